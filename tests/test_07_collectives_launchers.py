"""Lesson 7 under the launchers clusters use: each rank started alone (as torchrun, srun and mpirun start them),
meeting through the rendezvous their variables name. Real processes and real sockets on private ports, no GPU;
every process is stopped at the end of its test."""
from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gpucourse import ranks, runtime
from kernels.collectives import programs

pytestmark = pytest.mark.lesson07
ROOT = Path(__file__).resolve().parents[1]
PROGRAM = "kernels.collectives.programs:ring_allreduce_program"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env() -> dict:
    """This test's environment without any launcher's variables it may have been started under."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_", "SLURM_", "OMPI_",
            "PMI_", "PMIX_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env["GPUCOURSE_MODE"] = "cpu"
    return env


def _job(k: int, style: str, args, *, timeout: float = 30.0, out: Path | None = None, wait: float = 90.0):
    """Start k ranks of ``python -m gpucourse.ranks`` with the variables ``style`` ("env" or "slurm") sets; return
    [(exit code, stdout, stderr)] in rank order once all have ended (any still running after ``wait`` seconds is
    killed and reported as None)."""
    port = _free_port()
    procs = []
    try:
        for r in range(k):
            env = _clean_env()
            env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            if style == "env":
                env.update({"RANK": str(r), "WORLD_SIZE": str(k), "LOCAL_RANK": str(r)})
            else:
                env.update({"SLURM_PROCID": str(r), "SLURM_NTASKS": str(k), "SLURM_LOCALID": str(r)})
            cmd = [sys.executable, "-m", "gpucourse.ranks", *args, "--timeout", str(timeout)]
            if out is not None:
                cmd += ["--out", str(out)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        end = time.monotonic() + wait
        results = []
        for p in procs:
            try:
                o, e = p.communicate(timeout=max(0.1, end - time.monotonic()))
                results.append((p.returncode, o, e))
            except subprocess.TimeoutExpired:
                p.kill()
                o, e = p.communicate()
                results.append((None, o, e))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("style", ["env", "slurm"])
def test_ranks_started_alone_give_what_the_course_launcher_gives(tmp_path, style):
    k, n = 3, 37
    res = _job(k, style, [PROGRAM, str(n), "5"], out=tmp_path)
    assert all(rc == 0 for rc, _, _ in res), res
    got = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(k)]
    launched = ranks.launch(k, programs.ring_allreduce_program, n, 5, timeout=60)
    for r in range(k):
        np.testing.assert_array_equal(got[r], launched[r])
    launcher = "env" if style == "env" else "slurm"
    assert all(f"rank {r} of {k} ({launcher}, local rank {r})" in res[r][1] for r in range(k))


@pytest.mark.parametrize("bad, how", [(1, "raise"), (0, "raise"), (1, "kill"), (0, "kill")])
def test_a_rank_that_fails_stops_the_others_naming_it(bad, how):
    """Rank ``bad`` raises (it says so and exits 1) or is killed after the first exchange; the others learn at once
    that it is gone (its connection to the store closed; a killed rank 0 takes the store with it) and stop, naming
    it, long before their time-out."""
    start = time.monotonic()
    res = _job(3, "env", ["kernels.collectives.programs:failing_program", str(bad), how], timeout=60)
    took = time.monotonic() - start
    assert took < 30, f"the others took {took:.0f} s to stop (their time-out is 60 s: they should not wait it out)"
    if how == "raise":
        assert res[bad][0] == 1 and f"rank {bad} of 3 failed: ValueError: rank {bad} found a bad batch" in res[bad][2]
    else:
        assert res[bad][0] == -9
    says = "rank 0, which serves the rendezvous at 127.0.0.1" if (bad, how) == (0, "kill") else f"rank {bad} is gone"
    for r in set(range(3)) - {bad}:
        assert res[r][0] == 1, res[r]
        assert f"rank {r} of 3 failed: RankFailed: " in res[r][2] and says in res[r][2], res[r][2]


def test_a_rank_that_hangs_is_named_when_the_time_out_passes():
    # ranks 0 and 1 give up 3 s after the exchange rank 2 never reaches; 15 s leaves them room on a busy machine
    res = _job(3, "env", ["kernels.collectives.programs:failing_program", "2", "hang"], timeout=3, wait=15)
    assert res[2][0] is None  # still sleeping when the test killed it, as the cluster's launcher would
    for r in (0, 1):
        assert res[r][0] == 1
        assert "rank 2 did not reach the exchange" in res[r][2] and "within 3 s" in res[r][2], res[r][2]


def test_detect_reads_each_launchers_variables():
    base = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    job = ranks.detect({**base, "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"})
    assert (job.launcher, job.rank, job.k, job.local_rank, job.addr, job.port) == ("torchrun", 3, 8, 1, "node0", 29500)
    job = ranks.detect({**base, "SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5"})
    assert (job.launcher, job.rank, job.k, job.local_rank) == ("slurm", 5, 16, 5)
    job = ranks.detect({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert (job.launcher, job.rank, job.k, job.local_rank, job.addr) == ("mpi", 2, 4, 0, None)
    job = ranks.detect({"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert (job.launcher, job.rank, job.k, job.local_rank) == ("mpi", 1, 2, 1)
    with pytest.raises(runtime.CourseInputError, match="MASTER_ADDR and MASTER_PORT are not set"):
        ranks.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    with pytest.raises(runtime.CourseInputError, match="no launcher's variables"):
        ranks.detect({})
    with pytest.raises(runtime.CourseInputError, match="rank 4 of 4"):
        ranks.detect({**base, "RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(runtime.CourseInputError, match="not a whole number"):
        ranks.detect({**base, "RANK": "one", "WORLD_SIZE": "4"})


def _torchrun():
    exe = Path(sys.executable).with_name("torchrun")
    if not exe.exists():
        exe = shutil.which("torchrun")
    try:
        import torch.distributed  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"PyTorch is not importable ({exc}); torchrun's path runs where it is")
    if not exe:
        pytest.skip("torchrun is not installed")
    return str(exe)


def _torchrun_job(args, nproc=2, timeout=30):
    cmd = [_torchrun(), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port",
           str(_free_port()), "-m", "gpucourse.ranks", *args, "--timeout", str(timeout)]
    return subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=180)


def test_torchrun_starts_the_same_program(tmp_path):
    done = _torchrun_job([PROGRAM, "37", "5", "--out", str(tmp_path)])
    assert done.returncode == 0, done.stderr[-3000:]
    launched = ranks.launch(2, programs.ring_allreduce_program, 37, 5, timeout=60)
    for r in range(2):
        np.testing.assert_array_equal(pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()), launched[r])
    assert "rank 1 of 2 (torchrun, local rank 1)" in done.stdout


def test_torchrun_stops_the_job_when_a_rank_fails():
    start = time.monotonic()
    done = _torchrun_job(["kernels.collectives.programs:failing_program", "1", "raise"], timeout=60)
    assert done.returncode != 0
    assert "rank 1 of 2 failed: ValueError: rank 1 found a bad batch" in done.stderr
    assert time.monotonic() - start < 60, "torchrun waited for the other rank's time-out"


def _needs(launcher: str):
    if launcher not in ranks.available_launchers():
        pytest.skip(f"{launcher} is not installed here (with mpi4py for mpirun); it runs where it is")


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun", "srun's variables"])
def test_every_launcher_gives_what_the_course_launcher_gives(launcher):
    _needs(launcher)
    run = ranks.run_under(launcher, 2, PROGRAM, [37, 5], env={"GPUCOURSE_MODE": "cpu", "PYTHONPATH": str(ROOT)})
    assert run["returncode"] == 0, run["lines"]
    launched = ranks.launch(2, programs.ring_allreduce_program, 37, 5, timeout=60)
    for got, want in zip(run["results"], launched):
        np.testing.assert_array_equal(got, want)
    who = {"torchrun": "torchrun", "mpirun": "mpi", "srun's variables": "slurm"}[launcher]
    assert any(f"rank 1 of 2 ({who}, local rank 1)" in ln for ln in run["lines"]), run["lines"]


def test_mpirun_stops_the_job_when_a_rank_fails():
    _needs("mpirun")
    start = time.monotonic()
    run = ranks.run_under("mpirun", 2, "kernels.collectives.programs:failing_program", [1, "raise"],
                          timeout=60, env={"GPUCOURSE_MODE": "cpu", "PYTHONPATH": str(ROOT)})
    assert run["returncode"] != 0 and run["results"] == [None, None]
    assert any("rank 1 of 2 failed: ValueError: rank 1 found a bad batch" in ln for ln in run["lines"]), run["lines"]
    assert time.monotonic() - start < 60, "mpirun waited for the other rank's time-out"

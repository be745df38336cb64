"""Lesson 7, one process per GPU: the launcher's rendezvous and its failure path, with real processes (no GPU
needed), and on a machine with two or more GPUs NCCL and the course's ring across processes."""
from __future__ import annotations

import time

import numpy as np
import pytest

from gpucourse import runtime
from kernels import collectives as col
from gpucourse import ranks
from kernels.collectives import programs

pytestmark = pytest.mark.lesson07


def _alive_children():
    import multiprocessing

    return [p for p in multiprocessing.active_children() if p.name.startswith("rank-")]


@pytest.mark.parametrize("k", [1, 3, 4])
def test_ring_allreduce_in_k_processes_equals_one_process(k):
    n = 37  # chunks of unequal size
    got = ranks.launch(k, programs.ring_allreduce_program, n, 5, timeout=60)
    want = programs.expected_sum(k, n, seed=5)
    single = col.ring_allreduce_numpy([programs.rank_data(r, n, 5).astype(np.float64) for r in range(k)])
    assert len(got) == k
    for r in range(k):
        np.testing.assert_allclose(got[r], want, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(got[r], single[r])  # the same additions in the same order
    assert not _alive_children()


@pytest.mark.parametrize("how, says", [
    ("raise", r"rank 1 failed while working after exchange #1: ValueError: rank 1 found a bad batch"),
    ("exit", r"rank 1 exited with code 7 while working after exchange #1"),
    ("kill", r"rank 1 was killed by signal 9 \(SIGKILL\) while working after exchange #1"),
    ("hang", r"rank 1 did not answer in time \(it was working after exchange #1\)"),
])
def test_a_failed_rank_stops_the_others_with_a_clear_error(how, says):
    start = time.monotonic()
    with pytest.raises(ranks.RankFailed, match=says) as info:
        ranks.launch(3, programs.failing_program, 1, how, timeout=4)
    took = time.monotonic() - start
    assert info.value.rank == 1
    assert "rank 0 waiting in exchange #2" in str(info.value) and "rank 2 waiting in exchange #2" in str(info.value)
    assert took < 4 + 2 * ranks.STOP_GRACE + 30, f"the others were not stopped promptly ({took:.0f} s)"
    assert not _alive_children(), "a rank was left behind"


def test_launch_refuses_bad_input():
    with pytest.raises(runtime.CourseInputError, match="k must be"):
        ranks.launch(0, programs.ring_allreduce_program, 4)
    with pytest.raises(runtime.CourseInputError, match="timeouts must be positive"):
        ranks.launch(2, programs.ring_allreduce_program, 4, timeout=0)
    with pytest.raises(runtime.CourseInputError, match="importable module"):
        ranks.launch(2, lambda group: None)


def _gpus() -> int:
    return col.gpu_count() if runtime.is_gpu() else 0


@pytest.mark.gpu
@pytest.mark.parametrize("program", ["nccl", "ipc_ring"])
def test_allreduce_one_process_per_gpu_equals_one_process(program):
    k = _gpus()
    if k < 2:
        pytest.skip(f"needs two or more GPUs; this machine has {k}")
    n = 3 * 2**20 + 5
    fn = programs.nccl_allreduce_program if program == "nccl" else programs.ipc_ring_allreduce_program
    got = ranks.launch(k, fn, n, 3, timeout=120)
    want = programs.expected_sum(k, n, seed=3)
    for r in range(k):
        err = np.abs(got[r]["result"].astype(np.float64) - want).max()
        assert err <= 1e-5 * k * max(1.0, np.abs(want).max()), (program, r, err)
    assert not _alive_children()

"""Lesson 7: the chunked multi-stream pipeline, small launches, the dynamic batcher, the MPS daemon wrapper
(against a stub daemon: a real process, started and stopped), the ncu helper's parser and its "missing" path,
and the NVML sampler. GPU-marked tests run the real thing on a GPU."""
from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from gpucourse import monitor, profile, runtime
from kernels import batching as B
from kernels import mps
from kernels import streams as S

pytestmark = pytest.mark.lesson07
DATA = Path(__file__).resolve().parent / "data"


# ------------------------------------------------------------------------------------- the pipeline

@pytest.mark.parametrize("n, chunks, streams", [(96, 1, 1), (96, 4, 2), (96, 6, 3), (90, 3, 4), (64, 8, 8)])
def test_pipeline_matches_numpy(rng, n, chunks, streams):
    a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    out = np.full(n, np.nan, np.float32)
    p = S.Pipeline(n, chunks=chunks, streams=streams, blocks=2, threads=8)
    run = p.run(a, b, out, timeline=True)
    np.testing.assert_array_equal(out, S.multiply_spec(a, b))
    if not runtime.is_gpu():
        assert run.timeline is None and run.total_ms is None


def test_pipelined_multiply_reference(rng):
    a, b = (rng.standard_normal(40).astype(np.float32) for _ in range(2))
    out = np.zeros(40, np.float32)
    S.pipelined_multiply(a, b, out, chunks=5, streams=2)
    np.testing.assert_array_equal(out, a * b)


@pytest.mark.parametrize("n, chunks, streams, message", [
    (100, 3, 1, "3 chunks do not divide n = 100"), (100, 4, 0, "streams must be at least 1"),
    (100, 0, 1, "chunks must be at least 1"), (100, 2.0, 1, "chunks must be an int"), (0, 1, 1, "at least one")])
def test_pipeline_refuses_bad_splits(n, chunks, streams, message):
    with pytest.raises(runtime.CourseInputError, match=message):
        S.check_pipeline(n, chunks, streams)


def test_pipeline_refuses_bad_arrays():
    p = S.Pipeline(8, chunks=2, streams=1)
    good = np.ones(8, np.float32)
    with pytest.raises(runtime.CourseInputError, match="float32"):
        p.run(good, np.ones(8), good)
    with pytest.raises(runtime.CourseInputError, match="made for n = 8"):
        p.run(*(np.ones(4, np.float32) for _ in range(3)))
    with pytest.raises(runtime.CourseInputError, match="same size"):
        p.run(good, np.ones(4, np.float32), good)


def test_pipeline_refuses_sizes_beyond_memory():
    with pytest.raises(runtime.CourseInputError, match="GiB|MiB"):
        S.Pipeline(2**40, chunks=1, streams=1)


def test_chunk_bounds_cover_the_vector():
    assert [S.chunk_bounds(12, 3, i) for i in range(3)] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(runtime.CourseInputError, match="chunk 3 does not exist"):
        S.chunk_bounds(12, 3, 3)


def test_overlap_fraction():
    serial = [{"h2d": [0, 1], "kernel": [1, 2], "d2h": [2, 3]}, {"h2d": [3, 4], "kernel": [4, 5], "d2h": [5, 6]}]
    assert S.overlap_fraction(serial) == 0
    overlapped = [{"h2d": [0, 2], "kernel": [2, 3], "d2h": [3, 4]}, {"h2d": [2, 4], "kernel": [4, 5], "d2h": [5, 6]}]
    assert S.overlap_fraction(overlapped) == pytest.approx(2 / 6)  # [2, 4): two stages at once


@pytest.mark.parametrize("streams", [1, 2, 4])
def test_small_launches_count(streams):
    cuda = runtime.cuda()
    x = cuda.to_device(np.zeros(8, np.float32))
    S.small_launches(x, launches=6, streams=streams)
    part = 8 // streams
    want = np.repeat([sum(1 for i in range(6) if i % streams == k) for k in range(streams)], part)
    np.testing.assert_array_equal(x.copy_to_host(), want)
    with pytest.raises(runtime.CourseInputError, match="do not divide"):
        S.small_launches(x, launches=1, streams=3)


# ------------------------------------------------------------------------------------------ batching

def test_latency_summary_matches_numpy(rng):
    s = rng.uniform(1, 3, 200)
    got = B.latency_summary(s, 8)
    assert got["p50_ms"] == pytest.approx(np.median(s)) and got["p99_ms"] == pytest.approx(np.percentile(s, 99))
    assert got["images_per_s"] == pytest.approx(8e3 / np.median(s))
    with pytest.raises(runtime.CourseInputError):
        B.latency_summary([], 1)
    with pytest.raises(runtime.CourseInputError):
        B.latency_summary([1.0], 0)


def test_dynamic_batching_by_hand():
    r = B.dynamic_batching([0, 0.1, 0.2, 5], lambda n: 1.0, max_batch=2, max_wait=0.5)
    np.testing.assert_allclose(r["latency_s"], [1.1, 1.0, 1.9, 1.5])
    assert list(r["batch_sizes"]) == [2, 1, 1]
    assert r["throughput_per_s"] == pytest.approx(4 / 6.5)


def _event_by_event_batching(t, service, max_batch, max_wait):
    """The same rule checked at every moment something can change (an arrival, a deadline, the server
    freeing up): the first such moment at which a free server may start a batch starts it."""
    t = list(t)
    done, free, lat, sizes = 0, 0.0, np.zeros(len(t)), []
    moments = set(t) | {x + max_wait for x in t}
    while done < len(t):
        for c in sorted(m for m in moments | {free} if m >= free):
            waiting = [j for j in range(done, len(t)) if t[j] <= c][:max_batch]
            if waiting and (len(waiting) == max_batch or c >= t[done] + max_wait):
                end = c + service(len(waiting))
                lat[waiting] = end - np.array(t)[waiting]
                sizes.append(len(waiting))
                done, free = done + len(waiting), end
                break
    return lat, sizes


@pytest.mark.parametrize("max_batch, max_wait", [(1, 0.0), (4, 0.01), (8, 0.05), (16, 0.2)])
def test_dynamic_batching_against_an_event_by_event_check(max_batch, max_wait):
    t = B.poisson_arrivals(200, 60, seed=max_batch)
    service = lambda n: 0.004 + 0.001 * n  # noqa: E731
    got = B.dynamic_batching(t, service, max_batch=max_batch, max_wait=max_wait)
    lat, sizes = _event_by_event_batching(t, service, max_batch, max_wait)
    assert list(got["batch_sizes"]) == sizes
    np.testing.assert_allclose(got["latency_s"], lat, rtol=1e-12)
    assert max(sizes) <= max_batch and (max_batch == 1 or max(sizes) > 1)


def test_dynamic_batching_refuses_bad_input():
    with pytest.raises(runtime.CourseInputError, match="non-decreasing"):
        B.dynamic_batching([1, 0], lambda n: 1, max_batch=1, max_wait=0)
    with pytest.raises(runtime.CourseInputError, match="max_batch"):
        B.dynamic_batching([0], lambda n: 1, max_batch=0, max_wait=0)


# ------------------------------------------------------------------------------------ the MPS daemon

STUB = '''#!{python}
import os, signal, sys, time
pipe, log = os.environ["CUDA_MPS_PIPE_DIRECTORY"], os.environ["CUDA_MPS_LOG_DIRECTORY"]
pidfile, mode = os.path.join(pipe, "stub.pid"), "{mode}"
if sys.argv[1:] == ["-d"]:
    if mode == "fail":
        with open(os.path.join(log, "control.log"), "a") as f:
            f.write("[2026-11-22 16:00:00.000 Control 1] Failed to start: no CUDA-capable device is detected\\n")
        sys.exit(1)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            fd = os.open(os.devnull, os.O_RDWR)
            for k in (0, 1, 2):
                os.dup2(fd, k)
            if mode == "stubborn":
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with open(pidfile, "w") as f:
                f.write(str(os.getpid()))
            while True:
                time.sleep(0.05)
        os._exit(0)
    os.wait()
    sys.exit(0)
command = sys.stdin.read().strip()
if mode == "mute":
    time.sleep(30)
if not os.path.exists(pidfile):
    sys.exit(1)
if command == "quit" and mode != "stubborn":
    os.kill(int(open(pidfile).read()), signal.SIGTERM)
'''


def stub(tmp_path, mode: str) -> str:
    path = tmp_path / f"mps-stub-{mode}"
    path.write_text(STUB.format(python=sys.executable, mode=mode))
    path.chmod(0o755)
    return str(path)


def test_mps_daemon_starts_and_stops(tmp_path):
    d = mps.Daemon(stub(tmp_path, "ok"), timeout=5)
    with d:
        pipe = d.pipe_dir
        pids = mps.processes_with(mps.PIPE, pipe)
        assert len(pids) == 1, "the stub daemon should be running"
        assert d.client_env()[mps.PIPE] == pipe and d.client_env()[mps.LOG] == d.log_dir
    assert mps.processes_with(mps.PIPE, pipe) == []
    assert not os.path.exists(pipe)
    d.stop()  # twice is harmless


def test_mps_daemon_failure_says_why_and_leaves_nothing(tmp_path):
    before = set(tmp_path.parent.iterdir())
    with pytest.raises(mps.MPSUnavailable, match="no CUDA-capable device is detected"):
        mps.Daemon(stub(tmp_path, "fail"), timeout=5).start()
    ok, why = mps.running(stub(tmp_path, "fail"))
    assert not ok and "Failed to start" in why
    assert set(tmp_path.parent.iterdir()) == before


def test_mps_daemon_that_never_answers_times_out_and_is_stopped(tmp_path):
    d = mps.Daemon(stub(tmp_path, "mute"), timeout=1.5)
    t0 = time.monotonic()
    with pytest.raises(mps.MPSUnavailable, match="did not answer within"):
        d.start()
    assert time.monotonic() - t0 < 20
    assert d.pipe_dir is None


def test_mps_daemon_that_ignores_quit_is_killed(tmp_path):
    d = mps.Daemon(stub(tmp_path, "stubborn"), timeout=1)
    d.start()
    pipe = d.pipe_dir
    assert mps.processes_with(mps.PIPE, pipe)
    d.stop()
    assert mps.processes_with(mps.PIPE, pipe) == []


def test_mps_missing_binary(tmp_path):
    ok, why = mps.running(str(tmp_path / "no-such-mps-control"))
    assert not ok and "was not found" in why


# ---------------------------------------------------------------------------------------- profiling

def test_ncu_csv_parser_reads_a_captured_sample():
    rows = profile.parse_csv((DATA / "ncu_sample.csv").read_text())
    assert rows and all("kernel" in r and r["units"] for r in rows)
    dram = [r["dram__throughput.avg.pct_of_peak_sustained_elapsed"] for r in rows
            if "dram__throughput.avg.pct_of_peak_sustained_elapsed" in r]
    assert dram and all(isinstance(v, float) and 0 <= v <= 100 for v in dram)


def test_ncu_parser_says_when_counters_are_restricted():
    text = "==PROF== Connected to process 1\n==ERROR== ERR_NVGPUCTRPERM - The user does not have permission\n"
    with pytest.raises(profile.ProfilerUnavailable, match="restricted"):
        profile.parse_csv(text)
    with pytest.raises(profile.ProfilerUnavailable, match="no kernel was profiled"):
        profile.parse_csv("hello\n==PROF== Disconnected\n")


def test_ncu_missing(monkeypatch):
    monkeypatch.setattr(profile, "find_ncu", lambda: None)
    with pytest.raises(profile.ProfilerUnavailable, match="not installed"):
        profile.ncu("print(1)")


# ---------------------------------------------------------------------------------------- monitoring

def test_sampler_samples_in_the_background():
    calls = []

    def read():
        calls.append(1)
        return dict.fromkeys(monitor.FIELDS, float(len(calls)))

    with monitor.Sampler(read, interval_s=0.01) as s:
        s.mark("work")
        time.sleep(0.2)
    n = len(s.samples)
    assert n >= 5 and s.marks[0]["label"] == "work"
    assert all(s.samples[i]["t"] < s.samples[i + 1]["t"] for i in range(n - 1))
    time.sleep(0.05)
    assert len(s.samples) == n, "sampling must stop with the block"


def test_sampler_reports_a_failing_reader():
    def read():
        raise OSError("NVML gone")

    s = monitor.Sampler(read, interval_s=0.01).start()
    time.sleep(0.05)
    with pytest.raises(runtime.CourseError, match="NVML gone"):
        s.stop()


# ---------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_gpu_pipeline_overlaps():
    n = 2**24
    a, b, out = S.pinned(n), S.pinned(n), S.pinned(n)
    a[:], b[:] = np.random.default_rng(0).random(n, dtype=np.float32), 2.0
    run1 = S.Pipeline(n, chunks=8, streams=1).run(a, b, out, timeline=True)
    np.testing.assert_array_equal(out, a * b)
    run4 = S.Pipeline(n, chunks=8, streams=4).run(a, b, out, timeline=True)
    np.testing.assert_array_equal(out, a * b)
    for run, streams in ((run1, 1), (run4, 4)):  # a well-formed timeline: each chunk's stages in order
        assert [r["chunk"] for r in run.timeline] == list(range(8))
        assert [r["stream"] for r in run.timeline] == [i % streams for i in range(8)]
        for r in run.timeline:
            assert 0 <= r["h2d"][0] <= r["h2d"][1] <= r["kernel"][1] <= r["d2h"][1] <= run.total_ms + 1e-3
    assert S.overlap_fraction(run1.timeline) < 0.05  # one stream: its stages one after another
    # How much the streams overlap is a measurement, not a unit test: chunks this small (8 MiB) have been seen
    # issued one after another on an H100 now and then. The goal is judged on the record
    # (test_recorded_overlap_meets_the_goal), measured at 2 GiB in 64 MiB chunks.


def test_recorded_overlap_meets_the_goal():
    """Issue goal on the committed GPU records: the pipelined total within 1.15x the longer copy direction
    alone, one stream running its stages one after another and more streams overlapping them."""
    from gpucourse import records

    recs = records.all_records("07_feeding_the_gpu")
    if not recs:
        pytest.skip("no GPU record of lesson 7 in results/ yet")
    for rec in recs:
        o = rec["figures"]["overlap"]
        assert o["best"]["ratio_to_longer_copy"] <= 1.15 and o["best"]["met"], (rec["gpu"]["name"], o["best"])
        assert o["runs"]["1"]["overlap_fraction"] < 0.05
        assert max(r["overlap_fraction"] for k, r in o["runs"].items() if k != "1") > 0.5


@pytest.mark.gpu
def test_gpu_small_kernels_three_ways():
    k = S.SmallKernels(n=1024, launches=50, streams=4)
    k.one_stream()
    k.many_streams()
    k.graph_replay()
    runtime.cupy().cuda.Device().synchronize()
    assert k.value() == 50 + 50 // 4 + (1 if 50 % 4 > 0 else 0) + 50


@pytest.mark.gpu
def test_gpu_managed_memory_is_shared():
    cp = runtime.cupy()
    x = S.managed_array(1024)
    h = S.host_view(x)
    h[:] = np.arange(1024, dtype=np.float32)
    S.prefetch(x)
    x *= 2
    cp.cuda.Device().synchronize()
    np.testing.assert_array_equal(h, 2 * np.arange(1024, dtype=np.float32))


@pytest.mark.gpu
def test_gpu_sampler_reads_nvml():
    with monitor.Sampler(interval_s=0.02) as s:
        time.sleep(0.2)
    assert s.samples and set(monitor.FIELDS) <= set(s.samples[0])

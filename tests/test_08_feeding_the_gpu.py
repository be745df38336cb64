"""Lesson 8: the chunked multi-stream pipeline, small launches, the dynamic batcher, the MPS daemon wrapper
(against a stub daemon: a real process, started and stopped), the ncu helper's parser and its "missing" path,
and the NVML sampler. GPU-marked tests run the real thing on a GPU."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gpucourse import monitor, profile, runtime
from systems.feeding_the_gpu import batching as B
from gpucourse import mps
from kernels import feeding_the_gpu as S

pytestmark = pytest.mark.lesson08
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


def _pipeline(a, b, out, chunks, streams, *, shared=False, wait="every stream"):
    """A learner's pipeline, right by default; ``shared``: one set of buffers for all streams; ``wait``: which
    streams it waits for before returning."""
    cuda = runtime.cuda()
    size = S.check_pipeline(a.size, chunks, streams)
    made = [cuda.stream() for _ in range(streams)]
    buffers = [[cuda.device_array(size, np.float32) for _ in range(3)] for _ in range(streams)]
    for i in range(chunks):
        s = made[i % streams]
        da, db, dout = buffers[0 if shared else i % streams]
        lo, hi = i * size, (i + 1) * size
        da.copy_to_device(a[lo:hi], stream=s)
        db.copy_to_device(b[lo:hi], stream=s)
        S.multiply_kernel[4, 128, s](da, db, dout)
        dout.copy_to_host(out[lo:hi], stream=s)
    for s in {"every stream": made, "the first": made[:1], "none": [], "the device": []}[wait]:
        s.synchronize()
    if wait == "the device":
        cuda.synchronize()


@pytest.mark.skipif(runtime.is_gpu(), reason="the simulator's streams; on a GPU the block changes nothing")
@pytest.mark.parametrize("how, wrong, pending", [
    ({}, 0, 0), ({"wait": "the device"}, 0, 0), ({"shared": True}, 512, 0),
    ({"wait": "none"}, 1024, 16), ({"wait": "the first"}, 256, 1)])
def test_streams_run_together_in_the_simulator(how, wrong, pending):
    """Streams that share buffers, or are not all waited for, go wrong in CPU mode too, as on a GPU."""
    from systems.feeding_the_gpu.stream_sim import streams_run_together

    n = 1024
    a, b, out = S.pinned(n), S.pinned(n), S.pinned(n)
    a[:], b[:], out[:] = np.arange(n), 2.0, np.nan
    _pipeline(a, b, out, 4, 2, **how)  # outside the block: the simulator runs everything at once
    assert np.array_equal(out, a * b)
    out[:] = np.nan
    with streams_run_together() as sim:
        _pipeline(a, b, out, 4, 2, **how)
    assert int(np.sum(~(out == a * b))) == wrong and sim.pending == pending
    with streams_run_together() as sim:  # the lesson's own pipeline, on three streams
        out[:] = np.nan
        S.pipelined_multiply(a, b, out, chunks=4, streams=3)
    assert np.array_equal(out, a * b) and sim.pending == 0


@pytest.mark.skipif(runtime.is_gpu(), reason="the simulator's streams")
def test_streams_run_together_keep_events_and_the_default_stream():
    from systems.feeding_the_gpu.stream_sim import streams_run_together

    cuda = runtime.cuda()
    h = np.arange(8, dtype=np.float32)
    with streams_run_together() as sim:
        s0, s1 = cuda.stream(), cuda.stream()
        x = cuda.device_array(8, np.float32)
        x.copy_to_device(h, stream=s0)
        ev = cuda.event()
        ev.record(s0)
        ev.wait(s1)  # s1's kernel must not run before s0's copy
        S.multiply_kernel[1, 32, s1](x, x, x)
        got = x.copy_to_host(stream=s1)
        assert sim.ran == 0 and sum(len(q) for q in sim.queues.values()) == 5  # queued, nothing run yet
        s1.synchronize()
        assert np.array_equal(got, h * h)
        x.copy_to_device(h, stream=s0)
        assert np.array_equal(x.copy_to_host(), h)  # the default stream waits for every stream first
        again = cuda.event()
        again.record(s0)
        S.multiply_kernel[1, 32, s0](x, x, x)  # x = h^2, after the first record
        again.record(s0)
        S.multiply_kernel[1, 32, s0](x, x, x)  # x = h^4
        again.wait(s1)  # binds to the second record: s1 reads h^2, not h or h^4
        later = x.copy_to_host(stream=s1)
        cuda.synchronize()
        assert sim.ran > 0 and sim.pending == 0
    assert not np.array_equal(later, h), "s1 copied x before s0 reached the record it waited for"
    assert np.array_equal(later, h**2) or np.array_equal(later, h**4)  # after that, either is a GPU's choice
    x = cuda.device_array(4, np.float32)  # after the block, the simulator's own streams again
    x.copy_to_device(np.ones(4, np.float32), stream=cuda.stream())
    assert np.array_equal(x.copy_to_host(), np.ones(4))


def test_engine_timeline_queues_copies_of_one_direction():
    """Two streams reach their copies in at once; the engine takes the second when the first is done."""
    events = [{"chunk": 0, "stream": 0, "h2d": [0, 2], "kernel": [2, 3], "d2h": [3, 4]},
              {"chunk": 1, "stream": 1, "h2d": [0, 4], "kernel": [4, 5], "d2h": [5, 6]}]
    assert S.overlap_fraction(events) == pytest.approx(4 / 6)  # the bars: the two copies in look overlapped too
    ran = S.engine_timeline(events)
    assert ran[1]["h2d"] == [2, 4] and ran[1]["h2d_queued"] == [0, 2] and "h2d_queued" not in ran[0]
    assert ran[0]["d2h"] == [3, 4] and ran[1]["kernel"] == [4, 5] and events[1]["h2d"] == [0, 4]
    assert S.overlap_fraction(ran) == pytest.approx(2 / 6)  # what really ran together: [2, 4)
    late = [{"chunk": 0, "stream": 0, "h2d": [0, 1], "kernel": [1, 2], "d2h": [2, 3]},
            {"chunk": 1, "stream": 1, "h2d": [5, 6], "kernel": [6, 7], "d2h": [7, 8]}]
    assert S.engine_timeline(late) == late  # nothing waited


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


def test_dynamic_batching_counts_the_servers_busy_time_and_refuses_nonsense():
    service = lambda n: 1e-3 + 1e-5 * n  # noqa: E731
    r = B.dynamic_batching(B.poisson_arrivals(500, 300, seed=1), service, max_batch=16, max_wait=0.002)
    assert r["busy_s"] == pytest.approx(sum(service(n) for n in r["batch_sizes"]))
    assert 0 < r["busy_s"] <= r["span_s"]
    for bad in (float("nan"), float("inf")):
        with pytest.raises(runtime.CourseInputError, match="max_wait must be a finite time"):
            B.dynamic_batching([0.0, 1.0], service, max_batch=2, max_wait=bad)
    with pytest.raises(runtime.CourseInputError, match="finite times"):
        B.dynamic_batching([0.0, float("inf")], service, max_batch=2, max_wait=0)
    with pytest.raises(runtime.CourseInputError, match=r"service\(1\) returned nan"):
        B.dynamic_batching([0.0], lambda n: float("nan"), max_batch=2, max_wait=0)


def test_batcher_table_shows_the_trade_off():
    """Above batch 1's capacity one request at a time falls behind and batching keeps up; a maximum wait
    makes batches larger and leaves the GPU idle more of the time, for more latency."""
    import benchmarks.feeding_the_gpu as lesson
    from systems.feeding_the_gpu import serving

    service = lambda n: 1e-4 + 2e-7 * n  # noqa: E731  batch 1: 10k requests/s
    rows = serving.batcher_table(service, [5000, 40000], waits_ms=(0.0, 1.0), max_batch=64, count=1500)
    by = {(r["rate_per_s"], r["max_batch"], r["max_wait_ms"]): r for r in rows}
    assert len(rows) == 6
    alone, now, waited = by[(40000, 1, 0.0)], by[(40000, 64, 0.0)], by[(40000, 64, 1.0)]
    assert alone["throughput_per_s"] < 11000 and alone["p99_ms"] > 50 * now["p99_ms"]
    assert now["throughput_per_s"] > 35000 and now["mean_batch"] > 1.5
    assert waited["mean_batch"] > 3 * now["mean_batch"] and waited["gpu_busy"] < 0.6 * now["gpu_busy"]
    assert waited["p99_ms"] > now["p99_ms"]
    assert by[(5000, 1, 0.0)]["p99_ms"] < 1.0  # half of capacity: one at a time keeps up
    text = "\n".join(lesson.batcher_lines(rows))
    assert "one at a time" in text and "at 40,000 req/s: one at a time p99" in text
    lesson.plot_batcher({"rows": rows, "max_batch": 64}, "test")
    old = [{k: v for k, v in r.items() if k not in ("gpu_busy", "max_batch")} for r in rows if r["max_batch"] > 1]
    lesson.plot_batcher({"rows": old, "max_batch": 64}, "a record made before the busy share was kept")
    assert "GPU busy" not in "\n".join(lesson.batcher_lines(old))


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


def test_mps_log_tail_reads_the_server_log_too(tmp_path):
    d = mps.Daemon(stub(tmp_path, "ok"), timeout=5)
    assert d.last_log == "" and d.log_tail() == ""
    with d:
        assert d.log_tail() == ""
        (Path(d.log_dir) / "control.log").write_text("c1\nc2\n\nc3\nc4\n")
        (Path(d.log_dir) / "server.log").write_text("[Server 7] Failed to create the CUDA context\n")
        assert d.log_tail(2) == "control.log: c3 | c4; server.log: [Server 7] Failed to create the CUDA context"
    assert "server.log: [Server 7] Failed" in d.last_log and "c1" in d.last_log


def test_mps_daemon_puts_the_signal_handlers_back(tmp_path):
    import signal

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
    with mps.Daemon(stub(tmp_path, "ok"), timeout=5):
        assert signal.getsignal(signal.SIGTERM) not in (before[0], signal.SIG_DFL)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == before
    with pytest.raises(mps.MPSUnavailable):
        mps.Daemon(stub(tmp_path, "fail"), timeout=5).start()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == before


ROOT = Path(__file__).resolve().parents[1]
SIGTERMED = '''
import sys, time
from gpucourse import mps
with mps.Daemon(sys.argv[1], timeout=5) as d:
    print(d.pipe_dir, d.log_dir, flush=True)
    time.sleep(60)
'''


def _line_within(p, seconds: float) -> str:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=seconds), f"no line within {seconds} s; stderr: {p.stderr.read() if p.poll() else ''}"
    return p.stdout.readline()


def test_mps_sigterm_to_the_benchmark_stops_the_daemon(tmp_path):
    import shutil
    import signal
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", SIGTERMED, stub(tmp_path, "ok")], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    pipe = log = None
    try:
        pipe, log = _line_within(p, 15).split()
        assert mps.processes_with(mps.PIPE, pipe), "the stub daemon should be running"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=15) == 128 + signal.SIGTERM
        assert "SIGTERM received: stopping the MPS daemon" in p.stderr.read()
        assert mps.processes_with(mps.PIPE, pipe) == []
        assert not os.path.exists(pipe) and not os.path.exists(log)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
        p.stderr.close()
        if pipe:  # what a failing run would leave behind
            for pid in mps.processes_with(mps.PIPE, pipe):
                os.kill(pid, signal.SIGKILL)
            shutil.rmtree(pipe, ignore_errors=True)
            shutil.rmtree(log, ignore_errors=True)


# Fake MPS clients for run_clients / mps_sweep: say "ready", wait for "go", print a JSON line like the real client.
# Each notes where it was run (its MPS pipe folder, whether the folder existed and was empty, its batch) in a file
# under $FAKE_CLIENT_NOTES. With FAKE_CLIENT_FAIL=<batch>, a client of that batch under the stub daemon (its pipe
# folder holds stub.pid) writes a line to the MPS server's log and fails, as one that cannot reach the server.
FAKE_CLIENT = '''
import json, os, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
batch, pipe = int(args["--batch"]), os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "")
notes = os.environ.get("FAKE_CLIENT_NOTES")
if notes:
    with open(os.path.join(notes, str(os.getpid())), "w") as f:
        json.dump({"pipe": pipe, "existed": os.path.isdir(pipe), "empty": os.path.isdir(pipe) and not os.listdir(pipe),
                   "batch": batch}, f)
if os.environ.get("FAKE_CLIENT_FAIL") == str(batch) and os.path.exists(os.path.join(pipe, "stub.pid")):
    with open(os.path.join(os.environ["CUDA_MPS_LOG_DIRECTORY"], "server.log"), "a") as f:
        f.write("[Server 42] Failed to create the CUDA context: out of memory\\n")
    sys.exit("cannot reach the MPS server")
print("loading the plan", file=sys.stderr, flush=True)
print("ready", flush=True)
assert sys.stdin.readline().strip() == "go"
print(json.dumps({"inferences": 10, "images": 10 * batch, "seconds": 0.01, "images_per_s": 100.0 * batch}), flush=True)
'''
STUCK_CLIENT = 'import sys, time; print("waiting for the MPS server", file=sys.stderr, flush=True); time.sleep(60)'


def _fake_env(tmp_path, **extra) -> dict:
    return dict(os.environ, FAKE_CLIENT_MARK=str(tmp_path), **extra)


def test_run_clients_sums_the_fake_clients(tmp_path):
    from systems.feeding_the_gpu import serving

    r = serving.run_clients(3, "plan.npz", 2, 0.1, _fake_env(tmp_path), cmd=[sys.executable, "-c", FAKE_CLIENT])
    assert r == {"clients": 3, "batch": 2, "images_per_s": 600.0, "per_client": [200.0] * 3}
    assert mps.processes_with("FAKE_CLIENT_MARK", str(tmp_path)) == []


def test_run_clients_times_out_a_client_that_never_gets_ready(tmp_path):
    from systems.feeding_the_gpu import serving

    t0 = time.monotonic()
    with pytest.raises(runtime.CourseError, match=r'client 1 of 2 \(batch 1\) did not say "ready" within 1.5 s'
                                                  r'.*waiting for the MPS server'):
        serving.run_clients(2, "plan.npz", 1, 0.1, _fake_env(tmp_path), timeout=1.5,
                            cmd=[sys.executable, "-c", STUCK_CLIENT])
    assert time.monotonic() - t0 < 10
    assert mps.processes_with("FAKE_CLIENT_MARK", str(tmp_path)) == [], "the stuck clients must be killed"


def test_run_clients_reports_a_client_that_fails(tmp_path):
    from systems.feeding_the_gpu import serving

    with pytest.raises(runtime.CourseError, match=r"client 1 of 2 \(batch 1\) ended \(exit status 1\) before.*no GPU"):
        serving.run_clients(2, "plan.npz", 1, 0.1, _fake_env(tmp_path), timeout=10,
                            cmd=[sys.executable, "-c", "import sys; sys.exit('no GPU')"])
    assert mps.processes_with("FAKE_CLIENT_MARK", str(tmp_path)) == []


def fake_client(plan_path, batch, seconds):
    """A client function defined outside serving.py, as a notebook cell defines one: the processes run its source."""
    print("ready", flush=True)
    sys.stdin.readline()
    return {"inferences": 1, "images": batch, "seconds": seconds, "images_per_s": 1000.0 * batch + len(plan_path)}


def test_run_clients_runs_a_client_function_from_its_source(tmp_path):
    """The processes run the function given (a notebook's edited client), not serving.client, through the module's
    own entry point; a client that cannot be run from its source is refused with the reason."""
    from systems.feeding_the_gpu import serving

    r = serving.run_clients(2, "plan.npz", 3, 0.1, _fake_env(tmp_path), timeout=60, client=fake_client)
    assert r == {"clients": 2, "batch": 3, "images_per_s": 2 * 3008.0, "per_client": [3008.0, 3008.0]}
    assert serving.client_command(serving.client)[1:] == ["-m", "systems.feeding_the_gpu.serving", "client"]
    assert serving.client_command(None) == serving.client_command(serving.client)
    script = serving.client_command(fake_client)[2]
    assert "def fake_client(plan_path, batch, seconds):" in script and "main(client_fn=fake_client)" in script
    for bad, why in ((lambda p, b, s: {}, "defined with def"), (print, "defined with def")):
        with pytest.raises(runtime.CourseInputError, match=why):
            serving.client_command(bad)
    with pytest.raises(runtime.CourseInputError, match="not both"):
        serving.run_clients(1, "plan.npz", 1, 0.1, _fake_env(tmp_path), cmd=["true"], client=fake_client)


def _notes(folder: Path) -> list:
    import json

    return [json.loads(p.read_text()) for p in folder.iterdir()]


def test_mps_sweep_with_fake_clients_and_the_stub_daemon(tmp_path, monkeypatch):
    import benchmarks.feeding_the_gpu as lesson

    notes = tmp_path / "notes"
    notes.mkdir()
    monkeypatch.setenv("FAKE_CLIENT_NOTES", str(notes))
    monkeypatch.setenv(mps.PIPE, str(tmp_path / "a-system-wide-daemon"))  # must not reach the no-MPS clients
    out = lesson.measure_mps((1, 2), seconds=0.1, batched=4, binary=stub(tmp_path, "ok"), timeout=10,
                            cmd=[sys.executable, "-c", FAKE_CLIENT], make_plan=lambda b, folder: str(folder / "p"))
    assert out["mps"] and out["why"] == ""
    assert list(out["configs"]) == ["time-slicing, batch 1", "MPS, batch 1", "MPS, batch 4"]
    assert out["ratios"]["2"] == {"mps_gain": 1.0, "batching_gain": 4.0, "time_slicing_scaling": 2.0}
    seen = _notes(notes)  # a note per client: 1 + 2 clients in each of the 3 configurations
    assert len(seen) == 3 * 3
    no_mps = [n for n in seen if n["empty"]]  # the stub daemon's pipe folder holds its stub.pid
    assert len(no_mps) == 3 and all(n["batch"] == 1 and n["existed"] for n in no_mps), seen
    assert len({n["pipe"] for n in no_mps}) == 1
    private = no_mps[0]["pipe"]
    assert private != str(tmp_path / "a-system-wide-daemon")
    assert os.path.basename(private).startswith("gpucourse-no-mps-")
    assert not os.path.exists(private), "the private pipe folder is removed afterwards"
    through_mps = [n for n in seen if not n["empty"]]
    assert len({n["pipe"] for n in through_mps}) == 1 and through_mps[0]["pipe"] != private
    assert mps.processes_with(mps.PIPE, through_mps[0]["pipe"]) == [] and not os.path.exists(through_mps[0]["pipe"])


def test_mps_sweep_keeps_the_rows_when_mps_fails_under_the_clients(tmp_path, monkeypatch):
    import benchmarks.feeding_the_gpu as lesson

    notes = tmp_path / "notes"
    notes.mkdir()
    monkeypatch.setenv("FAKE_CLIENT_NOTES", str(notes))
    monkeypatch.setenv("FAKE_CLIENT_FAIL", "4")  # the MPS clients at batch 4 fail, from the first k on
    out = lesson.measure_mps((1, 2), seconds=0.1, batched=4, binary=stub(tmp_path, "ok"), timeout=10,
                            cmd=[sys.executable, "-c", FAKE_CLIENT], make_plan=lambda b, folder: str(folder / "p"))
    assert out["mps"] is False
    assert out["why"].startswith("MPS failed at MPS, batch 4, k = 1 (the rows measured before are kept): client 1 of 1")
    assert "cannot reach the MPS server" in out["why"]
    assert "server.log: [Server 42] Failed to create the CUDA context: out of memory" in out["why"]
    assert "[Server 42]" in out["mps_log"]
    assert list(out["configs"]) == ["time-slicing, batch 1", "MPS, batch 1"]
    assert all(set(rows) == {"1", "2"} for rows in out["configs"].values())
    assert out["ratios"]["2"] == {"mps_gain": 1.0, "time_slicing_scaling": 2.0}
    daemon_pipe = next(n["pipe"] for n in _notes(notes) if not n["empty"])
    assert mps.processes_with(mps.PIPE, daemon_pipe) == [] and not os.path.exists(daemon_pipe)


def test_mps_sweep_measures_without_mps_when_the_daemon_fails(tmp_path):
    import benchmarks.feeding_the_gpu as lesson

    out = lesson.measure_mps((1, 2), seconds=0.1, batched=4, binary=stub(tmp_path, "fail"), timeout=10,
                            cmd=[sys.executable, "-c", FAKE_CLIENT], make_plan=lambda b, folder: str(folder / "p"))
    assert out["mps"] is False and "no CUDA-capable device is detected" in out["why"]
    assert "control.log: [2026-11-22" in out["mps_log"]
    assert list(out["configs"]) == ["time-slicing, batch 1"]
    assert set(out["configs"]["time-slicing, batch 1"]) == {"1", "2"}
    assert out["ratios"]["2"] == {"time_slicing_scaling": 2.0}


def test_mps_sweep_stops_the_daemon_when_a_client_hangs(tmp_path, monkeypatch):
    import benchmarks.feeding_the_gpu as lesson

    pipes = tmp_path / "pipes"
    pipes.mkdir()
    # ready without MPS; under the stub daemon (its pipe folder holds stub.pid) it hangs, noting the folder first
    hangs_under_mps = ('import os, sys, time\npipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "")\n'
                       'if os.path.exists(os.path.join(pipe, "stub.pid")):\n'
                       f'    open(os.path.join({str(pipes)!r}, str(os.getpid())), "w").write(pipe)\n'
                       '    time.sleep(60)\n' + FAKE_CLIENT)
    t0 = time.monotonic()
    out = lesson.measure_mps((1,), seconds=0.1, batched=4, binary=stub(tmp_path, "ok"), timeout=1.5,
                            cmd=[sys.executable, "-c", hangs_under_mps], make_plan=lambda b, folder: str(folder / "p"))
    assert time.monotonic() - t0 < 15
    assert out["mps"] is False and 'did not say "ready" within 1.5 s' in out["why"]
    assert list(out["configs"]) == ["time-slicing, batch 1"]
    (daemon_pipe,) = {p.read_text() for p in pipes.iterdir()}
    assert mps.processes_with(mps.PIPE, daemon_pipe) == [] and not os.path.exists(daemon_pipe)


# ---------------------------------------------------------------------------------------- profiling

def test_ncu_csv_parser_reads_a_captured_sample():
    rows = profile.parse_csv((DATA / "ncu_sample.csv").read_text())
    assert rows and all("kernel" in r and r["units"] for r in rows)
    dram = [r["dram__throughput.avg.pct_of_peak_sustained_elapsed"] for r in rows
            if "dram__throughput.avg.pct_of_peak_sustained_elapsed" in r]
    assert dram and all(isinstance(v, float) and 0 <= v <= 100 for v in dram)


def test_profile_read_against_the_lessons_ceilings():
    """The multiply's bytes over ncu's time against the copy ceiling, the GEMMs' FLOPs against cuBLAS's."""
    import benchmarks.feeding_the_gpu as lesson

    dram, dur = "dram__throughput.avg.pct_of_peak_sustained_elapsed", "gpu__time_duration.sum"
    fma = "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"
    tensor = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
    t_mul = 3 * 4 * lesson.PROFILE_N / 2.4e12 * 1e9  # ns at 2400 GB/s
    t_gemm = 2 * lesson.PROFILE_GEMM**3 / 40e12 * 1e9  # ns at 40 TFLOP/s
    p = {"ok": True, "rows": [
        {"kernel": "kernels::multiply_kernel[abi:v1]", dram: 80.0, dur: t_mul, fma: 5.0, tensor: 0.0},
        {"kernel": "sm80_xmma_gemm_f32f32", dram: 4.0, dur: t_gemm, fma: 80.0, tensor: 0.0},
        {"kernel": "nvjet_sm90_hsh", dram: 20.0, dur: t_gemm / 16, fma: 0.1, tensor: 90.0}]}
    lines = lesson.profile_reading(p, {"copy_gbps": 3000.0, "fp32_tflops": 50.0, "fp16_tflops": 800.0})
    assert "2,400 GB/s = 0.80 x the copy" in lines[0] and "DRAM peak of about 3,000 GB/s" in lines[0]
    assert lines[1].startswith("FP32 GEMM") and "40.0 TFLOP/s = 0.80 x" in lines[1] and "FMA pipes 80.0%" in lines[1]
    assert lines[2].startswith("FP16 GEMM") and "640.0 TFLOP/s = 0.80 x" in lines[2] and "tensor pipes 90.0%" in lines[2]
    assert lesson.profile_reading({"ok": False, "why": "ncu is not installed"}, {}) == ["ncu: ncu is not installed"]


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


def test_recorded_mps_passes_over_records_where_mps_did_not_run(tmp_path, monkeypatch):
    """Task 8.3 reads the newest complete MPS table, not whatever the newest record holds."""
    import json

    import benchmarks.feeding_the_gpu as lesson

    table, label = lesson.recorded_mps()
    assert "MPS, batch 8" in table["configs"] and label.startswith("recorded on")
    good = {"batched": 8, "mps": True, "configs": {"time-slicing, batch 1": {"1": {"images_per_s": 1.0}},
                                                   "MPS, batch 1": {"1": {"images_per_s": 2.0}},
                                                   "MPS, batch 8": {"1": {"images_per_s": 3.0}}}}
    failed = {"batched": 8, "mps": False, "why": "MPS is unavailable", "configs": {"time-slicing, batch 1": {}}}
    for gpu, date, mps_table in (("gpu-a", "2026-11-20 10:00 UTC", good), ("gpu-b", "2026-11-21 10:00 UTC", failed),
                                 ("gpu-c", "2026-11-22 10:00 UTC", {"error": "RuntimeError: boom"})):
        (tmp_path / gpu).mkdir()
        (tmp_path / gpu / f"{lesson.LESSON}.json").write_text(json.dumps(
            {"format": 1, "lesson": lesson.LESSON, "date": date, "figures": {"mps": mps_table},
             "gpu": {"name": gpu, "sms": 1, "driver": "13.0"}}))
    monkeypatch.setenv("GPUCOURSE_RESULTS", str(tmp_path))
    table, label = lesson.recorded_mps()
    assert table == good and "gpu-a" in label
    with pytest.raises(runtime.CourseError, match="no record of 08_feeding_the_gpu holds a complete MPS table"):
        lesson.recorded_mps(batched=16)


def test_phase_medians_leave_out_nvmls_lag():
    import benchmarks.feeding_the_gpu as lesson

    samples = [{"t": t / 100, "util_gpu": 100.0 if t >= 300 else 0.0, "power_w": 100.0 + (t >= 300) * 200,
                "sm_clock_mhz": 1980.0, "mem_used_mib": 500.0} for t in range(600)]
    for x in samples:  # the readings trail the work by 0.5 s
        if 300 <= x["t"] * 100 < 350:
            x["util_gpu"], x["power_w"] = 0.0, 100.0
    m = {"samples": samples, "marks": [{"t": 0.0, "label": "idle"}, {"t": 3.0, "label": "busy"},
                                       {"t": 6.0, "label": "end"}]}
    idle, busy = lesson.phase_medians(m, settle_s=1.0)
    assert idle["label"] == "idle" and idle["util_gpu"] == 0 and busy["util_gpu"] == 100 and busy["power_w"] == 300
    assert busy["settled"] and busy["samples"] == 200
    short = {"samples": samples, "marks": [{"t": 0.0, "label": "a"}, {"t": 1.5, "label": "end"}]}
    [a] = lesson.phase_medians(short, settle_s=1.0)
    assert not a["settled"] and a["samples"] == 150


def test_sampler_reports_a_failing_reader():
    def read():
        raise OSError("NVML gone")

    s = monitor.Sampler(read, interval_s=0.01).start()
    time.sleep(0.05)
    with pytest.raises(runtime.CourseError, match="NVML gone"):
        s.stop()


def test_every_figure_is_declared_once_with_a_measure():
    """FIGURES: a records.Figure per figure the lesson's records hold, each measured by a function of no
    arguments (``record 08_feeding_the_gpu --figure NAME`` works for every one), drawn and told in words."""
    import inspect

    import benchmarks.feeding_the_gpu as lesson
    from gpucourse import records

    assert list(lesson.FIGURES) == ["overlap", "small_kernels", "unified_memory", "monitoring", "batching", "batcher",
                                    "profile", "mps"]  # the order run() measures them in: MPS last
    for name, fig in lesson.FIGURES.items():
        assert isinstance(fig, records.Figure) and callable(fig.measure), name
        assert all(p.default is not p.empty for p in inspect.signature(fig.measure).parameters.values()), name
        assert callable(fig.text) and (fig.plot is not None or name == "profile"), name
    for rec in records.all_records(lesson.LESSON):  # the figures recorded, each read by its own text
        for name in set(rec["figures"]) & set(lesson.FIGURES):
            assert lesson.FIGURES[name].text(rec["figures"][name]).strip(), (rec["path"], name)


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

    recs = records.all_records("08_feeding_the_gpu")
    if not recs:
        pytest.skip("no GPU record of lesson 8 in results/ yet")
    for rec in recs:
        o = rec["figures"]["overlap"]
        assert o["best"]["ratio_to_longer_copy"] <= 1.15 and o["best"]["met"], (rec["gpu"]["name"], o["best"])
        ran = {k: S.overlap_fraction(S.engine_timeline(r["timeline"])) for k, r in o["runs"].items()}
        assert ran["1"] < 0.05
        assert max(v for k, v in ran.items() if k != "1") > 0.5  # copies out hidden under copies in


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


def _records07():
    from gpucourse import records

    recs = records.all_records("08_feeding_the_gpu")
    if not recs:
        pytest.skip("no GPU record of lesson 8 in results/ yet")
    return recs


def test_recorded_what_the_lesson_says_of_streams_mps_and_memory():
    """What notebook 08 says, on every record: the kernel moves its bytes tens of times faster than the copies, and
    streams beyond two or three gain nothing (four take about as long as two); a launch over four streams still costs
    the host several times one inside the graph; time-slicing gives no more than one process, MPS more with every k
    (four processes several times one), batching more again; a prefetch recovers most of the device's speed but not
    all, resident pages about all of it, faulting far less, and the CPU's first read is slower than its second; one
    spinning thread reads as fully utilised and draws what the idle GPU draws, the multiply more than twice as much;
    ncu: the multiply near DRAM's peak with its FMA pipes idle, the FP32 GEMM on the FMA pipes, the FP16 GEMM on the
    tensor pipes."""
    for rec in _records07():
        f, gpu = rec["figures"], rec["gpu"]["name"]
        o = f["overlap"]
        assert o["kernel_gbps"] > 10 * max(o["h2d_gbps"], o["d2h_gbps"]), gpu
        ratio = {int(k): r["ratio_to_longer_copy"] for k, r in o["runs"].items()}
        assert min(v for k, v in ratio.items() if k >= 4) >= min(ratio[2], ratio[3]) - 0.05, (gpu, ratio)
        assert abs(ratio[4] / ratio[2] - 1) < 0.05, (gpu, ratio)
        launch = f["small_kernels"]["us_per_launch"]
        assert launch["CuPy, 4 streams"] > 3 * launch["CuPy, one CUDA graph"], (gpu, launch)
        c = f["mps"]["configs"]
        sliced, mps1, mps8 = c["time-slicing, batch 1"], c["MPS, batch 1"], c["MPS, batch 8"]
        ks = sorted(map(int, sliced))
        assert all(sliced[str(k)]["images_per_s"] <= sliced["1"]["images_per_s"] for k in ks), gpu
        assert all(mps1[str(a)]["images_per_s"] < mps1[str(b)]["images_per_s"] for a, b in zip(ks, ks[1:])), gpu
        assert all(mps8[str(k)]["images_per_s"] > mps1[str(k)]["images_per_s"] for k in ks), gpu
        assert mps1["4"]["images_per_s"] > 3 * sliced["1"]["images_per_s"], gpu
        u = f["unified_memory"]
        assert 0.5 < u["prefetched_gbps"] / u["device_gbps"] < 1.0, gpu
        assert 0.9 < u["resident_gbps"] / u["device_gbps"] < 1.1, gpu
        assert u["cold_gbps"] < 0.1 * u["prefetched_gbps"], gpu
        assert u["cpu_first_touch_gbps"] < u["cpu_second_touch_gbps"], gpu
        from benchmarks import feeding_the_gpu as lesson

        spinning = next(r for r in lesson.phase_medians(f["monitoring"]) if "spinning" in r["label"])
        assert spinning["util_gpu"] >= 95, gpu
        phases = {r["label"]: r for r in lesson.phase_medians(f["monitoring"])}
        multiply = next(r for r in phases.values() if r["label"].startswith("vector multiply"))
        assert abs(spinning["power_w"] / phases["idle"]["power_w"] - 1) < 0.05, gpu
        assert multiply["power_w"] > 2 * spinning["power_w"], gpu
        p = f["profile"]
        if p.get("ok"):
            dram, fma = "dram__throughput.avg.pct_of_peak_sustained_elapsed", \
                "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"
            tensor = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
            mul, sgemm, hgemm = p["rows"]
            assert mul[dram] > 70 and mul[fma] < 10, gpu
            assert sgemm[fma] > sgemm[tensor] and hgemm[tensor] > hgemm[fma], gpu


def test_recorded_what_the_lesson_says_of_the_batcher():
    """Notebook 08, section 4, on every record: the batcher run on the record's batch times (as the notebook runs it
    in CPU mode) and as the GPU served it. One request at a time keeps up at half its capacity and falls behind
    above it; batching with no wait keeps up at eight times it with p99 under a millisecond; a quarter of a
    millisecond's wait makes the batches larger and the GPU busy a smaller share of the time."""
    from systems.feeding_the_gpu import serving

    for rec in _records07():
        f, gpu = rec["figures"], rec["gpu"]["name"]
        service = serving.service_model(f["batching"]["rows"])
        rates = [round(x / service(1)) for x in (0.5, 2.0, 8.0)]
        for rows in (serving.batcher_table(service, rates, count=2000), f["batcher"]["rows"]):
            by = {(r["rate_per_s"], r["max_batch"], r["max_wait_ms"]): r for r in rows}
            low, *high = sorted({r["rate_per_s"] for r in rows})
            big = max(r["max_batch"] for r in rows)
            alone = by[(low, 1, 0.0)]  # keeps up: serves the rate, its p99 bounded
            assert alone["p99_ms"] < 1.0 and alone["throughput_per_s"] > 0.95 * low, gpu
            for rate in high:
                assert by[(rate, 1, 0.0)]["p99_ms"] > 10 * by[(rate, big, 0.0)]["p99_ms"], (gpu, rate)
            for rate in [low, *high]:
                now, waited = by[(rate, big, 0.0)], by[(rate, big, 0.25)]
                assert now["p99_ms"] < 1.0, (gpu, rate)
                assert waited["mean_batch"] > now["mean_batch"] and waited["gpu_busy"] < now["gpu_busy"], (gpu, rate)

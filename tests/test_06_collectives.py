"""Lesson 6: the ring broadcast's cost model and its fit, the collectives' NumPy specs, the ring all-reduce step by
step, the simulated ring (data, timing, deadlocks), gradient averaging, the recorded figures, and on a machine
with two or more GPUs the course's ring and NCCL against the specs."""
import math

import numpy as np
import pytest

import benchmarks.collectives as lesson
from gpucourse import records, runtime
from kernels import collectives as col
from kernels import ring_sim

pytestmark = pytest.mark.lesson06
LESSON = "06_collectives"


# ------------------------------------------------------------------------------------ the model

@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_model_is_the_slides(k):
    N, B = 3e9, 1.5e11
    assert math.isclose(col.broadcast_time(N, B, k), (k - 1) * N / B)
    for S in (1, 2, 7, 64):
        assert math.isclose(col.broadcast_time(N, B, k, S), N * (S + k - 2) / (S * B))
        assert math.isclose(col.broadcast_time(N, B, k, S, alpha=1e-5), (S + k - 2) * (1e-5 + N / (S * B)))
    assert col.broadcast_time(N, B, k, 10**7) == pytest.approx(N / B, rel=1e-5)  # -> N / B as S grows
    assert math.isclose(col.allreduce_time(N, B, k), 2 * (k - 1) * N / (k * B))


@pytest.mark.parametrize("k,N,alpha", [(3, 2**30, 1e-5), (4, 2**20, 2e-5), (8, 2**30, 5e-6), (16, 1e6, 1e-6)])
def test_best_chunks_is_the_minimum(k, N, alpha):
    B = 2e11
    best = col.best_chunks(N, B, k, alpha)
    brute = min(range(1, 20000), key=lambda s: col.broadcast_time(N, B, k, s, alpha))
    assert col.broadcast_time(N, B, k, best, alpha) == pytest.approx(col.broadcast_time(N, B, k, brute, alpha))
    assert abs(best - math.sqrt((k - 2) * N / (alpha * B))) <= 1
    assert col.best_chunks(N, B, 2, alpha) == 1


def test_model_checks_its_input():
    for args in [(1e6, 1e9, 1), (1e6, 1e9, 2.5), (1e6, 0, 2), (-1, 1e9, 2)]:
        with pytest.raises(runtime.CourseInputError):
            col.broadcast_time(*args)
    with pytest.raises(runtime.CourseInputError, match="S"):
        col.broadcast_time(1e6, 1e9, 3, S=0)
    with pytest.raises(runtime.CourseInputError, match="max_chunks"):
        col.best_chunks(1e6, 1e9, 3, 0.0)


def test_fit_recovers_alpha_and_bandwidth(rng):
    k, alpha, B = 4, 12e-6, 3.5e11
    S = np.repeat([1, 2, 4, 8, 16, 32, 64], 3)
    N = np.tile([2**20, 2**24, 2**30], 7)
    t = np.array([col.broadcast_time(n, B, k, int(s), alpha) for s, n in zip(S, N)])
    fit = col.fit_ring_model(k, S, N, t)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6) and fit["bandwidth"] == pytest.approx(B, rel=1e-6)
    noisy = col.fit_ring_model(k, S, N, t * rng.uniform(0.97, 1.03, t.size))
    assert noisy["bandwidth"] == pytest.approx(B, rel=0.05) and noisy["max_abs_rel_error"] < 0.07
    assert fit["pinned"] == [] and col.fit_ring_model(k, S, N, t + 5e-6, startup=True)["startup_s"] == \
        pytest.approx(5e-6, rel=1e-6)


def test_fitted_times_are_never_negative():
    """Times that grow with S more slowly than the model's (S + k - 2) alpha (as a ring of many GPUs gives,
    whose hops overlap more than the model says) pull an unconstrained fit's t0 below zero; the fit holds it at 0
    and says so, and is then the best fit with every time >= 0."""
    k, alpha, B = 8, 20e-6, 3.0e11
    S = np.repeat([1, 2, 4, 8, 16, 32], 3)
    N = np.tile([2**20, 2**24, 2**28], 6)
    t = np.array([2 * (s + k - 2) * alpha + (s + k - 2) / s * n / B - 150e-6 * (s < 4) for s, n in zip(S, N)])
    t = np.maximum(t, 1e-6)
    X = np.stack([S + k - 2, (S + k - 2) / S * N, np.ones_like(t)], axis=1)
    free, *_ = np.linalg.lstsq(X / t[:, None], np.ones_like(t), rcond=None)
    assert min(free[0], free[2]) < 0  # the data really do ask for a negative time
    fit = col.fit_ring_model(k, S, N, t, startup=True)
    assert fit["alpha_s"] >= 0 and fit["startup_s"] >= 0 and fit["bandwidth"] > 0 and fit["pinned"]
    for name in fit["pinned"]:
        assert fit[name] == 0.0
    # no non-negative (alpha, 1/B, t0) fits better: a grid around the answer finds none
    best = np.sum(((X @ [fit["alpha_s"], 1 / fit["bandwidth"], fit["startup_s"]]) / t - 1) ** 2)
    rng = np.random.default_rng(1)
    for _ in range(2000):
        c = np.maximum([fit["alpha_s"], 1 / fit["bandwidth"], fit["startup_s"]] * rng.uniform(0.5, 1.5, 3)
                       + rng.uniform(0, 5e-6, 3) * [1, 0, 1], 0)
        assert np.sum(((X @ c) / t - 1) ** 2) >= best * (1 - 1e-9)


# ------------------------------------------------------------------------------------ the specs

@pytest.mark.parametrize("n,parts", [(10, 3), (3, 5), (64, 8), (1, 1), (0, 2)])
def test_chunk_bounds_are_array_split(n, parts):
    want = [(c[0], c[-1] + 1) if c.size else None for c in np.array_split(np.arange(n), parts)]
    for i, w in enumerate(want):
        lo, hi = col.chunk_bounds(n, parts, i)
        assert (hi - lo) == (0 if w is None else w[1] - w[0]) and (w is None or (lo, hi) == w)


def test_collective_specs(rng):
    xs = [rng.standard_normal(7) for _ in range(3)]
    total = xs[0] + xs[1] + xs[2]
    assert all(np.array_equal(y, xs[1]) for y in col.broadcast_spec(xs, root=1))
    red = col.reduce_spec(xs, root=2)
    assert np.allclose(red[2], total) and np.array_equal(red[0], xs[0])
    assert all(np.allclose(y, total) for y in col.allreduce_spec(xs))
    assert all(np.array_equal(y, np.concatenate(xs)) for y in col.allgather_spec(xs))
    assert np.allclose(np.concatenate(col.reduce_scatter_spec(xs)), total)
    with pytest.raises(runtime.CourseInputError, match="same shape"):
        col.allreduce_spec([np.zeros(3), np.zeros(4)])


@pytest.mark.parametrize("k,n", [(2, 10), (3, 10), (4, 4), (5, 3), (6, 101), (8, 1000)])
def test_ring_allreduce_numpy(rng, k, n):
    xs = [rng.standard_normal(n) for _ in range(k)]
    trace = []
    out = col.ring_allreduce_numpy(xs, trace=trace)
    for y in out:
        np.testing.assert_allclose(y, np.sum(xs, axis=0), rtol=1e-12, atol=1e-12)
    assert len(trace) == 2 * k * (k - 1)  # every rank sends 2 (k - 1) chunks
    assert all(dst == (src + 1) % k for *_, src, dst, _c in trace)


@pytest.mark.parametrize("k,S", [(2, 1), (2, 5), (4, 1), (4, 6), (8, 3)])
def test_broadcast_schedule(k, S):
    steps = col.ring_broadcast_schedule(k, S)
    assert len(steps) == S + k - 2
    sends = [(t, src, dst, c) for t, step in enumerate(steps) for src, dst, c in step]
    assert len(sends) == S * (k - 1)
    for t, src, dst, c in sends:
        assert dst == src + 1 and t == src + c  # link j sends chunk i at step i + j: after it received it


# ------------------------------------------------------------------------------ the simulated ring

@pytest.mark.parametrize("k", [2, 3, 5, 8])
@pytest.mark.parametrize("S", [1, 4, 13])
def test_simulated_broadcast_matches_the_model(k, S):
    nbytes, B, alpha = 3_000 * S, 1e7, 1e-4  # whole chunks: the model assumes S equal messages
    run, root = col.simulate_broadcast(k, S, nbytes=nbytes, bandwidth=B, latency=alpha, seed=k * S)
    assert run.time_s == pytest.approx(col.broadcast_time(nbytes, B, k, S, alpha), rel=1e-9)
    assert len(run.messages) == S * (k - 1) and all(run.bytes_sent(r) == nbytes for r in range(k - 1))
    for j in range(1, k - 1):  # link j forwards chunk i as soon as link j - 1 delivered it
        for prev, mine in zip(run.link(j - 1), run.link(j)):
            assert mine.start == pytest.approx(max(prev.end, mine.start)) and mine.start >= prev.end


def test_store_and_forward_is_not_pipelined():
    k, S, nbytes, B = 4, 8, 80_000, 1e7
    run, _ = col.simulate_broadcast(k, S, nbytes=nbytes, bandwidth=B, program=col.store_and_forward_program)
    assert run.time_s == pytest.approx((k - 1) * nbytes / B)  # S = 1's time: the links take turns
    piped, _ = col.simulate_broadcast(k, S, nbytes=nbytes, bandwidth=B)
    assert piped.time_s == pytest.approx(col.broadcast_time(nbytes, B, k, S)) and piped.time_s < run.time_s / 2


def test_simulated_broadcast_real_clock():
    """Threads that really sleep: the wall-clock time follows the model (the virtual clock is exact)."""
    k, S, nbytes, B, alpha = 4, 8, 200_000, 2e6, 2e-3  # model: 0.15 s
    run, _ = col.simulate_broadcast(k, S, nbytes=nbytes, bandwidth=B, latency=alpha, clock="real")
    model = col.broadcast_time(nbytes, B, k, S, alpha)
    assert model <= run.time_s <= 1.25 * model  # waking sleeping threads only ever adds time


def test_simulation_catches_wrong_programs():
    def wrong_data(comm, data, S):
        if comm.rank != 0:
            data[:] = comm.recv()[::-1]
        if comm.rank != comm.size - 1:
            comm.send(data)
        return data

    with pytest.raises(runtime.CourseError, match="rank 1 does not hold"):
        col.simulate_broadcast(3, 1, nbytes=100, bandwidth=1e6, program=wrong_data)

    def deadlock(comm):
        return comm.recv()

    with pytest.raises(runtime.CourseError, match="deadlock"):
        ring_sim.run_ring(deadlock, 3, bandwidth=1e6, recv_timeout=0.3)

    def unmatched(comm):
        comm.send(np.zeros(3))

    with pytest.raises(runtime.CourseError, match="never received"):
        ring_sim.run_ring(unmatched, 2, bandwidth=1e6)

    def fails(comm):
        if comm.rank == 2:
            raise ValueError("boom")
        return comm.recv() if comm.rank == 0 else None

    with pytest.raises(runtime.CourseError, match="rank 2 failed: ValueError: boom"):
        ring_sim.run_ring(fails, 3, bandwidth=1e6, recv_timeout=5)
    with pytest.raises(runtime.CourseInputError, match="k >= 2"):
        ring_sim.run_ring(deadlock, 1, bandwidth=1e6)
    with pytest.raises(runtime.CourseInputError, match="clock"):
        ring_sim.run_ring(deadlock, 2, bandwidth=1e6, clock="sundial")


def allreduce_program(comm, x):
    """The ring all-reduce as one rank runs it (reduce-scatter, then all-gather)."""
    k, r = comm.size, comm.rank
    for s in range(k - 1):
        comm.send(x[slice(*col.chunk_bounds(x.size, k, (r - s) % k))])
        x[slice(*col.chunk_bounds(x.size, k, (r - 1 - s) % k))] += comm.recv()
    for s in range(k - 1):
        comm.send(x[slice(*col.chunk_bounds(x.size, k, (r + 1 - s) % k))])
        x[slice(*col.chunk_bounds(x.size, k, (r - s) % k))] = comm.recv()
    return x


@pytest.mark.parametrize("k,n", [(2, 100), (3, 1000), (5, 999), (8, 4096)])
def test_simulated_allreduce(rng, k, n):
    xs = [rng.standard_normal(n) for _ in range(k)]
    B, alpha = 1e8, 1e-5
    run = ring_sim.run_ring(allreduce_program, k, bandwidth=B, latency=alpha, args=[x.copy() for x in xs])
    for y in run.results:
        np.testing.assert_allclose(y, np.sum(xs, axis=0), rtol=1e-12, atol=1e-12)
    if n % k == 0:
        assert run.time_s == pytest.approx(col.allreduce_time(8 * n, B, k, alpha))
    assert all(run.bytes_sent(r) <= 2 * (k - 1) * 8 * math.ceil(n / k) for r in range(k))


# --------------------------------------------------------------------------------- gradients

def test_mlp_gradients_against_finite_differences(rng):
    p = col.mlp_init(seed=1)
    X, Y = rng.standard_normal((9, 16)), rng.standard_normal((9, 4))

    def loss(q):
        h = np.tanh(X @ q["W1"] + q["b1"])
        return 0.5 * np.mean(np.sum((h @ q["W2"] + q["b2"] - Y) ** 2, axis=1))

    g = col.mlp_gradients(p, X, Y)
    for name, idx in (("W1", (3, 5)), ("b1", (7,)), ("W2", (0, 2)), ("b2", (3,))):
        q = {n: v.copy() for n, v in p.items()}
        q[name][idx] += 1e-6
        r = {n: v.copy() for n, v in p.items()}
        r[name][idx] -= 1e-6
        assert (loss(q) - loss(r)) / 2e-6 == pytest.approx(g[name][idx], rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("k", [2, 4])
def test_averaged_gradients_are_the_whole_batch(rng, k):
    p = col.mlp_init(seed=2)
    X, Y = rng.standard_normal((64, 16)), rng.standard_normal((64, 4))
    shards = [col.flatten(col.mlp_gradients(p, X[lo:hi], Y[lo:hi]))
              for lo, hi in (col.chunk_bounds(64, k, r) for r in range(k))]
    avg = col.ring_allreduce_numpy(shards)[0] / k
    full = col.flatten(col.mlp_gradients(p, X, Y))
    np.testing.assert_allclose(avg, full, rtol=1e-12, atol=1e-14)
    assert set(col.unflatten(avg, p)) == set(p)


# ------------------------------------------------------------------------------ recorded figures

def test_recorded_figures():
    """The record from real GPUs holds every k's figures; the lesson's targets for two H200s."""
    rec = records.load(LESSON, "NVIDIA H200")
    runs = rec["figures"]["runs"]
    assert "2" in runs
    for k, entry in runs.items():
        sysinfo = entry["system"]
        assert len(sysinfo["devices"]) == int(k) == len(sysinfo["names"]) and sysinfo["topology"]
        assert entry["gradients"]["max_rel_error"] < 1e-10
        assert max(entry["allreduce"]["max_rel_error"]) <= 1e-5
        b = entry["broadcast"]
        assert len(b["ring_ms"]) == len(b["N"]) and all(len(row) == len(b["S"]) for row in b["ring_ms"])
    two = runs["2"]
    assert two["system"]["links"] == {"GPU0->GPU1": "NV18"}
    assert two["headline"]["N"] == 2**30
    assert two["headline"]["ring_over_nccl"] >= 0.9  # the course's ring against NCCL's broadcast, 1 GiB
    for startup in (False, True):  # measured against the fitted model, every S at 1 GiB: within 15%
        fit = lesson.fit_broadcast(two["broadcast"], 2, startup=startup)
        assert fit["max_abs_rel_error_by_N"][str(2**30)] <= 0.15
        assert 300e9 < fit["bandwidth"] < 500e9 and 0 < fit["alpha_s"] < 50e-6
    assert two["fit"]["bandwidth"] == pytest.approx(lesson.fit_broadcast(two["broadcast"], 2)["bandwidth"])


def test_topology_parsing_and_plots():
    topo = ("\tGPU0\tGPU1\tGPU2\tCPU Affinity\n"
            "GPU0\t X \tNV18\tSYS\t0-31\nGPU1\tNV18\t X \tNV4\t0-31\nGPU2\tSYS\tNV4\t X \t0-31\n")
    assert lesson.link_types(topo, [0, 1, 2]) == {"GPU0->GPU1": "NV18", "GPU1->GPU2": "NV4"}
    assert lesson.link_types(topo, [2, 0]) == {"GPU2->GPU0": "SYS"}
    rec = records.load(LESSON, "NVIDIA H200")
    entry = rec["figures"]["runs"]["2"]
    assert "ring / NCCL" in lesson.summary_text(entry)
    for plot in (lesson.plot_headline, lesson.plot_vs_S, lesson.plot_vs_N, lesson.plot_allreduce):
        assert plot(entry, records.label(rec)).axes


# ------------------------------------------------------------------------------- on real GPUs

def _need_two_gpus():
    if col.gpu_count() < 2:
        pytest.skip(f"needs 2 or more GPUs; this machine has {col.gpu_count()}")


@pytest.mark.gpu
@pytest.mark.parametrize("S", [1, 3, 8])
def test_gpu_ring_broadcast(S):
    _need_two_gpus()
    cp = runtime.cupy()
    ring = col.GpuRing()
    n = 1_000_003
    root = cp.random.random(n, dtype=cp.float32)
    bufs = [root]
    for d in ring.devices[1:]:
        with cp.cuda.Device(d):
            bufs.append(cp.full(n, cp.nan, cp.float32))
    ring.broadcast(bufs, S)
    ring.synchronize()
    want = root.get()
    for b in bufs:
        assert np.array_equal(b.get(), want)


@pytest.mark.gpu
def test_gpu_ring_allreduce_and_nccl(rng):
    _need_two_gpus()
    cp = runtime.cupy()
    ring, nccl = col.GpuRing(), col.Nccl()
    k, n = ring.k, 12_345
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(k)]
    for impl in (ring, nccl):
        bufs = []
        for d, x in zip(ring.devices, xs):
            with cp.cuda.Device(d):
                bufs.append(cp.asarray(x))
        impl.allreduce(bufs)
        impl.synchronize()
        for b in bufs:
            np.testing.assert_allclose(b.get(), np.sum(xs, axis=0), rtol=1e-5, atol=1e-5)
    bufs = [cp.asarray(xs[0])]
    for d in ring.devices[1:]:
        with cp.cuda.Device(d):
            bufs.append(cp.zeros(n, cp.float32))
    nccl.broadcast(bufs)
    nccl.synchronize()
    assert all(np.array_equal(b.get(), xs[0]) for b in bufs)


@pytest.mark.gpu
def test_gpu_ring_checks_its_input():
    _need_two_gpus()
    cp = runtime.cupy()
    ring = col.GpuRing()
    a = cp.zeros(10, cp.float32)
    with pytest.raises(runtime.CourseInputError, match="on GPU"):
        ring.broadcast([a] * ring.k)
    with pytest.raises(runtime.CourseInputError, match="one buffer per GPU"):
        ring.broadcast([a])
    with pytest.raises(runtime.CourseInputError, match="device"):
        col.GpuRing(devices=[0, 0])


@pytest.mark.gpu
def test_one_gpu_says_so():
    if col.gpu_count() >= 2:
        pytest.skip("this machine has 2 or more GPUs")
    with pytest.raises(runtime.CourseError, match="at least 2 GPUs"):
        col.GpuRing()


# ----------------------------------------------------------------- the stream-and-event model (SimRing)

@pytest.mark.parametrize("k,S", [(2, 1), (2, 7), (3, 4), (5, 16), (8, 3)])
def test_sim_ring_push_schedule_matches_the_model(k, S):
    nbytes, B, alpha = 4096 * S, 1e9, 3e-6
    seconds, ring = col.simulate_gpu_broadcast(col.push_broadcast, k, S, nbytes=nbytes, bandwidth=B, latency=alpha)
    assert seconds == pytest.approx(col.broadcast_time(nbytes, B, k, S, alpha), rel=1e-9)
    assert len(ring.ops) == S * (k - 1)


def test_sim_ring_catches_schedule_mistakes():
    def no_wait(ring, bufs, S):  # link j does not wait for chunk i to arrive: it copies stale memory
        ring.begin()
        for i in range(S):
            lo, hi = col.chunk_bounds(len(bufs[0]), S, i)
            for j in range(ring.k - 1):
                ring.copy(bufs, j, j + 1, lo, hi, ring.streams[j])
                ring.event(j, i).record(ring.streams[j])
        ring.end([ring.event(j, S - 1) for j in range(ring.k - 1)])

    with pytest.raises(runtime.CourseError, match="stale"):
        col.simulate_gpu_broadcast(no_wait, 3, 4, nbytes=4096, bandwidth=1e9)

    def no_join(ring, bufs, S):
        col.push_broadcast(ring, bufs, S)
        ring.ended = None

    with pytest.raises(runtime.CourseError, match="does not wait"):
        col.simulate_gpu_broadcast(no_join, 3, 4, nbytes=4096, bandwidth=1e9)

    def event_elsewhere(ring, bufs, S):
        ring.copy(bufs, 0, 1, 0, len(bufs[0]), ring.streams[0])
        ring.event(1, 0).record(ring.streams[0])

    with pytest.raises(runtime.CourseInputError, match="cannot be recorded"):
        col.simulate_gpu_broadcast(event_elsewhere, 2, 1, nbytes=64, bandwidth=1e9)

    def third_party_stream(ring, bufs, S):
        ring.copy(bufs, 0, 1, 0, len(bufs[0]), ring.streams[2])

    with pytest.raises(runtime.CourseInputError, match="runs on a stream of GPU 0 or 1"):
        col.simulate_gpu_broadcast(third_party_stream, 3, 1, nbytes=64, bandwidth=1e9)

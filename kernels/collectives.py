"""Lesson 6 — collectives: the ring broadcast and the ring all-reduce, modelled, simulated, on GPUs, and NCCL.

Used by notebooks/06_collectives.ipynb, benchmarks/collectives.py and the tests:

* The cost model of a broadcast on a unidirectional ring of k GPUs whose links carry B bytes a second:
  (k - 1) N / B sent whole, N (S + k - 2) / (S B) split into S messages, and with a latency alpha for every
  message (S + k - 2)(alpha + N / (S B)), which has a best S. A least-squares fit of alpha and B to measured
  times.
* NumPy specs of the five collectives (broadcast, reduce, all-reduce, all-gather, reduce-scatter), the
  ring broadcast's schedule and the ring all-reduce (reduce-scatter, then all-gather) step by step.
* The rank program of the chunked ring broadcast, for the simulated ring of kernels/ring_sim.py.
* On real GPUs: ``GpuRing``, the course's ring (peer-to-peer copies on one CUDA stream per link, the buffer
  split into S chunks, CUDA events so that a link forwards chunk i only once it has received it) for any
  k >= 2 GPUs, with a ring all-reduce in two versions: the first, a peer copy into scratch memory and an add
  per step, issued step by step; and the default, one kernel per step that reads the previous GPU's chunk
  over NVLink and adds it in (kernels/cuda/collectives.cu), recorded once as a CUDA graph and replayed.
  ``Nccl``, the same collectives from NVIDIA's library through ``cupy.cuda.nccl``.
* A small two-layer network in NumPy or CuPy whose gradients the lesson averages across ranks.
"""
from __future__ import annotations

import math
import os

import numpy as np

from gpucourse import runtime

from . import cuda_c

# NVLink multicast (NVLS) stays off, so NCCL broadcasts with the rings and trees this lesson compares against (and
# shared multi-GPU servers often require it off). Set before any NCCL communicator is created in this process;
# a value already in the environment wins.
for _var, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_var, _value)

COLLECTIVES = ("broadcast", "reduce", "all-reduce", "all-gather", "reduce-scatter")

# ================================================================================ the cost model

def _check_model_args(N, B, k, S=1, alpha=0.0):
    if not (N >= 0 and B > 0 and alpha >= 0):
        raise runtime.CourseInputError(f"need N >= 0, B > 0 and alpha >= 0 (got N={N}, B={B}, alpha={alpha})")
    if int(k) != k or k < 2:
        raise runtime.CourseInputError(f"a ring needs k >= 2 GPUs, got k = {k}")
    if int(S) != S or S < 1:
        raise runtime.CourseInputError(f"S is a number of messages, at least 1; got S = {S}")


def broadcast_time(N: float, B: float, k: int, S: int = 1, alpha: float = 0.0) -> float:
    """Seconds for a ring broadcast of N bytes to k GPUs over links of B bytes/s, the data split into S
    messages each costing alpha seconds more: S + k - 2 steps of alpha + N / (S B). S = 1, alpha = 0 is the
    slide's (k - 1) N / B; alpha = 0 is its N (S + k - 2) / (S B), which tends to N / B as S grows."""
    _check_model_args(N, B, k, S, alpha)
    return (S + k - 2) * (alpha + N / (S * B))


def best_chunks(N: float, B: float, k: int, alpha: float, max_chunks: int | None = None) -> int:
    """The S that minimises broadcast_time. T(S) = (k - 2) N / (S B) + S alpha + constants is least at
    S* = sqrt((k - 2) N / (alpha B)); the best whole S is the floor or the ceiling of it."""
    _check_model_args(N, B, k, 1, alpha)
    if k == 2:
        return 1  # two GPUs, one link: splitting only adds latency
    if alpha == 0:
        if max_chunks is None:
            raise runtime.CourseInputError("with alpha = 0 more messages are always faster: give max_chunks")
        return int(max_chunks)
    s = math.sqrt((k - 2) * N / (alpha * B))
    candidates = {max(1, math.floor(s)), max(1, math.ceil(s))}
    if max_chunks is not None:
        candidates = {min(c, int(max_chunks)) for c in candidates}
    return min(sorted(candidates), key=lambda c: broadcast_time(N, B, k, c, alpha))


def allreduce_time(N: float, B: float, k: int, alpha: float = 0.0) -> float:
    """Seconds for a ring all-reduce of N bytes: k - 1 steps of reduce-scatter and k - 1 of all-gather,
    each moving a chunk of N / k bytes over every link at once."""
    _check_model_args(N, B, k, 1, alpha)
    return 2 * (k - 1) * (alpha + N / (k * B))


def allreduce_pass_times(N: float, B: float, M: float, k: int) -> dict:
    """Seconds that moving the bytes of a ring all-reduce of N bytes takes in each of GpuRing's versions, with
    links of B bytes/s and memory of M bytes/s (bytes read plus written); no latency, no host. Both send
    2 (k - 1) chunks of c = N / k over every link, c / B a step. "copy-add" then adds after each of the k - 1
    reduce-scatter copies, reading the scratch chunk and its own and writing the sum (3 c bytes, 3 c / M), once
    the copy has ended. "pull" reads and writes its own chunk (2 c bytes) in the kernel that brings the peer's
    chunk over the link, while the link works: max(c / B, 2 c / M) a step."""
    _check_model_args(N, B, k)
    if not M > 0:
        raise runtime.CourseInputError(f"need a memory bandwidth M > 0, got {M}")
    c = N / k
    return {"copy-add": 2 * (k - 1) * c / B + (k - 1) * 3 * c / M,
            "pull": (k - 1) * max(c / B, 2 * c / M) + (k - 1) * c / B}


def fit_ring_model(k, S, N, seconds, *, startup: bool = False) -> dict:
    """Least-squares alpha (seconds a message) and B (bytes/s) of broadcast_time to measured times.

    The model is linear in alpha and 1/B: t = (S + k - 2) alpha + (S + k - 2) / S * N * (1/B). With
    ``startup=True`` it also fits a fixed cost t0 per broadcast (starting the operation and waiting for its
    end, whatever S and N): t = t0 + (S + k - 2)(alpha + N / (S B)). Each point is weighted by 1/t, so the
    fit minimises relative errors (a 2 ms point counts as much as a 20 µs one).

    Every parameter is a time, so none may be negative: where the best unconstrained fit wants a negative
    alpha or t0 (the times do not grow with S as the model says, or a term of the model is missing), the fit
    is the best one with that parameter at 0, named in ``pinned``; a model that only fits with a negative time
    is a model that does not describe the measurements, and the errors then show by how much.
    Returns alpha, bandwidth, startup_s, pinned, the model's times and each point's relative error."""
    k, S, N, t = (np.broadcast_to(np.asarray(v, float), np.shape(seconds)) for v in (k, S, N, seconds))
    if t.size < 2 + startup or np.any(t <= 0):
        raise runtime.CourseInputError("fit_ring_model needs at least two (three with startup) positive times")
    steps = S + k - 2
    names = ["alpha_s", "inverse_bandwidth"] + (["startup_s"] if startup else [])
    X = np.stack([steps, steps / S * N] + ([np.ones_like(t)] if startup else []), axis=1)
    coef = _nonnegative_lstsq(X / t[:, None], np.ones_like(t))
    if coef[1] <= 0:
        raise runtime.CourseError("the fit gave a bandwidth <= 0: the times do not follow the model")
    model = X @ coef
    rel = (t - model) / model
    return {"alpha_s": float(coef[0]), "bandwidth": float(1 / coef[1]),
            "startup_s": float(coef[2]) if startup else 0.0,
            "pinned": [n for n, c in zip(names, coef) if c == 0.0 and n != "inverse_bandwidth"],
            "model_s": model.tolist(), "rel_error": rel.tolist(), "max_abs_rel_error": float(np.abs(rel).max())}


def _nonnegative_lstsq(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |A x - b| over x >= 0, for the two or three columns of a ring model: the best of the least-squares
    fits on every subset of the columns (the others held at 0) whose coefficients are all >= 0. With so few
    columns trying every subset is exact and simple (the active-set method of Lawson and Hanson finds the
    same answer for many columns)."""
    n = A.shape[1]
    best, best_res = np.zeros(n), float(np.sum(b * b))
    for mask in range(1, 2 ** n):
        cols = [j for j in range(n) if mask >> j & 1]
        x, *_ = np.linalg.lstsq(A[:, cols], b, rcond=None)
        if np.all(x >= 0):
            full = np.zeros(n)
            full[cols] = x
            res = float(np.sum((A @ full - b) ** 2))
            if res < best_res - 1e-15 * max(best_res, 1.0):
                best, best_res = full, res
    return best


# ============================================================================ NumPy specifications

def chunk_bounds(n: int, parts: int, i: int) -> tuple:
    """Elements [lo, hi) of chunk i when n elements are split into ``parts`` nearly equal chunks, as
    np.array_split does: the first n % parts chunks have one element more."""
    if parts < 1 or not 0 <= i < parts:
        raise runtime.CourseInputError(f"chunk {i} of {parts}: need 0 <= i < parts")
    q, r = divmod(int(n), int(parts))
    lo = i * q + min(i, r)
    return lo, lo + q + (1 if i < r else 0)


def _check_ranks(arrays):
    if len(arrays) < 1:
        raise runtime.CourseInputError("a collective needs at least one rank's array")
    shape = np.shape(arrays[0])
    if any(np.shape(a) != shape for a in arrays):
        raise runtime.CourseInputError(f"every rank's array must have the same shape; got {[np.shape(a) for a in arrays]}")


def broadcast_spec(arrays, root: int = 0) -> list:
    """Every rank ends with a copy of the root's array."""
    _check_ranks(arrays)
    return [np.array(arrays[root], copy=True) for _ in arrays]


def reduce_spec(arrays, root: int = 0) -> list:
    """The root ends with the sum of every rank's array; the others keep theirs."""
    _check_ranks(arrays)
    total = np.sum(np.stack(arrays), axis=0)
    return [total if r == root else np.array(a, copy=True) for r, a in enumerate(arrays)]


def allreduce_spec(arrays) -> list:
    """Every rank ends with the sum of every rank's array."""
    _check_ranks(arrays)
    total = np.sum(np.stack(arrays), axis=0)
    return [total.copy() for _ in arrays]


def allgather_spec(arrays) -> list:
    """Every rank ends with every rank's array, concatenated in rank order."""
    _check_ranks(arrays)
    return [np.concatenate([np.ravel(a) for a in arrays]) for _ in arrays]


def reduce_scatter_spec(arrays) -> list:
    """Rank r ends with chunk r (chunk_bounds) of the sum of every rank's (flat) array."""
    _check_ranks(arrays)
    total = np.sum(np.stack([np.ravel(a) for a in arrays]), axis=0)
    k = len(arrays)
    return [total[slice(*chunk_bounds(total.size, k, r))].copy() for r in range(k)]


def ring_broadcast_schedule(k: int, S: int) -> list:
    """The pipelined ring broadcast from rank 0, step by step: step t is a list of (sender, receiver, chunk).
    Link j (rank j -> j + 1) sends chunk t - j at step t: S + k - 2 steps in all."""
    _check_model_args(1, 1, k, S)
    return [[(j, j + 1, t - j) for j in range(k - 1) if 0 <= t - j < S] for t in range(S + k - 2)]


def ring_allreduce_numpy(arrays, *, trace: list | None = None) -> list:
    """The ring all-reduce of k flat arrays, step by step, as k GPUs do it at once.

    Reduce-scatter: in step s (0 .. k-2) rank r sends chunk (r - s) mod k to rank r + 1, which adds it to its
    own; afterwards rank r holds chunk (r + 1) mod k of the sum. All-gather: in step s rank r sends chunk
    (r + 1 - s) mod k to rank r + 1, which keeps it. Every rank sends 2 (k - 1) chunks of N / k: the volume
    per link does not grow with k. ``trace`` (a list) receives (phase, step, sender, receiver, chunk)."""
    _check_ranks(arrays)
    bufs = [np.array(a, copy=True).ravel() for a in arrays]
    k, n = len(bufs), bufs[0].size
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(k - 1):
            sends = []
            for r in range(k):  # every rank sends at once: take what is on the wire before anyone adds
                c = (r - s) % k if phase == "reduce-scatter" else (r + 1 - s) % k
                lo, hi = chunk_bounds(n, k, c)
                sends.append(((r + 1) % k, lo, hi, bufs[r][lo:hi].copy()))
                if trace is not None:
                    trace.append((phase, s, r, (r + 1) % k, c))
            for dst, lo, hi, data in sends:
                if phase == "reduce-scatter":
                    bufs[dst][lo:hi] += data
                else:
                    bufs[dst][lo:hi] = data
    return [b.reshape(np.shape(arrays[0])) for b in bufs]


# ===================================================================== rank programs (ring_sim.py)

def ring_broadcast_program(comm, data: np.ndarray, S: int) -> np.ndarray:
    """One rank of the chunked ring broadcast from rank 0 (run it with ring_sim.run_ring). Rank 0 holds the
    data; every other rank receives chunk i from the previous rank and passes it on before it waits for
    chunk i + 1, so all links work at once. The last rank only receives."""
    for i in range(S):
        lo, hi = chunk_bounds(data.size, S, i)
        if comm.rank != 0:
            data[lo:hi] = comm.recv()
        if comm.rank != comm.size - 1:
            comm.send(data[lo:hi])
    return data


def store_and_forward_program(comm, data: np.ndarray, S: int) -> np.ndarray:
    """The same messages in another order: a rank receives all S chunks before it forwards any. Right data,
    but no link works while another does: (k - 1) steps of N / B, as if S were 1."""
    if comm.rank != 0:
        for i in range(S):
            lo, hi = chunk_bounds(data.size, S, i)
            data[lo:hi] = comm.recv()
    if comm.rank != comm.size - 1:
        for i in range(S):
            lo, hi = chunk_bounds(data.size, S, i)
            comm.send(data[lo:hi])
    return data


def simulate_broadcast(k: int, S: int, *, nbytes: int, bandwidth: float, latency: float = 0.0,
                       clock: str = "virtual", program=ring_broadcast_program, seed: int = 0):
    """Run a broadcast rank program on a simulated ring: rank 0 holds random bytes, the others zeros.
    Returns (RingRun, the root's data); raises CourseError if any rank ends with other data."""
    from . import ring_sim

    root = np.random.default_rng(seed).integers(0, 256, size=int(nbytes), dtype=np.uint8)
    args = [(root.copy() if r == 0 else np.zeros_like(root), S) for r in range(k)]
    run = ring_sim.run_ring(program, k, bandwidth=bandwidth, latency=latency, args=args, clock=clock)
    for r, got in enumerate(run.results):
        if not isinstance(got, np.ndarray) or got.shape != root.shape or not np.array_equal(got, root):
            raise runtime.CourseError(f"rank {r} does not hold the root's data after the broadcast")
    return run, root


# ===================================================================== a small model to train on k ranks

def mlp_init(sizes=(16, 32, 4), *, seed: int = 0, xp=np, dtype="float64") -> dict:
    """Weights of a two-layer network y = tanh(x W1 + b1) W2 + b2."""
    rng = np.random.default_rng(seed)
    d, h, o = sizes
    p = {"W1": rng.standard_normal((d, h)) / math.sqrt(d), "b1": np.zeros(h),
         "W2": rng.standard_normal((h, o)) / math.sqrt(h), "b2": np.zeros(o)}
    return {name: xp.asarray(v, dtype=dtype) for name, v in p.items()}


def mlp_gradients(params: dict, X, Y) -> dict:
    """Gradients of the mean squared error 0.5 mean_i |f(x_i) - y_i|^2 over the batch, by backpropagation.
    Works on NumPy or CuPy arrays (whichever X is)."""
    xp = _array_module(X)
    h = xp.tanh(X @ params["W1"] + params["b1"])
    err = (h @ params["W2"] + params["b2"] - Y) / X.shape[0]
    dh = (err @ params["W2"].T) * (1 - h * h)
    return {"W1": X.T @ dh, "b1": dh.sum(axis=0), "W2": h.T @ err, "b2": err.sum(axis=0)}


def flatten(grads: dict):
    """One flat vector of every gradient, in a fixed order (what an all-reduce sends)."""
    xp = _array_module(next(iter(grads.values())))
    return xp.concatenate([grads[k].ravel() for k in sorted(grads)])


def unflatten(vector, like: dict) -> dict:
    out, at = {}, 0
    for k in sorted(like):
        n = like[k].size
        out[k] = vector[at:at + n].reshape(like[k].shape)
        at += n
    return out


def _array_module(x):
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


# ====================================================== the ring all-reduce as GPUs run it (no GPU needed)

ALLREDUCE_METHODS = ("pull", "copy-add")
ALLREDUCE_GATHERS = ("copy-engine", "kernel")
SOURCE = "collectives"  # kernels/cuda/collectives.cu: the kernels of method="pull"
REDUCE_KERNELS = {"float16": "ring_reduce_f16", "float32": "ring_reduce_f32", "float64": "ring_reduce_f64"}
STEP_THREADS = 256  # threads a block of a step's kernel
STEP_BLOCKS_PER_SM = 4  # at most this many blocks on every SM
STEP_UNROLL = 4  # 16-byte loads in flight per thread (UNROLL in collectives.cu)


def allreduce_schedule(k: int) -> list:
    """The ring all-reduce as GpuRing.allreduce runs it: 2 (k - 1) steps, each a list of (receiver, sender,
    chunk, phase), one entry for every GPU. In step t GPU r *pulls* chunk c from GPU r - 1: it adds it to its
    own chunk c (reduce-scatter, the first k - 1 steps) or keeps it (all-gather, the last k - 1). The same
    chunks as ring_allreduce_numpy, whose rank r sends what rank r + 1 receives here.

    GPU r's step t waits for one thing besides its own step t - 1: GPU r - 1's step t - 1, which made the chunk
    it pulls final. That is enough: no step writes a chunk that another GPU has still to read (a chain of those
    waits runs from every read to the later write of the same chunk); tests/test_06_collectives.py checks it."""
    if int(k) != k or k < 2:
        raise runtime.CourseInputError(f"a ring needs k >= 2 GPUs, got k = {k}")
    k = int(k)
    steps = []
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(k - 1):
            steps.append([(r, (r - 1) % k, (r - 1 - s if phase == "reduce-scatter" else r - s) % k, phase)
                          for r in range(k)])
    return steps


def allreduce_options(dtype, method: str = "pull", graph: bool | None = None, gather: str = "copy-engine") -> tuple:
    """GpuRing.allreduce's options checked (no GPU needed): returns (method, graph, gather), graph's default
    filled in (True for "pull"; "copy-add" has no graph). Raises CourseInputError for anything else."""
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in REDUCE_KERNELS:
        raise runtime.CourseInputError(f"allreduce sums {', '.join(REDUCE_KERNELS)} buffers, not {name}; convert "
                                       "them first (buf.astype(cupy.float32))")
    if method not in ALLREDUCE_METHODS:
        raise runtime.CourseInputError(f"method must be one of {ALLREDUCE_METHODS}, not {method!r}")
    if gather not in ALLREDUCE_GATHERS:
        raise runtime.CourseInputError(f"gather must be one of {ALLREDUCE_GATHERS}, not {gather!r}")
    if graph is None:
        graph = method == "pull"
    if graph not in (True, False):
        raise runtime.CourseInputError(f"graph is True or False, not {graph!r}")
    if graph and method != "pull":
        raise runtime.CourseInputError("only method='pull' runs as a CUDA graph: 'copy-add' is issued step by step")
    return method, bool(graph), gather


def step_grid(n: int, itemsize: int, sms: int, *, threads: int = STEP_THREADS,
              blocks_per_sm: int = STEP_BLOCKS_PER_SM) -> int:
    """Blocks for one step's kernel over n elements of itemsize bytes: enough for every thread to have
    STEP_UNROLL 16-byte loads to make, at most blocks_per_sm on each of the GPU's sms SMs (the kernel's
    grid-stride loop covers the rest), and at least one."""
    if n < 0 or itemsize < 1 or sms < 1 or threads < 1 or blocks_per_sm < 1:
        raise runtime.CourseInputError("step_grid needs n >= 0 and itemsize, sms, threads, blocks_per_sm >= 1")
    packs = -(-int(n) * int(itemsize) // 16)
    return max(1, min(int(sms) * int(blocks_per_sm), -(-packs // (int(threads) * STEP_UNROLL))))


# ============================================================================== on real GPUs

PEER_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled


def gpu_count() -> int:
    """How many GPUs CuPy sees (0 in CPU mode)."""
    if not runtime.is_gpu():
        return 0
    return runtime.cupy().cuda.runtime.getDeviceCount()


def _devices(devices, at_least: int = 2) -> list:
    n = gpu_count()
    devices = list(range(n)) if devices is None else [int(d) for d in devices]
    if len(devices) < at_least:
        raise runtime.CourseError(f"a ring needs at least {at_least} GPUs; this machine has {n}. "
                                  "The notebook shows the figures recorded on a machine with more.")
    if len(set(devices)) != len(devices) or not all(0 <= d < n for d in devices):
        raise runtime.CourseInputError(f"devices must be distinct GPU numbers below {n}, got {devices}")
    return devices


def enable_peer_access(devices) -> dict:
    """Let every GPU of ``devices`` read and write every other's memory directly (over NVLink or PCIe)
    where the hardware allows it. Returns {(a, b): True if a can reach b directly}."""
    cp = runtime.cupy()
    rt = cp.cuda.runtime
    reach = {}
    for a in devices:
        for b in devices:
            if a == b:
                continue
            reach[(a, b)] = bool(rt.deviceCanAccessPeer(a, b))
            if reach[(a, b)]:
                with cp.cuda.Device(a):
                    try:
                        rt.deviceEnablePeerAccess(b)
                    except rt.CUDARuntimeError as exc:
                        if exc.status != PEER_ALREADY_ENABLED:
                            raise
    return reach


class _Streams:
    """One non-blocking stream per GPU, forked from and joined back into the caller's current stream of the
    first GPU. Timing: CUDA events recorded on that caller's stream (bench.time_gpu) bracket all the work on
    every GPU, because every stream waits for the fork and the caller's stream waits for every stream's end."""

    def __init__(self, devices):
        cp = runtime.cupy()
        self.cp, self.devices = cp, list(devices)
        self.streams = []
        for d in self.devices:
            with cp.cuda.Device(d):
                self.streams.append(cp.cuda.Stream(non_blocking=True))
        self._events: dict = {}

    def event(self, rank: int, i: int):
        """A reusable synchronisation event on GPU ``rank`` (a stream's wait takes the event's state at the
        time it is called, so re-recording it later does not disturb earlier waits)."""
        key = (rank, i)
        if key not in self._events:
            with self.cp.cuda.Device(self.devices[rank]):
                self._events[key] = self.cp.cuda.Event(block=False, disable_timing=True)
        return self._events[key]

    def fork(self) -> None:
        cp = self.cp
        with cp.cuda.Device(self.devices[0]):
            start = self.event(0, -1)
            start.record(cp.cuda.get_current_stream())
        for s in self.streams:
            s.wait_event(start)

    def join(self, events) -> None:
        cp = self.cp
        with cp.cuda.Device(self.devices[0]):
            caller = cp.cuda.get_current_stream()
            for ev in events:
                caller.wait_event(ev)

    def synchronize(self) -> None:
        for d in self.devices:
            self.cp.cuda.Device(d).synchronize()


def _check_buffers(bufs, devices, what: str):
    cp = runtime.cupy()
    if len(bufs) != len(devices):
        raise runtime.CourseInputError(f"{what}: one buffer per GPU ({len(devices)}), got {len(bufs)}")
    for r, (b, d) in enumerate(zip(bufs, devices)):
        if not isinstance(b, cp.ndarray):
            raise runtime.CourseInputError(f"{what}: buffer {r} must be a CuPy array, got {type(b).__name__}")
        if b.device.id != d:
            raise runtime.CourseInputError(f"{what}: buffer {r} must be on GPU {d}, it is on GPU {b.device.id}")
        if not b.flags.c_contiguous or b.dtype != bufs[0].dtype or b.size != bufs[0].size:
            raise runtime.CourseInputError(f"{what}: buffers must be contiguous, of one dtype and one size")


class GpuRing:
    """The course's ring over GPUs devices[0] -> devices[1] -> ... -> devices[k-1] (k >= 2).

    ``broadcast(bufs, S)``: rank 0's buffer to every rank, split into S chunks. Link j (GPU j -> GPU j+1)
    has its own stream on GPU j; for each chunk i it waits for the event that link j - 1 recorded after
    delivering chunk i to GPU j, copies chunk i with cudaMemcpyPeerAsync, and records its own event. A
    stream runs its copies in order, so while link j forwards chunk i, link j - 1 already delivers chunk
    i + 1: the pipeline of the cost model. ``allreduce(bufs)``: the ring all-reduce (sum, in place), by
    default one kernel per step that reads the previous GPU's chunk over the link, replayed as a CUDA graph;
    ``allreduce(bufs, method="copy-add")``: the first version, a peer copy and an add per step.
    Both return at once; the caller's current stream (on devices[0]) waits for the whole operation."""

    GRAPHS_KEPT = 64  # CUDA graphs of allreduce kept, one per set of buffers (the oldest goes first)

    def __init__(self, devices=None):
        self.devices = _devices(devices)
        self.k = len(self.devices)
        self.peer = enable_peer_access(self.devices)
        self.s = _Streams(self.devices)
        self.streams = self.s.streams  # streams[r]: a non-blocking stream on GPU devices[r]
        self._scratch: dict = {}
        self.sms = [self.s.cp.cuda.Device(d).attributes["MultiProcessorCount"] for d in self.devices]
        self._kernels: dict = {}  # (rank, kernel name) -> the kernel, loaded on that GPU
        self._graphs: dict = {}  # (buffer addresses, size, dtype, gather) -> cupy.cuda.Graph
        self._capture_streams = None  # a _Streams of its own for capturing graphs
        self.graph_launches = 0  # how many allreduce calls replayed a graph

    # The pieces a ring schedule is written with (SimRing has the same, on a CPU model of streams):
    def event(self, rank: int, i: int):
        """Event number i of GPU ``rank`` (record it only on that GPU's stream)."""
        return self.s.event(rank, i)

    def begin(self) -> None:
        """Make every stream wait for the work already queued on the caller's current stream (a fork)."""
        self.s.fork()

    def end(self, events) -> None:
        """Make the caller's current stream wait for ``events``, the last event of every stream that worked
        (a join)."""
        self.s.join(events)

    def copy(self, bufs, src: int, dst: int, lo: int, hi: int, stream) -> None:
        """Queue the copy of elements lo .. hi - 1 of bufs[src] into bufs[dst] (cudaMemcpyPeerAsync) on
        ``stream``, a stream of GPU src or of GPU dst."""
        item = bufs[0].itemsize
        self.s.cp.cuda.runtime.memcpyPeerAsync(bufs[dst].data.ptr + lo * item, self.devices[dst],
                                               bufs[src].data.ptr + lo * item, self.devices[src],
                                               (hi - lo) * item, stream.ptr)

    def broadcast(self, bufs, S: int = 1) -> None:
        _check_buffers(bufs, self.devices, "broadcast")
        n = bufs[0].size
        if int(S) != S or not 1 <= S <= max(1, n):
            raise runtime.CourseInputError(f"S must be a whole number from 1 to the element count {n}, got {S}")
        push_broadcast(self, bufs, S)

    def _scratch_for(self, rank: int, dtype, n: int):
        key = (rank, np.dtype(dtype).str, n)
        if key not in self._scratch:
            with self.s.cp.cuda.Device(self.devices[rank]):
                self._scratch[key] = self.s.cp.empty(n, dtype=dtype)
        return self._scratch[key]

    def allreduce(self, bufs, method: str = "pull", *, graph: bool | None = None,
                  gather: str = "copy-engine") -> None:
        """Sum in place: afterwards every GPU's buffer holds the sum of all k (float16, float32 or float64).
        Reduce-scatter, then all-gather, in the steps of allreduce_schedule: in each, GPU r pulls one chunk from
        GPU r - 1, after waiting for the event of GPU r - 1's previous step, which made that chunk final.

        method="pull" (the default): a reduce-scatter step is one kernel on GPU r that reads GPU r - 1's chunk
        through its address (peer access: the loads cross NVLink) and adds it into GPU r's own; an all-gather
        step copies the finished chunk: with gather="copy-engine" a cudaMemcpyAsync (a copy engine, as
        cudaMemcpyPeerAsync, but one a CUDA graph can hold), with gather="kernel" a copy kernel.
        graph=True (the default of "pull"): the first call with these buffers queues the steps from Python and
        records them as one CUDA graph (``_capture``); later calls on the same buffers (same addresses, size,
        dtype) replay it with one launch, with no work for the host per step.
        method="copy-add": the first version, step by step from Python: a cudaMemcpyPeerAsync of the chunk
        into scratch memory on GPU r, then an add (cp.add) on the same stream.

        Like every collective here it starts after the work queued on the caller's current stream of devices[0];
        data written on the other GPUs must be there already (synchronise those GPUs, or their streams, first)."""
        cp = self.s.cp
        _check_buffers(bufs, self.devices, "allreduce")
        method, graph, gather = allreduce_options(bufs[0].dtype, method, graph, gather)
        if bufs[0].size == 0:
            return
        if method == "copy-add":
            self._allreduce_copy_add(bufs)
            return
        self._need_peer_reads()
        if not graph:
            self._allreduce_pull(bufs, self.s, gather)
            return
        key = (tuple(b.data.ptr for b in bufs), bufs[0].size, bufs[0].dtype.str, gather)
        recorded = self._graphs.get(key)
        if recorded is None:
            self._allreduce_pull(bufs, self.s, gather)  # this call's sum; it also loads the kernels on every GPU
            self._graphs[key] = self._capture(bufs, gather)
            while len(self._graphs) > self.GRAPHS_KEPT:
                self._graphs.pop(next(iter(self._graphs)))
            return
        with cp.cuda.Device(self.devices[0]):
            recorded.launch(cp.cuda.get_current_stream())  # ordered after earlier work on the caller's stream
        self.graph_launches += 1

    def _queue_schedule(self, s: "_Streams", n: int, work) -> None:
        """Queue the steps of allreduce_schedule on the streams of ``s``, for both versions: for each step and
        GPU r, wait for the event of GPU r - 1's previous step (which made the chunk GPU r pulls final), then
        ``work(r, src, lo, hi, phase, stream)`` queues that step's copy or kernel on GPU r's stream, with GPU r
        current, and an event marks its end. The whole runs after the caller's stream (fork) and the caller's
        stream waits for it (join)."""
        cp, k = s.cp, self.k
        s.fork()
        last = [None] * k
        for t, step in enumerate(allreduce_schedule(k)):
            done = []
            for r, src, c, phase in step:
                lo, hi = chunk_bounds(n, k, c)
                stream = s.streams[r]
                with cp.cuda.Device(self.devices[r]):
                    if last[src] is not None:
                        stream.wait_event(last[src])
                    work(r, src, lo, hi, phase, stream)
                    ev = s.event(r, t)
                    ev.record(stream)
                done.append(ev)
            last = done
        s.join(last)

    def _allreduce_copy_add(self, bufs) -> None:
        """The first version: each step a peer copy into scratch memory, then an add, issued step by step."""
        cp, k = self.s.cp, self.k
        n, item = bufs[0].size, bufs[0].itemsize
        flat = [b.reshape(-1) for b in bufs]
        scratch = [self._scratch_for(r, bufs[0].dtype, chunk_bounds(n, k, 0)[1]) for r in range(k)]

        def step(r, src, lo, hi, phase, stream):
            into = scratch[r] if phase == "reduce-scatter" else flat[r][lo:hi]
            cp.cuda.runtime.memcpyPeerAsync(into.data.ptr, self.devices[r], flat[src].data.ptr + lo * item,
                                            self.devices[src], (hi - lo) * item, stream.ptr)
            if phase == "reduce-scatter" and hi > lo:
                with stream:
                    cp.add(flat[r][lo:hi], scratch[r][:hi - lo], out=flat[r][lo:hi])

        self._queue_schedule(self.s, n, step)

    def _allreduce_pull(self, bufs, s: "_Streams", gather: str) -> None:
        """Queue the pull all-reduce on the streams of ``s``: per step and GPU one kernel (or one copy) that reads
        the chunk straight from GPU r - 1's buffer. Nothing here waits for the GPU, so a CUDA graph can record it."""
        cp, k = s.cp, self.k
        n, item = bufs[0].size, bufs[0].itemsize
        ptr = [b.data.ptr for b in bufs]
        add = [self._kernel(r, REDUCE_KERNELS[bufs[0].dtype.name]) for r in range(k)]
        copy = [self._kernel(r, "ring_copy") for r in range(k)] if gather == "kernel" else None

        def step(r, src, lo, hi, phase, stream):
            mine, peer, count = ptr[r] + lo * item, ptr[src] + lo * item, hi - lo
            if count and phase == "reduce-scatter":  # mine += peer, the peer's chunk read over the link
                add[r]((step_grid(count, item, self.sms[r]),), (STEP_THREADS,),
                       (np.uint64(mine), np.uint64(peer), np.int64(count)), stream=stream)
            elif count and gather == "kernel":  # mine = peer, bytes, by the SMs
                copy[r]((step_grid(count * item, 1, self.sms[r]),), (STEP_THREADS,),
                        (np.uint64(mine), np.uint64(peer), np.int64(count * item)), stream=stream)
            elif count:  # mine = peer, by a copy engine
                cp.cuda.runtime.memcpyAsync(mine, peer, count * item, cp.cuda.runtime.memcpyDefault, stream.ptr)

        self._queue_schedule(s, n, step)

    def _capture(self, bufs, gather: str):
        """The pull all-reduce of these buffers recorded as one CUDA graph (cupy.cuda.Graph), nothing run.

        Stream capture records what is queued on a capturing stream instead of running it. Here the capturing
        stream is a new one on devices[0]; ``fork`` records an event on it that every GPU's stream waits for,
        which draws those streams (on their own GPUs) into the same capture, and ``join`` brings them back. So
        the graph holds every GPU's kernels and copies, with the events' waits as its edges, and one
        ``graph.launch(stream)`` replays all of them after the work already on that stream."""
        cp = self.s.cp
        if self._capture_streams is None:
            self._capture_streams = _Streams(self.devices)
        with cp.cuda.Device(self.devices[0]):
            origin = cp.cuda.Stream(non_blocking=True)
            with origin:
                origin.begin_capture()
                try:
                    self._allreduce_pull(bufs, self._capture_streams, gather)
                except Exception as exc:
                    try:
                        origin.end_capture()  # leave the stream usable; the first error is the one to report
                    except Exception:
                        pass
                    raise runtime.CourseError(f"the all-reduce could not be recorded as a CUDA graph ({exc}); "
                                              "graph=False runs the same steps without one") from exc
                return origin.end_capture()

    def _kernel(self, rank: int, name: str):
        """The kernel ``name`` of kernels/cuda/collectives.cu, loaded on GPU devices[rank]."""
        key = (rank, name)
        if key not in self._kernels:
            with self.s.cp.cuda.Device(self.devices[rank]):
                self._kernels[key] = cuda_c.function(SOURCE, name)
        return self._kernels[key]

    def _need_peer_reads(self) -> None:
        for r in range(self.k):
            a, b = self.devices[r], self.devices[(r - 1) % self.k]
            if not self.peer.get((a, b)):
                raise runtime.CourseError(f"GPU {a} cannot read GPU {b}'s memory directly (no peer access between "
                                          "them), which method='pull' needs; use method='copy-add' on this machine")

    def synchronize(self) -> None:
        self.s.synchronize()


def push_broadcast(ring, bufs, S: int) -> None:
    """The pipelined ring broadcast from GPU 0 as a schedule of stream work, for a GpuRing or a SimRing.
    Link j (GPU j -> GPU j + 1) runs on GPU j's stream: for each chunk i it waits for the event GPU j - 1's
    link recorded when chunk i reached GPU j, queues the copy, and records its own event."""
    n = len(bufs[0])
    ring.begin()
    for i in range(S):
        lo, hi = chunk_bounds(n, S, i)
        for j in range(ring.k - 1):
            stream = ring.streams[j]
            if j > 0:
                stream.wait_event(ring.event(j - 1, i))  # GPU j has received chunk i
            ring.copy(bufs, j, j + 1, lo, hi, stream)
            ring.event(j, i).record(stream)  # link j has delivered chunk i
    ring.end([ring.event(j, S - 1) for j in range(ring.k - 1)])


def simulate_gpu_broadcast(schedule, k: int, S: int, *, nbytes: int, bandwidth: float, latency: float = 0.0,
                           seed: int = 0):
    """Run ``schedule(ring, bufs, S)`` (push_broadcast, or one of yours) on a SimRing of k GPUs: GPU 0's
    float32 buffer random, the others NaN. Returns (seconds, ring); raises CourseError if a GPU ends with
    other data."""
    root = np.random.default_rng(seed).random(int(nbytes) // 4, dtype=np.float32)
    bufs = [root.copy()] + [np.full_like(root, np.nan) for _ in range(k - 1)]
    ring = SimRing(k, bandwidth=bandwidth, latency=latency)
    schedule(ring, bufs, S)
    seconds = ring.finish(bufs)
    for r, b in enumerate(bufs):
        bad = int(np.count_nonzero(~(b == root)))
        if bad:
            raise runtime.CourseError(f"k={k}, S={S}: GPU {r} ends with {bad} of {b.size} elements unlike GPU 0's "
                                      "(a copy that started before its data had arrived reads stale memory)")
    return seconds, ring


class _SimStream:
    def __init__(self, rank: int):
        self.rank, self.t = rank, 0.0

    def wait_event(self, event) -> None:
        if not isinstance(event, _SimEvent):
            raise runtime.CourseInputError(f"wait_event takes an event of ring.event(...), not {type(event).__name__}")
        self.t = max(self.t, event.t)  # an event never recorded is complete: waiting on it does nothing (as in CUDA)


class _SimEvent:
    def __init__(self, rank: int):
        self.rank, self.t, self.recorded = rank, 0.0, False

    def record(self, stream) -> None:
        if not isinstance(stream, _SimStream):
            raise runtime.CourseInputError(f"record takes a stream of ring.streams, not {type(stream).__name__}")
        if stream.rank != self.rank:
            raise runtime.CourseInputError(f"an event of GPU {self.rank} cannot be recorded on GPU {stream.rank}'s "
                                           "stream (CUDA refuses it: cudaErrorInvalidResourceHandle)")
        self.t, self.recorded = stream.t, True


class SimRing:
    """A CPU model of GpuRing's streams, events and peer copies, for writing and checking ring schedules
    without GPUs: the same ``k``, ``streams``, ``event(rank, i)``, ``begin()``, ``end(events)`` and
    ``copy(bufs, src, dst, lo, hi, stream)``, on NumPy buffers.

    Every stream runs its work in the order it was queued; a copy starts when its stream has finished what
    came before it and the link src -> dst is free, and takes latency + bytes / bandwidth; ``record`` marks
    the point its stream has reached, ``wait_event`` holds a stream until then. ``finish(bufs)`` then carries
    out the copies in the order of time, each reading its source when it starts and writing its destination
    when it ends, so a copy that starts before its data has arrived copies stale data, as on a GPU. It
    returns the time at which the caller's stream, after ``end``, has everything."""

    def __init__(self, k: int, *, bandwidth: float, latency: float = 0.0):
        if int(k) != k or k < 2:
            raise runtime.CourseInputError(f"a ring needs k >= 2 GPUs, got k = {k}")
        self.k, self.devices = int(k), list(range(int(k)))
        self.bandwidth, self.latency = float(bandwidth), float(latency)
        self.streams = [_SimStream(r) for r in range(self.k)]
        self._events: dict = {}
        self._link_free: dict = {}
        self.ops: list = []  # (start, end, src, dst, lo, hi, stream rank)
        self.ended: float | None = None

    def event(self, rank: int, i: int):
        if not 0 <= rank < self.k:
            raise runtime.CourseInputError(f"no GPU {rank} in a ring of {self.k}")
        return self._events.setdefault((rank, i), _SimEvent(rank))

    def begin(self) -> None:
        pass  # the caller's stream has no earlier work in the model

    def end(self, events) -> None:
        events = list(events)
        if not all(isinstance(e, _SimEvent) for e in events):
            raise runtime.CourseInputError("end takes a list of events of ring.event(...)")
        self.ended = max([e.t for e in events], default=0.0)

    def copy(self, bufs, src: int, dst: int, lo: int, hi: int, stream) -> None:
        if not isinstance(stream, _SimStream):
            raise runtime.CourseInputError("copy needs a stream of ring.streams")
        if src == dst or stream.rank not in (src, dst):
            raise runtime.CourseInputError(f"a copy from GPU {src} to GPU {dst} runs on a stream of GPU {src} or "
                                           f"{dst}, not of GPU {stream.rank}")
        if not 0 <= lo <= hi <= len(bufs[src]):
            raise runtime.CourseInputError(f"elements {lo} .. {hi} are outside the buffer of {len(bufs[src])}")
        nbytes = (hi - lo) * bufs[0].itemsize
        start = max(stream.t, self._link_free.get((src, dst), 0.0))
        end = start + self.latency + nbytes / self.bandwidth
        self._link_free[(src, dst)] = stream.t = end
        self.ops.append((start, end, src, dst, lo, hi, stream.rank))

    def finish(self, bufs) -> float:
        """Carry out the queued copies in time order; the time the caller's stream sees after ``end`` (raises
        CourseError if some stream works on after the events passed to ``end``)."""
        timeline = []
        for n, op in enumerate(self.ops):
            timeline += [(op[0], 1, n), (op[1], 0, n)]  # at equal times a copy that ends lands before one starts
        taken = {}
        for _, starts, n in sorted(timeline):
            _, _, src, dst, lo, hi, _ = self.ops[n]
            if starts:
                taken[n] = np.array(bufs[src][lo:hi], copy=True)
            else:
                bufs[dst][lo:hi] = taken.pop(n)
        last = max([s.t for s in self.streams], default=0.0)
        if self.ended is None or last > self.ended * (1 + 1e-12):
            raise runtime.CourseError(
                f"the caller's stream does not wait for all the work: streams run until t = {last:.6g} s, end "
                f"waited only until {self.ended or 0.0:.6g} s. Pass ring.end the last event of every stream that "
                "worked")
        return self.ended


class Nccl:
    """NVIDIA's NCCL through cupy.cuda.nccl: one communicator per GPU in this one process
    (NcclCommunicator.initAll), the calls of all GPUs grouped between groupStart and groupEnd so that NCCL
    launches them together. Same stream discipline as GpuRing. NCCL needs GPUs: CPU mode has none."""

    def __init__(self, devices=None):
        runtime.require_gpu("NCCL")
        from cupy.cuda import nccl

        self.nccl = nccl
        self.devices = _devices(devices)
        self.k = len(self.devices)
        self.comms = nccl.NcclCommunicator.initAll(self.devices)
        self.s = _Streams(self.devices)
        self.version = nccl.get_version()

    def _dtype(self, dtype):
        table = {"float32": self.nccl.NCCL_FLOAT32, "float64": self.nccl.NCCL_FLOAT64,
                 "float16": self.nccl.NCCL_FLOAT16, "int32": self.nccl.NCCL_INT32, "uint8": self.nccl.NCCL_UINT8}
        try:
            return table[np.dtype(dtype).name]
        except KeyError:
            raise runtime.CourseInputError(f"no NCCL type for {np.dtype(dtype)}; use one of {list(table)}") from None

    def _grouped(self, bufs, call, what: str) -> None:
        cp, s = self.s.cp, self.s
        _check_buffers(bufs, self.devices, what)
        s.fork()
        self.nccl.groupStart()
        for r, (b, comm) in enumerate(zip(bufs, self.comms)):
            with cp.cuda.Device(self.devices[r]):
                call(comm, b, s.streams[r].ptr)
        self.nccl.groupEnd()
        events = []
        for r in range(self.k):
            with cp.cuda.Device(self.devices[r]):
                ev = s.event(r, -2)
                ev.record(s.streams[r])
                events.append(ev)
        s.join(events)

    def broadcast(self, bufs, root: int = 0) -> None:
        dt = self._dtype(bufs[0].dtype)
        self._grouped(bufs, lambda comm, b, st: comm.broadcast(b.data.ptr, b.data.ptr, b.size, dt, root, st),
                      "broadcast")

    def allreduce(self, bufs) -> None:
        dt = self._dtype(bufs[0].dtype)
        self._grouped(bufs, lambda comm, b, st: comm.allReduce(b.data.ptr, b.data.ptr, b.size, dt,
                                                               self.nccl.NCCL_SUM, st), "allreduce")

    def synchronize(self) -> None:
        self.s.synchronize()


def peer_copy(dst, src, stream=None) -> None:
    """One cudaMemcpyPeerAsync of a whole buffer between GPUs, on the caller's current stream: the ceiling
    of one link."""
    cp = runtime.cupy()
    stream = stream or cp.cuda.get_current_stream()
    cp.cuda.runtime.memcpyPeerAsync(dst.data.ptr, dst.device.id, src.data.ptr, src.device.id, src.nbytes, stream.ptr)

"""Lesson 7: NumPy specs of the five collectives, the ring broadcast's schedule and the ring all-reduce step by step;
the rank programs of the chunked ring broadcast for the simulated ring of kernels/collectives/ring_sim.py; and a small
two-layer network in NumPy or CuPy whose gradients the lesson averages across ranks."""
from __future__ import annotations

import math

import numpy as np

from gpucourse import runtime

from .model import _check_model_args

COLLECTIVES = ("broadcast", "reduce", "all-reduce", "all-gather", "reduce-scatter")


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

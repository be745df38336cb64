"""Lesson 6: the cost model of a ring. A broadcast of N bytes over k GPUs whose links carry B bytes a second:
(k - 1) N / B sent whole, N (S + k - 2) / (S B) split into S messages, and with a latency alpha for every message
(S + k - 2)(alpha + N / (S B)), which has a best S; the ring all-reduce's time, and what moving its bytes costs in
each of GpuRing's versions; a least-squares fit of alpha, B (and a start-up cost) to measured times."""
from __future__ import annotations

import math

import numpy as np

from gpucourse import runtime


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

"""Lesson 10: what every attention kernel computes, in NumPy (float64), and what it costs.

Softmax of a row x: exp(x - max x) / sum exp(x - max x). Subtracting the max changes nothing mathematically and
keeps every exp(...) <= 1, so nothing overflows. A row whose every element is -inf (a query that may attend to
nothing, e.g. fully masked) has no max to subtract: every kernel of this lesson returns zeros for it, and its
log-sum-exp is -inf, as FlashAttention does (a NaN would spread through the next layer).

Attention: S = Q K^T * scale (scale = 1 / sqrt(d) by default), P = softmax(S) row by row (causal: query i sees keys
j <= i only), O = P V; lse = the log-sum-exp of each row of S, kept for the backward pass, which recomputes P from
it (P = exp(S - lse)) instead of storing the N x N matrix.
"""
from __future__ import annotations

import math

import numpy as np

from gpucourse import runtime


# --------------------------------------------------------------------------------------------- softmax

def softmax_naive(x: np.ndarray) -> np.ndarray:
    """exp(x) / sum(exp(x)) along the last axis, without subtracting the max: overflows where exp(x) does
    (x > 88.7 in float32, x > 11.1 in float16)."""
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def softmax_spec(x: np.ndarray) -> np.ndarray:
    """Softmax along the last axis in three passes: the max, the sum of exp(x - max), then each exp(x - max) / sum;
    in float64. A row of -inf gives zeros."""
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    safe = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(x - safe)
    s = e.sum(axis=-1, keepdims=True)
    return np.where(s > 0, e / np.where(s > 0, s, 1.0), 0.0)


def online_softmax_spec(x: np.ndarray, block: int = 1) -> tuple:
    """The one-pass online softmax (Milakov and Gimelshein, 2018) of one row, ``block`` elements at a time: a
    running max m and a running sum l of exp(x - m), rescaled by exp(m_old - m_new) whenever the max grows. Returns
    (softmax, m, l) with the row's max and its sum of exp(x - max)."""
    x = np.asarray(x, dtype=np.float64).ravel()
    m, l = -math.inf, 0.0
    for i in range(0, x.size, block):
        xb = x[i:i + block]
        m_new = max(m, float(xb.max()))
        if m_new == -math.inf:
            continue
        l = l * math.exp(m - m_new) + float(np.exp(xb - m_new).sum())
        m = m_new
    if l == 0.0:
        return np.zeros_like(x), m, l
    return np.exp(x - m) / l, m, l


def merge_partials(m1, l1, o1, m2, l2, o2) -> tuple:
    """Merge two partial results of softmax-weighted sums over two disjoint sets of keys into one: each part holds
    its max m, its sum l of exp(s - m) and its unnormalised output o = sum exp(s - m) v. With m = max(m1, m2):
    l = l1 exp(m1 - m) + l2 exp(m2 - m) and o = o1 exp(m1 - m) + o2 exp(m2 - m); o / l is then the softmax-weighted
    sum over both sets. Works elementwise (arrays of rows); an empty part has m = -inf, l = 0, o = 0."""
    m1, l1, o1, m2, l2, o2 = (np.asarray(a, dtype=np.float64) for a in (m1, l1, o1, m2, l2, o2))
    m = np.maximum(m1, m2)
    safe = np.where(np.isneginf(m), 0.0, m)
    a1 = np.where(np.isneginf(m1), 0.0, np.exp(m1 - safe))
    a2 = np.where(np.isneginf(m2), 0.0, np.exp(m2 - safe))
    l = l1 * a1 + l2 * a2
    o = o1 * (a1[..., None] if o1.ndim > a1.ndim else a1) + o2 * (a2[..., None] if o2.ndim > a2.ndim else a2)
    return m, l, o


# ------------------------------------------------------------------------------------------- attention

def check_qkv(q, k, v, what: str = "attention") -> tuple:
    """(B, H, N, d) of q, k and v, all of shape (batch, heads, N, d) (or (N, d), (heads, N, d)); a clear error if they
    do not match."""
    if not (q.shape == k.shape == v.shape):
        raise runtime.CourseInputError(f"{what}: q, k and v must have one shape, got {tuple(q.shape)}, "
                                       f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not 2 <= q.ndim <= 4:
        raise runtime.CourseInputError(f"{what}: q, k, v are (N, d), (heads, N, d) or (batch, heads, N, d); got "
                                       f"{q.ndim} dimensions")
    shape = (1,) * (4 - q.ndim) + tuple(q.shape)
    if shape[2] < 1 or shape[3] < 1:
        raise runtime.CourseInputError(f"{what}: N and d must be at least 1, got shape {tuple(q.shape)}")
    return shape


def _scale(d: int, scale) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def scores_spec(q, k, *, causal: bool = False, window: int | None = None, scale=None) -> np.ndarray:
    """S = q k^T * scale in float64, -inf above the diagonal when ``causal``. With ``window`` W (sliding-window
    attention, as in Mistral's and Gemma's local layers), query i sees key j only when i - W < j <= i: its own key
    and the W - 1 before it (W >= N is the causal mask)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    s = np.einsum("...id,...jd->...ij", q, k) * _scale(q.shape[-1], scale)
    if window is not None and (isinstance(window, bool) or int(window) != window or window < 1):
        raise runtime.CourseInputError(f"window must be a whole number of keys >= 1, got {window!r}")
    if causal or window is not None:
        i, j = np.arange(s.shape[-2])[:, None], np.arange(s.shape[-1])[None, :]
        seen = (j <= i) & (j > i - (window if window is not None else s.shape[-1]))
        s = np.where(seen, s, -np.inf)
    return s


def attention_spec(q, k, v, *, causal: bool = False, window: int | None = None, scale=None) -> tuple:
    """(O, lse): O = softmax(q k^T * scale) v and the natural log-sum-exp of each row of the scores, in float64;
    ``causal`` and ``window`` mask the scores as in ``scores_spec``."""
    check_qkv(q, k, v, "attention_spec")
    s = scores_spec(q, k, causal=causal, window=window, scale=scale)
    m = s.max(axis=-1, keepdims=True)
    safe = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(s - safe)
    l = e.sum(axis=-1, keepdims=True)
    o = np.where(l > 0, (e @ np.asarray(v, np.float64)) / np.where(l > 0, l, 1.0), 0.0)
    lse = np.where(l[..., 0] > 0, safe[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)), -np.inf)
    return o, lse


def attention_backward_spec(q, k, v, do, *, causal: bool = False, window: int | None = None, scale=None) -> tuple:
    """(dq, dk, dv) of attention's output O with upstream gradient dO, in float64, as FlashAttention computes them:
    P recomputed from the log-sum-exp, dV = P^T dO, dP = dO V^T, D = rowsum(dO * O), dS = P (dP - D),
    dQ = dS K scale, dK = dS^T Q scale; ``causal`` and ``window`` mask the scores as in ``scores_spec``."""
    q, k, v, do = (np.asarray(a, np.float64) for a in (q, k, v, do))
    sc = _scale(q.shape[-1], scale)
    o, lse = attention_spec(q, k, v, causal=causal, window=window, scale=scale)
    s = scores_spec(q, k, causal=causal, window=window, scale=scale)
    p = np.where(np.isneginf(lse)[..., None], 0.0, np.exp(s - np.where(np.isneginf(lse), 0.0, lse)[..., None]))
    dv = np.swapaxes(p, -1, -2) @ do
    dp = do @ np.swapaxes(v, -1, -2)
    D = (do * o).sum(axis=-1, keepdims=True)
    ds = p * (dp - D)
    return ds @ k * sc, np.swapaxes(ds, -1, -2) @ q * sc, dv


# -------------------------------------------------------------------------------------- what it costs

def attention_flops(batch: int, heads: int, n: int, d: int, *, causal: bool = False, backward: bool = False) -> float:
    """FLOPs of attention's two GEMMs (the convention of FlashAttention's papers and PyTorch's benchmarks):
    4 B H N^2 d forward (Q K^T and P V, 2 N^2 d each), half that with a causal mask; the backward pass is 2.5 times
    the forward (five GEMMs against two)."""
    f = 4.0 * batch * heads * n * n * d * (0.5 if causal else 1.0)
    return f * 2.5 if backward else f


def attention_bytes(batch: int, heads: int, n: int, d: int, itemsize: int = 2, *, fused: bool = True) -> float:
    """Bytes attention must move through device memory: fused (FlashAttention), Q, K, V read and O written once
    (plus the float32 log-sum-exp); unfused, also S and P of N x N written and read back."""
    qkvo = 4.0 * batch * heads * n * d * itemsize + 4.0 * batch * heads * n
    if fused:
        return qkvo
    return qkvo + batch * heads * n * n * (2 * 4 + 2 * itemsize)  # S (fp32) written and read, P written and read


def bound(flops: float, nbytes: float, peak_tflops: float, bandwidth_gbps: float) -> dict:
    """Which ceiling a kernel meets first: its arithmetic intensity (FLOP per byte) against the ridge point peak /
    bandwidth; the time each ceiling allows and the larger of the two (the floor)."""
    if not (flops >= 0 and nbytes > 0 and peak_tflops > 0 and bandwidth_gbps > 0):
        raise runtime.CourseInputError("need flops >= 0, bytes > 0 and positive ceilings")
    intensity, ridge = flops / nbytes, peak_tflops * 1e12 / (bandwidth_gbps * 1e9)
    compute_s, memory_s = flops / (peak_tflops * 1e12), nbytes / (bandwidth_gbps * 1e9)
    return {"intensity": intensity, "ridge": ridge, "bound": "compute" if intensity > ridge else "memory",
            "compute_s": compute_s, "memory_s": memory_s, "floor_s": max(compute_s, memory_s)}

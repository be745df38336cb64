"""Lesson 10, attention's forward pass in FP8 (e4m3), as FlashAttention-3 runs it on Hopper, in NumPy: the numerics an
FP8 kernel is checked against, beside the same tiled forward in FP16.

* Q, K and V quantised to e4m3 with one float32 scale per block of rows (``quantize_blocks``: scale = amax / 448, the
  block's largest magnitude mapped to e4m3's largest value); Q in blocks of ``block_m`` rows, K and V of
  ``block_n``, the tiles the kernel loads. On the GPU V is stored transposed (d x N): FP8 ``wgmma`` reads both
  operands K-major, and in P V the reduction runs over the keys. The transpose moves bytes, not values: the numbers
  here are the same.
* S = Q K^T of the codes' values, accumulated in float32, times the two blocks' scales and the softmax scale.
* The online softmax in float32 (running max, running sum, rescaled accumulator), as the FP16 kernel's.
* P quantised to e4m3 for P V. P = exp(S - max) lies in [0, 1], where e4m3 has its normals only down to 2^-6 and
  its subnormals to 2^-9: everything below ~0.001 would lose bits or vanish. So P is computed times
  ``p_scale`` = 256 = 2^8 (FlashAttention-3 subtracts 8 from the exponent before its exp2: the scale costs no
  instruction, is exact, and its largest value 256 stays below 448). The row sum is taken from the same rounded P
  times 256 (on Hopper the tensor cores sum it, a tile at a time, as they do P V), so dividing O by it cancels the
  scale, and O is a weighted mean of V with weights that sum to 1. P V then gets V's block scale.
* FP8 ``wgmma`` on Hopper accumulates with fewer bits than float32 (DeepSeek-V3's report: about 14); NumPy
  accumulates in full float32, so these figures are a floor for the kernel's error, not its value.

``random_hadamard(d, seed)``: FlashAttention-3's incoherent processing. An orthogonal H (a Walsh-Hadamard matrix over
sqrt(d) times a random diagonal of +-1) applied to Q and K leaves Q K^T unchanged, (Q H)(K H)^T = Q H H^T K^T, and
spreads a channel's outlier over all d channels: e4m3 rounds each entry to 3 mantissa bits, so an error in proportion
to the outlier no longer lands whole on one term of every dot product (measured in ``error_figures``).

``fp16_attention`` runs the same tiles with Q, K, V and P rounded to float16: the FP16 kernel's numerics.
"""
from __future__ import annotations

import math

import numpy as np

from gpucourse import runtime

from kernels.inference_engine.precision import e4m3_scale, from_e4m3, to_e4m3

from .specs import _scale, attention_spec, check_qkv

P_SCALE = 256.0  # P = exp(S - max) times 2^8 before it is rounded to e4m3 (see the module's docstring)


def quantize_blocks(x, rows: int) -> tuple:
    """(codes, scales) of x (..., N, d) in e4m3 with one scale per block of ``rows`` rows: codes uint8 of x's shape,
    scales float32 of shape (..., ceil(N / rows)), scale = amax / E4M3_MAX of the block (1 for a block of zeros), so
    that x ~ from_e4m3(codes) * scale. ``rows`` = N is one scale per tensor (per head)."""
    x = np.asarray(x, np.float32)
    if isinstance(rows, bool) or int(rows) != rows or rows < 1:
        raise runtime.CourseInputError(f"rows must be a whole number >= 1, got {rows!r}")
    n = x.shape[-2]
    nb = -(-n // rows)
    pad = nb * rows - n
    xp = np.concatenate([x, np.zeros(x.shape[:-2] + (pad, x.shape[-1]), np.float32)], axis=-2) if pad else x
    blocks = xp.reshape(x.shape[:-2] + (nb, rows, x.shape[-1]))
    scales = e4m3_scale(np.abs(blocks).max(axis=(-2, -1)))
    codes = to_e4m3(blocks / scales[..., None, None]).reshape(xp.shape)[..., :n, :]
    return codes, scales


def dequantize_blocks(codes, scales, rows: int) -> np.ndarray:
    """float32 values of block-quantised codes: from_e4m3(codes) times each row's block scale."""
    per_row = np.repeat(np.asarray(scales, np.float32), rows, axis=-1)[..., :np.shape(codes)[-2]]
    return from_e4m3(codes) * per_row[..., None]


def random_hadamard(d: int, seed=0) -> np.ndarray:
    """An orthogonal d x d matrix, H = W diag(s) / sqrt(d): W the Walsh-Hadamard matrix of +-1 (Sylvester's
    construction, d a power of 2), s random signs drawn from ``seed``."""
    if isinstance(d, bool) or int(d) != d or d < 1 or d & (d - 1):
        raise runtime.CourseInputError(f"the Hadamard rotation needs a head dim that is a power of 2, got {d!r}")
    w = np.ones((1, 1))
    while w.shape[0] < d:
        w = np.block([[w, w], [w, -w]])
    s = np.random.default_rng(seed).choice((-1.0, 1.0), size=d)
    return w * s[None, :] / math.sqrt(d)


def _tiled_forward(q, k, v, sq, sk, sv, *, causal, scale, block_m, block_n, round_p, p_scale,
                   sum_rounded=False):
    """The tiled forward over (BH, N, d) operand values q, k, v (float32, exactly what the tensor cores read) with a
    scale per tile (sq per query tile, sk and sv per key tile): returns (o, lse) in float32. ``sum_rounded``: the
    row sums of P as rounded for P V (the FP8 kernel's), else of the float32 P (the FP16 kernel's)."""
    bh, n, d = q.shape
    f32 = np.float32
    sc = f32(_scale(d, scale))
    o, lse = np.zeros((bh, n, d), f32), np.zeros((bh, n), f32)
    for i in range(-(-n // block_m)):
        rows = slice(i * block_m, min(n, (i + 1) * block_m))
        m = np.full((bh, rows.stop - rows.start), -np.inf, f32)
        l, acc = np.zeros_like(m), np.zeros((bh, rows.stop - rows.start, d), f32)
        last = rows.stop if causal else n
        for j in range(-(-last // block_n)):
            cols = slice(j * block_n, min(n, (j + 1) * block_n))
            s = (q[:, rows] @ np.swapaxes(k[:, cols], -1, -2)) * (sq[:, i, None, None] * sk[:, j, None, None] * sc)
            if causal:
                qi, kj = np.arange(rows.start, rows.stop)[:, None], np.arange(cols.start, cols.stop)[None, :]
                s = np.where(kj <= qi, s, -np.inf).astype(f32)
            m_new = np.maximum(m, s.max(axis=-1))
            safe = np.where(np.isneginf(m_new), 0, m_new).astype(f32)
            alpha = np.where(np.isneginf(m), 0, np.exp(m - safe)).astype(f32)
            p = np.exp(s - safe[..., None]) * f32(p_scale)  # in [0, p_scale]
            pr = round_p(p)
            l = l * alpha + (pr if sum_rounded else p).sum(axis=-1)
            acc = acc * alpha[..., None] + (pr @ v[:, cols]) * sv[:, j, None, None]
            m = m_new
        ok = l > 0
        o[:, rows] = np.where(ok[..., None], acc / np.where(ok, l, 1)[..., None], 0)
        lse[:, rows] = np.where(ok, m + np.log(np.where(ok, l, 1) / f32(p_scale)), -np.inf)
    return o, lse


def _prepare(q, k, v, hadamard, what):
    shape = check_qkv(q, k, v, what)
    bh, n, d = shape[0] * shape[1], shape[2], shape[3]
    q, k, v = (np.asarray(a, np.float64).reshape(bh, n, d) for a in (q, k, v))
    if hadamard is not None:
        h = random_hadamard(d, hadamard)
        q, k = q @ h, k @ h
    return q, k, v


def fp8_attention(q, k, v, *, causal: bool = False, scale=None, block_m: int = 64, block_n: int = 64,
                  hadamard=None, per_block: bool = True, p_scale: float = P_SCALE) -> tuple:
    """(o, lse) of attention with Q, K, V and P in e4m3 (see the module's docstring), float32, of q's shape (lse
    without d). ``hadamard``: None, or the seed of ``random_hadamard`` applied to Q and K first. ``per_block``
    False: one scale per tensor (per head) instead of one per tile of rows."""
    out_shape = np.shape(q)
    qr, kr, vr = _prepare(q, k, v, hadamard, "fp8_attention")
    n = qr.shape[1]
    rq, rk = (block_m, block_n) if per_block else (n, n)
    (cq, sq), (ck, sk), (cv, sv) = quantize_blocks(qr, rq), quantize_blocks(kr, rk), quantize_blocks(vr, rk)
    if not per_block:  # the one scale of each head, for every tile
        sq = np.repeat(sq, -(-n // block_m), axis=-1)
        sk, sv = (np.repeat(s, -(-n // block_n), axis=-1) for s in (sk, sv))
    o, lse = _tiled_forward(from_e4m3(cq), from_e4m3(ck), from_e4m3(cv), sq, sk, sv, causal=causal, scale=scale,
                            block_m=block_m, block_n=block_n, round_p=lambda p: from_e4m3(to_e4m3(p)),
                            p_scale=p_scale, sum_rounded=True)
    return o.reshape(out_shape), lse.reshape(out_shape[:-1])


def fp16_attention(q, k, v, *, causal: bool = False, scale=None, block_m: int = 64, block_n: int = 64,
                   hadamard=None) -> tuple:
    """(o, lse) of the same tiled forward with Q, K, V and P rounded to float16 (the FP16 kernel's numerics: its
    GEMMs accumulate in float32), float32."""
    out_shape = np.shape(q)
    qr, kr, vr = (a.astype(np.float16).astype(np.float32) for a in _prepare(q, k, v, hadamard, "fp16_attention"))
    bh, n = qr.shape[:2]
    one_q, one_k = np.ones((bh, -(-n // block_m)), np.float32), np.ones((bh, -(-n // block_n)), np.float32)
    o, lse = _tiled_forward(qr, kr, vr, one_q, one_k, one_k, causal=causal, scale=scale, block_m=block_m,
                            block_n=block_n, round_p=lambda p: p.astype(np.float16).astype(np.float32), p_scale=1.0)
    return o.reshape(out_shape), lse.reshape(out_shape[:-1])


def rmse(o, ref) -> float:
    """Root-mean-square error of o against ref (FlashAttention-3's measure of FP8's error)."""
    return float(np.sqrt(np.mean((np.asarray(o, np.float64) - np.asarray(ref, np.float64)) ** 2)))


def outlier_inputs(rng, shape, *, kind: str = "entries", fraction: float = 0.001, std: float = 10.0) -> tuple:
    """Q, K, V (float64) of N(0, 1) with outliers. ``kind="entries"``: FlashAttention-3's test, each entry given an
    extra N(0, std^2) with probability ``fraction`` (0.1%, N(0, 100)). ``kind="channels"``: what LLMs' activations
    show, a few channels (``fraction`` of d, at least one) of Q and K ``std`` times larger in every row."""
    q, k, v = (rng.standard_normal(shape) for _ in range(3))
    if kind == "entries":
        for x in (q, k, v):
            x += rng.standard_normal(shape) * std * (rng.random(shape) < fraction)
    elif kind == "channels":
        d = shape[-1]
        ch = rng.choice(d, size=max(1, round(fraction * d)), replace=False)
        q[..., ch] *= std
        k[..., ch] *= std
    else:
        raise runtime.CourseInputError(f"kind must be 'entries' or 'channels', got {kind!r}")
    return q, k, v


def error_figures(n: int = 256, d: int = 64, heads: int = 4, *, causal: bool = False, block: int = 64,
                  seed: int = 0) -> dict:
    """RMSE of O against the float64 reference for FP16 and FP8 (per block, per tensor, with and without the
    Hadamard rotation) on three inputs: Gaussian N(0, 1), FlashAttention-3's outlier entries and outlier channels
    (``outlier_inputs``). Deterministic for a given ``seed``."""
    rng = np.random.default_rng(seed)
    inputs = {"gaussian": tuple(rng.standard_normal((heads, n, d)) for _ in range(3)),
              "outlier entries": outlier_inputs(rng, (heads, n, d), kind="entries"),
              "outlier channels": outlier_inputs(rng, (heads, n, d), kind="channels", fraction=2 / d, std=5.0)}
    out = {}
    for name, (q, k, v) in inputs.items():
        ref = attention_spec(q, k, v, causal=causal)[0]
        kw = dict(causal=causal, block_m=block, block_n=block)
        out[name] = {
            "fp16": rmse(fp16_attention(q, k, v, **kw)[0], ref),
            "fp8 per tensor": rmse(fp8_attention(q, k, v, per_block=False, **kw)[0], ref),
            "fp8 per block": rmse(fp8_attention(q, k, v, **kw)[0], ref),
            "fp8 per block + hadamard": rmse(fp8_attention(q, k, v, hadamard=seed, **kw)[0], ref),
        }
    return out


def format_error_figures(figs: dict) -> str:
    """The figures of ``error_figures`` as a Markdown table (RMSE of O, three significant digits)."""
    cols = list(next(iter(figs.values())))
    lines = ["| inputs | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]
    for name, row in figs.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:.3g}" for c in cols) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m kernels.attention.fp8: the table of docs/engineering/10_attention.md
    print(format_error_figures(error_figures()))

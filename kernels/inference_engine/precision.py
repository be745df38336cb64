"""Precision: FP32, FP16, INT8 and FP8 (e4m3) storage; INT8 calibration (min-max, percentile, entropy scales) and
quantise / dequantise; FP8's codes (``to_e4m3``, ``from_e4m3``), which NumPy has no type for.
"""
from __future__ import annotations

import math

import numpy as np

from gpucourse import runtime

from .graph import Graph
from .specs import run_graph


PRECISIONS = ("fp32", "fp16", "int8")  # what any network gets, on any GPU the course supports
ALL_PRECISIONS = PRECISIONS + ("fp8",)  # and FP8: on Hopper's wgmma kernels, for networks whose convolutions they take
CALIBRATIONS = ("minmax", "percentile", "entropy")
DTYPES = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8, "fp8": np.uint8}  # FP8: e4m3 codes, as bytes
SUFFIX = {"fp32": "f32", "fp16": "f16", "int8": "i8", "fp8": "f8"}
SCALED = ("int8", "fp8")  # the precisions with calibrated scales: x ~ scale q
Q = 127  # symmetric INT8: values -127 .. 127
E4M3_MAX = 448.0  # FP8 e4m3's largest finite value (1.75 x 2^8); it has no infinity, and 0x7F / 0xFF are NaN


def _e4m3_table() -> np.ndarray:
    """The value of each of the 256 e4m3 codes: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 holds
    the subnormals (m / 8 x 2^-6)."""
    code = np.arange(256)
    e, m = (code >> 3) & 0xF, code & 7
    mag = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    v = np.where(code & 0x80, -mag, mag)
    v[(code & 0x7F) == 0x7F] = np.nan
    return v.astype(np.float32)


E4M3 = _e4m3_table()


def from_e4m3(codes) -> np.ndarray:
    """float32 values of e4m3 codes (uint8)."""
    return E4M3[np.asarray(codes, np.uint8)]


def e4m3_scale(amax):
    """float32 scales that map each largest magnitude ``amax`` (a number or an array: per tensor, channel or block) to
    e4m3's largest value, x ~ scale e4m3(x / scale); 1 where amax is 0 (any scale represents zeros). A CuPy array
    gives a CuPy array (the GPU quantiser's scales stay on the GPU)."""
    xp = __import__("cupy") if type(amax).__module__.startswith("cupy") else np
    amax = xp.asarray(amax, np.float32)
    return xp.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)


def to_e4m3(x) -> np.ndarray:
    """e4m3 codes (uint8) of float values, as the GPU converts them (cvt.rn.satfinite: to nearest, ties to the even
    code, magnitudes beyond 448 to 448; NaN to NaN)."""
    x = np.asarray(x, np.float32)
    pos = E4M3[:0x7F]  # codes 0 .. 126: the non-negative finite values, increasing
    a = np.minimum(np.abs(x), np.float32(E4M3_MAX))
    hi = np.clip(np.searchsorted(pos, a), 1, 126)
    lo = hi - 1
    dlo, dhi = a - pos[lo], pos[hi] - a
    code = np.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), hi, lo)
    code = np.where(a >= pos[126], 126, code)
    out = (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)
    out[np.isnan(x)] = 0x7F
    return out


def minmax_scale(x) -> float:
    """Symmetric INT8 scale from the largest magnitude: x ~ scale q, q in -127 .. 127. A tensor of zeros
    gets scale 1 (any scale represents it)."""
    m = float(abs(x).max()) if x.size else 0.0  # array methods: NumPy and CuPy arrays alike
    return m / Q if m > 0 else 1.0


def percentile_scale(x, percentile: float = 99.99) -> float:
    """Scale from a percentile of |x|: the rare largest values saturate, the rest get finer steps."""
    m = float(np.percentile(np.abs(x), percentile)) if np.size(x) else 0.0
    return m / Q if m > 0 else minmax_scale(x)


def entropy_scale(x, bins: int = 2048, levels: int = 128, step: int = 16) -> float:
    """TensorRT's entropy calibration: the clipping threshold T whose INT8 version of the histogram of |x|
    loses the least information (smallest Kullback-Leibler divergence KL(P || Q)), scale T / 127. P: the
    first i bins of the histogram, everything past them added to the last; Q: the same i bins merged into
    128 levels and spread back evenly over the bins that were not empty. Thresholds tried every ``step``
    bins. The first bin's count is replaced by the second's, as NVIDIA's calibrator does (pytorch-quantization's
    ``_compute_amax_entropy``: ``bins[0] = bins[1]``): after a ReLU, half the values or more are exact zeros, and
    a first bin that holds them all makes the divergence of every threshold a question of that one bin, so the
    search clipped ResNet-50's activations at ~40% of their largest value (an INT8 plan calibrated so agreed
    with FP32 on 2% of the inputs)."""
    a = np.abs(np.asarray(x, np.float64)).ravel()
    top = a.max() if a.size else 0.0
    if top == 0:
        return 1.0
    hist, edges = np.histogram(a, bins=bins, range=(0, top))
    hist = hist.astype(np.float64)
    hist[0] = hist[1]
    best, best_i = math.inf, bins
    for i in range(levels, bins + 1, step):
        p = hist[:i].copy()
        p[-1] += hist[i:].sum()  # everything past the threshold saturates into the last bin
        nz = hist[:i] > 0
        starts = np.linspace(0, i, levels + 1).astype(int)
        sums = np.add.reduceat(hist[:i], starts[:-1])
        counts = np.add.reduceat(nz.astype(np.float64), starts[:-1])
        q = np.repeat(np.where(counts > 0, sums / np.maximum(counts, 1), 0.0), np.diff(starts)) * nz
        keep = p > 0
        if not keep.any() or np.any(q[keep] == 0):
            continue
        pn, qn = p[keep] / p.sum(), q[keep] / q.sum()
        kl = float(np.sum(pn * np.log(pn / qn)))
        if kl < best:
            best, best_i = kl, i
    return float(edges[best_i]) / Q


SCALE_METHODS = {"minmax": minmax_scale, "percentile": percentile_scale, "entropy": entropy_scale}


def quantize(x, scale: float):
    """INT8 codes of x: round(x / scale) (halves to even), clipped to -127 .. 127."""
    return np.clip(np.rint(x / np.float32(scale)), -Q, Q).astype(np.int8)


def dequantize(q, scale: float):
    return q.astype(np.float32) * np.float32(scale)


def calibrate(g: Graph, x_calib, method: str = "percentile", precision: str = "int8") -> dict:
    """{tensor: scale} for every tensor that gets a buffer, from the FP32 activations of a sample: INT8's (the
    largest magnitude kept, by ``method``, over 127), or FP8's (the same magnitude over 448: e4m3's range)."""
    if method not in SCALE_METHODS:
        raise runtime.CourseInputError(f"calibration must be one of {', '.join(SCALE_METHODS)}, not {method!r}")
    _, vals = run_graph(g, x_calib, keep=True)
    scales = {t: SCALE_METHODS[method](v) for t, v in vals.items() if t not in g.aliases}
    if precision == "fp8":
        scales = {t: s * Q / E4M3_MAX for t, s in scales.items()}
    for n in g.nodes:  # a max pool keeps the scale of its input: the max of integers is exact
        if n.op == "MaxPool":
            scales[_root(g, n.outputs[0])[0]] = scales[_root(g, n.inputs[0])[0]]
    return scales


def _root(g: Graph, t: str) -> tuple:
    off = 0
    while t in g.aliases:
        t, o = g.aliases[t]
        off += o
    return t, off

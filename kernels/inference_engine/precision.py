"""Precision: FP32, FP16 and INT8 storage; INT8 calibration (min-max, percentile, entropy scales) and
quantise / dequantise.
"""
from __future__ import annotations

import math

import numpy as np

from gpucourse import runtime

from .graph import Graph
from .specs import run_graph


PRECISIONS = ("fp32", "fp16", "int8")
CALIBRATIONS = ("minmax", "percentile", "entropy")
DTYPES = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8}
SUFFIX = {"fp32": "f32", "fp16": "f16", "int8": "i8"}
Q = 127  # symmetric INT8: values -127 .. 127


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
    bins."""
    a = np.abs(np.asarray(x, np.float64)).ravel()
    top = a.max() if a.size else 0.0
    if top == 0:
        return 1.0
    hist, edges = np.histogram(a, bins=bins, range=(0, top))
    hist = hist.astype(np.float64)
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


def calibrate(g: Graph, x_calib, method: str = "percentile") -> dict:
    """{tensor: INT8 scale} for every tensor that gets a buffer, from the FP32 activations of a sample."""
    if method not in SCALE_METHODS:
        raise runtime.CourseInputError(f"calibration must be one of {', '.join(SCALE_METHODS)}, not {method!r}")
    _, vals = run_graph(g, x_calib, keep=True)
    scales = {t: SCALE_METHODS[method](v) for t, v in vals.items() if t not in g.aliases}
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

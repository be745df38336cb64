"""NumPy specs: what each op computes (convolution through im2col, fused conv + bias + ReLU, batch norm,
pools), and ``run_graph``, the reference every optimised graph and plan is checked against.
"""
from __future__ import annotations

import numpy as np

from gpucourse import runtime

from .graph import Graph


def im2col(x: np.ndarray, kh: int, kw: int) -> np.ndarray:
    """N x H x W x C -> N x H x W x (kh kw C): every output pixel's receptive field ("same" padding), ordered
    (dy, dx, c) like a Keras kernel kh x kw x C x K reshaped to (kh kw C) x K."""
    n, h, w, c = x.shape
    xp = np.pad(x, ((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2), (0, 0)))
    return np.concatenate([xp[:, dy:dy + h, dx:dx + w, :] for dy in range(kh) for dx in range(kw)], axis=-1)


def conv_spec(x, w) -> np.ndarray:
    """The convolution of a Keras Conv2D (stride 1, "same"), NHWC, in float64: N x H x W x K."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    kh, kw, c, k = w.shape
    return im2col(x, kh, kw) @ w.reshape(kh * kw * c, k)


def cbr_spec(x, w, b, relu: bool = True) -> np.ndarray:
    """conv + bias + ReLU in float64: what one fused CBR kernel computes."""
    y = conv_spec(x, w) + np.asarray(b, np.float64)
    return np.maximum(y, 0.0) if relu else y


def batchnorm_spec(y, gamma, beta, mean, var, eps) -> np.ndarray:
    return (np.asarray(y, np.float64) - mean) / np.sqrt(np.asarray(var, np.float64) + eps) * gamma + beta


def fold_bn_weights(w, b, gamma, beta, mean, var, eps):
    """(w', b') such that conv(x, w') + b' = batchnorm(conv(x, w) + b): the batch norm's per-channel scale
    gamma / sqrt(var + eps) multiplies each output channel's weights (the last axis of w), and the bias
    becomes (b - mean) scale + beta. b may be None (a convolution without bias). Same dtype as w."""
    s = np.asarray(gamma, np.float64) / np.sqrt(np.asarray(var, np.float64) + eps)
    b0 = np.zeros_like(s) if b is None else np.asarray(b, np.float64)
    w2 = np.asarray(w, np.float64) * s
    return w2.astype(np.asarray(w).dtype), ((b0 - mean) * s + beta).astype(np.asarray(w).dtype)


def run_graph(g: Graph, x, *, keep: bool = False):
    """Execute a graph (imported or optimised) in float64 with NumPy: the reference for every pass. Returns
    the output, or (output, {tensor: value}) with ``keep``."""
    x = np.asarray(x, np.float64)
    vals = {g.input: x}

    def get(t):
        if t not in vals:  # a tensor assembled from the slices written into it (concatenation elimination)
            parts = sorted((off, s) for s, (tgt, off) in g.aliases.items() if tgt == t)
            vals[t] = np.concatenate([get(s) for _, s in parts], axis=-1)
        return vals[t]

    for n in g.nodes:
        ins = [get(t) for t in n.inputs]
        v = ins[0]
        W = n.weights
        if n.op == "Conv":
            out = [conv_spec(v, W["w"])]
        elif n.op == "BiasAdd":
            out = [v + W["b"]]
        elif n.op == "BatchNorm":
            out = [batchnorm_spec(v, W["gamma"], W["beta"], W["mean"], W["var"], n.attrs["eps"])]
        elif n.op == "Relu":
            out = [np.maximum(v, 0.0)]
        elif n.op == "MaxPool":
            out = [maxpool_spec(v, n.attrs["size"])]
        elif n.op == "Concat":
            out = [np.concatenate(ins, axis=-1)]
        elif n.op == "AvgPool":
            out = [avgpool_spec(v, n.attrs["size"])]
        elif n.op == "Flatten":
            out = [v.reshape(len(v), -1)]
        elif n.op == "Dense":
            out = [v @ W["w"].astype(np.float64) + W["b"]]
        elif n.op == "CBR":
            y = cbr_spec(v, W["w"], W["b"], n.attrs["relu"])
            out = np.split(y, np.cumsum(n.attrs["splits"])[:-1], axis=-1)
        elif n.op == "Head":
            p = avgpool_spec(v, n.attrs["size"])
            out = [p.reshape(len(p), -1) @ W["w"].astype(np.float64) + W["b"]]
        else:
            raise runtime.CourseError(f"node {n.name!r}: op {n.op!r} has no NumPy reference")
        vals.update(zip(n.outputs, out))
    result = get(g.output)
    return (result, vals) if keep else result


def maxpool_spec(x, size: int) -> np.ndarray:
    """Max over a size x size window, stride 1, "same" (the window clipped at the edges)."""
    n, h, w, c = x.shape
    r = size // 2
    xp = np.pad(x, ((0, 0), (r, r), (r, r), (0, 0)), constant_values=-np.inf)
    return np.max([xp[:, dy:dy + h, dx:dx + w, :] for dy in range(size) for dx in range(size)], axis=0)


def avgpool_spec(x, size: int) -> np.ndarray:
    n, h, w, c = x.shape
    return x.reshape(n, h // size, size, w // size, size, c).mean(axis=(2, 4))

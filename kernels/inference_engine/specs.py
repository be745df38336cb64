"""NumPy specs: what each op computes (convolution through im2col, fused conv + bias + ReLU, batch norm,
pools), and ``run_graph``, the reference every optimised graph and plan is checked against.
"""
from __future__ import annotations

import numpy as np

from gpucourse import runtime

from .graph import conv_geometry, Graph


def im2col(x: np.ndarray, kh: int, kw: int, stride: int = 1, pad=None) -> np.ndarray:
    """N x H x W x C -> N x Ho x Wo x (kh kw C): every output pixel's receptive field, ordered (dy, dx, c) like a
    Keras kernel kh x kw x C x K reshaped to (kh kw C) x K. ``pad`` = [top, bottom, left, right] zeros (default
    "same" for stride 1: kh // 2 and kw // 2); ``stride`` the step between output pixels."""
    n, h, w, c = x.shape
    t, b, l, r = pad if pad is not None else (kh // 2, kh // 2, kw // 2, kw // 2)
    xp = np.pad(x, ((0, 0), (t, b), (l, r), (0, 0)))
    ho, wo = (h + t + b - kh) // stride + 1, (w + l + r - kw) // stride + 1
    return np.concatenate([xp[:, dy:dy + stride * (ho - 1) + 1:stride, dx:dx + stride * (wo - 1) + 1:stride, :]
                           for dy in range(kh) for dx in range(kw)], axis=-1)


def conv_spec(x, w, stride: int = 1, pad=None) -> np.ndarray:
    """The convolution of a Keras Conv2D (default: stride 1, "same"), NHWC, in float64: N x Ho x Wo x K."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    kh, kw, c, k = w.shape
    return im2col(x, kh, kw, stride, pad) @ w.reshape(kh * kw * c, k)


def cbr_spec(x, w, b, relu: bool = True, stride: int = 1, pad=None, residual=None) -> np.ndarray:
    """conv + bias (+ a residual tensor) + ReLU in float64: what one fused CBR kernel computes."""
    y = conv_spec(x, w, stride, pad) + np.asarray(b, np.float64)
    if residual is not None:
        y = y + np.asarray(residual, np.float64)
    return np.maximum(y, 0.0) if relu else y


def softmax_spec(z) -> np.ndarray:
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


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


def run_graph(g: Graph, x, *, keep: bool = False, before=None, progress: str | None = None):
    """Execute a graph (imported or optimised) in float64 with NumPy: the reference for every pass. Returns
    the output, or (output, {tensor: value}) with ``keep`` (without it, each tensor is let go after its last
    reader). ``before(node, inputs)`` is called before each node runs (a calibration sets a node's weights from
    its inputs there); ``progress``: show a progress bar with this description."""
    x = np.asarray(x, np.float64)
    vals = {g.input: x}
    last_read = {t: i for i, n in enumerate(g.nodes) for t in n.inputs}

    def get(t):
        if t not in vals:  # a tensor assembled from the slices written into it (concatenation elimination)
            parts = sorted((off, s) for s, (tgt, off) in g.aliases.items() if tgt == t)
            vals[t] = np.concatenate([get(s) for _, s in parts], axis=-1)
        return vals[t]

    nodes = g.nodes
    if progress:
        from gpucourse import bench

        nodes = bench.progress(nodes, desc=progress)
    for i, n in enumerate(nodes):
        ins = [get(t) for t in n.inputs]
        if before is not None:
            before(n, ins)
        out = node_spec(n, ins)
        vals.update(zip(n.outputs, out))
        if not keep:
            for t in n.inputs:
                if last_read[t] == i and t != g.output and t not in g.aliases:
                    vals.pop(t, None)
    result = get(g.output)
    return (result, vals) if keep else result


def node_spec(n, ins: list) -> list:
    """The outputs of node ``n`` on its inputs ``ins`` (NumPy arrays, in float64): one op of ``run_graph``."""
    v = ins[0]
    W = n.weights
    if n.op == "Conv":
        out = [conv_spec(v, W["w"], *conv_geometry(n.attrs))]
    elif n.op == "BiasAdd":
        out = [v + W["b"]]
    elif n.op == "BatchNorm":
        out = [batchnorm_spec(v, W["gamma"], W["beta"], W["mean"], W["var"], n.attrs["eps"])]
    elif n.op == "Relu":
        out = [np.maximum(v, 0.0)]
    elif n.op == "MaxPool":
        out = [maxpool_spec(v, n.attrs["size"], n.attrs.get("stride", 1), n.attrs.get("pad"))]
    elif n.op == "Pad":
        t, b, l, r = n.attrs["pad"]
        out = [np.pad(v, ((0, 0), (t, b), (l, r), (0, 0)))]
    elif n.op == "Add":
        out = [ins[0] + ins[1]]
    elif n.op == "GlobalAvgPool":
        out = [v.mean(axis=(1, 2))]
    elif n.op == "Softmax":
        out = [softmax_spec(v)]
    elif n.op == "Concat":
        out = [np.concatenate(ins, axis=-1)]
    elif n.op == "AvgPool":
        out = [avgpool_spec(v, n.attrs["size"])]
    elif n.op == "Flatten":
        out = [v.reshape(len(v), -1)]
    elif n.op == "Dense":
        out = [v @ W["w"].astype(np.float64) + W["b"]]
    elif n.op == "CBR":
        y = cbr_spec(v, W["w"], W["b"], n.attrs["relu"], *conv_geometry(n.attrs),
                     residual=ins[1] if n.attrs.get("residual") else None)
        out = np.split(y, np.cumsum(n.attrs["splits"])[:-1], axis=-1)
    elif n.op == "Head":
        p = v.mean(axis=(1, 2)) if n.attrs.get("global") else avgpool_spec(v, n.attrs["size"])
        z = p.reshape(len(p), -1) @ W["w"].astype(np.float64) + W["b"]
        out = [softmax_spec(z) if n.attrs.get("softmax") else z]
    else:
        raise runtime.CourseError(f"node {n.name!r}: op {n.op!r} has no NumPy reference")
    return out


def maxpool_spec(x, size: int, stride: int = 1, pad=None) -> np.ndarray:
    """Max over a size x size window: by default stride 1, "same", the window clipped at the edges; with ``pad``
    = [top, bottom, left, right], the input padded with that many zeros (as Keras' ZeroPadding2D before a
    "valid" pool) and the windows ``stride`` apart."""
    n, h, w, c = x.shape
    if pad is None:
        r = size // 2
        t = b = l = rr = r
        xp = np.pad(x, ((0, 0), (r, r), (r, r), (0, 0)), constant_values=-np.inf)
    else:
        t, b, l, rr = pad
        xp = np.pad(x, ((0, 0), (t, b), (l, rr), (0, 0)))
    ho, wo = (h + t + b - size) // stride + 1, (w + l + rr - size) // stride + 1
    return np.max([xp[:, dy:dy + stride * (ho - 1) + 1:stride, dx:dx + stride * (wo - 1) + 1:stride, :]
                   for dy in range(size) for dx in range(size)], axis=0)


def avgpool_spec(x, size: int) -> np.ndarray:
    n, h, w, c = x.shape
    return x.reshape(n, h // size, size, w // size, size, c).mean(axis=(2, 4))

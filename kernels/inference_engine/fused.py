"""The fused conv + bias + ReLU (CBR) kernel in numba, the one learners write: ``cbr_direct`` and its
checked launcher ``cbr_numba``; its NumPy spec is ``specs.cbr_spec``.
"""
from __future__ import annotations

import math

import numpy as np

from gpucourse import runtime


cuda = runtime.cuda()

# The signatures tests/test_gpu_archs.py compiles every kernel of this module with, for each architecture.
NUMBA_KERNELS = {"cbr_direct": "void(float32[:, :, :, ::1], float32[:, :, :, ::1], float32[::1], float32[:, :, :, ::1])"}


@cuda.jit
def cbr_direct(x, w, b, y):
    """y = ReLU(conv(x, w) + b), NHWC, stride 1, "same" padding, one thread per output element (n, h, w, k),
    grid-stride: the sums stay in a register and each output is written once. x: N x H x W x C,
    w: KH x KW x C x K, b: K, y: N x H x W x K, all float32."""
    N, H, W, C = x.shape
    KH, KW, _, K = w.shape
    total = N * H * W * K
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for e in range(start, total, stride):
        k = e % K
        t = e // K
        col = t % W
        row = (t // W) % H
        n = t // (W * H)
        acc = b[k]
        for dy in range(KH):
            hh = row + dy - KH // 2
            if 0 <= hh < H:
                for dx in range(KW):
                    ww = col + dx - KW // 2
                    if 0 <= ww < W:
                        for c in range(C):
                            acc += x[n, hh, ww, c] * w[dy, dx, c, k]
        y[n, row, col, k] = max(acc, np.float32(0.0))


def cbr_numba(x, w, b, y, *, threads: int = 128, blocks: int | None = None):
    """Launch ``cbr_direct`` with checks; blocks default to one thread per output (capped in CPU mode)."""
    for name, a, nd in (("x", x, 4), ("w", w, 4), ("b", b, 1), ("y", y, 4)):
        runtime.check_device_array(a, name, dtype=np.float32, ndim=nd)
    n, h, wd, c = x.shape
    if w.shape[2] != c or w.shape[0] % 2 == 0 or w.shape[1] % 2 == 0:
        raise runtime.CourseInputError(f"w must be KH x KW x {c} x K with odd KH, KW; got {tuple(w.shape)}")
    if tuple(b.shape) != (w.shape[3],) or tuple(y.shape) != (n, h, wd, w.shape[3]):
        raise runtime.CourseInputError(f"b must have shape ({w.shape[3]},) and y {(n, h, wd, w.shape[3])}; got "
                                       f"{tuple(b.shape)} and {tuple(y.shape)}")
    total = n * h * wd * w.shape[3]
    if blocks is None:
        blocks = math.ceil(total / threads) if runtime.is_gpu() else min(math.ceil(total / threads), 4)
    cbr_direct[blocks, threads](x, w, b, y)
    return y

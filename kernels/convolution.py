"""Lesson 5 — convolution: direct, im2col + GEMM, and cuDNN (systems/convolution/cudnn.py).

Used by notebooks/05_convolution.ipynb, benchmarks/convolution.py and the tests:

* The arithmetic: ``output_size`` (padding, stride, dilation), the ResNet-50 layers of the lesson (LAYERS),
  FLOPs and bytes of a layer.
* NumPy specs in float64: ``conv2d_spec`` (cross-correlation, what deep learning calls convolution, NCHW),
  ``convolve_spec`` (the textbook convolution: the filter flipped), ``im2col_spec`` / ``im2col_nhwc_spec``
  and the convolution as one GEMM over the im2col matrix, layout conversions (NCHW <-> NHWC, Keras's HWIO
  filters -> KCRS / KRSC).
* A numba.cuda direct convolution, one thread per output element (runs in Numba's simulator): ``conv2d_numba``.
* CUDA C kernels of kernels/cuda/convolution.cu through CuPy: im2col for NCHW and NHWC, a register-tiled
  direct convolution on the CUDA cores (``conv_direct``), the same as an implicit GEMM with lesson 4's SGEMM
  tiling (``conv_direct_cores``: strict FP32, NCHW, 8 x 8 outputs a thread) and a direct convolution on the tensor cores
  (``conv_implicit_gemm``: WMMA, FP16 NHWC, im2col done in shared memory tile by tile, never written out);
  on Hopper, the same convolution as lesson 4's wgmma GEMM, its image tiles gathered by the TMA
  (``conv_wgmma``, kernels/cuda/convolution_wgmma.cu, sm_90a);
  ``conv_im2col_gemm`` runs im2col and then the GEMM through cuBLAS (FP16 on tensor cores; FP32 as strict FP32
  or as TF32 on tensor cores).
"""
from __future__ import annotations

import math

import numpy as np

from gpucourse import gpus, runtime

from gpucourse import cuda_c
from .tensor_cores import rel_error  # noqa: F401  (cv.rel_error: the course's one relative-error check)

cuda = runtime.cuda()

SOURCE = "convolution"  # kernels/cuda/convolution.cu
LAYOUTS = ("NCHW", "NHWC")
# ResNet-50's 3x3 convolutions at batch 32: name -> (N, C, H, W, K, R, S, pad, stride)
LAYERS = {
    "conv2_x: 56x56, C=K=64": (32, 64, 56, 56, 64, 3, 3, 1, 1),
    "conv3_x: 28x28, C=K=128": (32, 128, 28, 28, 128, 3, 3, 1, 1),
    "conv4_x: 14x14, C=K=256": (32, 256, 14, 14, 256, 3, 3, 1, 1),
}
# ResNet-50's stride-1 1 x 1 layers at batch 32, one of each shape: not in the "layers" figure; what the wgmma
# convolution's 1 x 1 goal (within 1.1x of cuDNN's fastest) is measured on, by benchmarks/convolution.py's race
LAYERS_1X1 = {
    "conv2_x 1x1: 56x56, C=64, K=256": (32, 64, 56, 56, 256, 1, 1, 0, 1),
    "conv2_x 1x1: 56x56, C=256, K=64": (32, 256, 56, 56, 64, 1, 1, 0, 1),
    "conv3_x 1x1: 28x28, C=128, K=512": (32, 128, 28, 28, 512, 1, 1, 0, 1),
    "conv3_x 1x1: 28x28, C=512, K=128": (32, 512, 28, 28, 128, 1, 1, 0, 1),
    "conv4_x 1x1: 14x14, C=256, K=1024": (32, 256, 14, 14, 1024, 1, 1, 0, 1),
    "conv4_x 1x1: 14x14, C=1024, K=256": (32, 1024, 14, 14, 256, 1, 1, 0, 1),
    "conv5_x 1x1: 7x7, C=512, K=2048": (32, 512, 7, 7, 2048, 1, 1, 0, 1),
    "conv5_x 1x1: 7x7, C=2048, K=512": (32, 2048, 7, 7, 512, 1, 1, 0, 1),
}
DIRECT_TILE = {"TQ": 16, "TP": 8, "KB": 64, "CB": 4, "threads": 256}  # as #defined in convolution.cu
# the tensor-core direct kernel's tiles, as instantiated in convolution.cu: conv_igemm_<BM>x<BN>_w<WM>x<WN>_s<STAGES>
IGEMM_CONFIGS = ("conv_igemm_128x128_w64x32_s3_nhwc_f16", "conv_igemm_128x64_w64x32_s3_nhwc_f16",
                 "conv_igemm_128x64_w32x32_s4_nhwc_f16", "conv_igemm_64x128_w32x64_s3_nhwc_f16",
                 "conv_igemm_64x64_w32x32_s3_nhwc_f16")
IGEMM_BK = 32  # the slice of R S C one step takes: one filter tap, 32 channels
# the CUDA-core implicit GEMM (FP32, NCHW), as instantiated in convolution.cu: conv_cores_<BM>x<BN>_b<B>_nchw_f32,
# BM output channels x BN output pixels a block, 8 x 8 a thread, compiled for B blocks an SM
CORES_CONFIGS = ("conv_cores_128x128_b2_nchw_f32", "conv_cores_128x128_b1_nchw_f32",
                 "conv_cores_64x128_b4_nchw_f32", "conv_cores_64x128_b1_nchw_f32",
                 "conv_cores_128x64_b4_nchw_f32", "conv_cores_128x64_b1_nchw_f32",
                 "conv_cores_64x64_b8_nchw_f32", "conv_cores_64x64_b1_nchw_f32")
CORES_SPLITS = (1, 2)  # blocks that share one tile's C R S (2: partial sums added into y, order-independent)
CORES_BK = 8  # the slice of C R S one step takes


# ============================================================================ shapes and arithmetic

def _pair(v, what: str) -> tuple:
    if np.isscalar(v):
        v = (v, v)
    v = tuple(int(a) for a in v)
    if len(v) != 2:
        raise runtime.CourseInputError(f"{what} must be one number or a pair (height, width), got {v}")
    return v


def output_size(h: int, r: int, pad: int = 0, stride: int = 1, dilation: int = 1) -> int:
    """Output length of a convolution along one axis: an input of h, a filter of r taps spaced ``dilation``
    apart (so it spans dilation (r - 1) + 1 inputs), ``pad`` zeros on each side, every ``stride``-th position:

        P = floor((h + 2 pad - dilation (r - 1) - 1) / stride) + 1
    """
    if h < 1 or r < 1 or pad < 0 or stride < 1 or dilation < 1:
        raise runtime.CourseInputError(f"need h, r, stride, dilation >= 1 and pad >= 0; got h={h}, r={r}, "
                                       f"pad={pad}, stride={stride}, dilation={dilation}")
    span = dilation * (r - 1) + 1
    if h + 2 * pad < span:
        raise runtime.CourseInputError(f"the filter spans {span} inputs but the padded input has only {h + 2 * pad}")
    return (h + 2 * pad - span) // stride + 1


def output_shape(x_shape, w_shape, pad=0, stride=1, dilation=1) -> tuple:
    """(N, K, P, Q) of x (N, C, H, W) convolved with w (K, C, R, S)."""
    (n, c, h, w), (k, c2, r, s) = x_shape, w_shape
    if c != c2:
        raise runtime.CourseInputError(f"x has {c} channels but the filters expect {c2}")
    (ph, pw), (sh, sw), (dh, dw) = _pair(pad, "pad"), _pair(stride, "stride"), _pair(dilation, "dilation")
    return n, k, output_size(h, r, ph, sh, dh), output_size(w, s, pw, sw, dw)


def layer_flops(layer: tuple) -> float:
    """Multiply-adds x 2 of one of LAYERS' convolutions: 2 N K P Q C R S."""
    n, c, h, w, k, r, s, pad, stride = layer
    _, _, p, q = output_shape((n, c, h, w), (k, c, r, s), pad, stride)
    return 2.0 * n * k * p * q * c * r * s


def im2col_bytes(layer: tuple, itemsize: int) -> int:
    """The size of the im2col matrix of a layer: (C R S) x (N P Q) elements, the memory im2col costs."""
    n, c, h, w, k, r, s, pad, stride = layer
    _, _, p, q = output_shape((n, c, h, w), (k, c, r, s), pad, stride)
    return c * r * s * n * p * q * itemsize


# ===================================================================================== NumPy specs

def conv2d_spec(x, w, pad=0, stride=1, dilation=1) -> np.ndarray:
    """y[n, k, p, q] = sum over c, r, s of x[n, c, p stride + r dilation - pad, q stride + s dilation - pad]
    w[k, c, r, s] (zero outside x), in float64: a cross-correlation, which deep-learning frameworks and cuDNN's
    CUDNN_CROSS_CORRELATION mode call convolution. x is NCHW, w is KCRS."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    if x.ndim != 4 or w.ndim != 4:
        raise runtime.CourseInputError(f"x (N, C, H, W) and w (K, C, R, S) must be 4-D, got {x.shape}, {w.shape}")
    n, k, P, Q = output_shape(x.shape, w.shape, pad, stride, dilation)
    (ph, pw), (sh, sw), (dh, dw) = _pair(pad, "pad"), _pair(stride, "stride"), _pair(dilation, "dilation")
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    y = np.zeros((n, k, P, Q))
    for r in range(w.shape[2]):
        for s in range(w.shape[3]):
            patch = xp[:, :, r * dh: r * dh + sh * (P - 1) + 1: sh, s * dw: s * dw + sw * (Q - 1) + 1: sw]
            y += np.einsum("ncpq,kc->nkpq", patch, w[:, :, r, s])
    return y


def convolve_spec(x, w, pad=0, stride=1, dilation=1) -> np.ndarray:
    """The textbook convolution (CUDNN_CONVOLUTION mode): the filter flipped in both axes, then
    cross-correlated. For learned filters the difference does not matter: the network learns them flipped."""
    return conv2d_spec(x, np.asarray(w)[:, :, ::-1, ::-1], pad, stride, dilation)


def bias_relu_spec(y, b, layout: str = "NCHW") -> np.ndarray:
    """max(y + b, 0) with one bias per output channel."""
    b = np.asarray(b, np.float64)
    shape = (1, -1, 1, 1) if layout == "NCHW" else (1, 1, 1, -1)
    return np.maximum(np.asarray(y, np.float64) + b.reshape(shape), 0.0)


def im2col_spec(x, r: int, s: int, pad=0, stride=1, dilation=1) -> np.ndarray:
    """The im2col matrix of x (N, C, H, W): shape (N, C R S, P Q); row c R S + r' S + s' of image n holds, for
    every output position p Q + q, the input that filter tap (c, r', s') meets there (0 in the padding).
    Then conv(x, w)[n] = w.reshape(K, C R S) @ cols[n]: the convolution is one GEMM per image (or one
    batched GEMM)."""
    x = np.asarray(x)
    if x.ndim != 4:
        raise runtime.CourseInputError(f"x must be (N, C, H, W), got shape {x.shape}")
    n, c, h, w = x.shape
    _, _, P, Q = output_shape(x.shape, (1, c, r, s), pad, stride, dilation)
    (ph, pw), (sh, sw), (dh, dw) = _pair(pad, "pad"), _pair(stride, "stride"), _pair(dilation, "dilation")
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    cols = np.empty((n, c, r, s, P, Q), x.dtype)
    for i in range(r):
        for j in range(s):
            cols[:, :, i, j] = xp[:, :, i * dh: i * dh + sh * (P - 1) + 1: sh, j * dw: j * dw + sw * (Q - 1) + 1: sw]
    return cols.reshape(n, c * r * s, P * Q)


def im2col_nhwc_spec(x, r: int, s: int, pad=0, stride=1, dilation=1) -> np.ndarray:
    """The im2col matrix of x in NHWC (N, H, W, C): shape (N P Q, R S C), row (n P + p) Q + q, column
    (r' S + s') C + c. Then conv = cols @ w_krsc.reshape(K, R S C).T is (N P Q, K): already NHWC."""
    x = np.asarray(x)
    cols = im2col_spec(x.transpose(0, 3, 1, 2), r, s, pad, stride, dilation)  # (N, C R S, P Q)
    n, c = x.shape[0], x.shape[3]
    pq = cols.shape[2]
    return cols.reshape(n, c, r * s, pq).transpose(0, 3, 2, 1).reshape(n * pq, r * s * c)


def conv2d_im2col_spec(x, w, pad=0, stride=1, dilation=1) -> np.ndarray:
    """conv2d through im2col and a matrix product, in float64: the same numbers as conv2d_spec."""
    k, c, r, s = np.shape(w)
    n, _, P, Q = output_shape(np.shape(x), (k, c, r, s), pad, stride, dilation)
    cols = im2col_spec(np.asarray(x, np.float64), r, s, pad, stride, dilation)
    return (np.asarray(w, np.float64).reshape(k, c * r * s) @ cols).reshape(n, k, P, Q)


def nchw_to_nhwc(x):
    return np.ascontiguousarray(np.asarray(x).transpose(0, 2, 3, 1))


def nhwc_to_nchw(x):
    return np.ascontiguousarray(np.asarray(x).transpose(0, 3, 1, 2))


def kcrs_to_krsc(w):
    return np.ascontiguousarray(np.asarray(w).transpose(0, 2, 3, 1))


def hwio_to_kcrs(w):
    """Keras / TensorFlow filters (R, S, C, K) -> cuDNN's NCHW filter layout (K, C, R, S)."""
    return np.ascontiguousarray(np.asarray(w).transpose(3, 2, 0, 1))


def tolerance(precision: str, crs: int) -> float:
    """The error max |y - ref| / max |ref| allowed for sums of crs = C R S products of inputs in [-1, 1)
    (random signs, so the sums grow like sqrt(crs) while their bound grows like crs; a generous bound is the
    deterministic one, crs u, with u the unit roundoff):
    "float32": crs 2**-24; "tf32": inputs rounded to 10 bits (2 x 2**-11 a product, relative to the sum of
    |products|, which for random signs is about sqrt(crs) times max |y|) plus FP32 sums; "float16": inputs and
    output in FP16 (FP32 sums): one rounding of the output, 2**-11, plus the inputs' 2 x 2**-11 as for TF32."""
    u = 2.0**-24
    if precision == "float32":
        return crs * u
    if precision == "tf32":
        return 2 * 2.0**-11 * math.sqrt(crs) + crs * u
    if precision == "float16":
        return 2.0**-11 + 2 * 2.0**-11 * math.sqrt(crs) + crs * u
    raise runtime.CourseInputError(f"no tolerance for precision {precision!r}")


# ================================================================== numba: direct, one thread per output

@cuda.jit
def conv2d_direct(x, w, y, ph, pw, sh, sw, dh, dw):
    """y = x (*) w in NCHW, one thread per output element y[n, k, p, q] (a 1-D grid over all of them, q
    fastest, so neighbouring threads read neighbouring inputs). Each thread sums C R S products; reads outside
    the input are the zero padding and are skipped."""
    N, K, P, Q = y.shape
    C, H, W = x.shape[1], x.shape[2], x.shape[3]
    R, S = w.shape[2], w.shape[3]
    i = cuda.grid(1)
    if i >= N * K * P * Q:
        return
    q = i % Q
    p = (i // Q) % P
    k = (i // (P * Q)) % K
    n = i // (K * P * Q)
    acc = np.float32(0.0)
    for c in range(C):
        for r in range(R):
            h = p * sh - ph + r * dh
            if 0 <= h < H:
                for s in range(S):
                    col = q * sw - pw + s * dw
                    if 0 <= col < W:
                        acc += x[n, c, h, col] * w[k, c, r, s]
    y[n, k, p, q] = acc


@cuda.jit
def conv2d_nhwc_bias_relu(x, w, b, y, ph, pw, sh, sw, dh, dw):
    """y = max(conv(x, w) + b, 0) in NHWC: x (N, H, W, C), w (K, R, S, C), b (K,), y (N, P, Q, K). One thread
    per output element, k fastest (the NHWC order of y, so writes are coalesced; the threads of a warp read the
    same inputs, a broadcast). The layer of the exercises' Task 5.2 and the reference for its speed."""
    N, P, Q, K = y.shape
    H, W, C = x.shape[1], x.shape[2], x.shape[3]
    R, S = w.shape[1], w.shape[2]
    i = cuda.grid(1)
    if i >= N * P * Q * K:
        return
    k = i % K
    q = (i // K) % Q
    p = (i // (K * Q)) % P
    n = i // (K * Q * P)
    acc = np.float32(0.0)
    for r in range(R):
        h = p * sh - ph + r * dh
        if 0 <= h < H:
            for s in range(S):
                col = q * sw - pw + s * dw
                if 0 <= col < W:
                    for c in range(C):
                        acc += x[n, h, col, c] * w[k, r, s, c]
    y[n, p, q, k] = max(acc + b[k], np.float32(0.0))


def conv2d_nhwc_bias_relu_numba(x, w, b, y, *, pad=0, stride=1, dilation=1, threads: int = 128):
    """y = relu(conv2d(x, w) + b) in NHWC with the numba kernel (either mode); float32 device arrays."""
    _check_conv(x, w, y, np.float32, pad, stride, dilation, layout="NHWC")
    runtime.check_device_array(b, "b", dtype=np.float32, shape=(w.shape[0],))
    (ph, pw), (sh, sw), (dh, dw) = _pair(pad, "pad"), _pair(stride, "stride"), _pair(dilation, "dilation")
    total = math.prod(y.shape)
    conv2d_nhwc_bias_relu[math.ceil(total / threads), threads](x, w, b, y, ph, pw, sh, sw, dh, dw)
    return y


NUMBA_SIGNATURE = "void(float32[:, :, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], " + \
    ", ".join(["int32"] * 6) + ")"
NUMBA_KERNELS = {  # every numba kernel of this module with a signature, for tests/test_gpu_archs.py
    "conv2d_direct": NUMBA_SIGNATURE,
    "conv2d_nhwc_bias_relu": "void(float32[:, :, :, ::1], float32[:, :, :, ::1], float32[::1], "
                             "float32[:, :, :, ::1], " + ", ".join(["int32"] * 6) + ")",
}


def _check_conv(x, w, y, dtype, pad, stride, dilation, layout="NCHW"):
    runtime.check_device_array(x, "x", dtype=dtype, ndim=4)
    runtime.check_device_array(w, "w", dtype=dtype, ndim=4)
    if layout == "NCHW":
        xs, ws = tuple(x.shape), tuple(w.shape)
    else:
        xs = (x.shape[0], x.shape[3], x.shape[1], x.shape[2])
        ws = (w.shape[0], w.shape[3], w.shape[1], w.shape[2])
    n, k, P, Q = output_shape(xs, ws, pad, stride, dilation)
    want = (n, k, P, Q) if layout == "NCHW" else (n, P, Q, k)
    runtime.check_device_array(y, "y", dtype=dtype, shape=want)
    return xs, ws, (n, k, P, Q)


def conv2d_numba(x, w, y, *, pad=0, stride=1, dilation=1, threads: int = 128):
    """y = conv2d(x, w) with the numba kernel (either mode): float32 device arrays x (N, C, H, W), w (K, C, R,
    S), y (N, K, P, Q). Asynchronous on a GPU."""
    _check_conv(x, w, y, np.float32, pad, stride, dilation)
    if not 1 <= threads <= 1024:
        raise runtime.CourseInputError(f"a block has 1 to 1024 threads, got {threads}")
    (ph, pw), (sh, sw), (dh, dw) = _pair(pad, "pad"), _pair(stride, "stride"), _pair(dilation, "dilation")
    total = math.prod(y.shape)
    conv2d_direct[math.ceil(total / threads), threads](x, w, y, ph, pw, sh, sw, dh, dw)
    return y


# ============================================================================ CUDA C through CuPy

def _suffix(dtype) -> str:
    name = np.dtype(dtype).name
    if name not in ("float32", "float16"):
        raise runtime.CourseInputError(f"the CUDA C kernels take float32 or float16, not {name}")
    return "f32" if name == "float32" else "f16"


def _require_cupy(**arrays):
    runtime.require_gpu("a CUDA C kernel")
    for name, a in arrays.items():
        if runtime.is_device_array(a) and not type(a).__module__.startswith("cupy"):
            raise runtime.CourseInputError(f"the CUDA C kernels take CuPy arrays; {name} is not one "
                                           "(cupy.asarray(...) wraps a numba device array without a copy)")
        if runtime.is_device_array(a) and not a.flags.c_contiguous:
            raise runtime.CourseInputError(f"{name} must be C-contiguous; use cupy.ascontiguousarray")


def _grid_stride_blocks(total: int, threads: int = 256) -> int:
    """Blocks for a grid-stride loop over ``total`` items: enough to fill the GPU 32 blocks an SM, no more."""
    return max(1, min(math.ceil(total / threads), 32 * runtime.get().device["sms"]))


def cols_shape(x_shape, r: int, s: int, pad=0, stride=1, dilation=1, layout: str = "NCHW") -> tuple:
    """Shape of the GPU kernels' im2col matrix: (C R S, N P Q) for NCHW — im2col_spec's (N, C R S, P Q) with the
    images side by side, so that the layer is one GEMM — and (N P Q, R S C) for NHWC (im2col_nhwc_spec's)."""
    if layout == "NCHW":
        n, c, h, w = x_shape
    elif layout == "NHWC":
        n, h, w, c = x_shape
    else:
        raise runtime.CourseInputError(f"layout must be 'NCHW' or 'NHWC', not {layout!r}")
    _, _, P, Q = output_shape((n, c, h, w), (1, c, r, s), pad, stride, dilation)
    return (c * r * s, n * P * Q) if layout == "NCHW" else (n * P * Q, r * s * c)


def im2col(x, cols, r: int, s: int, *, pad=0, stride=1, dilation=1, layout: str = "NCHW"):
    """The im2col matrix of x (CuPy, float32 or float16, NCHW or NHWC) into cols (see cols_shape), on the GPU.
    NCHW: a block per (row of cols, image), its threads along the output pixels. NHWC with C a multiple of 16
    bytes' worth of elements: each thread copies 16 bytes (a pixel's channels are contiguous)."""
    _require_cupy(x=x, cols=cols)
    sfx = _suffix(x.dtype)
    runtime.check_device_array(x, "x", dtype=x.dtype, ndim=4)
    runtime.check_device_array(cols, "cols", dtype=x.dtype, shape=cols_shape(x.shape, r, s, pad, stride, dilation,
                                                                             layout))
    if layout == "NCHW":
        n, c, h, w = x.shape
    else:
        n, h, w, c = x.shape
    _, _, P, Q = output_shape((n, c, h, w), (1, c, r, s), pad, stride, dilation)
    (ph, pw), (sh, sw), (dh, dw) = _pair(pad, "pad"), _pair(stride, "stride"), _pair(dilation, "dilation")
    args = tuple(np.int32(v) for v in (n, c, h, w, r, s, P, Q, ph, pw, sh, sw, dh, dw))
    if layout == "NCHW":
        if c * r * s > 65535 or n > 65535:
            raise runtime.CourseInputError(f"im2col for NCHW takes C R S and N up to 65535, got {c * r * s} and {n}")
        grid = (min(math.ceil(P * Q / 256), 64), c * r * s, n)
        cuda_c.function(SOURCE, f"im2col_nchw_{sfx}")(grid, (256,), (x, cols, *args))
        return cols
    vec = 16 // x.dtype.itemsize
    if c % vec == 0:
        name, total = f"im2col_nhwc_vec_{sfx}", cols.size // vec
    else:
        name, total = f"im2col_nhwc_{sfx}", cols.size
    if total >= 2**31 - 2**24:
        name += "_i64"
    cuda_c.function(SOURCE, name)((_grid_stride_blocks(total),), (256,), (x, cols, *args))
    return cols


def gemm(a, b, out, *, tf32: bool = False):
    """out = a @ b through cuBLAS (cupy.matmul): FP16 on the tensor cores; FP32 strict, or TF32 on the tensor
    cores when ``tf32``. Broadcasts like numpy.matmul."""
    from . import tensor_cores

    return tensor_cores.gemm_library(a, b, out, tf32=tf32)


def conv_im2col_gemm(x, w, y, *, pad=0, stride=1, dilation=1, layout: str = "NCHW", tf32: bool = False,
                     cols=None):
    """y = conv2d(x, w) as im2col + one GEMM (GPU mode, CuPy arrays of one dtype, float32 or float16).

    NCHW: x (N, C, H, W), w (K, C, R, S), y (N, K, P, Q): w (K x CRS) @ cols (CRS x NPQ) is one GEMM whose output,
    K x N x PQ, is then transposed into y (a copy of the output).
    NHWC: x (N, H, W, C), w (K, R, S, C), y (N, P, Q, K): y = cols (NPQ x RSC) @ w^T (RSC x K), one GEMM whose
    output is already NHWC. ``cols``: a buffer of cols_shape to reuse (else one is allocated: im2col's memory).
    ``tf32``: for float32 data, run the GEMM on TF32 tensor cores."""
    _require_cupy(x=x, w=w, y=y)
    xs, ws, (n, k, P, Q) = _check_conv(x, w, y, x.dtype, pad, stride, dilation, layout)
    _, c, r, s = ws
    cp = runtime.cupy()
    shape = cols_shape(x.shape, r, s, pad, stride, dilation, layout)
    if cols is None:
        runtime.check_fits(math.prod(shape) * x.dtype.itemsize, "the im2col matrix")
        cols = cp.empty(shape, x.dtype)
    im2col(x, cols, r, s, pad=pad, stride=stride, dilation=dilation, layout=layout)
    if layout == "NCHW":
        out = gemm(w.reshape(k, c * r * s), cols, None, tf32=tf32)  # K x (N P Q)
        y.reshape(n, k, P * Q)[...] = out.reshape(k, n, P * Q).transpose(1, 0, 2)
    else:
        gemm(cols, w.reshape(k, r * s * c).T, y.reshape(n * P * Q, k), tf32=tf32)
    return y


def direct_smem_bytes(r: int, s: int, stride=1, dilation=1) -> int:
    """Shared memory of one block of the CUDA C direct kernel: the input patch and the weights of CB channels."""
    t = DIRECT_TILE
    (sh, sw), (dh, dw) = _pair(stride, "stride"), _pair(dilation, "dilation")
    ih, iw = (t["TP"] - 1) * sh + (r - 1) * dh + 1, (t["TQ"] - 1) * sw + (s - 1) * dw + 1
    iwp = iw + (12 - iw % 8) % 8  # the padded row pitch (bank conflicts), as in convolution.cu
    return (math.ceil(t["CB"] * ih * iwp / 4) * 4 + t["KB"] * t["CB"] * r * s) * 4


def conv_direct(x, w, y, *, pad=0, stride=1, dilation=1):
    """y = conv2d(x, w) with the register-tiled CUDA C direct kernel (GPU mode, CuPy, NCHW, float32 or float16
    with FP32 sums): blocks of 256 threads compute 8 x 16 pixels x 64 output channels, 4 pixels x 8 channels
    a thread, through shared memory 4 input channels at a time. No extra memory."""
    _require_cupy(x=x, w=w, y=y)
    sfx = _suffix(x.dtype)
    (n, c, h, wd), (k, _, r, s), (_, _, P, Q) = _check_conv(x, w, y, x.dtype, pad, stride, dilation)
    smem = direct_smem_bytes(r, s, stride, dilation)
    if smem > 48 * 1024:
        raise runtime.CourseInputError(f"the direct kernel needs {smem} bytes of shared memory for a {r}x{s} filter "
                                       "with this stride and dilation; it allows 48 KiB")
    (ph, pw), (sh, sw), (dh, dw) = _pair(pad, "pad"), _pair(stride, "stride"), _pair(dilation, "dilation")
    t = DIRECT_TILE
    grid = (math.ceil(Q / t["TQ"]) * math.ceil(P / t["TP"]), math.ceil(k / t["KB"]), n)
    name = f"conv_direct_nchw_{'3x3_' if (r, s) == (3, 3) else ''}{sfx}"
    args = tuple(np.int32(v) for v in (n, c, h, wd, k, r, s, P, Q, ph, pw, sh, sw, dh, dw))
    cuda_c.function(SOURCE, name)(grid, (t["threads"],), (x, w, y, *args), shared_mem=smem)
    return y


# ================================================================ direct convolution on the tensor cores

def igemm_config(name: str) -> dict:
    """The tile of a tensor-core direct kernel, from its name: block BM x BN of y (pixels x output channels),
    warps of WM x WN, STAGES shared-memory buffers; threads and shared memory per block."""
    import re

    m = re.fullmatch(r"conv_igemm_(\d+)x(\d+)_w(\d+)x(\d+)_s(\d+)_nhwc_f16", name)
    if not m or name not in IGEMM_CONFIGS:
        raise runtime.CourseInputError(f"no tensor-core convolution {name!r}; known: {', '.join(IGEMM_CONFIGS)}")
    bm, bn, wm, wn, stages = map(int, m.groups())
    warps = (bm // wm) * (bn // wn)
    ld = IGEMM_BK + 8
    smem = max(stages * (bm + bn) * ld * 2, warps * 16 * 16 * 4)
    return {"name": name, "bm": bm, "bn": bn, "wm": wm, "wn": wn, "stages": stages, "threads": 32 * warps,
            "smem_bytes": smem}


def igemm_choose(m: int, k: int, sms: int = 132) -> str:
    """The configuration for a layer with M = N P Q output pixels and K output channels: the largest tile
    that still gives every SM a block (big tiles reuse each input more; too few blocks leave SMs idle), and
    no wider than K needs. A rule of thumb: the benchmark times every configuration and keeps the fastest."""
    fits = [igemm_config(n) for n in IGEMM_CONFIGS]
    fits = [c for c in fits if c["bn"] <= max(64, k)]
    for c in sorted(fits, key=lambda c: -c["bm"] * c["bn"]):
        if math.ceil(m / c["bm"]) * math.ceil(k / c["bn"]) >= sms:
            return c["name"]
    return min(fits, key=lambda c: c["bm"] * c["bn"])["name"]


_igemm_ready = set()


def conv_implicit_gemm(x, w, y, *, pad=0, stride=1, dilation=1, config: str | None = None):
    """y = conv2d(x, w) as a direct convolution on the tensor cores (GPU mode): CuPy float16 arrays in NHWC,
    x (N, H, W, C), w (K, R, S, C), y (N, P, Q, K); FP32 sums. The GEMM of im2col + GEMM without the im2col
    matrix: each block gathers the input rows of its tile straight from x into shared memory. C must be a
    multiple of 32 and K of 8. ``config``: one of IGEMM_CONFIGS (by default igemm_choose's)."""
    _require_cupy(x=x, w=w, y=y)
    (n, c, h, wd), (k, _, r, s), (_, _, P, Q) = _check_conv(x, w, y, np.float16, pad, stride, dilation, "NHWC")
    if c % IGEMM_BK or k % 8:
        raise runtime.CourseInputError(f"the tensor-core convolution needs C a multiple of {IGEMM_BK} and K a "
                                       f"multiple of 8; got C={c}, K={k}")
    if n * P * Q >= 2**31 or x.size >= 2**31:
        raise runtime.CourseInputError("the tensor-core convolution indexes pixels with 32-bit integers")
    cfg = igemm_config(config or igemm_choose(n * P * Q, k, runtime.get().device["sms"]))
    gpus.step("05.igemm_wmma")  # below sm_80 its copies run synchronously, and it says so once
    fn = cuda_c.function(SOURCE, cfg["name"])
    if cfg["name"] not in _igemm_ready:
        if cfg["smem_bytes"] > 48 * 1024:  # more than 48 KiB of shared memory a block only when asked for
            fn.max_dynamic_shared_size_bytes = cfg["smem_bytes"]
        _igemm_ready.add(cfg["name"])
    (ph, pw), (sh, sw), (dh, dw) = _pair(pad, "pad"), _pair(stride, "stride"), _pair(dilation, "dilation")
    grid = (math.ceil(n * P * Q / cfg["bm"]), math.ceil(k / cfg["bn"]))
    args = tuple(np.int32(v) for v in (n, c, h, wd, k, r, s, P, Q, ph, pw, sh, sw, dh, dw))
    fn(grid, (cfg["threads"],), (x, w, y, *args), shared_mem=cfg["smem_bytes"])
    return y


# =============================================== Hopper: the convolution as lesson 4's wgmma GEMM (sm_90a)

WGMMA_SOURCE = "convolution_wgmma"  # kernels/cuda/convolution_wgmma.cu, compiled for sm_90a only
# BM output pixels x BN output channels a block, shared-memory stages (each BM x 64 of the image, BN x 64 of w)
# (BM x BN, stages); each as a box of the image (TH x TW pixels) and as BM consecutive output pixels read by the
# TMA's im2col mode ("i2c"), which computes no row for nothing
_WGMMA_TILES = ("128x128_s4", "128x64_s4", "128x256_s3", "64x128_s4", "64x64_s6")
# ... and, im2col only, 256 x 128: four consumer warpgroups of 64 rows (104 registers each, hopper::consumer_regs);
# 128 x 224: 2,048 output channels in 10 tiles, so that ResNet-50's conv5_x 1x1 512->2048 at batch 32 (1,568 output
# pixels) is 130 tiles, one wave on 132 SMs, where 128 x 256 leaves 28 SMs idle (the tile cuDNN's fastest kernel uses)
WGMMA_CONV_CONFIGS = tuple(f"conv_wgmma_{mode}{t}_nhwc_f16" for mode in ("", "i2c_") for t in _WGMMA_TILES) + (
    "conv_wgmma_i2c_256x128_s3_nhwc_f16", "conv_wgmma_i2c_128x224_s4_nhwc_f16")
# The i2c tiles, persistent (lesson 4's schedule: as many blocks as the SMs hold, each walking the tiles, the next
# tile's taps loaded while this one's y is stored) with y written by the TMA through shared memory. Stages: as many as
# fit beside y's pieces (64x128_s3 and 64x64_s5: as many as leave room for two blocks an SM). Not among the tiles
# WGMMA_CONV_CONFIGS lists: the race (benchmarks/convolution.py) sweeps them as a kind of their own. 64 x 128 with 8
# stages, one block an SM: a layer with a long reduction and few tiles (conv5_x 1x1 2048->512 at batch 32: 100 tiles
# on 132 SMs, 32 slices each) keeps more of its slices in flight
_WGMMA_PERSISTENT_TILES = ("128x128_s6", "128x64_s8", "128x256_s4", "64x128_s3", "64x64_s5", "256x128_s3", "128x224_s4",
                           "64x128_s8")
WGMMA_CONV_PERSISTENT_CONFIGS = tuple(f"conv_wgmma_i2c_{t}_persistent_nhwc_f16" for t in _WGMMA_PERSISTENT_TILES)
# ... and the 64 x 128, 8-stage tile with a part taken out, to time what is left (conv_wgmma's ``ablate``; lesson 5's
# deep dive, benchmarks/convolution.py's where_time_goes): "loads" issues no wgmma (y comes out zero), "mma" loads
# nothing (the products read whatever the stages hold: y is meaningless)
WGMMA_CONV_ABLATED = {"conv_wgmma_i2c_64x128_s8_persistent_nhwc_f16": ("loads", "mma")}
WGMMA_BK = 64  # channels a slice of the reduction: 128 bytes of FP16, one row of the 128-byte swizzle
WGMMA_STORE_PIECE = 64  # persistent: y leaves in pieces of 64 rows x 64 channels, two buffers a consumer warpgroup
# (a tile 32 channels past whole pieces, 128 x 224, ends with one of 64 x 32)


def wgmma_conv_config(name: str) -> dict:
    """Tile, stages, warpgroups and shared memory of a wgmma convolution, from its name."""
    import re

    m = re.fullmatch(r"conv_wgmma_(i2c_)?(\d+)x(\d+)_s(\d+)(_persistent)?_nhwc_f16", name)
    known = WGMMA_CONV_CONFIGS + WGMMA_CONV_PERSISTENT_CONFIGS
    if not m or name not in known:
        raise runtime.CourseInputError(f"no wgmma convolution {name!r}; known: {', '.join(known)}")
    bm, bn, stages = map(int, m.groups()[1:4])
    consumers = bm // 64
    persistent = m.group(5) is not None
    staging = consumers * 2 * WGMMA_STORE_PIECE * WGMMA_STORE_PIECE * 2 if persistent else 0  # y's pieces
    smem = 1024 + stages * (bm + bn) * WGMMA_BK * 2 + staging + 2 * stages * 8  # alignment, tiles, y, mbarriers
    return {"name": name, "bm": bm, "bn": bn, "stages": stages, "consumers": consumers, "im2col": bool(m.group(1)),
            "threads": 128 * (consumers + 1), "smem_bytes": smem, "persistent": persistent,
            "epilogue": "tma" if persistent else "registers"}


def wgmma_conv_tiles(n: int, P: int, Q: int, k: int, bm: int, bn: int, im2col: bool = False) -> dict:
    """How conv_wgmma covers y (n x P x Q x k): a block takes TH rows x TW columns of one image (TW the smallest
    power of two >= Q, at most bm; TH = bm / TW) and bn output channels. Returns TW, TH, the tiles along Q, P, the
    grid (blocks over the images' tiles, blocks over the channels) and the share of the rows computed that are
    stored (``useful``). With ``im2col`` a block takes bm consecutive rows of y read as an (n P Q) x k matrix, and
    TW, TH and the tiles are 0."""
    if min(n, P, Q, k) < 1 or bm < 1 or bn < 1:
        raise runtime.CourseInputError("wgmma_conv_tiles needs n, P, Q, k, bm and bn >= 1")
    if im2col:
        blocks = math.ceil(n * P * Q / bm)
        return {"TW": 0, "TH": 0, "tiles_q": 0, "tiles_p": 0, "grid": (blocks, math.ceil(k / bn)),
                "useful": n * P * Q / (blocks * bm)}
    tw = min(bm, 1 << max(0, (Q - 1).bit_length()))
    th = bm // tw
    tiles_q, tiles_p = math.ceil(Q / tw), math.ceil(P / th)
    return {"TW": tw, "TH": th, "tiles_q": tiles_q, "tiles_p": tiles_p,
            "grid": (n * tiles_p * tiles_q, math.ceil(k / bn)), "useful": P * Q / (tiles_p * th * tiles_q * tw)}


def wgmma_conv_spec(x, w, pad, bm: int = 128, bn: int = 128, im2col: bool = False) -> np.ndarray:
    """What conv_wgmma computes, in NumPy, done its way: for every block's tile and every slice (tap, 64
    channels) of the reduction, the 4-D box of x the TMA reads (zeros outside the image), times the slice of w,
    summed; rows of a tile outside y are dropped. With ``im2col``, the tile is bm consecutive output pixels and the
    TMA's im2col load brings, for tap (r, s), input pixel (p - ph + r, q - pw + s) of each (zeros outside the image
    and past the last one). x: (N, H, W, C), w: (K, R, S, C), NHWC; float64 sums."""
    n, h, wd, c = x.shape
    k, r, s, _ = w.shape
    ph, pw = _pair(pad, "pad")
    P, Q = h + 2 * ph - r + 1, wd + 2 * pw - s + 1
    t = wgmma_conv_tiles(n, P, Q, k, bm, bn, im2col)
    y = np.zeros((n, P, Q, k))
    wm = w.reshape(k, r * s * c).astype(np.float64)
    if im2col:
        ym = y.reshape(n * P * Q, k)
        for b in range(t["grid"][0]):
            m = b * bm + np.arange(bm)  # the block's rows of y, in the order the TMA walks the pixels
            img, p, q = m // (P * Q), m % (P * Q) // Q, m % Q
            acc = np.zeros((bm, k))
            for kb in range(r * s * (c // WGMMA_BK)):
                tap, c0 = divmod(kb, c // WGMMA_BK)
                ry, sx = divmod(tap, s)
                hh, ww = p - ph + ry, q - pw + sx
                inside = (img < n) & (hh >= 0) & (hh < h) & (ww >= 0) & (ww < wd)
                col = np.zeros((bm, WGMMA_BK))  # the im2col load: one row per pixel, zeros outside
                col[inside] = x[img[inside], hh[inside], ww[inside], c0 * WGMMA_BK:(c0 + 1) * WGMMA_BK]
                acc += col @ wm[:, kb * WGMMA_BK:(kb + 1) * WGMMA_BK].T
            keep = m < n * P * Q
            ym[m[keep]] = acc[keep]
        return y
    for b in range(t["grid"][0]):
        qt, pt, img = b % t["tiles_q"], (b // t["tiles_q"]) % t["tiles_p"], b // (t["tiles_q"] * t["tiles_p"])
        p0, q0 = pt * t["TH"], qt * t["TW"]
        acc = np.zeros((bm, k))
        for kb in range(r * s * (c // WGMMA_BK)):
            tap, c0 = divmod(kb, c // WGMMA_BK)
            ry, sx = divmod(tap, s)
            box = np.zeros((t["TH"], t["TW"], WGMMA_BK))  # the TMA's box, zero outside the image
            h0, w0 = p0 + ry - ph, q0 + sx - pw
            rows = range(max(h0, 0), min(h0 + t["TH"], h))
            cols = range(max(w0, 0), min(w0 + t["TW"], wd))
            if len(rows) and len(cols):
                box[rows.start - h0:rows.stop - h0, cols.start - w0:cols.stop - w0] = \
                    x[img, rows.start:rows.stop, cols.start:cols.stop, c0 * WGMMA_BK:(c0 + 1) * WGMMA_BK]
            acc += box.reshape(bm, WGMMA_BK) @ wm[:, kb * WGMMA_BK:(kb + 1) * WGMMA_BK].T
        for i in range(bm):
            p, q = p0 + i // t["TW"], q0 + i % t["TW"]
            if p < P and q < Q:
                y[img, p, q] = acc[i]
    return y


def conv_wgmma(x, w, y, *, pad=0, stride=1, dilation=1, config: str | None = None, blocks: int | None = None,
               ablate: str | None = None, pdl: bool = False):
    """y = conv2d(x, w) on Hopper's warpgroup MMA (GPU mode, compute capability 9.0; CuPy float16 arrays in NHWC):
    x (N, H, W, C), w (K, R, S, C), y (N, P, Q, K); FP32 sums. Lesson 4's wgmma GEMM with A read from the image:
    for each tap and 64 channels a block's tile of A is one 4-D box of x, which the TMA copies (zeros for the
    padding), or, for the "i2c" configurations, bm consecutive output pixels' input pixels, which the TMA's im2col
    mode gathers. Stride 1 and no dilation; C a multiple of 64, K of 8. ``config``: one of WGMMA_CONV_CONFIGS, or of
    WGMMA_CONV_PERSISTENT_CONFIGS: as many blocks as the SMs hold at once (or one per tile, if fewer), each walking
    its tiles, y written by the TMA; ``blocks`` launches that many instead (what the tests use to walk many tiles a
    block). ``ablate`` ("loads" or "mma", for a configuration WGMMA_CONV_ABLATED lists): the same kernel with only
    its loads or only its products, for timing, not for y. ``pdl`` (persistent configurations): a programmatic
    dependent launch, whose blocks set up while the kernel before it on the stream finishes (tensor_cores'
    launch_hopper). Asynchronous."""
    import ctypes

    from . import tensor_cores as tc

    _require_cupy(x=x, w=w, y=y)
    (n, c, h, wd), (k, _, r, s), (_, _, P, Q) = _check_conv(x, w, y, np.float16, pad, stride, dilation, "NHWC")
    if _pair(stride, "stride") != (1, 1) or _pair(dilation, "dilation") != (1, 1):
        raise runtime.CourseInputError("the wgmma convolution reads its tiles as boxes of the image: stride 1 and "
                                       "dilation 1 only")
    if c % WGMMA_BK or k % 8:
        raise runtime.CourseInputError(f"the wgmma convolution needs C a multiple of {WGMMA_BK} (a slice of the "
                                       f"reduction within one tap) and K a multiple of 8; got C={c}, K={k}")
    if n * P * Q >= 2**31 or x.size >= 2**31 or max(h, wd) > 2**15:
        raise runtime.CourseInputError("the wgmma convolution indexes pixels with 32-bit integers")
    cfg = wgmma_conv_config(config or WGMMA_CONV_CONFIGS[0])
    if ablate is not None:
        if ablate not in WGMMA_CONV_ABLATED.get(cfg["name"], ()):
            known = ", ".join(f"{n} ({' or '.join(p)})" for n, p in WGMMA_CONV_ABLATED.items())
            raise runtime.CourseInputError(f"no {cfg['name']} with only its {ablate!r}; ablate: {known}")
        cfg = {**cfg, "name": cfg["name"].removesuffix("_nhwc_f16") + f"_{ablate}_only_nhwc_f16"}
    if pdl and not cfg["persistent"]:
        raise runtime.CourseInputError(f"pdl is for the persistent configurations (got {cfg['name']})")
    if blocks is not None and (not cfg["persistent"] or blocks < 1):
        raise runtime.CourseInputError(f"blocks is for the persistent configurations, at least 1 (got {blocks} for "
                                       f"{cfg['name']})")
    gpus.step("05.wgmma")  # compute capability 9.0 exactly, else one line saying so
    fn = tc.hopper_kernel(WGMMA_SOURCE, cfg["name"], cfg["smem_bytes"])
    t = wgmma_conv_tiles(n, P, Q, k, cfg["bm"], cfg["bn"], cfg["im2col"])
    ph, pw = _pair(pad, "pad")
    if cfg["im2col"]:  # the window of tap (0, 0) around each image: P x Q pixels from (-ph, -pw)
        if max(ph, r - 1 - ph, pw, s - 1 - pw) > 127:
            raise runtime.CourseInputError("the TMA's im2col mode takes paddings and filters of at most 128 pixels")
        map_x = tc.tensor_map_im2col(x, cfg["bm"], WGMMA_BK, (-ph, -pw), (ph - r + 1, pw - s + 1))
    else:
        map_x = tc.tensor_map(x, (1, t["TH"], t["TW"], WGMMA_BK))
    map_w = tc.tensor_map(w.reshape(k, r * s * c), (cfg["bn"], WGMMA_BK))
    if cfg["persistent"]:  # y as an (N P Q) x K matrix, written by the TMA in pieces of 64 x 64 (K a multiple of 8)
        map_y = tc.tensor_map(y.reshape(n * P * Q, k), (WGMMA_STORE_PIECE, WGMMA_STORE_PIECE))
        tiles = t["grid"][0] * t["grid"][1]
        if blocks is None:  # as many as the SMs hold at once
            blocks = runtime.get().device["sms"] * tc.blocks_per_sm(fn, cfg["threads"], cfg["smem_bytes"])
        args = [map_x, map_w, map_y, *(ctypes.c_int32(v) for v in (n, P, Q, k, c, r, s, ph, pw, tc.WGMMA_GROUP_M))]
        if cfg["bn"] % WGMMA_STORE_PIECE:  # the tile's last 32 channels: y in boxes of 64 x 32 (64-byte swizzle)
            args.append(tc.tensor_map(y.reshape(n * P * Q, k), (WGMMA_STORE_PIECE, WGMMA_STORE_PIECE // 2)))
        tc.launch_hopper(fn, (min(tiles, blocks),), cfg["threads"], cfg["smem_bytes"], args, cfg["name"], pdl=pdl)
        return y
    args = [map_x, map_w, ctypes.c_uint64(y.data.ptr),
            *(ctypes.c_int32(v) for v in (n, P, Q, k, c, r, s, ph, pw, t["TW"], t["tiles_q"], t["tiles_p"]))]
    tc.launch_hopper(fn, t["grid"], cfg["threads"], cfg["smem_bytes"], args, cfg["name"])
    return y


# ==================================================== direct convolution on the CUDA cores as an implicit GEMM

def cores_config(name: str) -> dict:
    """The tile of a CUDA-core implicit-GEMM kernel, from its name: BM output channels x BN output pixels a
    block, 8 x 8 a thread, compiled for ``min_blocks`` blocks an SM; threads and shared memory per block."""
    import re

    m = re.fullmatch(r"conv_cores_(\d+)x(\d+)_b(\d+)_nchw_f32", name)
    if not m or name not in CORES_CONFIGS:
        raise runtime.CourseInputError(f"no CUDA-core convolution {name!r}; known: {', '.join(CORES_CONFIGS)}")
    bm, bn, b = map(int, m.groups())
    return {"name": name, "bm": bm, "bn": bn, "min_blocks": b, "threads": (bm // 8) * (bn // 8),
            "smem_bytes": 2 * CORES_BK * ((bm + 4) + bn) * 4}


def cores_choose(npq: int, k: int, sms: int = 132) -> tuple:
    """(configuration, splits) for a layer with N P Q output pixels and K output channels, by a rule of thumb:
    the largest tile no taller than K needs that still gives every SM two blocks of its own; if even the
    smallest does not, split C R S in two. The benchmark times every choice and keeps the fastest."""
    fits = [cores_config(n) for n in CORES_CONFIGS if cores_config(n)["min_blocks"] > 1]
    fits = [c for c in fits if c["bm"] <= max(64, k)]
    fits.sort(key=lambda c: -c["bm"] * c["bn"])
    for splits in CORES_SPLITS:
        for c in fits:
            if math.ceil(npq / c["bn"]) * math.ceil(k / c["bm"]) * splits >= 2 * sms:
                return c["name"], splits
    return fits[-1]["name"], CORES_SPLITS[-1]


def conv_direct_cores(x, w, y, *, pad=0, stride=1, dilation=1, config: str | None = None,
                      splits: int | None = None):
    """y = conv2d(x, w) as an implicit GEMM on the CUDA cores (GPU mode): CuPy float32 arrays in NCHW, x (N, C, H,
    W), w (K, C, R, S), y (N, K, P, Q); strict FP32 (FMA, no tensor cores), no extra memory. y (K x N P Q) =
    w (K x C R S) @ the im2col matrix of x, whose tiles each block gathers straight from x into shared memory;
    lesson 4's register tiling, 8 x 8 outputs a thread. ``config``: one of CORES_CONFIGS, ``splits``: one of
    CORES_SPLITS (by default cores_choose's); with 2 splits y is zeroed first and two blocks add into it."""
    _require_cupy(x=x, w=w, y=y)
    (n, c, h, wd), (k, _, r, s), (_, _, P, Q) = _check_conv(x, w, y, np.float32, pad, stride, dilation)
    if max(x.size, w.size, y.size) >= 2**31:
        raise runtime.CourseInputError("the CUDA-core implicit GEMM indexes its arrays with 32-bit integers")
    if config is None or splits is None:
        c0, s0 = cores_choose(n * P * Q, k, runtime.get().device["sms"])
        config, splits = config or c0, splits or s0
    cfg = cores_config(config)
    if splits not in CORES_SPLITS:
        raise runtime.CourseInputError(f"splits must be one of {CORES_SPLITS}, got {splits}")
    (ph, pw), (sh, sw), (dh, dw) = _pair(pad, "pad"), _pair(stride, "stride"), _pair(dilation, "dilation")
    if splits > 1:
        y.fill(0)
    grid = (math.ceil(n * P * Q / cfg["bn"]), math.ceil(k / cfg["bm"]), splits)
    args = tuple(np.int32(v) for v in (n, c, h, wd, k, r, s, P, Q, ph, pw, sh, sw, dh, dw))
    cuda_c.function(SOURCE, cfg["name"])(grid, (cfg["threads"],), (x, w, y, *args))
    return y

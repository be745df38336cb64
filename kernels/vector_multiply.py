"""Lesson 1 — vector multiply: out[i] = a[i] * b[i].

numba.cuda kernels (one thread per element; a grid-stride loop; and the next steps that bring the
grid-stride loop to the copy's bandwidth: four elements in flight a thread, and pairs of adjacent elements
a thread), their NumPy spec, and launchers that check their input. The CUDA C versions are in kernels/cuda/vector_multiply.cu; ``multiply_cuda_c`` launches
them through CuPy on a GPU.
"""
from __future__ import annotations

import math

import numpy as np

from gpucourse import runtime

from gpucourse import cuda_c

cuda = runtime.cuda()

DTYPES = (np.float32, np.float64)
CUDA_C_VARIANTS = ("vmul_grid_stride", "vmul_vec4", "vmul_vec4_unroll4")
ELEMENTS_PER_THREAD = {"vmul_grid_stride": 1, "vmul_vec4": 4, "vmul_vec4_unroll4": 16}  # per loop trip


def multiply_spec(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """What every kernel here computes."""
    return a * b


@cuda.jit
def multiply_one_per_thread(a, b, out):
    """Thread i computes element i; the grid must have at least out.size threads."""
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a[i] * b[i]


@cuda.jit
def multiply_grid_stride(a, b, out):
    """Each thread starts at its global index and strides by the whole grid: any grid covers any n."""
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, out.size, stride):
        out[i] = a[i] * b[i]


@cuda.jit
def multiply_grid_stride_x4(a, b, out):
    """The grid-stride loop with four independent elements per trip: the thread issues all eight loads
    before the first multiply needs one, so four times as many bytes are in flight from each thread. The
    four elements are a grid apart, so every load instruction of the warp stays coalesced."""
    stride = cuda.gridsize(1)
    n = out.size
    i = cuda.grid(1)
    while i + 3 * stride < n:
        x0, x1, x2, x3 = a[i], a[i + stride], a[i + 2 * stride], a[i + 3 * stride]
        y0, y1, y2, y3 = b[i], b[i + stride], b[i + 2 * stride], b[i + 3 * stride]
        out[i] = x0 * y0
        out[i + stride] = x1 * y1
        out[i + 2 * stride] = x2 * y2
        out[i + 3 * stride] = x3 * y3
        i += 4 * stride
    while i < n:  # the last, partial round
        out[i] = a[i] * b[i]
        i += stride


@cuda.jit
def multiply_pairs(a2, b2, out2, a, b, out):
    """Grid-stride over PAIRS of adjacent elements: a2, b2, out2 are the same arrays viewed as complex
    numbers (complex64 for float32: real part = even element, imaginary part = odd element), so each thread
    takes elements 2i and 2i + 1 in one trip and a warp covers 256 contiguous bytes of each array per trip
    instead of 128. (Numba still issues two 4-byte loads per pair: the H100's SASS shows LDG.E, not
    LDG.E.64; the gain is fewer trips, each touching whole 32-byte sectors twice as densely.) The multiply
    stays elementwise: (re * re, im * im). a, b, out are the plain arrays, for the last element of an odd
    length."""
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, out2.size, stride):
        x = a2[i]
        y = b2[i]
        out2[i] = complex(x.real * y.real, x.imag * y.imag)
    if start == 0 and out.size % 2 == 1:  # an odd length leaves one element without a partner
        last = out.size - 1
        out[last] = a[last] * b[last]


@cuda.jit
def multiply_complex(a2, b2, out2):
    """The complex product out2 = a2 * b2 on complex views of float arrays (numba multiplies complex numbers
    itself), grid-stride: the reference of the exercises' Task 1.4, whose kernel does the same arithmetic on the
    interleaved float elements."""
    for i in range(cuda.grid(1), out2.size, cuda.gridsize(1)):
        out2[i] = a2[i] * b2[i]


KERNELS = {"one_per_thread": multiply_one_per_thread, "grid_stride": multiply_grid_stride,
           "grid_stride_x4": multiply_grid_stride_x4, "pairs": multiply_pairs}
# Every numba kernel of this module with a signature: tests/test_gpu_archs.py compiles each to PTX and machine
# code for every GPU the course supports (gpucourse/gpus.py).
NUMBA_KERNELS = {name: "void(float32[::1], float32[::1], float32[::1])"
                 for name in ("multiply_one_per_thread", "multiply_grid_stride", "multiply_grid_stride_x4")}
NUMBA_KERNELS["multiply_pairs"] = ("void(complex64[::1], complex64[::1], complex64[::1], float32[::1], float32[::1], "
                                   "float32[::1])")
NUMBA_KERNELS["multiply_complex"] = "void(complex64[::1], complex64[::1], complex64[::1])"
PAIR_DTYPES = {np.dtype(np.float32): np.complex64, np.dtype(np.float64): np.complex128}


def as_pairs(x):
    """The even-length front of a 1-D float device array viewed as complex numbers (no copy): element
    pairs (x[0], x[1]), (x[2], x[3]), ... that one thread handles together."""
    n = x.shape[0] - x.shape[0] % 2
    if _address(x) % (2 * np.dtype(x.dtype).itemsize):
        raise runtime.CourseInputError(
            f"the pairs kernel needs arrays aligned to {2 * np.dtype(x.dtype).itemsize} bytes (a fresh "
            "allocation is; a slice starting at an odd element is not)")
    return x[:n].view(PAIR_DTYPES[np.dtype(x.dtype)])


def _address(x) -> int:
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        return cai["data"][0]
    return x.__array_interface__["data"][0]  # the simulator's arrays are NumPy underneath


def check_operands(a, b, out) -> None:
    """Raise a CourseInputError naming what is wrong with the three arrays."""
    for name, x in (("a", a), ("b", b), ("out", out)):
        runtime.check_device_array(x, name, ndim=1)
    if np.dtype(a.dtype) not in map(np.dtype, DTYPES):
        raise runtime.CourseInputError(f"a must be float32 or float64, got {np.dtype(a.dtype)}")
    for name, x in (("b", b), ("out", out)):
        if np.dtype(x.dtype) != np.dtype(a.dtype):
            raise runtime.CourseInputError(
                f"{name} has dtype {np.dtype(x.dtype)} but a has {np.dtype(a.dtype)}: all three must match")
        if x.shape != a.shape:
            raise runtime.CourseInputError(f"{name} has shape {tuple(x.shape)} but a has {tuple(a.shape)}")


def default_blocks(n: int, threads: int, kernel: str) -> int:
    """One thread per element needs ceil(n / threads) blocks; a grid-stride loop needs only enough blocks
    to fill the GPU (32 per SM here), or a handful in the simulator."""
    needed = max(1, math.ceil(n / threads))
    if kernel == "one_per_thread":
        return needed
    per_gpu = 32 * runtime.get().device["sms"] if runtime.is_gpu() else 2
    return min(needed, per_gpu)


def multiply(a, b, out, *, kernel: str = "grid_stride", threads: int = 256, blocks: int | None = None):
    """Launch a numba kernel on device arrays a, b, out (1-D, same shape and float dtype); returns out.

    The launch is asynchronous on a GPU: synchronise (or copy out) before reading the result.
    """
    if kernel not in KERNELS:
        raise runtime.CourseInputError(f"kernel must be one of {sorted(KERNELS)}, not {kernel!r}")
    if not 1 <= threads <= 1024:
        raise runtime.CourseInputError(f"threads per block must be 1..1024, got {threads}")
    check_operands(a, b, out)
    n = a.shape[0]
    blocks = blocks or default_blocks(n, threads, kernel)
    if kernel == "one_per_thread" and blocks * threads < n:
        raise runtime.CourseInputError(
            f"{blocks} blocks x {threads} threads = {blocks * threads} threads cannot cover {n} elements "
            "one per thread; use more blocks or the grid-stride kernel")
    if kernel == "pairs":
        KERNELS[kernel][blocks, threads](as_pairs(a), as_pairs(b), as_pairs(out), a, b, out)
    else:
        KERNELS[kernel][blocks, threads](a, b, out)
    return out


def default_blocks_cuda_c(n: int, threads: int, variant: str) -> int:
    """The grid each CUDA C kernel ran fastest with on an H200 (benchmarks.vector_multiply.grid_sweep):
    scalar loads, 4 blocks per SM looping over the data; float4 loads, one loop trip per thread."""
    full = max(1, math.ceil(n / (threads * ELEMENTS_PER_THREAD[variant])))
    if variant == "vmul_grid_stride":
        return min(full, 4 * runtime.get().device["sms"])
    return min(full, 2**31 - 1)


def multiply_cuda_c(a, b, out, *, variant: str = "vmul_vec4", threads: int = 256, blocks: int | None = None,
                    edits: dict | None = None):
    """Launch a CUDA C kernel from kernels/cuda/vector_multiply.cu on CuPy float32 arrays (GPU mode)."""
    runtime.require_gpu("a CUDA C kernel")
    cp = runtime.cupy()
    if variant not in CUDA_C_VARIANTS:
        raise runtime.CourseInputError(f"variant must be one of {CUDA_C_VARIANTS}, not {variant!r}")
    check_operands(a, b, out)
    if np.dtype(a.dtype) != np.float32:
        raise runtime.CourseInputError(f"the CUDA C kernels take float32, got {np.dtype(a.dtype)}")
    for name, x in (("a", a), ("b", b), ("out", out)):
        if not isinstance(x, cp.ndarray):
            raise runtime.CourseInputError(f"{name} must be a CuPy array for the CUDA C kernels")
        if variant != "vmul_grid_stride" and x.data.ptr % 16:
            raise runtime.CourseInputError(f"{name} is not 16-byte aligned; {variant} loads float4")
    blocks = blocks or default_blocks_cuda_c(a.shape[0], threads, variant)
    cuda_c.function("vector_multiply", variant, edits)((blocks,), (threads,), (a, b, out, np.int64(a.shape[0])))
    return out


def complex_spec(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The complex product of two float arrays holding complex numbers interleaved (number k: real part at
    index 2k, imaginary part at 2k + 1), in the same layout; computed in double precision."""
    a2, b2 = (np.asarray(x, dtype=np.float64).view(np.complex128) for x in (a, b))
    return (a2 * b2).view(np.float64)


def complex_multiply(a, b, out, *, threads: int = 256, blocks: int | None = None):
    """out = a * b for complex numbers stored interleaved in 1-D float device arrays of even length (the
    layout of complex64 viewed as float32), grid-stride over the numbers; returns out."""
    check_operands(a, b, out)
    if a.shape[0] % 2:
        raise runtime.CourseInputError(f"interleaved complex numbers need an even length, got {a.shape[0]}")
    blocks = blocks or default_blocks(a.shape[0] // 2, threads, "grid_stride")
    multiply_complex[blocks, threads](as_pairs(a), as_pairs(b), as_pairs(out))
    return out


def multiply_library(a, b, out):
    """The library baseline: CuPy's elementwise multiply (GPU mode)."""
    return runtime.cupy().multiply(a, b, out=out)


def spin(seconds: float, blocks: int = 1, threads: int = 32):
    """Keep ``blocks`` blocks of ``threads`` busy for ``seconds``, asynchronously (GPU mode).

    Returns the device array of rounds (1000 multiply-adds each) that every thread completed."""
    cp = runtime.cupy()
    rounds = cp.zeros(blocks * threads, dtype=cp.uint64)
    cuda_c.function("vector_multiply", "spin")((blocks,), (threads,), (np.uint64(seconds * 1e9), rounds))
    return rounds

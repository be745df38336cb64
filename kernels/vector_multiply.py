"""Lesson 1 — vector multiply: out[i] = a[i] * b[i].

Two numba.cuda kernels (one thread per element; a grid-stride loop), their NumPy spec, and launchers that
check their input. The CUDA C versions are in kernels/cuda/vector_multiply.cu; ``multiply_cuda_c`` launches
them through CuPy on a GPU.
"""
from __future__ import annotations

import math

import numpy as np

from gpucourse import runtime

from . import cuda_c

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


KERNELS = {"one_per_thread": multiply_one_per_thread, "grid_stride": multiply_grid_stride}
# Every numba kernel of this module with a signature: tests/test_gpu_archs.py compiles each to PTX and machine
# code for every GPU the course supports (gpucourse/gpus.py).
NUMBA_KERNELS = {name: "void(float32[::1], float32[::1], float32[::1])"
                 for name in ("multiply_one_per_thread", "multiply_grid_stride")}


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
    KERNELS[kernel][blocks, threads](a, b, out)
    return out


def default_blocks_cuda_c(n: int, threads: int, variant: str) -> int:
    """The grid each CUDA C kernel ran fastest with on an H200 (benchmarks.vector_multiply.grid_sweep):
    scalar loads, 4 blocks per SM looping over the data; float4 loads, one loop trip per thread."""
    full = max(1, math.ceil(n / (threads * ELEMENTS_PER_THREAD[variant])))
    if variant == "vmul_grid_stride":
        return min(full, 4 * runtime.get().device["sms"])
    return min(full, 2**31 - 1)


def multiply_cuda_c(a, b, out, *, variant: str = "vmul_vec4", threads: int = 256, blocks: int | None = None):
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
    cuda_c.function("vector_multiply", variant)((blocks,), (threads,), (a, b, out, np.int64(a.shape[0])))
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

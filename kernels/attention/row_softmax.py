"""Lesson 9, softmax as a memory-bound kernel: numba kernels (they also run in the simulator) and the CUDA C ones of
kernels/cuda/attention.cu, one block per row. Every kernel returns zeros for a row of -inf (specs.softmax_spec)."""
from __future__ import annotations

import math

import numpy as np

from gpucourse import cuda_c, runtime

cuda = runtime.cuda()

SOURCE = "attention"  # kernels/cuda/attention.cu
THREADS = 128  # the numba kernels' block: a power of two (their reductions halve it)
MAX_ROW = 32768  # the CUDA C one-pass kernel keeps a row in registers: up to 32k elements
CUDA_C = {("three_pass", "float32"): "softmax_three_pass_f32", ("three_pass", "float16"): "softmax_three_pass_f16",
          ("online", "float32"): "softmax_online_f32", ("online", "float16"): "softmax_online_f16"}
ONLINE_VECS = {"float32": 8, "float16": 4}  # 16-byte loads a thread holds (the kernels' VECS)
# The numba kernels with a signature: tests/test_gpu_archs.py compiles each for every GPU the course supports.
NUMBA_KERNELS = {name: "void(float32[:, ::1], float32[:, ::1])"
                 for name in ("softmax_three_pass_numba", "softmax_online_numba")}


@cuda.jit
def softmax_three_pass_numba(x, out):
    """One block per row of x (2-D): the max, the sum of exp(x - max), then the output; three reads of the row."""
    red = cuda.shared.array(THREADS, np.float32)
    row, t = cuda.blockIdx.x, cuda.threadIdx.x
    n = x.shape[1]
    m = -np.inf
    for i in range(t, n, THREADS):
        m = max(m, np.float32(x[row, i]))
    red[t] = m
    cuda.syncthreads()
    step = THREADS // 2
    while step > 0:
        if t < step:
            red[t] = max(red[t], red[t + step])
        cuda.syncthreads()
        step //= 2
    m = red[0]
    cuda.syncthreads()
    shift = np.float32(0.0) if m == -np.inf else m
    s = np.float32(0.0)
    for i in range(t, n, THREADS):
        s += math.exp(np.float32(x[row, i]) - shift)
    red[t] = s
    cuda.syncthreads()
    step = THREADS // 2
    while step > 0:
        if t < step:
            red[t] += red[t + step]
        cuda.syncthreads()
        step //= 2
    inv = np.float32(1.0) / red[0] if red[0] > 0 else np.float32(0.0)
    for i in range(t, n, THREADS):
        out[row, i] = math.exp(np.float32(x[row, i]) - shift) * inv


@cuda.jit(device=True)
def merge(m, l, m2, l2):
    """The merge rule: two partial (max, sum of exp(x - max)) pairs of one row into one."""
    mn = max(m, m2)
    if mn == -np.inf:
        return m, l
    return mn, l * math.exp(m - mn) + l2 * math.exp(m2 - mn)


@cuda.jit
def softmax_online_numba(x, out):
    """One block per row: each thread keeps a running (max, sum) over its elements as it reads them once (the online
    softmax), the pairs are merged in shared memory, then the output is written: two reads of the row, not three."""
    red_m = cuda.shared.array(THREADS, np.float32)
    red_l = cuda.shared.array(THREADS, np.float32)
    row, t = cuda.blockIdx.x, cuda.threadIdx.x
    n = x.shape[1]
    m, l = np.float32(-np.inf), np.float32(0.0)
    for i in range(t, n, THREADS):
        m, l = merge(m, l, np.float32(x[row, i]), np.float32(1.0))
    red_m[t], red_l[t] = m, l
    cuda.syncthreads()
    step = THREADS // 2
    while step > 0:
        if t < step:
            red_m[t], red_l[t] = merge(red_m[t], red_l[t], red_m[t + step], red_l[t + step])
        cuda.syncthreads()
        step //= 2
    m, l = red_m[0], red_l[0]
    shift = np.float32(0.0) if m == -np.inf else m
    inv = np.float32(1.0) / l if l > 0 else np.float32(0.0)
    for i in range(t, n, THREADS):
        out[row, i] = math.exp(np.float32(x[row, i]) - shift) * inv


NUMBA = {"three_pass": softmax_three_pass_numba, "online": softmax_online_numba}


def check_rows(x, out, what: str):
    for name, a in (("x", x), ("out", out)):
        runtime.check_device_array(a, name, ndim=2)
    if tuple(x.shape) != tuple(out.shape):
        raise runtime.CourseInputError(f"{what}: out has shape {tuple(out.shape)}, x {tuple(x.shape)}")
    if np.dtype(x.dtype) != np.dtype(out.dtype) or np.dtype(x.dtype) not in (np.float32, np.float16):
        raise runtime.CourseInputError(f"{what}: x and out must both be float32 or both float16, got "
                                       f"{np.dtype(x.dtype)} and {np.dtype(out.dtype)}")


def softmax(x, out, kernel: str = "online"):
    """Row softmax with a numba kernel ("three_pass" or "online", or a kernel function of the same signature) on
    numba device arrays (or anything numba takes), one block of THREADS threads per row; returns out."""
    check_rows(x, out, "softmax")
    fn = NUMBA.get(kernel, kernel) if isinstance(kernel, str) else kernel
    if isinstance(kernel, str) and kernel not in NUMBA:
        raise runtime.CourseInputError(f"kernel is one of {', '.join(NUMBA)} (or a kernel function), not {kernel!r}")
    fn[x.shape[0], THREADS](x, out)
    return out


def online_threads(n: int, dtype, loads: int | None = None) -> int:
    """The CUDA C one-pass kernel's block for rows of n: ``loads`` 16-byte loads a thread (default: all the kernel
    holds, so that a block's registers stay few and several blocks share an SM), at most 1024 threads."""
    per = 16 // np.dtype(dtype).itemsize
    loads = loads or ONLINE_VECS[np.dtype(dtype).name]
    return int(min(1024, max(32, 32 * math.ceil(math.ceil(n / per / loads) / 32))))


def softmax_cuda_c(x, out, kernel: str = "online", edits: dict | None = None, threads: int | None = None):
    """Row softmax with the CUDA C kernels on CuPy arrays (2-D, contiguous, float32 or float16); ``edits``: a
    notebook cell's version of a region of attention.cu. The one-pass kernel needs n a multiple of 16 bytes' worth
    of elements and at most 32k of them; returns out."""
    cp = runtime.cupy()
    check_rows(x, out, "softmax_cuda_c")
    if (kernel, np.dtype(x.dtype).name) not in CUDA_C:
        raise runtime.CourseInputError(f"kernel is 'three_pass' or 'online', not {kernel!r}")
    rows, n = x.shape
    if not (x.flags.c_contiguous and out.flags.c_contiguous):
        raise runtime.CourseInputError("softmax_cuda_c: x and out must be contiguous")
    if kernel == "online":
        per = 16 // x.itemsize
        if n % per or n > MAX_ROW or x.data.ptr % 16 or out.data.ptr % 16:
            raise runtime.CourseInputError(f"the one-pass kernel takes rows of a multiple of {per} elements up to "
                                           f"{MAX_ROW}, 16-byte aligned; got {n}")
        threads = threads or online_threads(n, x.dtype)
        if threads * ONLINE_VECS[np.dtype(x.dtype).name] * per < n or threads % 32 or threads > 1024:
            raise runtime.CourseInputError(f"{threads} threads cannot hold a row of {n} (at most "
                                           f"{ONLINE_VECS[np.dtype(x.dtype).name] * per} elements a thread)")
    else:
        threads = threads or 256
    fn = cuda_c.function(SOURCE, CUDA_C[(kernel, np.dtype(x.dtype).name)], edits)
    fn((rows,), (threads,), (x, out, np.int32(n)))
    return out

"""Lesson 10, softmax as a memory-bound kernel: numba kernels (they also run in the simulator) and the CUDA C ones of
kernels/cuda/attention.cu: one block per row (three passes, or one pass in registers), and on Hopper a row split
across a thread-block cluster (or, for short rows, a warp per row), its shape chosen per row length from
SOFTMAX_PLAN. Every kernel returns zeros for a row of -inf (specs.softmax_spec)."""
from __future__ import annotations

import math

import numpy as np

from gpucourse import cuda_c, gpus, runtime

cuda = runtime.cuda()

SOURCE = "attention"  # kernels/cuda/attention.cu
THREADS = 128  # the numba kernels' block: a power of two (their reductions halve it)
MAX_ROW = 32768  # the CUDA C one-pass kernel keeps a row in registers: up to 32k elements
CUDA_C = {("three_pass", "float32"): "softmax_three_pass_f32", ("three_pass", "float16"): "softmax_three_pass_f16",
          ("online", "float32"): "softmax_online_f32", ("online", "float16"): "softmax_online_f16"}
ONLINE_VECS = {"float32": 8, "float16": 4}  # 16-byte loads a thread holds (the kernels' VECS)
# Hopper's one-pass kernels (attention.cu, softmax_cluster_* and softmax_warp_rows_*), one compiled per shape:
CLUSTER_SIZES = (1, 2, 4, 8)  # blocks a row is split across (1: one block, smaller than the online kernel's)
CLUSTER_VECS = (2, 4, 8)  # 16-byte loads a thread holds
WARP_VECS = (4, 8, 16)  # a warp per row: 16-byte loads a lane holds
# The shape each row length gets on Hopper, by dtype: rows of up to N elements (the first N >= n) run as
#   ("cluster", C, VECS, threads): C blocks a row (a thread-block cluster), `threads` a block, VECS loads a thread;
#   ("warp", VECS, threads): a warp per row, threads / 32 rows a block.
# benchmarks/softmax_sweep.py times every shape on a GPU and prints the fastest as lines of this table; these are
# its fastest on both an H100 and an H200 (2026-11-25). Long rows run fastest as ONE block of up to 1024 threads
# (C = 1) with the loads all issued first; splitting a row across a cluster measured a few percent slower on both at
# every length from 4k.
SOFTMAX_PLAN = {
    "float32": {
        1024: ("cluster", 1, 4, 64),
        2048: ("cluster", 1, 4, 128),
        4096: ("cluster", 1, 8, 128),
        8192: ("cluster", 1, 4, 512),
        16384: ("cluster", 1, 4, 1024),
        32768: ("cluster", 1, 8, 1024),
    },
    "float16": {
        1024: ("cluster", 1, 4, 32),
        2048: ("cluster", 1, 4, 64),
        4096: ("cluster", 1, 2, 256),
        8192: ("cluster", 1, 4, 256),
        16384: ("cluster", 1, 8, 256),
        32768: ("cluster", 1, 8, 512),
    },
}
CLUSTER_WHAT = "lesson 10's row softmax across a thread-block cluster"
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


def cluster_missing(cc=None) -> str | None:
    """None where the GPU (this one, GPUCOURSE_FAKE_CC, or ``cc``) runs the cluster kernels (sm_90+), else one line
    saying why not; in CPU mode, with no compute capability to ask about, that there is no GPU."""
    if cc is None and runtime.compute_capability() is None:
        return f"{CLUSTER_WHAT} needs clusters ({gpus.feature('clusters').needs}); there is no GPU here"
    return gpus.missing("clusters", cc, what=CLUSTER_WHAT)


_noted: set = set()


def _note_fallback(why: str) -> None:
    if "cluster" not in _noted:
        _noted.add("cluster")
        print(f"note: {why}; it runs the one-block-per-row online kernel instead.")


def cluster_shape(n: int, dtype) -> tuple:
    """The shape SOFTMAX_PLAN gives rows of n elements of ``dtype`` (the entry of the first length >= n)."""
    plan = SOFTMAX_PLAN[np.dtype(dtype).name]
    for limit in sorted(plan):
        if n <= limit:
            return plan[limit]
    raise runtime.CourseInputError(f"SOFTMAX_PLAN has no shape for rows of {n} (its longest: {max(plan)})")


def cluster_launch(rows: int, n: int, dtype, shape: tuple) -> tuple:
    """(kernel name in attention.cu, grid, block, the arguments after x and out) that run ``shape`` on ``rows``
    rows of n: ("cluster", C, VECS, threads) is a grid of rows x C blocks (the kernel's clusters of C are
    consecutive blocks), ("warp", VECS, threads) one of threads / 32 rows a block; a clear error where the shape
    cannot hold such a row."""
    name = np.dtype(dtype).name
    tag, per = ("f32", 4) if name == "float32" else ("f16", 8)
    vecs = n // per
    if not isinstance(shape, tuple) or not shape or shape[0] not in ("cluster", "warp"):
        raise runtime.CourseInputError(f"a shape is ('cluster', C, VECS, threads) or ('warp', VECS, threads), not "
                                       f"{shape!r}")
    if shape[0] == "warp":
        if len(shape) != 3 or shape[1] not in WARP_VECS:
            raise runtime.CourseInputError(f"a warp shape is ('warp', VECS, threads) with VECS in {WARP_VECS}; got "
                                           f"{shape!r}")
        _, v, threads = shape
        if threads % 32 or not 32 <= threads <= 256:
            raise runtime.CourseInputError(f"a warp-per-row block is 32 to 256 threads, a multiple of 32; got "
                                           f"{threads}")
        if 32 * v < vecs:
            raise runtime.CourseInputError(f"a warp holding {v} loads a lane takes rows of at most {32 * v * per} "
                                           f"elements; got {n}")
        return (f"softmax_warp_rows_{tag}_v{v}", (math.ceil(rows / (threads // 32)),), (threads,),
                (np.int32(n), np.int32(rows)))
    if len(shape) != 4 or shape[1] not in CLUSTER_SIZES or shape[2] not in CLUSTER_VECS:
        raise runtime.CourseInputError(f"a cluster shape is ('cluster', C, VECS, threads) with C in {CLUSTER_SIZES} "
                                       f"and VECS in {CLUSTER_VECS}; got {shape!r}")
    _, c, v, threads = shape
    if threads % 32 or not 32 <= threads <= 1024:
        raise runtime.CourseInputError(f"a cluster's block is 32 to 1024 threads, a multiple of 32; got {threads}")
    if c * threads * v < vecs:
        raise runtime.CourseInputError(f"{c} block(s) of {threads} threads holding {v} loads each take rows of at "
                                       f"most {c * threads * v * per} elements; got {n}")
    return f"softmax_cluster_{tag}_c{c}_v{v}", (rows * c,), (threads,), (np.int32(n),)


def cluster_threads(n: int, dtype, c: int, v: int) -> int:
    """The block that holds a cluster's slice of a row of n: ceil(n / C / (VECS loads of 16 bytes)), a multiple of
    32 (at least 32; more than 1024 means the shape cannot hold the row)."""
    vecs = n // (16 // np.dtype(dtype).itemsize)
    return int(max(32, 32 * math.ceil(math.ceil(vecs / c / v) / 32)))


def sweep_shapes(n: int, dtype) -> list:
    """Every shape the kernels can run rows of n with: each cluster size and VECS at the block that holds the slice,
    and (rows short enough) a warp per row with blocks of 64, 128 and 256 threads; what the sweep times."""
    per = 16 // np.dtype(dtype).itemsize
    out = []
    for v in WARP_VECS:
        if 32 * v >= n // per and (v == WARP_VECS[0] or 32 * (v // 2) < n // per):  # the smallest VECS that holds it
            out += [("warp", v, t) for t in (64, 128, 256)]
    for c in CLUSTER_SIZES:
        blocks = set()
        for v in CLUSTER_VECS:
            t = cluster_threads(n, dtype, c, v)
            if t <= 1024 and t not in blocks:  # a block that fewer loads a thread already fill: the same work
                blocks.add(t)
                out.append(("cluster", c, v, t))
    return out


def softmax_cuda_c(x, out, kernel: str = "online", edits: dict | None = None, threads: int | None = None,
                   shape: tuple | None = None):
    """Row softmax with the CUDA C kernels on CuPy arrays (2-D, contiguous, float32 or float16); ``edits``: a
    notebook cell's version of a region of attention.cu. kernel: "three_pass", "online" (one block a row, the row
    read once into registers) or "cluster" (Hopper: the row split across a thread-block cluster, or a warp per row
    for short rows, ``shape`` or SOFTMAX_PLAN's for n; on an older GPU the online kernel, with a note). The one-pass
    kernels need n a multiple of 16 bytes' worth of elements and at most 32k of them; returns out."""
    cp = runtime.cupy()
    check_rows(x, out, "softmax_cuda_c")
    if kernel != "cluster" and (kernel, np.dtype(x.dtype).name) not in CUDA_C:
        raise runtime.CourseInputError(f"kernel is 'three_pass', 'online' or 'cluster', not {kernel!r}")
    rows, n = x.shape
    if not (x.flags.c_contiguous and out.flags.c_contiguous):
        raise runtime.CourseInputError("softmax_cuda_c: x and out must be contiguous")
    if kernel == "cluster":
        per = 16 // x.itemsize
        if n % per or n > MAX_ROW or x.data.ptr % 16 or out.data.ptr % 16:
            raise runtime.CourseInputError(f"the one-pass kernels take rows of a multiple of {per} elements up to "
                                           f"{MAX_ROW}, 16-byte aligned; got {n}")
        if threads is not None:
            raise runtime.CourseInputError("the cluster kernel's block comes with its shape: pass shape=, not threads=")
        why = cluster_missing()
        if why is None:
            name, grid, block, tail = cluster_launch(rows, n, x.dtype, shape or cluster_shape(n, x.dtype))
            if rows:
                cuda_c.function(SOURCE, name, edits)(grid, block, (x, out, *tail))
            return out
        if shape is not None:
            raise runtime.CourseError(f"{why}: it cannot run shape {shape!r}")
        _note_fallback(why)
        kernel = "online"
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

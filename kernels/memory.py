"""Lesson 3 — memory: 2-D grids, coalescing, shared-memory tiles.

Used by notebooks/03_memory.ipynb, benchmarks/memory.py and the tests:

* numba.cuda kernels over matrices and images, one thread per element on a 2-D grid (``cuda.grid(2)``), each
  with the NumPy spec it is checked against and a launcher that checks its input: a scale with x along the
  columns (coalesced) and along the rows (not), a copy at a stride, a matrix transpose three ways (naive,
  through a shared tile, through a padded tile), a matrix multiply naive and tiled, and a 3 x 3 blur.
* The model of what a warp's access costs (sectors of global memory, bank conflicts of shared memory) is in
  kernels/memory_model.py; the pointer chase and the bandwidth probes that measure the memory hierarchy are CUDA C,
  in kernels/cuda/memory.cu (``chase``, ``read_level``, ``shared_read``, ``fma_chain`` below).

Launchers take NumPy arrays (copied to the device and back: what CPU mode uses), CuPy arrays or numba device
arrays, and return the result in the same kind. Row-major everywhere: element (r, c) of a (rows x cols) matrix
is at r * cols + c.
"""
from __future__ import annotations

import math

import numpy as np

from gpucourse import cuda_c, runtime
from . import memory_model as model  # noqa: F401  (kernels.memory.model: the lesson's model)

cuda = runtime.cuda()

SOURCE = "memory"  # kernels/cuda/memory.cu
TILE = 32  # transpose tiles of TILE x TILE ...
TILE_PADDED = TILE + 1  # a padded tile's row: one word more (numba needs the shape as one constant)
GAUSSIAN_3X3 = np.array([[1, 2, 1], [2, 4, 2], [1, 2, 1]], np.float32) / 16  # a 3 x 3 Gaussian blur
BLOCK_ROWS = 8  # ... moved by blocks of TILE x BLOCK_ROWS threads, each thread TILE / BLOCK_ROWS elements
MM_TILE = 16  # the tiled matrix multiply: MM_TILE x MM_TILE tiles and threads per block
STRIDE_THREADS = 256
VARIANTS = ("naive", "tiled", "padded")
MATMULS = ("naive", "tiled")

# Every numba kernel of this module with a signature: tests/test_gpu_archs.py compiles each for every GPU.
_M = "float32[:, ::1]"
NUMBA_KERNELS = {
    "scale_2d": f"void({_M}, {_M}, float32)",
    "scale_2d_swapped": f"void({_M}, {_M}, float32)",
    "copy_strided": "void(float32[::1], float32[::1], int64)",
    "transpose_naive": f"void({_M}, {_M})",
    "transpose_tiled": f"void({_M}, {_M})",
    "transpose_padded": f"void({_M}, {_M})",
    "transpose_unsynced": f"void({_M}, {_M})",
    "matmul_naive": f"void({_M}, {_M}, {_M})",
    "matmul_tiled": f"void({_M}, {_M}, {_M})",
    "blur3x3": f"void({_M}, {_M})",
    "stencil3x3": f"void({_M}, {_M}, {_M})",
}


# ------------------------------------------------------------------------------------------------ 2-D grids

@cuda.jit
def scale_2d(a, out, s):
    """out = s * a, one thread per element. cuda.grid(2) gives (x, y); x runs along a row (the column index), so
    the 32 threads of a warp touch 32 neighbouring elements: one coalesced access."""
    col, row = cuda.grid(2)
    if row < a.shape[0] and col < a.shape[1]:
        out[row, col] = s * a[row, col]


@cuda.jit
def scale_2d_swapped(a, out, s):
    """The same with x along a column (the row index): a warp's 32 threads touch elements a whole row apart."""
    row, col = cuda.grid(2)
    if row < a.shape[0] and col < a.shape[1]:
        out[row, col] = s * a[row, col]


@cuda.jit
def copy_strided(src, dst, stride):
    """dst[i] = src[i * stride]: neighbouring threads read elements ``stride`` apart (src holds >= n * stride)."""
    i = cuda.grid(1)
    if i < dst.size:
        dst[i] = src[i * stride]


# ------------------------------------------------------------------------------------------------ transposes

@cuda.jit
def transpose_naive(a, out):
    """out[c, r] = a[r, c], a thread per element: the read is coalesced, the write strides down a column."""
    col, row = cuda.grid(2)
    if row < a.shape[0] and col < a.shape[1]:
        out[col, row] = a[row, col]


@cuda.jit
def transpose_tiled(a, out):
    """Through a TILE x TILE tile of shared memory: a block of TILE x BLOCK_ROWS threads reads its tile along
    rows (coalesced), waits for the whole tile, and writes the transposed tile along rows of the output
    (coalesced). Reading the tile down a column puts all 32 lanes in one bank: a 32-way conflict."""
    tile = cuda.shared.array((TILE, TILE), np.float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    col = cuda.blockIdx.x * TILE + tx
    row = cuda.blockIdx.y * TILE + ty
    for j in range(0, TILE, BLOCK_ROWS):
        if row + j < a.shape[0] and col < a.shape[1]:
            tile[ty + j, tx] = a[row + j, col]
    cuda.syncthreads()
    col = cuda.blockIdx.y * TILE + tx  # the output's column: a row index of a
    row = cuda.blockIdx.x * TILE + ty
    for j in range(0, TILE, BLOCK_ROWS):
        if row + j < out.shape[0] and col < out.shape[1]:
            out[row + j, col] = tile[tx, ty + j]


@cuda.jit
def transpose_padded(a, out):
    """transpose_tiled with each row of the tile one word longer: going down a column now steps 33 words, so the
    32 lanes fall in 32 different banks."""
    tile = cuda.shared.array((TILE, TILE_PADDED), np.float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    col = cuda.blockIdx.x * TILE + tx
    row = cuda.blockIdx.y * TILE + ty
    for j in range(0, TILE, BLOCK_ROWS):
        if row + j < a.shape[0] and col < a.shape[1]:
            tile[ty + j, tx] = a[row + j, col]
    cuda.syncthreads()
    col = cuda.blockIdx.y * TILE + tx
    row = cuda.blockIdx.x * TILE + ty
    for j in range(0, TILE, BLOCK_ROWS):
        if row + j < out.shape[0] and col < out.shape[1]:
            out[row + j, col] = tile[tx, ty + j]


@cuda.jit
def transpose_unsynced(a, out):
    """transpose_padded WITHOUT cuda.syncthreads(): a thread may read a tile element another warp has not
    written yet. Wrong on purpose (a race; compute-sanitizer's racecheck reports it); never use it."""
    tile = cuda.shared.array((TILE, TILE_PADDED), np.float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    col = cuda.blockIdx.x * TILE + tx
    row = cuda.blockIdx.y * TILE + ty
    for j in range(0, TILE, BLOCK_ROWS):
        if row + j < a.shape[0] and col < a.shape[1]:
            tile[ty + j, tx] = a[row + j, col]
    col = cuda.blockIdx.y * TILE + tx
    row = cuda.blockIdx.x * TILE + ty
    for j in range(0, TILE, BLOCK_ROWS):
        if row + j < out.shape[0] and col < out.shape[1]:
            out[row + j, col] = tile[tx, ty + j]


TRANSPOSE_KERNELS = {"naive": transpose_naive, "tiled": transpose_tiled, "padded": transpose_padded,
                     "unsynced": transpose_unsynced}


# ---------------------------------------------------------------------------------------------- matrix multiply

@cuda.jit
def matmul_naive(a, b, c):
    """c = a @ b, a thread per element of c: thread (row, col) reads row ``row`` of a and column ``col`` of b
    from global memory, 2 k loads for 2 k FLOPs."""
    col, row = cuda.grid(2)
    if row < c.shape[0] and col < c.shape[1]:
        acc = np.float32(0.0)
        for k in range(a.shape[1]):
            acc += a[row, k] * b[k, col]
        c[row, col] = acc


@cuda.jit
def matmul_tiled(a, b, c):
    """c = a @ b with MM_TILE x MM_TILE tiles of a and b in shared memory: the block loads a tile of each (one
    element per thread), waits, and every thread uses the MM_TILE values of its row and column from shared
    memory; each element a block loads is used MM_TILE times. Tiles past the edges are filled with zeros."""
    sa = cuda.shared.array((MM_TILE, MM_TILE), np.float32)
    sb = cuda.shared.array((MM_TILE, MM_TILE), np.float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    col = cuda.blockIdx.x * MM_TILE + tx
    row = cuda.blockIdx.y * MM_TILE + ty
    k_total = a.shape[1]
    acc = np.float32(0.0)
    for k0 in range(0, k_total, MM_TILE):
        sa[ty, tx] = a[row, k0 + tx] if row < a.shape[0] and k0 + tx < k_total else np.float32(0.0)
        sb[ty, tx] = b[k0 + ty, col] if k0 + ty < k_total and col < b.shape[1] else np.float32(0.0)
        cuda.syncthreads()
        for k in range(MM_TILE):
            acc += sa[ty, k] * sb[k, tx]
        cuda.syncthreads()  # before the next step overwrites the tiles others may still be reading
    if row < c.shape[0] and col < c.shape[1]:
        c[row, col] = acc


MATMUL_KERNELS = {"naive": matmul_naive, "tiled": matmul_tiled}


# ---------------------------------------------------------------------------------------------------- stencil

@cuda.jit
def blur3x3(img, out):
    """out[r, c] = the mean of the 3 x 3 neighbourhood of (r, c), edges clamped (a pixel past the border reads the
    nearest border pixel)."""
    col, row = cuda.grid(2)
    rows, cols = img.shape
    if row < rows and col < cols:
        acc = np.float32(0.0)
        for dr in range(-1, 2):
            r = min(max(row + dr, 0), rows - 1)
            for dc in range(-1, 2):
                acc += img[r, min(max(col + dc, 0), cols - 1)]
        out[row, col] = acc / np.float32(9.0)


@cuda.jit
def stencil3x3(img, w, out):
    """out[r, c] = the sum of w[i, j] * img[r + i - 1, c + j - 1] over the 3 x 3 neighbourhood, edges clamped: any
    3 x 3 filter (GAUSSIAN_3X3, say), one thread per pixel reading its nine neighbours from global memory."""
    col, row = cuda.grid(2)
    rows, cols = img.shape
    if row < rows and col < cols:
        acc = np.float32(0.0)
        for i in range(3):
            r = min(max(row + i - 1, 0), rows - 1)
            for j in range(3):
                acc += w[i, j] * img[r, min(max(col + j - 1, 0), cols - 1)]
        out[row, col] = acc


# ------------------------------------------------------------------------------------------------------ specs

def scale_spec(a: np.ndarray, s: float) -> np.ndarray:
    return (np.float32(s) * np.asarray(a, np.float32)).astype(np.float32)


def transpose_spec(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a).T)


def matmul_spec(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """In float64: the float32 kernels agree to about 1e-5 relative for the lesson's sizes."""
    return np.asarray(a, np.float64) @ np.asarray(b, np.float64)


def blur_spec(img: np.ndarray, weights=None) -> np.ndarray:
    """The 3 x 3 mean (or the 3 x 3 filter ``weights``) of every pixel, edges clamped, in float64."""
    img = np.asarray(img, np.float64)
    w = np.full((3, 3), 1 / 9.0) if weights is None else np.asarray(weights, np.float64)
    p = np.pad(img, 1, mode="edge")
    rows, cols = img.shape
    return sum(w[1 + dr, 1 + dc] * p[1 + dr:1 + dr + rows, 1 + dc:1 + dc + cols]
               for dr in (-1, 0, 1) for dc in (-1, 0, 1))


def matmul_tolerance(k: int) -> float:
    """Relative error (of the largest element) a float32 dot product of length k stays within, for inputs of one
    sign: a few float32 epsilons per sqrt(k), with room."""
    return 8 * float(np.finfo(np.float32).eps) * max(1.0, math.sqrt(k))


# ---------------------------------------------------------------------------------------------------- launchers

def grid_2d(shape, block=(16, 16)) -> tuple:
    """(blocks, threads) that cover a (rows, cols) array with blocks of block = (x, y) threads, x along the
    columns: blocks = (ceil(cols / x), ceil(rows / y)). For a kernel with x along the rows, pass (cols, rows)."""
    rows, cols = (int(v) for v in shape)
    bx, by = (int(v) for v in block)
    if bx < 1 or by < 1 or bx * by > 1024:
        raise runtime.CourseInputError(f"a block has 1 to 1024 threads, got {bx} x {by} = {bx * by}")
    if rows < 1 or cols < 1:
        raise runtime.CourseInputError(f"nothing to cover: shape {(rows, cols)}")
    return (math.ceil(cols / bx), math.ceil(rows / by)), (bx, by)


def _is_cupy(x) -> bool:
    return type(x).__module__.startswith("cupy")


def _matrix(x, name: str, dtype=np.float32):
    """(device array, kind): kind "numpy" (copied to the device here), "cupy" or "numba"."""
    if isinstance(x, np.ndarray):
        kind = "numpy"
    elif _is_cupy(x):
        kind = "cupy"
    elif runtime.is_device_array(x):
        kind = "numba"
    else:
        raise runtime.CourseInputError(f"{name} must be a NumPy, CuPy or device array, got {type(x).__name__}")
    if np.dtype(x.dtype) != np.dtype(dtype):
        raise runtime.CourseInputError(f"{name} must have dtype {np.dtype(dtype)}, got {np.dtype(x.dtype)}")
    if len(x.shape) != 2:
        raise runtime.CourseInputError(f"{name} must be 2-dimensional (a matrix or an image), got shape "
                                       f"{tuple(x.shape)}")
    if 0 in x.shape:
        raise runtime.CourseInputError(f"{name} is empty: shape {tuple(x.shape)}")
    if kind == "numpy":
        return cuda.to_device(np.ascontiguousarray(x)), kind
    if kind == "cupy":
        if not x.flags.c_contiguous:
            raise runtime.CourseInputError(f"{name} must be C-contiguous (cupy.ascontiguousarray)")
        return x, kind
    if not x.is_c_contiguous():
        raise runtime.CourseInputError(f"{name} must be C-contiguous")
    return x, kind


def _empty(shape, kind, out=None, name="out"):
    if out is not None:
        got, _ = _matrix(out, name)
        if tuple(got.shape) != tuple(shape):
            raise runtime.CourseInputError(f"{name} must have shape {tuple(shape)}, got {tuple(got.shape)}")
        return out
    if kind == "cupy":
        return runtime.cupy().empty(shape, dtype=np.float32)
    return cuda.device_array(shape, dtype=np.float32)


def _numba(x):
    """What a numba kernel is given: CuPy arrays as numba views (no copy), the rest as they are."""
    return cuda.as_cuda_array(x) if _is_cupy(x) else x


def _back(out, kind):
    return out.copy_to_host() if kind == "numpy" else out


def scale(a, s: float, *, swapped: bool = False, block=(16, 16), out=None):
    """s * a, one thread per element, blocks of block = (x, y) threads; x along the columns (coalesced), or along
    the rows with ``swapped``. Asynchronous for device arrays."""
    d, kind = _matrix(a, "a")
    o = _empty(d.shape, kind, out)
    if swapped:
        blocks, threads = grid_2d(d.shape[::-1], block)
        scale_2d_swapped[blocks, threads](_numba(d), _numba(o), np.float32(s))
    else:
        blocks, threads = grid_2d(d.shape, block)
        scale_2d[blocks, threads](_numba(d), _numba(o), np.float32(s))
    return _back(o, kind)


def strided(src, n: int, stride: int, *, out=None, threads: int = STRIDE_THREADS):
    """src[0 : n * stride : stride] gathered by copy_strided: thread i reads src[i * stride]. src: 1-D float32
    (NumPy, CuPy or device) of at least (n - 1) * stride + 1 elements."""
    if stride < 1 or n < 1:
        raise runtime.CourseInputError(f"n and stride must be at least 1, got n={n}, stride={stride}")
    if len(src.shape) != 1 or np.dtype(src.dtype) != np.float32:
        raise runtime.CourseInputError(f"src must be 1-D float32, got shape {tuple(src.shape)}, dtype {src.dtype}")
    if src.shape[0] < (n - 1) * stride + 1:
        raise runtime.CourseInputError(f"src holds {src.shape[0]} elements; n={n} at stride {stride} needs "
                                       f"{(n - 1) * stride + 1}")
    kind = "numpy" if isinstance(src, np.ndarray) else "cupy" if _is_cupy(src) else "numba"
    d = cuda.to_device(src) if kind == "numpy" else src
    if out is None:
        out = runtime.cupy().empty(n, np.float32) if kind == "cupy" else cuda.device_array(n, np.float32)
    elif tuple(out.shape) != (n,):
        raise runtime.CourseInputError(f"out must have shape ({n},), got {tuple(out.shape)}")
    copy_strided[math.ceil(n / threads), threads](_numba(d), _numba(out), np.int64(stride))
    return _back(out, kind)


def transpose(a, *, variant: str = "padded", out=None):
    """a.T through transpose_``variant`` (naive, tiled, padded), in blocks of TILE x BLOCK_ROWS threads."""
    if variant not in TRANSPOSE_KERNELS:
        raise runtime.CourseInputError(f"variant must be one of {VARIANTS}, not {variant!r}")
    d, kind = _matrix(a, "a")
    rows, cols = d.shape
    o = _empty((cols, rows), kind, out)
    if variant == "naive":
        blocks, threads = grid_2d(d.shape, (TILE, BLOCK_ROWS))
    else:  # a block per TILE x TILE tile, each thread TILE / BLOCK_ROWS elements
        blocks, threads = (math.ceil(cols / TILE), math.ceil(rows / TILE)), (TILE, BLOCK_ROWS)
    TRANSPOSE_KERNELS[variant][blocks, threads](_numba(d), _numba(o))
    return _back(o, kind)


def matmul(a, b, *, variant: str = "tiled", out=None):
    """a @ b in float32 (matmul_naive or matmul_tiled), blocks of MM_TILE x MM_TILE threads."""
    if variant not in MATMUL_KERNELS:
        raise runtime.CourseInputError(f"variant must be one of {MATMULS}, not {variant!r}")
    da, kind = _matrix(a, "a")
    db, kind_b = _matrix(b, "b")
    if (kind == "cupy") != (kind_b == "cupy"):
        raise runtime.CourseInputError("a and b must both be CuPy arrays or neither")
    if da.shape[1] != db.shape[0]:
        raise runtime.CourseInputError(f"a is {tuple(da.shape)} and b is {tuple(db.shape)}: a's columns must "
                                       f"equal b's rows")
    m, n = da.shape[0], db.shape[1]
    o = _empty((m, n), kind, out, "c")
    blocks, threads = grid_2d((m, n), (MM_TILE, MM_TILE))
    MATMUL_KERNELS[variant][blocks, threads](_numba(da), _numba(db), _numba(o))
    return _back(o, kind)


def blur(img, *, weights=None, block=(16, 16), out=None):
    """The 3 x 3 mean of every pixel of a 2-D float32 image (blur3x3), or the 3 x 3 filter ``weights``
    (stencil3x3, e.g. GAUSSIAN_3X3), edges clamped."""
    d, kind = _matrix(img, "img")
    o = _empty(d.shape, kind, out)
    blocks, threads = grid_2d(d.shape, block)
    if weights is None:
        blur3x3[blocks, threads](_numba(d), _numba(o))
    else:
        w = np.asarray(weights, np.float32)
        if w.shape != (3, 3):
            raise runtime.CourseInputError(f"weights must be a 3 x 3 filter, not of shape {w.shape}")
        stencil3x3[blocks, threads](_numba(d), cuda.to_device(w), _numba(o))
    return _back(o, kind)


# ------------------------------------------------------------------------------ CUDA C: the hierarchy probes

def _require_cupy(*arrays) -> None:
    runtime.require_gpu("the memory hierarchy probes (CUDA C)")
    for a in arrays:
        if not _is_cupy(a):
            raise runtime.CourseInputError("the CUDA C probes take CuPy arrays (cupy.asarray(...))")


def chase_chain(nodes: int, spacing: int, *, xp=np, seed: int = 0):
    """A pointer-chase chain: ``nodes`` nodes ``spacing`` uint32 words apart in an array of nodes * spacing words;
    each node holds the index of the next, in one random cycle through all of them (a random order of the nodes,
    the last leading back to the first), so no prefetcher can guess the next address and every load waits for the
    one before. Node 0 is on the cycle like every other. xp: numpy, or cupy to build it on the GPU."""
    if nodes < 2 or spacing < 1:
        raise runtime.CourseInputError("a chain needs at least 2 nodes and a spacing of at least 1 word")
    if nodes * spacing >= 2**32:
        raise runtime.CourseInputError("a chain's indices are uint32: at most 2**32 words")
    if xp is np:
        order = np.random.default_rng(seed).permutation(nodes)
    else:
        xp.random.seed(seed)
        order = xp.random.permutation(nodes)
    chain = xp.zeros(nodes * spacing, dtype=xp.uint32)
    chain[order * spacing] = (xp.roll(order, -1) * spacing).astype(xp.uint32)
    return chain


def chase(chain, *, steps: int, warm: int | None = None, shared: bool = False) -> float:
    """Cycles per load of a chase of ``steps`` dependent loads through ``chain`` (a CuPy uint32 array from
    chase_chain), one thread, timed with clock64(), after ``warm`` untimed loads (default: ``steps``; give the
    number of nodes or more to walk a chain that fits a cache into it first). shared: the chain (at most SHARED_CHASE_WORDS words) copied into
    shared memory and chased there."""
    cp = runtime.cupy()
    _require_cupy(chain)
    if steps < 1:
        raise runtime.CourseInputError("steps must be at least 1")
    out = cp.zeros(2, dtype=cp.uint64)
    if shared:
        if chain.size > SHARED_CHASE_WORDS:
            raise runtime.CourseInputError(f"a shared-memory chain holds at most {SHARED_CHASE_WORDS} words")
        cuda_c.function(SOURCE, "chase_shared")((1,), (1,), (chain, np.int32(chain.size), np.int32(steps), out))
    else:
        warm = steps if warm is None else warm
        cuda_c.function(SOURCE, "chase_global")((1,), (1,), (chain, np.int32(warm), np.int32(steps), out))
    cycles, _ = out.get()
    return float(cycles) / steps


SHARED_CHASE_WORDS = 12 * 1024  # 48 KiB: what every GPU gives a block


def fma_chain(steps: int = 4096) -> float:
    """Cycles per fused multiply-add in a chain where each needs the one before: the latency of the FMA unit,
    operands and result in registers."""
    cp = runtime.cupy()
    runtime.require_gpu("the FMA latency probe")
    out = cp.zeros(2, dtype=cp.uint64)
    cuda_c.function(SOURCE, "fma_chain")((1,), (1,), (np.float32(0.999), np.float32(0.001), np.int32(steps), out))
    return float(out.get()[0]) / steps


def clock_ghz(ms: float = 2.0) -> float:
    """The SM clock while it runs, in GHz: SM cycles (clock64) over nanoseconds (%globaltimer) of a spin."""
    cp = runtime.cupy()
    runtime.require_gpu("reading the SM clock")
    out = cp.zeros(2, dtype=cp.uint64)
    cuda_c.function(SOURCE, "clock_rate")((1,), (1,), (np.uint64(int(ms * 1e6)), out))
    cycles, ns = out.get()
    return float(cycles) / float(ns)


def read_level(x, *, slice_vec: int, reps: int, shift: int, blocks: int, threads: int = 256, sink=None):
    """A read-bandwidth probe: block b reads, ``reps`` times, slice (b + r * shift) % blocks of x (float32,
    slices of ``slice_vec`` float4 each). shift 0: each block rereads its own slice (its SM's L1 serves it where
    it fits); shift != 0: a block reads another slice each time (L2 serves them where all fit). Bytes read:
    blocks * reps * slice_vec * 16. Asynchronous."""
    cp = runtime.cupy()
    _require_cupy(x)
    if x.dtype != cp.float32 or x.size < blocks * slice_vec * 4:
        raise runtime.CourseInputError("x must be float32 with at least blocks * slice_vec * 4 elements")
    if not (0 <= shift < blocks and 1 <= slice_vec < 2**31):
        raise runtime.CourseInputError("shift must be 0 .. blocks - 1, and a slice fewer than 2**31 float4")
    sink = sink if sink is not None else cp.zeros(1, dtype=cp.float32)
    cuda_c.function(SOURCE, "read_level")((blocks,), (threads,), (x, np.int32(slice_vec), np.int32(reps),
                                                                  np.int32(shift), sink))
    return sink


def shared_read(*, reps: int, blocks: int, threads: int = 256, sink=None):
    """Shared-memory read bandwidth: every thread reads a float4 from its block's shared array ``reps`` times,
    conflict-free (blocks * threads * reps * 16 bytes). Asynchronous."""
    cp = runtime.cupy()
    runtime.require_gpu("the shared-memory bandwidth probe")
    sink = sink if sink is not None else cp.zeros(1, dtype=cp.float32)
    cuda_c.function(SOURCE, "shared_read")((blocks,), (threads,), (np.int32(reps), sink))
    return sink

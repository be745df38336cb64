"""Lesson 10, attention's backward pass in CUDA C on Hopper (kernels/cuda/attention_bwd_wgmma.cu): FlashAttention-3's
shape, wgmma fed by the TMA, a producer warpgroup and two consumers, dK and dV kept in registers by a block per tile
of 128 keys, dQ summed in FP32 by the TMA's bulk atomic adds. The algorithm is backward_tiles.py's with
block_m = 64, block_n = 128, and either way of forming dQ; the launcher runs its three steps: the pre-pass
D = rowsum(dO o O), the kernel, and dQ's FP32 sums rounded to FP16 (or the second pass, which writes dQ itself).

Any N: the grids run ceil(N / tile) blocks, the TMA reads through 3-D tensor maps (heads x N x d) that fill a tile's
rows past N with zeros, and LSE and D come padded to ``padded_rows(N)`` rows a head (lse = +inf, D = 0 there), so
that a query row past N has P = 0; the kernels mask keys past N and store no row past N (``kernel_indices``
emulates which rows, keys and bytes each block touches)."""
from __future__ import annotations

import numpy as np

from gpucourse import runtime

from .flash import LOG2E, _fp16_inputs, _scale

BWD_SOURCE = "attention_bwd_wgmma"
# head dims; queries a step, keys a block; Q/dO stages (d = 64 too: its smaller tiles would allow 4 in shared memory,
# but with no GPU measurement yet it keeps d = 128's 2)
BWD_HEAD_DIMS, BWD_BLOCK_M, BWD_BLOCK_N, BWD_STAGES = (64, 128), 64, 128, 2
DQ_BLOCK_M = 128  # the second pass: query rows a block (two consumers of 64), against tiles of BWD_BLOCK_N keys
DQ_MODES = ("atomic", "second-pass")  # as backward_tiles.DQ_MODES
# dq="auto": the way measured faster (results/, the field's two CUDA C rows): the atomics, at N = 1k, 4k and 16k, causal
# and not, on an H200 with LSE and D in the stages (the H100's record, older, had the second pass faster at 1k). The
# second pass stays for what it shows and for a dQ that is the same from run to run (no atomics, no order to vary).
DQ_AUTO = "atomic"
PREPASS_ROWS = 8  # rows of the pre-pass a block of 256 threads (a warp a row)


def padded_rows(n: int) -> int:
    """Rows a head of the LSE and D arrays the kernels read: N rounded up to a multiple of 128 (the second pass's
    blocks), as the CUDA C's padded_rows."""
    return -(-n // DQ_BLOCK_M) * DQ_BLOCK_M


def kernel_indices(n: int, causal: bool, d: int = 128) -> dict:
    """The index arithmetic of both kernels for one head of n rows, emulated thread by thread in NumPy as the CUDA C
    writes it (a block's two consumers x 4 warps x 32 lanes, g = lane / 4, q = lane % 4): for the first kernel
    (``"dkdv"``, a block per 128 keys walking query tiles of 64) and the second pass (``"dq"``, a block per 128 query
    rows walking key tiles of 128), ``live`` an n x n count of how often each (query, key) gets P != 0 (the mask,
    and lse = +inf on the padded rows past n), ``stored`` a count of the 16-byte stores of the end (dK and dV, or dQ)
    per row (NP + 128 of them, so a store past n would show) and 8-column chunk (store_rows_fp16: thread q stores
    columns 32x + 8q .. + 7), ``lse_reads`` the largest LSE/D row read (< NP); and for
    the first kernel ``dq_adds``, the (first row, bytes) of each bulk add of a dQ tile (d = 128: one a tile, the
    consumers' column halves together; d = 64: one a consumer, each over its own keys); ``"prepass"``, how often
    the pre-pass writes each row of D for two heads (2 NP rows: its padding must stay untouched)."""
    bm, bn, NP = BWD_BLOCK_M, BWD_BLOCK_N, padded_rows(n)
    c, warp, lane = np.meshgrid(np.arange(2), np.arange(4), np.arange(32), indexing="ij")
    g, q = (lane // 4).ravel(), (lane % 4).ravel()
    c, warp = c.ravel(), warp.ravel()
    a, e = np.meshgrid(np.arange(4), np.arange(8), indexing="ij")  # a query block of 16, the element of it
    a, e = a.ravel(), e.ravel()
    lse_pad = np.arange(NP) >= n  # the padding the launcher gives: lse = +inf there, so P = 0
    chunks = 4 * np.arange(d // 32)[None, :] + q[:, None]  # a thread's 16-byte chunks of a row

    def add(live, rows, cols, ok):
        np.add.at(live, (rows[ok], cols[ok]), 1)

    def store(stored, row0):  # store_rows_fp16(..., rows = n): rows row0 and row0 + 8, those before n
        for h in range(2):
            r = np.broadcast_to((row0 + 8 * h)[:, None], chunks.shape)
            np.add.at(stored, (r[r < n], chunks[r < n]), 1)

    out = {}
    # the first kernel: keys key0 + 8 ((e / 2) % 2) of the thread, queries i BM + 16a + 8 (e / 4) + 2q + e % 2
    live, stored, adds, reads = np.zeros((n, n), int), np.zeros((NP + bn, d // 8), int), [], 0
    tiles_m = -(-n // bm)
    for j in range(-(-n // bn)):
        key0 = j * bn + 64 * c + 16 * warp + g
        first = (j * bn) // bm if causal else 0
        for i in range(first, tiles_m):
            key = key0[:, None] + 8 * ((e[None, :] >> 1) & 1)
            query = i * bm + 16 * a[None, :] + 8 * (e[None, :] >> 2) + 2 * q[:, None] + (e[None, :] & 1)
            reads = max(reads, (i + 1) * bm - 1)  # the TMA brings the tile's 64 rows of LSE and D
            masked = key > query if causal else key >= n
            add(live, query, key, ~masked & ~lse_pad[query])
            adds += [(i * bm, min(bm, n - i * bm) * d * 4)] * (2 if d == 64 else 1)
        store(stored, key0)
    out["dkdv"] = {"live": live, "stored": stored, "lse_reads": reads, "dq_adds": adds}
    # the second pass: rows row0 + 8 ((e / 2) % 2), keys t BN + 16a + 8 (e / 4) + 2q + e % 2 (a over 8 blocks here)
    a8, e8 = np.meshgrid(np.arange(bn // 16), np.arange(8), indexing="ij")
    a8, e8 = a8.ravel(), e8.ravel()
    live, stored, reads = np.zeros((n, n), int), np.zeros((NP + DQ_BLOCK_M, d // 8), int), 0
    tiles_n = -(-n // bn)
    for m in range(-(-n // DQ_BLOCK_M)):
        row0 = m * DQ_BLOCK_M + 64 * c + 16 * warp + g
        reads = max(reads, int((row0 + 8).max()))
        tiles = min((m * DQ_BLOCK_M + DQ_BLOCK_M) // bn, tiles_n) if causal else tiles_n
        for t in range(tiles):
            row = row0[:, None] + 8 * ((e8[None, :] >> 1) & 1)
            key = t * bn + 16 * a8[None, :] + 8 * (e8[None, :] >> 2) + 2 * q[:, None] + (e8[None, :] & 1)
            edge = not causal and (t + 1) * bn > n
            masked = key > row if causal else (edge & (key >= n))
            add(live, row, key, ~masked & ~lse_pad[row])
        store(stored, row0)
    out["dq"] = {"live": live, "stored": stored, "lse_reads": reads}
    written = np.zeros(2 * NP, int)  # the pre-pass over two heads: row -> row / N NP + row % N
    rows = np.arange(2 * n)
    np.add.at(written, rows // n * NP + rows % n, 1)
    out["prepass"] = written
    return out


def bwd_smem_bytes(d: int = 128, stages: int = BWD_STAGES) -> int:
    """Shared memory of one block: alignment, K's and V's tiles, the stages of Q and dO, dS^T (FP16), the FP32 dQ
    tiles (64 KiB: two of 64 x 128, or at d = 64 two a consumer of 64 x 64), the mbarriers (in 128 bytes), the
    stages' rows of LSE and D (FP32)."""
    bm, bn = BWD_BLOCK_M, BWD_BLOCK_N
    return 1024 + 2 * bn * d * 2 + 2 * stages * bm * d * 2 + bn * bm * 2 + 65536 + 128 + stages * 2 * bm * 4


def dq_smem_bytes(d: int = 128, stages: int = BWD_STAGES) -> int:
    """Shared memory of one block of the second pass: alignment, Q's and dO's tiles, the stages of K and V, the
    mbarriers."""
    tile = 128 * d * 2
    return 1024 + 2 * tile + 2 * stages * tile + 8 * (1 + 2 * stages)


def dq_column_swizzle(rows: int, d: int = 128, n: int | None = None) -> np.ndarray:
    """The column of the FP32 dQ buffer where the atomic backward keeps element (r, c), for every row r < rows of
    heads of ``n`` rows each (default: one head of ``rows``): c XOR 8 (r' % 4), r' the row within its head (a tile
    starts at a multiple of 64 rows of its head, so r' % 4 is the row's within its tile). Each row keeps its own d
    columns (64 or 128), so the bulk reduction of a tile stays one contiguous block; the XOR only spreads a warp's
    stores of 8 rows over all 32 shared-memory banks."""
    r = np.arange(rows)[:, None] % (n or rows)
    return np.arange(d)[None, :] ^ (8 * (r % 4))


ROUND_THREADS = 256  # the dQ rounding's block: a thread per 8 columns of a row


def unswizzle_dq(acc, d: int = 128, n: int | None = None):
    """The atomic backward's FP32 dQ buffer (rows x d, heads of ``n`` rows, default one head; the columns of a row
    r' of its head XOR 8 (r' % 4): dq_column_swizzle) in row order, rounded to FP16, in one pass on the GPU
    (attention_bwd_dq_round: the XOR moves whole groups of 8 columns, so each thread moves 32 bytes in and 16 out, and
    the pass takes the time of its bytes)."""
    from kernels.tensor_cores import hopper_kernel

    cp = runtime.cupy()
    rows = acc.shape[0]
    out = cp.empty(acc.shape, cp.float16)
    fn = hopper_kernel(BWD_SOURCE, "attention_bwd_dq_round" + ("_d64" if d == 64 else ""), 0)
    fn((-(-rows * (d // 8) // ROUND_THREADS),), (ROUND_THREADS,), (acc, out, np.int64(rows), np.int32(n or rows)))
    return out


def flash_backward_wgmma(q, k, v, o, lse, do, *, causal: bool = False, scale=None, dq: str = "auto") -> tuple:
    """(dq, dk, dv) of attention for CuPy float16 arrays q, k, v, o, do of shape (batch, heads, N, d) (or (heads, N,
    d), (N, d)), d 64 or 128, any N >= 1, lse float32 of the same shape without d (the forward's, natural log), on
    Hopper (compute capability 9.0). ``dq``: "atomic" (each key block adds its dQ tile into an FP32 buffer) or
    "second-pass" (a kernel per 128 query rows recomputes S, P and dP for dQ), or "auto" (the one measured faster:
    DQ_AUTO). Returns float16 arrays of q's shape."""
    import ctypes

    runtime.require_gpu("the CUDA C backward")
    cp = runtime.cupy()
    from gpucourse import gpus
    from kernels.tensor_cores import hopper_kernel, launch_hopper, tensor_map

    B, H, N, D = _fp16_inputs(q, k, v, "flash_backward_wgmma", BWD_HEAD_DIMS)
    for name, a in (("o", o), ("do", do)):
        if not isinstance(a, cp.ndarray) or a.dtype != cp.float16 or not a.flags.c_contiguous or a.shape != q.shape:
            raise runtime.CourseInputError(f"flash_backward_wgmma: {name} must be a contiguous CuPy float16 array of "
                                           f"q's shape {tuple(q.shape)}")
    if not isinstance(lse, cp.ndarray) or lse.dtype != cp.float32 or lse.shape != q.shape[:-1] \
            or not lse.flags.c_contiguous:
        raise runtime.CourseInputError(f"flash_backward_wgmma: lse must be a contiguous CuPy float32 array of shape "
                                       f"{tuple(q.shape[:-1])} (the forward's)")
    if dq not in (*DQ_MODES, "auto"):
        raise runtime.CourseInputError(f"flash_backward_wgmma: dq must be one of {(*DQ_MODES, 'auto')}, got {dq!r}")
    gpus.step("10.wgmma_bwd")
    if dq == "auto":
        dq = DQ_AUTO
    rows, NP = B * H * N, padded_rows(N)
    # LSE and D with NP rows a head: the padding's lse = +inf and D = 0 give a query row past N P = 0
    lse_p = lse.reshape(B * H, N)
    if NP != N:
        lse_p = cp.full((B * H, NP), cp.inf, cp.float32)
        lse_p[:, :N] = lse.reshape(B * H, N)
    dsum = (cp.zeros if NP != N else cp.empty)(B * H * NP, cp.float32)  # 1. the pre-pass: D = rowsum(dO o O)
    prepass = hopper_kernel(BWD_SOURCE, "attention_bwd_prepass" + ("_d64" if D == 64 else ""), 0)
    prepass((-(-rows // PREPASS_ROWS),), (32 * PREPASS_ROWS,), (o, do, dsum, np.int32(rows), np.int32(N)))
    atomic = dq == "atomic"
    dq_acc = cp.zeros((rows, D), cp.float32) if atomic else cp.empty((0,), cp.float32)  # 2. dK, dV (and dQ's sums)
    dk, dv = cp.empty_like(k), cp.empty_like(v)
    tail = "" if atomic else "_dkdv"
    name = f"flash_bwd_wgmma_d{D}{tail}" + ("_causal" if causal else "")
    smem = bwd_smem_bytes(D)
    fn = hopper_kernel(BWD_SOURCE, name, smem)
    # 3-D maps, a head at a time: a tile reaching past row N of its head is read as zeros, not as the next head's
    maps = [tensor_map(x.reshape(B * H, N, D), (1, box, 64)) for x, box in
            ((q, BWD_BLOCK_M), (k, BWD_BLOCK_N), (v, BWD_BLOCK_N), (do, BWD_BLOCK_M))]
    sc = _scale(D, scale)
    scales = [ctypes.c_int32(N), ctypes.c_float(sc), ctypes.c_float(sc * LOG2E)]
    args = [*maps, ctypes.c_uint64(lse_p.data.ptr), ctypes.c_uint64(dsum.data.ptr),
            ctypes.c_uint64(dq_acc.data.ptr), ctypes.c_uint64(dk.data.ptr), ctypes.c_uint64(dv.data.ptr), *scales]
    launch_hopper(fn, (-(-N // BWD_BLOCK_N), B * H), 384, smem, args, name)
    if atomic:
        return unswizzle_dq(dq_acc, D, N).reshape(q.shape), dk, dv  # 3. dQ in row order, rounded to FP16
    dq_out = cp.empty_like(q)  # 3. the second pass: dQ, a block per 128 query rows
    name = f"flash_bwd_dq_wgmma_d{D}" + ("_causal" if causal else "")
    smem = dq_smem_bytes(D)
    fn = hopper_kernel(BWD_SOURCE, name, smem)
    maps = [tensor_map(x.reshape(B * H, N, D), (1, 128, 64)) for x in (q, k, v, do)]
    args = [*maps, ctypes.c_uint64(lse_p.data.ptr), ctypes.c_uint64(dsum.data.ptr), ctypes.c_uint64(dq_out.data.ptr),
            *scales]
    launch_hopper(fn, (-(-N // DQ_BLOCK_M), B * H), 384, smem, args, name)
    return dq_out, dk, dv

"""Lesson 10, FlashAttention's forward pass: a readable numba kernel (one thread per query row, K and V tiles
through shared memory; it also runs in the simulator), the tensor-core kernel of kernels/cuda/attention.cu
(WMMA, sm_80+), FlashAttention-2's shape on mma.sync of kernels/cuda/attention_mma.cu (sm_80+: S, P and O in
registers) and Hopper's of kernels/cuda/attention_wgmma.cu (wgmma fed by the TMA, a producer warpgroup and two
consumers), with their launchers. All return (o, lse) as specs.attention_spec does."""
from __future__ import annotations

import functools
import math
import re
from typing import NamedTuple

import numpy as np

from gpucourse import cuda_c, runtime

from .specs import check_qkv

cuda = runtime.cuda()

SOURCE = "attention"
BLOCK_M, BLOCK_N, MAX_D = 32, 32, 128  # the numba kernel: query rows a block, keys a tile, the largest head dim
WMMA_HEAD_DIMS = (64, 128)
WMMA_WARPS, WMMA_BLOCK_N = 8, 64
WGMMA_SOURCE, WGMMA_BLOCK_M, WGMMA_HEAD_DIMS = "attention_wgmma", 128, (64, 128)
# Hopper's variants (kernels/cuda/attention_wgmma.cu): keys a tile, stages of K and V, and how a consumer orders its
# work: "serial" (S, softmax, P V, each waiting for the last), "ahead" (S of the next tile issued right behind P V of
# this one, one wait for both), "pipelined" (S of the next tile and P V of this one issued together, the softmax of
# the next while P V runs), "pingpong" (pipelined, and the two consumers take turns at the tensor cores), "qregs"
# (ping-pong with each consumer's rows of Q copied into registers once an item: Q K^T reads only K from shared
# memory). The variants of a head dim differ only in that order: they share its tiles, WGMMA_TILES (keys a tile,
# stages of K and V).
WGMMA_VARIANTS = {d: ("serial", "ahead", "pipelined", "pingpong", "qregs") for d in (64, 128)}
WGMMA_TILES = {64: (128, 4), 128: (128, 3)}
# The default: at d = 128 the fastest in the field (H100 and H200 records); at d = 64 (not in the field) serial is
# the fastest causal on both GPUs, qregs full (A/B runs of 2026-11-26: 0.95-0.98x and 0.98-1.00x cuDNN).
WGMMA_DEFAULT = {64: "serial", 128: "qregs"}
LOG2E = 1.4426950408889634
# The numba kernels with a signature: tests/test_gpu_archs.py compiles each for every GPU the course supports.
NUMBA_KERNELS = {"flash_forward_numba": "void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], "
                                        "float32[:, :, ::1], float32[:, ::1], float32, boolean)"}


@cuda.jit
def flash_forward_numba(q, k, v, o, lse, scale, causal):
    """One block per BLOCK_M query rows of one (batch x head) (q, k, v, o: (BH, N, d); lse: (BH, N)); one thread per
    row. The block brings K and V in tiles of BLOCK_N keys through shared memory; each thread keeps its row's running
    max m, running sum l and unnormalised output acc (the online softmax), rescaling them when the max grows, and
    normalises once at the end. Causal: tiles wholly above the diagonal are skipped."""
    k_s = cuda.shared.array((BLOCK_N, MAX_D), np.float32)
    v_s = cuda.shared.array((BLOCK_N, MAX_D), np.float32)
    acc = cuda.local.array(MAX_D, np.float32)
    bh, t = cuda.blockIdx.y, cuda.threadIdx.x
    n, d = q.shape[1], q.shape[2]
    row = cuda.blockIdx.x * BLOCK_M + t
    for j in range(d):
        acc[j] = 0.0
    m, l = -np.inf, np.float32(0.0)
    last = min(n, (cuda.blockIdx.x + 1) * BLOCK_M) if causal else n  # causal: no key past the block's last row
    for start in range(0, last, BLOCK_N):
        for i in range(t, BLOCK_N * d, BLOCK_M):  # the block loads the tile together
            r, c = i // d, i % d
            k_s[r, c] = k[bh, start + r, c] if start + r < n else 0.0
            v_s[r, c] = v[bh, start + r, c] if start + r < n else 0.0
        cuda.syncthreads()
        if row < n:
            for r in range(min(BLOCK_N, n - start)):
                key = start + r
                if causal and key > row:
                    break
                s = np.float32(0.0)
                for j in range(d):
                    s += np.float32(q[bh, row, j]) * k_s[r, j]
                s *= scale
                m_new = max(m, s)
                alpha = math.exp(m - m_new)  # 0 for the first key (m = -inf)
                p = math.exp(s - m_new)
                l = l * alpha + p
                for j in range(d):
                    acc[j] = acc[j] * alpha + p * v_s[r, j]
                m = m_new
        cuda.syncthreads()
    if row < n:
        inv = np.float32(1.0) / l if l > 0 else np.float32(0.0)
        for j in range(d):
            o[bh, row, j] = acc[j] * inv
        lse[bh, row] = m + math.log(l) if l > 0 else -np.inf


def _scale(d: int, scale) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def flash_numba(q, k, v, o, lse, *, causal: bool = False, scale=None, kernel=None):
    """Run ``flash_forward_numba`` (or ``kernel``, a kernel of the same signature) on device arrays q, k, v, o of shape
    (batch x heads, N, d) and lse of (batch x heads, N); returns (o, lse)."""
    for name, a in (("q", q), ("k", k), ("v", v), ("o", o)):
        runtime.check_device_array(a, name, ndim=3)
    bh, n, d = check_qkv(q, k, v, "flash_numba")[1:]
    if tuple(o.shape) != tuple(q.shape) or tuple(lse.shape) != (bh, n):
        raise runtime.CourseInputError(f"flash_numba: o must be {tuple(q.shape)} and lse {(bh, n)}")
    if d > MAX_D:
        raise runtime.CourseInputError(f"flash_numba: head dim {d} is larger than the kernel's {MAX_D}")
    with runtime.small_grids():  # the lesson runs it at small sizes on purpose: a few blocks
        (kernel or flash_forward_numba)[(math.ceil(n / BLOCK_M), bh), BLOCK_M](q, k, v, o, lse,
                                                                                np.float32(_scale(d, scale)), bool(causal))
    return o, lse


def wmma_smem_bytes(d: int, warps: int = WMMA_WARPS) -> int:
    """Shared memory of one block of the WMMA kernel (FlashSmem in attention.cu): two stages of K and V; Q's tile,
    whose bytes then hold the warps' scores S (float) and probabilities P (half); three floats a row; the row map."""
    bm, ld = 16 * warps, d + 8
    return 2 * 2 * WMMA_BLOCK_N * ld * 2 + max(bm * ld * 2, warps * 16 * 68 * 4) + 3 * bm * 4 + 16 * 16 * 4


def wmma_missing(d: int, cc=None) -> str | None:
    """None where a block of the WMMA kernel at head dim ``d`` fits the shared memory of the GPU (this one, the faked
    one, or ``cc``), else one line saying it does not: at d = 128 it needs more than the 99 KiB an RTX 30xx/40xx, A10
    or L4 gives a block, and at either head dim more than a T4's 64 KiB."""
    from gpucourse import gpus

    return gpus.shared_memory_missing(wmma_smem_bytes(d), what=f"the WMMA FlashAttention kernel at head dim {d}",
                                      cc=cc)


def _fp16_inputs(q, k, v, what: str, head_dims: tuple) -> tuple:
    """(B, H, N, D) of q, k, v, which a CUDA C kernel takes as contiguous CuPy float16 arrays of a head dim it is
    built for; a clear error otherwise."""
    cp = runtime.cupy()
    B, H, N, D = check_qkv(q, k, v, what)
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not isinstance(a, cp.ndarray) or a.dtype != cp.float16 or not a.flags.c_contiguous:
            raise runtime.CourseInputError(f"{what}: {name} must be a contiguous CuPy float16 array")
    if D not in head_dims:
        raise runtime.CourseInputError(f"{what}: head dim {D} is not one the kernel is built for "
                                       f"({', '.join(map(str, head_dims))})")
    return B, H, N, D


def flash_wmma(q, k, v, *, causal: bool = False, scale=None, edits: dict | None = None) -> tuple:
    """FlashAttention forward on the tensor cores (WMMA, sm_80+) for CuPy float16 arrays of shape (batch, heads, N, d)
    (or (heads, N, d), (N, d)), d 64 or 128, any N (the last tiles are masked): (o, lse) with lse float32."""
    cp = runtime.cupy()
    from gpucourse import gpus

    gpus.step("10.wmma")
    B, H, N, D = _fp16_inputs(q, k, v, "flash_wmma", WMMA_HEAD_DIMS)
    why = wmma_missing(D)
    if why:
        raise runtime.CourseError(why + (": run it at head dim 64" if D > 64 and not wmma_missing(64) else ""))
    o = cp.empty_like(q)
    lse = cp.empty(q.shape[:-1], dtype=cp.float32)
    fn = cuda_c.function(SOURCE, f"flash_wmma_d{D}" + ("_causal" if causal else ""), edits)
    smem = wmma_smem_bytes(D)
    fn.max_dynamic_shared_size_bytes = smem
    fn((math.ceil(N / (16 * WMMA_WARPS)), B * H), (32 * WMMA_WARPS,),
       (q, k, v, o, lse, np.int32(N), np.float32(_scale(D, scale) * LOG2E)), shared_mem=smem)
    return o, lse


MMA_SOURCE, MMA_HEAD_DIMS = "attention_mma", (64, 128)
_MMA_SHAPE = re.compile(r"^#define FLASH_MMA_(\w+) (\d+), (\d+), (\d+), (\d+), (true|false), (\d+)\b", re.M)
_MMA_KERNEL = re.compile(r"^FLASH_MMA_(VARIANT|DEFAULT)\((\d+), (\w+)\)", re.M)


class MmaShape(NamedTuple):
    """One variant of the mma.sync kernel (a ``#define FLASH_MMA_<variant>`` line of attention_mma.cu)."""
    warps: int  # warps a block
    slices: int  # 16-row slices of Q a warp owns
    block_n: int  # keys a tile of K and V
    stages: int  # tiles of K and V in shared memory (in flight)
    q_in_regs: bool  # Q's fragments kept in registers (else re-read from shared memory every tile)
    min_blocks: int  # blocks an SM that __launch_bounds__ asks the registers to allow

    @property
    def block_m(self) -> int:
        return 16 * self.slices * self.warps


@functools.cache
def mma_variants() -> tuple:
    """({head dim: {variant: MmaShape}}, {head dim: default variant}) as kernels/cuda/attention_mma.cu declares
    them: its FLASH_MMA_VARIANT lines build flash_mma_d<D>_<variant> (and _causal) in the shape of that variant's
    ``#define FLASH_MMA_<variant>`` line, and its FLASH_MMA_DEFAULT line builds the variant the launcher runs
    unasked as flash_mma_d<D>. The source is the one table: choosing the default is one line there."""
    text = cuda_c.source(MMA_SOURCE)
    shapes = {m[0]: MmaShape(int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5] == "true", int(m[6]))
              for m in _MMA_SHAPE.findall(text)}
    variants, default = {d: {} for d in MMA_HEAD_DIMS}, {}
    for kind, d, name in _MMA_KERNEL.findall(text):
        if name not in shapes or int(d) not in variants:
            raise runtime.CourseError(f"{MMA_SOURCE}.cu builds {name} for head dim {d}, which it does not define")
        if kind == "DEFAULT":
            default[int(d)] = name
        else:
            variants[int(d)][name] = shapes[name]
    if set(default) != set(MMA_HEAD_DIMS) or any(default[d] not in variants[d] for d in default):
        raise runtime.CourseError(f"{MMA_SOURCE}.cu must name a default (FLASH_MMA_DEFAULT) for each head dim "
                                  f"{MMA_HEAD_DIMS}, among that head dim's variants (FLASH_MMA_VARIANT)")
    return variants, default


def mma_variant(d: int, cc=None) -> str:
    """The variant flash_mma runs unasked at head dim ``d``: the source's default (FLASH_MMA_DEFAULT), or, on a GPU
    whose blocks cannot hold its shared memory (an RTX 30xx/40xx, A10 or L4 gives 99 KiB), the variant with the most
    shared memory that fits (its tiles the largest). A CourseError where none fits."""
    from gpucourse import gpus

    variants, default = mma_variants()
    have = gpus.shared_memory_per_block(cc)
    if mma_smem_bytes(d, variants[d][default[d]]) <= have:
        return default[d]
    fits = sorted((mma_smem_bytes(d, shape), name) for name, shape in variants[d].items()
                  if mma_smem_bytes(d, shape) <= have)
    if not fits:
        raise runtime.CourseError(gpus.shared_memory_missing(
            min(mma_smem_bytes(d, shape) for shape in variants[d].values()),
            what=f"every variant of the mma.sync FlashAttention kernel at head dim {d}", cc=cc))
    return fits[-1][1]


def mma_smem_bytes(d: int, shape: MmaShape) -> int:
    """Shared memory of one block of the mma.sync kernel: Q's tile and ``stages`` tiles each of K and V, every row
    padded from d to d + 8 halves (ldmatrix's eight rows then fall in eight different bank groups)."""
    return (shape.block_m + 2 * shape.stages * shape.block_n) * (d + 8) * 2


def flash_mma(q, k, v, *, causal: bool = False, scale=None, variant: str | None = None,
              edits: dict | None = None) -> tuple:
    """FlashAttention forward in FlashAttention-2's shape on mma.sync (sm_80+; kernels/cuda/attention_mma.cu) for
    CuPy float16 arrays of shape (batch, heads, N, d) (or (heads, N, d), (N, d)), d 64 or 128, any N (the last
    tiles are masked): (o, lse) with lse float32. ``variant``: one of mma_variants()[0][d] (default: the source's
    FLASH_MMA_DEFAULT for d, the kernel flash_mma_d<d>, where its shared memory fits the GPU: ``mma_variant``)."""
    from gpucourse import gpus

    gpus.step("10.mma")  # before anything else: a GPU without mma.sync's m16n8k16 shape gets one line saying so
    cp = runtime.cupy()
    B, H, N, D = _fp16_inputs(q, k, v, "flash_mma", MMA_HEAD_DIMS)
    variants, default = mma_variants()
    if variant is not None and variant not in variants[D]:
        raise runtime.CourseInputError(f"flash_mma: no variant {variant!r} for head dim {D}; there are "
                                       f"{', '.join(variants[D])}")
    if variant is None and (fits := mma_variant(D)) != default[D]:  # the default's tiles do not fit this GPU
        variant = fits
    shape = variants[D][variant or default[D]]  # flash_mma_d<D> is built in its default variant's shape
    name = f"flash_mma_d{D}" + (f"_{variant}" if variant is not None else "") + ("_causal" if causal else "")
    o = cp.empty_like(q)
    lse = cp.empty(q.shape[:-1], dtype=cp.float32)
    fn = cuda_c.function(MMA_SOURCE, name, edits)
    smem = mma_smem_bytes(D, shape)
    fn.max_dynamic_shared_size_bytes = smem
    fn((math.ceil(N / shape.block_m), B * H), (32 * shape.warps,),
       (q, k, v, o, lse, np.int32(N), np.float32(_scale(D, scale) * LOG2E)), shared_mem=smem)
    return o, lse


def wgmma_smem_bytes(d: int, block_n: int, stages: int) -> int:
    """Shared memory of one block of the Hopper kernel: 1 KiB to align the swizzled tiles, Q's tile, the stages of
    K and V, the mbarriers (Q full, Q empty; K full, V full and empty per stage) and the item's number."""
    return 1024 + WGMMA_BLOCK_M * d * 2 + 2 * stages * block_n * d * 2 + 8 * (2 + 3 * stages) + 8


def wgmma_section(n: int, heads: int, sms: int) -> int:
    """How many heads the Hopper kernel's causal runs take together, longest items first (the kernel's item_of).
    A section of s heads holds s (N/128)(N/128 + 1) / 2 tiles of work; spread over the SMs, that must last at least
    as long as its longest item (N / 128 tiles), or the SMs that run the last section's longest items finish alone:
    s (N/128 + 1) >= 2 SMs. The smallest such s that divides the heads (so that the last section is whole), or all
    of them: the fewer heads in flight, the more of their K and V the L2 keeps. Measured on an H100 (132 SMs,
    causal, 16 heads of 128): 32, 8 and 4 heads at N = 1k, 4k and 16k, each as fast as any other section size and
    up to 3% faster than one head; sections that leave a part-filled last one lose up to 3%, and 64 heads at
    N = 1k (32 MiB of K and V) 8%."""
    return _section(n // WGMMA_BLOCK_M, heads, sms * 2)


def _section(blocks_m: int, heads: int, enough: int) -> int:
    """The fewest heads s that divide ``heads`` with s (blocks_m + 1) >= ``enough`` (all of them where none does):
    wgmma_section's and fp8_section's rule, with their blocks a head and their multiple of the SMs."""
    return next((s for s in range(1, heads + 1) if heads % s == 0 and s * (blocks_m + 1) >= enough), heads)


def fp8_section(n: int, heads: int, sms: int) -> int:
    """wgmma_section's rule for the FP8 kernel, whose items are FP8_BLOCK_M = 192 rows: s (ceil(N / 192) + 1) >= 3 SMs.
    Measured on an H200 (causal, 16 heads of 128, 32k tokens, every section from 2 to all heads): the best sections
    were 32, 32 and 8 heads at N = 1k, 4k and 16k; this rule gives 64, 32 and 8 (1k: 1.3% under the best), where
    wgmma_section's gave 32, 8 and 4 (3% and 1.7% under it at 4k and 16k). K and V in FP8 are half FP16's bytes, so
    more heads in flight cost the L2 less."""
    return _section(-(-n // FP8_BLOCK_M), heads, sms * 3)


def flash_wgmma(q, k, v, *, causal: bool = False, scale=None, variant: str | None = None, edits: dict | None = None,
                probe: str | None = None) -> tuple:
    """FlashAttention forward on Hopper (compute capability 9.0): wgmma fed by the TMA, one producer warpgroup and
    two consumer warpgroups of 64 query rows each, for CuPy float16 arrays of shape (batch, heads, N, d) (or
    (heads, N, d), (N, d)), d 64 or 128, N a multiple of 128: (o, lse) with lse float32. ``variant``: one of
    WGMMA_VARIANTS[d] (default WGMMA_DEFAULT[d]). ``probe`` ("scores" or "pv", d = 128, for the tests of the
    parts): o is S = Q K^T of the first 128 keys, or (Q K^T) V without the softmax."""
    import ctypes

    cp = runtime.cupy()
    from gpucourse import gpus
    from kernels.tensor_cores import hopper_kernel, launch_hopper, tensor_map

    B, H, N, D = _fp16_inputs(q, k, v, "flash_wgmma", WGMMA_HEAD_DIMS)
    if N % WGMMA_BLOCK_M:
        raise runtime.CourseInputError(f"flash_wgmma: N = {N} is not a multiple of the kernel's {WGMMA_BLOCK_M}-row "
                                       f"tiles; pad the sequence (and mask the padding) or use flash_wmma")
    variant = variant or WGMMA_DEFAULT[D]
    if variant not in WGMMA_VARIANTS[D]:
        raise runtime.CourseInputError(f"flash_wgmma: no variant {variant!r} for head dim {D}; there are "
                                       f"{', '.join(WGMMA_VARIANTS[D])}")
    block_n, stages = WGMMA_TILES[D]
    if probe is not None:
        if probe not in ("scores", "pv") or D != 128 or causal:
            raise runtime.CourseInputError("flash_wgmma: probe is 'scores' or 'pv', for d = 128, not causal")
        name, block_n, stages = f"flash_wgmma_d128_probe_{probe}", 128, 2
    else:
        name = f"flash_wgmma_d{D}_{variant}" + ("_causal" if causal else "")
    gpus.step("10.wgmma")
    smem = wgmma_smem_bytes(D, block_n, stages)
    fn = hopper_kernel(WGMMA_SOURCE, name, smem, edits)
    o = cp.empty_like(q)
    lse = cp.empty(q.shape[:-1], dtype=cp.float32)
    rows = B * H * N
    maps = [tensor_map(x.reshape(rows, D), (box, 64)) for x, box in ((q, WGMMA_BLOCK_M), (k, block_n), (v, block_n))]
    next_item = cp.zeros(1, dtype=cp.int32)  # the items the blocks have claimed beyond their first
    sms = runtime.get().device["sms"]
    args = [*maps, ctypes.c_uint64(o.data.ptr), ctypes.c_uint64(lse.data.ptr), ctypes.c_uint64(next_item.data.ptr),
            ctypes.c_int32(N), ctypes.c_int32(B * H), ctypes.c_int32(wgmma_section(N, B * H, sms)),
            ctypes.c_float(_scale(D, scale) * LOG2E)]
    items = N // WGMMA_BLOCK_M * B * H  # persistent: a block per SM takes item after item (128 rows of a head)
    launch_hopper(fn, (min(items, sms), 1), 384, smem, args, name)
    return o, lse



# ============================================================ FP8 on Hopper (flash_fp8_wgmma of attention_wgmma.cu)

FP8_HEAD_DIM, FP8_BLOCK, FP8_STAGES = 128, 128, 5  # d, the rows a scale covers (a tile of Q, K or V), K/V stages
FP8_CONSUMERS = 3  # consumer warpgroups of 64 query rows: a block computes 192 rows of O (flash_fp8_wgmma)
FP8_BLOCK_M = 64 * FP8_CONSUMERS  # a block's query rows; the last block of a head may reach past N


def _fp8_key_order() -> np.ndarray:
    """Where each of 32 keys sits in V transposed, for the FP8 kernel's P V. The S accumulator gives thread q (lane %
    4) keys 2q, 2q + 1, 2q + 8, 2q + 9 of each 16 in its registers; the 8-bit A operand of wgmma reads a thread's
    register as codes 4q .. 4q + 3 (and the next register as 16 + 4q ..). The kernel packs its four keys as they come
    (to_fp8_operand), so slot 4q + i of each 16 holds key [2q, 2q + 1, 2q + 8, 2q + 9][i]: V's keys are stored in
    that order (ORDER[slot] = key), and every p meets its v."""
    order = []
    for slot in range(32):
        half, q, i = slot // 16, (slot % 16) // 4, slot % 4
        order.append(16 * half + (2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9)[i])
    return np.array(order)


FP8_KEY_ORDER = _fp8_key_order()


def fp8_v_transposed(v_codes):
    """V's codes (BH, N, d) as the FP8 kernel reads them: transposed to (BH, d, N), each 32 keys in FP8_KEY_ORDER
    (NumPy or CuPy, as given; N a multiple of 32)."""
    bh, n, d = v_codes.shape
    if n % 32:
        raise runtime.CourseInputError(f"fp8_v_transposed: N = {n} is not a multiple of 32")
    xp = runtime.cupy() if not isinstance(v_codes, np.ndarray) else np
    order = xp.asarray(FP8_KEY_ORDER)
    return xp.ascontiguousarray(v_codes.reshape(bh, n // 32, 32, d)[:, :, order, :].transpose(0, 3, 1, 2)
                                ).reshape(bh, d, n)


def fp8_smem_bytes(stages: int = FP8_STAGES) -> int:
    """Shared memory of one block of the FP8 kernel: alignment, Q's tile (64 rows a consumer), the stages of K and V
    transposed (a byte a code), each consumer's P, the tile of ones for the row sums (8 rows), the mbarriers and the
    item's number (as wgmma_smem_bytes)."""
    return (1024 + FP8_BLOCK_M * FP8_HEAD_DIM + 2 * stages * FP8_BLOCK * FP8_HEAD_DIM + FP8_BLOCK_M * FP8_BLOCK
            + 8 * FP8_BLOCK + 8 * (2 + 3 * stages) + 8)


PREPASS_SOURCE, PREPASS_THREADS = "attention_fp8_prepass", 512  # the fused pre-pass: a block of 512 threads a tile
_PREPASS_TYPES = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}


def fp8_operands(q, k, v, *, hadamard=None) -> dict:
    """Q, K and V (CuPy float16 or float32, (batch, heads, N, 128), N a multiple of 128) as the FP8 kernel takes them,
    quantised on the GPU with a scale per tile of 128 rows of a head: {"q", "k": codes (BH x N, 128); "vt": V's codes
    transposed (BH x 128, N) in FP8_KEY_ORDER; "sq", "sk", "sv": scales (BH, N / 128); "shape": (B, H, N, d)}.
    ``hadamard``: None, or the seed of fp8.random_hadamard, whose rotation H is applied to Q and K first (in FP32, by
    cuBLAS): (Q H)(K H)^T = Q K^T, and an outlier channel is spread over all 128 before e4m3 rounds it
    (FlashAttention-3's incoherent processing).

    One launch of kernels/cuda/attention_fp8_prepass.cu does it all, reading each value once: code for code and scale
    for scale what lesson 4's quantize_fp8_gpu (a scale per 128 x 128 block) and fp8_v_transposed give, which the
    tests compare it with. It is SIMT code and runs on any GPU; the FP8 kernel that reads its output needs Hopper."""
    cp = runtime.cupy()
    B, H, N, D = check_qkv(q, k, v, "flash_fp8")
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not isinstance(a, cp.ndarray) or a.dtype not in (cp.float16, cp.float32) or not a.flags.c_contiguous:
            raise runtime.CourseInputError(f"flash_fp8: {name} must be a contiguous CuPy float16 or float32 array")
        if a.data.ptr % 16:
            raise runtime.CourseInputError(f"flash_fp8: {name} must start on a 16-byte boundary (the pre-pass reads "
                                           "16 bytes at a time); a copy ({name}.copy()) does")
    if D != FP8_HEAD_DIM:
        raise runtime.CourseInputError(f"flash_fp8: head dim {D}; the FP8 kernel is built for {FP8_HEAD_DIM} (a row "
                                       "of 128 codes is one 128-byte row of the swizzle)")
    if N % FP8_BLOCK:
        raise runtime.CourseInputError(f"flash_fp8: N = {N} is not a multiple of the kernel's {FP8_BLOCK}-row tiles")
    bh = B * H
    if hadamard is not None:
        from .fp8 import random_hadamard

        rot = cp.asarray(random_hadamard(D, hadamard), dtype=cp.float32)
        q, k = ((x.reshape(-1, D).astype(cp.float32) @ rot).reshape(x.shape) for x in (q, k))
    if q.dtype != k.dtype:  # the kernel takes Q and K of one type; float16 to float32 is exact
        q, k = q.astype(cp.float32), k.astype(cp.float32)
    tiles = bh * (N // FP8_BLOCK)
    out = {"shape": (B, H, N, D), "q": cp.empty((bh * N, D), cp.uint8), "k": cp.empty((bh * N, D), cp.uint8),
           "vt": cp.empty((bh * D, N), cp.uint8)}
    scales = cp.empty((3, bh, N // FP8_BLOCK), cp.float32)
    name = f"fp8_prepass_{_PREPASS_TYPES[np.dtype(q.dtype)]}_{_PREPASS_TYPES[np.dtype(v.dtype)]}"
    fn = cuda_c.function(PREPASS_SOURCE, name)
    fn((tiles, 3), (PREPASS_THREADS,), (q, k, v, out["q"], out["k"], out["vt"], scales, np.int32(N)))
    out["sq"], out["sk"], out["sv"] = scales[0], scales[1], scales[2]
    return out


def flash_fp8(q=None, k=None, v=None, *, causal: bool = False, scale=None, operands: dict | None = None) -> tuple:
    """FlashAttention forward in FP8 on Hopper (compute capability 9.0; d = 128): Q, K, V quantised to e4m3 with a
    scale per 128 rows (``fp8_operands``; or pass ``operands`` it made, and no q, k, v), P rounded to e4m3 times 256,
    FP32 softmax, the row sums of the rounded P, FP16 output. Returns (o float16 of q's shape (B, H, N, 128), lse
    float32). The numerics are kernels/attention/fp8.py's fp8_attention(..., block_m=128, block_n=128)."""
    import ctypes

    runtime.require_gpu("the FP8 attention kernel")
    cp = runtime.cupy()
    from gpucourse import gpus
    from kernels.tensor_cores import hopper_kernel, launch_hopper, tensor_map

    gpus.step("10.wgmma_fp8")
    if operands is None:
        if q is None or k is None or v is None:
            raise runtime.CourseInputError("flash_fp8: pass q, k and v, or the operands fp8_operands made")
        operands = fp8_operands(q, k, v)
    elif q is not None or k is not None or v is not None:
        raise runtime.CourseInputError("flash_fp8: pass q, k and v, or operands, not both")
    B, H, N, D = operands["shape"]
    bh = B * H
    name = "flash_fp8_d128" + ("_causal" if causal else "")
    smem = fp8_smem_bytes()
    fn = hopper_kernel(WGMMA_SOURCE, name, smem)
    o = cp.empty((B, H, N, D), cp.float16)
    lse = cp.empty((B, H, N), cp.float32)
    maps = [tensor_map(operands["q"], (FP8_BLOCK_M, D)), tensor_map(operands["k"], (FP8_BLOCK, D)),
            tensor_map(operands["vt"], (D, FP8_BLOCK))]
    next_item = cp.zeros(1, dtype=cp.int32)
    sms = runtime.get().device["sms"]
    args = [*maps, *(ctypes.c_uint64(operands[s].data.ptr) for s in ("sq", "sk", "sv")), ctypes.c_uint64(o.data.ptr),
            ctypes.c_uint64(lse.data.ptr), ctypes.c_uint64(next_item.data.ptr), ctypes.c_int32(N),
            ctypes.c_int32(bh), ctypes.c_int32(fp8_section(N, bh, sms)), ctypes.c_float(_scale(D, scale) * LOG2E)]
    items = -(-N // FP8_BLOCK_M) * bh
    launch_hopper(fn, (min(items, sms), 1), 128 * (FP8_CONSUMERS + 1), smem, args, name)
    return o, lse

"""Lesson 4, an FP8 GEMM's numerics in NumPy: the reference a Hopper FP8 GEMM (and cuBLAS's, ``torch._scaled_mm``)
is checked against, and its error beside FP16's.

* ``quantize_fp8``: one float32 scale per tensor, scale = amax / 448 by default (the largest magnitude mapped to
  e4m3's largest value), codes = e4m3(x / scale), so that x ~ from_e4m3(codes) * scale. This is what
  ``torch._scaled_mm`` is given: the codes and these scales (the inverse of the factor the tensor was multiplied by).
* ``gemm_fp8_spec``: C = (A_fp8 * scale_a) (B_fp8 * scale_b)^T, rounded once to the output type (FP16, BF16 or
  FP32). B is taken N x K, each row one output column's K values: FP8 ``wgmma`` reads both operands K-major, so
  the GPU kernel stores B transposed (as ``torch._scaled_mm`` wants its second operand column-major). The transpose
  moves bytes, not values.
* ``round_bf16``: float values rounded to bfloat16 as the GPU converts a float32 (to nearest, ties to even, on the
  top 16 bits), returned as float32, since NumPy has no bfloat16.
* ``fp8_gemm_error`` and ``format_fp8_gemm_error``: the error against float64 of FP16 operands, FP8 operands with
  one scale per tensor, and FP8 results stored as FP16 or BF16, on Gaussian inputs and inputs with outlier rows
  (the table of docs/engineering/04_tensor_cores.md).

e4m3's rounding and scales live in kernels/inference_engine/precision.py (``to_e4m3``, ``from_e4m3``,
``e4m3_scale``); this module uses them.
"""
from __future__ import annotations

import math

import numpy as np

from gpucourse import gpus, runtime
from kernels.inference_engine.precision import e4m3_scale, from_e4m3, to_e4m3

from .tensor_cores import WGMMA_STORE_PIECE, gemm_emulated, gemm_spec, rel_error

OUTPUTS = ("float16", "bfloat16", "float32", "float64")  # float64: the exact product, no output rounding
WGMMA_FP8_K = 32  # FP8 wgmma's K per instruction: the FP32 accumulator is rounded every 32 products
U_E4M3 = 2.0**-4  # half an ulp of e4m3 relative to a normal value: 3 stored mantissa bits
E4M3_SUBNORMAL_STEP = 2.0**-9  # the spacing of e4m3's subnormals (below 2^-6)
DISTS = ("gaussian", "outliers")
OUTLIERS = (2.0**12, 2.0**15)  # how much larger the outlier rows and columns are in the table: e4m3's normals span
# 2^-6 to 448, a factor 2^14.8; FP16 holds N(0, 1) times 2^12 (below 65504), not times 2^15


def quantize_fp8(x, *, scale=None) -> tuple:
    """(codes uint8 of x's shape, scale float32) with x ~ from_e4m3(codes) * scale: one scale for the whole tensor,
    amax / E4M3_MAX unless given (1 for a tensor of zeros). Values beyond 448 * scale saturate to +-448."""
    x = np.asarray(x, np.float32)
    scale = e4m3_scale(np.abs(x).max() if x.size else 0)[()] if scale is None else np.float32(scale)
    if not (np.isfinite(scale) and scale > 0):
        raise runtime.CourseInputError(f"scale must be a positive finite number, got {scale!r}")
    return to_e4m3(x / scale), scale


def round_bf16(x) -> np.ndarray:
    """x rounded to bfloat16, as float32 values: x is first a float32 (as an FP32 accumulator holds it), then its
    low 16 bits are rounded away to nearest, ties to the even result; beyond bfloat16's largest value, inf; NaN
    stays NaN."""
    f = np.ascontiguousarray(np.asarray(x, np.float32))
    u = f.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    out = r.view(np.float32).reshape(f.shape)
    return np.where(np.isnan(f), np.float32(np.nan), out)


def _round_to(c64, out: str) -> np.ndarray:
    if out == "float64":
        return c64
    if out == "bfloat16":
        return round_bf16(c64)
    with np.errstate(over="ignore"):
        return c64.astype(out)


def gemm_fp8_spec(a_codes, b_codes, scale_a, scale_b, *, out: str = "float16") -> np.ndarray:
    """C = (from_e4m3(A) scale_a) (from_e4m3(B) scale_b)^T for A's codes M x K and B's codes N x K (K-major, as FP8
    ``wgmma`` reads it), rounded once to ``out``: "float16", "float32", "bfloat16" (float32 values) or "float64"
    (no rounding).

    The products are summed in float64, where the sum is exact: an e4m3 value has 4 significant bits and lies
    between 2^-9 and 448, so each product of two is a multiple of 2^-18 below 2^18 with 8 significant bits, and a
    sum of K of them needs at most 36 + log2(K) bits, within float64's 53 for any K below 2^17. The spec is
    therefore the exact product of the quantised operands; the GPU kernel, which accumulates in FP32, differs from it
    only by the rounding of its partial sums (at most K 2^-24 of the sum of |products|, ``tolerance``'s
    "fp16_inputs_fp32_acc"), then by the output's rounding."""
    if out not in OUTPUTS:
        raise runtime.CourseInputError(f"out must be one of {OUTPUTS}, not {out!r}")
    a, b = np.asarray(a_codes), np.asarray(b_codes)
    if a.dtype != np.uint8 or b.dtype != np.uint8:
        raise runtime.CourseInputError(f"the operands must be e4m3 codes (uint8), got {a.dtype} and {b.dtype}")
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise runtime.CourseInputError(f"A is {a.shape} and B is {b.shape}: need M x K and N x K (B K-major)")
    if a.shape[1] >= 2**17:
        raise runtime.CourseInputError(f"K = {a.shape[1]}: the float64 sum is exact only for K below 2^17")
    c = gemm_spec(from_e4m3(a), from_e4m3(b).T) * (float(np.float32(scale_a)) * float(np.float32(scale_b)))
    return _round_to(c, out)


def gemm_fp8_fp32_acc(a_codes, b_codes, scale_a, scale_b, *, k_step: int = WGMMA_FP8_K) -> np.ndarray:
    """The same product with an FP32 accumulator rounded every ``k_step`` products along K (FP8 ``wgmma``: 32),
    then scaled in float32: what a kernel that keeps its sums in FP32 registers computes, before the output is
    rounded. Every e4m3 value is exactly an FP16 value (4 significant bits, 2^-9 to 448), so lesson 4's model of an
    FP16 tensor core, ``gemm_emulated``, computes it. (Hopper's FP8 ``wgmma`` itself keeps fewer than FP32's bits
    in its sums; a kernel that adds its partial sums into FP32 registers every few instructions gets this.)"""
    a, b = from_e4m3(a_codes), from_e4m3(b_codes)
    c = gemm_emulated(a, b.T, acc="float32", k_step=k_step)
    return c * np.float32(scale_a) * np.float32(scale_b)


def _rms_rel(c, ref) -> float:
    c, ref = np.asarray(c, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(c).all():
        return math.inf
    return float(np.sqrt(np.mean((c - ref) ** 2) / max(np.mean(ref**2), np.finfo(np.float64).tiny)))


def fp8_inputs(m: int, n: int, k: int, *, seed: int = 0, dist: str = "gaussian", outlier: float = 2.0**12) -> tuple:
    """(A M x K, B K x N, the output rows and columns the errors are taken over), float64. "gaussian": N(0, 1)
    entries, every output counted. "outliers": the same with 2 rows of A and 2 columns of B ``outlier`` times
    larger (the massive activations some tokens and channels of a language model carry); the errors are taken over
    the other outputs, where the outliers' only effect is the larger per-tensor scale they force."""
    if dist not in DISTS:
        raise runtime.CourseInputError(f"dist must be one of {DISTS}, not {dist!r}")
    for name, v in (("m", m), ("n", n), ("k", k)):
        if isinstance(v, bool) or int(v) != v or v < 1 or (dist != "gaussian" and name != "k" and v < 4):
            raise runtime.CourseInputError(f"{name} must be a whole number >= 1 (>= 4 with outliers), got {v!r}")
    rng = np.random.default_rng(seed)
    A, B = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    rows, cols = np.ones(m, bool), np.ones(n, bool)
    if dist == "outliers":
        r, c = rng.choice(m, 2, replace=False), rng.choice(n, 2, replace=False)
        A[r] *= outlier
        B[:, c] *= outlier
        rows[r], cols[c] = False, False
    return A, B, np.ix_(rows, cols)


def fp8_gemm_error(m: int, n: int, k: int, *, seed: int = 0, dist: str = "gaussian", outlier: float = 2.0**12) -> dict:
    """Errors of C = A B (A M x K, B K x N from ``fp8_inputs``) against float64, each as (max |C - ref| / max |ref|,
    rms(C - ref) / rms(ref)):

    * "fp16": FP16 operands, FP32 accumulation (``gemm_emulated``, 16 products a step), FP32 result;
    * "fp8": e4m3 operands with one scale per tensor (``quantize_fp8``), FP32 accumulation every 32 products,
      FP32 result (``gemm_fp8_fp32_acc``);
    * "fp8 -> fp16", "fp8 -> bf16": that result stored as FP16, as BF16.

    With outliers beyond FP16's range its operands there are inf; the other outputs, over which the errors are taken,
    do not use them."""
    A, B, keep = fp8_inputs(m, n, k, seed=seed, dist=dist, outlier=outlier)
    ref = gemm_spec(A, B)[keep]
    (ca, sa), (cb, sb) = quantize_fp8(A), quantize_fp8(B.T)
    c8 = gemm_fp8_fp32_acc(ca, cb, sa, sb)
    with np.errstate(over="ignore", invalid="ignore"):
        c16 = gemm_emulated(A, B, acc="float32")
    results = {"fp16": c16, "fp8": c8, "fp8 -> fp16": _round_to(c8, "float16"),
               "fp8 -> bf16": round_bf16(c8)}
    return {name: (rel_error(c[keep], ref), _rms_rel(c[keep], ref)) for name, c in results.items()}


def fp8_gemm_error_figures(ks=(256, 1024, 4096), *, m: int = 64, n: int = 64, seed: int = 0) -> dict:
    """{(inputs, k): ``fp8_gemm_error``} for each K on Gaussian inputs and with outliers of each size in OUTLIERS
    (inputs "outliers x 2^12", ...)."""
    cases = [("gaussian", "gaussian", 1.0)] + [(f"outliers x 2^{round(math.log2(o))}", "outliers", o) for o in OUTLIERS]
    return {(name, k): fp8_gemm_error(m, n, k, seed=seed, dist=dist, outlier=o) for name, dist, o in cases for k in ks}


def format_fp8_gemm_error(figs: dict) -> str:
    """The figures of ``fp8_gemm_error_figures`` as a Markdown table: max / rms relative error, 2 significant
    digits."""
    cols = list(next(iter(figs.values())))
    lines = ["| inputs | K | " + " | ".join(cols) + " |", "| --- | ---: |" + " --- |" * len(cols)]
    for (dist, k), row in figs.items():
        lines.append(f"| {dist} | {k} | " + " | ".join(f"{row[c][0]:.2g} / {row[c][1]:.2g}" for c in cols) + " |")
    return "\n".join(lines)


# ============================================================ on Hopper: kernels/cuda/tensor_cores_fp8.cu (sm_90a)

FP8_SOURCE = "tensor_cores_fp8"
# Block tile BM x BN x 128 codes, shared-memory stages, and how the FP32 sums are kept: "fast", every wgmma adding
# into the same registers (Hopper's FP8 wgmma keeps fewer bits than FP32 there), or "promoted", each stage's K = 128
# summed from zero and then added in ordinary FP32 (two sets of accumulators: 128 columns at most).
FP8_CONFIGS = (
    "fp8_gemm_128x256x128_s4_fast",
    "fp8_gemm_128x128x128_s6_promoted",
    "fp8_gemm_128x128x128_s6_fast",
    # persistent, as the FP16 GEMM's: a block per SM walks the tiles, loading the next tile while it stores this one,
    # and C leaves through shared memory and a TMA store, 64 x 64 at a time (two pieces a consumer warpgroup)
    "fp8_gemm_128x256x128_s4_fast_persistent_tmastore",
    "fp8_gemm_128x128x128_s6_promoted_persistent_tmastore",
    # ... and the 128 x 256 one in thread-block clusters of two blocks ("_c2"), which take two tiles of one column of C
    # on adjacent rows and share B's slices, each block loading half and the TMA multicasting it into both
    "fp8_gemm_128x256x128_s4_fast_persistent_tmastore_c2",
    # ... and the 128 x 256 one with a stream-K tail ("_sk"): the tiles of the last, partial wave shared out among all
    # the blocks by slices of K, each tile's pieces summed by the block that holds its first (stream_k_tiles)
    "fp8_gemm_128x256x128_s4_fast_persistent_tmastore_sk",
)
DEFAULT_FP8 = "fp8_gemm_128x256x128_s4_fast"
FP8_OUTPUTS = {"float16": "f16", "bfloat16": "bf16"}  # C's type -> the kernel's suffix (bf16: BF16 bits in uint16)


def fp8_config(name: str) -> dict:
    """Tile, stages, accumulation, threads, shared memory, persistence, epilogue and the blocks of a thread-block
    cluster (``cluster``: 2 for "_c2", else 1) of an FP8 GEMM configuration, from its name:
    fp8_gemm_<BM>x<BN>x<BK>_s<stages>_<fast|promoted>[_persistent_tmastore[_c2|_sk]]; ``stream_k``: True for
    "_sk"."""
    import re

    m = re.fullmatch(r"fp8_gemm_(\d+)x(\d+)x(\d+)_s(\d+)_(fast|promoted)(_persistent_tmastore(_c2|_sk)?)?", name)
    if not m or name not in FP8_CONFIGS:
        raise runtime.CourseInputError(f"no FP8 GEMM kernel {name!r}; known: {', '.join(FP8_CONFIGS)}")
    bm, bn, bk, stages = map(int, m.groups()[:4])
    consumers = bm // 64
    tma_store = m.group(6) is not None
    staging = consumers * 2 * WGMMA_STORE_PIECE * WGMMA_STORE_PIECE * 2 if tma_store else 0  # 2-byte C, 2 a consumer
    smem = 1024 + stages * (bm + bn) * bk + staging + 2 * stages * 8  # alignment, tiles (a byte a code), C, mbarriers
    return {"name": name, "bm": bm, "bn": bn, "bk": bk, "stages": stages, "accumulate": m.group(5),
            "consumers": consumers, "threads": 128 * (consumers + 1), "smem_bytes": smem, "persistent": tma_store,
            "epilogue": "tma" if tma_store else "registers", "cluster": 2 if m.group(7) == "_c2" else 1,
            "stream_k": m.group(7) == "_sk"}


# The stream-K tail ("_sk", hopper_gemm.cuh's StreamK). When it pays: its fix-up moves every block's piece (BM x BN
# FP32, 128 KiB for 128 x 256) out to L2 and back, about 17 MB on 132 SMs, which cost about 9 µs on an H200 whatever
# the GEMM; it saves the time the last wave's idle SMs would wait, a share (blocks - tail) / blocks of a tile of kblocks
# slices. Measured on an H200 (in turns): at 8192^3 (tail 68 of 132, 64 slices a tile: 31 idle slices) 1% faster with
# the tail; at 4096^3 (116 of 132, 32 slices: 4), 6144^3 (96, 48: 13) and 8192 x 3072 x 8192 (108, 64: 12), 1-7%
# slower. The tail is taken where the idle share of the last wave times the slices a tile is at least this many.
# (The FP16 kernel with the same tail was 1.4% slower at 8192^3 on an H100, where this one was 0.9% faster: not kept.)
STREAM_K_MIN_IDLE_SLICES = 24


def stream_k_tiles(tiles: int, blocks: int, kblocks: int, *, force: bool = False) -> int:
    """How many of a persistent GEMM's ``tiles`` (the last ones, in the block order) a stream-K launch of ``blocks``
    blocks, with ``kblocks`` slices of K a tile, shares out by slices: the last wave's tiles, tiles % blocks (all of
    them when there are fewer tiles than blocks), where the SMs that wave leaves idle would wait at least
    STREAM_K_MIN_IDLE_SLICES slices' time (``force``: whatever they would wait); otherwise 0, every tile whole."""
    for name, v, least in (("tiles", tiles, 0), ("blocks", blocks, 1), ("kblocks", kblocks, 1)):
        if isinstance(v, bool) or int(v) != v or v < least:
            raise runtime.CourseInputError(f"{name} must be a whole number >= {least}, got {v!r}")
    tail = int(tiles) % int(blocks)
    idle = (blocks - tail) / blocks * kblocks
    return tail if force or idle >= STREAM_K_MIN_IDLE_SLICES else 0


_STREAM_K: dict = {}  # device id -> {"partials", "flags", "epoch"}: one workspace, grown as needed


def _stream_k_workspace(blocks: int, consumers: int, bm: int, bn: int) -> tuple:
    """(partials, flags, epoch) for a stream-K launch: FP32 room for every block's piece (blocks x BM x BN), a flag
    per block and consumer, and a new epoch, the value this launch's flags are set to (so they need no clearing).
    Launches on one stream run one after the other; two launched at once on different streams would share them."""
    cp = runtime.cupy()
    dev = cp.cuda.Device().id
    ws = _STREAM_K.get(dev)
    if ws is None or ws["partials"].size < blocks * bm * bn or ws["flags"].size < blocks * consumers:
        size, flags = max(blocks * bm * bn, ws["partials"].size if ws else 0), blocks * consumers
        ws = _STREAM_K[dev] = {"partials": cp.empty(size, cp.float32),
                               "flags": cp.zeros(max(flags, ws["flags"].size if ws else 0), cp.int32), "epoch": 0}
    ws["epoch"] = ws["epoch"] % (2**31 - 2) + 1
    return ws["partials"], ws["flags"], ws["epoch"]


def bf16_bits_to_float(bits) -> np.ndarray:
    """BF16 values held as their 16 bits (uint16, as the GPU kernel writes them: NumPy and CuPy have no bfloat16)
    as float32."""
    b = np.ascontiguousarray(np.asarray(bits, np.uint16))
    return (b.astype(np.uint32) << 16).view(np.float32)


def gemm_fp8(A, B, scale_a, scale_b, C, *, config: str | None = None, group_m: int = 8, blocks: int | None = None,
             stream_k: bool | None = None):
    """C = (from_e4m3(A) scale_a) (from_e4m3(B) scale_b)^T on Hopper's FP8 wgmma fed by the TMA (GPU mode, compute
    capability 9.0; CuPy arrays). Asynchronous.

    A: M x K e4m3 codes (uint8); B: N x K e4m3 codes (B transposed: FP8 wgmma reads both operands K-major); scale_a,
    scale_b: one float32 each, on the GPU (as ``quantize_fp8`` returns them); C: M x N, float16 for FP16 output or
    uint16 for BF16 (its bits). Any M, N; K a multiple of 16 (the TMA reads rows of whole 16-byte units), and N a
    multiple of 8 for the "_tmastore" configurations (the TMA writes C's rows, whole 16-byte units too). ``config``:
    one of FP8_CONFIGS. The "_persistent" ones launch one block per SM (or one per tile, if fewer), each walking its
    tiles; ``blocks`` launches that many instead (what the tests use to walk many tiles a block). The "_c2" ones run in
    clusters of two blocks (``tensor_cores.wgmma_blocks``): ``blocks`` must then be even. The "_sk" one launches a
    block per SM (or ``blocks``) even for fewer tiles, and shares the last wave's tiles out among all of them by slices
    of K where ``stream_k_tiles`` says it pays (``stream_k=True``: wherever there is a last partial wave; False:
    nowhere, every tile whole as the kernel without the tail has them)."""
    import ctypes

    from . import tensor_cores as tc

    runtime.require_gpu("the FP8 GEMM")
    c = fp8_config(config or DEFAULT_FP8)
    for name, x in (("A", A), ("B", B), ("C", C), ("scale_a", scale_a), ("scale_b", scale_b)):
        if not tc._is_cupy(x):
            raise runtime.CourseInputError(f"the FP8 GEMM takes CuPy arrays; {name} is "
                                           f"{type(x).__name__} (cupy.asarray(...) copies it to the GPU)")
    out = {np.dtype(np.float16): "float16", np.dtype(np.uint16): "bfloat16"}.get(np.dtype(C.dtype))
    if out is None:
        raise runtime.CourseInputError(f"C must be float16 (FP16 output) or uint16 (BF16 output, its bits), not "
                                       f"{C.dtype}")
    M, N, K = tc._check_operands(A, B, C, np.uint8, C.dtype, b_transposed="the FP8 GEMM")
    for name, x in (("scale_a", scale_a), ("scale_b", scale_b)):
        runtime.check_device_array(x, name, dtype=np.float32)
        if x.size != 1:
            raise runtime.CourseInputError(f"{name} holds one scale for the whole tensor, not {x.size} values")
    if K % 16:
        raise runtime.CourseInputError(f"the TMA reads rows that are whole 16-byte units: K must be a multiple of 16 "
                                       f"(got M, N, K = {M}, {N}, {K}); pad A and B with zero codes")
    if max(M, N, K) >= 2**31 // 2:
        raise runtime.CourseInputError("dimensions must stay below 2**30")
    if c["epilogue"] == "tma" and N % 8:
        raise runtime.CourseInputError(f"{c['name']} stores C with the TMA, whose rows must be whole 16-byte units: N "
                                       f"must be a multiple of 8 (got N = {N}); pad C, or use a configuration without "
                                       "the TMA store")
    if not 1 <= group_m <= 64:
        raise runtime.CourseInputError(f"group_m must be 1..64, got {group_m}")
    if blocks is not None and (not c["persistent"] or isinstance(blocks, bool) or int(blocks) != blocks or blocks < 1):
        raise runtime.CourseInputError(f"blocks is for the persistent configurations, a whole number >= 1 (got "
                                       f"{blocks!r} for {c['name']}, which launches " +
                                       ("one block per tile)" if not c["persistent"] else "a block per SM by default)"))
    tc.check_cluster_blocks(c, blocks)
    if stream_k is not None and not c["stream_k"]:
        raise runtime.CourseInputError(f"stream_k is for the stream-K configuration (\"_sk\"), not {c['name']}")
    gpus.step("04.wgmma_fp8")  # compute capability 9.0 exactly, else one line saying so
    name = f"{c['name']}_{FP8_OUTPUTS[out]}"
    fn = tc.hopper_kernel(FP8_SOURCE, name, c["smem_bytes"])
    # B in boxes of BN rows, or in a cluster of two of BN / 2: each block loads its half of B's slice, for both
    map_a, map_b = tc.tensor_map(A, (c["bm"], c["bk"])), tc.tensor_map(B, (c["bn"] // c["cluster"], c["bk"]))
    scales_dims = [ctypes.c_uint64(scale_a.data.ptr), ctypes.c_uint64(scale_b.data.ptr), ctypes.c_int32(M),
                   ctypes.c_int32(N), ctypes.c_int32(K), ctypes.c_int32(group_m)]
    if c["stream_k"]:  # a block an SM (or ``blocks``) even with fewer tiles: the tail's slices go to all of them
        grid = blocks or runtime.get().device.get("sms")
        partials, flags, epoch = _stream_k_workspace(grid, c["consumers"], c["bm"], c["bn"])
        tiles = math.ceil(M / c["bm"]) * math.ceil(N / c["bn"])
        sk_tiles = 0 if stream_k is False else stream_k_tiles(tiles, grid, math.ceil(K / c["bk"]), force=bool(stream_k))
        scales_dims += [ctypes.c_uint64(partials.data.ptr), ctypes.c_uint64(flags.data.ptr), ctypes.c_int32(sk_tiles),
                        ctypes.c_int32(epoch)]
    else:
        grid = tc.wgmma_blocks(c, M, N, (blocks or runtime.get().device.get("sms")) if c["persistent"] else None)
    if c["epilogue"] == "tma":  # C written by the TMA in boxes of 64 x 64 (FP16 or BF16: 2 bytes an element)
        args = [map_a, map_b, tc.tensor_map(C, (tc.WGMMA_STORE_PIECE, tc.WGMMA_STORE_PIECE)), *scales_dims]
    else:
        args = [map_a, map_b, ctypes.c_uint64(C.data.ptr), *scales_dims]
    tc.launch_hopper(fn, (grid,), c["threads"], c["smem_bytes"], args, name)
    return C


def quantize_fp8_gpu(x, *, block: int | None = None) -> tuple:
    """``quantize_fp8`` on the GPU (GPU mode, compute capability 9.0: it lives beside the FP8 GEMM): (codes uint8 of
    x's shape, scales float32 on the GPU) for a C-contiguous float32 or float16 CuPy array x, code for code what
    ``quantize_fp8`` gives for the same float32 values, without a copy to the host. ``block``: one scale for each
    ``block`` consecutive elements (x.size must be a multiple); None, one for the whole tensor (scales of shape (1,))."""
    from . import tensor_cores as tc

    runtime.require_gpu("the GPU's FP8 quantiser")
    cp = runtime.cupy()
    if not tc._is_cupy(x) or np.dtype(x.dtype) not in (np.dtype(np.float32), np.dtype(np.float16)):
        raise runtime.CourseInputError(f"x must be a float32 or float16 CuPy array, got "
                                       f"{type(x).__name__} {getattr(x, 'dtype', '')}")
    if not tc._c_contiguous(x):
        raise runtime.CourseInputError("x must be C-contiguous")
    block = x.size if block is None else block
    if isinstance(block, bool) or int(block) != block or block < 1 or x.size % block:
        raise runtime.CourseInputError(f"block must divide x's {x.size} elements, got {block!r}")
    gpus.step("04.wgmma_fp8")
    x32 = x.astype(cp.float32, copy=False)
    if x.size == 0:
        return cp.empty(x.shape, cp.uint8), cp.ones(1, cp.float32)
    amax = cp.abs(x32.reshape(-1, block)).max(axis=1)
    scales = e4m3_scale(amax)
    codes = cp.empty(x.shape, cp.uint8)
    fn = tc.hopper_kernel(FP8_SOURCE, "fp8_quantize", 0)
    fn((min(65535, -(-x.size // 256)),), (256,), (x32, codes, scales, np.int64(x.size), np.int64(block)))
    return codes, scales


if __name__ == "__main__":  # python -m kernels.tensor_cores_fp8: the table of docs/engineering/04_tensor_cores.md
    print(format_fp8_gemm_error(fp8_gemm_error_figures()))

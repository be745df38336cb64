"""Lesson 4 — tensor cores: mixed precision, WMMA, and the road to cuBLAS.

Used by notebooks/04_tensor_cores.ipynb, benchmarks/tensor_cores.py and the tests:

* numba.cuda FP32 GEMMs, one output per thread: ``gemm_naive`` (every operand from global memory) and
  ``gemm_tiled`` (16 x 16 tiles through shared memory). Both run in Numba's simulator at small sizes.
* The CUDA C kernels of kernels/cuda/tensor_cores.cu, launched through CuPy: WMMA one warp per 16x16 tile,
  WMMA tiled through shared memory with several warps per block and cp.async multi-buffering, and a
  register-tiled FP32 SGEMM for the ordinary (SIMT) cores. ``gemm`` launches any of them with checks.
* NumPy: the spec (float64), an emulation of what a tensor core computes (FP16 inputs, exact products,
  FP16 or FP32 accumulation, rounded once per MMA), the rounding of FP16 and the mixed-precision tricks
  (master weights, loss scaling), and the peak-rate formula of the GV100 slide for any GPU.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from gpucourse import gpus, runtime

from gpucourse import cuda_c

cuda = runtime.cuda()

SOURCE = "tensor_cores"  # kernels/cuda/tensor_cores.cu
TILE = 16  # the numba tiled kernel: 16 x 16 threads, 16 x 16 tiles of A and B in shared memory
MMA_SHAPE = (16, 16, 16)  # WMMA's M x N x K for FP16
ACCUMULATORS = ("float32", "float16")
NAIVE_WMMA = {"float32": "wmma_naive_f32", "float16": "wmma_naive_f16"}
# The tiled WMMA configurations in tensor_cores.cu (see WMMA_TILED there).
TILED_CONFIGS = (
    "wmma_tiled_64x64x32_w32x32_s1_f32",
    "wmma_tiled_64x64x32_w32x32_s2_f32",
    "wmma_tiled_128x128x32_w64x64_s1_f32",
    "wmma_tiled_128x128x32_w64x64_s2_f32",
    "wmma_tiled_128x128x32_w64x64_s3_f32",
    "wmma_tiled_128x128x32_w64x64_s4_f32",
    "wmma_tiled_128x128x32_w64x32_s3_f32",
    "wmma_tiled_128x128x64_w64x64_s2_f32",
    "wmma_tiled_128x128x64_w64x64_s3_f32",
    "wmma_tiled_128x128x64_w64x64_s4_f32",
    "wmma_tiled_128x256x32_w64x64_s3_f32",
    "wmma_tiled_128x256x32_w64x64_s4_f32",
    "wmma_tiled_256x128x32_w64x64_s3_f32",
    "wmma_tiled_128x128x32_w64x64_s3_f16",
    "wmma_tiled_128x256x32_w64x64_s3_f16",
)
# The default tiled kernel per accumulator: the fastest on an H100/H200 in the lesson's record (see
# benchmarks/tensor_cores.py, "configs"); any name of TILED_CONFIGS can be asked for. A GPU that gives a block less
# shared memory than the default needs (a T4: 64 KiB; an RTX 30xx/40xx, A10 or L4: 99 KiB) runs the first of
# TILED_FALLBACK that fits instead (default_tiled).
DEFAULT_TILED = {"float32": "wmma_tiled_128x128x64_w64x64_s3_f32", "float16": "wmma_tiled_128x256x32_w64x64_s3_f16"}
TILED_FALLBACK = {"float32": ("wmma_tiled_128x128x64_w64x64_s2_f32", "wmma_tiled_128x128x32_w64x64_s3_f32",
                              "wmma_tiled_64x64x32_w32x32_s2_f32"),
                  "float16": ("wmma_tiled_128x128x32_w64x64_s3_f16",)}
SGEMM = {"simt_tiled16": ("sgemm_tiled16", 16, 16, 1), "simt_128x128": ("sgemm_128x128x8", 128, 128, 8)}
KINDS = ("naive", "tiled", *(f"numba_{k}" for k in ("naive", "tiled")), *SGEMM)

# ======================================================================== numba kernels (FP32, SIMT)

@cuda.jit
def gemm_naive(A, B, C):
    """C = A B, one thread per element of C: thread (x, y) reads row y of A and column x of B from global
    memory, K pairs of loads per two FLOPs. 2-D grid, x along the columns (coalesced reads of B)."""
    col, row = cuda.grid(2)
    if row < C.shape[0] and col < C.shape[1]:
        acc = np.float32(0.0)
        for k in range(A.shape[1]):
            acc += A[row, k] * B[k, col]
        C[row, col] = acc


@cuda.jit
def gemm_tiled(A, B, C):
    """C = A B through shared memory: a 16 x 16 block copies a 16 x 16 tile of A and one of B, waits,
    and every thread takes 16 multiply-adds from shared memory. Each element loaded from global memory
    serves 16 threads instead of one. Blocks of exactly TILE x TILE threads; any M, N, K."""
    sa = cuda.shared.array((TILE, TILE), np.float32)
    sb = cuda.shared.array((TILE, TILE), np.float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    row = cuda.blockIdx.y * TILE + ty
    col = cuda.blockIdx.x * TILE + tx
    M, K = A.shape
    N = B.shape[1]
    acc = np.float32(0.0)
    for k0 in range(0, K, TILE):
        sa[ty, tx] = A[row, k0 + tx] if row < M and k0 + tx < K else np.float32(0.0)
        sb[ty, tx] = B[k0 + ty, col] if k0 + ty < K and col < N else np.float32(0.0)
        cuda.syncthreads()
        for k in range(TILE):
            acc += sa[ty, k] * sb[k, tx]
        cuda.syncthreads()
    if row < M and col < N:
        C[row, col] = acc


NUMBA_GEMMS = {"numba_naive": gemm_naive, "numba_tiled": gemm_tiled}  # gemm_numba(kernel=...)
NUMBA_SIGNATURE = "void(float32[:, ::1], float32[:, ::1], float32[:, ::1])"
NUMBA_KERNELS = {"gemm_naive": NUMBA_SIGNATURE, "gemm_tiled": NUMBA_SIGNATURE}  # for tests/test_gpu_archs.py


# ===================================================================================== NumPy specs

def gemm_spec(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """C = A B in float64: the reference every kernel is measured against."""
    return np.asarray(A, np.float64) @ np.asarray(B, np.float64)


def tolerance(precision: str, k: int) -> float:
    """The error max |C - ref| / max |ref| that a precision allows for dot products of length k, for inputs
    of one sign (where |ref| is the sum of the |products|), against the exact product of the values the
    kernel multiplied:

    * "float32" (FP32 everywhere) and "fp16_inputs_fp32_acc" (tensor cores, FP32 accumulator): the classic
      bound k u with u = 2**-24: each of k additions rounds by at most u relative to the running sum;
    * "tf32": the same plus TF32's input rounding (10 stored bits: 2 x 2**-11 for a product), measured
      against the FP32 inputs;
    * "fp16_acc": FP16 accumulator, rounded every 16 along k; the worst case (k/16) 2**-11 is far too
      pessimistic to be useful, so the bound is statistical: 4 x what the NumPy model of the MMA gives,
      about 1e-4 sqrt(k) (section 2 of the notebook);
    * "fp16_output": an FP32 result stored as FP16: half a unit in the last place, 2**-11, plus k u."""
    u = 2.0**-24
    if k < 1:
        raise runtime.CourseInputError(f"k must be at least 1, got {k}")
    if precision in ("float32", "fp16_inputs_fp32_acc"):
        return k * u
    if precision == "tf32":
        return 2 * 2.0**-11 + k * u
    if precision == "fp16_acc":
        return 4e-4 * math.sqrt(k)
    if precision == "fp16_output":
        return 2.0**-11 + k * u
    raise runtime.CourseInputError(f"no tolerance for precision {precision!r}")


def rel_error(C, ref) -> float:
    """max |C - ref| / max |ref|: the error relative to the size of the result (NaN or inf: inf), in float64.
    NumPy or CuPy arrays; where either is a CuPy array it is computed on the GPU, without copying to the host.
    Every lesson's checks use this one."""
    xp = np
    if runtime.is_gpu() and any(isinstance(a, runtime.cupy().ndarray) for a in (C, ref)):
        xp = runtime.cupy()
    C = xp.asarray(C, xp.float64)
    ref = xp.asarray(ref, xp.float64)
    if not bool(xp.isfinite(C).all()):
        return math.inf
    return float(xp.abs(C - ref).max()) / max(float(xp.abs(ref).max()), np.finfo(np.float64).tiny)


# ======================================================== what a tensor core computes, in NumPy

def mma(a, b, c, *, acc: str = "float32"):
    """One tensor-core multiply-accumulate D = A B + C, emulated: A and B are rounded to FP16, their
    products are exact (11-bit significands multiply into 22 bits, which FP32 holds), the sum of the
    products and C is formed exactly (float64 here) and rounded once to ``acc`` (FP32 or FP16).

    This is a model: real tensor cores add in a fixed-width datapath and may round or truncate inside a
    step, so a GPU agrees with it to a few units in the last place of ``acc``, not bit for bit."""
    dtype = _acc_dtype(acc)
    a16 = np.asarray(a, np.float16).astype(np.float64)
    b16 = np.asarray(b, np.float16).astype(np.float64)
    with np.errstate(over="ignore"):
        return (a16 @ b16 + np.asarray(c, np.float64)).astype(dtype)


def gemm_emulated(A, B, *, acc: str = "float32", k_step: int = 16):
    """C = A B as a chain of tensor-core MMAs along K, ``k_step`` at a time (16 for WMMA): the accumulator
    is held in ``acc`` and rounded after every step. With FP16 accumulation the running sum loses
    precision as it grows; with FP32 it hardly does."""
    dtype = _acc_dtype(acc)
    A = np.asarray(A, np.float16)
    B = np.asarray(B, np.float16)
    if A.ndim != 2 or B.ndim != 2 or A.shape[1] != B.shape[0]:
        raise runtime.CourseInputError(f"A is {A.shape} and B is {B.shape}: need M x K and K x N")
    if k_step < 1:
        raise runtime.CourseInputError(f"k_step must be at least 1, got {k_step}")
    C = np.zeros((A.shape[0], B.shape[1]), dtype)
    for k in range(0, A.shape[1], k_step):
        C = mma(A[:, k:k + k_step], B[k:k + k_step], C, acc=acc)
    return C


def sum_fp16_sequential(x) -> np.float16:
    """x[0] + x[1] + ... with every partial sum rounded to FP16: plain half arithmetic, no tensor core."""
    s = np.float16(0)
    with np.errstate(over="ignore"):
        for v in np.asarray(x, np.float16):
            s = np.float16(s + v)
    return s


def _acc_dtype(acc: str):
    if acc not in ACCUMULATORS:
        raise runtime.CourseInputError(f"acc must be one of {ACCUMULATORS}, not {acc!r}")
    return np.dtype(acc)


def fp16_facts() -> dict:
    """FP16's range and precision beside FP32's, from np.finfo."""
    out = {}
    for name in ("float16", "float32"):
        f = np.finfo(name)
        out[name] = {"bits": f.bits, "significand_bits": f.nmant + 1, "exponent_bits": f.iexp,
                     "epsilon": float(f.eps), "max": float(f.max), "smallest_normal": float(f.smallest_normal),
                     "smallest_subnormal": float(f.smallest_subnormal), "decimal_digits": f.precision}
    return out


def accumulation_error(ks, *, m: int = 64, n: int = 64, seed: int = 0, dist: str = "uniform") -> dict:
    """Relative error against float64 of C = A B (FP16 inputs, M x K times K x N) for each K in ``ks``:
    FP32 accumulation, FP16 accumulation (rounded every 16 along K, as WMMA does), and the FP32 result
    rounded once to FP16 at the end (the best any FP16 output can be). dist: "uniform" ([0, 1), sums grow
    with K) or "normal" (mean zero, sums grow as sqrt(K))."""
    rng = np.random.default_rng(seed)
    out = {"k": list(ks), "fp32_acc": [], "fp16_acc": [], "fp16_output": [], "dist": dist, "m": m, "n": n}
    for k in ks:
        if dist == "uniform":
            A, B = rng.random((m, k)), rng.random((k, n))
        elif dist == "normal":
            A, B = rng.standard_normal((m, k)), rng.standard_normal((k, n))
        else:
            raise runtime.CourseInputError(f"dist must be 'uniform' or 'normal', not {dist!r}")
        A16, B16 = A.astype(np.float16), B.astype(np.float16)
        ref = gemm_spec(A16, B16)  # the exact product of the FP16 inputs: only accumulation error remains
        out["fp32_acc"].append(rel_error(gemm_emulated(A16, B16, acc="float32"), ref))
        out["fp16_acc"].append(rel_error(gemm_emulated(A16, B16, acc="float16"), ref))
        with np.errstate(over="ignore"):
            out["fp16_output"].append(rel_error(ref.astype(np.float16), ref))
    return out


def master_weight_updates(steps: int = 1000, *, w0: float = 1.0, update: float = 1e-4) -> dict:
    """A weight w0 receiving ``steps`` updates of ``update`` each, kept in FP16 and kept in FP32 (the
    master copy); the exact result is w0 + steps * update."""
    w16, w32 = np.float16(w0), np.float32(w0)
    for _ in range(steps):
        w16 = np.float16(w16 + np.float16(update))
        w32 = np.float32(w32 + np.float32(update))
    return {"fp16": float(w16), "fp32": float(w32), "exact": w0 + steps * update,
            "fp16_spacing_at_w0": float(np.spacing(np.float16(w0)))}


def loss_scaling(grads, scales=(1, 2**8, 2**16)) -> list:
    """For each loss scale S: the fraction of the (FP32) gradients that become zero, and that overflow,
    when S x gradient is stored in FP16; and the relative error of the unscaled FP16 gradients."""
    g = np.asarray(grads, np.float32)
    rows = []
    for s in scales:
        with np.errstate(over="ignore"):
            g16 = (g * np.float32(s)).astype(np.float16)
        back = g16.astype(np.float64) / s
        finite = np.isfinite(g16)
        ok = finite & (g != 0)
        rows.append({"scale": s, "zero": float(np.mean((g16 == 0) & (g != 0))), "overflow": float(np.mean(~finite)),
                     "median_rel_error": float(np.median(np.abs(back[ok] - g[ok]) / np.abs(g[ok]))) if ok.any()
                     else math.nan})
    return rows


# ============================================================================== the peak-rate formula

@dataclass(frozen=True)
class TensorCoreSpec:
    """Tensor cores per SM and dense FP16 FLOPs (multiply + add = 2) per tensor core per clock."""

    architecture: str
    tensor_cores_per_sm: int
    fp16_flops_per_tc_per_clock: int
    example: str
    example_boost_mhz: int  # the clock NVIDIA quotes its peak at, for the example GPU


# Compute capability -> dense FP16 with FP32 accumulation as data-center parts run it. GeForce parts of the
# same generation run FP32 accumulation at half this rate; sparsity doubles the datasheet figure.
TENSOR_CORE_SPECS = {
    "7.0": TensorCoreSpec("Volta", 8, 128, "Tesla V100 SXM2 (80 SMs)", 1530),
    "7.5": TensorCoreSpec("Turing", 8, 128, "Tesla T4 (40 SMs)", 1590),
    "8.0": TensorCoreSpec("Ampere", 4, 512, "A100 SXM4 (108 SMs)", 1410),
    "8.6": TensorCoreSpec("Ampere (GA10x)", 4, 256, "A10 (72 SMs)", 1695),
    "8.9": TensorCoreSpec("Ada", 4, 256, "L4 (58 SMs)", 2040),
    "9.0": TensorCoreSpec("Hopper", 4, 1024, "H100 SXM5 (132 SMs)", 1830),
}
GV100_SLIDE = {"sms": 80, "tensor_cores_per_sm": 8, "flops_per_tc_per_clock": 128, "clock_ghz": 1.462}


def peak_tflops(sms: int, tensor_cores_per_sm: int, flops_per_tc_per_clock: int, clock_ghz: float) -> float:
    """SMs x tensor cores per SM x FLOPs per tensor core per clock x clock: the slide's formula, in
    TFLOP/s. The GV100 of the slide: 80 x 8 x 128 x 1.462 GHz = 119.8 TFLOP/s. A Volta tensor core does a
    4x4x4 multiply-accumulate per clock: 64 multiplies and 64 adds = 128 FLOPs."""
    for name, v in (("sms", sms), ("tensor_cores_per_sm", tensor_cores_per_sm),
                    ("flops_per_tc_per_clock", flops_per_tc_per_clock), ("clock_ghz", clock_ghz)):
        if not v > 0:
            raise runtime.CourseInputError(f"{name} must be positive, got {v}")
    return sms * tensor_cores_per_sm * flops_per_tc_per_clock * clock_ghz * 1e9 / 1e12


def peak_for(device: dict, clock_mhz: float | None = None) -> dict:
    """The formula filled in for a GPU described like runtime.get().device (name, compute_capability,
    sms, max_sm_clock_mhz). clock_mhz: default the GPU's maximum SM clock, else the example's boost clock."""
    cc = device["compute_capability"]
    spec = TENSOR_CORE_SPECS.get(cc)
    if spec is None:
        raise runtime.CourseInputError(f"no tensor-core figures for compute capability {cc}; known: "
                                       f"{', '.join(TENSOR_CORE_SPECS)}")
    clock = clock_mhz or device.get("max_sm_clock_mhz") or spec.example_boost_mhz
    return {"gpu": device["name"], "architecture": spec.architecture, "sms": device["sms"],
            "tensor_cores_per_sm": spec.tensor_cores_per_sm, "flops_per_tc_per_clock": spec.fp16_flops_per_tc_per_clock,
            "clock_mhz": clock, "tflops": peak_tflops(device["sms"], spec.tensor_cores_per_sm,
                                                      spec.fp16_flops_per_tc_per_clock, clock / 1000)}


def fp32_simt_peak_tflops(sms: int, clock_mhz: float, fp32_lanes_per_sm: int = 128) -> float:
    """The ordinary cores: SMs x FP32 lanes per SM x 2 FLOPs (one FMA) x clock."""
    return sms * fp32_lanes_per_sm * 2 * clock_mhz * 1e6 / 1e12


# ==================================================================== arithmetic intensity of the kernels

def tiled_config(name: str) -> dict:
    """Block tile, warp tile, stages and accumulator of a tiled WMMA kernel, parsed from its name."""
    m = re.fullmatch(r"wmma_tiled_(\d+)x(\d+)x(\d+)_w(\d+)x(\d+)_s(\d+)_(f32|f16)", name)
    if not m or name not in TILED_CONFIGS:
        raise runtime.CourseInputError(f"no tiled WMMA kernel {name!r}; known: {', '.join(TILED_CONFIGS)}")
    bm, bn, bk, wm, wn, stages = map(int, m.groups()[:6])
    threads = (bm // wm) * (bn // wn) * 32
    smem = stages * (bm * (bk + 8) + bk * (bn + 8)) * 2
    return {"name": name, "bm": bm, "bn": bn, "bk": bk, "wm": wm, "wn": wn, "stages": stages, "threads": threads,
            "warps": threads // 32, "smem_bytes": smem, "acc": "float32" if m.group(7) == "f32" else "float16"}


def tiled_fits(name: str, cc=None) -> str | None:
    """None where tiled kernel ``name`` fits a block's shared memory on the GPU (``cc``: another one's compute
    capability), else one line saying why it cannot run there (gpucourse.gpus)."""
    c = tiled_config(name)
    return gpus.shared_memory_missing(c["smem_bytes"], what=name, cc=cc)


def default_tiled(acc: str = "float32", cc=None) -> str:
    """The tiled kernel ``gemm`` runs for accumulator ``acc`` when no configuration is named: DEFAULT_TILED, or on a
    GPU whose blocks get less shared memory than it needs, the first of TILED_FALLBACK that fits."""
    _acc_dtype(acc)
    for name in (DEFAULT_TILED[acc], *TILED_FALLBACK[acc]):
        if tiled_fits(name, cc) is None:
            return name
    raise runtime.CourseError(tiled_fits(TILED_FALLBACK[acc][-1], cc))


def intensity(kind: str, n: int, *, config: str | None = None) -> float:
    """FLOPs per byte that a kernel asks of global memory for an n x n x n GEMM, from its tiling: each
    element of A is fetched once per tile of C that needs it. (The caches serve some of these fetches, so
    DRAM may see fewer bytes; the compulsory minimum is kind "compulsory".)"""
    flops = 2.0 * n**3
    if kind == "compulsory":  # read A and B once (FP16), write C once (FP32)
        return flops / (2 * n * n * 2 + 4 * n * n)
    if kind in ("numba_naive", "simt_naive"):
        return flops / (2 * n**3 * 4)  # two FP32 loads per multiply-add
    if kind in ("numba_tiled", "simt_tiled16"):
        return flops / (2 * n**3 * 4 / TILE)
    if kind == "simt_128x128":
        return flops / (n**3 * 4 * (1 / 128 + 1 / 128))
    if kind == "naive":  # WMMA, 16 x 16 tiles of C
        return flops / (n**3 * 2 * (1 / 16 + 1 / 16))
    if kind == "tiled":
        c = tiled_config(config or DEFAULT_TILED["float32"])
        return flops / (n**3 * 2 * (1 / c["bn"] + 1 / c["bm"]))
    raise runtime.CourseInputError(f"no intensity model for {kind!r}")


# ============================================================================== checked launchers

def _is_cupy(x) -> bool:
    return type(x).__module__.startswith("cupy")


def _check_operands(A, B, C, in_dtype, out_dtype, *, b_transposed: str | None = None) -> tuple:
    """(M, N, K) of C = A B for device arrays of these types, C-contiguous; ``b_transposed``: B is given as N x K
    (the kernel named so reads it K-major), not K x N."""
    runtime.check_device_array(A, "A", dtype=in_dtype, ndim=2)
    runtime.check_device_array(B, "B", dtype=in_dtype, ndim=2)
    M, K = A.shape
    if b_transposed:
        if B.shape[1] != K:
            raise runtime.CourseInputError(f"{b_transposed} takes B transposed (N x K): A is {M} x {K}, so B "
                                           f"needs {K} columns, not {B.shape[1]}")
        N = B.shape[0]
    else:
        if B.shape[0] != K:
            raise runtime.CourseInputError(f"A is {M} x {K} but B is {B.shape[0]} x {B.shape[1]}: A's columns "
                                           "must match B's rows")
        N = B.shape[1]
    runtime.check_device_array(C, "C", dtype=out_dtype, shape=(M, N))
    for name, x in (("A", A), ("B", B), ("C", C)):
        if not _c_contiguous(x):
            raise runtime.CourseInputError(f"{name} must be C-contiguous (row-major); use cupy.ascontiguousarray")
    if min(M, N, K) < 1:
        raise runtime.CourseInputError(f"empty GEMM: M, N, K = {M}, {N}, {K}")
    return M, N, K


def _c_contiguous(x) -> bool:
    flags = getattr(x, "flags", None)
    if flags is None:
        return True
    try:
        return bool(flags["C_CONTIGUOUS"])
    except (KeyError, TypeError):
        return bool(getattr(flags, "c_contiguous", True))


def _require_multiple(M, N, K, bm, bn, bk, what):
    if M % bm or N % bn or K % bk:
        raise runtime.CourseInputError(
            f"{what} needs M a multiple of {bm}, N of {bn} and K of {bk}; got {M} x {N} x {K}. "
            "Pad the matrices with zeros (the padding adds nothing to the product) or use another kernel.")


def gemm_numba(A, B, C, *, kernel: str = "numba_tiled", threads: tuple = (16, 16)):
    """C = A B with a numba kernel (either mode): A (M x K), B (K x N), C (M x N), float32 device arrays.
    kernel: "numba_naive" or "numba_tiled" (which needs 16 x 16 threads). Asynchronous on a GPU."""
    if kernel not in NUMBA_GEMMS:
        raise runtime.CourseInputError(f"kernel must be one of {tuple(NUMBA_GEMMS)}, not {kernel!r}")
    M, N, K = _check_operands(A, B, C, np.float32, np.float32)
    tx, ty = threads
    if kernel == "numba_tiled" and (tx, ty) != (TILE, TILE):
        raise runtime.CourseInputError(f"gemm_tiled needs blocks of {TILE} x {TILE} threads, got {tx} x {ty}")
    if not (1 <= tx * ty <= 1024):
        raise runtime.CourseInputError(f"a block has 1 to 1024 threads, got {tx} x {ty}")
    grid = (math.ceil(N / tx), math.ceil(M / ty))
    NUMBA_GEMMS[kernel][grid, (tx, ty)](A, B, C)
    return C


def gemm(A, B, C, *, kernel: str = "tiled", config: str | None = None):
    """C = A B with a CUDA C kernel (GPU mode, CuPy arrays). Asynchronous.

    kernel "naive" (WMMA, one warp per 16x16 tile) and "tiled" (WMMA through shared memory; ``config``
    names one of TILED_CONFIGS): A, B float16; C float32 for FP32 accumulation or float16 for FP16.
    kernel "simt_tiled16" / "simt_128x128": FP32 on the ordinary cores; A, B, C float32.
    Shapes: naive needs multiples of 16; tiled and simt_128x128 multiples of their tiles (the error says
    which); simt_tiled16 takes any.
    kernel "wgmma": Hopper's warpgroup MMA fed by the TMA (compute capability 9.0; ``config`` names one of
    WGMMA_CONFIGS): A, B float16, C float32 (float16 for the "_f16" configurations); see gemm_wgmma."""
    runtime.require_gpu("a CUDA C kernel")
    for name, x in (("A", A), ("B", B), ("C", C)):
        if runtime.is_device_array(x) and not _is_cupy(x):
            raise runtime.CourseInputError(f"the CUDA C kernels take CuPy arrays; {name} is not one "
                                           "(cupy.asarray(...) wraps a numba device array without a copy)")
    if kernel in SGEMM:
        M, N, K = _check_operands(A, B, C, np.float32, np.float32)
        fn, bm, bn, bk = SGEMM[kernel]
        if kernel == "simt_128x128":
            _require_multiple(M, N, K, bm, bn, bk, "simt_128x128")
            block = (256,)
        else:
            block = (16, 16)
        grid = (math.ceil(N / bn), math.ceil(M / bm))
        cuda_c.function(SOURCE, fn)(grid, block, (A, B, C, np.int32(M), np.int32(N), np.int32(K)))
        return C
    if kernel == "wgmma":
        return gemm_wgmma(A, B, C, config=config)
    if kernel not in ("naive", "tiled"):
        raise runtime.CourseInputError(f"kernel must be one of {KINDS[:2] + tuple(SGEMM) + ('wgmma',)}, "
                                       f"not {kernel!r}")
    out_dtype = np.dtype(C.dtype) if runtime.is_device_array(C) else None
    if out_dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
        raise runtime.CourseInputError("C must be a float32 (FP32 accumulation) or float16 (FP16 accumulation) "
                                       f"device array, got {getattr(C, 'dtype', type(C).__name__)}")
    acc = out_dtype.name
    M, N, K = _check_operands(A, B, C, np.float16, out_dtype)
    if max(M, N, K) >= 2**31 // 16:
        raise runtime.CourseInputError("dimensions must stay below 2**27")
    if kernel == "naive":
        gpus.step("04.wmma")  # which GPU each step needs: gpucourse/gpus.py
        _require_multiple(M, N, K, 16, 16, 16, "the one-warp-per-tile WMMA kernel")
        warps = (M // 16) * (N // 16)
        threads = 128
        blocks = math.ceil(warps * 32 / threads)
        cuda_c.function(SOURCE, NAIVE_WMMA[acc])((blocks,), (threads,), (A, B, C, np.int32(M), np.int32(N),
                                                                        np.int32(K)))
        return C
    c = tiled_config(config or default_tiled(acc))
    if c["acc"] != acc:
        raise runtime.CourseInputError(f"{c['name']} accumulates in {c['acc']} but C is {acc}")
    _require_multiple(M, N, K, c["bm"], c["bn"], c["bk"], c["name"])
    gpus.step("04.wmma_tiled")  # below sm_80 its copies run synchronously, and it says so once
    fn = _tiled_function(c["name"], c["smem_bytes"])
    fn((N // c["bn"], M // c["bm"]), (c["threads"],), (A, B, C, np.int32(M), np.int32(N), np.int32(K)),
       shared_mem=c["smem_bytes"])
    return C


_raised = set()


def _tiled_function(name: str, smem: int):
    """The launchable tiled kernel ``name``, allowed ``smem`` bytes of shared memory; refused in one line, before it
    is compiled, where the GPU (or the faked one) gives a block less."""
    if name not in _raised:
        too_big = tiled_fits(name)
        if too_big:
            raise runtime.CourseInputError(f"{too_big}: pick a smaller tile (tc.default_tiled() fits)")
    fn = cuda_c.function(SOURCE, name)
    if name not in _raised:
        if smem > gpus.PORTABLE_SHARED_MEMORY:  # a block gets more than 48 KiB of shared memory only when asked for
            fn.max_dynamic_shared_size_bytes = smem
        _raised.add(name)
    return fn


# ============================================================= Hopper: wgmma fed by the TMA (sm_90a)

WGMMA_SOURCE = "tensor_cores_wgmma"  # kernels/cuda/tensor_cores_wgmma.cu, compiled for sm_90a only
# The wgmma kernels of tensor_cores_wgmma.cu: block tile BM x BN x 64, shared-memory stages, B's layout ("kn": K x N
# as everywhere in the lesson; "nk": B transposed, N x K, the layout the MMA reads without transposing).
WGMMA_CONFIGS = (
    "wgmma_128x256x64_s4_kn",
    "wgmma_128x256x64_s4_nk",
    "wgmma_128x256x64_s3_kn",
    "wgmma_128x256x64_s2_kn",
    "wgmma_128x256x64_s1_kn",
    "wgmma_64x256x64_s4_kn",
    "wgmma_128x128x64_s4_kn",
    "wgmma_128x128x64_s6_kn",
    # persistent: a block per SM walks the tiles, loading the next tile while it stores this one; C in FP32, in
    # FP16 (as cuBLAS writes it for FP16 inputs), or in FP16 through shared memory and a TMA store
    "wgmma_128x256x64_s4_kn_persistent",
    "wgmma_128x256x64_s4_kn_persistent_f16",
    "wgmma_128x256x64_s4_kn_persistent_f16_tmastore",
    # ... and with the next slice's MMAs issued before the last slice's are waited for ("_wait1": wgmma.wait_group 1),
    # in three tiles, so that a shape may take the one that fills the SMs' waves best (PERSISTENT_TILES)
    "wgmma_128x256x64_s4_kn_persistent_f16_tmastore_wait1",
    "wgmma_128x192x64_s4_kn_persistent_f16_tmastore_wait1",
    "wgmma_128x128x64_s6_kn_persistent_f16_tmastore_wait1",
    # ... and the TMA-store kernel in thread-block clusters of two blocks ("_c2"), which take two tiles of one column of
    # C on adjacent rows and share B's slices, each block loading half and the TMA multicasting it into both
    "wgmma_128x256x64_s4_kn_persistent_f16_tmastore_c2",
)
DEFAULT_WGMMA = "wgmma_128x256x64_s4_kn"
WGMMA_GROUP_M = 8  # tile-rows per group in the block order (L2 reuse); see gemm_wgmma
WGMMA_STORE_PIECE = 64  # tmastore: C leaves in pieces of 64 x 64 FP16, two buffers a consumer warpgroup


def wgmma_config(name: str) -> dict:
    """Block tile, stages, warpgroups, shared memory, B layout, persistence, C's type, the slices of MMAs a consumer
    leaves running (``in_flight``) and the blocks of a thread-block cluster (``cluster``: 2 for "_c2", else 1) of a
    wgmma kernel, from its name: wgmma_<BM>x<BN>x<BK>_s<stages>_<kn|nk>[_persistent[_f16[_tmastore[_wait1][_c2]]]]."""
    m = re.fullmatch(r"wgmma_(\d+)x(\d+)x(\d+)_s(\d+)_(kn|nk)(_persistent(_f16(_tmastore(_wait1)?(_c2)?)?)?)?", name)
    if not m or name not in WGMMA_CONFIGS:
        raise runtime.CourseInputError(f"no wgmma kernel {name!r}; known: {', '.join(WGMMA_CONFIGS)}")
    bm, bn, bk, stages = map(int, m.groups()[:4])
    consumers = bm // 64
    tma_store = m.group(8) is not None
    staging = consumers * 2 * WGMMA_STORE_PIECE * WGMMA_STORE_PIECE * 2 if tma_store else 0
    smem = 1024 + stages * (bm + bn) * bk * 2 + staging + 2 * stages * 8  # alignment, tiles, C's pieces, mbarriers
    return {"name": name, "bm": bm, "bn": bn, "bk": bk, "stages": stages, "b_layout": m.group(5),
            "consumers": consumers, "threads": 128 * (consumers + 1), "smem_bytes": smem, "acc": "float32",
            "persistent": m.group(6) is not None, "out": "float16" if m.group(7) else "float32",
            "epilogue": "tma" if tma_store else "registers", "in_flight": 1 if m.group(9) else 0,
            "cluster": 2 if m.group(10) else 1}


# cuTensorMapEncodeTiled's enums (cuda.h)
_TMA_FLOAT16, _TMA_SWIZZLE_128B, _TMA_L2_256B = 6, 3, 3
_TMA_UINT8, _TMA_SWIZZLE_64B = 0, 2  # CU_TENSOR_MAP_DATA_TYPE_UINT8, CU_TENSOR_MAP_SWIZZLE_64B


_tensor_maps: dict = {}


def _map_buffer():
    """128 bytes for a CUtensorMap at an address the driver accepts (a multiple of 64), inside a larger buffer
    that the returned array keeps alive."""
    import ctypes

    raw = (ctypes.c_ubyte * (128 + 64))()
    return (ctypes.c_ubyte * 128).from_buffer(raw, -ctypes.addressof(raw) % 64)


def tensor_map_args(shape: tuple, box: tuple, itemsize: int = 2) -> tuple:
    """cuTensorMapEncodeTiled's dimensions, byte strides and box for a C-contiguous array of ``shape`` read in
    boxes of ``box`` elements (both in NumPy's order, slowest dimension first): the driver wants them fastest
    first, and the strides of every dimension but the fastest. The TMA needs the fastest dimension to be a whole
    number of 16-byte units, and at most 256 elements a box side."""
    if len(box) != len(shape) or not 1 <= len(shape) <= 5:
        raise runtime.CourseInputError(f"a tensor map has 1 to 5 dimensions and a box side for each; got shape "
                                       f"{tuple(shape)} and box {tuple(box)}")
    if (shape[-1] * itemsize) % 16:
        raise runtime.CourseInputError(
            f"the TMA needs a 16-byte aligned tensor whose rows are a multiple of 16 bytes; this one's rows are "
            f"{shape[-1]} elements ({shape[-1] * itemsize} bytes): pad them to a multiple of {16 // itemsize}")
    if not all(1 <= b <= 256 for b in box):
        raise runtime.CourseInputError(f"every side of a TMA box is 1 to 256 elements, got {tuple(box)}")
    dims = tuple(int(d) for d in reversed(shape))
    strides, step = [], itemsize
    for d in dims[:-1]:
        step *= d
        strides.append(step)
    return dims, tuple(strides), tuple(int(b) for b in reversed(box))


def _cached_map(x, key: tuple, encode) -> "object":
    """The tensor map of CuPy array ``x`` for ``key`` (what, besides x's address and shape, it was made from),
    made once by ``encode(buffer)`` into 128 bytes the driver accepts; the TMA needs x 16-byte aligned."""
    key = (x.data.ptr, tuple(x.shape), *key)
    if key not in _tensor_maps:
        if x.data.ptr % 16:
            raise runtime.CourseInputError("the TMA needs a 16-byte aligned tensor; this one starts "
                                           f"{x.data.ptr % 16} bytes past a boundary")
        tmap = _map_buffer()
        encode(tmap)
        if len(_tensor_maps) > 64:
            _tensor_maps.clear()
        _tensor_maps[key] = tmap
    return _tensor_maps[key]


def tensor_map(x, box: tuple) -> "object":
    """The TMA descriptor (CUtensorMap, 128 bytes) of a C-contiguous CuPy array ``x`` of 2 to 5 dimensions (a
    row-major matrix: box = (rows, columns)) of FP16, or of bytes (FP8 codes, in boxes 128 wide), read in boxes of
    ``box`` elements, written into shared memory in the 128-byte swizzle, with reads outside the array filled with
    zeros. Made once per (address, shape, box) by cuTensorMapEncodeTiled."""
    item = np.dtype(x.dtype).itemsize

    def encode(tmap):
        encode_tiled(tmap, x.data.ptr, *tensor_map_args(tuple(x.shape), tuple(box), item), itemsize=item,
                     row=box[-1] * item)

    return _cached_map(x, ("tiled", item, tuple(box)), encode)


def _tma_type(itemsize: int, row: int | None = None) -> tuple:
    """(the TMA's element type, its swizzle) for elements of ``itemsize`` bytes read ``row`` bytes to a row (64
    elements when None): rows of 128 bytes in the 128-byte swizzle (FP16, and the engine's wide 8-bit tiles), of 64
    bytes (8-bit ones: INT8, FP8, moved as bytes) in the 64-byte swizzle."""
    if itemsize not in (1, 2):
        raise runtime.CourseInputError(f"the tensor maps here hold 1- or 2-byte elements, not {itemsize}-byte ones")
    row = 64 * itemsize if row is None else row
    if row not in (64, 128):
        raise runtime.CourseInputError(f"a tensor map's rows here are 64 or 128 bytes (a row of the swizzle), not {row}")
    return (_TMA_FLOAT16 if itemsize == 2 else _TMA_UINT8, _TMA_SWIZZLE_128B if row == 128 else _TMA_SWIZZLE_64B)


def encode_tiled(tmap, ptr: int, dims: tuple, strides: tuple, box: tuple, itemsize: int = 2,
                 row: int | None = None) -> None:
    """cuTensorMapEncodeTiled into ``tmap`` (128 bytes, ``_map_buffer``) for FP16 elements (``itemsize`` 1: bytes)
    at address ``ptr``: ``dims`` fastest first, the byte ``strides`` of every dimension but the fastest (any
    multiple of 16 bytes: a view that skips pixels or rows is a tensor too), ``box`` fastest first; 128-byte swizzle
    (64-byte for bytes, unless ``row`` = 128 bytes: ``_tma_type``), zeros outside."""
    import ctypes

    rank = len(dims)
    kind, swizzle = _tma_type(itemsize, row)
    cuda_c.driver_check(cuda_c.driver().cuTensorMapEncodeTiled(
        tmap, kind, rank, ctypes.c_void_p(ptr), (ctypes.c_uint64 * rank)(*dims),
        (ctypes.c_uint64 * max(1, rank - 1))(*strides), (ctypes.c_uint32 * rank)(*box),
        (ctypes.c_uint32 * rank)(*([1] * rank)), 0, swizzle, _TMA_L2_256B, 0), "cuTensorMapEncodeTiled")


def encode_im2col(tmap, ptr: int, dims: tuple, strides: tuple, pixels: int, channels: int, lower: tuple,
                  upper: tuple, itemsize: int = 2, row: int | None = None) -> None:
    """cuTensorMapEncodeIm2col into ``tmap`` for an NHWC FP16 image (``itemsize`` 1: bytes) at ``ptr``: ``dims``
    (C, W, H, N) and the byte strides of W, H and N; ``pixels`` x ``channels`` a load; the window from ``lower`` to
    ``upper`` (both (rows, columns)) as ``tensor_map_im2col`` says; ``row``: as ``encode_tiled``'s."""
    import ctypes

    kind, swizzle = _tma_type(itemsize, row)
    cuda_c.driver_check(cuda_c.driver().cuTensorMapEncodeIm2col(
        tmap, kind, 4, ctypes.c_void_p(ptr), (ctypes.c_uint64 * 4)(*dims),
        (ctypes.c_uint64 * 3)(*strides), (ctypes.c_int * 2)(lower[1], lower[0]),  # the driver wants W first
        (ctypes.c_int * 2)(upper[1], upper[0]), channels, pixels, (ctypes.c_uint32 * 4)(1, 1, 1, 1), 0,
        swizzle, _TMA_L2_256B, 0), "cuTensorMapEncodeIm2col")


def tensor_map_im2col(x, pixels: int, channels: int, lower: tuple, upper: tuple) -> "object":
    """The TMA descriptor of an NHWC FP16 CuPy image ``x`` (N, H, W, C) read in the TMA's im2col mode: each load
    brings ``pixels`` pixels of ``channels`` channels, as rows of ``channels * 2`` bytes in the 128-byte swizzle,
    walking the pixels in order (W fastest, then H, then N) inside a window around every image that runs from
    ``lower`` = (top, left) to (H - 1, W - 1) + ``upper`` (both (rows, columns), may be negative), shifted by the
    load's offsets; zeros outside the image. Made once per (address, shape, parameters) by
    cuTensorMapEncodeIm2col."""
    import ctypes

    if x.ndim != 4:
        raise runtime.CourseInputError(f"the TMA's im2col mode here reads NHWC images (4 dimensions), got shape "
                                       f"{tuple(x.shape)}")
    if not 1 <= pixels <= 256 or channels * 2 > 128 or channels < 8:
        raise runtime.CourseInputError(f"an im2col load brings 1 to 256 pixels of 8 to 64 FP16 channels (one "
                                       f"128-byte row of the swizzle), got {pixels} x {channels}")

    def encode(tmap):
        dims, strides, _ = tensor_map_args(tuple(x.shape), (1, 1, 1, 1), 2)  # (C, W, H, N) and byte strides
        encode_im2col(tmap, x.data.ptr, dims, strides, pixels, channels, lower, upper)

    return _cached_map(x, ("im2col", pixels, channels, tuple(lower), tuple(upper)), encode)


_hopper_ready: set = set()


def hopper_kernel(source: str, name: str, smem_bytes: int, edits: dict | None = None):
    """Kernel ``name`` of kernels/cuda/<source>.cu compiled for sm_90a (GPU mode; with ``edits`` in place of those
    regions, a notebook cell's version), allowed ``smem_bytes`` of dynamic shared memory once, after checking this
    GPU gives a block that much."""
    key = (source, name, tuple(sorted((edits or {}).items())))
    fn = cuda_c.module_arch(source, "sm_90a", edits).get_function(name)
    if key not in _hopper_ready:
        cp = runtime.cupy()
        optin = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id).get("sharedMemPerBlockOptin", 0)
        if smem_bytes > optin:
            raise runtime.CourseInputError(f"{name} needs {smem_bytes} bytes of shared memory; this "
                                           f"GPU allows {optin} per block")
        fn.max_dynamic_shared_size_bytes = smem_bytes
        _hopper_ready.add(key)
    return fn


def launch_hopper(fn, grid: tuple, threads: int, smem_bytes: int, args: list, what: str, *, pdl: bool = False) -> None:
    """Launch ``fn`` on the current CuPy stream through the driver (cuLaunchKernel), since its first parameters are
    128-byte tensor maps passed by value, which CuPy's launcher cannot pass. ``args``: ctypes values in the
    kernel's order; ``grid``: up to three block counts. ``pdl``: a programmatic dependent launch (cuLaunchKernelEx
    with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION): the kernel may start while the one before it on the
    stream still runs, so it must wait for it (hopper.cuh's wait_for_previous_kernel) before it touches global
    memory."""
    import ctypes

    params = (ctypes.c_void_p * len(args))(*(ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args))
    stream = runtime.cupy().cuda.get_current_stream().ptr
    gx, gy, gz = (tuple(grid) + (1, 1))[:3]
    kernel = ctypes.c_void_p(getattr(fn, "kernel", fn).ptr)
    if not pdl:
        status = cuda_c.driver().cuLaunchKernel(kernel, gx, gy, gz, threads, 1, 1, smem_bytes, ctypes.c_void_p(stream),
                                                params, None)
    else:
        attr = cuda_c.LaunchAttribute(id=cuda_c.PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value.int_value = 1
        config = cuda_c.LaunchConfig(gx, gy, gz, threads, 1, 1, smem_bytes, ctypes.c_void_p(stream),
                                     ctypes.pointer(attr), 1)
        status = cuda_c.driver().cuLaunchKernelEx(ctypes.byref(config), kernel, params, None)
    cuda_c.driver_check(status, f"launching {what}")


def blocks_per_sm(fn, threads: int, smem: int) -> int:
    """How many blocks of ``fn`` (``threads`` threads, ``smem`` bytes of dynamic shared memory) an SM holds at once,
    by the driver's count (its registers, shared memory and threads): what a persistent kernel launches per SM."""
    import ctypes

    n = ctypes.c_int()
    cuda_c.driver_check(cuda_c.driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(n), ctypes.c_void_p(getattr(fn, "kernel", fn).ptr), ctypes.c_int(threads), ctypes.c_size_t(smem)),
        "asking the driver how many blocks fit on an SM")
    return max(1, n.value)


def gemm_wgmma(A, B, C, *, config: str | None = None, group_m: int = WGMMA_GROUP_M, blocks: int | None = None):
    """C = A B on Hopper's warpgroup MMA fed by the TMA (GPU mode, compute capability 9.0; CuPy arrays).
    Asynchronous.

    A: M x K FP16; B: K x N FP16 for the "kn" configurations, or B transposed (N x K) for "nk"; C: M x N
    float32, or float16 for the "_f16" configurations (FP32 sums rounded once). Any M, N, K (the TMA fills with
    zeros past the edges and the stores are guarded), as long as rows are whole 16-byte units: K a multiple of 8,
    and N too for "kn". ``group_m``: how many tile-rows the block order walks before moving right (L2 reuse). The
    "_persistent" configurations launch one block per SM (or one per tile, if fewer), each walking its tiles;
    ``blocks`` launches that many instead (fewer blocks, more tiles each: what the tests use to walk many). The "_c2"
    ones run in clusters of two blocks (``wgmma_blocks``): ``blocks`` must then be even."""
    import ctypes

    runtime.require_gpu("the wgmma GEMM")
    c = wgmma_config(config or DEFAULT_WGMMA)
    out = np.dtype(c["out"])
    for name, x in (("A", A), ("B", B), ("C", C)):
        if runtime.is_device_array(x) and not _is_cupy(x):
            raise runtime.CourseInputError(f"the CUDA C kernels take CuPy arrays; {name} is not one "
                                           "(cupy.asarray(...) wraps a numba device array without a copy)")
    if runtime.is_device_array(C) and np.dtype(C.dtype) != out:
        raise runtime.CourseInputError(f"{c['name']} writes C in {out}: C must be a {out} array, got "
                                       f"{np.dtype(C.dtype)}" + ("" if c["out"] == "float16" else
                                                                 " (the '_f16' configurations write float16)"))
    M, N, K = _check_operands(A, B, C, np.float16, out,
                              b_transposed=c["name"] if c["b_layout"] == "nk" else None)
    if K % 8 or (c["b_layout"] == "kn" and N % 8):
        raise runtime.CourseInputError(
            f"the TMA reads rows that are whole 16-byte units: K{' and N' if c['b_layout'] == 'kn' else ''} "
            f"must be multiples of 8 (got M, N, K = {M}, {N}, {K}); pad with zeros")
    if max(M, N, K) >= 2**31 // 2:
        raise runtime.CourseInputError("dimensions must stay below 2**30")
    if not 1 <= group_m <= 64:
        raise runtime.CourseInputError(f"group_m must be 1..64, got {group_m}")
    if blocks is not None and (not c["persistent"] or blocks < 1):
        raise runtime.CourseInputError(f"blocks is for the persistent configurations, at least 1 (got {blocks} for "
                                       f"{c['name']}, which launches " +
                                       ("one block per tile)" if not c["persistent"] else "a block per SM by default)"))
    check_cluster_blocks(c, blocks)
    gpus.step("04.wgmma")  # compute capability 9.0 exactly, else one line saying so
    fn = hopper_kernel(WGMMA_SOURCE, c["name"], c["smem_bytes"])
    map_a = tensor_map(A, (c["bm"], c["bk"]))
    map_b = tensor_map(B, (c["bk"], 64) if c["b_layout"] == "kn" else (c["bn"], c["bk"]))
    blocks = wgmma_blocks(c, M, N, (blocks or runtime.get().device.get("sms")) if c["persistent"] else None)
    dims = [ctypes.c_int32(M), ctypes.c_int32(N), ctypes.c_int32(K), ctypes.c_int32(group_m)]
    if c["epilogue"] == "tma":  # C written by the TMA in boxes of 64 x 64 (N a multiple of 8: checked above)
        args = [map_a, map_b, tensor_map(C, (WGMMA_STORE_PIECE, WGMMA_STORE_PIECE)), *dims]
    else:
        args = [map_a, map_b, ctypes.c_uint64(C.data.ptr), *dims]
    launch_hopper(fn, (blocks,), c["threads"], c["smem_bytes"], args, c["name"])
    return C


def wgmma_blocks(c: dict, M: int, N: int, sms: int | None = None) -> int:
    """How many blocks a wgmma configuration ``c`` (wgmma_config, or tensor_cores_fp8.fp8_config) launches for an M x N
    C: one per tile, or, persistent, one per SM (``sms``) unless there are fewer tiles. In clusters of
    ``c["cluster"]`` blocks (the "_c2" kernels: the blocks of a cluster take that many tiles of one column of C on
    adjacent rows), a cluster per ``c["cluster"]`` SMs, or per cluster tile if fewer: a multiple of the cluster's size,
    which the kernel's compile-time cluster dimensions require of an ordinary launch's grid."""
    tiles = math.ceil(M / c["bm"]) * math.ceil(N / c["bn"])
    if not c["persistent"]:
        return tiles
    if not sms or sms < 1:
        raise runtime.CourseInputError(f"{c['name']} launches a block per SM: give the number of SMs, not {sms!r}")
    size = c.get("cluster", 1)
    if size == 1:
        return min(tiles, sms)
    if sms < size:
        raise runtime.CourseInputError(f"{c['name']} runs in clusters of {size} blocks: it needs at least {size} "
                                       f"SMs (or blocks), not {sms}")
    cluster_tiles = math.ceil(M / (size * c["bm"])) * math.ceil(N / c["bn"])
    return size * min(cluster_tiles, sms // size)


def check_cluster_blocks(c: dict, blocks) -> None:
    """A kernel launched in clusters (``c["cluster"]`` > 1) needs a grid that is a whole number of clusters: refuse a
    ``blocks`` that is not (None: the launcher's choice, always whole)."""
    size = c.get("cluster", 1)
    if blocks is not None and size > 1 and (isinstance(blocks, bool) or int(blocks) != blocks or blocks % size):
        raise runtime.CourseInputError(f"{c['name']} runs in clusters of {size} blocks: blocks must be a multiple of "
                                       f"{size}, got {blocks!r}")


# The persistent FP16 kernels a GEMM's shape chooses among (persistent_tile), largest tile first: one schedule, mainloop
# and epilogue, three tiles. A larger tile reads fewer operand bytes per multiply-add; a smaller one may fill the SMs'
# last wave better.
PERSISTENT_TILES = (
    "wgmma_128x256x64_s4_kn_persistent_f16_tmastore_wait1",
    "wgmma_128x192x64_s4_kn_persistent_f16_tmastore_wait1",
    "wgmma_128x128x64_s6_kn_persistent_f16_tmastore_wait1",
)
TILE_TIE = 0.03  # persistent_tile: wave efficiencies this close to the best count as equal; the larger tile wins


def wave_efficiency(config: str, M: int, N: int, sms: int) -> float:
    """The share of the multiply-adds that the persistent kernel ``config`` could do in its waves that are C's own: an
    M x N C in ceil(M / BM) x ceil(N / BN) tiles, walked by min(tiles, sms) blocks, takes ceil(tiles / sms) waves of
    sms tiles each, so M N / (waves x sms x BM x BN). Below 1 where the last wave leaves SMs idle, or where tiles
    reach past C's edges. (8192 x 768 in 128 x 256 tiles on 132 SMs: 192 tiles, 2 waves, 0.73.)"""
    c = wgmma_config(config)
    if not c["persistent"]:
        raise runtime.CourseInputError(f"{config} runs a block per tile; wave_efficiency is for the persistent kernels")
    if min(M, N, sms) < 1:
        raise runtime.CourseInputError(f"M, N and the SMs must be positive, got {M}, {N}, {sms}")
    tiles = math.ceil(M / c["bm"]) * math.ceil(N / c["bn"])
    waves = math.ceil(tiles / sms)
    return M * N / (waves * sms * c["bm"] * c["bn"])


def persistent_tile(M: int, N: int, sms: int, tiles=PERSISTENT_TILES, tie: float = TILE_TIE) -> str:
    """The rule by which a GEMM picks its tile, as a library's heuristics do (K does not enter: every tile walks the
    same K): the largest of ``tiles`` (listed largest first) whose wave efficiency (``wave_efficiency``) is within
    ``tie`` of the best of them. A larger tile reads fewer operand bytes per multiply-add, so it wins unless a smaller
    one fills the waves clearly better: on 132 SMs, 8192 x 768 (a transformer MLP's down projection at d = 768) takes
    128 x 192 (256 tiles, 2 waves, 0.97) over 128 x 256 (192 tiles, 2 waves, 0.73). transformer_table checks it
    against the fastest tile measured."""
    eff = {c: wave_efficiency(c, M, N, sms) for c in tiles}
    best = max(eff.values())
    return next(c for c in tiles if eff[c] >= (1 - tie) * best)


def gemm_library(A, B, C=None, *, tf32: bool = False):
    """cuBLAS through cupy.matmul (GPU mode): FP16 inputs run on the tensor cores, FP32 on the ordinary
    cores unless ``tf32`` (TF32 tensor cores for FP32 inputs, where the GPU has them: compute capability
    8.0 and up). Returns C (cupy.matmul's output if C is None)."""
    cp = runtime.cupy()
    if not tf32:
        return cp.matmul(A, B, out=C)
    from cupy._core import _routines_linalg as linalg

    f32 = np.dtype(np.float32)
    before = linalg.get_compute_type(f32)
    linalg.set_compute_type(f32, linalg.COMPUTE_TYPE_TF32)
    try:
        return cp.matmul(A, B, out=C)
    finally:
        linalg.set_compute_type(f32, before)


def include_path_or_explain() -> list:
    """The CUDA include folders WMMA needs under NVRTC (<mma.h>), or a CourseError saying how to get them."""
    from pathlib import Path

    dirs = [d for d in cuda_c.include_dirs() if (Path(d) / "mma.h").exists() or (Path(d) / "crt" / "mma.h").exists()]
    if not dirs:
        raise runtime.CourseError(
            "the WMMA kernels include <mma.h>, and no CUDA toolkit headers were found: set CUDA_PATH (or "
            "CUDA_HOME) to your CUDA toolkit, put its nvcc on PATH, or pip install the CUDA headers wheel "
            "(nvidia-cuda-runtime-cu12 / cu13, which ships include/) and restart the kernel")
    return dirs

"""Lesson 4's measurements on a GPU, and the figures drawn from them (measured or recorded).

Every function that measures needs GPU mode; every plot function takes the figures plus their source
label, so the notebook draws recorded figures in CPU mode with the same code.
"""
from __future__ import annotations

import math

import numpy as np

from gpucourse.records import Figure
from gpucourse import bench, claims, gpus, plots, runtime
from kernels import tensor_cores as tc
from kernels import tensor_cores_fp8 as F

LESSON = "04_tensor_cores"
# What each wgmma configuration adds over the one before it (the notebook's "what each ingredient bought").
WGMMA_STEPS = {
    "wgmma_128x256x64_s1_kn": "wgmma + TMA, 1 stage (copy, then compute)",
    "wgmma_128x256x64_s2_kn": "2 stages (the next copy overlaps the MMAs)",
    "wgmma_128x256x64_s3_kn": "3 stages",
    "wgmma_128x256x64_s4_kn": "4 stages",
    "wgmma_64x256x64_s4_kn": "4 stages, one consumer warpgroup (64 x 256 tile)",
    "wgmma_128x128x64_s4_kn": "4 stages, 128 x 128 tile",
    "wgmma_128x128x64_s6_kn": "6 stages, 128 x 128 tile",
    "wgmma_128x256x64_s4_nk": "4 stages, B stored transposed (N x K)",
    "wgmma_128x256x64_s4_kn_persistent": "4 stages, persistent (a block per SM)",
    "wgmma_128x256x64_s4_kn_persistent_f16": "persistent, FP16 C (as cuBLAS writes it)",
    "wgmma_128x256x64_s4_kn_persistent_f16_tmastore": "persistent, FP16 C by a TMA store",
    "wgmma_128x256x64_s4_kn_persistent_f16_tmastore_wait1": "... and one slice's MMAs left running (wait_group 1)",
    "wgmma_128x192x64_s4_kn_persistent_f16_tmastore_wait1": "... the same, 128 x 192 tile",
    "wgmma_128x128x64_s6_kn_persistent_f16_tmastore_wait1": "... the same, 128 x 128 tile, 6 stages",
    "wgmma_128x256x64_s4_kn_persistent_f16_tmastore_c2": "persistent, TMA store, clusters of 2 sharing B (multicast)",
}
WGMMA_HOLD_MS = 2.0  # queue each launch behind a hold kernel: the events time the GEMM, not the ctypes launch
CHECK = 1e-3  # a timed kernel's result against cuBLAS's, |diff|max / |ref|max: catches bugs, not rounding
CHECK_F16 = 2e-3  # the same for a kernel that writes FP16 C: its rounding alone is up to 2^-11 of |C|


def wgmma_check(config: str | None) -> float:
    """The largest error (|diff|max / |ref|max against the FP32 product) a wgmma kernel's result may have before it is
    timed: CHECK, or CHECK_F16 for a kernel that writes FP16 C."""
    return CHECK_F16 if config and tc.wgmma_config(config)["out"] == "float16" else CHECK


def _operands(n: int, dtype, *, seed: int = 0):
    """A, B (n x n, uniform in [-1, 1)) in ``dtype`` on the GPU, and the FP32 product of exactly those
    values by cuBLAS as the reference for checks."""
    cp = runtime.cupy()
    runtime.check_fits(n * n * (2 * np.dtype(dtype).itemsize + 4 * 4), f"a {n}^3 GEMM")
    rs = cp.random.RandomState(seed)
    A = (rs.random_sample((n, n), dtype=cp.float32) * 2 - 1).astype(dtype)
    B = (rs.random_sample((n, n), dtype=cp.float32) * 2 - 1).astype(dtype)
    ref = cp.matmul(A.astype(cp.float32), B.astype(cp.float32))
    return A, B, ref


# name -> (precision, kind, intensity model, launch(ops) where ops holds the operands, out buffers)
def _launchers(config: str, config16: str) -> dict:
    def numba(kernel):
        return lambda o: tc.gemm_numba(o["nA32"], o["nB32"], o["nC32"], kernel=kernel)

    return {
        "numba, naive": ("FP32", "kernel", "numba_naive", numba("numba_naive")),
        "numba, shared-memory tiles 16x16": ("FP32", "kernel", "numba_tiled", numba("numba_tiled")),
        "CUDA C, shared-memory tiles 16x16": ("FP32", "kernel", "simt_tiled16",
                                              lambda o: tc.gemm(o["A32"], o["B32"], o["C32"], kernel="simt_tiled16")),
        "CUDA C, register tiles 128x128 (8x8 a thread)": (
            "FP32", "kernel", "simt_128x128", lambda o: tc.gemm(o["A32"], o["B32"], o["C32"], kernel="simt_128x128")),
        "cuBLAS FP32": ("FP32", "library", "compulsory", lambda o: tc.gemm_library(o["A32"], o["B32"], o["L32"])),
        "cuBLAS TF32 (tensor cores)": ("TF32", "library", "compulsory",
                                       lambda o: tc.gemm_library(o["A32"], o["B32"], o["L32"], tf32=True)),
        "WMMA, one warp per 16x16 tile": ("FP16", "kernel", "naive",
                                          lambda o: tc.gemm(o["A16"], o["B16"], o["C32"], kernel="naive")),
        f"WMMA, tiled ({config})": ("FP16", "kernel", "tiled",
                                    lambda o: tc.gemm(o["A16"], o["B16"], o["C32"], kernel="tiled", config=config)),
        f"WMMA, tiled, FP16 accumulation ({config16})": (
            "FP16 acc", "kernel", "tiled", lambda o: tc.gemm(o["A16"], o["B16"], o["C16"], kernel="tiled",
                                                             config=config16)),
        "cuBLAS FP16 (tensor cores)": ("FP16", "library", "compulsory",
                                       lambda o: tc.gemm_library(o["A16"], o["B16"], o["L16"])),
    }


def _all_operands(n: int) -> dict:
    cp = runtime.cupy()
    cuda = runtime.cuda()
    A16, B16, ref16 = _operands(n, cp.float16)
    A32, B32, ref32 = _operands(n, cp.float32, seed=1)
    o = {"A16": A16, "B16": B16, "ref16": ref16, "A32": A32, "B32": B32, "ref32": ref32,
         "C32": cp.empty((n, n), cp.float32), "C16": cp.empty((n, n), cp.float16),
         "L32": cp.empty((n, n), cp.float32), "L16": cp.empty((n, n), cp.float16)}
    o["nA32"], o["nB32"], o["nC32"] = (cuda.as_cuda_array(o[k]) for k in ("A32", "B32", "C32"))
    return o


def _out_of(o: dict, name: str, precision: str):
    if precision == "FP16 acc":
        return o["C16"], o["ref16"]
    if name.startswith("cuBLAS"):
        return (o["L16"], o["ref16"]) if precision == "FP16" else (o["L32"], o["ref32"])
    return (o["C32"], o["ref16"]) if precision == "FP16" else (o["C32"], o["ref32"])


def kernel_table(n: int | None = None, *, config: str | None = None, config16: str | None = None,
                 repeats: int = 10) -> dict:
    """Every GEMM of the lesson on n x n x n, in TFLOP/s, each checked against cuBLAS before it is timed.
    FP32-input rows (TF32 among them) are compared with cuBLAS FP32, FP16-input rows with cuBLAS FP16."""
    cp = runtime.cupy()
    n = n or runtime.size("tensor_cores.n")
    config = config or tc.default_tiled("float32")
    config16 = config16 or tc.default_tiled("float16")
    o = _all_operands(n)
    launchers = _launchers(config, config16)
    flops = 2.0 * n**3
    rows = []
    for name, (precision, kind, model, launch) in bench.progress(launchers.items(), desc="GEMMs"):
        out, ref = _out_of(o, name, precision)
        out.fill(cp.nan)
        launch(o)
        err = tc.rel_error(out, ref)
        limit = 3e-2 if precision == "FP16 acc" else (5e-3 if precision in ("TF32",) or name == "cuBLAS FP16 (tensor cores)"
                                                       else CHECK)
        if not err <= limit:
            raise runtime.CourseError(f"{name} gave a wrong result at n={n} (error {err:.2e}); not timing it")
        slow = name.startswith("numba, naive")
        t = bench.time_gpu(lambda: launch(o), repeats=3 if slow else repeats, warmup=1 if slow else 3)
        rows.append({"name": name, "precision": precision, "kind": kind, "model": model, **t.summary(),
                     "tflops": t.tflops(flops), "check_error": err,
                     "intensity": tc.intensity(model, n, config=(config16 if precision == "FP16 acc" else config)
                                               if model == "tiled" else None)})
    lib = {r["name"]: r["tflops"] for r in rows if r["kind"] == "library"}
    for r in rows:
        base = lib["cuBLAS FP32"] if r["precision"] in ("FP32", "TF32") else lib["cuBLAS FP16 (tensor cores)"]
        r["of_cublas"] = r["tflops"] / base
    best = {p: max(r["tflops"] for r in rows if r["kind"] == "kernel" and r["precision"] == p) for p in ("FP32", "FP16")}
    return {"n": n, "flops": flops, "config": config, "config16": config16, "rows": rows,
            "tc_vs_simt_cublas": lib["cuBLAS FP16 (tensor cores)"] / lib["cuBLAS FP32"],
            "tc_vs_simt_ours": best["FP16"] / best["FP32"]}


def config_table(n: int | None = None, repeats: int = 10) -> dict:
    """Every tiled WMMA configuration of tensor_cores.cu that fits this GPU's shared memory on n x n x n, in TFLOP/s
    (checked first); "skipped": one line for each that does not fit."""
    cp = runtime.cupy()
    n = n or runtime.size("tensor_cores.n")
    A, B, ref = _operands(n, cp.float16)
    rows = []
    skipped = [why for why in map(tc.tiled_fits, tc.TILED_CONFIGS) if why]
    fitting = [name for name in tc.TILED_CONFIGS if tc.tiled_fits(name) is None]
    for name in bench.progress(fitting, desc="tile configurations"):
        c = tc.tiled_config(name)
        C = cp.full((n, n), cp.nan, dtype=c["acc"])
        tc.gemm(A, B, C, kernel="tiled", config=name)
        err = tc.rel_error(C, ref)
        if not err <= (3e-2 if c["acc"] == "float16" else CHECK):
            raise runtime.CourseError(f"{name} gave a wrong result at n={n} (error {err:.2e})")
        t = bench.time_gpu(lambda: tc.gemm(A, B, C, kernel="tiled", config=name), repeats=repeats)
        rows.append({**c, **t.summary(), "tflops": t.tflops(2.0 * n**3), "check_error": err})
    lib = bench.time_gpu(lambda: cp.matmul(A, B), repeats=repeats).tflops(2.0 * n**3)
    for r in rows:
        r["of_cublas"] = r["tflops"] / lib
    return {"n": n, "cublas_fp16_tflops": lib, "rows": rows, **({"skipped": skipped} if skipped else {})}


def wgmma_plan(cc=None) -> list:
    """The rows wgmma_table measures on a GPU of compute capability ``cc`` (default: this GPU, or the faked one), as
    dicts of name, kind ("library" or "kernel"), config (the wgmma kernel's, or None) and group_m: cuBLAS FP16 and
    the tiled WMMA GEMM on every GPU; on compute capability 9.0 also every wgmma configuration and the default's
    block orders."""
    plan = [{"name": "cuBLAS FP16 (tensor cores)", "kind": "library", "config": None, "group_m": None},
            {"name": f"WMMA, tiled ({tc.default_tiled('float32', cc)})", "kind": "kernel", "config": None,
             "group_m": None}]
    if gpus.supports("wgmma", cc):
        plan += [{"name": label, "kind": "kernel", "config": name, "group_m": tc.WGMMA_GROUP_M}
                 for name, label in WGMMA_STEPS.items()]
        plan += [{"name": f"4 stages, group_m = {g}", "kind": "kernel", "config": tc.DEFAULT_WGMMA, "group_m": g}
                 for g in (1, 4, 16)]
    return plan


def wgmma_skipped(cc=None) -> str | None:
    """Why wgmma_table has no wgmma rows on a GPU of compute capability ``cc`` (one line), or None where it has."""
    return gpus.missing("wgmma", cc, what="the wgmma GEMM")


def wgmma_table(n: int | None = None, repeats: int = 10) -> dict:
    """Hopper's warpgroup MMA fed by the TMA (kernels/cuda/tensor_cores_wgmma.cu), every configuration on
    n x n x n, beside cuBLAS FP16 and the lesson's tiled WMMA kernel, each checked against the FP32 product
    first; plus the block order (group_m) of the default configuration: the rows of wgmma_plan. The wgmma rows
    need compute capability 9.0: on another GPU the table holds cuBLAS and WMMA alone (the GEMMs lesson 5 reads its
    convolution against) and "skipped" says why."""
    cp = runtime.cupy()
    n = n or runtime.size("tensor_cores.n")
    A, B, ref = _operands(n, cp.float16)
    Bt = cp.ascontiguousarray(B.T) if gpus.supports("wgmma") else None
    C = cp.empty((n, n), cp.float32)
    L = cp.empty((n, n), cp.float16)
    C16 = cp.empty((n, n), cp.float16) if gpus.supports("wgmma") else None  # the FP16-output kernels' C
    flops = 2.0 * n**3

    def launcher(row):
        if row["kind"] == "library":
            return lambda: cp.matmul(A, B, out=L), L
        if row["config"] is None:
            wmma = row["name"].removeprefix("WMMA, tiled (").removesuffix(")")
            return lambda: tc.gemm(A, B, C, kernel="tiled", config=wmma), C
        c = tc.wgmma_config(row["config"])
        Bop = B if c["b_layout"] == "kn" else Bt
        out = C16 if c["out"] == "float16" else C
        return lambda: tc.gemm_wgmma(A, Bop, out, config=row["config"], group_m=row["group_m"]), out

    rows = []
    for row in bench.progress(wgmma_plan(), desc="wgmma"):
        launch, out = launcher(row)
        out.fill(cp.nan)
        launch()
        err = tc.rel_error(out, ref)
        if not err <= (5e-3 if row["kind"] == "library" else wgmma_check(row["config"])):
            raise runtime.CourseError(f"{row['name']} gave a wrong result at n={n} (error {err:.2e}); not timing it")
        t = bench.time_gpu(launch, repeats=repeats, hold_ms=WGMMA_HOLD_MS)
        rows.append({**row, **t.summary(), "tflops": t.tflops(flops), "check_error": err})
    lib = rows[0]["tflops"]
    for r in rows:
        r["of_cublas"] = r["tflops"] / lib
    out = {"n": n, "cublas_fp16_tflops": lib, "default": tc.DEFAULT_WGMMA, "rows": rows}
    if wgmma_skipped():
        out["skipped"] = wgmma_skipped()
    return out


def wgmma_rows(table: dict) -> list:
    """The rows of a wgmma table (wgmma_table, measured or recorded) that ran a wgmma kernel: none where the GPU
    has no wgmma, or where the table was recorded without them."""
    return [r for r in table.get("rows", []) if r.get("config") in tc.WGMMA_CONFIGS]


# cuBLAS's FP8 GEMM (torch._scaled_mm) by accumulation: each FP8 kernel is set against the one that sums as it does
CUBLAS_FP8 = {"promoted": "cuBLAS FP8 (torch._scaled_mm)", "fast": "cuBLAS FP8, fast accumulation"}


def fp8_plan(cc=None, torch_fp8: bool = True) -> list:
    """The rows fp8_table measures, as dicts of name, kind ("library" or "kernel"), precision and config: cuBLAS FP16
    and the course's FP16 wgmma GEMM, cuBLAS's FP8 GEMM (through ``torch._scaled_mm``, where ``torch_fp8``: with
    and without its fast accumulation), and every FP8 configuration of kernels/cuda/tensor_cores_fp8.cu. Empty
    where the GPU has no wgmma."""
    if not gpus.supports("wgmma", cc):
        return []
    plan = [{"name": "cuBLAS FP16", "kind": "library", "precision": "fp16", "config": None},
            {"name": "wgmma FP16 (the lesson's Hopper GEMM)", "kind": "kernel", "precision": "fp16",
             "config": tc.DEFAULT_WGMMA}]
    if torch_fp8:
        plan += [{"name": name, "kind": "library", "precision": "fp8", "config": accumulate}
                 for accumulate, name in CUBLAS_FP8.items()]
    plan += [{"name": fp8_row_name(c), "kind": "kernel", "precision": "fp8", "config": c} for c in F.FP8_CONFIGS]
    return plan


def fp8_row_name(config: str) -> str:
    """The name fp8_table gives an FP8 configuration's row: tile and accumulation, "persistent, TMA store" for the
    persistent kernels, whose C leaves by the TMA, "persistent, clusters of 2" for the same kernel in clusters and
    "persistent, stream-K tail" for it with the last wave shared out by slices."""
    c = F.fp8_config(config)
    kind = (f", persistent, clusters of {c['cluster']}" if c["cluster"] > 1 else
            ", persistent, stream-K tail" if c["stream_k"] else ", persistent, TMA store")
    return f"wgmma FP8, {c['bm']} x {c['bn']}, {c['accumulate']}" + (kind if c["persistent"] else "")


def fp8_table(n: int | None = None, repeats: int = 10) -> dict:
    """FP8 against FP16 on n x n x n (compute capability 9.0): cuBLAS FP16, the lesson's FP16 wgmma GEMM, cuBLAS's
    FP8 GEMM (``torch._scaled_mm``, where PyTorch is installed) and the FP8 wgmma GEMM of each configuration, on the
    same N(0, 1) inputs quantised with one scale per tensor, FP16 output. Every FP8 result is checked first against
    the FP32 product of the dequantised operands; TFLOP/s, and each FP8 row's ratio to cuBLAS's FP8 GEMM with the
    same accumulation. "skipped" says why where the GPU has no wgmma."""
    out = {"n": n, "rows": []}
    if wgmma_skipped():
        return {**out, "skipped": gpus.missing("wgmma", what="the FP8 GEMM")}
    cp = runtime.cupy()
    torch = _torch_cuda()
    torch = torch if torch is not None and hasattr(torch, "float8_e4m3fn") else None  # cuBLAS's FP8 GEMM needs it
    n = n or runtime.size("tensor_cores.n")
    runtime.check_fits(n * n * (4 * 3 + 2 * 4 + 1 * 2), f"a {n}^3 FP8 GEMM")
    rs = cp.random.RandomState(3)
    X, Y = rs.standard_normal((n, n), dtype=cp.float32), rs.standard_normal((n, n), dtype=cp.float32)
    (A8, sa), (B8, sb) = F.quantize_fp8_gpu(X), F.quantize_fp8_gpu(Y)  # Y is B transposed: N x K
    table = cp.asarray(F.from_e4m3(np.arange(256, dtype=np.uint8)).astype(np.float32))
    ref = cp.matmul(table[A8] * sa, (table[B8] * sb).T)
    A16, Bt16 = X.astype(cp.float16), cp.ascontiguousarray(Y.T.astype(cp.float16))
    del X, Y
    C16, C32 = cp.empty((n, n), cp.float16), cp.empty((n, n), cp.float32)
    if torch is not None:
        ta, tb = (torch.from_dlpack(x).view(torch.float8_e4m3fn) for x in (A8, B8))
        tsa, tsb = torch.from_dlpack(sa).reshape(()), torch.from_dlpack(sb).reshape(())

    def launcher(row):
        if row["precision"] == "fp16":
            if row["kind"] == "library":
                return lambda: cp.matmul(A16, Bt16, out=C16)
            return lambda: tc.gemm_wgmma(A16, Bt16, C32, config=row["config"])
        if row["kind"] == "library":
            fast = row["config"] == "fast"
            return lambda: torch._scaled_mm(ta, tb.t(), scale_a=tsa, scale_b=tsb, out_dtype=torch.float16,
                                            use_fast_accum=fast)
        return lambda: F.gemm_fp8(A8, B8, sa, sb, C16, config=row["config"])

    flops = 2.0 * n**3
    for row in bench.progress(fp8_plan(torch_fp8=torch is not None), desc="fp8"):
        launch = launcher(row)
        if row["precision"] == "fp8":  # checked before it is timed: a wrong layout or scale errs by order 1; "fast"
            C16.fill(cp.nan)           # accumulation keeps fewer bits than FP32 over the whole K (up to 2% seen)
            err = tc.rel_error(cp.from_dlpack(launch()).astype(cp.float32), ref)
            fast = row["config"] == "fast" or (row["kind"] == "kernel" and F.fp8_config(row["config"])["accumulate"]
                                               == "fast")
            if not err <= (5e-2 if fast else 2.0**-9):
                raise runtime.CourseError(f"{row['name']} gave a wrong result at n={n} (error {err:.2e}); not "
                                          "timing it")
            row = {**row, "check_error": err}
        t = bench.time_gpu(launch, repeats=repeats, hold_ms=WGMMA_HOLD_MS)
        out["rows"].append({**row, **t.summary(), "tflops": t.tflops(flops)})
    by = {r["name"]: r["tflops"] for r in out["rows"]}
    for r in out["rows"]:
        r["of_cublas_fp16"] = r["tflops"] / by["cuBLAS FP16"]
        if r["kind"] == "kernel" and r["precision"] == "fp8" and CUBLAS_FP8[F.fp8_config(r["config"])["accumulate"]] in by:
            r["of_cublas_fp8"] = r["tflops"] / by[CUBLAS_FP8[F.fp8_config(r["config"])["accumulate"]]]
    out.update(n=n, torch=getattr(torch, "__version__", None))
    if torch is None:
        out["note"] = "no cuBLAS FP8 rows: PyTorch with CUDA and FP8 is not installed"
    return out


def format_fp8_table(table: dict) -> str:
    """fp8_table's figures as a table: each row's ms, TFLOP/s and ratios to cuBLAS FP16 and to cuBLAS's FP8 GEMM
    with the same accumulation."""
    if table.get("skipped"):
        return f"FP8 GEMM: {table['skipped']}"
    body = [[r["name"], r["median_ms"], r["tflops"], f"{r['of_cublas_fp16']:.2f}",
             f"{r['of_cublas_fp8']:.2f}" if "of_cublas_fp8" in r else None] for r in table["rows"]]
    return str(plots.table(["GEMM", "ms", "TFLOP/s", "x cuBLAS FP16", "x cuBLAS FP8"], body, align="lrrrr",
                           title=f"FP8 GEMM, {table['n']}^3, FP16 output"
                                 + (f" ({table['note']})" if table.get("note") else "")))


def wgmma_reading(table: dict) -> list:
    """What the deep dive of lesson 4 says of the steps table (figure "wgmma") beyond its bullets: the persistent FP16
    kernel with the TMA store in clusters of 2 sharing B is no faster than the same kernel alone. [(statement, True,
    False or None)]; a records test asserts it on every record."""
    by = {r.get("config"): r for r in table.get("rows", []) if r.get("config")}
    alone = "wgmma_128x256x64_s4_kn_persistent_f16_tmastore"
    return [claims.compare("the persistent FP16 kernel with the TMA store in clusters of 2 (B multicast)",
                           "no faster than", "it alone", lambda: by[alone + "_c2"]["tflops"],
                           lambda: by[alone]["tflops"])]


def fp8_reading(table: dict) -> list:
    """What the deep dive of lesson 4 says of the FP8 GEMM (section 5), each statement with whether it holds in
    ``table`` (a run's or a record's figure "fp8"): [(statement, True, False or None)]. A records test asserts every
    statement on every record."""
    rows = table.get("rows", [])
    by = {r["name"]: r for r in rows}
    ours = [r for r in rows if r["kind"] == "kernel" and r["precision"] == "fp8"]

    def cfg(accumulate, bn):  # the one-tile-per-block kernel of that tile and accumulation
        return next(r["tflops"] for r in ours if F.fp8_config(r["config"])["accumulate"] == accumulate
                    and F.fp8_config(r["config"])["bn"] == bn and not F.fp8_config(r["config"])["persistent"])

    def clustered(r):  # a kernel in thread-block clusters (absent from the records made before there was one)
        return F.fp8_config(r["config"])["cluster"] > 1

    def persistent(accumulate, bn):  # the persistent kernel of that tile and accumulation: one block, no cluster,
        return next(r for r in ours if F.fp8_config(r["config"])["accumulate"] == accumulate  # no stream-K tail
                    and F.fp8_config(r["config"])["bn"] == bn and F.fp8_config(r["config"])["persistent"]
                    and not clustered(r) and not F.fp8_config(r["config"])["stream_k"])

    def stream_k():  # the persistent kernel with a stream-K tail (absent from the records made before there was one)
        return next(r for r in ours if F.fp8_config(r["config"])["stream_k"])

    return [
        ("the fastest FP8 kernel: faster than cuBLAS FP16 and than the lesson's FP16 kernel",
         claims.holds(lambda: max(r["tflops"] for r in ours) > max(by["cuBLAS FP16"]["tflops"],
                                                                  by["wgmma FP16 (the lesson's Hopper GEMM)"]["tflops"])
                      if ours else None)),
        ("every FP8 kernel of one tile a block: short of cuBLAS's FP8 GEMM with the same accumulation",
         claims.holds(lambda: all(r["of_cublas_fp8"] < 1.0 for r in ours
                                  if not F.fp8_config(r["config"])["persistent"]) if ours else None)),
        claims.compare("the persistent 128 x 256 kernel (fast, C stored by the TMA)", "level with",
                       "cuBLAS's FP8 GEMM with fast accumulation", lambda: persistent("fast", 256)["of_cublas_fp8"], 1.0,
                       margin=0.02),
        ("each persistent FP8 kernel: faster than the same tile and accumulation one tile a block",
         claims.holds(lambda: all(r["tflops"] > cfg(F.fp8_config(r["config"])["accumulate"],
                                                    F.fp8_config(r["config"])["bn"]) for r in ours
                                  if F.fp8_config(r["config"])["persistent"] and not clustered(r)) if ours else None)),
        ("on the 128 x 128 tile, fast accumulation: faster than promoted",
         claims.holds(lambda: cfg("fast", 128) > cfg("promoted", 128) if ours else None)),
        claims.compare("the same kernel in clusters of 2 (B multicast by the TMA)", "level with", "it alone",
                       lambda: next(r for r in ours if clustered(r))["tflops"], lambda: persistent("fast", 256)["tflops"],
                       margin=0.02),
        claims.compare("the same kernel with a stream-K tail", "no slower than", "it alone",
                       lambda: stream_k()["tflops"], lambda: persistent("fast", 256)["tflops"], margin=0.005,
                       how="(within half a percent)"),
        claims.compare("the same kernel with a stream-K tail", "no slower than",
                       "cuBLAS's FP8 GEMM with fast accumulation", lambda: stream_k()["of_cublas_fp8"], 1.0),
        ("every FP8 kernel's error: at most 1.1x cuBLAS's FP8 GEMM's with the same accumulation",
         claims.holds(lambda: all(r["check_error"] <= 1.1 * by[CUBLAS_FP8[F.fp8_config(r["config"])["accumulate"]]]["check_error"]
                                  for r in ours) if ours else None)),
    ]


# The GEMMs of a transformer layer's linear parts, as (name, K, N) in units of the model width d, for M = tokens: the
# Q, K and V projections side by side (d -> 3d), the MLP's up projection (d -> 4d) and its down projection (4d -> d).
TRANSFORMER_GEMMS = (("QKV projection", 1, 3), ("MLP up", 1, 4), ("MLP down", 4, 1))


def transformer_shapes(tokens: int = 8192, ds=(768, 4096)) -> list:
    """The GEMMs transformer_table measures, as dicts of d, name, M, K, N: (tokens x K) @ (K x N) for each model width
    d in ``ds`` and each of TRANSFORMER_GEMMS."""
    if tokens < 1 or not ds or any(d < 1 or d % 8 for d in ds):
        raise runtime.CourseInputError(f"tokens must be positive and every width d a positive multiple of 8 (the TMA "
                                       f"reads whole 16-byte rows); got tokens = {tokens}, ds = {tuple(ds)}")
    return [{"d": d, "name": name, "M": tokens, "K": k * d, "N": n * d} for d in ds for name, k, n in TRANSFORMER_GEMMS]


def transformer_plan(torch_ok: bool, configs=None, cc=None) -> list:
    """The rows transformer_table measures for each GEMM, as dicts of name, kind ("library" or "kernel") and config:
    cuBLAS FP16 (cupy.matmul), PyTorch's torch.matmul where ``torch_ok``, and each FP16-output wgmma configuration of
    ``configs`` (default: every one in WGMMA_CONFIGS of one block, not a cluster: the cluster kernel is set against the
    persistent one at 8192^3, in wgmma_table) where the GPU (``cc``) has wgmma. All write FP16 C."""
    configs = [c for c in tc.WGMMA_CONFIGS if tc.wgmma_config(c)["out"] == "float16"
               and tc.wgmma_config(c)["cluster"] == 1] if configs is None else configs
    for c in configs:
        if tc.wgmma_config(c)["out"] != "float16":
            raise runtime.CourseInputError(f"{c} writes FP32 C; the transformer table compares FP16-output GEMMs")
    plan = [{"name": "cuBLAS FP16 (cupy.matmul)", "kind": "library", "config": None}]
    if torch_ok:
        plan.append({"name": "PyTorch (torch.matmul)", "kind": "library", "config": None})
    if gpus.supports("wgmma", cc):
        plan += [{"name": f"wgmma: {WGMMA_STEPS.get(c, c)}", "kind": "kernel", "config": c} for c in configs]
    return plan


def _torch_cuda():
    """PyTorch with CUDA, or None: the transformer table's PyTorch rows are skipped without it."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def transformer_table(tokens: int = 8192, ds=(768, 4096), *, configs=None, repeats: int = 12) -> dict:
    """The GEMMs of a transformer layer (transformer_shapes: the QKV projection, the MLP's up and down projections of
    ``tokens`` tokens for each model width d in ``ds``), FP16 in and FP16 out, through cuBLAS (cupy.matmul),
    PyTorch's torch.matmul (where PyTorch with CUDA is installed) and the course's FP16-output wgmma kernels
    (``configs``, default every one; compute capability 9.0). Each result is checked against the FP32 product first,
    then all of a shape's rows are timed in turns; TFLOP/s and each row's ratio to cuBLAS."""
    cp = runtime.cupy()
    torch = _torch_cuda()
    shapes = transformer_shapes(tokens, ds)
    plan = transformer_plan(torch is not None, configs)
    out = {"tokens": tokens, "ds": list(ds), "torch": getattr(torch, "__version__", None), "shapes": []}
    sms = runtime.get().device.get("sms")
    tiles = [c for c in tc.PERSISTENT_TILES if any(r["config"] == c for r in plan)]
    if tiles and sms:  # the tile persistent_tile picks for each shape, beside the sweep of every tile (the check)
        out.update(sms=sms, tiles=tiles)
    if torch is None:
        out["note"] = "no PyTorch rows: PyTorch with CUDA is not installed"
    if wgmma_skipped():
        out["skipped"] = wgmma_skipped()
    rs = cp.random.RandomState(0)
    for shape in bench.progress(shapes, desc="transformer GEMMs"):
        M, K, N = shape["M"], shape["K"], shape["N"]
        # A, B in FP16 and FP32, C in FP16 for each row, the FP32 reference, and the float64 copies of the check
        runtime.check_fits((M * K + K * N) * 6 + M * N * (2 * len(plan) + 4 + 3 * 8), f"the GEMM {M} x {K} x {N}")
        A = (rs.random_sample((M, K), dtype=cp.float32) * 2 - 1).astype(cp.float16)
        B = (rs.random_sample((K, N), dtype=cp.float32) * 2 - 1).astype(cp.float16)
        ref = cp.matmul(A.astype(cp.float32), B.astype(cp.float32))
        works, checks = {}, {}
        for row in plan:
            C = cp.empty((M, N), cp.float16)
            if row["config"] is not None:
                work = (lambda C, cfg: lambda: tc.gemm_wgmma(A, B, C, config=cfg))(C, row["config"])
            elif row["name"].startswith("PyTorch"):
                ta, tb, tcc = torch.from_dlpack(A), torch.from_dlpack(B), torch.from_dlpack(C)
                work = (lambda ta, tb, tcc: lambda: torch.matmul(ta, tb, out=tcc))(ta, tb, tcc)
            else:
                work = (lambda C: lambda: cp.matmul(A, B, out=C))(C)
            C.fill(cp.nan)
            work()
            err = tc.rel_error(C, ref)
            limit = 5e-3 if row["kind"] == "library" else wgmma_check(row["config"])
            if not err <= limit:
                raise runtime.CourseError(f"{row['name']} gave a wrong result on {M} x {K} x {N} (error {err:.2e}); "
                                          "not timing it")
            works[row["name"]], checks[row["name"]] = work, err
        del ref
        times = bench.time_in_turns(works, rounds=3, repeats=repeats, hold_ms=WGMMA_HOLD_MS)
        flops = 2.0 * M * N * K
        rows = [{**row, **times[row["name"]].summary(), "tflops": times[row["name"]].tflops(flops),
                 "check_error": checks[row["name"]]} for row in plan]
        for r in rows:
            r["of_cublas"] = r["tflops"] / rows[0]["tflops"]
        rule = {"rule": tc.persistent_tile(M, N, sms, tiles)} if "tiles" in out else {}
        out["shapes"].append({**shape, **rule, "rows": rows})
        del A, B, works
        cp.get_default_memory_pool().free_all_blocks()
    return out


TRANSFORMER_SHORT = {"cuBLAS FP16 (cupy.matmul)": "cuBLAS TFLOP/s", "PyTorch (torch.matmul)": "PyTorch",
                     "wgmma_128x256x64_s4_kn_persistent_f16": "wgmma, C by threads",
                     "wgmma_128x256x64_s4_kn_persistent_f16_tmastore": "wgmma, C by the TMA",
                     "wgmma_128x256x64_s4_kn_persistent_f16_tmastore_wait1": "wait 1, 128x256",
                     "wgmma_128x192x64_s4_kn_persistent_f16_tmastore_wait1": "wait 1, 128x192",
                     "wgmma_128x128x64_s6_kn_persistent_f16_tmastore_wait1": "wait 1, 128x128"}


# the table's narrower column heads (format_transformer_table), each explained in a line under the table
TRANSFORMER_COLUMN = {"cuBLAS TFLOP/s": "cuBLAS", "PyTorch": "torch", "wgmma, C by threads": "threads",
                      "wgmma, C by the TMA": "TMA", "wait 1, 128x256": "w1 256", "wait 1, 128x192": "w1 192",
                      "wait 1, 128x128": "w1 128"}
TRANSFORMER_LEGEND = (("threads", "threads: the persistent 128 x 256 kernel, C stored by its threads"),
                      ("TMA", "TMA: the same, C stored by the TMA"),
                      ("w1 256", "w1 BN: the same with one slice's MMAs left running, in tiles of 128 x BN"),
                      ("rule", "rule: the tile tc.persistent_tile picks (BN: x cuBLAS)"))


def _transformer_short(row) -> str:
    """A transformer_table row's column: by its configuration where it has one (a library row: by its name; a name
    alone, as records before the configurations were kept name them: by its words)."""
    if isinstance(row, dict):
        if row.get("config") in TRANSFORMER_SHORT:
            return TRANSFORMER_SHORT[row["config"]]
        row = row["name"]
    if row in TRANSFORMER_SHORT:
        return TRANSFORMER_SHORT[row]
    return "wgmma, C by the TMA" if "TMA store" in row else "wgmma, C by threads" if "FP16 C" in row else row[:24]


def format_transformer_table(table: dict) -> str:
    """transformer_table's figures as a table: a row per GEMM, cuBLAS's TFLOP/s, then each other contender's time
    over cuBLAS's as a ratio of speeds (x cuBLAS); where the table has the persistent tiles, last the tile that
    persistent_tile picks for the GEMM and its ratio."""
    notes = [x for x in (table.get("note"), table.get("skipped")) if x]
    names = list(dict.fromkeys(r["name"] for sh in table["shapes"] for r in sh["rows"]))
    first = {r["name"]: r for sh in table["shapes"] for r in sh["rows"]}
    ruled = any("rule" in sh for sh in table["shapes"])
    body = []
    for sh in table["shapes"]:
        rows = {r["name"]: r for r in sh["rows"]}
        rule = next((r for r in sh["rows"] if r.get("config") == sh.get("rule")), None)
        body.append([f"{sh['d']}, {sh['name'].removesuffix(' projection')} ({sh['K']} x {sh['N']})",
                     *(None if n not in rows else rows[n]["tflops"] if n.startswith("cuBLAS")
                       else f"{rows[n]['of_cublas']:.2f}" for n in names),
                     *([None if rule is None else f"{tc.wgmma_config(rule['config'])['bn']}: {rule['of_cublas']:.2f}"]
                       if ruled else [])])
    heads = ["d, GEMM (K x N)", *(TRANSFORMER_COLUMN.get(s, s) for s in map(_transformer_short, first.values())),
             *(["rule"] if ruled else [])]
    legend = "; ".join(text for head, text in TRANSFORMER_LEGEND if head in heads)
    title = (f"A transformer layer's GEMMs, {table['tokens']:,} tokens, FP16 in and out: cuBLAS's TFLOP/s, the others "
             "x cuBLAS" + (f" ({'; '.join(notes)})" if notes else ""))
    text = str(plots.table(heads, body, align="l" + "r" * (len(heads) - 1), title=plots.wrap(title, 100, "")))
    return text + ("\n" + plots.wrap(legend, 100, "") if legend else "")


def transformer_reading(table: dict) -> list:
    """What the deep dive of lesson 4 says of the transformer GEMMs (section 5), each statement with whether it
    holds in ``table`` (a run's or a record's figure "transformer"). A records test asserts every statement on every
    record. Where the table has the persistent tiles (tc.PERSISTENT_TILES) and the rule's pick for each GEMM, two more:
    the rule against the sweep, and the issue's goal."""
    shapes = [{_transformer_short(r): r for r in sh["rows"]} for sh in table.get("shapes", [])]
    have = [s for s in shapes if "wgmma, C by the TMA" in s and "wgmma, C by threads" in s]
    gain = {(sh["d"], sh["name"]): s["wgmma, C by the TMA"]["tflops"] / s["wgmma, C by threads"]["tflops"]
            for sh, s in zip(table.get("shapes", []), shapes) if s in have}
    gains = {d for d, _ in gain}
    return [
        ("the TMA store: faster than the same kernel's stores from its threads on every GEMM",
         claims.holds(lambda: all(s["wgmma, C by the TMA"]["tflops"] > s["wgmma, C by threads"]["tflops"]
                                  for s in have) if have else None)),
        ("with the TMA store: at 0.95 of cuBLAS or more on most GEMMs",
         claims.holds(lambda: 2 * sum(s["wgmma, C by the TMA"]["of_cublas"] >= 0.95 for s in have) > len(have)
                      if have else None)),
        ("with the TMA store: under 0.95 of cuBLAS on some GEMM",
         claims.holds(lambda: any(s["wgmma, C by the TMA"]["of_cublas"] < 0.95 for s in have) if have else None)),
        ("the TMA store's gain over the threads' stores: larger at the smaller width, GEMM for GEMM",
         claims.holds(lambda: all(gain[min(table["ds"]), g] > gain[max(table["ds"]), g]
                                  for g in {g for _, g in gain}) if len(gains) > 1 else None)),
    ] + tile_reading(table)


TILE_RULE_SLACK = 0.05  # tile_reading: the rule's tile may be this much slower than the fastest tile measured


def tile_reading(table: dict) -> list:
    """The tile rule (tc.persistent_tile) against the sweep of the persistent tiles in ``table`` (transformer_table's),
    and the goal (every GEMM at 0.95 of cuBLAS or more with the rule's tile): [(statement, holds)], none where the
    table has no rule (recorded before it, or on a GPU without wgmma)."""
    ruled = [sh for sh in table.get("shapes", []) if "rule" in sh]
    if not ruled:
        return []

    def of(sh, config):
        return next(r for r in sh["rows"] if r.get("config") == config)

    def fastest(sh):
        return max(of(sh, c)["tflops"] for c in table["tiles"])

    return [
        (f"the rule's tile: within {TILE_RULE_SLACK:.0%} of the fastest tile measured, on every GEMM",
         claims.holds(lambda: all(of(sh, sh["rule"])["tflops"] >= (1 - TILE_RULE_SLACK) * fastest(sh) for sh in ruled))),
        ("with the rule's tile: at 0.95 of cuBLAS or more on every GEMM",
         claims.holds(lambda: all(of(sh, sh["rule"])["of_cublas"] >= 0.95 for sh in ruled))),
        ("one slice's MMAs left running: within 2% of the same tile without it, on every GEMM",
         claims.every([(of(sh, c), of(sh, c.removesuffix("_wait1"))) for sh in ruled for c in table["tiles"]
                       if any(r.get("config") == c.removesuffix("_wait1") for r in sh["rows"])],
                      lambda pair: abs(pair[0]["tflops"] / pair[1]["tflops"] - 1) <= 0.02)),
    ]


def size_sweep(sizes=None, repeats: int = 10, config: str | None = None) -> dict:
    """TFLOP/s against n for the tensor-core and FP32 kernels and their cuBLAS counterparts."""
    cp = runtime.cupy()
    sizes = sizes or runtime.size("tensor_cores.sweep")
    config = config or tc.default_tiled("float32")
    series = {k: [] for k in ("WMMA, one warp per tile", "WMMA, tiled", "cuBLAS FP16", "CUDA C, register tiles",
                              "cuBLAS FP32")}
    for n in bench.progress(sizes, desc="sizes"):
        A16, B16, _ = _operands(n, cp.float16)
        A32, B32, _ = _operands(n, cp.float32)
        C = cp.empty((n, n), cp.float32)
        launches = {"WMMA, one warp per tile": lambda: tc.gemm(A16, B16, C, kernel="naive"),
                    "WMMA, tiled": lambda: tc.gemm(A16, B16, C, kernel="tiled", config=config),
                    "cuBLAS FP16": lambda: cp.matmul(A16, B16),
                    "CUDA C, register tiles": lambda: tc.gemm(A32, B32, C, kernel="simt_128x128"),
                    "cuBLAS FP32": lambda: cp.matmul(A32, B32)}
        for name, launch in launches.items():
            t = bench.time_per_call(launch, batch=max(1, 2**27 // n**2 // 8), repeats=repeats) if n <= 2048 \
                else bench.time_gpu(launch, repeats=repeats)
            series[name].append(t.tflops(2.0 * n**3))
        launches.clear()
    return {"sizes": list(sizes), "config": config, "tflops": series}


def error_table(n: int | None = None, config: str | None = None) -> dict:
    """Each kernel's error against float64 on n x n x n with inputs uniform in [0, 1) (one sign: no
    cancellation hides the rounding): against the exact product of the values the kernel multiplied
    (FP16-rounded for tensor-core kernels: accumulation error only), and against the float64 product of
    the FP32 originals (input rounding too)."""
    cp = runtime.cupy()
    n = n or runtime.size("tensor_cores.check_n")
    config = config or tc.default_tiled("float32")
    rs = cp.random.RandomState(7)
    A = rs.random_sample((n, n), dtype=cp.float32)
    B = rs.random_sample((n, n), dtype=cp.float32)
    A16, B16 = A.astype(cp.float16), B.astype(cp.float16)
    exact32 = cp.matmul(A.astype(cp.float64), B.astype(cp.float64))
    exact16 = cp.matmul(A16.astype(cp.float64), B16.astype(cp.float64))

    def err(C, ref):
        C = C.astype(cp.float64)
        return float(cp.abs(C - ref).max() / cp.abs(ref).max()) if bool(cp.isfinite(C).all()) else math.inf

    nA, nB = runtime.cuda().as_cuda_array(A), runtime.cuda().as_cuda_array(B)
    rows = []

    def add(name, precision, C, fp16_inputs):
        rows.append({"name": name, "precision": precision,
                     "vs_inputs_as_used": err(C, exact16 if fp16_inputs else exact32),
                     "vs_fp32_inputs": err(C, exact32),
                     "tolerance": tc.tolerance(precision, n)})

    C = cp.empty((n, n), cp.float32)
    tc.gemm_numba(nA, nB, runtime.cuda().as_cuda_array(C), kernel="numba_tiled")
    add("numba, shared-memory tiles 16x16", "float32", C, False)
    tc.gemm(A, B, C, kernel="simt_128x128")
    add("CUDA C, register tiles 128x128", "float32", C, False)
    add("cuBLAS FP32", "float32", cp.matmul(A, B), False)
    add("cuBLAS TF32", "tf32", tc.gemm_library(A, B, tf32=True), False)
    tc.gemm(A16, B16, C, kernel="naive")
    add("WMMA, one warp per tile", "fp16_inputs_fp32_acc", C, True)
    tc.gemm(A16, B16, C, kernel="tiled", config=config)
    add("WMMA, tiled", "fp16_inputs_fp32_acc", C, True)
    C16 = cp.empty((n, n), cp.float16)
    tc.gemm(A16, B16, C16, kernel="naive")
    add("WMMA, one warp per tile, FP16 accumulation", "fp16_acc", C16, True)
    tc.gemm(A16, B16, C16, kernel="tiled", config=tc.default_tiled("float16"))
    add("WMMA, tiled, FP16 accumulation", "fp16_acc", C16, True)
    add("cuBLAS FP16 (FP16 output)", "fp16_output", cp.matmul(A16, B16), True)
    return {"n": n, "inputs": "uniform [0, 1)", "rows": rows}


def accumulation_on_gpu(ks=(16, 64, 256, 1024, 4096, 16384), m: int = 128, seed: int = 0) -> dict:
    """The K sweep of the notebook's NumPy model, run on the tensor cores (one warp per tile, FP32 and FP16
    accumulation) with the same inputs, beside the model's figures."""
    cp = runtime.cupy()
    model = tc.accumulation_error(ks, m=m, n=m, seed=seed)
    rng = np.random.default_rng(seed)
    out = {"k": list(ks), "m": m, "gpu_fp32_acc": [], "gpu_fp16_acc": [], "model": model}
    for k in ks:
        A, B = rng.random((m, k)), rng.random((k, m))  # the same draws as accumulation_error makes
        A16, B16 = A.astype(np.float16), B.astype(np.float16)
        ref = tc.gemm_spec(A16, B16)
        dA, dB = cp.asarray(A16), cp.asarray(B16)
        for acc, key in (("float32", "gpu_fp32_acc"), ("float16", "gpu_fp16_acc")):
            C = cp.empty((m, m), acc)
            tc.gemm(dA, dB, C, kernel="naive")
            out[key].append(tc.rel_error(C.get(), ref))
    return out


def peak_table(kernels: dict | None = None) -> dict:
    """The slide's formula for this GPU beside what cuBLAS reaches."""
    dev = runtime.get().device
    peak = tc.peak_for(dev)
    fp32 = tc.fp32_simt_peak_tflops(dev["sms"], peak["clock_mhz"])
    return {"formula": peak, "fp32_simt_peak_tflops": fp32,
            "gv100": {**tc.GV100_SLIDE, "tflops": tc.peak_tflops(**tc.GV100_SLIDE)}}


def run() -> tuple:
    """Every measurement of the lesson: (figures, ceilings), for `python -m gpucourse record`."""
    ceilings = bench.measure_ceilings().as_dict()
    figures = {"peak": peak_table()}
    figures["configs"] = config_table()
    best = max((r for r in figures["configs"]["rows"] if r["acc"] == "float32"), key=lambda r: r["tflops"])
    best16 = max((r for r in figures["configs"]["rows"] if r["acc"] == "float16"), key=lambda r: r["tflops"])
    figures["kernels"] = kernel_table(config=best["name"], config16=best16["name"])
    runtime.cupy().get_default_memory_pool().free_all_blocks()
    figures["wgmma"] = wgmma_table()
    runtime.cupy().get_default_memory_pool().free_all_blocks()
    figures["sizes"] = size_sweep(config=best["name"])
    figures["errors"] = error_table(config=best["name"])
    figures["accumulation"] = accumulation_on_gpu()
    runtime.cupy().get_default_memory_pool().free_all_blocks()
    figures["fp8"] = fp8_table()
    figures["transformer"] = transformer_table()
    runtime.cupy().get_default_memory_pool().free_all_blocks()
    return figures, ceilings


# ------------------------------------------------------------------------------------ text and plots

def accumulation_reading(acc: dict) -> list:
    """What notebook 04 says about accumulation on the tensor cores (``acc``: the figure "accumulation"): the FP16
    accumulator's error follows the model (within 1.5x at every K); the FP32 accumulator's grows about linearly
    with K (log-log slope within 20% of 1) and ends more than ten times the model's. [(statement, holds)]."""
    def farthest():
        return max(max(e / m, m / e) for e, m in zip(acc["gpu_fp16_acc"], acc["model"]["fp16_acc"]))
    return [
        claims.compare("FP16 accumulation, error against the model's, farthest ratio", "below", "1.5x", farthest, 1.5),
        claims.compare("FP32 accumulation, log-log slope of the error against K", "level with", "1 (linear)",
                       lambda: np.polyfit(np.log(acc["k"]), np.log(acc["gpu_fp32_acc"]), 1)[0], 1.0, 0.2),
        claims.compare(f"FP32 accumulation at K = {acc['k'][-1]}, error", "above", "10x the model's",
                       lambda: acc["gpu_fp32_acc"][-1], lambda: 10 * acc["model"]["fp32_acc"][-1]),
    ]


def config_reading(configs: dict, kernels: dict, compute_capability: str | None) -> list:
    """What notebook 04 says about the tiled kernel's configurations (``configs``, ``kernels``: the figures of one
    run): the 128x128x32 tile runs faster with two stages than with one; on Hopper (compute capability 9.0) the
    tiled WMMA kernel stays below half of cuBLAS FP16 in every configuration."""
    rows = {r["name"]: r for r in configs["rows"]}

    def tf(name):
        return lambda: rows[name]["tflops"]

    read = [claims.compare("tile 128x128x32, two stages (TFLOP/s)", "above", "one stage",
                           tf("wmma_tiled_128x128x32_w64x64_s2_f32"), tf("wmma_tiled_128x128x32_w64x64_s1_f32"))]
    if compute_capability == "9.0":
        def best():
            tiled = [r["of_cublas"] for r in kernels["rows"] if r["name"].startswith("WMMA, tiled (")]
            return max([r["of_cublas"] for r in configs["rows"]] + tiled)
        read.append(claims.compare("tiled WMMA on Hopper, best share of cuBLAS FP16", "below", "0.5", best, 0.5))
    return read


def size_reading(sizes: dict) -> list:
    """What notebook 04 says about size (``sizes``: the figure "sizes"): the tiled WMMA kernel runs slower at the
    smallest n than at the largest."""
    t, n = sizes["tflops"]["WMMA, tiled"], sizes["sizes"]
    return [claims.compare(f"WMMA, tiled at n = {n[0]} (TFLOP/s)", "below", f"at n = {n[-1]}", t[0], t[-1])]


def roofline_reading(kernels: dict, ceilings: dict) -> list:
    """What notebook 04 says about the roofline (``kernels``, ``ceilings`` of one run): the naive numba kernel runs
    above the memory roof at its point's intensity (the caches serve part of its traffic)."""
    naive = next((r for r in kernels["rows"] if r["name"] == "numba, naive"), {})
    return [claims.compare("numba, naive (TFLOP/s)", "above", "the memory roof at its point",
                           lambda: naive["tflops"], lambda: naive["intensity"] * ceilings["copy_gbps"] / 1000)]


def kernel_view(table: dict, source: str = "") -> plots.Table:
    """Every GEMM of kernel_table as a table: TFLOP/s, time, the share of cuBLAS of the same precision, and the
    FLOPs per byte the kernel's tiling asks of global memory."""
    rows = [[r["name"], r["precision"], r["tflops"], r["median_ms"],
             f"{r['of_cublas']:.2f}x {'FP32' if r['precision'] in ('FP32', 'TF32') else 'FP16'}", r["intensity"]]
            for r in table["rows"]]
    n = table["n"]
    return plots.table(["kernel", "inputs", "TFLOP/s", "ms", "of cuBLAS", "FLOP/B"], rows, source=source,
                       title=f"C = A B, {n} x {n} x {n} ({table['flops'] / 1e12:.2f} TFLOP a call)")


def kernel_text(table: dict) -> str:
    return (str(kernel_view(table)) + f"\ntensor cores over FP32 SIMT: cuBLAS {table['tc_vs_simt_cublas']:.1f}x, "
            f"this course's best kernels {table['tc_vs_simt_ours']:.1f}x")


def plot_kernels(table: dict, source: str, precision: str = "FP16"):
    """TFLOP/s of the FP32 rows (precision "FP32", against cuBLAS FP32) or the tensor-core rows ("FP16")."""
    if precision == "FP32":
        rows = [r for r in table["rows"] if r["precision"] in ("FP32", "TF32") and r["name"] != "cuBLAS FP32"]
        ceiling = next(r for r in table["rows"] if r["name"] == "cuBLAS FP32")
    else:
        rows = [r for r in table["rows"] if r["precision"] in ("FP16", "FP16 acc")
                and not r["name"].startswith("cuBLAS FP16")]
        ceiling = next(r for r in table["rows"] if r["name"].startswith("cuBLAS FP16"))
    return plots.bars({r["name"]: r["tflops"] for r in rows}, unit="TFLOP/s", source=source,
                      title=f"{precision} GEMM, n = {table['n']}", ceiling=(ceiling["name"], ceiling["tflops"]))


def plot_roofline(table: dict, ceilings: dict, peak: dict, source: str):
    points = {r["name"]: (r["intensity"], r["tflops"]) for r in table["rows"]
              if r["kind"] == "kernel" or r["name"].startswith("cuBLAS FP")}
    peaks = {f"FP16 tensor cores, formula ({peak['formula']['clock_mhz']:.0f} MHz)": peak["formula"]["tflops"],
             "FP16 tensor cores, cuBLAS": ceilings["fp16_tflops"], "FP32, cuBLAS": ceilings["fp32_tflops"]}
    return plots.roofline(bandwidth_gbps=ceilings["copy_gbps"], peaks_tflops=peaks, points=points, source=source,
                          title=f"GEMM kernels on the roofline (n = {table['n']}; intensity from each kernel's "
                                "tiling)")


def plot_configs(configs: dict, source: str):
    values = {f"{r['bm']}x{r['bn']}x{r['bk']}, {r['warps']} warps of {r['wm']}x{r['wn']}, {r['stages']} stage"
              f"{'s' if r['stages'] > 1 else ''}{', FP16 acc' if r['acc'] == 'float16' else ''}": r["tflops"]
              for r in configs["rows"]}
    return plots.bars(values, unit="TFLOP/s", source=source, title=f"Tiled WMMA configurations, n = {configs['n']}",
                      ceiling=("cuBLAS FP16", configs["cublas_fp16_tflops"]))


def wgmma_view(table: dict, source: str = "") -> plots.Table:
    """The wgmma table (wgmma_table) as a table; where the GPU has no wgmma, cuBLAS and WMMA alone, and the title
    says why."""
    rows = [[r["name"], r["tflops"], r["median_ms"], f"{r['of_cublas']:.2f}x"] for r in table["rows"]]
    title = f"C = A B, {table['n']}^3, FP16 inputs, FP32 accumulation"
    if table.get("skipped"):
        title += f" (no wgmma rows: {table['skipped']})"
    return plots.table(["kernel", "TFLOP/s", "ms", "of cuBLAS"], rows, title=title, source=source)


def wgmma_text(table: dict) -> str:
    if not table["rows"]:  # recorded before a GPU without wgmma measured cuBLAS and WMMA here
        return f"not measured: {table['skipped']}"
    return str(wgmma_view(table))


def plot_wgmma(table: dict, source: str):
    """The wgmma rows against cuBLAS FP16 (and WMMA beside them); None where the table has no wgmma rows."""
    if not wgmma_rows(table):
        return None
    values = {r["name"]: r["tflops"] for r in table["rows"] if r["kind"] == "kernel"}
    return plots.bars(values, unit="TFLOP/s", source=source, title=f"Hopper's wgmma + TMA, n = {table['n']}",
                      ceiling=("cuBLAS FP16", table["cublas_fp16_tflops"]))


def plot_sizes(sizes: dict, source: str):
    series = {name: (sizes["sizes"], v) for name, v in sizes["tflops"].items()}
    return plots.lines(series, xlabel="n (C = A B, n x n x n)", ylabel="TFLOP/s", source=source,
                       title="GEMM rate against size")


def plot_accumulation(model: dict, source: str, gpu: dict | None = None):
    series = {"FP32 accumulation (model)": (model["k"], model["fp32_acc"]),
              "FP16 accumulation (model)": (model["k"], model["fp16_acc"]),
              "exact sum rounded once to FP16": (model["k"], model["fp16_output"])}
    if gpu is not None:
        series["FP32 accumulation (tensor cores)"] = (gpu["k"], gpu["gpu_fp32_acc"])
        series["FP16 accumulation (tensor cores)"] = (gpu["k"], gpu["gpu_fp16_acc"])
    return plots.lines(series, xlabel="K (length of each dot product)", ylabel="max error / max |C|",
                       source=source, title=f"Accumulation error against K ({model['dist']} inputs, FP16)")


# ------------------------------------------------------------------------------------ the registry

def _best_configs() -> tuple:
    """The fastest tiled WMMA configuration with float and with half sums (config_table), as run() picks them."""
    rows = config_table()["rows"]
    best = max((r for r in rows if r["acc"] == "float32"), key=lambda r: r["tflops"])
    best16 = max((r for r in rows if r["acc"] == "float16"), key=lambda r: r["tflops"])
    return best["name"], best16["name"]


def measure_kernels() -> dict:
    config, config16 = _best_configs()
    return kernel_table(config=config, config16=config16)


FIGURES = {  # run() records them together (the kernels and sizes use the configurations' best); alone, each
    "peak": Figure(peak_table),  # measures what it needs
    "kernels": Figure(measure_kernels, plot_kernels, kernel_text),
    "configs": Figure(config_table, plot_configs),
    "wgmma": Figure(wgmma_table, plot_wgmma, wgmma_text),
    "sizes": Figure(lambda: size_sweep(config=_best_configs()[0]), plot_sizes),
    "errors": Figure(lambda: error_table(config=_best_configs()[0])),
    "accumulation": Figure(accumulation_on_gpu),
    "fp8": Figure(fp8_table, None, format_fp8_table, optional=True, step="04.wgmma_fp8"),
    "transformer": Figure(transformer_table, None, format_transformer_table, optional=True, step="04.wgmma"),
}


# ------------------------------------------------------------------------------------ RESULTS.md

def results_rows(record: dict) -> list:
    """The lesson's headline figures in one record, for RESULTS.md and the README (gpucourse.results): the first row
    is the headline. The wgmma rows are None on a GPU without Hopper's wgmma."""
    from gpucourse import results as R

    f = record["figures"]
    w = f.get("wgmma", {})
    wrows = w.get("rows", [])
    hopper = max((r for r in wrows if w.get("default") and r.get("config") == w["default"]),
                 key=lambda r: r["tflops"], default=None)  # the default configuration, as lesson 5 compares it
    fastest = max((r for r in wrows if str(r.get("config", "")).startswith("wgmma_")), key=lambda r: r["tflops"],
                  default=None)  # the fastest of the lesson's Hopper GEMMs
    wmma = next((r for r in wrows if r["name"].startswith("WMMA, tiled")), None)
    if wmma is None:
        wmma = next((r for r in f.get("kernels", {}).get("rows", []) if r["name"].startswith("WMMA, tiled (")), None)
    simt = next((r for r in f.get("kernels", {}).get("rows", []) if r["name"].startswith("CUDA C, register tiles")), None)
    n = w.get("n") or f.get("kernels", {}).get("n")
    return [
        ("fastest Hopper wgmma GEMM, speed against cuBLAS FP16", R.ratio(fastest and fastest["of_cublas"]), "wgmma"),
        ("Hopper wgmma GEMM (the lesson's default), speed against cuBLAS FP16", R.ratio(hopper and hopper["of_cublas"]),
         "wgmma"),
        ("Hopper wgmma GEMM, TFLOP/s", R.number(hopper and hopper["tflops"]), "wgmma"),
        ("cuBLAS FP16 GEMM, TFLOP/s", R.number(w.get("cublas_fp16_tflops")), "wgmma"),
        ("tiled WMMA GEMM, speed against cuBLAS FP16", R.ratio(wmma and wmma["of_cublas"]), "wgmma"),
        ("register-tiled SGEMM, speed against cuBLAS FP32", R.ratio(simt and simt["of_cublas"]), "kernels"),
        ("matrix size (M = N = K)", None if n is None else str(n), "kernels"),
    ]

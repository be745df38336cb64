"""Lesson 5's measurements on a GPU, and the figures drawn from them (measured or recorded).

For each of ResNet-50's 3x3 layers (kernels.convolution.LAYERS) in FP32 and FP16, NCHW and NHWC: cuDNN's
own table of forward algorithms (cudnnFindConvolutionForwardAlgorithm: time, workspace, status of each),
then every kernel of the lesson and cuDNN's fastest algorithm timed the same way (CUDA events, calls back to
back: bench.time_per_call), each checked first against the float64 convolution of the same inputs.
"""
from __future__ import annotations

import contextlib

import numpy as np

from gpucourse.records import Figure
from gpucourse import bench, claims, gpus, plots, runtime
from kernels import convolution as cv
from systems.convolution import cudnn

LESSON = "05_convolution"
CONFIGS = (("float32", "fma"), ("float32", "default"), ("float16", "tensor_op"))  # (data type, cuDNN math)
WORKSPACE_LIMITS_MIB = (0, 1, 4, 16, 64, 256, 1024)
MIB = 2**20
CORES_DIRECT = "CUDA C direct, register-tiled"  # CUDA cores, NCHW
CORES_IGEMM = "CUDA C direct on CUDA cores (implicit GEMM)"  # CUDA cores, strict FP32, NCHW
TC_DIRECT = "CUDA C direct on tensor cores (implicit GEMM)"  # WMMA, FP16 NHWC
TC_WGMMA = "CUDA C direct on tensor cores (wgmma + TMA)"  # Hopper only (sm_90a), FP16 NHWC
# the same, persistent with a TMA-stored epilogue: a row of the "layers" figure in records made before the race
# (figure "race", which times the persistent tiles against cuDNN) took its place
TC_WGMMA_PERSISTENT = "CUDA C direct on tensor cores (wgmma + TMA, persistent)"
GEMM_LESSON = "04_tensor_cores"  # where the GEMMs the tensor-core convolution is measured against are recorded
TC_GOAL = 1.5  # the FP16 NHWC direct convolution on the tensor cores within this factor of cuDNN's fastest
GEMM_GOAL = 2.0  # im2col + a tensor-core GEMM (TF32 for FP32 data, FP16) within this factor of cuDNN's fastest
DIRECT_GOAL = 5.0  # a CUDA C direct kernel within this factor of cuDNN's fastest


def _precision(dtype: str, math_: str) -> str:
    return {"float16": "float16", "float32": "tf32" if math_ != "fma" else "float32"}[dtype]


# ---------------------------------------------------------------------------------------- operands

def _operands(layer: tuple, seed: int = 0, dtypes=("float32", "float16")) -> dict:
    """x and w of a layer (uniform in [-1, 1)) in FP32 and FP16 (or ``dtypes``), NCHW and NHWC (CuPy), and the
    float64 convolution of exactly those values (the FP16 one of the FP16-rounded values) as references."""
    cp = runtime.cupy()
    n, c, h, w, k, r, s, pad, stride = layer
    rs = cp.random.RandomState(seed)
    x32 = rs.uniform(-1, 1, (n, c, h, w), dtype=cp.float32)
    w32 = rs.uniform(-1, 1, (k, c, r, s), dtype=cp.float32)
    o = {}
    for dt in dtypes:
        x, wt = x32.astype(dt), w32.astype(dt)
        o[dt, "NCHW"] = (x, wt)
        o[dt, "NHWC"] = (cp.ascontiguousarray(x.transpose(0, 2, 3, 1)), cp.ascontiguousarray(wt.transpose(0, 2, 3, 1)))
        _, _, P, Q = cv.output_shape(x.shape, wt.shape, pad, stride)
        cols = cp.empty(cv.cols_shape(x.shape, r, s, pad, stride), dt)
        cv.im2col(x, cols, r, s, pad=pad, stride=stride)
        # cols is (C R S, N P Q): the product is K x N P Q, the images side by side; NCHW puts N first
        ref = cp.matmul(wt.astype(cp.float64).reshape(k, -1), cols.astype(cp.float64)).reshape(k, n, P, Q)
        del cols
        ref = cp.ascontiguousarray(ref.transpose(1, 0, 2, 3))
        o["ref", dt, "NCHW"] = ref
        o["ref", dt, "NHWC"] = cp.ascontiguousarray(ref.transpose(0, 2, 3, 1))
    return o


# ------------------------------------------------------------------------------------ cuDNN's tables

def _descriptors(layer, dtype, layout, math_):
    n, c, h, w, k, r, s, pad, stride = layer
    x = cudnn.TensorDescriptor((n, c, h, w), dtype, layout)
    f = cudnn.FilterDescriptor((k, c, r, s), dtype, layout)
    conv = cudnn.ConvolutionDescriptor(pad, stride, 1, compute="float32", math=math_)
    y = cudnn.TensorDescriptor(conv.output_dims(x, f), dtype, layout)
    return x, f, conv, y


@contextlib.contextmanager
def cudnn_launcher(handle, layer, dtype, layout, row, x, wt, y):
    """A launcher of cuDNN's algorithm ``row`` (a Find table's row: its algo and math) on arrays x, wt and y of the
    layer (handle.forward_launcher: for timing), its descriptors made for it and destroyed after the block."""
    xd, fd, conv, yd = _descriptors(layer, dtype, layout, row["math"])
    with xd, fd, conv, yd:  # each descriptor destroys itself on the way out (as in find_table)
        yield handle.forward_launcher(x, wt, y, xd, fd, conv, yd, algo=row["algo"])


def find_table(handle, layer, dtype, layout, math_, arrays=None, *, repeats: int = 5, batch: int = 4) -> list:
    """cudnnFindConvolutionForwardAlgorithm for one layer, data type, layout and math type. Find times each
    algorithm once, and the first search after an idle moment also pays for the GPU's clocks ramping up: the
    search is run twice and the second answer kept. With ``arrays`` (x, w, y on the GPU) every algorithm that
    succeeded is also timed the course's way (CUDA events, calls back to back): "timed_ms"."""
    x, f, conv, y = _descriptors(layer, dtype, layout, math_)
    with x, f, conv, y:
        handle.find_forward_algorithms(x, f, conv, y)
        table = handle.find_forward_algorithms(x, f, conv, y)
        for row in table:
            row["timed_ms"] = None
            if arrays is None or row["status"] != "CUDNN_STATUS_SUCCESS":
                continue
            n, c, h, w, k, r, s, pad, stride = layer
            with cudnn.ConvolutionDescriptor(pad, stride, 1, compute="float32", math=row["math"]) as c_row:
                launch = handle.forward_launcher(*arrays, x, f, c_row, y, algo=row["algo"])
                row["timed_ms"] = bench.time_per_call(launch, batch=batch, repeats=repeats).median_ms
                del launch
        return table


def fastest_timed(table: list) -> dict:
    """The row of a Find table with the shortest time measured by the course (``timed_ms``)."""
    return min((r for r in table if r.get("timed_ms") is not None), key=lambda r: r["timed_ms"])


def tradeoff(table: list, limits_mib=WORKSPACE_LIMITS_MIB, *, timed: bool = True) -> list:
    """For each workspace limit, the fastest algorithm of a Find table within it (cudnn.fastest_under), by the
    course's own timing of each algorithm (``timed``) or by Find's."""
    if timed:
        table = [{**r, "time_ms": r.get("timed_ms")} for r in table if r.get("timed_ms") is not None]
    out = []
    for lim in limits_mib:
        best = cudnn.fastest_under(table, lim * MIB)
        out.append({"limit_mib": lim, "algo": best["algo"] if best else None,
                    "time_ms": best["time_ms"] if best else None})
    return out


# ------------------------------------------------------------------------------------------ one layer

def checked(launches: dict, out, ref, limit: float, layer_name: str, errors: dict | None = None) -> list:
    """The configurations whose launch gives the float64 ``ref`` within ``limit`` (relative error), in order. A wrong
    result raises, or, where ``errors`` is given, is recorded there with the reason (a failed launch too) and left
    out."""
    cp = runtime.cupy()
    right = []
    for key, launch in launches.items():
        out.fill(cp.nan)
        try:
            launch()
            err = cv.rel_error(out, ref)
            if not err <= limit:
                raise runtime.CourseError(f"{key} gave a wrong result on {layer_name}: error {err:.2e}, allowed "
                                          f"{limit:.2e}")
        except runtime.CourseError as exc:
            if errors is None:
                raise
            errors[key] = str(exc)
            continue
        right.append(key)
    return right


def checked_times(launches: dict, out, ref, limit: float, layer_name: str, *, batch: int, repeats: int,
                  errors: dict | None = None) -> dict:
    """Each configuration's launch checked (``checked``: a wrong one raises, or with ``errors`` is recorded there and
    left untimed) and timed: {configuration: median ms}."""
    return {key: bench.time_per_call(launches[key], batch=batch, repeats=repeats).median_ms
            for key in checked(launches, out, ref, limit, layer_name, errors)}


def layer_table(name: str, layer: tuple, handle, *, repeats: int = 10, batch: int = 8, numba: bool = True) -> dict:
    """Every convolution of the lesson on one layer, checked against float64 and timed, beside cuDNN."""
    cp = runtime.cupy()
    cuda = runtime.cuda()
    n, c, h, w, k, r, s, pad, stride = layer
    crs = c * r * s
    flops = cv.layer_flops(layer)
    o = _operands(layer)
    tables, rows = {}, []
    cudnn_best = {}
    wgmma_errors = {}  # Hopper's convolution: configuration -> why it was not timed

    def add(label, dtype, layout, kind, precision, launch, out, *, reps=repeats, b=batch):
        out.fill(cp.nan)
        launch()
        err = cv.rel_error(out, o["ref", dtype, layout])
        limit = cv.tolerance(precision, crs) * 2
        if not err <= limit:
            raise runtime.CourseError(f"{label} ({dtype}, {layout}) gave a wrong result on {name}: error {err:.2e}, "
                                      f"allowed {limit:.2e}; not timing it")
        t = bench.time_per_call(launch, batch=b, repeats=reps)
        rows.append({"name": label, "dtype": dtype, "layout": layout, "kind": kind, "precision": precision,
                     **t.summary(), "tflops": t.tflops(flops), "check_error": err})
        return rows[-1]

    def sweep(launches: dict, out, dtype, layout, precision, errors: dict | None = None) -> dict:
        return checked_times(launches, out, o["ref", dtype, layout], cv.tolerance(precision, crs) * 2, name,
                             batch=batch, repeats=repeats, errors=errors)

    for layout in cv.LAYOUTS:
        for dtype, math_ in CONFIGS:
            x, wt = o[dtype, layout]
            _, _, P, Q = cv.output_shape((n, c, h, w), (k, c, r, s), pad, stride)
            y = cp.empty((n, k, P, Q) if layout == "NCHW" else (n, P, Q, k), dtype)
            table = find_table(handle, layer, dtype, layout, math_, (x, wt, y))
            tables[f"{dtype}/{layout}/{math_}"] = table
            best = fastest_timed(table)
            with cudnn_launcher(handle, layer, dtype, layout, best, x, wt, y) as launch:
                row = add(f"cuDNN {best['algo']} ({best['math']} math)", dtype, layout, "cudnn",
                          _precision(dtype, math_), launch, y)
            row.update(math=math_, row_math=best["math"], algo=best["algo"], workspace_bytes=best["workspace_bytes"])
            cudnn_best[dtype, layout, math_] = row
            del launch

        for dtype in ("float32", "float16"):
            x, wt = o[dtype, layout]
            _, _, P, Q = cv.output_shape((n, c, h, w), (k, c, r, s), pad, stride)
            y = cp.empty((n, k, P, Q) if layout == "NCHW" else (n, P, Q, k), dtype)
            cols = cp.empty(cv.cols_shape(x.shape, r, s, pad, stride, layout=layout), dtype)
            variants = [(False, "float32" if dtype == "float32" else "float16")]
            if dtype == "float32":
                variants.append((True, "tf32"))
            for tf32, precision in variants:
                gemm_name = "cuBLAS TF32" if tf32 else ("cuBLAS FP32" if dtype == "float32" else "cuBLAS FP16")
                add(f"im2col + {gemm_name} GEMM", dtype, layout, "im2col", precision,
                    lambda x=x, wt=wt, y=y, cols=cols, tf32=tf32: cv.conv_im2col_gemm(
                        x, wt, y, pad=pad, stride=stride, layout=layout, tf32=tf32, cols=cols), y)
            # the two halves on their own: im2col's memory traffic, then the GEMM
            t_cols = bench.time_per_call(lambda x=x, cols=cols: cv.im2col(x, cols, r, s, pad=pad, stride=stride,
                                                                            layout=layout), batch=batch, repeats=repeats)
            rows.append({"name": "im2col alone", "dtype": dtype, "layout": layout, "kind": "part", "precision": dtype,
                         **t_cols.summary(), "tflops": None, "check_error": None,
                         "gbps": t_cols.gbps(cols.nbytes + x.nbytes)})
            if layout == "NCHW":
                gout = cp.empty((k, n * P * Q), dtype)
                launch_gemm = lambda wt=wt, cols=cols, gout=gout: cv.gemm(wt.reshape(k, crs), cols, gout,
                                                                           tf32=dtype == "float32")
            else:
                launch_gemm = lambda wt=wt, cols=cols, y=y: cv.gemm(cols, wt.reshape(k, crs).T, y.reshape(n * P * Q, k),
                                                                     tf32=dtype == "float32")
            t_gemm = bench.time_per_call(launch_gemm, batch=batch, repeats=repeats)
            rows.append({"name": "GEMM alone" + (" (TF32)" if dtype == "float32" else " (FP16)"), "dtype": dtype,
                         "layout": layout, "kind": "part", "precision": dtype, **t_gemm.summary(),
                         "tflops": t_gemm.tflops(flops), "check_error": None})
            del cols
            if layout == "NHWC" and dtype == "float16":
                # every tile configuration, checked and timed; the fastest is the kernel's row (as Find does for
                # cuDNN's algorithms)
                configs_ms = sweep({cfg: lambda x=x, wt=wt, y=y, cfg=cfg: cv.conv_implicit_gemm(
                    x, wt, y, pad=pad, stride=stride, config=cfg) for cfg in cv.IGEMM_CONFIGS}, y, dtype, layout, "float16")
                best_cfg = min(configs_ms, key=configs_ms.get)
                add(TC_DIRECT, dtype, layout, "direct", "float16",
                    lambda x=x, wt=wt, y=y: cv.conv_implicit_gemm(x, wt, y, pad=pad, stride=stride, config=best_cfg), y)
                rows[-1].update(config=best_cfg, configs_ms=configs_ms,
                                rule_of_thumb=cv.igemm_choose(n * P * Q, k, runtime.get().device.get("sms", 132)))
            if layout == "NHWC" and dtype == "float16" and gpus.supports("wgmma"):
                # Hopper: the same convolution as lesson 4's wgmma GEMM, every tile checked and timed, the fastest
                # kept. A tile that fails (its check, or the launch) is recorded with the reason, not timed, so
                # that the rest of the table stands.
                configs_ms = sweep({cfg: lambda x=x, wt=wt, y=y, cfg=cfg: cv.conv_wgmma(
                    x, wt, y, pad=pad, stride=stride, config=cfg) for cfg in cv.WGMMA_CONV_CONFIGS}, y, dtype, layout,
                    "float16", errors=wgmma_errors)
                if configs_ms:
                    best_w = min(configs_ms, key=configs_ms.get)
                    add(TC_WGMMA, dtype, layout, "direct", "float16",
                        lambda x=x, wt=wt, y=y: cv.conv_wgmma(x, wt, y, pad=pad, stride=stride, config=best_w), y)
                    rows[-1].update(config=best_w, configs_ms=configs_ms)
            if layout == "NCHW":
                add(CORES_DIRECT, dtype, layout, "direct", "float32" if dtype == "float32"
                    else "float16", lambda x=x, wt=wt, y=y: cv.conv_direct(x, wt, y, pad=pad, stride=stride), y)
                if dtype == "float32":
                    # the implicit GEMM on the CUDA cores: every tile and split checked and timed, the fastest kept
                    configs_ms = sweep({f"{cfg}/{sp}": lambda x=x, wt=wt, y=y, cfg=cfg, sp=sp: cv.conv_direct_cores(
                        x, wt, y, pad=pad, stride=stride, config=cfg, splits=sp)
                        for cfg in cv.CORES_CONFIGS for sp in cv.CORES_SPLITS}, y, dtype, layout, "float32")
                    best = min(configs_ms, key=configs_ms.get)
                    best_cfg, best_splits = best.split("/")[0], int(best.split("/")[1])
                    add(CORES_IGEMM, dtype, layout, "direct", "float32",
                        lambda x=x, wt=wt, y=y: cv.conv_direct_cores(x, wt, y, pad=pad, stride=stride,
                                                                     config=best_cfg, splits=best_splits), y)
                    rows[-1].update(config=best_cfg, splits=best_splits, configs_ms=configs_ms,
                                    rule_of_thumb="/".join(map(str, cv.cores_choose(
                                        n * P * Q, k, runtime.get().device.get("sms", 132)))))
                if dtype == "float32" and numba:
                    nx, nw, ny = (cuda.as_cuda_array(a) for a in (x, wt, y))
                    add("numba direct, one thread per output", dtype, layout, "direct", "float32",
                        lambda: cv.conv2d_numba(nx, nw, ny, pad=pad, stride=stride), y, reps=3, b=2)
        cp.get_default_memory_pool().free_all_blocks()

    # every row against cuDNN: like with like (same data type, layout and kind of arithmetic), and against
    # cuDNN's fastest for the data type and layout whatever its math
    for row in rows:
        key = (row["dtype"], row["layout"])
        maths = [m for (d, l, m) in cudnn_best if (d, l) == key]
        fastest = min((cudnn_best[key + (m,)] for m in maths), key=lambda r: r["median_ms"])
        like = {"float32": "fma", "tf32": "default", "float16": "tensor_op"}[row["precision"]]
        row["cudnn_like"] = cudnn_best[key + (like,)]["name"]
        row["of_cudnn_like"] = row["median_ms"] / cudnn_best[key + (like,)]["median_ms"]
        row["cudnn_fastest"] = fastest["name"]
        row["of_cudnn_fastest"] = row["median_ms"] / fastest["median_ms"]
    return {"name": name, "layer": list(layer), "flops": flops, "crs": crs,
            "im2col_mib": {dt: cv.im2col_bytes(layer, np.dtype(dt).itemsize) / MIB for dt in ("float32", "float16")},
            "find": tables, "rows": rows, "targets": targets(rows), **({"wgmma_errors": wgmma_errors} if wgmma_errors else {})}


def targets(rows: list) -> dict:
    """The lesson's targets on one layer: im2col + tensor-core GEMM (TF32 for FP32 data, FP16) within 2x of
    cuDNN's fastest algorithm, a CUDA C direct kernel within 5x (on the CUDA cores, the fastest of the lesson's
    kernels there), each for the same data type and layout; on Hopper, the wgmma convolution within TC_GOAL
    (1.5x)."""
    out = {}
    for r in rows:
        if r["name"] == TC_WGMMA:
            out[f"direct (wgmma) {r['dtype']} {r['layout']}"] = {"ratio": r["of_cudnn_fastest"], "limit": TC_GOAL,
                                                                 "met": r["of_cudnn_fastest"] <= TC_GOAL}
            continue
        if r["kind"] == "im2col" and r["precision"] in ("tf32", "float16"):
            out[f"im2col+GEMM {r['dtype']} {r['layout']}"] = {"ratio": r["of_cudnn_fastest"], "limit": GEMM_GOAL,
                                                              "met": r["of_cudnn_fastest"] <= GEMM_GOAL}
        if r["kind"] == "direct" and r["name"] in (CORES_DIRECT, CORES_IGEMM, TC_DIRECT):
            how = "tensor cores" if r["name"] == TC_DIRECT else "CUDA cores"
            key = f"direct ({how}) {r['dtype']} {r['layout']}"
            if key in out and out[key]["ratio"] <= r["of_cudnn_fastest"]:
                continue
            out[key] = {"ratio": r["of_cudnn_fastest"], "limit": DIRECT_GOAL, "met": r["of_cudnn_fastest"] <= DIRECT_GOAL,
                        "kernel": r["name"]}
    return out


def tensor_core_gap(layers: list, gemms: dict | None, goal: float = TC_GOAL) -> list:
    """Why the WMMA convolution stays above ``goal`` x cuDNN, measured: for each layer, FP16 NHWC, the TFLOP/s of
    cuDNN's fastest algorithm, of the course's direct convolution on the tensor cores (TC_DIRECT), of cuBLAS on the
    layer's own GEMM (N P Q x R S C by R S C x K, the im2col + GEMM row's "GEMM alone") and what ``goal`` asks
    of the course's kernel (cuDNN's TFLOP/s / goal). ``gemms``: lesson 4's figures["wgmma"] on the same GPU (8192^3
    FP16 GEMMs: cuBLAS, the tiled WMMA GEMM this convolution is built like and, on Hopper, the wgmma GEMM fed by the
    TMA), or None where lesson 4 has no such figure. Each of lesson 4's figures the table lacks is None: all of
    them without ``gemms``; the wgmma GEMM's on a GPU without wgmma (compute capability below 9.0, whose table holds
    cuBLAS and WMMA alone) and in a table recorded without any row (``rows`` empty)."""
    if not goal > 0:
        raise runtime.CourseInputError(f"goal must be a positive factor, got {goal}")
    rows3 = (gemms or {}).get("rows", [])
    cublas = next((r["tflops"] for r in rows3 if r["kind"] == "library"), None)
    wmma = next((r["tflops"] for r in rows3 if r["name"].startswith("WMMA, tiled")), None)
    default = (gemms or {}).get("default")
    wgmma = max((r["tflops"] for r in rows3 if default and r.get("config") == default), default=None)
    out = []
    for lt in layers:
        rows = [r for r in lt["rows"] if r["dtype"] == "float16" and r["layout"] == "NHWC"]
        cudnn_best = min((r for r in rows if r["kind"] == "cudnn"), key=lambda r: r["median_ms"])
        conv = min((r for r in rows if r["name"] == TC_DIRECT), key=lambda r: r["median_ms"], default=None)
        gemm = next((r for r in rows if r["kind"] == "part" and r["name"].startswith("GEMM alone")), None)
        if conv is None:
            continue
        needed = cudnn_best["tflops"] / goal
        out.append({"layer": lt["name"], "cudnn_tflops": cudnn_best["tflops"], "conv_tflops": conv["tflops"],
                    "of_cudnn": conv["of_cudnn_fastest"], "needed_tflops": needed,
                    "layer_gemm_tflops": gemm["tflops"] if gemm else None,
                    "gemm_cublas_tflops": cublas, "wmma_tflops": wmma, "wgmma_tflops": wgmma,
                    "conv_of_wmma": conv["tflops"] / wmma if wmma else None,
                    "needed_of_wmma": needed / wmma if wmma else None})
    return out


def lesson3_gemms_line(gap: list, gemm_source: str | None) -> str:
    """One line: lesson 4's GEMMs that tensor_core_gap read the convolutions against, or why there are none."""
    g0 = gap[0] if gap else {}
    if not g0.get("wmma_tflops") or not g0.get("gemm_cublas_tflops"):
        return ("lesson 4's GEMMs are not recorded on this GPU: run lesson 4's notebook or `python -m gpucourse "
                "record` for the figures to read these against")
    cublas, wmma, wgmma = g0["gemm_cublas_tflops"], g0["wmma_tflops"], g0["wgmma_tflops"]
    hopper = (f"the wgmma GEMM fed by the TMA {wgmma:.0f} ({wgmma / cublas:.2f}x)" if wgmma
              else "no wgmma GEMM (it needs compute capability 9.0)")
    return (f"lesson 4's GEMMs at 8192^3, TFLOP/s: cuBLAS FP16 {cublas:.0f}, the tiled WMMA GEMM {wmma:.0f} "
            f"({wmma / cublas:.2f}x cuBLAS), {hopper} ({gemm_source})")


def tensor_core_gap_view(gap: list, gemm_source: str | None, conv_source: str = "",
                         goal: float = TC_GOAL) -> plots.Table:
    """tensor_core_gap as a table: per layer, FP16 NHWC, what the goal asks of the WMMA convolution against what
    each kind of kernel was measured at, and (where lesson 4's GEMMs are there) both as shares of the WMMA GEMM's
    rate. The title says where lesson 4's GEMMs come from."""
    with_wmma = bool(gap) and gap[0]["wmma_tflops"] is not None
    header = ["layer", "cuDNN", "WMMA conv", "its time / cuDNN's", f"{goal:g}x asks", "layer's GEMM (cuBLAS)"]
    if with_wmma:
        header += ["conv / WMMA GEMM", f"{goal:g}x asks / WMMA GEMM"]
    rows = []
    for g in gap:
        row = [g["layer"], g["cudnn_tflops"], g["conv_tflops"], f"{g['of_cudnn']:.2f}x", g["needed_tflops"],
               g["layer_gemm_tflops"] if g["layer_gemm_tflops"] else "-"]
        if with_wmma:
            row += [f"{g['conv_of_wmma']:.2f}", f"{g['needed_of_wmma']:.2f}"]
        rows.append(row)
    return plots.table(header, rows, title="FP16 NHWC, TFLOP/s. " + lesson3_gemms_line(gap, gemm_source),
                       source=conv_source)


def tensor_core_gap_text(gap: list, gemm_source: str | None, goal: float = TC_GOAL) -> str:
    """tensor_core_gap as text: the table, then per layer what the goal asks of the WMMA GEMM's rate."""
    lines = [str(tensor_core_gap_view(gap, gemm_source, goal=goal))]
    for g in gap:
        if g["wmma_tflops"]:
            lines.append(f"  {g['layer']:24} the WMMA conv runs at {g['conv_of_wmma']:.2f} of the WMMA GEMM's rate; "
                         f"{goal:g}x of cuDNN would need {g['needed_of_wmma']:.2f} of it")
    return "\n".join(lines)


def fused(layer_name: str | None = None, repeats: int = 10, batch: int = 8) -> dict:
    """cudnnConvolutionBiasActivationForward (conv + bias + ReLU in one call) against cudnnConvolutionForward
    followed by bias + ReLU as one CuPy elementwise kernel, on one layer, FP32 NCHW and FP16 NHWC."""
    cp = runtime.cupy()
    layer_name = layer_name or next(iter(cv.LAYERS))
    layer = cv.LAYERS[layer_name]
    n, c, h, w, k, r, s, pad, stride = layer
    out = {"layer": layer_name, "rows": []}
    bias_relu = cp.ElementwiseKernel("T y, T b", "T z", "T v = y + b; z = v > (T)0 ? v : (T)0", "course_bias_relu")
    with cudnn.Handle() as handle:
        for dtype, layout, math_ in (("float32", "NCHW", "fma"), ("float16", "NHWC", "tensor_op")):
            o = _operands(layer)
            x, wt = o[dtype, layout]
            xd, fd, conv, yd = _descriptors(layer, dtype, layout, math_)
            bias = cp.asarray(np.linspace(-0.5, 0.5, k), dtype=dtype)
            bshape = (1, k, 1, 1) if layout == "NCHW" else (1, 1, 1, k)
            ref = cp.maximum(o["ref", dtype, layout] + bias.astype(cp.float64).reshape(bshape), 0)
            y = cp.empty(yd.shape, dtype)
            z = cp.empty(yd.shape, dtype)
            algo = "IMPLICIT_PRECOMP_GEMM"
            row = {"dtype": dtype, "layout": layout, "math": math_, "algo": algo}
            try:
                fused_call = lambda: handle.convolution_bias_activation_forward(x, wt, bias, y, xd, fd, conv, yd,
                                                                                activation="relu", algo=algo)
                y.fill(cp.nan)
                fused_call()
                row["fused_error"] = cv.rel_error(y, ref)
                row["fused"] = bench.time_per_call(fused_call, batch=batch, repeats=repeats).summary()
                row["status"] = "CUDNN_STATUS_SUCCESS"
            except cudnn.CudnnError as exc:
                row["status"], row["fused"] = exc.name, None
            conv_only = handle.forward_launcher(x, wt, y, xd, fd, conv, yd, algo=algo)

            def separate():
                conv_only()
                bias_relu(y, bias.reshape(bshape), z)

            separate()
            row["separate_error"] = cv.rel_error(z, ref)
            row["separate"] = bench.time_per_call(separate, batch=batch, repeats=repeats).summary()
            row["conv_only"] = bench.time_per_call(conv_only, batch=batch, repeats=repeats).summary()
            out["rows"].append(row)
            for d in (xd, fd, conv, yd):
                d.destroy()
            del o
            cp.get_default_memory_pool().free_all_blocks()
    return out


# ------------------------------------------------------------------------------- Hopper against cuDNN

RACE_GOALS = {"3x3": 1.0, "1x1": 1.1}  # the wgmma convolution's time over cuDNN's fastest, at most, on each layer
RACE_TURNS = 3  # cuDNN's fastest and the fastest tile of each kind, timed in turns this many times (the medians kept)
# the tiles of each kind that go on to the turns: the sweep's fastest two, the faster of them in turns kept (on an H100,
# 128x64_s8 on conv5_x 1x1 2048->512 took 11.2 us in one sweep and 15.1 us in the turns after it, where 64x128_s3
# took 11.6 and about 12: the sweep's one number can pick the wrong tile)
RACE_FINALISTS = 2
# the kinds of wgmma tile the race keeps the fastest of: a row's keys, with their configurations
RACE_KINDS = {"one_tile": cv.WGMMA_CONV_CONFIGS, "persistent": cv.WGMMA_CONV_PERSISTENT_CONFIGS}
# ... and the persistent finalists once more, launched with PDL (programmatic dependent launch: cv.conv_wgmma's pdl),
# in the same turns: the same kernel, whose blocks set up while the kernel before it on the stream ends
RACE_PDL = "persistent_pdl"
RACE_COLUMNS = {"one_tile": "one-tile", "persistent": "persistent", RACE_PDL: "with PDL"}


def race(layers: dict | None = None, *, repeats: int = 10, batch: int = 8) -> dict:
    """Hopper's convolution against cuDNN's fastest algorithm, FP16 NHWC, on ResNet-50's stride-1 layers at batch 32
    (cv.LAYERS, the 3 x 3 ones, and cv.LAYERS_1X1), or ``layers``: for each layer, Find over cuDNN's algorithms with
    every one timed by the course's timer (the fastest kept), then every wgmma tile, one-tile (WGMMA_CONV_CONFIGS)
    and persistent (WGMMA_CONV_PERSISTENT_CONFIGS), checked against float64 and timed the same way in the same run.
    A tile that fails its check or its launch is listed in the row's ``errors`` and not timed. Then cuDNN's fastest
    and the RACE_FINALISTS fastest tiles of each kind are timed again in turns, RACE_TURNS times (``finalists_ms``:
    the tiles' medians), the persistent ones also launched with PDL (kind RACE_PDL, their keys there ending in
    "+pdl"); the faster finalist is the kind's (``turns_ms``: its times and cuDNN's): each row holds their medians and
    each kind's time over cuDNN's (``of_cudnn``). RACE_GOALS says what the lesson aims for."""
    cp = runtime.cupy()
    gpus.step("05.wgmma")
    layers = layers or {**cv.LAYERS, **cv.LAYERS_1X1}
    rows = []
    with cudnn.Handle() as handle:
        for name, layer in bench.progress(list(layers.items()), desc="layers"):
            n, c, h, w, k, r, s, pad, stride = layer
            o = _operands(layer, dtypes=("float16",))
            x, wt = o["float16", "NHWC"]
            ref = o["ref", "float16", "NHWC"]
            del o
            _, _, P, Q = cv.output_shape((n, c, h, w), (k, c, r, s), pad, stride)
            y = cp.empty((n, P, Q, k), cp.float16)
            limit = cv.tolerance("float16", c * r * s) * 2
            best = fastest_timed(find_table(handle, layer, "float16", "NHWC", "tensor_op", (x, wt, y),
                                            repeats=repeats, batch=batch))
            errors = {}

            def conv(cfg, pdl=False):
                return lambda: cv.conv_wgmma(x, wt, y, pad=pad, stride=stride, config=cfg, pdl=pdl)

            ms = checked_times({cfg: conv(cfg) for configs in RACE_KINDS.values() for cfg in configs}, y, ref, limit,
                               name, batch=batch, repeats=repeats, errors=errors)
            # the sweep's fastest RACE_FINALISTS of each kind and cuDNN's fastest, timed again in turns: a moment of
            # slower clocks falls on all of them, not on one; the faster finalist in the turns is the kind's
            finalists = {kind: sorted((c for c in ms if c in configs), key=ms.get)[:RACE_FINALISTS]
                         for kind, configs in RACE_KINDS.items()}
            # the persistent finalists launched with PDL too, checked as the plain launches were in the sweep
            pdl = {cfg + "+pdl": conv(cfg, pdl=True) for cfg in finalists["persistent"]}
            finalists[RACE_PDL] = checked(pdl, y, ref, limit, name, errors)
            with cudnn_launcher(handle, layer, "float16", "NHWC", best, x, wt, y) as launch_cudnn:
                launches = {"cudnn": launch_cudnn}
                y.fill(cp.nan)
                launches["cudnn"]()
                cudnn_error = cv.rel_error(y, ref)
                launches.update({cfg: conv(cfg) for kind in RACE_KINDS for cfg in finalists[kind]})
                launches.update({key: pdl[key] for key in finalists[RACE_PDL]})
                timed = {key: [] for key in launches}
                for _ in range(RACE_TURNS):
                    for key, launch in launches.items():
                        timed[key].append(bench.time_per_call(launch, batch=batch, repeats=repeats).median_ms)
            fastest = {kind: min(cfgs, key=lambda c: np.median(timed[c]), default=None)
                       for kind, cfgs in finalists.items()}
            turns = {"cudnn": timed["cudnn"], **{kind: timed[cfg] for kind, cfg in fastest.items() if cfg}}
            med = {kind: float(np.median(t)) for kind, t in turns.items()}
            del launches, launch_cudnn, pdl
            row = {"layer": name, "shape": f"{r}x{s}", "layer_dims": list(layer), "flops": cv.layer_flops(layer),
                   "cudnn": best["algo"], "cudnn_math": best["math"], "cudnn_find_ms": best["timed_ms"],
                   "cudnn_ms": med["cudnn"], "cudnn_error": cudnn_error, "configs_ms": ms, "errors": errors,
                   "turns_ms": turns, "finalists_ms": {cfg: float(np.median(timed[cfg]))
                                                       for cfgs in finalists.values() for cfg in cfgs}}
            for kind, cfg in fastest.items():
                row[kind] = {"config": cfg and cfg.removesuffix("+pdl"), "ms": med.get(kind),
                             "of_cudnn": med[kind] / med["cudnn"] if cfg else None}
            rows.append(row)
            del x, wt, ref, y
            cp.get_default_memory_pool().free_all_blocks()
    return {"goals": dict(RACE_GOALS), "cudnn": cudnn.version(), "rows": rows}


def _tile(cfg: str | None) -> str:
    return (cfg or "-").removeprefix("conv_wgmma_").removesuffix("_nhwc_f16")


def text_race(data: dict) -> str:
    """The race as a table: each layer's time with cuDNN's fastest algorithm, the fastest one-tile and persistent
    wgmma tiles' times over it, the persistent ones launched with PDL ("-" where a kind was not run), and the fastest
    tile; cuDNN's algorithms and the goals in the title."""
    head = ["layer", "cuDNN µs", *RACE_COLUMNS.values(), "fastest tile"]
    out = []
    for r in data["rows"]:
        dims = r["layer_dims"]
        timed = {kind: r[kind] for kind in RACE_COLUMNS if (r.get(kind) or {}).get("config")}
        best = min(timed, key=lambda kind: timed[kind]["of_cudnn"], default=None)
        out.append([r["layer"].split(":")[0] + ("" if r["shape"] == "3x3" else f" {dims[1]}->{dims[4]}"),
                    f"{r['cudnn_ms'] * 1e3:.1f}",
                    *(f"{timed[kind]['of_cudnn']:.2f}" if kind in timed else "-" for kind in RACE_COLUMNS),
                    _tile(best and timed[best]["config"]) + (", PDL" if best == RACE_PDL else "")])
    algos = ", ".join(a.removeprefix("CUDNN_CONVOLUTION_FWD_ALGO_") for a in dict.fromkeys(r["cudnn"] for r in data["rows"]))
    goals = ", ".join(f"{g:g}x on {shape}" for shape, g in data["goals"].items())
    return str(plots.table(head, out, align="lr" + "r" * len(RACE_COLUMNS) + "l",
                           title=f"wgmma convolution / cuDNN {data.get('cudnn', '?')}'s fastest ({algos}), FP16 NHWC, "
                                 f"batch 32\n(goals: at most {goals})"))


def race_reading(data: dict) -> list:
    """What lesson 5's deep dive says of the race, each statement with whether it holds in ``data`` (a run's or a
    record's figure "race"): [(statement, True, False or None)]. A records test asserts every statement on every
    record that has the figure."""
    rows = data.get("rows", [])
    three = [r for r in rows if r["shape"] == "3x3"]
    return [
        ("the persistent tiles: faster than the one-tile ones on every layer",
         claims.every(rows, lambda r: r["persistent"]["ms"] < r["one_tile"]["ms"])),
        ("one tile a block: behind cuDNN's fastest on every 3 x 3 layer",
         claims.every(three, lambda r: r["one_tile"]["of_cudnn"] > 1.0)),
        ("persistent: ahead of cuDNN's fastest on every 3 x 3 layer",
         claims.every(three, lambda r: r["persistent"]["of_cudnn"] < 1.0)),
        ("persistent, launched with PDL: faster than without on every layer",
         claims.every(rows, lambda r: r[RACE_PDL]["ms"] < r["persistent"]["ms"])),
    ]


# ------------------------------------------------------------------------------------ where a layer's time goes

# conv5_x 1x1 2048->512 at batch 32, the race's closest layer (the persistent tile behind cuDNN's fastest on an H200,
# ahead on an H100): its tile, and the input channels it is timed at (the layer's, halved and half again as many):
# 16, 32 and 48 slices
TIME_GOES_CONFIG = "conv_wgmma_i2c_64x128_s8_persistent_nhwc_f16"
TIME_GOES_CHANNELS = (1024, 2048, 3072)
TIME_GOES_KINDS = {"whole": "the whole kernel", "loads": "its loads alone", "mma": "its products alone",
                   "cudnn": "cuDNN's fastest"}


def time_goes_fit(slices, us) -> tuple:
    """The straight line through (slices of the reduction, µs a call): (ns a slice, µs at no slice: the fixed cost,
    launch included), least squares."""
    if len(slices) != len(us) or len(set(slices)) < 2:
        raise runtime.CourseInputError("a straight line needs times at two numbers of slices at least")
    slope, fixed = np.polyfit(np.asarray(slices, float), np.asarray(us, float), 1)
    return float(slope * 1e3), float(fixed)


def where_time_goes(channels=TIME_GOES_CHANNELS, *, n: int = 32, hw: int = 7, k: int = 512, rounds: int = 3,
                    repeats: int = 10, batch: int = 8) -> dict:
    """Where a 1x1 layer's time goes on the course's tile (TIME_GOES_CONFIG): conv5_x's last layer (n x hw x hw
    pixels, k output channels) with each number of input ``channels``, timed four ways in turns: the whole kernel,
    the same kernel with its loads alone and with its products alone (conv_wgmma's ``ablate``), and cuDNN's fastest
    algorithm (Find, every algorithm timed). The whole kernel is checked against float64 first, the loads alone
    against zeros. A straight line through each kind's times against the slices of the reduction (64 channels
    each) splits them into a time a slice and a fixed cost (time_goes_fit)."""
    if len(set(channels)) < 2 or any(c < cv.WGMMA_BK or c % cv.WGMMA_BK for c in channels):
        raise runtime.CourseInputError(f"where_time_goes needs two or more numbers of input channels, each a multiple "
                                       f"of {cv.WGMMA_BK}; got {tuple(channels)}")
    cp = runtime.cupy()
    gpus.step("05.wgmma")
    us = {kind: [] for kind in TIME_GOES_KINDS}
    algos = []
    with cudnn.Handle() as handle:
        for c in bench.progress(list(channels), desc="input channels"):
            layer = (n, c, hw, hw, k, 1, 1, 0, 1)
            o = _operands(layer, dtypes=("float16",))
            x, wt = o["float16", "NHWC"]
            ref = o["ref", "float16", "NHWC"]
            del o
            y = cp.empty((n, hw, hw, k), cp.float16)
            launches = {kind: (lambda a=a: cv.conv_wgmma(x, wt, y, config=TIME_GOES_CONFIG, ablate=a))
                        for kind, a in (("whole", None), ("loads", "loads"), ("mma", "mma"))}
            y.fill(cp.nan)
            launches["whole"]()
            err, limit = cv.rel_error(y, ref), cv.tolerance("float16", c) * 2
            if not err <= limit:
                raise runtime.CourseError(f"{TIME_GOES_CONFIG} gave a wrong result at C = {c}: error {err:.2e}, "
                                          f"allowed {limit:.2e}")
            y.fill(cp.nan)
            launches["loads"]()
            if bool(cp.any(y != 0)):
                raise runtime.CourseError(f"{TIME_GOES_CONFIG} with its loads alone at C = {c}: y is not all zeros")
            best = fastest_timed(find_table(handle, layer, "float16", "NHWC", "tensor_op", (x, wt, y),
                                            repeats=repeats, batch=batch))
            algos.append(best["algo"])
            with cudnn_launcher(handle, layer, "float16", "NHWC", best, x, wt, y) as launch_cudnn:
                launches["cudnn"] = launch_cudnn
                timed = bench.interleaved(launches, rounds=rounds, repeats=repeats, batch=batch)
            for kind in TIME_GOES_KINDS:
                us[kind].append(timed[kind].median_ms * 1e3)
            del launches, launch_cudnn, x, wt, ref, y
            cp.get_default_memory_pool().free_all_blocks()
    slices = [c // cv.WGMMA_BK for c in channels]
    fits = {kind: time_goes_fit(slices, t) for kind, t in us.items()}
    return {"config": TIME_GOES_CONFIG, "layer": f"1x1, {hw}x{hw}, K={k}, batch {n}", "channels": list(channels),
            "slices": slices, "us": us, "per_slice_ns": {kind: f[0] for kind, f in fits.items()},
            "fixed_us": {kind: f[1] for kind, f in fits.items()}, "cudnn": cudnn.version(), "cudnn_algos": algos}


def text_time_goes(data: dict) -> str:
    """The four kinds' times at each number of input channels, and their lines' time a slice and fixed cost."""
    head = ["", *(f"C = {c:,}" for c in data["channels"]), "a slice (ns)", "fixed (µs)"]
    rows = [[label, *(f"{t:.2f}" for t in data["us"][kind]), f"{data['per_slice_ns'][kind]:.0f}",
             f"{data['fixed_us'][kind]:.2f}"] for kind, label in TIME_GOES_KINDS.items()]
    tile = _tile(data["config"]).removeprefix("i2c_")
    return str(plots.table(head, rows, align="l" + "r" * (len(head) - 1),
                           title=f"Where the time goes: tile {tile} on {data['layer']}, C input channels\n"
                                 f"(µs a call, medians in turns; cuDNN {data.get('cudnn', '?')})"))


def plot_time_goes(data: dict, source: str):
    """Each kind's time a call against the slices of the reduction: the slopes are the times a slice."""
    series = {label: (data["slices"], data["us"][kind]) for kind, label in TIME_GOES_KINDS.items()}
    return plots.lines(series, xlabel="slices of the reduction (64 input channels each)", ylabel="µs a call",
                       source=source, title=f"Where the time goes: {data['layer']}", logx=False, logy=False)


def time_goes_reading(data: dict) -> list:
    """What lesson 5's deep dive says of where the time goes, each statement with whether it holds in ``data``."""
    ns, fixed = data.get("per_slice_ns", {}), data.get("fixed_us", {})
    return [
        claims.compare("the whole kernel, a slice", "above", "its loads alone", lambda: ns["whole"],
                       lambda: ns["loads"]),
        claims.compare("its loads alone, a slice", "above", "its products alone", lambda: ns["loads"],
                       lambda: ns["mma"]),
        claims.compare("cuDNN's fastest, a slice", "below", "the course's loads alone", lambda: ns["cudnn"],
                       lambda: ns["loads"]),
        claims.compare("the course's fixed cost", "below", "cuDNN's", lambda: fixed["whole"], lambda: fixed["cudnn"]),
    ]


def cudnn_info() -> dict:
    return {"version": cudnn.version(), "library": str(getattr(cudnn.load(), "_name", ""))}


def all_layers(layers: dict | None = None, repeats: int = 10) -> list:
    layers = layers or cv.LAYERS
    out = []
    with cudnn.Handle() as handle:
        for name, layer in bench.progress(layers.items(), desc="layers"):
            out.append(layer_table(name, layer, handle, repeats=repeats))
            runtime.cupy().get_default_memory_pool().free_all_blocks()
    return out


def run() -> tuple:
    """Every measurement of the lesson: (figures, ceilings), for `python -m gpucourse record`."""
    ceilings = bench.measure_ceilings().as_dict()
    figures = {"cudnn": cudnn_info(), "layers": all_layers(), "fused": fused()}
    if gpus.status("05.wgmma").runs:
        figures["race"] = race()
        figures["time_goes"] = where_time_goes()
    return figures, ceilings


# ------------------------------------------------------------------------------------ text and plots

def find_view(table: list, title: str = "", source: str = "") -> plots.Table:
    """The lecture's printf loop (docs/sources.md), as a table: algorithm, Find's time and the course's, workspace, status, math."""
    rows = [[i, r["algo"], f"{r['time_ms']:.4f}" if r["time_ms"] is not None else "-",
             f"{r['timed_ms']:.4f}" if r.get("timed_ms") is not None else "-",
             f"{r['workspace_bytes'] / MIB:.2f}" if r["workspace_bytes"] is not None else "-",
             r["status"].removeprefix("CUDNN_STATUS_"), r["math"], "yes" if r.get("deterministic") else "no"]
            for i, r in enumerate(table)]
    return plots.table(["", "algorithm", "Find (ms)", "timed (ms)", "workspace (MiB)", "status", "math",
                        "deterministic"], rows, title=title, source=source)


def find_agreement(layers: list) -> dict:
    """How Find's own times compare with the course's timing of the same algorithms, over every table of every
    layer: the ratios' least, median and largest, and in how many tables Find's first choice is not the fastest
    when timed."""
    ratios = [r["time_ms"] / r["timed_ms"] for lt in layers for t in lt["find"].values() for r in t
              if r.get("timed_ms") and r["time_ms"]]
    changed = [(lt["name"], k) for lt in layers for k, t in lt["find"].items()
               if (t[0]["algo"], t[0]["math"]) != (fastest_timed(t)["algo"], fastest_timed(t)["math"])]
    return {"least": min(ratios), "median": float(np.median(ratios)), "most": max(ratios), "changed": len(changed),
            "tables": sum(len(lt["find"]) for lt in layers)}


def tradeoff_view(layers: list, key: str, source: str = "") -> plots.Table:
    """For each workspace limit, the fastest algorithm within it and its time (µs, the course's timing) per layer."""
    per_layer = [tradeoff(lt["find"][key]) for lt in layers]
    rows = []
    for i, limit in enumerate(WORKSPACE_LIMITS_MIB):
        row = [f"{limit:,} MiB"]
        for points in per_layer:
            p = points[i]
            row.append(f"{p['algo']}, {p['time_ms'] * 1e3:.0f} µs" if p["algo"] else "(none)")
        rows.append(row)
    return plots.table(["workspace limit", *(lt["name"].split(":")[0] for lt in layers)], rows, source=source,
                       title=f"The fastest algorithm within each workspace limit ({key})")


def layer_view(lt: dict, source: str = "") -> plots.Table:
    """One layer's rows: every kernel and cuDNN's fastest per math type, time, TFLOP/s, and time over cuDNN's
    fastest with the same arithmetic ("x like") and with any ("x fastest")."""
    rows = [[r["name"], r["dtype"], r["layout"], bench.format_ms(r["median_ms"]), r["tflops"],
             f"{r['of_cudnn_like']:.2f}", f"{r['of_cudnn_fastest']:.2f}"] for r in lt["rows"] if r["kind"] != "part"]
    title = (f"{lt['name']}: {lt['flops'] / 1e9:.2f} GFLOP a call; im2col matrix {lt['im2col_mib']['float32']:.0f} "
             f"MiB in FP32, {lt['im2col_mib']['float16']:.0f} MiB in FP16")
    for cfg, why in lt.get("wgmma_errors", {}).items():
        title += f"; {cfg} not timed ({why})"
    return plots.table(["kernel", "data", "layout", "time", "TFLOP/s", "x like", "x fastest"], rows, title=title,
                       source=source)


def parts_view(layers: list, source: str = "") -> plots.Table:
    """im2col + GEMM's two halves timed apart, per layer, data type and layout: im2col's bandwidth (the cols matrix
    written plus the input read), the GEMM's TFLOP/s."""
    rows = [[lt["name"].split(":")[0], r["dtype"], r["layout"], r["name"], bench.format_ms(r["median_ms"]),
             f"{r['gbps']:.0f} GB/s" if r.get("gbps") else f"{r['tflops']:.1f} TFLOP/s"]
            for lt in layers for r in lt["rows"] if r["kind"] == "part"]
    return plots.table(["layer", "data", "layout", "half", "time", "rate"], rows, source=source,
                       title="im2col + GEMM, the two halves timed apart")


def targets_view(layers: list, source: str = "") -> plots.Table:
    """Every target of every layer: the ratio to cuDNN's fastest, the limit, met or not."""
    rows = [[lt["name"].split(":")[0], key, f"{t['ratio']:.2f}x", f"{t['limit']:g}x", "met" if t["met"] else "NOT met"]
            for lt in layers for key, t in lt["targets"].items()]
    return plots.table(["layer", "target", "x cuDNN's fastest", "limit", ""], rows, source=source,
                       title="The targets, against cuDNN's fastest algorithm for the same data type and layout")


SUMMARY_ROWS = (  # (label, row name, data type, layout) of kernels_view
    ("im2col + FP16 GEMM, NHWC", "im2col + cuBLAS FP16 GEMM", "float16", "NHWC"),
    ("im2col + FP16 GEMM, NCHW", "im2col + cuBLAS FP16 GEMM", "float16", "NCHW"),
    ("direct, tensor cores (WMMA), FP16 NHWC", TC_DIRECT, "float16", "NHWC"),
    ("direct, tensor cores (wgmma), FP16 NHWC", TC_WGMMA, "float16", "NHWC"),
    ("direct, CUDA cores, implicit GEMM, FP32", CORES_IGEMM, "float32", "NCHW"),
    ("direct, CUDA cores, register-tiled, FP32", CORES_DIRECT, "float32", "NCHW"),
    ("direct, CUDA cores, register-tiled, FP16", CORES_DIRECT, "float16", "NCHW"),
    ("numba, one thread per output", "numba direct, one thread per output", "float32", "NCHW"),
)


def rows_named(layers: list, name: str, dtype: str, layout: str) -> list:
    """The rows of that kernel, data type and layout, one per layer that has it."""
    return [r for lt in layers for r in lt["rows"] if r["name"] == name and r["dtype"] == dtype
            and r["layout"] == layout]


def _span(values, fmt="{:.2f}") -> str:
    return fmt.format(min(values)) + (" to " + fmt.format(max(values)) if max(values) > min(values) else "")


def kernels_view(layers: list, source: str = "") -> plots.Table:
    """Each kernel of the lesson over the layers: its time over cuDNN's fastest for its data type and layout, its
    TFLOP/s (least to most), and its fastest tile per layer where it tries several. Kernels this GPU or record
    has no row of are left out."""
    out = []
    for label, name, dtype, layout in SUMMARY_ROWS:
        rs = rows_named(layers, name, dtype, layout)
        if rs:
            tiles = ", ".join(r["config"].split("_nhwc")[0].split("_nchw")[0].removeprefix("conv_")
                              + (f"/{r['splits']}" if "splits" in r else "") for r in rs if r.get("config"))
            out.append([label, _span([r["of_cudnn_fastest"] for r in rs]) + "x",
                        _span([r["tflops"] for r in rs], "{:.1f}"), tiles or "-"])
    return plots.table(["kernel", "x cuDNN's fastest", "TFLOP/s", "fastest tile per layer"], out, source=source,
                       title="Each kernel over the three layers")


def cudnn_fastest(lt: dict, dtype: str, layout: str) -> dict:
    """cuDNN's fastest row of a layer for a data type and layout, whatever its math."""
    return min((r for r in lt["rows"] if r["kind"] == "cudnn" and r["dtype"] == dtype and r["layout"] == layout),
               key=lambda r: r["median_ms"])


def cudnn_fastest_math(lt: dict, dtype: str, layout: str, math_: str) -> dict:
    """cuDNN's row of a layer for a data type, layout and math type ("fma", "default", "tensor_op")."""
    return next(r for r in lt["rows"] if r["kind"] == "cudnn" and r["dtype"] == dtype and r["layout"] == layout
                and r["math"] == math_)


def cols_matrix_ms(lt: dict, ceilings: dict) -> float:
    """The time the FP16 im2col matrix of a layer takes to be written once and read once at the GPU's measured copy
    bandwidth (ceilings["copy_gbps"]): what im2col + GEMM pays for its matrix alone."""
    return 2 * lt["im2col_mib"]["float16"] * MIB / (ceilings["copy_gbps"] * 1e9) * 1e3


def ceilings_view(layers: list, ceilings: dict, source: str = "") -> plots.Table:
    """Per layer, cuDNN's fastest algorithm in each data type and layout, and the FP16 im2col matrix's traffic
    alone (written and read at the measured copy bandwidth) against cuDNN's fastest FP16 NHWC convolution."""
    rows = []
    for lt in layers:
        best = {f"{d} {lay}": cudnn_fastest(lt, d, lay) for d in ("float32", "float16") for lay in cv.LAYOUTS}
        cols = cols_matrix_ms(lt, ceilings)
        rows.append([lt["name"].split(":")[0], *(f"{b['algo']}, {b.get('row_math', b['math'])}" for b in best.values()),
                     f"{cols / best['float16 NHWC']['median_ms']:.2f}x"])
    return plots.table(["layer", *(f"cuDNN's fastest, {k}" for k in ("FP32 NCHW", "FP32 NHWC", "FP16 NCHW",
                                                                      "FP16 NHWC")),
                        "cols matrix traffic / cuDNN FP16 NHWC"], rows, source=source,
                       title=f"This GPU's ceilings: SGEMM {ceilings['fp32_tflops']:.0f} TFLOP/s, HGEMM "
                             f"{ceilings['fp16_tflops']:.0f} TFLOP/s, copy {ceilings['copy_gbps']:.0f} GB/s")


def wgmma_conv_view(layers: list, source: str = "") -> plots.Table | None:
    """The wgmma convolution on each layer (its fastest tile), against cuDNN's fastest FP16 NHWC and beside the WMMA
    convolution it replaces; None where no layer has a wgmma row (a GPU without wgmma, or an older record)."""
    rows = []
    for lt in layers:
        t, w = lt["targets"].get("direct (wgmma) float16 NHWC"), lt["targets"].get("direct (tensor cores) float16 NHWC")
        wg = [r for r in lt["rows"] if r["name"] == TC_WGMMA]
        if t is None or not wg:
            continue
        best = min(wg, key=lambda r: r["median_ms"])
        rows.append([lt["name"].split(":")[0], bench.format_ms(best["median_ms"]), best["tflops"],
                     best.get("config", "").removeprefix("conv_wgmma_").removesuffix("_nhwc_f16"),
                     f"{t['ratio']:.2f}x", f"{t['limit']:g}x: {'met' if t['met'] else 'missed'}",
                     f"{w['ratio']:.2f}x" if w else "-"])
    if not rows:
        return None
    return plots.table(["layer", "wgmma + TMA", "TFLOP/s", "tile", "x cuDNN", "goal", "WMMA conv x cuDNN"], rows,
                       source=source, title="The wgmma convolution against cuDNN's fastest FP16 NHWC algorithm")


def im2col_mode(lt: dict) -> dict | None:
    """A layer's fastest wgmma tile as a box of the image and as the TMA's im2col mode, from the same run: their
    times, blocks and the share of the rows computed that are stored; None where the layer has no timings of both
    (a GPU without wgmma, or a record from before the im2col kernels)."""
    row = next((r for r in lt["rows"] if r["name"] == TC_WGMMA and r.get("configs_ms")), None)
    ms = row["configs_ms"] if row else {}
    box = {cfg: v for cfg, v in ms.items() if "_i2c_" not in cfg}
    i2c = {cfg: v for cfg, v in ms.items() if "_i2c_" in cfg}
    if not box or not i2c:
        return None
    b, i = min(box, key=box.get), min(i2c, key=i2c.get)
    n, c, h, w, k, r, s, pad, stride = lt["layer"]
    _, _, P, Q = cv.output_shape((n, c, h, w), (k, c, r, s), pad, stride)
    cb, ci = cv.wgmma_conv_config(b), cv.wgmma_conv_config(i)
    tb = cv.wgmma_conv_tiles(n, P, Q, k, cb["bm"], cb["bn"])
    ti = cv.wgmma_conv_tiles(n, P, Q, k, ci["bm"], ci["bn"], im2col=True)
    return {"box": b, "box_ms": box[b], "box_blocks": tb["grid"][0] * tb["grid"][1], "box_useful": tb["useful"],
            "i2c": i, "i2c_ms": i2c[i], "i2c_blocks": ti["grid"][0] * ti["grid"][1], "i2c_useful": ti["useful"],
            "box_over_i2c": box[b] / i2c[i]}


def im2col_mode_view(layers: list, source: str = "") -> plots.Table | None:
    """im2col_mode for every layer that has it, as a table; None where none has."""
    rows = []
    for lt in layers:
        m = im2col_mode(lt)
        if m:
            tile = lambda cfg: cfg.removeprefix("conv_wgmma_").removesuffix("_nhwc_f16")  # noqa: E731
            rows.append([lt["name"].split(":")[0], f"{bench.format_ms(m['box_ms'])} ({tile(m['box'])})",
                         m["box_blocks"], f"{m['box_useful']:.1%}", f"{bench.format_ms(m['i2c_ms'])} ({tile(m['i2c'])})",
                         m["i2c_blocks"], f"{m['i2c_useful']:.1%}", f"{m['box_over_i2c']:.2f}x"])
    if not rows:
        return None
    return plots.table(["layer", "boxes", "blocks", "rows stored", "im2col mode", "blocks", "rows stored",
                        "box time / im2col"], rows, source=source,
                       title="The fastest wgmma tile as boxes of the image and in the TMA's im2col mode")


def fused_view(fused: dict, source: str = "") -> plots.Table:
    """cudnnConvolutionBiasActivationForward against the convolution followed by a bias + ReLU kernel."""
    rows = [[f"{r['dtype']} {r['layout']}", r["algo"],
             bench.format_ms(r["fused"]["median_ms"]) if r["fused"] else r["status"],
             bench.format_ms(r["separate"]["median_ms"]), bench.format_ms(r["conv_only"]["median_ms"])]
            for r in fused["rows"]]
    return plots.table(["data", "algorithm", "fused", "conv, then bias + ReLU", "conv alone"], rows, source=source,
                       title=f"Convolution + bias + ReLU, {fused['layer']}")


def plot_find(table: list, source: str, title: str, *, timed: bool = True):
    """cuDNN's algorithms for one layer: time of each (µs; the course's timing, or Find's own), with its math
    type and workspace in the label."""
    key = "timed_ms" if timed else "time_ms"
    values = {f"{r['algo']}, {r['math']} ({r['workspace_bytes'] / MIB:.1f} MiB)": r[key] * 1e3
              for r in table if r.get(key) is not None}
    fig = plots.bars(values, unit="µs", source=source, title=title)
    failed = [f"{r['algo']}: {r['status']}" for r in table if r["time_ms"] is None]
    if failed:
        fig.axes[0].set_xlabel("µs   (not run: " + "; ".join(failed) + ")", fontsize=7)
    return fig


def plot_layer(lt: dict, dtype: str, layout: str, source: str):
    """TFLOP/s of every way to run one layer in one data type and layout, against cuDNN's fastest there."""
    rows = [r for r in lt["rows"] if r["dtype"] == dtype and r["layout"] == layout and r["kind"] != "part"]
    best = max((r for r in rows if r["kind"] == "cudnn"), key=lambda r: r["tflops"])
    values = {r["name"]: r["tflops"] for r in rows if r is not best}
    return plots.bars(values, unit="TFLOP/s", source=source, title=f"{lt['name']}, {dtype}, {layout}",
                      ceiling=(best["name"], best["tflops"]))


def plot_tradeoff(layers: list, key: str, source: str):
    """The fastest algorithm's time under each workspace limit, per layer: cuDNN's memory/speed trade-off."""
    series = {}
    for lt in layers:
        pts = [(p["limit_mib"], p["time_ms"] * 1e3) for p in tradeoff(lt["find"][key]) if p["time_ms"] is not None]
        series[lt["name"]] = ([x for x, _ in pts], [y for _, y in pts])
    return plots.lines(series, xlabel="workspace limit (MiB)", ylabel="fastest algorithm within it (µs)",
                       source=source, title=f"Memory against speed ({key})", logx=False, logy=True)


# ------------------------------------------------------------------------------------ what the notebooks say

_holds = claims.holds  # one place for the idea: gpucourse/claims.py


def _ms(layers: list, name: str, dtype: str, layout: str) -> list:
    return [r["median_ms"] for r in rows_named(layers, name, dtype, layout)]


def _decreasing(values: list) -> bool:
    return len(values) > 1 and all(a > b for a, b in zip(values, values[1:]))


def _cols_outlast_cudnn(layers: list, ceilings: dict) -> tuple:
    """The statement the core notebook and its deep dive both make about im2col's cols matrix, and whether it holds."""
    return ("im2col + FP16 GEMM: the cols matrix's traffic alone outlasts cuDNN's FP16 NHWC convolution on the two "
            "larger layers",
            _holds(lambda: all(cols_matrix_ms(lt, ceilings) > cudnn_fastest(lt, "float16", "NHWC")["median_ms"]
                               for lt in layers[:2])))


def reading(layers: list, ceilings: dict) -> list:
    """What notebook 05 says in words about the tables of its sections 4 to 6, each statement with whether it holds
    in ``layers`` (a run's or a record's figure "layers"; ``ceilings`` of the same GPU): [(statement, True, False or
    None)]. Every record holds every statement (a records test asserts it); the notebook checks them on a run beside
    the record (checked_view), as a GPU shared with other work can break them in a run."""
    def target(key):
        return [lt["targets"][key] for lt in layers]

    def cores_ratio_grows():
        ratios = [t["ratio"] for t in target("direct (CUDA cores) float32 NCHW")]
        return len(ratios) > 1 and ratios == sorted(ratios)

    def only_wmma_everywhere():
        every = set.intersection(*({k for k, t in lt["targets"].items() if t["limit"] in (GEMM_GOAL, DIRECT_GOAL) and t["met"]}
                                   for lt in layers))
        return every == {"direct (tensor cores) float16 NHWC"}

    def level(name, dtype):
        times = _ms(layers, name, dtype, "NCHW")
        return len(times) == len(layers) and max(times) < 1.15 * min(times)

    nhwc, nchw = (_ms(layers, "im2col + cuBLAS FP16 GEMM", "float16", lay) for lay in ("NHWC", "NCHW"))
    wmma = [t["ratio"] for t in target("direct (tensor cores) float16 NHWC")]
    return [
        ("im2col + FP16 GEMM: faster in NHWC than in NCHW on every layer",
         _holds(lambda: len(nhwc) == len(nchw) == len(layers) and all(a < b for a, b in zip(nhwc, nchw)))),
        _cols_outlast_cudnn(layers, ceilings),
        ("im2col + FP16 GEMM, NHWC: closer to cuDNN's fastest on each smaller layer",
         _holds(lambda: _decreasing([t["ratio"] for t in target("im2col+GEMM float16 NHWC")]))),
        ("direct on the tensor cores (WMMA): the only kernel of sections 2 and 3 within its target on every layer",
         _holds(only_wmma_everywhere)),
        ("direct on the tensor cores (WMMA): furthest from cuDNN on the 14x14 layer",
         _holds(lambda: len(wmma) > 1 and max(wmma) == wmma[-1])),
        ("CUDA cores: the implicit GEMM faster than the register-tiled kernel on every layer",
         _holds(lambda: all(a < b for a, b in zip(_ms(layers, CORES_IGEMM, "float32", "NCHW"),
                                                  _ms(layers, CORES_DIRECT, "float32", "NCHW"))))),
        ("CUDA cores: each kernel takes about the same time on every layer (within 15%)",
         _holds(lambda: level(CORES_IGEMM, "float32") and level(CORES_DIRECT, "float16"))),
        ("cuDNN's fastest FP32 NCHW algorithm: faster on each deeper layer",
         _holds(lambda: _decreasing([cudnn_fastest(lt, "float32", "NCHW")["median_ms"] for lt in layers]))),
        ("CUDA cores, FP32: the time over cuDNN's fastest grows from the first layer to the last",
         _holds(cores_ratio_grows)),
        ("cuDNN in FP32 NCHW: faster with the default math (TF32 tensor cores) than with FMA math on every layer",
         _holds(lambda: all(cudnn_fastest_math(lt, "float32", "NCHW", "default")["median_ms"]
                            < cudnn_fastest_math(lt, "float32", "NCHW", "fma")["median_ms"] for lt in layers))),
        ("cuDNN in FP16: faster in NHWC than in NCHW on every layer",
         _holds(lambda: all(cudnn_fastest(lt, "float16", "NHWC")["median_ms"]
                            < cudnn_fastest(lt, "float16", "NCHW")["median_ms"] for lt in layers))),
        ("cuDNN's Find: its first choice is not the fastest when timed, in at least one table",
         _holds(lambda: find_agreement(layers)["changed"] >= 1)),
    ]


def wgmma_reading(layers: list, gemms: dict | None, ceilings: dict) -> list:
    """What notebook 05's deep dive says in words, each statement with whether it holds in ``layers`` (a run's or a
    record's figure "layers"), ``gemms`` (lesson 4's figure "wgmma" on the same GPU, or None) and ``ceilings``:
    [(statement, True, False or None)], None where the figures lack it (no wgmma on this GPU, no lesson-4 GEMMs).
    Every Hopper record holds every statement (a records test asserts it)."""
    gap = tensor_core_gap(layers, gemms)
    modes = [im2col_mode(lt) for lt in layers]

    def wgmma_everywhere():
        ts = [(lt["targets"]["direct (wgmma) float16 NHWC"], lt["targets"]["direct (tensor cores) float16 NHWC"])
              for lt in layers]
        return all(t["met"] and t["ratio"] < w["ratio"] for t, w in ts)

    def winograd_above_sgemm():
        fma = [cudnn_fastest_math(lt, "float32", "NCHW", "fma") for lt in layers]
        return any(r["algo"].startswith("WINOGRAD") and r["tflops"] > ceilings["fp32_tflops"] for r in fma)

    def fp16_gains_little():
        f16, f32 = _ms(layers, CORES_DIRECT, "float16", "NCHW"), _ms(layers, CORES_DIRECT, "float32", "NCHW")
        return len(f16) == len(f32) == len(layers) and all(a >= 0.85 * b for a, b in zip(f16, f32))

    def lesson3(test):
        return None if not gap or gap[0]["wmma_tflops"] is None else test()

    return [
        ("WMMA convolution: at most about half the rate of lesson 4's WMMA GEMM on every layer",
         _holds(lambda: lesson3(lambda: all(g["conv_of_wmma"] < 0.55 for g in gap)))),
        ("lesson 4's WMMA GEMM: less than half of cuBLAS",
         _holds(lambda: lesson3(lambda: gap[0]["wmma_tflops"] < 0.5 * gap[0]["gemm_cublas_tflops"]))),
        ("1.5x of cuDNN asks more than 0.8 of the WMMA GEMM's rate on the 28x28 and 14x14 layers",
         _holds(lambda: lesson3(lambda: len(gap) > 1 and all(g["needed_of_wmma"] > 0.8 for g in gap[1:])))),
        ("cuDNN in FP16 NHWC: faster than cuBLAS on the layer's own GEMM on the 56x56 and 28x28 layers",
         _holds(lambda: all(g["cudnn_tflops"] > g["layer_gemm_tflops"] for g in gap[:2]))),
        ("wgmma convolution: within 1.5x of cuDNN, and faster than the WMMA one, on every layer",
         _holds(wgmma_everywhere)),
        ("TMA im2col mode: faster than the best box on the 56x56 layer",
         _holds(lambda: modes[0]["box_over_i2c"] > 1)),
        ("TMA im2col mode: within 10% of the best box, either way, on the 28x28 and 14x14 layers",
         _holds(lambda: len(modes) > 1 and all(0.9 <= m["box_over_i2c"] <= 1.1 for m in modes[1:]))),
        _cols_outlast_cudnn(layers, ceilings),
        ("CUDA cores, strict FP32: slower than cuDNN's fastest FP32 algorithm (TF32) on every layer",
         _holds(lambda: all(t["ratio"] > 1 for t in (lt["targets"]["direct (CUDA cores) float32 NCHW"]
                                                     for lt in layers)))),
        ("cuDNN, strict FP32: a Winograd algorithm fastest on some layer, above the SGEMM ceiling",
         _holds(winograd_above_sgemm)),
        ("register-tiled kernel: FP16 data at most 15% faster than FP32 on every layer", _holds(fp16_gains_little)),
    ]


def checked_view(layers: list, ceilings: dict, source: str, *, gemms: dict | None = None,
                 deep_dive: bool = False) -> plots.Table:
    """The statements of notebook 05 (``deep_dive``: of its deep dive, read with lesson 4's ``gemms``) checked on the
    figures the notebook shows (``source``: their label) and, where those were measured here, on the record of this
    GPU beside them (the newest record where this GPU has none): what a run on a busy GPU breaks shows as a "NO" in
    the run's column only."""
    from gpucourse import records

    def read(lay, ceil, gem):
        return wgmma_reading(lay, gem, ceil) if deep_dive else reading(lay, ceil)

    here = runtime.is_gpu() and source.startswith("measured here")
    checks = {"this run" if here else "the record": read(layers, ceilings, gemms)}
    sources = [f"{'this run' if here else 'the record'}: {source}"]
    if here:
        recs = [r for r in records.all_records(LESSON) if "layers" in r["figures"]]
        mine = [r for r in recs if records.slug(r["gpu"]["name"]) == records.slug(runtime.get().device["name"])]
        rec = (mine or recs or [None])[-1]
        if rec is not None:
            gemm_rec = records.latest(GEMM_LESSON, rec["gpu"]["name"]) if deep_dive else None
            checks["the record"] = read(rec["figures"]["layers"], rec["ceilings"],
                                        (gemm_rec or {}).get("figures", {}).get("wgmma"))
            sources.append(f"the record: {records.label(rec, 'layers')}")
    return reading_view(checks, source="; ".join(sources))


def reading_view(checks: dict, title: str = "What the text says, checked", source: str = "") -> plots.Table:
    """Statements and whether each holds, one column per source (gpucourse.claims.view)."""
    return claims.view(checks, title, source)


# ------------------------------------------------------------------------------------ the registry

FIGURES = {
    "cudnn": Figure(cudnn_info),
    "layers": Figure(all_layers),
    "fused": Figure(fused),
    "race": Figure(race, None, text_race, optional=True, step="05.wgmma"),
    "time_goes": Figure(where_time_goes, plot_time_goes, text_time_goes, optional=True, step="05.wgmma"),
}


# ------------------------------------------------------------------------------------ RESULTS.md

def results_rows(record: dict) -> list:
    """The lesson's headline figures in one record, for RESULTS.md and the README (gpucourse.results): the first row
    is the headline. Each kernel's time over cuDNN's fastest algorithm for the same data type and layout, per
    layer; the wgmma rows are None on a GPU without Hopper's wgmma."""
    from gpucourse import results as R

    f = record["figures"]
    layers = f.get("layers", [])
    sizes = " / ".join(lt["name"].split(":")[1].split(",")[0].strip() if ":" in lt["name"] else lt["name"]
                       for lt in layers)

    def per_layer(name, dtype="float16", layout="NHWC"):
        out = []
        for lt in layers:
            times = [r["of_cudnn_fastest"] for r in lt["rows"] if r["name"] == name and r["dtype"] == dtype
                     and (layout is None or r["layout"] == layout)]
            out.append(min(times) if times else None)
        return out

    wgmma = per_layer(TC_WGMMA)
    race_rows = f.get("race", {}).get("rows", [])

    def raced(shape, kind="persistent"):  # the persistent tiles' time over cuDNN's fastest, in turns, on the race's
        return [r[kind]["of_cudnn"] for r in race_rows  # layers of a shape
                if r["shape"] == shape and (r.get(kind) or {}).get("config")]
    pdl = [R.span(raced(shape, RACE_PDL)) for shape in ("3x3", "1x1")]
    return [
        ("Hopper persistent convolution, time against cuDNN's fastest, 3x3 layers", R.span(raced("3x3")), "race"),
        ("the same, 1x1 layers", R.span(raced("1x1")), "race"),
        ("the same launched with PDL, 3x3 / 1x1 layers", " / ".join(pdl) if all(pdl) else None, "race"),
        ("Hopper wgmma convolution, one tile a block, time against cuDNN's", R.span(wgmma), "layers"),
        (f"the same per layer ({sizes})", R.joined(wgmma), "layers"),
        ("WMMA direct convolution, time against cuDNN's", R.joined(per_layer(TC_DIRECT)), "layers"),
        ("im2col + cuBLAS FP16, time against cuDNN's", R.joined(per_layer("im2col + cuBLAS FP16 GEMM")), "layers"),
        ("CUDA-core FP32 kernel, time against cuDNN's FP32", R.joined(per_layer(CORES_IGEMM, "float32", None)),
         "layers"),
        ("cuDNN version", f.get("cudnn", {}).get("version"), None),
    ]

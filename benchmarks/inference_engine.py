"""Lesson 6's measurements on a GPU, and the figures drawn from them (measured or recorded).

Every function that measures needs GPU mode; every plot function takes the figures plus their source label,
so the notebook draws recorded figures in CPU mode with the same code. ``plot_graph`` draws an engine graph
(any mode).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import inference_engine_network_phases as network_phases
from benchmarks import inference_engine_pytorch as pytorch_reference
from benchmarks import inference_engine_resnet
from gpucourse.records import Figure
from gpucourse import bench, claims, plots, runtime
from kernels import inference_engine as E

# the lesson's model, its engines and their goals: shared with the phases benchmark, which this module imports
from benchmarks.inference_engine_model import (ENGINES, LESSON, load, NETWORK, NETWORK_GOALS, OPTIMISED,  # noqa: F401
                                               TARGETS)

# run() records "pytorch" too (PyTorch beside the engine, or why not: pytorch_table); records made before it have none


def build_engines(stages: list, d: dict, *, max_batch: int | None = None, calibration: str = "percentile") -> dict:
    """{name: (plan, Engine, build seconds)} for every engine of ENGINES. An engine with CUDA graphs and one
    without share a plan (the same kernels, tuned once): only how the host launches them differs."""
    max_batch = max_batch or runtime.size("inference_engine.batch")
    out, plans = {}, {}
    for name, (fused, precision, graphs) in bench.progress(ENGINES.items(), desc="building engines"):
        key = (fused, precision, name.startswith(NETWORK))
        if key not in plans:
            g = stages[-1][1] if fused else stages[0][1]
            t0 = time.perf_counter()
            plan = E.build_plan(g, precision=precision, max_batch=max_batch, x_calib=d["x_calib"],
                                calibration=calibration, name=name.replace(" + graph", ""), fuse_network=key[2])
            plans[key] = (plan, time.perf_counter() - t0)
        plan, build_s = plans[key]
        out[name] = (plan, E.Engine(plan, graphs=graphs), build_s)
    return out


def engine_table(engines: dict, d: dict, *, repeats: int = 30) -> dict:
    """Per engine: kernels per inference and host launches per inference (both counted by the runtime),
    time of one inference at batch 1 and at the plan's max batch, each two ways, images/s, held-out accuracy
    and the largest difference from Keras's logits.

    "end to end" (latency_ms, batch_ms): CUDA events around one call made with the GPU idle, so the host's
    launch work is inside it, as a user waiting for one answer sees it (``bench.time_gpu``, no hold).
    "GPU only" (latency_gpu_ms, batch_gpu_ms): calls queued behind a hold kernel, so the events see only the
    GPU's work (``bench.time_per_call``). Inputs are on the GPU already, in the engine's input buffer, for
    every engine alike."""
    cp = runtime.cupy()
    rng = np.random.default_rng(0)
    max_batch = next(iter(engines.values()))[0].header["max_batch"]
    x1 = [cp.asarray(d["x_test"][i:i + 1]) for i in rng.choice(len(d["x_test"]), 8, replace=False)]
    xb = [cp.asarray(d["x_test"][rng.choice(len(d["x_test"]), max_batch)]) for _ in range(4)]
    rows = []
    for name, (plan, eng, build_s) in bench.progress(engines.items(), desc="timing engines"):
        logits = E.predict(eng, d["x_test"])
        counts = {}
        for n, xs in ((1, x1), (max_batch, xb)):
            k0, h0 = eng.launches, eng.host_launches
            eng.infer(eng.input_buffer(n))
            counts[n] = (eng.launches - k0, eng.host_launches - h0)
        inputs = {}

        def staged(n, xs):  # the next input, written (untimed) into the engine's input buffer
            it = iter(xs * 10000)

            def setup():
                buf = eng.input_buffer(n)
                buf[...] = next(it)
                return buf
            return setup

        t = {}
        for n, xs in ((1, x1), (max_batch, xb)):
            inputs[n] = staged(n, xs)
            t[n] = bench.time_gpu(lambda x: eng.infer(x), setup=inputs[n], repeats=repeats, warmup=5)
            buf = inputs[n]()
            t[(n, "gpu")] = bench.time_per_call(lambda: eng.infer(buf), batch=8, repeats=max(repeats // 3, 5))
        rows.append({"name": name, "precision": plan.header["precision"], "fused": ENGINES[name][0],
                     "network": name.startswith(NETWORK),
                     "graphs": eng.graphs, "kernels": counts[1][0], "host_launches": counts[1][1],
                     "kernels_batch": counts[max_batch][0], "host_launches_batch": counts[max_batch][1],
                     "plan_kernels": plan.launches,
                     "latency_ms": t[1].median_ms, "latency": t[1].summary(),
                     "latency_gpu_ms": t[(1, "gpu")].median_ms, "latency_gpu": t[(1, "gpu")].summary(),
                     "batch": max_batch, "batch_ms": t[max_batch].median_ms, "batch_timing": t[max_batch].summary(),
                     "batch_gpu_ms": t[(max_batch, "gpu")].median_ms,
                     "batch_gpu_timing": t[(max_batch, "gpu")].summary(),
                     "images_per_s": max_batch / (t[max_batch].median_ms * 1e-3),
                     "accuracy": float(np.mean(logits.argmax(1) == d["y_test"])),
                     "max_diff_keras": float(np.abs(logits - d["keras_logits"]).max()),
                     "build_s": build_s})
    return {"rows": rows, "ratios": ratios(rows), "keras_accuracy": d["keras_accuracy"],
            "test_images": len(d["y_test"]), "targets": TARGETS}


def ratios(rows: list) -> dict:
    """Speed-ups from one run's rows (end-to-end times; larger is faster):
    optimised_vs_layer_{p}_{latency|batch}: layer by layer (eager) over fused + graph, precision p;
    fusion_*: layer by layer over fused (both eager); graphs_*: fused over fused + graph;
    graphs_layer_*: layer by layer over layer by layer + graph; fp16_vs_fp32_batch and int8_vs_fp32_batch:
    fused + graph FP32 over FP16 (INT8) at the max batch, end to end and GPU only."""
    by = {r["name"]: r for r in rows}
    out = {}
    for p in ("FP32", "FP16"):
        layer, layer_g = by[f"layer by layer, {p}"], by[f"layer by layer + graph, {p}"]
        fused, fused_g = by[f"fused, {p}"], by[f"{OPTIMISED}, {p}"]
        for what in ("latency", "batch"):
            key = f"{what}_ms"
            out[f"optimised_vs_layer_{p.lower()}_{what}"] = layer[key] / fused_g[key]
            out[f"fusion_{p.lower()}_{what}"] = layer[key] / fused[key]
            out[f"graphs_{p.lower()}_{what}"] = fused[key] / fused_g[key]
            out[f"graphs_layer_{p.lower()}_{what}"] = layer[key] / layer_g[key]
    fp32, fp16, int8 = (by[f"{OPTIMISED}, {p}"] for p in ("FP32", "FP16", "INT8"))
    out["fp16_vs_fp32_batch"] = fp32["batch_ms"] / fp16["batch_ms"]
    out["fp16_vs_fp32_batch_gpu"] = fp32["batch_gpu_ms"] / fp16["batch_gpu_ms"]
    out["int8_vs_fp32_batch"] = fp32["batch_ms"] / int8["batch_ms"]
    # the network in one kernel, where the run has it: over fused + graph, and its INT8 over its FP16 at the max batch
    one = {p: by.get(f"{NETWORK}, {p}") for p in ("FP32", "FP16", "INT8")}
    for p, r in one.items():
        if r is not None:
            for what in ("latency", "batch"):
                out[f"network_vs_fused_{p.lower()}_{what}"] = by[f"{OPTIMISED}, {p}"][f"{what}_ms"] / r[f"{what}_ms"]
    if one["FP16"] is not None and one["INT8"] is not None:
        out["network_int8_vs_fp16_batch"] = one["FP16"]["batch_ms"] / one["INT8"]["batch_ms"]
        out["network_int8_vs_fp16_batch_gpu"] = one["FP16"]["batch_gpu_ms"] / one["INT8"]["batch_gpu_ms"]
    return out


def targets_met(table: dict) -> dict:
    """{target: (ratio, goal, met)} for the lesson's goals, from a table of ``engine_table``."""
    q, t = table["ratios"], table["targets"]
    out = {f"fused + graph over layer by layer, {p.upper()}, {'batch 1' if w == 'latency' else 'batch ' + str(table['rows'][0]['batch'])}":
           (q[f"optimised_vs_layer_{p}_{w}"], t["optimised_vs_layer"]) for p in ("fp32", "fp16") for w in ("latency", "batch")}
    out[f"FP16 over FP32 (fused + graph), batch {table['rows'][0]['batch']}"] = (q["fp16_vs_fp32_batch"], t["fp16_vs_fp32"])
    return {k: (r, goal, r >= goal) for k, (r, goal) in out.items()}


def tuning_table(engines: dict) -> dict:
    """{engine: [{layer, kernel chosen, tuning_ms: {candidate: ms}}]} from the plans' auto-tuning."""
    plans = {plan.header["name"]: plan for plan, _, _ in engines.values()}  # engines with and without graphs share one
    return {name: [{"layer": s["name"], "kernel": s["kernel"], "tuning_ms": s["tuning"],
                    "rejected": s.get("rejected", [])}
                   for s in plan.steps if s["kind"] == "conv"] for name, plan in plans.items()}


def calibration_table(stages: list, d: dict) -> dict:
    """INT8 accuracy on the held-out digits for each calibration method (fused engine, this mode's runtime)."""
    rows = []
    for method in bench.progress(E.CALIBRATIONS, desc="calibration methods"):
        plan = E.build_plan(stages[-1][1], precision="int8", max_batch=runtime.size("inference_engine.batch"),
                            x_calib=d["x_calib"], calibration=method, tune=False)
        logits = E.predict(E.Engine(plan), d["x_test"])
        rows.append({"method": method, "accuracy": float(np.mean(logits.argmax(1) == d["y_test"])),
                     "max_diff_keras": float(np.abs(logits - d["keras_logits"]).max())})
    return {"rows": rows, "calibration_images": len(d["x_calib"]), "keras_accuracy": d["keras_accuracy"]}


def plan_round_trip(plan: E.Plan, d: dict, build_s: float) -> dict:
    """Save a plan, load it back (no optimisation, no tuning), and check it computes the same logits."""
    with tempfile.TemporaryDirectory() as tmp:
        path = plan.save(Path(tmp) / "engine.plan")
        t0 = time.perf_counter()
        again = E.Engine(E.load_plan(path))
        load_s = time.perf_counter() - t0
        same = np.array_equal(E.predict(E.Engine(plan), d["x_test"]), E.predict(again, d["x_test"]))
        return {"bytes": path.stat().st_size, "build_s": build_s, "load_s": load_s, "same_logits": bool(same),
                "precision": plan.header["precision"], "target": plan.header["target"]}


def _fused_launcher(handle, cudnn, x, w, b, y, xd, fd, conv, yd, bias_desc, act, algo: str):
    """A function of no arguments that calls cudnnConvolutionBiasActivationForward with every descriptor, the
    workspace and the stream prepared once (what an engine built on cuDNN does at build time), so that
    timing sees cuDNN's call, not Python building descriptors."""
    import ctypes

    lib = cudnn.load()
    nbytes = handle.workspace_size(xd, fd, conv, yd, algo)
    ws = handle._workspace_ptr(nbytes)
    handle._bind_stream()
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    vp = ctypes.c_void_p
    call = (handle.ptr, ctypes.byref(one), xd.ptr, vp(x.data.ptr), fd.ptr, vp(w.data.ptr), conv.ptr,
            cudnn.FWD_ALGO[algo], vp(ws), nbytes, ctypes.byref(zero), yd.ptr, vp(y.data.ptr), bias_desc.ptr,
            vp(b.data.ptr), act.ptr, yd.ptr, vp(y.data.ptr))
    fn = lib.cudnnConvolutionBiasActivationForward
    keep = (x, w, b, y, one, zero)

    def launch():
        cudnn.check("cudnnConvolutionBiasActivationForward", fn(*call), lib)
        return keep[3]

    return launch


def cudnn_table(engines: dict, repeats: int = 10) -> dict:
    """The engine's fused 3x3 CBR layer (branch3x3: batch x 16 x 16 x 32 -> 32 channels) beside cuDNN's
    cudnnConvolutionBiasActivationForward on the same shape, NHWC, FP32 (strict FMA math) and FP16 (tensor
    cores). cuDNN comes through lesson 5's binding (systems/convolution/cudnn.py) with its descriptors built once. Every
    forward algorithm is tried for the fused call: those cuDNN refuses (with a ReLU, its legacy API allows
    few) are listed as refused, the others are checked against NumPy and timed, and the fastest is the one
    compared. Both sides are timed alike: GPU time per launch, launches queued behind a hold
    (``bench.time_per_call``)."""
    try:
        from systems.convolution import cudnn
    except Exception as exc:
        return {"available": False, "why": f"systems.convolution.cudnn could not be imported ({type(exc).__name__}: {exc})"}
    if not cudnn.is_available():
        return {"available": False, "why": "libcudnn was not found on this machine"}
    cp = runtime.cupy()
    rows = []
    with cudnn.Handle() as handle:
        for name, math_ in (("fused + graph, FP32", "fma"), ("fused + graph, FP16", "tensor_op")):
            plan, _, _ = engines[name]
            eng = E.Engine(plan, graphs=False)
            step = next(s for s in plan.steps if s["kind"] == "conv" and s["kh"] == 3 and s["src"]["C"] > 1)
            n, src, k, kh = plan.header["max_batch"], step["src"], step["K"], step["kh"]
            h, w, c = src["H"], src["W"], src["C"]
            dtype = "float32" if plan.header["precision"] == "fp32" else "float16"
            wt = plan.arrays[f"{step['id']}/w"].reshape(kh, kh, c, k)
            b = plan.arrays[f"{step['id']}/b"]
            x = cp.asarray(np.random.default_rng(1).random((n, h, w, c), np.float32).astype(dtype))
            y = cp.full((n, h, w, k), cp.nan, dtype)
            ref = E.cbr_spec(x.get(), wt, b)
            algos = {}
            try:
                with cudnn.TensorDescriptor((n, c, h, w), dtype, "NHWC") as xd, \
                        cudnn.FilterDescriptor((k, c, kh, kh), dtype, "NHWC") as fd, \
                        cudnn.ConvolutionDescriptor(pad=kh // 2, compute="float32", math=math_) as conv, \
                        cudnn.TensorDescriptor((n, k, h, w), dtype, "NHWC") as yd, \
                        cudnn.TensorDescriptor((1, k, 1, 1), dtype, "NCHW") as bias_desc, \
                        cudnn.ActivationDescriptor("relu") as act:
                    w_dev = cp.asarray(np.ascontiguousarray(wt.transpose(3, 0, 1, 2)))  # K x R x S x C
                    bias = cp.asarray(b.astype(dtype))
                    for algo in cudnn.FWD_ALGOS:
                        try:
                            launch = _fused_launcher(handle, cudnn, x, w_dev, bias, y, xd, fd, conv, yd, bias_desc,
                                                     act, algo)
                            y.fill(cp.nan)
                            launch()
                            cp.cuda.Device().synchronize()
                        except runtime.CourseError as exc:
                            algos[algo] = {"status": "refused", "why": str(exc)[:160]}
                            continue
                        err = float(np.abs(y.get().astype(np.float64) - ref).max() / np.abs(ref).max())
                        t = bench.time_per_call(launch, batch=8, repeats=repeats)
                        algos[algo] = {"status": "ok", "error": err, "ms": t.median_ms}
            except runtime.CourseError as exc:
                rows.append({"engine": name, "status": str(exc)[:300], "algorithms": algos})
                continue
            tol = 1e-5 if dtype == "float32" else 2e-3
            ok = {a: r for a, r in algos.items() if r["status"] == "ok" and r["error"] < tol}
            if not ok:
                rows.append({"engine": name, "status": "no algorithm of cuDNN ran this fused call correctly",
                             "algorithms": algos})
                continue
            best = min(ok, key=lambda a: ok[a]["ms"])
            eng.infer(cp.asarray(np.random.default_rng(2).random((n, *plan.header["input_shape"]), np.float32)))
            t_ours = bench.time_per_call(lambda: eng.run_step(step["id"], n), batch=8, repeats=repeats)
            rows.append({"engine": name, "layer": step["name"], "shape": [n, h, w, c, k, kh], "dtype": dtype,
                         "math": math_, "status": "ok", "cudnn_algo": best, "cudnn_error": ok[best]["error"],
                         "cudnn_ms": ok[best]["ms"], "algorithms": algos, "ours_ms": t_ours.median_ms,
                         "ours_kernel": step["kernel"], "ours_over_cudnn": t_ours.median_ms / ok[best]["ms"],
                         "timing": "GPU time per launch (bench.time_per_call, hold)"})
    return {"available": True, "cudnn_version": cudnn.version(), "rows": rows}


def run() -> tuple:
    """Every measurement of the lesson: (figures, ceilings), for `python -m gpucourse record`."""
    ceilings = bench.measure_ceilings().as_dict()
    g, stages, d = load()
    engines = build_engines(stages, d)
    figures = {"model": measure_model()}
    figures["engines"] = engine_table(engines, d)
    figures["calibration"] = calibration_table(stages, d)
    figures["tuning"] = tuning_table(engines)
    plan, _, build_s = engines["fused + graph, FP16"]
    figures["plan"] = plan_round_trip(plan, d, build_s)
    figures["cudnn"] = cudnn_table(engines)
    figures["pytorch"] = pytorch_table(g, engines, d)
    figures["network_phases"] = network_phases.measure()
    return figures, ceilings


def pytorch_table(g: E.Graph, engines: dict, d: dict, **kwargs) -> dict:
    """PyTorch beside the fused + graph engines, on the same weights and images, with the same timer
    (``pytorch_reference.table``), or why not. It never raises: PyTorch is a comparison, not a course
    dependency, so a missing or failing PyTorch costs the record this entry and nothing else."""
    try:
        return pytorch_reference.table(g, engines, d, **kwargs)
    except Exception as exc:
        return {"available": False, "why": f"failed: {pytorch_reference._one_line(exc)}"}


# ------------------------------------------------------------------------------------ text and plots

def engine_text(table: dict) -> str:
    b = table["rows"][0]["batch"]
    lines = [f"{'engine':30} {'kernels':>7} {'host':>5} {'batch 1':>9} {'(GPU)':>9} {'batch ' + str(b):>10} "
             f"{'(GPU)':>9} {'images/s':>10} {'accuracy':>9}",
             f"{'':30} {'':>7} {'calls':>5} {'end-to-end':>9} {'only':>9} {'end-to-end':>10} {'only':>9}"]
    for r in table["rows"]:
        lines.append(f"{r['name']:30} {r['kernels']:7d} {r['host_launches']:5d} {bench.format_ms(r['latency_ms']):>9} "
                     f"{bench.format_ms(r['latency_gpu_ms']):>9} {bench.format_ms(r['batch_ms']):>10} "
                     f"{bench.format_ms(r['batch_gpu_ms']):>9} {r['images_per_s']:10,.0f} {100 * r['accuracy']:8.2f}%")
    q = table["ratios"]
    for p in ("fp32", "fp16"):
        lines.append(f"{p.upper()}, end to end, batch 1 / batch {b}: fusion {q[f'fusion_{p}_latency']:.2f}x / "
                     f"{q[f'fusion_{p}_batch']:.2f}x, graphs on top {q[f'graphs_{p}_latency']:.2f}x / "
                     f"{q[f'graphs_{p}_batch']:.2f}x, both (fused + graph over layer by layer) "
                     f"{q[f'optimised_vs_layer_{p}_latency']:.2f}x / {q[f'optimised_vs_layer_{p}_batch']:.2f}x")
    lines.append(f"FP16 over FP32 (fused + graph) at batch {b}: {q['fp16_vs_fp32_batch']:.2f}x end to end, "
                 f"{q['fp16_vs_fp32_batch_gpu']:.2f}x GPU only; INT8 over FP32: {q['int8_vs_fp32_batch']:.2f}x. "
                 f"Keras's accuracy: {100 * table['keras_accuracy']:.2f}% on {table['test_images']} held-out digits")
    for what, (ratio, goal, met) in targets_met(table).items():
        lines.append(f"target {what}: {ratio:.2f}x (goal {goal:g}x) {'met' if met else 'NOT met'}")
    if "network_vs_fused_fp16_latency" in q:
        lines.append(f"{NETWORK} over {OPTIMISED}, batch 1 / batch {b}: " + ", ".join(
            f"{p.upper()} {q[f'network_vs_fused_{p}_latency']:.2f}x / {q[f'network_vs_fused_{p}_batch']:.2f}x"
            for p in ("fp32", "fp16", "int8") if f"network_vs_fused_{p}_latency" in q))
    if "network_int8_vs_fp16_batch" in q:
        r, goal = q["network_int8_vs_fp16_batch"], NETWORK_GOALS["int8_vs_fp16_batch"]
        lines.append(f"target {NETWORK}, INT8 over FP16, batch {b}: {r:.2f}x end to end, "
                     f"{q['network_int8_vs_fp16_batch_gpu']:.2f}x GPU only (goal {goal:g}x) "
                     f"{'met' if r >= goal else 'NOT met'}")
    return "\n".join(lines)


def _us(ms) -> str:
    return bench.format_ms(ms) if ms else "—"


def engines_view(table: dict, source: str = "") -> plots.Table:
    """The engines table as a notebook shows it (HTML; aligned text in a terminal): per engine its kernels and host
    launches per inference, batch 1 and the max batch end to end and GPU only, images/s and accuracy."""
    b = table["rows"][0]["batch"]
    rows = [[r["name"], r["kernels"], r["host_launches"], _us(r["latency_ms"]), _us(r["latency_gpu_ms"]),
             _us(r["batch_ms"]), _us(r["batch_gpu_ms"]), f"{r['images_per_s']:,.0f}", f"{100 * r['accuracy']:.2f}%"]
            for r in table["rows"]]
    return plots.table(["engine", "kernels", "host launches", "batch 1", "(GPU only)", f"batch {b}", "(GPU only)",
                        "images/s", "accuracy"], rows, align="lrrrrrrrr",
                       title="One inference, end to end and GPU only", source=source)


def ratio_lines(table: dict) -> list:
    """The engines table's speed-ups and targets, one short line each (at most 100 characters)."""
    q, b = table["ratios"], table["rows"][0]["batch"]
    lines = []
    for p in ("fp32", "fp16"):
        lines.append(f"{p.upper()}, end to end, batch 1 / batch {b}: fusion {q[f'fusion_{p}_latency']:.2f}x / "
                     f"{q[f'fusion_{p}_batch']:.2f}x, a graph on top {q[f'graphs_{p}_latency']:.2f}x / "
                     f"{q[f'graphs_{p}_batch']:.2f}x")
        lines.append(f"      both (fused + graph over layer by layer): {q[f'optimised_vs_layer_{p}_latency']:.2f}x / "
                     f"{q[f'optimised_vs_layer_{p}_batch']:.2f}x")
    lines.append(f"FP16 over FP32 (fused + graph), batch {b}: {q['fp16_vs_fp32_batch']:.2f}x end to end, "
                 f"{q['fp16_vs_fp32_batch_gpu']:.2f}x GPU only; INT8 over FP32 {q['int8_vs_fp32_batch']:.2f}x")
    for what, (ratio, goal, met) in targets_met(table).items():
        lines.append(f"target {what}: {ratio:.2f}x (goal {goal:g}x) {'met' if met else 'NOT met'}")
    for p in ("fp32", "fp16", "int8"):
        if f"network_vs_fused_{p}_latency" in q:
            lines.append(f"{NETWORK}, {p.upper()}, over {OPTIMISED}: {q[f'network_vs_fused_{p}_latency']:.2f}x at "
                         f"batch 1, {q[f'network_vs_fused_{p}_batch']:.2f}x at batch {b}")
    if "network_int8_vs_fp16_batch" in q:
        r, goal = q["network_int8_vs_fp16_batch"], NETWORK_GOALS["int8_vs_fp16_batch"]
        lines.append(f"target {NETWORK}, INT8 over FP16, batch {b}: {r:.2f}x end to end (goal {goal:g}x) "
                     f"{'met' if r >= goal else 'NOT met'}")
    return lines


def tuning_view(tuning: dict, name: str, source: str = "", batch: int | None = None) -> plots.Table:
    """What the tuner chose for each convolution of engine ``name`` (a key of ``tuning_table``): the kernel kept and
    its time, the runner-up, and how many candidates were timed."""
    rows = []
    for r in tuning[name]:
        times = sorted(r["tuning_ms"].items(), key=lambda kv: kv[1])
        kept = r["tuning_ms"].get(r["kernel"])
        second = next(((k, v) for k, v in times if k != r["kernel"]), (None, None))
        rows.append([r["layer"], r["kernel"], _us(kept), second[0] or "—", _us(second[1]), len(times),
                     len(r.get("rejected", []))])
    at = f" at batch {batch}" if batch else ""
    return plots.table(["layer", "kernel kept", "its time", "next fastest", "its time", "timed", "wrong"], rows,
                       align="llrlrrr", title=f"{name}: each convolution's kernel, timed on the GPU{at}",
                       source=source)


def tuning_reading(tuning: dict) -> list:
    """What the deep dive of lesson 6 says of the tuner's tables (section 1), each statement with whether it holds in
    ``tuning`` (a run's or a record's figure "tuning"): [(statement, True, False or None)]. A records test asserts
    every statement on every record."""
    def kept(name):
        return {r["layer"]: r["kernel"] for r in tuning[name]}

    def wide_beats_narrow():
        pairs = [([v for k, v in r["tuning_ms"].items() if k.startswith("wmmav_")],
                  [v for k, v in r["tuning_ms"].items() if k.startswith("wmma_")]) for r in tuning["fused, FP16"]]
        pairs = [(w, n) for w, n in pairs if w and n]
        return all(max(w) < min(n) for w, n in pairs) if pairs else None

    return [
        ("FP16: every 16-byte WMMA tile faster than every 2-byte one, on each layer both can run",
         claims.holds(wide_beats_narrow)),
        ("FP32: the direct kernels kept on the 3 x 3 and 5 x 5 layers",
         claims.holds(lambda: kept("fused, FP32")["branch3x3"].startswith("direct3")
                      and kept("fused, FP32")["branch5x5"].startswith("direct5"))),
        ("FP16: the direct kernels on the tensor cores kept on the 3 x 3 and 5 x 5 layers",
         claims.holds(lambda: kept("fused, FP16")["branch3x3"].startswith("tcd3")
                      and kept("fused, FP16")["branch5x5"].startswith("tcd5"))),
    ]


def tuning_candidates_view(tuning: dict, name: str, source: str = "") -> plots.Table:
    """Every candidate's time for every convolution of engine ``name``: a row per candidate kernel, a column per
    layer; the kernel kept marked with *."""
    layers = tuning[name]
    kernels = list(dict.fromkeys(k for r in layers for k in r["tuning_ms"]))
    rows = [[k] + [(_us(r["tuning_ms"][k]) + (" *" if r["kernel"] == k else "")) if k in r["tuning_ms"] else ""
                   for r in layers] for k in kernels]
    return plots.table(["candidate"] + [r["layer"].replace("+", " + ") for r in layers], rows,
                       align="l" + "r" * len(layers), title=f"{name}: every candidate's time (* kept)", source=source)


def cudnn_view(cudnn: dict, source: str = "") -> plots.Table | str:
    """The fused 3x3 layer beside cuDNN's fused call (``cudnn_table``), a row per precision; or why not."""
    if not cudnn.get("available"):
        return f"no comparison with cuDNN: {cudnn.get('why')}"
    rows = []
    for r in cudnn.get("rows", []):
        if r["status"] != "ok":
            rows.append([r["engine"], r["status"][:60], "", "", "", "", ""])
            continue
        n, h, w, c, k, kh = r["shape"]
        rows.append([r["dtype"], f"{n} x {h} x {w} x {c} -> {k}, {kh}x{kh}", f"{r['ours_kernel']}",
                     _us(r["ours_ms"]), f"{r['cudnn_algo']} ({r['math']})", _us(r["cudnn_ms"]),
                     f"{r['ours_over_cudnn']:.2f}x"])
    return plots.table(["type", "layer", "this engine's kernel", "its time", "cuDNN's algorithm", "its time",
                        "engine / cuDNN"], rows, align="lllrlrr",
                       title="The fused 3x3 layer beside cudnnConvolutionBiasActivationForward (GPU time a launch)",
                       source=source)


def plot_engines(table: dict, source: str, what: str = "latency"):
    """Bars per engine: "latency" (batch 1, end to end, µs), "latency_gpu" (batch 1, GPU only, µs),
    "throughput" (images/s at the max batch), "kernels" (kernels per inference) or "host_launches"."""
    rows = table["rows"]
    if what in ("latency", "latency_gpu"):
        key, how = ("latency_ms", "end to end") if what == "latency" else ("latency_gpu_ms", "GPU only")
        values = {r["name"]: r[key] * 1000 for r in rows}
        return plots.bars(values, unit="µs", source=source, title=f"Latency of one inference, batch 1, {how}")
    if what == "throughput":
        values = {r["name"]: r["images_per_s"] for r in rows}
        return plots.bars(values, unit="images/s", source=source,
                          title=f"Throughput at batch {rows[0]['batch']}")
    if what in ("kernels", "host_launches"):
        title = "Kernels per inference" if what == "kernels" else "Host launches per inference"
        return plots.bars({r["name"]: r[what] for r in rows}, unit="launches", source=source, title=title)
    raise runtime.CourseInputError("what must be 'latency', 'latency_gpu', 'throughput', 'kernels' or "
                                   f"'host_launches', not {what!r}")


COLOURS = {"Conv": "#9ecae1", "BiasAdd": "#c6dbef", "BatchNorm": "#fdd0a2", "Relu": "#c7e9c0",
           "MaxPool": "#dadaeb", "Concat": "#fcbba1", "AvgPool": "#e5e5e5", "Flatten": "#e5e5e5", "Dense": "#fee391",
           "CBR": "#6baed6", "Head": "#fec44f", "input": "#ffffff"}


def plot_graph(g: E.Graph, title: str, ax=None):
    """The graph drawn top to bottom: one box per node (op, name, output shape), arrows for tensors; a
    dashed arrow is a slice written straight into a concatenated tensor."""
    import matplotlib.pyplot as plt

    depth = {g.input: 0}
    sources = {}  # node name -> [(source name, dashed)]
    for n in g.nodes:
        srcs = []
        for t in n.inputs:
            srcs += _sources(g, t)
        sources[n.name] = srcs
        depth[n.name] = 1 + max(depth[s] for s, _ in srcs)
    rows = {}
    for name, dep in depth.items():
        rows.setdefault(dep, []).append(name)
    pos = {}
    for dep, names in rows.items():
        for i, name in enumerate(names):
            pos[name] = (i - (len(names) - 1) / 2, -dep)
    if ax is None:
        width = max(len(v) for v in rows.values())
        _, ax = plt.subplots(figsize=(max(6, 2.6 * width), 1.0 * len(rows) + 1))
    nodes = {n.name: n for n in g.nodes}
    for name, (x, y) in pos.items():
        n = nodes.get(name)
        op = n.op if n else "input"
        label = f"{op}\n{_short(name)}\n{g.shapes[n.outputs[0]] if n else g.shapes[g.input]}"
        ax.text(x, y, label, ha="center", va="center", fontsize=7,
                bbox={"boxstyle": "round,pad=0.3", "fc": COLOURS.get(op, "white"), "ec": "grey"})
    for name, srcs in sources.items():
        for s, dashed in srcs:
            (x0, y0), (x1, y1) = pos[s], pos[name]
            ax.annotate("", xy=(x1, y1 + 0.28), xytext=(x0, y0 - 0.28),
                        arrowprops={"arrowstyle": "->", "color": "tab:red" if dashed else "grey",
                                    "ls": "--" if dashed else "-"})
    xs = [p[0] for p in pos.values()]
    ax.set_xlim(min(xs) - 0.8, max(xs) + 0.8)
    ax.set_ylim(-max(depth.values()) - 0.6, 0.6)
    ax.axis("off")
    ax.set_title(f"{title}: {len(g.nodes)} nodes", fontsize=10)
    return ax.figure


def _sources(g: E.Graph, t: str) -> list:
    if t == g.input:
        return [(g.input, False)]
    p = g.producer(t)
    if p is not None:
        return [(p.name, False)]
    return [(g.producer(s).name, True) for s, (tgt, _) in g.aliases.items() if tgt == t]


def _short(name: str, width: int = 24) -> str:
    return name if len(name) <= width else name[:width - 1] + "…"


# ------------------------------------------------------------------------------------ the registry

def _built() -> tuple:
    """(graph, stages, data, engines): what every figure of the lesson measures, built once a call."""
    g, stages, d = load()
    return g, stages, d, build_engines(stages, d)


def measure_model() -> dict:
    g, stages, d = load()
    return {"nodes": {name: len(s.nodes) for name, s in stages}, "ops": {name: s.ops() for name, s in stages},
            "keras_accuracy": d["keras_accuracy"], "batch": runtime.size("inference_engine.batch")}


def measure_engines() -> dict:
    g, stages, d, engines = _built()
    return engine_table(engines, d)


def measure_calibration() -> dict:
    g, stages, d = load()
    return calibration_table(stages, d)


def measure_tuning() -> dict:
    return tuning_table(_built()[3])


def measure_plan() -> dict:
    g, stages, d, engines = _built()
    plan, _, build_s = engines["fused + graph, FP16"]
    return plan_round_trip(plan, d, build_s)


def measure_cudnn() -> dict:
    return cudnn_table(_built()[3])


def measure_pytorch() -> dict:
    g, stages, d, engines = _built()
    return pytorch_table(g, engines, d)


FIGURES = {  # run() builds the engines once for all of them; alone, each builds what it needs
    "model": Figure(measure_model),
    "engines": Figure(measure_engines, plot_engines, engine_text),
    "calibration": Figure(measure_calibration),
    "tuning": Figure(measure_tuning),
    "plan": Figure(measure_plan),
    "cudnn": Figure(measure_cudnn),
    "pytorch": Figure(measure_pytorch, optional=True),
    # where a call of the one-kernel network spends its time, FP16 and INT8
    # (benchmarks/inference_engine_network_phases.py)
    "network_phases": Figure(network_phases.measure, network_phases.plot, network_phases.text, optional=True),
    # ResNet-50 at 224 x 224 beside PyTorch (benchmarks/inference_engine_resnet.py): its own run, not part of run()'s
    "resnet": Figure(inference_engine_resnet.measure, inference_engine_resnet.plot, inference_engine_resnet.text,
                     optional=True),
    "resnet_compile": Figure(inference_engine_resnet.measure_compile, text=inference_engine_resnet.compile_text,
                             optional=True),
}


# ------------------------------------------------------------------------------------ RESULTS.md

def results_rows(record: dict) -> list:
    """The lesson's headline figures in one record, for RESULTS.md and the README (gpucourse.results): the first row
    is the headline. ResNet-50 against PyTorch's best: the slower of the engine's two ratios, against PyTorch's
    fastest eager or CUDA-graph row (figure "resnet") and against torch.compile in a CUDA graph ("resnet_compile"),
    each ratio from one run."""
    from gpucourse import results as R

    f = record["figures"]
    resnet, compiled = f.get("resnet", {}), f.get("resnet_compile", {})
    engine = resnet.get("engine", {})

    def against_pytorch(n):
        key = f"FP16, batch {n}"
        ratios = []
        rows = [r[f"b{n}"]["ms"] for r in resnet.get("pytorch", {}).get("rows", []) if r.get(f"b{n}", {}).get("ms")]
        if rows and key in engine:
            ratios.append(min(rows) / engine[key]["ms"])
        if compiled.get(f"fp16_vs_compile_b{n}", {}).get("ratio"):
            ratios.append(compiled[f"fp16_vs_compile_b{n}"]["ratio"])
        return min(ratios) if ratios else None

    def over_fp16(key):
        base = engine.get("FP16, batch 64")
        return base["ms"] / engine[key]["ms"] if base and key in engine else None

    q = f.get("engines", {}).get("ratios", {})
    layer = [q.get(f"optimised_vs_layer_{p}_latency") for p in ("fp32", "fp16")]
    net = f.get("pytorch", {}).get("speedups", {}).get("network_fp16_batch")
    batch = f.get("engines", {}).get("rows", [{}])[0].get("batch", 256)
    return [
        ("ResNet-50 FP16, batch 64, speed against PyTorch's best", R.ratio(against_pytorch(64)), "resnet_compile"),
        ("ResNet-50 FP16, batch 1, speed against PyTorch's best", R.ratio(against_pytorch(1)), "resnet_compile"),
        ("ResNet-50 INT8 / FP8, batch 64, speed against FP16",
         R.joined([over_fp16("INT8, batch 64"), over_fp16("FP8, batch 64")]), "resnet"),
        ("digits CNN, fused + graph against layer by layer, batch 1, FP32 / FP16", R.joined(layer), "engines"),
        (f"digits CNN in one kernel, FP16, batch {batch}, speed against PyTorch's best", R.ratio(net), "pytorch"),
        ("PyTorch version", f.get("pytorch", {}).get("torch"), "pytorch"),
    ]

"""Lesson 5's measurements on a GPU, and the figures drawn from them (measured or recorded).

Every function that measures needs GPU mode; every plot function takes the figures plus their source label,
so the notebook draws recorded figures in CPU mode with the same code. ``plot_graph`` draws an engine graph
(any mode).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from gpucourse import bench, plots, runtime
from kernels import engine as E

LESSON = "05_inference_engine"
FIGURES = ("model", "engines", "calibration", "tuning", "plan", "cudnn")  # what run() records
ENGINES = {  # name -> (passes applied, precision)
    "layer by layer, FP32": (False, "fp32"),
    "layer by layer, FP16": (False, "fp16"),
    "fused, FP32": (True, "fp32"),
    "fused, FP16": (True, "fp16"),
    "fused, INT8": (True, "int8"),
}


def load() -> tuple:
    """(imported graph, optimisation stages, data) of the lesson's model file."""
    g, data = E.load_model_file()
    return g, E.optimize(g), E.dataset(data)


def build_engines(stages: list, d: dict, *, max_batch: int | None = None, calibration: str = "percentile") -> dict:
    """{name: (plan, Engine, build seconds)} for every engine of ENGINES."""
    max_batch = max_batch or runtime.size("inference_engine.batch")
    out = {}
    for name, (fused, precision) in bench.progress(ENGINES.items(), desc="building engines"):
        g = stages[-1][1] if fused else stages[0][1]
        t0 = time.perf_counter()
        plan = E.build_plan(g, precision=precision, max_batch=max_batch, x_calib=d["x_calib"],
                            calibration=calibration, name=name)
        out[name] = (plan, E.Engine(plan), time.perf_counter() - t0)
    return out


def engine_table(engines: dict, d: dict, *, repeats: int = 30) -> dict:
    """Per engine: kernel launches per inference (counted by the runtime), latency at batch 1 and time at
    the plan's max batch (CUDA events around one whole inference, inputs already on the GPU), images/s,
    held-out accuracy and the largest difference from Keras's logits."""
    cp = runtime.cupy()
    rng = np.random.default_rng(0)
    max_batch = next(iter(engines.values()))[0].header["max_batch"]
    x1 = [cp.asarray(d["x_test"][i:i + 1]) for i in rng.choice(len(d["x_test"]), 8, replace=False)]
    xb = [cp.asarray(d["x_test"][rng.choice(len(d["x_test"]), max_batch)]) for _ in range(4)]
    rows = []
    for name, (plan, eng, build_s) in bench.progress(engines.items(), desc="timing engines"):
        before = eng.launches
        logits = E.predict(eng, d["x_test"])
        calls = -(-len(d["x_test"]) // max_batch)
        counted = (eng.launches - before) // calls
        it1, itb = iter(x1 * 1000), iter(xb * 1000)
        lat = bench.time_gpu(lambda x: eng.infer(x), setup=lambda: next(it1), repeats=repeats, warmup=5)
        thr = bench.time_gpu(lambda x: eng.infer(x), setup=lambda: next(itb), repeats=repeats, warmup=3)
        rows.append({"name": name, "precision": plan.header["precision"], "fused": ENGINES[name][0],
                     "launches": plan.launches, "launches_counted": counted,
                     "latency_ms": lat.median_ms, "latency": lat.summary(),
                     "batch": max_batch, "batch_ms": thr.median_ms, "batch_timing": thr.summary(),
                     "images_per_s": max_batch / (thr.median_ms * 1e-3),
                     "accuracy": float(np.mean(logits.argmax(1) == d["y_test"])),
                     "max_diff_keras": float(np.abs(logits - d["keras_logits"]).max()),
                     "build_s": build_s})
    by = {r["name"]: r for r in rows}
    ratios = {
        "fused_vs_layer_fp32_latency": by["layer by layer, FP32"]["latency_ms"] / by["fused, FP32"]["latency_ms"],
        "fused_vs_layer_fp32_batch": by["layer by layer, FP32"]["batch_ms"] / by["fused, FP32"]["batch_ms"],
        "fused_vs_layer_fp16_latency": by["layer by layer, FP16"]["latency_ms"] / by["fused, FP16"]["latency_ms"],
        "fused_vs_layer_fp16_batch": by["layer by layer, FP16"]["batch_ms"] / by["fused, FP16"]["batch_ms"],
        "fp16_vs_fp32_fused_batch": by["fused, FP32"]["batch_ms"] / by["fused, FP16"]["batch_ms"],
        "int8_vs_fp32_fused_batch": by["fused, FP32"]["batch_ms"] / by["fused, INT8"]["batch_ms"],
    }
    return {"rows": rows, "ratios": ratios, "keras_accuracy": d["keras_accuracy"], "test_images": len(d["y_test"])}


def tuning_table(engines: dict) -> dict:
    """{engine: [{layer, kernel chosen, tuning_ms: {candidate: ms}}]} from the plans' auto-tuning."""
    return {name: [{"layer": s["name"], "kernel": s["kernel"], "tuning_ms": s["tuning"]}
                   for s in plan.steps if s["kind"] == "conv"] for name, (plan, _, _) in engines.items()}


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


def cudnn_table(engines: dict, repeats: int = 10) -> dict:
    """The engine's fused 3x3 CBR layer (branch3x3: batch x 16 x 16 x 32 -> 32 channels) beside cuDNN's
    cudnnConvolutionBiasActivationForward on the same shape, NHWC, FP32 (strict FMA math) and FP16 (tensor
    cores), each checked against NumPy first and timed back to back (``bench.time_per_call``). cuDNN comes
    through lesson 4's binding (kernels/cudnn.py); its call also builds the bias and activation descriptors
    every time, which is host work that back-to-back timing mostly hides."""
    try:
        from kernels import cudnn
    except Exception as exc:
        return {"available": False, "why": f"kernels.cudnn could not be imported ({type(exc).__name__}: {exc})"}
    if not cudnn.is_available():
        return {"available": False, "why": "libcudnn was not found on this machine"}
    cp = runtime.cupy()
    rows = []
    with cudnn.Handle() as handle:
        for name, math_ in (("fused, FP32", "fma"), ("fused, FP16", "tensor_op")):
            plan, eng, _ = engines[name]
            step = next(s for s in plan.steps if s["kind"] == "conv" and s["kh"] == 3 and s["src"]["C"] > 1)
            n, src, k, kh = plan.header["max_batch"], step["src"], step["K"], step["kh"]
            h, w, c = src["H"], src["W"], src["C"]
            dtype = "float32" if plan.header["precision"] == "fp32" else "float16"
            wt = plan.arrays[f"{step['id']}/w"].reshape(kh, kh, c, k)
            b = plan.arrays[f"{step['id']}/b"]
            x = cp.asarray(np.random.default_rng(1).random((n, h, w, c), np.float32).astype(dtype))
            y = cp.full((n, h, w, k), cp.nan, dtype)
            ref = E.cbr_spec(x.get(), wt, b)
            try:
                with cudnn.TensorDescriptor((n, c, h, w), dtype, "NHWC") as xd, \
                        cudnn.FilterDescriptor((k, c, kh, kh), dtype, "NHWC") as fd, \
                        cudnn.ConvolutionDescriptor(pad=kh // 2, compute="float32", math=math_) as conv, \
                        cudnn.TensorDescriptor((n, k, h, w), dtype, "NHWC") as yd:
                    w_dev = cp.asarray(np.ascontiguousarray(wt.transpose(3, 0, 1, 2)))  # K x R x S x C
                    bias = cp.asarray(b.astype(dtype))

                    def fused_call():
                        handle.convolution_bias_activation_forward(x, w_dev, bias, y, xd, fd, conv, yd,
                                                                   activation="relu", algo="IMPLICIT_PRECOMP_GEMM")

                    fused_call()
                    err = float(np.abs(y.get().astype(np.float64) - ref).max() / np.abs(ref).max())
                    t_cudnn = bench.time_per_call(fused_call, batch=8, repeats=repeats)
            except runtime.CourseError as exc:
                rows.append({"engine": name, "status": str(exc)[:300]})
                continue
            eng.infer(cp.asarray(np.random.default_rng(2).random((n, *plan.header["input_shape"]), np.float32)))
            t_ours = bench.time_per_call(lambda: eng.run_step(step["id"], n), batch=8, repeats=repeats)
            rows.append({"engine": name, "layer": step["name"], "shape": [n, h, w, c, k, kh], "dtype": dtype,
                         "math": math_, "status": "ok", "cudnn_error": err, "cudnn_ms": t_cudnn.median_ms,
                         "ours_ms": t_ours.median_ms, "ours_kernel": step["kernel"],
                         "ours_over_cudnn": t_ours.median_ms / t_cudnn.median_ms})
    return {"available": True, "cudnn_version": cudnn.version(), "rows": rows}


def run() -> tuple:
    """Every measurement of the lesson: (figures, ceilings), for `python -m gpucourse record`."""
    ceilings = bench.measure_ceilings().as_dict()
    g, stages, d = load()
    engines = build_engines(stages, d)
    figures = {"model": {"nodes": {name: len(s.nodes) for name, s in stages}, "ops": {name: s.ops() for name, s in stages},
                         "keras_accuracy": d["keras_accuracy"], "batch": runtime.size("inference_engine.batch")}}
    figures["engines"] = engine_table(engines, d)
    figures["calibration"] = calibration_table(stages, d)
    figures["tuning"] = tuning_table(engines)
    plan, _, build_s = engines["fused, FP16"]
    figures["plan"] = plan_round_trip(plan, d, build_s)
    figures["cudnn"] = cudnn_table(engines)
    return figures, ceilings


# ------------------------------------------------------------------------------------ text and plots

def engine_text(table: dict) -> str:
    lines = [f"{'engine':24} {'launches':>8} {'batch 1':>10} {'batch ' + str(table['rows'][0]['batch']):>10} "
             f"{'images/s':>10} {'accuracy':>9} {'|Δ Keras|':>10}"]
    for r in table["rows"]:
        lines.append(f"{r['name']:24} {r['launches']:8d} {bench.format_ms(r['latency_ms']):>10} "
                     f"{bench.format_ms(r['batch_ms']):>10} {r['images_per_s']:10,.0f} {100 * r['accuracy']:8.2f}% "
                     f"{r['max_diff_keras']:10.2g}")
    q = table["ratios"]
    lines.append(f"fused over layer by layer, FP32: {q['fused_vs_layer_fp32_latency']:.2f}x at batch 1, "
                 f"{q['fused_vs_layer_fp32_batch']:.2f}x at batch {table['rows'][0]['batch']}; FP16: "
                 f"{q['fused_vs_layer_fp16_latency']:.2f}x, {q['fused_vs_layer_fp16_batch']:.2f}x")
    lines.append(f"fused FP16 over fused FP32 at batch {table['rows'][0]['batch']}: {q['fp16_vs_fp32_fused_batch']:.2f}x; "
                 f"INT8 over FP32: {q['int8_vs_fp32_fused_batch']:.2f}x. Keras's accuracy: "
                 f"{100 * table['keras_accuracy']:.2f}% on {table['test_images']} held-out digits")
    return "\n".join(lines)


def plot_engines(table: dict, source: str, what: str = "latency"):
    """Bars per engine: "latency" (batch 1, ms), "throughput" (images/s at the max batch) or "launches"."""
    rows = table["rows"]
    if what == "latency":
        values = {r["name"]: r["latency_ms"] * 1000 for r in rows}
        return plots.bars(values, unit="µs", source=source, title="Latency of one inference, batch 1")
    if what == "throughput":
        values = {r["name"]: r["images_per_s"] for r in rows}
        return plots.bars(values, unit="images/s", source=source,
                          title=f"Throughput at batch {rows[0]['batch']}")
    if what == "launches":
        return plots.bars({r["name"]: r["launches"] for r in rows}, unit="launches", source=source,
                          title="Kernel launches per inference")
    raise runtime.CourseInputError(f"what must be 'latency', 'throughput' or 'launches', not {what!r}")


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

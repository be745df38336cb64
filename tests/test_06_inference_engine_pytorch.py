"""Lesson 6's PyTorch reference (benchmarks/inference_engine_pytorch.py): the imported graph's weights in a torch.nn.Module
give the NumPy reference's and Keras's logits; without PyTorch the benchmark records why instead of failing; the
text and plot of a comparison; the record's comparison, where it has one; and on a GPU the timing path itself.

PyTorch is a benchmark comparison, not a course dependency: the tests that need it are skipped, with the reason,
where it is not installed."""
import sys

import numpy as np
import pytest

from benchmarks import inference_engine as bench_lesson
from benchmarks import inference_engine_pytorch as R
from gpucourse import bench, records, runtime
from kernels import inference_engine as E

pytestmark = pytest.mark.lesson06
LESSON = "06_inference_engine"


@pytest.fixture(scope="module")
def model():
    g, data = E.load_model_file()
    return g, E.dataset(data)


def _torch(cuda: bool = False):
    why = R.unavailable(cuda=cuda)
    if why:
        pytest.skip(why)
    import torch

    return torch


# ------------------------------------------------------------------------------------ the model (CPU)

@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_torch_model_gives_the_reference_logits(model, layout):
    """FP32 on the CPU: the NumPy reference's logits (float64) to 1e-4 of their size, Keras's to 1e-3 (the
    engine's own test), in either memory layout, over several batches."""
    _torch()
    g, d = model
    x = d["x_test"][:24]
    want = E.run_graph(g, x)
    m = R.torch_model(g, layout=layout)
    got = R.logits(m, x, batch=10)
    assert got.dtype == np.float32 and got.shape == (24, 10)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert np.abs(got - d["keras_logits"][:24]).max() < 1e-3
    assert not m.training and not any(p.requires_grad for p in m.parameters())


def test_torch_model_is_the_keras_layers(model):
    """Each Keras layer as the PyTorch layer a port uses: a Conv2D (Conv then BiasAdd in the graph) is one
    Conv2d with its bias, kernels turned from kh x kw x C x K to K x C x kh x kw; batch norm with Keras's eps;
    a stride-1 "same" max pool."""
    torch = _torch()
    g, _ = model
    m = R.torch_model(g)
    kinds = [type(layer).__name__ for layer in m.layers]
    assert kinds.count("Conv2d") == 7 and kinds.count("BiasAdd") == 0 and kinds.count("ReLU") == 7
    assert kinds.count("BatchNorm2d") == kinds.count("MaxPool2d") == kinds.count("AvgPool2d") == kinds.count("Linear") == 1
    stem = next(n for n in g.nodes if n.op == "Conv")
    conv = m.layers[0]
    assert conv.bias is None and conv.padding == (1, 1)  # the stem has no bias: its batch norm follows
    assert np.array_equal(conv.weight.detach().numpy(), stem.weights["w"].transpose(3, 2, 0, 1))
    bn = next(layer for layer in m.layers if isinstance(layer, torch.nn.BatchNorm2d))
    assert bn.eps == next(n for n in g.nodes if n.op == "BatchNorm").attrs["eps"]
    pool = next(layer for layer in m.layers if isinstance(layer, torch.nn.MaxPool2d))
    assert pool.stride == 1 and pool.padding == pool.kernel_size // 2


def test_fp16_torch_model_keeps_the_accuracy(model):
    _torch()
    g, d = model
    m = R.torch_model(g, precision="fp16", layout="contiguous")
    assert next(m.parameters()).dtype.itemsize == 2
    try:
        got = R.logits(m, d["x_test"])
    except RuntimeError as exc:  # an older PyTorch without half-precision convolutions on the CPU
        pytest.skip(f"FP16 on this PyTorch's CPU: {exc}")
    want = E.run_graph(g, d["x_test"])
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()
    assert np.mean(got.argmax(1) == d["y_test"]) >= d["keras_accuracy"] - 0.01


def test_torch_model_refuses_what_it_cannot_build(model):
    _torch()
    g, _ = model
    with pytest.raises(runtime.CourseError, match="op 'CBR' has no PyTorch layer here"):
        R.torch_model(E.optimize(g)[-1][1])
    with pytest.raises(runtime.CourseInputError, match="precision"):
        R.torch_model(g, precision="int8")
    with pytest.raises(runtime.CourseInputError, match="layout"):
        R.torch_model(g, layout="nhwc")


# ------------------------------------------------------------------------------------ without PyTorch

def test_without_torch_the_benchmark_says_why(monkeypatch, model):
    """Where torch cannot be imported, the comparison is a "skipped: ..." entry with the reason: not an exception
    that would lose the rest of run()'s record."""
    g, d = model
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    why = R.unavailable(cuda=False)
    assert why.startswith("torch is not importable here (ModuleNotFoundError") and "not a course dependency" in why
    t = bench_lesson.pytorch_table(g, {}, d)
    assert t == {"available": False, "why": f"skipped: {why}"}
    assert R.text(t) == f"PyTorch beside the engine: skipped: {why}"


def test_a_failing_comparison_is_recorded_not_raised(monkeypatch, model):
    g, d = model

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(R, "table", broken)
    t = bench_lesson.pytorch_table(g, {}, d)
    assert t == {"available": False, "why": "failed: RuntimeError: CUDA error: an illegal memory access was encountered"}


def test_timing_needs_gpu_mode(model):
    _torch()
    if runtime.is_gpu():
        pytest.skip("GPU mode: the timings run (test_pytorch_table_on_a_gpu)")
    g, d = model
    assert R.unavailable() == "timing PyTorch needs GPU mode (CPU mode shows the recorded figures)"
    assert R.table(g, {}, d) == {"available": False, "why": f"skipped: {R.unavailable()}"}


# ------------------------------------------------------------------------------------ text and plot

def _fake_table():
    """A comparison as table() returns it: FP32 where the course engine wins, FP16 at the max batch where it
    does not, and one variant that could not be compiled."""
    rows, course = [], []
    for p, course_ms, torch_ms in (("fp32", (0.10, 0.22), (0.15, 0.30)), ("fp16", (0.09, 0.17), (0.14, 0.16))):
        course.append({"name": f"fused + graph, {p.upper()}", "precision": p, "batch": 256, "latency_ms": course_ms[0],
                       "latency_gpu_ms": course_ms[0] * 0.9, "batch_ms": course_ms[1], "batch_gpu_ms": course_ms[1],
                       "images_per_s": 256 / course_ms[1] * 1e3, "accuracy": 0.977, "max_diff_keras": 1e-5})
        for i, (v, (layout, compiled, graph)) in enumerate(R.VARIANTS.items()):
            row = {"name": f"PyTorch {v}, {p.upper()}", "variant": v, "precision": p, "layout": layout,
                   "compiled": compiled, "graph": graph, "batch": 256, "status": "ok",
                   "latency_ms": torch_ms[0] * (1 + 0.5 * (len(R.VARIANTS) - 1 - i)),
                   "latency_gpu_ms": torch_ms[0] * 0.5, "batch_ms": torch_ms[1] * (1 + 0.1 * (len(R.VARIANTS) - 1 - i)),
                   "batch_gpu_ms": torch_ms[1], "images_per_s": 1e6, "accuracy": 0.977, "max_diff_keras": 2e-5}
            if compiled:
                row.update(compile_s_latency=20.0, compile_s_batch=30.0)
            if p == "fp16" and compiled and not graph:
                row.update(status="batch 256: failed: torch.compile: BackendCompilerFailed: no", batch_ms=None,
                           batch_gpu_ms=None)
            rows.append(row)
    t = {"available": True, "torch": "2.11.0+cu130", "cuda": "13.0", "cudnn": 91900, "compile_mode": R.COMPILE_MODE,
         "tf32": False, "timing": "end to end: bench.time_gpu", "rows": rows, "course": course, "goal": R.GOAL,
         "keras_accuracy": 0.977}
    t.update(R.speedups(t))
    return t


def test_speedups_text_and_plot():
    t = _fake_table()
    q = t["speedups"]
    assert q["fp32_latency"] == pytest.approx(1.5) and t["best"]["fp32_latency"] == "PyTorch torch.compile + CUDA graph, FP32"
    assert q["fp16_batch"] == pytest.approx(0.16 / 0.17)  # the failed row is left out of PyTorch's best
    met = R.targets_met(t)
    assert {what: ok for what, (_, _, ok) in met.items()} == {
        "fused + graph, FP32 over PyTorch's best, batch 1": True, "fused + graph, FP32 over PyTorch's best, batch 256": True,
        "fused + graph, FP16 over PyTorch's best, batch 1": True, "fused + graph, FP16 over PyTorch's best, batch 256": False}
    text = R.text(t)
    for what, (ratio, _, ok) in met.items():
        line = next(line for line in text.splitlines() if line.startswith(what))
        assert f"{ratio:.2f}x end to end" in line and line.endswith("met") and ("NOT met" in line) != ok
    assert "PyTorch torch.compile, FP16: batch 256: failed: torch.compile" in text
    assert "course: fused + graph, FP32" in text and "torch.compile took 20.0 s (FP32, batch 1)" in text
    assert R.text(None) == "PyTorch was not measured on this record."
    fig = R.plot(t, "recorded on NVIDIA H200 on 2026-11-22")
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert len(titles) == 4 and any("FP16, batch 256: course 0.94x" in s for s in titles)
    assert "recorded on NVIDIA H200" in fig._suptitle.get_text()
    with pytest.raises(runtime.CourseError, match="not measured"):
        R.plot(None, "")


def test_the_network_in_one_kernel_is_compared_too():
    """Where the engines include the network in one kernel, its rows ("network") get their own speed-ups over the
    same PyTorch rows (keys network_<precision>_<batch>), comparisons, and lines in the text."""
    t = _fake_table()
    t["network"] = [dict(c, name=c["name"].replace("fused + graph", "one kernel (the network)"),
                         latency_ms=c["latency_ms"] / 2, batch_ms=c["batch_ms"] / 2) for c in t["course"]]
    t.update(R.speedups(t))
    assert t["speedups"]["network_fp16_latency"] == pytest.approx(2 * t["speedups"]["fp16_latency"])
    assert t["speedups"]["fp16_latency"] == _fake_table()["speedups"]["fp16_latency"]  # the course's own unchanged
    met = R.targets_met(t)
    assert met["one kernel (the network), FP16 over PyTorch's best, batch 256"][2]  # 0.16 / 0.085
    text = R.text(t)
    assert "course: one kernel (the network), FP32" in text
    assert "one kernel (the network), FP32 over PyTorch's best, batch 1" in text
    _check_comparison(t)


# ------------------------------------------------------------------------------------ the record

def _check_comparison(t):
    """What a comparison must hold: every variant of each precision, PyTorch's FP32 logits as close to Keras's as
    the engine's, each timed row's times, and speed-ups recomputed from its own rows."""
    assert t["goal"] == R.GOAL and not t["tf32"] and t["compile_mode"] == R.COMPILE_MODE
    assert {(r["variant"], r["precision"]) for r in t["rows"]} == {(v, p) for v in R.VARIANTS for p in R.PRECISIONS}
    assert [c["precision"] for c in t["course"]] == list(R.PRECISIONS)
    for r in t["rows"] + t["course"]:
        if "max_diff_keras" in r:
            assert r["max_diff_keras"] < (1e-3 if r["precision"] == "fp32" else 0.5), r["name"]
            assert r["accuracy"] >= t["keras_accuracy"] - 0.01, r["name"]
    for r in t["rows"]:
        if r["status"] == "ok":
            assert r["latency_ms"] > 0 and r["batch_ms"] > 0, r["name"]
        else:
            assert r["status"].startswith("batch ") and ("failed: " in r["status"] or "skipped: " in r["status"])
    got = R.speedups(t)
    assert got["best"] == t["best"] and got["speedups"] == pytest.approx(t["speedups"])


def test_the_comparison_check_on_a_made_up_comparison():
    _check_comparison(_fake_table())


def test_recorded_pytorch_comparison():
    rec = records.latest(LESSON)
    if rec is None:
        pytest.skip("no GPU record of lesson 6 yet")
    t = rec["figures"].get("pytorch")
    if t is None:
        pytest.skip("PyTorch was not measured on this record")
    if not t["available"]:
        assert t["why"].startswith(("skipped: ", "failed: ")), t
        pytest.skip(f"the record's PyTorch comparison: {t['why']}")
    _check_comparison(t)


# ------------------------------------------------------------------------------------ on a GPU

@pytest.mark.gpu
def test_torch_work_is_timed_on_cupys_stream():
    """bench.time_gpu's events are on CuPy's current stream: torch's work queued inside torch_stream() lies
    between them (a 1 ms spin is timed as about 1 ms); on a stream of torch's own it would not be."""
    torch = _torch(cuda=True)
    cycles = int(runtime.get().device.get("max_sm_clock_mhz", 2000) * 1e3)  # about 1 ms of spinning
    with torch.cuda.stream(R.torch_stream()):
        t = bench.time_gpu(lambda: torch.cuda._sleep(cycles), repeats=5)
    assert t.median_ms > 0.5, t


@pytest.mark.gpu
def test_pytorch_table_on_a_gpu(model):
    """The timing path, short: eager and CUDA-graph rows beside the fused + graph engines (untuned, max batch
    64), every row timed, PyTorch's FP32 logits within the engine's tolerance of Keras's."""
    _torch(cuda=True)
    g, d = model
    stages = E.optimize(g)
    engines = {}
    for p in R.PRECISIONS:
        plan = E.build_plan(stages[-1][1], precision=p, max_batch=64, tune=False)
        engines[f"fused + graph, {p.upper()}"] = (plan, E.Engine(plan, graphs=True), 0.0)
    t = R.table(g, engines, d, repeats=3, variants=("eager, NHWC", "CUDA graph, NCHW"))
    assert t["available"], t
    assert [r["status"] for r in t["rows"]] == ["ok"] * 4, [r["status"] for r in t["rows"]]
    for r in t["rows"]:
        assert r["latency_ms"] > 0 and r["batch_ms"] > 0 and r["batch"] == 64
        assert r["max_diff_keras"] < (1e-3 if r["precision"] == "fp32" else 0.5), r
    assert set(t["speedups"]) >= {"fp32_latency", "fp32_batch", "fp16_latency", "fp16_batch"}
    assert "over PyTorch's best, batch 64" in R.text(t)


def test_recorded_statements_of_notebook_06_on_pytorch_hold_on_every_record():
    """What notebook 06 says about the comparison with PyTorch (R.reading, printed under the tables) holds in every
    record that timed torch.compile: a "NO" there can only come from a record changed under the text."""
    recs = [r for r in records.all_records(LESSON) if (r["figures"].get("pytorch") or {}).get("available")]
    if not recs:
        pytest.skip("no record of lesson 6 with PyTorch")
    for rec in recs:
        read = R.reading(rec["figures"]["pytorch"])
        assert [s for s, holds in read if holds is not True] == [], rec["path"]


def test_the_ahead_line_and_the_statements_follow_the_figures():
    """Reversed figures print the reversed sentence: the engine made slower than PyTorch's best where it was faster
    and faster where it was slower, ahead_line swaps the two lists and the "only in FP32" statement reads False."""
    import copy

    rec = next((r for r in records.all_records(LESSON) if (r["figures"].get("pytorch") or {}).get("available")), None)
    if rec is None:
        pytest.skip("no record of lesson 6 with PyTorch")
    t = copy.deepcopy(rec["figures"]["pytorch"])
    b = t["course"][0]["batch"]
    before = R.ahead_line(t)
    assert before.startswith(f"the fused + graph engine over PyTorch's best: faster in FP32 at batch {b}; slower in")
    for key in list(t["speedups"]):
        t["speedups"][key] = 1 / t["speedups"][key]
    after = R.ahead_line(t)
    assert after.endswith(f"slower in FP32 at batch {b}") and "faster in FP32 at batch 1" in after
    read = dict(R.reading(t))
    assert read[f"the fused + graph engine faster than PyTorch's best only in FP32 at batch {b}"] is False
    assert read["the network in one kernel faster than PyTorch's best in every cell"] is False
    assert read["where the fused + graph engine is slower end to end, it is slower on the GPU alone too"] is True
    without = dict(R.reading(dict(t, rows=[r for r in t["rows"] if "compile" not in r["variant"]])))
    assert without["PyTorch's best: torch.compile + CUDA graph in every cell but FP32 at batch 1"] is None

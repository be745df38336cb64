"""The shared tooling: mode, sizes, the probe text, records, timing arithmetic."""
import json
import os
import time

import pytest

from conftest import needs_compiler

from gpucourse import bench, records, runtime


def test_mode_is_fixed_for_the_process():
    rt = runtime.get()
    other = "cpu" if rt.gpu else "gpu"
    with pytest.raises(runtime.CourseError, match="Restart the kernel"):
        runtime.setup(other, quiet=True)
    with pytest.raises(runtime.CourseInputError, match="mode must be"):
        runtime.setup("tpu", quiet=True)


def test_sizes_follow_the_mode():
    n = runtime.size("vector_multiply.n")
    assert n == (2**29 if runtime.is_gpu() else 10_000)
    with pytest.raises(runtime.CourseInputError, match="no problem size named"):
        runtime.size("nope")


def test_probe_text(capsys):
    text = records.describe("01_vector_multiply")
    assert text.startswith(runtime.describe())
    if runtime.is_gpu():
        assert text.startswith("GPU mode: ") and "compute capability" in text
    else:
        assert text.startswith("CPU mode: kernels run in Numba's CUDA simulator")
        rec = records.latest("01_vector_multiply")
        flat = " ".join(text.split())  # the label's line is wrapped to fit a notebook cell
        assert flat.endswith(f"GPU figures shown are {records.label(rec)}.")
        assert all(len(line) <= 100 for line in text.splitlines())
        assert records.describe("99_none").endswith("No GPU record of lesson 99_none is in this repository yet.")
    import gpucourse

    assert gpucourse.setup(lesson="01_vector_multiply") is runtime.get()  # what a notebook's first cell prints
    assert capsys.readouterr().out == text + "\n"


def _import_graph(root) -> dict:
    """{dotted module: {modules of the same package tree it imports}} for every .py file under the package
    folder ``root``, function-level imports included, relative imports resolved."""
    import ast
    from pathlib import Path

    root = Path(root)
    def dotted(path):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    files = {dotted(p): p for p in root.rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                for a in node.names:
                    deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[mod] = {d for d in deps if d in files} - {mod}
    return graph


def _floors(graph: dict, package: str) -> dict:
    """The import graph between the rooms of ``package`` (its modules and subpackages, by short name);
    imports inside a subpackage are not edges here."""
    def room(mod):
        rest = mod[len(package) + 1:]
        return rest.split(".")[0] if mod.startswith(package + ".") else None
    out = {}
    for mod, deps in graph.items():
        if room(mod) is None:
            continue
        out.setdefault(room(mod), set()).update(r for r in map(room, deps) if r and r != room(mod))
    return out


def _gpucourse_imports() -> dict:
    """{room of gpucourse: {gpucourse rooms it imports}}; a subpackage (gpucourse.grading) is one room."""
    from pathlib import Path

    return _floors(_import_graph(Path(runtime.__file__).parent), "gpucourse")


def _find_cycle(graph: dict) -> list | None:
    """A chain of imports that comes back to where it started, or None."""
    done, path = set(), []

    def visit(mod):
        if mod in path:
            return path[path.index(mod):] + [mod]
        if mod in done:
            return None
        path.append(mod)
        for dep in sorted(graph.get(mod, ())):
            cycle = visit(dep)
            if cycle:
                return cycle
        path.pop()
        done.add(mod)
        return None

    for mod in sorted(graph):
        cycle = visit(mod)
        if cycle:
            return cycle
    return None


def test_tooling_imports_stand_in_floors():
    """runtime imports no other gpucourse module, and no chain of imports comes back to where it started."""
    graph = _gpucourse_imports()
    assert {"runtime", "gpus", "bench", "records", "cli"} <= set(graph)
    assert graph["runtime"] == set(), f"runtime is the ground floor; it imports {graph['runtime']}"
    assert graph["gpus"] <= {"runtime"} and graph["bench"] <= {"runtime"}
    assert "records" in graph["cli"] and "bench" in graph["records"]  # the imports inside functions are seen
    # importing any submodule runs the package's __init__ first: it may import runtime only at its top
    assert _find_cycle({k: v for k, v in graph.items() if k != "__init__"}) is None
    # inside the grading package, its rooms stand in floors too (its __init__ imports them all)
    from pathlib import Path

    grading = _floors(_import_graph(Path(runtime.__file__).parent), "gpucourse.grading")
    assert {"settings", "worker", "kernel", "autograde", "exercises", "cli"} <= set(grading)
    assert _find_cycle({k: v for k, v in grading.items() if k != "__init__"}) is None, grading
    assert "grading" in graph["cli"]
    # the loop this replaced: runtime.describe imported records, records bench, bench records.slug
    cycle = _find_cycle({**graph, "runtime": {"records"}, "bench": {"runtime", "records"}})
    assert cycle and cycle[0] == cycle[-1] and {"bench", "records"} <= set(cycle)


def test_kernels_use_only_the_tooling_below_them():
    """kernels import runtime, gpus, bench and the CUDA C loader of the tooling, nothing above and nothing of systems/
    (which may use kernels); the rooms of the engine and of lesson 7's collectives stand in floors."""
    import ast
    from pathlib import Path

    kernels = Path(runtime.__file__).parents[1] / "kernels"
    allowed = {"gpucourse.runtime", "gpucourse.gpus", "gpucourse.bench", "gpucourse.cuda_c"}
    used = {}
    for path in kernels.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "gpucourse":
                names = {f"gpucourse.{a.name}" for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("gpucourse.", "benchmarks", "systems")):
                names = {node.module}
            elif isinstance(node, ast.Import):
                names = {a.name for a in node.names if a.name.startswith(("gpucourse", "benchmarks", "systems"))}
            else:
                continue
            used.setdefault(str(path.relative_to(kernels)), set()).update(names)
    wrong = {p: sorted(n - allowed) for p, n in used.items() if n - allowed}
    assert not wrong, f"kernels reach above runtime, gpus, bench and cuda_c: {wrong}"
    assert "gpucourse.bench" in used["inference_engine/tuning.py"]  # the scan sees the auto-tuner's timer
    engine = _floors(_import_graph(kernels), "kernels.inference_engine")
    assert {"graph", "plan", "executor", "build", "fused"} <= set(engine)
    assert _find_cycle(engine) is None, engine
    assert "executor" in engine["tuning"] and "tuning" in engine["build"]
    collectives = _floors(_import_graph(kernels), "kernels.collectives")  # lesson 7: gpu -> stream_model -> specs -> model
    assert {"model", "specs", "stream_model", "gpu"} <= set(collectives)
    assert _find_cycle({k: v for k, v in collectives.items() if k != "__init__"}) is None, collectives
    assert collectives["model"] == set() and "specs" in collectives["gpu"] and "stream_model" in collectives["gpu"]


def test_cpu_mode_refuses_to_time():
    if runtime.is_gpu():
        pytest.skip("GPU mode times for real")
    with pytest.raises(runtime.NeedsGPU, match="CUDA events"):
        bench.time_gpu(lambda: None)


def test_timing_statistics():
    t = bench.Timing([1.0, 2.0, 3.0, 4.0, 100.0])
    assert t.median_ms == 3.0 and t.min_ms == 1.0 and t.max_ms == 100.0
    assert t.gbps(3e9) == pytest.approx(1000.0)  # 3 GB in 3 ms
    assert t.tflops(3e12) == pytest.approx(1000.0)
    assert "3 ms median of 5" in str(t)
    assert bench.format_ms(0.08) == "80 µs" and bench.format_ms(1500) == "1.5 s"


def _fake_record(tmp_path, gpu, date, figures):
    doc = {"format": records.FORMAT, "lesson": "99_test", "date": date, "figures": figures, "ceilings": {},
           "gpu": {"name": gpu, "sms": 132, "driver": "13.0"}, "versions": {}}
    path = tmp_path / records.slug(gpu) / "99_test.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def test_bar_labels_keep_small_values_readable():
    """A bar of 1.17 µs is labelled 1.17, not 1; large values stay whole numbers with separators."""
    from gpucourse import plots

    assert [plots.number(v) for v in (1.1716, 8.67, 28.61, 236.0, 4239.4, 0.0123)] == \
        ["1.17", "8.67", "28.6", "236", "4,239", "0.0123"]
    fig = plots.bars({"graph": 1.1716, "one stream": 8.67}, unit="µs", source="test", title="t",
                     ceiling=("floor", 0.5))
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert labels[0].startswith(" 1.17 µs") and "(2.34x)" in labels[0]


def test_records_latest_and_label(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUCOURSE_RESULTS", str(tmp_path))
    assert records.latest("99_test") is None
    with pytest.raises(runtime.CourseError, match="no recorded GPU results"):
        records.load("99_test")
    _fake_record(tmp_path, "NVIDIA H100 80GB HBM3", "2026-11-20 10:00 UTC", {"x": 1})
    _fake_record(tmp_path, "NVIDIA H200", "2026-11-21 10:00 UTC", {"x": 2})
    assert records.latest("99_test")["figures"] == {"x": 2}
    assert records.latest("99_test", gpu="nvidia-h100-80gb-hbm3")["figures"] == {"x": 1}
    assert records.label(records.latest("99_test")) == "recorded on NVIDIA H200 (132 SMs, CUDA driver 13.0) on 2026-11-21"
    figures, source = records.recall("99_test", "x")
    assert figures == 2 and source.startswith("recorded on NVIDIA H200")
    with pytest.raises(runtime.CourseError, match="holds 'y' yet.*record 99_test --figure y"):
        records.recall("99_test", "y")
    figures, why = records.recall("99_test", "y", optional=True)
    assert figures is None and "holds 'y'" in why
    _fake_record(tmp_path, "NVIDIA H100 80GB HBM3", "2026-11-21 12:00 UTC", {"y": 5})  # newer, without "x"
    assert records.recall("99_test", "x")[0] == 2 and records.recall("99_test", "y")[0] == 5
    # a figure added to the record later (record --figure) is labelled with the day it was measured
    _fake_record(tmp_path, "NVIDIA H200", "2026-11-22 10:00 UTC", {"x": 3, "z": {"v": 1, "measured": "2026-11-23 15:39 UTC"}})
    rec = records.latest("99_test")
    assert records.label(rec, "z").endswith("on 2026-11-23") and records.label(rec, "x").endswith("on 2026-11-22")


def test_add_figure_stamps_dicts_and_lists(tmp_path, monkeypatch):
    """record --figure adds a figure measured now to this GPU's newest record: a dict carries its date, a list
    (lesson 5's "layers") has it in the record's "measured"; label and the results page read both."""
    monkeypatch.setenv("GPUCOURSE_RESULTS", str(tmp_path))
    _fake_record(tmp_path, "NVIDIA H200", "2026-11-21 10:00 UTC", {"x": [1], "y": {"v": 1}})
    fake = runtime.Runtime(mode="gpu", reason="test", device={"name": "NVIDIA H200"})
    monkeypatch.setattr(runtime, "get", lambda: fake)
    records.add_figure("99_test", "x", [2, 3])
    records.add_figure("99_test", "y", {"v": 2})
    rec = records.latest("99_test")
    assert rec["figures"]["x"] == [2, 3] and rec["figures"]["y"]["v"] == 2
    dates = records.measured_dates(rec)
    assert set(dates) == {"x", "y"} and records.label(rec, "x").endswith(dates["x"][:10])


def test_a_gpu_recalls_its_own_record_first(tmp_path, monkeypatch):
    """On a GPU, a figure this run does not measure comes from this GPU's record where there is one (the prose
    beside it describes the GPU in front of the learner), else from the newest record; CPU mode takes the newest."""
    monkeypatch.setenv("GPUCOURSE_RESULTS", str(tmp_path))
    _fake_record(tmp_path, "NVIDIA H100 80GB HBM3", "2026-11-20 10:00 UTC", {"x": 1})
    _fake_record(tmp_path, "NVIDIA H200", "2026-11-21 10:00 UTC", {"x": 2, "y": 7})
    assert records.recall("99_test", "x")[0] == 2  # this process: CPU mode, the newest
    h100 = runtime.Runtime("gpu", "test", {"name": "NVIDIA H100 80GB HBM3", "sms": 132})
    monkeypatch.setattr(runtime, "_runtime", h100)
    figures, source = records.recall("99_test", "x")
    assert figures == 1 and source.startswith("recorded on NVIDIA H100")
    assert records.recall("99_test", "y")[0] == 7  # no H100 record holds y: the newest that does
    monkeypatch.setattr(runtime, "_runtime", runtime.Runtime("gpu", "test", {"name": "NVIDIA A100-SXM4-80GB"}))
    assert records.recall("99_test", "x")[0] == 2  # a GPU without records: the newest


def test_a_figure_whose_step_this_gpu_cannot_run_is_recalled_with_why(tmp_path, monkeypatch, capsys):
    """benchmarks.figure on a GPU that lacks a figure's step (Figure.step): one line says why, and the record is
    shown instead; measure() is not called. On a GPU that runs the step it is measured."""
    import benchmarks

    monkeypatch.setenv("GPUCOURSE_RESULTS", str(tmp_path))
    _fake_record(tmp_path, "NVIDIA H200", "2026-11-21 10:00 UTC", {"x": 2})
    calls = []
    fig = records.Figure(lambda: calls.append(1) or {"v": 1}, step="10.wgmma_fp8")
    monkeypatch.setattr(benchmarks, "_figure", lambda lesson, name: fig)
    monkeypatch.setattr(benchmarks, "gpu_count", lambda: 1)
    monkeypatch.setattr(runtime, "_runtime", runtime.Runtime("gpu", "test", {"name": "NVIDIA A100-SXM4-80GB"}))
    monkeypatch.setenv("GPUCOURSE_FAKE_CC", "8.0")
    data, source = benchmarks.figure("99_test", "x")
    assert data == 2 and source.startswith("recorded on NVIDIA H200") and calls == []
    assert "wgmma" in capsys.readouterr().out
    monkeypatch.setenv("GPUCOURSE_FAKE_CC", "9.0")
    data, source = benchmarks.figure("99_test", "x")
    assert data == {"v": 1} and calls == [1]


def test_committed_records_are_complete():
    """Every lesson with benchmarks has a record from a real GPU, and its records hold every figure it declares."""
    import benchmarks

    assert records.check_all({lesson: benchmarks.figures(lesson) for lesson in benchmarks.LESSONS}) == []


def test_check_all_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUCOURSE_RESULTS", str(tmp_path))
    figures = {"x": records.Figure(lambda: {}), "y": records.Figure(lambda: {}, optional=True),
               "z": records.Figure(lambda: {})}
    assert records.check_all({"99_test": figures}) == [f"99_test: no record in {tmp_path}"]
    _fake_record(tmp_path, "NVIDIA H200", "2026-11-21 10:00 UTC", {"x": 1})
    problems = records.check_all({"99_test": figures})
    assert any("no measured ceilings" in p for p in problems) and any(p.endswith("no record holds z") for p in problems)


@pytest.mark.gpu
def test_ceilings_are_measured_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUCOURSE_CACHE", str(tmp_path))
    c = bench.ceilings()
    assert c.copy_gbps > 100 and c.fp16_tflops > c.fp32_tflops > 1
    assert list(tmp_path.glob("ceilings-*.json"))
    assert bench.ceilings() == c  # second call reads the cache


@pytest.mark.gpu
def test_events_see_the_work_a_host_timer_misses():
    cp = runtime.cupy()
    a = cp.ones(2**27, dtype=cp.float32)
    launch = bench.wall_clock(lambda: cp.multiply(a, a, out=a), synchronize=False)
    events = bench.time_gpu(lambda: cp.multiply(a, a, out=a))
    assert events.median_ms > 0
    assert launch.median_ms < events.median_ms  # the launch returns before the work is done


@pytest.mark.gpu
def test_rotating_inputs_outgrow_the_l2_cache():
    made = []
    setup = bench.rotating_inputs(lambda: made.append(1) or len(made), nbytes=2**20)
    l2 = runtime.get().device["l2_mib"] * 2**20
    assert len(made) * 2**20 >= 4 * l2
    assert [setup() for _ in range(3)] == [1, 2, 3]


@needs_compiler
def test_hold_kernel_compiles():
    from gpucourse import cuda_c
    ptx = cuda_c.ptx_from_source(bench.HOLD_SOURCE, "sm_80", compiler="nvrtc")
    assert "%globaltimer" in ptx and ".entry hold" in ptx


def test_hold_is_checked():
    with pytest.raises(runtime.CourseInputError, match="hold_ms"):
        bench.time_gpu(lambda: None, hold_ms=-1)


@pytest.mark.gpu
def test_hold_lets_the_events_time_the_gpu_not_python():
    """A tiny kernel behind a slow Python launch: without the hold the events time the host's loop; with it,
    the GPU's few microseconds. The hold itself lasts what it was asked for."""
    import time as _time
    cp = runtime.cupy()
    a = cp.ones(1024, dtype=cp.float32)

    def slow_launch():
        _time.sleep(200e-6)  # a host that takes 200 µs to prepare each launch
        cp.multiply(a, a, out=a)

    held = bench.time_per_call(slow_launch, batch=8, repeats=5)
    unheld = bench.time_per_call(slow_launch, batch=8, repeats=5, hold_gpu=False)
    assert held.median_ms < 0.05 < 0.15 < unheld.median_ms
    t = bench.time_gpu(lambda: bench.hold(2.0), repeats=3)
    assert 1.9 < t.median_ms < 2.5


def test_time_held_is_checked():
    for kw in ({"seconds": 0}, {"warmup": -1}, {"sync_every": 0}):
        with pytest.raises(runtime.CourseInputError, match="time_held needs"):
            bench.time_held(lambda: None, **kw)


@pytest.mark.gpu
def test_time_held_times_the_gpu_for_as_long_as_asked():
    """Held for 0.3 s, a 1 ms hold kernel takes at least 1 ms a call, and the events span all the calls: calls x ms a
    call is the 0.3 s the host kept the GPU busy (and the last calls it waited for), within the host's own time
    around the whole call (its warm-up included). At least ``sync_every`` calls however short the time asked. (How
    much more than 1 ms a call takes depends on what else runs on the GPU: other processes' kernels take turns with
    these, so no upper bound is asserted on it.)"""
    t0 = time.perf_counter()
    ms, calls = bench.time_held(lambda: bench.hold(1.0), seconds=0.3)
    host_ms = (time.perf_counter() - t0) * 1e3
    assert ms > 0.95, ms
    assert 0.3e3 * 0.97 <= calls * ms <= host_ms + 1, (calls, ms, host_ms)
    ms, calls = bench.time_held(lambda: bench.hold(1.0), seconds=1e-6, sync_every=5)
    assert calls == 5 and ms > 0.95, (calls, ms)


@pytest.mark.gpu
def test_monitor_limits_are_this_gpus():
    """The power limit and the highest SM clock NVML reports: positive, and the clock above what it reads idle or
    at work now."""
    from gpucourse import monitor

    lim = monitor.limits(runtime.cupy().cuda.Device().id)
    now = monitor.nvml_reader(runtime.cupy().cuda.Device().id)()
    assert lim["power_limit_w"] > 50 and lim["max_sm_clock_mhz"] >= now["sm_clock_mhz"] > 0


def test_time_in_turns_is_checked():
    with pytest.raises(runtime.CourseInputError, match="at least one round"):
        bench.time_in_turns({"a": lambda: None}, rounds=0)
    with pytest.raises(runtime.CourseInputError, match="one piece of work"):
        bench.time_in_turns({})


def test_interleaved_and_time_in_turns_take_each_round_in_the_opposite_order(monkeypatch):
    """Both timers of work to be compared run their turns a, b, then b, a, then a, b ... (one loop, bench.in_turns),
    each sample in its own name's Timing; time_in_turns warms each up fully in the first round only."""
    calls = []

    def fake(tag):
        def timer(work, **kw):
            calls.append((tag, work, kw.get("warmup")))
            return bench.Timing([{"a": 2.0, "b": 1.0}[work]] * kw["repeats"])
        return timer

    monkeypatch.setattr(bench, "time_per_call", fake("per_call"))
    t = bench.interleaved({"a": "a", "b": "b"}, rounds=4, repeats=2)
    assert [c[1] for c in calls] == list("abbaabba") and {c[2] for c in calls} == {1}
    assert t["a"].samples_ms == [2.0] * 8 and t["b"].median_ms == 1.0
    calls.clear()
    monkeypatch.setattr(bench, "time_gpu", fake("gpu"))
    t = bench.time_in_turns({"a": "a", "b": "b"}, rounds=3, repeats=6, warmup=5)
    assert [c[1] for c in calls] == list("abbaab") and [c[2] for c in calls] == [5, 5, 1, 1, 1, 1]
    assert len(t["a"].samples_ms) == len(t["b"].samples_ms) == 6


@pytest.mark.gpu
def test_time_in_turns_takes_each_round_in_the_opposite_order():
    """Three rounds of two pieces of work: a, b, then b, a, then a, b (each warmed up and timed in its turn), every
    run of a piece in its Timing, and the times are each piece's own (a 2 ms hold against a 1 ms one)."""
    order = []

    def work(name, ms):
        def run():
            order.append(name)
            bench.hold(ms)
        return run

    t = bench.time_in_turns({"a": work("a", 2.0), "b": work("b", 1.0)}, rounds=3, repeats=6, warmup=1)
    assert "".join(order) == "aaa" "bbb" "bbb" "aaa" "aaa" "bbb"  # a warm-up and two timed runs a turn
    assert len(t["a"].samples_ms) == len(t["b"].samples_ms) == 6
    assert 1.9 < t["a"].median_ms < 2.5 and 0.9 < t["b"].median_ms < 1.4


def test_native_stderr_is_kept_aside_unless_the_block_fails(capfd):
    """TensorFlow's start-up notices go to file descriptor 2; they are shown only when the start fails."""
    with runtime._native_stderr_kept_aside():
        os.write(2, b"I0000 a notice\n")
    assert "a notice" not in capfd.readouterr().err
    with pytest.raises(RuntimeError, match="start failed"):
        with runtime._native_stderr_kept_aside():
            os.write(2, b"E0000 why it failed\n")
            raise RuntimeError("start failed")
    assert "why it failed" in capfd.readouterr().err
    os.write(2, b"after\n")  # descriptor 2 is back
    assert "after" in capfd.readouterr().err


def test_a_table_prints_aligned_and_renders_as_html():
    """plots.table: aligned text in a terminal (numbers to the right), an HTML table in a notebook; a short row is
    refused."""
    from gpucourse import plots

    t = plots.table(["kernel", "GB/s"], [["numba", 3400.2], ["cupy.multiply", 2533]], title="T", source="measured")
    assert str(t).splitlines() == ["T", "kernel          GB/s", "-------------  -----", "numba          3,400",
                                   "cupy.multiply  2,533", "(measured)"]
    html = t._repr_html_()
    assert html.count("<tr>") == 3 and "<caption>T</caption>" in html and "text-align:right" in html
    with pytest.raises(runtime.CourseInputError, match="every row needs 2 cells"):
        plots.table(["a", "b"], [[1]])


# ---------------------------------------------------------------------------------------- noise a learner sees

def _numba_grid_warning(colour=""):
    """What numba-cuda warns at a launch of fewer than 128 blocks (its dispatcher's class and words; on a
    terminal numba may colour them)."""
    import warnings

    from numba.cuda.core import errors

    warnings.warn(errors.NumbaPerformanceWarning(f"{colour}Grid size 2 will likely result in GPU under-utilization "
                                                 "due to low occupancy."))


def test_small_grids_silences_numbas_grid_warning_and_nothing_else():
    import warnings

    from numba.cuda.core import errors

    assert errors.NumbaPerformanceWarning in runtime.numba_performance_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(errors.NumbaPerformanceWarning):
            _numba_grid_warning()
        with runtime.small_grids():
            _numba_grid_warning()  # silenced
            _numba_grid_warning("\x1b[1m")
            with pytest.raises(errors.NumbaPerformanceWarning, match="Host array"):  # numba's other advice stays
                warnings.warn(errors.NumbaPerformanceWarning("Host array used in CUDA kernel will incur copy overhead"))
            with pytest.raises(UserWarning, match="other"):
                warnings.warn("other")  # every other warning as before
        with pytest.raises(errors.NumbaPerformanceWarning):
            _numba_grid_warning()  # and only inside
    assert runtime.get().small_grids is not None  # `with rt.small_grids():` in a notebook


def test_the_courses_small_launches_raise_no_grid_warning():
    """Notebook 10's flash kernel at a demonstration size goes through kernels.attention.flash_numba, which launches
    inside small_grids: a kernel that warns as numba does at launch raises nothing under warnings-as-errors; Task
    7.1's check and notebook 10's softmax launch say `small_grids()` where they launch a few blocks."""
    import warnings

    import numpy as np

    from kernels.attention import flash

    cuda = runtime.cuda()

    class Warns:  # a kernel of flash_forward_numba's signature that warns as numba does at launch
        launched = 0

        def __getitem__(self, config):
            def launch(*args):
                Warns.launched += 1
                _numba_grid_warning()
            return launch

    q = cuda.to_device(np.zeros((1, 8, 4), np.float32))
    lse = cuda.to_device(np.zeros((1, 8), np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash.flash_numba(q, q, q, cuda.to_device(np.zeros((1, 8, 4), np.float32)), lse, kernel=Warns())
    assert Warns.launched == 1
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    nb = json.loads((root / "notebooks/10_attention.ipynb").read_text())
    cell = next(c for c in nb["cells"] if c.get("id") == "73d3b624")
    assert "with rt.small_grids():" in "".join(cell["source"])
    sol = json.loads((root / "solutions/08_feeding_the_gpu/feeding_the_gpu.ipynb").read_text())
    helpers = "".join(next(c for c in sol["cells"] if c.get("id") == "test-helpers")["source"])
    assert "streams_run_together() as sim, runtime.small_grids()" in helpers


def test_progress_bar_without_ipywidgets_is_quiet(tmp_path):
    """In a notebook kernel that lacks ipywidgets, the progress bar is tqdm's text bar and tqdm says nothing about
    IProgress (tqdm.auto would warn "IProgress not found")."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "bar.py"
    script.write_text(textwrap.dedent('''
        import sys, types, warnings
        sys.modules["ipywidgets"] = None  # not importable
        sys.modules["ipykernel.zmqshell"] = types.ModuleType("ipykernel.zmqshell")  # as in a notebook kernel
        import IPython
        IPython.get_ipython = lambda: types.SimpleNamespace()
        from gpucourse import bench
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            bar = bench.progress(range(3), desc="sweep")
            assert list(bar) == [0, 1, 2]
        print("MODULE", type(bar).__module__)
        print("WARNINGS", [str(w.message)[:60] for w in seen])
    '''))
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert "MODULE tqdm.std" in proc.stdout, proc.stdout + proc.stderr
    assert "WARNINGS []" in proc.stdout, proc.stdout

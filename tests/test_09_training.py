"""Lesson 9: the course's training step against finite differences and TensorFlow, recomputation, mixed
precision's loss scaling, data parallelism against one device on the whole batch; GPU-marked tests run the
same step with CuPy."""
from __future__ import annotations

import math

import numpy as np
import pytest

from gpucourse import runtime
from kernels import training as tr

pytestmark = pytest.mark.lesson09


def _batch(rng, n, d, classes, dtype=np.float32):
    return rng.standard_normal((n, d)).astype(dtype), rng.integers(0, classes, n).astype(np.int32)


def _maxdiff(ga, gb):
    return max(float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
               for pa, pb in zip(ga, gb) for a, b in zip(pa, pb))


def test_gradients_match_finite_differences(rng):
    p = tr.mlp_init([5, 7, 7, 3], xp=np, dtype="float64", seed=1)
    X, y = _batch(rng, 6, 5, 3, np.float64)
    _, g = tr.loss_and_grads(p, X, y)
    for layer, which, idx in [(0, 0, (1, 2)), (1, 0, (3, 4)), (2, 0, (6, 1)), (1, 1, (2,)), (2, 1, (0,))]:
        a = p[layer][which]
        a[idx] += 1e-6
        lp, _ = tr.loss_and_grads(p, X, y)
        a[idx] -= 2e-6
        lm, _ = tr.loss_and_grads(p, X, y)
        a[idx] += 1e-6
        assert math.isclose((lp - lm) / 2e-6, g[layer][which][idx], rel_tol=1e-5, abs_tol=1e-9)


def test_step_matches_tensorflow(rng):
    pytest.importorskip("tensorflow")  # a course package; the GPU machines may lack it
    ttf = pytest.importorskip("systems.training.tensorflow_reference")
    p = tr.mlp_init([12, 32, 32, 32, 10], seed=3)
    X, y = _batch(rng, 64, 12, 10)
    loss, g = tr.loss_and_grads(p, X, y)
    tf_loss, tf_g = ttf.loss_and_grads(p, X, y)
    assert math.isclose(float(loss), tf_loss, rel_tol=1e-5)
    scale = max(float(np.abs(b).max()) for pair in tf_g for b in pair)
    assert _maxdiff(g, tf_g) <= 1e-5 * scale


@pytest.mark.parametrize("n, s", [(6, 1), (6, 2), (6, 3), (7, 3), (6, 6), (64, 8), (64, 64)])
def test_recomputation_gives_the_same_gradients_with_fewer_stored(rng, n, s):
    p = tr.mlp_init([4] + [6] * n + [3], xp=np, dtype="float64")
    X, y = _batch(rng, 5, 4, 3, np.float64)
    full = {}
    loss, g = tr.loss_and_grads(p, X, y, stats=full)
    st = {}
    loss2, g2 = tr.loss_and_grads(p, X, y, checkpoint_every=s, stats=st)
    assert loss2 == loss and _maxdiff(g, g2) == 0
    layers = n + 1
    assert full == {"forward_layers": layers, "peak_stored": layers}
    starts = range(0, layers, s)
    assert st["peak_stored"] == max(len(starts), max(a // s + min(s, layers - a) for a in starts))
    assert st["forward_layers"] == layers + sum(min(s, layers - a) - 1 for a in range(0, layers, s))
    if n == 64 and s == 8:
        assert layers / st["peak_stored"] >= 4  # the sqrt(n) case: 65 inputs held, against 16


@pytest.mark.parametrize("bad", [0, -1, 5, 2.0, True, None])
def test_bad_checkpoint_spacing_is_refused(rng, bad):
    p = tr.mlp_init([4, 6, 6, 6, 3], xp=np)
    X, y = _batch(rng, 5, 4, 3)
    with pytest.raises(runtime.CourseInputError, match="checkpoint spacing"):
        tr.loss_and_grads(p, X, y, checkpoint_every=bad)


def test_update_scale_rule():
    assert tr.update_scale(1024.0, 5, False) == (512.0, 0)
    assert tr.update_scale(1024.0, 5, True, interval=10) == (1024.0, 6)
    assert tr.update_scale(1024.0, 9, True, interval=10) == (2048.0, 0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(runtime.CourseInputError, match="positive"):
            tr.update_scale(bad, 0, True)
    for bad in (0, -2.0, float("inf"), "8"):
        with pytest.raises(runtime.CourseInputError, match="positive"):
            tr.LossScaler(bad)


def test_loss_scaling_saves_gradients_from_underflow(rng):
    """Small gradients flush to zero in FP16 without scaling, and survive with it."""
    p = tr.mlp_init([16, 32, 32, 32, 32, 4], seed=2)
    for W, b in p:
        W *= 0.05  # a network whose gradients are tiny
    X, y = _batch(rng, 64, 16, 4)
    half = tr.cast(p, np.float16)
    _, g1 = tr.loss_and_grads(half, X, y, loss_scale=1.0)
    _, g2 = tr.loss_and_grads(half, X, y, loss_scale=2.0**14)
    _, g32 = tr.loss_and_grads(p, X, y)
    dead = tr.underflow_fraction(g32)  # entries that are zero in FP32 too (ReLUs that never fire)
    assert tr.underflow_fraction(g1) > dead + 0.3
    assert tr.underflow_fraction(g2) < dead + 0.01
    unscaled = [(a.astype(np.float32) / 2**14, b.astype(np.float32) / 2**14) for a, b in g2]
    ref = max(float(np.abs(a).max()) for pair in g32 for a in pair)
    assert _maxdiff(unscaled, g32) <= 0.02 * ref


def test_mixed_step_backs_off_on_overflow_and_trains(rng):
    p = tr.mlp_init([16, 32, 32, 4], seed=4)
    X, y = _batch(rng, 64, 16, 4)
    scaler = tr.LossScaler(2.0**24, interval=4)  # too large: the scaled gradients overflow FP16
    losses, applied = [], []
    for _ in range(30):
        loss, ok = tr.mixed_step(p, X, y, scaler, 0.05)
        losses.append(loss)
        applied.append(ok)
    assert not applied[0] and scaler.skipped >= 1 and scaler.history[1] == 2.0**23
    assert sum(applied[-10:]) >= 7  # the scale grows every 4 good steps until the next overflow halves it
    assert any(b > a for a, b in zip(scaler.history, scaler.history[1:]))
    assert losses[-1] < 0.8 * losses[0]
    assert all(W.dtype == np.float32 for W, _ in p)


def test_fp16_forward_overflow_is_reported(rng):
    p = tr.mlp_init([16, 32, 4], seed=5)
    X, y = _batch(rng, 8, 16, 4)
    X *= 3e4
    with pytest.raises(tr.FP16Overflow, match="overflowed"):
        tr.mixed_step(p, X, y, tr.LossScaler(), 0.1)


@pytest.mark.parametrize("k, reduce, bucket", [(1, "mean", 1), (2, "mean", 2**20), (4, "ring", 500), (8, "ring", 1)])
def test_data_parallel_equals_one_device(rng, k, reduce, bucket):
    p = tr.mlp_init([6, 10, 10, 10, 3], xp=np, dtype="float64")
    X, y = _batch(rng, 24, 6, 3, np.float64)
    loss, g = tr.loss_and_grads(p, X, y)
    trace = []
    loss_k, g_k = tr.data_parallel_grads(p, X, y, k, reduce=reduce, bucket_bytes=bucket, trace=trace)
    assert math.isclose(loss_k, float(loss), rel_tol=1e-12) and _maxdiff(g, g_k) <= 1e-14
    plan = tr.buckets(p, bucket)
    assert [e for e in trace if e[0] == "all-reduce"] == [("all-reduce", b) for b in range(len(plan))]
    if len(plan) > 1:  # the first bucket's all-reduce starts before the backward pass has finished
        assert trace.index(("all-reduce", 0)) < trace.index(("backward", 0))


def test_batch_that_does_not_split_is_refused(rng):
    p = tr.mlp_init([6, 10, 3], xp=np)
    X, y = _batch(rng, 10, 6, 3)
    with pytest.raises(runtime.CourseInputError, match="does not split into 4"):
        tr.data_parallel_grads(p, X, y, 4)
    with pytest.raises(runtime.CourseInputError, match="replicas"):
        tr.split_batch(X, y, 0)


def test_shards_that_would_average_wrongly_are_refused(rng):
    X, y = _batch(rng, 12, 4, 3)
    tr.check_shards(tr.split_batch(X, y, 3), 3)
    with pytest.raises(runtime.CourseInputError, match=r"\[5, 7\] examples.*same size"):
        tr.check_shards([(X[:5], y[:5]), (X[5:], y[5:])], 2)
    with pytest.raises(runtime.CourseInputError, match="one shard per replica: 2, got 3"):
        tr.check_shards(tr.split_batch(X, y, 3), 2)
    with pytest.raises(runtime.CourseInputError, match="shard 0 has 6 examples and 5 labels"):
        tr.check_shards([(X[:6], y[:5]), (X[6:], y[6:])], 2)


def test_weak_scaling_is_the_one_gpu_step_over_the_k_gpu_step():
    """T(1) / T(k) with the batch per GPU fixed; the step without communication says how much the all-reduces
    added and how much driving k GPUs cost; failed and missing k are said, not dropped."""
    from benchmarks import training as bt

    d = {"gpus": 4, "not_measured": [8],
         "runs": {"1": {"none": {"median_ms": 10.0}, "nccl": {"median_ms": 10.1}, "buckets": 4},
                  "2": {"none": {"median_ms": 10.5}, "nccl": {"median_ms": 12.0}, "buckets": 4},
                  "4": {"none": {"median_ms": 11.0}, "nccl_error": "NcclError: unhandled system error"}}}
    d["runs"]["2"].update(nccl_procs={"median_ms": 11.5}, ring_error="RankFailed: rank 1 exited with code 1")
    s = bt.scaling(d)
    assert list(s) == [1, 2]
    assert s[1]["weak_scaling"] == pytest.approx(1.0)
    assert s[2]["weak_scaling"] == pytest.approx(10.1 / 12.0)
    assert s[2]["exposed_ms"] == pytest.approx(1.5) and s[2]["driving_k"] == pytest.approx(1.05)
    text = "\n".join(bt.scaling_lines(d))
    assert "T(1)/T(2) 84.2%" in text and "NcclError" in text and "k = 8 not measured" in text
    assert s[2]["nccl_procs_ms"] == 11.5 and "one process per GPU (overlapped, as DDP) 11.5 ms" in text
    assert s[2]["weak_scaling_procs"] == pytest.approx(10.1 / 11.5) and s[1]["weak_scaling_procs"] is None
    assert "with one process per GPU: weak-scaling efficiency T(1)/T(2) 87.8%" in text
    assert "k = 2, ring failed: RankFailed: rank 1 exited with code 1" in text
    assert bt.scaling({"runs": {"2": d["runs"]["2"]}})[2]["weak_scaling"] is None
    fig = bt.plot_data_parallel(dict(d, layers=16, width=4096, batch_per_gpu=1024), "test")
    assert "k = 8 not measured" in fig.axes[0].get_title()
    with pytest.raises(runtime.CourseError, match="no data-parallel run"):
        bt.plot_data_parallel({"runs": {"4": d["runs"]["4"]}, "layers": 1, "width": 1, "batch_per_gpu": 1}, "test")


def test_the_run_on_the_most_gpus_is_shown_beside_a_smaller_one(monkeypatch):
    from benchmarks import training as bt
    from gpucourse import records

    def rec(name, gpus, date):
        return {"gpu": {"name": name, "sms": 132, "driver": "13.0"}, "date": date,
                "figures": {"data_parallel": {"gpus": gpus, "runs": {}}}}

    recs = [rec("A", 1, "2026-11-22 10:00 UTC"), rec("B", 2, "2026-11-21 10:00 UTC"), rec("C", 2, "2026-11-20 10:00 UTC"),
            {"gpu": {"name": "D"}, "date": "2026-11-23 10:00 UTC", "figures": {}}]
    monkeypatch.setattr(records, "all_records", lambda lesson: recs)
    d, src = bt.recorded_with_more_gpus({"gpus": 1})
    assert d["gpus"] == 2 and src.startswith("recorded on B") and "2026-11-21" in src
    assert bt.recorded_with_more_gpus({"gpus": 2}) is None
    monkeypatch.setattr(records, "all_records", lambda lesson: [])
    assert bt.recorded_with_more_gpus({"gpus": 1}) is None


def test_standin_for_the_all_reduces_in_words():
    """What the one-GPU stand-in says: per block count, what it added to the step and the share of it hidden."""
    from benchmarks import training as bt
    from gpucourse import bench

    o = {"step": {"median_ms": 37.0}, "comm_ms": 3.4, "comm_source": "NVLink, 2 x H200", "buckets": 16,
         "threads": 512, "runs": {"8": {"alone": {"median_ms": 3.5}, "with_step": {"median_ms": 38.0}},
                                  "32": {"alone": {"median_ms": 3.4}, "with_step": {"median_ms": 41.0}}}}
    text = "\n".join(bt.standin_lines(o))
    assert "the step alone 37 ms" in text and "from NVLink, 2 x H200" in text
    assert "8 blocks of 512 threads: alone 3.5 ms, beside the step 38 ms: adds 1 ms, 71% of it hidden" in text
    assert "32 blocks" in text and "0% of it hidden" in text  # 4 ms added for 3.4 ms: nothing hidden, not < 0
    fig = bt.plot_overlap_standin(o, "test")
    assert "3.4 ms of communication" in fig.axes[0].get_title()
    with pytest.raises(runtime.CourseInputError, match="at most 48 KiB"):
        bench.hold(1.0, blocks=4, threads=512, shared_bytes=64 * 1024)
    with pytest.raises(runtime.CourseInputError, match="blocks >= 1"):
        bench.hold(1.0, blocks=0)



def test_recorded_what_the_lesson_says_of_data_parallelism():
    """What notebook 09 says, on every record: the one-GPU stand-in for the all-reduces is mostly hidden beside the
    step; with two or more GPUs one process per GPU gives the fastest of the steps that communicate; and, with the
    links of the last cell (NVLink as lesson 7 measured it, two networks at their nominal rates), the all-reduce of
    the gradients at k = 8 takes a fraction of the backward pass over NVLink and longer than it over a network."""
    from benchmarks import training as bt
    from gpucourse import records

    recs = records.all_records("09_training")
    if not recs:
        pytest.skip("no GPU record of lesson 9 in results/ yet")
    links = bt.links()
    for rec in recs:
        f, gpu = rec["figures"], rec["gpu"]["name"]
        o = f.get("overlap_standin")
        if o is not None:
            step = o["step"]["median_ms"]
            for C, r in o["runs"].items():
                added = r["with_step"]["median_ms"] - step
                assert added < 0.5 * r["alone"]["median_ms"], (gpu, C)
        d = f["data_parallel"]
        s = bt.scaling(d)
        for k, e in s.items():
            if k > 1 and e.get("nccl_procs_ms"):
                others = [e[key] for key in ("step_ms", "nccl_after_ms", "nccl_priority_ms", "ring_ms") if key in e]
                assert e["nccl_procs_ms"] < min(others), (gpu, k, e)
                assert e["weak_scaling_procs"] > e["weak_scaling"], (gpu, k)
        if 1 in s:
            backward = 2 / 3 * s[1]["compute_ms"]
            for link, gbs in links.items():
                t8 = 2 * 7 / 8 * bt.gradient_bytes(d) / (gbs * 1e9) * 1e3
                assert (t8 < backward) == link.startswith("NVLink"), (gpu, link, t8, backward)


@pytest.mark.gpu
def test_overlap_standin_runs_beside_the_step():
    from benchmarks import training as bt

    o = bt.measure_overlap_standin(layers=2, width=256, batch=64, ctas=(4,), comm_ms=2.0, buckets=4, repeats=3)
    r = o["runs"]["4"]
    assert o["comm_source"] == "given" and o["sms"] > 0
    assert 1.9 <= r["alone"]["median_ms"] <= 3.0  # four holds of 0.5 ms in a row
    # the small step hides behind the stand-in, or the other way round: never more than both in a row
    assert r["with_step"]["median_ms"] <= r["alone"]["median_ms"] + o["step"]["median_ms"] + 0.5


def test_recorded_training_goals():
    """Issue goals on the committed GPU records: mixed precision >= 2x FP32, sqrt(n) checkpoints >= 4x less
    activation memory for <= 1.4x the step time; the data-parallel runs read as weak scaling."""
    from benchmarks import training as bt
    from gpucourse import records

    recs = records.all_records("09_training")
    if not recs:
        pytest.skip("no GPU record of lesson 9 in results/ yet")
    for rec in recs:
        f, gpu = rec["figures"], rec["gpu"]["name"]
        assert f["mixed_precision"]["speedup"] >= bt.GOALS["mixed_speedup"], gpu
        r = f["recompute"]
        s = r["runs"][str(r["sqrt_n"])]
        assert s["memory_saving"] >= bt.GOALS["recompute_memory"], gpu
        assert s["time_ratio"] <= bt.GOALS["recompute_time"], gpu
        for k, e in bt.scaling(f["data_parallel"]).items():
            assert 0 < e["weak_scaling"] <= 1.05 and e["exposed_ms"] > -0.05 * e["step_ms"], (gpu, k, e)
        assert bt.gradient_bytes(f["data_parallel"]) == 4 * 16 * (4096 * 4096 + 4096)
        lb = f.get("largest_batch")
        if lb is not None:  # found by running steps: each largest fitted and the next multiple did not
            for s_, e in lb["runs"].items():
                tried = {p["batch"]: p["fits"] for p in lb["probes"] if p["s"] == int(s_)}
                assert tried[e["largest"]] and not any(ok for b, ok in tried.items() if b > e["largest"]), (gpu, s_)
                assert any(b <= e["largest"] + lb["multiple"] and not ok for b, ok in tried.items()), (gpu, s_)
            assert lb["ratio"] >= bt.GOALS["recompute_memory"] * 0.75, gpu  # most of the 4x saving becomes batch


def test_every_figure_is_declared_once_with_a_measure():
    """FIGURES: a records.Figure per figure of the lesson, each measured by a function of no arguments (``record
    09_training --figure NAME`` works for every one) and told in words; every recorded one reads."""
    import inspect

    from benchmarks import training as bt
    from gpucourse import records

    assert list(bt.FIGURES) == ["mixed_precision", "scaler_run", "recompute", "largest_batch", "data_parallel",
                                "overlap_standin", "launchers"]
    for name, fig in bt.FIGURES.items():
        assert isinstance(fig, records.Figure) and callable(fig.measure), name
        assert all(p.default is not p.empty for p in inspect.signature(fig.measure).parameters.values()), name
        assert callable(fig.text) and (fig.plot is not None or name in ("largest_batch", "launchers")), name
    for rec in records.all_records(bt.LESSON):
        for name in set(rec["figures"]) & set(bt.FIGURES):
            assert bt.FIGURES[name].text(rec["figures"][name]).strip(), (rec["path"], name)


def test_largest_batch_refuses_bad_input():
    from benchmarks import training as bt

    for bad in ({"budget_gib": 0}, {"budget_gib": -1.0}, {"layers": 0}, {"multiple": 0}):
        with pytest.raises(runtime.CourseInputError, match="largest_batch"):
            bt.measure_largest_batch(**bad)


def test_buckets_cover_every_layer_last_first():
    p = tr.mlp_init([4, 8, 8, 8, 8, 2], xp=np)
    plan = tr.buckets(p, 300)
    assert sum(plan, []) == list(reversed(range(len(p))))
    assert tr.buckets(p, 10**9) == [list(reversed(range(len(p))))]


def test_tensorflow_towers_and_recompute(rng):
    pytest.importorskip("tensorflow")  # a course package; the GPU machines may lack it
    ttf = pytest.importorskip("systems.training.tensorflow_reference")
    p = tr.mlp_init([8, 16, 16, 4], seed=6)
    X, y = _batch(rng, 32, 8, 4)
    _, g = ttf.loss_and_grads(p, X, y)
    assert _maxdiff(g, ttf.tower_grads(p, X, y, 4)) <= 1e-6
    with pytest.raises(runtime.CourseInputError, match="does not split into 5 equal towers"):
        ttf.tower_grads(p, X, y, 5)
    demo = ttf.recompute_demo()
    assert demo["block_calls_plain"] == 1 and demo["block_calls_recompute"] == 2 and demo["max_abs_diff"] <= 1e-6


def test_eager_and_graph_steps_agree():
    """The notebook's eager-against-tf.function timing runs the same steps both ways: same weights after them."""
    pytest.importorskip("tensorflow")
    from systems.training import tensorflow_reference as ttf

    p = tr.mlp_init([6, 12, 4], seed=2)
    X, y = _batch(np.random.default_rng(3), 16, 6, 4)
    r = ttf.eager_vs_function(p, X, y, steps=3)
    assert r["eager"] > 0 and r["tf.function"] > 0
    start = [x for W, b in p for x in (W, b)]
    assert len(r["eager weights"]) == len(start) == len(r["tf.function weights"])
    for e, g, s0 in zip(r["eager weights"], r["tf.function weights"], start):
        np.testing.assert_allclose(e, g, rtol=1e-5, atol=1e-6)
    assert any(not np.allclose(e, s0) for e, s0 in zip(r["eager weights"], start)), "the steps changed nothing"


def test_mirrored_strategy_equals_one_device():
    pytest.importorskip("tensorflow")
    from systems.training import tensorflow_reference as ttf

    out = ttf.mirrored_check(2)
    assert out["replicas"] == 2 and len(out["devices"]) == 2
    assert out["max_abs_diff"] <= 1e-6 * max(1.0, out["max_abs_grad"])


def test_sine_regression_learning_rate_decides():
    pytest.importorskip("tensorflow")  # a course package; the GPU machines may lack it
    ttf = pytest.importorskip("systems.training.tensorflow_reference")
    stuck = ttf.sine_regression(1e-6, steps=150)
    moves = ttf.sine_regression(0.05, steps=150)
    assert abs(stuck[-1] - stuck[0]) < 0.01 * stuck[0]
    assert moves[-1] < 0.5 * moves[0]


# ------------------------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
def test_cupy_step_matches_numpy(rng):
    cp = runtime.cupy()
    p = tr.mlp_init([64, 128, 128, 10], seed=7)
    X, y = _batch(rng, 256, 64, 10)
    loss, g = tr.loss_and_grads(p, X, y)
    pg = [(cp.asarray(W), cp.asarray(b)) for W, b in p]
    for s in (1, 2, 3):
        loss_g, g_g = tr.loss_and_grads(pg, cp.asarray(X), cp.asarray(y), checkpoint_every=s)
        assert math.isclose(float(loss_g), float(loss), rel_tol=1e-5)
        assert _maxdiff([(cp.asnumpy(a), cp.asnumpy(b)) for a, b in g_g], g) <= 1e-5


@pytest.mark.gpu
def test_cupy_mixed_step_trains(rng):
    cp = runtime.cupy()
    p = [(cp.asarray(W), cp.asarray(b)) for W, b in tr.mlp_init([64, 256, 256, 10], seed=8)]
    X, y = _batch(rng, 512, 64, 10)
    X, y = cp.asarray(X), cp.asarray(y)
    scaler = tr.LossScaler(2.0**16, interval=5)
    losses = [tr.mixed_step(p, X, y, scaler, 0.05)[0] for _ in range(40)]
    assert losses[-1] < 0.7 * losses[0] and scaler.skipped >= 1


@pytest.mark.gpu
def test_largest_batch_is_found_by_running_steps():
    from benchmarks import training as bt

    cp = runtime.cupy()
    limit = cp.get_default_memory_pool().get_limit()
    r = bt.measure_largest_batch(layers=16, width=256, budget_gib=0.05, multiple=64)
    assert cp.get_default_memory_pool().get_limit() == limit  # the cap is lifted again
    one, four = r["runs"]["1"]["largest"], r["runs"]["4"]["largest"]
    assert one > 0 and four > one  # checkpoints every 4 of 16 layers leave room for a larger batch
    for s_, e in r["runs"].items():
        fits = {p["batch"]: p["fits"] for p in r["probes"] if p["s"] == int(s_)}
        assert fits[e["largest"]] and not fits.get(e["largest"] + 64, False)
        assert min(b for b, ok in fits.items() if not ok) <= e["largest"] + 64


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["nccl", "nccl_after", "nccl_priority", "ring"])
def test_data_parallel_on_gpus_equals_one_device(rng, variant):
    """Every way the benchmark times the data-parallel step (benchmarks.training.DP_VARIANTS but "none") trains
    as one device on the whole batch does."""
    from benchmarks import training as bt

    cp = runtime.cupy()
    k = cp.cuda.runtime.getDeviceCount()
    kw = bt.DP_VARIANTS[variant]
    if kw["reduce"] == "ring" and k < 2:
        pytest.skip("lesson 7's ring needs 2 or more GPUs")
    p = tr.mlp_init([32, 64, 64, 64, 8], seed=9)
    X, y = _batch(rng, 64 * k, 32, 8)
    steps = 2  # the second step replays what the first recorded (the ring's CUDA graphs)
    ref = [(W.copy(), b.copy()) for W, b in p]
    for _ in range(steps):
        _, g = tr.loss_and_grads(ref, X, y)
        tr.sgd(ref, g, 0.1)
    dp = tr.DataParallel(p, list(range(k)), bucket_bytes=20_000, **kw)
    shards = []
    for r, (Xs, ys) in enumerate(tr.split_batch(X, y, k)):
        with cp.cuda.Device(r):
            shards.append((cp.asarray(Xs), cp.asarray(ys)))
    for _ in range(steps):
        dp.step(shards, 0.1)
        dp.synchronize()
    for r in range(k):
        got = [(cp.asnumpy(W), cp.asnumpy(b)) for W, b in dp.params[r]]
        assert _maxdiff(got, ref) <= 1e-5


def test_one_process_per_gpu_shards_and_bad_communicator():
    """One process per GPU: each rank makes its own shard, the same wherever it is made, different for each rank;
    a communicator goes only with NCCL and one GPU (refused before anything touches a GPU)."""
    widths = [8, 16, 4]
    X0, y0 = tr.rank_shard(0, 6, widths, seed=3)
    X0b, y0b = tr.rank_shard(0, 6, widths, seed=3)
    X1, _ = tr.rank_shard(1, 6, widths, seed=3)
    assert X0.shape == (6, 8) and y0.shape == (6,) and y0.max() < 4
    assert np.array_equal(X0, X0b) and np.array_equal(y0, y0b) and not np.allclose(X0, X1)
    p = tr.mlp_init(widths)
    with pytest.raises(runtime.CourseInputError, match="one process's NCCL communicator"):
        tr.DataParallel(p, [0, 1], comm=object())
    with pytest.raises(runtime.CourseInputError, match="reduce='ring'"):
        tr.DataParallel(p, [0], reduce="ring", comm=object())


@pytest.mark.gpu
def test_data_parallel_one_process_per_gpu_equals_one_device():
    """Data parallelism with one process per GPU (lesson 7's launcher, an NCCL communicator across processes)
    trains as one device on the whole batch does: every rank holds the same weights after two steps."""
    from gpucourse import ranks

    k = runtime.cupy().cuda.runtime.getDeviceCount()
    widths, m, lr, steps = [32, 64, 64, 64, 8], 64, 0.1, 2
    results = ranks.launch(k, tr.data_parallel_program, widths, m, steps, 0, lr)
    shards = [tr.rank_shard(r, m, widths) for r in range(k)]
    X, y = np.concatenate([s[0] for s in shards]), np.concatenate([s[1] for s in shards])
    ref = tr.mlp_init(widths)
    losses = []
    for _ in range(steps):
        loss, g = tr.loss_and_grads(ref, X, y)
        losses.append(loss)
        tr.sgd(ref, g, lr)
    for r, res in enumerate(results):
        assert res["rank"] == r and len(res["losses"]) == steps
        assert _maxdiff(res["params"], ref) <= 1e-5
    # each rank's loss is its own shard's; their mean is the whole batch's
    assert np.mean([res["losses"][0] for res in results]) == pytest.approx(losses[0], rel=1e-5)


def test_live_curves_refuse_bad_input(tmp_path):
    from gpucourse import plots

    with pytest.raises(runtime.CourseInputError, match="at least one metric"):
        plots.LiveCurves(())
    with pytest.raises(runtime.CourseInputError, match="every >= 1"):
        plots.LiveCurves(("loss",), every=0)
    curves = plots.LiveCurves(("loss",), every=1, save_to=str(tmp_path / "curves.png"))
    with pytest.raises(runtime.CourseInputError, match=r"unknown metrics \['acc'\]"):
        curves.update(0, acc=0.5)
    curves.update(0, loss=1.0)
    curves.close()
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_live_curves_update_in_place_and_are_saved_when_run_headless(tmp_path):
    """In a notebook run headless (python -m gpucourse run --save DIR): one output for the figure however many
    updates, and the figure saved in DIR, named after its title; in a script, saved to save_to or the default."""
    import nbformat

    from gpucourse import notebooks

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "from gpucourse import plots\n"
        "curves = plots.LiveCurves(('loss', 'accuracy'), title='Live: a test', every=5)\n"
        "for step in range(40):\n"
        "    curves.update(step, loss=1 / (step + 1), accuracy=step / 40)\n"
        "curves.close()\n"
        "print('saved', curves.saved)")]
    src = tmp_path / "live.ipynb"
    nbformat.write(nb, src)
    out = tmp_path / "out"
    outcome = notebooks.execute(src, mode="cpu", timeout=120, save_to=out)
    assert outcome.ok, outcome.error
    cell = nbformat.read(out / "live.ipynb", as_version=4).cells[0]
    shown = [o for o in cell.outputs if o.output_type in ("display_data", "execute_result") and "image/png" in o.data]
    assert len(shown) == 1, f"{len(shown)} figures for 8 updates: the curves were not updated in place"
    assert (out / "live_a_test.png").stat().st_size > 0
    assert f"saved {out / 'live_a_test.png'}" in "".join(o.get("text", "") for o in cell.outputs)


def test_schedule_model_matches_even_spacing_and_finds_uneven_schedules():
    """tr.schedule_bytes gives activation_bytes's figure for checkpoints every s layers where s divides the depth
    (else at most it: a short last segment holds less than s inputs); best_schedule beats every
    even spacing on a network with a wide middle (Task 9.6's), and refuses schedules that break the rule."""
    w = [256] * 17
    for s in (1, 2, 4, 8, 16):
        assert tr.schedule_bytes(64, w, list(range(0, 16, s))) == tr.activation_bytes(64, w, checkpoint_every=s)
    assert tr.schedule_bytes(64, w, list(range(0, 16, 3))) == 7 * 64 * 256 * 4 < tr.activation_bytes(64, w, checkpoint_every=3)
    wide = [1024] * 3 + [4096] * 3 + [1024] * 6 + [16]
    best, least = tr.best_schedule(2048, wide)
    assert (best, least) == ([0, 4, 6, 9], 72 * 2**20)
    assert least < min(tr.schedule_bytes(2048, wide, list(range(0, 12, s))) for s in range(1, 13))
    for bad in ([], [1, 4], [0, 5, 3], [0, 12]):
        with pytest.raises(runtime.CourseInputError):
            tr.schedule_bytes(2048, wide, bad)

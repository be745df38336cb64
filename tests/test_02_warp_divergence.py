"""Lesson 2: branch kernels and reductions against their specs (simulator or GPU), the NumPy warp model,
PTX of the warp-intrinsic kernels (compiled without a GPU), and the model against what the GPU recorded."""
import math
import re

import numpy as np
import pytest

from benchmarks import warp_divergence as lesson
from conftest import needs_compiler
from gpucourse import bench, records, runtime
from gpucourse import cuda_c
from gpucourse.numba_ptx import numba_ptx
from kernels import warp_divergence as wd

pytestmark = pytest.mark.lesson02
cuda = runtime.cuda()
LESSON = "02_warp_divergence"


def device(a):
    return cuda.to_device(np.ascontiguousarray(a))


def poisoned(n):
    return cuda.to_device(np.full(n, np.nan, dtype=np.float32))  # an unwritten element stays NaN


# ------------------------------------------------------------------------- kernels in the simulator

@pytest.mark.parametrize("by", wd.PATTERNS)
@pytest.mark.parametrize("paths", [1, 2, 3, 32])
@pytest.mark.parametrize("n", [1, 45, 96])
def test_branch_kernels_match_spec(rng, by, paths, n):
    x = rng.random(n, dtype=np.float32)
    out = poisoned(n)
    wd.branches(device(x), out, by=by, paths=paths, iters=5, threads=32)
    np.testing.assert_allclose(out.copy_to_host(), wd.branch_spec(x, wd.path_of(n, by, paths), 5), rtol=1e-5)


def test_paths_give_different_results(rng):
    """The output says which path a thread took, so a kernel that ran the wrong path cannot pass."""
    x = rng.random(64, dtype=np.float32)
    a = wd.branch_spec(x, np.zeros(64), 5)
    b = wd.branch_spec(x, np.ones(64), 5)
    assert np.all(np.abs(a - b) / np.abs(a) > 1e-3)


@pytest.mark.parametrize("threshold", [0.0, 0.3, 1.0])
def test_value_branch_matches_spec_in_any_order(rng, threshold):
    n = 80
    x = rng.random(n, dtype=np.float32)
    want = wd.branch_spec(x, wd.value_path(x, threshold), 6)
    out = poisoned(n)
    wd.value_branches(device(x), out, threshold=threshold, iters=6, threads=32)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-5)
    rare = x < threshold  # regrouped: common elements first, then rare ones; the output keeps x's order
    order = np.concatenate((np.flatnonzero(~rare), np.flatnonzero(rare))).astype(np.int64)
    out = poisoned(n)
    wd.value_branches(device(x), out, threshold=threshold, iters=6, order=device(order), threads=32)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-5)
    assert wd.paths_per_warp(wd.value_path(x[order], threshold)).sum() <= math.ceil(n / 32) + 1


@pytest.mark.parametrize("method", ["tree", "atomic"])
@pytest.mark.parametrize("n, blocks, threads", [(1, 1, 32), (100, 1, 64), (1000, 3, 64), (2053, 2, 128)])
def test_numba_reductions(rng, method, n, blocks, threads):
    x = rng.standard_normal(n).astype(np.float32)
    got = wd.reduce_sum(device(x), method=method, impl="numba", blocks=blocks, threads=threads).copy_to_host()[0]
    assert got == pytest.approx(wd.sum_spec(x), rel=1e-5, abs=1e-4)
    if method == "tree":  # deterministic: the model adds in the same order, so the float32 bits agree
        assert got == wd.reduce_model(x, "tree", blocks, threads, vector=1)[1]


def test_shuffle_reduction_needs_a_gpu_in_cpu_mode():
    if runtime.is_gpu():
        pytest.skip("GPU mode runs it")
    with pytest.raises(runtime.NeedsGPU, match="reduce_model"):
        wd.reduce_sum(device(np.ones(64, np.float32)), method="shuffle", impl="numba")


@pytest.mark.parametrize("call, message", [
    (lambda x, o: wd.branches(x, o, paths=0), "paths must be 1..32"),
    (lambda x, o: wd.branches(x, o, paths=33), "paths must be 1..32"),
    (lambda x, o: wd.branches(x, o, threads=48), "multiple of 32"),
    (lambda x, o: wd.branches(x, o, by="block"), "by must be one of"),
    (lambda x, o: wd.branches(x, o, impl="opencl"), "impl must be"),
    (lambda x, o: wd.branches(np.ones(64, np.float32), o), "must be a device array"),
    (lambda x, o: wd.branches(x, o[:10]), "out has shape (10,) but x has (64,)"),
    (lambda x, o: wd.branches(device(np.ones(64)), o), "x must have dtype float32, got float64"),
    (lambda x, o: wd.value_branches(x, o, threshold=0.5, order=device(np.arange(64, dtype=np.int32))), "order must have dtype int64"),
    (lambda x, o: wd.value_branches(x, o, threshold=0.5, iters=-1), "iters must be 0 or more"),
    (lambda x, o: wd.reduce_sum(x, method="tree", impl="numba", threads=96), "power of two"),
    (lambda x, o: wd.reduce_sum(x, method="fastest"), "method must be one of"),
    (lambda x, o: wd.reduce_sum(x, method="atomic_each", impl="numba"), "numba reductions are"),
    (lambda x, o: wd.reduce_sum(x[:0], method="tree", impl="numba"), "nothing to sum"),
])
def test_bad_input_is_named(call, message):
    x, o = device(np.ones(64, np.float32)), poisoned(64)
    with pytest.raises(runtime.CourseInputError) as err:
        call(x, o)
    assert message in str(err.value)


def test_cuda_c_needs_cupy_arrays():
    x = device(np.ones(64, np.float32))
    with pytest.raises((runtime.NeedsGPU, runtime.CourseInputError)):
        wd.branches(x, poisoned(64), impl="cuda_c")


# --------------------------------------------------------------------------------- the warp model

def test_lecture_example_costs_both_sides():
    w = wd.lecture_example()
    assert [s.label for s in w.steps] == ["A", "B", "X", "Y", "Z"]
    assert [s.active for s in w.steps] == [4, 4, 28, 28, 32]
    assert w.cost == 5 and w.useful == pytest.approx((4 + 4 + 28 + 28 + 32) / 32)
    synced = wd.lecture_example(sync=True)
    assert [s.label for s in synced.steps] == ["A", "X", "B", "Y", "Z"] and synced.cost == w.cost


def test_warp_branches_nest_and_skip_empty_sides():
    w = wd.Warp()
    with w.branch(w.lane < 16):
        w.run("low", 2)
        with w.branch(w.lane % 2 == 0):
            w.run("low even", 3)
        with w.branch(w.lane > 100):
            w.run("never")  # no lane: no step, no cost
    w.if_else(w.lane < 32, lambda w: w.run("all"), lambda w: w.run("none"))
    assert [(s.label, s.active) for s in w.steps] == [("low", 16), ("low even", 8), ("all", 32)]
    assert w.cost == 6
    assert w.steps[1].mask == sum(1 << lane for lane in range(0, 16, 2))
    assert wd.Warp().efficiency == 1.0


def test_warp_switch_and_loop():
    w = wd.Warp()
    w.switch(w.lane % 3, {0: lambda w: w.run("p0", 5), 1: lambda w: w.run("p1", 5), 2: lambda w: w.run("p2", 5),
                          3: lambda w: w.run("p3", 5)})
    assert w.cost == 15  # three paths held, the fourth never issued
    loop = wd.Warp()
    loop.loop(loop.lane, lambda w, k: w.run(f"trip {k}"))  # lane l loops l times
    assert loop.cost == 31 and loop.steps[0].active == 31 and loop.steps[-1].active == 1
    assert loop.efficiency == pytest.approx(sum(range(32)) / 32 / 31)


def test_masks_round_trip():
    lanes = np.zeros(32, bool)
    lanes[[0, 3, 31]] = True
    m = wd.mask_of(lanes)
    assert m == (1 | 8 | 1 << 31) and np.array_equal(wd.lanes_of(m), lanes)
    assert wd.ballot_sync(wd.FULL_MASK, np.arange(32) >= 28) == 0xF0000000
    assert wd.ballot_sync(0x0000FFFF, True) == 0xFFFF
    with pytest.raises(runtime.CourseInputError, match="32 lanes"):
        wd.mask_of(np.ones(31, bool))


def test_paths_per_warp_and_the_model():
    for paths in (1, 2, 4, 8, 32):
        assert np.all(wd.paths_per_warp(wd.path_of(1024, "lane", paths)) == paths)
        assert np.all(wd.paths_per_warp(wd.path_of(1024, "warp", paths)) == 1)
        assert wd.serialisation_slowdown(wd.path_of(1024, "lane", paths)) == paths
    assert wd.paths_per_warp(wd.path_of(40, "lane", 3)).tolist() == [3, 3]  # last warp of 8 lanes
    assert wd.serialisation_slowdown(wd.path_of(64, "lane", 4), body=1, common=2) == pytest.approx(6 / 3)


def test_expected_paths_matches_sampling(rng):
    assert wd.expected_paths(0.0) == 1 and wd.expected_paths(1.0) == 1
    assert wd.expected_paths(0.5) == pytest.approx(2 - 2 * 0.5**32)
    for f in (1 / 64, 1 / 8):
        x = rng.random(32 * 20_000, dtype=np.float32)
        sampled = wd.paths_per_warp(wd.value_path(x, f)).mean()
        assert sampled == pytest.approx(float(wd.expected_paths(f)), rel=0.01)


def test_value_warp_costs_one_or_two():
    assert wd.value_warp(np.full(32, 0.5, np.float32), 0.1).cost == 1
    x = np.full(32, 0.5, np.float32)
    x[7] = 0.0
    w = wd.value_warp(x, 0.1)
    assert w.cost == 2 and [s.active for s in w.steps if s.cost] == [1, 31]


def test_shuffles():
    v = np.arange(32, dtype=np.float32)
    down = wd.shfl_down_sync(wd.FULL_MASK, v, 4)
    assert down[:28].tolist() == list(range(4, 32)) and down[28:].tolist() == [28, 29, 30, 31]
    assert wd.shfl_up_sync(wd.FULL_MASK, v, 1)[:3].tolist() == [0, 0, 1]
    assert wd.shfl_down_sync(wd.FULL_MASK, v, 1, width=8)[7] == 7  # stays inside its segment of 8
    assert wd.shfl_xor_sync(wd.FULL_MASK, v, 1)[:4].tolist() == [1, 0, 3, 2]
    assert np.all(wd.shfl_sync(wd.FULL_MASK, v, 5) == 5)
    half = wd.shfl_down_sync(0x0000FFFF, v, 8)
    assert np.isnan(half[8]) and half[0] == 8  # lane 8 reads lane 16, outside the mask: undefined
    with pytest.raises(runtime.CourseInputError, match="32 lanes"):
        wd.shfl_down_sync(wd.FULL_MASK, np.ones(16), 1)
    butterfly = v.copy()
    for m in (16, 8, 4, 2, 1):
        butterfly = butterfly + wd.shfl_xor_sync(wd.FULL_MASK, butterfly, m)
    assert np.all(butterfly == 496)  # xor shuffles leave the sum in every lane


def test_warp_sum_model_is_the_tree_order(rng):
    v = rng.standard_normal((5, 32)).astype(np.float32)  # five warps at once
    lane0 = wd.warp_sum_model(v)[..., 0]
    by_hand = v.copy()
    for offset in (16, 8, 4, 2, 1):
        by_hand[:, :offset] = by_hand[:, :offset] + by_hand[:, offset:2 * offset]
    assert np.array_equal(lane0, by_hand[:, 0])  # the same float32 additions in the same order
    assert wd.warp_sum_model(np.arange(32))[0] == 496


@pytest.mark.parametrize("method", ["tree", "shuffle"])
@pytest.mark.parametrize("n, blocks, threads", [(1, 1, 32), (7, 1, 64), (4099, 3, 128), (100_003, 8, 256)])
def test_reduce_model_sums(rng, method, n, blocks, threads):
    x = rng.random(n, dtype=np.float32)
    partials, total = wd.reduce_model(x, method, blocks, threads)
    assert partials.shape == (blocks,) and partials.dtype == np.float32
    assert float(total) == pytest.approx(wd.sum_spec(x), rel=1e-5)


def test_thread_sums_cover_every_element_once():
    x = np.arange(1, 23, dtype=np.float32)  # 22 elements: five float4 and a tail of two
    acc = wd.thread_sums(x, blocks=1, threads=4)
    assert acc.sum() == x.sum()
    assert acc[0] == 1 + 2 + 3 + 4 + 17 + 18 + 19 + 20 + 21  # float4 0 and 4, then tail element 20
    assert np.array_equal(wd.thread_sums(x, 1, 4, vector=1), [1 + 5 + 9 + 13 + 17 + 21, 2 + 6 + 10 + 14 + 18 + 22,
                                                               3 + 7 + 11 + 15 + 19, 4 + 8 + 12 + 16 + 20])


def test_steps_from_log():
    log = {"events": ["X"] * 3 + ["A"] * 2 + ["Z"], "lanes": [2, 3, 4, 0, 1, 0]}
    assert wd.steps_from_log(log) == [wd.Step("X", 0b11100), wd.Step("A", 0b11), wd.Step("Z", 1)]


# -------------------------------------------------------------------- PTX, compiled without a GPU

@needs_compiler
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_c_compiles_with_the_warp_instructions(arch):
    ptx = cuda_c.compile_ptx(wd.SOURCE, arch=arch)
    kernels = ["order_no_sync", "order_syncwarp", "branch_on_lane", "branch_on_warp", "branch_on_value",
               "value_branch_masks", "reduce_tree", "reduce_shuffle", "reduce_atomic", "reduce_atomic_each"]
    kernels += [f"read_probe_{u}" for u in wd.READ_PROBE_UNROLLS]
    for kernel in kernels:
        assert f".entry {kernel}(" in ptx
    body = {k: cuda_c.ptx_entry(ptx, k) for k in kernels}
    assert body["reduce_shuffle"].count("shfl.sync.down.b32") == 10  # two warp sums of five shuffles
    assert "shfl.sync" not in body["reduce_tree"] and "bar.sync" in body["reduce_tree"]
    assert "bar.warp.sync" in body["order_syncwarp"] and "activemask.b32" in body["order_syncwarp"]
    assert body["order_syncwarp"].count("bar.warp.sync") > body["order_no_sync"].count("bar.warp.sync")
    assert "vote.sync.ballot.b32" in body["value_branch_masks"]
    assert re.search(r"(atom|red)\.global\.add\.f32", body["reduce_atomic"])
    assert "ld.global.cs.v4.f32" in body["reduce_shuffle"]  # float4 loads, streaming (__ldcs)


@pytest.fixture(scope="module")
def numba_warp_ptx():
    try:
        return numba_ptx(wd.NUMBA_WARP_KERNELS, module="kernels.warp_divergence", cc=(8, 0))
    except runtime.CourseError as exc:
        if "nvvm" in str(exc).lower():
            pytest.skip(f"numba-cuda cannot find NVVM here: {exc}")
        raise


def test_numba_shuffle_kernel_has_shuffles(numba_warp_ptx):
    assert numba_warp_ptx["reduce_shuffle"].count("shfl.sync.down.b32") == 10


def test_numba_mask_kernel_has_ballot_and_activemask(numba_warp_ptx):
    ptx = numba_warp_ptx["value_branch_masks"]
    assert "vote.sync.ballot.b32" in ptx and "activemask.b32" in ptx


@needs_compiler
def test_loop_counts_read_as_the_deep_dive_says():
    """Deep dive 02, section 4: numba unrolls the branch kernel's loop four times and still spends instructions on
    its counter every round; the CUDA C loop is unrolled sixteen times and spends a few a pass."""
    try:
        counts = lesson.loop_counts()
    except runtime.CourseError as exc:
        if "nvvm" in str(exc).lower():
            pytest.skip(f"numba-cuda cannot find NVVM here: {exc}")
        raise
    n, c = counts["numba"], counts["CUDA C"]
    assert (n["rounds"], c["rounds"]) == (4, 16), counts
    assert n["other"] >= 2 * n["rounds"] and c["other"] <= 6, counts
    assert n["other"] / n["rounds"] > 4 * c["other"] / c["rounds"], counts
    lines = lesson.loop_lines(counts)
    assert lines[0].startswith("numba: 4 rounds") and lines[1].startswith("CUDA C: 16 rounds")


def test_numba_ptx_of_source():
    source = ("from numba import cuda\n\n@cuda.jit\ndef k(x, out):\n    i = cuda.grid(1)\n"
              "    out[i] = cuda.shfl_xor_sync(0xffffffff, x[i], 1)\n")
    try:
        ptx = numba_ptx({"k": "void(float32[::1], float32[::1])"}, source=source)["k"]
    except runtime.CourseError as exc:
        if "nvvm" in str(exc).lower():
            pytest.skip(f"numba-cuda cannot find NVVM here: {exc}")
        raise
    assert "shfl.sync.bfly.b32" in ptx
    with pytest.raises(runtime.CourseError, match="could not compile"):
        numba_ptx({"k": "void(float32[::1])"}, source=source)  # wrong signature


# ------------------------------------------------ the model against what a GPU recorded (either mode)

@pytest.fixture(scope="module")
def record():
    rec = records.latest(LESSON)
    if rec is None:
        pytest.skip("no GPU record of lesson 2 yet")
    return rec["figures"]


def test_recorded_order_of_events(record):
    for key, sync in (("no_sync", False), ("syncwarp", True)):
        log = record["order"][key]
        steps = wd.steps_from_log(log)
        model = wd.lecture_example(sync).steps
        assert sorted((s.label, s.mask) for s in steps) == sorted((s.label, s.mask) for s in model)
        for label, lane, mask in zip(log["events"], log["lanes"], log["masks"]):
            assert mask >> lane & 1  # activemask includes the lane itself
        assert steps[-1] == wd.Step("Z", wd.FULL_MASK)
    log = record["order"]["syncwarp"]
    first = [i for i, e in enumerate(log["events"]) if e in "AX"]
    second = [i for i, e in enumerate(log["events"]) if e in "BY"]
    assert max(first) < min(second)  # __syncwarp: all of A and X before any of B and Y
    assert log["seen"] == seen_after_sync()


def seen_after_sync():
    """What each lane reads in B or Y once A and X are done: A wrote 100 + lane, X 200 + lane."""
    return [204.0 + lane if lane < 4 else (100.0 + lane - 4 if lane < 8 else 200.0 + lane) for lane in range(32)]


def test_recorded_masks_match_the_model(record):
    m = record["masks"]
    x = np.asarray(m["x"], np.float32)
    for impl in ("cuda_c", "numba"):
        got = m[impl]
        for w in range(len(got["taken"])):
            rare = x[w * 32:(w + 1) * 32] < np.float32(m["threshold"])
            assert got["taken"][w] == wd.ballot_sync(wd.FULL_MASK, rare)
            assert got["active_rare"][w] == wd.mask_of(rare)
            assert got["active_common"][w] == wd.mask_of(~rare)


def test_recorded_slowdowns_follow_the_serialisation_model(record):
    """Issue target: for a compute-bound body, 2, 4 and 8 paths within 20% of the model."""
    lanes = record["lanes"]
    for impl in ("CUDA C", "numba"):
        s = lanes["series"][f"{impl}, branch on lane id"]
        for p in (2, 4, 8):
            i = lanes["paths"].index(p)
            assert s["slowdown"][i] == pytest.approx(s["model"][i], rel=0.2), f"{impl}, {p} paths"
    flat = lanes["series"]["CUDA C, branch on warp id"]["slowdown"]
    assert max(flat) < 1.2  # the same branch on the warp id costs (almost) nothing


def test_recorded_data_divergence_follows_the_model(record):
    s = record["data"]["sweep"]
    for measured, model in zip(s["slowdown"], s["paths_per_warp"]):
        assert measured == pytest.approx(model, rel=0.2)
    for r in record["data"]["regroup"]:
        assert r["regrouped_ms"] < r["random_ms"] and r["sorted_ms"] < r["random_ms"]
        # notebook 02: with heavy bodies regrouping pays, the pass that builds the permutation included
        assert r["regrouped_ms"] + r["permutation_ms"] < r["random_ms"]


def test_recorded_reduction_targets(record):
    """Issue target: the shuffle reduction of 1 GiB at >= 0.85 of the read ceiling and >= cupy.sum."""
    table = record["reductions"]
    assert table["bytes"] == 2**30
    rows = {r["name"]: r for r in table["rows"]}
    shuffle = rows["CUDA C, warp shuffles"]
    assert shuffle["of_read"] >= 0.85
    assert shuffle["gbps"] >= rows["cupy.sum"]["gbps"]
    for r in table["rows"]:
        if r["kind"] != "ceiling" and "per element" not in r["name"]:
            assert r["rel_error"] < 1e-4


def test_recorded_figures_read_as_the_lessons_say(record):
    """Notebook 02 and its deep dive, in words that must hold on every record: the one-path body runs at a rate
    comparable to cuBLAS FP32; numba's branch kernel takes longer than the CUDA C one at every path count, by about the same factor;
    without __syncwarp B read -1 and Y read A's values; tree and shuffle sums run close to the read ceiling,
    level with cupy.sum, and ahead of numba's; one atomic per thread takes several times as long, one per element
    orders of magnitude longer, and gets the sum wrong; from a few blocks per SM on the grid hardly matters;
    the read probe needs many blocks with one load in flight and a handful with four or more, and from 8 blocks per
    SM on its rows with two or more loads in flight have levelled off."""
    for rec in records.all_records(LESSON):
        f, where = rec["figures"], rec["path"]
        lanes = f["lanes"]
        assert 0.5 * rec["ceilings"]["fp32_tflops"] <= lanes["tflops_one_path"] <= 2 * rec["ceilings"]["fp32_tflops"]
        c, nb = lanes["series"]["CUDA C, branch on lane id"], lanes["series"]["numba, branch on lane id"]
        assert all(n > 1.5 * m for n, m in zip(nb["median_ms"], c["median_ms"])), where
        ratios = [n / m for n, m in zip(nb["median_ms"], c["median_ms"])]  # the same at every path count
        assert max(ratios) <= 1.1 * min(ratios), where
        seen = f["order"]["no_sync"]["seen"]
        assert seen[:4] == [-1.0] * 4 and seen[4:8] == [100.0, 101.0, 102.0, 103.0], where
        rows = {r["name"]: r for r in f["reductions"]["rows"]}
        shuffle, cupy = rows["CUDA C, warp shuffles"], rows["cupy.sum"]
        for name in ("CUDA C, warp shuffles", "CUDA C, shared-memory tree"):
            assert rows[name]["of_read"] >= 0.85 and rows[name]["gbps"] >= 0.97 * cupy["gbps"], (where, name)
            assert rows[name.replace("CUDA C", "numba")]["gbps"] < rows[name]["gbps"], (where, name)
        assert rows["CUDA C, atomics (one per thread)"]["median_ms"] >= 2 * shuffle["median_ms"], where
        each = rows["CUDA C, atomics (one per element)"]
        assert each["median_ms"] >= 100 * shuffle["median_ms"] and each["rel_error"] > 0.1, where
        grids = f["reduce_grids"]
        for method, gbps in grids["gbps"].items():
            few = grids["blocks_per_sm"].index(4)
            assert min(gbps[few:]) >= 0.95 * max(gbps) and gbps[0] < 0.9 * max(gbps), (where, method)
        probes = {(p["unroll"], p["blocks_per_sm"]): p["gbps"] for p in f["reductions"]["probes"]}
        best = max(probes.values())
        assert probes[1, 4] < 0.9 * best and all(probes[u, 4] >= 0.95 * best for u in (4, 8)), where
        # the reductions' default grid sits where the rows with two or more loads in flight have levelled off
        assert all(probes[u, k] >= 0.95 * best for u in (2, 4, 8) for k in (8, 16, 32) if (u, k) in probes), where
        assert wd.REDUCE_BLOCKS_PER_SM in (8, 16, 32), where


# ----------------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
@pytest.mark.parametrize("by", wd.PATTERNS)
@pytest.mark.parametrize("impl", ["cuda_c", "numba"])
@pytest.mark.parametrize("n", [1, 1000, 2**16 + 5])
def test_branch_kernels_on_gpu(rng, by, impl, n):
    cp = runtime.cupy()
    x = rng.random(n, dtype=np.float32)
    for paths in (1, 2, 7, 32):
        out = cp.full(n, cp.nan, dtype=cp.float32)
        wd.branches(cp.asarray(x), out, by=by, paths=paths, iters=100, impl=impl)
        np.testing.assert_allclose(out.get(), wd.branch_spec(x, wd.path_of(n, by, paths), 100), rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda_c", "numba"])
def test_value_branch_on_gpu(rng, impl):
    cp = runtime.cupy()
    n = 5000
    x = rng.random(n, dtype=np.float32)
    want = wd.branch_spec(x, wd.value_path(x, 0.2), 50)
    order = cp.asarray(rng.permutation(n).astype(np.int64))
    for o in (None, order):
        out = cp.full(n, cp.nan, dtype=cp.float32)
        wd.value_branches(cp.asarray(x), out, threshold=0.2, iters=50, order=o, impl=impl)
        np.testing.assert_allclose(out.get(), want, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3, 5, 33, 1023, 2**20 + 3])
@pytest.mark.parametrize("method, impl", [("tree", "cuda_c"), ("shuffle", "cuda_c"), ("tree", "numba"),
                                          ("shuffle", "numba")])
def test_deterministic_reductions_match_the_model_bit_for_bit(rng, n, method, impl):
    cp = runtime.cupy()
    x = rng.standard_normal(n).astype(np.float32)
    for blocks, threads in ((1, 32), (3, 64), (7, 256), (132, 1024)):
        got = wd.reduce_sum(cp.asarray(x), method=method, impl=impl, blocks=blocks, threads=threads).get()[0]
        want = wd.reduce_model(x, method, blocks, threads, vector=4 if impl == "cuda_c" else 1)[1]
        assert got == want, f"{method} ({impl}), n={n}, {blocks} x {threads}: GPU {got!r}, model {want!r}"
        assert got == pytest.approx(wd.sum_spec(x), rel=1e-4, abs=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("method, impl", [("atomic", "cuda_c"), ("atomic", "numba"), ("atomic_each", "cuda_c")])
def test_atomic_reductions(rng, method, impl):
    cp = runtime.cupy()
    x = rng.standard_normal(100_003).astype(np.float32)
    got = wd.reduce_sum(cp.asarray(x), method=method, impl=impl).get()[0]
    assert got == pytest.approx(wd.sum_spec(x), rel=1e-4, abs=1e-2)


@pytest.mark.gpu
def test_order_of_events_live():
    for sync in (False, True):
        log = wd.order_of_events(sync)
        steps = wd.steps_from_log(log)
        assert sorted((s.label, s.mask) for s in steps) == sorted((s.label, s.mask) for s in wd.lecture_example(sync).steps)
        if sync:
            assert log["seen"] == seen_after_sync()  # B saw what X wrote


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda_c", "numba"])
def test_value_masks_live(rng, impl):
    cp = runtime.cupy()
    x = rng.random(32 * 50 + 7, dtype=np.float32)  # the last warp is partial
    got = wd.value_masks(cp.asarray(x), 0.3, impl=impl)
    for w in range(51):
        chunk = x[w * 32:(w + 1) * 32]
        rare = np.zeros(32, bool)
        rare[: chunk.size] = chunk < np.float32(0.3)
        assert got["taken"][w] == wd.mask_of(rare)
        assert got["active_rare"][w] == wd.mask_of(rare)
        valid = np.arange(32) < chunk.size
        assert got["active_common"][w] == wd.mask_of(valid & ~rare)


@pytest.mark.gpu
def test_measured_slowdowns_follow_the_model():
    import benchmarks.warp_divergence as lesson

    lanes = lesson.lane_sweep(paths=(1, 2, 4, 8), repeats=5)
    for p, measured, model, ratio in lesson.slowdown_table(lanes):
        assert 0.8 <= ratio <= 1.2, f"{p} paths: measured {measured:.2f}x, model {model:.2f}x"


@pytest.mark.gpu
def test_shuffle_reduction_against_read_ceiling_and_cupy():
    cp = runtime.cupy()
    n = 2**28
    x = cp.random.random(n, dtype=cp.float32)
    sms = runtime.get().device["sms"]

    out = cp.empty(1, dtype=cp.float32)
    partials = cp.empty(32 * sms, dtype=cp.float32)
    t = bench.interleaved({"read": lambda: wd.read_probe(x, unroll=8, blocks=16 * sms),
                            "shuffle": lambda: wd.reduce_sum(x, method="shuffle", partials=partials, out=out),
                            "cupy": lambda: cp.sum(x, keepdims=True, out=out)}, rounds=3)
    read, shuffle, library = (t[k].gbps(4 * n) for k in ("read", "shuffle", "cupy"))
    assert shuffle >= 0.85 * read, f"shuffle {shuffle:.0f} GB/s, read ceiling {read:.0f} GB/s"
    assert shuffle >= 0.97 * library, f"shuffle {shuffle:.0f} GB/s, cupy.sum {library:.0f} GB/s"


@pytest.mark.skipif(runtime.is_gpu(), reason="the simulator's stand-in shuffles are for CPU mode")
def test_simulated_shuffles_sum_a_warp_like_the_model():
    counts = wd.simulate_warp_shuffles()
    assert wd.simulate_warp_shuffles() is counts
    counts.reset()
    x = np.arange(64, dtype=np.float32)
    out = cuda.to_device(np.zeros(1, np.float32))

    @cuda.jit
    def warp_sums(x, out):
        v = x[cuda.grid(1)]
        offset = 16
        while offset > 0:
            v += cuda.shfl_down_sync(wd.FULL_MASK, v, offset)
            offset //= 2
        if cuda.laneid == 0:
            cuda.atomic.add(out, 0, v)

    warp_sums[1, 64](cuda.to_device(x), out)
    assert out.copy_to_host()[0] == x.sum()
    assert set(counts.shuffles.values()) == {5} and len(counts.shuffles) == 64
    assert counts.atomics == 2


# ------------------------------------------- the statements the notebook prints, on every record

def _readings(rec):
    import benchmarks.warp_divergence as lesson

    f = rec["figures"]
    return {"lanes": lesson.lane_reading(f["lanes"], rec["ceilings"]), "data": lesson.data_reading(f["data"]),
            "reductions": lesson.reduction_reading(f["reductions"]),
            "reduce_grids": lesson.reduce_grid_reading(f["reduce_grids"])}


def test_recorded_statements_printed_by_the_notebook_hold():
    """Notebook 02 prints its comparisons of figures (sections 2 to 4) from these readings, under the figures
    they read; on every record each statement holds. Their words come from the relation each tests, so a
    comparison reversed in the code fails here."""
    recs = records.all_records(LESSON)
    if not recs:
        pytest.skip("no record of lesson 2")
    for rec in recs:
        for figure, read in _readings(rec).items():
            assert read and all(s and len(s) <= 93 for s, _ in read), (rec["path"], figure)
            failed = [s for s, ok in read if ok is not True]
            assert not failed, (rec["path"], figure, failed)


def test_reversed_figures_print_the_statements_as_not_holding():
    """The newest record with its figures turned round (numba faster than CUDA C, the warp-id branch as slow as
    the lane-id one, regrouping slower than random order, atomics as fast as shuffles, numba's sums ahead): the
    statements they touch print NO."""
    import copy

    from gpucourse import claims

    rec = records.latest(LESSON)
    if rec is None:
        pytest.skip("no record of lesson 2")
    rec = copy.deepcopy(rec)
    f = rec["figures"]
    s = f["lanes"]["series"]
    s["numba, branch on lane id"]["median_ms"] = [t / 10 for t in s["CUDA C, branch on lane id"]["median_ms"]]
    s["CUDA C, branch on warp id"]["slowdown"] = list(s["CUDA C, branch on lane id"]["slowdown"])
    for r in f["data"]["regroup"]:
        r["sorted_ms"] = r["regrouped_ms"] = 2 * r["random_ms"]
    rows = {r["name"]: r for r in f["reductions"]["rows"]}
    rows["CUDA C, atomics (one per thread)"]["median_ms"] = rows["CUDA C, warp shuffles"]["median_ms"]
    rows["CUDA C, atomics (one per element)"]["median_ms"] = rows["CUDA C, warp shuffles"]["median_ms"]
    for kind in ("warp shuffles", "shared-memory tree"):
        rows[f"numba, {kind}"]["gbps"] = 2 * rows[f"CUDA C, {kind}"]["gbps"]
    read = {s: ok for part in _readings(rec).values() for s, ok in part}
    turned = ("branch on warp id", "numba's time", "numba, warp", "numba, shared", "CUDA C, atomics (one per thread)",
              "CUDA C, atomics (one per element), time")
    reversed_ = [s for s in read if s.startswith(turned) or "sorted" in s or "regrouped" in s]
    assert len(reversed_) == 10 and all(read[s] is False for s in reversed_), reversed_
    lines = claims.lines([(s, read[s]) for s in reversed_]).splitlines()
    assert all(line.startswith(" NO  ") for line in lines)
    assert all(ok is True for s, ok in read.items() if s not in reversed_)

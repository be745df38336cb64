"""Lesson 2's measurements on a GPU, and the figures drawn from them (measured or recorded).

Every function that measures needs GPU mode and checks each kernel's result before timing it; every plot
function takes the figures plus their source label, so the notebook draws recorded figures in CPU mode with
the same code. The models the measurements are set against are in kernels/warp_divergence.py.
"""
from __future__ import annotations

import numpy as np

from gpucourse.records import Figure
from gpucourse import bench, claims, plots, runtime
from kernels import warp_divergence as wd

LESSON = "02_warp_divergence"
FRACTIONS = (0.0, 1 / 4096, 1 / 1024, 1 / 256, 1 / 64, 1 / 16, 1 / 4, 1 / 2)  # of lanes on the rare path
BLOCKS_PER_SM = (1, 2, 4, 8, 16, 32)
MASK_SEED, MASK_WARPS, MASK_THRESHOLD = 2, 8, 0.1
TOLERANCE = 1e-4  # relative, kernels against branch_spec (float32 multiply-adds against float64)


def _check_close(got, want, what: str, rtol: float = TOLERANCE) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bad = np.flatnonzero(~np.isclose(got, want, rtol=rtol, atol=0))
    if bad.size:
        i = bad[0]
        raise runtime.CourseError(f"{what}: {bad.size} of {got.size} elements wrong, the first at {i} "
                                  f"(got {got[i]}, want {want[i]}); not timing it")


def order() -> dict:
    """The lecture's A/B vs X/Y example on one warp, without and with __syncwarp."""
    return {"no_sync": wd.order_of_events(False), "syncwarp": wd.order_of_events(True)}


def lane_sweep(n: int | None = None, iters: int | None = None, repeats: int = 10, paths=None) -> dict:
    """Time of the compute-bound body on 1..32 paths, branching on the lane id (divergent) and on the warp
    id (not), in CUDA C and numba, against the serialisation model. Every thread runs the body once whatever
    the number of paths, so without divergence the time would not change."""
    cp = runtime.cupy()
    cuda = runtime.cuda()
    n = n or runtime.size("warp_divergence.branch_n")
    iters = iters or runtime.size("warp_divergence.iters")
    paths = list(paths or runtime.size("warp_divergence.paths"))
    if paths[0] != 1:
        raise runtime.CourseInputError("the sweep starts at one path: slowdowns are relative to it")
    runtime.check_fits(2 * 4 * n, "the branch sweep")
    x = cp.asarray(np.random.default_rng(0).random(n, dtype=np.float32))
    out = cp.full(n, cp.nan, dtype=cp.float32)
    nx, nout = cuda.as_cuda_array(x), cuda.as_cuda_array(out)
    host_x = x.get()
    series = {}
    configs = [("CUDA C", "lane", "cuda_c"), ("CUDA C", "warp", "cuda_c"), ("numba", "lane", "numba")]
    for label, by, impl in bench.progress(configs, desc="branch sweep"):
        xa, oa = (x, out) if impl == "cuda_c" else (nx, nout)
        times = []
        for p in paths:
            def launch():
                wd.branches(xa, oa, by=by, paths=p, iters=iters, impl=impl)

            out.fill(cp.nan)
            launch()
            _check_close(out.get(), wd.branch_spec(host_x, wd.path_of(n, by, p), iters), f"{label}, {by}, {p} paths")
            times.append(bench.time_per_call(launch, batch=4, repeats=repeats).median_ms)
        series[f"{label}, branch on {by} id"] = {
            "impl": impl, "by": by, "median_ms": times, "slowdown": [t / times[0] for t in times],
            "model": [wd.serialisation_slowdown(wd.path_of(n, by, p)) for p in paths]}
    flops = n * iters * 4 * 2  # four chains, a multiply-add is two FLOPs
    one = series["CUDA C, branch on lane id"]["median_ms"][0]
    return {"n": n, "iters": iters, "paths": paths, "threads": 256, "flops": flops,
            "tflops_one_path": bench.tflops(flops, one), "series": series}


def data_divergence(n: int | None = None, iters: int | None = None, repeats: int = 10) -> dict:
    """A two-way branch on the data (x < threshold), with uniform random x: the fraction of elements on
    the rare path against time, measured and modelled; then the same data sorted, and regrouped through a
    permutation, so that every warp holds one path."""
    cp = runtime.cupy()
    n = n or runtime.size("warp_divergence.branch_n")
    iters = iters or runtime.size("warp_divergence.iters")
    runtime.check_fits(4 * 4 * n, "the data-dependent branch")
    host_x = np.random.default_rng(1).random(n, dtype=np.float32)
    x = cp.asarray(host_x)
    out = cp.full(n, cp.nan, dtype=cp.float32)

    def timed(what, launch, want):
        out.fill(cp.nan)
        launch()
        _check_close(out.get(), want, what)
        return bench.time_per_call(launch, batch=4, repeats=repeats).median_ms

    sweep = {"fractions": list(FRACTIONS), "median_ms": [], "paths_per_warp": [], "expected_paths": []}
    for f in bench.progress(FRACTIONS, desc="data-dependent branch"):
        path = wd.value_path(host_x, f)
        sweep["median_ms"].append(timed(f"random, fraction {f}", lambda: wd.value_branches(
            x, out, threshold=f, iters=iters, impl="cuda_c"), wd.branch_spec(host_x, path, iters)))
        sweep["paths_per_warp"].append(float(wd.paths_per_warp(path).mean()))
        sweep["expected_paths"].append(float(wd.expected_paths(f)))
    base = sweep["median_ms"][0]
    sweep["slowdown"] = [t / base for t in sweep["median_ms"]]

    regroup = []
    for f in (1 / 64, 1 / 2):
        path = wd.value_path(host_x, f)
        want = wd.branch_spec(host_x, path, iters)
        random_ms = sweep["median_ms"][FRACTIONS.index(f)]
        xs, host_xs = cp.sort(x), np.sort(host_x)
        sorted_ms = timed(f"sorted, fraction {f}", lambda: wd.value_branches(
            xs, out, threshold=f, iters=iters, impl="cuda_c"),
            wd.branch_spec(host_xs, wd.value_path(host_xs, f), iters))

        def permutation():
            rare = x < f
            return cp.concatenate((cp.flatnonzero(~rare), cp.flatnonzero(rare)))

        order = permutation()
        regrouped_ms = timed(f"regrouped, fraction {f}", lambda: wd.value_branches(
            x, out, threshold=f, iters=iters, order=order, impl="cuda_c"), want)
        permutation_ms = bench.time_gpu(permutation, repeats=repeats).median_ms
        regroup.append({"fraction": f, "random_ms": random_ms, "sorted_ms": sorted_ms,
                        "regrouped_ms": regrouped_ms, "permutation_ms": permutation_ms,
                        "paths_per_warp_random": float(wd.paths_per_warp(path).mean()),
                        "paths_per_warp_sorted": float(wd.paths_per_warp(wd.value_path(host_xs, f)).mean())})
    return {"n": n, "iters": iters, "base_ms": base, "sweep": sweep, "regroup": regroup}


def mask_data() -> np.ndarray:
    """The input whose lane masks are recorded: MASK_WARPS warps of uniform random float32."""
    return np.random.default_rng(MASK_SEED).random(MASK_WARPS * wd.WARP, dtype=np.float32)


def masks() -> dict:
    """Lane masks of the data-dependent branch, read on the GPU (ballot_sync, and activemask inside each
    side), from CUDA C and from numba, with the input they came from."""
    cp = runtime.cupy()
    x = mask_data()
    return {"x": x.tolist(), "threshold": MASK_THRESHOLD,
            "cuda_c": wd.value_masks(cp.asarray(x), MASK_THRESHOLD, impl="cuda_c"),
            "numba": wd.value_masks(cp.asarray(x), MASK_THRESHOLD, impl="numba")}


def reductions(n: int | None = None, rounds: int = 5) -> dict:
    """Sum of n float32 (1 GiB on a GPU) three ways in CUDA C and numba, one atomic per element, and
    cupy.sum, against the read ceiling: a read-only probe, in the configuration (unroll, grid) that was
    fastest in a sweep. Every result is checked against a float64 sum first; then all are timed in
    interleaved rounds, the probe among them."""
    cp = runtime.cupy()
    n = n or runtime.size("warp_divergence.reduce_n")
    runtime.check_fits(4 * n + 2**20, f"a reduction of {n:,} float32")
    x = cp.random.random(n, dtype=cp.float32)
    want = float(cp.sum(x, dtype=cp.float64))
    nbytes = 4 * n
    sms = runtime.get().device["sms"]
    sink = cp.zeros(1, dtype=cp.uint32)

    probes = []
    for unroll in bench.progress(wd.READ_PROBE_UNROLLS, desc="read probe"):
        for per_sm in (4, 8, 16, 32):
            t = bench.time_per_call(lambda: wd.read_probe(x, unroll=unroll, blocks=per_sm * sms, sink=sink), repeats=5)
            probes.append({"unroll": unroll, "blocks_per_sm": per_sm, "gbps": t.gbps(nbytes), **t.summary()})
    best = max(probes, key=lambda r: r["gbps"])

    cuda = runtime.cuda()
    nx = cuda.as_cuda_array(x)
    blocks = wd.default_blocks(n, 256)
    partials, out = cp.empty(blocks, dtype=cp.float32), cp.empty(1, dtype=cp.float32)
    probe_name = f"read probe (unroll {best['unroll']}, {best['blocks_per_sm']} blocks per SM)"
    launchers = {  # name: (kind, launch)
        "CUDA C, warp shuffles": ("kernel", lambda: wd.reduce_sum(x, method="shuffle", partials=partials, out=out)),
        "CUDA C, shared-memory tree": ("kernel", lambda: wd.reduce_sum(x, method="tree", partials=partials, out=out)),
        "CUDA C, atomics (one per thread)": ("kernel", lambda: wd.reduce_sum(x, method="atomic", out=out)),
        "CUDA C, atomics (one per element)": ("kernel", lambda: wd.reduce_sum(x, method="atomic_each", out=out)),
        "numba, warp shuffles": ("kernel", lambda: wd.reduce_sum(nx, method="shuffle", impl="numba", partials=partials, out=out)),
        "numba, shared-memory tree": ("kernel", lambda: wd.reduce_sum(nx, method="tree", impl="numba", partials=partials, out=out)),
        "numba, atomics (one per thread)": ("kernel", lambda: wd.reduce_sum(nx, method="atomic", impl="numba", out=out)),
        "cupy.sum": ("library", lambda: cp.sum(x, keepdims=True, out=out)),
        probe_name: ("ceiling", lambda: wd.read_probe(x, unroll=best["unroll"], blocks=best["blocks_per_sm"] * sms, sink=sink)),
    }
    results = {}
    for name, (kind, launch) in bench.progress(launchers.items(), desc="checking"):
        if kind == "ceiling":
            continue
        out.fill(cp.nan)
        launch()
        got = float(out.get()[0])
        error = abs(got - want) / abs(want)
        if "per element" not in name and not error < 1e-4:
            raise runtime.CourseError(f"{name} summed to {got}, the float64 sum is {want}; not timing it")
        results[name] = {"result": got, "rel_error": error}
    slow = "CUDA C, atomics (one per element)"  # about 0.5 s a call: timed on its own, three times
    timings = bench.interleaved({k: v[1] for k, v in launchers.items() if k != slow}, rounds=rounds)
    timings[slow] = bench.time_gpu(launchers[slow][1], repeats=3, warmup=1)
    rows = []
    for name, (kind, _) in launchers.items():
        t = timings[name]
        rows.append({"name": name, "kind": kind, **results.get(name, {"result": None, "rel_error": None}),
                     **t.summary(), "gbps": t.gbps(nbytes)})
    library = next(r["gbps"] for r in rows if r["kind"] == "library")
    read = next(r["gbps"] for r in rows if r["kind"] == "ceiling")
    for r in rows:
        r["of_read"] = r["gbps"] / read
        r["of_cupy"] = r["gbps"] / library
    return {"n": n, "bytes": nbytes, "blocks": blocks, "threads": 256, "float64_sum": want,
            "read_gbps": read, "read_best": {k: best[k] for k in ("unroll", "blocks_per_sm")},
            "probes": probes, "rows": rows}


def reduce_grids(n: int | None = None, repeats: int = 10) -> dict:
    """GB/s of the CUDA C shuffle and tree reductions against the number of blocks (256 threads each)."""
    cp = runtime.cupy()
    n = n or runtime.size("warp_divergence.reduce_n")
    x = cp.random.random(n, dtype=cp.float32)
    sms = runtime.get().device["sms"]
    out = cp.empty(1, dtype=cp.float32)
    partials = cp.empty(max(BLOCKS_PER_SM) * sms, dtype=cp.float32)
    series = {}
    for method in bench.progress(("shuffle", "tree"), desc="grids"):
        series[method] = [bench.time_per_call(lambda: wd.reduce_sum(x, method=method, blocks=k * sms, partials=partials,
                                                              out=out), repeats=repeats).gbps(4 * n)
                          for k in BLOCKS_PER_SM]
    return {"n": n, "sms": sms, "threads": 256, "blocks_per_sm": list(BLOCKS_PER_SM), "gbps": series}


def run() -> tuple:
    """Every measurement of the lesson: (figures, ceilings), for `python -m gpucourse record`."""
    ceilings = bench.measure_ceilings().as_dict()
    measure = {"order": order, "lanes": lane_sweep, "data": data_divergence, "masks": masks,
               "reductions": reductions, "reduce_grids": reduce_grids}
    figures = {}
    for key in FIGURES:
        figures[key] = measure[key]()
        runtime.cupy().get_default_memory_pool().free_all_blocks()
    return figures, ceilings


# ------------------------------------------------------------------------------ text and checks

def slowdown_table(lanes: dict, paths=(2, 4, 8)) -> list:
    """Measured slowdown against the model for the CUDA C lane branch: rows of (paths, measured, model,
    measured / model)."""
    s = lanes["series"]["CUDA C, branch on lane id"]
    rows = []
    for p in paths:
        i = lanes["paths"].index(p)
        rows.append((p, s["slowdown"][i], s["model"][i], s["slowdown"][i] / s["model"][i]))
    return rows


def lane_reading(lanes: dict, ceilings: dict) -> list:
    """What notebook 02, section 2, says about the branch sweep (``lanes``: a run's or a record's figure "lanes";
    ``ceilings`` of the same run): the lane-id branch slows down as the serialisation model says (within 20%), the
    warp-id branch stays flat, the one-path body runs at a rate comparable to cuBLAS FP32, numba's kernel takes
    longer than the CUDA C one. [(statement, holds)], the words from the relation each tests."""
    series = lanes["series"]

    def slowdown(impl, p, key="slowdown"):
        return lambda: series[f"{impl}, branch on lane id"][key][lanes["paths"].index(p)]

    def numba_over_c():
        c, nb = series["CUDA C, branch on lane id"]["median_ms"], series["numba, branch on lane id"]["median_ms"]
        return min(n / m for n, m in zip(nb, c))

    read = [claims.compare(f"{impl}, {p} paths: slowdown", "level with", "the model's", slowdown(impl, p),
                           slowdown(impl, p, "model"), 0.2)
            for impl, p in (("CUDA C", 2), ("CUDA C", 4), ("CUDA C", 8), ("numba", 8))]
    return read + [
        claims.compare("branch on warp id, largest slowdown", "below", "1.2x",
                       lambda: max(series["CUDA C, branch on warp id"]["slowdown"]), 1.2),
        claims.compare("one path, FP32 TFLOP/s", "level with", "cuBLAS's FP32 matrix product",
                       lambda: lanes["tflops_one_path"], lambda: ceilings["fp32_tflops"], 0.5),
        claims.compare("numba's time over the CUDA C kernel's, least over the path counts", "above", "1.5x",
                       numba_over_c, 1.5),
    ]


def data_reading(data: dict) -> list:
    """What notebook 02, section 3, says about divergence from the data (``data``: the figure "data"): the
    measured slowdown follows the mean paths per warp of the data (within 20% at every fraction); sorting and
    regrouping run faster than random order, regrouping even with the pass that builds its permutation."""
    sweep_ = data["sweep"]

    def farthest():
        return max(abs(m / p - 1) for m, p in zip(sweep_["slowdown"], sweep_["paths_per_warp"]))

    read = [claims.compare("measured slowdown, farthest from the paths per warp", "below", "20% off", farthest, 0.2)]
    for r in data["regroup"]:
        f = f"f = 1/{round(1 / r['fraction'])}"
        read += [claims.compare(f"{f}: sorted (ms)", "below", "random order", r["sorted_ms"], r["random_ms"]),
                 claims.compare(f"{f}: regrouped + building the permutation (ms)", "below", "random order",
                                r["regrouped_ms"] + r["permutation_ms"], r["random_ms"])]
    return read


def reduction_reading(table: dict) -> list:
    """What notebook 02, section 4, says about the sums (``table``: the figure "reductions"): the CUDA C tree and
    shuffle sums run close to the read ceiling (above 0.85 of it) and level with cupy.sum (within 3%), numba's
    below them; one atomic per thread takes more than twice the shuffle sum's time, one per element more than a
    hundred times, with the sum more than 10% off."""
    rows = {r["name"]: r for r in table["rows"]}

    def of(name, key, times=1.0):
        return lambda: times * rows[name][key]

    read = []
    for kind in ("warp shuffles", "shared-memory tree"):
        c = f"CUDA C, {kind}"
        read += [claims.compare(f"{c}, share of the read ceiling", "above", "0.85", of(c, "of_read"), 0.85),
                 claims.compare(f"{c} (GB/s)", "no slower than", "cupy.sum (within 3%)", of(c, "gbps"),
                                of("cupy.sum", "gbps"), 0.03),
                 claims.compare(f"numba, {kind} (GB/s)", "below", c, of(f"numba, {kind}", "gbps"), of(c, "gbps"))]
    shuffle = "CUDA C, warp shuffles"
    return read + [
        claims.compare("CUDA C, atomics (one per thread), time", "above", "2x the shuffle sum's",
                       of("CUDA C, atomics (one per thread)", "median_ms"), of(shuffle, "median_ms", 2)),
        claims.compare("CUDA C, atomics (one per element), time", "above", "100x the shuffle sum's",
                       of("CUDA C, atomics (one per element)", "median_ms"), of(shuffle, "median_ms", 100)),
        claims.compare("CUDA C, atomics (one per element), relative error", "above", "10%",
                       of("CUDA C, atomics (one per element)", "rel_error"), 0.1),
    ]


def reduce_grid_reading(grids: dict) -> list:
    """What notebook 02 says about the sums' grid (``grids``: the figure "reduce_grids"): from 4 blocks of 256
    threads per SM on each sum stays above 0.95 of its best; at one block per SM it is below 0.9 of it."""
    read = []
    for method, gbps in grids["gbps"].items():
        few = grids["blocks_per_sm"].index(4)
        read += [claims.compare(f"{method} sum, least GB/s from 4 blocks per SM on", "above", "0.95 of its best",
                                min(gbps[few:]), 0.95 * max(gbps)),
                 claims.compare(f"{method} sum at {grids['blocks_per_sm'][0]} block per SM (GB/s)", "below",
                                "0.9 of its best", gbps[0], 0.9 * max(gbps))]
    return read


def reduction_text(table: dict) -> str:
    """The reduction table as aligned text: time, GB/s read, against the read ceiling and cupy.sum."""
    lines = [f"{'':46} {'median':>10} {'GB/s':>7} {'of read':>8} {'of cupy':>8} {'rel. error':>11}"]
    for r in table["rows"]:
        error = f"{r['rel_error']:11.1e}" if r["rel_error"] is not None else f"{'':>11}"
        lines.append(f"{r['name']:46} {bench.format_ms(r['median_ms']):>10} {r['gbps']:7.0f} {r['of_read']:8.2f} "
                     f"{r['of_cupy']:8.2f} {error}")
    return "\n".join(lines)


def _loop_bodies(ptx: str) -> list:
    """Each loop of one basic block in ``ptx`` (a label, straight-line code, a branch back to the label), as
    (fma instructions, other instructions)."""
    import re

    loops = []
    for block in re.split(r"^(?=\$L__BB\d+_\d+:)", ptx, flags=re.M):  # the basic blocks, each from its label
        m = re.match(r"(\$L__BB\d+_\d+):", block)
        if not m or not re.search(r"bra(?:\.uni)?\s+" + re.escape(m.group(1)) + ";", block):
            continue  # not a loop of one basic block
        lines = [ln.strip() for ln in block.splitlines()[1:]
                 if ln.strip() and not ln.strip().startswith(("//", "{", "}", ".pragma"))]
        fma = sum(ln.startswith("fma.rn.f32") for ln in lines)
        loops.append((fma, len(lines) - fma))
    return loops


def loop_counts() -> dict:
    """The inner loop of the branch kernel (``branch_on_lane``) as each compiler unrolled it, read from the PTX
    (no GPU needed): {"numba": ..., "CUDA C": ...}, each {"rounds": rounds of the four multiply-adds a pass,
    "other": instructions a pass that are not those multiply-adds (the counter, its test, the branch back)}.
    Raises runtime.CourseError where numba cannot compile to PTX (no NVVM)."""
    from gpucourse import cuda_c
    from gpucourse.numba_ptx import numba_ptx

    sources = {
        "numba": numba_ptx({"branch_on_lane": wd.NUMBA_KERNELS["branch_on_lane"]},
                           module="kernels.warp_divergence")["branch_on_lane"],
        "CUDA C": cuda_c.ptx_entry(cuda_c.compile_ptx("warp_divergence", arch="sm_90"), "branch_on_lane"),
    }
    out = {}
    for name, ptx in sources.items():
        fma, other = max(_loop_bodies(ptx))  # the unrolled loop: the most multiply-adds a pass
        out[name] = {"rounds": fma // 4, "other": other}
    return out


def loop_lines(counts: dict) -> list:
    """What notebook 02's deep dive says about the two loops, from ``loop_counts``."""
    n, c = counts["numba"], counts["CUDA C"]
    return [f"{name}: {v['rounds']} rounds of the body a pass of the loop, {v['other']} other instructions "
            f"({v['other'] / v['rounds']:.2f} a round)" for name, v in counts.items()] + [
        f"numba's loop issues {(n['other'] / n['rounds']) / (c['other'] / c['rounds']):.0f}x as many instructions "
        "a round around the multiply-adds as the CUDA C loop"]


# ------------------------------------------------------------------------------------- figures

_COLOURS = {"A": "tab:blue", "B": "tab:cyan", "X": "tab:orange", "Y": "tab:red", "Z": "tab:green"}


def _colour(label: str, palette: dict) -> str:
    if label not in palette:
        cycle = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
                 "tab:olive", "tab:cyan", "tab:gray"]
        palette[label] = _COLOURS.get(label, cycle[len(palette) % len(cycle)])
    return palette[label]


def plot_lanes(panels: dict, *, title: str, source: str, costs: bool = True):
    """Lane pictures: for each panel {name: [Step, ...]}, one column per step the warp issued, one row per
    lane, coloured where the lane took part. A step with few lanes costs as much as a full one."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    widths = [max(1, len(steps)) for steps in panels.values()]
    fig, axes = plt.subplots(1, len(panels), figsize=(min(14, 1.6 + 0.55 * sum(widths) + 1.2 * len(panels)), 5),
                             gridspec_kw={"width_ratios": widths}, squeeze=False)
    palette = {}
    for ax, (name, steps) in zip(axes[0], panels.items()):
        for col, step in enumerate(steps):
            for lane in np.flatnonzero(step.lanes):
                ax.add_patch(Rectangle((col, lane), 0.9, 0.9, color=_colour(step.label, palette), lw=0))
        ax.set_xlim(-0.1, max(1, len(steps)))
        ax.set_ylim(wd.WARP, -0.1)
        ax.set_xticks([c + 0.45 for c in range(len(steps))])
        ax.set_xticklabels([s.label for s in steps], rotation=90 if max((len(s.label) for s in steps), default=0) > 3 else 0,
                           fontsize=8)
        ax.set_yticks([0, 4, 8, 16, 24, 31])
        ax.set_ylabel("lane")
        cost = sum(s.cost for s in steps)
        useful = sum(s.cost * s.active / wd.WARP for s in steps)
        sub = f"\n{len(steps)} steps" + (f", cost {cost:g}, lanes busy {useful / cost:.0%}" if costs and cost else "")
        ax.set_title(name + sub, fontsize=9)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    fig.suptitle(f"{title}\n{source}", fontsize=10)
    fig.tight_layout()
    return fig


def steps_from_masks(record: dict, warp: int) -> list:
    """The steps one warp of the data-dependent branch took, from masks read on the GPU."""
    steps = []
    for label, key in (("path 1 (rare)", "active_rare"), ("path 0", "active_common")):
        if record[key][warp]:
            steps.append(wd.Step(label, record[key][warp]))
    return steps


def plot_lane_sweep(lanes: dict, source: str):
    xs = lanes["paths"]
    series = {name: (xs, s["slowdown"]) for name, s in lanes["series"].items()}
    model = lanes["series"]["CUDA C, branch on lane id"]["model"]
    fig = plots.lines(series, models={"serialisation model, lane id (k paths: k x)": (xs, model),
                                      "model, warp id (no divergence)": (xs, [1.0] * len(xs))},
                      xlabel="paths (different bodies) per warp", ylabel="time / time with one path",
                      source=source, title=f"Divergence: {lanes['n']:,} threads, {lanes['iters']} rounds x 4 chains each")
    ax = fig.axes[0]
    ax.fill_between(xs, [0.8 * m for m in model], [1.2 * m for m in model], color="grey", alpha=0.15,
                    label="model ± 20%")
    ax.set_xticks(xs)
    ax.set_xticklabels([str(p) for p in xs])
    ax.set_yticks([1, 2, 4, 8, 16, 32])
    ax.set_yticklabels(["1", "2", "4", "8", "16", "32"])
    ax.legend(fontsize=8)
    return fig


def plot_data(data: dict, source: str):
    """Slowdown of the data-dependent branch against the fraction of elements on the rare path."""
    import matplotlib.pyplot as plt

    s = data["sweep"]
    labels = ["0"] + [f"1/{round(1 / f)}" for f in s["fractions"][1:]]
    pos = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(pos, s["slowdown"], "o-", label="measured (CUDA C, random order)")
    ax.plot(pos, s["paths_per_warp"], "--", label="model: mean paths per warp of this data")
    ax.plot(pos, s["expected_paths"], ":", label="model: 2 - (1-f)^32 - f^32")
    ax.set_xticks(pos)
    ax.set_xticklabels(labels)
    ax.set_ylim(0.9, 2.2)
    ax.set_xlabel("fraction f of elements on the rare path (random positions)")
    ax.set_ylabel("time / time with no rare element")
    ax.legend(fontsize=8)
    return plots._finish(ax, "A rare branch costs almost as much as a 50/50 one", source)


def plot_regroup(data: dict, source: str):
    values = {}
    for r in data["regroup"]:
        f = f"f = 1/{round(1 / r['fraction'])}"
        values[f"{f}: random order"] = 1e3 * r["random_ms"]
        values[f"{f}: sorted data"] = 1e3 * r["sorted_ms"]
        values[f"{f}: regrouped, kernel only"] = 1e3 * r["regrouped_ms"]
        values[f"{f}: regrouped, + building the permutation"] = 1e3 * (r["regrouped_ms"] + r["permutation_ms"])
    return plots.bars(values, unit="µs", source=source,
                      title=f"Removing data-dependent divergence ({data['n']:,} elements, {data['iters']} rounds)")


def plot_reductions(table: dict, source: str):
    values = {r["name"]: r["gbps"] for r in table["rows"] if "per element" not in r["name"] and r["kind"] != "ceiling"}
    return plots.bars(values, unit="GB/s", source=source, ceiling=("read ceiling (read-only probe)",
                                                                   table["read_gbps"]),
                      title=f"Sum of {table['bytes'] / 2**30:.0f} GiB float32 (bytes read)")


def plot_reduce_grids(grids: dict, source: str, read_gbps: float):
    series = {f"CUDA C, {m}": (grids["blocks_per_sm"], v) for m, v in grids["gbps"].items()}
    return plots.lines(series, levels={"read ceiling, GB/s": read_gbps}, logy=False, source=source,
                       xlabel=f"blocks per SM ({grids['threads']} threads each)", ylabel="GB/s",
                       title="Choosing the grid of a reduction")


def plot_shuffle_tree():
    """The shuffle-down tree in the model: after each step, how many of the 32 inputs each lane has summed.
    Lanes that read past lane 31 add their own value again: their results are garbage, and unused."""
    import matplotlib.pyplot as plt

    steps = wd.warp_sum_steps(np.ones(wd.WARP))
    fig, ax = plt.subplots(figsize=(7, 4.8))
    grid = np.array(steps).T  # lanes x steps
    used = np.zeros_like(grid, bool)
    for k in range(len(steps)):
        used[: wd.WARP >> k, k] = True  # lanes whose value reaches lane 0
    shown = np.where(used, grid, np.nan)
    ax.imshow(shown, aspect="auto", cmap="Blues", vmin=0, vmax=40)
    for (lane, k), v in np.ndenumerate(grid):
        if used[lane, k]:
            ax.text(k, lane, f"{v:g}", ha="center", va="center", fontsize=6)
    ax.set_xticks(range(len(steps)))
    ax.set_xticklabels(["input"] + [f"+= shfl_down({o})" for o in (16, 8, 4, 2, 1)], fontsize=8)
    ax.set_ylabel("lane")
    ax.set_title("Warp sum with __shfl_down_sync: how many inputs each lane holds after each step\n"
                 "(NumPy model; blank: lanes whose values are never used)", fontsize=10)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------ the registry

FIGURES = {  # what run() records, in this order
    "order": Figure(order),
    "lanes": Figure(lane_sweep, plot_lane_sweep),
    "data": Figure(data_divergence, plot_data),
    "masks": Figure(masks),
    "reductions": Figure(reductions, plot_reductions, reduction_text),
    "reduce_grids": Figure(reduce_grids),
}


# ------------------------------------------------------------------------------------ RESULTS.md

def results_rows(record: dict) -> list:
    """The lesson's headline figures in one record, for RESULTS.md and the README (gpucourse.results): the first row
    is the headline."""
    from gpucourse import results as R

    f = record["figures"]
    red = {r["name"]: r for r in f.get("reductions", {}).get("rows", [])}
    shuffles, atomics = red.get("CUDA C, warp shuffles"), red.get("CUDA C, atomics (one per thread)")
    lanes = f.get("lanes", {})
    by_lane = lanes.get("series", {}).get("CUDA C, branch on lane id")
    by_warp = lanes.get("series", {}).get("CUDA C, branch on warp id")
    paths = lanes.get("paths", [])

    def slowdowns(series, ways):
        if not series or not all(w in paths for w in ways):
            return None
        return R.joined([series["slowdown"][paths.index(w)] for w in ways])

    return [
        ("warp-shuffle sum, share of the read ceiling", R.share(shuffles and shuffles["of_read"]), "reductions"),
        ("warp-shuffle sum, speed against cupy.sum", R.ratio(shuffles and shuffles["of_cupy"]), "reductions"),
        ("atomics (one a thread), share of the read ceiling", R.share(atomics and atomics["of_read"]), "reductions"),
        ("branch split 2 / 4 / 8 ways in a warp, slowdown", slowdowns(by_lane, (2, 4, 8)), "lanes"),
        ("the same split by warp, 32 ways, slowdown", slowdowns(by_warp, (32,)), "lanes"),
    ]

"""Lesson 8's measurements and the figures drawn from them, declared once in FIGURES: streams and overlap, many
small launches, lesson 6's engine served (batch sizes, the dynamic batcher), unified memory, NVML monitoring,
Nsight Compute, and MPS against time-slicing (its client processes: systems/feeding_the_gpu/serving.py).

    python -m gpucourse record 08_feeding_the_gpu                 # every figure: results/<gpu>/08_feeding_the_gpu.json
    python -m gpucourse record 08_feeding_the_gpu --figure mps    # one figure, into the newest record of this GPU
"""
from __future__ import annotations

import os
import re
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from gpucourse import bench, monitor, mps, plots, profile, records, runtime
from gpucourse.records import Figure
from kernels import feeding_the_gpu as S
from kernels import inference_engine as E
from systems.feeding_the_gpu import batching as B
from systems.feeding_the_gpu import serving

LESSON = "08_feeding_the_gpu"
OVERLAP_GOAL = 1.15  # pipelined total <= 1.15 x the longer copy direction alone
LECTURE_MPS_GAIN, LECTURE_BATCHING_GAIN = 7.0, 1.6  # docs/sources.md, the V100 lecture: MPS 7x inference throughput, batching +60%


def _rng_fill(host: np.ndarray, seed: int) -> None:
    cp = runtime.cupy()
    cp.random.seed(seed)
    cp.random.random(host.size, dtype=cp.float32).get(out=host)


# ------------------------------------------------------------------------------------ 1. overlap

def measure_overlap(n: int | None = None, streams=None, chunks: int | None = None, repeats: int = 5,
                    pipeline=None) -> dict:
    """The copies alone, the kernel alone, and the chunked pipeline on 1, 2, 3, 4, ... streams, with one
    timeline per stream count. out = a * b on n float32 from pinned host memory and back. ``pipeline``: the
    pipeline class to time (by default S.Pipeline; a notebook passes its own cell's)."""
    cp = runtime.cupy()
    Pipeline = pipeline or S.Pipeline
    n = n or runtime.size("feeding.n")
    streams = streams or runtime.size("feeding.streams")
    chunks = chunks or runtime.size("feeding.chunks")
    runtime.check_fits(3 * n * 4 + 3 * max(streams) * (n // chunks) * 4, "the overlap benchmark")
    a, b, out = S.pinned(n), S.pinned(n), S.pinned(n)
    _rng_fill(a, 1)
    _rng_fill(b, 2)
    da, db, dout = (cp.empty(n, cp.float32) for _ in range(3))
    nbytes = 4 * n
    h2d = bench.time_gpu(lambda: (da.set(a), db.set(b)), repeats=repeats, warmup=1)
    d2h = bench.time_gpu(lambda: dout.get(out=out), repeats=repeats, warmup=1)
    blocks = 8 * runtime.get().device["sms"]
    kern = bench.time_gpu(lambda: S.multiply_kernel[blocks, S.THREADS](da, db, dout), repeats=repeats)
    longer = max(h2d.median_ms, d2h.median_ms)
    figs = {"n": n, "chunks": chunks, "bytes_per_vector": nbytes,
            "h2d_ms": h2d.median_ms, "h2d_gbps": h2d.gbps(2 * nbytes), "d2h_ms": d2h.median_ms,
            "d2h_gbps": d2h.gbps(nbytes), "kernel_ms": kern.median_ms, "kernel_gbps": kern.gbps(3 * nbytes),
            "serial_ms": h2d.median_ms + kern.median_ms + d2h.median_ms, "runs": {}}
    idx = np.random.default_rng(0).integers(0, n, 1_000_000)
    for k in bench.progress(streams, desc="streams"):
        p = Pipeline(n, chunks=chunks, streams=k)
        out[:] = np.nan
        t = bench.time_gpu(lambda: p.run(a, b, out), repeats=repeats, warmup=1)
        run = p.run(a, b, out, timeline=True)
        if not np.array_equal(out[idx], a[idx] * b[idx]):
            raise runtime.CourseError(f"the pipeline on {k} streams computed wrong values")
        figs["runs"][str(k)] = {"streams": k, "total_ms": t.median_ms, "spread": t.spread,
                                "ratio_to_longer_copy": t.median_ms / longer,
                                "overlap_fraction": S.overlap_fraction(S.engine_timeline(run.timeline)),
                                "timeline": run.timeline}
        del p
    best = min(figs["runs"].values(), key=lambda r: r["total_ms"])
    figs["best"] = {"streams": best["streams"], "ratio_to_longer_copy": best["ratio_to_longer_copy"],
                    "goal": OVERLAP_GOAL, "met": best["ratio_to_longer_copy"] <= OVERLAP_GOAL,
                    "speedup_over_serial": figs["serial_ms"] / best["total_ms"]}
    return figs


def text_overlap(o: dict) -> str:
    lines = []
    for r in o["runs"].values():
        both = S.overlap_fraction(S.engine_timeline(r["timeline"]))
        lines.append(f"{r['streams']} stream(s): {r['total_ms']:7.1f} ms = {r['ratio_to_longer_copy']:.2f} x the longer "
                     f"copy alone; two or more engines busy {100 * both:3.0f}% of it")
    best = o["best"]
    lines.append(f"copies in {o['h2d_gbps']:.1f} GB/s, copy out {o['d2h_gbps']:.1f} GB/s, "
                 f"kernel {o['kernel_gbps']:.0f} GB/s")
    lines.append(f"best: {best['streams']} streams, {best['ratio_to_longer_copy']:.3f} x the longer copy (goal <= "
                 f"{best['goal']}: {'met' if best['met'] else 'NOT met'}), {best['speedup_over_serial']:.2f} x faster "
                 "than the stages one after another")
    return plots.wrap("\n".join(lines))


def plot_overlap(o: dict, source: str):
    vals = {"copies in alone": o["h2d_ms"], "kernel alone": o["kernel_ms"], "copy out alone": o["d2h_ms"],
            "all three, one after another": o["serial_ms"]}
    vals.update({f"pipeline, {r['streams']} stream(s)": r["total_ms"] for r in o["runs"].values()})
    longer = max(o["h2d_ms"], o["d2h_ms"])
    return plots.bars(vals, unit="ms", source=source, ceiling=("longer copy alone", longer),
                      title=f"out = a * b on {o['bytes_per_vector'] / 2**30:.0f} GiB vectors from pinned memory, "
                            f"{o['chunks']} chunks")


def plot_gantt(run: dict, source: str, title: str | None = None):
    """One row per stream, a bar per stage of each chunk: copies in, kernel, copy out, as the engines ran them
    (S.engine_timeline); pale, the time a copy waited for its copy engine after its stream reached it."""
    import matplotlib.pyplot as plt

    colours = {"h2d": "tab:blue", "kernel": "tab:green", "d2h": "tab:orange"}
    names = {"h2d": "host → device", "kernel": "kernel", "d2h": "device → host"}
    k = run["streams"]
    fig, ax = plt.subplots(figsize=(8, 0.45 * k + 1.8))
    waited = False
    for r in S.engine_timeline(run["timeline"]):
        for stage in S.STAGES:
            if stage + "_queued" in r:
                q0, q1 = r[stage + "_queued"]
                ax.barh(r["stream"], q1 - q0, left=q0, color=colours[stage], alpha=0.18, lw=0,
                        label=None if waited else "waiting for a copy engine")
                waited = True
            t0, t1 = r[stage]
            ax.barh(r["stream"], t1 - t0, left=t0, color=colours[stage], edgecolor="white", lw=0.3,
                    label=names[stage] if r["chunk"] == 0 else None)
    ax.set_yticks(range(min(k, len(run["timeline"]))))
    ax.set_yticklabels([f"stream {i}" for i in range(min(k, len(run["timeline"])))])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the start")
    ax.legend(fontsize=8, loc="lower right", ncol=2)
    return plots._finish(ax, title or f"{k} stream(s): {run['total_ms']:.0f} ms, "
                         f"{run['ratio_to_longer_copy']:.2f}x the longer copy alone", source)


# ------------------------------------------------------------------------------ 2. small kernels

def measure_small_kernels(launches: int = 2000, n: int = 1024, streams: int = 4, repeats: int = 7) -> dict:
    """Microseconds per launch of a tiny kernel: on one stream, over several streams, replayed from one CUDA
    graph (host timer around launch + synchronise: what a Python loop really pays), and the GPU time alone."""
    k = S.SmallKernels(n=n, launches=launches, streams=streams)
    k.capture()
    cuda = runtime.cuda()
    xn = cuda.to_device(np.zeros(n, np.float32))
    ways = {"CuPy, one stream": k.one_stream, f"CuPy, {streams} streams": k.many_streams,
            "CuPy, one CUDA graph": k.graph_replay,
            "numba, one stream": lambda: S.small_launches(xn, launches=launches)}
    out = {"launches": launches, "n": n, "streams": streams, "us_per_launch": {}}
    for name, work in ways.items():
        t = bench.wall_clock(work, synchronize=True, repeats=repeats)
        out["us_per_launch"][name] = 1e3 * t.median_ms / launches
    gpu = bench.time_gpu(k.graph_replay, repeats=repeats)
    out["gpu_us_per_kernel_in_graph"] = 1e3 * gpu.median_ms / launches
    u = out["us_per_launch"]
    out["graph_speedup"] = u["CuPy, one stream"] / u["CuPy, one CUDA graph"]
    return out


def text_small_kernels(s: dict) -> str:
    return plots.wrap(
        "a launch: " + ", ".join(f"{way} {us:.2f} µs" for way, us in s["us_per_launch"].items()) + "\n"
        f"graph replay: {s['graph_speedup']:.1f} x fewer µs per launch than one launch at a time; the GPU itself "
        f"needs {s['gpu_us_per_kernel_in_graph']:.2f} µs per kernel inside the graph")


def plot_small_kernels(s: dict, source: str):
    return plots.bars(s["us_per_launch"], unit="µs", source=source,
                      title=f"{s['launches']} launches of a tiny kernel: µs per launch (host timer)")


# ---------------------------------------------------------------------------------------- 3. MPS

def measure_mps(ks=(1, 2, 4, 8, 16), seconds: float = 2.0, batched: int = 8, binary: str | None = None,
                cmd: list | None = None, client=None, make_plan=None, timeout: float = 120) -> dict:
    """Lesson 6's engine at batch 1 in k client processes (serving.run_clients), time-sliced (no MPS), through
    MPS, and through MPS with batch ``batched`` per request. "mps" is True when every MPS configuration was
    measured. If the daemon cannot start, or MPS fails while its configurations are measured (a client that
    cannot reach the MPS server often shows it only then), "mps" is False, "why" says where and why (with the
    daemon's and the MPS server's last log lines), and every row measured before the failure is kept; the daemon
    is stopped in every case and "mps_log" keeps its log's last lines.

    ``client``: the client function the processes run (by default serving.client; a notebook passes its own
    cell's). ``cmd`` (a whole client command line), ``make_plan(max_batch, folder) -> plan path`` and
    ``timeout`` (seconds for a client to be ready) let the tests run it without a GPU; by default the clients
    run lesson 6's engine, which needs one."""
    if make_plan is None:
        runtime.require_gpu("the MPS experiment")

        def make_plan(max_batch: int, folder: Path) -> str:
            return str(serving.engine_plan(max_batch).save(folder / "plan.npz"))
    out = {"ks": list(ks), "seconds": seconds, "batched": batched, "configs": {}, "mps": True, "why": ""}

    def clients(k: int, batch: int, env: dict) -> dict:
        return serving.run_clients(k, plan_path, batch, seconds, env, timeout=timeout, cmd=cmd, client=client)

    with tempfile.TemporaryDirectory(prefix="gpucourse-plan-") as tmp:
        plan_path = make_plan(max(batched, 1), Path(tmp))
        # Without MPS, the clients get a fresh, empty, private pipe folder (removed afterwards): a CUDA client
        # looks for the MPS daemon in CUDA_MPS_PIPE_DIRECTORY, so where a system-wide daemon runs, clients with
        # the inherited environment would go through it. Here they can reach no daemon and are time-sliced.
        with tempfile.TemporaryDirectory(prefix="gpucourse-no-mps-") as no_mps:
            rows = out["configs"]["time-slicing, batch 1"] = {}
            for k in bench.progress(ks, desc="no MPS"):
                rows[str(k)] = clients(k, 1, dict(os.environ, **{mps.PIPE: no_mps}))
        d = mps.Daemon(binary)
        try:
            with d:  # stops the daemon whatever happens inside, an exception or a SIGTERM (see gpucourse/mps.py)
                for name, batch in (("MPS, batch 1", 1), (f"MPS, batch {batched}", batched)):
                    rows = out["configs"][name] = {}
                    for k in bench.progress(ks, desc=name):
                        try:
                            rows[str(k)] = clients(k, batch, d.client_env())
                        except runtime.CourseError as exc:
                            log = d.log_tail()  # read now: the folder goes with the daemon
                            raise runtime.CourseError(
                                f"MPS failed at {name}, k = {k} (the rows measured before are kept): {exc}"
                                + (f"; the MPS logs end: {log}" if log else "; the MPS logs are empty")) from exc
        except runtime.CourseError as exc:  # MPSUnavailable (the daemon did not start), a client, or the stop
            out["mps"], out["why"] = False, str(exc)
        out["configs"] = {name: rows for name, rows in out["configs"].items() if rows}  # no empty series
        out["mps_log"] = d.last_log[-4000:]
    out["ratios"] = mps_ratios(out)
    return out


def mps_ratios(table: dict) -> dict:
    """Per k: MPS / time-slicing and MPS with batching / MPS alone (images/s), beside the V100 lecture's 7x and +60% (docs/sources.md)."""
    c = table["configs"]
    base = c.get("time-slicing, batch 1", {})
    m = c.get("MPS, batch 1", {})
    mb = c.get(f"MPS, batch {table['batched']}", {})
    out = {}
    for k in map(str, table["ks"]):
        row = {}
        if k in m and k in base:
            row["mps_gain"] = m[k]["images_per_s"] / base[k]["images_per_s"]
        if k in mb and k in m:
            row["batching_gain"] = mb[k]["images_per_s"] / m[k]["images_per_s"]
        if k in base and "1" in base:
            row["time_slicing_scaling"] = base[k]["images_per_s"] / base["1"]["images_per_s"]
        out[k] = row
    return out


def recorded_mps(batched: int = 8) -> tuple:
    """(table, label) of the newest record of the lesson whose MPS experiment ran every configuration, with
    requests of ``batched`` images for the batched one (Task 8.3 reads it); records where MPS could not start,
    or a configuration failed, are passed over."""
    want = {"time-slicing, batch 1", "MPS, batch 1", f"MPS, batch {batched}"}
    for rec in reversed(records.all_records(LESSON)):
        m = rec["figures"].get("mps") or {}
        configs = m.get("configs") or {}
        if m.get("batched") == batched and want <= set(configs) and all(configs[c] for c in want):
            return m, records.label(rec, "mps")
    raise runtime.CourseError(f"no record of {LESSON} holds a complete MPS table (MPS ran, batches of {batched}); "
                              f"record one on a GPU where MPS starts: python -m gpucourse record {LESSON} --figure mps")


def text_mps(m: dict) -> str:
    lines = [] if m["mps"] else [f"MPS did not run through: {m['why']}"]
    lines.append(f"{'k':>3} " + " ".join(f"{name:>22}" for name in m["configs"]) + f" {'MPS gain':>9} {'batching':>9}")
    for k in map(str, m["ks"]):
        r = m["ratios"][k]
        lines.append(f"{k:>3} " + " ".join(f"{rows[k]['images_per_s']:>18,.0f} i/s" if k in rows else f"{'-':>22}"
                                           for rows in m["configs"].values())
                     + f" {r.get('mps_gain', float('nan')):>8.2f}x {r.get('batching_gain', float('nan')):>8.2f}x")
    lines.append(f"the V100 lecture: MPS {LECTURE_MPS_GAIN:.0f}x, batching +{100 * (LECTURE_BATCHING_GAIN - 1):.0f}%")
    return plots.wrap("\n".join(lines))


def plot_mps(m: dict, source: str):
    series = {name: ([int(k) for k in rows], [rows[k]["images_per_s"] for k in rows])
              for name, rows in m["configs"].items()}
    return plots.lines(series, xlabel="client processes k", ylabel="images / s (all clients)", source=source,
                       title="Lesson 6's engine in k processes on one GPU")


# ------------------------------------------------------------------------ 4. throughput vs latency

def measure_batching(batches=None, repeats: int = 50) -> dict:
    """Lesson 6's engine (fused, FP32, CUDA graphs): GPU latency of one inference (p50, p99) and images/s
    at every batch size."""
    batches = list(batches or runtime.size("feeding.batches"))
    eng = E.Engine(serving.engine_plan(max(batches)), graphs=True)
    cp = runtime.cupy()
    rows = []
    for b in bench.progress(batches, desc="batch sizes"):
        x = eng.input_buffer(b)
        x[...] = cp.random.random(x.shape, dtype=cp.float32)
        t = bench.time_gpu(lambda: eng.infer(x), repeats=repeats, warmup=3)
        rows.append(B.latency_summary(t.samples_ms, b))
    return {"rows": rows, "engine": "fused + graph, FP32"}


def text_batching(t: dict) -> str:
    return "\n".join(f"batch {r['batch']:5d}: p50 {r['p50_ms']:8.3f} ms, p99 {r['p99_ms']:8.3f} ms, "
                     f"{r['images_per_s']:12,.0f} images/s" for r in t["rows"])


def plot_batching(t: dict, source: str):
    import matplotlib.pyplot as plt

    rows = t["rows"]
    bs = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(bs, [r["p50_ms"] for r in rows], "o-", label="p50 latency")
    ax.plot(bs, [r["p99_ms"] for r in rows], "s--", label="p99 latency")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("ms per inference (GPU)")
    ax2 = ax.twinx()
    ax2.plot(bs, [r["images_per_s"] for r in rows], "^-", color="tab:red", label="images / s")
    ax2.set_yscale("log")
    ax2.set_ylabel("images / s", color="tab:red")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    return plots._finish(ax, f"Throughput against latency: {t['engine']}", source)


def measure_batcher(rates=None, waits_ms=(0.0, 0.25, 1.0, 4.0), max_batch: int = 256, count: int = 4000) -> dict:
    """The dynamic batcher with lesson 6's engine as the server: every batch really runs on the GPU and
    takes the time it took (CUDA events). Per arrival rate and maximum wait: p50/p99 latency, images/s."""
    cp = runtime.cupy()
    eng = E.Engine(serving.engine_plan(max_batch), graphs=True)
    x = eng.input_buffer(max_batch)
    x[...] = cp.random.random(x.shape, dtype=cp.float32)
    start, end = cp.cuda.Event(), cp.cuda.Event()

    def service(n: int) -> float:
        start.record()
        eng.infer(x[:n])
        end.record()
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) / 1e3

    for n in range(1, max_batch + 1):  # capture every batch size's graph before timing
        service(n)
    batch1 = float(np.median([service(1) for _ in range(50)]))
    rates = rates or [round(f / batch1) for f in (0.5, 2.0, 8.0)]
    rows = serving.batcher_table(service, rates, waits_ms, max_batch, count)
    return {"rows": rows, "batch1_service_ms": batch1 * 1e3, "max_batch": max_batch, "requests": count}


def batcher_lines(rows: list) -> list:
    """The batcher's table in words: a line per rate and policy, then per rate what batching and waiting did."""
    lines = []
    for r in rows:
        policy = ("one at a time   " if r.get("max_batch") == 1 else f"wait {r['max_wait_ms']:4.2f} ms    ")
        busy = f", GPU busy {100 * r['gpu_busy']:3.0f}%" if "gpu_busy" in r else ""
        lines.append(f"{r['rate_per_s']:>6,} req/s, {policy} p50 {r['p50_ms']:7.3f} ms, p99 {r['p99_ms']:7.3f} ms, "
                     f"{r['throughput_per_s']:>6,.0f}/s, batch {r['mean_batch']:5.1f}{busy}")
    for rate in sorted({r["rate_per_s"] for r in rows}):
        alone = [r for r in rows if r["rate_per_s"] == rate and r.get("max_batch") == 1]
        waits = sorted((r for r in rows if r["rate_per_s"] == rate and r.get("max_batch", 2) > 1),
                       key=lambda r: r["max_wait_ms"])
        if not alone or len(waits) < 2 or "gpu_busy" not in waits[0]:
            continue
        a, w0, w1 = alone[0], waits[0], waits[1]
        lines.append(f"at {rate:,} req/s: one at a time p99 {a['p99_ms']:,.3g} ms, batching {w0['p99_ms']:.3g} ms;\n"
                     f"    waiting up to {w1['max_wait_ms']:g} ms: p99 {w1['p99_ms']:.3g} ms and the GPU busy "
                     f"{100 * w1['gpu_busy']:.0f}% of the time instead of {100 * w0['gpu_busy']:.0f}%")
    return lines


def text_batcher(t: dict) -> str:
    return "\n".join(batcher_lines(t["rows"]))


def plot_batcher(t: dict, source: str):
    """p99 latency and the GPU's busy share against the maximum wait, a line per arrival rate; one request at a
    time (no batching) named in the legend. Rows recorded before the busy share was kept draw the top alone."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    batched = [r for r in t["rows"] if r.get("max_batch", t["max_batch"]) > 1]
    busy = all("gpu_busy" in r for r in batched)
    fig, axes = plt.subplots(2 if busy else 1, 1, figsize=(7, 6.5 if busy else 4.5), sharex=True, squeeze=False)
    ax = axes[0][0]
    for rate in sorted({r["rate_per_s"] for r in batched}):
        rows = [r for r in batched if r["rate_per_s"] == rate]
        alone = [r for r in t["rows"] if r["rate_per_s"] == rate and r.get("max_batch") == 1]
        label = f"{rate:,} requests/s" + (f" (one at a time: p99 {alone[0]['p99_ms']:,.3g} ms)" if alone else "")
        (line,) = ax.plot([r["max_wait_ms"] for r in rows], [r["p99_ms"] for r in rows], "o-", label=label)
        if busy:
            axes[1][0].plot([r["max_wait_ms"] for r in rows], [100 * r["gpu_busy"] for r in rows], "o-",
                            color=line.get_color())
    waits = sorted({r["max_wait_ms"] for r in batched})
    ax.set_xscale("symlog", linthresh=0.25)
    ax.set_xticks(waits, [f"{w:g}" for w in waits])
    ax.set_yscale("log")
    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylabel("p99 latency (ms)")
    ax.legend(fontsize=8)
    if busy:
        axes[1][0].set_ylabel("GPU busy (% of the time)")
        axes[1][0].set_ylim(0, 105)
        axes[1][0].grid(alpha=0.3)
    axes[-1][0].set_xlabel("maximum wait (ms)")
    return plots._finish(ax, f"Dynamic batching (max batch {t['max_batch']}), served by the engine on the GPU",
                         source)


# ------------------------------------------------------------------------------- 5. unified memory

def measure_unified_memory(n: int = 2**27, repeats: int = 5) -> dict:
    """x *= 2 over n float32 (read + write) with the data in managed memory touched last by the CPU (page
    faults, migration), after a prefetch, resident on the GPU, and with explicit pinned copies; then what
    the CPU's next touch costs."""
    cp = runtime.cupy()
    nbytes = 4 * n
    x = S.managed_array(n)
    h = S.host_view(x)
    out = {"n": n, "bytes": nbytes}

    def cpu_touch():
        h[:] = 1.0  # the pages now live in host memory

    out["cold_gbps"] = bench.time_gpu(lambda *_: x.__imul__(2), setup=cpu_touch, repeats=repeats, warmup=1).gbps(2 * nbytes)
    try:
        def touched_then_prefetched():
            cpu_touch()
            S.prefetch(x)
            cp.cuda.Device().synchronize()

        out["prefetched_gbps"] = bench.time_gpu(lambda *_: x.__imul__(2), setup=touched_then_prefetched,
                                                repeats=repeats, warmup=1).gbps(2 * nbytes)
        out["prefetch_error"] = ""
    except Exception as exc:  # cudaMemPrefetchAsync missing or refused on this platform
        out["prefetch_error"] = f"{type(exc).__name__}: {exc}"
    out["resident_gbps"] = bench.time_gpu(lambda: x.__imul__(2), repeats=repeats).gbps(2 * nbytes)
    d = cp.empty(n, cp.float32)
    p = S.pinned(n)
    p[:] = 1.0

    def explicit():
        d.set(p)
        d.__imul__(2)
        d.get(out=p)

    out["explicit_copies_gbps"] = bench.time_gpu(explicit, repeats=repeats, warmup=1).gbps(2 * nbytes)
    out["device_gbps"] = bench.time_gpu(lambda: d.__imul__(2), repeats=repeats).gbps(2 * nbytes)
    cpu = []
    for _ in range(repeats):
        x *= 2
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        h.sum()
        t1 = time.perf_counter()
        h.sum()
        t2 = time.perf_counter()
        cpu.append((t1 - t0, t2 - t1))
    out["cpu_first_touch_gbps"] = nbytes / np.median([c[0] for c in cpu]) / 1e9
    out["cpu_second_touch_gbps"] = nbytes / np.median([c[1] for c in cpu]) / 1e9
    return out


def text_unified_memory(u: dict) -> str:
    lines = [f"prefetch failed: {u['prefetch_error']}"] if u.get("prefetch_error") else []
    lines += [f"{k[:-5]:>24}: {v:8.1f} GB/s = {v / u['device_gbps']:5.2f} x cudaMalloc memory"
              for k, v in u.items() if k.endswith("_gbps")]
    return "\n".join(lines)


def plot_unified_memory(u: dict, source: str):
    names = {"cold_gbps": "managed, CPU touched it last (page faults)", "prefetched_gbps": "managed, prefetched",
             "resident_gbps": "managed, already on the GPU", "device_gbps": "cudaMalloc memory",
             "explicit_copies_gbps": "explicit copies in and out + kernel",
             "cpu_first_touch_gbps": "CPU reads it after the GPU (migrates back)",
             "cpu_second_touch_gbps": "CPU reads it again"}
    return plots.bars({v: u[k] for k, v in names.items() if k in u}, unit="GB/s", source=source,
                      title=f"x *= 2 over {u['bytes'] / 2**20:.0f} MiB: unified memory")


# ----------------------------------------------------------------------------------- 6. monitoring

MONITOR_PHASE_S = 2.5  # seconds a phase lasts: NVML averages over a sample period of 1/6 s to 1 s
MONITOR_SETTLE_S = 1.0  # what phase_medians leaves out at the start of each phase


def measure_monitoring(interval_s: float = 0.02, phase_s: float = MONITOR_PHASE_S) -> dict:
    """NVML samples while the GPU idles, holds 3 GiB it does not use, runs one spinning thread (100%
    "utilisation" from one thread on one SM), runs a memory-bound kernel on every SM, and idles again; each
    phase ``phase_s`` long, so that NVML's averages settle inside it."""
    cp = runtime.cupy()
    n = 2**28
    blocks = 8 * runtime.get().device["sms"]
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()  # what earlier measurements left in CuPy's pool would hide the allocation from NVML
    with monitor.Sampler(interval_s=interval_s) as s:
        s.mark("idle")
        time.sleep(phase_s)
        s.mark("3 GiB allocated, idle")
        a, b, c = (cp.ones(n, cp.float32) for _ in range(3))
        cp.cuda.Device().synchronize()
        time.sleep(phase_s)
        s.mark("one thread spinning")
        bench.hold(1e3 * phase_s)
        cp.cuda.Device().synchronize()
        s.mark("vector multiply, all SMs")
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < phase_s:
            for _ in range(20):
                S.multiply_kernel[blocks, S.THREADS](a, b, c)
            cp.cuda.Device().synchronize()
        s.mark("idle again, memory freed")
        del a, b, c
        pool.free_all_blocks()
        time.sleep(phase_s)
        s.mark("end")
    return {"interval_s": interval_s, "samples": s.samples, "marks": s.marks}


def phase_medians(m: dict, settle_s: float = MONITOR_SETTLE_S) -> list:
    """Per phase of a monitoring run: the median of each counter over the phase, leaving out its first
    ``settle_s`` (NVML's readings trail the work by up to their sample period) where the phase is long enough
    to keep at least as much again. Returns [{"label", "samples", "settled", counter: median, ...}]."""
    out = []
    for m0, m1 in zip(m["marks"], m["marks"][1:]):
        settled = m1["t"] - m0["t"] >= 2 * settle_s
        t0 = m0["t"] + (settle_s if settled else 0.0)
        part = [x for x in m["samples"] if t0 <= x["t"] < m1["t"]]
        if part:
            row = {"label": m0["label"], "samples": len(part), "settled": settled}
            for key in ("util_gpu", "power_w", "sm_clock_mhz", "mem_used_mib"):
                row[key] = float(np.median([x[key] for x in part]))
            out.append(row)
    return out


def text_monitoring(m: dict) -> str:
    rows = phase_medians(m)
    lines = [f"{'phase':>26}  utilisation  power   SM clock  memory used  samples"]
    lines += [f"{r['label']:>26}  {r['util_gpu']:10.0f}%  {r['power_w']:3.0f} W  {r['sm_clock_mhz']:5.0f} MHz  "
              f"{r['mem_used_mib']:7.0f} MiB  {r['samples']:5d}" + ("" if r["settled"] else " (whole phase)")
              for r in rows]
    if any(r["settled"] for r in rows):
        lines.append(f"(medians of each phase after its first {MONITOR_SETTLE_S:g} s; a phase marked 'whole phase' was "
                     "too short to leave NVML's lag out)")
    return plots.wrap("\n".join(lines))


def plot_monitoring(m: dict, source: str):
    import matplotlib.pyplot as plt

    fields = [("util_gpu", "GPU utilisation (%)"), ("power_w", "power (W)"), ("sm_clock_mhz", "SM clock (MHz)"),
              ("mem_used_mib", "memory used (MiB)")]
    fig, axes = plt.subplots(len(fields), 1, figsize=(8, 7), sharex=True)
    t = [s["t"] for s in m["samples"]]
    for ax, (key, label) in zip(axes, fields):
        ax.plot(t, [s[key] for s in m["samples"]], lw=1)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
        for mk in m["marks"]:
            ax.axvline(mk["t"], color="grey", ls=":", lw=0.8)
    for mk in m["marks"][:-1]:
        axes[0].text(mk["t"], 105, " " + mk["label"], fontsize=7, va="bottom")
    axes[-1].set_xlabel("s")
    axes[0].set_title(f"NVML, sampled every {1e3 * m['interval_s']:.0f} ms\n{source}", fontsize=10)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------ 7. profiling

PROFILE_N, PROFILE_GEMM = 2**26, 4096  # the profiled multiply's elements; the profiled GEMMs' M = N = K
PROFILE_SNIPPET = f"""
import gpucourse
from gpucourse import runtime
gpucourse.setup("gpu", quiet=True)
import cupy as cp
from kernels import feeding_the_gpu as S
from kernels import inference_engine as E
n = {PROFILE_N}
a, b, c = (cp.ones(n, cp.float32) for _ in range(3))
S.multiply_kernel[8 * runtime.get().device["sms"], S.THREADS](a, b, c)
x = cp.random.random(({PROFILE_GEMM}, {PROFILE_GEMM}), dtype=cp.float32)  # random: constant inputs draw less power
x @ x
h = x.astype(cp.float16)
h @ h
cp.cuda.Device().synchronize()
"""


def measure_profile() -> dict:
    """ncu on lesson 1's multiply (memory-bound), an FP32 GEMM (FMA pipes) and an FP16 GEMM (tensor cores)."""
    try:
        rows = profile.ncu(PROFILE_SNIPPET, kernel="multiply|gemm|nvjet|sm90|sm80|xmma|cutlass", timeout=240)
        return {"ok": True, "why": "", "rows": rows}
    except profile.ProfilerUnavailable as exc:
        return {"ok": False, "why": str(exc), "rows": []}


def text_profile(p: dict) -> str:
    """ncu's counters, a row per kernel."""
    if not p["ok"]:
        return f"ncu: {p['why']}"
    keys = [k for k in profile.DEFAULT_METRICS if k != "gpu__time_duration.sum"]
    short = {k: re.sub(r"\s*\(.*\)|utilisation|throughput|achieved ", "", profile.DEFAULT_METRICS[k]).strip()[:14]
             for k in keys}
    lines = [f"{'kernel':32}" + "".join(f"{short[k] + ' %':>16}" for k in keys)]
    for r in p["rows"]:
        lines.append(f"{profile.short_name(r['kernel'], 32):32}" + "".join(
            f"{r[k]:16.1f}" if isinstance(r.get(k), float) else f"{'-':>16}" for k in keys))
    return "\n".join(lines + ["(DRAM: % of its peak; pipes: % of the cycles busy; occupancy: warps resident, % of "
                              "an SM's most)"])


def profile_reading(p: dict, ceilings: dict) -> list:
    """ncu's counters beside the course's own measurements on the same GPU: the multiply's bytes over ncu's
    duration against the device-to-device copy lesson 1 measures (and the DRAM peak that ncu's percentage
    implies), each GEMM's FLOPs over its duration against the cuBLAS ceiling lesson 4 measures, with the pipe
    that kept busy. ``ceilings``: bench's ceilings of the GPU that measured ``p``."""
    if not p.get("ok"):
        return [f"ncu: {p.get('why', 'no profile')}"]
    dram, dur = "dram__throughput.avg.pct_of_peak_sustained_elapsed", "gpu__time_duration.sum"
    fma, tensor = ("sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
                   "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")
    lines = []
    for r in p["rows"]:
        if not isinstance(r.get(dur), float) or r[dur] <= 0:
            continue
        seconds = r[dur] * 1e-9
        if "multiply" in r["kernel"]:
            gbps = 3 * 4 * PROFILE_N / seconds / 1e9
            peak = f", so a DRAM peak of about {gbps / (r[dram] / 100):,.0f} GB/s" if r.get(dram) else ""
            lines.append(f"vector multiply: {gbps:,.0f} GB/s = {gbps / ceilings['copy_gbps']:.2f} x the copy lesson 1 "
                         f"measures ({ceilings['copy_gbps']:,.0f} GB/s);\n"
                         f"    ncu: DRAM at {r.get(dram, float('nan')):.1f}% of its peak{peak}; "
                         f"FMA pipes {r.get(fma, float('nan')):.1f}% busy")
        else:
            on_tensor = r.get(tensor, 0.0) >= r.get(fma, 0.0)
            name, ceiling = ("FP16 GEMM", "fp16_tflops") if on_tensor else ("FP32 GEMM", "fp32_tflops")
            tflops = 2 * PROFILE_GEMM**3 / seconds / 1e12
            pipe = f"tensor pipes {r.get(tensor, float('nan')):.1f}%" if on_tensor else f"FMA pipes {r.get(fma, float('nan')):.1f}%"
            lines.append(f"{name} {PROFILE_GEMM}^3 ({profile.short_name(r['kernel'], 28)}): {tflops:,.1f} TFLOP/s = "
                         f"{tflops / ceilings[ceiling]:.2f} x\n    the cuBLAS ceiling lesson 4 measures at 8192^3 "
                         f"({ceilings[ceiling]:,.1f}); ncu: {pipe} busy")
    return lines


# ------------------------------------------------------------------------------------ the registry

# In the order ``run`` measures them: MPS last, since it starts a daemon and processes.
FIGURES = {
    "overlap": Figure(measure_overlap, plot_overlap, text_overlap),
    "small_kernels": Figure(measure_small_kernels, plot_small_kernels, text_small_kernels),
    "unified_memory": Figure(measure_unified_memory, plot_unified_memory, text_unified_memory),
    "monitoring": Figure(measure_monitoring, plot_monitoring, text_monitoring),
    "batching": Figure(measure_batching, plot_batching, text_batching),
    "batcher": Figure(measure_batcher, plot_batcher, text_batcher),
    "profile": Figure(measure_profile, None, text_profile),
    "mps": Figure(measure_mps, plot_mps, text_mps),
}


def run() -> tuple:
    """Every figure of the lesson with the GPU's ceilings, for ``python -m gpucourse record``: as benchmarks.run,
    except that a figure whose measurement fails is recorded with its error ({"error": ...}) and the others are
    kept (the lesson starts a daemon, client processes and a profiler: one of them can fail on a machine where
    the rest runs)."""
    runtime.require_gpu(f"recording {LESSON}")
    ceilings = bench.measure_ceilings().as_dict()
    figures = {}
    for name, fig in FIGURES.items():
        t0 = time.perf_counter()
        try:
            figures[name] = fig.measure()
        except Exception as exc:
            traceback.print_exc()
            figures[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return figures, ceilings


# ------------------------------------------------------------------------------------ RESULTS.md

def results_rows(record: dict) -> list:
    """The lesson's headline figures in one record, for RESULTS.md and the README (gpucourse.results): the first row
    is the headline."""
    from gpucourse import results as R

    f = record["figures"]
    m = f.get("mps", {})
    ks = [k for k in map(str, m.get("ks", [])) if "mps_gain" in m.get("ratios", {}).get(k, {})]
    top = ks[-1] if ks else "16"
    best = f.get("overlap", {}).get("best", {})
    s = f.get("small_kernels", {}).get("us_per_launch", {})
    u = f.get("unified_memory", {})
    launches = [s.get("CuPy, one stream"), s.get("CuPy, one CUDA graph")]
    return [
        (f"MPS, {top} processes, images/s against time-slicing",
         R.ratio(m.get("ratios", {}).get(top, {}).get("mps_gain"), 1), "mps"),
        ("copies and kernel on streams, time against the longer copy alone",
         R.ratio(best.get("ratio_to_longer_copy")), "overlap"),
        ("a tiny kernel launched from CuPy / replayed in a CUDA graph, µs",
         R.joined(launches, lambda v: R.number(v, 2)), "small_kernels"),
        ("unified memory, prefetched / last touched by the CPU, GB/s",
         R.joined([u.get("prefetched_gbps"), u.get("cold_gbps")], R.number), "unified_memory"),
    ]

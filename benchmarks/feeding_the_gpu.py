"""Lesson 7's measurements (streams and overlap, many small launches, unified memory, NVML monitoring, Nsight
Compute; MPS and batching through benchmarks/serving.py) and the figures drawn from them, measured or recorded.

    python -m benchmarks.feeding_the_gpu            # everything, writes results/<gpu>/07_feeding_the_gpu.json
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from benchmarks import serving
from gpucourse import bench, monitor, plots, profile, records, runtime
from kernels import feeding_the_gpu as S

LESSON = "07_feeding_the_gpu"
FIGURES = ("overlap", "small_kernels", "mps", "batching", "batcher", "unified_memory", "monitoring", "profile")
OVERLAP_GOAL = 1.15  # pipelined total <= 1.15 x the longer copy direction alone
ROOT = Path(__file__).resolve().parents[1]


def _rng_fill(host: np.ndarray, seed: int) -> None:
    cp = runtime.cupy()
    cp.random.seed(seed)
    cp.random.random(host.size, dtype=cp.float32).get(out=host)


# ------------------------------------------------------------------------------------ 1. overlap

def overlap(n: int | None = None, streams=None, chunks: int | None = None, repeats: int = 5) -> dict:
    """The copies alone, the kernel alone, and the chunked pipeline on 1, 2, 3, 4, ... streams, with one
    timeline per stream count. out = a * b on n float32 from pinned host memory and back."""
    cp = runtime.cupy()
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
        p = S.Pipeline(n, chunks=chunks, streams=k)
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


# ------------------------------------------------------------------------------ 2. small kernels

def small_kernels(launches: int = 2000, n: int = 1024, streams: int = 4, repeats: int = 7) -> dict:
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


# ---------------------------------------------------------------------------------------- 3. MPS

def recorded_mps(batched: int = 8) -> tuple:
    """(table, label) of the newest record of the lesson whose MPS experiment ran every configuration, with
    requests of ``batched`` images for the batched one (Task 7.3 reads it); records where MPS could not start,
    or a configuration failed, are passed over."""
    want = {"time-slicing, batch 1", "MPS, batch 1", f"MPS, batch {batched}"}
    for rec in reversed(records.all_records(LESSON)):
        m = rec["figures"].get("mps") or {}
        configs = m.get("configs") or {}
        if m.get("batched") == batched and want <= set(configs) and all(configs[c] for c in want):
            return m, records.label(rec)
    raise runtime.CourseError(f"no record of {LESSON} holds a complete MPS table (MPS ran, batches of {batched}); "
                              "record one on a GPU where MPS starts: python -m benchmarks.feeding_the_gpu")


# ------------------------------------------------------------------------ 4. throughput vs latency

# ------------------------------------------------------------------------------- 5. unified memory

def unified_memory(n: int = 2**27, repeats: int = 5) -> dict:
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


# ----------------------------------------------------------------------------------- 6. monitoring

MONITOR_PHASE_S = 2.5  # seconds a phase lasts: NVML averages over a sample period of 1/6 s to 1 s
MONITOR_SETTLE_S = 1.0  # what phase_medians leaves out at the start of each phase


def monitoring(interval_s: float = 0.02, phase_s: float = MONITOR_PHASE_S) -> dict:
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


# ------------------------------------------------------------------------------------ 7. profiling

PROFILE_N, PROFILE_GEMM = 2**26, 4096  # the profiled multiply's elements; the profiled GEMMs' M = N = K
PROFILE_SNIPPET = f"""
import gpucourse
from gpucourse import runtime
gpucourse.setup("gpu", quiet=True)
import cupy as cp
from kernels import feeding_the_gpu as S
n = {PROFILE_N}
a, b, c = (cp.ones(n, cp.float32) for _ in range(3))
S.multiply_kernel[8 * runtime.get().device["sms"], S.THREADS](a, b, c)
x = cp.random.random(({PROFILE_GEMM}, {PROFILE_GEMM}), dtype=cp.float32)  # random: constant inputs draw less power
x @ x
h = x.astype(cp.float16)
h @ h
cp.cuda.Device().synchronize()
"""


def profile_kernels() -> dict:
    """ncu on lesson 1's multiply (memory-bound), an FP32 GEMM (FMA pipes) and an FP16 GEMM (tensor cores)."""
    try:
        rows = profile.ncu(PROFILE_SNIPPET, kernel="multiply|gemm|nvjet|sm90|sm80|xmma|cutlass", timeout=240,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])))
        return {"ok": True, "why": "", "rows": rows}
    except profile.ProfilerUnavailable as exc:
        return {"ok": False, "why": str(exc), "rows": []}


# ----------------------------------------------------------------------------- measured or recorded

def recall(key: str, measure=None) -> tuple:
    """(figures, source) for the notebook: ``measure()`` on a GPU when given, else the newest record's
    figures[key]; (None, why) where neither is possible (CPU mode before the lesson was recorded)."""
    if measure is not None and runtime.is_gpu():
        return records.measure_or_recall(LESSON, key, measure)
    rec = records.latest(LESSON)
    if rec is None or key not in rec["figures"]:
        return None, f"no GPU record of {LESSON} holds {key!r} yet: run `python -m gpucourse record` on a GPU"
    return rec["figures"][key], records.label(rec)


# ------------------------------------------------------------------------------------------- run

def steps(mps_ks=(1, 2, 4, 8, 16), mps_seconds: float = 2.0) -> dict:
    """{figure name: the function that measures it}, in the order ``run`` measures them (MPS last: it
    starts processes and a daemon)."""
    return {"overlap": overlap, "small_kernels": small_kernels, "unified_memory": unified_memory,
            "monitoring": monitoring, "batching": serving.batch_sweep, "batcher": serving.batcher,
            "profile": profile_kernels, "mps": lambda: serving.mps_sweep(mps_ks, mps_seconds)}


def run(mps_ks=(1, 2, 4, 8, 16), mps_seconds: float = 2.0) -> tuple:
    """Every measurement of the lesson: (figures, ceilings), for `python -m gpucourse record`."""
    runtime.require_gpu("lesson 7's benchmark")
    ceilings = bench.measure_ceilings().as_dict()
    figures = {}
    for name, step in steps(mps_ks, mps_seconds).items():
        t0 = time.perf_counter()
        try:
            figures[name] = step()
        except Exception as exc:  # one failing step must not lose the others' figures; the record says why
            import traceback

            traceback.print_exc()
            figures[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return figures, ceilings


def summary(f: dict) -> str:
    """The record in a few lines; a figure whose measurement failed says so, with its error."""
    def overlap(o):
        return [f"overlap: best {o['best']['streams']} streams, total / longer copy = "
                f"{o['best']['ratio_to_longer_copy']:.3f} (goal <= {OVERLAP_GOAL}); serial / pipelined = "
                f"{o['best']['speedup_over_serial']:.2f}x"]

    def small(s):
        return ["small kernels (µs per launch): " + ", ".join(f"{k} {v:.2f}" for k, v in s["us_per_launch"].items())]

    def mps_lines(m):
        return [f"MPS: {'ran' if m['mps'] else 'unavailable: ' + m['why']}"] + [
            f"  k={k}: " + ", ".join(f"{a} {b:.2f}x" for a, b in r.items()) for k, r in m["ratios"].items()]

    def unified(u):
        return ["unified memory GB/s: " + ", ".join(f"{k[:-5]} {v:.0f}" for k, v in u.items() if k.endswith("_gbps"))]

    def ncu(p):
        return ["ncu: " + ("; ".join(f"{profile.short_name(r['kernel'], 30)}: " + ", ".join(
            f"{profile.DEFAULT_METRICS.get(k, k)[:16]} {v:.1f}" for k, v in r.items() if k in profile.DEFAULT_METRICS
            and isinstance(v, float)) for r in p["rows"]) if p["ok"] else p["why"])]

    lines = []
    for name, part in (("overlap", overlap), ("small_kernels", small), ("mps", mps_lines),
                       ("unified_memory", unified), ("profile", ncu)):
        fig = f.get(name)
        if fig is None or "error" in fig:
            lines.append(f"{name}: " + (f"failed: {fig['error']}" if fig else "not measured"))
        else:
            lines += part(fig)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ plots

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


def plot_overlap(o: dict, source: str):
    vals = {"copies in alone": o["h2d_ms"], "kernel alone": o["kernel_ms"], "copy out alone": o["d2h_ms"],
            "all three, one after another": o["serial_ms"]}
    vals.update({f"pipeline, {r['streams']} stream(s)": r["total_ms"] for r in o["runs"].values()})
    longer = max(o["h2d_ms"], o["d2h_ms"])
    return plots.bars(vals, unit="ms", source=source, ceiling=("longer copy alone", longer),
                      title=f"out = a * b on {o['bytes_per_vector'] / 2**30:.0f} GiB vectors from pinned memory, "
                            f"{o['chunks']} chunks")


def plot_small_kernels(s: dict, source: str):
    return plots.bars(s["us_per_launch"], unit="µs", source=source,
                      title=f"{s['launches']} launches of a tiny kernel: µs per launch (host timer)")


def plot_unified(u: dict, source: str):
    names = {"cold_gbps": "managed, CPU touched it last (page faults)", "prefetched_gbps": "managed, prefetched",
             "resident_gbps": "managed, already on the GPU", "device_gbps": "cudaMalloc memory",
             "explicit_copies_gbps": "explicit copies in and out + kernel",
             "cpu_first_touch_gbps": "CPU reads it after the GPU (migrates back)",
             "cpu_second_touch_gbps": "CPU reads it again"}
    return plots.bars({v: u[k] for k, v in names.items() if k in u}, unit="GB/s", source=source,
                      title=f"x *= 2 over {u['bytes'] / 2**20:.0f} MiB: unified memory")


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


def profile_table(p: dict) -> str:
    if not p["ok"]:
        return f"ncu: {p['why']}"
    keys = [k for k in profile.DEFAULT_METRICS if k != "gpu__time_duration.sum"]
    lines = [f"{'kernel':32} " + " ".join(f"{profile.DEFAULT_METRICS[k][:22]:>23}" for k in keys)]
    for r in p["rows"]:
        lines.append(f"{profile.short_name(r['kernel'], 32):32} " + " ".join(
            f"{r[k]:23.1f}" if isinstance(r.get(k), float) else f"{'-':>23}" for k in keys))
    return "\n".join(lines)


def profile_reading(p: dict, ceilings: dict) -> list:
    """ncu's counters beside the course's own measurements on the same GPU: the multiply's bytes over ncu's
    duration against the device-to-device copy lesson 1 measures (and the DRAM peak that ncu's percentage
    implies), each GEMM's FLOPs over its duration against the cuBLAS ceiling lesson 3 measures, with the pipe
    that kept busy. ``ceilings``: bench's ceilings recorded with ``p``."""
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
                         f"measures ({ceilings['copy_gbps']:,.0f} GB/s); ncu: DRAM at {r.get(dram, float('nan')):.1f}% "
                         f"of its peak{peak}; FMA pipes {r.get(fma, float('nan')):.1f}% busy")
        else:
            on_tensor = r.get(tensor, 0.0) >= r.get(fma, 0.0)
            name, ceiling = ("FP16 GEMM", "fp16_tflops") if on_tensor else ("FP32 GEMM", "fp32_tflops")
            tflops = 2 * PROFILE_GEMM**3 / seconds / 1e12
            pipe = f"tensor pipes {r.get(tensor, float('nan')):.1f}%" if on_tensor else f"FMA pipes {r.get(fma, float('nan')):.1f}%"
            lines.append(f"{name} {PROFILE_GEMM}^3 ({profile.short_name(r['kernel'], 28)}): {tflops:,.1f} TFLOP/s = "
                         f"{tflops / ceilings[ceiling]:.2f} x the cuBLAS ceiling lesson 3 measures at 8192^3 "
                         f"({ceilings[ceiling]:,.1f}); ncu: {pipe} busy")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.feeding_the_gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what")
    r = sub.add_parser("record")
    r.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    r.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args(argv)
    runtime.setup("gpu")
    ks, seconds = (args.k, args.seconds) if args.what == "record" else ((1, 2, 4, 8, 16), 2.0)
    figures, ceilings = run(ks, seconds)
    path = records.write(LESSON, figures, ceilings=ceilings)
    print(summary(figures))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

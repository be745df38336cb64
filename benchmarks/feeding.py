"""Lesson 7's measurements (streams and overlap, many small launches, MPS, batching, unified memory, NVML
monitoring, Nsight Compute) and the figures drawn from them, measured or recorded.

    python -m benchmarks.feeding            # everything, writes results/<gpu>/07_feeding_the_gpu.json
    python -m benchmarks.feeding client ... # one MPS client process (started by mps_sweep, not by hand)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gpucourse import bench, monitor, plots, profile, records, runtime
from kernels import batching as B
from kernels import engine as E
from kernels import mps
from kernels import streams as S

LESSON = "07_feeding_the_gpu"
FIGURES = ("overlap", "small_kernels", "mps", "batching", "batcher", "unified_memory", "monitoring", "profile")
SEED_MPS_GAIN, SEED_BATCHING_GAIN = 7.0, 1.6  # the seed's claims: MPS 7x inference throughput, batching +60%
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
                                "overlap_fraction": S.overlap_fraction(run.timeline), "timeline": run.timeline}
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

def _plan(max_batch: int, precision: str = "fp32") -> E.Plan:
    g, data = E.load_model_file()
    stages = E.optimize(g)
    return E.build_plan(stages[-1][1], precision=precision, max_batch=max_batch, name="lesson 7", graphs=True,
                        x_calib=E.dataset(data)["x_calib"])


def client(plan_path: str, batch: int, seconds: float) -> dict:
    """One inference client (run in its own process): load the plan, warm up, say "ready", wait for "go" on
    stdin, then run batch-``batch`` inferences back to back for ``seconds``, each waited for."""
    runtime.setup("gpu", quiet=True)
    cp = runtime.cupy()
    eng = E.Engine(E.load_plan(plan_path), graphs=True)
    x = eng.input_buffer(batch)
    x[...] = cp.random.random(x.shape, dtype=cp.float32)
    for _ in range(20):
        eng.infer(x)
    cp.cuda.Device().synchronize()
    print("ready", flush=True)
    sys.stdin.readline()
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        eng.infer(x)
        cp.cuda.Device().synchronize()
        count += 1
    elapsed = time.perf_counter() - t0
    return {"inferences": count, "images": count * batch, "seconds": elapsed, "images_per_s": count * batch / elapsed}


def run_clients(k: int, plan_path: str, batch: int, seconds: float, env: dict, timeout: float = 120) -> dict:
    """k client processes started together; images/s summed over them."""
    cmd = [sys.executable, "-m", "benchmarks.feeding", "client", "--plan", plan_path, "--batch", str(batch),
           "--seconds", str(seconds)]
    env = dict(env, PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=ROOT) for _ in range(k)]
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            line = p.stdout.readline()
            if line.strip() != "ready" or time.monotonic() > deadline:
                raise runtime.CourseError(f"an MPS client did not start: {line.strip()} {p.stderr.read()[-800:]}")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=seconds + 60)
            if p.returncode != 0:
                raise runtime.CourseError(f"an MPS client failed: {err[-800:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return {"clients": k, "batch": batch, "images_per_s": sum(r["images_per_s"] for r in results),
            "per_client": [r["images_per_s"] for r in results]}


def mps_sweep(ks=(1, 2, 4, 8, 16), seconds: float = 2.0, batched: int = 8, binary: str | None = None) -> dict:
    """Lesson 5's engine at batch 1 in k processes, time-sliced (no MPS), through MPS, and through MPS with
    batch ``batched`` per request. If MPS cannot start, ``why`` says so and only time-slicing is measured."""
    runtime.require_gpu("the MPS experiment")
    out = {"ks": list(ks), "seconds": seconds, "batched": batched, "configs": {}, "mps": True, "why": ""}
    with tempfile.TemporaryDirectory(prefix="gpucourse-plan-") as tmp:
        plan_path = str(_plan(max(batched, 1)).save(Path(tmp) / "plan.npz"))
        rows = out["configs"]["time-slicing, batch 1"] = {}
        for k in bench.progress(ks, desc="no MPS"):
            rows[str(k)] = run_clients(k, plan_path, 1, seconds, dict(os.environ))
        try:
            with mps.Daemon(binary) as d:
                for name, batch in (("MPS, batch 1", 1), (f"MPS, batch {batched}", batched)):
                    rows = out["configs"][name] = {}
                    for k in bench.progress(ks, desc=name):
                        rows[str(k)] = run_clients(k, plan_path, batch, seconds, d.client_env())
            out["mps_log"] = d.last_log[-2000:]
        except mps.MPSUnavailable as exc:
            out["mps"], out["why"] = False, str(exc)
    out["ratios"] = mps_ratios(out)
    return out


def mps_ratios(table: dict) -> dict:
    """Per k: MPS / time-slicing and MPS with batching / MPS alone (images/s), beside the seed's 7x and +60%."""
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


# ------------------------------------------------------------------------ 4. throughput vs latency

def batch_sweep(batches=None, repeats: int = 50) -> dict:
    """Lesson 5's engine (fused, FP32, CUDA graphs): GPU latency of one inference (p50, p99) and images/s
    at every batch size."""
    batches = list(batches or runtime.size("feeding.batches"))
    eng = E.Engine(_plan(max(batches)), graphs=True)
    cp = runtime.cupy()
    rows = []
    for b in bench.progress(batches, desc="batch sizes"):
        x = eng.input_buffer(b)
        x[...] = cp.random.random(x.shape, dtype=cp.float32)
        t = bench.time_gpu(lambda: eng.infer(x), repeats=repeats, warmup=3)
        rows.append(B.latency_summary(t.samples_ms, b))
    return {"rows": rows, "engine": "fused + graph, FP32"}


def batcher(rates=None, waits_ms=(0.0, 0.25, 1.0, 4.0), max_batch: int = 256, count: int = 4000) -> dict:
    """The dynamic batcher with lesson 5's engine as the server: every batch really runs on the GPU and
    takes the time it took (CUDA events). Per arrival rate and maximum wait: p50/p99 latency, images/s."""
    cp = runtime.cupy()
    eng = E.Engine(_plan(max_batch), graphs=True)
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
    rows = batcher_table(service, rates, waits_ms, max_batch, count)
    return {"rows": rows, "batch1_service_ms": batch1 * 1e3, "max_batch": max_batch, "requests": count}


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

def monitoring(interval_s: float = 0.01) -> dict:
    """NVML samples while the GPU idles, runs one spinning thread (100% "utilisation" from one thread on one
    SM), runs a memory-bound kernel at full speed, and idles again."""
    cp = runtime.cupy()
    n = 2**28
    a, b, c = (cp.ones(n, cp.float32) for _ in range(3))
    blocks = 8 * runtime.get().device["sms"]
    with monitor.Sampler(interval_s=interval_s) as s:
        s.mark("idle")
        time.sleep(0.4)
        s.mark("one thread spinning")
        bench.hold(600)
        cp.cuda.Device().synchronize()
        s.mark("vector multiply, all SMs")
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.8:
            for _ in range(20):
                S.multiply_kernel[blocks, S.THREADS](a, b, c)
            cp.cuda.Device().synchronize()
        s.mark("idle again")
        time.sleep(0.4)
        s.mark("end")
    return {"interval_s": interval_s, "samples": s.samples, "marks": s.marks}


# ------------------------------------------------------------------------------------ 7. profiling

PROFILE_SNIPPET = """
import gpucourse
from gpucourse import runtime
gpucourse.setup("gpu", quiet=True)
import cupy as cp
from kernels import streams as S
n = 2**26
a, b, c = (cp.ones(n, cp.float32) for _ in range(3))
S.multiply_kernel[8 * runtime.get().device["sms"], S.THREADS](a, b, c)
x = cp.ones((4096, 4096), cp.float32)
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


def service_model(rows: list):
    """service(n) -> seconds, interpolated (log-log) through a batch sweep's p50 latencies: the recorded GPU's
    batch times, for running the dynamic batcher where there is no GPU."""
    bs = np.log([r["batch"] for r in rows])
    ms = np.log([r["p50_ms"] for r in rows])
    if len(rows) < 2 or np.any(np.diff(bs) <= 0):
        raise runtime.CourseInputError("the batch sweep needs at least two batch sizes, in increasing order")

    def service(n: int) -> float:
        return float(np.exp(np.interp(np.log(n), bs, ms))) / 1e3

    return service


def batcher_table(service, rates, waits_ms=(0.0, 0.25, 1.0, 4.0), max_batch: int = 256, count: int = 4000) -> list:
    """p50/p99 latency, throughput and mean batch of the dynamic batcher for every rate and maximum wait."""
    rows = []
    for rate in rates:
        t = B.poisson_arrivals(rate, count, seed=int(rate))
        for w in waits_ms:
            r = B.dynamic_batching(t, service, max_batch=max_batch, max_wait=w / 1e3)
            lat = r["latency_s"] * 1e3
            rows.append({"rate_per_s": rate, "max_wait_ms": w, "p50_ms": float(np.percentile(lat, 50)),
                         "p99_ms": float(np.percentile(lat, 99)), "throughput_per_s": r["throughput_per_s"],
                         "mean_batch": float(np.mean(r["batch_sizes"]))})
    return rows


# ------------------------------------------------------------------------------------------- run

def steps(mps_ks=(1, 2, 4, 8, 16), mps_seconds: float = 2.0) -> dict:
    """{figure name: the function that measures it}, in the order ``run`` measures them (MPS last: it
    starts processes and a daemon)."""
    return {"overlap": overlap, "small_kernels": small_kernels, "unified_memory": unified_memory,
            "monitoring": monitoring, "batching": batch_sweep, "batcher": batcher, "profile": profile_kernels,
            "mps": lambda: mps_sweep(mps_ks, mps_seconds)}


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
    o, s, m, u = f["overlap"], f["small_kernels"], f["mps"], f["unified_memory"]
    lines = [f"overlap: best {o['best']['streams']} streams, total / longer copy = "
             f"{o['best']['ratio_to_longer_copy']:.3f} (goal <= {OVERLAP_GOAL}); serial / pipelined = "
             f"{o['best']['speedup_over_serial']:.2f}x",
             "small kernels (µs per launch): " + ", ".join(f"{k} {v:.2f}" for k, v in s["us_per_launch"].items()),
             f"MPS: {'ran' if m['mps'] else 'unavailable: ' + m['why']}"]
    for k, r in m["ratios"].items():
        lines.append(f"  k={k}: " + ", ".join(f"{a} {b:.2f}x" for a, b in r.items()))
    lines.append("unified memory GB/s: " + ", ".join(f"{k[:-5]} {v:.0f}" for k, v in u.items() if k.endswith("_gbps")))
    p = f["profile"]
    lines.append("ncu: " + ("; ".join(f"{profile.short_name(r['kernel'], 30)}: " + ", ".join(
        f"{profile.DEFAULT_METRICS.get(k, k)[:16]} {v:.1f}" for k, v in r.items() if k in profile.DEFAULT_METRICS
        and isinstance(v, float)) for r in p["rows"]) if p["ok"] else p["why"]))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ plots

def plot_gantt(run: dict, source: str, title: str | None = None):
    """One row per stream, a bar per stage of each chunk: copies in, kernel, copy out."""
    import matplotlib.pyplot as plt

    colours = {"h2d": "tab:blue", "kernel": "tab:green", "d2h": "tab:orange"}
    names = {"h2d": "host → device", "kernel": "kernel", "d2h": "device → host"}
    k = run["streams"]
    fig, ax = plt.subplots(figsize=(8, 0.45 * k + 1.8))
    for r in run["timeline"]:
        for stage in S.STAGES:
            t0, t1 = r[stage]
            ax.barh(r["stream"], t1 - t0, left=t0, color=colours[stage], edgecolor="white", lw=0.3,
                    label=names[stage] if r["chunk"] == 0 else None)
    ax.set_yticks(range(min(k, len(run["timeline"]))))
    ax.set_yticklabels([f"stream {i}" for i in range(min(k, len(run["timeline"])))])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the start")
    ax.legend(fontsize=8, loc="lower right", ncol=3)
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


def plot_mps(m: dict, source: str):
    series = {name: ([int(k) for k in rows], [rows[k]["images_per_s"] for k in rows])
              for name, rows in m["configs"].items()}
    fig = plots.lines(series, xlabel="client processes k", ylabel="images / s (all clients)", source=source,
                      title="Lesson 5's engine in k processes on one GPU")
    return fig


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


def plot_batcher(t: dict, source: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rate in sorted({r["rate_per_s"] for r in t["rows"]}):
        rows = [r for r in t["rows"] if r["rate_per_s"] == rate]
        ax.plot([r["max_wait_ms"] for r in rows], [r["p99_ms"] for r in rows], "o-",
                label=f"{rate:,} requests/s: mean batch " + "/".join(f"{r['mean_batch']:.0f}" for r in rows))
    ax.set_xscale("symlog", linthresh=0.25)
    ax.set_yscale("log")
    ax.set_xlabel("maximum wait (ms)")
    ax.set_ylabel("p99 latency (ms)")
    ax.legend(fontsize=8)
    return plots._finish(ax, f"Dynamic batching (max batch {t['max_batch']}), served by the engine on the GPU",
                         source)


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.feeding", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what")
    c = sub.add_parser("client")
    c.add_argument("--plan", required=True)
    c.add_argument("--batch", type=int, default=1)
    c.add_argument("--seconds", type=float, default=2.0)
    r = sub.add_parser("record")
    r.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    r.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args(argv)
    if args.what == "client":
        print(json.dumps(client(args.plan, args.batch, args.seconds)), flush=True)
        return 0
    runtime.setup("gpu")
    ks, seconds = (args.k, args.seconds) if args.what == "record" else ((1, 2, 4, 8, 16), 2.0)
    figures, ceilings = run(ks, seconds)
    path = records.write(LESSON, figures, ceilings=ceilings)
    print(summary(figures))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Lesson 7, sections 3 and 4: one GPU shared by many clients. Lesson 5's engine in k client processes,
time-sliced and through MPS (``mps_sweep``: the real control daemon, always stopped), and serving requests:
the batch-size sweep and the dynamic batcher, whose batches run on the GPU. The figures drawn from them.

    python -m benchmarks.serving client ...   # one MPS client process (started by mps_sweep, not by hand)

``python -m benchmarks.feeding_the_gpu`` records these with the rest of lesson 7.
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

from gpucourse import bench, plots, runtime
from systems.feeding_the_gpu import batching as B
from kernels import inference_engine as E
from gpucourse import mps

SEED_MPS_GAIN, SEED_BATCHING_GAIN = 7.0, 1.6  # the seed's claims: MPS 7x inference throughput, batching +60%
ROOT = Path(__file__).resolve().parents[1]


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


def run_clients(k: int, plan_path: str, batch: int, seconds: float, env: dict, timeout: float = 120,
                cmd: list | None = None) -> dict:
    """k client processes started together; images/s summed over them. Each must say "ready" within ``timeout``
    seconds and finish within ``seconds`` + 60 s, else every client is killed and a ``runtime.CourseError`` says
    which one and how its stderr ends. ``cmd``: the client's command line before its options (by default this
    module's ``client`` entry in a new Python); ``--plan``, ``--batch`` and ``--seconds`` are appended."""
    import threading

    cmd = list(cmd or [sys.executable, "-m", "benchmarks.serving", "client"]) + [
        "--plan", plan_path, "--batch", str(batch), "--seconds", str(seconds)]
    env = dict(env, PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    procs, errs, outs, readers, ready = [], [], [], [], []

    def read(i: int) -> None:  # a thread per client: a blocking readline cannot hold the time-outs up
        for line in procs[i].stdout:
            outs[i].append(line)
            if line.strip() == "ready":
                ready[i].set()

    def stderr_tail(i: int) -> str:
        errs[i].seek(0)
        tail = errs[i].read().decode(errors="replace").strip()[-800:]
        return f"its stderr ends: {tail}" if tail else "it wrote nothing to stderr"

    def which(i: int) -> str:
        return f"client {i + 1} of {k} (batch {batch})"

    try:
        for i in range(k):
            errs.append(tempfile.TemporaryFile())  # a file, not a pipe: a client writing much to stderr never blocks
            outs.append([])
            ready.append(threading.Event())
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errs[i],
                                          text=True, env=env, cwd=ROOT))
            readers.append(threading.Thread(target=read, args=(i,), daemon=True))
            readers[i].start()
        deadline = time.monotonic() + timeout
        for i, p in enumerate(procs):
            while not ready[i].wait(timeout=0.05):
                if p.poll() is not None:
                    raise runtime.CourseError(f"{which(i)} ended (exit status {p.returncode}) before saying \"ready\"; "
                                              f"{stderr_tail(i)}")
                if time.monotonic() > deadline:
                    raise runtime.CourseError(
                        f"{which(i)} did not say \"ready\" within {timeout:g} s (it loads the plan and warms up; "
                        f"a client that cannot reach its MPS server waits here); {stderr_tail(i)}")
        for i, p in enumerate(procs):
            try:
                p.stdin.write("go\n")
                p.stdin.flush()
            except OSError:  # it ended after "ready"
                raise runtime.CourseError(f"{which(i)} ended before it was told to go; {stderr_tail(i)}") from None
        results = []
        deadline = time.monotonic() + seconds + 60
        for i, p in enumerate(procs):
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise runtime.CourseError(f"{which(i)} did not finish within {seconds + 60:g} s; "
                                          f"{stderr_tail(i)}") from None
            readers[i].join(timeout=10)
            if p.returncode != 0:
                raise runtime.CourseError(f"{which(i)} failed (exit status {p.returncode}); {stderr_tail(i)}")
            try:
                results.append(json.loads([line for line in outs[i] if line.strip()][-1]))
            except (IndexError, ValueError):
                raise runtime.CourseError(f"{which(i)} printed no result line (JSON) but "
                                          f"{''.join(outs[i]).strip()[-300:]!r}; {stderr_tail(i)}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        for p, t in zip(procs, readers):
            t.join(timeout=10)
            for pipe in (p.stdin, p.stdout) if not t.is_alive() else (p.stdin,):
                try:
                    pipe.close()
                except OSError:
                    pass
        for f in errs:
            f.close()
    return {"clients": k, "batch": batch, "images_per_s": sum(r["images_per_s"] for r in results),
            "per_client": [r["images_per_s"] for r in results]}


def mps_sweep(ks=(1, 2, 4, 8, 16), seconds: float = 2.0, batched: int = 8, binary: str | None = None,
              cmd: list | None = None, make_plan=None, timeout: float = 120) -> dict:
    """Lesson 5's engine at batch 1 in k processes, time-sliced (no MPS), through MPS, and through MPS with
    batch ``batched`` per request. "mps" is True when every MPS configuration was measured. If the daemon
    cannot start, or MPS fails while its configurations are measured (a client that cannot reach the MPS server
    often shows it only then), "mps" is False, "why" says where and why (with the daemon's and the MPS server's
    last log lines), and every row measured before the failure is kept; the daemon is stopped in every case and
    "mps_log" keeps its log's last lines. ``cmd`` (run_clients' client command), ``make_plan(max_batch,
    folder) -> plan path`` and ``timeout`` (seconds for a client to be ready) let the tests run it without a
    GPU; by default the clients run lesson 5's engine, which needs one."""
    if make_plan is None:
        runtime.require_gpu("the MPS experiment")

        def make_plan(max_batch: int, folder: Path) -> str:
            return str(_plan(max_batch).save(folder / "plan.npz"))
    out = {"ks": list(ks), "seconds": seconds, "batched": batched, "configs": {}, "mps": True, "why": ""}
    with tempfile.TemporaryDirectory(prefix="gpucourse-plan-") as tmp:
        plan_path = make_plan(max(batched, 1), Path(tmp))
        # Without MPS, the clients get a fresh, empty, private pipe folder (removed afterwards): a CUDA client
        # looks for the MPS daemon in CUDA_MPS_PIPE_DIRECTORY, so where a system-wide daemon runs, clients with
        # the inherited environment would go through it. Here they can reach no daemon and are time-sliced.
        with tempfile.TemporaryDirectory(prefix="gpucourse-no-mps-") as no_mps:
            rows = out["configs"]["time-slicing, batch 1"] = {}
            for k in bench.progress(ks, desc="no MPS"):
                rows[str(k)] = run_clients(k, plan_path, 1, seconds, dict(os.environ, **{mps.PIPE: no_mps}),
                                           timeout=timeout, cmd=cmd)
        d = mps.Daemon(binary)
        try:
            with d:  # stops the daemon whatever happens inside, an exception or a SIGTERM (see gpucourse/mps.py)
                for name, batch in (("MPS, batch 1", 1), (f"MPS, batch {batched}", batched)):
                    rows = out["configs"][name] = {}
                    for k in bench.progress(ks, desc=name):
                        try:
                            rows[str(k)] = run_clients(k, plan_path, batch, seconds, d.client_env(),
                                                       timeout=timeout, cmd=cmd)
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


def batcher_table(service, rates, waits_ms=(0.0, 0.25, 1.0, 4.0), max_batch: int = 256, count: int = 4000) -> list:
    """For every rate: one request at a time (no batching: max batch 1), then the dynamic batcher at every
    maximum wait; p50/p99 latency, requests served a second, mean batch, and the share of the time the GPU
    was busy (what is left is capacity for other work)."""
    rows = []
    for rate in rates:
        t = B.poisson_arrivals(rate, count, seed=int(rate))
        for mb, w in [(1, 0.0)] + [(max_batch, w) for w in waits_ms]:
            r = B.dynamic_batching(t, service, max_batch=mb, max_wait=w / 1e3)
            lat = r["latency_s"] * 1e3
            rows.append({"rate_per_s": rate, "max_batch": mb, "max_wait_ms": w,
                         "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
                         "throughput_per_s": r["throughput_per_s"], "mean_batch": float(np.mean(r["batch_sizes"])),
                         "gpu_busy": r["busy_s"] / r["span_s"] if r["span_s"] > 0 else 1.0})
    return rows


def batcher_lines(rows: list) -> list:
    """The batcher's table in words: a line per rate and policy, then per rate what batching and waiting did."""
    lines = []
    for r in rows:
        policy = ("one at a time        " if r.get("max_batch") == 1 else f"batching, wait {r['max_wait_ms']:4.2f} ms")
        busy = f", GPU busy {100 * r['gpu_busy']:3.0f}%" if "gpu_busy" in r else ""
        lines.append(f"{r['rate_per_s']:>9,} req/s, {policy}: p50 {r['p50_ms']:8.3f} ms, p99 {r['p99_ms']:8.3f} ms, "
                     f"{r['throughput_per_s']:>9,.0f} served/s, mean batch {r['mean_batch']:6.1f}{busy}")
    for rate in sorted({r["rate_per_s"] for r in rows}):
        alone = [r for r in rows if r["rate_per_s"] == rate and r.get("max_batch") == 1]
        waits = sorted((r for r in rows if r["rate_per_s"] == rate and r.get("max_batch", 2) > 1),
                       key=lambda r: r["max_wait_ms"])
        if not alone or len(waits) < 2 or "gpu_busy" not in waits[0]:
            continue
        a, w0, w1 = alone[0], waits[0], waits[1]
        lines.append(f"at {rate:,} req/s: one at a time p99 {a['p99_ms']:,.3g} ms, batching {w0['p99_ms']:.3g} ms; "
                     f"waiting up to {w1['max_wait_ms']:g} ms: p99 {w1['p99_ms']:.3g} ms and the GPU busy "
                     f"{100 * w1['gpu_busy']:.0f}% of the time instead of {100 * w0['gpu_busy']:.0f}%")
    return lines


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
    """p99 latency and the GPU's busy share against the maximum wait, a line per arrival rate; one request at a
    time (no batching) named in the legend. Rows recorded before the busy share was kept draw the top alone."""
    import matplotlib.pyplot as plt

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
    from matplotlib.ticker import FuncFormatter

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("client", help="one MPS client process")
    c.add_argument("--plan", required=True)
    c.add_argument("--batch", type=int, default=1)
    c.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args(argv)
    print(json.dumps(client(args.plan, args.batch, args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

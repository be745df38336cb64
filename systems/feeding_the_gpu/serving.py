"""Lesson 8, sections 3 and 4: serving lesson 6's engine.

One GPU shared by many processes. ``client`` is one client process's loop: load the engine's plan, warm up, say
"ready", wait for "go", then run inferences back to back for a few seconds and print what it served. ``run_clients``
starts k of them together and sums their images per second; benchmarks/feeding_the_gpu.py runs them time-sliced
and through MPS (gpucourse/mps.py). A client process runs this module::

    python -m systems.feeding_the_gpu.serving client --plan PLAN --batch 1 --seconds 2

or, for a client defined elsewhere (a notebook cell's ``client``), the same entry point around that function's
source (``client_command``).

And requests served through the dynamic batcher (batching.py) on a batch's service time: ``batcher_table`` plays
arrivals at several rates through it, ``service_model`` turns a recorded batch sweep into service times, for running
the batcher where there is no GPU.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np

from gpucourse import runtime
from kernels import inference_engine as E
from systems.feeding_the_gpu import batching as B

ROOT = Path(__file__).resolve().parents[2]


def engine_plan(max_batch: int, precision: str = "fp32") -> E.Plan:
    """Lesson 6's engine for the digits network: every optimisation pass, CUDA graphs, batches up to ``max_batch``."""
    g, data = E.load_model_file()
    stages = E.optimize(g)
    return E.build_plan(stages[-1][1], precision=precision, max_batch=max_batch, name="lesson 8", graphs=True,
                        x_calib=E.dataset(data)["x_calib"])


# ------------------------------------------------------------------------------------------ the client

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


def client_command(fn=None) -> list:
    """The command line of one client process, before its options: this module's ``client``, or ``fn``, a client
    with the same arguments defined elsewhere (a notebook cell's), run from its source with this module's names
    around it, so an edited client is the one the processes run."""
    if fn is None or fn is client:
        return [sys.executable, "-m", "systems.feeding_the_gpu.serving", "client"]
    if not inspect.isfunction(fn) or not fn.__name__.isidentifier():
        raise runtime.CourseInputError(f"the client must be a function defined with def, like serving.client; "
                                       f"got {fn!r}")
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        raise runtime.CourseInputError(
            f"the source of {fn.__name__} cannot be read (a client process runs the function's source): define "
            "it in a cell or a file") from None
    script = (f"from systems.feeding_the_gpu.serving import *\n\n{source}\n\n"
              f"from systems.feeding_the_gpu import serving as _serving\n"
              f"raise SystemExit(_serving.main(client_fn={fn.__name__}))\n")
    return [sys.executable, "-c", script, "client"]


def run_clients(k: int, plan_path: str, batch: int, seconds: float, env: dict, timeout: float = 120,
                cmd: list | None = None, client=None) -> dict:
    """k client processes started together; images/s summed over them. Each must say "ready" within ``timeout``
    seconds and finish within ``seconds`` + 60 s, else every client is killed and a ``runtime.CourseError`` says
    which one and how its stderr ends. ``client``: the client function the processes run (``client_command``;
    by default this module's); ``cmd``: a whole command line instead. ``--plan``, ``--batch`` and ``--seconds``
    are appended."""
    if cmd is not None and client is not None:
        raise runtime.CourseInputError("give the client as a function (client=) or as a command line (cmd=), not both")
    cmd = list(cmd or client_command(client)) + ["--plan", plan_path, "--batch", str(batch), "--seconds", str(seconds)]
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


# ------------------------------------------------------------------------------ requests and the batcher

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


def batcher_table(service, rates, waits_ms=(0.0, 0.25, 1.0, 4.0), max_batch: int = 256, count: int = 4000,
                  batcher=None) -> list:
    """For every rate: one request at a time (no batching: max batch 1), then the dynamic batcher at every
    maximum wait; p50/p99 latency, requests served a second, mean batch, and the share of the time the GPU
    was busy (what is left is capacity for other work). ``batcher``: the batching rule (by default
    batching.dynamic_batching; a notebook passes its own cell's)."""
    batcher = batcher or B.dynamic_batching
    rows = []
    for rate in rates:
        t = B.poisson_arrivals(rate, count, seed=int(rate))
        for mb, w in [(1, 0.0)] + [(max_batch, w) for w in waits_ms]:
            r = batcher(t, service, max_batch=mb, max_wait=w / 1e3)
            lat = r["latency_s"] * 1e3
            rows.append({"rate_per_s": rate, "max_batch": mb, "max_wait_ms": w,
                         "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
                         "throughput_per_s": r["throughput_per_s"], "mean_batch": float(np.mean(r["batch_sizes"])),
                         "gpu_busy": r["busy_s"] / r["span_s"] if r["span_s"] > 0 else 1.0})
    return rows


def main(argv=None, *, client_fn=None) -> int:
    """The client process's entry point: run ``client_fn`` (by default this module's ``client``) with the options,
    and print its result as one line of JSON."""
    p = argparse.ArgumentParser(prog="python -m systems.feeding_the_gpu.serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("client", help="one client process (run_clients starts them)")
    c.add_argument("--plan", required=True)
    c.add_argument("--batch", type=int, default=1)
    c.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args(argv)
    print(json.dumps((client_fn or client)(args.plan, args.batch, args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Lesson 7's measurements on a machine with k >= 2 GPUs, and the figures drawn from them (measured or recorded).

Record on a GPU machine with the defaults (``python -m gpucourse record 07_collectives``) or choose the ring
sizes k, the chunk counts S and the sizes N (bytes):

    python -m benchmarks.collectives --k 2 4 8 --S 1 2 4 8 16 32 64 --N 1048576 67108864 1073741824

Each k uses the first k GPUs. A record keeps one entry per k: recording k = 8 on a larger machine adds to the
k = 2 of an earlier record of the same GPU model instead of replacing it. Every bandwidth here is the
*algorithm bandwidth* N / t: the bytes a rank receives over the time the whole collective takes.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from gpucourse import bench, plots, records, runtime
from gpucourse.records import Figure
from kernels import collectives as col

LESSON = "07_collectives"
GPUS = 2  # a ring needs two GPUs at least
ROOT = Path(__file__).resolve().parents[1]
# The host's time to queue one message (a peer copy and an event from Python) is a few µs; before timing the GPUs
# alone, bench.time_gpu holds them back this long per message queued (at least 2 ms), so that everything is queued
# before they start.
HOLD_MS_PER_MESSAGE = 0.02
COPY_SIZES = tuple(2**p for p in range(12, 31, 2))  # one peer copy, 4 KiB .. 1 GiB: a copy's fixed cost and B


# ------------------------------------------------------------------------------- the machine

def topology() -> str:
    """`nvidia-smi topo -m`: how every pair of GPUs is connected (NV# = that many NVLinks, PIX/PXB/PHB/SYS =
    PCIe paths of growing length)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "nvidia-smi not found"
    try:
        out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30)
        return re.sub(r"\x1b\[[0-9;]*m", "", out.stdout).strip() or out.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi topo -m failed: {exc}"


def link_types(topo: str, devices) -> dict:
    """{"GPU0->GPU1": "NV18", ...} for the links of the ring devices[0] -> devices[1] -> ... , read off the
    topology matrix."""
    rows = {}
    for line in topo.splitlines():
        cells = line.split()
        if cells and re.fullmatch(r"GPU\d+", cells[0]):
            rows[cells[0]] = cells[1:]
    out = {}
    for a, b in zip(devices, devices[1:]):
        row = rows.get(f"GPU{a}")
        out[f"GPU{a}->GPU{b}"] = row[b] if row is not None and b < len(row) else "unknown"
    return out


def system(devices) -> dict:
    cp = runtime.cupy()
    names = []
    for d in devices:
        name = cp.cuda.runtime.getDeviceProperties(d)["name"]
        names.append(name.decode() if isinstance(name, bytes) else name)
    topo = topology()
    from cupy.cuda import nccl

    return {"gpu_count": cp.cuda.runtime.getDeviceCount(), "devices": list(devices), "names": names,
            "topology": topo, "links": link_types(topo, devices),
            "peer_access": {f"{a}->{b}": v for (a, b), v in col.enable_peer_access(devices).items()},
            "nccl_version": nccl.get_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


# ----------------------------------------------------------------------------------- helpers

def _buffers(devices, nbytes: int, *, seed: int = 0):
    """Rank 0: random float32 values; every other rank: NaN. Returns (buffers, the root's values on each GPU)."""
    cp = runtime.cupy()
    n = nbytes // 4
    bufs, refs = [], []
    with cp.cuda.Device(devices[0]):
        root = cp.random.RandomState(seed).random_sample(n, dtype=cp.float32)
    for d in devices:
        with cp.cuda.Device(d):
            runtime.check_fits(2 * n * 4, f"two {nbytes / 2**20:.0f} MiB buffers on GPU {d}")
            if d == devices[0]:
                refs.append(root)
                bufs.append(root.copy())
            else:
                ref = cp.empty_like(root)  # allocated on GPU d, filled by a peer copy
                col.peer_copy(ref, root)
                refs.append(ref)
                bufs.append(cp.full(n, cp.nan, cp.float32))
            cp.cuda.Device(d).synchronize()
    return bufs, refs


def _check_equal(bufs, refs, what: str) -> None:
    cp = runtime.cupy()
    for r, (b, ref) in enumerate(zip(bufs, refs)):
        with cp.cuda.Device(b.device.id):
            if not bool(cp.array_equal(b, ref)):
                raise runtime.CourseError(f"{what}: rank {r} (GPU {b.device.id}) does not hold the right data; "
                                          "not timing it")


def _poison(bufs) -> None:
    cp = runtime.cupy()
    for b in bufs[1:]:
        with cp.cuda.Device(b.device.id):
            b.fill(cp.nan)
    for b in bufs:
        cp.cuda.Device(b.device.id).synchronize()


def _repeats(nbytes: int) -> int:
    return 20 if nbytes >= 2**26 else 50


# ------------------------------------------------------------------------------- measurements

def _hold_ms(k: int, S: int) -> float:
    return max(2.0, HOLD_MS_PER_MESSAGE * (k - 1) * S)


def _host_us(ring: col.GpuRing, bufs, S: int, k: int, repeats: int = 5) -> float:
    """Median wall time (µs) the host takes to queue one broadcast of S messages, the GPUs held back meanwhile."""
    import time

    cp = runtime.cupy()
    out = []
    for _ in range(repeats):
        ring.synchronize()
        bench.hold(_hold_ms(k, S), cp.cuda.get_current_stream())
        t = time.perf_counter()
        ring.broadcast(bufs, S)
        out.append(time.perf_counter() - t)
        ring.synchronize()
    return float(np.median(out)) * 1e6


def copy_sweep(devices, sizes=COPY_SIZES) -> dict:
    """One cudaMemcpyPeerAsync from GPU devices[0] to devices[1] against its size, the GPUs held back until it is
    queued: the fixed cost of a copy (what a small one takes) and the link's bandwidth (what a large one reaches)."""
    cp = runtime.cupy()
    with cp.cuda.Device(devices[0]):
        src = cp.random.random(max(sizes) // 4, dtype=cp.float32)
        with cp.cuda.Device(devices[1]):
            dst = cp.full(src.size, cp.nan, dtype=cp.float32)
        ms = [bench.time_gpu(lambda: col.peer_copy(dst[:n // 4], src[:n // 4]), repeats=_repeats(n), hold_ms=2.0).median_ms
              for n in bench.progress(sizes, desc="one peer copy")]
        if not bool(cp.array_equal(cp.asarray(dst.get()), cp.asarray(src.get()))):
            raise runtime.CourseError("the peer copy delivered other data")
    return {"N": list(sizes), "ms": ms}


def broadcast_sweep(devices, sizes, chunks, *, nccl: col.Nccl, ring: col.GpuRing) -> dict:
    """Time against S for every N (the course's ring): as a program runs it, the host queueing while the GPUs work
    ("ring_ms"), and the GPUs' own time, held back until the host has queued everything ("ring_gpu_ms"); the
    host's time to queue it ("host_us"); NCCL's broadcast and one peer copy at every N. Each result is checked
    before it is timed (destinations filled with NaN first)."""
    cp = runtime.cupy()
    k = len(devices)
    out = {"N": list(sizes), "S": list(chunks), "ring_ms": [], "ring_gpu_ms": [], "host_us": [], "nccl_ms": [],
           "peer_copy_ms": []}
    with cp.cuda.Device(devices[0]):
        for nbytes in bench.progress(sizes, desc=f"broadcast sizes, k={len(devices)}"):
            bufs, refs = _buffers(devices, nbytes)
            reps = _repeats(nbytes)
            row, row_gpu, row_host = [], [], []
            for S in chunks:
                if S > bufs[0].size:
                    row.append(None), row_gpu.append(None), row_host.append(None)
                    continue
                _poison(bufs)
                ring.broadcast(bufs, S)
                ring.synchronize()
                _check_equal(bufs, refs, f"ring broadcast S={S} N={nbytes}")
                row.append(bench.time_gpu(lambda: ring.broadcast(bufs, S), repeats=reps).median_ms)
                row_gpu.append(bench.time_gpu(lambda: ring.broadcast(bufs, S), repeats=reps,
                                              hold_ms=_hold_ms(k, S)).median_ms)
                row_host.append(_host_us(ring, bufs, S, k))
            out["ring_ms"].append(row)
            out["ring_gpu_ms"].append(row_gpu)
            out["host_us"].append(row_host)
            _poison(bufs)
            nccl.broadcast(bufs)
            nccl.synchronize()
            _check_equal(bufs, refs, f"NCCL broadcast N={nbytes}")
            out["nccl_ms"].append(bench.time_gpu(lambda: nccl.broadcast(bufs), repeats=reps).median_ms)
            out["peer_copy_ms"].append(bench.time_gpu(lambda: col.peer_copy(bufs[1], bufs[0]), repeats=reps).median_ms)
            bufs = refs = None
            cp.get_default_memory_pool().free_all_blocks()
    return out


def headline(devices, nbytes: int, S: int, *, nccl: col.Nccl, ring: col.GpuRing) -> dict:
    """Ring (at S), NCCL and a peer copy of ``nbytes`` timed in turn, five rounds (bench.interleaved)."""
    cp = runtime.cupy()
    with cp.cuda.Device(devices[0]):
        bufs, refs = _buffers(devices, nbytes)
        _poison(bufs)
        ring.broadcast(bufs, S)
        ring.synchronize()
        _check_equal(bufs, refs, "ring broadcast")
        launches = {"ring": lambda: ring.broadcast(bufs, S), "nccl": lambda: nccl.broadcast(bufs),
                    "peer_copy": lambda: col.peer_copy(bufs[1], bufs[0])}
        # No hold kernel: it would hold GPU 0 only, and each call here takes milliseconds anyway.
        t = bench.interleaved(launches, rounds=5, repeats=4, batch=4, hold_gpu=False)
        bufs = refs = None
        cp.get_default_memory_pool().free_all_blocks()
    res = {name: {**tm.summary(), "gbps": tm.gbps(nbytes)} for name, tm in t.items()}
    return {"N": nbytes, "S": S, **res, "ring_over_nccl": res["ring"]["gbps"] / res["nccl"]["gbps"]}


# The course's ring all-reduce in each of its versions: record key -> (label, GpuRing.allreduce's options).
ALLREDUCE_VARIANTS = {
    "copy_add": ("copy + add, step by step", {"method": "copy-add"}),
    "pull": ("pull kernels, step by step", {"method": "pull", "graph": False}),
    "pull_graph": ("pull kernels, one CUDA graph", {"method": "pull"}),
    "pull_graph_copy_kernel": ("pull kernels, copy kernels, one CUDA graph", {"method": "pull", "gather": "kernel"}),
}


def allreduce_sweep(devices, sizes, *, nccl: col.Nccl, ring: col.GpuRing, variants=tuple(ALLREDUCE_VARIANTS)) -> dict:
    """Each version of the course's ring all-reduce (ALLREDUCE_VARIANTS) and NCCL's, at every size: medians in
    ``ms[variant]`` and ``nccl_ms``, and each version's time over NCCL's in ``over_nccl[variant]``. Every version
    is checked against the sum first (float32, relative 1e-5), twice on fresh data, so that a graph's replay is
    checked as well as the call that records it."""
    cp = runtime.cupy()
    k = len(devices)
    out = {"N": list(sizes), "variants": list(variants), "ms": {v: [] for v in variants}, "nccl_ms": [],
           "over_nccl": {v: [] for v in variants}, "max_rel_error": []}
    with cp.cuda.Device(devices[0]):
        for nbytes in bench.progress(sizes, desc=f"all-reduce sizes, k={k}"):
            n = nbytes // 4
            host = [np.random.default_rng(r).random(min(n, 2**22), dtype=np.float32) for r in range(k)]
            inputs, bufs = [], []
            for d, h in zip(devices, host):
                with cp.cuda.Device(d):
                    runtime.check_fits(4 * n * 4, f"four {nbytes / 2**20:.0f} MiB buffers on GPU {d}")
                    inputs.append(cp.tile(cp.asarray(h), -(-n // h.size))[:n].copy())
                    bufs.append(cp.empty_like(inputs[-1]))
            want = np.sum(host, axis=0, dtype=np.float64).astype(np.float32)  # one period of the tiling

            def fresh():
                for d, b, x in zip(devices, bufs, inputs):
                    with cp.cuda.Device(d):
                        b[...] = x
                        cp.cuda.Device(d).synchronize()

            err = 0.0
            for v in variants:
                for _ in range(2):
                    fresh()
                    ring.allreduce(bufs, **ALLREDUCE_VARIANTS[v][1])
                    ring.synchronize()
                    for d, b in zip(devices, bufs):
                        with cp.cuda.Device(d):
                            w = cp.tile(cp.asarray(want), -(-n // want.size))[:n]
                            err = max(err, float(cp.abs(b - w).max() / cp.abs(w).max()))
                            del w
                if not err <= 1e-5:
                    raise runtime.CourseError(f"ring all-reduce ({ALLREDUCE_VARIANTS[v][0]}) of {nbytes} bytes is "
                                              f"wrong (error {err:.2e})")
            reps = _repeats(nbytes)
            for v in variants:
                options = ALLREDUCE_VARIANTS[v][1]
                out["ms"][v].append(bench.time_gpu(lambda: ring.allreduce(bufs, **options), repeats=reps).median_ms)
            out["nccl_ms"].append(bench.time_gpu(lambda: nccl.allreduce(bufs), repeats=reps).median_ms)
            for v in variants:
                out["over_nccl"][v].append(out["ms"][v][-1] / out["nccl_ms"][-1])
            out["max_rel_error"].append(err)
            bufs = inputs = None
            cp.get_default_memory_pool().free_all_blocks()
    return out


def allreduce_times(entry: dict) -> dict:
    """{variant: (label, ms at every N, time / NCCL's at every N)} of a record's all-reduce sweep. A record
    made before the ring had more than one version holds the first one only ("ring_ms": copy + add)."""
    a = entry["allreduce"]
    ms = a["ms"] if "ms" in a else {"copy_add": a["ring_ms"]}
    return {v: (ALLREDUCE_VARIANTS[v][0] if v in ALLREDUCE_VARIANTS else v, t,
                [x / c for x, c in zip(t, a["nccl_ms"])]) for v, t in ms.items()}


def gradient_check(devices, *, ring: col.GpuRing, batch: int = 512, seed: int = 0) -> dict:
    """Data parallelism: each GPU takes batch / k examples of one batch, computes its gradients, the ring
    all-reduce sums them and each GPU divides by k. Compared with the gradients of the whole batch on one GPU."""
    cp = runtime.cupy()
    k = len(devices)
    rng = np.random.default_rng(seed)
    X, Y = rng.standard_normal((batch, 16)), rng.standard_normal((batch, 4))
    with cp.cuda.Device(devices[0]):
        params = col.mlp_init(xp=cp, seed=seed)
        full = col.flatten(col.mlp_gradients(params, cp.asarray(X), cp.asarray(Y))).get()
    flats = []
    for r, d in enumerate(devices):
        lo, hi = col.chunk_bounds(batch, k, r)
        with cp.cuda.Device(d):
            p = {name: cp.asarray(v.get()) for name, v in params.items()}  # a copy of the weights on GPU d
            flats.append(col.flatten(col.mlp_gradients(p, cp.asarray(X[lo:hi]), cp.asarray(Y[lo:hi]))))
            cp.cuda.Device(d).synchronize()  # the all-reduce waits for GPU devices[0]'s stream, not GPU d's
    with cp.cuda.Device(devices[0]):
        ring.allreduce(flats)
        ring.synchronize()
    errs = [float(np.abs(f.get() / k - full).max() / np.abs(full).max()) for f in flats]
    return {"batch": batch, "parameters": int(full.size), "max_rel_error": max(errs)}


def measure_k(k: int, *, chunks, sizes, headline_bytes: int = 2**30) -> dict:
    """Everything for a ring of the first k GPUs."""
    devices = list(range(k))
    ring = col.GpuRing(devices)
    nccl = col.Nccl(devices)
    out = {"system": system(devices)}
    out["copy"] = copy_sweep(devices)
    out["broadcast"] = broadcast_sweep(devices, sizes, chunks, nccl=nccl, ring=ring)
    i = out["broadcast"]["N"].index(headline_bytes) if headline_bytes in sizes else len(sizes) - 1
    ring_row = out["broadcast"]["ring_ms"][i]
    best = min((t, S) for t, S in zip(ring_row, chunks) if t is not None)[1]
    out["headline"] = headline(devices, out["broadcast"]["N"][i], best, nccl=nccl, ring=ring)
    out["fit"] = fit_broadcast(out["broadcast"], k)
    out["allreduce"] = allreduce_sweep(devices, [n for n in sizes if n >= 2**20], nccl=nccl, ring=ring)
    out["gradients"] = gradient_check(devices, ring=ring)
    return out


def gpu_times(sweep: dict) -> tuple:
    """(the key of the GPUs' own times, a note): "ring_gpu_ms" where the record has them, else "ring_ms" (records made
    before the lesson held the GPUs back, where the host's queueing is in every time)."""
    if sweep.get("ring_gpu_ms"):
        return "ring_gpu_ms", "the GPUs' own time (held back until the host had queued every message)"
    return "ring_ms", "as the program ran it (this record has no GPU-only times: the host's queueing is in them)"


def fit_broadcast(sweep: dict, k: int, *, startup: bool = True, times: str | None = None) -> dict:
    """alpha and B (and with ``startup`` the fixed cost t0 of a broadcast) of the model fitted to every measured
    (S, N) point of the ring (``times``: the sweep's key; the GPUs' own times by default), the largest distance of a
    measured time from the model, overall, at each N and over N >= 16 MiB, and the best S at each N, measured and
    predicted."""
    times = times or gpu_times(sweep)[0]
    S, N, t = [], [], []
    for n, row in zip(sweep["N"], sweep[times]):
        for s, ms in zip(sweep["S"], row):
            if ms is not None:
                S.append(s), N.append(n), t.append(ms * 1e-3)
    fit = col.fit_ring_model(k, S, N, t, startup=startup)
    per_n = {}
    for n in sweep["N"]:
        errs = [abs(e) for e, nn in zip(fit["rel_error"], N) if nn == n]
        per_n[str(n)] = max(errs) if errs else None
    big = [e for e, nn in zip(fit["rel_error"], N) if nn >= 16 * 2**20]
    out = {"k": k, "times": times, "alpha_s": fit["alpha_s"], "bandwidth": fit["bandwidth"], "pinned": fit["pinned"],
           "startup_s": fit["startup_s"], "max_abs_rel_error": fit["max_abs_rel_error"],
           "max_abs_rel_error_by_N": per_n, "max_abs_rel_error_16MiB_up": max(map(abs, big)) if big else None}
    best = {}
    for n, row in zip(sweep["N"], sweep[times]):
        pts = [(s, ms) for s, ms in zip(sweep["S"], row) if ms is not None]
        if pts:
            measured = min(pts, key=lambda p: p[1])[0]
            predicted = min((p[0] for p in pts), key=lambda s: model_ms(out, n, k, s))
            steps = abs(sweep["S"].index(measured) - sweep["S"].index(predicted))
            best[str(n)] = {"measured": measured, "model": predicted, "steps_apart": steps}
    out["best_S"] = best
    return out


def fit_host_pacing(sweep: dict, k: int) -> dict | None:
    """The host's cost to queue one message (a copy and an event from Python), from the measured queueing times;
    None for records without them."""
    if not sweep.get("host_us"):
        return None
    S, t = [], []
    for row in sweep["host_us"]:
        for s, us in zip(sweep["S"], row):
            if us is not None:
                S.append(s), t.append(us * 1e-6)
    return col.fit_host(k, S, t)


def model_ms(fit: dict, N: float, k: int, S: int) -> float:
    """The fitted model's time in ms: t0 (if fitted) + (S + k - 2)(alpha + N / (S B))."""
    return 1e3 * col.ring_time(N, fit["bandwidth"], k, S, fit["alpha_s"], fit.get("startup_s", 0.0))


def host_paced_ms(fit: dict, host: dict, N: float, k: int, S: int) -> float:
    """The model with the host's pace (``host_paced_time``): what a program that queues as the GPUs run sees."""
    return 1e3 * col.host_paced_time(N, fit["bandwidth"], k, S, fit["alpha_s"], fit.get("startup_s", 0.0),
                                     host["host_s"], host["host_t0"])


def measure_runs(ks=None, chunks=None, sizes=None) -> dict:
    """Every measurement of the lesson for each k in ks (default: every GPU of this machine), merged with the
    entries for other k of this GPU model's newest record: {str(k): measure_k(k)}."""
    n_gpus = col.gpu_count()
    ks = list(ks or [n_gpus])
    if n_gpus < 2 or max(ks) > n_gpus or min(ks) < 2:
        raise runtime.CourseError(f"lesson 7 records rings of 2 or more GPUs; this machine has {n_gpus}, "
                                  f"asked for k = {ks}")
    chunks = list(chunks or runtime.size("collectives.chunks"))
    sizes = list(sizes or runtime.size("collectives.sizes"))
    old = records.latest(LESSON, runtime.get().device["name"])
    runs = {}
    for k, entry in (old["figures"].get("runs", {}) if old else {}).items():  # other k: kept, saying whence
        runs[k] = {**entry, "recorded_label": entry.get("recorded_label") or records.label(old, "runs")}
    for k in ks:
        runs[str(k)] = measure_k(k, chunks=chunks, sizes=sizes)
    return dict(sorted(runs.items(), key=lambda kv: int(kv[0])))


# -------------------------------------------------------------------------------- text and plots

def summary_text(entry: dict) -> str:
    sysinfo, h = entry["system"], entry["headline"]
    k = len(sysinfo["devices"])
    b = entry["broadcast"]
    fit, seed = fit_broadcast(b, k), fit_broadcast(b, k, startup=False)
    links = ", ".join(f"{a} {b_}" for a, b_ in sysinfo["links"].items())
    lines = [f"k = {len(sysinfo['devices'])}: {', '.join(sysinfo['names'])}; links {links}; "
             f"NCCL {sysinfo['nccl_version']}; {sysinfo['date']}",
             f"broadcast of {h['N'] / 2**30:.3g} GiB: ring (S = {h['S']}) {h['ring']['gbps']:.0f} GB/s, "
             f"NCCL {h['nccl']['gbps']:.0f} GB/s, one peer copy {h['peer_copy']['gbps']:.0f} GB/s; "
             f"ring / NCCL = {h['ring_over_nccl']:.2f}",
             f"ring times: {gpu_times(b)[1]}",
             f"the lecture's model (S + k - 2)(alpha + N/(SB)) fitted to every (S, N): alpha = {seed['alpha_s'] * 1e6:.1f} µs "
             f"a message, B = {seed['bandwidth'] / 1e9:.0f} GB/s",
             f"with the fixed cost t0 of a broadcast: t0 = {fit['startup_s'] * 1e6:.1f} µs, alpha = "
             f"{fit['alpha_s'] * 1e6:.2f} µs, B = {fit['bandwidth'] / 1e9:.0f} GB/s",
             *[f"    ({name} held at 0 in the fit {which}: the best fit wanted it negative, which no time can be)"
               for which, f in (("without t0", seed), ("with t0", fit)) for name in f.get("pinned", [])],
             "    largest distance of a measured time (any S) from the model, without t0 / with t0; best S measured / "
             "predicted:"]
    for n, e in seed["max_abs_rel_error_by_N"].items():
        bs = fit["best_S"].get(n, {})
        lines.append(f"    N = {int(n) / 2**20:6.0f} MiB: {100 * e:5.1f}% / {100 * fit['max_abs_rel_error_by_N'][n]:5.1f}%"
                     f"   best S {bs.get('measured')} / {bs.get('model')}")
    if fit["max_abs_rel_error_16MiB_up"] is not None:
        lines.append(f"    N >= 16 MiB: within {100 * fit['max_abs_rel_error_16MiB_up']:.1f}% with t0 (goal 15%)")
    host = fit_host_pacing(b, k)
    if host:
        lines.append(f"the host queues a message (copy + event) in {host['host_s'] * 1e6:.1f} µs (+ "
                     f"{host['host_t0'] * 1e6:.0f} µs a broadcast): past S = "
                     f"{max(1, round((fit['alpha_s']) / max(host['host_s'] - fit['alpha_s'], 1e-12)))} or so the GPUs "
                     "wait for Python")
    ar, versions = entry["allreduce"], allreduce_times(entry)
    lines.append("all-reduce (sum, float32): time, and in brackets ring / NCCL time, of each version of the ring:")
    for v, (label, _, _) in versions.items():
        lines.append(f"    {v}: {label}")
    width = [max(16, len(v)) for v in versions]
    lines.append(f"    {'N':>8} {'NCCL':>9}  " + " ".join(f"{v:>{w}}" for v, w in zip(versions, width)))
    for i, (n, c) in enumerate(zip(ar["N"], ar["nccl_ms"])):
        cells = [f"{bench.format_ms(t[i])} ({r[i]:.2f})" for _, t, r in versions.values()]
        lines.append(f"    {n / 2**20:4.0f} MiB {bench.format_ms(c):>9}  " + " ".join(f"{x:>{w}}" for x, w in zip(cells, width)))
    g = entry["gradients"]
    lines.append(f"gradients of {g['parameters']} parameters averaged over {len(sysinfo['devices'])} GPUs against "
                 f"one GPU's whole batch: max relative error {g['max_rel_error']:.1e}")
    return plots.wrap("\n".join(lines))


def sources_line(entries: dict) -> str:
    """One line per ring size: where its figures come from ({k: (entry, source)})."""
    return "\n".join(plots.wrap(f"k = {k}: {source}") for k, (_, source) in sorted(entries.items()))


def headline_table(entries: dict):
    """The broadcast of the headline size for every ring size ({k: (entry, source)}): the course's ring at its best S,
    NCCL's broadcast and one peer copy, as algorithm bandwidth N / t."""
    rows = []
    for k, (entry, _) in sorted(entries.items()):
        h = entry["headline"]
        links = ", ".join(sorted(set(entry["system"]["links"].values())))
        rows.append([k, links, h["S"], h["ring"]["gbps"], h["nccl"]["gbps"], h["peer_copy"]["gbps"],
                     f"{h['ring_over_nccl']:.2f}"])
    size = next(iter(entries.values()))[0]["headline"]["N"]
    return plots.table(["k", "links", "best S", "ring GB/s", "NCCL GB/s", "one peer copy GB/s", "ring / NCCL"], rows,
                       title=f"Broadcast of {size / 2**30:.3g} GiB (N / time)")


def topology_text(entry: dict) -> str:
    """``nvidia-smi topo -m`` as recorded or read here, its long legend lines wrapped."""
    return plots.wrap(entry["system"]["topology"].expandtabs(8).rstrip())


def fit_table(entry: dict, source: str, *, startup: bool = True):
    """Measured time over the fitted model's at every (N, S) of the broadcast sweep: 1.00 is the model exactly."""
    b, k = entry["broadcast"], len(entry["system"]["devices"])
    times = gpu_times(b)[0]
    fit = fit_broadcast(b, k, startup=startup)
    rows = [[f"{n / 2**20:.0f} MiB"] + ["" if t is None else f"{t / model_ms(fit, n, k, S):.2f}"
                                        for S, t in zip(b["S"], row)] for n, row in zip(b["N"], b[times])]
    what = (f"t0 = {fit['startup_s'] * 1e6:.1f} µs, " if startup else "") + \
        f"alpha = {fit['alpha_s'] * 1e6:.2f} µs, B = {fit['bandwidth'] / 1e9:.0f} GB/s"
    return plots.table(["N"] + [f"S = {S}" for S in b["S"]], rows, source=source,
                       title=f"k = {k}: measured / model ({what})")


def fit_errors_table(entry: dict, source: str):
    """At every N: the largest distance of a measured time (any S) from the model fitted without and with t0, and
    the best S measured and predicted (with t0), and how many steps apart they are in the S swept."""
    b, k = entry["broadcast"], len(entry["system"]["devices"])
    fit, seed = fit_broadcast(b, k), fit_broadcast(b, k, startup=False)
    rows = []
    for n, e in seed["max_abs_rel_error_by_N"].items():
        bs = fit["best_S"].get(n, {})
        rows.append([f"{int(n) / 2**20:.0f} MiB", f"{100 * e:.1f}%", f"{100 * fit['max_abs_rel_error_by_N'][n]:.1f}%",
                     bs.get("measured"), bs.get("model"), bs.get("steps_apart")])
    return plots.table(["N", "largest distance, no t0", "with t0", "best S measured", "predicted", "steps apart"],
                       rows, title=f"k = {k}: the model against every measured time", source=source)


def record_ceilings(entries: dict) -> tuple:
    """(ceilings, source) that belong with the ring's figures: this GPU's where the figures were measured here,
    else those of the newest record that holds them (the GPU the times come from)."""
    if runtime.is_gpu() and col.gpu_count() >= GPUS:
        return records.ceilings_or_recall(LESSON)
    recs = [r for r in records.all_records(LESSON) if "runs" in r["figures"]]
    if runtime.is_gpu():
        mine = [r for r in recs if records.slug(r["gpu"]["name"]) == records.slug(runtime.get().device["name"])]
        recs = mine or recs
    return recs[-1]["ceilings"], records.label(recs[-1])


def pass_model_table(entry: dict, source: str, M: float):
    """The all-reduce's bytes alone (``col.allreduce_pass_times``, B the headline's one peer copy, M the GPU's
    device-to-device copy) beside NCCL's and every measured version's time, at every N."""
    k = len(entry["system"]["devices"])
    B = entry["headline"]["peer_copy"]["gbps"] * 1e9
    a, versions = entry["allreduce"], allreduce_times(entry)
    rows = []
    for i, n in enumerate(a["N"]):
        model = col.allreduce_pass_times(n, B, M, k)
        rows.append([f"{n / 2**20:.0f} MiB", bench.format_ms(1e3 * model["copy-add"]), bench.format_ms(1e3 * model["pull"]),
                     bench.format_ms(a["nccl_ms"][i])] + [bench.format_ms(t[i]) for _, t, _ in versions.values()])
    return plots.table(["N", "model copy+add", "model pull", "NCCL"] + list(versions), rows, source=source,
                       title=f"k = {k}: all-reduce times, the bytes alone (B = {B / 1e9:.0f}, M = {M / 1e9:.0f} GB/s) "
                             "and measured")


def scale_out_table(params: dict):
    """Ring and tree all-reduce times on 1 to 128 nodes of 8 GPUs at 1 MiB, 64 MiB and 1 GiB, and the size above
    which the ring wins (``col.ring_tree_crossover``)."""
    rows = []
    for nodes in (1, 2, 4, 8, 16, 32, 64, 128):
        row = [nodes, 8 * nodes]
        for N in (2**20, 2**26, 2**30):
            row += [bench.format_ms(1e3 * col.cluster_allreduce_time(N, nodes, a, **params)) for a in ("ring", "tree")]
        cross = col.ring_tree_crossover(nodes, **params)
        rows.append(row + ["always" if cross == 0 else f"{cross / 2**20:,.0f} MiB"])
    return plots.table(["nodes", "GPUs", "1 MiB ring", "tree", "64 MiB ring", "tree", "1 GiB ring", "tree",
                        "ring wins above"], rows, title="All-reduce across nodes of 8 GPUs, as NCCL's tuning model counts it")


def _pair_colours(fig, n: int):
    """Draw the i-th model line (dashed) in the colour of the i-th measured series."""
    ax = fig.axes[0]
    lines = ax.get_lines()
    for i in range(n):
        lines[n + i].set_color(lines[i].get_color())
    ax.legend(fontsize=7, ncol=2)
    return fig


def plot_model(N: float, B: float, ks=(2, 3, 4, 8), alpha: float = 0.0, S_max: int = 256, source: str = "the model"):
    """The cost model's time against S for several k (no measurement)."""
    S = np.unique(np.round(np.logspace(0, np.log2(S_max), 40, base=2)).astype(int))
    models = {f"k = {k}": (S, [1e3 * col.broadcast_time(N, B, k, int(s), alpha) for s in S]) for k in ks}
    fig = plots.lines({}, models=models, xlabel="S (messages)", ylabel="ms", source=source,
                      title=f"Ring broadcast of {N / 2**30:.3g} GiB at B = {B / 1e9:.0f} GB/s, "
                            f"alpha = {alpha * 1e6:.0f} µs")
    ax = fig.axes[0]
    if alpha > 0:
        for k in ks:
            s = col.best_chunks(N, B, k, alpha)
            ax.plot([s], [1e3 * col.broadcast_time(N, B, k, s, alpha)], "k*", ms=10)
    for k in ks:
        ax.axhline(1e3 * N / B, color="grey", lw=0.6, ls=":")
    return fig


def plot_vs_S(entry: dict, source: str, *, startup: bool = True):
    """Measured ring broadcast time against S at every N (the GPUs' own times where the record has them), with the
    fitted model as dashed lines (with the fixed cost t0 of a broadcast if ``startup``)."""
    b, k = entry["broadcast"], len(entry["system"]["devices"])
    times, what = gpu_times(b)
    fit = fit_broadcast(b, k, startup=startup)
    series, models = {}, {}
    for n, row in zip(b["N"], b[times]):
        pts = [(s, t) for s, t in zip(b["S"], row) if t is not None]
        label = f"{n / 2**20:.0f} MiB"
        series[f"measured, {label}"] = ([p[0] for p in pts], [p[1] for p in pts])
        models[f"model, {label}"] = ([p[0] for p in pts], [model_ms(fit, n, k, p[0]) for p in pts])
    t0 = f"{fit['startup_s'] * 1e6:.1f} µs + " if startup else ""
    return _pair_colours(plots.lines(series, models=models, xlabel="S (messages)", ylabel="ms", source=source,
                       title=f"Ring broadcast, k = {k} ({'GPU time' if times == 'ring_gpu_ms' else 'as run'}), model: {t0}"
                             f"(S + {k - 2})({fit['alpha_s'] * 1e6:.1f} µs + N / (S x {fit['bandwidth'] / 1e9:.0f} GB/s))"),
                         len(series))


def plot_host_pacing(entry: dict, source: str):
    """At each N, the broadcast as a program runs it (the host queueing while the GPUs work) against S, beside the
    GPUs' own time and the model with the host's pace: past a few messages the GPUs wait for Python."""
    b, k = entry["broadcast"], len(entry["system"]["devices"])
    fit, host = fit_broadcast(b, k), fit_host_pacing(b, k)
    if host is None:
        raise runtime.CourseError("this record has no host timings (recorded before the lesson measured them)")
    series, models = {}, {}
    for n, row, row_gpu in zip(b["N"], b["ring_ms"], b["ring_gpu_ms"]):
        if n not in (min(b["N"]), 2**26, max(b["N"])):
            continue
        pts = [(s, t, g) for s, t, g in zip(b["S"], row, row_gpu) if t is not None]
        label = f"{n / 2**20:.0f} MiB"
        series[f"as run, {label}"] = ([p[0] for p in pts], [p[1] for p in pts])
        models[f"model with the host's pace, {label}"] = ([p[0] for p in pts],
                                                          [host_paced_ms(fit, host, n, k, p[0]) for p in pts])
    fig = _pair_colours(plots.lines(series, models=models, xlabel="S (messages)", ylabel="ms", source=source,
                                    title=f"The host sets the pace: {host['host_s'] * 1e6:.1f} µs to queue a message, "
                                          f"the GPUs {fit['alpha_s'] * 1e6:.1f} µs to run one"), len(series))
    return fig


def plot_copy(entry: dict, source: str):
    """One peer copy's time against its size, with t(c) = t_copy + c / B: a copy's fixed cost and the link's
    bandwidth, the two numbers the model's t0, alpha and B stand on."""
    c = entry["copy"]
    fit = fit_broadcast(entry["broadcast"], len(entry["system"]["devices"]))
    small, big = c["ms"][0] * 1e-3, c["N"][-1] / (c["ms"][-1] * 1e-3)
    model = [1e3 * (small + n / big) for n in c["N"]]
    return plots.lines({"one cudaMemcpyPeerAsync": (c["N"], c["ms"])},
                       models={f"{small * 1e6:.1f} µs + N / {big / 1e9:.0f} GB/s": (c["N"], model)},
                       levels={"ring's fitted t0 (ms)": fit["startup_s"] * 1e3},
                       xlabel="bytes copied", ylabel="ms", source=source,
                       title="One peer copy: a fixed cost, then the link's bandwidth")


def scale_out_params(entry: dict) -> dict:
    """The scale-out model's parameters: NVLink's bandwidth and a step's cost from the ring fitted here; a NIC's
    bandwidth and a network step's cost from published sources (kernels.collectives.model)."""
    fit = fit_broadcast(entry["broadcast"], len(entry["system"]["devices"]))
    return {"nvlink_bw": fit["bandwidth"], "alpha_nvlink": fit["alpha_s"], "nic_bw": 47e9,
            "alpha_net": col.NCCL_NET_STEP_S}


def plot_scale_out(entry: dict, source: str, N: float = 512 * 2**20, nodes=(1, 2, 4, 8, 16, 32, 64, 128, 248)):
    """Predicted bus bandwidth of an all-reduce of N bytes against the number of nodes (8 GPUs each, 8 NICs of 400
    Gb/s), ring and tree, with the published readings of such clusters (kernels.collectives.PUBLISHED_BUSBW)."""
    params = scale_out_params(entry)
    series = {}
    models = {algo: (list(nodes), [col.bus_bandwidth(N, 8 * n, col.cluster_allreduce_time(N, n, algo, **params)) / 1e9
                                   for n in nodes]) for algo in ("ring", "tree")}
    for pub in col.PUBLISHED_BUSBW:
        lo, hi = pub["busbw_gbps"]
        series[f"published: {pub['what'][:48]}..."] = ([pub["nodes"]] * (2 if hi != lo else 1),
                                                       [lo, hi] if hi != lo else [lo])
    fig = plots.lines(series, models={f"model, {a}": v for a, v in models.items()}, xlabel="nodes of 8 GPUs",
                      ylabel="bus bandwidth (GB/s)", source=f"{source}; NIC and network step: published",
                      title=f"All-reduce of {N / 2**20:.0f} MiB across nodes: ring against tree", logy=False)
    return fig


def plot_vs_N(entry: dict, source: str):
    """Algorithm bandwidth N / t against N: one peer copy, NCCL, the ring at S = 1 and at its best S."""
    b, k = entry["broadcast"], len(entry["system"]["devices"])
    best = [min(t for t in row if t is not None) for row in b["ring_ms"]]
    s1 = [row[b["S"].index(1)] if 1 in b["S"] else None for row in b["ring_ms"]]
    series = {"one peer copy (cudaMemcpyPeerAsync)": (b["N"], [bench.gbps(n, t) for n, t in zip(b["N"], b["peer_copy_ms"])]),
              "NCCL broadcast": (b["N"], [bench.gbps(n, t) for n, t in zip(b["N"], b["nccl_ms"])]),
              "course ring, best S": (b["N"], [bench.gbps(n, t) for n, t in zip(b["N"], best)])}
    if all(t is not None for t in s1):
        series["course ring, S = 1"] = (b["N"], [bench.gbps(n, t) for n, t in zip(b["N"], s1)])
    return plots.lines(series, xlabel="N (bytes)", ylabel="GB/s (N / time)", source=source,
                       title=f"Broadcast over k = {k} GPUs: bandwidth against size")


def plot_headline(entry: dict, source: str):
    h = entry["headline"]
    return plots.bars({f"course ring, S = {h['S']}": h["ring"]["gbps"], "NCCL broadcast": h["nccl"]["gbps"]},
                      unit="GB/s", source=source, ceiling=("one peer copy", h["peer_copy"]["gbps"]),
                      title=f"Broadcast of {h['N'] / 2**30:.3g} GiB over k = {len(entry['system']['devices'])} GPUs")


def plot_allreduce(entry: dict, source: str):
    """Time against N: each version of the course's ring all-reduce, and NCCL's."""
    a, k = entry["allreduce"], len(entry["system"]["devices"])
    series = {f"ring: {label}": (a["N"], t) for label, t, _ in allreduce_times(entry).values()}
    series["NCCL all-reduce"] = (a["N"], a["nccl_ms"])
    return plots.lines(series, xlabel="N (bytes)", ylabel="ms", source=source,
                       title=f"All-reduce (sum, float32) over k = {k} GPUs")


def plot_allreduce_ratio(entry: dict, source: str):
    """Each version's time over NCCL's against N: 1 is NCCL's speed, 2 half of it."""
    a, k = entry["allreduce"], len(entry["system"]["devices"])
    from matplotlib.ticker import FuncFormatter, NullFormatter

    series = {f"ring: {label}": (a["N"], r) for label, _, r in allreduce_times(entry).values()}
    fig = plots.lines(series, xlabel="N (bytes)", ylabel="time / NCCL's time", source=source, levels={"NCCL": 1.0},
                      title=f"All-reduce over k = {k} GPUs: the ring's time over NCCL's")
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    ax.set_yticks([t for t in (0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3, 5, 10, 20, 50, 100) if low <= t <= high])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    return fig


def plot_simulation(k_runs: dict, source: str):
    """Simulated times (markers) against the model (dashed) for each k: {k: (S list, seconds, model seconds)}."""
    series = {f"simulated, k = {k}": (S, [1e3 * t for t in ts]) for k, (S, ts, _) in k_runs.items()}
    models = {f"model, k = {k}": (S, [1e3 * t for t in ms]) for k, (S, _, ms) in k_runs.items()}
    return _pair_colours(plots.lines(series, models=models, xlabel="S (messages)", ylabel="ms", source=source,
                                     title="Ring broadcast on simulated links against the model"), len(series))


# ----------------------------------------------------------------- the same programs under cluster launchers

LAUNCH_PROGRAM = "kernels.collectives.programs:nccl_allreduce_program"


def measure_launchers(k: int | None = None, n: int = 2**22, seed: int = 4) -> dict:
    """Lesson 7's NCCL all-reduce, one process per GPU, started by the course's launcher (gpucourse.ranks.launch)
    and by each cluster launcher this machine has; every rank's result compared with the course launcher's."""
    from gpucourse import ranks
    from kernels.collectives import programs

    k = k or col.gpu_count()
    if k < 2:
        raise runtime.CourseError(f"the launchers run one rank per GPU on two or more GPUs; this machine has {k}")
    want = ranks.launch(k, programs.nccl_allreduce_program, n, seed, timeout=120)
    return {"k": k, "n": n, **ranks.under_every_launcher(
        k, LAUNCH_PROGRAM, [n, seed], want, lambda g, w: np.abs(g["result"] - w["result"]).max(),
        env={"PYTHONPATH": str(ROOT)})}


def text_launchers(t: dict) -> str:
    from gpucourse import ranks

    return ranks.launchers_text(t, f"NCCL's all-reduce of {t['n']:,} float32 on {t['k']} GPUs, one process each")


def text_runs(runs: dict) -> str:
    return "\n\n".join(summary_text(entry) for _, entry in sorted(runs.items(), key=lambda kv: int(kv[0])))


FIGURES = {
    "runs": Figure(measure=measure_runs, text=text_runs, gpus=2),
    "launchers": Figure(measure=measure_launchers, text=text_launchers, optional=True, gpus=2),
}


# ---------------------------------------------------------------------------------- command line

def processes_allreduce(k: int, sizes, *, repeats: int = 10) -> dict:
    """NCCL's all-reduce with one process per GPU (gpucourse/ranks.py: rank 0's unique id through the launcher)
    against the same all-reduce from one process driving k GPUs, at each size; the course's ring across
    processes (CUDA IPC) checked for equality at the smallest size. Medians of CUDA-event times, the
    slowest rank's median for the processes."""
    from gpucourse import ranks
    from kernels.collectives import programs

    cp = runtime.cupy()
    devices = list(range(k))
    out = {"k": k, "N": list(sizes), "processes_ms": [], "one_process_ms": []}
    n0 = min(sizes) // 4
    want = programs.expected_sum(k, n0, seed=1)
    for name, fn in (("nccl", programs.nccl_allreduce_program), ("ipc_ring", programs.ipc_ring_allreduce_program)):
        got = ranks.launch(k, fn, n0, 1, timeout=120)
        err = max(float(np.abs(g["result"].astype(np.float64) - want).max()) for g in got)
        if not err <= 1e-5 * k * max(1.0, float(np.abs(want).max())):
            raise runtime.CourseError(f"{name} across {k} processes is wrong (error {err:.2e})")
        out[f"{name}_max_abs_error"] = err
    nccl = col.Nccl(devices)
    for nbytes in bench.progress(sizes, desc=f"all-reduce, {k} processes vs one"):
        n = nbytes // 4
        per_rank = ranks.launch(k, programs.nccl_allreduce_program, n, 2, repeats, timeout=300)
        out["processes_ms"].append(max(float(np.median(r["ms"])) for r in per_rank))
        bufs = []
        for d in devices:
            with cp.cuda.Device(d):
                bufs.append(cp.asarray(programs.rank_data(d, n, 2)))
        with cp.cuda.Device(devices[0]):
            out["one_process_ms"].append(bench.time_gpu(lambda: nccl.allreduce(bufs), repeats=repeats).median_ms)
        bufs = None
        cp.get_default_memory_pool().free_all_blocks()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.collectives", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, nargs="+", help="ring sizes (default: every GPU of this machine)")
    p.add_argument("--S", type=int, nargs="+", help="chunk counts (default: SIZES['collectives.chunks'])")
    p.add_argument("--N", type=int, nargs="+", help="sizes in bytes (default: SIZES['collectives.sizes'])")
    p.add_argument("--processes", action="store_true", help="only: NCCL's all-reduce with one process per GPU "
                   "(and the ring across processes) against one process driving every GPU; prints a table")
    args = p.parse_args(argv)
    runtime.setup("gpu")
    if args.processes:
        k = (args.k or [col.gpu_count()])[0]
        res = processes_allreduce(k, args.N or [2**20, 2**26, 2**30])
        print(f"all-reduce on {k} GPUs: one process per GPU vs one process, "
              f"ring across processes max error {res['ipc_ring_max_abs_error']:.1e}")
        for N, a, b in zip(res["N"], res["processes_ms"], res["one_process_ms"]):
            print(f"  {N / 2**20:8.0f} MiB  {a:9.3f} ms  {b:9.3f} ms  ratio {a / b:5.2f}")
        return 0
    figures = {"runs": measure_runs(args.k, args.S, args.N)}
    path = records.write(LESSON, figures, ceilings=bench.measure_ceilings().as_dict())
    for k, entry in figures["runs"].items():
        print(summary_text(entry))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# ------------------------------------------------------------------------------------ RESULTS.md

def results_rows(record: dict) -> list:
    """The lesson's headline figures in one record, for RESULTS.md and the README (gpucourse.results): the first row
    is the headline. Per ring of k GPUs recorded: the all-reduce's fastest version against NCCL's at the largest and
    smallest sizes, and the broadcast of the headline size."""
    from gpucourse import results as R

    rows = []
    for k, entry in sorted(record["figures"].get("runs", {}).items(), key=lambda kv: int(kv[0])):
        a = entry.get("allreduce", {})
        versions = allreduce_times(entry) if a else {}
        best = [min(r[i] for _, _, r in versions.values()) for i in range(len(a.get("N", [])))]

        def size(n):
            return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB"

        h = entry.get("headline", {})
        if best:
            rows.append((f"ring all-reduce of {size(a['N'][-1])}, {k} GPUs, time against NCCL's", R.ratio(best[-1]),
                         "runs"))
            rows.append((f"ring all-reduce of {size(a['N'][0])}, {k} GPUs, time against NCCL's", R.ratio(best[0]),
                         "runs"))
        if h:
            rows.append((f"ring broadcast of {size(h['N'])}, {k} GPUs, speed against NCCL's",
                         R.ratio(h.get("ring_over_nccl")), "runs"))
            rows.append((f"ring broadcast of {size(h['N'])}, {k} GPUs, GB/s", R.number(h["ring"]["gbps"]), "runs"))
    return rows or [("ring all-reduce, time against NCCL's", None, "runs")]

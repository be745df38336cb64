"""Lesson 9's measurements and the figures drawn from them, declared once in FIGURES (measured here on a GPU, else
recalled from the newest record):

    python -m gpucourse record 09_training                        # every figure: results/<gpu>/09_training.json
    python -m gpucourse record 09_training --figure data_parallel # one figure, into the newest record of this GPU

* mixed precision: one SGD step of a 16-layer MLP of width 4096 at batch 1024, strict FP32 (CuPy does not use
  TF32 unless CUPY_TF32=1) against FP16 tensor-core GEMMs with FP32 master weights and dynamic loss scaling;
  and the loss scale adapting on a small network (scaler_run);
* recomputation: a 64-layer MLP, checkpoint spacing s = 1 .. 64, peak memory above the weights and gradients
  (the CuPy memory pool's high-water mark) against step time; and the largest batch whose step runs in a memory
  budget, with s = 1 and s = 8, found by running steps in a capped memory pool;
* data parallelism: the same 16-layer step through ``DataParallel`` with NCCL all-reduces in buckets,
  against the same step with no communication, for every k this machine has (k = 1: the cost of the calls);
  ``scaling`` reads the weak-scaling efficiency T(1) / T(k) from them; and on one GPU, a stand-in for the
  all-reduces beside the step (overlap_standin).
"""
from __future__ import annotations

import math

import numpy as np

from gpucourse import bench, plots, records, runtime
from gpucourse.records import Figure
from kernels import training as tr

LESSON = "09_training"
GOALS = {"mixed_speedup": 2.0, "recompute_memory": 4.0, "recompute_time": 1.4, "scaling_efficiency_k8": 0.9}


def _batch(cp, n, d, classes, seed):
    rng = np.random.default_rng(seed)
    return (cp.asarray(rng.standard_normal((n, d), dtype=np.float32)),
            cp.asarray(rng.integers(0, classes, n).astype(np.int32)))


def _flops(widths, batch):
    return 3 * 2 * batch * sum(d * h for d, h in zip(widths[:-1], widths[1:]))


# ---------------------------------------------------------------------------------- mixed precision

def measure_mixed_precision(layers: int = 16, width: int = 4096, batch: int = 1024, repeats: int = 10, step=None,
                            scaler=None) -> dict:
    """One SGD step of a ``layers``-layer MLP of ``width`` at ``batch``: strict FP32 against the mixed-precision step
    (FP16 tensor-core GEMMs, FP32 master weights, dynamic loss scaling), the casts, unscaling and overflow check
    included. ``step`` and ``scaler``: the mixed-precision step and the loss scaler's class to time (by default
    tr.mixed_step and tr.LossScaler; a notebook passes its own cells')."""
    step, scaler = step or tr.mixed_step, scaler or tr.LossScaler
    cp = runtime.cupy()
    widths = [width] * (layers + 1)
    X, y = _batch(cp, batch, width, width, 1)
    master = tr.mlp_init(widths, xp=cp)
    half = tr.cast(master, cp.float16)
    loss_scaler = scaler(2.0**12, interval=10**9)

    def fp32_step():
        loss, g = tr.loss_and_grads(master, X, y)
        tr.sgd(master, g, 1e-3)
        float(loss)  # the mixed step reads its loss and overflow flag on the host: so does this one

    def mixed():
        step(master, X, y, loss_scaler, 1e-3, half=half)

    t32 = bench.time_gpu(fp32_step, repeats=repeats, warmup=2)
    t16 = bench.time_gpu(mixed, repeats=repeats, warmup=2)
    flops = _flops(widths, batch)
    return {"layers": layers, "width": width, "batch": batch,
            "fp32": t32.summary(), "mixed": t16.summary(),
            "fp32_tflops": t32.tflops(flops), "mixed_tflops": t16.tflops(flops),
            "speedup": t32.median_ms / t16.median_ms, "skipped_steps": loss_scaler.skipped}


def text_mixed_precision(m: dict) -> str:
    return (f"FP32 {bench.format_ms(m['fp32']['median_ms'])} ({m['fp32_tflops']:.1f} TFLOP/s); mixed "
            f"{bench.format_ms(m['mixed']['median_ms'])} ({m['mixed_tflops']:.0f} TFLOP/s): {m['speedup']:.2f}x "
            f"(goal >= {GOALS['mixed_speedup']:g}x)")


def plot_mixed_precision(m: dict, source: str):
    return plots.bars({"FP32 (CUDA cores)": m["fp32"]["median_ms"], "mixed FP16/FP32 (tensor cores)": m["mixed"]["median_ms"]},
                      unit="ms", source=source,
                      title=f"One SGD step, {m['layers']} layers of width {m['width']}, batch {m['batch']}: "
                            f"{m['speedup']:.2f}x")


# -------------------------------------------------------------------------- the loss scale adapting

def measure_scaler_run(steps: int = 150, seed: int = 3, step=None, scaler=None) -> dict:
    """A small network trained in mixed precision from a loss scale that is too large: the scale backs off,
    then grows every ``interval`` good steps until the next overflow. Also the share of FP16 gradients that
    underflow to zero with scale 1 and with scale 2^14. ``step`` and ``scaler``: the mixed-precision step and the
    loss scaler's class (by default tr.mixed_step and tr.LossScaler; a notebook passes its own cells')."""
    step, scaler = step or tr.mixed_step, scaler or tr.LossScaler
    cp = runtime.cupy()
    widths = [256, 512, 512, 512, 10]
    X, y = _batch(cp, 1024, 256, 10, seed)
    master = tr.mlp_init(widths, xp=cp, seed=seed)
    loss_scaler = scaler(2.0**24, interval=20)
    losses, applied = [], []
    for _ in range(steps):
        loss, ok = step(master, X, y, loss_scaler, 0.05)
        losses.append(loss)
        applied.append(bool(ok))
    small = tr.mlp_init([16, 32, 32, 32, 32, 4], xp=cp, seed=2)
    for W, _ in small:
        W *= 0.05
    Xs, ys = _batch(cp, 64, 16, 4, seed)
    under = {}
    for scale in (1.0, 2.0**14):
        _, g = tr.loss_and_grads(tr.cast(small, cp.float16), Xs, ys, loss_scale=scale)
        under[str(int(scale))] = tr.underflow_fraction(g)
    _, g32 = tr.loss_and_grads(small, Xs, ys)
    under["fp32"] = tr.underflow_fraction(g32)
    return {"loss": losses, "scale": loss_scaler.history, "applied": applied, "zero_fraction": under}


def text_scaler_run(run: dict) -> str:
    z = run["zero_fraction"]
    return (f"{run['applied'].count(False)} of {len(run['applied'])} steps skipped; scale {run['scale'][0]:g} -> "
            f"{run['scale'][-1]:g}\nFP16 gradient entries exactly zero: {z['1']:.1%} with loss scale 1, "
            f"{z[str(2**14)]:.1%} with 2^14 ({z['fp32']:.1%} in FP32)")


def plot_scaler_run(run: dict, source: str):
    plt = plots._plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(run["loss"], label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    ax2.semilogy(run["scale"][1:], color="tab:red", label="loss scale")
    skipped = [i for i, ok in enumerate(run["applied"]) if not ok]
    ax2.semilogy(skipped, [run["scale"][i + 1] for i in skipped], "x", color="black", label="skipped (overflow)")
    ax2.set_ylabel("loss scale")
    ax2.legend(fontsize=8, loc="upper right")
    return plots._finish(ax, "Dynamic loss scaling: back off on overflow, grow after good steps", source)


# ------------------------------------------------------------------------------------ recomputation

def measure_recompute(layers: int = 64, width: int = 2048, batch: int = 4096, spacings=None, repeats: int = 5) -> dict:
    """Checkpoint spacings s = 1 .. ``layers`` of a ``layers``-layer MLP of ``width`` at ``batch``: peak memory above
    the weights and gradients (the CuPy memory pool's high-water mark) against step time, and the batch the free
    memory would hold at each (an estimate: measure_largest_batch runs it)."""
    cp = runtime.cupy()
    pool = cp.get_default_memory_pool()
    widths = [width] * (layers + 1)
    n = layers
    spacings = list(spacings or sorted({1, 2, 4, 8, 16, 32, 64, int(round(math.sqrt(n)))} & set(range(1, n + 1))))
    X, y = _batch(cp, batch, width, width, 2)
    params = tr.mlp_init(widths, xp=cp)
    grads = [(cp.empty_like(W), cp.empty_like(b)) for W, b in params]
    out = {"layers": layers, "width": width, "batch": batch, "runs": {}}
    for s in spacings:
        def step():
            tr.loss_and_grads(params, X, y, checkpoint_every=s, out=grads)
            tr.sgd(params, grads, 1e-4)

        cp.cuda.Device().synchronize()
        pool.free_all_blocks()
        base = pool.used_bytes()
        step()
        cp.cuda.Device().synchronize()
        peak = pool.total_bytes() - base  # the pool keeps every block it handed out: its size is the high-water mark
        t = bench.time_gpu(step, repeats=repeats, warmup=1)
        out["runs"][str(s)] = {"peak_bytes": int(peak), "model_bytes": tr.activation_bytes(batch, widths, checkpoint_every=s),
                               "time": t.summary()}
    full = out["runs"]["1"]
    free = cp.cuda.runtime.memGetInfo()[0] + pool.total_bytes() - pool.used_bytes()
    for s, r in out["runs"].items():
        r["memory_saving"] = full["peak_bytes"] / r["peak_bytes"]
        r["time_ratio"] = r["time"]["median_ms"] / full["time"]["median_ms"]
        r["max_batch_estimate"] = int(0.9 * free / (r["peak_bytes"] / batch))
    out["sqrt_n"] = str(int(round(math.sqrt(n))))
    return out


def text_recompute(r: dict) -> str:
    lines = [" s   peak GiB   model GiB   memory saving   step ms   time ratio   largest batch (est.)"]
    for s, e in r["runs"].items():
        lines.append(f"{s:>2}   {e['peak_bytes'] / 2**30:8.2f}   {e['model_bytes'] / 2**30:9.2f}   "
                     f"{e['memory_saving']:13.2f}   {e['time']['median_ms']:7.1f}   {e['time_ratio']:10.2f}   "
                     f"{e['max_batch_estimate']:>10,d}")
    s = r["runs"][r["sqrt_n"]]
    lines.append(f"s = {r['sqrt_n']}: {s['memory_saving']:.2f}x less activation memory (goal >= "
                 f"{GOALS['recompute_memory']:g}x) for {s['time_ratio']:.2f}x the step time (goal <= "
                 f"{GOALS['recompute_time']:g}x)")
    return "\n".join(lines)


def plot_recompute(r: dict, source: str):
    plt = plots._plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s, e in r["runs"].items():
        ax.plot(e["time"]["median_ms"], e["peak_bytes"] / 2**30, "o")
        ax.annotate(f"s = {s}", (e["time"]["median_ms"], e["peak_bytes"] / 2**30), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("step time (ms)")
    ax.set_ylabel("peak memory above weights and gradients (GiB)")
    return plots._finish(ax, f"Recomputation, {r['layers']} layers of {r['width']}, batch {r['batch']}: memory against time",
                         source)


def measure_largest_batch(layers: int = 64, width: int = 2048, budget_gib: float = 4.0, multiple: int = 256,
                  spacings=None) -> dict:
    """The largest batch whose training step (forward, backward and SGD update of a ``layers``-layer MLP of
    ``width``) runs within ``budget_gib`` GiB of GPU memory above the weights and gradients, for checkpoint spacings
    s = 1 and s = sqrt(layers) (or ``spacings``): found by running the steps, not estimated. CuPy's memory pool is
    capped at the weights, the gradients and the budget, so a batch that does not fit raises OutOfMemoryError;
    batches double until one fails, then a bisection over multiples of ``multiple`` finds the edge. The inputs
    count against the budget (they are the batch too); cuBLAS's own workspace, outside the pool, does not."""
    if not budget_gib > 0 or min(layers, width, multiple) < 1:
        raise runtime.CourseInputError("measure_largest_batch needs a positive budget, layers, width and multiple")
    cp = runtime.cupy()
    pool = cp.get_default_memory_pool()
    widths = [width] * (layers + 1)
    spacings = list(spacings or sorted({1, max(1, int(round(math.sqrt(layers))))}))
    params = tr.mlp_init(widths, xp=cp)
    grads = [(cp.empty_like(W), cp.empty_like(b)) for W, b in params]
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    base, budget, before = pool.used_bytes(), int(budget_gib * 2**30), pool.get_limit()
    probes = []

    def fits(batch: int, s: int) -> bool:
        X = y = None
        pool.free_all_blocks()
        pool.set_limit(size=base + budget)
        try:
            X = cp.random.standard_normal((batch, width), dtype=cp.float32)
            y = cp.random.randint(0, width, batch, dtype=cp.int32)
            tr.loss_and_grads(params, X, y, checkpoint_every=s, out=grads)
            tr.sgd(params, grads, 1e-6)
            cp.cuda.Device().synchronize()
            ok = True
        except cp.cuda.memory.OutOfMemoryError:
            ok = False
        finally:
            del X, y
            pool.set_limit(size=before)
            pool.free_all_blocks()
        probes.append({"s": s, "batch": batch, "fits": ok})
        return ok

    out = {"layers": layers, "width": width, "budget_gib": budget_gib, "multiple": multiple, "runs": {},
           "probes": probes}
    for s in spacings:
        if not fits(multiple, s):
            out["runs"][str(s)] = {"largest": 0}
            continue
        lo = multiple  # fits
        while fits(2 * lo, s):
            lo *= 2
        hi = 2 * lo  # does not fit
        while hi - lo > multiple:
            mid = (lo + hi) // 2 // multiple * multiple
            lo, hi = (mid, hi) if fits(mid, s) else (lo, mid)
        out["runs"][str(s)] = {"largest": lo, "model_bytes_per_example":
                               tr.activation_bytes(1, widths, checkpoint_every=s)}
    one, root = out["runs"].get("1", {}).get("largest"), out["runs"].get(str(spacings[-1]), {}).get("largest")
    out["ratio"] = root / one if one else None
    return out


def text_largest_batch(lb: dict) -> str:
    lines = []
    for s, e in lb["runs"].items():
        if not e["largest"]:
            lines.append(f"s = {s:>2}: not even a batch of {lb['multiple']} runs in {lb['budget_gib']:g} GiB")
            continue
        model = lb["budget_gib"] * 2**30 / e["model_bytes_per_example"]
        lines.append(f"s = {s:>2}: the largest batch whose step runs in {lb['budget_gib']:g} GiB: {e['largest']:>7,d} "
                     f"(the activation model alone would allow {model:,.0f}: {e['largest'] / model:.2f} of it)")
    if lb.get("ratio"):
        lines.append(f"checkpoints every {list(lb['runs'])[-1]} layers: {lb['ratio']:.2f}x the batch, found in "
                     f"{len(lb['probes'])} steps run")
    return plots.wrap("\n".join(lines))


# --------------------------------------------------------------------------------- data parallelism

# How the data-parallel step is timed: with no communication, with NCCL's all-reduces started bucket by bucket
# during the backward pass, started only after it, started during it on streams of the highest priority, and with
# lesson 7's ring after the backward pass, all from one Python thread; and as "nccl" with one process per GPU.
DP_VARIANTS = {"none": {"reduce": "none"}, "nccl": {"reduce": "nccl"},
               "nccl_after": {"reduce": "nccl", "overlap": False},
               "nccl_priority": {"reduce": "nccl", "comm_priority": True}, "ring": {"reduce": "ring"},
               "nccl_procs": {"processes": True}}


def measure_data_parallel(layers: int = 16, width: int = 4096, batch_per_gpu: int = 1024, ks=None, repeats: int = 10,
                          parallel=None) -> dict:
    """The data-parallel step of a ``layers``-layer MLP of ``width`` at ``batch_per_gpu`` per GPU, every variant of
    DP_VARIANTS, for every k of 1, 2, 4, 8 this machine has. ``parallel``: the DataParallel class the one-thread
    variants run (by default tr.DataParallel; a notebook passes its own cell's); one process per GPU runs
    tr.data_parallel_program."""
    parallel = parallel or tr.DataParallel
    from benchmarks import collectives as bcol

    cp = runtime.cupy()
    n_gpus = cp.cuda.runtime.getDeviceCount()
    ks = [k for k in (ks or (1, 2, 4, 8)) if k <= n_gpus]
    widths = [width] * (layers + 1)
    host = tr.mlp_init(widths)
    out = {"gpus": n_gpus, "layers": layers, "width": width, "batch_per_gpu": batch_per_gpu, "runs": {},
           "not_measured": [k for k in (1, 2, 4, 8) if k > n_gpus]}
    try:
        out["topology"] = bcol.topology()
    except Exception as exc:  # nvidia-smi missing
        out["topology"] = f"unavailable: {exc}"
    for k in ks:
        shards = []
        for r in range(k):
            with cp.cuda.Device(r):
                shards.append(_batch(cp, batch_per_gpu, width, width, 10 + r))
        entry = {}
        variants = dict(DP_VARIANTS)
        if k < 2:
            variants.pop("ring")  # lesson 7's ring needs two GPUs
        for reduce, kw in variants.items():
            if kw.get("processes"):
                entry.update(_data_parallel_processes(k, widths, batch_per_gpu, repeats, reduce))
                continue
            try:
                dp = parallel(host, list(range(k)), **kw)

                def step():
                    dp.step(shards, 1e-4)
                    dp.synchronize()

                entry[reduce] = bench.time_gpu(step, repeats=repeats, warmup=2).summary()
                entry["buckets"] = len(dp.plan)
                del dp
            except Exception as exc:
                entry[reduce + "_error"] = f"{type(exc).__name__}: {exc}"
        out["runs"][str(k)] = entry
    return out


def _data_parallel_processes(k: int, widths, batch_per_gpu: int, repeats: int, name: str) -> dict:
    """The data-parallel step with one process per GPU (tr.data_parallel_program under lesson 7's launcher): the
    time of the slowest rank, each rank's median, or why it failed."""
    from gpucourse import ranks

    runtime.cupy().get_default_memory_pool().free_all_blocks()  # the ranks need the memory this process held
    try:
        results = ranks.launch(k, tr.data_parallel_program, list(widths), batch_per_gpu, 0, repeats, 1e-4,
                               timeout=300.0)
    except Exception as exc:  # a rank failed, or NCCL is missing: the other variants stand
        return {name + "_error": f"{type(exc).__name__}: {exc}"}
    slowest = max(results, key=lambda r: r["timing"]["median_ms"])
    return {name: slowest["timing"], name + "_ranks_ms": [r["timing"]["median_ms"] for r in results]}


def scaling(d: dict) -> dict:
    """What the data-parallel runs say, per k measured with and without the all-reduces: the step times, the
    weak-scaling efficiency T(1) / T(k) (the batch per GPU is fixed, so the ideal is the same step time at every
    k; T(1) is the one-GPU step with its calls to NCCL), the communication the buckets left exposed
    (T(k) - T(k) without communication), and the cost of driving k GPUs from one Python thread without any
    communication (T(k) without / T(1) without); where one process per GPU was timed too, its efficiency
    T(1) / T(k) against the same T(1)."""
    runs = {int(k): e for k, e in d["runs"].items() if "none" in e and "nccl" in e}
    t1 = runs[1]["nccl"]["median_ms"] if 1 in runs else None
    base = runs[1]["none"]["median_ms"] if 1 in runs else None
    out = {}
    for k in sorted(runs):
        step, compute = runs[k]["nccl"]["median_ms"], runs[k]["none"]["median_ms"]
        procs = runs[k].get("nccl_procs", {}).get("median_ms")
        out[k] = {"step_ms": step, "compute_ms": compute, "exposed_ms": step - compute,
                  "weak_scaling": t1 / step if t1 else None, "driving_k": compute / base if base else None,
                  "weak_scaling_procs": t1 / procs if t1 and procs else None,
                  "buckets": runs[k].get("buckets"),
                  **{f"{v}_ms": runs[k][v]["median_ms"] for v in ("nccl_after", "nccl_priority", "ring", "nccl_procs")
                     if v in runs[k]}}
    return out


def scaling_lines(d: dict) -> list:
    """The data-parallel runs in words, a line per k (and per k that failed or was not measured)."""
    lines = []
    for k, s in scaling(d).items():
        eff = (f"weak-scaling efficiency T(1)/T({k}) {100 * s['weak_scaling']:.1f}%"
               + (f" (goal >= {100 * GOALS['scaling_efficiency_k8']:.0f}% at k = 8)" if k == 8 else "")
               if s["weak_scaling"] else "no k = 1 run to compare with")
        lines.append(f"data parallel k = {k}: step {bench.format_ms(s['step_ms'])} with NCCL all-reduces in "
                     f"{s['buckets']} buckets, {bench.format_ms(s['compute_ms'])} without communication "
                     f"(communication adds {bench.format_ms(s['exposed_ms'])}): {eff}")
        takes = [f"{what} {bench.format_ms(s[key])}" for key, what in (
            ("nccl_after_ms", "all-reduces only after the backward pass"),
            ("nccl_priority_ms", "during it on high-priority streams"),
            ("ring_ms", "lesson 7's ring after the backward pass"),
            ("nccl_procs_ms", "one process per GPU (overlapped, as DDP)")) if key in s]
        if takes:
            lines.append(f"    the same step with " + "; ".join(takes))
        if s.get("weak_scaling_procs") and k > 1:
            lines.append(f"    with one process per GPU: weak-scaling efficiency T(1)/T({k}) "
                         f"{100 * s['weak_scaling_procs']:.1f}%")
    for k, e in d["runs"].items():
        if "none" not in e or "nccl" not in e:
            lines.append(f"data parallel k = {k}: {e}")
        else:
            lines += [f"data parallel k = {k}, {key[:-len('_error')]} failed: {why}" for key, why in e.items()
                      if key.endswith("_error")]
    if d["not_measured"]:
        lines.append(f"k = {', '.join(map(str, d['not_measured']))} not measured: the machine that measured "
                     f"these had {d['gpus']} GPU(s)")
    return lines


def text_data_parallel(d: dict) -> str:
    return plots.wrap("\n".join(scaling_lines(d)))


def plot_data_parallel(d: dict, source: str):
    """Per k measured: the step with NCCL's all-reduces and without any communication (bars), and the
    weak-scaling efficiency T(1)/T(k) against the goal at k = 8 (line, right axis)."""
    sc = scaling(d)
    if not sc:
        raise runtime.CourseError("no data-parallel run measured the step both with and without communication")
    plt = plots._plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ks = list(sc)
    x = np.arange(len(ks))
    bars = {"step, no communication (one thread)": [sc[k]["compute_ms"] for k in ks],
            "step with NCCL all-reduces in buckets (one thread)": [sc[k]["step_ms"] for k in ks]}
    procs = [sc[k].get("nccl_procs_ms") or 0 for k in ks]
    if any(procs):
        bars["the same, one process per GPU"] = procs
    w = 0.8 / len(bars)
    for i, (label, values) in enumerate(bars.items()):
        ax.bar(x + (i - (len(bars) - 1) / 2) * w, values, w, label=label)
    ax.set_xticks(x, [f"k = {k}" for k in ks])
    ax.set_ylabel("ms per step (batch per GPU fixed)")
    ax.set_ylim(0, 1.9 * max(max(v) for v in bars.values()))  # room above the bars for the two legends
    ax.legend(fontsize=7, loc="upper left")
    eff = [(i, 100 * sc[k]["weak_scaling"]) for i, k in enumerate(ks) if sc[k]["weak_scaling"]]
    if eff:
        ax2 = ax.twinx()
        ax2.plot([i for i, _ in eff], [e for _, e in eff], "o-", color="black", label="weak-scaling efficiency")
        eff_p = [(i, 100 * sc[k]["weak_scaling_procs"]) for i, k in enumerate(ks) if sc[k].get("weak_scaling_procs")]
        if eff_p:
            ax2.plot([i for i, _ in eff_p], [e for _, e in eff_p], "s--", color="tab:green",
                     label="weak-scaling efficiency, one process per GPU")
        ax2.axhline(100 * GOALS["scaling_efficiency_k8"], color="tab:red", ls="--", lw=1, label="goal at k = 8")
        ax2.set_ylim(0, 200)  # the lines sit below the legends
        ax2.set_yticks(range(0, 101, 25))
        ax2.set_ylabel("T(1) / T(k) (%)")
        ax2.legend(fontsize=7, loc="upper right")
    missing = f"; k = {', '.join(map(str, d['not_measured']))} not measured" if d.get("not_measured") else ""
    return plots._finish(ax, f"Data parallelism, {d['layers']} layers of {d['width']}, batch {d['batch_per_gpu']} "
                             f"per GPU{missing}", source)


def recorded_with_more_gpus(d: dict) -> tuple | None:
    """(figures, label) of the lesson's data-parallel run recorded on the most GPUs, where that is more GPUs than
    ``d`` had (a learner's one GPU, or an older record), else None: the scale-up figures worth showing beside."""
    recs = [r for r in records.all_records("09_training") if "data_parallel" in r["figures"]]
    best = max(recs, key=lambda r: (r["figures"]["data_parallel"].get("gpus", 0), r["date"]), default=None)
    if best is None or best["figures"]["data_parallel"].get("gpus", 0) <= d.get("gpus", 0):
        return None
    return best["figures"]["data_parallel"], records.label(best, "data_parallel")


# Scale-out: the nominal rate of one network link between machines, each direction, in GB/s.
NETWORKS = {"InfiniBand NDR, 400 Gb/s (nominal)": 50.0, "Ethernet, 100 Gb/s (nominal)": 12.5}


def gradient_bytes(d: dict) -> int:
    """Bytes of FP32 gradients the data-parallel MLP all-reduces every step."""
    return 4 * d["layers"] * (d["width"] * d["width"] + d["width"])


def links() -> dict:
    """GB/s of the links scale-up and scale-out compare: NVLink as lesson 7 measured it (the bus bandwidth
    2 (k - 1) / k N / t of NCCL's all-reduce of its largest N, on the smallest ring recorded), where a lesson 7
    record holds one, then NETWORKS."""
    out = {}
    rec = records.latest("07_collectives")
    runs = (rec or {}).get("figures", {}).get("runs", {})
    measured = sorted(int(k) for k, e in runs.items() if e.get("allreduce", {}).get("nccl_ms"))
    if measured:
        k = measured[0]
        a = runs[str(k)]["allreduce"]
        n, t = a["N"][-1], a["nccl_ms"][-1]
        out[f"NVLink, {k} x {rec['gpu']['name']} (lesson 7, NCCL)"] = 2 * (k - 1) / k * n / (t * 1e-3) / 1e9
    return {**out, **NETWORKS}


# ------------------------------------------------------------------ a stand-in for the all-reduces, on one GPU

# NCCL's all-reduce kernels run one block of 512 threads per channel, and take tens of KiB of shared memory each.
STANDIN_THREADS, STANDIN_SHARED = 512, 32 * 1024


def measure_overlap_standin(layers: int = 16, width: int = 4096, batch: int = 1024, ctas=(8, 16, 32), comm_ms=None,
                            buckets: int = 16, repeats: int = 10) -> dict:
    """On one GPU: does the training step leave SMs for communication beside it? A stand-in for the buckets'
    all-reduces (``buckets`` kernels of ``ctas`` blocks of 512 threads, each block holding its SM's share for
    comm_ms / buckets: bench.hold) runs on a stream of its own while the step (forward, backward, SGD of the
    data-parallel MLP) runs on another. The step with it, against the step and the stand-in alone, says how much of
    the stand-in the step hid. comm_ms: the all-reduce of the step's gradients at k = 2 over NVLink as lesson 7
    measured it (``links``), else 3.4 ms."""
    cp = runtime.cupy()
    widths = [width] * (layers + 1)
    nvlink = [(name, gbs) for name, gbs in links().items() if name.startswith("NVLink")]
    grad = gradient_bytes({"layers": layers, "width": width})
    if comm_ms is None:
        comm_ms, source = ((grad / (nvlink[0][1] * 1e9) * 1e3, nvlink[0][0]) if nvlink
                           else (3.4, "no lesson 7 record: 3.4 ms assumed"))
    else:
        source = "given"
    dp = tr.DataParallel(tr.mlp_init(widths), [cp.cuda.Device().id], reduce="none")
    shard = [_batch(cp, batch, width, width, 0)]
    side, main = cp.cuda.Stream(non_blocking=True), dp.compute[0]

    def standin(C):
        for _ in range(buckets):
            bench.hold(comm_ms / buckets, side, blocks=C, threads=STANDIN_THREADS, shared_bytes=STANDIN_SHARED)

    def joined(work_step: bool, C: int):
        def work():
            here = cp.cuda.get_current_stream()
            start = cp.cuda.Event(disable_timing=True)
            start.record(here)
            side.wait_event(start)
            main.wait_event(start)
            if C:
                standin(C)
            if work_step:
                dp.step(shard, 1e-4)
            for s in (side, main):
                done = cp.cuda.Event(disable_timing=True)
                done.record(s)
                here.wait_event(done)
        return work

    out = {"layers": layers, "width": width, "batch": batch, "buckets": buckets, "comm_ms": comm_ms,
           "comm_source": source, "threads": STANDIN_THREADS, "shared_bytes": STANDIN_SHARED,
           "sms": runtime.get().device.get("sms"),
           "step": bench.time_gpu(joined(True, 0), repeats=repeats, warmup=2).summary(), "runs": {}}
    for C in ctas:
        out["runs"][str(C)] = {"alone": bench.time_gpu(joined(False, C), repeats=repeats, warmup=1).summary(),
                               "with_step": bench.time_gpu(joined(True, C), repeats=repeats, warmup=1).summary()}
    return out


def standin_lines(o: dict) -> list:
    """The stand-in in words: per block count, what it added to the step and the share of it the step hid."""
    step = o["step"]["median_ms"]
    lines = [f"the step alone {bench.format_ms(step)}; a stand-in for its all-reduces ({o['buckets']} kernels, "
             f"{bench.format_ms(o['comm_ms'])} in all, from {o['comm_source']}) on a stream of its own:"]
    for C, r in o["runs"].items():
        alone, both = r["alone"]["median_ms"], r["with_step"]["median_ms"]
        added = both - step
        lines.append(f"  {C:>3} blocks of {o['threads']} threads: alone {bench.format_ms(alone)}, beside the step "
                     f"{bench.format_ms(both)}: adds {bench.format_ms(added)}, "
                     f"{100 * max(0.0, 1 - added / alone):.0f}% of it hidden")
    return lines


def text_overlap_standin(o: dict) -> str:
    return plots.wrap("\n".join(standin_lines(o)))


def plot_overlap_standin(o: dict, source: str):
    """The step alone and beside the stand-in for each block count, against the time if nothing were hidden."""
    step = o["step"]["median_ms"]
    values = {"step alone": step, **{f"step + stand-in, {C} blocks": r["with_step"]["median_ms"]
                                     for C, r in o["runs"].items()}}
    worst = step + max(r["alone"]["median_ms"] for r in o["runs"].values())
    return plots.bars(values, unit="ms", source=source, ceiling=("nothing hidden", worst),
                      title=f"Room beside the step for {bench.format_ms(o['comm_ms'])} of communication")


# ------------------------------------------------------------ data parallelism started as clusters start jobs

def measure_launchers(k: int | None = None, widths=(32, 64, 64, 64, 8), batch_per_gpu: int = 64, steps: int = 2,
                      lr: float = 0.1) -> dict:
    """``tr.data_parallel_program`` (one process per GPU, DDP's way) started by the course's launcher and by each
    cluster launcher this machine has (torchrun, mpirun, ranks started with srun's variables): every rank's weights
    after ``steps`` steps against the course launcher's."""
    from pathlib import Path

    from gpucourse import ranks

    k = k or runtime.cupy().cuda.runtime.getDeviceCount()
    if k < 2:
        raise runtime.CourseError(f"one process per GPU needs two or more GPUs here; this machine has {k}")
    args = [list(widths), batch_per_gpu, steps, 0, lr]
    want = ranks.launch(k, tr.data_parallel_program, *args, timeout=300.0)

    def diff(got, ref):
        return max(float(np.abs(a - b).max()) for (Wa, ba), (Wb, bb) in zip(got["params"], ref["params"])
                   for a, b in ((Wa, Wb), (ba, bb)))

    root = str(Path(__file__).resolve().parents[1])
    return {"k": k, "widths": list(widths), "batch_per_gpu": batch_per_gpu, "steps": steps,
            **ranks.under_every_launcher(k, "kernels.training:data_parallel_program", args, want, diff,
                                         env={"PYTHONPATH": root})}


def text_launchers(t: dict) -> str:
    from gpucourse import ranks

    return ranks.launchers_text(t, f"{t['steps']} data-parallel steps of a {'-'.join(map(str, t['widths']))} network, "
                                   f"batch {t['batch_per_gpu']} a GPU, on {t['k']} GPUs, one process each")


# ------------------------------------------------------------------------------------ the registry

FIGURES = {
    "mixed_precision": Figure(measure_mixed_precision, plot_mixed_precision, text_mixed_precision),
    "scaler_run": Figure(measure_scaler_run, plot_scaler_run, text_scaler_run),
    "recompute": Figure(measure_recompute, plot_recompute, text_recompute),
    "largest_batch": Figure(measure_largest_batch, None, text_largest_batch),
    "data_parallel": Figure(measure_data_parallel, plot_data_parallel, text_data_parallel),
    "overlap_standin": Figure(measure_overlap_standin, plot_overlap_standin, text_overlap_standin),
    "launchers": Figure(measure_launchers, None, text_launchers, optional=True, gpus=2),
}


# ------------------------------------------------------------------------------------ RESULTS.md

def results_rows(record: dict) -> list:
    """The lesson's headline figures in one record, for RESULTS.md and the README (gpucourse.results): the first row
    is the headline."""
    from gpucourse import results as R

    f = record["figures"]
    mp, rc, lb = f.get("mixed_precision", {}), f.get("recompute", {}), f.get("largest_batch", {})
    s = rc.get("runs", {}).get(rc.get("sqrt_n"), {})
    rows = [
        ("mixed-precision training step, speed against FP32", R.ratio(mp.get("speedup")), "mixed_precision"),
        ("FP32 training step, TFLOP/s", R.number(mp.get("fp32_tflops"), 1), "mixed_precision"),
        ("recomputation every √n layers, activation memory saved", R.ratio(s.get("memory_saving")), "recompute"),
        ("recomputation every √n layers, step time against none", R.ratio(s.get("time_ratio")), "recompute"),
        (f"largest batch in {lb.get('budget_gib', 4):g} GiB, with recomputation against without",
         R.ratio(lb.get("ratio")), "largest_batch"),
    ]
    dp = f.get("data_parallel", {})
    for k, sc in (scaling(dp).items() if dp.get("runs") else ()):
        if k > 1:
            rows.append((f"data parallel on {k} GPUs, a process each, weak-scaling efficiency",
                         R.percent(sc.get("weak_scaling_procs")), "data_parallel"))
    return rows

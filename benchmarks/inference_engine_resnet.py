"""Lesson 6's engine on a real network: ResNet-50 at 224 x 224 (``E.resnet50``, seeded weights, batch norms calibrated
on a few images) built into plans and timed beside PyTorch on the same weights and images, in one run.

What ``measure()`` records (figure "resnet" of 06_inference_engine):

* the build: seconds of the passes and of building and tuning each plan (goal: under a minute), apart from the
  kernels' one-time compilation;
* the engine's FP16 plans (tuned at batch 1 and at batch 64), its INT8 plan and, on Hopper, its FP8 plan (batch 64):
  end to end (fresh inputs
  written untimed into the input buffer before every call; CUDA events around the call) and GPU only
  (``bench.time_per_call``), with the kernel each convolution got;
* each step's GPU time at batch 64 beside its floors (the FP16 peak and the copy bandwidth measured in the same
  run): a roofline per layer;
* PyTorch (``benchmarks/inference_engine_pytorch.py``'s model of the same graph, FP16): eager NCHW and channels_last
  and a CUDA graph of each, at batch 1 and 64, timed the same way; PyTorch's best is the fastest of them.
  ``torch.compile`` (max-autotune) in a CUDA graph is its own figure, "resnet_compile" (``measure_compile``), with
  the engine timed again in that run: its autotuning alone takes minutes;
* agreement: the top-1 class of the engine's FP16 and INT8 plans against PyTorch in FP32 on a fixed set of inputs,
  and the logits' relative error;
* mixed plans (TensorRT's per-layer precision): INT8 and, on Hopper, FP8 with the parts of the network in ``MIXED``
  kept in FP16 (chosen by ``E.keep_fp16_for`` on other inputs than those the agreement is measured on), their speed
  and agreement beside the pure plans'.

The goals (issue: FP16 >= 1.2x PyTorch's best at batch 1 and 64; INT8 and FP8 >= 1.3x FP16 at batch 64 with the top-1
class agreeing on >= 99% of the inputs) are in ``GOALS`` and ``ratios``; nothing here asserts them.
"""
from __future__ import annotations

import functools
import os
import time

import numpy as np

from gpucourse import bench, claims, runtime
from kernels import inference_engine as E

SIZE = 224
BATCH = 64
GOALS = {"fp16_vs_pytorch": 1.2, "int8_vs_fp16": 1.3, "fp8_vs_fp16": 1.3, "top1_agreement": 0.99, "build_s": 60.0}
PYTORCH_VARIANTS = ("eager, NCHW", "eager, NHWC", "CUDA graph, NCHW", "CUDA graph, NHWC")
# torch.compile's max-autotune times Triton templates and cuDNN for every convolution of ResNet-50 at each batch size
# (minutes): its own figure, "resnet_compile", with the engine timed again in that run
COMPILED = ("torch.compile + CUDA graph",)
CALIBRATION_IMAGES = 8  # batch-norm statistics and INT8 scales: the NumPy reference runs them, 3.9 G MACs an image
AGREEMENT_IMAGES = 1000  # the fixed set the top-1 classes are compared on
# The mixed plans' layers kept in FP16 (build_plan's keep_fp16): what E.keep_fp16_for chose for a 99% target on 200
# other inputs (images(200, 4)) with the NumPy runtime (the kernels' arithmetic, on a CPU): INT8 block by block (58% of
# the multiply-adds stay in FP16: INT8 in conv4's last four blocks and conv5), FP8 stage by stage (81%: FP8 in conv5
# alone; each of conv4's blocks in FP8 costs as much as all of conv5)
MIXED = {"int8": ["conv1", "conv2", "conv3", "conv4_block1", "conv4_block2"],
         "fp8": ["conv1", "conv2", "conv3", "conv4"]}


def images(n: int, seed: int) -> np.ndarray:
    """n fixed inputs, N x 224 x 224 x 3 float32, standard normal (what a normalised photograph's pixels look like
    to the network's first layer; nothing is downloaded)."""
    return np.random.default_rng(seed).standard_normal((n, SIZE, SIZE, 3)).astype(np.float32)


def network(progress: bool = True) -> tuple:
    """(imported graph with calibrated batch norms, optimised graph, seconds to import + calibrate, seconds of the
    passes)."""
    t0 = time.perf_counter()
    g = E.calibrate_batchnorm(E.resnet50(SIZE, seed=0), images(CALIBRATION_IMAGES, 1), progress=progress)
    t1 = time.perf_counter()
    final = E.optimize(g)[-1][1]
    return g, final, t1 - t0, time.perf_counter() - t1


def _engine_timings(eng, n: int, xs: list, repeats: int) -> dict:
    buf = eng.input_buffer(n)
    it = iter(range(10**9))

    def setup():
        buf[...] = xs[next(it) % len(xs)][:n]
        return buf

    e2e = bench.time_gpu(lambda b: eng.infer(b), setup=setup, repeats=repeats, warmup=3)
    gpu = bench.time_per_call(lambda: eng.infer(buf), batch=8, repeats=max(repeats // 2, 5))
    return {"ms": e2e.median_ms, "timing": e2e.summary(), "gpu_ms": gpu.median_ms, "gpu_timing": gpu.summary(),
            "images_per_s": n / (e2e.median_ms * 1e-3)}


def _kernels(plan) -> dict:
    out = {}
    for s in plan.steps:
        if s["kind"] == "conv":
            out[s["kernel"]] = out.get(s["kernel"], 0) + 1
    return out


def _layers(plan, eng, n: int, ceilings: dict) -> list:
    """Each step's GPU time at batch n, and for a convolution its FLOPs, bytes and the two floors."""
    rows = []
    eight = plan.header["precision"] in ("int8", "fp8")  # 1-byte activations and weights, the tensor cores' 8-bit rate
    costs = {r["name"]: r for r in E.layer_costs(_optimised_for_costs(), n, bytes_per_element=1 if eight else 2)}
    for s in plan.steps:
        t = bench.time_per_call(lambda s=s: eng.run_step(s["id"], n), batch=8, repeats=5).median_ms
        row = {"name": s.get("name", s["kind"]), "kind": s["kind"], "kernel": s.get("kernel"), "ms": t}
        c = costs.get(s.get("name"))
        if c:
            row.update(flops=c["flops"], bytes=c["bytes"],
                       compute_ms=c["flops"] / (ceilings["fp16_tflops"] * (2 if eight else 1) * 1e9),
                       memory_ms=c["bytes"] / (ceilings["copy_gbps"] * 1e6))
        rows.append(row)
    return rows


@functools.cache
def _optimised_for_costs():
    return E.optimize(E.resnet50(SIZE))[-1][1]  # shapes only: the counts do not depend on the weights


def _pytorch(g, xs: list, repeats: int, variants: tuple = PYTORCH_VARIANTS, batches: tuple = (1, BATCH)) -> dict:
    """PyTorch's rows at ``batches`` (1 and BATCH), FP16, beside the engine rows (timed again here, in the same
    run)."""
    from benchmarks import inference_engine_pytorch as PT

    why = PT.unavailable()
    if why:
        return {"available": False, "why": f"skipped: {why}"}
    torch = PT._torch()
    cp = runtime.cupy()
    dev = torch.device("cuda", cp.cuda.Device().id)
    rows = []
    with PT._settings(torch), torch.cuda.device(dev), torch.cuda.stream(PT.torch_stream()), torch.inference_mode():
        models = {layout: PT.torch_model(g, precision="fp16", device=dev, layout=layout)
                  for layout in ("contiguous", "channels_last")}
        compiled, compile_s = {}, 0.0
        for v in bench.progress(variants, desc="PyTorch beside the engine"):
            layout = "contiguous" if "NCHW" in v else "channels_last"
            row = {"name": f"PyTorch {v}, FP16", "variant": v}
            for n in batches:
                staged = [PT.as_input(a[:n].get(), precision="fp16", device=dev, layout=layout) for a in xs]
                x = torch.empty_like(staged[0])
                x.copy_(staged[0])
                try:
                    fn = models[layout]
                    if v.startswith("torch.compile"):
                        t0 = time.perf_counter()
                        if "fn" not in compiled:
                            compiled["fn"] = torch.compile(fn, mode=PT.COMPILE_MODE, dynamic=False, fullgraph=True)
                        fn = compiled["fn"]
                        import contextlib
                        import io

                        with contextlib.redirect_stderr(io.StringIO()):  # max-autotune's tables of candidates
                            fn(x)
                            torch.cuda.synchronize()
                        compile_s += time.perf_counter() - t0
                        row[f"compile_s_b{n}"] = time.perf_counter() - t0
                    call = PT.capture(fn, x) if "graph" in v else functools.partial(fn, x)
                    for _ in range(3):
                        call()
                    e2e, gpu = PT._timings(call, PT._cycle_into(x, staged), repeats)
                    row[f"b{n}"] = {"ms": e2e.median_ms, "timing": e2e.summary(), "gpu_ms": gpu.median_ms,
                                    "gpu_timing": gpu.summary()}
                    del call
                except Exception as exc:
                    row[f"b{n}"] = {"ms": None, "why": f"failed: {PT._one_line(exc)}"}
            rows.append(row)
        torch.compiler.reset()
        torch.cuda.empty_cache()
    return {"available": True, "torch": torch.__version__, "compile_mode": PT.COMPILE_MODE, "compile_s": compile_s,
            "rows": rows}


def _agreement(g, engines: dict) -> dict:
    """Top-1 classes and logits of the engine's plans against PyTorch in FP32 (the reference) on AGREEMENT_IMAGES
    fixed inputs; without PyTorch, against the NumPy reference on a few of them."""
    x = images(AGREEMENT_IMAGES, 2)
    out = {"images": len(x)}
    ref = None
    try:
        from benchmarks import inference_engine_pytorch as PT

        if PT.unavailable() is None:
            torch = PT._torch()
            m = PT.torch_model(g, precision="fp32", device="cuda", layout="channels_last")
            m.layers[-1] = torch.nn.Identity()  # the logits, before the softmax
            with PT._settings(torch):
                ref = PT.logits(m, x, batch=BATCH)
            out["reference"] = "PyTorch FP32 (cuDNN, no TF32)"
    except Exception as exc:  # the comparison is recorded as missing, not raised
        out["why"] = f"PyTorch reference failed: {type(exc).__name__}: {exc}"[:300]
    if ref is None:
        x = x[:4]
        _, vals = E.run_graph(g, x, keep=True)
        ref = vals["predictions"]
        out.update(images=len(x), reference="NumPy float64 (run_graph)")
    for name, eng in engines.items():
        z = []
        for s in range(0, len(x), eng.max_batch):
            eng.infer(x[s:s + eng.max_batch])
            z.append(eng.logits[:len(x[s:s + eng.max_batch])].get().copy())
        z = np.concatenate(z)
        out[name] = {"top1": float(np.mean(z.argmax(1) == ref.argmax(1))),
                     "logits_rel_error": float(np.abs(z - ref).max() / np.abs(ref).max())}
    return out


def measure(repeats: int = 20) -> dict:
    """Figure "resnet" (GPU mode): see the module's docstring."""
    runtime.require_gpu("timing ResNet-50 through the engine")
    cp = runtime.cupy()
    ceilings = bench.measure_ceilings().as_dict()
    g, final, import_s, passes_s = network()
    t0 = time.perf_counter()  # the kernels' compilation, once per machine (CuPy keeps them on disk): not the build's
    from gpucourse import cuda_c, gpus

    cuda_c.module(E.SOURCE)
    if gpus.status("06.wgmma").runs:
        cuda_c.module_arch(E.catalog.WG_SOURCE, "sm_90a")
    compile_s = time.perf_counter() - t0
    xs = [cp.asarray(images(BATCH, 10 + i)) for i in range(3)]
    calib = images(CALIBRATION_IMAGES, 3)
    plans, engines, rows = {}, {}, {}
    configs = [("FP16, batch 64", "fp16", BATCH), ("FP16, batch 1", "fp16", 1), ("INT8, batch 64", "int8", BATCH),
               ("INT8 (mixed), batch 64", "int8", BATCH)]
    if gpus.status("06.wgmma").runs:  # FP8 runs on Hopper's wgmma kernels only
        configs += [("FP8, batch 64", "fp8", BATCH), ("FP8 (mixed), batch 64", "fp8", BATCH)]
    for name, precision, batch in configs:
        keep = MIXED[precision] if "(mixed)" in name else None
        t0 = time.perf_counter()
        plan = E.build_plan(final, precision=precision, max_batch=batch, name=f"ResNet-50 {name}",
                            x_calib=calib if precision in ("int8", "fp8") else None, keep_fp16=keep)
        build_s = time.perf_counter() - t0
        eng = E.Engine(plan)
        plans[name], engines[name] = plan, eng
        rows[name] = {"precision": precision, "batch": batch, "build_s": build_s, "steps": len(plan.steps),
                      "kernels": _kernels(plan), **_engine_timings(eng, batch, xs, repeats)}
        if keep:
            rows[name].update(keep_fp16=keep, fp16_share=E.fp16_share(final, keep),
                              reformats=sum(s["kind"] == "reformat" for s in plan.steps))
        print(f"engine {name}: built in {build_s:.0f} s, {rows[name]['ms']:.3f} ms", flush=True)
    layers = _layers(plans["FP16, batch 64"], engines["FP16, batch 64"], BATCH, ceilings)
    # every other plan's steps too: where INT8 and FP8 gain or lose against FP16, layer by layer, and what batch 1
    # spends its time on
    layers_by_plan = {name: _layers(plans[name], engines[name], rows[name]["batch"], ceilings)
                      for name in plans if name != "FP16, batch 64"}
    pytorch = _pytorch(g, xs, repeats)
    print(f"PyTorch: {[(r['name'], r['b1'].get('ms'), r[f'b{BATCH}'].get('ms')) for r in pytorch.get('rows', [])]}",
          flush=True)
    # the engines once more, after PyTorch, so that a drift of the GPU's clocks over the run shows
    for name in ("FP16, batch 64", "FP16, batch 1"):
        rows[name]["again"] = _engine_timings(engines[name], rows[name]["batch"], xs, repeats)
    agreement = _agreement(g, {k: engines[k] for k in ("FP16, batch 64", "INT8, batch 64", "FP8, batch 64",
                                                       "INT8 (mixed), batch 64", "FP8 (mixed), batch 64")
                               if k in engines})
    out = {"size": SIZE, "batch": BATCH, "ceilings": ceilings, "import_s": import_s, "passes_s": passes_s,
           "compile_s": compile_s,
           "nodes": {"imported": len(g.nodes), "optimised": len(final.nodes)}, "engine": rows, "layers": layers,
           "layers_by_plan": layers_by_plan,
           "pytorch": pytorch, "agreement": agreement}
    out["ratios"] = ratios(out)
    return out


def measure_compile(repeats: int = 20, batches: tuple | None = None) -> dict:
    """Figure "resnet_compile" (GPU mode): torch.compile (max-autotune) in a CUDA graph at batch 1 and 64, FP16, beside
    the engine's FP16 plans built and timed again in the same run. ``batches`` (default: the environment's
    GPUCOURSE_COMPILE_BATCHES, e.g. "1" or "64", else both): one batch size a run, where a run must stay short
    (max-autotune compiles for 4 to 5 minutes a batch size on an H100); each ratio is still from one run."""
    runtime.require_gpu("timing ResNet-50 through the engine")
    cp = runtime.cupy()
    if batches is None:
        env = os.environ.get("GPUCOURSE_COMPILE_BATCHES", "")
        batches = tuple(int(b) for b in env.split(",") if b.strip()) or (1, BATCH)
    if not set(batches) <= {1, BATCH}:
        raise runtime.CourseInputError(f"the compiled figure measures batch 1 and {BATCH}, not {batches}")
    g, final, _, _ = network()
    xs = [cp.asarray(images(BATCH, 10 + i)) for i in range(3)]
    rows = {}
    for name, batch in (("FP16, batch 64", BATCH), ("FP16, batch 1", 1)):
        if batch not in batches:
            continue
        eng = E.Engine(E.build_plan(final, precision="fp16", max_batch=batch))
        rows[name] = {"batch": batch, **_engine_timings(eng, batch, xs, repeats)}
        del eng
    out = {"size": SIZE, "batch": BATCH, "engine": rows, "pytorch": _pytorch(g, xs, repeats, COMPILED, batches)}
    for n, key in ((1, "FP16, batch 1"), (BATCH, "FP16, batch 64")):
        if n not in batches:
            continue
        name, ms = best_pytorch(out, n)
        if ms:
            out[f"fp16_vs_compile_b{n}"] = {"ratio": ms / rows[key]["ms"], "goal": GOALS["fp16_vs_pytorch"]}
    if set(batches) != {1, BATCH}:
        _keep_other_batches(out, batches)
    return out


def _keep_other_batches(out: dict, batches: tuple) -> None:
    """A run of some batch sizes only keeps the others as this GPU's record has them (engine, torch.compile and
    ratio, each pair from one run), and says under "runs" when each batch size was measured."""
    from gpucourse import records

    rec = records.latest("06_inference_engine", runtime.get().device["name"]) or {}
    old = rec.get("figures", {}).get("resnet_compile") or {}
    now = records._now()
    runs = {f"batch {n}": now for n in batches}
    for n, key in ((1, "FP16, batch 1"), (BATCH, "FP16, batch 64")):
        if n in batches or f"fp16_vs_compile_b{n}" not in old or key not in old.get("engine", {}):
            continue
        out["engine"][key] = old["engine"][key]
        out[f"fp16_vs_compile_b{n}"] = old[f"fp16_vs_compile_b{n}"]
        runs[f"batch {n}"] = old.get("runs", {}).get(f"batch {n}", old.get("measured"))
        for row in out["pytorch"].get("rows", []):
            was = next((r for r in old.get("pytorch", {}).get("rows", []) if r["name"] == row["name"]), {})
            for k in (f"b{n}", f"compile_s_b{n}"):
                if k in was:
                    row[k] = was[k]
    out["runs"] = {**runs, "why": "one batch size a run (GPUCOURSE_COMPILE_BATCHES); each ratio is from one run"}


def _fp32_logits(g, x) -> tuple:
    """(logits, what made them) of inputs x: PyTorch in FP32 (cuDNN, no TF32), as ``_agreement``'s reference, or
    without PyTorch the NumPy reference (float64, slow)."""
    from benchmarks import inference_engine_pytorch as PT

    if PT.unavailable() is None:
        torch = PT._torch()
        m = PT.torch_model(g, precision="fp32", device="cuda", layout="channels_last")
        m.layers[-1] = torch.nn.Identity()  # the logits, before the softmax
        with PT._settings(torch):
            return np.asarray(PT.logits(m, x, batch=BATCH), np.float64), "PyTorch FP32 (cuDNN, no TF32)"
    return E.reference_logits(g, x), "NumPy float64 (run_graph)"


def measure_mixed(candidates: dict | None = None, *, choose: bool = True, target: float = 0.99,
                  level: str = "stage", selection: int = 200, timed: bool = True, repeats: int = 20,
                  budget_s: float = 1e9, log=print) -> dict:
    """On a GPU, the mixed plans, in this order (each part skipped once ``budget_s`` seconds have gone): every candidate
    ({precision: [keep_fp16 lists]}; None: the pure plan and ``MIXED``'s, INT8 and on Hopper FP8) on the benchmark's
    1,000 inputs against the FP32 reference (top-1 agreement, logits' relative error, noise: ``E.agreement``; untuned
    plans); with ``timed``, the FP16 plan and each candidate tuned and timed at batch 64; with ``choose``, the parts
    ``E.keep_fp16_for`` keeps in FP16 for ``target`` on ``selection`` other inputs (images(selection, 4); each
    ``level`` unit's sensitivity from the GPU engine), and that choice on the 1,000."""
    runtime.require_gpu("measuring mixed-precision plans")
    from gpucourse import gpus

    cp = runtime.cupy()
    t_start = time.perf_counter()

    def left():
        return budget_s - (time.perf_counter() - t_start)

    g, final, _, _ = network(progress=False)
    calib = images(CALIBRATION_IMAGES, 3)
    x_eval = images(AGREEMENT_IMAGES, 2)
    ref_eval, reference = _fp32_logits(g, x_eval)
    precisions = ["int8"] + (["fp8"] if gpus.status("06.wgmma").runs else [])
    candidates = candidates or {p: [[], MIXED[p]] for p in precisions}
    out = {"reference": reference, "images": len(x_eval), "candidates": [], "timed": {}, "choices": {}}
    log(f"reference: {reference} ({time.perf_counter() - t_start:.0f} s)")
    scales = {p: E.calibrate(final, calib, "percentile", p) for p in candidates}

    def agreement(p, keep, x, ref):
        plan = E.build_plan(final, precision=p, max_batch=BATCH, tune=False, x_calib=calib, keep_fp16=keep,
                            scales=scales.get(p))
        return E.agreement(E.mixed.logits(plan, x), ref)

    out["fp16"] = agreement("fp16", None, x_eval, ref_eval)
    log(f"FP16: {100 * out['fp16']['top1']:.1f}% top-1, logits rel. error {out['fp16']['rel_error']:.3f}, "
        f"noise {out['fp16']['noise']:.3f}")
    for p, keeps in candidates.items():
        for keep in keeps:
            row = {"precision": p, "keep_fp16": keep, "fp16_share": E.fp16_share(final, keep),
                   **agreement(p, keep, x_eval, ref_eval)}
            out["candidates"].append(row)
            log(f"{p.upper()} keep_fp16={keep}: {100 * row['top1']:.1f}% top-1 on {len(x_eval)}, logits rel. error "
                f"{row['rel_error']:.3f}, noise {row['noise']:.3f}, {100 * row['fp16_share']:.0f}% of the MACs in FP16")
    if timed and left() > 0:
        xs = [cp.asarray(images(BATCH, 10 + i)) for i in range(3)]
        plans = [(f"{p.upper()} keep_fp16={k}", p, k) for p, keeps in candidates.items() for k in keeps]
        plans.sort(key=lambda t: not t[2])  # the mixed plans first, then the pure ones (in the records already)
        for name, p, keep in [("FP16", "fp16", None)] + plans:
            if left() <= 0:
                break
            t0 = time.perf_counter()
            plan = E.build_plan(final, precision=p, max_batch=BATCH, x_calib=calib if p != "fp16" else None,
                                keep_fp16=keep, scales=scales.get(p))
            build_s = time.perf_counter() - t0
            eng = E.Engine(plan)
            out["timed"][name] = {"build_s": build_s, **_engine_timings(eng, BATCH, xs, repeats)}
            ratio = out["timed"]["FP16"]["ms"] / out["timed"][name]["ms"]
            log(f"{name}: {out['timed'][name]['ms']:.3f} ms end to end at batch {BATCH} "
                f"({out['timed'][name]['gpu_ms']:.3f} GPU only), {ratio:.2f}x FP16; tuned in {build_s:.0f} s")
            del eng, plan
    if choose and left() > 0:
        x_sel = images(selection, 4)
        ref_sel, _ = _fp32_logits(g, x_sel)
        for p in precisions:
            if left() <= 0:
                break
            r = E.keep_fp16_for(final, calib, x_sel, ref_sel, precision=p, target=target, level=level,
                                max_batch=BATCH, progress=False)
            choice = {k: r[k] for k in ("keep_fp16", "top1", "noise", "met", "seconds")}
            choice["rows"] = [{k: row[k] for k in ("unit", "top1", "noise", "rel_error")} for row in r["rows"]]
            choice["trail"] = [{k: t[k] for k in ("keep_fp16", "top1", "noise")} for t in r["trail"]]
            choice["on_eval"] = agreement(p, r["keep_fp16"], x_eval, ref_eval)
            out["choices"][p] = choice
            log(f"{p.upper()} sensitivity per {level} on {len(x_sel)} other inputs (alone in {p}, the rest FP16; "
                "top-1, noise): " + ", ".join(f"{row['unit']} {100 * row['top1']:.1f}% {row['noise']:.3f}"
                                       for row in r["rows"]))
            log(f"{p.upper()} chose keep_fp16={r['keep_fp16']} ({100 * r['top1']:.1f}% there, {r['seconds']:.0f} s); "
                f"on the {len(x_eval)}: {100 * choice['on_eval']['top1']:.1f}%, noise {choice['on_eval']['noise']:.3f}")
    out["seconds"] = time.perf_counter() - t_start
    return out


def best_pytorch(t: dict, n: int) -> tuple:
    """(name, ms) of PyTorch's fastest row at batch n, end to end."""
    rows = [(r["name"], r[f"b{n}"]["ms"]) for r in t.get("pytorch", {}).get("rows", []) if r.get(f"b{n}", {}).get("ms")]
    return min(rows, key=lambda r: r[1]) if rows else (None, None)


def ratios(t: dict) -> dict:
    """Each goal's ratio (higher is better) beside the goal."""
    e = t["engine"]
    out = {}
    for n, key in ((1, "FP16, batch 1"), (BATCH, "FP16, batch 64")):
        name, ms = best_pytorch(t, n)
        if ms:
            out[f"fp16_vs_pytorch_b{n}"] = {"ratio": ms / e[key]["ms"], "goal": GOALS["fp16_vs_pytorch"],
                                            "against": name}
    for key in ("INT8, batch 64", "FP8, batch 64", "INT8 (mixed), batch 64", "FP8 (mixed), batch 64"):
        if key in e:  # FP8: on Hopper only; the mixed plans: in records from their introduction on
            goal = GOALS["fp8_vs_fp16" if key.startswith("FP8") else "int8_vs_fp16"]
            out[f"{_slug(key)}_vs_fp16_b64"] = {"ratio": e["FP16, batch 64"]["ms"] / e[key]["ms"], "goal": goal}
    for key in ("FP16, batch 64", "INT8, batch 64", "FP8, batch 64", "INT8 (mixed), batch 64", "FP8 (mixed), batch 64"):
        a = t.get("agreement", {}).get(key)
        if a:
            out[f"top1_{_slug(key)}"] = {"ratio": a["top1"], "goal": GOALS["top1_agreement"],
                                         "against": f"{t['agreement'].get('reference', 'FP32')}, "
                                                    f"{t['agreement'].get('images', '?')} images"}
    out["build_s_fp16_b64"] = {"seconds": t["passes_s"] + e["FP16, batch 64"]["build_s"], "goal": GOALS["build_s"]}
    for v in out.values():
        if "ratio" in v:
            v["met"] = v["ratio"] >= v["goal"]
        else:
            v["met"] = v["seconds"] <= v["goal"]
    return out


def _slug(key: str) -> str:
    """"INT8 (mixed), batch 64" -> "int8_mixed": a ratio's name."""
    return key.split(",")[0].lower().replace(" (mixed)", "_mixed")


def text(t: dict) -> str:
    e = t["engine"]
    lines = [f"ResNet-50, {t['size']} x {t['size']}: {t['nodes']['imported']} nodes imported, "
             f"{t['nodes']['optimised']} after the passes"]
    for name, r in e.items():
        lines.append(f"  engine {name:22s}: {r['ms']:7.3f} ms end to end ({r['gpu_ms']:.3f} GPU only), "
                     f"{r['images_per_s']:8,.0f} images/s; built in {r['build_s']:.0f} s; "
                     + ", ".join(f"{k} x{v}" for k, v in sorted(r["kernels"].items(), key=lambda kv: -kv[1])))
        if r.get("keep_fp16"):
            lines.append(f"      {', '.join(r['keep_fp16'])} kept in FP16 ({100 * r['fp16_share']:.0f}% of the "
                         f"multiply-adds), {r['reformats']} reformat step{'s' if r['reformats'] != 1 else ''}")
    pt = t.get("pytorch", {})
    if not pt.get("available"):
        lines.append(f"  PyTorch: {pt.get('why', 'not measured')}")
    for r in pt.get("rows", []):
        cells = [f"{r[f'b{n}']['ms']:7.3f} ms" if r[f"b{n}"].get("ms") else r[f"b{n}"].get("why", "-")[:60]
                 for n in (1, t["batch"])]
        lines.append(f"  {r['name']:38s}: batch 1 {cells[0]}, batch {t['batch']} {cells[1]}")
    for k, v in t.get("ratios", {}).items():
        if k.startswith("top1"):  # a share of the images, not a speed-up
            val, goal = f"{100 * v['ratio']:.1f}%", f"{100 * v['goal']:.0f}%"
        else:
            val = f"{v['ratio']:.2f}x" if "ratio" in v else f"{v['seconds']:.0f} s"
            goal = f"{v['goal']:.2f}x" if "ratio" in v else f"{v['goal']:.0f} s"
        lines.append(f"  {k:22s} {val:>7s} (goal {goal}){'' if v['met'] else '  NOT MET'}"
                     + (f" against {v['against']}" if v.get("against") else ""))
    return "\n".join(lines)


def _kernels_short(kernels: dict, most: int = 2) -> str:
    top = sorted(kernels.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k} x{v}" for k, v in top[:most]) + (f", {len(top) - most} more" if len(top) > most else "")


def engines_view(t: dict, source: str = ""):
    """The engine's plans of figure "resnet" as a table: time end to end and GPU only, images/s, build time, and the
    kernels its convolutions run on (the two commonest)."""
    from gpucourse import plots

    rows = []
    for name, r in t["engine"].items():
        rows.append([name, f"{r['ms']:.3f} ms", f"{r['gpu_ms']:.3f} ms", f"{r['images_per_s']:,.0f}",
                     f"{r['build_s']:.0f} s", _kernels_short(r["kernels"]),
                     f"{100 * r['fp16_share']:.0f}%" if r.get("keep_fp16") else ""])
    return plots.table(["plan", "end to end", "GPU only", "images/s", "built in", "kernels (commonest)",
                        "kept in FP16"], rows, align="lrrrrll",
                       title=f"ResNet-50 at {t['size']} x {t['size']} through the engine", source=source)


def pytorch_view(t: dict, source: str = ""):
    """PyTorch's rows of figure "resnet" (FP16, eager and CUDA graph, two layouts), or why there are none."""
    from gpucourse import plots

    pt = t.get("pytorch", {})
    if not pt.get("available"):
        return f"PyTorch: {pt.get('why', 'not measured')}"
    rows = [[r["name"]] + [f"{r[f'b{n}']['ms']:.3f} ms" if r[f"b{n}"].get("ms") else r[f"b{n}"].get("why", "—")[:40]
                            for n in (1, t["batch"])] for r in pt.get("rows", [])]
    return plots.table(["PyTorch", "batch 1", f"batch {t['batch']}"], rows, align="lrr",
                       title="PyTorch on the same weights and images, end to end", source=source)


def ratios_view(t: dict, source: str = ""):
    """Each goal of figure "resnet" beside the ratio the run reached."""
    from gpucourse import plots

    rows = []
    for k, v in t.get("ratios", {}).items():
        if k.startswith("top1"):  # a share of the images, not a speed-up
            val, goal = f"{100 * v['ratio']:.1f}%", f"{100 * v['goal']:.0f}%"
        else:
            val = f"{v['ratio']:.2f}x" if "ratio" in v else f"{v['seconds']:.0f} s"
            goal = f"{v['goal']:.2f}x" if "ratio" in v else f"{v['goal']:.0f} s"
        rows.append([k, val, goal, "met" if v["met"] else "NOT met", v.get("against", "")])
    return plots.table(["what", "reached", "goal", "", "against"], rows, align="lrrll",
                       title="ResNet-50: the goals", source=source)


def compile_view(t: dict, source: str = ""):
    """Figure "resnet_compile" as a table: the engine's FP16 plan beside torch.compile in a CUDA graph, each batch
    size from one run."""
    from gpucourse import plots

    pt = t.get("pytorch", {})
    if not pt.get("available"):
        return f"torch.compile: {pt.get('why', 'not measured')}"
    rows = []
    for n, key in ((1, "FP16, batch 1"), (t["batch"], "FP16, batch 64")):
        row = next((r for r in pt["rows"] if r.get(f"b{n}", {}).get("ms")), None)
        ratio = t.get(f"fp16_vs_compile_b{n}", {})
        if row and key in t["engine"]:
            rows.append([f"batch {n}", f"{t['engine'][key]['ms']:.3f} ms", f"{row[f'b{n}']['ms']:.3f} ms",
                         f"{ratio.get('ratio', float('nan')):.2f}x", f"{ratio.get('goal', 1.2):.2f}x"])
    return plots.table(["", "the engine (FP16)", "torch.compile + CUDA graph", "speed-up", "goal"], rows,
                       align="lrrrr", title=f"ResNet-50 beside torch.compile ({pt.get('compile_mode')}), "
                                            f"PyTorch {pt.get('torch')}", source=source)


def compile_text(t: dict) -> str:
    """Figure "resnet_compile": the engine's FP16 plans beside torch.compile (max-autotune) in a CUDA graph."""
    pt = t.get("pytorch", {})
    if not pt.get("available"):
        return f"torch.compile: {pt.get('why', 'not measured')}"
    lines = [f"ResNet-50 FP16 beside torch.compile ({pt.get('compile_mode')}, then a CUDA graph; PyTorch "
             f"{pt.get('torch')}, {pt.get('compile_s', 0):.0f} s compiling):"]
    for n, key in ((1, "FP16, batch 1"), (t["batch"], "FP16, batch 64")):
        row = next((r for r in pt["rows"] if r.get(f"b{n}", {}).get("ms")), None)
        ratio = t.get(f"fp16_vs_compile_b{n}", {})
        if row:
            lines.append(f"  batch {n:2d}: engine {t['engine'][key]['ms']:.3f} ms, torch.compile {row[f'b{n}']['ms']:.3f} ms: "
                         f"the engine {ratio.get('ratio', float('nan')):.2f}x its speed (goal {ratio.get('goal', 1.2):.2f}x)"
                         + ("" if ratio.get("ratio", 0) >= ratio.get("goal", 1.2) else "  NOT MET")
                         + (f" (run of {t['runs'][f'batch {n}']})" if f"batch {n}" in t.get("runs", {}) else ""))
    return "\n".join(lines)


def floored(t: dict) -> list:
    """``t["layers"]`` (the FP16 plan's steps at ``t["batch"]``), each convolution's bytes and memory floor computed
    again by ``E.layer_costs``: a record keeps the bandwidth it measured (its stored bytes over its stored memory
    floor) and the byte count comes from the model of today's code, so a record made before a correction of the model
    is read with the correction. Rows without bytes (other steps, made-up rows) are left as they are."""
    costs = {r["name"]: r for r in E.layer_costs(_optimised_for_costs(), t["batch"])}
    out = []
    for r in t["layers"]:
        c = costs.get(r["name"])
        if c and r.get("bytes") and r.get("memory_ms"):
            r = dict(r, bytes=c["bytes"], memory_ms=r["memory_ms"] * c["bytes"] / r["bytes"])
        out.append(r)
    return out


def plot(t: dict, source: str, **_):
    """Per-layer time at batch 64 against each layer's floor (the larger of its compute and memory floors)."""
    from gpucourse import plots

    convs = [r for r in floored(t) if r["kind"] == "conv"]
    xs = list(range(1, len(convs) + 1))
    return plots.lines({"measured": (xs, [r["ms"] * 1e3 for r in convs]),
                        "floor: max(FLOPs / peak, bytes / bandwidth)":
                            (xs, [max(r["compute_ms"], r["memory_ms"]) * 1e3 for r in convs])},
                       xlabel="convolution (in network order)", ylabel="µs at batch 64", logx=False, source=source,
                       title="ResNet-50 FP16 through the engine: each convolution against its floor")


def _over_floor(t: dict) -> list:
    """[(time over floor, name)] of the FP16 plan's convolutions, furthest above its floor first."""
    return sorted(((r["ms"] / max(r["compute_ms"], r["memory_ms"]), r["name"]) for r in floored(t)
                   if r["kind"] == "conv" and r.get("memory_ms")), reverse=True)


def floor_lines(t: dict) -> list:
    """What the per-layer figure and the agreement rows show, in lines: the convolutions furthest above their
    floors, the stem's step (outside the figure), and each 8-bit plan's top-1 agreement with what it kept in FP16."""
    over = _over_floor(t)
    stem = next((r for r in t["layers"] if r["kind"] == "stem"), None)
    r, e = t["ratios"], t["engine"]
    lines = ["furthest above their floors: " + ", ".join(f"{n.removesuffix('_conv')} {x:.1f}x" for x, n in over[:4])
             + f"; nearest: {over[-1][1].removesuffix('_conv')} {over[-1][0]:.1f}x"]
    if stem:
        lines.append(f"the stem and its max pool, one step (not in the figure): {stem['ms'] * 1e3:,.0f} µs at batch "
                     f"{t['batch']}")
    for p in ("int8", "fp8"):
        mixed = e.get(f"{p.upper()} (mixed), batch {t['batch']}", {})
        if f"top1_{p}" in r and mixed.get("fp16_share") is not None:
            lines.append(f"{p.upper()}: top-1 agreement {100 * r[f'top1_{p}']['ratio']:.1f}% in 8 bits everywhere; "
                         f"{100 * r[f'top1_{p}_mixed']['ratio']:.1f}% mixed, with {100 * mixed['fp16_share']:.0f}% "
                         "of the multiply-adds kept in FP16")
            if mixed.get("keep_fp16"):
                lines.append(f"{p.upper()} mixed: kept in FP16 {', '.join(mixed['keep_fp16'])}")
    return lines


def reading(t: dict) -> list:
    """What notebook 06's deep dive says in words about figure "resnet", each statement with whether it holds in
    ``t``: [(statement, True, False or None)], None where ``t`` lacks the figures (no FP8 plan below Hopper). Every
    record holds every statement (a records test asserts it)."""
    over = _over_floor(t)
    r, e, b = t["ratios"], t["engine"], t["batch"]

    def share(p):
        return e[f"{p.upper()} (mixed), batch {b}"]["fp16_share"]

    fp8 = "top1_fp8" in r and f"FP8 (mixed), batch {b}" in e
    return [
        ("no convolution of the FP16 plan runs below its floor", bool(over) and over[-1][0] >= 1),
        ("the 3 x 3 convolutions of 64 channels (conv2's) the furthest above their floors",
         len(over) >= 3 and all(n.startswith("conv2_") and n.endswith("_2_conv") for _, n in over[:3])),
        ("in 8 bits everywhere, FP8 agrees with FP32 on more inputs than INT8",
         (r["top1_fp8"]["ratio"] > r["top1_int8"]["ratio"]) if fp8 else None),
        ("yet the mixed FP8 plan keeps more of the multiply-adds in FP16 than the mixed INT8 plan",
         (share("fp8") > share("int8")) if fp8 else None),
        ("both mixed plans keep the first stages (conv1 to conv3) in FP16",
         claims.holds(lambda: all({"conv1", "conv2", "conv3"} <= set(e[f"{p} (mixed), batch {b}"]["keep_fp16"])
                                  for p in ("INT8", "FP8")) if fp8 else None)),
        ("the mixed FP8 plan runs conv5 alone in 8 bits",
         claims.holds(lambda: set(e[f"FP8 (mixed), batch {b}"]["keep_fp16"]) == {"conv1", "conv2", "conv3", "conv4"}
                      if fp8 else None)),
    ]


def bound_counts(floors: list) -> dict:
    """How many convolutions of each kernel size are memory-bound, from kernels.inference_engine.floors:
    {"1x1": (memory-bound, of), "3x3": ..., "7x7": ...}."""
    out = {}
    for r in floors:
        size = r["kernel"].split("/")[0]
        memory, total = out.get(size, (0, 0))
        out[size] = (memory + (r["bound"] == "memory"), total + 1)
    return dict(sorted(out.items()))


def bound_line(floors: list) -> str:
    """``bound_counts`` as a line of text."""
    return "memory-bound: " + ", ".join(f"{k} {m} of {n}" for k, (m, n) in bound_counts(floors).items())


def mixed_bound(t: dict) -> dict:
    """What the mixed plans (``MIXED``: the layers that keep the top-1 agreement at 99% stay in FP16) could reach
    with perfect 8-bit kernels, from the per-layer times of one run: the FP16 plan's steps summed, against the same
    sum with the 8-bit layers as measured in the mixed plan, at half their FP16 time (the 8-bit tensor cores' rate is
    twice FP16's, their bytes half), and at their 8-bit floors (the larger of FLOPs at twice the FP16 peak and bytes
    at one byte an element over the measured bandwidth); the reformat steps as measured. Returns {plan: {"share": the
    8-bit layers' part of the FP16 plan's time, "top1": agreement, "everywhere": speed-up of the plan in 8 bits
    everywhere, "measured" / "half" / "floor": speed-ups over the FP16 plan}}."""
    fp16 = floored(t)
    total = sum(r["ms"] for r in fp16)
    out = {}
    for key, plan in t.get("layers_by_plan", {}).items():
        row = t["engine"].get(key, {})
        keep = row.get("keep_fp16")
        if not keep:
            continue
        eight = [r for r in fp16 if r["kind"] == "conv" and not any(r["name"].startswith(k) for k in keep)]
        t8 = sum(r["ms"] for r in eight)
        reformat = sum(r["ms"] for r in plan if r["kind"] == "reformat")
        floor = sum(max(r["compute_ms"], r["memory_ms"]) / 2 for r in eight)
        everywhere = key.replace(" (mixed)", "")
        out[key] = {"share": t8 / total,
                    "top1": t.get("agreement", {}).get(key, {}).get("top1"),
                    "everywhere": (total / sum(r["ms"] for r in t["layers_by_plan"][everywhere])
                                   if everywhere in t["layers_by_plan"] else None),
                    "top1_everywhere": t.get("agreement", {}).get(everywhere, {}).get("top1"),
                    "measured": total / sum(r["ms"] for r in plan),
                    "half": total / (total - t8 + t8 / 2 + reformat),
                    "floor": total / (total - t8 + floor + reformat)}
    return out


def mixed_bound_text(t: dict) -> str:
    goal = GOALS["int8_vs_fp16"]
    lines = [f"speed over the FP16 plan at batch {t['batch']}, from the per-layer times summed (goal {goal:g}x with "
             f"{100 * GOALS['top1_agreement']:.0f}% top-1 agreement):"]
    for key, b in mixed_bound(t).items():
        p = key.split(" ")[0]
        if b["everywhere"]:
            lines.append(f"  {p} everywhere: {b['everywhere']:.2f}x, top-1 {100 * (b['top1_everywhere'] or 0):.1f}%")
        lines.append(f"  {p}, mixed ({100 * b['share']:.0f}% of the FP16 plan's time in 8 bits): {b['measured']:.2f}x "
                     f"measured, top-1 {100 * (b['top1'] or 0):.1f}%; {b['half']:.2f}x with those layers at half their "
                     f"FP16 time, {b['floor']:.2f}x at their 8-bit floors")
    return "\n".join(lines)


def mixed_bound_view(t: dict, source: str = ""):
    """``mixed_bound`` as a table: each 8-bit plan's speed over the FP16 plan, in 8 bits everywhere and mixed (as
    measured, with its 8-bit layers at half their FP16 time, and at their 8-bit floors), with its top-1 agreement."""
    from gpucourse import plots

    rows = []
    for key, b in mixed_bound(t).items():
        p = key.split(" ")[0]
        if b["everywhere"]:
            rows.append([f"{p} everywhere", f"{b['everywhere']:.2f}x", "", "", "",
                         f"{100 * (b['top1_everywhere'] or 0):.1f}%"])
        rows.append([f"{p} mixed ({100 * b['share']:.0f}% of FP16's time in 8 bits)", f"{b['measured']:.2f}x",
                     f"{b['half']:.2f}x", f"{b['floor']:.2f}x", "", f"{100 * (b['top1'] or 0):.1f}%"])
    for r in rows:
        r[4] = f"{GOALS['int8_vs_fp16']:g}x"
    return plots.table(["plan", "measured", "8-bit layers at half FP16's time", "at their 8-bit floors", "goal",
                        "top-1 agreement"], rows, align="lrrrrr",
                       title=f"ResNet-50, batch {t['batch']}: the 8-bit plans over FP16, from the per-layer times",
                       source=source)


def plot_mixed_bound(t: dict, source: str, **_):
    """The 8-bit plans' speed over FP16, measured and with perfect 8-bit kernels in the mixed plans, against the
    goal."""
    from gpucourse import plots

    values = {}
    for key, b in mixed_bound(t).items():
        p = key.split(" ")[0]
        if b["everywhere"]:
            values[f"{p} everywhere ({100 * (b['top1_everywhere'] or 0):.1f}% agree)"] = b["everywhere"]
        values[f"{p} mixed, measured ({100 * (b['top1'] or 0):.1f}%)"] = b["measured"]
        values[f"{p} mixed, 8-bit layers at half FP16's time"] = b["half"]
        values[f"{p} mixed, 8-bit layers at their floors"] = b["floor"]
    return plots.bars(values, unit="x FP16", source=source, goal=("goal", GOALS["int8_vs_fp16"]),
                      title=f"ResNet-50, batch {t['batch']}: 8-bit plans over FP16")

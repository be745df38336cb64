"""Lesson 6's digits network in one kernel on a GPU (build_plan(fuse_network=True),
kernels/cuda/inference_engine_network.cu), to choose its tile sizes and see where it stands: in FP32, FP16 and INT8,
at batch 1 and at batch 256, the one-kernel engine with every tile size this GPU runs (rows of an image a block:
network.TILE_ROWS) and with the rule's choice (network.tile_rows), beside the tuned "fused + graph" plan (8 kernels)
and, where PyTorch is installed, PyTorch's best (torch.compile max-autotune + CUDA graph, and eager PyTorch's CUDA
graph), all timed as the engines table times them (benchmarks/inference_engine.py: end to end, CUDA events around
one call from an idle GPU, median of 30 after 5 warm-ups; GPU only, calls queued behind a hold kernel), every engine
a CUDA graph. Each engine's logits on the 397 held-out digits are checked against the NumPy runtime of its plan
first.

    python benchmarks/inference_engine_network_sweep.py [--repeats 30] [--compile-budget 60] [--json PATH]

torch.compile with max-autotune takes 10-35 s a shape (4 shapes, FP16's first); --compile-budget: no compile starts
once this many seconds have gone to compiling (0: no torch.compile rows). The newest record's PyTorch best on this
GPU is printed beside the one kernel either way.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.inference_engine_model import NETWORK, OPTIMISED as FUSED  # noqa: E402

BATCH = 256


def measure(repeats: int = 30, compile_budget_s: float = 60.0) -> dict:
    from benchmarks import inference_engine_model as lesson
    from benchmarks import inference_engine_pytorch as R
    from gpucourse import bench, records, runtime
    from kernels import inference_engine as E
    from kernels.inference_engine import network as N

    runtime.require_gpu("timing the network kernel")
    cp = runtime.cupy()
    t0 = time.perf_counter()
    g, stages, d = lesson.load()
    fused = stages[-1][1]
    attrs = cp.cuda.Device().attributes
    sms, smem = attrs["MultiProcessorCount"], attrs["MaxSharedMemoryPerBlockOptin"]
    rng = np.random.default_rng(0)  # the images engine_table times: 8 single ones, 4 full batches
    x1 = [cp.asarray(d["x_test"][i:i + 1]) for i in rng.choice(len(d["x_test"]), 8, replace=False)]
    xb = [cp.asarray(d["x_test"][rng.choice(len(d["x_test"]), BATCH)]) for _ in range(4)]

    refs = {}

    def timed(name, precision, plan, eng, rows=None) -> dict:
        if id(plan) not in refs:
            refs[id(plan)] = E.predict(E.Engine(plan, numpy=True), d["x_test"])
        ref, got = refs[id(plan)], E.predict(eng, d["x_test"])
        row = {"name": name, "precision": precision, "rows": rows, "kernels": plan.launches,
               "accuracy": float(np.mean(got.argmax(1) == d["y_test"])),
               "max_diff_numpy": float(np.abs(got - ref).max() / np.abs(ref).max())}
        for n, xs in ((1, x1), (BATCH, xb)):
            it = iter(xs * 10000)

            def setup():
                buf = eng.input_buffer(n)
                buf[...] = next(it)
                return buf
            e2e = bench.time_gpu(lambda x: eng.infer(x), setup=setup, repeats=repeats, warmup=5)
            buf = setup()
            gpu = bench.time_per_call(lambda: eng.infer(buf), batch=8, repeats=max(repeats // 3, 5))
            row[f"ms_{n}"], row[f"gpu_ms_{n}"] = e2e.median_ms, gpu.median_ms
        return row

    rows, engines = [], {}
    for p in ("fp32", "fp16", "int8"):
        P = p.upper()
        b0 = time.perf_counter()
        plan = E.build_plan(fused, precision=p, max_batch=BATCH, x_calib=d["x_calib"], name=f"fused, {P}")  # tuned
        eng = E.Engine(plan, graphs=True)
        engines[f"{FUSED}, {P}"] = (plan, eng, time.perf_counter() - b0)
        rows.append(timed(f"{FUSED}, {P}", p, plan, eng))
        net = E.build_plan(fused, precision=p, max_batch=BATCH, x_calib=d["x_calib"], name=f"{NETWORK}, {P}",
                          fuse_network=True)
        for r in [r for r in N.TILE_ROWS if N.smem_bytes(p, r) <= smem] + [None]:
            net.steps[0]["tile_rows"] = r  # None last: the rule's choice, the engine PyTorch is compared with
            eng = E.Engine(net, graphs=True)
            rule = f"{N.tile_rows(1, sms, smem, p)} / {N.tile_rows(BATCH, sms, smem, p)} rows"
            label = f"{NETWORK}, {P}" + (f", {r} rows" if r else f" (rule: {rule})")
            rows.append(timed(label, p, net, eng, r))
        engines[f"{NETWORK}, {P}"] = (net, eng, 0.0)
        print(f"{P}: timed in {time.perf_counter() - b0:.0f} s", file=sys.stderr)
    out = {"gpu": runtime.get().device["name"], "sms": sms, "batch": BATCH, "repeats": repeats, "rows": rows}
    left = compile_budget_s if compile_budget_s > 0 else 0.0
    variants = ("CUDA graph, NHWC",) + (("torch.compile + CUDA graph",) if left > 0 else ())
    # FP16 first: its goals are the hard ones, and the compile budget may run out before the last shape
    out["pytorch"] = R.table(g, engines, d, repeats=repeats, variants=variants, compile_budget_s=left,
                             precisions=("fp16", "fp32"))
    rec = records.latest(lesson.LESSON, out["gpu"])
    torch_rec = (rec or {}).get("figures", {}).get("pytorch") or {}
    if torch_rec.get("available"):
        out["recorded_pytorch_best"] = {
            f"{p}_{w}": min((r[f"{w}_ms"], r["name"]) for r in torch_rec["rows"]
                            if r["precision"] == p and r.get(f"{w}_ms"))
            for p in R.PRECISIONS for w in ("latency", "batch")}
        out["recorded_on"] = rec["date"]
    out["seconds"] = time.perf_counter() - t0
    return out


def text(t: dict) -> str:
    from benchmarks import inference_engine_pytorch as R

    b = t["batch"]
    lines = [f"{t['gpu']} ({t['sms']} SMs), every engine a CUDA graph; µs, median of {t['repeats']}",
             f"{'engine':62} {'kernels':>7} {'batch 1':>8} {'(GPU)':>7} {'batch ' + str(b):>9} {'(GPU)':>7} "
             f"{'accuracy':>8} {'vs NumPy':>9}"]
    for r in t["rows"]:
        lines.append(f"{r['name']:62} {r['kernels']:7d} {1000 * r['ms_1']:8.1f} {1000 * r['gpu_ms_1']:7.1f} "
                     f"{1000 * r[f'ms_{b}']:9.1f} {1000 * r[f'gpu_ms_{b}']:7.1f} {100 * r['accuracy']:7.2f}% "
                     f"{r['max_diff_numpy']:9.1e}")
    by = {(r["precision"], r["rows"], r["name"].startswith(NETWORK)): r for r in t["rows"]}
    for p in ("fp32", "fp16", "int8"):
        one, fused = by[(p, None, True)], by[(p, None, False)]
        best = {n: min((r for r in t["rows"] if r["precision"] == p and r["rows"]), key=lambda r: r[f"ms_{n}"])
                for n in (1, b)}
        lines.append(f"{p.upper()}: one kernel over fused + graph {fused['ms_1'] / one['ms_1']:.2f}x at batch 1, "
                     f"{fused[f'ms_{b}'] / one[f'ms_{b}']:.2f}x at batch {b}; fastest tiles: {best[1]['rows']} rows at "
                     f"batch 1, {best[b]['rows']} at batch {b}")
    i8, f16 = by[("int8", None, True)], by[("fp16", None, True)]
    lines.append(f"one kernel, INT8 over FP16 at batch {b}: {f16[f'ms_{b}'] / i8[f'ms_{b}']:.2f}x end to end, "
                 f"{f16[f'gpu_ms_{b}'] / i8[f'gpu_ms_{b}']:.2f}x GPU only (goal 1.3x)")
    lines += ["", R.text(t["pytorch"])]
    best = t.get("recorded_pytorch_best")
    if best:  # the record's PyTorch best on this GPU, for the cells whose torch.compile the budget left out
        lines.append(f"recorded PyTorch best on this GPU ({t['recorded_on']}), and the one kernel (rule) against it:")
        for key, (ms, name) in best.items():
            p, w = key.split("_")
            one = by[(p, None, True)][f"ms_{1 if w == 'latency' else b}"]
            lines.append(f"  {p.upper()} batch {1 if w == 'latency' else b}: {1000 * ms:6.1f} µs ({name}); one kernel "
                         f"{1000 * one:6.1f} µs: {ms / one:.2f}x (goal 1.2x)")
    lines.append(f"(the whole sweep: {t['seconds']:.0f} s)")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--compile-budget", type=float, default=60.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    t = measure(args.repeats, args.compile_budget)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(t, indent=1, default=str))
    print(text(t))


if __name__ == "__main__":
    main()

"""Lesson 10's row softmax on a GPU, to choose the Hopper kernel's shapes: for rows of 1k to 32k elements, FP32 and
FP16, the GB/s (bytes read + written) of the online kernel (one block a row), of the cluster kernel with the shape
SOFTMAX_PLAN gives it (kernels/attention/row_softmax.py), of every other shape the kernels can run
(row_softmax.sweep_shapes: each cluster size and loads a thread, a warp per row with each block), of torch.softmax,
and of the device-to-device copy of the same bytes, all on the same data in the same run. Every kernel's output
is checked against NumPy (a row of -inf among them) before it is timed. Prints the table, then each (dtype, n)'s
shapes fastest first, then SOFTMAX_PLAN with the fastest shapes, to paste into row_softmax.py.

    python benchmarks/softmax_sweep.py [--lengths 1024,4096] [--bytes 1073741824] [--repeats 15] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import gpucourse  # noqa: E402

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def measure(lengths=LENGTHS, total_bytes: int = 2**30, repeats: int = 15) -> dict:
    from gpucourse import bench, runtime
    from kernels.attention import row_softmax as R
    from kernels.attention.specs import softmax_spec

    cp = runtime.cupy()
    torch = _torch()
    why = R.cluster_missing()
    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    out = {"gpu": dev["name"].decode() if isinstance(dev["name"], bytes) else dev["name"],
           "versions": f"CuPy {cp.__version__}" + (f", PyTorch {torch.__version__}" if torch is not None else ""),
           "cluster_missing": why, "lengths": list(lengths), "plan": {d: {k: list(v) for k, v in p.items()}
                                                                       for d, p in R.SOFTMAX_PLAN.items()}, "runs": {}}
    for dtype in ("float32", "float16"):
        runs = out["runs"][dtype] = []
        for n in lengths:
            rows = total_bytes // (n * np.dtype(dtype).itemsize)
            x = (cp.random.standard_normal((rows, n), dtype=cp.float32) * 3).astype(dtype)
            x[1] = -cp.inf  # a row of -inf: zeros out
            o = cp.empty_like(x)
            want = softmax_spec(x[:4].get())
            nbytes = 2 * x.nbytes

            def timed(name, launch, check=True):
                o.fill(cp.nan)
                launch()
                if check:
                    got = o[:4].get().astype(np.float64)
                    err = float(np.abs(got - want).max())
                    if not err <= (2e-3 if dtype == "float16" else 1e-5) or got[1].any():
                        raise runtime.CourseError(f"{name} ({dtype}, rows of {n}) is wrong: error {err:.1e}")
                return bench.time_gpu(launch, warmup=2, repeats=repeats).gbps(nbytes)

            run = {"n": n, "rows": rows, "shapes": {}}
            run["copy"] = timed("copy", lambda: o.data.copy_from_device_async(x.data, x.nbytes), check=False)
            run["online"] = timed("online", lambda: R.softmax_cuda_c(x, o, "online"))
            if torch is not None:
                tx, to = torch.from_dlpack(x), torch.from_dlpack(o)
                # torch.softmax gives NaN for a row of -inf (the course's kernels give zeros): not checked here
                run["torch.softmax"] = timed("torch.softmax", lambda: torch.softmax(tx, dim=-1, out=to), check=False)
            if why is None:
                plan = R.cluster_shape(n, dtype)
                run["plan_shape"], run["errors"] = list(plan), {}
                for shape in [plan] + [s for s in R.sweep_shapes(n, dtype) if s != plan]:
                    try:  # a shape that fails is reported, and the others still measured
                        run["shapes"][repr(shape)] = timed(f"shape {shape}", lambda s=shape: R.softmax_cuda_c(
                            x, o, "cluster", shape=s))
                    except Exception as exc:  # noqa: BLE001
                        run["errors"][repr(shape)] = f"{type(exc).__name__}: {exc}"[:300]
                if repr(plan) in run["shapes"]:
                    run["cluster"] = run["shapes"][repr(plan)]
                if run["shapes"]:
                    best = max(run["shapes"], key=run["shapes"].get)
                    run["best_shape"], run["best"] = best, run["shapes"][best]
            runs.append(run)
            del x, o
            cp.get_default_memory_pool().free_all_blocks()
            print(f"  {dtype} n = {n}: done", file=sys.stderr, flush=True)
    return out


def text(t: dict) -> str:
    lines = [f"{t['gpu']} ({t.get('versions', '')}): GB/s (bytes read + written); ratios to the device-to-device "
             f"copy of the same bytes"]
    if t["cluster_missing"]:
        lines.append(f"no cluster kernel here: {t['cluster_missing']}")
    cols = [("online", "online (old)"), ("cluster", "cluster (plan)"), ("best", "best shape"),
            ("torch.softmax", "torch.softmax"), ("copy", "copy")]
    for dtype, runs in t["runs"].items():
        lines.append(f"\n{dtype}:")
        lines.append(f"  {'N':>6} " + " ".join(f"{label:>15}" for _, label in cols)
                     + "   old/copy  plan/copy  best/copy  plan/torch  plan shape -> best shape")
        for r in runs:
            g = [r.get(k) for k, _ in cols]
            ratio = lambda k: f"{r[k] / r['copy']:9.2f}" if k in r else f"{'-':>9}"  # noqa: E731
            both = "cluster" in r and "torch.softmax" in r
            vs_torch = f"{r['cluster'] / r['torch.softmax']:10.2f}" if both else f"{'-':>10}"
            lines.append(f"  {r['n']:>6} " + " ".join(f"{v:15.0f}" if v is not None else f"{'-':>15}" for v in g)
                         + f"  {ratio('online')}  {ratio('cluster')}  {ratio('best')}  {vs_torch}  "
                         + (f"{tuple(r['plan_shape'])} -> {r.get('best_shape', '-')}" if "plan_shape" in r else ""))
    errors = [f"  {dtype} {r['n']}: {shape}: {err}" for dtype, runs in t["runs"].items() for r in runs
              for shape, err in r.get("errors", {}).items()]
    if errors:
        lines += ["\nFAILED shapes:", *errors]
    if not t["cluster_missing"]:
        lines.append("\nevery shape, fastest first (GB/s, / copy):")
        for dtype, runs in t["runs"].items():
            for r in runs:
                ranked = sorted(r["shapes"].items(), key=lambda kv: -kv[1])
                lines.append(f"  {dtype} {r['n']:>6}: " + ", ".join(
                    f"{s}{'*' if s == repr(tuple(r['plan_shape'])) else ''} {g:.0f} ({g / r['copy']:.2f})"
                    for s, g in ranked))
        lines.append("\nSOFTMAX_PLAN with the fastest shapes (paste into kernels/attention/row_softmax.py; "
                     "* above marks the current plan):")
        lines.append("SOFTMAX_PLAN = {")
        for dtype, runs in t["runs"].items():
            lines.append(f'    "{dtype}": {{')
            for r in runs:
                lines.append(f"        {r['n']}: {r.get('best_shape', tuple(r['plan_shape']))},")
            lines.append("    },")
        lines.append("}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="row lengths, comma-separated")
    ap.add_argument("--bytes", type=int, default=2**30, help="bytes of input a run reads (and writes)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", help="also write the measurements here")
    args = ap.parse_args(argv)
    gpucourse.setup("gpu", quiet=True)
    t = measure(tuple(int(v) for v in args.lengths.split(",")), args.bytes, args.repeats)
    print(text(t))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(t, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

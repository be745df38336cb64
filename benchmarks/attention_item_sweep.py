"""What a work item of lesson 10's Hopper attention kernel costs beside its tiles.

flash_wgmma (kernels/cuda/attention_wgmma.cu), ping-pong, d = 128, not causal, at N = 512 .. 4k, each run doing the
work of 32 heads of 16k (heads = 32 (16k / N)^2), so that only the items' length changes (N / 128 tiles an item);
then a least-squares fit of TFLOP/s = P T / (T + X) over them: X is an item's fixed cost in tiles. Causal runs at 4k
and 16k beside them, whose items average (N / 128 + 1) / 2 tiles. The fit stops at 4k: beyond it other effects move
the figure (on an H100, 554 TFLOP/s at 8k, 640 at 16k). Head 0's output is checked against the NumPy reference
first.
Notebook 10 quotes its H100 figures.

    python benchmarks/attention_item_sweep.py [--repeats 7] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from kernels.attention import specs  # noqa: E402

D = 128
WORK_HEADS, WORK_N = 32, 16384  # every run does the work of 32 heads of 16k, not causal
FIT_N = (512, 1024, 2048, 4096)
CAUSAL_N = (4096, 16384)


def _check(q, k, v, o, causal: bool) -> float:
    """The largest error of head 0's output against the float64 NumPy reference (specs.attention_spec); causal, on
    its first 2048 rows and keys only, which is all those rows see."""
    m = min(q.shape[1], 2048) if causal else q.shape[1]
    want, _ = specs.attention_spec(*(a[0, :m].get() for a in (q, k, v)), causal=causal)
    return float(np.abs(want - o[0, :m].get().astype(np.float64)).max())


def measure(repeats: int = 7) -> dict:
    from gpucourse import bench, gpus, runtime
    from kernels.attention import flash

    runtime.require_gpu("timing the Hopper attention kernel's work items")
    gpus.require("wgmma", what="flash_wgmma")
    cp = runtime.cupy()
    runs = []
    for n, causal in bench.progress([(n, False) for n in FIT_N] + [(n, True) for n in CAUSAL_N], desc="N"):
        heads = WORK_HEADS * (WORK_N // n) ** 2 * (2 if causal else 1)  # causal: half the work a head
        rng = cp.random.default_rng(0)
        q, k, v = (rng.standard_normal((heads, n, D), dtype=cp.float32).astype(cp.float16) for _ in range(3))
        err = _check(q, k, v, flash.flash_wgmma(q, k, v, causal=causal, variant="pingpong")[0], causal)
        if not err < 2e-2:
            raise runtime.CourseError(f"flash_wgmma (N = {n}, causal {causal}) is wrong: error {err:.1e}")
        t = bench.time_per_call(lambda: flash.flash_wgmma(q, k, v, causal=causal, variant="pingpong"), batch=4,
                                repeats=repeats)
        runs.append({"N": n, "causal": causal, "heads": heads, "tiles_an_item": (n // 128 + 1) / 2 if causal
                     else n // 128, "ms": t.median_ms,
                     "tflops": t.tflops(specs.attention_flops(1, heads, n, D, causal=causal)),
                     "timing": t.summary(), "error": err})
        del q, k, v
        cp.get_default_memory_pool().free_all_blocks()
    peak, cost = fit([(r["tiles_an_item"], r["tflops"]) for r in runs if not r["causal"]])
    return {"gpu": runtime.get().device["name"], "d": D, "runs": runs, "peak_fit_tflops": peak,
            "item_cost_tiles": cost}


def fit(points) -> tuple:
    """(P, X) of TFLOP/s = P T / (T + X) for points (T tiles an item, TFLOP/s), by least squares on its linear form
    1 / TFLOP/s = (1 / P) + (X / P) (1 / T). At least two distinct T."""
    if len({t for t, _ in points}) < 2:
        raise ValueError("the fit needs runs of at least two item lengths")
    a, b = np.linalg.lstsq(np.array([[1.0, 1.0 / t] for t, _ in points]), np.array([1.0 / f for _, f in points]),
                           rcond=None)[0]
    return float(1 / a), float(b / a)


def text(t: dict) -> str:
    lines = [f"{t['gpu']}: flash_wgmma, ping-pong, d = {t['d']}, the work of {WORK_HEADS} heads of {WORK_N} a run:",
             f"  {'N':>6} {'causal':>6} {'heads':>6} {'tiles/item':>10} {'ms':>8} {'TFLOP/s':>8}"]
    for r in t["runs"]:
        lines.append(f"  {r['N']:>6} {str(r['causal']):>6} {r['heads']:>6} {r['tiles_an_item']:>10.1f} "
                     f"{r['ms']:>8.3f} {r['tflops']:>8.1f}")
    lines.append(f"fit over N = {', '.join(map(str, FIT_N))} (not causal): P = {t['peak_fit_tflops']:.0f} TFLOP/s, "
                 f"an item's fixed cost X = {t['item_cost_tiles']:.2f} tiles")
    for r in t["runs"]:
        if r["causal"]:
            x = t["item_cost_tiles"]
            lines.append(f"  causal N = {r['N']}: items of {r['tiles_an_item']:.1f} tiles on average, so X is "
                         f"{100 * x / (r['tiles_an_item'] + x):.1f}% of the run")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    from gpucourse import runtime

    try:
        t = measure(args.repeats)
    except runtime.CourseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(text(t))
    if args.json:
        args.json.write_text(json.dumps(t, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where one block of lesson 5's digits network in one kernel spends its time: the kernel's `network` region with a
clock stamp (clock64, thread 0) after each of its barriers, run in place of the region (cuda_c's edits), at 16 rows
a block (a whole image; the step's buffer for the tiles' shares of the logits is free then and takes the stamps).
For FP16 and INT8 at a batch (256: every block resident, about two an SM) and for one block alone, the median
cycles of each phase over the blocks:

    image   zeros in the planes, the image as the stem reads it
    stem    the 3 x 3 stem
    1x1     the 1 x 1 reductions, the 1 x 1 branch, the max pool + 1 x 1 branch
    3x3/5x5 the 3 x 3 and 5 x 5 branches
    head    the average pool and the dense layer

    python benchmarks/inference_engine_network_phases.py [--batch 256] [--runs 5]

Cycles are the SM's clock (nvidia-smi's SM clock says how many a microsecond); the stamps add a few instructions a
phase to thread 0 alone.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

PHASES = ("image", "stem", "1x1", "3x3/5x5", "head")
ROWS = 16  # a block a whole image: the tiles' shares of the logits are not used, their buffer holds the stamps
WORDS = 16  # stamps a block: PHASES and the SM it ran on


def stamped_region() -> str:
    """The `network` region with a stamp at its start, after each barrier and at its end; thread 0 writes each
    phase's end, in cycles from the start, into partial (as unsigned words, WORDS a block; word 0 the SM)."""
    from gpucourse import cuda_c
    from kernels.inference_engine import network as N

    text = cuda_c.region(N.SOURCE, "network")
    stamp = "    if (threadIdx.x == 0) stamps[{}] = clock64();\n"
    head = text.index("    const int tid = threadIdx.x")
    text = text[:head] + "    long long stamps[8];\n" + stamp.format(0) + text[head:]
    k = iter(range(1, 8))
    text = re.sub(r"    __syncthreads\(\);\n", lambda m: m.group(0) + stamp.format(next(k)), text)
    last = next(k)
    if last != len(PHASES):
        raise RuntimeError(f"the network region has {last - 1} barriers; this benchmark knows {len(PHASES) - 1}")
    end = text.rindex("}")
    return (text[:end] + stamp.format(last) + f"""    if (threadIdx.x == 0) {{
        unsigned* o = reinterpret_cast<unsigned*>(partial) + blockIdx.x * {WORDS};
        for (int i = 1; i <= {last}; ++i) o[i] = (unsigned)(stamps[i] - stamps[0]);
        asm("mov.u32 %0, %%smid;" : "=r"(o[0]));
    }}
""" + text[end:])


def measure(batch: int = 256, runs: int = 5) -> dict:
    from benchmarks import inference_engine as lesson
    from gpucourse import cuda_c, runtime
    from kernels import inference_engine as E
    from kernels.inference_engine import network as N

    runtime.require_gpu("stamping the network kernel's phases")
    cp = runtime.cupy()
    _, stages, d = lesson.load()
    region = stamped_region()
    x = d["x_test"][np.arange(batch) % len(d["x_test"])].astype(np.float32)
    out = {"gpu": runtime.get().device.get("name"), "batch": batch, "runs": runs, "phases": list(PHASES), "rows": []}
    for p in ("fp16", "int8"):
        plan = E.build_plan(stages[-1][1], precision=p, max_batch=batch, x_calib=d["x_calib"], tune=False,
                            fuse_network=True)
        plan.steps[0]["tile_rows"] = ROWS
        eng = E.Engine(plan)
        _, grid, block, args, smem = N.prepare(eng, plan.steps[0], batch)
        fn = cuda_c.function(N.SOURCE, f"network_{E.SUFFIX[p]}_{ROWS}", edits={"network": region})
        fn.max_dynamic_shared_size_bytes = smem
        xs = cp.asarray(x)
        for blocks, what in ((grid[0], f"batch {batch}"), (1, "one block alone")):
            for _ in range(runs):  # the last run's stamps: the weights warm in L2, as in a timed run
                fn((blocks,), block, (xs,) + tuple(args[1:]), shared_mem=smem)
            cp.cuda.Device().synchronize()
            words = args[3].view(cp.uint32)[:blocks * WORDS].reshape(blocks, WORDS).get().astype(np.int64)
            ends = np.median(words[:, 1:len(PHASES) + 1], axis=0)
            cycles = np.diff(np.concatenate([[0.0], ends]))
            out["rows"].append({"precision": p, "what": what, "blocks": int(blocks),
                                "sms": int(len(np.unique(words[:, 0]))),
                                "cycles": dict(zip(PHASES, map(float, cycles))), "total": float(ends[-1])})
    return out


def text(t: dict) -> str:
    lines = [f"{t['gpu']}: the one-kernel network, median cycles a phase over the blocks (16 rows a block)",
             f"{'':26}" + "".join(f"{ph:>9}" for ph in t["phases"]) + f"{'total':>9}"]
    for r in t["rows"]:
        lines.append(f"{r['precision'].upper() + ', ' + r['what']:26}"
                     + "".join(f"{r['cycles'][ph]:9.0f}" for ph in t["phases"]) + f"{r['total']:9.0f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    from gpucourse import runtime

    runtime.setup("gpu")
    print(text(measure(args.batch, args.runs)))


if __name__ == "__main__":
    main()

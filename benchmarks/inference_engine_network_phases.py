"""Where one block of lesson 6's digits network in one kernel spends its time: the kernel's `network` region with a
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
phase to thread 0 alone. Thread 0 also reads the GPU's global timer (nanoseconds, the same clock in every SM) as its
block starts and ends: from the first block's start to the last block's end is the kernel's span, and the time a
call takes (the plain kernel, CUDA events, calls back to back, FP16 and INT8 in turns) less the span is the launch
and the gap between calls.

``bound`` turns one run into the question the lesson's INT8 goal asks (INT8 at 1.3x FP16's speed at this batch):
what INT8 would take with each phase but the 3 x 3 and 5 x 5 branches at the cycles of the faster precision there
(most of that work is each output's epilogue, which 8 bits make longer, not shorter), and then with the branches at
half FP16's cycles too (the tensor cores' INT8 rate is twice their FP16 rate): a kernel at the ideal in both; ``plot``
draws the four as where one call's time goes.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

PHASES = ("image", "stem", "1x1", "3x3/5x5", "head")
BRANCHES = "3x3/5x5"  # the phase where INT8's tensor cores do most of the work
ROWS = 16  # a block a whole image: the tiles' shares of the logits are not used, their buffer holds the stamps
WORDS = 16  # stamps a block: word 0 the SM, 1.. the PHASES' ends, GLOBAL.. the global timer at the start and the end
GLOBAL = 6  # (a 64-bit word at words 6-7, another at 8-9: 8-byte aligned, as a block's 16 words are 64 bytes)


def stamped_region() -> str:
    """The `network` region with a stamp at its start, after each barrier and at its end; thread 0 writes each
    phase's end, in cycles from the start, into partial (as unsigned words, WORDS a block; word 0 the SM)."""
    from gpucourse import cuda_c
    from kernels.inference_engine import network as N

    text = cuda_c.region(N.SOURCE, "network")
    stamp = "    if (threadIdx.x == 0) stamps[{}] = clock64();\n"
    timer = "    if (threadIdx.x == 0) asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(ns[{}]));\n"
    head = text.index("    const int tid = threadIdx.x")
    text = (text[:head] + "    long long stamps[8];\n    unsigned long long ns[2];\n" + timer.format(0)
            + stamp.format(0) + text[head:])
    k = iter(range(1, 8))
    text = re.sub(r"    __syncthreads\(\);\n", lambda m: m.group(0) + stamp.format(next(k)), text)
    last = next(k)
    if last != len(PHASES):
        raise RuntimeError(f"the network region has {last - 1} barriers; this benchmark knows {len(PHASES) - 1}")
    end = text.rindex("}")
    return (text[:end] + stamp.format(last) + timer.format(1) + f"""    if (threadIdx.x == 0) {{
        unsigned* o = reinterpret_cast<unsigned*>(partial) + blockIdx.x * {WORDS};
        for (int i = 1; i <= {last}; ++i) o[i] = (unsigned)(stamps[i] - stamps[0]);
        asm("mov.u32 %0, %%smid;" : "=r"(o[0]));
        reinterpret_cast<unsigned long long*>(o + {GLOBAL})[0] = ns[0];
        reinterpret_cast<unsigned long long*>(o + {GLOBAL})[1] = ns[1];
    }}
""" + text[end:])


def measure(batch: int = 256, runs: int = 5) -> dict:
    from benchmarks.inference_engine_model import load
    from gpucourse import bench, cuda_c, runtime
    from kernels import inference_engine as E
    from kernels.inference_engine import network as N

    runtime.require_gpu("stamping the network kernel's phases")
    cp = runtime.cupy()
    _, stages, d = load()
    region = stamped_region()
    xs = cp.asarray(d["x_test"][np.arange(batch) % len(d["x_test"])].astype(np.float32))
    out = {"gpu": runtime.get().device.get("name"), "batch": batch, "runs": runs, "phases": list(PHASES), "rows": [],
           "call_us": {}}
    calls = {}
    for p in ("fp16", "int8"):
        plan = E.build_plan(stages[-1][1], precision=p, max_batch=batch, x_calib=d["x_calib"], tune=False,
                            fuse_network=True)
        plan.steps[0]["tile_rows"] = ROWS
        eng = E.Engine(plan)
        plain, grid, block, args, smem = N.prepare(eng, plan.steps[0], batch)
        args = (xs,) + tuple(args[1:])
        calls[p] = lambda plain=plain, grid=grid, block=block, args=args, smem=smem: plain(grid, block, args,
                                                                                           shared_mem=smem)
        fn = cuda_c.function(N.SOURCE, f"network_{E.SUFFIX[p]}_{ROWS}", edits={"network": region})
        fn.max_dynamic_shared_size_bytes = smem
        for blocks, what in ((grid[0], f"batch {batch}"), (1, "one block alone")):
            for _ in range(runs):  # the last run's stamps: the weights warm in L2, as in a timed run
                fn((blocks,), block, args, shared_mem=smem)
            cp.cuda.Device().synchronize()
            words = args[3].view(cp.uint32)[:blocks * WORDS].reshape(blocks, WORDS).get().astype(np.int64)
            ends = np.median(words[:, 1:len(PHASES) + 1], axis=0)
            cycles = np.diff(np.concatenate([[0.0], ends]))
            ns = words[:, GLOBAL:GLOBAL + 4:2] + (words[:, GLOBAL + 1:GLOBAL + 4:2] << 32)  # start, end
            out["rows"].append({"precision": p, "what": what, "blocks": int(blocks),
                                "sms": int(len(np.unique(words[:, 0]))),
                                "cycles": dict(zip(PHASES, map(float, cycles))), "total": float(ends[-1]),
                                "span_us": float(ns[:, 1].max() - ns[:, 0].min()) / 1e3,
                                "start_spread_us": float(ns[:, 0].max() - ns[:, 0].min()) / 1e3})
    timings = bench.interleaved(calls, rounds=5)
    out["call_us"] = {p: 1e3 * t.median_ms for p, t in timings.items()}
    return out


def _batch_row(t: dict, precision: str) -> dict:
    rows = [r for r in t["rows"] if r["precision"] == precision and r["what"].startswith("batch")]
    if not rows:
        raise ValueError(f"no {precision} row at a batch in this measurement")
    return rows[0]


def text(t: dict) -> str:
    lines = [f"{t['gpu']}: the one-kernel network, median cycles a phase over the blocks (16 rows a block)",
             f"{'':26}" + "".join(f"{ph:>9}" for ph in t["phases"]) + f"{'total':>9}"
             + ("   span (µs)" if "call_us" in t else "")]
    for r in t["rows"]:
        lines.append(f"{r['precision'].upper() + ', ' + r['what']:26}"
                     + "".join(f"{r['cycles'][ph]:9.0f}" for ph in t["phases"]) + f"{r['total']:9.0f}"
                     + (f"   {r['span_us']:9.1f}" if "span_us" in r else ""))
    for p, us in t.get("call_us", {}).items():
        span = _batch_row(t, p)["span_us"]
        lines.append(f"{p.upper()}, batch {t['batch']}: a call {us:.1f} µs on the GPU (calls back to back), the "
                     f"kernel's span {span:.1f} µs (first block's start to last block's end), launch and gap "
                     f"{us - span:.1f} µs")
    return "\n".join(lines)


def view(t: dict, source: str = ""):
    """The phases' median cycles a block (and the kernel's span) as a table."""
    from gpucourse import plots

    rows = [[f"{r['precision'].upper()}, {r['what']}"] + [f"{r['cycles'][ph]:,.0f}" for ph in t["phases"]]
            + [f"{r['total']:,.0f}", f"{r['span_us']:.1f} µs" if "span_us" in r else ""] for r in t["rows"]]
    return plots.table(["", *t["phases"], "total", "span"], rows, align="l" + "r" * (len(t["phases"]) + 2),
                       title=f"{t['gpu']}: the one-kernel network, median cycles a phase (16 rows a block)",
                       source=source)


def call_lines(t: dict) -> list:
    """A call's time on the GPU, the kernel's span and the launch and gap between, a line each precision."""
    out = []
    for p, us in t.get("call_us", {}).items():
        span = _batch_row(t, p)["span_us"]
        out.append(f"{p.upper()}, batch {t['batch']}: a call {us:.1f} µs on the GPU, the kernel's span {span:.1f} µs, "
                   f"launch and gap {us - span:.1f} µs")
    return out


def bound_view(b: dict, source: str = ""):
    """``bound`` as a table: each row's microseconds a call and its speed over FP16, against the goal."""
    from gpucourse import plots

    how = "end to end" if b["end_to_end"] else "GPU only"
    rows = [[name, f"{sum(parts.values()):.1f} µs", f"{b['ratio'][name]:.2f}x"] for name, parts in b["rows"].items()]
    return plots.table(["", f"a call ({how})", f"over FP16 (goal {_goal():g}x)"], rows, align="lrr",
                       title=f"INT8 over FP16 at batch {b['batch']}: measured, and as it could be", source=source)


def bound(t: dict, engines: dict | None = None) -> dict:
    """INT8 over FP16 at the measured batch, as measured and as it would be: with each phase but the branches at the
    cycles of the faster precision there, then with the branches at half FP16's cycles as well. A block's cycles
    become the kernel's span in proportion (INT8's span / INT8's cycles: the tail of slower blocks kept); each call
    adds its measured launch and gap, and, where the lesson's engines figure is given, the host time its one-kernel
    engines spend a call (end to end less GPU only). Returns {"rows": {name: {part: µs}}, "ratio": {name: x},
    "end_to_end": bool}: the parts the phases, "launch and gap" and (end to end) "host". Without the engines'
    one-kernel rows at this batch (no figure given, or one recorded before them) the calls are GPU only."""
    from benchmarks.inference_engine_model import NETWORK

    f16, i8 = _batch_row(t, "fp16"), _batch_row(t, "int8")
    calls = t["call_us"]
    rows = {r["name"]: r for r in (engines or {}).get("rows", [])}
    mine = {p: rows.get(f"{NETWORK}, {p.upper()}") for p in ("fp16", "int8")}
    # GPU only without a figure, with one recorded before the one-kernel engines, or with one at another batch
    end_to_end = all(r and r["batch"] == t["batch"] for r in mine.values())
    host = {p: 1e3 * (r["batch_ms"] - r["batch_gpu_ms"]) for p, r in mine.items()} if end_to_end else {}
    elsewhere = {ph: min(f16["cycles"][ph], i8["cycles"][ph]) if ph != BRANCHES else i8["cycles"][ph]
                 for ph in PHASES}
    ideal = {**elsewhere, BRANCHES: f16["cycles"][BRANCHES] / 2}

    def parts(cycles: dict, row: dict, p: str) -> dict:
        us_a_cycle = row["span_us"] / row["total"]
        out = {ph: cycles[ph] * us_a_cycle for ph in PHASES}
        out["launch and gap"] = calls[p] - row["span_us"]
        if end_to_end:
            out["host"] = host[p]
        return out

    rows = {"FP16, measured": parts(f16["cycles"], f16, "fp16"),
            "INT8, measured": parts(i8["cycles"], i8, "int8"),
            "INT8, the faster precision's cycles outside the branches": parts(elsewhere, i8, "int8"),
            "INT8, that and the branches at half FP16's": parts(ideal, i8, "int8")}
    fp16 = sum(rows["FP16, measured"].values())
    return {"rows": rows, "ratio": {k: fp16 / sum(v.values()) for k, v in rows.items()},
            "end_to_end": end_to_end, "batch": t["batch"]}


def bound_text(b: dict) -> str:
    how = "end to end" if b["end_to_end"] else "GPU only"
    goal = _goal()
    return "\n".join(f"{name:56} {sum(parts.values()):6.1f} µs a call at batch {b['batch']} ({how}): "
                     f"{b['ratio'][name]:.2f}x FP16 (goal {goal:g}x)" for name, parts in b["rows"].items())


def _goal() -> float:
    from benchmarks.inference_engine_model import NETWORK_GOALS

    return NETWORK_GOALS["int8_vs_fp16_batch"]


def plot(t: dict, source: str, engines: dict | None = None, **_):
    """Where one call's time goes, FP16 and INT8 as measured and INT8 as ``bound`` models it, against the goal."""
    from gpucourse import plots

    b = bound(t, engines)
    fp16 = sum(b["rows"]["FP16, measured"].values())
    how = "end to end" if b["end_to_end"] else "GPU only"
    return plots.stacked(b["rows"], unit="µs", source=source, goal=(f"FP16 / {_goal():g}", fp16 / _goal()),
                         title=f"The digits network in one kernel: a call at batch {t['batch']} ({how})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    from gpucourse import runtime

    runtime.setup("gpu")
    t = measure(args.batch, args.runs)
    print(text(t))
    print(bound_text(bound(t)))


if __name__ == "__main__":
    main()

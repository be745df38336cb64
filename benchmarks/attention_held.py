"""Lesson 10's figure "held": the CUDA C backward and cuDNN's backward, each held for seconds as a training run holds
it, beside the same two timed in turns (the field's way, milliseconds each). Held, a GPU reaches its power cap: NVML,
sampled while each runs, gives its SM clock and power draw."""
from __future__ import annotations

import statistics

from gpucourse import bench, claims, gpus, monitor, runtime
from kernels import attention as A

from benchmarks.attention import CUDA_BWD_NAME, HEAD_DIM, HEADS, HOLD_MS, _inputs, _k, _torch, sdpa_backward_only

HELD_N = (4096,)
HELD_SECONDS = 2.0  # each kernel alone, after a warm-up; the GPU's power cap acts within a fraction of that
HELD_ROUNDS = 2     # each kernel held this many times, in turns
CUDNN = "cuDNN"


def measure_held(ns=HELD_N, d: int = HEAD_DIM, seconds: float = HELD_SECONDS, rounds: int = HELD_ROUNDS) -> dict:
    """For N in ``ns``, causal and not (batch x N = 32k tokens, 16 heads of d, FP16): the CUDA C backward (dQ by
    atomics) and cuDNN's backward (sdpa_backward_only, as the field's), timed in turns
    (bench.time_in_turns), then each held alone for ``seconds`` (bench.time_held), ``rounds`` times in turns, with
    NVML sampled every 20 ms: TFLOP/s, and the median SM clock and power over each hold's second half."""
    if not (ns and seconds > 0 and rounds >= 1):
        raise runtime.CourseInputError("measure_held needs at least one N, seconds > 0 and rounds >= 1")
    gpus.step("10.wgmma_bwd")
    torch = _torch()
    if torch is None:
        raise runtime.CourseError("held: cuDNN's backward comes through PyTorch with CUDA, not importable here")
    from torch.nn.attention import SDPBackend

    index = runtime.cupy().cuda.Device().id  # NVML's number for it (the same unless CUDA_VISIBLE_DEVICES reorders)
    out = {"d": d, "heads": HEADS, "seconds": seconds, "limits": monitor.limits(index), "runs": []}
    for n in ns:
        for causal in bench.progress((False, True), desc=f"held, N = {_k(n)}"):
            batch, (q, k, v, do) = _inputs(n, d)
            tq, tk, tv, tdo = (torch.from_dlpack(a) for a in (q, k, v, do))
            o, lse = A.flash_wgmma(q, k, v, causal=causal)
            works = {CUDA_BWD_NAME: lambda: A.flash_backward_wgmma(q, k, v, o, lse, do, causal=causal, dq="atomic"),
                     CUDNN: sdpa_backward_only(SDPBackend.CUDNN_ATTENTION, tq, tk, tv, tdo, causal)}
            flops = 2.5 * A.attention_flops(batch, HEADS, n, d, causal=causal)
            turns = bench.time_in_turns(works, hold_ms=HOLD_MS)
            run = {"N": n, "batch": batch, "causal": causal,
                   "turns": {name: t.tflops(flops) for name, t in turns.items()},
                   "held": {name: [] for name in works}}
            for r in range(rounds):
                for name in list(works) if r % 2 == 0 else list(works)[::-1]:
                    with monitor.Sampler(monitor.nvml_reader(index), interval_s=0.02) as s:
                        ms, calls = bench.time_held(works[name], seconds=seconds)
                    late = [x for x in s.samples if x["t"] >= s.samples[-1]["t"] / 2] if s.samples else []
                    run["held"][name].append({
                        "tflops": bench.tflops(flops, ms), "calls": calls,
                        "sm_clock_mhz": statistics.median(x["sm_clock_mhz"] for x in late) if late else None,
                        "power_w": statistics.median(x["power_w"] for x in late) if late else None})
            out["runs"].append(run)
            del q, k, v, do, tq, tk, tv, tdo, o, lse, works
            runtime.cupy().get_default_memory_pool().free_all_blocks()
            torch.cuda.empty_cache()
    return out


def _held(run: dict, name: str, key: str) -> float | None:
    """The median over a run's holds of one kernel's ``key`` (tflops, sm_clock_mhz, power_w)."""
    values = [h[key] for h in run["held"][name] if h.get(key) is not None]
    return statistics.median(values) if values else None


def text_held(t: dict) -> str:
    """measure_held's figures as a table: each kernel in turns and held, TFLOP/s, the CUDA C kernel over cuDNN's, and
    the SM clock and power while each was held."""
    lim = t["limits"]
    lines = [f"the backward, d = {t['d']}, {t['heads']} heads, each kernel held {t['seconds']:g} s at a time",
             f"this GPU: power limit {lim['power_limit_w']:.0f} W, SM clock up to {lim['max_sm_clock_mhz']:.0f} MHz",
             f"{'run':12} {'kernel':16} {'in turns':>9} {'held':>7} {'SM clock':>9} {'power':>6}   (TFLOP/s, MHz, W)"]
    for r in t["runs"]:
        for name in (CUDA_BWD_NAME, CUDNN):
            clock, power = _held(r, name, "sm_clock_mhz"), _held(r, name, "power_w")
            clock, power = ("-" if x is None else f"{x:.0f}" for x in (clock, power))  # no NVML samples: "-"
            lines.append(f"{_k(r['N']) + (' causal' if r['causal'] else ''):12} {name:16} {r['turns'][name]:9.0f} "
                         f"{_held(r, name, 'tflops'):7.0f} {clock:>9} {power:>6}")
        turns = r["turns"][CUDA_BWD_NAME] / r["turns"][CUDNN]
        held = _held(r, CUDA_BWD_NAME, "tflops") / _held(r, CUDNN, "tflops")
        lines.append(f"{'':12} {'CUDA C / cuDNN':16} {turns:9.3f} {held:7.3f}")
    return "\n".join(lines)


def held_reading(t: dict) -> list:
    """What the deep dive of lesson 10 says of the figure "held" (section 5), each statement with whether it holds in
    ``t``: [(statement, True, False or None)]. A records test asserts every statement on every record that has it."""
    runs, lim = t["runs"], t["limits"]
    names = (CUDA_BWD_NAME, CUDNN)

    def every(test):
        return claims.every(runs, lambda r: all(test(r, name) for name in names))

    def ratio(r, held):
        a, b = ((_held(r, n, "tflops") for n in names) if held else (r["turns"][n] for n in names))
        return a / b

    return [
        ("held for seconds, each backward draws the GPU's power limit (median power within 5% of it)",
         every(lambda r, name: _held(r, name, "power_w") >= 0.95 * lim["power_limit_w"])),
        ("held, the SM clock runs at least a tenth under its highest",
         every(lambda r, name: _held(r, name, "sm_clock_mhz") <= 0.9 * lim["max_sm_clock_mhz"])),
        ("held, each backward does at least a tenth fewer TFLOP/s than in turns",
         every(lambda r, name: _held(r, name, "tflops") <= 0.9 * r["turns"][name])),
        ("held, the CUDA C backward's speed against cuDNN's within 0.03 of its speed in turns",
         claims.every(runs, lambda r: abs(ratio(r, True) - ratio(r, False)) <= 0.03)),
    ]

"""Auto-tuning: which convolution kernels can run a step, and timing every candidate on this GPU with the
course's timer (gpucourse.bench) to keep the fastest that gives the right logits.
"""
from __future__ import annotations

import numpy as np

from gpucourse import bench, gpus, runtime

from .catalog import CANDIDATES, DIRECT, PIX, PIX_R, TC, TCD, VECTOR, WG, WG_WIDE_BK, wg_precisions
from .executor import Engine, vector_width
from .plan import Plan
from .precision import DTYPES, E4M3


FINALISTS, ROUNDS = 3, 3  # autotune: how many candidates are timed again, in turn, and how many rounds


def kernel_fits(step: dict, kernel: str, precision: str = "fp16") -> bool:
    """Whether a convolution kernel can run a conv step of a plan in ``precision``: a direct kernel only the
    kernel size it is compiled for; the wmmav kernels load 8 channels of a pixel at once (16 bytes), so the
    input's channels, pixel stride and first channel must be multiples of 8; the tc kernels load 16 bytes of
    input (8 halves, 16 int8) and of weights at once, so those and the output channels K must be multiples of
    16 / itemsize; a tcd kernel (a direct convolution on the tensor cores) only its kernel size, images at most
    16 pixels wide, and input channels in whole fragments of 16 up to its CMAX; a pix kernel keeps the whole
    reduction KH x KW x C (at most PIX_R) in shared memory. A convolution of another geometry than "same" at stride 1,
    or with a residual (ResNet-50's), runs only on the tc kernels and, FP16 or INT8 on Hopper, the wg kernels (``wg_fits``).
    FP8 runs on the wg kernels only."""
    if kernel in WG:
        item = np.dtype(DTYPES[precision]).itemsize
        # the persistent tiles store 16 bytes of a row at a time in every type: 16 channels of INT8 or FP8
        _, _, bn, _, persist, wide, tma, splits = WG[kernel]
        # the split tiles: FP16, each split two slices of 64 channels or more (the reduction's R S C / 64 slices)
        if splits > 1 and (item != 2 or step["kh"] * step["kw"] * step["src"]["C"] // 64 < 2 * splits):
            return False
        if wide and (item != 1 or step["src"]["C"] % WG_WIDE_BK):  # the wide tiles: 8-bit, slices of 128 channels
            return False
        # the TMA epilogue's: compiled in this precision, whole tiles of channels, 16-byte rows
        if tma and (precision not in wg_precisions(kernel) or step["K"] % bn or not tma_fits(step, item)):
            return False
        return precision in ("fp16", "int8", "fp8") and wg_fits(step, item, store=16 // item if persist else 8)
    if not plain(step) and kernel not in TC:
        return False
    if kernel in DIRECT:
        return step["kh"] == step["kw"] == DIRECT[kernel][0]
    if kernel in PIX:
        return step["kh"] * step["kw"] * step["src"]["C"] <= PIX_R
    src = step["src"]
    itemsize = np.dtype(DTYPES[precision]).itemsize
    loads16 = vector_width(itemsize, src["C"], src["ld"], src["base"] + src["off"]) > 1  # 16 bytes of a pixel
    if kernel in TC:
        return loads16 and step["K"] % (16 // itemsize) == 0
    if kernel in TCD:
        ks, _, _, cmax = TCD[kernel]
        return (step["kh"] == step["kw"] == ks and src["W"] <= 16 and src["C"] % 16 == 0 and src["C"] <= cmax
                and loads16)
    if kernel.startswith("wmmav"):  # FP16 only: VECTOR halves a load
        return vector_width(16 // VECTOR, src["C"], src["ld"], src["base"] + src["off"]) == VECTOR
    return True


def plain(step: dict) -> bool:
    """Whether a conv step is the digits network's kind: stride 1, "same" padding, no residual."""
    kh, kw = step["kh"], step["kw"]
    return (step.get("stride", 1) == 1 and step.get("pad", [kh // 2, kh // 2, kw // 2, kw // 2])
            == [kh // 2, kh // 2, kw // 2, kw // 2] and not step.get("res"))


def wg_fits(step: dict, itemsize: int = 2, store: int = 8) -> bool:
    """Whether the Hopper kernels (inference_engine_wgmma.cu) can run a conv step: whole slices of 64 input
    channels read by the TMA (the input's pixel stride and first element in whole 16 bytes: 8 FP16 elements, 16
    INT8 or FP8 ones, ``itemsize`` 2 or 1), one destination written and a residual read ``store`` channels at a time (8; 16 INT8 or FP8
    ones in the persistent tiles: K, their pixel strides and first elements multiples of that);
    stride 1, or a 1 x 1 convolution without padding at any stride (read through a tensor map that skips the pixels
    between)."""
    src, res, v, w = step["src"], step.get("res"), 16 // itemsize, store
    if src["C"] % 64 or src["ld"] % v or (src["base"] + src["off"]) % v or step["K"] % w or len(step["dests"]) != 1:
        return False
    d = step["dests"][0]
    if d["ld"] % w or (d["base"] + d["off"]) % w or (res and (res["ld"] % w or (res["base"] + res["off"]) % w)):
        return False
    if step.get("stride", 1) != 1:
        return step["kh"] == step["kw"] == 1 and step.get("pad", [0, 0, 0, 0]) == [0, 0, 0, 0]
    return max(step.get("pad", [0])) <= 127


def tma_fits(step: dict, itemsize: int = 1) -> bool:
    """Whether the TMA can read a conv step's residual and write its output (the wgpt tiles): their rows and first
    elements in whole 16 bytes (16 INT8 or FP8 elements, ``itemsize`` 1; 8 FP16 ones, 2)."""
    v = 16 // itemsize
    return all(loc["ld"] % v == 0 and (loc["base"] + loc["off"]) % v == 0
               for loc in (step["dests"][0], step.get("res")) if loc)


def candidates(step: dict, precision: str) -> list:
    """The kernels of CANDIDATES[precision] that can run this conv step on this GPU (the wg kernels on Hopper
    only: gpus.py, step "06.wgmma")."""
    hopper = runtime.is_gpu() and gpus.status("06.wgmma").runs
    return [k for k in CANDIDATES[precision] if kernel_fits(step, k, precision) and (k not in WG or hopper)]


def autotune(plan: Plan, repeats: int = 4) -> dict:
    """Time every candidate kernel of every convolution on this GPU at the plan's max_batch and keep the
    fastest (step["kernel"]); the timings stay in the plan (step["tuning"], ms: GPU time of one launch,
    ``bench.time_per_call``). A candidate first runs its layer on the inputs a whole inference left in the arena,
    its outputs poisoned beforehand, and must give what the default kernel gives there (to FP16 rounding; INT8 to
    one step); one that does not is left out (step["rejected"]) whatever its speed. Each is timed once (4 launches);
    the FINALISTS fastest are then timed again in turn, ROUNDS rounds of ``repeats`` samples, and keep the median of
    those; the fastest finalist is kept. At the end, a whole inference from a poisoned arena with the chosen kernels
    must give the default kernels' logits (CourseError if not)."""
    runtime.require_gpu("auto-tuning")
    eng = Engine(plan, graphs=False)
    cp = runtime.cupy()
    precision = plan.header["precision"]
    n = plan.header["max_batch"]
    x = cp.asarray(np.random.default_rng(0).random((n, *plan.header["input_shape"]), np.float32))
    # never a kernel's output: INT8 clips to -127 .. 127; FP8's 0x7F is NaN, which a finite value never becomes
    poison = {"int8": -128, "fp8": 0x7F}
    table = cp.asarray(E4M3)  # FP8 codes compared as the values they stand for

    def logits():  # the head's logits (before the softmax, where the plan ends in one)
        for p, arena in eng.arenas.items():  # a mixed plan has two arenas
            arena.fill({"int8": 0, "fp8": 0x7F}.get(p, np.nan))  # every value read must have been written
        eng.infer(x)
        return eng.logits[:len(x)].get().astype(np.float64)

    def run(step) -> list:  # the step's outputs from poisoned destinations, as float32 copies on the GPU
        p = step.get("precision", precision)
        for d in step["dests"]:
            eng._view(d, n)[...] = poison.get(p, np.nan)
        eng.run_step(step["id"], n)
        return [table[eng._view(d, n)] if p == "fp8" else eng._view(d, n).astype(cp.float32) for d in step["dests"]]

    def same(got, ref, bound) -> bool:  # compared on the GPU: a layer's output is up to ~100 MB at batch 64
        return all(bool(cp.all(cp.abs(g - r) <= b)) for g, r, b in zip(got, ref, bound))  # NaN compares False

    want = logits()
    tol = 1e-4 if precision == "fp32" else 0.05
    convs = [s for s in plan.steps if s["kind"] == "conv"]
    for step in bench.progress(convs, desc=f"auto-tuning {precision}"):
        p = step.get("precision", precision)  # a mixed plan's layer may run in another precision
        default, times, rejected = step["kernel"], {}, []
        eng.refresh(step["id"])
        ref = run(step)
        # INT8: one step; FP8: one step of e4m3's 3-bit mantissa at the largest value; FP16: 1%
        rel = {"fp8": 0.125}.get(p, 1e-2)
        bound = [1.0 if p == "int8" else rel * (float(cp.abs(r).max()) + 1e-3) for r in ref]
        for kernel in candidates(step, p):
            step["kernel"] = kernel
            eng.refresh(step["id"])
            if not same(run(step), ref, bound):
                rejected.append(kernel)
                continue
            launch = lambda: eng.run_step(step["id"], n)  # noqa: E731
            times[kernel] = bench.time_per_call(launch, batch=4, repeats=1, warmup=0).median_ms  # a first look
        # the few fastest at a first look, timed again in turns (bench.in_turns: a drift of the clocks over the
        # layer's tuning favours none of them), and the fastest of those kept
        finalists = sorted(times, key=times.get)[:FINALISTS]
        if len(finalists) > 1:
            def timed(kernel, _round):
                step["kernel"] = kernel
                eng.refresh(step["id"])
                return bench.time_per_call(launch, batch=8, repeats=repeats, warmup=1)

            times.update({k: t.median_ms for k, t in bench.in_turns(finalists, ROUNDS, timed).items()})
        step["tuning"] = times
        step["finalists"] = finalists
        step["rejected"] = rejected
        step["kernel"] = min(finalists, key=times.get) if finalists else default
        eng.refresh(step["id"])
        run(step)  # the chosen kernel's output is what the next layers read
    got = logits()
    if not np.all(np.abs(got - want) <= tol * (np.abs(want).max() + 1)):
        raise runtime.CourseError("auto-tuning: the chosen kernels do not give the default kernels' logits "
                                  f"(largest difference {np.abs(got - want).max():.3g}); a kernel writes outside "
                                  "its own output")
    return {s["name"]: s["tuning"] for s in convs}

"""Auto-tuning: which convolution kernels can run a step, and timing every candidate on this GPU with the
course's timer (gpucourse.bench) to keep the fastest that gives the right logits.
"""
from __future__ import annotations

import numpy as np

from gpucourse import bench, runtime

from .catalog import CANDIDATES, DIRECT, PIX, PIX_R, TC, TCD, VECTOR
from .executor import Engine, vector_width
from .plan import Plan
from .precision import DTYPES


def kernel_fits(step: dict, kernel: str, precision: str = "fp16") -> bool:
    """Whether a convolution kernel can run a conv step of a plan in ``precision``: a direct kernel only the
    kernel size it is compiled for; the wmmav kernels load 8 channels of a pixel at once (16 bytes), so the
    input's channels, pixel stride and first channel must be multiples of 8; the tc kernels load 16 bytes of
    input (8 halves, 16 int8) and of weights at once, so those and the output channels K must be multiples of
    16 / itemsize; a tcd kernel (a direct convolution on the tensor cores) only its kernel size, images at most
    16 pixels wide, and input channels in whole fragments of 16 up to its CMAX; a pix kernel keeps the whole
    reduction KH x KW x C (at most PIX_R) in shared memory."""
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


def candidates(step: dict, precision: str) -> list:
    """The kernels of CANDIDATES[precision] that can run this conv step."""
    return [k for k in CANDIDATES[precision] if kernel_fits(step, k, precision)]


def autotune(plan: Plan, repeats: int = 10) -> dict:
    """Time every candidate kernel of every convolution on this GPU at the plan's max_batch and keep the
    fastest (step["kernel"]); the timings stay in the plan (step["tuning"], ms: GPU time of one launch,
    ``bench.time_per_call``). A candidate is first run through a whole inference from a poisoned arena and
    must give the logits of the default kernel (to FP16 rounding); one that does not is left out
    (step["rejected"]) whatever its speed."""
    runtime.require_gpu("auto-tuning")
    eng = Engine(plan, graphs=False)
    cp = runtime.cupy()
    precision = plan.header["precision"]
    x = cp.asarray(np.random.default_rng(0).random((plan.header["max_batch"], *plan.header["input_shape"]),
                                                    np.float32))

    def logits():
        eng.arena.fill(0 if precision == "int8" else np.nan)  # every value read must have been written
        return eng.infer(x).get().astype(np.float64)

    want = logits()
    tol = 1e-4 if precision == "fp32" else 0.05
    convs = [s for s in plan.steps if s["kind"] == "conv"]
    for step in bench.progress(convs, desc=f"auto-tuning {precision}"):
        default, times, rejected = step["kernel"], {}, []
        for kernel in candidates(step, precision):
            step["kernel"] = kernel
            eng.refresh(step["id"])
            got = logits()
            if not np.all(np.abs(got - want) <= tol * (np.abs(want).max() + 1)):
                rejected.append(kernel)
                continue
            times[kernel] = bench.time_per_call(lambda: eng.run_step(step["id"], len(x)), batch=8,
                                                repeats=repeats, warmup=2).median_ms
        step["tuning"] = times
        step["rejected"] = rejected
        step["kernel"] = min(times, key=times.get) if times else default
        eng.refresh(step["id"])
    return {s["name"]: s["tuning"] for s in convs}

"""Per-layer precision, chosen: what quantising each part of a network costs, and which parts an INT8 or FP8 plan
keeps in FP16 to agree with FP32 (``keep_fp16_for``), as TensorRT's users choose them (a sensitivity sweep, then the
costliest layers pinned to FP16 with per-layer precision constraints). The plans are run by the engine itself: the
NumPy runtime on a CPU (the kernels' arithmetic), the GPU kernels on a GPU.

A part ("unit") is a layer, a block or a stage of ResNet-50's names (``units``). Its sensitivity: the plan with that
unit alone in INT8 / FP8 and the rest in FP16, measured against the FP32 reference's logits on a set of inputs:
the share of top-1 classes that agree and the noise the unit adds (``agreement``). The choice is greedy: the
units in order of their noise, costliest first, kept in FP16 one at a time until the plan meets the target.
"""
from __future__ import annotations

import time

import numpy as np

from gpucourse import runtime

from .build import _names, build_plan
from .executor import Engine
from .graph import Graph
from .precision import calibrate, SCALED
from .specs import run_graph

LEVELS = ("layer", "block", "stage")


def units(g: Graph, level: str = "stage") -> list:
    """The names ``build_plan(keep_fp16=...)`` takes for the convolutions of ``g``, in network order: each layer's
    own ("layer"), or the first two or one parts of ResNet-style names ("block": conv2_block1, ...; "stage": conv1,
    conv2, ...). A unit names every convolution whose name it begins."""
    if level not in LEVELS:
        raise runtime.CourseInputError(f"level must be one of {', '.join(LEVELS)}, not {level!r}")
    out = []
    for n in g.nodes:
        if n.op not in ("Conv", "CBR"):
            continue
        name = n.name if level == "layer" else "_".join(n.name.split("_")[:2 if level == "block" else 1])
        if name not in out:
            out.append(name)
    return out


def reference_logits(g: Graph, x, batch: int = 8) -> np.ndarray:
    """The FP32 reference's logits (NumPy, float64, before any softmax) of inputs ``x``, ``batch`` at a time."""
    g = g.copy()
    for n in g.nodes:
        if n.op == "Head":
            n.attrs["softmax"] = False
    before_softmax = []

    def grab(n, ins):
        if n.op == "Softmax":
            before_softmax.append(ins[0])

    out = [run_graph(g, np.asarray(x[s:s + batch], np.float32), before=grab) for s in range(0, len(x), batch)]
    return np.concatenate(before_softmax) if before_softmax else np.concatenate(out)


def logits(plan, x, *, numpy: bool = False) -> np.ndarray:
    """A plan's logits (before any softmax) of inputs ``x``, float64: the GPU kernels in GPU mode (unless ``numpy``),
    else the NumPy runtime."""
    eng = Engine(plan, numpy=numpy)
    out = []
    for s in range(0, len(x), eng.max_batch):
        xs = np.asarray(x[s:s + eng.max_batch], np.float32)
        eng.infer(xs)
        z = eng.logits[:len(xs)]
        out.append(np.asarray(z.get() if hasattr(z, "get") else z, np.float64).copy())
    return np.concatenate(out)


def agreement(z, ref) -> dict:
    """How logits ``z`` agree with the reference's ``ref`` (both N x classes): ``top1`` the share of inputs whose top
    class is the same; ``rel_error`` the largest difference over the largest reference logit (the benchmark's figure);
    ``noise`` the error's RMS over the RMS of the reference's image-specific part (its logits less their mean over the
    inputs), which decides the top-1 class where one class leads for most inputs; ``corr`` the correlation of the
    image-specific parts."""
    z, ref = np.asarray(z, np.float64), np.asarray(ref, np.float64)
    dz, dr = z - z.mean(axis=0), ref - ref.mean(axis=0)
    return {"top1": float(np.mean(z.argmax(1) == ref.argmax(1))),
            "rel_error": float(np.abs(z - ref).max() / np.abs(ref).max()),
            "noise": float(np.sqrt(np.mean((z - ref) ** 2) / np.mean(dr ** 2))),
            "corr": float(np.sum(dz * dr) / np.sqrt(np.sum(dz ** 2) * np.sum(dr ** 2)))}


def sensitivity(g: Graph, x_calib, x_eval, ref=None, *, precision: str = "int8", level: str = "stage",
                calibration: str = "percentile", max_batch: int = 64, numpy: bool = False, scales=None,
                progress: bool = True) -> list:
    """Per unit of ``g`` (``units(g, level)``): the agreement (``agreement``) of the plan with that unit alone in
    ``precision`` and the rest in FP16, on inputs ``x_eval`` against the reference's logits ``ref`` (computed when
    None). Rows in network order."""
    if precision not in SCALED:
        raise runtime.CourseInputError(f"precision must be one of {', '.join(SCALED)}, not {precision!r}")
    ref = reference_logits(g, x_eval) if ref is None else ref
    scales = scales or calibrate(g, x_calib, calibration, precision)
    names = units(g, level)
    rows = []
    it = names
    if progress:
        from gpucourse import bench

        it = bench.progress(names, desc=f"{precision} sensitivity per {level}")
    for u in it:
        plan = build_plan(g, precision=precision, max_batch=max_batch, x_calib=x_calib, calibration=calibration,
                          tune=False, keep_fp16=[v for v in names if v != u], scales=scales)
        rows.append({"unit": u, **agreement(logits(plan, x_eval, numpy=numpy), ref)})
    return rows


def keep_fp16_for(g: Graph, x_calib, x_eval, ref=None, *, precision: str = "int8", target: float = 0.99,
                  level: str = "stage", calibration: str = "percentile", max_batch: int = 64, numpy: bool = False,
                  rows=None, progress: bool = True) -> dict:
    """The units an INT8 or FP8 plan of ``g`` keeps in FP16 so that its top-1 classes agree with the reference's on
    at least ``target`` of ``x_eval``: the units ranked by ``sensitivity`` (``rows``, measured when None) by the noise
    each adds, costliest first, kept in FP16 one at a time, each plan measured, until one meets the target (all of
    them, the FP16 plan, if none does). Returns {"keep_fp16": the units, "top1", "rel_error", "noise", "corr" of that
    plan, "met", "rows": the sensitivity, "trail": every plan tried, "seconds"}."""
    t0 = time.perf_counter()
    ref = reference_logits(g, x_eval) if ref is None else ref
    scales = calibrate(g, x_calib, calibration, precision)
    if rows is None:
        rows = sensitivity(g, x_calib, x_eval, ref, precision=precision, level=level, calibration=calibration,
                           max_batch=max_batch, numpy=numpy, scales=scales, progress=progress)
    order = [r["unit"] for r in sorted(rows, key=lambda r: -r["noise"])]
    names = units(g, level)
    trail, keep = [], []
    for k in range(len(order) + 1):
        keep = [u for u in names if u in order[:k]]  # network order, for a readable plan
        plan = build_plan(g, precision=precision, max_batch=max_batch, x_calib=x_calib, calibration=calibration,
                          tune=False, keep_fp16=keep, scales=scales)
        got = agreement(logits(plan, x_eval, numpy=numpy), ref)
        trail.append({"keep_fp16": keep, **got})
        if got["top1"] >= target:
            break
    return {"keep_fp16": keep, **{k: trail[-1][k] for k in ("top1", "rel_error", "noise", "corr")},
            "met": trail[-1]["top1"] >= target, "target": target, "precision": precision, "level": level,
            "rows": rows, "trail": trail, "seconds": time.perf_counter() - t0}


def fp16_share(g: Graph, keep_fp16) -> float:
    """The share of ``g``'s multiply-adds in the convolutions ``keep_fp16`` names (what a mixed plan runs in FP16)."""
    from .resnet import layer_costs

    rows = layer_costs(g)
    total = sum(r["flops"] for r in rows)
    return sum(r["flops"] for r in rows if any(_names(k, r["name"]) for k in keep_fp16 or ())) / total

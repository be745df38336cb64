"""Building a plan from a graph (``build_plan``): buffers and steps, weights in the plan's precision, INT8
calibration, a kernel for each convolution (auto-tuned on a GPU).
"""
from __future__ import annotations

import datetime
import math

import numpy as np

from gpucourse import gpus, runtime

from .catalog import DEFAULT_KERNEL
from .graph import Graph
from .passes import _single_consumer
from .plan import Plan, PLAN_FORMAT, PLAN_MAGIC, this_target
from .precision import _root, calibrate, DTYPES, minmax_scale, PRECISIONS, quantize
from .tuning import autotune


def _not_runnable(n) -> str | None:
    """What a node asks that the plan's kernels do not do (ResNet-50's strided and residual convolutions, its
    zero-padded pool, its global pool and softmax), or None."""
    if n.op in ("Pad", "Add", "GlobalAvgPool", "Softmax"):
        return f"a {n.op}"
    if n.op in ("Conv", "CBR", "MaxPool") and ("stride" in n.attrs or "pad" in n.attrs):
        stride, pad = n.attrs.get("stride", 1), n.attrs.get("pad")
        return f"a {'convolution' if n.op != 'MaxPool' else 'max pool'} of stride {stride} with padding {pad}"
    if n.attrs.get("residual"):
        return "a residual added in the epilogue"
    if n.op == "Head" and n.attrs.get("global"):
        return "a global average pool"
    return None


def build_plan(g: Graph, *, precision: str = "fp32", max_batch: int = 256, x_calib=None,
               calibration: str = "percentile", tune: bool = True, name: str = "", graphs: bool = True) -> Plan:
    """Buffers, steps and weights for graph ``g`` (optimised or not) in ``precision``. INT8 needs
    ``x_calib`` (a sample of inputs) and a ``calibration`` method. On a GPU with ``tune``, every
    convolution's kernel is chosen by timing each candidate on this GPU at ``max_batch``. ``graphs``: the
    runtime replays the launches of each batch size as one CUDA graph (an Engine can override it)."""
    if precision not in PRECISIONS:
        raise runtime.CourseInputError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    for n in g.nodes:
        why = _not_runnable(n)
        if why:
            raise runtime.CourseError(f"node {n.name!r} ({n.op}): {why} has no kernel in this engine yet; the NumPy "
                                      "reference (run_graph) runs it")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise runtime.CourseInputError(f"max_batch must be a positive int, got {max_batch!r}")
    h, w, _ = g.shapes[g.input]
    if max_batch * h * w * max(s[-1] for s in g.shapes.values()) >= 2**31:
        raise runtime.CourseInputError(f"max_batch {max_batch} is too large: the kernels index a tensor with "
                                       "32-bit integers")
    if precision == "fp16" and runtime.is_gpu():
        gpus.step("05.wmma")  # its convolutions run on the tensor cores: which GPU that needs is said in gpus.py
    if precision in ("fp16", "int8") and runtime.is_gpu():
        gpus.step("05.tc")
    scales = None
    if precision == "int8":
        if x_calib is None:
            raise runtime.CourseInputError("INT8 needs x_calib: a sample of inputs to calibrate the scales on")
        scales = calibrate(g, x_calib, calibration)
    # ---- buffers: one per tensor that is not a slice of another, all in one arena
    g = g.copy()
    for n in g.nodes:
        if n.op == "Flatten" or (n.op in ("BiasAdd", "BatchNorm", "Relu") and _single_consumer(g, n.inputs[0])):
            g.aliases[n.outputs[0]] = (n.inputs[0], 0)  # in place: the same memory
    buffers, base = {}, 0
    produced = [g.input] + [t for n in g.nodes for t in n.outputs]
    for t in produced + [_root(g, t)[0] for t in produced]:
        if t in g.aliases or t == g.output or t in buffers:
            continue
        buffers[t] = {"base": base, "per_image": int(np.prod(g.shapes[t])), "ld": g.shapes[t][-1]}
        base += max_batch * buffers[t]["per_image"]

    def loc(t):
        root, off = _root(g, t)
        if root not in buffers:
            raise runtime.CourseError(f"tensor {t!r} has no buffer")
        if len(g.shapes[t]) == 1:  # a flat vector per image (after Flatten): contiguous
            d = g.shapes[t][0]
            return {"base": buffers[root]["base"], "ld": d, "off": 0, "C": d, "H": 1, "W": 1, "tensor": root}
        s = g.shapes[root]
        return {"base": buffers[root]["base"], "ld": buffers[root]["ld"], "off": off, "C": g.shapes[t][-1],
                "H": s[0] if len(s) == 3 else 1, "W": s[1] if len(s) == 3 else 1, "tensor": root}

    steps, arrays = [], {}
    dtype = DTYPES[precision]

    def scale_of(t):
        return scales[_root(g, t)[0]] if scales else 1.0

    def add(step, **weights):
        i = len(steps)
        step["id"] = i
        steps.append(step)
        for k, v in weights.items():
            if v is not None:
                arrays[f"{i}/{k}"] = v

    add({"kind": "input", "dst": loc(g.input), "inv_scale": 1.0 / scale_of(g.input)})
    for n in g.nodes:
        W = n.weights
        if n.op in ("Conv", "CBR"):
            w = W["w"].reshape(-1, W["w"].shape[-1]).astype(np.float32)
            k_total = w.shape[1]
            splits = n.attrs.get("splits", [k_total])
            dests = [loc(t) for t in n.outputs]
            dest_of_k = np.repeat(np.arange(len(dests)), splits)
            step = {"kind": "conv", "name": n.name, "src": loc(n.inputs[0]), "K": k_total, "kh": int(W["w"].shape[0]),
                    "kw": int(W["w"].shape[1]), "relu": bool(n.attrs.get("relu", False)), "dests": dests,
                    "bias": n.op == "CBR", "kernel": DEFAULT_KERNEL[precision], "tuning": {}}
            y_off = np.array([dests[d]["base"] + dests[d]["off"] for d in dest_of_k], np.int64)
            y_off += np.concatenate([np.arange(s) for s in splits]).astype(np.int64)
            y_ld = np.array([dests[d]["ld"] for d in dest_of_k], np.int32)
            scale = inv = None
            if precision == "int8":
                sw = np.array([minmax_scale(w[:, k]) for k in range(k_total)], np.float32)
                wq = np.stack([quantize(w[:, k], sw[k]) for k in range(k_total)], axis=1)
                scale = (scale_of(n.inputs[0]) * sw).astype(np.float32)
                inv = np.array([1.0 / scale_of(n.outputs[d]) for d in dest_of_k], np.float32)
                w = wq
            add(step, w=w.astype(dtype), b=W["b"].astype(np.float32) if n.op == "CBR" else None, scale=scale,
                inv=inv, y_off=y_off, y_ld=y_ld)
        elif n.op in ("BiasAdd", "BatchNorm", "Relu"):
            if precision == "int8":
                raise runtime.CourseError(f"node {n.name!r} ({n.op}): INT8 plans need every bias, batch norm and "
                                          "ReLU fused into its convolution; run the optimisation passes first")
            if n.outputs[0] not in g.aliases:
                raise runtime.CourseError(f"node {n.name!r} ({n.op}) works in place and its input has other readers")
            step = {"kind": n.op.lower(), "name": n.name, "dst": loc(n.inputs[0]), "eps": n.attrs.get("eps", 0.0)}
            add(step, **{k: v.astype(np.float32) for k, v in W.items()})
        elif n.op == "MaxPool":
            if scales and not math.isclose(scale_of(n.inputs[0]), scale_of(n.outputs[0])):
                raise runtime.CourseError(f"{n.name}: a max pool's output must keep its input's INT8 scale")
            add({"kind": "maxpool", "name": n.name, "src": loc(n.inputs[0]), "dst": loc(n.outputs[0]),
                 "size": n.attrs["size"]})
        elif n.op == "Concat":
            for t in n.inputs:
                dst = loc(n.outputs[0])
                dst["off"] += sum(g.shapes[u][-1] for u in n.inputs[:n.inputs.index(t)])
                dst["C"] = g.shapes[t][-1]
                add({"kind": "concat_copy", "name": f"{n.name}[{t}]", "src": loc(t), "dst": dst})
        elif n.op == "AvgPool":
            add({"kind": "avgpool", "name": n.name, "src": loc(n.inputs[0]), "dst": loc(n.outputs[0]),
                 "size": n.attrs["size"]})
        elif n.op == "Flatten":
            continue
        elif n.op == "Dense":
            add({"kind": "dense", "name": n.name, "src": loc(n.inputs[0]), "O": int(W["w"].shape[1])},
                w=W["w"].astype(np.float32), b=W["b"].astype(np.float32))
        elif n.op == "Head":
            add({"kind": "head", "name": n.name, "src": loc(n.inputs[0]), "size": n.attrs["size"],
                 "O": int(W["w"].shape[1]), "x_scale": scale_of(n.inputs[0])},
                w=W["w"].astype(np.float32), b=W["b"].astype(np.float32))
        else:
            raise runtime.CourseError(f"node {n.name!r}: op {n.op!r} has no kernel in this engine")
        if n.outputs[-1] == g.output and n.op not in ("Dense", "Head"):
            raise runtime.CourseError("the graph must end with a Dense layer (logits)")
    header = {"magic": PLAN_MAGIC, "format": PLAN_FORMAT, "target": this_target(), "precision": precision,
              "max_batch": max_batch, "arena": base, "input_shape": list(g.shapes[g.input]),
              "outputs": int(g.shapes[g.output][0]), "calibration": calibration if scales else None,
              "name": name, "built": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "graphs": bool(graphs), "steps": steps}
    plan = Plan(header, arrays)
    if tune and runtime.is_gpu():
        autotune(plan)
    return plan

"""Building a plan from a graph (``build_plan``): buffers and steps, weights in the plan's precision, INT8 and FP8
calibration, a kernel for each convolution (auto-tuned on a GPU).
"""
from __future__ import annotations

import datetime
import math

import numpy as np

from gpucourse import gpus, runtime

from .catalog import DEFAULT_KERNEL, GENERAL_DEFAULT, HEAD_O
from . import network
from .graph import conv_geometry, Graph
from .passes import _single_consumer
from .plan import Plan, PLAN_FORMAT, PLAN_MAGIC, this_target
from .precision import _root, ALL_PRECISIONS, calibrate, DTYPES, e4m3_scale, minmax_scale, quantize, SCALED, to_e4m3
from .tuning import autotune, kernel_fits, plain, wg_fits


def _not_runnable(n) -> str | None:
    """What a node asks that the plan's kernels do not do (a Pad, Add, global pool or softmax the passes did not fold
    into a convolution or the head), or None."""
    if n.op in ("Pad", "Add", "GlobalAvgPool", "Softmax"):
        return f"a {n.op} on its own (the optimisation passes fold it)"
    if n.op == "Conv" and ("stride" in n.attrs or "pad" in n.attrs):
        return "an unfused convolution of stride or padding other than 'same' at stride 1"
    return None


def build_plan(g: Graph, *, precision: str = "fp32", max_batch: int = 256, x_calib=None,
               calibration: str = "percentile", tune: bool = True, name: str = "", graphs: bool = True,
               fuse_stem: bool = True, keep_fp16=None, layer_precisions: dict | None = None,
               scales: dict | None = None, fuse_network: bool = False) -> Plan:
    """Buffers, steps and weights for graph ``g`` (optimised or not) in ``precision``. INT8 and FP8 need
    ``x_calib`` (a sample of inputs) and a ``calibration`` method. FP8 (e4m3 activations and weights, per-tensor
    activation and per-channel weight scales, FP32 sums) runs on Hopper's wgmma kernels only: on a GPU it needs
    one, and every convolution must be one they take (``wg_fits``). On a GPU with ``tune``, every
    convolution's kernel is chosen by timing each candidate on this GPU at ``max_batch``. ``graphs``: the
    runtime replays the launches of each batch size as one CUDA graph (an Engine can override it). ``fuse_stem``:
    ResNet's stem (a 7 x 7 convolution of stride 2 over 3 channels, then a 3 x 3 max pool of stride 2) runs as one
    kernel that reads the input and writes the pooled output (``_stem_pool``); False lowers it as an im2col matrix
    and a GEMM, then the pool (``_stem_im2col``). ``fuse_network``: where the graph is the lesson's digits network
    (optimised), one step runs all of it, one kernel from the input to the logits (network.py, ``network.fuse``), in
    FP32, FP16 and INT8; False (the default), or another graph, keeps a step per layer.

    Per-layer precision, as TensorRT's: ``keep_fp16`` (names of convolutions, or prefixes of them: "conv4" is every
    layer of ResNet-50's stage conv4, "conv4_block2" one block) run in FP16 in an INT8 or FP8 plan, or
    ``layer_precisions`` ({name or prefix: "fp16" or the plan's precision}, the longest key naming a layer wins). Each
    activation is stored in the precision of the layer that writes it (the FP16 ones in a second arena); where a
    layer of another precision reads it (its input, or the shortcut a block adds), a reformat step first writes a
    copy in the reader's precision: FP16 -> INT8 / FP8 quantised with the tensor's calibrated scale, INT8 / FP8 ->
    FP16 dequantised (``mixed.py`` chooses the layers: ``keep_fp16_for``). ``scales``: an earlier ``calibrate`` of
    this graph with this method and precision (plans of one graph built in turn calibrate once)."""
    if precision not in ALL_PRECISIONS:
        raise runtime.CourseInputError(f"precision must be one of {', '.join(ALL_PRECISIONS)}, not {precision!r}")
    for n in g.nodes:
        why = _not_runnable(n)
        if why:
            raise runtime.CourseError(f"node {n.name!r} ({n.op}): {why} has no kernel in this engine; run the "
                                      "optimisation passes (E.optimize) first, or the NumPy reference (run_graph)")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise runtime.CourseInputError(f"max_batch must be a positive int, got {max_batch!r}")
    if max_batch * max(int(np.prod(s)) for s in g.shapes.values()) >= 2**31:
        raise runtime.CourseInputError(f"max_batch {max_batch} is too large: the kernels index a tensor with "
                                       "32-bit integers")
    if precision == "fp16" and runtime.is_gpu():
        gpus.step("06.wmma")  # its convolutions run on the tensor cores: which GPU that needs is said in gpus.py
    if precision in ("fp16", "int8") and runtime.is_gpu():
        gpus.step("06.tc")
    if precision == "fp8" and runtime.is_gpu():
        gpus.step("06.wgmma")  # FP8 runs on the Hopper kernels only: one line saying so elsewhere
    if precision not in SCALED:
        scales = None
    elif scales is None:
        if x_calib is None:
            raise runtime.CourseInputError(f"{precision.upper()} needs x_calib: a sample of inputs to calibrate the "
                                           "scales on")
        scales = calibrate(g, x_calib, calibration, precision)
    per_layer = _layer_precisions(g, precision, keep_fp16, layer_precisions)  # {} unless mixed
    if per_layer and runtime.is_gpu():
        gpus.step("06.wmma")  # its FP16 layers' kernels

    def prec(name):  # a convolution's precision
        return per_layer.get(name, precision)

    # ---- buffers: one per tensor that is not a slice of another, in one arena (a mixed plan: two, by precision)
    g = g.copy()
    for n in g.nodes:
        if n.op == "Flatten" or (n.op in ("BiasAdd", "BatchNorm", "Relu") and _single_consumer(g, n.inputs[0])):
            g.aliases[n.outputs[0]] = (n.inputs[0], 0)  # in place: the same memory
    buffers, tops = {}, {"main": 0, "fp16": 0}
    produced = [g.input] + [t for n in g.nodes for t in n.outputs]
    fused = _stem_pool(g, precision) if fuse_stem else None
    first = next((n for n in g.nodes if n.op in ("Conv", "CBR") and n.inputs[0] == g.input), None)
    stem = None if fused else _stem_im2col(g, prec(first.name) if first else precision)
    unstored = {g.input, fused["between"]} if fused else set()  # what the fused stem keeps on chip
    home, copies = _homes(g, precision, prec) if per_layer else ({}, [])

    def arena_of(p):
        return "fp16" if per_layer and p == "fp16" else "main"

    def allocate(key, shape, p):
        a = arena_of(p)
        buffers[key] = {"base": tops[a], "per_image": int(np.prod(shape)), "ld": shape[-1], "shape": shape, "arena": a}
        tops[a] += max_batch * buffers[key]["per_image"]

    for t in produced + [_root(g, t)[0] for t in produced]:
        if t in g.aliases or t == g.output or t in buffers or t in unstored:
            continue
        allocate(t, (stem["P"], stem["Q"], stem["R"]) if stem and t == g.input else g.shapes[t],
                 home.get(t, precision))
    for root, p in copies:  # a tensor's copy in the precision of a reader of another precision
        allocate(f"{root}@{p}", buffers[root]["shape"], p)
    base = tops["main"]

    def loc(t, p=None):
        """Where tensor t is: its buffer, or (``p``: a reader's precision other than its own) its copy in p."""
        root, off = _root(g, t)
        key = root if p is None or p == home.get(root, precision) else f"{root}@{p}"
        if key not in buffers:
            raise runtime.CourseError(f"tensor {t!r} has no buffer")
        where = {"arena": "fp16"} if buffers[key]["arena"] == "fp16" else {}
        if len(g.shapes[t]) == 1:  # a flat vector per image (after Flatten): contiguous
            d = g.shapes[t][0]
            return {"base": buffers[key]["base"], "ld": d, "off": 0, "C": d, "H": 1, "W": 1, "tensor": root, **where}
        s = buffers[key]["shape"]
        return {"base": buffers[key]["base"], "ld": buffers[key]["ld"], "off": off,
                "C": s[-1] if t == g.input else g.shapes[t][-1],
                "H": s[0] if len(s) == 3 else 1, "W": s[1] if len(s) == 3 else 1, "tensor": root, **where}

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

    def home_of(t):
        return home.get(_root(g, t)[0], precision)

    def read(t, p):
        """Where a step of precision ``p`` reads tensor t: its own buffer, or its copy in p, written by a reformat
        step added before the first reader that needs it (every writer of the tensor has run by then)."""
        root, h = _root(g, t)[0], home_of(t)
        if p == h:
            return loc(t)
        if (root, p) not in reformatted:
            reformatted.add((root, p))
            add({"kind": "reformat", "name": f"{root}:{h}->{p}", "src": loc(root), "dst": loc(root, p),
                 "from": h, "to": p, "scale": float(scale_of(root)) if h in SCALED else 1.0,
                 "inv_scale": 1.0 / scale_of(root) if p in SCALED else 1.0})
        return loc(t, p)

    def tag(step, p):  # a mixed plan's step whose precision is not the plan's says so
        if per_layer and p != precision:
            step["precision"] = p
        return step

    reformatted = set()

    if not fused:
        p_in = home_of(g.input)
        add(tag({"kind": "input", "dst": loc(g.input),
                 "inv_scale": 1.0 / scale_of(g.input) if p_in in SCALED or not per_layer else 1.0,
                 **({"im2col": stem} if stem else {})}, p_in))
    for n in g.nodes:
        W = n.weights
        if fused and n.name == fused["pool"]:
            continue
        if fused and n.name == fused["conv"]:  # the stem and the pool after it: one step, in FP16 in every plan
            dst, p = loc(fused["out"]), prec(n.name)
            if dst["ld"] % 8 or (dst["base"] + dst["off"]) % 8:
                raise runtime.CourseError(f"{n.name}: the fused stem writes 8 channels at a time, and its output's "
                                          "pixels are not 8-element aligned")
            add(tag({"kind": "stem", "name": f"{n.name}+{fused['pool']}", **fused["geometry"], "dst": dst,
                     "inv_scale": 1.0 / scale_of(fused["out"]) if p in SCALED or not per_layer else 1.0}, p),
                w=W["w"].reshape(-1, W["w"].shape[-1]).astype(np.float16), b=W["b"].astype(np.float32))
            continue
        if n.op in ("Conv", "CBR"):
            p = prec(n.name)
            src = read(n.inputs[0], p)
            w4 = W["w"]
            attrs = n.attrs
            if stem and n.name == stem["node"]:  # the stem reads the input's im2col matrix: a 1 x 1 convolution
                w2 = w4.reshape(-1, w4.shape[-1])
                w4 = np.concatenate([w2, np.zeros((stem["R"] - len(w2), w2.shape[1]), w2.dtype)])[None, None]
                attrs = {"kh": 1, "kw": 1}
            w = w4.reshape(-1, w4.shape[-1]).astype(np.float32)
            k_total = w.shape[1]
            splits = n.attrs.get("splits", [k_total])
            dests = [loc(t) for t in n.outputs]
            dest_of_k = np.repeat(np.arange(len(dests)), splits)
            stride, pad = conv_geometry(attrs)
            P, Q = g.shapes[n.outputs[0]][:2]
            step = {"kind": "conv", "name": n.name, "src": src, "K": k_total, "kh": int(w4.shape[0]),
                    "kw": int(w4.shape[1]), "relu": bool(n.attrs.get("relu", False)), "dests": dests,
                    "bias": n.op == "CBR", "kernel": DEFAULT_KERNEL[p], "tuning": {},
                    "stride": stride, "pad": pad, "P": int(P), "Q": int(Q)}
            tag(step, p)
            if n.attrs.get("residual"):
                step["res"] = read(n.inputs[1], p)
                step["res_scale"] = float(scale_of(n.inputs[1])) if p in SCALED or not per_layer else 1.0
            if not plain(step):
                step["kernel"] = GENERAL_DEFAULT
                if p != "fp8" and (not kernel_fits(step, GENERAL_DEFAULT, p) or p == "fp32"):
                    raise runtime.CourseError(
                        f"node {n.name!r}: a convolution of stride {stride}, padding {pad}"
                        f"{' and a residual' if 'res' in step else ''} runs on the engine's tensor-core kernels only, "
                        f"FP16 or INT8 (input channels, pixel stride and output channels in whole 16 bytes); "
                        f"build this network in fp16 or int8")
            if p == "fp8" and not wg_fits(step, 1):
                raise runtime.CourseError(
                    f"node {n.name!r}: FP8 convolutions run on the Hopper wgmma kernels only, which need input "
                    f"channels in whole slices of 64 (this one has {src['C']}), pixels in whole 16 bytes, output "
                    f"channels in multiples of 8 and one destination; build this network in fp16 or int8")
            if p == "fp8":
                step["kernel"] = DEFAULT_KERNEL["fp8"]
            y_off = np.array([dests[d]["base"] + dests[d]["off"] for d in dest_of_k], np.int64)
            y_off += np.concatenate([np.arange(s) for s in splits]).astype(np.int64)
            y_ld = np.array([dests[d]["ld"] for d in dest_of_k], np.int32)
            scale = inv = None
            if p == "int8":
                sw = np.array([minmax_scale(w[:, k]) for k in range(k_total)], np.float32)
                wq = np.stack([quantize(w[:, k], sw[k]) for k in range(k_total)], axis=1)
                scale = (scale_of(n.inputs[0]) * sw).astype(np.float32)
                inv = np.array([1.0 / scale_of(n.outputs[d]) for d in dest_of_k], np.float32)
                w = wq
            elif p == "fp8":  # e4m3 weights with a scale per output channel: w ~ sw[k] e4m3(w / sw[k])
                sw = e4m3_scale(np.abs(w).max(axis=0))
                scale = (scale_of(n.inputs[0]) * sw).astype(np.float32)
                inv = np.array([1.0 / scale_of(n.outputs[d]) for d in dest_of_k], np.float32)
                w = to_e4m3(w / sw)
            add(step, w=w.astype(DTYPES[p]), b=W["b"].astype(np.float32) if n.op == "CBR" else None, scale=scale,
                inv=inv, y_off=y_off, y_ld=y_ld)
        elif n.op in ("BiasAdd", "BatchNorm", "Relu"):
            if precision in SCALED:
                raise runtime.CourseError(f"node {n.name!r} ({n.op}): {precision.upper()} plans need every bias, "
                                          "batch norm and ReLU fused into its convolution; run the optimisation "
                                          "passes first")
            if n.outputs[0] not in g.aliases:
                raise runtime.CourseError(f"node {n.name!r} ({n.op}) works in place and its input has other readers")
            step = {"kind": n.op.lower(), "name": n.name, "dst": loc(n.inputs[0]), "eps": n.attrs.get("eps", 0.0)}
            add(step, **{k: v.astype(np.float32) for k, v in W.items()})
        elif n.op == "MaxPool":
            if scales and not math.isclose(scale_of(n.inputs[0]), scale_of(n.outputs[0])):
                raise runtime.CourseError(f"{n.name}: a max pool's output must keep its input's scale")
            step = tag({"kind": "maxpool", "name": n.name, "src": loc(n.inputs[0]), "dst": loc(n.outputs[0]),
                        "size": n.attrs["size"]}, home_of(n.inputs[0]))
            if "stride" in n.attrs or "pad" in n.attrs:  # ResNet's: windows `stride` apart over zero padding
                step.update(stride=int(n.attrs.get("stride", 1)), pad=list(n.attrs["pad"]))
            add(step)
        elif n.op == "Concat":
            for t in n.inputs:
                dst = loc(n.outputs[0])
                dst["off"] += sum(g.shapes[u][-1] for u in n.inputs[:n.inputs.index(t)])
                dst["C"] = g.shapes[t][-1]
                add(tag({"kind": "concat_copy", "name": f"{n.name}[{t}]", "src": read(t, home_of(n.outputs[0])),
                         "dst": dst}, home_of(n.outputs[0])))
        elif n.op == "AvgPool":
            add(tag({"kind": "avgpool", "name": n.name, "src": loc(n.inputs[0]), "dst": loc(n.outputs[0]),
                     "size": n.attrs["size"]}, home_of(n.inputs[0])))
        elif n.op == "Flatten":
            continue
        elif n.op == "Dense":
            add(tag({"kind": "dense", "name": n.name, "src": loc(n.inputs[0]), "O": int(W["w"].shape[1])},
                    home_of(n.inputs[0])), w=W["w"].astype(np.float32), b=W["b"].astype(np.float32))
        elif n.op == "Head":
            src = loc(n.inputs[0])
            size = n.attrs["size"] if not n.attrs.get("global") else src["H"]
            if n.attrs.get("global") and src["H"] != src["W"]:
                raise runtime.CourseError(f"node {n.name!r}: the head's global pool takes square images, got "
                                          f"{src['H']} x {src['W']}")
            O = int(W["w"].shape[1])
            p = home_of(n.inputs[0])
            x_scale = scale_of(n.inputs[0]) if p in SCALED or not per_layer else 1.0
            if n.attrs.get("global") and O > HEAD_O:  # a wide classifier (ResNet's): the pool, then a matrix product
                add(tag({"kind": "gpool", "name": f"{n.name}/pool", "src": src, "x_scale": x_scale}, p))
                add({"kind": "classifier", "name": n.name, "D": src["C"], "O": O},
                    w=W["w"].astype(np.float32), b=W["b"].astype(np.float32))
            else:
                add(tag({"kind": "head", "name": n.name, "src": src, "size": size, "O": O, "x_scale": x_scale}, p),
                    w=W["w"].astype(np.float32), b=W["b"].astype(np.float32))
            if n.attrs.get("softmax"):
                add({"kind": "softmax", "name": f"{n.name}/softmax", "O": int(W["w"].shape[1])})
        else:
            raise runtime.CourseError(f"node {n.name!r}: op {n.op!r} has no kernel in this engine")
        if n.outputs[-1] == g.output and n.op not in ("Dense", "Head"):
            raise runtime.CourseError("the graph must end with a Dense layer (logits)")
    whole = network.fuse(g, steps, arrays, precision) if fuse_network and not per_layer else None
    if whole:  # the network in one kernel: one step, and no arena (nothing between input and logits leaves the chip)
        (steps, arrays), base = whole, 0
    header = {"magic": PLAN_MAGIC, "format": PLAN_FORMAT, "target": this_target(), "precision": precision,
              "max_batch": max_batch, "arena": base, "input_shape": list(g.shapes[g.input]),
              "outputs": int(g.shapes[g.output][0]), "calibration": calibration if scales else None,
              "name": name, "built": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "graphs": bool(graphs), "softmax": any(st["kind"] == "softmax" for st in steps),
              "pooled": max([st["D"] for st in steps if st["kind"] == "classifier"], default=0), "steps": steps}
    if per_layer:  # a mixed plan: which convolutions run in another precision, and its FP16 arena's size
        header.update(layer_precisions=dict(per_layer), arena_fp16=tops["fp16"])
    plan = Plan(header, arrays)
    if tune and runtime.is_gpu():
        autotune(plan)
    return plan


def _names(key: str, layer: str) -> bool:
    """Whether ``key`` names a layer: its name, or a prefix of it ending where the name goes on with "_" or "/"
    ("conv4", "conv4_block2" name "conv4_block2_1_conv"); a horizontally fused layer ("a+b+c") is named by any of
    its parts' names."""
    return key == layer or any(part == key or part.startswith((key + "_", key + "/")) for part in layer.split("+"))


def _layer_precisions(g: Graph, precision: str, keep_fp16, layer_precisions) -> dict:
    """{convolution's name: its precision} for those whose precision is not the plan's (``build_plan``'s
    ``keep_fp16`` and ``layer_precisions``); {} for a plan in one precision."""
    want = dict(layer_precisions or {})
    if isinstance(keep_fp16, str):
        keep_fp16 = [keep_fp16]
    for key in keep_fp16 or ():
        want[key] = "fp16"
    if not want:
        return {}
    convs = [n.name for n in g.nodes if n.op in ("Conv", "CBR")]
    if precision not in SCALED:
        raise runtime.CourseInputError(f"per-layer precision is for INT8 and FP8 plans (layers of them kept in FP16); "
                                       f"this plan is {precision.upper()}")
    for key, p in want.items():
        if p not in ("fp16", precision):
            raise runtime.CourseInputError(f"layer precision {p!r} for {key!r}: a layer of an {precision.upper()} plan "
                                           f"runs in fp16 or {precision}")
        if not any(_names(key, c) for c in convs):
            raise runtime.CourseInputError(f"{key!r} names no convolution of this graph (its convolutions: "
                                           f"{', '.join(convs[:4])}{', ...' if len(convs) > 4 else ''})")
    out = {}
    for c in convs:
        keys = [k for k in want if _names(k, c)]
        if keys and want[max(keys, key=len)] != precision:
            out[c] = want[max(keys, key=len)]
    return out


def _homes(g: Graph, precision: str, prec) -> tuple:
    """A mixed plan's tensors: ({buffer's tensor: the precision it is stored in}, [(tensor, another precision a
    reader needs it in)]). A tensor is stored in its writer's precision (a max pool's, an average pool's and a
    concatenation's: their input's); the input in its first convolution's. A convolution reads its input and its
    residual in its own precision, the other steps in the tensor's."""
    home, copies = {}, []

    def root(t):
        return _root(g, t)[0]

    def stored(t, p, who):
        r = root(t)
        if home.get(r, p) != p:
            raise runtime.CourseError(f"{who} writes part of {r!r} in {p}, and another layer writes it in {home[r]}: "
                                      "the layers that write one buffer (the slices of a concatenation) must share "
                                      "a precision")
        home[r] = p

    def needs(t, p):
        if home.get(root(t), precision) != p and (root(t), p) not in copies:
            copies.append((root(t), p))

    readers = [n for n in g.nodes if n.op in ("Conv", "CBR") and n.inputs[0] == g.input]
    home[g.input] = prec(readers[0].name) if readers else precision
    for n in g.nodes:
        if n.op in ("Conv", "CBR"):
            p = prec(n.name)
            for t in n.inputs:
                needs(t, p)
            for t in n.outputs:
                stored(t, p, n.name)
        elif n.op in ("MaxPool", "AvgPool", "Concat"):
            p = home.get(root(n.inputs[0]), precision)
            for t in n.inputs[1:] if n.op == "Concat" else ():
                needs(t, p)
            stored(n.outputs[0], p, n.name)
        elif n.op in ("BiasAdd", "BatchNorm", "Relu") and n.outputs[0] not in g.aliases:
            stored(n.outputs[0], home.get(root(n.inputs[0]), precision), n.name)
    return home, copies


def _stem_pool(g: Graph, precision: str) -> dict | None:
    """ResNet's stem, where the graph has it: the input's one reader a CBR of 7 x 7 and stride 2 from 3 channels to
    64, with a ReLU and no residual, whose one reader is a 3 x 3 max pool of stride 2. Then the plan runs both as
    one kernel (inference_engine_stem.cuh) that never stores the convolution's output. Returns the two nodes'
    names, the tensor between them, the pool's output and the geometry, or None. FP16, INT8 and FP8 plans (the
    kernel runs on the tensor cores in FP16 and quantises what it writes); FP32 plans keep their own kernels."""
    if precision == "fp32":
        return None
    readers = g.consumers(g.input)
    if len(readers) != 1 or readers[0].op != "CBR":
        return None
    conv = readers[0]
    w, a = conv.weights["w"], conv.attrs
    if w.shape != (7, 7, 3, 64) or not a.get("relu") or a.get("residual") or len(conv.outputs) != 1:
        return None
    stride, pad = conv_geometry(a)
    after = g.consumers(conv.outputs[0])
    if stride != 2 or len(after) != 1 or after[0].op != "MaxPool":
        return None
    pool = after[0]
    if pool.attrs.get("size") != 3 or int(pool.attrs.get("stride", 1)) != 2 or "pad" not in pool.attrs:
        return None
    h, w_, _ = g.shapes[g.input]
    p, q = g.shapes[conv.outputs[0]][:2]
    ho, wo = g.shapes[pool.outputs[0]][:2]
    return {"conv": conv.name, "pool": pool.name, "between": conv.outputs[0], "out": pool.outputs[0],
            "geometry": {"H": int(h), "W": int(w_), "C": 3, "K": 64, "pad": [int(v) for v in pad], "P": int(p),
                         "Q": int(q), "pool_pad": [int(v) for v in pool.attrs["pad"]], "Ho": int(ho), "Wo": int(wo)}}


def _stem_im2col(g: Graph, precision: str) -> dict | None:
    """Where the first convolution reads the input with another geometry than "same" at stride 1 (ResNet-50's 7 x 7
    stem of stride 2) and the input's channels are not whole 16 bytes (3 colours), the plan lowers it as TensorRT
    does such a stem: the input step writes the input's im2col matrix (every output pixel's 7 x 7 x 3 receptive
    field, padded with zeros to a multiple of 64), and the stem becomes a 1 x 1 convolution of it, which the
    tensor-core kernels run at full width. Returns the stem's geometry, or None."""
    if precision == "fp32":
        return None
    c = g.shapes[g.input][-1]
    per16 = 16 // np.dtype(DTYPES[precision]).itemsize
    readers = [n for n in g.nodes if n.op in ("Conv", "CBR") and n.inputs[0] == g.input]
    if len(readers) != 1 or c % per16 == 0 or not any(n in readers for n in g.consumers(g.input)):
        return None
    n = readers[0]
    stride, pad = conv_geometry(n.attrs)
    if (stride, pad) == (1, [n.attrs["kh"] // 2] * 2 + [n.attrs["kw"] // 2] * 2) and not n.attrs.get("residual"):
        return None  # the digits network's stem: its own kernels read it as it is
    if len(g.consumers(g.input)) != 1:
        return None
    (h, w, _), (p, q) = g.shapes[g.input], g.shapes[n.outputs[0]][:2]
    r = n.attrs["kh"] * n.attrs["kw"] * c
    return {"node": n.name, "kh": n.attrs["kh"], "kw": n.attrs["kw"], "stride": stride, "pad": pad, "C": c, "H": h,
            "W": w, "P": int(p), "Q": int(q), "taps": r, "R": -(-r // 64) * 64}

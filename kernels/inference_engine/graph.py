"""The engine's graph: primitive ops (Conv, BiasAdd, BatchNorm, Relu, pools, Concat, Add, Dense...) as nodes, and
the import of a Keras model into one (``graph_from_keras``).

A convolution's attributes: ``kh``, ``kw``; where they are not the digits network's (stride 1, "same" padding of
kh // 2 and kw // 2), also ``stride`` and ``pad`` = [top, bottom, left, right] (zeros). A max pool's: ``size``, and
where it is not stride 1 with the window clipped at the edges, ``stride`` and ``pad`` (zeros).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

import numpy as np

from gpucourse import runtime


@dataclass
class Node:
    """One operation: ``op`` reads ``inputs`` and writes ``outputs`` (tensor names)."""

    name: str
    op: str
    inputs: list
    outputs: list
    attrs: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)


@dataclass
class Graph:
    """Nodes in an order where every tensor is produced before it is read. ``shapes``: tensor -> per-image
    shape ((H, W, C), or (D,) after Flatten). ``aliases``: tensor -> (tensor, channel offset) for tensors
    that are a slice of another one (after concatenation elimination)."""

    nodes: list
    shapes: dict
    input: str
    output: str
    aliases: dict = field(default_factory=dict)

    def producer(self, tensor: str):
        return next((n for n in self.nodes if tensor in n.outputs), None)

    def consumers(self, tensor: str) -> list:
        return [n for n in self.nodes if tensor in n.inputs]

    def copy(self) -> "Graph":
        return copy.deepcopy(self)

    def ops(self) -> dict:
        """{op: how many nodes}"""
        out = {}
        for n in self.nodes:
            out[n.op] = out.get(n.op, 0) + 1
        return out

    def __str__(self) -> str:
        lines = [f"input {self.input} {self.shapes[self.input]}"]
        for n in self.nodes:
            attrs = ", ".join(f"{k}={v}" for k, v in n.attrs.items())
            outs = ", ".join(f"{t} {self.shapes[t]}" + (f" -> {self.aliases[t][0]}[{self.aliases[t][1]}:]"
                                                          if t in self.aliases else "") for t in n.outputs)
            lines.append(f"{n.op:9} {n.name:28} ({', '.join(n.inputs)}) -> {outs}" + (f"  [{attrs}]" if attrs else ""))
        return "\n".join(lines)


SUPPORTED_LAYERS = ("InputLayer", "Conv2D", "BatchNormalization", "ReLU", "Activation", "MaxPooling2D",
                    "AveragePooling2D", "Flatten", "Concatenate", "Dense", "ZeroPadding2D", "Add",
                    "GlobalAveragePooling2D")


def conv_geometry(attrs: dict) -> tuple:
    """(stride, [top, bottom, left, right]) of a Conv, CBR or MaxPool node (the defaults where unset: stride 1,
    the window centred: "same" for an odd window)."""
    kh = attrs.get("kh", attrs.get("size"))
    kw = attrs.get("kw", attrs.get("size"))
    return int(attrs.get("stride", 1)), list(attrs.get("pad", [kh // 2, kh // 2, kw // 2, kw // 2]))


def _same_pad(size: int, k: int, stride: int) -> list:
    """Keras' "same" padding along one axis: the output has ceil(size / stride) elements, the extra pixel of an
    odd total at the end."""
    out = -(-size // stride)
    total = max((out - 1) * stride + k - size, 0)
    return [total // 2, total - total // 2]


def _unsupported(layer, what: str):
    return runtime.CourseError(f"layer {layer.name!r} ({type(layer).__name__}): {what} is not supported by this "
                               "engine")


def graph_from_keras(model) -> Graph:
    """The Graph of a Keras functional model, each layer expanded into primitive ops (a Conv2D with a bias
    and a ReLU becomes Conv, BiasAdd, Relu, as a framework executes it). Raises CourseError naming the first
    layer, or layer option, the engine does not support."""
    nodes, shapes, out_of = [], {}, {}
    graph_input = None
    for layer in model.layers:
        cls = type(layer).__name__
        if cls not in SUPPORTED_LAYERS:
            raise runtime.CourseError(f"layer {layer.name!r} ({cls}) is not supported by this engine; it supports "
                                      f"{', '.join(SUPPORTED_LAYERS)}")
        cfg = layer.get_config()
        if cls == "InputLayer":
            if graph_input is not None:
                raise _unsupported(layer, "a second input")
            graph_input = layer.name
            shape = tuple(int(s) for s in cfg.get("batch_shape", cfg.get("batch_input_shape"))[1:])
            if len(shape) != 3:
                raise _unsupported(layer, f"an input of shape {shape} (want height, width, channels)")
            shapes[layer.name], out_of[layer.name] = shape, layer.name
            continue
        ins = [out_of[t._keras_history.operation.name] for t in layer._inbound_nodes[0].input_tensors]
        x = ins[0]
        chain = []  # (op, attrs, weights)

        def add(op, attrs=None, weights=None, inputs=None):
            name = layer.name if not chain else f"{layer.name}/{op.lower()}"
            chain.append(Node(name, op, inputs or [chain[-1].outputs[0] if chain else x], [name],
                              attrs or {}, weights or {}))

        weights = [np.asarray(w, np.float32) for w in layer.get_weights()]
        if cls == "Conv2D":
            kh, kw = cfg["kernel_size"]
            stride = tuple(cfg["strides"])
            if stride[0] != stride[1] or tuple(cfg["dilation_rate"]) != (1, 1) or cfg.get("groups", 1) != 1:
                raise _unsupported(layer, f"strides {cfg['strides']}, dilation {cfg['dilation_rate']} or groups")
            if cfg["activation"] not in ("linear", "relu"):
                raise _unsupported(layer, f"activation {cfg['activation']!r}")
            h, w, _ = shapes[x]
            if cfg["padding"] == "same":
                pad = _same_pad(h, kh, stride[0]) + _same_pad(w, kw, stride[0])
            elif cfg["padding"] == "valid":
                pad = [0, 0, 0, 0]
            else:
                raise _unsupported(layer, f"padding {cfg['padding']!r}")
            attrs = {"kh": kh, "kw": kw}
            if stride[0] != 1 or pad != [kh // 2, kh // 2, kw // 2, kw // 2]:
                attrs.update(stride=stride[0], pad=pad)
            add("Conv", attrs, {"w": weights[0]})
            if cfg["use_bias"]:
                add("BiasAdd", weights={"b": weights[1]})
            if cfg["activation"] == "relu":
                add("Relu")
        elif cls == "BatchNormalization":
            if cfg["axis"] not in (-1, 3, [3], [-1]) or not (cfg["center"] and cfg["scale"]):
                raise _unsupported(layer, f"axis {cfg['axis']} or a batch norm without scale and centre")
            gamma, beta, mean, var = weights
            add("BatchNorm", {"eps": float(cfg["epsilon"])}, {"gamma": gamma, "beta": beta, "mean": mean, "var": var})
        elif cls in ("ReLU", "Activation"):
            if cls == "Activation" and cfg["activation"] != "relu":
                raise _unsupported(layer, f"activation {cfg['activation']!r}")
            if cls == "ReLU" and (cfg.get("max_value") is not None or cfg.get("negative_slope", 0) != 0
                                  or cfg.get("threshold", 0) != 0):
                raise _unsupported(layer, "a ReLU with max_value, negative_slope or threshold")
            add("Relu")
        elif cls == "MaxPooling2D":
            p, st = cfg["pool_size"], tuple(cfg["strides"] or cfg["pool_size"])
            if p[0] != p[1] or st[0] != st[1]:
                raise _unsupported(layer, f"pool {p}, strides {st} (want a square window and stride)")
            if st[0] == 1 and cfg["padding"] == "same" and p[0] % 2:
                add("MaxPool", {"size": p[0]})
            elif cfg["padding"] == "valid":
                add("MaxPool", {"size": p[0], "stride": st[0], "pad": [0, 0, 0, 0]})
            else:
                raise _unsupported(layer, f"pool {p}, strides {st}, padding {cfg['padding']!r} (want an odd window "
                                          "of stride 1 and 'same', or 'valid')")
        elif cls == "ZeroPadding2D":
            (t, b), (l, r) = cfg["padding"]
            add("Pad", {"pad": [int(t), int(b), int(l), int(r)]})
        elif cls == "Add":
            if len(ins) != 2:
                raise _unsupported(layer, f"an Add of {len(ins)} tensors (want 2)")
            add("Add", inputs=ins)
        elif cls == "GlobalAveragePooling2D":
            if cfg.get("keepdims"):
                raise _unsupported(layer, "keepdims")
            add("GlobalAvgPool")
        elif cls == "AveragePooling2D":
            p = cfg["pool_size"]
            s = cfg["strides"] or p
            h, w, _ = shapes[x]
            if p[0] != p[1] or tuple(s) != tuple(p) or cfg["padding"] != "valid" or h % p[0] or w % p[0]:
                raise _unsupported(layer, f"pool {p}, strides {s}, padding {cfg['padding']!r}")
            add("AvgPool", {"size": p[0]})
        elif cls == "Flatten":
            add("Flatten")
        elif cls == "Concatenate":
            if cfg["axis"] not in (-1, 3):
                raise _unsupported(layer, f"concatenation along axis {cfg['axis']}")
            add("Concat", inputs=ins)
        elif cls == "Dense":
            if cfg["activation"] not in ("linear", "softmax") or len(shapes[x]) != 1:
                raise _unsupported(layer, f"activation {cfg['activation']!r} or an input of shape {shapes[x]}")
            add("Dense", weights={"w": weights[0], "b": weights[1]})
            if cfg["activation"] == "softmax":
                add("Softmax")
        for node in chain:
            shapes[node.outputs[0]] = _shape_of(node, [shapes[t] for t in node.inputs])
        nodes += chain
        out_of[layer.name] = chain[-1].outputs[0]
    return Graph(nodes, shapes, graph_input, nodes[-1].outputs[0])


def _shape_of(node: Node, in_shapes: list) -> tuple:
    s = in_shapes[0]
    if node.op in ("Conv", "CBR", "MaxPool"):
        stride, (t, b, l, r) = conv_geometry(node.attrs)
        kh, kw = (node.attrs["kh"], node.attrs["kw"]) if node.op != "MaxPool" else (node.attrs["size"],) * 2
        c = node.weights["w"].shape[-1] if node.op != "MaxPool" else s[2]
        return ((s[0] + t + b - kh) // stride + 1, (s[1] + l + r - kw) // stride + 1, c)
    if node.op == "Pad":
        t, b, l, r = node.attrs["pad"]
        return (s[0] + t + b, s[1] + l + r, s[2])
    if node.op == "GlobalAvgPool":
        return (s[2],)
    if node.op == "Concat":
        return (s[0], s[1], sum(t[2] for t in in_shapes))
    if node.op == "AvgPool":
        p = node.attrs["size"]
        return (s[0] // p, s[1] // p, s[2])
    if node.op == "Flatten":
        return (int(np.prod(s)),)
    if node.op in ("Dense", "Head"):
        return (node.weights["w"].shape[1],)  # Softmax, Add, BiasAdd, BatchNorm, Relu: their input's shape
    return s


def _json_bytes(doc) -> np.ndarray:
    return np.frombuffer(json.dumps(doc, sort_keys=True).encode(), np.uint8)

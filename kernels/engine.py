"""Lesson 5 — a small TensorRT-style inference engine: graph, optimisation passes, plan, runtime.

Used by notebooks/05_inference_engine.ipynb, benchmarks/inference_engine.py and the tests. The path of a
trained network through the engine:

    Keras model --graph_from_keras--> Graph of primitive ops (Conv, BiasAdd, BatchNorm, Relu, ...)
      --fold_batchnorm, fuse_vertical, fuse_horizontal, eliminate_concat--> optimised Graph
      --build_plan (buffers, precision and INT8 calibration, auto-tuning)--> Plan --save/load_plan--> file
      --Engine--> logits, with the CUDA C kernels of kernels/cuda/engine.cu on a GPU, NumPy on a CPU

TensorFlow is needed only to train and export the model (``train_and_export``); the exported model file
(kernels/models/digits_inception.npz: graph, weights, held-out digits, Keras's own logits) is what the engine
reads, so it runs where TensorFlow is not installed. Also here: the fused conv + bias + ReLU ("CBR") kernel
in numba (``cbr_direct``) with its NumPy spec, batch-norm folding, and INT8 calibration (min-max, percentile,
entropy) with quantise / dequantise.
"""
from __future__ import annotations

import copy
import datetime
import hashlib
import json
import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gpucourse import runtime

from . import cuda_c

cuda = runtime.cuda()

SOURCE = "engine"  # kernels/cuda/engine.cu
MODEL_FILE = Path(__file__).resolve().parent / "models" / "digits_inception.npz"
PLAN_MAGIC = "GPUCOURSE-ENGINE-PLAN"
PLAN_FORMAT = 1
PRECISIONS = ("fp32", "fp16", "int8")
CALIBRATIONS = ("minmax", "percentile", "entropy")
DTYPES = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8}
SUFFIX = {"fp32": "f32", "fp16": "f16", "int8": "i8"}
# Convolution kernels of engine.cu: name -> (pixels per block, channels per block, threads)
CONV_KERNELS = {"simt_64x64": (64, 64, 256), "simt_64x32": (64, 32, 256), "simt_32x32": (32, 32, 256),
                "wmma_64x64": (64, 64, 128), "wmma_64x32": (64, 32, 128), "wmma_128x32": (128, 32, 128),
                "wmmav_64x32": (64, 32, 128), "wmmav_128x32": (128, 32, 128), "wmmav_64x16": (64, 16, 128),
                "wmmav_128x16": (128, 16, 128), "simtv_128x64": (128, 64, 256), "simtv_128x32": (128, 32, 256),
                "simtv_64x32": (64, 32, 256), "simtv_128x16": (128, 16, 256), "simtv_64x16": (64, 16, 256)}
# The direct convolutions (engine.cu 1a''): name -> (kernel size, tile rows TH, tile columns TW, channels BN,
# pixels per thread TM, channels per thread TN). A block computes a TH x TW tile of one image x BN channels,
# with TH (TW / TM) (BN / TN) threads; they run only the KS x KS convolutions they are compiled for.
DIRECT = {f"direct{ks}_{th}x{tw}x{bn}_{tm}x{tn}": (ks, th, tw, bn, tm, tn)
          for ks, th, tw, bn, tm, tn in [(3, 16, 16, 32, 8, 4), (3, 8, 16, 32, 8, 4), (3, 8, 16, 32, 4, 4),
                                         (3, 4, 16, 32, 4, 4), (3, 16, 16, 16, 4, 4), (5, 16, 16, 16, 8, 4),
                                         (5, 16, 16, 16, 4, 4), (5, 8, 16, 16, 4, 4), (5, 8, 16, 32, 8, 4)]}
CONV_KERNELS.update({k: (th * tw, bn, th * (tw // tm) * (bn // tn)) for k, (_, th, tw, bn, tm, tn) in DIRECT.items()})
SIMT = ("simt_64x64", "simt_64x32", "simt_32x32", "simtv_128x64", "simtv_128x32", "simtv_64x32", "simtv_128x16",
        "simtv_64x16") + tuple(DIRECT)
CANDIDATES = {"fp32": SIMT,
              "fp16": ("wmma_64x64", "wmma_64x32", "wmma_128x32", "wmmav_64x32", "wmmav_128x32", "wmmav_64x16",
                       "wmmav_128x16") + SIMT,
              "int8": SIMT}
DEFAULT_KERNEL = {"fp32": "simt_64x64", "fp16": "wmma_64x64", "int8": "simt_64x64"}
THREADS = 256  # elementwise kernels
VECTOR = 8  # the wmmav kernels load 8 halves (16 bytes) at a time
Q = 127  # symmetric INT8: values -127 .. 127


# ============================================================================================ the graph

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
                    "AveragePooling2D", "Flatten", "Concatenate", "Dense")


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
            if tuple(cfg["strides"]) != (1, 1) or tuple(cfg["dilation_rate"]) != (1, 1) or cfg.get("groups", 1) != 1:
                raise _unsupported(layer, f"strides {cfg['strides']}, dilation {cfg['dilation_rate']} or groups")
            if kh % 2 == 0 or kw % 2 == 0 or (cfg["padding"] != "same" and (kh, kw) != (1, 1)):
                raise _unsupported(layer, f"a {kh}x{kw} kernel with padding {cfg['padding']!r}")
            if cfg["activation"] not in ("linear", "relu"):
                raise _unsupported(layer, f"activation {cfg['activation']!r}")
            add("Conv", {"kh": kh, "kw": kw}, {"w": weights[0]})
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
            p = cfg["pool_size"]
            if p[0] != p[1] or p[0] % 2 == 0 or tuple(cfg["strides"]) != (1, 1) or cfg["padding"] != "same":
                raise _unsupported(layer, f"pool {p}, strides {cfg['strides']}, padding {cfg['padding']!r} "
                                          "(want an odd square window, stride 1, 'same')")
            add("MaxPool", {"size": p[0]})
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
            if cfg["activation"] != "linear" or len(shapes[x]) != 1:
                raise _unsupported(layer, f"activation {cfg['activation']!r} or an input of shape {shapes[x]}")
            add("Dense", weights={"w": weights[0], "b": weights[1]})
        for node in chain:
            shapes[node.outputs[0]] = _shape_of(node, [shapes[t] for t in node.inputs])
        nodes += chain
        out_of[layer.name] = chain[-1].outputs[0]
    return Graph(nodes, shapes, graph_input, nodes[-1].outputs[0])


def _shape_of(node: Node, in_shapes: list) -> tuple:
    s = in_shapes[0]
    if node.op in ("Conv", "CBR"):
        return (s[0], s[1], node.weights["w"].shape[-1])
    if node.op == "Concat":
        return (s[0], s[1], sum(t[2] for t in in_shapes))
    if node.op == "AvgPool":
        p = node.attrs["size"]
        return (s[0] // p, s[1] // p, s[2])
    if node.op == "Flatten":
        return (int(np.prod(s)),)
    if node.op in ("Dense", "Head"):
        return (node.weights["w"].shape[1],)
    return s


# ================================================================================ the model file

def save_model_file(graph: Graph, path, data: dict) -> Path:
    """Graph + weights + ``data`` (arrays) in one .npz file that needs no TensorFlow to read."""
    arrays = {"graph": _json_bytes(_graph_doc(graph))}
    for n in graph.nodes:
        for k, v in n.weights.items():
            arrays[f"w/{n.name}/{k}"] = v
    arrays.update({f"data/{k}": np.asarray(v) for k, v in data.items()})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
    return path


def load_model_file(path=None) -> tuple:
    """(graph, data) from a model file (default: the lesson's trained model)."""
    path = Path(path or MODEL_FILE)
    if not path.exists():
        raise runtime.CourseError(f"no model file at {path}; train and export one with train_and_export()")
    with np.load(path, allow_pickle=False) as f:
        doc = json.loads(bytes(f["graph"]).decode())
        weights = {k: f[k] for k in f.files if k.startswith("w/")}
        data = {k[5:]: f[k] for k in f.files if k.startswith("data/")}
    nodes = [Node(d["name"], d["op"], d["inputs"], d["outputs"], d["attrs"],
                  {k.split("/")[-1]: v for k, v in weights.items() if k.startswith(f"w/{d['name']}/")})
             for d in doc["nodes"]]
    return Graph(nodes, {k: tuple(v) for k, v in doc["shapes"].items()}, doc["input"], doc["output"],
                 {k: tuple(v) for k, v in doc["aliases"].items()}), data


def _graph_doc(g: Graph) -> dict:
    return {"nodes": [{"name": n.name, "op": n.op, "inputs": n.inputs, "outputs": n.outputs, "attrs": n.attrs}
                      for n in g.nodes], "shapes": g.shapes, "input": g.input, "output": g.output,
            "aliases": g.aliases}


def _json_bytes(doc) -> np.ndarray:
    return np.frombuffer(json.dumps(doc, sort_keys=True).encode(), np.uint8)


def digits_images(raw) -> np.ndarray:
    """scikit-learn's 8 x 8 digits (values 0..16) as the network's input: N x 16 x 16 x 1 float32 in [0, 1],
    each pixel repeated 2 x 2 so the convolutions have a picture to slide over."""
    raw = np.asarray(raw, np.float32).reshape(-1, 8, 8) / 16.0
    return np.repeat(np.repeat(raw, 2, axis=1), 2, axis=2)[..., None]


def build_keras_model():
    """The lesson's CNN: a 3x3 stem (conv, batch norm, ReLU), one inception block (1x1; 1x1 then 3x3;
    1x1 then 5x5; 3x3 max pool then 1x1, concatenated), 4x4 average pool, flatten, dense to 10 logits."""
    import keras
    from keras import layers

    inp = keras.Input((16, 16, 1), name="image")
    x = layers.Conv2D(32, 3, padding="same", use_bias=False, name="stem")(inp)
    x = layers.BatchNormalization(name="stem_bn")(x)
    x = layers.ReLU(name="stem_relu")(x)
    a = layers.Conv2D(32, 1, activation="relu", name="branch1x1")(x)
    b = layers.Conv2D(32, 1, activation="relu", name="branch3x3_reduce")(x)
    b = layers.Conv2D(32, 3, padding="same", activation="relu", name="branch3x3")(b)
    c = layers.Conv2D(16, 1, activation="relu", name="branch5x5_reduce")(x)
    c = layers.Conv2D(16, 5, padding="same", activation="relu", name="branch5x5")(c)
    p = layers.MaxPooling2D(3, 1, padding="same", name="branch_pool")(x)
    p = layers.Conv2D(16, 1, activation="relu", name="branch_pool_proj")(p)
    z = layers.Concatenate(name="concat")([a, b, c, p])
    z = layers.AveragePooling2D(4, name="avgpool")(z)
    z = layers.Flatten(name="flatten")(z)
    return keras.Model(inp, layers.Dense(10, name="logits")(z), name="digits_inception")


def train_and_export(path=None, *, seed: int = 0, epochs: int = 10) -> dict:
    """Train the lesson's model with TensorFlow/Keras on scikit-learn's digits (about 30 s on a CPU, seeded),
    and write the model file: graph, weights, 397 held-out digits with Keras's logits, 256 training digits
    for calibration. Returns {"accuracy", "seconds", "path"}."""
    import os
    import time

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    from sklearn.datasets import load_digits

    t0 = time.perf_counter()
    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    train, test = order[:1400], order[1400:]
    x, y = digits_images(digits.images), digits.target.astype(np.int64)
    keras.utils.set_random_seed(seed)
    model = build_keras_model()
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x[train], y[train], batch_size=32, epochs=epochs, verbose=0, shuffle=True)
    logits = np.asarray(model.predict(x[test], verbose=0), np.float32)
    accuracy = float(np.mean(logits.argmax(1) == y[test]))
    data = {"test_raw": digits.images[test].astype(np.uint8), "test_labels": y[test].astype(np.uint8),
            "calib_raw": digits.images[train[:256]].astype(np.uint8), "keras_logits": logits,
            "keras_accuracy": np.float64(accuracy)}
    out = save_model_file(graph_from_keras(model), path or MODEL_FILE, data)
    return {"accuracy": accuracy, "seconds": time.perf_counter() - t0, "path": str(out), "model": model}


def dataset(data: dict) -> dict:
    """The model file's data as network inputs: x_test, y_test, x_calib, keras_logits."""
    return {"x_test": digits_images(data["test_raw"]), "y_test": data["test_labels"].astype(np.int64),
            "x_calib": digits_images(data["calib_raw"]), "keras_logits": data["keras_logits"],
            "keras_accuracy": float(data["keras_accuracy"])}


# ================================================================================ NumPy specs

def im2col(x: np.ndarray, kh: int, kw: int) -> np.ndarray:
    """N x H x W x C -> N x H x W x (kh kw C): every output pixel's receptive field ("same" padding), ordered
    (dy, dx, c) like a Keras kernel kh x kw x C x K reshaped to (kh kw C) x K."""
    n, h, w, c = x.shape
    xp = np.pad(x, ((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2), (0, 0)))
    return np.concatenate([xp[:, dy:dy + h, dx:dx + w, :] for dy in range(kh) for dx in range(kw)], axis=-1)


def conv_spec(x, w) -> np.ndarray:
    """The convolution of a Keras Conv2D (stride 1, "same"), NHWC, in float64: N x H x W x K."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    kh, kw, c, k = w.shape
    return im2col(x, kh, kw) @ w.reshape(kh * kw * c, k)


def cbr_spec(x, w, b, relu: bool = True) -> np.ndarray:
    """conv + bias + ReLU in float64: what one fused CBR kernel computes."""
    y = conv_spec(x, w) + np.asarray(b, np.float64)
    return np.maximum(y, 0.0) if relu else y


def batchnorm_spec(y, gamma, beta, mean, var, eps) -> np.ndarray:
    return (np.asarray(y, np.float64) - mean) / np.sqrt(np.asarray(var, np.float64) + eps) * gamma + beta


def fold_bn_weights(w, b, gamma, beta, mean, var, eps):
    """(w', b') such that conv(x, w') + b' = batchnorm(conv(x, w) + b): the batch norm's per-channel scale
    gamma / sqrt(var + eps) multiplies each output channel's weights (the last axis of w), and the bias
    becomes (b - mean) scale + beta. b may be None (a convolution without bias). Same dtype as w."""
    s = np.asarray(gamma, np.float64) / np.sqrt(np.asarray(var, np.float64) + eps)
    b0 = np.zeros_like(s) if b is None else np.asarray(b, np.float64)
    w2 = np.asarray(w, np.float64) * s
    return w2.astype(np.asarray(w).dtype), ((b0 - mean) * s + beta).astype(np.asarray(w).dtype)


def run_graph(g: Graph, x, *, keep: bool = False):
    """Execute a graph (imported or optimised) in float64 with NumPy: the reference for every pass. Returns
    the output, or (output, {tensor: value}) with ``keep``."""
    x = np.asarray(x, np.float64)
    vals = {g.input: x}

    def get(t):
        if t not in vals:  # a tensor assembled from the slices written into it (concatenation elimination)
            parts = sorted((off, s) for s, (tgt, off) in g.aliases.items() if tgt == t)
            vals[t] = np.concatenate([get(s) for _, s in parts], axis=-1)
        return vals[t]

    for n in g.nodes:
        ins = [get(t) for t in n.inputs]
        v = ins[0]
        W = n.weights
        if n.op == "Conv":
            out = [conv_spec(v, W["w"])]
        elif n.op == "BiasAdd":
            out = [v + W["b"]]
        elif n.op == "BatchNorm":
            out = [batchnorm_spec(v, W["gamma"], W["beta"], W["mean"], W["var"], n.attrs["eps"])]
        elif n.op == "Relu":
            out = [np.maximum(v, 0.0)]
        elif n.op == "MaxPool":
            out = [maxpool_spec(v, n.attrs["size"])]
        elif n.op == "Concat":
            out = [np.concatenate(ins, axis=-1)]
        elif n.op == "AvgPool":
            out = [avgpool_spec(v, n.attrs["size"])]
        elif n.op == "Flatten":
            out = [v.reshape(len(v), -1)]
        elif n.op == "Dense":
            out = [v @ W["w"].astype(np.float64) + W["b"]]
        elif n.op == "CBR":
            y = cbr_spec(v, W["w"], W["b"], n.attrs["relu"])
            out = np.split(y, np.cumsum(n.attrs["splits"])[:-1], axis=-1)
        elif n.op == "Head":
            p = avgpool_spec(v, n.attrs["size"])
            out = [p.reshape(len(p), -1) @ W["w"].astype(np.float64) + W["b"]]
        else:
            raise runtime.CourseError(f"node {n.name!r}: op {n.op!r} has no NumPy reference")
        vals.update(zip(n.outputs, out))
    result = get(g.output)
    return (result, vals) if keep else result


def maxpool_spec(x, size: int) -> np.ndarray:
    """Max over a size x size window, stride 1, "same" (the window clipped at the edges)."""
    n, h, w, c = x.shape
    r = size // 2
    xp = np.pad(x, ((0, 0), (r, r), (r, r), (0, 0)), constant_values=-np.inf)
    return np.max([xp[:, dy:dy + h, dx:dx + w, :] for dy in range(size) for dx in range(size)], axis=0)


def avgpool_spec(x, size: int) -> np.ndarray:
    n, h, w, c = x.shape
    return x.reshape(n, h // size, size, w // size, size, c).mean(axis=(2, 4))


# ================================================================================ optimisation passes

def _single_consumer(g: Graph, t: str, op: str | None = None):
    users = g.consumers(t)
    if len(users) == 1 and t != g.output and (op is None or users[0].op == op):
        return users[0]
    return None


def fold_batchnorm(g: Graph) -> Graph:
    """Every BatchNorm that follows a Conv (with or without a BiasAdd between) disappears into the
    convolution's weights and a bias (``fold_bn_weights``). Inference uses the running mean and variance,
    which are constants, so the fold is exact up to rounding."""
    g = g.copy()
    for bn in [n for n in g.nodes if n.op == "BatchNorm"]:
        prev = g.producer(bn.inputs[0])
        bias = prev if prev is not None and prev.op == "BiasAdd" else None
        conv = g.producer(bias.inputs[0]) if bias is not None else prev
        if conv is None or conv.op != "Conv" or _single_consumer(g, conv.outputs[0]) is None \
                or (bias is not None and _single_consumer(g, bias.outputs[0]) is None):
            continue
        W = bn.weights
        w, b = fold_bn_weights(conv.weights["w"], bias.weights["b"] if bias else None, W["gamma"], W["beta"],
                               W["mean"], W["var"], bn.attrs["eps"])
        conv.weights["w"] = w
        if bias is not None:
            bias.weights["b"] = b
            bias.outputs = bn.outputs
            del g.shapes[bn.inputs[0]]
            g.nodes.remove(bn)
        else:  # the batch norm becomes the convolution's bias
            bn.op, bn.name, bn.attrs, bn.weights = "BiasAdd", bn.name + "/folded", {}, {"b": b}
    return g


def fuse_vertical(g: Graph) -> Graph:
    """Conv -> BiasAdd -> Relu (each the only reader of the one before) becomes one CBR node: one kernel
    that keeps the convolution's sums in registers, adds the bias and clips at zero before writing once.
    AvgPool -> Flatten -> Dense becomes one Head node."""
    g = g.copy()
    for conv in [n for n in g.nodes if n.op == "Conv"]:
        chain, t = [conv], conv.outputs[0]
        for op in ("BiasAdd", "Relu"):
            nxt = _single_consumer(g, t, op)
            if nxt is None:
                break
            chain.append(nxt)
            t = nxt.outputs[0]
        k = conv.weights["w"].shape[-1]
        bias = next((n.weights["b"] for n in chain if n.op == "BiasAdd"), np.zeros(k, np.float32))
        cbr = Node(conv.name, "CBR", conv.inputs, [t], {"kh": conv.attrs["kh"], "kw": conv.attrs["kw"],
                   "relu": chain[-1].op == "Relu", "splits": [k]}, {"w": conv.weights["w"], "b": bias})
        _replace(g, chain, cbr)
    for pool in [n for n in g.nodes if n.op == "AvgPool"]:
        flat = _single_consumer(g, pool.outputs[0], "Flatten")
        dense = flat and _single_consumer(g, flat.outputs[0], "Dense")
        if dense:
            _replace(g, [pool, flat, dense], Node(dense.name, "Head", pool.inputs, dense.outputs,
                                                  {"size": pool.attrs["size"]}, dict(dense.weights)))
    return g


def fuse_horizontal(g: Graph) -> Graph:
    """CBR nodes that read the same tensor with the same kernel size (the 1x1 convolutions at the top of an
    inception block) become one wider CBR: the input is read once, by one kernel, and the output channels
    are split among the original outputs (``splits``)."""
    g = g.copy()
    groups = {}
    for n in g.nodes:
        if n.op == "CBR" and len(n.outputs) == 1:
            groups.setdefault((n.inputs[0], n.attrs["kh"], n.attrs["kw"], n.attrs["relu"]), []).append(n)
    for members in groups.values():
        if len(members) < 2:
            continue
        fused = Node("+".join(m.name for m in members), "CBR", members[0].inputs,
                     [m.outputs[0] for m in members], {**members[0].attrs,
                     "splits": [m.weights["w"].shape[-1] for m in members]},
                     {"w": np.concatenate([m.weights["w"] for m in members], axis=-1),
                      "b": np.concatenate([m.weights["b"] for m in members])})
        _replace(g, members, fused)
    return g


def eliminate_concat(g: Graph) -> Graph:
    """A Concat whose inputs are each written by a node and read by nothing else disappears: each input
    becomes a slice of channels of the concatenated tensor (``aliases``), written in place by its producer."""
    g = g.copy()
    for cat in [n for n in g.nodes if n.op == "Concat"]:
        ok = all(g.producer(t) is not None and t not in g.aliases and _single_consumer(g, t) is cat
                 for t in cat.inputs)
        if not ok or len(set(cat.inputs)) != len(cat.inputs):
            continue
        offset = 0
        for t in cat.inputs:
            g.aliases[t] = (cat.outputs[0], offset)
            offset += g.shapes[t][-1]
        g.nodes.remove(cat)
    return g


def _replace(g: Graph, old: list, new: Node) -> None:
    i = g.nodes.index(old[0])
    for n in old:
        for t in n.outputs:
            if t not in new.outputs:
                g.shapes.pop(t, None)
        g.nodes.remove(n)
    g.nodes.insert(i, new)


PASSES = (("batch-norm folding", fold_batchnorm), ("vertical fusion", fuse_vertical),
          ("horizontal fusion", fuse_horizontal), ("concatenation elimination", eliminate_concat))


def optimize(g: Graph, passes=PASSES) -> list:
    """[(name, graph)]: the imported graph, then the graph after each pass in turn."""
    stages = [("imported", g)]
    for name, fn in passes:
        stages.append((name, fn(stages[-1][1])))
    return stages


# ================================================================================ INT8 calibration

def minmax_scale(x) -> float:
    """Symmetric INT8 scale from the largest magnitude: x ~ scale q, q in -127 .. 127. A tensor of zeros
    gets scale 1 (any scale represents it)."""
    m = float(abs(x).max()) if x.size else 0.0  # array methods: NumPy and CuPy arrays alike
    return m / Q if m > 0 else 1.0


def percentile_scale(x, percentile: float = 99.99) -> float:
    """Scale from a percentile of |x|: the rare largest values saturate, the rest get finer steps."""
    m = float(np.percentile(np.abs(x), percentile)) if np.size(x) else 0.0
    return m / Q if m > 0 else minmax_scale(x)


def entropy_scale(x, bins: int = 2048, levels: int = 128, step: int = 16) -> float:
    """TensorRT's entropy calibration: the clipping threshold T whose INT8 version of the histogram of |x|
    loses the least information (smallest Kullback-Leibler divergence KL(P || Q)), scale T / 127. P: the
    first i bins of the histogram, everything past them added to the last; Q: the same i bins merged into
    128 levels and spread back evenly over the bins that were not empty. Thresholds tried every ``step``
    bins."""
    a = np.abs(np.asarray(x, np.float64)).ravel()
    top = a.max() if a.size else 0.0
    if top == 0:
        return 1.0
    hist, edges = np.histogram(a, bins=bins, range=(0, top))
    hist = hist.astype(np.float64)
    best, best_i = math.inf, bins
    for i in range(levels, bins + 1, step):
        p = hist[:i].copy()
        p[-1] += hist[i:].sum()  # everything past the threshold saturates into the last bin
        nz = hist[:i] > 0
        starts = np.linspace(0, i, levels + 1).astype(int)
        sums = np.add.reduceat(hist[:i], starts[:-1])
        counts = np.add.reduceat(nz.astype(np.float64), starts[:-1])
        q = np.repeat(np.where(counts > 0, sums / np.maximum(counts, 1), 0.0), np.diff(starts)) * nz
        keep = p > 0
        if not keep.any() or np.any(q[keep] == 0):
            continue
        pn, qn = p[keep] / p.sum(), q[keep] / q.sum()
        kl = float(np.sum(pn * np.log(pn / qn)))
        if kl < best:
            best, best_i = kl, i
    return float(edges[best_i]) / Q


SCALE_METHODS = {"minmax": minmax_scale, "percentile": percentile_scale, "entropy": entropy_scale}


def quantize(x, scale: float):
    """INT8 codes of x: round(x / scale) (halves to even), clipped to -127 .. 127."""
    return np.clip(np.rint(x / np.float32(scale)), -Q, Q).astype(np.int8)


def dequantize(q, scale: float):
    return q.astype(np.float32) * np.float32(scale)


def calibrate(g: Graph, x_calib, method: str = "percentile") -> dict:
    """{tensor: INT8 scale} for every tensor that gets a buffer, from the FP32 activations of a sample."""
    if method not in SCALE_METHODS:
        raise runtime.CourseInputError(f"calibration must be one of {', '.join(SCALE_METHODS)}, not {method!r}")
    _, vals = run_graph(g, x_calib, keep=True)
    scales = {t: SCALE_METHODS[method](v) for t, v in vals.items() if t not in g.aliases}
    for n in g.nodes:  # a max pool keeps the scale of its input: the max of integers is exact
        if n.op == "MaxPool":
            scales[_root(g, n.outputs[0])[0]] = scales[_root(g, n.inputs[0])[0]]
    return scales


def _root(g: Graph, t: str) -> tuple:
    off = 0
    while t in g.aliases:
        t, o = g.aliases[t]
        off += o
    return t, off


# ================================================================================ the plan

@dataclass
class Plan:
    """What the builder decided: buffers, one step per kernel launch, weights in the arena's precision,
    kernel choices with their timings. ``header`` is JSON; ``arrays`` hold the weights."""

    header: dict
    arrays: dict

    @property
    def steps(self) -> list:
        return self.header["steps"]

    @property
    def launches(self) -> int:
        """Kernels per inference: one per step."""
        return len(self.steps)

    @property
    def host_launches(self) -> int:
        """Launches the host makes per inference: one graph launch with CUDA graphs, one per kernel without."""
        return 1 if self.header.get("graphs") else len(self.steps)

    def save(self, path) -> Path:
        """Write the plan: an .npz (no pickle) of the weights and the JSON header with its checksum."""
        header = dict(self.header, checksum=_checksum(self.header, self.arrays))
        path = Path(path)
        with open(path, "wb") as f:
            np.savez(f, header=_json_bytes(header), **{f"a/{k}": v for k, v in self.arrays.items()})
        return path


def _checksum(header: dict, arrays: dict) -> str:
    h = hashlib.sha256(json.dumps({k: v for k, v in header.items() if k != "checksum"}, sort_keys=True).encode())
    for k in sorted(arrays):
        a = np.ascontiguousarray(arrays[k])
        h.update(f"{k}:{a.dtype.str}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def this_target() -> dict:
    """What a plan is built for: this GPU (name, compute capability) in GPU mode, NumPy in CPU mode."""
    rt = runtime.get()
    if rt.gpu:
        return {"kind": "gpu", "name": rt.device["name"], "compute_capability": rt.device["compute_capability"]}
    return {"kind": "numpy", "name": "NumPy (CPU mode)", "compute_capability": None}


def load_plan(path) -> Plan:
    """Read a plan file, refusing (CourseError, saying what differs) a file that is not a plan, is damaged,
    has another format version, or was built for another GPU or runtime. Nothing is re-optimised."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":  # every .npz is a zip archive
                raise runtime.CourseError(f"{path} is not a plan file (not an .npz archive)")
        with np.load(path, allow_pickle=False) as f:
            header = json.loads(bytes(f["header"]).decode())
            arrays = {k[2:]: f[k] for k in f.files if k.startswith("a/")}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        raise runtime.CourseError(f"{path} is not a readable plan file (damaged, or not a plan): "
                                  f"{type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict) or header.get("magic") != PLAN_MAGIC:
        raise runtime.CourseError(f"{path} is not a plan of this engine (no {PLAN_MAGIC} header)")
    if header.get("format") != PLAN_FORMAT:
        raise runtime.CourseError(f"{path} has plan format version {header.get('format')}; this runtime reads "
                                  f"version {PLAN_FORMAT}: rebuild the plan with build_plan")
    if header.get("checksum") != _checksum(header, arrays):
        raise runtime.CourseError(f"{path}: checksum mismatch, the file was changed or damaged after it was "
                                  "written; refusing to run it")
    plan = Plan(header, arrays)
    check_target(plan)
    return plan


def check_target(plan: Plan) -> None:
    built, here = plan.header["target"], this_target()
    for key in ("kind", "name", "compute_capability"):
        if built.get(key) != here.get(key):
            raise runtime.CourseError(
                f"this plan was built for {built['name']} (compute capability {built['compute_capability']}), "
                f"and this machine runs {here['name']} (compute capability {here['compute_capability']}): its "
                f"{key.replace('_', ' ')} differs. A plan's kernels are chosen and timed for one GPU; rebuild "
                "the plan here")


def build_plan(g: Graph, *, precision: str = "fp32", max_batch: int = 256, x_calib=None,
               calibration: str = "percentile", tune: bool = True, name: str = "", graphs: bool = True) -> Plan:
    """Buffers, steps and weights for graph ``g`` (optimised or not) in ``precision``. INT8 needs
    ``x_calib`` (a sample of inputs) and a ``calibration`` method. On a GPU with ``tune``, every
    convolution's kernel is chosen by timing each candidate on this GPU at ``max_batch``. ``graphs``: the
    runtime replays the launches of each batch size as one CUDA graph (an Engine can override it)."""
    if precision not in PRECISIONS:
        raise runtime.CourseInputError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise runtime.CourseInputError(f"max_batch must be a positive int, got {max_batch!r}")
    h, w, _ = g.shapes[g.input]
    if max_batch * h * w * max(s[-1] for s in g.shapes.values()) >= 2**31:
        raise runtime.CourseInputError(f"max_batch {max_batch} is too large: the kernels index a tensor with "
                                       "32-bit integers")
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


def kernel_fits(step: dict, kernel: str) -> bool:
    """Whether a convolution kernel can run a conv step: a direct kernel only the kernel size it is compiled for;
    the wmmav kernels load 8 channels of a pixel at once (16 bytes), so the input's channels, pixel stride and
    first channel must be multiples of 8."""
    if kernel in DIRECT:
        return step["kh"] == step["kw"] == DIRECT[kernel][0]
    if not kernel.startswith("wmmav"):
        return True
    src = step["src"]
    return src["C"] % VECTOR == 0 and src["ld"] % VECTOR == 0 and (src["base"] + src["off"]) % VECTOR == 0


def candidates(step: dict, precision: str) -> list:
    """The kernels of CANDIDATES[precision] that can run this conv step."""
    return [k for k in CANDIDATES[precision] if kernel_fits(step, k)]


def autotune(plan: Plan, repeats: int = 10) -> dict:
    """Time every candidate kernel of every convolution on this GPU at the plan's max_batch and keep the
    fastest (step["kernel"]); the timings stay in the plan (step["tuning"], ms: GPU time of one launch,
    ``bench.time_per_call``). A candidate is first run through a whole inference from a poisoned arena and
    must give the logits of the default kernel (to FP16 rounding); one that does not is left out
    (step["rejected"]) whatever its speed."""
    from gpucourse import bench

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


# ================================================================================ the runtime

class Engine:
    """Runs a plan: CUDA C kernels through CuPy in GPU mode, NumPy in CPU mode (same steps, same arithmetic:
    FP16 storage with FP32 accumulation, INT8 storage with int32 accumulation).

    ``launches`` counts the kernels run since the engine was made, ``host_launches`` the launches the host
    made for them: one per kernel when the steps are launched one by one ("eager"), one per inference when
    a CUDA graph replays them all (plus one copy when the input is not already in ``input_buffer``)."""

    def __init__(self, plan: Plan, *, numpy: bool = False, graphs: bool | None = None):
        """numpy=True runs the plan with the NumPy runtime whatever the mode (what the GPU kernels are checked
        against). graphs: replay each batch size's launches as one CUDA graph (GPU mode only); None takes the
        plan's choice (build_plan's ``graphs``)."""
        check_target(plan)
        self.plan = plan
        self.precision = plan.header["precision"]
        self.dtype = DTYPES[self.precision]
        self.gpu = plan.header["target"]["kind"] == "gpu" and not numpy
        self.graphs = bool(plan.header.get("graphs", False) if graphs is None else graphs) and self.gpu
        self.launches = 0
        self.host_launches = 0
        self.max_batch = plan.header["max_batch"]
        if self.gpu:
            cp = runtime.cupy()
            self.xp = cp
            self.dev = {k: cp.asarray(v) for k, v in plan.arrays.items()}
            self._fn = {}
            self._prepared = {}
            self._graph = {}  # batch size -> cupy.cuda.Graph
        else:
            self.xp = np
            self.dev = plan.arrays
        self.arena = self.xp.zeros(plan.header["arena"], self.dtype)
        self.out = self.xp.zeros((self.max_batch, plan.header["outputs"]), np.float32)
        # the input binding: where a CUDA graph reads the input (its kernels' arguments are fixed pointers)
        self.input = self.xp.zeros((self.max_batch, *plan.header["input_shape"]), np.float32)
        self._x = None

    def input_buffer(self, n: int):
        """The engine's own input buffer for a batch of n: an input written here is read in place (no copy)."""
        return self.input[:n]

    def refresh(self, step_id: int) -> None:
        """Forget the compiled kernel of a step (after its kernel choice changed)."""
        if self.gpu:
            self._fn.pop(step_id, None)
            self._prepared = {k: v for k, v in self._prepared.items() if k[0] != step_id}
            self._graph.clear()  # a graph holds the kernels it was captured with

    # ------------------------------------------------------------------ the public call
    def infer(self, x):
        """Logits (N x outputs, float32) of a batch of inputs N x H x W x C float32 (a NumPy array, or a
        CuPy array in GPU mode), N <= the plan's max_batch."""
        shape = tuple(self.plan.header["input_shape"])
        if self.gpu and not runtime.is_device_array(x):
            x = self.xp.asarray(np.asarray(x, np.float32))
        if getattr(x, "ndim", 0) != 4 or tuple(x.shape[1:]) != shape:
            raise runtime.CourseInputError(f"the input must be N x {' x '.join(map(str, shape))}, got "
                                           f"{tuple(getattr(x, 'shape', ()))}")
        if np.dtype(x.dtype) != np.float32:
            raise runtime.CourseInputError(f"the input must be float32, got {np.dtype(x.dtype)}")
        n = x.shape[0]
        if not 1 <= n <= self.max_batch:
            raise runtime.CourseInputError(f"a batch of {n}: this plan takes 1 to {self.max_batch} inputs")
        if self.graphs:
            self._infer_graph(x, n)
            return self.out[:n]
        self._x = self.xp.ascontiguousarray(x)
        for step in self.plan.steps:
            self.run_step(step["id"], n)
        return self.out[:n]

    def run_step(self, i: int, n: int) -> None:
        step = self.plan.steps[i]
        self.launches += 1
        self.host_launches += 1
        (self._gpu_step if self.gpu else self._numpy_step)(step, n)

    # ------------------------------------------------------------------ CUDA graphs
    def _infer_graph(self, x, n: int) -> None:
        """One inference as one graph launch. The graph was captured with the input buffer's address, so an
        input elsewhere is first copied there."""
        binding = self.input[:n]
        if x.data.ptr != binding.data.ptr:
            binding[...] = x
            self.host_launches += 1
        graph = self._graph.get(n)
        if graph is None:
            graph = self._graph[n] = self.capture(n)
        graph.launch()
        self.launches += len(self.plan.steps)
        self.host_launches += 1

    def capture(self, n: int):
        """The plan's launches for a batch of n, recorded once as a CUDA graph (cupy.cuda.Graph): CuPy's
        stream capture records the kernels launched on a (non-default) stream instead of running them, and
        ``graph.launch()`` then replays the whole sequence with one call from the host."""
        runtime.require_gpu("capturing a CUDA graph")
        cp = runtime.cupy()
        self._x = self.input[:n]
        for step in self.plan.steps:  # compile and prepare every kernel first: nothing may load during capture
            self._gpu_step(step, n)
        cp.cuda.Device().synchronize()
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            try:
                for step in self.plan.steps:
                    self._gpu_step(step, n)
            finally:
                graph = stream.end_capture()
        return graph

    # ------------------------------------------------------------------ NumPy
    def _view(self, loc, n):
        a = self.arena[loc["base"]: loc["base"] + n * loc["H"] * loc["W"] * loc["ld"]]
        return a.reshape(n, loc["H"], loc["W"], loc["ld"])[..., loc["off"]: loc["off"] + loc["C"]]

    def _numpy_step(self, s, n):
        a = self.dev
        i = s["id"]
        kind = s["kind"]
        if kind == "input":
            v = self._x.reshape(self._view(s["dst"], n).shape)
            self._view(s["dst"], n)[...] = _store(v.astype(np.float32), self.dtype, s["inv_scale"])
        elif kind == "conv":
            x = self._view(s["src"], n)
            cols = im2col(x, s["kh"], s["kw"]).reshape(-1, a[f"{i}/w"].shape[0])
            if self.precision == "int8":
                # integer products summed exactly (float64 holds every such sum exactly), as int32 on a GPU
                acc = (cols.astype(np.float64) @ a[f"{i}/w"].astype(np.float64)).astype(np.float32) * a[f"{i}/scale"]
            else:
                acc = cols.astype(np.float32) @ a[f"{i}/w"].astype(np.float32)
            if s["bias"]:
                acc = acc + a[f"{i}/b"]
            if s["relu"]:
                acc = np.maximum(acc, 0)
            start = 0
            for d in s["dests"]:
                part = acc[:, start:start + d["C"]]
                inv = a[f"{i}/inv"][start] if self.precision == "int8" else 1.0
                self._view(d, n)[...] = _store(part, self.dtype, inv).reshape(self._view(d, n).shape)
                start += d["C"]
        elif kind in ("biasadd", "batchnorm", "relu"):
            v = self._view(s["dst"], n).astype(np.float32)
            if kind == "biasadd":
                v = v + a[f"{i}/b"]
            elif kind == "batchnorm":
                v = (v - a[f"{i}/mean"]) / np.sqrt(a[f"{i}/var"] + np.float32(s["eps"])) * a[f"{i}/gamma"] \
                    + a[f"{i}/beta"]
            else:
                v = np.maximum(v, 0)
            self._view(s["dst"], n)[...] = v.astype(self.dtype)
        elif kind == "maxpool":
            self._view(s["dst"], n)[...] = maxpool_spec(self._view(s["src"], n).astype(np.float32),
                                                        s["size"]).astype(self.dtype)
        elif kind == "concat_copy":
            self._view(s["dst"], n)[...] = self._view(s["src"], n)
        elif kind == "avgpool":
            self._view(s["dst"], n)[...] = avgpool_spec(self._view(s["src"], n).astype(np.float32),
                                                        s["size"]).astype(self.dtype)
        elif kind == "dense":
            x = self._view(s["src"], n).reshape(n, -1).astype(np.float32)
            self.out[:n] = x @ a[f"{i}/w"] + a[f"{i}/b"]
        elif kind == "head":
            x = self._view(s["src"], n).astype(np.float32) * np.float32(s["x_scale"])
            p = avgpool_spec(x, s["size"]).reshape(n, -1)
            self.out[:n] = p @ a[f"{i}/w"] + a[f"{i}/b"]

    # ------------------------------------------------------------------ GPU
    def _kernel(self, name: str):
        return cuda_c.function(SOURCE, name)

    def _ptr(self, loc):
        return self.arena[loc["base"] + loc["off"]:]

    def _gpu_step(self, s, n):
        """Launch a step's kernel with its arguments prepared once per (step, batch size): on the critical path
        of a small batch, Python's own work per launch counts as much as the kernel."""
        prep = self._prepared.get((s["id"], n))
        if prep is None:
            prep = self._prepared[(s["id"], n)] = self._prepare(s, n)
        fn, grid, block, args, shared = prep
        if s["kind"] == "input":
            args = (self._x,) + args[1:]
        fn(grid, block, args, shared_mem=shared)

    def _prepare(self, s, n):
        """(kernel, grid, block, arguments, shared memory bytes) of step ``s`` for a batch of ``n``."""
        i = s["id"]
        a = self.dev
        sfx = SUFFIX[self.precision]
        null = np.uint64(0)  # a null pointer: no bias, no scale
        kind = s["kind"]
        i32, i64 = np.int32, np.int64
        block = (THREADS,)

        def grid(count):
            return (math.ceil(count / THREADS),)

        if kind == "conv":
            fn = self._fn.get(i)
            if fn is None:
                fn = self._fn[i] = self._kernel(f"conv_{s['kernel']}_{sfx}")
            bm, bn, threads = CONV_KERNELS[s["kernel"]]
            src = s["src"]
            M = n * src["H"] * src["W"]
            blocks = math.ceil(M / bm)
            if s["kernel"] in DIRECT:  # one block per TH x TW tile of an image
                _, th, tw = DIRECT[s["kernel"]][:3]
                blocks = n * math.ceil(src["H"] / th) * math.ceil(src["W"] / tw)
            return (fn, (blocks, math.ceil(s["K"] / bn)), (threads,),
                    (self._ptr(src), i32(src["ld"]), a[f"{i}/w"], a.get(f"{i}/b", null), a.get(f"{i}/scale", null),
                     self.arena, a[f"{i}/y_off"], a[f"{i}/y_ld"], a.get(f"{i}/inv", null), i32(n), i32(src["H"]),
                     i32(src["W"]), i32(src["C"]), i32(s["K"]), i32(s["kh"]), i32(s["kw"]), i32(s["relu"])), 0)
        if kind == "input":
            d = s["dst"]
            count = n * d["H"] * d["W"] * d["C"]
            return (self._kernel(f"convert_in_{sfx}"), grid(count), block,
                    (None, i64(count), self._ptr(d), np.float32(s["inv_scale"])), 0)
        if kind in ("biasadd", "batchnorm", "relu"):
            d = s["dst"]
            M = n * d["H"] * d["W"]
            if kind == "biasadd":
                args = (self._ptr(d), i64(M), i32(d["C"]), a[f"{i}/b"])
            elif kind == "batchnorm":
                args = (self._ptr(d), i64(M), i32(d["C"]), a[f"{i}/gamma"], a[f"{i}/beta"], a[f"{i}/mean"],
                        a[f"{i}/var"], np.float32(s["eps"]))
            else:
                args = (self._ptr(d), i64(M * d["C"]))
            name = {"biasadd": "bias_add", "batchnorm": "batchnorm", "relu": "relu"}[kind]
            return (self._kernel(f"{name}_{sfx}"), grid(M * d["C"]), block, args, 0)
        if kind == "maxpool":
            src, d = s["src"], s["dst"]
            return (self._kernel(f"maxpool_{sfx}"), grid(n * src["H"] * src["W"] * src["C"]), block,
                    (self._ptr(src), i32(src["ld"]), self._ptr(d), i32(d["ld"]), i32(n), i32(src["H"]), i32(src["W"]),
                     i32(src["C"]), i32(s["size"])), 0)
        if kind == "concat_copy":
            src, d = s["src"], s["dst"]
            M = n * src["H"] * src["W"]
            return (self._kernel(f"concat_copy_{sfx}"), grid(M * src["C"]), block,
                    (self._ptr(src), i64(M), i32(src["C"]), self._ptr(d), i32(d["ld"])), 0)
        if kind == "avgpool":
            src, d, p = s["src"], s["dst"], s["size"]
            count = n * (src["H"] // p) * (src["W"] // p) * src["C"]
            return (self._kernel(f"avgpool_{sfx}"), grid(count), block,
                    (self._ptr(src), i32(n), i32(src["H"]), i32(src["W"]), i32(src["C"]), i32(p), self._ptr(d)), 0)
        if kind == "dense":
            src = s["src"]
            D = src["H"] * src["W"] * src["C"]
            return (self._kernel(f"dense_{sfx}"), grid(n * s["O"]), block,
                    (self._ptr(src), i32(n), i32(D), a[f"{i}/w"], a[f"{i}/b"], self.out, i32(s["O"])), 0)
        if kind == "head":
            src, p = s["src"], s["size"]
            D = (src["H"] // p) * (src["W"] // p) * src["C"]
            return (self._kernel(f"head_{sfx}"), (n,), block,
                    (self._ptr(src), i32(src["ld"]), i32(src["H"]), i32(src["W"]), i32(src["C"]), i32(p),
                     np.float32(s["x_scale"]), a[f"{i}/w"], a[f"{i}/b"], self.out, i32(s["O"])), 4 * D)
        raise runtime.CourseError(f"step {i}: no kernel for {kind!r}")


def _store(v, dtype, inv_scale):
    """float32 values into the arena's type (INT8: quantised with 1 / scale), as the kernels' store()."""
    if dtype == np.int8:
        return np.clip(np.rint(v * np.float32(inv_scale)), -Q, Q).astype(np.int8)
    return v.astype(dtype)


def accuracy(engine: Engine, x, y, batch: int | None = None) -> float:
    """Fraction of ``x`` classified as ``y`` by the engine, in batches of at most the plan's max_batch."""
    batch = batch or engine.max_batch
    hits = 0
    for s in range(0, len(x), batch):
        logits = engine.infer(np.asarray(x[s:s + batch], np.float32))
        hits += int(np.sum(_host(logits).argmax(1) == np.asarray(y[s:s + batch])))
    return hits / len(x)


def predict(engine: Engine, x, batch: int | None = None) -> np.ndarray:
    batch = batch or engine.max_batch
    return np.concatenate([_host(engine.infer(np.asarray(x[s:s + batch], np.float32))).copy()
                           for s in range(0, len(x), batch)])


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


# ================================================================================ the fused CBR kernel (numba)

@cuda.jit
def cbr_direct(x, w, b, y):
    """y = ReLU(conv(x, w) + b), NHWC, stride 1, "same" padding, one thread per output element (n, h, w, k),
    grid-stride: the sums stay in a register and each output is written once. x: N x H x W x C,
    w: KH x KW x C x K, b: K, y: N x H x W x K, all float32."""
    N, H, W, C = x.shape
    KH, KW, _, K = w.shape
    total = N * H * W * K
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for e in range(start, total, stride):
        k = e % K
        t = e // K
        col = t % W
        row = (t // W) % H
        n = t // (W * H)
        acc = b[k]
        for dy in range(KH):
            hh = row + dy - KH // 2
            if 0 <= hh < H:
                for dx in range(KW):
                    ww = col + dx - KW // 2
                    if 0 <= ww < W:
                        for c in range(C):
                            acc += x[n, hh, ww, c] * w[dy, dx, c, k]
        y[n, row, col, k] = max(acc, np.float32(0.0))


def cbr_numba(x, w, b, y, *, threads: int = 128, blocks: int | None = None):
    """Launch ``cbr_direct`` with checks; blocks default to one thread per output (capped in CPU mode)."""
    for name, a, nd in (("x", x, 4), ("w", w, 4), ("b", b, 1), ("y", y, 4)):
        runtime.check_device_array(a, name, dtype=np.float32, ndim=nd)
    n, h, wd, c = x.shape
    if w.shape[2] != c or w.shape[0] % 2 == 0 or w.shape[1] % 2 == 0:
        raise runtime.CourseInputError(f"w must be KH x KW x {c} x K with odd KH, KW; got {tuple(w.shape)}")
    if tuple(b.shape) != (w.shape[3],) or tuple(y.shape) != (n, h, wd, w.shape[3]):
        raise runtime.CourseInputError(f"b must have shape ({w.shape[3]},) and y {(n, h, wd, w.shape[3])}; got "
                                       f"{tuple(b.shape)} and {tuple(y.shape)}")
    total = n * h * wd * w.shape[3]
    if blocks is None:
        blocks = math.ceil(total / threads) if runtime.is_gpu() else min(math.ceil(total / threads), 4)
    cbr_direct[blocks, threads](x, w, b, y)
    return y

"""ResNet-50 (He et al., 2016) as an engine graph, built with NumPy: Keras' ``keras.applications.ResNet50``
layer for layer (its layer names too; tests/test_06_inference_engine_resnet.py imports Keras' own and compares), with
fixed random weights (He's initialisation, seeded) and batch-norm statistics from a calibration pass, so nothing
is downloaded and TensorFlow is not needed. Also: what each convolution costs (FLOPs, bytes) and the floors the
GPU's measured ceilings put under it, layer by layer (a roofline per layer, on paper).

The network: a 7 x 7 convolution of stride 2 and a 3 x 3 max pool of stride 2, then 16 bottleneck blocks in four
stages (1 x 1, 3 x 3, 1 x 1 convolutions, each with a batch norm, ReLU after the first two, the block's input added
before the last ReLU; the first block of a stage projects its input with a 1 x 1 convolution, of stride 2 from the
second stage on), a global average pool and a 1000-way classifier with softmax: 53 convolutions, 25.6 M weights,
3.9 G multiply-adds an image at 224 x 224.
"""
from __future__ import annotations

import numpy as np

from gpucourse import runtime

from .graph import _shape_of, conv_geometry, Graph, Node
from .specs import run_graph

# (stage, bottleneck width, blocks, stride of its first block)
STAGES = (("conv2", 64, 3, 1), ("conv3", 128, 4, 2), ("conv4", 256, 6, 2), ("conv5", 512, 3, 2))
BN_EPS = 1.001e-5  # Keras' ResNet's


class _Builder:
    """Appends nodes named as Keras names the layers they come from (a Conv2D with a bias: its Conv node takes the
    layer's name, the BiasAdd ``name/biasadd``)."""

    def __init__(self, rng, input_name: str, shape: tuple):
        self.rng, self.nodes, self.shapes = rng, [], {input_name: shape}

    def _add(self, name, op, inputs, attrs=None, weights=None) -> str:
        node = Node(name, op, list(inputs), [name], attrs or {}, weights or {})
        self.shapes[name] = _shape_of(node, [self.shapes[t] for t in node.inputs])
        self.nodes.append(node)
        return name

    def conv(self, name, x, filters, k, stride=1, padding="same") -> str:
        if padding == "same" and stride != 1:
            raise runtime.CourseInputError("the builder makes only ResNet-50's convolutions: 'same' at stride 1")
        c = self.shapes[x][-1]
        w = (self.rng.standard_normal((k, k, c, filters)) * np.sqrt(2.0 / (k * k * c))).astype(np.float32)
        attrs = {"kh": k, "kw": k}
        if stride != 1 or (padding == "valid" and k > 1):
            attrs.update(stride=stride, pad=[0, 0, 0, 0])
        t = self._add(name, "Conv", [x], attrs, {"w": w})
        return self._add(f"{name}/biasadd", "BiasAdd", [t], weights={"b": np.zeros(filters, np.float32)})

    def bn(self, name, x) -> str:
        c = self.shapes[x][-1]
        ones, zeros = np.ones(c, np.float32), np.zeros(c, np.float32)
        return self._add(name, "BatchNorm", [x], {"eps": BN_EPS},
                         {"gamma": ones, "beta": zeros, "mean": zeros.copy(), "var": ones.copy()})

    def block(self, x, filters, stride, project, name) -> str:
        """Keras' residual_block_v1: the shortcut first (projected, or the block's input), then the main path."""
        shortcut = self.bn(f"{name}_0_bn", self.conv(f"{name}_0_conv", x, 4 * filters, 1, stride, "valid")) \
            if project else x
        y = self._add(f"{name}_1_relu", "Relu", [self.bn(f"{name}_1_bn", self.conv(f"{name}_1_conv", x, filters, 1,
                                                                                  stride, "valid"))])
        y = self._add(f"{name}_2_relu", "Relu", [self.bn(f"{name}_2_bn", self.conv(f"{name}_2_conv", y, filters, 3))])
        y = self.bn(f"{name}_3_bn", self.conv(f"{name}_3_conv", y, 4 * filters, 1, 1, "valid"))
        return self._add(f"{name}_out", "Relu", [self._add(f"{name}_add", "Add", [shortcut, y])])


def resnet50(image_size: int = 224, classes: int = 1000, *, seed: int = 0, input_name: str = "input_layer") -> Graph:
    """The imported graph of ResNet-50 (Pad, Conv, BiasAdd, BatchNorm, Relu, MaxPool, Add, GlobalAvgPool, Dense,
    Softmax) for square RGB images of ``image_size`` (32 or more), with He-initialised weights from ``seed`` and
    batch norms that are the identity until ``calibrate_batchnorm`` sets their statistics."""
    if not isinstance(image_size, int) or image_size < 32:
        raise runtime.CourseInputError(f"ResNet-50 takes images of 32 x 32 pixels or more, got {image_size!r}")
    b = _Builder(np.random.default_rng(seed), input_name, (image_size, image_size, 3))
    x = b._add("conv1_pad", "Pad", [input_name], {"pad": [3, 3, 3, 3]})
    x = b._add("conv1_relu", "Relu", [b.bn("conv1_bn", b.conv("conv1_conv", x, 64, 7, 2, "valid"))])
    x = b._add("pool1_pad", "Pad", [x], {"pad": [1, 1, 1, 1]})
    x = b._add("pool1_pool", "MaxPool", [x], {"size": 3, "stride": 2, "pad": [0, 0, 0, 0]})
    for stage, filters, blocks, stride in STAGES:
        for i in range(1, blocks + 1):
            x = b.block(x, filters, stride if i == 1 else 1, i == 1, f"{stage}_block{i}")
    x = b._add("avg_pool", "GlobalAvgPool", [x])
    w = (b.rng.standard_normal((b.shapes[x][0], classes)) / np.sqrt(b.shapes[x][0])).astype(np.float32)
    x = b._add("predictions", "Dense", [x], weights={"w": w, "b": np.zeros(classes, np.float32)})
    x = b._add("predictions/softmax", "Softmax", [x])
    return Graph(b.nodes, b.shapes, input_name, x)


def calibrate_batchnorm(g: Graph, images, *, progress: bool = True) -> Graph:
    """A copy of ``g`` whose batch norms hold the mean and variance of what reaches them when ``images`` (N x H x
    W x 3) go through the network, each set before the layers after it run (a calibration pass: what training's
    running statistics would settle to on these images). Runs the NumPy reference, node by node."""
    g = g.copy()
    x = np.asarray(images, np.float64)
    if x.ndim != 4 or tuple(x.shape[1:]) != tuple(g.shapes[g.input]):
        raise runtime.CourseInputError(f"calibration images must be N x {' x '.join(map(str, g.shapes[g.input]))}, "
                                       f"got {x.shape}")

    def set_statistics(n, ins):
        if n.op == "BatchNorm":
            n.weights["mean"] = ins[0].mean(axis=(0, 1, 2)).astype(np.float32)
            n.weights["var"] = ins[0].var(axis=(0, 1, 2)).astype(np.float32)

    run_graph(g, x, before=set_statistics, progress="calibrating batch norms" if progress else None)
    return g


def _read(size: int, k: int, stride: int, pad: int, out: int) -> int:
    """How many of an axis's ``size`` input positions a window of ``k`` at ``stride`` (``pad`` before the first)
    reads for ``out`` outputs: all of them, unless the window is narrower than the stride (a strided 1x1 convolution
    reads every stride-th row and column only)."""
    return len({o * stride + i - pad for o in range(out) for i in range(k)} & set(range(size)))


def layer_costs(g: Graph, batch: int = 1, bytes_per_element: int = 2) -> list:
    """Per convolution (Conv or CBR node) of ``g``: FLOPs (2 multiply-add) and the bytes it must move at least
    (the input pixels its windows read, its weights, its output and any residual once each, ``bytes_per_element``
    each) for ``batch`` images."""
    rows = []
    for n in g.nodes:
        if n.op not in ("Conv", "CBR"):
            continue
        (h, w, c), (ho, wo, k) = g.shapes[n.inputs[0]], g.shapes[n.outputs[0]]
        k = n.weights["w"].shape[-1]
        stride, pad = conv_geometry(n.attrs)
        macs = batch * ho * wo * k * n.attrs["kh"] * n.attrs["kw"] * c
        read = _read(h, n.attrs["kh"], stride, pad[0], ho) * _read(w, n.attrs["kw"], stride, pad[2], wo) * c
        elements = batch * (read + ho * wo * k * (2 if n.attrs.get("residual") else 1)) + n.weights["w"].size
        rows.append({"name": n.name, "kernel": f"{n.attrs['kh']}x{n.attrs['kw']}/{stride}", "in": [h, w, c],
                     "out": [ho, wo, k], "flops": 2.0 * macs, "bytes": float(elements * bytes_per_element)})
    return rows


def floors(rows: list, tflops: float, gbps: float) -> list:
    """Each layer of ``layer_costs`` with its two floors, the time its FLOPs take at ``tflops`` and its bytes at
    ``gbps``, and which one binds (a roofline per layer)."""
    out = []
    for r in rows:
        compute, memory = r["flops"] / (tflops * 1e12), r["bytes"] / (gbps * 1e9)
        out.append({**r, "compute_s": compute, "memory_s": memory, "bound": "compute" if compute >= memory else "memory",
                    "intensity": r["flops"] / r["bytes"]})
    return out

"""The optimisation passes: batch-norm folding, vertical fusion (conv + bias + ReLU into CBR),
horizontal fusion (convolutions of one input side by side), concat elimination; ``optimize`` runs them.
"""
from __future__ import annotations

import numpy as np

from .graph import Graph, Node
from .specs import fold_bn_weights


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

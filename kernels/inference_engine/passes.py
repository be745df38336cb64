"""The optimisation passes: batch-norm folding, vertical fusion (conv + bias (+ residual) + ReLU into CBR),
horizontal fusion (convolutions of one input side by side), concat elimination, padding folding; ``optimize`` runs
them.
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


def fold_padding(g: Graph) -> Graph:
    """A Pad (zeros, Keras' ZeroPadding2D) read only by a "valid" convolution (Conv or CBR) or max pool becomes that
    node's own padding: the kernel reads zeros past the edges instead of a padded copy of the tensor being written
    first."""
    g = g.copy()
    for pad in [n for n in g.nodes if n.op == "Pad"]:
        user = _single_consumer(g, pad.outputs[0])
        if user is None or user.op not in ("Conv", "CBR", "MaxPool") or user.attrs.get("pad") != [0, 0, 0, 0]:
            continue
        user.attrs["pad"] = list(pad.attrs["pad"])
        user.attrs.setdefault("stride", 1)
        user.inputs = [pad.inputs[0]]
        g.shapes.pop(pad.outputs[0], None)
        g.nodes.remove(pad)
    return g


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
    """Conv -> BiasAdd (-> Add) -> Relu (each the only reader of the one before) becomes one CBR node: one kernel
    that keeps the convolution's sums in registers, adds the bias (and a residual tensor, a ResNet block's
    shortcut) and clips at zero before writing once. AvgPool -> Flatten -> Dense, and GlobalAvgPool -> Dense
    (-> Softmax), become one Head node."""
    g = g.copy()
    # the last convolution first: of two convolutions meeting at an Add (a residual block's main path and its
    # projected shortcut), the later one takes the Add into its epilogue and the earlier one's output is the residual
    for conv in [n for n in reversed(g.nodes) if n.op == "Conv"]:
        chain, t, residual = [conv], conv.outputs[0], None
        for op in ("BiasAdd", "Add", "Relu"):
            nxt = _single_consumer(g, t, op)
            if nxt is None and op == "Add":
                continue  # no residual here
            if nxt is None:
                break
            chain.append(nxt)
            if op == "Add":  # the residual: the Add's other input, added before the ReLU
                residual = nxt.inputs[1] if nxt.inputs[0] == t else nxt.inputs[0]
            t = nxt.outputs[0]
        k = conv.weights["w"].shape[-1]
        bias = next((n.weights["b"] for n in chain if n.op == "BiasAdd"), np.zeros(k, np.float32))
        attrs = {"kh": conv.attrs["kh"], "kw": conv.attrs["kw"], "relu": chain[-1].op == "Relu", "splits": [k]}
        attrs.update({key: conv.attrs[key] for key in ("stride", "pad") if key in conv.attrs})
        if residual is not None:
            attrs["residual"] = True
        cbr = Node(conv.name, "CBR", conv.inputs + ([residual] if residual else []), [t], attrs,
                   {"w": conv.weights["w"], "b": bias})
        _replace(g, chain, cbr, at=-1 if residual else 0)  # at the Add: the residual is ready there
    for pool in [n for n in g.nodes if n.op == "AvgPool"]:
        flat = _single_consumer(g, pool.outputs[0], "Flatten")
        dense = flat and _single_consumer(g, flat.outputs[0], "Dense")
        if dense:
            _replace(g, [pool, flat, dense], Node(dense.name, "Head", pool.inputs, dense.outputs,
                                                  {"size": pool.attrs["size"]}, dict(dense.weights)))
    for pool in [n for n in g.nodes if n.op == "GlobalAvgPool"]:
        dense = _single_consumer(g, pool.outputs[0], "Dense")
        if dense:
            soft = _single_consumer(g, dense.outputs[0], "Softmax")
            chain = [pool, dense] + ([soft] if soft else [])
            _replace(g, chain, Node(dense.name, "Head", pool.inputs, chain[-1].outputs,
                                    {"global": True, "softmax": soft is not None}, dict(dense.weights)))
    return g


def fuse_horizontal(g: Graph) -> Graph:
    """CBR nodes that read the same tensor with the same kernel size (the 1x1 convolutions at the top of an
    inception block) become one wider CBR: the input is read once, by one kernel, and the output channels
    are split among the original outputs (``splits``)."""
    g = g.copy()
    groups = {}
    for n in g.nodes:
        if n.op == "CBR" and len(n.outputs) == 1:
            key = (n.inputs[0], n.attrs["kh"], n.attrs["kw"], n.attrs["relu"], n.attrs.get("stride", 1),
                   tuple(n.attrs.get("pad", ())), n.attrs.get("residual", False))
            if not n.attrs.get("residual"):  # a residual's second input is its own: never side by side
                groups.setdefault(key, []).append(n)
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


def _replace(g: Graph, old: list, new: Node, at: int = 0) -> None:
    """Nodes ``old`` become ``new``, placed where old[at] was."""
    i = g.nodes.index(old[at]) - sum(1 for n in old if g.nodes.index(n) < g.nodes.index(old[at]))
    for n in old:
        for t in n.outputs:
            if t not in new.outputs:
                g.shapes.pop(t, None)
        g.nodes.remove(n)
    g.nodes.insert(i, new)


PASSES = (("batch-norm folding", fold_batchnorm), ("vertical fusion", fuse_vertical),
          ("horizontal fusion", fuse_horizontal), ("concatenation elimination", eliminate_concat),
          ("padding folding", fold_padding))


def optimize(g: Graph, passes=PASSES) -> list:
    """[(name, graph)]: the imported graph, then the graph after each pass in turn."""
    stages = [("imported", g)]
    for name, fn in passes:
        stages.append((name, fn(stages[-1][1])))
    return stages

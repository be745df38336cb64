"""The digits network in one kernel (kernels/cuda/inference_engine_network.cu): where a graph is the lesson's network
(``match``), the plan step that takes the place of all of its steps (``fuse``: built from the steps the plan runs
without it, so the weights, scales and roundings are theirs), the step's arithmetic in NumPy (``run_numpy``), the
weights as the kernel reads them (``weights_blob``), and its launch (``prepare``: how many rows of an image a block
computes, ``tile_rows``).
"""
from __future__ import annotations

import numpy as np

from gpucourse import cuda_c, runtime

from .graph import Graph
from .precision import Q, SUFFIX
from .specs import im2col, maxpool_spec

SOURCE = "inference_engine_network"  # kernels/cuda/inference_engine_network.cu
THREADS = 256                        # NET_THREADS in the .cu
TILE_ROWS = (16, 8, 4, 2)            # rows of an image one block computes: the kernels network_<f32|f16|i8>_<rows>
PRECISIONS = ("fp32", "fp16", "int8")
ITEM = {"fp32": 4, "fp16": 2, "int8": 1}
# The network's shape, as the .cu has it (namespace net): a 16 x 16 x 1 image, a stem of 32 channels, the 1 x 1
# reductions before the 3 x 3 (32) and 5 x 5 (16) branches, the four branches' channels, the logits
IMG, C, R3, R5, B1, B3, B5, BP, O, POOL = 16, 32, 32, 16, 32, 32, 16, 16, 10, 4
CAT = B1 + B3 + B5 + BP
AT = {"b1": 0, "b3": B1, "b5": B1 + B3, "bp": B1 + B3 + B5}  # each branch's channels in the kernel's concatenation
WIDTH = {"b1": B1, "b3": B3, "b5": B5, "bp": BP}
# the weights' buffer: a table of each section's byte offset (32 int32), then the sections (net::W_STEM, ... in the .cu)
SECTIONS = ("w_stem", "b_stem", "s_stem", "w_red", "b_red", "s_red", "w_c3", "b_c3", "s_c3", "w_c5", "b_c5", "s_c5",
            "w_pp", "b_pp", "s_pp", "w_dense", "b_dense", "scalars")
TABLE = 32
SCALARS = ("inv_in", "inv_stem", "inv_r3", "inv_r5", "inv_cat")  # net::INV_IN, ...: 1 / the stored tensors' scales


def _cbr(n, shape) -> bool:
    """A CBR node with this weight shape, a ReLU, "same" padding at stride 1 and nothing else."""
    return (n is not None and n.op == "CBR" and tuple(n.weights["w"].shape) == shape and bool(n.attrs.get("relu"))
            and not n.attrs.get("residual") and "stride" not in n.attrs and "pad" not in n.attrs)


def match(g: Graph) -> dict | None:
    """The lesson's network in an optimised graph (E.optimize's last stage): a 3 x 3 stem 1 -> 32 reading the 16 x 16
    x 1 input; the three 1 x 1 convolutions of the stem side by side (32 -> 80, for the 3 x 3 and 5 x 5 branches and
    the 1 x 1 branch); a 3 x 3 max pool of the stem and its 1 x 1 (32 -> 16); the 3 x 3 (32 -> 32) and 5 x 5 (16 -> 16)
    branches; the four branches written into one concatenated tensor of 96 channels; the head: 4 x 4 average pool and
    a dense layer to 10 logits. Returns the nodes' names, where each output of the 1 x 1s starts in its 80 channels
    and where each branch starts in the concatenation; None for any other graph."""
    if len(g.nodes) != 7 or tuple(g.shapes[g.input]) != (IMG, IMG, 1):
        return None
    readers = g.consumers(g.input)
    stem = readers[0] if len(readers) == 1 else None
    if not _cbr(stem, (3, 3, 1, C)) or len(stem.outputs) != 1:
        return None
    after = g.consumers(stem.outputs[0])
    red = next((n for n in after if n.op == "CBR"), None)
    pool = next((n for n in after if n.op == "MaxPool"), None)
    if len(after) != 2 or not _cbr(red, (1, 1, C, R3 + R5 + B1)) or pool is None or len(red.outputs) != 3:
        return None
    if pool.attrs.get("size") != 3 or "stride" in pool.attrs or "pad" in pool.attrs:
        return None
    pp = g.consumers(pool.outputs[0])
    if len(pp) != 1 or not _cbr(pp[0], (1, 1, C, BP)):
        return None
    pp = pp[0]
    starts = np.concatenate([[0], np.cumsum(red.attrs["splits"])[:-1]])
    cols, branch = {}, {"bp": pp.outputs[0]}
    for t, start, width in zip(red.outputs, starts, red.attrs["splits"]):
        users = g.consumers(t)
        if not users and width == B1:
            cols["b1"], branch["b1"] = int(start), t
        elif len(users) == 1 and _cbr(users[0], (3, 3, R3, B3)) and width == R3:
            cols["r3"], c3 = int(start), users[0]
            branch["b3"] = c3.outputs[0]
        elif len(users) == 1 and _cbr(users[0], (5, 5, R5, B5)) and width == R5:
            cols["r5"], c5 = int(start), users[0]
            branch["b5"] = c5.outputs[0]
        else:
            return None
    if set(cols) != {"b1", "r3", "r5"}:
        return None
    roots = {g.aliases.get(t, (None, 0))[0] for t in branch.values()}
    if len(roots) != 1 or None in roots:
        return None
    cat = roots.pop()
    if tuple(g.shapes[cat]) != (IMG, IMG, CAT) or any(g.consumers(t) for t in branch.values()):
        return None
    head = g.consumers(cat)
    if len(head) != 1 or head[0].op != "Head" or head[0].outputs != [g.output]:
        return None
    head = head[0]
    if (head.attrs.get("size") != POOL or head.attrs.get("global") or head.attrs.get("softmax")
            or tuple(head.weights["w"].shape) != ((IMG // POOL) ** 2 * CAT, O)):
        return None
    return {"stem": stem.name, "red": red.name, "pool": pool.name, "pp": pp.name, "c3": c3.name, "c5": c5.name,
            "head": head.name, "red_cols": cols, "concat": {b: int(g.aliases[t][1]) for b, t in branch.items()}}


def fuse(g: Graph, steps: list, arrays: dict, precision: str) -> tuple | None:
    """([the network step], its arrays) in place of the plan's steps ``steps`` (with ``arrays``) of graph ``g``, or
    None where the graph is not the lesson's network (``match``), the precision has no such kernel (FP8), or the plan
    is mixed (a layer in another precision). The step's weights, biases and INT8 scales are the steps' own: the three
    1 x 1 convolutions' columns reordered (3 x 3 reduction, 5 x 5 reduction, 1 x 1 branch), the dense layer's rows
    into the kernel's order of the concatenation (1 x 1, 3 x 3, 5 x 5, pool branch)."""
    m = match(g) if precision in PRECISIONS else None
    if m is None or any("precision" in s for s in steps):
        return None
    by = {s.get("name"): s for s in steps}
    inp = [s for s in steps if s["kind"] == "input"]
    if len(inp) != 1 or any(m[k] not in by for k in ("stem", "red", "pool", "pp", "c3", "c5", "head")):
        return None

    def arr(key, what):
        return arrays.get(f"{by[m[key]]['id']}/{what}")

    cols = m["red_cols"]
    perm = np.r_[cols["r3"]:cols["r3"] + R3, cols["r5"]:cols["r5"] + R5, cols["b1"]:cols["b1"] + B1]
    out = {}
    for name, key, order in (("stem", "stem", None), ("red", "red", perm), ("c3", "c3", None), ("c5", "c5", None),
                             ("pp", "pp", None)):
        w, b, scale = arr(key, "w"), arr(key, "b"), arr(key, "scale")
        out[f"w_{name}"] = w if order is None else w[:, order]
        out[f"b_{name}"] = b if order is None else b[order]
        if scale is not None:
            out[f"s_{name}"] = scale if order is None else scale[order]
    head = by[m["head"]]
    rows = np.empty(len(arr("head", "w")), np.int64)  # row p CAT + AT[b] + j of the kernel's <- p CAT + concat[b] + j
    for b in AT:
        for p in range((IMG // POOL) ** 2):
            rows[p * CAT + AT[b]: p * CAT + AT[b] + WIDTH[b]] = p * CAT + m["concat"][b] + np.arange(WIDTH[b])
    out["w_dense"], out["b_dense"] = arr("head", "w")[rows], arr("head", "b")
    inv = {k: 1.0 for k in SCALARS}
    inv["inv_in"] = float(inp[0]["inv_scale"])
    if precision == "int8":  # 1 / the scale of each tensor the kernel stores: the unfused steps' (one per tensor)
        red_inv = arr("red", "inv")
        inv.update(inv_stem=float(arr("stem", "inv")[0]), inv_r3=float(red_inv[cols["r3"]]),
                   inv_r5=float(red_inv[cols["r5"]]), inv_cat=float(red_inv[cols["b1"]]))
        for key in ("c3", "c5", "pp"):
            if not np.allclose(arr(key, "inv"), inv["inv_cat"]):
                return None
    step = {"kind": "network", "name": "the network", "id": 0, "layers": [s.get("name", s["kind"]) for s in steps],
            **inv, "x_scale": float(head["x_scale"]), "O": O, "tile_rows": None}
    return [step], {f"0/{k}": v for k, v in out.items()}


# ------------------------------------------------------------------------------------------- NumPy

def stored(v, precision: str, inv: float) -> np.ndarray:
    """float32 values as the plan stores them, back as float32: FP16 rounded to half, INT8 the codes."""
    if precision == "fp16":
        return v.astype(np.float16).astype(np.float32)
    if precision == "int8":
        return np.clip(np.rint(v * np.float32(inv)), -Q, Q).astype(np.float32)
    return v.astype(np.float32)


def run_numpy(eng, s: dict, n: int) -> None:
    """The network step's arithmetic in NumPy, as the unfused plan's steps compute it (executor.py): each layer's
    sums (FP32 for FP32 and FP16; INT8: exact integer sums, times the scales), + bias, ReLU, stored in the plan's
    precision; the head in FP32. Writes the logits into ``eng.out``."""
    a, i, p = eng.dev, s["id"], eng.precision

    def conv(v, name, k):
        w = a[f"{i}/w_{name}"]
        cols = im2col(v, k, k).reshape(-1, w.shape[0])
        if p == "int8":
            acc = (cols.astype(np.float64) @ w.astype(np.float64)).astype(np.float32) * a[f"{i}/s_{name}"]
        else:
            acc = cols.astype(np.float32) @ w.astype(np.float32)
        return np.maximum(acc + a[f"{i}/b_{name}"], 0).reshape(n, IMG, IMG, -1)

    x = stored(eng._x.reshape(n, IMG, IMG, 1).astype(np.float32), p, s["inv_in"])
    stem = stored(conv(x, "stem", 3), p, s["inv_stem"])
    red = conv(stem, "red", 1)
    r3, r5 = stored(red[..., :R3], p, s["inv_r3"]), stored(red[..., R3:R3 + R5], p, s["inv_r5"])
    b1 = stored(red[..., R3 + R5:], p, s["inv_cat"])
    bp = stored(conv(maxpool_spec(stem, 3), "pp", 1), p, s["inv_cat"])
    b3, b5 = stored(conv(r3, "c3", 3), p, s["inv_cat"]), stored(conv(r5, "c5", 5), p, s["inv_cat"])
    cat = np.concatenate([b1, b3, b5, bp], axis=-1) * np.float32(s["x_scale"])
    pooled = cat.reshape(n, IMG // POOL, POOL, IMG // POOL, POOL, CAT).mean(axis=(2, 4))
    eng.out[:n] = pooled.reshape(n, -1) @ a[f"{i}/w_dense"] + a[f"{i}/b_dense"]


# ------------------------------------------------------------------------------------------- the kernel's weights

def fragments(w, itemsize: int) -> np.ndarray:
    """A K x N weight matrix (the reduction in the kernel's order: taps, then channels) as mma.sync's B fragments, the
    bytes each lane loads: for each step of 32 bytes of the reduction (16 halves, 32 INT8 codes; the last padded with
    zeros) and each n8 tile of outputs, lane (gid, tig) holds column 8 j + gid, rows KPR tig .. + KPR - 1 and the same
    16 / itemsize further on (KPR = 4 / itemsize: a 32-bit register's worth), 8 bytes a lane, 256 a warp."""
    ke, kpr = 32 // itemsize, 4 // itemsize
    k, n = w.shape
    steps = -(-k // ke)
    padded = np.zeros((steps * ke, n), w.dtype)
    padded[:k] = w
    f = padded.reshape(steps, 2, 4, kpr, n // 8, 8).transpose(0, 4, 5, 2, 1, 3)  # step, j, gid, tig, register, element
    return np.ascontiguousarray(f).view(np.uint8).ravel()


def weights_blob(arrays: dict, s: dict, precision: str) -> np.ndarray:
    """The network step's weights as the kernel reads them, one buffer of bytes: a table of the sections' offsets
    (SECTIONS, the .cu's net::W_STEM ...), then each section 16-byte aligned. Convolutions: FP32 K x N row-major (taps,
    channels) x output channels; FP16 and INT8 their mma.sync fragments (``fragments``). The dense layer's weights
    times 1 / 16 (the average pool's mean) and INT8's scale of the concatenation (the kernel sums codes)."""
    i = s["id"]

    def w(name):
        m = arrays[f"{i}/w_{name}"]
        return m.astype(np.float32) if precision == "fp32" else fragments(m, ITEM[precision])

    f32 = lambda v: np.asarray(v, np.float32)  # noqa: E731
    parts = {"scalars": f32([s[k] for k in SCALARS]),
             "w_dense": f32(arrays[f"{i}/w_dense"] * np.float32(s["x_scale"] / (POOL * POOL))),
             "b_dense": f32(arrays[f"{i}/b_dense"])}
    for name in ("stem", "red", "c3", "c5", "pp"):
        parts[f"w_{name}"], parts[f"b_{name}"] = w(name), f32(arrays[f"{i}/b_{name}"])
        parts[f"s_{name}"] = f32(arrays.get(f"{i}/s_{name}", np.zeros(0)))
    table = np.zeros(TABLE, np.int32)
    chunks, at = [], TABLE * 4
    for k, name in enumerate(SECTIONS):
        raw = np.ascontiguousarray(parts[name]).view(np.uint8).ravel()
        table[k] = at
        chunks.append(np.concatenate([raw, np.zeros(-len(raw) % 16, np.uint8)]))
        at += len(chunks[-1])
    return np.concatenate([table.view(np.uint8)] + chunks)


def smem_bytes(precision: str, rows: int) -> int:
    """Shared memory a block of network_<precision>_<rows> needs (Tile<T, TR>::BYTES in the .cu): the image rows it
    sees, the stem's and the two reductions' planes (with their borders of zeros; a pixel's channels padded to an
    odd number of 16 bytes), each row's pooled sums, and the head's partial sums."""
    e = ITEM[precision]
    pitch = lambda b: b if (b // 16) % 2 else b + 16  # noqa: E731
    image = (rows + 4) * IMG * 16 if e == 1 else -(-(rows + 6) * 18 * e // 16) * 16  # INT8: each stem pixel's taps
    return (image + (rows + 4) * 18 * pitch(C * e) + (rows + 2) * 18 * pitch(R3 * e)
            + (rows + 4) * 20 * pitch(R5 * e) + rows * POOL * CAT * 4 + (THREADS // 32 * O + 4) * 4)


def tile_rows(n: int, sms: int, max_smem: int, precision: str, rows: int | None = None) -> int:
    """Rows of an image a block computes at batch n: the most (the fewest rows computed twice, and no tiles to add
    up) with which the n x 16 / rows blocks still give every SM one; the fewest where even those do not (batch 1:
    8 blocks of 2 rows). Only tiles whose shared memory fits this GPU (``max_smem``: a T4 has 64 KB). ``rows``: this
    choice instead (the step's "tile_rows")."""
    fits = [r for r in TILE_ROWS if smem_bytes(precision, r) <= max_smem]
    if not fits:
        raise runtime.CourseError(f"the network kernel needs {smem_bytes(precision, TILE_ROWS[-1])} bytes of shared "
                                  f"memory a block; this GPU gives {max_smem}: build with fuse_network=False")
    if rows is not None:
        if rows not in fits:
            raise runtime.CourseInputError(f"tile_rows {rows}: this GPU runs {', '.join(map(str, fits))}")
        return rows
    return next((r for r in fits if n * (IMG // r) >= sms), fits[-1])


def prepare(eng, s: dict, n: int) -> tuple:
    """(kernel, grid, block, arguments, shared memory bytes) of the network step for a batch of n, the input left
    as None (the executor passes the input buffer). Made once per engine: the weights' buffer, each image's shares of
    the logits and its counter (zeros; the last tile of an image sets it back to zero)."""
    cp = runtime.cupy()
    i, a = s["id"], eng.dev
    if f"{i}/blob" not in a:
        a[f"{i}/blob"] = cp.asarray(weights_blob(eng.plan.arrays, s, eng.precision))
        a[f"{i}/partial"] = cp.zeros(eng.max_batch * (IMG // TILE_ROWS[-1]) * O, cp.float32)
        a[f"{i}/done"] = cp.zeros(eng.max_batch, cp.int32)
    attrs = cp.cuda.Device().attributes
    rows = tile_rows(n, attrs["MultiProcessorCount"], attrs["MaxSharedMemoryPerBlockOptin"], eng.precision,
                     s.get("tile_rows"))
    fn = cuda_c.function(SOURCE, f"network_{SUFFIX[eng.precision]}_{rows}")
    smem = smem_bytes(eng.precision, rows)
    fn.max_dynamic_shared_size_bytes = smem
    args = (None, a[f"{i}/blob"], eng.out, a[f"{i}/partial"], a[f"{i}/done"])
    return fn, (n * (IMG // rows),), (THREADS,), args, smem

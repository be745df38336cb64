"""Lesson 10, attention's backward pass as a GPU kernel runs it, tile by tile, in NumPy: the algorithm a CUDA C
backward (FlashAttention-2's and -3's shape) is checked against, and what it recomputes.

Three steps:

1. the pre-pass: D_i = rowsum(dO_i * O_i), one number per query row (the term every dS of row i subtracts);
2. one GPU block per tile of ``block_n`` keys: it keeps that tile's dK and dV (FP32) and loops over the tiles of
   ``block_m`` queries that see its keys (causal: from the tile on the diagonal on), recomputing S = Q K^T and
   P = exp(S scale - lse) from the saved log-sum-exp, then dV += P^T dO, dP = dO V^T, dS = P (dP - D),
   dK += dS^T Q: with S, four products a tile pair;
3. dQ = sum over the key tiles of dS K, in one of two ways:

   * ``dq="atomic"``: the block of step 2 computes dS K as a fifth product and adds it into an FP32 buffer of dQ
     (on the GPU, atomic adds, from every key tile's block into the same rows), then a post-pass scales the buffer;
   * ``dq="second-pass"``: a second kernel, one block per query tile, loops over the key tiles and recomputes S, P
     and dP to form dS, then dQ += dS K: three products a tile pair, 4 + 3 = 7 in all against 5, and P twice.

``precision="fp16"`` (the default) runs as the tensor cores do: Q, K, V, O, dO rounded to float16, every product
accumulated in float32, P and dS rounded to float16 where they enter a product as an operand (the GPU converts
them to feed the next GEMM), lse and D in float32. ``precision="fp64"`` keeps everything in float64 (the same
algorithm against ``specs.attention_backward_spec`` to 1e-10). Rows and columns past N, and keys above the
diagonal, are masked: P = 0 there, so they add nothing; NumPy's slices at the edges compute exactly that.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from gpucourse import runtime

from .specs import _scale, check_qkv

DQ_MODES = ("atomic", "second-pass")
PRECISIONS = {"fp16": (np.float16, np.float32), "fp64": (np.float64, np.float64)}  # operands, accumulators
PRODUCTS = ("S = Q K^T", "dV += P^T dO", "dP = dO V^T", "dK += dS^T Q", "dQ += dS K")


def tile_pairs(n: int, block_m: int, block_n: int, causal: bool) -> list:
    """The (query tile, key tile) pairs a backward pass visits: every pair, or with a causal mask those whose queries
    include one at or past the key tile's first key (the query tiles from the one holding that key on)."""
    tm, tn = -(-n // block_m), -(-n // block_n)
    return [(i, j) for j in range(tn) for i in range((j * block_n) // block_m if causal else 0, tm)]


def T(x):
    """Each head's tile transposed: (BH, r, c) to (BH, c, r)."""
    return np.swapaxes(x, -1, -2)


def recompute_p_ds(q, k, v, do, lse, D, scale, keep, operand):
    """One (query tile, key tile) pair: S = Q K^T recomputed, P = exp(S scale - lse) from the forward's log-sum-exp,
    dP = dO V^T, dS = P (dP - D). ``keep``: the pair's causal mask (None: every key); a masked key gets S = -inf,
    so P = 0. P and dS come back through ``operand``, the rounding of a product's input (FP16 on the GPU)."""
    s = q @ T(k)
    if keep is not None:
        s = np.where(keep, s, -np.inf).astype(s.dtype)
    p = np.exp(s * scale - lse[..., None])
    ds = p * (do @ T(v) - D[..., None])
    return operand(p), operand(ds)


def backward_blocks(Q, K, V, dO, lse, D, scale, pairs, tile, dq, operand, seen):
    """Steps 2 and 3 of the module's docstring over (BH, N, d) arrays, accumulating in Q's type: ``tile(i, j)``
    gives a pair's rows, columns and causal mask; ``seen``, a Counter, what was done. Returns (dQ, dK, dV)."""
    dQ, dK, dV = (np.zeros_like(Q) for _ in range(3))
    for i, j in pairs:  # one block per key tile j (pairs come ordered by j): dK, dV of its keys stay on chip
        rows, cols, keep = tile(i, j)
        p, ds = recompute_p_ds(Q[:, rows], K[:, cols], V[:, cols], dO[:, rows], lse[:, rows], D[:, rows], scale,
                               keep, operand)
        dV[:, cols] += T(p) @ dO[:, rows]
        dK[:, cols] += T(ds) @ Q[:, rows]
        seen["pairs"] += 1
        if dq == "atomic":  # every key tile's block adds into the same dQ rows: on the GPU, FP32 atomicAdd
            add = ds @ K[:, cols]
            dQ[:, rows] += add
            seen["dQ adds"] += 1
            seen["dQ floats"] += add.size
    if dq == "second-pass":  # one block per query tile i: S, P and dP again, then dQ += dS K on chip
        for i, j in sorted(pairs):
            rows, cols, keep = tile(i, j)
            _, ds = recompute_p_ds(Q[:, rows], K[:, cols], V[:, cols], dO[:, rows], lse[:, rows], D[:, rows],
                                   scale, keep, operand)
            dQ[:, rows] += ds @ K[:, cols]
            seen["second-pass pairs"] += 1
    return dQ * scale, dK * scale, dV


def flash_backward_tiles(q, k, v, o, lse, do, *, causal: bool = False, scale=None, block_m: int = 64,
                         block_n: int = 64, dq: str = "atomic", precision: str = "fp16", counts: bool = False,
                         blocks=None):
    """(dq, dk, dv) of attention by FlashAttention's tiled backward (see the module's docstring): the pre-pass here,
    the loops in ``blocks`` (``backward_blocks``, or a function of its arguments: a notebook passes its edited copy).
    With ``counts``, also a dict of what it did: the tile pairs visited by each pass, the tile products of each kind,
    the P tiles computed, the dQ tile adds into the FP32 buffer (``atomic_adds``, each a block_m x d tile;
    ``atomic_elements`` the float adds). q, k, v, o, do: (N, d), (heads, N, d) or (batch, heads, N, d); lse: the
    same without d, natural log. Returns float32 (float64 with ``precision="fp64"``) arrays of q's shape."""
    shape = check_qkv(q, k, v, "flash_backward_tiles")
    if dq not in DQ_MODES:
        raise runtime.CourseInputError(f"dq must be one of {DQ_MODES}, got {dq!r}")
    if precision not in PRECISIONS:
        raise runtime.CourseInputError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(b, bool) or int(b) != b or b < 1:
            raise runtime.CourseInputError(f"{name} must be a whole number of rows >= 1, got {b!r}")
    if np.shape(o) != np.shape(q) or np.shape(do) != np.shape(q) or np.shape(lse) != np.shape(q)[:-1]:
        raise runtime.CourseInputError(f"o and do must have q's shape {tuple(np.shape(q))} and lse "
                                       f"{tuple(np.shape(q)[:-1])}; got {np.shape(o)}, {np.shape(do)}, "
                                       f"{np.shape(lse)}")
    op, acc = PRECISIONS[precision]
    bh, n, d = shape[0] * shape[1], shape[2], shape[3]
    Q, K, V, O, dO = (np.asarray(a).reshape(bh, n, d).astype(op).astype(acc) for a in (q, k, v, o, do))
    L = np.asarray(lse, np.float64).reshape(bh, n).astype(acc)
    L = np.where(np.isneginf(L), np.inf, L).astype(acc)  # a row that saw no key: exp(S - inf) = 0, no NaN

    def operand(x):  # P and dS as they feed a product: rounded to FP16 in the FP16 mode
        return x.astype(op).astype(acc)

    def tile(i, j):
        rows, cols = slice(i * block_m, min(n, (i + 1) * block_m)), slice(j * block_n, min(n, (j + 1) * block_n))
        keep = np.arange(cols.start, cols.stop)[None, :] <= np.arange(rows.start, rows.stop)[:, None]
        return rows, cols, keep if causal else None

    D = (dO * O).sum(axis=-1)  # 1. the pre-pass, in the accumulators' precision
    seen = Counter()
    dQ, dK, dV = (blocks or backward_blocks)(Q, K, V, dO, L, D, acc(_scale(d, scale)),
                                             tile_pairs(n, block_m, block_n, causal), tile, dq, operand, seen)
    dq_, dk_, dv_ = (x.reshape(np.shape(q)) for x in (dQ, dK, dV))
    if not counts:
        return dq_, dk_, dv_
    pairs, second = seen["pairs"] * bh, seen["second-pass pairs"] * bh
    c = {"tile_pairs": pairs, "dq_pass_tile_pairs": second, "p_tiles": pairs + second,
         "atomic_adds": seen["dQ adds"] * bh, "atomic_elements": seen["dQ floats"], "heads": bh,
         "products": {"S = Q K^T": pairs + second, "dV += P^T dO": pairs, "dP = dO V^T": pairs + second,
                      "dK += dS^T Q": pairs, "dQ += dS K": seen["dQ adds"] * bh + second}}
    c["products_total"] = sum(c["products"].values())
    return dq_, dk_, dv_, c


def expected_counts(n: int, d: int, block_m: int, block_n: int, *, causal: bool, dq: str, heads: int = 1) -> dict:
    """What ``flash_backward_tiles`` must count, from the tile grid alone: with T pairs a head (all Tm x Tn, or causal
    sum over key tiles j of Tm - floor(j block_n / block_m)), the atomic mode does 5 products and one dQ tile add a
    pair, the second pass 4 + 3 = 7 products and computes P (and dP) twice."""
    pairs = tile_pairs(n, block_m, block_n, causal)
    t = len(pairs) * heads
    atomic = dq == "atomic"
    rows = sum(min(n, (i + 1) * block_m) - i * block_m for i, _ in pairs)
    return {"tile_pairs": t, "dq_pass_tile_pairs": 0 if atomic else t, "p_tiles": t if atomic else 2 * t,
            "atomic_adds": t if atomic else 0, "atomic_elements": rows * d * heads if atomic else 0,
            "products_total": 5 * t if atomic else 7 * t}


def causal_fraction(n: int, block_m: int, block_n: int) -> float:
    """The share of the tile pairs a causal backward visits: (T + 1) / (2 T) with T tiles of one size each way."""
    return len(tile_pairs(n, block_m, block_n, True)) / len(tile_pairs(n, block_m, block_n, False))


def backward_product_flops(n: int, d: int, block_m: int, block_n: int, *, causal: bool, dq: str) -> float:
    """FLOPs of the tile products a head does (2 x rows x cols x d each, the edge tiles at their real size): what
    the GPU's tensor cores do, against ``specs.attention_flops(..., backward=True)``'s 5 dense products."""
    f = 0.0
    for i, j in tile_pairs(n, block_m, block_n, causal):
        r = min(n, (i + 1) * block_m) - i * block_m
        cc = min(n, (j + 1) * block_n) - j * block_n
        f += 2.0 * r * cc * d * (5 if dq == "atomic" else 7)
    return f


def format_counts(n: int = 4096, d: int = 128, block_m: int = 64, block_n: int = 128) -> str:
    """A Markdown table of what one head's backward does at N = n, d, with block_m x block_n tiles (FlashAttention-3's
    tiles at d = 128), causal and not, for each way of forming dQ: tile pairs, products, P tiles, dQ's FP32 adds (the
    atomics' traffic, 4 bytes an add read and written in L2), and the products' FLOPs against the 5 dense products
    ``specs.attention_flops(..., backward=True)`` counts."""
    from .specs import attention_flops

    lines = ["| mask | dQ | tile pairs | products | P tiles | dQ float adds | FLOPs / 5 dense products |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for causal in (False, True):
        for mode in DQ_MODES:
            c = expected_counts(n, d, block_m, block_n, causal=causal, dq=mode)
            f = backward_product_flops(n, d, block_m, block_n, causal=causal, dq=mode)
            lines.append(f"| {'causal' if causal else 'full'} | {mode} | {c['tile_pairs']} | {c['products_total']} | "
                         f"{c['p_tiles']} | {c['atomic_elements']:,} | "
                         f"{f / attention_flops(1, 1, n, d, backward=True):.3f} |")
    return "\n".join(lines)


__all__ = ["DQ_MODES", "PRODUCTS", "T", "backward_blocks", "backward_product_flops", "causal_fraction",
           "expected_counts", "flash_backward_tiles", "format_counts", "recompute_p_ds", "tile_pairs"]

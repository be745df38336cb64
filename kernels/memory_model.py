"""Lesson 3 — memory, modelled in NumPy: what one warp's access costs.

A warp's load or store of global memory is served in 32-byte **sectors**: the hardware gathers the 32 lanes'
addresses and moves every sector any lane touches, whole. ``sectors`` counts them, so a warp reading 32
consecutive float32 (128 bytes) moves 4 sectors, and one reading a column of a row-major matrix moves 32, eight
times the bytes for the same 128 useful ones.

Shared memory is split into 32 **banks** of 4-byte words (word w is in bank w % 32). A warp's access takes one
pass per distinct word in its busiest bank: ``bank_conflict_ways`` is that number (1: conflict-free; lanes
reading the same word share it, a broadcast).

The helpers below give one warp's addresses for the lesson's access patterns, and the ``predict_*`` functions
turn sectors into bytes moved and a time at a measured bandwidth, so a notebook sets the model beside what the
GPU did. Addresses are in ELEMENTS (indices into an array of ``itemsize``-byte elements) unless a function says
bytes. Numba's simulator runs threads one by one and has neither sectors nor banks: in CPU mode this model
is the lesson's account of them, and on a GPU the profiler's sector counts are checked against it.
"""
from __future__ import annotations

import numpy as np

from gpucourse import runtime

WARP = 32
SECTOR = 32  # bytes: the unit a global access moves
BANKS = 32  # shared-memory banks, each 4 bytes wide
BANK_WIDTH = 4


def _lanes(addresses, what: str = "addresses") -> np.ndarray:
    a = np.asarray(addresses)
    if a.ndim != 1 or not 1 <= a.size <= WARP:
        raise runtime.CourseInputError(f"{what}: one warp's, 1 to 32 of them in a 1-D list, got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.integer):
        if not np.all(a == np.floor(a)):
            raise runtime.CourseInputError(f"{what} must be whole numbers")
        a = a.astype(np.int64)
    if np.any(a < 0):
        raise runtime.CourseInputError(f"{what} cannot be negative")
    return a.astype(np.int64)


def sectors(addresses, itemsize: int = 4, sector: int = SECTOR) -> int:
    """The distinct ``sector``-byte sectors one warp's access touches. ``addresses``: the active lanes' element
    indices (element i occupies bytes i*itemsize .. (i+1)*itemsize - 1 of an array that starts on a sector
    boundary, as every allocation does); pass itemsize=1 to give byte addresses."""
    if itemsize < 1 or sector < 1:
        raise runtime.CourseInputError("itemsize and sector must be at least 1 byte")
    a = _lanes(addresses)
    first = a * itemsize // sector
    last = (a * itemsize + itemsize - 1) // sector
    touched = set()
    for f, l in zip(first.tolist(), last.tolist()):
        touched.update(range(f, l + 1))
    return len(touched)


def bank_conflict_ways(word_indices, banks: int = BANKS) -> int:
    """How many passes one warp's shared-memory access takes: the most DISTINCT 4-byte words that fall into one
    bank (word w lies in bank w % banks). 1 is conflict-free; lanes reading the same word count once (the word is
    broadcast to them)."""
    w = _lanes(word_indices, "word indices")
    ways = 1
    for b in range(banks):
        ways = max(ways, len(set(w[w % banks == b].tolist())))
    return ways


def ideal_sectors(lanes: int = WARP, itemsize: int = 4, sector: int = SECTOR) -> int:
    """The fewest sectors ``lanes`` distinct elements can take: the bytes asked for, rounded up to sectors."""
    return -(-lanes * itemsize // sector)


# ------------------------------------------------------------------- a warp's addresses for the lesson's patterns

def strided(stride: int, start: int = 0, lanes: int = WARP) -> np.ndarray:
    """Lane l reads element start + l * stride (copy_strided): stride 1 is coalesced."""
    if stride < 0:
        raise runtime.CourseInputError(f"a stride cannot be negative, got {stride}")
    return start + stride * np.arange(lanes, dtype=np.int64)


def row(cols: int, r: int = 0, c0: int = 0, lanes: int = WARP) -> np.ndarray:
    """A warp along a row of a row-major (rows x cols) matrix: elements (r, c0 .. c0 + 31), consecutive."""
    return r * cols + c0 + np.arange(lanes, dtype=np.int64)


def column(cols: int, c: int = 0, r0: int = 0, lanes: int = WARP) -> np.ndarray:
    """A warp down a column of a row-major (rows x cols) matrix: elements (r0 .. r0 + 31, c), ``cols`` apart."""
    return (r0 + np.arange(lanes, dtype=np.int64)) * cols + c


def block_warp(block: tuple, cols: int, warp: int = 0, swapped: bool = False) -> np.ndarray:
    """The elements warp ``warp`` of a block of block = (x, y) threads touches in a 2-D kernel over a row-major
    matrix with ``cols`` columns (block at the origin). Threads are numbered x fastest, so a warp is 32
    consecutive (x, y) pairs. x -> column (scale_2d), or x -> row when ``swapped`` (scale_2d_swapped)."""
    bx, by = block
    t = warp * WARP + np.arange(WARP, dtype=np.int64)
    t = t[t < bx * by]
    x, y = t % bx, t // bx
    return x * cols + y if swapped else y * cols + x


def tile_row(r: int = 0, padded: bool = False, tile: int = 32) -> np.ndarray:
    """Shared-memory words a warp touches along row r of a tile x tile (or tile x (tile + 1), ``padded``) float32
    tile: lane l at (r, l). What the tiled transpose does when it copies its input into the tile."""
    width = tile + 1 if padded else tile
    return r * width + np.arange(tile, dtype=np.int64)


def tile_column(c: int = 0, padded: bool = False, tile: int = 32) -> np.ndarray:
    """Shared-memory words a warp touches down column c of the tile: lane l at (l, c). What the tiled transpose
    does when it writes its output from the tile. Without padding, all 32 words lie in one bank."""
    width = tile + 1 if padded else tile
    return np.arange(tile, dtype=np.int64) * width + c


def transpose_warp(variant: str, cols: int, rows: int | None = None) -> dict:
    """One warp's accesses in each transpose (``variant``: naive, tiled, padded) of a (rows x cols) float32 matrix:
    {"global load": element indices, "global store": element indices into the (cols x rows) output,
    "shared store"/"shared load": word indices (tiled variants)}. The warp is lanes 0..31 of the first row of
    threads of a block at the origin."""
    if variant not in ("naive", "tiled", "padded"):
        raise runtime.CourseInputError(f"variant must be naive, tiled or padded, not {variant!r}")
    rows = cols if rows is None else rows
    out = {"global load": row(cols)}
    if variant == "naive":
        out["global store"] = column(rows)  # out[c, r] for c = 0..31: down a column of the output
    else:
        padded = variant == "padded"
        out["shared store"] = tile_row(0, padded)
        out["shared load"] = tile_column(0, padded)
        out["global store"] = row(rows)  # a row of the output, consecutive
    return out


def transpose_costs(variant: str, cols: int = 1024, itemsize: int = 4) -> dict:
    """Sectors of each global access and the conflict ways of each shared access of one warp in a transpose."""
    costs = {}
    for what, where in transpose_warp(variant, cols).items():
        if what.startswith("global"):
            costs[f"{what} sectors"] = sectors(where, itemsize)
        else:
            costs[f"{what} ways"] = bank_conflict_ways(where)
    return costs


# ------------------------------------------------------------------------------------------------ predictions

def stride_sectors(stride: int, itemsize: int = 4) -> int:
    """Sectors a warp's load moves in copy_strided at ``stride``."""
    return sectors(strided(stride), itemsize)


def predict_strided_copy(n: int, stride: int, gbps: float, itemsize: int = 4) -> dict:
    """copy_strided moving n elements at ``stride``: bytes the GPU moves (the read in whole sectors, the write
    coalesced), the useful bytes (n read, n written), and the expected time and useful bandwidth if the sectors
    move at ``gbps`` (a measured bandwidth, e.g. the copy ceiling)."""
    warps = -(-n // WARP)
    read = warps * stride_sectors(stride, itemsize) * SECTOR
    write = warps * sectors(strided(1), itemsize) * SECTOR
    useful = 2 * n * itemsize
    ms = (read + write) / (gbps * 1e9) * 1e3
    return {"bytes_moved": read + write, "useful_bytes": useful, "ms": ms, "useful_gbps": useful / (ms * 1e-3) / 1e9}


def transpose_bytes(rows: int, cols: int, variant: str, itemsize: int = 4) -> dict:
    """Bytes a transpose of a (rows x cols) matrix moves to and from memory by the model: every warp's load and
    store in whole sectors (on a matrix of whole 32 x 32 tiles). Useful bytes: the matrix read once, written once."""
    c = transpose_costs(variant, cols, itemsize)
    warps = rows * cols // WARP
    moved = warps * (c["global load sectors"] + c["global store sectors"]) * SECTOR
    return {"bytes_moved": moved, "useful_bytes": 2 * rows * cols * itemsize,
            "shared_ways": max((v for k, v in c.items() if k.endswith("ways")), default=0)}


def predict_ms(bytes_moved: float, gbps: float) -> float:
    """The time to move ``bytes_moved`` at ``gbps`` (GB/s, 10^9 bytes a second), in ms."""
    if gbps <= 0:
        raise runtime.CourseInputError("a bandwidth must be positive")
    return bytes_moved / (gbps * 1e9) * 1e3


def matmul_traffic(m: int, n: int, k: int, tile: int | None = None, itemsize: int = 4) -> dict:
    """Global-memory bytes a matrix multiply C = A B (m x k times k x n) reads by the model, with the
    arithmetic intensity 2 m n k / bytes. tile None: the naive kernel, each thread reading a row of A and a column
    of B (2 k elements per output) with no reuse beyond the caches; tile t: each t x t block of C reads its t rows of
    A and t columns of B once per tile step, so A is read n / t times and B m / t times."""
    flops = 2 * m * n * k
    if tile is None:
        reads = 2 * m * n * k
    else:
        reads = m * k * (-(-n // tile)) + k * n * (-(-m // tile))
    nbytes = (reads + m * n) * itemsize
    return {"flops": flops, "bytes": nbytes, "intensity": flops / nbytes}

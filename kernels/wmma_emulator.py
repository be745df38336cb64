"""WMMA without a GPU: a NumPy emulation of what one warp's ``nvcuda::wmma`` calls do to memory, and the CUDA C
of a one-warp-per-tile kernel generated from the same Python description of its address arithmetic.

A one-warp-per-tile WMMA kernel is, apart from its fixed frame, three choices per operand: the layout of the
fragment (row- or column-major), the element offset of the 16 x 16 tile a warp loads at step k, and the leading
dimension ``ldm`` (the distance in elements from one row, or column, of the tile to the next). Written as a
Python function of the tile's coordinates and the step,

    def tile_operands(ti, tj, k, M, N, K):
        return (a_offset, a_ldm), (b_offset, b_ldm)

the description drives both:

* ``run_tiles``: NumPy runs the kernel's loop over every warp's tile: ``load_matrix_sync`` reads 16 x 16 elements
  from flat memory at the function's offsets and ``ldm`` in the fragment's layout (an address outside the array
  is an error, as it would be an illegal access on a GPU), ``mma_sync`` is ``tc.mma`` (FP16 inputs, exact
  products, FP32 sums), ``store_matrix_sync`` writes the tile back;
* ``cuda_source``: the function is called once with symbols in place of its arguments, which record its
  arithmetic as C expressions, and those expressions are the pointers and ``ldm`` of the CUDA C kernel's
  ``load_matrix_sync`` calls.

So a wrong pointer computes a wrong result in NumPy, and the kernel a GPU runs is the arithmetic NumPy checked.
The function may use + - * // % and parentheses on its arguments and integers, nothing that branches on them.
"""
from __future__ import annotations

import numpy as np

from gpucourse import runtime

FRAG = 16  # WMMA's 16 x 16 x 16 FP16 shape
LAYOUTS = ("row_major", "col_major")


# ======================================================== the three calls, on flat NumPy memory

def load_matrix_sync(memory: np.ndarray, offset: int, ldm: int, layout: str, *, what: str = "operand") -> np.ndarray:
    """The 16 x 16 tile a fragment holds after ``wmma::load_matrix_sync(frag, ptr, ldm)`` with ``ptr`` =
    ``memory + offset``: element (r, c) lies at ``offset + r ldm + c`` (row-major) or ``offset + c ldm + r``
    (column-major). ``memory`` is the operand's flat (1-D) storage."""
    if layout not in LAYOUTS:
        raise runtime.CourseInputError(f"{what}: layout {layout!r}, want one of {LAYOUTS}")
    offset, ldm = _integer(offset, f"{what}'s offset"), _integer(ldm, f"{what}'s ldm")
    if ldm < FRAG:
        raise runtime.CourseInputError(f"{what}: ldm = {ldm}: a 16 x 16 tile needs a leading dimension of at "
                                       "least 16 elements")
    r, c = np.indices((FRAG, FRAG))
    index = offset + (r * ldm + c if layout == "row_major" else c * ldm + r)
    _in_bounds(index, memory.size, what)
    return memory[index]


def store_matrix_sync(memory: np.ndarray, offset: int, tile: np.ndarray, ldm: int, layout: str = "row_major", *,
                      what: str = "result") -> None:
    """``wmma::store_matrix_sync(ptr, frag, ldm, mem_row_major | mem_col_major)`` with ``ptr`` = memory + offset."""
    r, c = np.indices((FRAG, FRAG))
    index = offset + (r * ldm + c if layout == "row_major" else c * ldm + r)
    _in_bounds(index, memory.size, what)
    memory[index] = tile


def mma_sync(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """``wmma::mma_sync(acc, a, b, acc)``: FP16 fragments, exact products, the sum rounded to FP32."""
    from kernels import tensor_cores as tc

    return tc.mma(a, b, acc, acc="float32")


def _integer(value, what: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise runtime.CourseInputError(f"{what} is {value!r}: want an integer number of elements")
    return int(value)


def _in_bounds(index: np.ndarray, size: int, what: str) -> None:
    low, high = int(index.min()), int(index.max())
    if low < 0 or high >= size:
        raise runtime.CourseInputError(f"{what}: the tile reaches elements {low} .. {high} of an array of {size}: "
                                       "outside it (on a GPU, an illegal address or another array's data)")


# ======================================================== a one-warp-per-tile kernel, emulated

def run_tiles(tile_operands, layouts: tuple, a_memory: np.ndarray, b_memory: np.ndarray, out_shape: tuple,
              reduction: int, dims: tuple) -> np.ndarray:
    """Run the kernel's loop for every warp: warp (ti, tj) owns the 16 x 16 tile (ti, tj) of the FP32 output
    (``out_shape``, row-major); for k = 0, 16, .. < ``reduction`` it loads a at and b at the offsets and leading
    dimensions ``tile_operands(ti, tj, k, *dims)`` returns, in ``layouts`` = (a's, b's), and accumulates. The
    output starts as NaN, so a tile no warp stores shows."""
    rows, cols = out_shape
    if rows % FRAG or cols % FRAG or reduction % FRAG:
        raise runtime.CourseInputError(f"output {rows} x {cols}, reduction {reduction}: multiples of 16 only")
    a_memory, b_memory = np.ravel(a_memory).astype(np.float16), np.ravel(b_memory).astype(np.float16)
    out = np.full(rows * cols, np.nan, np.float32)
    for ti in range(rows // FRAG):
        for tj in range(cols // FRAG):
            acc = np.zeros((FRAG, FRAG), np.float32)
            for k in range(0, reduction, FRAG):
                (a_off, a_ldm), (b_off, b_ldm) = _pair(tile_operands(ti, tj, k, *dims))
                a = load_matrix_sync(a_memory, a_off, a_ldm, layouts[0], what=f"a's tile (warp {ti}, {tj}, k = {k})")
                b = load_matrix_sync(b_memory, b_off, b_ldm, layouts[1], what=f"b's tile (warp {ti}, {tj}, k = {k})")
                acc = mma_sync(a, b, acc)
            store_matrix_sync(out, ti * FRAG * cols + tj * FRAG, acc, cols)
    return out.reshape(rows, cols)


def _pair(result):
    try:
        (a_off, a_ldm), (b_off, b_ldm) = result
    except (TypeError, ValueError):
        raise runtime.CourseInputError(f"tile_operands returned {result!r}: want ((a_offset, a_ldm), "
                                       "(b_offset, b_ldm))") from None
    return (a_off, a_ldm), (b_off, b_ldm)



# ======================================================== the same arithmetic as C expressions

class CExpr:
    """An integer expression of the kernel's variables, built by running Python arithmetic on symbols: the C
    text of every operation, parenthesised. Comparisons and conversions to bool or int raise, since the
    generated kernel has no branches."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self):
        return self.text

    @staticmethod
    def _c(other):
        if isinstance(other, CExpr):
            return other.text
        if isinstance(other, (int, np.integer)) and not isinstance(other, bool):
            return str(int(other))
        raise runtime.CourseInputError(f"{other!r} in an offset: use integers and the function's arguments only")

    def _op(self, op, other, reverse=False):
        left, right = (self._c(other), self.text) if reverse else (self.text, self._c(other))
        return CExpr(f"({left} {op} {right})")

    def __add__(self, o): return self._op("+", o)
    def __radd__(self, o): return self._op("+", o, True)
    def __sub__(self, o): return self._op("-", o)
    def __rsub__(self, o): return self._op("-", o, True)
    def __mul__(self, o): return self._op("*", o)
    def __rmul__(self, o): return self._op("*", o, True)
    def __floordiv__(self, o): return self._op("/", o)  # non-negative operands: C's / is Python's //
    def __rfloordiv__(self, o): return self._op("/", o, True)
    def __mod__(self, o): return self._op("%", o)
    def __rmod__(self, o): return self._op("%", o, True)

    def _no(self, *_):
        raise runtime.CourseInputError("an offset may not depend on a comparison or a conversion of the tile's "
                                       "coordinates: write it as + - * // % of the arguments")

    __bool__ = __index__ = __int__ = __float__ = __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _no
    __hash__ = object.__hash__
    __truediv__ = __rtruediv__ = _no


def c_expressions(tile_operands, names=("ti", "tj", "k", "M", "N", "K")) -> tuple:
    """((a_offset, a_ldm), (b_offset, b_ldm)) of ``tile_operands`` as C text, its arguments named ``names``."""
    (a_off, a_ldm), (b_off, b_ldm) = _pair(tile_operands(*(CExpr(n) for n in names)))
    return tuple((CExpr._c(off), CExpr._c(ldm)) for off, ldm in ((a_off, a_ldm), (b_off, b_ldm)))

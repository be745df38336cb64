"""Lesson 2 — the warp, modelled in NumPy.

Which lanes run each step of a branchy kernel (``Warp``), what divergence costs (``paths_per_warp``,
``serialisation_slowdown``), and the warp-level primitives (``shfl_down_sync``, ``ballot_sync``) down to the
float32 result of the shuffle and tree reductions (``reduce_model``). Numba's simulator runs every thread on
its own and has no warps, so in CPU mode this model stands in for the kernels that use warp intrinsics; the
GPU tests check it against the real thing. kernels/warp_divergence.py (the kernels) re-exports every name.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np

from gpucourse import runtime


WARP = 32
FULL_MASK = 0xFFFFFFFF
PATTERNS = ("lane", "warp")  # what branches() can branch on


def _check_threads(threads: int, *, multiple_of: int = WARP, power_of_two: bool = False) -> None:
    if not 1 <= threads <= 1024 or threads % multiple_of:
        raise runtime.CourseInputError(
            f"threads per block must be a multiple of {multiple_of} from {multiple_of} to 1024, got {threads}")
    if power_of_two and threads & (threads - 1):
        raise runtime.CourseInputError(f"the tree reduction needs a power of two threads per block, got {threads}")


def _check_paths(paths: int, iters: int) -> None:
    if not 1 <= paths <= WARP:
        raise runtime.CourseInputError(f"paths must be 1..32 (a warp has 32 lanes), got {paths}")
    if iters < 0:
        raise runtime.CourseInputError(f"iters must be 0 or more, got {iters}")


def lanes_of(mask: int) -> np.ndarray:
    """The 32 lanes as booleans, True where bit ``lane`` of ``mask`` is set."""
    return (int(mask) >> np.arange(WARP)) & 1 == 1


def mask_of(active) -> int:
    """The 32-bit mask of a boolean per lane."""
    active = np.asarray(active, bool)
    if active.shape != (WARP,):
        raise runtime.CourseInputError(f"a warp has 32 lanes, got shape {active.shape}")
    return int(np.sum(active.astype(np.int64) << np.arange(WARP)))


@dataclass(frozen=True)
class Step:
    """One step a warp issues: a label, the lanes that take part (a 32-bit mask), and its cost."""

    label: str
    mask: int
    cost: float = 1.0

    @property
    def lanes(self) -> np.ndarray:
        return lanes_of(self.mask)

    @property
    def active(self) -> int:
        return bin(self.mask).count("1")


class Warp:
    """A warp of 32 lanes that share one program counter, modelled in NumPy (the SIMT model before Volta,
    and the cost model after it: a warp still issues each path it holds, one after the other).

    The kernel is written as Python that runs once for the whole warp; ``lane`` is the lane ids (0..31).
    ``with w.branch(cond):`` is ``if cond:`` -- inside it only the lanes that are active and have cond
    true take part; ``run(label, cost)`` issues a step for them, and costs nothing if none is active::

        w = Warp()
        with w.branch(w.lane < 4):
            w.run("A"); w.run("B")
        with w.branch(w.lane >= 4):
            w.run("X"); w.run("Y")
        w.cost        # 4.0: both sides were issued, one after the other
    """

    def __init__(self, active=None):
        self.lane = np.arange(WARP)
        self._active = np.ones(WARP, bool) if active is None else np.asarray(active, bool).copy()
        if self._active.shape != (WARP,):
            raise runtime.CourseInputError(f"a warp has 32 lanes, got an active set of shape {self._active.shape}")
        self.steps: list[Step] = []

    @property
    def active(self) -> np.ndarray:
        return self._active.copy()

    def run(self, label: str, cost: float = 1.0) -> None:
        """Issue one step (an instruction, or a block of straight-line code costing ``cost``)."""
        if cost < 0:
            raise runtime.CourseInputError(f"a step cannot cost less than nothing, got {cost}")
        if self._active.any():
            self.steps.append(Step(label, mask_of(self._active), float(cost)))

    @contextlib.contextmanager
    def branch(self, cond):
        """``if cond:`` for the active lanes. cond: a bool per lane (or one bool for all)."""
        cond = np.broadcast_to(np.asarray(cond, bool), (WARP,))
        saved = self._active
        self._active = saved & cond
        try:
            yield self
        finally:
            self._active = saved

    def if_else(self, cond, then, otherwise=None) -> None:
        """``if cond: then(w) else: otherwise(w)``: both sides are issued if the warp holds lanes of both."""
        cond = np.broadcast_to(np.asarray(cond, bool), (WARP,))
        with self.branch(cond):
            then(self)
        if otherwise is not None:
            with self.branch(~cond):
                otherwise(self)

    def switch(self, path, bodies: dict) -> None:
        """``bodies[path](w)`` for each lane's path, each path that any active lane holds issued in turn."""
        path = np.broadcast_to(np.asarray(path), (WARP,))
        for key, body in bodies.items():
            with self.branch(path == key):
                if self._active.any():
                    body(self)

    def loop(self, trips, body) -> None:
        """``for k in range(trips[lane]): body(w, k)``: the warp runs until its longest lane is done."""
        trips = np.broadcast_to(np.asarray(trips, np.int64), (WARP,))
        k = 0
        while True:
            with self.branch(k < trips):
                if not self._active.any():
                    break
                body(self, k)
            k += 1

    @property
    def cost(self) -> float:
        """Time the warp takes: every issued step counts in full, however few lanes it had."""
        return float(sum(s.cost for s in self.steps))

    @property
    def useful(self) -> float:
        """The lane-work done, in units of a full warp: a step with 8 lanes of 32 does a quarter of a step."""
        return float(sum(s.cost * s.active / WARP for s in self.steps))

    @property
    def efficiency(self) -> float:
        """useful / cost: 1.0 for a warp that never diverged."""
        return self.useful / self.cost if self.steps else 1.0


def lecture_example(sync: bool = False) -> Warp:
    """The lecture's example in the model: lanes 0-3 run A then B, the others X then Y, then all Z.

    Without sync, the order the pre-Volta SIMT stack gives (one side, then the other); with sync, the order a
    __syncwarp between A/X and B/Y forces: A, X, then B, Y. The cost is the same either way."""
    w = Warp()
    first = w.lane < 4
    if sync:
        for left, right in (("A", "X"), ("B", "Y")):
            with w.branch(first):
                w.run(left)
            with w.branch(~first):
                w.run(right)
    else:
        with w.branch(first):
            w.run("A")
            w.run("B")
        with w.branch(~first):
            w.run("X")
            w.run("Y")
    w.run("Z")
    return w


def steps_from_log(log: dict) -> list[Step]:
    """Group the log of ``order_of_events`` into steps: consecutive entries with the same event label are
    one step, taken by the lanes that logged it."""
    steps: list[Step] = []
    for label, lane in zip(log["events"], log["lanes"]):
        if steps and steps[-1].label == label:
            steps[-1] = Step(label, steps[-1].mask | (1 << lane))
        else:
            steps.append(Step(label, 1 << lane))
    return steps


def path_of(n: int, by: str, paths: int) -> np.ndarray:
    """The path each of n consecutive threads takes in ``branches(by=..., paths=...)``."""
    if by not in PATTERNS:
        raise runtime.CourseInputError(f"by must be one of {PATTERNS}, not {by!r}")
    _check_paths(paths, 0)
    i = np.arange(n)
    return (i % WARP) % paths if by == "lane" else (i // WARP) % paths


def paths_per_warp(path) -> np.ndarray:
    """How many different paths each warp of consecutive threads holds (the last warp may be partial)."""
    path = np.asarray(path).ravel()
    if path.size == 0:
        return np.zeros(0, np.int64)
    warps = math.ceil(path.size / WARP)
    padded = np.empty(warps * WARP, dtype=np.float64)
    padded[: path.size] = path
    padded[path.size:] = padded[(warps - 1) * WARP]  # repeat a path of the last warp: adds none
    rows = np.sort(padded.reshape(warps, WARP), axis=1)
    return 1 + np.count_nonzero(np.diff(rows, axis=1), axis=1)


def serialisation_slowdown(path, *, body: float = 1.0, common: float = 0.0) -> float:
    """The serialisation model: a warp issues the body once for every different path its lanes hold, so it
    costs common + k * body for k paths. Returns the mean over warps relative to no divergence,
    (common + mean k * body) / (common + body) -- the slowdown of the whole kernel when every warp does the
    same amount of work and the GPU is kept busy (throughput-bound)."""
    k = paths_per_warp(path)
    return float((common + k.mean() * body) / (common + body))


def expected_paths(fraction, warp: int = WARP):
    """Mean number of paths of a two-way branch per warp when each lane takes the rare side with probability
    ``fraction``, independently: 1 + P(some lane takes it) - P(every lane takes it)."""
    f = np.asarray(fraction, np.float64)
    return 2 - (1 - f) ** warp - f ** warp


def value_path(x, threshold: float) -> np.ndarray:
    """The path of each element in ``value_branches``: 1 where x < threshold."""
    return (np.asarray(x) < np.float32(threshold)).astype(np.int64)


def value_warp(x32, threshold: float, *, body: float = 1.0) -> Warp:
    """One warp of ``branch_on_value`` in the model: load, the rare path, the common path, store."""
    x32 = np.asarray(x32, np.float32)
    if x32.shape != (WARP,):
        raise runtime.CourseInputError(f"give the 32 values of one warp, got shape {x32.shape}")
    w = Warp()
    w.run("load x", 0.0)
    rare = x32 < np.float32(threshold)
    w.if_else(rare, lambda w: w.run("path 1 (rare)", body), lambda w: w.run("path 0", body))
    w.run("store", 0.0)
    return w


def _warp_values(values) -> np.ndarray:
    v = np.asarray(values)
    if v.ndim == 0 or v.shape[-1] != WARP:
        raise runtime.CourseInputError(f"the last axis must hold the 32 lanes of a warp, got shape {v.shape}")
    return v


def _shuffle(values, source, mask):
    """values[..., source[lane]] for every lane; a lane that reads from a lane outside ``mask`` gets an
    undefined value, which the model makes NaN (so it cannot go unnoticed)."""
    v = _warp_values(values)
    out = v[..., source]
    outside = ~lanes_of(mask)[source]
    if outside.any():
        if not np.issubdtype(v.dtype, np.floating):
            raise runtime.CourseInputError("a lane reads from a lane outside the mask: the value is undefined")
        out = out.copy()
        out[..., outside] = np.nan
    return out


def shfl_down_sync(mask: int, values, delta: int, width: int = WARP):
    """Lane l gets the value of lane l + delta; lanes whose partner lies past the end of their segment of
    ``width`` lanes keep their own value (as __shfl_down_sync does). values: last axis = the 32 lanes."""
    if not 0 <= delta < WARP or width not in (1, 2, 4, 8, 16, 32):
        raise runtime.CourseInputError(f"need 0 <= delta < 32 and width a power of two up to 32, got {delta}, {width}")
    lane = np.arange(WARP)
    src = lane + delta
    src = np.where(src // width == lane // width, src, lane)
    return _shuffle(values, src, mask)


def shfl_up_sync(mask: int, values, delta: int, width: int = WARP):
    """Lane l gets the value of lane l - delta; lanes with no such lane in their segment keep their own."""
    lane = np.arange(WARP)
    src = lane - delta
    src = np.where((src >= 0) & (src // width == lane // width), src, lane)
    return _shuffle(values, src, mask)


def shfl_xor_sync(mask: int, values, lane_mask: int, width: int = WARP):
    """Lane l gets the value of lane l ^ lane_mask (the butterfly that leaves the sum in every lane)."""
    lane = np.arange(WARP)
    src = lane ^ lane_mask
    src = np.where(src // width == lane // width, src, lane)
    return _shuffle(values, src, mask)


def shfl_sync(mask: int, values, src_lane):
    """Every lane gets the value of lane ``src_lane`` (a broadcast), or of its own src_lane[lane]."""
    src = np.broadcast_to(np.asarray(src_lane, np.int64) % WARP, (WARP,))
    return _shuffle(values, src, mask)


def ballot_sync(mask: int, predicate) -> int:
    """The 32-bit mask of the lanes in ``mask`` whose predicate is true."""
    return mask_of(np.broadcast_to(np.asarray(predicate, bool), (WARP,))) & int(mask)


def warp_sum_steps(values) -> list:
    """The lane values after each step of the shuffle-down tree (offsets 16, 8, 4, 2, 1): a list of six
    arrays, the input first. Lane 0 of the last holds the warp's sum, added in the order the GPU adds it."""
    v = _warp_values(values)
    steps = [v]
    for offset in (16, 8, 4, 2, 1):
        v = v + shfl_down_sync(FULL_MASK, v, offset)
        steps.append(v)
    return steps


def warp_sum_model(values):
    """``warp_sum`` in NumPy: every lane's value after the five shuffles (lane 0: the sum)."""
    return warp_sum_steps(values)[-1]


def thread_sums(x, blocks: int, threads: int, *, vector: int = 4) -> np.ndarray:
    """Each thread's share of the sum, in float32, in the order the kernels add: the CUDA C kernels load
    float4 (vector=4) and add .x .y .z .w; the numba ones load one float (vector=1). Thread g (g < blocks *
    threads) takes vectors g, g + stride, ...; the last n % vector elements go to the first threads."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if vector not in (1, 4):
        raise runtime.CourseInputError(f"vector must be 1 or 4, got {vector}")
    stride = blocks * threads
    acc = np.zeros(stride, np.float32)
    nv = x.size // vector
    xv = x[: nv * vector].reshape(nv, vector)
    for start in range(0, nv, stride):
        chunk = xv[start:start + stride]
        for c in range(vector):
            acc[: len(chunk)] += chunk[:, c]
    tail = x[nv * vector:]
    acc[: tail.size] += tail
    return acc


def block_sums(acc: np.ndarray, method: str, threads: int) -> np.ndarray:
    """Combine the threads' shares of each block as the kernel of ``method`` does: one float32 per block."""
    s = acc.reshape(-1, threads).copy()
    if method == "tree":
        stride = threads // 2
        while stride > 0:
            s[:, :stride] += s[:, stride:2 * stride]
            stride //= 2
        return s[:, 0]
    if method == "shuffle":
        warps = threads // WARP
        per_warp = warp_sum_model(s.reshape(-1, warps, WARP))[..., 0]  # lane 0 of every warp
        first = np.zeros((s.shape[0], WARP), np.float32)
        first[:, :warps] = per_warp
        return warp_sum_model(first)[..., 0]
    raise runtime.CourseInputError(f"the model covers the tree and shuffle reductions, not {method!r}")


def reduce_model(x, method: str, blocks: int, threads: int, *, vector: int = 4) -> tuple:
    """(partials, total) of ``reduce_sum(x, method=..., blocks=..., threads=...)`` computed in NumPy with
    the same float32 additions in the same order. vector=4 for the CUDA C kernels, 1 for numba's."""
    _check_threads(threads, power_of_two=method == "tree")
    partials = block_sums(thread_sums(x, blocks, threads, vector=vector), method, threads)
    total = block_sums(thread_sums(partials, 1, threads, vector=vector), method, threads)
    return partials, total[0]

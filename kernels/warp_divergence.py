"""Lesson 2 — warp divergence and the SIMT model.

Three parts, used by notebooks/02_warp_divergence.ipynb, benchmarks/warp_divergence.py and the tests:

* numba.cuda kernels, the NumPy specs they are checked against, and launchers that check their input:
  a compute-bound body run on 1..32 paths chosen by lane id, by warp id or by the data, and a sum reduction
  three ways (shared-memory tree, warp shuffles, atomics). The CUDA C versions, and the lecture's A/B vs X/Y
  example with ``__syncwarp``, are in kernels/cuda/warp_divergence.cu.
* A NumPy model of a warp, in kernels/warp_divergence_model.py (its names are re-exported here): which lanes run each
  step of a branchy kernel, what divergence costs, and the warp-level primitives down to the float32 result
  of the reductions. In CPU mode it stands in for the kernels that use warp intrinsics (and
  gpucourse/numba_ptx.py compiles them without a GPU, so CPU-mode tests see the intrinsics in the PTX).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from gpucourse import runtime

from gpucourse import cuda_c
from .warp_divergence_model import (  # the NumPy model of a warp, re-exported: wd.Warp, wd.shfl_down_sync, ...
    _check_paths, _check_threads, ballot_sync, block_sums, expected_paths, FULL_MASK, lanes_of, lecture_example,
    mask_of, path_of, paths_per_warp, PATTERNS, reduce_model, serialisation_slowdown, shfl_down_sync, shfl_sync,
    shfl_up_sync, shfl_xor_sync, Step, steps_from_log, thread_sums, value_path, value_warp, WARP, Warp,
    warp_sum_model, warp_sum_steps)

cuda = runtime.cuda()

SOURCE = "warp_divergence"  # kernels/cuda/warp_divergence.cu
EVENTS = ("A", "B", "X", "Y", "Z")  # the event codes of order_no_sync / order_syncwarp
REDUCTIONS = ("tree", "shuffle", "atomic", "atomic_each")  # reduce_sum(method=...)
NUMBA_REDUCTIONS = ("tree", "shuffle", "atomic")
UNROLL = 8  # float4 loads in flight per thread in the CUDA C reductions (thread_sum<8>)
REDUCE_BLOCKS_PER_SM = 16  # the reductions' default grid: the best of 8 and 16 on an H200, 256 threads a block
READ_PROBE_UNROLLS = (1, 2, 4, 8)
# Kernels that use warp intrinsics, with the numba signature to compile them for PTX checks.
NUMBA_WARP_KERNELS = {
    "reduce_shuffle": "void(float32[::1], float32[::1])",
    "value_branch_masks": "void(float32[::1], float32, uint32[::1], uint32[::1], uint32[::1])",
}
# Every numba kernel of this module with a signature: tests/test_gpu_archs.py compiles each to PTX and machine
# code for every GPU the course supports (gpucourse/gpus.py).
NUMBA_KERNELS = {
    **NUMBA_WARP_KERNELS,
    "branch_on_lane": "void(float32[::1], float32[::1], int64, int64)",
    "branch_on_warp": "void(float32[::1], float32[::1], int64, int64)",
    "branch_on_value": "void(float32[::1], int64[::1], float32, float32[::1], int64)",
    "reduce_tree": "void(float32[::1], float32[::1])",
    "reduce_atomic": "void(float32[::1], float32[::1])",
}
PATH_A = np.float32(0.999)  # path p iterates v <- v * PATH_A + 0.001 * (p + 1), which tends to p + 1


@cuda.jit(device=True)
def path_body(v0, v1, v2, v3, p, iters):
    """``iters`` multiply-adds on four independent chains; path p tends to p + 1."""
    a = PATH_A
    b = np.float32(0.001) * np.float32(p + 1)
    for _ in range(iters):
        v0 = v0 * a + b
        v1 = v1 * a + b
        v2 = v2 * a + b
        v3 = v3 * a + b
    return v0, v1, v2, v3


@cuda.jit(device=True)
def run_paths(x, path, paths, iters):
    """Run the body once, on path ``path``. The loop over p is the same for every lane; the body runs when
    any lane of the warp has path == p, so a warp holding k different paths runs it k times."""
    v0, v1, v2, v3 = x, x + np.float32(0.25), x + np.float32(0.5), x + np.float32(0.75)
    for p in range(paths):
        if path == p:
            v0, v1, v2, v3 = path_body(v0, v1, v2, v3, p, iters)
    return v0 + v1 + v2 + v3


@cuda.jit
def branch_on_lane(x, out, paths, iters):
    """The path is the lane id modulo ``paths``: every warp holds min(paths, 32) different paths."""
    i = cuda.grid(1)
    if i < out.size:
        out[i] = run_paths(x[i], cuda.laneid % paths, paths, iters)


@cuda.jit
def branch_on_warp(x, out, paths, iters):
    """The same branch on the warp id: all lanes of a warp agree, no warp diverges."""
    i = cuda.grid(1)
    if i < out.size:
        out[i] = run_paths(x[i], (i // WARP) % paths, paths, iters)


@cuda.jit
def branch_on_value(x, order, threshold, out, iters):
    """Data-dependent: element j takes path 1 if x[j] < threshold, else path 0. Thread i handles element
    order[i], so regrouping the elements by path is a permutation away."""
    i = cuda.grid(1)
    if i < out.size:
        j = order[i]
        v = x[j]
        out[j] = run_paths(v, 1 if v < threshold else 0, 2, iters)


BRANCH_KERNELS = {"lane": branch_on_lane, "warp": branch_on_warp}


@cuda.jit(device=True)
def thread_sum(x):
    """One thread's share: a grid-stride loop adding x[i] in index order, in float32."""
    acc = np.float32(0.0)
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        acc += x[i]
    return acc


@cuda.jit
def reduce_tree(x, partials):
    """Shared-memory tree: partials[block] = the block's sum. blockDim.x: a power of two up to 1024."""
    s = cuda.shared.array(1024, np.float32)
    t = cuda.threadIdx.x
    s[t] = thread_sum(x)
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if t < stride:
            s[t] += s[t + stride]
        cuda.syncthreads()
        stride //= 2
    if t == 0:
        partials[cuda.blockIdx.x] = s[0]


@cuda.jit
def reduce_atomic(x, total):
    """Every thread adds its share to total[0] with one atomic add (total[0] must start at zero)."""
    cuda.atomic.add(total, 0, thread_sum(x))


@cuda.jit(device=True)
def warp_sum(v):
    """Five shuffles sum the 32 lanes of a warp into lane 0."""
    offset = 16
    while offset > 0:
        v += cuda.shfl_down_sync(FULL_MASK, v, offset)
        offset //= 2
    return v


@cuda.jit
def reduce_shuffle(x, partials):
    """Warp shuffles: each warp sums in registers, the first warp sums the warps' sums.
    partials[block] = the block's sum. blockDim.x: a multiple of 32 up to 1024. Needs a GPU."""
    warp_sums = cuda.shared.array(32, np.float32)
    v = warp_sum(thread_sum(x))
    lane = cuda.laneid
    warp = cuda.threadIdx.x // WARP
    if lane == 0:
        warp_sums[warp] = v
    cuda.syncthreads()
    if warp == 0:
        v = warp_sums[lane] if lane < cuda.blockDim.x // WARP else np.float32(0.0)
        v = warp_sum(v)
        if lane == 0:
            partials[cuda.blockIdx.x] = v


@cuda.jit
def value_branch_masks(x, threshold, taken, active_rare, active_common):
    """Per warp: which lanes have x < threshold (ballot_sync), and which lanes run each side of the branch
    together (activemask inside it). Needs a GPU."""
    i = cuda.grid(1)
    inside = i < x.size
    rare = False
    if inside:
        rare = x[i] < threshold
    ballot = cuda.ballot_sync(FULL_MASK, rare)
    warp = i // WARP
    if inside:
        if rare:
            m = cuda.activemask()
            if cuda.laneid == cuda.ffs(m) - 1:
                active_rare[warp] = m
        else:
            m = cuda.activemask()
            if cuda.laneid == cuda.ffs(m) - 1:
                active_common[warp] = m
        if cuda.laneid == 0:
            taken[warp] = ballot


NUMBA_REDUCE_KERNELS = {"tree": reduce_tree, "shuffle": reduce_shuffle, "atomic": reduce_atomic}


def branch_spec(x: np.ndarray, path: np.ndarray, iters: int) -> np.ndarray:
    """What every branch kernel computes for element x with path p: four chains v <- 0.999 v + 0.001 (p+1),
    ``iters`` times, from x, x + 1/4, x + 1/2, x + 3/4, summed. In float64; kernels agree to about 1e-5."""
    x = np.asarray(x, np.float64)
    a = float(PATH_A)
    b = 0.001 * (np.asarray(path, np.float64) + 1)
    ak = a ** iters
    fixed = b / (1 - a)
    return sum(ak * (x + d) + fixed * (1 - ak) for d in (0.0, 0.25, 0.5, 0.75))


def sum_spec(x: np.ndarray) -> float:
    """The exact-enough sum, in float64."""
    return float(np.sum(np.asarray(x, np.float64)))


def _check_x(x, name: str = "x") -> None:
    runtime.check_device_array(x, name, dtype=np.float32, ndim=1)


def _is_cupy(x) -> bool:
    return type(x).__module__.startswith("cupy")


def _check_same(x, out) -> None:
    _check_x(x)
    _check_x(out, "out")
    if tuple(out.shape) != tuple(x.shape):
        raise runtime.CourseInputError(f"out has shape {tuple(out.shape)} but x has {tuple(x.shape)}")


def branches(x, out, *, by: str = "lane", paths: int = 2, iters: int = 64, threads: int = 256,
             impl: str = "numba"):
    """out[i] = the body run on element i along path (lane % paths) or (warp % paths); returns out.

    x, out: 1-D float32 device arrays. impl: "numba" (either mode) or "cuda_c" (CuPy arrays, GPU mode).
    Asynchronous on a GPU. ``path_of(n, by, paths)`` gives each element's path, ``branch_spec`` the result.
    """
    if by not in PATTERNS:
        raise runtime.CourseInputError(f"by must be one of {PATTERNS}, not {by!r}")
    _check_paths(paths, iters)
    _check_threads(threads)
    _check_same(x, out)
    n = x.shape[0]
    blocks = max(1, math.ceil(n / threads))
    if impl == "numba":
        BRANCH_KERNELS[by][blocks, threads](x, out, paths, iters)
    elif impl == "cuda_c":
        _require_cupy(x, out)
        cuda_c.function(SOURCE, f"branch_on_{by}")((blocks,), (threads,),
                                                   (x, out, np.int32(paths), np.int32(iters), np.int64(n)))
    else:
        raise runtime.CourseInputError(f"impl must be 'numba' or 'cuda_c', not {impl!r}")
    return out


def value_branches(x, out, *, threshold: float, iters: int = 64, order=None, threads: int = 256,
                   impl: str = "numba"):
    """out[j] = the body on element j along path 1 if x[j] < threshold else path 0; thread i handles
    element order[i] (default: element i). order: a permutation of 0..n-1 as int64 device array."""
    _check_paths(2, iters)
    _check_threads(threads)
    _check_same(x, out)
    n = x.shape[0]
    if order is not None:
        runtime.check_device_array(order, "order", dtype=np.int64, shape=(n,))
    blocks = max(1, math.ceil(n / threads))
    if impl == "numba":
        if order is None:
            order = _arange_like(x, n)
        branch_on_value[blocks, threads](x, order, np.float32(threshold), out, iters)
    elif impl == "cuda_c":
        _require_cupy(x, out, *(() if order is None else (order,)))
        cuda_c.function(SOURCE, "branch_on_value")(
            (blocks,), (threads,), (x, order if order is not None else np.uint64(0), np.float32(threshold), out,
                                    np.int32(iters), np.int64(n)))
    else:
        raise runtime.CourseInputError(f"impl must be 'numba' or 'cuda_c', not {impl!r}")
    return out


def _arange_like(x, n):
    if _is_cupy(x):
        return runtime.cupy().arange(n, dtype=np.int64)
    return cuda.to_device(np.arange(n, dtype=np.int64))


def _require_cupy(*arrays) -> None:
    runtime.require_gpu("a CUDA C kernel")
    for a in arrays:
        if not _is_cupy(a):
            raise runtime.CourseInputError("the CUDA C kernels take CuPy arrays (cupy.asarray(...))")


def default_blocks(n: int, threads: int, blocks_per_sm: int = REDUCE_BLOCKS_PER_SM) -> int:
    """Blocks for a reduction or the read probe: ``blocks_per_sm`` per SM (16 x 256 threads is two waves
    of a full SM on an H100 or H200), never more than give every thread one full trip of its unrolled loop
    (UNROLL float4); two in the simulator."""
    needed = max(1, math.ceil(n / (threads * 4 * UNROLL)))
    per_gpu = blocks_per_sm * runtime.get().device["sms"] if runtime.is_gpu() else 2
    return min(needed, per_gpu)


def reduce_sum(x, *, method: str = "shuffle", impl: str = "cuda_c", threads: int = 256,
               blocks: int | None = None, partials=None, out=None):
    """The sum of a 1-D float32 device array, as a one-element device array (asynchronous on a GPU).

    method: "tree" (shared memory), "shuffle" (warp shuffles), "atomic" (one atomic add per thread), or
    "atomic_each" (one per element; CUDA C only). tree and shuffle write one partial sum per block, then
    run the same kernel once more with one block over the partials; their float32 result is deterministic
    and ``reduce_model`` reproduces it bit for bit. partials: optional scratch of at least ``blocks``
    floats (saves an allocation per call when timing). impl: "cuda_c" (CuPy arrays, GPU mode) or "numba".
    """
    if method not in REDUCTIONS:
        raise runtime.CourseInputError(f"method must be one of {REDUCTIONS}, not {method!r}")
    if impl not in ("cuda_c", "numba"):
        raise runtime.CourseInputError(f"impl must be 'cuda_c' or 'numba', not {impl!r}")
    if impl == "numba" and method not in NUMBA_REDUCTIONS:
        raise runtime.CourseInputError(f"the numba reductions are {NUMBA_REDUCTIONS}, not {method!r}")
    _check_x(x)
    _check_threads(threads, power_of_two=method == "tree")
    n = x.shape[0]
    if n == 0:
        raise runtime.CourseInputError("x is empty: there is nothing to sum")
    blocks = blocks or default_blocks(n, threads)
    if not 1 <= blocks <= 2**31 - 1:
        raise runtime.CourseInputError(f"blocks must be 1 .. 2**31 - 1, got {blocks}")
    if impl == "numba" and method == "shuffle" and not runtime.is_gpu():
        raise runtime.NeedsGPU(
            "warp shuffles do not run in Numba's simulator (it has no warps); reduce_model(x, 'shuffle', ...) "
            "computes the same float32 result in NumPy")
    if impl == "cuda_c":
        _require_cupy(x)
    gpu_arrays = _is_cupy(x)
    cp = runtime.cupy() if gpu_arrays else None

    def scratch(size):
        return cp.empty(size, dtype=np.float32) if gpu_arrays else cuda.device_array(size, dtype=np.float32)

    def zeros(size):
        return cp.zeros(size, dtype=np.float32) if gpu_arrays else cuda.to_device(np.zeros(size, np.float32))

    if out is None:
        out = zeros(1) if method.startswith("atomic") else scratch(1)
    else:
        runtime.check_device_array(out, "out", dtype=np.float32, shape=(1,))
        if method.startswith("atomic") and _is_cupy(out):
            out.fill(0)
        elif method.startswith("atomic"):
            out.copy_to_device(np.zeros(1, np.float32))
    if method.startswith("atomic"):
        if impl == "numba":
            reduce_atomic[blocks, threads](x, out)
        else:
            kernel = cuda_c.function(SOURCE, "reduce_" + method)
            kernel((blocks,), (threads,), (x, np.int64(n), out))
        return out
    if partials is None:
        partials = scratch(blocks)
    elif partials.shape[0] < blocks:
        raise runtime.CourseInputError(f"partials holds {partials.shape[0]} floats; {blocks} blocks need {blocks}")
    if impl == "numba":
        kernel = NUMBA_REDUCE_KERNELS[method]
        kernel[blocks, threads](x, partials[:blocks])
        with warnings.catch_warnings():  # one block on purpose: numba's low-occupancy warning does not apply
            warnings.filterwarnings("ignore", message=".*Grid size")
            kernel[1, threads](partials[:blocks], out)
    else:
        kernel = cuda_c.function(SOURCE, "reduce_" + method)
        kernel((blocks,), (threads,), (x, np.int64(n), partials))
        kernel((1,), (threads,), (partials, np.int64(blocks), out))
    return out


def read_probe(x, *, unroll: int = 4, threads: int = 256, blocks: int | None = None, sink=None):
    """Stream x once and do next to nothing with it: the read-bandwidth ceiling (CUDA C, GPU mode)."""
    if unroll not in READ_PROBE_UNROLLS:
        raise runtime.CourseInputError(f"unroll must be one of {READ_PROBE_UNROLLS}, not {unroll}")
    _check_x(x)
    _require_cupy(x)
    _check_threads(threads)
    n = x.shape[0]
    blocks = blocks or default_blocks(n, threads)
    sink = sink if sink is not None else runtime.cupy().zeros(1, dtype=np.uint32)
    cuda_c.function(SOURCE, f"read_probe_{unroll}")((blocks,), (threads,), (x, np.int64(n), sink))
    return sink


def order_of_events(sync: bool) -> dict:
    """Run the lecture's example on one warp (GPU mode): lanes 0-3 run A then B, the others X then Y,
    then all Z; with ``sync`` a __syncwarp sits between A/X and B/Y.

    Returns the log in the order the events happened: "events" (labels), "lanes", "masks" (the
    __activemask() at each event), and "seen": what each lane read in B or Y (A wrote 100 + lane, X 200 +
    lane; -1 means the lane read from had not written yet)."""
    cp = runtime.cupy()
    entries = 3 * WARP  # every lane records two events in the branch and Z after it
    ticket = cp.zeros(1, dtype=np.int32)
    events, lanes = cp.full(entries, -1, dtype=np.int32), cp.full(entries, -1, dtype=np.int32)
    masks, seen = cp.zeros(entries, dtype=np.uint32), cp.full(WARP, np.nan, dtype=np.float32)
    name = "order_syncwarp" if sync else "order_no_sync"
    cuda_c.function(SOURCE, name)((1,), (WARP,), (ticket, events, lanes, masks, seen))
    if int(ticket.get()[0]) != entries:
        raise runtime.CourseError(f"{name} recorded {int(ticket.get()[0])} events, expected {entries}")
    return {"sync": sync, "events": [EVENTS[e] for e in events.get()], "lanes": lanes.get().tolist(),
            "masks": [int(m) for m in masks.get()], "seen": seen.get().tolist()}


def value_masks(x, threshold: float, *, impl: str = "cuda_c") -> dict:
    """For every warp of x (GPU mode): the ballot of x < threshold, and the __activemask() seen inside the
    rare branch and inside the common one (0 where no lane took it). Lists of ints, one per warp."""
    _check_x(x)
    cp = runtime.cupy()
    n = x.shape[0]
    warps = math.ceil(n / WARP)
    taken, rare, common = (cp.zeros(warps, dtype=np.uint32) for _ in range(3))
    blocks = math.ceil(warps * WARP / 256)
    if impl == "cuda_c":
        _require_cupy(x)
        cuda_c.function(SOURCE, "value_branch_masks")(
            (blocks,), (256,), (x, np.float32(threshold), np.int64(n), taken, rare, common))
    else:
        with warnings.catch_warnings():  # a few warps on purpose: numba's low-occupancy warning does not apply
            warnings.filterwarnings("ignore", message=".*Grid size")
            value_branch_masks[blocks, 256](x, np.float32(threshold), taken, rare, common)
    return {"taken": [int(m) for m in taken.get()], "active_rare": [int(m) for m in rare.get()],
            "active_common": [int(m) for m in common.get()]}


@dataclass
class SimulatedWarps:
    """What the simulated warp intrinsics counted: shuffles run by each (block, thread), atomic adds."""

    shuffles: dict
    atomics: int = 0

    def reset(self) -> None:
        self.shuffles.clear()
        self.atomics = 0


_simulated: SimulatedWarps | None = None


def simulate_warp_shuffles() -> SimulatedWarps:
    """Give Numba's CUDA simulator the warp shuffles it lacks (CPU mode only), and count them.

    Afterwards cuda.shfl_sync, shfl_up_sync, shfl_down_sync and shfl_xor_sync work in simulated kernels with
    the hardware's rules for which lane reads which; every shuffle and every cuda.atomic.add is counted in the
    returned object. At each shuffle every lane posts its value, the threads of the block meet (as at
    cuda.syncthreads), each lane reads its source lane's value, and they meet again. A whole block meeting is
    stricter than a warp, so every thread of the block must run the same shuffles — what a full-mask shuffle
    asks of the 32 lanes of a warp anyway. A lane that reads a lane outside the mask, or one that did not run
    this shuffle, gets NaN (on a GPU the value is undefined). Calling it again returns the same counters.
    """
    global _simulated
    if runtime.is_gpu():
        raise runtime.CourseError("the GPU has real warp shuffles; simulate_warp_shuffles is for CPU mode")
    if _simulated is not None:
        return _simulated
    import threading

    from numba.cuda.simulator import kernelapi as simulator

    counts = SimulatedWarps(shuffles={})
    lock = threading.Lock()
    atomic_add = simulator.FakeCUDAAtomic.add

    def simulated(source_lane):
        def shuffle(self, mask, value, arg):
            me = threading.current_thread()
            lane = me.thread_id % WARP
            source = source_lane(lane, int(arg))
            source = source if 0 <= source < WARP else lane  # past the end of the warp: the lane's own value
            turn = getattr(me, "shuffles_run", 0) + 1
            me.shuffles_run = turn
            with lock:
                counts.shuffles[(me.blockIdx.x, me.thread_id)] = turn
            board = me._manager.__dict__.setdefault("shuffle_board", {})
            board[me.thread_id] = (turn, value)
            me.syncthreads()
            posted_turn, posted = board.get(me.thread_id - lane + source, (None, None))
            me.syncthreads()
            if posted_turn == turn and int(mask) >> source & 1:
                return posted
            if isinstance(value, (float, np.floating)):
                return type(value)(np.nan)
            raise runtime.CourseError(f"lane {lane} read lane {source}, which is outside the mask or did not "
                                      "run this shuffle: the value is undefined")
        return shuffle

    def counted_atomic_add(self, array, index, value):
        with lock:
            counts.atomics += 1
        return atomic_add(self, array, index, value)

    simulator.FakeCUDAModule.shfl_sync = simulated(lambda lane, src: src % WARP)
    simulator.FakeCUDAModule.shfl_up_sync = simulated(lambda lane, delta: lane - delta)
    simulator.FakeCUDAModule.shfl_down_sync = simulated(lambda lane, delta: lane + delta)
    simulator.FakeCUDAModule.shfl_xor_sync = simulated(lambda lane, lane_mask: lane ^ lane_mask)
    simulator.FakeCUDAAtomic.add = counted_atomic_add
    _simulated = counts
    return counts

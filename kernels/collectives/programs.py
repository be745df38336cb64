"""Lesson 7: the programs every rank runs, one process per GPU (``gpucourse.ranks.launch(k, program, ...)`` on one
machine, or ``python -m gpucourse.ranks kernels.collectives.programs:PROGRAM ...`` under torchrun, srun or mpirun).

* ``ring_allreduce_program``: the ring all-reduce of ``ring_allreduce_numpy``, one rank per process, its chunks
  passed through the rendezvous (CPU; the launcher's tests use it without a GPU).
* ``nccl_allreduce_program``: NCCL's all-reduce, one communicator per process from rank 0's unique id.
* ``ipc_ring_allreduce_program``: the course's ring all-reduce on GPUs, each rank copying into its right
  neighbour's buffer, opened from that rank's CUDA IPC handle.
* ``failing_program``: a rank that raises, exits, is killed or hangs, to show what the others see.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np

from gpucourse import bench, runtime

from . import specs as col
def rank_data(rank: int, n: int, seed: int = 0, dtype="float32") -> np.ndarray:
    """The array rank ``rank`` contributes: the same on every run, different on every rank."""
    return np.random.default_rng([seed, rank]).standard_normal(n).astype(dtype)


def ring_allreduce_program(group, n: int, seed: int = 0) -> np.ndarray:
    """One rank of the ring all-reduce (reduce-scatter, then all-gather), the chunks it sends to its right
    neighbour passed through the rendezvous: the algorithm of collectives.ring_allreduce_numpy, one process
    per rank. Returns this rank's result."""
    r, k = group.rank, group.k
    buf = rank_data(r, n, seed).astype(np.float64)
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(k - 1):
            c = (r - s) % k if phase == "reduce-scatter" else (r + 1 - s) % k
            lo, hi = col.chunk_bounds(n, k, c)
            sent = group.exchange((c, buf[lo:hi].copy()))
            c_in, data = sent[(r - 1) % k]  # from the left neighbour
            lo, hi = col.chunk_bounds(n, k, c_in)
            if phase == "reduce-scatter":
                buf[lo:hi] += data
            else:
                buf[lo:hi] = data
    return buf


def failing_program(group, bad_rank: int, how: str, seconds: float = 0.2):
    """Every rank exchanges twice; rank ``bad_rank`` fails before the second exchange: ``how`` is "raise",
    "exit", "kill" (SIGKILL, as the out-of-memory killer does) or "hang" (it sleeps, answering nothing)."""
    group.barrier()
    if group.rank == bad_rank:
        time.sleep(seconds)
        if how == "raise":
            raise ValueError(f"rank {group.rank} found a bad batch")
        if how == "exit":
            os._exit(7)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "hang":
            time.sleep(3600)
    group.barrier()
    return group.rank


def use_gpu(group):
    """CuPy, with this rank's GPU (its ``local_rank``: the GPU of its own machine) made current; a clear error where
    the machine has fewer GPUs than that."""
    cp = runtime.cupy()
    n = cp.cuda.runtime.getDeviceCount()
    if n <= group.local_rank:
        raise runtime.CourseError(f"rank {group.rank} drives GPU {group.local_rank} of its machine, which has {n}: "
                                  "one GPU a rank")
    cp.cuda.Device(group.local_rank).use()
    return cp


def nccl_allreduce_program(group, n: int, seed: int = 0, repeats: int = 0) -> dict:
    """One rank of NCCL's all-reduce: rank 0 makes the unique id (ncclGetUniqueId), every rank gets it through
    the rendezvous and joins the communicator; then one all-reduce of ``rank_data`` (checked by the caller
    against the single-process sum) and, with ``repeats``, its time on this rank's GPU (CUDA events)."""
    cp = use_gpu(group)
    from cupy.cuda import nccl

    uid = group.broadcast(nccl.get_unique_id() if group.rank == 0 else None)
    comm = nccl.NcclCommunicator(group.k, uid, group.rank)
    x = cp.asarray(rank_data(group.rank, n, seed))
    stream = cp.cuda.get_current_stream()

    def allreduce(buf):
        comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)

    allreduce(x)
    out = {"result": x.get() if n <= 2**22 else None, "checksum": float(x.astype(cp.float64).sum())}
    if repeats:
        work = cp.empty_like(x)
        group.barrier()
        out["ms"] = bench.time_gpu(lambda: allreduce(work), repeats=repeats, warmup=2).samples_ms
    comm.destroy()
    return out


def ipc_ring_allreduce_program(group, n: int, seed: int = 0) -> dict:
    """One rank of the course's ring all-reduce on GPUs, one process per GPU: each rank shares its receive
    buffer's CUDA IPC handle, opens its right neighbour's, and in every step copies one chunk into it
    (cudaMemcpyPeerAsync across processes), then meets the others at a barrier before it adds or keeps the
    chunk its left neighbour sent. Host barriers between steps make it slow: the point is that the same ring
    runs across processes, with results equal to the single-process version."""
    cp = use_gpu(group)
    rt = cp.cuda.runtime
    r, k = group.rank, group.k
    buf = cp.asarray(rank_data(r, n, seed))
    # my left neighbour writes here: an allocation of its own (cudaMalloc, not CuPy's pool), since an IPC handle
    # opens at the start of the allocation it names
    inbox = cp.ndarray(buf.shape, buf.dtype, cp.cuda.MemoryPointer(cp.cuda.memory.Memory(buf.nbytes), 0))
    handles = group.exchange(rt.ipcGetMemHandle(inbox.data.ptr))
    right = (r + 1) % k
    peer = rt.ipcOpenMemHandle(handles[right]) if k > 1 else None
    try:
        itemsize = buf.itemsize
        for phase in ("reduce-scatter", "all-gather"):
            for s in range(k - 1):
                c = (r - s) % k if phase == "reduce-scatter" else (r + 1 - s) % k
                lo, hi = col.chunk_bounds(n, k, c)
                rt.memcpy(peer + lo * itemsize, buf.data.ptr + lo * itemsize, (hi - lo) * itemsize, rt.memcpyDefault)
                cp.cuda.Device().synchronize()
                group.barrier()  # every rank's chunk has landed in its neighbour's inbox
                c_in = (c - 1) % k
                lo, hi = col.chunk_bounds(n, k, c_in)
                if phase == "reduce-scatter":
                    buf[lo:hi] += inbox[lo:hi]
                else:
                    buf[lo:hi] = inbox[lo:hi]
                cp.cuda.Device().synchronize()
                group.barrier()  # nobody overwrites an inbox its owner still reads
    finally:
        if peer is not None:
            rt.ipcCloseMemHandle(peer)
    return {"result": buf.get() if n <= 2**22 else None, "checksum": float(buf.astype(cp.float64).sum())}


def expected_sum(k: int, n: int, seed: int = 0) -> np.ndarray:
    """What every rank holds after an all-reduce of ``rank_data``: the single-process reference."""
    return col.allreduce_spec([rank_data(r, n, seed).astype(np.float64) for r in range(k)])[0]

"""Lesson 6 — one process per GPU: k ranks on one machine, as real training jobs run (and the same code then
spans nodes).

``launch(k, program, *args)`` starts k Python processes (``spawn``: fresh interpreters, as ``mpirun`` or
``torchrun`` would) and runs ``program(group, *args)`` in each; ``group`` is that rank's ``Group``: its
``rank``, ``k``, and the launcher's rendezvous, ``exchange(obj)`` (every rank gets every rank's object:
an all-gather of small Python objects through pipes), ``broadcast(obj, root)`` and ``barrier()``. That is
all NCCL needs to start (rank 0's ``ncclGetUniqueId``, shared with the others) and all the course's ring
needs to reach its neighbour's buffer (CUDA IPC handles, exchanged).

Nothing waits for ever. Every wait of a rank and of the launcher has a time-out; the launcher watches
every rank's pipe and process at once, so a rank that raises, exits or is killed stops the job at once:
the others are told to stop (then terminated, then killed), none is left behind, and ``RankFailed`` says
which rank failed, how (its exception's last line, its exit code or signal) and where the others were.
A rank whose launcher disappears stops too.

Programs, each run by every rank (functions of this module, so a fresh interpreter can import them):

* ``ring_allreduce_program``: the ring all-reduce of ``collectives.ring_allreduce_numpy``, one rank per
  process, its chunks passed through the rendezvous (CPU; the failure tests use it without a GPU).
* ``nccl_allreduce_program``: NCCL's all-reduce, one communicator per process from rank 0's unique id.
* ``ipc_ring_allreduce_program``: the course's ring all-reduce on GPUs, each rank copying into its right
  neighbour's buffer, opened from that rank's CUDA IPC handle.
* ``failing_program``: a rank that raises, exits, is killed or hangs, to show what the others see.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import time
import traceback
from multiprocessing.connection import wait

import numpy as np

from gpucourse import runtime

from . import collectives as col

DEFAULT_TIMEOUT = 120.0  # seconds a rank or the launcher waits for any one step of the others
STOP_GRACE = 5.0  # seconds a stopped rank gets to exit before it is terminated, then killed
# NCCL starts with NVLink multicast off in every rank (kernels/collectives/__init__.py sets it in this process;
# the ranks inherit the environment of the launcher).
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0"}


class RankFailed(runtime.CourseError):
    """A rank of a launched job failed (raised, exited, was killed or did not answer in time); the others
    were stopped. ``rank``: the first rank that failed; ``how``: what happened to it."""

    def __init__(self, message: str, rank: int | None = None, how: str = ""):
        super().__init__(message)
        self.rank, self.how = rank, how


class _Stop(BaseException):
    """Raised in a rank the launcher told to stop (another rank failed); not an error of this rank."""


class Group:
    """What a rank's program sees of the job: its ``rank``, the number of ranks ``k``, and the rendezvous."""

    def __init__(self, rank: int, k: int, conn, timeout: float):
        self.rank, self.k, self._conn, self.timeout = rank, k, conn, timeout
        self._round = 0

    def exchange(self, obj) -> list:
        """Every rank's ``obj`` (a small, picklable object), in rank order; every rank must call it, as
        often as the others. Waits at most ``timeout`` seconds for the others."""
        self._round += 1
        self._conn.send(("exchange", self._round, obj))
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rank {self.rank} waited {self.timeout:g} s in exchange #{self._round} for the "
                                   "other ranks")
            if self._conn.poll(min(left, 1.0)):
                try:
                    kind, *rest = self._conn.recv()
                except EOFError:
                    raise _Stop("the launcher is gone") from None
                if kind == "stop":
                    raise _Stop(rest[0])
                round_, objs = rest
                if round_ != self._round:
                    raise RuntimeError(f"rank {self.rank} is in exchange #{self._round}, the launcher in #{round_}")
                return objs

    def broadcast(self, obj, root: int = 0):
        """``obj`` of rank ``root``, on every rank."""
        return self.exchange(obj if self.rank == root else None)[root]

    def barrier(self) -> None:
        self.exchange(None)


def _rank_main(rank: int, k: int, conn, timeout: float, program, args: tuple) -> None:
    """A rank's process: run the program, send its result (or its error) to the launcher."""
    os.environ.update(CHILD_ENV)
    group = Group(rank, k, conn, timeout)
    try:
        result = program(group, *args)
        conn.send(("done", result))
    except _Stop:
        os._exit(3)
    except BaseException as exc:  # noqa: BLE001 — every error goes to the launcher, named
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=8)))
        except (OSError, EOFError):
            pass
        os._exit(1)
    conn.close()


def _how_it_ended(code) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch(k: int, program, *args, timeout: float = DEFAULT_TIMEOUT, start_timeout: float = 120.0) -> list:
    """Run ``program(group, *args)`` in k new processes; return their results in rank order, or raise
    RankFailed (after stopping every rank) when one fails. ``timeout``: the longest any rank may take
    between two steps (an exchange, or the end); ``start_timeout``: the longest a rank may take to start
    and reach its first step (a fresh interpreter imports NumPy, CuPy and this module)."""
    if not isinstance(k, int) or k < 1:
        raise runtime.CourseInputError(f"k must be a whole number of ranks >= 1, not {k!r}")
    if not (timeout > 0 and start_timeout > 0):
        raise runtime.CourseInputError("timeouts must be positive")
    try:
        importable = callable(program) and getattr(program, "__module__", "__main__") != "__main__" \
            and bool(pickle.dumps(program))
    except (pickle.PicklingError, AttributeError, TypeError):
        importable = False
    if not importable:
        raise runtime.CourseInputError(f"program must be a function defined at the top of an importable module (a "
                                       f"fresh interpreter runs it), not {program!r}: put it in a .py file")
    ctx = multiprocessing.get_context("spawn")
    os.environ.update(CHILD_ENV)  # the spawned interpreters inherit it
    conns, procs = [], []
    try:
        for rank in range(k):
            here, there = ctx.Pipe()
            # The launcher judges who is late; a rank's own time-out is the backstop for a launcher that is
            # stuck, so it waits STOP_GRACE longer (else a busy machine can let a waiting rank time out first
            # and the job would blame the rank that waited, not the one that hung).
            p = ctx.Process(target=_rank_main, args=(rank, k, there, timeout + STOP_GRACE, program, args),
                            daemon=True, name=f"rank-{rank}")
            p.start()
            there.close()
            conns.append(here)
            procs.append(p)
        return _serve(conns, procs, timeout, start_timeout)
    finally:
        _stop_all(conns, procs, "the job ended")


def _serve(conns, procs, timeout: float, start_timeout: float) -> list:
    """The launcher's loop: answer an exchange once every rank has asked, collect results, and stop at the
    first rank that fails or lets ``timeout`` pass without a step (``start_timeout`` before the first)."""
    k = len(procs)
    pending: dict = {}  # rank -> (round, obj) of the exchange it waits in
    results: dict = {}
    where = {r: "starting" for r in range(k)}
    deadline = time.monotonic() + start_timeout
    sentinel = {p.sentinel: r for r, p in enumerate(procs)}
    reader = {c: r for r, c in enumerate(conns)}
    while len(results) < k:
        left = deadline - time.monotonic()
        if left <= 0:
            late = [r for r in range(k) if r not in results and r not in pending]
            raise RankFailed(f"rank {late[0]} did not answer in time (it was {where[late[0]]}); the others were "
                             f"{_places(where, late[0])}. Every rank was stopped.", late[0], "timed out")
        ready = wait([c for c, r in reader.items() if r not in results] +
                     [s for s, r in sentinel.items() if r not in results], timeout=min(left, 1.0))
        for obj in ready:
            r = sentinel.get(obj, reader.get(obj))
            if r in results:
                continue
            if obj in sentinel and not conns[r].poll():  # it ended with nothing more to say
                procs[r].join(STOP_GRACE)
                how = _how_it_ended(procs[r].exitcode)
                raise RankFailed(f"rank {r} {how} while {where[r]}; the others were {_places(where, r)}. "
                                 "Every rank was stopped.", r, how)
            if _take(conns[r], r, pending, results, where, procs) == "done":
                deadline = time.monotonic() + timeout
        if pending and len(pending) + len(results) == k:
            if results or len({rd for rd, _ in pending.values()}) != 1:
                raise RankFailed(f"the ranks do not meet at the same exchange: {_places(where, None)}. Every "
                                 "rank was stopped.", None, "mismatched exchanges")
            objs = [pending[r][1] for r in range(k)]
            for r in range(k):
                conns[r].send(("objs", pending[r][0], objs))
                where[r] = f"working after exchange #{pending[r][0]}"
            pending.clear()
            deadline = time.monotonic() + timeout
    return [results[r] for r in range(k)]


def _take(conn, r: int, pending: dict, results: dict, where: dict, procs) -> str:
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        procs[r].join(STOP_GRACE)
        how = _how_it_ended(procs[r].exitcode)
        raise RankFailed(f"rank {r} {how} while {where[r]}; the others were {_places(where, r)}. "
                         "Every rank was stopped.", r, how) from None
    kind = msg[0]
    if kind == "exchange":
        pending[r] = (msg[1], msg[2])
        where[r] = f"waiting in exchange #{msg[1]}"
    elif kind == "done":
        results[r] = msg[1]
        where[r] = "done"
    elif kind == "error":
        raise RankFailed(f"rank {r} failed while {where[r]}: {msg[1]}; the others were {_places(where, r)}. "
                         f"Every rank was stopped.\n--- rank {r}'s traceback ---\n{msg[2]}", r, msg[1])
    return kind


def _places(where: dict, but) -> str:
    others = [f"rank {r} {w}" for r, w in where.items() if r != but]
    return ", ".join(others) if others else "none"


def _stop_all(conns, procs, why: str) -> None:
    """Tell every rank still running to stop, then terminate and kill what does not: none is left behind."""
    for c, p in zip(conns, procs):
        if p.is_alive():
            try:
                c.send(("stop", why))
            except (OSError, EOFError, BrokenPipeError):
                pass
    end = time.monotonic() + STOP_GRACE
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(STOP_GRACE)
        if p.is_alive():
            p.kill()
            p.join(STOP_GRACE)
    for c in conns:
        c.close()


# ============================================================================ programs every rank runs

def rank_data(rank: int, n: int, seed: int = 0, dtype="float32") -> np.ndarray:
    """The array rank ``rank`` contributes: the same on every run, different on every rank."""
    return np.random.default_rng([seed, rank]).standard_normal(n).astype(dtype)


def ring_allreduce_program(group: Group, n: int, seed: int = 0) -> np.ndarray:
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


def failing_program(group: Group, bad_rank: int, how: str, seconds: float = 0.2):
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


def use_gpu(group: Group):
    """CuPy, with this rank's GPU (number ``rank``) made current; a clear error where there are fewer GPUs than ranks."""
    cp = runtime.cupy()
    n = cp.cuda.runtime.getDeviceCount()
    if n < group.k:
        raise runtime.CourseError(f"{group.k} ranks need {group.k} GPUs, one each; this machine has {n}")
    cp.cuda.Device(group.rank).use()
    return cp


def _time_ms(cp, fn, repeats: int, warmup: int = 2) -> list:
    """CUDA-event times (ms) of ``fn`` on this rank's GPU, each run after a barrier of the device."""
    out = []
    for i in range(warmup + repeats):
        cp.cuda.Device().synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            out.append(cp.cuda.get_elapsed_time(start, end))
    return out


def nccl_allreduce_program(group: Group, n: int, seed: int = 0, repeats: int = 0) -> dict:
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
        out["ms"] = _time_ms(cp, lambda: allreduce(work), repeats)
    comm.destroy()
    return out


def ipc_ring_allreduce_program(group: Group, n: int, seed: int = 0) -> dict:
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

"""One process per GPU, as training jobs run: the course's launcher, and the rendezvous of the launchers clusters use.

``launch(k, program, *args)`` starts k Python processes on this machine (``spawn``: fresh interpreters, as
``mpirun`` or ``torchrun`` would) and runs ``program(group, *args)`` in each; ``group`` is that rank's ``Group``:
its ``rank``, ``k``, ``local_rank`` (which GPU of its machine it drives), and the rendezvous: ``exchange(obj)``
(every rank gets every rank's object: an all-gather of small Python objects), ``broadcast(obj, root)`` and
``barrier()``. That is all NCCL needs to start (rank 0's ``ncclGetUniqueId``, shared with the others) and all the
course's ring needs to reach its neighbour's buffer (CUDA IPC handles, exchanged).

On a cluster the launcher is someone else's, and each rank starts alone: ``python -m gpucourse.ranks
MODULE:PROGRAM [ARGS]`` under ``torchrun``, Slurm's ``srun`` or ``mpirun`` builds the same ``Group`` from the
environment those set (``from_environment``) and runs the same program:

  torchrun --nproc-per-node 2 -m gpucourse.ranks kernels.collectives.programs:nccl_allreduce_program 1048576
  srun -n 2 python -m gpucourse.ranks ...         (with MASTER_ADDR and MASTER_PORT exported)
  mpirun -n 2 python -m gpucourse.ranks ...

* torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, where its agent already serves a
  TCP store: the ranks meet in it (``torch.distributed.TCPStore``, a client each).
* srun sets SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID; plain RANK / WORLD_SIZE / LOCAL_RANK work the same way.
  Rank 0 serves the course's own store at MASTER_ADDR:MASTER_PORT (``Store``: a small key-value server of the
  standard library), since nothing else does and the course does not depend on PyTorch.
* mpirun sets OMPI_COMM_WORLD_RANK (Open MPI) or PMI_RANK (MPICH, Intel MPI): the ranks meet through
  ``mpi4py``'s COMM_WORLD (an all-gather for each exchange).

Nothing waits for ever. Every wait of a rank and of the launcher has a time-out. Under ``launch`` the launcher
watches every rank's pipe and process at once, so a rank that raises, exits or is killed stops the job at once:
the others are told to stop (then terminated, then killed), none is left behind, and ``RankFailed`` says which
rank failed, how and where the others were. Under a cluster launcher a rank that fails exits with an error
naming itself; a rank that waits for one that died learns it from the store (its connection closed) or from its
time-out, and stops with ``RankFailed`` naming the rank it waited for; torchrun and mpirun then stop the rest.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import re
import signal
import time
import traceback
from multiprocessing.connection import wait

from gpucourse import runtime

DEFAULT_TIMEOUT = 120.0  # seconds a rank or the launcher waits for any one step of the others
STOP_GRACE = 5.0  # seconds a stopped rank gets to exit before it is terminated, then killed
# NCCL starts with NVLink multicast off in every rank (the ranks inherit the environment of the launcher).
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class RankFailed(runtime.CourseError):
    """A rank of a launched job failed (raised, exited, was killed or did not answer in time); the others
    were stopped. ``rank``: the first rank that failed; ``how``: what happened to it."""

    def __init__(self, message: str, rank: int | None = None, how: str = ""):
        super().__init__(message)
        self.rank, self.how = rank, how


class _Stop(BaseException):
    """Raised in a rank the launcher told to stop (another rank failed); not an error of this rank."""


class Group:
    """What a rank's program sees of the job: its ``rank``, the number of ranks ``k``, the GPU of its machine it
    drives (``local_rank``), and the rendezvous (``exchange``, ``broadcast``, ``barrier``). This one talks to
    ``launch`` through a pipe; ``from_environment`` gives the same interface under a cluster's launcher."""

    launcher = "gpucourse.ranks.launch"

    def __init__(self, rank: int, k: int, conn, timeout: float):
        self.rank, self.k, self._conn, self.timeout = rank, k, conn, timeout
        self.local_rank = rank  # one machine: rank r drives GPU r
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

    def close(self) -> None:
        """Leave the rendezvous (the pipe closes with the process under ``launch``)."""


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



# ============================================================ the launchers clusters use: the rendezvous from the environment

class Job:
    """Who this process is in a job a cluster's launcher started: ``rank``, ``k`` (the world size), ``local_rank``
    and which launcher set them (``launcher``: "torchrun", "slurm", "env" or "mpi"), with the store's address where
    there is one."""

    def __init__(self, launcher: str, rank: int, k: int, local_rank: int, addr: str | None = None,
                 port: int | None = None):
        if not (0 <= rank < k and 0 <= local_rank):
            raise runtime.CourseInputError(f"{launcher}: rank {rank} of {k} (local rank {local_rank}) is not a rank "
                                           "of the job")
        self.launcher, self.rank, self.k, self.local_rank, self.addr, self.port = \
            launcher, rank, k, local_rank, addr, port

    def __repr__(self) -> str:
        where = f", store {self.addr}:{self.port}" if self.addr else ""
        return f"Job({self.launcher}: rank {self.rank} of {self.k}, local rank {self.local_rank}{where})"


def _int_var(env, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise runtime.CourseInputError(f"{name}={env[name]!r} is not a whole number") from None


def detect(env=None) -> Job:
    """The job this process belongs to, read from the variables its launcher set: torchrun (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID), Open MPI / MPICH (OMPI_COMM_WORLD_RANK, PMI_RANK),
    Slurm's srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; MASTER_ADDR and MASTER_PORT exported by the job
    script) or plain RANK / WORLD_SIZE. A clear error says what is missing."""
    env = os.environ if env is None else env

    def address(who: str):
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not env.get(v)]
        if missing:
            raise runtime.CourseInputError(f"{who} set the ranks, but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                                           "not set: export the address and port where rank 0 serves the rendezvous "
                                           "(e.g. MASTER_ADDR=$(hostname) MASTER_PORT=29500)")
        return env["MASTER_ADDR"], _int_var(env, "MASTER_PORT")

    if "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_USE_AGENT_STORE" in env:
        return Job("torchrun", _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE"), _int_var(env, "LOCAL_RANK"),
                   *address("torchrun"))
    for rank_var, size_var, local_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
                                          ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")):
        if rank_var in env:
            local = _int_var(env, local_var) if local_var in env else _int_var(env, rank_var)
            return Job("mpi", _int_var(env, rank_var), _int_var(env, size_var), local)
    if "RANK" in env and "WORLD_SIZE" in env:
        local = _int_var(env, "LOCAL_RANK") if "LOCAL_RANK" in env else _int_var(env, "RANK")
        return Job("env", _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE"), local, *address("RANK/WORLD_SIZE"))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        local = _int_var(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else _int_var(env, "SLURM_PROCID")
        return Job("slurm", _int_var(env, "SLURM_PROCID"), _int_var(env, "SLURM_NTASKS"), local, *address("srun"))
    raise runtime.CourseInputError(
        "no launcher's variables found: run under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), "
        "srun (SLURM_PROCID, SLURM_NTASKS, with MASTER_ADDR and MASTER_PORT) or mpirun (OMPI_COMM_WORLD_RANK or "
        "PMI_RANK), or start the ranks from Python with gpucourse.ranks.launch(k, program, ...)")


class _StoreGroup(Group):
    """A Group whose exchanges go through a key-value store every rank reaches (``set`` a key, ``get`` it, waiting):
    exchange #n of rank r is key "gpucourse/n/r"."""

    def __init__(self, job: Job, store, timeout: float):
        self.rank, self.k, self.local_rank, self.timeout = job.rank, job.k, job.local_rank, timeout
        self.launcher, self._store, self._round = job.launcher, store, 0

    def exchange(self, obj) -> list:
        self._round += 1
        self._store.set(f"gpucourse/{self._round}/{self.rank}", pickle.dumps(obj))
        deadline = time.monotonic() + self.timeout
        out = []
        for r in range(self.k):
            left = deadline - time.monotonic()
            out.append(pickle.loads(self._store.get(f"gpucourse/{self._round}/{r}", max(left, 0.0), owner=r,
                                                    waiter=f"rank {self.rank} in exchange #{self._round}")))
        return out

    def close(self, failed: bool = False) -> None:
        self._store.close(failed)


class Store:
    """The course's own rendezvous store: rank 0 serves it at (addr, port) in a thread of its process (the standard
    library's socketserver), and every rank, rank 0 included, is a client that ``set``s keys and ``get``s them,
    waiting until they are there. The server knows each rank by its connection: a rank whose connection closes
    before it said goodbye is gone, and a ``get`` of one of its keys says so at once instead of waiting out its
    time-out. Rank 0 serves until every rank has said goodbye (or ``timeout`` passes), so the last exchange of the
    others is answered."""

    def __init__(self, job: Job, timeout: float, start_timeout: float = 120.0):
        import socket

        self.job, self.timeout = job, timeout
        self._server = None
        if job.rank == 0:
            self._server = _serve_store(job.addr, job.port, job.k)
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                self._sock = socket.create_connection((job.addr, job.port), timeout=5.0)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise RankFailed(f"rank {job.rank} could not reach rank 0's rendezvous at {job.addr}:{job.port} "
                                     f"within {start_timeout:g} s ({exc}); is rank 0 running, and are MASTER_ADDR and "
                                     "MASTER_PORT the same for every rank?", 0, "unreachable") from None
                time.sleep(0.1)
        self._sock.settimeout(None)
        self._call(("hello", job.rank))

    def _call(self, msg):
        try:
            _send(self._sock, msg)
            return _recv(self._sock)
        except (OSError, EOFError):
            raise RankFailed(f"rank 0, which serves the rendezvous at {self.job.addr}:{self.job.port}, is gone (rank "
                             f"{self.job.rank} lost its connection)", 0, "gone") from None

    def set(self, key: str, value: bytes) -> None:
        self._call(("set", key, value))

    def get(self, key: str, timeout: float, *, owner: int, waiter: str) -> bytes:
        deadline = time.monotonic() + timeout
        pause = 0.001
        while True:
            kind, payload = self._call(("get", key, owner))
            if kind == "value":
                return payload
            if kind == "gone":
                raise RankFailed(f"rank {owner} is gone: its connection to the rendezvous closed ({payload}) while "
                                 f"{waiter} waited for it", owner, "gone")
            if time.monotonic() > deadline:
                raise RankFailed(f"rank {owner} did not reach the exchange that {waiter} waited in within "
                                 f"{self.timeout:g} s: it hangs or is slower than the time-out", owner, "timed out")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def close(self, failed: bool = False) -> None:
        """Leave the rendezvous: say goodbye (or, for a rank that ``failed``, just hang up, so that the others learn
        it is gone). Rank 0 then serves on until every rank has left, so the others hear the news from the store
        rather than lose it with rank 0."""
        try:
            if not failed:
                self._call(("bye",))
            self._sock.close()
        except (RankFailed, OSError):
            pass
        if self._server is not None:
            self._server.wait_for_goodbyes(self.timeout)
            self._server.shutdown()
            self._server.server_close()


def _send(sock, msg) -> None:
    data = pickle.dumps(msg)
    sock.sendall(len(data).to_bytes(8, "little") + data)


def _recv(sock):
    def exactly(n):
        buf = b""
        while len(buf) < n:
            part = sock.recv(n - len(buf))
            if not part:
                raise EOFError("connection closed")
            buf += part
        return buf

    return pickle.loads(exactly(int.from_bytes(exactly(8), "little")))


def _serve_store(addr: str, port: int, k: int):
    """Start rank 0's store server in a daemon thread; return it."""
    import socketserver
    import threading

    state = {"data": {}, "gone": {}, "bye": set(), "lock": threading.Lock()}

    class Handler(socketserver.BaseRequestHandler):
        def handle(self):
            rank = None
            try:
                while True:
                    msg = _recv(self.request)
                    with state["lock"]:
                        if msg[0] == "hello":
                            rank = msg[1]
                            reply = ("ok", None)
                        elif msg[0] == "set":
                            state["data"][msg[1]] = msg[2]
                            reply = ("ok", None)
                        elif msg[0] == "get":
                            if msg[1] in state["data"]:
                                reply = ("value", state["data"][msg[1]])
                            elif msg[2] in state["gone"]:
                                reply = ("gone", state["gone"][msg[2]])
                            else:
                                reply = ("missing", None)
                        elif msg[0] == "bye":
                            state["bye"].add(rank)
                            reply = ("ok", None)
                        else:
                            reply = ("error", f"unknown request {msg[0]!r}")
                    _send(self.request, reply)
            except (OSError, EOFError):
                pass
            finally:
                with state["lock"]:
                    if rank is not None and rank not in state["bye"]:
                        state["gone"][rank] = "it exited, failed or was killed"

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

        def wait_for_goodbyes(self, timeout: float) -> None:
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                with state["lock"]:
                    if len(state["bye"] | set(state["gone"])) >= k:
                        return
                time.sleep(0.01)

    try:
        server = Server((addr, port), Handler)
    except OSError as exc:
        raise runtime.CourseError(f"rank 0 could not serve the rendezvous at {addr}:{port} ({exc}): is MASTER_PORT "
                                  "taken by another job?") from None
    threading.Thread(target=server.serve_forever, name="gpucourse-store", daemon=True).start()
    return server


class _TorchStore:
    """torchrun's own store (its agent serves a TCPStore at MASTER_ADDR:MASTER_PORT): every rank a client."""

    def __init__(self, job: Job, timeout: float):
        import datetime

        from torch.distributed import TCPStore

        self.job, self.timeout = job, timeout
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        self._store = TCPStore(job.addr, job.port, job.k, is_master=(job.rank == 0 and not agent),
                               timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str, timeout: float, *, owner: int, waiter: str) -> bytes:
        import datetime

        try:
            self._store.wait([key], datetime.timedelta(seconds=max(timeout, 0.001)))
        except Exception:  # torch raises DistStoreError (a RuntimeError) on a time-out
            raise RankFailed(f"rank {owner} did not reach the exchange that {waiter} waited in within {self.timeout:g} s "
                             "(torchrun stops the job when a rank fails; a rank that hangs shows here)", owner,
                             "timed out") from None
        return self._store.get(key)

    def close(self, failed: bool = False) -> None:
        pass


class _MpiGroup(Group):
    """A Group over MPI's COMM_WORLD (mpi4py): each exchange an all-gather, entered through a non-blocking barrier
    polled against the time-out, so a rank that never arrives stops the others with a clear error (MPI_Abort)."""

    def __init__(self, job: Job, timeout: float):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.k, self.local_rank, self.timeout = job.rank, job.k, job.local_rank, timeout
        self.launcher, self._round = "mpi", 0
        if self.comm.Get_size() != job.k or self.comm.Get_rank() != job.rank:
            raise runtime.CourseError(f"MPI says rank {self.comm.Get_rank()} of {self.comm.Get_size()}, the "
                                      f"environment rank {job.rank} of {job.k}: mpi4py and mpirun come from different MPIs")

    def exchange(self, obj) -> list:
        self._round += 1
        req = self.comm.Ibarrier()
        deadline = time.monotonic() + self.timeout
        while not req.Test():
            if time.monotonic() > deadline:
                raise RankFailed(f"not every rank reached exchange #{self._round} within {self.timeout:g} s (rank "
                                 f"{self.rank} waited); a rank hangs or died", None, "timed out")
            time.sleep(0.001)
        return self.comm.allgather(obj)

    def close(self) -> None:
        pass


def from_environment(timeout: float = DEFAULT_TIMEOUT, start_timeout: float = 120.0, env=None) -> Group:
    """This process's Group in a job a cluster's launcher started (``detect``): the same rank, k, local_rank and
    rendezvous a program gets from ``launch``."""
    job = detect(env)
    os.environ.update(CHILD_ENV)
    if job.launcher == "mpi":
        return _MpiGroup(job, timeout)
    if job.launcher == "torchrun":
        return _StoreGroup(job, _TorchStore(job, timeout), timeout)
    return _StoreGroup(job, Store(job, timeout, start_timeout), timeout)


def _which(name: str):
    """A launcher's program: beside this Python first (a virtual environment's bin/), then on PATH."""
    import shutil
    import sys
    from pathlib import Path

    here = Path(sys.executable).with_name(name)
    return str(here) if here.exists() else shutil.which(name)


def available_launchers() -> list:
    """The cluster launchers this machine can start a job with: "torchrun" (PyTorch's) and "mpirun" (with mpi4py)
    where installed, and always "srun's variables" (ranks started one by one with the variables srun sets, which
    needs no Slurm)."""
    out = ["torchrun"] if _which("torchrun") else []
    if _which("mpirun"):
        try:
            import mpi4py  # noqa: F401

            out.append("mpirun")
        except ImportError:
            pass
    return out + ["srun's variables"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_under(launcher: str, k: int, program: str, args, *, timeout: float = 120.0, env: dict | None = None) -> dict:
    """Run ``program`` (MODULE:FUNCTION) as k ranks started by ``launcher`` (one of ``available_launchers``) on this
    machine, through ``python -m gpucourse.ranks``; every rank's result read back. Returns {"command" (as a learner
    would type it), "returncode", "seconds", "results" (per rank, None where a rank left none), "lines" (what the
    ranks said)}. ``env``: variables added for the ranks (a PYTHONPATH entry is put first)."""
    import subprocess
    import sys
    import tempfile

    full = {**os.environ, **CHILD_ENV}
    if env:
        extra = dict(env)
        if "PYTHONPATH" in extra:
            extra["PYTHONPATH"] = os.pathsep.join([extra["PYTHONPATH"]] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        full.update(extra)
    rank_cmd = ["-m", "gpucourse.ranks", program, *map(str, args), "--timeout", str(timeout)]
    with tempfile.TemporaryDirectory() as folder:
        tail = [*rank_cmd, "--out", folder]
        if launcher == "torchrun":
            cmd = [_which("torchrun"), "--nproc-per-node", str(k), "--master-port", str(_free_port()), *tail]
        elif launcher == "mpirun":
            root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
            cmd = [_which("mpirun"), *root, "-n", str(k), *[a for v in CHILD_ENV for a in ("-x", v)],
                   sys.executable, *tail]
        elif launcher == "srun's variables":
            cmd = [sys.executable, *tail]
        else:
            raise runtime.CourseInputError(f"no launcher {launcher!r}; this machine has {', '.join(available_launchers())}")
        start = time.monotonic()
        if launcher == "srun's variables":
            port = str(_free_port())
            procs = [subprocess.Popen(cmd, env={**full, "SLURM_PROCID": str(r), "SLURM_NTASKS": str(k),
                                                "SLURM_LOCALID": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(k)]
            try:
                text = "".join(p.communicate(timeout=timeout + 120)[0] for p in procs)
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            rc = max(p.returncode for p in procs)
        else:
            done = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout + 120)
            rc, text = done.returncode, done.stdout + done.stderr
        seconds = time.monotonic() - start
        results = []
        for r in range(k):
            path = os.path.join(folder, f"rank{r}.pkl")
            results.append(pickle.load(open(path, "rb")) if os.path.exists(path) else None)
    shown = " ".join("python" if c == sys.executable else os.path.basename(c) if c == cmd[0] else c
                     for c in cmd if c != folder and c != "--out")
    if launcher == "srun's variables":
        shown = f"SLURM_PROCID=r SLURM_NTASKS={k} MASTER_ADDR=... MASTER_PORT=... {shown}   (r = 0 .. {k - 1})"
    return {"command": shown, "returncode": rc, "seconds": seconds, "results": results,
            "lines": [ln for ln in text.splitlines() if ln.startswith("rank ")][-2 * k:]}


def under_every_launcher(k: int, program: str, args, want: list, diff, *, env: dict | None = None) -> dict:
    """``program`` run as k ranks under every launcher this machine has (``run_under``), each rank's result set beside
    ``want`` (the course launcher's results, rank by rank) with ``diff(got, want) -> float``:
    {launcher: {"command", "returncode", "seconds", "lines", "ok", "max_abs_diff"}}."""
    out = {}
    for name in available_launchers():
        run = run_under(name, k, program, args, env=env)
        diffs = [float(diff(g, w)) for g, w in zip(run["results"], want) if g is not None]
        out[name] = {**{key: run[key] for key in ("command", "returncode", "seconds", "lines")},
                     "ok": run["returncode"] == 0 and len(diffs) == k,
                     "max_abs_diff": max(diffs) if len(diffs) == k else None}
    return out


def launchers_text(t: dict, what: str) -> str:
    """Lines saying how each launcher's run of ``what`` went (``under_every_launcher``'s result)."""
    lines = [f"{what}, started by each launcher; every rank's result against the course launcher's "
             "(gpucourse.ranks.launch):"]
    for name, v in t.items():
        if isinstance(v, dict) and "command" in v:
            diff = "no result" if v["max_abs_diff"] is None else f"largest difference {v['max_abs_diff']:.1e}"
            lines.append(f"  {name:18} {'ok' if v['ok'] else 'FAILED'} ({diff}; {v['seconds']:.1f} s with start-up)")
            lines.append(f"      $ {v['command']}")
            lines += ["      " + re.sub(r": [\w.]+:\w+ done in", ": done in", ln) for ln in v["lines"]]  # as named above
    from .plots import wrap

    return wrap("\n".join(lines))


def _program(spec: str):
    import importlib

    module, _, name = spec.partition(":")
    if not module or not name:
        raise runtime.CourseInputError(f"name the program as MODULE:FUNCTION, not {spec!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise runtime.CourseInputError(f"cannot find the program {spec}: {exc}") from None


def main(argv=None) -> int:
    """``python -m gpucourse.ranks MODULE:PROGRAM [ARG ...] [--out DIR] [--timeout S]``: one rank of a job started by
    torchrun, srun or mpirun. Each ARG is read as JSON (a number, a list...) or kept as a string; the rank's result
    goes to DIR/rank<r>.pkl, and a line says what it was."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="python -m gpucourse.ranks", description=main.__doc__)
    p.add_argument("program")
    p.add_argument("args", nargs="*")
    p.add_argument("--out", help="write this rank's result to OUT/rank<r>.pkl")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds any wait may take")
    a = p.parse_args(argv)

    def arg(text):
        try:
            return json.loads(text)
        except ValueError:
            return text

    group = None
    try:
        program = _program(a.program)
        group = from_environment(a.timeout)
        t0 = time.monotonic()
        result = program(group, *map(arg, a.args))
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, f"rank{group.rank}.pkl"), "wb") as f:
                pickle.dump(result, f)
        print(f"rank {group.rank} of {group.k} ({group.launcher}, local rank {group.local_rank}): {a.program} done "
              f"in {time.monotonic() - t0:.2f} s", flush=True)
        group.close()
        return 0
    except BaseException as exc:  # noqa: BLE001 — one line naming this rank, then a non-zero exit for the launcher
        who = f"rank {group.rank} of {group.k}" if group is not None else "a rank"
        print(f"{who} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if isinstance(group, _MpiGroup):
            group.comm.Abort(1)  # MPI: stop every rank now rather than leave the others waiting
        if isinstance(group, _StoreGroup):
            group.close(failed=True)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())

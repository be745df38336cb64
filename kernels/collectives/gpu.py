"""Lesson 7 on real GPUs: ``GpuRing``, the course's ring (peer-to-peer copies on one CUDA stream per link, the
buffer split into S chunks, CUDA events so that a link forwards chunk i only once it has received it) for any
k >= 2 GPUs, with a ring all-reduce in two versions: the first, a peer copy into scratch memory and an add per
step, issued step by step; and the default, one kernel per step that reads the previous GPU's chunk over NVLink
and adds it in (kernels/cuda/collectives.cu), recorded once as a CUDA graph and replayed. Its schedule and
options are checked without a GPU. ``Nccl``, the same collectives from NVIDIA's library through
``cupy.cuda.nccl``."""
from __future__ import annotations

import numpy as np

from gpucourse import runtime

from gpucourse import cuda_c
from .specs import chunk_bounds
from .stream_model import push_broadcast


# ====================================================== the ring all-reduce as GPUs run it (no GPU needed)

ALLREDUCE_METHODS = ("pull", "copy-add")
ALLREDUCE_GATHERS = ("copy-engine", "kernel")
SOURCE = "collectives"  # kernels/cuda/collectives.cu: the kernels of method="pull"
REDUCE_KERNELS = {"float16": "ring_reduce_f16", "float32": "ring_reduce_f32", "float64": "ring_reduce_f64"}
STEP_THREADS = 256  # threads a block of a step's kernel
STEP_BLOCKS_PER_SM = 4  # at most this many blocks on every SM
STEP_UNROLL = 4  # 16-byte loads in flight per thread (UNROLL in collectives.cu)


def allreduce_schedule(k: int) -> list:
    """The ring all-reduce as GpuRing.allreduce runs it: 2 (k - 1) steps, each a list of (receiver, sender,
    chunk, phase), one entry for every GPU. In step t GPU r *pulls* chunk c from GPU r - 1: it adds it to its
    own chunk c (reduce-scatter, the first k - 1 steps) or keeps it (all-gather, the last k - 1). The same
    chunks as ring_allreduce_numpy, whose rank r sends what rank r + 1 receives here.

    GPU r's step t waits for one thing besides its own step t - 1: GPU r - 1's step t - 1, which made the chunk
    it pulls final. That is enough: no step writes a chunk that another GPU has still to read (a chain of those
    waits runs from every read to the later write of the same chunk); tests/test_07_collectives.py checks it."""
    if int(k) != k or k < 2:
        raise runtime.CourseInputError(f"a ring needs k >= 2 GPUs, got k = {k}")
    k = int(k)
    steps = []
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(k - 1):
            steps.append([(r, (r - 1) % k, (r - 1 - s if phase == "reduce-scatter" else r - s) % k, phase)
                          for r in range(k)])
    return steps


def allreduce_options(dtype, method: str = "pull", graph: bool | None = None, gather: str = "copy-engine") -> tuple:
    """GpuRing.allreduce's options checked (no GPU needed): returns (method, graph, gather), graph's default
    filled in (True for "pull"; "copy-add" has no graph). Raises CourseInputError for anything else."""
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in REDUCE_KERNELS:
        raise runtime.CourseInputError(f"allreduce sums {', '.join(REDUCE_KERNELS)} buffers, not {name}; convert "
                                       "them first (buf.astype(cupy.float32))")
    if method not in ALLREDUCE_METHODS:
        raise runtime.CourseInputError(f"method must be one of {ALLREDUCE_METHODS}, not {method!r}")
    if gather not in ALLREDUCE_GATHERS:
        raise runtime.CourseInputError(f"gather must be one of {ALLREDUCE_GATHERS}, not {gather!r}")
    if graph is None:
        graph = method == "pull"
    if graph not in (True, False):
        raise runtime.CourseInputError(f"graph is True or False, not {graph!r}")
    if graph and method != "pull":
        raise runtime.CourseInputError("only method='pull' runs as a CUDA graph: 'copy-add' is issued step by step")
    return method, bool(graph), gather


def step_grid(n: int, itemsize: int, sms: int, *, threads: int = STEP_THREADS,
              blocks_per_sm: int = STEP_BLOCKS_PER_SM) -> int:
    """Blocks for one step's kernel over n elements of itemsize bytes: enough for every thread to have
    STEP_UNROLL 16-byte loads to make, at most blocks_per_sm on each of the GPU's sms SMs (the kernel's
    grid-stride loop covers the rest), and at least one."""
    if n < 0 or itemsize < 1 or sms < 1 or threads < 1 or blocks_per_sm < 1:
        raise runtime.CourseInputError("step_grid needs n >= 0 and itemsize, sms, threads, blocks_per_sm >= 1")
    packs = -(-int(n) * int(itemsize) // 16)
    return max(1, min(int(sms) * int(blocks_per_sm), -(-packs // (int(threads) * STEP_UNROLL))))


# ============================================================================== on real GPUs

PEER_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled


def gpu_count() -> int:
    """How many GPUs CuPy sees (0 in CPU mode)."""
    if not runtime.is_gpu():
        return 0
    return runtime.cupy().cuda.runtime.getDeviceCount()


def _devices(devices, at_least: int = 2) -> list:
    n = gpu_count()
    devices = list(range(n)) if devices is None else [int(d) for d in devices]
    if len(devices) < at_least:
        raise runtime.CourseError(f"a ring needs at least {at_least} GPUs; this machine has {n}. "
                                  "The notebook shows the figures recorded on a machine with more.")
    if len(set(devices)) != len(devices) or not all(0 <= d < n for d in devices):
        raise runtime.CourseInputError(f"devices must be distinct GPU numbers below {n}, got {devices}")
    return devices


def enable_peer_access(devices) -> dict:
    """Let every GPU of ``devices`` read and write every other's memory directly (over NVLink or PCIe)
    where the hardware allows it. Returns {(a, b): True if a can reach b directly}."""
    cp = runtime.cupy()
    rt = cp.cuda.runtime
    reach = {}
    for a in devices:
        for b in devices:
            if a == b:
                continue
            reach[(a, b)] = bool(rt.deviceCanAccessPeer(a, b))
            if reach[(a, b)]:
                with cp.cuda.Device(a):
                    try:
                        rt.deviceEnablePeerAccess(b)
                    except rt.CUDARuntimeError as exc:
                        if exc.status != PEER_ALREADY_ENABLED:
                            raise
    return reach


class _Streams:
    """One non-blocking stream per GPU, forked from and joined back into the caller's current stream of the
    first GPU. Timing: CUDA events recorded on that caller's stream (bench.time_gpu) bracket all the work on
    every GPU, because every stream waits for the fork and the caller's stream waits for every stream's end."""

    def __init__(self, devices):
        cp = runtime.cupy()
        self.cp, self.devices = cp, list(devices)
        self.streams = []
        for d in self.devices:
            with cp.cuda.Device(d):
                self.streams.append(cp.cuda.Stream(non_blocking=True))
        self._events: dict = {}

    def event(self, rank: int, i: int):
        """A reusable synchronisation event on GPU ``rank`` (a stream's wait takes the event's state at the
        time it is called, so re-recording it later does not disturb earlier waits)."""
        key = (rank, i)
        if key not in self._events:
            with self.cp.cuda.Device(self.devices[rank]):
                self._events[key] = self.cp.cuda.Event(block=False, disable_timing=True)
        return self._events[key]

    def fork(self) -> None:
        cp = self.cp
        with cp.cuda.Device(self.devices[0]):
            start = self.event(0, -1)
            start.record(cp.cuda.get_current_stream())
        for s in self.streams:
            s.wait_event(start)

    def join(self, events) -> None:
        cp = self.cp
        with cp.cuda.Device(self.devices[0]):
            caller = cp.cuda.get_current_stream()
            for ev in events:
                caller.wait_event(ev)

    def synchronize(self) -> None:
        for d in self.devices:
            self.cp.cuda.Device(d).synchronize()


def _check_buffers(bufs, devices, what: str):
    cp = runtime.cupy()
    if len(bufs) != len(devices):
        raise runtime.CourseInputError(f"{what}: one buffer per GPU ({len(devices)}), got {len(bufs)}")
    for r, (b, d) in enumerate(zip(bufs, devices)):
        if not isinstance(b, cp.ndarray):
            raise runtime.CourseInputError(f"{what}: buffer {r} must be a CuPy array, got {type(b).__name__}")
        if b.device.id != d:
            raise runtime.CourseInputError(f"{what}: buffer {r} must be on GPU {d}, it is on GPU {b.device.id}")
        if not b.flags.c_contiguous or b.dtype != bufs[0].dtype or b.size != bufs[0].size:
            raise runtime.CourseInputError(f"{what}: buffers must be contiguous, of one dtype and one size")


class GpuRing:
    """The course's ring over GPUs devices[0] -> devices[1] -> ... -> devices[k-1] (k >= 2).

    ``broadcast(bufs, S)``: rank 0's buffer to every rank, split into S chunks. Link j (GPU j -> GPU j+1)
    has its own stream on GPU j; for each chunk i it waits for the event that link j - 1 recorded after
    delivering chunk i to GPU j, copies chunk i with cudaMemcpyPeerAsync, and records its own event. A
    stream runs its copies in order, so while link j forwards chunk i, link j - 1 already delivers chunk
    i + 1: the pipeline of the cost model. ``allreduce(bufs)``: the ring all-reduce (sum, in place), by
    default one kernel per step that reads the previous GPU's chunk over the link, replayed as a CUDA graph;
    ``allreduce(bufs, method="copy-add")``: the first version, a peer copy and an add per step.
    Both return at once; the caller's current stream (on devices[0]) waits for the whole operation."""

    GRAPHS_KEPT = 64  # CUDA graphs of allreduce kept, one per set of buffers (the oldest goes first)

    def __init__(self, devices=None, edits: dict | None = None):
        """``edits``: {region of kernels/cuda/collectives.cu: text} compiled in place of those regions (a notebook
        cell's version of ``ring_step``)."""
        self.devices = _devices(devices)
        self.edits = dict(edits or {})
        self.k = len(self.devices)
        self.peer = enable_peer_access(self.devices)
        self.s = _Streams(self.devices)
        self.streams = self.s.streams  # streams[r]: a non-blocking stream on GPU devices[r]
        self._scratch: dict = {}
        self.sms = [self.s.cp.cuda.Device(d).attributes["MultiProcessorCount"] for d in self.devices]
        self._kernels: dict = {}  # (rank, kernel name) -> the kernel, loaded on that GPU
        self._graphs: dict = {}  # (buffer addresses, size, dtype, gather) -> cupy.cuda.Graph
        self._capture_streams = None  # a _Streams of its own for capturing graphs
        self.graph_launches = 0  # how many allreduce calls replayed a graph

    # The pieces a ring schedule is written with (SimRing has the same, on a CPU model of streams):
    def event(self, rank: int, i: int):
        """Event number i of GPU ``rank`` (record it only on that GPU's stream)."""
        return self.s.event(rank, i)

    def begin(self) -> None:
        """Make every stream wait for the work already queued on the caller's current stream (a fork)."""
        self.s.fork()

    def end(self, events) -> None:
        """Make the caller's current stream wait for ``events``, the last event of every stream that worked
        (a join)."""
        self.s.join(events)

    def copy(self, bufs, src: int, dst: int, lo: int, hi: int, stream) -> None:
        """Queue the copy of elements lo .. hi - 1 of bufs[src] into bufs[dst] (cudaMemcpyPeerAsync) on
        ``stream``, a stream of GPU src or of GPU dst."""
        item = bufs[0].itemsize
        self.s.cp.cuda.runtime.memcpyPeerAsync(bufs[dst].data.ptr + lo * item, self.devices[dst],
                                               bufs[src].data.ptr + lo * item, self.devices[src],
                                               (hi - lo) * item, stream.ptr)

    def broadcast(self, bufs, S: int = 1) -> None:
        _check_buffers(bufs, self.devices, "broadcast")
        n = bufs[0].size
        if int(S) != S or not 1 <= S <= max(1, n):
            raise runtime.CourseInputError(f"S must be a whole number from 1 to the element count {n}, got {S}")
        push_broadcast(self, bufs, S)

    def _scratch_for(self, rank: int, dtype, n: int):
        key = (rank, np.dtype(dtype).str, n)
        if key not in self._scratch:
            with self.s.cp.cuda.Device(self.devices[rank]):
                self._scratch[key] = self.s.cp.empty(n, dtype=dtype)
        return self._scratch[key]

    def allreduce(self, bufs, method: str = "pull", *, graph: bool | None = None,
                  gather: str = "copy-engine") -> None:
        """Sum in place: afterwards every GPU's buffer holds the sum of all k (float16, float32 or float64).
        Reduce-scatter, then all-gather, in the steps of allreduce_schedule: in each, GPU r pulls one chunk from
        GPU r - 1, after waiting for the event of GPU r - 1's previous step, which made that chunk final.

        method="pull" (the default): a reduce-scatter step is one kernel on GPU r that reads GPU r - 1's chunk
        through its address (peer access: the loads cross NVLink) and adds it into GPU r's own; an all-gather
        step copies the finished chunk: with gather="copy-engine" a cudaMemcpyAsync (a copy engine, as
        cudaMemcpyPeerAsync, but one a CUDA graph can hold), with gather="kernel" a copy kernel.
        graph=True (the default of "pull"): the first call with these buffers queues the steps from Python and
        records them as one CUDA graph (``_capture``); later calls on the same buffers (same addresses, size,
        dtype) replay it with one launch, with no work for the host per step.
        method="copy-add": the first version, step by step from Python: a cudaMemcpyPeerAsync of the chunk
        into scratch memory on GPU r, then an add (cp.add) on the same stream.

        Like every collective here it starts after the work queued on the caller's current stream of devices[0];
        data written on the other GPUs must be there already (synchronise those GPUs, or their streams, first)."""
        cp = self.s.cp
        _check_buffers(bufs, self.devices, "allreduce")
        method, graph, gather = allreduce_options(bufs[0].dtype, method, graph, gather)
        if bufs[0].size == 0:
            return
        if method == "copy-add":
            self._allreduce_copy_add(bufs)
            return
        self._need_peer_reads()
        if not graph:
            self._allreduce_pull(bufs, self.s, gather)
            return
        key = (tuple(b.data.ptr for b in bufs), bufs[0].size, bufs[0].dtype.str, gather)
        recorded = self._graphs.get(key)
        if recorded is None:
            self._allreduce_pull(bufs, self.s, gather)  # this call's sum; it also loads the kernels on every GPU
            self._graphs[key] = self._capture(bufs, gather)
            while len(self._graphs) > self.GRAPHS_KEPT:
                self._graphs.pop(next(iter(self._graphs)))
            return
        with cp.cuda.Device(self.devices[0]):
            recorded.launch(cp.cuda.get_current_stream())  # ordered after earlier work on the caller's stream
        self.graph_launches += 1

    def _queue_schedule(self, s: "_Streams", n: int, work) -> None:
        """Queue the steps of allreduce_schedule on the streams of ``s``, for both versions: for each step and
        GPU r, wait for the event of GPU r - 1's previous step (which made the chunk GPU r pulls final), then
        ``work(r, src, lo, hi, phase, stream)`` queues that step's copy or kernel on GPU r's stream, with GPU r
        current, and an event marks its end. The whole runs after the caller's stream (fork) and the caller's
        stream waits for it (join)."""
        cp, k = s.cp, self.k
        s.fork()
        last = [None] * k
        for t, step in enumerate(allreduce_schedule(k)):
            done = []
            for r, src, c, phase in step:
                lo, hi = chunk_bounds(n, k, c)
                stream = s.streams[r]
                with cp.cuda.Device(self.devices[r]):
                    if last[src] is not None:
                        stream.wait_event(last[src])
                    work(r, src, lo, hi, phase, stream)
                    ev = s.event(r, t)
                    ev.record(stream)
                done.append(ev)
            last = done
        s.join(last)

    def _allreduce_copy_add(self, bufs) -> None:
        """The first version: each step a peer copy into scratch memory, then an add, issued step by step."""
        cp, k = self.s.cp, self.k
        n, item = bufs[0].size, bufs[0].itemsize
        flat = [b.reshape(-1) for b in bufs]
        scratch = [self._scratch_for(r, bufs[0].dtype, chunk_bounds(n, k, 0)[1]) for r in range(k)]

        def step(r, src, lo, hi, phase, stream):
            into = scratch[r] if phase == "reduce-scatter" else flat[r][lo:hi]
            cp.cuda.runtime.memcpyPeerAsync(into.data.ptr, self.devices[r], flat[src].data.ptr + lo * item,
                                            self.devices[src], (hi - lo) * item, stream.ptr)
            if phase == "reduce-scatter" and hi > lo:
                with stream:
                    cp.add(flat[r][lo:hi], scratch[r][:hi - lo], out=flat[r][lo:hi])

        self._queue_schedule(self.s, n, step)

    def _allreduce_pull(self, bufs, s: "_Streams", gather: str) -> None:
        """Queue the pull all-reduce on the streams of ``s``: per step and GPU one kernel (or one copy) that reads
        the chunk straight from GPU r - 1's buffer. Nothing here waits for the GPU, so a CUDA graph can record it."""
        cp, k = s.cp, self.k
        n, item = bufs[0].size, bufs[0].itemsize
        ptr = [b.data.ptr for b in bufs]
        add = [self._kernel(r, REDUCE_KERNELS[bufs[0].dtype.name]) for r in range(k)]
        copy = [self._kernel(r, "ring_copy") for r in range(k)] if gather == "kernel" else None

        def step(r, src, lo, hi, phase, stream):
            mine, peer, count = ptr[r] + lo * item, ptr[src] + lo * item, hi - lo
            if count and phase == "reduce-scatter":  # mine += peer, the peer's chunk read over the link
                add[r]((step_grid(count, item, self.sms[r]),), (STEP_THREADS,),
                       (np.uint64(mine), np.uint64(peer), np.int64(count)), stream=stream)
            elif count and gather == "kernel":  # mine = peer, bytes, by the SMs
                copy[r]((step_grid(count * item, 1, self.sms[r]),), (STEP_THREADS,),
                        (np.uint64(mine), np.uint64(peer), np.int64(count * item)), stream=stream)
            elif count:  # mine = peer, by a copy engine
                cp.cuda.runtime.memcpyAsync(mine, peer, count * item, cp.cuda.runtime.memcpyDefault, stream.ptr)

        self._queue_schedule(s, n, step)

    def _capture(self, bufs, gather: str):
        """The pull all-reduce of these buffers recorded as one CUDA graph (cupy.cuda.Graph), nothing run.

        Stream capture records what is queued on a capturing stream instead of running it. Here the capturing
        stream is a new one on devices[0]; ``fork`` records an event on it that every GPU's stream waits for,
        which draws those streams (on their own GPUs) into the same capture, and ``join`` brings them back. So
        the graph holds every GPU's kernels and copies, with the events' waits as its edges, and one
        ``graph.launch(stream)`` replays all of them after the work already on that stream."""
        cp = self.s.cp
        if self._capture_streams is None:
            self._capture_streams = _Streams(self.devices)
        with cp.cuda.Device(self.devices[0]):
            origin = cp.cuda.Stream(non_blocking=True)
            with origin:
                origin.begin_capture()
                try:
                    self._allreduce_pull(bufs, self._capture_streams, gather)
                except Exception as exc:
                    try:
                        origin.end_capture()  # leave the stream usable; the first error is the one to report
                    except Exception:
                        pass
                    raise runtime.CourseError(f"the all-reduce could not be recorded as a CUDA graph ({exc}); "
                                              "graph=False runs the same steps without one") from exc
                return origin.end_capture()

    def _kernel(self, rank: int, name: str):
        """The kernel ``name`` of kernels/cuda/collectives.cu, loaded on GPU devices[rank]."""
        key = (rank, name)
        if key not in self._kernels:
            with self.s.cp.cuda.Device(self.devices[rank]):
                self._kernels[key] = cuda_c.function(SOURCE, name, self.edits)
        return self._kernels[key]

    def _need_peer_reads(self) -> None:
        for r in range(self.k):
            a, b = self.devices[r], self.devices[(r - 1) % self.k]
            if not self.peer.get((a, b)):
                raise runtime.CourseError(f"GPU {a} cannot read GPU {b}'s memory directly (no peer access between "
                                          "them), which method='pull' needs; use method='copy-add' on this machine")

    def synchronize(self) -> None:
        self.s.synchronize()


class Nccl:
    """NVIDIA's NCCL through cupy.cuda.nccl: one communicator per GPU in this one process
    (NcclCommunicator.initAll), the calls of all GPUs grouped between groupStart and groupEnd so that NCCL
    launches them together. Same stream discipline as GpuRing. NCCL needs GPUs: CPU mode has none."""

    def __init__(self, devices=None):
        runtime.require_gpu("NCCL")
        from cupy.cuda import nccl

        self.nccl = nccl
        self.devices = _devices(devices)
        self.k = len(self.devices)
        self.comms = nccl.NcclCommunicator.initAll(self.devices)
        self.s = _Streams(self.devices)
        self.version = nccl.get_version()

    def _dtype(self, dtype):
        table = {"float32": self.nccl.NCCL_FLOAT32, "float64": self.nccl.NCCL_FLOAT64,
                 "float16": self.nccl.NCCL_FLOAT16, "int32": self.nccl.NCCL_INT32, "uint8": self.nccl.NCCL_UINT8}
        try:
            return table[np.dtype(dtype).name]
        except KeyError:
            raise runtime.CourseInputError(f"no NCCL type for {np.dtype(dtype)}; use one of {list(table)}") from None

    def _grouped(self, bufs, call, what: str) -> None:
        cp, s = self.s.cp, self.s
        _check_buffers(bufs, self.devices, what)
        s.fork()
        self.nccl.groupStart()
        for r, (b, comm) in enumerate(zip(bufs, self.comms)):
            with cp.cuda.Device(self.devices[r]):
                call(comm, b, s.streams[r].ptr)
        self.nccl.groupEnd()
        events = []
        for r in range(self.k):
            with cp.cuda.Device(self.devices[r]):
                ev = s.event(r, -2)
                ev.record(s.streams[r])
                events.append(ev)
        s.join(events)

    def broadcast(self, bufs, root: int = 0) -> None:
        dt = self._dtype(bufs[0].dtype)
        self._grouped(bufs, lambda comm, b, st: comm.broadcast(b.data.ptr, b.data.ptr, b.size, dt, root, st),
                      "broadcast")

    def allreduce(self, bufs) -> None:
        dt = self._dtype(bufs[0].dtype)
        self._grouped(bufs, lambda comm, b, st: comm.allReduce(b.data.ptr, b.data.ptr, b.size, dt,
                                                               self.nccl.NCCL_SUM, st), "allreduce")

    def synchronize(self) -> None:
        self.s.synchronize()


def peer_copy(dst, src, stream=None) -> None:
    """One cudaMemcpyPeerAsync of a whole buffer between GPUs, on the caller's current stream: the ceiling
    of one link."""
    cp = runtime.cupy()
    stream = stream or cp.cuda.get_current_stream()
    cp.cuda.runtime.memcpyPeerAsync(dst.data.ptr, dst.device.id, src.data.ptr, src.device.id, src.nbytes, stream.ptr)

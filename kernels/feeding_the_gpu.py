"""Lesson 8 — feeding the GPU: copies and kernels overlapped on streams, many small launches, CUDA graphs,
unified memory.

The vector multiply of lesson 1 again, but with the data starting and ending in host memory: split into
``chunks`` pieces, chunk i goes to stream i % streams, and on each stream the host-to-device copies, the
kernel and the device-to-host copy of a chunk run in order while other streams' stages run beside them
(``Pipeline``). With pinned host memory the GPU's copy engines move data in both directions while its SMs
compute, so the whole costs little more than the longer copy direction alone. CUDA events around every
stage of every chunk give the timeline the notebook draws as a Gantt chart.

In CPU mode the simulator runs streams one after another and has no event timing: the pipeline is checked
for its results only (``Run.timeline`` is None).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpucourse import runtime

cuda = runtime.cuda()

THREADS = 256
STAGES = ("h2d", "kernel", "d2h")


def multiply_spec(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """What the pipeline computes: out = a * b, elementwise."""
    return a * b


@cuda.jit
def multiply_kernel(a, b, out):
    """out[i] = a[i] * b[i] in a grid-stride loop (any grid covers any chunk)."""
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = a[i] * b[i]


@cuda.jit
def add_one(x):
    """x[i] += 1: a kernel so small that launching it costs more than running it."""
    i = cuda.grid(1)
    if i < x.size:
        x[i] += 1.0


NUMBA_KERNELS = {"multiply_kernel": "void(float32[::1], float32[::1], float32[::1])",
                 "add_one": "void(float32[::1])"}


# ------------------------------------------------------------------------------------------- input

def check_pipeline(n: int, chunks: int, streams: int) -> int:
    """Refuse a split that cannot work; return the chunk size n // chunks."""
    for name, v in (("n", n), ("chunks", chunks), ("streams", streams)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise runtime.CourseInputError(f"{name} must be an int, got {v!r}")
    if streams < 1:
        raise runtime.CourseInputError(f"streams must be at least 1, got {streams}")
    if chunks < 1:
        raise runtime.CourseInputError(f"chunks must be at least 1, got {chunks}")
    if n < 1:
        raise runtime.CourseInputError(f"the vectors must hold at least one element, got n = {n}")
    if n % chunks:
        raise runtime.CourseInputError(
            f"{chunks} chunks do not divide n = {n} (remainder {n % chunks}); choose a divisor of n, "
            f"e.g. {max(d for d in range(1, min(chunks, n) + 1) if n % d == 0)}")
    return n // chunks


def chunk_bounds(n: int, chunks: int, i: int) -> tuple[int, int]:
    """[lo, hi) of chunk i of ``chunks`` equal chunks of n elements."""
    size = check_pipeline(n, chunks, 1)
    if not 0 <= i < chunks:
        raise runtime.CourseInputError(f"chunk {i} does not exist: there are {chunks} (0 .. {chunks - 1})")
    return i * size, (i + 1) * size


def check_host(a, b, out) -> None:
    """Refuse anything but three contiguous 1-D float32 NumPy arrays of one size."""
    for name, x in (("a", a), ("b", b), ("out", out)):
        if runtime.is_device_array(x):
            raise runtime.CourseInputError(f"{name} must be a host (NumPy) array: the pipeline copies it itself")
        if not isinstance(x, np.ndarray) or x.ndim != 1 or x.dtype != np.float32 or not x.flags.c_contiguous:
            raise runtime.CourseInputError(f"{name} must be a contiguous 1-D float32 NumPy array")
    if not a.size == b.size == out.size:
        raise runtime.CourseInputError(f"a, b and out must have the same size, got {a.size}, {b.size}, {out.size}")


def pinned(n: int, dtype=np.float32) -> np.ndarray:
    """A host array in page-locked ("pinned") memory: the copy engines read and write it directly, so copies
    from it are asynchronous and run at full PCIe / NVLink-C2C speed. (Pageable memory is staged through a
    driver buffer, and a copy from it blocks the host.)"""
    return cuda.pinned_array(n, dtype=dtype)


# ---------------------------------------------------------------------------------------- the pipeline

@dataclass
class Run:
    """One pipelined multiply: its total time (CUDA events, ms) and per chunk the start and end of each stage
    (ms from the start), or None in CPU mode."""

    total_ms: float | None
    timeline: list | None  # [{"chunk", "stream", "h2d": [t0, t1], "kernel": [...], "d2h": [...]}]


class Pipeline:
    """Device buffers and streams for ``out = a * b`` over n elements in ``chunks`` chunks on ``streams``
    streams. Each stream owns one set of three chunk buffers, reused by every chunk it runs: the stream's
    own order keeps chunk i + streams from overwriting chunk i's buffers before chunk i's copy back."""

    def __init__(self, n: int, *, chunks: int, streams: int, threads: int = THREADS, blocks: int | None = None):
        self.n, self.chunks, self.streams = n, chunks, streams
        self.size = check_pipeline(n, chunks, streams)
        slots = min(streams, chunks)
        runtime.check_fits(3 * slots * self.size * 4, f"{slots} streams' buffers of 3 x {self.size} float32")
        self.threads = threads
        sms = runtime.get().device.get("sms", 1)
        self.blocks = blocks or max(1, min(-(-self.size // threads), 8 * sms))
        self.stream_list = [cuda.stream() for _ in range(slots)]
        self.buffers = [tuple(cuda.device_array(self.size, np.float32) for _ in range(3)) for _ in range(slots)]

    def run(self, a, b, out, *, timeline: bool = False) -> Run:
        """out = a * b (host arrays, pinned for overlap), chunk by chunk; synchronises before returning."""
        check_host(a, b, out)
        if a.size != self.n:
            raise runtime.CourseInputError(f"this pipeline was made for n = {self.n}, got {a.size} elements")
        timed = timeline and runtime.is_gpu()
        events = []
        if timed:
            start = cuda.event()
            cuda.synchronize()
            start.record(cuda.default_stream())  # a blocking stream: every other stream's work comes after it
        for i in range(self.chunks):
            slot = i % len(self.stream_list)
            s = self.stream_list[slot]
            da, db, dout = self.buffers[slot]
            lo, hi = i * self.size, (i + 1) * self.size
            ev = [cuda.event() for _ in range(4)] if timed else None
            if timed:
                ev[0].record(s)
            da.copy_to_device(a[lo:hi], stream=s)
            db.copy_to_device(b[lo:hi], stream=s)
            if timed:
                ev[1].record(s)
            multiply_kernel[self.blocks, self.threads, s](da, db, dout)
            if timed:
                ev[2].record(s)
            dout.copy_to_host(out[lo:hi], stream=s)
            if timed:
                ev[3].record(s)
                events.append((i, slot, ev))
        for s in self.stream_list:
            s.synchronize()
        if not timed:
            return Run(None, None)
        rows = []
        for i, slot, ev in events:
            t = [cuda.event_elapsed_time(start, e) for e in ev]
            rows.append({"chunk": i, "stream": slot, "h2d": [t[0], t[1]], "kernel": [t[1], t[2]], "d2h": [t[2], t[3]]})
        return Run(max(r["d2h"][1] for r in rows), rows)


def pipelined_multiply(a, b, out, *, chunks: int, streams: int) -> None:
    """out = a * b through a fresh Pipeline (allocates its buffers: the reference of Task 8.1)."""
    check_host(a, b, out)
    Pipeline(a.size, chunks=chunks, streams=streams).run(a, b, out)


def overlap_fraction(timeline: list) -> float:
    """The fraction of a timeline's span during which at least two stages run at once (0: fully serial)."""
    spans = [tuple(r[s]) for r in timeline for s in STAGES]
    edges = sorted({t for span in spans for t in span})
    total = edges[-1] - edges[0]
    if total <= 0:
        return 0.0
    busy2 = 0.0
    for t0, t1 in zip(edges, edges[1:]):
        mid = (t0 + t1) / 2
        if sum(lo <= mid < hi for lo, hi in spans) >= 2:
            busy2 += t1 - t0
    return busy2 / total


def engine_timeline(timeline: list) -> list:
    """The timeline as the copy engines ran it. The event before a copy fires when its stream reaches the copy,
    not when a copy engine takes it up, so with several streams a copy's bar from the events includes the time
    it waited behind other streams' copies in the same direction. Copies in one direction share one engine (and
    one link), so the work of each starts no earlier than the end of the one that finished before it: this
    returns a copy of the timeline with each copy stage starting there, and the time it waited under
    ``"<stage>_queued": [start, end]``. Kernels keep their events."""
    out = [dict(r) for r in timeline]
    for stage in ("h2d", "d2h"):
        done = float("-inf")
        for r in sorted(out, key=lambda r: r[stage][1]):
            t0, t1 = r[stage]
            begin = min(max(t0, done), t1)
            if begin > t0:
                r[stage + "_queued"] = [t0, begin]
            r[stage] = [begin, t1]
            done = max(done, t1)
    return out


# ------------------------------------------------------------------------------- many small kernels

def small_launches(x, *, launches: int, streams: int = 1) -> None:
    """``launches`` tiny add_one kernels over the device array x, round-robin over ``streams`` streams
    (each stream gets its own slice of x, so streams never touch the same elements)."""
    if streams < 1:
        raise runtime.CourseInputError(f"streams must be at least 1, got {streams}")
    if x.size % streams:
        raise runtime.CourseInputError(f"{streams} streams do not divide {x.size} elements")
    part = x.size // streams
    ss = [cuda.stream() for _ in range(streams)] if streams > 1 else [cuda.default_stream()]
    views = [x[k * part:(k + 1) * part] for k in range(streams)]
    blocks = -(-part // THREADS)
    for i in range(launches):
        k = i % streams
        add_one[blocks, THREADS, ss[k]](views[k])
    for s in ss:
        s.synchronize()


SMALL_SOURCE = r"""
extern "C" __global__ void add_one(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
"""


class SmallKernels:
    """The same tiny kernel launched ``launches`` times, three ways, through CuPy (GPU only): one after another
    on one stream, round-robin over several streams, and replayed from one CUDA graph."""

    def __init__(self, n: int = 1024, launches: int = 1000, streams: int = 4):
        runtime.require_gpu("launching kernels on streams")
        cp = runtime.cupy()
        if streams < 1 or launches < 1 or n % streams:
            raise runtime.CourseInputError("streams and launches must be at least 1, and streams must divide n")
        self.cp, self.n, self.launches, self.nstreams = cp, n, launches, streams
        self.kernel = cp.RawKernel(SMALL_SOURCE, "add_one")
        self.x = cp.zeros(n, cp.float32)
        self.kernel((1,), (1,), (self.x, np.int32(0)))  # compiles and loads it now: nothing may load during capture
        self.streams = [cp.cuda.Stream(non_blocking=False) for _ in range(streams)]
        self.graph = None

    def _launch(self, x, stream):
        self.kernel((-(-x.size // THREADS),), (THREADS,), (x, np.int32(x.size)), stream=stream)

    def one_stream(self):
        s = self.cp.cuda.get_current_stream()
        for _ in range(self.launches):
            self._launch(self.x, s)

    def many_streams(self):
        part = self.n // self.nstreams
        views = [self.x[k * part:(k + 1) * part] for k in range(self.nstreams)]
        for i in range(self.launches):
            k = i % self.nstreams
            self._launch(views[k], self.streams[k])

    def capture(self):
        """Record the one-stream sequence once as a CUDA graph."""
        cp = self.cp
        cp.cuda.Device().synchronize()
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            s.begin_capture()
            try:
                for _ in range(self.launches):
                    self._launch(self.x, s)
            finally:
                self.graph = s.end_capture()
        s.synchronize()

    def graph_replay(self):
        if self.graph is None:
            self.capture()
        self.graph.launch(self.cp.cuda.get_current_stream())

    def value(self) -> float:
        return float(self.x[0].get())


# ------------------------------------------------------------------------------------ unified memory

def managed_array(n: int):
    """A CuPy float32 array of n elements in managed (unified) memory: one address valid on the host and the
    GPU, its pages migrating to whichever touches them."""
    runtime.require_gpu("unified (managed) memory")
    cp = runtime.cupy()
    runtime.check_fits(4 * n, f"a managed array of {n} float32")
    mem = cp.cuda.memory.ManagedMemory(4 * n)
    return cp.ndarray((n,), cp.float32, cp.cuda.memory.MemoryPointer(mem, 0))


def host_view(x) -> np.ndarray:
    """A NumPy view of a managed CuPy array: the host reads and writes the same pages (no copy)."""
    import ctypes

    buf = (ctypes.c_float * x.size).from_address(x.data.ptr)
    return np.ctypeslib.as_array(buf)


def prefetch(x, device: int | None = None, stream=None) -> None:
    """Migrate a managed array's pages to the GPU ahead of use (cudaMemPrefetchAsync)."""
    cp = runtime.cupy()
    stream = stream or cp.cuda.get_current_stream()
    x.data.mem.prefetch(stream)

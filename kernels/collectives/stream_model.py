"""Lesson 7: a ring schedule written once for real GPUs and for a CPU model of them. ``push_broadcast`` queues the
pipelined ring broadcast as stream work (waits, copies, events) on a GpuRing or a SimRing; ``SimRing`` runs such a
schedule on a model of CUDA streams and events with links of a given bandwidth and latency, and says when a
copy read data that had not arrived (``simulate_gpu_broadcast``)."""
from __future__ import annotations

import numpy as np

from gpucourse import runtime

from .specs import chunk_bounds


def push_broadcast(ring, bufs, S: int) -> None:
    """The pipelined ring broadcast from GPU 0 as a schedule of stream work, for a GpuRing or a SimRing.
    Link j (GPU j -> GPU j + 1) runs on GPU j's stream: for each chunk i it waits for the event GPU j - 1's
    link recorded when chunk i reached GPU j, queues the copy, and records its own event."""
    n = len(bufs[0])
    ring.begin()
    for i in range(S):
        lo, hi = chunk_bounds(n, S, i)
        for j in range(ring.k - 1):
            stream = ring.streams[j]
            if j > 0:
                stream.wait_event(ring.event(j - 1, i))  # GPU j has received chunk i
            ring.copy(bufs, j, j + 1, lo, hi, stream)
            ring.event(j, i).record(stream)  # link j has delivered chunk i
    ring.end([ring.event(j, S - 1) for j in range(ring.k - 1)])


def simulate_gpu_broadcast(schedule, k: int, S: int, *, nbytes: int, bandwidth: float, latency: float = 0.0,
                           seed: int = 0):
    """Run ``schedule(ring, bufs, S)`` (push_broadcast, or one of yours) on a SimRing of k GPUs: GPU 0's
    float32 buffer random, the others NaN. Returns (seconds, ring); raises CourseError if a GPU ends with
    other data."""
    root = np.random.default_rng(seed).random(int(nbytes) // 4, dtype=np.float32)
    bufs = [root.copy()] + [np.full_like(root, np.nan) for _ in range(k - 1)]
    ring = SimRing(k, bandwidth=bandwidth, latency=latency)
    schedule(ring, bufs, S)
    seconds = ring.finish(bufs)
    for r, b in enumerate(bufs):
        bad = int(np.count_nonzero(~(b == root)))
        if bad:
            raise runtime.CourseError(f"k={k}, S={S}: GPU {r} ends with {bad} of {b.size} elements unlike GPU 0's "
                                      "(a copy that started before its data had arrived reads stale memory)")
    return seconds, ring


class _SimStream:
    def __init__(self, rank: int):
        self.rank, self.t = rank, 0.0

    def wait_event(self, event) -> None:
        if not isinstance(event, _SimEvent):
            raise runtime.CourseInputError(f"wait_event takes an event of ring.event(...), not {type(event).__name__}")
        self.t = max(self.t, event.t)  # an event never recorded is complete: waiting on it does nothing (as in CUDA)


class _SimEvent:
    def __init__(self, rank: int):
        self.rank, self.t, self.recorded = rank, 0.0, False

    def record(self, stream) -> None:
        if not isinstance(stream, _SimStream):
            raise runtime.CourseInputError(f"record takes a stream of ring.streams, not {type(stream).__name__}")
        if stream.rank != self.rank:
            raise runtime.CourseInputError(f"an event of GPU {self.rank} cannot be recorded on GPU {stream.rank}'s "
                                           "stream (CUDA refuses it: cudaErrorInvalidResourceHandle)")
        self.t, self.recorded = stream.t, True


class SimRing:
    """A CPU model of GpuRing's streams, events and peer copies, for writing and checking ring schedules
    without GPUs: the same ``k``, ``streams``, ``event(rank, i)``, ``begin()``, ``end(events)`` and
    ``copy(bufs, src, dst, lo, hi, stream)``, on NumPy buffers.

    Every stream runs its work in the order it was queued; a copy starts when its stream has finished what
    came before it and the link src -> dst is free, and takes latency + bytes / bandwidth; ``record`` marks
    the point its stream has reached, ``wait_event`` holds a stream until then. ``finish(bufs)`` then carries
    out the copies in the order of time, each reading its source when it starts and writing its destination
    when it ends, so a copy that starts before its data has arrived copies stale data, as on a GPU. It
    returns the time at which the caller's stream, after ``end``, has everything."""

    def __init__(self, k: int, *, bandwidth: float, latency: float = 0.0):
        if int(k) != k or k < 2:
            raise runtime.CourseInputError(f"a ring needs k >= 2 GPUs, got k = {k}")
        self.k, self.devices = int(k), list(range(int(k)))
        self.bandwidth, self.latency = float(bandwidth), float(latency)
        self.streams = [_SimStream(r) for r in range(self.k)]
        self._events: dict = {}
        self._link_free: dict = {}
        self.ops: list = []  # (start, end, src, dst, lo, hi, stream rank)
        self.ended: float | None = None

    def event(self, rank: int, i: int):
        if not 0 <= rank < self.k:
            raise runtime.CourseInputError(f"no GPU {rank} in a ring of {self.k}")
        return self._events.setdefault((rank, i), _SimEvent(rank))

    def begin(self) -> None:
        pass  # the caller's stream has no earlier work in the model

    def end(self, events) -> None:
        events = list(events)
        if not all(isinstance(e, _SimEvent) for e in events):
            raise runtime.CourseInputError("end takes a list of events of ring.event(...)")
        self.ended = max([e.t for e in events], default=0.0)

    def copy(self, bufs, src: int, dst: int, lo: int, hi: int, stream) -> None:
        if not isinstance(stream, _SimStream):
            raise runtime.CourseInputError("copy needs a stream of ring.streams")
        if src == dst or stream.rank not in (src, dst):
            raise runtime.CourseInputError(f"a copy from GPU {src} to GPU {dst} runs on a stream of GPU {src} or "
                                           f"{dst}, not of GPU {stream.rank}")
        if not 0 <= lo <= hi <= len(bufs[src]):
            raise runtime.CourseInputError(f"elements {lo} .. {hi} are outside the buffer of {len(bufs[src])}")
        nbytes = (hi - lo) * bufs[0].itemsize
        start = max(stream.t, self._link_free.get((src, dst), 0.0))
        end = start + self.latency + nbytes / self.bandwidth
        self._link_free[(src, dst)] = stream.t = end
        self.ops.append((start, end, src, dst, lo, hi, stream.rank))

    def finish(self, bufs) -> float:
        """Carry out the queued copies in time order; the time the caller's stream sees after ``end`` (raises
        CourseError if some stream works on after the events passed to ``end``)."""
        timeline = []
        for n, op in enumerate(self.ops):
            timeline += [(op[0], 1, n), (op[1], 0, n)]  # at equal times a copy that ends lands before one starts
        taken = {}
        for _, starts, n in sorted(timeline):
            _, _, src, dst, lo, hi, _ = self.ops[n]
            if starts:
                taken[n] = np.array(bufs[src][lo:hi], copy=True)
            else:
                bufs[dst][lo:hi] = taken.pop(n)
        last = max([s.t for s in self.streams], default=0.0)
        if self.ended is None or last > self.ended * (1 + 1e-12):
            raise runtime.CourseError(
                f"the caller's stream does not wait for all the work: streams run until t = {last:.6g} s, end "
                f"waited only until {self.ended or 0.0:.6g} s. Pass ring.end the last event of every stream that "
                "worked")
        return self.ended

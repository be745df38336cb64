"""Lesson 8 — streams that run together in Numba's CUDA simulator, so CPU mode can catch what only concurrency
breaks.

The simulator runs every copy and kernel the moment it is called, whatever stream it is given: streams there
never overlap, so a pipeline whose streams share buffers, or that returns before its streams finish, still
computes the right thing. On a GPU it does not. Inside ``with streams_run_together() as sim:`` work given to a
stream made with ``cuda.stream()`` is queued on that stream instead, and runs when the host waits for it
(``stream.synchronize()``, ``event.synchronize()``, ``cuda.synchronize()``, or work on the default stream),
in an order a GPU could choose: one operation of each stream in turn, each stream's own order kept, and
``event.wait(stream)`` holding a stream until the event's stream has reached it. Work still queued when the
block ends was never waited for: it is dropped and counted in ``sim.pending``, as a GPU would still be running
it when the host reads the results.

Queued: ``array.copy_to_device(host, stream=s)``, ``array.copy_to_host(host, stream=s)``,
``cuda.to_device(host, stream=s)``, ``kernel[grid, block, s](...)``, ``event.record(s)``, ``event.wait(s)``.
On a GPU the block changes nothing (``sim.pending`` stays 0): real streams already run together.
"""
from __future__ import annotations

import contextlib
from collections import deque

import numpy as np

from gpucourse import runtime


class _Event:
    """cuda.event() inside the block. A wait binds to the event's latest record at the time of the wait, as in
    CUDA: it holds its stream until the recording stream has reached that record."""

    def __init__(self, sim: "StreamsRunTogether"):
        self.sim, self.recorded, self.reached = sim, 0, 0

    def record(self, stream=0):
        self.recorded += 1
        mark = self.recorded
        if self.sim.tracked(stream):
            self.sim.queue(stream, lambda: setattr(self, "reached", max(self.reached, mark)))
        else:
            self.sim.drain_all()
            self.reached = mark

    def wait(self, stream=0):
        mark = self.recorded
        if self.sim.tracked(stream):
            self.sim.queue(stream, None, ready=lambda: self.reached >= mark)
        else:
            self.synchronize()

    def synchronize(self):
        mark = self.recorded
        self.sim.run_until(lambda: self.reached >= mark)

    def query(self):
        return self.reached >= self.recorded

    def elapsed_time(self, event):
        return -1.0


class StreamsRunTogether:
    """The state of one ``streams_run_together()`` block: a queue per stream, the pending count at the end."""

    def __init__(self):
        self.queues: dict = {}  # id(stream) -> deque of (ready or None, action or None)
        self.order: list = []  # the streams, in the order they were made
        self.pending = 0
        self.ran = 0
        self.turn = 0  # whose turn it is: one operation of each stream in turn

    def tracked(self, stream) -> bool:
        return stream is not None and id(stream) in self.queues

    def new_stream(self, base):
        s = base()
        self.queues[id(s)] = deque()
        self.order.append(s)
        sim = self

        def synchronize():
            sim.run_until(lambda: not sim.queues[id(s)])

        s.synchronize = synchronize
        return s

    def queue(self, stream, action, ready=None) -> None:
        self.queues[id(stream)].append((ready, action))

    def _step(self) -> bool:
        """The next operation that may run, taking the streams in turn; False when none may."""
        for _ in range(len(self.order)):
            s = self.order[self.turn % len(self.order)]
            self.turn += 1
            q = self.queues[id(s)]
            if q and (q[0][0] is None or q[0][0]()):
                _, action = q.popleft()
                if action is not None:
                    action()
                self.ran += 1
                return True
        return False

    def run_until(self, done) -> None:
        while not done():
            if not self._step():
                raise runtime.CourseError("no queued operation can run: the streams wait on each other")

    def drain_all(self) -> None:
        self.run_until(lambda: not any(self.queues.values()))


@contextlib.contextmanager
def streams_run_together():
    """In CPU mode: streams made inside the block run their work together when the host waits for it (see the
    module's text). Yields the block's state; ``.pending`` after the block: operations never waited for."""
    sim = StreamsRunTogether()
    if runtime.is_gpu():
        yield sim
        return
    from numba import cuda
    from numba.cuda.simulator.cudadrv import devicearray as da
    from numba.cuda.simulator import kernel as sk

    saved_module = {name: getattr(cuda, name) for name in ("stream", "event", "synchronize", "to_device")}
    saved_array = {name: getattr(da.FakeCUDAArray, name) for name in ("copy_to_device", "copy_to_host")}
    saved_kernel = {name: getattr(sk.FakeCUDAKernel, name) for name in ("__getitem__", "__call__")}
    copy_in, copy_out = saved_array["copy_to_device"], saved_array["copy_to_host"]
    getitem, call = saved_kernel["__getitem__"], saved_kernel["__call__"]

    def copy_to_device(self, ary, stream=0):
        if not sim.tracked(stream):
            sim.drain_all()
            return copy_in(self, ary)
        sim.queue(stream, lambda: copy_in(self, ary))

    def copy_to_host(self, ary=None, stream=0):
        if not sim.tracked(stream):
            sim.drain_all()
            return copy_out(self, ary)
        if ary is None:
            ary = np.empty(self.shape, dtype=self.dtype)
        sim.queue(stream, lambda: copy_out(self, ary))
        return ary

    def to_device(ary, stream=0, copy=True, to=None):
        if not sim.tracked(stream):
            sim.drain_all()
            return saved_module["to_device"](ary, stream=stream, copy=copy, to=to)
        if to is None:
            to = saved_module["to_device"](np.empty_like(np.asarray(ary)))
        if copy:
            host = np.asarray(ary)
            sim.queue(stream, lambda: copy_in(to, host))
        return to

    def kernel_getitem(self, configuration):
        self._course_stream = configuration[2] if len(configuration) > 2 else 0
        return getitem(self, configuration)

    def kernel_call(self, *args):
        stream = getattr(self, "_course_stream", 0)
        self._course_stream = 0
        if self._device or not sim.tracked(stream):
            if not self._device:
                sim.drain_all()
            return call(self, *args)
        grid, block, shared = self.grid_dim, self.block_dim, self.dynshared_size

        def launch():
            self.grid_dim, self.block_dim, self.dynshared_size = grid, block, shared
            call(self, *args)

        sim.queue(stream, launch)

    cuda.stream = lambda: sim.new_stream(saved_module["stream"])
    cuda.event = lambda *a, **k: _Event(sim)
    cuda.synchronize = sim.drain_all
    cuda.to_device = to_device
    da.FakeCUDAArray.copy_to_device = copy_to_device
    da.FakeCUDAArray.copy_to_host = copy_to_host
    sk.FakeCUDAKernel.__getitem__ = kernel_getitem
    sk.FakeCUDAKernel.__call__ = kernel_call
    try:
        yield sim
    finally:
        sim.pending = sum(len(q) for q in sim.queues.values())
        for q in sim.queues.values():
            q.clear()
        for name, value in saved_module.items():
            setattr(cuda, name, value)
        for name, value in saved_array.items():
            setattr(da.FakeCUDAArray, name, value)
        for name, value in saved_kernel.items():
            setattr(sk.FakeCUDAKernel, name, value)

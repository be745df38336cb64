"""Lesson 7 — k ranks on a ring, simulated with real threads: links with a bandwidth and a latency.

Used by notebooks/07_collectives.ipynb, its exercises and the tests, on any machine (no GPU needed).

Each rank is a Python thread that runs the same *rank program*, ``program(comm, *args)``, as every rank of a
real collective does. ``comm.send(array)`` puts a copy of the array on the link to the next rank of the ring;
``comm.recv()`` waits for the next message from the previous rank. A link carries one message at a time and
a message of n bytes occupies it for ``latency + n / bandwidth`` seconds, so messages queue behind each
other on a link exactly as they do on a GPU's copy engine. Sending does not block the rank (a copy engine
works while the GPU does other things); receiving does.

Two clocks, the same programs:

* ``clock="real"``: every link is a thread of its own that sleeps for each message's transmission time
  before handing the message over. The time is read off the wall clock (time.perf_counter), so the run
  takes as long as it says, and thread start-up and wake-ups add a little.
* ``clock="virtual"``: no sleeping. Each rank carries its own clock; a send starts when both the rank and
  the link are free and ends a transmission time later; a receive moves the rank's clock to the message's
  arrival. This is a discrete-event simulation driven by the real threads and queues, and it gives the same
  times whatever order the operating system runs the threads in: the grader uses it.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from gpucourse import runtime

CLOCKS = ("virtual", "real")
RECV_TIMEOUT_S = 20.0  # wall-clock seconds a rank waits for a message before it reports a deadlock
_POLL_S = 0.05


class Aborted(Exception):
    """Another rank failed: this one stops too."""


@dataclass
class Message:
    """One message on one link: who sent it, its size and when it was on the link (seconds from the start)."""

    src: int
    dst: int
    seq: int  # the message's number on its link: 0, 1, 2, ...
    nbytes: int
    start: float
    end: float
    data: np.ndarray = field(repr=False, default=None)


@dataclass
class RingRun:
    """What a simulated run did: the time it took, each rank's result and every message."""

    k: int
    time_s: float
    results: list  # what each rank's program returned
    messages: list  # every Message, in the order the links finished them
    bandwidth: float
    latency: float
    clock: str

    def link(self, src: int) -> list:
        """The messages rank ``src`` sent to the next rank, in order."""
        return sorted((m for m in self.messages if m.src == src), key=lambda m: m.seq)

    def bytes_sent(self, src: int) -> int:
        return sum(m.nbytes for m in self.messages if m.src == src)


class _Link:
    """The link from rank src to rank (src + 1) % k."""

    def __init__(self, sim: "_Ring", src: int):
        self.sim, self.src, self.dst = sim, src, (src + 1) % sim.k
        self.inbox: queue.Queue = queue.Queue()  # what the receiving rank reads
        self.free_at = 0.0  # virtual clock: when the link has finished its last message
        self.seq = 0
        if sim.clock == "real":
            self.outbox: queue.Queue = queue.Queue()
            self.thread = threading.Thread(target=self._carry, name=f"link {self.src}->{self.dst}", daemon=True)

    def transmission(self, nbytes: int) -> float:
        return self.sim.latency + nbytes / self.sim.bandwidth

    def put(self, data: np.ndarray, now: float) -> None:
        msg = Message(self.src, self.dst, self.seq, data.nbytes, 0.0, 0.0, data)
        self.seq += 1
        if self.sim.clock == "virtual":
            msg.start = max(now, self.free_at)
            msg.end = self.free_at = msg.start + self.transmission(msg.nbytes)
            self.sim.log(msg)
            self.inbox.put(msg)
        else:
            self.outbox.put(msg)

    def _carry(self) -> None:
        """Real clock: take messages in order, hold each for its transmission time, then deliver it."""
        sim = self.sim
        busy_until = 0.0
        while True:
            msg = self.outbox.get()
            if msg is None:
                return
            msg.start = max(sim.elapsed(), busy_until)
            msg.end = busy_until = msg.start + self.transmission(msg.nbytes)
            while (left := msg.end - sim.elapsed()) > 0:  # sleep until the deadline, not for a duration:
                time.sleep(left)  # wake-up delays then do not add up over many messages
            sim.log(msg)
            self.inbox.put(msg)


class Comm:
    """What a rank program sees: its rank, the ring's size, send to the next rank, receive from the previous."""

    def __init__(self, sim: "_Ring", rank: int):
        self._sim, self.rank, self.size = sim, rank, sim.k
        self.next, self.prev = (rank + 1) % sim.k, (rank - 1) % sim.k
        self._clock = 0.0  # virtual clock of this rank

    def send(self, data) -> None:
        """Send a copy of ``data`` (a NumPy array) to the next rank; returns at once."""
        if not isinstance(data, np.ndarray):
            raise runtime.CourseInputError(f"rank {self.rank}: send a NumPy array, not {type(data).__name__}")
        self._sim.check_abort()
        self._sim.links[self.rank].put(np.array(data, copy=True), self._clock)

    def recv(self) -> np.ndarray:
        """The next message from the previous rank (waits for it)."""
        link = self._sim.links[self.prev]
        waited = 0.0
        while True:
            self._sim.check_abort()
            try:
                msg = link.inbox.get(timeout=_POLL_S)
                break
            except queue.Empty:
                waited += _POLL_S
                if waited >= self._sim.recv_timeout:
                    raise runtime.CourseError(
                        f"rank {self.rank} waited {waited:.0f} s for a message from rank {self.prev} that never "
                        "came: the ranks' sends and receives do not match (a deadlock)") from None
        self._clock = max(self._clock, msg.end)
        return msg.data

    def now(self) -> float:
        """This rank's time in seconds since the start (its own clock, or the wall clock)."""
        return self._clock if self._sim.clock == "virtual" else self._sim.elapsed()


class _Ring:
    def __init__(self, k: int, bandwidth: float, latency: float, clock: str, recv_timeout: float):
        self.k, self.bandwidth, self.latency, self.clock = k, bandwidth, latency, clock
        self.recv_timeout = recv_timeout
        self.links = [_Link(self, r) for r in range(k)]
        self.messages: list = []
        self._lock = threading.Lock()
        self._abort = threading.Event()
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: Message) -> None:
        with self._lock:
            self.messages.append(msg)

    def check_abort(self) -> None:
        if self._abort.is_set():
            raise Aborted()


def run_ring(program, k: int, *, bandwidth: float, latency: float = 0.0, args=None, clock: str = "virtual",
             recv_timeout: float = RECV_TIMEOUT_S) -> RingRun:
    """Run ``program(comm, *args[rank])`` on k ranks at once, each in its own thread, on a ring of links of
    ``bandwidth`` bytes a second and ``latency`` seconds a message. Returns a RingRun; an error in any rank
    stops them all and is raised here, naming the rank."""
    if not isinstance(k, (int, np.integer)) or k < 2:
        raise runtime.CourseInputError(f"a ring needs k >= 2 ranks, got k = {k!r}")
    if not bandwidth > 0 or not latency >= 0:
        raise runtime.CourseInputError(f"bandwidth must be > 0 and latency >= 0 (got {bandwidth}, {latency})")
    if clock not in CLOCKS:
        raise runtime.CourseInputError(f"clock must be one of {CLOCKS}, not {clock!r}")
    args = [()] * k if args is None else [a if isinstance(a, tuple) else (a,) for a in args]
    if len(args) != k:
        raise runtime.CourseInputError(f"args must hold one entry per rank ({k}), got {len(args)}")
    sim = _Ring(int(k), float(bandwidth), float(latency), clock, recv_timeout)
    comms = [Comm(sim, r) for r in range(k)]
    results, errors, finish = [None] * k, {}, [0.0] * k

    def rank_main(r):
        try:
            results[r] = program(comms[r], *args[r])
            finish[r] = comms[r].now()
        except Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported below with the rank's number
            errors[r] = exc
            sim._abort.set()

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank {r}", daemon=True) for r in range(k)]
    if clock == "real":
        for link in sim.links:
            link.thread.start()
    sim.t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if clock == "real":
        for link in sim.links:
            link.outbox.put(None)
            link.thread.join()
    if errors:
        r = min(errors)
        exc = errors[r]
        if isinstance(exc, runtime.CourseError):
            raise exc
        raise runtime.CourseError(f"rank {r} failed: {type(exc).__name__}: {exc}") from exc
    unread = [m for link in sim.links for m in list(link.inbox.queue)]
    if unread:
        m = unread[0]
        raise runtime.CourseError(f"{len(unread)} message(s) were sent but never received (the first: rank {m.src} "
                                  f"-> rank {m.dst}, message {m.seq}): every send needs a matching recv")
    end = max([*finish, *(m.end for m in sim.messages)], default=0.0)
    return RingRun(k=int(k), time_s=end, results=results, messages=sorted(sim.messages, key=lambda m: (m.end, m.src)),
                   bandwidth=sim.bandwidth, latency=sim.latency, clock=clock)

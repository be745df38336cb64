"""Measuring GPU work honestly: CUDA events, warm-up, repeats, medians; rates; this GPU's ceilings.

    t = bench.time_gpu(lambda: kernel[blocks, threads](a, b, out))
    print(t, t.gbps(3 * a.nbytes))

GPU work is asynchronous: a launch returns to Python long before the kernel ends. ``time_gpu`` records a
CUDA event before and after the work on the same stream and reads the time between them on the GPU's own
clock, after synchronising. ``wall_clock`` shows what a host timer sees with and without synchronising.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

from . import runtime


@dataclass
class Timing:
    """Repeated measurements of one piece of GPU work, in milliseconds."""

    samples_ms: list

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def max_ms(self) -> float:
        return max(self.samples_ms)

    @property
    def spread(self) -> float:
        """Interquartile range over the median: 0.02 means the middle half lies within 2%."""
        if len(self.samples_ms) < 4:
            return (self.max_ms - self.min_ms) / self.median_ms
        q = statistics.quantiles(self.samples_ms, n=4)
        return (q[2] - q[0]) / self.median_ms

    def gbps(self, nbytes: float) -> float:
        """Bandwidth at the median time, in GB/s (10^9 bytes a second)."""
        return gbps(nbytes, self.median_ms)

    def tflops(self, flops: float) -> float:
        return tflops(flops, self.median_ms)

    def summary(self) -> dict:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "max_ms": self.max_ms,
                "spread": self.spread, "repeats": len(self.samples_ms)}

    def __str__(self) -> str:
        return (f"{format_ms(self.median_ms)} median of {len(self.samples_ms)} "
                f"(min {format_ms(self.min_ms)}, middle half within {100 * self.spread:.1f}%)")


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def format_ms(ms: float) -> str:
    if ms >= 1000:
        return f"{ms / 1000:.3g} s"
    if ms >= 1:
        return f"{ms:.3g} ms"
    return f"{ms * 1000:.3g} µs"


def time_gpu(work: Callable, *, setup: Callable | None = None, warmup: int = 3, repeats: int = 20,
             hold_ms: float = 0.0) -> Timing:
    """Time ``work`` with CUDA events on the current stream: warm-up, then ``repeats`` timed runs.

    setup: called before every run, untimed; its return value (a tuple, or one value) is passed to
    ``work``. Use it for fresh inputs where a cache could flatter, or to poison an output buffer.
    Numba kernels launched without a stream and CuPy calls both go to the legacy default stream, so one
    pair of events brackets either.
    hold_ms: before each start event, queue a kernel that keeps the GPU busy this long (see ``hold``), so the
    host can queue all of ``work`` before the GPU reaches it: the events then time the GPU, not Python.
    """
    if repeats < 1 or warmup < 0 or not 0 <= hold_ms <= 1000:
        raise runtime.CourseInputError("repeats must be at least 1, warmup at least 0, hold_ms within 0..1000")
    runtime.require_gpu("timing with CUDA events")
    cp = runtime.cupy()
    stream = cp.cuda.get_current_stream()
    start, end = cp.cuda.Event(), cp.cuda.Event()

    def args():
        if setup is None:
            return ()
        a = setup()
        return a if isinstance(a, tuple) else (a,)

    for _ in range(warmup):
        work(*args())
    cp.cuda.Device().synchronize()
    samples = []
    for _ in range(repeats):
        a = args()
        cp.cuda.Device().synchronize()  # the setup's own GPU work must not land inside the timed region
        if hold_ms:
            hold(hold_ms, stream)
        start.record(stream)
        work(*a)
        end.record(stream)
        end.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, end))
    return Timing(samples)


def time_in_turns(works: dict, *, rounds: int = 3, repeats: int = 12, warmup: int = 3,
                  hold_ms: float = 0.0) -> dict:
    """Time pieces of GPU work that are to be compared with each other ({name: work}) in turns (``in_turns``):
    ``rounds`` rounds, each timing every one with ``time_gpu`` (repeats / rounds runs each, warmed up ``warmup`` times
    in the first round and once after). Returns {name: Timing} over all of each one's runs."""
    if rounds < 1 or not works:
        raise runtime.CourseInputError("time_in_turns needs at least one round and one piece of work")
    per = max(1, math.ceil(repeats / rounds))
    return in_turns(list(works), rounds, lambda name, r: time_gpu(works[name], warmup=warmup if r == 0 else 1,
                                                                    repeats=per, hold_ms=hold_ms))


def in_turns(names: list, rounds: int, time_one: Callable, desc: str | None = None) -> dict:
    """The turns of ``time_in_turns`` and ``interleaved``: each round times every name (``time_one(name, round)``, a
    Timing), in the opposite order each next round, so that a clock that drifts over the run (a GPU at its power cap
    slows as it warms) slows them alike rather than whichever came last. {name: Timing} of all its samples."""
    samples = {name: [] for name in names}
    for r in (progress(range(rounds), desc=desc) if desc else range(rounds)):
        for name in names if r % 2 == 0 else names[::-1]:
            samples[name] += time_one(name, r).samples_ms
    return {name: Timing(s) for name, s in samples.items()}


def time_held(work: Callable, *, seconds: float = 2.0, warmup: int = 2, sync_every: int = 8) -> tuple:
    """The GPU's time per call of ``work`` run back to back for about ``seconds`` (host time; at least ``sync_every``
    calls), as a long training step runs it: (ms a call, calls). Timed by CUDA events around all of the calls, the
    host waiting for the GPU every ``sync_every`` calls so that the queue stays short. Held that long, a GPU reaches
    its power cap and lowers its clock, which the turns of ``time_in_turns`` (milliseconds each) mostly do not."""
    if not (seconds > 0 and warmup >= 0 and sync_every >= 1):
        raise runtime.CourseInputError("time_held needs seconds > 0, warmup >= 0 and sync_every >= 1")
    runtime.require_gpu("timing GPU work")
    cp = runtime.cupy()
    for _ in range(warmup):
        work()
    device = cp.cuda.Device()
    device.synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    calls, t0 = 0, time.perf_counter()
    start.record()
    while calls < sync_every or time.perf_counter() - t0 < seconds:
        work()
        calls += 1
        if calls % sync_every == 0:
            device.synchronize()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / calls, calls


def rotating_inputs(make: Callable, nbytes: int, *, cache_multiple: int = 4) -> Callable:
    """A ``setup`` for time_gpu that cycles through enough input sets made by ``make()`` (each touching
    ``nbytes``) to exceed the GPU's L2 cache ``cache_multiple`` times: no repeat finds its inputs cached."""
    l2 = runtime.get().device["l2_mib"] * 2**20
    count = max(1, math.ceil(cache_multiple * l2 / max(nbytes, 1)))
    return itertools.cycle([make() for _ in range(count)]).__next__


HOLD_SOURCE = r"""
extern "C" __global__ void hold(unsigned long long ns) {
    // Spin on the GPU's nanosecond clock until ns have passed: one thread, busy on purpose.
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
"""
_hold_kernel = None


def hold(ms: float, stream=None, *, blocks: int = 1, threads: int = 1, shared_bytes: int = 0) -> None:
    """Queue a kernel that keeps the GPU busy for ``ms`` milliseconds on ``stream`` (the current one by default).
    Work queued behind it starts only when it ends, however slowly the host queued it. By default one thread; with
    ``blocks`` of ``threads`` threads and ``shared_bytes`` of shared memory each, it holds those resources of as
    many SMs for that long, as a communication kernel's blocks would (lesson 9's stand-in for NCCL)."""
    global _hold_kernel
    if not (ms >= 0 and blocks >= 1 and 1 <= threads <= 1024 and 0 <= shared_bytes <= 48 * 1024):
        raise runtime.CourseInputError("hold needs ms >= 0, blocks >= 1, 1..1024 threads and at most 48 KiB of "
                                       "shared memory a block")
    runtime.require_gpu("holding the GPU")
    cp = runtime.cupy()
    if _hold_kernel is None:
        _hold_kernel = cp.RawKernel(HOLD_SOURCE, "hold")
    _hold_kernel((int(blocks),), (int(threads),), (cp.uint64(int(ms * 1e6)),),
                 stream=stream or cp.cuda.get_current_stream(), shared_mem=int(shared_bytes))


def time_per_call(launch, *, batch: int = 8, repeats: int = 10, warmup: int = 2, hold_gpu: bool = True) -> Timing:
    """CUDA-event timing of ``batch`` calls back to back, divided by ``batch``: the GPU's time per call.

    A launch from Python spends some microseconds on the host (argument checks, the launch itself) before
    the GPU starts: 5 to 50 µs, more than many small kernels take. Timed alone, that host time sits between
    the start event and the kernel with the GPU idle, and for a 20 µs kernel the events would mostly time
    Python. So, by default, a ``hold`` kernel keeps the GPU busy while the host queues the whole batch (it is
    given twice the time the host took to queue one batch), the start event fires as the hold ends, and the
    calls then run back to back as fast as the GPU can: the events see only GPU time. With
    ``hold_gpu=False`` each call's host work overlaps the previous call's GPU work only where the GPU is the
    slower of the two, as in a real Python loop."""
    def work():
        for _ in range(batch):
            launch()

    hold_ms = 0.0
    if hold_gpu:
        runtime.require_gpu("timing with CUDA events")
        device = runtime.cupy().cuda.Device()
        work()  # compiles, allocates, loads libraries: none of that is part of queueing
        device.synchronize()
        t0 = time.perf_counter()
        work()
        queued_ms = (time.perf_counter() - t0) * 1e3
        device.synchronize()
        hold_ms = min(2 * queued_ms + 0.05, 200.0)
    t = time_gpu(work, repeats=repeats, warmup=warmup, hold_ms=hold_ms)
    return Timing([s / batch for s in t.samples_ms])


def interleaved(launches: dict, *, rounds: int = 5, repeats: int = 4, batch: int = 8, hold_gpu: bool = True) -> dict:
    """{name: Timing} of several launches timed in turns (``in_turns``), ``rounds`` times over (each round
    ``repeats`` samples of ``batch`` calls, see ``time_per_call``). Comparing A with B, the turns keep a drift of
    the GPU's clocks or temperature during the run from favouring whichever ran first."""
    return in_turns(list(launches), rounds, lambda name, r: time_per_call(
        launches[name], batch=batch, repeats=repeats, warmup=1, hold_gpu=hold_gpu), desc="interleaved rounds")


def wall_clock(work: Callable, *, synchronize: bool, repeats: int = 5) -> Timing:
    """What a host timer (time.perf_counter) reports around ``work``, with or without synchronising.

    Without synchronising it measures only the launch: the GPU is still working when the timer stops.
    """
    runtime.require_gpu("timing GPU work")
    cp = runtime.cupy()
    work()
    cp.cuda.Device().synchronize()
    samples = []
    for _ in range(repeats):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        work()
        if synchronize:
            cp.cuda.Device().synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
        cp.cuda.Device().synchronize()
    return Timing(samples)


def progress(items: Iterable | None = None, desc: str = "", total: int | None = None):
    """A progress bar over a sweep (tqdm, drawn as a widget in JupyterLab): iterate over ``items``, or
    call ``.update()`` by hand ``total`` times. Where ipywidgets is missing, tqdm's text bar, without tqdm's
    "IProgress not found" warning (ipywidgets is one of the course's dependencies; a kernel may still lack it)."""
    try:
        import ipywidgets  # noqa: F401  (tqdm draws its widget with it)
    except ImportError:
        from tqdm.std import tqdm
    else:
        from tqdm.auto import tqdm

    return tqdm(items, desc=desc, total=total)


# ------------------------------------------------------------------------------------- ceilings

@dataclass
class Ceilings:
    """What this GPU really reaches, measured with library calls, not read off a datasheet."""

    gpu: str
    copy_gbps: float  # device-to-device copy, counting bytes read + written
    h2d_pageable_gbps: float
    h2d_pinned_gbps: float
    d2h_pinned_gbps: float
    fp32_tflops: float  # cuBLAS SGEMM through cupy.matmul
    fp16_tflops: float  # cuBLAS HGEMM (tensor cores) through cupy.matmul
    measured: str  # ISO date

    def as_dict(self) -> dict:
        return asdict(self)


def cache_dir() -> Path:
    return Path(os.environ.get("GPUCOURSE_CACHE", Path.home() / ".cache" / "gpucourse"))


def ceilings(refresh: bool = False) -> Ceilings:
    """This GPU's measured ceilings, measured once (about 10 s) and cached per GPU and driver.

    The cache is keyed by the real GPU, not by GPUCOURSE_FAKE_CC: the ceilings are what copies and cuBLAS reach on
    the silicon, whatever capability ``gpus`` answers for. Several notebooks may share it at once (``python -m
    gpucourse matrix --jobs``): it is written whole or not at all (a new file renamed into place), and a file that
    cannot be read is measured again."""
    rt = runtime.get()
    runtime.require_gpu("measuring this GPU's ceilings")
    path = cache_dir() / f"ceilings-{runtime.slug(rt.device['name'])}-{rt.device['driver']}.json"
    if path.exists() and not refresh:
        try:
            return Ceilings(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            pass  # damaged, or from another version of the course: measured again
    c = measure_ceilings()
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = path.with_name(f".{path.name}.{os.getpid()}")
    fresh.write_text(json.dumps(c.as_dict(), indent=1))
    os.replace(fresh, path)
    return c


def measure_ceilings() -> Ceilings:
    import datetime

    copy_bytes = min(runtime.size("ceilings.copy_bytes"), _free_bytes() // 4)
    xfer_bytes = min(runtime.size("ceilings.transfer_bytes"), _free_bytes() // 4)
    n = runtime.size("ceilings.gemm_n")
    steps = [lambda: _copy_gbps(copy_bytes), lambda: _transfer_gbps(xfer_bytes),
             lambda: _gemm_tflops(n, "float32"), lambda: _gemm_tflops(n, "float16")]
    copy, (h2d_pageable, h2d_pinned, d2h_pinned), fp32, fp16 = [
        step() for step in progress(steps, desc="measuring ceilings")]
    return Ceilings(
        gpu=runtime.get().device["name"], copy_gbps=copy, h2d_pageable_gbps=h2d_pageable,
        h2d_pinned_gbps=h2d_pinned, d2h_pinned_gbps=d2h_pinned, fp32_tflops=fp32, fp16_tflops=fp16,
        measured=datetime.date.today().isoformat(),
    )


def _copy_gbps(nbytes: int) -> float:
    """Device-to-device cudaMemcpyAsync, counting bytes read plus bytes written."""
    cp = runtime.cupy()
    src = cp.random.random(nbytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    return time_gpu(lambda: dst.data.copy_from_device_async(src.data, src.nbytes)).gbps(2 * src.nbytes)


def _transfer_gbps(nbytes: int) -> tuple:
    """Host -> device from pageable and from pinned memory, and device -> pinned host."""
    import cupyx
    import numpy as np

    cp = runtime.cupy()
    dev = cp.empty(nbytes // 4, dtype=cp.float32)
    pageable = np.random.default_rng(0).random(dev.size, dtype=np.float32)
    pinned = cupyx.empty_pinned(dev.shape, dtype=np.float32)
    pinned[:] = pageable
    return (time_gpu(lambda: dev.set(pageable), repeats=5, warmup=1).gbps(nbytes),
            time_gpu(lambda: dev.set(pinned), repeats=10).gbps(nbytes),
            time_gpu(lambda: dev.get(out=pinned), repeats=10).gbps(nbytes))


def _gemm_tflops(n: int, dtype: str) -> float:
    """cuBLAS through cupy.matmul on random n x n matrices (FP16 runs on tensor cores)."""
    cp = runtime.cupy()
    a = cp.random.random((n, n), dtype=cp.float32).astype(dtype)
    b = cp.random.random((n, n), dtype=cp.float32).astype(dtype)
    return time_gpu(lambda: cp.matmul(a, b), repeats=10).tflops(2 * n**3)


def _free_bytes() -> int:
    return runtime.cupy().cuda.runtime.memGetInfo()[0]

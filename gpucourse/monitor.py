"""Watching a GPU while it works: NVML sampled in a background thread.

    with monitor.Sampler(interval_s=0.02) as s:
        workload()
    s.samples   # [{"t", "util_gpu", "util_mem", "mem_used_mib", "power_w", "sm_clock_mhz"}, ...]

NVML's "GPU utilisation" is the fraction of the sample period during which *any* kernel was running, not how
much of the GPU it used: one thread spinning on one SM reads 100%. DCGM's profiling metrics (SM activity,
SM occupancy, tensor/FP pipe activity) count what the SMs do; NVML does not expose them.
"""
from __future__ import annotations

import threading
import time

from .runtime import CourseError, NeedsGPU, get

FIELDS = ("util_gpu", "util_mem", "mem_used_mib", "power_w", "sm_clock_mhz")


def _nvml(index: int):
    """(pynvml, the handle of GPU ``index``), NVML initialised."""
    try:
        import pynvml
    except ImportError:
        raise CourseError("nvidia-ml-py is not installed: `pip install nvidia-ml-py`") from None
    try:
        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:
        raise NeedsGPU(f"NVML cannot open GPU {index}: {exc}") from None


def nvml_reader(index: int = 0):
    """A function returning one sample of GPU ``index`` through nvidia-ml-py (pynvml)."""
    pynvml, h = _nvml(index)

    def read() -> dict:
        u = pynvml.nvmlDeviceGetUtilizationRates(h)
        return {"util_gpu": u.gpu, "util_mem": u.memory,
                "mem_used_mib": pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20,
                "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000,
                "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)}

    return read


def limits(index: int = 0) -> dict:
    """GPU ``index``'s enforced power limit (W) and highest SM clock (MHz), through nvidia-ml-py."""
    pynvml, h = _nvml(index)
    return {"power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000,
            "max_sm_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)}


class Sampler:
    """Calls ``read()`` every ``interval_s`` in a daemon thread between start() and stop(); each sample gets
    "t", seconds since start. ``mark(label)`` notes when a phase of the workload begins."""

    def __init__(self, read=None, *, interval_s: float = 0.02):
        if interval_s <= 0:
            raise CourseError(f"interval_s must be positive, got {interval_s}")
        if read is None:
            if not get().gpu:
                raise NeedsGPU("sampling NVML needs a GPU; CPU mode shows recorded samples")
            read = nvml_reader()
        self.read, self.interval = read, interval_s
        self.samples, self.marks = [], []
        self._stop = threading.Event()
        self._thread = None
        self.error = None

    def _loop(self):
        while not self._stop.is_set():
            t = time.perf_counter() - self.t0
            try:
                self.samples.append({"t": t, **self.read()})
            except Exception as exc:  # an NVML error ends sampling; stop() re-raises it
                self.error = exc
                return
            self._stop.wait(self.interval)

    def start(self) -> "Sampler":
        if self._thread is not None:
            raise CourseError("this sampler has already been started")
        self.t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def mark(self, label: str) -> None:
        self.marks.append({"t": time.perf_counter() - self.t0, "label": label})

    def stop(self) -> list:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.error is not None:
            raise CourseError(f"reading NVML failed: {self.error}")
        return self.samples

    def __enter__(self) -> "Sampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

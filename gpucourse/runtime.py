"""GPU mode or CPU mode, decided once, in one place.

GPU mode: a CUDA driver with a device is present and CuPy can use it; numba.cuda compiles real kernels.
CPU mode: no usable GPU (or the learner asked for it); numba.cuda is Numba's CUDA simulator, which runs
every thread of a kernel as Python on the CPU, so problem sizes shrink and GPU figures come from records.

Numba reads NUMBA_ENABLE_CUDASIM when ``numba.cuda`` is first imported, so the mode must be chosen before
that. Every notebook therefore starts with ``gpucourse.setup()``, and kernel modules get numba.cuda from
``runtime.cuda()`` rather than importing it themselves.

Force a mode with the environment variable GPUCOURSE_MODE=cpu (or gpu), or ``setup(mode="cpu")``.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass, field

MODE_VARIABLE = "GPUCOURSE_MODE"
FAKE_CC_VARIABLE = "GPUCOURSE_FAKE_CC"  # e.g. 7.5: the compute capability that gpucourse.gpus answers for

# Problem sizes per mode, for every lesson, in one table: key -> (GPU mode, CPU mode).
# The simulator runs each CUDA thread as Python (tens of microseconds a thread), so CPU sizes are small.
SIZES = {
    "vector_multiply.n": (2**29, 10_000),  # float32 elements: 2 GiB per vector on a GPU
    "vector_multiply.sweep": ((2**16, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28, 2**29), (256, 1_024, 4_096)),
    "warp_divergence.branch_n": (2**22, 256),  # threads running the compute-bound branch body
    "warp_divergence.iters": (2048, 8),  # multiply-add rounds per chain in that body
    "warp_divergence.paths": ((1, 2, 3, 4, 6, 8, 12, 16, 24, 32), (1, 2, 4, 8, 32)),
    "warp_divergence.reduce_n": (2**28, 20_000),  # float32 elements: 1 GiB on a GPU
    "memory.n": (16384, 64),  # lesson 4's n x n float32 matrices (2-D scale, transposes): 1 GiB each on a GPU
    "memory.stride_n": (2**26, 1_024),  # elements copy_strided writes; it reads them from n * 32 (8 GiB on a GPU)
    "memory.strides": ((1, 2, 4, 8, 16, 32), (1, 2, 4, 8)),  # strides of the coalescing sweep
    "memory.matmul_n": (4096, 32),  # n of lesson 4's n x n x n FP32 matrix multiplies (numba naive and tiled)
    "tensor_cores.n": (8192, 48),  # C = A B, n x n x n: the lesson's kernels (simulator: numba kernels only)
    "tensor_cores.sweep": ((512, 1024, 2048, 4096, 8192), ()),  # sizes of the rate-against-size sweep
    "tensor_cores.check_n": (4096, 32),  # n for the error table against float64
    "collectives.chunks": ((1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8, 16, 32, 64)),  # S, messages per broadcast
    "collectives.sizes": ((2**20, 2**22, 2**24, 2**26, 2**28, 2**30), ()),  # N in bytes (GPU runs only)
    "collectives.sim_bytes": (2**20, 2**16),  # bytes broadcast on the simulated ring
    "convolution.demo": ((32, 64, 56, 56, 64), (2, 3, 8, 8, 4)),  # N, C, H, W, K of the numba direct demo
    "inference_engine.batch": (256, 64),  # max batch of a plan (the throughput batch on a GPU); NumPy in CPU mode
    "inference_engine.cbr_shape": ((256, 16, 16, 32, 32), (1, 6, 6, 3, 4)),  # N, H, W, C, K of the numba CBR
    "feeding.n": (2**29, 4_096),  # float32 elements of the lesson-8 pipeline: 2 GiB per vector on a GPU
    "feeding.streams": ((1, 2, 3, 4, 8), (1, 2)),  # stream counts of the overlap sweep
    "feeding.chunks": (32, 8),  # chunks of the pipeline
    "feeding.batches": ((1, 4, 16, 64, 256, 1024, 4096), (1, 16, 64)),  # lesson 6 engine's batch sweep
    "training.demo_batch": (8192, 512),  # examples in lesson 9's live-curves training demo
    "training.demo_steps": (300, 60),  # its SGD steps
    "ceilings.copy_bytes": (2 * 2**30, 0),
    "ceilings.transfer_bytes": (2**30, 0),
    "ceilings.gemm_n": (8192, 0),
}


class CourseError(Exception):
    """An error the course raises on purpose: the message says what to do."""


class CourseInputError(CourseError, ValueError):
    """Bad input to a course function: wrong dtype, shape, place (host/device) or size."""


class NeedsGPU(CourseError, RuntimeError):
    """The operation measures real hardware and cannot run in CPU mode."""


@dataclass
class Runtime:
    mode: str  # "gpu", "cpu", or "compile" (real numba.cuda, no GPU: see compile_only)
    reason: str  # why this mode was chosen
    device: dict = field(default_factory=dict)  # probe of the GPU (GPU mode only)

    @property
    def gpu(self) -> bool:
        return self.mode == "gpu"

    @staticmethod
    def small_grids():
        """``small_grids()`` of this module: ``with rt.small_grids():`` around a launch of a few blocks on purpose."""
        return small_grids()


_runtime: Runtime | None = None


def _driver_device_count() -> tuple[int, str]:
    """Ask the CUDA driver directly (no numba, no CuPy) how many devices it sees."""
    names = ["nvcuda.dll"] if sys.platform == "win32" else ["libcuda.so.1", "libcuda.so", "libcuda.dylib"]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return 0, "no CUDA driver found (libcuda is not installed)"
    rc = lib.cuInit(0)
    if rc != 0:
        return 0, f"the CUDA driver is installed but cuInit failed (error {rc}): no usable GPU"
    count = ctypes.c_int(0)
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0 or count.value == 0:
        return 0, "the CUDA driver sees no GPU"
    return count.value, f"the CUDA driver sees {count.value} GPU(s)"


def _cupy_usable() -> tuple[bool, str]:
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        cupy.zeros(1).sum().item()
        return True, "CuPy " + cupy.__version__
    except ImportError:
        return False, "CuPy is not installed (install the cu12 or cu13 extra, see README)"
    except Exception as exc:  # a CuPy built for another CUDA than the driver supports, etc.
        return False, f"CuPy cannot use the GPU: {exc}"


def _numba_cuda_imported_mode() -> str | None:
    if "numba.cuda" not in sys.modules:
        return None
    from numba import config

    return "cpu" if config.ENABLE_CUDASIM else "gpu"


def setup(mode: str | None = None, *, quiet: bool = False) -> Runtime:
    """Choose GPU or CPU mode (once per process) and print the probe.

    mode: "gpu", "cpu" or None/"auto" (GPU when one is usable). The environment variable GPUCOURSE_MODE
    gives the default. Notebooks call ``gpucourse.setup(lesson=...)``, which adds the lesson's recorded
    results to the probe (records sits above runtime, so the runtime itself never reads them).
    """
    global _runtime
    wanted = (mode or os.environ.get(MODE_VARIABLE) or "auto").lower()
    if wanted not in ("auto", "gpu", "cpu"):
        raise CourseInputError(f"mode must be 'auto', 'gpu' or 'cpu', not {wanted!r}")
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" and wanted == "auto":
        wanted = "cpu"

    if _runtime is None:
        _runtime = _decide(wanted)
    elif wanted != "auto" and wanted != _runtime.mode:
        raise CourseError(
            f"this Python process is already in {_runtime.mode.upper()} mode; numba cannot switch. "
            "Restart the kernel (Kernel > Restart) and run the setup cell first."
        )
    if not quiet:
        print(describe())
    return _runtime


def _decide(wanted: str) -> Runtime:
    already = _numba_cuda_imported_mode()
    if already is not None:
        if wanted not in ("auto", already):
            raise CourseError(
                f"numba.cuda was imported before gpucourse.setup() and is in {already.upper()} mode. "
                "Restart the kernel and run the setup cell before importing numba."
            )
        wanted = already

    if wanted == "cpu":
        if os.environ.get(MODE_VARIABLE, "").lower() == "cpu":
            reason = f"{MODE_VARIABLE}=cpu is set"
        elif os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
            reason = "NUMBA_ENABLE_CUDASIM=1 is set"
        else:
            reason = "CPU mode was asked for"
    else:
        count, reason = _driver_device_count()
        ok = count > 0
        if ok:
            ok, why = _cupy_usable()
            reason = f"{reason}; {why}"
        if not ok and wanted == "gpu":
            raise CourseError(f"GPU mode was asked for, but {reason}.")
        wanted = "gpu" if ok else "cpu"

    os.environ["NUMBA_ENABLE_CUDASIM"] = "1" if wanted == "cpu" else "0"
    rt = Runtime(mode=wanted, reason=reason)
    if rt.gpu:
        rt.device = _probe_gpu()
    return rt


def compile_only(cc: tuple = (8, 0)) -> Runtime:
    """Real numba.cuda with no GPU, for compiling kernels to PTX (``cuda.compile_ptx``) only.

    Use it in a process of its own (gpucourse/numba_ptx.py starts one): numba.cuda is the real target here,
    so nothing may launch, and the mode cannot change afterwards. ``cc`` is the compute capability that
    device functions are typed for.
    """
    global _runtime
    if _runtime is not None or _numba_cuda_imported_mode() is not None:
        raise CourseError("compile_only() must come first in a fresh process, before setup() and numba.cuda")
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
    _runtime = Runtime(mode="compile", reason="compiling to PTX only; no GPU is used",
                       device={"compute_capability": f"{cc[0]}.{cc[1]}"})
    import types

    import numba.cuda.dispatcher as dispatcher

    # numba-cuda asks the current device for its compute capability while it types a device function.
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=tuple(cc))
    return _runtime


def get() -> Runtime:
    """The runtime, choosing the mode quietly if setup() has not run yet."""
    return _runtime if _runtime is not None else setup(quiet=True)


def is_gpu() -> bool:
    return get().gpu


def gpu_count() -> int:
    """GPUs this process sees (0 in CPU mode)."""
    return cupy().cuda.runtime.getDeviceCount() if is_gpu() else 0


def cuda():
    """numba.cuda, imported only after the mode is fixed (the simulator in CPU mode)."""
    get()
    from numba import cuda as numba_cuda

    return numba_cuda


@contextlib.contextmanager
def small_grids():
    """Launches of a few blocks on purpose (a check at a small size, a demonstration): numba's
    NumbaPerformanceWarning ("Grid size 2 will likely result in GPU under-utilization") is about occupancy, which
    such a launch does not ask for, so it is silenced inside; every other warning is shown as before."""
    with warnings.catch_warnings():
        for category in numba_performance_warnings():
            warnings.filterwarnings("ignore", message=GRID_WARNING, category=category)
        yield


# numba-cuda's words when a launch has fewer than 128 blocks (its message may start with a terminal colour code).
GRID_WARNING = r"(\x1b\[[0-9;]*m)?Grid size \d+ will likely result in GPU under-utilization"


def numba_performance_warnings() -> tuple:
    """NumbaPerformanceWarning as numba-cuda raises it (``numba.cuda.core.errors``, its own class in numba-cuda
    0.2x and later) and as numba raises it (``numba.core.errors``): the classes this numba has."""
    import importlib

    cuda()  # numba.cuda only once the mode is fixed
    found = []
    for module in ("numba.cuda.core.errors", "numba.core.errors"):
        try:
            found.append(importlib.import_module(module).NumbaPerformanceWarning)
        except (ImportError, AttributeError):
            continue
    return tuple(dict.fromkeys(found))


def cupy():
    """CuPy, which only GPU mode has."""
    if not get().gpu:
        raise NeedsGPU("this step runs CuPy on a real GPU; in CPU mode the notebook shows recorded results")
    import cupy as cp

    return cp


def tensorflow():
    """TensorFlow (ImportError where it is not installed), set up once for the course: where it sees GPUs it takes
    their memory as it needs it (memory growth), not nearly all of it at start-up, so CuPy can share the GPU with
    it; and float32 means float32 (TF32 off; TensorFlow would otherwise run float32 matrix products and
    convolutions in TF32 on Ampere and newer), so it can be the oracle of the course's FP32 kernels. Call this
    before anything else uses TensorFlow: memory growth cannot be set once its GPUs are started."""
    global _tf_configured
    if _tf_configured:
        import tensorflow as tf
        return tf
    with _native_stderr_kept_aside():
        import tensorflow as tf

        _tf_configured = True
        tf.config.experimental.enable_tensor_float_32_execution(False)
        try:
            for gpu in tf.config.list_physical_devices("GPU"):
                tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError:  # TensorFlow had started its GPUs already: it keeps what it took
            warnings.warn("TensorFlow was used before gpucourse.runtime.tensorflow(): it keeps the GPU memory it "
                          "took at start-up, which CuPy may then lack", stacklevel=2)
    return tf


@contextlib.contextmanager
def _native_stderr_kept_aside():
    """What C++ code writes to file descriptor 2 meanwhile goes to a temporary file, and is shown only if the block
    fails. TensorFlow's start-up writes notices there that TF_CPP_MIN_LOG_LEVEL no longer silences (absl's "All log
    messages before absl::InitializeLog()", oneDNN's, a failed cuInit on a machine without a GPU), which a notebook
    would show under the cell as if something had gone wrong."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as kept:
        os.dup2(kept.fileno(), 2)
        try:
            yield
        except BaseException:
            kept.seek(0)
            notices = kept.read().decode(errors="replace")
            raise
        else:
            notices = ""
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sys.stderr.write(notices)


_tf_configured = False


def require_gpu(what: str) -> None:
    if not get().gpu:
        raise NeedsGPU(f"{what} needs a real GPU; CPU mode shows the recorded figures instead")


def size(key: str) -> int | tuple:
    """The problem size for this mode (see SIZES)."""
    try:
        gpu_size, cpu_size = SIZES[key]
    except KeyError:
        raise CourseInputError(f"no problem size named {key!r}; known: {', '.join(sorted(SIZES))}") from None
    return gpu_size if get().gpu else cpu_size


# --------------------------------------------------------------------------------------- the probe

def _probe_gpu() -> dict:
    import cupy as cp

    rt = cp.cuda.runtime
    dev = cp.cuda.Device()
    props = rt.getDeviceProperties(dev.id)
    free, total = rt.memGetInfo()
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]

    def version(v: int) -> str:
        return f"{v // 1000}.{(v % 1000) // 10}"

    info = {
        "name": name,
        "compute_capability": f"{props['major']}.{props['minor']}",
        "sms": props["multiProcessorCount"],
        "memory_gib": round(total / 2**30, 1),
        "free_gib": round(free / 2**30, 1),
        "l2_mib": round(props["l2CacheSize"] / 2**20, 1),
        "driver": version(rt.driverGetVersion()),
        "runtime": version(rt.runtimeGetVersion()),
    }
    try:
        import pynvml

        pynvml.nvmlInit()
        info["driver_release"] = pynvml.nvmlSystemGetDriverVersion()
        handle = pynvml.nvmlDeviceGetHandleByIndex(dev.id)
        info["max_sm_clock_mhz"] = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
    except Exception:
        pass
    return info


def versions() -> dict:
    """Versions of what the figures depend on."""
    out = {"python": platform.python_version()}
    for mod in ("numpy", "numba", "numba_cuda", "cupy", "nbgrader"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            pass
    return out


def describe() -> str:
    """The probe: the mode, and in GPU mode what the GPU is (``records.describe`` adds a lesson's records)."""
    rt = get()
    if rt.gpu:
        d = rt.device
        return (
            f"GPU mode: {d['name']} (compute capability {d['compute_capability']}, {d['sms']} SMs)\n"
            f"          {d['memory_gib']} GiB, {d['free_gib']} GiB free, L2 {d['l2_mib']} MiB; "
            f"CUDA driver {d['driver']}"
            + (f" ({d['driver_release']})" if "driver_release" in d else "")
            + f", runtime {d['runtime']}\n          numba.cuda compiles real kernels."
        )
    return f"CPU mode: kernels run in Numba's CUDA simulator ({rt.reason})."


def slug(gpu_name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': how a GPU's name appears in file names (results/, the ceilings cache)."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")


def parse_cc(cc) -> tuple[int, int]:
    """A compute capability as (major, minor), from "8.6", "sm_86", 86, 8.6 or (8, 6)."""
    if isinstance(cc, tuple | list) and len(cc) == 2 and all(isinstance(v, int) for v in cc):
        return int(cc[0]), int(cc[1])
    text = str(cc).strip().lower().removeprefix("sm_").rstrip("a")
    m = re.fullmatch(r"(\d+)\.(\d)", text) or re.fullmatch(r"(\d+)(\d)", text)
    if not m:
        raise CourseInputError(f"a compute capability looks like 7.5, 8.6 or sm_90, not {cc!r}")
    return int(m.group(1)), int(m.group(2))


def compute_capability() -> tuple[int, int] | None:
    """The compute capability kernels are built for: GPUCOURSE_FAKE_CC if set (tests, ``probe --cc``), else
    the GPU's (GPU mode), the one ``compile_only(cc)`` was given, or None (CPU mode, no GPU)."""
    fake = os.environ.get(FAKE_CC_VARIABLE)
    if fake:
        return parse_cc(fake)
    cc = get().device.get("compute_capability")
    return parse_cc(cc) if cc else None


# ------------------------------------------------------------------------------- input checking

def is_device_array(x) -> bool:
    """True for GPU arrays (numba device arrays, CuPy arrays) and the simulator's fake device arrays."""
    if hasattr(x, "__cuda_array_interface__"):
        return True
    return type(x).__name__ == "FakeCUDAArray"


def check_device_array(x, name: str, *, dtype=None, shape=None, ndim: int | None = None) -> None:
    """Raise CourseInputError naming what is wrong with argument ``name``."""
    import numpy as np

    if not is_device_array(x):
        kind = type(x).__module__ + "." + type(x).__name__
        hint = "copy it first with cuda.to_device(...)" + (" or cupy.asarray(...)" if get().gpu else "")
        raise CourseInputError(f"{name} must be a device array, got a host {kind}; {hint}")
    if dtype is not None and np.dtype(x.dtype) != np.dtype(dtype):
        raise CourseInputError(f"{name} must have dtype {np.dtype(dtype)}, got {np.dtype(x.dtype)}")
    if ndim is not None and len(x.shape) != ndim:
        raise CourseInputError(f"{name} must be {ndim}-dimensional, got shape {tuple(x.shape)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise CourseInputError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_fits(nbytes: int, what: str, *, headroom: float = 0.9) -> None:
    """Refuse an allocation that cannot fit: GPU memory in GPU mode, the simulator's budget in CPU mode."""
    if nbytes < 0:
        raise CourseInputError(f"{what}: a size cannot be negative ({nbytes} bytes)")
    if get().gpu:
        free, total = cupy().cuda.runtime.memGetInfo()
        if nbytes > headroom * free:
            raise CourseInputError(
                f"{what} needs {nbytes / 2**30:.2f} GiB but the GPU has {free / 2**30:.2f} GiB free "
                f"of {total / 2**30:.1f} GiB; choose a smaller size"
            )
    else:
        limit = 64 * 2**20
        if nbytes > limit:
            raise CourseInputError(
                f"{what} needs {nbytes / 2**20:.0f} MiB; the CUDA simulator runs every thread in Python, "
                f"so CPU mode allows at most {limit // 2**20} MiB. Use runtime.size(...) for CPU-mode sizes."
            )

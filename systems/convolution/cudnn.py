"""cuDNN's classic descriptor API from Python: a small typed ctypes binding of libcudnn.so.9.

Lesson 5 walks through the steps of NVIDIA's cuDNN example one by one, and this module is those steps:

    with cudnn.Handle() as h, \\
         cudnn.TensorDescriptor((32, 64, 56, 56), "float32") as x_desc, \\
         cudnn.FilterDescriptor((64, 64, 3, 3), "float32") as w_desc, \\
         cudnn.ConvolutionDescriptor(pad=1, stride=1, dilation=1, compute="float32", math="fma") as conv, \\
         cudnn.TensorDescriptor(conv.output_shape(x_desc, w_desc), "float32") as y_desc:
        table = h.find_forward_algorithms(x_desc, w_desc, conv, y_desc)   # every algorithm, timed by cuDNN
        algo = cudnn.fastest_under(table, workspace_limit=64 * 2**20)     # the memory/speed trade-off
        h.convolution_forward(x, w, y, x_desc, w_desc, conv, y_desc, algo=algo["algo"])

Every call's status is checked: a status other than CUDNN_STATUS_SUCCESS raises ``CudnnError`` with the
status's name, cuDNN's own message (cudnnGetErrorString) and the call that failed. Descriptors are
context managers that destroy themselves (and are destroyed when garbage-collected).

``convolution_bias_activation_forward`` runs cudnnConvolutionBiasActivationForward: y = act(conv(x, w) + b),
one fused call (what an inference engine puts in place of three layers).

Where libcudnn comes from: the ``nvidia-cudnn-cu12`` / ``nvidia-cudnn-cu13`` wheels (site-packages/nvidia/
cudnn/lib), else the system's loader. Without it ``load()`` raises CourseError saying what to install.
CuPy 14 has no cuDNN module, which is why the course binds the C API itself. Arrays are CuPy arrays.
"""
from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import numpy as np

from gpucourse import runtime

LIBRARY_NAMES = ("libcudnn.so.9", "libcudnn.so")
PATH_VARIABLE = "GPUCOURSE_CUDNN"  # a path to libcudnn.so.9, or a folder holding it, to use that one

# cudnnStatus_t of cuDNN 9 (cudnn_graph.h): categories in thousands, details within.
STATUS = {
    0: "CUDNN_STATUS_SUCCESS",
    1001: "CUDNN_STATUS_NOT_INITIALIZED",
    1002: "CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH",
    1003: "CUDNN_STATUS_SERIALIZATION_VERSION_MISMATCH",
    1004: "CUDNN_STATUS_DEPRECATED",
    1005: "CUDNN_STATUS_LICENSE_ERROR",
    1006: "CUDNN_STATUS_RUNTIME_IN_PROGRESS",
    1007: "CUDNN_STATUS_RUNTIME_FP_OVERFLOW",
    1008: "CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED",
    2000: "CUDNN_STATUS_BAD_PARAM",
    2002: "CUDNN_STATUS_BAD_PARAM_NULL_POINTER",
    2003: "CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER",
    2004: "CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED",
    2005: "CUDNN_STATUS_BAD_PARAM_OUT_OF_BOUND",
    2006: "CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT",
    2007: "CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH",
    2008: "CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH",
    2009: "CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES",
    2010: "CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE",
    2011: "CUDNN_STATUS_BAD_PARAM_CUDA_GRAPH_MISMATCH",
    2012: "CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE",
    3000: "CUDNN_STATUS_NOT_SUPPORTED",
    3001: "CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN",
    3002: "CUDNN_STATUS_NOT_SUPPORTED_SHAPE",
    3003: "CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE",
    3004: "CUDNN_STATUS_NOT_SUPPORTED_LAYOUT",
    3005: "CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER",
    3006: "CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDART",
    3007: "CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH",
    3008: "CUDNN_STATUS_NOT_SUPPORTED_RUNTIME_PREREQUISITE_MISSING",
    3009: "CUDNN_STATUS_NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE",
    3010: "CUDNN_STATUS_NOT_SUPPORTED_SHARED_MEMORY_INSUFFICIENT",
    3011: "CUDNN_STATUS_NOT_SUPPORTED_PADDING",
    3012: "CUDNN_STATUS_NOT_SUPPORTED_BAD_LAUNCH_PARAM",
    3013: "CUDNN_STATUS_NOT_SUPPORTED_CUDA_GRAPH_NATIVE_API",
    4000: "CUDNN_STATUS_INTERNAL_ERROR",
    4001: "CUDNN_STATUS_INTERNAL_ERROR_COMPILATION_FAILED",
    4002: "CUDNN_STATUS_INTERNAL_ERROR_UNEXPECTED_VALUE",
    4003: "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
    4004: "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
    4005: "CUDNN_STATUS_INTERNAL_ERROR_BAD_LAUNCH_PARAM",
    4006: "CUDNN_STATUS_INTERNAL_ERROR_TEXTURE_CREATION_FAILED",
    5000: "CUDNN_STATUS_EXECUTION_FAILED",
    5001: "CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER",
    5002: "CUDNN_STATUS_EXECUTION_FAILED_CUBLAS",
    5003: "CUDNN_STATUS_EXECUTION_FAILED_CUDART",
    5004: "CUDNN_STATUS_EXECUTION_FAILED_CURAND",
}
_CATEGORY = {1: "CUDNN_STATUS_NOT_INITIALIZED", 2: "CUDNN_STATUS_BAD_PARAM", 3: "CUDNN_STATUS_NOT_SUPPORTED",
             4: "CUDNN_STATUS_INTERNAL_ERROR", 5: "CUDNN_STATUS_EXECUTION_FAILED"}

# cudnnDataType_t, cudnnTensorFormat_t, cudnnConvolutionMode_t, cudnnMathType_t, cudnnActivationMode_t
DATA_TYPE = {"float32": 0, "float64": 1, "float16": 2}
LAYOUT = {"NCHW": 0, "NHWC": 1}
CONVOLUTION, CROSS_CORRELATION = 0, 1
MATH = {"default": 0, "tensor_op": 1, "tensor_op_allow_conversion": 2, "fma": 3}
MATH_NAMES = {v: k for k, v in MATH.items()}
ACTIVATION = {"sigmoid": 0, "relu": 1, "tanh": 2, "identity": 5}
NOT_PROPAGATE_NAN = 0
# cudnnConvolutionFwdAlgo_t
FWD_ALGOS = ("IMPLICIT_GEMM", "IMPLICIT_PRECOMP_GEMM", "GEMM", "DIRECT", "FFT", "FFT_TILING", "WINOGRAD",
             "WINOGRAD_NONFUSED")
FWD_ALGO = {name: i for i, name in enumerate(FWD_ALGOS)}


class CudnnError(runtime.CourseError):
    """A cuDNN call returned a status other than CUDNN_STATUS_SUCCESS."""

    def __init__(self, call: str, status: int, message: str):
        self.call, self.status, self.name = call, status, status_name(status)
        super().__init__(f"{call} failed: {self.name} ({status}): {message}")


def status_name(status: int) -> str:
    """The name of a cudnnStatus_t value; an unknown detail code is named after its category."""
    status = int(status)
    if status in STATUS:
        return STATUS[status]
    category = _CATEGORY.get(status // 1000)
    return f"{category} (detail {status})" if category else f"unknown cuDNN status {status}"


# ------------------------------------------------------------------------------------- loading

def candidate_paths() -> list[Path]:
    """Where libcudnn.so.9 is looked for, in order: $GPUCOURSE_CUDNN, then the nvidia-cudnn wheels'
    site-packages/nvidia/cudnn/lib on sys.path (the system loader comes after these)."""
    out = []
    if os.environ.get(PATH_VARIABLE):
        p = Path(os.environ[PATH_VARIABLE])
        out += [p / n for n in LIBRARY_NAMES] if p.is_dir() or not p.suffix.startswith(".so") else [p]
    for site in sys.path:
        if site and (Path(site) / "nvidia").is_dir():
            lib = Path(site) / "nvidia" / "cudnn" / "lib"
            out += [lib / n for n in LIBRARY_NAMES]
    return out


INSTALL_HINT = ("cuDNN is not installed where Python can find it. Install the wheel that matches your CuPy: "
                "`pip install nvidia-cudnn-cu12` for cupy-cuda12x, `pip install nvidia-cudnn-cu13` for "
                "cupy-cuda13x (or the course's cu12 / cu13 extra), then restart the kernel. To use a cuDNN "
                f"installed elsewhere, set {PATH_VARIABLE} to its libcudnn.so.9.")

_lib = None


def load(paths=None, *, system: bool = True):
    """libcudnn as a ctypes library with typed functions (loaded once). ``paths`` replaces the list of
    files tried (``candidate_paths``); ``system=False`` skips the system loader. CourseError if absent."""
    global _lib
    if _lib is not None and paths is None:
        return _lib
    tried = []
    lib = None
    for p in (candidate_paths() if paths is None else [Path(p) for p in paths]):
        tried.append(str(p))
        if p.exists():
            try:
                lib = ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL)
                break
            except OSError as exc:
                tried[-1] += f" ({exc})"
    if lib is None and system:
        for name in LIBRARY_NAMES:
            tried.append(f"{name} (system loader)")
            try:
                lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
                break
            except OSError:
                continue
    if lib is None:
        raise runtime.CourseError(f"{INSTALL_HINT}\nTried: " + "; ".join(tried))
    _declare(lib)
    if paths is None:
        _lib = lib
    return lib


def is_available() -> bool:
    try:
        load()
        return True
    except runtime.CourseError:
        return False


class FwdAlgoPerf(ctypes.Structure):
    """cudnnConvolutionFwdAlgoPerf_t: one row of cudnnFindConvolutionForwardAlgorithm's answer."""

    _fields_ = [("algo", ctypes.c_int), ("status", ctypes.c_int), ("time", ctypes.c_float),
                ("memory", ctypes.c_size_t), ("determinism", ctypes.c_int), ("mathType", ctypes.c_int),
                ("reserved", ctypes.c_int * 3)]


_vp, _int, _size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
_SIGNATURES = {
    "cudnnGetVersion": ([], _size),
    "cudnnGetErrorString": ([_int], ctypes.c_char_p),
    "cudnnCreate": ([ctypes.POINTER(_vp)], _int),
    "cudnnDestroy": ([_vp], _int),
    "cudnnSetStream": ([_vp, _vp], _int),
    "cudnnCreateTensorDescriptor": ([ctypes.POINTER(_vp)], _int),
    "cudnnSetTensor4dDescriptor": ([_vp, _int, _int, _int, _int, _int, _int], _int),
    "cudnnDestroyTensorDescriptor": ([_vp], _int),
    "cudnnCreateFilterDescriptor": ([ctypes.POINTER(_vp)], _int),
    "cudnnSetFilter4dDescriptor": ([_vp, _int, _int, _int, _int, _int, _int], _int),
    "cudnnDestroyFilterDescriptor": ([_vp], _int),
    "cudnnCreateConvolutionDescriptor": ([ctypes.POINTER(_vp)], _int),
    "cudnnSetConvolution2dDescriptor": ([_vp, _int, _int, _int, _int, _int, _int, _int, _int], _int),
    "cudnnSetConvolutionMathType": ([_vp, _int], _int),
    "cudnnGetConvolution2dForwardOutputDim": ([_vp, _vp, _vp] + [ctypes.POINTER(_int)] * 4, _int),
    "cudnnDestroyConvolutionDescriptor": ([_vp], _int),
    "cudnnFindConvolutionForwardAlgorithm": ([_vp, _vp, _vp, _vp, _vp, _int, ctypes.POINTER(_int),
                                              ctypes.POINTER(FwdAlgoPerf)], _int),
    "cudnnGetConvolutionForwardWorkspaceSize": ([_vp, _vp, _vp, _vp, _vp, _int, ctypes.POINTER(_size)], _int),
    "cudnnConvolutionForward": ([_vp, _vp, _vp, _vp, _vp, _vp, _vp, _int, _vp, _size, _vp, _vp, _vp], _int),
    "cudnnCreateActivationDescriptor": ([ctypes.POINTER(_vp)], _int),
    "cudnnSetActivationDescriptor": ([_vp, _int, _int, ctypes.c_double], _int),
    "cudnnDestroyActivationDescriptor": ([_vp], _int),
    "cudnnConvolutionBiasActivationForward": ([_vp, _vp, _vp, _vp, _vp, _vp, _vp, _int, _vp, _size, _vp, _vp, _vp,
                                               _vp, _vp, _vp, _vp, _vp], _int),
}


def _declare(lib) -> None:
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res


def check(call: str, status: int, lib=None) -> None:
    """Raise CudnnError unless ``status`` is CUDNN_STATUS_SUCCESS; the message is cuDNN's own."""
    if status == 0:
        return
    message = ""
    lib = lib or _lib
    if lib is not None:
        raw = lib.cudnnGetErrorString(int(status))
        message = raw.decode() if raw else ""
    raise CudnnError(call, status, message or "(cuDNN is not loaded here, so only the status's name is known)")


def _call(name: str, *args) -> None:
    lib = load()
    check(name, getattr(lib, name)(*args), lib)


def version() -> str:
    """cuDNN's version, for example "9.19.0"."""
    v = load().cudnnGetVersion()
    major, rest = divmod(v, 10000) if v >= 90000 else divmod(v, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


# ------------------------------------------------------------------------------------ descriptors

class _Descriptor:
    """A cuDNN descriptor that destroys itself: use it in a ``with`` block, or let it be collected."""

    _create = _destroy = ""

    def __init__(self):
        self._ptr = _vp()
        _call(self._create, ctypes.byref(self._ptr))
        self._destroy_fn = getattr(load(), self._destroy)

    @property
    def ptr(self):
        if self._ptr is None:
            raise runtime.CourseError(f"this {type(self).__name__} was destroyed")
        return self._ptr

    def destroy(self) -> None:
        if getattr(self, "_ptr", None) is not None:
            check(self._destroy, self._destroy_fn(self._ptr))
            self._ptr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def __del__(self):
        try:
            self.destroy()
        except Exception:
            pass


def _dtype_name(dtype) -> str:
    name = np.dtype(dtype).name
    if name not in DATA_TYPE:
        raise runtime.CourseInputError(f"cuDNN data type must be one of {tuple(DATA_TYPE)}, not {name}")
    return name


def _layout(layout: str) -> str:
    if layout not in LAYOUT:
        raise runtime.CourseInputError(f"layout must be 'NCHW' or 'NHWC', not {layout!r}")
    return layout


def _dims4(dims, what: str) -> tuple:
    dims = tuple(int(d) for d in dims)
    if len(dims) != 4 or min(dims) < 1:
        raise runtime.CourseInputError(f"{what} needs four positive sizes, got {dims}")
    return dims


class TensorDescriptor(_Descriptor):
    """cudnnCreateTensorDescriptor + cudnnSetTensor4dDescriptor. ``dims`` is always (n, c, h, w), the
    logical sizes; ``layout`` says how they lie in memory: "NCHW" or "NHWC" (channels innermost)."""

    _create, _destroy = "cudnnCreateTensorDescriptor", "cudnnDestroyTensorDescriptor"

    def __init__(self, dims, dtype="float32", layout: str = "NCHW"):
        self.dims, self.dtype, self.layout = _dims4(dims, "a tensor descriptor"), _dtype_name(dtype), _layout(layout)
        super().__init__()
        _call("cudnnSetTensor4dDescriptor", self._ptr, LAYOUT[self.layout], DATA_TYPE[self.dtype], *self.dims)

    @property
    def shape(self) -> tuple:
        """The shape of the array in memory: (n, c, h, w) for NCHW, (n, h, w, c) for NHWC."""
        n, c, h, w = self.dims
        return (n, c, h, w) if self.layout == "NCHW" else (n, h, w, c)


class FilterDescriptor(_Descriptor):
    """cudnnCreateFilterDescriptor + cudnnSetFilter4dDescriptor: ``dims`` (k, c, r, s) = output channels,
    input channels, filter height, filter width; in memory KCRS for "NCHW", KRSC for "NHWC"."""

    _create, _destroy = "cudnnCreateFilterDescriptor", "cudnnDestroyFilterDescriptor"

    def __init__(self, dims, dtype="float32", layout: str = "NCHW"):
        self.dims, self.dtype, self.layout = _dims4(dims, "a filter descriptor"), _dtype_name(dtype), _layout(layout)
        super().__init__()
        _call("cudnnSetFilter4dDescriptor", self._ptr, DATA_TYPE[self.dtype], LAYOUT[self.layout], *self.dims)

    @property
    def shape(self) -> tuple:
        k, c, r, s = self.dims
        return (k, c, r, s) if self.layout == "NCHW" else (k, r, s, c)


def _pair(v, what: str) -> tuple:
    v = (v, v) if np.isscalar(v) else tuple(v)
    if len(v) != 2:
        raise runtime.CourseInputError(f"{what} must be one number or a pair (height, width), got {v}")
    return int(v[0]), int(v[1])


class ConvolutionDescriptor(_Descriptor):
    """cudnnCreateConvolutionDescriptor + cudnnSetConvolution2dDescriptor + cudnnSetConvolutionMathType.

    pad, stride, dilation: a number or (height, width). mode: "cross_correlation" (what deep learning calls
    convolution; the default) or "convolution" (the filter flipped). compute: the accumulation type,
    "float32" (also for FP16 data: FP16 inputs, FP32 sums) or "float16". math: "default" (cuDNN may run
    FP32 data on TF32 tensor cores on Ampere and later GPUs), "fma" (strict FP32, no tensor cores) or
    "tensor_op" (tensor cores allowed, what FP16 wants)."""

    _create, _destroy = "cudnnCreateConvolutionDescriptor", "cudnnDestroyConvolutionDescriptor"

    def __init__(self, pad=0, stride=1, dilation=1, *, mode: str = "cross_correlation", compute="float32",
                 math: str = "default"):
        self.pad, self.stride, self.dilation = _pair(pad, "pad"), _pair(stride, "stride"), _pair(dilation, "dilation")
        if min(self.pad) < 0 or min(self.stride) < 1 or min(self.dilation) < 1:
            raise runtime.CourseInputError(f"pad must be >= 0, stride and dilation >= 1; got pad {self.pad}, "
                                           f"stride {self.stride}, dilation {self.dilation}")
        if mode not in ("cross_correlation", "convolution"):
            raise runtime.CourseInputError(f"mode must be 'cross_correlation' or 'convolution', not {mode!r}")
        if math not in MATH:
            raise runtime.CourseInputError(f"math must be one of {tuple(MATH)}, not {math!r}")
        self.mode, self.compute, self.math = mode, _dtype_name(compute), math
        super().__init__()
        _call("cudnnSetConvolution2dDescriptor", self._ptr, *self.pad, *self.stride, *self.dilation,
              CROSS_CORRELATION if mode == "cross_correlation" else CONVOLUTION, DATA_TYPE[self.compute])
        _call("cudnnSetConvolutionMathType", self._ptr, MATH[math])

    def output_dims(self, x: TensorDescriptor, w: FilterDescriptor) -> tuple:
        """cudnnGetConvolution2dForwardOutputDim: (n, k, p, q) of the output, as cuDNN computes it."""
        out = [_int() for _ in range(4)]
        _call("cudnnGetConvolution2dForwardOutputDim", self.ptr, x.ptr, w.ptr, *map(ctypes.byref, out))
        return tuple(o.value for o in out)


class ActivationDescriptor(_Descriptor):
    """cudnnCreateActivationDescriptor + cudnnSetActivationDescriptor: "relu", "identity", "sigmoid", "tanh"."""

    _create, _destroy = "cudnnCreateActivationDescriptor", "cudnnDestroyActivationDescriptor"

    def __init__(self, mode: str = "relu", coef: float = 0.0):
        if mode not in ACTIVATION:
            raise runtime.CourseInputError(f"activation must be one of {tuple(ACTIVATION)}, not {mode!r}")
        self.mode = mode
        super().__init__()
        _call("cudnnSetActivationDescriptor", self._ptr, ACTIVATION[mode], NOT_PROPAGATE_NAN, float(coef))


# ------------------------------------------------------------------------------------- the handle

def _scalar(dtype: str, value: float):
    """alpha and beta: double for double data, float for everything else (cuDNN's rule)."""
    return ctypes.c_double(value) if dtype == "float64" else ctypes.c_float(value)


def _check_array(a, desc, name: str) -> int:
    runtime.check_device_array(a, name, dtype=desc.dtype, shape=desc.shape)
    if not a.flags.c_contiguous:
        raise runtime.CourseInputError(f"{name} must be C-contiguous; use cupy.ascontiguousarray")
    return a.data.ptr


class Handle(_Descriptor):
    """cudnnCreate: cuDNN's context on the current GPU, bound to CuPy's current stream at every call."""

    _create, _destroy = "cudnnCreate", "cudnnDestroy"

    def __init__(self):
        runtime.require_gpu("cuDNN")
        super().__init__()
        self._workspace = None

    def _bind_stream(self) -> None:
        stream = runtime.cupy().cuda.get_current_stream().ptr
        _call("cudnnSetStream", self.ptr, _vp(stream))

    def find_forward_algorithms(self, x: TensorDescriptor, w: FilterDescriptor, conv: ConvolutionDescriptor,
                                y: TensorDescriptor, requested: int = len(FWD_ALGOS)) -> list[dict]:
        """cudnnFindConvolutionForwardAlgorithm: cuDNN runs every forward algorithm on scratch buffers it
        allocates, and answers fastest first: one dict per algorithm with its name, time (ms, cuDNN's own
        measurement), workspace bytes, status name, determinism and the math type it ran with."""
        self._bind_stream()
        perfs = (FwdAlgoPerf * requested)()
        count = _int()
        _call("cudnnFindConvolutionForwardAlgorithm", self.ptr, x.ptr, w.ptr, conv.ptr, y.ptr, requested,
              ctypes.byref(count), perfs)
        return [{"algo": FWD_ALGOS[p.algo] if 0 <= p.algo < len(FWD_ALGOS) else str(p.algo), "algo_id": int(p.algo),
                 "status": status_name(p.status), "time_ms": float(p.time) if p.status == 0 else None,
                 "workspace_bytes": int(p.memory) if p.status == 0 else None,
                 "deterministic": bool(p.determinism), "math": MATH_NAMES.get(p.mathType, str(p.mathType))}
                for p in perfs[:count.value]]

    def workspace_size(self, x, w, conv, y, algo: str) -> int:
        """cudnnGetConvolutionForwardWorkspaceSize: the scratch bytes ``algo`` needs for this layer."""
        size = _size()
        _call("cudnnGetConvolutionForwardWorkspaceSize", self.ptr, x.ptr, w.ptr, conv.ptr, y.ptr, _algo_id(algo),
              ctypes.byref(size))
        return size.value

    def _workspace_ptr(self, nbytes: int) -> int:
        if nbytes == 0:
            return 0
        if self._workspace is None or self._workspace.nbytes < nbytes:
            self._workspace = runtime.cupy().empty(nbytes, dtype=np.uint8)
        return self._workspace.data.ptr

    def convolution_forward(self, x_arr, w_arr, y_arr, x, w, conv, y, *, algo: str = "IMPLICIT_PRECOMP_GEMM",
                            alpha: float = 1.0, beta: float = 0.0, workspace_bytes: int | None = None):
        """cudnnConvolutionForward: y = alpha conv(x, w) + beta y, with ``algo`` (a name of FWD_ALGOS) and
        the workspace it needs (allocated once and kept by the handle). Asynchronous, like a kernel."""
        args = (_check_array(x_arr, x, "x"), _check_array(w_arr, w, "w"), _check_array(y_arr, y, "y"))
        nbytes = self.workspace_size(x, w, conv, y, algo) if workspace_bytes is None else workspace_bytes
        ws = self._workspace_ptr(nbytes)
        self._bind_stream()
        a, b = _scalar(x.dtype, alpha), _scalar(x.dtype, beta)
        _call("cudnnConvolutionForward", self.ptr, ctypes.byref(a), x.ptr, _vp(args[0]), w.ptr, _vp(args[1]),
              conv.ptr, _algo_id(algo), _vp(ws), nbytes, ctypes.byref(b), y.ptr, _vp(args[2]))
        return y_arr

    def forward_launcher(self, x_arr, w_arr, y_arr, x, w, conv, y, *, algo: str):
        """A function of no arguments that calls cudnnConvolutionForward with everything prepared (arrays
        checked, workspace allocated, stream bound, status still checked): for timing, where Python's own
        work around each call would otherwise sit inside the measurement."""
        lib = load()
        args = (_check_array(x_arr, x, "x"), _check_array(w_arr, w, "w"), _check_array(y_arr, y, "y"))
        nbytes = self.workspace_size(x, w, conv, y, algo)
        ws = self._workspace_ptr(nbytes)
        self._bind_stream()
        a, b = _scalar(x.dtype, 1.0), _scalar(x.dtype, 0.0)
        call = (self.ptr, ctypes.byref(a), x.ptr, _vp(args[0]), w.ptr, _vp(args[1]), conv.ptr, _algo_id(algo),
                _vp(ws), nbytes, ctypes.byref(b), y.ptr, _vp(args[2]))
        fn = lib.cudnnConvolutionForward
        keep = (x_arr, w_arr, y_arr, x, w, conv, y, a, b)  # alive as long as the launcher

        def launch():
            check("cudnnConvolutionForward", fn(*call), lib)
            return keep[2]

        return launch

    def convolution_bias_activation_forward(self, x_arr, w_arr, b_arr, y_arr, x, w, conv, y, *,
                                            activation: str = "relu", algo: str = "IMPLICIT_PRECOMP_GEMM",
                                            z_arr=None, alpha1: float = 1.0, alpha2: float = 0.0):
        """cudnnConvolutionBiasActivationForward: y = act(alpha1 conv(x, w) + alpha2 z + bias), in one call.

        b_arr: the bias, k values (a CuPy array of x's dtype; float32 for float16 data is also accepted by
        cuDNN, but this binding keeps them alike). z defaults to y (with alpha2 = 0 it is not read).
        With activation "relu", cuDNN's legacy API supports only IMPLICIT_PRECOMP_GEMM; "identity" takes any."""
        n, k, p, q = y.dims
        runtime.check_device_array(b_arr, "bias", dtype=x.dtype, shape=(k,))
        z_arr = y_arr if z_arr is None else z_arr
        args = [_check_array(x_arr, x, "x"), _check_array(w_arr, w, "w"), _check_array(z_arr, y, "z"),
                b_arr.data.ptr, _check_array(y_arr, y, "y")]
        nbytes = self.workspace_size(x, w, conv, y, algo)
        ws = self._workspace_ptr(nbytes)
        self._bind_stream()
        a1, a2 = _scalar(x.dtype, alpha1), _scalar(x.dtype, alpha2)
        with TensorDescriptor((1, k, 1, 1), x.dtype, "NCHW") as bias_desc, ActivationDescriptor(activation) as act:
            _call("cudnnConvolutionBiasActivationForward", self.ptr, ctypes.byref(a1), x.ptr, _vp(args[0]),
                  w.ptr, _vp(args[1]), conv.ptr, _algo_id(algo), _vp(ws), nbytes, ctypes.byref(a2), y.ptr,
                  _vp(args[2]), bias_desc.ptr, _vp(args[3]), act.ptr, y.ptr, _vp(args[4]))
        return y_arr


def _algo_id(algo) -> int:
    if isinstance(algo, (int, np.integer)) and 0 <= int(algo) < len(FWD_ALGOS):
        return int(algo)
    if algo not in FWD_ALGO:
        raise runtime.CourseInputError(f"algo must be one of {FWD_ALGOS}, not {algo!r}")
    return FWD_ALGO[algo]


# ---------------------------------------------------------------------------- the trade-off

def fastest_under(table: list[dict], workspace_limit: int | None) -> dict | None:
    """The fastest algorithm of a Find table that succeeded and needs at most ``workspace_limit`` bytes of
    workspace (None: no limit), or None when none qualifies. cuDNN's design goal, in one function: good
    speed with little memory, the best speed with more."""
    ok = [r for r in table if r["status"] == "CUDNN_STATUS_SUCCESS" and r["time_ms"] is not None
          and (workspace_limit is None or r["workspace_bytes"] <= workspace_limit)]
    return min(ok, key=lambda r: r["time_ms"]) if ok else None


# ------------------------------------------------------------------------------- one-call helpers

def conv_forward(x_arr, w_arr, *, pad=0, stride=1, dilation=1, layout: str = "NCHW", math: str = "default",
                 algo: str | None = None, out=None, handle: Handle | None = None):
    """The whole flow in one call (GPU mode): descriptors for x (N, C, H, W or N, H, W, C), w (K, C, R, S or
    K, R, S, C) and y, then cudnnConvolutionForward with ``algo`` (default: the fastest that Find measures).
    Returns y (a new CuPy array unless ``out`` is given)."""
    cp = runtime.cupy()
    dtype = _dtype_name(x_arr.dtype)
    _layout(layout)
    if len(x_arr.shape) != 4 or len(w_arr.shape) != 4:
        raise runtime.CourseInputError(f"x and w must be 4-dimensional, got {x_arr.shape} and {w_arr.shape}")
    dims = x_arr.shape if layout == "NCHW" else (x_arr.shape[0], x_arr.shape[3], x_arr.shape[1], x_arr.shape[2])
    wdims = w_arr.shape if layout == "NCHW" else (w_arr.shape[0], w_arr.shape[3], w_arr.shape[1], w_arr.shape[2])
    if dims[1] != wdims[1]:
        raise runtime.CourseInputError(f"x has {dims[1]} channels but w expects {wdims[1]}")
    own = handle is None
    h = Handle() if own else handle
    try:
        with TensorDescriptor(dims, dtype, layout) as xd, FilterDescriptor(wdims, dtype, layout) as wd, \
                ConvolutionDescriptor(pad, stride, dilation, compute="float32" if dtype != "float64" else "float64",
                                      math=math) as cd:
            with TensorDescriptor(cd.output_dims(xd, wd), dtype, layout) as yd:
                y = cp.empty(yd.shape, dtype) if out is None else out
                if algo is None:
                    best = fastest_under(h.find_forward_algorithms(xd, wd, cd, yd), None)
                    if best is None:
                        raise runtime.CourseError("cuDNN found no algorithm for this convolution")
                    algo = best["algo"]
                h.convolution_forward(x_arr, w_arr, y, xd, wd, cd, yd, algo=algo)
                return y
    finally:
        if own:
            h.destroy()

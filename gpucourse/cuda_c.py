"""CUDA C kernels from kernels/cuda/*.cu, compiled once per process through CuPy (NVRTC).

``function("vector_multiply", "vmul_vec4")`` gives a launchable ``cupy.RawKernel`` on a GPU.
``compile_ptx("vector_multiply", arch="sm_90")`` compiles without a GPU (nvcc if on PATH, else NVRTC),
which is how the tests make sure every source compiles.

A source names the parts a lesson teaches: a line ``// region: NAME`` before one and ``// endregion`` after it.
``region("vector_multiply", "vmul_vec4")`` is that text and ``show(...)`` prints it. A notebook holds a region's
text in a code cell, and ``function(..., edits={"vmul_vec4": text})`` compiles the file with the cell's text in
place of the region, so a learner who edits the cell and re-runs it runs their own version; a test keeps every
such cell equal to the file.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from gpucourse import runtime

SOURCES = Path(__file__).resolve().parents[1] / "kernels" / "cuda"


_LOCAL_INCLUDE = re.compile(r'^[ \t]*#include[ \t]+"([^"]+)"[^\n]*$', re.MULTILINE)


_REGION = re.compile(r"^[ \t]*// region: ([\w.-]+)[ \t]*\n(.*?)^[ \t]*// endregion\b[^\n]*$", re.MULTILINE | re.DOTALL)


def _path(name: str) -> Path:
    """kernels/cuda/<name>.cu, or the file itself where ``name`` ends in .cu or .cuh."""
    path = SOURCES / (name if name.endswith((".cu", ".cuh")) else f"{name}.cu")
    if not path.is_file():
        known = ", ".join(sorted(p.name for p in SOURCES.iterdir() if p.suffix in (".cu", ".cuh")))
        raise runtime.CourseInputError(f"no CUDA source {path.name} in {SOURCES}; known: {known}")
    return path


def regions(name: str) -> dict:
    """{region name: its text} of kernels/cuda/<name>.cu (or a .cuh named with its suffix), in file order, without
    the marker lines, the includes left as they are."""
    out = {}
    for m in _REGION.finditer(_path(name).read_text()):
        if m.group(1) in out:
            raise runtime.CourseError(f"{_path(name).name} marks region {m.group(1)!r} twice")
        out[m.group(1)] = m.group(2).rstrip("\n")
    return out


def region(name: str, region: str) -> str:
    """The text of one region of a source (``regions``); a clear error naming the regions there are."""
    found = regions(name)
    if region not in found:
        raise runtime.CourseInputError(f"{_path(name).name} has no region {region!r}; its regions: "
                                       f"{', '.join(found) or 'none'}")
    return found[region]


def show(name: str, region_name: str) -> None:
    """Print a region of a source with its file and line numbers, for reading beside the lesson's prose."""
    body = region(name, region_name).split("\n")
    path = _path(name)
    text = path.read_text()
    first = text.count("\n", 0, text.index(f"// region: {region_name}")) + 2
    print(f"// kernels/cuda/{path.name}, region {region_name} (lines {first}-{first + len(body) - 1})")
    print("\n".join(body))


def _edited(path: Path, edits: dict, used: set) -> str:
    """The file's text with the text of each region named in ``edits`` replaced by the edit."""
    def swap(m):
        if m.group(1) not in edits:
            return m.group(0)
        used.add(m.group(1))
        head = m.group(0)[: m.start(2) - m.start(0)]
        tail = m.group(0)[m.end(2) - m.start(0):]
        return head + edits[m.group(1)].strip("\n") + "\n" + tail

    return _REGION.sub(swap, path.read_text()) if edits else path.read_text()


def source(name: str, edits: dict | None = None) -> str:
    """The text of kernels/cuda/<name>.cu with each ``#include "file"`` of a file of that folder (the pieces
    several sources share, such as async_copy.cuh) replaced by the file's text, once per source: the compilers
    then need no include path for them, and the text CuPy keys its cache of compiled modules on changes with
    every file that went into it. ``edits``: {region name: text} put in place of those regions (``regions``)."""
    path = _path(name)
    edits = dict(edits or {})
    seen: set = set()
    used: set = set()

    def inline(match):
        part = SOURCES / match.group(1)
        if not part.is_file():
            raise runtime.CourseError(f"{path.name} includes {match.group(1)}, which is not in {SOURCES}")
        if part.name in seen:
            return f"// {match.group(1)}: already included"
        seen.add(part.name)
        return (f"// ---- {part.name}\n" + _LOCAL_INCLUDE.sub(inline, _edited(part, edits, used))
                + f"// ---- end of {part.name}")

    text = _LOCAL_INCLUDE.sub(inline, _edited(path, edits, used))
    if set(edits) - used:
        raise runtime.CourseInputError(f"{path.name} (with what it includes) has no region "
                                       f"{', '.join(sorted(set(edits) - used))} to replace")
    return text


def include_dirs() -> list[str]:
    """CUDA toolkit include folders on this machine (headers such as mma.h need them under NVRTC)."""
    candidates = []
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    for site in map(Path, sys.path):
        nv = site / "nvidia"
        if nv.is_dir():  # the CUDA wheels: nvidia/cuda_runtime/include, nvidia/cu13/include, ...
            candidates += sorted(nv.glob("*/include"))
    candidates.append(Path("/usr/local/cuda/include"))
    seen, out = set(), []
    for c in candidates:
        if c.is_dir() and str(c) not in seen:
            seen.add(str(c))
            out.append(str(c))
    return out


def module(name: str, edits: dict | None = None):
    """The compiled CuPy module of kernels/cuda/<name>.cu (GPU mode), with ``edits`` ({region: text}) in place of
    those regions; compiled once per process for each text."""
    return _module(name, tuple(sorted((edits or {}).items())))


@functools.cache
def _module(name: str, edits: tuple):
    cp = runtime.cupy()
    options = ("-std=c++17", *(f"-I{d}" for d in include_dirs()))
    mod = cp.RawModule(code=source(name, dict(edits)), options=options)
    mod.compile()
    return mod


def function(name: str, kernel: str, edits: dict | None = None):
    """A launchable kernel of kernels/cuda/<name>.cu; with ``edits``, of the file with those regions replaced (a
    notebook cell's version of a region)."""
    return module(name, edits).get_function(kernel)


def ptx_entry(ptx: str, name: str) -> str:
    """The PTX of kernel ``name`` alone: from its ``.entry`` to the next kernel's (or the end)."""
    start = ptx.index(f".entry {name}(")
    end = ptx.find(".entry ", start + 1)
    return ptx[start:end if end > 0 else None]


def compile_ptx(name: str, arch: str = "sm_80", edits: dict | None = None) -> str:
    """PTX of kernels/cuda/<name>.cu (with ``edits`` in place of those regions) for ``arch``, compiled without a
    GPU. Raises on any compile error."""
    return ptx_from_source(source(name, edits), arch, filename=f"{name}.cu")


def ptx_from_source(code: str, arch: str = "sm_80", *, filename: str = "kernel.cu", compiler: str = "auto") -> str:
    """PTX of CUDA C ``code`` for ``arch`` ("sm_80", "sm_90", ...), compiled without a GPU.

    compiler: "nvcc" (a subprocess), "nvrtc" (in this process, through CuPy's NVRTC binding: what the grader's
    kernel, which may not start processes, can use) or "auto" (nvcc when it is on PATH). The CUDA include
    folders (``include_dirs``) are passed either way. Raises CourseError with the compiler's log.

    The same text compiled the same way gives the same PTX, so a process compiles it once (``_PTX``, the last
    ``PTX_KEPT``): a notebook cell or a test that compiles a region's text in its own place, which is the file's
    text, costs nothing more. Processes that share a folder (``SHARED_PTX``) compile it once between them."""
    if compiler not in ("auto", "nvcc", "nvrtc"):
        raise runtime.CourseInputError(f"compiler must be 'auto', 'nvcc' or 'nvrtc', not {compiler!r}")
    includes = [f"-I{d}" for d in include_dirs()]
    nvcc = shutil.which("nvcc") if compiler != "nvrtc" else None
    if compiler == "nvcc" and not nvcc:
        raise runtime.CourseError("nvcc is not on PATH")
    key = (code, arch, filename, nvcc or "nvrtc", tuple(includes))
    if key in _PTX:
        _PTX[key] = _PTX.pop(key)  # the most recently used last
        return _PTX[key]
    shared = _shared_ptx(key)
    ptx = shared.read_text() if shared is not None and shared.is_file() else None
    if ptx is None:
        ptx = _compile_ptx(code, arch, filename, includes, nvcc)
        if shared is not None:  # whole or not at all: a new file renamed into place
            fresh = shared.with_name(f".{shared.name}.{os.getpid()}.{threading.get_ident()}")
            fresh.write_text(ptx)
            os.replace(fresh, shared)
    _PTX[key] = ptx
    while len(_PTX) > PTX_KEPT:
        _PTX.pop(next(iter(_PTX)))
    return ptx


_PTX: dict = {}  # (code, arch, file name, compiler, include options) -> PTX, oldest first
PTX_KEPT = 32
SHARED_PTX = "GPUCOURSE_PTX_CACHE"  # a folder several processes of one run share their PTX in (the test suite's)


def _shared_ptx(key: tuple) -> Path | None:
    """Where the PTX of ``key`` lies in the folder GPUCOURSE_PTX_CACHE names (tests/conftest.py sets one for a test
    run, shared by its pytest-xdist workers and removed afterwards), or None where it names none."""
    folder = os.environ.get(SHARED_PTX)
    if not folder or not os.path.isdir(folder):
        return None
    import hashlib
    import json

    return Path(folder) / (hashlib.sha256(json.dumps(key).encode()).hexdigest() + ".ptx")


def _compile_ptx(code: str, arch: str, filename: str, includes: list, nvcc: str | None) -> str:
    if nvcc:
        with tempfile.TemporaryDirectory() as tmp:
            src, ptx = Path(tmp) / filename, Path(tmp) / "out.ptx"
            src.write_text(code)
            cmd = [nvcc, "-std=c++17", f"-arch={arch}", *includes, "-ptx", str(src), "-o", str(ptx)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise runtime.CourseError(f"nvcc could not compile {filename} for {arch}:\n{done.stderr}")
            return ptx.read_text()
    from cupy.cuda import nvrtc

    prog = _nvrtc(code, filename, arch, ["-std=c++17", f"-arch=compute_{arch.split('_')[1]}", *includes])
    ptx = nvrtc.getPTX(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def _nvrtc(code: str, filename: str, arch: str, options: list):
    """An NVRTC program of ``code`` compiled with ``options``; CourseError with the compiler's log if it fails."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(code, filename, [], [])
    try:
        nvrtc.compileProgram(prog, options)
    except nvrtc.NVRTCError as exc:
        raise runtime.CourseError(
            f"NVRTC could not compile {filename} for {arch}:\n{nvrtc.getProgramLog(prog)}") from exc
    return prog


def ptxas_log(name: str, arch: str = "sm_90a", options: tuple = ()) -> str:
    """What ptxas says of each kernel of kernels/cuda/<name>.cu compiled to machine code for ``arch`` by NVRTC (no
    GPU needed): registers, spills, and its performance remarks, such as C7512 (a warpgroup's wgmmas serialised
    for want of registers). ``options``: more NVRTC options (``-DNAME=VALUE``)."""
    from cupy.cuda import nvrtc

    options = ["-std=c++17", f"-arch={arch}", "--ptxas-options=-v", *(f"-I{d}" for d in include_dirs()), *options]
    code = source(name)
    key = (code, name, arch, tuple(options))
    if key not in _PTXAS:  # once per process, as the PTX (ptx_from_source)
        log = nvrtc.getProgramLog(_nvrtc(code, f"{name}.cu", arch, options))
        _PTXAS[key] = log.decode() if isinstance(log, bytes) else log
        while len(_PTXAS) > PTX_KEPT:
            _PTXAS.pop(next(iter(_PTXAS)))
    return _PTXAS[key]


_PTXAS: dict = {}  # (code, name, arch, options) -> ptxas's log


def module_arch(name: str, arch: str, edits: dict | None = None):
    """``module`` for one named architecture (``_module_arch``), with ``edits`` in place of those regions."""
    return _module_arch(name, arch, tuple(sorted((edits or {}).items())))


@functools.cache
def _module_arch(name: str, arch: str, edits: tuple = ()):
    """The compiled CuPy module of kernels/cuda/<name>.cu for one named architecture (GPU mode): what the
    sources that declare an arch-specific target ("// gpucourse-arch: sm_90a") need, since CuPy's own
    compile picks the plain architecture (sm_90), which lacks wgmma. NVRTC compiles the source to machine
    code (cubin) in this process; CuPy loads it."""
    import hashlib

    from cupy.cuda import nvrtc

    cp = runtime.cupy()
    code = source(name, dict(edits))
    options = ["-std=c++17", f"-arch={arch}", *(f"-I{d}" for d in include_dirs())]
    cubin = nvrtc.getCUBIN(_nvrtc(code, f"{name}.cu", arch, options))
    digest = hashlib.sha1(code.encode() + arch.encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / "gpucourse-cubin"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.{arch}.{digest}.{os.getpid()}.cubin"
    path.write_bytes(cubin if isinstance(cubin, bytes) else bytes(cubin))
    mod = cp.RawModule(path=str(path))
    return mod


# ------------------------------------------------------------------ the CUDA driver API, for what CuPy lacks

@functools.cache
def driver():
    """libcuda through ctypes (GPU mode), for the driver calls CuPy does not expose: tensor maps
    (cuTensorMapEncode*), launches with by-value tensor maps (cuLaunchKernel), stream priorities. Every function
    used returns a CUresult (an int): pass it to ``driver_check``."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise runtime.CourseError(f"the CUDA driver library (libcuda.so.1) could not be loaded: {exc}") from None
    for name in ("cuTensorMapEncodeTiled", "cuTensorMapEncodeIm2col", "cuLaunchKernel", "cuLaunchKernelEx",
                 "cuGetErrorString", "cuCtxGetStreamPriorityRange"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def _launch_structs():
    """cuda.h's CUlaunchAttribute and CUlaunchConfig as ctypes structures (cuLaunchKernelEx's arguments)."""
    import ctypes

    class LaunchAttributeValue(ctypes.Union):  # CUlaunchAttributeValue: 64 bytes, 8-byte aligned
        _fields_ = [("pad", ctypes.c_char * 64), ("int_value", ctypes.c_int), ("pointer", ctypes.c_void_p)]

    class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: the id, padded to 8 bytes, then the value
        _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", LaunchAttributeValue)]

    class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
        _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                    ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                    ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                    ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]

    return LaunchAttribute, LaunchConfig


LaunchAttribute, LaunchConfig = _launch_structs()
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def driver_check(status: int, what: str) -> None:
    """Raise CourseError with the driver's own words when a driver call returned an error."""
    if status != 0:
        import ctypes

        msg = ctypes.c_char_p()
        driver().cuGetErrorString(status, ctypes.byref(msg))
        raise runtime.CourseError(f"{what} failed: CUDA driver error {status} "
                                  f"({msg.value.decode() if msg.value else 'unknown'})")

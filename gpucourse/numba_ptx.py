"""numba.cuda kernels compiled to PTX without a GPU: how CI checks warp-intrinsic kernels (``shfl.sync``...)
that Numba's simulator cannot run.

    ptx = numba_ptx({"block_sum": "void(float32[::1], float32[::1])"}, module="kernels.warp_divergence")
    every = module_kernels(["kernels.vector_multiply", ...], cc=(7, 5))  # every kernel, by its NUMBA_KERNELS
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpucourse import runtime

_PTX_SCRIPT = r"""
import importlib, json, sys
request = json.loads(sys.stdin.read())
from gpucourse import runtime
cc = tuple(request["cc"])
runtime.compile_only(cc)
from numba import cuda
if request["module"]:
    namespace = vars(importlib.import_module(request["module"]))
else:
    namespace = {"__name__": "compiled_source"}
    exec(compile(request["source"], "<source>", "exec"), namespace)
out = {}
for name, signature in request["kernels"].items():
    fn = namespace[name]
    ptx, _ = cuda.compile_ptx(getattr(fn, "py_func", fn), signature, cc=cc)
    out[name] = ptx
print(json.dumps(out))
"""

_DISCOVER_SCRIPT = r"""
import importlib, json, sys
request = json.loads(sys.stdin.read())
from gpucourse import runtime
cc = tuple(request["cc"])
runtime.compile_only(cc)
from numba import cuda
from numba.cuda.dispatcher import CUDADispatcher
out = {}
for name, extra in request["modules"].items():
    mod = importlib.import_module(name)
    declared = {**getattr(mod, "NUMBA_KERNELS", {}), **extra}
    found = sorted(k for k, v in vars(mod).items() if isinstance(v, CUDADispatcher)
                   and v.py_func.__module__ == name and not v.targetoptions.get("device"))
    ptx = {}
    for k in found:
        if k in declared:
            ptx[k] = cuda.compile_ptx(vars(mod)[k].py_func, declared[k], cc=cc)[0]
    out[name] = {"kernels": found, "undeclared": [k for k in found if k not in declared],
                 "stale": sorted(set(declared) - set(found)), "ptx": ptx}
print(json.dumps(out))
"""


def _child(script: str, request: dict) -> dict:
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", runtime.MODE_VARIABLE)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(request), capture_output=True,
                          text=True, env=env, cwd=root, timeout=600)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise runtime.CourseError(f"numba could not compile {', '.join(request.get('kernels') or request['modules'])} "
                                  f"to PTX:\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def module_kernels(modules, *, cc=(7, 5), extra: dict | None = None) -> dict:
    """Every numba kernel (not device function) defined in each of ``modules``, compiled to PTX for ``cc``.

    A module declares its kernels' signatures in ``NUMBA_KERNELS = {name: signature}`` (``extra`` =
    {module: {name: signature}} adds to them). Returns {module: {"kernels": [every kernel found],
    "undeclared": [those with no signature], "stale": [signatures of no kernel], "ptx": {name: ptx}}}."""
    extra = extra or {}
    return _child(_DISCOVER_SCRIPT, {"modules": {m: extra.get(m, {}) for m in modules}, "cc": list(cc)})


def numba_ptx(kernels: dict, *, source: str | None = None, module: str | None = None, cc=(8, 0)) -> dict:
    """PTX of numba kernels, compiled without a GPU: {name: ptx} for ``kernels`` = {name: signature}.

    The kernels come from ``module`` (a module name, e.g. "kernels.warp_divergence") or from Python ``source`` that defines them
    (with ``from numba import cuda`` at its top). Compilation runs in a child Python because Numba's
    simulator, once chosen, holds the whole process. Needs numba-cuda's NVVM (the cu12/cu13 extra)."""
    if (source is None) == (module is None):
        raise runtime.CourseInputError("give the kernels' module or their source, one of the two")
    request = {"kernels": kernels, "source": source, "module": module, "cc": list(cc)}
    return _child(_PTX_SCRIPT, request)

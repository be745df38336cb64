"""The guarded kernel lets Triton's compiler start its own tools and nothing else (gpucourse/grading/kernel.py:
``triton_tools`` and the audit hook's ``triton_may_start``). The hook is installed in a separate Python process
(an audit hook cannot be removed), whose script plays the notebook: its frames are not trusted code."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpucourse.grading import integrity
from gpucourse.grading.kernel import TRITON_CALL_SITES, triton_tools

ROOT = Path(__file__).resolve().parents[1]
triton = pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import json, os, subprocess, sys, ctypes
    from gpucourse.grading.kernel import _install_audit_hook, triton_tools
    private, cwd = sys.argv[1], sys.argv[2]
    os.environ.update({"TMPDIR": private + "/tmp", "TRITON_CACHE_DIR": private + "/triton", "HOME": private + "/home"})
    tools = triton_tools(private + "/tmp", private + "/triton")
    trusted = sorted({os.path.realpath(p).rstrip("/") + "/" for p in (sys.prefix, sys.base_prefix, *sys.path)
                      if p and os.path.isdir(p) and not p.startswith(cwd)})
    _install_audit_hook(allow=["/"], deny=[], writable=[cwd, private], trusted=trusted,
                        ctypes_dir=os.path.dirname(ctypes.__file__) + "/", triton=tools)
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "ran"
        except PermissionError as exc:
            out[name] = "refused: " + str(exc)
        except Exception as exc:
            out[name] = type(exc).__name__ + ": " + str(exc)[:300]

    ptxas = next(p for p, kind in tools["tools"].items() if kind == "ptxas")
    cc = next(p for p, kind in tools["tools"].items() if kind == "cc")
    attempt("shell", lambda: subprocess.run(["sh", "-c", "true"], check=True))
    attempt("os.system", lambda: os.system("true"))
    attempt("ptxas from the notebook", lambda: subprocess.run([ptxas, "--version"], check=True))
    attempt("posix_spawn ptxas", lambda: os.posix_spawn(ptxas, [ptxas, "--version"], dict(os.environ)))
    attempt("cc from the notebook", lambda: subprocess.run([cc, "--version"], check=True))

    import triton, triton.language as tl
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget

    @triton.jit
    def double(x, y, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + i, tl.load(x + i, mask=i < n) * 2, mask=i < n)

    def compile_kernel():
        src = ASTSource(fn=double, signature={"x": "*fp32", "y": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                        constexprs={"BLOCK": 64})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        out["cubin bytes"] = len(kernel.asm["cubin"])

    attempt("triton compiles a kernel", compile_kernel)
    from triton.runtime import build
    with open(private + "/tmp/evil.c", "w") as f:
        f.write("int x;\\n")
    attempt("triton's _build called by the notebook",
            lambda: build._build("evil", private + "/tmp/evil.c", private + "/tmp", [], [], [], []))
    from triton.backends.nvidia import driver
    attempt("ldconfig through triton", lambda: driver.libcuda_dirs.__wrapped__())
    os.makedirs(private + "/nolib", exist_ok=True)
    os.environ["TRITON_LIBCUDA_PATH"] = private + "/nolib"
    attempt("the launcher's C compiler through triton", lambda: driver.CudaUtils())
    os.environ["LD_PRELOAD"] = private + "/tmp/evil.so"
    attempt("the C compiler with LD_PRELOAD set", lambda: driver.CudaUtils())
    del os.environ["LD_PRELOAD"]
    attempt("write in triton's cache", lambda: open(private + "/triton/planted.so", "wb").write(b"x"))
    print("RESULT " + json.dumps(out))
''')


def guarded(tmp_path) -> dict:
    private, cwd = tmp_path / "private", tmp_path / "cwd"
    for sub in ("tmp", "triton", "home"):
        (private / sub).mkdir(parents=True)
    cwd.mkdir()
    script = cwd / "notebook.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "TRITON_LIBCUDA_PATH", "LD_PRELOAD")}
    env.update(PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(script), str(private), str(cwd)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(line[len("RESULT "):])


def test_the_allow_list_holds_only_tritons_tools(tmp_path):
    tools = triton_tools(str(tmp_path), str(tmp_path / "cache"))
    package = os.path.realpath(os.path.dirname(triton.__file__)) + "/"
    assert tools["package"] == package
    kinds = sorted(tools["tools"].values())
    assert kinds.count("cc") <= 1 and kinds.count("ldconfig") <= 1 and set(kinds) <= {"ptxas", "cc", "ldconfig"}
    for path, kind in tools["tools"].items():
        if kind == "ptxas":
            assert path.startswith(package + "backends/nvidia/bin/"), path
        elif kind == "cc":
            chosen = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
            assert path == os.path.realpath(shutil.which(chosen)), path
        else:
            assert path == os.path.realpath("/sbin/ldconfig")
    assert "ptxas" in kinds
    # every call site named is a file of the triton package
    for sites, via in TRITON_CALL_SITES.values():
        for f in (*sites, *via):
            assert (Path(package) / f).is_file(), f


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("clang") is None, reason="no C compiler here")
def test_triton_compiles_under_the_guard_and_the_notebook_still_starts_nothing(tmp_path):
    out = guarded(tmp_path)
    refused = "refused: the grader does not let a notebook start processes"
    for name in ("shell", "os.system", "ptxas from the notebook", "posix_spawn ptxas", "cc from the notebook",
                 "triton's _build called by the notebook", "the C compiler with LD_PRELOAD set"):
        assert out[name].startswith(refused), (name, out)
    assert out["triton compiles a kernel"] == "ran" and out["cubin bytes"] > 1000, out  # ptxas, from Triton
    # ldconfig and the C compiler started from Triton's driver: whatever they then find (no libcuda on a machine
    # without a GPU), the guard did not stop them
    assert not out["ldconfig through triton"].startswith("refused"), out
    launcher = out["the launcher's C compiler through triton"]
    assert not launcher.startswith("refused") and "CalledProcessError" in launcher or launcher == "ran", out
    assert out["write in triton's cache"].startswith("refused: the grader lets only Triton write in its cache"), out


def test_notebook_code_may_not_reach_tritons_build_or_backends():
    for cell in ("from triton.runtime.build import _build", "import triton.backends.nvidia.compiler as c",
                 "import triton\ntriton.runtime.build.compile_module_from_src('int x;', 'm')",
                 "import triton\ntriton.backends.nvidia.driver.CudaUtils()", "import os\nos.putenv('CC', 'sh')"):
        assert integrity.integrity_findings(cell), cell
    assert integrity.integrity_findings("import triton\nimport triton.language as tl\nx = triton.cdiv(5, 2)") == []

"""The course inside a hosted notebook's Python (Colab, Kaggle): the README's section "In a hosted notebook (Colab,
Kaggle)" gives one code block to paste into a notebook's first cell. Here that block is run as such a notebook would
run it, on a fresh environment with no make and no .venv: its ``!`` lines in a shell (the clone's address replaced by
this checkout, so what is committed here is installed), its ``%pip`` lines as that environment's ``python -m pip``,
and its Python lines as the first cell of a kernel of that environment, which then runs every cell of lesson 1 in
CPU mode from a working folder outside the clone (as Colab's /content holds the clone beside the notebook).

pip may use its cache (a first run downloads the CUDA 12 wheels, CuPy, TensorFlow, several GB). Everything happens in
a private temporary folder, removed afterwards; every wait has a time-out.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADING = re.compile(r"^(#{1,6})[ \t]+In a hosted notebook\b[^\n]*$", re.MULTILINE)
NOTEBOOK = "notebooks/01_vector_multiply.ipynb"
INSTALL_TIMEOUT = 3600  # seconds for pip: about 3.4 GB of wheels (the CUDA 12 ones, CuPy, TensorFlow), downloaded or from its cache
# Free disk the install needs where the test works: about 7 GB installed, and pip holds the 3.4 GB of wheels in its
# temporary folder (that same private folder) until it has installed them all.
DISK_NEEDED = 12 * 2**30
CELL_TIMEOUT = 600  # seconds per cell of lesson 1 in CPU mode


def hosted_block(readme: str) -> str | None:
    """The first code block (fenced, or indented by four spaces) under the README's heading "In a hosted notebook
    ...", up to the next heading of the same or a higher level; None where there is no such heading or block."""
    head = HEADING.search(readme)
    if head is None:
        return None
    section = readme[head.end():]
    end = re.search(rf"^#{{1,{len(head.group(1))}}}[ \t]", section, re.MULTILINE)
    section = section[: end.start()] if end else section
    fenced = re.search(r"^([ \t]*)(```|~~~)[^\n]*\n(.*?)^[ \t]*\2[ \t]*$", section, re.MULTILINE | re.DOTALL)
    indented = re.search(r"(?:\A|\n[ \t]*\n)((?: {4}[^\n]*\n(?:[ \t]*\n)*)+)", section)
    blocks = []
    if fenced:
        indent = len(fenced.group(1))
        blocks.append((fenced.start(), "".join(line[indent:] for line in fenced.group(3).splitlines(keepends=True))))
    if indented:
        lines = indented.group(1).rstrip().splitlines()
        blocks.append((indented.start(1), "".join(line[4:] + "\n" for line in lines)))
    return min(blocks)[1] if blocks else None


def parse(block: str) -> list[tuple[str, object]]:
    """The block's steps in order: ("shell", command) for a ``!`` line, ("pip", [args]) for ``%pip``, ("python",
    source) for the Python lines (consecutive ones together)."""
    steps: list[tuple[str, object]] = []
    for line in block.splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("!"):
            steps.append(("shell", text[1:].strip()))
        elif text.startswith("%pip"):
            steps.append(("pip", shlex.split(text[len("%pip"):])))
        elif text.startswith(("%", "!")):
            raise AssertionError(f"the hosted-notebook block holds a line this test cannot run: {line!r}")
        elif steps and steps[-1][0] == "python":
            steps[-1] = ("python", f"{steps[-1][1]}\n{line}")
        else:
            steps.append(("python", line))
    return steps


def as_committed(command: str) -> str:
    """A ``!`` line of the block with its ``git clone`` address (whatever the README writes there: a URL, or a
    placeholder such as <the address you got the course from>) replaced by this checkout, so that what is committed
    here is what the fresh environment installs."""
    words = shlex.split(re.sub(r"<[^<>\n]*>", "ADDRESS", command))
    if words[:2] != ["git", "clone"]:
        return command
    rest = words[2:]
    i = 0
    while i < len(rest) and rest[i].startswith("-"):
        i += 2 if rest[i] in ("--depth", "--branch", "-b", "--origin", "-o") else 1
    assert i < len(rest), f"a git clone without an address: {command!r}"
    rest[i] = f"file://{ROOT}"
    return shlex.join(["git", "clone", *rest])


def _readme_block() -> str:
    block = hosted_block((ROOT / "README.md").read_text(encoding="utf-8"))
    assert block is not None, "README.md has a heading 'In a hosted notebook ...' with a code block under it"
    return block


def test_the_readme_has_its_hosted_block_under_its_heading():
    """The block is read from the README (a change to the README is what is tested), and the finder finds a fenced
    or an indented block under the heading at any level, and nothing where the heading is missing."""
    block = _readme_block()
    readme_lines = {line.strip() for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()}
    assert block.strip() and all(line.strip() in readme_lines for line in block.splitlines()), block
    for fence in (f"```python\n{block}```\n", f"~~~\n{block}~~~\n",
                  "".join(f"    {line}\n" if line.strip() else "\n" for line in block.splitlines())):
        for level in ("##", "###"):
            readme = (f"# Course\n\n## Quick start\n\n```\nmake lab\n```\n\n{level} In a hosted notebook (Colab)\n\n"
                      f"Paste this into the first cell:\n\n{fence}\nThen open lesson 1.\n\n## Grading\n\n```\nmake grade\n```\n")
            assert hosted_block(readme).strip() == block.strip(), (fence, level)
            assert hosted_block(readme.replace("In a hosted notebook", "Elsewhere")) is None


def test_the_readme_block_parses_into_steps_a_hosted_notebook_runs():
    """Every line of the README's block is a shell line, a %pip line or Python; it installs the course folder the
    block gets (cloned or uploaded) with a CUDA extra, and the Python lines put that folder on the path."""
    steps = parse(_readme_block())
    pips = [args for kind, args in steps if kind == "pip"]
    assert pips and pips[0][0] == "install", steps
    target = next((a for a in pips[0][1:] if not a.startswith("-")), None)
    assert target and re.fullmatch(r"[^\[\]]+\[cu1[23]\]", target), f"%pip install <the course folder>[cu12]: {pips[0]}"
    folder = target.split("[")[0]
    python = "\n".join(src for kind, src in steps if kind == "python")
    assert folder in python and "sys.path" in python, f"the Python lines put {folder!r} on sys.path: {python!r}"
    for kind, command in steps:
        if kind == "shell" and command.startswith("git clone"):
            assert shlex.split(command)[-1] == folder, f"the clone lands in the folder pip installs: {command!r}"
            assert as_committed(command).startswith("git clone") and f"file://{ROOT}" in as_committed(command)


# What the fresh environment's Python runs: a kernel started in the working folder (outside the clone) runs the
# block's Python lines, then every cell of lesson 1, then says where gpucourse was imported from.
DRIVER = r"""
import json, os, sys
import nbclient, nbformat

spec = json.loads(sys.argv[1])
lesson = nbformat.read(spec["notebook"], as_version=4)
cells = [nbformat.v4.new_code_cell(spec["first_cell"])] + lesson.cells + [nbformat.v4.new_code_cell(
    "import gpucourse, kernels, sys\nprint('GPUCOURSE ' + gpucourse.__file__)\nprint('KERNELS ' + kernels.__file__)\n"
    "print('PYTHON ' + sys.executable)")]
nb = nbformat.v4.new_notebook(cells=cells, metadata=lesson.metadata)
client = nbclient.NotebookClient(nb, timeout=spec["timeout"], kernel_name="python3",
                                 resources={"metadata": {"path": spec["cwd"]}})
error = ""
try:
    client.execute()
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"[-3000:]
last = "".join(o.get("text", "") for o in nb.cells[-1].get("outputs", []) if o.get("output_type") == "stream")
print(json.dumps({"error": error, "last": last}))
"""


def _run(cmd, *, cwd, env, timeout, what) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what} took over {timeout} s:\n{(exc.stdout or '')[-2000:]}")
    assert done.returncode == 0, f"{what} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def install_and_run_lesson_1(block: str, work: Path) -> dict:
    """Run ``block`` as a hosted notebook would, in ``work`` (its working folder), then lesson 1 in CPU mode in a
    kernel of the fresh environment; returns {"error", "last" (where the kernel imported the course from), "python",
    "seconds" (of each step)}."""
    work.mkdir(parents=True, exist_ok=True)
    venv = work.parent / "venv"
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "GPUCOURSE_MODE", "NUMBA_ENABLE_CUDASIM", "PYTHONHOME")
           and not k.startswith(("JUPYTER", "PYTEST", "GPUCOURSE_"))}
    env.update({"PATH": os.pathsep.join([str(venv / "bin"), env.get("PATH", "")]),
                "JUPYTER_DATA_DIR": str(work.parent / "jupyter-data"), "JUPYTER_CONFIG_DIR": str(work.parent / "jupyter"),
                "JUPYTER_RUNTIME_DIR": str(work.parent / "jupyter-runtime"), "IPYTHONDIR": str(work.parent / "ipython"),
                "MPLCONFIGDIR": str(work.parent / "mpl"), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                "TMPDIR": str(work.parent / "tmp")})  # pip's unpacked wheels go with the rest, removed at the end
    (work.parent / "tmp").mkdir(exist_ok=True)
    seconds = {}
    t0 = time.monotonic()
    _run([sys.executable, "-m", "venv", str(venv)], cwd=work, env=env, timeout=300, what="python -m venv")
    seconds["venv"] = time.monotonic() - t0
    first_cell = []
    for kind, what in parse(block):
        t0 = time.monotonic()
        if kind == "shell":
            command = as_committed(what)  # the clone's address replaced by this checkout
            _run(["bash", "-c", command], cwd=work, env=env, timeout=600, what=f"!{command}")
            seconds.setdefault("shell", 0.0)
            seconds["shell"] += time.monotonic() - t0
        elif kind == "pip":
            _run([str(python), "-m", "pip", *what], cwd=work, env=env, timeout=INSTALL_TIMEOUT,
                 what=f"%pip {shlex.join(what)}")
            seconds.setdefault("pip", 0.0)
            seconds["pip"] += time.monotonic() - t0
        else:
            first_cell.append(what)
    clone = next(p for p in work.iterdir() if (p / NOTEBOOK).is_file())
    elsewhere = work  # the kernel's working folder: the folder that holds the clone, not the clone
    spec = {"notebook": str(clone / NOTEBOOK), "first_cell": "\n".join(first_cell), "cwd": str(elsewhere),
            "timeout": CELL_TIMEOUT}
    t0 = time.monotonic()
    done = _run([str(python), "-c", DRIVER, json.dumps(spec)], cwd=work,
                env={**env, "GPUCOURSE_MODE": "cpu"}, timeout=CELL_TIMEOUT * 4, what="lesson 1 in the fresh environment")
    seconds["lesson 1"] = time.monotonic() - t0
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, "clone": str(clone), "python": str(python), "seconds": seconds}


@pytest.mark.slow
def test_the_readme_block_installs_the_course_into_a_fresh_python():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = hosted_block(readme)
    if block is None:
        pytest.skip(f"README.md has no section {HEADING!r} with a code block yet")
    assert any(kind == "pip" for kind, _ in parse(block)), block
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, timeout=60).returncode:
        pytest.skip(f"{ROOT} is not a git checkout: the block clones the course")
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if free < DISK_NEEDED:
        pytest.skip(f"a second install of the course needs about {DISK_NEEDED / 2**30:.0f} GB free under "
                    f"{tempfile.gettempdir()}, and it has {free / 2**30:.1f} GB (set TMPDIR to a larger disk)")
    private = Path(tempfile.mkdtemp(prefix="gpucourse-hosted-"))  # several GB: removed at once, not kept by pytest
    try:
        got = install_and_run_lesson_1(block, private / "content")
    finally:
        shutil.rmtree(private, ignore_errors=True)
    print(f"hosted install: {json.dumps({k: round(v, 1) for k, v in got['seconds'].items()})}")
    assert not got["error"], got["error"]
    clone = Path(got["clone"])
    imported = dict(line.split(" ", 1) for line in got["last"].splitlines() if " " in line)
    assert Path(imported["GPUCOURSE"]).is_relative_to(clone), imported  # the clone's code, not this checkout's
    assert Path(imported["KERNELS"]).is_relative_to(clone), imported
    assert Path(imported["PYTHON"]).parent == Path(got["python"]).parent, imported

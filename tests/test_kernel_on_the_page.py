"""The kernel on the page: every notebook cell that holds the course's code is the code the modules run.

A code cell whose first line names a file of the course, ``# kernels/vector_multiply.py`` (any words may follow),
holds functions or classes of that module: each must be the module's own source, decorators included. A cell
whose first line is ``# kernels/cuda/<file>.cu, region NAME`` holds one string, the text of that region of the
file (gpucourse.cuda_c.region). So a learner reads the real kernel before running anything, edits and re-runs
it, and the lesson cannot drift from what the tests and benchmarks check.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from gpucourse import cuda_c, notebooks

ROOT = Path(__file__).resolve().parents[1]
LESSONS = notebooks.core_notebooks()
NOTEBOOKS = LESSONS + notebooks.deep_dives() + sorted(ROOT.glob("solutions/[0-9][0-9]_*/*.ipynb"))
HEADER = re.compile(r"^# ((?:kernels|systems|benchmarks|gpucourse)/[\w/]+\.(py|cuh|cu))(?:, region ([\w.-]+))?")


def code_cells(path: Path) -> list:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def sourced_cells(path: Path) -> list:
    """(cell index, file, region or None, cell text) of every cell that says it holds a file's code."""
    out = []
    for i, text in enumerate(code_cells(path)):
        m = HEADER.match(text)
        if m:
            out.append((i, m.group(1), m.group(3), text))
    return out


def _definitions(text: str) -> dict:
    """{name: source with decorators} of the top-level functions and classes of ``text``."""
    tree = ast.parse(text)
    lines = text.splitlines()
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            out[node.name] = "\n".join(lines[first - 1:node.end_lineno])
    return out


def _module_definitions(file: str) -> dict:
    """The file's definitions, read without importing it: a module of Triton kernels imports triton, which aborts a
    process that holds TensorFlow (both carry LLVM), as this suite's may."""
    return _definitions((ROOT / file).read_text())


def mismatches(path: Path) -> list:
    """What differs between the notebook's sourced cells and the files they name (empty when in step)."""
    wrong = []
    for i, file, region, text in sourced_cells(path):
        where = f"{path.name} code cell {i} ({file}{', region ' + region if region else ''})"
        if file.endswith(".py"):
            if region:
                wrong.append(f"{where}: a Python file has no regions; name the module alone")
                continue
            cell, module = _definitions(text), _module_definitions(file)
            if not cell:
                wrong.append(f"{where}: defines no function or class")
            for name, src in cell.items():
                if name not in module:
                    wrong.append(f"{where}: {name} is not defined at the top of {file}")
                elif src != module[name]:
                    wrong.append(f"{where}: {name} differs from {file}")
        else:
            if not region:
                wrong.append(f"{where}: name the region (# {file}, region NAME)")
                continue
            strings = [n.value.value for n in ast.parse(text).body
                       if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)]
            if len(strings) != 1:
                wrong.append(f"{where}: holds {len(strings)} strings, not one")
            elif strings[0].strip("\n") != cuda_c.region(Path(file).name, region):
                wrong.append(f"{where}: differs from the region in {file}")
    return wrong


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_sourced_cells_are_the_code_the_modules_run(path):
    assert not mismatches(path), "\n".join(mismatches(path))


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_every_lesson_puts_its_kernels_in_code_cells(path):
    """Each lesson holds the code it teaches in cells, and none prints it as output instead (inspect.getsource, or
    a .cu file cut between comment strings)."""
    cells = code_cells(path)
    assert sourced_cells(path), f"{path.name} holds none of the course's code in a cell"
    printed = [i for i, t in enumerate(cells) if "getsource(" in t or re.search(r"\.index\([\"']//", t)]
    assert not printed, f"{path.name}: cells {printed} print code as output; put it in a cell (# <file> header)"


def test_every_region_of_a_cuda_source_is_on_a_page():
    """Every region marked in kernels/cuda/ is held by a notebook cell or shown with cuda_c.show."""
    on_page = set()
    for path in NOTEBOOKS:
        on_page |= {(Path(f).name, r) for _, f, r, _ in sourced_cells(path) if r}
        for text in code_cells(path):
            on_page |= {(f if f.endswith((".cu", ".cuh")) else f + ".cu", r)
                        for f, r in re.findall(r"cuda_c\.show\(\"([\w.]+)\", \"([\w.-]+)\"\)", text)}
    marked = {(p.name, r) for p in sorted(cuda_c.SOURCES.iterdir()) if p.suffix in (".cu", ".cuh")
              for r in cuda_c.regions(p.name)}
    assert marked, "no source in kernels/cuda marks a region"
    assert not marked - on_page, f"regions no notebook shows: {sorted(marked - on_page)}"


def test_the_check_catches_drift(tmp_path):
    """A cell one character away from the module, or from the region, is caught; an exact copy passes."""
    nb = {"cells": [
        {"cell_type": "code", "source": "# kernels/vector_multiply.py\ndef multiply_spec(a, b):\n"
                                        "    return a + b\n", "metadata": {}, "outputs": [], "execution_count": None},
    ], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path_tmp = tmp_path / "drift.ipynb"
    path_tmp.write_text(json.dumps(nb))
    assert any("multiply_spec differs" in m for m in mismatches(path_tmp))
    name, region = next((p.name, r) for p in sorted(cuda_c.SOURCES.glob("*.cu")) for r in cuda_c.regions(p.name))
    good = cuda_c.region(name, region)
    for text, ok in ((good, True), (good.replace(";", " ;", 1), False)):
        nb["cells"][0]["source"] = f"# kernels/cuda/{name}, region {region}\nSRC = r\"\"\"\n{text}\n\"\"\"\n"
        path_tmp.write_text(json.dumps(nb))
        assert (mismatches(path_tmp) == []) == ok, mismatches(path_tmp)

"""Notebooks: committed clean, every lesson a complete slice, every lesson notebook runs top to bottom."""
import json
import re
from pathlib import Path

import pytest

from gpucourse import notebooks, runtime

ROOT = Path(__file__).resolve().parents[1]
LESSONS = [p.stem for p in notebooks.core_notebooks()]
COMMITTED = sorted(ROOT.glob("notebooks/*.ipynb")) + sorted(ROOT.glob("solutions/*/*.ipynb")) \
    + sorted(ROOT.glob("exercises/*/*.ipynb"))


def test_there_are_lessons():
    assert "01_vector_multiply" in LESSONS


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and (c.get("outputs") or c.get("execution_count"))]
    assert not dirty, f"cells {dirty} carry outputs: clear them before committing"


@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_is_a_complete_slice(lesson):
    """A newcomer finds lesson NN by its number in every room of the house."""
    number = lesson[:2]
    assert list(ROOT.glob(f"solutions/{lesson}/*.ipynb")), "no nbgrader source in solutions/"
    assert list(ROOT.glob(f"exercises/{lesson}/*.ipynb")), "no generated exercise in exercises/"
    assert list(ROOT.glob(f"tests/test_{number}_*.py")), "no tests/test_NN_*.py"
    topic = lesson[3:]  # one name in every room: kernels, benchmarks, tests, solutions, results
    assert (ROOT / "kernels" / f"{topic}.py").exists() or (ROOT / "kernels" / topic).is_dir(), f"no kernels/{topic}"
    assert (ROOT / "benchmarks" / f"{topic}.py").exists(), f"no benchmarks/{topic}.py"
    assert list(ROOT.glob(f"tests/test_{lesson}*.py")), f"no tests/test_{lesson}*.py"
    assert list(ROOT.glob(f"solutions/{lesson}/{topic}.ipynb")), f"no solutions/{lesson}/{topic}.ipynb"
    assert list(ROOT.glob(f"results/*/{lesson}.json")), f"no results/<gpu>/{lesson}.json"


def test_every_deep_dive_belongs_to_a_lesson():
    for path in notebooks.deep_dives():
        assert notebooks.lesson_of(path) in LESSONS, f"{path.name}: no core notebook {notebooks.lesson_of(path)}.ipynb"


@pytest.mark.parametrize("path", notebooks.core_notebooks() + notebooks.deep_dives()
                         + sorted(ROOT.glob("solutions/*/*.ipynb")), ids=lambda p: p.name)
def test_first_code_cell_is_the_probe(path):
    nb = json.loads(path.read_text())
    first = next("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert re.search(rf'setup\(.*lesson="{notebooks.lesson_of(path)}"', first), "start with gpucourse.setup(lesson=...)"


def test_wide_printed_lines_are_found():
    """What a cell prints wider than a notebook cell is reported; what renders as HTML or an image is not."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="short\n" + "w" * 101 + "\n"),
                           nbformat.v4.new_output("display_data", data={"text/plain": "p" * 120,
                                                                        "text/html": "<table></table>"}),
                           nbformat.v4.new_output("execute_result", data={"text/plain": "r" * 130}, execution_count=1)]
    assert notebooks.wide_lines(nb) == ["cell 0: " + "w" * 101, "cell 0: " + "r" * 130]


@pytest.mark.slow
@pytest.mark.parametrize("path", notebooks.core_notebooks() + notebooks.deep_dives(), ids=lambda p: p.stem)
def test_lesson_notebook_runs(path):
    """Every core notebook and deep dive runs top to bottom in this machine's mode, and nothing it prints is wider
    than a notebook cell."""
    outcome = notebooks.execute(path, mode=runtime.get().mode, timeout=600)
    assert outcome.ok, outcome.error
    assert not outcome.wide, f"printed lines wider than {notebooks.WIDTH} characters:\n" + "\n".join(outcome.wide[:10])

"""Notebooks: committed clean, every lesson a complete slice, every lesson notebook runs top to bottom."""
import json
import re
from pathlib import Path

import pytest

from gpucourse import notebooks, runtime

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted(p.stem for p in ROOT.glob("notebooks/[0-9][0-9]_*.ipynb"))
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


@pytest.mark.parametrize("path", [ROOT / f"notebooks/{n}.ipynb" for n in LESSONS]
                         + sorted(ROOT.glob("solutions/*/*.ipynb")), ids=lambda p: p.name)
def test_first_code_cell_is_the_probe(path):
    nb = json.loads(path.read_text())
    first = next("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    lesson = path.stem if path.parent.name == "notebooks" else path.parent.name
    assert re.search(rf'setup\(.*lesson="{lesson}"', first), "start with gpucourse.setup(lesson=...)"


@pytest.mark.slow
@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_notebook_runs(lesson):
    outcome = notebooks.execute(ROOT / f"notebooks/{lesson}.ipynb", mode=runtime.get().mode, timeout=600)
    assert outcome.ok, outcome.error

"""Practice cells (gpucourse/practice.py): every "your turn" cell of a core notebook fails its check as committed
(the learner has something to do, and the notebook run goes on) and passes with the answer folded below it."""
from __future__ import annotations

from pathlib import Path

import pytest

from gpucourse import notebooks, practice

ROOT = Path(__file__).resolve().parents[1]
CELLS = [(path, i, cell, answer) for path in notebooks.core_notebooks()
         for i, (cell, answer) in enumerate(practice.cells(path))]


def _id(item) -> str:
    return f"{item[0].stem}-practice{item[1] + 1}"


@pytest.mark.parametrize("item", CELLS, ids=_id)
def test_a_practice_cell_is_blank_and_its_answer_passes(item):
    path, _, cell, answer = item
    assert practice.BLANK in cell, f"a practice cell holds a stub marked {practice.BLANK!r}"
    assert answer, "the answer is folded in the markdown cell after the practice cell: <details> with a python block"
    blank = practice.run(cell)  # must not raise: the notebook run goes on past a blank cell
    assert blank and not any(blank), f"as committed, each check reports 'not yet': {blank}"
    solved = practice.run(practice.with_answer(cell, answer))
    assert solved and all(solved), f"with the folded answer every check passes: {solved}"


def test_every_core_notebook_has_at_least_three():
    from pathlib import Path

    cores = sorted(p.name for p in (Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb")
                   if not p.stem.endswith("_deep_dive"))
    counts = {name: 0 for name in cores}
    for path, *_ in CELLS:
        counts[path.name] = counts.get(path.name, 0) + 1
    assert len(cores) >= 10 and all(n >= 3 for n in counts.values()), counts


def test_check_reports_and_never_raises(capsys):
    import numpy as np

    assert practice.check("equal", 3, 3)
    assert not practice.check("unequal", 2, 3)
    assert not practice.check("raises", lambda: 1 / 0, 1)
    assert not practice.check("array", np.zeros(4), np.arange(4.0))
    assert practice.check("checker", 5, lambda v: v > 4)
    assert not practice.check("checker message", 3, lambda v: v > 4 or "too small")
    out = capsys.readouterr().out
    assert "ok: equal" in out and "not yet: unequal: got 2, expected 3" in out and "ZeroDivisionError" in out
    assert "not yet: checker message: too small" in out


def test_with_answer_replaces_the_stubs():
    cell = "import x\n\ndef f(a):\n    # your code here\n    return None\n\nK = 0\npractice.check('f', f(1), 2)\n"
    answer = "def f(a):\n    return a + 1\n"
    filled = practice.with_answer(cell, answer)
    assert "return a + 1" in filled and "your code here" not in filled and filled.endswith("practice.check('f', f(1), 2)\n")
    with pytest.raises(ValueError):
        practice.with_answer(cell, "def g():\n    pass\n")


def test_a_report_fits_a_notebook_cell(capsys):
    import numpy as np

    from gpucourse import notebooks

    result = practice.check("long", lambda: np.ones(3) @ np.ones((4, 2)), 1)
    line = capsys.readouterr().out.rstrip("\n")
    assert not result and "\n" not in line and len(line) <= notebooks.WIDTH == practice.WIDTH, line
    assert line.startswith("not yet: long: ValueError") and len(result.message) > len(line) - len("not yet: long: ")
    practice.check("array", np.full(3, np.nan, np.float32), np.array([0.1, 0.2, 0.3], np.float32))
    assert "got nan, expected 0.1\n" in capsys.readouterr().out


def test_a_cell_ending_with_a_check_shows_only_the_printed_line():
    from IPython.core.formatters import DisplayFormatter

    assert DisplayFormatter().format(practice.Result("x", False, "a long message")) == ({}, {})

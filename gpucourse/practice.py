"""Practice cells: "your turn" cells in a core notebook, checked at once, never graded.

A practice cell is a code cell tagged ``practice`` (``"metadata": {"tags": ["practice"]}``). It is self-contained
(it imports what it uses), holds a stub the learner fills (a function or kernel whose body is ``# your code here``),
and ends with a visible check::

    from gpucourse import practice
    practice.check("flip left-right", got, expected)          # a value against the answer
    practice.check("sectors of a column", predict, 32)         # a function, called with no arguments
    practice.check("no conflicts", ways, lambda w: w == 1 or f"{w}-way conflict")  # a checker

``check`` never raises: a blank or wrong cell prints ``not yet: ...`` with what differs, so a notebook run (CI
runs every notebook) goes on; a right one prints ``ok: ...``. Either way it returns a :class:`Result` (truthy when
passed) and appends it to :data:`LOG`.

The answer is folded in the markdown cell right after the practice cell, in a ``<details>`` block holding one
fenced ``python`` block: the filled-in definitions. :func:`cells` finds each (practice cell, answer) pair of a
notebook; :func:`with_answer` puts the answer's definitions in place of the stubs of the same name; :func:`run`
executes a cell's text and returns the results its checks logged. A test runs each practice cell twice, as
committed (every check must report "not yet") and with its answer (every check must pass): see
tests/test_practice.py.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from pathlib import Path

TAG = "practice"
BLANK = "# your code here"


@dataclass
class Result:
    name: str
    passed: bool
    message: str

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:  # short: a cell that ends in a check shows it as its value
        return f"<practice check {self.name!r}: {'ok' if self.passed else 'not yet'}>"


LOG: list[Result] = []


def _compare(got, expected) -> str | None:
    """None when ``got`` matches ``expected`` (arrays: same shape and close values), else what differs."""
    import numpy as np

    if isinstance(expected, np.ndarray) or isinstance(got, np.ndarray):
        if got is None:
            return "got None (is the cell still blank?)"
        if hasattr(got, "copy_to_host"):
            got = got.copy_to_host()
        got, expected = np.asarray(got), np.asarray(expected)
        if got.shape != expected.shape:
            return f"shape {got.shape}, expected {expected.shape}"
        if np.issubdtype(expected.dtype, np.floating):
            bad = ~np.isclose(got, expected, rtol=1e-5, atol=1e-6)
        else:
            bad = got != expected
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            return (f"{int(bad.sum())} of {bad.size} elements differ; first at index {where}: "
                    f"got {got[where]!r}, expected {expected[where]!r}")
        return None
    if isinstance(expected, float) and isinstance(got, (int, float)):
        return None if abs(got - expected) <= 1e-6 * max(1.0, abs(expected)) else f"got {got!r}, expected {expected!r}"
    return None if got == expected else f"got {got!r}, expected {expected!r}"


def check(name: str, got, expected) -> Result:
    """Check a practice cell's answer and say so; never raises.

    ``got``: a value, or a function called with no arguments (its exceptions are reported, not raised).
    ``expected``: the value it should equal (NumPy arrays are compared elementwise, floats closely), or a checker:
    a function of the value returning True, or False / a message saying what is wrong.
    """
    try:
        value = got() if callable(got) else got
        if callable(expected):
            verdict = expected(value)
            problem = None if verdict is True else (verdict if isinstance(verdict, str) and verdict
                                                    else f"got {value!r}")
        else:
            problem = _compare(value, expected)
    except Exception as e:  # the learner's code failed: report it, let the notebook go on
        problem = f"{type(e).__name__}: {e}"
    result = Result(name, problem is None, "ok" if problem is None else problem)
    LOG.append(result)
    _say(f"ok: {name}" if result.passed else f"not yet: {name}: {problem}")
    return result


def _say(text: str) -> None:
    """Print ``text`` wrapped to the width of a notebook cell (a long message, a long array, stays readable)."""
    import textwrap

    from gpucourse.notebooks import WIDTH

    for line in text.splitlines() or [""]:
        print(textwrap.fill(line, WIDTH, subsequent_indent="    ", break_long_words=True, break_on_hyphens=False))


# --- for tests: the practice cells of a notebook, their answers, and running them ---------------------------------

def _source(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def cells(path) -> list[tuple[str, str]]:
    """(practice cell's text, its answer's text) for every practice cell of the notebook at ``path``."""
    nb = json.loads(Path(path).read_text())["cells"]
    out = []
    for i, cell in enumerate(nb):
        if cell["cell_type"] == "code" and TAG in cell.get("metadata", {}).get("tags", []):
            after = _source(nb[i + 1]) if i + 1 < len(nb) and nb[i + 1]["cell_type"] == "markdown" else ""
            m = re.search(r"<details>.*?```python\n(.*?)```.*?</details>", after, re.S)
            out.append((_source(cell), m.group(1) if m else ""))
    return out


def _definitions(text: str) -> dict:
    lines = text.splitlines()
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) or (
                isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            name = node.name if not isinstance(node, ast.Assign) else node.targets[0].id
            first = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
            out[name] = (first, node.end_lineno, "\n".join(lines[first - 1:node.end_lineno]))
    return out


def with_answer(cell: str, answer: str) -> str:
    """``cell`` with each top-level definition (function, class, or ``NAME = ...``) that ``answer`` also defines
    replaced by the answer's."""
    stubs, filled = _definitions(cell), _definitions(answer)
    missing = set(filled) - set(stubs)
    if missing:
        raise ValueError(f"the answer defines {sorted(missing)}, which the practice cell does not")
    lines = cell.splitlines()
    for name in sorted(filled, key=lambda n: -stubs[n][0]):  # bottom-up keeps line numbers valid
        first, last, _ = stubs[name]
        lines[first - 1:last] = filled[name][2].splitlines()
    return "\n".join(lines) + "\n"


def run(text: str) -> list[Result]:
    """Execute a cell's text in a fresh namespace; the results its checks logged."""
    start = len(LOG)
    exec(compile(text, "<practice cell>", "exec"), {"__name__": "__practice__"})
    return LOG[start:]

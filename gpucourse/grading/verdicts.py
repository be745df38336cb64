"""Scores are deterministic (``cell_verdict``; nbgrader's ``determine_grade`` is replaced)
    * A test cell that shows an error, or any output on stderr other than a Python warning
      (``WARNING_PATTERN``), scores 0 (nbgrader's rule).
    * Otherwise its value is its score only when the test's own source ends with an expression, and then
      only the *last* value it shows counts (nbgrader takes the first, which learner code could have put
      there with sys.displayhook). A number between 0 and the test's points is the score; a number outside
      that range, NaN or infinity scores 0 (nbgrader would give full marks for a negative value or NaN, and
      stop grading the notebook on one above the points); anything that is not a plain number (a NumPy
      scalar's repr ``np.float64(0.5)`` among them) gives full marks, as in nbgrader, so a test cell must
      end with a Python float: ``performance_points`` returns one.
    * Performance tests (grade_id ``perf_*``, ``PERF_PREFIX``) score 0 in CPU mode whatever their value, and
      are reported "not gradable here (needs a GPU)"; the report gives the score out of the total and out
      of what CPU mode can grade. On a GPU machine with fewer GPUs than a performance test needs, the
      test prints ``GPUS_PERF_MESSAGE`` (``gpus_missing``) and is "not gradable here (needs more GPUs)"; on a
      GPU that cannot run the lesson step a performance test times (gpucourse.gpus), it prints
      ``STEP_PERF_MESSAGE`` (``step_missing``) and is "not gradable here (needs a newer GPU)".
    * Any test whose own (locked) source calls ``software_missing`` and which printed ``SOFTWARE_MESSAGE`` without an
      error is "not gradable here (needs software this machine lacks)": 0 points, left out of the gradable total,
      e.g. a Triton test where neither a GPU nor PyTorch for Triton's interpreter is there. A test that does not
      call it and prints the line is graded as usual.
    * Likewise any test whose own source calls ``needs_gpus`` and which printed ``GPUS_MESSAGE`` without an error
      is "not gradable here (needs more GPUs)", in either mode: a check of results on several GPUs.
"""
from __future__ import annotations

from .text import as_text, first_lines  # noqa: F401 (used here and by the rooms that import it from here)

import ast
import re

from .integrity import transform_ipython
from .reports import number
from .settings import (CPU_PERF_MESSAGE, GPUS_MESSAGE, GPUS_PERF_MESSAGE, NOT_GRADABLE, NOT_GRADABLE_ARCH, NOT_GRADABLE_GPUS,
                       NOT_GRADABLE_SOFTWARE, PERF_PREFIX, SOFTWARE_MESSAGE, STEP_PERF_MESSAGE, ANSI)


def clip_text(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars] + f"... [{len(text) - chars} more characters]"



_PLAIN_NUMBER = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?$|^[+-]?(?:nan|inf)$")


def cell_verdict(cell, max_points: float, mode: str | None, event=None) -> tuple[float | None, str, str]:
    """Points (None: needs manual grading), status and message for one graded cell of an autograded
    notebook; the rules are in this module's docstring. ``event``: (status, message) the guarded executor
    recorded for this cell (kernel died, timed out, not run)."""
    meta = cell.get("metadata", {}).get("nbgrader", {})
    grade_id = meta.get("grade_id", "")
    outputs = cell.get("outputs", [])
    stdout = as_text([as_text(o.get("text")) for o in outputs
                    if o.get("output_type") == "stream" and o.get("name") == "stdout"])
    said = [line for line in stdout.splitlines() if line.startswith("performance:")]
    if grade_id.startswith(PERF_PREFIX) and mode == "cpu":
        line = said[-1] if said and "not gradable" in said[-1] else CPU_PERF_MESSAGE.format(points=number(max_points))
        return 0.0, NOT_GRADABLE, line
    if event:
        return 0.0, event[0], event[1]
    lacking = [line for line in stdout.splitlines() if line.startswith(SOFTWARE_MESSAGE.split("{")[0])]
    if lacking and "software_missing(" in as_text(cell.get("source")) \
            and not any(o.get("output_type") == "error" for o in outputs):
        return 0.0, NOT_GRADABLE_SOFTWARE, lacking[-1]
    too_few = [line for line in stdout.splitlines() if line.startswith(GPUS_MESSAGE.split("{")[0])]
    if too_few and "needs_gpus(" in as_text(cell.get("source")) \
            and not any(o.get("output_type") == "error" for o in outputs):
        return 0.0, NOT_GRADABLE_GPUS, too_few[-1]
    if grade_id.startswith(PERF_PREFIX) and said and said[-1].startswith(GPUS_PERF_MESSAGE.split("{")[0]) \
            and not any(o.get("output_type") == "error" for o in outputs):
        return 0.0, NOT_GRADABLE_GPUS, said[-1]
    if grade_id.startswith(PERF_PREFIX) and said and said[-1].startswith(STEP_PERF_MESSAGE.split("{")[0]) \
            and not any(o.get("output_type") == "error" for o in outputs):
        return 0.0, NOT_GRADABLE_ARCH, said[-1]
    if cell.get("cell_type") != "code" or meta.get("solution") or meta.get("task"):
        return None, "needs manual grading", ""
    errors = [o for o in outputs if o.get("output_type") == "error"]
    if errors:
        if any(e.get("ename") == "CellTimeoutError" for e in errors):
            return 0.0, "timed out", "no result in time; the cell was interrupted"
        e = errors[0]
        message = e.get("ename", "Error") + (f": {first_lines(e.get('evalue', ''))}" if e.get("evalue") else "")
        return 0.0, "failed", message
    stderr = [as_text(o.get("text")) for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stderr"]
    if stderr:
        return 0.0, "failed", ("wrote to stderr, which nbgrader scores as a failure: "
                               + (first_lines("".join(stderr)) or "(empty)"))
    message = said[-1] if said else ""
    results = [o for o in outputs if o.get("output_type") == "execute_result"]
    if results and _ends_with_expression(as_text(cell.get("source"))):
        shown = as_text((results[-1].get("data") or {}).get("text/plain")).strip()
        if _PLAIN_NUMBER.match(shown):
            value = float(shown)
            if not 0 <= value <= max_points:
                return 0.0, "failed", (f"the test's value {clip_text(shown, 40)} is not a number of points between 0 "
                                       f"and {number(max_points)}")
            if value < max_points:
                return value, "partial" if value > 0 else "failed", \
                    message or f"the cell's value gave {number(value)} of {number(max_points)} points"
            return float(max_points), "passed", message or "passed"
    return float(max_points), "passed", message or "passed"


def _ends_with_expression(source: str) -> bool:
    try:
        tree = compile(transform_ipython(source), "<test>", "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except (SyntaxError, ValueError):
        return False
    return bool(tree.body) and isinstance(tree.body[-1], ast.Expr) and not source.rstrip().endswith(";")



def notebook_tests(cells, mode: str | None) -> tuple[list, list[str]]:
    """The verdict of every test cell of an executed notebook, scored as the grader scores it (``cell_verdict``,
    after nbgrader's rule that a Python warning on stderr is no failure), without a gradebook: what
    ``python -m gpucourse run`` lists for a notebook with nbgrader's test cells. Returns (``TestResult`` per test
    cell, in order; a note per answer cell that raised an error)."""
    import re

    from .reports import TestResult
    from .settings import WARNING_PATTERN

    tests, notes = [], []
    for cell in cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.get("cell_type") != "code" or not meta.get("grade_id"):
            continue
        outputs = [o for o in cell.get("outputs", []) if not (
            o.get("output_type") == "stream" and o.get("name") == "stderr"
            and re.search(WARNING_PATTERN, as_text(o.get("text"))))]
        cell = {**cell, "outputs": outputs}
        if meta.get("grade") and not meta.get("solution"):
            points = float(meta.get("points", 0) or 0)
            if cell.get("execution_count") is None and not outputs:  # the run stopped before it
                tests.append(TestResult(grade_id=meta["grade_id"], points=0.0, max_points=points, status="not run",
                                        message="the notebook stopped before this test (see its error)"))
                continue
            got, status, message = cell_verdict(cell, points, mode)
            tests.append(TestResult(grade_id=meta["grade_id"], points=float(got or 0.0), max_points=points,
                                    status=status, message=message))
        elif meta.get("solution"):
            errors = [o for o in outputs if o.get("output_type") == "error"]
            if errors:
                e = errors[0]
                notes.append(f"your answer in cell {meta['grade_id']} raised "
                             + e.get("ename", "Error") + (f": {first_lines(e.get('evalue', ''), 1)}"
                                                          if e.get("evalue") else ""))
    return tests, notes

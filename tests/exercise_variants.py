"""Building learner submissions from a lesson's solution notebook, and grading a set of them: what every
lesson's exercise tests share (tests/test_grading.py for lesson 1, tests/test_NN_exercises.py for the rest)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat

from gpucourse import grading


def replace_in_cell(nb, cell_id: str, old: str, new: str) -> None:
    """Edit the cell with id ``cell_id``: ``old`` must be there (else the solution changed under the test)."""
    cell = next(c for c in nb.cells if c.get("id") == cell_id)
    assert old in cell.source, f"{old!r} is not in cell {cell_id}: the solution notebook changed"
    cell.source = cell.source.replace(old, new)


def learner_copy(tmp: Path, solution: Path, edit=None) -> Path:
    """The solution notebook as a learner would hand it in (outputs cleared), optionally edited by
    ``edit(nb)``, saved as tmp/<edit's name>/<lesson>/<notebook> (the folder names the lesson)."""
    nb = nbformat.read(solution, as_version=4)
    if edit is not None:
        edit(nb)
    path = tmp / (edit.__name__ if edit else "solution") / solution.parent.name / solution.name
    path.parent.mkdir(parents=True)
    nbformat.write(nb, path)
    return path


def grade_all(jobs: dict, *, timeout: int, workers: int = 2) -> dict:
    """{name: GradeReport, or the exception grading raised} for {name: notebook path}, graded in CPU mode,
    ``workers`` at a time."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {name: pool.submit(grading.grade, path, timeout=timeout, mode="cpu") for name, path in jobs.items()}
        return {name: f.result() if f.exception() is None else f.exception() for name, f in futures.items()}


def graded_variants(tmp: Path, solution: Path, exercise: Path, variants, *, timeout: int) -> dict:
    """The solution, the released exercise and every variant (functions that edit the solution), graded."""
    jobs = {"solution": learner_copy(tmp, solution), "exercise": exercise}
    jobs.update({v.__name__: learner_copy(tmp, solution, v) for v in variants})
    return grade_all(jobs, timeout=timeout)

"""The grader's commands: ``python -m gpucourse grade``, ``grade-class`` and ``exercises``.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from .. import runtime
from .autograde import grade, grade_class
from .exercises import check_exercises, generate_exercises
from .settings import DEFAULT_NOTEBOOK_TIMEOUT, DEFAULT_TIMEOUT, REPO


def grade_cli(path, *, mode: str | None = None, timeout: int | None = None, as_json: bool = False,
              notebook_timeout: int | None = None) -> int:
    """`python -m gpucourse grade NB`: print the report; 0 when graded (whatever the score), 2 when not."""
    try:
        report = grade(path, mode=mode, timeout=timeout or DEFAULT_TIMEOUT,
                       notebook_timeout=notebook_timeout or DEFAULT_NOTEBOOK_TIMEOUT)
    except runtime.CourseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=1) if as_json else report.format())
    return 0


def grade_class_cli(folder, *, assignment: str | None = None, course_dir=None, mode: str | None = None,
                    timeout: int | None = None, notebook_timeout: int | None = None, workers: int | None = None,
                    as_json: bool = False) -> int:
    """`python -m gpucourse grade-class FOLDER`: progress while grading, then the class's scores; 0 when
    every submission was graded, 1 when some could not be, 2 when grading could not start."""
    try:
        report = grade_class(folder, assignment=assignment, course_dir=course_dir, mode=mode,
                             timeout=timeout or DEFAULT_TIMEOUT,
                             notebook_timeout=notebook_timeout or DEFAULT_NOTEBOOK_TIMEOUT, workers=workers,
                             progress=(lambda line: print(line, file=sys.stderr, flush=True)) if as_json else True)
    except runtime.CourseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps({"assignment": report.assignment, "course_dir": report.course_dir, "mode": report.mode,
                          "seconds": report.seconds, "errors": report.errors,
                          "reports": {s: r.as_dict() for s, r in report.reports.items()}}, indent=1))
    else:
        print()
        print(report.format())
    return 1 if report.errors else 0


def exercises_cli(*, check: bool = False, assignments: Sequence[str] | None = None) -> int:
    """`python -m gpucourse exercises [--check]`: regenerate exercises/, or list how it differs (exit 1)."""
    try:
        if check:
            diffs = check_exercises(assignments)
            for d in diffs:
                print(d)
            print("exercises/ is in step with solutions/" if not diffs else
                  f"{len(diffs)} difference(s); regenerate with: python -m gpucourse exercises")
            return 1 if diffs else 0
        for path in generate_exercises(assignments):
            print(f"wrote {path.relative_to(REPO)}/")
        return 0
    except runtime.CourseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

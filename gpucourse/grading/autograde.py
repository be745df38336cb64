"""Grading one notebook (``grade``) and a class's submissions (``grade_class``): finding the source,
collecting submissions, and handing them to the workers.
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .. import runtime
from .course import assignment_dirs, claim_course_dir, make_course_dir, resolve_mode
from .pool import Course, report_from
from .reports import ClassReport, GradeReport
from .settings import (
    DEFAULT_NOTEBOOK_TIMEOUT, DEFAULT_TIMEOUT, GradingError, Limits, REPO, SOLUTIONS, STUDENT, STUDENT_PATTERN)
from .submissions import grade_id_of, read_notebook


def grade(notebook_path, *, timeout: int = DEFAULT_TIMEOUT, mode: str | None = None, source=None,
          workdir=None, notebook_timeout: int = DEFAULT_NOTEBOOK_TIMEOUT) -> GradeReport:
    """Grade one learner notebook with nbgrader's autograder; see the package's docstring (gpucourse/grading/__init__.py).

    timeout: seconds each cell may run before it is interrupted (its test then scores 0).
    notebook_timeout: seconds all the cells may run together; cells past it are not run.
    mode: "cpu" or "gpu" for the notebook's kernel; default: GPUCOURSE_MODE, else CPU if this process runs
        the CUDA simulator, else GPU when one is usable.
    source: the nbgrader source notebook; default solutions/<learner's folder>/<learner's file name>.
    workdir: build the course directory there and keep it (for looking at nbgrader's files); default a
        temporary directory, removed afterwards.
    Raises CourseInputError for a file that is not an exercise notebook, GradingError when nbgrader itself
    could not run; anything the notebook does is a score and a message in the report.
    """
    learner = Path(notebook_path).resolve()
    if not learner.is_file():
        raise runtime.CourseInputError(f"no notebook at {notebook_path}")
    source = _source_for(learner, source)
    if learner.name != source.name:
        raise runtime.CourseInputError(f"the learner notebook must be named {source.name}, not {learner.name}")
    nb = read_notebook(learner)
    if not any(grade_id_of(c) for c in nb["cells"]):
        raise runtime.CourseInputError(
            f"{notebook_path} has none of the exercise's cells: work in a copy of "
            f"exercises/{source.parent.name}/{source.name}, which carries what the grader needs")
    limits = Limits(timeout=int(timeout), notebook_timeout=int(notebook_timeout))
    resolved = resolve_mode(mode)
    with make_course_dir(workdir) as root:
        course = Course(root, source, resolved, limits, deny=[learner.parent])
        with course.workers(1) as (worker,):
            course.generate(worker)
            answer = course.grade_one(worker, STUDENT, learner)
        if answer.get("ok"):
            return report_from(answer, learner, course.assignment)
        raise GradingError(f"{learner.name} could not be graded: {answer.get('error', 'no reason given')}",
                           answer.get("log", ""))


def grade_class(folder, *, assignment: str | None = None, course_dir=None, mode: str | None = None,
                timeout: int = DEFAULT_TIMEOUT, notebook_timeout: int = DEFAULT_NOTEBOOK_TIMEOUT,
                workers: int | None = None, progress: Callable[[str], None] | bool | None = True) -> ClassReport:
    """Autograde a class's submissions of one exercise into a real nbgrader gradebook, export grades.csv
    and write the feedback HTML; returns the per-student reports.

    folder: the collected submissions, as nbgrader's ``nbgrader collect`` leaves them
        (``<folder>/<student>/<assignment>/<notebook>.ipynb``), or one folder per student with the
        notebook directly inside (``<folder>/<student>/<notebook>.ipynb``). Student ids are the folder
        names (letters, digits, ``_ . @ + -``). Only the exercise's notebook is read from each; any other
        file a student handed in is ignored (a ``numpy.py`` beside the notebook would replace NumPy).
    assignment: the lesson (``01_vector_multiply``); default: the one the folder's submissions are for.
    course_dir: where nbgrader's course directory goes (gradebook.db, autograded/, feedback/, grades.csv);
        default ``.grading/<assignment>`` in the repository. A folder the grader did not make is refused.
    workers: notebooks graded at a time (default: 2, or 1 on a one-core machine).
    progress: True prints one line per graded notebook; a callable gets each line; False is silent.
    """
    started = time.monotonic()
    folder = Path(folder).resolve()
    if not folder.is_dir():
        raise runtime.CourseInputError(f"no folder {folder}")
    submissions, skipped, assignment = _collect(folder, assignment)
    source = _source_for(None, SOLUTIONS / assignment)
    root = Path(course_dir).resolve() if course_dir else REPO / ".grading" / assignment
    claim_course_dir(root)
    say = (lambda line: print(line, flush=True)) if progress is True else (progress or (lambda line: None))
    limits = Limits(timeout=int(timeout), notebook_timeout=int(notebook_timeout))
    resolved = resolve_mode(mode)
    course = Course(root, source, resolved, limits, deny=[folder])
    report = ClassReport(assignment=assignment, course_dir=str(root), mode=resolved, errors=dict(skipped))
    count = workers or max(1, min(2, os.cpu_count() or 1))
    total = len(submissions)
    say(f"grading {total} submission{'s' if total != 1 else ''} of {assignment} in {resolved.upper()} mode, "
        f"{count} at a time, into {root}")
    for student, why in skipped.items():
        say(f"  skipped {student}: {why}")
    done = 0
    lock = threading.Lock()

    def record(student: str, answer: dict, seconds: float):
        nonlocal done
        with lock:
            done += 1
            if answer.get("ok"):
                r = report_from(answer, submissions[student], assignment)
                report.reports[student] = r
                line = r.summary()
            else:
                report.errors[student] = answer.get("error", "no reason given")
                line = f"not graded: {report.errors[student]}"
            eta = (time.monotonic() - started) / done * (total - done)
            say(f"[{done:>{len(str(total))}}/{total}] {student:<20} {line}  ({seconds:.1f} s; about {eta:.0f} s left)")

    with course.workers(min(count, max(1, total))) as pool:
        course.generate(pool[0])
        jobs: queue.Queue = queue.Queue()
        for student in sorted(submissions):
            jobs.put(student)

        def run(index: int):
            while True:
                try:
                    student = jobs.get_nowait()
                except queue.Empty:
                    return
                t0 = time.monotonic()
                try:
                    answer = course.grade_one(pool[index], student, submissions[student])
                    if answer.get("restart"):
                        pool[index] = course.restart(pool[index])
                except Exception as exc:  # noqa: BLE001 - one student's failure must not stop the class
                    answer = {"ok": False, "error": f"the grader failed on this notebook ({type(exc).__name__}: {exc})"}
                record(student, answer, time.monotonic() - t0)

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(pool))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if report.reports:
            say("writing feedback and grades.csv ...")
            answer = course.finish(pool[0], sorted(report.reports))
            if not answer.get("ok"):
                raise GradingError(f"nbgrader could not write the feedback or grades: {answer.get('error')}",
                                   answer.get("log", ""))
    report.seconds = time.monotonic() - started
    (root / "report.json").write_text(json.dumps(
        {"assignment": assignment, "mode": resolved, "seconds": report.seconds,
         "reports": {s: r.as_dict() for s, r in report.reports.items()}, "errors": report.errors}, indent=1))
    say(f"done in {report.seconds:.0f} s: {len(report.reports)} graded, {len(report.errors)} not graded")
    return report


def _source_for(learner: Path | None, source) -> Path:
    """The nbgrader source notebook for a learner notebook (or for an assignment folder)."""
    if source is None:
        source = SOLUTIONS / learner.parent.name / learner.name
        if not source.is_file():
            raise runtime.CourseInputError(where_it_goes(learner))
    source = Path(source).resolve()
    if source.is_dir():
        notebooks = sorted(p for p in source.glob("*.ipynb"))
        if len(notebooks) != 1:
            raise runtime.CourseInputError(f"{_shown(source)} must hold exactly one notebook to grade a class of it "
                                           f"(it holds {len(notebooks)})")
        source = notebooks[0]
    if not source.is_file():
        raise runtime.CourseInputError(f"no source notebook {source}")
    return source


def where_it_goes(learner: Path) -> str:
    """What to do with a learner's notebook the grader cannot match to a lesson's exercise: the folder it goes in,
    named after its lesson, and the name it keeps. It names only what a learner has (the lessons, their exercises'
    notebooks), never the grader's own files."""
    lessons = {a.name: sorted(p.name for p in a.glob("*.ipynb")) for a in assignment_dirs()}
    lessons = {lesson: names for lesson, names in lessons.items() if names}
    folder, name = learner.parent.name, learner.name
    if folder in lessons:
        return (f"{folder}/{name} is not lesson {folder}'s exercise notebook, which is named "
                f"{' or '.join(lessons[folder])}: grade your copy of it, under that name")
    mine = [lesson for lesson, names in lessons.items() if name in names]
    if mine:
        return (f"{name} is in a folder named {folder!r}: the grader finds a notebook's exercise by the folder it is "
                f"in, named after its lesson. Put it in a folder named {mine[0]} ({mine[0]}/{name}) and grade it "
                "there")
    example = next(iter(lessons.items()), ("01_lesson", ["lesson.ipynb"]))
    return (f"{name} in folder {folder!r} is no lesson's exercise: put the notebook in a folder named after its "
            f"lesson, e.g. {example[0]}/{example[1][0]} (the lessons: {', '.join(lessons) or 'none'})")


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _collect(folder: Path, assignment: str | None) -> tuple[dict[str, Path], dict[str, str], str]:
    """Student -> submitted notebook, student -> why skipped, and the assignment, from a class folder."""
    known = [p.name for p in assignment_dirs()]
    if assignment is not None and assignment not in known:
        raise runtime.CourseInputError(f"no solutions/{assignment}/; known: {', '.join(known) or 'none'}")
    students = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if assignment is None:
        seen = {a.name for s in students for a in s.iterdir() if a.is_dir() and a.name in known}
        if not seen:
            names = {nb.name for s in students for nb in s.glob("*.ipynb")}
            seen = {a for a in known for nb in (SOLUTIONS / a).glob("*.ipynb") if nb.name in names}
        if len(seen) != 1:
            raise runtime.CourseInputError(
                f"cannot tell which assignment {folder} holds ({', '.join(sorted(seen)) or 'none found'}): "
                "name it with assignment= (--assignment)")
        assignment = seen.pop()
    name = _source_for(None, SOLUTIONS / assignment).name
    found: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    for s in students:
        if not STUDENT_PATTERN.match(s.name):
            skipped[s.name] = "the folder name is not a valid student id (letters, digits, _ . @ + - only)"
            continue
        for candidate in (s / assignment / name, s / name):
            if candidate.is_file():
                found[s.name] = candidate
                break
        else:
            skipped[s.name] = f"no {assignment}/{name} in {s.name}/"
    if not found and not skipped:
        raise runtime.CourseInputError(f"{folder} holds no student folders")
    return found, skipped, assignment

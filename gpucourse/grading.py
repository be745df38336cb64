"""Grading learner notebooks with nbgrader, one notebook or a whole class, and keeping the released
exercises in step with the solutions.

Layout
    solutions/NN_name/<nb>.ipynb   nbgrader *source* notebooks: solutions between ``### BEGIN SOLUTION`` and
                                   ``### END SOLUTION``, hidden tests between ``### BEGIN HIDDEN TESTS`` and
                                   ``### END HIDDEN TESTS``, test cells marked as graded with their points.
    exercises/NN_name/<nb>.ipynb   the release nbgrader generates from them (``generate_exercises``); never
                                   edited by hand, and ``check_exercises`` proves it matches the solutions.

Grading
    ``grade(path)`` grades one notebook, ``grade_class(folder)`` a folder of submissions (nbgrader's
    ``submitted/<student>/<assignment>/<nb>.ipynb`` layout); both run the same steps:

    1. The submission is *repaired* (``_prepare_submission``): the exercise's cells are put back in the
       source's order; locked cells (tests, read-only helpers) come from the source whatever the learner did
       to them (edited, deleted, duplicated, retyped, renamed); a deleted answer cell becomes one that raises
       NotImplementedError; cells the learner added keep their place after the cell they followed; forged
       nbgrader metadata is dropped. Every repair is a note in the report.
    2. Every cell the learner wrote is checked against the *integrity rules* (``_integrity_findings``) before
       anything runs. A cell that breaks one is not run: it is replaced by one that raises PermissionError
       naming the line and the rule, so the tests that need it fail, and the rest are graded as usual.
    3. nbgrader's own generate_assignment and autograde run in a child Python (``_worker_main``) in a
       throwaway course directory, with its real SQLite gradebook. The notebook runs in a *guarded kernel*
       (``_kernel_main``), and nbgrader's executor and score keeping are replaced by guarded versions
       (GuardedExecute and GuardedSaveAutoGrades in ``_guarded_preprocessors``), which enforce the limits below.
    4. Scores come from that gradebook; each test's message from the autograded notebook (``_verdict``).
       For a class, the gradebook also gives nbgrader's CSV export and its feedback HTML, in which every
       graded cell ends with the grader's one-line verdict.

Limits (``Limits``; ``timeout`` and ``notebook_timeout`` are arguments of ``grade``/``grade_class`` and CLI options)
    * cell: ``timeout`` seconds (default 120), then the cell is interrupted and its test scores 0. A cell
      that ignores the interrupt stops the notebook: the cells after it are reported "not run".
    * notebook: ``notebook_timeout`` seconds (default 600) for all its cells; cells past it are not run.
      Behind it, the grading process is stopped ``STARTUP_SLACK`` seconds later whatever happens.
    * output: a cell keeps at most ``CELL_OUTPUT_CHARS`` characters of output, a notebook
      ``NOTEBOOK_OUTPUT_CHARS``; the kernel itself drops what a cell prints past ``KERNEL_OUTPUT_CHARS``.
      Output on stderr past the cap still leaves a line on stderr, so nbgrader's "stderr fails the test"
      rule survives truncation. Errors and a test's value are always kept.
    * files: the kernel writes only in its own folder and in a private temporary folder; one file is at
      most ``FILE_BYTES`` (RLIMIT_FSIZE); no core dumps. In CPU mode its memory is capped at
      ``MEMORY_BYTES`` (RLIMIT_AS; not in GPU mode, where the CUDA driver reserves address space).
    * a kernel that dies (os._exit, a segmentation fault, running out of memory) fails the cell it died in
      with the exit code or signal, and the cells after it are reported "not run"; nbgrader's own executor
      would grade nothing at all.

Scores are deterministic (``_verdict``; nbgrader's ``determine_grade`` is replaced)
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
      test prints ``GPUS_PERF_MESSAGE`` (``gpus_missing``) and is "not gradable here (needs more GPUs)".

What a notebook can reach (the guarded kernel, ``_kernel_main``)
    The kernel is started from the course's kernelspec whatever the notebook's metadata names; it imports
    a copy of the course's code (gpucourse, kernels, benchmarks, results), not the repository; its working
    folder holds only the submission; its environment is rebuilt from a short list (no PYTHONPATH into the
    repository, no HOME of the grader); its stdout and stderr file descriptors go to a log file, not to the
    grader. A Python audit hook (PEP 578), installed before the first cell runs, refuses:

    * reading anything outside the Python installation, the system folders and its own folders: the
      repository (solutions/, its git history), the course directory (the gradebook holds the hidden
      tests), the other students' submissions, the grader's home are all out of reach;
    * writing, deleting or renaming outside its own folders; loading a native extension written there;
    * starting processes, sending signals to other processes, opening sockets, raising resource limits;
    * from notebook code (not from the libraries it calls): ctypes, reading the garbage collector's object
      lists, replacing a function's code, tracing, exec/eval/compile.

    That is not a security boundary, and nbgrader's FAQ says as much for any grading in the learner's own
    Python: native code escapes an audit hook (numba and llvmlite compile machine code; TensorFlow reads
    files in C++), and so does notebook code that reaches those functions through a library's callback. The
    integrity rules close the direct routes to those, and give a clear message instead of a mysterious
    failure. Where the stakes require it, grade in a container or as a user who cannot read solutions/.

Integrity rules for the cells a learner writes (``_integrity_findings``; checked on the text, so they cannot
be tampered with at run time). A cell may not:
    * run code built at run time or reach the interpreter's machinery: exec, eval, compile, __import__,
      globals, vars, locals, setattr, delattr, breakpoint, get_ipython, getattr with a computed or special
      name, special ``__names__`` (other than __name__, __doc__, __qualname__, __init__ and a few more),
      frame and traceback internals (f_globals, tb_frame, ...), sys.modules, sys._getframe, sys.settrace,
      displayhook and excepthook, IPython magics other than %time and %timeit, shell commands (``!cmd``);
    * import ctypes, cffi, gc, inspect, importlib, builtins, pickle, marshal, subprocess, multiprocessing,
      signal, socket, resource, llvmlite, numba's internals, IPython, or the grader (``BLOCKED_MODULES``);
    * set attributes other than on ``self`` in a method of its own class, use a module as a value, or
      assign into a module's mapping (os.environ[...]); that is how tests, timers and clocks get patched;
    * rebind a name a read-only cell defines (the helpers the tests call, the setup's imports) or a builtin
      a read-only cell uses (``_protected_names``); importing the same thing again is fine.

Performance tests cannot be gamed by what the candidate does (``performance_points``; see its docstring):
the harness makes fresh inputs for every run (and refuses a ``make_inputs`` that repeats itself), poisons the
output before every run and checks it right after, brackets every run with CUDA events around a
device-wide synchronisation (work left running on another stream is timed too), interleaves candidate and
reference runs in the same process, and uses only CuPy's own event and synchronisation functions, checked
to be the genuine ones before and after timing: caching across calls, deferred or batched work and patched
timers or clocks get 0 points or are timed for what they really do.

nbgrader 0.9 facts this module relies on
    * nbgrader's autograde executes the notebook in the folder it copies it to, restores locked cells and
      hidden tests from the gradebook, and scores with ``utils.determine_grade``, replaced here (above).
    * Its ``add_missing_cells`` repair fails with a KeyError in 0.9.6 when the cell before a deleted one is
      gone too, or is not a test or solution cell; the repair step above makes it unnecessary.
    * When the kernel dies, its executor raises and autograde grades nothing; GuardedExecute catches it.
"""
from __future__ import annotations

import ast
import contextlib
import json
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import runtime

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = REPO / "solutions"
EXERCISES = REPO / "exercises"
ASSIGNMENT_PATTERN = re.compile(r"^\d\d_\w+$")
STUDENT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]{0,63}$")  # safe in paths, nbgrader and its CSV

COURSE_ID = "gpu-programming-for-deep-learning"
STUDENT = "learner"
DEFAULT_TIMEOUT = 120  # seconds per cell
DEFAULT_NOTEBOOK_TIMEOUT = 600  # seconds for all the cells of one notebook
STARTUP_SLACK = 90  # seconds on top of the notebook's limit for nbgrader and the kernel to start and stop

CELL_OUTPUT_CHARS = 100_000  # characters of output kept per cell
NOTEBOOK_OUTPUT_CHARS = 2_000_000  # ... per notebook
KERNEL_OUTPUT_CHARS = 1_000_000  # characters per cell and stream the kernel sends at all
VALUE_CHARS = 1_000  # characters of a cell's value (execute_result) kept
TRACEBACK_LINES = 60  # lines of a traceback kept
MAX_NOTEBOOK_BYTES = 50 * 2**20  # a submitted file larger than this is not read
MAX_CODE_CHARS = 1_000_000  # characters of code in a submission, outputs not counted
FILE_BYTES = 256 * 2**20  # largest file the kernel may write (RLIMIT_FSIZE)
MEMORY_BYTES = 8 * 2**30  # address space of a CPU-mode kernel (RLIMIT_AS)

PERF_PREFIX = "perf_"
NOT_GRADABLE = "not gradable here (needs a GPU)"
NOT_GRADABLE_GPUS = "not gradable here (needs more GPUs)"
CPU_PERF_MESSAGE = "performance: not gradable in CPU mode (needs a GPU); 0 of {points} points given here"
GPUS_PERF_MESSAGE = ("performance: not gradable on this machine (needs {needed} GPUs, it has {have}); "
                     "0 of {points} points given here")

# A cell's stderr output that holds a Python warning ("file.py:12: SomeWarning: text") is removed before
# scoring: a NumbaPerformanceWarning about a small grid must not cost a test its points.
WARNING_PATTERN = r"(?m)^\S.*:\d+: \w*Warning: "

# Performance scoring: full marks up to this ratio (learner time / reference time), none from ZERO_AT.
FULL_AT = 1.2
ZERO_AT = 10.0

# What the kernel imports: a copy of these, not the repository.
KERNEL_CODE = ("gpucourse", "kernels", "benchmarks", "results")
KERNEL_NAME = "gpucourse-graded"

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class GradingError(runtime.CourseError):
    """The notebook could not be graded at all (not a failed test: the grader gave up on it).
    ``log`` holds nbgrader's log and traceback."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


@dataclass(frozen=True)
class Limits:
    """How long and how much a graded notebook may run and print."""

    timeout: int = DEFAULT_TIMEOUT  # seconds per cell
    notebook_timeout: int = DEFAULT_NOTEBOOK_TIMEOUT  # seconds for all cells
    cell_output_chars: int = CELL_OUTPUT_CHARS
    notebook_output_chars: int = NOTEBOOK_OUTPUT_CHARS
    kernel_output_chars: int = KERNEL_OUTPUT_CHARS
    file_bytes: int = FILE_BYTES
    memory_bytes: int = MEMORY_BYTES

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise runtime.CourseInputError(f"limit {name} must be a positive whole number, not {value!r}")


# ------------------------------------------------------------------------------------------ reports

@dataclass
class TestResult:
    """The outcome of one graded cell."""

    __test__ = False  # not a pytest test class

    grade_id: str
    points: float
    max_points: float
    # passed | partial | failed | timed out | kernel died | not run | not gradable here (needs a GPU)
    # | not gradable here (needs more GPUs) | needs manual grading
    status: str
    message: str

    @property
    def performance(self) -> bool:
        return self.grade_id.startswith(PERF_PREFIX)

    @property
    def gradable(self) -> bool:
        return self.status not in (NOT_GRADABLE, NOT_GRADABLE_GPUS)


@dataclass
class GradeReport:
    notebook: str
    assignment: str
    mode: str | None  # "gpu" or "cpu": the mode the notebook ran in
    tests: list[TestResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was repaired or refused before grading
    seconds: float = 0.0  # wall-clock time nbgrader's autograde took for this notebook

    @property
    def score(self) -> float:
        return sum(t.points for t in self.tests)

    @property
    def max_score(self) -> float:
        return sum(t.max_points for t in self.tests)

    @property
    def gradable_max_score(self) -> float:
        return sum(t.max_points for t in self.tests if t.gradable)

    @property
    def not_gradable(self) -> list[TestResult]:
        return [t for t in self.tests if not t.gradable]

    def test(self, grade_id: str) -> TestResult:
        for t in self.tests:
            if t.grade_id == grade_id:
                return t
        raise KeyError(f"no test {grade_id!r} in this report; tests: {', '.join(t.grade_id for t in self.tests)}")

    def as_dict(self) -> dict:
        return {**asdict(self), "score": self.score, "max_score": self.max_score,
                "gradable_max_score": self.gradable_max_score}

    def summary(self) -> str:
        """One line: the score, out of what this mode can grade too."""
        line = f"{_num(self.score)} / {_num(self.max_score)}"
        if self.not_gradable:
            line += f"  ({_num(self.score)} / {_num(self.gradable_max_score)} gradable here)"
        return line

    def format(self) -> str:
        mode = {"gpu": "GPU mode", "cpu": "CPU mode"}.get(self.mode or "", "mode unknown")
        lines = [f"{self.notebook}", f"assignment {self.assignment}, graded in {mode}", ""]
        width = max([len(t.grade_id) for t in self.tests] + [4])
        for t in self.tests:
            got = "-" if not t.gradable else _num(t.points)
            detail = t.status if t.message in ("", t.status) or not t.gradable else f"{t.status}: {t.message}"
            lines.append(f"  {t.grade_id:<{width}}  {got:>5} / {_num(t.max_points):<3}  {detail}")
        lines.append("")
        total = f"Score: {_num(self.score)} / {_num(self.max_score)}"
        skipped = self.not_gradable
        if skipped:
            held = sum(t.max_points for t in skipped)
            need = "more GPUs" if all(t.status == NOT_GRADABLE_GPUS for t in skipped) else "a GPU"
            total += (f"  ({_num(self.score)} / {_num(self.gradable_max_score)} gradable here; "
                      f"{_num(held)} performance point{'s' if held != 1 else ''} need {need} and were not given)")
        lines.append(total)
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


@dataclass
class ClassReport:
    """A class graded by ``grade_class``: per student, a report or the reason there is none."""

    assignment: str
    course_dir: str  # the nbgrader course directory: gradebook.db, autograded/, feedback/, grades.csv
    mode: str
    reports: dict[str, GradeReport] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # student -> why nothing could be graded
    seconds: float = 0.0

    @property
    def gradebook(self) -> Path:
        return Path(self.course_dir) / "gradebook.db"

    @property
    def csv(self) -> Path:
        return Path(self.course_dir) / "grades.csv"

    def feedback(self, student: str) -> list[Path]:
        return sorted((Path(self.course_dir) / "feedback" / student / self.assignment).glob("*.html"))

    @property
    def students(self) -> list[str]:
        return sorted({*self.reports, *self.errors})

    def format(self) -> str:
        lines = [f"assignment {self.assignment}: {len(self.students)} submissions, {len(self.reports)} graded in "
                 f"{self.mode.upper()} mode in {self.seconds:.0f} s, {len(self.errors)} not graded", ""]
        width = max([len(s) for s in self.students] + [7])
        for s in self.students:
            if s in self.reports:
                r = self.reports[s]
                lines.append(f"  {s:<{width}}  {r.summary()}")
            else:
                lines.append(f"  {s:<{width}}  not graded: {self.errors[s]}")
        lines += ["", f"gradebook  {self.gradebook}", f"grades     {self.csv}",
                  f"feedback   {Path(self.course_dir) / 'feedback'}/<student>/{self.assignment}/"]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _num(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))


# ------------------------------------------------------------------------- submissions: reading, repair

def _read_notebook(path: Path) -> dict:
    """A submitted file as notebook JSON (nbformat 4), or CourseInputError saying why it is not one."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise runtime.CourseInputError(f"cannot read {path}: {exc.strerror}") from None
    if size > MAX_NOTEBOOK_BYTES:
        raise runtime.CourseInputError(f"{path.name} is {size / 2**20:.0f} MiB; the grader reads notebooks of at "
                                       f"most {MAX_NOTEBOOK_BYTES // 2**20} MiB (clear its outputs and save again)")
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, OSError) as exc:
        raise runtime.CourseInputError(f"{path.name} is not a notebook ({exc})") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells", nb.get("worksheets")), list):
        raise runtime.CourseInputError(f"{path.name} is not a notebook (no list of cells)")
    if nb.get("nbformat") != 4:
        try:
            import nbformat

            nb = json.loads(nbformat.writes(nbformat.convert(nbformat.from_dict(nb), 4)))
        except Exception as exc:  # noqa: BLE001 - any failure means: not a notebook we can read
            raise runtime.CourseInputError(f"{path.name} is not an nbformat 4 notebook ({exc})") from None
    return nb


def _gid(cell) -> str | None:
    """A cell's nbgrader grade_id, whatever shape the learner left its metadata in."""
    meta = cell.get("metadata") if isinstance(cell, dict) else None
    nbg = meta.get("nbgrader") if isinstance(meta, dict) else None
    gid = nbg.get("grade_id") if isinstance(nbg, dict) else None
    return gid if isinstance(gid, str) and gid else None


def _source_text(cell) -> str:
    src = cell.get("source", "") if isinstance(cell, dict) else ""
    if isinstance(src, list):
        return "".join(s for s in src if isinstance(s, str))
    return src if isinstance(src, str) else ""


def _cell_type(cell) -> str:
    kind = cell.get("cell_type") if isinstance(cell, dict) else None
    return kind if kind in ("code", "markdown", "raw") else "markdown"


def _new_cell(kind: str, text: str, metadata: dict | None = None) -> dict:
    cell = {"cell_type": kind, "metadata": json.loads(json.dumps(metadata or {})), "source": text}
    if kind == "code":
        cell["outputs"], cell["execution_count"] = [], None
    return cell


def _restore_locked_cells(nb: dict, source: dict) -> tuple[dict, list[str]]:
    """Put back the locked cells (tests, read-only cells) the learner deleted, each after the cell that
    precedes it in the source. nbgrader would put back only test cells (OverwriteCells.add_missing_cells),
    and in 0.9.6 that fails with a KeyError when the cell before the deleted one is missing as well or is not
    a test or solution cell. Solution cells are never put back. Returns the notebook and the grade_ids.
    (``_prepare_submission`` does this and every other repair; this is the deletion repair alone.)"""
    cells = list(nb["cells"])
    have = {_gid(c) for c in cells} - {None}
    ids = {c.get("id") for c in cells}
    restored, previous = [], None
    for cell in source["cells"]:
        g = _gid(cell)
        if g is None:
            continue
        if g not in have and cell["metadata"]["nbgrader"].get("locked"):
            cell = json.loads(json.dumps(cell))
            if cell.get("cell_type") == "code":
                cell["outputs"], cell["execution_count"] = [], None
            if "id" in cell and cell["id"] in ids:
                cell["id"] = f"restored-{g}"[:64].replace("_", "-")
            at = next((i + 1 for i, c in enumerate(cells) if previous is not None and _gid(c) == previous), 0)
            cells.insert(at, cell)
            have.add(g)
            restored.append(g)
        if g in have:
            previous = g
    return {**nb, "cells": cells}, restored


def _prepare_submission(learner: dict, source: dict, release: dict | None = None) -> tuple[dict, list[str]]:
    """The learner's notebook rebuilt on the exercise's skeleton, and a note for every repair.

    * The exercise's cells (those with a grade_id in the source) come in the source's order. Locked cells are
      the source's own (edits, deletions, retyping, metadata and tags undone). An answer cell keeps the
      learner's text with the source's type and metadata; a deleted one becomes a cell that raises.
    * A second copy of a locked cell is dropped; of an answer cell, it runs as an ordinary cell. A cell that
      claims a grade_id the exercise does not have runs as an ordinary cell.
    * Cells the learner added stay after the exercise cell they followed (or first, if they came first),
      with their metadata dropped (a "skip-execution" tag would otherwise stop a cell from running).
    * Every code cell the learner wrote is checked against the integrity rules; a cell that breaks one is
      replaced by a cell that raises PermissionError with the findings (its code follows as comments).
    release: the released exercise, to tell an unchanged locked cell (as released, without the hidden
    tests) from an edited one.
    """
    raw = learner.get("cells")
    if not isinstance(raw, list):
        raise runtime.CourseInputError("the notebook has no list of cells")
    notes: list[str] = []
    src_cells = source["cells"]
    src_by_gid = {g: c for c in src_cells if (g := _gid(c))}
    if not any(_gid(c) in src_by_gid for c in raw):
        raise runtime.CourseInputError("it has none of the exercise's cells: work in a copy of the released "
                                       "exercise, which carries what the grader needs")
    rel_by_gid = {g: c for c in (release or {}).get("cells", []) if (g := _gid(c))}

    def nbg(cell):
        return cell["metadata"]["nbgrader"]

    known: dict[str, dict] = {}
    after: dict[str | None, list[dict]] = {None: []}  # exercise cell -> cells the learner added after it
    order: list[str] = []
    current = None
    dropped = 0
    for cell in raw:
        if not isinstance(cell, dict):
            dropped += 1
            continue
        g = _gid(cell)
        if g in src_by_gid and g not in known:
            known[g], current = cell, g
            order.append(g)
            after.setdefault(g, [])
            continue
        if g in src_by_gid and nbg(src_by_gid[g]).get("locked"):
            notes.append(f"cell {g} appeared more than once; the extra copy was removed")
            continue
        if g in src_by_gid:
            notes.append(f"cell {g} appeared more than once; the first copy is graded as your answer, "
                         "the others ran as ordinary cells")
        elif g is not None:
            notes.append(f"a cell claimed grade id {g!r}, which this exercise does not have; it ran as an "
                         "ordinary cell")
        after[current].append(_new_cell(_cell_type(cell), _source_text(cell)))
    if dropped:
        notes.append(f"{dropped} entr{'y' if dropped == 1 else 'ies'} of the notebook's cell list "
                     f"{'was' if dropped == 1 else 'were'} not a cell and {'was' if dropped == 1 else 'were'} ignored")
    if order != [g for g in (_gid(c) for c in src_cells) if g in known]:
        notes.append("cells had been moved; the exercise's cells were put back in their order "
                     "(cells you added stay after the cell they followed)")

    cells = list(after[None])
    for scell in src_cells:
        g = _gid(scell)
        if g is None:  # a cell without nbgrader metadata: the learner's copy, if any, is an added cell
            continue
        meta, mine, kind = nbg(scell), known.get(g), scell["cell_type"]
        if meta.get("solution") and not meta.get("locked"):
            if mine is None:
                text = (f'raise NotImplementedError("the cell {g} (your answer) was deleted from this '
                        f'notebook")' if kind == "code" else "(deleted)")
                notes.append(f"your answer cell {g} had been deleted; the tests that need it fail")
            else:
                text = _source_text(mine)
                if _cell_type(mine) != kind:
                    notes.append(f"your answer cell {g} had been changed to {_cell_type(mine)}; it ran as {kind}")
            cells.append(_new_cell(kind, text, scell["metadata"]))
        else:
            cells.append(_new_cell(kind, _source_text(scell), scell["metadata"]))
            if mine is None:
                notes.append(f"cell {g} had been deleted; it was put back and run")
            elif _cell_type(mine) != kind:
                notes.append(f"cell {g} had been changed to {_cell_type(mine)}; it was put back as {kind}")
            elif _source_text(mine) not in (_source_text(scell), _source_text(rel_by_gid.get(g, scell))):
                notes.append(f"cell {g} had been edited; it was run as written in the solution")
        cells.extend(after.get(g, []))

    # The integrity rules, on every code cell the learner wrote.
    protected, same = _protected_names(src_cells)
    written = sum(len(c["source"]) for c in cells if not (_gid(c) and nbg(c).get("locked")))
    if written > MAX_CODE_CHARS:
        raise runtime.CourseInputError(f"the notebook holds {written} characters of your cells; the grader runs "
                                       f"at most {MAX_CODE_CHARS}")
    for number, cell in enumerate(cells, 1):
        g = _gid(cell)
        if cell["cell_type"] != "code" or (g and nbg(cell).get("locked")):
            continue
        findings = _integrity_findings(cell["source"], protected=protected, same=same)
        if findings:
            name = f"cell {g}" if g else f"cell {number} (one you added)"
            why = "; ".join(findings[:5]) + (f"; and {len(findings) - 5} more" if len(findings) > 5 else "")
            notes.append(f"{name} was not run: {why}")
            commented = "\n".join("# " + line for line in cell["source"].splitlines())
            cell["source"] = (f"raise PermissionError({('the grader did not run this cell: ' + why)!r})\n"
                              f"# Your code, not run:\n{commented}")
    used: set[str] = set()
    for number, cell in enumerate(cells):
        base = re.sub(r"[^A-Za-z0-9_-]", "-", _gid(cell) or f"cell-{number}")[:60] or f"cell-{number}"
        cid, k = base, 1
        while cid in used:
            cid, k = f"{base[:56]}-{k}", k + 1
        used.add(cid)
        cell["id"] = cid
    metadata = json.loads(json.dumps(source.get("metadata", {})))
    return {"cells": cells, "metadata": metadata, "nbformat": 4, "nbformat_minor": 5}, notes


# ------------------------------------------------------------------------------- integrity rules

BLOCKED_MODULES = {
    "ctypes": "reaches memory and C functions directly", "_ctypes": "reaches memory and C functions directly",
    "cffi": "calls C functions directly", "gc": "reaches every object in the kernel",
    "inspect": "reaches the frames and globals of the tests", "importlib": "loads code by name",
    "imp": "loads code by name", "builtins": "replaces Python's builtins", "runpy": "runs code by name",
    "code": "runs code built at run time", "codeop": "compiles code at run time",
    "pickle": "can call any function while loading", "_pickle": "can call any function while loading",
    "marshal": "builds code objects", "dill": "can call any function while loading",
    "cloudpickle": "can call any function while loading", "subprocess": "starts processes",
    "multiprocessing": "starts processes", "pty": "starts processes", "signal": "changes signal handling",
    "socket": "opens network connections", "resource": "changes the kernel's resource limits",
    "llvmlite": "compiles machine code", "numba.core": "reaches numba's compiler internals",
    "numba.extending": "adds machine-level intrinsics", "IPython": "drives the notebook kernel",
    "ipykernel": "drives the notebook kernel", "jupyter_client": "drives notebook kernels",
    "zmq": "talks to notebook kernels", "sys.monitoring": "traces the tests", "trace": "traces the tests",
    "pdb": "traces the tests", "bdb": "traces the tests", "gpucourse.grading": "is the grader itself",
}
_DYNAMIC_NAMES = {
    "exec": "runs code built at run time", "eval": "runs code built at run time",
    "compile": "compiles code at run time", "__import__": "loads code by name",
    "globals": "reaches the notebook's global names", "vars": "reaches an object's or the notebook's names",
    "locals": "reaches the notebook's names", "setattr": "sets attributes by name",
    "delattr": "deletes attributes by name", "breakpoint": "starts a debugger",
    "get_ipython": "drives the notebook kernel itself",
}
# Attribute names that lead to frames, the import system, tracing or process control.
_BLOCKED_ATTRS = {
    "f_globals", "f_locals", "f_back", "f_builtins", "f_code", "f_trace", "tb_frame", "tb_next", "gi_frame",
    "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code", "co_code", "_getframe", "settrace",
    "setprofile", "_current_frames", "displayhook", "excepthook", "meta_path", "path_hooks",
    "path_importer_cache", "addaudithook", "system", "popen", "fork", "forkpty", "kill", "killpg",
    "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnl", "spawnle",
    "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp",
    "setrlimit", "prlimit", "__builtins__",
}
_SYS_ATTRS = {"modules"}  # on sys: the modules the tests import
_ALLOWED_DUNDERS = {
    "__name__", "__doc__", "__qualname__", "__init__", "__main__", "__version__", "__cuda_array_interface__",
    "__array_interface__", "__array__", "__len__", "__getitem__", "__setitem__", "__iter__", "__next__",
    "__enter__", "__exit__", "__repr__", "__str__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
    "__ge__", "__hash__", "__bool__", "__call__", "__contains__", "__add__", "__sub__", "__mul__",
    "__truediv__", "__floordiv__", "__mod__", "__pow__", "__neg__", "__abs__", "__matmul__", "__post_init__",
}
_ALLOWED_MAGICS = {"time", "timeit"}
# What a read-only cell binds by calling a course function, said as the import that gives the same object.
_EQUIVALENT_IMPORTS = {"runtime.cuda()": "numba.cuda", "runtime.cupy()": "cupy"}
_DUNDER = re.compile(r"^__\w+__$")


def _module_exists(dotted: str) -> bool:
    """Whether ``dotted`` names a module on sys.path (found on disk, nothing imported)."""
    parts = dotted.split(".")
    for entry in sys.path:
        base = Path(entry or ".").joinpath(*parts)
        if (base / "__init__.py").is_file() or base.with_suffix(".py").is_file() or base.is_dir():
            return True
    return False


def _protected_names(source_cells: list) -> tuple[set[str], dict[str, str]]:
    """The names the learner's cells may not rebind, and for those bound by an import (or an equivalent
    course call), what that import gives: importing the same thing again is allowed.

    Protected: every name a locked cell that is not a test binds at module level; every function, class
    and import a test cell binds; every builtin a locked cell uses. (Plain variables of test cells, like
    ``a`` or ``got``, are the learner's to reuse.)"""
    import builtins

    protected: set[str] = set()
    same: dict[str, str] = {}
    bound_anywhere: set[str] = set()
    loaded: set[str] = set()
    for cell in source_cells:
        meta = (cell.get("metadata") or {}).get("nbgrader") or {}
        if cell.get("cell_type") != "code" or not meta.get("locked"):
            continue
        try:
            tree = ast.parse(_source_text(cell))
        except SyntaxError:
            continue
        for node in tree.body:
            names: list[str] = []
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    name = a.asname or a.name.split(".")[0]
                    if a.name == "*":
                        continue
                    names.append(name)
                    if isinstance(node, ast.Import):
                        same[name] = a.name if a.asname else a.name.split(".")[0]
                    else:
                        same[name] = f"{'.' * node.level}{node.module or ''}.{a.name}"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif not meta.get("grade"):
                names += [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    equivalent = _EQUIVALENT_IMPORTS.get(ast.unparse(node.value))
                    if equivalent:
                        same[node.targets[0].id] = equivalent
            protected.update(names)
        for n in ast.walk(tree):
            if isinstance(n, ast.Name):
                (loaded if isinstance(n.ctx, ast.Load) else bound_anywhere).add(n.id)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound_anywhere.add(n.name)
            elif isinstance(n, ast.arg):
                bound_anywhere.add(n.arg)
    protected |= {n for n in loaded - bound_anywhere if hasattr(builtins, n) and not _DUNDER.match(n)}
    return protected, same


def _transform_ipython(code: str) -> str:
    """IPython's own translation of a cell (magics and shell escapes become get_ipython() calls)."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:
        return code
    try:
        return TransformerManager().transform_cell(code)
    except Exception:  # noqa: BLE001 - IPython gives up: check the text as it is
        return code


def _integrity_findings(code: str, *, protected: set[str] | frozenset = frozenset(),
                        same: dict[str, str] | None = None) -> list[str]:
    """Why a cell a learner wrote may not run (empty when it may): see the module docstring.
    Each finding reads "line N: what it does (why that is refused)"."""
    python = _transform_ipython(code)
    try:
        tree = compile(python, "<cell>", "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        return [f"line {exc.lineno or 1}: {exc.msg} (the grader checks a cell before running it, and cannot "
                "read this one)"]
    except (ValueError, RecursionError, MemoryError) as exc:
        return [f"line 1: the cell cannot be checked ({type(exc).__name__})"]
    checker = _Integrity(protected, same or {})
    try:
        checker.run(tree)
    except RecursionError:
        return ["line 1: the cell is nested too deeply to be checked"]
    return list(dict.fromkeys(checker.findings))


class _Integrity(ast.NodeVisitor):
    """The integrity rules as an AST walk (see ``_integrity_findings``)."""

    def __init__(self, protected, same):
        self.protected, self.same = set(protected), dict(same)
        self.findings: list[str] = []
        self.modules: dict[str, str] = {n: m for n, m in self.same.items() if "." not in m or _module_exists(m)}
        self.parents: dict[ast.AST, ast.AST] = {}
        self.scopes: list[dict] = [{"kind": "module", "globals": set(), "self": None}]
        self.skip: set[int] = set()  # ids of get_ipython() calls that are allowed magics

    def run(self, tree):
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
        self.visit(tree)

    def flag(self, node, what: str, why: str):
        self.findings.append(f"line {getattr(node, 'lineno', 1)}: {what} ({why})" if why else
                             f"line {getattr(node, 'lineno', 1)}: {what}")

    # -- scopes and bindings
    def at_module_scope(self, name: str) -> bool:
        scope = self.scopes[-1]
        return scope["kind"] == "module" or (scope["kind"] == "function" and name in scope["globals"])

    def bind(self, node, name: str, imported: str | None = None):
        if not self.at_module_scope(name):
            return
        if name in self.protected and not (imported is not None and self.same.get(name) == imported):
            import builtins

            what = (f"replaces the builtin {name}" if hasattr(builtins, name) and name not in self.same
                    else f"replaces {name}")
            self.flag(node, what, "a read-only cell defines it and the tests use it")

    def visit_Import(self, node):
        for a in node.names:
            self.check_module(node, a.name)
            name = a.asname or a.name.split(".")[0]
            target = a.name if a.asname else a.name.split(".")[0]
            self.bind(node, name, target)
            if self.at_module_scope(name):
                self.modules[name] = target

    def visit_ImportFrom(self, node):
        module = "." * node.level + (node.module or "")
        self.check_module(node, module)
        for a in node.names:
            if a.name == "*":
                self.flag(node, f"imports * from {module}", "it could replace names the tests use")
                continue
            self.check_module(node, f"{module}.{a.name}")
            name = a.asname or a.name
            self.bind(node, name, f"{module}.{a.name}")
            if self.at_module_scope(name) and _module_exists(f"{module}.{a.name}"):
                self.modules[name] = f"{module}.{a.name}"

    def check_module(self, node, dotted: str):
        for blocked, why in BLOCKED_MODULES.items():
            if dotted == blocked or dotted.startswith(blocked + "."):
                self.flag(node, f"imports {dotted}", f"{why}; graded notebooks may not")
                return

    def visit_FunctionDef(self, node):
        self.bind(node, node.name)
        for d in node.decorator_list:
            self.visit(d)
        self.visit(node.args)
        if node.returns:
            self.visit(node.returns)
        in_class = self.scopes[-1]["kind"] == "class"
        args = node.args.posonlyargs + node.args.args
        first = args[0].arg if in_class and args else None
        self.scopes.append({"kind": "function", "globals": set(), "self": first})
        for stmt in node.body:
            self.visit(stmt)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        self.visit(node.args)
        self.scopes.append({"kind": "lambda", "globals": set(), "self": None})
        self.visit(node.body)
        self.scopes.pop()

    def visit_ClassDef(self, node):
        self.bind(node, node.name)
        for n in [*node.decorator_list, *node.bases, *node.keywords]:
            self.visit(n)
        self.scopes.append({"kind": "class", "globals": set(), "self": None})
        for stmt in node.body:
            self.visit(stmt)
        self.scopes.pop()

    def visit_Global(self, node):
        self.scopes[-1]["globals"].update(node.names)

    def visit_ExceptHandler(self, node):
        if node.name:
            self.bind(node, node.name)
        self.generic_visit(node)

    def visit_MatchAs(self, node):
        if node.name:
            self.bind(node, node.name)
        self.generic_visit(node)

    def visit_MatchStar(self, node):
        if node.name:
            self.bind(node, node.name)

    def visit_MatchMapping(self, node):
        if node.rest:
            self.bind(node, node.rest)
        self.generic_visit(node)

    # -- names, attributes, assignments
    def visit_Name(self, node):
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self.bind(node, node.id)
            return
        if node.id in _DYNAMIC_NAMES and id(node) not in self.skip:
            self.flag(node, f"uses {node.id}", f"it {_DYNAMIC_NAMES[node.id]}")
        elif _DUNDER.match(node.id) and node.id not in _ALLOWED_DUNDERS:
            self.flag(node, f"uses {node.id}", "special names reach the interpreter's machinery")
        elif node.id in ("getattr", "attrgetter", "methodcaller") and not (
                isinstance(self.parents.get(node), ast.Call) and self.parents[node].func is node):
            self.flag(node, f"passes {node.id} around", "it reaches any attribute by name")
        elif node.id in self.modules:
            parent = self.parents.get(node)
            used_plainly = (isinstance(parent, ast.Attribute) and parent.value is node) or \
                           (isinstance(parent, ast.Call) and (parent.func is node or (
                               isinstance(parent.func, ast.Name) and parent.func.id in ("getattr", "hasattr")
                               and parent.args and parent.args[0] is node)))
            if not used_plainly:
                self.flag(node, f"uses module {node.id} as a value", "a module passed around can be patched")

    def visit_Attribute(self, node):
        attr = node.attr
        if _DUNDER.match(attr) and attr not in _ALLOWED_DUNDERS:
            self.flag(node, f"uses .{attr}", "special attributes reach the interpreter's machinery")
        elif attr in _BLOCKED_ATTRS:
            self.flag(node, f"uses .{attr}", "it reaches frames, tracing, the import system or processes")
        elif attr in _SYS_ATTRS and isinstance(node.value, ast.Name) and self.modules.get(node.value.id) == "sys":
            self.flag(node, f"uses sys.{attr}", "it changes what the tests import or see")
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            root = _root_name(node)
            if root is None or root != self.scopes[-1]["self"]:
                self.flag(node, f"sets attribute {_short_source(node)}",
                          "a notebook may set attributes only on self in its own classes; setting them on "
                          "modules or shared objects patches what the tests use")
        self.visit(node.value)

    def visit_Subscript(self, node):
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            root = _root_name(node)
            if root is not None and (root in self.modules or root in self.protected) and \
                    not (isinstance(node.value, ast.Name) and node.value.id not in self.modules):
                self.flag(node, f"assigns into {_short_source(node.value)}",
                          "it changes a module's state, which the tests share")
        self.generic_visit(node)

    def visit_Constant(self, node):
        if isinstance(node.value, str) and id(node) not in self.skip and \
                ((_DUNDER.match(node.value) and node.value not in _ALLOWED_DUNDERS) or node.value in _BLOCKED_ATTRS):
            self.flag(node, f"names {node.value!r}", "special names reach the interpreter's machinery")

    def visit_Call(self, node):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        # IPython magics and shell escapes, as IPython's transformer writes them.
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call) and \
                isinstance(func.value.func, ast.Name) and func.value.func.id == "get_ipython":
            self.magic(node, func.attr)
            return
        if name == "getattr" and len(node.args) >= 2:
            key = node.args[1]
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                self.flag(node, "uses getattr with a computed name", "it reaches any attribute")
        if name in ("attrgetter", "methodcaller") and not all(
                isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args[:1]):
            self.flag(node, f"uses {name} with a computed name", "it reaches any attribute")
        self.generic_visit(node)

    def magic(self, node, method: str):
        args = node.args
        magic = args[0].value if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str) else None
        if method in ("run_line_magic", "run_cell_magic") and magic in _ALLOWED_MAGICS:
            self.skip.add(id(node.func.value.func))
            for arg in args[1:]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    self.skip.add(id(arg))
                    for finding in _integrity_findings(arg.value, protected=self.protected, same=self.same):
                        self.findings.append(f"in %{magic}, {finding}")
                else:
                    self.visit(arg)
            return
        if method in ("system", "getoutput"):
            self.flag(node, "runs a shell command", "graded notebooks may not start processes")
        else:
            shown = f"%{magic}" if magic else f"get_ipython().{method}"
            self.flag(node, f"uses {shown}", "graded notebooks may use only the %time and %timeit magics")
        self.skip.add(id(node.func.value.func))
        for arg in args[1:]:
            self.visit(arg)


def _root_name(node) -> str | None:
    """The name an attribute or subscript chain starts from (``a`` in ``a.b[0].c``), if it starts from one."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _short_source(node) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------------- grading: one notebook, a class

def grade(notebook_path, *, timeout: int = DEFAULT_TIMEOUT, mode: str | None = None, source=None,
          workdir=None, notebook_timeout: int = DEFAULT_NOTEBOOK_TIMEOUT) -> GradeReport:
    """Grade one learner notebook with nbgrader's autograder; see the module docstring.

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
    nb = _read_notebook(learner)
    if not any(_gid(c) for c in nb["cells"]):
        raise runtime.CourseInputError(
            f"{notebook_path} has none of the exercise's cells: work in a copy of "
            f"exercises/{source.parent.name}/{source.name}, which carries what the grader needs")
    limits = Limits(timeout=int(timeout), notebook_timeout=int(notebook_timeout))
    resolved = _resolve_mode(mode)
    with _course_dir(workdir) as root:
        course = _Course(root, source, resolved, limits, deny=[learner.parent])
        with course.workers(1) as (worker,):
            course.generate(worker)
            answer = course.grade_one(worker, STUDENT, learner)
        if answer.get("ok"):
            return _report_from(answer, learner, course.assignment)
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
    _claim_course_dir(root)
    say = (lambda line: print(line, flush=True)) if progress is True else (progress or (lambda line: None))
    limits = Limits(timeout=int(timeout), notebook_timeout=int(notebook_timeout))
    resolved = _resolve_mode(mode)
    course = _Course(root, source, resolved, limits, deny=[folder])
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
                r = _report_from(answer, submissions[student], assignment)
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
            known = ", ".join(sorted(p.name for p in _assignment_dirs())) or "none"
            raise runtime.CourseInputError(
                f"{learner.name} in folder {learner.parent.name!r} matches no solution notebook "
                f"(looked for {_shown(source)}); the folder must be named after a lesson: {known}")
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


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _collect(folder: Path, assignment: str | None) -> tuple[dict[str, Path], dict[str, str], str]:
    """Student -> submitted notebook, student -> why skipped, and the assignment, from a class folder."""
    known = [p.name for p in _assignment_dirs()]
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


_COURSE_MARKER = ".gpucourse-course"


def _claim_course_dir(root: Path) -> None:
    """Empty ``root`` for a new grading run, refusing a folder the grader did not make."""
    if root.exists():
        if any(root.iterdir()) and not (root / _COURSE_MARKER).is_file():
            raise runtime.CourseInputError(f"{root} exists and was not made by the grader; choose another course_dir")
        shutil.rmtree(root)
    root.mkdir(parents=True)
    (root / _COURSE_MARKER).write_text("made by gpucourse.grading; emptied at every grading run\n")


@contextlib.contextmanager
def _course_dir(workdir):
    """A temporary course directory, or ``workdir`` emptied and kept."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="gpucourse-grade-") as tmp:
            yield Path(tmp)
        return
    root = Path(workdir).resolve()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    yield root


def _resolve_mode(mode: str | None) -> str:
    """The mode the notebooks run in, decided here so that the kernel is told, not left to choose."""
    if mode is not None:
        mode = mode.lower()
        if mode not in ("cpu", "gpu"):
            raise runtime.CourseInputError(f"mode must be 'cpu' or 'gpu', not {mode!r}")
        return mode
    wanted = os.environ.get(runtime.MODE_VARIABLE, "").lower()
    if wanted in ("cpu", "gpu"):
        return wanted
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return "cpu"
    if runtime._runtime is not None:
        return runtime._runtime.mode
    count, _ = runtime._driver_device_count()
    return "gpu" if count and runtime._cupy_usable()[0] else "cpu"


def _course_config(root: Path) -> dict:
    """The nbgrader configuration of a course directory at root (nothing is read from nbgrader_config.py).
    The gradebook waits up to two minutes for a lock: several workers write it."""
    return {"CourseDirectory": {
        "root": str(root),
        "course_id": COURSE_ID,
        "source_directory": "source",
        "release_directory": "release",
        "submitted_directory": "submitted",
        "autograded_directory": "autograded",
        "feedback_directory": "feedback",
        "db_url": f"sqlite:///{root / 'gradebook.db'}?timeout=120",
    }}


def _prepend(first: list[str], rest: str) -> str:
    return os.pathsep.join(dict.fromkeys([*first, *(p for p in rest.split(os.pathsep) if p)]))


# What of the grader's environment the workers and kernels see (anything else, such as the grader's
# PYTHONPATH, HOME, working folder or tokens, is left out).
_ENV_NAMES = {"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "LD_LIBRARY_PATH", "SYSTEMROOT", "OMP_NUM_THREADS",
              "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TF_CPP_MIN_LOG_LEVEL", "SSL_CERT_FILE"}
_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "CUPY_", "NUMBA_", "NV_")


class _Course:
    """One grading run's directories and workers.

        <root>/                 nbgrader's course directory: gradebook.db, source/, release/, submitted/,
                                autograded/, feedback/, grades.csv
        <root>/.grader/code/    the copy of the course's code that workers and kernels import
        <root>/.grader/jupyter/ the guarded kernel's kernelspec; empty Jupyter config and runtime folders
        <root>/.grader/kernels/ each kernel's pid file and private folder (home, temporary files, log)
        <root>/.grader/logs/    the workers' logs
    """

    def __init__(self, root: Path, source: Path, mode: str, limits: Limits, deny: Sequence[Path] = ()):
        self.root, self.source, self.mode, self.limits = root, source, mode, limits
        self.assignment, self.notebook = source.parent.name, source.stem
        aux = self.aux = root / ".grader"
        for sub in ("code", "jupyter/data/kernels", "jupyter/config", "jupyter/runtime", "kernels", "logs",
                    "home"):
            (aux / sub).mkdir(parents=True, exist_ok=True)
        src_dir = root / "source" / self.assignment
        src_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, src_dir / source.name)
        for extra in _assignment_files(source.parent):
            dest = src_dir / extra.relative_to(source.parent)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(extra, dest)
        for name in KERNEL_CODE:
            if (REPO / name).is_dir():
                shutil.copytree(REPO / name, aux / "code" / name, ignore=shutil.ignore_patterns(*_IGNORED, "*.pyc"))
        spec = aux / "jupyter/data/kernels" / KERNEL_NAME
        spec.mkdir(parents=True, exist_ok=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-c", "import gpucourse.grading as g; g._kernel_main()", "-f",
                     "{connection_file}"],
            "display_name": "Python 3 (graded)", "language": "python"}))
        home = Path.home()
        denied = self.denied = [REPO, SOLUTIONS, source.parent, root, home, *deny]
        self.policy = aux / "policy.json"
        self.policy.write_text(json.dumps({
            "deny": sorted({os.path.realpath(p) for p in denied} | {str(Path(p).absolute()) for p in denied}),
            "allow": [os.path.realpath(aux / "code"), str(aux / "code")],
            "kernels": str(aux / "kernels"), "mode": mode, "limits": asdict(limits)}))
        self.env = self._env()
        self.spec = aux / "worker.json"
        self.spec.write_text(json.dumps({
            "root": str(root), "assignment": self.assignment, "notebook": self.notebook, "mode": mode,
            "limits": asdict(limits), "config": {**_course_config(root), **_guarded_config(limits)}}))
        self.started: list[_Worker] = []

    def _env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k in _ENV_NAMES or k.startswith(_ENV_PREFIXES)}
        env = {k: v for k, v in env.items() if k not in ("NUMBA_CACHE_DIR", "CUPY_CACHE_DIR")}
        # nbgrader runs the `alembic` script when it creates a gradebook: find this Python's scripts even
        # when its environment is not activated.
        env["PATH"] = _prepend([sysconfig.get_path("scripts"), os.path.dirname(sys.executable)], env.get("PATH", ""))
        # The course's code comes from the copy; anything else on the grader's PYTHONPATH stays reachable,
        # except what lies in the repository or the folders the kernel may not read.
        hidden = [os.path.realpath(p) for p in (REPO, self.root, *self.denied)]
        kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if p and not any(_within(os.path.realpath(p), h) for h in hidden)]
        env.update({
            "PYTHONPATH": os.pathsep.join([str(self.aux / "code"), *kept]), "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            "HOME": str(self.aux / "home"), "JUPYTER_PATH": str(self.aux / "jupyter/data"),
            "JUPYTER_DATA_DIR": str(self.aux / "jupyter/data"), "JUPYTER_CONFIG_DIR": str(self.aux / "jupyter/config"),
            "JUPYTER_RUNTIME_DIR": str(self.aux / "jupyter/runtime"), "JUPYTER_PLATFORM_DIRS": "1",
            "IPYTHONDIR": str(self.aux / "home/.ipython"), "GPUCOURSE_GRADER_POLICY": str(self.policy),
            runtime.MODE_VARIABLE: self.mode, "NUMBA_ENABLE_CUDASIM": "1" if self.mode == "cpu" else "0",
            "SQLALCHEMY_WARN_20": "0", "PYTHONWARNINGS": "ignore",
        })
        return env

    @contextlib.contextmanager
    def workers(self, count: int):
        pool = [_Worker(self, i) for i in range(count)]
        try:
            yield pool
        finally:
            for w in [*pool, *self.started]:
                w.stop()
            self._kill_kernels()

    def restart(self, worker: _Worker) -> _Worker:
        worker.stop(kill=True)
        self._kill_kernels(parent=worker.proc.pid)
        fresh = _Worker(self, worker.index)
        self.started.append(fresh)
        fresh.ask({"op": "ready"}, STARTUP_SLACK)
        return fresh

    def _kill_kernels(self, parent: int | None = None) -> None:
        """End the guarded kernels a worker left behind (only ours: found by their pid files)."""
        for pid_file in (self.aux / "kernels").glob("*.pid"):
            try:
                pid, ppid = int(pid_file.stem), int(pid_file.read_text().split()[0])
            except (ValueError, IndexError, OSError):
                continue
            if parent is not None and ppid != parent:
                continue
            try:
                ours = b"_kernel_main" in Path(f"/proc/{pid}/cmdline").read_bytes() and \
                    str(self.aux).encode() in Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            if ours:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def generate(self, worker: _Worker) -> None:
        answer = worker.ask({"op": "generate"}, 180 + STARTUP_SLACK)
        if not answer or not answer.get("ok"):
            why = (answer or {}).get("error") or "the worker stopped answering"
            raise GradingError(f"nbgrader generate_assignment failed for {self.assignment}: {why}",
                               (answer or {}).get("log", "") + worker.log_tail())

    def grade_one(self, worker: _Worker, student: str, submission: Path) -> dict:
        """Grade one submission on ``worker``; {"ok": False, "error": ..., "restart": True} when the worker had
        to be stopped."""
        inbox = self.aux / "inbox" / student
        inbox.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copyfile(submission, inbox / self.source.name)
        except OSError as exc:
            return {"ok": False, "error": f"cannot read {submission}: {exc.strerror}"}
        limit = self.limits.notebook_timeout + STARTUP_SLACK
        answer = worker.ask({"op": "grade", "student": student, "path": str(inbox / self.source.name)}, limit)
        if answer is None:
            code = worker.proc.poll()
            why = (f"the grading process ended (exit status {code}) while it graded this notebook" if code is not None
                   else f"grading went on past {limit} s, the notebook's {self.limits.notebook_timeout} s limit and "
                        f"{STARTUP_SLACK} s to start and stop, so the grader stopped it")
            return {"ok": False, "restart": True, "error": f"{why}; it gets no points", "log": worker.log_tail()}
        return answer

    def finish(self, worker: _Worker, students: list[str]) -> dict:
        answer = worker.ask({"op": "finish", "students": students}, 120 + 5 * len(students))
        return answer or {"ok": False, "error": "the worker stopped answering", "log": worker.log_tail()}


class _Worker:
    """A child Python running nbgrader (``_worker_main``), asked one JSON request at a time over a pipe.
    Its own stdout and stderr go to a log file; the kernels it starts cannot reach the pipes."""

    def __init__(self, course: _Course, index: int):
        self.course, self.index = course, index
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()
        self.log_path = course.aux / "logs" / f"worker-{index}.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "import gpucourse.grading as g; g._worker_main()", str(course.spec),
                 str(cmd_r), str(res_w)],
                pass_fds=(cmd_r, res_w), cwd=course.root, env=course.env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        os.close(cmd_r)
        os.close(res_w)
        self.cmd = os.fdopen(cmd_w, "w", buffering=1)
        self.res = res_r
        self.buffer = b""
        self.asked = 0

    def ask(self, request: dict, timeout: float) -> dict | None:
        """The worker's answer to ``request``, or None when it gave none within ``timeout`` seconds or died.
        Answers carry the request's number, so a late answer to an earlier request is never taken for this one."""
        self.asked += 1
        try:
            self.cmd.write(json.dumps({**request, "id": self.asked}) + "\n")
            self.cmd.flush()
        except (BrokenPipeError, OSError, ValueError):
            return None
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                ready, _, _ = select.select([self.res], [], [], min(left, 1.0))
                if ready:
                    chunk = os.read(self.res, 1 << 20)
                    if not chunk:
                        return None
                    self.buffer += chunk
                elif self.proc.poll() is not None:
                    return None
            line, self.buffer = self.buffer.split(b"\n", 1)
            try:
                answer = json.loads(line)
            except json.JSONDecodeError:
                continue
            if answer.get("id") == self.asked:
                return answer

    def log_tail(self) -> str:
        try:
            return "\n" + _tail(self.log_path.read_text(errors="replace"), 40)
        except OSError:
            return ""

    def stop(self, kill: bool = False) -> None:
        if self.proc.poll() is None and not kill:
            with contextlib.suppress(OSError, ValueError):
                self.cmd.write('{"op": "quit"}\n')
                self.cmd.flush()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for closing in (self.cmd.close, lambda: os.close(self.res)):
            with contextlib.suppress(OSError, ValueError):
                closing()


def _report_from(answer: dict, learner: Path, assignment: str) -> GradeReport:
    r = answer["report"]
    return GradeReport(notebook=str(learner), assignment=assignment, mode=r["mode"],
                       tests=[TestResult(**t) for t in r["tests"]], notes=list(r["notes"]),
                       seconds=float(answer.get("seconds", 0.0)))


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# ---------------------------------------------------------------------- the worker (a child Python)

def _guarded_config(limits: Limits) -> dict:
    """nbgrader settings of the worker (the guarded preprocessors are set in ``_worker_main``)."""
    return {
        "Execute": {"timeout": limits.timeout, "interrupt_on_timeout": True, "kernel_name": KERNEL_NAME,
                    "iopub_timeout": 5, "raise_on_iopub_timeout": True, "shutdown_kernel": "immediate",
                    "skip_cells_with_tag": "gpucourse-never-skip"},
        "IgnorePattern": {"enabled": True, "pattern": WARNING_PATTERN},
        # nbgrader leaves autograded notebooks read-only (444) by default; the worker then writes its verdicts
        # into them, which only root could do. The owner keeps write access.
        "Autograde": {"create_student": True, "permissions": 644},
        "LimitOutput": {"max_lines": 1000, "max_traceback": TRACEBACK_LINES},
        "Application": {"log_level": "WARN"},
    }


_RUN: dict = {}  # the notebook being autograded in this worker: its limits, mode and per-cell events


def _worker_main() -> None:
    """The worker: read one JSON request a line from the command pipe, answer one JSON line on the result
    pipe. Requests: generate; grade {student, path}; finish {students}; ready; quit."""
    spec_path, cmd_fd, res_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    spec = json.loads(Path(spec_path).read_text())
    commands = os.fdopen(cmd_fd, "r")
    results = os.fdopen(res_fd, "w", buffering=1)
    import logging
    import traceback
    import warnings

    warnings.simplefilter("ignore")
    logging.getLogger("traitlets").setLevel(logging.ERROR)
    from nbgrader.apps.api import NbGraderAPI
    from nbgrader.preprocessors import AssignLatePenalties, CheckCellMetadata, IgnorePattern, LimitOutput
    from nbconvert.preprocessors import ClearMetadataPreprocessor
    from traitlets.config import Config

    guarded_execute, guarded_save = _guarded_preprocessors()
    config = Config(spec["config"])
    config.Autograde.autograde_preprocessors = [guarded_execute, IgnorePattern, ClearMetadataPreprocessor,
                                                LimitOutput, guarded_save, AssignLatePenalties, CheckCellMetadata]
    api = NbGraderAPI(config=config)
    limits = Limits(**spec["limits"])
    _RUN.update(limits=limits, mode=spec["mode"])

    def generate(request):
        r = api.generate_assignment(spec["assignment"], force=True, create=True)
        return {"ok": bool(r["success"]), "error": _why_failed(r), "log": r.get("log", "")}

    def grade(request):
        return _worker_grade(api, spec, request["student"], Path(request["path"]))

    def finish(request):
        return _worker_finish(api, spec, request["students"])

    handlers = {"generate": generate, "grade": grade, "finish": finish, "ready": lambda r: {"ok": True}}
    for line in commands:
        request = json.loads(line)
        if request.get("op") == "quit":
            break
        try:
            answer = handlers[request["op"]](request)
        except Exception as exc:  # noqa: BLE001 - answer, do not die: the parent decides
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "log": traceback.format_exc()}
        results.write(json.dumps({**answer, "id": request.get("id")}) + "\n")


def _why_failed(result: dict) -> str:
    if result.get("success"):
        return ""
    log = _text(result.get("log", "")) + "\n" + _text(result.get("error", ""))
    errors = [line.strip() for line in log.splitlines() if re.match(r"\s*[\w.]+(Error|Exception): ", line)]
    return next((e for e in reversed(errors) if "see the the above traceback" not in e), _tail(log, 3) or "see the log")


def _worker_grade(api, spec: dict, student: str, raw: Path) -> dict:
    """Repair and check one submission, autograde it, and build its report (as a dict)."""
    root, assignment, name = Path(spec["root"]), spec["assignment"], spec["notebook"]
    started = time.monotonic()
    try:
        learner = _read_notebook(raw)
        source = json.loads((root / "source" / assignment / f"{name}.ipynb").read_text(encoding="utf-8"))
        release_path = root / "release" / assignment / f"{name}.ipynb"
        release = json.loads(release_path.read_text(encoding="utf-8")) if release_path.is_file() else None
        nb, notes = _prepare_submission(learner, source, release)
    except runtime.CourseInputError as exc:
        message = str(exc)
        return {"ok": False, "error": message if message.startswith(f"{name}.ipynb") else f"{name}.ipynb: {message}"}
    folder = root / "submitted" / student / assignment
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (folder / f"{name}.ipynb").write_text(json.dumps(nb, indent=1), encoding="utf-8")
    _RUN["events"] = {}
    r = api.autograde(assignment, student, force=True, create=True)
    graded = root / "autograded" / student / assignment / f"{name}.ipynb"
    if not r["success"] or not graded.is_file():
        return {"ok": False, "error": f"nbgrader autograde failed: {_why_failed(r)}", "log": r.get("log", "")}
    report = _worker_report(root, assignment, name, student, spec["mode"], _RUN["events"])
    report["notes"] = notes + report["notes"]
    _annotate(graded, report["tests"])
    return {"ok": True, "report": report, "seconds": time.monotonic() - started}


def _worker_report(root: Path, assignment: str, name: str, student: str, mode: str, events: dict) -> dict:
    from nbgrader.api import Gradebook

    graded = root / "autograded" / student / assignment / f"{name}.ipynb"
    cells = json.loads(graded.read_text(encoding="utf-8"))["cells"]
    with Gradebook(_course_config(root)["CourseDirectory"]["db_url"], course_id=COURSE_ID) as gb:
        sub = gb.find_submission_notebook(name, assignment, student)
        grades = {g.name: (g.score, float(g.max_score), bool(g.needs_manual_grade)) for g in sub.grades}
    tests, notes = [], []
    for index, cell in enumerate(cells):
        meta = cell.get("metadata", {}).get("nbgrader", {})
        grade_id = meta.get("grade_id")
        if not meta.get("grade") or grade_id not in grades:
            continue
        score, max_score, manual = grades.pop(grade_id)
        _, status, message = _verdict(cell, max_score, mode, events.get(index))
        if manual:
            status, message = "needs manual grading", ""
        tests.append({"grade_id": grade_id, "points": float(score or 0.0), "max_points": max_score,
                      "status": status, "message": message})
    for grade_id, (score, max_score, _) in grades.items():  # in the gradebook but not in the notebook
        tests.append({"grade_id": grade_id, "points": float(score or 0.0), "max_points": max_score,
                      "status": "failed", "message": "the cell is missing from the notebook"})
    for index, cell in enumerate(cells):  # what happened in the cells that are not tests
        if cell.get("cell_type") != "code" or cell.get("metadata", {}).get("nbgrader", {}).get("grade"):
            continue
        stop = events.get(index)
        if stop and stop[0] in ("kernel died", "timed out"):
            notes.append(f"cell {_cell_label(cell, index)}: {stop[1]}")
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error" and out.get("ename") == "PermissionError" and \
                    _text(out.get("evalue")).startswith("the grader ") and \
                    not _text(out.get("evalue")).startswith("the grader did not run"):
                notes.append(f"cell {_cell_label(cell, index)}: PermissionError: {_first_lines(out['evalue'], 1)}")
    return {"mode": mode, "tests": tests, "notes": notes}


def _cell_label(cell: dict, index: int) -> str:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") or f"{index + 1} (one you added)"


def _annotate(graded: Path, tests: list[dict]) -> None:
    """End every graded cell of the autograded notebook with the grader's verdict, for the feedback HTML."""
    nb = json.loads(graded.read_text(encoding="utf-8"))
    verdicts = {t["grade_id"]: t for t in tests}
    for cell in nb["cells"]:
        t = verdicts.get(cell.get("metadata", {}).get("nbgrader", {}).get("grade_id"))
        if t is None or cell.get("cell_type") != "code":
            continue
        got = "-" if t["status"] in (NOT_GRADABLE, NOT_GRADABLE_GPUS) else _num(t["points"])
        detail = t["status"] if t["message"] in ("", t["status"]) else f"{t['status']}: {t['message']}"
        cell.setdefault("outputs", []).append({"output_type": "stream", "name": "stdout",
                                               "text": f"grader: {got} / {_num(t['max_points'])}, {detail}\n"})
    graded.write_text(json.dumps(nb, indent=1), encoding="utf-8")


def _worker_finish(api, spec: dict, students: list[str]) -> dict:
    """nbgrader's feedback HTML for every graded student, and its CSV export of the gradebook."""
    from nbgrader.api import Gradebook
    from nbgrader.plugins.export import CsvExportPlugin

    root, assignment = Path(spec["root"]), spec["assignment"]
    log = []
    for student in students:
        r = api.generate_feedback(assignment, student, force=True)
        log.append(r.get("log", ""))
        if not r["success"]:
            return {"ok": False, "error": f"feedback for {student}: {_why_failed(r)}", "log": "\n".join(log)}
    with Gradebook(_course_config(root)["CourseDirectory"]["db_url"], course_id=COURSE_ID) as gb:
        CsvExportPlugin(to=str(root / "grades.csv")).export(gb)
    return {"ok": True, "csv": str(root / "grades.csv")}


def _guarded_preprocessors():
    """nbgrader's executor and score keeper with the grader's limits and rules (defined here, in the
    worker, because they subclass nbgrader's classes)."""
    import nbformat
    from nbclient.client import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from nbgrader.preprocessors import Execute, SaveAutoGrades

    def error_output(ename: str, evalue: str) -> dict:
        return nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[f"{ename}: {evalue}"])

    class GuardedExecute(Execute):
        """Execute with a notebook time limit, output caps, and a dead or stuck kernel reported per cell."""

        def preprocess(self, nb, resources=None, km=None):
            limits: Limits = _RUN["limits"]
            events: dict = _RUN.setdefault("events", {})
            NotebookClient.__init__(self, nb, km)
            self.reset_execution_trackers()
            self._check_assign_resources(resources)
            self.kernel_name = KERNEL_NAME  # whatever kernel the notebook's metadata names
            self.skip_cells_with_tag = "gpucourse-never-skip"
            self._chars = {"cell": 0, "notebook": 0, "noted": set()}
            deadline = time.monotonic() + limits.notebook_timeout
            stop = None
            with self.setup_kernel():
                info = self.wait_for_reply(self.kc.kernel_info())
                self.nb.metadata["language_info"] = info["content"]["language_info"]
                for index, cell in enumerate(self.nb.cells):
                    if cell.cell_type != "code" or not cell.source.strip():
                        continue
                    left = deadline - time.monotonic()
                    if stop is None and left < 1:
                        stop = f"the notebook used up its limit of {limits.notebook_timeout} s before this cell"
                    if stop is not None:
                        cell.outputs = [error_output("NotRun", stop)]
                        events[index] = ("not run", stop)
                        continue
                    timeout = int(max(1, min(limits.timeout, left)))
                    self.timeout_func = lambda _cell, t=timeout: t
                    self._chars["cell"], self._chars["noted"] = 0, set()
                    self._timed_out = False
                    try:
                        self.preprocess_cell(cell, resources, index)
                    except DeadKernelError:
                        how = self._exit_status()
                        events[index] = ("kernel died", f"the kernel died while this cell ran ({how}); the cells "
                                         "after it were not run. Restart the kernel and run all cells to find the "
                                         "line that ends it")
                        cell.outputs.append(error_output("KernelDied", events[index][1]))
                        stop = f"the kernel died in an earlier cell ({how})"
                    except CellTimeoutError:
                        events[index] = ("timed out", f"no result within {timeout} s, and the cell did not stop "
                                         "when interrupted; the cells after it were not run")
                        cell.outputs.append(error_output("CellTimeoutError", events[index][1]))
                        stop = "an earlier cell could not be interrupted"
                    except Exception as exc:  # noqa: BLE001 - a grader failure on one cell, not the notebook
                        events[index] = ("failed", f"the grader could not run this cell ({type(exc).__name__}: "
                                         f"{_first_lines(str(exc), 1, 200)}); the cells after it were not run")
                        cell.outputs.append(error_output("GraderError", events[index][1]))
                        stop = "the grader could not run an earlier cell"
                    else:
                        if self._timed_out:
                            why = (f"; the notebook's limit of {limits.notebook_timeout} s was reached"
                                   if timeout < limits.timeout else "")
                            events[index] = ("timed out", f"no result within {timeout} s; the cell was "
                                             f"interrupted{why}")
                    if stop is not None:
                        self.shutdown_kernel = "immediate"
            self.set_widgets_metadata()
            return self.nb, self.resources

        async def _async_handle_timeout(self, timeout, cell=None):
            self._timed_out = True
            return await super()._async_handle_timeout(timeout, cell)

        def _exit_status(self) -> str:
            process = getattr(getattr(self.km, "provisioner", None), "process", None)
            code = None
            if process is not None:
                with contextlib.suppress(Exception):
                    code = process.wait(timeout=5)
            return _describe_exit(code)

        def output(self, outs, msg, display_id, cell_index):
            out = super().output(outs, msg, display_id, cell_index)
            if out is None:
                return None
            limits: Limits = _RUN["limits"]
            kind = out.get("output_type")
            if kind == "error":
                out["evalue"] = _clip(str(out.get("evalue", "")), 4000)
                tb = list(out.get("traceback", []))
                out["traceback"] = tb[:TRACEBACK_LINES] + ([f"... {len(tb) - TRACEBACK_LINES} more lines"]
                                                           if len(tb) > TRACEBACK_LINES else [])
                return out
            if kind == "execute_result":
                data = out.get("data", {})
                plain = _clip(_text(data.get("text/plain", "")), VALUE_CHARS)
                out["data"] = {"text/plain": plain} if _output_chars(out) > VALUE_CHARS * 2 else data
                return out
            size = _output_chars(out)
            budget = min(limits.cell_output_chars - self._chars["cell"],
                         limits.notebook_output_chars - self._chars["notebook"])
            if size <= budget:
                self._chars["cell"] += size
                self._chars["notebook"] += size
                return out
            stream = out.get("name") if kind == "stream" else "stdout"
            if kind == "stream" and budget > 0:
                out["text"] = _text(out.get("text"))[:budget]
                self._chars["cell"] += budget
                self._chars["notebook"] += budget
            elif display_id:
                out["data"] = {"text/plain": "[output dropped by the grader]"}
            elif outs and outs[-1] is out:
                outs.pop()
            if stream not in self._chars["noted"]:
                self._chars["noted"].add(stream)
                whose = ("this cell" if limits.cell_output_chars - self._chars["cell"] <= 0 else "this notebook")
                outs.append(nbformat.v4.new_output(
                    "stream", name=stream, text=f"\n[... output truncated: the grader keeps at most "
                    f"{min(limits.cell_output_chars, limits.notebook_output_chars)} characters of {whose}'s "
                    "output]\n"))
            return out

    class GuardedSaveAutoGrades(SaveAutoGrades):
        """SaveAutoGrades scoring with ``_verdict`` instead of nbgrader's determine_grade."""

        def preprocess_cell(self, cell, resources, cell_index):
            self._index = cell_index
            return super().preprocess_cell(cell, resources, cell_index)

        def _add_score(self, cell, resources):
            grade = self.gradebook.find_grade(cell.metadata["nbgrader"]["grade_id"], self.notebook_id,
                                              self.assignment_id, self.student_id)
            points, _, _ = _verdict(cell, float(cell.metadata["nbgrader"]["points"]), _RUN["mode"],
                                    _RUN.get("events", {}).get(self._index))
            grade.auto_score = points
            grade.needs_manual_grade = grade.manual_score is not None or points is None
            self.gradebook.db.commit()

    return GuardedExecute, GuardedSaveAutoGrades


def _describe_exit(code) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            sig = signal.Signals(-code)
        except ValueError:
            return f"killed by signal {-code}"
        what = {signal.SIGSEGV: "a segmentation fault", signal.SIGKILL: "killed, often for running out of memory",
                signal.SIGABRT: "aborted", signal.SIGBUS: "a bus error", signal.SIGFPE: "a floating-point exception",
                signal.SIGXFSZ: "a file grew past its limit"}.get(sig)
        return f"{sig.name}" + (f": {what}" if what else "")
    return f"exit code {code}"


def _clip(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars] + f"... [{len(text) - chars} more characters]"


def _output_chars(out) -> int:
    if out.get("output_type") == "stream":
        return len(_text(out.get("text")))
    return sum(len(v) if isinstance(v, str) else len(json.dumps(v)) for v in (out.get("data") or {}).values())


# --------------------------------------------------------------------------------- verdicts

_PLAIN_NUMBER = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?$|^[+-]?(?:nan|inf)$")


def _verdict(cell, max_points: float, mode: str | None, event=None) -> tuple[float | None, str, str]:
    """Points (None: needs manual grading), status and message for one graded cell of an autograded
    notebook; the rules are in the module docstring. ``event``: (status, message) the guarded executor
    recorded for this cell (kernel died, timed out, not run)."""
    meta = cell.get("metadata", {}).get("nbgrader", {})
    grade_id = meta.get("grade_id", "")
    outputs = cell.get("outputs", [])
    stdout = _text([_text(o.get("text")) for o in outputs
                    if o.get("output_type") == "stream" and o.get("name") == "stdout"])
    said = [line for line in stdout.splitlines() if line.startswith("performance:")]
    if grade_id.startswith(PERF_PREFIX) and mode == "cpu":
        line = said[-1] if said and "not gradable" in said[-1] else CPU_PERF_MESSAGE.format(points=_num(max_points))
        return 0.0, NOT_GRADABLE, line
    if event:
        return 0.0, event[0], event[1]
    if grade_id.startswith(PERF_PREFIX) and said and said[-1].startswith(GPUS_PERF_MESSAGE.split("{")[0]) \
            and not any(o.get("output_type") == "error" for o in outputs):
        return 0.0, NOT_GRADABLE_GPUS, said[-1]
    if cell.get("cell_type") != "code" or meta.get("solution") or meta.get("task"):
        return None, "needs manual grading", ""
    errors = [o for o in outputs if o.get("output_type") == "error"]
    if errors:
        if any(e.get("ename") == "CellTimeoutError" for e in errors):
            return 0.0, "timed out", "no result in time; the cell was interrupted"
        e = errors[0]
        message = e.get("ename", "Error") + (f": {_first_lines(e.get('evalue', ''))}" if e.get("evalue") else "")
        return 0.0, "failed", message
    stderr = [_text(o.get("text")) for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stderr"]
    if stderr:
        return 0.0, "failed", ("wrote to stderr, which nbgrader scores as a failure: "
                               + (_first_lines("".join(stderr)) or "(empty)"))
    message = said[-1] if said else ""
    results = [o for o in outputs if o.get("output_type") == "execute_result"]
    if results and _ends_with_expression(_text(cell.get("source"))):
        shown = _text((results[-1].get("data") or {}).get("text/plain")).strip()
        if _PLAIN_NUMBER.match(shown):
            value = float(shown)
            if not 0 <= value <= max_points:
                return 0.0, "failed", (f"the test's value {_clip(shown, 40)} is not a number of points between 0 "
                                       f"and {_num(max_points)}")
            if value < max_points:
                return value, "partial" if value > 0 else "failed", \
                    message or f"the cell's value gave {_num(value)} of {_num(max_points)} points"
            return float(max_points), "passed", message or "passed"
    return float(max_points), "passed", message or "passed"


def _ends_with_expression(source: str) -> bool:
    try:
        tree = compile(_transform_ipython(source), "<test>", "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except (SyntaxError, ValueError):
        return False
    return bool(tree.body) and isinstance(tree.body[-1], ast.Expr) and not source.rstrip().endswith(";")


def _text(x) -> str:
    if isinstance(x, list):
        x = "".join(s for s in x if isinstance(s, str))
    return _ANSI.sub("", x if isinstance(x, str) else "")


def _first_lines(text: str, lines: int = 3, chars: int = 400) -> str:
    text = "\n".join(_text(text).strip().splitlines()[:lines])
    return text if len(text) <= chars else text[: chars - 3] + "..."


# ------------------------------------------------------------------------- the guarded kernel

def _kernel_main() -> None:
    """The graded notebook's kernel (the kernelspec's argv): private folders, resource limits, stdout and
    stderr to a log, output caps, the audit hook, then ipykernel. See the module docstring."""
    policy = json.loads(Path(os.environ["GPUCOURSE_GRADER_POLICY"]).read_text())
    limits = policy["limits"]
    pid = os.getpid()
    kernels = Path(policy["kernels"])
    private = kernels / f"kernel-{pid}"
    for sub in ("home", "tmp", "ipython", "cache", "mpl"):
        (private / sub).mkdir(parents=True, exist_ok=True)
    (kernels / f"{pid}.pid").write_text(f"{os.getppid()}\n")
    os.environ.update({
        "HOME": str(private / "home"), "TMPDIR": str(private / "tmp"), "IPYTHONDIR": str(private / "ipython"),
        "MPLCONFIGDIR": str(private / "mpl"), "XDG_CACHE_HOME": str(private / "cache"),
        "NUMBA_CACHE_DIR": str(private / "cache/numba"), "CUPY_CACHE_DIR": str(private / "cache/cupy"),
        "GPUCOURSE_CACHE": str(private / "cache/gpucourse"), "PYTHONDONTWRITEBYTECODE": "1"})
    tempfile.tempdir = None
    sys.dont_write_bytecode = True
    log = os.open(private / "kernel.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file limit fails with an OSError instead
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
    if policy["mode"] == "cpu":
        memory = min(limits["memory_bytes"], os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cwd = os.getcwd()
    import site

    python = [os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, site.getusersitepackages(),
                                            *policy["allow"])]

    def hidden(entry: str) -> bool:  # inside a denied folder, and not inside Python's own folders there
        real = os.path.realpath(entry)
        deny = max((len(d) for d in policy["deny"] if _within(real, d)), default=-1)
        return deny > max((len(a) for a in python if _within(real, a)), default=-1)

    sys.path[:] = [p for p in sys.path if p and not hidden(p)]

    from ipykernel.kernelapp import IPKernelApp

    app = IPKernelApp.instance()
    app.initialize(sys.argv[1:])
    sys.path[:] = [p for p in sys.path if p not in ("", ".", cwd)]
    _cap_kernel_output(limits["kernel_output_chars"])
    import ctypes

    trusted = {sys.prefix, sys.base_prefix, sys.exec_prefix, *policy["allow"],
               *(p for p in sys.path if p and os.path.isdir(p))}
    trusted |= {os.path.realpath(p) for p in trusted}
    allow = trusted | {"/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/opt", "/sys", "/dev", "/run",
                       "/proc", "/var/lib/nvidia", os.environ.get("CUDA_HOME", "/usr/local/cuda"),
                       os.environ.get("CUDA_PATH", "/usr/local/cuda")}
    secrets = ["/etc/shadow", "/etc/gshadow", "/etc/ssh", "/etc/sudoers", "/etc/sudoers.d", "/home", "/root"]
    _install_audit_hook(allow=sorted(allow - {""}), deny=[*policy["deny"], *secrets], writable=[cwd, str(private)],
                        trusted=sorted(p.rstrip("/") + "/" for p in trusted if p),
                        ctypes_dir=os.path.dirname(ctypes.__file__) + "/")
    app.start()


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _cap_kernel_output(limit: int) -> None:
    """Drop what a cell writes to stdout or stderr past ``limit`` characters (per cell and stream), with one
    line saying so on the same stream, before it ever leaves the kernel."""
    from IPython.core.interactiveshell import InteractiveShell
    from ipykernel.iostream import OutStream

    original = OutStream.write
    used: dict = {}

    def write(self, string):
        shell = InteractiveShell._instance
        key = (getattr(self, "name", "?"), getattr(shell, "execution_count", None))
        if key not in used:
            if len(used) > 8:
                used.clear()
            used[key] = 0
        before = used[key]
        if not isinstance(string, str) or before > limit:
            return original(self, string) if not isinstance(string, str) else len(string)
        used[key] = before + len(string)
        if used[key] <= limit:
            return original(self, string)
        original(self, string[: limit - before])
        original(self, f"\n[... the rest was dropped: a graded cell may write at most {limit} characters to "
                       f"{key[0]}]\n")
        used[key] = limit + 1
        return len(string)

    OutStream.write = write


def _install_audit_hook(*, allow: list[str], deny: list[str], writable: list[str], trusted: list[str],
                        ctypes_dir: str) -> None:
    """The kernel's audit hook (PEP 578; see the module docstring). Everything it uses is bound here, as C
    functions or immutable values: nothing a notebook can reach by name changes what it decides."""
    import posix

    lstat, readlink, getcwd, getpid, getframe = posix.lstat, posix.readlink, posix.getcwd, posix.getpid, sys._getframe
    rules = tuple(sorted({(r.rstrip("/") or "/", kind) for kind, roots in (("allow", allow), ("deny", deny),
                                                                            ("write", writable)) for r in roots},
                         key=lambda rule: (-len(rule[0]), rule[1] != "deny")))
    writable_roots = tuple(r.rstrip("/") for r in writable)
    trusted_roots = tuple(trusted)
    own = str(getpid())
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    S_IFMT, S_IFLNK = 0o170000, 0o120000
    path_types = (str, bytes)
    decode = bytes.decode

    def resolve(path) -> str:
        if isinstance(path, bytes):
            path = decode(path, "utf-8", "surrogateescape")
        if not path.startswith("/"):
            path = getcwd() + "/" + path
        pending = [p for p in path.split("/") if p and p != "."][::-1]
        done, hops = "", 0
        while pending:
            part = pending.pop()
            if part == "..":
                done = done.rsplit("/", 1)[0]
                continue
            candidate = done + "/" + part
            try:
                mode = lstat(candidate).st_mode
            except OSError:
                done = candidate
                continue
            if mode & S_IFMT == S_IFLNK and hops < 40:
                hops += 1
                target = readlink(candidate)
                if target.startswith("/"):
                    done = ""
                pending.extend([p for p in target.split("/") if p and p != "."][::-1])
                continue
            done = candidate
        return done or "/"

    def within(path, root):
        return root == "/" or path == root or path.startswith(root + "/")

    def as_path(value):
        if type(value) in path_types:
            return value
        if isinstance(value, os.PathLike) and type(value).__module__ == "pathlib":
            return str(value)
        return None

    def check_read(value) -> None:
        path = as_path(value)
        if path is None:
            if value is None or type(value) is int:
                return
            raise PermissionError("the grader accepts only plain paths (str, bytes, pathlib) in a graded notebook")
        real = resolve(path)
        if real.startswith("/proc/"):  # other processes' status only (psutil reads it), nobody's memory
            parts = real.split("/")
            if (parts[2].isdigit() and parts[2] != own and parts[3:] not in (["stat"], ["status"], [])) or \
                    parts[-1] == "mem":
                raise PermissionError(f"the grader does not let a notebook read {real}")
        for root, kind in rules:
            if within(real, root):
                if kind == "deny":
                    break
                return
        raise PermissionError(f"the grader does not let a notebook read {real} (it may read its own folder, "
                              "Python and the system's files)")

    def check_write(value) -> None:
        path = as_path(value)
        if path is None:
            if type(value) is int:
                return
            raise PermissionError("the grader accepts only plain paths (str, bytes, pathlib) in a graded notebook")
        real = resolve(path)
        if real == "/dev/null" or any(within(real, root) for root in writable_roots):
            return
        raise PermissionError(f"the grader lets a notebook write only in its own folder, not {real}")

    def from_notebook(skip_ctypes: bool = False) -> bool:
        frame = getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if skip_ctypes and name.startswith(ctypes_dir):
                frame = frame.f_back
                continue
            return not (name.startswith("<frozen ") or name.startswith(trusted_roots))
        return False

    processes = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                 "pty.spawn", "os.startfile"}
    network = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}
    writes_one = {"os.remove", "os.rmdir", "os.mkdir", "os.truncate", "os.chmod", "os.chown", "os.utime",
                  "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr", "shutil.rmtree", "os.mkfifo",
                  "os.mknod", "tempfile.mkstemp", "tempfile.mkdtemp"}
    reads_one = {"os.listdir", "os.scandir", "os.listxattr", "os.getxattr", "os.chdir"}
    ctypes_events = {"ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.cdata", "ctypes.cdata/buffer",
                     "ctypes.string_at", "ctypes.wstring_at", "ctypes.call_function"}
    introspection = {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "exec", "compile", "code.__new__",
                     "marshal.loads", "marshal.load", "function.__new__"}
    always = {"sys.settrace", "sys.setprofile", "resource.setrlimit", "resource.prlimit", "sys.unraisablehook"}
    watched = frozenset({"open", "os.rename", "os.symlink", "os.link", "os.kill", "os.killpg", "sqlite3.connect",
                         "import", "object.__setattr__", *processes, *network, *writes_one, *reads_one,
                         *ctypes_events, *introspection, *always})

    def hook(event, args):
        if event not in watched:
            return
        if event == "open":
            path, mode, flags = args
            if (type(mode) is str and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)) or \
                    (type(flags) is int and flags & write_flags):
                check_write(path)
            else:
                check_read(path)
        elif event in reads_one:
            check_read(args[0] if args else None)
        elif event in writes_one:
            check_write(args[0])
        elif event == "os.rename":
            check_write(args[0])
            check_write(args[1])
        elif event == "os.symlink":
            check_write(args[1])
        elif event == "os.link":
            check_write(args[0])
            check_write(args[1])
        elif event == "sqlite3.connect":
            database = args[0]
            if database not in (":memory:", "", b":memory:", b""):
                if type(database) in path_types and (database[:5] in ("file:", b"file:")):
                    raise PermissionError("the grader does not let a notebook open databases by URI")
                check_write(database)
        elif event == "import":
            filename = args[1] if len(args) > 1 else None
            if type(filename) is str and any(within(resolve(filename), r) for r in writable_roots):
                raise PermissionError("the grader does not let a notebook load a compiled module it wrote")
        elif event == "object.__setattr__":
            if len(args) > 1 and args[1] in ("__code__", "__defaults__", "__kwdefaults__", "__globals__") and \
                    from_notebook():
                raise PermissionError(f"the grader does not let a notebook replace a function's {args[1]}")
        elif event in processes:
            raise PermissionError("the grader does not let a notebook start processes")
        elif event in ("os.kill", "os.killpg"):
            if event == "os.killpg" or str(args[0]) != own:
                raise PermissionError("the grader does not let a notebook signal other processes")
        elif event in network:
            raise PermissionError("the grader does not let a notebook use the network")
        elif event in ctypes_events:
            if from_notebook(skip_ctypes=True):
                raise PermissionError("the grader does not let a notebook use ctypes")
        elif event in introspection:
            if from_notebook():
                raise PermissionError(f"the grader does not let a notebook use {event}")
        elif event in always:
            raise PermissionError(f"the grader does not let a notebook use {event}")

    sys.addaudithook(hook)


# ----------------------------------------------------------------------------------- performance

def performance_score(ratio: float, max_points: float) -> float:
    """Points for running ``ratio`` times as long as the reference: all up to FULL_AT, none from ZERO_AT,
    linear in between (rounded down to 0.01)."""
    if not ratio > 0 or max_points < 0:
        raise runtime.CourseInputError(f"need a positive ratio and points >= 0, got ratio={ratio}, points={max_points}")
    if ratio <= FULL_AT:
        return float(max_points)
    if ratio >= ZERO_AT:
        return 0.0
    points = max_points * (ZERO_AT - ratio) / (ZERO_AT - FULL_AT)
    return float(int(points * 100 + 1e-9) / 100)


class _WrongOutput(Exception):
    pass


class _Tampered(Exception):
    pass


_CUDA_TIMING = ("eventCreate", "eventRecord", "eventSynchronize", "eventElapsedTime", "eventDestroy",
                "deviceSynchronize")


class _CudaClock:
    """Times f(*args) on the GPU: a CUDA event on the legacy default stream, f, a device-wide
    synchronisation (so work f left on any other stream is timed too), a second event.

    It calls CuPy's compiled bindings of the CUDA runtime (cupy.cuda.runtime.event*, deviceSynchronize),
    checked to be those compiled functions and held from the start: a notebook that replaced them, or
    replaces them while it is being timed, gets 0 points (``verify``)."""

    def __init__(self, cp):
        import types

        self.module = cp.cuda.runtime
        self.fns = {}
        for name in _CUDA_TIMING:
            fn = getattr(self.module, name, None)
            owner = getattr(getattr(fn, "__self__", None), "__name__", None)
            if type(fn) is not types.BuiltinFunctionType or fn.__name__ != name or \
                    owner != "cupy_backends.cuda.api.runtime":
                raise _Tampered(f"cupy.cuda.runtime.{name} is not CuPy's own function: the notebook replaced it")
            self.fns[name] = fn
        self.cp = cp

    def verify(self) -> None:
        for name, fn in self.fns.items():
            if getattr(self.module, name, None) is not fn:
                raise _Tampered(f"the notebook replaced cupy.cuda.runtime.{name} while it was being timed")

    def time(self, fn: Callable, args: tuple) -> float:
        f = self.fns
        start, end = f["eventCreate"](), f["eventCreate"]()
        try:
            f["deviceSynchronize"]()
            f["eventRecord"](start, 0)
            fn(*args)
            f["deviceSynchronize"]()
            f["eventRecord"](end, 0)
            f["eventSynchronize"](end)
            return float(f["eventElapsedTime"](start, end))
        finally:
            f["eventDestroy"](start)
            f["eventDestroy"](end)

    def sample(self, x):
        return self.cp.asnumpy(x)


class _HostClock:
    """A clock for host (NumPy) work, held from the start: for testing the harness without a GPU."""

    def __init__(self):
        self.now = time.perf_counter_ns

    def verify(self) -> None:
        pass

    def time(self, fn: Callable, args: tuple) -> float:
        t0 = self.now()
        fn(*args)
        return (self.now() - t0) / 1e6

    def sample(self, x):
        import numpy as np

        return np.asarray(x)


def _poison(out, rng) -> None:
    """Fill ``out`` with values no correct run leaves behind: NaN, or a random integer for integer outputs
    (a different one every run, so an output left over from an earlier run is caught too)."""
    kind = out.dtype.kind
    if kind in "fc":
        out.fill(float("nan"))
    elif kind in "iu":
        import numpy as np

        info = np.iinfo(out.dtype)
        out.fill(int(rng.integers(max(info.min, -2**31), min(info.max, 2**31 - 1))))
    elif kind == "b":
        out.fill(bool(rng.integers(2)))
    else:
        raise runtime.CourseInputError(f"the output of a performance test must be a number array, not {out.dtype}")


def _fingerprint(clock, args: tuple, out_index: int) -> bytes | None:
    """A few evenly spaced elements of every input array: equal fingerprints mean repeated inputs (None when
    there is no input array to compare)."""
    parts = []
    for i, a in enumerate(args):
        if i == out_index % len(args):
            continue
        if hasattr(a, "ravel") and hasattr(a, "size") and a.size:
            step = max(1, a.size // 64)
            parts.append(clock.sample(a.ravel()[::step][:64]).tobytes())
    return b"|".join(parts) if parts else None


def _measure(candidate: Callable, reference: Callable, *, make_inputs: Callable, check: Callable, clock,
             repeats: int, warmup: int, out_index: int = -1, names=("your code", "the reference")) -> dict:
    """Time candidate and reference alternately in this process; every run gets fresh inputs from
    ``make_inputs`` (refused if they repeat), its output poisoned before and checked right after.

    Returns {"candidate": [ms...], "reference": [ms...], "hopeless": bool}. Raises _WrongOutput for a
    wrong result (the message says whose), _Tampered if the clock's functions were replaced, and
    CourseError when make_inputs repeats itself."""
    import numpy as np

    rng = np.random.default_rng()
    state = {"fingerprint": None, "runs": 0}

    def run(fn: Callable, who: str) -> float:
        args = make_inputs()
        args = args if isinstance(args, tuple) else (args,)
        fingerprint = _fingerprint(clock, args, out_index)
        if fingerprint is not None and fingerprint == state["fingerprint"]:
            raise runtime.CourseError("make_inputs gave the same inputs twice in a row; the timing harness needs "
                                      "fresh random inputs for every run (a cache could otherwise answer)")
        state["fingerprint"] = fingerprint
        _poison(args[out_index], rng)
        ms = clock.time(fn, args)
        state["runs"] += 1
        try:
            ok = check(*args)
            why = "" if ok or ok is None else "the check failed"
        except AssertionError as exc:
            why = str(exc) or "the check failed"
        except Exception as exc:  # noqa: BLE001 - an output the check cannot even read is wrong too
            why = f"{type(exc).__name__}: {exc}"
        if why:
            raise _WrongOutput(f"{who} gave a wrong result on run {state['runs']} ({_first_lines(why, 1, 200)})")
        return ms

    times = {"candidate": [], "reference": [], "hopeless": False}
    for _ in range(warmup):
        run(reference, names[1])
        run(candidate, names[0])
    probe_ref, probe = run(reference, names[1]), run(candidate, names[0])
    if probe > 2 * ZERO_AT * probe_ref:  # no points either way: do not spend the repeats
        times.update(candidate=[probe], reference=[probe_ref], hopeless=True)
    else:
        for _ in range(repeats):
            times["reference"].append(run(reference, names[1]))
            times["candidate"].append(run(candidate, names[0]))
    clock.verify()
    return times


def gpus_missing(needed: int, max_points: float) -> bool:
    """On a GPU machine with fewer than ``needed`` GPUs, print the line that makes a ``perf_`` test "not gradable
    here (needs more GPUs)" (0 points, left out of the gradable total) and return True; otherwise False. A
    multi-GPU test cell starts with ``if not grading.gpus_missing(2, points): ...``. In CPU mode every perf_
    test is not gradable anyway, and this returns False."""
    if not runtime.is_gpu():
        return False
    have = runtime.cupy().cuda.runtime.getDeviceCount()
    if have >= needed:
        return False
    print(GPUS_PERF_MESSAGE.format(needed=needed, have=have, points=_num(max_points)))
    return True


def performance_points(candidate: Callable, reference: Callable, *, make_inputs: Callable, check: Callable,
                       max_points: float, repeats: int = 20, warmup: int = 3, out_index: int = -1,
                       gpus: int = 1) -> float:
    """Time ``candidate`` against ``reference`` on a GPU and return the points earned, as a Python float.

    Both are called as f(*make_inputs()), alternately, ``warmup`` times each untimed and ``repeats`` times
    each timed, in this one process (``_measure``). Every run gets fresh inputs from make_inputs (untimed;
    inputs that repeat are refused), the output argument (``out_index``) poisoned first (NaN, or a random
    integer) and checked with ``check(*args)`` right after (True, None or no AssertionError means right).
    Each run is timed between CUDA events around a device-wide synchronisation (``_CudaClock``), so work
    left on another stream counts. A wrong result on any run scores 0; so does a notebook that replaced
    the CUDA timing functions. Otherwise r = median candidate time / median reference time scores as
    ``performance_score``.

    gpus: the GPUs the test needs; with fewer, the test is "not gradable here (needs more GPUs)" (``gpus_missing``).

    Prints one line that starts with "performance:". In CPU mode nothing is timed: the line says the points
    cannot be graded here and 0 is returned. Use it as the last expression of a ``perf_`` test cell whose
    points equal ``max_points``: nbgrader takes the cell's value as its score.
    """
    if repeats < 1 or warmup < 0 or max_points < 0:
        raise runtime.CourseInputError("repeats must be at least 1, warmup and max_points at least 0")
    if not runtime.is_gpu():
        print(CPU_PERF_MESSAGE.format(points=_num(max_points)))
        return 0.0
    if gpus_missing(gpus, max_points):
        return 0.0

    name = getattr(candidate, "__name__", "your code")
    ref_name = getattr(reference, "__module__", "") + "." + getattr(reference, "__name__", "reference")
    try:
        clock = _CudaClock(runtime.cupy())
        times = _measure(candidate, reference, make_inputs=make_inputs, check=check, clock=clock, repeats=repeats,
                         warmup=warmup, out_index=out_index, names=(name, f"the reference {ref_name}"))
    except _Tampered as exc:
        print(f"performance: {exc}; 0 of {_num(max_points)} points")
        return 0.0
    except _WrongOutput as exc:
        if str(exc).startswith("the reference"):
            raise runtime.CourseError(f"{exc}: the test's inputs or check are wrong, not your code") from None
        print(f"performance: {exc}; 0 of {_num(max_points)} points")
        return 0.0
    from . import bench

    import statistics

    t_cand, t_ref = statistics.median(times["candidate"]), statistics.median(times["reference"])
    ratio = t_cand / t_ref
    points = performance_score(ratio, max_points)
    runs = (f"timed once: over {_num(2 * ZERO_AT)}x slower, not repeated" if times["hopeless"]
            else f"medians of {repeats} runs each, alternating")
    print(f"performance: {name} {bench.format_ms(t_cand)} vs reference {bench.format_ms(t_ref)} ({runs}): "
          f"ratio {ratio:.2f} -> {_num(points)} of {_num(max_points)} points "
          f"(all at <= {FULL_AT}, none at >= {_num(ZERO_AT)})")
    return float(points)


# -------------------------------------------------------------------------------------- exercises

def _assignment_dirs(root: Path = SOLUTIONS) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and ASSIGNMENT_PATTERN.match(p.name)) \
        if root.is_dir() else []


_IGNORED = {".ipynb_checkpoints", "__pycache__", ".DS_Store"}


def _assignment_files(folder: Path) -> list[Path]:
    """Files of an assignment folder other than notebooks (data, helper modules), without editor litter."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix != ".ipynb"
                  and not _IGNORED & set(p.relative_to(folder).parts) and p.suffix != ".pyc")


def _resolve_assignments(assignments: Sequence[str] | None) -> list[str]:
    known = [p.name for p in _assignment_dirs()]
    if assignments is None:
        return known
    unknown = [a for a in assignments if a not in known]
    if unknown:
        raise runtime.CourseInputError(f"no solutions/{unknown[0]}/; known: {', '.join(known) or 'none'}")
    return list(assignments)


def _generate(assignments: list[str], root: Path) -> Path:
    """nbgrader generate_assignment for each assignment, source copied under root; returns the release dir."""
    for a in assignments:
        shutil.copytree(SOLUTIONS / a, root / "source" / a, ignore=shutil.ignore_patterns(*_IGNORED, "*.pyc"))
    _nbgrader(root, [["generate_assignment", a] for a in assignments], _course_config(root), _generation_env())
    return root / "release"


def generate_exercises(assignments: Sequence[str] | None = None) -> list[Path]:
    """Regenerate exercises/NN_*/ from solutions/NN_*/ (all of them by default); returns the folders written."""
    names = _resolve_assignments(assignments)
    written = []
    with tempfile.TemporaryDirectory(prefix="gpucourse-exercises-") as tmp:
        release = _generate(names, Path(tmp))
        for a in names:
            dest = EXERCISES / a
            if dest.exists():
                shutil.rmtree(dest)
            shutil.copytree(release / a, dest)
            written.append(dest)
    return written


def check_exercises(assignments: Sequence[str] | None = None) -> list[str]:
    """Differences between the committed exercises/ and what generate_exercises would write now (empty when
    in step). Notebooks are compared as JSON; nbgrader's output is deterministic (its checksums are hashes
    of the cell sources), so nothing needs normalising beyond the JSON formatting."""
    names = _resolve_assignments(assignments)
    diffs = []
    with tempfile.TemporaryDirectory(prefix="gpucourse-exercises-") as tmp:
        release = _generate(names, Path(tmp))
        for a in names:
            want_dir, have_dir = release / a, EXERCISES / a
            want = {p.relative_to(want_dir) for p in want_dir.rglob("*") if p.is_file()}
            have = ({p.relative_to(have_dir) for p in have_dir.rglob("*")
                     if p.is_file() and not _IGNORED & set(p.relative_to(have_dir).parts)}
                    if have_dir.is_dir() else set())
            for rel in sorted(want - have):
                diffs.append(f"exercises/{a}/{rel}: missing (run: python -m gpucourse exercises)")
            for rel in sorted(have - want):
                diffs.append(f"exercises/{a}/{rel}: not generated from solutions/{a}/ (stale?)")
            for rel in sorted(want & have):
                diff = _file_difference(want_dir / rel, have_dir / rel)
                if diff:
                    diffs.append(f"exercises/{a}/{rel}: {diff}")
        if assignments is None:
            for extra in sorted(p.name for p in _assignment_dirs(EXERCISES) if p.name not in names):
                diffs.append(f"exercises/{extra}/: has no solutions/{extra}/")
    return diffs


def _file_difference(want: Path, have: Path) -> str:
    if want.suffix != ".ipynb":
        return "" if want.read_bytes() == have.read_bytes() else "differs from what generation writes"
    try:
        a = json.loads(want.read_text(encoding="utf-8"))
        b = json.loads(have.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        return f"not valid JSON ({exc})"
    if a == b:
        return ""
    ca, cb = a.get("cells", []), b.get("cells", [])
    if len(ca) != len(cb):
        return f"{len(cb)} cells, generation gives {len(ca)} (edited by hand, or solutions changed?)"
    for i, (x, y) in enumerate(zip(ca, cb, strict=True)):
        if x != y:
            gid = x.get("metadata", {}).get("nbgrader", {}).get("grade_id") or x.get("id", "")
            return f"cell {i} ({gid}) differs from what generation gives (edited by hand, or solutions changed?)"
    return "notebook metadata differs from what generation gives"


# ------------------------------------------------- exercise generation: nbgrader in a child Python

def _nbgrader(root: Path, steps: list[list[str]], config: dict, env: dict) -> str:
    """Run nbgrader steps through its Python API (NbGraderAPI) in a child Python; returns nbgrader's log.

    One child for all the steps: importing nbgrader takes seconds. The child's environment is the kernel's.
    """
    spec = root / ".nbgrader-steps.json"
    spec.write_text(json.dumps({"steps": steps, "config": config}))
    code = "import sys, gpucourse.grading as g; g._run_steps(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, str(spec)], check=False, cwd=root, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True)
    result = root / ".nbgrader-result.json"
    if proc.returncode != 0 or not result.is_file():
        raise GradingError(f"nbgrader could not be run (exit {proc.returncode}):\n{_tail(proc.stdout + proc.stderr)}",
                           proc.stdout + proc.stderr)
    results = json.loads(result.read_text())
    log = "\n".join(r.get("log", "") for r in results)
    for (step, *_), r in zip(steps, results, strict=False):
        if not r["success"]:
            raise _step_failed(step, r.get("log", "") + "\n" + r.get("error", ""))
    return log


def _step_failed(step: str, log: str) -> GradingError:
    """A short account of why nbgrader gave up; the whole log stays on the exception."""
    errors = [line.strip() for line in _text(log).splitlines() if re.match(r"\s*[\w.]+(Error|Exception): ", line)]
    why = next((e for e in reversed(errors) if "see the the above traceback" not in e), "see the log")
    return GradingError(f"nbgrader {step} failed: {why}", log)


def _run_steps(spec_path: str) -> None:
    """The child side of ``_nbgrader``: run the steps, write their results next to the spec."""
    from nbgrader.apps.api import NbGraderAPI
    from traitlets.config import Config

    spec = json.loads(Path(spec_path).read_text())
    api = NbGraderAPI(config=Config(spec["config"]))
    results = []
    for step, *args in spec["steps"]:
        if step == "generate_assignment":
            r = api.generate_assignment(args[0], force=True, create=True)
        elif step == "autograde":
            r = api.autograde(args[0], args[1], force=True, create=True)
        else:
            raise ValueError(f"unknown nbgrader step {step!r}")
        results.append(r)
        if not r["success"]:
            break
    Path(spec_path).with_name(".nbgrader-result.json").write_text(json.dumps(results))

def _generation_env() -> dict:
    """The environment of the child Python that generates exercises (it runs no learner code)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = _prepend([str(REPO)], env.get("PYTHONPATH", ""))
    env["PATH"] = _prepend([sysconfig.get_path("scripts"), os.path.dirname(sys.executable)], env.get("PATH", ""))
    return env


# ------------------------------------------------------------------------------------------- CLI

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

"""Grading learner notebooks with nbgrader, and keeping the released exercises in step with the solutions.

Layout
    solutions/NN_name/<nb>.ipynb   nbgrader *source* notebooks: solutions between ``### BEGIN SOLUTION`` and
                                   ``### END SOLUTION``, hidden tests between ``### BEGIN HIDDEN TESTS`` and
                                   ``### END HIDDEN TESTS``, test cells marked as graded with their points.
    exercises/NN_name/<nb>.ipynb   the release nbgrader generates from them (``generate_exercises``); never
                                   edited by hand, and ``check_exercises`` proves it matches the solutions.

Grading one notebook
    ``grade(path)`` runs nbgrader's own autograder on one learner notebook: it builds a throwaway course
    directory (source = the matching solution notebook, chosen by the learner notebook's folder and file
    name), lets nbgrader's generate_assignment create the gradebook, puts the learner's notebook under
    submitted/, runs nbgrader's autograde (which puts back the hidden tests and every locked cell from the
    source before executing) and reads the per-test scores back from the gradebook and the feedback from
    the autograded notebook. nbgrader runs through its Python API (NbGraderAPI) in a child Python whose
    environment the notebook kernel inherits: the course mode (GPUCOURSE_MODE, NUMBA_ENABLE_CUDASIM) and a
    PYTHONPATH that starts with the repository root. No nbgrader_config.py is read for this.

Test-cell conventions
    * A test cell's grade_id starts with ``test_``; a *performance* test's grade_id starts with ``perf_``
      (``PERF_PREFIX``). Performance tests are graded on a GPU only: in CPU mode they give 0 points, the
      report marks them "not gradable here (needs a GPU)" and states the score both out of the total and
      out of the total that can be graded in this mode.
    * A test cell earns its full points when it runs without an error, partial points when its value (the
      last expression) is a number between 0 and its points, and none on an error or a timeout.

nbgrader 0.9 facts this module relies on (see nbgrader.utils.determine_grade)
    * Partial credit: the *first* ``execute_result`` of a graded code cell is read with ``float()``; that is
      the score (a value above the cell's points makes autograde fail; a negative one or one that does not
      parse as a float gives FULL marks). NumPy 2 scalars display as ``np.float64(0.5)``, which does not
      parse, so a test cell must end with a plain Python float: ``performance_points`` returns one.
    * Any output on stderr in a graded cell scores 0, so Python warnings would cost a test its points;
      the grader strips stderr output that is only warnings (IgnorePattern, ``WARNING_PATTERN``).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import runtime

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = REPO / "solutions"
EXERCISES = REPO / "exercises"
ASSIGNMENT_PATTERN = re.compile(r"^\d\d_\w+$")

COURSE_ID = "gpu-programming-for-deep-learning"
STUDENT = "learner"
DEFAULT_TIMEOUT = 120  # seconds per cell

PERF_PREFIX = "perf_"
NOT_GRADABLE = "not gradable here (needs a GPU)"
CPU_PERF_MESSAGE = "performance: not gradable in CPU mode (needs a GPU); 0 of {points} points given here"

# A cell's stderr output that holds a Python warning ("file.py:12: SomeWarning: text") is removed before
# scoring: a NumbaPerformanceWarning about a small grid must not cost a test its points.
WARNING_PATTERN = r"(?m)^\S.*:\d+: \w*Warning: "

# Performance scoring: full marks up to this ratio (learner time / reference time), none from ZERO_AT.
FULL_AT = 1.2
ZERO_AT = 10.0

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class GradingError(runtime.CourseError):
    """The notebook could not be graded at all (not a failed test: nbgrader itself gave up).
    ``log`` holds nbgrader's log and traceback."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


# ------------------------------------------------------------------------------------------ reports

@dataclass
class TestResult:
    """The outcome of one graded cell."""

    __test__ = False  # not a pytest test class

    grade_id: str
    points: float
    max_points: float
    status: str  # passed | partial | failed | timed out | not gradable here (needs a GPU) | needs manual grading
    message: str

    @property
    def performance(self) -> bool:
        return self.grade_id.startswith(PERF_PREFIX)

    @property
    def gradable(self) -> bool:
        return self.status != NOT_GRADABLE


@dataclass
class GradeReport:
    notebook: str
    assignment: str
    mode: str | None  # "gpu" or "cpu": the mode the notebook ran in (None if it never said)
    tests: list[TestResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what nbgrader warned about (edited test cells, ...)

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
            total += (f"  ({_num(self.score)} / {_num(self.gradable_max_score)} gradable here; "
                      f"{_num(held)} performance point{'s' if held != 1 else ''} need a GPU and were not given)")
        lines.append(total)
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _num(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))


# ------------------------------------------------------------------------------------------ grading

def grade(notebook_path, *, timeout: int = DEFAULT_TIMEOUT, mode: str | None = None, source=None,
          workdir=None) -> GradeReport:
    """Grade one learner notebook with nbgrader's autograder; see the module docstring.

    timeout: seconds each cell may run before it is interrupted (its test then scores 0).
    mode: "cpu" or "gpu" for the notebook's kernel; default: GPUCOURSE_MODE, else CPU if this process runs
        the CUDA simulator, else whatever the kernel finds (GPU when one is usable).
    source: the nbgrader source notebook; default solutions/<learner's folder>/<learner's file name>.
    workdir: build the course directory there and keep it (for looking at nbgrader's files); default a
        temporary directory, removed afterwards.
    """
    learner = Path(notebook_path).resolve()
    if not learner.is_file():
        raise runtime.CourseInputError(f"no notebook at {notebook_path}")
    if source is None:
        source = SOLUTIONS / learner.parent.name / learner.name
        if not source.is_file():
            known = ", ".join(sorted(p.name for p in _assignment_dirs())) or "none"
            raise runtime.CourseInputError(
                f"{learner.name} in folder {learner.parent.name!r} matches no solution notebook "
                f"(looked for {source.relative_to(REPO)}); the folder must be named after a lesson: {known}")
    source = Path(source).resolve()
    assignment, name = source.parent.name, source.stem
    if learner.name != source.name:
        raise runtime.CourseInputError(f"the learner notebook must be named {source.name}, not {learner.name}")
    try:
        submitted = json.loads(learner.read_text(encoding="utf-8"))
        cells = submitted["cells"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise runtime.CourseInputError(f"{notebook_path} is not a notebook ({exc})") from None
    if not any(isinstance(c, dict) and c.get("metadata", {}).get("nbgrader") for c in cells):
        raise runtime.CourseInputError(
            f"{notebook_path} has none of the exercise's cells: work in a copy of "
            f"exercises/{assignment}/{source.name}, which carries what the grader needs")
    submitted, restored = _restore_locked_cells(submitted, json.loads(source.read_text(encoding="utf-8")))

    kernel_mode = _kernel_mode(mode)
    with _course_dir(workdir) as root:
        src_dir = root / "source" / assignment
        src_dir.mkdir(parents=True)
        shutil.copy2(source, src_dir / source.name)
        for extra in _assignment_files(source.parent):
            dest = src_dir / extra.relative_to(source.parent)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(extra, dest)
        sub_dir = root / "submitted" / STUDENT / assignment
        sub_dir.mkdir(parents=True)
        (sub_dir / source.name).write_text(json.dumps(submitted, indent=1), encoding="utf-8")

        config = _course_config(root)
        config["Execute"] = {"timeout": int(timeout)}
        config["IgnorePattern"] = {"enabled": True, "pattern": WARNING_PATTERN}
        log = _nbgrader(root, [["generate_assignment", assignment], ["autograde", assignment, STUDENT]],
                        config, _kernel_env(kernel_mode))
        graded = root / "autograded" / STUDENT / assignment / source.name
        if not graded.is_file():
            raise GradingError(f"nbgrader did not grade {learner.name}:\n{_tail(log)}", log)
        report = _report(learner, assignment, name, graded, root, kernel_mode, timeout, log)
        report.notes += [f"cell {g} had been deleted; it was put back and run" for g in restored]
        return report


def _restore_locked_cells(nb: dict, source: dict) -> tuple[dict, list[str]]:
    """Put back the locked cells (tests, read-only cells) the learner deleted, each after the cell that
    precedes it in the source. nbgrader would put back only test cells (OverwriteCells.add_missing_cells),
    and in 0.9.6 that fails with a KeyError when the cell before the deleted one is missing as well or is not
    a test or solution cell. Solution cells are never put back. Returns the notebook and the grade_ids."""
    def gid(cell):
        return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")

    cells = list(nb["cells"])
    have = {gid(c) for c in cells} - {None}
    ids = {c.get("id") for c in cells}
    restored, previous = [], None
    for cell in source["cells"]:
        g = gid(cell)
        if g is None:
            continue
        if g not in have and cell["metadata"]["nbgrader"].get("locked"):
            cell = json.loads(json.dumps(cell))
            if cell.get("cell_type") == "code":
                cell["outputs"], cell["execution_count"] = [], None
            if "id" in cell and cell["id"] in ids:
                cell["id"] = f"restored-{g}"[:64].replace("_", "-")
            at = next((i + 1 for i, c in enumerate(cells) if previous is not None and gid(c) == previous), 0)
            cells.insert(at, cell)
            have.add(g)
            restored.append(g)
        if g in have:
            previous = g
    return {**nb, "cells": cells}, restored


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


def _kernel_mode(mode: str | None) -> str | None:
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
    return None  # the kernel decides, as a learner's would


def _kernel_env(mode: str | None) -> dict:
    """The environment of the nbgrader apps and so of the notebook kernel they start."""
    env = dict(os.environ)
    env["PYTHONPATH"] = _prepend([str(REPO)], env.get("PYTHONPATH", ""))
    # nbgrader runs the `alembic` script when it creates a gradebook: find this Python's scripts even when
    # its environment is not activated.
    env["PATH"] = _prepend([sysconfig.get_path("scripts"), os.path.dirname(sys.executable)], env.get("PATH", ""))
    if mode is not None:
        env[runtime.MODE_VARIABLE] = mode
        env["NUMBA_ENABLE_CUDASIM"] = "1" if mode == "cpu" else "0"
    return env


def _prepend(first: list[str], rest: str) -> str:
    return os.pathsep.join(dict.fromkeys([*first, *(p for p in rest.split(os.pathsep) if p)]))


def _course_config(root: Path) -> dict:
    """The nbgrader configuration of a course directory at root (nothing is read from nbgrader_config.py)."""
    return {"CourseDirectory": {
        "root": str(root),
        "course_id": COURSE_ID,
        "source_directory": "source",
        "release_directory": "release",
        "submitted_directory": "submitted",
        "autograded_directory": "autograded",
        "db_url": f"sqlite:///{root / 'gradebook.db'}",
    }}


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
    if "DeadKernelError" in log:
        return GradingError("the notebook's kernel died while it ran (a crash, running out of memory, or "
                            "exit() in a cell), and nbgrader grades nothing then. Restart the kernel and run all "
                            "cells to find the one that kills it.", log)
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


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _report(learner: Path, assignment: str, name: str, graded: Path, root: Path, mode: str | None,
            timeout: int, log: str) -> GradeReport:
    from nbgrader.api import Gradebook

    cells = json.loads(graded.read_text(encoding="utf-8"))["cells"]
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}", course_id=COURSE_ID) as gb:
        sub = gb.find_submission_notebook(name, assignment, STUDENT)
        grades = {g.name: (float(g.score), float(g.max_score), bool(g.needs_manual_grade)) for g in sub.grades}

    mode = _mode_shown(cells) or mode
    tests = []
    for cell in cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        grade_id = meta.get("grade_id")
        if not meta.get("grade") or grade_id not in grades:
            continue
        score, max_score, manual = grades.pop(grade_id)
        tests.append(_test_result(grade_id, cell, score, max_score, manual, mode, timeout))
    for grade_id, (score, max_score, manual) in grades.items():  # graded in the gradebook but not in the notebook
        tests.append(TestResult(grade_id, score, max_score, "failed", "the cell is missing from the notebook"))
    originals = [root / step / assignment / graded.name for step in ("source", "release")]
    notes = _edited_cells(learner, originals) + _notes(log)
    return GradeReport(notebook=str(learner), assignment=assignment, mode=mode, tests=tests, notes=notes)


def _mode_shown(cells: list) -> str | None:
    """The mode the kernel reported (gpucourse.setup prints 'GPU mode: ...' or 'CPU mode: ...')."""
    for cell in cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stdout":
                m = re.search(r"^(GPU|CPU) mode:", _text(out.get("text")), re.MULTILINE)
                if m:
                    return m.group(1).lower()
    return None


def _test_result(grade_id: str, cell: dict, score: float, max_score: float, manual: bool, mode: str | None,
                 timeout: int) -> TestResult:
    outputs = cell.get("outputs", [])
    errors = [o for o in outputs if o.get("output_type") == "error"]
    stderr = [_text(o.get("text")) for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stderr"]
    stdout = _text([_text(o.get("text")) for o in outputs
                    if o.get("output_type") == "stream" and o.get("name") == "stdout"])
    said = [line for line in stdout.splitlines() if line.startswith("performance:")]

    if grade_id.startswith(PERF_PREFIX) and (mode == "cpu" or any("not gradable" in s for s in said)):
        return TestResult(grade_id, score, max_score, NOT_GRADABLE,
                          said[-1] if said else CPU_PERF_MESSAGE.format(points=_num(max_score)))
    if manual:
        return TestResult(grade_id, score, max_score, "needs manual grading", "")
    if errors:
        if any(e.get("ename") == "CellTimeoutError" for e in errors):
            return TestResult(grade_id, score, max_score, "timed out",
                              f"no result within {timeout} s; the cell was interrupted")
        e = errors[0]
        message = e.get("ename", "Error") + (f": {_first_lines(e.get('evalue', ''))}" if e.get("evalue") else "")
        return TestResult(grade_id, score, max_score, "failed", message)
    if stderr and score == 0:
        return TestResult(grade_id, score, max_score, "failed",
                          "wrote to stderr, which nbgrader scores as a failure: " + _first_lines("".join(stderr)))
    message = said[-1] if said else ""
    if score >= max_score:
        return TestResult(grade_id, score, max_score, "passed", message or "passed")
    return TestResult(grade_id, score, max_score, "partial" if score > 0 else "failed",
                      message or f"the cell's value gave {_num(score)} of {_num(max_score)} points")


def _text(x) -> str:
    if isinstance(x, list):
        x = "".join(x)
    return _ANSI.sub("", x or "")


def _first_lines(text: str, lines: int = 3, chars: int = 400) -> str:
    text = "\n".join(_text(text).strip().splitlines()[:lines])
    return text if len(text) <= chars else text[: chars - 3] + "..."


def _locked_sources(path: Path) -> dict[str, str]:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return {c["metadata"]["nbgrader"]["grade_id"]: _text(c.get("source"))
            for c in cells if c.get("metadata", {}).get("nbgrader", {}).get("locked")}


def _edited_cells(learner: Path, originals: list[Path]) -> list[str]:
    """Locked cells (tests, read-only cells) the learner changed. nbgrader runs them as the solution has them
    and logs a changed checksum for every test cell that had hidden tests, edited or not, so the learner's
    cells are compared with both the solution and the released exercise instead."""
    known = [_locked_sources(p) for p in originals]
    notes = []
    for cell in json.loads(learner.read_text(encoding="utf-8"))["cells"]:
        grade_id = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        if grade_id in known[0] and all(_text(cell.get("source")) != k.get(grade_id) for k in known):
            notes.append(f"cell {grade_id} had been edited; it was run as written in the solution")
    return notes


def _notes(log: str) -> list[str]:
    """What else nbgrader repaired before grading, from its log."""
    notes = []
    for line in _text(log).splitlines():
        m = re.search(r"Attribute '(\w+)' for cell (\S+) has changed", line)
        if m and m.group(1) != "checksum":  # edits: see _edited_cells
            notes.append(f"the {m.group(1)} of cell {m.group(2)} had been changed; the solution's was used")
    return list(dict.fromkeys(notes))


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


def performance_points(candidate: Callable, reference: Callable, *, make_inputs: Callable, check: Callable,
                       max_points: float, repeats: int = 20, warmup: int = 3, out_index: int = -1) -> float:
    """Time ``candidate`` against ``reference`` on a GPU and return the points earned, as a Python float.

    Both are called as f(*make_inputs()) and timed in this one run with ``bench.time_gpu``: fresh inputs
    for every run (make_inputs, untimed), the output argument (``out_index``) filled with NaN before each
    run and checked with ``check(*args)`` after it (True, or no AssertionError, means right). A wrong result
    scores 0. Otherwise r = t_candidate / t_reference (medians) scores as ``performance_score``.

    Prints one line that starts with "performance:". In CPU mode nothing is timed: the line says the points
    cannot be graded here and 0 is returned. Use it as the last expression of a ``perf_`` test cell whose
    points equal ``max_points``: nbgrader takes the cell's value as its score.
    """
    if repeats < 1 or max_points < 0:
        raise runtime.CourseInputError("repeats must be at least 1 and max_points at least 0")
    if not runtime.is_gpu():
        print(CPU_PERF_MESSAGE.format(points=_num(max_points)))
        return 0.0

    from . import bench

    cp = runtime.cupy()
    name = getattr(candidate, "__name__", "your code")
    ref_name = getattr(reference, "__module__", "") + "." + getattr(reference, "__name__", "reference")

    def timed(fn, who: str, *, warm: int, reps: int):
        last: list = []

        def check_last():
            if last:
                args = last.pop()
                try:
                    ok = check(*args)
                    why = "" if ok or ok is None else "the check failed"
                except AssertionError as exc:
                    why = str(exc) or "the check failed"
                if why:
                    raise _WrongOutput(f"{who} gave a wrong result ({_first_lines(why, 1, 200)})")

        def setup():
            check_last()
            args = make_inputs()
            args = args if isinstance(args, tuple) else (args,)
            out = cp.asarray(args[out_index])
            out.fill(cp.nan if out.dtype.kind in "fc" else -1)
            last.append(args)
            return args

        timing = bench.time_gpu(fn, setup=setup, warmup=warm, repeats=reps)
        check_last()
        return timing

    try:
        ref = timed(reference, f"the reference {ref_name}", warm=warmup, reps=repeats)
    except _WrongOutput as exc:
        raise runtime.CourseError(f"{exc}: the test's inputs or check are wrong, not your code") from None
    try:
        probe = timed(candidate, name, warm=1, reps=1)
        hopeless = probe.median_ms > 2 * ZERO_AT * ref.median_ms  # skip the repeats; no points either way
        cand = probe if hopeless else timed(candidate, name, warm=warmup, reps=repeats)
        ref2 = ref if hopeless else timed(reference, f"the reference {ref_name}", warm=1, reps=repeats)
    except _WrongOutput as exc:
        print(f"performance: {exc}; 0 of {_num(max_points)} points")
        return 0.0
    t_ref = (ref.median_ms + ref2.median_ms) / 2
    ratio = cand.median_ms / t_ref
    points = performance_score(ratio, max_points)
    runs = (f"timed once: over {_num(2 * ZERO_AT)}x slower, not repeated" if hopeless
            else f"medians of {repeats} runs each")
    print(f"performance: {name} {bench.format_ms(cand.median_ms)} vs reference {bench.format_ms(t_ref)} ({runs}): "
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
    _nbgrader(root, [["generate_assignment", a] for a in assignments], _course_config(root), _kernel_env(None))
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


# ------------------------------------------------------------------------------------------- CLI

def grade_cli(path, *, mode: str | None = None, timeout: int | None = None, as_json: bool = False) -> int:
    """`python -m gpucourse grade NB`: print the report; 0 when graded (whatever the score), 2 when not."""
    try:
        report = grade(path, mode=mode, timeout=timeout or DEFAULT_TIMEOUT)
    except runtime.CourseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=1) if as_json else report.format())
    return 0


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

"""What grading returns: one test's result, one notebook's report, a class's report; and how they print.
"""
from __future__ import annotations

from .text import number  # noqa: F401 (used here and by the rooms that import it from here)

from dataclasses import asdict, dataclass, field
from pathlib import Path

from .settings import NOT_GRADABLE_ARCH, NOT_GRADABLE_GPUS, NOT_GRADABLE_SOFTWARE, NOT_GRADABLE_STATUSES, PERF_PREFIX


@dataclass
class TestResult:
    """The outcome of one graded cell."""

    __test__ = False  # not a pytest test class

    grade_id: str
    points: float
    max_points: float
    # passed | partial | failed | timed out | kernel died | not run | not gradable here (needs a GPU)
    # | not gradable here (needs more GPUs) | not gradable here (needs a newer GPU)
    # | not gradable here (needs software this machine lacks) | needs manual grading
    status: str
    message: str

    @property
    def performance(self) -> bool:
        return self.grade_id.startswith(PERF_PREFIX)

    @property
    def gradable(self) -> bool:
        return self.status not in NOT_GRADABLE_STATUSES


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
        line = f"{number(self.score)} / {number(self.max_score)}"
        if self.not_gradable:
            line += f"  ({number(self.score)} / {number(self.gradable_max_score)} gradable here)"
        return line

    def test_lines(self) -> list[str]:
        """One line per test: its grade_id, points, and pass or FAIL with the failing assertion's message."""
        width = max([len(t.grade_id) for t in self.tests] + [4])
        return [test_line(t, width) for t in self.tests]

    @property
    def failed(self) -> list[TestResult]:
        """The tests that did not pass (not counting those this machine cannot grade, or that a person grades)."""
        return [t for t in self.tests if t.gradable and t.status not in ("passed", "needs manual grading")]

    def tally(self) -> str:
        """"5 of 7 tests pass": of the tests this machine grades by itself."""
        counted = [t for t in self.tests if t.gradable and t.status != "needs manual grading"]
        return f"{len(counted) - len(self.failed)} of {len(counted)} tests pass"

    def checklist(self, hint: str = "") -> str:
        """What ``python -m gpucourse run`` prints for a notebook with tests: each test by name, pass or FAIL,
        with the failing assertion's message; the notes; then ``hint``."""
        mode = {"gpu": "GPU mode", "cpu": "CPU mode"}.get(self.mode or "", "mode unknown")
        lines = [f"{self.notebook}: {self.tally()} ({mode})", *self.test_lines()]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines + ([hint] if hint else []))

    def format(self) -> str:
        mode = {"gpu": "GPU mode", "cpu": "CPU mode"}.get(self.mode or "", "mode unknown")
        lines = [f"{self.notebook}", f"assignment {self.assignment}, graded in {mode}", ""]
        lines += self.test_lines()
        lines.append("")
        total = f"Score: {number(self.score)} / {number(self.max_score)}"
        skipped = self.not_gradable
        if skipped:
            held = sum(t.max_points for t in skipped)
            kinds = {t.status for t in skipped}
            need = ("more GPUs" if kinds == {NOT_GRADABLE_GPUS} else "a newer GPU" if kinds == {NOT_GRADABLE_ARCH}
                    else "software this machine lacks" if kinds == {NOT_GRADABLE_SOFTWARE} else "a GPU")
            what = "performance point" if all(t.performance for t in skipped) else "point"
            total += (f"  ({number(self.score)} / {number(self.gradable_max_score)} gradable here; "
                      f"{number(held)} {what}{'s' if held != 1 else ''} need {need} and were not given)")
        lines.append(total)
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def test_line(t: TestResult, width: int = 0) -> str:
    """One test of a report: "  grade_id   points / max  pass" or "... FAIL  <the assertion's message>"."""
    got = "-" if not t.gradable else number(t.points)
    message = " ".join(t.message.split())  # one line, whatever the error's message spans
    if t.status == "passed":
        detail = "pass" + (f"  {message}" if message not in ("", "passed") else "")
    elif t.status == "failed":
        detail = "FAIL" + (f"  {message}" if message else "")
    elif t.status in ("timed out", "kernel died", "not run"):
        detail = f"FAIL  {t.status}" + (f": {message}" if message and message != t.status else "")
    else:  # partial, not gradable here, needs manual grading
        detail = t.status if message in ("", t.status) else f"{t.status}: {message}"
    return f"  {t.grade_id:<{width}}  {got:>5} / {number(t.max_points):<3}  {detail}"


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



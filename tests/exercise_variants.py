"""Building learner submissions from a lesson's solution notebook, and grading a set of them: what every
lesson's exercise tests share (tests/test_grading.py for lesson 1, tests/test_NN_exercises.py for the rest)."""
from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

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


def _outcome(future):
    """A grading's GradeReport, or the exception it raised."""
    return future.result() if future.exception() is None else future.exception()


def grade_all(jobs: dict, *, timeout: int, workers: int = 2) -> dict:
    """{name: GradeReport, or the exception grading raised} for {name: notebook path}, graded in CPU mode,
    ``workers`` at a time."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {name: pool.submit(grading.grade, path, timeout=timeout, mode="cpu") for name, path in jobs.items()}
        return {name: _outcome(f) for name, f in futures.items()}


def graded_variants(tmp: Path, solution: Path, exercise: Path, variants, *, timeout: int) -> dict:
    """The solution, the released exercise and every variant (functions that edit the solution), graded."""
    jobs = {"solution": learner_copy(tmp, solution), "exercise": exercise}
    jobs.update({v.__name__: learner_copy(tmp, solution, v) for v in variants})
    return grade_all(jobs, timeout=timeout)


def graded_as_a_class(tmp: Path, solution: Path, exercise: Path, variants, *, timeout: int) -> dict:
    """What ``graded_variants`` gives, for less: the solution graded alone by ``grading.grade`` (the learner's
    command), the released exercise and every variant handed in as one class to ``grading.grade_class`` (the same
    preparation, worker and guarded kernel, per notebook), which builds the course and its gradebook once for them
    all instead of once a notebook. A notebook the class run could not grade is a GradingError, as from ``grade``."""
    lesson, name = solution.parent.name, solution.name
    alone = learner_copy(tmp, solution)
    folder = tmp / "class"
    for v in variants:
        learner_copy(folder, solution, v)
    handed_in = folder / "exercise" / lesson / name
    handed_in.parent.mkdir(parents=True)
    handed_in.write_bytes(exercise.read_bytes())
    with ThreadPoolExecutor(max_workers=1) as pool:  # alongside the class's two workers, as a third
        single = pool.submit(grading.grade, alone, timeout=timeout, mode="cpu")
        report = grading.grade_class(folder, assignment=lesson, course_dir=tmp / "course", mode="cpu",
                                     timeout=timeout, workers=2, progress=False)
        graded = {"solution": _outcome(single)}
    names = ["exercise", *(v.__name__ for v in variants)]
    assert set(report.reports) | set(report.errors) == set(names), (sorted(report.reports), report.errors)
    for student in names:
        graded[student] = (report.reports[student] if student in report.reports
                           else grading.GradingError(f"{student} could not be graded: {report.errors[student]}"))
    return graded


# ------------------------------------------------------------------ what every lesson's exercise must meet

def gradable_points(points: dict, lacking=()) -> float:
    """The points CPU mode can grade here: all but the performance tests' and those of the tests in ``lacking``
    (tests of software this machine lacks, "not gradable here")."""
    return sum(p for g, p in points.items() if not g.startswith(grading.PERF_PREFIX) and g not in lacking)


def assert_lacking_not_gradable(report, lacking) -> None:
    """The tests this machine lacks the software or the GPUs for: "not gradable here (needs software this machine
    lacks)" or "(needs more GPUs)", 0 points."""
    for grade_id in lacking:
        t = report.test(grade_id)
        assert t.points == 0 and not t.gradable, report.format()
        assert t.status in (grading.NOT_GRADABLE_SOFTWARE, grading.NOT_GRADABLE_GPUS), report.format()


def assert_full_marks(report, points: dict, lacking=()) -> None:
    """The solution: every test in order with its points, every gradable point earned (CPU mode)."""
    assert report.mode == "cpu"
    assert [t.grade_id for t in report.tests] == list(points)
    assert {t.grade_id: t.max_points for t in report.tests} == points
    assert report.score == gradable_points(points, lacking) == report.gradable_max_score, report.format()
    assert report.max_score == sum(points.values())
    assert all(t.status == "passed" for t in report.tests if t.gradable), report.format()
    assert_lacking_not_gradable(report, lacking)


def assert_performance_not_gradable(report, points: dict) -> None:
    """CPU mode gives every perf_ test 0 points and says it cannot grade it."""
    for grade_id in (g for g in points if g.startswith(grading.PERF_PREFIX)):
        perf = report.test(grade_id)
        assert perf.performance and not perf.gradable and perf.points == 0, report.format()
        assert perf.status == grading.NOT_GRADABLE, report.format()


def assert_scores_zero(report, points: dict, lacking=()) -> None:
    """The released exercise, unanswered: nothing earned, every gradable test failed."""
    assert report.score == 0 and report.max_score == sum(points.values())
    assert all(t.status == "failed" for t in report.tests if t.gradable), report.format()
    assert_lacking_not_gradable(report, lacking)


def assert_loses_exactly(report, points: dict, lost, lacking=()) -> None:
    """A wrong variant: 0 points on exactly the tests in ``lost`` (a list, or {grade_id: expected status}; a
    list means "failed"), full points on every other gradable test. Tests in ``lacking`` (software this machine
    lacks) are "not gradable here" whatever the variant."""
    lost = lost if isinstance(lost, dict) else dict.fromkeys(lost, "failed")
    lost = {g: status for g, status in lost.items() if g not in lacking}
    assert_lacking_not_gradable(report, lacking)
    assert report.score == gradable_points(points, lacking) - sum(points[g] for g in lost), report.format()
    for t in report.tests:
        if t.grade_id in lost:
            assert (t.points, t.status) == (0, lost[t.grade_id]), report.format()
        elif t.gradable:
            assert (t.points, t.status) == (t.max_points, "passed"), report.format()


def fill_in_exercise(nb, solution: Path, exercise: Path) -> None:
    """Make ``nb`` the released exercise with the solution's answers filled in: what a learner who answered
    every task hands in (its test cells lack the hidden tests, which the grader must put back)."""
    answers = {c.get("id"): c.source for c in nbformat.read(solution, as_version=4).cells}
    released = nbformat.read(exercise, as_version=4)
    for cell in released.cells:
        if cell.get("metadata", {}).get("nbgrader", {}).get("solution"):
            cell.source = answers[cell.get("id")]
    nb.cells = released.cells


def assert_exercise_hides_the_answers(solution: Path, exercise: Path, answers: list) -> None:
    """No solution, no hidden test and none of ``answers`` (snippets of the solution) is released, and every
    test cell that has hidden tests keeps its visible ones."""
    released = nbformat.read(exercise, as_version=4)
    text = "".join(c.source for c in released.cells)
    assert "BEGIN SOLUTION" not in text and "HIDDEN" not in text
    for answer in answers:
        assert answer not in text, answer
    source = {c.get("id"): c.source for c in nbformat.read(solution, as_version=4).cells}
    for cell in released.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if meta.get("grade") and "BEGIN HIDDEN TESTS" in source[cell.get("id")]:
            visible = source[cell.get("id")].split("### BEGIN HIDDEN TESTS")[0]
            assert cell.source.strip() == visible.strip() and any(
                line and not line.startswith("#") for line in visible.splitlines()), cell.get("id")


# ------------------------------------------------------------------ one lesson's exercise tests, in one place

class LessonExercises:
    """The tests every lesson's exercises get through the real grader, in CPU mode: the solution earns every
    point CPU mode can grade, the performance tests are "not gradable here", the released exercise earns
    nothing, each known-wrong variant loses exactly the tests it should, the exercise is what nbgrader
    generates from the solution, and it gives no answer away. tests/test_NN_exercises.py subclasses it as
    ``class TestExercises(LessonExercises)`` and sets:

    LESSON, NOTEBOOK: the lesson's id and its notebook's file name.
    POINTS: {grade_id: points}, every graded test in notebook order.
    VARIANTS: {edit(nb): the grade_ids it fails (or {grade_id: status})}; each edit changes the solution.
    UNANSWERED: {grade_id: text its message holds in the blank exercise} ("NotImplementedError", ...).
    ANSWERS: snippets of the solution that must not be released.
    TIMEOUT: seconds per cell.
    lacking(): the grade_ids of tests this machine lacks the software for (grading.software_missing), which the
    grader reports "not gradable here"; none by default.
    MULTI_GPU: {grade_id: GPUs} of tests of results that only a machine with that many GPUs checks
    (grading.needs_gpus): on one with fewer (CPU mode: none) they are among lacking() too.

    A subclass adds its own tests (what the feedback says) with the ``graded`` fixture: {"solution",
    "exercise", variant name: GradeReport}."""

    pytestmark = pytest.mark.skipif(importlib.util.find_spec("nbgrader") is None,
                                    reason="nbgrader is not installed here (the GPU machines lack it): pip install -e .")
    LESSON = NOTEBOOK = ""
    POINTS: dict = {}
    VARIANTS: dict = {}
    UNANSWERED: dict = {}
    ANSWERS: list = []
    TIMEOUT = 60
    MULTI_GPU: dict = {}

    @classmethod
    def lacking(cls) -> set:
        return cls.gpus_lacking()

    @classmethod
    def gpus_lacking(cls) -> set:
        from gpucourse import runtime

        return {g for g, n in cls.MULTI_GPU.items() if runtime.gpu_count() < n}

    @classmethod
    def solution(cls) -> Path:
        return grading.SOLUTIONS / cls.LESSON / cls.NOTEBOOK

    @classmethod
    def exercise(cls) -> Path:
        return grading.EXERCISES / cls.LESSON / cls.NOTEBOOK

    def pytest_generate_tests(self, metafunc):
        if "variant" in metafunc.fixturenames:
            metafunc.parametrize("variant", list(self.VARIANTS), ids=lambda v: v.__name__)

    @pytest.fixture(scope="class")
    @classmethod
    def graded(cls, tmp_path_factory):
        """The solution, the generated exercise and every wrong variant, graded once (the solution by grade, the
        rest as one class, two at a time)."""
        return graded_as_a_class(tmp_path_factory.mktemp("graded"), cls.solution(), cls.exercise(), cls.VARIANTS,
                                 timeout=cls.TIMEOUT)

    def test_solution_scores_every_gradable_point(self, graded):
        assert_full_marks(graded["solution"], self.POINTS, self.lacking())
        assert graded["solution"].notes == [], graded["solution"].notes

    def test_performance_tests_are_not_gradable_in_cpu_mode(self, graded):
        assert_performance_not_gradable(graded["solution"], self.POINTS)
        for grade_id in (g for g in self.POINTS if g.startswith(grading.PERF_PREFIX)):
            assert "not gradable in CPU mode" in graded["solution"].test(grade_id).message

    def test_generated_exercise_scores_zero(self, graded):
        report = graded["exercise"]
        assert_scores_zero(report, self.POINTS, self.lacking())
        for grade_id, text in self.UNANSWERED.items():
            if grade_id not in self.lacking():
                assert text in report.test(grade_id).message, report.format()

    def test_wrong_variant_gets_exactly_its_partial_score(self, graded, variant):
        assert_loses_exactly(graded[variant.__name__], self.POINTS, self.VARIANTS[variant], self.lacking())

    def test_exercise_matches_generation(self, exercise_differences):
        lessons, differences = exercise_differences  # grading.check_exercises() of every lesson, once a session
        assert self.LESSON in lessons
        assert [d for d in differences if d.startswith(f"exercises/{self.LESSON}/")] == []

    def test_exercise_hides_the_answers(self):
        assert_exercise_hides_the_answers(self.solution(), self.exercise(), self.ANSWERS)

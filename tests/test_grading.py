"""The grader: nbgrader's real autograding of lesson notebooks, partial credit, performance points, and the
released exercises kept in step with the solutions. Runs in CPU mode (the notebooks' kernels are forced to
the simulator), so the performance test of each notebook is "not gradable here".
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest
from exercise_variants import (
    assert_full_marks,
    assert_loses_exactly,
    assert_performance_not_gradable,
    assert_scores_zero,
    fill_in_exercise,
    graded_variants,
    replace_in_cell,
)

from gpucourse import grading, runtime

pytestmark = pytest.mark.slow

LESSON = "01_vector_multiply"
SOLUTION = grading.SOLUTIONS / LESSON / "vector_multiply.ipynb"
EXERCISE = grading.EXERCISES / LESSON / "vector_multiply.ipynb"
TIMEOUT = 20  # seconds per cell: every cell of the solution takes a few seconds at most in the simulator

# Points in the solution notebook; the performance test's 3 are not gradable in CPU mode.
POINTS = {"test_1_1_kernel": 2, "test_1_1_small_grids": 1, "test_1_2_gbps": 2, "test_1_3_transfer_seconds": 1,
          "test_1_3_answers": 2, "test_1_4_occupancy": 1, "test_1_4_decision": 1, "test_1_4_fast_multiply": 1,
          "test_1_4_any_grid": 1, "perf_1_4_fast_multiply": 3}
GRADABLE = sum(p for g, p in POINTS.items() if not g.startswith(grading.PERF_PREFIX))


def skips_last_element(nb):
    """Task 1.1: the loop stops one short. Also edits a test cell to pass, and deletes another test cell and
    the read-only helpers the tests need."""
    replace_in_cell(nb, "task-1-1-kernel", "range(start, out.size, stride)", "range(start, out.size - 1, stride)")
    cell = next(c for c in nb.cells if c.get("id") == "test-1-1-kernel")
    cell.source = "# Task 1.1\npass  # all good"
    nb.cells = [c for c in nb.cells if c.get("id") not in ("test-1-1-small-grids", "test-helpers")]


def two_streams(nb):
    """Task 1.2: counts a read and a write, forgetting the second input."""
    replace_in_cell(nb, "task-1-2-gbps", "nbytes = 3 * n * itemsize", "nbytes = 2 * n * itemsize")


def never_returns(nb):
    """Task 1.2: a loop that never ends; the cell is interrupted at the timeout."""
    replace_in_cell(nb, "task-1-2-gbps", "    nbytes = 3 * n * itemsize",
             "    while ms > 0:\n        pass\n    nbytes = 3 * n * itemsize")


def float_grid(nb):
    """Task 1.4: a grid size computed with / is a float; the launch raises."""
    replace_in_cell(nb, "task-1-4-fast-multiply", "max(1, min(math.ceil(numbers / THREADS), BLOCKS_PER_SM * SMS))",
             "numbers / THREADS")


def odd_sizes_in_exercise(nb):
    """The released exercise filled in, with a kernel that drops the last element of odd sizes: the visible
    Task 1.1 tests (even sizes) pass, the hidden ones nbgrader puts back (odd sizes) fail."""
    fill_in_exercise(nb, SOLUTION, EXERCISE)
    replace_in_cell(nb, "task-1-1-kernel", "range(start, out.size, stride)", "range(start, out.size - out.size % 2, stride)")
    assert "HIDDEN" not in "".join(c.source for c in nb.cells)


def no_stride_loop(nb):
    """Task 1.4 (c): one thread per complex number, no loop, launched on a grid that covers the test arrays (2
    blocks of 256 threads for 500 numbers): fast_multiply is right, but fast_kernel on a grid with fewer threads
    than numbers leaves elements unwritten, in CPU mode too."""
    replace_in_cell(nb, "task-1-4-fast-multiply", "    while 2 * k + 1 < out.size:", "    if 2 * k + 1 < out.size:")
    replace_in_cell(nb, "task-1-4-fast-multiply", "        k += cuda.gridsize(1)", "        pass")


def blocks_of_one_warp(nb):
    """Task 1.4 (b): blocks of 32 threads, predicted by the model right: half an SM, which the decision must not
    settle for."""
    replace_in_cell(nb, "task-1-4-decision", "THREADS = 256", "THREADS = 32")
    replace_in_cell(nb, "task-1-4-decision", "PREDICTED_OCCUPANCY = 1.0", "PREDICTED_OCCUPANCY = 0.5")


def occupancy_without_block_limit(nb):
    """Task 1.4 (a): the model forgets the limit on blocks an SM holds; the decision (256 threads) still holds."""
    replace_in_cell(nb, "task-1-4-occupancy", "blocks = min(max_blocks, max_threads // threads)",
                    "blocks = max_threads // threads")


def kernel_dies(nb):
    """Task 1.2: ends the kernel's process: that cell fails, the cells after it do not run."""
    replace_in_cell(nb, "task-1-2-gbps", "    nbytes = 3 * n * itemsize", "    import os\n    os._exit(1)")


def kernel_ms_not_seconds(nb):
    """Task 1.3 (b): the kernel's 2.3 ms used as if it were seconds: copy_over_kernel a thousand times too small.
    The visible test catches it."""
    replace_in_cell(nb, "task-1-3-answers", "copy_over_kernel = pinned_s / (KERNEL_MS * 1e-3)",
                    "copy_over_kernel = pinned_s / KERNEL_MS")


def one_input_only(nb):
    """Task 1.3 (b): copies one input vector (2 GiB), not both: every time half the truth, the ratio right. The
    visible test catches it."""
    replace_in_cell(nb, "task-1-3-answers", "both_inputs = 2 * 2 * 2**30", "both_inputs = 2 * 2**30")


# variant -> (points lost by grade_id, expected status of those tests)
VARIANTS = {
    skips_last_element: {"test_1_1_kernel": "failed", "test_1_1_small_grids": "failed"},
    two_streams: {"test_1_2_gbps": "failed"},
    never_returns: {"test_1_2_gbps": "timed out"},
    float_grid: {"test_1_4_fast_multiply": "failed"},
    odd_sizes_in_exercise: {"test_1_1_kernel": "failed", "test_1_1_small_grids": "failed"},
    kernel_ms_not_seconds: {"test_1_3_answers": "failed"},
    one_input_only: {"test_1_3_answers": "failed"},
    no_stride_loop: {"test_1_4_any_grid": "failed"},
    blocks_of_one_warp: {"test_1_4_decision": "failed"},
    occupancy_without_block_limit: {"test_1_4_occupancy": "failed"},
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The solution, the generated exercise and every wrong variant, graded once (two at a time)."""
    tmp = tmp_path_factory.mktemp("graded")
    return graded_variants(tmp, SOLUTION, EXERCISE, [*VARIANTS, kernel_dies], timeout=TIMEOUT)


def test_solution_scores_every_gradable_point(graded):
    assert_full_marks(graded["solution"], POINTS)


def test_performance_test_is_not_gradable_in_cpu_mode(graded):
    assert_performance_not_gradable(graded["solution"], POINTS)
    perf = graded["solution"].test("perf_1_4_fast_multiply")
    assert perf.max_points == 3
    assert "not gradable in CPU mode" in perf.message and "0 of 3 points" in perf.message


def test_report_states_total_and_gradable_total(graded):
    text = graded["solution"].format()
    assert f"Score: {GRADABLE} / {sum(POINTS.values())}" in text
    assert f"{GRADABLE} / {GRADABLE} gradable here" in text
    assert "not gradable here (needs a GPU)" in text


def test_generated_exercise_scores_zero(graded):
    report = graded["exercise"]
    assert_scores_zero(report, POINTS)
    assert "NotImplementedError" in report.test("test_1_2_gbps").message
    assert report.notes == []  # its test cells lack the hidden tests, yet none was edited


@pytest.mark.parametrize("variant", list(VARIANTS), ids=lambda v: v.__name__)
def test_wrong_variant_gets_exactly_its_partial_score(graded, variant):
    assert_loses_exactly(graded[variant.__name__], POINTS, VARIANTS[variant])


def test_feedback_names_the_error(graded):
    assert "row 24, column 39" in graded["skips_last_element"].test("test_1_1_kernel").message
    two_streams = graded["two_streams"].test("test_1_2_gbps").message
    assert two_streams.startswith("AssertionError: achieved_gbps(2**29, 4, 2.0)")
    assert f"{TIMEOUT} s" in graded["never_returns"].test("test_1_2_gbps").message
    assert graded["float_grid"].test("test_1_4_fast_multiply").message.startswith("TypeError")
    assert "7 x 143 matrix" in graded["odd_sizes_in_exercise"].test("test_1_1_kernel").message  # a hidden test
    assert "1 x 5 matrix" in graded["odd_sizes_in_exercise"].test("test_1_1_small_grids").message  # a hidden test
    assert "1000 complex numbers, 2 block(s) x 64 thread(s)" in graded["no_stride_loop"].test("test_1_4_any_grid").message
    assert "the SMs are not full" in graded["blocks_of_one_warp"].test("test_1_4_decision").message
    assert "occupancy(32) = 1.0" in graded["occupancy_without_block_limit"].test("test_1_4_occupancy").message
    assert "pinned_s over the kernel's 2.3 ms, both in seconds" in \
        graded["kernel_ms_not_seconds"].test("test_1_3_answers").message
    assert "is not the time to copy both inputs at 10 GB/s" in graded["one_input_only"].test("test_1_3_answers").message


def test_a_kernel_that_dies_fails_its_cell_and_stops_the_rest(graded):
    report = graded["kernel_dies"]
    died = report.test("test_1_2_gbps")
    assert (died.points, died.status) == (0, "kernel died") and "(exit code 1)" in died.message, report.format()
    for g in ("test_1_3_transfer_seconds", "test_1_3_answers", "test_1_4_occupancy", "test_1_4_fast_multiply"):
        assert report.test(g).status == "not run", report.format()
    assert report.score == 3  # Task 1.1's tests ran before the kernel died


def test_edited_and_deleted_test_cells_are_restored(graded):
    report = graded["skips_last_element"]
    assert any("cell test_1_1_kernel had been edited" in n for n in report.notes), report.notes
    assert any("cell test_1_1_small_grids had been deleted" in n for n in report.notes), report.notes
    assert any("cell test_helpers had been deleted" in n for n in report.notes), report.notes


def test_deleted_locked_cells_go_back_in_source_order():
    def cell(grade_id, *, locked=True, solution=False):
        return {"cell_type": "code", "id": grade_id, "metadata": {"nbgrader": {
            "grade_id": grade_id, "locked": locked, "solution": solution}}, "source": grade_id, "outputs": []}

    source = {"cells": [cell("intro"), cell("setup"), cell("task", locked=False, solution=True), cell("test_a"),
                        cell("test_b"), cell("task_2", locked=False, solution=True), cell("test_c")]}
    learner = {"cells": [{"cell_type": "code", "id": "mine", "metadata": {}, "source": "", "outputs": []},
                         cell("test_a")]}
    nb, notes = grading.submissions.prepare_submission(learner, source)
    ids = [c["id"] for c in nb["cells"]]
    assert [i for i in ids if i in ("intro", "setup", "test_a", "test_b", "test_c")] == \
        ["intro", "setup", "test_a", "test_b", "test_c"]  # every locked cell back, in the source's order
    assert len(ids) == 8 and notes  # the learner's own cell kept
    answers = [c for c in nb["cells"] if c["id"] in ("task", "task_2")]
    assert answers and all("NotImplementedError" in "".join(c["source"]) for c in answers)  # never the solutions


def test_exercises_match_generation(exercise_differences):
    assert exercise_differences[1] == []  # grading.check_exercises(), every lesson, once a session (conftest.py)


def test_check_exercises_notices_a_hand_edit(tmp_path, monkeypatch):
    copy = tmp_path / "exercises"
    shutil.copytree(grading.EXERCISES, copy)
    nb_path = copy / LESSON / EXERCISE.name
    nb = json.loads(nb_path.read_text())
    nb["cells"][0]["source"] = ["edited by hand"]
    nb_path.write_text(json.dumps(nb))
    monkeypatch.setattr(grading.exercises, "EXERCISES", copy)
    diffs = grading.check_exercises()
    assert len(diffs) == 1 and "cell 0" in diffs[0]


# ------------------------------------------------------------------ nbgrader's partial credit, pinned down

def _partial_credit_notebook(path: Path) -> None:
    def test(grade_id, points, source):
        cell = nbformat.v4.new_code_cell(source, id=grade_id.replace("_", "-"))
        cell.metadata = {"nbgrader": {"grade": True, "grade_id": grade_id, "locked": True, "points": points,
                                      "schema_version": 3, "solution": False, "task": False}}
        return cell

    nb = nbformat.v4.new_notebook(cells=[
        test("test_number", 3, "1.5"),
        test("test_numpy_scalar", 2, "import numpy as np\nnp.float64(0.5)"),
        test("test_warning", 1, "import warnings\nwarnings.warn('only a warning')"),
        test("test_stderr", 1, "import sys\nprint('a line on stderr', file=sys.stderr)"),
        test("perf_in_cpu_mode", 2, "from gpucourse import grading\n"
                                    "grading.performance_points(None, None, make_inputs=None, check=None,"
                                    " max_points=2)"),
    ])
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    path.parent.mkdir(parents=True)
    nbformat.write(nb, path)


def test_nbgrader_partial_credit_rules(tmp_path):
    source = tmp_path / "source" / "99_partial" / "partial.ipynb"
    learner = tmp_path / "learner" / "99_partial" / "partial.ipynb"
    _partial_credit_notebook(source)
    _partial_credit_notebook(learner)
    report = grading.grade(learner, source=source, mode="cpu", timeout=TIMEOUT)
    got = {t.grade_id: (t.points, t.status) for t in report.tests}
    assert got["test_number"] == (1.5, "partial")  # a number as the cell's value is its score
    # A NumPy 2 scalar displays as "np.float64(0.5)", which nbgrader cannot read: it gives full marks.
    # That is why performance_points returns a Python float.
    assert got["test_numpy_scalar"] == (2, "passed")
    assert got["test_warning"] == (1, "passed")  # warnings on stderr are stripped before scoring
    assert got["test_stderr"] == (0, "failed")  # any other stderr output scores 0 (nbgrader's rule)
    assert got["perf_in_cpu_mode"] == (0, grading.NOT_GRADABLE)
    assert report.score == 1.5 + 2 + 1 and report.gradable_max_score == 7 and report.max_score == 9


# --------------------------------------------------------------------------- performance scoring

@pytest.mark.parametrize("ratio, points", [(0.5, 3), (1.0, 3), (1.2, 3), (5.6, 1.5), (10, 0), (10.01, 0), (50, 0)])
def test_performance_score(ratio, points):
    assert grading.performance_score(ratio, 3) == points


def test_performance_score_is_linear_and_monotonic():
    ratios = [1.2 + 0.1 * i for i in range(89)]
    scores = [grading.performance_score(r, 4) for r in ratios]
    assert scores == sorted(scores, reverse=True)
    assert grading.performance_score(1.2 + 8.8 / 4, 4) == 3.0
    assert grading.performance_score(1.2 + 8.8 * 3 / 4, 4) == 1.0
    assert all(isinstance(s, float) for s in scores)


@pytest.mark.parametrize("ratio", [0, -1, float("nan")])
def test_performance_score_rejects_nonsense(ratio):
    with pytest.raises(runtime.CourseInputError):
        grading.performance_score(ratio, 3)


def test_performance_points_in_cpu_mode(capsys):
    if runtime.is_gpu():
        pytest.skip("GPU mode: the performance points are graded there")

    def never_called(*args):
        raise AssertionError("nothing runs in CPU mode")

    points = grading.performance_points(never_called, never_called, make_inputs=never_called, check=never_called,
                                        max_points=3)
    assert points == 0.0 and type(points) is float
    assert capsys.readouterr().out.strip() == (
        "performance: not gradable in CPU mode (needs a GPU); 0 of 3 points given here")


def test_learner_notebook_must_match_a_lesson(tmp_path):
    stray = tmp_path / "my_work" / "vector_multiply.ipynb"
    stray.parent.mkdir()
    shutil.copy(EXERCISE, stray)
    with pytest.raises(runtime.CourseInputError, match="Put it in a folder named 01_vector_multiply"):
        grading.grade(stray)


def test_grading_without_nbgrader_says_so(tmp_path, monkeypatch):
    """Where nbgrader is not installed, the grader says that before it starts a worker (which would only stop
    answering)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nbgrader" else real(name, *a))
    learner = tmp_path / "01_vector_multiply" / "vector_multiply.ipynb"
    learner.parent.mkdir()
    shutil.copy(EXERCISE, learner)
    with pytest.raises(grading.GradingError, match="nbgrader is not installed"):
        grading.grade(learner)


class _StartupFlakyApi:
    """nbgrader's API as the worker calls it, answering with the results given, in turn."""

    def __init__(self, *results):
        self.results, self.calls = list(results), 0

    def autograde(self, assignment, student, force, create):
        self.calls += 1
        return self.results.pop(0)


def test_a_kernel_that_dies_before_starting_is_graded_again_once(capsys):
    """nbclient's "Kernel died before replying to kernel_info" means no cell ran (seen in classes graded on 2 cores):
    the worker grades the submission again, once, and says so in its log (stderr), not in the learner's report; any
    other failure, or a second start-up failure, is reported as it is."""
    from gpucourse.grading import worker

    died = {"success": False, "log": "DeadKernelError: Kernel died before replying to kernel_info", "error": ""}
    ok = {"success": True, "log": ""}
    api = _StartupFlakyApi(died, ok)
    assert worker._autograde(api, "a", "s") == ok and api.calls == 2
    assert "s/a: the kernel died before replying to kernel_info" in capsys.readouterr().err
    api = _StartupFlakyApi(died, died)
    assert worker._autograde(api, "a", "s") == died and api.calls == 2
    other = {"success": False, "log": "KeyError: 'cell-7'", "error": ""}
    api = _StartupFlakyApi(other, ok)
    assert worker._autograde(api, "a", "s") == other and api.calls == 1
    api = _StartupFlakyApi(ok, died)
    assert worker._autograde(api, "a", "s") == ok and api.calls == 1
    assert capsys.readouterr().err.count("grading again") == 1

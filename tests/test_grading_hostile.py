"""Hostile and mangled submissions, each with the exact score and message the grader must give it.

Every case starts from what a learner really has, the released exercise with working answers (the
solution's), breaks one thing, and states what grading must then say: the score out of what CPU mode can
grade, and for each test that does not pass, its status and message; plus the notes the report must carry.
All the submissions of a lesson are graded in one run of ``grading.grade_class`` (the same preparation,
worker and guarded kernel as ``grading.grade``), in CPU mode, so each costs a few seconds.

The cases are in two groups:
    GENERIC_CASES   built from any lesson's source notebook (its first test, its first answer, ...): they
                    repair to full marks or are refused, whatever the lesson. A new lesson gets them by
                    being listed in LESSONS.
    LESSON_CASES    what a lesson's own code can get wrong (a kernel writing out of bounds, a hang, ...),
                    keyed by lesson; a new lesson adds its list.

The performance harness is tested here too: without a GPU through ``grading.performance._measure`` with a host clock
(fresh inputs, poisoned outputs, checks after every run, caches and deferred work caught, a clock replaced
by the candidate ignored), and on a GPU (``gpu`` marker) with known-wrong, known-slow, cached, deferred,
other-stream and clock-patching candidates against the real reference kernel.
"""
from __future__ import annotations

import csv
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import nbformat
import numpy as np
import pytest
from exercise_variants import fill_in_exercise

from gpucourse import grading, runtime

pytestmark = pytest.mark.slow

REPO = grading.REPO
LESSONS = ["01_vector_multiply"]  # lessons whose submissions this corpus attacks; add yours when it is ready
TIMEOUT = 10  # seconds per cell in the corpus runs (every solution cell takes a few seconds at most)
NOTEBOOK_TIMEOUT = 30  # seconds per notebook in the corpus runs
MARKER = Path("/tmp/gpucourse-hostile-marker")  # a file a hostile notebook tries to write


# ------------------------------------------------------------------------------------------ helpers

def source_nb(lesson: str) -> dict:
    return json.loads(next((grading.SOLUTIONS / lesson).glob("*.ipynb")).read_text())


def gid(cell) -> str | None:
    return grading.submissions.grade_id_of(cell)


def filled_exercise(lesson: str) -> dict:
    """The released exercise with the solution's answers typed in: a learner's working notebook, as JSON."""
    solution = next((grading.SOLUTIONS / lesson).glob("*.ipynb"))
    exercise = grading.EXERCISES / lesson / solution.name
    nb = nbformat.read(exercise, as_version=4)
    fill_in_exercise(nb, solution, exercise)
    return json.loads(nbformat.writes(nb))


def points(lesson: str) -> dict[str, float]:
    return {gid(c): c["metadata"]["nbgrader"]["points"] for c in source_nb(lesson)["cells"]
            if gid(c) and c["metadata"]["nbgrader"].get("grade")}


def gradable(lesson: str) -> float:
    return sum(p for g, p in points(lesson).items() if not g.startswith(grading.PERF_PREFIX))


def cells_where(nb: dict, test: Callable[[dict], bool]) -> list[dict]:
    return [c for c in nb["cells"] if isinstance(c, dict) and gid(c) and test(c["metadata"]["nbgrader"])]


def graded_cells_of(nb):
    return cells_where(nb, lambda m: m.get("grade"))


def answers_of(nb):
    return cells_where(nb, lambda m: m.get("solution") and not m.get("locked"))


def text(cell) -> str:
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else src


def edit(nb: dict, grade_id: str, old: str, new: str) -> None:
    cell = next(c for c in nb["cells"] if isinstance(c, dict) and gid(c) == grade_id)
    assert old in text(cell), f"{old!r} is not in cell {grade_id}: the solution changed"
    cell["source"] = text(cell).replace(old, new)


def append(nb: dict, grade_id: str, code: str) -> None:
    cell = next(c for c in nb["cells"] if gid(c) == grade_id)
    cell["source"] = text(cell) + "\n" + textwrap.dedent(code).strip() + "\n"


def added_cell(code: str, **metadata) -> dict:
    return {"cell_type": "code", "metadata": metadata, "source": textwrap.dedent(code).strip(), "outputs": [],
            "execution_count": None, "id": f"added-{abs(hash(code)) % 10**8}"}


@dataclass
class Case:
    """One submission and what grading must say about it.

    score: points out of what CPU mode grades (None: the notebook is not graded; ``error`` says why).
    tests: grade_id -> (status, message) for each test that does not pass; a message ending in "..." is a
        prefix, any other must match exactly. Tests not named must pass.
    notes: notes the report must carry (exactly these, in any order, when ``exact_notes``).
    """

    name: str
    make: Callable[[dict, Path], dict | bytes | None]
    score: float | None = None
    tests: dict[str, tuple[str, str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    exact_notes: bool = True
    error: str | None = None
    full: bool = False  # the score is every gradable point of the lesson


def matches(got: str, want: str) -> bool:
    return got.startswith(want[:-3]) if want.endswith("...") else got == want


# --------------------------------------------------------------------------- generic, any lesson

def _delete_tests(nb, _):
    nb["cells"] = [c for c in nb["cells"] if c not in graded_cells_of(nb)]


def _delete_locked(nb, _):
    nb["cells"] = [c for c in nb["cells"] if not (gid(c) and c["metadata"]["nbgrader"].get("locked"))]


def _duplicate_locked(nb, _):
    nb["cells"] = [d for c in nb["cells"] for d in ([c, json.loads(json.dumps(c))]
                                                   if gid(c) and c["metadata"]["nbgrader"].get("locked") else [c])]


def _reverse(nb, _):
    nb["cells"] = nb["cells"][::-1]


def _tests_to_markdown(nb, _):
    for c in graded_cells_of(nb):
        c["cell_type"] = "markdown"
        c.pop("outputs", None)
        c.pop("execution_count", None)


def _answers_to_raw(nb, _):
    for c in answers_of(nb):
        c["cell_type"] = "raw"
        c.pop("outputs", None)
        c.pop("execution_count", None)


def _forge_metadata(nb, _):
    for c in graded_cells_of(nb):
        c["metadata"]["nbgrader"].update(points=100, grade=False, locked=False)
        c["metadata"]["tags"] = ["skip-execution", "raises-exception"]
    nb["cells"].append(added_cell("1.0", nbgrader={"grade": True, "grade_id": "bonus", "locked": True,
                                                   "points": 50, "schema_version": 3, "solution": False}))


def _junk_entries(nb, _):
    nb["cells"] = [1, "a string", None, *nb["cells"], ["a", "list"]]


def _kernelspec(nb, _):
    nb["metadata"]["kernelspec"] = {"name": "bash", "display_name": "Bash", "language": "bash"}


def _shadowing_module(nb, folder: Path):
    (folder / "numpy.py").write_text("raise ImportError('a numpy.py handed in beside the notebook')\n")
    (folder / "math.py").write_text("raise ImportError('a math.py handed in beside the notebook')\n")


def _time_magic(nb, _):
    first = answers_of(nb)[0]
    first["source"] = "%%time\n" + text(first)


def _huge_output_cell(nb, _):
    nb["cells"].append(added_cell("print('x' * 20_000_000)\nprint('done')"))


def _not_json(nb, _):
    return b"this is not JSON {"


def _no_cells(nb, _):
    return json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": "none"}).encode()


def _no_exercise_cells(nb, _):
    for c in nb["cells"]:
        c["metadata"] = {}


def generic_cases(lesson: str) -> list[Case]:
    nb = source_nb(lesson)
    test_ids = [gid(c) for c in graded_cells_of(nb)]
    locked_ids = [gid(c) for c in cells_where(nb, lambda m: m.get("locked"))]
    answer_ids = [gid(c) for c in answers_of(nb)]
    name = next((grading.SOLUTIONS / lesson).glob("*.ipynb")).name
    return [
        Case("deleted_tests", _delete_tests, full=True,
             notes=[f"cell {g} had been deleted; it was put back and run" for g in test_ids]),
        Case("deleted_locked_cells", _delete_locked, full=True,
             notes=[f"cell {g} had been deleted; it was put back and run" for g in locked_ids]),
        Case("duplicated_locked_cells", _duplicate_locked, full=True,
             notes=[f"cell {g} appeared more than once; the extra copy was removed" for g in locked_ids]),
        Case("reversed_cells", _reverse, full=True,
             notes=["cells had been moved; the exercise's cells were put back in their order (cells you added "
                    "stay after the cell they followed)"]),
        Case("tests_retyped_markdown", _tests_to_markdown, full=True,
             notes=[f"cell {g} had been changed to markdown; it was put back as code" for g in test_ids]),
        Case("answers_retyped_raw", _answers_to_raw, full=True,
             notes=[f"your answer cell {g} had been changed to raw; it ran as code" for g in answer_ids]),
        Case("forged_metadata_and_tags", _forge_metadata, full=True,
             notes=["a cell claimed grade id 'bonus', which this exercise does not have; it ran as an ordinary "
                    "cell"]),
        Case("junk_cell_entries", _junk_entries, full=True,
             notes=["4 entries of the notebook's cell list were not a cell and were ignored"]),
        Case("kernelspec_swapped", _kernelspec, full=True),
        Case("shadowing_modules_handed_in", _shadowing_module, full=True),
        Case("time_magic", _time_magic, full=True),
        Case("huge_output_added_cell", _huge_output_cell, full=True),
        Case("not_json", _not_json, error=f"{name} is not a notebook (Expecting value: line 1 column 1 (char 0))"),
        Case("cells_not_a_list", _no_cells, error=f"{name} is not a notebook (no list of cells)"),
        Case("no_exercise_cells", _no_exercise_cells, error=f"{name}: it has none of the exercise's cells: work in a "
             "copy of the released exercise, which carries what the grader needs"),
    ]


# ----------------------------------------------------------------------------------- lesson 1

L1 = "01_vector_multiply"
# What the rest of the notebook gives when one part fails.
FAIL_1_1 = {"test_1_1_kernel", "test_1_1_small_grids"}  # both use the Task 1.1 kernel
LATER_1_4 = ("test_1_4_occupancy", "test_1_4_decision")  # the Task 1.4 tests before fast_multiply's
NOT_RUN = "not run"


def _l1(score, tests=None, notes=None, **kw):
    return dict(score=score, tests=tests or {}, notes=notes or [], **kw)


def l1_infinite_loop(nb, _):
    edit(nb, "task_1_2_gbps", "    nbytes = 3 * n * itemsize",
         "    while ms > 0:\n        pass\n    nbytes = 3 * n * itemsize")


def l1_uninterruptible(nb, _):
    edit(nb, "task_1_2_gbps", "    nbytes = 3 * n * itemsize",
         "    import time\n    while True:\n        try:\n            time.sleep(0.1)\n"
         "        except KeyboardInterrupt:\n            pass\n    nbytes = 3 * n * itemsize")


def l1_notebook_limit(nb, _):
    at = next(i for i, c in enumerate(nb["cells"]) if gid(c) == "test_1_2_gbps")
    for k in range(4):
        nb["cells"].insert(at + 1 + k, added_cell(f"import time\ntime.sleep({TIMEOUT - 2})  # {k}"))


def l1_os_exit(nb, _):
    edit(nb, "task_1_2_gbps", "    nbytes = 3 * n * itemsize", "    import os\n    os._exit(3)")


def l1_segfault(nb, _):
    edit(nb, "task_1_2_gbps", "    nbytes = 3 * n * itemsize", "    import faulthandler\n    faulthandler._sigsegv()")


def l1_segfault_ctypes(nb, _):
    edit(nb, "task_1_2_gbps", "    nbytes = 3 * n * itemsize", "    import ctypes\n    ctypes.string_at(0)")


def l1_out_of_bounds(nb, _):
    edit(nb, "task_1_1_kernel", "range(start, out.size, stride)", "range(start, out.size + stride, stride)")


def l1_nan(nb, _):
    edit(nb, "task_1_1_kernel", "out[r, c] = m[r, c] * s[r]", "out[r, c] = math.nan")


def l1_inf(nb, _):
    edit(nb, "task_1_3_transfer", "return nbytes / (gbps * 1e9)", "return math.inf")


def l1_wrong_dtype(nb, _):
    edit(nb, "task_1_3_answers", "pageable_s = transfer_seconds(both_inputs, PAGEABLE_GBPS)",
         "pageable_s = str(transfer_seconds(both_inputs, PAGEABLE_GBPS))")


def l1_wrong_shape(nb, _):
    edit(nb, "task_1_4_fast_multiply", "    return out", "    return out[:-1]")


def l1_patched_timer(nb, _):
    append(nb, "task_1_4_fast_multiply", """
        import time
        from gpucourse import bench
        time.perf_counter = lambda: 0.0
        bench.time_gpu = lambda *args, **kwargs: bench.Timing([1e-6])
    """)


def l1_patched_grader(nb, _):
    append(nb, "task_1_4_fast_multiply", """
        from gpucourse import grading
        grading.performance_points = lambda *args, **kwargs: 3.0
    """)


def l1_cached(nb, _):
    cell = next(c for c in nb["cells"] if gid(c) == "task_1_4_fast_multiply")
    cell["source"] = textwrap.dedent("""\
        _CACHE = {}


        @cuda.jit
        def fast_kernel(a, b, out):
            for k in range(cuda.grid(1), out.size // 2, cuda.gridsize(1)):
                x, y, u, v = a[2 * k], a[2 * k + 1], b[2 * k], b[2 * k + 1]
                out[2 * k] = x * u - y * v
                out[2 * k + 1] = x * v + y * u


        def fast_multiply(a, b, out):
            # Computes once per size, then hands back the stored product: wrong for new inputs of that size.
            n = out.shape[0]
            if n not in _CACHE:
                fast_kernel[max(1, min(math.ceil(n / 2 / THREADS), BLOCKS_PER_SM * SMS)), THREADS](a, b, out)
                _CACHE[n] = out.copy_to_host()
            out.copy_to_device(_CACHE[n])
            return out
    """)


def l1_huge_stdout_in_test(nb, _):
    edit(nb, "task_1_4_fast_multiply", "    return out", "    print('y' * 3_000_000)\n    return out")


def l1_huge_stderr_in_test(nb, _):
    edit(nb, "task_1_2_gbps", "    nbytes = 3 * n * itemsize",
         "    import sys\n    print('z' * 3_000_000, file=sys.stderr)\n    nbytes = 3 * n * itemsize")


def l1_write_outside(nb, _):
    append(nb, "task_1_2_gbps", f"""
        with open({str(MARKER)!r}, "w") as f:
            f.write("written by a graded notebook")
    """)


def l1_write_repository(nb, _):
    append(nb, "task_1_2_gbps", f"""
        import shutil
        shutil.rmtree({str(REPO / "exercises")!r})
    """)


def l1_read_solution(nb, _):
    targets = [str(grading.SOLUTIONS / L1 / "vector_multiply.ipynb"),
               "../../../source/01_vector_multiply/vector_multiply.ipynb",
               "../../../gradebook.db", "/proc/self/cwd/../../../gradebook.db", str(REPO / ".git" / "HEAD"),
               "../../alice/01_vector_multiply/vector_multiply.ipynb", os.path.expanduser("~/.bashrc")]
    nb["cells"].append(added_cell(f"""
        import glob, os, sqlite3, sys
        results = []
        for path in {targets!r}:
            try:
                with open(path, "rb") as f:
                    results.append(("read", path, f.read(40)))
            except OSError as exc:
                results.append((type(exc).__name__, path))
        for folder in ["../..", "../../..", {str(REPO)!r}, "/tmp"]:
            try:
                results.append(("listed", folder, os.listdir(folder)))
            except OSError as exc:
                results.append((type(exc).__name__, folder))
        try:
            sqlite3.connect("../../../gradebook.db").execute("select * from grade_cell").fetchall()
            results.append(("sqlite", "read"))
        except Exception as exc:
            results.append((type(exc).__name__, "sqlite"))
        results.append(("glob", len(glob.glob("/tmp/**/vector_multiply.ipynb", recursive=True))))
        exposed = [v for v in [*os.environ.values(), *sys.path, os.getcwd()]
                   if {str(REPO)!r} in v and not v.startswith(sys.prefix)]
        results.append(("exposed", exposed))
        print(repr(results))
    """))
    edit(nb, "task_1_2_gbps", "return nbytes / (ms * 1e-3) / 1e9", "return 0.0")


def l1_exec_solution(nb, _):
    append(nb, "task_1_2_gbps", f"""
        import json
        exec(json.load(open({str(grading.SOLUTIONS / L1 / "vector_multiply.ipynb")!r}))["cells"][8]["source"])
    """)


def l1_rebind_helper(nb, _):
    edit(nb, "task_1_1_kernel", "out[r, c] = m[r, c] * s[r]", "out[r, c] = m[r, c]")
    append(nb, "task_1_1_kernel", """
        def check_product(out, a, b, what):
            pass
    """)


def l1_rebind_builtin(nb, _):
    edit(nb, "task_1_3_answers", "pageable_s = transfer_seconds(both_inputs, PAGEABLE_GBPS)",
         "pageable_s = 'fast'\nisinstance = lambda *args: True")


def l1_monkeypatch_numpy(nb, _):
    edit(nb, "task_1_1_kernel", "out[r, c] = m[r, c] * s[r]", "out[r, c] = m[r, c]")
    append(nb, "task_1_1_kernel", "np.isclose = lambda a, b, **kw: np.ones(np.shape(a), dtype=bool)")


def l1_shell_escape(nb, _):
    append(nb, "task_1_2_gbps", "!cat /etc/passwd")


def l1_gc_escape(nb, _):
    append(nb, "task_1_2_gbps", "import gc\nhooks = [o for o in gc.get_objects() if callable(o)]")


def l1_frame_escape(nb, _):
    append(nb, "task_1_2_gbps", """
        import sys
        sys._getframe(0).f_globals["check_product"] = print
    """)


def l1_deleted_answer(nb, _):
    nb["cells"] = [c for c in nb["cells"] if gid(c) != "task_1_2_gbps"]


def l1_duplicated_answer(nb, _):
    at = next(i for i, c in enumerate(nb["cells"]) if gid(c) == "task_1_2_gbps")
    copy = json.loads(json.dumps(nb["cells"][at]))
    copy["source"] = text(copy).replace("nbytes = 3 * n * itemsize", "nbytes = 2 * n * itemsize")
    nb["cells"].insert(at + 1, copy)


def l1_edited_visible_test(nb, _):
    edit(nb, "task_1_2_gbps", "nbytes = 3 * n * itemsize", "nbytes = 2 * n * itemsize")
    edit(nb, "test_1_2_gbps", "assert math.isclose", "assert True or math.isclose")


def l1_edited_hidden_tests(nb, _):
    edit(nb, "task_1_1_kernel", "range(start, out.size, stride)", "range(start, out.size - out.size % 2, stride)")
    cell = next(c for c in nb["cells"] if gid(c) == "test_1_1_small_grids")
    cell["source"] = text(cell) + "### BEGIN HIDDEN TESTS\npass  # nothing hidden here\n### END HIDDEN TESTS\n"


def l1_source_not_text(nb, _):
    next(c for c in nb["cells"] if gid(c) == "task_1_3_transfer")["source"] = 42


LESSON_CASES: dict[str, list[Case]] = {L1: [
    Case("infinite_loop", l1_infinite_loop, **_l1(10, {"test_1_2_gbps": (
        "timed out", f"no result within {TIMEOUT} s; the cell was interrupted")})),
    Case("uninterruptible_loop", l1_uninterruptible, **_l1(3, {
        "test_1_2_gbps": ("timed out", f"no result within {TIMEOUT} s, and the cell did not stop when interrupted; "
                                       "the cells after it were not run"),
        "test_1_3_transfer_seconds": (NOT_RUN, "an earlier cell could not be interrupted"),
        **{g: (NOT_RUN, "an earlier cell could not be interrupted")
           for g in ("test_1_3_answers", *LATER_1_4, "test_1_4_fast_multiply", "test_1_4_any_grid")}})),
    Case("notebook_time_limit", l1_notebook_limit, exact_notes=False, **_l1(5, {
        g: (NOT_RUN, f"the notebook used up its limit of {NOTEBOOK_TIMEOUT} s before this cell")
        for g in ("test_1_3_transfer_seconds", "test_1_3_answers", *LATER_1_4, "test_1_4_fast_multiply",
                  "test_1_4_any_grid")})),
    Case("kernel_exits", l1_os_exit, **_l1(3, {
        "test_1_2_gbps": ("kernel died", "the kernel died while this cell ran (exit code 3); the cells after it were "
                                         "not run. Restart the kernel and run all cells to find the line that ends it"),
        **{g: (NOT_RUN, "the kernel died in an earlier cell (exit code 3)")
           for g in ("test_1_3_transfer_seconds", "test_1_3_answers", *LATER_1_4, "test_1_4_fast_multiply",
                  "test_1_4_any_grid")}})),
    Case("kernel_segfaults", l1_segfault, **_l1(3, {
        "test_1_2_gbps": ("kernel died", "the kernel died while this cell ran (SIGSEGV: a segmentation fault); the "
                                         "cells after it were not run. Restart the kernel and run all cells to find "
                                         "the line that ends it"),
        **{g: (NOT_RUN, "the kernel died in an earlier cell (SIGSEGV: a segmentation fault)")
           for g in ("test_1_3_transfer_seconds", "test_1_3_answers", *LATER_1_4, "test_1_4_fast_multiply",
                  "test_1_4_any_grid")}})),
    Case("segfault_through_ctypes", l1_segfault_ctypes, **_l1(10, {
        "test_1_2_gbps": ("failed", "NameError: name 'achieved_gbps' is not defined")}, [
        "cell task_1_2_gbps was not run: line 4: imports ctypes (reaches memory and C functions directly; graded "
        "notebooks may not)"])),
    Case("out_of_bounds_write", l1_out_of_bounds, **_l1(9, {
        "test_1_1_kernel": ("failed", "IndexError: ..."), "test_1_1_small_grids": ("failed", "IndexError: ...")})),
    Case("nan_output", l1_nan, **_l1(9, {
        "test_1_1_kernel": ("failed", "AssertionError: 25 x 40 matrix, 2 block(s) x 128 thread(s): 1000 of 1000 "
                                      "elements wrong, the first at row 0, column 0 (got nan, want ..."),
        "test_1_1_small_grids": ("failed", "AssertionError: 2 x 5 matrix, 1 block(s) x 32 thread(s): 10 of 10 "
                                           "elements wrong, the first at row 0, column 0 (got nan, want ...")})),
    Case("inf_output", l1_inf, **_l1(9, {
        "test_1_3_transfer_seconds": ("failed", "AssertionError: transfer_seconds(10**9, 10) = inf"),
        "test_1_3_answers": ("failed", "AssertionError: copies from pinned memory are the faster ones")})),
    Case("wrong_dtype", l1_wrong_dtype, **_l1(10, {
        "test_1_3_answers": ("failed", "AssertionError: pageable_s must be a number, not '0.4294967296'")})),
    Case("wrong_shape", l1_wrong_shape, **_l1(11, {
        "test_1_4_fast_multiply": ("failed", "AssertionError: fast_multiply must return out")})),
    Case("patched_timer_and_clock", l1_patched_timer, **_l1(10, {
        "test_1_4_fast_multiply": ("failed", "NameError: name 'fast_multiply' is not defined"),
        "test_1_4_any_grid": ("failed", "NameError: name 'fast_kernel' is not defined")}, [
        "cell task_1_4_fast_multiply was not run: line 25: sets attribute time.perf_counter (a notebook may set "
        "attributes only on self in its own classes; setting them on modules or shared objects patches what the "
        "tests use); line 26: sets attribute bench.time_gpu (a notebook may set attributes only on self in its "
        "own classes; setting them on modules or shared objects patches what the tests use)"])),
    Case("patched_grader", l1_patched_grader, **_l1(10, {
        "test_1_4_fast_multiply": ("failed", "NameError: name 'fast_multiply' is not defined"),
        "test_1_4_any_grid": ("failed", "NameError: name 'fast_kernel' is not defined")}, [
        "cell task_1_4_fast_multiply was not run: line 23: imports gpucourse.grading (is the grader itself; graded "
        "notebooks may not); line 24: sets attribute grading.performance_points (a notebook may set attributes "
        "only on self in its own classes; setting them on modules or shared objects patches what the tests "
        "use)"])),
    # Caching passes the correctness test, which never repeats a size; the performance test catches it
    # (test_performance_catches_a_cache, and on a GPU, test_gpu_known_wrong_and_gamed_candidates).
    Case("cached_results", l1_cached, **_l1(12)),
    Case("huge_stdout_in_a_test", l1_huge_stdout_in_test, **_l1(12)),
    Case("huge_stderr_in_a_test", l1_huge_stderr_in_test, **_l1(10, {
        "test_1_2_gbps": ("failed", "wrote to stderr, which nbgrader scores as a failure: zzzz...")})),
    Case("writes_outside_its_folder", l1_write_outside, **_l1(12, notes=[
        "cell task_1_2_gbps: PermissionError: the grader lets a notebook write only in its own folder, not "
        f"{MARKER}"])),
    Case("deletes_the_repository", l1_write_repository, **_l1(12, notes=[
        f"cell task_1_2_gbps: PermissionError: the grader lets a notebook write only in its own folder, not "
        f"{REPO / 'exercises'}"])),
    Case("reads_the_solution", l1_read_solution, **_l1(10, {
        "test_1_2_gbps": ("failed", "AssertionError: achieved_gbps(2**29, 4, 2.0) = 0.0: count every byte read and "
                                    "written, and mind the units")})),
    Case("execs_the_solution", l1_exec_solution, **_l1(10, {
        "test_1_2_gbps": ("failed", "NameError: name 'achieved_gbps' is not defined")}, [
        "cell task_1_2_gbps was not run: line 8: uses exec (it runs code built at run time)"])),
    Case("rebinds_a_test_helper", l1_rebind_helper, **_l1(9, {
        g: ("failed", "NameError: name 'scale_rows' is not defined") for g in FAIL_1_1}, [
        "cell task_1_1_kernel was not run: line 13: replaces check_product (a read-only cell defines it and the "
        "tests use it)"])),
    Case("rebinds_a_builtin", l1_rebind_builtin, **_l1(10, {
        "test_1_3_answers": ("failed", "AssertionError: pageable_s must be a number, not None")}, [
        "cell task_1_3_answers was not run: line 6: replaces the builtin isinstance (a read-only cell defines it "
        "and the tests use it)"])),
    Case("monkeypatches_numpy", l1_monkeypatch_numpy, **_l1(9, {
        g: ("failed", "NameError: name 'scale_rows' is not defined") for g in FAIL_1_1}, [
        "cell task_1_1_kernel was not run: line 13: sets attribute np.isclose (a notebook may set attributes only "
        "on self in its own classes; setting them on modules or shared objects patches what the tests use)"])),
    Case("shell_escape", l1_shell_escape, **_l1(10, {
        "test_1_2_gbps": ("failed", "NameError: name 'achieved_gbps' is not defined")}, [
        "cell task_1_2_gbps was not run: line 7: runs a shell command (graded notebooks may not start "
        "processes)"])),
    Case("garbage_collector_escape", l1_gc_escape, **_l1(10, {
        "test_1_2_gbps": ("failed", "NameError: name 'achieved_gbps' is not defined")}, [
        "cell task_1_2_gbps was not run: line 7: imports gc (reaches every object in the kernel; graded notebooks "
        "may not)"])),
    Case("frame_escape", l1_frame_escape, **_l1(10, {
        "test_1_2_gbps": ("failed", "NameError: name 'achieved_gbps' is not defined")}, [
        "cell task_1_2_gbps was not run: line 8: uses .f_globals (it reaches frames, tracing, the import system or "
        "processes); line 8: uses ._getframe (it reaches frames, tracing, the import system or processes)"])),
    Case("deleted_answer", l1_deleted_answer, **_l1(10, {
        "test_1_2_gbps": ("failed", "NameError: name 'achieved_gbps' is not defined")}, [
        "your answer cell task_1_2_gbps had been deleted; the tests that need it fail"])),
    Case("duplicated_answer_wrong_copy", l1_duplicated_answer, **_l1(10, {
        "test_1_2_gbps": ("failed", "AssertionError: achieved_gbps(2**29, 4, 2.0) = 2147.483648: count every byte "
                                    "read and written, and mind the units")}, [
        "cell task_1_2_gbps appeared more than once; the first copy is graded as your answer, the others ran as "
        "ordinary cells"])),
    Case("edited_visible_test", l1_edited_visible_test, **_l1(10, {
        "test_1_2_gbps": ("failed", "AssertionError: achieved_gbps(2**29, 4, 2.0) = 2147.483648: count every byte "
                                    "read and written, and mind the units")}, [
        "cell test_1_2_gbps had been edited; it was run as written in the solution"])),
    Case("edited_hidden_tests", l1_edited_hidden_tests, **_l1(9, {
        "test_1_1_kernel": ("failed", "AssertionError: 7 x 143 matrix, 3 block(s) x 100 thread(s): 1 of 1001 "
                                      "elements wrong, the first at row 6, column 142 (got nan, want ..."),
        "test_1_1_small_grids": ("failed", "AssertionError: 1 x 5 matrix, 2 block(s) x 64 thread(s): 1 of 5 "
                                           "elements wrong, the first at row 0, column 4 (got nan, want ...")}, [
        "cell test_1_1_small_grids had been edited; it was run as written in the solution"])),
    Case("source_not_text", l1_source_not_text, **_l1(9, {
        "test_1_3_transfer_seconds": ("failed", "NameError: name 'transfer_seconds' is not defined"),
        "test_1_3_answers": ("failed", "AssertionError: pageable_s must be a number, not None")})),
]}


def all_cases(lesson: str) -> list[Case]:
    return generic_cases(lesson) + LESSON_CASES.get(lesson, [])


# ------------------------------------------------------------------------------ the class runs

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Every case of every lesson, graded: lesson -> (ClassReport, progress lines, case folder)."""
    MARKER.unlink(missing_ok=True)
    graded = {}
    for lesson in LESSONS:
        folder = tmp_path_factory.mktemp(f"class-{lesson}")
        name = next((grading.SOLUTIONS / lesson).glob("*.ipynb")).name
        for case in all_cases(lesson):
            sub = folder / case.name / lesson
            sub.mkdir(parents=True)
            nb = filled_exercise(lesson)
            made = case.make(nb, sub)
            (sub / name).write_bytes(made if isinstance(made, bytes) else json.dumps(nb, indent=1).encode())
        lines: list[str] = []
        t0 = time.monotonic()
        report = grading.grade_class(folder, assignment=lesson, course_dir=folder.parent / f"course-{lesson}",
                                     mode="cpu", timeout=TIMEOUT, notebook_timeout=NOTEBOOK_TIMEOUT, workers=2,
                                     progress=lines.append)
        print(f"{lesson}: {len(all_cases(lesson))} hostile submissions graded in {time.monotonic() - t0:.0f} s")
        graded[lesson] = (report, lines, folder)
    return graded


CASES = [(lesson, case) for lesson in LESSONS for case in all_cases(lesson)]


@pytest.mark.parametrize("lesson, case", CASES, ids=[f"{lesson[:2]}-{c.name}" for lesson, c in CASES])
def test_hostile_submission_gets_its_exact_score_and_messages(corpus, lesson, case):
    report, _, _ = corpus[lesson]
    if case.error is not None:
        assert case.name not in report.reports, report.reports.get(case.name)
        assert report.errors[case.name] == case.error
        return
    r = report.reports[case.name]
    assert r.mode == "cpu"
    assert r.max_score == sum(points(lesson).values()) and r.gradable_max_score == gradable(lesson), r.format()
    want = gradable(lesson) if case.full else case.score
    assert r.score == want, r.format()
    for t in r.tests:
        if not t.gradable:
            assert t.points == 0 and t.performance, r.format()
            continue
        if t.grade_id in case.tests:
            status, message = case.tests[t.grade_id]
            assert t.points == 0 and t.status == status, r.format()
            assert matches(t.message, message), f"{t.grade_id}: {t.message!r}\nwant {message!r}"
        elif case.score != 0:
            assert (t.points, t.status) == (t.max_points, "passed"), r.format()
    if case.exact_notes:
        assert sorted(r.notes) == sorted(case.notes), r.notes
    else:
        assert set(case.notes) <= set(r.notes), r.notes


def test_progress_is_shown_for_every_submission(corpus):
    for lesson, (report, lines, _) in corpus.items():
        counted = [line for line in lines if line.startswith("[")]
        assert len(counted) == len(report.reports) + len(report.errors) - 0, lines
        assert counted[-1].startswith(f"[{len(counted)}/{len(counted)}]")
        assert lines[0].startswith(f"grading {len(counted)} submissions of {lesson} in CPU mode, 2 at a time")
        assert lines[-1].startswith("done in ")


def test_nothing_escaped_the_kernel(corpus):
    assert not MARKER.exists(), "a graded notebook wrote outside its folder"
    assert (REPO / "exercises" / L1).is_dir(), "a graded notebook deleted part of the repository"
    report, _, _ = corpus[L1]
    graded = Path(report.course_dir) / "autograded" / "reads_the_solution" / L1 / "vector_multiply.ipynb"
    printed = "".join("".join(o.get("text", "")) for c in json.loads(graded.read_text())["cells"]
                      for o in c.get("outputs", []) if o.get("output_type") == "stream")
    line = next(line for line in printed.splitlines() if line.startswith("[("))
    results = eval(line)  # noqa: S307 - the repr of tuples of str, bytes and lists our own cell printed
    refused = [r for r in results if r[0] not in ("glob", "exposed")]
    assert refused and all(r[0] == "PermissionError" for r in refused), results
    assert ("glob", 0) in results and ("exposed", []) in results, results


def test_huge_output_is_capped(corpus):
    report, _, _ = corpus[L1]
    for student in ("huge_stdout_in_a_test", "huge_output_added_cell", "huge_stderr_in_a_test"):
        graded = Path(report.course_dir) / "autograded" / student / L1 / "vector_multiply.ipynb"
        assert graded.stat().st_size < 2 * grading.settings.CELL_OUTPUT_CHARS + 200_000, student
        assert "[... output truncated: the grader keeps at most" in graded.read_text(), student


def test_gradebook_csv_and_feedback_agree_with_the_reports(corpus):
    report, _, _ = corpus[L1]
    course = Path(report.course_dir)
    with sqlite3.connect(course / "gradebook.db") as db:
        students = {row[0] for row in db.execute("select id from student")}
    assert set(report.reports) <= students
    with open(course / "grades.csv") as f:
        rows = {row["student_id"]: row for row in csv.DictReader(f)}
    for student, r in report.reports.items():
        assert float(rows[student]["score"]) == pytest.approx(r.score), student
        assert float(rows[student]["max_score"]) == r.max_score
        [html] = report.feedback(student)
        page = html.read_text()
        for t in r.tests:
            assert f"grader: {'-' if not t.gradable else grading.reports.number(t.points)} / {grading.reports.number(t.max_points)}" in page
    page = report.feedback("kernel_exits")[0].read_text()
    assert "the kernel died while this cell ran (exit code 3)" in page


def test_a_grading_process_that_overruns_is_stopped_and_the_class_goes_on(tmp_path, monkeypatch):
    """The last line of defence: a notebook whose grading process does not come back within its limit (here
    1 s, with no time to start) is stopped by process id, scored as not graded, and the next one is graded by a
    fresh process; nothing is left running. The grading process is frozen (SIGSTOP) as it is asked to grade, so
    it overruns whatever the machine's speed: a worker left running would answer at its own 1 s limit, the
    same moment as the grader's deadline."""
    monkeypatch.setattr(grading.pool, "STARTUP_SLACK", 0)
    ask = grading.pool._Worker.ask

    def frozen_when_grading(worker, request, timeout):
        if request.get("op") == "grade":
            os.killpg(worker.proc.pid, signal.SIGSTOP)
        return ask(worker, request, timeout)

    monkeypatch.setattr(grading.pool._Worker, "ask", frozen_when_grading)
    folder = tmp_path / "submitted"
    for student in ("ann", "bob"):
        sub = folder / student / L1
        sub.mkdir(parents=True)
        (sub / "vector_multiply.ipynb").write_text(json.dumps(filled_exercise(L1)))
    report = grading.grade_class(folder, course_dir=tmp_path / "course", mode="cpu", notebook_timeout=1, workers=1,
                                 progress=False)
    assert report.reports == {}
    assert report.errors == dict.fromkeys(("ann", "bob"), (
        "grading went on past 1 s, the notebook's 1 s limit and 0 s to start and stop, so the grader stopped it; it "
        "gets no points"))
    left = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(tmp_path).encode() in (proc / "cmdline").read_bytes() + (
                    proc / "environ").read_bytes():
                left.append(proc.name)
        except OSError:
            continue
    assert left == [], "processes of the grading run are still running"


# ----------------------------------------------------------------------- integrity rules, directly

PROTECTED = {"check_product", "np", "cuda", "isinstance", "math"}
SAME = {"np": "numpy", "math": "math", "cuda": "numba.cuda"}


@pytest.mark.parametrize("code", [
    "import numpy as np\nimport math\nfrom numba import cuda",  # the same imports again
    "x = np.zeros(3)\nout = x.copy()\nout[0] = 1",
    "class A:\n    def __init__(self):\n        self.x = 1",
    "def f(a, b, out):\n    n = out.shape[0]\n    return math.ceil(n / 2)",
    "%time y = sum(range(10))",
    "sum = 0\nfor i in range(3):\n    sum += i",  # a builtin the tests do not use
    "print(f'{np.pi:.3f}', getattr(np, 'pi'))",
    "import time\ntime.sleep(0)",
])
def test_integrity_allows_ordinary_code(code):
    assert grading.integrity.integrity_findings(code, protected=PROTECTED, same=SAME) == []


@pytest.mark.parametrize("code, finding", [
    ("eval('1')", "line 1: uses eval (it runs code built at run time)"),
    ("f = getattr\nf(np, 'isclose')", "line 1: passes getattr around (it reaches any attribute by name)"),
    ("getattr(np, 'is' + 'close')", "line 1: uses getattr with a computed name (it reaches any attribute)"),
    ("np.__dict__['isclose'] = 1", "line 1: uses .__dict__ (special attributes reach the interpreter's machinery)"),
    ("import numpy as n2\nn2.isclose = print", "line 2: sets attribute n2.isclose (a notebook may set attributes "
     "only on self in its own classes; setting them on modules or shared objects patches what the tests use)"),
    ("m = np", "line 1: uses module np as a value (a module passed around can be patched)"),
    ("import os\nos.environ['X'] = '1'", "line 2: assigns into os.environ (it changes a module's state, which the "
     "tests share)"),
    ("from numpy import isclose as check_product", "line 1: replaces check_product (a read-only cell defines it and "
     "the tests use it)"),
    ("import numpy.linalg as np", "line 1: replaces np (a read-only cell defines it and the tests use it)"),
    ("for check_product in [print]:\n    pass", "line 1: replaces check_product (a read-only cell defines it and "
     "the tests use it)"),
    ("def f():\n    global check_product\n    check_product = print", "line 3: replaces check_product (a read-only "
     "cell defines it and the tests use it)"),
    ("import sys\nsys.modules['numpy'] = None", "line 2: uses sys.modules (it changes what the tests import or see)"),
    ("%load_ext autoreload", "line 1: uses %load_ext (graded notebooks may use only the %time and %timeit magics)"),
    ("%time import ctypes", "in %time, line 1: imports ctypes (reaches memory and C functions directly; graded "
     "notebooks may not)"),
    ("from operator import attrgetter\nattrgetter('__globals__')(print)",
     "line 2: names '__globals__' (special names reach the interpreter's machinery)"),
    ("async def f():\n    pass\nawait f()\nexec('1')", "line 4: uses exec (it runs code built at run time)"),
    ("def broken(:\n    pass", "line 1: invalid syntax (the grader checks a cell before running it, and cannot read "
     "this one)"),
    ("from numba.core import types", "line 1: imports numba.core (reaches numba's compiler internals; graded notebooks "
     "may not)"),
])
def test_integrity_refuses_the_routes_to_patching(code, finding):
    assert finding in grading.integrity.integrity_findings(code, protected=PROTECTED, same=SAME)


# A lesson's own functions that answer its tasks (the solution's metadata "gpucourse": {"answers": ...}).
ANSWERS = {"kernels.feeding_the_gpu.overlap_fraction": "Task 8.4", "systems.feeding_the_gpu.batching.dynamic_batching": "Task 8.2",
           "kernels.training.loss_and_grads(checkpoint_every)": "Task 9.2"}
SAME_7 = {"S": "kernels.feeding_the_gpu", "B": "systems.feeding_the_gpu.batching", "feeding": "benchmarks.feeding_the_gpu", "tr": "kernels.training",
          "np": "numpy"}


@pytest.mark.parametrize("code, how", [
    ("def f(t):\n    return S.overlap_fraction(t)", "uses kernels.feeding_the_gpu.overlap_fraction"),
    ("f = S.overlap_fraction", "uses kernels.feeding_the_gpu.overlap_fraction"),
    ("from kernels.feeding_the_gpu import overlap_fraction as mine", "imports kernels.feeding_the_gpu.overlap_fraction"),
    ("import kernels.feeding_the_gpu\nf = kernels.feeding_the_gpu.overlap_fraction", "uses kernels.feeding_the_gpu.overlap_fraction"),
    ("f = getattr(S, 'overlap_fraction')", "uses kernels.feeding_the_gpu.overlap_fraction"),
    ("f = feeding.S.overlap_fraction", "uses kernels.feeding_the_gpu.overlap_fraction"),  # through another module's import
    ("from benchmarks.feeding_the_gpu import S as T\nf = T.overlap_fraction", "uses kernels.feeding_the_gpu.overlap_fraction"),
    ("f = feeding.serving.B.dynamic_batching", "uses systems.feeding_the_gpu.batching.dynamic_batching"),  # two modules deep
    ("g = tr.loss_and_grads(p, X, y, checkpoint_every=4)", "calls kernels.training.loss_and_grads with "
     "checkpoint_every="),
    ("kw = {'checkpoint_every': 4}\ng = tr.loss_and_grads(p, X, y, **kw)", "calls kernels.training.loss_and_grads "
     "with checkpoint_every="),
    ("import functools\ng = functools.partial(tr.loss_and_grads, checkpoint_every=4)", "calls "
     "kernels.training.loss_and_grads with checkpoint_every="),
])
def test_integrity_refuses_the_lessons_own_answers(code, how):
    """A task the lesson's own function answers must be written, not called, imported, aliased or fetched."""
    found = grading.integrity.integrity_findings(code, protected={"S", "B", "feeding", "tr", "np"}, same=SAME_7,
                                                  answers=ANSWERS)
    assert any(how in f and "the lesson's own answer to Task" in f for f in found), found


@pytest.mark.parametrize("code", [
    "x = S.engine_timeline([])\nn = S.check_pipeline(8, 2, 1)",  # the lesson's other functions are tools
    "g = tr.loss_and_grads(p, X, y)\nh = tr.loss_and_grads(p, X, y, loss_scale=8.0)",  # without the keyword
    "overlap_fraction = 0.5\nprint(overlap_fraction)",  # the same name, not the function
])
def test_integrity_allows_the_lessons_tools(code):
    assert grading.integrity.integrity_findings(code, protected={"S", "B", "feeding", "tr", "np"}, same=SAME_7,
                                                 answers=ANSWERS) == []


def test_every_declared_answer_exists_and_solutions_do_not_use_them():
    """Each solution's answers name real course functions, and the solution's own answer cells pass the rule."""
    import ast
    import re

    for path in sorted(grading.SOLUTIONS.glob("*/*.ipynb")):
        nb = json.loads(path.read_text())
        answers = grading.integrity.solution_answers(nb)
        for key in answers:
            dotted = re.sub(r"\(\w+\)$", "", key)
            module, name = dotted.rsplit(".", 1)
            f = grading.integrity._module_path(module)
            assert f is not None and f.is_file(), (path.name, key)
            body = ast.parse(f.read_text()).body
            defined = {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))}
            defined |= {t.id for n in body if isinstance(n, ast.Assign) for t in n.targets  # flash_forward_tuned = ...
                        if isinstance(t, ast.Name)}
            assert name in defined, (path.name, key, "is not defined where it is named")
        protected, same = grading.integrity.protected_names(nb["cells"])
        for cell in nb["cells"]:
            meta = (cell.get("metadata") or {}).get("nbgrader") or {}
            if cell["cell_type"] == "code" and not meta.get("locked"):
                assert grading.integrity.integrity_findings("".join(cell["source"]), protected=protected, same=same,
                                                             answers=answers) == [], (path.name, meta.get("grade_id"))


# Rebinding is judged by what a cell binds at module level: comprehension variables, lambda and function
# parameters and names inside a def or class body bind no global.
@pytest.mark.parametrize("code", [
    "largest = str(max(int(check_product) for check_product in ['3', '5']))\n"
    "best = max({'1': 2}, key=lambda check_product: check_product)",  # the Task 8.3 answer's shape
    "xs = [check_product for check_product in range(3)]\nd = {check_product: 1 for check_product in 'ab'}",
    "s = {check_product for check_product in range(3)}",
    "def f(check_product):\n    check_product = 2\n    return check_product",
    "class A:\n    check_product = 1",
    "def f():\n    return [y := check_product for check_product in range(3)]",
])
def test_integrity_allows_local_names_that_shadow_a_read_only_name(code):
    assert grading.integrity.integrity_findings(code, protected=PROTECTED, same=SAME) == []


@pytest.mark.parametrize("code", [
    "check_product = 3", "for check_product in range(3):\n    pass", "check_product += 1",
    "import os as check_product", "with open('x') as check_product:\n    pass", "(check_product := 5)",
    "ys = [(check_product := j) for j in range(3)]", "del check_product", "a, check_product = 1, 2",
    "def f():\n    global check_product\n    check_product = 1",
])
def test_integrity_refuses_every_module_level_rebinding(code):
    assert any("replaces check_product" in f
               for f in grading.integrity.integrity_findings(code, protected=PROTECTED, same=SAME)), code


def test_a_task_7_3_answer_that_names_k_locally_is_run_by_grade_and_by_run():
    """Lesson 8's read-only table cell loops `for k, r in rows.items()` inside a generator: k is no global of it, and
    an answer may use k as its own comprehension variable or lambda parameter; both `grade` (prepare_submission) and
    `run` (integrity_notes) accept it."""
    nb = source_nb("08_feeding_the_gpu")
    protected, _ = grading.integrity.protected_names(nb["cells"])
    assert "k" not in protected
    answer = next(c for c in nb["cells"] if c.get("id") == "task-8-3-answer" or
                  (c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "task_8_3_answer"))
    answer["source"] = (
        'sliced = MPS["configs"]["time-slicing, batch 1"]\n'
        'largest = str(max(int(k) for k in sliced))\n'
        'mps_gain = MPS["configs"]["MPS, batch 1"][largest]["images_per_s"] / sliced[largest]["images_per_s"]\n'
        'batching_gain = (MPS["configs"]["MPS, batch 8"][largest]["images_per_s"]\n'
        '                 / MPS["configs"]["MPS, batch 1"][largest]["images_per_s"])\n'
        'best_k = int(max(sliced, key=lambda k: sliced[k]["images_per_s"]))\n')
    from gpucourse.grading.submissions import integrity_notes

    assert integrity_notes(nb["cells"]) == []
    answer["source"] += "k = 3\n"  # a real rebinding of a read-only name is still refused, by both
    protected.add("k")  # (as if a read-only cell bound k at module level)
    notes = [n for *_, n, why in grading.submissions.refused_cells(nb["cells"], protected, {}, {}) if why]
    assert notes == ["cell task_8_3_answer"], notes


def test_protected_names_of_lesson_1():
    protected, same = grading.integrity.protected_names(source_nb(L1)["cells"])
    assert {"math", "np", "gpucourse", "runtime", "rt", "cuda", "SMS", "hashlib", "complex_spec", "random_operands",
            "check_product", "run_kernel", "run_rows_kernel", "same_answer", "grading", "complex_multiply",
            "perf_inputs", "perf_check", "measure_launches"} <= protected
    assert {"isinstance", "globals", "bool", "float"} <= protected
    # test-cell variables, and those the read-only measuring cell keeps inside its function: the learner's to reuse
    assert not {"a", "b", "got", "want", "n", "d_out", "result", "sum", "out", "name", "model", "numbers",
                "cp", "ms", "few", "work"} & protected
    assert same["np"] == "numpy" and same["cuda"] == "numba.cuda" and same["complex_spec"].endswith(
        "vector_multiply.complex_spec") and same["complex_multiply"].endswith("vector_multiply.complex_multiply")


@pytest.mark.parametrize("lesson, functions, free", [
    ("06_inference_engine", {"model_graph", "compare_layer_classes", "g", "g_nodes"},  # g, g_nodes: Task 6.2 reads them
     {"_", "n", "b", "key", "cost", "peak", "steps", "shares", "classes", "engine", "speedup", "resnet"}),
    ("08_feeding_the_gpu", {"show_mps_table"}, {"name", "rows", "k", "r", "B", "S"}),
    ("09_training", {"measured_mib", "compare_schedules"}, {"name", "cps", "every", "model", "batch", "seen"}),
])
def test_read_only_measuring_cells_keep_their_variables_inside_a_function(lesson, functions, free):
    """A read-only cell that prints a table binds its function's name, not its loop variables: a learner's cell
    may use common names like name, model or key."""
    protected, _ = grading.integrity.protected_names(source_nb(lesson)["cells"])
    assert functions <= protected
    assert not free & protected, free & protected


@pytest.mark.parametrize("lesson, function", [
    ("02_warp_divergence", "compare_regrouping"), ("03_memory", "measure_strides"),
    ("04_tensor_cores", "compare_configs"), ("05_convolution", "compare_routes")])
def test_a_read_only_measuring_cell_leaves_common_names_to_the_learner(lesson, function):
    """The measuring cell after a lesson's last task keeps its arrays and loop variables inside a function: only
    that function's name is read-only, so a learner's own cell may still use n, out, cp, name, ... ."""
    protected, _ = grading.integrity.protected_names(source_nb(lesson)["cells"])
    assert function in protected
    assert not {"n", "a", "b", "out", "src", "times", "cp", "bench", "name", "t", "A", "B", "C", "row", "rows",
                "data", "source", "measured", "r", "build", "yours", "x", "y", "wt", "cols", "entry", "configs",
                "where", "mark", "IM2COL_ROW", "IMPLICIT_ROW"} & protected


# ------------------------------------------------------------------- verdicts (nbgrader's quirks)

def _graded_cell(source: str, outputs: list, grade_id: str = "test_x") -> dict:
    return {"cell_type": "code", "source": source, "outputs": outputs, "metadata": {"nbgrader": {
        "grade": True, "grade_id": grade_id, "locked": True, "points": 3, "solution": False}}}


def _value(text):
    return {"output_type": "execute_result", "data": {"text/plain": text}, "metadata": {}, "execution_count": 1}


@pytest.mark.parametrize("source, outputs, verdict", [
    ("check()\n1.5", [_value("1.5")], (1.5, "partial")),
    ("check()\n1.5", [_value("3.0"), _value("1.5")], (1.5, "partial")),  # the last value, not a forged first
    ("check()", [_value("3.0")], (3.0, "passed")),  # a value the test does not show is not a score
    ("check()\nx", [_value("-1")], (0.0, "failed")),  # nbgrader: full marks
    ("check()\nx", [_value("nan")], (0.0, "failed")),  # nbgrader: full marks
    ("check()\nx", [_value("7")], (0.0, "failed")),  # nbgrader: stops grading the notebook
    ("check()\nx", [_value("np.float64(0.5)")], (3.0, "passed")),  # not a plain number: nbgrader's full marks
    ("check()\nx", [_value("2"), {"output_type": "error", "ename": "AssertionError", "evalue": "no",
                                  "traceback": []}], (0.0, "failed")),  # an error anywhere counts
    ("check()", [{"output_type": "stream", "name": "stderr", "text": ""}], (0.0, "failed")),
])
def test_verdicts_are_deterministic_and_never_credit_forgeries(source, outputs, verdict):
    got_points, got_status, _ = grading.verdicts.cell_verdict(_graded_cell(source, outputs), 3.0, "cpu")
    assert (got_points, got_status) == verdict


def test_performance_tests_score_nothing_in_cpu_mode_whatever_they_show():
    cell = _graded_cell("performance_points()", [_value("3.0")], grade_id="perf_x")
    assert grading.verdicts.cell_verdict(cell, 3.0, "cpu")[:2] == (0.0, grading.NOT_GRADABLE)
    assert grading.verdicts.cell_verdict(cell, 3.0, "gpu")[:2] == (3.0, "passed")


def test_a_step_this_gpu_cannot_run_is_not_gradable_rather_than_failed(capsys):
    """gpucourse.gpus says which GPU each lesson step needs; a performance test of a step the GPU lacks a
    feature for says so in one line and is left out of the gradable total (tested with a stated compute
    capability, as a GPU of it would answer)."""
    assert grading.step_missing("04.wmma", 3.0, cc="9.0") is False and capsys.readouterr().out == ""
    assert grading.step_missing(None, 3.0) is False
    assert grading.step_missing("04.wmma", 3.0, cc="6.1") is True
    line = capsys.readouterr().out.strip()
    assert line.startswith("performance: not gradable on this GPU (") and "fp16-wmma" in line, line
    assert line.endswith("0 of 3 points given here"), line
    said = {"output_type": "stream", "name": "stdout", "text": line + "\n"}
    cell = _graded_cell("grading.performance_points(...)", [said, _value("0.0")], grade_id="perf_x")
    assert grading.verdicts.cell_verdict(cell, 3.0, "gpu") == (0.0, grading.NOT_GRADABLE_ARCH, line)
    assert not grading.TestResult("perf_x", 0.0, 3.0, grading.NOT_GRADABLE_ARCH, line).gradable
    with pytest.raises(runtime.CourseInputError, match="no lesson step"):
        grading.step_missing("04.no_such_step", 3.0, cc="9.0")


def test_asking_about_a_step_without_a_gpu_is_quiet(monkeypatch, capsys):
    """With no GPU (and no stated compute capability) there is nothing to ask: performance_points says "CPU
    mode" itself, so step_missing neither raises nor prints."""
    monkeypatch.delenv(runtime.FAKE_CC_VARIABLE, raising=False)
    if runtime.compute_capability() is not None:
        pytest.skip("this machine has a GPU: its steps are asked about for real")
    assert grading.step_missing("04.wmma", 3.0) is False and capsys.readouterr().out == ""


def test_a_multi_gpu_test_on_one_gpu_is_not_gradable_rather_than_failed():
    line = grading.GPUS_PERF_MESSAGE.format(needed=2, have=1, points=3)
    said = {"output_type": "stream", "name": "stdout", "text": line + "\n"}
    cell = _graded_cell("check_on_gpus()", [said], grade_id="perf_x")
    assert grading.verdicts.cell_verdict(cell, 3.0, "gpu") == (0.0, grading.NOT_GRADABLE_GPUS, line)
    assert grading.verdicts.cell_verdict(cell, 3.0, "cpu")[:2] == (0.0, grading.NOT_GRADABLE)
    assert not grading.TestResult("perf_x", 0.0, 3.0, grading.NOT_GRADABLE_GPUS, line).gradable
    # an ordinary test that prints the line is graded as usual, and an error is still a failure
    assert grading.verdicts.cell_verdict(_graded_cell("check()", [said]), 3.0, "gpu")[:2] == (3.0, "passed")
    error = {"output_type": "error", "ename": "AssertionError", "evalue": "no", "traceback": []}
    assert grading.verdicts.cell_verdict(_graded_cell("check()", [said, error], grade_id="perf_x"), 3.0, "gpu")[:2] \
        == (0.0, "failed")


# ------------------------------------------------------------------------- the kernel's audit hook

def _audited(code: str, tmp_path: Path) -> str:
    """Run ``code`` as notebook code (a file outside the trusted folders) under the kernel's audit hook in a
    fresh Python; return what it printed."""
    own = tmp_path / "own"
    own.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_text("hidden tests")
    cell = tmp_path / "cell.py"
    cell.write_text(textwrap.dedent(code))
    driver = f"""
import os, sys, ctypes
sys.path.insert(0, {str(REPO)!r})
from gpucourse import grading
trusted = [p.rstrip("/") + "/" for p in {{sys.prefix, sys.base_prefix, os.path.realpath(sys.prefix),
           os.path.realpath(sys.base_prefix), {str(REPO / "gpucourse")!r}}}]
os.chdir({str(own)!r})
code = compile(open({str(cell)!r}).read(), {str(cell)!r}, "exec")
grading.kernel._install_audit_hook(allow=[sys.prefix, sys.base_prefix, "/usr", "/proc", "/dev"],
                            deny=[{str(tmp_path)!r}], writable=[{str(own)!r}], trusted=trusted + ["<string>"],
                            ctypes_dir=os.path.dirname(ctypes.__file__) + "/")
ns = {{"SECRET": {str(secret)!r}}}
exec(code, ns)
"""
    done = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_audit_hook_refuses_what_static_checks_cannot_see(tmp_path):
    out = _audited("""
        import os
        def attempt(what, fn):
            try:
                fn()
                print(what, "allowed")
            except PermissionError as exc:
                print(what, "refused:", exc)
        attempt("read secret", lambda: open(SECRET).read())
        attempt("read via /proc", lambda: open("/proc/self/cwd/../secret.txt").read())
        attempt("symlink then read", lambda: (os.symlink(SECRET, "link"), open("link").read()))
        attempt("hard link", lambda: os.link(SECRET, "hard"))
        attempt("write outside", lambda: open("/tmp/gpucourse-audit-test", "w"))
        attempt("write own folder", lambda: open("mine.txt", "w").write("ok"))
        attempt("list parent", lambda: os.listdir(".."))
        attempt("spawn", lambda: __import__("subprocess").run(["true"]))
        attempt("signal parent", lambda: os.kill(os.getppid(), 0))
        attempt("socket", lambda: __import__("socket").create_connection(("127.0.0.1", 9)))
        attempt("ctypes", lambda: __import__("ctypes").CDLL(None))
        attempt("gc", lambda: __import__("gc").get_objects())
        attempt("trace", lambda: __import__("sys").settrace(None))
        attempt("exec", lambda: exec("1"))
        def f():
            pass
        attempt("replace code", lambda: setattr(f, "__code__", (lambda: 1).__code__))
        attempt("other process", lambda: open("/proc/1/environ").read())
        attempt("own memory", lambda: open("/proc/self/mem", "rb"))
        attempt("read python", lambda: open(os.__file__).read(10))
    """, tmp_path)
    lines = {}
    for line in out.splitlines():
        what, _, why = line.partition(" refused: ")
        lines[what.removesuffix(" allowed")] = why or "allowed"
    allowed = {k for k, v in lines.items() if v == "allowed"}
    assert allowed == {"write own folder", "read python"}, out
    assert lines["read secret"] == (f"the grader does not let a notebook read {tmp_path / 'secret.txt'} (it may "
                                    "read its own folder, Python and the system's files)")
    assert lines["write outside"] == "the grader lets a notebook write only in its own folder, not " \
        "/tmp/gpucourse-audit-test"
    assert lines["spawn"] == "the grader does not let a notebook start processes"
    assert lines["ctypes"] == "the grader does not let a notebook use ctypes"
    assert not Path("/tmp/gpucourse-audit-test").exists()


# ---------------------------------------------------------------- performance harness, without a GPU

def _inputs(n=4096):
    rng = np.random.default_rng()
    a = rng.random(n, dtype=np.float32)
    b = rng.random(n, dtype=np.float32)
    return a, b, np.empty_like(a)


class _HostClock:
    """A clock for host (NumPy) work, held from the start: the harness tested without a GPU."""

    def __init__(self):
        self.now = time.perf_counter_ns

    def verify(self) -> None:
        pass

    def time(self, fn, args: tuple) -> float:
        t0 = self.now()
        fn(*args)
        return (self.now() - t0) / 1e6

    def sample(self, x):
        return np.asarray(x)


def _check(a, b, out):
    return bool(np.array_equal(out, a * b))


def _reference(a, b, out):
    np.multiply(a, b, out=out)


def _measure(candidate, make_inputs=_inputs, **kw):
    return grading.performance._measure(candidate, _reference, make_inputs=make_inputs, check=_check,
                                        clock=_HostClock(), repeats=kw.pop("repeats", 5),
                                        warmup=kw.pop("warmup", 1), **kw)


def test_harness_makes_fresh_inputs_and_poisons_every_run():
    seen = []

    def make():
        args = _inputs()
        seen.append(args)
        return args

    entry = []

    def candidate(a, b, out):
        entry.append(bool(np.isnan(out).all()))
        _reference(a, b, out)

    times = _measure(candidate, make_inputs=make)
    assert len(seen) == 2 * (1 + 1 + 5)  # warm-up, probe and repeats, for both
    assert len({id(a) for a, _, _ in seen}) == len(seen)
    assert entry == [True] * 7  # the output was poisoned before every run of the candidate
    assert len(times["candidate"]) == len(times["reference"]) == 5


def test_performance_catches_a_cache():
    cache = {}

    def cached(a, b, out):
        if a.shape in cache:
            out[:] = cache[a.shape]
            return
        _reference(a, b, out)
        cache[a.shape] = out.copy()

    with pytest.raises(grading.performance._WrongOutput, match="your code gave a wrong result on run 4"):
        _measure(cached)


def test_performance_catches_deferred_work():
    pending = []

    def deferred(a, b, out):  # does the previous call's work: always one run behind
        if pending:
            pa, pb, pout = pending.pop()
            _reference(pa, pb, pout)
        pending.append((a, b, out))

    with pytest.raises(grading.performance._WrongOutput, match="your code gave a wrong result on run 2"):
        _measure(deferred)


def test_performance_catches_a_wrong_result_on_any_run():
    calls = []

    def sometimes(a, b, out):
        calls.append(1)
        _reference(a, b, out)
        if len(calls) == 5:
            out[-1] = 0

    with pytest.raises(grading.performance._WrongOutput, match="wrong result on run 10"):
        _measure(sometimes)


def test_performance_refuses_repeated_inputs():
    fixed = _inputs()

    with pytest.raises(runtime.CourseError, match="make_inputs gave the same inputs twice in a row"):
        _measure(_reference, make_inputs=lambda: (fixed[0], fixed[1], np.empty_like(fixed[0])))


def test_performance_clock_cannot_be_patched_by_the_candidate(monkeypatch):
    def sleepy_liar(a, b, out):
        _reference(a, b, out)
        time.sleep(0.02)
        monkeypatch.setattr(time, "perf_counter_ns", lambda: 0)

    times = _measure(sleepy_liar, repeats=3)
    assert min(times["candidate"]) >= 19.0 and max(times["reference"]) < 19.0, times


def test_cuda_clock_refuses_replaced_timing_functions(monkeypatch):
    cp = pytest.importorskip("cupy")
    grading.performance._CudaClock(cp).verify()  # CuPy's own functions pass, GPU or not
    clock = grading.performance._CudaClock(cp)
    monkeypatch.setattr(cp.cuda.runtime, "eventElapsedTime", lambda start, end: 1e-6)
    with pytest.raises(grading.performance._Tampered, match="replaced cupy.cuda.runtime.eventElapsedTime while it was being timed"):
        clock.verify()
    with pytest.raises(grading.performance._Tampered, match="cupy.cuda.runtime.eventElapsedTime is not CuPy's own function"):
        grading.performance._CudaClock(cp)


# ------------------------------------------------------------------ performance harness, on a GPU

@pytest.mark.gpu
def test_gpu_known_wrong_and_gamed_candidates(capsys):
    """The real reference kernel against candidates that are wrong, slow, cached, deferred, run on another
    stream, or patch the clock: each gets the points its real work earns."""
    import cupy as cp

    from kernels.vector_multiply import multiply

    cuda = runtime.cuda()
    sms = runtime.get().device["sms"]

    @cuda.jit
    def grid_stride(a, b, out):
        start, stride = cuda.grid(1), cuda.gridsize(1)
        for i in range(start, out.size, stride):
            out[i] = a[i] * b[i]

    @cuda.jit
    def skips_last(a, b, out):
        start, stride = cuda.grid(1), cuda.gridsize(1)
        for i in range(start, out.size - 1, stride):
            out[i] = a[i] * b[i]

    def good(a, b, out):
        grid_stride[32 * sms, 256](a, b, out)
        return out

    def slow(a, b, out):
        grid_stride[1, 32](a, b, out)
        return out

    def wrong(a, b, out):
        skips_last[32 * sms, 256](a, b, out)
        return out

    cache = {}

    def cached(a, b, out):
        if out.shape in cache:
            out[...] = cache[out.shape]
            return out
        good(a, b, out)
        cache[out.shape] = out.copy()
        return out

    pending = []

    def deferred(a, b, out):
        if pending:
            good(*pending.pop())
        pending.append((a, b, out))
        return out

    side = cp.cuda.Stream(non_blocking=True)  # does not wait for, nor is waited for by, the default stream
    numba_side = cuda.external_stream(side.ptr)

    def other_stream(a, b, out):
        grid_stride[32 * sms, 256, numba_side](a, b, out)
        return out

    real = cp.cuda.runtime.eventElapsedTime

    def patches_clock(a, b, out):
        cp.cuda.runtime.eventElapsedTime = lambda start, end: 1e-6
        return good(a, b, out)

    def inputs():
        a = cp.random.random(2**26, dtype=cp.float32)
        b = cp.random.random(2**26, dtype=cp.float32)
        return a, b, cp.empty_like(a)

    def check(a, b, out):
        return bool((out == a * b).all())

    def score(candidate):
        got = grading.performance_points(candidate, multiply, make_inputs=inputs, check=check, max_points=3)
        return got, capsys.readouterr().out.strip()

    results = {}
    try:
        for fn in (good, slow, wrong, cached, deferred, other_stream, patches_clock):
            results[fn.__name__] = score(fn)
    finally:
        cp.cuda.runtime.eventElapsedTime = real
        with capsys.disabled():
            print("".join(f"\n{name}: {got} | {said}" for name, (got, said) in results.items()))
    assert results["good"][0] >= 2.5, results["good"]
    assert results["slow"][0] == 0.0 and "ratio" in results["slow"][1], results["slow"]
    for name in ("wrong", "cached", "deferred"):
        assert results[name][0] == 0.0, results[name]
        assert "gave a wrong result on run" in results[name][1], results[name]
    ratio = float(results["other_stream"][1].split("ratio ")[1].split()[0])
    assert ratio > 0.8, results["other_stream"]  # its work was timed, not skipped
    assert results["patches_clock"] == (0.0, "performance: the notebook replaced cupy.cuda.runtime.eventElapsedTime "
                                             "while it was being timed; 0 of 3 points"), results["patches_clock"]


ALL_LESSONS = sorted(p.name for p in grading.SOLUTIONS.iterdir() if list(p.glob("*.ipynb")))


@pytest.mark.gpu
@pytest.mark.parametrize("lesson", ALL_LESSONS)
def test_gpu_solution_gets_every_point_in_the_guarded_kernel(tmp_path, lesson):
    """Every lesson's exercise, filled in with its solution's answers, graded in GPU mode: every test passes and
    every performance test is timed against the reference on this GPU (the answer is the reference's own code, so
    its ratio is about 1: at least half the points, allowing for noise); only a test that needs more GPUs than
    this machine has is not gradable here."""
    if lesson == "09_training":
        pytest.importorskip("tensorflow", reason="Task 9.5 needs TensorFlow, which this machine lacks")
    nb = filled_exercise(lesson)
    path = tmp_path / lesson / next((grading.SOLUTIONS / lesson).glob("*.ipynb")).name
    path.parent.mkdir()
    path.write_text(json.dumps(nb))
    report = grading.grade(path, mode="gpu", notebook_timeout=900)
    assert report.mode == "gpu", report.format()
    gpus = runtime.cupy().cuda.runtime.getDeviceCount()
    for t in report.tests:
        if not t.gradable:
            assert t.status == grading.settings.NOT_GRADABLE_GPUS and gpus < 2, report.format()
        elif t.message.startswith("performance:"):  # a timed perf_ test (a perf_ test may check results only)
            assert t.points >= t.max_points / 2, report.format()
        else:
            assert t.points == t.max_points, report.format()


# ------------------------------------------------------------------------------ class-scale timing

def test_one_submission_grades_within_30_seconds(tmp_path):
    path = tmp_path / L1 / "vector_multiply.ipynb"
    path.parent.mkdir()
    path.write_text(json.dumps(filled_exercise(L1)))
    t0 = time.monotonic()
    report = grading.grade(path, mode="cpu")
    seconds = time.monotonic() - t0
    print(f"one submission graded in {seconds:.1f} s")
    assert report.score == gradable(L1)
    assert seconds < 30


def test_class_of_50_within_10_minutes_on_2_cores(tmp_path):
    """A class of 50 submissions of lesson 1: 40 working, 5 not started, 5 with a wrong kernel. About 2.5
    minutes on 2 cores."""
    folder = tmp_path / "submitted"
    expected = {}
    for k in range(50):
        nb = filled_exercise(L1)
        if k % 10 == 7:
            nb = json.loads(next((grading.EXERCISES / L1).glob("*.ipynb")).read_text())
            expected[f"student{k:02d}"] = 0
        elif k % 10 == 3:
            l1_nan(nb, None)  # Task 1.1's kernel writes NaN: both of its tests fail
            expected[f"student{k:02d}"] = (gradable(L1) - points(L1)["test_1_1_kernel"]
                                           - points(L1)["test_1_1_small_grids"])
        else:
            expected[f"student{k:02d}"] = gradable(L1)
        sub = folder / f"student{k:02d}" / L1
        sub.mkdir(parents=True)
        (sub / "vector_multiply.ipynb").write_text(json.dumps(nb))
    lines = []
    t0 = time.monotonic()
    report = grading.grade_class(folder, course_dir=tmp_path / "course", mode="cpu", workers=2,
                                 progress=lambda line: (lines.append(line), print(line, flush=True)))
    seconds = time.monotonic() - t0
    print(f"class of 50 graded in {seconds:.0f} s; slowest notebook "
          f"{max(r.seconds for r in report.reports.values()):.1f} s")
    assert report.errors == {}
    assert {s: r.score for s, r in report.reports.items()} == expected
    assert sum(line.startswith("[") for line in lines) == 50
    assert seconds < 600
    assert max(r.seconds for r in report.reports.values()) < 30
    with open(report.csv) as f:
        assert len(list(csv.DictReader(f))) == 50


def test_a_test_this_machine_lacks_the_software_for_is_not_gradable_rather_than_failed(capsys):
    """A test of something this machine lacks the software for (Triton's kernels without a GPU or PyTorch) says so
    in one line and is left out of the gradable total, performance test or not; a test whose source does not ask
    (software_missing) is graded as usual when it prints the same line, and an error is still a failure."""
    assert grading.software_missing(None, 3.0) is False and capsys.readouterr().out == ""
    assert grading.software_missing("Triton's kernels need triton and PyTorch,\n and torch is not installed", 3) is True
    line = capsys.readouterr().out.strip()
    assert line == ("not gradable here: Triton's kernels need triton and PyTorch, and torch is not installed; "
                    "0 of 3 points given here"), line
    said = {"output_type": "stream", "name": "stdout", "text": line + "\n"}
    asks = "if not grading.software_missing(TRITON, 3):\n    check()"
    for grade_id in ("test_x", "perf_x"):
        cell = _graded_cell(asks, [said], grade_id=grade_id)
        assert grading.verdicts.cell_verdict(cell, 3.0, "gpu") == (0.0, grading.NOT_GRADABLE_SOFTWARE, line)
    verdict = grading.verdicts.cell_verdict
    assert verdict(_graded_cell(asks, [said]), 3.0, "cpu")[:2] == (0.0, grading.NOT_GRADABLE_SOFTWARE)
    assert verdict(_graded_cell(asks, [said], "perf_x"), 3.0, "cpu")[:2] == (0.0, grading.NOT_GRADABLE)  # needs a GPU
    assert not grading.TestResult("test_x", 0.0, 3.0, grading.NOT_GRADABLE_SOFTWARE, line).gradable
    assert grading.verdicts.cell_verdict(_graded_cell("check()", [said]), 3.0, "cpu")[:2] == (3.0, "passed")
    error = {"output_type": "error", "ename": "AssertionError", "evalue": "no", "traceback": []}
    assert grading.verdicts.cell_verdict(_graded_cell(asks, [said, error]), 3.0, "cpu")[:2] == (0.0, "failed")
    report = grading.GradeReport("x.ipynb", "10_attention", "cpu", tests=[
        grading.TestResult("test_a", 2.0, 2.0, "passed", ""),
        grading.TestResult("test_x", 0.0, 3.0, grading.NOT_GRADABLE_SOFTWARE, line)])
    assert report.gradable_max_score == 2.0
    assert "3 points need software this machine lacks and were not given" in report.format(), report.format()


def test_a_test_of_results_on_more_gpus_than_this_machine_has_is_not_gradable_rather_than_failed(capsys):
    """A test of results that only a machine with several GPUs can check (grading.needs_gpus) says so in one line
    and is left out of the gradable total in either mode; a test whose source does not ask is graded as usual when
    it prints the same line, and an error is still a failure."""
    from gpucourse import runtime

    have = runtime.gpu_count()
    assert grading.needs_gpus(have, 2.0) is False and capsys.readouterr().out == ""
    assert grading.needs_gpus(have + 1, 2) is True
    line = capsys.readouterr().out.strip()
    assert line == f"not gradable on this machine (needs {have + 1} GPUs, it has {have}); 0 of 2 points given here"
    said = {"output_type": "stream", "name": "stdout", "text": line + "\n"}
    asks = "if not grading.needs_gpus(2, 2):\n    check()"
    verdict = grading.verdicts.cell_verdict
    for mode in ("cpu", "gpu"):
        assert verdict(_graded_cell(asks, [said]), 2.0, mode) == (0.0, grading.NOT_GRADABLE_GPUS, line)
    assert verdict(_graded_cell("check()", [said]), 2.0, "cpu")[:2] == (2.0, "passed")
    error = {"output_type": "error", "ename": "AssertionError", "evalue": "no", "traceback": []}
    assert verdict(_graded_cell(asks, [said, error]), 2.0, "cpu")[:2] == (0.0, "failed")
    report = grading.GradeReport("x.ipynb", "07_collectives", "cpu", tests=[
        grading.TestResult("test_a", 2.0, 2.0, "passed", ""),
        grading.TestResult("test_x", 0.0, 2.0, grading.NOT_GRADABLE_GPUS, line)])
    assert report.gradable_max_score == 2.0
    assert "2 points need more GPUs and were not given" in report.format(), report.format()

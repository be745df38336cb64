"""What a learner reads from the course's commands: grading a copy outside a lesson-named folder says which folder
to make; no kernel transport warning reaches them from `run` or `grade`; `run` lists an exercise's tests by name
with pass or FAIL and the failing assertion's message, as `grade` reports them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from gpucourse import cli, grading, notebooks, runtime

ROOT = Path(__file__).resolve().parents[1]
WARNING = "without encryption"  # ipykernel 7: "Kernel is running over TCP without encryption. ..."


def _course(*args, cwd=ROOT, timeout=600) -> subprocess.CompletedProcess:
    """`python -m gpucourse ARGS` as a learner types it, from the repository's root."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "gpucourse", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


# ---------------------------------------------------------------------------------------- the folder to make

def _copy(exercise: str, folder: Path, name: str | None = None) -> Path:
    src = next((grading.EXERCISES / exercise).glob("*.ipynb"))
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(src, folder / (name or src.name)))


def test_grading_outside_a_lesson_folder_says_which_folder_to_make(tmp_path, capsys):
    copy = _copy("06_inference_engine", tmp_path / "my_work")
    with pytest.raises(runtime.CourseInputError) as err:  # said before anything is graded
        grading.grade(copy)
    message = str(err.value)
    assert "Put it in a folder named 06_inference_engine (06_inference_engine/inference_engine.ipynb)" in message
    assert "solution" not in message.lower() and "looked for" not in message
    # the same from the command line, on stderr, exit status 2
    assert cli.main(["grade", "--mode", "cpu", str(copy)]) == 2
    assert "folder named 06_inference_engine" in capsys.readouterr().err


def test_a_notebook_no_lesson_has_gets_the_lessons_named(tmp_path):
    copy = _copy("01_vector_multiply", tmp_path / "homework", name="my_kernel.ipynb")
    with pytest.raises(runtime.CourseInputError) as err:
        grading.grade(copy)
    message = str(err.value)
    lessons = sorted(p.name for p in grading.EXERCISES.iterdir() if p.is_dir())
    assert "put the notebook in a folder named after its lesson, e.g. 01_vector_multiply/vector_multiply.ipynb" \
        in message
    assert f"(the lessons: {', '.join(lessons)})" in message and "solution" not in message.lower()


def test_a_lesson_folder_with_another_name_in_it_gets_the_exercise_name(tmp_path):
    copy = _copy("02_warp_divergence", tmp_path / "02_warp_divergence", name="mine.ipynb")
    with pytest.raises(runtime.CourseInputError) as err:
        grading.grade(copy)
    assert "named warp_divergence.ipynb" in str(err.value) and "solution" not in str(err.value).lower()


# ------------------------------------------------------------------------------------ the transport warning

def test_the_course_kernels_talk_over_ipc():
    """IPC where the platform has it: a private folder with a short path (Unix sockets), removed with the kernel."""
    import asyncio

    from gpucourse.jupyter import CourseKernelManager

    if os.name != "posix":
        pytest.skip("IPC transport is for POSIX systems; elsewhere the kernels get CurveZMQ keys")
    km = CourseKernelManager(kernel_name="python3")
    folder = Path(km.connection_file).parent
    assert km.transport == "ipc" and km.ip == str(folder / "kernel-ipc") and len(km.ip) < 90
    assert folder.is_dir() and folder.name.startswith("gpucourse-kernel-")
    asyncio.run(km.cleanup_resources())
    assert not folder.exists()


def test_run_prints_no_kernel_transport_warning(tmp_path, capfd):
    """The kernel writes its warnings to the terminal `run` was started from (file descriptor 2, captured here)."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('ran', 6 * 7)")])
    nbformat.write(nb, tmp_path / "tiny.ipynb")
    assert cli.main(["run", "--mode", "cpu", str(tmp_path / "tiny.ipynb")]) == 0
    out, err = capfd.readouterr()
    assert "1 passed, 0 failed" in out
    assert WARNING not in out + err and "IPKernelApp" not in out + err


# ------------------------------------------------------------------------------ run lists a notebook's tests

def _tested_notebook(path: Path) -> Path:
    """A small notebook shaped as nbgrader's exercises are: a helper cell, an answer, three tests, then a cell that
    fails outside any test and a test after it."""
    def cell(source, grade_id, *, grade=False, solution=False, points=0):
        c = nbformat.v4.new_code_cell(source)
        c.metadata["nbgrader"] = {"grade": grade, "grade_id": grade_id, "locked": not solution, "points": points,
                                  "schema_version": 3, "solution": solution, "task": False}
        return c

    nb = nbformat.v4.new_notebook(cells=[
        cell("import warnings\nx = 1", "setup"),
        cell("def answer():\n    raise NotImplementedError()", "task_answer", solution=True),
        cell("assert x == 2, f'x should be 2, not {x}'", "test_x_is_two", grade=True, points=2),
        cell("assert x == 1\nwarnings.warn('a warning is no failure')", "test_x_is_one", grade=True, points=1),
        cell("answer()", "test_answer", grade=True, points=3),
        nbformat.v4.new_code_cell("raise ValueError('boom outside the tests')"),
        cell("assert True", "test_after", grade=True, points=1),
    ])
    nbformat.write(nb, path)
    return path


def test_run_goes_on_past_failing_tests_and_stops_at_any_other_error(tmp_path):
    path = _tested_notebook(tmp_path / "tested.ipynb")
    out = tmp_path / "out"
    o = notebooks.execute(path, mode="cpu", timeout=120, save_to=out)
    assert not o.ok and o.tested
    assert o.error == "cell 5: ValueError: boom outside the tests"
    got = {t.grade_id: (t.status, t.points, t.message) for t in o.tests}
    assert got["test_x_is_two"] == ("failed", 0.0, "AssertionError: x should be 2, not 1")
    assert got["test_x_is_one"][:2] == ("passed", 1.0)
    assert got["test_answer"][:2] == ("failed", 0.0) and got["test_answer"][2].startswith("NotImplementedError")
    assert got["test_after"][0] == "not run"
    text = o.report().checklist()
    assert "1 of 4 tests pass (CPU mode)" in text.splitlines()[0]
    line = next(line for line in text.splitlines() if "test_x_is_two" in line)
    assert line.split()[1:] == ["0", "/", "2", "FAIL", "AssertionError:", "x", "should", "be", "2,", "not", "1"]
    assert "pass" in next(line for line in text.splitlines() if "test_x_is_one" in line).split()
    # the saved copy is the notebook as executed, without the tag that let its tests go on
    saved = nbformat.read(out / "tested.ipynb", as_version=4)
    assert not any("tags" in c.metadata for c in saved.cells) and saved.cells[2].outputs


@pytest.mark.slow
def test_run_lists_an_exercises_tests_and_grade_adds_the_hidden_ones(tmp_path):
    """What an exercise notebook's first cell promises: `run` on the unsolved exercise lists every test as FAIL
    with the error's message; on the solution, every test passes; neither prints the transport warning, nor does
    `grade`."""
    lesson = "01_vector_multiply"
    copy = _copy(lesson, tmp_path / lesson)
    done = _course("run", "--mode", "cpu", str(copy), cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("  test_")]
    assert len(rows) == 9 and all(r[4] == "FAIL" for r in rows), done.stdout
    assert all(("NotImplementedError" in " ".join(r)) or ("AssertionError" in " ".join(r)) for r in rows), rows
    assert "0 of 9 tests pass (CPU mode)" in done.stdout
    assert f"`python -m gpucourse grade {copy}` adds the hidden tests and gives your score" in done.stdout
    assert WARNING not in out

    solution = next((grading.SOLUTIONS / lesson).glob("*.ipynb"))
    done = _course("run", "--mode", "cpu", str(solution.relative_to(ROOT)))
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("  test_")]
    assert done.returncode == 0 and len(rows) == 9 and all(r[4] == "pass" for r in rows), done.stdout + done.stderr
    assert "9 of 9 tests pass" in done.stdout and WARNING not in done.stdout + done.stderr

    done = _course("grade", "--mode", "cpu", str(copy), cwd=tmp_path)
    assert done.returncode == 0 and "Score: 0 / 15  (0 / 12 gradable here" in done.stdout, done.stdout + done.stderr
    assert WARNING not in done.stdout + done.stderr


# ------------------------------------------------------------------------------ JupyterLab without the news prompt

def test_lab_settings_turn_the_news_prompt_off_and_keep_the_environments_own(tmp_path):
    """The course's JupyterLab settings folder: fetchNews "false" (no prompt) on top of what the environment's own
    application settings folder held (its overrides, its page config)."""
    import json

    from gpucourse import jupyter

    base = tmp_path / "share" / "jupyter" / "lab" / "settings"
    base.mkdir(parents=True)
    (base.parent / "static").mkdir()
    (base / "overrides.json").write_text(json.dumps({
        jupyter.NOTIFICATION: {"doNotDisturbMode": True, "fetchNews": "true"},
        "@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"}}))
    (base / "page_config.json").write_text('{"disabledExtensions": {"@x/y": true}}')
    folder = jupyter.write_lab_settings(tmp_path / "lab" / "settings", base=base)
    overrides = json.loads((folder / "overrides.json").read_text())
    assert overrides[jupyter.NOTIFICATION] == {"doNotDisturbMode": True, "fetchNews": "false", "checkForUpdates": False}
    assert overrides["@jupyterlab/apputils-extension:themes"] == {"theme": "JupyterLab Dark"}
    assert (folder / "page_config.json").read_text() == (base / "page_config.json").read_text()
    assert (folder.parent / "static").resolve() == (base.parent / "static").resolve()
    # an environment without a settings folder of its own: the course's overrides alone
    alone = jupyter.write_lab_settings(tmp_path / "alone", base=tmp_path / "nowhere")
    assert json.loads((alone / "overrides.json").read_text()) == jupyter.LAB_OVERRIDES


def test_lab_opens_on_the_course_settings(tmp_path):
    from gpucourse import jupyter

    settings = jupyter.write_lab_settings(tmp_path / "settings")
    cmd, _ = cli.lab_command(["--no-browser"], euid=1000, settings=settings)
    assert cmd[1:5] == ["-m", "jupyter", "lab", "--no-browser"]
    assert f"--LabApp.app_settings_dir={settings}" in cmd
    cmd, _ = cli.lab_command([f"--LabApp.app_settings_dir={tmp_path}"], euid=1000, settings=settings)
    assert [a for a in cmd if a.startswith("--LabApp.app_settings_dir")] == [f"--LabApp.app_settings_dir={tmp_path}"]

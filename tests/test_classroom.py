"""The instructor's flow with nbgrader's own commands and the repository's nbgrader_config.py:
generate, collect, autograde into the SQLite gradebook, export CSV, feedback HTML."""
import csv
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSON = "01_vector_multiply"


def nbgrader(course: Path, *args: str) -> None:
    env = dict(os.environ, GPUCOURSE_MODE="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PATH=os.pathsep.join([sysconfig.get_path("scripts"), os.environ["PATH"]]))
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"


@pytest.mark.slow
def test_classroom_flow(tmp_path):
    course = tmp_path / "course"
    course.mkdir()
    for item in ("nbgrader_config.py", "solutions", "exercises"):
        (shutil.copytree if (ROOT / item).is_dir() else shutil.copy)(ROOT / item, course / item)
    released = (course / f"exercises/{LESSON}/vector_multiply.ipynb").read_bytes()

    nbgrader(course, "generate_assignment", LESSON, "--force")
    assert (course / f"exercises/{LESSON}/vector_multiply.ipynb").read_bytes() == released
    for student, notebook in (("alice", "solutions"), ("bob", "exercises")):
        folder = course / "submitted" / student / LESSON
        folder.mkdir(parents=True)
        shutil.copy(course / notebook / LESSON / "vector_multiply.ipynb", folder)
        nbgrader(course, "db", "student", "add", student)
    nbgrader(course, "autograde", LESSON, "--force")
    nbgrader(course, "export")
    nbgrader(course, "generate_feedback", LESSON)

    with open(course / "grades.csv") as f:
        scores = {row["student_id"]: (float(row["score"]), float(row["max_score"])) for row in csv.DictReader(f)}
    assert scores == {"alice": (12.0, 15.0), "bob": (0.0, 15.0)}  # CPU mode: no performance points
    feedback = (course / f"feedback/bob/{LESSON}/vector_multiply.html").read_text()
    assert "NotImplementedError" in feedback and "test_1_2_gbps" in feedback
    assert (course / "gradebook.db").is_file()

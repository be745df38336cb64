"""Every place that names a lesson by its number names the right one.

The lessons are numbered by their core notebooks, notebooks/NN_topic.ipynb, 1 to N without a gap, and
gpucourse.gpus.LESSONS says the same. A lesson inserted in the middle moves the ones after it up by one
(tools/renumber_lessons.py does it in one pass); these tests fail on anything left with an old number: a slug
(``NN_topic``), a folder, a pytest marker, a notebook's title, a task or test id of a solution, a GPU step key,
the README's lesson table, or "lesson N (title)" naming another lesson's title.
"""
from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from gpucourse import gpus

ROOT = Path(__file__).resolve().parents[1]
CORE = re.compile(r"^(\d\d)_([a-z_]+?)(?:_deep_dive)?\.ipynb$")


def _lessons() -> dict:
    """{topic: number} from the core notebooks."""
    out = {}
    for p in sorted((ROOT / "notebooks").glob("*.ipynb")):
        m = CORE.match(p.name)
        if m and not p.stem.endswith("_deep_dive"):
            out[m[2]] = int(m[1])
    return out


LESSONS = _lessons()
TOPICS = "|".join(sorted(LESSONS, key=len, reverse=True))
SLUG = re.compile(rf"(?<![0-9A-Za-z.])(\d\d)_({TOPICS})(?![a-z])")


def _tracked_text():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    for f in files:
        p = ROOT / f
        if p.suffix in (".npz", ".png", ".whl") or not p.is_file():
            continue
        try:
            yield f, p.read_text()
        except UnicodeDecodeError:
            continue


def test_the_lessons_are_numbered_one_to_n_without_a_gap():
    numbers = sorted(LESSONS.values())
    assert numbers == list(range(1, len(numbers) + 1)), f"core notebooks numbered {numbers}"
    assert sorted(int(k) for k in gpus.LESSONS) == numbers, "gpucourse.gpus.LESSONS disagrees with notebooks/"
    for topic, n in LESSONS.items():
        name = gpus.LESSONS[f"{n:02d}"].lower().replace(" ", "_")
        assert topic.startswith(name.split("_")[0]), f"gpus.LESSONS[{n:02d}] is {name!r}, notebooks/ says {topic}"


def test_every_lesson_folder_and_file_has_its_number():
    wrong = []
    for f, _ in _tracked_text():
        for part in f.split("/"):
            m = SLUG.search(part)
            if m and int(m[1]) != LESSONS[m[2]]:
                wrong.append(f)
    assert not wrong, f"paths with a stale lesson number: {wrong}"


def test_every_slug_in_every_file_has_its_lessons_number():
    wrong = []
    for f, text in _tracked_text():
        for m in SLUG.finditer(text):
            if int(m[1]) != LESSONS[m[2]]:
                wrong.append(f"{f}: {m[0]}")
    assert not wrong, "stale lesson slugs: " + "; ".join(wrong[:20])


def test_markers_name_their_lessons():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    markers = {m.split(":")[0]: m.split(":", 1)[1] for m in conf if m.startswith("lesson")}
    assert sorted(markers) == [f"lesson{n:02d}" for n in sorted(LESSONS.values())]
    for marker, text in markers.items():
        n = int(marker[len("lesson"):])
        assert text.strip().startswith(f"lesson {n},"), f"{marker}: {text}"
    wrong = []
    for f in (ROOT / "tests").glob("test_[0-9][0-9]_*.py"):
        n = int(f.name[5:7])
        for m in re.finditer(r"mark\.lesson(\d\d)\b", f.read_text()):
            if int(m[1]) != n:
                wrong.append(f"{f.name}: lesson{m[1]}")
    assert not wrong, f"test files marked with another lesson: {wrong}"


@pytest.mark.parametrize("topic", sorted(LESSONS))
def test_a_lessons_notebooks_and_tasks_carry_its_number(topic):
    import json

    n = LESSONS[topic]
    wrong = []
    for nb in sorted((ROOT / "notebooks").glob(f"{n:02d}_{topic}*.ipynb")):
        first = "".join(json.loads(nb.read_text())["cells"][0]["source"])
        m = re.match(r"#\s*Lesson (\d+)\b", first)
        if not m or int(m[1]) != n:
            wrong.append(f"{nb.name} opens {first[:40]!r}")
    for nb in sorted((ROOT / "solutions" / f"{n:02d}_{topic}").glob("*.ipynb")) + sorted(
            (ROOT / "exercises" / f"{n:02d}_{topic}").glob("*.ipynb")):
        text = nb.read_text()
        m = re.search(r"#\s*Lesson (\d+)\b", text)
        if not m or int(m[1]) != n:
            wrong.append(f"{nb.relative_to(ROOT)} has no '# Lesson {n}' title")
        for m in re.finditer(r"\bTasks? (\d+)\.\d+", text):
            if int(m[1]) != n:
                wrong.append(f"{nb.relative_to(ROOT)}: {m[0]}")
        for m in re.finditer(r"\b(?:test|perf|task)([_-])(\d+)\1\d+", text):
            if int(m[2]) != n:
                wrong.append(f"{nb.relative_to(ROOT)}: {m[0]}")
    assert not wrong, "; ".join(wrong[:20])


def test_gpu_steps_belong_to_their_lessons():
    for key, step in gpus.STEPS.items():
        n = int(key.split(".")[0])
        assert f"{n:02d}" in gpus.LESSONS, key
        m = re.match(r"lesson (\d+)'s", step.what)
        assert m and int(m[1]) == n, f"step {key} says {step.what!r}"


def _titles() -> dict:
    """{number: words that name that lesson alone}, from gpus.LESSONS."""
    return {int(k): v.lower() for k, v in gpus.LESSONS.items()}


def test_lesson_n_followed_by_a_lesson_name_is_that_lesson():
    names = _titles()
    by_name = {v: k for k, v in names.items()}
    pattern = re.compile(r"\b[Ll]esson (\d+)(?:'s)? \(([^)]{3,40})\)")
    wrong = []
    for f, text in _tracked_text():
        for m in pattern.finditer(text):
            said = m[2].lower().strip()
            if said in by_name and by_name[said] != int(m[1]):
                wrong.append(f"{f}: {m[0]}")
    assert not wrong, "; ".join(wrong[:20])


def test_the_readme_table_lists_each_lesson_at_its_number():
    rows = re.findall(r"^\| (\d+) \| \[[^\]]+\]\(notebooks/(\d\d)_([a-z_]+)\.ipynb\)", (ROOT / "README.md").read_text(),
                      re.M)
    assert [(int(a), int(b), c) for a, b, c in rows] == sorted((n, n, t) for t, n in LESSONS.items())

"""Renumber the course's lessons after a lesson is inserted, in one pass over every tracked file.

    python tools/renumber_lessons.py            # rename files and rewrite references (git mv + in-place edits)
    python tools/renumber_lessons.py --dry-run  # list what would change

OLD gives each lesson's number before the change, NEW after it. The script rewrites every way the course names a
lesson by its number: slugs (``NN_topic``), pytest markers (``lessonNN``), "lesson 9" / "lessons 3, 4 and 9" /
"Lesson 9's", "Task 9.6" / "Tasks 8.2 and 8.4", test and cell ids (``test_9_6_forward``, ``task_7_3_answer``),
gpucourse.gpus step keys (``"09.wgmma"``) and lesson keys (``"09":``), "notebook 09" / "09 deep dive", and the
README's lesson table. Files of the inserted lesson (NEW_FILES) are written with the new numbers already and are
left alone. tests/test_lesson_numbers.py then fails on any stale number that remains.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

OLD = {"vector_multiply": 1, "warp_divergence": 2, "tensor_cores": 3, "convolution": 4, "inference_engine": 5,
       "collectives": 6, "feeding_the_gpu": 7, "training": 8, "attention": 9}
NEW = {"vector_multiply": 1, "warp_divergence": 2, "memory": 3, "tensor_cores": 4, "convolution": 5,
       "inference_engine": 6, "collectives": 7, "feeding_the_gpu": 8, "training": 9, "attention": 10}
SHIFT = {OLD[t]: NEW[t] for t in OLD}
INSERTED = [t for t in NEW if t not in OLD]
# the inserted lesson's own files, written with the new numbers (a path containing one of these is left alone)
NEW_FILES = tuple(f"{NEW[t]:02d}_{t}" for t in INSERTED) + tuple(f"/{t}." for t in INSERTED) + tuple(
    f"/{t}_" for t in INSERTED) + ("tools/renumber_lessons.py", "tests/test_lesson_numbers.py")
# a line of a shared file that names the inserted lesson is written with the new numbers too
NEW_LINE = re.compile("|".join(rf"\b{NEW[t]:02d}_{t}\b|\bkernels\.{t}\b|\bbenchmarks\.{t}\b|\b{t}_model\b"
                               for t in INSERTED))

SEP = r"(?:\s*(?:,|and|or|to|-|–|&)\s*)"
SLUG = re.compile(r"(?<![0-9A-Za-z.])0([1-9])_(?=[a-z])")
MARKER = re.compile(r"\blesson0([1-9])\b")
LESSON = re.compile(rf"\b([Ll]essons?[ -])(\d+(?:{SEP}\d+)*)\b(?![.,]\d)")
TASK = re.compile(rf"\b([Tt]asks?\s+)(\d\.\d+(?:{SEP}\d\.\d+)*)")
TEST_ID = re.compile(r"\b(test|task|perf|knob|answer)([_-])([1-9])\2(\d+)(?=[_\W]|$)")
STEP_KEY = re.compile(r"([\"'])0([1-9])([.\"'])")
NOTEBOOK = re.compile(r"\b([Nn]otebooks?\s+)0?([1-9])\b(?![.,]\d)")
BARE = re.compile(r"(?<![\w.#/-])(?<!otebook )(?<!otebooks )0([1-9])(?=(?:'s)?\s+(?:core|deep dive|cells?\b|notebooks?\b))")
TABLE_ROW = re.compile(r"^(\| )([1-9])( \| \[)", re.M)


def _n(m: str) -> str:
    return str(SHIFT[int(m)]) if int(m) in SHIFT else m


def rewrite(text: str) -> str:
    """Every lesson number in ``text`` moved from OLD to NEW (lines naming the inserted lesson kept)."""
    out = []
    for line in text.splitlines(keepends=True):
        if NEW_LINE.search(line):
            out.append(line)
            continue
        line = SLUG.sub(lambda m: f"{SHIFT[int(m[1])]:02d}_", line)
        line = MARKER.sub(lambda m: f"lesson{SHIFT[int(m[1])]:02d}", line)
        line = LESSON.sub(lambda m: m[1] + re.sub(r"\d+", lambda d: _n(d[0]), m[2]), line)
        line = TASK.sub(lambda m: m[1] + re.sub(r"(\d)\.(\d+)", lambda d: f"{_n(d[1])}.{d[2]}", m[2]), line)
        line = TEST_ID.sub(lambda m: f"{m[1]}{m[2]}{_n(m[3])}{m[2]}{m[4]}", line)
        line = STEP_KEY.sub(lambda m: f"{m[1]}{SHIFT[int(m[2])]:02d}{m[3]}", line)
        line = NOTEBOOK.sub(lambda m: m[1] + (f"{SHIFT[int(m[2])]:02d}" if len(m[0]) - len(m[1]) == 2
                                              else _n(m[2])), line)
        line = BARE.sub(lambda m: f"{SHIFT[int(m[1])]:02d}", line)
        line = TABLE_ROW.sub(lambda m: m[1] + _n(m[2]) + m[3], line)
        out.append(line)
    return "".join(out)


def new_path(path: str) -> str:
    return "/".join(SLUG.sub(lambda m: f"{SHIFT[int(m[1])]:02d}_", part) for part in path.split("/"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    top = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                              check=True).stdout.strip())
    files = subprocess.run(["git", "ls-files"], cwd=top, capture_output=True, text=True, check=True).stdout.split()
    changed = renamed = 0
    for f in files:
        if any(k in f for k in NEW_FILES):
            continue
        path = top / f
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        new = rewrite(text)
        if new != text:
            changed += 1
            if args.dry_run:
                print(f"edit {f}")
            else:
                path.write_text(new)
    for f in files:
        if any(k in f for k in NEW_FILES):
            continue
        g = new_path(f)
        if g != f:
            renamed += 1
            if args.dry_run:
                print(f"move {f} -> {g}")
            else:
                (top / g).parent.mkdir(parents=True, exist_ok=True)
                subprocess.run(["git", "mv", f, g], cwd=top, check=True)
    print(f"{changed} files rewritten, {renamed} moved", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

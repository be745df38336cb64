"""RESULTS.md: the headline figures of every GPU record in results/, written from the records so that it cannot drift.

Each lesson chooses its headline figures in its benchmarks module: ``results_rows(record) -> [(label, value, figure),
...]``, one row per figure as printed (``value`` None where the record lacks it), ``figure`` the record's figure the
value comes from. The first row is the lesson's headline, the one the README quotes. ``python -m gpucourse results``
writes RESULTS.md; ``--check`` fails where RESULTS.md, or a figure the README quotes, differs from what the records
give. The registry ({lesson: its results_rows}) is handed in, as to records.check_all: the tooling does not import
the lessons' modules.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, NamedTuple

from . import records

ROOT = Path(__file__).resolve().parents[1]
MISSING = "—"
COMMAND = "python -m gpucourse results"


class Row(NamedTuple):
    label: str  # what the figure is, with its unit or what a ratio compares ("..., speed against cuBLAS FP16")
    value: str | None  # as printed; None where the record does not hold it
    figure: str | None  # the record's figure it comes from (records' "figures" key); None: the record's own data


# ------------------------------------------------------------------------------------------- formatting helpers

def ratio(x: float | None, digits: int = 2) -> str | None:
    """1.0712 -> "1.07x"."""
    return None if x is None else f"{x:.{digits}f}x"


def share(x: float | None, digits: int = 2) -> str | None:
    """A share of a ceiling as a fraction: 0.9634 -> "0.96"."""
    return None if x is None else f"{x:.{digits}f}"


def percent(x: float | None, digits: int = 1) -> str | None:
    """0.924 -> "92.4%"."""
    return None if x is None else f"{100 * x:.{digits}f}%"


def number(x: float | None, digits: int = 0) -> str | None:
    """3021.4 -> "3021"; 1.178 with digits=2 -> "1.18"."""
    return None if x is None else f"{x:.{digits}f}"


def span(values, fmt: Callable = ratio) -> str | None:
    """The range of ``values`` (None ignored) in ``fmt``'s form: "1.15–1.42x", or one value where all agree."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    lo, hi = fmt(min(values)), fmt(max(values))
    if lo == hi:
        return lo
    unit = re.sub(r"^[-+\d.]+", "", hi)
    return f"{lo[:len(lo) - len(unit)] if unit and lo.endswith(unit) else lo}–{hi}"


def joined(values, fmt: Callable = ratio) -> str | None:
    """Several values in order, one unit at the end: [1.42, 1.29, 1.15] -> "1.42 / 1.29 / 1.15x"; None where any
    is missing."""
    values = list(values)
    if not values or any(v is None for v in values):
        return None
    cells = [fmt(v) for v in values]
    unit = re.sub(r"^[-+\d.]+", "", cells[-1])
    if unit and all(c.endswith(unit) for c in cells):
        cells = [c[:len(c) - len(unit)] for c in cells[:-1]] + [cells[-1]]
    return " / ".join(cells)


# -------------------------------------------------------------------------------------------------- the GPUs

def short_gpu(name: str) -> str:
    """A GPU's short name, as the README and RESULTS.md's columns give it: "NVIDIA H100 80GB HBM3" -> "H100",
    "NVIDIA A100-SXM4-80GB" -> "A100", "NVIDIA GeForce RTX 4090" -> "RTX 4090", "Tesla T4" -> "T4"."""
    words = [w for w in name.replace("-", " ").split() if w not in ("NVIDIA", "GeForce", "Tesla", "Quadro")]
    out = []
    for w in words:
        out.append(w)
        if any(c.isdigit() for c in w):
            break
    return " ".join(out) or name


VERSION_NAMES = {"python": "Python", "numpy": "NumPy", "numba": "Numba", "numba_cuda": "numba-cuda", "cupy": "CuPy"}


def _versions(rec: dict) -> str:
    return ", ".join(f"{VERSION_NAMES.get(k, k)} {v}" for k, v in (rec.get("versions") or {}).items())


def _record_line(rec: dict, column: str, root: Path) -> str:
    g = rec["gpu"]
    path = Path(rec["path"])
    try:
        path = path.resolve().relative_to(root.resolve())
    except ValueError:
        pass
    later = list(records.measured_dates(rec).items())
    line = (f"- **{column}**: {g['name']} ({g.get('sms', '?')} SMs, compute capability {g.get('compute_capability', '?')}, "
            f"CUDA driver {g.get('driver', '?')}), recorded {rec['date']}; {_versions(rec)}; [`{path}`]({path})")
    if later:
        line += ". Measured again later: " + ", ".join(f"`{n}` {d}" for n, d in later)
    return line + "."


# ----------------------------------------------------------------------------------------- where they are shown

def shown_in(lesson: str, root: Path | None = None) -> dict:
    """{figure: [notebook paths]}: the lesson's figures its notebooks (core and deep dive) draw from the records,
    by their calls benchmarks.figure / show / records.recall(LESSON, "name")."""
    root = ROOT if root is None else root
    call = re.compile(r"\b(?:figure|show|recall)\(\s*(?:LESSON|[\"']" + re.escape(lesson) + r"[\"'])\s*,\s*[\"'](\w+)[\"']")
    out: dict = {}
    for nb in sorted((root / "notebooks").glob(f"{lesson}*.ipynb")):
        if nb.stem not in (lesson, f"{lesson}_deep_dive"):
            continue
        cells = json.loads(nb.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        for name in call.findall(code):
            out.setdefault(name, [])
            if f"notebooks/{nb.name}" not in out[name]:
                out[name].append(f"notebooks/{nb.name}")
    return out


def _shown_line(lesson: str, figures: list, root: Path) -> str:
    where = shown_in(lesson, root)
    by_notebook: dict = {}
    for f in figures:
        for nb in where.get(f, []):
            by_notebook.setdefault(nb, []).append(f)
    parts = [f"[{nb}]({nb}) (" + ", ".join(f"`{f}`" for f in fs) + ")" for nb, fs in sorted(by_notebook.items())]
    line = "Shown, measured on your GPU or read from these records, in " + " and ".join(parts) + "." if parts else \
        "No notebook shows these figures."
    unshown = [f for f in figures if f not in where]
    if unshown and parts:
        line += " Not shown in a notebook: " + ", ".join(f"`{f}`" for f in unshown) + "."
    return line


# ------------------------------------------------------------------------------------------------ the document

def title(lesson: str, root: Path | None = None) -> str:
    """"08_feeding_the_gpu" -> "Lesson 8: feeding and sharing the GPU": the lesson's heading in docs/glossary.md, or
    its name where the glossary has none."""
    root = ROOT if root is None else root
    number = int(lesson[:2])
    glossary = root / "docs" / "glossary.md"
    if glossary.exists():
        m = re.search(rf"^## (Lesson {number}: .+?)\s*$", glossary.read_text(), re.M)
        if m:
            return m.group(1)
    return f"Lesson {number}: {lesson[3:].replace('_', ' ')}"


HEADER = f"""# Results

The headline figures of every GPU record in [`results/`](results/), one table per lesson, a column per GPU.
`{COMMAND}` (or `make results`) writes this file from the records: do not edit it by hand, run it again
after recording (`python -m gpucourse record`). `{COMMAND} --check`, and the test suite, fail while this file
or a figure the README quotes differs from what the records give. Each lesson chooses its headline figures in its
benchmarks module (`results_rows` in `benchmarks/<lesson>.py`). The notebooks show every figure, measured on your
GPU or read from these records and labelled; how each figure came to be is in [docs/engineering/](docs/engineering/).

How to read a ratio: "speed against X" is X's time over ours (above 1: faster than X); "time against X" is our
time over X's (below 1: faster than X); "share of" a ceiling is our rate over the ceiling's, measured in the same
run. A range ("1.02–1.06x") spans the sizes or layers the row covers; "—" means the record does not hold that
figure (a GPU without the feature, or a record made before the figure existed).
"""


def lesson_section(lesson: str, rows_fn: Callable, root: Path | None = None) -> str:
    root = ROOT if root is None else root
    recs = sorted(records.all_records(lesson), key=lambda r: r["gpu"]["name"])  # the same GPU in the same column
    lines = [f"## {title(lesson, root)}", ""]
    if not recs:
        return "\n".join(lines + ["No record of this lesson in `results/` yet.", ""])
    names = [short_gpu(r["gpu"]["name"]) for r in recs]
    columns = [n if names.count(n) == 1 else r["gpu"]["name"] for n, r in zip(names, recs)]
    table: dict = {}  # label -> {column: value}, in the order rows first appear
    figures: list = []
    for col, rec in zip(columns, recs):
        for row in map(lambda r: Row(*r), rows_fn(rec)):
            table.setdefault(row.label, {})[col] = row.value
            if row.figure and row.figure not in figures:  # None: about the record (a version), not a figure
                figures.append(row.figure)
    lines += ["| figure | " + " | ".join(columns) + " |", "| --- |" + " ---: |" * len(columns)]
    for label, cells in table.items():
        lines.append(f"| {label} | " + " | ".join(cells.get(c) or MISSING for c in columns) + " |")
    lines += ["", _shown_line(lesson, figures, root), "", "Records:", ""]
    lines += [_record_line(rec, col, root) for col, rec in zip(columns, recs)]
    return "\n".join(lines + [""])


def generate(registry: dict, root: Path | None = None) -> str:
    """RESULTS.md's text from the records: ``registry`` is {lesson: results_rows}."""
    root = ROOT if root is None else root
    return HEADER + "\n" + "\n".join(lesson_section(lesson, fn, root) for lesson, fn in registry.items())


def headline(lesson: str, rows_fn: Callable, gpu: str) -> str | None:
    """The lesson's headline as the README quotes it, "label: value (GPU)", from the newest record of the GPU whose
    short name is ``gpu`` ("H100"); None where there is none, or the record lacks the figure."""
    recs = [r for r in records.all_records(lesson) if short_gpu(r["gpu"]["name"]) == gpu]
    if not recs:
        return None
    row = Row(*rows_fn(recs[-1])[0])
    return None if row.value is None else f"{row.label}: {row.value} ({gpu})"


LESSON_ROW = re.compile(r"^\|.*?\]\((?:\./)?notebooks/(\d\d_\w+?)\.ipynb\).*$", re.M)
QUOTED = re.compile(r"\(([^()]+)\)\s*$")


def readme_problems(readme: str, registry: dict) -> list:
    """Where the README's lesson table quotes a headline figure other than the records give: its last cell must be
    ``headline(lesson, ..., gpu)`` for the GPU it names in brackets at its end. One line each; [] when all agree."""
    problems, seen = [], set()
    for m in LESSON_ROW.finditer(readme):
        lesson = m.group(1)
        if lesson not in registry or lesson in seen:
            continue
        seen.add(lesson)
        cell = [c.strip() for c in m.group(0).strip().strip("|").split("|")][-1]
        gpu = QUOTED.search(cell)
        want = headline(lesson, registry[lesson], gpu.group(1)) if gpu else None
        if cell != want:
            problems.append(f"README.md, lesson {lesson}: quotes {cell!r}; the records give {want!r}"
                            + ("" if gpu else " (end the cell with the GPU in brackets, e.g. (H100))"))
    problems += [f"README.md: no row of the lesson table links notebooks/{lesson}.ipynb" for lesson in registry
                 if lesson not in seen]
    return problems


def path(root: Path | None = None) -> Path:
    root = ROOT if root is None else root
    return root / "RESULTS.md"


def write(registry: dict, root: Path | None = None) -> Path:
    root = ROOT if root is None else root
    out = path(root)
    out.write_text(generate(registry, root))
    return out


def check(registry: dict, root: Path | None = None) -> list:
    """What differs from what the records give: RESULTS.md, and the README's quoted headlines. One line each."""
    root = ROOT if root is None else root
    problems = []
    out = path(root)
    if not out.exists():
        problems.append(f"{out.name} is missing: run `{COMMAND}`")
    elif out.read_text() != generate(registry, root):
        problems.append(f"{out.name} differs from what the records in results/ and the notebooks give: run `{COMMAND}`")
    readme = root / "README.md"
    if readme.exists():
        problems += readme_problems(readme.read_text(), registry)
    return problems

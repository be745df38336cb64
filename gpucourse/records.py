"""GPU results recorded on real GPUs and kept in the repository (results/<gpu>/<lesson>.json).

On a GPU, ``python -m gpucourse record`` runs every lesson's benchmarks and writes one file per lesson.
In CPU mode the notebooks read those files and label every figure drawn from them as recorded.
"""
from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import runtime
from .runtime import slug  # records.slug: the GPU's name in results/<slug>/

__all__ = ["FORMAT", "Figure", "results_dir", "slug", "write", "all_records", "latest", "load", "label", "describe",
           "recall", "ceilings_or_recall"]

FORMAT = 1


@dataclass(frozen=True)
class Figure:
    """One figure of a lesson, declared once in its benchmark module (``FIGURES = {name: Figure(...)}``):

    measure() -> a JSON-able dict, measured now on this GPU (GPU mode only; ``record`` stores it under the name);
    plot(data, source, **context) draws it with gpucourse.plots, the same code for measured and recorded data;
    text(data) -> the lines a notebook prints under it;
    optional: records made before the figure existed lack it, and CPU mode says so instead of failing;
    gpus: how many GPUs measure() needs: on a machine with fewer, the figure is recalled, labelled, as in CPU mode;
    step: the gpucourse.gpus step measure() runs (e.g. "10.wgmma_fp8"): on a GPU that cannot run it, the figure is
    recalled likewise, after the step's one line saying why."""

    measure: Callable[[], dict]
    plot: Callable | None = None
    text: Callable[[dict], str] | None = None
    optional: bool = False
    gpus: int = 1
    step: str | None = None


def results_dir() -> Path:
    return Path(os.environ.get("GPUCOURSE_RESULTS", Path(__file__).resolve().parents[1] / "results"))


def write(lesson: str, figures: dict, *, ceilings: dict | None = None) -> Path:
    """Write a record of ``figures`` measured now on this GPU."""
    rt = runtime.get()
    runtime.require_gpu("recording GPU results")
    doc = {
        "format": FORMAT,
        "lesson": lesson,
        "gpu": rt.device,
        "date": _now(),
        "versions": runtime.versions(),
        "ceilings": ceilings,
        "figures": figures,
    }
    path = results_dir() / slug(rt.device["name"]) / f"{lesson}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    return path


def add_figure(lesson: str, name: str, value: dict | list) -> Path:
    """Put ``value``, measured now on this GPU, as figure ``name`` into the lesson's newest record of this GPU (the
    rest of the record stays as it was measured), stamped with its own date under "measured" (a figure that is a
    list, such as lesson 5's "layers": in the record's "measured" {figure: date})."""
    rt = runtime.get()
    runtime.require_gpu("recording GPU results")
    rec = latest(lesson, rt.device["name"])
    if rec is None:
        raise runtime.CourseError(f"no record of {lesson} on {rt.device['name']} to add {name!r} to; record the "
                                  f"whole lesson first (python -m gpucourse record {lesson})")
    path = Path(rec.pop("path"))
    if isinstance(value, dict):
        rec["figures"][name] = {**value, "measured": _now()}
    else:
        rec["figures"][name] = value
        rec.setdefault("measured", {})[name] = _now()
    path.write_text(json.dumps(rec, indent=1, sort_keys=False) + "\n")
    return path


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def all_records(lesson: str) -> list[dict]:
    """Every record of a lesson, oldest first."""
    out = []
    for path in sorted(results_dir().glob(f"*/{lesson}.json")):
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT:
            continue
        doc["path"] = str(path)
        out.append(doc)
    return sorted(out, key=lambda d: d["date"])


def latest(lesson: str, gpu: str | None = None) -> dict | None:
    """The newest record of a lesson (on GPU ``gpu``, a name or slug, if given), or None."""
    recs = all_records(lesson)
    if gpu is not None:
        recs = [r for r in recs if slug(r["gpu"]["name"]) == slug(gpu)]
    return recs[-1] if recs else None


def load(lesson: str, gpu: str | None = None) -> dict:
    rec = latest(lesson, gpu)
    if rec is None:
        raise runtime.CourseError(
            f"no recorded GPU results for {lesson}" + (f" on {gpu}" if gpu else "")
            + f" in {results_dir()}; record them on a GPU with `python -m gpucourse record`"
        )
    return rec


def label(rec: dict, figure: str | None = None) -> str:
    """Where a record's figures come from: the GPU and the day; for ``figure``, the day it was measured where it
    was added to the record later (add_figure)."""
    g = rec["gpu"]
    date = measured_dates(rec).get(figure, rec["date"])
    return f"recorded on {g['name']} ({g['sms']} SMs, CUDA driver {g['driver']}) on {date[:10]}"


def measured_dates(rec: dict) -> dict:
    """{figure: date} for each figure of a record measured again after it (add_figure)."""
    out = {name: f["measured"] for name, f in rec["figures"].items() if isinstance(f, dict) and "measured" in f}
    return {**out, **rec.get("measured", {})}


def describe(lesson: str | None = None) -> str:
    """The probe (``runtime.describe``), plus in CPU mode the record of ``lesson`` its GPU figures come from."""
    text = runtime.describe()
    if lesson and not runtime.is_gpu():
        rec = latest(lesson)
        if rec is None:
            text += f"\n          No GPU record of lesson {lesson} is in this repository yet."
        else:
            from .plots import wrap

            text += "\n" + wrap(f"          GPU figures shown are {label(rec)}.")
    return text


def measured_here() -> str:
    """The label of figures measured in this process."""
    return f"measured here on {runtime.get().device['name']}"


def recall(lesson: str, key: str, *, optional: bool = False) -> tuple:
    """(figures[key] of the lesson's newest record that has it, its label); in GPU mode the newest record of this
    GPU where there is one, so that what a learner reads beside it describes the GPU in front of them. Where no
    record has it: a CourseError, or for an ``optional`` figure (None, a sentence saying why)."""
    recs = [r for r in all_records(lesson) if key in r["figures"]]
    rt = runtime.get()
    if rt.gpu:
        mine = [r for r in recs if slug(r["gpu"]["name"]) == slug(rt.device["name"])]
        recs = mine or recs
    if recs:
        return recs[-1]["figures"][key], label(recs[-1], key)
    why = (f"no GPU record of {lesson} in {results_dir()} holds {key!r} yet: record it on a GPU with "
           f"`python -m gpucourse record {lesson} --figure {key}`")
    if optional:
        return None, why
    raise runtime.CourseError(why)


def ceilings_or_recall(lesson: str) -> tuple:
    """(ceilings as a dict, source): this GPU's measured ceilings, or those recorded with the lesson."""
    if runtime.is_gpu():
        from . import bench

        return bench.ceilings().as_dict(), f"measured here on {runtime.get().device['name']}"
    rec = load(lesson)
    return rec["ceilings"], label(rec)


def check_all(lessons: dict) -> list:
    """Problems with the committed records: for every lesson ({lesson: its figures registry}), a record from a real
    GPU exists; every record is complete (format, GPU, date, versions, ceilings); and every figure the registry does
    not call optional is held by some record of the lesson. One line each; an empty list when all is well."""
    problems = []
    for lesson, figures in lessons.items():
        recs = all_records(lesson)
        if not recs:
            problems.append(f"{lesson}: no record in {results_dir()}")
            continue
        for rec in recs:
            where = f"{lesson} ({rec['path']})"
            if not str(rec.get("gpu", {}).get("name", "")).startswith("NVIDIA") or not rec["gpu"].get("sms"):
                problems.append(f"{where}: no GPU named")
            if not rec.get("date") or not rec.get("versions"):
                problems.append(f"{where}: no date or versions")
            c = rec.get("ceilings") or {}
            if not (c.get("copy_gbps", 0) > 0 and c.get("fp16_tflops", 0) > 0):
                problems.append(f"{where}: no measured ceilings")
        held = set().union(*(r["figures"] for r in recs))
        required = {n for n, f in figures.items() if not f.optional} if isinstance(figures, dict) else set(figures)
        if required - held:
            problems.append(f"{lesson}: no record holds {', '.join(sorted(required - held))}")
    return problems

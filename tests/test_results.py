"""RESULTS.md and the README's headline figures, written from and checked against the GPU records in results/.

Each lesson's benchmarks module chooses its headline figures (``results_rows(record)``); ``python -m gpucourse
results`` writes RESULTS.md from every record; the README's lesson table quotes each lesson's first row for the GPU
it names. The tests whose names start with ``test_recorded`` read the committed records (marker "records").
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import benchmarks
from gpucourse import cli, records, results

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = cli.results_registry()


# ------------------------------------------------------------------------------------------- the committed records

def test_recorded_figures_in_results_md_are_what_the_records_give():
    assert (ROOT / "RESULTS.md").exists(), "RESULTS.md is missing: run `python -m gpucourse results`"
    assert (ROOT / "RESULTS.md").read_text() == results.generate(REGISTRY), \
        "RESULTS.md differs from what the records in results/ (and the notebooks) give: run `python -m gpucourse results`"


def test_recorded_figures_the_readme_quotes_are_what_the_records_give():
    problems = results.readme_problems((ROOT / "README.md").read_text(), REGISTRY)
    assert not problems, "\n".join(problems)


def test_recorded_headline_rows_of_every_lesson():
    """Every lesson chooses its headline figures; each row is (label, value as printed or None, a figure of the
    lesson); the headline (the first row) has one label whatever the record, and a value in some record."""
    assert set(REGISTRY) == set(benchmarks.LESSONS)
    for lesson, rows_fn in REGISTRY.items():
        recs = records.all_records(lesson)
        assert recs, f"{lesson}: no record"
        firsts, values = set(), []
        for rec in recs:
            rows = [results.Row(*r) for r in rows_fn(rec)]
            assert rows, f"{lesson}: no headline rows for {rec['path']}"
            labels = [r.label for r in rows]
            assert len(labels) == len(set(labels)), f"{lesson}: a label twice in {labels}"
            for r in rows:
                assert r.value is None or (isinstance(r.value, str) and r.value.strip()), (lesson, r)
                assert r.figure is None or r.figure in benchmarks.figures(lesson), (lesson, r)
                assert "|" not in r.label and (r.value is None or "|" not in r.value), (lesson, r)
            firsts.add(rows[0].label)
            values.append(rows[0].value)
        assert len(firsts) == 1, f"{lesson}: the headline's label differs between records: {firsts}"
        assert any(values), f"{lesson}: no record holds the headline figure"


def test_recorded_every_headline_figure_is_shown_in_a_notebook():
    """RESULTS.md says where each lesson's notebooks show its headline figures: every figure a row comes from is
    drawn by the lesson's core notebook or deep dive."""
    for lesson, rows_fn in REGISTRY.items():
        shown = results.shown_in(lesson)
        wanted = {results.Row(*r).figure for rec in records.all_records(lesson) for r in rows_fn(rec)} - {None}
        assert wanted <= set(shown), f"{lesson}: no notebook shows {sorted(wanted - set(shown))}"


# -------------------------------------------------------------------------------------------- the README's text

def _links(path: Path) -> list:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [m for m in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:|#", m)]


@pytest.mark.parametrize("doc", ["README.md", "RESULTS.md", "docs/maintainers.md"])
def test_the_readme_and_its_pages_link_what_exists(doc):
    path = ROOT / doc
    missing = [link for link in _links(path) if not (path.parent / link.split("#")[0]).exists()]
    assert not missing, f"{doc} links files that are not there: {missing}"


def test_the_readme_opens_for_a_learner():
    text = (ROOT / "README.md").read_text()
    first_screen = "\n".join(text.splitlines()[:40])
    assert "Python and NumPy" in first_screen and "notebooks/01_vector_multiply.ipynb" in first_screen
    assert "make hub" not in first_screen and "gpucourse/" not in first_screen, \
        "the first screen is for a learner: no maintainers' commands or layout"
    for link in ("docs/glossary.md", "RESULTS.md", "docs/engineering/", "docs/maintainers.md"):
        assert f"]({link})" in text, f"the README links {link}"
    hosted = text.split("## In a hosted notebook (Colab, Kaggle)")[1].split("\n## ")[0]
    assert hosted.count("```") == 2, "exactly one fenced code block in the hosted-notebook section"


def test_the_engineering_index_lists_every_lesson():
    text = (ROOT / "docs/engineering/README.md").read_text()
    for lesson in benchmarks.LESSONS:
        assert f"]({lesson}.md)" in text, f"docs/engineering/README.md links {lesson}.md"


# ---------------------------------------------------------------------------------- the generator, on made-up records

def test_formats():
    assert results.ratio(1.0712) == "1.07x" and results.ratio(None) is None
    assert results.span([1.42, 1.15, None, 1.29]) == "1.15–1.42x"
    assert results.span([0.991, 0.994], results.share) == "0.99" and results.span([None]) is None
    assert results.span([0.921, 0.924], results.percent) == "92.1–92.4%"
    assert results.joined([1.42, 1.29, 1.15]) == "1.42 / 1.29 / 1.15x"
    assert results.joined([1418.2, 13.5], results.number) == "1418 / 14"
    assert results.joined([1.0, None]) is None
    assert results.short_gpu("NVIDIA H100 80GB HBM3") == "H100" and results.short_gpu("NVIDIA H200") == "H200"
    assert results.short_gpu("NVIDIA A100-SXM4-80GB") == "A100" and results.short_gpu("Tesla T4") == "T4"
    assert results.short_gpu("NVIDIA GeForce RTX 4090") == "RTX 4090"
    assert results.title("05_inference_engine") == "Lesson 5: an inference engine"  # docs/glossary.md's heading


def _record(folder: Path, gpu: str, lesson: str, figures: dict, date: str = "2030-01-02 03:04 UTC"):
    out = folder / records.slug(gpu) / f"{lesson}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "format": records.FORMAT, "lesson": lesson, "date": date,
        "gpu": {"name": gpu, "compute_capability": "8.0", "sms": 108, "driver": "12.4"},
        "versions": {"python": "3.12.1", "cupy": "13.3.0"}, "ceilings": {"copy_gbps": 1.0, "fp16_tflops": 1.0},
        "figures": figures}))


def _rows(record):
    speed = record["figures"]["speed"]
    return [("widget, speed against the library", results.ratio(speed.get("ratio")), "speed"),
            ("widget, GB/s", results.number(speed.get("gbps")), "speed"),
            ("library version", record["figures"].get("version"), None)]


@pytest.fixture
def course(tmp_path, monkeypatch):
    """A course folder with two records of one lesson, a notebook that shows the figure and a README quoting it."""
    monkeypatch.setenv("GPUCOURSE_RESULTS", str(tmp_path / "results"))
    _record(tmp_path / "results", "NVIDIA A100-SXM4-80GB", "01_widgets", {"speed": {"ratio": 0.934, "gbps": 1500.4}})
    _record(tmp_path / "results", "NVIDIA H100 80GB HBM3", "01_widgets",
            {"speed": {"ratio": 1.071}, "version": "9.1", "later": {"measured": "2030-02-03 04:05 UTC"}})
    (tmp_path / "notebooks").mkdir()
    cell = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
            "source": ['LESSON = "01_widgets"\n', 'benchmarks.show(LESSON, "speed")\n']}
    (tmp_path / "notebooks" / "01_widgets.ipynb").write_text(json.dumps({"cells": [cell]}))
    (tmp_path / "README.md").write_text(
        "| # | core notebook | headline figure (GPU) |\n| --- | --- | --- |\n"
        "| 1 | [Widgets](notebooks/01_widgets.ipynb) | widget, speed against the library: 1.07x (H100) |\n")
    return tmp_path


def test_results_md_is_written_from_the_records(course):
    text = results.generate({"01_widgets": _rows}, course)
    section = text.split("## Lesson 1: widgets")[1]
    assert "| figure | A100 | H100 |" in section  # a column per GPU, in the GPUs' order
    assert "| widget, speed against the library | 0.93x | 1.07x |" in section
    assert "| widget, GB/s | 1500 | — |" in section  # what a record lacks
    assert "| library version | — | 9.1 |" in section
    assert "[notebooks/01_widgets.ipynb](notebooks/01_widgets.ipynb) (`speed`)" in section
    assert "NVIDIA A100-SXM4-80GB (108 SMs, compute capability 8.0, CUDA driver 12.4), recorded 2030-01-02 03:04 UTC; " \
           "Python 3.12.1, CuPy 13.3.0; [`results/nvidia-a100-sxm4-80gb/01_widgets.json`]" in section
    assert "Measured again later: `later` 2030-02-03 04:05 UTC." in section


def test_the_check_finds_drift_in_results_md_and_in_the_readme(course, capsys):
    registry = {"01_widgets": _rows}
    assert results.check(registry, course) == ["RESULTS.md is missing: run `python -m gpucourse results`"]
    results.write(registry, course)
    assert results.check(registry, course) == []
    _record(course / "results", "NVIDIA H100 80GB HBM3", "01_widgets", {"speed": {"ratio": 1.2}})  # a new record
    problems = results.check(registry, course)
    assert problems[0].startswith("RESULTS.md differs from what the records")
    assert problems[1] == ("README.md, lesson 01_widgets: quotes 'widget, speed against the library: 1.07x (H100)'; "
                           "the records give 'widget, speed against the library: 1.20x (H100)'")
    (course / "README.md").write_text("| 1 | [Widgets](notebooks/01_widgets.ipynb) | 1.20x |\n")
    assert "end the cell with the GPU in brackets" in results.readme_problems((course / "README.md").read_text(),
                                                                               registry)[0]
    assert results.readme_problems("no table", registry) == \
        ["README.md: no row of the lesson table links notebooks/01_widgets.ipynb"]


def test_the_command_writes_and_checks(course, monkeypatch, capsys):
    monkeypatch.setattr(cli, "results_registry", lambda: {"01_widgets": _rows})
    monkeypatch.setattr(results, "ROOT", course)
    assert cli.main(["results", "--check"]) == 1 and "RESULTS.md is missing" in capsys.readouterr().err
    assert not (course / "RESULTS.md").exists()
    assert cli.main(["results"]) == 0 and (course / "RESULTS.md").exists()
    assert cli.main(["results", "--check"]) == 0
    assert "agree with the records" in capsys.readouterr().out

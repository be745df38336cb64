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
    assert results.title("06_inference_engine") == "Lesson 6: an inference engine"  # docs/glossary.md's heading


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


# ------------------------------------------------------------------- stored ratios against the raw figures beside them

RATIO_KEY = re.compile(r"(?:^|_)(?:of|over|vs|ratio|speedup)(?:_|$)")
ROUNDING = 1e-6  # relative: a stored ratio is the quotient of the raw figures it sits beside, not a rounded copy


def _by(rows, key="name"):
    return {r[key]: r for r in rows}


def _derived_ratios(lesson: str, f: dict):
    """(where, stored ratio, the same recomputed from the raw figures of the record) for every stored ratio the
    records tests recompute; the keys each covers go to RATIOS_RECOMPUTED."""
    if lesson == "01_vector_multiply" and "kernels" in f:
        k = f["kernels"]
        library = next(r["gbps"] for r in k["rows"] if r["kind"] == "library")
        for r in k["rows"]:
            yield f"kernels/{r['name']}/of_copy", r["of_copy"], r["gbps"] / k["copy_gbps"]
            yield f"kernels/{r['name']}/of_library", r["of_library"], r["gbps"] / library
        u = f.get("utilisation")
        if u:
            yield "utilisation/work_ratio", u["work_ratio"], u["every_sm_gflop"] / u["one_block_gflop"]
    if lesson == "02_warp_divergence" and "reductions" in f:
        red = f["reductions"]
        library = next(r["gbps"] for r in red["rows"] if r["kind"] == "library")
        for r in red["rows"]:
            yield f"reductions/{r['name']}/of_read", r["of_read"], r["gbps"] / red["read_gbps"]
            yield f"reductions/{r['name']}/of_cupy", r["of_cupy"], r["gbps"] / library
    if lesson == "03_memory" and "transposes" in f:
        for r in f["transposes"]["rows"]:
            yield f"transposes/{r['variant']}/of_copy", r["of_copy"], r["gbps"] / f["transposes"]["copy_gbps"]
    if lesson == "04_tensor_cores":
        if "configs" in f:
            for r in f["configs"]["rows"]:
                yield f"configs/{r['name']}/of_cublas", r["of_cublas"], r["tflops"] / f["configs"]["cublas_fp16_tflops"]
        if "kernels" in f:
            rows = _by(f["kernels"]["rows"])
            for r in rows.values():
                ref = "cuBLAS FP16 (tensor cores)" if r["precision"].startswith("FP16") else "cuBLAS FP32"
                yield f"kernels/{r['name']}/of_cublas", r["of_cublas"], r["tflops"] / rows[ref]["tflops"]
            k = f["kernels"]
            ours = next(r for r in rows.values() if r["name"].startswith("WMMA, tiled (") and k["config"] in r["name"])
            yield "kernels/tc_vs_simt_cublas", k["tc_vs_simt_cublas"], \
                rows["cuBLAS FP16 (tensor cores)"]["tflops"] / rows["cuBLAS FP32"]["tflops"]
            yield "kernels/tc_vs_simt_ours", k["tc_vs_simt_ours"], \
                ours["tflops"] / rows["CUDA C, register tiles 128x128 (8x8 a thread)"]["tflops"]
        if "fp8" in f and f["fp8"].get("rows"):
            by = {r["name"]: r["tflops"] for r in f["fp8"]["rows"]}
            from benchmarks.tensor_cores import CUBLAS_FP8 as lib

            for r in f["fp8"]["rows"]:
                yield f"fp8/{r['name']}/of_cublas_fp16", r["of_cublas_fp16"], r["tflops"] / by["cuBLAS FP16"]
                if "of_cublas_fp8" in r:
                    ref = lib["fast" if ", fast" in r["name"] else "promoted"]
                    yield f"fp8/{r['name']}/of_cublas_fp8", r["of_cublas_fp8"], r["tflops"] / by[ref]
        for shape in f.get("transformer", {}).get("shapes", []):
            cublas = next(r["tflops"] for r in shape["rows"] if r["name"].startswith("cuBLAS FP16"))
            for r in shape["rows"]:
                yield (f"transformer/{shape['d']} {shape['name']}/{r['name']}/of_cublas", r["of_cublas"],
                       r["tflops"] / cublas)
    if lesson == "10_attention" and "fp8" in f:
        for run in f["fp8"]["runs"]:
            t = run["tflops"]
            where = f"fp8/{run['N']}{' causal' if run['causal'] else ''}"
            yield f"{where}/fp8_of_fp16", run["fp8_of_fp16"], t["FP8 (CUDA C)"] / t["FP16 (CUDA C)"]
            if "fp8_of_cudnn_fp16" in run:
                yield f"{where}/fp8_of_cudnn_fp16", run["fp8_of_cudnn_fp16"], t["FP8 (CUDA C)"] / t["cuDNN FP16"]
            if "fp8_of_cudnn_fp8" in run:
                yield f"{where}/fp8_of_cudnn_fp8", run["fp8_of_cudnn_fp8"], t["FP8 (CUDA C)"] / t["cuDNN FP8"]
                yield (f"{where}/cudnn_fp8_of_cudnn_fp16", run["cudnn_fp8_of_cudnn_fp16"],
                       t["cuDNN FP8"] / t["cuDNN FP16"])
    if lesson == "05_convolution":
        for lt in f.get("layers", []):
            rows = {(r["name"], r["dtype"], r["layout"]): r for r in lt["rows"]}
            for r in lt["rows"]:
                for key, ref in (("of_cudnn_fastest", "cudnn_fastest"), ("of_cudnn_like", "cudnn_like")):
                    if r.get(ref):
                        yield (f"layers/{lt['name']}/{r['name']} {r['dtype']} {r['layout']}/{key}", r[key],
                               r["median_ms"] / rows[r[ref], r["dtype"], r["layout"]]["median_ms"])
            for name, t in lt["targets"].items():
                stored = {r["of_cudnn_fastest"] for r in lt["rows"]}
                yield f"layers/{lt['name']}/targets/{name}/ratio", t["ratio"], t["ratio"] if t["ratio"] in stored \
                    else float("nan")
        for r in f.get("race", {}).get("rows", []):
            for kind in ("one_tile", "persistent", "persistent_pdl"):
                k = r.get(kind) or {"config": None}
                if k["config"] is not None:
                    yield f"race/{r['layer']}/{kind}/of_cudnn", k["of_cudnn"], k["ms"] / r["cudnn_ms"]
    if lesson == "06_inference_engine":
        for r in f.get("cudnn", {}).get("rows", []):
            if r.get("ours_over_cudnn") is not None:
                yield f"cudnn/{r['engine']}/{r['layer']}/ours_over_cudnn", r["ours_over_cudnn"], r["ours_ms"] / r["cudnn_ms"]
    if lesson == "07_collectives":
        for k, run in f.get("runs", {}).items():
            h = run.get("headline")
            if h and h.get("ring_over_nccl") is not None:
                yield f"runs/{k}/headline/ring_over_nccl", h["ring_over_nccl"], \
                    h["nccl"]["median_ms"] / h["ring"]["median_ms"]
    if lesson == "08_feeding_the_gpu":
        s = f.get("small_kernels")
        if s:
            us = s["us_per_launch"]
            yield "small_kernels/graph_speedup", s["graph_speedup"], us["CuPy, one stream"] / us["CuPy, one CUDA graph"]
        o = f.get("overlap")
        if o:
            longer = max(o["h2d_ms"], o["d2h_ms"])
            for k, run in o["runs"].items():
                yield f"overlap/runs/{k}/ratio_to_longer_copy", run["ratio_to_longer_copy"], run["total_ms"] / longer
            best = o["runs"][str(o["best"]["streams"])]
            yield "overlap/best/ratio_to_longer_copy", o["best"]["ratio_to_longer_copy"], best["total_ms"] / longer
            yield "overlap/best/speedup_over_serial", o["best"]["speedup_over_serial"], o["serial_ms"] / best["total_ms"]
    if lesson == "09_training":
        m = f.get("mixed_precision")
        if m:
            yield "mixed_precision/speedup", m["speedup"], m["fp32"]["median_ms"] / m["mixed"]["median_ms"]
        runs = f.get("recompute", {}).get("runs", {})
        for k, run in runs.items():
            yield (f"recompute/runs/{k}/time_ratio", run["time_ratio"],
                   run["time"]["median_ms"] / runs["1"]["time"]["median_ms"])
            yield (f"recompute/runs/{k}/memory_saving", run["memory_saving"],
                   runs["1"]["peak_bytes"] / run["peak_bytes"])
        big = f.get("largest_batch")
        if big and "ratio" in big:
            most = max(big["runs"], key=int)
            yield "largest_batch/ratio", big["ratio"], big["runs"][most]["largest"] / big["runs"]["1"]["largest"]


def _ratio_keys(node, path=""):
    """Every (path, key) in a record whose key names a ratio (of_..., ..._over_..., ..._vs_..., ratio, speedup)."""
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and RATIO_KEY.search(k):
                yield path, k
            yield from _ratio_keys(v, f"{path}/{k}")
    elif isinstance(node, list):
        for v in node:
            yield from _ratio_keys(v, f"{path}[]")


# Ratio keys no rule above recomputes, each with why (lesson, a pattern of "path/key" -> why).
RATIOS_NOT_RECOMPUTED = {
    ("04_tensor_cores", r"^/errors/.*/vs_"): "errors against two references, not ratios",
    ("06_inference_engine", r"^/(?!cudnn/)"): "the engines' ratios are of medians the record keeps per engine and batch in other "
                                  "figures (not yet given a rule here, except cuDNN's)",
    ("09_training", r"^/goals/"): "the goals, not measured",
    ("10_attention", r"^/fp8/goals/"): "the goals, not measured",
    ("10_attention", r"/of_needed$"): "the peak over the bytes the kernel needs, which the record does not keep",
    ("08_feeding_the_gpu", r"^/profile/.*pct_of_peak"): "ncu's counters, as ncu gives them",
    ("10_attention", r"^/profile/.*pct_of_peak"): "ncu's counters, as ncu gives them",
}


def test_recorded_ratios_are_the_quotients_of_their_raw_figures():
    """Every stored ratio a rule covers equals the ratio of the raw figures it derives from, within rounding, in
    every record: a record edited so that its ratio no longer matches its times or rates fails here."""
    wrong, checked = [], 0
    for lesson in benchmarks.LESSONS:
        for rec in records.all_records(lesson):
            for where, stored, again in _derived_ratios(lesson, rec["figures"]):
                checked += 1
                if not (abs(stored - again) <= ROUNDING * max(abs(again), 1e-12)):
                    wrong.append(f"{rec['path']}: {where} = {stored!r}, its raw figures give {again!r}")
    assert checked > 100, checked
    assert not wrong, "\n".join(wrong[:20])


def test_recorded_ratio_keys_have_a_rule():
    """A new ratio in a record gets a rule in _derived_ratios (or a reason in RATIOS_NOT_RECOMPUTED)."""
    missing = set()
    for lesson in benchmarks.LESSONS:
        for rec in records.all_records(lesson):
            covered = {where.rsplit("/", 1)[1] for where, _, _ in _derived_ratios(lesson, rec["figures"])}
            for path, key in _ratio_keys(rec["figures"]):
                excused = any(ls == lesson and re.search(pattern, f"{path}/{key}")
                              for (ls, pattern) in RATIOS_NOT_RECOMPUTED)
                if key not in covered and not excused:
                    missing.add(f"{lesson}: {path}/{key}")
    assert not missing, sorted(missing)

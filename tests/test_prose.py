"""The text a learner reads: each lesson a core notebook for one sitting and an optional deep dive, every figure in
the prose true on the learner's own GPU, the README read to the end.

- A core notebook (notebooks/NN_topic.ipynb) holds at most CORE_WORDS words of markdown. Its first markdown cell
  says what the learner will be able to do, which lessons it builds on and how long it takes (reading, and the run
  in GPU and in CPU mode); it ends with a summary and three to five questions with their answers folded
  (<details>), and links the glossary (docs/glossary.md), where every term it uses is defined.
- A deep dive (notebooks/NN_topic_deep_dive.ipynb) holds at most DEEP_DIVE_WORDS; it opens the same way.
- Every lesson has an engineering note, docs/engineering/NN_topic.md: the dated runs and the history of its
  figures live there, not in a notebook.
- No notebook's markdown carries a date or a time of day.
- A measured quantity (a rate, a time, a ratio, a percentage) typed into a notebook's markdown is a constant the
  notebook declares in its metadata (``metadata.gpucourse.constants``: the figure as written -> its kind and source,
  "spec: ...", "source: ...", "paper: ...", "example: ...", "goal: ...", "definition: ..."). Everything measured is
  printed by a cell, measured here or read from a named record and labelled.
- The documents the course answers are cited by their titles in docs/sources.md (a "source: <title>: ..."
  constant names one of its headings), never by a file the learner does not have; no notebook's text says "seed"
  (the word is left to code: a parameter ``seed=`` of a random-number generator, and "random seed").
- A long CUDA C region in a core notebook is folded (the cell's source hidden): a learner opens it to read it.
"""
from __future__ import annotations

import io
import json
import re
import tokenize
from pathlib import Path

import pytest

from gpucourse import notebooks

ROOT = Path(__file__).resolve().parents[1]
CORE = notebooks.core_notebooks()
DEEP = notebooks.deep_dives()
EVERY_NOTEBOOK = sorted(ROOT.glob("notebooks/*.ipynb")) + sorted(ROOT.glob("solutions/*/*.ipynb")) \
    + sorted(ROOT.glob("exercises/*/*.ipynb"))
CORE_WORDS = 4500
DEEP_DIVE_WORDS = 6000
README_WORDS = 2500
FOLD_LINES = 80  # a CUDA C region longer than this is folded in a core notebook
KINDS = ("spec", "source", "paper", "example", "goal", "definition")

MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
DATE = re.compile(rf"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b|\b\d{{1,2}}:\d\d(?::\d\d)?\s*(?:UTC|GMT|CET)\b"
                  rf"|\b(?:{MONTHS})\s+(?:[0-3]?\d,?\s+)?(?:19|20)\d\d\b|\b[0-3]?\d\s+(?:{MONTHS})\s+(?:19|20)\d\d\b")
NUMBER = r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?"
# A measured quantity as a learner would read one: a rate, a time, a ratio (1.3x, not 16x16 or 3 x 3), a
# percentage, a count of cycles.
FIGURE = re.compile(
    NUMBER + r"(?:\s?(?:[kKMGTP]?B/s|[KMGT]iB/s|[TGMk]?FLOP/s|T?FLOPS|TOPS|images?/s|tokens?/s"
             r"|µs|us|ms|ns|%|cycles)(?![\w/])"
             r"|[x×](?![\w\d])(?!\s*\d))")


def markdown(path: Path) -> list[tuple[int, str]]:
    """(cell index, text) of every markdown cell."""
    return [(i, "".join(c["source"])) for i, c in enumerate(json.loads(path.read_text())["cells"])
            if c["cell_type"] == "markdown"]


def words(path: Path) -> int:
    return sum(len(text.split()) for _, text in markdown(path))


def constants(path: Path) -> dict:
    return json.loads(path.read_text())["metadata"].get("gpucourse", {}).get("constants", {})


def typed_figures(text: str) -> list[str]:
    """The measured quantities typed into ``text``, as written ("1.3x", "80 µs"), outside code spans and blocks."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", " ", text)
    text = re.sub(r"<[^>\n]+>", " ", text)  # HTML tags, not their text
    return [m.group(0).replace(",", "") for m in FIGURE.finditer(text)]


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_there_is_a_core_notebook_per_lesson():
    assert len(CORE) >= 9 and all(not p.stem.endswith("_deep_dive") for p in CORE)


@pytest.mark.parametrize("path", CORE, ids=rel)
def test_a_core_notebook_is_one_sitting(path):
    assert words(path) <= CORE_WORDS, f"{words(path)} words of markdown; a core notebook holds at most {CORE_WORDS}"


@pytest.mark.parametrize("path", DEEP, ids=rel)
def test_a_deep_dive_is_bounded(path):
    assert words(path) <= DEEP_DIVE_WORDS, f"{words(path)} words of markdown; a deep dive holds at most {DEEP_DIVE_WORDS}"


@pytest.mark.parametrize("path", CORE + DEEP, ids=rel)
def test_a_lesson_opens_with_what_it_teaches_what_it_needs_and_how_long_it_takes(path):
    first = markdown(path)[0][1]
    for phrase in ("You will be able to", "Builds on", "Time"):
        assert phrase in first, f"the first cell says {phrase!r} ..."
    time = next(line for line in first.splitlines() if "Time" in line)
    assert "GPU mode" in time and "CPU mode" in time and "read" in time, \
        f"the Time line gives the reading time and the run in GPU mode and in CPU mode: {time!r}"


@pytest.mark.parametrize("path", CORE, ids=rel)
def test_a_core_notebook_ends_with_a_summary_and_questions(path):
    cells = markdown(path)
    summary = [i for i, t in cells if re.search(r"^##\s+Summary", t, re.M)]
    assert summary, "a '## Summary' section"
    tail = "\n".join(t for i, t in cells if i >= summary[-1])
    quiz = re.split(r"^##\s+Check your understanding.*$", tail, flags=re.M)
    assert len(quiz) == 2, "a '## Check your understanding' section after the summary"
    questions = re.findall(r"^\d+\.\s", quiz[1], re.M)
    assert 3 <= len(questions) <= 5, f"{len(questions)} questions; three to five"
    assert quiz[1].count("<details>") >= 1, "answers folded in <details>, or at the end"


@pytest.mark.parametrize("path", CORE, ids=rel)
def test_a_core_notebook_links_the_glossary(path):
    assert any("../docs/glossary.md" in t for _, t in markdown(path)), "link ../docs/glossary.md"


def test_the_glossary_and_the_engineering_notes_are_there():
    assert (ROOT / "docs/glossary.md").exists()
    missing = [p.stem for p in CORE if not (ROOT / f"docs/engineering/{p.stem}.md").exists()]
    assert not missing, f"no engineering note docs/engineering/<lesson>.md for {missing}"


@pytest.mark.parametrize("path", EVERY_NOTEBOOK, ids=rel)
def test_no_date_or_time_of_day_in_a_notebook(path):
    found = [f"cell {i}: {m.group(0)!r}" for i, t in markdown(path) for m in DATE.finditer(t)]
    assert not found, "dates belong in the records and docs/engineering/, not in a lesson: " + "; ".join(found)


SEED = re.compile(r"\bseeds?\b", re.I)
RANDOM_SEED = re.compile(r"\brandom\s+seeds?\b", re.I)


def seed_words(text: str) -> list[str]:
    """Where ``text`` says "seed" as a word, other than "random seed"."""
    return [text[max(0, m.start() - 30):m.end() + 30].replace("\n", " ")
            for m in SEED.finditer(RANDOM_SEED.sub(" ", text))]


def code_text(source: str) -> str:
    """The strings and comments of a code cell: what it prints or says. Names (a ``seed=`` parameter) are code."""
    lines = [("" if line.lstrip().startswith(("%", "!")) else line) for line in source.splitlines(keepends=True)]
    try:
        return " ".join(t.string for t in tokenize.generate_tokens(io.StringIO("".join(lines)).readline)
                        if t.type in (tokenize.STRING, tokenize.COMMENT) or t.type == getattr(tokenize, "FSTRING_MIDDLE", -1))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return " ".join(re.findall(r"#.*|\"[^\"\n]*\"|'[^'\n]*'", source))


@pytest.mark.parametrize("path", EVERY_NOTEBOOK, ids=rel)
def test_no_notebook_says_seed(path):
    nb = json.loads(path.read_text())
    found = []
    for i, c in enumerate(nb["cells"]):
        source = "".join(c["source"])
        if c["cell_type"] == "markdown":
            text = re.sub(r"`[^`\n]*`", " ", source)  # code spans: a parameter named seed
        elif c["cell_type"] == "code":  # a comment may name the parameter: fn(ks, seed), seed=0
            text = re.sub(r"\bseed(?=\s*[=),\]])", " ", code_text(source))
        else:
            text = source
        found += [f"cell {i}: ...{w}..." for w in seed_words(text)]
    found += [f"constant {k!r}: {v}" for k, v in constants(path).items() if seed_words(str(v))]
    assert not found, ("cite the documents the course answers by their titles in docs/sources.md, not as 'the seed': "
                       + "; ".join(found))


def test_a_quoted_source_is_one_of_the_courses_sources():
    titles = re.findall(r"^## (.+)$", (ROOT / "docs/sources.md").read_text(), re.M)
    quoted = {f"{rel(p)}: {k}": str(v) for p in CORE + DEEP for k, v in constants(p).items()
              if str(v).startswith("source:")}
    assert quoted, "no notebook quotes a figure of the course's sources"
    unknown = {k: v for k, v in quoted.items() if not any(v.startswith(f"source: {t}:") or v.startswith(f"source: {t},")
                                                           for t in titles)}
    assert not unknown, f"a 'source: <title>: ...' constant names a heading of docs/sources.md: {unknown}"


def test_the_seed_finder():
    assert seed_words("as the seed material claims") and seed_words("the Seed's formula")
    assert not seed_words("draw it with a random seed of 0") and not seed_words("seeded, seedling")
    assert code_text("rng = np.random.default_rng(seed)\nf(seed=3)  # fixed\n") == "# fixed"
    assert seed_words(code_text('print(f"gain {g:.2f}x (seed: 7x)")'))


@pytest.mark.parametrize("path", CORE + DEEP, ids=rel)
def test_every_figure_typed_into_the_prose_is_a_declared_constant(path):
    declared = constants(path)
    bad_kind = {k: v for k, v in declared.items() if not str(v).startswith(tuple(f"{k}:" for k in KINDS))}
    assert not bad_kind, f"say what kind of constant each is ({', '.join(KINDS)}) and its source: {bad_kind}"
    typed = [(i, f) for i, t in markdown(path) for f in typed_figures(t)]
    undeclared = [f"cell {i}: {f}" for i, f in typed if f not in declared]
    assert not undeclared, (
        "measured figures belong in a cell's output (measured here, or a named record, labelled); a constant goes in "
        "metadata.gpucourse.constants with its kind and source. Undeclared: " + "; ".join(undeclared))
    stale = set(declared) - {f for _, f in typed}
    assert not stale, f"declared constants the prose no longer uses: {sorted(stale)}"


def test_the_figure_finder_finds_measurements_and_not_shapes():
    text = ("It ran at 3,400 GB/s, 0.97x cuBLAS, 1.3x faster, 80 µs, 11% busy, 742 TFLOP/s and 1,000 cycles; "
            "16x16 tiles, a 3 x 3 filter, `2.5x` in code, sm_90a, 2 GiB vectors, 4x4x4 per clock.")
    assert typed_figures(text) == ["3400 GB/s", "0.97x", "1.3x", "80 µs", "11%", "742 TFLOP/s", "1000 cycles"]
    assert DATE.search("recorded on 2026-11-23") and DATE.search("at 13:37 UTC") and DATE.search("November 2026")
    assert not DATE.search("batch 256 at 12:1 ratio, 8:30 of the run")


@pytest.mark.parametrize("path", CORE, ids=rel)
def test_a_long_cuda_region_is_folded_in_a_core_notebook(path):
    long_open = []
    for i, c in enumerate(json.loads(path.read_text())["cells"]):
        text = "".join(c["source"])
        if c["cell_type"] == "code" and re.match(r"# kernels/cuda/\S+, region ", text) \
                and len(text.splitlines()) > FOLD_LINES and not c["metadata"].get("jupyter", {}).get("source_hidden"):
            long_open.append(f"cell {i} ({len(text.splitlines())} lines)")
    assert not long_open, (f"CUDA C regions over {FOLD_LINES} lines open in the core path: {long_open}; fold them "
                           "(metadata.jupyter.source_hidden) or move them to the deep dive")


def test_the_readme_is_read_to_the_end():
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) <= README_WORDS, f"{len(text.split())} words; at most {README_WORDS}"
    assert "notebooks/01_vector_multiply.ipynb" in text and "exercises/01_vector_multiply" in text, \
        "the README says where to start: notebooks/01, then exercises/01"

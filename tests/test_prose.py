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

MONTHS = ("January|February|March|April|May|June|July|August|September|October|November|December"
          "|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sept?|Oct|Nov|Dec")
YEAR = r"(?:19|20)\d\d"
# A date or a time of day in any common form: 2026-11-23, 23/11/2026, 11/23/2026, 26.11.2026, November 2026, Nov 23,
# 2026, 23 Nov. 2026; 13:37 UTC, at 14:05, 14:05:09.
DATE = re.compile(rf"\b{YEAR}-[01]\d-[0-3]\d\b"
                  rf"|\b[0-3]?\d[/.][0-3]?\d[/.]{YEAR}\b"
                  rf"|\b\d{{1,2}}:\d\d(?::\d\d)?\s*(?:UTC|GMT|CET|CEST|[AP]M)\b|\b\d{{1,2}}:\d\d:\d\d\b"
                  rf"|\b(?:at|@)\s+[0-2]?\d:[0-5]\d\b"
                  rf"|\b(?:{MONTHS})\.?\s+(?:[0-3]?\d(?:st|nd|rd|th)?,?\s+)?{YEAR}\b"
                  rf"|\b[0-3]?\d(?:st|nd|rd|th)?\s+(?:of\s+)?(?:{MONTHS})\.?,?\s+{YEAR}\b")
NUMBER = r"(?<![\w./])[-+]?\d[\d,]*(?:\.\d+)?"
# A measured quantity as a learner would read one: a rate, a time (80 µs, 1.2 s, 3 seconds), a ratio (1.3x, not
# 16x16 or 3 x 3; "1.3 times as fast"), a percentage (11%, 84 percent), a count of cycles.
FIGURE = re.compile(
    NUMBER + r"(?:\s?(?:[kKMGTP]?B/s|[KMGT]iB/s|[TGMk]?FLOP/s|T?FLOPS|TOPS|images?/s|tokens?/s"
             r"|µs|us|ms|ns|s|%|cycles)(?![\w/])"
             r"|\s(?:seconds?|percent|per\s?cent)\b"
             r"|\s+times\s+(?:as|faster|slower|more|less|fewer|higher|lower|longer|shorter|larger|smaller|the)\b"
             r"|[x×](?![\w\d])(?!\s*\d))")
TIME_LINE = re.compile(r"^\*\*Time:\*\*.*$", re.M)  # the opening's reading and run times, which a test asks for


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
    text = TIME_LINE.sub(" ", text)
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


# A constant's source names the value in code it states as a dotted path from the repository's packages, with
# subscripts: benchmarks.attention.GOALS['softmax_of_copy']. A goal must name one; every one named is checked.
CODE_REF = re.compile(r"\b(?:benchmarks|kernels|gpucourse)(?:\.\w+)+(?:\[(?:'[^'\]]+'|\"[^\"\]]+\"|\d+)\])*")


def code_value(ref: str):
    """The value ``ref`` (a CODE_REF) names: the longest importable module prefix, then attributes and subscripts."""
    import ast
    import importlib

    path, subs = re.match(r"([\w.]+)((?:\[.*\])*)$", ref).groups()
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            value = getattr(value, name)
        for key in re.findall(r"\[([^\]]+)\]", subs):
            value = value[ast.literal_eval(key)]
        return value
    raise ImportError(ref)


def written_value(figure: str) -> float:
    """The number a figure as written states: "0.9x" -> 0.9, "90%" -> 0.9, "4 ms" -> 4."""
    number = float(re.match(NUMBER, figure).group(0).replace(",", ""))
    return number / 100 if figure.rstrip().endswith("%") else number


@pytest.mark.parametrize("path", CORE + DEEP, ids=rel)
def test_every_declared_goal_is_the_value_in_code_it_names(path):
    """A goal typed into the prose ("the goal is 0.9x of the copy") is the value the code holds: each declared goal
    names that value (benchmarks.attention.GOALS['softmax_of_copy']), and every value a constant names is the
    number its figure writes."""
    unnamed, wrong = [], []
    for figure, source in constants(path).items():
        refs = CODE_REF.findall(str(source))
        if str(source).startswith("goal:") and not refs:
            unnamed.append(figure)
        for ref in refs:
            value = code_value(ref)
            if not isinstance(value, (int, float)) or abs(written_value(figure) - value) > 1e-9 * max(1, abs(value)):
                wrong.append(f"{figure!r} but {ref} = {value!r}")
    assert not unnamed, f"name the value in code each goal states (e.g. benchmarks.lesson.GOALS['key']): {unnamed}"
    assert not wrong, "the prose declares a figure the code no longer holds: " + "; ".join(wrong)


def test_the_goal_check_reads_the_code():
    assert code_value("benchmarks.attention.GOALS['softmax_of_copy']") is __import__("benchmarks.attention").attention\
        .GOALS["softmax_of_copy"]
    assert written_value("90%") == 0.9 and written_value("0.9x") == 0.9 and written_value("1,000 cycles") == 1000
    assert CODE_REF.findall("goal: x (benchmarks.training.GOALS['mixed_speedup'], see benchmarks/training.py)") == \
        ["benchmarks.training.GOALS['mixed_speedup']"]


def test_the_figure_finder_finds_measurements_and_not_shapes():
    text = ("It ran at 3,400 GB/s, 0.97x cuBLAS, 1.3x faster, 80 µs, 11% busy, 742 TFLOP/s and 1,000 cycles; "
            "16x16 tiles, a 3 x 3 filter, `2.5x` in code, sm_90a, 2 GiB vectors, 4x4x4 per clock.")
    assert typed_figures(text) == ["3400 GB/s", "0.97x", "1.3x", "80 µs", "11%", "742 TFLOP/s", "1000 cycles"]
    assert DATE.search("recorded on 2026-11-23") and DATE.search("at 13:37 UTC") and DATE.search("November 2026")
    assert not DATE.search("batch 256 at 12:1 ratio, 8:30 of the run")


@pytest.mark.parametrize("written", ["Nov 23, 2026", "23/11/2026 at 14:05", "26.11.2026", "11/23/2026", "at 14:05",
                                     "23 Nov 2026", "November 23rd, 2026", "Sept. 2026", "2026-11-23", "9:05 PM",
                                     "14:05:09"])
def test_the_date_finder_finds_every_common_form(written):
    assert DATE.search(f"the run of {written} said so"), written


def test_the_date_finder_leaves_ordinary_text():
    for text in ("version 12.4.1 of the driver", "a 3/4 share", "ratio 16:9 and 4:3",
                 "sm_90a, 2 GiB, 128 x 128 tiles", "page 2/3", "Nov is not a date", "in 2026 the GPU", "8:30 of the run",
                 "10.0.2 in 1999 steps"):
        assert not DATE.search(text), text


def test_the_figure_finder_finds_figures_in_words():
    text = "it ran 1.3 times as fast, took 1.2 s, then 3 seconds; 84 percent busy, 2.5 times faster than 80 per cent"
    assert typed_figures(text) == ["1.3 times as", "1.2 s", "3 seconds", "84 percent", "2.5 times faster",
                                   "80 per cent"]
    assert typed_figures("3 times the launches, 2 sets, 4 SMs, 12 bytes, 3 stages, sm_90s, lesson 4's") == \
        ["3 times the"]
    assert typed_figures("**Time:** about 40 minutes to read; the cells run in under 2 minutes and 30 s in CPU mode.") == []


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

"""Every term a core notebook uses is defined where it first appears or linked there to its glossary entry.

The convention, simple enough to check:

- A glossary entry that notebooks link carries an anchor: ``- <a id="cuda"></a>**CUDA**: ...`` in
  docs/glossary.md. A notebook links it as ``[CUDA](../docs/glossary.md#cuda)``. Every such link in any notebook
  (core, deep dive, solution) must name an anchor the glossary has (or a heading's anchor).
- TERMS lists, per core notebook, the terms it must introduce properly (the tools and names a newcomer meets
  without a definition otherwise). For each, the first markdown cell that mentions it (case-insensitive, whole
  word, code spans left out) must either define it, in italics or bold (``*term*``, ``**term**``), or link its
  glossary anchor; and the glossary must hold that anchor.

Add a notebook's terms here when you write its lesson; add the anchor to the glossary entry when you link it.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "docs" / "glossary.md"

# notebook -> {term as the text writes it: its glossary anchor}
TERMS = {
    "01_vector_multiply": {
        "CUDA": "cuda", "Numba": "numba", "CuPy": "cupy", "cudaMemcpy": "cudamemcpy", "NVRTC": "nvrtc",
        "PTX": "ptx", "SASS": "sass", "cuBLAS": "cublas", "cuDNN": "cudnn", "FP32": "fp32", "FP16": "fp32",
        "NVML": "nvml", "simulator": "simulator",
    },
    "02_warp_divergence": {
        "SIMT": "simt", "program counter": "program-counter", "divergence": "divergence",
        "active mask": "active-mask", "reduction": "reduction", "shared memory": "shared-memory",
        "barrier": "barrier", "atomic": "atomic", "warp shuffle": "warp-shuffle", "CUB": "cub", "Volta": "volta",
        "independent thread scheduling": "independent-thread-scheduling", "data race": "data-race",
    },
}
LINK = re.compile(r"\]\(\.\./docs/glossary\.md#([\w-]+)\)")


def anchors() -> set[str]:
    text = GLOSSARY.read_text()
    ids = set(re.findall(r'<a id="([\w-]+)"></a>', text))
    heads = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}
    return ids | heads


def markdown_cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"]


def prose(text: str) -> str:
    """The text without code blocks and code spans (a term in `code` is code, not the term)."""
    return re.sub(r"`[^`\n]*`", " ", re.sub(r"```.*?```", " ", text, flags=re.S))


def mentions(term: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(term)}(?![\w-])", prose(text), re.I) is not None


def defines(term: str, text: str) -> bool:
    return re.search(rf"\*\*?{re.escape(term)}s?\*?\*", prose(text), re.I) is not None


@pytest.mark.parametrize("path", sorted(ROOT.glob("notebooks/*.ipynb")) + sorted(ROOT.glob("solutions/*/*.ipynb")),
                         ids=lambda p: p.stem)
def test_every_glossary_link_names_an_entry(path):
    have = anchors()
    links = {a for text in markdown_cells(path) for a in LINK.findall(text)}
    assert links <= have, f"links to glossary anchors it lacks: {sorted(links - have)} (add <a id=...></a>)"


@pytest.mark.parametrize("lesson", sorted(TERMS))
def test_marked_terms_are_defined_or_linked_where_they_first_appear(lesson):
    cells = markdown_cells(ROOT / "notebooks" / f"{lesson}.ipynb")
    have = anchors()
    problems = []
    for term, anchor in TERMS[lesson].items():
        if anchor not in have:
            problems.append(f"{term}: docs/glossary.md has no anchor #{anchor}")
        first = next((i for i, text in enumerate(cells) if mentions(term, text)), None)
        if first is None:
            problems.append(f"{term}: not used (take it off TERMS)")
            continue
        text = cells[first]
        if not (defines(term, text) or f"](../docs/glossary.md#{anchor})" in text):
            problems.append(f"{term}: markdown cell {first} uses it first, without *{term}* or a link to "
                            f"../docs/glossary.md#{anchor}")
    assert not problems, "\n".join(problems)


def test_the_convention_is_checkable():
    assert defines("PTX", "first to *PTX*, a portable") and not defines("PTX", "first to PTX")
    assert mentions("CUDA", "a CUDA kernel") and not mentions("CUDA", "`numba.cuda`") and not mentions("CUB", "cuBLAS")
    assert "cuda" in anchors() or True  # anchors() parses; the lessons' tests say which must be there

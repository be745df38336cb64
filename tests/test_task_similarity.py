"""No graded task's answer is a copy of the lesson's code: every solution region (``### BEGIN SOLUTION`` ...
``### END SOLUTION``) of every solution notebook is compared with every code cell of its lesson's notebooks (core
and deep dive) and with its lesson's kernel sources, and the test fails when a region of at least MIN_LINES lines
matches some window of them with a similarity of THRESHOLD or more.

The measure: both sides become token streams (words, numbers and single punctuation marks; comments, blank space
and a cell's or file's layout dropped; identifiers kept as written, so that renaming the lesson's variables alone
does not lower the score much, while the same words in another order do); the score of a region is the best
``difflib.SequenceMatcher`` ratio of its stream against any window of the same length (slid by an eighth of it)
of one lesson cell or source file. 1.0 is a verbatim copy. A region that applies the lesson's idea to another
operation, shape, layout or schedule scores below 0.6; the copies this test was written against scored above 0.85
(Task 4.1's loop body, the lesson's gemm_tiled, 0.99; the window slides in steps, so a verbatim copy may score a
little below 1).

``python tests/test_task_similarity.py`` prints every region's best score and where it matched."""
from __future__ import annotations

import difflib
import json
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THRESHOLD = 0.75  # a region scoring this or more against a lesson window is a near copy
MIN_LINES = 4  # regions shorter than this (a constant, a letter, a one-line call) are answers, not code to copy

# Solutions still near copies of their lesson, each to be reworked as Tasks 4.1, 4.2, 7.5, 9.1 and 10.6 were (the same
# idea applied to another operation, shape, layout or schedule): none today. A name listed here is expected to fail,
# strictly: once it is reworked its test passes, fails as "XPASS", and its line goes.
KNOWN_COPIES: dict = {}

# The kernel sources of each lesson, besides the code cells of notebooks/NN_*.ipynb.
SOURCES = {
    "01": ["kernels/vector_multiply.py", "kernels/cuda/vector_multiply.cu"],
    "02": ["kernels/warp_divergence.py", "kernels/warp_divergence_model.py", "kernels/cuda/warp_divergence.cu"],
    "03": ["kernels/memory.py", "kernels/memory_model.py", "kernels/cuda/memory.cu"],
    "04": ["kernels/tensor_cores.py", "kernels/cuda/tensor_cores.cu", "kernels/cuda/tensor_cores_wgmma.cu"],
    "05": ["kernels/convolution.py", "kernels/cuda/convolution.cu", "kernels/cuda/convolution_wgmma.cu"],
    "06": ["kernels/inference_engine", "kernels/cuda/inference_engine.cu", "kernels/cuda/inference_engine_network.cu"],
    "07": ["kernels/collectives", "kernels/cuda/collectives.cu"],
    "08": ["kernels/feeding_the_gpu.py"],
    "09": ["kernels/training.py"],
    "10": ["kernels/attention", "kernels/cuda/attention.cu", "kernels/cuda/attention_mma.cu"],
}

TOKEN = re.compile(r"[A-Za-z_]\w*|\d[\w.]*|\S")
COMMENT = re.compile(r"(?<![:\"'])//[^\n]*|#(?!include|define|pragma|if|endif|else)[^\n]*")


def tokens(text: str) -> tuple:
    """The token stream of Python or CUDA C source: comments and blank space dropped."""
    return tuple(TOKEN.findall(COMMENT.sub(" ", text)))


def solution_regions(path: Path):
    """(cell id, region text) of every solution region of a solution notebook."""
    for cell in json.loads(path.read_text())["cells"]:
        source = "".join(cell["source"])
        for match in re.finditer(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", source, re.S):
            yield cell.get("id"), match.group(1)


def code_lines(text: str) -> int:
    return sum(1 for line in COMMENT.sub("", text).splitlines() if line.strip())


@lru_cache(maxsize=None)
def lesson_streams(lesson: str) -> tuple:
    """(where, token stream) of every code cell of the lesson's notebooks and of every kernel source file."""
    streams = []
    for nb in sorted((ROOT / "notebooks").glob(f"{lesson}_*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] == "code":
                streams.append((f"{nb.name} cell {i}", tokens("".join(cell["source"]))))
    for name in SOURCES.get(lesson, []):
        path = ROOT / name
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            if file.exists():
                streams.append((str(file.relative_to(ROOT)), tokens(file.read_text())))
    return tuple(streams)


def best_match(region: tuple, streams) -> tuple:
    """(score, where) of the lesson window most like ``region``."""
    matcher = difflib.SequenceMatcher(autojunk=False)
    matcher.set_seq2(region)
    n, step = len(region), max(1, len(region) // 8)
    best = (0.0, "")
    for where, stream in streams:
        starts = range(0, max(1, len(stream) - n + 1), step)
        for start in list(starts) + ([len(stream) - n] if len(stream) > n else []):
            matcher.set_seq1(stream[start:start + n])
            if matcher.real_quick_ratio() <= best[0] or matcher.quick_ratio() <= best[0]:
                continue
            score = matcher.ratio()
            if score > best[0]:
                best = (score, where)
    return best


def all_regions():
    """(lesson notebook, cell id, lines, region text) of every solution region long enough to compare."""
    for path in sorted((ROOT / "solutions").glob("*/*.ipynb")):
        for cell_id, text in solution_regions(path):
            if code_lines(text) >= MIN_LINES:
                yield path, cell_id, code_lines(text), text


def scores():
    for path, cell_id, lines, text in all_regions():
        lesson = path.parent.name[:2]
        score, where = best_match(tokens(text), lesson_streams(lesson))
        yield f"{path.parent.name}/{cell_id}", lines, score, where


REGIONS = list(all_regions())


def test_there_are_regions_to_compare():
    assert len({path.parent.name for path, *_ in REGIONS}) >= 9


def test_a_copy_scores_one_and_a_rewrite_less():
    """The measure itself: the lesson's gemm_tiled loop scores near 1 against lesson 4; the same idea for Y = X W^T,
    W's tile read along its rows and stored transposed (Task 4.1 now), and unrelated code score below the threshold."""
    streams = lesson_streams("04")
    copy = tokens("""
        sa[ty, tx] = A[row, k0 + tx] if row < M and k0 + tx < K else np.float32(0.0)
        sb[ty, tx] = B[k0 + ty, col] if k0 + ty < K and col < N else np.float32(0.0)
        cuda.syncthreads()
        for k in range(TILE):
            acc += sa[ty, k] * sb[k, tx]
        cuda.syncthreads()
    """)
    assert best_match(copy, streams)[0] >= 0.95
    rewrite = tokens("""
        sx[ty, tx] = X[row, k0 + tx] if row < M and k0 + tx < K else np.float32(0.0)
        w_row = cuda.blockIdx.x * TILE + ty
        swt[tx, ty] = W[w_row, k0 + tx] if w_row < N and k0 + tx < K else np.float32(0.0)
        cuda.syncthreads()
        for k in range(TILE):
            acc += sx[ty, k] * swt[k, tx]
        cuda.syncthreads()
    """)
    assert best_match(rewrite, streams)[0] < THRESHOLD
    assert best_match(tokens("x = 1\ny = 2\nz = x + y\nprint(z)\n"), streams)[0] < 0.5


def _param(path, cell_id, lines, text):
    name = f"{path.parent.name}/{cell_id}"
    marks = [pytest.mark.xfail(strict=True, reason=f"still a near copy of {KNOWN_COPIES[name]}")] if name in KNOWN_COPIES else []
    return pytest.param(path, cell_id, lines, text, id=name, marks=marks)


def test_known_copies_are_solution_regions():
    names = {f"{p.parent.name}/{c}" for p, c, *_ in REGIONS}
    assert set(KNOWN_COPIES) <= names, set(KNOWN_COPIES) - names


@pytest.mark.parametrize("path,cell_id,lines,text", [_param(*r) for r in REGIONS])
def test_solution_is_not_a_copy_of_the_lesson(path, cell_id, lines, text):
    score, where = best_match(tokens(text), lesson_streams(path.parent.name[:2]))
    assert score < THRESHOLD, (f"{path.parent.name}, cell {cell_id}: the solution ({lines} lines) matches {where} "
                               f"with similarity {score:.2f} (at most {THRESHOLD} allowed): ask for the idea "
                               "applied differently, not the lesson's code again")


if __name__ == "__main__":
    for name, lines, score, where in scores():
        print(f"{score:.2f}  {'COPY ' if score >= THRESHOLD else '     '}{name} ({lines} lines) ~ {where}")

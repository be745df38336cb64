"""Reading a submitted notebook and repairing it against its source: the exercise's cells put back in the
source's order, locked cells restored, deleted answers made to fail, forged nbgrader metadata dropped.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from .. import runtime
from .integrity import solution_answers, integrity_findings, protected_names, source_text
from .settings import MAX_CODE_CHARS, MAX_NOTEBOOK_BYTES


def read_notebook(path: Path) -> dict:
    """A submitted file as notebook JSON (nbformat 4), or CourseInputError saying why it is not one."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise runtime.CourseInputError(f"cannot read {path}: {exc.strerror}") from None
    if size > MAX_NOTEBOOK_BYTES:
        raise runtime.CourseInputError(f"{path.name} is {size / 2**20:.0f} MiB; the grader reads notebooks of at "
                                       f"most {MAX_NOTEBOOK_BYTES // 2**20} MiB (clear its outputs and save again)")
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, OSError) as exc:
        raise runtime.CourseInputError(f"{path.name} is not a notebook ({exc})") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells", nb.get("worksheets")), list):
        raise runtime.CourseInputError(f"{path.name} is not a notebook (no list of cells)")
    if nb.get("nbformat") != 4:
        try:
            import nbformat

            nb = json.loads(nbformat.writes(nbformat.convert(nbformat.from_dict(nb), 4)))
        except Exception as exc:  # noqa: BLE001 - any failure means: not a notebook we can read
            raise runtime.CourseInputError(f"{path.name} is not an nbformat 4 notebook ({exc})") from None
    return nb


def grade_id_of(cell) -> str | None:
    """A cell's nbgrader grade_id, whatever shape the learner left its metadata in."""
    meta = cell.get("metadata") if isinstance(cell, dict) else None
    nbg = meta.get("nbgrader") if isinstance(meta, dict) else None
    gid = nbg.get("grade_id") if isinstance(nbg, dict) else None
    return gid if isinstance(gid, str) and gid else None


def _cell_type(cell) -> str:
    kind = cell.get("cell_type") if isinstance(cell, dict) else None
    return kind if kind in ("code", "markdown", "raw") else "markdown"


def _new_cell(kind: str, text: str, metadata: dict | None = None) -> dict:
    cell = {"cell_type": kind, "metadata": json.loads(json.dumps(metadata or {})), "source": text}
    if kind == "code":
        cell["outputs"], cell["execution_count"] = [], None
    return cell



def prepare_submission(learner: dict, source: dict, release: dict | None = None) -> tuple[dict, list[str]]:
    """The learner's notebook rebuilt on the exercise's skeleton, and a note for every repair.

    * The exercise's cells (those with a grade_id in the source) come in the source's order. Locked cells are
      the source's own (edits, deletions, retyping, metadata and tags undone). An answer cell keeps the
      learner's text with the source's type and metadata; a deleted one becomes a cell that raises.
    * A second copy of a locked cell is dropped; of an answer cell, it runs as an ordinary cell. A cell that
      claims a grade_id the exercise does not have runs as an ordinary cell.
    * Cells the learner added stay after the exercise cell they followed (or first, if they came first),
      with their metadata dropped (a "skip-execution" tag would otherwise stop a cell from running).
    * Every code cell the learner wrote is checked against the integrity rules; a cell that breaks one is
      replaced by a cell that raises PermissionError with the findings (its code follows as comments).
    release: the released exercise, to tell an unchanged locked cell (as released, without the hidden
    tests) from an edited one.
    """
    raw = learner.get("cells")
    if not isinstance(raw, list):
        raise runtime.CourseInputError("the notebook has no list of cells")
    notes: list[str] = []
    src_cells = source["cells"]
    src_by_gid = {g: c for c in src_cells if (g := grade_id_of(c))}
    if not any(grade_id_of(c) in src_by_gid for c in raw):
        raise runtime.CourseInputError("it has none of the exercise's cells: work in a copy of the released "
                                       "exercise, which carries what the grader needs")
    rel_by_gid = {g: c for c in (release or {}).get("cells", []) if (g := grade_id_of(c))}

    def nbg(cell):
        return cell["metadata"]["nbgrader"]

    known: dict[str, dict] = {}
    after: dict[str | None, list[dict]] = {None: []}  # exercise cell -> cells the learner added after it
    order: list[str] = []
    current = None
    dropped = 0
    for cell in raw:
        if not isinstance(cell, dict):
            dropped += 1
            continue
        g = grade_id_of(cell)
        if g in src_by_gid and g not in known:
            known[g], current = cell, g
            order.append(g)
            after.setdefault(g, [])
            continue
        if g in src_by_gid and nbg(src_by_gid[g]).get("locked"):
            notes.append(f"cell {g} appeared more than once; the extra copy was removed")
            continue
        if g in src_by_gid:
            notes.append(f"cell {g} appeared more than once; the first copy is graded as your answer, "
                         "the others ran as ordinary cells")
        elif g is not None:
            notes.append(f"a cell claimed grade id {g!r}, which this exercise does not have; it ran as an "
                         "ordinary cell")
        after[current].append(_new_cell(_cell_type(cell), source_text(cell)))
    if dropped:
        notes.append(f"{dropped} entr{'y' if dropped == 1 else 'ies'} of the notebook's cell list "
                     f"{'was' if dropped == 1 else 'were'} not a cell and {'was' if dropped == 1 else 'were'} ignored")
    if order != [g for g in (grade_id_of(c) for c in src_cells) if g in known]:
        notes.append("cells had been moved; the exercise's cells were put back in their order "
                     "(cells you added stay after the cell they followed)")

    cells = list(after[None])
    for scell in src_cells:
        g = grade_id_of(scell)
        if g is None:  # a cell without nbgrader metadata: the learner's copy, if any, is an added cell
            continue
        meta, mine, kind = nbg(scell), known.get(g), scell["cell_type"]
        if meta.get("solution") and not meta.get("locked"):
            if mine is None:
                text = (f'raise NotImplementedError("the cell {g} (your answer) was deleted from this '
                        f'notebook")' if kind == "code" else "(deleted)")
                notes.append(f"your answer cell {g} had been deleted; the tests that need it fail")
            else:
                text = source_text(mine)
                if _cell_type(mine) != kind:
                    notes.append(f"your answer cell {g} had been changed to {_cell_type(mine)}; it ran as {kind}")
            cells.append(_new_cell(kind, text, scell["metadata"]))
        else:
            cells.append(_new_cell(kind, source_text(scell), scell["metadata"]))
            if mine is None:
                notes.append(f"cell {g} had been deleted; it was put back and run")
            elif _cell_type(mine) != kind:
                notes.append(f"cell {g} had been changed to {_cell_type(mine)}; it was put back as {kind}")
            elif source_text(mine) not in (source_text(scell), source_text(rel_by_gid.get(g, scell))):
                notes.append(f"cell {g} had been edited; it was run as written in the solution")
        cells.extend(after.get(g, []))

    # The integrity rules, on every code cell the learner wrote.
    protected, same = protected_names(src_cells)
    answers = solution_answers(source)
    written = sum(len(c["source"]) for c in cells if not (grade_id_of(c) and nbg(c).get("locked")))
    if written > MAX_CODE_CHARS:
        raise runtime.CourseInputError(f"the notebook holds {written} characters of your cells; the grader runs "
                                       f"at most {MAX_CODE_CHARS}")
    for number, cell, name, why in refused_cells(cells, protected, same, answers):
        if why:
            notes.append(f"{name} was not run: {why}")
            commented = "\n".join("# " + line for line in cell["source"].splitlines())
            cell["source"] = (f"raise PermissionError({('the grader did not run this cell: ' + why)!r})\n"
                              f"# Your code, not run:\n{commented}")
    used: set[str] = set()
    for number, cell in enumerate(cells):
        base = re.sub(r"[^A-Za-z0-9_-]", "-", grade_id_of(cell) or f"cell-{number}")[:60] or f"cell-{number}"
        cid, k = base, 1
        while cid in used:
            cid, k = f"{base[:56]}-{k}", k + 1
        used.add(cid)
        cell["id"] = cid
    metadata = json.loads(json.dumps(source.get("metadata", {})))
    return {"cells": cells, "metadata": metadata, "nbformat": 4, "nbformat_minor": 5}, notes


def refused_cells(cells, protected, same, answers):
    """(number, cell, name, why) for each code cell a learner writes (every cell but the read-only ones with a
    grade id): ``why`` is what the integrity rules find in it, "" where nothing. ``grade`` and ``run`` both
    judge a notebook's cells by this (``integrity_notes``)."""
    for number, cell in enumerate(cells, 1):
        g = grade_id_of(cell)
        meta = cell.get("metadata") if isinstance(cell.get("metadata"), dict) else {}
        locked = isinstance(meta.get("nbgrader"), dict) and meta["nbgrader"].get("locked")
        if cell.get("cell_type") != "code" or (g and locked):
            continue
        findings = integrity_findings(source_text(cell), protected=protected, same=same, answers=answers)
        name = f"cell {g}" if g else f"cell {number} (one you added)"
        why = "; ".join(findings[:5]) + (f"; and {len(findings) - 5} more" if len(findings) > 5 else "")
        yield number, cell, name, why


def integrity_notes(cells, answers=None) -> list[str]:
    """What the grader would refuse to run among ``cells`` (an exercise or a learner's copy of it, as dicts),
    judged against its own read-only cells, as ``grade`` judges against the solution's: one note a cell."""
    cells = [dict(c) for c in cells]
    protected, same = protected_names(cells)
    return [f"{name} would not be run by the grader: {why}"
            for _, _, name, why in refused_cells(cells, protected, same, answers or {}) if why]

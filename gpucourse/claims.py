"""Statements a notebook makes about its figures, printed by a function that reads the figures, so that a records
test can run the same function over every record (lesson 5's ``reading`` is the pattern).

A reading is a list of (statement, holds): holds is True, False, or None where the figures lack what the statement
needs. ``compare`` writes a comparison's words from the relation it tests, so that reversing the words reverses the
test; ``view`` shows readings side by side (this run, the record).
"""
from __future__ import annotations

import textwrap

from gpucourse import plots

# relation -> test of a against b, with a margin (a share of b)
RELATIONS = {
    "below": lambda a, b, m: a < b * (1 - m),
    "above": lambda a, b, m: a > b * (1 + m),
    "level with": lambda a, b, m: abs(a - b) <= m * abs(b),
    "no faster than": lambda a, b, m: a <= b * (1 + m),
    "no slower than": lambda a, b, m: a >= b * (1 - m),
}


def holds(test) -> bool | None:
    """test() as True or False; None where the figures lack what it needs (a missing row or key)."""
    try:
        out = test()
    except (KeyError, IndexError, StopIteration, TypeError, ValueError, ZeroDivisionError):
        return None
    except RuntimeError as exc:  # a next() that found no row, inside a generator, arrives as a RuntimeError
        if isinstance(exc.__cause__, StopIteration):
            return None
        raise
    return None if out is None else bool(out)


def every(rows, test) -> bool | None:
    """Whether test(row) holds for every row: True or False; None where there are no rows or a row lacks what the
    test needs (``holds``)."""
    return holds(lambda: all(test(r) for r in rows) if rows else None)


def compare(subject: str, relation: str, other: str, a, b, margin: float = 0.0, how: str = "") -> tuple:
    """("subject: relation other[ how]", whether a stands in ``relation`` to b within ``margin``): the words come
    from the relation tested. ``a`` and ``b`` are numbers or functions returning them (None where missing)."""
    if relation not in RELATIONS:
        raise ValueError(f"relation {relation!r}: one of {sorted(RELATIONS)}")
    margin_words = f" (within {margin:.0%})" if relation == "level with" and margin else ""
    text = f"{subject}: {relation} {other}{margin_words}{(' ' + how) if how else ''}"

    def test():
        x = a() if callable(a) else a  # not in a generator: a StopIteration there would become a RuntimeError
        y = b() if callable(b) else b
        return RELATIONS[relation](x, y, margin)
    return text, holds(test)


def lines(reading: list, width: int = 100) -> str:
    """A reading as text, one statement a line after whether it holds ("yes", "NO", "-" where a figure lacks
    it), wrapped at ``width`` characters: what a notebook prints under the figures it checks."""
    word = {True: "yes", False: "NO", None: "-"}
    return "\n".join(textwrap.fill(statement, width, initial_indent=f"{word[ok]:>3}  ", subsequent_indent=" " * 7)
                     for statement, ok in reading)


def view(checks: dict, title: str = "What the text says, checked", source: str = "") -> plots.Table:
    """Statements and whether each holds, one column per source: ``checks`` {label: reading}, the labels in the
    header ("this run", "the record"); "-" where a figure lacks it."""
    labels = list(checks)
    word = {True: "yes", False: "NO", None: "-"}
    rows = [[statement, *(word[checks[label][i][1]] for label in labels)]
            for i, (statement, _) in enumerate(checks[labels[0]])]
    return plots.table(["statement", *labels], rows, title=title, source=source, align="l" + "l" * len(labels))

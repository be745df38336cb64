"""The grader's small text helpers, in one place: every other room of the grader may use them."""
from __future__ import annotations

import re

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # terminal colours in tracebacks nbgrader keeps


def as_text(x) -> str:
    """A notebook's text field (a string or a list of strings) as one string, without terminal colours."""
    if isinstance(x, list):
        x = "".join(s for s in x if isinstance(s, str))
    return ANSI.sub("", x if isinstance(x, str) else "")


def first_lines(text: str, lines: int = 3, chars: int = 400) -> str:
    """The first ``lines`` lines of a message, at most ``chars`` characters."""
    text = "\n".join(as_text(text).strip().splitlines()[:lines])
    return text if len(text) <= chars else text[: chars - 3] + "..."


def tail(text: str, lines: int = 30) -> str:
    """The last ``lines`` lines of a process's output."""
    return "\n".join(text.strip().splitlines()[-lines:])


def number(x: float) -> str:
    """A score as people write it: 2, 1.5, 0.25."""
    return f"{x:.2f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))

"""The course's figures: a roofline, bars against a ceiling or a goal, stacked bars (where a call's time goes),
measured lines against a model.

Every figure carries its source: "measured here on <GPU>" or "recorded on <GPU> on <date>" (``source``),
so recorded numbers are never mistaken for the learner's own.
"""
from __future__ import annotations

import os
import re

import numpy as np

from .runtime import CourseInputError


def _plt():
    import matplotlib.pyplot as plt

    return plt



def _finish(ax, title: str, source: str):
    ax.set_title(f"{title}\n{source}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.figure.tight_layout()
    return ax.figure


def roofline(*, bandwidth_gbps: float, peaks_tflops: dict, points: dict, source: str, title: str = "Roofline"):
    """Attainable TFLOP/s against arithmetic intensity (FLOP per byte of device memory traffic).

    peaks_tflops: {"FP32 (cuBLAS)": 51.0, ...}; points: {"kernel": (intensity, tflops)}.
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    intens = np.logspace(-2, 4, 400)
    for label, peak in peaks_tflops.items():
        roof = np.minimum(peak, bandwidth_gbps * intens / 1e3)
        ax.loglog(intens, roof, label=f"{label}: {peak:.1f} TFLOP/s", lw=2)
        ridge = peak * 1e3 / bandwidth_gbps
        ax.axvline(ridge, ls=":", color="grey", lw=0.8)
    ax.plot([], [], " ", label=f"memory: {bandwidth_gbps:.0f} GB/s (measured copy)")
    for name, (x, y) in points.items():
        ax.loglog([x], [y], "o", ms=7, label=f"{name}: {y:.3g} TFLOP/s")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=8, loc="lower right")
    return _finish(ax, title, source)


def number(v: float) -> str:
    """A figure's value as a label: whole numbers from 100 up (with thousands separators), three significant
    digits below, so 1.17 µs does not read "1 µs"."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def wrap(text: str, width: int = 100, indent: str = "    ") -> str:
    """``text`` with every line longer than ``width`` broken at spaces, its continuations indented by ``indent``
    more than the line itself: printed text that fits a notebook cell at JupyterLab's default width."""
    import textwrap

    out = []
    for line in str(text).splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        lead = line[:len(line) - len(line.lstrip())]
        out += textwrap.wrap(line.lstrip(), width, initial_indent=lead, subsequent_indent=lead + indent,
                             break_long_words=False, break_on_hyphens=False)
    return "\n".join(out)


def bars(values: dict, *, unit: str, source: str, title: str, ceiling: tuple | None = None,
         goal: tuple | None = None):
    """Horizontal bars (one per kernel or library call), with an optional (label, value) ceiling (each bar's
    fraction of it printed beside the bar) or an optional (label, value) goal (a line only)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(values) + 1.8))
    names = list(values)
    vals = [values[k] for k in names]
    ax.barh(names, vals, color="tab:blue")
    for i, v in enumerate(vals):
        text = f"{number(v)} {unit}" + (f"  ({v / ceiling[1]:.2f}x)" if ceiling else "")
        ax.text(v, i, " " + text, va="center", fontsize=8)
    for line, style in ((ceiling, "--"), (goal, ":")):
        if line:
            ax.axvline(line[1], color="tab:red", ls=style, label=f"{line[0]}: {number(line[1])} {unit}")
    if ceiling or goal:
        ax.legend(fontsize=8, loc="lower right")
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_xlim(0, max(vals + [line[1] for line in (ceiling, goal) if line]) * 1.35)
    return _finish(ax, title, source)


def stacked(rows: dict, *, unit: str, source: str, title: str, goal: tuple | None = None):
    """Horizontal bars split into parts (where one call's time goes): rows {bar: {part: value}}, every bar the
    same parts in the same order, each part one colour; the bar's total printed at its end; an optional (label,
    value) goal as a line."""
    plt = _plt()
    names = list(rows)
    parts = list(rows[names[0]]) if names else []
    if any(list(rows[n]) != parts for n in names):
        raise CourseInputError(f"stacked: every bar needs the parts {parts}, in that order")
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(names) + 2.4))
    left = np.zeros(len(names))
    for i, part in enumerate(parts):
        vals = np.array([rows[n][part] for n in names], dtype=float)
        ax.barh(names, vals, left=left, label=part, color=plt.get_cmap("tab20")(i))
        left += vals
    for i, total in enumerate(left):
        ax.text(total, i, f" {number(total)} {unit}", va="center", fontsize=8)
    if goal:
        ax.axvline(goal[1], color="tab:red", ls=":", label=f"{goal[0]}: {number(goal[1])} {unit}")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_xlim(0, max(list(left) + ([goal[1]] if goal else [])) * 1.2)
    return _finish(ax, title, source)


def lines(series: dict, *, xlabel: str, ylabel: str, source: str, title: str, models: dict | None = None,
          levels: dict | None = None, logx: bool = True, logy: bool = True):
    """Measured series as markers, model curves as dashed lines, ceilings as horizontal lines.

    series and models: {name: (xs, ys)}; levels: {name: y}.
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, "o-", label=name, ms=4)
    for name, (xs, ys) in (models or {}).items():
        ax.plot(xs, ys, "--", label=name)
    for name, y in (levels or {}).items():
        ax.axhline(y, color="tab:red", ls="--", lw=1, label=f"{name}: {number(y)}")
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    return _finish(ax, title, source)


FIGURES_ENV = "GPUCOURSE_FIGURES"  # a folder where notebooks run headless leave their live figures


class LiveCurves:
    """Training curves drawn while training runs (the DIGITS view): one panel per metric, redrawn in place
    through an IPython display handle (one output, not one figure per update), at most every ``every`` steps.
    Run headless (no IPython kernel, e.g. a script), nothing is drawn until ``close()``, which saves the figure
    to ``save_to`` (default ``training_curves.png``). In a notebook ``close(save_to=...)`` saves it too, and so
    does every ``close()`` of a notebook run headless with ``python -m gpucourse run --save DIR``: the figure
    goes to DIR (FIGURES_ENV names the folder), named after its title.

        curves = plots.LiveCurves(("loss", "accuracy"), title="MLP on the GPU", source=source)
        for step in range(n):
            ...
            curves.update(step, loss=loss, accuracy=acc)
        curves.close()
    """

    def __init__(self, metrics=("loss", "accuracy"), *, title: str = "Training", source: str = "",
                 every: int = 10, save_to: str | None = None):
        if every < 1 or not metrics:
            raise CourseInputError("LiveCurves needs at least one metric and every >= 1")
        self.metrics, self.title, self.source, self.every, self.save_to = tuple(metrics), title, source, every, save_to
        self.data = {m: ([], []) for m in self.metrics}
        self.calls = 0
        self.handle = None
        self.interactive = _in_kernel()
        plt = _plt()
        self.fig, axes = plt.subplots(1, len(self.metrics), figsize=(4 * len(self.metrics) + 1, 3.4), squeeze=False)
        self.axes = dict(zip(self.metrics, axes[0]))
        self.fig.suptitle(f"{title}\n{source}" if source else title, fontsize=10)
        self.lines = {}
        for m, ax in self.axes.items():
            (self.lines[m],) = ax.plot([], [], "-", lw=1.5)
            ax.set_xlabel("step")
            ax.set_ylabel(m)
            ax.grid(True, alpha=0.3)
        self.fig.tight_layout()
        if self.interactive:
            plt.close(self.fig)  # shown only through the handle, not again at the end of the cell

    def update(self, step: float, **values) -> None:
        unknown = set(values) - set(self.metrics)
        if unknown:
            raise CourseInputError(f"unknown metrics {sorted(unknown)}; this figure draws {list(self.metrics)}")
        for m, v in values.items():
            xs, ys = self.data[m]
            xs.append(float(step))
            ys.append(float(v))
        self.calls += 1
        if self.calls % self.every == 0:
            self._draw()

    def _draw(self) -> None:
        for m, (xs, ys) in self.data.items():
            self.lines[m].set_data(xs, ys)
            ax = self.axes[m]
            ax.relim()
            ax.autoscale_view()
            if ys:
                ax.set_title(f"{m}: {ys[-1]:.4g}", fontsize=9)
        if self.interactive:
            from IPython.display import display

            if self.handle is None:
                self.handle = display(self.fig, display_id=True)
            else:
                self.handle.update(self.fig)

    def close(self, save_to: str | None = None):
        """Draw the last state; save it (always when headless). Returns the figure."""
        self._draw()
        folder = os.environ.get(FIGURES_ENV)
        default = (os.path.join(folder, re.sub(r"[^a-z0-9]+", "_", self.title.lower()).strip("_") + ".png")
                   if folder else None if self.interactive else "training_curves.png")
        path = save_to or self.save_to or default
        if path:
            self.fig.savefig(path, dpi=100)
            self.saved = path
        return self.fig


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython

        ip = get_ipython()
    except ImportError:
        return False
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


class Table:
    """A table a notebook shows as HTML (it fits any cell width: no wrapped rows) and a terminal prints as aligned
    text. ``table(header, rows, title=..., source=...)`` makes one; as a cell's last expression it renders, and
    ``print(t)`` or ``str(t)`` gives the text."""

    def __init__(self, header, rows, *, title: str = "", source: str = "", align: str = ""):
        self.header = [str(h) for h in header]
        self.rows = [[_cell(v) for v in row] for row in rows]
        if any(len(r) != len(self.header) for r in self.rows):
            raise CourseInputError(f"every row needs {len(self.header)} cells, one per column of {self.header}")
        # "l" or "r" per column; by default numbers (after the first column) align right
        self.align = align or "l" + "".join("r" if all(_numeric(r[i]) for r in self.rows) else "l"
                                           for i in range(1, len(self.header)))
        self.title, self.source = title, source

    def __str__(self) -> str:
        widths = [max([len(h)] + [len(r[i]) for r in self.rows]) for i, h in enumerate(self.header)]

        def line(cells):
            return "  ".join(c.rjust(w) if a == "r" else c.ljust(w)
                             for c, w, a in zip(cells, widths, self.align)).rstrip()

        out = [self.title] if self.title else []
        out += [line(self.header), line(["-" * w for w in widths]), *map(line, self.rows)]
        return "\n".join(out + ([f"({self.source})"] if self.source else []))

    __repr__ = __str__

    def _repr_html_(self) -> str:
        import html

        def row(cells, tag):
            return "<tr>" + "".join(f'<{tag} style="text-align:{"right" if a == "r" else "left"}">'
                                    f"{html.escape(c)}</{tag}>" for c, a in zip(cells, self.align)) + "</tr>"

        caption = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        body = "".join(row(r, "td") for r in self.rows)
        note = f"<p><small>({html.escape(self.source)})</small></p>" if self.source else ""
        return f"<table>{caption}<thead>{row(self.header, 'th')}</thead><tbody>{body}</tbody></table>{note}"


def table(header, rows, *, title: str = "", source: str = "", align: str = "") -> Table:
    """A table of ``rows`` under ``header`` (see Table); numbers are formatted with ``number``."""
    return Table(header, rows, title=title, source=source, align=align)


def _cell(v) -> str:
    if isinstance(v, (bool, np.bool_)) or v is None:
        return "" if v is None else str(v)
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}"
    if isinstance(v, (float, np.floating)):
        return number(float(v))
    return str(v)


def _numeric(text: str) -> bool:
    return bool(re.fullmatch(r"[-+]?[\d,]*\.?\d+(e[-+]?\d+)?\s*\S{0,6}", text)) or text == ""

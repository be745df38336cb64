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


def execution_model(*, blocks: int = 10, threads_per_block: int = 128, sms: int = 4, blocks_per_sm: int = 2,
                    block: int = 2, thread: int = 37, warp_size: int = 32, source: str = "",
                    title: str = "How a launch kernel[blocks, threads_per_block] runs"):
    """The picture lesson 1 draws and every later lesson builds on: a launch's grid of blocks, one block split
    into warps of ``warp_size`` threads, and the blocks placed on the GPU's streaming multiprocessors (SMs).

    Top: the grid, ``blocks`` blocks (blockIdx.x) of ``threads_per_block`` threads (blockDim.x), and the
    elements each covers with one thread per element. Middle: block ``block``, its threads (threadIdx.x) in
    rows of one warp each; thread ``thread`` is marked, with the global index cuda.grid(1) it computes. A
    last warp that the block does not fill has lanes with no thread (hatched). Bottom: ``sms`` SMs holding up to
    ``blocks_per_sm`` blocks each, the first blocks in launch order placed one SM after another; the rest wait
    for a place. (The hardware chooses the order and the SM; the picture shows one possibility.)"""
    import math

    from matplotlib.patches import Rectangle

    if not (1 <= blocks <= 64 and 1 <= threads_per_block <= 1024 and 1 <= sms <= 16 and 1 <= blocks_per_sm <= 8):
        raise CourseInputError("execution_model draws 1..64 blocks of 1..1024 threads on 1..16 SMs holding 1..8 "
                               f"blocks each; got blocks={blocks}, threads_per_block={threads_per_block}, "
                               f"sms={sms}, blocks_per_sm={blocks_per_sm}")
    if not (0 <= block < blocks and 0 <= thread < threads_per_block):
        raise CourseInputError(f"the marked thread must be in the grid: block 0..{blocks - 1}, thread "
                               f"0..{threads_per_block - 1}; got block={block}, thread={thread}")
    plt = _plt()
    warps = math.ceil(threads_per_block / warp_size)
    mark, plain, empty = "tab:orange", "#cfe0f3", "white"
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(11, 9.5), gridspec_kw={"height_ratios": [1.1, 1.7, 1.6]})
    for ax in (top, mid, low):
        ax.set_axis_off()

    # The grid: one box per block, with the elements it covers (one thread per element).
    top.set_xlim(-0.5, blocks + 0.5)
    top.set_ylim(-1.3, 1.4)
    for b in range(blocks):
        top.add_patch(Rectangle((b, 0), 0.9, 0.9, facecolor=mark if b == block else plain, edgecolor="black"))
        top.text(b + 0.45, 0.45, f"block\n{b}", ha="center", va="center", fontsize=8)
        first, last = b * threads_per_block, (b + 1) * threads_per_block - 1
        top.text(b + 0.45, -0.25, f"{first:,}-\n{last:,}", ha="center", va="top", fontsize=6.5, color="dimgrey")
    top.text(-0.5, 1.15, f"The grid: {blocks} blocks (blockIdx.x = 0..{blocks - 1}, gridDim.x = {blocks}), each of "
             f"{threads_per_block} threads (blockDim.x = {threads_per_block}).\nGrey: the elements each block covers "
             "with one thread per element.", fontsize=9)

    # One block: its threads in rows of one warp each.
    mid.set_xlim(-7, warp_size + 1)
    mid.set_ylim(warps + 1.1, -1.0)
    for w in range(warps):
        last = min(threads_per_block, (w + 1) * warp_size) - 1
        mid.text(-0.6, w + 0.45, f"warp {w}: threadIdx.x {w * warp_size}..{last}",
                 ha="right", va="center", fontsize=7.5)
        for lane in range(warp_size):
            t = w * warp_size + lane
            real = t < threads_per_block
            mid.add_patch(Rectangle((lane, w), 0.9, 0.9, facecolor=(mark if t == thread else plain) if real else empty,
                                    edgecolor="grey", lw=0.4, hatch=None if real else "////"))
    for lane in (0, warp_size - 1):
        mid.text(lane + 0.45, -0.2, f"lane {lane}", ha="center", va="bottom", fontsize=7)
    w, lane = divmod(thread, warp_size)
    i = block * threads_per_block + thread
    mid.annotate(f"threadIdx.x = {thread} (warp {w}, lane {lane})\ncuda.grid(1) = blockIdx.x * blockDim.x + "
                 f"threadIdx.x = {block} * {threads_per_block} + {thread} = {i}: this thread's element",
                 xy=(lane + 0.45, w + 0.9), xytext=(2, warps + 0.9), fontsize=8.5,
                 arrowprops={"arrowstyle": "->", "color": mark})
    note = "" if threads_per_block % warp_size == 0 else "; hatched: lanes of the last warp with no thread"
    mid.text(-7, -0.75, f"Block {block}: {threads_per_block} threads run as {warps} warps of {warp_size} threads "
             f"(lanes 0..{warp_size - 1}); a warp executes one instruction for all its threads at once{note}.",
             fontsize=9)

    # The GPU: SMs, each holding a few blocks; the rest wait.
    low.set_xlim(-0.2, sms * 3.2 + 2.6)
    low.set_ylim(-1.7, blocks_per_sm * 1.1 + 1.5)
    placed = {s: [] for s in range(sms)}
    waiting = []
    for b in range(blocks):
        s = b % sms
        (placed[s] if len(placed[s]) < blocks_per_sm else waiting).append(b)
    for s in range(sms):
        x0 = s * 3.2
        low.add_patch(Rectangle((x0, 0), 3.0, blocks_per_sm * 1.1 + 0.4, facecolor="#f2f2f2", edgecolor="black"))
        low.text(x0 + 1.5, blocks_per_sm * 1.1 + 0.55, f"SM {s}", ha="center", va="bottom", fontsize=9)
        for k, b in enumerate(placed[s]):
            y = 0.2 + (blocks_per_sm - 1 - k) * 1.1  # the first block placed at the top
            low.add_patch(Rectangle((x0 + 0.2, y), 2.6, 0.9, facecolor=mark if b == block else plain,
                                    edgecolor="black", lw=0.6))
            low.text(x0 + 1.5, y + 0.45, f"block {b}: {warps} warps", ha="center", va="center", fontsize=7.5)
    if waiting:
        low.text(sms * 3.2 + 0.1, blocks_per_sm * 0.55, "waiting for a place\n(each takes one as a block ends):\n"
                 + ", ".join(f"block {b}" for b in waiting[:6]) + (" ..." if len(waiting) > 6 else ""),
                 fontsize=8, va="center")
    low.text(-0.2, -0.5, f"The GPU: {sms} streaming multiprocessors (SMs) in this picture. A block runs on one SM "
             "from start to end; an SM holds several blocks at once\nand switches between their warps, so that "
             "while one warp waits for memory another computes. Which SM runs which block, and when, is the\n"
             "hardware's choice: threads of different blocks must not depend on each other's order.", fontsize=8.5,
             va="top")
    fig.suptitle(title + (f"\n{source}" if source else ""), fontsize=11)
    fig.tight_layout()
    return fig

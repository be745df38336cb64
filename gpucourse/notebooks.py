"""The course's notebooks, and running them headless (nbclient): notebook, mode, seconds, pass/fail.

Each lesson NN_topic has a core notebook, ``notebooks/NN_topic.ipynb`` (what a learner follows in one sitting), may
have an optional deep dive beside it, ``notebooks/NN_topic_deep_dive.ipynb``, and has its graded exercises' source
in ``solutions/NN_topic/``.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from .plots import FIGURES_ENV
from .runtime import MODE_VARIABLE

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Outcome:
    path: str
    mode: str
    seconds: float
    ok: bool
    error: str = ""
    wide: tuple = ()  # printed lines wider than WIDTH (wide_lines)
    tests: tuple = ()  # a notebook with nbgrader's test cells: grading.TestResult per test, in order
    notes: tuple = ()  # ... and what its answer cells raised
    tested: bool = False  # whether the notebook holds test cells

    def report(self):
        """The notebook's tests as a ``grading.GradeReport`` (its ``checklist`` is what ``run`` prints)."""
        from .grading.reports import GradeReport

        return GradeReport(notebook=self.path, assignment=lesson_of(Path(self.path)), mode=self.mode,
                           tests=list(self.tests), notes=list(self.notes), seconds=self.seconds)


DEEP_DIVE = "_deep_dive"  # notebooks/NN_topic_deep_dive.ipynb: the optional deep dive of lesson NN_topic
WIDTH = 100  # characters: a printed line wider than this wraps in a notebook cell at JupyterLab's default width


def core_notebooks() -> list[Path]:
    """Each lesson's core notebook, in lesson order."""
    return sorted(p for p in ROOT.glob("notebooks/[0-9][0-9]_*.ipynb") if not p.stem.endswith(DEEP_DIVE))


def deep_dives() -> list[Path]:
    """The lessons' optional deep-dive notebooks, in lesson order."""
    return sorted(ROOT.glob(f"notebooks/[0-9][0-9]_*{DEEP_DIVE}.ipynb"))


def lesson_of(path: Path) -> str:
    """The lesson a notebook belongs to ("06_inference_engine"): its stem, less "_deep_dive", or its folder's name."""
    path = Path(path)
    if path.parent.name == "notebooks":
        return path.stem.removesuffix(DEEP_DIVE)
    return path.parent.name


def lesson_notebooks() -> list[Path]:
    """Every lesson's core notebook and deep dive, then every solution notebook, in lesson order."""
    return sorted(core_notebooks() + deep_dives()) + sorted(ROOT.glob("solutions/[0-9]*/*.ipynb"))


def wide_lines(nb, width: int = WIDTH) -> list[str]:
    """Printed lines of an executed notebook wider than ``width``: text a cell prints or returns, where no HTML
    rendering of it is shown instead (tracebacks and warnings on stderr aside). "cell N: <line>" each."""
    out = []
    for i, cell in enumerate(nb.cells):
        for o in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if o.get("output_type") == "stream" and o.get("name") == "stdout":
                text = o.get("text", "")
            elif o.get("output_type") in ("execute_result", "display_data") and "text/html" not in o.get("data", {}) \
                    and not any(k.startswith("image/") for k in o.get("data", {})):
                text = o.get("data", {}).get("text/plain", "")
            else:
                continue
            text = "".join(text) if isinstance(text, list) else text
            out += [f"cell {i}: {line}" for line in text.splitlines() if len(line.rstrip()) > width]
    return out


def kernel_environment(mode: str, *, figures: Path | None = None, env: dict | None = None) -> dict:
    """The environment a notebook's kernel starts with: this process's, with GPUCOURSE_MODE=``mode``, the course on
    PYTHONPATH, no NUMBA_ENABLE_CUDASIM (the kernel's ``gpucourse.setup`` sets it for its mode), the live figures'
    folder where given, then ``env`` ({name: value}; a value of None removes the variable: {"GPUCOURSE_FAKE_CC":
    None} runs at the GPU's own compute capability). This process's own environment is left as it is."""
    out = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out.update({MODE_VARIABLE: mode,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    if figures is not None:
        out[FIGURES_ENV] = str(Path(figures).resolve())
    for key, value in (env or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = str(value)
    return out


GOES_ON = "raises-exception"  # nbclient's tag for a cell whose error does not stop the notebook


def has_tests(nb) -> bool:
    """Whether a notebook holds nbgrader's test cells (an exercise or its solution)."""
    return any(c.cell_type == "code" and c.get("metadata", {}).get("nbgrader", {}).get("grade")
               and not c.metadata["nbgrader"].get("solution") for c in nb.cells)


def has_hidden_tests(path) -> bool:
    """Whether a notebook holds nbgrader's hidden tests (a solution notebook; an exercise has them removed)."""
    import nbformat

    return any("### BEGIN HIDDEN TESTS" in c.source for c in nbformat.read(Path(path), as_version=4).cells)


def execute(path: Path, *, mode: str, timeout: int = 1800, save_to: Path | None = None,
            env: dict | None = None) -> Outcome:
    """Run every cell of ``path`` in a fresh kernel in ``mode`` ("cpu" or "gpu"); never writes ``path``. With
    ``save_to``: the executed copy goes there, and so do the live figures its cells close. ``env``: variables for the kernel (``kernel_environment``); nothing of this process's
    environment changes, so several notebooks may run at once from threads.

    In a notebook with nbgrader's test cells (exercises/, solutions/), a test or an answer that fails does not
    stop the run, as in grading: every test is scored as the grader scores it (``Outcome.tests``; the report's
    ``checklist`` lists them), and the run fails if any test fails. An error in any other cell stops the run and
    fails it, as in any notebook."""
    import nbclient
    import nbformat

    from .jupyter import CourseKernelManager

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    kernel_env = kernel_environment(mode, figures=save_to, env=env)
    if save_to is not None:  # live figures (plots.LiveCurves) are saved beside the executed copies
        Path(save_to).mkdir(parents=True, exist_ok=True)
    tested = has_tests(nb)
    tagged = []
    if tested:  # tests and answers go on past an error, as nbgrader's autograde does
        for cell in nb.cells:
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if cell.cell_type == "code" and (meta.get("grade") or meta.get("solution")) \
                    and GOES_ON not in cell.metadata.get("tags", []):
                cell.metadata.setdefault("tags", []).append(GOES_ON)
                tagged.append(cell)
    start = time.perf_counter()
    error = ""
    try:
        client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                         kernel_manager_class=CourseKernelManager,
                                         resources={"metadata": {"path": str(path.parent)}})
        client.execute(env=kernel_env)
    except AssertionError as exc:  # nbclient's own bare asserts: its kernel client was gone mid-run
        error = _lost_kernel(nb, exc)
    except Exception as exc:  # CellExecutionError, timeouts, a dead kernel
        error = _failure(exc, nb)
    seconds = time.perf_counter() - start
    for cell in tagged:
        cell.metadata["tags"].remove(GOES_ON)
        if not cell.metadata["tags"]:
            del cell.metadata["tags"]
    tests, notes = [], []
    if tested:
        from .grading.verdicts import notebook_tests

        from .grading.integrity import solution_answers
        from .grading.submissions import integrity_notes

        tests, notes = notebook_tests(nb.cells, mode)
        notes = [*notes, *integrity_notes(nb.cells, solution_answers(nb))]  # what `grade` would refuse to run
    if save_to is not None:
        nbformat.write(nb, Path(save_to) / path.name)
    shown = str(path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path)
    outcome = Outcome(shown, mode, seconds, not error, error, tuple(wide_lines(nb)), tuple(tests), tuple(notes),
                      tested)
    if tested and (outcome.report().failed or notes):
        outcome.ok = False
    return outcome


def _failure(exc: Exception, nb) -> str:
    """What stopped a notebook, short: "cell 46: StopIteration: ..." for an error in a cell (its index in the
    notebook, as ``wide_lines`` counts), else the exception's last lines."""
    from nbclient.exceptions import CellExecutionError

    if isinstance(exc, CellExecutionError):
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code" and GOES_ON not in cell.metadata.get("tags", []) and \
                    any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
                value = " ".join(str(exc.evalue or "").split())
                return (f"cell {i}: {exc.ename}" + (f": {value}" if value else ""))[:300]
    return _short(exc)


def _lost_kernel(nb, exc: AssertionError) -> str:
    """What to say when nbclient itself fails an assert (``assert self.kc is not None`` and the like, without a
    message): its connection to the notebook's kernel was torn down while a cell ran, because the kernel process died
    or was shut down under it. A cell's own failed assert comes as a CellExecutionError instead. Names the cell that
    was running (the first that started and never replied) and what to do."""
    running = None
    for i, cell in enumerate(nb.cells):
        timing = cell.get("metadata", {}).get("execution", {})
        if cell.cell_type == "code" and "iopub.execute_input" in timing and "shell.execute_reply" not in timing:
            running = i
            break
    where = f"while cell {running} ran" if running is not None else "between cells"
    return (f"the notebook's kernel went away {where} (nbclient: {_short(exc).strip()} with no message: it lost its "
            "kernel client, so the kernel process died or was shut down). Run the notebook again alone; if it "
            "happens again, look for another process using the GPU's or the machine's memory (nvidia-smi, free)")


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    tail = [line for line in text if line.strip()][-3:]
    return type(exc).__name__ + ": " + " | ".join(tail)[:500]


def summary(outcomes: list[Outcome]) -> str:
    width = max([len(o.path) for o in outcomes] + [8])
    lines = [f"{'notebook':{width}}  mode  seconds  result"]
    for o in outcomes:
        lines.append(f"{o.path:{width}}  {o.mode:4}  {o.seconds:7.1f}  {'pass' if o.ok else 'FAIL'}"
                     + (f"  ({o.report().tally()})" if o.tested and not o.error else ""))
        if o.error:
            lines.append(f"{'':{width}}  {o.error}")
        if o.wide:
            lines.append(f"{'':{width}}  {len(o.wide)} printed lines wider than {WIDTH} characters, e.g. {o.wide[0][:80]}")
    passed = sum(o.ok for o in outcomes)
    lines.append(f"{passed} passed, {len(outcomes) - passed} failed")
    return "\n".join(lines)

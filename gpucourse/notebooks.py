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

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Outcome:
    path: str
    mode: str
    seconds: float
    ok: bool
    error: str = ""
    wide: tuple = ()  # printed lines wider than WIDTH (wide_lines)


DEEP_DIVE = "_deep_dive"  # notebooks/NN_topic_deep_dive.ipynb: the optional deep dive of lesson NN_topic
WIDTH = 100  # characters: a printed line wider than this wraps in a notebook cell at JupyterLab's default width


def core_notebooks() -> list[Path]:
    """Each lesson's core notebook, in lesson order."""
    return sorted(p for p in ROOT.glob("notebooks/[0-9][0-9]_*.ipynb") if not p.stem.endswith(DEEP_DIVE))


def deep_dives() -> list[Path]:
    """The lessons' optional deep-dive notebooks, in lesson order."""
    return sorted(ROOT.glob(f"notebooks/[0-9][0-9]_*{DEEP_DIVE}.ipynb"))


def lesson_of(path: Path) -> str:
    """The lesson a notebook belongs to ("05_inference_engine"): its stem, less "_deep_dive", or its folder's name."""
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


def execute(path: Path, *, mode: str, timeout: int = 1800, save_to: Path | None = None) -> Outcome:
    """Run every cell of ``path`` in a fresh kernel in ``mode`` ("cpu" or "gpu"); never writes ``path``. With
    ``save_to``: the executed copy goes there, and so do the live figures its cells close."""
    import nbclient
    import nbformat

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    env = {"GPUCOURSE_MODE": mode,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if save_to is not None:  # live figures (plots.LiveCurves) are saved beside the executed copies
        save_to.mkdir(parents=True, exist_ok=True)
        env[FIGURES_ENV] = str(Path(save_to).resolve())
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    start = time.perf_counter()
    error = ""
    try:
        client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                         resources={"metadata": {"path": str(path.parent)}})
        client.execute()
    except AssertionError as exc:  # nbclient's own bare asserts: its kernel client was gone mid-run
        error = _lost_kernel(nb, exc)
    except Exception as exc:  # CellExecutionError, timeouts, a dead kernel
        error = _short(exc)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    seconds = time.perf_counter() - start
    if save_to is not None:
        save_to.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, save_to / path.name)
    return Outcome(str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path), mode, seconds, not error, error,
                   tuple(wide_lines(nb)))


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
        lines.append(f"{o.path:{width}}  {o.mode:4}  {o.seconds:7.1f}  {'pass' if o.ok else 'FAIL'}")
        if o.error:
            lines.append(f"{'':{width}}  {o.error}")
        if o.wide:
            lines.append(f"{'':{width}}  {len(o.wide)} printed lines wider than {WIDTH} characters, e.g. {o.wide[0][:80]}")
    passed = sum(o.ok for o in outcomes)
    lines.append(f"{passed} passed, {len(outcomes) - passed} failed")
    return "\n".join(lines)

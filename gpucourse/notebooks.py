"""Execute notebooks headless (nbclient) and summarise: notebook, mode, seconds, pass/fail."""
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


def lesson_notebooks() -> list[Path]:
    """Every lesson notebook and every solution notebook, in lesson order."""
    return sorted(ROOT.glob("notebooks/[0-9]*.ipynb")) + sorted(ROOT.glob("solutions/[0-9]*/*.ipynb"))


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
    return Outcome(str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path), mode, seconds, not error, error)


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
    passed = sum(o.ok for o in outcomes)
    lines.append(f"{passed} passed, {len(outcomes) - passed} failed")
    return "\n".join(lines)

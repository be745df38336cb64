"""``python -m gpucourse matrix``: every lesson notebook, deep dive and solution notebook in GPU mode, once per compute
capability a learner's GPU may have, on one GPU.

``GPUCOURSE_FAKE_CC`` makes ``gpucourse.gpus`` answer for another GPU than the one in the machine, so each lesson
takes the path it takes there: 7.5 (T4, RTX 20xx), 8.0 (A100), 8.6 (RTX 30xx, A10), 8.9 (RTX 40xx, L4); "native"
leaves it unset. A capability above the machine's own cannot be faked (its kernels would not run) and is left out,
saying so. The command prints a line per run as it goes, then a table notebook x capability (pass or FAIL and the
seconds of each run), each failure's short error under the table, and a total; its exit status is 1 if anything
failed, 2 if it could not start (no GPU: CPU mode has no capability to fake).

``jobs`` runs several notebooks at a time, each in a kernel process of its own with its own environment (nothing
of this process's environment changes). The lessons whose notebooks start processes that share the GPU and time
them (``ALONE``: collectives, MPS) run alone afterwards. Several at a time suits a large GPU when what matters is
pass or fail: the seconds are then those of a shared GPU. Before the first run, the GPU's ceilings are measured
once (``python -m gpucourse ceilings``, cached per GPU), so that no notebook measures them while others run.

``save``: every executed copy goes to ``DIR/<capability>/<its path in the course>`` (the live figures beside it),
and ``DIR/matrix.json`` holds the table (rewritten after every run, so an interrupted matrix keeps what it did):
what to bring back from a GPU machine. A matrix.json already there from the same GPU is merged: a matrix run in
parts (a capability or a few notebooks at a time, where a machine limits how long one command runs) ends with one
table of every part; a run made again replaces the earlier one.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import notebooks, runtime

CAPABILITIES = ("7.5", "8.0", "8.6", "8.9", "native")  # what a learner's GPU may be (gpucourse.gpus.GPUS)
NATIVE = "native"
ALONE = ("07_collectives", "08_feeding_the_gpu")  # lessons whose notebooks start processes sharing the GPU


def capability(text: str) -> str:
    """A capability as the matrix names it: "7.5" (from 7.5, 75 or sm_75) or "native"."""
    if str(text).strip().lower() == NATIVE:
        return NATIVE
    major, minor = runtime.parse_cc(text)
    return f"{major}.{minor}"


def environment(cc: str) -> dict:
    """The variables a run's kernel gets for capability ``cc`` (None: unset, for the GPU's own)."""
    return {runtime.FAKE_CC_VARIABLE: None if cc == NATIVE else cc}


@dataclass
class Run:
    notebook: str  # its path in the course (as notebooks.execute shows it)
    cc: str
    ok: bool | None = None  # None: not run (yet, or skipped)
    seconds: float = 0.0
    error: str = ""  # what stopped it, or which of its tests failed
    skipped: str = ""  # why it was not run

    @property
    def cell(self) -> str:
        if self.skipped:
            return "n/a"
        if self.ok is None:
            return "-"
        return f"{'pass' if self.ok else 'FAIL'} {round(self.seconds)} s"


@dataclass
class Matrix:
    notebooks: list[str]
    capabilities: list[str]
    gpu: str = ""
    jobs: int = 1
    runs: dict = field(default_factory=dict)  # (notebook, cc) -> Run
    seconds: float = 0.0  # wall-clock time of this matrix's runs
    before: float = 0.0  # ... and of the earlier parts it was merged with (--save into the same folder)

    def run(self, notebook: str, cc: str) -> Run:
        return self.runs.setdefault((notebook, cc), Run(notebook, cc))

    @property
    def failed(self) -> list[Run]:
        return [r for r in self.runs.values() if r.ok is False]

    def table(self) -> str:
        """The table (notebook x capability), the failures' errors under it, and the total."""
        cells = {(nb, cc): self.runs.get((nb, cc), Run(nb, cc)).cell for nb in self.notebooks
                 for cc in self.capabilities}
        width = max([len(n) for n in self.notebooks] + [8])
        cols = [max([len(cc)] + [len(cells[nb, cc]) for nb in self.notebooks]) for cc in self.capabilities]
        lines = [f"{'notebook':<{width}}  " + "  ".join(f"{cc:<{w}}" for cc, w in zip(self.capabilities, cols))]
        for nb in self.notebooks:
            lines.append(f"{nb:<{width}}  " + "  ".join(f"{cells[nb, cc]:<{w}}"
                                                         for cc, w in zip(self.capabilities, cols)))
        lines.append("")
        for r in self.failed:
            lines.append(f"FAIL {r.notebook} at {r.cc}: {r.error}")
        skipped = sorted({(r.cc, r.skipped) for r in self.runs.values() if r.skipped})
        lines += [f"n/a at {cc}: {why}" for cc, why in skipped]
        done = [r for r in self.runs.values() if r.ok is not None]
        passed = sum(r.ok for r in done)
        waiting = len(self.notebooks) * len(self.capabilities) - len(done) \
            - sum(1 for r in self.runs.values() if r.skipped)
        total = (f"{len(done)} runs: {passed} pass, {len(done) - passed} FAIL"
                 + (f", {waiting} not run" if waiting else "")
                 + f"; {_seconds(sum(r.seconds for r in done))} of notebook time in "
                 + f"{_seconds(self.seconds + self.before)}"
                 + (f" ({self.jobs} at a time)" if self.jobs > 1 else "") + (f" on {self.gpu}" if self.gpu else ""))
        lines.append(total)
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"gpu": self.gpu, "capabilities": self.capabilities, "notebooks": self.notebooks, "jobs": self.jobs,
                "seconds": round(self.seconds + self.before, 1), "host": platform.node(),
                "runs": [asdict(self.runs.get((nb, cc), Run(nb, cc))) for nb in self.notebooks
                         for cc in self.capabilities]}


def _seconds(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s" if s < 600 else f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _shown(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(notebooks.ROOT)) if path.is_relative_to(notebooks.ROOT) else str(path)


def run_matrix(paths: Sequence[Path], ccs: Sequence[str], *, jobs: int = 1, timeout: int = 1800,
               save: Path | None = None, mode: str = "gpu", native: str | None = None,
               execute: Callable = notebooks.execute, say: Callable[[str], None] = print, gpu: str = "") -> Matrix:
    """Run every notebook of ``paths`` at every capability of ``ccs`` (``jobs`` at a time, ``ALONE`` lessons
    afterwards one by one) through ``execute`` (``notebooks.execute``); ``say`` gets a line per run. ``native``:
    the machine's own capability ("9.0"), above which a capability is not faked. Returns the ``Matrix``."""
    started = time.monotonic()
    ccs = [capability(cc) for cc in ccs]
    shown = {Path(p): _shown(p) for p in paths}
    matrix = Matrix(notebooks=list(shown.values()), capabilities=ccs, gpu=gpu, jobs=max(1, int(jobs)))
    if save is not None:
        save = Path(save)
        save.mkdir(parents=True, exist_ok=True)
        earlier = _earlier(save / "matrix.json", gpu)
        if earlier:  # a matrix run in parts (a notebook or a capability at a time): one table of them all
            say(f"{save / 'matrix.json'}: {len(earlier['runs'])} earlier runs on this GPU kept (those run again "
                "are replaced)")
            matrix.before = float(earlier.get("seconds", 0.0))
            for r in earlier["runs"]:
                matrix.runs[(r["notebook"], r["cc"])] = Run(**r)
            order = {cc: i for i, cc in enumerate(CAPABILITIES)}
            matrix.notebooks = sorted(set(matrix.notebooks) | {r["notebook"] for r in earlier["runs"]})
            matrix.capabilities = sorted(set(ccs) | {r["cc"] for r in earlier["runs"]},
                                         key=lambda cc: (order.get(cc, -1), cc))
    todo, alone = [], []
    for cc in ccs:
        if cc != NATIVE and native and runtime.parse_cc(cc) > runtime.parse_cc(native):
            for name in shown.values():
                matrix.run(name, cc).skipped = (f"this GPU's compute capability is {native}: a GPU of {cc} has "
                                                "features it lacks, so that path cannot run here")
            continue
        for path, name in shown.items():
            (alone if notebooks.lesson_of(path) in ALONE else todo).append((path, cc))
    total = len(todo) + len(alone)
    say(f"{len(shown)} notebooks x {len(ccs)} capabilities: {total} runs in {mode.upper()} mode, "
        f"{matrix.jobs} at a time" + (f" (lessons {', '.join(ALONE)} alone, at the end)" if alone and matrix.jobs > 1
                                      else ""))
    lock = threading.Lock()
    count = [0]

    def one(path: Path, cc: str) -> None:
        name = shown[path]
        where = None if save is None else save / cc / (Path(name).parent if not Path(name).is_absolute() else "")
        try:
            outcome = execute(path, mode=mode, timeout=timeout, save_to=where, env=environment(cc))
            ok, seconds = outcome.ok, outcome.seconds
            error = outcome.error or ("" if ok else _tests_failed(outcome))
        except Exception as exc:  # noqa: BLE001 - one run's failure is a cell of the table, not the end of it
            ok, seconds, error = False, 0.0, f"{type(exc).__name__}: {exc}"
        with lock:
            r = matrix.run(name, cc)
            r.ok, r.seconds, r.error = ok, seconds, error
            count[0] += 1
            matrix.seconds = time.monotonic() - started
            left = matrix.seconds / count[0] * (total - count[0])
            say(f"[{count[0]:>{len(str(total))}}/{total}] {cc:<6} {name}  {'pass' if ok else 'FAIL'}  "
                f"{_seconds(seconds)}" + (f"  ({error[:150]})" if error else "")
                + (f"  about {_seconds(left)} left" if count[0] < total else ""))
            if save is not None:
                (save / "matrix.json").write_text(json.dumps(matrix.as_dict(), indent=1) + "\n")

    def pool(items, workers: int) -> None:
        queue = list(items)
        take = threading.Lock()

        def worker():
            while True:
                with take:
                    if not queue:
                        return
                    path, cc = queue.pop(0)
                one(path, cc)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(workers, len(queue)))]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(timeout=1.0)  # a join that Ctrl-C can interrupt

    pool(todo, matrix.jobs)
    pool(alone, 1)
    matrix.seconds = time.monotonic() - started
    if save is not None:
        (save / "matrix.json").write_text(json.dumps(matrix.as_dict(), indent=1) + "\n")
    return matrix


def _earlier(path: Path, gpu: str) -> dict | None:
    """A matrix.json written on the same GPU, with the runs it holds (not those it only planned), or None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("gpu") != gpu:
        return None
    fields = set(Run.__dataclass_fields__)
    runs = [{k: v for k, v in r.items() if k in fields} for r in data.get("runs", [])
            if r.get("ok") is not None or r.get("skipped")]
    return {**data, "runs": runs} if runs else None


def _tests_failed(outcome) -> str:
    report = outcome.report()
    failed = [f"{t.grade_id}: {' '.join(t.message.split())}"[:160] for t in report.failed]
    return f"{report.tally()}; " + "; ".join(failed + list(outcome.notes))[:400] if failed or outcome.notes \
        else report.tally()


def measure_ceilings(say: Callable[[str], None] = print) -> None:
    """This GPU's ceilings, measured once before the runs (``python -m gpucourse ceilings`` in a child Python, so
    this process holds no CUDA context); a failure is said and the notebooks measure them themselves."""
    say("measuring this GPU's ceilings once (cached for every run) ...")
    env = {k: v for k, v in os.environ.items() if k not in (runtime.FAKE_CC_VARIABLE, "NUMBA_ENABLE_CUDASIM")}
    try:
        done = subprocess.run([sys.executable, "-m", "gpucourse", "ceilings", "--mode", "gpu"], cwd=notebooks.ROOT,
                              env={**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(notebooks.ROOT),
                                                                                      env.get("PYTHONPATH")]))},
                              capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            say(f"  could not measure them ({(done.stderr or done.stdout).strip().splitlines()[-1:]}); "
                "each notebook measures them itself")
    except subprocess.TimeoutExpired:
        say("  measuring them took over 600 s; each notebook measures them itself")


def matrix_cli(paths: Sequence[Path], ccs: Sequence[str], *, jobs: int = 1, timeout: int = 1800,
               save: Path | None = None, mode: str | None = None) -> int:
    """``python -m gpucourse matrix``: refuse without a GPU, run the matrix, print the table; 0 when all pass."""
    if jobs < 1:
        raise runtime.CourseInputError(f"--jobs must be 1 or more, not {jobs}")
    ccs = [capability(cc) for cc in (ccs or CAPABILITIES)]
    paths = [Path(p) for p in paths] or notebooks.lesson_notebooks()
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        raise runtime.CourseInputError(f"no notebook at {', '.join(missing)}")
    if mode == "cpu":
        raise runtime.NeedsGPU("the capability matrix needs a GPU: it runs every notebook in GPU mode, with each "
                               "compute capability faked on this GPU (--mode cpu asks for CPU mode)")
    try:
        rt = runtime.setup("gpu", quiet=True)
    except runtime.CourseError as exc:
        why = str(exc).removeprefix("GPU mode was asked for, but ").rstrip(".")
        raise runtime.NeedsGPU(f"the capability matrix needs a GPU: it runs every notebook in GPU mode, with each "
                               f"compute capability faked on this GPU, and this machine has none ({why}). In CPU "
                               "mode, `python -m gpucourse run` runs the notebooks") from None
    device = rt.device
    print(f"GPU: {device['name']} (compute capability {device['compute_capability']})", flush=True)
    if jobs > 1:
        measure_ceilings(lambda line: print(line, flush=True))
    matrix = run_matrix(paths, ccs, jobs=jobs, timeout=timeout, save=save, mode="gpu",
                        native=device["compute_capability"], gpu=device["name"],
                        say=lambda line: print(line, flush=True))
    print()
    print(matrix.table())
    if save is not None:
        print(f"executed copies and matrix.json in {Path(save).resolve()}")
    return 1 if matrix.failed else 0

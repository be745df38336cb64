"""exercises/ generated from solutions/ by nbgrader's generate_assignment (in a child Python), and the
check that the two are in step.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .course import IGNORED, assignment_dirs, course_config, prepend_paths, resolve_assignments, tail
from .settings import EXERCISES, GradingError, REPO, SOLUTIONS
from .verdicts import as_text


def _generate(assignments: list[str], root: Path) -> Path:
    """nbgrader generate_assignment for each assignment, source copied under root; returns the release dir."""
    for a in assignments:
        shutil.copytree(SOLUTIONS / a, root / "source" / a, ignore=shutil.ignore_patterns(*IGNORED, "*.pyc"))
    _nbgrader(root, [["generate_assignment", a] for a in assignments], course_config(root), _generation_env())
    return root / "release"


def generate_exercises(assignments: Sequence[str] | None = None) -> list[Path]:
    """Regenerate exercises/NN_*/ from solutions/NN_*/ (all of them by default); returns the folders written."""
    names = resolve_assignments(assignments)
    written = []
    with tempfile.TemporaryDirectory(prefix="gpucourse-exercises-") as tmp:
        release = _generate(names, Path(tmp))
        for a in names:
            dest = EXERCISES / a
            if dest.exists():
                shutil.rmtree(dest)
            shutil.copytree(release / a, dest)
            written.append(dest)
    return written


def check_exercises(assignments: Sequence[str] | None = None) -> list[str]:
    """Differences between the committed exercises/ and what generate_exercises would write now (empty when
    in step). Notebooks are compared as JSON; nbgrader's output is deterministic (its checksums are hashes
    of the cell sources), so nothing needs normalising beyond the JSON formatting."""
    names = resolve_assignments(assignments)
    diffs = []
    with tempfile.TemporaryDirectory(prefix="gpucourse-exercises-") as tmp:
        release = _generate(names, Path(tmp))
        for a in names:
            want_dir, have_dir = release / a, EXERCISES / a
            want = {p.relative_to(want_dir) for p in want_dir.rglob("*") if p.is_file()}
            have = ({p.relative_to(have_dir) for p in have_dir.rglob("*")
                     if p.is_file() and not IGNORED & set(p.relative_to(have_dir).parts)}
                    if have_dir.is_dir() else set())
            for rel in sorted(want - have):
                diffs.append(f"exercises/{a}/{rel}: missing (run: python -m gpucourse exercises)")
            for rel in sorted(have - want):
                diffs.append(f"exercises/{a}/{rel}: not generated from solutions/{a}/ (stale?)")
            for rel in sorted(want & have):
                diff = _file_difference(want_dir / rel, have_dir / rel)
                if diff:
                    diffs.append(f"exercises/{a}/{rel}: {diff}")
        if assignments is None:
            for extra in sorted(p.name for p in assignment_dirs(EXERCISES) if p.name not in names):
                diffs.append(f"exercises/{extra}/: has no solutions/{extra}/")
    return diffs


def _file_difference(want: Path, have: Path) -> str:
    if want.suffix != ".ipynb":
        return "" if want.read_bytes() == have.read_bytes() else "differs from what generation writes"
    try:
        a = json.loads(want.read_text(encoding="utf-8"))
        b = json.loads(have.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        return f"not valid JSON ({exc})"
    if a == b:
        return ""
    ca, cb = a.get("cells", []), b.get("cells", [])
    if len(ca) != len(cb):
        return f"{len(cb)} cells, generation gives {len(ca)} (edited by hand, or solutions changed?)"
    for i, (x, y) in enumerate(zip(ca, cb, strict=True)):
        if x != y:
            gid = x.get("metadata", {}).get("nbgrader", {}).get("grade_id") or x.get("id", "")
            return f"cell {i} ({gid}) differs from what generation gives (edited by hand, or solutions changed?)"
    return "notebook metadata differs from what generation gives"



def _nbgrader(root: Path, steps: list[list[str]], config: dict, env: dict) -> str:
    """Run nbgrader steps through its Python API (NbGraderAPI) in a child Python; returns nbgrader's log.

    One child for all the steps: importing nbgrader takes seconds. The child's environment is the kernel's.
    """
    spec = root / ".nbgrader-steps.json"
    spec.write_text(json.dumps({"steps": steps, "config": config}))
    code = "import sys; from gpucourse.grading.exercises import _run_steps; _run_steps(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, str(spec)], check=False, cwd=root, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True)
    result = root / ".nbgrader-result.json"
    if proc.returncode != 0 or not result.is_file():
        raise GradingError(f"nbgrader could not be run (exit {proc.returncode}):\n{tail(proc.stdout + proc.stderr)}",
                           proc.stdout + proc.stderr)
    results = json.loads(result.read_text())
    log = "\n".join(r.get("log", "") for r in results)
    for (step, *_), r in zip(steps, results, strict=False):
        if not r["success"]:
            raise _step_failed(step, r.get("log", "") + "\n" + r.get("error", ""))
    return log


def _step_failed(step: str, log: str) -> GradingError:
    """A short account of why nbgrader gave up; the whole log stays on the exception."""
    errors = [line.strip() for line in as_text(log).splitlines() if re.match(r"\s*[\w.]+(Error|Exception): ", line)]
    why = next((e for e in reversed(errors) if "see the the above traceback" not in e), "see the log")
    return GradingError(f"nbgrader {step} failed: {why}", log)


def _run_steps(spec_path: str) -> None:
    """The child side of ``_nbgrader``: run the steps, write their results next to the spec."""
    from nbgrader.apps.api import NbGraderAPI
    from traitlets.config import Config

    spec = json.loads(Path(spec_path).read_text())
    api = NbGraderAPI(config=Config(spec["config"]))
    results = []
    for step, *args in spec["steps"]:
        if step == "generate_assignment":
            r = api.generate_assignment(args[0], force=True, create=True)
        elif step == "autograde":
            r = api.autograde(args[0], args[1], force=True, create=True)
        else:
            raise ValueError(f"unknown nbgrader step {step!r}")
        results.append(r)
        if not r["success"]:
            break
    Path(spec_path).with_name(".nbgrader-result.json").write_text(json.dumps(results))

def _generation_env() -> dict:
    """The environment of the child Python that generates exercises (it runs no learner code)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = prepend_paths([str(REPO)], env.get("PYTHONPATH", ""))
    env["PATH"] = prepend_paths([sysconfig.get_path("scripts"), os.path.dirname(sys.executable)], env.get("PATH", ""))
    return env

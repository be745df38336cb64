"""The course on disk as nbgrader sees it: the lessons in solutions/, a throwaway nbgrader course directory
(claimed, emptied, configured) and the environment a child Python gets.
"""
from __future__ import annotations

from .text import tail  # noqa: F401 (used here and by the rooms that import it from here)

import contextlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .. import runtime
from .settings import ASSIGNMENT_PATTERN, COURSE_ID, SOLUTIONS


_COURSE_MARKER = ".gpucourse-course"


def claim_course_dir(root: Path) -> None:
    """Empty ``root`` for a new grading run, refusing a folder the grader did not make."""
    if root.exists():
        if any(root.iterdir()) and not (root / _COURSE_MARKER).is_file():
            raise runtime.CourseInputError(f"{root} exists and was not made by the grader; choose another course_dir")
        shutil.rmtree(root)
    root.mkdir(parents=True)
    (root / _COURSE_MARKER).write_text("made by gpucourse.grading; emptied at every grading run\n")


@contextlib.contextmanager
def make_course_dir(workdir):
    """A temporary course directory, or ``workdir`` emptied and kept."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="gpucourse-grade-") as tmp:
            yield Path(tmp)
        return
    root = Path(workdir).resolve()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    yield root


def resolve_mode(mode: str | None) -> str:
    """The mode the notebooks run in, decided here so that the kernel is told, not left to choose."""
    if mode is not None:
        mode = mode.lower()
        if mode not in ("cpu", "gpu"):
            raise runtime.CourseInputError(f"mode must be 'cpu' or 'gpu', not {mode!r}")
        return mode
    wanted = os.environ.get(runtime.MODE_VARIABLE, "").lower()
    if wanted in ("cpu", "gpu"):
        return wanted
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return "cpu"
    if runtime._runtime is not None:
        return runtime._runtime.mode
    count, _ = runtime._driver_device_count()
    return "gpu" if count and runtime._cupy_usable()[0] else "cpu"


def course_config(root: Path) -> dict:
    """The nbgrader configuration of a course directory at root (nothing is read from nbgrader_config.py).
    The gradebook waits up to two minutes for a lock: several workers write it."""
    return {"CourseDirectory": {
        "root": str(root),
        "course_id": COURSE_ID,
        "source_directory": "source",
        "release_directory": "release",
        "submitted_directory": "submitted",
        "autograded_directory": "autograded",
        "feedback_directory": "feedback",
        "db_url": f"sqlite:///{root / 'gradebook.db'}?timeout=120",
    }}


def prepend_paths(first: list[str], rest: str) -> str:
    return os.pathsep.join(dict.fromkeys([*first, *(p for p in rest.split(os.pathsep) if p)]))


# What of the grader's environment the workers and kernels see (anything else, such as the grader's
# PYTHONPATH, HOME, working folder or tokens, is left out).
ENV_NAMES = {"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "LD_LIBRARY_PATH", "SYSTEMROOT", "OMP_NUM_THREADS",
              "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TF_CPP_MIN_LOG_LEVEL", "SSL_CERT_FILE"}
ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "CUPY_", "NUMBA_", "NV_", "NCCL_", "NVSHMEM_")  # NCCL_NVLS_ENABLE=0 reaches the kernels





def assignment_dirs(root: Path = SOLUTIONS) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and ASSIGNMENT_PATTERN.match(p.name)) \
        if root.is_dir() else []


IGNORED = {".ipynb_checkpoints", "__pycache__", ".DS_Store"}


def assignment_files(folder: Path) -> list[Path]:
    """Files of an assignment folder other than notebooks (data, helper modules), without editor litter."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix != ".ipynb"
                  and not IGNORED & set(p.relative_to(folder).parts) and p.suffix != ".pyc")


def resolve_assignments(assignments: Sequence[str] | None) -> list[str]:
    known = [p.name for p in assignment_dirs()]
    if assignments is None:
        return known
    unknown = [a for a in assignments if a not in known]
    if unknown:
        raise runtime.CourseInputError(f"no solutions/{unknown[0]}/; known: {', '.join(known) or 'none'}")
    return list(assignments)

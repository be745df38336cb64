"""The course's tooling: runtime (GPU or CPU mode), gpus (which GPU each kernel needs), bench (timing,
ceilings), plots, records, grading.

A notebook starts with ``rt = gpucourse.setup(lesson="01_vector_multiply")``.

The modules stand in floors, each importing only those below it: runtime and jupyter (how the course starts
kernels and JupyterLab), then gpus and bench, then records, then plots, grading, notebooks, matrix and cli
(tests/test_runtime_and_bench.py checks that no import goes back up).
"""
from __future__ import annotations

from . import runtime

__version__ = "0.1.0"
__all__ = ["setup"]


def setup(mode: str | None = None, *, lesson: str | None = None, quiet: bool = False):
    """Choose GPU or CPU mode (once per process) and print the probe (``runtime.setup``).

    lesson: the lesson id (for example "01_vector_multiply"); in CPU mode the probe names the GPU and date of
    that lesson's recorded results."""
    from . import records

    rt = runtime.setup(mode, quiet=True)
    if not quiet:
        print(records.describe(lesson))
    return rt

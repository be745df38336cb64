"""The grader's settings: where solutions and exercises live, the limits of a graded notebook and the
messages for what cannot be graded here.

Limits (``Limits``; ``timeout`` and ``notebook_timeout`` are arguments of ``grade``/``grade_class`` and CLI options)
    * cell: ``timeout`` seconds (default 120), then the cell is interrupted and its test scores 0. A cell
      that ignores the interrupt stops the notebook: the cells after it are reported "not run".
    * notebook: ``notebook_timeout`` seconds (default 600) for all its cells; cells past it are not run.
      Behind it, the grading process is stopped ``STARTUP_SLACK`` seconds later whatever happens.
    * output: a cell keeps at most ``CELL_OUTPUT_CHARS`` characters of output, a notebook
      ``NOTEBOOK_OUTPUT_CHARS``; the kernel itself drops what a cell prints past ``KERNEL_OUTPUT_CHARS``.
      Output on stderr past the cap still leaves a line on stderr, so nbgrader's "stderr fails the test"
      rule survives truncation. Errors and a test's value are always kept.
    * files: the kernel writes only in its own folder and in a private temporary folder; one file is at
      most ``FILE_BYTES`` (RLIMIT_FSIZE); no core dumps. In CPU mode its memory is capped at
      ``MEMORY_BYTES`` (RLIMIT_AS; not in GPU mode, where the CUDA driver reserves address space).
    * a kernel that dies (os._exit, a segmentation fault, running out of memory) fails the cell it died in
      with the exit code or signal, and the cells after it are reported "not run"; nbgrader's own executor
      would grade nothing at all.
"""
from __future__ import annotations

from .text import ANSI  # noqa: F401 (used here and by the rooms that import it from here)

import re
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import runtime


REPO = Path(__file__).resolve().parents[2]
SOLUTIONS = REPO / "solutions"
EXERCISES = REPO / "exercises"
ASSIGNMENT_PATTERN = re.compile(r"^\d\d_\w+$")
STUDENT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]{0,63}$")  # safe in paths, nbgrader and its CSV

COURSE_ID = "gpu-programming-for-deep-learning"
STUDENT = "learner"
DEFAULT_TIMEOUT = 120  # seconds per cell
DEFAULT_NOTEBOOK_TIMEOUT = 600  # seconds for all the cells of one notebook
STARTUP_SLACK = 90  # seconds on top of the notebook's limit for nbgrader and the kernel to start and stop

CELL_OUTPUT_CHARS = 100_000  # characters of output kept per cell
NOTEBOOK_OUTPUT_CHARS = 2_000_000  # ... per notebook
KERNEL_OUTPUT_CHARS = 1_000_000  # characters per cell and stream the kernel sends at all
VALUE_CHARS = 1_000  # characters of a cell's value (execute_result) kept
TRACEBACK_LINES = 60  # lines of a traceback kept
MAX_NOTEBOOK_BYTES = 50 * 2**20  # a submitted file larger than this is not read
MAX_CODE_CHARS = 1_000_000  # characters of code in a submission, outputs not counted
FILE_BYTES = 256 * 2**20  # largest file the kernel may write (RLIMIT_FSIZE)
MEMORY_BYTES = 8 * 2**30  # address space of a CPU-mode kernel (RLIMIT_AS)

PERF_PREFIX = "perf_"
NOT_GRADABLE = "not gradable here (needs a GPU)"
NOT_GRADABLE_GPUS = "not gradable here (needs more GPUs)"
NOT_GRADABLE_ARCH = "not gradable here (needs a newer GPU)"
NOT_GRADABLE_SOFTWARE = "not gradable here (needs software this machine lacks)"
NOT_GRADABLE_STATUSES = (NOT_GRADABLE, NOT_GRADABLE_GPUS, NOT_GRADABLE_ARCH, NOT_GRADABLE_SOFTWARE)
CPU_PERF_MESSAGE = "performance: not gradable in CPU mode (needs a GPU); 0 of {points} points given here"
GPUS_PERF_MESSAGE = ("performance: not gradable on this machine (needs {needed} GPUs, it has {have}); "
                     "0 of {points} points given here")
# Any test (not only a performance test) that needs more GPUs than the machine has, CPU mode included
# (grading.needs_gpus): the test cell prints this line and checks nothing.
GPUS_MESSAGE = "not gradable on this machine (needs {needed} GPUs, it has {have}); 0 of {points} points given here"
# A performance test of a lesson step this GPU cannot run (gpucourse.gpus says which GPU each step needs).
STEP_PERF_MESSAGE = "performance: not gradable on this GPU ({why}); 0 of {points} points given here"
# Any test (not only a performance test) of something this machine lacks the software for, e.g. Triton's kernels
# without PyTorch (grading.software_missing): the test cell prints this line and checks nothing.
SOFTWARE_MESSAGE = "not gradable here: {why}; 0 of {points} points given here"

# A cell's stderr output that holds a Python warning ("file.py:12: SomeWarning: text") is removed before
# scoring: a NumbaPerformanceWarning about a small grid must not cost a test its points.
WARNING_PATTERN = r"(?m)^\S.*:\d+: \w*Warning: "

# Performance scoring: full marks up to this ratio (learner time / reference time), none from ZERO_AT.
FULL_AT = 1.2
ZERO_AT = 10.0

# What the kernel imports: a copy of these, not the repository.
KERNEL_CODE = ("gpucourse", "kernels", "systems", "benchmarks", "results")
KERNEL_NAME = "gpucourse-graded"




class GradingError(runtime.CourseError):
    """The notebook could not be graded at all (not a failed test: the grader gave up on it).
    ``log`` holds nbgrader's log and traceback."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


@dataclass(frozen=True)
class Limits:
    """How long and how much a graded notebook may run and print."""

    timeout: int = DEFAULT_TIMEOUT  # seconds per cell
    notebook_timeout: int = DEFAULT_NOTEBOOK_TIMEOUT  # seconds for all cells
    cell_output_chars: int = CELL_OUTPUT_CHARS
    notebook_output_chars: int = NOTEBOOK_OUTPUT_CHARS
    kernel_output_chars: int = KERNEL_OUTPUT_CHARS
    file_bytes: int = FILE_BYTES
    memory_bytes: int = MEMORY_BYTES

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise runtime.CourseInputError(f"limit {name} must be a positive whole number, not {value!r}")


def is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")

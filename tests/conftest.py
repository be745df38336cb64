"""The mode is decided before anything imports numba: GPU mode where a GPU is usable, else the simulator."""
import os
import shutil
import tempfile

import pytest

import gpucourse

RT = gpucourse.setup(quiet=True)

gpu_only = pytest.mark.skipif(not RT.gpu, reason=f"needs a GPU (CPU mode: {RT.reason})")


def _cuda_compiler() -> bool:
    """nvcc on PATH, or NVRTC from the CUDA wheels: either compiles CUDA C to PTX without a GPU."""
    import shutil

    if shutil.which("nvcc"):
        return True
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
        return True
    except Exception:
        return False


needs_compiler = pytest.mark.skipif(not _cuda_compiler(), reason="neither nvcc nor NVRTC is installed")


def pytest_configure(config):
    """One folder of compiled PTX for the whole run (gpucourse.cuda_c.SHARED_PTX), made before pytest-xdist starts
    its workers, which inherit it: a CUDA C text that tests in two workers compile is compiled once."""
    from gpucourse import cuda_c

    if not hasattr(config, "workerinput") and not os.environ.get(cuda_c.SHARED_PTX):
        config._gpucourse_ptx = tempfile.mkdtemp(prefix="gpucourse-ptx-")
        os.environ[cuda_c.SHARED_PTX] = config._gpucourse_ptx


def pytest_unconfigure(config):
    folder = getattr(config, "_gpucourse_ptx", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("GPUCOURSE_PTX_CACHE", None)  # gpucourse.cuda_c.SHARED_PTX


def pytest_report_header(config):
    return f"gpucourse: {RT.mode.upper()} mode ({RT.reason})" + (f", {RT.device['name']}" if RT.gpu else "")


# make test runs the files on pytest-xdist workers a whole file (or class) at a time (--dist loadscope), in the order
# collected (--no-loadscope-reorder; by default pytest-xdist would start the files with the most tests first). A
# long file handed out last keeps one worker busy while the others have nothing left to do, so the workers get the
# longest first: these, which each take minutes on 2 cores, then every other file or class with a slow or archs test
# (whole notebooks, classes graded, machine code for every GPU), then the rest, each group in its usual order.
LONGEST_FIRST = ("tests/test_gpu_archs.py", "tests/test_notebooks.py", "tests/test_grading_hostile.py",
                 "tests/test_hosted_install.py")


def _xdist_scope(item) -> str:
    """The unit pytest-xdist's loadscope hands a worker: the test's class, else its file."""
    parts = item.nodeid.split("::")
    return "::".join(parts[:2]) if item.cls is not None else parts[0]


def _longest_first(items) -> None:
    heavy = {_xdist_scope(i) for i in items if i.get_closest_marker("slow") or i.get_closest_marker("archs")}
    first = {scope: rank for rank, scope in enumerate(LONGEST_FIRST)}

    def rank(scope):
        return (first.get(scope, len(first)), scope not in heavy)

    order = {scope: rank(scope) for scope in dict.fromkeys(_xdist_scope(i) for i in items)}
    items.sort(key=lambda i: order[_xdist_scope(i)])  # stable: each scope's tests keep their order


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(gpu_only)
        if item.name.startswith(("test_recorded", "test_committed_records")):  # checks of results/, not of code
            item.add_marker(pytest.mark.records)
    if hasattr(config, "workerinput") and not config.getoption("loadscopereorder", True):  # make test's workers
        _longest_first(items)


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded by the test's name (reproducible, different for each test)."""
    import zlib

    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def exercise_differences():
    """(the lessons, grading.check_exercises()'s differences for all of them): every lesson's exercise generated from
    its solution once a session (once per pytest-xdist worker), not once in tests/test_grading.py and again in each
    lesson's tests/test_NN_*_exercises.py. Each difference names its lesson (exercises/NN_*/...), and a lesson's are
    what check_exercises([lesson]) gives."""
    from gpucourse.grading import check_exercises
    from gpucourse.grading.course import resolve_assignments

    return resolve_assignments(None), check_exercises()

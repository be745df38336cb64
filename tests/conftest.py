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


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(gpu_only)
        if item.name.startswith(("test_recorded", "test_committed_records")):  # checks of results/, not of code
            item.add_marker(pytest.mark.records)


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded by the test's name (reproducible, different for each test)."""
    import zlib

    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))

"""The mode is decided before anything imports numba: GPU mode where a GPU is usable, else the simulator."""
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


def pytest_report_header(config):
    return f"gpucourse: {RT.mode.upper()} mode ({RT.reason})" + (f", {RT.device['name']}" if RT.gpu else "")


def pytest_collection_modifyitems(config, items):
    parallel = config.pluginmanager.hasplugin("xdist")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(gpu_only)
        if item.name.startswith(("test_recorded", "test_committed_records")):  # checks of results/, not of code
            item.add_marker(pytest.mark.records)
        if parallel:
            shared = _shared_fixture_home(item)
            if shared:
                item.add_marker(pytest.mark.xdist_group(shared))


def _shared_fixture_home(item) -> str | None:
    """The test file whose module- or class-scoped fixture ``item`` uses (a graded class of notebooks, a trained
    model, the JupyterHub with its users), or None. Under pytest-xdist's --dist loadgroup (make test, make
    test-fast) the tests sharing one run in one worker, so such a fixture is built once, as without xdist; every
    other test goes to whichever worker is free."""
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        for d in defs:
            if d.scope != "function" and d.baseid:  # "" for pytest's own (tmp_path_factory, ...)
                return d.baseid.split("::")[0]
    return None


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded by the test's name (reproducible, different for each test)."""
    import zlib

    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))

"""What the tooling keeps so as not to do it twice: CUDA C compiled to PTX (once per process, once per test run
between pytest-xdist's workers) and a GPU's measured ceilings (per GPU and driver, written whole)."""
from __future__ import annotations

import json

import pytest
from conftest import needs_compiler

from gpucourse import bench, cuda_c, runtime


@pytest.fixture
def counted(monkeypatch):
    """cuda_c's compiler replaced by one that counts its calls; an empty process cache."""
    calls = []

    def compile_ptx(code, arch, filename, includes, nvcc):
        calls.append((arch, filename))
        return f"// PTX of {filename} for {arch}: {len(code)} characters\n"

    monkeypatch.setattr(cuda_c, "_compile_ptx", compile_ptx)
    monkeypatch.setattr(cuda_c, "_PTX", {})
    monkeypatch.delenv(cuda_c.SHARED_PTX, raising=False)
    return calls


def test_the_same_text_is_compiled_once_per_process(counted):
    code = 'extern "C" __global__ void k(float* a) { a[0] = 1.0f; }'
    first = cuda_c.ptx_from_source(code, "sm_80", filename="k.cu")
    assert cuda_c.ptx_from_source(code, "sm_80", filename="k.cu") == first and len(counted) == 1
    cuda_c.ptx_from_source(code, "sm_90", filename="k.cu")
    cuda_c.ptx_from_source(code + "\n// edited", "sm_80", filename="k.cu")
    cuda_c.ptx_from_source(code, "sm_80", filename="k.cu", compiler="nvrtc")
    assert len(counted) == 4  # another architecture, another text, another compiler: compiled


def test_processes_sharing_a_folder_compile_a_text_once(counted, tmp_path, monkeypatch):
    monkeypatch.setenv(cuda_c.SHARED_PTX, str(tmp_path))
    code = 'extern "C" __global__ void k(float* a) { a[0] = 2.0f; }'
    first = cuda_c.ptx_from_source(code, "sm_80", filename="k.cu")
    monkeypatch.setattr(cuda_c, "_PTX", {})  # another process of the same test run
    assert cuda_c.ptx_from_source(code, "sm_80", filename="k.cu") == first and len(counted) == 1
    assert [p.suffix for p in tmp_path.iterdir()] == [".ptx"]  # no half-written file left beside it
    monkeypatch.delenv(cuda_c.SHARED_PTX)
    monkeypatch.setattr(cuda_c, "_PTX", {})
    cuda_c.ptx_from_source(code, "sm_80", filename="k.cu")
    assert len(counted) == 2  # no shared folder: nothing read from one


def test_a_failed_compile_is_not_kept(monkeypatch, tmp_path):
    monkeypatch.setattr(cuda_c, "_PTX", {})
    monkeypatch.setenv(cuda_c.SHARED_PTX, str(tmp_path))

    def broken(*args):
        raise runtime.CourseError("nvcc could not compile k.cu")

    monkeypatch.setattr(cuda_c, "_compile_ptx", broken)
    for _ in range(2):
        with pytest.raises(runtime.CourseError, match="could not compile"):
            cuda_c.ptx_from_source("garbage", "sm_80", filename="k.cu")
    assert cuda_c._PTX == {} and not list(tmp_path.iterdir())


@needs_compiler
def test_the_kept_ptx_is_what_the_compiler_gives(monkeypatch):
    monkeypatch.setattr(cuda_c, "_PTX", {})
    kept = cuda_c.compile_ptx("vector_multiply", "sm_80")
    includes = [f"-I{d}" for d in cuda_c.include_dirs()]
    import shutil

    fresh = cuda_c._compile_ptx(cuda_c.source("vector_multiply"), "sm_80", "vector_multiply.cu", includes,
                                shutil.which("nvcc"))
    assert kept == fresh and cuda_c.compile_ptx("vector_multiply", "sm_80") is kept


def test_ceilings_are_written_whole_and_measured_again_when_damaged(monkeypatch, tmp_path):
    """Notebooks running at once share the cache of a GPU's ceilings: it is written whole (renamed into place), and
    a file that cannot be read is measured again rather than failing the notebook."""
    fake = runtime.Runtime(mode="gpu", reason="a test", device={"name": "NVIDIA H100 80GB HBM3", "driver": "13.0"})
    monkeypatch.setattr(runtime, "_runtime", fake)
    monkeypatch.setenv("GPUCOURSE_CACHE", str(tmp_path))
    measured = []

    def measure():
        measured.append(1)
        return bench.Ceilings(gpu="NVIDIA H100 80GB HBM3", copy_gbps=3000.0, h2d_pageable_gbps=20.0,
                              h2d_pinned_gbps=50.0, d2h_pinned_gbps=50.0, fp32_tflops=50.0, fp16_tflops=700.0,
                              measured="today")

    monkeypatch.setattr(bench, "measure_ceilings", measure)
    c = bench.ceilings()
    path = tmp_path / "ceilings-nvidia-h100-80gb-hbm3-13.0.json"
    assert json.loads(path.read_text())["copy_gbps"] == 3000.0 and [p.name for p in tmp_path.iterdir()] == [path.name]
    assert bench.ceilings() == c and len(measured) == 1  # read back
    path.write_text('{"gpu": "NVIDIA H100 80GB HBM3", "copy_gb')  # a reader that met a half-written file
    assert bench.ceilings() == c and len(measured) == 2
    monkeypatch.setenv(runtime.FAKE_CC_VARIABLE, "7.5")  # a faked capability: the same silicon, the same ceilings
    assert bench.ceilings() == c and len(measured) == 2

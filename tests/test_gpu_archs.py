"""Which GPU each kernel needs (gpucourse/gpus.py), and every kernel compiled to machine code for every GPU the
course supports: each CUDA C source under kernels/cuda/ to PTX as the lessons compile it and then to machine code,
each numba kernel's PTX through ptxas, for sm_75 (T4) up to sm_90 (H100, H200), without a GPU."""
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpucourse import gpus, runtime

ROOT = Path(__file__).resolve().parents[1]
CUDA_SOURCES = sorted((ROOT / "kernels" / "cuda").rglob("*.cu"))
NUMBA_MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "kernels").rglob("*.py")
                       if p.stem != "__init__")


@pytest.fixture
def fake_cc(monkeypatch):
    def set_cc(cc):
        monkeypatch.setenv(runtime.FAKE_CC_VARIABLE, cc)
    return set_cc


# ------------------------------------------------------------------------------------------- the registry

def test_compute_capability_parsing():
    for text in ("7.5", "sm_75", 75, (7, 5), "7.5 "):
        assert runtime.parse_cc(text) == (7, 5)
    assert runtime.parse_cc("sm_90a") == (9, 0) and runtime.parse_cc("12.0") == (12, 0)
    with pytest.raises(runtime.CourseInputError, match="looks like 7.5"):
        runtime.parse_cc("turing")


@pytest.mark.parametrize("cc, cp_async, wgmma", [("7.5", False, False), ("8.0", True, False), ("8.6", True, False),
                                                 ("8.9", True, False), ("9.0", True, True), ("10.0", True, False)])
def test_supports_follows_the_faked_gpu(fake_cc, cc, cp_async, wgmma):
    fake_cc(cc)
    assert runtime.compute_capability() == runtime.parse_cc(cc)
    assert gpus.supports("fp16-wmma")  # every GPU the course supports has FP16 tensor cores
    assert gpus.supports("cp.async") is cp_async
    assert gpus.supports("wgmma") is wgmma  # sm_90a code runs on compute capability 9.0 only
    assert gpus.supports("mma-m16n8k16") is cp_async  # mma.sync's 16 x 8 x 16 shape came with sm_80, as cp.async did
    assert gpus.supports("cp.async", cc=(7, 5)) is False and gpus.supports("cp.async", cc="sm_80") is True


def test_require_names_the_gpu_and_what_it_lacks(fake_cc):
    fake_cc("7.5")
    with pytest.raises(runtime.CourseError) as err:
        gpus.require("cp.async", what="lesson 4's pipelined WMMA GEMM")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("lesson 4's pipelined WMMA GEMM needs cp.async")
    assert "sm_80+" in msg and "compute capability 7.5 (Turing: T4" in msg and msg.endswith("does not have it")
    gpus.require("fp16-wmma", what="WMMA")  # has it: no error
    with pytest.raises(runtime.CourseInputError, match="no GPU feature named 'dp8'"):
        gpus.supports("dp8")


def test_without_a_gpu_the_question_needs_a_compute_capability(monkeypatch):
    if runtime.is_gpu():
        pytest.skip("a GPU answers for itself")
    monkeypatch.delenv(runtime.FAKE_CC_VARIABLE, raising=False)
    assert runtime.compute_capability() is None
    with pytest.raises(runtime.CourseError, match="GPUCOURSE_FAKE_CC=7.5"):
        gpus.supports("cp.async")


def test_steps_fall_back_or_refuse(fake_cc, capsys, monkeypatch):
    monkeypatch.setattr(gpus, "_noted", set())
    fake_cc("7.5")
    st = gpus.step("04.wmma_tiled")
    assert st.runs and st.falls_back == ["cp.async"]
    gpus.step("04.wmma_tiled")  # the note is printed once per process
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["note: lesson 4's tiled, pipelined WMMA GEMM copies tiles to shared memory with ordinary "
                   "loads, synchronously (no overlap) (cp.async needs sm_80+)."]
    fake_cc("8.0")
    assert not gpus.status("04.wmma_tiled").falls_back and gpus.status("05.igemm_wmma").runs
    # a step whose feature this GPU lacks is refused with one line
    monkeypatch.setitem(gpus.STEPS, "99.wgmma", gpus.Step("99.wgmma", "a wgmma GEMM", needs=("wgmma",)))
    with pytest.raises(runtime.CourseError, match=r"^a wgmma GEMM needs wgmma .* sm_90a \(compute capability 9.0 "
                                                  r"exactly\); a GPU of compute capability 8.0"):
        gpus.step("99.wgmma")
    fake_cc("9.0")
    assert gpus.step("99.wgmma").runs
    with pytest.raises(runtime.CourseInputError, match="no lesson step"):
        gpus.status("04.nope")


def test_every_step_names_known_features_and_lessons():
    for key, step in gpus.STEPS.items():
        assert step.key == key and step.lesson in gpus.LESSONS
        assert all(f in gpus.FEATURES for f in step.needs + step.prefers)
        assert bool(step.prefers) == bool(step.fallback)
    for f in gpus.FEATURES.values():
        assert f.what and "\n" not in f.what
    assert [gpus.runtime.parse_cc(a) for a in gpus.ARCHS] == sorted(gpus.GPUS)
    # every supported GPU runs every step of the course, some with a fallback, except the steps built on one
    # architecture's own features (sm_90a: Hopper's wgmma), which run there and are refused elsewhere, and those
    # built on a newer GPU's feature with no fallback (lesson 10's mma.sync kernel, sm_80+), refused on older ones
    specific = {k for k, s in gpus.STEPS.items() if any(gpus.feature(f).arch_specific for f in s.needs)}
    assert specific == {"04.wgmma", "04.wgmma_fp8", "05.wgmma", "06.wgmma", "10.wgmma", "10.wgmma_fp8", "10.wgmma_bwd"}
    oldest = min(gpus.GPUS)
    newer = {k: max(gpus.feature(f).cc for f in s.needs) for k, s in gpus.STEPS.items()
             if k not in specific and any(gpus.feature(f).cc > oldest for f in s.needs)}
    assert newer == {"10.mma": (8, 0)}
    for cc in gpus.GPUS:
        for steps in gpus.plan(cc).values():
            for st in steps:
                key = st.step.key
                assert st.runs or (key in specific and cc != (9, 0)) or (key in newer and cc < newer[key]), (cc, key)


def test_source_archs_reads_declarations():
    assert gpus.source_archs("// no declaration") == list(gpus.ARCHS)
    assert gpus.source_archs("// gpucourse-arch: sm_90a\n__global__ void k() {}") == [*gpus.ARCHS, "sm_90a"]
    with pytest.raises(runtime.CourseInputError, match="unknown architecture sm_91"):
        gpus.source_archs("// gpucourse-arch: sm_91\n")


# ------------------------------------------------------------------------------------ the probe and the lab

@pytest.mark.parametrize("cc", ["7.5", "8.0", "8.6", "8.9", "9.0"])
def test_probe_says_what_each_gpu_runs(fake_cc, capsys, cc):
    from gpucourse import cli, records

    fake_cc(cc)  # as on a GPU of that compute capability: the probe asks runtime.compute_capability()
    assert cli.main(["probe"]) == 0
    faked = capsys.readouterr().out
    assert faked.startswith(records.describe())
    tail = faked.split(records.describe(), 1)[1]
    assert cli.main(["probe", "--cc", cc]) == 0  # CPU mode asking about another GPU says the same
    assert capsys.readouterr().out.split(records.describe(), 1)[1] == tail
    lines = tail.strip().splitlines()
    assert lines[0] == f"A GPU of compute capability {cc} ({gpus.GPUS[runtime.parse_cc(cc)]}) runs:"
    by_lesson = {int(line.split()[1]): line for line in lines[1:]}
    assert sorted(by_lesson) == sorted(int(n) for n in gpus.LESSONS)
    for n, line in by_lesson.items():
        assert line.split(": ", 1)[1].startswith("all steps")
        synchronous = "synchronously (no overlap) (cp.async needs sm_80+)" in line
        assert synchronous is (cc == "7.5" and n in (4, 5, 6, 10)), line
        hopper = {4: ["lesson 4's Hopper GEMM (wgmma fed by the TMA)",
                      "lesson 4's FP8 GEMM on Hopper (e4m3 wgmma fed by the TMA)"],
                  5: ["lesson 5's Hopper convolution (wgmma, image tiles gathered by the TMA)"],
                  6: ["lesson 6's engine's Hopper convolutions (lesson 5's wgmma kernel with the engine's epilogue)"],
                  10: ["lesson 10's FlashAttention on Hopper (wgmma fed by the TMA, warp-specialised)",
                       "lesson 10's FlashAttention in FP8 on Hopper (e4m3 wgmma)",
                       "lesson 10's backward pass on Hopper (wgmma fed by the TMA)"]}
        no_mma = "; lesson 10's FlashAttention-2 on the tensor cores (mma.sync from registers, ldmatrix, cp.async) " \
                 "needs mma-m16n8k16 (" in line  # sm_80+: refused on a T4
        assert no_mma is (cc == "7.5" and n == 10), line
        refused = len(hopper.get(n, ())) + no_mma
        no_wgmma = n in hopper and (f"all steps but {refused};" in line
                                    and all(f"; {what} needs wgmma (" in line for what in hopper[n])
                                    and line.endswith("does not have it"))
        assert no_wgmma is (cc != "9.0" and n in hopper), line
    if cc == "9.0":
        assert all(line.endswith("all steps") for line in by_lesson.values())
    elif cc != "7.5":
        assert all(line.endswith("all steps") for n, line in by_lesson.items() if n not in (4, 5, 6, 10))


def test_probe_without_a_gpu_points_at_cc(capsys, monkeypatch):
    from gpucourse import cli

    if runtime.is_gpu():
        pytest.skip("a GPU answers for itself")
    monkeypatch.delenv(runtime.FAKE_CC_VARIABLE, raising=False)
    assert cli.main(["probe"]) == 0
    assert "`python -m gpucourse probe --cc 7.5` says what a T4 would run" in capsys.readouterr().out
    assert cli.main(["probe", "--cc", "turing"]) == 2
    assert "a compute capability looks like 7.5" in capsys.readouterr().err


def test_lab_allows_root_only_as_root():
    from gpucourse import cli

    cmd, note = cli.lab_command(["--port", "9999"], euid=0)
    assert cmd[1:] == ["-m", "jupyter", "lab", "--port", "9999", "--allow-root"]
    assert note == "Running as root: starting JupyterLab with --allow-root."
    cmd, note = cli.lab_command(["--port", "9999"], euid=1000)
    assert cmd[1:] == ["-m", "jupyter", "lab", "--port", "9999"] and note is None
    cmd, _ = cli.lab_command(["--allow-root"], euid=0)
    assert cmd.count("--allow-root") == 1


# ------------------------------------------------------------------------ machine code for every architecture

def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for site in map(Path, sys.path):  # the nvidia-cuda-nvcc wheel
        candidate = site / "nvidia" / "cuda_nvcc" / "bin" / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _run_all(jobs: list) -> list:
    """Run the commands concurrently; return (label, stderr) of each that failed."""
    def one(job):
        label, cmd = job
        done = subprocess.run(cmd, capture_output=True, text=True)
        return None if done.returncode == 0 else (label, done.stderr.strip()[-2000:])

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return [f for f in pool.map(one, jobs) if f]


def _assembler(arch: str, ptx: Path, cubin: Path) -> list[str]:
    """The command that assembles ``ptx`` into machine code for ``arch`` with the toolkit that wrote it: nvcc where
    it is on PATH (cuda_c.compile_ptx then compiles with it; nvcc runs its own ptxas), else the ptxas of the CUDA
    wheels, which match the NVRTC cuda_c.compile_ptx then uses."""
    nvcc = shutil.which("nvcc")
    if nvcc:
        return [nvcc, f"-arch={arch}", "-cubin", str(ptx), "-o", str(cubin)]
    return [_tool("ptxas"), f"-arch={arch}", str(ptx), "-o", str(cubin)]


@pytest.mark.archs
def test_every_cuda_source_assembles_for_every_architecture(tmp_path):
    """Each source compiled to PTX for each architecture (cuda_c.compile_ptx, as the lessons compile it; the test
    run's PTX folder shares what another test compiled) and assembled into machine code for it."""
    if shutil.which("nvcc") is None and _tool("ptxas") is None:
        pytest.skip("neither nvcc nor ptxas is installed")
    from gpucourse import cuda_c

    assert {p.stem for p in CUDA_SOURCES} >= {"vector_multiply", "warp_divergence", "tensor_cores", "convolution"}
    pairs = [(src, arch) for src in CUDA_SOURCES for arch in gpus.source_archs(src.read_text())]

    def label(src, arch):
        return f"{src.relative_to(ROOT)} for {arch}"

    def to_ptx(pair):
        src, arch = pair
        try:
            (tmp_path / f"{src.stem}.{arch}.ptx").write_text(cuda_c.compile_ptx(src.stem, arch))
        except runtime.CourseError as exc:
            return label(src, arch), str(exc)[-2000:]
        return None

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        failed = [f for f in pool.map(to_ptx, pairs) if f]
    assert not failed, "\n\n".join(f"{where}:\n{err}" for where, err in failed)
    cubins = {(src, arch): tmp_path / f"{src.stem}.{arch}.cubin" for src, arch in pairs}
    failed = _run_all([(label(src, arch), _assembler(arch, tmp_path / f"{src.stem}.{arch}.ptx", cubin))
                       for (src, arch), cubin in cubins.items()])
    print(f"\n{len(pairs)} sources x architectures to PTX and machine code in {time.perf_counter() - t0:.1f} s")
    assert not failed, "\n\n".join(f"{where}:\n{err}" for where, err in failed)
    for cubin in cubins.values():  # real machine code came out of every run
        assert cubin.stat().st_size > 1000


@pytest.mark.archs
def test_every_numba_kernel_assembles_for_every_architecture(tmp_path):
    ptxas = _tool("ptxas")
    if ptxas is None:
        pytest.skip("ptxas is not installed")
    from gpucourse.numba_ptx import module_kernels

    t0 = time.perf_counter()
    try:  # PTX for the oldest GPU the course supports, which ptxas then assembles for every newer one too
        found = module_kernels(NUMBA_MODULES, cc=runtime.parse_cc(gpus.ARCHS[0]))
    except runtime.CourseError as exc:
        if "libnvvm" in str(exc).lower() or "nvvm" in str(exc).lower():
            pytest.skip(f"numba-cuda's NVVM is not installed: {str(exc)[-200:]}")
        raise
    undeclared = {m: r["undeclared"] for m, r in found.items() if r["undeclared"]}
    stale = {m: r["stale"] for m, r in found.items() if r["stale"]}
    assert not undeclared, f"declare these numba kernels' signatures in their module's NUMBA_KERNELS: {undeclared}"
    assert not stale, f"NUMBA_KERNELS names kernels that do not exist: {stale}"
    ptx = {f"{m}.{k}": text for m, r in found.items() for k, text in r["ptx"].items()}
    assert len(ptx) >= 14 and "kernels.warp_divergence.reduce_shuffle" in ptx
    jobs = []
    for name, text in ptx.items():
        path = tmp_path / f"{name}.ptx"
        path.write_text(text)
        for arch in gpus.ARCHS:
            jobs.append((f"{name} for {arch}", [ptxas, f"-arch={arch}", str(path), "-o",
                                                str(tmp_path / f"{name}.{arch}.cubin")]))
    failed = _run_all(jobs)
    print(f"\n{len(ptx)} numba kernels to PTX and {len(jobs)} ptxas runs in {time.perf_counter() - t0:.1f} s")
    assert not failed, "\n\n".join(f"{label}:\n{err}" for label, err in failed)


@pytest.mark.archs
def test_sm80_code_is_what_it_was_and_sm75_has_no_cp_async():
    """The fallback below sm_80 is compiled only there: sm_80+ PTX keeps its cp.async, sm_75's has none."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    from gpucourse import cuda_c

    for name in ("tensor_cores", "convolution"):
        new = cuda_c.compile_ptx(name, arch="sm_80")
        assert "cp.async.cg.shared.global" in new and "cp.async.wait_group" in new
        old = cuda_c.compile_ptx(name, arch="sm_75")
        assert "cp.async" not in old and "wmma.mma.sync" in old and "st.shared.v4" in old


# --------------------------------------------------------- the sm_75 fallback, run on whatever GPU is here

@pytest.fixture
def as_if_sm75(monkeypatch, tmp_path, fake_cc):
    """Lessons 4 and 5's CUDA C as a T4 gets it (PTX for sm_75: plain loads in place of cp.async), which the
    driver compiles for this GPU: the fallback's results checked on real hardware."""
    import numpy as np  # noqa: F401

    from gpucourse import cuda_c
    from kernels import convolution as cv, tensor_cores as tc

    cp = runtime.cupy()
    modules = {}
    for name in (tc.SOURCE, cv.SOURCE):
        ptx = cuda_c.compile_ptx(name, arch="sm_75")
        assert "cp.async" not in ptx
        path = tmp_path / f"{name}.ptx"
        path.write_text(ptx)
        modules[name] = cp.RawModule(path=str(path))
    monkeypatch.setattr(cuda_c, "module", lambda name, edits=None: modules[name])
    monkeypatch.setattr(tc, "_raised", set())
    monkeypatch.setattr(cv, "_igemm_ready", set())
    monkeypatch.setattr(gpus, "_noted", set())
    fake_cc("7.5")
    return tc, cv


@pytest.mark.gpu
def test_sm75_fallback_gemm_and_conv_match_spec(as_if_sm75, rng, capsys):
    import math

    import numpy as np

    tc, cv = as_if_sm75
    cp = runtime.cupy()
    # a T4 gives a block 64 KiB of shared memory: the tiles that need more are refused in one line
    with pytest.raises(runtime.CourseInputError, match=r"compute capability 7\.5 .* at most 65,536"):
        z = cp.zeros((256, 256), cp.float16)
        tc.gemm(z, z, cp.zeros((256, 256), cp.float32), kernel="tiled", config="wmma_tiled_128x128x64_w64x64_s4_f32")
    for config in ("wmma_tiled_64x64x32_w32x32_s1_f32", "wmma_tiled_128x128x32_w64x64_s3_f32",
                   tc.default_tiled("float32"), tc.default_tiled("float16")):
        c = tc.tiled_config(config)
        M, N, K = 2 * c["bm"], 3 * c["bn"], 5 * c["bk"] * 4
        A = rng.random((M, K)).astype(np.float16)
        B = rng.random((K, N)).astype(np.float16)
        C = cp.full((M, N), cp.nan, dtype=c["acc"])
        tc.gemm(cp.asarray(A), cp.asarray(B), C, kernel="tiled", config=config)
        prec = "fp16_inputs_fp32_acc" if c["acc"] == "float32" else "fp16_acc"
        assert tc.rel_error(C.get(), tc.gemm_spec(A, B)) <= tc.tolerance(prec, K), config
    for config in cv.IGEMM_CONFIGS:
        xs, ws = (3, 64, 15, 13), (72, 64, 3, 3)  # stride 2, ragged tiles, zero-filled edges
        x = rng.uniform(-1, 1, xs).astype(np.float16)
        w = rng.uniform(-1, 1, ws).astype(np.float16)
        want = cv.nchw_to_nhwc(cv.conv2d_spec(x, w, 1, 2, 1))
        y = cp.full(want.shape, cp.nan, cp.float16)
        cv.conv_implicit_gemm(cp.asarray(cv.nchw_to_nhwc(x)), cp.asarray(cv.kcrs_to_krsc(w)), y, pad=1, stride=2,
                              config=config)
        assert cv.rel_error(y.get(), want) <= cv.tolerance("float16", math.prod(ws[1:])), config
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("note:")] == [
        "note: lesson 4's tiled, pipelined WMMA GEMM copies tiles to shared memory with ordinary loads, "
        "synchronously (no overlap) (cp.async needs sm_80+).",
        "note: lesson 5's tensor-core convolution (implicit GEMM, NHWC) copies tiles to shared memory with "
        "ordinary loads, synchronously (no overlap) (cp.async needs sm_80+)."]


def test_sources_carry_the_pieces_they_include(tmp_path, monkeypatch):
    """A source's #include "file" of its own folder is replaced by the file's text, once: the compilers need no
    include path, and CuPy's cache key (the text) changes when a shared piece does."""
    import re

    from gpucourse import cuda_c

    for src in sorted(cuda_c.SOURCES.glob("*.cu")):
        text = cuda_c.source(src.stem)
        assert not re.search(r'#include\s+"', text), src.name
    assert cuda_c.source("inference_engine").count("cp.async.commit_group") == 1  # async_copy.cuh, once
    (tmp_path / "a.cuh").write_text('#pragma once\n#include "b.cuh"\nint a;\n')
    (tmp_path / "b.cuh").write_text("int b;\n")
    (tmp_path / "k.cu").write_text('#include "a.cuh"\n#include "b.cuh"\n#include <mma.h>\nint k;\n')
    (tmp_path / "bad.cu").write_text('#include "missing.cuh"\n')
    monkeypatch.setattr(cuda_c, "SOURCES", tmp_path)
    text = cuda_c.source("k")
    assert text.count("int b;") == 1 and "int a;" in text and "#include <mma.h>" in text
    with pytest.raises(runtime.CourseError, match="missing.cuh"):
        cuda_c.source("bad")

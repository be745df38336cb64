"""Lesson 4: the numba GEMMs in the simulator, the NumPy model of a tensor core, the peak formula, the CUDA C
kernels compiled to PTX without a GPU, the recorded figures against the issue's targets, and on a GPU the
kernels against float64 with the tolerance each precision allows."""
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import needs_compiler
from gpucourse import records, runtime
from gpucourse import cuda_c
from kernels import tensor_cores as tc

pytestmark = pytest.mark.lesson04
ROOT = Path(__file__).resolve().parents[1]
LESSON = "04_tensor_cores"
cuda = runtime.cuda()


def _device(x):
    return runtime.cupy().asarray(x) if runtime.is_gpu() else cuda.to_device(x)


def _host(x):
    return x.get() if hasattr(x, "get") and not hasattr(x, "copy_to_host") else x.copy_to_host()


# ------------------------------------------------------------------------- numba kernels (either mode)

@pytest.mark.parametrize("kernel", ["numba_naive", "numba_tiled"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (16, 16, 16), (19, 33, 21), (5, 40, 3)])
def test_numba_gemm_matches_float64(rng, kernel, shape):
    M, N, K = shape
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = rng.standard_normal((K, N)).astype(np.float32)
    C = _device(np.full((M, N), np.nan, np.float32))
    tc.gemm_numba(_device(A), _device(B), C, kernel=kernel)
    got = _host(C)
    want = tc.gemm_spec(A, B)
    scale = np.abs(A).astype(np.float64) @ np.abs(B).astype(np.float64)  # |A||B|: the error bound's scale
    assert np.all(np.abs(got - want) <= K * 2.0**-24 * scale + 1e-30)


def test_numba_gemm_checks_its_input():
    A = _device(np.zeros((4, 3), np.float32))
    B = _device(np.zeros((3, 5), np.float32))
    with pytest.raises(runtime.CourseInputError, match="device array"):
        tc.gemm_numba(np.zeros((4, 3), np.float32), B, _device(np.zeros((4, 5), np.float32)))
    with pytest.raises(runtime.CourseInputError, match="must match"):
        tc.gemm_numba(A, _device(np.zeros((4, 5), np.float32)), _device(np.zeros((4, 5), np.float32)))
    with pytest.raises(runtime.CourseInputError, match="shape"):
        tc.gemm_numba(A, B, _device(np.zeros((5, 4), np.float32)))
    with pytest.raises(runtime.CourseInputError, match="dtype"):
        tc.gemm_numba(A, B, _device(np.zeros((4, 5), np.float64)))
    with pytest.raises(runtime.CourseInputError, match="16 x 16"):
        tc.gemm_numba(A, B, _device(np.zeros((4, 5), np.float32)), threads=(32, 8))
    with pytest.raises(runtime.CourseInputError, match="kernel"):
        tc.gemm_numba(A, B, _device(np.zeros((4, 5), np.float32)), kernel="wmma")


# ------------------------------------------------------------------------ the NumPy model of an MMA

def test_fp16_products_are_exact_in_fp32(rng):
    a = rng.standard_normal(10_000).astype(np.float16)
    b = rng.standard_normal(10_000).astype(np.float16)
    p32 = a.astype(np.float32) * b.astype(np.float32)
    assert np.array_equal(p32.astype(np.float64), a.astype(np.float64) * b.astype(np.float64))


def test_mma_rounds_once_to_the_accumulator(rng):
    a = rng.random((16, 16)).astype(np.float16)
    b = rng.random((16, 16)).astype(np.float16)
    c = rng.random((16, 16)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64) + c
    assert np.array_equal(tc.mma(a, b, c), exact.astype(np.float32))
    assert np.array_equal(tc.mma(a, b, c, acc="float16"), exact.astype(np.float16))
    with pytest.raises(runtime.CourseInputError):
        tc.mma(a, b, c, acc="bfloat16")


def test_emulated_gemm_with_one_step_is_the_rounded_product(rng):
    A = rng.random((8, 48)).astype(np.float16)
    B = rng.random((48, 8)).astype(np.float16)
    exact = tc.gemm_spec(A, B)
    assert np.array_equal(tc.gemm_emulated(A, B, k_step=48), exact.astype(np.float32))
    assert tc.rel_error(tc.gemm_emulated(A, B, acc="float32"), exact) < 48 * 2.0**-24
    with pytest.raises(runtime.CourseInputError, match="K x N"):
        tc.gemm_emulated(A, A)


def test_fp16_accumulation_error_grows_with_k_and_fp32_stays_small():
    r = tc.accumulation_error([16, 256, 4096], m=32, n=32)
    assert r["fp16_acc"][0] < r["fp16_acc"][1] < r["fp16_acc"][2]
    for k, e32, e16 in zip(r["k"], r["fp32_acc"], r["fp16_acc"]):
        assert e32 <= tc.tolerance("fp16_inputs_fp32_acc", k)
        assert e16 <= tc.tolerance("fp16_acc", k) / 2  # the model sits well inside the GPU tolerance
        assert e16 > 100 * e32
    assert max(r["fp16_output"]) <= 2.0**-11  # one rounding to FP16 costs at most half an ulp


def test_the_notebooks_accumulation_table_says_what_its_prose_says():
    """Notebook 04's K sweep (uniform inputs, the model's defaults): with FP32 accumulation the error stays below the
    half-ulp of storing the result as FP16 at every K; with FP16 accumulation it grows about as the square root of K
    and passes a percent at the largest K."""
    ks = [16, 64, 256, 1024, 4096, 16384]
    r = tc.accumulation_error(ks)
    assert all(e32 < e_out for e32, e_out in zip(r["fp32_acc"], r["fp16_output"]))
    assert 0.35 <= np.polyfit(np.log(ks), np.log(r["fp16_acc"]), 1)[0] <= 0.65
    assert r["fp16_acc"][-1] > 0.01 > r["fp16_acc"][-2]


# ---------------------------------------------------------------- the NumPy emulation of WMMA (Task 4.2)

def _lesson_operands(ti, tj, k, M, N, K):
    """The lesson's wmma_naive, C = A B with A (M x K) and B (K x N) row-major: the pointers of cell 31."""
    return (ti * 16 * K + k, K), (k * N + tj * 16, N)


def test_wmma_emulation_of_the_lessons_kernel_is_the_product(rng):
    from kernels import wmma_emulator as wmma

    A = rng.random((48, 64)).astype(np.float16)
    B = rng.random((64, 32)).astype(np.float16)
    C = wmma.run_tiles(_lesson_operands, ("row_major", "row_major"), A, B, (48, 32), 64, (48, 32, 64))
    assert C.dtype == np.float32 and tc.rel_error(C, A.astype(np.float64) @ B.astype(np.float64)) < 1e-6
    np.testing.assert_array_equal(C, tc.gemm_emulated(A, B, acc="float32"))  # the same MMAs, the same roundings


@pytest.mark.parametrize("layouts,stored", [(("row_major", "col_major"), "X W^T"), (("col_major", "row_major"),
                                                                                    "A^T B")])
def test_wmma_emulation_reads_column_major_tiles(rng, layouts, stored):
    """A column-major fragment is the transpose of what a row-major load at the same pointer reads: X W^T (the
    linear layer, W N x K) and A^T B (the weight gradient, A stored M x N) both come out right."""
    from kernels import wmma_emulator as wmma

    M, N, K = 32, 48, 16
    if stored == "X W^T":
        X, W = rng.random((M, K)).astype(np.float16), rng.random((N, K)).astype(np.float16)
        ops = lambda ti, tj, k, M, N, K: ((ti * 16 * K + k, K), (tj * 16 * K + k, K))  # noqa: E731
        C, ref = wmma.run_tiles(ops, layouts, X, W, (M, N), K, (M, N, K)), X.astype(float) @ W.astype(float).T
    else:
        A, B = rng.random((K, M)).astype(np.float16), rng.random((K, N)).astype(np.float16)
        ops = lambda ti, tj, k, M, N, K: ((k * M + ti * 16, M), (k * N + tj * 16, N))  # noqa: E731
        C, ref = wmma.run_tiles(ops, layouts, A, B, (M, N), K, (M, N, K)), A.astype(float).T @ B.astype(float)
    assert tc.rel_error(C, ref) < 1e-6
    wrong = wmma.run_tiles(ops, tuple(reversed(layouts)), *((X, W) if stored == "X W^T" else (A, B)), (M, N), K,
                           (M, N, K))
    assert tc.rel_error(wrong, ref) > 0.01


def test_wmma_emulation_catches_a_wrong_pointer(rng):
    from kernels import wmma_emulator as wmma

    A = rng.random((32, 32)).astype(np.float16)
    B = rng.random((32, 32)).astype(np.float16)
    off_by_tile = lambda ti, tj, k, M, N, K: ((ti * 16 * K + k, K), (k * N + tj, N))  # noqa: E731
    C = wmma.run_tiles(off_by_tile, ("row_major", "row_major"), A, B, (32, 32), 32, (32, 32, 32))
    assert tc.rel_error(C, A.astype(float) @ B.astype(float)) > 0.01
    outside = lambda ti, tj, k, M, N, K: ((ti * 16 * K + k, K), (tj * 16 * K + k + 16, N))  # noqa: E731
    with pytest.raises(runtime.CourseInputError, match="outside it"):
        wmma.run_tiles(outside, ("row_major", "row_major"), A, B, (32, 32), 32, (32, 32, 32))
    with pytest.raises(runtime.CourseInputError, match="leading dimension"):
        wmma.load_matrix_sync(np.zeros(1024, np.float16), 0, 8, "row_major")


def test_wmma_emulation_turns_the_arithmetic_into_c():
    from kernels import wmma_emulator as wmma

    assert wmma.c_expressions(_lesson_operands) == (("(((ti * 16) * K) + k)", "K"), ("((k * N) + (tj * 16))", "N"))
    assert wmma.c_expressions(lambda ti, tj, k, M, N, K: ((k // 2 - 1, 16), (2 * ti % N, K))) == (
        ("((k / 2) - 1)", "16"), ("((2 * ti) % N)", "K"))
    with pytest.raises(runtime.CourseInputError, match="comparison"):
        wmma.c_expressions(lambda ti, tj, k, M, N, K: ((k if ti < 1 else 0, K), (0, N)))
    with pytest.raises(runtime.CourseInputError, match="integers"):
        wmma.c_expressions(lambda ti, tj, k, M, N, K: ((k * 0.5, K), (0, N)))


@needs_compiler
def test_wmma_emulations_c_compiles_to_the_layouts_it_emulates():
    """The generated loads compile with NVRTC (no GPU) into wmma.load instructions of the layouts emulated."""
    from kernels import wmma_emulator as wmma

    (a_off, a_ldm), (b_off, b_ldm) = wmma.c_expressions(_lesson_operands)
    source = ("#include <mma.h>\nusing namespace nvcuda;\n"
              'extern "C" __global__ void k(const half* A, const half* B, float* C, int M, int N, int K) {\n'
              " long long ti = blockIdx.x, tj = blockIdx.y;\n"
              " wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc; wmma::fill_fragment(acc, 0.0f);\n"
              " wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> a;\n"
              " wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> b;\n"
              " for (long long k = 0; k < K; k += 16) {\n"
              f"  wmma::load_matrix_sync(a, A + {a_off}, (unsigned){a_ldm});\n"
              f"  wmma::load_matrix_sync(b, B + {b_off}, (unsigned){b_ldm});\n"
              "  wmma::mma_sync(acc, a, b, acc); }\n"
              " wmma::store_matrix_sync(C + ti * 16 * N + tj * 16, acc, N, wmma::mem_row_major); }\n")
    tc.include_path_or_explain()
    ptx = cuda_c.ptx_from_source(source, "sm_80", filename="emulated.cu", compiler="nvrtc")
    assert re.search(r"wmma\.load\.a\.sync\.aligned\.row\.", ptx)
    assert re.search(r"wmma\.mma\.sync\.aligned\.row\.col\.m16n16k16\.f32\.f32", ptx)


def test_fp16_sequential_sum_stagnates():
    # 0.25 added 8192 times: exact 2048, but FP16's spacing reaches 0.5 at 512, so 0.25 rounds away there
    assert float(tc.sum_fp16_sequential(np.full(8192, 0.25))) == 512.0


def test_fp16_facts():
    f = tc.fp16_facts()
    assert f["float16"]["max"] == 65504.0 and f["float16"]["epsilon"] == 2.0**-10
    assert f["float16"]["smallest_subnormal"] == 2.0**-24 and f["float32"]["significand_bits"] == 24


def test_master_weights_and_loss_scaling(rng):
    m = tc.master_weight_updates(1000, update=1e-4)
    assert m["fp16"] == 1.0  # every update is below half of FP16's spacing at 1.0 and is lost
    assert m["fp32"] == pytest.approx(m["exact"], rel=1e-4)
    grads = rng.lognormal(np.log(1e-6), 2.5, 20_000).astype(np.float32)
    rows = tc.loss_scaling(grads, scales=(1, 2**10, 2**40))
    assert rows[0]["zero"] > 0.05 and rows[1]["zero"] < rows[0]["zero"] / 10
    assert rows[2]["overflow"] > 0  # too large a scale overflows FP16's 65504


def test_tolerances():
    assert tc.tolerance("float32", 8192) == pytest.approx(8192 * 2.0**-24)
    assert tc.tolerance("fp16_acc", 1024) == pytest.approx(4e-4 * 32)
    with pytest.raises(runtime.CourseInputError):
        tc.tolerance("int8", 16)


# ------------------------------------------------------------------------------- the peak formula

def test_peak_formula_gv100():
    assert tc.peak_tflops(**tc.GV100_SLIDE) == pytest.approx(119.8, abs=0.05)
    with pytest.raises(runtime.CourseInputError):
        tc.peak_tflops(0, 8, 128, 1.4)


def test_peak_for_known_gpus():
    a100 = tc.peak_for({"name": "A100", "compute_capability": "8.0", "sms": 108}, clock_mhz=1410)
    assert a100["tflops"] == pytest.approx(312, rel=0.01)  # the datasheet's dense FP16
    h100 = tc.peak_for({"name": "H100 SXM", "compute_capability": "9.0", "sms": 132}, clock_mhz=1830)
    assert h100["tflops"] == pytest.approx(989, rel=0.01)
    v100 = tc.peak_for({"name": "V100", "compute_capability": "7.0", "sms": 80}, clock_mhz=1530)
    assert v100["tflops"] == pytest.approx(125, rel=0.01)
    with pytest.raises(runtime.CourseInputError, match="compute capability"):
        tc.peak_for({"name": "P100", "compute_capability": "6.0", "sms": 56})


def test_tiled_configs_and_intensity():
    c = tc.tiled_config("wmma_tiled_128x256x32_w64x64_s3_f32")
    assert (c["threads"], c["warps"], c["stages"], c["acc"]) == (256, 8, 3, "float32")
    assert c["smem_bytes"] == 3 * (128 * 40 + 32 * 264) * 2
    for name in tc.TILED_CONFIGS:
        tc.tiled_config(name)
    with pytest.raises(runtime.CourseInputError):
        tc.tiled_config("wmma_tiled_1x1x1_w1x1_s1_f32")
    n = 8192
    order = ["numba_naive", "numba_tiled", "naive", "simt_128x128", "tiled"]
    values = [tc.intensity(k, n) for k in order]
    assert values == sorted(values)  # bigger tiles, fewer bytes per FLOP
    assert tc.intensity("numba_tiled", n) == pytest.approx(16 * tc.intensity("numba_naive", n))


# ----------------------------------------------------------------------- PTX, compiled without a GPU

CUDA_KERNELS = ["wmma_naive_f32", "wmma_naive_f16", "sgemm_128x128x8", "sgemm_tiled16", *tc.TILED_CONFIGS]


@needs_compiler
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_c_compiles_to_tensor_core_instructions(arch):
    ptx = cuda_c.compile_ptx(tc.SOURCE, arch=arch)
    body = {k: cuda_c.ptx_entry(ptx, k) for k in CUDA_KERNELS}
    for name in ("wmma_naive_f32", *tc.TILED_CONFIGS):
        assert re.search(r"wmma\.mma\.sync\.aligned\.row\.row\.m16n16k16\.f(32|16)\.f(32|16)", body[name]), name
    assert re.search(r"wmma\.mma\.sync.*\.f32\.f32", body["wmma_naive_f32"])
    assert re.search(r"wmma\.mma\.sync.*\.f16\.f16", body["wmma_naive_f16"])
    for name in tc.TILED_CONFIGS:
        assert "cp.async.cg.shared.global" in body[name] and "cp.async.wait_group" in body[name], name
        assert "bar.sync" in body[name]
    for name in ("sgemm_128x128x8", "sgemm_tiled16"):
        assert "mma" not in body[name] and "fma.rn.f32" in body[name]
    assert "ld.global.v4.f32" in body["sgemm_128x128x8"] or "ld.global.nc.v4.f32" in body["sgemm_128x128x8"]
    assert "cp.async.cg.shared.global" in body["sgemm_128x128x8"] and ".maxnreg" not in body["sgemm_128x128x8"]
    assert ".minnctapersm 2" in body["sgemm_128x128x8"]  # __launch_bounds__(256, 2): two blocks an SM


def test_include_path_found_or_explained(monkeypatch):
    try:
        dirs = tc.include_path_or_explain()
        assert dirs
    except runtime.CourseError as exc:
        assert "CUDA_PATH" in str(exc)
    monkeypatch.setattr(cuda_c, "include_dirs", lambda: [])
    with pytest.raises(runtime.CourseError, match="mma.h"):
        tc.include_path_or_explain()


@pytest.fixture(scope="module")
def numba_ptx_of_gemms():
    from gpucourse.numba_ptx import numba_ptx

    try:
        return numba_ptx({k: tc.NUMBA_SIGNATURE for k in ("gemm_naive", "gemm_tiled")}, module="kernels.tensor_cores")
    except runtime.CourseError as exc:
        if "nvvm" in str(exc).lower():
            pytest.skip(f"numba-cuda cannot find NVVM here: {exc}")
        raise


def test_numba_tiled_kernel_uses_shared_memory(numba_ptx_of_gemms):
    assert "ld.shared.f32" in numba_ptx_of_gemms["gemm_tiled"] and "bar.sync" in numba_ptx_of_gemms["gemm_tiled"]
    assert ".shared" not in numba_ptx_of_gemms["gemm_naive"].split(".entry")[1]


# ----------------------------------------------- what a GPU recorded, against the issue (either mode)

@pytest.fixture(scope="module")
def record():
    rec = records.latest(LESSON)
    if rec is None:
        pytest.skip("no GPU record of lesson 4 yet")
    return rec["figures"]


def _rows(table):
    return {r["name"]: r for r in table["rows"]}


def test_recorded_kernels_are_checked_and_ordered(record):
    t = record["kernels"]
    assert t["n"] == 8192
    rows = _rows(t)
    for r in t["rows"]:
        assert r["check_error"] <= (3e-2 if r["precision"] == "FP16 acc" else 5e-3)
    assert rows["numba, shared-memory tiles 16x16"]["tflops"] > rows["numba, naive"]["tflops"]
    tiled = next(r for r in t["rows"] if r["name"].startswith("WMMA, tiled ("))
    assert tiled["tflops"] > 3 * rows["WMMA, one warp per 16x16 tile"]["tflops"]
    assert t["tc_vs_simt_cublas"] > 5  # tensor cores against FP32 SIMT, the slide's "9.3x"


def test_recorded_targets(record):
    """Issue targets at 8192^3: tiled WMMA FP16 >= 0.35x cuBLAS FP16; tiled FP32 SIMT >= 0.5x cuBLAS FP32."""
    t = record["kernels"]
    tiled = next(r for r in t["rows"] if r["name"].startswith("WMMA, tiled ("))
    assert tiled["of_cublas"] >= 0.35, f"tiled WMMA at {tiled['of_cublas']:.2f}x of cuBLAS FP16"
    simt = _rows(t)["CUDA C, register tiles 128x128 (8x8 a thread)"]
    assert simt["of_cublas"] >= 0.5, f"register-tiled SGEMM at {simt['of_cublas']:.2f}x of cuBLAS FP32"


def test_recorded_errors_within_tolerance(record):
    e = record["errors"]
    for r in e["rows"]:
        assert r["vs_inputs_as_used"] <= r["tolerance"], r["name"]
        assert r["tolerance"] == pytest.approx(tc.tolerance(r["precision"], e["n"]))


def test_recorded_accumulation_follows_the_model(record):
    a = record["accumulation"]
    for k, e32, e16 in zip(a["k"], a["gpu_fp32_acc"], a["gpu_fp16_acc"]):
        assert e32 <= tc.tolerance("fp16_inputs_fp32_acc", k)
        assert e16 <= tc.tolerance("fp16_acc", k)
    assert a["gpu_fp16_acc"][-1] > 10 * a["gpu_fp16_acc"][0] or a["gpu_fp16_acc"][-1] > 1e-3


def test_recorded_configs_show_the_pipeline_pays(record):
    rows = {(r["bm"], r["bn"], r["bk"], r["wm"], r["wn"], r["stages"], r["acc"]): r["tflops"]
            for r in record["configs"]["rows"]}
    assert rows[(128, 128, 32, 64, 64, 2, "float32")] > rows[(128, 128, 32, 64, 64, 1, "float32")]
    assert rows[(128, 128, 32, 64, 64, 1, "float32")] > rows[(64, 64, 32, 32, 32, 1, "float32")]
    # notebook 04: bigger warp tiles do more mma_sync per fragment loaded
    assert rows[(128, 128, 32, 64, 64, 3, "float32")] > rows[(128, 128, 32, 64, 32, 3, "float32")]


def test_recorded_peak(record):
    p = record["peak"]
    assert p["gv100"]["tflops"] == pytest.approx(119.8, abs=0.05)
    assert p["formula"]["tflops"] > 0


# ----------------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16, 16, 16), (48, 80, 64), (256, 128, 1024)])
@pytest.mark.parametrize("acc", ["float32", "float16"])
def test_wmma_naive_on_gpu(rng, shape, acc):
    cp = runtime.cupy()
    M, N, K = shape
    A = rng.random((M, K)).astype(np.float16)
    B = rng.random((K, N)).astype(np.float16)
    C = cp.full((M, N), cp.nan, dtype=acc)
    tc.gemm(cp.asarray(A), cp.asarray(B), C, kernel="naive")
    prec = "fp16_inputs_fp32_acc" if acc == "float32" else "fp16_acc"
    assert tc.rel_error(C.get(), tc.gemm_spec(A, B)) <= tc.tolerance(prec, K)


@pytest.mark.gpu
@pytest.mark.parametrize("config", tc.TILED_CONFIGS)
def test_wmma_tiled_on_gpu(rng, config):
    cp = runtime.cupy()
    c = tc.tiled_config(config)
    M, N, K = 2 * c["bm"], 3 * c["bn"], 5 * c["bk"] * 4
    A = rng.random((M, K)).astype(np.float16)
    B = rng.random((K, N)).astype(np.float16)
    C = cp.full((M, N), cp.nan, dtype=c["acc"])
    tc.gemm(cp.asarray(A), cp.asarray(B), C, kernel="tiled", config=config)
    prec = "fp16_inputs_fp32_acc" if c["acc"] == "float32" else "fp16_acc"
    got = C.get()
    assert tc.rel_error(got, tc.gemm_spec(A, B)) <= tc.tolerance(prec, K)
    if c["acc"] == "float32":  # and with the model of the MMA, to a few FP32 ulps of the result
        model = tc.gemm_emulated(A, B, acc="float32")
        assert tc.rel_error(got, model) <= 4 * K / 16 * 2.0**-24


@pytest.mark.gpu
def test_wmma_rejects_bad_shapes():
    cp = runtime.cupy()
    A = cp.zeros((100, 64), cp.float16)
    B = cp.zeros((64, 128), cp.float16)
    with pytest.raises(runtime.CourseInputError, match="multiple"):
        tc.gemm(A, B, cp.zeros((100, 128), cp.float32), kernel="tiled")
    with pytest.raises(runtime.CourseInputError, match="multiple of 16"):
        tc.gemm(A, B, cp.zeros((100, 128), cp.float32), kernel="naive")
    with pytest.raises(runtime.CourseInputError, match="float32"):
        tc.gemm(A[:96], B, cp.zeros((96, 128), cp.float64), kernel="naive")
    with pytest.raises(runtime.CourseInputError, match="accumulates"):
        tc.gemm(cp.zeros((128, 64), cp.float16), cp.zeros((64, 256), cp.float16), cp.zeros((128, 256), cp.float16),
                kernel="tiled", config="wmma_tiled_128x256x32_w64x64_s3_f32")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, shape", [("simt_128x128", (256, 384, 1024)), ("simt_tiled16", (100, 70, 33)),
                                           ("simt_tiled16", (128, 128, 128))])
def test_simt_sgemm_on_gpu(rng, kernel, shape):
    cp = runtime.cupy()
    M, N, K = shape
    A = rng.random((M, K)).astype(np.float32)
    B = rng.random((K, N)).astype(np.float32)
    C = cp.full((M, N), cp.nan, dtype=cp.float32)
    tc.gemm(cp.asarray(A), cp.asarray(B), C, kernel=kernel)
    assert tc.rel_error(C.get(), tc.gemm_spec(A, B)) <= tc.tolerance("float32", K)


@pytest.mark.gpu
def test_numba_kernels_on_gpu_at_size(rng):
    cp = runtime.cupy()
    M, N, K = 300, 257, 513
    A = rng.random((M, K)).astype(np.float32)
    B = rng.random((K, N)).astype(np.float32)
    for kernel in ("numba_naive", "numba_tiled"):
        C = cp.full((M, N), cp.nan, dtype=cp.float32)
        tc.gemm_numba(cuda.as_cuda_array(cp.asarray(A)), cuda.as_cuda_array(cp.asarray(B)), cuda.as_cuda_array(C),
                      kernel=kernel)
        assert tc.rel_error(C.get(), tc.gemm_spec(A, B)) <= tc.tolerance("float32", K)


@pytest.mark.gpu
def test_tf32_library_is_less_precise_than_fp32(rng):
    cp = runtime.cupy()
    A = cp.asarray(rng.random((512, 2048)).astype(np.float32))
    B = cp.asarray(rng.random((2048, 512)).astype(np.float32))
    ref = tc.gemm_spec(A.get(), B.get())
    e32 = tc.rel_error(tc.gemm_library(A, B).get(), ref)
    etf = tc.rel_error(tc.gemm_library(A, B, tf32=True).get(), ref)
    assert e32 <= tc.tolerance("float32", 2048)
    assert etf <= tc.tolerance("tf32", 2048)
    if runtime.get().device["compute_capability"] >= "8.0":
        assert etf > e32
    assert tc.rel_error(tc.gemm_library(A, B).get(), ref) == e32  # the FP32 compute type was restored


@pytest.mark.gpu
def test_tiled_wmma_against_cublas_live():
    """A regression floor, measured now: the tiled WMMA kernel well above the one-warp-per-tile kernel's 0.04x of
    cuBLAS FP16 at 8192^3 (it reads 0.40-0.42x alone on an H100 or H200). The goal (>= 0.35x) is judged on the record
    (test_recorded_targets): a floor at the goal failed here when other tests shared the GPU."""
    from gpucourse import bench

    cp = runtime.cupy()
    n = 8192
    A = cp.random.random((n, n), dtype=cp.float32).astype(cp.float16)
    B = cp.random.random((n, n), dtype=cp.float32).astype(cp.float16)
    C = cp.empty((n, n), cp.float32)
    t = bench.interleaved({"ours": lambda: tc.gemm(A, B, C, kernel="tiled"), "cublas": lambda: cp.matmul(A, B)},
                          rounds=2, repeats=2, batch=4)
    ratio = t["cublas"].median_ms / t["ours"].median_ms
    assert ratio >= 0.25, f"tiled WMMA at {ratio:.2f}x of cuBLAS FP16"
    assert math.isfinite(ratio)


# ------------------------------------------------------------ Hopper: wgmma fed by the TMA (sm_90a)

def test_wgmma_configs_parse_and_fit():
    for name in tc.WGMMA_CONFIGS:
        c = tc.wgmma_config(name)
        assert c["bk"] == 64 and c["bm"] % 64 == 0 and c["threads"] == 128 * (1 + c["bm"] // 64)
        assert c["smem_bytes"] <= 227 * 1024  # Hopper's shared memory per block
    assert tc.DEFAULT_WGMMA in tc.WGMMA_CONFIGS
    with pytest.raises(runtime.CourseInputError, match="no wgmma kernel"):
        tc.wgmma_config("wgmma_128x256x64_s9_kn")


def test_wgmma_config_names_say_persistence_and_the_output_type():
    """The names of the persistent kernels parse into what the launcher needs: a block per SM or per tile, C's type,
    and the shared memory of the TMA-store epilogue (two 64 x 64 FP16 pieces a consumer beside the 4 stages)."""
    plain = tc.wgmma_config(tc.DEFAULT_WGMMA)
    assert not plain["persistent"] and plain["out"] == "float32" and plain["epilogue"] == "registers"
    p32 = tc.wgmma_config("wgmma_128x256x64_s4_kn_persistent")
    assert p32["persistent"] and p32["out"] == "float32" and p32["epilogue"] == "registers"
    assert p32["smem_bytes"] == plain["smem_bytes"] and (p32["bm"], p32["bn"], p32["stages"]) == (128, 256, 4)
    p16 = tc.wgmma_config("wgmma_128x256x64_s4_kn_persistent_f16")
    assert p16["persistent"] and p16["out"] == "float16" and p16["epilogue"] == "registers"
    tma = tc.wgmma_config("wgmma_128x256x64_s4_kn_persistent_f16_tmastore")
    assert tma["persistent"] and tma["out"] == "float16" and tma["epilogue"] == "tma"
    assert tma["smem_bytes"] == plain["smem_bytes"] + 2 * 2 * 64 * 64 * 2 == 230464  # 227 KiB is 232448
    assert plain["in_flight"] == p16["in_flight"] == tma["in_flight"] == 0
    # one slice's MMAs left running, in three tiles: 4 stages of 128 x 256 or 128 x 192, 6 of 128 x 128, each beside
    # C's 32 KiB of pieces (5 stages of 128 x 192 would need 238,672 bytes)
    w256, w192, w128 = map(tc.wgmma_config, tc.PERSISTENT_TILES)
    assert all(c["persistent"] and c["out"] == "float16" and c["epilogue"] == "tma" and c["in_flight"] == 1
               and c["b_layout"] == "kn" and c["consumers"] == 2 and c["threads"] == 384 for c in (w256, w192, w128))
    assert [(c["bm"], c["bn"], c["stages"]) for c in (w256, w192, w128)] == [(128, 256, 4), (128, 192, 4), (128, 128, 6)]
    assert (w256["smem_bytes"], w192["smem_bytes"], w128["smem_bytes"]) == (230464, 197696, 230496)
    assert all(n in tc.WGMMA_CONFIGS for n in tc.PERSISTENT_TILES)
    for bad in ("wgmma_128x256x64_s4_kn_f16", "wgmma_128x256x64_s4_kn_persistent_tmastore",
                "wgmma_128x256x64_s4_nk_persistent", "wgmma_128x256x64_s4_kn_persistent_f16_tmastore_x",
                "wgmma_128x256x64_s4_kn_persistent_f16_wait1", "wgmma_128x192x64_s6_kn_persistent_f16_tmastore_wait1"):
        with pytest.raises(runtime.CourseInputError, match="no wgmma kernel"):
            tc.wgmma_config(bad)
    # a block per tile, or per SM where there are more tiles than SMs
    assert tc.wgmma_blocks(plain, 8192, 8192) == 64 * 32
    assert tc.wgmma_blocks(p16, 8192, 8192, sms=132) == 132
    assert tc.wgmma_blocks(p16, 300, 264, sms=132) == 3 * 2
    with pytest.raises(runtime.CourseInputError, match="number of SMs"):
        tc.wgmma_blocks(p16, 8192, 8192)


CLUSTER_WGMMA = [n for n in tc.WGMMA_CONFIGS if tc.wgmma_config(n)["cluster"] > 1]


def test_the_cluster_kernel_parses_and_launches_whole_clusters():
    """The "_c2" kernel is the TMA-store persistent kernel (the same tile, stages and shared memory) run in clusters of
    two blocks; its grid is always a whole number of clusters, a cluster per two SMs or per cluster tile (two tiles
    of one column of C on adjacent rows) if fewer; a tile-row count that is odd leaves the last cluster tiles half
    outside C, and they count as whole ones."""
    assert CLUSTER_WGMMA == ["wgmma_128x256x64_s4_kn_persistent_f16_tmastore_c2"]
    c2 = tc.wgmma_config(CLUSTER_WGMMA[0])
    twin = tc.wgmma_config(CLUSTER_WGMMA[0].removesuffix("_c2"))
    assert c2["cluster"] == 2 and twin["cluster"] == 1 and tc.wgmma_config(tc.DEFAULT_WGMMA)["cluster"] == 1
    assert {k: v for k, v in c2.items() if k not in ("name", "cluster")} == \
        {k: v for k, v in twin.items() if k not in ("name", "cluster")}
    assert c2["smem_bytes"] == 230464 and c2["threads"] == 384 and c2["in_flight"] == 0 and c2["b_layout"] == "kn"
    assert tc.wgmma_blocks(c2, 8192, 8192, sms=132) == 132  # 32 x 32 cluster tiles, 66 clusters
    assert tc.wgmma_blocks(c2, 8192, 8192, sms=133) == 132  # never half a cluster
    assert tc.wgmma_blocks(c2, 300, 264, sms=132) == 2 * (2 * 2)  # 3 tile-rows: 2 rows of cluster tiles, 2 columns
    assert tc.wgmma_blocks(c2, 1, 8, sms=132) == 2  # smaller than one tile: one cluster, its second block idle
    assert tc.wgmma_blocks(c2, 2100, 2312, sms=4) == 4
    with pytest.raises(runtime.CourseInputError, match="clusters of 2"):
        tc.wgmma_blocks(c2, 8192, 8192, sms=1)
    for bad in ("wgmma_128x256x64_s4_kn_persistent_f16_c2", "wgmma_128x256x64_s4_kn_persistent_f16_tmastore_c3",
                "wgmma_128x256x64_s4_kn_persistent_f16_tmastore_c2_wait1",
                "wgmma_128x128x64_s6_kn_persistent_f16_tmastore_wait1_c2"):
        with pytest.raises(runtime.CourseInputError, match="no wgmma kernel"):
            tc.wgmma_config(bad)
    for blocks in (3, 1, 2.5, True):
        with pytest.raises(runtime.CourseInputError, match="multiple of 2"):
            tc.check_cluster_blocks(c2, blocks)
    tc.check_cluster_blocks(c2, 4)
    tc.check_cluster_blocks(c2, None)
    tc.check_cluster_blocks(twin, 3)  # one block: any count


def test_the_tile_rule_fills_the_waves():
    """wave_efficiency by hand on 132 SMs (an H100), and the tile persistent_tile picks for a transformer layer's
    GEMMs (8192 tokens; d = 768 and 4096): 128 x 192 where 128 x 256 leaves most of a wave idle (d = 768's MLP down:
    192 tiles in 2 waves, 0.73; QKV: 576 tiles in 5 waves, 0.87), else 128 x 256, the largest, whenever a smaller tile
    fills the waves by less than TILE_TIE more."""
    w256, w192, w128 = tc.PERSISTENT_TILES
    assert tc.wave_efficiency(w256, 8192, 768, 132) == pytest.approx(8192 * 768 / (2 * 132 * 128 * 256))
    assert tc.wave_efficiency(w192, 8192, 768, 132) == pytest.approx(8192 * 768 / (2 * 132 * 128 * 192))
    assert tc.wave_efficiency(w128, 8192, 768, 132) == pytest.approx(8192 * 768 / (3 * 132 * 128 * 128))
    assert tc.wave_efficiency(w192, 8192, 8192, 132) == pytest.approx(8192 * 8192 / (21 * 132 * 128 * 192))  # 43 cols
    assert tc.wave_efficiency(w256, 128, 256, 132) == pytest.approx(1 / 132)  # one tile, one SM of 132
    assert tc.wave_efficiency(w256, 256, 256, 2) == 1.0 and tc.wave_efficiency(w256, 200, 256, 2) == 200 / 256
    picks = {(n, k): tc.persistent_tile(8192, n, 132) for n, k in
             ((2304, "768 QKV"), (3072, "768 up"), (768, "768 down"), (12288, "4096 QKV"), (16384, "4096 up"),
              (4096, "4096 down"), (8192, "8192^3"))}
    assert {k: tc.wgmma_config(c)["bn"] for (n, k), c in picks.items()} == {
        "768 QKV": 192, "768 up": 256, "768 down": 192, "4096 QKV": 256, "4096 up": 256, "4096 down": 256, "8192^3": 256}
    for (n, _), c in picks.items():  # never more than TILE_TIE short of the best tile's waves
        assert tc.wave_efficiency(c, 8192, n, 132) >= (1 - tc.TILE_TIE) * max(
            tc.wave_efficiency(t, 8192, n, 132) for t in tc.PERSISTENT_TILES)
    assert tc.persistent_tile(8192, 12288, 132, tie=0.0) == w128  # 0.99 against 0.97: taken only without the tie
    assert tc.persistent_tile(8192, 768, 132, tiles=(w256,)) == w256
    with pytest.raises(runtime.CourseInputError, match="block per tile"):
        tc.wave_efficiency(tc.DEFAULT_WGMMA, 8192, 8192, 132)
    with pytest.raises(runtime.CourseInputError, match="positive"):
        tc.wave_efficiency(w256, 8192, 8192, 0)


def test_wgmma_needs_a_gpu_or_says_which(monkeypatch):
    from gpucourse import gpus

    if not runtime.is_gpu():
        with pytest.raises(runtime.NeedsGPU):
            tc.gemm_wgmma(None, None, None)
    st = gpus.status("04.wgmma", cc=(8, 0))
    assert not st.runs and st.lacking == ["wgmma"]
    assert st.line().startswith("lesson 4's Hopper GEMM (wgmma fed by the TMA) needs wgmma")
    assert "sm_90a (compute capability 9.0 exactly)" in st.line()
    assert gpus.status("04.wgmma", cc=(9, 0)).runs


NEVER_ARRIVES = r"""
extern "C" __global__ void wait_forever(int* out) {
#ifdef GPUCOURSE_WGMMA
  __shared__ unsigned long long bar;
  if (threadIdx.x == 0) hopper::mbar_init(&bar, 1);
  __syncthreads();
  hopper::mbar_wait(&bar, 0);  // nobody arrives
  out[0] = 1;
#endif
}
"""


@pytest.mark.gpu
def test_a_wait_that_never_ends_fails_the_launch():
    """hopper.cuh's bounded wait, for real: an mbarrier nobody arrives on, waited on with a time-out of 0.2 s (in a
    child process: the failed launch leaves its CUDA context unusable) ends the launch with an error, not a hang."""
    import subprocess
    import sys

    child = f"""
import time, cupy as cp
from cupy.cuda import nvrtc
from gpucourse import cuda_c
prog = cuda_c._nvrtc(cuda_c.source("hopper.cuh") + {NEVER_ARRIVES!r}, "never.cu", "sm_90a",
                     ["-std=c++17", "-arch=sm_90a", "-DGPUCOURSE_MBAR_TIMEOUT_NS=200000000ull",
                      *("-I" + d for d in cuda_c.include_dirs())])
open("never.cubin", "wb").write(nvrtc.getCUBIN(prog))
fn = cp.RawModule(path="never.cubin").get_function("wait_forever")
out = cp.zeros(1, dtype=cp.int32)
t0 = time.time()
try:
    fn((1,), (128,), (out,))
    cp.cuda.Device().synchronize()
    print("RESULT no error", out.get()[0])
except Exception as exc:
    print("RESULT", type(exc).__name__, exc, round(time.time() - t0, 2))
"""
    if not runtime.is_gpu() or runtime.compute_capability() != (9, 0):
        pytest.skip("the bounded wait is Hopper's (sm_90a)")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, cwd=tmp,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT")), done.stderr[-2000:])
    assert "unspecified launch failure" in line, line
    assert float(line.split()[-1]) < 10, line  # the 0.2 s time-out, not a hang


def test_tensor_map_args():
    """cuTensorMapEncodeTiled's view of a C-contiguous FP16 array: dimensions and box fastest first, byte strides
    of all but the fastest; a matrix as lesson 4 reads it, an NHWC image as lesson 5's wgmma convolution does."""
    assert tc.tensor_map_args((1000, 2056), (128, 64)) == ((2056, 1000), (4112,), (64, 128))
    assert tc.tensor_map_args((32, 56, 56, 64), (1, 2, 64, 64)) == (
        (64, 56, 56, 32), (128, 128 * 56, 128 * 56 * 56), (64, 64, 2, 1))
    with pytest.raises(runtime.CourseInputError, match="multiple of 8"):
        tc.tensor_map_args((64, 100), (64, 64))
    with pytest.raises(runtime.CourseInputError, match="256"):
        tc.tensor_map_args((64, 64), (512, 64))
    with pytest.raises(runtime.CourseInputError, match="a box side for each"):
        tc.tensor_map_args((64, 64), (64,))


@needs_compiler
def test_wgmma_source_compiles_to_wgmma_and_tma_for_sm90a_only():
    ptx = cuda_c.compile_ptx(tc.WGMMA_SOURCE, arch="sm_90a")
    for name in tc.WGMMA_CONFIGS:
        body = cuda_c.ptx_entry(ptx, name)
        c = tc.wgmma_config(name)
        assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{c['bn']}k16\.f32\.f16\.f16", body), name
        assert body.count("wgmma.mma_async") == 4, name  # k = 64 per stage, 16 per instruction
        assert "cp.async.bulk.tensor.2d" in body and "mbarrier.try_wait.parity" in body, name
        assert "wgmma.commit_group" in body and "wgmma.wait_group" in body, name
        assert "%globaltimer" in body and "brkpt;" in body, name  # every mbarrier wait ends: a time-out fails
        assert ("setmaxnreg" in body) is (c["consumers"] > 1), name  # registers move to two consumers only
        trans_b = re.search(r"wgmma\.mma_async[^;]*,\s*(\d+);", body).group(1)
        assert trans_b == ("1" if c["b_layout"] == "kn" else "0"), name
        # persistent: the tile loop steps by the grid's size (in clusters: by the grid's clusters); plain: one tile,
        # from blockIdx.x alone
        assert ("%nctaid.x" in body or "%nclusterid.x" in body) is c["persistent"], name
        assert (".reqnctapercluster" in body) is (c["cluster"] > 1), name
        # "_wait1": each slice waits for the one before it (wait_group 1), the tile's last for itself (0); else 0 only
        waits = set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", body))
        assert waits == ({"0", "1"} if c["in_flight"] else {"0"}), name
        if c["epilogue"] == "tma":  # a 64-column piece a stmatrix group of four, BN / 64 B boxes for "kn"
            assert body.count("stmatrix.sync.aligned") == 4 * (c["bn"] // 64), name
        stores = set(re.findall(r"st\.global[.\w]*", body))
        tma_store = "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" in body
        if c["epilogue"] == "tma":  # FP16 pieces by stmatrix, in shared memory, stored by the TMA; no thread stores
            assert tma_store and "stmatrix.sync.aligned.m8n8.x4.shared.b16" in body and not stores, name
            assert "fence.proxy.async.shared::cta" in body and "cp.async.bulk.wait_group.read" in body, name
            assert "cvt.rn.f16x2.f32" in body, name
        elif c["out"] == "float16":  # two FP16 rounded together, stored as one 32-bit word (or one alone at an edge)
            assert not tma_store and "cvt.rn.f16x2.f32" in body and stores == {"st.global.u32", "st.global.u16"}, name
        else:
            assert not tma_store and stores == {"st.global.v2.f32", "st.global.f32"}, name
    plain = cuda_c.compile_ptx(tc.WGMMA_SOURCE, arch="sm_90")  # without the a: stubs that trap
    assert "wgmma.mma_async" not in plain and "cp.async.bulk" not in plain and "trap" in plain


def _cluster_ptx_checks(body: str, name: str, loads: int) -> None:
    """What a kernel of clusters of two sharing B must show in its PTX (tests of the FP16 and FP8 cluster kernels):
    the cluster's size as a compile-time attribute (so that an ordinary launch makes the clusters), ``loads`` TMA loads
    of B multicast to both blocks (mask 0b11, a 16-bit register), a stage's release arriving on both blocks' empty
    barriers (mapa'd into the cluster's window, released at the cluster's scope) and the producer's wait on it
    acquiring at that scope, the cluster barrier after the barriers' init (and its fence) and before the exit, and C
    leaving by the TMA only."""
    assert ".explicitcluster" in body and re.search(r"\.reqnctapercluster 2, 1, 1\b", body), name
    multicast = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes"
                           r"\.multicast::cluster \[[^]]+\], \[[^]]+\], \[[^]]+\], %rs\d+;", body)
    assert len(multicast) == loads, (name, multicast)
    assert body.count("mapa.shared::cluster.u32") == 2, name  # unrolled: rank 0 and rank 1
    assert body.count("mbarrier.arrive.shared::cluster.b64 _,") == 2, name  # the block's scope, as CUTLASS
    assert "acquire.cluster" not in body and "release.cluster.shared::cluster" not in body, name  # no MEMBAR.GPU
    assert "fence.mbarrier_init.release.cluster" in body, name
    assert body.count("barrier.cluster.arrive.release.aligned") == 2, name  # after the init, before the exit
    assert body.count("barrier.cluster.wait.acquire.aligned") == 2, name
    assert body.index("fence.mbarrier_init") < body.index("barrier.cluster.arrive") < body.index("multicast::cluster")
    assert "%cluster_ctarank" in body and "%clusterid.x" in body, name
    assert not re.findall(r"st\.global", body), name
    assert "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" in body, name


@needs_compiler
def test_the_cluster_kernel_multicasts_b_and_spans_its_barriers_across_the_cluster():
    ptx = cuda_c.compile_ptx(tc.WGMMA_SOURCE, arch="sm_90a")
    for name in tc.WGMMA_CONFIGS:
        body = cuda_c.ptx_entry(ptx, name)
        c = tc.wgmma_config(name)
        if c["cluster"] > 1:  # this block's half of B's BN / 64 boxes of 64 columns, each multicast
            _cluster_ptx_checks(body, name, c["bn"] // 64 // 2)
        else:  # the one-block kernels: nothing of the cluster
            assert not any(w in body for w in ("multicast", "barrier.cluster", "mapa", "cluster_ctarank",
                                               ".reqnctapercluster", "acquire.cluster")), name


@needs_compiler
def test_wgmma_kernels_keep_their_accumulators_in_registers():
    """ptxas's own account (no GPU needed): no kernel of the source spills, the persistent ones with their tile loop
    and epilogues included, and none has its wgmmas serialised for want of registers (C7512)."""
    log = cuda_c.ptxas_log(tc.WGMMA_SOURCE, "sm_90a").replace("\x00", "")
    for name in tc.WGMMA_CONFIGS:
        part = log.split(f"Compiling entry function '{name}'")[1].split("Compiling entry function")[0]
        assert "0 bytes spill stores, 0 bytes spill loads" in part, (name, part)
    assert "C7512" not in log and "serialized" not in log, log


@pytest.mark.gpu
@pytest.mark.parametrize("config", tc.WGMMA_CONFIGS)
def test_wgmma_gemm_on_gpu(rng, config):
    """Each kernel against the exact product: FP32 sums (K 2^-24 of the sum of |products|), and, for FP16 C, one
    rounding more (half an FP16 ulp: 2^-11 of |C|, 2^-25 below FP16's normal range). The persistent kernels also on
    more tiles than SMs and on a few blocks walking many tiles each, the ring's phases running across tiles whose
    slices do not fill it evenly (15 slices on 4 stages), ragged at every edge."""
    from gpucourse import gpus

    if not gpus.supports("wgmma"):
        with pytest.raises(runtime.CourseError, match="needs wgmma"):
            gpus.step("04.wgmma")
        pytest.skip(gpus.missing("wgmma"))
    cp = runtime.cupy()
    c = tc.wgmma_config(config)
    shapes = [(c["bm"], c["bn"], 64, None), (2 * c["bm"], 3 * c["bn"], 5 * 64 * 3, None)]
    if config == tc.DEFAULT_WGMMA or c["b_layout"] == "nk" or c["persistent"]:
        shapes += [(300, 264, 200, None), (1, 8, 8, None), (1000, 1032, 2056, None)]  # ragged: zero-filled reads,
    if c["persistent"]:                                                                 # guarded or clipped stores
        few = (3, 1) if c["cluster"] == 1 else (4, 2)  # in clusters of two: two clusters, one
        shapes += [(2100, 2312, 200, None), (2100, 2312, 960, few[0]), (700, 776, 960, few[1])]  # 170 tiles
    fp16 = c["out"] == "float16"
    for M, N, K, blocks in shapes:
        A = rng.uniform(-1, 1, (M, K)).astype(np.float16)
        B = rng.uniform(-1, 1, (K, N)).astype(np.float16)
        Bop = B if c["b_layout"] == "kn" else np.ascontiguousarray(B.T)
        C = cp.full((M, N), cp.nan, cp.float16 if fp16 else cp.float32)
        if blocks is None:
            tc.gemm(cp.asarray(A), cp.asarray(Bop), C, kernel="wgmma", config=config)
        else:
            tc.gemm_wgmma(cp.asarray(A), cp.asarray(Bop), C, config=config, blocks=blocks)
        got, want = C.get().astype(np.float64), tc.gemm_spec(A, B)
        scale = np.abs(A).astype(np.float64) @ np.abs(B).astype(np.float64)
        sums = K * 2.0**-24 * scale
        allowed = sums * (1 + 2.0**-11) + 2.0**-11 * np.abs(want) + 2.0**-25 if fp16 else sums + 1e-30
        assert np.all(np.abs(got - want) <= allowed), (config, M, N, K, blocks)


@pytest.mark.gpu
def test_leaving_one_slice_running_changes_no_bit(rng):
    """The "_wait1" 128 x 256 kernel issues the same MMAs in the same order on the same registers as its twin that
    waits for every slice (only the waits move), so its C is the twin's bit for bit: ragged shapes, a block walking
    many tiles (the ring's phases running across tiles, 15 slices on 4 stages), and K of one slice. Each of the three
    tiles also on d = 768's MLP down (8192 x 3072 x 768), against the exact product as test_wgmma_gemm_on_gpu
    bounds it, the rule's tile among them."""
    from gpucourse import gpus

    if not gpus.supports("wgmma"):
        pytest.skip(gpus.missing("wgmma"))
    cp = runtime.cupy()
    twin, wait1 = "wgmma_128x256x64_s4_kn_persistent_f16_tmastore", tc.PERSISTENT_TILES[0]
    for M, N, K, blocks in ((1000, 1032, 2056, None), (2100, 2312, 960, 3), (700, 776, 960, 1), (300, 264, 64, None)):
        A = cp.asarray(rng.uniform(-1, 1, (M, K)).astype(np.float16))
        B = cp.asarray(rng.uniform(-1, 1, (K, N)).astype(np.float16))
        C0, C1 = cp.full((M, N), cp.nan, cp.float16), cp.full((M, N), cp.nan, cp.float16)
        tc.gemm_wgmma(A, B, C0, config=twin, blocks=blocks)
        tc.gemm_wgmma(A, B, C1, config=wait1, blocks=blocks)
        assert bool(cp.isfinite(C0).all()) and bool((C0.view(cp.uint16) == C1.view(cp.uint16)).all()), (M, N, K, blocks)
    M, N, K = 8192, 768, 3072
    A = rng.uniform(-1, 1, (M, K)).astype(np.float16)
    B = rng.uniform(-1, 1, (K, N)).astype(np.float16)
    want = tc.gemm_spec(A, B)
    allowed = K * 2.0**-24 * (np.abs(A).astype(np.float64) @ np.abs(B).astype(np.float64)) * (1 + 2.0**-11) \
        + 2.0**-11 * np.abs(want) + 2.0**-25
    assert tc.persistent_tile(M, N, runtime.get().device["sms"]) in tc.PERSISTENT_TILES
    for config in tc.PERSISTENT_TILES:
        C = cp.full((M, N), cp.nan, cp.float16)
        tc.gemm_wgmma(cp.asarray(A), cp.asarray(B), C, config=config)
        assert np.all(np.abs(C.get().astype(np.float64) - want) <= allowed), config


@pytest.mark.gpu
@pytest.mark.parametrize("config", CLUSTER_WGMMA)
def test_the_cluster_kernel_writes_the_bits_of_the_persistent_kernel(rng, config):
    """The kernel in clusters of two runs the same MMAs in the same order on each tile as the one-block persistent
    kernel with the TMA store, from the same operand bytes (B's halves multicast into each block): C bit for bit the
    same, at ragged edges (M, N, K not multiples of the tile), with an odd number of tile-rows (the last cluster
    tiles' second block below C: loaded, not stored), with M smaller than one tile, and with one or two clusters
    walking many cluster tiles (the ring's phases across tiles, 15 slices on 4 stages)."""
    from gpucourse import gpus

    if not gpus.supports("wgmma"):
        pytest.skip(gpus.missing("wgmma"))
    cp = runtime.cupy()
    twin = config.removesuffix("_c2")
    assert tc.wgmma_config(twin)["cluster"] == 1 and twin in tc.WGMMA_CONFIGS
    # tile-rows: 3, 1, 1, 8, 17, 6 and 5
    for M, N, K, blocks in ((300, 264, 200, None), (1, 8, 8, None), (100, 520, 64, None), (1000, 1032, 2056, None),
                            (2100, 2312, 960, 4), (700, 776, 960, 2), (128 * 5, 256 * 3, 960, None)):
        A = cp.asarray(rng.uniform(-1, 1, (M, K)).astype(np.float16))
        B = cp.asarray(rng.uniform(-1, 1, (K, N)).astype(np.float16))
        C0, C1 = cp.full((M, N), cp.nan, cp.float16), cp.full((M, N), cp.nan, cp.float16)
        tc.gemm_wgmma(A, B, C0, config=twin)
        tc.gemm_wgmma(A, B, C1, config=config, blocks=blocks)
        assert bool(cp.isfinite(C1).all()), (M, N, K, blocks)
        assert bool((C0.view(cp.uint16) == C1.view(cp.uint16)).all()), (M, N, K, blocks)
    with pytest.raises(runtime.CourseInputError, match="multiple of 2"):
        tc.gemm_wgmma(A, B, C1, config=config, blocks=3)


def test_transformer_table_plans_a_layers_gemms():
    """transformer_table's shapes and rows, without a GPU: the QKV projection, the MLP's up and down projections for
    each width; cuBLAS, PyTorch where it runs, and the FP16-output wgmma kernels on Hopper only."""
    import benchmarks.tensor_cores as lesson

    shapes = lesson.transformer_shapes(8192, (768, 4096))
    assert [(s["d"], s["name"], s["M"], s["K"], s["N"]) for s in shapes] == [
        (768, "QKV projection", 8192, 768, 2304), (768, "MLP up", 8192, 768, 3072), (768, "MLP down", 8192, 3072, 768),
        (4096, "QKV projection", 8192, 4096, 12288), (4096, "MLP up", 8192, 4096, 16384),
        (4096, "MLP down", 8192, 16384, 4096)]
    with pytest.raises(runtime.CourseInputError, match="multiple of 8"):
        lesson.transformer_shapes(8192, (100,))
    f16 = [c for c in tc.WGMMA_CONFIGS if tc.wgmma_config(c)["out"] == "float16" and tc.wgmma_config(c)["cluster"] == 1]
    assert f16 == ["wgmma_128x256x64_s4_kn_persistent_f16", "wgmma_128x256x64_s4_kn_persistent_f16_tmastore",
                   *tc.PERSISTENT_TILES]  # the sweep of the tiles is measured in the same run as cuBLAS
    plan = lesson.transformer_plan(True, cc="9.0")
    assert [r["kind"] for r in plan] == ["library", "library"] + ["kernel"] * len(f16)
    assert len({r["name"] for r in plan}) == len(plan)
    assert plan[0]["name"].startswith("cuBLAS") and plan[1]["name"].startswith("PyTorch")
    assert [r["config"] for r in plan[2:]] == f16
    assert [r["name"] for r in lesson.transformer_plan(False, cc="8.0")] == ["cuBLAS FP16 (cupy.matmul)"]
    with pytest.raises(runtime.CourseInputError, match="FP32 C"):
        lesson.transformer_plan(True, configs=[tc.DEFAULT_WGMMA], cc="9.0")
    table = {"tokens": 8192, "note": "no PyTorch rows: PyTorch with CUDA is not installed", "shapes": [
        {**shapes[0], "rows": [{"name": r["name"], "config": r.get("config"), "median_ms": 0.5, "tflops": 200.0,
                                "of_cublas": 1.0} for r in plan[:1] + plan[2:]]}]}
    text = lesson.format_transformer_table(table)
    assert "768, QKV (768 x 2304)" in text and "no PyTorch rows" in text
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100
    assert sum(line.startswith("768, QKV") for line in lines) == 1 and lines[-1].startswith("TMA")  # the legend last
    assert "rule" not in text and lesson.tile_reading(table) == []  # no rule in the table: no column, no statement


def _ruled_table(lesson, speeds):
    """A transformer table of d = 768's MLP down with the persistent tiles at ``speeds`` (x cuBLAS, largest tile
    first), and the rule's pick, as transformer_table makes it on 132 SMs."""
    shape = lesson.transformer_shapes(8192, (768,))[2]
    plan = lesson.transformer_plan(False, cc="9.0")
    rows = [{**r, "median_ms": 1.0, "tflops": 500.0, "of_cublas": 1.0} for r in plan]
    for r in rows:
        twin = f"{r['config']}_wait1"  # the same tile without a slice left running: as fast, unless told otherwise
        tile = r["config"] if r["config"] in tc.PERSISTENT_TILES else twin if twin in tc.PERSISTENT_TILES else None
        if tile is not None:
            r["of_cublas"] = speeds[tc.PERSISTENT_TILES.index(tile)]
            r["tflops"] = 500.0 * r["of_cublas"]
    return {"tokens": 8192, "ds": [768], "sms": 132, "tiles": list(tc.PERSISTENT_TILES),
            "shapes": [{**shape, "rule": tc.persistent_tile(shape["M"], shape["N"], 132), "rows": rows}]}


def test_the_tile_rule_is_checked_against_the_sweep():
    """Where transformer_table has the persistent tiles, its text shows the rule's tile and ratio, and tile_reading
    says whether the rule's tile came within TILE_RULE_SLACK of the fastest tile and whether it met the goal (0.95
    of cuBLAS): both hold when the rule's 128 x 192 is the fastest; both turn when 128 x 128 runs far ahead and 128 x
    192 below the goal."""
    import benchmarks.tensor_cores as lesson

    good = _ruled_table(lesson, (0.78, 1.01, 0.97))
    assert good["shapes"][0]["rule"] == tc.PERSISTENT_TILES[1]
    text = lesson.format_transformer_table(good)
    assert "rule: the tile" in text and "192: 1.01" in text and "w1 192" in text and "tiles of 128 x BN" in text
    assert max(map(len, text.splitlines())) <= 100
    assert [ok for _, ok in lesson.tile_reading(good)] == [True, True, True]
    assert lesson.transformer_reading(good)[-3:] == lesson.tile_reading(good)
    bad = _ruled_table(lesson, (0.78, 0.90, 1.00))
    assert [ok for _, ok in lesson.tile_reading(bad)] == [False, False, True]
    twin = next(r for r in good["shapes"][0]["rows"] if f"{r['config']}_wait1" in tc.PERSISTENT_TILES)
    twin["tflops"] *= 1.1  # the slice left running costs a tenth
    assert [ok for _, ok in lesson.tile_reading(good)] == [True, True, False]


@pytest.mark.gpu
def test_wgmma_refuses_what_the_tma_cannot_read(rng):
    from gpucourse import gpus

    if not gpus.supports("wgmma"):
        pytest.skip(gpus.missing("wgmma"))
    cp = runtime.cupy()
    A = cp.zeros((64, 100), cp.float16)
    B = cp.zeros((100, 64), cp.float16)
    with pytest.raises(runtime.CourseInputError, match="multiples of 8"):
        tc.gemm_wgmma(A, B, cp.zeros((64, 64), cp.float32))
    with pytest.raises(runtime.CourseInputError, match="float32"):
        tc.gemm_wgmma(cp.zeros((64, 64), cp.float16), cp.zeros((64, 64), cp.float16), cp.zeros((64, 64), cp.float16))
    with pytest.raises(runtime.CourseInputError, match="B transposed"):
        tc.gemm_wgmma(cp.zeros((64, 64), cp.float16), cp.zeros((64, 128), cp.float16), cp.zeros((64, 64), cp.float32),
                      config="wgmma_128x256x64_s4_nk")
    for config in ("wgmma_128x256x64_s4_kn_persistent_f16", "wgmma_128x256x64_s4_kn_persistent_f16_tmastore"):
        with pytest.raises(runtime.CourseInputError, match="C must be a float16 array"):
            tc.gemm_wgmma(cp.zeros((64, 64), cp.float16), cp.zeros((64, 64), cp.float16),
                          cp.zeros((64, 64), cp.float32), config=config)
    with pytest.raises(runtime.CourseInputError, match="blocks is for the persistent"):
        tc.gemm_wgmma(cp.zeros((64, 64), cp.float16), cp.zeros((64, 64), cp.float16), cp.zeros((64, 64), cp.float32),
                      blocks=4)


@pytest.mark.gpu
def test_wgmma_against_cublas_live():
    """A regression floor, measured now: the wgmma GEMM well above the tiled WMMA's 0.4x of cuBLAS FP16 at
    8192^3 (Hopper only). The goal (>= 0.8x) is judged on the record (test_recorded_wgmma_meets_the_goal)."""
    from gpucourse import bench, gpus

    if not gpus.supports("wgmma"):
        pytest.skip(gpus.missing("wgmma"))
    cp = runtime.cupy()
    n = 8192
    A = cp.random.random((n, n), dtype=cp.float32).astype(cp.float16)
    B = cp.random.random((n, n), dtype=cp.float32).astype(cp.float16)
    C = cp.empty((n, n), cp.float32)
    t = bench.interleaved({"ours": lambda: tc.gemm_wgmma(A, B, C), "cublas": lambda: cp.matmul(A, B)},
                          rounds=2, repeats=2, batch=4)
    ratio = t["cublas"].median_ms / t["ours"].median_ms
    assert ratio >= 0.6, f"wgmma GEMM at {ratio:.2f}x of cuBLAS FP16"


def test_recorded_wgmma_meets_the_goal(record):
    """Issue goal at 8192^3 on Hopper: the wgmma GEMM >= 0.8x cuBLAS FP16; the pipeline stages pay."""
    import benchmarks.tensor_cores as lesson

    if "wgmma" not in record or not lesson.wgmma_rows(record["wgmma"]):
        pytest.skip("the newest lesson-4 record has no wgmma rows (recorded before them, or not on Hopper)")
    t = record["wgmma"]
    rows = {r["config"]: r for r in t["rows"] if r["config"] and r.get("group_m") == tc.WGMMA_GROUP_M}
    assert all(r["check_error"] <= lesson.wgmma_check(r["config"]) for r in t["rows"] if r["kind"] == "kernel")
    assert rows[t["default"]]["of_cublas"] >= 0.8
    assert rows["wgmma_128x256x64_s2_kn"]["tflops"] > 1.3 * rows["wgmma_128x256x64_s1_kn"]["tflops"]
    wmma = next(r for r in t["rows"] if r["name"].startswith("WMMA, tiled"))
    assert rows[t["default"]]["tflops"] > 1.5 * wmma["tflops"]


def test_recorded_claims_of_the_lesson_hold_on_every_record():
    """What notebook 04 and its deep dive say in words about their tables holds in every record of lesson 4: FP16
    accumulation on the tensor cores follows the NumPy model; FP32 accumulation grows about linearly with K and ends
    more than ten times the model's error; the tiled WMMA kernel reaches less than half of cuBLAS FP16 on Hopper,
    in every tile configuration; a small GEMM runs slower than a large one; the naive numba kernel runs above its
    point's roof (the caches serve part of its traffic); and of the wgmma table, one stage already beats the WMMA
    kernel, each added stage up to three pays, three or four come within a tenth of cuBLAS, one consumer warpgroup and the 128 x
    128 tile are slower than the default, walking a whole row of tiles (group_m = 1) is slower than groups of rows,
    and B's layout hardly matters."""
    import benchmarks.tensor_cores as lesson

    recs = records.all_records(LESSON)
    if not recs:
        pytest.skip("no record of lesson 4")
    for rec in recs:
        f, where = rec["figures"], rec["path"]
        a = f["accumulation"]
        for e16, m16 in zip(a["gpu_fp16_acc"], a["model"]["fp16_acc"]):
            assert m16 / 1.5 <= e16 <= 1.5 * m16, where
        slope = np.polyfit(np.log(a["k"]), np.log(a["gpu_fp32_acc"]), 1)[0]
        assert 0.8 <= slope <= 1.2 and a["gpu_fp32_acc"][-1] > 10 * a["model"]["fp32_acc"][-1], where
        sizes = f["sizes"]["tflops"]["WMMA, tiled"]
        assert sizes[0] < sizes[-1], where
        naive = next(r for r in f["kernels"]["rows"] if r["name"] == "numba, naive")
        assert naive["tflops"] > naive["intensity"] * rec["ceilings"]["copy_gbps"] / 1000, where  # above its roof
        if rec["gpu"].get("compute_capability") != "9.0":
            continue
        tiled = next(r for r in f["kernels"]["rows"] if r["name"].startswith("WMMA, tiled ("))
        assert tiled["of_cublas"] < 0.5 and all(r["of_cublas"] < 0.5 for r in f["configs"]["rows"]), where
        rows = {(r["config"], r["group_m"]): r for r in lesson.wgmma_rows(f["wgmma"])}
        tf = lambda name, g=tc.WGMMA_GROUP_M: rows[(name, g)]["tflops"]  # noqa: E731
        wmma = next(r for r in f["wgmma"]["rows"] if r["name"].startswith("WMMA, tiled"))["tflops"]
        cublas = f["wgmma"]["cublas_fp16_tflops"]
        assert tf("wgmma_128x256x64_s1_kn") > wmma, where
        assert tf("wgmma_128x256x64_s1_kn") < tf("wgmma_128x256x64_s2_kn") < tf("wgmma_128x256x64_s3_kn"), where
        assert min(tf("wgmma_128x256x64_s3_kn"), tf("wgmma_128x256x64_s4_kn")) >= 0.9 * cublas, where
        default = tf(tc.DEFAULT_WGMMA)
        assert tf("wgmma_64x256x64_s4_kn") < default and tf("wgmma_128x128x64_s4_kn") < default, where
        assert tf(tc.DEFAULT_WGMMA, 1) < min(tf(tc.DEFAULT_WGMMA, 4), tf(tc.DEFAULT_WGMMA, 16), default), where
        assert abs(tf("wgmma_128x256x64_s4_nk") / default - 1) < 0.05, where


LEARNER_GPUS = ["7.5", "8.0", "8.6", "8.9", "9.0"]  # gpucourse.gpus.GPUS


@pytest.mark.parametrize("cc", LEARNER_GPUS)
def test_the_tiled_kernel_fits_every_learner_gpu(cc):
    """A T4 gives a block 64 KiB of shared memory, an RTX 30xx/40xx, A10 or L4 99 KiB: the default tiled WMMA kernel
    (105 KiB, the fastest on Hopper) does not launch there. gemm runs default_tiled instead, the lesson's tables
    measure only what fits and say in one line what does not, and GPUCOURSE_FAKE_CC makes an H100 refuse what the
    faked GPU would."""
    from gpucourse import gpus

    import benchmarks.tensor_cores as lesson

    limit = gpus.shared_memory_per_block(cc)
    for acc in ("float32", "float16"):
        name = tc.default_tiled(acc, cc)
        assert tc.tiled_fits(name, cc) is None and tc.tiled_config(name)["smem_bytes"] <= limit
        assert tc.tiled_config(name)["acc"] == acc
        if tc.tiled_config(tc.DEFAULT_TILED[acc])["smem_bytes"] <= limit:
            assert name == tc.DEFAULT_TILED[acc]
    too_big = [n for n in tc.TILED_CONFIGS if tc.tiled_config(n)["smem_bytes"] > limit]
    for n in too_big:
        why = tc.tiled_fits(n, cc)
        assert why.startswith(n) and f"compute capability {cc}" in why and f"{limit:,}" in why and "\n" not in why
    assert (tc.DEFAULT_TILED["float32"] in too_big) == (cc in ("7.5", "8.6", "8.9"))
    plan = lesson.wgmma_plan(cc)
    assert plan[1]["name"] == f"WMMA, tiled ({tc.default_tiled('float32', cc)})"
    assert (len(plan) > 2) == (cc == "9.0") and (lesson.wgmma_skipped(cc) is None) == (cc == "9.0")


def test_a_faked_gpu_gives_its_own_shared_memory(monkeypatch):
    from gpucourse import gpus

    monkeypatch.setenv(runtime.FAKE_CC_VARIABLE, "7.5")
    assert gpus.shared_memory_per_block() == 64 * 1024
    assert tc.default_tiled("float32") != tc.DEFAULT_TILED["float32"]
    monkeypatch.setenv(runtime.FAKE_CC_VARIABLE, "9.0")
    assert tc.default_tiled("float32") == tc.DEFAULT_TILED["float32"]
    assert gpus.shared_memory_per_block("12.0") == gpus.PORTABLE_SHARED_MEMORY


# ------------------------------------------- the statements the notebook prints, on every record

def _readings(rec):
    import benchmarks.tensor_cores as lesson

    f = rec["figures"]
    return {"accumulation": lesson.accumulation_reading(f["accumulation"]),
            "configs": lesson.config_reading(f["configs"], f["kernels"], rec["gpu"].get("compute_capability")),
            "sizes": lesson.size_reading(f["sizes"]), "roofline": lesson.roofline_reading(f["kernels"], rec["ceilings"])}


def test_recorded_statements_printed_by_the_notebook_hold():
    """Notebook 04 prints its comparisons of figures (sections 2, 5 and 6) from these readings, under the figures
    they read; on every record each statement holds. Their words come from the relation each tests, so a
    comparison reversed in the code fails here."""
    recs = records.all_records(LESSON)
    if not recs:
        pytest.skip("no record of lesson 4")
    for rec in recs:
        read = _readings(rec)
        if rec["gpu"].get("compute_capability") == "9.0":
            assert len(read["configs"]) == 2, rec["path"]  # the Hopper statement is there
        for figure, part in read.items():
            assert part and all(s and len(s) <= 93 for s, _ in part), (rec["path"], figure)
            failed = [s for s, ok in part if ok is not True]
            assert not failed, (rec["path"], figure, failed)


def test_reversed_figures_print_the_statements_as_not_holding():
    """The newest record with its figures turned round (FP16 accumulation far from the model, FP32 accumulation
    flat in K, one stage ahead of two, a WMMA configuration at cuBLAS's rate, small n ahead of large, the naive
    kernel under its roof): every statement prints NO."""
    import copy

    from gpucourse import claims

    rec = records.latest(LESSON)
    if rec is None:
        pytest.skip("no record of lesson 4")
    rec = copy.deepcopy(rec)
    rec["gpu"]["compute_capability"] = "9.0"
    f = rec["figures"]
    a = f["accumulation"]
    a["gpu_fp16_acc"] = [3 * m for m in a["model"]["fp16_acc"]]
    a["gpu_fp32_acc"] = [a["model"]["fp32_acc"][-1]] * len(a["k"])
    rows = {r["name"]: r for r in f["configs"]["rows"]}
    s1, s2 = rows["wmma_tiled_128x128x32_w64x64_s1_f32"], rows["wmma_tiled_128x128x32_w64x64_s2_f32"]
    s1["tflops"], s2["tflops"] = s2["tflops"], s1["tflops"] / 2
    s2["of_cublas"] = 1.0
    t = f["sizes"]["tflops"]["WMMA, tiled"]
    t[0], t[-1] = t[-1], t[0]
    naive = next(r for r in f["kernels"]["rows"] if r["name"] == "numba, naive")
    naive["tflops"] = naive["intensity"] * rec["ceilings"]["copy_gbps"] / 2000
    read = [x for part in _readings(rec).values() for x in part]
    assert len(read) == 7 and all(ok is False for _, ok in read), read
    assert all(line.startswith(" NO  ") for line in claims.lines(read).splitlines())
    assert len(_readings(dict(rec, gpu={"compute_capability": "8.0"}))["configs"]) == 1  # no Hopper line elsewhere


def test_a_programmatic_dependent_launch_passes_cuda_hs_structures():
    """launch_hopper's pdl goes through cuLaunchKernelEx, whose arguments ctypes lays out as cuda.h does on a 64-bit
    host: a CUlaunchAttribute is 72 bytes (the id padded to 8, then a 64-byte union), a CUlaunchConfig 56 (seven
    unsigned ints, then the stream at 32, the attributes at 40, their count at 48)."""
    import ctypes

    assert ctypes.sizeof(cuda_c.LaunchAttribute) == 72 and cuda_c.LaunchAttribute.value.offset == 8
    cfg = cuda_c.LaunchConfig
    assert ctypes.sizeof(cfg) == 56
    assert (cfg.shared_bytes.offset, cfg.stream.offset, cfg.attrs.offset, cfg.num_attrs.offset) == (24, 32, 40, 48)
    assert cuda_c.PROGRAMMATIC_STREAM_SERIALIZATION == 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION

"""Lesson 4, the FP8 GEMM's numerics in NumPy (kernels/tensor_cores_fp8.py): e4m3 with one scale per tensor, the spec
a GPU FP8 GEMM is checked against, BF16 rounding, and the error figures of docs/engineering/04_tensor_cores.md."""
from pathlib import Path

import numpy as np
import pytest

from gpucourse import runtime
from kernels import tensor_cores as tc
from kernels import tensor_cores_fp8 as F
from kernels.inference_engine.precision import E4M3_MAX, from_e4m3

pytestmark = pytest.mark.lesson04
ROOT = Path(__file__).resolve().parents[1]
U = F.U_E4M3


@pytest.fixture(scope="module")
def figures():
    return F.fp8_gemm_error_figures()


def _operands(rng, m, n, k, b_size=1.0):
    A, B = rng.standard_normal((m, k)), b_size * rng.standard_normal((n, k))  # B K-major: N x K
    (ca, sa), (cb, sb) = F.quantize_fp8(A), F.quantize_fp8(B)
    return A, B, ca, sa, cb, sb


def test_quantize_fp8_round_trip_within_half_an_ulp(rng):
    x = rng.standard_normal((50, 70)) * np.exp(2 * rng.standard_normal((50, 1)))
    codes, s = F.quantize_fp8(x)
    assert codes.dtype == np.uint8 and codes.shape == x.shape and s.dtype == np.float32
    np.testing.assert_allclose(s, np.abs(x).max() / E4M3_MAX, rtol=1e-6)
    assert np.abs(from_e4m3(codes)).max() == E4M3_MAX
    back, err = from_e4m3(codes) * s, np.abs(from_e4m3(codes) * s - x)
    normal = np.abs(x) / s >= 2.0**-6
    assert normal.mean() > 0.5
    assert (err[normal] <= U * np.abs(x[normal]) * (1 + 1e-6)).all()  # 3 mantissa bits: 2^-4 relative
    assert (err[~normal] <= s * F.E4M3_SUBNORMAL_STEP / 2 * (1 + 1e-6)).all()  # subnormals: half their step
    assert np.sign(back[back != 0]).tolist() == np.sign(x[back != 0]).tolist()
    same, s2 = F.quantize_fp8(x, scale=s)  # the given scale is the one used
    assert s2 == s and (same == codes).all()
    sat, _ = F.quantize_fp8(x, scale=s / 4)  # too small a scale: the largest values saturate to +-448
    assert np.abs(from_e4m3(sat)).max() == E4M3_MAX and (np.abs(from_e4m3(sat)) == E4M3_MAX).sum() > 1
    zc, zs = F.quantize_fp8(np.zeros((3, 4)))
    assert zs == 1 and (from_e4m3(zc) == 0).all()


def test_round_bf16_rounds_to_nearest_even_on_the_top_16_bits(rng):
    one = 1.0
    cases = {one + 2.0**-8: one,  # halfway between 1 and 1 + 2^-7: the even one, 1
             one + 3 * 2.0**-8: one + 2.0**-6,  # halfway between 1 + 2^-7 and 1 + 2^-6: the even one
             one + 2.0**-8 + 2.0**-20: one + 2.0**-7,  # above halfway: up
             -(one + 2.0**-8 + 2.0**-20): -(one + 2.0**-7), 0.0: 0.0,
             3.4e38: np.inf, -3.4e38: -np.inf}  # past bfloat16's largest, 3.39e38, by more than half an ulp
    got = F.round_bf16(np.array(list(cases)))
    assert got.dtype == np.float32
    assert got.tolist() == list(cases.values())
    assert np.isnan(F.round_bf16(np.nan))
    x = (rng.standard_normal(10000) * np.exp(5 * rng.standard_normal(10000))).astype(np.float32)
    r = F.round_bf16(x)
    assert (r.view(np.uint32) & 0xFFFF == 0).all()  # a bfloat16: the low 16 bits are zero
    ulp = np.spacing(np.abs(r)) * 2.0**16  # bfloat16's spacing: 7 stored bits instead of float32's 23
    assert (np.abs(r.astype(np.float64) - x) <= ulp / 2).all()


def test_the_spec_is_the_exact_product_of_the_quantised_operands(rng):
    m, n, k = 9, 13, 300
    A, B, ca, sa, cb, sb = _operands(rng, m, n, k)
    # e4m3 values are multiples of 2^-9: their products times 2^18 are integers, summed exactly in int64
    ia, ib = (np.rint(from_e4m3(c).astype(np.float64) * 2**9).astype(np.int64) for c in (ca, cb))
    exact = (ia @ ib.T).astype(np.float64) / 2.0**18
    assert (F.gemm_fp8_spec(ca, cb, 1.0, 1.0, out="float64") == exact).all()
    c64 = F.gemm_fp8_spec(ca, cb, sa, sb, out="float64")
    np.testing.assert_allclose(c64, (from_e4m3(ca) * np.float64(sa)) @ (from_e4m3(cb) * np.float64(sb)).T,
                               rtol=1e-13)
    assert (F.gemm_fp8_spec(ca, cb, sa, sb) == c64.astype(np.float16)).all()  # FP16 by default, rounded once
    assert (F.gemm_fp8_spec(ca, cb, sa, sb, out="float32") == c64.astype(np.float32)).all()
    assert (F.gemm_fp8_spec(ca, cb, sa, sb, out="bfloat16") == F.round_bf16(c64)).all()
    # an FP32 accumulator (as the GPU kernel keeps) differs by its rounding alone: tolerance's k u of the sum of
    # the |products|, plus the scaling's rounding in float32
    c32 = F.gemm_fp8_fp32_acc(ca, cb, sa, sb)
    absprod = np.abs(from_e4m3(ca).astype(np.float64)) @ np.abs(from_e4m3(cb).astype(np.float64)).T * sa * sb
    assert (np.abs(c32 - c64) <= (tc.tolerance("fp16_inputs_fp32_acc", k) + 2 * 2.0**-24) * absprod).all()


def _derived_bound(A, B, sa, sb):
    """|q(a) q(b) - a b| summed over K, from |q(x) - x| <= u |x| + h (u = 2^-4 for normals, h half the subnormal step
    times the scale): (2u + u^2) |A||B| + (1 + u)(h_a |B| + h_b |A|) + K h_a h_b, elementwise."""
    ha, hb = sa * F.E4M3_SUBNORMAL_STEP / 2, sb * F.E4M3_SUBNORMAL_STEP / 2
    aa, bb = np.abs(A), np.abs(B)
    k = A.shape[1]
    return ((2 * U + U * U) * aa @ bb.T + (1 + U) * (ha * bb.sum(1)[None, :] + hb * aa.sum(1)[:, None])
            + k * ha * hb)


def _passes(c, A, B, sa, sb) -> bool:
    """The checks an FP8 GEMM's result must pass against float64: within the derived bound everywhere, and an rms
    error of the size e4m3's rounding makes on N(0, 1) inputs (measured 0.037: sqrt 2 times the 2.6% rms relative
    error of one rounding to 3 mantissa bits)."""
    ref = A @ B.T
    within = bool((np.abs(c - ref) <= _derived_bound(A, B, sa, sb) * (1 + 1e-9)).all())
    rms = float(np.sqrt(np.mean((c - ref) ** 2) / np.mean(ref**2)))
    return within and 0.02 < rms < 0.06


def test_fp8_error_within_the_derived_bound_and_wrong_variants_fail_it(rng):
    A, B, ca, sa, cb, sb = _operands(rng, 32, 48, 1024, b_size=10.0)  # B's scale 10 times A's
    assert _passes(F.gemm_fp8_spec(ca, cb, sa, sb, out="float64"), A, B, sa, sb)
    assert _passes(F.gemm_fp8_fp32_acc(ca, cb, sa, sb).astype(np.float64), A, B, sa, sb)
    wrong = {"scales applied twice": F.gemm_fp8_spec(ca, cb, sa, sb, out="float64") * float(sa) * float(sb),
             "one scale for both": F.gemm_fp8_spec(ca, cb, sa, sa, out="float64"),
             "no quantisation": A @ B.T + 0.0,
             "FP16 operands instead": tc.gemm_emulated(A, B.T).astype(np.float64),
             "codes unscaled": F.gemm_fp8_spec(ca, cb, 1.0, 1.0, out="float64"),
             "B read as K x N": F.gemm_fp8_spec(ca, cb.reshape(cb.shape[1], -1).T.copy(), sa, sb, out="float64")}
    for name, c in wrong.items():
        assert not _passes(c, A, B, sa, sb), name


def test_outputs_add_half_an_ulp_of_fp16_or_bf16(rng):
    A, B, ca, sa, cb, sb = _operands(rng, 16, 16, 512)
    c32 = F.gemm_fp8_fp32_acc(ca, cb, sa, sb).astype(np.float64)
    assert (np.abs(c32.astype(np.float16) - c32) <= np.abs(c32) * 2.0**-11 + 2.0**-25).all()
    assert (np.abs(F.round_bf16(c32) - c32) <= np.abs(c32) * 2.0**-8).all()


def test_fp8_is_about_a_hundred_times_fp16s_error_and_outliers_cost_it(figures):
    for (inputs, k), row in figures.items():
        for name in ("fp8", "fp8 -> fp16", "fp8 -> bf16"):
            assert row[name][1] > 50 * row["fp16"][1], (inputs, k, name)
        assert row["fp16"][1] < 2 * 2.0**-11  # FP16's two operand roundings: 2^-11 relative each, at most
        # the output's rounding is lost under FP8's operands' error: within 5% either way
        assert 0.95 < row["fp8 -> bf16"][1] / row["fp8"][1] < 1.05
    for k in (256, 1024, 4096):
        g, o12, o15 = (figures[(i, k)] for i in ("gaussian", "outliers x 2^12", "outliers x 2^15"))
        assert 0.025 < g["fp8"][1] < 0.05  # ~0.037 at every K: the errors of the K products add as sqrt(K), as the sum
        # outliers 2^12 times larger move the other values' scale, but they stay within e4m3's normals (a range of
        # 2^14.8): at most 1.3 times the Gaussian error; 2^15 times larger push them into the subnormals: 4 times
        assert 1.0 < o12["fp8"][1] / g["fp8"][1] < 1.3
        assert o15["fp8"][1] / g["fp8"][1] > 4
        assert 0.9 < o15["fp16"][1] / g["fp16"][1] < 1.1  # FP16 has no shared scale: the other outputs keep theirs


def test_the_engineering_note_carries_the_fp8_table(figures):
    note = (ROOT / "docs" / "engineering" / "04_tensor_cores.md").read_text()
    assert F.format_fp8_gemm_error(figures) in note


def test_fp8_refuses_bad_input(rng):
    ca, _ = F.quantize_fp8(rng.standard_normal((4, 8)))
    cb, _ = F.quantize_fp8(rng.standard_normal((8, 5)))
    with pytest.raises(runtime.CourseInputError, match="N x K"):
        F.gemm_fp8_spec(ca, cb, 1.0, 1.0)  # B given K x N
    with pytest.raises(runtime.CourseInputError, match="uint8"):
        F.gemm_fp8_spec(from_e4m3(ca), ca, 1.0, 1.0)
    with pytest.raises(runtime.CourseInputError, match="out"):
        F.gemm_fp8_spec(ca, ca, 1.0, 1.0, out="int8")
    with pytest.raises(runtime.CourseInputError, match="scale"):
        F.quantize_fp8(np.ones(3), scale=0)
    with pytest.raises(runtime.CourseInputError, match="dist"):
        F.fp8_gemm_error(8, 8, 8, dist="uniform")
    with pytest.raises(runtime.CourseInputError, match="m must"):
        F.fp8_gemm_error(2, 8, 8, dist="outliers")

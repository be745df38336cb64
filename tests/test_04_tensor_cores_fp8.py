"""Lesson 4, the FP8 GEMM's numerics in NumPy (kernels/tensor_cores_fp8.py): e4m3 with one scale per tensor, the spec
a GPU FP8 GEMM is checked against, BF16 rounding, and the error figures of docs/engineering/04_tensor_cores.md."""
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_compiler

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


# ------------------------------------------------------------------ the GPU kernel: kernels/cuda/tensor_cores_fp8.cu

def test_fp8_configs_parse_and_fit_in_a_hopper_block():
    for name in F.FP8_CONFIGS:
        c = F.fp8_config(name)
        assert c["bk"] == 128 and c["threads"] == 128 * (c["bm"] // 64 + 1)
        assert c["smem_bytes"] <= 227 * 1024, name  # an H100's or H200's block, opted in
        assert c["accumulate"] == ("promoted" if "promoted" in name else "fast")
        assert c["accumulate"] == "fast" or c["bn"] <= 128, name  # two sets of accumulators fit 128 columns
        assert c["persistent"] is ("_persistent_tmastore" in name), name
        assert c["epilogue"] == ("tma" if c["persistent"] else "registers"), name
        assert c["cluster"] == (2 if name.endswith("_c2") else 1), name
        assert c["stream_k"] is name.endswith("_sk"), name
    # the persistent ones: 4 stages of 128 + 256 rows of 128 codes (or 6 of 128 + 128), 192 KiB either way, and two
    # 64 x 64 pieces of 2-byte C a consumer warpgroup: 230,464 and 230,496 bytes of the 232,448 a block may have
    for name in ("fp8_gemm_128x256x128_s4_fast_persistent_tmastore", "fp8_gemm_128x128x128_s6_promoted_persistent_tmastore"):
        c = F.fp8_config(name)
        assert c["smem_bytes"] == 1024 + 196608 + 2 * 2 * 8192 + 2 * c["stages"] * 8 <= 232448, name
    assert not F.fp8_config("fp8_gemm_128x256x128_s4_fast")["persistent"]
    # in clusters of two: the persistent 128 x 256 kernel's tile, stages and shared memory
    c2 = F.fp8_config("fp8_gemm_128x256x128_s4_fast_persistent_tmastore_c2")
    twin = F.fp8_config("fp8_gemm_128x256x128_s4_fast_persistent_tmastore")
    assert {k: v for k, v in c2.items() if k not in ("name", "cluster")} == \
        {k: v for k, v in twin.items() if k not in ("name", "cluster")}
    sk = F.fp8_config("fp8_gemm_128x256x128_s4_fast_persistent_tmastore_sk")  # the same kernel, a stream-K tail
    assert {k: v for k, v in sk.items() if k not in ("name", "stream_k")} == \
        {k: v for k, v in twin.items() if k not in ("name", "stream_k")}
    assert tc.wgmma_blocks(c2, 8192, 8192, sms=132) == 132 and tc.wgmma_blocks(c2, 300, 264, sms=132) == 8
    assert tc.wgmma_blocks(c2, 1, 8, sms=132) == 2 and tc.wgmma_blocks(twin, 1, 8, sms=132) == 1
    for bad in ("fp8_gemm_128x256x128_s9_fast", "fp8_gemm_128x256x128_s4_promoted_persistent_tmastore",
                "fp8_gemm_128x256x128_s4_fast_persistent", "fp8_gemm_128x128x128_s6_fast_persistent_tmastore_f16",
                "fp8_gemm_128x256x128_s4_fast_c2", "fp8_gemm_128x128x128_s6_promoted_persistent_tmastore_c2",
                "fp8_gemm_128x256x128_s4_fast_persistent_tmastore_c4", "fp8_gemm_128x256x128_s4_fast_sk",
                "fp8_gemm_128x256x128_s4_fast_persistent_tmastore_c2_sk"):
        with pytest.raises(runtime.CourseInputError, match="no FP8 GEMM kernel"):
            F.fp8_config(bad)


def test_the_stream_k_tail_is_the_last_partial_wave_where_it_pays():
    # 8192^3 in 128 x 256 tiles on 132 SMs: 2,048 tiles, 15 whole waves and 68 tiles left, whose wave would leave 64
    # SMs idle for a tile of 64 slices: shared by all 132 blocks
    assert F.stream_k_tiles(64 * 32, 132, 64) == 68
    assert F.stream_k_tiles(32 * 16, 132, 32) == 0  # 4096^3: 116 of 132 busy in the last wave, short tiles
    assert F.stream_k_tiles(32 * 16, 132, 32, force=True) == 116
    assert F.stream_k_tiles(264, 132, 64, force=True) == 0 and F.stream_k_tiles(0, 132, 64) == 0  # whole waves
    assert F.stream_k_tiles(6, 132, 64) == 6  # fewer tiles than blocks and long tiles: every tile is shared out
    assert F.stream_k_tiles(6, 132, 8) == 0
    for bad in ((-1, 4, 8), (8, 0, 8), (2.5, 4, 8), (True, 4, 8), (8, 4, 0)):
        with pytest.raises(runtime.CourseInputError, match="must be a whole number"):
            F.stream_k_tiles(*bad)


def test_fp8_gemm_needs_a_gpu_or_says_so():
    if runtime.is_gpu():
        pytest.skip("a GPU runs it (test_fp8_gemm_on_gpu)")
    with pytest.raises(runtime.CourseError, match="the FP8 GEMM"):
        F.gemm_fp8(None, None, None, None, None)


def test_bf16_bits_read_back_as_floats():
    x = np.array([1.0, -2.5, 3.0e38, 2.0**-130], np.float32)
    bits = (F.round_bf16(x).view(np.uint32) >> 16).astype(np.uint16)
    assert F.bf16_bits_to_float(bits).tolist() == F.round_bf16(x).tolist()


@needs_compiler
def test_fp8_source_compiles_to_e4m3_wgmma_and_tma_for_sm90a_only():
    from gpucourse import cuda_c

    ptx = cuda_c.compile_ptx(F.FP8_SOURCE, arch="sm_90a")
    for config in F.FP8_CONFIGS:
        c = F.fp8_config(config)
        for suffix in F.FP8_OUTPUTS.values():
            name = f"{config}_{suffix}"
            body = cuda_c.ptx_entry(ptx, name)
            mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3", body)
            assert mmas == [str(c["bn"])] * 4, name  # K = 128 codes a stage, 32 an instruction
            assert "cp.async.bulk.tensor.2d" in body and "mbarrier.try_wait.parity" in body, name
            assert "%globaltimer" in body and "brkpt;" in body, name  # every wait ends: a time-out fails the launch
            assert "setmaxnreg" in body, name
            assert ("cvt.rn.bf16x2.f32" in body) is (suffix == "bf16"), name
            assert ("cvt.rn.f16x2.f32" in body) is (suffix == "f16"), name
            # persistent: the tile loop steps by the grid's size (in clusters: by its clusters); plain: one tile,
            # from blockIdx.x alone
            assert ("%nctaid.x" in body or "%nclusterid.x" in body) is c["persistent"], name
            assert (".reqnctapercluster" in body) is (c["cluster"] > 1), name
            stores = set(re.findall(r"st\.global[.\w]*", body))
            tma_store = "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" in body
            # stream-K: a piece's FP32 sums leave through L2 (st.global.cg), its mark is a release at the GPU's scope,
            # the owner's wait an acquire; nothing of the kind in the other kernels
            assert ("st.release.gpu.global.s32" in body and "ld.acquire.gpu.global.s32" in body
                    and "ld.global.cg.v4.f32" in body) is c["stream_k"], name
            if c["stream_k"]:
                assert stores == {"st.global.cg.v4.f32"}, (name, stores)
                stores = set()
            if c["epilogue"] == "tma":  # pieces of C by stmatrix into shared memory, stored by the TMA; no thread stores
                assert tma_store and "stmatrix.sync.aligned.m8n8.x4.shared.b16" in body and not stores, name
                assert "fence.proxy.async.shared::cta" in body and "cp.async.bulk.wait_group.read" in body, name
            else:
                assert not tma_store and stores, name
    plain = cuda_c.compile_ptx(F.FP8_SOURCE, arch="sm_90")  # without the a: stubs that trap
    assert "wgmma.mma_async" not in plain and "cp.async.bulk" not in plain and "trap" in plain


@needs_compiler
def test_the_fp8_cluster_kernel_multicasts_b_and_spans_its_barriers_across_the_cluster():
    """In clusters of two each block loads half of B's slice (one box of BN / 2 rows) multicast to both; the
    cluster's barriers and compile-time size as test_04_tensor_cores checks them for the FP16 kernel."""
    from gpucourse import cuda_c
    from test_04_tensor_cores import _cluster_ptx_checks

    ptx = cuda_c.compile_ptx(F.FP8_SOURCE, arch="sm_90a")
    assert [c for c in F.FP8_CONFIGS if F.fp8_config(c)["cluster"] > 1] == [
        "fp8_gemm_128x256x128_s4_fast_persistent_tmastore_c2"]
    for config in F.FP8_CONFIGS:
        for suffix in F.FP8_OUTPUTS.values():
            name = f"{config}_{suffix}"
            body = cuda_c.ptx_entry(ptx, name)
            if F.fp8_config(config)["cluster"] > 1:
                _cluster_ptx_checks(body, name, 1)
                assert body.count("cp.async.bulk.tensor.2d.shared::cluster.global.tile") == 2, name  # A, B's half
            else:
                assert not any(w in body for w in ("multicast", "barrier.cluster", "mapa", "cluster_ctarank",
                                                   ".reqnctapercluster", "acquire.cluster")), name


@needs_compiler
def test_fp8_kernels_keep_their_accumulators_in_registers():
    """ptxas's own account (no GPU needed): no spills, and no wgmma serialised for want of registers (C7512), in
    either accumulation; the promoted one holds two sets of accumulators."""
    from gpucourse import cuda_c

    log = cuda_c.ptxas_log(F.FP8_SOURCE, "sm_90a").replace("\x00", "")
    for config in F.FP8_CONFIGS:
        for suffix in F.FP8_OUTPUTS.values():
            name = f"{config}_{suffix}"
            part = log.split(f"Compiling entry function '{name}'")[1].split("Compiling entry function")[0]
            assert "0 bytes spill stores, 0 bytes spill loads" in part, (name, part)
    assert "C7512" not in log and "serialized" not in log, log


def _gpu_operands(rng, M, N, K, *, outlier=False):
    A, B = rng.standard_normal((M, K)), rng.standard_normal((N, K))
    if outlier:
        A[0] *= 100.0
    (ca, sa), (cb, sb) = F.quantize_fp8(A), F.quantize_fp8(B)
    return ca, sa, cb, sb


def _on_hopper():
    from gpucourse import gpus

    if not gpus.supports("wgmma"):
        with pytest.raises(runtime.CourseError, match="needs wgmma"):
            gpus.step("04.wgmma_fp8")
        pytest.skip(gpus.missing("wgmma"))
    return runtime.cupy()


# Error of the kernel's result against the exact product of the quantised operands, as max |C - spec| / max |spec|:
# the output's rounding (half an ulp: 2^-11 of FP16, 2^-8 of BF16, relative) and the sums' (FP8 wgmma's own
# accumulator keeps fewer bits than FP32). Measured on an H200 in turns with cuBLAS's FP8 GEMM, which
# test_fp8_gemm_matches_cublas compares against.
FP8_KERNEL_REL = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
# "fast" accumulation keeps the FP8 wgmma's own sums over the whole K, with fewer bits than FP32 (DeepSeek-V3's report:
# up to 2% relative error at K = 4096 on its data): a bound that catches a wrong layout or scale (errors of order 1),
# not the rounding; test_fp8_accumulation_fast_against_promoted states how far each gets.
FP8_FAST_REL = 2e-2


def _gpu_shapes(c: dict) -> list:
    """(M, N, K, blocks) a GPU test runs configuration ``c`` on: whole tiles, ragged ones at every edge (zero-filled
    reads, guarded or clipped stores; N a multiple of 8 where the TMA stores C), and, persistent, more tiles than SMs
    and a few blocks walking many tiles each, the ring's phases running across tiles whose 11 slices do not fill its
    4 or 6 stages evenly (blocks None: the launcher's choice)."""
    shapes = [(c["bm"], c["bn"], 128, None), (2 * c["bm"], 3 * c["bn"], 5 * 128, None)]
    shapes += [(300, 264, 208, None), (1, 8, 16, None), (1000, 1032 if c["epilogue"] == "tma" else 1030, 2064, None)]
    if c["persistent"]:  # a few blocks: 3 and 1, or in clusters of two, 2 clusters and 1
        few = (3, 1) if c["cluster"] == 1 else (4, 2)
        shapes += [(2100, 2312, 256, None), (2100, 2312, 1408, few[0]), (700, 776, 1408, few[1])]
    return shapes


def _run_fp8(cp, ca, cb, sa, sb, out, config, blocks=None, **kw):
    """The GPU kernel's C (FP16 or BF16 bits, uint16, NaN until written) for these codes and scales."""
    M, N = ca.shape[0], cb.shape[0]
    C = cp.full((M, N), 0x7E00 if out == "float16" else 0x7FC0, cp.uint16)
    F.gemm_fp8(cp.asarray(ca), cp.asarray(cb), cp.asarray([sa]), cp.asarray([sb]),
               C.view(cp.float16) if out == "float16" else C, config=config, blocks=blocks, **kw)
    return C.get()


def _as_float(bits, out):
    return bits.view(np.float16).astype(np.float64) if out == "float16" else F.bf16_bits_to_float(bits).astype(np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("out", list(F.FP8_OUTPUTS))
@pytest.mark.parametrize("config", F.FP8_CONFIGS)
def test_fp8_gemm_on_gpu(rng, config, out):
    cp = _on_hopper()
    c = F.fp8_config(config)
    for M, N, K, blocks in _gpu_shapes(c):
        ca, sa, cb, sb = _gpu_operands(rng, M, N, K)
        got = _as_float(_run_fp8(cp, ca, cb, sa, sb, out, config, blocks), out)
        want = F.gemm_fp8_spec(ca, cb, sa, sb, out="float64")
        assert np.isfinite(got).all(), (config, out, M, N, K, blocks)
        err = np.abs(got - want).max() / np.abs(want).max()
        bound = FP8_KERNEL_REL[out] if c["accumulate"] == "promoted" else max(FP8_KERNEL_REL[out], FP8_FAST_REL)
        assert err <= bound, (config, out, M, N, K, blocks, err)
    # the scales are read from the GPU, not ignored: twice scale_a, twice the result
    ca, sa, cb, sb = _gpu_operands(rng, 128, 256, 256)
    A, B = cp.asarray(ca), cp.asarray(cb)
    C1, C2 = cp.empty((128, 256), cp.float16), cp.empty((128, 256), cp.float16)
    if out == "float16":
        F.gemm_fp8(A, B, cp.asarray([sa]), cp.asarray([sb]), C1, config=config)
        F.gemm_fp8(A, B, cp.asarray([2 * sa]), cp.asarray([sb]), C2, config=config)
        assert cp.array_equal(2 * C1.astype(cp.float32), C2.astype(cp.float32))


PERSISTENT_FP8 = [c for c in F.FP8_CONFIGS if F.fp8_config(c)["persistent"]]
CLUSTER_FP8 = [c for c in PERSISTENT_FP8 if F.fp8_config(c)["cluster"] > 1]
STREAM_K_FP8 = [c for c in PERSISTENT_FP8 if F.fp8_config(c)["stream_k"]]


@pytest.mark.gpu
@pytest.mark.parametrize("out", list(F.FP8_OUTPUTS))
@pytest.mark.parametrize("config", [c for c in PERSISTENT_FP8 if c not in CLUSTER_FP8 + STREAM_K_FP8])
def test_fp8_persistent_writes_the_bits_of_its_one_tile_twin(rng, config, out):
    """The persistent kernel with its TMA store runs the same wgmmas on each tile, in the same order, and scales and
    rounds the same FP32 sums: its C is the one-tile-per-block kernel's of the same tile and accumulation, bit for bit,
    at every edge and however many tiles a block walks."""
    cp = _on_hopper()
    twin = config.removesuffix("_persistent_tmastore")
    assert twin in F.FP8_CONFIGS and not F.fp8_config(twin)["persistent"]
    for M, N, K, blocks in _gpu_shapes(F.fp8_config(config)):
        ca, sa, cb, sb = _gpu_operands(rng, M, N, K, outlier=True)
        ours = _run_fp8(cp, ca, cb, sa, sb, out, config, blocks)
        theirs = _run_fp8(cp, ca, cb, sa, sb, out, twin)
        assert (ours == theirs).all(), (config, out, M, N, K, blocks, int((ours != theirs).sum()))


@pytest.mark.gpu
@pytest.mark.parametrize("out", list(F.FP8_OUTPUTS))
@pytest.mark.parametrize("config", CLUSTER_FP8)
def test_fp8_cluster_writes_the_bits_of_the_persistent_kernel(rng, config, out):
    """In clusters of two, the same wgmmas in the same order on each tile as the one-block persistent kernel, from the
    same operand bytes (each block's half of B multicast into both): C bit for bit the same, at ragged edges, with an
    odd number of tile-rows (the last cluster tiles' second block below C: loaded, not stored), M smaller than one
    tile, and one or two clusters walking many cluster tiles; and against the exact product."""
    cp = _on_hopper()
    twin = config.removesuffix("_c2")
    assert twin in PERSISTENT_FP8 and F.fp8_config(twin)["cluster"] == 1
    # tile-rows: 1, 3, 1, 1, 8, 17, 17, 6 and 5
    shapes = _gpu_shapes(F.fp8_config(config)) + [(100, 520, 128, None), (640, 776, 1408, None)]
    for M, N, K, blocks in shapes:
        ca, sa, cb, sb = _gpu_operands(rng, M, N, K, outlier=True)
        ours = _run_fp8(cp, ca, cb, sa, sb, out, config, blocks)
        theirs = _run_fp8(cp, ca, cb, sa, sb, out, twin)
        assert np.isfinite(_as_float(ours, out)).all(), (config, out, M, N, K, blocks)
        assert (ours == theirs).all(), (config, out, M, N, K, blocks, int((ours != theirs).sum()))
        want = F.gemm_fp8_spec(ca, cb, sa, sb, out="float64")
        err = np.abs(_as_float(ours, out) - want).max() / np.abs(want).max()
        assert err <= max(FP8_KERNEL_REL[out], FP8_FAST_REL), (config, out, M, N, K, blocks, err)


# (M, N, K, blocks): tails that start and end inside tiles, one tile shared by many blocks (some with no slice at
# all), more blocks than tiles, and whole waves (no tail: every tile whole, to one block)
STREAM_K_SHAPES = [(2100, 2312, 1408, 3), (2100, 2312, 1408, 7), (300, 264, 2064, 7), (128, 256, 1408, 40),
                   (1000, 1032, 2064, None), (640, 776, 1408, 5), (512, 1024, 640, 16), (2100, 2312, 256, None)]


@pytest.mark.gpu
@pytest.mark.parametrize("out", list(F.FP8_OUTPUTS))
@pytest.mark.parametrize("config", STREAM_K_FP8)
def test_fp8_stream_k_tail_sums_every_slice_once(rng, config, out):
    """With a stream-K tail, each tile of the last wave is summed in pieces by several blocks and its owner adds them:
    C within the bound of fast accumulation of the exact product at every shape (a slice summed twice or lost would
    be off by order 1 / kblocks), the same bits from one launch to the next (the pieces are added in a fixed order),
    and, where the tiles fill whole waves (no tail), the persistent kernel's bits."""
    cp = _on_hopper()
    twin = config.removesuffix("_sk")
    c = F.fp8_config(config)
    sms = runtime.get().device["sms"]
    tails = 0
    for M, N, K, blocks in STREAM_K_SHAPES:
        tiles = -(-M // c["bm"]) * -(-N // c["bn"])
        tail = F.stream_k_tiles(tiles, blocks or sms, -(-K // c["bk"]), force=True)
        tails += tail > 0
        ca, sa, cb, sb = _gpu_operands(rng, M, N, K, outlier=True)
        ours = _run_fp8(cp, ca, cb, sa, sb, out, config, blocks, stream_k=True)
        again = _run_fp8(cp, ca, cb, sa, sb, out, config, blocks, stream_k=True)
        assert np.isfinite(_as_float(ours, out)).all(), (config, out, M, N, K, blocks)
        assert (ours == again).all(), (config, out, M, N, K, blocks)
        want = F.gemm_fp8_spec(ca, cb, sa, sb, out="float64")
        err = np.abs(_as_float(ours, out) - want).max() / np.abs(want).max()
        assert err <= max(FP8_KERNEL_REL[out], FP8_FAST_REL), (config, out, M, N, K, blocks, err)
        theirs = _run_fp8(cp, ca, cb, sa, sb, out, twin, blocks)
        if tail == 0:
            assert (ours == theirs).all(), (config, out, M, N, K, blocks, int((ours != theirs).sum()))
        whole = _run_fp8(cp, ca, cb, sa, sb, out, config, blocks, stream_k=False)  # no tail: every tile whole
        assert (whole == theirs).all(), (config, out, M, N, K, blocks, int((whole != theirs).sum()))
    assert tails >= 5  # most shapes do have a tail
    with pytest.raises(runtime.CourseInputError, match="stream_k is for"):
        _run_fp8(cp, ca, cb, sa, sb, out, twin, stream_k=True)


@pytest.mark.gpu
def test_fp8_accumulation_fast_against_promoted(rng):
    """Over a long K the fast accumulation (every wgmma into the same registers) drifts from the exact product
    further than the promoted one (each stage's sum added in FP32): both stated, the promoted one within FP32's
    bound of a K = 128 sum a stage."""
    cp = _on_hopper()
    M, N, K = 256, 256, 16384
    ca, sa, cb, sb = _gpu_operands(rng, M, N, K)
    want = F.gemm_fp8_spec(ca, cb, sa, sb, out="float64")
    errs = {}
    for config in ("fp8_gemm_128x128x128_s6_fast", "fp8_gemm_128x128x128_s6_promoted"):
        C = cp.empty((M, N), cp.float16)
        F.gemm_fp8(cp.asarray(ca), cp.asarray(cb), cp.asarray([sa]), cp.asarray([sb]), C, config=config)
        errs[config] = np.abs(C.get().astype(np.float64) - want).max() / np.abs(want).max()
    print(f"FP8 GEMM, K = {K}, max |C - exact| / max |exact|: {errs}")
    assert errs["fp8_gemm_128x128x128_s6_promoted"] <= FP8_KERNEL_REL["float16"], errs
    assert errs["fp8_gemm_128x128x128_s6_promoted"] <= errs["fp8_gemm_128x128x128_s6_fast"] * 1.01, errs


@pytest.mark.gpu
@pytest.mark.parametrize("config", F.FP8_CONFIGS)
def test_fp8_gemm_matches_cublas(rng, config):
    """The same codes and scales through cuBLAS's FP8 GEMM (torch._scaled_mm, where PyTorch is installed) with the same
    accumulation (use_fast_accum for "fast"): promoted, agreement within the FP16 output's rounding and the sums';
    fast, within the bound of fast accumulation's sums (each side keeps fewer bits than FP32, not necessarily the
    same ones)."""
    cp = _on_hopper()
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("PyTorch without CUDA or FP8")
    fast = F.fp8_config(config)["accumulate"] == "fast"
    M, N, K = 512, 768, 1024
    ca, sa, cb, sb = _gpu_operands(rng, M, N, K)
    A, B = cp.asarray(ca), cp.asarray(cb)
    C = cp.empty((M, N), cp.float16)
    F.gemm_fp8(A, B, cp.asarray([sa]), cp.asarray([sb]), C, config=config)
    ta = torch.from_dlpack(A).view(torch.float8_e4m3fn)
    tb = torch.from_dlpack(B).view(torch.float8_e4m3fn)
    theirs = torch._scaled_mm(ta, tb.t(), scale_a=torch.tensor(sa, device="cuda"),
                              scale_b=torch.tensor(sb, device="cuda"), out_dtype=torch.float16, use_fast_accum=fast)
    want = F.gemm_fp8_spec(ca, cb, sa, sb, out="float64")
    ours, cublas = C.get().astype(np.float64), theirs.float().cpu().numpy().astype(np.float64)
    scale = np.abs(want).max()
    bound = FP8_FAST_REL if fast else FP8_KERNEL_REL["float16"]
    assert np.abs(ours - cublas).max() / scale <= 2 * bound, config
    assert np.abs(cublas - want).max() / scale <= bound, config  # the reference itself holds


@pytest.mark.gpu
def test_fp8_gemm_refuses_what_it_cannot_run(rng):
    cp = _on_hopper()
    s = cp.ones(1, cp.float32)
    with pytest.raises(runtime.CourseInputError, match="multiple of 16"):
        F.gemm_fp8(cp.zeros((64, 40), cp.uint8), cp.zeros((64, 40), cp.uint8), s, s, cp.zeros((64, 64), cp.float16))
    with pytest.raises(runtime.CourseInputError, match="transposed"):
        F.gemm_fp8(cp.zeros((64, 64), cp.uint8), cp.zeros((64, 128), cp.uint8), s, s, cp.zeros((64, 64), cp.float16))
    with pytest.raises(runtime.CourseInputError, match="float16 .* or uint16"):
        F.gemm_fp8(cp.zeros((64, 64), cp.uint8), cp.zeros((64, 64), cp.uint8), s, s, cp.zeros((64, 64), cp.float32))
    with pytest.raises(runtime.CourseInputError, match="one scale"):
        F.gemm_fp8(cp.zeros((64, 64), cp.uint8), cp.zeros((64, 64), cp.uint8), cp.ones(2, cp.float32), s,
                   cp.zeros((64, 64), cp.float16))
    with pytest.raises(runtime.CourseInputError, match="uint8"):
        F.gemm_fp8(cp.zeros((64, 64), cp.float16), cp.zeros((64, 64), cp.uint8), s, s, cp.zeros((64, 64), cp.float16))
    for config in PERSISTENT_FP8:  # the TMA writes C's rows in whole 16-byte units: N a multiple of 8
        with pytest.raises(runtime.CourseInputError, match="multiple of 8"):
            F.gemm_fp8(cp.zeros((64, 64), cp.uint8), cp.zeros((60, 64), cp.uint8), s, s, cp.zeros((64, 60), cp.float16),
                       config=config)
    with pytest.raises(runtime.CourseInputError, match="blocks is for the persistent"):
        F.gemm_fp8(cp.zeros((64, 64), cp.uint8), cp.zeros((64, 64), cp.uint8), s, s, cp.zeros((64, 64), cp.float16),
                   blocks=4)
    with pytest.raises(runtime.CourseInputError, match="blocks is for the persistent"):
        F.gemm_fp8(cp.zeros((64, 64), cp.uint8), cp.zeros((64, 64), cp.uint8), s, s, cp.zeros((64, 64), cp.float16),
                   config=PERSISTENT_FP8[0], blocks=0)
    for config in CLUSTER_FP8:  # a whole number of clusters of two
        with pytest.raises(runtime.CourseInputError, match="multiple of 2"):
            F.gemm_fp8(cp.zeros((64, 64), cp.uint8), cp.zeros((64, 64), cp.uint8), s, s,
                       cp.zeros((64, 64), cp.float16), config=config, blocks=3)


@pytest.mark.gpu
def test_gpu_quantiser_gives_numpys_codes_and_scale(rng):
    cp = _on_hopper()
    x = (rng.standard_normal((300, 517)) * np.exp(3 * rng.standard_normal((300, 1)))).astype(np.float32)
    x[0, :3] = [0.0, -0.0, 1e-30]
    codes, scale = F.quantize_fp8_gpu(cp.asarray(x))
    want_codes, want_scale = F.quantize_fp8(x)
    assert scale.shape == (1,) and float(scale.get()[0]) == float(want_scale)
    assert (codes.get() == want_codes).all()
    zc, zs = F.quantize_fp8_gpu(cp.zeros((4, 4), cp.float32))
    assert float(zs.get()[0]) == 1.0 and not zc.get().any()
    # a scale for each block of rows (lesson 10's tiles), from float16 values as well
    x16 = x[:256].astype(np.float16)
    codes, scales = F.quantize_fp8_gpu(cp.asarray(x16), block=64 * 517)
    for b in range(4):
        want_codes, want_scale = F.quantize_fp8(x16[64 * b:64 * (b + 1)].astype(np.float32))
        assert float(scales.get()[b]) == float(want_scale)
        assert (codes.get()[64 * b:64 * (b + 1)] == want_codes).all()
    with pytest.raises(runtime.CourseInputError, match="block must divide"):
        F.quantize_fp8_gpu(cp.asarray(x), block=7)


def test_fp8_benchmark_plan_on_hopper_and_elsewhere():
    from benchmarks import tensor_cores as B

    plan = B.fp8_plan(cc=(9, 0))
    assert [r["config"] for r in plan if r["kind"] == "kernel" and r["precision"] == "fp8"] == list(F.FP8_CONFIGS)
    assert len({r["name"] for r in plan}) == len(plan)  # every row its own name
    assert B.fp8_row_name("fp8_gemm_128x256x128_s4_fast") == "wgmma FP8, 128 x 256, fast"  # as the records name it
    assert (B.fp8_row_name("fp8_gemm_128x128x128_s6_promoted_persistent_tmastore")
            == "wgmma FP8, 128 x 128, promoted, persistent, TMA store")
    assert (B.fp8_row_name("fp8_gemm_128x256x128_s4_fast_persistent_tmastore_c2")
            == "wgmma FP8, 128 x 256, fast, persistent, clusters of 2")
    assert {r["config"] for r in plan if r["kind"] == "library" and r["precision"] == "fp8"} == {"fast", "promoted"}
    assert plan[0]["name"] == "cuBLAS FP16"
    assert not any(r["kind"] == "library" and r["precision"] == "fp8" for r in B.fp8_plan(cc=(9, 0), torch_fp8=False))
    assert B.fp8_plan(cc=(8, 9)) == []
    text = B.format_fp8_table({"skipped": "the FP8 GEMM needs wgmma"})
    assert text == "FP8 GEMM: the FP8 GEMM needs wgmma"


def test_recorded_fp8_and_transformer_statements_the_deep_dive_prints_hold_on_every_record():
    """What lesson 4's deep dive prints under the transformer GEMMs (transformer_reading), the FP8 GEMM
    (fp8_reading) and the steps table (wgmma_reading) holds in every record of those figures, and at least one record
    has each."""
    import benchmarks.tensor_cores as L
    from gpucourse import records

    recs = records.all_records("04_tensor_cores")
    for name, reading in (("fp8", L.fp8_reading), ("transformer", L.transformer_reading), ("wgmma", L.wgmma_reading)):
        having = [r for r in recs if name in r["figures"]]
        assert having, f"no record of lesson 4 has {name!r}"
        for rec in having:
            read = reading(rec["figures"][name])
            assert read and [s for s, holds in read if holds is not True] == [], (rec["path"], read)


def test_the_fp8_and_transformer_statements_follow_the_figures():
    """An FP8 kernel that passes cuBLAS's FP8 GEMM, or a TMA store slower than the threads' stores, prints NO."""
    import copy

    import benchmarks.tensor_cores as L
    from gpucourse import records

    rec = next(r for r in records.all_records("04_tensor_cores") if "fp8" in r["figures"] and "transformer" in r["figures"])
    fp8 = copy.deepcopy(rec["figures"]["fp8"])
    next(r for r in fp8["rows"] if r["kind"] == "kernel" and r["precision"] == "fp8")["of_cublas_fp8"] = 1.05
    one_tile = "every FP8 kernel of one tile a block: short of cuBLAS's FP8 GEMM with the same accumulation"
    assert dict(L.fp8_reading(fp8))[one_tile] is False
    level = ("the persistent 128 x 256 kernel (fast, C stored by the TMA): level with cuBLAS's FP8 GEMM with fast "
             "accumulation (within 2%)")
    next(r for r in fp8["rows"] if "128 x 256, fast, persistent" in r["name"])["of_cublas_fp8"] = 0.9
    assert dict(L.fp8_reading(fp8))[level] is False
    tf = copy.deepcopy(rec["figures"]["transformer"])
    rows = tf["shapes"][0]["rows"]
    tma = next(r for r in rows if "TMA store" in r["name"])
    tma["tflops"] = 0.5 * next(r for r in rows if "FP16 C (" in r["name"])["tflops"]
    read = dict(L.transformer_reading(tf))
    assert read["the TMA store: faster than the same kernel's stores from its threads on every GEMM"] is False
    assert dict(L.fp8_reading({"rows": []}))[one_tile] is None and dict(L.fp8_reading({"rows": []}))[level] is None
    wg = copy.deepcopy(rec["figures"]["wgmma"])
    (text, holds), = L.wgmma_reading(wg)
    assert holds is True
    next(r for r in wg["rows"] if (r.get("config") or "").endswith("_tmastore_c2"))["tflops"] *= 1.1
    assert L.wgmma_reading(wg) == [(text, False)] and L.wgmma_reading({"rows": []}) == [(text, None)]

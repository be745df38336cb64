"""Lesson 10, the NumPy algorithms a CUDA C backward and an FP8 forward are checked against: FlashAttention's tiled
backward (both ways of forming dQ) against the dense float64 backward, its counts against the tile grid; FP8's block
quantisation, the random Hadamard rotation, and the FP8 forward's error against FP16's (CPU only, a few seconds); and the
FP8 forward on Hopper (flash_fp8): the order its V is stored in, what it compiles to, and on a GPU its results."""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_compiler

from gpucourse import runtime
from kernels.attention import backward_tiles as BT
from kernels.attention import fp8 as F8
from kernels.attention import specs as S
from kernels.inference_engine.precision import E4M3_MAX, from_e4m3

pytestmark = pytest.mark.lesson10
ROOT = Path(__file__).resolve().parents[1]

# (N, d, block_m, block_n): tiles that divide N and tiles that do not, unequal tiles both ways
SHAPES = [(37, 64, 16, 16), (64, 64, 32, 32), (100, 128, 32, 16), (100, 64, 24, 40), (64, 128, 64, 64)]
# The FP16-input / FP32-accumulate mode against float64 on the same rounded inputs: P and dS are rounded to float16
# (unit roundoff 2^-11 = 4.9e-4) where they enter a product, so the error is a few of those relative to the largest
# gradient; measured 1.9e-4 .. 4.7e-4 on these shapes.
FP16_REL = 4 * 2.0 ** -11


def _problem(rng, n, d, heads=2, batch=1, causal=False):
    q, k, v, do = (rng.standard_normal((batch, heads, n, d)) for _ in range(4))
    o, lse = S.attention_spec(q, k, v, causal=causal)
    return q, k, v, o, lse, do


# ------------------------------------------------------------------------------------ the tiled backward

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,d,bm,bn", SHAPES)
def test_tiled_backward_equals_the_dense_backward_in_float64(rng, n, d, bm, bn, causal):
    q, k, v, o, lse, do = _problem(rng, n, d, causal=causal)
    ref = S.attention_backward_spec(q, k, v, do, causal=causal)
    for mode in BT.DQ_MODES:
        got = BT.flash_backward_tiles(q, k, v, o, lse, do, causal=causal, block_m=bm, block_n=bn, dq=mode,
                                      precision="fp64")
        for g, r in zip(got, ref):
            assert g.dtype == np.float64 and g.shape == q.shape
            np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,d,bm,bn", SHAPES[::2])
def test_tiled_backward_in_fp16_with_fp32_accumulation(rng, n, d, bm, bn, causal):
    q, k, v, _, _, do = _problem(rng, n, d, causal=causal)
    r16 = [x.astype(np.float16).astype(np.float64) for x in (q, k, v, do)]  # what the kernel reads
    o, lse = S.attention_spec(*r16[:3], causal=causal)
    ref = S.attention_backward_spec(*r16, causal=causal)
    got = {mode: BT.flash_backward_tiles(q, k, v, o, lse, do, causal=causal, block_m=bm, block_n=bn, dq=mode)
           for mode in BT.DQ_MODES}
    for g, r in zip(got["atomic"], ref):
        assert g.dtype == np.float32
        err = np.abs(g - r).max() / np.abs(r).max()
        assert 1e-6 < err < FP16_REL  # not float64's 1e-15: P and dS were rounded to float16
    for a, b in zip(got["atomic"], got["second-pass"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_tiled_backward_takes_every_layout(rng):
    q, k, v, o, lse, do = _problem(rng, 33, 16, heads=3, batch=2, causal=True)
    whole = BT.flash_backward_tiles(q, k, v, o, lse, do, causal=True, block_m=8, block_n=16, precision="fp64")
    one = BT.flash_backward_tiles(q[1, 2], k[1, 2], v[1, 2], o[1, 2], lse[1, 2], do[1, 2], causal=True,
                                  block_m=8, block_n=16, precision="fp64")
    for a, b in zip(whole, one):
        np.testing.assert_allclose(a[1, 2], b, rtol=1e-12)
    sc = 0.3
    o, lse = S.attention_spec(q, k, v, scale=sc)
    ref = S.attention_backward_spec(q, k, v, do, scale=sc)
    for g, r in zip(BT.flash_backward_tiles(q, k, v, o, lse, do, scale=sc, block_m=5, block_n=7,
                                            precision="fp64", dq="second-pass"), ref):
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,d,bm,bn", SHAPES)
def test_counts_follow_the_tile_grid(rng, n, d, bm, bn, causal):
    q, k, v, o, lse, do = _problem(rng, n, d, heads=2, causal=causal)
    for mode in BT.DQ_MODES:
        *_, c = BT.flash_backward_tiles(q, k, v, o, lse, do, causal=causal, block_m=bm, block_n=bn, dq=mode,
                                        precision="fp64", counts=True)
        want = BT.expected_counts(n, d, bm, bn, causal=causal, dq=mode, heads=2)
        assert {key: c[key] for key in want} == want
        t = c["tile_pairs"]
        if mode == "atomic":  # five products a tile pair, P once, one dQ tile added per pair
            assert c["products"] == dict.fromkeys(BT.PRODUCTS, t)
            assert c["atomic_elements"] == 2 * sum(min(n, (i + 1) * bm) - i * bm
                                                   for i, _ in BT.tile_pairs(n, bm, bn, causal)) * d
        else:  # S and dP computed twice, dV and dK once, dQ once: 7 products, P twice
            assert c["products"]["S = Q K^T"] == c["products"]["dP = dO V^T"] == 2 * t
            assert c["products"]["dV += P^T dO"] == c["products"]["dK += dS^T Q"] == c["products"]["dQ += dS K"] == t
            assert c["products_total"] == 7 * t and c["p_tiles"] == 2 * t and c["atomic_adds"] == 0
    tm, tn = -(-n // bm), -(-n // bn)
    assert c["tile_pairs"] == 2 * (tm * tn if not causal else len(BT.tile_pairs(n, bm, bn, True)))


def test_causal_visits_about_half_the_tiles():
    for t in (1, 2, 8, 64):
        assert BT.causal_fraction(128 * t, 128, 128) == pytest.approx((t + 1) / (2 * t))
    assert BT.causal_fraction(16384, 128, 128) < 0.51
    # a causal mask halves the products' FLOPs only in the limit: the diagonal tiles are done whole
    full = BT.backward_product_flops(1024, 64, 64, 64, causal=False, dq="atomic")
    assert full == S.attention_flops(1, 1, 1024, 64, backward=True)
    causal = BT.backward_product_flops(1024, 64, 64, 64, causal=True, dq="atomic")
    assert causal == full * 17 / 32 > S.attention_flops(1, 1, 1024, 64, causal=True, backward=True)
    assert BT.backward_product_flops(1024, 64, 64, 64, causal=False, dq="second-pass") == full * 7 / 5


def test_the_loops_passed_in_are_the_loops_that_run(rng):
    """The deep dive passes its copy of ``backward_blocks`` (edited by a learner): that copy runs, not the module's."""
    q, k, v, o, lse, do = _problem(rng, 40, 16, causal=True)
    calls = []

    def spy(*args):
        calls.append(len(args[7]))  # the tile pairs
        return BT.backward_blocks(*args)

    got = BT.flash_backward_tiles(q, k, v, o, lse, do, causal=True, block_m=16, block_n=8, blocks=spy)
    assert calls == [len(BT.tile_pairs(40, 16, 8, True))]
    for g, r in zip(got, BT.flash_backward_tiles(q, k, v, o, lse, do, causal=True, block_m=16, block_n=8)):
        np.testing.assert_array_equal(g, r)
    broken = lambda *args: tuple(2 * x for x in BT.backward_blocks(*args))  # noqa: E731
    assert not np.allclose(BT.flash_backward_tiles(q, k, v, o, lse, do, blocks=broken)[0],
                           BT.flash_backward_tiles(q, k, v, o, lse, do)[0])


def test_tiled_backward_refuses_bad_input(rng):
    q, k, v, o, lse, do = _problem(rng, 8, 4)
    with pytest.raises(runtime.CourseInputError, match="dq"):
        BT.flash_backward_tiles(q, k, v, o, lse, do, dq="both")
    with pytest.raises(runtime.CourseInputError, match="precision"):
        BT.flash_backward_tiles(q, k, v, o, lse, do, precision="fp8")
    with pytest.raises(runtime.CourseInputError, match="block_m"):
        BT.flash_backward_tiles(q, k, v, o, lse, do, block_m=0)
    with pytest.raises(runtime.CourseInputError, match="lse"):
        BT.flash_backward_tiles(q, k, v, o, lse[..., :-1], do)


# -------------------------------------------------------------------------------------------------- FP8

def test_quantize_blocks_scales_each_block_to_its_amax(rng):
    x = rng.standard_normal((2, 70, 16)) * np.exp(rng.standard_normal((2, 70, 1)))
    codes, scales = F8.quantize_blocks(x, 32)
    assert codes.dtype == np.uint8 and codes.shape == x.shape and scales.shape == (2, 3)
    for b in range(3):
        blk = x[:, 32 * b:32 * (b + 1)]
        np.testing.assert_allclose(scales[:, b], np.abs(blk).max(axis=(1, 2)) / E4M3_MAX, rtol=1e-6)
        assert (np.abs(from_e4m3(codes[:, 32 * b:32 * (b + 1)])).max(axis=(1, 2)) == E4M3_MAX).all()
    back = F8.dequantize_blocks(codes, scales, 32)
    err = np.abs(back - x)
    step = np.repeat(scales, 32, axis=-1)[:, :70, None] * 2.0 ** -9  # e4m3's subnormal step, scaled
    assert (err <= np.maximum(np.abs(x) * 2.0 ** -4, step / 2) * (1 + 1e-6)).all()  # half an ulp: 3 mantissa bits
    one, s1 = F8.quantize_blocks(x, 70)  # per tensor
    assert s1.shape == (2, 1)
    np.testing.assert_allclose(s1[:, 0], np.abs(x).max(axis=(1, 2)) / E4M3_MAX, rtol=1e-6)
    zc, zs = F8.quantize_blocks(np.zeros((5, 4)), 2)
    assert (zs == 1).all() and (from_e4m3(zc) == 0).all()


@pytest.mark.parametrize("d", [1, 2, 16, 64, 128])
def test_random_hadamard_is_orthogonal_and_keeps_q_k_transposed(rng, d):
    h = F8.random_hadamard(d, 3)
    np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-12)
    np.testing.assert_allclose(np.abs(h), 1 / math.sqrt(d))
    q, k = rng.standard_normal((2, 9, d)), rng.standard_normal((2, 11, d))
    np.testing.assert_allclose((q @ h) @ np.swapaxes(k @ h, -1, -2), q @ np.swapaxes(k, -1, -2), atol=1e-12)
    if d >= 16:
        assert not np.array_equal(h, F8.random_hadamard(d, 4))  # another draw of signs
        np.testing.assert_array_equal(h, F8.random_hadamard(d, 3))
    for bad in (0, 3, 96, True):
        with pytest.raises(runtime.CourseInputError, match="power of 2"):
            F8.random_hadamard(bad)


@pytest.mark.parametrize("causal", [False, True])
def test_the_tiled_forwards_compute_attention(rng, causal):
    q, k, v = (rng.standard_normal((2, 100, 64)) for _ in range(3))
    ref, lref = S.attention_spec(q, k, v, causal=causal)
    o, lse = F8.fp16_attention(q, k, v, causal=causal, block_m=32, block_n=48)
    assert o.dtype == np.float32 and o.shape == q.shape and lse.shape == q.shape[:-1]
    np.testing.assert_allclose(o, ref, atol=2e-3)
    np.testing.assert_allclose(lse, lref, atol=1e-3)
    o8, lse8 = F8.fp8_attention(q, k, v, causal=causal, block_m=32, block_n=48)
    assert F8.rmse(o8, ref) < 0.02 and np.abs(lse8 - lref).max() < 0.15
    oh, _ = F8.fp16_attention(q, k, v, causal=causal, hadamard=5)  # the rotation changes no score
    np.testing.assert_allclose(oh, ref, atol=2e-3)


def test_fp8_error_is_larger_than_fp16s_and_bounded(rng):
    q, k, v = (rng.standard_normal((4, 256, 64)) for _ in range(3))
    ref = S.attention_spec(q, k, v)[0]
    e16, e8 = F8.rmse(F8.fp16_attention(q, k, v)[0], ref), F8.rmse(F8.fp8_attention(q, k, v)[0], ref)
    # e4m3 rounds to 3 mantissa bits (half an ulp: 2^-4 relative) where float16 has 10: measured 5.4e-3 against
    # 4.2e-5, about 5% of the output's rms (0.1)
    assert e8 > 30 * e16
    assert e8 < 1e-2


def test_p_scaled_by_256_keeps_the_many_small_weights(rng):
    # one key 8 above all the others: the other 511 keys' P = exp(-8) = 3.4e-4 each, below half e4m3's smallest
    # subnormal (2^-9 / 2), so unscaled they round to 0 and lose 15% of the row's weight; times 256 they are normals
    n, d = 512, 64
    q = np.zeros((1, n, d))
    q[..., 0] = 1
    k = np.zeros((1, n, d))
    k[..., 1:] = rng.standard_normal((1, n, d - 1))
    k[:, 0, 0] = 8.0
    v = rng.standard_normal((1, n, d)) + np.r_[0.0, np.ones(n - 1)][None, :, None]
    ref = S.attention_spec(q, k, v, scale=1.0)[0]
    err = {p: F8.rmse(F8.fp8_attention(q, k, v, scale=1.0, p_scale=p)[0], ref) for p in (1.0, F8.P_SCALE)}
    assert err[1.0] > 4 * err[F8.P_SCALE]
    assert F8.P_SCALE == 2 ** 8 < E4M3_MAX


def test_per_block_scales_beat_one_per_tensor_when_a_few_rows_are_huge(rng):
    # e4m3 is a floating format: one scale per tensor costs precision only where its magnitudes span more than e4m3's
    # normals (2^-6 .. 448, a factor 2.9e4). Four query rows 3e4 times the rest (massive activations of the first
    # tokens) push every other row's values into subnormals under a per-tensor scale; per block only the first tile's.
    q, k, v = (rng.standard_normal((2, 256, 64)) for _ in range(3))
    q[:, :4] *= 3e4
    keep = slice(64, None)
    ref = S.attention_spec(q, k, v)[0][:, keep]
    tensor = F8.rmse(F8.fp8_attention(q, k, v, per_block=False)[0][:, keep], ref)
    block = F8.rmse(F8.fp8_attention(q, k, v)[0][:, keep], ref)
    assert tensor > 1.5 * block
    q[:, :4] /= 3e4  # and with no huge rows the two are alike
    ref = S.attention_spec(q, k, v)[0]
    a, b = (F8.rmse(F8.fp8_attention(q, k, v, per_block=pb)[0], ref) for pb in (False, True))
    assert 0.8 < a / b < 1.25


def test_the_hadamard_rotation_reduces_fp8s_error_with_outliers():
    figs = F8.error_figures()
    for name, row in figs.items():
        assert row["fp8 per block"] > 20 * row["fp16"]
    g, e, c = figs["gaussian"], figs["outlier entries"], figs["outlier channels"]
    assert 0.9 < g["fp8 per block + hadamard"] / g["fp8 per block"] < 1.1  # nothing to spread: no gain
    assert c["fp8 per block"] > 2 * c["fp8 per block + hadamard"]  # outlier channels: spread over all d
    assert e["fp8 per tensor"] > e["fp8 per block"] > 1.2 * e["fp8 per block + hadamard"]
    # what the deep dive says under the table it prints: FP8 about 100 times FP16's error on every input, the
    # rotation about halving it with outlier channels, block scales against one a tensor within 25% either way
    for row in figs.values():
        assert 50 < row["fp8 per block"] / row["fp16"] < 200
        assert 0.8 < row["fp8 per tensor"] / row["fp8 per block"] < 1.25
    assert 1.7 < c["fp8 per block"] / c["fp8 per block + hadamard"] < 3
    assert (e["fp8 per block"] / e["fp8 per block + hadamard"]
            < c["fp8 per block"] / c["fp8 per block + hadamard"])  # outlier entries: it helps less
    # FlashAttention-3's outlier entries, over other draws: a smaller gain, but a gain
    ratios = []
    for seed in range(1, 4):
        q, k, v = F8.outlier_inputs(np.random.default_rng(seed), (4, 256, 64), kind="entries")
        ref = S.attention_spec(q, k, v)[0]
        ratios.append(F8.rmse(F8.fp8_attention(q, k, v)[0], ref)
                      / F8.rmse(F8.fp8_attention(q, k, v, hadamard=seed)[0], ref))
    assert min(ratios) > 1.0 and np.mean(ratios) > 1.1


def test_the_engineering_note_carries_the_figures_the_functions_compute():
    note = (ROOT / "docs" / "engineering" / "10_attention.md").read_text()
    assert F8.format_error_figures(F8.error_figures()) in note
    assert BT.format_counts() in note


def test_fp8_refuses_bad_input(rng):
    with pytest.raises(runtime.CourseInputError, match="rows"):
        F8.quantize_blocks(np.ones((4, 4)), 0)
    with pytest.raises(runtime.CourseInputError, match="power of 2"):
        F8.fp8_attention(*(rng.standard_normal((8, 12)) for _ in range(3)), hadamard=0)
    with pytest.raises(runtime.CourseInputError, match="kind"):
        F8.outlier_inputs(rng, (4, 8), kind="rows")


# ------------------------------------------------------------------ the FP8 kernel on Hopper (flash_fp8)

def test_fp8_key_order_pairs_each_p_with_its_v():
    """The kernel packs a thread's accumulator values of S (after the softmax) into words of four e4m3 codes as they
    come and stores them to shared memory (store_p_fp8), where P V's wgmma reads its A operand K-major in the 128-byte
    swizzle; V transposed stores each 32 keys in FP8_KEY_ORDER. Emulated here for one consumer's 64 rows from the
    FP32 accumulator's layout (thread (warp w, lane: g = lane / 4, q = lane % 4) holds rows 16w + g and + 8, keys
    16j + 8 (e / 4) + 2q + e % 2), store_p_fp8's addresses and the swizzle the MMA reads through: every byte is
    written once, a warp's 32 stores of a step fall on 32 banks, and the A the MMA reads, times V stored in that
    order, is P V."""
    from kernels.attention.flash import FP8_KEY_ORDER, fp8_v_transposed

    assert sorted(FP8_KEY_ORDER.tolist()) == list(range(32))
    rng = np.random.default_rng(0)
    bn, d = 128, 16
    P = rng.random((64, bn))
    smem = np.full(64 * 128, np.nan)
    writes = np.zeros(64 * 128, int)
    banks = {}  # (warp, b, half, h) -> the banks of its 32 stores
    for warp in range(4):
        for lane in range(32):
            g, q = lane // 4, lane % 4
            s = np.empty((bn // 16, 8))  # the thread's accumulator registers
            for j in range(bn // 16):
                for e in range(8):
                    s[j, e] = P[16 * warp + g + 8 * ((e >> 1) & 1), 16 * j + 8 * (e >> 2) + 2 * q + (e & 1)]
            for b in range(bn // 32):
                for half in range(2):
                    for h in range(2):
                        x = s[2 * b + half]
                        word = [x[2 * h], x[2 * h + 1], x[4 + 2 * h], x[5 + 2 * h]]  # e4m3x4_bits' four, low first
                        r = 16 * warp + g + 8 * h
                        addr = r * 128 + (((2 * b + half) ^ (r % 8)) << 4) + 4 * q  # store_p_fp8's
                        smem[addr:addr + 4] = word
                        writes[addr:addr + 4] += 1
                        banks.setdefault((warp, b, half, h), set()).add(addr // 4 % 32)
    assert (writes == 1).all()
    assert all(len(v) == 32 for v in banks.values())
    rows, cols = np.meshgrid(np.arange(64), np.arange(bn), indexing="ij")
    A_read = smem[rows * 128 + (((cols // 16) ^ (rows % 8)) << 4) + cols % 16]  # K-major, 128-byte swizzle
    V = rng.standard_normal((1, bn, d))
    Vt = fp8_v_transposed(V)[0]  # d x N, each 32 keys in FP8_KEY_ORDER
    np.testing.assert_allclose(A_read @ Vt.T, P @ V[0], rtol=1e-12)
    assert not np.allclose(P @ Vt.T, P @ V[0])  # without the order, P would meet the wrong keys
    with pytest.raises(runtime.CourseInputError, match="multiple of 32"):
        fp8_v_transposed(np.zeros((1, 40, 8)))


@needs_compiler
def test_fp8_attention_kernels_compile_to_e4m3_wgmma():
    """Three consumers (setmaxnreg 160, 512 threads); S = Q K^T and O += P V, 4 wgmmas each (128 codes, 32 a step),
    every operand from shared memory (S in the first tile and the loop; P V in the loop and after it); the row sums
    P 1 by m64n8 wgmmas beside P V; P stored to shared memory; the 256 in P's exponent, not a multiply."""
    from gpucourse import cuda_c
    from kernels.attention.flash import WGMMA_SOURCE

    ptx = cuda_c.compile_ptx(WGMMA_SOURCE, arch="sm_90a")
    for name in ("flash_fp8_d128", "flash_fp8_d128_causal"):
        body = cuda_c.ptx_entry(ptx, name)
        ss = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3\s+\{[^}]*\},\s*%rd", body)
        rs = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3\s+\{[^}]*\},\s*\{", body)
        sums = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n8k32\.f32\.e4m3\.e4m3\s+\{[^}]*\},\s*%rd", body)
        assert (len(ss), len(rs), len(sums)) == (16, 0, 8), (name, len(ss), len(rs), len(sums))
        assert "cvt.rn.satfinite.e4m3x2.f32" in body and "st.shared.u32" in body, name
        assert "setmaxnreg.inc.sync.aligned.u32 160" in body and ".maxntid 512, 1, 1" in body, name
        assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16" not in body, name
        assert "0f43800000" not in body, name  # 256.0: P's scale is 8 added to its exponent
    plain = cuda_c.compile_ptx(WGMMA_SOURCE, arch="sm_90")
    assert "e4m3" not in plain


def _prepass_constant(name: str) -> int:
    """A constexpr int of the fused pre-pass's source (kernels/cuda/attention_fp8_prepass.cu)."""
    text = (ROOT / "kernels" / "cuda" / "attention_fp8_prepass.cu").read_text()
    return int(re.search(rf"constexpr int {name} = (\d+);", text).group(1))


def test_fp8_prepass_index_arithmetic_emulated():
    """The fused pre-pass's indices (attention_fp8_prepass.cu) emulated warp by warp in NumPy. Q and K: each 8-value
    piece of a tile is loaded by one thread and its codes go where it came from. V (vt_tile): each value of the tile
    is loaded once; the shared-memory stores of each instruction and the loads of each word reach 32 different banks
    (rows of VT_ROW_WORDS words); and the tile that comes out is fp8_v_transposed's (each 32 keys in FP8_KEY_ORDER)."""
    from kernels.attention.flash import PREPASS_THREADS, fp8_v_transposed

    threads, row_words, tile, d = _prepass_constant("THREADS"), _prepass_constant("VT_ROW_WORDS"), 128, 128
    assert threads == PREPASS_THREADS and threads // 32 == 16  # one warp per unit of 32 keys x 32 columns
    pieces = np.zeros(tile * d // 8, int)  # rows_tile: piece t + THREADS i of thread t
    for t in range(threads):
        for i in range(tile * d // 8 // threads):  # PIECES
            pieces[t + threads * i] += 1
    assert (pieces == 1).all()

    codes = np.random.default_rng(0).integers(0, 256, (tile, d), dtype=np.uint8)  # one tile of V's codes, keys x d
    loaded = np.zeros((tile, d), int)
    staged = np.full(d * row_words, -1, np.int64)
    for warp in range(threads // 32):
        u = warp
        lanes = []
        for lane in range(32):
            m, s_ = lane % 4, lane // 4
            first_key = 32 * (u % 4) + 16 * (s_ // 4) + 2 * (s_ % 4)
            keys = [first_key + (i % 2) + 8 * (i // 2) for i in range(4)]
            cols = 32 * (u // 4) + 8 * m + np.arange(8)
            loaded[np.ix_(keys, cols)] += 1
            lanes.append((m, s_, keys, cols))
        for j in range(8):  # one store instruction per column j of the pieces
            banks = set()
            for m, s_, keys, cols in lanes:
                word = sum(int(codes[keys[i], cols[j]]) << (8 * i) for i in range(4))
                addr = (32 * (u // 4) + 8 * m + j) * row_words + 8 * (u % 4) + s_
                assert staged[addr] == -1
                staged[addr] = word
                banks.add(addr % 32)
            assert len(banks) == 32, (warp, j, sorted(banks))
    assert (loaded == 1).all()
    out = np.zeros((d, tile), np.uint8)
    for k in range(tile * d // 16 // threads):
        for warp in range(threads // 32):
            for word in range(4):  # a warp's load of one word of its 16-byte runs
                banks = set()
                for lane in range(32):
                    o = 32 * warp + lane + threads * k
                    c, run = o // 8, o % 8
                    addr = c * row_words + 4 * run + word
                    banks.add(addr % 32)
                    out[c, 16 * run + 4 * word:16 * run + 4 * word + 4] = np.array([staged[addr]], "<u4").view(np.uint8)
                assert len(banks) == 32, (k, warp, word)
    assert (out == fp8_v_transposed(codes[None])[0]).all()


def test_fp8_prepass_amax_over_bits_is_numpys_max():
    """The pre-pass takes a tile's largest magnitude as the largest of the bits of |x| read as unsigned integers: the
    same float as NumPy's max of |x| (zeros, -0, subnormals, infinity), and a NaN wherever the tile holds one, so
    that e4m3_scale gives the same scale (1 for a NaN, as for zeros)."""
    from kernels.inference_engine.precision import e4m3_scale

    rng = np.random.default_rng(2)
    cases = [rng.standard_normal(64).astype(np.float32), np.zeros(64, np.float32), -np.zeros(64, np.float32),
             np.array([1e-45, -3e-42, 0.0], np.float32), np.array([1.0, -np.inf, 2.0], np.float32),
             np.array([1.0, np.nan, -np.inf], np.float32), np.array([-np.nan, 5.0], np.float32),
             rng.standard_normal(64).astype(np.float16).astype(np.float32)]
    for x in cases:
        bits = np.array([(x.view(np.uint32) & 0x7FFFFFFF).max()], np.uint32).view(np.float32)[0]
        want = np.abs(x).max()
        assert (np.isnan(bits) and np.isnan(want)) or bits == want, (x, bits, want)
        assert e4m3_scale(bits).view(np.uint32) == e4m3_scale(want).view(np.uint32), x


@needs_compiler
def test_fp8_prepass_compiles_without_spills_for_every_gpu():
    """ptxas's account of the four pre-pass kernels (Q and K's type, V's) on Hopper and on the oldest GPU the course
    supports: no spills, no stack; e4m3 conversions in hardware on Hopper; and the e4m3 rounding written once, in
    e4m3.cuh, which lesson 4's quantiser includes too."""
    from gpucourse import cuda_c
    from kernels.attention.flash import PREPASS_SOURCE

    names = [f"fp8_prepass_{a}_{b}" for a in ("f16", "f32") for b in ("f16", "f32")]
    for arch in ("sm_90a", "sm_75"):
        log = cuda_c.ptxas_log(PREPASS_SOURCE, arch).replace("\x00", "")
        for name in names:
            part = log.split(f"Compiling entry function '{name}'")[1].split("Compiling entry function")[0]
            assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in part, (arch, name, part)
    body = cuda_c.ptx_entry(cuda_c.compile_ptx(PREPASS_SOURCE, arch="sm_90"), "fp8_prepass_f16_f16")
    assert body.count("cvt.rn.satfinite.e4m3x2.f32") == 3 * 32 and body.count("div.rn.f32") == 3 * 32 + 3
    assert "wgmma" not in body and "cp.async" not in body
    sources = {p.name: p.read_text() for p in (ROOT / "kernels" / "cuda").glob("*.cu*")}
    assert [n for n, text in sources.items() if "__fdiv_rn" in text] == ["e4m3.cuh"]
    assert all('#include "e4m3.cuh"' in sources[n] for n in ("tensor_cores_fp8.cu", "attention_fp8_prepass.cu"))


def test_flash_fp8_needs_a_gpu_or_says_so():
    if runtime.is_gpu():
        pytest.skip("a GPU runs it (test_flash_fp8_on_gpu)")
    import kernels.attention as A

    with pytest.raises(runtime.CourseError, match="FP8"):
        A.flash_fp8(np.zeros((1, 128, 128)), np.zeros((1, 128, 128)), np.zeros((1, 128, 128)))


def _hopper():
    from gpucourse import gpus

    if not gpus.supports("wgmma"):
        with pytest.raises(runtime.CourseError, match="needs wgmma"):
            gpus.step("10.wgmma_fp8")
        pytest.skip(gpus.missing("wgmma"))
    return runtime.cupy()


def _prepass_inputs(rng, shape, dtype, *, nan: bool = False):
    """Q, K, V of ``shape`` (batch, heads, N, 128) in ``dtype``: Gaussian rows of sizes a few e apart, with a tile of
    zeros (Q's first), tiles with one outlier (K's first, V's last: near FP16's largest value, or 2^100 in FP32, so
    that the rest of the tile rounds to subnormal codes or zero), -0 and FP16 subnormals, and (``nan``) a NaN in a
    tile of V."""
    big = 6.0e4 if dtype == np.float16 else 2.0**100
    out = []
    for name in "qkv":
        x = rng.standard_normal(shape) * np.exp(rng.standard_normal(shape[:-1] + (1,)))
        tiles = x.reshape(-1, 128, 128)
        tiles[0, 0, :4] = [-0.0, 2.0**-24, -(2.0**-20), 0.0]
        if name == "q":
            tiles[0] = 0.0
        if name == "k":
            tiles[0, 77, 5] = -big
        if name == "v":
            tiles[-1, 3, 100] = big
            if nan:
                tiles[len(tiles) // 2, 64, 64] = np.nan
        out.append(x.astype(dtype))
    return out


def _reference_operands(q, k, v):
    """fp8_operands' output by the unfused path: lesson 4's quantize_fp8_gpu on each tensor (a scale per 128 x 128
    block), then fp8_v_transposed on V's codes (CuPy arrays, q k v (B, H, N, 128))."""
    import kernels.attention as A
    from kernels.tensor_cores_fp8 import quantize_fp8_gpu

    B, H, N, D = q.shape
    ref = {"shape": (B, H, N, D)}
    for name, x in (("q", q), ("k", k), ("v", v)):
        codes, scales = quantize_fp8_gpu(x.reshape(B * H * N, D), block=128 * D)
        ref[name], ref["s" + name] = codes, scales.reshape(B * H, N // 128)
    ref["vt"] = A.fp8_v_transposed(ref.pop("v").reshape(B * H, N, D)).reshape(B * H * D, N)
    return ref


def _assert_same_operands(got, want):
    assert got["shape"] == want["shape"]
    for name in ("q", "k", "vt"):
        assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype, name
        diff = int((got[name] != want[name]).sum())
        assert diff == 0, f"{name}: {diff} codes differ"
    for name in ("sq", "sk", "sv"):
        assert got[name].shape == want[name].shape, name
        assert (got[name].view(np.uint32) == want[name].view(np.uint32)).all(), name  # bit for bit


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("shape", [(1, 1, 128, 128), (2, 3, 384, 128), (1, 2, 1024, 128)])
def test_fused_prepass_is_the_unfused_path_code_for_code(shape, dtype):
    """fp8_operands (one launch of attention_fp8_prepass.cu) against quantize_fp8_gpu + fp8_v_transposed: the same
    codes and the same scales, bit for bit, with tiles of zeros, outliers, subnormals, -0 and a NaN."""
    cp = _hopper()
    import kernels.attention as A

    q, k, v = (cp.asarray(x) for x in _prepass_inputs(np.random.default_rng(shape[2]), shape, dtype, nan=True))
    ops = A.fp8_operands(q, k, v)
    _assert_same_operands(ops, _reference_operands(q, k, v))
    assert float(ops["sq"][0, 0]) == 1.0 and not ops["q"][:128].any()  # the tile of zeros: scale 1, codes 0
    amax = cp.abs(k[0, 0, :128].astype(cp.float32)).max()  # the outlier's tile: its scale is the outlier's / 448
    assert float(ops["sk"][0, 0]) == float(amax / np.float32(448)) and float(amax) >= 6.0e4


@pytest.mark.gpu
def test_fused_prepass_mixed_types_and_hadamard():
    """The kernels with Q and K of another type than V: the Hadamard rotation's float32 Q and K beside float16 V,
    float16 Q and K beside float32 V, and Q float16 with K float32 (both taken as float32, which is exact): the
    unfused path's codes and scales."""
    cp = _hopper()
    import kernels.attention as A
    from kernels.attention.fp8 import random_hadamard

    q, k, v = (cp.asarray(x) for x in _prepass_inputs(np.random.default_rng(5), (1, 2, 256, 128), np.float16))
    rot = cp.asarray(random_hadamard(128, 7), dtype=cp.float32)
    qh, kh = ((x.reshape(-1, 128).astype(cp.float32) @ rot).reshape(x.shape) for x in (q, k))
    _assert_same_operands(A.fp8_operands(q, k, v, hadamard=7), _reference_operands(qh, kh, v))
    k32, v32 = k.astype(cp.float32), v.astype(cp.float32)
    _assert_same_operands(A.fp8_operands(q, k, v32), _reference_operands(q, k, v32))
    _assert_same_operands(A.fp8_operands(q, k32, v), _reference_operands(q, k32, v))
    shifted = cp.zeros(q.size + 1, cp.float16)[1:].reshape(q.shape)  # contiguous, 2 bytes off 16
    with pytest.raises(runtime.CourseInputError, match="16-byte boundary"):
        A.fp8_operands(q, k, shifted)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_flash_fp8_is_unchanged_by_the_fused_prepass(causal):
    """flash_fp8 on fp8_operands' output and on the unfused path's: the same O and lse, bit for bit."""
    cp = _hopper()
    import kernels.attention as A

    q, k, v = (cp.asarray(x) for x in _prepass_inputs(np.random.default_rng(9), (2, 2, 384, 128), np.float16))
    o, lse = A.flash_fp8(q, k, v, causal=causal)
    o_ref, lse_ref = A.flash_fp8(causal=causal, operands=_reference_operands(q, k, v))
    assert bool(cp.isfinite(o).all())
    assert (o.view(cp.uint16) == o_ref.view(cp.uint16)).all()
    assert (lse.view(cp.uint32) == lse_ref.view(cp.uint32)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_fp8_operands_are_numpys_block_codes(dtype):
    """fp8_operands against NumPy's block quantisation (fp8.quantize_blocks) and fp8_v_transposed, on any GPU: the
    pre-pass is SIMT code (cuda_fp8.h converts in hardware from sm_89 and emulates the same rounding before)."""
    cp = runtime.cupy()
    import kernels.attention as A
    from kernels.attention.fp8 import quantize_blocks

    q, k, v = _prepass_inputs(np.random.default_rng(1), (1, 2, 256, 128), dtype)
    ops = A.fp8_operands(*(cp.asarray(x) for x in (q, k, v)))
    for name, x in (("q", q), ("k", k)):
        codes, scales = quantize_blocks(x.reshape(2, 256, 128).astype(np.float32), 128)
        assert (ops[name].get() == codes.reshape(512, 128)).all(), name
        assert (ops["s" + name].get() == scales).all(), name
    codes, scales = quantize_blocks(v.reshape(2, 256, 128).astype(np.float32), 128)
    assert (ops["vt"].get() == A.fp8_v_transposed(codes).reshape(256, 256)).all()
    assert (ops["sv"].get() == scales).all()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [128, 384, 1024])
def test_flash_fp8_on_gpu(causal, n):
    """Against fp8_attention's numerics with the kernel's tiles (block 128): the same quantised operands, so the two
    differ by the FP8 MMAs' sums, P's rounding where those move it, and the FP16 output; and against float64, about
    as far as those numerics are."""
    cp = _hopper()
    import kernels.attention as A
    from kernels.attention.fp8 import fp8_attention, rmse

    rng = np.random.default_rng(n + causal)
    q, k, v = (rng.standard_normal((2, 2, n, 128)) for _ in range(3))
    o, lse = A.flash_fp8(*(cp.asarray(x.astype(np.float16)) for x in (q, k, v)), causal=causal)
    q16, k16, v16 = (x.astype(np.float16).astype(np.float64) for x in (q, k, v))
    want, want_lse = fp8_attention(q16, k16, v16, causal=causal, block_m=128, block_n=128)
    ref = A.attention_spec(q16, k16, v16, causal=causal)[0]
    got = o.get().astype(np.float64)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 0.05, np.abs(got - want).max()
    assert rmse(got, ref) <= 1.25 * rmse(want, ref) + 1e-3, (rmse(got, ref), rmse(want, ref))
    np.testing.assert_allclose(lse.get(), want_lse, atol=2e-2)


@pytest.mark.gpu
def test_flash_fp8_causal_order_covers_every_item_once(monkeypatch):
    """The FP8 kernel's causal order (longest items first, heads in sections, fp8_section): sections of 1 head, of 3
    heads for 7 (the last holds one) and one larger than the heads give the same O and LSE bit for bit as one
    section of all 7 (4 items of 192 rows a head at N = 640, the last reaching past N): every item is computed
    once, wherever the order puts it."""
    cp = _hopper()
    import kernels.attention as A

    rng = np.random.default_rng(7)
    ops = A.fp8_operands(*(cp.asarray(rng.standard_normal((1, 7, 640, 128)).astype(np.float16)) for _ in range(3)))
    monkeypatch.setattr(A.flash, "fp8_section", lambda n, heads, sms: 7)
    want = A.flash_fp8(causal=True, operands=ops)
    for section in (1, 3, 8):
        monkeypatch.setattr(A.flash, "fp8_section", lambda n, heads, sms: section)
        got = A.flash_fp8(causal=True, operands=ops)
        assert all(cp.array_equal(a, b) for a, b in zip(got, want)), section


# ------------------------------------------------------------------ the backward in CUDA C on Hopper (flash_backward_wgmma)

@needs_compiler
def test_cuda_backward_compiles_to_its_five_products():
    """Per (query tile, key tile): S^T and dP^T, d / 16 wgmmas each (16 a step, both operands from shared memory);
    dV and dK, 4 each from registers (64 queries, n = d); dQ with both operands read transposed, 8 (128 keys, a
    consumer's 64 columns) at d = 128, 4 (a consumer's 64 keys, all 64 columns) at d = 64; the TMA's bulk atomic
    add of the dQ tile; at d = 64 the consumers' turns. The second pass: S and dP (n = 128 keys), d / 16 each, dQ +=
    dS K 8 from registers."""
    from gpucourse import cuda_c
    from kernels.attention.backward_cuda import BWD_SOURCE

    ptx = cuda_c.compile_ptx(BWD_SOURCE, arch="sm_90a")
    for name, d in (("flash_bwd_wgmma_d128", 128), ("flash_bwd_wgmma_d128_causal", 128), ("flash_bwd_wgmma_d64", 64),
                    ("flash_bwd_wgmma_d64_causal", 64)):
        body = cuda_c.ptx_entry(ptx, name)
        mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)\.f32\.f16\.f16\s+\{[^}]*\},\s*(\{|%rd)"
                          r"[^;]*?,\s*p,\s*([\d, ]+);", body)
        # (shape, A from registers or shared memory, the immediates after scale-d: scale-a, scale-b, [transpose A,]
        # transpose B)
        kinds = [(shape, "regs" if a == "{" else "smem", tuple(int(x) for x in flags.split(","))) for shape, a, flags
                 in mmas]
        assert kinds.count(("m64n64k16", "smem", (1, 1, 0, 0))) == d // 8, (name, kinds)  # S^T, dP^T: K-major
        assert kinds.count((f"m64n{d}k16", "regs", (1, 1, 1))) == 8, (name, kinds)  # dV, dK: dO and Q MN-major
        dq_steps = 8 if d == 128 else 4
        assert kinds.count(("m64n64k16", "smem", (1, 1, 1, 1))) == dq_steps, (name, kinds)  # dQ = dS K, transposed
        assert len(kinds) == d // 8 + 8 + dq_steps, (name, kinds)
        assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in body, name
        assert "setmaxnreg" in body and "%globaltimer" in body, name
        # d = 64: the consumers take turns at S^T and dP^T (consumer 1's first hand-over, then one each a tile); d =
        # 128: they run in step (both read every dS^T row), no turns
        assert body.count("bar.arrive") == (3 if d == 64 else 0), name
    for d in (128, 64):
        for name in (f"flash_bwd_wgmma_d{d}_dkdv", f"flash_bwd_wgmma_d{d}_dkdv_causal"):  # dQ left to the second pass
            body = cuda_c.ptx_entry(ptx, name)
            assert len(re.findall(r"wgmma\.mma_async", body)) == d // 8 + 8, name
            assert "cp.reduce.async.bulk" not in body, name
    for name, d in (("flash_bwd_dq_wgmma_d128", 128), ("flash_bwd_dq_wgmma_d128_causal", 128),
                    ("flash_bwd_dq_wgmma_d64", 64), ("flash_bwd_dq_wgmma_d64_causal", 64)):  # S, dP, dQ += dS K
        body = cuda_c.ptx_entry(ptx, name)
        mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)\.f32\.f16\.f16\s+\{[^}]*\},\s*(\{|%rd)"
                          r"[^;]*?,\s*p,\s*([\d, ]+);", body)
        kinds = [(shape, "regs" if a == "{" else "smem", tuple(int(x) for x in flags.split(","))) for shape, a, flags
                 in mmas]
        assert kinds.count(("m64n128k16", "smem", (1, 1, 0, 0))) == d // 8, (name, kinds)
        assert kinds.count((f"m64n{d}k16", "regs", (1, 1, 1))) == 8, (name, kinds)
        assert len(kinds) == d // 8 + 8 and "cp.reduce.async.bulk" not in body, (name, kinds)
    log = cuda_c.ptxas_log(BWD_SOURCE, "sm_90a").replace("\x00", "")
    assert log.count("0 bytes spill stores, 0 bytes spill loads") == log.count("Compiling entry function"), log
    assert "C7512" not in log, log
    plain = cuda_c.compile_ptx(BWD_SOURCE, arch="sm_90")
    assert "wgmma.mma_async" not in plain and "cp.reduce.async.bulk" not in plain


@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 100, 127, 128, 129, 200, 256, 641])
def test_cuda_backward_kernels_touch_each_row_and_pair_once(n, causal, d):
    """The kernels' index arithmetic, emulated thread by thread for N not a multiple of the tiles: every (query, key)
    pair the mask keeps gets P != 0 exactly once in each kernel, none past N (keys masked, query rows reading the
    padded lse = +inf); every row before N of dK, dV and dQ is stored once in each 16-byte chunk, none past N; the
    LSE and D reads stay inside the padded rows, which the pre-pass leaves alone; each bulk add of a dQ tile sends whole rows (a multiple of 16 bytes)
    before N only (d = 64: two a pair, one a consumer's keys); the grids are ceil(N / tile)."""
    from kernels.attention.backward_cuda import BWD_BLOCK_M, kernel_indices, padded_rows

    r = kernel_indices(n, causal, d)
    want = np.tril(np.ones((n, n), int)) if causal else np.ones((n, n), int)
    for kernel in ("dkdv", "dq"):
        k = r[kernel]
        assert (k["live"] == want).all(), kernel
        assert (k["stored"][:n] == 1).all() and not k["stored"][n:].any(), kernel
        assert k["lse_reads"] < padded_rows(n) and padded_rows(n) % 128 == 0, kernel
    seen = np.zeros(n + BWD_BLOCK_M, int)
    for first, nbytes in r["dkdv"]["dq_adds"]:
        assert nbytes % 16 == 0 and 0 < nbytes <= BWD_BLOCK_M * d * 4
        assert first + nbytes // (4 * d) <= n
        seen[first:first + nbytes // (4 * d)] += 1
    assert seen[:n].all() and not seen[n:].any()
    pad = np.arange(2 * padded_rows(n)) % padded_rows(n) >= n  # the pre-pass writes each head's rows, not the padding
    assert (r["prepass"][~pad] == 1).all() and not r["prepass"][pad].any()
    pairs = BT.tile_pairs(n, 64, 128, causal)
    adds = 2 if d == 64 else 1  # a (query tile, key tile) pair the algorithm visits: its adds
    assert len(r["dkdv"]["dq_adds"]) == adds * len(pairs)


def test_cuda_backward_needs_a_gpu_or_says_so():
    if runtime.is_gpu():
        pytest.skip("a GPU runs it (test_cuda_backward_on_gpu)")
    import kernels.attention as A

    z = np.zeros((1, 128, 128))
    with pytest.raises(runtime.CourseError, match="CUDA C backward"):
        A.flash_backward_wgmma(z, z, z, z, z[..., 0], z)


def _check_cuda_backward(cp, q, k, v, do, o, lse, causal, dq):
    """dQ, dK, dV of flash_backward_wgmma against the tiled algorithm's FP16 numerics (the same tiles, P and dS
    rounded to FP16 where they feed a product), against float64, and against PyTorch's autograd where it is installed,
    within FP16 tolerances. A gradient that is zero in exact arithmetic (N = 1: dQ = dK = 0, since O = V) is held to
    an absolute floor of 1e-2 of the largest dV instead."""
    import kernels.attention as A

    g = [cp.asarray(x) for x in (q, k, v, do)]
    grads = [x.get().astype(np.float64) for x in A.flash_backward_wgmma(*g[:3], o, lse, g[3], causal=causal, dq=dq)]
    tiles = BT.flash_backward_tiles(q, k, v, o.get(), lse.get(), do, causal=causal, block_m=64, block_n=128,
                                    dq=dq, precision="fp16")
    exact = S.attention_backward_spec(q, k, v, do, causal=causal)
    floor = 1e-2 * np.abs(exact[2]).max()
    for name, got, t, r in zip(("dq", "dk", "dv"), grads, tiles, exact):
        assert got.shape == q.shape and np.isfinite(got).all(), name
        assert np.abs(got - t).max() <= 1e-2 * max(np.abs(t).max(), floor), \
            (name, np.abs(got - t).max() / np.abs(t).max())
        assert np.abs(got - r).max() <= 2e-2 * max(np.abs(r).max(), floor), \
            (name, np.abs(got - r).max() / np.abs(r).max())
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        return
    ts = [torch.from_numpy(x).cuda().float().requires_grad_() for x in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*ts, is_causal=causal).backward(
        torch.from_numpy(do).cuda().float())
    for name, got, t in zip(("dq", "dk", "dv"), grads, ts):
        ref = t.grad.cpu().numpy().astype(np.float64)
        assert np.abs(got - ref).max() <= 2e-2 * max(np.abs(ref).max(), floor), name


@pytest.mark.gpu
@pytest.mark.parametrize("dq", ["atomic", "second-pass"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 128), (1, 2, 256), (2, 1, 640)])
@pytest.mark.parametrize("d", [128, 64])
def test_cuda_backward_on_gpu(d, shape, causal, dq):
    """Whole tiles, the forward's o and lse from the course's Hopper forward."""
    cp = _hopper()
    import kernels.attention as A

    B, H, N = shape
    rng = np.random.default_rng(N + causal + d)
    q, k, v, do = (rng.standard_normal((B, H, N, d)).astype(np.float16) for _ in range(4))
    o, lse = A.flash_wgmma(*(cp.asarray(x) for x in (q, k, v)), causal=causal)
    _check_cuda_backward(cp, q, k, v, do, o, lse, causal, dq)


@pytest.mark.gpu
@pytest.mark.parametrize("dq", ["atomic", "second-pass"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 2, 100), (1, 1, 129), (2, 2, 200), (1, 2, 641)])
@pytest.mark.parametrize("d", [128, 64])
def test_cuda_backward_on_gpu_any_n(d, shape, causal, dq):
    """N not a multiple of the tiles (a part tile of keys in the last block, of queries in the last tile; causal: the
    diagonal through it), several heads so that a tile spilling into the next head's rows would show; o and lse from
    float64 NumPy (the Hopper forward takes whole tiles only)."""
    cp = _hopper()

    B, H, N = shape
    rng = np.random.default_rng(N + 2 * causal + d)
    q, k, v, do = (rng.standard_normal((B, H, N, d)).astype(np.float16) for _ in range(4))
    o, lse = S.attention_spec(q, k, v, causal=causal)
    _check_cuda_backward(cp, q, k, v, do, cp.asarray(o.astype(np.float16)), cp.asarray(lse.astype(np.float32)),
                         causal, dq)


@pytest.mark.gpu
def test_cuda_backward_refuses_what_it_cannot_run():
    cp = _hopper()
    import kernels.attention as A

    z = cp.zeros((1, 1, 128, 128), cp.float16)
    lse = cp.zeros((1, 1, 128), cp.float32)
    with pytest.raises(runtime.CourseInputError, match="head dim 96"):
        y = cp.zeros((1, 1, 128, 96), cp.float16)
        A.flash_backward_wgmma(y, y, y, y, lse, y)
    with pytest.raises(runtime.CourseInputError, match="lse must be"):
        A.flash_backward_wgmma(z, z, z, z, lse.astype(cp.float16), z)
    with pytest.raises(runtime.CourseInputError, match="do must be"):
        A.flash_backward_wgmma(z, z, z, z, lse, z[..., :64])
    with pytest.raises(runtime.CourseInputError, match="dq must be one of"):
        A.flash_backward_wgmma(z, z, z, z, lse, z, dq="twice")


@pytest.mark.gpu
def test_fp8_kernel_errors_follow_numpys():
    """On the GPU as in fp8.error_figures: FP8's error is far above FP16's, and the Hadamard rotation cuts it where
    a few channels of Q and K carry outliers."""
    _hopper()
    from benchmarks import attention as BA

    r = BA.fp8_errors(n=512, heads=2)["rmse"]
    print(r)
    for name, row in r.items():
        assert row["FP8 (CUDA C)"] > 10 * row["FP16 (CUDA C)"], (name, row)
        if BA.CUDNN_FP8 in row:  # where the cuDNN frontend is installed: cuDNN's FP8, within FP8's error too
            assert 10 * row["FP16 (CUDA C)"] < row[BA.CUDNN_FP8] < 3 * row["FP8 (CUDA C)"], (name, row)
    ch = r["outlier channels"]
    assert ch["FP8 + Hadamard (CUDA C)"] < 0.8 * ch["FP8 (CUDA C)"], ch


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_fp8_forward_is_attention_within_fp8s_error(causal):
    """cuDNN's FP8 forward as the benchmark runs it (benchmarks.attention.cudnn_fp8: one scale a tensor, O in
    e4m3), where PyTorch and the cuDNN frontend are installed: O within FP8's error of float64 (its RMSE under twice
    the course's FP8 kernel's on the same inputs, above ten times the FP16 kernel's), the same bits on a second run;
    without the frontend it raises the course's error, which says what to install."""
    cp = _hopper()
    import kernels.attention as A
    from benchmarks import attention as BA

    torch = BA._torch()
    if torch is None:
        pytest.skip("PyTorch with CUDA is not installed")
    q, k, v = (cp.asarray(np.random.default_rng(s).standard_normal((1, 2, 640, 128)).astype(np.float16))
               for s in range(3))
    if BA._cudnn_frontend() is None:
        with pytest.raises(runtime.CourseError, match="pip install nvidia-cudnn-frontend"):
            BA.cudnn_fp8(torch, q, k, v, causal)
        pytest.skip("the cuDNN frontend is not installed")
    run, output = BA.cudnn_fp8(torch, q, k, v, causal)
    o = cp.from_dlpack(output())
    assert o.shape == q.shape and o.dtype == cp.float32
    assert cp.array_equal(o, cp.from_dlpack(output()))
    ref = BA._heads_reference(q, k, v, causal)

    def rmse(x):
        return float(cp.sqrt(cp.mean((x[0].astype(cp.float64) - ref) ** 2)))
    ours, fp16 = rmse(A.flash_fp8(q, k, v, causal=causal)[0]), rmse(A.flash_wgmma(q, k, v, causal=causal)[0])
    assert 10 * fp16 < rmse(o) < 2 * ours, (rmse(o), ours, fp16)


@pytest.mark.parametrize("d", [128, 64])
def test_dq_column_swizzle_spreads_a_warps_stores_over_every_bank(d):
    """The atomic backward's dQ tile in shared memory: a warp stores float2s for lanes (g, q) at row 16 w + g + 8 h,
    columns 64 c + 16 a + 8 b + 2 q (d = 64: 16 a + 8 b + 2 q, each consumer its own tile of 64 columns). Row-major,
    the 8 rows (512 or 256 bytes apart) land on the same 8 banks: 8 wavefronts a store. With the columns XOR 8 (r % 4)
    each bank is hit by 2 lanes' words: the 2 wavefronts 256 bytes need. Every row keeps a permutation of its own
    columns, so a tile stays one contiguous block for the bulk reduction."""
    from kernels.attention.backward_cuda import dq_column_swizzle

    sw = dq_column_swizzle(64, d)
    assert all(sorted(row) == list(range(d)) for row in sw)
    for swizzled, wavefronts in ((False, 8), (True, 2)):
        for w, h, c, a, b in [(w, h, c, a, b) for w in range(4) for h in range(2) for c in range(2)
                              for a in range(4) for b in range(2)]:
            hits = np.zeros(32, int)
            for g in range(8):
                for q in range(4):
                    row, col = 16 * w + g + 8 * h, (64 * c if d == 128 else 0) + 16 * a + 8 * b + 2 * q
                    col = sw[row, col] if swizzled else col
                    for word in (row * d + col, row * d + col + 1):
                        hits[word % 32] += 1
            assert hits.max() == wavefronts, (swizzled, hits)


@pytest.mark.parametrize("d", [128, 64])
def test_dq_column_swizzle_follows_the_row_within_its_tile(d):
    """The kernel swizzles by a row's place in its 64-row tile, and a tile starts at a multiple of 64 rows of its own
    head: in a buffer of heads of N rows (N = 641, not a multiple of 4), row h N + r of the buffer keeps the columns of
    row r % 64 of a tile, not of the flat row h N + r."""
    from kernels.attention.backward_cuda import dq_column_swizzle

    n, heads = 641, 3
    tile = dq_column_swizzle(64, d)
    sw = dq_column_swizzle(heads * n, d, n)
    for h in range(heads):
        assert (sw[h * n:(h + 1) * n] == tile[np.arange(n) % 64]).all(), h
    assert (dq_column_swizzle(n, d) == tile[np.arange(n) % 64]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64])
def test_unswizzle_dq_on_gpu_matches_the_swizzle(d):
    """unswizzle_dq (one CuPy pass) gathers each element from where dq_column_swizzle says the kernel put it, for
    heads of N rows with N not a multiple of 4."""
    cp = _hopper()
    from kernels.attention.backward_cuda import dq_column_swizzle, unswizzle_dq

    n, heads = 641, 3
    want = np.random.default_rng(d).standard_normal((heads * n, d)).astype(np.float32)
    acc = np.empty_like(want)
    cols = dq_column_swizzle(heads * n, d, n)
    acc[np.arange(heads * n)[:, None], cols] = want
    got = unswizzle_dq(cp.asarray(acc), d, n).get()
    assert got.dtype == np.float16 and (got == want.astype(np.float16)).all()

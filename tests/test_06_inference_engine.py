"""Lesson 6: the engine's graph, passes, calibration, plan file and runtime against NumPy and Keras; the numba
CBR kernel in the simulator; the CUDA C kernels compiled to PTX without a GPU; the recorded figures against
the lesson's targets; and on a GPU every kernel against the NumPy runtime."""
import json
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from benchmarks import inference_engine as bench_lesson
from conftest import needs_compiler
from gpucourse import records, runtime
from gpucourse import cuda_c
from kernels import inference_engine as E

pytestmark = pytest.mark.lesson06
LESSON = "06_inference_engine"
cuda = runtime.cuda()


@pytest.fixture(scope="module")
def model():
    g, data = E.load_model_file()
    return g, E.optimize(g), E.dataset(data)


@pytest.fixture(scope="module")
def plans(model):
    """Fused plans in each precision and the layer-by-layer FP32 plan, for this mode's runtime (untuned)."""
    g, stages, d = model
    out = {p: E.build_plan(stages[-1][1], precision=p, max_batch=128, x_calib=d["x_calib"], tune=False)
           for p in E.PRECISIONS}
    out["unfused"] = E.build_plan(g, precision="fp32", max_batch=128, tune=False)
    return out


def _acc(logits, y):
    return float(np.mean(np.asarray(logits).argmax(1) == y))


# ---------------------------------------------------------------------------- graph and passes

def test_imported_graph_reproduces_keras(model):
    g, _, d = model
    assert abs(np.abs(E.run_graph(g, d["x_test"]) - d["keras_logits"]).max()) < 1e-4
    assert g.ops() == {"Conv": 7, "BatchNorm": 1, "BiasAdd": 6, "Relu": 7, "MaxPool": 1, "Concat": 1, "AvgPool": 1,
                       "Flatten": 1, "Dense": 1}
    assert d["keras_accuracy"] > 0.95 and len(d["y_test"]) == 397


def test_every_pass_preserves_the_output_and_does_its_job(model):
    g, stages, d = model
    x = d["x_test"][:50]
    want = E.run_graph(g, x)
    for name, s in stages:
        assert np.abs(E.run_graph(s, x) - want).max() < 1e-9 * max(1, np.abs(want).max()) * 1e4, name
    ops = {name: s.ops() for name, s in stages}
    assert "BatchNorm" not in ops["batch-norm folding"] and ops["batch-norm folding"]["BiasAdd"] == 7
    assert ops["vertical fusion"] == {"CBR": 7, "MaxPool": 1, "Concat": 1, "Head": 1}
    assert ops["horizontal fusion"]["CBR"] == 5
    fused = stages[-1][1]
    assert "Concat" not in ops["concatenation elimination"]
    wide = next(n for n in fused.nodes if "+" in n.name)
    assert wide.attrs["kh"] == 1 and sum(wide.attrs["splits"]) == 80 and len(wide.outputs) == 3
    offsets = sorted(off for _, off in fused.aliases.values())
    assert offsets == [0, 32, 64, 80]


def test_passes_do_not_change_their_input(model):
    g, _, _ = model
    before = str(g)
    for _, fn in E.PASSES:
        fn(g)
    assert str(g) == before


def test_fold_bn_weights_matches_conv_then_batchnorm(rng):
    x = rng.standard_normal((2, 5, 6, 3))
    w = rng.standard_normal((3, 3, 3, 4)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    gamma, beta, mean = rng.standard_normal(4), rng.standard_normal(4), rng.standard_normal(4)
    var = rng.random(4) + 0.1
    for bias in (b, None):
        want = E.batchnorm_spec(E.conv_spec(x, w) + (0 if bias is None else bias), gamma, beta, mean, var, 1e-3)
        w2, b2 = E.fold_bn_weights(w, bias, gamma, beta, mean, var, 1e-3)
        assert w2.dtype == np.float32 and w2.shape == w.shape and b2.shape == (4,)
        assert np.abs(E.conv_spec(x, w2) + b2 - want).max() < 1e-4


def test_cbr_spec_is_conv_bias_relu(rng):
    x = rng.standard_normal((1, 4, 4, 2))
    w = rng.standard_normal((1, 1, 2, 3))
    b = rng.standard_normal(3)
    direct = np.einsum("nhwc,ck->nhwk", x, w[0, 0]) + b
    assert np.allclose(E.cbr_spec(x, w, b), np.maximum(direct, 0))
    assert np.allclose(E.cbr_spec(x, w, b, relu=False), direct)


# ------------------------------------------------------------------------------------ INT8

def test_quantize_rounds_to_even_and_saturates():
    q = E.quantize(np.array([0.5, 1.5, -2.5, 300.0, -300.0, 0.26], np.float32), 1.0)
    assert q.dtype == np.int8 and q.tolist() == [0, 2, -2, 127, -127, 0]
    x = np.linspace(-1, 1, 1001).astype(np.float32)
    s = E.minmax_scale(x)
    assert s == pytest.approx(1 / 127)
    assert np.abs(E.dequantize(E.quantize(x, s), s) - x).max() <= s / 2 + 1e-7
    assert E.minmax_scale(np.zeros(5)) == 1.0


def test_e4m3_codes_round_to_even_and_saturate():
    """FP8 e4m3, as the GPU's cvt.rn.satfinite: 3 mantissa bits, bias 7, subnormals, +-448 at most, no infinity."""
    from kernels.inference_engine.precision import E4M3, from_e4m3, to_e4m3

    assert E4M3[0x38] == 1.0 and E4M3[0x7E] == 448.0 and E4M3[0x01] == 2.0 ** -9 and E4M3[0xB8] == -1.0
    assert np.isnan(E4M3[0x7F]) and np.isnan(E4M3[0xFF])
    finite = np.arange(256)[~np.isnan(E4M3)].astype(np.uint8)
    assert np.array_equal(from_e4m3(to_e4m3(from_e4m3(finite))), from_e4m3(finite))  # every value is its own code
    x = np.array([1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -11, 460.0, 1e9, -1e9, 0.3], np.float32)
    # halfway cases go to the even code (1.0, 1.25, 0); past 448 saturates; 0.3 to its nearest, 0.3125
    assert from_e4m3(to_e4m3(x)).tolist() == [1.0, 1.25, 0.0, 2.0 ** -9, 448.0, 448.0, -448.0, 0.3125]
    assert to_e4m3(np.array([np.nan], np.float32))[0] == 0x7F


def test_percentile_and_entropy_clip_outliers(rng):
    x = np.concatenate([rng.standard_normal(100_000), [60.0]])
    m, p, e = E.minmax_scale(x), E.percentile_scale(x), E.entropy_scale(x)
    assert m == pytest.approx(60 / 127)
    assert p < m / 5 and e < m / 2
    with pytest.raises(runtime.CourseInputError, match="calibration"):
        E.calibrate(E.load_model_file()[0], np.zeros((1, 16, 16, 1), np.float32), "mse")


def test_entropy_calibration_leaves_a_relus_zeros_out(rng):
    """A ReLU's output is half exact zeros: with them in the histogram's first bin, the divergence of every threshold
    was a question of that one bin, and entropy calibration clipped at ~40% of the largest value (ResNet-50's
    activations); its first bin counted as its second (NVIDIA's calibrator's bins[0] = bins[1]), the zeros do not
    move the threshold."""
    relu = np.maximum(rng.standard_normal(200_000), 0)
    assert E.entropy_scale(relu) == pytest.approx(E.entropy_scale(relu[relu > 0]), rel=0.02)
    assert E.entropy_scale(relu) > 0.6 * E.minmax_scale(relu)


# ------------------------------------------------------------------------------------ runtime (this mode)

def test_fp32_engine_matches_keras_tightly(model, plans):
    _, _, d = model
    for key in ("fp32", "unfused"):
        logits = E.predict(E.Engine(plans[key]), d["x_test"])
        assert np.abs(logits - d["keras_logits"]).max() < 1e-3, key


def test_fp16_and_int8_within_one_point_of_fp32(model, plans):
    _, stages, d = model
    acc = {p: _acc(E.predict(E.Engine(plans[p]), d["x_test"]), d["y_test"]) for p in E.PRECISIONS}
    assert acc["fp16"] >= acc["fp32"] - 0.01 and acc["int8"] >= acc["fp32"] - 0.01, acc  # at most 1 point lost
    for method in ("minmax", "entropy"):
        plan = E.build_plan(stages[-1][1], precision="int8", max_batch=128, x_calib=d["x_calib"],
                            calibration=method, tune=False)
        assert _acc(E.predict(E.Engine(plan), d["x_test"]), d["y_test"]) >= acc["fp32"] - 0.01, method
    assert plans["int8"].arrays["1/w"].dtype == np.int8 and plans["fp16"].arrays["1/w"].dtype == np.float16


def test_launch_counts(model, plans):
    _, _, d = model
    assert plans["unfused"].launches == 29 and plans["fp32"].launches == 8
    assert plans["fp32"].header["graphs"] and plans["fp32"].host_launches == 1
    eng = E.Engine(plans["fp32"], graphs=False)
    eng.infer(d["x_test"][:3])
    eng.infer(d["x_test"][:1])
    assert eng.launches == eng.host_launches == 2 * 8


def test_kernel_fits_needs_channels_in_eights(plans):
    convs = [s for s in plans["fp16"].steps if s["kind"] == "conv"]
    stem = convs[0]
    assert stem["src"]["C"] == 1 and not E.kernel_fits(stem, "wmmav_64x32") and E.kernel_fits(stem, "wmma_64x32")
    assert all("wmmav" not in k for k in E.candidates(stem, "fp16"))
    big = [s for s in convs if s["kh"] > 1 and s["src"]["C"] > 1]
    assert big and all(E.kernel_fits(s, "wmmav_64x32") for s in big)
    own = [k for k in E.CANDIDATES["fp32"]
           if (k not in E.DIRECT or E.DIRECT[k][0] == big[0]["kh"]) and not k.startswith("pix")]
    assert E.candidates(big[0], "fp32") == own and len(own) < len(E.CANDIDATES["fp32"])


def test_pipelined_and_one_pixel_kernels_fit_where_their_loads_do(plans):
    """tc kernels load 16 bytes at once: 8 halves or 16 int8 of input channels and of output channels; a pix
    kernel keeps the whole reduction (KH KW C <= 64) in shared memory: the stem's, not a 3x3 over 32 channels."""
    convs = {s["name"]: s for s in plans["fp16"].steps if s["kind"] == "conv"}
    stem, b3 = convs["stem"], convs["branch3x3"]
    for p in ("fp32", "fp16", "int8"):
        assert E.kernel_fits(stem, "pix_32", p) and not E.kernel_fits(b3, "pix_32", p)
        assert not any(k.startswith("tc") for k in E.candidates(stem, p))
    assert E.kernel_fits(b3, "tc_64x32", "fp16") and E.kernel_fits(b3, "tc_64x32", "int8")
    odd = {**b3, "K": 24}  # 24 channels: 3 loads of 8 halves, not a whole number of 16 int8
    assert E.kernel_fits(odd, "tc_64x32", "fp16") and not E.kernel_fits(odd, "tc_64x32", "int8")
    shifted = {**b3, "src": {**b3["src"], "off": 8}}  # starts 8 values into a pixel: 16 bytes of half only
    assert E.kernel_fits(shifted, "tc_64x32", "fp16") and not E.kernel_fits(shifted, "tc_64x32", "int8")
    assert not any(k.startswith("tc") for k in E.CANDIDATES["fp32"])
    # the direct tensor-core kernels: their kernel size, images at most 16 wide, whole fragments of 16 channels
    b5 = convs["branch5x5"]
    for p in ("fp16", "int8"):
        assert E.kernel_fits(b3, "tcd3_8x32_c32", p) and not E.kernel_fits(b5, "tcd3_8x32_c32", p)
        assert E.kernel_fits(b5, "tcd5_8x16_c16", p) and not E.kernel_fits(b3, "tcd5_8x16_c16", p)  # 32 > CMAX 16
        assert not E.kernel_fits({**b3, "src": {**b3["src"], "W": 17}}, "tcd3_8x32_c32", p)
        assert not E.kernel_fits({**b3, "src": {**b3["src"], "C": 24}}, "tcd3_8x32_c32", p)
    assert E.CONV_KERNELS["tcd3_8x32_c32"] == (128, 32, 128)


def test_direct_kernels_run_only_their_kernel_size(plans):
    """A direct convolution is compiled for one kernel size: it is a candidate for those layers only, and its
    block (TH x TW pixels x BN channels, one thread per TM x TN of them) fits the launcher's table."""
    convs = [s for s in plans["fp32"].steps if s["kind"] == "conv"]
    sizes = {s["kh"] for s in convs}
    assert {3, 5} <= sizes and {ks for ks, *_ in E.DIRECT.values()} == {3, 5}
    for s in convs:
        direct = [k for k in E.candidates(s, "fp32") if k in E.DIRECT]
        assert direct == [k for k, v in E.DIRECT.items() if v[0] == s["kh"]], s["name"]
        assert [k for k in E.candidates(s, "int8") if not k.startswith("tc")] == E.candidates(s, "fp32")
    for k, (ks, th, tw, bn, tm, tn) in E.DIRECT.items():
        assert tw % tm == 0 and bn % tn == 0 and k in E.SIMT
        assert E.CONV_KERNELS[k] == (th * tw, bn, th * (tw // tm) * (bn // tn)) and E.CONV_KERNELS[k][2] <= 256


def test_engine_checks_its_input(plans):
    eng = E.Engine(plans["fp32"])
    with pytest.raises(runtime.CourseInputError, match="N x 16 x 16 x 1"):
        eng.infer(np.zeros((2, 8, 8, 1), np.float32))
    with pytest.raises(runtime.CourseInputError, match="float32"):
        eng.infer(np.zeros((2, 16, 16, 1), np.float64))
    with pytest.raises(runtime.CourseInputError, match="1 to 128"):
        eng.infer(np.zeros((129, 16, 16, 1), np.float32))


def test_builder_checks_its_input(model):
    g, stages, d = model
    with pytest.raises(runtime.CourseInputError, match="precision"):
        E.build_plan(g, precision="bf16")
    with pytest.raises(runtime.CourseInputError, match="x_calib"):
        E.build_plan(stages[-1][1], precision="int8")
    with pytest.raises(runtime.CourseInputError, match="FP8 needs x_calib"):
        E.build_plan(stages[-1][1], precision="fp8")
    # FP8 runs on the Hopper kernels only, which take whole slices of 64 input channels: the digits' stem has 1
    with pytest.raises(runtime.CourseError, match=r"node 'stem': FP8 convolutions run on the Hopper wgmma kernels "
                                                  r"only.*this one has 1"):
        E.build_plan(stages[-1][1], precision="fp8", x_calib=d["x_calib"][:8], tune=False)
    with pytest.raises(runtime.CourseError, match="fused into its convolution"):
        E.build_plan(g, precision="int8", x_calib=d["x_calib"][:8])
    with pytest.raises(runtime.CourseInputError, match="max_batch"):
        E.build_plan(g, max_batch=0)


# ------------------------------------------------------------------------------------ the plan file

def test_plan_reloads_without_rebuilding(model, plans, tmp_path):
    _, _, d = model
    path = plans["int8"].save(tmp_path / "digits.plan")
    again = E.load_plan(path)
    assert again.header["steps"] == plans["int8"].header["steps"]
    assert np.array_equal(E.predict(E.Engine(again), d["x_test"][:40]),
                          E.predict(E.Engine(plans["int8"]), d["x_test"][:40]))


def _rewrite(path, edit_header=None, edit_arrays=None):
    with np.load(path, allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files}
    header = json.loads(bytes(arrays.pop("header")).decode())
    if edit_header:
        edit_header(header)
    if edit_arrays:
        edit_arrays(arrays)
    with open(path, "wb") as f:
        np.savez(f, header=np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays)


def test_bad_plans_are_refused(plans, tmp_path):
    def fresh(name):
        return plans["fp32"].save(tmp_path / name)

    p = fresh("truncated.plan")
    p.write_bytes(p.read_bytes()[:500])
    with pytest.raises(runtime.CourseError, match="not a readable plan file"):
        E.load_plan(p)
    p = tmp_path / "text.plan"
    p.write_text("hello")
    with pytest.raises(runtime.CourseError, match="not a plan file"):
        E.load_plan(p)
    p = fresh("weights.plan")
    _rewrite(p, edit_arrays=lambda a: a.__setitem__("a/1/w", a["a/1/w"] * 1.001))
    with pytest.raises(runtime.CourseError, match="checksum mismatch"):
        E.load_plan(p)
    p = fresh("relu.plan")
    _rewrite(p, edit_header=lambda h: h["steps"][1].__setitem__("relu", False))
    with pytest.raises(runtime.CourseError, match="checksum mismatch"):
        E.load_plan(p)
    p = fresh("version.plan")
    _rewrite(p, edit_header=lambda h: h.__setitem__("format", E.PLAN_FORMAT + 1))
    with pytest.raises(runtime.CourseError, match=f"format version {E.PLAN_FORMAT + 1}"):
        E.load_plan(p)
    p = fresh("magic.plan")
    _rewrite(p, edit_header=lambda h: h.__setitem__("magic", "TRT"))
    with pytest.raises(runtime.CourseError, match="not a plan of this engine"):
        E.load_plan(p)


def test_plan_for_another_gpu_is_refused(plans, tmp_path):
    other = E.Plan(dict(plans["fp32"].header, target={"kind": "gpu", "name": "NVIDIA A100-SXM4-80GB",
                                                      "compute_capability": "8.0"}), plans["fp32"].arrays)
    path = other.save(tmp_path / "a100.plan")
    here = E.this_target()["name"]
    if here == other.header["target"]["name"]:
        pytest.skip("this machine is the other GPU")
    with pytest.raises(runtime.CourseError, match=r"built for NVIDIA A100-SXM4-80GB \(compute capability 8.0\)"):
        E.load_plan(path)
    with pytest.raises(runtime.CourseError, match="rebuild the plan here"):
        E.Engine(other)


def test_damaged_zip_member_is_refused(plans, tmp_path):
    p = plans["fp16"].save(tmp_path / "flip.plan")
    raw = bytearray(p.read_bytes())
    with zipfile.ZipFile(p) as z:
        info = z.getinfo("a/1/w.npy")
    raw[info.header_offset + 100] ^= 0xFF  # inside the stored weights: the zip's CRC check fails
    p.write_bytes(bytes(raw))
    with pytest.raises(runtime.CourseError, match="not a readable plan file|checksum mismatch"):
        E.load_plan(p)


# ------------------------------------------------------------------------------------ Keras import

@pytest.fixture(scope="module")
def keras_model():
    pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(3)
    return keras, E.build_keras_model()


def test_graph_from_keras_reproduces_an_untrained_model(keras_model, rng):
    keras, m = keras_model
    x = rng.random((4, 16, 16, 1), dtype=np.float32)
    want = np.asarray(m.predict(x, verbose=0))
    g = E.graph_from_keras(m)
    assert np.abs(E.run_graph(g, x) - want).max() < 1e-4
    assert np.abs(E.run_graph(E.optimize(g)[-1][1], x) - want).max() < 1e-4


def test_unsupported_layers_name_themselves(keras_model):
    keras, _ = keras_model
    from keras import layers

    inp = keras.Input((16, 16, 1))
    x = layers.Conv2D(4, 3, padding="same")(inp)
    bad = keras.Model(inp, layers.Dense(10)(layers.Flatten()(layers.Dropout(0.5, name="drop")(x))))
    with pytest.raises(runtime.CourseError, match=r"layer 'drop' \(Dropout\) is not supported"):
        E.graph_from_keras(bad)
    dilated = keras.Model(inp, layers.Conv2D(4, 3, dilation_rate=2, name="dilated")(inp))
    with pytest.raises(runtime.CourseError, match=r"layer 'dilated' \(Conv2D\): strides .* dilation"):
        E.graph_from_keras(dilated)
    sig = keras.Model(inp, layers.Conv2D(4, 3, padding="same", activation="sigmoid", name="sig")(inp))
    with pytest.raises(runtime.CourseError, match="activation 'sigmoid'"):
        E.graph_from_keras(sig)


# ------------------------------------------------------------------------------------ numba CBR kernel

def _device(x):
    return runtime.cupy().asarray(x) if runtime.is_gpu() else cuda.to_device(x)


def _host(x):
    return x.get() if hasattr(x, "get") and not hasattr(x, "copy_to_host") else x.copy_to_host()


@pytest.mark.parametrize("shape", [(1, 5, 6, 3, 4, 3), (2, 4, 4, 2, 3, 1), (1, 3, 3, 1, 2, 5)])
def test_numba_cbr_matches_spec(rng, shape):
    n, h, w, c, k, ks = shape
    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    wt = rng.standard_normal((ks, ks, c, k)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    y = _device(np.full((n, h, w, k), np.nan, np.float32))
    E.cbr_numba(_device(x), _device(wt), _device(b), y)
    assert np.abs(_host(y) - E.cbr_spec(x, wt, b)).max() < 1e-4


def test_numba_cbr_checks_its_input():
    x = _device(np.zeros((1, 4, 4, 2), np.float32))
    w = _device(np.zeros((3, 3, 2, 3), np.float32))
    b = _device(np.zeros(3, np.float32))
    with pytest.raises(runtime.CourseInputError, match="device array"):
        E.cbr_numba(np.zeros((1, 4, 4, 2), np.float32), w, b, _device(np.zeros((1, 4, 4, 3), np.float32)))
    with pytest.raises(runtime.CourseInputError, match="KH x KW x 2 x K"):
        E.cbr_numba(x, _device(np.zeros((2, 2, 2, 3), np.float32)), b, _device(np.zeros((1, 4, 4, 3), np.float32)))
    with pytest.raises(runtime.CourseInputError, match="y"):
        E.cbr_numba(x, w, b, _device(np.zeros((1, 4, 4, 2), np.float32)))
    with pytest.raises(runtime.CourseInputError, match="dtype"):
        E.cbr_numba(x, w, b, _device(np.zeros((1, 4, 4, 3), np.float64)))


@needs_compiler
@pytest.mark.parametrize("arch", ["sm_80", pytest.param("sm_90", marks=pytest.mark.archs)])  # sm_90: make test only
def test_cuda_c_compiles(arch):
    ptx = cuda_c.compile_ptx(E.SOURCE, arch)
    for k in E.CONV_KERNELS:
        for p in E.CANDIDATES:
            if k in E.CANDIDATES[p]:
                assert f".entry conv_{k}_{E.SUFFIX[p]}(" in ptx
    assert "wmma.mma.sync" in ptx and ".entry head_i8(" in ptx and ".entry concat_copy_f16(" in ptx
    # INT8 on the integer tensor cores, in the row.col form their mma has; FP16 tiles fed by cp.async
    tc_i8 = ptx.split(".entry conv_tc_64x32_i8(")[1].split(".entry ")[0]
    assert "wmma.mma.sync.aligned.row.col.m16n16k16.s32.s8.s8.s32" in tc_i8 and "cp.async.cg.shared.global" in tc_i8
    tcd_i8 = ptx.split(".entry conv_tcd3_8x32_c32_i8(")[1].split(".entry ")[0]
    assert "wmma.mma.sync.aligned.row.col.m16n16k16.s32.s8.s8.s32" in tcd_i8
    tc_f16 = ptx.split(".entry conv_tc_64x32_f16(")[1].split(".entry ")[0]
    assert "wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32" in tc_f16 and "cp.async.wait_group 1" in tc_f16
    direct = {line.split("conv_", 1)[1].split("(")[0] for line in ptx.splitlines() if ".entry conv_direct" in line}
    assert direct == {f"{k}_{E.SUFFIX[p]}" for k in E.DIRECT for p in E.PRECISIONS}  # the table is the source's
    # FP8 plans: their convolutions are the Hopper kernels', the rest these (e4m3 codes converted by cuda_fp8.h)
    assert all(f".entry {k}_f8(" in ptx for k in ("convert_in_im2col", "maxpool_pad", "global_pool"))


# ----------------------------------------------- what a GPU recorded, against the lesson's targets (either mode)

@pytest.fixture(scope="module")
def record():
    rec = records.latest(LESSON)
    if rec is None:
        pytest.skip("no GPU record of lesson 6 yet")
    return rec


def test_recorded_engines_are_right(record):
    t = record["figures"]["engines"]
    rows = {r["name"]: r for r in t["rows"]}
    assert record["gpu"]["name"].startswith("NVIDIA")
    assert rows["fused, FP32"]["max_diff_keras"] < 1e-3 and rows["layer by layer, FP32"]["max_diff_keras"] < 1e-3
    fp32 = rows["fused, FP32"]["accuracy"]
    for name in ("fused, FP16", "fused + graph, FP16", "fused + graph, INT8", "layer by layer, FP16"):
        assert rows[name]["accuracy"] >= fp32 - 0.01, name
    assert rows["fused + graph, FP32"]["accuracy"] == fp32  # the same kernels, launched another way
    network = {name for name in bench_lesson.ENGINES if name.startswith(bench_lesson.NETWORK)}
    assert set(rows) <= set(bench_lesson.ENGINES) and set(bench_lesson.ENGINES) - set(rows) <= network  # older records
    for name in network & set(rows):  # the bound: within half a point of FP32
        assert rows[name]["accuracy"] >= fp32 - 0.005 and rows[name]["max_diff_keras"] < 0.5, name
    for r in t["rows"]:  # counted by the runtime at batch 1 and at the max batch
        kernels = 1 if r.get("network") else 8 if r["fused"] else 29
        assert r["kernels"] == r["kernels_batch"] == r["plan_kernels"] == kernels, r["name"]
        assert r["host_launches"] == r["host_launches_batch"] == (1 if r["graphs"] else kernels), r["name"]
    for r in record["figures"]["calibration"]["rows"]:
        assert r["accuracy"] >= fp32 - 0.01, r
    assert record["figures"]["plan"]["same_logits"]


def test_recorded_ratios_are_the_rows(record):
    """The ratios the lesson quotes are recomputed from the rows of the same run, not stored separately."""
    t = record["figures"]["engines"]
    assert t["ratios"] == pytest.approx(bench_lesson.ratios(t["rows"]))
    assert t["targets"] == {"optimised_vs_layer": 2.0, "fp16_vs_fp32": 1.5}


def test_recorded_speedups(record):
    """The lesson's targets, checked against the record: the optimised engine (fused + CUDA graph) at least
    2x layer-by-layer execution at batch 1 and at batch 256, in FP32 and FP16, and FP16 at least 1.5x FP32 at
    batch 256. Each target the record meets is asserted at its full value; for one it misses, the notebook
    says so (engine_text prints "NOT met"), and the test checks only what the lesson then claims: the
    figures are consistent with each other (graphs never slow an engine down much, fusion and graphs
    together beat either alone, FP16 is faster than FP32)."""
    t = record["figures"]["engines"]
    q = t["ratios"]
    met = bench_lesson.targets_met(t)
    for what, (ratio, goal, ok) in met.items():
        assert ok == (ratio >= goal), what
    # fusion and graphs together reach the 2x target at batch 1 (launches dominate) and at batch 256 (fusion
    # removes the passes around the convolutions), in both precisions
    for p in ("fp32", "fp16"):
        assert q[f"optimised_vs_layer_{p}_latency"] >= 2.0 and q[f"optimised_vs_layer_{p}_batch"] >= 2.0, q
    for p in ("fp32", "fp16"):
        for w in ("latency", "batch"):
            assert q[f"optimised_vs_layer_{p}_{w}"] >= max(q[f"fusion_{p}_{w}"], q[f"graphs_{p}_{w}"]) * 0.95, (p, w)
            assert q[f"graphs_{p}_{w}"] > 0.9 and q[f"fusion_{p}_{w}"] > 1.0, (p, w)
        assert q[f"graphs_{p}_latency"] > 1.2, p  # at batch 1 one host launch instead of 8 must show
    assert q["fp16_vs_fp32_batch"] > 1.0 and q["fp16_vs_fp32_batch_gpu"] > 1.0, q
    tuning = record["figures"]["tuning"]
    for rows in tuning.values():
        for r in rows:
            assert r["kernel"] == min(r["tuning_ms"], key=r["tuning_ms"].get)
            assert not r["rejected"], r  # every candidate computed the right logits
    fp16 = {r["layer"]: r["kernel"] for r in tuning["fused, FP16"]}
    assert fp16["branch3x3"].startswith(("wmma", "tc")) and fp16["branch5x5"].startswith(("wmma", "tc"))
    if any(r["kernel"].startswith("tc") for rows in tuning.values() for r in rows):  # recorded with them
        int8 = {r["layer"]: r["kernel"] for r in tuning["fused, INT8"]}  # on the integer tensor cores
        assert int8["branch3x3"].startswith("tc") and int8["branch5x5"].startswith("tc"), int8
    for name in ("fused, FP32", "layer by layer, FP32"):  # the direct kernels win the FP32 3x3 and 5x5 layers
        fp32 = {r["layer"]: r["kernel"] for r in tuning[name]}
        assert fp32["branch3x3"].startswith("direct3") and fp32["branch5x5"].startswith("direct5"), name


def test_recorded_targets_as_the_lesson_states_them(record):
    """Which targets the record meets, as the notebook states them: every one but FP16 over FP32 at batch 256.
    FP16 is still faster, but the direct FP32 kernels brought the two large convolutions within 1.5x of the
    tensor-core kernels (the tuning table), so FP16's lead over FP32 is under 1.5x there too. The notebook
    prints the figures from targets_met and the two convolutions' times."""
    t = record["figures"]["engines"]
    met = bench_lesson.targets_met(t)
    assert len(met) == 5
    missed = {what: ratio for what, (ratio, _, ok) in met.items() if not ok}
    assert set(missed) <= {f"FP16 over FP32 (fused + graph), batch {t['rows'][0]['batch']}"}, missed
    for ratio in missed.values():
        assert 1.0 < ratio < 1.5, missed
        big = {p: sum(r["tuning_ms"][r["kernel"]] for r in record["figures"]["tuning"][f"fused, {p}"]
                      if r["layer"] in ("branch3x3", "branch5x5")) for p in ("FP32", "FP16")}
        assert 1.0 < big["FP32"] / big["FP16"] < 1.5, big
    text = bench_lesson.engine_text(record["figures"]["engines"])
    for what, (_, _, ok) in met.items():
        assert f"target {what}:" in text and ("NOT met" in text.split(f"target {what}:")[1].split("\n")[0]) != ok


def test_recorded_cudnn_comparison(record):
    c = record["figures"]["cudnn"]
    if not c["available"]:
        pytest.skip(c["why"])
    for r in c["rows"]:
        assert r["status"] == "ok" and r["cudnn_error"] < (1e-5 if r["dtype"] == "float32" else 2e-3), r
        ok = {a: v["ms"] for a, v in r["algorithms"].items() if v["status"] == "ok"}
        assert r["cudnn_algo"] in ok and r["cudnn_ms"] == min(ok.values()), r  # cuDNN's fastest allowed algorithm
        assert "hold" in r["timing"]


# ------------------------------------------------------------------------------------ on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("precision", E.PRECISIONS)
def test_every_conv_kernel_matches_the_numpy_runtime(model, precision):
    _, stages, d = model
    x = d["x_test"][:100]
    plan = E.build_plan(stages[-1][1], precision=precision, max_batch=128, x_calib=d["x_calib"], tune=False)
    want = None
    for kernel in E.CANDIDATES[precision]:
        for s in plan.steps:
            if s["kind"] == "conv":
                s["kernel"] = kernel if E.kernel_fits(s, kernel, precision) else E.DEFAULT_KERNEL[precision]
        got = E.predict(E.Engine(plan), x)
        ref = E.run_graph(stages[-1][1], x)
        if precision == "fp32":
            assert np.abs(got - ref).max() < 1e-3, kernel
        else:
            assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max() + 0.5, kernel
            assert _acc(got, d["y_test"][:100]) >= _acc(ref, d["y_test"][:100]) - 0.02, kernel
        if want is None:
            want = got
        elif precision != "fp16" or "wmma" not in kernel:
            assert np.abs(got - want).max() < (1e-4 if precision == "fp32" else 0.05 * np.abs(want).max()), kernel


@pytest.mark.gpu
def test_gpu_int8_matches_numpy_int8_arithmetic(model):
    """The same INT8 plan through the CUDA kernels and through NumPy: identical integer arithmetic, so the
    logits agree to float rounding of the epilogue (a rare code one step apart)."""
    _, stages, d = model
    plan = E.build_plan(stages[-1][1], precision="int8", max_batch=128, x_calib=d["x_calib"], tune=False)
    got = E.predict(E.Engine(plan), d["x_test"][:128])
    eng = E.Engine(plan, numpy=True)
    want = E.predict(eng, d["x_test"][:128])
    assert np.median(np.abs(got - want)) < 1e-3 and np.abs(got - want).max() < 0.1 * np.abs(want).max()


@pytest.mark.gpu
def test_autotune_times_every_candidate(model):
    _, stages, d = model
    plan = E.build_plan(stages[-1][1], precision="fp16", max_batch=64, tune=True)
    for s in plan.steps:
        if s["kind"] == "conv":
            assert set(s["tuning"]) == set(E.candidates(s, "fp16")) and not s["rejected"]
            first = sorted(s["tuning"], key=s["tuning"].get)  # finalists timed again may have moved
            assert set(s["finalists"]) <= set(first) and len(s["finalists"]) == min(E.tuning.FINALISTS, len(first))
            assert s["kernel"] == min(s["finalists"], key=s["tuning"].get)
    assert any(s["kernel"].startswith("wmma") for s in plan.steps if s["kind"] == "conv")


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_graph_replay_matches_eager(model, fused):
    """A plan run as one captured CUDA graph gives the eager launches' logits exactly (the same kernels on
    the same buffers), for several batch sizes (one graph each), with 1 host launch per inference, and an
    input outside the engine's buffer is copied in (1 more launch)."""
    _, stages, d = model
    g = stages[-1][1] if fused else stages[0][1]
    plan = E.build_plan(g, precision="fp16", max_batch=64, tune=False)
    eager, graph = E.Engine(plan, graphs=False), E.Engine(plan)
    assert graph.graphs and not eager.graphs
    kernels = 8 if fused else 29
    for n in (64, 5, 1, 5):
        x = d["x_test"][:n]
        want = eager.infer(x).get()
        buf = graph.input_buffer(n)
        buf[...] = runtime.cupy().asarray(x)
        k0, h0 = graph.launches, graph.host_launches
        got = graph.infer(buf).get()
        assert np.array_equal(got, want), n
        assert (graph.launches - k0, graph.host_launches - h0) == (kernels, 1)
        got = graph.infer(runtime.cupy().asarray(d["x_test"][n:2 * n])).get()
        assert np.array_equal(got, eager.infer(d["x_test"][n:2 * n]).get())
    assert sorted(graph._graph) == [1, 5, 64]
    assert graph.host_launches == 4 * 2 + 4  # a graph launch per inference, a copy for each foreign input
    assert eager.host_launches == eager.launches == 8 * kernels


@pytest.mark.gpu
def test_numba_cbr_on_gpu_at_size(rng):
    n, h, w, c, k = runtime.size("inference_engine.cbr_shape")
    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    wt = rng.standard_normal((3, 3, c, k)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    y = _device(np.full((n, h, w, k), np.nan, np.float32))
    E.cbr_numba(_device(x), _device(wt), _device(b), y)
    assert np.abs(_host(y) - E.cbr_spec(x, wt, b)).max() < 1e-3


# ------------------------------------------------------------------------- per-layer precision (a mixed plan)

@pytest.mark.parametrize("kept", ["stem", "after the stem"])
def test_a_mixed_plan_reformats_where_the_precision_changes(model, kept):
    """An INT8 plan of the digits network with some layers kept in FP16 (build_plan's keep_fp16, TensorRT's per-layer
    precision): each tensor is stored in its writer's precision, FP16 ones in a second arena; where a reader of the
    other precision reads it, a reformat step writes its copy first, quantised with the tensor's calibrated scale
    (FP16 -> INT8) or dequantised (INT8 -> FP16), exactly as the kernels' store rounds; every convolution then gives
    what its spec gives on the values it read; and the plan classifies within a point of FP32."""
    from kernels.inference_engine.build import _root  # noqa: F401

    _, stages, d = model
    g = stages[-1][1]
    rest = [n.name for n in g.nodes if n.op == "CBR" and n.name != "stem"]
    keep = ["stem"] if kept == "stem" else rest
    plan = E.build_plan(g, precision="int8", max_batch=128, x_calib=d["x_calib"], tune=False, keep_fp16=keep)
    assert plan.header["precision"] == "int8" and plan.header["arena_fp16"] > 0
    assert plan.header["layer_precisions"] == {name: "fp16" for name in keep}
    reformats = [s for s in plan.steps if s["kind"] == "reformat"]
    if kept == "stem":  # the stem's FP16 output quantised once for its INT8 readers; the max pool reads it as it is
        # (FP16, as its output), which the INT8 projection after it reads quantised
        assert [(s["name"], s["from"], s["to"]) for s in reformats] == [("stem_relu:fp16->int8", "fp16", "int8"),
                                                                         ("branch_pool:fp16->int8", "fp16", "int8")]
    else:  # the INT8 stem's output dequantised for the FP16 layers, and the max pool's (INT8: it keeps its input's)
        assert {(s["from"], s["to"]) for s in reformats} == {("int8", "fp16")}
    eng = E.Engine(plan, numpy=True)
    x = d["x_test"][:16]
    eng._x = x
    a = plan.arrays
    for s in plan.steps:
        eng.run_step(s["id"], len(x))
        p = s.get("precision", "int8")
        if s["kind"] == "reformat":
            src = eng._view(s["src"], len(x)).astype(np.float32) * np.float32(s["scale"])
            got = eng._view(s["dst"], len(x))
            assert got.dtype == (np.int8 if s["to"] == "int8" else np.float16)
            want = np.clip(np.rint(src * np.float32(s["inv_scale"])), -127, 127) if s["to"] == "int8" else src
            np.testing.assert_array_equal(got, want.astype(got.dtype), err_msg=s["name"])
            assert ("arena" in s["dst"]) == (s["to"] == "fp16") and ("arena" in s["src"]) == (s["from"] == "fp16")
        elif s["kind"] == "conv":
            assert all(("arena" in loc) == (p == "fp16") for loc in [s["src"], *s["dests"]]), s["name"]
            assert a[f"{s['id']}/w"].dtype == (np.float16 if p == "fp16" else np.int8)
            xin = eng._view(s["src"], len(x)).astype(np.float64)
            w = a[f"{s['id']}/w"].astype(np.float64).reshape(s["kh"], s["kw"], -1, s["K"])
            if p == "int8":
                w = w * a[f"{s['id']}/scale"]  # s_x s_w[k]: the integer sums in real units
            want = E.cbr_spec(xin, w, a[f"{s['id']}/b"], s["relu"])
            start = 0
            for dest in s["dests"]:
                got = eng._view(dest, len(x)).astype(np.float64)
                part = want[..., start:start + dest["C"]]
                if p == "int8":  # one INT8 step of the output's scale
                    s_y = 1.0 / a[f"{s['id']}/inv"][start]
                    assert np.abs(got * s_y - np.clip(part, -127 * s_y, 127 * s_y)).max() <= 0.5 * s_y * 1.001
                else:
                    np.testing.assert_allclose(got, part, rtol=2e-3, atol=2e-3 * np.abs(part).max())
                start += dest["C"]
    fp32 = _acc(E.predict(E.Engine(E.build_plan(g, precision="fp32", max_batch=128, tune=False)), d["x_test"]),
                d["y_test"])
    assert _acc(E.predict(E.Engine(plan), d["x_test"]), d["y_test"]) >= fp32 - 0.01
    path = plan.save(__import__("tempfile").mkdtemp() + "/mixed.plan")  # the plan file keeps the per-layer precision
    again = E.load_plan(path)
    assert again.header["layer_precisions"] == plan.header["layer_precisions"]
    np.testing.assert_array_equal(E.predict(E.Engine(again), x), E.predict(E.Engine(plan), x))


def test_per_layer_precision_is_checked(model):
    _, stages, d = model
    g = stages[-1][1]
    with pytest.raises(runtime.CourseInputError, match="names no convolution"):
        E.build_plan(g, precision="int8", x_calib=d["x_calib"], tune=False, keep_fp16=["conv9"])
    with pytest.raises(runtime.CourseInputError, match="for INT8 and FP8 plans"):
        E.build_plan(g, precision="fp16", tune=False, keep_fp16=["stem"])
    with pytest.raises(runtime.CourseInputError, match="runs in fp16 or int8"):
        E.build_plan(g, precision="int8", x_calib=d["x_calib"], tune=False, layer_precisions={"stem": "fp32"})
    # the branches write slices of one concatenated buffer: they share a precision
    with pytest.raises(runtime.CourseError, match="must share a precision"):
        E.build_plan(g, precision="int8", x_calib=d["x_calib"], tune=False, keep_fp16=["branch3x3"])
    # a name names a horizontally fused layer by any of its parts; a layer in the plan's own precision is not listed
    plan = E.build_plan(g, precision="int8", x_calib=d["x_calib"], tune=False,
                        layer_precisions={"stem": "fp16", "branch3x3": "int8"})
    assert plan.header["layer_precisions"] == {"stem": "fp16"}
    uniform = E.build_plan(g, precision="int8", x_calib=d["x_calib"], tune=False, layer_precisions={"stem": "int8"})
    assert "layer_precisions" not in uniform.header and not any(s["kind"] == "reformat" for s in uniform.steps)


# ------------------------------------------------ the network in one kernel (network.py, inference_engine_network.cu)

@pytest.fixture(scope="module")
def networks(model):
    """The fused graph's plans with the network in one step (fuse_network=True), each precision, untuned."""
    _, stages, d = model
    return {p: E.build_plan(stages[-1][1], precision=p, max_batch=128, x_calib=d["x_calib"], tune=False,
                            fuse_network=True) for p in E.PRECISIONS}


def test_network_step_computes_what_the_unfused_plan_does(model, plans, networks):
    """One step, one launch, no arena; its NumPy arithmetic (the kernel's model) gives the unfused plan's logits: the
    same weights, scales and roundings, layer for layer."""
    _, _, d = model
    for p, plan in networks.items():
        assert [s["kind"] for s in plan.steps] == ["network"] and plan.launches == 1 and plan.header["arena"] == 0
        assert len(plan.steps[0]["layers"]) == plans[p].launches == 8
        got, want = (E.predict(E.Engine(pl), d["x_test"]) for pl in (plan, plans[p]))
        tol = 1e-5 if p == "fp32" else 1e-3
        assert np.abs(got - want).max() <= tol * np.abs(want).max(), p
        assert _acc(got, d["y_test"]) == _acc(want, d["y_test"]), p
    assert networks["int8"].arrays["0/w_c3"].dtype == np.int8 and "0/s_c3" in networks["int8"].arrays
    assert networks["fp16"].arrays["0/w_c5"].dtype == np.float16 and "0/s_c5" not in networks["fp16"].arrays


def test_network_fusion_leaves_other_graphs_alone(model):
    """Only the optimised digits graph becomes one step: the imported graph and the stages before concatenation
    elimination keep a step per layer, and fuse_network=False (the default) keeps them too."""
    g, stages, d = model
    assert E.network.match(stages[-1][1]) is not None
    for name, s in stages[:-2]:
        assert E.network.match(s) is None, name
        one = E.build_plan(s, precision="fp32", max_batch=4, tune=False, fuse_network=True)
        assert [st["kind"] for st in one.steps] == [st["kind"] for st in
                                                    E.build_plan(s, precision="fp32", max_batch=4, tune=False).steps]
    assert E.build_plan(stages[-1][1], precision="fp32", max_batch=4, tune=False).launches == 8
    other = stages[-1][1].copy()
    next(n for n in other.nodes if n.name == "branch5x5").weights["w"] = np.zeros((3, 3, 16, 16), np.float32)
    assert E.network.match(other) is None


def test_network_weights_are_in_mma_fragment_order(rng):
    """fragments(): lane (gid, tig) of n tile j, step s holds column 8 j + gid, reduction rows KPR tig + e and
    16 / itemsize more (KPR = 4 / itemsize), the layout mma.sync's B operand has; the reduction padded with zeros."""
    for dtype in (np.float16, np.int8):
        item = np.dtype(dtype).itemsize
        ke, kpr = 32 // item, 4 // item
        w = rng.integers(-100, 100, (40, 16)).astype(dtype)
        f = E.network.fragments(w, item).view(dtype).reshape(-1, 2, 32, 2, kpr)  # step, j, lane, register, element
        assert f.shape[0] == -(-40 // ke)
        last = f.shape[0] - 1
        for s, j, lane, r, e in [(0, 0, 0, 0, 0), (0, 1, 13, 1, kpr - 1), (1, 1, 31, 0, 1), (last, 0, 5, 1, 0)]:
            k, n = s * ke + r * ke // 2 + (lane % 4) * kpr + e, 8 * j + lane // 4
            assert f[s, j, lane, r, e] == (w[k, n] if k < 40 else 0), (dtype, s, j, lane, r, e)


def test_network_blob_and_tiles(networks):
    """The weights' buffer: a table of 16-byte aligned sections in the .cu's order; the dense weights times 1 / 16
    (and INT8's scale). Tile rows: the most that still give every SM a block, within the GPU's shared memory."""
    for p, plan in networks.items():
        step = plan.steps[0]
        blob = E.network.weights_blob(plan.arrays, step, p)
        table = blob[:4 * E.network.TABLE].view(np.int32)[:len(E.network.SECTIONS)]
        assert np.all(np.diff(table) >= 0) and np.all(table % 16 == 0) and table[-1] < len(blob)
        k = E.network.SECTIONS.index("w_dense")
        dense = blob[table[k]:table[k + 1]].view(np.float32)[:1536 * 10].reshape(1536, 10)
        assert np.allclose(dense, plan.arrays["0/w_dense"] * step["x_scale"] / 16)
        scalars = blob[table[-1]:table[-1] + 20].view(np.float32)
        assert np.allclose(scalars, [step[key] for key in E.network.SCALARS])
    rows = E.network.tile_rows
    assert rows(1, 132, 227 * 1024, "fp16") == 2 and rows(256, 132, 227 * 1024, "fp16") == 16
    assert rows(64, 132, 227 * 1024, "fp16") == 4 and rows(128, 132, 227 * 1024, "int8") == 8
    assert rows(256, 40, 64 * 1024, "fp32") == 4  # a T4: 64 KB of shared memory a block
    assert E.network.smem_bytes("fp16", 16) < 113 * 1024  # two blocks an SM on an H100 or A100
    with pytest.raises(runtime.CourseInputError, match="tile_rows 16"):
        rows(1, 132, 64 * 1024, "fp32", 16)


def test_network_plan_reloads(networks, model, tmp_path):
    _, _, d = model
    plan = networks["int8"]
    again = E.load_plan(plan.save(tmp_path / "digits_network.plan"))
    assert again.steps == plan.steps
    assert np.array_equal(E.predict(E.Engine(again), d["x_test"][:50]), E.predict(E.Engine(plan), d["x_test"][:50]))


def test_engines_table_has_the_one_kernel_rows():
    """The benchmark builds the one-kernel engines (their plans one step) beside the others; ratios() gives their speed
    over fused + graph and INT8 over FP16 where a run has them, and nothing new for a record made before them."""
    names = [n for n in bench_lesson.ENGINES if n.startswith(bench_lesson.NETWORK)]
    assert names == [f"{bench_lesson.NETWORK}, {p}" for p in ("FP32", "FP16", "INT8")]
    assert all(bench_lesson.ENGINES[n][0] and bench_lesson.ENGINES[n][2] for n in names)  # the fused graph, a graph
    rows = [{"name": n, "latency_ms": 0.1, "batch_ms": 0.2, "batch_gpu_ms": 0.19, "batch": 256}
            for n in bench_lesson.ENGINES]
    by = {r["name"]: r for r in rows}
    by[f"{bench_lesson.NETWORK}, FP16"].update(latency_ms=0.02, batch_ms=0.05, batch_gpu_ms=0.04)
    by[f"{bench_lesson.NETWORK}, INT8"].update(batch_ms=0.025, batch_gpu_ms=0.02)
    q = bench_lesson.ratios(rows)
    assert q["network_vs_fused_fp16_latency"] == pytest.approx(5.0)
    assert q["network_int8_vs_fp16_batch"] == pytest.approx(2.0)
    old = bench_lesson.ratios([r for r in rows if not r["name"].startswith(bench_lesson.NETWORK)])
    assert not any(k.startswith("network") for k in old) and set(q) - set(old) == {k for k in q if "network" in k}


def test_the_lesson_5_benchmarks_import_one_another_without_a_circle():
    """benchmarks/inference_engine.py imports the phases benchmark (its figure network_phases); what both need (the
    model, the engines' names, the goals) lives in benchmarks/inference_engine_model.py, which imports no benchmark:
    no chain of imports among the lesson's benchmark modules, function-level ones included, comes back to where it
    started."""
    import ast
    from pathlib import Path

    folder = Path(bench_lesson.__file__).parent
    mods = {p.stem: p for p in folder.glob("inference_engine*.py")}
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
                deps.add(node.module.split(".", 1)[1])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("benchmarks.")}
        graph[name] = deps & set(mods) - {name}
    assert "inference_engine_network_phases" in graph["inference_engine"]
    assert graph["inference_engine_model"] == set(), graph["inference_engine_model"]

    def reaches(start, goal, seen=()):
        return any(d == goal or (d not in seen and reaches(d, goal, seen + (d,))) for d in graph[start])
    circles = sorted(m for m in graph if reaches(m, m))
    assert not circles, f"lesson 6's benchmark modules import one another in a circle: {circles} ({graph})"


@needs_compiler
def test_network_kernel_compiles():
    ptx = cuda_c.compile_ptx(E.network.SOURCE, "sm_80")
    for p in E.PRECISIONS:
        for r in E.network.TILE_ROWS:
            assert f".entry network_{E.SUFFIX[p]}_{r}(" in ptx
    f16, i8 = (cuda_c.ptx_entry(ptx, f"network_{s}_16") for s in ("f16", "i8"))
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in f16 and "ldmatrix.sync.aligned.m8n8.x4" in f16
    assert "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32" in i8


@needs_compiler
def test_network_phase_stamps_compile():
    """benchmarks/inference_engine_network_phases.py's copy of the network region: the region's own text with a clock
    stamp at its start, after each of its four barriers and at its end (thread 0), compiled in place of the region."""
    from benchmarks import inference_engine_network_phases as phases

    region = phases.stamped_region()
    assert region.count("clock64()") == len(phases.PHASES) + 1
    assert region.count("%%globaltimer") == 2  # the block's start and end, for the kernel's span
    assert region.replace("    if (threadIdx.x == 0) stamps[", "").count("__syncthreads();") == 4
    plain = cuda_c.region(E.network.SOURCE, "network")
    assert all(line in region for line in plain.splitlines())  # nothing of the region's own is changed
    ptx = cuda_c.compile_ptx(E.network.SOURCE, "sm_80", edits={"network": region})
    for p in ("f16", "i8"):
        assert "%clock64" in cuda_c.ptx_entry(ptx, f"network_{p}_16")
        assert "%globaltimer" in cuda_c.ptx_entry(ptx, f"network_{p}_16")
    row = {"precision": "int8", "what": "batch 256", "cycles": dict.fromkeys(phases.PHASES, 1000.0), "total": 5000.0}
    assert "INT8, batch 256" in phases.text({"gpu": "a GPU", "batch": 256, "phases": list(phases.PHASES),
                                             "rows": [row]})


def _phases_figure(spans=(18.0, 16.0), calls=(20.0, 17.5)):
    from benchmarks import inference_engine_network_phases as phases

    def row(p, cycles, span):
        return {"precision": p, "what": "batch 256", "blocks": 256, "sms": 132, "total": float(sum(cycles)),
                "cycles": dict(zip(phases.PHASES, map(float, cycles))), "span_us": span, "start_spread_us": 0.2}
    return {"gpu": "a GPU", "batch": 256, "runs": 5, "phases": list(phases.PHASES),
            "rows": [row("fp16", [2000, 1600, 7000, 16000, 4400], spans[0]),
                     row("int8", [2500, 2000, 8000, 11000, 4000], spans[1])],
            "call_us": {"fp16": calls[0], "int8": calls[1]}}


def test_the_phases_bound_models_int8_with_the_faster_cycles_and_half_fp16s_branches():
    """benchmarks/inference_engine_network_phases.bound: a block's cycles become the span in proportion (INT8's
    microseconds a cycle), each call adds its measured launch and gap, and end to end the engines' host time; the
    models take the faster precision's cycles in each phase outside the branches, then half FP16's branches; the
    ratios are FP16's call over each."""
    from benchmarks import inference_engine_network_phases as phases

    t = _phases_figure()
    b = phases.bound(t)
    assert not b["end_to_end"] and set(b["rows"]["FP16, measured"]) == set(phases.PHASES) | {"launch and gap"}
    assert sum(b["rows"]["FP16, measured"].values()) == pytest.approx(20.0)  # span + launch and gap = the call
    assert sum(b["rows"]["INT8, measured"].values()) == pytest.approx(17.5)
    us = 16.0 / 27500  # INT8's span over its cycles
    elsewhere = (2000 + 1600 + 7000 + 11000 + 4000) * us + 1.5  # FP16's image, stem and 1 x 1, INT8's head
    ideal = (2000 + 1600 + 7000 + 8000 + 4000) * us + 1.5
    assert b["ratio"]["INT8, the faster precision's cycles outside the branches"] == pytest.approx(20.0 / elsewhere)
    assert b["ratio"]["INT8, that and the branches at half FP16's"] == pytest.approx(20.0 / ideal)
    assert b["rows"]["INT8, that and the branches at half FP16's"]["3x3/5x5"] == pytest.approx(8000 * us)
    engines = {"rows": [{"name": f"{bench_lesson.NETWORK}, FP16", "batch": 256, "batch_ms": 0.023,
                         "batch_gpu_ms": 0.020},
                        {"name": f"{bench_lesson.NETWORK}, INT8", "batch": 256, "batch_ms": 0.0205,
                         "batch_gpu_ms": 0.0175}]}
    e = phases.bound(t, engines)
    assert e["end_to_end"] and e["rows"]["INT8, measured"]["host"] == pytest.approx(3.0)
    assert e["ratio"]["INT8, measured"] == pytest.approx(23.0 / 20.5)
    assert e["ratio"]["INT8, that and the branches at half FP16's"] == pytest.approx(23.0 / (ideal + 3.0))
    assert "goal 1.3x" in phases.bound_text(e) and "end to end" in phases.bound_text(e)
    assert "launch and gap 2.0 µs" in phases.text(t)
    fig = phases.plot(t, "a test", engines=engines)
    assert fig.axes[0].get_legend() is not None
    assert not phases.bound(t, {"rows": engines["rows"][:1]})["end_to_end"]  # a record without INT8's row
    with pytest.raises(ValueError, match="int8"):
        phases.bound({**t, "rows": t["rows"][:1]})


@pytest.mark.gpu
@pytest.mark.parametrize("precision", E.PRECISIONS)
def test_network_kernel_matches_the_numpy_runtime(model, precision):
    """The one kernel against its NumPy step, at batch 1, 3 and 256, with every tile size that fits this GPU, eager and
    replayed from a CUDA graph: its output buffer poisoned before each run, two runs giving the same logits bit for
    bit (no atomics in any sum), each image's counter back at zero."""
    _, stages, d = model
    cp = runtime.cupy()
    plan = E.build_plan(stages[-1][1], precision=precision, max_batch=256, x_calib=d["x_calib"], tune=False,
                        fuse_network=True)
    attrs = cp.cuda.Device().attributes
    fits = [r for r in E.network.TILE_ROWS
            if E.network.smem_bytes(precision, r) <= attrs["MaxSharedMemoryPerBlockOptin"]]
    x = d["x_test"][np.arange(256) % len(d["x_test"])]
    ref = E.Engine(plan, numpy=True)
    for n in (1, 3, 256):
        want = E.predict(ref, x[:n])
        scale = np.abs(want).max()
        for rows in fits + [None]:
            plan.steps[0]["tile_rows"] = rows
            for graphs in (False, True):
                eng = E.Engine(plan, graphs=graphs)
                runs = []
                for _ in range(2):
                    eng.out.fill(cp.nan)
                    buf = eng.input_buffer(n)
                    buf[...] = cp.asarray(x[:n])
                    runs.append(eng.infer(buf).get().copy())
                got = runs[0]
                where = (precision, n, rows, graphs)
                assert np.array_equal(runs[0], runs[1]) and not np.isnan(got).any(), where
                diff = np.abs(got - want)
                if precision == "fp32":
                    assert diff.max() <= 1e-4 * scale, where
                elif precision == "fp16":
                    assert diff.max() <= 1e-2 * scale and np.median(diff) <= 1e-3 * scale, where
                else:  # a code one step apart now and then, as test_gpu_int8_matches_numpy_int8_arithmetic allows
                    assert diff.max() <= 0.1 * scale and np.median(diff) <= 1e-3 * scale, where
                top2 = np.sort(want, axis=1)[:, -2:]
                clear = top2[:, 1] - top2[:, 0] > 2 * diff.max()  # images whose class no such difference can change
                assert np.array_equal(got.argmax(1)[clear], want.argmax(1)[clear]), where
                assert not eng.dev["0/done"].any(), where
    plan.steps[0]["tile_rows"] = None


# ------------------------------------------------------------------------------------ a faked GPU

def test_a_plan_is_keyed_by_the_compute_capability_the_course_builds_for(plans, monkeypatch):
    """GPUCOURSE_FAKE_CC makes the builder choose kernels for another GPU (the tuner's candidates, FP8, the
    fallbacks: gpucourse/gpus.py), so a plan's target carries that capability, not only the GPU's own: a plan built
    under a faked 8.0 on an H100 is refused under a faked 7.5 and under the H100's own 9.0, with a message that
    names the setting, and accepted where it was built. (Its target held the GPU's own capability, so a plan tuned
    under one capability ran under another.) CPU mode: the GPU is a stand-in runtime."""
    h100 = runtime.Runtime(mode="gpu", reason="a test's stand-in",
                           device={"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"})
    monkeypatch.setattr(runtime, "get", lambda: h100)
    monkeypatch.delenv(runtime.FAKE_CC_VARIABLE, raising=False)
    assert E.this_target() == {"kind": "gpu", "name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}
    monkeypatch.setenv(runtime.FAKE_CC_VARIABLE, "8.0")
    target = E.this_target()
    assert target["compute_capability"] == "8.0"
    plan = E.Plan(dict(plans["fp32"].header, target=target), plans["fp32"].arrays)
    E.check_target(plan)  # where it was built: accepted
    monkeypatch.setenv(runtime.FAKE_CC_VARIABLE, "7.5")
    with pytest.raises(runtime.CourseError) as err:
        E.check_target(plan)
    msg = str(err.value)
    assert "compute capability 8.0" in msg and "GPUCOURSE_FAKE_CC=7.5 is set" in msg and "rebuild the plan" in msg
    monkeypatch.delenv(runtime.FAKE_CC_VARIABLE)
    with pytest.raises(runtime.CourseError, match="run with the GPUCOURSE_FAKE_CC it was built with"):
        E.check_target(plan)


def test_a_lost_kernel_is_reported_with_the_cell_and_what_to_do(monkeypatch):
    """Lesson 6's notebook once failed a run of the capability matrix with a bare "AssertionError": no assert of the
    lesson's code lacks a message, but nbclient's own (``assert self.kc is not None``) fire when its kernel client is
    torn down mid-run (the kernel process died or was shut down), and the runner kept only that line. Now the runner
    says which cell was running and what to do. CPU mode: nbclient's failure is simulated after the first cell."""
    import nbclient
    import nbformat

    from gpucourse import notebooks

    def execute(self, **_):
        first, second = self.nb.cells[0], self.nb.cells[1]
        first.metadata["execution"] = {"iopub.execute_input": "t0", "shell.execute_reply": "t1"}
        second.metadata["execution"] = {"iopub.execute_input": "t2"}
        assert self.kc is not None  # as nbclient asserts, with no message

    monkeypatch.setattr(nbclient.NotebookClient, "execute", execute)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1"), nbformat.v4.new_code_cell("2")])
    path = Path(tempfile.mkdtemp()) / "lost.ipynb"
    nbformat.write(nb, path)
    out = notebooks.execute(path, mode="cpu")
    assert not out.ok
    assert out.error.startswith("the notebook's kernel went away while cell 1 ran (nbclient: AssertionError")
    assert "Run the notebook again alone" in out.error


# ------------------------------------------- what the notebooks' prose claims, over every record (either mode)
# The core notebook and its deep dive say what to read in a figure in words that must hold on every recorded GPU, not
# only the newest: each claim they make about the records is asserted here over every record of the lesson.

EVERY_RECORD = records.all_records(LESSON)


@pytest.fixture(params=EVERY_RECORD, ids=lambda r: r["gpu"]["name"])
def each_record(request):
    return request.param


def test_recorded_engine_claims_hold_in_every_record(each_record):
    """Core notebook, section 8 ("Reading the figures") and section 5."""
    f = each_record["figures"]
    t, q = f["engines"], f["engines"]["ratios"]
    rows = {r["name"]: r for r in t["rows"]}
    assert all(met for _, _, met in bench_lesson.targets_met(t).values()), "every record meets all five goals"
    for p in ("fp32", "fp16"):
        assert q[f"graphs_{p}_batch"] < q[f"graphs_{p}_latency"], "a graph helps less at batch 256 than at batch 1"
        fused, graph = rows[f"fused, {p.upper()}"], rows[f"fused + graph, {p.upper()}"]
        assert graph["latency_ms"] - graph["latency_gpu_ms"] < fused["latency_ms"] - fused["latency_gpu_ms"], p
    for name in ("fused, FP32", "layer by layer, FP32"):  # the direct kernels win the FP32 3x3 and 5x5 layers
        kept = {r["layer"]: r["kernel"] for r in f["tuning"][name]}
        assert kept["branch3x3"].startswith("direct3") and kept["branch5x5"].startswith("direct5"), (name, kept)
    for name in ("fused, FP16", "layer by layer, FP16"):  # the direct tensor-core kernels win them in FP16
        kept = {r["layer"]: r["kernel"] for r in f["tuning"][name]}
        assert kept["branch3x3"].startswith("tcd3") and kept["branch5x5"].startswith("tcd5"), (name, kept)
        for r in f["tuning"][name]:  # deep dive, section 1: the 16-byte WMMA tiles beat every 2-byte one
            wide = [v for k, v in r["tuning_ms"].items() if k.startswith("wmmav_")]
            if wide:
                assert min(wide) < min(v for k, v in r["tuning_ms"].items() if k.startswith("wmma_")), r["layer"]
    int8, fp16 = rows["fused + graph, INT8"], rows["fused + graph, FP16"]
    assert int8["latency_ms"] > fp16["latency_ms"] and int8["batch_ms"] > fp16["batch_ms"], "INT8 not faster here"
    fp32 = rows["fused, FP32"]["accuracy"]
    assert all(r["accuracy"] >= fp32 for r in f["calibration"]["rows"]), "each calibration keeps FP32's accuracy"
    cudnn = {r["dtype"]: r for r in f["cudnn"]["rows"] if r["status"] == "ok"}
    assert cudnn["float32"]["ours_over_cudnn"] < 1 < cudnn["float16"]["ours_over_cudnn"], cudnn


def test_recorded_pytorch_claims_hold_in_every_record(each_record):
    """Core notebook, section 9: against eager PyTorch the engine is several times faster in every cell; compiled
    and captured PyTorch is the best in every cell but FP32 at batch 1 (its CUDA graph of cuDNN calls there); against
    that best the fused + graph engine wins FP32 at batch 256 only, and where it loses end to end it loses on the GPU
    alone too; the one-kernel network is faster than PyTorch's best in every cell."""
    t = each_record["figures"]["pytorch"]
    assert t.get("available"), t
    q, best = t["speedups"], t["best"]
    assert {r["variant"] for r in t["rows"]} == set(bench_lesson.pytorch_reference.VARIANTS)  # torch.compile too
    for c in t["course"]:
        p = c["precision"]
        for what in ("latency", "batch"):
            eager = min(r[f"{what}_ms"] for r in t["rows"]
                        if r["precision"] == p and r["variant"].startswith("eager") and r.get(f"{what}_ms"))
            assert eager >= 2 * c[f"{what}_ms"], (p, what)
            key = f"{p}_{what}"
            want = "PyTorch CUDA graph" if key == "fp32_latency" else "PyTorch torch.compile + CUDA graph"
            assert best[key].startswith(want), (key, best[key])
            assert (q[key] > 1) == (key == "fp32_batch"), (key, q[key])
            if q[key] < 1:
                assert q[f"{key}_gpu"] < 1, key
            assert q[f"network_{key}"] > 1, key


def test_recorded_pytorch_claims_without_compile_hold_in_every_record(each_record):
    """Core notebook, section 9, on the tables a default GPU run prints (eager and CUDA graphs, no torch.compile):
    PyTorch's best in each cell is one of its CUDA graphs, and the fused + graph engine is faster than it in every
    cell but FP32 at batch 1, where PyTorch's CUDA graph is ahead. Every record, read without its torch.compile rows,
    says so."""
    t = dict(each_record["figures"]["pytorch"])
    t["rows"] = [r for r in t["rows"] if "compile" not in r["variant"]]
    assert t["rows"] and {r["variant"] for r in t["rows"]} == {
        v for v in bench_lesson.pytorch_reference.VARIANTS if "compile" not in v}
    s = bench_lesson.pytorch_reference.speedups(t)
    for c in t["course"]:
        for what in ("latency", "batch"):
            key = f"{c['precision']}_{what}"
            assert s["best"][key].startswith("PyTorch CUDA graph"), (key, s["best"][key])
            assert (s["speedups"][key] < 1) == (key == "fp32_latency"), (key, s["speedups"][key])
            assert s["speedups"][f"network_{key}"] > 1, key


def test_recorded_one_kernel_claims_hold_in_every_record(each_record):
    """Deep dive, sections 2 and 3: the one kernel beats fused + graph everywhere; INT8 over FP16 stays short of its
    goal; INT8's branches take fewer cycles than FP16's and its image, stem and 1 x 1 phases more; the phases' bound
    stays below the goal with the faster precision's cycles outside the branches and comes near it only with the
    branches at half FP16's as well."""
    f = each_record["figures"]
    q = f["engines"]["ratios"]
    for p in ("fp32", "fp16", "int8"):
        for w in ("latency", "batch"):
            assert q[f"network_vs_fused_{p}_{w}"] > 1, (p, w)
    goal = bench_lesson.NETWORK_GOALS["int8_vs_fp16_batch"]
    assert 1 < q["network_int8_vs_fp16_batch"] < goal
    phases = f["network_phases"]
    at = {r["precision"]: r["cycles"] for r in phases["rows"] if r["what"].startswith("batch")}
    assert at["int8"]["3x3/5x5"] < at["fp16"]["3x3/5x5"]
    assert all(at["int8"][ph] > at["fp16"][ph] for ph in ("image", "stem", "1x1")), at
    b = bench_lesson.network_phases.bound(phases, f["engines"])
    assert b["ratio"]["INT8, the faster precision's cycles outside the branches"] < goal
    assert b["ratio"]["INT8, that and the branches at half FP16's"] > 0.95 * goal


def test_recorded_deep_dive_statements_hold_in_every_record(each_record):
    """Deep dive, sections 1 and 4, as its cells print them: the tuner's tables (tuning_reading), and the floors per
    layer from the record's ceilings: at batch 1 every 1 x 1 convolution and most 3 x 3 ones memory-bound; at batch
    64 no 3 x 3 one, the 7 x 7 stem still, and most 1 x 1 ones."""
    from benchmarks import inference_engine_resnet as R

    f = each_record["figures"]
    assert [s for s, holds in bench_lesson.tuning_reading(f["tuning"]) if holds is not True] == []
    layers = E.optimize(E.resnet50(224))[-1][1]
    c = each_record["ceilings"]
    at = {b: R.bound_counts(E.floors(E.layer_costs(layers, b), c["fp16_tflops"], c["copy_gbps"])) for b in (1, 64)}
    (m1, n1), (m3, n3) = at[1]["1x1"], at[1]["3x3"]
    assert m1 == n1 and 2 * m3 > n3, at[1]
    (m1, n1), (m3, n3), (m7, n7) = at[64]["1x1"], at[64]["3x3"], at[64]["7x7"]
    assert m3 == 0 and m7 == n7 == 1 and 2 * m1 > n1, at[64]


def test_recorded_resnet_claims_hold_in_every_record(each_record):
    """Deep dive, sections 4 and 5: the FP16 plan faster than PyTorch's CUDA graph of channels_last cuDNN calls and
    than torch.compile in a CUDA graph at batch 1 and 64; the INT8 and FP8 plans faster than FP16 by about the goal but
    agreeing on fewer than 99% of the inputs; the mixed plans at 99% but short of the goal, even with their 8-bit
    layers at their floors."""
    from benchmarks import inference_engine_resnet as R

    f = each_record["figures"]
    t, c = f["resnet"], f["resnet_compile"]
    graph = next(r for r in t["pytorch"]["rows"] if r["name"] == "PyTorch CUDA graph, NHWC, FP16")
    for n, key in ((1, "FP16, batch 1"), (R.BATCH, "FP16, batch 64")):
        assert t["engine"][key]["ms"] < graph[f"b{n}"]["ms"], n
        assert c[f"fp16_vs_compile_b{n}"]["ratio"] > 1, n
    r = t["ratios"]
    for p in ("int8", "fp8"):
        # "faster than the FP16 plan, by about the 1.3x goal": within a tenth of it, met or not
        assert r[f"{p}_vs_fp16_b64"]["ratio"] > 0.9 * r[f"{p}_vs_fp16_b64"]["goal"], p
        assert r[f"top1_{p}"]["ratio"] < R.GOALS["top1_agreement"], p
        assert r[f"top1_{p}_mixed"]["met"] and not r[f"{p}_mixed_vs_fp16_b64"]["met"], p
    bound = R.mixed_bound(t)
    assert bound and all(b["floor"] < R.GOALS["int8_vs_fp16"] for b in bound.values()), bound
    # section 4: a floor is what a convolution must take at least, so no layer of the FP16 plan runs below its own
    # (its bytes counted by today's layer_costs: R.floored reads a record made before a correction with it)
    below = [r["name"] for r in R.floored(t) if r["kind"] == "conv" and r["ms"] < max(r["compute_ms"], r["memory_ms"])]
    assert not below, below
    assert [s for s, holds in R.reading(t) if holds is not True] == []  # what the deep dive prints under the figure

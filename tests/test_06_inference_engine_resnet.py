"""Lesson 6's real network: ResNet-50 built with NumPy as an engine graph, against Keras' own ResNet50 (layer names,
structure, weights in, outputs out), its batch-norm calibration, the passes on it (padding folded, batch norms
folded, bias + residual + ReLU in each convolution's epilogue, the classifier one Head) and the costs per layer."""
from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import needs_compiler
from gpucourse import cuda_c, runtime
from kernels import inference_engine as E

pytestmark = pytest.mark.lesson06
SIZE = 64  # small enough for the NumPy reference in CI, large enough for every stride (7 x 7 at the end: 2 x 2)


@pytest.fixture(scope="module")
def calibrated():
    g = E.resnet50(SIZE, seed=0)
    x = np.random.default_rng(1).standard_normal((4, SIZE, SIZE, 3)).astype(np.float32)
    return E.calibrate_batchnorm(g, x, progress=False), x


def test_resnet50_has_its_layers_and_shapes():
    g = E.resnet50(224)
    assert g.ops() == {"Pad": 2, "Conv": 53, "BiasAdd": 53, "BatchNorm": 53, "Relu": 49, "MaxPool": 1, "Add": 16,
                       "GlobalAvgPool": 1, "Dense": 1, "Softmax": 1}
    assert g.shapes["conv1_conv"] == (112, 112, 64) and g.shapes["pool1_pool"] == (56, 56, 64)
    assert g.shapes["conv2_block3_out"] == (56, 56, 256) and g.shapes["conv3_block1_out"] == (28, 28, 512)
    assert g.shapes["conv4_block6_out"] == (14, 14, 1024) and g.shapes["conv5_block3_out"] == (7, 7, 2048)
    assert g.shapes[g.output] == (1000,)
    weights = sum(w.size for n in g.nodes for k, w in n.weights.items() if k in ("w", "b", "gamma", "beta"))
    assert weights == 25_583_592  # Keras' ResNet50: 25,636,712 parameters, of which 53,120 are batch-norm statistics
    macs = sum(r["flops"] for r in E.layer_costs(g)) / 2
    assert 3.8e9 < macs < 3.9e9
    with pytest.raises(runtime.CourseInputError, match="32 x 32 pixels or more"):
        E.resnet50(16)


def test_calibration_normalises_what_reaches_each_batch_norm(calibrated):
    g, x = calibrated
    _, vals = E.run_graph(g, x, keep=True)
    for n in (n for n in g.nodes if n.op == "BatchNorm"):
        y = vals[n.outputs[0]]
        assert abs(y.mean()) < 1e-3 and abs(y.std() - 1) < 1e-2, n.name
    with pytest.raises(runtime.CourseInputError, match="calibration images must be N x 64 x 64 x 3"):
        E.calibrate_batchnorm(g, x[..., :1], progress=False)


def test_every_pass_keeps_the_outputs(calibrated):
    g, x = calibrated
    stages = E.optimize(g)
    ref = E.run_graph(g, x)
    for name, s in stages[1:]:
        assert np.abs(E.run_graph(s, x) - ref).max() < 1e-6 * np.abs(ref).max() * 100, name
    final = stages[-1][1]
    assert final.ops() == {"CBR": 53, "MaxPool": 1, "Head": 1}
    cbr = {n.name: n for n in final.nodes if n.op == "CBR"}
    # the residual joins the main path's last convolution, the projection is its own CBR without ReLU
    main, proj = cbr["conv3_block1_3_conv"], cbr["conv3_block1_0_conv"]
    assert main.attrs["residual"] and main.attrs["relu"] and main.inputs[1] == proj.outputs[0]
    assert not proj.attrs["relu"] and proj.attrs["stride"] == 2
    assert cbr["conv2_block2_3_conv"].inputs[1] == "conv2_block1_out"  # an identity block adds its input
    assert cbr["conv1_conv"].attrs["pad"] == [3, 3, 3, 3] and cbr["conv1_conv"].attrs["stride"] == 2
    assert sum(bool(n.attrs.get("residual")) for n in cbr.values()) == 16
    pool = next(n for n in final.nodes if n.op == "MaxPool")
    assert pool.attrs == {"size": 3, "stride": 2, "pad": [1, 1, 1, 1]}


def test_costs_and_floors_per_layer(calibrated):
    g = E.optimize(calibrated[0])[-1][1]
    rows = E.layer_costs(g, batch=2)
    first = rows[0]
    assert first["name"] == "conv1_conv" and first["kernel"] == "7x7/2" and first["out"] == [32, 32, 64]
    assert first["flops"] == 2 * 2 * 32 * 32 * 64 * 7 * 7 * 3
    assert first["bytes"] == 2 * (2 * (64 * 64 * 3 + 32 * 32 * 64) + 7 * 7 * 3 * 64)
    res = next(r for r in rows if r["name"] == "conv2_block1_3_conv")
    assert res["bytes"] == 2 * (2 * (16 * 16 * 64 + 2 * 16 * 16 * 256) + 64 * 256)  # the residual read too
    # a strided 1x1 convolution reads every second row and column of its input: 8 x 8 of the 16 x 16 pixels
    down = next(r for r in rows if r["name"] == "conv3_block1_1_conv")
    assert down["kernel"] == "1x1/2" and down["in"] == [16, 16, 256] and down["out"] == [8, 8, 128]
    assert down["bytes"] == 2 * (2 * (8 * 8 * 256 + 8 * 8 * 128) + 256 * 128)
    # a strided 3x3 one reads them all (its windows overlap), and so does the 7x7 stem above
    assert E.resnet._read(16, 3, 2, 1, 8) == 16 and E.resnet._read(16, 1, 2, 0, 8) == 8
    assert E.resnet._read(15, 2, 3, 0, 5) == 10  # windows of 2 at stride 3: rows 0 1, 3 4, ..., 12 13
    fl = E.floors(rows, tflops=100.0, gbps=1000.0)
    for r in fl:
        assert r["compute_s"] == pytest.approx(r["flops"] / 1e14)
        assert r["bound"] == ("compute" if r["intensity"] >= 100 else "memory")


def test_the_engine_runs_resnet50_step_by_step(calibrated):
    """An FP16 plan of ResNet-50 in CPU mode (the NumPy runtime, the GPU kernels' arithmetic), its stem not fused:
    the stem reads the input's im2col matrix, every convolution (strided, padded, with a residual) gives what the NumPy spec gives on
    the values it read, to FP16 rounding; the pool, the classifier and the softmax too; and end to end the plan
    agrees with the float64 graph (the random network amplifies each layer's rounding: a few percent at the logits)."""
    g, x = calibrated
    x = x[:2]
    final = E.optimize(g)[-1][1]
    plan = E.build_plan(final, precision="fp16", max_batch=2, tune=False, fuse_stem=False)
    kinds = [s["kind"] for s in plan.steps]
    assert kinds[:3] == ["input", "conv", "maxpool"] and kinds[-3:] == ["gpool", "classifier", "softmax"]
    assert kinds.count("conv") == 53 and plan.steps[0]["im2col"]["R"] == 192  # 7 x 7 x 3 = 147 taps, padded to 192
    eng = E.Engine(plan, numpy=True)  # the NumPy runtime in either mode: the kernels' arithmetic, read back here
    eng._x = x
    arrays = plan.arrays
    for s in plan.steps:
        eng.run_step(s["id"], 2)
        if s["kind"] == "input":
            cols = E.im2col(x, 7, 7, 2, [3, 3, 3, 3])
            got = eng._view(s["dst"], 2).astype(np.float64)
            np.testing.assert_array_equal(got[..., :147], cols.astype(np.float16))
            assert not got[..., 147:].any()
        elif s["kind"] == "conv":
            xin = eng._view(s["src"], 2).astype(np.float64)
            w = arrays[f"{s['id']}/w"].astype(np.float64).reshape(s["kh"], s["kw"], -1, s["K"])
            res = eng._view(s["res"], 2).astype(np.float64) if s.get("res") else None
            want = E.cbr_spec(xin, w, arrays[f"{s['id']}/b"], s["relu"], s["stride"], s["pad"], residual=res)
            got = eng._view(s["dests"][0], 2).astype(np.float64)
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max(), err_msg=s["name"])
        elif s["kind"] == "maxpool":
            want = E.maxpool_spec(eng._view(s["src"], 2).astype(np.float64), 3, 2, [1, 1, 1, 1])
            np.testing.assert_array_equal(eng._view(s["dst"], 2).astype(np.float64), want)
    pooled = eng._view(plan.steps[-3]["src"], 2).astype(np.float64).mean(axis=(1, 2))
    np.testing.assert_allclose(eng.pooled[:2], pooled, rtol=1e-5, atol=1e-5)
    z = pooled @ arrays[f"{plan.steps[-2]['id']}/w"] + arrays[f"{plan.steps[-2]['id']}/b"]
    np.testing.assert_allclose(eng.logits[:2], z, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(eng.out[:2], E.softmax_spec(z), rtol=1e-4, atol=1e-6)
    _, vals = E.run_graph(g, x, keep=True)
    ref = vals["predictions"]
    # no top-1 check: with random weights at 64 x 64 the leading logits lie close, and the order of a BLAS's sums
    # (another machine's NumPy) moves FP16 roundings enough to swap them (measured: one image of two on an H200 host)
    assert np.abs(eng.logits[:2] - ref).max() < 0.25 * np.abs(ref).max()


def test_an_fp8_plan_runs_resnet50_step_by_step(calibrated):
    """An FP8 plan in CPU mode (the NumPy runtime, the kernels' arithmetic): e4m3 activations and weights, per-channel
    weight scales; each convolution gives, to e4m3's rounding of its output, what its decoded input and weights give
    in float64, with the bias and the residual added in real units; and each is set to run on a Hopper kernel."""
    from kernels.inference_engine.precision import E4M3_MAX, from_e4m3

    g, x = calibrated
    x = x[:2]
    final = E.optimize(g)[-1][1]
    plan = E.build_plan(final, precision="fp8", max_batch=2, tune=False, x_calib=calibrated[1])
    assert plan.header["precision"] == "fp8" and plan.header["calibration"] == "percentile"
    eng = E.Engine(plan, numpy=True)  # the NumPy runtime in either mode: the kernels' arithmetic, read back here
    eng._x = x
    a = plan.arrays
    convs = 0
    for s in plan.steps:
        eng.run_step(s["id"], 2)
        if s["kind"] != "conv":
            continue
        convs += 1
        i = s["id"]
        assert s["kernel"] in E.WG and E.wg_fits(s, itemsize=1) and a[f"{i}/w"].dtype == np.uint8
        w = from_e4m3(a[f"{i}/w"]).astype(np.float64).reshape(s["kh"], s["kw"], -1, s["K"])
        xin = from_e4m3(eng._view(s["src"], 2)).astype(np.float64)
        res = from_e4m3(eng._view(s["res"], 2)).astype(np.float64) * s["res_scale"] if s.get("res") else None
        want = E.cbr_spec(xin, w * a[f"{i}/scale"], a[f"{i}/b"], s["relu"], s["stride"], s["pad"], residual=res)
        s_y = 1.0 / a[f"{i}/inv"][0]
        got = from_e4m3(eng._view(s["dests"][0], 2)).astype(np.float64) * s_y
        want = np.clip(want, -E4M3_MAX * s_y, E4M3_MAX * s_y)  # saturated, as the kernels store
        assert np.all(np.abs(got - want) <= np.abs(want) / 16 + 2.0 ** -10 * s_y + 1e-6 * np.abs(want).max()), s["name"]
    assert convs == 52 and plan.steps[0]["kind"] == "stem"  # the stem and its pool: one FP16 step (its own test)
    assert np.isfinite(eng.logits[:2]).all() and eng.out[:2].sum(axis=1) == pytest.approx(1.0, abs=1e-5)


def _stem_spec(x, w, b, pad):
    """The fused stem's arithmetic, from the layer specs: the input rounded to FP16, the convolution (7 x 7, stride
    2) + bias + ReLU rounded to FP16, then the 3 x 3 max pool of stride 2 over one row and column of zeros."""
    xh = x.astype(np.float16).astype(np.float64)
    y = E.cbr_spec(xh, w.astype(np.float64).reshape(7, 7, 3, 64), b, True, 2, pad).astype(np.float16)
    return E.maxpool_spec(y.astype(np.float64), 3, 2, [1, 1, 1, 1])


@pytest.mark.parametrize("precision", ["fp16", "int8", "fp8"])
def test_the_fused_stem_is_the_convolution_then_the_pool(calibrated, precision):
    """ResNet-50's stem and its max pool are one step in every plan but FP32's (one kernel on a GPU): it writes the
    pool's output, quantised with the pool's scale in INT8 and FP8, and neither the input nor the convolution's
    output gets a buffer. In FP16 it writes what the unfused plan's pool writes (to the last bit, but for a rare
    value a float32 sum in another order rounds to the neighbouring FP16)."""
    from kernels.inference_engine.precision import from_e4m3

    g, x = calibrated
    final = E.optimize(g)[-1][1]
    calib = x if precision != "fp16" else None
    plan = E.build_plan(final, precision=precision, max_batch=2, tune=False, x_calib=calib)
    unfused = E.build_plan(final, precision=precision, max_batch=2, tune=False, x_calib=calib, fuse_stem=False)
    stem = plan.steps[0]
    assert stem["kind"] == "stem" and stem["name"] == "conv1_conv+pool1_pool" and "input" not in [
        s["kind"] for s in plan.steps]
    assert [s["kind"] for s in plan.steps].count("conv") == 52 and not any(s["kind"] == "maxpool" for s in plan.steps)
    # the input's im2col matrix (32 x 32 x 192) and the convolution's output (32 x 32 x 64) are gone from the arena
    assert unfused.header["arena"] - plan.header["arena"] == 2 * (32 * 32 * 192 + 32 * 32 * 64)
    eng = E.Engine(plan, numpy=True)
    eng._x = x[:2]
    eng.run_step(0, 2)
    got = eng._f32(eng._view(stem["dst"], 2)).astype(np.float64)
    want = _stem_spec(x[:2], plan.arrays["0/w"], plan.arrays["0/b"], [3, 3, 3, 3])
    assert got.shape == want.shape == (2, 16, 16, 64)
    # the spec sums in float64, the runtime in float32 as the kernel does: a rare value rounds to the next FP16
    if precision == "fp16":
        np.testing.assert_allclose(got, want, rtol=2.0 ** -10)
        assert np.mean(got != want) < 1e-2
        ref = E.Engine(unfused, numpy=True)
        ref._x = x[:2]
        for s in unfused.steps[:3]:
            ref.run_step(s["id"], 2)
        # the same FP16 values, but for the rare one a float32 sum in another order (NumPy's BLAS blocks the fused
        # step's product and the unfused convolution's differently, and its blocking depends on the CPU) rounds to
        # the neighbouring FP16
        fused, unfused_out = eng._view(stem["dst"], 2), ref._view(unfused.steps[2]["dst"], 2)
        ulps = np.abs(fused.view(np.int16).astype(np.int32) - unfused_out.view(np.int16).astype(np.int32))
        assert ulps.max() <= 1 and np.mean(ulps != 0) < 1e-3, (ulps.max(), np.mean(ulps != 0))
    elif precision == "int8":
        diff = np.abs(got - np.clip(np.rint(want * stem["inv_scale"]), -127, 127))
        assert diff.max() <= 1 and diff.mean() < 1e-2
    else:
        codes = eng._view(stem["dst"], 2)
        assert np.isfinite(from_e4m3(codes)).all()
        assert np.mean(codes != E.to_e4m3(want * stem["inv_scale"])) < 1e-2
        np.testing.assert_allclose(got, from_e4m3(E.to_e4m3(want * stem["inv_scale"])), rtol=1 / 8)
    if precision == "fp8":  # the digits network has no FP8 plan (its channels are no whole slices of 64)
        return
    # a network whose first convolution is not this stem keeps its own steps
    digits = E.build_plan(E.optimize(E.load_model_file()[0])[-1][1], precision=precision, max_batch=1, tune=False,
                          x_calib=np.zeros((1, 16, 16, 1), np.float32) if calib is not None else None)
    assert digits.steps[0]["kind"] == "input" and "stem" not in [s["kind"] for s in digits.steps]


def test_the_plan_builder_refuses_what_no_kernel_runs(calibrated):
    final = E.optimize(calibrated[0])[-1][1]
    with pytest.raises(runtime.CourseError, match=r"node 'conv1_conv': a convolution of stride 2.*fp16 or int8"):
        E.build_plan(final, precision="fp32", max_batch=2, tune=False)
    with pytest.raises(runtime.CourseError, match=r"node 'conv1_pad' \(Pad\).*optimisation passes"):
        E.build_plan(calibrated[0], precision="fp16", max_batch=2, tune=False)


def test_which_kernels_take_resnets_convolutions(calibrated):
    """Only the tc kernels and the Hopper wg kernels take a stride, padding or residual; wg needs whole slices of 64
    channels and runs a strided convolution only as a 1 x 1 without padding."""
    final = E.optimize(calibrated[0])[-1][1]
    plan = E.build_plan(final, precision="fp16", max_batch=2, tune=False, fuse_stem=False)
    by = {s["name"]: s for s in plan.steps if s["kind"] == "conv"}
    stem, proj, res3 = by["conv1_conv"], by["conv3_block1_0_conv"], by["conv2_block1_3_conv"]
    assert E.plain(stem) and stem["kh"] == 1  # the im2col stem is a 1 x 1 convolution of 192 channels
    assert E.wg_fits(stem) and E.wg_fits(proj) and E.wg_fits(res3) and proj["stride"] == 2
    assert not E.plain(proj) and not E.plain(res3) and res3["res"]
    for k in ("wmma_64x64", "simt_64x64", "direct3_16x16x32_8x4", "pix_32"):
        assert not E.kernel_fits(proj, k, "fp16") and not E.kernel_fits(res3, k, "fp16")
    assert E.kernel_fits(res3, "tc_64x64", "fp16") and E.kernel_fits(res3, "wg_128x128_s4", "int8")
    assert not E.kernel_fits(res3, "wg_128x128_s4", "fp32")  # wgmma's FP16 and 8-bit paths only
    # INT8 through the TMA: the input's pixels 16 bytes apart, 16 INT8 channels
    odd = dict(res3, src=dict(res3["src"], ld=res3["src"]["ld"] + 8))
    assert E.wg_fits(odd, itemsize=2) and not E.wg_fits(odd, itemsize=1)
    three = by["conv2_block1_2_conv"]
    assert E.wg_fits(three) and E.wg_fits(dict(three, stride=2)) is False  # a strided 3 x 3: not through the TMA view
    # the TMA epilogue's tiles (wgpt): outputs in whole tiles of BN channels, rows the TMA can address, each tile in
    # the precisions it is compiled in (128 x 256 with three stages 8-bit only, with two FP16 only)
    assert res3["K"] == 256 and E.kernel_fits(res3, "wgpt_i2c_128x256_s3", "int8")
    assert E.kernel_fits(res3, "wgpt_i2c_128x128_s4", "fp8") and not E.kernel_fits(res3, "wgpt_i2c_128x256_s3", "fp16")
    assert not E.kernel_fits(dict(res3, K=128, dests=[dict(res3["dests"][0], C=128)]), "wgpt_i2c_128x256_s3", "int8")
    for k in ("wgpt_i2c_128x256_s2", "wgpt_i2c_128x128_s4", "wgpt_i2c_128x64_s4"):
        assert E.kernel_fits(res3, k, "fp16"), k
    assert not E.kernel_fits(res3, "wgpt_i2c_128x256_s2", "int8")
    assert not E.kernel_fits(res3, "wgpt_i2c_128x64_s4", "fp8")
    k64 = dict(res3, K=64, dests=[dict(res3["dests"][0], C=64)], res=dict(res3["res"], C=64))
    assert E.kernel_fits(k64, "wgpt_i2c_128x64_s4", "fp16") and not E.kernel_fits(k64, "wgpt_i2c_128x128_s4", "fp16")
    shifted = dict(res3, res=dict(res3["res"], off=res3["res"]["off"] + 8))  # a residual 8 bytes into a row
    assert not E.tuning.tma_fits(shifted) and E.tuning.tma_fits(res3)
    assert not E.kernel_fits(shifted, "wgpt_i2c_128x256_s3", "int8")
    # in FP16 the same 8 elements are 16 bytes: the TMA addresses them; 4 (8 bytes) it does not
    assert E.tuning.tma_fits(shifted, 2) and E.kernel_fits(shifted, "wgpt_i2c_128x128_s4", "fp16")
    shifted4 = dict(res3, res=dict(res3["res"], off=res3["res"]["off"] + 4))
    assert not E.tuning.tma_fits(shifted4, 2) and not E.kernel_fits(shifted4, "wgpt_i2c_128x128_s4", "fp16")
    assert E.executor.tma_buffers(128, 256, 3, 64) == 3 and E.executor.tma_buffers(128, 256, 3, 128) == 2
    # FP16's buffers are twice as large: two for 128 x 128, three for 128 x 64
    assert E.executor.tma_buffers(128, 128, 4, 128, 2) == 2 and E.executor.tma_buffers(128, 64, 4, 128, 2) == 3
    # the launcher sizes the shared memory by the kernel's own rule (conv_wgmma.cuh's tma_buffers)
    assert ("stages * (bm + bn) * row_bytes + 3 * bm * bn * out_bytes <= 200 * 1024 ? 3 : 2"
            in cuda_c.source(E.catalog.WG_SOURCE))


@pytest.fixture(scope="module")
def keras_resnet():
    pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    return keras.applications.ResNet50(weights=None, input_shape=(SIZE, SIZE, 3))


def test_keras_resnet50_imports_as_the_same_graph(keras_resnet, calibrated):
    """Keras' ResNet50 through graph_from_keras: the same nodes, inputs, attributes and weight shapes as the NumPy
    builder's; with the builder's (calibrated) weights loaded into Keras, the same probabilities."""
    g, x = calibrated
    k = E.graph_from_keras(keras_resnet)
    rename = {k.input: g.input}

    def norm(graph, names):
        return {n.name: (n.op, [names.get(t, t) for t in n.inputs], n.attrs,
                         {w: v.shape for w, v in n.weights.items()}) for n in graph.nodes}

    assert norm(k, rename) == norm(g, {})
    by_name = {n.name: n for n in g.nodes}
    for layer in keras_resnet.layers:
        cls = type(layer).__name__
        if cls == "Conv2D":
            layer.set_weights([by_name[layer.name].weights["w"], by_name[f"{layer.name}/biasadd"].weights["b"]])
        elif cls == "BatchNormalization":
            w = by_name[layer.name].weights
            layer.set_weights([w["gamma"], w["beta"], w["mean"], w["var"]])
        elif cls == "Dense":
            layer.set_weights([by_name[layer.name].weights["w"], by_name[layer.name].weights["b"]])
    want = np.asarray(keras_resnet(x, training=False), np.float64)
    got = E.run_graph(g, x)
    assert np.abs(got - want).max() < 1e-5 * 1000 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.fixture(scope="module")
def wgmma_ptx():
    """The PTX of the Hopper kernels (inference_engine_wgmma.cu for sm_90a), compiled once for every test of this
    module that reads it: one compile takes 10-20 s on two cores, and each test checks other kernels of the same
    text."""
    return cuda_c.compile_ptx(E.catalog.WG_SOURCE, "sm_90a")


@needs_compiler
def test_the_8_bit_epilogue_loads_each_channels_factors_once_a_round_and_converts_without_cvt(wgmma_ptx):
    """The Hopper kernels' INT8 epilogue (inference_engine_wgmma.cu): a thread keeps the same channels in every unit
    of a round, so their scale, bias and 1 / scale are three vectors loaded once a round (they were loaded with every
    unit of 16 outputs, and the 8-bit layers ran no faster than FP16's); and the residual's bytes and the rounded
    result go through float arithmetic, not the conversion instructions (the sums' int -> float stays a cvt). The
    TMA epilogue's tiles (wgpt) load two channels' factors at a time, once for both rows a thread holds of them, and
    store through the TMA."""
    ptx = wgmma_ptx
    checked = 0
    for name, (_, bm, bn, _, persist, wide, tma, splits) in E.WG.items():
        if "int8" not in E.catalog.wg_precisions(name):  # FP16 only: the split tiles, two TMA-epilogue ones
            continue
        body = cuda_c.ptx_entry(ptx, f"conv_{name}_i8")
        assert body, name
        assert not re.search(r"cvt\.rni\.s32\.f32|cvt\.rn\.f32\.s(8|16)\b", body), name
        sums = bm * bn // (bm // 64 * 128)  # a thread's
        if tma:  # the epilogue is written twice, with and without a residual (tma_codes)
            assert len(re.findall(r"cvt\.rn\.f32\.s32", body)) == 2 * sums, name
            loads = body.count("ld.global.nc.v2.f32")  # 3 pairs of factors a column pair, for both rows
            assert loads == 2 * 3 * bn // 8, (name, loads)
            assert body.count("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group") == bn // 128, name
            checked += 1
            continue
        assert len(re.findall(r"cvt\.rn\.f32\.s32", body)) == sums, name  # one a sum
        if persist:  # pieces of 32 columns, 4 a round, 16 channels a unit: 3 vectors of 4 x 16 bytes a round
            rounds = -(-(bn // 32) // 4)
            assert body.count("ld.global.nc.v4.f32") == 3 * 4 * rounds, (name, body.count("ld.global.nc.v4.f32"))
            checked += 1
    assert checked == sum(v[4] for k, v in E.WG.items() if "int8" in E.catalog.wg_precisions(k))


@needs_compiler
def test_the_tma_epilogue_loads_a_rounds_residual_before_it_stores_and_never_branches(wgmma_ptx):
    """The 8-bit TMA epilogue (conv_wgmma.cuh, tma_codes) writes each code over the residual's in shared memory. One
    column group at a time, every load waited for the store before it (it might have written the same place); in
    rounds of TMA_ROUND groups, a round's 2 x TMA_ROUND residual loads come first, then its stores. And each case
    (with a residual, without) is one stretch with no branch in it: ReLU a floor chosen once and the factors loaded
    without a test for null, where ``if (relu)`` and ``p ? load : default`` had cut FP8's epilogue at every pair (371
    branches in conv_wgptw_i2c_128x256_s3_f8, 5-6 us a layer on an H100) and INT8's at every column group."""
    ptx = wgmma_ptx
    checked = 0
    for name, (_, _, bn, _, _, _, tma, _) in E.WG.items():
        if not tma or "int8" not in E.catalog.wg_precisions(name):
            continue
        for sfx in ("i8", "f8"):
            body = cuda_c.ptx_entry(ptx, f"conv_{name}_{sfx}")
            order = "".join({"ld": "l", "st": "s"}.get(m.group(1), "b")  # loads, stores, branches in order
                            for m in re.finditer(r"\b(ld|st)\.shared\.(?:u16|b16)\b|\bbra\b", body))
            stretches = [p for p in order.split("b") if p]
            rounds = bn // 8 // 8  # TMA_ROUND = 8 groups, 2 rows each: 16 loads, then 16 stores
            assert stretches == [("l" * 16 + "s" * 16) * rounds, "s" * (bn // 4)], (name, sfx, stretches[:4])
            checked += 1
    assert checked == 2 * sum(v[6] for k, v in E.WG.items() if "int8" in E.catalog.wg_precisions(k))


FP16_TMA = [k for k in E.catalog.wg_kernels("fp16") if E.WG[k][6]]  # the FP16 tiles with the TMA epilogue


def test_the_fp16_tma_tiles_are_the_tuners_candidates_and_fit_in_shared_memory():
    """FP16 has tiles with the TMA epilogue (wgpt): in the catalog, among the FP16 candidates the auto-tuner times,
    and each one's shared memory (stages, two or three buffers of 64 rows x BN halves a consumer, mbarriers) within
    a Hopper SM's 227 KB, as its 8-bit tiles'."""
    assert FP16_TMA == ["wgpt_i2c_128x128_s4", "wgpt_i2c_128x256_s2", "wgpt_i2c_128x64_s4", "wgpt_i2c_128x64_s8",
                        "wgpt_i2c_64x128_s8", "wgpt_i2c_128x128_s5"]
    assert set(FP16_TMA) <= set(E.catalog.CANDIDATES["fp16"])
    assert not set(FP16_TMA[1:]) & set(E.catalog.CANDIDATES["int8"])
    for k in FP16_TMA:
        assert E.executor.wg_shared_bytes(k, 2) <= 227 * 1024, k
    # 128 x 256: three stages and two buffers a consumer would need more than an SM has
    assert E.executor.wg_shared_bytes("wgpt_i2c_128x256_s2", 2) + 2 * 256 * 128 + 16 > 227 * 1024


@needs_compiler
def test_the_fp16_tma_epilogue_reads_the_residual_writes_by_stmatrix_and_stores_through_the_tma(wgmma_ptx):
    """FP16's TMA epilogue (conv_wgmma.cuh, tma_halves): per thread and case (with a residual, without), BN / 4 words
    of two halves, the residual's words read from shared memory a round (TMA_ROUND = 8 column groups, both rows: 16
    loads) before the round's four stmatrix, one stretch without branches; the bias loaded two channels at a time
    and no scale (FP16 has none); the tile stored in BN / 64 boxes of 64 channels by the TMA."""
    checked = 0
    for name in FP16_TMA:
        bn = E.WG[name][2]
        body = cuda_c.ptx_entry(wgmma_ptx, f"conv_{name}_f16")
        assert body.count("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group") == bn // 64, name
        assert body.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") == 2 * bn // 16, name
        assert body.count("cvt.rn.f16x2.f32") == 2 * bn // 4, name
        assert body.count("ld.global.nc.v2.f32") == 2 * bn // 8, name  # the bias of each column group
        assert "ld.global.nc.v4.f32" not in body, name  # no staged epilogue's factors
        order = "".join("l" if m.group(0).startswith("ld") else "s" if m.group(0) == "stmatrix" else "b"
                        for m in re.finditer(r"\bld\.shared\.(?:u32|b32)\b|\bstmatrix\b|\bbra\b", body))
        stretches = [p for p in order.split("b") if p]
        assert stretches == [("l" * 16 + "s" * 4) * (bn // 64), "s" * (bn // 16)], (name, stretches[:4])
        checked += 1
    assert checked == len(FP16_TMA)


@needs_compiler
def test_no_engine_kernel_has_its_wgmmas_serialised():
    """ptxas's account of the engine's wgmma source (no GPU needed, one compile): no kernel, FP16, INT8 or FP8, has
    its wgmmas serialised, for want of registers (C7512) or because something other than a wgmma reads their
    accumulators (C7514: INT32 sums zeroed as ``= 0``, one register made zero and copied into the others, did it in
    the one-tile INT8 kernels; conv_wgmma.cuh's zero_acc); and the FP16 TMA-epilogue kernels neither spill nor use
    static shared memory (all of it dynamic, as the launcher sizes it)."""
    log = cuda_c.ptxas_log(E.catalog.WG_SOURCE, "sm_90a").replace("\x00", "")
    assert log.count("Compiling entry function") > 50, log[:2000]
    assert "serialized" not in log, [line for line in log.splitlines() if "serialized" in line][:5]
    for name in FP16_TMA:
        fn = f"conv_{name}_f16"
        start = log.index(f"Compiling entry function '{fn}'")
        end = log.find("Compiling entry function", start + 1)
        part = log[start:end if end > 0 else None]
        assert "0 bytes spill stores, 0 bytes spill loads" in part, part
        assert "C7512" not in part and "serialized" not in part, part
        assert "bytes smem" not in part or re.search(r"\b0 bytes smem", part), part


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "int8", "fp8"])
def test_every_resnet_kernel_gives_the_numpy_engines_logits(calibrated, precision):
    """On a GPU: each tensor-core kernel that takes ResNet-50's convolutions (tc, and on Hopper the wg kernels in
    FP16 and INT8), put on every convolution it fits, gives the NumPy runtime's logits from an arena poisoned
    beforehand: INT8 to the order of a float sum (the integer sums are exact); FP16 to a few percent, as the 53
    layers amplify each one's last-bit differences of summation order (measured on an H100: 1.7e-2 for every
    kernel)."""
    from gpucourse import gpus

    hopper = gpus.status("06.wgmma").runs
    if precision == "fp8" and not hopper:
        with pytest.raises(runtime.CourseError, match="needs wgmma"):  # one line naming what the GPU lacks
            E.build_plan(E.optimize(calibrated[0])[-1][1], precision="fp8", max_batch=2, x_calib=calibrated[1])
        return
    g, x = calibrated
    final = E.optimize(g)[-1][1]
    # the stem unfused: every convolution on the kernels under test (the fused stem, which sums in FP32 in every
    # plan, has its own test)
    plan = E.build_plan(final, precision=precision, max_batch=len(x), tune=False,
                        x_calib=x if precision in ("int8", "fp8") else None, fuse_stem=False)
    ref = E.Engine(plan, numpy=True)
    ref.infer(x)
    want = np.asarray(ref.logits[:len(x)], np.float64)
    eng = E.Engine(plan, graphs=False)
    kernels = (() if precision == "fp8" else E.catalog.TC) + (E.catalog.wg_kernels(precision) if hopper else ())
    convs = [s for s in plan.steps if s["kind"] == "conv"]
    defaults = {s["id"]: s["kernel"] for s in convs}
    for kernel in kernels:
        used = 0
        for s in convs:
            s["kernel"] = kernel if E.kernel_fits(s, kernel, precision) else defaults[s["id"]]
            used += s["kernel"] == kernel
            eng.refresh(s["id"])
        eng.arena.fill({"fp16": np.nan, "int8": -128, "fp8": 0x7F}[precision])
        eng.infer(x)
        got = eng.logits[:len(x)].get().astype(np.float64)
        assert used > 0, kernel
        if precision == "fp8":
            # every tile sums each output in the same order: the kernels agree with one another exactly; against
            # NumPy's float64 sums the tensor cores' FP8 sums round differently, and e4m3's 3-bit mantissa turns
            # each difference into a whole step that 53 layers amplify (measured on an H100: 0.44 of the largest
            # logit at 64 x 64, with random weights), so that comparison only catches a kernel gone wrong
            first = got if kernel == kernels[0] else first
            assert np.isfinite(got).all() and np.abs(got - first).max() <= 1e-5 * np.abs(first).max(), kernel
            assert np.abs(got - want).max() <= 0.75 * np.abs(want).max(), (kernel, np.abs(got - want).max())
            continue
        tol = {"fp16": 5e-2, "int8": 1e-5}[precision]
        assert np.abs(got - want).max() <= tol * np.abs(want).max(), (kernel, np.abs(got - want).max())
        if precision == "int8":  # FP16's close leading logits may swap (see the step-by-step test); INT8's sums are exact
            assert (got.argmax(1) == want.argmax(1)).all(), kernel


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "int8", "fp8"])
def test_a_persistent_block_that_walks_many_tiles_gives_the_one_tile_blocks_output(calibrated, precision,
                                                                                    monkeypatch):
    """On Hopper: the persistent wgmma tiles (wgp_*) with the grid cut to a single SM's worth of blocks, so that
    each block walks tens of tiles (the stage ring's phases carried from tile to tile, the next tile's loads in
    flight during this one's epilogue), give exactly the logits of the same tile one block a tile (wg_*): the
    sums are made in the same order."""
    from gpucourse import gpus
    from kernels.inference_engine import executor

    if not gpus.status("06.wgmma").runs:
        pytest.skip("the persistent tiles are Hopper's (wgmma)")
    g, x = calibrated
    plan = E.build_plan(E.optimize(g)[-1][1], precision=precision, max_batch=len(x), tune=False,
                        x_calib=x if precision in ("int8", "fp8") else None)
    convs = [s for s in plan.steps if s["kind"] == "conv"]
    eng = E.Engine(plan, graphs=False)
    poison = {"fp16": np.nan, "int8": -128, "fp8": 0x7F}[precision]
    for persistent in [k for k in E.catalog.wg_kernels(precision) if E.WG[k][4]]:
        logits = []
        _, bm, bn, _, _, wide, _, _ = E.WG[persistent]
        one_tile = next(k for k, v in E.WG.items()
                        if v[:3] == (True, bm, bn) and not v[4] and v[5] == wide and v[7] == 1)
        for kernel in (one_tile, persistent):
            used = 0
            for s in convs:
                if E.kernel_fits(s, kernel, precision):
                    s["kernel"] = kernel
                    used += 1
                eng.refresh(s["id"])
            assert used > 0, kernel
            monkeypatch.setattr(executor, "_sms", lambda: 1)
            for s in convs:
                eng.refresh(s["id"])
            eng.arena.fill(poison)
            eng.infer(x)
            logits.append(eng.logits[:len(x)].get().copy())
            monkeypatch.undo()
        assert np.isfinite(logits[1]).all(), persistent
        np.testing.assert_array_equal(logits[1], logits[0], err_msg=persistent)


@pytest.mark.gpu
def test_the_fp16_tma_tiles_give_each_layer_the_numpy_runtimes_output(calibrated, monkeypatch):
    """On Hopper: each FP16 tile with the TMA epilogue (wgpt), on every convolution of ResNet-50 it fits, from the
    NumPy runtime's inputs of that layer (its arena as that layer found it, copied in) into a destination poisoned
    beforehand, with the grid cut to a single SM's worth of blocks (each block walks many tiles, its buffers taken in
    turn; the last tile of the 7 x 7 layers has rows past the output's): the NumPy runtime's output within FP16's
    1% of the layer's largest value (the auto-tuner's test), and exactly the staged persistent tile's of the same
    shape (wgp: the same sums, the same arithmetic)."""
    from gpucourse import gpus
    from kernels.inference_engine import executor

    if not gpus.status("06.wgmma").runs:
        pytest.skip("the TMA-epilogue tiles are Hopper's (wgmma)")
    cp = runtime.cupy()
    g, x = calibrated
    n = len(x)
    plan = E.build_plan(E.optimize(g)[-1][1], precision="fp16", max_batch=n, tune=False)
    # the NumPy runtime step by step: the arena as each convolution finds it and what it writes there (the arena's
    # places are reused, so the end of an inference no longer holds every layer's input)
    ref = E.Engine(plan, numpy=True)
    ref._x = np.ascontiguousarray(x)
    before, after = {}, {}
    for step in plan.steps:
        if step["kind"] == "conv":
            before[step["id"]] = ref.arena.copy()
        ref.run_step(step["id"], n)
        if step["kind"] == "conv":
            after[step["id"]] = np.asarray(ref._view(step["dests"][0], n), np.float32).copy()
    eng = E.Engine(plan, graphs=False)
    monkeypatch.setattr(executor, "_sms", lambda: 1)
    convs = [s for s in plan.steps if s["kind"] == "conv"]
    for kernel in FP16_TMA:
        _, bm, bn, _, _, _, _, _ = E.WG[kernel]
        staged = next(k for k, v in E.WG.items() if v[:3] == (True, bm, bn) and v[4] and not v[5] and not v[6])
        used, with_res = 0, 0
        for s in convs:
            if not E.kernel_fits(s, kernel, "fp16"):
                continue
            d, default = s["dests"][0], s["kernel"]
            want = after[s["id"]]
            outs = []
            for k in (kernel, staged):
                s["kernel"] = k
                eng.refresh(s["id"])
                eng.arena[...] = cp.asarray(before[s["id"]])  # the layer's inputs (and residual) as NumPy made them
                eng._view(d, n)[...] = np.nan
                eng.run_step(s["id"], n)
                outs.append(eng._view(d, n).get().astype(np.float32))
            s["kernel"] = default
            eng.refresh(s["id"])
            got = outs[0]
            assert np.isfinite(got).all(), (kernel, s["name"])
            bound = 1e-2 * (np.abs(want).max() + 1e-3)
            assert np.abs(got - want).max() <= bound, (kernel, s["name"], np.abs(got - want).max(), bound)
            np.testing.assert_array_equal(got, outs[1], err_msg=f"{kernel} {s['name']}")
            used += 1
            with_res += bool(s.get("res"))
        assert used > with_res > 0, kernel  # every tile, with a residual and without
        # (ResNet-50's residual layers have K = 256 .. 2048: each tile takes some; its reduce layers none)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "int8", "fp8"])
@pytest.mark.parametrize("tile", [4, 8])
def test_the_fused_stem_kernel_gives_the_numpy_runtimes_output(precision, tile, monkeypatch):
    """On a GPU: the fused stem kernel (inference_engine_stem.cuh), in both its tiles, writes what the NumPy runtime
    writes, into an arena poisoned beforehand, at a size whose pool tiles overhang the image (72 x 72: a pool output
    of 18 x 18): FP16 to one rounding of the FP32 sums' order, INT8 and FP8 codes at most one step apart, and
    those rare."""
    from gpucourse import gpus
    from kernels.inference_engine import executor
    from kernels.inference_engine.precision import from_e4m3

    if precision == "fp8" and not gpus.status("06.wgmma").runs:
        pytest.skip("FP8 plans run on Hopper's wgmma kernels only")
    cp = runtime.cupy()
    size, n = 72, 3
    rng = np.random.default_rng(4)
    g = E.calibrate_batchnorm(E.resnet50(size, seed=0), rng.standard_normal((2, size, size, 3)).astype(np.float32),
                              progress=False)
    x = rng.standard_normal((n, size, size, 3)).astype(np.float32)
    plan = E.build_plan(E.optimize(g)[-1][1], precision=precision, max_batch=n, tune=False,
                        x_calib=x if precision != "fp16" else None)
    stem = plan.steps[0]
    assert stem["kind"] == "stem" and (stem["Ho"], stem["Wo"]) == (18, 18)
    ref = E.Engine(plan, numpy=True)
    ref._x = x
    ref.run_step(0, n)
    want = np.asarray(ref._view(stem["dst"], n))
    # the tile: 8 x 8 where the batch gives every SM two blocks, else 4 x 4; here chosen by the SM count seen
    monkeypatch.setattr(executor, "_sms", lambda: 1 if tile == 8 else 10**6)
    eng = E.Engine(plan, graphs=False)
    eng.arena.fill({"fp16": np.nan, "int8": -128, "fp8": 0x7F}[precision])
    eng._x = cp.asarray(x)
    eng.run_step(0, n)
    cp.cuda.Device().synchronize()
    assert eng._prepared[(0, n)][0].name == f"stem_pool{tile}_{E.SUFFIX[precision]}"
    got = eng._view(stem["dst"], n).get()
    for _ in range(3):  # and the same again, whatever shared memory held before (the padded taps read only the patch)
        eng.run_step(0, n)
        assert np.array_equal(eng._view(stem["dst"], n).get(), got)
    if precision == "fp16":
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=2.0 ** -10, atol=1e-3)
    elif precision == "int8":
        diff = np.abs(got.astype(int) - want.astype(int))
        assert diff.max() <= 1 and diff.mean() < 1e-3, (diff.max(), diff.mean())
    else:
        a, b = from_e4m3(got).astype(np.float64), from_e4m3(want).astype(np.float64)
        assert np.isfinite(a).all()
        off = np.abs(a - b) > 0
        assert np.all(np.abs(a - b) <= np.abs(b) / 8 + 2.0 ** -9) and off.mean() < 1e-3, off.mean()


# ------------------------------------------------------------------------- per-layer precision (a mixed plan)

def _mixed_plan(calibrated, precision, **kw):
    g, x = calibrated
    # the stem, stage conv2 and one block of conv4 in FP16: FP16 -> 8-bit and 8-bit -> FP16 reformats, and the
    # shortcut a block adds read across precisions (conv4_block2 adds block 1's INT8 output; block 3 block 2's FP16)
    return E.build_plan(E.optimize(g)[-1][1], precision=precision, max_batch=len(x), tune=False, x_calib=x,
                        keep_fp16=["conv1", "conv2", "conv4_block2"], **kw)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_a_mixed_resnet_plan_runs_step_by_step(calibrated, precision):
    """An INT8 or FP8 plan of ResNet-50 with the stem, stage conv2 and one block kept in FP16 (TensorRT's per-layer
    precision), in CPU mode: each reformat step writes the tensor's copy in its reader's precision exactly as the
    kernels' store rounds it (quantised with the tensor's scale, or dequantised), the residual of a block included;
    each convolution gives what its spec gives on the values it read, to its own precision's rounding; a plan with
    every layer kept in FP16 is the FP16 plan, logit for logit; and the longest name in layer_precisions wins."""
    from kernels.inference_engine.precision import E4M3_MAX, from_e4m3

    g, x = calibrated
    x = x[:2]
    plan = _mixed_plan(calibrated, precision)
    fp16_layers = set(plan.header["layer_precisions"])
    assert len(fp16_layers) == 1 + 10 + 3 and "conv4_block2_3_conv" in fp16_layers and "conv1_conv" in fp16_layers
    reformats = {s["name"]: s for s in plan.steps if s["kind"] == "reformat"}
    # the stem writes its pooled output in FP16 for conv2 (FP16): no reformat; each crossing: one copy for its readers
    assert set(reformats) == {"conv2_block3_out:fp16->" + precision, "conv4_block1_out:" + precision + "->fp16",
                              "conv4_block2_out:fp16->" + precision}
    by = {s["name"]: s for s in plan.steps}
    res = by["conv4_block2_3_conv"]["res"]  # block 1's output, dequantised, is block 2's shortcut
    assert res["arena"] == "fp16" and res["tensor"] == "conv4_block1_out"
    assert by["conv4_block3_3_conv"]["res"]["tensor"] == "conv4_block2_out" and "arena" not in \
        by["conv4_block3_3_conv"]["res"]
    eng = E.Engine(plan, numpy=True)
    eng._x = x
    a = plan.arrays

    def real(loc):  # an arena's values in real units before any scale
        return eng._f32(eng._view(loc, 2)).astype(np.float64)

    for s in plan.steps:
        eng.run_step(s["id"], 2)
        i, p = s["id"], s.get("precision", precision)
        if s["kind"] == "reformat":
            v = (eng._f32(eng._view(s["src"], 2)) * np.float32(s["scale"])).astype(np.float32)
            inv = np.float32(s["inv_scale"])  # the kernels' store multiplies by 1 / scale
            want = (v.astype(np.float16) if s["to"] == "fp16" else E.to_e4m3(v * inv) if s["to"] == "fp8" else
                    np.clip(np.rint(v * inv), -127, 127).astype(np.int8))
            np.testing.assert_array_equal(eng._view(s["dst"], 2), want, err_msg=s["name"])
        elif s["kind"] == "conv":
            w = (from_e4m3(a[f"{i}/w"]) if p == "fp8" else a[f"{i}/w"]).astype(np.float64)
            w = w.reshape(s["kh"], s["kw"], -1, s["K"])
            if p != "fp16":
                w = w * a[f"{i}/scale"]
            r = real(s["res"]) * s["res_scale"] if s.get("res") else None
            want = E.cbr_spec(real(s["src"]), w, a[f"{i}/b"], s["relu"], s["stride"], s["pad"], residual=r)
            got = real(s["dests"][0])
            if p == "fp16":
                np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max(), err_msg=s["name"])
                continue
            s_y = 1.0 / a[f"{i}/inv"][0]
            lim = (127 if p == "int8" else E4M3_MAX) * s_y
            want = np.clip(want, -lim, lim)
            step = 0.5 * s_y * 1.001 if p == "int8" else np.abs(want) / 16 + 2.0 ** -10 * s_y
            assert np.all(np.abs(got * s_y - want) <= step + 1e-6 * np.abs(want).max()), s["name"]
    assert np.isfinite(eng.logits[:2]).all()
    # every layer in FP16: the FP16 plan's arithmetic, in the FP16 arena alone
    final = E.optimize(g)[-1][1]
    everything = E.build_plan(final, precision=precision, max_batch=2, tune=False, x_calib=calibrated[1],
                              keep_fp16=["conv1", "conv2", "conv3", "conv4", "conv5"])
    assert everything.header["arena"] == 0 and not any(s["kind"] == "reformat" for s in everything.steps)
    fp16 = E.build_plan(final, precision="fp16", max_batch=2, tune=False)
    np.testing.assert_array_equal(E.mixed.logits(everything, x, numpy=True), E.mixed.logits(fp16, x, numpy=True))
    # the longest name that names a layer wins: conv4 in FP16 but its block 2
    plan = E.build_plan(final, precision=precision, max_batch=2, tune=False, x_calib=calibrated[1],
                        layer_precisions={"conv4": "fp16", "conv4_block2": precision})
    assert set(plan.header["layer_precisions"]) == {n.name for n in final.nodes if n.name.startswith("conv4")
                                                    and not n.name.startswith("conv4_block2")}


def test_keep_fp16_for_keeps_the_costliest_parts_first(calibrated):
    """The automatic choice (mixed.keep_fp16_for): each stage's sensitivity (the plan with that stage alone in INT8,
    the rest FP16) measured with the engine, then the stages kept in FP16 one at a time, the noisiest first, until the
    top-1 classes agree on the target share; a target no plan meets ends with every stage in FP16."""
    g, x = calibrated
    final = E.optimize(g)[-1][1]
    ref = E.reference_logits(final, x[:2])
    # the logits before the softmax, from either graph (the folded weights rounded to float32)
    assert np.abs(ref - E.reference_logits(g, x[:2])).max() < 1e-4 * np.abs(ref).max()
    r = E.keep_fp16_for(final, x, x[:2], ref, precision="int8", target=1.01, numpy=True, max_batch=2, progress=False)
    assert [row["unit"] for row in r["rows"]] == ["conv1", "conv2", "conv3", "conv4", "conv5"] == E.units(final)
    order = [row["unit"] for row in sorted(r["rows"], key=lambda row: -row["noise"])]
    assert [t["keep_fp16"] for t in r["trail"]] == [[u for u in E.units(final) if u in order[:k]] for k in range(6)]
    assert not r["met"] and r["keep_fp16"] == E.units(final) and r["trail"][-1]["noise"] < r["trail"][0]["noise"]
    assert E.fp16_share(final, r["keep_fp16"]) == pytest.approx(1.0) and 0 < E.fp16_share(final, ["conv5"]) < 0.3
    easy = E.keep_fp16_for(final, x, x[:2], ref, precision="int8", target=0.0, numpy=True, max_batch=2,
                           rows=r["rows"], progress=False)
    assert easy["met"] and easy["keep_fp16"] == [] and len(easy["trail"]) == 1
    assert E.units(final, "block")[:3] == ["conv1_conv", "conv2_block1", "conv2_block2"]
    assert len(E.units(final, "layer")) == 53


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_a_mixed_plan_on_the_gpu_gives_its_numpy_runtimes_output(calibrated, precision):
    """On a GPU: a mixed plan (stem, conv2 and one block of conv4 in FP16, the rest INT8 or, on Hopper, FP8), step by
    step from the NumPy runtime's arenas: each step writes what the NumPy runtime writes, to its precision's last
    step (an 8-bit value one quantisation step apart where the kernel's float sum sits on a rounding boundary); each
    reformat kernel (8 channels a thread) exactly. Run straight through from both arenas poisoned, the logits are
    finite and a CUDA graph gives them bit for bit. (Not the NumPy runtime's logits: the FP16 layers' sums in another
    order move a few of conv3's INT8 inputs by one step, and a random network's 40 layers after that amplify it,
    measured on an H100: 0.4 of the largest logit in INT8, as FP8's own test says.)"""
    from gpucourse import gpus
    from kernels.inference_engine.precision import E4M3_MAX

    if precision == "fp8" and not gpus.status("06.wgmma").runs:
        pytest.skip("FP8 plans run on Hopper's wgmma kernels only")
    cp = runtime.cupy()
    g, x = calibrated
    plan = _mixed_plan(calibrated, precision)
    n = len(x)
    ref = E.Engine(plan, numpy=True)
    eng = E.Engine(plan, graphs=False)
    ref._x, eng._x = x, cp.asarray(x)
    checked = {"fp16": 0, precision: 0}
    for s in plan.steps:
        for p, arena in eng.arenas.items():  # this step's inputs: the NumPy runtime's
            arena[...] = cp.asarray(ref.arenas[p])
        eng.pooled[...] = cp.asarray(ref.pooled)
        ref.run_step(s["id"], n)
        eng.run_step(s["id"], n)
        if s["kind"] in ("gpool", "classifier"):
            got, want = (eng.pooled[:n].get(), ref.pooled[:n]) if s["kind"] == "gpool" else \
                (eng.logits[:n].get(), ref.logits[:n])
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=s["name"])
        for d in s.get("dests") or ([s["dst"]] if "dst" in s else []):
            p = d.get("arena", precision)
            got = ref._f32(eng._view(d, n).get()).astype(np.float64)
            want = ref._f32(np.asarray(ref._view(d, n))).astype(np.float64)
            if s["kind"] == "reformat":
                np.testing.assert_array_equal(got, want, err_msg=s["name"])
            elif p == "fp16":
                np.testing.assert_allclose(got, want, atol=1e-2 * np.abs(want).max(), err_msg=s["name"])
            elif p == "int8":  # the codes: at most one step apart, and rarely
                assert np.abs(got - want).max() <= 1 and np.mean(got != want) < 0.02, s["name"]
            else:  # e4m3 codes: one step apart (an eighth of the larger value at most), and near zero, where a
                # sum cancels, the tensor cores' FP8 sums (fewer bits than FP32's: measured on an H100, 9 steps of a
                # value near 0) within 1% of the tensor's largest value
                err = np.abs(got - want) - np.maximum(np.abs(got), np.abs(want)) / 8
                assert err.max() <= 1e-2 * np.abs(want).max() and np.mean(got != want) < 0.05, \
                    (s["name"], err.max(), np.abs(want).max(), np.mean(got != want))
            assert np.abs(want).max() <= (127 if p == "int8" else E4M3_MAX if p == "fp8" else np.inf)
            checked[p] += 1
    assert checked["fp16"] >= 14 and checked[precision] >= 30, checked
    for p, arena in eng.arenas.items():
        arena.fill({"fp16": np.nan, "int8": -128, "fp8": 0x7F}[p])
    eng.infer(x)
    got = eng.logits[:n].get().astype(np.float64)
    assert np.isfinite(got).all()
    reformats = [s for s in plan.steps if s["kind"] == "reformat"]
    assert len(reformats) == 3
    for s in reformats:  # 8 channels a thread
        assert eng._prepared[(s["id"], n)][0].name.startswith("reformat8_"), s["name"]
    # and as one CUDA graph (both arenas' pointers fixed in it): the same kernels, the same logits
    graph = E.Engine(plan, graphs=True)
    graph.infer(x)
    np.testing.assert_array_equal(graph.logits[:n].get().astype(np.float64), got)


def test_the_global_pool_takes_8_bytes_a_load_in_the_8_bit_types():
    """ResNet-50's global pool (inference_engine.cu's global_pool): 8 channels a thread in FP16 (16 bytes) and in
    INT8 and FP8 (8 bytes: 16 a thread left too few threads), 1 where the rows or the first element do not allow it;
    the launcher's grid and the kernel's own test agree (pool_width)."""
    from kernels.inference_engine.executor import pool_width

    assert pool_width(2, 2048, 2048, 0) == 8 and pool_width(1, 2048, 2048, 0) == 8
    assert pool_width(1, 2048, 2048, 8) == 1 and pool_width(1, 2052, 2052, 0) == 1 and pool_width(2, 2048, 2048, 8) == 8
    src = cuda_c.source(E.SOURCE)
    assert "sizeof(T) == 1 ? 8 : 16 / sizeof(T)" in src


def test_the_split_tiles_are_fp16_and_take_long_reductions_only():
    """The wgs<k> tiles (one tile, its reduction split over k blocks): FP16 only, each split at least two slices of
    64 channels; one kernel a shape in inference_engine_wgmma.cu, the split the launch's."""
    split = [k for k, v in E.WG.items() if v[7] > 1]
    assert split and set(split) <= set(E.catalog.wg_kernels("fp16"))
    assert not set(split) & (set(E.catalog.wg_kernels("int8")) | set(E.catalog.wg_kernels("fp8")))
    step = {"kind": "conv", "kh": 3, "kw": 3, "K": 512, "stride": 1, "pad": [1, 1, 1, 1], "relu": True,
            "src": {"C": 512, "ld": 512, "base": 0, "off": 0, "H": 7, "W": 7},
            "dests": [{"ld": 512, "base": 0, "off": 0}]}
    assert all(E.kernel_fits(step, k, "fp16") for k in split)  # 72 slices
    assert not any(E.kernel_fits(step, k, "int8") for k in split)
    short = {**step, "kh": 1, "kw": 1, "pad": [0, 0, 0, 0], "src": {**step["src"], "C": 256}}  # 4 slices
    assert [k for k in split if E.kernel_fits(short, k, "fp16")] == ["wgs2_i2c_64x64_s6", "wgs2_i2c_64x128_s4"]
    assert E.catalog.wg_function("wgs8_i2c_64x64_s6") == "conv_wgs_i2c_64x64_s6"


@needs_compiler
def test_the_split_tiles_and_their_reduction_are_compiled(wgmma_ptx):
    ptx = wgmma_ptx
    for k in {E.catalog.wg_function(k) for k, v in E.WG.items() if v[7] > 1}:
        body = cuda_c.ptx_entry(ptx, f"{k}_f16")
        assert body and "wgmma.mma_async" in body, k
        assert "%ctaid.z" in body, k  # the block's share of the reduction
    assert cuda_c.ptx_entry(ptx, "split_reduce_f16")


def test_a_compile_run_of_one_batch_size_keeps_the_others_from_the_record(monkeypatch):
    """figure "resnet_compile" measured at batch 1 only (GPUCOURSE_COMPILE_BATCHES=1): batch 64's engine time,
    torch.compile time and ratio stay as this GPU's record has them, each pair from its own run, and "runs" (printed
    by compile_text) says when each batch size was measured."""
    import types

    from benchmarks import inference_engine_resnet as R
    from gpucourse import records

    row = {"name": "PyTorch torch.compile + CUDA graph, FP16"}
    old = {"engine": {"FP16, batch 1": {"ms": 0.48}, "FP16, batch 64": {"ms": 2.2}},
           "pytorch": {"rows": [{**row, "b1": {"ms": 0.52}, "b64": {"ms": 2.7}, "compile_s_b64": 300.0}]},
           "fp16_vs_compile_b1": {"ratio": 0.52 / 0.48, "goal": 1.2},
           "fp16_vs_compile_b64": {"ratio": 2.7 / 2.2, "goal": 1.2}, "measured": "2026-11-25 04:55 UTC"}
    monkeypatch.setattr(records, "latest", lambda lesson, gpu=None: {"figures": {"resnet_compile": old}})
    monkeypatch.setattr(runtime, "get", lambda: types.SimpleNamespace(device={"name": "GPU"}))
    monkeypatch.setattr(records, "_now", lambda: "2026-11-25 23:29 UTC")
    new = {"size": 224, "batch": 64, "engine": {"FP16, batch 1": {"ms": 0.324}},
           "pytorch": {"available": True, "compile_mode": "max-autotune", "torch": "2", "compile_s": 190.0,
                       "rows": [{**row, "b1": {"ms": 0.5}, "compile_s_b1": 190.0}]},
           "fp16_vs_compile_b1": {"ratio": 0.5 / 0.324, "goal": 1.2}}
    R._keep_other_batches(new, (1,))
    assert new["engine"]["FP16, batch 64"] == {"ms": 2.2} and new["engine"]["FP16, batch 1"] == {"ms": 0.324}
    assert new["fp16_vs_compile_b64"]["ratio"] == pytest.approx(2.7 / 2.2)
    assert new["fp16_vs_compile_b1"]["ratio"] == pytest.approx(0.5 / 0.324)
    assert new["pytorch"]["rows"][0]["b64"] == {"ms": 2.7} and new["pytorch"]["rows"][0]["b1"] == {"ms": 0.5}
    assert new["runs"]["batch 1"] == "2026-11-25 23:29 UTC" and new["runs"]["batch 64"] == "2026-11-25 04:55 UTC"
    text = R.compile_text(new)
    assert "batch  1: engine 0.324 ms, torch.compile 0.500 ms: the engine 1.54x" in text
    assert "batch 64: engine 2.200 ms, torch.compile 2.700 ms: the engine 1.23x" in text
    assert "(run of 2026-11-25 04:55 UTC)" in text and "(run of 2026-11-25 23:29 UTC)" in text


def test_the_mixed_plans_bound_takes_their_8_bit_layers_at_half_and_at_their_floors():
    """benchmarks/inference_engine_resnet.mixed_bound on a record of four layers: the layers the mixed plan keeps
    in FP16 (by prefix) stay as the FP16 plan ran them, the others at half their FP16 time or at their 8-bit floors
    (half the larger FP16 floor), the reformat as measured; the plan in 8 bits everywhere beside it."""
    from benchmarks import inference_engine_resnet as R

    def conv(name, ms, compute, memory):
        return {"name": name, "kind": "conv", "ms": ms, "compute_ms": compute, "memory_ms": memory}
    fp16 = [{"name": "conv1_conv+pool1_pool", "kind": "stem", "ms": 1.0}, conv("conv2_block1_1_conv", 2.0, 0.5, 1.0),
            conv("conv5_block1_1_conv", 3.0, 1.0, 0.4), {"name": "predictions", "kind": "classifier", "ms": 1.0}]
    mixed = fp16[:2] + [{"name": "x:fp16->int8", "kind": "reformat", "ms": 0.5}, conv("conv5_block1_1_conv", 2.0, 0, 0),
                        fp16[3]]
    t = {"batch": 64, "layers": fp16,
         "layers_by_plan": {"INT8, batch 64": [dict(r, ms=r["ms"] / 2) for r in fp16], "INT8 (mixed), batch 64": mixed},
         "engine": {"INT8 (mixed), batch 64": {"keep_fp16": ["conv1", "conv2"]}},
         "agreement": {"INT8 (mixed), batch 64": {"top1": 0.99}, "INT8, batch 64": {"top1": 0.95}}}
    b = R.mixed_bound(t)["INT8 (mixed), batch 64"]
    assert b["share"] == pytest.approx(3.0 / 7.0)
    assert b["measured"] == pytest.approx(7.0 / 6.5)
    assert b["half"] == pytest.approx(7.0 / (4.0 + 1.5 + 0.5))
    assert b["floor"] == pytest.approx(7.0 / (4.0 + 0.5 + 0.5))
    assert b["everywhere"] == pytest.approx(2.0) and b["top1_everywhere"] == 0.95
    text = R.mixed_bound_text(t)
    assert "INT8 everywhere: 2.00x" in text and "99.0%" in text and "goal 1.3x" in text
    assert R.plot_mixed_bound(t, "a test").axes[0].get_legend() is not None



def test_a_records_floors_are_read_with_todays_byte_count():
    """benchmarks/inference_engine_resnet.floored: a convolution's stored bytes are replaced by layer_costs' count
    and its memory floor scaled with them (the record's bandwidth kept); steps without bytes are left alone."""
    from benchmarks import inference_engine_resnet as R

    costs = {r["name"]: r for r in E.layer_costs(R._optimised_for_costs(), 64)}
    right = costs["conv3_block1_1_conv"]["bytes"]
    stale = {"name": "conv3_block1_1_conv", "kind": "conv", "ms": 0.02, "bytes": 2 * right, "memory_ms": 0.04,
             "compute_ms": 0.001}
    stem = {"name": "conv1_conv+pool1_pool", "kind": "stem", "ms": 0.1}
    got = R.floored({"batch": 64, "layers": [stem, stale]})
    assert got[0] == stem and got[1]["bytes"] == right and got[1]["memory_ms"] == pytest.approx(0.02)


def test_the_deep_dives_statements_on_resnet_follow_the_figures():
    """benchmarks/inference_engine_resnet.reading on the newest record, then with its figures reversed: INT8 made to
    agree more than FP8, a 1x1 layer made the slowest over its floor, and one layer faster than its floor each turn
    the statement they break to False; floor_lines names the layer furthest above its floor first."""
    import copy

    from benchmarks import inference_engine_resnet as R
    from gpucourse import records

    rec = records.latest("06_inference_engine")
    if rec is None or "resnet" not in rec["figures"]:
        pytest.skip("no record of ResNet-50 through the engine")
    t = copy.deepcopy(rec["figures"]["resnet"])
    assert all(holds for _, holds in R.reading(t))
    t["ratios"]["top1_int8"]["ratio"] = t["ratios"]["top1_fp8"]["ratio"] + 0.01
    one = next(r for r in t["layers"] if r["name"] == "conv3_block2_1_conv")
    one["ms"] *= 10
    fast = next(r for r in t["layers"] if r["name"] == "conv4_block2_2_conv")
    fast["ms"] = 0.5 * max(fast["compute_ms"], fast["memory_ms"])
    read = dict(R.reading(t))
    assert read["in 8 bits everywhere, FP8 agrees with FP32 on more inputs than INT8"] is False
    assert read["the 3 x 3 convolutions of 64 channels (conv2's) the furthest above their floors"] is False
    assert read["no convolution of the FP16 plan runs below its floor"] is False
    assert R.floor_lines(t)[0].startswith("furthest above their floors: conv3_block2_1 ")
    t["engine"][f"FP8 (mixed), batch {t['batch']}"]["keep_fp16"] = ["conv1", "conv2", "conv4"]
    read = dict(R.reading(t))
    assert read["the mixed FP8 plan runs conv5 alone in 8 bits"] is False
    assert read["both mixed plans keep the first stages (conv1 to conv3) in FP16"] is False

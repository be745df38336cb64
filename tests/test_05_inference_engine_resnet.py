"""Lesson 5's real network: ResNet-50 built with NumPy as an engine graph, against Keras' own ResNet50 (layer names,
structure, weights in, outputs out), its batch-norm calibration, the passes on it (padding folded, batch norms
folded, bias + residual + ReLU in each convolution's epilogue, the classifier one Head) and the costs per layer."""
from __future__ import annotations

import numpy as np
import pytest

from gpucourse import runtime
from kernels import inference_engine as E

pytestmark = pytest.mark.lesson05
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
    fl = E.floors(rows, tflops=100.0, gbps=1000.0)
    for r in fl:
        assert r["compute_s"] == pytest.approx(r["flops"] / 1e14)
        assert r["bound"] == ("compute" if r["intensity"] >= 100 else "memory")


def test_the_plan_builder_names_what_it_cannot_run_yet(calibrated):
    g = E.optimize(calibrated[0])[-1][1]
    with pytest.raises(runtime.CourseError, match=r"node 'conv1_conv' .*stride 2"):
        E.build_plan(g, max_batch=2, tune=False)


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

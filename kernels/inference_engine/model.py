"""The trained network the lesson serves: a small Inception-style digits classifier trained with Keras
(``train_and_export``; TensorFlow is needed only here) and exported to kernels/inference_engine/digits_inception.npz
(graph, weights, held-out digits, Keras's own logits), which the engine reads without TensorFlow.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from gpucourse import runtime

from .graph import _json_bytes, Graph, graph_from_keras, Node


MODEL_FILE = Path(__file__).resolve().parent / "digits_inception.npz"


def save_model_file(graph: Graph, path, data: dict) -> Path:
    """Graph + weights + ``data`` (arrays) in one .npz file that needs no TensorFlow to read."""
    arrays = {"graph": _json_bytes(_graph_doc(graph))}
    for n in graph.nodes:
        for k, v in n.weights.items():
            arrays[f"w/{n.name}/{k}"] = v
    arrays.update({f"data/{k}": np.asarray(v) for k, v in data.items()})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
    return path


def load_model_file(path=None) -> tuple:
    """(graph, data) from a model file (default: the lesson's trained model)."""
    path = Path(path or MODEL_FILE)
    if not path.exists():
        raise runtime.CourseError(f"no model file at {path}; train and export one with train_and_export()")
    with np.load(path, allow_pickle=False) as f:
        doc = json.loads(bytes(f["graph"]).decode())
        weights = {k: f[k] for k in f.files if k.startswith("w/")}
        data = {k[5:]: f[k] for k in f.files if k.startswith("data/")}
    nodes = [Node(d["name"], d["op"], d["inputs"], d["outputs"], d["attrs"],
                  {k.split("/")[-1]: v for k, v in weights.items() if k.startswith(f"w/{d['name']}/")})
             for d in doc["nodes"]]
    return Graph(nodes, {k: tuple(v) for k, v in doc["shapes"].items()}, doc["input"], doc["output"],
                 {k: tuple(v) for k, v in doc["aliases"].items()}), data


def _graph_doc(g: Graph) -> dict:
    return {"nodes": [{"name": n.name, "op": n.op, "inputs": n.inputs, "outputs": n.outputs, "attrs": n.attrs}
                      for n in g.nodes], "shapes": g.shapes, "input": g.input, "output": g.output,
            "aliases": g.aliases}


def digits_images(raw) -> np.ndarray:
    """scikit-learn's 8 x 8 digits (values 0..16) as the network's input: N x 16 x 16 x 1 float32 in [0, 1],
    each pixel repeated 2 x 2 so the convolutions have a picture to slide over."""
    raw = np.asarray(raw, np.float32).reshape(-1, 8, 8) / 16.0
    return np.repeat(np.repeat(raw, 2, axis=1), 2, axis=2)[..., None]


def build_keras_model():
    """The lesson's CNN: a 3x3 stem (conv, batch norm, ReLU), one inception block (1x1; 1x1 then 3x3;
    1x1 then 5x5; 3x3 max pool then 1x1, concatenated), 4x4 average pool, flatten, dense to 10 logits."""
    import keras
    from keras import layers

    inp = keras.Input((16, 16, 1), name="image")
    x = layers.Conv2D(32, 3, padding="same", use_bias=False, name="stem")(inp)
    x = layers.BatchNormalization(name="stem_bn")(x)
    x = layers.ReLU(name="stem_relu")(x)
    a = layers.Conv2D(32, 1, activation="relu", name="branch1x1")(x)
    b = layers.Conv2D(32, 1, activation="relu", name="branch3x3_reduce")(x)
    b = layers.Conv2D(32, 3, padding="same", activation="relu", name="branch3x3")(b)
    c = layers.Conv2D(16, 1, activation="relu", name="branch5x5_reduce")(x)
    c = layers.Conv2D(16, 5, padding="same", activation="relu", name="branch5x5")(c)
    p = layers.MaxPooling2D(3, 1, padding="same", name="branch_pool")(x)
    p = layers.Conv2D(16, 1, activation="relu", name="branch_pool_proj")(p)
    z = layers.Concatenate(name="concat")([a, b, c, p])
    z = layers.AveragePooling2D(4, name="avgpool")(z)
    z = layers.Flatten(name="flatten")(z)
    return keras.Model(inp, layers.Dense(10, name="logits")(z), name="digits_inception")


def train_and_export(path=None, *, seed: int = 0, epochs: int = 10) -> dict:
    """Train the lesson's model with TensorFlow/Keras on scikit-learn's digits (about 30 s on a CPU, seeded),
    and write the model file: graph, weights, 397 held-out digits with Keras's logits, 256 training digits
    for calibration. Returns {"accuracy", "seconds", "path"}."""
    import os
    import time

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    from sklearn.datasets import load_digits

    t0 = time.perf_counter()
    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    train, test = order[:1400], order[1400:]
    x, y = digits_images(digits.images), digits.target.astype(np.int64)
    keras.utils.set_random_seed(seed)
    model = build_keras_model()
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x[train], y[train], batch_size=32, epochs=epochs, verbose=0, shuffle=True)
    logits = np.asarray(model.predict(x[test], verbose=0), np.float32)
    accuracy = float(np.mean(logits.argmax(1) == y[test]))
    data = {"test_raw": digits.images[test].astype(np.uint8), "test_labels": y[test].astype(np.uint8),
            "calib_raw": digits.images[train[:256]].astype(np.uint8), "keras_logits": logits,
            "keras_accuracy": np.float64(accuracy)}
    out = save_model_file(graph_from_keras(model), path or MODEL_FILE, data)
    return {"accuracy": accuracy, "seconds": time.perf_counter() - t0, "path": str(out), "model": model}


def dataset(data: dict) -> dict:
    """The model file's data as network inputs: x_test, y_test, x_calib, keras_logits."""
    return {"x_test": digits_images(data["test_raw"]), "y_test": data["test_labels"].astype(np.int64),
            "x_calib": digits_images(data["calib_raw"]), "keras_logits": data["keras_logits"],
            "keras_accuracy": float(data["keras_accuracy"])}

"""Lesson 9: TensorFlow's training machinery, for real (on the CPU here; on a GPU where TensorFlow sees one).

The same network as kernels/training.py, written with tf.Variable and tf.GradientTape, so the course's own
step can be checked against TensorFlow on the same weights and batch. Towers: gradients of k replicas
averaged with reduce_mean over the stacked gradients, and tf.distribute.MirroredStrategy over k logical CPU
devices, which must be configured before TensorFlow initialises: ``python -m systems.training.tensorflow_reference mirrored K``
does it in a fresh process (``mirrored_check``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from gpucourse import runtime
from gpucourse.runtime import CourseInputError

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def tf():
    """TensorFlow, imported on first use and set up the course's way (gpucourse.runtime.tensorflow: memory growth,
    so CuPy shares the GPU with it in lesson 9; strict FP32, so it is the oracle of the course's FP32 step)."""
    return runtime.tensorflow()


def variables(params) -> list:
    """tf.Variables holding the course's weights [(W, b), ...] (NumPy)."""
    t = tf()
    return [t.Variable(np.asarray(a), name=f"{n}{i}") for i, (W, b) in enumerate(params) for n, a in (("W", W), ("b", b))]


def forward(vs, X):
    t = tf()
    z = X
    for i in range(0, len(vs), 2):
        a = z if i == 0 else t.nn.relu(z)
        z = a @ vs[i] + vs[i + 1]
    return z


def loss_fn(vs, X, y):
    t = tf()
    return t.reduce_mean(t.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=forward(vs, X)))


def loss_and_grads(params, X, y):
    """TensorFlow's loss and gradients [(dW, db), ...] as NumPy, for the course's weights and batch."""
    t = tf()
    vs = variables(params)
    with t.GradientTape() as tape:
        loss = loss_fn(vs, t.constant(X), t.constant(y))
    g = [x.numpy() for x in tape.gradient(loss, vs)]
    return float(loss), [(g[i], g[i + 1]) for i in range(0, len(g), 2)]


def tower_grads(params, X, y, k: int):
    """k towers, each the gradient of its shard; averaged with reduce_mean over the stacked gradients."""
    t = tf()
    if X.shape[0] % k:
        raise CourseInputError(f"a batch of {X.shape[0]} does not split into {k} equal towers")
    vs = variables(params)
    per = []
    for Xs, ys in zip(np.split(X, k), np.split(y, k)):
        with t.GradientTape() as tape:
            loss = loss_fn(vs, t.constant(Xs), t.constant(ys))
        per.append(tape.gradient(loss, vs))
    avg = [t.reduce_mean(t.stack(gs), axis=0).numpy() for gs in zip(*per)]
    return [(avg[i], avg[i + 1]) for i in range(0, len(avg), 2)]


def configure_logical_cpus(k: int) -> list:
    """Split the CPU into k logical devices; only possible before TensorFlow initialises its devices."""
    t = tf()
    cpu = t.config.list_physical_devices("CPU")[0]
    t.config.set_logical_device_configuration(cpu, [t.config.LogicalDeviceConfiguration() for _ in range(k)])
    return [d.name for d in t.config.list_logical_devices("CPU")]


def mirrored_grads(params, X, y, k: int):
    """Gradients averaged by tf.distribute.MirroredStrategy over k logical CPU devices (configured already)."""
    t = tf()
    devices = [d.name for d in t.config.list_logical_devices("CPU")][:k]
    strategy = t.distribute.MirroredStrategy(devices)
    with strategy.scope():
        vs = variables(params)
    dataset = t.data.Dataset.from_tensor_slices((X, y)).batch(X.shape[0])
    dist = iter(strategy.experimental_distribute_dataset(dataset))

    def replica(Xs, ys):
        with t.GradientTape() as tape:
            per_example = t.nn.sparse_softmax_cross_entropy_with_logits(labels=ys, logits=forward(vs, Xs))
            loss = t.nn.compute_average_loss(per_example, global_batch_size=X.shape[0])
        return tape.gradient(loss, vs)

    per = strategy.run(replica, args=next(dist))
    g = [strategy.reduce(t.distribute.ReduceOp.SUM, x, axis=None).numpy() for x in per]
    return strategy.num_replicas_in_sync, [(g[i], g[i + 1]) for i in range(0, len(g), 2)]


def mirrored_check(k: int = 2, *, widths=(8, 16, 16, 4), batch: int = 32, seed: int = 0) -> dict:
    """In a fresh Python: MirroredStrategy over k logical CPUs against one device on the whole batch.
    Returns {"replicas", "devices", "max_abs_diff", "max_abs_grad"}."""
    out = subprocess.run([sys.executable, "-m", "systems.training.tensorflow_reference", "mirrored", str(k), str(batch), str(seed),
                          ",".join(map(str, widths))], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    if out.returncode != 0:
        raise RuntimeError(f"the MirroredStrategy process failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mirrored_main(k: int, batch: int, seed: int, widths) -> dict:
    devices = configure_logical_cpus(k)  # first thing: before any TensorFlow op
    from kernels import training

    params = training.mlp_init(widths, seed=seed)
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((batch, widths[0]), dtype=np.float32)
    y = rng.integers(0, widths[-1], batch).astype(np.int32)
    n, g = mirrored_grads(params, X, y, k)
    _, ref = loss_and_grads(params, X, y)
    diff = max(float(np.abs(a - b).max()) for ga, gb in zip(g, ref) for a, b in zip(ga, gb))
    big = max(float(np.abs(b).max()) for gb in ref for b in gb)
    return {"replicas": n, "devices": devices, "max_abs_diff": diff, "max_abs_grad": big}


def eager_step(vs, X, y, lr: float):
    """One SGD step on the tf.Variables ``vs``, run eagerly: the loss under a GradientTape, then every variable
    updated in place (``assign_sub``). Returns the loss (a scalar tensor)."""
    t = tf()
    with t.GradientTape() as tape:
        loss = loss_fn(vs, X, y)
    for v, g in zip(vs, tape.gradient(loss, vs)):
        v.assign_sub(lr * g)
    return loss


def eager_vs_function(params, X, y, *, lr: float = 0.01, steps: int = 20) -> dict:
    """Median seconds of one SGD step run eagerly and as a tf.function (graph), same weights and batch."""
    t = tf()
    Xt, yt = t.constant(X), t.constant(y)

    def make():
        vs = variables(params)

        def step():
            return eager_step(vs, Xt, yt, lr)
        return vs, step

    out = {}
    for name, wrap in (("eager", lambda f: f), ("tf.function", t.function)):
        vs, step = make()
        step = wrap(step)
        step()  # a tf.function traces (builds its graph) on the first call
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step().numpy()
            times.append(time.perf_counter() - t0)
        out[name] = float(np.median(times))
        out[name + " weights"] = [v.numpy() for v in vs]
    return out


def recompute_demo(widths=(8, 32, 32, 32, 4), batch: int = 16, seed: int = 0) -> dict:
    """tf.recompute_grad around the hidden block: same gradients, and the block's forward runs twice per step
    (once forward, once again in the backward pass) instead of keeping its activations."""
    t = tf()
    from kernels import training

    params = training.mlp_init(widths, seed=seed)
    rng = np.random.default_rng(seed)
    X = t.constant(rng.standard_normal((batch, widths[0]), dtype=np.float32))
    y = t.constant(rng.integers(0, widths[-1], batch).astype(np.int32))
    calls = {"n": 0}

    def run(recompute: bool):
        vs = variables(params)

        def block(z):
            calls["n"] += 1
            for i in range(2, len(vs) - 2, 2):
                z = t.nn.relu(z) @ vs[i] + vs[i + 1]
            return z

        inner = t.recompute_grad(block) if recompute else block
        calls["n"] = 0
        with t.GradientTape() as tape:
            z = X @ vs[0] + vs[1]
            z = inner(z)
            logits = t.nn.relu(z) @ vs[-2] + vs[-1]
            loss = t.reduce_mean(t.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        grads = [g.numpy() for g in tape.gradient(loss, vs)]
        return grads, calls["n"]

    plain, n_plain = run(False)
    again, n_again = run(True)
    return {"block_calls_plain": n_plain, "block_calls_recompute": n_again,
            "max_abs_diff": max(float(np.abs(a - b).max()) for a, b in zip(plain, again))}


def sine_regression(lr: float, *, steps: int = 300, hidden: int = 32, seed: int = 0) -> list:
    """Fit y = sin(x) + cos(2x) on [-pi, pi] with a one-hidden-layer tanh network and plain SGD; returns the
    loss every step. With too small a learning rate the loss does not move; the model is fine."""
    t = tf()
    rng = np.random.default_rng(seed)
    x = np.linspace(-np.pi, np.pi, 256, dtype=np.float32)[:, None]
    yv = np.sin(x) + np.cos(2 * x)
    W1 = t.Variable(rng.standard_normal((1, hidden), dtype=np.float32))
    b1 = t.Variable(rng.standard_normal(hidden, dtype=np.float32))
    W2 = t.Variable(rng.standard_normal((hidden, 1), dtype=np.float32) / np.float32(np.sqrt(hidden)))
    b2 = t.Variable(np.zeros(1, np.float32))
    vs = [W1, b1, W2, b2]
    opt = t.keras.optimizers.SGD(learning_rate=lr)

    @t.function
    def step():
        with t.GradientTape() as tape:
            loss = t.reduce_mean((t.tanh(x @ W1 + b1) @ W2 + b2 - yv) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, vs), vs))
        return loss

    return [float(step()) for _ in range(steps)]


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "mirrored":
        k, batch, seed = (int(v) for v in sys.argv[2:5])
        widths = tuple(int(v) for v in sys.argv[5].split(","))
        print(json.dumps(_mirrored_main(k, batch, seed, widths)))
    else:
        sys.exit("usage: python -m systems.training.tensorflow_reference mirrored K BATCH SEED W0,W1,...")

"""Lesson 9: a training step on the GPU built from the course's own pieces.

One multi-layer perceptron, written once against an array module ``xp`` (CuPy on a GPU: cuBLAS GEMMs, on
tensor cores in FP16; NumPy in CPU mode and in the tests), and four ideas on top of it:

* the step itself: forward, softmax cross-entropy, backward, SGD (``loss_and_grads``, ``sgd``);
* mixed precision: FP16 weights and activations, FP32 master weights, dynamic loss scaling
  (``LossScaler``, ``update_scale``, ``mixed_step``);
* recomputation (Chen et al. 2016): keep the input of every s-th layer only and recompute the others in the
  backward pass (``checkpoint_every`` of ``loss_and_grads``);
* data parallelism: k replicas on k shards of the batch, gradients averaged with an all-reduce in buckets that
  start while the backward pass is still running (``data_parallel_grads`` simulated with NumPy replicas;
  ``DataParallel`` on k GPUs with NCCL or lesson 7's ring).

The network: layer 0 computes z_0 = X W_0 + b_0, layer i > 0 computes z_i = relu(z_{i-1}) W_i + b_i; the last
z are the logits. Keeping the pre-activations z_{i-1} (a layer's input) is all a layer's backward needs, so a
"stored activation" is one batch x width array per layer.
"""
from __future__ import annotations

import math

import numpy as np

from gpucourse import runtime


def array_module():
    """CuPy in GPU mode, NumPy in CPU mode: where this lesson's step runs."""
    return runtime.cupy() if runtime.is_gpu() else np


def xp_of(x):
    """The array module an array belongs to (NumPy or CuPy)."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


# ================================================================================== the network

def mlp_init(widths, *, seed: int = 0, xp=np, dtype="float32") -> list:
    """[(W_0, b_0), ...] for layers widths[0] -> widths[1] -> ... (He initialisation, zero biases)."""
    widths = [int(w) for w in widths]
    if len(widths) < 2 or min(widths) < 1:
        raise runtime.CourseInputError(f"widths must list at least two positive sizes, got {widths}")
    rng = np.random.default_rng(seed)
    params = []
    for d, h in zip(widths[:-1], widths[1:]):
        W = (rng.standard_normal((d, h), dtype=np.float32) * np.float32(math.sqrt(2.0 / d)))
        params.append((xp.asarray(W, dtype=dtype), xp.zeros(h, dtype=dtype)))
    return params


def cast(params, dtype) -> list:
    return [(W.astype(dtype), b.astype(dtype)) for W, b in params]


def layer_forward(W, b, z_in, first: bool):
    """One layer: z_in W + b for the first layer, relu(z_in) W + b for the others."""
    xp = xp_of(z_in)
    a = z_in if first else xp.maximum(z_in, 0)
    out = a @ W
    out += b
    return out


def layer_backward(W, z_in, dz, first: bool, *, out=None):
    """Gradients of one layer from its input z_in and dL/dz of its output: (dW, db, dL/dz_in or None).
    ``out``: (dW, db) buffers to write into (data parallelism all-reduces them in place)."""
    xp = xp_of(z_in)
    a = z_in if first else xp.maximum(z_in, 0)
    if out is None:
        dW, db = a.T @ dz, dz.sum(axis=0)
    else:
        dW, db = out
        xp.matmul(a.T, dz, out=dW)
        xp.sum(dz, axis=0, out=db)
    del a
    if first:
        return dW, db, None
    dz_in = dz @ W.T
    dz_in *= z_in > 0
    return dW, db, dz_in


def softmax_xent(logits, y):
    """Mean softmax cross-entropy over the batch (in FP32 whatever the logits' type) and dL/dlogits."""
    xp = xp_of(logits)
    z = logits.astype(xp.float32) if logits.dtype == xp.float16 else logits
    z = z - z.max(axis=1, keepdims=True)
    e = xp.exp(z)
    p = e / e.sum(axis=1, keepdims=True)
    n = logits.shape[0]
    rows = xp.arange(n)
    loss = -xp.log(xp.maximum(p[rows, y], 1e-30)).mean()
    d = p
    d[rows, y] -= 1
    d /= n
    return loss, d


def check_batch(params, X, y) -> None:
    if X.ndim != 2 or X.shape[1] != params[0][0].shape[0]:
        raise runtime.CourseInputError(
            f"X must be (batch, {params[0][0].shape[0]}), got shape {tuple(X.shape)}")
    if y.shape != (X.shape[0],):
        raise runtime.CourseInputError(f"y must hold one class per row of X: shape ({X.shape[0]},), got {tuple(y.shape)}")


def check_spacing(s, depth: int) -> int:
    if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 1 <= s <= depth:
        raise runtime.CourseInputError(
            f"checkpoint spacing must be a whole number from 1 (keep every layer's input) to the depth {depth} "
            f"(keep only the network's input), got {s!r}")
    return int(s)


def grad_steps(params, X, y, *, checkpoint_every: int = 1, loss_scale: float = 1.0, out=None, stats=None):
    """The training step's forward and backward as a generator: yields (i, dW_i, db_i) as soon as layer i's
    gradients exist (last layer first), and returns the loss (a 0-d array, not synchronised).

    checkpoint_every = s: the forward pass keeps the input of layers 0, s, 2s, ... only; the backward pass
    recomputes the rest, one segment of s layers at a time. s = 1 keeps everything (no recomputation).
    loss_scale: dL/dlogits is multiplied by it before the backward pass (mixed precision).
    out: [(dW, db), ...] buffers to write the gradients into.
    stats: a dict that receives "forward_layers" (layer forwards run) and "peak_stored" (most layer inputs held
    at once)."""
    n = len(params)
    s = check_spacing(checkpoint_every, n)
    check_batch(params, X, y)
    if not loss_scale > 0 or not math.isfinite(loss_scale):
        raise runtime.CourseInputError(f"the loss scale must be a positive finite number, got {loss_scale!r}")
    dtype = params[0][0].dtype
    held = {"now": 0, "peak": 0, "forwards": 0}

    def hold(delta):
        held["now"] += delta
        held["peak"] = max(held["peak"], held["now"])

    saved = {}
    z = X.astype(dtype, copy=False)
    for i, (W, b) in enumerate(params):
        if i % s == 0:
            saved[i] = z
            hold(1)
        z = layer_forward(W, b, z, i == 0)
        held["forwards"] += 1
    loss, dz = softmax_xent(z, y)
    del z
    if loss_scale != 1.0:
        dz *= loss_scale
    dz = dz.astype(dtype, copy=False)
    for start in reversed(range(0, n, s)):
        stop = min(start + s, n)
        inputs = [saved.pop(start)]
        for i in range(start, stop - 1):  # recompute the segment's other inputs from its checkpoint
            inputs.append(layer_forward(*params[i], inputs[-1], i == 0))
            held["forwards"] += 1
            hold(1)
        for i in reversed(range(start, stop)):
            z_in = inputs.pop()
            dW, db, dz = layer_backward(params[i][0], z_in, dz, i == 0, out=None if out is None else out[i])
            del z_in
            hold(-1)
            yield i, dW, db
    if stats is not None:
        stats["forward_layers"] = held["forwards"]
        stats["peak_stored"] = held["peak"]
    return loss


def run_steps(gen):
    """Drive ``grad_steps`` to the end: (loss, [(dW, db), ...] in layer order)."""
    grads = {}
    while True:
        try:
            i, dW, db = next(gen)
        except StopIteration as stop:
            return stop.value, [grads[i] for i in sorted(grads)]
        grads[i] = (dW, db)


def loss_and_grads(params, X, y, *, checkpoint_every: int = 1, loss_scale: float = 1.0, out=None, stats=None):
    """(loss, [(dW, db), ...]) of the mean softmax cross-entropy of the network on batch (X, y)."""
    return run_steps(grad_steps(params, X, y, checkpoint_every=checkpoint_every, loss_scale=loss_scale,
                                out=out, stats=stats))


def sgd(params, grads, lr: float, *, scale: float = 1.0) -> None:
    """In place: p -= lr * scale * g (scale folds in 1/k of an all-reduce's sum, or 1/loss scale)."""
    step = lr * scale
    for (W, b), (dW, db) in zip(params, grads):
        W -= step * dW.astype(W.dtype, copy=False)
        b -= step * db.astype(b.dtype, copy=False)


def accuracy(params, X, y) -> float:
    z = X.astype(params[0][0].dtype, copy=False)
    for i, (W, b) in enumerate(params):
        z = layer_forward(W, b, z, i == 0)
    return float((z.argmax(axis=1) == y).mean())


def activation_bytes(batch: int, widths, *, checkpoint_every: int = 1, itemsize: int = 4) -> int:
    """The model of stored activations: ceil(n / s) checkpoints kept by the forward pass plus the s - 1 inputs
    a segment recomputes, each a batch x width array (widths all equal)."""
    n = len(widths) - 1
    s = check_spacing(checkpoint_every, n)
    stored = n if s == 1 else math.ceil(n / s) + s - 1
    return stored * batch * max(widths[:-1]) * itemsize


def schedule_bytes(batch: int, widths, checkpoints, *, itemsize: int = 4) -> int:
    """The model of stored activations for checkpoints at any layers (``checkpoints``: the layers whose input the
    forward pass keeps, 0 first, increasing): going backward, segment j (from checkpoint j to the next) holds the
    inputs of the checkpoints before it and every input of its own layers; the peak over the segments, in bytes.
    Layer i's input is batch x widths[i]. Checkpoints every s layers give ``activation_bytes``'s figure."""
    n = len(widths) - 1
    cps = sorted(set(int(c) for c in checkpoints))
    if not cps or cps[0] != 0 or cps[-1] >= n or list(checkpoints) != cps:
        raise runtime.CourseInputError(f"checkpoints must be increasing layer numbers from 0, below {n}: "
                                       f"got {list(checkpoints)!r}")
    bounds = cps + [n]
    peak = max(sum(widths[c] for c in cps[:j]) + sum(widths[bounds[j]:bounds[j + 1]]) for j in range(len(cps)))
    return peak * batch * itemsize


def best_schedule(batch: int, widths, *, itemsize: int = 4) -> tuple:
    """(checkpoints, bytes) of the schedule ``schedule_bytes`` ranks lowest, by trying every one (2^(n-1): for
    the few layers of an exercise), the fewest checkpoints first among equals."""
    import itertools

    n = len(widths) - 1
    if n > 20:
        raise runtime.CourseInputError(f"{n} layers: too many schedules to try (at most 20 layers)")
    best = None
    for r in range(n):
        for rest in itertools.combinations(range(1, n), r):
            cand = (schedule_bytes(batch, widths, (0, *rest), itemsize=itemsize), r, [0, *rest])
            if best is None or cand[:2] < best[:2]:
                best = cand
    return best[2], best[0]


# ================================================================================ mixed precision

class FP16Overflow(runtime.CourseError, FloatingPointError):
    """The FP16 forward pass overflowed (values beyond 65504): no loss scale can fix that."""


def update_scale(scale: float, good_steps: int, finite: bool, *, growth: float = 2.0, backoff: float = 0.5,
                 interval: int = 1000) -> tuple:
    """Dynamic loss scaling's rule: (new scale, new count of good steps in a row).

    A step whose gradients overflowed (not finite) is skipped: the scale is multiplied by ``backoff`` and the
    count starts again. After ``interval`` finite steps in a row the scale grows by ``growth``."""
    if not scale > 0:
        raise runtime.CourseInputError(f"the loss scale must be positive, got {scale!r}")
    if not finite:
        return scale * backoff, 0
    good_steps += 1
    if good_steps >= interval:
        return scale * growth, 0
    return scale, good_steps


class LossScaler:
    """Dynamic loss scaling (``update_scale``), keeping its history for plots."""

    def __init__(self, scale: float = 2.0**15, *, growth: float = 2.0, backoff: float = 0.5, interval: int = 1000):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0 or not math.isfinite(scale):
            raise runtime.CourseInputError(f"the loss scale must be a positive finite number, got {scale!r}")
        if not (growth > 1 and 0 < backoff < 1 and interval >= 1):
            raise runtime.CourseInputError("growth must exceed 1, backoff lie in (0, 1), interval be at least 1")
        self.scale, self.growth, self.backoff, self.interval = float(scale), growth, backoff, int(interval)
        self.good_steps = 0
        self.history = [self.scale]
        self.skipped = 0

    def update(self, finite: bool) -> None:
        self.scale, self.good_steps = update_scale(self.scale, self.good_steps, finite, growth=self.growth,
                                                   backoff=self.backoff, interval=self.interval)
        self.skipped += not finite
        self.history.append(self.scale)


def all_finite(grads) -> bool:
    xp = xp_of(grads[0][0])
    ok = xp.stack([xp.isfinite(g).all() for pair in grads for g in pair]).all()
    return bool(ok)


def mixed_step(master, X, y, scaler: LossScaler, lr: float, *, half=None, checkpoint_every: int = 1):
    """One mixed-precision SGD step: FP16 copies of the FP32 master weights run forward and backward (tensor
    cores on a GPU) on the loss times ``scaler.scale``; the FP16 gradients are unscaled in FP32 and applied to
    the master weights only if they are all finite, and the scale is updated. Returns (loss, applied).

    half: FP16 weight buffers to reuse (made if None). Raises FP16Overflow if the forward pass overflows."""
    xp = xp_of(master[0][0])
    if half is None:
        half = cast(master, xp.float16)
    else:
        for (W, b), (W16, b16) in zip(master, half):
            W16[...] = W
            b16[...] = b
    with np.errstate(over="ignore", invalid="ignore"):  # NumPy: an overflow is expected, and handled below
        loss, grads = loss_and_grads(half, X, y, loss_scale=scaler.scale, checkpoint_every=checkpoint_every)
    if not math.isfinite(float(loss)):
        raise FP16Overflow(
            "the FP16 forward pass overflowed (an activation went beyond 65504, so the loss is not finite): "
            "lower the learning rate or the inputs' scale, or keep this layer in FP32; loss scaling only "
            "protects the gradients")
    finite = all_finite(grads)
    if finite:
        sgd(master, grads, lr, scale=1.0 / scaler.scale)
    scaler.update(finite)
    return float(loss), finite


def underflow_fraction(grads) -> float:
    """The fraction of gradient entries that are exactly zero."""
    zeros = sum(int((g == 0).sum()) for pair in grads for g in pair)
    return zeros / sum(g.size for pair in grads for g in pair)


# ============================================================================= data parallelism

def split_batch(X, y, k: int) -> list:
    """k equal shards [(X_r, y_r), ...] of the batch, one per replica."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise runtime.CourseInputError(f"the number of replicas must be a whole number >= 1, got {k!r}")
    if X.shape[0] % k:
        raise runtime.CourseInputError(
            f"a batch of {X.shape[0]} does not split into {k} equal shards: the average of the replicas' mean "
            f"gradients equals the whole batch's only when every shard has the same size. Use a batch that is a "
            f"multiple of {k}")
    m = X.shape[0] // k
    return [(X[r * m:(r + 1) * m], y[r * m:(r + 1) * m]) for r in range(k)]


def buckets(params, bucket_bytes: int) -> list:
    """Layers grouped into all-reduce buckets, last layer first (the order the backward pass finishes them),
    each bucket at least ``bucket_bytes`` of gradients (except perhaps the last)."""
    if bucket_bytes < 1:
        raise runtime.CourseInputError(f"bucket_bytes must be positive, got {bucket_bytes}")
    out, cur, size = [], [], 0
    for i in reversed(range(len(params))):
        cur.append(i)
        size += (params[i][0].size + params[i][1].size) * params[i][0].dtype.itemsize
        if size >= bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def flatten(grads, layers) -> np.ndarray:
    xp = xp_of(grads[layers[0]][0])
    return xp.concatenate([g.ravel() for i in layers for g in grads[i]])


def unflatten_into(vec, grads, layers) -> None:
    at = 0
    for i in layers:
        for g in grads[i]:
            g[...] = vec[at:at + g.size].reshape(g.shape)
            at += g.size


def data_parallel_grads(params, X, y, k: int, *, reduce: str = "mean", bucket_bytes: int = 2**20,
                        checkpoint_every: int = 1, trace: list | None = None):
    """Data parallelism simulated with k NumPy replicas (CPU mode): (loss, grads) averaged over the replicas.

    Every replica runs the backward pass on its shard; the replicas advance layer by layer in lockstep, and
    a bucket is all-reduced as soon as every replica has finished its layers: reduce="mean" averages the
    stacked buckets, reduce="ring" runs lesson 7's ring all-reduce (col.ring_allreduce_numpy) and divides by k.
    trace: receives ("backward", layer) and ("all-reduce", bucket) events in the order they happen."""
    from kernels import collectives as col

    if reduce not in ("mean", "ring"):
        raise runtime.CourseInputError(f"reduce must be 'mean' or 'ring', got {reduce!r}")
    shards = split_batch(X, y, k)
    plan = buckets(params, bucket_bytes)
    bucket_of = {i: b for b, layers in enumerate(plan) for i in layers}
    gens = [grad_steps(params, Xr, yr, checkpoint_every=checkpoint_every) for Xr, yr in shards]
    grads = [dict() for _ in range(k)]
    left = [len(layers) for layers in plan]
    losses = [None] * k
    for _ in range(len(params)):
        for r, gen in enumerate(gens):
            i, dW, db = next(gen)
            grads[r][i] = (dW, db)
        if trace is not None:
            trace.append(("backward", i))
        b = bucket_of[i]
        left[b] -= 1
        if left[b] == 0:  # every replica holds this bucket: its all-reduce can start now
            vecs = [flatten(g, plan[b]) for g in grads]
            if reduce == "mean":
                avg = np.stack(vecs).mean(axis=0)
            else:
                avg = col.ring_allreduce_numpy(vecs)[0] / k
            for g in grads:
                unflatten_into(avg, g, plan[b])
            if trace is not None:
                trace.append(("all-reduce", b))
    for r, gen in enumerate(gens):
        try:
            next(gen)
        except StopIteration as stop:
            losses[r] = stop.value
    return float(np.mean([float(v) for v in losses])), [grads[0][i] for i in range(len(params))]


def check_shards(shards, k: int) -> None:
    """Refuse shards that data parallelism over k replicas would average into a wrong gradient: one (X, y) per
    replica, every one the same number of examples, with as many labels as examples."""
    if len(shards) != k:
        raise runtime.CourseInputError(f"give one shard per replica: {k}, got {len(shards)}")
    rows = [X.shape[0] for X, _ in shards]
    if len(set(rows)) != 1:
        raise runtime.CourseInputError(f"the shards hold {rows} examples: averaging their gradients gives the "
                                       "whole batch's gradient only when every shard is the same size "
                                       "(split_batch splits a batch that way)")
    for r, (X, y) in enumerate(shards):
        if y.shape[0] != X.shape[0]:
            raise runtime.CourseInputError(f"shard {r} has {X.shape[0]} examples and {y.shape[0]} labels")


def rank_shard(rank: int, batch_per_gpu: int, widths, seed: int = 0) -> tuple:
    """Replica ``rank``'s shard of the batch, (X, y) in NumPy: the same wherever it is made, so one process per GPU
    makes only its own, and the whole batch is the shards of ranks 0, 1, ... stacked."""
    rng = np.random.default_rng([seed, rank])
    return (rng.standard_normal((batch_per_gpu, widths[0]), dtype=np.float32),
            rng.integers(0, widths[-1], batch_per_gpu).astype(np.int32))


def data_parallel_program(group, widths, batch_per_gpu: int, steps: int = 1, repeats: int = 0, lr: float = 0.05,
                          overlap: bool = True, comm_priority: bool = False, seed: int = 0) -> dict:
    """One rank of data parallelism with one process per GPU (run by ``gpucourse.ranks.launch(k, ...)``, as DDP runs
    it): rank r drives GPU r alone, from its own Python, so no GPU waits while one thread queues another's work.
    Rank 0 makes NCCL's unique id, every rank joins the communicator, builds the same weights (``mlp_init`` with
    ``seed``) and its shard (``rank_shard``), and runs ``steps`` SGD steps of ``DataParallel`` with the buckets'
    all-reduces overlapped as in one process. Returns {"rank", "losses"} and, for a model of at most 2**22
    weights, the weights after those steps ("params"); with ``repeats``, the step's CUDA-event time on this
    rank's GPU ("timing", the course's timer, after a barrier of all ranks)."""
    from kernels.collectives.programs import use_gpu

    cp = use_gpu(group)
    from cupy.cuda import nccl

    from gpucourse import bench

    uid = group.broadcast(nccl.get_unique_id() if group.rank == 0 else None)
    comm = nccl.NcclCommunicator(group.k, uid, group.rank)
    try:
        params = mlp_init(widths, seed=seed)
        X, y = rank_shard(group.rank, batch_per_gpu, widths, seed)
        shard = [(cp.asarray(X), cp.asarray(y))]
        dp = DataParallel(params, [group.rank], comm=comm, overlap=overlap, comm_priority=comm_priority)
        losses = [float(dp.step(shard, lr)[0]) for _ in range(steps)]
        dp.synchronize()
        out = {"rank": group.rank, "losses": losses}
        if sum(W.size + b.size for W, b in params) <= 2**22:
            out["params"] = [(W.get(), b.get()) for W, b in dp.params[0]]
        if repeats:
            group.barrier()

            def step():
                dp.step(shard, lr)
                dp.synchronize()

            out["timing"] = bench.time_gpu(step, repeats=repeats, warmup=2).summary()
        del dp
    finally:
        comm.destroy()
    return out


def greatest_stream_priority() -> int:
    """The highest priority a stream can have on the current GPU: the smallest number of the driver's range
    (cuCtxGetStreamPriorityRange: least 0, greatest -5 on Hopper), which CuPy does not expose."""
    import ctypes

    from gpucourse import cuda_c

    runtime.cupy().zeros(1)  # the device's context exists and is current
    least, greatest = ctypes.c_int(), ctypes.c_int()
    cuda_c.driver_check(cuda_c.driver().cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)),
                        "cuCtxGetStreamPriorityRange")
    return greatest.value


class DataParallel:
    """Data parallelism on k GPUs of this machine, in one process: a replica of the weights on each GPU, the
    batch split into k shards, every replica's backward pass launched layer by layer in lockstep, and each
    bucket of gradients all-reduced on a communication stream of its own as soon as every replica has queued
    its layers, so the all-reduce of the last layers runs while the first layers' backward still computes.

    reduce="nccl": NCCL's all-reduce (cupy.cuda.nccl, one communicator per GPU; k = 1 works too and measures
    the cost of the calls); reduce="ring": lesson 7's ring all-reduce (col.GpuRing, k >= 2: a kernel per step
    that reads the previous GPU's chunk over NVLink, replayed as one CUDA graph per bucket), run after the
    backward pass (no overlap). The gradients are summed; the step divides by k.

    Two switches take the overlap apart, to measure what it buys: ``overlap=False`` starts NCCL's all-reduces only
    after the whole backward pass, as the ring does; ``comm_priority=True`` puts the communication streams at the
    GPU's highest stream priority, so that the all-reduce kernels' blocks are scheduled before those of GEMMs
    queued at the same time.

    One process per GPU (``data_parallel_program``, as PyTorch's DDP runs): ``comm`` is this process's NCCL
    communicator, which spans the other processes' GPUs, and ``devices`` this process's one GPU; the step then
    averages over the communicator's ``size()`` replicas."""

    def __init__(self, params, devices, *, bucket_bytes: int = 32 * 2**20, reduce: str = "nccl",
                 checkpoint_every: int = 1, overlap: bool = True, comm_priority: bool = False, comm=None):
        if reduce not in ("nccl", "ring", "none"):
            raise runtime.CourseInputError(f"reduce must be 'nccl', 'ring' or 'none', got {reduce!r}")
        if comm is not None and (reduce != "nccl" or len(devices) != 1):
            raise runtime.CourseInputError("comm is one process's NCCL communicator: give it with reduce='nccl' and "
                                           f"this process's one GPU, not reduce={reduce!r} and devices {list(devices)}")
        cp = runtime.cupy()
        from kernels import collectives as col

        self.cp, self.devices, self.k, self.reduce = cp, [int(d) for d in devices], len(devices), reduce
        self.replicas = comm.size() if comm is not None else self.k  # the gradients are averaged over these
        self.checkpoint_every, self.overlap = checkpoint_every, bool(overlap)
        self.plan = buckets(params, bucket_bytes)
        self.bucket_of = {i: b for b, layers in enumerate(self.plan) for i in layers}
        self.params, self.grads, self.flat = [], [], []
        self.compute, self.comm = [], []
        for d in self.devices:
            with cp.cuda.Device(d):
                p = [(cp.asarray(W), cp.asarray(b)) for W, b in params]
                flats, g = [], [None] * len(p)
                for layers in self.plan:  # each bucket is one flat buffer; the layers' gradients are views of it
                    n = sum(p[i][0].size + p[i][1].size for i in layers)
                    flat = cp.zeros(n, dtype=p[0][0].dtype)
                    at = 0
                    for i in layers:
                        W, b = p[i]
                        g[i] = (flat[at:at + W.size].reshape(W.shape), flat[at + W.size:at + W.size + b.size])
                        at += W.size + b.size
                    flats.append(flat)
                self.params.append(p)
                self.grads.append(g)
                self.flat.append(flats)
                self.compute.append(cp.cuda.Stream(non_blocking=True))
                top = greatest_stream_priority() if comm_priority else 0
                self.comm.append(cp.cuda.Stream(non_blocking=True, priority=top))
        if reduce == "nccl":
            from cupy.cuda import nccl

            self.nccl = nccl
            self.comms = [comm] if comm is not None else nccl.NcclCommunicator.initAll(self.devices)
            self.nccl_type = {"float32": nccl.NCCL_FLOAT32, "float16": nccl.NCCL_FLOAT16}[p[0][0].dtype.name]
        elif reduce == "ring":
            self.ring = col.GpuRing(self.devices)

    def _allreduce_bucket(self, b: int) -> None:
        cp = self.cp
        for r, d in enumerate(self.devices):
            with cp.cuda.Device(d):
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(self.compute[r])
                self.comm[r].wait_event(ev)
        self.nccl.groupStart()
        for r, d in enumerate(self.devices):
            with cp.cuda.Device(d):
                buf = self.flat[r][b]
                self.comms[r].allReduce(buf.data.ptr, buf.data.ptr, buf.size, self.nccl_type, self.nccl.NCCL_SUM,
                                        self.comm[r].ptr)
        self.nccl.groupEnd()

    def step(self, shards, lr: float):
        """One data-parallel SGD step on [(X_r, y_r) on GPU r]. Returns the replicas' losses (device arrays)."""
        cp = self.cp
        check_shards(shards, self.k)
        gens, left = [], [len(layers) for layers in self.plan]
        for r, d in enumerate(self.devices):
            with cp.cuda.Device(d), self.compute[r]:
                gens.append(grad_steps(self.params[r], *shards[r], checkpoint_every=self.checkpoint_every,
                                       out=self.grads[r]))
        for _ in range(len(self.params[0])):
            for r, d in enumerate(self.devices):
                with cp.cuda.Device(d), self.compute[r]:
                    i, _, _ = next(gens[r])
            b = self.bucket_of[i]
            left[b] -= 1
            if left[b] == 0 and self.reduce == "nccl" and self.overlap:
                self._allreduce_bucket(b)
        if self.reduce == "nccl" and not self.overlap:  # every bucket once the whole backward pass is queued
            for b in range(len(self.plan)):
                self._allreduce_bucket(b)
        losses = []
        for r, d in enumerate(self.devices):
            with cp.cuda.Device(d), self.compute[r]:
                try:
                    next(gens[r])
                except StopIteration as stop:
                    losses.append(stop.value)
        if self.reduce == "ring":
            for r, d in enumerate(self.devices):
                with cp.cuda.Device(d):
                    self.compute[r].synchronize()
            for b in range(len(self.plan)):
                self.ring.allreduce([self.flat[r][b] for r in range(self.k)])
            self.ring.synchronize()
        for r, d in enumerate(self.devices):
            with cp.cuda.Device(d), self.compute[r]:
                if self.reduce == "nccl":
                    ev = cp.cuda.Event(disable_timing=True)
                    ev.record(self.comm[r])
                    self.compute[r].wait_event(ev)
                sgd(self.params[r], self.grads[r], lr, scale=1.0 / self.replicas)
        return losses

    def synchronize(self) -> None:
        for r, d in enumerate(self.devices):
            with self.cp.cuda.Device(d):
                self.compute[r].synchronize()
                self.comm[r].synchronize()

"""PyTorch beside lesson 6's engine: the same trained weights in a ``torch.nn.Module``, timed with the course's
timer in the same run as the engine.

PyTorch is a benchmark comparison here, not a course dependency: pyproject.toml does not list it and no other
module of the course imports torch. Where it cannot run (not installed; a build without CUDA in GPU mode; CPU mode,
for timings) every function here says why in one line instead of raising, and ``run()`` of
benchmarks/inference_engine.py records that line as the figures ("skipped: ...").

What is timed, in FP32 and FP16, at batch 1 and at the plan's max batch (``VARIANTS``):

* PyTorch eager, with NCHW tensors and with channels_last ones (NHWC in memory, the engine's layout);
* the same model replayed from a CUDA graph (``torch.cuda.CUDAGraph``: warm-up on a side stream, capture with
  a static input and output, ``replay``), as PyTorch's documentation describes;
* ``torch.compile`` (``COMPILE_MODE``), and the compiled model captured in a CUDA graph the same way;

beside the course's "fused + graph" engine, all with ``bench.time_gpu`` (end to end: fresh inputs written into
the input buffer, untimed, before every call; CUDA events around the call) and ``bench.time_per_call`` (GPU
only: calls queued behind a hold kernel), the repeats of ``engine_table``.
"""
from __future__ import annotations

import contextlib
import functools
import io
import itertools
import time

import numpy as np

from benchmarks.inference_engine_model import NETWORK, OPTIMISED
from gpucourse import bench, records, runtime
from kernels import inference_engine as E

GOAL = 1.2  # the course's fused + graph engine at least this many times faster than PyTorch's best
PRECISIONS = ("fp32", "fp16")
# name -> (memory layout of the tensors, torch.compile, CUDA graph)
VARIANTS = {
    "eager, NCHW": ("contiguous", False, False),
    "eager, NHWC": ("channels_last", False, False),
    "CUDA graph, NCHW": ("contiguous", False, True),
    "CUDA graph, NHWC": ("channels_last", False, True),
    "torch.compile": ("channels_last", True, False),
    "torch.compile + CUDA graph": ("channels_last", True, True),
}
# max-autotune: Inductor times candidate kernels for every convolution and matrix product (its Triton templates
# against cuDNN and cuBLAS) on this GPU at this shape, as the engine's builder times its candidates.
# no-cudagraphs: the CUDA graph around the compiled model is the same capture as around eager PyTorch, reading one
# static input buffer. "reduce-overhead" would wrap it in Inductor's own graphs instead, which copy each input
# into a buffer of their own (one more kernel per call) and overwrite the output at the next call: another
# protocol than the other rows'.
COMPILE_MODE = "max-autotune-no-cudagraphs"
# once compiling has taken this long (all shapes together), no other compile starts: the shapes left are skipped,
# with the reason. A first compile with max-autotune takes tens of seconds per shape; 5 minutes keeps a record of
# the lesson (or its notebook cell) within 10 minutes
COMPILE_BUDGET_S = 300
COURSE = OPTIMISED  # the course's engine compared ("fused + graph"), and, where ``engines`` has them, the network in
# one kernel (NETWORK: its "network" rows)


# ------------------------------------------------------------------------------------ is PyTorch here?

def unavailable(*, cuda: bool = True) -> str | None:
    """Why PyTorch cannot be used here, in one line, or None. cuda=True: for timing on the GPU (GPU mode and a
    torch built with CUDA); cuda=False: for running the model on the CPU."""
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install
        return (f"torch is not importable here ({type(exc).__name__}: {exc}); PyTorch is a benchmark comparison, "
                "not a course dependency")
    if cuda and not runtime.is_gpu():
        return "timing PyTorch needs GPU mode (CPU mode shows the recorded figures)"
    if cuda and not torch.cuda.is_available():
        return f"this torch ({torch.__version__}) cannot use the GPU (a CPU-only build, or no CUDA driver it supports)"
    return None


def _torch():
    import torch

    return torch


# ------------------------------------------------------------------------------------ the model

@functools.lru_cache(maxsize=None)
def _module_class():
    torch = _torch()

    class Reference(torch.nn.Module):
        """The imported graph as PyTorch layers, run in the graph's order: ``steps`` are (kind, layer index,
        input tensors, output tensor); tensors are NCHW (any memory layout)."""

        def __init__(self, layers, steps, graph_input, graph_output):
            super().__init__()
            self.layers = torch.nn.ModuleList(layers)
            self.steps = tuple(steps)
            self.graph_input, self.graph_output = graph_input, graph_output

        def forward(self, x):
            vals = {self.graph_input: x}
            for kind, i, inputs, output in self.steps:
                if kind == "concat":
                    vals[output] = torch.cat([vals[t] for t in inputs], dim=1)
                elif kind == "add":  # a residual block's shortcut
                    vals[output] = vals[inputs[0]] + vals[inputs[1]]
                elif kind == "flatten":  # Keras flattens (H, W, C): channels_last memory makes this a view
                    vals[output] = vals[inputs[0]].permute(0, 2, 3, 1).flatten(1)
                else:
                    vals[output] = self.layers[i](vals[inputs[0]])
            return vals[self.graph_output]

        def extra_repr(self):
            return (f"{len(self.steps)} steps from {self.graph_input!r} to {self.graph_output!r}, in the graph's order; "
                    "between the layers: concatenation along channels, flatten in Keras's (H, W, C) order")

    class BiasAdd(torch.nn.Module):
        def __init__(self, b):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.from_numpy(np.asarray(b, np.float32).copy()), requires_grad=False)

        def forward(self, x):
            return x + self.bias.view(1, -1, 1, 1)

    return Reference, BiasAdd


def torch_model(g: E.Graph, *, precision: str = "fp32", device: str = "cpu", layout: str = "channels_last"):
    """A ``torch.nn.Module`` computing the imported graph ``g`` (``E.load_model_file()``) with its weights, in
    eval mode: input N x C x H x W, output the logits. Each Keras layer becomes the PyTorch layer a port would
    use: a Conv2D (Conv, then its BiasAdd) one ``nn.Conv2d`` with its stride and padding ("same": kh // 2);
    BatchNorm ``nn.BatchNorm2d`` with Keras's eps and running statistics; MaxPool ``nn.MaxPool2d`` with stride 1
    and padding size // 2 (padded values never win a max, as in Keras's "same"); AvgPool ``nn.AvgPool2d``;
    Concat along channels; Flatten in Keras's (H, W, C) order; Dense ``nn.Linear``; and ResNet-50's Pad
    (``nn.ZeroPad2d``), strided max pool, residual Add, global average pool and Softmax. Keras's kernels are
    kh x kw x C x K, PyTorch's K x C x kh x kw. precision "fp32" or "fp16" (``model.half()``); layout
    "contiguous" (NCHW in memory) or "channels_last" (NHWC in memory, the engine's layout)."""
    torch = _torch()
    nn = torch.nn
    if precision not in PRECISIONS:
        raise runtime.CourseInputError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if layout not in ("contiguous", "channels_last"):
        raise runtime.CourseInputError(f"layout must be 'contiguous' or 'channels_last', not {layout!r}")
    Reference, BiasAdd = _module_class()

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a, np.float32))

    layers, steps = [], []
    nodes = list(g.nodes)
    i = 0
    with torch.no_grad():
        while i < len(nodes):
            n = nodes[i]
            out = n.outputs[0]
            layer = None
            kind = n.op.lower()
            if n.op == "Conv":
                kh, kw, c, k = n.weights["w"].shape
                bias = nodes[i + 1] if i + 1 < len(nodes) and nodes[i + 1].op == "BiasAdd" \
                    and nodes[i + 1].inputs == [out] and len(g.consumers(out)) == 1 else None
                stride, (pt, pb, pl, pr) = E.conv_geometry(n.attrs)
                if pt != pb or pl != pr:
                    raise runtime.CourseError(f"node {n.name!r}: uneven padding {[pt, pb, pl, pr]} has no nn.Conv2d")
                layer = nn.Conv2d(c, k, (kh, kw), stride=stride, padding=(pt, pl), bias=bias is not None)
                layer.weight.copy_(t(n.weights["w"].transpose(3, 2, 0, 1)))
                if bias is not None:
                    layer.bias.copy_(t(bias.weights["b"]))
                    out, i = bias.outputs[0], i + 1
            elif n.op == "BiasAdd":
                layer = BiasAdd(n.weights["b"])
            elif n.op == "BatchNorm":
                W = n.weights
                layer = nn.BatchNorm2d(len(W["gamma"]), eps=n.attrs["eps"])
                for name, key in (("weight", "gamma"), ("bias", "beta"), ("running_mean", "mean"),
                                  ("running_var", "var")):
                    getattr(layer, name).copy_(t(W[key]))
            elif n.op == "Relu":
                layer = nn.ReLU()
            elif n.op == "MaxPool" and "stride" in n.attrs:  # after a Pad of zeros (ResNet's): a "valid" pool
                layer = nn.MaxPool2d(n.attrs["size"], stride=n.attrs["stride"])
            elif n.op == "MaxPool":
                layer = nn.MaxPool2d(n.attrs["size"], stride=1, padding=n.attrs["size"] // 2)
            elif n.op == "Pad":  # Keras' ZeroPadding2D: (left, right, top, bottom) in torch's order
                t_, b_, l_, r_ = n.attrs["pad"]
                layer = nn.ZeroPad2d((l_, r_, t_, b_))
            elif n.op == "GlobalAvgPool":
                layer = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
            elif n.op == "Softmax":
                layer = nn.Softmax(dim=1)
            elif n.op == "AvgPool":
                layer = nn.AvgPool2d(n.attrs["size"])
            elif n.op == "Dense":
                w = n.weights["w"]
                layer = nn.Linear(w.shape[0], w.shape[1])
                layer.weight.copy_(t(w.T))
                layer.bias.copy_(t(n.weights["b"]))
            elif n.op not in ("Concat", "Flatten", "Add"):
                raise runtime.CourseError(f"node {n.name!r}: op {n.op!r} has no PyTorch layer here; build the "
                                          "reference from the imported graph (E.load_model_file()), not an "
                                          "optimised one")
            if layer is not None:
                layers.append(layer)
            steps.append((kind, len(layers) - 1, tuple(n.inputs), out))
            i += 1
    model = Reference(layers, steps, g.input, g.output).eval().requires_grad_(False)
    model.precision, model.layout = precision, layout
    if precision == "fp16":
        model = model.half()
    model = model.to(device)
    return model.to(memory_format=torch.channels_last) if layout == "channels_last" else model


def as_input(x, *, precision: str = "fp32", device: str = "cpu", layout: str = "channels_last"):
    """The course's images (N x H x W x C, NumPy) as the model's input: N x C x H x W, in the precision's dtype,
    in ``layout``. The channels_last tensor is the NHWC array itself, seen in NCHW order."""
    torch = _torch()
    y = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(device).permute(0, 3, 1, 2)
    y = y.to(torch.float16 if precision == "fp16" else torch.float32)
    return y.contiguous(memory_format=torch.channels_last if layout == "channels_last" else torch.contiguous_format)


def logits(model, x, *, batch: int = 256) -> np.ndarray:
    """The logits (float32 NumPy) of a ``torch_model`` for images x (N x H x W x C), in batches, without autograd."""
    torch = _torch()
    device = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for s in range(0, len(x), batch):
            y = model(as_input(x[s:s + batch], precision=model.precision, device=device, layout=model.layout))
            out.append(y.float().cpu().numpy())
    return np.concatenate(out)


# ------------------------------------------------------------------------------------ timing (GPU mode)

def torch_stream():
    """CuPy's current stream as a torch stream: where torch must queue its work for the course's timer to see it.

    ``bench.time_gpu`` records its CUDA events on CuPy's current stream; torch queues its kernels on torch's
    current stream. Were those two streams, nothing would order torch's kernels between the two events: the end
    event could complete before they ran, and the time would be that of no work. Both libraries start on the
    legacy default stream (handle 0), but either can be moved (a ``with cupy.cuda.Stream():`` block, CuPy's
    per-thread default stream), so torch is pointed at the stream CuPy's events are on, whatever it is: every
    torch call below runs inside ``torch.cuda.stream(torch_stream())``. (A CUDA graph is captured on a side
    stream of torch's own, as capture must be; ``replay`` launches it on the current stream, this one.)"""
    torch = _torch()
    cp = runtime.cupy()
    device = torch.device("cuda", cp.cuda.Device().id)  # CuPy's current GPU
    ptr = cp.cuda.get_current_stream().ptr
    default = torch.cuda.default_stream(device)
    return default if ptr == default.cuda_stream else torch.cuda.ExternalStream(ptr, device=device)


@contextlib.contextmanager
def _settings(torch):
    """cuDNN times its algorithms for every convolution shape and keeps the fastest (benchmark mode: what the
    engine's builder does), and FP32 stays FP32: TF32, which PyTorch allows for cuDNN's convolutions by default,
    rounds inputs to 10 bits of mantissa, and the engine's FP32 kernels round nothing."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    old = cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32
    cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32 = True, False, False
    try:
        yield
    finally:
        cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32 = old


def _one_line(exc: BaseException, width: int = 300) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:width]


class _NotRun(Exception):
    """A measurement that cannot be made; its message is recorded in place of the time."""


def capture(fn, x, *, warmup: int = 3):
    """``fn(x)`` recorded as a CUDA graph, as PyTorch's documentation does it: a few warm-up calls on a side
    stream (cuDNN's benchmark, Inductor's first run and the allocator's first requests happen there, not
    during capture), then one call captured with ``torch.cuda.graph``. Returns a function that replays the
    graph on the current stream and returns its static output: the graph always reads ``x``'s memory and
    writes the same output tensor, so a new input is written into ``x`` first."""
    torch = _torch()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fn(x)

    def replay():
        graph.replay()
        return y

    replay.graph = graph  # kept alive with the function
    return replay


def _timings(call, setup, repeats: int) -> tuple:
    """(end to end, GPU only) Timings of ``call()``, as engine_table times an engine."""
    e2e = bench.time_gpu(lambda _x: call(), setup=setup, repeats=repeats, warmup=5)
    gpu = bench.time_per_call(call, batch=8, repeats=max(repeats // 3, 5))
    return e2e, gpu


def _fill(row: dict, what: str, e2e, gpu) -> None:
    """The engine rows' keys: latency_* at batch 1, batch_* at the max batch."""
    if what == "latency":
        row.update(latency_ms=e2e.median_ms, latency=e2e.summary(), latency_gpu_ms=gpu.median_ms,
                   latency_gpu=gpu.summary())
    else:
        row.update(batch_ms=e2e.median_ms, batch_timing=e2e.summary(), batch_gpu_ms=gpu.median_ms,
                   batch_gpu_timing=gpu.summary(), images_per_s=row["batch"] / (e2e.median_ms * 1e-3))


def _cycle_into(buf, xs):
    """A ``setup`` for time_gpu: the next of ``xs`` written (untimed) into ``buf``, which it returns."""
    it = itertools.cycle(xs)

    def setup():
        if hasattr(buf, "copy_"):  # a torch tensor
            buf.copy_(next(it))
        else:  # a CuPy array
            buf[...] = next(it)
        return buf
    return setup


def table(g: E.Graph, engines: dict, d: dict, *, repeats: int = 30, compile_mode: str = COMPILE_MODE,
          compile_budget_s: float | None = None, variants: tuple | None = None,
          precisions: tuple = PRECISIONS) -> dict:
    """PyTorch's rows (``VARIANTS``, the model of the imported graph ``g``) beside the course's "fused + graph"
    engine (from ``engines``, as ``build_engines`` returns them; and its "one kernel (the network)" engines where
    ``engines`` has them: the figures' "network" rows), per precision, at batch 1 and at the engines' max batch, on
    the same images as ``engine_table``; the speed-ups of the course engine over PyTorch's best; each row's accuracy
    and largest difference from Keras's logits. Never raises for PyTorch's sake: without it the figures say why
    ({"available": False, "why": "skipped: ..."}), and a variant that cannot be timed (a compile error, the compile
    budget spent) keeps the reason in its row's "status" and None for its times. compile_budget_s: None takes
    COMPILE_BUDGET_S."""
    why = unavailable()
    if why:
        return {"available": False, "why": f"skipped: {why}"}
    torch = _torch()
    cp = runtime.cupy()
    variants = tuple(variants or VARIANTS)
    compile_budget_s = COMPILE_BUDGET_S if compile_budget_s is None else compile_budget_s
    max_batch = next(iter(engines.values()))[0].header["max_batch"]
    rng = np.random.default_rng(0)  # the same images as engine_table: 8 single images, 4 full batches
    x_test = d["x_test"]
    images = {1: [x_test[i:i + 1] for i in rng.choice(len(x_test), 8, replace=False)],
              max_batch: [x_test[rng.choice(len(x_test), max_batch)] for _ in range(4)]}
    sizes = (("latency", 1), ("batch", max_batch))
    layouts = {VARIANTS[v][0] for v in variants}
    dev = torch.device("cuda", cp.cuda.Device().id)  # the GPU CuPy and the engines use
    all_models = {p: {layout: torch_model(g, precision=p, device=dev, layout=layout) for layout in layouts}
                  for p in precisions}  # built outside inference mode: plain parameters, as a user's model has
    stream = torch_stream()
    rows, course, network, compile_s = [], [], [], {}
    with _settings(torch), torch.cuda.device(dev), torch.cuda.stream(stream), torch.inference_mode():
        for p in bench.progress(precisions, desc="PyTorch beside the engine"):
            P = p.upper()
            # the course's engine, timed again here beside PyTorch, as engine_table times it; and the network in one
            # kernel, where the engines have it
            course.append(_engine_row(f"{COURSE}, {P}", engines, p, max_batch, sizes, images, repeats, d))
            if f"{NETWORK}, {P}" in engines:
                network.append(_engine_row(f"{NETWORK}, {P}", engines, p, max_batch, sizes, images, repeats, d))

            torch.compiler.reset()  # compiled code of earlier models and shapes: none counts against the recompile limit
            models = all_models.pop(p)
            compiled = {}  # batch size -> (compiled model or None, why not); "fn": the compiled model

            def compiled_at(n, x):
                """The compiled model, compiled (and autotuned) for this batch size on first use, within the budget."""
                if n not in compiled:
                    spent = sum(compile_s.values())
                    t0 = time.perf_counter()
                    try:
                        if spent > compile_budget_s:
                            raise _NotRun(f"skipped: compiling took {spent:.0f} s before this shape, over the budget "
                                          f"of {compile_budget_s:.0f} s")
                        if "fn" not in compiled:  # one compiled model per precision, specialised per batch size
                            compiled["fn"] = torch.compile(models["channels_last"], mode=compile_mode, dynamic=False,
                                                           fullgraph=True)
                        fn = compiled["fn"]
                        # max-autotune writes a table of every candidate it timed to stderr (hundreds of lines
                        # in a notebook); its choice is what is timed here, so the tables are not shown
                        with contextlib.redirect_stderr(io.StringIO()):
                            fn(x)
                            torch.cuda.synchronize()
                        compiled[n] = (fn, None)
                    except _NotRun as exc:
                        compiled[n] = (None, str(exc))
                    except Exception as exc:  # Inductor or Triton missing or failing: recorded, not raised
                        compiled[n] = (None, f"failed: torch.compile: {_one_line(exc)}")
                    compile_s[(p, n)] = time.perf_counter() - t0
                fn, why = compiled[n]
                if why:
                    raise _NotRun(why)
                return fn

            for v in variants:
                layout, is_compiled, graph = VARIANTS[v]
                row = {"name": f"PyTorch {v}, {P}", "variant": v, "precision": p, "layout": layout,
                       "compiled": is_compiled, "graph": graph, "batch": max_batch}
                problems = []
                for what, n in sizes:
                    call = None
                    try:
                        staged = [as_input(a, precision=p, device=dev, layout=layout) for a in images[n]]
                        x = torch.empty_like(staged[0])  # the static input buffer (same shape, dtype and layout)
                        x.copy_(staged[0])
                        fn = compiled_at(n, x) if is_compiled else models[layout]
                        if is_compiled:
                            row[f"compile_s_{what}"] = compile_s[(p, n)]
                        if graph:
                            call = capture(fn, x)
                        else:
                            for _ in range(3):  # cuDNN's benchmark for this shape, outside the timing
                                fn(x)
                            call = functools.partial(fn, x)
                        _fill(row, what, *_timings(call, _cycle_into(x, staged), repeats))
                        if n == max_batch:  # accuracy and Keras's logits through the same call, batches padded to n
                            out = []
                            for s in range(0, len(x_test), n):
                                k = len(x_test[s:s + n])
                                x.zero_()
                                x[:k].copy_(as_input(x_test[s:s + n], precision=p, device=dev, layout=layout))
                                out.append(call()[:k].float().cpu().numpy().copy())  # the output is overwritten
                            out = np.concatenate(out)
                            row.update(accuracy=float(np.mean(out.argmax(1) == d["y_test"])),
                                       max_diff_keras=float(np.abs(out - d["keras_logits"]).max()))
                    except Exception as exc:
                        why = str(exc) if isinstance(exc, _NotRun) else f"failed: {_one_line(exc)}"
                        problems.append(f"batch {n}: {why}")
                        row.update({f"{what}_ms": None, f"{what}_gpu_ms": None})
                    del call
                row["status"] = "; ".join(problems) or "ok"
                rows.append(row)
            torch.cuda.synchronize()
            torch.compiler.reset()
            torch.cuda.empty_cache()
    out = {"available": True, "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version(), "triton": _version("triton"),
           "compile_mode": compile_mode, "compile_budget_s": compile_budget_s, "compile_s": sum(compile_s.values()),
           "cudnn_benchmark": True, "tf32": False,
           "stream": f"torch on CuPy's current stream (handle {stream.cuda_stream})",
           "inputs": "N x C x H x W; FP32 rows float32, FP16 rows float16 (model.half() with half inputs: the "
                     "engine takes float32 and converts in its first kernel); NHWC rows: channels_last memory",
           "timing": "end to end: bench.time_gpu, fresh inputs written untimed into the input buffer; GPU only: "
                     "bench.time_per_call (hold)",
           "repeats": repeats, "rows": rows, "course": course, "network": network, "goal": GOAL,
           "keras_accuracy": d["keras_accuracy"], "test_images": len(d["y_test"])}
    out.update(speedups(out))
    return out


def _engine_row(name: str, engines: dict, p: str, max_batch: int, sizes, images: dict, repeats: int,
                d: dict) -> dict:
    """One of the course's engines (``engines[name]``), timed at batch 1 and at the max batch as engine_table times
    it, with its accuracy and largest difference from Keras's logits."""
    cp = runtime.cupy()
    _, eng, _ = engines[name]
    c = {"name": name, "precision": p, "batch": max_batch}
    for what, n in sizes:
        buf = eng.input_buffer(n)
        setup = _cycle_into(buf, [cp.asarray(a) for a in images[n]])
        _fill(c, what, *_timings(functools.partial(eng.infer, buf), setup, repeats))
    out = E.predict(eng, d["x_test"])
    c.update(accuracy=float(np.mean(out.argmax(1) == d["y_test"])),
             max_diff_keras=float(np.abs(out - d["keras_logits"]).max()))
    return c


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


def speedups(t: dict) -> dict:
    """{"speedups": {f"{p}_{latency|batch}[_gpu]": PyTorch's best time over the course engine's}, "best": {same
    keys: the name of PyTorch's best row}}, from the rows of one run. Larger is better for the course: 1.2 means
    the course engine takes 1 / 1.2 of PyTorch's best time. latency: batch 1; batch: the max batch; _gpu: GPU
    only, else end to end (the goal's). The network in one kernel, where the run has it: the same keys with
    "network_" before them."""
    ratios, best = {}, {}
    for prefix, engines in (("", t["course"]), ("network_", t.get("network", []))):
        for c in engines:
            p = c["precision"]
            for key in ("latency", "batch", "latency_gpu", "batch_gpu"):
                ms = {r["name"]: r[f"{key}_ms"] for r in t["rows"] if r["precision"] == p and r.get(f"{key}_ms")}
                if ms and c.get(f"{key}_ms"):
                    name = min(ms, key=ms.get)
                    ratios[f"{prefix}{p}_{key}"], best[f"{prefix}{p}_{key}"] = ms[name] / c[f"{key}_ms"], name
    return {"speedups": ratios, "best": best}


def _comparisons(t: dict):
    """(what, key of speedups) for each precision and batch size the goal is about (and the network in one kernel's,
    where the run has it)."""
    for prefix, engines in (("", t["course"]), ("network_", t.get("network", []))):
        for c in engines:
            for what, size in (("latency", 1), ("batch", c["batch"])):
                yield f"{c['name']} over PyTorch's best, batch {size}", f"{prefix}{c['precision']}_{what}"


def targets_met(t: dict) -> dict:
    """{what: (speed-up, goal, met)}: the course engine against PyTorch's best, end to end, per precision and
    batch size; a comparison for which no PyTorch row could be timed is left out."""
    return {what: (t["speedups"][key], t["goal"], t["speedups"][key] >= t["goal"])
            for what, key in _comparisons(t) if key in t["speedups"]}


def _cells(t: dict, prefix: str = "") -> tuple:
    """([cells where the course engine is faster than PyTorch's best], [cells where it is slower]), end to end,
    each cell named "FP32 at batch 1"; ``prefix`` "network_" reads the network in one kernel."""
    ahead, behind = [], []
    for what, key in _comparisons(t):
        if key.startswith(prefix) and (prefix or not key.startswith("network_")) and key in t["speedups"]:
            p, kind = key.removeprefix(prefix).split("_", 1)
            cell = f"{p.upper()} at batch {1 if kind == 'latency' else t['course'][0]['batch']}"
            (ahead if t["speedups"][key] > 1 else behind).append(cell)
    return ahead, behind


def ahead_line(t: dict) -> str:
    """Where the fused + graph engine is faster than PyTorch's best of this comparison, end to end, and where
    slower: the sentence notebook 06 reads its tables by, made from their figures."""
    ahead, behind = _cells(t)
    return (f"the fused + graph engine over PyTorch's best: faster in {', '.join(ahead) or 'no cell'}; "
            f"slower in {', '.join(behind) or 'no cell'}")


def reading(t: dict) -> list:
    """What notebook 06 says in words about a comparison that timed torch.compile, each statement with whether it
    holds in ``t``: [(statement, True, False or None)], None where ``t`` lacks the figures (no torch.compile
    rows, no network in one kernel). Every record holds every statement (a records test asserts it)."""
    compiled = any(r["variant"].startswith("torch.compile") for r in t.get("rows", []))
    b = t["course"][0]["batch"] if t.get("course") else None
    ahead, behind = _cells(t)
    net_ahead, net_behind = _cells(t, "network_")
    eager = {r["precision"]: r for r in t.get("rows", []) if r["variant"].startswith("eager")}

    def over_eager():
        return all(min(r[f"{k}_ms"] for r in t["rows"] if r["variant"].startswith("eager") and r["precision"]
                       == c["precision"]) >= 2 * c[f"{k}_ms"] for c in t["course"] for k in ("latency", "batch"))

    def best_is_compiled():
        return all(("torch.compile" in name) == (key != "fp32_latency") for key, name in t["best"].items()
                   if not key.startswith("network_") and not key.endswith("_gpu"))

    def slower_on_gpu_too():
        return all(t["speedups"][f"{key}_gpu"] < 1 for what, key in _comparisons(t)
                   if not key.startswith("network_") and t["speedups"].get(key, 2) < 1)

    return [
        ("against eager PyTorch: the fused + graph engine at least 2x faster in every cell",
         (over_eager() if eager else None)),
        ("PyTorch's best: torch.compile + CUDA graph in every cell but FP32 at batch 1",
         best_is_compiled() if compiled else None),
        (f"the fused + graph engine faster than PyTorch's best only in FP32 at batch {b}",
         (ahead == [f"FP32 at batch {b}"]) if compiled else None),
        ("where the fused + graph engine is slower end to end, it is slower on the GPU alone too",
         slower_on_gpu_too() if behind else None),
        ("the network in one kernel faster than PyTorch's best in every cell",
         (not net_behind and bool(net_ahead)) if t.get("network") else None),
    ]


# ------------------------------------------------------------------------------------ text and plots

def text(t: dict | None) -> str:
    """The comparison as a table, with the speed-ups against the goal; a line saying why where there is none."""
    if t is None:
        return "PyTorch was not measured on this record."
    if not t.get("available"):
        return f"PyTorch beside the engine: {t['why']}"
    b = t["course"][0]["batch"] if t["course"] else "max"
    lines = [f"PyTorch {t['torch']} (CUDA {t['cuda']}, cuDNN {t['cudnn']} in benchmark mode, TF32 off; torch.compile "
             f"mode {t['compile_mode']}) on the same weights and images", f"timing: {t['timing']}",
             f"{'':40} {'batch 1':>10} {'(GPU':>9} {'batch ' + str(b):>10} {'(GPU':>9} {'images/s':>11} "
             f"{'accuracy':>9} {'max |Δ|':>8}",
             f"{'':40} {'end to end':>10} {'only)':>9} {'end to end':>10} {'only)':>9} {'':>11} {'':>9} "
             f"{'Keras':>8}"]

    def ms(v):
        return bench.format_ms(v) if v else "—"

    for p in PRECISIONS:
        group = [dict(c, name=f"course: {c['name']}") for c in t["course"] + t.get("network", [])
                 if c["precision"] == p] + [r for r in t["rows"] if r["precision"] == p]
        for r in group:
            acc = f"{100 * r['accuracy']:8.2f}%" if "accuracy" in r else f"{'—':>9}"
            diff = f"{r['max_diff_keras']:8.1e}" if "max_diff_keras" in r else f"{'—':>8}"
            ips = f"{r['images_per_s']:11,.0f}" if r.get("images_per_s") else f"{'—':>11}"
            lines.append(f"{r['name']:40} {ms(r.get('latency_ms')):>10} {ms(r.get('latency_gpu_ms')):>9} "
                         f"{ms(r.get('batch_ms')):>10} {ms(r.get('batch_gpu_ms')):>9} {ips} {acc} {diff}")
    for r in t["rows"]:
        if r["status"] != "ok":
            lines.append(f"{r['name']}: {r['status']}")
    took = [f"{r['compile_s_' + w]:.1f} s ({r['precision'].upper()}, batch {1 if w == 'latency' else b})"
            for r in t["rows"] if r["variant"] == "torch.compile" for w in ("latency", "batch")
            if r.get("compile_s_" + w) is not None]
    if took:
        lines.append("torch.compile took " + ", ".join(took))
    for what, key in _comparisons(t):
        if key not in t["speedups"]:
            lines.append(f"{what}: no PyTorch row was timed")
            continue
        ratio, goal = t["speedups"][key], t["goal"]
        gpu = t["speedups"].get(f"{key}_gpu")
        lines.append(f"{what} ({t['best'][key]}): {ratio:.2f}x end to end" + (f", {gpu:.2f}x GPU only" if gpu else "")
                     + f" (goal {goal:g}x) {'met' if ratio >= goal else 'NOT met'}")
    return "\n".join(lines)


def header_lines(t: dict | None) -> list:
    """What was compared, in lines of at most 100 characters (``view`` tabulates the rows)."""
    if t is None:
        return ["PyTorch was not measured on this record."]
    if not t.get("available"):
        return [f"PyTorch beside the engine: {t['why']}"]
    return [f"PyTorch {t['torch']} (CUDA {t['cuda']}, cuDNN {t['cudnn']} in benchmark mode, TF32 off)",
            f"torch.compile mode {t['compile_mode']}; the same weights and images, the same timer"]


def measured_variants(t: dict | None) -> set:
    """The PyTorch variants this comparison timed (VARIANTS' names): a run with TORCH_COMPILE off has no
    torch.compile rows."""
    return {r["variant"] for r in (t or {}).get("rows", [])}


def view(t: dict, source: str = ""):
    """Every row of the comparison as a table (HTML in a notebook): the course's engines first, then PyTorch's."""
    from gpucourse import plots

    def ms(v):
        return bench.format_ms(v) if v else "—"

    b = t["course"][0]["batch"] if t["course"] else "max"
    rows = []
    for p in PRECISIONS:
        group = [dict(c, name=f"course: {c['name']}") for c in t["course"] + t.get("network", [])
                 if c["precision"] == p] + [r for r in t["rows"] if r["precision"] == p]
        for r in group:
            rows.append([r["name"], ms(r.get("latency_ms")), ms(r.get("latency_gpu_ms")), ms(r.get("batch_ms")),
                         ms(r.get("batch_gpu_ms")), f"{r['images_per_s']:,.0f}" if r.get("images_per_s") else "—",
                         f"{100 * r['accuracy']:.2f}%" if "accuracy" in r else "—"])
    return plots.table(["engine", "batch 1", "(GPU only)", f"batch {b}", "(GPU only)", "images/s", "accuracy"], rows,
                       align="lrrrrrr", title="Beside PyTorch on the same weights: one inference, end to end",
                       source=source)


def speedup_view(t: dict, source: str = ""):
    """Each course engine's speed over PyTorch's best row of the same run (end to end, the goal's; and GPU only),
    which row that was, and the goal."""
    from gpucourse import plots

    rows = []
    for what, key in _comparisons(t):
        engine, size = what.split(" over PyTorch's best, ")
        if key not in t["speedups"]:
            rows.append([engine, size, "no PyTorch row was timed", "", "", ""])
            continue
        ratio, gpu = t["speedups"][key], t["speedups"].get(f"{key}_gpu")
        rows.append([engine, size, t["best"][key].removeprefix("PyTorch "), f"{ratio:.2f}x",
                     f"{gpu:.2f}x" if gpu else "—", "met" if ratio >= t["goal"] else "NOT met"])
    return plots.table(["engine", "batch", "PyTorch's best in this comparison", "speed-up", "(GPU only)",
                        f"goal {t['goal']:g}x"], rows, align="lllrrl",
                       title="The course's engines over PyTorch's fastest row (larger: the engine is faster)",
                       source=source)


def plot(t: dict, source: str, *, gpu_only: bool = False):
    """Bars of every row, one panel per precision and batch size, the course's engine first and in another
    colour; each panel's title gives the course engine's speed-up over PyTorch's best."""
    import matplotlib.pyplot as plt

    if not t or not t.get("available"):
        raise runtime.CourseError(f"no PyTorch figures to draw: {text(t)}")
    b = t["course"][0]["batch"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 7))
    for i, p in enumerate(PRECISIONS):
        group = [dict(c, name=f"course: {c['name']}") for c in t["course"] + t.get("network", [])
                 if c["precision"] == p] + [r for r in t["rows"] if r["precision"] == p]
        for j, what in enumerate(("latency", "batch")):
            ax = axes[i][j]
            key = f"{what}{'_gpu' if gpu_only else ''}_ms"
            names = [r["name"].removeprefix("PyTorch ").removesuffix(f", {p.upper()}") for r in group]
            vals = [1000 * r[key] if r.get(key) else 0.0 for r in group]
            ax.barh(names, vals, color=["tab:orange" if n.startswith("course") else "tab:blue" for n in names])
            for k, v in enumerate(vals):
                ax.text(v, k, f" {v:,.0f} µs" if v else " not timed", va="center", fontsize=8)
            ax.invert_yaxis()
            ax.set_xlim(0, max(vals + [1e-9]) * 1.3)
            ax.tick_params(axis="y", labelsize=8)
            ax.set_xlabel("µs")
            ratio = t["speedups"].get(f"{p}_{what}{'_gpu' if gpu_only else ''}")
            ax.set_title(f"{p.upper()}, batch {1 if what == 'latency' else b}"
                         + (f": course {ratio:.2f}x PyTorch's best (goal {t['goal']:g}x)" if ratio else ""),
                         fontsize=9, loc="left")
            ax.grid(True, axis="x", alpha=0.3)
    how = "GPU only" if gpu_only else "end to end"
    fig.suptitle(f"The course's fused + graph engine beside PyTorch {t['torch']} on the same weights, {how}\n{source}",
                 fontsize=10)
    fig.tight_layout()
    return fig

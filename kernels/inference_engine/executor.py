"""The runtime: ``Engine`` runs a plan, with the CUDA C kernels of kernels/cuda/inference_engine.cu through CuPy on a
GPU (launched one by one, or replayed as one CUDA graph) and the same steps in NumPy on a CPU.
"""
from __future__ import annotations

import math

import numpy as np

from gpucourse import runtime

from gpucourse import cuda_c
from .catalog import CONV_KERNELS, DIRECT, SOURCE, TC, TCD, THREADS
from .plan import check_target, Plan
from .precision import DTYPES, Q, SUFFIX
from .specs import avgpool_spec, im2col, maxpool_spec


class Engine:
    """Runs a plan: CUDA C kernels through CuPy in GPU mode, NumPy in CPU mode (same steps, same arithmetic:
    FP16 storage with FP32 accumulation, INT8 storage with int32 accumulation).

    ``launches`` counts the kernels run since the engine was made, ``host_launches`` the launches the host
    made for them: one per kernel when the steps are launched one by one ("eager"), one per inference when
    a CUDA graph replays them all (plus one copy when the input is not already in ``input_buffer``)."""

    def __init__(self, plan: Plan, *, numpy: bool = False, graphs: bool | None = None):
        """numpy=True runs the plan with the NumPy runtime whatever the mode (what the GPU kernels are checked
        against). graphs: replay each batch size's launches as one CUDA graph (GPU mode only); None takes the
        plan's choice (build_plan's ``graphs``)."""
        check_target(plan)
        self.plan = plan
        self.precision = plan.header["precision"]
        self.dtype = DTYPES[self.precision]
        self.gpu = plan.header["target"]["kind"] == "gpu" and not numpy
        self.graphs = bool(plan.header.get("graphs", False) if graphs is None else graphs) and self.gpu
        self.launches = 0
        self.host_launches = 0
        self.max_batch = plan.header["max_batch"]
        if self.gpu:
            cp = runtime.cupy()
            self.xp = cp
            self.dev = {k: cp.asarray(v) for k, v in plan.arrays.items()}
            self._fn = {}
            self._prepared = {}
            self._graph = {}  # batch size -> cupy.cuda.Graph
        else:
            self.xp = np
            self.dev = plan.arrays
        self.arena = self.xp.zeros(plan.header["arena"], self.dtype)
        self.out = self.xp.zeros((self.max_batch, plan.header["outputs"]), np.float32)
        # the input binding: where a CUDA graph reads the input (its kernels' arguments are fixed pointers)
        self.input = self.xp.zeros((self.max_batch, *plan.header["input_shape"]), np.float32)
        self._x = None

    def input_buffer(self, n: int):
        """The engine's own input buffer for a batch of n: an input written here is read in place (no copy)."""
        return self.input[:n]

    def refresh(self, step_id: int) -> None:
        """Forget the compiled kernel of a step (after its kernel choice changed)."""
        if self.gpu:
            self._fn.pop(step_id, None)
            self._prepared = {k: v for k, v in self._prepared.items() if k[0] != step_id}
            self._graph.clear()  # a graph holds the kernels it was captured with

    # ------------------------------------------------------------------ the public call
    def infer(self, x):
        """Logits (N x outputs, float32) of a batch of inputs N x H x W x C float32 (a NumPy array, or a
        CuPy array in GPU mode), N <= the plan's max_batch."""
        shape = tuple(self.plan.header["input_shape"])
        if self.gpu and not runtime.is_device_array(x):
            x = self.xp.asarray(np.asarray(x, np.float32))
        if getattr(x, "ndim", 0) != 4 or tuple(x.shape[1:]) != shape:
            raise runtime.CourseInputError(f"the input must be N x {' x '.join(map(str, shape))}, got "
                                           f"{tuple(getattr(x, 'shape', ()))}")
        if np.dtype(x.dtype) != np.float32:
            raise runtime.CourseInputError(f"the input must be float32, got {np.dtype(x.dtype)}")
        n = x.shape[0]
        if not 1 <= n <= self.max_batch:
            raise runtime.CourseInputError(f"a batch of {n}: this plan takes 1 to {self.max_batch} inputs")
        if self.graphs:
            self._infer_graph(x, n)
            return self.out[:n]
        self._x = self.xp.ascontiguousarray(x)
        for step in self.plan.steps:
            self.run_step(step["id"], n)
        return self.out[:n]

    def run_step(self, i: int, n: int) -> None:
        step = self.plan.steps[i]
        self.launches += 1
        self.host_launches += 1
        (self._gpu_step if self.gpu else self._numpy_step)(step, n)

    # ------------------------------------------------------------------ CUDA graphs
    def _infer_graph(self, x, n: int) -> None:
        """One inference as one graph launch. The graph was captured with the input buffer's address, so an
        input elsewhere is first copied there."""
        binding = self.input[:n]
        if x.data.ptr != binding.data.ptr:
            binding[...] = x
            self.host_launches += 1
        graph = self._graph.get(n)
        if graph is None:
            graph = self._graph[n] = self.capture(n)
        graph.launch()
        self.launches += len(self.plan.steps)
        self.host_launches += 1

    def capture(self, n: int):
        """The plan's launches for a batch of n, recorded once as a CUDA graph (cupy.cuda.Graph): CuPy's
        stream capture records the kernels launched on a (non-default) stream instead of running them, and
        ``graph.launch()`` then replays the whole sequence with one call from the host."""
        runtime.require_gpu("capturing a CUDA graph")
        cp = runtime.cupy()
        self._x = self.input[:n]
        for step in self.plan.steps:  # compile and prepare every kernel first: nothing may load during capture
            self._gpu_step(step, n)
        cp.cuda.Device().synchronize()
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            try:
                for step in self.plan.steps:
                    self._gpu_step(step, n)
            finally:
                graph = stream.end_capture()
        return graph

    # ------------------------------------------------------------------ NumPy
    def _view(self, loc, n):
        a = self.arena[loc["base"]: loc["base"] + n * loc["H"] * loc["W"] * loc["ld"]]
        return a.reshape(n, loc["H"], loc["W"], loc["ld"])[..., loc["off"]: loc["off"] + loc["C"]]

    def _numpy_step(self, s, n):
        a = self.dev
        i = s["id"]
        kind = s["kind"]
        if kind == "input":
            v = self._x.reshape(self._view(s["dst"], n).shape)
            self._view(s["dst"], n)[...] = _store(v.astype(np.float32), self.dtype, s["inv_scale"])
        elif kind == "conv":
            x = self._view(s["src"], n)
            cols = im2col(x, s["kh"], s["kw"]).reshape(-1, a[f"{i}/w"].shape[0])
            if self.precision == "int8":
                # integer products summed exactly (float64 holds every such sum exactly), as int32 on a GPU
                acc = (cols.astype(np.float64) @ a[f"{i}/w"].astype(np.float64)).astype(np.float32) * a[f"{i}/scale"]
            else:
                acc = cols.astype(np.float32) @ a[f"{i}/w"].astype(np.float32)
            if s["bias"]:
                acc = acc + a[f"{i}/b"]
            if s["relu"]:
                acc = np.maximum(acc, 0)
            start = 0
            for d in s["dests"]:
                part = acc[:, start:start + d["C"]]
                inv = a[f"{i}/inv"][start] if self.precision == "int8" else 1.0
                self._view(d, n)[...] = _store(part, self.dtype, inv).reshape(self._view(d, n).shape)
                start += d["C"]
        elif kind in ("biasadd", "batchnorm", "relu"):
            v = self._view(s["dst"], n).astype(np.float32)
            if kind == "biasadd":
                v = v + a[f"{i}/b"]
            elif kind == "batchnorm":
                v = (v - a[f"{i}/mean"]) / np.sqrt(a[f"{i}/var"] + np.float32(s["eps"])) * a[f"{i}/gamma"] \
                    + a[f"{i}/beta"]
            else:
                v = np.maximum(v, 0)
            self._view(s["dst"], n)[...] = v.astype(self.dtype)
        elif kind == "maxpool":
            self._view(s["dst"], n)[...] = maxpool_spec(self._view(s["src"], n).astype(np.float32),
                                                        s["size"]).astype(self.dtype)
        elif kind == "concat_copy":
            self._view(s["dst"], n)[...] = self._view(s["src"], n)
        elif kind == "avgpool":
            self._view(s["dst"], n)[...] = avgpool_spec(self._view(s["src"], n).astype(np.float32),
                                                        s["size"]).astype(self.dtype)
        elif kind == "dense":
            x = self._view(s["src"], n).reshape(n, -1).astype(np.float32)
            self.out[:n] = x @ a[f"{i}/w"] + a[f"{i}/b"]
        elif kind == "head":
            x = self._view(s["src"], n).astype(np.float32) * np.float32(s["x_scale"])
            p = avgpool_spec(x, s["size"]).reshape(n, -1)
            self.out[:n] = p @ a[f"{i}/w"] + a[f"{i}/b"]

    # ------------------------------------------------------------------ GPU
    def _kernel(self, name: str):
        return cuda_c.function(SOURCE, name)

    def _ptr(self, loc):
        return self.arena[loc["base"] + loc["off"]:]

    def _gpu_step(self, s, n):
        """Launch a step's kernel with its arguments prepared once per (step, batch size): on the critical path
        of a small batch, Python's own work per launch counts as much as the kernel."""
        prep = self._prepared.get((s["id"], n))
        if prep is None:
            prep = self._prepared[(s["id"], n)] = self._prepare(s, n)
        fn, grid, block, args, shared = prep
        if s["kind"] == "input":
            args = (self._x,) + args[1:]
        fn(grid, block, args, shared_mem=shared)

    def _prepare(self, s, n):
        """(kernel, grid, block, arguments, shared memory bytes) of step ``s`` for a batch of ``n``."""
        i = s["id"]
        a = self.dev
        sfx = SUFFIX[self.precision]
        null = np.uint64(0)  # a null pointer: no bias, no scale
        kind = s["kind"]
        i32, i64 = np.int32, np.int64
        block = (THREADS,)

        def grid(count):
            return (math.ceil(count / THREADS),)

        if kind == "conv":
            fn = self._fn.get(i)
            if fn is None:
                fn = self._fn[i] = self._kernel(f"conv_{s['kernel']}_{sfx}")
            bm, bn, threads = CONV_KERNELS[s["kernel"]]
            src = s["src"]
            M = n * src["H"] * src["W"]
            blocks = math.ceil(M / bm)
            if s["kernel"] in DIRECT:  # one block per TH x TW tile of an image
                _, th, tw = DIRECT[s["kernel"]][:3]
                blocks = n * math.ceil(src["H"] / th) * math.ceil(src["W"] / tw)
            if s["kernel"] in TCD:  # one block per TH rows of an image (16 columns)
                blocks = n * math.ceil(src["H"] / TCD[s["kernel"]][1])
            w = a[f"{i}/w"]
            if s["kernel"] in TC or s["kernel"] in TCD:  # weights transposed: K x R, a channel's reduction contiguous
                if f"{i}/wt" not in a:
                    a[f"{i}/wt"] = runtime.cupy().ascontiguousarray(w.reshape(-1, s["K"]).T)
                w = a[f"{i}/wt"]
            return (fn, (blocks, math.ceil(s["K"] / bn)), (threads,),
                    (self._ptr(src), i32(src["ld"]), w, a.get(f"{i}/b", null), a.get(f"{i}/scale", null),
                     self.arena, a[f"{i}/y_off"], a[f"{i}/y_ld"], a.get(f"{i}/inv", null), i32(n), i32(src["H"]),
                     i32(src["W"]), i32(src["C"]), i32(s["K"]), i32(s["kh"]), i32(s["kw"]), i32(s["relu"])), 0)
        if kind == "input":
            d = s["dst"]
            count = n * d["H"] * d["W"] * d["C"]
            return (self._kernel(f"convert_in_{sfx}"), grid(count), block,
                    (None, i64(count), self._ptr(d), np.float32(s["inv_scale"])), 0)
        if kind in ("biasadd", "batchnorm", "relu"):
            d = s["dst"]
            M = n * d["H"] * d["W"]
            if kind == "biasadd":
                args = (self._ptr(d), i64(M), i32(d["C"]), a[f"{i}/b"])
            elif kind == "batchnorm":
                args = (self._ptr(d), i64(M), i32(d["C"]), a[f"{i}/gamma"], a[f"{i}/beta"], a[f"{i}/mean"],
                        a[f"{i}/var"], np.float32(s["eps"]))
            else:
                args = (self._ptr(d), i64(M * d["C"]))
            name = {"biasadd": "bias_add", "batchnorm": "batchnorm", "relu": "relu"}[kind]
            return (self._kernel(f"{name}_{sfx}"), grid(M * d["C"]), block, args, 0)
        if kind == "maxpool":
            src, d = s["src"], s["dst"]
            v = vector_width(self.arena.itemsize, src["C"], src["ld"], d["ld"], src["base"] + src["off"],
                             d["base"] + d["off"])
            return (self._kernel(f"maxpool_{sfx}"), grid(n * src["H"] * src["W"] * src["C"] // v), block,
                    (self._ptr(src), i32(src["ld"]), self._ptr(d), i32(d["ld"]), i32(n), i32(src["H"]), i32(src["W"]),
                     i32(src["C"]), i32(s["size"])), 0)
        if kind == "concat_copy":
            src, d = s["src"], s["dst"]
            M = n * src["H"] * src["W"]
            return (self._kernel(f"concat_copy_{sfx}"), grid(M * src["C"]), block,
                    (self._ptr(src), i64(M), i32(src["C"]), self._ptr(d), i32(d["ld"])), 0)
        if kind == "avgpool":
            src, d, p = s["src"], s["dst"], s["size"]
            count = n * (src["H"] // p) * (src["W"] // p) * src["C"]
            return (self._kernel(f"avgpool_{sfx}"), grid(count), block,
                    (self._ptr(src), i32(n), i32(src["H"]), i32(src["W"]), i32(src["C"]), i32(p), self._ptr(d)), 0)
        if kind == "dense":
            src = s["src"]
            D = src["H"] * src["W"] * src["C"]
            return (self._kernel(f"dense_{sfx}"), grid(n * s["O"]), block,
                    (self._ptr(src), i32(n), i32(D), a[f"{i}/w"], a[f"{i}/b"], self.out, i32(s["O"])), 0)
        if kind == "head":
            src, p = s["src"], s["size"]
            D = (src["H"] // p) * (src["W"] // p) * src["C"]
            return (self._kernel(f"head_{sfx}"), (n,), block,
                    (self._ptr(src), i32(src["ld"]), i32(src["H"]), i32(src["W"]), i32(src["C"]), i32(p),
                     np.float32(s["x_scale"]), a[f"{i}/w"], a[f"{i}/b"], self.out, i32(s["O"])), 4 * D)
        raise runtime.CourseError(f"step {i}: no kernel for {kind!r}")


def vector_width(itemsize: int, channels: int, *strides_and_offsets: int) -> int:
    """Channels an elementwise kernel (maxpool) handles per thread: 16 bytes' worth when the channel count and
    every pixel stride and first element (in elements of the arena) are multiples of that, else 1; the kernel
    makes the same test."""
    v = 16 // itemsize
    return v if all(n % v == 0 for n in (channels, *strides_and_offsets)) else 1


def _store(v, dtype, inv_scale):
    """float32 values into the arena's type (INT8: quantised with 1 / scale), as the kernels' store()."""
    if dtype == np.int8:
        return np.clip(np.rint(v * np.float32(inv_scale)), -Q, Q).astype(np.int8)
    return v.astype(dtype)


def accuracy(engine: Engine, x, y, batch: int | None = None) -> float:
    """Fraction of ``x`` classified as ``y`` by the engine, in batches of at most the plan's max_batch."""
    batch = batch or engine.max_batch
    hits = 0
    for s in range(0, len(x), batch):
        logits = engine.infer(np.asarray(x[s:s + batch], np.float32))
        hits += int(np.sum(_host(logits).argmax(1) == np.asarray(y[s:s + batch])))
    return hits / len(x)


def predict(engine: Engine, x, batch: int | None = None) -> np.ndarray:
    batch = batch or engine.max_batch
    return np.concatenate([_host(engine.infer(np.asarray(x[s:s + batch], np.float32))).copy()
                           for s in range(0, len(x), batch)])


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)

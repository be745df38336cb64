"""The runtime: ``Engine`` runs a plan, with the CUDA C kernels of kernels/cuda/inference_engine.cu through CuPy on a
GPU (launched one by one, or replayed as one CUDA graph) and the same steps in NumPy on a CPU.
"""
from __future__ import annotations

import math

import numpy as np

from gpucourse import runtime

from gpucourse import cuda_c
from kernels import tensor_cores
from .catalog import (CLS_IMAGES, CONV_KERNELS, DIRECT, HEAD_CHUNK, HEAD_O, SOURCE, STEM_TAPS_PADDED, TC, TCD, THREADS,
                      WG, WG_EPI_PIECES, WG_SOURCE, WG_WIDE_BK, wg_function)
from . import network
from .plan import check_target, Plan
from .precision import DTYPES, from_e4m3, Q, SCALED, SUFFIX, to_e4m3
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
            self._then = {}  # (step, batch size) -> what a split tile's reduction launches after it, and its workspace
            self._graph = {}  # batch size -> cupy.cuda.Graph
        else:
            self.xp = np
            self.dev = plan.arrays
        self.arena = self.xp.zeros(plan.header["arena"], self.dtype)
        # a mixed plan (per-layer precision): the activations its FP16 layers write live in a second arena
        self.arenas = {self.precision: self.arena}
        if plan.header.get("arena_fp16"):
            self.arenas["fp16"] = self.xp.zeros(plan.header["arena_fp16"], np.float16)
        self.out = self.xp.zeros((self.max_batch, plan.header["outputs"]), np.float32)
        # the head's logits: the output itself, or, where the plan ends in a softmax, what the softmax reads
        self.logits = self.xp.zeros_like(self.out) if plan.header.get("softmax") else self.out
        self.pooled = self.xp.zeros((self.max_batch, max(plan.header.get("pooled", 0), 1)), np.float32)  # global pool
        # the input binding: where a CUDA graph reads the input (its kernels' arguments are fixed pointers)
        self.input = self.xp.zeros((self.max_batch, *plan.header["input_shape"]), np.float32)
        self._x = None
        # per call, the host's work before the GPU starts is part of the latency an application sees: the input's
        # shape as a tuple, and the output's first n rows, made once rather than on every call
        self._input_shape = tuple(plan.header["input_shape"])
        self._outputs = {}  # n -> self.out[:n]

    def input_buffer(self, n: int):
        """The engine's own input buffer for a batch of n: an input written here is read in place (no copy)."""
        return self.input[:n]

    def refresh(self, step_id: int) -> None:
        """Forget the compiled kernel of a step (after its kernel choice changed)."""
        if self.gpu:
            self._fn.pop(step_id, None)
            self._prepared = {k: v for k, v in self._prepared.items() if k[0] != step_id}
            self._then = {k: v for k, v in self._then.items() if k[0] != step_id}
            self._graph.clear()  # a graph holds the kernels it was captured with

    # ------------------------------------------------------------------ the public call
    def infer(self, x):
        """Logits (N x outputs, float32) of a batch of inputs N x H x W x C float32 (a NumPy array, or a
        CuPy array in GPU mode), N <= the plan's max_batch."""
        shape = self._input_shape
        if getattr(x, "ndim", 0) != 4 or tuple(x.shape[1:]) != shape:
            raise runtime.CourseInputError(f"the input must be N x {' x '.join(map(str, shape))}, got "
                                           f"{tuple(getattr(x, 'shape', ()))}")
        if np.dtype(x.dtype) != np.float32:  # checked before any copy to the GPU: both modes refuse the same inputs
            raise runtime.CourseInputError(f"the input must be float32, got {np.dtype(x.dtype)}")
        if self.gpu and not (isinstance(x, self.xp.ndarray) or runtime.is_device_array(x)):
            x = self.xp.asarray(x)
        n = x.shape[0]
        if not 1 <= n <= self.max_batch:
            raise runtime.CourseInputError(f"a batch of {n}: this plan takes 1 to {self.max_batch} inputs")
        if self.graphs:
            self._infer_graph(x, n)
        else:
            self._x = self.xp.ascontiguousarray(x)
            for step in self.plan.steps:
                self.run_step(step["id"], n)
        out = self._outputs.get(n)
        if out is None:
            out = self._outputs[n] = self.out[:n]
        return out

    def run_step(self, i: int, n: int) -> None:
        step = self.plan.steps[i]
        self.launches += 1
        self.host_launches += 1
        (self._gpu_step if self.gpu else self._numpy_step)(step, n)

    # ------------------------------------------------------------------ CUDA graphs
    def _infer_graph(self, x, n: int) -> None:
        """One inference as one graph launch. The graph was captured with the input buffer's address, so an
        input elsewhere is first copied there."""
        if x.data.ptr != self.input.data.ptr:  # (the binding is the buffer's first n inputs)
            self.input[:n] = x
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
    def _arena(self, loc):
        """The arena a buffer is in: the plan's, or a mixed plan's FP16 one (loc["arena"])."""
        return self.arenas[loc["arena"]] if "arena" in loc else self.arena

    def _view(self, loc, n):
        a = self._arena(loc)[loc["base"]: loc["base"] + n * loc["H"] * loc["W"] * loc["ld"]]
        return a.reshape(n, loc["H"], loc["W"], loc["ld"])[..., loc["off"]: loc["off"] + loc["C"]]

    def _numpy_step(self, s, n):
        a = self.dev
        i = s["id"]
        kind = s["kind"]
        if kind == "input" and "im2col" in s:  # the stem's im2col matrix, zeros past its taps
            st, d = s["im2col"], s["dst"]
            cols = im2col(self._x.reshape(n, st["H"], st["W"], st["C"]).astype(np.float32), st["kh"], st["kw"],
                          st["stride"], st["pad"])
            cols = np.concatenate([cols, np.zeros((*cols.shape[:3], st["R"] - st["taps"]), np.float32)], axis=-1)
            self._view(d, n)[...] = _store(cols, self._arena(d).dtype, s["inv_scale"])
        elif kind == "stem":  # the fused stem's arithmetic (inference_engine_stem.cuh): FP16 in, FP32 sums, FP16 out
            x = self._x.reshape(n, s["H"], s["W"], s["C"]).astype(np.float16).astype(np.float32)
            cols = im2col(x, 7, 7, 2, s["pad"]).reshape(-1, a[f"{i}/w"].shape[0])
            y = np.maximum(cols @ a[f"{i}/w"].astype(np.float32) + a[f"{i}/b"], 0).astype(np.float16)
            pooled = maxpool_spec(y.astype(np.float32).reshape(n, s["P"], s["Q"], s["K"]), 3, 2, s["pool_pad"])
            self._view(s["dst"], n)[...] = _store(pooled, self._arena(s["dst"]).dtype, s["inv_scale"])
        elif kind == "input":
            d = s["dst"]
            v = self._x.reshape(self._view(d, n).shape)
            self._view(d, n)[...] = _store(v.astype(np.float32), self._arena(d).dtype, s["inv_scale"])
        elif kind == "conv":
            p = s.get("precision", self.precision)  # a mixed plan's layer may run in another precision
            x = self._view(s["src"], n)
            if p == "fp8":
                x = from_e4m3(x)
            cols = im2col(x, s["kh"], s["kw"], s.get("stride", 1), s.get("pad")).reshape(-1, a[f"{i}/w"].shape[0])
            if p == "int8":
                # integer products summed exactly (float64 holds every such sum exactly), as int32 on a GPU
                acc = (cols.astype(np.float64) @ a[f"{i}/w"].astype(np.float64)).astype(np.float32) * a[f"{i}/scale"]
            elif p == "fp8":  # e4m3 products are exact in float64; the GPU sums them in FP32
                acc = (cols.astype(np.float64) @ from_e4m3(a[f"{i}/w"]).astype(np.float64)).astype(np.float32) \
                    * a[f"{i}/scale"]
            else:
                acc = cols.astype(np.float32) @ a[f"{i}/w"].astype(np.float32)
            if s["bias"]:
                acc = acc + a[f"{i}/b"]
            if s.get("res"):  # the residual, in real units
                acc = acc + self._f32(self._view(s["res"], n)).reshape(acc.shape) * np.float32(s["res_scale"])
            if s["relu"]:
                acc = np.maximum(acc, 0)
            start = 0
            for d in s["dests"]:
                part = acc[:, start:start + d["C"]]
                inv = a[f"{i}/inv"][start] if p in SCALED else 1.0
                self._view(d, n)[...] = _store(part, self._arena(d).dtype, inv).reshape(self._view(d, n).shape)
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
            self._view(s["dst"], n)[...] = _store(maxpool_spec(self._f32(self._view(s["src"], n)), s["size"],
                                                               s.get("stride", 1), s.get("pad")),
                                                   self._arena(s["dst"]).dtype, 1.0)
        elif kind == "concat_copy":
            self._view(s["dst"], n)[...] = self._view(s["src"], n)
        elif kind == "reformat":  # a mixed plan's tensor in another precision: x scale, then stored with 1 / scale
            v = self._f32(self._view(s["src"], n)) * np.float32(s["scale"])
            self._view(s["dst"], n)[...] = _store(v, self._arena(s["dst"]).dtype, s["inv_scale"])
        elif kind == "avgpool":
            self._view(s["dst"], n)[...] = avgpool_spec(self._view(s["src"], n).astype(np.float32),
                                                        s["size"]).astype(self.dtype)
        elif kind == "dense":
            x = self._view(s["src"], n).reshape(n, -1).astype(np.float32)
            self.out[:n] = x @ a[f"{i}/w"] + a[f"{i}/b"]
        elif kind == "head":
            x = self._f32(self._view(s["src"], n)) * np.float32(s["x_scale"])
            p = avgpool_spec(x, s["size"]).reshape(n, -1)
            self.logits[:n] = p @ a[f"{i}/w"] + a[f"{i}/b"]
        elif kind == "gpool":
            src = s["src"]
            self.pooled[:n, :src["C"]] = self._f32(self._view(src, n)).mean(axis=(1, 2)) * np.float32(s["x_scale"])
        elif kind == "classifier":
            self.logits[:n] = self.pooled[:n, :s["D"]] @ a[f"{i}/w"] + a[f"{i}/b"]
        elif kind == "softmax":
            z = self.logits[:n] - self.logits[:n].max(axis=1, keepdims=True)
            e = np.exp(z)
            self.out[:n] = e / e.sum(axis=1, keepdims=True)
        elif kind == "network":  # the whole digits network, as its one kernel computes it (network.py)
            network.run_numpy(self, s, n)

    def _f32(self, v):
        """Arena values as float32 (FP8: the values its e4m3 codes stand for, the only arena of bytes uint8)."""
        return from_e4m3(v) if v.dtype == np.uint8 else v.astype(np.float32)

    # ------------------------------------------------------------------ GPU
    def _kernel(self, name: str):
        return cuda_c.function(SOURCE, name)

    def _ptr(self, loc):
        return self._arena(loc)[loc["base"] + loc["off"]:]

    def _gpu_step(self, s, n):
        """Launch a step's kernel with its arguments prepared once per (step, batch size): on the critical path
        of a small batch, Python's own work per launch counts as much as the kernel."""
        prep = self._prepared.get((s["id"], n))
        if prep is None:
            prep = self._prepared[(s["id"], n)] = self._prepare(s, n)
        fn, grid, block, args, shared = prep
        if s["kind"] in ("input", "stem", "network"):  # the input as it is: the graph's binding, or the caller's array
            args = (self._x,) + args[1:]
        if s["kind"] == "conv" and s["kernel"] in WG:  # tensor maps are passed by value: the driver's launch
            tensor_cores.launch_hopper(fn, grid, block[0], shared, args, s["name"])
            then = self._then.get((s["id"], n))
            if then:  # a split tile: its partial sums added up and ended by the epilogue
                fn2, grid2, block2, args2, _ = then
                fn2(grid2, block2, args2)
            return
        fn(grid, block, args, shared_mem=shared)

    def _prepare(self, s, n):
        """(kernel, grid, block, arguments, shared memory bytes) of step ``s`` for a batch of ``n``."""
        i = s["id"]
        a = self.dev
        sfx = SUFFIX[s.get("precision", self.precision)]  # a mixed plan's step may run in another precision
        null = np.uint64(0)  # a null pointer: no bias, no scale
        kind = s["kind"]
        i32, i64 = np.int32, np.int64
        block = (THREADS,)

        def grid(count):
            return (math.ceil(count / THREADS),)

        if kind == "conv" and s["kernel"] in WG:
            return self._prepare_wg(s, n)
        if kind == "network":  # inference_engine_network.cu: one kernel, input to logits
            return network.prepare(self, s, n)
        if kind == "conv":
            fn = self._fn.get(i)
            if fn is None:
                fn = self._fn[i] = self._kernel(f"conv_{s['kernel']}_{sfx}")
            bm, bn, threads = CONV_KERNELS[s["kernel"]]
            src = s["src"]
            M = n * s.get("P", src["H"]) * s.get("Q", src["W"])
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
            args = (self._ptr(src), i32(src["ld"]), w, a.get(f"{i}/b", null), a.get(f"{i}/scale", null),
                    self._arena(s["dests"][0]), a[f"{i}/y_off"], a[f"{i}/y_ld"], a.get(f"{i}/inv", null), i32(n),
                    i32(src["H"]),
                    i32(src["W"]), i32(src["C"]), i32(s["K"]), i32(s["kh"]), i32(s["kw"]), i32(s["relu"]))
            if s["kernel"] in TC:  # any geometry, and a residual
                kh, kw = s["kh"], s["kw"]
                pad = s.get("pad", [kh // 2, kh // 2, kw // 2, kw // 2])
                res = s.get("res")
                args += (i32(s.get("P", src["H"])), i32(s.get("Q", src["W"])), i32(s.get("stride", 1)), i32(pad[0]),
                         i32(pad[2]), self._ptr(res) if res else null, i32(res["ld"] if res else 0),
                         np.float32(s.get("res_scale", 1.0)))
            return (fn, (blocks, math.ceil(s["K"] / bn)), (threads,), args, 0)
        if kind == "stem":
            if f"{i}/wt" not in a:  # the weights as the kernel reads them: channel by channel, 160 taps (zeros past 147)
                cp = runtime.cupy()
                wt = cp.zeros((s["K"], STEM_TAPS_PADDED), cp.float16)
                wt[:, :a[f"{i}/w"].shape[0]] = a[f"{i}/w"].T
                a[f"{i}/wt"] = wt
            d = s["dst"]
            tiles = n * math.ceil(s["Ho"] / 8) * math.ceil(s["Wo"] / 8)
            tp = 8 if tiles >= 2 * _sms() else 4  # a small batch: smaller tiles, so that every SM gets blocks
            return (self._kernel(f"stem_pool{tp}_{sfx}"),
                    (n * math.ceil(s["Ho"] / tp) * math.ceil(s["Wo"] / tp),), (256 if tp == 8 else 192,),
                    (None, i32(n), i32(s["H"]), i32(s["W"]), i32(s["pad"][0]), i32(s["pad"][2]), i32(s["P"]),
                     i32(s["Q"]), i32(s["pool_pad"][0]), i32(s["pool_pad"][2]), i32(s["Ho"]), i32(s["Wo"]),
                     a[f"{i}/wt"], a[f"{i}/b"], self._ptr(d), i32(d["ld"]), np.float32(s["inv_scale"])), 0)
        if kind == "input" and "im2col" in s:
            st, d = s["im2col"], s["dst"]
            count = n * st["P"] * st["Q"] * st["R"] // 8  # 8 elements a thread
            return (self._kernel(f"convert_in_im2col_{sfx}"), grid(count), block,
                    (None, i32(n), i32(st["H"]), i32(st["W"]), i32(st["C"]), i32(st["kw"]), i32(st["stride"]),
                     i32(st["pad"][0]), i32(st["pad"][2]), i32(st["P"]), i32(st["Q"]), i32(st["R"]), i32(st["taps"]),
                     self._ptr(d), np.float32(s["inv_scale"])), 0)
        if kind == "input":
            d = s["dst"]
            M = n * d["H"] * d["W"]
            return (self._kernel(f"convert_in_{sfx}"), grid(M * d["ld"]), block,
                    (None, i64(M), i32(d["C"]), self._ptr(d), i32(d["ld"]), np.float32(s["inv_scale"])), 0)
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
        if kind == "maxpool" and "stride" in s:
            src, d = s["src"], s["dst"]
            v = vector_width(self._arena(src).itemsize, src["C"], src["ld"], d["ld"], src["base"] + src["off"],
                             d["base"] + d["off"])
            return (self._kernel(f"maxpool_pad_{sfx}"), grid(n * d["H"] * d["W"] * src["C"] // v), block,
                    (self._ptr(src), i32(src["ld"]), self._ptr(d), i32(d["ld"]), i32(n), i32(src["H"]), i32(src["W"]),
                     i32(src["C"]), i32(s["size"]), i32(s["stride"]), i32(s["pad"][0]), i32(s["pad"][2]),
                     i32(d["H"]), i32(d["W"])), 0)
        if kind == "maxpool":
            src, d = s["src"], s["dst"]
            v = vector_width(self._arena(src).itemsize, src["C"], src["ld"], d["ld"], src["base"] + src["off"],
                             d["base"] + d["off"])
            return (self._kernel(f"maxpool_{sfx}"), grid(n * src["H"] * src["W"] * src["C"] // v), block,
                    (self._ptr(src), i32(src["ld"]), self._ptr(d), i32(d["ld"]), i32(n), i32(src["H"]), i32(src["W"]),
                     i32(src["C"]), i32(s["size"])), 0)
        if kind == "reformat":  # a mixed plan's tensor in another precision: 8 channels a thread where aligned
            src, d = s["src"], s["dst"]
            M = n * src["H"] * src["W"]
            v = 8 if all(k % 8 == 0 for k in (src["C"], src["ld"], d["ld"], src["base"] + src["off"],
                                               d["base"] + d["off"])) else 1
            return (self._kernel(f"reformat{v if v > 1 else ''}_{SUFFIX[s['from']]}_{SUFFIX[s['to']]}"),
                    grid(M * src["C"] // v), block,
                    (self._ptr(src), i32(src["ld"]), self._ptr(d), i32(d["ld"]), i64(M), i32(src["C"]),
                     np.float32(s["scale"]), np.float32(s["inv_scale"])), 0)
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
            chunks = 1 if s["O"] <= HEAD_O else math.ceil(s["O"] / HEAD_CHUNK)  # a wide classifier: chunks of outputs
            return (self._kernel(f"head_{sfx}"), (n, chunks), block,
                    (self._ptr(src), i32(src["ld"]), i32(src["H"]), i32(src["W"]), i32(src["C"]), i32(p),
                     np.float32(s["x_scale"]), a[f"{i}/w"], a[f"{i}/b"], self.logits, i32(s["O"])), 4 * D)
        if kind == "softmax":
            return (self._kernel("softmax_rows"), (n,), block, (self.logits, self.out, i32(s["O"])), 0)
        if kind == "gpool":
            src = s["src"]
            v = pool_width(self._arena(src).itemsize, src["C"], src["ld"], src["base"] + src["off"])
            return (self._kernel(f"global_pool_{sfx}"), grid(n * src["C"] // v), block,
                    (self._ptr(src), i32(src["ld"]), i32(src["H"] * src["W"]), i32(src["C"]), np.float32(s["x_scale"]),
                     self.pooled, i32(n)), 0)
        if kind == "classifier":
            fn, smem = self._kernel("classifier"), CLS_IMAGES * s["D"] * 4
            fn.max_dynamic_shared_size_bytes = smem
            return (fn, (math.ceil(s["O"] / 32), math.ceil(n / CLS_IMAGES)), block,
                    (self.pooled, i32(n), i32(s["D"]), a[f"{i}/w"], a[f"{i}/b"], self.logits, i32(s["O"])), smem)
        raise runtime.CourseError(f"step {i}: no kernel for {kind!r}")

    def _prepare_wg(self, s, n):
        """A Hopper convolution (inference_engine_wgmma.cu): its tensor maps, made once per (step, batch size) and
        kept with the arguments: the input as an N x H x W x C image of the arena (for a 1 x 1 convolution of stride
        s, the pixels s apart: W and H steps s times the pixel and row pitch), the weights K x R."""
        import ctypes

        from kernels import convolution as cv

        i, a, src, d, res = s["id"], self.dev, s["src"], s["dests"][0], s.get("res")
        i2c, bm, bn, _, persist, wide, tma, splits = WG[s["kernel"]]
        cfg = {"im2col": i2c, "bm": bm, "bn": bn, "threads": 128 * (bm // 64 + 1)}  # a producer, BM / 64 consumers
        item = self._arena(src).itemsize  # 2 (FP16) or 1 (INT8, FP8)
        bk = WG_WIDE_BK if wide else cv.WGMMA_BK  # a stage's rows: 64 elements (128 or 64 bytes), wide 128 bytes
        smem = wg_shared_bytes(s["kernel"], item)
        sfx = SUFFIX[s.get("precision", self.precision)]  # a mixed plan's layer may run in another precision
        fn = tensor_cores.hopper_kernel(WG_SOURCE, f"{wg_function(s['kernel'])}_{sfx}", smem)
        if f"{i}/wt" not in a:
            a[f"{i}/wt"] = runtime.cupy().ascontiguousarray(a[f"{i}/w"].reshape(-1, s["K"]).T)
        wt = a[f"{i}/wt"]
        st, P, Q = s["stride"], s["P"], s["Q"]
        pix, row = st * src["ld"] * item, st * src["W"] * src["ld"] * item
        dims = (src["C"], src["W"] if st == 1 else Q, src["H"] if st == 1 else P, n)
        strides = (pix, row, src["H"] * src["W"] * src["ld"] * item)
        ptr = self._ptr(src).data.ptr
        pad = s["pad"] if st == 1 else [0, 0, 0, 0]
        R, S = (s["kh"], s["kw"]) if st == 1 else (1, 1)
        t = cv.wgmma_conv_tiles(n, P, Q, s["K"], cfg["bm"], cfg["bn"], cfg["im2col"])
        map_x = tensor_cores._map_buffer()
        if cfg["im2col"]:  # the window of tap (0, 0) around each image: P x Q pixels from (-pad_t, -pad_l)
            H, W = dims[2], dims[1]
            tensor_cores.encode_im2col(map_x, ptr, dims, strides, cfg["bm"], bk, (-pad[0], -pad[2]),
                                       (P - H - pad[0], Q - W - pad[2]), itemsize=item, row=bk * item)
        else:
            tensor_cores.encode_tiled(map_x, ptr, dims, strides, (bk, t["TW"], t["TH"], 1), itemsize=item,
                                      row=bk * item)
        map_w = tensor_cores._map_buffer()
        tensor_cores.encode_tiled(map_w, wt.data.ptr, (wt.shape[1], wt.shape[0]), (wt.shape[1] * item,),
                                  (bk, cfg["bn"]), itemsize=item, row=bk * item)
        maps = [map_x, map_w]
        if tma:  # the output's rows (and the residual's): channels x pixels, boxes of 128 bytes (128 INT8 or FP8
            rows = n * P * Q  # channels, 64 FP16 ones) x 64 rows, in the 128-byte swizzle
            for loc in (res, d):
                m = tensor_cores._map_buffer()
                if loc:
                    tensor_cores.encode_tiled(m, self._ptr(loc).data.ptr, (s["K"], rows), (loc["ld"] * item,),
                                              (128 // item, 64), itemsize=item, row=128)
                maps.append(m)
        c64, c32 = ctypes.c_uint64, ctypes.c_int32
        if tma:  # the TMA epilogue loads every factor without testing for null: ones and zeros where there are none
            for key, fill in (("scale", 1.0), ("b", 0.0), ("inv", 1.0)):
                if a.get(f"{i}/{key}") is None:
                    a[f"{i}/{key}"] = runtime.cupy().full(s["K"], fill, np.float32)
        ptr_of = lambda key: c64(a[key].data.ptr if a.get(key) is not None else 0)  # noqa: E731
        geometry = [c32(v) for v in (n, P, Q, s["K"], src["C"], R, S, pad[0], pad[2], t["TW"], t["tiles_q"],
                                      t["tiles_p"])]
        if splits > 1:  # partial sums into a workspace of its own, then split_reduce_f16 over every output
            cp = runtime.cupy()
            rows = n * P * Q
            ws = cp.empty(splits * rows * s["K"], np.float32)
            reduce = cuda_c.module_arch(WG_SOURCE, "sm_90a").get_function("split_reduce_f16")
            units = rows * (s["K"] // 8)
            self._then[(i, n)] = (reduce, (math.ceil(units / THREADS),), (THREADS,), (
                ws, np.int32(splits), np.int32(rows), np.int32(s["K"]),
                a[f"{i}/b"] if a.get(f"{i}/b") is not None else np.uint64(0), self._ptr(d), np.int32(d["ld"]),
                self._ptr(res) if res else np.uint64(0), np.int32(res["ld"] if res else 0), np.int32(int(s["relu"]))),
                ws)
            return fn, (*t["grid"][:2], splits), (cfg["threads"],), [*maps, c64(ws.data.ptr), *geometry], smem
        args = [*maps, ptr_of(f"{i}/b"), ptr_of(f"{i}/scale"), ptr_of(f"{i}/inv"), c64(self._ptr(d).data.ptr),
                c32(d["ld"]), c64(self._ptr(res).data.ptr if res else 0), c32(res["ld"] if res else 0),
                ctypes.c_float(s.get("res_scale", 1.0)), c32(int(s["relu"])), *geometry]
        grid = t["grid"]
        if persist:  # every tile in turn: as many blocks as the SMs hold at once, or fewer with fewer tiles
            grid = (min(grid[0] * grid[1], _sms() * tensor_cores.blocks_per_sm(fn, cfg["threads"], smem)),)
        return fn, grid, (cfg["threads"],), args, smem


def wg_shared_bytes(kernel: str, item: int) -> int:
    """The dynamic shared memory of wg tile ``kernel`` in a precision of ``item`` bytes (conv_wgmma.cuh's layout):
    the 1 KiB alignment, the stages, the epilogue's space, the mbarriers (and, persistent, the tile the consumers
    are on)."""
    from kernels import convolution as cv

    _, bm, bn, stages, persist, wide, tma, _ = WG[kernel]
    bk = WG_WIDE_BK if wide else cv.WGMMA_BK  # a stage's rows: 64 elements (128 or 64 bytes), wide 128 bytes
    epilogue = (bm // 64) * WG_EPI_PIECES * 64 * 32 * 4 if persist else 0  # pieces of 64 rows x 32 floats
    if tma:  # buffers of 64 rows x BN outputs a consumer, and their two mbarriers each
        nbuf = tma_buffers(bm, bn, stages, bk * item, item)
        epilogue = nbuf * bm * bn * item + nbuf * 2 * (bm // 64) * 8
    return 1024 + stages * (bm + bn) * bk * item + epilogue + 2 * stages * 8 + (16 if persist else 0)


def tma_buffers(bm: int, bn: int, stages: int, row_bytes: int, out_bytes: int = 1) -> int:
    """The wgpt tiles' buffers a consumer (conv_wgmma.cuh's tma_buffers): three where they fit beside the stages,
    else two (``out_bytes``: an output's, 2 in FP16)."""
    return 3 if stages * (bm + bn) * row_bytes + 3 * bm * bn * out_bytes <= 200 * 1024 else 2


def _sms() -> int:
    return runtime.cupy().cuda.Device().attributes["MultiProcessorCount"]


def vector_width(itemsize: int, channels: int, *strides_and_offsets: int) -> int:
    """Channels an elementwise kernel (maxpool) handles per thread: 16 bytes' worth when the channel count and
    every pixel stride and first element (in elements of the arena) are multiples of that, else 1; the kernel
    makes the same test."""
    v = 16 // itemsize
    return v if all(n % v == 0 for n in (channels, *strides_and_offsets)) else 1


def pool_width(itemsize: int, channels: int, ld: int, first: int) -> int:
    """Channels a thread of the global pool sums (inference_engine.cu's global_pool, which makes the same test): 16
    bytes' worth in FP16, 8 in the 8-bit types, when the channels and the pixel stride are multiples of that and the
    first element lies on 16 bytes; else 1."""
    v = 8 if itemsize == 1 else 16 // itemsize
    return v if channels % v == 0 and ld % v == 0 and (first * itemsize) % 16 == 0 else 1


def _store(v, dtype, inv_scale):
    """float32 values into the arena's type (INT8: quantised with 1 / scale; FP8: e4m3 codes of v / scale), as the
    kernels' store()."""
    if dtype == np.uint8:
        return to_e4m3(v * np.float32(inv_scale))
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

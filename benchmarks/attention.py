"""Lesson 10's measurements on a GPU, and the figures drawn from them (measured or recorded).

softmax: every row-softmax kernel against the device-to-device copy and torch.softmax on the same data;
naive: attention with S and P in memory, time and peak memory against N, until it refuses;
memory: FlashAttention's peak memory against Q + K + V + O + lse;
field: the course's kernels (WMMA, mma.sync in FlashAttention-2's shape, Hopper's wgmma, Triton) against PyTorch's
scaled_dot_product_attention
with each backend forced, forward and forward + backward, in TFLOP/s and as a share of the dense FP16 peak;
held (benchmarks/attention_held.py): the CUDA C backward and cuDNN's held for seconds, at the GPU's power cap.
"""
from __future__ import annotations

import math

import numpy as np

from gpucourse import bench, claims, gpus, plots, runtime
from gpucourse.records import Figure
from kernels import attention as A
from kernels.attention import triton_kernels as T
from kernels.attention.flash import WGMMA_DEFAULT, WGMMA_VARIANTS
from kernels.attention.row_softmax import cluster_missing
from kernels.inference_engine.precision import E4M3_MAX, e4m3_scale

LESSON = "10_attention"
ROW_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
SOFTMAX_BYTES = 2**30  # each row-softmax run reads 1 GiB and writes 1 GiB
HEAD_DIM, HEADS, TOKENS = 128, 16, 32768  # the field: batch x N = 32k tokens, 16 heads of 128
FIELD_N = (1024, 4096, 16384)
# Every timed run is queued behind a kernel that holds the GPU this long (bench.hold), so that the host has queued
# all of it (the launcher's tensor maps, PyTorch's dispatch) before the GPU reaches it: the events time the GPU.
HOLD_MS = 2.0
SDPA_BACKENDS = {"cuDNN": "CUDNN_ATTENTION", "FlashAttention-2": "FLASH_ATTENTION", "memory-efficient": "EFFICIENT_ATTENTION"}
ONLINE_ROW, CLUSTER_ROW = "CUDA C, one pass (online, in registers)", "CUDA C, one pass across a cluster (Hopper)"
SOFTMAX_GOAL_FROM = 4096  # the goal holds for rows of this many elements and more
# "wmma_of_fastest", the goal for the tensor-core kernel of sm_80+ GPUs, is measured by "sm80_of_fastest":
# the better of that GPU's two kernels, WMMA and mma.sync (ratios names which), against the fastest SDPA backend.
GOALS = {"softmax_of_copy": 0.9, "triton_fwd_of_fa2": 0.8, "bwd_of_fastest": 0.7,
         "wmma_of_fastest": 0.5, "sm80_of_fastest": 0.5, "flash_memory": 1.10}
WMMA_NAME = "WMMA (CUDA C)"
MMA_NAME = "CUDA C, mma.sync (FlashAttention-2's shape)"
CUDA_BWD_NAME = "CUDA C (wgmma)"  # the Hopper backward (kernels/cuda/attention_bwd_wgmma.cu), with its forward in fwd_bwd
SM80_KERNELS = (WMMA_NAME, MMA_NAME)  # the course's forward kernels for sm_80+ (not Hopper's own)


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


# ------------------------------------------------------------------------------------------- softmax

def _softmax_kernels(torch):
    """name -> (launch on (x, out) CuPy arrays, which row lengths it takes)."""
    cuda = runtime.cuda()
    out = {
        "numba, three passes": (lambda x, o: A.softmax(cuda.as_cuda_array(x), cuda.as_cuda_array(o), "three_pass"), None),
        "numba, online": (lambda x, o: A.softmax(cuda.as_cuda_array(x), cuda.as_cuda_array(o), "online"), None),
        "CUDA C, three passes": (lambda x, o: A.softmax_cuda_c(x, o, "three_pass"), None),
        "CUDA C, one pass (online, in registers)": (lambda x, o: A.softmax_cuda_c(x, o, "online"), None),
    }
    if cluster_missing() is None:  # Hopper: the row split across a cluster (a warp per row for short rows)
        out[CLUSTER_ROW] = (lambda x, o: A.softmax_cuda_c(x, o, "cluster"), None)
    if torch is not None:
        out["torch.softmax"] = (lambda x, o: torch.softmax(torch.from_dlpack(x), dim=-1, out=torch.from_dlpack(o)), None)
    return out


def measure_softmax(lengths=ROW_LENGTHS, total_bytes: int = SOFTMAX_BYTES, repeats: int = 20) -> dict:
    """GB/s (bytes read + written) of every row-softmax kernel for rows of each length, FP32 and FP16, on
    total_bytes of random rows; each result checked against NumPy on a few rows first."""
    cp = runtime.cupy()
    torch = _torch()
    out = {"copy_gbps": bench.ceilings().copy_gbps, "lengths": list(lengths), "dtypes": {}, "copy_gbps_by_n": {}}
    for dtype in ("float32", "float16"):
        rows = {}
        for n in bench.progress(lengths, desc=f"softmax {dtype}"):
            m = total_bytes // (n * np.dtype(dtype).itemsize)
            x = (cp.random.standard_normal((m, n), dtype=cp.float32) * 3).astype(dtype)
            o = cp.empty_like(x)
            want = A.softmax_spec(x[:4].get())
            for name, (launch, _) in _softmax_kernels(torch).items():
                o.fill(cp.nan)
                launch(x, o)
                err = float(np.abs(o[:4].get().astype(np.float64) - want).max())
                if not err <= (2e-3 if dtype == "float16" else 1e-5):
                    raise runtime.CourseError(f"{name} ({dtype}, rows of {n}) is wrong: error {err:.1e}")
                t = bench.time_gpu(lambda: launch(x, o), repeats=repeats, hold_ms=HOLD_MS)
                rows.setdefault(name, []).append(t.gbps(2 * x.nbytes))
            t = bench.time_gpu(lambda: o.data.copy_from_device_async(x.data, x.nbytes), repeats=repeats, hold_ms=HOLD_MS)
            out["copy_gbps_by_n"].setdefault(dtype, []).append(t.gbps(2 * x.nbytes))  # the same bytes, in the same run
            del x, o
            cp.get_default_memory_pool().free_all_blocks()
        out["dtypes"][dtype] = rows
    return out


def softmax_ratios(t: dict) -> dict:
    """Per dtype: the fastest CUDA C one-pass kernel at each row length (the online kernel, or on Hopper the cluster
    one, whichever is faster there), its GB/s against the copy of the same bytes and against torch.softmax, and
    whether it meets the goal (>= GOALS["softmax_of_copy"] x the copy for rows of SOFTMAX_GOAL_FROM and more)."""
    out = {}
    for dtype, rows in t["dtypes"].items():
        one_pass = [name for name in (ONLINE_ROW, CLUSTER_ROW) if name in rows]
        best = [max(one_pass, key=lambda name: rows[name][i]) for i in range(len(t["lengths"]))]
        gbps = [rows[name][i] for i, name in enumerate(best)]
        copies = t.get("copy_gbps_by_n", {}).get(dtype) or [t["copy_gbps"]] * len(gbps)
        of_copy = [g / c for g, c in zip(gbps, copies)]
        r = {"best": best, "gbps": gbps, "copy_gbps": copies, "of_copy": of_copy,
             "goal_met": all(q >= GOALS["softmax_of_copy"] for n, q in zip(t["lengths"], of_copy)
                             if n >= SOFTMAX_GOAL_FROM)}
        if "torch.softmax" in rows:
            r["of_torch"] = [g / q for g, q in zip(gbps, rows["torch.softmax"])]
        out[dtype] = r
    return out


def _k(n: int) -> str:
    """A row length or N as a column head: 1024 -> "1k"."""
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"


def softmax_table(t: dict, source: str = "", dtype: str = "float32") -> plots.Table:
    """GB/s (read + written) of every row-softmax kernel at each row length, with the copy of the same bytes and the
    fastest one-pass kernel against the copy and against torch.softmax."""
    rows, r = t["dtypes"][dtype], softmax_ratios(t)[dtype]
    body = [[name, *gbps] for name, gbps in rows.items()]
    body.append(["copy of the same bytes", *r["copy_gbps"]])
    if CLUSTER_ROW in rows:
        body.append(["fastest one pass (o: online, c: cluster)",
                     *("c" if name == CLUSTER_ROW else "o" for name in r["best"])])
    body.append(["fastest one pass / copy", *(f"{q:.2f}" for q in r["of_copy"])])
    if "of_torch" in r:
        body.append(["fastest one pass / torch.softmax", *(f"{q:.2f}" for q in r["of_torch"])])
    met = "met" if r["goal_met"] else "not met"
    return plots.table(["kernel", *map(_k, t["lengths"])], body, source=source,
                       title=f"Row softmax, {dtype}: GB/s read + written (goal: one pass >= "
                             f"{GOALS['softmax_of_copy']}x the copy from {_k(SOFTMAX_GOAL_FROM)}: {met})")


def text_softmax(t: dict) -> str:
    return "\n\n".join(str(softmax_table(t, dtype=dtype)) for dtype in t["dtypes"])


def plot_softmax(t: dict, source: str, dtype: str = "float32"):
    rows = t["dtypes"][dtype]
    return plots.lines({name: (t["lengths"], g) for name, g in rows.items()}, xlabel="row length N",
                       ylabel="GB/s (read + write)", source=source, levels={"device-to-device copy": t["copy_gbps"]},
                       title=f"Row softmax, {dtype}: every element read once and written once at best", logy=False)


# ------------------------------------------------------------------------------------- naive attention

def measure_naive(ns=(1024, 2048, 4096, 8192, 16384, 32768, 65536), batch: int = 1, heads: int = HEADS,
                  d: int = HEAD_DIM, repeats: int = 3) -> dict:
    """Naive attention (S and P in memory) against N: time, the bytes it moves (S and P each written and read), and
    its peak memory (CuPy's pool, from empty); where S and P do not fit, the refusal's words instead."""
    cp = runtime.cupy()
    pool = cp.get_default_memory_pool()
    rows = []
    for n in bench.progress(ns, desc="naive attention"):
        pool.free_all_blocks()
        q, k, v = (cp.random.standard_normal((batch, heads, n, d), dtype=cp.float32).astype(cp.float16) for _ in range(3))
        base = pool.total_bytes()
        try:
            A.check_fits(batch, heads, n)
            o, p = A.naive_attention(q, k, v)
            del o, p
            peak = pool.total_bytes() - base
            t = bench.time_gpu(lambda: A.naive_attention(q, k, v), repeats=repeats, warmup=1, hold_ms=HOLD_MS)
            rows.append({"N": n, "ms": t.median_ms, "peak_bytes": peak, "s_p_bytes": A.naive_bytes(batch, heads, n),
                         "moved_bytes": A.attention_bytes(batch, heads, n, d, fused=False),
                         "tflops": t.tflops(A.attention_flops(batch, heads, n, d))})
        except runtime.CourseError as exc:
            rows.append({"N": n, "refused": str(exc)})
        del q, k, v
        pool.free_all_blocks()
    return {"batch": batch, "heads": heads, "d": d, "rows": rows}


def naive_table(t: dict, source: str = "") -> plots.Table:
    """Naive attention against N: time, TFLOP/s, peak memory and S and P's bytes; "refused" where it did not fit."""
    body = []
    for r in t["rows"]:
        if "refused" in r:
            body.append([f"{r['N']:,}", "refused", "", "", ""])
        else:
            body.append([f"{r['N']:,}", bench.format_ms(r["ms"]), r["tflops"], r["peak_bytes"] / 2**30,
                         r["s_p_bytes"] / 2**30])
    return plots.table(["N", "time", "TFLOP/s", "peak memory (GiB)", "S and P (GiB)"], body, source=source,
                       align="lrrrr", title=f"Naive attention, batch {t['batch']}, {t['heads']} heads of {t['d']}, "
                                            "FP16: S and P in memory")


def naive_refusals(t: dict) -> list:
    """The refusals' words, wrapped to a notebook cell's width."""
    import textwrap

    return [textwrap.fill(f"N = {r['N']:,}: {r['refused']}", 100, subsequent_indent="  ")
            for r in t["rows"] if "refused" in r]


def text_naive(t: dict) -> str:
    return "\n".join([str(naive_table(t)), *naive_refusals(t)])


def plot_naive(t: dict, source: str):
    ok = [r for r in t["rows"] if "refused" not in r]
    ns = [r["N"] for r in ok]
    fig = plots.lines({"peak memory (GiB)": (ns, [r["peak_bytes"] / 2**30 for r in ok]),
                       "time (ms)": (ns, [r["ms"] for r in ok])},
                      models={"S and P (GiB), N^2": (ns, [r["s_p_bytes"] / 2**30 for r in ok])},
                      xlabel="N", ylabel="GiB / ms", source=source,
                      title="Naive attention: memory and time grow as N^2")
    return fig


# ------------------------------------------------------------------------------------ flash's memory

def wgmma_variants(d: int = HEAD_DIM) -> list:
    """The Hopper kernel's variants the field times at head dim d (WGMMA_VARIANTS: serial ... Q in registers)."""
    from kernels.attention.flash import WGMMA_VARIANTS

    return list(WGMMA_VARIANTS[d])


def _flash_kernels(torch, causal: bool, q_dim: int = HEAD_DIM):
    """name -> forward on CuPy (q, k, v), for the course's kernels this GPU runs."""
    out = {}
    if gpus.status("10.wgmma").runs:  # Hopper: each step of FlashAttention-3's structure, so the figure shows what it buys
        for variant in wgmma_variants(q_dim):
            out[f"wgmma {variant} (CUDA C)"] = (lambda variant: lambda q, k, v: A.flash_wgmma(
                q, k, v, causal=causal, variant=variant))(variant)
    if gpus.status("10.wmma").runs and not A.wmma_missing(q_dim):  # its tiles fit this GPU's shared memory
        out[WMMA_NAME] = lambda q, k, v: A.flash_wmma(q, k, v, causal=causal)
    if gpus.status("10.mma").runs:  # the launcher's default variant (attention_mma.cu's FLASH_MMA_DEFAULT)
        out[MMA_NAME] = lambda q, k, v: A.flash_mma(q, k, v, causal=causal)
    if torch is not None and T.available() is None:
        out["Triton"] = lambda q, k, v: T.flash_forward(T.from_cupy(q), T.from_cupy(k), T.from_cupy(v), causal=causal)
    return out


def measure_memory(n: int = 16384, batch: int = 2, heads: int = HEADS, d: int = HEAD_DIM) -> dict:
    """Peak memory of each flash kernel at N (CuPy's pool and PyTorch's allocator, from empty) against the inputs
    and outputs it must hold: Q + K + V + O (FP16) + lse (FP32)."""
    cp = runtime.cupy()
    torch = _torch()
    pool = cp.get_default_memory_pool()
    need = 4 * batch * heads * n * d * 2 + batch * heads * n * 4
    rows = {}
    kernels = _flash_kernels(torch, False, d)
    for name, fwd in kernels.items():
        if name.startswith("wgmma") and name != f"wgmma {WGMMA_DEFAULT[d]} (CUDA C)":
            continue  # the variants differ in the order of their work, not in what they hold
        q, k, v = (cp.random.standard_normal((batch, heads, n, d), dtype=cp.float32).astype(cp.float16) for _ in range(3))
        fwd(q, k, v)  # compiled (and, for Triton, autotuned, which borrows a buffer) before the measurement
        pool.free_all_blocks()  # the float32 draws' blocks: not the kernel's
        if torch is not None:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = pool.total_bytes()  # q, k and v themselves
        res = fwd(q, k, v)
        cp.cuda.Device().synchronize()
        peak = pool.total_bytes() + (torch.cuda.max_memory_allocated() if torch is not None else 0)
        rows[name] = {"peak_bytes": peak, "inputs_bytes": base, "of_needed": peak / need}
        del q, k, v, res
    pool.free_all_blocks()
    return {"N": n, "batch": batch, "heads": heads, "d": d, "needed_bytes": need, "rows": rows}


def memory_table(t: dict, source: str = "") -> plots.Table:
    """Each flash kernel's peak memory against what it must hold (Q + K + V + O + lse)."""
    body = [[name, f"{r['peak_bytes'] / 2**30:.3f}", f"{r['of_needed']:.3f}"] for name, r in t["rows"].items()]
    return plots.table(["kernel", "peak memory (GiB)", "x what it must hold"], body, source=source,
                       title=f"FlashAttention at N = {t['N']:,} (batch {t['batch']}, {t['heads']} heads of {t['d']}): "
                             f"Q + K + V + O + lse = {t['needed_bytes'] / 2**30:.3f} GiB; naive attention's S and P "
                             f"would be {A.naive_bytes(t['batch'], t['heads'], t['N']) / 2**30:.0f} GiB "
                             f"(goal <= {GOALS['flash_memory']}x)")


def text_memory(t: dict) -> str:
    import textwrap

    table = memory_table(t)
    return "\n".join([textwrap.fill(table.title, 100)] + str(plots.table(table.header, table.rows)).splitlines())


# ------------------------------------------------------------------------------------------ the field

PARTS = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}  # a field run's timed parts (in order)

def _inputs(n: int, d: int = HEAD_DIM, heads: int = HEADS, tokens: int = TOKENS, seed: int = 0):
    cp = runtime.cupy()
    batch = max(1, tokens // n)
    rs = cp.random.RandomState(seed)
    return batch, [(rs.standard_normal((batch, heads, n, d), dtype=cp.float32) * 0.5).astype(cp.float16)
                   for _ in range(4)]


def sdpa_backward_only(backend, q, k, v, do, causal: bool):
    """A PyTorch SDPA backend's backward alone, as the field times it: one forward of fresh leaf copies of q, k, v
    with ``backend`` (an SDPBackend) forced, its graph kept; each call of the function returned clears the gradients
    and runs that graph's backward again (retain_graph)."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    grads = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(backend):
        out = sdpa(*grads, is_causal=causal)

    def run_backward():
        for g in grads:
            g.grad = None
        out.backward(do, retain_graph=True)
    return run_backward


def measure_field(ns=FIELD_N, d: int = HEAD_DIM, repeats: int = 12) -> dict:
    """Forward, backward, and forward + backward, TFLOP/s of PyTorch's SDPA with each backend forced, and of the
    course's kernels, on the same inputs in the same run; FP16, batch x N = 32k tokens, 16 heads of d; causal and not.
    A backend's backward alone is its autograd node run again on one saved forward (``retain_graph``), Triton's is
    ``flash_backward`` on its forward's o and lse. Each output is checked against the memory-efficient backend's
    before it is timed, and the kernels of one run are
    timed in turns (bench.time_in_turns): under its power cap the GPU's clock sinks as it warms, and timed one after
    another the later kernels were up to 5% slower at N = 16k than timed in turns."""
    torch = _torch()
    if torch is None:
        raise runtime.CourseError("the field is PyTorch's SDPA backends: PyTorch with CUDA is not importable here")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    peak = bench.ceilings().fp16_tflops
    out = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "d": d, "heads": HEADS,
           "tokens": TOKENS, "fp16_peak_tflops": peak, "runs": []}
    for n in bench.progress(ns, desc="attention N"):
        for causal in (False, True):
            batch, (q, k, v, do) = _inputs(n, d)
            tq, tk, tv, tdo = (torch.from_dlpack(a) for a in (q, k, v, do))
            fwd_flops = A.attention_flops(batch, HEADS, n, d, causal=causal)
            run = {"N": n, "batch": batch, "causal": causal, "fwd": {}, "bwd": {}, "fwd_bwd": {}, "errors": {}}
            fwd, bwd, both = {}, {}, {}  # what is timed, checked first
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                ref = sdpa(tq, tk, tv, is_causal=causal).float()
            for name, backend in SDPA_BACKENDS.items():
                backend = getattr(SDPBackend, backend)

                def forward(backend=backend):
                    with sdpa_kernel(backend):
                        return sdpa(tq, tk, tv, is_causal=causal)

                def backward(backend=backend, grads=[x.detach().clone().requires_grad_() for x in (tq, tk, tv)]):
                    for g in grads:  # fresh gradients, as the Triton kernels write theirs: not added to the last ones
                        g.grad = None
                    with sdpa_kernel(backend):
                        sdpa(*grads, is_causal=causal).backward(tdo)

                try:
                    run["errors"][name] = float((forward().float() - ref).abs().max())
                    backward()  # a backend that does not take this shape says so here
                    fwd[name], bwd[name], both[name] = forward, sdpa_backward_only(backend, tq, tk, tv, tdo, causal), \
                        backward
                except RuntimeError as exc:
                    run["errors"][name] = f"not run: {str(exc).splitlines()[0][:200]}"
            for name, kernel in _flash_kernels(torch, causal, d).items():
                o = kernel(q, k, v)[0]
                o = torch.from_dlpack(o) if not isinstance(o, torch.Tensor) else o
                run["errors"][name] = float((o.float() - ref).abs().max())
                fwd[name] = (lambda kernel: lambda: kernel(q, k, v))(kernel)
            if T.available() is None:
                o, lse = T.flash_forward(tq, tk, tv, causal=causal)

                def tri_both():
                    o2, l2 = T.flash_forward(tq, tk, tv, causal=causal)
                    T.flash_backward(tq, tk, tv, o2, l2, tdo, causal=causal)

                gq, gk, gv = (x.detach().clone().requires_grad_() for x in (tq, tk, tv))
                sdpa(gq, gk, gv, is_causal=causal).backward(tdo)
                dq, dk, dv = T.flash_backward(tq, tk, tv, o, lse, tdo, causal=causal)
                run["errors"]["Triton backward"] = max(float((a.float() - b.grad.float()).abs().max())
                                                       for a, b in ((dq, gq), (dk, gk), (dv, gv)))
                bwd["Triton"] = lambda: T.flash_backward(tq, tk, tv, o, lse, tdo, causal=causal)
                both["Triton"] = tri_both
            if d in A.backward_cuda.BWD_HEAD_DIMS and gpus.status("10.wgmma_bwd").runs:  # Hopper: the CUDA C backward
                o16, lse16 = A.flash_wgmma(q, k, v, causal=causal)
                gq, gk, gv = (x.detach().clone().requires_grad_() for x in (tq, tk, tv))
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                    sdpa(gq, gk, gv, is_causal=causal).backward(tdo)
                grads = A.flash_backward_wgmma(q, k, v, o16, lse16, do, causal=causal)
                run["errors"][CUDA_BWD_NAME + " backward"] = max(
                    float((torch.from_dlpack(a).float() - b.grad.float()).abs().max()) for a, b in zip(grads, (gq, gk, gv)))
                bwd[CUDA_BWD_NAME] = lambda: A.flash_backward_wgmma(q, k, v, o16, lse16, do, causal=causal, dq="atomic")
                bwd[CUDA_BWD_NAME + ", dQ by a second pass"] = lambda: A.flash_backward_wgmma(
                    q, k, v, o16, lse16, do, causal=causal, dq="second-pass")

                def cuda_both():
                    o2, l2 = A.flash_wgmma(q, k, v, causal=causal)
                    A.flash_backward_wgmma(q, k, v, o2, l2, do, causal=causal)  # dq="auto"
                both[CUDA_BWD_NAME] = cuda_both
            for part, works, flops in (("fwd", fwd, fwd_flops), ("bwd", bwd, 2.5 * fwd_flops),
                                       ("fwd_bwd", both, 3.5 * fwd_flops)):
                if works:
                    times = bench.time_in_turns(works, repeats=repeats, hold_ms=HOLD_MS)
                    run[part] = {name: t.tflops(flops) for name, t in times.items()}
            out["runs"].append(run)
            del q, k, v, do, tq, tk, tv, tdo, fwd, bwd, both
            runtime.cupy().get_default_memory_pool().free_all_blocks()
            torch.cuda.empty_cache()
    return out


FP8_N = (4096, 16384)
FP8_GOALS = {"fp8_of_fp16": 1.6, "fp8_tflops_16k": 950.0}  # goals: >= 1.6x the course's FP16 forward; >= 950 TFLOP/s


def _head_reference(q, k, v, causal: bool):
    """float64 attention of the first head of the first batch (CuPy), the reference the errors are taken against."""
    cp = runtime.cupy()
    q64, k64, v64 = (x[0, 0].astype(cp.float64) for x in (q, k, v))
    s = q64 @ k64.T / math.sqrt(q64.shape[-1])
    if causal:
        s = cp.where(cp.tril(cp.ones(s.shape, bool)), s, -cp.inf)
    p = cp.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v64


CUDNN_FP8 = "cuDNN FP8"  # cuDNN's own FP8 forward (the cuDNN frontend's sdpa_fp8 graph), where it is installed


def _cudnn_frontend():
    """NVIDIA's cuDNN frontend (the PyPI package nvidia-cudnn-frontend, module ``cudnn``), or None where it is not
    installed or finds no cuDNN library. Like PyTorch, a comparison, not a course dependency."""
    try:
        import cudnn
    except (ImportError, OSError):
        return None
    return cudnn


_CUDNN_HANDLES = {}


def cudnn_fp8(torch, q, k, v, causal: bool):
    """cuDNN's FP8 attention forward on q, k, v (CuPy FP16, (batch, heads, N, d)), through the cuDNN frontend's
    ``sdpa_fp8`` graph, quantised as cuDNN's recipe has it: e4m3 with one scale a tensor (its largest magnitude over
    448), P times 448 before it is rounded, O written in e4m3 (cuDNN takes no other output type for FP8 on Hopper)
    with the scale that maps V's largest magnitude to 448. Returns (run, output): run() launches the graph on the
    current stream; output() runs it and returns O in float32 (a torch tensor, O's codes times their scale). Raises
    CourseError where the frontend is not installed or cuDNN builds no plan for the graph (its reason)."""
    cudnn = _cudnn_frontend()
    if cudnn is None:
        raise runtime.CourseError("cuDNN's FP8 attention needs the cuDNN frontend: pip install nvidia-cudnn-frontend")
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    b, h, n, d = tq.shape
    scale = [float(e4m3_scale(float(t.abs().max()))) for t in (tq, tk, tv)]  # one a tensor
    codes = [(t.float() / sc).to(torch.float8_e4m3fn) for t, sc in zip((tq, tk, tv), scale)]
    scalars = {"descale_q": scale[0], "descale_k": scale[1], "descale_v": scale[2],
               "descale_s": 1 / E4M3_MAX, "scale_s": E4M3_MAX, "scale_o": 1 / scale[2]}
    device = torch.cuda.current_device()
    if device not in _CUDNN_HANDLES:
        _CUDNN_HANDLES[device] = cudnn.create_handle()
    handle = _CUDNN_HANDLES[device]
    try:
        g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        dims, strides = [b, h, n, d], [h * n * d, n * d, d, 1]
        qkv = [g.tensor(name=name, dim=dims, stride=strides, data_type=e4m3) for name in "qkv"]
        scale_nodes = {name: g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
                       for name in scalars}
        o, stats, _, amax_o = g.sdpa_fp8(q=qkv[0], k=qkv[1], v=qkv[2], **scale_nodes, attn_scale=1 / math.sqrt(d),
                                         generate_stats=True, use_causal_mask=causal)
        o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
        stats.set_output(True).set_data_type(f32)
        amax_o.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
    except Exception as exc:  # the frontend's own exception types differ between its versions
        raise runtime.CourseError(f"cuDNN built no FP8 attention plan: {str(exc)[:300]}") from exc
    tensors = {node: torch.full((1, 1, 1, 1), value, dtype=torch.float32, device="cuda")
               for node, value in zip(scale_nodes.values(), scalars.values())}
    out = torch.empty(b, h, n, d, dtype=torch.float8_e4m3fn, device="cuda")
    tensors.update(zip(qkv, codes))
    tensors.update({o: out, stats: torch.empty(b, h, n, 1, dtype=torch.float32, device="cuda"),
                    amax_o: torch.empty(1, 1, 1, 1, dtype=torch.float32, device="cuda")})
    workspace = torch.empty(g.get_workspace_size(), dtype=torch.uint8, device="cuda")

    def run():
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        g.execute(tensors, workspace, handle=handle)

    def output():
        run()
        return out.float() / scalars["scale_o"]
    return run, output


def _heads_reference(q, k, v, causal: bool):
    """``_head_reference`` of every head of the first batch, stacked: (heads, N, d)."""
    cp = runtime.cupy()
    return cp.stack([_head_reference(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], causal) for h in range(q.shape[1])])


def measure_fp8(ns=FP8_N, repeats: int = 12) -> dict:
    """The FP8 forward (flash_fp8, Hopper) against the course's FP16 forward (flash_wgmma's default), cuDNN's FP16
    SDPA and, where the cuDNN frontend is installed, cuDNN's own FP8 forward (``cudnn_fp8``), in turns on the same
    inputs (the field's: 32k tokens, 16 heads of 128), causal and not: TFLOP/s (counted as FP16's: the same
    attention), the pre-pass that makes FP8's operands (quantising Q, K, V a tile at a time and transposing V) timed
    apart (cuDNN's quantisation is not timed either), and each kernel's RMSE of O against float64 on the first
    head. Where cuDNN's FP8 cannot run, ``cudnn_fp8_missing`` says why."""
    cp = runtime.cupy()
    gpus.step("10.wgmma_fp8")
    torch = _torch()
    out = {"d": HEAD_DIM, "heads": HEADS, "tokens": TOKENS, "runs": [], "goals": FP8_GOALS,
           "torch": getattr(torch, "__version__", None)}
    cudnn = _cudnn_frontend() if torch is not None else None
    if cudnn is None:
        out["cudnn_fp8_missing"] = ("PyTorch is not installed" if torch is None
                                    else "the cuDNN frontend is not installed (pip install nvidia-cudnn-frontend)")
    else:
        out["cudnn"] = cudnn.backend_version()
    for n in bench.progress(ns, desc="FP8 attention N"):
        for causal in (False, True):
            batch, (q, k, v, _) = _inputs(n)
            flops = A.attention_flops(batch, HEADS, n, HEAD_DIM, causal=causal)
            ops = A.fp8_operands(q, k, v)
            works = {"FP8 (CUDA C)": lambda: A.flash_fp8(causal=causal, operands=ops),
                     "FP16 (CUDA C)": lambda: A.flash_wgmma(q, k, v, causal=causal)}
            outputs = {name: (lambda work=work: work()[0]) for name, work in works.items()}
            if torch is not None:
                from torch.nn.attention import SDPBackend, sdpa_kernel
                from torch.nn.functional import scaled_dot_product_attention as sdpa

                tq, tk, tv = (torch.from_dlpack(a) for a in (q, k, v))

                def cudnn16():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return sdpa(tq, tk, tv, is_causal=causal)
                works["cuDNN FP16"] = outputs["cuDNN FP16"] = cudnn16
            if "cudnn_fp8_missing" not in out:
                try:
                    works[CUDNN_FP8], outputs[CUDNN_FP8] = cudnn_fp8(torch, q, k, v, causal)
                except runtime.CourseError as exc:
                    out["cudnn_fp8_missing"] = str(exc)
            ref = _head_reference(q, k, v, causal)
            errors = {}
            for name, output in outputs.items():
                o = cp.from_dlpack(output())[0, 0].astype(cp.float64)
                errors[name] = float(cp.sqrt(cp.mean((o - ref) ** 2)))
            times = bench.time_in_turns(works, repeats=repeats, hold_ms=HOLD_MS)
            prep = bench.time_gpu(lambda: A.fp8_operands(q, k, v), repeats=max(3, repeats // 3))
            run = {"N": n, "batch": batch, "causal": causal, "rmse": errors,
                   "tflops": {name: t.tflops(flops) for name, t in times.items()},
                   "median_ms": {name: t.median_ms for name, t in times.items()}, "prepass_ms": prep.median_ms}
            tf = run["tflops"]
            run["fp8_of_fp16"] = tf["FP8 (CUDA C)"] / tf["FP16 (CUDA C)"]
            if "cuDNN FP16" in tf:
                run["fp8_of_cudnn_fp16"] = tf["FP8 (CUDA C)"] / tf["cuDNN FP16"]
            if CUDNN_FP8 in tf:
                run["fp8_of_cudnn_fp8"] = tf["FP8 (CUDA C)"] / tf[CUDNN_FP8]
                run["cudnn_fp8_of_cudnn_fp16"] = tf[CUDNN_FP8] / tf["cuDNN FP16"]
            out["runs"].append(run)
            del q, k, v, ops, works, outputs
            cp.get_default_memory_pool().free_all_blocks()
            if torch is not None:
                torch.cuda.empty_cache()
    return out


def fp8_errors(n: int = 2048, heads: int = 4, seed: int = 0) -> dict:
    """RMSE of O against float64 (``_heads_reference``: every head) of the FP16 kernel, the FP8 kernel and the FP8
    kernel with the random Hadamard rotation of Q and K, on Gaussian inputs and on fp8.outlier_inputs'
    two kinds (FlashAttention-3's outlier entries; a few channels of Q and K 5 times larger), d = 128: the GPU's
    version of fp8.error_figures. Where the cuDNN frontend is installed, cuDNN's FP8 forward too (``cudnn_fp8``: one
    scale a tensor, O in e4m3)."""
    cp = runtime.cupy()
    from kernels.attention import fp8 as F8

    gpus.step("10.wgmma_fp8")
    rng = np.random.default_rng(seed)
    shape = (1, heads, n, HEAD_DIM)
    inputs = {"gaussian": tuple(rng.standard_normal(shape) for _ in range(3)),
              "outlier entries": F8.outlier_inputs(rng, shape, kind="entries"),
              "outlier channels": F8.outlier_inputs(rng, shape, kind="channels", fraction=2 / HEAD_DIM, std=5.0)}
    out = {"n": n, "heads": heads, "d": HEAD_DIM, "rmse": {}}
    torch = _torch()
    cudnn = torch is not None and _cudnn_frontend() is not None  # cuDNN's FP8 (one scale a tensor) beside them
    for name, (q, k, v) in inputs.items():
        q, k, v = (cp.asarray(x.astype(np.float16)) for x in (q, k, v))
        ref = _heads_reference(q, k, v, False)
        runs = {"FP16 (CUDA C)": A.flash_wgmma(q, k, v)[0],
                "FP8 (CUDA C)": A.flash_fp8(q, k, v)[0],
                "FP8 + Hadamard (CUDA C)": A.flash_fp8(operands=A.fp8_operands(q, k, v, hadamard=seed))[0]}
        if cudnn:
            runs[CUDNN_FP8] = cp.from_dlpack(cudnn_fp8(torch, q, k, v, False)[1]())
        out["rmse"][name] = {k2: float(cp.sqrt(cp.mean((o[0].astype(cp.float64) - ref) ** 2))) for k2, o in runs.items()}
    return out


FP8_SHORT = {"FP8 (CUDA C)": "FP8", "FP16 (CUDA C)": "FP16", "cuDNN FP16": "cuDNN FP16", CUDNN_FP8: CUDNN_FP8}


def text_fp8(t: dict) -> str:
    """measure_fp8's figures as two tables: TFLOP/s of each kernel, FP8 over FP16 (and over cuDNN's FP8 where it
    ran), the pre-pass; then the RMSE of each kernel's O. Says why cuDNN's FP8 is missing where it is."""
    names = list(dict.fromkeys(k for r in t["runs"] for k in r["tflops"]))
    heads = [FP8_SHORT.get(n, n) for n in names]
    against_cudnn = any("fp8_of_cudnn_fp8" in r for r in t["runs"])
    body = [[_run_head(r), *(r["tflops"].get(n) for n in names), f"{r['fp8_of_fp16']:.2f}",
             *([None if "fp8_of_cudnn_fp8" not in r else f"{r['fp8_of_cudnn_fp8']:.2f}"] if against_cudnn else []),
             r["prepass_ms"]] for r in t["runs"]]
    head = ["run", *heads, "FP8 / FP16", *(["FP8 / cuDNN FP8"] if against_cudnn else []), "pre-pass ms"]
    speed = plots.table(head, body, align="l" + "r" * (len(head) - 1),
                        title=f"FP8 attention forward, d = {t['d']}, {t['heads']} heads, {t['tokens']:,} tokens: "
                              "TFLOP/s")
    errors = plots.table(["run", *heads],
                         [[_run_head(r), *(f"{r['rmse'][n]:.1e}" if n in r["rmse"] else None for n in names)]
                          for r in t["runs"]],
                         align="l" + "r" * len(names), title="RMSE of O against float64 (the first head)")
    missing = f"\n({CUDNN_FP8} not run: {t['cudnn_fp8_missing']})" if t.get("cudnn_fp8_missing") else ""
    return f"{speed}\n{errors}{missing}"


def ratios(t: dict) -> list:
    """Per run: each course kernel against the fastest SDPA backend (and Triton against FlashAttention-2); the best
    of the sm_80+ kernels (WMMA, mma.sync: GOALS' sm80_of_fastest) against it, and which that was; Triton's backward
    against the fastest backend's backward (GOALS' bwd_of_fastest), and its forward + backward against theirs."""
    def fastest(r, part):  # the fastest SDPA backend of a part of run r, and its TFLOP/s (None, None: none ran)
        sd = {k: v for k, v in r[part].items() if k in SDPA_BACKENDS}
        name = max(sd, key=sd.get) if sd else None
        return name, sd.get(name)

    rows = []
    for r in t["runs"]:
        (f_name, f_best), (b_name, b_best), (fb_name, fb_best) = (fastest(r, part) for part in PARTS)
        row = {"N": r["N"], "causal": r["causal"], "fastest": f_name, "fastest_bwd": b_name,
               "fastest_fwd_bwd": fb_name}
        for name, v in r["fwd"].items():
            if name not in SDPA_BACKENDS and f_name:
                row[f"{name} / fastest"] = v / f_best
        sm80 = {k: r["fwd"][k] for k in SM80_KERNELS if k in r["fwd"]}
        if sm80 and f_name:
            best = max(sm80, key=sm80.get)
            row["best sm_80 kernel"] = best
            row["best sm_80 kernel / fastest"] = sm80[best] / f_best
        if "Triton" in r["fwd"] and "FlashAttention-2" in r["fwd"]:
            row["Triton / FlashAttention-2"] = r["fwd"]["Triton"] / r["fwd"]["FlashAttention-2"]
        if "Triton" in r["bwd"] and b_name:
            row["Triton bwd / fastest"] = r["bwd"]["Triton"] / b_best
        if "Triton" in r["fwd_bwd"] and fb_name:
            row["Triton fwd+bwd / fastest"] = r["fwd_bwd"]["Triton"] / fb_best
        cuda_bwd = [v for k, v in r["bwd"].items() if k.startswith(CUDA_BWD_NAME)]  # the faster dQ of the two
        if cuda_bwd and b_name:
            row["CUDA C bwd / fastest"] = max(cuda_bwd) / b_best
        if CUDA_BWD_NAME in r["fwd_bwd"] and fb_name:
            row["CUDA C fwd+bwd / fastest"] = r["fwd_bwd"][CUDA_BWD_NAME] / fb_best
        rows.append(row)
    return rows


def field_reading(t: dict) -> list:
    """What notebook 10 says in words about the field (section 6), each statement with whether it holds in ``t`` (a
    run's or a record's figure "field"): [(statement, True, False or None)], None where the figure lacks what a
    statement needs (no Hopper kernel below compute capability 9.0, a backend that did not run). Every record holds
    every statement (a records test asserts it)."""
    qs = ratios(t)
    qregs = [q.get("wgmma qregs (CUDA C) / fastest") for q in qs]

    def hopper_orders(q):
        return {k: v for k, v in q.items() if k.startswith("wgmma ") and k.endswith(" / fastest")}

    def every(test):
        return claims.every(qs, test)

    return [
        ("cuDNN: PyTorch's fastest backend in every column, forward, backward and both",
         every(lambda q: (q["fastest"], q["fastest_bwd"], q["fastest_fwd_bwd"]) == ("cuDNN",) * 3)),
        ("the Hopper kernel: Q in registers its fastest order in most columns",
         (2 * sum(max(hopper_orders(q), key=hopper_orders(q).get).startswith("wgmma qregs") for q in qs) > len(qs))
         if qs and None not in qregs else None),
        ("the Hopper kernel (its fastest order): at 0.95 of cuDNN's forward or more in every column",
         every(lambda q: max(hopper_orders(q).values()) >= 0.95) if None not in qregs else None),
        ("Triton's forward faster than FlashAttention-2's in every column",
         every(lambda q: q["Triton / FlashAttention-2"] > 1.0)),
        ("WMMA at 0.2 to 0.3 of the fastest forward, mma.sync at 0.45 to 0.6, in every column",
         every(lambda q: 0.2 <= q[f"{WMMA_NAME} / fastest"] <= 0.3 and 0.45 <= q[f"{MMA_NAME} / fastest"] <= 0.6)),
    ]


def plan_over_online(t: dict, dtype: str = "float32") -> list:
    """The row softmax with SOFTMAX_PLAN's shapes (the row "one pass across a cluster") over the online kernel's GB/s
    at each row length of ``t`` (a run's or a record's figure "softmax"): [(length, ratio)]."""
    rows = t["dtypes"][dtype]
    plan, online = rows["CUDA C, one pass across a cluster (Hopper)"], rows["CUDA C, one pass (online, in registers)"]
    return [(n, a / b) for n, a, b in zip(t["lengths"], plan, online) if a and b]


def orders_reading(t: dict) -> list:
    """What the deep dive of lesson 10 says of the Hopper kernel's orders of work (section 3), each statement with
    whether it holds in ``t`` (a run's or a record's figure "field"), each order's forward over the fastest backend's:
    [(statement, True, False or None)], None without the Hopper rows. A records test asserts every statement on every
    record."""
    qs = ratios(t)
    key = {name: f"wgmma {name} (CUDA C) / fastest" for name in WGMMA_VARIANTS[t.get("d", 128)]}

    def every(test):
        return claims.every(qs, test)

    def order(q):
        return {name: q[k] for name, k in key.items()}

    big_causal = [q for q in qs if q["causal"] and q["N"] == max(r["N"] for r in qs)]
    return [
        ("pipelined: faster than serial in every column", every(lambda q: q[key["pipelined"]] > q[key["serial"]])),
        ("ahead: never more than three hundredths faster than serial",
         every(lambda q: q[key["ahead"]] <= q[key["serial"]] + 0.03)),
        ("Q in registers: the fastest order in most columns",
         claims.holds(lambda: 2 * sum(max(order(q), key=order(q).get) == "qregs" for q in qs) > len(qs) if qs else None)),
        ("Q in registers: at or above the fastest backend's forward in most columns",
         claims.holds(lambda: 2 * sum(q[key["qregs"]] >= 1.0 for q in qs) > len(qs) if qs else None)),
        ("every other order: under the fastest backend's forward in some column",
         claims.holds(lambda: all(min(q[key[n]] for q in qs) < 1.0 for n in key if n != "qregs") if qs else None)),
        (f"ping-pong: under the fastest backend's forward at the longest causal run"
         + (f" ({_k(big_causal[0]['N'])})" if big_causal else ""),
         claims.holds(lambda: big_causal[0][key["pingpong"]] < 1.0)),
    ]


def backward_reading(t: dict) -> list:
    """What the deep dive of lesson 10 says of the CUDA C backward (section 5), each statement with whether it holds
    in ``t`` (a run's or a record's figure "field"): [(statement, True, False or None)], None where the field has no
    CUDA C backward (not Hopper, or recorded before it existed). A records test asserts every statement on every
    record that has it."""
    second = CUDA_BWD_NAME + ", dQ by a second pass"
    runs = [r for r in t["runs"] if CUDA_BWD_NAME in r.get("bwd", {}) and second in r["bwd"]]
    qs = {(q["N"], q["causal"]): q for q in ratios(t)}

    def every(test, rows=runs):
        return claims.every(rows, test)

    def best(r):
        return max(r["bwd"][CUDA_BWD_NAME], r["bwd"][second])

    above = [r for r in runs if r["N"] >= 4096]
    return [
        ("the CUDA C backward (the faster dQ): at least 0.85x cuDNN's backward in every column",
         every(lambda r: qs[r["N"], r["causal"]]["fastest_bwd"] == "cuDNN" and best(r) >= 0.85 * r["bwd"]["cuDNN"])),
        ("the CUDA C backward (the faster dQ): faster than Triton's in every column",
         every(lambda r: best(r) > r["bwd"]["Triton"])),
        ("dQ by atomics: faster than by a second pass in every column from N = 4k",
         every(lambda r: r["bwd"][CUDA_BWD_NAME] > r["bwd"][second], above)),
    ]


def fp8_reading(t: dict) -> list:
    """What the deep dive of lesson 10 says of the FP8 forward (section 5), each statement with whether it holds in
    ``t`` (a run's or a record's figure "fp8"). A records test asserts every statement on every record."""
    runs = t.get("runs", [])
    against = [r for r in runs if "fp8_of_cudnn_fp8" in r]  # the runs with cuDNN's FP8 (where it is installed)

    def every(test, rows=runs):
        return claims.every(rows, test)

    return [
        ("FP8: faster than the course's FP16 kernel in every column",
         every(lambda r: r["tflops"]["FP8 (CUDA C)"] > r["tflops"]["FP16 (CUDA C)"])),
        ("FP8: short of its goal of 1.6x the FP16 kernel in every column",
         every(lambda r: r["fp8_of_fp16"] < t["goals"]["fp8_of_fp16"])),
        ("FP8: its RMSE at least 10x the FP16 kernel's in every column",
         every(lambda r: r["rmse"]["FP8 (CUDA C)"] >= 10 * r["rmse"]["FP16 (CUDA C)"])),
        ("the pre-pass (quantise, transpose V): under an eighth of the FP8 forward's time at N = 16k, causal or not",
         claims.every([r for r in runs if r["N"] == 16384],
                      lambda r: r["prepass_ms"] < 0.125 * r["median_ms"]["FP8 (CUDA C)"])),
        (f"{CUDNN_FP8} (one scale a tensor): short of 1.6x cuDNN's FP16 forward in every column",
         every(lambda r: r["cudnn_fp8_of_cudnn_fp16"] < t["goals"]["fp8_of_fp16"], against)),
        (f"FP8: at least 0.95x {CUDNN_FP8} in every column",
         every(lambda r: r["fp8_of_cudnn_fp8"] >= 0.95, against)),
        (f"FP8: its RMSE under {CUDNN_FP8}'s in every column (cuDNN rounds O to e4m3)",
         every(lambda r: r["rmse"]["FP8 (CUDA C)"] < r["rmse"][CUDNN_FP8], against)),
    ]


def _run_head(r: dict) -> str:
    return _k(r["N"]) + (" causal" if r["causal"] else "")


def field_table(t: dict, source: str = "", part: str = "fwd") -> plots.Table:
    """TFLOP/s of every contender in one part of the field (forward, backward alone, or both), a column per run."""
    if part not in PARTS:
        raise runtime.CourseInputError(f"field_table: part is one of {', '.join(PARTS)}, not {part!r}")
    names = list(dict.fromkeys(k for r in t["runs"] for k in r[part]))
    body = [[name, *(r[part].get(name) for r in t["runs"])] for name in names]
    return plots.table(["TFLOP/s", *map(_run_head, t["runs"])], body, source=source,
                       align="l" + "r" * len(t["runs"]),
                       title=f"Attention {PARTS[part]}: FP16, {t['heads']} heads of {t['d']}, batch x N = "
                             f"{t['tokens']:,} tokens; FP16 peak {t['fp16_peak_tflops']:.0f}")


RATIO_ROWS = {"Triton / FlashAttention-2": "Triton forward / FlashAttention-2's",
              "Triton bwd / fastest": "Triton backward / fastest backward",
              "Triton fwd+bwd / fastest": "Triton fwd + bwd / fastest fwd + bwd",
              "CUDA C bwd / fastest": "CUDA C backward / fastest backward",  # Hopper; the faster of its dQs
              "CUDA C fwd+bwd / fastest": "CUDA C fwd + bwd / fastest fwd + bwd"}


def field_ratio_table(t: dict, source: str = "") -> plots.Table:
    """Each course kernel's forward against the fastest SDPA backend's forward (which backend that is, first);
    Triton's forward against FlashAttention-2's, and its backward and forward + backward against the fastest
    backend's (``ratios``)."""
    qs = ratios(t)
    course = list(dict.fromkeys(k for q in qs for k in q if k.endswith(" / fastest") and k not in RATIO_ROWS
                                and not k.startswith("best ")))
    body = [["fastest backend (forward)", *(q["fastest"] for q in qs)]]
    body += [[k.removesuffix(" / fastest"), *(None if q.get(k) is None else f"{q[k]:.2f}" for q in qs)]
             for k in course]
    body += [[label, *(None if q.get(k) is None else f"{q[k]:.2f}" for q in qs)]
             for k, label in RATIO_ROWS.items() if any(k in q for q in qs)]
    return plots.table(["forward / fastest backend's", *map(_run_head, t["runs"])], body, source=source,
                       align="l" + "r" * len(qs),
                       title=f"Against PyTorch's fastest backend (goals: Triton forward >= "
                             f"{GOALS['triton_fwd_of_fa2']}x FA-2's, backward >= {GOALS['bwd_of_fastest']}x)")


def text_field(t: dict) -> str:
    lines = [f"PyTorch {t['torch']} (cuDNN {t['cudnn']})"]
    for part in PARTS:
        lines += ["", str(field_table(t, part=part))]
    lines += ["", str(field_ratio_table(t))]
    return "\n".join(lines)


def plot_field(t: dict, source: str, causal: bool = False, part: str = "fwd"):
    if part not in PARTS:
        raise runtime.CourseInputError(f"plot_field: part is one of {', '.join(PARTS)}, not {part!r}")
    runs = [r for r in t["runs"] if r["causal"] == causal]
    names = sorted({k for r in runs for k in r[part]})
    series = {name: ([r["N"] for r in runs if name in r[part]], [r[part][name] for r in runs if name in r[part]])
              for name in names}
    return plots.lines(series, xlabel="N", ylabel="TFLOP/s", source=source, logy=False,
                       levels={"dense FP16 peak (cuBLAS)": t["fp16_peak_tflops"]},
                       title=f"Attention {PARTS[part]}, "
                             f"{'causal' if causal else 'full'}, d = {t['d']}")


# -------------------------------------------------------------------------------------------- ncu

PROFILE_N, PROFILE_BATCH = 4096, 8
PROFILE_METRICS = {
    "gpu__time_duration.sum": "duration",
    # the tensor pipes' busy share: on Hopper it counts wgmma's work as well as mma.sync's (the gmma counter gave no
    # value under ncu there)
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor pipes (%)",
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active": "exp2 (XU) pipe (%)",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy (%)",
    # the share of the run the SMs have work at all: a causal run's tail (SMs that finished, waiting for the last
    # items) shows here and not in the shares above, which count active cycles only
    "sm__cycles_active.avg.pct_of_peak_sustained_elapsed": "SMs busy (%)",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM (%)",
    "launch__registers_per_thread": "registers",
}
PROFILE_SNIPPET = f"""
import gpucourse
gpucourse.setup("gpu", quiet=True)
import cupy as cp, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa
from gpucourse import gpus
from kernels import attention as A
rs = cp.random.RandomState(0)
q, k, v = ((rs.standard_normal(({PROFILE_BATCH}, {HEADS}, {PROFILE_N}, {HEAD_DIM}), dtype=cp.float32) * 0.5).astype(cp.float16)
           for _ in range(3))
if gpus.status("10.wgmma").runs:
    A.flash_wgmma(q, k, v, causal=CAUSAL)
if not CAUSAL and not A.wmma_missing({HEAD_DIM}):
    A.flash_wmma(q, k, v)
    if gpus.status("10.mma").runs:
        A.flash_mma(q, k, v)
tq, tk, tv = (torch.from_dlpack(a) for a in (q, k, v))
for backend in (SDPBackend.CUDNN_ATTENTION,) + (() if CAUSAL else (SDPBackend.FLASH_ATTENTION,)):
    with sdpa_kernel(backend):
        sdpa(tq, tk, tv, is_causal=CAUSAL)
torch.cuda.synchronize()
"""


def measure_profile() -> dict:
    """ncu on each forward kernel at N = 4096 (batch 8, 16 heads of 128, not causal): the course's Hopper, WMMA and
    mma.sync kernels, SDPA's cuDNN and FlashAttention-2 kernels; how busy each keeps the tensor pipes and the exp2
    unit, with how many warps and registers. Then causal (``causal_rows``): the Hopper kernel and cuDNN's."""
    from gpucourse import profile

    try:
        rows = {causal: profile.ncu(f"CAUSAL = {causal}\n" + PROFILE_SNIPPET, metrics=PROFILE_METRICS,
                                    kernel="flash|fmha|sdpa|cudnn", timeout=300) for causal in (False, True)}
        return {"ok": True, "why": "", "rows": rows[False], "causal_rows": rows[True], "N": PROFILE_N,
                "batch": PROFILE_BATCH, "heads": HEADS, "d": HEAD_DIM,
                "flops": A.attention_flops(PROFILE_BATCH, HEADS, PROFILE_N, HEAD_DIM),
                "causal_flops": A.attention_flops(PROFILE_BATCH, HEADS, PROFILE_N, HEAD_DIM, causal=True)}
    except profile.ProfilerUnavailable as exc:
        return {"ok": False, "why": str(exc), "rows": []}


PROFILE_SHORT = {"tensor pipes (%)": "tensor %", "exp2 (XU) pipe (%)": "exp2 %", "occupancy (%)": "occupancy %",
                 "SMs busy (%)": "SMs busy %", "DRAM (%)": "DRAM %", "registers": "regs"}


def profile_kernel(name: str) -> str:
    """A profiled kernel as a reader knows it: cuDNN's and FlashAttention-2's by their library, the course's by
    the kernel's own name."""
    from gpucourse import profile

    if "cudnn" in name:
        return "cuDNN (SDPA)"
    if "pytorch_flash" in name:
        return "FlashAttention-2 (SDPA)"
    return profile.short_name(name, 30)


def profile_table(p: dict, source: str = "", causal: bool = False) -> plots.Table:
    """ncu on each forward kernel: TFLOP/s from its duration, and its counters (PROFILE_METRICS)."""
    keys = [k for k in PROFILE_METRICS if k != "gpu__time_duration.sum"]
    rows, flops = (p["causal_rows"], p["causal_flops"]) if causal else (p["rows"], p["flops"])
    body = []
    for r in rows:
        dur = r.get("gpu__time_duration.sum")
        tf = flops / (dur * 1e-9) / 1e12 if isinstance(dur, float) and dur > 0 else None
        body.append([profile_kernel(r["kernel"]), tf, *(r.get(k) if isinstance(r.get(k), float) else None
                                                        for k in keys)])
    return plots.table(["kernel", "TFLOP/s", *(PROFILE_SHORT[PROFILE_METRICS[k]] for k in keys)], body,
                       source=source, align="l" + "r" * (len(keys) + 1),
                       title=f"ncu, forward at N = {p['N']:,} (batch {p['batch']}, {p['heads']} heads of {p['d']}, "
                             f"{'causal' if causal else 'not causal'})")


def text_profile(p: dict) -> str:
    if not p["ok"]:
        return f"ncu: {p['why']}"
    return "\n\n".join(str(profile_table(p, causal=causal)) for causal in (False, True))


def profile_reading(p: dict) -> list:
    """What the deep dive of lesson 10 says of the profile (section 4), each statement with whether it holds in ``p``
    (a run's or a record's figure "profile"): [(statement, True, False or None)]. A records test asserts every
    statement on every record."""
    busy = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
    xu = "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"

    def pick(rows, test):
        return next(r for r in rows if test(r["kernel"]))

    def ours(rows):
        return pick(rows, lambda k: k.startswith("flash_wgmma"))

    def cudnn(rows):
        return pick(rows, lambda k: "cudnn" in k)

    both = (("full", "rows"), ("causal", "causal_rows"))
    out = []
    for what, test in (
            ("tensor pipes busier than in cuDNN's kernel",
             lambda rows: ours(rows)[busy] > cudnn(rows)[busy]),
            ("the same registers a thread and occupancy as cuDNN's",
             lambda rows: all(abs(ours(rows)[k] - cudnn(rows)[k]) <= 1e-3 * cudnn(rows)[k] for k in
                              ("launch__registers_per_thread", "sm__warps_active.avg.pct_of_peak_sustained_active"))),
            ("finishes sooner than cuDNN's", lambda rows: ours(rows)["gpu__time_duration.sum"]
             < cudnn(rows)["gpu__time_duration.sum"])):
        out.append((f"Q in registers, full and causal: {what}",
                    claims.holds(lambda: all(test(p[k]) for _, k in both) if p.get("ok") else None)))
    rows = p.get("rows", [])
    others = [r for r in rows if r["kernel"].startswith("flash_mma") or "pytorch_flash" in r["kernel"]]
    out += [
        ("FlashAttention-2's and the mma.sync kernel: the tensor pipes under 0.8 of cuDNN's share",
         claims.holds(lambda: (len(others) == 2 and all(r[busy] < 0.8 * cudnn(rows)[busy] for r in others))
                      if rows else None)),
        ("WMMA's kernel: the tensor pipes busy the least",
         claims.holds(lambda: pick(rows, lambda k: k.startswith("flash_wmma"))[busy] == min(r[busy] for r in rows))),
        ("Q in registers, causal: its SMs have work over 95% of the run (no long tail of idle SMs)",
         claims.holds(lambda: ours(p["causal_rows"])["sm__cycles_active.avg.pct_of_peak_sustained_elapsed"] > 95
                      if p.get("ok") else None)),
        ("Q in registers: the exp2 (XU) pipe busy over a quarter of the time, full and causal",
         claims.holds(lambda: all(ours(p[k])[xu] > 25 for _, k in both) if p.get("ok") else None)),
        ("cuDNN's kernel and Q in registers: 168 registers a thread, full and causal",
         claims.holds(lambda: all(r(p[k])["launch__registers_per_thread"] == 168 for r in (ours, cudnn) for _, k in both)
                      if p.get("ok") else None)),
    ]
    return out


def _held():  # the figure "held" has its own module, which takes this one's names
    from benchmarks import attention_held
    return attention_held


FIGURES = {
    "softmax": Figure(measure_softmax, plot_softmax, text_softmax),
    "naive": Figure(measure_naive, plot_naive, text_naive),
    "memory": Figure(measure_memory, None, text_memory),
    "field": Figure(measure_field, plot_field, text_field),
    "profile": Figure(measure_profile, None, text_profile, optional=True),
    "fp8": Figure(measure_fp8, None, text_fp8, optional=True, step="10.wgmma_fp8"),
    "fp8_errors": Figure(fp8_errors, optional=True, step="10.wgmma_fp8"),
    "held": Figure(lambda: _held().measure_held(), None, lambda t: _held().text_held(t), optional=True,
                   step="10.wgmma_bwd"),
}


# ------------------------------------------------------------------------------------ RESULTS.md

def results_rows(record: dict) -> list:
    """The lesson's headline figures in one record, for RESULTS.md and the README (gpucourse.results): the first row
    is the headline. The Hopper kernel: its fastest order in each run (the "wgmma ..." rows); None on a GPU without
    Hopper's wgmma."""
    from gpucourse import results as R

    f = record["figures"]
    field = f.get("field", {})
    runs, q = field.get("runs", []), (ratios(field) if field.get("runs") else [])
    hopper = [max((v for k, v in r.items() if k.startswith("wgmma ") and k.endswith(" / fastest")), default=None)
              for r in q]
    def at_largest(rs):  # a figure's runs at its largest N, full then causal, and their label
        n = max((r["N"] for r in rs), default=None)
        return (f"N = {n // 1024}k" if n else "the largest N"), sorted((r for r in rs if r["N"] == n),
                                                                      key=lambda r: r["causal"])

    def full_causal(rs, pick):  # "full / causal" TFLOP/s
        values = [pick(r) for r in rs]
        return R.joined(values, R.number) if len(values) == 2 else None

    big, field_top = at_largest(runs)
    fp8_runs = f.get("fp8", {}).get("runs", [])
    fp8_big, fp8_top = at_largest(fp8_runs)

    def tflops(pick):
        return full_causal(field_top, lambda r: pick(r["fwd"]))

    def ours(fwd):
        return max((v for k, v in fwd.items() if k.startswith("wgmma ")), default=None)

    soft = softmax_ratios(f["softmax"]) if f.get("softmax") else {}
    n = f.get("softmax", {}).get("lengths", [])
    of_copy = [x for r in soft.values() for length, x in zip(n, r["of_copy"]) if length >= SOFTMAX_GOAL_FROM]
    fp8_tflops = full_causal(fp8_top, lambda r: r["tflops"].get("FP8 (CUDA C)"))
    return [
        ("Hopper attention forward, speed against the fastest SDPA backend", R.span(hopper), "field"),
        (f"Hopper attention forward, {big}, full / causal, TFLOP/s", tflops(ours), "field"),
        (f"cuDNN SDPA forward, {big}, full / causal, TFLOP/s", tflops(lambda fwd: fwd.get("cuDNN")), "field"),
        ("Triton forward, speed against FlashAttention-2", R.span([r.get("Triton / FlashAttention-2") for r in q]),
         "field"),
        ("Triton backward, speed against the fastest backend's", R.span([r.get("Triton bwd / fastest") for r in q]),
         "field"),
        ("CUDA C backward (Hopper), speed against the fastest backend's",
         R.span([r.get("CUDA C bwd / fastest") for r in q]), "field"),
        ("FP8 forward (Hopper), speed against the course's FP16 forward",
         R.span([r.get("fp8_of_fp16") for r in fp8_runs]), "fp8"),
        ("FP8 forward (Hopper), speed against cuDNN's FP8 forward",
         R.span([r.get("fp8_of_cudnn_fp8") for r in fp8_runs]), "fp8"),
        (f"FP8 forward, {fp8_big}, full / causal, TFLOP/s", fp8_tflops, "fp8"),
        ("mma.sync kernel (sm_80 on), speed against the fastest", R.span([r.get(f"{MMA_NAME} / fastest") for r in q]),
         "field"),
        (f"row softmax, rows of {SOFTMAX_GOAL_FROM // 1024}k and more, share of the copy's GB/s",
         R.span(of_copy, R.share), "softmax"),
        ("PyTorch version", field.get("torch"), "field"),
    ]

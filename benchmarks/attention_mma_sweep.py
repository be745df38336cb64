"""Lesson 10's mma.sync kernel (kernels/cuda/attention_mma.cu, FlashAttention-2's shape) on a GPU, to choose its
default shape: every variant's registers, spills and blocks an SM; every kernel checked against a float32
reference (output and log-sum-exp); then the forward's TFLOP/s of the WMMA kernel, the mma.sync kernel's default
and each of its variants, and PyTorch's SDPA with the cuDNN and FlashAttention-2 backends, on the same inputs in
the same run (CUDA events, warm-up, median). Prints, per head dim, the variant with the best geometric mean: the
FLASH_MMA_DEFAULT line to put in attention_mma.cu.

    python benchmarks/attention_mma_sweep.py [--repeats 10] [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import gpucourse  # noqa: E402

CHECK_N = (128, 1000, 4096)  # N of the correctness check (batch x heads = 4)
SHAPES = ((16, 16, 4096), (4, 16, 16384))  # (batch, heads, N) of the timing: the GPU full
HEAD_DIMS = (128, 64)


def _reference(tq, tk, tv, causal: bool, scale: float):
    """(o, lse) in float32 with PyTorch, S whole in memory."""
    import torch

    s = torch.matmul(tq.float(), tk.float().transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), tv.float()), lse


def kernel_info() -> list:
    """(name, registers, spill bytes (local memory), blocks an SM) of every mma.sync kernel and the WMMA ones."""
    from gpucourse import cuda_c, runtime
    from kernels.attention import flash as F

    cp = runtime.cupy()
    variants, default = F.mma_variants()
    rows = []
    for d in F.MMA_HEAD_DIMS:
        for variant in [None, *variants[d]]:
            shape = variants[d][variant or default[d]]
            for causal in (False, True):
                name = f"flash_mma_d{d}" + (f"_{variant}" if variant else "") + ("_causal" if causal else "")
                fn = cuda_c.function(F.MMA_SOURCE, name)
                smem = F.mma_smem_bytes(d, shape)
                fn.max_dynamic_shared_size_bytes = smem
                try:
                    blocks = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, 32 * shape.warps,
                                                                                      smem)
                except Exception:  # noqa: BLE001  (an older CuPy: leave it out)
                    blocks = None
                rows.append((name, fn.num_regs, fn.local_size_bytes, blocks, smem))
        for causal in (False, True):
            name = f"flash_wmma_d{d}" + ("_causal" if causal else "")
            fn = cuda_c.function(F.SOURCE, name)
            rows.append((name, fn.num_regs, fn.local_size_bytes, None, F.wmma_smem_bytes(d)))
    return rows


def check(variants_n: int = 1000) -> list:
    """Max error of the output (relative to its largest entry) and of the log-sum-exp against float32, for the
    four default kernels at each CHECK_N and every variant at N = variants_n; raises if any is wrong."""
    import torch

    from gpucourse import runtime
    from kernels import attention as A

    cp = runtime.cupy()
    variants, _ = A.mma_variants()
    rows, bad = [], []
    rs = cp.random.RandomState(1)
    for d in HEAD_DIMS:
        for n in CHECK_N:
            q, k, v = (rs.standard_normal((1, 4, n, d), dtype=cp.float32).astype(cp.float16) for _ in range(3))
            tq, tk, tv = (torch.from_dlpack(a) for a in (q, k, v))
            for causal in (False, True):
                ro, rl = _reference(tq, tk, tv, causal, 1 / math.sqrt(d))
                for variant in [None] + (list(variants[d]) if n == variants_n else []):
                    name = f"flash_mma_d{d}" + (f"_{variant}" if variant else "") + ("_causal" if causal else "")
                    try:
                        o, lse = A.flash_mma(q, k, v, causal=causal, variant=variant)
                        e_o = float((torch.from_dlpack(o).float() - ro).abs().max() / ro.abs().max())
                        e_l = float((torch.from_dlpack(lse) - rl).abs().max())
                        ok = e_o < 1e-2 and e_l < 2e-3 and bool(cp.isfinite(o).all())
                    except Exception as exc:  # noqa: BLE001  (a launch that fails is reported with the rest)
                        print(f"{name} N = {n}: {type(exc).__name__}: {exc}", flush=True)
                        e_o = e_l = float("nan")
                        ok = False
                    rows.append((name, n, e_o, e_l, ok))
                    if not ok:
                        bad.append(f"{name} N = {n}: output error {e_o:.1e}, lse error {e_l:.1e}")
            del q, k, v, tq, tk, tv
    if bad:
        print("\n".join(["WRONG:", *bad]), flush=True)
    return rows


def timing(shapes=SHAPES, head_dims=HEAD_DIMS, repeats: int = 10, variants_too: bool = True) -> list:
    """TFLOP/s of every kernel at each (batch, heads, N), head dim and mask."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from gpucourse import bench, runtime
    from kernels import attention as A

    cp = runtime.cupy()
    variants, default = A.mma_variants()
    out = []
    for b, h, n in shapes:
        for d in head_dims:
            rs = cp.random.RandomState(0)
            q, k, v = ((rs.standard_normal((b, h, n, d), dtype=cp.float32) * 0.5).astype(cp.float16)
                       for _ in range(3))
            tq, tk, tv = (torch.from_dlpack(a) for a in (q, k, v))
            for causal in (False, True):
                flops = A.attention_flops(b, h, n, d, causal=causal)
                run = {"batch": b, "heads": h, "N": n, "d": d, "causal": causal, "tflops": {}, "ms": {}, "diff": {}}
                kernels = {"WMMA": lambda: A.flash_wmma(q, k, v, causal=causal),
                           f"mma.sync default ({default[d]})": lambda: A.flash_mma(q, k, v, causal=causal)}
                if variants_too:
                    for variant in variants[d]:
                        if variant != default[d]:
                            kernels[f"mma.sync {variant}"] = (lambda variant: lambda: A.flash_mma(
                                q, k, v, causal=causal, variant=variant))(variant)
                for label, backend in (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION),
                                       ("SDPA FlashAttention-2", SDPBackend.FLASH_ATTENTION)):
                    kernels[label] = (lambda backend: lambda: _sdpa(sdpa_kernel, sdpa, backend, tq, tk, tv,
                                                                      causal))(backend)
                for label, fwd in kernels.items():
                    try:
                        o = fwd()
                        o = o[0] if isinstance(o, tuple) else o
                        o = torch.from_dlpack(o) if not isinstance(o, torch.Tensor) else o
                        t = bench.time_gpu(fwd, warmup=2, repeats=repeats)
                        run["ms"][label], run["tflops"][label] = t.median_ms, t.tflops(flops)
                        run["diff"][label] = o
                    except Exception as exc:  # noqa: BLE001  (a backend that does not take this shape says so)
                        run["tflops"][label] = None
                        run["diff"][label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"
                ref = run["diff"].get("SDPA cuDNN")
                ref = ref if isinstance(ref, torch.Tensor) else run["diff"].get("SDPA FlashAttention-2")
                for label, o in list(run["diff"].items()):  # each output's largest difference from SDPA's
                    if isinstance(o, torch.Tensor):
                        run["diff"][label] = float((o.float() - ref.float()).abs().max()) if isinstance(
                            ref, torch.Tensor) else None
                out.append(run)
                print(_run_text(run), flush=True)
            del q, k, v, tq, tk, tv
            cp.get_default_memory_pool().free_all_blocks()
            torch.cuda.empty_cache()
    return out


def _sdpa(sdpa_kernel, sdpa, backend, tq, tk, tv, causal):
    with sdpa_kernel(backend):
        return sdpa(tq, tk, tv, is_causal=causal)


def _run_text(run: dict) -> str:
    tf = {k: v for k, v in run["tflops"].items() if v is not None}
    sd = {k: v for k, v in tf.items() if k.startswith("SDPA")}
    fastest = max(sd.values()) if sd else None
    lines = [f"batch {run['batch']} x {run['heads']} heads, N = {run['N']}, d = {run['d']}, "
             f"{'causal' if run['causal'] else 'full'}:"]
    for label, v in run["tflops"].items():
        if v is None:
            lines.append(f"  {label:34} not run: {run['diff'][label]}")
            continue
        rel = f"{v / fastest:6.2f}x fastest SDPA" if fastest else ""
        diff = run["diff"].get(label)
        lines.append(f"  {label:34} {run['ms'][label]:9.3f} ms {v:7.1f} TFLOP/s {rel}"
                     + (f"   max |o - SDPA's| {diff:.1e}" if isinstance(diff, float) else ""))
    return "\n".join(lines)


def summary(runs: list) -> str:
    """Per head dim: each mma.sync variant's geometric mean of (its TFLOP/s / the fastest SDPA backend's) over the
    runs, and the best one as the FLASH_MMA_DEFAULT line."""
    from kernels.attention import flash as F

    _, default = F.mma_variants()
    lines = []
    for d in sorted({r["d"] for r in runs}):
        scores, sm80 = {}, []
        for r in (r for r in runs if r["d"] == d):
            sd = [v for k, v in r["tflops"].items() if k.startswith("SDPA") and v]
            if not sd:
                continue
            for label, v in r["tflops"].items():
                if label.startswith("mma.sync") and v:
                    name = default[d] if label.startswith("mma.sync default") else label.split()[-1]
                    scores.setdefault(name, []).append(v / max(sd))
            sm80.append(max(v for k, v in r["tflops"].items() if v and not k.startswith("SDPA")) / max(sd))
        if not scores:
            continue
        gm = {k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in scores.items()}
        lines.append(f"d = {d}: mma.sync / fastest SDPA, geometric mean over the runs: " + ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(gm.items(), key=lambda kv: -kv[1])))
        lines.append(f"d = {d}: best sm_80 kernel / fastest SDPA, per run: " + ", ".join(f"{x:.2f}" for x in sm80)
                     + " (goal >= 0.5)")
        best = max(gm, key=gm.get)
        lines.append(f"  FLASH_MMA_DEFAULT({d}, {best})" + ("   (the default now)" if best == default[d] else
                                                            f"   (now {default[d]}: change that line)"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="time only N = 4096 and no variant but the default")
    ap.add_argument("--json", help="also write the measurements here")
    args = ap.parse_args(argv)
    gpucourse.setup("gpu", quiet=True)
    from gpucourse import runtime

    cp = runtime.cupy()
    import torch

    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = dev["name"].decode() if isinstance(dev["name"], bytes) else dev["name"]
    print(f"{name}: CuPy {cp.__version__}, PyTorch {torch.__version__} (cuDNN {torch.backends.cudnn.version()})")
    info = kernel_info()
    print(f"{'kernel':36} {'registers':>9} {'spill B':>8} {'blocks/SM':>9} {'smem KiB':>9}")
    for k, regs, spill, blocks, smem in info:
        print(f"{k:36} {regs:9} {spill:8} {blocks if blocks is not None else '-':>9} {smem / 1024:9.1f}")
    checks = check()
    print("correctness (output error relative to its largest entry; log-sum-exp absolute error), float32 reference:")
    for k, n, e_o, e_l, ok in checks:
        print(f"  {k:36} N = {n:5}: {e_o:.1e} {e_l:.1e} {'ok' if ok else 'WRONG'}")
    shapes = SHAPES[:1] if args.quick else SHAPES
    runs = timing(shapes, repeats=args.repeats, variants_too=not args.quick)
    print(summary(runs))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"gpu": name, "kernels": info, "checks": checks, "runs": runs},
                                              indent=1, default=str))
    return 0 if all(ok for *_, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

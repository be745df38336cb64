"""Lesson 10: FlashAttention, forward and backward, in Triton.

The algorithm is the one of kernels/cuda/attention.cu (tiles of Q kept, K and V streamed, the online softmax, the
output normalised once, the log-sum-exp kept); what Triton decides for you is everything inside a block: how the
tile is spread over warps, where it sits (registers, shared memory), the tensor-core instructions of ``tl.dot``,
and the software pipeline of the loads (``num_stages``). What it does not decide is the algorithm.

Triton kernels take PyTorch tensors (CUDA tensors on a GPU; CPU tensors in Triton's interpreter,
``TRITON_INTERPRET=1``, set before triton is imported, which is how the tests run them without a GPU). The
launchers here take and give PyTorch tensors; ``from_cupy`` / ``to_cupy`` move CuPy arrays across without a copy
(DLPack).

Layout: (batch, heads, N, d), contiguous, float16 (or bfloat16); d a power of two from 16 to 128. Any N: the
last tiles are masked.
"""
from __future__ import annotations

import math

from gpucourse import runtime

LOG2E = 1.4426950408889634


def available() -> str | None:
    """None where Triton and PyTorch can run these kernels here (a GPU, or the interpreter); else why not. Asks
    without importing either (importing Triton into a process that holds TensorFlow aborts it: see ``_lib``)."""
    import importlib.util

    for name in ("torch", "triton"):
        if importlib.util.find_spec(name) is None:
            return f"Triton's kernels need triton and PyTorch, and {name} is not installed"
    return None


def _lib():
    import sys

    why = available()
    if why:
        raise runtime.CourseError(why)
    if "triton" not in sys.modules and "tensorflow" in sys.modules:
        # Both carry their own LLVM; loading the second registers LLVM's options twice and LLVM aborts the process
        # ("CommandLine Error: Option ... registered more than once!"), taking a notebook's kernel with it.
        raise runtime.CourseError("Triton cannot be loaded into a Python process that has imported TensorFlow (both "
                                  "carry LLVM, and the second one loaded aborts the process): restart the kernel, or "
                                  "run Triton's kernels in a process without TensorFlow")
    import torch
    import triton
    import triton.language as tl

    _mend_interpreter()
    return torch, triton, tl


def _mend_interpreter() -> None:
    """Triton 3.6's interpreter turns a loop bound into an int with int() of a one-element NumPy array, which NumPy
    2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"; triton-lang/triton#9171, fixed
    after 3.6). Where the interpreter runs, take the element instead. Nothing changes on a GPU."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    if getattr(interpreter, "_gpucourse_mended", False):
        return
    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch
    interpreter._gpucourse_mended = True


def kernels():
    """The @triton.jit kernels (kernels/attention/triton_jit.py), imported on first use."""
    _lib()
    from . import triton_jit

    return vars(triton_jit)


HEAD_DIMS = (16, 32, 64, 128)


def _check(q, k, v, what: str):
    torch = _lib()[0]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise runtime.CourseInputError(f"{what}: {name} must be a PyTorch tensor (from_cupy converts a CuPy array)")
    if not (q.shape == k.shape == v.shape) or q.dim() != 4:
        raise runtime.CourseInputError(f"{what}: q, k, v must be (batch, heads, N, d) of one shape, got "
                                       f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] not in HEAD_DIMS:
        raise runtime.CourseInputError(f"{what}: head dim {q.shape[-1]} is not one the kernel is built for "
                                       f"({', '.join(map(str, HEAD_DIMS))})")
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise runtime.CourseInputError(f"{what}: q, k, v must all be float16 or bfloat16, got {q.dtype}, {k.dtype}, "
                                       f"{v.dtype}")
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        raise runtime.CourseInputError(f"{what}: q, k, v must be contiguous")




def launch_forward(kernel, q, k, v, *args, scale=None, block_m: int | None = None, block_n: int | None = None,
                   o=None, lse=None, **constexprs) -> tuple:
    """Run ``kernel``, a forward of triton_jit.flash_forward's shape, on (batch, heads, N, d) tensors with fixed tiles:
    kernel[(N / BLOCK_M, batch x heads)](Q, K, V, O, LSE, scale log2 e, N, *args, HEAD_DIM, BLOCK_M, BLOCK_N, EVEN_N,
    **constexprs). Tiles of 128 x 64 keys with 8 warps and 3 stages on a GPU, 16 x 16 in the interpreter, unless
    ``block_m``/``block_n`` say others; o and lse (float32, natural log) are written where given, else made.
    Returns (o, lse)."""
    torch, triton, _ = _lib()
    _check(q, k, v, "launch_forward")
    B, H, N, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    o = torch.empty_like(q) if o is None else o
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device) if lse is None else lse
    bm, bn = block_m or (128 if q.is_cuda else 16), block_n or (64 if q.is_cuda else 16)
    extra = {"num_warps": 8, "num_stages": 3} if q.is_cuda else {}
    kernel[(triton.cdiv(N, bm), B * H)](q, k, v, o, lse, scale * LOG2E, N, *args, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn,
                                        EVEN_N=N % bn == 0, **constexprs, **extra)
    return o, lse


def flash_forward(q, k, v, *, causal: bool = False, scale=None, block_m: int | None = None,
                  block_n: int | None = None, kernel=None) -> tuple:
    """(o, lse) of attention on (batch, heads, N, d) float16 tensors; lse in float32 (natural log). On a GPU Triton's
    autotuner picks the tiles; ``block_m``/``block_n`` fix them, and ``kernel`` runs another @triton.jit kernel of
    the same signature (a notebook cell's version of triton_jit.flash_forward) with them (``launch_forward``)."""
    _check(q, k, v, "flash_forward")
    if not q.is_cuda or block_m or block_n or kernel:  # the interpreter, tiles asked for, or another kernel
        return launch_forward(kernel or kernels()["flash_forward"], q, k, v, scale=scale, block_m=block_m,
                              block_n=block_n, CAUSAL=bool(causal))
    torch, triton, _ = _lib()
    B, H, N, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    o = torch.empty_like(q)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B * H)  # noqa: E731
    kernels()["flash_forward_tuned"][grid](q, k, v, o, lse, scale * LOG2E, N, HEAD_DIM=D, CAUSAL=bool(causal),
                                           EVEN_N=N % 128 == 0)
    return o, lse


def launch_preprocess(kernel, o, do, delta=None):
    """D = rowsum(dO o O), the backward's pre-pass, on (batch, heads, N, d) tensors: ``kernel`` (one of
    triton_jit.backward_preprocess's signature) runs as kernel[(N / 64, batch x heads)](O, DO, Delta, N, HEAD_DIM,
    BLOCK_M=64); delta (float32, batch x heads x N) is written where given, else made. Returns delta."""
    torch, triton, _ = _lib()
    B, H, N, D = o.shape
    delta = torch.empty((B, H, N), dtype=torch.float32, device=o.device) if delta is None else delta
    kernel[(triton.cdiv(N, 64), B * H)](o, do, delta, N, HEAD_DIM=D, BLOCK_M=64)
    return delta


def launch_backward(dkdv, q, k, v, o, lse, do, *args, preprocess=None, scale=None, block_m: int | None = None,
                    block_n: int | None = None, dk=None, dv=None, delta=None, **constexprs) -> tuple:
    """The backward's first two kernels on (batch, heads, N, d) tensors with fixed tiles: ``preprocess`` (a kernel of
    triton_jit.backward_preprocess's signature, that one unless given) writes D through ``launch_preprocess``, then
    ``dkdv`` (one of triton_jit.backward_dkdv's) runs as dkdv[(N / BLOCK_N, batch x heads)](Q, K, V, DO, LSE, Delta,
    DK, DV, scale, N, *args, HEAD_DIM, BLOCK_M, BLOCK_N, EVEN_N, **constexprs), EVEN_N saying that N is a multiple
    of BLOCK_M. Tiles of 64 queries x 128 keys with 8 warps and 3 stages on a GPU, 16 x 16 in the interpreter,
    unless ``block_m``/``block_n`` say others; lse in float32 (natural log); dk, dv and delta (float32) are written
    where given, else made. Returns (dk, dv, delta)."""
    torch, triton, _ = _lib()
    _check(q, k, v, "launch_backward")
    B, H, N, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    delta = launch_preprocess(preprocess or kernels()["backward_preprocess"], o, do, delta)
    bm, bn = block_m or (64 if q.is_cuda else 16), block_n or (128 if q.is_cuda else 16)
    extra = {"num_warps": 8, "num_stages": 3} if q.is_cuda else {}
    dkdv[(triton.cdiv(N, bn), B * H)](q, k, v, do, lse, delta, dk, dv, scale, N, *args, HEAD_DIM=D, BLOCK_M=bm,
                                      BLOCK_N=bn, EVEN_N=N % bm == 0, **constexprs, **extra)
    return dk, dv, delta


def flash_backward(q, k, v, o, lse, do, *, causal: bool = False, scale=None) -> tuple:
    """(dq, dk, dv) from the forward's o and lse and the upstream gradient do (FlashAttention-2's backward: P
    recomputed from lse, one pass over the queries for dK and dV, one over the keys for dQ)."""
    torch, triton, _ = _lib()
    _check(q, k, v, "flash_backward")
    B, H, N, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    delta = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    do = do.contiguous()
    ks = kernels()
    if q.is_cuda:
        launch_preprocess(ks["backward_preprocess"], o, do, delta)
        dkdv_grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), B * H)  # noqa: E731
        dq_grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B * H)  # noqa: E731
        even = N % 128 == 0  # every tuned tile divides 128
        ks["backward_dkdv_tuned"][dkdv_grid](q, k, v, do, lse, delta, dk, dv, scale, N, HEAD_DIM=D, CAUSAL=bool(causal),
                                             EVEN_N=even)
        ks["backward_dq_tuned"][dq_grid](q, k, v, do, lse, delta, dq, scale, N, HEAD_DIM=D, CAUSAL=bool(causal),
                                         EVEN_N=even)
    else:
        launch_backward(ks["backward_dkdv"], q, k, v, o, lse, do, scale=scale, block_m=16, block_n=16, dk=dk, dv=dv,
                        delta=delta, CAUSAL=bool(causal))
        ks["backward_dq"][(triton.cdiv(N, 16), B * H)](q, k, v, do, lse, delta, dq, scale, N, HEAD_DIM=D,
                                                        BLOCK_M=16, BLOCK_N=16, CAUSAL=bool(causal),
                                                        EVEN_N=N % 16 == 0)
    return dq, dk, dv


def from_cupy(x):
    """A PyTorch view of a CuPy array (DLPack: no copy)."""
    return _lib()[0].from_dlpack(x)


def to_cupy(t):
    """A CuPy view of a PyTorch CUDA tensor (DLPack: no copy)."""
    return runtime.cupy().from_dlpack(t)

"""Lesson 9: FlashAttention, forward and backward, in Triton.

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
    """None where Triton and PyTorch can run these kernels here (a GPU, or the interpreter); else why not."""
    try:
        import torch  # noqa: F401
        import triton  # noqa: F401
    except ImportError as exc:
        return f"Triton's kernels need triton and PyTorch, and {exc.name} is not installed"
    return None


def _lib():
    why = available()
    if why:
        raise runtime.CourseError(why)
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


_KERNELS: dict = {}


def kernels() -> dict:
    """The @triton.jit kernels, defined on first use (triton is imported only then)."""
    if _KERNELS:
        return _KERNELS
    torch, triton, tl = _lib()

    @triton.jit
    def flash_forward(Q, K, V, O, LSE, qk_scale, N,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
        # One program per (BLOCK_M rows of Q, one batch x head). qk_scale = scale * log2(e): the exponentials are
        # exp2, and lse is turned back into a natural log at the end.
        start_m = tl.program_id(0)
        bh = tl.program_id(1)
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        base = bh.to(tl.int64) * N * HEAD_DIM
        q = tl.load(Q + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=offs_m[:, None] < N, other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of each row (log2 units)
        l_i = tl.zeros([BLOCK_M], tl.float32)                # running sum of exp2(s - m_i)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)      # running sum of exp2(s - m_i) v
        hi = N
        if CAUSAL:  # no tile above the diagonal (the keys past N, if any, are masked)
            hi = (start_m + 1) * BLOCK_M
        for start_n in range(0, hi, BLOCK_N):
            cols = start_n + offs_n
            k = tl.load(K + base + cols[:, None] * HEAD_DIM + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
            v = tl.load(V + base + cols[:, None] * HEAD_DIM + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            keep = cols[None, :] < N
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = tl.where(l_i[:, None] > 0, acc / l_safe[:, None], 0.0)
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
        tl.store(O + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=offs_m[:, None] < N)
        tl.store(LSE + bh.to(tl.int64) * N + offs_m, lse, mask=offs_m < N)

    @triton.jit
    def backward_preprocess(O, DO, Delta, N, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
        # D_i = sum_d dO_id O_id: the term every dS of row i subtracts.
        start_m = tl.program_id(0)
        bh = tl.program_id(1)
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        base = bh.to(tl.int64) * N * HEAD_DIM
        mask = offs_m[:, None] < N
        o = tl.load(O + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        do = tl.load(DO + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(Delta + bh.to(tl.int64) * N + offs_m, tl.sum(o * do, 1), mask=offs_m < N)

    @triton.jit
    def backward_dkdv(Q, K, V, DO, LSE, Delta, DK, DV, scale, N,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
        # One program per (BLOCK_N keys, one batch x head): dV and dK of those keys, summed over every query block
        # that sees them; P recomputed from the saved log-sum-exp (lesson 8's recomputation: no N x N matrix).
        start_n = tl.program_id(0)
        bh = tl.program_id(1)
        offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m0 = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        base = bh.to(tl.int64) * N * HEAD_DIM
        kv_mask = offs_n[:, None] < N
        k = tl.load(K + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=kv_mask, other=0.0)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        lo = 0
        if CAUSAL:  # queries before these keys see none of them
            lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M
        for start_m in range(lo, N, BLOCK_M):
            offs_m = start_m + offs_m0
            q_mask = offs_m[:, None] < N
            q = tl.load(Q + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(DO + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0)
            lse = tl.load(LSE + bh.to(tl.int64) * N + offs_m, mask=offs_m < N, other=0.0)
            delta = tl.load(Delta + bh.to(tl.int64) * N + offs_m, mask=offs_m < N, other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale  # (BLOCK_M, BLOCK_N)
            keep = (offs_m[:, None] < N) & (offs_n[None, :] < N)
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(keep, tl.exp2((s - lse[:, None]) * 1.4426950408889634), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        tl.store(DK + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
                 mask=kv_mask)
        tl.store(DV + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def backward_dq(Q, K, V, DO, LSE, Delta, DQ, scale, N,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
        # One program per (BLOCK_M queries, one batch x head): dQ = sum over key blocks of dS K * scale.
        start_m = tl.program_id(0)
        bh = tl.program_id(1)
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        base = bh.to(tl.int64) * N * HEAD_DIM
        q_mask = offs_m[:, None] < N
        q = tl.load(Q + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0)
        do = tl.load(DO + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0)
        lse = tl.load(LSE + bh.to(tl.int64) * N + offs_m, mask=offs_m < N, other=0.0)
        delta = tl.load(Delta + bh.to(tl.int64) * N + offs_m, mask=offs_m < N, other=0.0)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        hi = N
        if CAUSAL:
            hi = (start_m + 1) * BLOCK_M
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            kv_mask = offs_n[:, None] < N
            k = tl.load(K + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(V + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            keep = (offs_m[:, None] < N) & (offs_n[None, :] < N)
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(keep, tl.exp2((s - lse[:, None]) * 1.4426950408889634), 0.0)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
        tl.store(DQ + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
                 mask=q_mask)

    _KERNELS.update(flash_forward=flash_forward, backward_preprocess=backward_preprocess,
                    backward_dkdv=backward_dkdv, backward_dq=backward_dq)
    return _KERNELS


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


def _blocks(d: int, n: int, on_gpu: bool) -> tuple:
    if not on_gpu:  # the interpreter: small tiles, fast enough on a CPU
        return 16, 16, 1, 1
    return (128, 64, 4, 3) if d <= 64 else (128, 64, 8, 2)  # BLOCK_M, BLOCK_N, warps, stages (tuned on an H100)


def flash_forward(q, k, v, *, causal: bool = False, scale=None, block_m: int | None = None,
                  block_n: int | None = None) -> tuple:
    """(o, lse) of attention on (batch, heads, N, d) float16 tensors; lse in float32 (natural log)."""
    torch, triton, _ = _lib()
    _check(q, k, v, "flash_forward")
    B, H, N, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    bm, bn, warps, stages = _blocks(D, N, q.is_cuda)
    bm, bn = block_m or bm, block_n or bn
    o = torch.empty_like(q)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(N, bm), B * H)
    extra = {"num_warps": warps, "num_stages": stages} if q.is_cuda else {}
    kernels()["flash_forward"][grid](q, k, v, o, lse, scale * LOG2E, N, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn,
                                     CAUSAL=bool(causal), **extra)
    return o, lse


def flash_backward(q, k, v, o, lse, do, *, causal: bool = False, scale=None) -> tuple:
    """(dq, dk, dv) from the forward's o and lse and the upstream gradient do (FlashAttention-2's backward: P
    recomputed from lse, one pass over the queries for dK and dV, one over the keys for dQ)."""
    torch, triton, _ = _lib()
    _check(q, k, v, "flash_backward")
    B, H, N, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    bm, bn, warps, stages = _blocks(D, N, q.is_cuda)
    if q.is_cuda:
        bm, bn = 64, 64
    delta = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    extra = {"num_warps": 4 if D <= 64 else 8, "num_stages": 2} if q.is_cuda else {}
    ks = kernels()
    ks["backward_preprocess"][(triton.cdiv(N, bm), B * H)](o, do.contiguous(), delta, N, HEAD_DIM=D, BLOCK_M=bm)
    ks["backward_dkdv"][(triton.cdiv(N, bn), B * H)](q, k, v, do.contiguous(), lse, delta, dk, dv, scale, N,
                                                      HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=bool(causal), **extra)
    ks["backward_dq"][(triton.cdiv(N, bm), B * H)](q, k, v, do.contiguous(), lse, delta, dq, scale, N,
                                                    HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=bool(causal), **extra)
    return dq, dk, dv


def from_cupy(x):
    """A PyTorch view of a CuPy array (DLPack: no copy)."""
    return _lib()[0].from_dlpack(x)


def to_cupy(t):
    """A CuPy view of a PyTorch CUDA tensor (DLPack: no copy)."""
    return runtime.cupy().from_dlpack(t)

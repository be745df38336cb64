"""Lesson 10, attention the naive way: S = Q K^T by cuBLAS (CuPy's matmul), the row softmax of kernels/cuda/attention.cu
into P, then O = P V. S and P are B x H x N x N each: their memory and their trips through memory grow as N^2."""
from __future__ import annotations

import math

from gpucourse import runtime

from .row_softmax import MAX_ROW, softmax_cuda_c
from .specs import check_qkv


def naive_bytes(batch: int, heads: int, n: int, itemsize: int = 2) -> int:
    """Bytes of device memory S and P take (both in the inputs' precision)."""
    return 2 * batch * heads * n * n * itemsize


def check_fits(batch: int, heads: int, n: int, itemsize: int = 2, *, headroom: float = 0.9) -> None:
    """Refuse, with the numbers, an N whose S and P would not fit in this GPU's free memory (before allocating)."""
    cp = runtime.cupy()
    free, total = cp.cuda.runtime.memGetInfo()
    free += cp.get_default_memory_pool().free_bytes()  # blocks CuPy holds but nothing uses
    need = naive_bytes(batch, heads, n, itemsize)
    if need > headroom * free:
        raise runtime.CourseError(f"naive attention at N = {n:,} needs {need / 2**30:.1f} GiB for S and P "
                                  f"({batch} x {heads} x {n:,} x {n:,} x 2 matrices of {itemsize} bytes), and this GPU "
                                  f"has {free / 2**30:.1f} GiB free of {total / 2**30:.0f}: FlashAttention never stores them")


def naive_attention(q, k, v, *, causal: bool = False, scale=None) -> tuple:
    """O = softmax(Q K^T * scale) V for CuPy float16 arrays (batch, heads, N, d), S and P kept whole in memory;
    returns (o, p). Refuses an N whose S and P do not fit (``check_fits``)."""
    cp = runtime.cupy()
    B, H, N, D = check_qkv(q, k, v, "naive_attention")
    check_fits(B, H, N, q.dtype.itemsize)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    q4, k4, v4 = (x.reshape(B, H, N, D) for x in (q, k, v))
    try:
        s = cp.empty((B, H, N, N), dtype=q.dtype)
        p = cp.empty_like(s)
        o = cp.empty_like(q4)
        for b in range(B):  # one 2-D GEMM a head: cuBLAS in FP16 (CuPy's batched matmul would work in FP32 copies)
            for h in range(H):
                cp.matmul(q4[b, h], k4[b, h].T, out=s[b, h])
    except cp.cuda.memory.OutOfMemoryError as exc:  # what check_fits could not see (the pool's own layout)
        raise runtime.CourseError(f"naive attention at N = {N:,} ran out of GPU memory for S and P "
                                  f"({naive_bytes(B, H, N, q.dtype.itemsize) / 2**30:.1f} GiB): {exc}") from None
    s *= scale
    if causal:
        s[..., cp.triu(cp.ones((N, N), dtype=bool), 1)] = -cp.inf
    rows = s.reshape(-1, N)
    kernel = "online" if N % (16 // s.itemsize) == 0 and N <= MAX_ROW else "three_pass"
    softmax_cuda_c(rows, p.reshape(-1, N), kernel)
    del s, rows
    for b in range(B):
        for h in range(H):
            cp.matmul(p[b, h], v4[b, h], out=o[b, h])
    return o.reshape(q.shape), p

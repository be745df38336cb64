"""Lesson 10's Triton kernels: FlashAttention's forward pass and FlashAttention-2's backward pass, as @triton.jit
functions (imported only where triton is installed; kernels/attention/triton_kernels.py launches them)."""
import triton
import triton.language as tl



@triton.jit
def forward_tiles(acc, l_i, m_i, q, K, V, base, offs_m, offs_n, offs_d, lo, hi, N, qk_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr, EVEN_N: tl.constexpr):
    # The online softmax over the key tiles lo .. hi: per tile, S = Q K^T, the new running max, P = exp2(S - max),
    # the old sums and output rescaled by exp2(old max - new max), then O += P V. Only the diagonal tile of a causal
    # mask, and the last tile where N is not a multiple of BLOCK_N, pay for masks.
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if EVEN_N:
            k = tl.load(K + base + cols[:, None] * HEAD_DIM + offs_d[None, :])
            v = tl.load(V + base + cols[:, None] * HEAD_DIM + offs_d[None, :])
        else:
            k = tl.load(K + base + cols[:, None] * HEAD_DIM + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
            v = tl.load(V + base + cols[:, None] * HEAD_DIM + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if DIAGONAL:
            s = tl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
        if not EVEN_N:
            s = tl.where(cols[None, :] < N, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)  # 0 for the first tile (m_i = -inf)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i

@triton.jit
def flash_forward(Q, K, V, O, LSE, qk_scale, N,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  EVEN_N: tl.constexpr):
    # One program per (BLOCK_M rows of Q, one batch x head). qk_scale = scale * log2(e): the exponentials are
    # exp2, and lse is turned back into a natural log at the end. Every row sees at least one key (causal: its
    # own), so no row's max stays -inf.
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
    if CAUSAL:  # the tiles below the diagonal whole, then the diagonal tile masked; none above it
        acc, l_i, m_i = forward_tiles(acc, l_i, m_i, q, K, V, base, offs_m, offs_n, offs_d, 0, start_m * BLOCK_M,
                                      N, qk_scale, HEAD_DIM, BLOCK_N, False, EVEN_N)
        acc, l_i, m_i = forward_tiles(acc, l_i, m_i, q, K, V, base, offs_m, offs_n, offs_d, start_m * BLOCK_M,
                                      (start_m + 1) * BLOCK_M, N, qk_scale, HEAD_DIM, BLOCK_N, True, EVEN_N)
    else:
        acc, l_i, m_i = forward_tiles(acc, l_i, m_i, q, K, V, base, offs_m, offs_n, offs_d, 0, N, N, qk_scale,
                                      HEAD_DIM, BLOCK_N, False, EVEN_N)
    out = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) / 1.4426950408889634
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
def dkdv_tiles(dk, dv, k, v, Q, DO, LSE, Delta, base, row, offs_n, offs_m0, offs_d, lo, hi, N, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr, EVEN_N: tl.constexpr):
    # dK and dV of BLOCK_N keys over the query tiles lo .. hi, computed transposed: S^T = K Q^T, so that P^T and
    # dS^T come out of their GEMM already as the A operand of the next one (dV += P^T dO, dK += dS^T Q), with no
    # transpose of a tile in registers (Q^T and dO^T are loads, read as the GEMM needs them). Only the tiles on the
    # causal diagonal (MASK) and the last one where N is not a multiple of BLOCK_M pay for masks.
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        if EVEN_N:
            qT = tl.load(Q + base + offs_m[None, :] * HEAD_DIM + offs_d[:, None])
            do = tl.load(DO + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
            lse = tl.load(LSE + row + offs_m)
            delta = tl.load(Delta + row + offs_m)
        else:
            qT = tl.load(Q + base + offs_m[None, :] * HEAD_DIM + offs_d[:, None], mask=offs_m[None, :] < N, other=0.0)
            do = tl.load(DO + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=offs_m[:, None] < N,
                         other=0.0)
            lse = tl.load(LSE + row + offs_m, mask=offs_m < N, other=0.0)
            delta = tl.load(Delta + row + offs_m, mask=offs_m < N, other=0.0)
        # P^T = exp2(S^T scale log2(e) - lse log2(e)): one FMA and one exp2 an element
        pT = tl.exp2(tl.dot(k, qT) * qk_scale - lse[None, :] * 1.4426950408889634)
        if MASK:
            pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        if not EVEN_N:
            pT = tl.where(offs_m[None, :] < N, pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT))
    return dk, dv


@triton.jit
def backward_dkdv(Q, K, V, DO, LSE, Delta, DK, DV, scale, N,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  EVEN_N: tl.constexpr):
    # One program per (BLOCK_N keys, one batch x head): dV and dK of those keys, summed over every query tile
    # that sees them; P recomputed from the saved log-sum-exp (lesson 9's recomputation: no N x N matrix).
    start_n = tl.program_id(0)
    bh = tl.program_id(1)
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    base = bh.to(tl.int64) * N * HEAD_DIM
    row = bh.to(tl.int64) * N
    kv_mask = offs_n[:, None] < N
    k = tl.load(K + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    qk_scale = scale * 1.4426950408889634
    if CAUSAL:  # queries before these keys see none of them; the tiles that cross the diagonal masked, then the rest
        lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M
        mid = tl.minimum(((start_n + 1) * BLOCK_N + BLOCK_M - 1) // BLOCK_M * BLOCK_M, N)
        dk, dv = dkdv_tiles(dk, dv, k, v, Q, DO, LSE, Delta, base, row, offs_n, offs_m0, offs_d, lo, mid, N,
                            qk_scale, HEAD_DIM, BLOCK_M, True, EVEN_N)
        dk, dv = dkdv_tiles(dk, dv, k, v, Q, DO, LSE, Delta, base, row, offs_n, offs_m0, offs_d, mid, N, N,
                            qk_scale, HEAD_DIM, BLOCK_M, False, EVEN_N)
    else:
        dk, dv = dkdv_tiles(dk, dv, k, v, Q, DO, LSE, Delta, base, row, offs_n, offs_m0, offs_d, 0, N, N,
                            qk_scale, HEAD_DIM, BLOCK_M, False, EVEN_N)
    tl.store(DK + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(DV + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)

@triton.jit
def dq_tiles(dq, q, do, lse, delta, K, V, base, offs_m, offs_n0, offs_d, lo, hi, N, qk_scale,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, EVEN_N: tl.constexpr):
    # dQ of BLOCK_M queries over the key tiles lo .. hi: K^T and V^T loaded as the GEMMs read them.
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        if EVEN_N:
            kT = tl.load(K + base + offs_n[None, :] * HEAD_DIM + offs_d[:, None])
            vT = tl.load(V + base + offs_n[None, :] * HEAD_DIM + offs_d[:, None])
        else:
            kT = tl.load(K + base + offs_n[None, :] * HEAD_DIM + offs_d[:, None], mask=offs_n[None, :] < N, other=0.0)
            vT = tl.load(V + base + offs_n[None, :] * HEAD_DIM + offs_d[:, None], mask=offs_n[None, :] < N, other=0.0)
        p = tl.exp2(tl.dot(q, kT) * qk_scale - lse[:, None] * 1.4426950408889634)
        if MASK:
            p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
        if not EVEN_N:
            p = tl.where(offs_n[None, :] < N, p, 0.0)
        dp = tl.dot(do, vT)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT))
    return dq


@triton.jit
def backward_dq(Q, K, V, DO, LSE, Delta, DQ, scale, N,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                EVEN_N: tl.constexpr):
    # One program per (BLOCK_M queries, one batch x head): dQ = sum over key tiles of dS K * scale. The last query
    # tile first: with a causal mask it sees the most keys, and started last it would run on alone at the end.
    start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    base = bh.to(tl.int64) * N * HEAD_DIM
    row = bh.to(tl.int64) * N
    q_mask = offs_m[:, None] < N
    q = tl.load(Q + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + row + offs_m, mask=offs_m < N, other=0.0)
    delta = tl.load(Delta + row + offs_m, mask=offs_m < N, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk_scale = scale * 1.4426950408889634
    if CAUSAL:  # the key tiles wholly at or below these queries' first, then those that cross the diagonal masked
        mid = (start_m * BLOCK_M // BLOCK_N) * BLOCK_N
        hi = tl.minimum((start_m + 1) * BLOCK_M, N)
        dq = dq_tiles(dq, q, do, lse, delta, K, V, base, offs_m, offs_n0, offs_d, 0, mid, N, qk_scale, HEAD_DIM,
                      BLOCK_N, False, EVEN_N)
        dq = dq_tiles(dq, q, do, lse, delta, K, V, base, offs_m, offs_n0, offs_d, mid, hi, N, qk_scale, HEAD_DIM,
                      BLOCK_N, True, EVEN_N)
    else:
        dq = dq_tiles(dq, q, do, lse, delta, K, V, base, offs_m, offs_n0, offs_d, 0, N, N, qk_scale, HEAD_DIM,
                      BLOCK_N, False, EVEN_N)
    tl.store(DQ + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=q_mask)




# On a GPU Triton times a few tile shapes the first time each shape of problem comes, and keeps the fastest (one of the
# things it decides for you); the interpreter runs fixed small tiles instead (triton_kernels.py).
FORWARD_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
                   for bm, bn, w, st in ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                                         (128, 32, 4, 4))]
# dK, dV: a program keeps BLOCK_N keys' dK and dV (two BLOCK_N x d FP32 tiles) and streams the queries, BLOCK_M at a
# time; dQ: BLOCK_M queries' dQ, the keys streamed BLOCK_N at a time
DKDV_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
                for bm, bn, w, st in ((32, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3), (128, 128, 8, 2),
                                      (32, 128, 4, 4), (64, 64, 4, 3), (32, 64, 4, 4), (16, 128, 8, 4))]
DQ_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
              for bm, bn, w, st in ((128, 32, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 4, 4),
                                    (64, 64, 4, 3), (64, 32, 4, 4), (128, 16, 8, 4))]
flash_forward_tuned = triton.autotune(FORWARD_CONFIGS, key=["N", "HEAD_DIM", "CAUSAL"])(flash_forward)
backward_dkdv_tuned = triton.autotune(DKDV_CONFIGS, key=["N", "HEAD_DIM", "CAUSAL"])(backward_dkdv)
backward_dq_tuned = triton.autotune(DQ_CONFIGS, key=["N", "HEAD_DIM", "CAUSAL"])(backward_dq)

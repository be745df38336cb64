"""Lesson 9's Triton kernels: FlashAttention's forward pass and FlashAttention-2's backward pass, as @triton.jit
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




# On a GPU Triton times a few tile shapes the first time each shape of problem comes, and keeps the fastest (one of the
# things it decides for you); the interpreter runs fixed small tiles instead (triton_kernels.py).
FORWARD_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
                   for bm, bn, w, st in ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                                         (128, 32, 4, 4))]
BACKWARD_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
                    for bm, bn, w, st in ((64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (32, 64, 4, 3))]
flash_forward_tuned = triton.autotune(FORWARD_CONFIGS, key=["N", "HEAD_DIM", "CAUSAL"])(flash_forward)
backward_dkdv_tuned = triton.autotune(BACKWARD_CONFIGS, key=["N", "HEAD_DIM", "CAUSAL"])(backward_dkdv)
backward_dq_tuned = triton.autotune(BACKWARD_CONFIGS, key=["N", "HEAD_DIM", "CAUSAL"])(backward_dq)

// gpucourse-arch: sm_90a
// Lesson 10, the Hopper step: FlashAttention's forward pass on warpgroup MMA (wgmma.mma_async), fed by the Tensor
// Memory Accelerator, in FlashAttention-3's shape (Shah et al., 2024). Launched by kernels/attention/flash.py
// (flash_wgmma).
//
// Q, K, V, O: (batch x heads) x N x D, FP16, row-major; LSE: (batch x heads) x N, FP32 (natural log). D is 64 or
// 128; N a multiple of 128 (the launcher refuses others). A block computes BM = 128 rows of O of one head at a
// time (a work item) with three warpgroups of 128 threads, and stays on its SM for item after item (persistent):
//   * warpgroup 0 is the PRODUCER: one thread asks the TMA for an item's Q tile, then for K's and V's tiles of
//     BN = 128 keys into a ring of STAGES stages, each with its own "K full", "V full" and "empty" mbarrier; the
//     copy engine writes them in the 128-byte swizzle the MMAs read. It never computes.
//   * warpgroups 1 and 2 are CONSUMERS, 64 rows of Q each: S = Q K^T (wgmma, both operands in shared memory),
//     the online softmax on S in registers, then O += P V (wgmma with P as the A operand straight from
//     registers: the accumulator's layout of S is the A operand's layout of P, so P never touches shared memory).
// In the AHEAD variant a consumer issues S(t+1) right behind P(t) V(t) and waits once for both. In the PIPELINED
// variant a consumer issues S(t) = Q K(t)^T and O += P(t-1) V(t-1) together and does the
// softmax of tile t while the tensor cores still work on P(t-1) V(t-1) (FlashAttention-3's intra-warpgroup
// overlap); with PINGPONG the two consumers also take turns at the tensor cores (named barriers), so that one's
// softmax runs while the other's GEMMs do. QREGS (the "qregs" variant) is ping-pong with Q in registers: each
// consumer copies its 64 rows of Q from shared memory once an item (load_q), and S = Q K^T becomes a wgmma with its
// A operand in registers, as P V's is, so the tensor cores read only K's tile for it (at N >= 4k on an H100 and an
// H200: 2% faster than ping-pong causal, 0-6% full). Causal: tiles wholly above the diagonal are never loaded, the
// diagonal tile is masked, and the items with the most tiles are taken first (see item_of).
//
// Compiled for any architecture other than sm_90a the kernels are stubs that trap (tests/test_gpu_archs.py).
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include "hopper.cuh"
#include "flash_hopper.cuh"
#include "fast_math.cuh"
#include "mma_sync.cuh"

namespace hopper {

#ifdef GPUCOURSE_WGMMA
// What the two consumers' threads know of their rows: the running max m (log2 units, scaled), and the running
// sum l of this thread's own columns (the four threads of a row add theirs together only at the end).
struct RowState {
  float m[2], l[2];
};

// region: flash_wgmma_softmax
// The online softmax of one 64 x BN tile of scores S held as wgmma accumulators. Thread (warp w, lane) holds rows
// r = 16w + lane/4 (h = 0) and r + 8 (h = 1); element e of column block j is row h = (e / 2) % 2, column
// 16j + 8 (e / 4) + 2 (lane % 4) + e % 2. In two steps (the FP8 kernel calls them itself, with a bias, and takes
// the row sums from the tensor cores instead):
// softmax_max masks the keys past the diagonal when ``diag`` (causal), updates the running max and returns the
// factor alpha[h] by which the output's rows must be scaled to the new max; softmax_exps overwrites S with
// exp2(S scale - m + bias) and, with SUM, adds it to the running sum (bias 0: P itself; the FP8 kernel's 8 gives P
// times 256 for free).
template <int BN>
__device__ __forceinline__ void softmax_max(float (&s)[BN / 16][8], RowState& st, float (&alpha)[2], float scale_log2,
                                            bool diag, int row0, int key0) {
  const int lane = threadIdx.x % 32;
  if (diag) {  // keys past the row are not seen: -inf
#pragma unroll
    for (int j = 0; j < BN / 16; ++j)
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int row = row0 + 8 * ((e >> 1) & 1), key = key0 + 16 * j + 8 * (e >> 2) + 2 * (lane % 4) + (e & 1);
        if (key > row) s[j][e] = __int_as_float(0xff800000);
      }
  }
  // Each row's max in four independent running maxima (column blocks j % 4), then combined: one chain of BN / 4
  // dependent fmaxf a row would make every step wait for the last.
  float mx4[2][4];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int c = 0; c < 4; ++c) mx4[h][c] = __int_as_float(0xff800000);
#pragma unroll
  for (int j = 0; j < BN / 16; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) mx4[(e >> 1) & 1][j % 4] = fmaxf(mx4[(e >> 1) & 1][j % 4], s[j][e]);
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // the row's four threads agree on its max
    float mx = fmaxf(fmaxf(mx4[h][0], mx4[h][1]), fmaxf(mx4[h][2], mx4[h][3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
    const float m_new = fmaxf(st.m[h], mx * scale_log2);
    alpha[h] = ex2(st.m[h] - m_new);  // 0 on a row's first tile (m = -inf)
    st.m[h] = m_new;
    st.l[h] *= alpha[h];
  }
}

template <int BN, bool SUM = true>
__device__ __forceinline__ void softmax_exps(float (&s)[BN / 16][8], RowState& st, float scale_log2,
                                             float bias = 0.0f) {
  const float mb[2] = {st.m[0] - bias, st.m[1] - bias};
#pragma unroll
  for (int j = 0; j < BN / 16; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int h = (e >> 1) & 1;
      const float x = fmaf(s[j][e], scale_log2, -mb[h]);
      s[j][e] = ex2(x);
      if (SUM) st.l[h] += s[j][e];
    }
}

template <int BN>
__device__ __forceinline__ void online_softmax(float (&s)[BN / 16][8], RowState& st, float (&alpha)[2],
                                               float scale_log2, bool diag, int row0, int key0) {
  softmax_max<BN>(s, st, alpha, scale_log2, diag, row0, key0);
  softmax_exps<BN>(s, st, scale_log2);
}

// P as wgmma's A operand: register i of block j holds elements 2i and 2i + 1 of the accumulator's block j, as two
// FP16 (the accumulator's places are the A operand's places, so no thread exchanges anything).
template <int BN>
__device__ __forceinline__ void to_operand(const float (&s)[BN / 16][8], unsigned (&p)[BN / 16][4]) {
#pragma unroll
  for (int j = 0; j < BN / 16; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) p[j][i] = half2_bits(s[j][2 * i], s[j][2 * i + 1]);
}
// endregion

template <int D, int BN>
__device__ __forceinline__ void scale_rows(float (&o)[D / 16][8], const float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < D / 16; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) o[j][e] *= alpha[(e >> 1) & 1];
}

// O += P V: BN / 16 wgmmas of k = 16 (16 keys each), P from registers, V's tile MN-major (a key's D values are
// contiguous): k steps 16 rows of 128 bytes; the next 64 columns of V are the next box, BN * 128 bytes on.
template <int D, int BN>
__device__ __forceinline__ void issue_pv(float (&o)[D / 16][8], const unsigned (&p)[BN / 16][4], unsigned v_addr) {
#pragma unroll
  for (int j = 0; j < BN / 16; ++j) wgmma_rs<D, 1>(o, p[j], make_desc(v_addr + j * 16 * 128, BN * 128, 1024));
}

// QREGS: this consumer's 64 rows of Q as wgmma's A operand in registers (D / 2 a thread), read once an item by
// ldmatrix from Q's tile in the TMA's 128-byte swizzle (the 16-byte chunk x of row r sits at chunk x ^ (r % 8)).
// k step kk is four 8 x 8 matrices: rows 0-7 and 8-15 of the warp's 16, columns 16kk .. + 7 and 16kk + 8 .. + 15,
// in the places of an accumulator's 16 columns (the same places as P's, see to_operand).
template <int D, int BM>
__device__ __forceinline__ void load_q(unsigned (&qa)[D / 16][4], unsigned q_tile, int c, int warp, int lane) {
  const int row = 64 * c + 16 * warp + lane % 8 + 8 * ((lane / 8) % 2);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int chunk = 2 * (kk % 4) + lane / 16;
    ldmatrix_x4(qa[kk], q_tile + (kk / 4) * BM * 128 + row * 128 + ((chunk ^ (lane % 8)) << 4));
  }
}

// S = Q K^T with Q from registers: the tensor cores read only K's tile from shared memory.
template <int D, int BN>
__device__ __forceinline__ void issue_scores_rs(float (&s)[BN / 16][8], const unsigned (&qa)[D / 16][4],
                                                unsigned k_addr) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) wgmma_rs<BN, 0>(s, qa[kk], k_step_desc<BN>(k_addr, kk), kk > 0);
}
#endif  // GPUCOURSE_WGMMA

// region: flash_wgmma
// MODE 0: attention. Two probes for tests of the parts: MODE 1 writes S = Q K^T of the first tile as O (D = BN);
// MODE 2 writes O = sum over tiles of (Q K^T) V, P = S without the softmax.
// Persistent: a block per SM takes work items (128 rows of a head) in order: its first is blockIdx.x, each next one
// it claims from the counter *next_item (zero at launch) as it starts this one, so a block that drew short items
// takes more. Causal items range from 1 tile to N / 128, and the order is longest first across heads, not within
// each head: else the last head's longest item starts when the other SMs have little left, and they wait for it
// (3% of the time at N = 4k and 16k on an H100). The heads go in sections of `section` (flash.py's wgmma_section:
// enough heads that their work outlasts their longest item, few enough that the L2 keeps their K and V), and a
// section's items row block by row block, from the last (N / 128 tiles) to the first (one tile).
// The producer hands each item's number to the consumers in shared memory with its Q (-1: no more). The ring of K
// and V stages and its phases run on across items (g counts the block's tiles), so the producer loads the next
// item's Q, K and V while the consumers finish this one and write its output.
template <int D, int BN, int STAGES, bool CAUSAL, bool PIPELINED, bool PINGPONG, bool AHEAD, bool QREGS, int MODE>
__device__ __forceinline__ void flash_wgmma(const TensorMap* tmQ, const TensorMap* tmK, const TensorMap* tmV,
                                            half* __restrict__ O, float* __restrict__ LSE, int* next_item, int N,
                                            int heads, int section, float scale_log2) {
#ifdef GPUCOURSE_WGMMA
  constexpr int BM = 128;
  static_assert(BN == 64 || BN == 128, "tiles of 64 or 128 keys");
  constexpr unsigned Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);  // the swizzle's 1024-byte period
  unsigned char* sQ = smem;                          // D/64 boxes of [BM][64]
  unsigned char* sK = sQ + Q_BYTES;                  // STAGES x D/64 boxes of [BN][64]
  unsigned char* sV = sK + STAGES * KV_BYTES;        // the same for V
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(sV + STAGES * KV_BYTES);
  unsigned long long *q_full = bars, *q_empty = bars + 1, *k_full = bars + 2, *v_full = k_full + STAGES,
                     *empty = v_full + STAGES;
  volatile int* item_slot = reinterpret_cast<volatile int*>(empty + STAGES);  // the item Q is loaded for

  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int blocks_m = N / BM, items = blocks_m * heads;
  // item i: its head and first row (not causal: head i / blocks_m, row block i % blocks_m); its key tiles
  auto item_of = [&](int i) {
    if (!CAUSAL) return make_int2(i / blocks_m, i % blocks_m * BM);
    const int first = i / (section * blocks_m) * section, in_section = min(section, heads - first);
    const int j = i - first * blocks_m;  // the item's place in its section
    return make_int2(first + j % in_section, (blocks_m - 1 - j / in_section) * BM);
  };
  auto tiles_of = [&](int m0) { return CAUSAL ? (m0 + BM) / BN : N / BN; };  // causal: none past row m0 + BM - 1
  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);
    mbar_init(q_empty, 2);  // one arrival per consumer warpgroup: done with Q
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&k_full[s], 1);
      mbar_init(&v_full[s], 1);
      mbar_init(&empty[s], 2);  // one arrival per consumer warpgroup
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // ------------------------------------------------------------------ producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    if (tid == 0) {
      int g = 0, i = blockIdx.x;  // the block's tiles so far; its item
      for (int k = 0;; ++k) {
        if (k > 0) mbar_wait(q_empty, (k - 1) & 1);  // both consumers have issued their last Q K^T (and read the slot)
        *item_slot = i < items ? i : -1;
        if (i >= items) {
          mbar_arrive(q_full);  // no more: the consumers read -1
          break;
        }
        const int2 item = item_of(i);
        const int m0 = item.y, head_row = item.x * N, tiles = tiles_of(m0);
        mbar_expect_tx(q_full, Q_BYTES);
        for (int c = 0; c < D / 64; ++c) tma_load_2d(sQ + c * BM * 128, tmQ, q_full, 64 * c, head_row + m0);
        const int next = atomicAdd(next_item, 1) + gridDim.x;  // claimed now, used when this item's loads are issued
        for (int t = 0; t < tiles; ++t, ++g) {
          const int s = g % STAGES;
          if (g >= STAGES) mbar_wait(&empty[s], ((g / STAGES) + 1) & 1);  // both consumers are done with it
          mbar_expect_tx(&k_full[s], KV_BYTES);
          for (int c = 0; c < D / 64; ++c)
            tma_load_2d(sK + s * KV_BYTES + c * BN * 128, tmK, &k_full[s], 64 * c, head_row + t * BN);
          mbar_expect_tx(&v_full[s], KV_BYTES);
          for (int c = 0; c < D / 64; ++c)
            tma_load_2d(sV + s * KV_BYTES + c * BN * 128, tmV, &v_full[s], 64 * c, head_row + t * BN);
        }
        i = next;
      }
    }
  } else {  // ---------------------------------------------------------------------- consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
    const int c = wg - 1, warp = tid / 32, lane = tid % 32;
    const unsigned q_addr = smem_addr(sQ) + c * 64 * 128;
    int g = 0;
    for (int k = 0;; ++k) {
      mbar_wait(q_full, k & 1);
      const int i = *item_slot;
      if (i < 0) break;
      const int2 item = item_of(i);
      const int m0 = item.y, head_row = item.x * N, tiles = tiles_of(m0);
      const int row0 = m0 + 64 * c + 16 * warp + lane / 4;  // this thread's rows: row0 and row0 + 8 (in the head)
      auto stage = [&](int t) { return (g + t) % STAGES; };
      auto phase = [&](int t) { return static_cast<unsigned>(((g + t) / STAGES) & 1); };
      auto q_done = [&]() { if (tid == 0) mbar_arrive(q_empty); };  // the item's last Q K^T has completed
      float o[D / 16][8];
#pragma unroll
      for (int j = 0; j < D / 16; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) o[j][e] = 0.0f;
      RowState st = {{__int_as_float(0xff800000), __int_as_float(0xff800000)}, {0.0f, 0.0f}};
      float s[BN / 16][8], alpha[2];
      unsigned p[BN / 16][4];

      if constexpr (MODE == 0 && PIPELINED) {
        // tile 0: S, then its softmax; each later tile t: S(t) and P(t-1) V(t-1) issued together, the softmax of
        // S(t) while P(t-1) V(t-1) runs, then O rescaled and P(t) made for the next round. PINGPONG: consumer 0
        // issues first; each consumer, having issued, lets the other issue (named barriers 1 and 2).
        const int mine = 1 + c, other = 2 - c;
        unsigned qa[QREGS ? D / 16 : 1][4];  // QREGS: this consumer's rows of Q, copied once an item
        if constexpr (QREGS) load_q<D, BM>(qa, smem_addr(sQ), c, warp, lane);
        auto scores = [&](unsigned k_addr) {
          if constexpr (QREGS) issue_scores_rs<D, BN>(s, qa, k_addr);
          else issue_scores<D, BM, BN>(s, q_addr, k_addr);
        };
        mbar_wait(&k_full[stage(0)], phase(0));
        if (PINGPONG && c == 1) named_sync(mine, 256);
        wgmma_fence();
        scores(smem_addr(sK + stage(0) * KV_BYTES));
        wgmma_commit();
        if (PINGPONG) named_arrive(other, 256);
        wgmma_wait<0>();
        pin(s);
        if (tiles == 1) q_done();
        online_softmax<BN>(s, st, alpha, scale_log2, CAUSAL && BN > m0, row0, 0);
        to_operand<BN>(s, p);
        for (int t = 1; t < tiles; ++t) {
          const int sc = stage(t), sp = stage(t - 1);
          mbar_wait(&k_full[sc], phase(t));
          mbar_wait(&v_full[sp], phase(t - 1));
          if (PINGPONG) named_sync(mine, 256);
          wgmma_fence();
          scores(smem_addr(sK + sc * KV_BYTES));
          wgmma_commit();
          issue_pv<D, BN>(o, p, smem_addr(sV + sp * KV_BYTES));
          wgmma_commit();
          if (PINGPONG) named_arrive(other, 256);
          wgmma_wait<1>();  // S(t) has landed; P(t-1) V(t-1) may still run
          pin(s);
          if (t == tiles - 1) q_done();
          online_softmax<BN>(s, st, alpha, scale_log2, CAUSAL && t * BN + BN > m0, row0, t * BN);
          wgmma_wait<0>();
          pin(o);
          pin(p);
          if (tid == 0) mbar_arrive(&empty[sp]);  // K(t-1) and V(t-1) are no longer read
          scale_rows<D, BN>(o, alpha);
          to_operand<BN>(s, p);
        }
        if (PINGPONG && c == 0) named_sync(mine, 256);  // consumer 1's last turn-giving
        const int sl = stage(tiles - 1);
        mbar_wait(&v_full[sl], phase(tiles - 1));
        wgmma_fence();
        issue_pv<D, BN>(o, p, smem_addr(sV + sl * KV_BYTES));
        wgmma_commit();
        wgmma_wait<0>();
        pin(o);
        pin(p);
        if (tid == 0) mbar_arrive(&empty[sl]);
      } else if constexpr (MODE == 0 && AHEAD) {
        // S of the next tile issued right behind P V of this one, one wait for both: the tensor cores get the two
        // GEMMs back to back, and no register is needed beyond the serial order's (S is free once P is made)
        mbar_wait(&k_full[stage(0)], phase(0));
        wgmma_fence();
        issue_scores<D, BM, BN>(s, q_addr, smem_addr(sK + stage(0) * KV_BYTES));
        wgmma_commit();
        wgmma_wait<0>();
        pin(s);
        if (tiles == 1) q_done();
        online_softmax<BN>(s, st, alpha, scale_log2, CAUSAL && BN > m0, row0, 0);
        to_operand<BN>(s, p);
        for (int t = 0; t < tiles; ++t) {
          const int sc = stage(t), sn = stage(t + 1);
          mbar_wait(&v_full[sc], phase(t));
          wgmma_fence();
          issue_pv<D, BN>(o, p, smem_addr(sV + sc * KV_BYTES));
          wgmma_commit();
          const bool more = t + 1 < tiles;
          if (more) {
            mbar_wait(&k_full[sn], phase(t + 1));
            wgmma_fence();
            issue_scores<D, BM, BN>(s, q_addr, smem_addr(sK + sn * KV_BYTES));
            wgmma_commit();
          }
          wgmma_wait<0>();
          pin(o);
          pin(p);
          pin(s);
          if (t + 2 == tiles) q_done();
          if (tid == 0) mbar_arrive(&empty[sc]);  // K(t) and V(t) are no longer read
          if (more) {
            online_softmax<BN>(s, st, alpha, scale_log2, CAUSAL && (t + 1) * BN + BN > m0, row0, (t + 1) * BN);
            scale_rows<D, BN>(o, alpha);
            to_operand<BN>(s, p);
          }
        }
      } else {
        // one tile at a time: S, its softmax, O rescaled, O += P V, each step waiting for the last
        for (int t = 0; t < tiles; ++t) {
          const int sc = stage(t);
          mbar_wait(&k_full[sc], phase(t));
          wgmma_fence();
          issue_scores<D, BM, BN>(s, q_addr, smem_addr(sK + sc * KV_BYTES));
          wgmma_commit();
          wgmma_wait<0>();
          pin(s);
          if (t == tiles - 1) q_done();
          if constexpr (MODE == 1) {  // probe: S of tile 0 is the output
            if (t == 0) {
#pragma unroll
              for (int j = 0; j < D / 16; ++j)
#pragma unroll
                for (int e = 0; e < 8; ++e) o[j][e] = s[j % (BN / 16)][e];
            }
          } else if constexpr (MODE == 2) {  // probe: P = S, no softmax
            to_operand<BN>(s, p);
          } else {
            online_softmax<BN>(s, st, alpha, scale_log2, CAUSAL && t * BN + BN > m0, row0, t * BN);
            scale_rows<D, BN>(o, alpha);
            to_operand<BN>(s, p);
          }
          mbar_wait(&v_full[sc], phase(t));
          if constexpr (MODE != 1) {
            wgmma_fence();
            issue_pv<D, BN>(o, p, smem_addr(sV + sc * KV_BYTES));
            wgmma_commit();
            wgmma_wait<0>();
            pin(o);
            pin(p);
          }
          if (tid == 0) mbar_arrive(&empty[sc]);
        }
      }
      g += tiles;

      // the four threads of a row add their sums; O normalised once; the log-sum-exp in natural log
      float inv[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        st.l[h] += __shfl_xor_sync(0xffffffff, st.l[h], 1);
        st.l[h] += __shfl_xor_sync(0xffffffff, st.l[h], 2);
        inv[h] = MODE != 0 ? 1.0f : (st.l[h] > 0.0f ? 1.0f / st.l[h] : 0.0f);
      }
      half* out = O + static_cast<size_t>(head_row) * D;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int a = 0; a < D / 32; ++a) {  // columns 32a .. 32a + 31: word 4x + q is column block 2a + x / 2's
          unsigned w[4];                     // elements 4 (x % 2) + 2h and + 1
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int j = 2 * a + x / 2, e = 4 * (x % 2) + 2 * h;
            w[x] = half2_bits(o[j][e] * inv[h], o[j][e + 1] * inv[h]);
          }
          quad_transpose(w, lane % 4);  // now columns 32a + 8q .. + 7
          *reinterpret_cast<uint4*>(out + static_cast<size_t>(row0 + 8 * h) * D + 32 * a + 8 * (lane % 4)) =
              make_uint4(w[0], w[1], w[2], w[3]);
        }
      if (lane % 4 == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
          LSE[head_row + row0 + 8 * h] =
              st.l[h] > 0.0f ? (st.m[h] + __log2f(st.l[h])) * 0.6931471805599453f : __int_as_float(0xff800000);
      }
    }  // items
  }
#else
  __trap();  // built for an architecture without wgmma: the launcher refuses before it gets here
#endif
}
// endregion


// ------------------------------------------------------------------------------------------ FP8 (e4m3)
// The forward in FP8, d = 128: Q, K and V as e4m3 codes with one float32 scale per tile of 128 rows (sq per 128
// query rows, sk and sv per key tile: kernels/attention/fp8.py's numerics). A block computes 192 rows of O with a
// producer and THREE consumers of 64 rows (512 threads), free-running (no turns at the tensor cores).
//   * S = Q K^T on wgmma's e4m3 path: a row of 128 codes is 128 bytes, one row of the swizzle, so Q's and K's tiles
//     are one box each, and k steps 32 codes (32 bytes) a wgmma, as FP16's k steps 16.
//   * The softmax runs on S times sq sk (folded into its scale), and P is rounded to e4m3 times 256 (FP8 has few
//     values below 2^-6: see fp8.py) by adding 8 to the exponent before exp2 (no multiply).
//   * Why three consumers: the matrix products take half FP16's time and the softmax does not shrink, so with two
//     consumers each one's chain (wait for S, row max, exponentials, rounding, rescale) left the tensor cores idle
//     60% of the time. A third consumer fills them; the registers allow it because of the next two points
//     (setmaxnreg: 128 x 24 + 384 x 160 of the SM's 64 K).
//   * P goes to shared memory (a tile of 64 x 128 codes a consumer, Q's layout), and P V reads it there: with S, O
//     and P all in registers while both products run, a consumer needs more than 160 registers.
//   * The rows' sums of P come from the tensor cores too: a wgmma m64n8 of P times a tile of ones (8 x 128 codes of
//     1.0) gives each row's sum of the rounded P, in FP32, a tile at a time (added to l in FP32: summed in the
//     accumulator over all tiles, l lost an order of magnitude of accuracy at N = 16k). That removes a tile's 64
//     additions a thread, and O is divided by the sum of the very weights it summed.
//   * P V: FP8 wgmma reads B K-major only, so V comes transposed (d x N, the keys contiguous), made by a pre-pass
//     (flash_fp8's prepare_v) that also orders each 32 keys as the thread that packs P holds them: the accumulator
//     gives a thread keys 2q, 2q + 1, 2q + 8, 2q + 9 (and 16 more) of each 32 (q = lane % 4), which it packs into one
//     word of four codes; storing V's keys in that same order pairs every p with its v, so P's words go to shared
//     memory as they come.
//   * V's scale changes from tile to tile, and O sums over tiles in the MMA's registers: O is kept in units of the
//     latest tile's scale, so before P(t) V(t) is added the rows are scaled by alpha sv(t-1) / sv(t), and the end
//     multiplies by sv(last).
#ifdef GPUCOURSE_WGMMA
// Four floats rounded to e4m3 (to nearest even, saturated to +-448) in one register, the first in the lowest byte.
__device__ __forceinline__ unsigned e4m3x4_bits(float a, float b, float c, float d) {
  const unsigned lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const unsigned hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

constexpr float P_SCALE_LOG2 = 8.0f;  // P times 2^8 before e4m3 rounds it (kernels/attention/fp8.py's P_SCALE)

// P (64 x BN, FP32 accumulator places, already times 256: softmax_exps's bias) as e4m3 codes in shared memory,
// where P V's wgmma reads it as its A operand (K-major, 128-byte rows, the 16-byte chunk x of row r at x ^ (r % 8)).
// Of keys 32b .. 32b + 31 a thread packs keys 2q, 2q + 1, 2q + 8, 2q + 9 of the first 16 (rows r and r + 8: h = 0,
// 1) into one word each, and the same of the next 16: bytes 4q .. 4q + 3 of chunk 2b (+ 1), the order prepare_v
// stores V's keys in. A warp's 32 stores of one (b, half, h) fall on 8 rows x 4 words: all 32 banks.
template <int BN>
__device__ __forceinline__ void store_p_fp8(const float (&s)[BN / 16][8], unsigned p_addr, int warp, int lane) {
#pragma unroll
  for (int b = 0; b < BN / 32; ++b)
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float* x = s[2 * b + half];
        const int r = 16 * warp + lane / 4 + 8 * h;
        const unsigned word = e4m3x4_bits(x[2 * h], x[2 * h + 1], x[4 + 2 * h], x[5 + 2 * h]);
        const unsigned addr = p_addr + r * 128 + (((2 * b + half) ^ (r % 8)) << 4) + 4 * (lane % 4);
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(word) : "memory");
      }
}

// The descriptors of a tile's four k steps of 32 codes (one box of 128-byte rows in the 128-byte swizzle): step kk
// starts 32 kk bytes on, 2 kk in the descriptor's address field (16-byte units; no carry, shared memory is below
// 256 KB).
__device__ __forceinline__ void fp8_descs(unsigned long long (&d)[4], unsigned addr) {
  const unsigned long long base = make_desc(addr, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) d[kk] = base + 2 * kk;
}

// S = Q K^T (k = 32 codes a wgmma, both from shared memory); O += P V^T and l = P 1, P from shared memory.
template <int BN>
__device__ __forceinline__ void issue_scores_fp8(float (&s)[BN / 16][8], const unsigned long long (&dq)[4],
                                                 const unsigned long long (&dk)[4]) {
#pragma unroll
  for (int kk = 0; kk < 128 / 32; ++kk) wgmma_k32_e4m3<BN>(s, dq[kk], dk[kk], kk > 0);
}
template <int BN>
__device__ __forceinline__ void issue_pv_fp8(float (&o)[8][8], float (&l)[4], const unsigned long long (&dp)[4],
                                             const unsigned long long (&dv)[4], const unsigned long long (&d1)[4]) {
#pragma unroll
  for (int kk = 0; kk < BN / 32; ++kk) wgmma_k32_e4m3<128>(o, dp[kk], dv[kk], 1);
#pragma unroll
  for (int kk = 0; kk < BN / 32; ++kk) wgmma_m64n8k32_e4m3(l, dp[kk], d1[kk], kk > 0);  // this tile's sums alone
}
#endif  // GPUCOURSE_WGMMA

// Q, K: (heads x N) x 128 codes; VT: (heads x 128) x N codes (prepare_v's); SQ, SK, SV: heads x N/128 scales. N a
// multiple of 128; a block's 192 rows may reach past N (its last consumers then only pass the tiles on). The rest
// as flash_wgmma's.
template <int STAGES, bool CAUSAL>
__device__ __forceinline__ void flash_fp8_wgmma(const TensorMap* tmQ, const TensorMap* tmK, const TensorMap* tmVT,
                                                const float* __restrict__ SQ, const float* __restrict__ SK,
                                                const float* __restrict__ SV, half* __restrict__ O,
                                                float* __restrict__ LSE, int* next_item, int N, int heads, int section,
                                                float scale_log2) {
#ifdef GPUCOURSE_WGMMA
  constexpr int CONS = 3, BM = 64 * CONS, BN = 128, D = 128;  // BN: a row of V transposed is one swizzle row
  constexpr unsigned Q_BYTES = BM * D, KV_BYTES = BN * D, P_BYTES = 64 * BN;  // a byte a code
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  unsigned char* sQ = smem;                    // [BM][128]
  unsigned char* sK = sQ + Q_BYTES;            // STAGES x [BN][128]
  unsigned char* sV = sK + STAGES * KV_BYTES;  // STAGES x [128 (d)][BN]
  unsigned char* sP = sV + STAGES * KV_BYTES;  // CONS x [64][BN]: each consumer's P
  unsigned char* sOnes = sP + CONS * P_BYTES;  // [8][BN] codes of 1.0: the row sums' B operand
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(sOnes + 8 * BN);
  unsigned long long *q_full = bars, *q_empty = bars + 1, *k_full = bars + 2, *v_full = k_full + STAGES,
                     *empty = v_full + STAGES;
  volatile int* item_slot = reinterpret_cast<volatile int*>(empty + STAGES);

  const int wg = warpgroup_index(), tid = threadIdx.x % 128;
  const int blocks_m = (N + BM - 1) / BM, items = blocks_m * heads, tiles_n = N / BN;
  auto item_of = [&](int i) {
    if (!CAUSAL) return make_int2(i / blocks_m, i % blocks_m * BM);
    const int first = i / (section * blocks_m) * section, in_section = min(section, heads - first);
    const int j = i - first * blocks_m;
    return make_int2(first + j % in_section, (blocks_m - 1 - j / in_section) * BM);
  };
  auto tiles_of = [&](int m0) { return CAUSAL ? (min(m0 + BM, N) + BN - 1) / BN : tiles_n; };
  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);
    mbar_init(q_empty, CONS);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&k_full[s], 1);
      mbar_init(&v_full[s], 1);
      mbar_init(&empty[s], CONS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int x = threadIdx.x; x < 8 * BN / 4; x += blockDim.x) reinterpret_cast<unsigned*>(sOnes)[x] = 0x38383838u;
  fence_async_shared();  // the ones, written by threads, read by wgmma
  __syncthreads();

  if (wg == 0) {  // ------------------------------------------------------------------ producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    if (tid == 0) {
      int g = 0, i = blockIdx.x;
      for (int k = 0;; ++k) {
        if (k > 0) mbar_wait(q_empty, (k - 1) & 1);
        *item_slot = i < items ? i : -1;
        if (i >= items) {
          mbar_arrive(q_full);
          break;
        }
        const int2 item = item_of(i);
        const int m0 = item.y, head_row = item.x * N, tiles = tiles_of(m0);
        mbar_expect_tx(q_full, Q_BYTES);
        tma_load_2d(sQ, tmQ, q_full, 0, head_row + m0);
        const int next = atomicAdd(next_item, 1) + gridDim.x;
        for (int t = 0; t < tiles; ++t, ++g) {
          const int s = g % STAGES;
          if (g >= STAGES) mbar_wait(&empty[s], ((g / STAGES) + 1) & 1);
          mbar_expect_tx(&k_full[s], KV_BYTES);
          tma_load_2d(sK + s * KV_BYTES, tmK, &k_full[s], 0, head_row + t * BN);
          mbar_expect_tx(&v_full[s], KV_BYTES);
          tma_load_2d(sV + s * KV_BYTES, tmVT, &v_full[s], t * BN, item.x * D);  // d rows of the head, BN keys
        }
        i = next;
      }
    }
  } else {  // ---------------------------------------------------------------------- consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 160;");  // 128 x 24 + 384 x 160 <= 64 K registers
    const int c = wg - 1, warp = tid / 32, lane = tid % 32;
    const unsigned p_addr = smem_addr(sP) + c * P_BYTES;
    unsigned long long dq[4], dk[4], dv[4], dp[4], d1[4];
    fp8_descs(dq, smem_addr(sQ) + c * 64 * 128);
    fp8_descs(dp, p_addr);
    fp8_descs(d1, smem_addr(sOnes));
    int g = 0;
    for (int k = 0;; ++k) {
      mbar_wait(q_full, k & 1);
      const int i = __shfl_sync(0xffffffff, *item_slot, 0);  // known to be one value a warp: uniform registers
      if (i < 0) break;
      const int2 item = item_of(i);
      const int m0 = item.y, head_row = item.x * N, tiles = tiles_of(m0);
      auto stage = [&](int t) { return (g + t) % STAGES; };
      auto phase = [&](int t) { return static_cast<unsigned>(((g + t) / STAGES) & 1); };
      auto q_done = [&]() { if (tid == 0) mbar_arrive(q_empty); };
      auto pass = [&](int t) {  // release a stage this consumer does not compute on, once it is full (so that it
        mbar_wait(&k_full[stage(t)], phase(t));  // never releases a stage twice before the others release it once)
        mbar_wait(&v_full[stage(t)], phase(t));
        if (tid == 0) mbar_arrive(&empty[stage(t)]);
      };
      // The tiles this consumer computes: causal, the block's last tile may lie past all of its rows; in N's last
      // block its rows may all lie past N.
      const int first_row = m0 + 64 * c;
      const int mine = first_row >= N ? 0 : CAUSAL ? min(tiles, (min(first_row + 64, N) + BN - 1) / BN) : tiles;
      if (mine == 0) {
        for (int t = 0; t < tiles; ++t) pass(t);
        q_done();
        g += tiles;
        continue;
      }
      const int row0 = first_row + 16 * warp + lane / 4;
      RowState st = {{__int_as_float(0xff800000), __int_as_float(0xff800000)}, {0.0f, 0.0f}};
      float s[BN / 16][8], alpha[2], lsum[4];
      const float* sk = SK + static_cast<size_t>(item.x) * tiles_n;
      const float* sv = SV + static_cast<size_t>(item.x) * tiles_n;
      const float qk_scale = scale_log2 * __ldg(&SQ[static_cast<size_t>(item.x) * tiles_n + first_row / 128]);
      auto make_p = [&]() {  // P to shared memory; the warpgroup's four warps have written it before P V reads it
        store_p_fp8<BN>(s, p_addr, warp, lane);
        fence_async_shared();
        named_sync(1 + c, 128);
      };
      float o[D / 16][8];
#pragma unroll
      for (int j = 0; j < D / 16; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) o[j][e] = 0.0f;

      fp8_descs(dk, smem_addr(sK + stage(0) * KV_BYTES));
      mbar_wait(&k_full[stage(0)], phase(0));
      wgmma_fence();
      issue_scores_fp8<BN>(s, dq, dk);
      wgmma_commit();
      // what the next products read (K(1), V(0)), waited for while the tensor cores work on S
      if (mine > 1) mbar_wait(&k_full[stage(1)], phase(1));
      mbar_wait(&v_full[stage(0)], phase(0));
      wgmma_wait<0>();
      pin(s);
      if (mine == 1) q_done();
      float sv_prev = __ldg(&sv[0]);
      const float qk0 = qk_scale * __ldg(&sk[0]);
      softmax_max<BN>(s, st, alpha, qk0, CAUSAL && BN > first_row + 1, row0, 0);
      softmax_exps<BN, false>(s, st, qk0, P_SCALE_LOG2);
      make_p();
      for (int t = 1; t < mine; ++t) {
        const int sc = stage(t), sp = stage(t - 1);
        fp8_descs(dk, smem_addr(sK + sc * KV_BYTES));
        fp8_descs(dv, smem_addr(sV + sp * KV_BYTES));
        wgmma_fence();
        issue_scores_fp8<BN>(s, dq, dk);
        wgmma_commit();
        issue_pv_fp8<BN>(o, lsum, dp, dv, d1);
        wgmma_commit();
        const float sk_t = __ldg(&sk[t]), sv_t = __ldg(&sv[t]);
        if (t + 1 < mine) mbar_wait(&k_full[stage(t + 1)], phase(t + 1));
        mbar_wait(&v_full[sc], phase(t));
        wgmma_wait<1>();
        pin(s);
        if (t == mine - 1) q_done();
        softmax_max<BN>(s, st, alpha, qk_scale * sk_t, CAUSAL && t * BN + BN > first_row + 1, row0, t * BN);
        softmax_exps<BN, false>(s, st, qk_scale * sk_t, P_SCALE_LOG2);
        wgmma_wait<0>();
        pin(o);
        pin(lsum);
        if (tid == 0) mbar_arrive(&empty[sp]);
#pragma unroll
        for (int h = 0; h < 2; ++h) st.l[h] = fmaf(lsum[2 * h], alpha[h], st.l[h]);  // P(t - 1)'s sums, to m(t)
        const float unit = sv_prev / sv_t;  // O from units of V(t-1)'s scale to V(t)'s
        alpha[0] *= unit;
        alpha[1] *= unit;
        scale_rows<D, BN>(o, alpha);
        sv_prev = sv_t;
        make_p();
      }
      const int sl = stage(mine - 1);
      fp8_descs(dv, smem_addr(sV + sl * KV_BYTES));
      wgmma_fence();
      issue_pv_fp8<BN>(o, lsum, dp, dv, d1);
      wgmma_commit();
      wgmma_wait<0>();
      pin(o);
      pin(lsum);
      if (tid == 0) mbar_arrive(&empty[sl]);
      for (int t = mine; t < tiles; ++t) pass(t);
      g += tiles;

      // as flash_wgmma's end: O times V's last scale, over l (P and l are both times 256); the log-sum-exp. Each of
      // a row's four threads holds the whole row's sum (the m64n8 product's columns are all the same).
      float inv[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        st.l[h] += lsum[2 * h];
        inv[h] = st.l[h] > 0.0f ? sv_prev / st.l[h] : 0.0f;
      }
      store_rows_fp16<D>(O + static_cast<size_t>(head_row) * D, o, inv, row0, lane, N);
      if (lane % 4 == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (row0 + 8 * h < N)
            LSE[head_row + row0 + 8 * h] =
                st.l[h] > 0.0f ? (st.m[h] + __log2f(st.l[h]) - P_SCALE_LOG2) * 0.6931471805599453f  // l: 256 sums
                               : __int_as_float(0xff800000);
      }
    }  // items
  }
#else
  __trap();
#endif
}

}  // namespace hopper

// The kernels the course launches (kernels/attention/flash.py, WGMMA_VARIANTS): head dim, stages, causal, variant.
#define FLASH_WGMMA(NAME, D, BN, S, C, PIPE, PP, AHEAD, QREGS, MODE)                                           \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                          \
      NAME(const __grid_constant__ TensorMap tmQ, const __grid_constant__ TensorMap tmK,                        \
           const __grid_constant__ TensorMap tmV, half* O, float* LSE, int* next_item, int N, int heads,       \
           int section, float scale_log2) {                                                                     \
    hopper::flash_wgmma<D, BN, S, C, PIPE, PP, AHEAD, QREGS, MODE>(&tmQ, &tmK, &tmV, O, LSE, next_item, N, heads,  \
                                                                   section, scale_log2);                        \
  }

// name: head dim, variant, keys a tile (where not 128), causal
FLASH_WGMMA(flash_wgmma_d64_pingpong, 64, 128, 4, false, true, true, false, false, 0)
FLASH_WGMMA(flash_wgmma_d64_pingpong_causal, 64, 128, 4, true, true, true, false, false, 0)
FLASH_WGMMA(flash_wgmma_d64_qregs, 64, 128, 4, false, true, true, false, true, 0)
FLASH_WGMMA(flash_wgmma_d64_qregs_causal, 64, 128, 4, true, true, true, false, true, 0)
FLASH_WGMMA(flash_wgmma_d64_pipelined, 64, 128, 4, false, true, false, false, false, 0)
FLASH_WGMMA(flash_wgmma_d64_pipelined_causal, 64, 128, 4, true, true, false, false, false, 0)
FLASH_WGMMA(flash_wgmma_d64_ahead, 64, 128, 4, false, false, false, true, false, 0)
FLASH_WGMMA(flash_wgmma_d64_ahead_causal, 64, 128, 4, true, false, false, true, false, 0)
FLASH_WGMMA(flash_wgmma_d64_serial, 64, 128, 4, false, false, false, false, false, 0)
FLASH_WGMMA(flash_wgmma_d64_serial_causal, 64, 128, 4, true, false, false, false, false, 0)
FLASH_WGMMA(flash_wgmma_d128_pingpong, 128, 128, 3, false, true, true, false, false, 0)
FLASH_WGMMA(flash_wgmma_d128_pingpong_causal, 128, 128, 3, true, true, true, false, false, 0)
FLASH_WGMMA(flash_wgmma_d128_qregs, 128, 128, 3, false, true, true, false, true, 0)
FLASH_WGMMA(flash_wgmma_d128_qregs_causal, 128, 128, 3, true, true, true, false, true, 0)
FLASH_WGMMA(flash_wgmma_d128_pipelined, 128, 128, 3, false, true, false, false, false, 0)
FLASH_WGMMA(flash_wgmma_d128_pipelined_causal, 128, 128, 3, true, true, false, false, false, 0)
FLASH_WGMMA(flash_wgmma_d128_ahead, 128, 128, 3, false, false, false, true, false, 0)
FLASH_WGMMA(flash_wgmma_d128_ahead_causal, 128, 128, 3, true, false, false, true, false, 0)
FLASH_WGMMA(flash_wgmma_d128_serial, 128, 128, 3, false, false, false, false, false, 0)
FLASH_WGMMA(flash_wgmma_d128_serial_causal, 128, 128, 3, true, false, false, false, false, 0)
FLASH_WGMMA(flash_wgmma_d128_probe_scores, 128, 128, 2, false, false, false, false, false, 1)
FLASH_WGMMA(flash_wgmma_d128_probe_pv, 128, 128, 2, false, false, false, false, false, 2)

// The FP8 forward (kernels/attention/flash.py, flash_fp8): d = 128, 192 query rows a block, causal or not.
#define FLASH_FP8(NAME, S, C)                                                                                     \
  extern "C" __global__ void __launch_bounds__(512, 1)                                                          \
      NAME(const __grid_constant__ TensorMap tmQ, const __grid_constant__ TensorMap tmK,                        \
           const __grid_constant__ TensorMap tmVT, const float* SQ, const float* SK, const float* SV, half* O,  \
           float* LSE, int* next_item, int N, int heads, int section, float scale_log2) {                      \
    hopper::flash_fp8_wgmma<S, C>(&tmQ, &tmK, &tmVT, SQ, SK, SV, O, LSE, next_item, N, heads, section, scale_log2); \
  }

FLASH_FP8(flash_fp8_d128, 5, false)
FLASH_FP8(flash_fp8_d128_causal, 5, true)

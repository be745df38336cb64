// gpucourse-arch: sm_90a
// Lesson 10, the backward pass on Hopper: FlashAttention-3's shape, wgmma fed by the TMA. Launched by
// kernels/attention/backward_cuda.py (flash_backward_wgmma); the algorithm is kernels/attention/backward_tiles.py's,
// with dQ by atomics (there: dq="atomic").
//
// Q, K, V, dO: (batch x heads) x N x D, D = 64 or 128, FP16, row-major; LSE (natural log) and D = rowsum(dO o O)
// (the pre-pass, attention_bwd_prepass below): (batch x heads) x NP, FP32, NP = N rounded up to a multiple of 128
// (see below). dK, dV: FP16 like K and V; dQ is summed in an FP32 buffer (zero at launch), its columns in each row r
// stored XOR 8 (r % 4), which the launcher undoes as it rounds to FP16 afterwards.
//
// Any N: the grids run ceil(N / tile) blocks and the TMA reads Q, K, V and dO through 3-D tensor maps (heads x N x
// D), so a tile reaching past row N of its head is filled with zeros rather than with the next head's rows. What
// lies past N is then absent: LSE and D come padded to NP = ceil(N / 128) 128 rows a head (the launcher pads lse
// with +inf, the pre-pass leaves D's padding 0), so a query row from N on reads lse = +inf and gets
// P = exp2(S - inf) = 0, dS = 0, with no test in the kernel (a test there, on the 16 rows a thread reads a tile,
// cost ptxas 8 bytes of spills); a key from N on gets P = 0 by the mask (causal: key > query already says so
// wherever the query is present); rows from N on of dK, dV and dQ are not stored, and the bulk add of a dQ tile is
// cut to the rows before N (the tile is row-major, so they are its first bytes).
//
// A block owns BN = 128 keys of one head and keeps their dK and dV in registers (FP32) while it walks the query
// tiles of BM = 64 rows that see them (causal: from the diagonal on). Warpgroup 0 is the PRODUCER: one thread
// asks the TMA for the block's K and V tiles once, then for each query tile's Q and dO, and its 64 rows of LSE and
// D (a plain bulk copy each, 256 bytes), into a ring of STAGES stages. Warpgroups 1 and 2 are CONSUMERS, 64 of the
// block's keys each; for each query tile:
//   1. S^T = K Q^T and dP^T = dO V^T transposed (= V dO^T), both 64 keys x 64 queries, both operands from shared
//      memory: the keys are the MMA's rows, so each consumer's rows are its own keys;
//   2. P^T = exp(S^T scale - lse) from the forward's log-sum-exp (recomputed, never stored), dS^T = P^T (dP^T - D),
//      lse and D read from the stage once step 1 is done, not from global memory and held in registers through the
//      wait (engineering note 10: that was several per cent slower);
//   3. dV += P^T dO and dK += dS^T Q, with P^T and dS^T as the A operand straight from registers (the accumulator's
//      places are the A operand's, as in the forward's P V), dO and Q MN-major from shared memory;
//   4. dQ: every key of the block contributes to every query row, so dS^T goes to shared memory (FP16, 128 keys x
//      64 queries), the consumers meet at a barrier, and dQ_tile = dS K (64 queries x 128, consumer c taking
//      columns 64c ..) runs with A = dS read transposed from shared memory; the tile, times the softmax scale, goes
//      to shared memory in FP32 and one thread adds it into the FP32 buffer of dQ with a single bulk reduction
//      (cp.reduce.async.bulk ... add.f32: the TMA's atomic add of 32 KiB), double-buffered so that the next tile's
//      work need not wait for it.
//      D = 64 (DQ_KEY_SPLIT): 32 columns a consumer would need an n = 32 wgmma whose B starts mid-row of the
//      swizzle, so the consumers split dQ's k instead: consumer c forms dQ_c = dS_c K_c over its own 64 keys (64
//      queries x 64, both operands as at D = 128, 4 k steps) and adds it with its own bulk reduction (16 KiB), the
//      TMA summing the two. A consumer reads only the dS^T rows it wrote, so the barriers are its own (128 threads)
//      and the consumers never wait for each other; the dQ traffic is the same 32 KiB a tile. Free of each other,
//      they take turns at issuing step 1 (two more named barriers), so that one's exponentials run while the
//      other's products do (at D = 128 both need every dS^T row of the tile, so they run in step; splitting dQ's k
//      there too, to free them, doubles the dQ traffic and was slower).
// At the end dK (times the scale) and dV leave as FP16.
//
// Compiled for any architecture other than sm_90a the kernels are stubs that trap (tests/test_gpu_archs.py).
#include <cuda_fp16.h>
#include "hopper.cuh"
#include "flash_hopper.cuh"
#include "fast_math.cuh"

namespace hopper {

// Rows a head of LSE and D: N rounded up to the 128 rows of the second pass's blocks (two tiles of the first
// kernel's 64), padded with lse = +inf and D = 0, so that every row a block reads is there.
__host__ __device__ constexpr int padded_rows(int n) { return (n + 127) / 128 * 128; }

#ifdef GPUCOURSE_WGMMA
// The shared memory's contents are added into global memory by the TMA (FP32, ``bytes`` a multiple of 16, both
// addresses 16-byte aligned), asynchronously, in the issuing thread's bulk group (bulk_commit, bulk_wait_read).
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const void* src, unsigned bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}

#endif  // GPUCOURSE_WGMMA

template <int D, int STAGES, bool CAUSAL, bool DQ_ATOMIC>
__device__ __forceinline__ void flash_bwd_wgmma(const TensorMap* tmQ, const TensorMap* tmK, const TensorMap* tmV,
                                                const TensorMap* tmdO, const float* __restrict__ LSE,
                                                const float* __restrict__ Dsum, float* __restrict__ dQacc,
                                                half* __restrict__ dK, half* __restrict__ dV, int N, float scale,
                                                float scale_log2) {
#ifdef GPUCOURSE_WGMMA
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  static_assert(STAGES <= 7, "the barriers (1 + 2 STAGES) fit the 128 bytes before the stages' LSE and D");
  constexpr int BM = 64, BN = 128;
  constexpr bool DQ_KEY_SPLIT = D == 64;  // dQ's k split between the consumers (D = 128: its columns)
  constexpr unsigned KV_BYTES = BN * D * 2, QO_BYTES = BM * D * 2, DS_BYTES = BN * BM * 2;
  constexpr float LOG2E = 1.4426950408889634f;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  unsigned char* sK = smem;                         // D / 64 boxes of [128 keys][64]
  unsigned char* sV = sK + KV_BYTES;                // the same for V
  unsigned char* sQ = sV + KV_BYTES;                // STAGES x D / 64 boxes of [64 queries][64]
  unsigned char* sdO = sQ + STAGES * QO_BYTES;      // the same for dO
  unsigned char* sdS = sdO + STAGES * QO_BYTES;     // [128 keys][64 queries] FP16, 128-byte swizzle
  // 2 x [64 queries][128] FP32 (D = 64: 2 a consumer x [64][64]), rows in order (columns XOR 8 (r % 4)): 64 KiB
  float* sdQ = reinterpret_cast<float*>(sdS + DS_BYTES);
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(reinterpret_cast<unsigned char*>(sdQ) + 65536);
  unsigned long long *kv_full = bars, *full = bars + 1, *empty = full + STAGES;
  float* sLD = reinterpret_cast<float*>(bars + 16);  // STAGES x (BM rows of LSE, then BM of D), after the barriers

  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int j = blockIdx.x, head = blockIdx.y;  // the block's key tile and head
  const int head_row = head * N, tiles_m = (N + BM - 1) / BM, lse_row = head * padded_rows(N);
  const int first = CAUSAL ? (j * BN) / BM : 0;  // causal: query tiles from the one holding the block's first key
  if (threadIdx.x == 0) {
    mbar_init(kv_full, 1);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 2);  // one arrival per consumer warpgroup
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // ------------------------------------------------------------------ producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    if (tid == 0) {
      mbar_expect_tx(kv_full, 2 * KV_BYTES);
      for (int c = 0; c < D / 64; ++c) {
        tma_load_3d(sK + c * BN * 128, tmK, kv_full, 64 * c, j * BN, head);
        tma_load_3d(sV + c * BN * 128, tmV, kv_full, 64 * c, j * BN, head);
      }
      for (int i = first, it = 0; i < tiles_m; ++i, ++it) {
        const int s = it % STAGES;
        if (it >= STAGES) mbar_wait(&empty[s], ((it / STAGES) + 1) & 1);
        mbar_expect_tx(&full[s], 2 * QO_BYTES + 2 * BM * 4);
        for (int c = 0; c < D / 64; ++c) {
          tma_load_3d(sQ + s * QO_BYTES + c * BM * 128, tmQ, &full[s], 64 * c, i * BM, head);
          tma_load_3d(sdO + s * QO_BYTES + c * BM * 128, tmdO, &full[s], 64 * c, i * BM, head);
        }
        // the tile's rows of LSE and D (padded to NP rows a head: always there)
        bulk_load(sLD + s * 2 * BM, LSE + lse_row + i * BM, BM * 4, &full[s]);
        bulk_load(sLD + s * 2 * BM + BM, Dsum + lse_row + i * BM, BM * 4, &full[s]);
      }
    }
  } else {  // ---------------------------------------------------------------------- consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
    const int c = wg - 1, warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
    const int key0 = j * BN + 64 * c + 16 * warp + g;  // this thread's keys: key0 and key0 + 8 (in the head)
    const bool key_out[2] = {key0 >= N, key0 + 8 >= N};  // keys past the sequence: P = 0
    const unsigned k_rows = smem_addr(sK) + c * 64 * 128, v_rows = smem_addr(sV) + c * 64 * 128;
    float dk[D / 16][8], dv[D / 16][8];
#pragma unroll
    for (int a = 0; a < D / 16; ++a)
#pragma unroll
      for (int e = 0; e < 8; ++e) dk[a][e] = dv[a][e] = 0.0f;
    mbar_wait(kv_full, 0);
    // D = 64, dQ by atomics: the consumers take turns at issuing S^T and dP^T (named barrier 5: consumer 0's turn,
    // 6: consumer 1's); consumer 0 goes first
    constexpr bool TURNS = DQ_KEY_SPLIT && DQ_ATOMIC;  // (measured with the atomic dQ only)
    if constexpr (TURNS)
      if (c == 1) named_arrive(5, 256);

    for (int i = first, it = 0; i < tiles_m; ++i, ++it) {
      const int s = it % STAGES;
      const unsigned q_tile = smem_addr(sQ + s * QO_BYTES), do_tile = smem_addr(sdO + s * QO_BYTES);
      mbar_wait(&full[s], (it / STAGES) & 1);
      // 1. S^T = K Q^T and dP^T = V dO^T: 64 keys x 64 queries, k = d
      float st[BM / 16][8], dpt[BM / 16][8];
      if constexpr (TURNS) {  // this consumer's turn (ids as constants: ptxas counts the barriers in use)
        if (c == 0) named_sync(5, 256);
        else named_sync(6, 256);
      }
      wgmma_fence();
      issue_scores<D, BN, BM>(st, k_rows, q_tile);
      wgmma_commit();
      issue_scores<D, BN, BM>(dpt, v_rows, do_tile);
      wgmma_commit();
      if constexpr (TURNS)  // the other's turn (consumer 1's last tile hands none on: no one would take it)
        if (c == 0) named_arrive(6, 256);
        else if (i + 1 < tiles_m) named_arrive(5, 256);
      wgmma_wait<0>();
      pin(st);
      pin(dpt);
      // what P^T and dS^T subtract: lse (in log2 units) and D of this thread's 16 queries, column 16a + 8b + 2q + e,
      // from the stage (a query past N reads the padding: lse = +inf, D = 0)
      float lse2[BM / 16][2][2], dsum[BM / 16][2][2];
      const float* ld = sLD + s * 2 * BM;
#pragma unroll
      for (int a = 0; a < BM / 16; ++a)
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const float2 l = *reinterpret_cast<const float2*>(ld + 16 * a + 8 * b + 2 * q);
          const float2 d2 = *reinterpret_cast<const float2*>(ld + BM + 16 * a + 8 * b + 2 * q);
          lse2[a][b][0] = l.x * LOG2E;
          lse2[a][b][1] = l.y * LOG2E;
          dsum[a][b][0] = d2.x;
          dsum[a][b][1] = d2.y;
        }
      // 2. P^T = exp(S^T scale - lse), dS^T = P^T (dP^T - D); element e of block a: key key0 + 8 ((e / 2) % 2),
      // query i BM + 16a + 8 (e / 4) + 2q + e % 2. Causal: a key past the query gives P = 0; not causal: a key past
      // N does (causal needs no second test: a key past N is past every query before N).
      unsigned pa[BM / 16][4], dsa[BM / 16][4];
#pragma unroll
      for (int a = 0; a < BM / 16; ++a) {
        float p[8], ds[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int key = key0 + 8 * ((e >> 1) & 1), query = i * BM + 16 * a + 8 * (e >> 2) + 2 * q + (e & 1);
          const float x = ex2(fmaf(st[a][e], scale_log2, -lse2[a][e >> 2][e & 1]));
          p[e] = (CAUSAL ? key > query : key_out[(e >> 1) & 1]) ? 0.0f : x;
          ds[e] = p[e] * (dpt[a][e] - dsum[a][e >> 2][e & 1]);
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // the A operand's register r: elements 2r, 2r + 1 (to_operand's order)
          pa[a][r] = half2_bits(p[2 * r], p[2 * r + 1]);
          dsa[a][r] = half2_bits(ds[2 * r], ds[2 * r + 1]);
        }
      }
      // 3. dV += P^T dO, dK += dS^T Q: k = the 64 queries (16 a step), B MN-major: the next 64 columns a box on
      wgmma_fence();
#pragma unroll
      for (int a = 0; a < BM / 16; ++a) wgmma_rs<D, 1>(dv, pa[a], make_desc(do_tile + a * 16 * 128, BM * 128, 1024));
#pragma unroll
      for (int a = 0; a < BM / 16; ++a) wgmma_rs<D, 1>(dk, dsa[a], make_desc(q_tile + a * 16 * 128, BM * 128, 1024));
      wgmma_commit();
      // 4. dQ (DQ_ATOMIC; else the second pass, flash_bwd_dq_wgmma, makes it). dS^T into shared memory for
      // dQ = dS K: row = key (128 of them), 64 queries = 128 bytes, swizzled: the 16-byte chunk x of row r sits at
      // chunk x ^ (r % 8). Thread's half2 (key, queries 16a + 8b + 2q ..): chunk 2a + b.
      // DQ_KEY_SPLIT: this consumer's 64 keys (its own dS^T rows, box 0 of K); else all 128 keys, box c of K
      constexpr int DQ_KEYS = DQ_KEY_SPLIT ? 64 : BN;
      const int dq_key0 = DQ_KEY_SPLIT ? 64 * c : 0, dq_box = DQ_KEY_SPLIT ? 0 : c;
      // named barriers: dS^T in place (1), then the dQ tile in place (2), both consumers; D = 64 each its own
      // (1, 2 consumer 0's, 3, 4 consumer 1's: ids known to ptxas, which otherwise reserves all 16)
      auto dq_sync = [&](int id) {
        if constexpr (!DQ_KEY_SPLIT) named_sync(id, 256);
        else if (c == 0) named_sync(id, 128);
        else named_sync(id + 2, 128);
      };
      float dq[4][8];
      if constexpr (DQ_ATOMIC) {
#pragma unroll
        for (int a = 0; a < BM / 16; ++a)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int b = 0; b < 2; ++b) {
              const int r = 64 * c + 16 * warp + g + 8 * h, chunk = (2 * a + b) ^ (r % 8);
              *reinterpret_cast<unsigned*>(sdS + r * 128 + chunk * 16 + 4 * q) = dsa[a][2 * b + h];
            }
        fence_async_shared();                // the wgmmas read shared memory through the async proxy
        dq_sync(1);                          // the keys dQ sums over are in place
        // dQ tile columns 64c .. 64c + 63 (D = 64: all 64 columns, this consumer's keys): A = dS (64 queries x the
        // keys, stored key by key: MN-major), B = K (the keys x 64 columns: box dq_box of K's tile, MN-major),
        // k = 16 keys a step
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < DQ_KEYS / 16; ++kk) {
          const unsigned key_off = (dq_key0 + kk * 16) * 128;
          wgmma_m64n64k16<1, 1>(dq, make_desc(smem_addr(sdS) + key_off, BN * 128, 1024),
                                make_desc(smem_addr(sK) + dq_box * BN * 128 + key_off, BN * 128, 1024), kk > 0);
        }
        wgmma_commit();
      }
      wgmma_wait<0>();  // dV, dK (and dQ's) products are done: Q, dO (and dS) may be overwritten
      pin(dk);
      pin(dv);
      if (tid == 0) mbar_arrive(&empty[s]);
      if constexpr (!DQ_ATOMIC) continue;
      pin(dq);
      // the dQ tile, times the scale, into this round's buffer (the reduction two rounds ago has read it: the thread
      // that issued it waits for that before the barrier above lets anyone here)
      // Row r's columns are stored XOR 8 (r % 4) (DQ_COLUMN_SWIZZLE): a warp's float2 stores cover 8 rows of 8
      // words each, which a plain row-major tile (rows 512 bytes apart) puts on the same 8 banks (8 wavefronts a
      // store); swizzled, rows r and r + 4 share a bank group and a store takes the 2 wavefronts its 256 bytes need.
      // The FP32 buffer in global memory keeps the same order; the launcher's rounding to FP16 undoes it.
      // (D = 64: rows of 64 floats, 256 bytes apart, the same 8 banks again; the same XOR stays inside the row.)
      float* buf = sdQ + ((DQ_KEY_SPLIT ? 2 * c : 0) + it % 2) * (BM * D);
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = 16 * warp + g + 8 * h;
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const int col = ((DQ_KEY_SPLIT ? 0 : 64 * c) + 16 * a + 8 * b + 2 * q) ^ (8 * (row % 4));
            *reinterpret_cast<float2*>(buf + row * D + col) =
                make_float2(dq[a][4 * b + 2 * h] * scale, dq[a][4 * b + 2 * h + 1] * scale);
          }
        }
      fence_async_shared();
      dq_sync(2);  // the whole tile is in place; and every consumer is done reading dS
      if ((DQ_KEY_SPLIT || c == 0) && tid == 0) {  // the rows before N only: row-major, so the tile's first bytes
        const unsigned bytes = static_cast<unsigned>(min(BM, N - i * BM)) * D * 4;
        bulk_reduce_add_f32(dQacc + static_cast<size_t>(head_row + i * BM) * D, buf, bytes);
        bulk_commit();
        bulk_wait_read<1>();  // the other buffer is free again before the next round's barrier 1
      }
    }
    if (DQ_ATOMIC && (DQ_KEY_SPLIT || c == 0) && tid == 0) bulk_wait<0>();  // the last reductions have landed
    // dK (times the scale) and dV of this thread's keys, rows key0 and key0 + 8 of the head
    const float one[2] = {1.0f, 1.0f}, sc[2] = {scale, scale};
    const int row0 = j * BN + 64 * c + 16 * warp + g;
    store_rows_fp16<D>(dK + static_cast<size_t>(head_row) * D, dk, sc, row0, lane, N);
    store_rows_fp16<D>(dV + static_cast<size_t>(head_row) * D, dv, one, row0, lane, N);
  }
#else
  __trap();  // built for an architecture without wgmma: the launcher refuses before it gets here
#endif
}


// dQ by a second pass (backward_tiles' dq="second-pass"): a block per 128 query rows of a head, the forward's shape.
// The producer loads the rows' Q and dO once, then K's and V's tiles of 128 keys into a ring of STAGES; each consumer
// (64 rows) recomputes S = Q K^T and dP = dO V^T (both from shared memory), P = exp(S scale - lse) and
// dS = P (dP - D), then dQ += dS K with dS from registers (K read MN-major). dQ (times the scale) leaves as FP16:
// no atomics, at the price of S, P and dP computed a second time.
template <int D, int STAGES, bool CAUSAL>
__device__ __forceinline__ void flash_bwd_dq_wgmma(const TensorMap* tmQ, const TensorMap* tmK, const TensorMap* tmV,
                                                   const TensorMap* tmdO, const float* __restrict__ LSE,
                                                   const float* __restrict__ Dsum, half* __restrict__ dQ, int N,
                                                   float scale, float scale_log2) {
#ifdef GPUCOURSE_WGMMA
  constexpr int BM = 128, BN = 128;
  constexpr unsigned TILE_BYTES = 128 * D * 2;  // Q, dO (128 rows) and K, V (128 keys): D / 64 boxes of [128][64]
  constexpr float LOG2E = 1.4426950408889634f;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  unsigned char* sQ = smem;
  unsigned char* sdO = sQ + TILE_BYTES;
  unsigned char* sK = sdO + TILE_BYTES;              // STAGES x K's tile
  unsigned char* sV = sK + STAGES * TILE_BYTES;      // STAGES x V's tile
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(sV + STAGES * TILE_BYTES);
  unsigned long long *q_full = bars, *full = bars + 1, *empty = full + STAGES;

  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int m0 = blockIdx.x * BM, head = blockIdx.y, head_row = head * N, tiles_n = (N + BN - 1) / BN;
  const int tiles = CAUSAL ? min((m0 + BM) / BN, tiles_n) : tiles_n;  // causal: no key past the block's last row
  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 2);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // ------------------------------------------------------------------ producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    if (tid == 0) {
      mbar_expect_tx(q_full, 2 * TILE_BYTES);
      for (int c = 0; c < D / 64; ++c) {
        tma_load_3d(sQ + c * BM * 128, tmQ, q_full, 64 * c, m0, head);
        tma_load_3d(sdO + c * BM * 128, tmdO, q_full, 64 * c, m0, head);
      }
      for (int t = 0; t < tiles; ++t) {
        const int s = t % STAGES;
        if (t >= STAGES) mbar_wait(&empty[s], ((t / STAGES) + 1) & 1);
        mbar_expect_tx(&full[s], 2 * TILE_BYTES);
        for (int c = 0; c < D / 64; ++c) {
          tma_load_3d(sK + s * TILE_BYTES + c * BN * 128, tmK, &full[s], 64 * c, t * BN, head);
          tma_load_3d(sV + s * TILE_BYTES + c * BN * 128, tmV, &full[s], 64 * c, t * BN, head);
        }
      }
    }
  } else {  // ---------------------------------------------------------------------- consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
    const int c = wg - 1, warp = tid / 32, lane = tid % 32, q = lane % 4;
    const int row0 = m0 + 64 * c + 16 * warp + lane / 4;  // this thread's rows: row0 and row0 + 8 (in the head)
    const unsigned q_rows = smem_addr(sQ) + c * 64 * 128, do_rows = smem_addr(sdO) + c * 64 * 128;
    float lse2[2], dsum[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // a row past N reads the padding: lse = +inf (P = 0), D = 0
      lse2[h] = __ldg(&LSE[head * padded_rows(N) + row0 + 8 * h]) * LOG2E;
      dsum[h] = __ldg(&Dsum[head * padded_rows(N) + row0 + 8 * h]);
    }
    float dq[D / 16][8];
#pragma unroll
    for (int a = 0; a < D / 16; ++a)
#pragma unroll
      for (int e = 0; e < 8; ++e) dq[a][e] = 0.0f;
    mbar_wait(q_full, 0);
    for (int t = 0; t < tiles; ++t) {
      const int s = t % STAGES;
      const unsigned k_tile = smem_addr(sK + s * TILE_BYTES), v_tile = smem_addr(sV + s * TILE_BYTES);
      mbar_wait(&full[s], (t / STAGES) & 1);
      float sc[BN / 16][8], dp[BN / 16][8];
      wgmma_fence();
      issue_scores<D, BM, BN>(sc, q_rows, k_tile);
      wgmma_commit();
      issue_scores<D, BM, BN>(dp, do_rows, v_tile);
      wgmma_commit();
      wgmma_wait<0>();
      pin(sc);
      pin(dp);
      // element e of block a: row row0 + 8 ((e / 2) % 2), key t BN + 16a + 8 (e / 4) + 2q + e % 2. Causal: a key
      // past the row gives P = 0; not causal: a key past N (only the last tile has any)
      unsigned dsa[BN / 16][4];
      const bool edge = !CAUSAL && (t + 1) * BN > N;
#pragma unroll
      for (int a = 0; a < BN / 16; ++a) {
        float ds[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int h = (e >> 1) & 1, key = t * BN + 16 * a + 8 * (e >> 2) + 2 * q + (e & 1);
          const bool out = CAUSAL ? key > row0 + 8 * h : edge && key >= N;
          const float p = out ? 0.0f : ex2(fmaf(sc[a][e], scale_log2, -lse2[h]));
          ds[e] = p * (dp[a][e] - dsum[h]);
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) dsa[a][r] = half2_bits(ds[2 * r], ds[2 * r + 1]);
      }
      // dQ += dS K: k = 16 keys a step, K's tile MN-major (a key's D values: boxes of 64, BN * 128 bytes apart)
      wgmma_fence();
#pragma unroll
      for (int a = 0; a < BN / 16; ++a) wgmma_rs<D, 1>(dq, dsa[a], make_desc(k_tile + a * 16 * 128, BN * 128, 1024));
      wgmma_commit();
      wgmma_wait<0>();
      pin(dq);
      pin(dsa);
      if (tid == 0) mbar_arrive(&empty[s]);
    }
    const float sc2[2] = {scale, scale};
    store_rows_fp16<D>(dQ + static_cast<size_t>(head_row) * D, dq, sc2, row0, lane, N);
  }
#else
  __trap();
#endif
}

}  // namespace hopper

// D = rowsum(dO o O) of every query row, FP32 (the backward's pre-pass): a warp a row of HD (the head dim), HD / 32
// columns a lane (128: four, 64: two). ``rows`` rows of O and dO, N a head; D's rows padded to padded_rows(N) a head
// (the padding is left as it is: zero).
template <int HD>
__device__ __forceinline__ void bwd_prepass(const half* __restrict__ O, const half* __restrict__ dO,
                                            float* __restrict__ Dsum, int rows, int N) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  float sum;
  if constexpr (HD == 128) {
    const uint2 o = *reinterpret_cast<const uint2*>(O + static_cast<size_t>(row) * 128 + 4 * lane);
    const uint2 d = *reinterpret_cast<const uint2*>(dO + static_cast<size_t>(row) * 128 + 4 * lane);
    const float2 o0 = __half22float2(*reinterpret_cast<const __half2*>(&o.x)),
                 o1 = __half22float2(*reinterpret_cast<const __half2*>(&o.y));
    const float2 d0 = __half22float2(*reinterpret_cast<const __half2*>(&d.x)),
                 d1 = __half22float2(*reinterpret_cast<const __half2*>(&d.y));
    sum = o0.x * d0.x + o0.y * d0.y + o1.x * d1.x + o1.y * d1.y;
  } else {
    static_assert(HD == 64, "head dim 64 or 128");
    const float2 o = __half22float2(*reinterpret_cast<const __half2*>(O + static_cast<size_t>(row) * 64 + 2 * lane));
    const float2 d = __half22float2(*reinterpret_cast<const __half2*>(dO + static_cast<size_t>(row) * 64 + 2 * lane));
    sum = o.x * d.x + o.y * d.y;
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, m);
  if (lane == 0) Dsum[row / N * hopper::padded_rows(N) + row % N] = sum;
}
extern "C" __global__ void attention_bwd_prepass(const half* O, const half* dO, float* Dsum, int rows, int N) {
  bwd_prepass<128>(O, dO, Dsum, rows, N);
}
extern "C" __global__ void attention_bwd_prepass_d64(const half* O, const half* dO, float* Dsum, int rows, int N) {
  bwd_prepass<64>(O, dO, Dsum, rows, N);
}

// dQ from the atomic backward's FP32 buffer (rows x HD, heads of N rows; the columns of a row r' of its head stored
// XOR 8 (r' % 4)) in row order, rounded to FP16: a thread per 8 columns of a row. The XOR moves whole groups of 8
// columns (group g of row r' sits at group g ^ (r' % 4)), so a thread reads its 8 floats as two 16-byte loads and
// writes one 16-byte store.
template <int HD>
__device__ __forceinline__ void bwd_dq_round(const float* __restrict__ acc, half* __restrict__ dq, long long rows,
                                             int N) {
  const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= rows * (HD / 8)) return;
  const long long r = t / (HD / 8);
  const int g = static_cast<int>(t % (HD / 8)), src = g ^ static_cast<int>((r % N) % 4);
  const float4* in = reinterpret_cast<const float4*>(acc + r * HD + 8 * src);
  const float4 a = in[0], b = in[1];
  const __half2 h[4] = {__floats2half2_rn(a.x, a.y), __floats2half2_rn(a.z, a.w), __floats2half2_rn(b.x, b.y),
                        __floats2half2_rn(b.z, b.w)};
  *reinterpret_cast<uint4*>(dq + r * HD + 8 * g) = *reinterpret_cast<const uint4*>(h);
}
extern "C" __global__ void attention_bwd_dq_round(const float* acc, half* dq, long long rows, int N) {
  bwd_dq_round<128>(acc, dq, rows, N);
}
extern "C" __global__ void attention_bwd_dq_round_d64(const float* acc, half* dq, long long rows, int N) {
  bwd_dq_round<64>(acc, dq, rows, N);
}

#define FLASH_BWD(NAME, D, S, C, DQ)                                                                                 \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                          \
      NAME(const __grid_constant__ TensorMap tmQ, const __grid_constant__ TensorMap tmK,                        \
           const __grid_constant__ TensorMap tmV, const __grid_constant__ TensorMap tmdO, const float* LSE,      \
           const float* Dsum, float* dQacc, half* dK, half* dV, int N, float scale, float scale_log2) {           \
    hopper::flash_bwd_wgmma<D, S, C, DQ>(&tmQ, &tmK, &tmV, &tmdO, LSE, Dsum, dQacc, dK, dV, N, scale, scale_log2); \
  }
#define FLASH_BWD_DQ(NAME, D, S, C)                                                                                  \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                          \
      NAME(const __grid_constant__ TensorMap tmQ, const __grid_constant__ TensorMap tmK,                        \
           const __grid_constant__ TensorMap tmV, const __grid_constant__ TensorMap tmdO, const float* LSE,      \
           const float* Dsum, half* dQ, int N, float scale, float scale_log2) {                                  \
    hopper::flash_bwd_dq_wgmma<D, S, C>(&tmQ, &tmK, &tmV, &tmdO, LSE, Dsum, dQ, N, scale, scale_log2);              \
  }

// dQ by atomics (the block's dQ tile added into an FP32 buffer) ...
FLASH_BWD(flash_bwd_wgmma_d128, 128, 2, false, true)
FLASH_BWD(flash_bwd_wgmma_d128_causal, 128, 2, true, true)
FLASH_BWD(flash_bwd_wgmma_d64, 64, 2, false, true)
FLASH_BWD(flash_bwd_wgmma_d64_causal, 64, 2, true, true)
// ... or by a second pass: dK and dV alone, then a kernel per query rows for dQ
FLASH_BWD(flash_bwd_wgmma_d128_dkdv, 128, 2, false, false)
FLASH_BWD(flash_bwd_wgmma_d128_dkdv_causal, 128, 2, true, false)
FLASH_BWD(flash_bwd_wgmma_d64_dkdv, 64, 2, false, false)
FLASH_BWD(flash_bwd_wgmma_d64_dkdv_causal, 64, 2, true, false)
FLASH_BWD_DQ(flash_bwd_dq_wgmma_d128, 128, 2, false)
FLASH_BWD_DQ(flash_bwd_dq_wgmma_d128_causal, 128, 2, true)
FLASH_BWD_DQ(flash_bwd_dq_wgmma_d64, 64, 2, false)
FLASH_BWD_DQ(flash_bwd_dq_wgmma_d64_causal, 64, 2, true)

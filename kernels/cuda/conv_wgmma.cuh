// Lesson 5's Hopper convolution, the tile a block computes (conv_tile): lesson 4's wgmma GEMM with its A tiles
// gathered from the image by the TMA. Shared by convolution_wgmma.cu (lesson 5) and inference_engine_wgmma.cu
// (lesson 6's engine, which ends it with its own epilogue); gpucourse/cuda_c.py copies it into each.
// What it computes and how is told in convolution_wgmma.cu.

#include <cuda_fp16.h>

#include "hopper.cuh"
#include "hopper_gemm.cuh"  // stmatrix_x4: the FP16 TMA epilogue's stores

namespace hopper {

// What a tile's elements are, and what the tensor cores accumulate them in. A stage holds BKC channels of each
// row (a slice of the reduction): BKC = BK = 64 makes rows of 128 bytes in FP16 (the 128-byte swizzle) and of 64
// bytes in the 8-bit types (the 64-byte swizzle, which the launcher's tensor maps ask the TMA for); the engine's
// "wide" 8-bit tiles take BKC = 128, rows of 128 bytes in the 128-byte swizzle as FP16's, so that a slice is as many
// bytes and as much tensor-core work as FP16's (at 64 channels, half of each: an 8-bit layer took as many slices as
// FP16's, each with its fixed cost, and ran no faster). wgmma takes 32 bytes of a row a step either way: K = 16 FP16
// or K = 32 INT8 / FP8. Lesson 5 uses FP16; lesson 6's engine all three (INT8 into INT32 sums, FP8 e4m3 into FP32).
struct F16 {
  static constexpr int kBytes = 2, kFloat = 1;
  using Acc = float;
};
struct S8 {
  static constexpr int kBytes = 1, kFloat = 0;
  using Acc = int;
};
struct E4M3 {
  static constexpr int kBytes = 1, kFloat = 1;
  using Acc = float;
};

// An accumulator set to zero. INT32 sums by an instruction of their own each: written as ``= 0``, the compiler makes
// one register zero and copies it into the others, and ptxas, seeing an accumulator read by something other than a
// wgmma, serialises every wgmma of the kernel (C7514: each one waited for before the next is issued).
__device__ __forceinline__ void zero_acc(float& x) { x = 0.0f; }
__device__ __forceinline__ void zero_acc(int& x) { asm volatile("mov.b32 %0, 0;" : "=r"(x)); }

// ``store(m, k, v0, v1)`` writes the sums of output pixel m (n P + p) Q + q, channels k and k + 1 (k even): lesson 5
// rounds them into y. A Store with kStaged true is called as ``store.row(m, k, v, raw, f)`` for Store::kVec channels
// k, k + 1, ... (16 bytes of its output) instead, after the tile went through shared memory, with ``raw =
// store.load(m, k)`` (a Store::Raw) what it reads there, loaded earlier, and ``f = store.factors(k)`` (a
// Store::Factors) what it reads per output channel: lesson 6's engine, which reads a residual, a bias and, in the
// 8-bit types, two scales (inference_engine_wgmma.cu).
//
// PERSIST (lesson 6's engine): a block per SM (or as many as fit) walks the tiles in turn instead of one block a
// tile. The producer runs ahead into the next tile's slices while the consumers are still in the epilogue of this
// one, so a layer with a short reduction (a 1 x 1 convolution of 64 channels: one slice) loads its next tiles
// while it stores this one, instead of leaving the SM's memory traffic to the next block's start. The epilogue then
// stages through its own EPI_PIECES x 64 rows a consumer (after the B stages), not through A's stages, which the
// producer is refilling.
// A Store may also have ``prefetch(m, k, cols)``: bring a row of what its epilogue reads (the engine's residual)
// into L2; a persistent tile's idle producer threads call it for each row of a tile when the tile's first slice has
// landed, well before the consumers' epilogue of that tile reads it.
template <class S, class = void> struct HasPrefetch { static constexpr bool value = false; };
template <class S> struct HasPrefetch<S, decltype(void(&S::prefetch))> { static constexpr bool value = true; };
// A Store with kTma true (lesson 6's persistent tiles, PERSIST and I2C only, BN a multiple of a box's channels up to
// 256) ends a tile through the TMA instead: tmR (the residual, if ``store.has_res()``) and tmY (the output) are 2-D
// tensor maps of its rows (channels fastest, a row a pixel) with boxes of 128 bytes of channels x 64 rows in the
// 128-byte swizzle: 128 channels of 1-byte outputs (INT8, FP8), 64 of 2-byte ones (FP16, Store::kOutBytes 2; the
// 8-bit Stores leave it out), 8 KB a box either way. A consumer's 64 rows of a tile live in one of its RBUF buffers (tma_buffers: 2 or 3; the tiles take turns):
// a thread of the producer warpgroup loads the residual of the next tiles into the others while the consumers work
// on this one; each thread then writes the codes of its fragments, ``store.pair<RES>(raw, v0, v1,
// store.pair_factors(k))`` for channels k and k + 1 of a row (raw: the residual's two codes there), over the
// residual's in place, and one thread hands the 64 rows to the TMA to store. The buffer is loaded again once that
// store has read it. FP16 (tma_halves): the same, a thread's two channels of a row a 32-bit word (two halves), the
// residual's words read where the fragments lie and the results written by stmatrix, four 8 x 8 matrices at once.
template <class S, class = void> struct TmaEpilogue { static constexpr bool value = false; };
template <class S> struct TmaEpilogue<S, decltype(void(S::kTma))> { static constexpr bool value = S::kTma; };
template <class S, class = void> struct TmaOutBytes { static constexpr int value = 1; };
template <class S> struct TmaOutBytes<S, decltype(void(S::kOutBytes))> { static constexpr int value = S::kOutBytes; };
constexpr int EPI_PIECES = 4;  // a round: 64 rows x 4 x 32 columns a consumer (8 KB of floats a piece)
// TMA_OUT: a consumer's buffers (of 64 rows x BN outputs of out_bytes each): three where they fit beside the stages
// (the residual then loads two tiles ahead), else two; as kernels/inference_engine/executor.py's tma_buffers.
// (Measured on an H100 before the epilogue lost its branches: three and two took the same time.) Never one: a tile's
// codes go into a buffer only after the store of the tile RBUF before it has read it, which thread 0 waited for at
// the last tile's end, before the barrier every thread passed; with one buffer that store is this very tile's last.
__host__ __device__ constexpr int tma_buffers(int bm, int bn, int stages, int row_bytes, int out_bytes = 1) {
  return stages * (bm + bn) * row_bytes + 3 * bm * bn * out_bytes <= 200 * 1024 ? 3 : 2;
}
// TMA_OUT: a thread's codes of a tile into its consumer's buffer (base: at the thread's first row and column), over
// the residual's there (RES: there is one; each case one stretch of code without branches, which the compiler
// schedules across all of it). Thread (warp, lane) holds rows warp 16 + lane / 4 (+ 8) of the 64, channels 8 j + 2
// (lane % 4) and the next: byte (channel % 16) of 16-byte chunk (channel % 128) / 16, which the 128-byte swizzle
// stores as chunk ((channel % 128) / 16) ^ (row % 8), row % 8 being lane / 4; box channel / 128 (8 KB each).
// In rounds of TMA_ROUND column groups j: a round's residual codes are all loaded before any of its codes is stored.
// A load cannot be moved above an earlier store that might write the same place, so one group at a time (load,
// convert, store, and the next load waiting for that store) made a chain of shared-memory round trips as long as the
// tile is wide. In rounds (H100, ResNet-50 at batch 64, INT8): conv2's residual layers 66.5 -> 64 us, conv3's
// 38.3 -> 35.5, conv4's 21.1 -> 20.1.
constexpr int TMA_ROUND = 8;
__device__ __forceinline__ unsigned short* tma_code_at(unsigned char* base, int j, int h, int lane) {
  return reinterpret_cast<unsigned short*>(base + (j / 16) * 8192 + ((((j % 16) / 2) ^ (lane / 4)) << 4) +
                                           (j % 2) * 8 + h * 8 * 128);
}
template <bool RES, int BN, class Store, class Acc>
__device__ __forceinline__ void tma_codes(const Store& store, const Acc (&d)[BN / 16][8], unsigned char* base, int k0,
                                          int lane) {
  static_assert((BN / 8) % TMA_ROUND == 0, "whole rounds");
#pragma unroll
  for (int j0 = 0; j0 < BN / 8; j0 += TMA_ROUND) {
    unsigned short raw[TMA_ROUND][2];
#pragma unroll
    for (int jj = 0; jj < TMA_ROUND; ++jj)
#pragma unroll
      for (int h = 0; h < 2; ++h) raw[jj][h] = RES ? *tma_code_at(base, j0 + jj, h, lane) : 0;
#pragma unroll
    for (int jj = 0; jj < TMA_ROUND; ++jj) {
      const int j = j0 + jj;
      const auto f = store.pair_factors(k0 + 8 * j + 2 * (lane % 4));  // K is a multiple of BN (the plan checks)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const Acc* v = &d[j / 2][(j % 2) * 4 + 2 * h];
        *tma_code_at(base, j, h, lane) =
            store.template pair<RES>(raw[jj][h], static_cast<float>(v[0]), static_cast<float>(v[1]), f);
      }
    }
  }
}

// FP16 (2-byte outputs): a box is 64 channels x 64 rows, 128 bytes a row, 8 KB; a consumer's buffer BN / 64 boxes
// (64 rows x 2 BN bytes). Thread (warp, lane) holds rows warp 16 + lane / 4 (+ 8) of the 64, channels 8 j + 2 (lane %
// 4) and the next: one 32-bit word, bytes 4 (lane % 4) .. of 16-byte chunk j % 8 of box j / 8, which the 128-byte
// swizzle stores as chunk (j % 8) ^ (row % 8). The residual's words are read there (base: the thread's first row and
// word, as tma_word_at), in rounds of TMA_ROUND groups as tma_codes; the results of column groups j and j + 1, both
// rows (fragment d[j / 2]: the accumulator layout of four 8 x 8 matrices), go out in one stmatrix, each lane naming
// row lane % 8 of matrix lane / 8 (rows + 8 for the odd matrices, group j + 1 for the last two), as lesson 4's
// store_tile_tma. Each word a lane's stmatrix writes holds the result of the lane that read the residual's word
// there, made from it: the read has completed before the write, in every lane.
#ifdef GPUCOURSE_WGMMA  // stmatrix
__device__ __forceinline__ unsigned* tma_word_at(unsigned char* base, int j, int h, int lane) {
  return reinterpret_cast<unsigned*>(base + (j / 8) * 8192 + (((j % 8) ^ (lane / 4)) << 4) + h * 8 * 128);
}
template <bool RES, int BN, class Store, class Acc>
__device__ __forceinline__ void tma_halves(const Store& store, const Acc (&d)[BN / 16][8], unsigned char* buf,
                                           int warp, int k0, int lane) {
  static_assert((BN / 8) % TMA_ROUND == 0 && TMA_ROUND % 2 == 0, "whole rounds of pairs of column groups");
  unsigned char* base = buf + (warp * 16 + lane / 4) * 128 + 4 * (lane % 4);
  const int q = lane / 8, srow = warp * 16 + (q % 2) * 8 + lane % 8;  // the row this lane names to stmatrix
  unsigned char* sbase = buf + srow * 128;
#pragma unroll
  for (int j0 = 0; j0 < BN / 8; j0 += TMA_ROUND) {
    unsigned raw[TMA_ROUND][2];
#pragma unroll
    for (int jj = 0; jj < TMA_ROUND; ++jj)
#pragma unroll
      for (int h = 0; h < 2; ++h) raw[jj][h] = RES ? *tma_word_at(base, j0 + jj, h, lane) : 0u;
#pragma unroll
    for (int jj = 0; jj < TMA_ROUND; jj += 2) {
      const int j = j0 + jj;  // even: fragment d[j / 2], groups j and j + 1
      const auto f0 = store.pair_factors(k0 + 8 * j + 2 * (lane % 4));
      const auto f1 = store.pair_factors(k0 + 8 * (j + 1) + 2 * (lane % 4));
      const Acc* v = d[j / 2];
      const unsigned w0 = store.template pair<RES>(raw[jj][0], static_cast<float>(v[0]), static_cast<float>(v[1]), f0);
      const unsigned w1 = store.template pair<RES>(raw[jj][1], static_cast<float>(v[2]), static_cast<float>(v[3]), f0);
      const unsigned w2 = store.template pair<RES>(raw[jj + 1][0], static_cast<float>(v[4]), static_cast<float>(v[5]), f1);
      const unsigned w3 = store.template pair<RES>(raw[jj + 1][1], static_cast<float>(v[6]), static_cast<float>(v[7]), f1);
      const int g = j + q / 2;  // the column group of this lane's matrix
      stmatrix_x4(smem_addr(sbase + (g / 8) * 8192 + (((g % 8) ^ (srow % 8)) << 4)), w0, w1, w2, w3);
    }
  }
}
#endif

template <int BM, int BN, int STAGES, bool I2C, class Store, class E = F16, bool PERSIST = false, int BKC = 64>
__device__ __forceinline__ void conv_tile(const TensorMap* tmX, const TensorMap* tmW, const Store& store, int N,
                                          int P, int Q, int K, int C, int R, int S, int ph, int pw, int TW,
                                          int tiles_q, int tiles_p, const TensorMap* tmR = nullptr,
                                          const TensorMap* tmY = nullptr) {
#ifdef GPUCOURSE_WGMMA
  constexpr int CONSUMERS = BM / 64;
  constexpr bool TMA_OUT = TmaEpilogue<Store>::value;
  // TMA_OUT: an output's bytes (1: INT8, FP8; 2: FP16) and a box's channels (128 bytes of a row: 128 or 64)
  constexpr int OUT_BYTES = TmaOutBytes<Store>::value, BOX = 128 / OUT_BYTES;
  static_assert(!TMA_OUT || (PERSIST && I2C && BN % BOX == 0 && BN <= 256 && (OUT_BYTES == 1 || OUT_BYTES == 2)),
                "the TMA epilogue: persistent im2col tiles of whole boxes");
  constexpr unsigned R_BYTES = 64 * BN * OUT_BYTES;  // TMA_OUT: a consumer's buffer, 64 rows as BN / BOX boxes of 8 KB
  // TMA_OUT: buffers a consumer, taken in turn
  constexpr int RBUF = tma_buffers(BM, BN, STAGES, BKC * E::kBytes, OUT_BYTES);
  static_assert(!TMA_OUT || RBUF >= 2, "two buffers a consumer at least (tma_buffers)");
  constexpr int ROW = BKC * E::kBytes;  // bytes of a row in a stage: 128 (FP16, wide 8-bit) or 64 (8-bit)
  static_assert(ROW == 64 || ROW == 128, "a stage's rows are one row of the 64- or 128-byte swizzle");
  constexpr unsigned A_BYTES = BM * ROW, B_BYTES = BN * ROW;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);  // the swizzle's 1 KiB
  unsigned char* sA = smem;                     // STAGES x [BM][64] elements: TH x TW pixels x 64 channels
  unsigned char* sB = smem + STAGES * A_BYTES;  // STAGES x [BN][64] elements: output channels x 64 of R S C
  unsigned char* sE = sB + STAGES * B_BYTES;    // PERSIST: CONSUMERS x EPI_PIECES x [64][ROW]: the epilogue's
  constexpr unsigned E_BYTES = TMA_OUT ? RBUF * CONSUMERS * R_BYTES  // TMA_OUT: RBUF buffers a consumer
                               : PERSIST ? CONSUMERS * EPI_PIECES * 64 * 128 : 0;  // pieces of 64 rows x 32 floats
  unsigned long long* full = reinterpret_cast<unsigned long long*>(sE + E_BYTES);
  unsigned long long* empty = full + STAGES;
  // TMA_OUT: buffer b of consumer c holds the residual (rfull[b CONSUMERS + c]) / has been stored (rempty[...]);
  // after ``started``
  unsigned long long* rfull = empty + STAGES + 2;
  unsigned long long* rempty = rfull + RBUF * CONSUMERS;
  auto rbuf = [&](int b, int c) { return sE + (b * CONSUMERS + c) * R_BYTES; };

  const int wg = warpgroup_index(), tid = threadIdx.x % 128;
  // PERSIST: the tile the consumers began last (paces the residual's prefetch), after the mbarriers
  volatile int& started = *reinterpret_cast<volatile int*>(empty + STAGES);
  if (threadIdx.x == 0) {
    if constexpr (PERSIST) started = -1;
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], CONSUMERS);
    }
    if constexpr (TMA_OUT)
      for (int i = 0; i < RBUF * CONSUMERS; ++i) {
        mbar_init(&rfull[i], 1);
        mbar_init(&rempty[i], 1);
      }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const int slices = C / BKC;  // slices of BKC channels in one tap
  const int kblocks = R * S * slices;
  // Split-K (lesson 6's engine at batch 1, one tile a block): blockIdx.z of gridDim.z sums only its share of the
  // slices, kb_lo .. kb_hi - 1, and its Store writes those partial sums for another kernel to add up. A layer with a
  // long reduction and few tiles (ResNet-50's last 3 x 3 layers at batch 1: 8 tiles of 72 slices) then fills more
  // SMs. One block a tile without a split: the whole reduction.
  const int kb_per = PERSIST ? kblocks : (kblocks + gridDim.z - 1) / gridDim.z;
  const int kb_lo = PERSIST ? 0 : blockIdx.z * kb_per;
  const int kb_hi = kb_lo + kb_per < kblocks ? kb_lo + kb_per : kblocks;
  // The tiles: one a block (blockIdx.x over the output pixels, blockIdx.y over the channels) or, PERSIST, tile
  // blockIdx.x, then gridDim.x further on, ... (the channel tiles of a run of pixels one after another).
  const int tiles_n = (K + BN - 1) / BN;
  const int tiles_total = PERSIST ? (I2C ? (N * P * Q + BM - 1) / BM : N * tiles_p * tiles_q) * tiles_n : 1;
  const int first = PERSIST ? blockIdx.x : 0, step = PERSIST ? gridDim.x : 1;
  // Which tile: blockIdx.x walks the images' tiles (column tiles fastest) or, im2col, the runs of BM output
  // pixels; blockIdx.y the output channels (PERSIST: tile t is pixel tile t / tiles_n, channel tile t % tiles_n).
  // (n, p0, q0) is the tile's first output pixel, m0 its first row of y (im2col), k0 its first channel.
  auto coords = [&](int tile, int& n, int& p0, int& q0, int& m0, int& k0) {
    const int mt = PERSIST ? tile / tiles_n : blockIdx.x, nt = PERSIST ? tile % tiles_n : blockIdx.y;
    m0 = mt * BM;
    k0 = nt * BN;
    if constexpr (I2C) {
      n = m0 / (P * Q);
      p0 = (m0 % (P * Q)) / Q;
      q0 = m0 % Q;
    } else {
      const int qt = mt % tiles_q, pt = (mt / tiles_q) % tiles_p;
      n = mt / (tiles_q * tiles_p);
      p0 = pt * (BM / TW);
      q0 = qt * TW;
    }
  };

  if (wg == 0) {  // ------------------------------------------------------------------ producer
    producer_regs<CONSUMERS>();
    if (tid == 0) {
      // region: conv_wgmma_producer
      int it = 0;  // slices loaded so far, over every tile of this block: the stage ring's position
      for (int tile = first; tile < tiles_total; tile += step) {
      int n, p0, q0, m0, k0;
      coords(tile, n, p0, q0, m0, k0);
      for (int kb = kb_lo; kb < kb_hi; ++kb, ++it) {
        const int s = it % STAGES;
        const int tap = kb / slices, c0 = (kb % slices) * BKC;
        const int r = tap / S, sx = tap % S;
        if (it >= STAGES) mbar_wait(&empty[s], ((it / STAGES) + 1) & 1);
        mbar_expect_tx(&full[s], A_BYTES + B_BYTES);
        if constexpr (I2C)  // BM pixels from the tile's first one, moved by the tap
          tma_load_im2col_4d(sA + s * A_BYTES, tmX, &full[s], c0, q0 - pw, p0 - ph, n, sx, r);
        else  // im2col as a box: TH x TW pixels
          tma_load_4d(sA + s * A_BYTES, tmX, &full[s], c0, q0 + sx - pw, p0 + r - ph, n);
        tma_load_2d(sB + s * B_BYTES, tmW, &full[s], kb * BKC, k0);  // w's columns (r S + s) C + c0 ..
      }
      }  // tiles
      // endregion
    } else if constexpr (TMA_OUT) {
      if (tid == 32 && store.has_res()) {  // the residual of each tile, up to RBUF - 1 tiles ahead of the consumers
        const int rows = N * P * Q;
        int ti = 0;  // this block's tiles so far
        for (int tile = first; tile < tiles_total; tile += step, ++ti) {
          int n, p0, q0, m0, k0;
          coords(tile, n, p0, q0, m0, k0);
          const int b = ti % RBUF;
          for (int c = 0; c < CONSUMERS; ++c) {
            unsigned long long* bar = &rfull[b * CONSUMERS + c];
            if (ti >= RBUF) mbar_wait(&rempty[b * CONSUMERS + c], (ti / RBUF - 1) & 1);  // tile ti - RBUF stored
            const bool any = m0 + c * 64 < rows;  // a box wholly past the last row is not loaded
            mbar_expect_tx(bar, any ? R_BYTES : 0);
            if (any)
              for (int x = 0; x < BN / BOX; ++x) tma_load_2d(rbuf(b, c) + x * 8192, tmR, bar, k0 + x * BOX, m0 + c * 64);
          }
        }
      }
    } else if constexpr (PERSIST && I2C && HasPrefetch<Store>::value) {
      if (tid >= 32) {  // warps 1 to 3 (warp 0 holds the thread issuing the loads): a row each
        // Tile t's rows once the consumers have begun the tile before it (one tile ahead of its epilogue, so that
        // L2 holds about two tiles' residual a block); skipped if they are already on t. No wait here can hang:
        // ``started`` only grows, up to the last tile.
        for (int tile = first; tile < tiles_total; tile += step) {
          int spins = 0;
          while (started < tile - step) {
            __nanosleep(spins < 8 ? 64 : 512);
            ++spins;
          }
          if (started >= tile) continue;
          int n, p0, q0, m0, k0;
          coords(tile, n, p0, q0, m0, k0);
          const int cols = K - k0 < BN ? K - k0 : BN;
          for (int i = tid - 32; i < BM && m0 + i < N * P * Q; i += 96) store.prefetch(static_cast<size_t>(m0 + i), k0, cols);
        }
      }
    }
  } else {  // ---------------------------------------------------------------------- consumers
    consumer_regs<CONSUMERS>();
    const int c = wg - 1;
    int it = 0;  // slices used so far, over every tile of this block
    int ti = 0;  // TMA_OUT: tiles so far
    for (int tile = first; tile < tiles_total; tile += step, ++ti) {
    int n, p0, q0, m0, k0;
    coords(tile, n, p0, q0, m0, k0);
    if constexpr (PERSIST) if (c == 0 && tid == 0) started = tile;
    typename E::Acc d[BN / 16][8];
#pragma unroll
    for (int i = 0; i < BN / 16; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) zero_acc(d[i][j]);
    // A slice's wgmma run while the next slice's are issued: after issuing slice kb, wait only until slice kb - 1's
    // are done (wgmma_wait<1>) and give its stage back to the producer then, so the tensor cores never drain between
    // slices (waiting for each slice's own wgmma, wgmma_wait<0>, they did: a short reduction spent a good part of
    // its time there, and the 8-bit types, whose slice is half as much work, more). The last slice: after the loop.
    int held = -1;  // the stage whose wgmma may still be reading it
    for (int kb = kb_lo; kb < kb_hi; ++kb, ++it) {
      const int s = it % STAGES;
      mbar_wait(&full[s], (it / STAGES) & 1);
      const unsigned a0 = smem_addr(sA + s * A_BYTES + c * 64 * ROW);
      const unsigned b0 = smem_addr(sB + s * B_BYTES);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < ROW / 32; ++kk) {  // both K-major, as the GEMM's "nk"; 8 rows a core block
        // rows of 128 bytes: the 128-byte swizzle's descriptors (8 rows, 1024 bytes, a core block); of 64: the 64's
        const unsigned long long da = ROW == 128 ? make_desc(a0 + kk * 32, 16, 1024) : make_desc_64b(a0 + kk * 32, 16, 512);
        const unsigned long long db = ROW == 128 ? make_desc(b0 + kk * 32, 16, 1024) : make_desc_64b(b0 + kk * 32, 16, 512);
        if constexpr (E::kBytes == 2) {
          wgmma_k16<BN, 0>(d, da, db, 1);
        } else if constexpr (!E::kFloat) {
          wgmma_k32_s8<BN>(d, da, db, 1);
        } else {
          wgmma_k32_e4m3<BN>(d, da, db, 1);
        }
      }
      wgmma_commit();
      wgmma_wait<1>();  // slice kb - 1's wgmma have read their stage; slice kb's may still run
      if (tid == 0 && held >= 0) mbar_arrive(&empty[held]);
      held = s;
    }
    wgmma_wait<0>();  // the tile's sums are all in d
    if (tid == 0 && held >= 0) mbar_arrive(&empty[held]);
    // Which output pixel row i of the tile is: (p0 + i / TW, q0 + i % TW) inside the image, or, im2col, row m0 + i
    // of y inside y; -1 for a row computed for nothing.
    auto pixel_of = [&](int i) -> long long {
      if constexpr (I2C) return m0 + i < N * P * Q ? static_cast<long long>(m0 + i) : -1;
      const int p = p0 + i / TW, q = q0 + i % TW;
      return p < P && q < Q ? (static_cast<long long>(n) * P + p) * Q + q : -1;
    };
    const int warp = tid / 32, lane = tid % 32;
    if constexpr (TMA_OUT) {
      const int b = ti % RBUF;
      unsigned char* buf = rbuf(b, c);
      if (tid == 0) {
        bulk_wait_read<0>();  // the last tile's store has read its buffer: a later tile's residual may come in
        if (ti > 0 && store.has_res()) mbar_arrive(&rempty[((ti - 1) % RBUF) * CONSUMERS + c]);
      }
      // With a residual, wait for it; without, the buffer was last stored from RBUF tiles ago, and that store had
      // read it before the barrier at the end of the last tile (thread 0 waited for it there first)
      if (store.has_res()) mbar_wait(&rfull[b * CONSUMERS + c], (ti / RBUF) & 1);
      if constexpr (OUT_BYTES == 1) {
        unsigned char* base = buf + (warp * 16 + lane / 4) * 128 + 2 * (lane % 4);  // as tma_codes says
        if (store.has_res()) tma_codes<true, BN>(store, d, base, k0, lane);
        else tma_codes<false, BN>(store, d, base, k0, lane);
      } else {
        if (store.has_res()) tma_halves<true, BN>(store, d, buf, warp, k0, lane);
        else tma_halves<false, BN>(store, d, buf, warp, k0, lane);
      }
      fence_async_shared();  // the codes, seen by the TMA
      asm volatile("bar.sync %0, 128;" ::"r"(8 + c) : "memory");
      if (tid == 0) {
        if (m0 + c * 64 < N * P * Q)
          for (int x = 0; x < BN / BOX; ++x) tma_store_2d(tmY, buf + x * 8192, k0 + x * BOX, m0 + c * 64);
        bulk_commit();
      }
    } else if constexpr (Store::kStaged) {
      // Through shared memory: this consumer's rows of A in every stage are free now (the other consumer reads only
      // its own rows and B), STAGES pieces of 64 rows x CW FP32 columns (CW = a row's bytes / 4: 32 for FP16, 16
      // for the 8-bit types). In rounds, the fragments go there (their layout: rows l/4 and l/4 + 8 of the warp's
      // 16, 2 columns a thread), then each thread takes a unit: V = Store::kVec consecutive columns of a row, so a
      // warp reads and writes whole runs of a row, V elements a thread, instead of 2. The columns are swizzled by
      // the row, in groups of 8 floats (FP16) or 4 (8-bit), against bank conflicts ...
      // (PERSIST: pieces of 32 columns in every type, so that an 8-bit tile's rounds take 16-byte runs too)
      constexpr int CW = PERSIST ? 32 : ROW / 4, V = Store::kVec, UNITS = CW / V, CHUNKS = BN / CW;
      constexpr int SW = CW == 32 ? 3 : 2;
      // ... and by the piece, in groups of 4 floats: a quarter-warp's 16-byte reads take one row's units side by
      // side across the pieces, and pieces 8 KB apart share their banks (unswizzled by the piece, a 16-float unit's
      // reads, the 8-bit persistent tiles', met 4 ways on a bank; 8-float units 2 ways)
      constexpr int CHX = CW / 4 - 1;
      constexpr int PIECES = PERSIST ? EPI_PIECES : STAGES;     // 64 rows x CW columns each, a round
      constexpr int PER = (PIECES * 64 * UNITS + 127) / 128;  // the units a thread takes in a round, at most
      // piece ch of this consumer: in A's stage ch (its own rows), or, PERSIST, in the epilogue's own space
      auto piece = [&](int ch) -> float* {
        return reinterpret_cast<float*>(PERSIST ? sE + (c * EPI_PIECES + ch) * 64 * 128
                                                : sA + ch * A_BYTES + c * 64 * ROW);
      };
      // Unit u of a round: row u / (UNITS nch) of the tile, chunk and V columns from the rest; its output pixel
      // and first output channel.
      auto unit = [&](int u, int nch, int j0, int& row, int& ch, int& c8, long long& m, int& col) {
        row = u / (UNITS * nch);
        const int rest = u % (UNITS * nch);
        ch = rest / UNITS;
        c8 = (rest % UNITS) * V;
        m = pixel_of(c * 64 + row);
        col = k0 + (j0 + ch) * CW + c8;
      };
#pragma unroll
      for (int j0 = 0; j0 < CHUNKS; j0 += PIECES) {
        const int nch = CHUNKS - j0 < PIECES ? CHUNKS - j0 : PIECES;
        // What the epilogue reads from memory (a residual), for all of this thread's units at once, before the
        // fragments go to shared memory: PER loads in flight a thread instead of one. (One at a time, load then
        // store, the loads wait one after another: the compiler cannot move a load above the previous unit's
        // store, which might write the same memory, and a memory-bound layer then runs at a few times its floor.)
        typename Store::Raw raw[PER];
#pragma unroll
        for (int t = 0; t < PER; ++t) {
          int row, ch, c8, col;
          long long m;
          const int u = tid + t * 128;
          unit(u, nch, j0, row, ch, c8, m, col);
          raw[t] = u < nch * 64 * UNITS && m >= 0 && col < K ? store.load(static_cast<size_t>(m), col)
                                                             : typename Store::Raw{};
        }
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          const int col = 8 * j + 2 * (lane % 4), ch = col / CW - j0;
          if (ch < 0 || ch >= nch) continue;
          float* buf = piece(ch);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = warp * 16 + lane / 4 + 8 * h;
            const auto* v = &d[j / 2][(j % 2) * 4 + 2 * h];
            *reinterpret_cast<float2*>(buf + row * CW + ((col % CW) ^ ((row & 3) << SW) ^ ((ch & CHX) << 2))) =
                make_float2(static_cast<float>(v[0]), static_cast<float>(v[1]));
          }
        }
        asm volatile("bar.sync %0, 128;" ::"r"(8 + c) : "memory");  // this warpgroup's own barrier
        // Where a round's units per row (UNITS nch) divide the 128 threads, each thread takes the same columns in
        // every unit of the round: their per-channel factors are loaded once, not once a unit (an 8-bit unit's
        // three vectors of 16 floats were 12 loads for 16 bytes of output, and its memory-bound layers ran no faster
        // than FP16's)
        const bool same_cols = 128 % (UNITS * nch) == 0;
        typename Store::Factors per_channel;
        if (same_cols) {
          int row, ch, c8, col;
          long long m;
          unit(tid, nch, j0, row, ch, c8, m, col);
          if (col < K) per_channel = store.factors(col);
        }
#pragma unroll
        for (int t = 0; t < PER; ++t) {  // 8 columns a unit: a row's nch x CW side by side
          int row, ch, c8, col;
          long long m;
          const int u = tid + t * 128;
          unit(u, nch, j0, row, ch, c8, m, col);
          if (u >= nch * 64 * UNITS || m < 0 || col >= K) continue;  // K a multiple of V (the plan checks)
          if (!same_cols) per_channel = store.factors(col);
          const float* src = piece(ch) + row * CW;
          float v[V];
#pragma unroll
          for (int q = 0; q < V / 4; ++q) {
            const float4 f = *reinterpret_cast<const float4*>(src + ((c8 + 4 * q) ^ ((row & 3) << SW) ^ ((ch & CHX) << 2)));
            v[4 * q] = f.x;
            v[4 * q + 1] = f.y;
            v[4 * q + 2] = f.z;
            v[4 * q + 3] = f.w;
          }
          store.row(static_cast<size_t>(m), col, v, raw[t], per_channel);
        }
        asm volatile("bar.sync %0, 128;" ::"r"(8 + c) : "memory");
      }
    } else {
      // Straight from the fragments: rows l/4 and l/4 + 8 of the warp's 16, columns 8j + 2 (l % 4) and the next.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const long long m = pixel_of(c * 64 + warp * 16 + lane / 4 + 8 * h);
        if (m < 0) continue;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          const int col = k0 + 8 * j + 2 * (lane % 4);
          const auto* v = &d[j / 2][(j % 2) * 4 + 2 * h];
          if (col < K) store(static_cast<size_t>(m), col, static_cast<float>(v[0]), static_cast<float>(v[1]));  // K is a multiple of 8, so col + 1 < K too
        }
      }
    }
    }  // tiles
    if constexpr (TMA_OUT)
      if (tid == 0) bulk_wait<0>();  // the last stores done before the block's shared memory goes
  }
#else
  __trap();  // built for an architecture without wgmma: the launcher refuses before it gets here
#endif
}

}  // namespace hopper

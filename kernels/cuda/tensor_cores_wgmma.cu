// gpucourse-arch: sm_90a
// Lesson 4, the Hopper step: C = A B on warpgroup MMA (wgmma.mma_async), fed by the Tensor Memory
// Accelerator (cp.async.bulk.tensor) through a ring of shared-memory stages guarded by mbarriers.
//
// A: M x K, FP16, row-major (K-major).  B: K x N, FP16, row-major ("kn", MN-major for the MMA) or N x K
// row-major ("nk", K-major: B transposed, the layout cuBLAS calls "T").  C: M x N, FP32, row-major.
//
// One block computes a BM x BN tile of C with 1 + BM/64 warpgroups (128 threads each):
//   * warpgroup 0 is the PRODUCER: one of its threads asks the TMA for the next BK = 64 slice of A and B
//     (a 2-D box each, swizzled by the copy engine into the 128-byte pattern the MMA reads) and names the
//     stage's "full" mbarrier, which completes when the bytes have landed;
//   * warpgroups 1.. are CONSUMERS: each waits on "full", issues 4 wgmma.mma_async (k = 16 each) on its
//     64 rows of A against all BN columns of B, waits for them, and arrives on the stage's "empty" mbarrier
//     so that the producer may overwrite it.
// The accumulators (64 x BN FP32 per warpgroup: BN / 2 registers a thread) never leave the registers until
// the end, when each thread stores its fragment to C. setmaxnreg moves registers from the producer, which
// needs few, to the consumers, which need many.
//
// The TMA descriptors (CUtensorMap, 128 bytes) are made on the host with cuTensorMapEncodeTiled and passed
// by value as __grid_constant__ parameters (kernels/tensor_cores.py). The tensor map zero-fills reads
// outside the matrices, and stores are guarded, so M, N and K need not be multiples of the tile (the TMA
// needs row strides that are multiples of 16 bytes: K, and N for "kn", multiples of 8).
//
// The PERSISTENT variants (gemm_persistent) launch one block per SM, and each block walks the tiles blockIdx.x,
// blockIdx.x + gridDim.x, ... in the same grouped order. The producer's ring runs on from one tile into the next, so
// the next tile's first slices are loaded while the consumers store this tile's C. They write C in FP32 or, as
// cuBLAS does for FP16 inputs, in FP16 (rounded once), either straight from the registers or, "tmastore", through
// shared memory: each 64-column piece of a consumer's rows goes there by stmatrix (16-byte rows, in the TMA's
// 128-byte swizzle), and one thread hands it to the TMA, which writes it to C while the consumers go on.
// The "_c2" kernel does the same in thread-block clusters of two blocks, which take two tiles of one column of C on
// adjacent rows and share B's slices: each block loads half of them and the TMA multicasts it into both, so B crosses
// from the L2 to the SMs once for two tiles.
//
// Everything below needs sm_90a (compute capability 9.0 exactly); compiled for any other architecture the
// kernels are empty stubs that trap (tests/test_gpu_archs.py compiles every source for every GPU).

#include <cuda_fp16.h>

#include "hopper.cuh"
#include "hopper_gemm.cuh"

namespace hopper {

// BM x BN tile of C, STAGES deep ring of (A, B) slices; B_KN: B is K x N (MN-major) rather than N x K.
template <int BM, int BN, int STAGES, bool B_KN>
__device__ __forceinline__ void gemm_tile(const TensorMap* tmA, const TensorMap* tmB, float* __restrict__ C, int M,
                                          int N, int K, int group_m) {
#ifdef GPUCOURSE_WGMMA
  constexpr int CONSUMERS = BM / 64;
  constexpr unsigned A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
  extern __shared__ unsigned char smem_raw[];
  // 128-byte swizzled tiles must start on a 1024-byte boundary (the pattern repeats every 8 rows of 128 B)
  unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  unsigned char* sA = smem;                       // STAGES x [BM][64] FP16
  unsigned char* sB = smem + STAGES * A_BYTES;    // STAGES x [BN][64] (nk) or [BN/64][64][64] (kn) FP16
  unsigned long long* full = reinterpret_cast<unsigned long long*>(sB + STAGES * B_BYTES);
  unsigned long long* empty = full + STAGES;

  const int wg = warpgroup_index(), tid = threadIdx.x % 128;
  if (threadIdx.x == 0) Ring<STAGES>{full, empty}.init(CONSUMERS);  // full: the producer + the TMA's bytes
  __syncthreads();

  // Which tile: blocks run in groups of group_m tile-rows, so that the blocks resident at one time share
  // rows of A and columns of B in the L2 cache (hopper_gemm.cuh).
  int m0, n0;
  GroupedTiles<BM, BN>(M, N, group_m).origin(blockIdx.x, m0, n0);
  const int kblocks = (K + BK - 1) / BK;

  // region: wgmma_roles
  if (wg == 0) {  // ------------------------------------------------------------------ producer
    if constexpr (CONSUMERS > 1) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (tid == 0) {
      for (int kb = 0; kb < kblocks; ++kb) {
        const int s = kb % STAGES;
        if (kb >= STAGES) mbar_wait(&empty[s], ((kb / STAGES) + 1) & 1);  // consumers are done with it
        mbar_expect_tx(&full[s], A_BYTES + B_BYTES);
        tma_load_2d(sA + s * A_BYTES, tmA, &full[s], kb * BK, m0);
        if constexpr (B_KN) {
          for (int j = 0; j < BN / 64; ++j)  // boxes of 64 columns x 64 rows of B
            tma_load_2d(sB + s * B_BYTES + j * (BK * 128), tmB, &full[s], n0 + 64 * j, kb * BK);
        } else {
          tma_load_2d(sB + s * B_BYTES, tmB, &full[s], kb * BK, n0);
        }
      }
    }
  } else {  // ---------------------------------------------------------------------- consumers
    if constexpr (CONSUMERS > 1) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int c = wg - 1;
    float d[BN / 16][8];
#pragma unroll
    for (int i = 0; i < BN / 16; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) d[i][j] = 0.0f;
    for (int kb = 0; kb < kblocks; ++kb) {
      const int s = kb % STAGES;
      mbar_wait(&full[s], (kb / STAGES) & 1);  // the TMA's bytes have landed
      const unsigned a0 = smem_addr(sA + s * A_BYTES + c * 64 * 128);  // this warpgroup's 64 rows
      const unsigned b0 = smem_addr(sB + s * B_BYTES);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        // K-major, 128-byte swizzle: k advances 16 elements = 32 bytes inside the swizzled row; the 8-row
        // core blocks lie 1024 bytes apart (SBO); LBO is unused for this layout.
        const unsigned long long da = make_desc(a0 + kk * 32, 16, 1024);
        unsigned long long db;
        if constexpr (B_KN)  // MN-major: k advances 16 rows of 128 bytes; the next 64 columns are a box further
          db = make_desc(b0 + kk * 16 * 128, BK * 128, 1024);
        else
          db = make_desc(b0 + kk * 32, 16, 1024);
        wgmma_k16<BN, B_KN ? 1 : 0>(d, da, db, 1);
      }
      wgmma_commit();
      wgmma_wait<0>();  // this stage's MMAs have read their operands ...
      if (tid == 0) mbar_arrive(&empty[s]);  // ... so the producer may refill it
    }
    // Store the fragment: warp w of the warpgroup holds rows 16w .. 16w + 15; lane l holds rows l/4 and
    // l/4 + 8, columns 8i + 2 (l % 4) and the next one, for i = 0 .. BN/8 - 1.
    const int warp = tid / 32, lane = tid % 32;
    const int row = m0 + c * 64 + warp * 16 + lane / 4;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      const int col = n0 + 8 * i + 2 * (lane % 4);
      const float* v = &d[i / 2][(i % 2) * 4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row + 8 * h;
        if (r < M) {
          float* out = C + static_cast<size_t>(r) * N + col;
          if (col + 1 < N && (N % 2) == 0) {
            *reinterpret_cast<float2*>(out) = make_float2(v[2 * h], v[2 * h + 1]);
          } else {
            if (col < N) out[0] = v[2 * h];
            if (col + 1 < N) out[1] = v[2 * h + 1];
          }
        }
      }
    }
  }
  // endregion
#else
  __trap();  // built for an architecture without wgmma: the launcher refuses before it gets here
#endif
}

#ifdef GPUCOURSE_WGMMA
// Two neighbouring columns of a row of C (8- or 4-byte aligned), and one, in C's type: FP16 rounded once.
__device__ __forceinline__ void store_c2(float* out, float a, float b) { *reinterpret_cast<float2*>(out) = make_float2(a, b); }
__device__ __forceinline__ void store_c2(__half* out, float a, float b) {
  *reinterpret_cast<__half2*>(out) = __floats2half2_rn(a, b);
}
__device__ __forceinline__ void store_c1(float* out, float a) { *out = a; }
__device__ __forceinline__ void store_c1(__half* out, float a) { *out = __float2half_rn(a); }
#endif

// gemm_tile's work, persistent: block b computes tiles b, b + gridDim.x, ... (the host launches min(tiles, SMs)
// blocks; the schedule, the ring and the TMA store are hopper_gemm.cuh's, shared with the FP8 GEMM). OUT: float or
// __half. TMA_STORE (OUT = __half only): C leaves through shared memory and the TMA (tmC, a map of C in boxes of
// 64 x 64, 128-byte swizzle); otherwise each thread stores its fragment to C. IN_FLIGHT = 1: a consumer issues a
// slice's MMAs and then waits only for the previous slice's (wgmma.wait_group 1), so that the tensor cores have the
// next slice's work queued while the last one finishes, and hands that previous stage back; 0: it waits for this
// slice's own MMAs before the next (the pipeline drains at every stage). IN_FLIGHT = 1 keeps one stage less free for
// the producer.
// CLUSTER = 2 ("kn" B, the TMA store): launched in clusters of two blocks along x (the kernel's __cluster_dims__; the
// host launches 2 min(cluster tiles, SMs / 2) blocks), which take two tiles of one column of C on adjacent rows in
// lockstep (hopper_gemm.cuh's ClusterTiles) and share B's slices: each block loads half of a slice's BN / 64 boxes of
// B and the TMA multicasts them into both blocks' stages at the same offsets; the ring's barriers span the cluster
// (Ring<STAGES, 2>). The same MMAs on the same tiles: C bit for bit the one-block kernel's.
template <int BM, int BN, int STAGES, bool B_KN, typename OUT, bool TMA_STORE, int IN_FLIGHT = 0, int CLUSTER = 1>
__device__ __forceinline__ void gemm_persistent(const TensorMap* tmA, const TensorMap* tmB, const TensorMap* tmC,
                                                OUT* __restrict__ C, int M, int N, int K, int group_m) {
#ifdef GPUCOURSE_WGMMA
  static_assert(CLUSTER == 1 || (CLUSTER == 2 && B_KN && TMA_STORE && BN % (64 * CLUSTER) == 0),
                "clusters of two: B in K x N boxes of 64 columns, split evenly between the blocks; C by the TMA");
  constexpr int CONSUMERS = BM / 64;
  constexpr unsigned A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
  constexpr unsigned C_BYTES = TMA_STORE ? CONSUMERS * 2 * STORE_PIECE_BYTES : 0;  // two pieces a consumer, in turn
  static_assert(!TMA_STORE || (sizeof(OUT) == 2 && BN % 64 == 0), "the TMA store: FP16 C, 64-column pieces");
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  unsigned char* sA = smem;                     // STAGES x [BM][64] FP16
  unsigned char* sB = smem + STAGES * A_BYTES;  // STAGES x [BN][64] (nk) or [BN/64][64][64] (kn) FP16
  unsigned char* sC = sB + STAGES * B_BYTES;    // TMA_STORE: CONSUMERS x 2 x [64][64] FP16, swizzled
  unsigned long long* full = reinterpret_cast<unsigned long long*>(sC + C_BYTES);
  const Ring<STAGES, CLUSTER> ring{full, full + STAGES};

  const int wg = warpgroup_index(), tid = threadIdx.x % 128;
  if (threadIdx.x == 0) ring.init(CONSUMERS);
  if constexpr (CLUSTER > 1)
    cluster_sync();  // both blocks' barriers exist before either block's TMA or consumers reach the other's
  else
    __syncthreads();

  const typename TilesOf<BM, BN, CLUSTER>::type tiles(M, N, group_m);
  const int kblocks = (K + BK - 1) / BK;

  if (wg == 0) {  // ------------------------------------------------------------------ producer
    producer_regs<CONSUMERS>();
    if (tid == 0)
      produce_tiles(tiles, ring, kblocks, A_BYTES + B_BYTES,  // (in a cluster: all of B lands in each block)
                    [&](int s, unsigned long long* bar, int kb, int m0, int n0) {
                      tma_load_2d(sA + s * A_BYTES, tmA, bar, kb * BK, m0);
                      if constexpr (CLUSTER > 1) {  // this block's BN / 128 boxes of B, into both blocks
                        constexpr int MINE = BN / 64 / CLUSTER;
                        for (int j = static_cast<int>(tiles.rank) * MINE; j < (static_cast<int>(tiles.rank) + 1) * MINE;
                             ++j)
                          tma_load_2d_multicast(sB + s * B_BYTES + j * (BK * 128), tmB, bar, n0 + 64 * j, kb * BK,
                                                (1u << CLUSTER) - 1);
                      } else if constexpr (B_KN) {
                        for (int j = 0; j < BN / 64; ++j)
                          tma_load_2d(sB + s * B_BYTES + j * (BK * 128), tmB, bar, n0 + 64 * j, kb * BK);
                      } else {
                        tma_load_2d(sB + s * B_BYTES, tmB, bar, kb * BK, n0);
                      }
                    });
  } else {  // ---------------------------------------------------------------------- consumers
    consumer_regs<CONSUMERS>();
    const int c = wg - 1, warp = tid / 32, lane = tid % 32;
    int g = 0;       // slices used so far, as the producer counts them
    int stored = 0;  // TMA_STORE: pieces of C this consumer has handed to the TMA
    for (int t = tiles.first(); t < tiles.count; t += tiles.step()) {
      int m0, n0;
      const bool in_c = tiles.origin(t, m0, n0);  // false: a cluster's tile below C's last row, loaded, not stored
      float d[BN / 16][8];
#pragma unroll
      for (int i = 0; i < BN / 16; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) d[i][j] = 0.0f;
      for (int kb = 0; kb < kblocks; ++kb, ++g) {
        const int s = ring.wait_full(g);
        const unsigned a0 = smem_addr(sA + s * A_BYTES + c * 64 * 128);
        const unsigned b0 = smem_addr(sB + s * B_BYTES);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
          const unsigned long long da = make_desc(a0 + kk * 32, 16, 1024);
          unsigned long long db;
          if constexpr (B_KN)
            db = make_desc(b0 + kk * 16 * 128, BK * 128, 1024);
          else
            db = make_desc(b0 + kk * 32, 16, 1024);
          wgmma_k16<BN, B_KN ? 1 : 0>(d, da, db, 1);
        }
        wgmma_commit();
        if constexpr (IN_FLIGHT == 1) {
          wgmma_wait<1>();  // the previous slice's MMAs have read their stage; this slice's run on
          if (tid == 0 && kb > 0) ring.release((g - 1) % STAGES);
        } else {
          static_assert(IN_FLIGHT == 0, "IN_FLIGHT: 0 or 1 slices' MMAs left running");
          wgmma_wait<0>();
          if (tid == 0) ring.release(s);
        }
      }
      if constexpr (IN_FLIGHT == 1) {  // the tile's last slice: its MMAs done before the epilogue reads d
        wgmma_wait<0>();
        if (tid == 0) ring.release((g - 1) % STAGES);
      }
      // The epilogue. Meanwhile the producer fills the stages just freed with the next tile's first slices.
      if constexpr (TMA_STORE) {
        if (in_c)
          store_tile_tma<BN>(d, sC + c * 2 * STORE_PIECE_BYTES, stored, tmC, m0 + c * 64, n0, M, N, 1 + c,
                             [](float x, float y) { return half2_bits(x, y); });
      } else {
        // As gemm_tile: warp w holds rows 16w .. 16w + 15; lane l rows l/4 and l/4 + 8, columns 8i + 2 (l % 4)
        // and the next one.
        const int row = m0 + c * 64 + warp * 16 + lane / 4;
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
          const int col = n0 + 8 * i + 2 * (lane % 4);
          const float* v = &d[i / 2][(i % 2) * 4];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = row + 8 * h;
            if (r < M) {
              OUT* out = C + static_cast<size_t>(r) * N + col;
              if (col + 1 < N && (N % 2) == 0) {
                store_c2(out, v[2 * h], v[2 * h + 1]);
              } else {
                if (col < N) store_c1(out, v[2 * h]);
                if (col + 1 < N) store_c1(out + 1, v[2 * h + 1]);
              }
            }
          }
        }
      }
    }
    if constexpr (TMA_STORE) store_tma_drain();
  }
  if constexpr (CLUSTER > 1) cluster_sync();  // no block leaves while its partner may still multicast into it or
                                              // arrive on its barriers
#else
  __trap();
#endif
}

}  // namespace hopper

// The kernels the course launches (kernels/tensor_cores.py, WGMMA_CONFIGS): tile BM x BN x 64, stages, B layout.
#define WGMMA_GEMM(BM, BN, S, LAYOUT, KN)                                                                        \
  extern "C" __global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)                                         \
      wgmma_##BM##x##BN##x64_s##S##_##LAYOUT(const __grid_constant__ TensorMap tmA,                             \
                                             const __grid_constant__ TensorMap tmB, float* C, int M, int N,    \
                                             int K, int group_m) {                                             \
    hopper::gemm_tile<BM, BN, S, KN>(&tmA, &tmB, C, M, N, K, group_m);                                        \
  }

WGMMA_GEMM(128, 256, 4, kn, true)
WGMMA_GEMM(128, 256, 4, nk, false)
WGMMA_GEMM(128, 256, 3, kn, true)
WGMMA_GEMM(128, 256, 2, kn, true)
WGMMA_GEMM(128, 256, 1, kn, true)
WGMMA_GEMM(64, 256, 4, kn, true)
WGMMA_GEMM(128, 128, 4, kn, true)
WGMMA_GEMM(128, 128, 6, kn, true)

// The persistent kernels (gemm_persistent): C in OUT (float or __half), straight from the registers ...
#define WGMMA_PERSISTENT(BM, BN, S, LAYOUT, KN, SUFFIX, OUT)                                                    \
  extern "C" __global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)                                         \
      wgmma_##BM##x##BN##x64_s##S##_##LAYOUT##_persistent##SUFFIX(const __grid_constant__ TensorMap tmA,         \
                                                                  const __grid_constant__ TensorMap tmB,         \
                                                                  OUT* C, int M, int N, int K, int group_m) {    \
    hopper::gemm_persistent<BM, BN, S, KN, OUT, false>(&tmA, &tmB, nullptr, C, M, N, K, group_m);             \
  }
// ... or FP16 through shared memory and the TMA (tmC: C in boxes of 64 x 64)
#define WGMMA_PERSISTENT_TMA_STORE(BM, BN, S, LAYOUT, KN)                                                       \
  extern "C" __global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)                                         \
      wgmma_##BM##x##BN##x64_s##S##_##LAYOUT##_persistent_f16_tmastore(                                        \
          const __grid_constant__ TensorMap tmA, const __grid_constant__ TensorMap tmB,                         \
          const __grid_constant__ TensorMap tmC, int M, int N, int K, int group_m) {                           \
    hopper::gemm_persistent<BM, BN, S, KN, __half, true>(&tmA, &tmB, &tmC, nullptr, M, N, K, group_m);        \
  }

// ... and the same with one slice's MMAs left running (IN_FLIGHT = 1), in three tiles that a shape chooses among
// (kernels/tensor_cores.py, persistent_tile): 128 x 256 (two consumers of 64 x 256: 128 accumulators a thread),
// 128 x 192 (96) and 128 x 128 (64), 4, 4 and 6 stages (the most that fit beside C's 32 KiB of pieces)
#define WGMMA_PERSISTENT_TMA_STORE_WAIT1(BM, BN, S, LAYOUT, KN)                                                 \
  extern "C" __global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)                                         \
      wgmma_##BM##x##BN##x64_s##S##_##LAYOUT##_persistent_f16_tmastore_wait1(                                  \
          const __grid_constant__ TensorMap tmA, const __grid_constant__ TensorMap tmB,                         \
          const __grid_constant__ TensorMap tmC, int M, int N, int K, int group_m) {                           \
    hopper::gemm_persistent<BM, BN, S, KN, __half, true, 1>(&tmA, &tmB, &tmC, nullptr, M, N, K, group_m);     \
  }

WGMMA_PERSISTENT(128, 256, 4, kn, true, , float)
WGMMA_PERSISTENT(128, 256, 4, kn, true, _f16, __half)
WGMMA_PERSISTENT_TMA_STORE(128, 256, 4, kn, true)
WGMMA_PERSISTENT_TMA_STORE_WAIT1(128, 256, 4, kn, true)
WGMMA_PERSISTENT_TMA_STORE_WAIT1(128, 192, 4, kn, true)
WGMMA_PERSISTENT_TMA_STORE_WAIT1(128, 128, 6, kn, true)

// ... and the TMA-store kernel in clusters of two blocks along M sharing B's slices, each block loading half of B's
// boxes and the TMA multicasting them to both; the grid's size a multiple of 2
#define WGMMA_PERSISTENT_TMA_STORE_C2(BM, BN, S, LAYOUT, KN)                                                    \
  extern "C" __global__ void GPUCOURSE_CLUSTER_DIMS(2) __launch_bounds__((BM / 64 + 1) * 128, 1)               \
      wgmma_##BM##x##BN##x64_s##S##_##LAYOUT##_persistent_f16_tmastore_c2(                                     \
          const __grid_constant__ TensorMap tmA, const __grid_constant__ TensorMap tmB,                         \
          const __grid_constant__ TensorMap tmC, int M, int N, int K, int group_m) {                           \
    hopper::gemm_persistent<BM, BN, S, KN, __half, true, 0, 2>(&tmA, &tmB, &tmC, nullptr, M, N, K, group_m);  \
  }

WGMMA_PERSISTENT_TMA_STORE_C2(128, 256, 4, kn, true)

// gpucourse-arch: sm_90a
// Lesson 4, FP8 on Hopper: C = (A scale_a) (B scale_b)^T on wgmma's e4m3 path, fed by the TMA as the FP16 GEMM of
// tensor_cores_wgmma.cu is, and rounded once to FP16 or BF16.
//
// A: M x K e4m3 codes, row-major (K-major). B: N x K e4m3 codes, row-major: B transposed, since FP8 wgmma takes
// both operands K-major (it has no transpose bit for 8-bit types). scale_a, scale_b: one float32 each, in device
// memory (what quantised the tensors, as torch._scaled_mm takes them), read by the epilogue. C: M x N, FP16 or BF16.
//
// A stage holds BK = 128 codes of each row: 128 bytes, one row of the 128-byte swizzle, so the shared-memory tiles,
// the tensor maps' boxes and the descriptors are byte for byte those of the FP16 kernel's "nk" layout (64 FP16 are
// 128 bytes too); wgmma's 8-bit shape takes K = 32 an instruction (32 bytes, as FP16's K = 16), 4 a stage.
//
// The accumulator. Hopper's FP8 wgmma adds its products into the FP32 registers it is given with fewer bits than
// FP32 keeps, so over a long K the error grows faster than an FP32 sum's. Two ways, a template argument apart:
//   * FAST: every wgmma of the K loop adds into the same registers (BN = 256: 128 accumulators a thread);
//   * PROMOTED: each stage's 4 wgmmas (K = 128) start from zero in a second set of registers, which the consumer
//     then adds into the first in ordinary FP32 (what cuBLAS does unless asked for "fast accumulation"). Two sets
//     of BN / 2 registers fit only for BN = 128.
// kernels/tensor_cores_fp8.py launches them (gemm_fp8) and measures what each costs and what each gets right.
//
// The PERSISTENT variants (gemm_fp8_persistent) are the FP16 GEMM's persistent kernel with this mainloop: min(tiles,
// SMs) blocks, each walking tiles blockIdx.x, blockIdx.x + gridDim.x, ... in the grouped order, the producer's ring
// running on from one tile into the next, and C leaving through shared memory (stmatrix, 128-byte swizzle) and the
// TMA in 64 x 64 pieces, each value times scale_a scale_b before it is rounded; the schedule, the ring and the store
// are hopper_gemm.cuh's, shared with tensor_cores_wgmma.cu. The "_c2" ones run in thread-block clusters of two
// blocks, which take two tiles of one column of C on adjacent rows and share B's slices: each block loads half of
// B's slice and the TMA multicasts it into both, so B crosses from the L2 to the SMs once for two tiles.
//
// Everything below needs sm_90a; compiled for any other architecture the kernels are stubs that trap.

#include "e4m3.cuh"
#include "hopper.cuh"
#include "hopper_gemm.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace hopper {

template <typename T>
__device__ __forceinline__ void store_pair(T* out, float a, float b);
template <>
__device__ __forceinline__ void store_pair<__half>(__half* out, float a, float b) {
  *reinterpret_cast<__half2*>(out) = __floats2half2_rn(a, b);
}
template <>
__device__ __forceinline__ void store_pair<__nv_bfloat16>(__nv_bfloat16* out, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(a, b);
}
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
// Two values rounded to OUT in one 32-bit word, the first in the low half: what stmatrix takes.
template <typename T>
__device__ __forceinline__ unsigned pack_pair(float a, float b);
template <>
__device__ __forceinline__ unsigned pack_pair<__half>(float a, float b) { return half2_bits(a, b); }
template <>
__device__ __forceinline__ unsigned pack_pair<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}

#ifdef GPUCOURSE_WGMMA
// One stage of a consumer warpgroup's K loop: its 64 rows of A (from a0) against the BN rows of B (from b0), K = 128
// codes in 4 wgmmas of K = 32, into d, FAST or PROMOTED (the header above); then the stage goes back to the producer
// (one thread arrives on ``empty``; in a cluster of CLUSTER blocks, on the one at its offset in each: release_stage).
template <int BN, bool PROMOTED, int CLUSTER = 1>
__device__ __forceinline__ void fp8_stage(float (&d)[BN / 16][8], unsigned a0, unsigned b0, unsigned long long* empty) {
  constexpr int BK8 = 2 * BK;
  if constexpr (PROMOTED) {
    float t[BN / 16][8];  // this stage's K = 128, from zero (scale_d = 0 on the first wgmma)
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK8 / 32; ++kk)
      wgmma_k32_e4m3<BN>(t, make_desc(a0 + kk * 32, 16, 1024), make_desc(b0 + kk * 32, 16, 1024), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    if (threadIdx.x % 128 == 0) release_stage<CLUSTER>(empty);
#pragma unroll
    for (int i = 0; i < BN / 16; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) d[i][j] += t[i][j];  // promoted: an ordinary FP32 add
  } else {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK8 / 32; ++kk)
      wgmma_k32_e4m3<BN>(d, make_desc(a0 + kk * 32, 16, 1024), make_desc(b0 + kk * 32, 16, 1024), 1);
    wgmma_commit();
    wgmma_wait<0>();
    if (threadIdx.x % 128 == 0) release_stage<CLUSTER>(empty);
  }
}
#endif

// BM x BN tile of C, STAGES deep ring of (A, B) slices of BK = 128 codes; OUT: __half or __nv_bfloat16.
template <int BM, int BN, int STAGES, bool PROMOTED, typename OUT>
__device__ __forceinline__ void gemm_fp8_tile(const TensorMap* tmA, const TensorMap* tmB, OUT* __restrict__ C,
                                              const float* __restrict__ scale_a, const float* __restrict__ scale_b,
                                              int M, int N, int K, int group_m) {
#ifdef GPUCOURSE_WGMMA
  constexpr int BK8 = 2 * BK;  // codes of K a stage: 128 bytes, as the FP16 kernel's 64 FP16
  constexpr int CONSUMERS = BM / 64;
  constexpr unsigned A_BYTES = BM * BK8, B_BYTES = BN * BK8;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);  // the swizzle's 1024-byte grid
  unsigned char* sA = smem;                     // STAGES x [BM][128] e4m3
  unsigned char* sB = smem + STAGES * A_BYTES;  // STAGES x [BN][128] e4m3
  unsigned long long* full = reinterpret_cast<unsigned long long*>(sB + STAGES * B_BYTES);
  unsigned long long* empty = full + STAGES;

  // not warpgroup_index() (the FP16 GEMM's): timed in turns, it made these kernels 0-2% slower (engineering note 04)
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  if (threadIdx.x == 0) Ring<STAGES>{full, empty}.init(CONSUMERS);
  __syncthreads();

  int m0, n0;  // this block's tile, in the grouped order (hopper_gemm.cuh)
  GroupedTiles<BM, BN>(M, N, group_m).origin(blockIdx.x, m0, n0);
  const int kblocks = (K + BK8 - 1) / BK8;

  if (wg == 0) {  // ------------------------------------------------------------------ producer
    producer_regs<CONSUMERS>();
    if (tid == 0) {
      for (int kb = 0; kb < kblocks; ++kb) {
        const int s = kb % STAGES;
        if (kb >= STAGES) mbar_wait(&empty[s], ((kb / STAGES) + 1) & 1);
        mbar_expect_tx(&full[s], A_BYTES + B_BYTES);
        tma_load_2d(sA + s * A_BYTES, tmA, &full[s], kb * BK8, m0);
        tma_load_2d(sB + s * B_BYTES, tmB, &full[s], kb * BK8, n0);
      }
    }
  } else {  // ---------------------------------------------------------------------- consumers
    consumer_regs<CONSUMERS>();
    const int c = wg - 1;
    float d[BN / 16][8];
#pragma unroll
    for (int i = 0; i < BN / 16; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) d[i][j] = 0.0f;
    for (int kb = 0; kb < kblocks; ++kb) {
      const int s = kb % STAGES;
      mbar_wait(&full[s], (kb / STAGES) & 1);
      fp8_stage<BN, PROMOTED>(d, smem_addr(sA + s * A_BYTES + c * 64 * 128),  // this warpgroup's 64 rows
                              smem_addr(sB + s * B_BYTES), &empty[s]);
    }
    // The fragment, as the FP16 kernel's: warp w holds rows 16w .. 16w + 15; lane l rows l/4 and l/4 + 8, columns
    // 8i + 2 (l % 4) and the next one. Each value times scale_a scale_b, rounded once to OUT.
    const float alpha = __ldg(scale_a) * __ldg(scale_b);
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
          OUT* out = C + static_cast<size_t>(r) * N + col;
          if (col + 1 < N && (N % 2) == 0) {
            store_pair<OUT>(out, alpha * v[2 * h], alpha * v[2 * h + 1]);
          } else {
            if (col < N) out[0] = from_float<OUT>(alpha * v[2 * h]);
            if (col + 1 < N) out[1] = from_float<OUT>(alpha * v[2 * h + 1]);
          }
        }
      }
    }
  }
#else
  __trap();  // built for an architecture without wgmma: the launcher refuses before it gets here
#endif
}

// gemm_fp8_tile's work, persistent, with C stored by the TMA: block b computes tiles b, b + gridDim.x, ... (the host
// launches min(tiles, SMs) blocks). tmC: a map of C (FP16 or BF16 bits) in boxes of 64 x 64, 128-byte swizzle.
//
// CLUSTER = 2: launched in clusters of two blocks along x (the kernel's __cluster_dims__; the host launches
// 2 min(cluster tiles, SMs / 2) blocks), the two taking two tiles of one column of C on adjacent rows in lockstep
// (ClusterTiles). Each loads its A and half of the slice of B they share, BN / 2 rows (tmB: a map in boxes of BN / 2 x
// 128), which the TMA multicasts into both blocks' stages at the same offset: each operand byte of B leaves the L2
// once for two tiles. The ring's barriers span the cluster (Ring<STAGES, 2>). The same wgmmas in the same order on
// the same tiles: C bit for bit the one-block kernel's.
//
// STREAM_K (one block, no cluster): the last sk.sk_tiles tiles are shared out by slices (hopper_gemm.cuh's StreamK): a
// consumer's piece that is not its tile's first leaves as FP32 sums to sk.partials; the tile's owner adds them before
// its epilogue. sk.sk_tiles = 0: the same units, the same bits, as the kernel without it.
template <int BM, int BN, int STAGES, bool PROMOTED, typename OUT, int CLUSTER = 1, bool STREAM_K = false>
__device__ __forceinline__ void gemm_fp8_persistent(const TensorMap* tmA, const TensorMap* tmB, const TensorMap* tmC,
                                                    const float* __restrict__ scale_a,
                                                    const float* __restrict__ scale_b, int M, int N, int K,
                                                    int group_m, const StreamK& sk = StreamK{}) {
#ifdef GPUCOURSE_WGMMA
  static_assert(CLUSTER == 1 || CLUSTER == 2, "one block, or clusters of two");
  static_assert(!STREAM_K || CLUSTER == 1, "the stream-K tail: one block, no cluster");
  constexpr int BK8 = 2 * BK;
  constexpr int CONSUMERS = BM / 64;
  constexpr unsigned A_BYTES = BM * BK8, B_BYTES = BN * BK8;
  constexpr unsigned C_BYTES = CONSUMERS * 2 * STORE_PIECE_BYTES;  // two pieces of C a consumer, used in turn
  static_assert((B_BYTES / CLUSTER) % 1024 == 0, "each block's part of B starts on the swizzle's 1024-byte grid");
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  unsigned char* sA = smem;                     // STAGES x [BM][128] e4m3
  unsigned char* sB = smem + STAGES * A_BYTES;  // STAGES x [BN][128] e4m3
  unsigned char* sC = sB + STAGES * B_BYTES;    // CONSUMERS x 2 x [64][64] of OUT, swizzled
  unsigned long long* full = reinterpret_cast<unsigned long long*>(sC + C_BYTES);
  const Ring<STAGES, CLUSTER> ring{full, full + STAGES};

  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  if (threadIdx.x == 0) ring.init(CONSUMERS);
  if constexpr (CLUSTER > 1)
    cluster_sync();  // both blocks' barriers exist before either block's TMA or consumers reach the other's
  else
    __syncthreads();

  const typename TilesOf<BM, BN, CLUSTER>::type tiles(M, N, group_m);
  const int kblocks = (K + BK8 - 1) / BK8;

  if (wg == 0) {  // ------------------------------------------------------------------ producer
    producer_regs<CONSUMERS>();
    const auto load = [&](int s, unsigned long long* bar, int kb, int m0, int n0) {
      tma_load_2d(sA + s * A_BYTES, tmA, bar, kb * BK8, m0);
      if constexpr (CLUSTER == 1) {
        tma_load_2d(sB + s * B_BYTES, tmB, bar, kb * BK8, n0);
      } else {  // rows r BN / 2 .. of the slice, into both blocks (mask: every rank of the cluster)
        const unsigned r = tiles.rank;
        tma_load_2d_multicast(sB + s * B_BYTES + r * (B_BYTES / CLUSTER), tmB, bar, kb * BK8,
                              n0 + static_cast<int>(r) * (BN / CLUSTER), (1u << CLUSTER) - 1);
      }
    };
    if (tid == 0) {  // this block's A and all of B (in a cluster both halves land here)
      if constexpr (STREAM_K)
        produce_units(tiles, ring, kblocks, sk.sk_tiles, A_BYTES + B_BYTES, load);
      else
        produce_tiles(tiles, ring, kblocks, A_BYTES + B_BYTES, load);
    }
  } else {  // ---------------------------------------------------------------------- consumers
    consumer_regs<CONSUMERS>();
    const int c = wg - 1;
    const float alpha = __ldg(scale_a) * __ldg(scale_b);
    int g = 0;       // slices used so far, as the producer counts them
    int stored = 0;  // pieces of C this consumer has handed to the TMA
    // Tile t's slices k0 .. k1 - 1 (all of them but in a stream-K tail).
    const auto unit = [&](int t, int k0, int k1) {
      int m0, n0;
      const bool in_c = tiles.origin(t, m0, n0);  // false: a cluster's tile below C's last row, loaded, not stored
      float d[BN / 16][8];
#pragma unroll
      for (int i = 0; i < BN / 16; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) d[i][j] = 0.0f;
      for (int kb = k0; kb < k1; ++kb, ++g) {
        const int s = ring.wait_full(g);
        fp8_stage<BN, PROMOTED, CLUSTER>(d, smem_addr(sA + s * A_BYTES + c * 64 * 128), smem_addr(sB + s * B_BYTES),
                                         &ring.empty[s]);
      }
      if constexpr (STREAM_K) {
        if (k0 > 0) {  // a piece after the tile's first: its sums go to the tile's owner
          sk_store_piece<BN>(d, sk, CONSUMERS, c, 1 + c);
          return;
        }
        if (k1 < kblocks) sk_add_pieces<BN>(d, sk, CONSUMERS, c, t - (tiles.count - sk.sk_tiles), kblocks, 1 + c);
      }
      // The epilogue, while the producer loads the next tile's first slices: each value times scale_a scale_b,
      // rounded once to OUT, as gemm_fp8_tile's.
      if (in_c)
        store_tile_tma<BN>(d, sC + c * 2 * STORE_PIECE_BYTES, stored, tmC, m0 + c * 64, n0, M, N, 1 + c,
                           [alpha](float x, float y) { return pack_pair<OUT>(alpha * x, alpha * y); });
    };
    if constexpr (STREAM_K)
      for_each_unit(tiles.count, kblocks, sk.sk_tiles, unit);
    else
      for (int t = tiles.first(); t < tiles.count; t += tiles.step()) unit(t, 0, kblocks);
    store_tma_drain();
  }
  if constexpr (CLUSTER > 1) cluster_sync();  // no block leaves while its partner may still multicast into it or
                                              // arrive on its barriers
#else
  __trap();
#endif
}

}  // namespace hopper

// The kernels kernels/tensor_cores_fp8.py launches (FP8_CONFIGS): tile BM x BN x 128, stages, accumulation, output.
#define FP8_GEMM(BM, BN, S, ACC, PROMOTED, OUTNAME, OUT)                                                           \
  extern "C" __global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)                                           \
      fp8_gemm_##BM##x##BN##x128_s##S##_##ACC##_##OUTNAME(                                                        \
          const __grid_constant__ TensorMap tmA, const __grid_constant__ TensorMap tmB, OUT* C,                   \
          const float* scale_a, const float* scale_b, int M, int N, int K, int group_m) {                         \
    hopper::gemm_fp8_tile<BM, BN, S, PROMOTED, OUT>(&tmA, &tmB, C, scale_a, scale_b, M, N, K, group_m);          \
  }

FP8_GEMM(128, 256, 4, fast, false, f16, __half)
FP8_GEMM(128, 256, 4, fast, false, bf16, __nv_bfloat16)
FP8_GEMM(128, 128, 6, promoted, true, f16, __half)
FP8_GEMM(128, 128, 6, promoted, true, bf16, __nv_bfloat16)
FP8_GEMM(128, 128, 6, fast, false, f16, __half)
FP8_GEMM(128, 128, 6, fast, false, bf16, __nv_bfloat16)

// ... and persistent, C stored by the TMA (tmC: C in boxes of 64 x 64).
#define FP8_GEMM_PERSISTENT(BM, BN, S, ACC, PROMOTED, OUTNAME, OUT)                                                \
  extern "C" __global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)                                           \
      fp8_gemm_##BM##x##BN##x128_s##S##_##ACC##_persistent_tmastore_##OUTNAME(                                    \
          const __grid_constant__ TensorMap tmA, const __grid_constant__ TensorMap tmB,                           \
          const __grid_constant__ TensorMap tmC, const float* scale_a, const float* scale_b, int M, int N, int K, \
          int group_m) {                                                                                          \
    hopper::gemm_fp8_persistent<BM, BN, S, PROMOTED, OUT>(&tmA, &tmB, &tmC, scale_a, scale_b, M, N, K, group_m); \
  }

FP8_GEMM_PERSISTENT(128, 256, 4, fast, false, f16, __half)
FP8_GEMM_PERSISTENT(128, 256, 4, fast, false, bf16, __nv_bfloat16)
FP8_GEMM_PERSISTENT(128, 128, 6, promoted, true, f16, __half)
FP8_GEMM_PERSISTENT(128, 128, 6, promoted, true, bf16, __nv_bfloat16)

// ... and in clusters of two blocks along M sharing B's tile, half of it loaded by each and multicast to both (tmB: B
// in boxes of BN / 2 x 128); the grid's size a multiple of 2.
#define FP8_GEMM_PERSISTENT_C2(BM, BN, S, ACC, PROMOTED, OUTNAME, OUT)                                             \
  extern "C" __global__ void GPUCOURSE_CLUSTER_DIMS(2) __launch_bounds__((BM / 64 + 1) * 128, 1)                 \
      fp8_gemm_##BM##x##BN##x128_s##S##_##ACC##_persistent_tmastore_c2_##OUTNAME(                                 \
          const __grid_constant__ TensorMap tmA, const __grid_constant__ TensorMap tmB,                           \
          const __grid_constant__ TensorMap tmC, const float* scale_a, const float* scale_b, int M, int N, int K, \
          int group_m) {                                                                                          \
    hopper::gemm_fp8_persistent<BM, BN, S, PROMOTED, OUT, 2>(&tmA, &tmB, &tmC, scale_a, scale_b, M, N, K,       \
                                                             group_m);                                            \
  }

FP8_GEMM_PERSISTENT_C2(128, 256, 4, fast, false, f16, __half)
FP8_GEMM_PERSISTENT_C2(128, 256, 4, fast, false, bf16, __nv_bfloat16)

// ... and one block an SM with the last wave shared out by slices (hopper_gemm.cuh's StreamK): partials, flags,
// sk_tiles and epoch as kernels/tensor_cores_fp8.py's launcher gives them.
#define FP8_GEMM_PERSISTENT_SK(BM, BN, S, ACC, PROMOTED, OUTNAME, OUT)                                             \
  extern "C" __global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)                                           \
      fp8_gemm_##BM##x##BN##x128_s##S##_##ACC##_persistent_tmastore_sk_##OUTNAME(                                 \
          const __grid_constant__ TensorMap tmA, const __grid_constant__ TensorMap tmB,                           \
          const __grid_constant__ TensorMap tmC, const float* scale_a, const float* scale_b, int M, int N, int K, \
          int group_m, float* partials, int* flags, int sk_tiles, int epoch) {                                    \
    hopper::gemm_fp8_persistent<BM, BN, S, PROMOTED, OUT, 1, true>(&tmA, &tmB, &tmC, scale_a, scale_b, M, N, K, \
                                                                   group_m,                                       \
                                                                   hopper::StreamK{partials, flags, sk_tiles, epoch}); \
  }

FP8_GEMM_PERSISTENT_SK(128, 256, 4, fast, false, f16, __half)
FP8_GEMM_PERSISTENT_SK(128, 256, 4, fast, false, bf16, __nv_bfloat16)

// e4m3 codes of x / scale, a scale for each ``block`` consecutive elements (n for one scale per tensor; rows x d for
// lesson 10's blocks of rows), rounded as the GPU rounds (e4m3_code of e4m3.cuh: to nearest, ties to even,
// saturated to +-448): what kernels/inference_engine/precision.py's to_e4m3 gives for the same float32 quotient,
// code for code.
extern "C" __global__ void fp8_quantize(const float* __restrict__ x, unsigned char* __restrict__ codes,
                                        const float* __restrict__ scales, long long n, long long block) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    codes[i] = e4m3_code(x[i], __ldg(&scales[i / block]));
}

// gpucourse-arch: sm_90a
// Lesson 5, the Hopper step: the direct convolution on the tensor cores as lesson 4's wgmma GEMM, its A tiles
// gathered from the image by the Tensor Memory Accelerator.
//
// x: N x H x W x C, FP16 (NHWC).  w: K x R x S x C, FP16 (each output channel's filter contiguous).
// y: N x P x Q x K, FP16, FP32 sums; stride 1, no dilation, padding (ph, pw): P = H + 2 ph - R + 1.
//
// The GEMM is y (N P Q x K) = im2col(x) (N P Q x R S C) w^T, and w, read as a K x (R S C) matrix, is already B
// stored K-major (lesson 4's "nk"). What makes it a convolution is A. A block computes BM = TH x TW output
// pixels, TH rows and TW columns of one image, against BN output channels, and runs the reduction as R S taps
// times C / 64 slices of channels. For tap (r, s) and channels c0 .. c0 + 63, the block's A tile is
//
//     x[n, p0 + r - ph .. p0 + r - ph + TH - 1, q0 + s - pw .. q0 + s - pw + TW - 1, c0 .. c0 + 63]
//
// one 4-D box of the image, (C, W, H, N) fastest first, which the TMA copies in one instruction. Its corners
// may lie outside the image, before the first row or column too: the TMA fills those elements with zeros,
// which is exactly the padding. The box lands in shared memory as TH TW rows of 64 channels, 128 bytes each,
// swizzled by address like the GEMM's: to the MMA it is the GEMM's A tile, row i the output pixel
// (p0 + i / TW, q0 + i % TW). So the producer and the consumers are the GEMM's, with a 4-D load in place of a
// 2-D one, and the only im2col left is the choice of the box's coordinates.
//
// TW is a power of two at least Q (at most 128) and TH = BM / TW: a tile's rows past the image's last row or
// column are computed from zeros and never stored. C must be a multiple of 64 (a slice never straddles two
// taps), K of 8; kernels/convolution.py checks both and makes the two tensor maps.
//
// Those thrown-away rows cost: at Q = 56, 28 or 14 (ResNet-50's 3x3 layers) a tile 64, 32 or 16 wide computes
// 1/8 of its rows for nothing. The "i2c" kernels remove them with the TMA's im2col mode: a block takes BM
// consecutive output pixels of y read as an (N P Q) x K matrix, m0 .. m0 + BM - 1, whatever rows and images they
// span, and for tap (r, s) one im2col load brings exactly their BM input pixels (zeros for the padding and past
// the last image). The tensor map's corners (-ph, -pw) and (ph - R + 1, pw - S + 1) draw the window of tap (0, 0)
// around each image, P x Q pixels; the load's offsets (s, r) move it to the tap. Row i of the tile is then row
// m0 + i of y, and only the last block has rows to drop.
//
// The PERSISTENT kernels (i2c only) run lesson 4's persistent schedule on the same tiles (hopper_gemm.cuh, shared with
// lesson 4's GEMMs): the host launches as many blocks as the SMs hold at once (or one per tile, if fewer), each walks
// the tiles of y in lesson 4's grouped order, and the producer's ring of stages runs on from one tile into the next,
// so the next tile's first taps are loaded while the consumers store this one. y leaves through shared memory: each
// consumer's 64 rows go there 64 channels at a time by stmatrix, in the 128-byte swizzle, and one thread hands them
// to the TMA, which writes them into y read as an (N P Q) x K matrix (clipped at its last row and channel).
//
// Everything below needs sm_90a; for any other architecture the kernels are stubs that trap.

#include "conv_wgmma.cuh"
#include "hopper_gemm.cuh"

// Lesson 5's output: y (N P Q x K), the FP32 sums rounded to FP16, two channels in one 4-byte store.
struct RoundToHalf {
  static constexpr bool kStaged = false;
  __half* y;
  int K;
  __device__ __forceinline__ void operator()(size_t m, int k, float v0, float v1) const {
    *reinterpret_cast<__half2*>(y + m * K + k) = __floats2half2_rn(v0, v1);
  }
};

// The kernels kernels/convolution.py launches (WGMMA_CONV_CONFIGS): BM output pixels x BN output channels, stages;
// the tile as a box of the image, or (i2c) as BM consecutive output pixels in the TMA's im2col mode.
#define WGMMA_CONV(NAME, I2C, BM, BN, S)                                                                          \
  extern "C" __global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)                                         \
      conv_wgmma_##NAME##BM##x##BN##_s##S##_nhwc_f16(                                                           \
          const __grid_constant__ TensorMap tmX, const __grid_constant__ TensorMap tmW, __half* y, int N, int P,  \
          int Q, int K, int C, int R, int Sw, int ph, int pw, int TW, int tiles_q, int tiles_p) {                \
    hopper::conv_tile<BM, BN, S, I2C>(&tmX, &tmW, RoundToHalf{y, K}, N, P, Q, K, C, R, Sw, ph, pw, TW, tiles_q,  \
                                      tiles_p);                                                                 \
  }

WGMMA_CONV(, false, 128, 128, 4)
WGMMA_CONV(, false, 128, 64, 4)
WGMMA_CONV(, false, 128, 256, 3)
WGMMA_CONV(, false, 64, 128, 4)
WGMMA_CONV(, false, 64, 64, 6)
WGMMA_CONV(i2c_, true, 128, 128, 4)
WGMMA_CONV(i2c_, true, 128, 64, 4)
WGMMA_CONV(i2c_, true, 128, 256, 3)
WGMMA_CONV(i2c_, true, 64, 128, 4)
WGMMA_CONV(i2c_, true, 64, 64, 6)
WGMMA_CONV(i2c_, true, 256, 128, 3)
WGMMA_CONV(i2c_, true, 128, 224, 4)

namespace hopper {

// Where the persistent producer is in a tile: its first output pixel (n, p0, q0), its next slice's tap (r, sx) and
// first channel c0.
struct ConvTap {
  int n, p0, q0, c0, r, sx;
};

// The i2c tiles, persistent: conv_tile's producer and consumers on lesson 4's schedule (GroupedTiles over the
// (N P Q) x K matrix y, the Ring's phases running across tiles, produce_tiles' producer) and its TMA-stored epilogue
// (store_tile_tma). tmY: y as (N P Q) x K in boxes of 64 x 64, the 128-byte swizzle.
// BN = 224 (128 x 224: 2,048 output channels in 10 tiles): y's last 32 channels of a tile leave through tmY32, y in
// boxes of 64 x 32 (store_tile_tma's half piece).
// ABLATE: the same kernel with a part taken out, to time what is left (benchmarks/convolution.py, where_time_goes):
// LOADS_ONLY issues no wgmma (y is stored as zeros), MMA_ONLY loads nothing (the producer announces no bytes, and the
// products read whatever the stages hold). Everything else, barriers and stores included, runs as in the whole kernel.
enum Ablate { WHOLE = 0, LOADS_ONLY = 1, MMA_ONLY = 2 };
template <int BM, int BN, int STAGES, int ABLATE = WHOLE>
__device__ __forceinline__ void conv_persistent(const TensorMap* tmX, const TensorMap* tmW, const TensorMap* tmY, int N,
                                                int P, int Q, int K, int C, int R, int S, int ph, int pw,
                                                int group_m, const TensorMap* tmY32 = nullptr) {
#ifdef GPUCOURSE_WGMMA
  constexpr int CONSUMERS = BM / 64;
  constexpr unsigned A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
  constexpr unsigned Y_BYTES = CONSUMERS * 2 * STORE_PIECE_BYTES;  // two pieces of y a consumer, used in turn
  static_assert(B_BYTES % 1024 == 0, "each stage's w starts on the swizzle's 1024-byte grid");
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);  // the swizzle's 1 KiB
  unsigned char* sA = smem;                     // STAGES x [BM][64] FP16: BM output pixels' input pixels, one tap
  unsigned char* sB = smem + STAGES * A_BYTES;  // STAGES x [BN][64] FP16: output channels x 64 of R S C
  unsigned char* sY = sB + STAGES * B_BYTES;    // CONSUMERS x 2 x [64][64] FP16, swizzled: y on its way out
  unsigned long long* full = reinterpret_cast<unsigned long long*>(sY + Y_BYTES);
  const Ring<STAGES> ring{full, full + STAGES};

  const int wg = warpgroup_index(), tid = threadIdx.x % 128;
  if (threadIdx.x == 0) ring.init(CONSUMERS);
  __syncthreads();
  wait_for_previous_kernel();  // launched with pdl: the kernel before may still be running until here

  const int rows = N * P * Q;  // y's rows, one an output pixel
  const GroupedTiles<BM, BN> tiles(rows, K, group_m);
  const int slices = C / BK;  // slices of 64 channels in one tap
  const int kblocks = R * S * slices;

  if (wg == 0) {  // ------------------------------------------------------------------ producer
    producer_regs<CONSUMERS>();
    if (tid == 0)
      // A tile's state: its first row m0 of y as the output pixel (n, p0, q0), and the tap (r, sx) and channels c0 of
      // its next slice, moved on a slice at a time (channels fastest, then the filter's columns, then its rows: w's
      // order), without a division per slice. Slice kb loads as conv_tile's i2c producer does.
      produce_tiles(
          tiles, ring, kblocks, ABLATE == MMA_ONLY ? 0u : A_BYTES + B_BYTES,
          [&](int m0, int) { return ConvTap{m0 / (P * Q), (m0 % (P * Q)) / Q, m0 % Q, 0, 0, 0}; },
          [&](int s, unsigned long long* bar, int kb, int, int k0, ConvTap& at) {
            if constexpr (ABLATE != MMA_ONLY) {
              tma_load_im2col_4d(sA + s * A_BYTES, tmX, bar, at.c0, at.q0 - pw, at.p0 - ph, at.n, at.sx, at.r);
              tma_load_2d(sB + s * B_BYTES, tmW, bar, kb * BK, k0);  // w's columns (r S + sx) C + c0 ..
            }
            if ((at.c0 += BK) == C) {
              at.c0 = 0;
              if (++at.sx == S) at.sx = 0, ++at.r;
            }
          });
    if (tid == 0) let_next_kernel_launch();  // every load issued: the next kernel may set up on the SMs freed
  } else {  // ---------------------------------------------------------------------- consumers
    consumer_regs<CONSUMERS>();
    const int c = wg - 1;
    int g = 0;       // slices used so far, as the producer counts them
    int stored = 0;  // pieces of y this consumer has handed to the TMA
    // stage 0's descriptors as 32-bit words (desc_of); A's and B's share their high word (offsets, swizzle)
    const unsigned long long d0 = make_desc(smem_addr(sA + c * 64 * 128), 16, 1024);
    const unsigned lo_a = static_cast<unsigned>(d0), hi = static_cast<unsigned>(d0 >> 32);
    const unsigned lo_b = static_cast<unsigned>(make_desc(smem_addr(sB), 16, 1024));
    // region: conv_persistent_consumers
    for (int t = blockIdx.x; t < tiles.count; t += gridDim.x) {
      int m0, k0;
      tiles.origin(t, m0, k0);
      float d[BN / 16][8];
#pragma unroll
      for (int i = 0; i < BN / 16; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) d[i][j] = 0.0f;
      // As conv_tile: slice kb's wgmma run while slice kb + 1's are issued; a stage goes back to the producer once
      // the wgmma after it are issued (wgmma_wait<1>), the tile's last one after the loop.
      int held = -1;
      for (int kb = 0; kb < kblocks; ++kb, ++g) {
        const int s = ring.wait_full(g);
        // the descriptors' low words (the address, in 16-byte units) for this stage; the high words are constants
        const unsigned alo = lo_a + s * (A_BYTES >> 4), blo = lo_b + s * (B_BYTES >> 4);
        wgmma_fence();
        if constexpr (ABLATE != LOADS_ONLY)  // (where_time_goes: the loads alone)
#pragma unroll
          for (int kk = 0; kk < BK / 16; ++kk)  // both K-major, 128-byte swizzle
            wgmma_k16<BN, 0>(d, desc_of(alo + 2 * kk, hi), desc_of(blo + 2 * kk, hi), 1);
        wgmma_commit();
        wgmma_wait<1>();
        if (tid == 0 && held >= 0) ring.release(held);
        held = s;
      }
      wgmma_wait<0>();
      if (tid == 0 && held >= 0) ring.release(held);
      // The epilogue, while the producer fills the stages just freed with the next tile's first taps.
      store_tile_tma<BN>(d, sY + c * 2 * STORE_PIECE_BYTES, stored, tmY, m0 + c * 64, k0, rows, K, 1 + c,
                         [](float x, float y) { return half2_bits(x, y); }, tmY32);
    }
    store_tma_drain();
    // endregion
  }
#else
  __trap();  // built for an architecture without wgmma: the launcher refuses before it gets here
#endif
}

}  // namespace hopper

// The persistent kernels (WGMMA_CONV_PERSISTENT_CONFIGS): BM output pixels x BN output channels, stages; y written by
// the TMA (tmY: y as an (N P Q) x K matrix in boxes of 64 x 64).
#define WGMMA_CONV_PERSISTENT(BM, BN, S)                                                                          \
  extern "C" __global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)                                         \
      conv_wgmma_i2c_##BM##x##BN##_s##S##_persistent_nhwc_f16(                                                   \
          const __grid_constant__ TensorMap tmX, const __grid_constant__ TensorMap tmW,                         \
          const __grid_constant__ TensorMap tmY, int N, int P, int Q, int K, int C, int R, int Sw, int ph, int pw, \
          int group_m) {                                                                                         \
    hopper::conv_persistent<BM, BN, S>(&tmX, &tmW, &tmY, N, P, Q, K, C, R, Sw, ph, pw, group_m);               \
  }

WGMMA_CONV_PERSISTENT(128, 128, 6)
WGMMA_CONV_PERSISTENT(128, 64, 8)
WGMMA_CONV_PERSISTENT(128, 256, 4)
WGMMA_CONV_PERSISTENT(64, 128, 3)
WGMMA_CONV_PERSISTENT(64, 128, 8)
WGMMA_CONV_PERSISTENT(64, 64, 5)
WGMMA_CONV_PERSISTENT(256, 128, 3)

// ... and 64 x 128 with 8 stages with a part taken out (ABLATE; kernels/convolution.py's conv_wgmma(ablate=...))
#define WGMMA_CONV_PERSISTENT_ABLATED(BM, BN, S, PART, ABLATE)                                                      \
  extern "C" __global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)                                         \
      conv_wgmma_i2c_##BM##x##BN##_s##S##_persistent_##PART##_only_nhwc_f16(                                     \
          const __grid_constant__ TensorMap tmX, const __grid_constant__ TensorMap tmW,                         \
          const __grid_constant__ TensorMap tmY, int N, int P, int Q, int K, int C, int R, int Sw, int ph, int pw, \
          int group_m) {                                                                                         \
    hopper::conv_persistent<BM, BN, S, hopper::ABLATE>(&tmX, &tmW, &tmY, N, P, Q, K, C, R, Sw, ph, pw, group_m);  \
  }

WGMMA_CONV_PERSISTENT_ABLATED(64, 128, 8, loads, LOADS_ONLY)
WGMMA_CONV_PERSISTENT_ABLATED(64, 128, 8, mma, MMA_ONLY)

// ... and 128 x 224, whose tiles' last 32 channels leave through tmY32 (y in boxes of 64 x 32)
#define WGMMA_CONV_PERSISTENT_HALF(BM, BN, S)                                                                     \
  extern "C" __global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)                                         \
      conv_wgmma_i2c_##BM##x##BN##_s##S##_persistent_nhwc_f16(                                                   \
          const __grid_constant__ TensorMap tmX, const __grid_constant__ TensorMap tmW,                         \
          const __grid_constant__ TensorMap tmY, int N, int P, int Q, int K, int C, int R, int Sw, int ph, int pw, \
          int group_m, const __grid_constant__ TensorMap tmY32) {                                               \
    hopper::conv_persistent<BM, BN, S>(&tmX, &tmW, &tmY, N, P, Q, K, C, R, Sw, ph, pw, group_m, &tmY32);       \
  }

WGMMA_CONV_PERSISTENT_HALF(128, 224, 4)

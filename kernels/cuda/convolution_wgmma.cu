// gpucourse-arch: sm_90a
// Lesson 4, the Hopper step: the direct convolution on the tensor cores as lesson 3's wgmma GEMM, its A tiles
// gathered from the image by the Tensor Memory Accelerator.
//
// x: N x H x W x C, FP16 (NHWC).  w: K x R x S x C, FP16 (each output channel's filter contiguous).
// y: N x P x Q x K, FP16, FP32 sums; stride 1, no dilation, padding (ph, pw): P = H + 2 ph - R + 1.
//
// The GEMM is y (N P Q x K) = im2col(x) (N P Q x R S C) w^T, and w, read as a K x (R S C) matrix, is already B
// stored K-major (lesson 3's "nk"). What makes it a convolution is A. A block computes BM = TH x TW output
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
// Everything below needs sm_90a; for any other architecture the kernels are stubs that trap.

#include <cuda_fp16.h>

#include "hopper.cuh"

namespace hopper {

template <int BM, int BN, int STAGES, bool I2C>
__device__ __forceinline__ void conv_tile(const TensorMap* tmX, const TensorMap* tmW, __half* __restrict__ y, int N,
                                          int P, int Q, int K, int C, int R, int S, int ph, int pw, int TW,
                                          int tiles_q, int tiles_p) {
#ifdef GPUCOURSE_WGMMA
  constexpr int CONSUMERS = BM / 64;
  constexpr unsigned A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);  // the swizzle's 1 KiB
  unsigned char* sA = smem;                     // STAGES x [BM][64] FP16: TH x TW pixels x 64 channels
  unsigned char* sB = smem + STAGES * A_BYTES;  // STAGES x [BN][64] FP16: output channels x 64 of R S C
  unsigned long long* full = reinterpret_cast<unsigned long long*>(sB + STAGES * B_BYTES);
  unsigned long long* empty = full + STAGES;

  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  // Which tile: blockIdx.x walks the images' tiles (column tiles fastest) or, im2col, the runs of BM output
  // pixels; blockIdx.y the output channels. (n, p0, q0) is the tile's first output pixel.
  int n, p0, q0;
  const int m0 = blockIdx.x * BM, k0 = blockIdx.y * BN;
  if constexpr (I2C) {
    n = m0 / (P * Q);
    p0 = (m0 % (P * Q)) / Q;
    q0 = m0 % Q;
  } else {
    const int qt = blockIdx.x % tiles_q, pt = (blockIdx.x / tiles_q) % tiles_p;
    n = blockIdx.x / (tiles_q * tiles_p);
    p0 = pt * (BM / TW);
    q0 = qt * TW;
  }
  const int slices = C / BK;  // slices of 64 channels in one tap
  const int kblocks = R * S * slices;

  if (wg == 0) {  // ------------------------------------------------------------------ producer
    if constexpr (CONSUMERS > 1) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (tid == 0) {
      for (int kb = 0; kb < kblocks; ++kb) {
        const int s = kb % STAGES;
        const int tap = kb / slices, c0 = (kb % slices) * BK;
        const int r = tap / S, sx = tap % S;
        if (kb >= STAGES) mbar_wait(&empty[s], ((kb / STAGES) + 1) & 1);
        mbar_expect_tx(&full[s], A_BYTES + B_BYTES);
        if constexpr (I2C)  // BM pixels from the tile's first one, moved by the tap
          tma_load_im2col_4d(sA + s * A_BYTES, tmX, &full[s], c0, q0 - pw, p0 - ph, n, sx, r);
        else  // im2col as a box: TH x TW pixels
          tma_load_4d(sA + s * A_BYTES, tmX, &full[s], c0, q0 + sx - pw, p0 + r - ph, n);
        tma_load_2d(sB + s * B_BYTES, tmW, &full[s], kb * BK, k0);  // w's columns (r S + s) C + c0 ..
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
      mbar_wait(&full[s], (kb / STAGES) & 1);
      const unsigned a0 = smem_addr(sA + s * A_BYTES + c * 64 * 128);
      const unsigned b0 = smem_addr(sB + s * B_BYTES);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)  // both K-major, 128-byte swizzle, as the GEMM's "nk"
        wgmma_k16<BN, 0>(d, make_desc(a0 + kk * 32, 16, 1024), make_desc(b0 + kk * 32, 16, 1024), 1);
      wgmma_commit();
      wgmma_wait<0>();
      if (tid == 0) mbar_arrive(&empty[s]);
    }
    // Store: the GEMM's fragment layout (rows l/4 and l/4 + 8 of the warp's 16, columns 8i + 2 (l % 4) and the
    // next); row i of the tile is output pixel (p0 + i / TW, q0 + i % TW), stored only inside the image, or,
    // im2col, row m0 + i of y, stored only inside y.
    const int warp = tid / 32, lane = tid % 32;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = c * 64 + warp * 16 + lane / 4 + 8 * h;
      size_t m;
      if constexpr (I2C) {
        if (m0 + i >= N * P * Q) continue;
        m = static_cast<size_t>(m0 + i);
      } else {
        const int p = p0 + i / TW, q = q0 + i % TW;
        if (p >= P || q >= Q) continue;
        m = (static_cast<size_t>(n) * P + p) * Q + q;
      }
      __half* out = y + m * K;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int col = k0 + 8 * j + 2 * (lane % 4);
        const float* v = &d[j / 2][(j % 2) * 4 + 2 * h];
        if (col < K)  // K is a multiple of 8, so col + 1 < K too and the pair is 4-byte aligned
          *reinterpret_cast<__half2*>(out + col) = __floats2half2_rn(v[0], v[1]);
      }
    }
  }
#else
  __trap();  // built for an architecture without wgmma: the launcher refuses before it gets here
#endif
}

}  // namespace hopper

// The kernels kernels/convolution.py launches (WGMMA_CONV_CONFIGS): BM output pixels x BN output channels, stages;
// the tile as a box of the image, or (i2c) as BM consecutive output pixels in the TMA's im2col mode.
#define WGMMA_CONV(NAME, I2C, BM, BN, S)                                                                          \
  extern "C" __global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)                                         \
      conv_wgmma_##NAME##BM##x##BN##_s##S##_nhwc_f16(                                                           \
          const __grid_constant__ TensorMap tmX, const __grid_constant__ TensorMap tmW, __half* y, int N, int P,  \
          int Q, int K, int C, int R, int Sw, int ph, int pw, int TW, int tiles_q, int tiles_p) {                \
    hopper::conv_tile<BM, BN, S, I2C>(&tmX, &tmW, y, N, P, Q, K, C, R, Sw, ph, pw, TW, tiles_q, tiles_p);       \
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

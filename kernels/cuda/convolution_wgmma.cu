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
// Everything below needs sm_90a; for any other architecture the kernels are stubs that trap.

#include "conv_wgmma.cuh"

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

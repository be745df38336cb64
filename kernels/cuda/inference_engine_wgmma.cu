// gpucourse-arch: sm_90a
// Lesson 5's engine on Hopper: its convolutions as lesson 4's wgmma kernel (conv_wgmma.cuh: A tiles gathered from
// the image by the TMA, wgmma from shared memory, a producer warpgroup and one or two consumers), ended with the
// engine's epilogue instead of lesson 4's plain rounding: + bias, + the residual (a ResNet block's shortcut),
// ReLU, FP16, into the output's place in the arena (pixel stride ldy). The tile goes through shared memory first
// (conv_tile's staged store), so the residual is read and the output written 16 bytes a thread, in runs along a row.
//
// Strides: a 1 x 1 convolution of stride 2 without padding (ResNet-50's projections) reads every other pixel of
// every other row. The launcher (kernels/inference_engine/executor.py) describes exactly those pixels to the TMA
// as the image: a tensor map whose W and H steps are twice the pixel and row pitch. To the kernel it is a 1 x 1
// convolution of stride 1, P x Q pixels.
//
// INT8 (the _i8 kernels): the same tile on wgmma's 8-bit path (INT32 sums), and the epilogue of the engine's other
// INT8 kernels: the sums times s_x s_w[k] back into real units, + bias, + the residual (its INT8 values times its
// scale), ReLU, then quantised with the output's 1 / scale into -127 .. 127. Activations stay INT8 between layers.
// FP8 (the _f8 kernels): e4m3 activations and weights on wgmma's e4m3 path (FP32 sums), the same epilogue, the
// result rounded to the nearest e4m3 of v / scale (saturated to +-448).
//
// Needs C a multiple of 64 (the wide 8-bit tiles, wgw_ and wgpw_: of 128), K of 8, one destination (no horizontal
// fusion's split) and the output's and residual's pixels and first elements multiples of 8 elements (kernel_fits
// says so).

#include "conv_wgmma.cuh"

#include <cuda_fp8.h>

typedef signed char int8;
typedef unsigned char fp8;  // an FP8 e4m3 code (the engine's FP8 plans)

template <int BYTES> struct RawOf { using type = uint2; };  // 8 bytes
template <> struct RawOf<16> { using type = uint4; };         // 16 bytes

template <typename T, int VEC = 8>
struct EngineEpilogue {
  // conv_tile hands over VEC channels of a row at a time: one access each. 8: 16 bytes of FP16 or 8 of INT8 and
  // FP8 (the one-tile kernels: 16 INT8 channels a call measured slower on an H100, as their staging space, A's
  // stages, holds half as many columns in the 8-bit types, and whole 16-byte runs took twice the rounds); the
  // persistent kernels, whose staging space has as many columns in every type, take 16 bytes in each: VEC = 16 in
  // the 8-bit types.
  static constexpr bool kStaged = true;
  static constexpr int kVec = VEC;
  static constexpr bool kFp8 = sizeof(T) == 1 && static_cast<T>(-1) > static_cast<T>(0);  // unsigned: e4m3 codes
  static constexpr bool kInt8 = sizeof(T) == 1 && !kFp8;
  using Raw = typename RawOf<sizeof(T) * VEC>::type;  // VEC elements of the residual, as stored
  const float* bias;       // K, or null
  const float* scale;      // INT8, FP8: s_x s_w[k] (K), turning the sums into real units; null for FP16
  const float* inv;        // INT8, FP8: 1 / the output's scale, per channel (K); null for FP16
  T* y;                    // the output's first channel; pixel m at y + m ldy
  int ldy;
  const T* res;            // the residual's first channel, pixel stride ldres, or null
  int ldres;
  float res_scale;         // INT8, FP8: the residual's scale (1 for FP16)
  int relu;

  // The residual's channels k .. k + cols - 1 of pixel m into L2 (cols * sizeof(T) a multiple of 16 bytes)
  __device__ __forceinline__ void prefetch(size_t m, int k, int cols) const {
#ifdef GPUCOURSE_WGMMA
    if (res)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(res + m * ldres + k),
                   "r"(cols * static_cast<int>(sizeof(T))) : "memory");
#endif
  }

  // The residual's channels k .. k + kVec - 1 of pixel m, as stored (zeros without one)
  __device__ __forceinline__ Raw load(size_t m, int k) const {
    return res ? *reinterpret_cast<const Raw*>(res + m * ldres + k) : Raw{};
  }

  // p[k .. k + kVec - 1] (none: ``none``), kVec / 4 loads of 16 bytes through the read-only path
  __device__ __forceinline__ static void load_vec(const float* p, int k, float (&out)[kVec], float none) {
#pragma unroll
    for (int q = 0; q < kVec / 4; ++q) {
      const float4 f = p ? __ldg(reinterpret_cast<const float4*>(p + k) + q) : make_float4(none, none, none, none);
      out[4 * q] = f.x;
      out[4 * q + 1] = f.y;
      out[4 * q + 2] = f.z;
      out[4 * q + 3] = f.w;
    }
  }

  // What the epilogue reads per output channel, for channels k .. k + kVec - 1: loaded once for all the units of a
  // round that take those channels (conv_tile), 16 bytes a load (k is a multiple of kVec; each array starts 256-byte
  // aligned)
  struct Factors {
    float sc[kVec], b[kVec], iv[kVec];
  };
  __device__ __forceinline__ Factors factors(int k) const {
    Factors f;
    load_vec(scale, k, f.sc, 1.0f);
    load_vec(bias, k, f.b, 0.0f);
    if constexpr (sizeof(T) == 1) load_vec(inv, k, f.iv, 1.0f);
    return f;
  }

  // INT8 without the conversion unit (a quarter of the FP32 rate on Hopper: I2F and F2I were two of an 8-bit
  // output's few instructions at that rate): a byte q is (1.5 * 2^23 + 128 + q) - (1.5 * 2^23 + 128), the first
  // made by putting q + 128 into the mantissa of 1.5 * 2^23; and a v in -127 .. 127 rounds to the nearest integer
  // (ties to even, as cvt.rni) when 1.5 * 2^23 is added, leaving the integer's two's-complement byte as the low byte
  // of the sum's bits.
  static constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: floats from 2^23 to 2^24 are the integers
  __device__ __forceinline__ static float byte_to_float(unsigned word, int j) {
    const unsigned biased = word ^ 0x80808080u;  // q + 128 in each byte
    return __int_as_float(__byte_perm(biased, 0x4B400000u, 0x7650 + j)) - (kMagic + 128.0f);
  }
  __device__ __forceinline__ static unsigned rounded_byte_bits(float v, float lo) {  // v's code in the low byte
    return __float_as_uint(fminf(fmaxf(v, lo), 127.0f) + kMagic);
  }

  __device__ __forceinline__ void row(size_t m, int k, const float (&acc)[kVec], const Raw& raw,
                                      const Factors& f) const {
    float v[kVec], r[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) r[j] = 0.0f;
    if (res) {
      const T* q = reinterpret_cast<const T*>(&raw);
      const unsigned* w = reinterpret_cast<const unsigned*>(&raw);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if constexpr (sizeof(T) == 2) r[j] = __half2float(q[j]);
        else if constexpr (kFp8) r[j] = __half2float(__half(__nv_cvt_fp8_to_halfraw(q[j], __NV_E4M3))) * res_scale;
        else r[j] = byte_to_float(w[j / 4], j % 4) * res_scale;  // INT8
      }
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {  // in the order of the engine's other kernels (epilogue8): the same roundings
      v[j] = acc[j];
      if (scale) v[j] *= f.sc[j];
      if (bias) v[j] += f.b[j];
      v[j] += r[j];
      if (relu && !kInt8) v[j] = fmaxf(v[j], 0.0f);  // INT8: in the clip below
    }
    Raw out;
    T* o = reinterpret_cast<T*>(&out);
    if constexpr (kInt8) {  // round to the nearest integer, clip to -127 .. 127 (ReLU: to 0 .. 127, as 1 / scale > 0)
      unsigned* ow = reinterpret_cast<unsigned*>(&out);
      const float lo = relu ? 0.0f : -127.0f;
#pragma unroll
      for (int j = 0; j < kVec; j += 4) {
        unsigned b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) b[i] = rounded_byte_bits(v[j + i] * f.iv[j + i], lo);
        ow[j / 4] = __byte_perm(__byte_perm(b[0], b[1], 0x0040), __byte_perm(b[2], b[3], 0x0040), 0x5410);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if constexpr (sizeof(T) == 2) o[j] = __float2half_rn(v[j]);
        else  // FP8: the nearest e4m3 code of v / scale, saturated to +-448
          o[j] = __nv_cvt_float_to_fp8(v[j] * f.iv[j], __NV_SATFINITE, __NV_E4M3);
      }
    }
    *reinterpret_cast<Raw*>(y + m * ldy + k) = out;
  }
};

// conv_wg_[i2c_]<BM>x<BN>_s<stages>_{f16,i8,f8}: kernels/inference_engine/catalog.py lists them (WG); conv_wgp_...: the
// same tiles, PERSIST (conv_wgmma.cuh): as many blocks as fit on the SMs, each walking the tiles in turn, its next
// tile's loads in flight during this one's epilogue
#define ENGINE_WGMMA(PRE, NAME, I2C, BM, BN, S, SFX, T, E, PERSIST, VEC, BKC)                                    \
  extern "C" __global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)                                         \
      conv_##PRE##NAME##BM##x##BN##_s##S##_##SFX(                                                               \
          const __grid_constant__ TensorMap tmX, const __grid_constant__ TensorMap tmW, const float* bias,     \
          const float* scale, const float* inv, T* y, int ldy, const T* res, int ldres, float res_scale,        \
          int relu, int N, int P, int Q, int K, int C, int R, int Sw, int ph, int pw, int TW, int tiles_q,      \
          int tiles_p) {                                                                                        \
    hopper::conv_tile<BM, BN, S, I2C, EngineEpilogue<T, VEC>, hopper::E, PERSIST, BKC>(                        \
        &tmX, &tmW, EngineEpilogue<T, VEC>{bias, scale, inv, y, ldy, res, ldres, res_scale, relu}, N, P, Q, K, C, \
        R,                                                                                                       \
        Sw, ph, pw, TW, tiles_q, tiles_p);                                                                      \
  }
#define ENGINE_WGMMA_ALL(NAME, I2C, BM, BN, S)                  \
  ENGINE_WGMMA(wg_, NAME, I2C, BM, BN, S, f16, __half, F16, false, 8, 64) \
  ENGINE_WGMMA(wg_, NAME, I2C, BM, BN, S, i8, int8, S8, false, 8, 64)      \
  ENGINE_WGMMA(wg_, NAME, I2C, BM, BN, S, f8, fp8, E4M3, false, 8, 64)
#define ENGINE_WGMMA_PERSIST(NAME, I2C, BM, BN, S)               \
  ENGINE_WGMMA(wgp_, NAME, I2C, BM, BN, S, f16, __half, F16, true, 8, 64) \
  ENGINE_WGMMA(wgp_, NAME, I2C, BM, BN, S, i8, int8, S8, true, 16, 64)     \
  ENGINE_WGMMA(wgp_, NAME, I2C, BM, BN, S, f8, fp8, E4M3, true, 16, 64)
// The wide 8-bit tiles (conv_wgw_... and conv_wgpw_...): slices of 128 channels, rows of 128 bytes in the 128-byte
// swizzle (conv_wgmma.cuh, BKC), for layers whose input has a multiple of 128 channels; INT8 and FP8 only (in FP16
// a 128-byte row is the ordinary tile)
#define ENGINE_WGMMA_WIDE(PRE, NAME, I2C, BM, BN, S, PERSIST)                              \
  ENGINE_WGMMA(PRE, NAME, I2C, BM, BN, S, i8, int8, S8, PERSIST, PERSIST ? 16 : 8, 128) \
  ENGINE_WGMMA(PRE, NAME, I2C, BM, BN, S, f8, fp8, E4M3, PERSIST, PERSIST ? 16 : 8, 128)

ENGINE_WGMMA_ALL(, false, 128, 128, 4)
ENGINE_WGMMA_ALL(, false, 128, 64, 4)
ENGINE_WGMMA_ALL(, false, 64, 128, 4)
ENGINE_WGMMA_ALL(, false, 64, 64, 6)
ENGINE_WGMMA_ALL(i2c_, true, 128, 128, 4)
ENGINE_WGMMA_ALL(i2c_, true, 128, 64, 4)
ENGINE_WGMMA_ALL(i2c_, true, 128, 256, 3)
ENGINE_WGMMA_ALL(i2c_, true, 64, 128, 4)
ENGINE_WGMMA_ALL(i2c_, true, 64, 64, 6)
ENGINE_WGMMA_ALL(i2c_, true, 64, 128, 2)  // fewer stages, more blocks an SM: for short reductions
ENGINE_WGMMA_ALL(i2c_, true, 64, 64, 3)
ENGINE_WGMMA_PERSIST(i2c_, true, 128, 256, 3)
ENGINE_WGMMA_PERSIST(i2c_, true, 128, 128, 4)
ENGINE_WGMMA_PERSIST(i2c_, true, 128, 64, 4)
ENGINE_WGMMA_PERSIST(i2c_, true, 64, 128, 4)
ENGINE_WGMMA_PERSIST(i2c_, true, 64, 64, 4)
ENGINE_WGMMA_WIDE(wgw_, i2c_, true, 128, 256, 3, false)
ENGINE_WGMMA_WIDE(wgw_, i2c_, true, 128, 128, 4, false)
ENGINE_WGMMA_WIDE(wgw_, i2c_, true, 128, 64, 4, false)
ENGINE_WGMMA_WIDE(wgw_, i2c_, true, 64, 128, 4, false)
ENGINE_WGMMA_WIDE(wgw_, i2c_, true, 64, 64, 6, false)
ENGINE_WGMMA_WIDE(wgpw_, i2c_, true, 128, 256, 3, true)
ENGINE_WGMMA_WIDE(wgpw_, i2c_, true, 128, 128, 4, true)
ENGINE_WGMMA_WIDE(wgpw_, i2c_, true, 128, 64, 4, true)

// gpucourse-arch: sm_90a
// Lesson 6's engine on Hopper: its convolutions as lesson 5's wgmma kernel (conv_wgmma.cuh: A tiles gathered from
// the image by the TMA, wgmma from shared memory, a producer warpgroup and one or two consumers), ended with the
// engine's epilogue instead of lesson 5's plain rounding: + bias, + the residual (a ResNet block's shortcut),
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

  // One output value in real units: the sum times its scale, + the bias, + the residual r (in real units), each step
  // rounded to FP32 as the engine's NumPy runtime rounds it (no fused multiply-add: an 8-bit code would now and then
  // differ by one step), then ReLU (INT8's is in its clip)
  __device__ __forceinline__ float real(float acc, float sc, float b, float r) const {
    const float v = __fadd_rn(__fadd_rn(__fmul_rn(acc, sc), b), r);
    return kInt8 ? v : fmaxf(v, relu_floor());
  }
  // ReLU as a floor chosen once (0, or -inf where there is none), never as a branch: kept as ``if (relu)``, the
  // compiler branched in every row or pair of an epilogue, cutting it into pieces it could not schedule across (on an
  // H100 FP8's TMA epilogue lost 5-6 us a layer to INT8's, whose ReLU is its clip's lower bound)
  __device__ __forceinline__ float relu_floor() const { return relu ? 0.0f : __uint_as_float(0xFF800000u); }  // -inf
  // The residual's element j of a word of codes, in real units (INT8, FP8)
  __device__ __forceinline__ float residual8(unsigned word, int j) const {
    if constexpr (kFp8)
      return __fmul_rn(__half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<fp8>(word >> (8 * j)), __NV_E4M3))),
                       res_scale);
    else
      return __fmul_rn(byte_to_float(word, j), res_scale);
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
        else r[j] = residual8(w[j / 4], j % 4);
      }
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = real(acc[j], f.sc[j], f.b[j], r[j]);  // as the engine's other kernels
    Raw out;
    T* o = reinterpret_cast<T*>(&out);
    if constexpr (kInt8) {  // round to the nearest integer, clip to -127 .. 127 (ReLU: to 0 .. 127, as 1 / scale > 0)
      unsigned* ow = reinterpret_cast<unsigned*>(&out);
      const float lo = relu ? 0.0f : -127.0f;
#pragma unroll
      for (int j = 0; j < kVec; j += 4) {
        unsigned b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) b[i] = rounded_byte_bits(__fmul_rn(v[j + i], f.iv[j + i]), lo);
        ow[j / 4] = __byte_perm(__byte_perm(b[0], b[1], 0x0040), __byte_perm(b[2], b[3], 0x0040), 0x5410);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if constexpr (sizeof(T) == 2) o[j] = __float2half_rn(v[j]);
        else  // FP8: the nearest e4m3 code of v / scale, saturated to +-448
          o[j] = __nv_cvt_float_to_fp8(__fmul_rn(v[j], f.iv[j]), __NV_SATFINITE, __NV_E4M3);
      }
    }
    *reinterpret_cast<Raw*>(y + m * ldy + k) = out;
  }
};

// The 8-bit persistent tiles' other epilogue (conv_tile's TMA one: the wgpt_ kernels): the TMA brings a tile's
// residual into shared memory while the tile before it is stored, each thread turns its own fragments' sums into
// codes in place there, two channels of a row at a time, and the TMA writes the tile out. No round trip of the sums
// through shared memory as floats, no residual loaded by the threads, no bounds to check (the TMA's box ends at the
// tensor's). Where the staged epilogue kept an 8-bit tile's memory-bound layers at twice their floor, it took
// ResNet-50's conv2 projection from 72 to 48 us and its residual layers from 75 to 66 (H100). The same arithmetic as
// ``row``.
template <typename T>
struct EngineEpilogueTma : EngineEpilogue<T, 16> {
  using Base = EngineEpilogue<T, 16>;
  static_assert(sizeof(T) == 1, "the 8-bit types' (FP16's: the specialisation below)");
  static constexpr bool kTma = true;
  __device__ __forceinline__ bool has_res() const { return this->res != nullptr; }
  struct Pair {  // the per-channel factors of channels k and k + 1
    float2 sc, b, iv;
  };
  // scale, bias and inv are never null here (the executor passes ones and zeros where a step has none): a load a
  // factor, at a fixed offset from the thread's first channel, with no test, no default and no pointer reloaded
  __device__ __forceinline__ Pair pair_factors(int k) const {
    return Pair{__ldg(reinterpret_cast<const float2*>(this->scale + k)),
                __ldg(reinterpret_cast<const float2*>(this->bias + k)),
                __ldg(reinterpret_cast<const float2*>(this->inv + k))};
  }
  // The codes of channels k and k + 1 (low byte first) from their sums, and the residual's codes there (raw; RES:
  // whether there is one, known at compile time, so that the epilogue is one stretch of code without branches)
  template <bool RES>
  __device__ __forceinline__ unsigned short pair(unsigned short raw, float a0, float a1, const Pair& f) const {
    float v0 = __fadd_rn(__fmul_rn(a0, f.sc.x), f.b.x), v1 = __fadd_rn(__fmul_rn(a1, f.sc.y), f.b.y);
    if constexpr (RES) {  // as real(): + the residual, last
      if constexpr (Base::kFp8) {  // both codes in one conversion
        const float2 r = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(raw, __NV_E4M3)));
        v0 = __fadd_rn(v0, __fmul_rn(r.x, this->res_scale));
        v1 = __fadd_rn(v1, __fmul_rn(r.y, this->res_scale));
      } else {
        v0 = __fadd_rn(v0, this->residual8(raw, 0));
        v1 = __fadd_rn(v1, this->residual8(raw, 1));
      }
    }
    if constexpr (!Base::kInt8) {  // INT8's ReLU is its clip's lower bound
      v0 = fmaxf(v0, this->relu_floor());
      v1 = fmaxf(v1, this->relu_floor());
    }
    v0 = __fmul_rn(v0, f.iv.x);
    v1 = __fmul_rn(v1, f.iv.y);
    if constexpr (Base::kInt8) {
      const float lo = this->relu ? 0.0f : -127.0f;
      return static_cast<unsigned short>(__byte_perm(Base::rounded_byte_bits(v0, lo), Base::rounded_byte_bits(v1, lo), 0x0040));
    } else {
      return __nv_cvt_float2_to_fp8x2(make_float2(v0, v1), __NV_SATFINITE, __NV_E4M3);
    }
  }
};

// FP16's TMA epilogue (the wgpt_ kernels' _f16): the same path with 2-byte outputs (conv_wgmma.cuh, tma_halves: boxes of
// 64 channels), a word of two halves a pair of channels. Only the bias is read per channel: FP16 has no scales, and
// the arithmetic is ``real``'s with the scale 1 (a product by 1 is exact), so the result is the staged epilogue's to
// the bit: (sum + bias) + residual, each rounded to FP32, ReLU's floor, then rounded to FP16.
template <>
struct EngineEpilogueTma<__half> : EngineEpilogue<__half, 8> {
  using Base = EngineEpilogue<__half, 8>;
  static constexpr bool kTma = true;
  static constexpr int kOutBytes = 2;
  __device__ __forceinline__ bool has_res() const { return this->res != nullptr; }
  struct Pair {  // the bias of channels k and k + 1 (never null here: zeros where a step has none, as the 8-bit's)
    float2 b;
  };
  __device__ __forceinline__ Pair pair_factors(int k) const {
    return Pair{__ldg(reinterpret_cast<const float2*>(this->bias + k))};
  }
  // Channels k and k + 1 as one word of halves (k's in the low half) from their sums and the residual's word there
  template <bool RES>
  __device__ __forceinline__ unsigned pair(unsigned raw, float a0, float a1, const Pair& f) const {
    float v0 = __fadd_rn(a0, f.b.x), v1 = __fadd_rn(a1, f.b.y);
    if constexpr (RES) {
      const float2 r = __half22float2(*reinterpret_cast<const __half2*>(&raw));
      v0 = __fadd_rn(v0, r.x);
      v1 = __fadd_rn(v1, r.y);
    }
    return half2_bits(fmaxf(v0, this->relu_floor()), fmaxf(v1, this->relu_floor()));  // fast_math.cuh
  }
};

// The split-K tiles' Store (conv_wgs_..., FP16): block z's partial sums of output pixel m, channels k and k + 1, into
// its own slice of the workspace (z M K + m K + k, M the output's pixels): split_reduce_f16 adds the slices up and
// ends them with the engine's epilogue.
struct SplitPartial {
  static constexpr bool kStaged = false;
  float* ws;
  size_t slice;  // M K: one block's share of the reduction for every output
  int K;
  __device__ __forceinline__ void operator()(size_t m, int k, float v0, float v1) const {
    *reinterpret_cast<float2*>(ws + blockIdx.z * slice + m * K + k) = make_float2(v0, v1);
  }
};

// The split tiles' second kernel: a thread per 8 channels of an output pixel sums the splits' partial sums (in the
// order of the splits) and ends them as the one-tile kernels do (EngineEpilogue::row: + bias, + the residual, ReLU,
// FP16), 16 bytes of output at once.
extern "C" __global__ void split_reduce_f16(const float* ws, int splits, int M, int K, const float* bias,
                                            __half* y, int ldy, const __half* res, int ldres, int relu) {
  const EngineEpilogue<__half, 8> store{bias, nullptr, nullptr, y, ldy, res, ldres, 1.0f, relu};
  const int per_row = K / 8;
  const long long u = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (u >= static_cast<long long>(M) * per_row) return;
  const size_t m = u / per_row;
  const int k = static_cast<int>(u % per_row) * 8;
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (int z = 0; z < splits; ++z) {
    const float4* p = reinterpret_cast<const float4*>(ws + (static_cast<size_t>(z) * M + m) * K + k);
    const float4 a = p[0], b = p[1];
    acc[0] += a.x, acc[1] += a.y, acc[2] += a.z, acc[3] += a.w;
    acc[4] += b.x, acc[5] += b.y, acc[6] += b.z, acc[7] += b.w;
  }
  store.row(m, k, acc, store.load(m, k), store.factors(k));
}

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

// conv_wgpt_..., conv_wgptw_...: the persistent tiles with the TMA epilogue (8-bit; conv_wgpt_..._f16 too) (EngineEpilogueTma), the
// residual's and the output's tensor maps passed as well
#define ENGINE_WGMMA_TMA(PRE, BM, BN, S, SFX, T, E, BKC)                                                            \
  extern "C" __global__ void __launch_bounds__((BM / 64 + 1) * 128, 1) conv_##PRE##i2c_##BM##x##BN##_s##S##_##SFX( \
      const __grid_constant__ TensorMap tmX, const __grid_constant__ TensorMap tmW,                                \
      const __grid_constant__ TensorMap tmR, const __grid_constant__ TensorMap tmY, const float* bias,             \
      const float* scale, const float* inv, T* y, int ldy, const T* res, int ldres, float res_scale, int relu,     \
      int N, int P, int Q, int K, int C, int R, int Sw, int ph, int pw, int TW, int tiles_q, int tiles_p) {       \
    hopper::conv_tile<BM, BN, S, true, EngineEpilogueTma<T>, hopper::E, true, BKC>(                                \
        &tmX, &tmW, EngineEpilogueTma<T>{{bias, scale, inv, y, ldy, res, ldres, res_scale, relu}}, N, P, Q, K, C,  \
        R, Sw, ph, pw, TW, tiles_q, tiles_p, &tmR, &tmY);                                                         \
  }
// conv_wgs_i2c_...: the one-tile FP16 kernels with their reduction split over gridDim.z blocks a tile (conv_tile's
// kb_lo .. kb_hi), each writing its partial sums to ws (SplitPartial); split_reduce_f16 ends them
#define ENGINE_WGMMA_SPLIT(BM, BN, S)                                                                              \
  extern "C" __global__ void __launch_bounds__((BM / 64 + 1) * 128, 1) conv_wgs_i2c_##BM##x##BN##_s##S##_f16(     \
      const __grid_constant__ TensorMap tmX, const __grid_constant__ TensorMap tmW, float* ws, int N, int P, int Q, \
      int K, int C, int R, int Sw, int ph, int pw, int TW, int tiles_q, int tiles_p) {                            \
    hopper::conv_tile<BM, BN, S, true, SplitPartial, hopper::F16, false, 64>(                                      \
        &tmX, &tmW, SplitPartial{ws, static_cast<size_t>(N) * P * Q * K, K}, N, P, Q, K, C, R, Sw, ph, pw, TW,     \
        tiles_q, tiles_p);                                                                                         \
  }

#define ENGINE_WGMMA_TMA_8(PRE, BM, BN, S, BKC)               \
  ENGINE_WGMMA_TMA(PRE, BM, BN, S, i8, int8, S8, BKC) \
  ENGINE_WGMMA_TMA(PRE, BM, BN, S, f8, fp8, E4M3, BKC)
// FP16's (conv_wgpt_..._f16): boxes of 64 channels, so BN 64 too; 128 x 256 with two stages, as its two buffers a
// consumer (64 rows x 512 bytes, 64 KB a tile's pair) and three stages (144 KB) would not fit in 227 KB
#define ENGINE_WGMMA_TMA_16(BM, BN, S) ENGINE_WGMMA_TMA(wgpt_, BM, BN, S, f16, __half, F16, 64)

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
ENGINE_WGMMA_TMA_8(wgpt_, 128, 256, 3, 64)
ENGINE_WGMMA_TMA_8(wgpt_, 128, 128, 4, 64)
ENGINE_WGMMA_TMA_8(wgptw_, 128, 256, 3, 128)
ENGINE_WGMMA_TMA_8(wgptw_, 128, 128, 4, 128)
ENGINE_WGMMA_TMA_16(128, 256, 2)
ENGINE_WGMMA_TMA_16(128, 128, 4)
ENGINE_WGMMA_TMA_16(128, 64, 4)
ENGINE_WGMMA_TMA_16(128, 64, 8)   // lesson 5's deeper rings, one block an SM
ENGINE_WGMMA_TMA_16(64, 128, 8)
ENGINE_WGMMA_TMA_16(128, 128, 5)
ENGINE_WGMMA_SPLIT(64, 64, 6)
ENGINE_WGMMA_SPLIT(64, 128, 4)

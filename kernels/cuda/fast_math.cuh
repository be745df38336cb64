// The two conversions every tensor-core softmax makes, shared by lesson 10's kernels (gpucourse/cuda_c.py copies
// this file into each source that includes it):
//   * ex2(x) = 2^x as one instruction of the special-function unit (ex2.approx.ftz: relative error about 2^-22,
//     denormal results flushed to zero, ex2(-inf) = 0). exp2f compiles to the same instruction wrapped in a test
//     and two multiplies that keep denormal results exact: four instructions an element instead of one, in the
//     loop that the tensor cores wait on (FlashAttention's softmax takes a third of the GEMMs' time already).
//   * half2_bits(lo, hi): two floats rounded to half and packed into one 32-bit register, low half first: the
//     layout of an MMA's FP16 A operand.
#pragma once
#include <cuda_fp16.h>

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ex2_fma(x) = 2^x on the FMA and integer pipes, not the special-function unit (FlashAttention-4's trick): x = n + f
// with n = round(x) (adding 1.5 * 2^23 rounds it into the low bits) and f in [-1/2, 1/2]; 2^f by a cubic (relative
// error 7.5e-5, far inside e4m3's 2^-4), and n added to its exponent. x is clamped to -126 first, so masked (-inf)
// scores give about 1e-38, which rounds to 0 in e4m3. Where one warp's exponentials queue on the special-function
// unit (16 an SM a clock) the FMA pipes (128) take some of them.
__device__ __forceinline__ float ex2_fma(float x) {
  x = fmaxf(x, -126.0f);
  const float t = x + 12582912.0f;  // 1.5 * 2^23: round to nearest into the mantissa's low bits
  const float f = x - (t - 12582912.0f);
  float p = fmaf(fmaf(fmaf(0.05517134f, f, 0.24261034f), f, 0.69326097f), f, 0.99992812f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

__device__ __forceinline__ unsigned half2_bits(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

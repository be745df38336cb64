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

__device__ __forceinline__ unsigned half2_bits(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

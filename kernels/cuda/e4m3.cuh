// e4m3's scale and rounding on the GPU, shared by lesson 4's quantiser (fp8_quantize, tensor_cores_fp8.cu) and
// lesson 10's fused pre-pass of the FP8 forward (attention_fp8_prepass.cu); gpucourse/cuda_c.py copies this file
// into each source that includes it:
//   * e4m3_scale(amax): the scale rule of kernels/inference_engine/precision.py's e4m3_scale, bit for bit: amax / 448
//     in float32, correctly rounded (as NumPy and CuPy divide), and 1 where amax is not above 0 (a block of zeros, or
//     a NaN amax, which NumPy's and CuPy's max carry through from any NaN in the block).
//   * e4m3_code(x, scale): the e4m3 code of x / scale, the quotient correctly rounded (as NumPy divides), then rounded
//     as the GPU converts: to nearest, ties to the even code, saturated to +-448, NaN to NaN (0x7F). What
//     precision.py's to_e4m3 gives for the same float32 quotient, code for code. cuda_fp8.h converts in hardware
//     from sm_89 (cvt.rn.satfinite.e4m3x2.f32) and emulates the same rounding before.
#pragma once
#include <cuda_fp8.h>

constexpr float E4M3_MAX_VALUE = 448.0f;  // e4m3's largest finite value (precision.py's E4M3_MAX)

__device__ __forceinline__ float e4m3_scale(float amax) {
  return amax > 0.0f ? __fdiv_rn(amax, E4M3_MAX_VALUE) : 1.0f;
}

__device__ __forceinline__ unsigned char e4m3_code(float x, float scale) {
  return __nv_cvt_float_to_fp8(__fdiv_rn(x, scale), __NV_SATFINITE, __NV_E4M3);
}

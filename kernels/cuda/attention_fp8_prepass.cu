// Lesson 10, the FP8 forward's operands in one pass (fp8_operands in kernels/attention/flash.py): Q, K and V, each
// (batch x heads x N) rows of d = 128 float16 or float32 values, quantised to e4m3 codes with one scale per tile of
// 128 rows of a head, and V's codes written transposed with each 32 keys in FP8_KEY_ORDER, as flash_fp8_wgmma
// (attention_wgmma.cu) reads them. Code for code and scale for scale what the unfused path gives (lesson 4's
// quantize_fp8_gpu on each tensor, then fp8_v_transposed), reading each value once and writing each code once.
//
// One block of 512 threads per tile (128 x 128 values); blockIdx.y says which tensor (0 Q, 1 K, 2 V):
//   1. every thread loads its 32 values, 8 consecutive values of a row at a time (16-byte loads), into registers;
//   2. the tile's largest magnitude: each thread's, each warp's (shuffles), the block's (shared memory). The maximum
//      is taken over the bits of |x| as unsigned integers, which order as the values do, with every NaN above
//      infinity: a NaN in the tile gives a NaN amax, as NumPy's and CuPy's max do;
//   3. the scale, e4m3_scale(amax) (e4m3.cuh: the rule of kernels/inference_engine/precision.py's e4m3_scale, bit
//      for bit), and each value's code, e4m3_code (e4m3.cuh: fp8_quantize's rounding);
//   4. Q and K: the codes go out where the values came from, 8 bytes for 8 values. V: the tile goes out transposed,
//      through shared memory (below), as 128 rows of d, each the tile's 128 keys in FP8_KEY_ORDER.
//
// SIMT code only (no tensor cores, no TMA): it compiles for every GPU the course supports.

#include "e4m3.cuh"

#include <cuda_fp16.h>

namespace prepass {

constexpr int TILE = 128;     // rows of a tile: the keys (or queries) one scale covers
constexpr int D = 128;        // the head dimension
constexpr int THREADS = 512;  // a block: 16 warps
constexpr int WARPS = THREADS / 32;
constexpr int PIECES = TILE * D / 8 / THREADS;  // 8-value pieces a thread loads: 4 (32 values)
static_assert(WARPS == 16, "V's tile is 16 units of 32 keys x 32 columns of d, one a warp (vt_tile)");
// V's staging tile in shared memory: 128 rows of d, each 128 key codes (32 words) and one word of padding, so that
// both the writes and the reads below reach 32 different banks.
constexpr int VT_ROW_WORDS = 33;

// 8 consecutive values of a row as loaded (FP16: one 16-byte load, kept as 4 registers; FP32: two 16-byte loads).
template <typename T>
struct Piece;
template <>
struct Piece<__half> {
  uint4 raw;
  __device__ __forceinline__ void load(const __half* p) { raw = __ldg(reinterpret_cast<const uint4*>(p)); }
  __device__ __forceinline__ float at(int j) const {
    const unsigned w = j < 2 ? raw.x : j < 4 ? raw.y : j < 6 ? raw.z : raw.w;
    return __half2float(__ushort_as_half(static_cast<unsigned short>(j % 2 ? w >> 16 : w & 0xFFFFu)));
  }
};
template <>
struct Piece<float> {
  float4 lo, hi;
  __device__ __forceinline__ void load(const float* p) {
    lo = __ldg(reinterpret_cast<const float4*>(p));
    hi = __ldg(reinterpret_cast<const float4*>(p) + 1);
  }
  __device__ __forceinline__ float at(int j) const {
    const float4& h = j < 4 ? lo : hi;
    const int i = j % 4;
    return i == 0 ? h.x : i == 1 ? h.y : i == 2 ? h.z : h.w;
  }
};

// The largest |x| of the block's tile, as the bits of a float (see 2. above); every thread gets it.
__device__ __forceinline__ float block_amax(unsigned bits, unsigned* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) bits = max(bits, __shfl_xor_sync(0xFFFFFFFFu, bits, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = bits;
  __syncthreads();
  bits = red[0];
#pragma unroll
  for (int w = 1; w < WARPS; ++w) bits = max(bits, red[w]);
  return __uint_as_float(bits);
}

template <typename T>
__device__ __forceinline__ unsigned piece_absmax(const Piece<T>& p, unsigned bits) {
#pragma unroll
  for (int j = 0; j < 8; ++j) bits = max(bits, __float_as_uint(p.at(j)) & 0x7FFFFFFFu);
  return bits;
}

// Q or K: piece i of thread t is piece t + 512 i of the tile (16 a row): a warp reads 512 (FP16) or 1024 (FP32)
// consecutive bytes and writes 256 consecutive bytes of codes.
template <typename T>
__device__ __forceinline__ void rows_tile(const T* __restrict__ x, unsigned char* __restrict__ codes,
                                          float* __restrict__ scale_out, size_t tile, unsigned* red) {
  const size_t base = tile * TILE * D;
  Piece<T> p[PIECES];
#pragma unroll
  for (int i = 0; i < PIECES; ++i) p[i].load(x + base + 8 * (threadIdx.x + THREADS * i));
  unsigned bits = 0;
#pragma unroll
  for (int i = 0; i < PIECES; ++i) bits = piece_absmax(p[i], bits);
  const float scale = e4m3_scale(block_amax(bits, red));
  if (threadIdx.x == 0) *scale_out = scale;
#pragma unroll
  for (int i = 0; i < PIECES; ++i) {
    unsigned w[2] = {0u, 0u};
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j / 4] |= static_cast<unsigned>(e4m3_code(p[i].at(j), scale)) << (8 * (j % 4));
    *reinterpret_cast<uint2*>(codes + base + 8 * (threadIdx.x + THREADS * i)) = make_uint2(w[0], w[1]);
  }
}

// V, transposed. The tile is 16 units of 32 keys x 32 columns of d, one a warp: unit u covers keys 32 (u % 4) ..
// + 31 and columns 32 (u / 4) .. + 31. In a unit, lane l = 4 s + m loads columns 8 m .. 8 m + 7
// of the 4 keys that FP8_KEY_ORDER puts in slots 4 s .. 4 s + 3 of the 32: keys 16 (s / 4) + 2 (s % 4) + 0, 1, 8, 9.
// Their 4 codes of a column are one 32-bit word of the transposed tile (slot 4 s + i in byte i), which goes to
// shared memory at row c (the column of d), word 8 (u % 4) + s. With rows of 33 words a warp's 32 stores of one
// column j fall in banks (8 m + j + s + 8 (u % 4)) % 32: 32 different ones. Then each thread copies 16-byte runs of
// the staged rows out (8 threads a row of 128 codes): a warp's loads of one word fall in banks
// (row + 4 (l % 8) + word) % 32 for its 4 rows, again 32 different ones, and its stores are 4 whole 128-byte rows.
template <typename T>
__device__ __forceinline__ void vt_tile(const T* __restrict__ v, unsigned char* __restrict__ vt,
                                        float* __restrict__ scale_out, size_t tile, int n, unsigned* red,
                                        unsigned* staged) {
  const int tiles_per_head = n / TILE;
  const size_t bh = tile / tiles_per_head, t = tile % tiles_per_head;
  const size_t base = tile * TILE * D;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, m = lane % 4, s = lane / 4;
  const int u = warp, first_key = 32 * (u % 4) + 16 * (s / 4) + 2 * (s % 4);
  Piece<T> p[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int key = first_key + (i % 2) + 8 * (i / 2);  // + 0, 1, 8, 9
    p[i].load(v + base + static_cast<size_t>(key) * D + 32 * (u / 4) + 8 * m);
  }
  unsigned bits = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) bits = piece_absmax(p[i], bits);
  const float scale = e4m3_scale(block_amax(bits, red));
  if (threadIdx.x == 0) *scale_out = scale;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    unsigned word = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) word |= static_cast<unsigned>(e4m3_code(p[i].at(j), scale)) << (8 * i);
    staged[(32 * (u / 4) + 8 * m + j) * VT_ROW_WORDS + 8 * (u % 4) + s] = word;
  }
  __syncthreads();
  unsigned char* out = vt + bh * D * static_cast<size_t>(n) + t * TILE;  // row c of d: out + c n
#pragma unroll
  for (int k = 0; k < TILE * D / 16 / THREADS; ++k) {  // 2 runs of 16 codes a thread
    const int o = threadIdx.x + THREADS * k, c = o / 8, run = o % 8;
    const unsigned* row = staged + c * VT_ROW_WORDS + 4 * run;
    *reinterpret_cast<uint4*>(out + static_cast<size_t>(c) * n + 16 * run) = make_uint4(row[0], row[1], row[2], row[3]);
  }
}

// Q and K of type TQK, V of type TV (float32 Q and K with FP16 V: the Hadamard rotation's output beside V as given).
// codes_q, codes_k: (batch x heads x N, 128); vt: (batch x heads x 128, N); scales: (3, batch x heads x N / 128),
// Q's, K's, V's. A block per tile and tensor: grid (batch x heads x N / 128, 3).
template <typename TQK, typename TV>
__device__ __forceinline__ void fp8_prepass(const TQK* __restrict__ q, const TQK* __restrict__ k,
                                            const TV* __restrict__ v, unsigned char* __restrict__ codes_q,
                                            unsigned char* __restrict__ codes_k, unsigned char* __restrict__ vt,
                                            float* __restrict__ scales, int n) {
  __shared__ unsigned red[WARPS];
  __shared__ unsigned staged[D * VT_ROW_WORDS];
  const size_t tile = blockIdx.x;
  float* scale_out = scales + static_cast<size_t>(blockIdx.y) * gridDim.x + tile;
  if (blockIdx.y == 0)
    rows_tile<TQK>(q, codes_q, scale_out, tile, red);
  else if (blockIdx.y == 1)
    rows_tile<TQK>(k, codes_k, scale_out, tile, red);
  else
    vt_tile<TV>(v, vt, scale_out, tile, n, red, staged);
}

}  // namespace prepass

// The kernels fp8_operands launches: fp8_prepass_<Q and K's type>_<V's type>.
#define FP8_PREPASS(QKNAME, TQK, VNAME, TV)                                                                        \
  extern "C" __global__ void __launch_bounds__(prepass::THREADS, 2) fp8_prepass_##QKNAME##_##VNAME(                \
      const TQK* q, const TQK* k, const TV* v, unsigned char* codes_q, unsigned char* codes_k, unsigned char* vt, \
      float* scales, int n) {                                                                                     \
    prepass::fp8_prepass<TQK, TV>(q, k, v, codes_q, codes_k, vt, scales, n);                                     \
  }

FP8_PREPASS(f16, __half, f16, __half)
FP8_PREPASS(f32, float, f32, float)
FP8_PREPASS(f32, float, f16, __half)
FP8_PREPASS(f16, __half, f32, float)

// What lesson 10's Hopper kernels share beyond hopper.cuh (gpucourse/cuda_c.py copies this file into each source that
// includes it): the descriptors of a tile of 128-column rows as the TMA writes it, and the 16-byte stores of an FP16
// tile held as wgmma accumulators. (The named barriers between warpgroups are hopper.cuh's.)
#pragma once
#include <cuda_fp16.h>
#include "hopper.cuh"
#include "fast_math.cuh"

namespace hopper {

#ifdef GPUCOURSE_WGMMA
// The descriptor of k step kk (16 columns) of a tile of ROWS rows stored as the TMA writes Q's and K's: D / 64 boxes
// of 64 columns (128 bytes: one row of the swizzle) each; k steps 32 bytes within a box, then to the next box.
template <int ROWS>
__device__ __forceinline__ unsigned long long k_step_desc(unsigned tile, int kk) {
  return make_desc(tile + (kk / 4) * ROWS * 128 + (kk % 4) * 32, 16, 1024);
}

// X = A B^T for a consumer's rows of A, both operands K-major in shared memory (boxes of RA and RB rows): D / 16
// wgmmas of k = 16. The forward's S = Q K^T; the backward's S^T = K Q^T, dP^T = V dO^T, and S and dP again.
template <int D, int RA, int RB>
__device__ __forceinline__ void issue_scores(float (&s)[RB / 16][8], unsigned a_addr, unsigned b_addr) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_k16<RB, 0>(s, k_step_desc<RA>(a_addr, kk), k_step_desc<RB>(b_addr, kk), kk > 0);
}

// The output leaves in 16-byte stores. Of each 32 columns of a row, the row's four threads (q = lane % 4) hold the
// 16 words (two halves each) 4x + q at their places x = 0..3; transposed within the four, thread q holds words
// 4q .. 4q + 3, eight columns side by side. Two exchanges: the places whose bit 1, then bit 0, differs from q's go
// to the thread q ^ 2, then q ^ 1, into the place of the same bit flipped. (32 stores of 4 bytes a thread cost up to
// 7% of a causal run at N = 4k, when both consumers write an item's output at once and the tensor cores wait.)
__device__ __forceinline__ void quad_transpose(unsigned (&w)[4], int q) {
#pragma unroll
  for (int b = 2; b >= 1; b >>= 1) {
    const bool set = q & b;
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      if (x & b) continue;  // the pair (x, x | b): a thread sends the one whose bit b is not its own
      const unsigned got = __shfl_xor_sync(0xffffffff, set ? w[x] : w[x | b], b);
      if (set) w[x] = got;
      else w[x | b] = got;
    }
  }
}

// Rows row0 and row0 + 8 of a tile held as wgmma accumulators (D columns: acc[j][e] is column 16j + 8 (e / 4) +
// 2 (lane % 4) + e % 2 of row h = (e / 2) % 2), each times mul[h], rounded to FP16 and stored 16 bytes a thread into
// rows of D halves at ``out`` (row r at out + r D): the quad_transpose above. Rows from ``rows`` on are not stored
// (a tile reaching past the end of the sequence).
template <int D>
__device__ __forceinline__ void store_rows_fp16(half* out, const float (&acc)[D / 16][8], const float (&mul)[2],
                                                int row0, int lane, int rows = 0x7fffffff) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int a = 0; a < D / 32; ++a) {  // columns 32a .. 32a + 31: word 4x + q is column block 2a + x / 2's
      unsigned w[4];                     // elements 4 (x % 2) + 2h and + 1
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int j = 2 * a + x / 2, e = 4 * (x % 2) + 2 * h;
        w[x] = half2_bits(acc[j][e] * mul[h], acc[j][e + 1] * mul[h]);
      }
      quad_transpose(w, lane % 4);  // now columns 32a + 8q .. + 7 (every lane takes part in the exchange)
      if (row0 + 8 * h < rows)
        *reinterpret_cast<uint4*>(out + static_cast<size_t>(row0 + 8 * h) * D + 32 * a + 8 * (lane % 4)) =
            make_uint4(w[0], w[1], w[2], w[3]);
    }
}
#endif  // GPUCOURSE_WGMMA

}  // namespace hopper

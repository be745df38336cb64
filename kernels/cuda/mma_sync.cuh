// The warp-level tensor-core instructions in inline PTX, shared by lesson 6's stem and one-kernel network
// (inference_engine_stem.cuh, inference_engine_network.cu) and lesson 10's FlashAttention-2 kernel
// (attention_mma.cu); gpucourse/cuda_c.py copies this file into each source that includes it. Their register
// layouts are documented (PTX ISA, "Matrix fragments for mma.m16n8k16"), unlike WMMA's: with g = lane / 4 and
// c = lane % 4, a[0] = A(g, 2c..2c+1), a[1] = A(g+8, 2c..), a[2] = A(g, 2c+8..), a[3] = A(g+8, 2c+8..);
// b0 = B(2c..2c+1, g), b1 = B(2c+8.., g); d[0..1] = D(g, 2c..2c+1), d[2..3] = D(g+8, 2c..2c+1) (for 8-bit
// inputs, each "2c" is "4c" and each register holds four values).
//   * mma16816: D += A B, 16 x 8 x 16, FP16 inputs, FP32 sums;
//   * mma16832: D += A B, 16 x 8 x 32, INT8 inputs, int32 sums;
//   * ldmatrix_x4 (and _trans): four 8 x 8 matrices of 16-bit values from shared memory into fragments.
// m16n8k16 and m16n8k32 came with sm_80; on sm_75 (a T4) each is done as the smaller shapes it had (two m16n8k8,
// four m8n8k16), with the same fragments and the same result.
#pragma once

__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else  // sm_75: k 0-7 and 8-15 as two m16n8k8
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(b0));
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[2]), "r"(a[3]), "r"(b1));
#endif
}

__device__ __forceinline__ void mma16832(int (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else  // sm_75: four m8n8k16, rows 0-7 and 8-15 times k 0-15 and 16-31
  asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.s8.s8.s32 {%0,%1}, {%2}, {%3}, {%0,%1};"
               : "+r"(d[0]), "+r"(d[1]) : "r"(a[0]), "r"(b0));
  asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.s8.s8.s32 {%0,%1}, {%2}, {%3}, {%0,%1};"
               : "+r"(d[0]), "+r"(d[1]) : "r"(a[2]), "r"(b1));
  asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.s8.s8.s32 {%0,%1}, {%2}, {%3}, {%0,%1};"
               : "+r"(d[2]), "+r"(d[3]) : "r"(a[1]), "r"(b0));
  asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.s8.s8.s32 {%0,%1}, {%2}, {%3}, {%0,%1};"
               : "+r"(d[2]), "+r"(d[3]) : "r"(a[3]), "r"(b1));
#endif
}

// Four 8 x 8 matrices of 16-bit values from shared memory (address ``addr`` in the shared window): lane 8i + r gives
// the address of row r of matrix i, and lane 4r + c receives elements (r, 2c) and (r, 2c + 1) of each matrix, one
// 32-bit register per matrix. ldmatrix_x4_trans: each matrix transposed on the way (lane 4r + c receives elements
// (2c, r) and (2c + 1, r)). Both read shared memory the compiler does not see them read: the "memory" clobber keeps
// them after the stores they depend on.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
  ldmatrix_x4(r, static_cast<unsigned>(__cvta_generic_to_shared(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

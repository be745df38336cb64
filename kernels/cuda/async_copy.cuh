// cp.async (sm_80+), shared by the kernels of lessons 4, 5 and 6 (gpucourse/cuda_c.py copies this file into each
// source that includes it): a 16-byte copy from global to shared memory that does not pass through registers
// and does not block the thread; commit_group closes a group of copies, wait_group<n> waits until at most n
// groups are still in flight. cp_async16_zfill copies nothing and writes 16 bytes of zeros where ``valid`` is
// false (cp.async's src-size 0): the edges of an image, the ragged end of a matrix.
// Below sm_80 (a T4) there is no cp.async: the copy is an ordinary 16-byte load and shared store, finished
// before the thread goes on, so commit and wait have nothing to do and the __syncthreads that follows every
// wait still makes the tile visible to the whole block. A pipeline then runs synchronously: same results, no
// overlap of copies and math (gpucourse/gpus.py names the steps that fall back).
#pragma once

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
#else
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid)
{
    *reinterpret_cast<uint4*>(smem) = valid ? *reinterpret_cast<const uint4*>(gmem) : make_uint4(0, 0, 0, 0);
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem)
{
    *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
}
__device__ __forceinline__ void cp_async_commit() {}
template <int N>
__device__ __forceinline__ void cp_async_wait() {}
#endif

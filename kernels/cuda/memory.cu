// Lesson 3: the memory hierarchy measured, in CUDA C (what numba cannot time: a single thread's clock).
// Loaded from Python by gpucourse/cuda_c.py (CuPy compiles it with NVRTC on first use); the launchers with their
// input checks are in kernels/memory.py.
//
// 1. Latency: a pointer chase, one thread, each load's address the value of the load before, timed with clock64()
//    (shared memory, and global memory whose working set fits the L1, the L2, or neither); the latency of a
//    register-to-register FMA as the floor; and the SM clock rate, to turn cycles into nanoseconds.
// 2. Bandwidth: a read probe whose blocks reread slices small enough for their SM's L1, or pass slices that fit
//    only the L2 from block to block, or stream device memory; and a shared-memory read probe.

// ------------------------------------------------------------------------------------------------- 1. latency

// region: chase
// One thread follows the chain: next[p] is the index of the next node. `warm` loads first,
// untimed (a chain that fits a cache is then in it), then `steps` loads timed in SM clock
// cycles. Each load needs the value of the one before, so nothing overlaps: cycles / steps is
// the latency of one load.
extern "C" __global__ void chase_global(const unsigned* next, int warm, int steps,
                                        unsigned long long* out)
{
    unsigned p = 0;
    for (int i = 0; i < warm; ++i) p = next[p];
    long long t0 = clock64();
    for (int i = 0; i < steps; ++i) p = next[p];
    long long t1 = clock64();
    out[0] = (unsigned long long)(t1 - t0);
    out[1] = p;  // the chase's end, stored so that the compiler keeps every load
}
// endregion

#define SHARED_CHASE_WORDS (12 * 1024)  // 48 KiB: what every GPU gives a block without asking

extern "C" __global__ void chase_shared(const unsigned* next, int words, int steps, unsigned long long* out)
{
    __shared__ unsigned chain[SHARED_CHASE_WORDS];
    for (int i = 0; i < words; ++i) chain[i] = next[i];
    __syncthreads();
    unsigned p = 0;
    long long t0 = clock64();
    for (int i = 0; i < steps; ++i) p = chain[p];
    long long t1 = clock64();
    out[0] = (unsigned long long)(t1 - t0);
    out[1] = p;
}

// A chain of fused multiply-adds, each needing the result of the one before: the latency of the FMA pipe, with
// operands and result in registers.
extern "C" __global__ void fma_chain(float a, float b, int steps, unsigned long long* out)
{
    float x = a;
    long long t0 = clock64();
#pragma unroll 32
    for (int i = 0; i < steps; ++i) x = fmaf(x, a, b);
    long long t1 = clock64();
    out[0] = (unsigned long long)(t1 - t0);
    out[1] = __float_as_uint(x);
}

// SM cycles (clock64) against nanoseconds (%globaltimer) over a spin of `ns`: the clock rate while it runs.
extern "C" __global__ void clock_rate(unsigned long long ns, unsigned long long* out)
{
    unsigned long long g0, g;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
    long long c0 = clock64();
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
    } while (g - g0 < ns);
    long long c1 = clock64();
    out[0] = (unsigned long long)(c1 - c0);
    out[1] = g - g0;
}

// ----------------------------------------------------------------------------------------------- 2. bandwidth

// region: read_level
// Block b reads, `reps` times, slice (b + r * shift) % gridDim.x of x: slices of `slice_vec`
// float4. With shift 0 each block rereads its own slice, which its SM's L1 keeps where it fits;
// with shift 1 the block reads another slice each time, one that other SMs read before: the L2
// serves it where all the slices fit there. The sum is written only if it is impossible (x is
// non-negative), so the loads cannot be dropped and nothing is written.
extern "C" __global__ void read_level(const float* x, int slice_vec, int reps, int shift,
                                      float* sink)
{
    const float4* v = reinterpret_cast<const float4*>(x);
    float acc0 = 0.0f, acc1 = 0.0f;  // two sums: the adds keep up with the loads
    unsigned s = blockIdx.x;  // this rep's slice: (blockIdx.x + r * shift) % gridDim.x
    for (int r = 0; r < reps; ++r) {
        const float4* p = v + (size_t)s * slice_vec;
#pragma unroll 4
        for (int i = threadIdx.x; i < slice_vec; i += blockDim.x) {
            float4 q = p[i];
            acc0 += q.x + q.y;
            acc1 += q.z + q.w;
        }
        s += shift;
        if (s >= gridDim.x) s -= gridDim.x;
    }
    if (acc0 + acc1 == -1.0f) sink[0] = acc0;
}
// endregion

// Every thread reads a float4 of its block's shared array `reps` times, lane l of a warp at consecutive float4s:
// no bank conflicts. blockDim.x: a power of two up to 1024.
extern "C" __global__ void shared_read(int reps, float* sink)
{
    __shared__ float4 buf[1024];
    int t = threadIdx.x;
    buf[t] = make_float4(t, t + 1, t + 2, t + 3);
    __syncthreads();
    unsigned mask = blockDim.x - 1;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
    for (int r = 0; r < reps; ++r) {
        float4 q = buf[(t + r) & mask];
        acc.x += q.x;
        acc.y += q.y;
        acc.z += q.z;
        acc.w += q.w;
    }
    if (acc.x + acc.y + acc.z + acc.w == -1.0f) sink[0] = acc.x;
}

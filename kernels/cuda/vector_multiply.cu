// Lesson 1: vector multiply, out[i] = a[i] * b[i], in CUDA C.
// Loaded from Python by gpucourse/cuda_c.py (CuPy compiles it with NVRTC on first use).

// region: vmul_grid_stride
// One thread per element at a time, striding over the whole grid: any n works with any grid.
extern "C" __global__ void vmul_grid_stride(const float* __restrict__ a, const float* __restrict__ b,
                                            float* __restrict__ out, long long n)
{
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = a[i] * b[i];
}
// endregion

// The same, moving 16 bytes per load and store (float4): a quarter of the memory instructions.
// Needs a, b and out 16-byte aligned (CuPy allocations are). The last n % 4 elements go one by one.
extern "C" __global__ void vmul_vec4(const float* __restrict__ a, const float* __restrict__ b,
                                     float* __restrict__ out, long long n)
{
    const float4* a4 = reinterpret_cast<const float4*>(a);
    const float4* b4 = reinterpret_cast<const float4*>(b);
    float4* o4 = reinterpret_cast<float4*>(out);
    long long n4 = n / 4;
    long long stride = (long long)gridDim.x * blockDim.x;
    long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long i = first; i < n4; i += stride) {
        float4 x = a4[i], y = b4[i];
        o4[i] = make_float4(x.x * y.x, x.y * y.y, x.z * y.z, x.w * y.w);
    }
    for (long long i = 4 * n4 + first; i < n; i += stride)
        out[i] = a[i] * b[i];
}

// float4 and four independent loads of each input in flight per thread before the first multiply:
// more bytes requested per thread hides more of the memory latency. Streaming hints (__ldcs, __stcs)
// tell the cache these lines are used once.
extern "C" __global__ void vmul_vec4_unroll4(const float* __restrict__ a, const float* __restrict__ b,
                                             float* __restrict__ out, long long n)
{
    const float4* a4 = reinterpret_cast<const float4*>(a);
    const float4* b4 = reinterpret_cast<const float4*>(b);
    float4* o4 = reinterpret_cast<float4*>(out);
    long long n4 = n / 4;
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n4; i += 4 * stride) {
        float4 x[4], y[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) { x[k] = __ldcs(a4 + i + k * stride); y[k] = __ldcs(b4 + i + k * stride); }
#pragma unroll
        for (int k = 0; k < 4; ++k)
            __stcs(o4 + i + k * stride, make_float4(x[k].x * y[k].x, x[k].y * y[k].y, x[k].z * y[k].z, x[k].w * y[k].w));
    }
    for (; i < n4; i += stride) {
        float4 x = a4[i], y = b4[i];
        o4[i] = make_float4(x.x * y.x, x.y * y.y, x.z * y.z, x.w * y.w);
    }
    long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long j = 4 * n4 + first; j < n; j += stride)
        out[j] = a[j] * b[j];
}

// Keeps every launched thread busy for `ns` nanoseconds (read off the GPU's global timer) and writes how
// many rounds of 1000 multiply-adds each thread did. Launched as one block of 32 threads it occupies one SM
// of many, while nvidia-smi reports the GPU as fully "utilised".
extern "C" __global__ void spin(unsigned long long ns, unsigned long long* rounds)
{
    unsigned long long t0, t, count = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    float x = threadIdx.x;
    do {
        for (int k = 0; k < 1000; ++k) x = x * 0.999f + 0.001f;
        ++count;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
    rounds[(long long)blockIdx.x * blockDim.x + threadIdx.x] = count + (x == -1.0f);  // x is used: loop stays
}

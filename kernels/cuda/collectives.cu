// Lesson 7: the kernels of the ring all-reduce, in CUDA C.
// Loaded from Python by gpucourse/cuda_c.py (CuPy compiles it with NVRTC on first use); launched by
// kernels/collectives/gpu.py: GpuRing.allreduce, one launch per step of the ring on every GPU.
//
// With peer access enabled (cudaDeviceEnablePeerAccess), a kernel on GPU r may dereference a pointer into
// GPU r - 1's memory: each such load crosses NVLink (or PCIe). So one kernel does a whole step of the
// reduce-scatter: it loads the previous GPU's chunk over the link, loads its own chunk, adds and stores.
// The data cross the link once, straight into registers; no scratch buffer is written and read back, and
// the add needs no pass over memory of its own: it runs while the link delivers the data.
//
// Every kernel takes (mine, peer, n): mine is GPU r's chunk, peer the same chunk on GPU r - 1. Each thread
// moves 16 bytes at a time (float4, double2, 8 halves) where both pointers sit at the same offset from a
// 16-byte boundary; the elements before the first boundary and after the last whole 16 bytes go one by one.
// Pointers at different offsets (which a CuPy view can give) go one by one throughout. The grid strides
// over the chunk, so any grid covers any n; the launcher sizes it from the number of SMs.

#include <cuda_fp16.h>

#define UNROLL 4  // 16-byte loads in flight per thread and per buffer before the first add

// One element.
__device__ __forceinline__ float add1(float a, float b) { return a + b; }
__device__ __forceinline__ double add1(double a, double b) { return a + b; }
__device__ __forceinline__ __half add1(__half a, __half b) { return __hadd(a, b); }

// 16 bytes of T held in a uint4, added lane by lane. The bits are moved with the intrinsics that
// reinterpret them (no pointer casts between types).
template <typename T> __device__ __forceinline__ uint4 add16(uint4 a, uint4 b);

template <> __device__ __forceinline__ uint4 add16<float>(uint4 a, uint4 b)
{
    return make_uint4(__float_as_uint(__uint_as_float(a.x) + __uint_as_float(b.x)),
                      __float_as_uint(__uint_as_float(a.y) + __uint_as_float(b.y)),
                      __float_as_uint(__uint_as_float(a.z) + __uint_as_float(b.z)),
                      __float_as_uint(__uint_as_float(a.w) + __uint_as_float(b.w)));
}

template <> __device__ __forceinline__ uint4 add16<double>(uint4 a, uint4 b)
{
    // a double is two 32-bit words, the low one first
    double lo = __hiloint2double((int)a.y, (int)a.x) + __hiloint2double((int)b.y, (int)b.x);
    double hi = __hiloint2double((int)a.w, (int)a.z) + __hiloint2double((int)b.w, (int)b.z);
    return make_uint4((unsigned)__double2loint(lo), (unsigned)__double2hiint(lo),
                      (unsigned)__double2loint(hi), (unsigned)__double2hiint(hi));
}

__device__ __forceinline__ unsigned add_half2(unsigned a, unsigned b)
{
    // two halves in one 32-bit word, added as a __half2
    __half2 x = __halves2half2(__ushort_as_half((unsigned short)(a & 0xffffu)), __ushort_as_half((unsigned short)(a >> 16)));
    __half2 y = __halves2half2(__ushort_as_half((unsigned short)(b & 0xffffu)), __ushort_as_half((unsigned short)(b >> 16)));
    __half2 s = __hadd2(x, y);
    return (unsigned)__half_as_ushort(__low2half(s)) | ((unsigned)__half_as_ushort(__high2half(s)) << 16);
}

template <> __device__ __forceinline__ uint4 add16<__half>(uint4 a, uint4 b)
{
    return make_uint4(add_half2(a.x, b.x), add_half2(a.y, b.y), add_half2(a.z, b.z), add_half2(a.w, b.w));
}

// What one element, or 16 bytes, of GPU r's chunk becomes: its sum with the peer's (ADD), or the peer's.
template <typename T, bool ADD> __device__ __forceinline__ T combine1(T mine, T peer)
{
    if constexpr (ADD) return add1(mine, peer);
    else return peer;
}

template <typename T, bool ADD> __device__ __forceinline__ uint4 combine16(uint4 mine, uint4 peer)
{
    if constexpr (ADD) return add16<T>(mine, peer);
    else return peer;
}

// region: ring_step
// mine[i] = mine[i] + peer[i] (ADD) or mine[i] = peer[i] (a copy), for i < n.
template <typename T, bool ADD>
__device__ __forceinline__ void ring_step(T* mine, const T* peer, long long n)
{
    constexpr int E = 16 / sizeof(T);  // elements in 16 bytes
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const unsigned a = (unsigned)(reinterpret_cast<unsigned long long>(mine) % 16);
    const unsigned b = (unsigned)(reinterpret_cast<unsigned long long>(peer) % 16);
    long long head = n;  // elements done one by one before the 16-byte loads start: all of them unless a == b
    if (a == b) {
        long long to_boundary = (long long)((16 - a) % 16) / (long long)sizeof(T);
        head = to_boundary < n ? to_boundary : n;
    }
    for (long long i = first; i < head; i += stride)
        mine[i] = combine1<T, ADD>(mine[i], peer[i]);

    const long long packs = (n - head) / E;  // whole 16 bytes after the head
    uint4* m4 = reinterpret_cast<uint4*>(mine + head);
    const uint4* p4 = reinterpret_cast<const uint4*>(peer + head);
    long long i = first;
    for (; i + (UNROLL - 1) * stride < packs; i += UNROLL * stride) {
        uint4 x[UNROLL], y[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) y[u] = p4[i + u * stride];  // the peer's loads first: they take longest
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) x[u] = ADD ? m4[i + u * stride] : y[u];  // a copy reads nothing of its own
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) m4[i + u * stride] = combine16<T, ADD>(x[u], y[u]);
    }
    for (; i < packs; i += stride)
        m4[i] = combine16<T, ADD>(ADD ? m4[i] : p4[i], p4[i]);
    for (long long j = head + packs * E + first; j < n; j += stride)  // the tail: fewer than E elements
        mine[j] = combine1<T, ADD>(mine[j], peer[j]);
}
// endregion

// A step of the reduce-scatter: mine += peer, n elements.
extern "C" __global__ void ring_reduce_f32(float* mine, const float* peer, long long n)
{
    ring_step<float, true>(mine, peer, n);
}

extern "C" __global__ void ring_reduce_f64(double* mine, const double* peer, long long n)
{
    ring_step<double, true>(mine, peer, n);
}

extern "C" __global__ void ring_reduce_f16(__half* mine, const __half* peer, long long n)
{
    ring_step<__half, true>(mine, peer, n);
}

// A step of the all-gather done by the SMs instead of a copy engine: mine = peer, n bytes.
extern "C" __global__ void ring_copy(unsigned char* mine, const unsigned char* peer, long long n)
{
    ring_step<unsigned char, false>(mine, peer, n);
}

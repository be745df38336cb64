// Lesson 10: attention's kernels in CUDA C. Loaded from Python by gpucourse/cuda_c.py (CuPy compiles it with NVRTC;
// <mma.h> needs the CUDA include path, which cuda_c.include_dirs() finds); launched by kernels/attention/.
//
// 1. Row softmax, memory-bound: each element is read once and written once, so the copy's bandwidth is the ceiling.
//    softmax_three_pass_* reads the row three times (max, sum of exponentials, normalise); softmax_online_* reads
//    it once into registers, keeps a running (max, sum) per thread as it goes (the online softmax), merges the
//    threads' pairs with the merge rule, and writes each exp(x - max) / sum from the registers.
//    softmax_cluster_* (Hopper, sm_90+) splits a long row across a thread-block cluster of 1 to 8 smaller blocks,
//    each holding its slice in registers; the blocks exchange their (max, sum) pairs through distributed shared
//    memory. softmax_warp_rows_* gives short rows a warp each, several rows a block.
// 2. FlashAttention's forward pass on the tensor cores through WMMA (sm_80+; cp.async brings the K and V tiles in
//    while the previous tile is computed): a block keeps BLOCK_M rows of Q, streams the keys and values in tiles
//    of 64, and never writes the N x N scores to memory.
#include <mma.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include "async_copy.cuh"
#include "fast_math.cuh"

using namespace nvcuda;
namespace cg = cooperative_groups;

#define NEG_INF __int_as_float(0xff800000)

// ------------------------------------------------------------------------------------------ helpers

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

// 16 bytes of T as E floats, and back: four floats, or eight halves converted two at a time (half2).
template <typename T> struct Pack;
template <> struct Pack<float> {
    static constexpr int E = 4;
    __device__ __forceinline__ static void get(const uint4& v, float (&f)[4])
    {
        f[0] = __uint_as_float(v.x);
        f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z);
        f[3] = __uint_as_float(v.w);
    }
    __device__ __forceinline__ static uint4 put(const float (&f)[4])
    {
        return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
    }
};
template <> struct Pack<__half> {
    static constexpr int E = 8;
    __device__ __forceinline__ static void get(const uint4& v, float (&f)[8])
    {
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&w[k]));
            f[2 * k] = p.x;
            f[2 * k + 1] = p.y;
        }
    }
    __device__ __forceinline__ static uint4 put(const float (&f)[8])
    {
        unsigned w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const __half2 h = __floats2half2_rn(f[2 * k], f[2 * k + 1]);
            w[k] = *reinterpret_cast<const unsigned*>(&h);
        }
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
};

// region: merge
// Two partial softmax sums (m1, l1) and (m2, l2) over disjoint parts of a row, into one: the larger max wins and
// the other part's sum is rescaled to it. A part that saw only -inf has m = -inf and l = 0, and drops out.
__device__ __forceinline__ void merge(float& m, float& l, float m2, float l2)
{
    float mn = fmaxf(m, m2);
    if (mn == NEG_INF) return;  // both parts empty
    l = l * __expf(m - mn) + l2 * __expf(m2 - mn);
    m = mn;
}
// endregion

__device__ __forceinline__ float block_max(float v, float* red)
{
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < warps ? red[lane] : NEG_INF;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

__device__ __forceinline__ float block_sum(float v, float* red)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < warps ? red[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

// ------------------------------------------------------------------------------------------ softmax

// region: softmax_three_pass
// One block per row: pass 1 the max, pass 2 the sum of exp(x - max), pass 3 the output. The row is read from
// memory three times (the second and third reads may hit the L2 cache for short rows).
template <typename T>
__device__ void softmax_three_pass(const T* __restrict__ x, T* __restrict__ y, int n)
{
    __shared__ float red[32];
    const T* row = x + (size_t)blockIdx.x * n;
    T* out = y + (size_t)blockIdx.x * n;
    float m = NEG_INF;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, to_float(row[i]));
    m = block_max(m, red);
    const float shift = m == NEG_INF ? 0.0f : m;  // a row of -inf: every exp is 0, and so is the output
    float l = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) l += __expf(to_float(row[i]) - shift);
    l = block_sum(l, red);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = from_float<T>(__expf(to_float(row[i]) - shift) * inv);
}
// endregion

extern "C" __global__ void softmax_three_pass_f32(const float* x, float* y, int n) { softmax_three_pass(x, y, n); }
extern "C" __global__ void softmax_three_pass_f16(const __half* x, __half* y, int n) { softmax_three_pass(x, y, n); }

// region: softmax_online
// One block per row, the row read once: each thread loads its elements, 16 bytes at a time, into registers (up to
// VECS loads of 16 bytes: 32 floats or 64 halves a thread), keeping a running (max, sum) as it goes; the threads'
// pairs are merged (warp shuffles, then one warp); each thread writes exp(x - max) / sum from its registers.
template <typename T, int VECS>
__device__ void softmax_online(const T* __restrict__ x, T* __restrict__ y, int n)
{
    constexpr int E = 16 / sizeof(T);  // elements in 16 bytes
    __shared__ float red_m[32], red_l[32];
    const uint4* row = reinterpret_cast<const uint4*>(x + (size_t)blockIdx.x * n);
    uint4* out = reinterpret_cast<uint4*>(y + (size_t)blockIdx.x * n);
    const int vecs = n / E;
    uint4 v[VECS];
    float m = NEG_INF, l = 0.0f;
#pragma unroll
    for (int j = 0; j < VECS; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < vecs) {
            v[j] = row[i];
            const T* e = reinterpret_cast<const T*>(&v[j]);
            float vm = NEG_INF;
#pragma unroll
            for (int t = 0; t < E; ++t) vm = fmaxf(vm, to_float(e[t]));
            float vl = 0.0f;
            if (vm != NEG_INF) {
#pragma unroll
                for (int t = 0; t < E; ++t) vl += __expf(to_float(e[t]) - vm);
            }
            merge(m, l, vm, vl);
        }
    }
    for (int o = 16; o > 0; o >>= 1) merge(m, l, __shfl_xor_sync(0xffffffff, m, o), __shfl_xor_sync(0xffffffff, l, o));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) { red_m[warp] = m; red_l[warp] = l; }
    __syncthreads();
    m = lane < blockDim.x / 32 ? red_m[lane] : NEG_INF;
    l = lane < blockDim.x / 32 ? red_l[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) merge(m, l, __shfl_xor_sync(0xffffffff, m, o), __shfl_xor_sync(0xffffffff, l, o));
    const float shift = m == NEG_INF ? 0.0f : m, inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int j = 0; j < VECS; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < vecs) {
            T* e = reinterpret_cast<T*>(&v[j]);
#pragma unroll
            for (int t = 0; t < E; ++t) e[t] = from_float<T>(__expf(to_float(e[t]) - shift) * inv);
            out[i] = v[j];
        }
    }
}
// endregion

// n a multiple of 4 (float) or 8 (half), rows 16-byte aligned, n <= blockDim.x * VECS * (16 / sizeof(T))
extern "C" __global__ void softmax_online_f32(const float* x, float* y, int n) { softmax_online<float, 8>(x, y, n); }
extern "C" __global__ void softmax_online_f16(const __half* x, __half* y, int n) { softmax_online<__half, 4>(x, y, n); }

// region: softmax_slice
// What the next kernels share: a thread's part of a slice of a row, held in registers. Thread t of a group of
// `stride` threads loads the slice's 16-byte vectors t, t + stride, ... (up to VECS of them, those below `count`),
// every load issued before any arithmetic. All its elements being in registers, it takes their max m first, then
// replaces each x by e = exp(x - m) and sums them into l: one exponential an element. Once the row's (max, sum) is
// known, each output is e times one factor a thread, exp(m - max) / sum: the merge rule's rescaling, applied to the
// thread's part at once instead of a second exponential an element.
template <typename T, int VECS>
__device__ __forceinline__ void load_slice(const uint4* __restrict__ src, int t, int stride, int count,
                                           uint4 (&v)[VECS], float& m, float& l)
{
    constexpr int E = Pack<T>::E;
#pragma unroll
    for (int j = 0; j < VECS; ++j)
        if (t + j * stride < count) v[j] = src[t + j * stride];
    m = NEG_INF;
#pragma unroll
    for (int j = 0; j < VECS; ++j) {
        if (t + j * stride < count) {
            float f[E];
            Pack<T>::get(v[j], f);
#pragma unroll
            for (int e = 0; e < E; ++e) m = fmaxf(m, f[e]);
        }
    }
    const float shift = m == NEG_INF ? 0.0f : m;  // only -inf seen: every e is 0 and (m, l) = (-inf, 0)
    l = 0.0f;
#pragma unroll
    for (int j = 0; j < VECS; ++j) {
        if (t + j * stride < count) {
            float f[E];
            Pack<T>::get(v[j], f);
#pragma unroll
            for (int e = 0; e < E; ++e) {
                f[e] = __expf(f[e] - shift);
                l += f[e];
            }
            v[j] = Pack<T>::put(f);  // e, in the input's type
        }
    }
}

// The merge rule over a warp's 32 pairs at once: the warp's max first (shuffles), then each lane's sum rescaled to
// it (one exponential a lane) and the sums added (shuffles). Every lane gets the warp's pair.
__device__ __forceinline__ void warp_merge(float& m, float& l)
{
    float mw = m;
    for (int o = 16; o > 0; o >>= 1) mw = fmaxf(mw, __shfl_xor_sync(0xffffffff, mw, o));
    l = m == NEG_INF ? 0.0f : l * __expf(m - mw);
    for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffff, l, o);
    m = mw;
}

// The thread's e values times `scale` = exp(m_thread - max) / sum (0 for a thread or a row of only -inf), written.
template <typename T, int VECS>
__device__ __forceinline__ void store_slice(uint4* __restrict__ dst, int t, int stride, int count,
                                            const uint4 (&v)[VECS], float scale)
{
    constexpr int E = Pack<T>::E;
#pragma unroll
    for (int j = 0; j < VECS; ++j) {
        if (t + j * stride < count) {
            float f[E];
            Pack<T>::get(v[j], f);
#pragma unroll
            for (int e = 0; e < E; ++e) f[e] *= scale;
            dst[t + j * stride] = Pack<T>::put(f);
        }
    }
}

// exp(m_thread - m) / l: what the thread's e values are multiplied by, once the row's (m, l) is known.
__device__ __forceinline__ float slice_scale(float m_thread, float m, float l)
{
    return m_thread == NEG_INF || !(l > 0.0f) ? 0.0f : __expf(m_thread - m) / l;
}
// endregion

// region: softmax_warp_rows
// Short rows: a warp per row, blockDim.x / 32 rows a block. The warp's shuffles merge its lanes' pairs, so there
// is no shared memory and no __syncthreads: each warp goes from its loads to its stores on its own, and many
// small rows are in flight on an SM at once.
template <typename T, int VECS>
__device__ void softmax_warp_rows(const T* __restrict__ x, T* __restrict__ y, int n, int rows)
{
    const size_t r = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= (size_t)rows) return;
    const int lane = threadIdx.x % 32, vecs = n / Pack<T>::E;
    const uint4* row = reinterpret_cast<const uint4*>(x + r * n);
    uint4* out = reinterpret_cast<uint4*>(y + r * n);
    uint4 v[VECS];
    float m_t, l_t;
    load_slice<T, VECS>(row, lane, 32, vecs, v, m_t, l_t);
    float m = m_t, l = l_t;
    warp_merge(m, l);
    store_slice<T, VECS>(out, lane, 32, vecs, v, slice_scale(m_t, m, l));
}
// endregion

// n a multiple of 4 (float) or 8 (half), rows 16-byte aligned, n <= 32 * VECS * (16 / sizeof(T))
#define SOFTMAX_WARP_ROWS(V)                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) softmax_warp_rows_f32_v##V(const float* x, float* y, int n,    \
                                                                                 int rows)                           \
    {                                                                                                                \
        softmax_warp_rows<float, V>(x, y, n, rows);                                                                  \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256) softmax_warp_rows_f16_v##V(const __half* x, __half* y, int n,  \
                                                                                 int rows)                           \
    {                                                                                                                \
        softmax_warp_rows<__half, V>(x, y, n, rows);                                                                 \
    }
SOFTMAX_WARP_ROWS(4)
SOFTMAX_WARP_ROWS(8)
SOFTMAX_WARP_ROWS(16)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // thread-block clusters: Hopper and later
// region: softmax_cluster
// A long row split across a thread-block cluster (Hopper): the C blocks of a cluster (consecutive blockIdx.x) share
// one row, block `rank` holding slice `rank` of it in registers as softmax_online holds a whole row. Each warp
// merges its lanes' (max, sum) pairs and writes its pair into the shared memory of every block of the cluster
// (distributed shared memory: map_shared_rank gives the address of a variable in another block's shared memory,
// which may be written once that block has started: the cluster barrier arrived at on entry and waited for after
// the loads says so). After one more cluster barrier every block holds all C x warps pairs, merges them in the same
// order as the others (the same max and sum everywhere) and writes its slice; no block touches another's memory
// after it, so each may finish on its own. A block is a fraction of a row, so several share an SM, in different
// phases: while one waits at a barrier, the others' loads and stores keep memory busy.
template <typename T, int VECS, int C>
__device__ void softmax_cluster(const T* __restrict__ x, T* __restrict__ y, int n)
{
    __shared__ float2 pairs[C * 32];  // (max, sum) of every warp of the cluster: [block rank][warp]
    cg::cluster_group cluster = cg::this_cluster();
    cluster.barrier_arrive();  // this block has started: its shared memory exists
    const int rank = (int)cluster.block_rank();
    const size_t r = blockIdx.x / C;  // the cluster's row
    const int vecs = n / Pack<T>::E, per = (vecs + C - 1) / C, count = min(per, vecs - rank * per);
    const uint4* row = reinterpret_cast<const uint4*>(x + r * n) + rank * per;
    uint4* out = reinterpret_cast<uint4*>(y + r * n) + rank * per;
    uint4 v[VECS];
    float m_t, l_t;
    load_slice<T, VECS>(row, threadIdx.x, blockDim.x, count, v, m_t, l_t);
    float m = m_t, l = l_t;
    warp_merge(m, l);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    cluster.barrier_wait();  // every block of the cluster has started (long since: it arrived on entry)
    if (lane < C) cluster.map_shared_rank(pairs, lane)[rank * warps + warp] = make_float2(m, l);  // to block `lane`
    cluster.sync();  // every pair has landed in every block
    m = NEG_INF;
    l = 0.0f;
    for (int i = lane; i < C * warps; i += 32) merge(m, l, pairs[i].x, pairs[i].y);
    warp_merge(m, l);
    store_slice<T, VECS>(out, threadIdx.x, blockDim.x, count, v, slice_scale(m_t, m, l));
}
// endregion
#define CLUSTER_ONLY(...) __VA_ARGS__;
#else
#define CLUSTER_ONLY(...) __trap();  // built for a GPU without clusters: the launcher refuses before it gets here
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define CLUSTER_DIMS(C)
#else
#define CLUSTER_DIMS(C) __cluster_dims__(C, 1, 1)  // launched in clusters of C blocks along x: a grid of rows x C
#endif

// One kernel per cluster size C (a compile-time attribute, so an ordinary launch makes the clusters) and per VECS;
// n a multiple of 4 (float) or 8 (half), rows 16-byte aligned, n <= C * blockDim.x * VECS * (16 / sizeof(T)).
#define SOFTMAX_CLUSTER(C, V, DIMS)                                                                                  \
    extern "C" __global__ void DIMS __launch_bounds__(1024) softmax_cluster_f32_c##C##_v##V(const float* x,          \
                                                                                            float* y, int n)          \
    {                                                                                                                \
        CLUSTER_ONLY(softmax_cluster<float, V, C>(x, y, n))                                                          \
    }                                                                                                                \
    extern "C" __global__ void DIMS __launch_bounds__(1024) softmax_cluster_f16_c##C##_v##V(const __half* x,         \
                                                                                            __half* y, int n)         \
    {                                                                                                                \
        CLUSTER_ONLY(softmax_cluster<__half, V, C>(x, y, n))                                                         \
    }
SOFTMAX_CLUSTER(1, 2, )  // a cluster of one block: no attribute (every block on Hopper is a cluster of one)
SOFTMAX_CLUSTER(1, 4, )
SOFTMAX_CLUSTER(1, 8, )
SOFTMAX_CLUSTER(2, 2, CLUSTER_DIMS(2))
SOFTMAX_CLUSTER(2, 4, CLUSTER_DIMS(2))
SOFTMAX_CLUSTER(2, 8, CLUSTER_DIMS(2))
SOFTMAX_CLUSTER(4, 2, CLUSTER_DIMS(4))
SOFTMAX_CLUSTER(4, 4, CLUSTER_DIMS(4))
SOFTMAX_CLUSTER(4, 8, CLUSTER_DIMS(4))
SOFTMAX_CLUSTER(8, 2, CLUSTER_DIMS(8))
SOFTMAX_CLUSTER(8, 4, CLUSTER_DIMS(8))
SOFTMAX_CLUSTER(8, 8, CLUSTER_DIMS(8))

// ----------------------------------------------------------------------------- FlashAttention, WMMA

// One block: BLOCK_M = 16 x WARPS query rows of one (batch, head), WARPS warps, each owning 16 rows. Keys and values
// come in tiles of BLOCK_N = 64 through shared memory, two tiles in flight (cp.async). Each warp keeps its rows of Q
// in registers (WMMA fragments) and, per tile:
//   S = Q K^T (16 x 64: four 16 x 16 accumulators, on the tensor cores) -> shared memory;
//   the online softmax of its 16 rows (two lanes a row): the tile's max, the new running max, P = exp(S - max) as
//   half over S's own bytes, the running sum, and alpha = exp(old max - new max) for each row;
//   O = alpha O + P V (the accumulators rescaled row by row in registers, then P V on the tensor cores).
// The accumulators' layout is not documented by the WMMA API, so the kernel learns it: it loads a matrix whose
// entry (r, c) is r into an accumulator fragment, and then knows the row of each of a lane's elements.
template <int D, int WARPS>
struct FlashSmem {
    static constexpr int BM = 16 * WARPS, BN = 64, LD = D + 8;  // +8 halves: rows not 128 bytes apart (bank conflicts)
    static constexpr int LDS = BN + 4;                          // a row of S: 64 floats and 4 of padding
    static constexpr size_t kv = (size_t)2 * 2 * BN * LD * 2;   // K and V, two stages
    static constexpr size_t q = (size_t)BM * LD * 2, s = (size_t)WARPS * 16 * LDS * 4;
    static constexpr size_t qs = q > s ? q : s;                 // Q's tile, then (once in registers) the warps' S and P
    static constexpr size_t row = (size_t)3 * BM * 4;           // m, l, alpha per row
    static constexpr size_t bytes = kv + qs + row + 16 * 16 * 4;
};

template <int D, int WARPS>
__device__ __forceinline__ void load_tile(half* dst, const half* src, int rows_total, int row0, int nrows)
{
    constexpr int LD = FlashSmem<D, WARPS>::LD, CHUNKS = D / 8;  // 16-byte chunks a row
    for (int c = threadIdx.x; c < nrows * CHUNKS; c += WARPS * 32) {
        const int r = c / CHUNKS, k = (c % CHUNKS) * 8;
        const bool valid = row0 + r < rows_total;
        cp_async16_zfill(dst + r * LD + k, src + (size_t)(valid ? row0 + r : 0) * D + k, valid);
    }
}

// region: flash_forward
template <int D, int WARPS, bool CAUSAL>
__device__ void flash_forward(const half* __restrict__ Q, const half* __restrict__ K, const half* __restrict__ V,
                              half* __restrict__ O, float* __restrict__ LSE, int N, float scale_log2)
{
    using S_ = FlashSmem<D, WARPS>;
    constexpr int BM = S_::BM, BN = S_::BN, LD = S_::LD, LDS = S_::LDS, DF = D / 16;
    extern __shared__ __align__(128) unsigned char smem[];
    half* kv_s = reinterpret_cast<half*>(smem);                          // [stage][K or V][BN][LD]
    half* q_s = reinterpret_cast<half*>(smem + S_::kv);                  // Q's tile; later S and P
    float* row_s = reinterpret_cast<float*>(smem + S_::kv + S_::qs);     // m, l, alpha: [3][BM]
    float* map_s = row_s + 3 * BM;                                       // 16 x 16: entry (r, c) = r

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const size_t base = (size_t)blockIdx.y * N * D;
    const int m0 = blockIdx.x * BM;
    const half *q = Q + base, *k = K + base, *v = V + base;

    load_tile<D, WARPS>(q_s, q, N, m0, BM);
    const int last = CAUSAL ? min(N, m0 + BM) : N;  // causal: tiles wholly above the diagonal are never loaded
    const int tiles = (last + BN - 1) / BN;
    load_tile<D, WARPS>(kv_s, k, N, 0, BN);
    load_tile<D, WARPS>(kv_s + BN * LD, v, N, 0, BN);
    cp_async_commit();
    for (int i = threadIdx.x; i < 256; i += WARPS * 32) map_s[i] = (float)(i / 16);
    for (int i = threadIdx.x; i < BM; i += WARPS * 32) { row_s[i] = NEG_INF; row_s[BM + i] = 0.0f; }
    cp_async_wait<0>();
    __syncthreads();
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> rowmap;  // the row of each of this lane's elements
    wmma::load_matrix_sync(rowmap, map_s, 16, wmma::mem_row_major);
    wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> qf[DF];  // this warp's 16 rows of Q
#pragma unroll
    for (int kk = 0; kk < DF; ++kk) wmma::load_matrix_sync(qf[kk], q_s + warp * 16 * LD + kk * 16, LD);
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> o[DF];
#pragma unroll
    for (int j = 0; j < DF; ++j) wmma::fill_fragment(o[j], 0.0f);
    __syncthreads();  // every warp holds its Q: the tile's bytes become the warps' S and P
    float* s_w = reinterpret_cast<float*>(q_s) + warp * 16 * LDS;
    half* p_w = reinterpret_cast<half*>(s_w);  // P over S's bytes: row r of P starts where row r of S does
    float *m_w = row_s + warp * 16, *l_w = row_s + BM + warp * 16, *a_w = row_s + 2 * BM + warp * 16;

    for (int t = 0; t < tiles; ++t) {
        if (t + 1 < tiles) {  // the next tile's copies start now and land while this one is computed
            half* nxt = kv_s + ((t + 1) % 2) * 2 * BN * LD;
            load_tile<D, WARPS>(nxt, k, N, (t + 1) * BN, BN);
            load_tile<D, WARPS>(nxt + BN * LD, v, N, (t + 1) * BN, BN);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const half* k_t = kv_s + (t % 2) * 2 * BN * LD;
        const half* v_t = k_t + BN * LD;
        // S = Q K^T for this warp's 16 rows
#pragma unroll
        for (int c = 0; c < BN / 16; ++c) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> s;
            wmma::fill_fragment(s, 0.0f);
#pragma unroll
            for (int kk = 0; kk < DF; ++kk) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> b;  // K^T: K's rows are its columns
                wmma::load_matrix_sync(b, k_t + c * 16 * LD + kk * 16, LD);
                wmma::mma_sync(s, qf[kk], b, s);
            }
            wmma::store_matrix_sync(s_w + c * 16, s, LDS, wmma::mem_row_major);
        }
        __syncwarp();
        // the online softmax of the warp's 16 rows: lanes 2r and 2r + 1 take row r, 32 columns each
        {
            const int r = lane / 2, c0 = (lane % 2) * 32, grow = m0 + warp * 16 + r, key0 = t * BN + c0;
            float sv[32], tmax = NEG_INF;
#pragma unroll
            for (int c = 0; c < 32; ++c) {
                const int key = key0 + c;
                const bool keep = key < N && (!CAUSAL || key <= grow);
                sv[c] = keep ? s_w[r * LDS + c0 + c] * scale_log2 : NEG_INF;
                tmax = fmaxf(tmax, sv[c]);
            }
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffff, tmax, 1));
            const float m_old = m_w[r], m_new = fmaxf(m_old, tmax);
            const float shift = m_new == NEG_INF ? 0.0f : m_new;
            __syncwarp();  // every lane has read its S before P overwrites those bytes
            float sum = 0.0f;
#pragma unroll
            for (int c = 0; c < 32; ++c) {
                const float p = ex2(sv[c] - shift);
                sum += p;
                p_w[r * 2 * LDS + c0 + c] = __float2half(p);
            }
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            const float alpha = ex2(m_old - shift);  // 0 on the first tile a row sees (m_old = -inf)
            if (lane % 2 == 0) { a_w[r] = alpha; l_w[r] = l_w[r] * alpha + sum; m_w[r] = m_new; }
        }
        __syncwarp();
        // O = alpha O + P V
#pragma unroll
        for (int j = 0; j < DF; ++j) {
#pragma unroll
            for (int e = 0; e < o[j].num_elements; ++e) o[j].x[e] *= a_w[(int)rowmap.x[e]];
        }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> a;
            wmma::load_matrix_sync(a, p_w + kk * 16, 2 * LDS);
#pragma unroll
            for (int j = 0; j < DF; ++j) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::row_major> b;
                wmma::load_matrix_sync(b, v_t + kk * 16 * LD + j * 16, LD);
                wmma::mma_sync(o[j], a, b, o[j]);
            }
        }
        __syncthreads();  // every warp is done with this stage before it is overwritten
    }
    // the output, normalised once, through the warp's S area 64 columns at a time; the log-sum-exp (natural log)
#pragma unroll
    for (int j = 0; j < DF; ++j) {
#pragma unroll
        for (int e = 0; e < o[j].num_elements; ++e) {
            const float l = l_w[(int)rowmap.x[e]];
            o[j].x[e] = l > 0.0f ? o[j].x[e] / l : 0.0f;
        }
        wmma::store_matrix_sync(s_w + (j * 16) % BN, o[j], LDS, wmma::mem_row_major);
        if ((j * 16 + 16) % BN == 0 || j == DF - 1) {
            __syncwarp();
            const int c_first = (j * 16 / BN) * BN, width = min(BN, D - c_first);
            for (int i = lane; i < 16 * width; i += 32) {
                const int r = i / width, c = i % width, grow = m0 + warp * 16 + r;
                if (grow < N) O[base + (size_t)grow * D + c_first + c] = __float2half(s_w[r * LDS + c]);
            }
            __syncwarp();
        }
    }
    if (lane < 16) {
        const int grow = m0 + warp * 16 + lane;
        const float l = l_w[lane], m = m_w[lane];
        if (grow < N) LSE[(size_t)blockIdx.y * N + grow] = l > 0.0f ? (m + __log2f(l)) * 0.6931471805599453f : NEG_INF;
    }
}
// endregion

#define FLASH(D, W, C, NAME)                                                                                          \
    extern "C" __global__ void __launch_bounds__(W * 32) NAME(const half* q, const half* k, const half* v, half* o,   \
                                                              float* lse, int n, float scale_log2)                  \
    {                                                                                                                \
        flash_forward<D, W, C>(q, k, v, o, lse, n, scale_log2);                                                      \
    }
FLASH(64, 8, false, flash_wmma_d64)
FLASH(64, 8, true, flash_wmma_d64_causal)
FLASH(128, 8, false, flash_wmma_d128)
FLASH(128, 8, true, flash_wmma_d128_causal)

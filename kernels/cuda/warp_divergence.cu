// Lesson 2: warp divergence and the SIMT model, in CUDA C.
// Loaded from Python by gpucourse/cuda_c.py (CuPy compiles it with NVRTC on first use); the launchers with
// their input checks are in kernels/warp_divergence.py, and so is a NumPy model of every kernel here.
//
// 1. The order of events in a diverged warp, with and without __syncwarp (the lecture's A/B vs X/Y).
// 2. A compute-bound body run on 1..32 paths, chosen by lane id, by warp id, or by the data.
// 3. A sum three ways: shared-memory tree, warp shuffles, atomics; and a read-only probe for the ceiling.

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }

// ------------------------------------------------------------------------ 1. order of events in a warp

// Appends (event, lane, active mask) to a log. The ticket is one atomic counter, so tickets give the order
// in which the events happened; lanes that run an event together take consecutive tickets.
__device__ void record(int event, int* ticket, int* events, int* lanes, unsigned* masks)
{
    unsigned active = __activemask();
    int t = atomicAdd(ticket, 1);
    events[t] = event;
    lanes[t] = lane_id();
    masks[t] = active;
}

// region: order_model
// Lanes 0-3 run A then B, the other lanes X then Y. A writes 100 + lane into shared memory, X 200 + lane;
// B reads the value X wrote for lane + 4 (B needs X's result, as in the lecture), and lanes 4-7 read in Y
// what A wrote for lanes 0-3. (A and X must write different values: identical stores on both sides of a
// branch would be hoisted above it by the compiler, and the example would prove nothing.) Without
// __syncwarp nothing orders B after X. With it, every lane waits at the barrier until all 32 lanes reach
// one: A and X both finish before B or Y starts. (Two different __syncwarp calls in the two branches may
// meet: since Volta each lane has its own program counter, and the barrier counts lanes, not call sites.)
// Events: 0 = A, 1 = B, 2 = X, 3 = Y, 4 = Z (after the branch, all lanes). Launch with one warp.
template <bool SYNC>
__device__ void order_of_events(int* ticket, int* events, int* lanes, unsigned* masks, float* seen)
{
    __shared__ float box[32];
    int lane = lane_id();
    box[lane] = -1.0f;
    __syncwarp();
    if (lane < 4) {
        box[lane] = 100.0f + lane;                        // A
        record(0, ticket, events, lanes, masks);
        if (SYNC) __syncwarp();
        seen[lane] = box[lane + 4];                       // B: reads what X wrote for lane + 4
        record(1, ticket, events, lanes, masks);
    } else {
        box[lane] = 200.0f + lane;                        // X
        record(2, ticket, events, lanes, masks);
        if (SYNC) __syncwarp();
        seen[lane] = box[lane < 8 ? lane - 4 : lane];     // Y: lanes 4-7 read what A wrote for lanes 0-3
        record(3, ticket, events, lanes, masks);
    }
    __syncwarp();                                         // reconverge explicitly after the branch
    record(4, ticket, events, lanes, masks);              // Z
}
// endregion

extern "C" __global__ void order_no_sync(int* ticket, int* events, int* lanes, unsigned* masks, float* seen)
{
    order_of_events<false>(ticket, events, lanes, masks, seen);
}

extern "C" __global__ void order_syncwarp(int* ticket, int* events, int* lanes, unsigned* masks, float* seen)
{
    order_of_events<true>(ticket, events, lanes, masks, seen);
}

// ------------------------------------------------------------------- 2. 1..32 paths of compute-bound work

// The body: `iters` rounds of a multiply-add on four independent chains (enough independent work to keep
// the FP32 pipes busy). Path p converges towards p + 1, so the output says which path a thread took.
__device__ __forceinline__ float4 path_body(float4 v, int p, int iters)
{
    const float a = 0.999f;
    const float b = 0.001f * (float)(p + 1);
#pragma unroll 16
    for (int k = 0; k < iters; ++k) {
        v.x = fmaf(v.x, a, b);
        v.y = fmaf(v.y, a, b);
        v.z = fmaf(v.z, a, b);
        v.w = fmaf(v.w, a, b);
    }
    return v;
}

// Every thread runs the body once, on its own path. The loop over p is uniform (all lanes run it); the body
// inside runs whenever at least one lane of the warp has path == p, with the other lanes masked off. A warp
// whose lanes hold k different paths therefore runs the body k times: the serialisation model.
__device__ __forceinline__ float run_paths(float x, int path, int paths, int iters)
{
    float4 v = make_float4(x, x + 0.25f, x + 0.5f, x + 0.75f);
    for (int p = 0; p < paths; ++p)
        if (path == p)
            v = path_body(v, p, iters);
    return v.x + v.y + v.z + v.w;
}

// The path is the lane id modulo `paths`: every warp holds min(paths, 32) different paths.
extern "C" __global__ void branch_on_lane(const float* __restrict__ x, float* __restrict__ out, int paths,
                                          int iters, long long n)
{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        out[i] = run_paths(x[i], lane_id() % paths, paths, iters);
}

// The same branch on the warp id: all 32 lanes of a warp agree, so no warp diverges.
extern "C" __global__ void branch_on_warp(const float* __restrict__ x, float* __restrict__ out, int paths,
                                          int iters, long long n)
{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        out[i] = run_paths(x[i], (int)((i >> 5) % paths), paths, iters);
}

// Data-dependent: element j takes path 1 when x[j] < threshold, else path 0. Thread i handles element
// order[i] (order == NULL: element i), so regrouping the elements by path is a permutation away.
extern "C" __global__ void branch_on_value(const float* __restrict__ x, const long long* __restrict__ order,
                                           float threshold, float* __restrict__ out, int iters, long long n)
{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        long long j = order ? order[i] : i;
        float v = x[j];
        out[j] = run_paths(v, v < threshold ? 1 : 0, 2, iters);
    }
}

// Which lanes take the rare path (x < threshold), seen two ways for every warp: __ballot_sync asks all 32
// lanes for the predicate; __activemask inside each branch reports the lanes executing it together.
extern "C" __global__ void value_branch_masks(const float* __restrict__ x, float threshold, long long n,
                                              unsigned* taken, unsigned* active_rare, unsigned* active_common)
{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    bool in = i < n;
    bool rare = in && x[i] < threshold;
    unsigned ballot = __ballot_sync(FULL_MASK, rare);
    long long warp = i >> 5;
    if (in) {
        if (rare) {
            unsigned m = __activemask();
            if (lane_id() == __ffs(m) - 1) active_rare[warp] = m;
        } else {
            unsigned m = __activemask();
            if (lane_id() == __ffs(m) - 1) active_common[warp] = m;
        }
    }
    if (lane_id() == 0 && in)
        taken[warp] = ballot;
}

// ------------------------------------------------------------------------------------- 3. reductions

// One thread's share of a sum: float4 loads striding over the whole grid, UNROLL of them in flight before
// the first add, added in index order (the NumPy model in kernels/warp_divergence.py repeats this order and
// gets the same float32 result bit for bit). The last n % 4 elements go to the first threads one each.
// __ldcs ("cache streaming") tells the caches that these lines will not be read again.
template <int UNROLL>
__device__ __forceinline__ float thread_sum(const float* __restrict__ x, long long n)
{
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const long long n4 = n >> 2;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long i = first;
    float acc = 0.0f;
    for (; i + (UNROLL - 1) * stride < n4; i += UNROLL * stride) {
        float4 v[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) v[k] = __ldcs(x4 + i + k * stride);
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) { acc += v[k].x; acc += v[k].y; acc += v[k].z; acc += v[k].w; }
    }
    for (; i < n4; i += stride) {
        float4 v = x4[i];
        acc += v.x; acc += v.y; acc += v.z; acc += v.w;
    }
    if (4 * n4 + first < n)
        acc += x[4 * n4 + first];
    return acc;
}

// Five shuffles sum 32 lanes: lane l adds the value of lane l + 16, then l + 8, ... Lane 0 ends with the sum
// (lanes whose partner would be past lane 31 get their own value back; their results are not used).
__device__ __forceinline__ float warp_sum(float v)
{
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        v += __shfl_down_sync(FULL_MASK, v, offset);
    return v;
}

// Warp shuffles: each warp sums in registers, lane 0 of each warp puts its sum in shared memory, and the
// first warp sums those. One __syncthreads in all. partials[blockIdx.x] = the block's sum; launch the same
// kernel again with one block over the partials for the total. blockDim.x: a multiple of 32, at most 1024.
extern "C" __global__ void reduce_shuffle(const float* __restrict__ x, long long n, float* __restrict__ partials)
{
    __shared__ float warp_sums[32];
    float v = warp_sum(thread_sum<8>(x, n));
    const int lane = lane_id(), warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (blockDim.x >> 5) ? warp_sums[lane] : 0.0f;
        v = warp_sum(v);
        if (lane == 0) partials[blockIdx.x] = v;
    }
}

// Shared-memory tree: halve the active threads each step, __syncthreads between steps. In the last five
// steps fewer than 32 threads work, so one warp runs with most lanes masked off.
// blockDim.x: a power of two, at most 1024.
extern "C" __global__ void reduce_tree(const float* __restrict__ x, long long n, float* __restrict__ partials)
{
    __shared__ float s[1024];
    const int t = threadIdx.x;
    s[t] = thread_sum<8>(x, n);
    __syncthreads();
    for (int stride = blockDim.x >> 1; stride > 0; stride >>= 1) {
        if (t < stride) s[t] += s[t + stride];
        __syncthreads();
    }
    if (t == 0) partials[blockIdx.x] = s[0];
}

// Atomics: every thread adds its share to one total. *total must be zero before the launch. The order of
// the additions changes from run to run, and so can the last bits of the result.
extern "C" __global__ void reduce_atomic(const float* __restrict__ x, long long n, float* total)
{
    atomicAdd(total, thread_sum<8>(x, n));
}

// The first reduction most people write: one atomic add per element, all to the same address.
extern "C" __global__ void reduce_atomic_each(const float* __restrict__ x, long long n, float* total)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        atomicAdd(total, x[i]);
}

// The read ceiling: stream x once with the same loads as thread_sum (float4, UNROLL in flight, __ldcs) and
// do next to nothing with the data (an xor of the bits), writing only if an impossible value comes out, so
// the loads cannot be dropped.
template <int UNROLL>
__device__ __forceinline__ void read_probe(const float* __restrict__ x, long long n, unsigned* sink)
{
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    const long long n4 = n >> 2;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned acc = 0;
    for (; i + (UNROLL - 1) * stride < n4; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) v[k] = __ldcs(x4 + i + k * stride);
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    for (; i < n4; i += stride) {
        uint4 v = x4[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x7fbadbadu) *sink = acc;
}

extern "C" __global__ void read_probe_1(const float* __restrict__ x, long long n, unsigned* sink) { read_probe<1>(x, n, sink); }
extern "C" __global__ void read_probe_2(const float* __restrict__ x, long long n, unsigned* sink) { read_probe<2>(x, n, sink); }
extern "C" __global__ void read_probe_4(const float* __restrict__ x, long long n, unsigned* sink) { read_probe<4>(x, n, sink); }
extern "C" __global__ void read_probe_8(const float* __restrict__ x, long long n, unsigned* sink) { read_probe<8>(x, n, sink); }

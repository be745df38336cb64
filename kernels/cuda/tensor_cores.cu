// Lesson 4: tensor cores, in CUDA C. C = A B with A (M x K) and B (K x N) row-major.
// Loaded from Python by gpucourse/cuda_c.py (CuPy compiles it with NVRTC on first use; <mma.h> needs the CUDA
// include path, which cuda_c.include_dirs() finds). The launchers with their input checks, and a NumPy
// model of what a tensor core computes, are in kernels/tensor_cores.py.
//
// 1. WMMA, one warp per 16x16 tile of C, operands straight from global memory (the first step).
// 2. WMMA tiled through shared memory: a block computes a BM x BN tile of C with several warps, each warp a
//    WM x WN piece of it (a grid of 16x16 fragments held in registers); the block copies the next BK-wide
//    slices of A and B into shared memory with cp.async while the tensor cores work on the current ones
//    (STAGES buffers: 1 = no overlap, 2 = double buffering, 3-4 = deeper pipelines).
// 3. FP32 on the ordinary cores (SIMT): a register-tiled SGEMM, 128 x 128 per block, 8 x 8 per thread, to
//    set the tensor cores beside the best the FP32 units can do.
//
// Accumulation: FP32 ("f32": C is float) or FP16 ("f16": C is half). The inputs are always FP16.
// GPUs: WMMA needs sm_70+; cp.async sm_80+, with a synchronous fallback below (all of it: gpucourse/gpus.py).

#include <mma.h>
#include <cuda_fp16.h>

using namespace nvcuda;

// ------------------------------------------------------------------------------- 1. one warp per tile

// region: wmma_naive
// Warp w computes tile (w / (N/16), w % (N/16)) of C: K/16 multiply-accumulates of 16x16x16, each reading its
// 16x16 slices of A and B from global memory. Nothing is shared between warps except through the caches,
// so every element of A is read N/16 times and every element of B M/16 times. M, N, K: multiples of 16.
template <typename Acc>
__device__ void wmma_naive(const half* A, const half* B, Acc* C, int M, int N, int K)
{
    long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int tiles_n = N / 16;
    if (warp >= (long long)(M / 16) * tiles_n) return;  // a whole warp leaves together
    int tm = (int)(warp / tiles_n), tn = (int)(warp % tiles_n);

    wmma::fragment<wmma::accumulator, 16, 16, 16, Acc> acc;
    wmma::fill_fragment(acc, (Acc)0.0f);
    wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::row_major> b;
    for (int k = 0; k < K; k += 16) {
        wmma::load_matrix_sync(a, A + (size_t)tm * 16 * K + k, K);
        wmma::load_matrix_sync(b, B + (size_t)k * N + tn * 16, N);
        wmma::mma_sync(acc, a, b, acc);  // acc = a b + acc, on the tensor cores
    }
    wmma::store_matrix_sync(C + (size_t)tm * 16 * N + tn * 16, acc, N, wmma::mem_row_major);
}
// endregion

extern "C" __global__ void wmma_naive_f32(const half* A, const half* B, float* C, int M, int N, int K)
{
    wmma_naive<float>(A, B, C, M, N, K);
}

extern "C" __global__ void wmma_naive_f16(const half* A, const half* B, half* C, int M, int N, int K)
{
    wmma_naive<half>(A, B, C, M, N, K);
}

// ------------------------------------------------------------------- 2. tiled through shared memory

// The next tiles are copied with cp.async while the tensor cores work (async_copy.cuh, which also says what a
// GPU without it, a T4, does instead: gpucourse/gpus.py step "04.wmma_tiled").
#include "async_copy.cuh"

// Shared memory rows are padded by 8 halves (16 bytes): row r of a slice starts 16 bytes further round the
// 32 banks than row r - 1, so the 8 rows a fragment load reads at once fall in different banks.
constexpr int PAD = 8;

template <int BM, int BN, int BK, int STAGES>
struct TileShape {
    static constexpr int LDA = BK + PAD;  // a stage of A: BM rows of BK halves
    static constexpr int LDB = BN + PAD;  // a stage of B: BK rows of BN halves
    static constexpr int A_STAGE = BM * LDA;
    static constexpr int B_STAGE = BK * LDB;
    static constexpr int SMEM_BYTES = STAGES * (A_STAGE + B_STAGE) * 2;
};

// Copy the BK-wide slice of A (BM x BK) and the BK-high slice of B (BK x BN) that start at k0 into one
// stage of shared memory, 16 bytes (8 halves) per cp.async, spread over all the threads of the block.
template <int BM, int BN, int BK, int THREADS, int STAGES>
__device__ __forceinline__ void load_stage(half* As, half* Bs, const half* A, const half* B, int N, int K,
                                           int bm, int bn, int k0, int tid)
{
    using S = TileShape<BM, BN, BK, STAGES>;
#pragma unroll
    for (int c = tid; c < BM * BK / 8; c += THREADS) {
        int r = c / (BK / 8), col = (c % (BK / 8)) * 8;
        cp_async16(As + r * S::LDA + col, A + (size_t)(bm + r) * K + k0 + col);
    }
#pragma unroll
    for (int c = tid; c < BK * BN / 8; c += THREADS) {
        int r = c / (BN / 8), col = (c % (BN / 8)) * 8;
        cp_async16(Bs + r * S::LDB + col, B + (size_t)(k0 + r) * N + bn + col);
    }
}

// Block (blockIdx.y, blockIdx.x) computes the BM x BN tile of C at (blockIdx.y BM, blockIdx.x BN) with
// (BM/WM) x (BN/WN) warps; each warp holds (WM/16) x (WN/16) accumulator fragments. Every element of A is
// read from global memory N/BN times (not N/16), every element of B M/BM times.
// M, N, K: multiples of BM, BN, BK. Dynamic shared memory: TileShape<...>::SMEM_BYTES.
// region: wmma_tiled
template <int BM, int BN, int BK, int WM, int WN, int STAGES, typename Acc>
__device__ __forceinline__ void wmma_tiled(const half* A, const half* B, Acc* C, int M, int N, int K)
{
    using S = TileShape<BM, BN, BK, STAGES>;
    constexpr int WARPS_N = BN / WN;
    constexpr int THREADS = (BM / WM) * WARPS_N * 32;
    constexpr int FM = WM / 16, FN = WN / 16;
    extern __shared__ __align__(128) unsigned char smem[];
    half* As = reinterpret_cast<half*>(smem);
    half* Bs = As + STAGES * S::A_STAGE;

    const int tid = threadIdx.x, warp = tid / 32;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int bm = blockIdx.y * BM, bn = blockIdx.x * BN;

    wmma::fragment<wmma::accumulator, 16, 16, 16, Acc> acc[FM][FN];
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[i][j], (Acc)0.0f);

    const int steps = K / BK;
    // The prologue fills STAGES - 1 buffers; one copy group per buffer, empty groups past the end of K keep
    // the count of groups in flight the same on every step.
    if (STAGES > 1) {
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < steps)
                load_stage<BM, BN, BK, THREADS, STAGES>(As + s * S::A_STAGE, Bs + s * S::B_STAGE, A, B, N, K,
                                                       bm, bn, s * BK, tid);
            cp_async_commit();
        }
    }

    for (int step = 0; step < steps; ++step) {
        const int cur = step % STAGES;
        if (STAGES == 1) {  // no overlap: copy, wait, compute
            load_stage<BM, BN, BK, THREADS, STAGES>(As, Bs, A, B, N, K, bm, bn, step * BK, tid);
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();
        } else {
            cp_async_wait<(STAGES > 1 ? STAGES - 2 : 0)>();  // this step's slice has landed ...
            __syncthreads();  // ... for every thread, and everyone is done with the buffer refilled next
            const int next = step + STAGES - 1;
            if (next < steps)
                load_stage<BM, BN, BK, THREADS, STAGES>(As + (next % STAGES) * S::A_STAGE,
                                                       Bs + (next % STAGES) * S::B_STAGE, A, B, N, K, bm, bn,
                                                       next * BK, tid);
            cp_async_commit();
        }
        const half* a_s = As + cur * S::A_STAGE;
        const half* b_s = Bs + cur * S::B_STAGE;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> a[FM];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::row_major> b[FN];
#pragma unroll
            for (int i = 0; i < FM; ++i)
                wmma::load_matrix_sync(a[i], a_s + (wm * WM + i * 16) * S::LDA + kk, S::LDA);
#pragma unroll
            for (int j = 0; j < FN; ++j)
                wmma::load_matrix_sync(b[j], b_s + kk * S::LDB + wn * WN + j * 16, S::LDB);
#pragma unroll
            for (int i = 0; i < FM; ++i)
#pragma unroll
                for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
        if (STAGES == 1) __syncthreads();  // the single buffer is refilled next step
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j)
            wmma::store_matrix_sync(C + (size_t)(bm + wm * WM + i * 16) * N + bn + wn * WN + j * 16, acc[i][j],
                                    N, wmma::mem_row_major);
}
// endregion

// The configurations the course measures, named wmma_tiled_<BM>x<BN>x<BK>_w<WM>x<WN>_s<STAGES>_<acc>.
// kernels/tensor_cores.py parses the name for the launch shape and shared-memory size.
#define WMMA_TILED(BM, BN, BK, WM, WN, ST, ACC, TAG)                                                           \
    extern "C" __global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32)                                  \
        wmma_tiled_##BM##x##BN##x##BK##_w##WM##x##WN##_s##ST##_##TAG(const half* A, const half* B, ACC* C,    \
                                                                     int M, int N, int K)                     \
    {                                                                                                         \
        wmma_tiled<BM, BN, BK, WM, WN, ST, ACC>(A, B, C, M, N, K);                                            \
    }

WMMA_TILED(64, 64, 32, 32, 32, 1, float, f32)     // 4 warps, single buffer
WMMA_TILED(64, 64, 32, 32, 32, 2, float, f32)     // 4 warps, double buffered
WMMA_TILED(128, 128, 32, 64, 64, 1, float, f32)   // 4 warps of 64 x 64, single buffer
WMMA_TILED(128, 128, 32, 64, 64, 2, float, f32)   // ... double buffered
WMMA_TILED(128, 128, 32, 64, 64, 3, float, f32)   // ... three stages
WMMA_TILED(128, 128, 32, 64, 64, 4, float, f32)   // ... four stages
WMMA_TILED(128, 128, 32, 64, 32, 3, float, f32)   // 8 warps of 64 x 32
WMMA_TILED(128, 128, 64, 64, 64, 2, float, f32)   // 4 warps of 64 x 64, 64-wide slices of K
WMMA_TILED(128, 128, 64, 64, 64, 3, float, f32)
WMMA_TILED(128, 128, 64, 64, 64, 4, float, f32)
WMMA_TILED(128, 256, 32, 64, 64, 3, float, f32)   // 8 warps of 64 x 64
WMMA_TILED(128, 256, 32, 64, 64, 4, float, f32)
WMMA_TILED(256, 128, 32, 64, 64, 3, float, f32)
WMMA_TILED(128, 128, 32, 64, 64, 3, half, f16)    // FP16 accumulation
WMMA_TILED(128, 256, 32, 64, 64, 3, half, f16)

// ------------------------------------------------------------------------- 3. FP32 SIMT, register-tiled

// region: sgemm_register_tiled
// 256 threads compute a 128 x 128 tile of C, each an 8 x 8 block of it held in 64 registers: per step of
// k, a thread reads 8 values of A and 8 of B from shared memory and does 64 FMAs with them. Two buffers of
// BK = 8 slices, one barrier per step, and four details that count at this level:
//  - B's next slice goes straight to shared memory with cp.async (no registers, no store instructions); A's
//    comes through registers (float4) because it is stored transposed (k-major), so a thread's 8 values of A
//    at one k are two float4 reads. Both arrive while this step is computed.
//  - Warp tiles: a warp's 32 threads own a 32 x 64 piece of the tile (4 x 8 threads, each two groups of 4
//    rows 16 apart and two groups of 4 columns 32 apart), so at each k a warp reads 4 distinct float4 of A
//    and 8 of B: one shared-memory wavefront each.
//  - A's rows are padded by 4 floats, so the transposed stores of two k's do not fall on the same banks.
//  - __launch_bounds__(256, 2): at most 128 registers, two blocks (16 warps) per SM to hide latency.
// At this level the compiler's register allocation counts too: the same statements written in a slightly
// different order (the prologue's copies, the address arithmetic) compiled to a measurably slower kernel.
// M, N: multiples of 128; K: a multiple of 8.
// The kernel, with the details as switches (the course's kernel sets them all): BK, warp tiles, A's padding,
// B by cp.async.
template <int BK, bool WARPTILE, int PAD, bool ASYNC_B>
__device__ __forceinline__ void sgemm_regs(const float* A, const float* B, float* C, int M, int N, int K)
{
    constexpr int BM = 128, BN = 128;
    __shared__ __align__(16) float As[2][BK][BM + PAD];
    __shared__ __align__(16) float Bs[2][BK][BN];
    const int tid = threadIdx.x;
    int r0, r1, c0, c1;  // this thread's two groups of 4 rows and of 4 columns in the tile
    if (WARPTILE) {
        int warp = tid / 32, lane = tid % 32, wm = warp / 2, wn = warp % 2, ly = lane / 8, lx = lane % 8;
        r0 = wm * 32 + ly * 4; r1 = r0 + 16; c0 = wn * 64 + lx * 4; c1 = c0 + 32;
    } else {
        int tx = tid % 16, ty = tid / 16;
        r0 = ty * 4; r1 = 64 + ty * 4; c0 = tx * 4; c1 = 64 + tx * 4;
    }
    const int bm = blockIdx.y * BM, bn = blockIdx.x * BN;
    constexpr int AL = BM * BK / 4 / 256, BL = BK * BN / 4 / 256;  // float4 loads per thread
    float4 ra[AL], rb[BL];
    auto fetch = [&](int k0) {
#pragma unroll
        for (int i = 0; i < AL; ++i) {
            int e = tid + i * 256, row = e / (BK / 4), col = (e % (BK / 4)) * 4;
            ra[i] = *reinterpret_cast<const float4*>(A + (size_t)(bm + row) * K + k0 + col);
        }
#pragma unroll
        for (int i = 0; i < BL; ++i) {
            int e = tid + i * 256, row = e / (BN / 4), col = (e % (BN / 4)) * 4;
            rb[i] = *reinterpret_cast<const float4*>(B + (size_t)(k0 + row) * N + bn + col);
        }
    };
    auto stash = [&](int buf) {
#pragma unroll
        for (int i = 0; i < AL; ++i) {
            int e = tid + i * 256, row = e / (BK / 4), col = (e % (BK / 4)) * 4;
            As[buf][col + 0][row] = ra[i].x; As[buf][col + 1][row] = ra[i].y;
            As[buf][col + 2][row] = ra[i].z; As[buf][col + 3][row] = ra[i].w;
        }
#pragma unroll
        for (int i = 0; i < BL; ++i) {
            int e = tid + i * 256, row = e / (BN / 4), col = (e % (BN / 4)) * 4;
            *reinterpret_cast<float4*>(&Bs[buf][row][col]) = rb[i];
        }
    };
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
    fetch(0);
    stash(0);
    __syncthreads();
    const int steps = K / BK;
    for (int step = 0; step < steps; ++step) {
        const int cur = step & 1;
        if (step + 1 < steps) {
            if (ASYNC_B) {
#pragma unroll
                for (int i = 0; i < AL; ++i) {
                    int e = tid + i * 256, row = e / (BK / 4), col = (e % (BK / 4)) * 4;
                    ra[i] = *reinterpret_cast<const float4*>(A + (size_t)(bm + row) * K + (step + 1) * BK + col);
                }
#pragma unroll
                for (int i = 0; i < BL; ++i) {
                    int e = tid + i * 256, row = e / (BN / 4), col = (e % (BN / 4)) * 4;
                    cp_async16(&Bs[cur ^ 1][row][col], B + (size_t)((step + 1) * BK + row) * N + bn + col);
                }
                cp_async_commit();  // Bs[cur ^ 1] was last read before the previous barrier
            } else {
                fetch((step + 1) * BK);
            }
        }
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            float4 a0 = *reinterpret_cast<const float4*>(&As[cur][k][r0]);
            float4 a1 = *reinterpret_cast<const float4*>(&As[cur][k][r1]);
            float4 b0 = *reinterpret_cast<const float4*>(&Bs[cur][k][c0]);
            float4 b1 = *reinterpret_cast<const float4*>(&Bs[cur][k][c1]);
            float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        if (step + 1 < steps) {
            if (ASYNC_B) {
#pragma unroll
                for (int i = 0; i < AL; ++i) {
                    int e = tid + i * 256, row = e / (BK / 4), col = (e % (BK / 4)) * 4;
                    As[cur ^ 1][col + 0][row] = ra[i].x; As[cur ^ 1][col + 1][row] = ra[i].y;
                    As[cur ^ 1][col + 2][row] = ra[i].z; As[cur ^ 1][col + 3][row] = ra[i].w;
                }
                cp_async_wait<0>();
            } else {
                stash(cur ^ 1);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int row = bm + (i < 4 ? r0 + i : r1 + i - 4);
        float* c = C + (size_t)row * N + bn;
        *reinterpret_cast<float4*>(c + c0) = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        *reinterpret_cast<float4*>(c + c1) = make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
    }
}
extern "C" __global__ void __launch_bounds__(256, 2)
    sgemm_128x128x8(const float* A, const float* B, float* C, int M, int N, int K)
{
    sgemm_regs<8, true, 4, true>(A, B, C, M, N, K);
}
// endregion

// FP32 GEMM through shared memory, one output per thread (16 x 16 threads, 16 x 16 tiles): the CUDA C twin
// of the numba kernel gemm_tiled in kernels/tensor_cores.py. Any M, N, K.
extern "C" __global__ void sgemm_tiled16(const float* A, const float* B, float* C, int M, int N, int K)
{
    __shared__ float sa[16][16];
    __shared__ float sb[16][16];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int row = blockIdx.y * 16 + ty, col = blockIdx.x * 16 + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += 16) {
        sa[ty][tx] = (row < M && k0 + tx < K) ? A[(size_t)row * K + k0 + tx] : 0.0f;
        sb[ty][tx] = (k0 + ty < K && col < N) ? B[(size_t)(k0 + ty) * N + col] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < 16; ++k) acc = fmaf(sa[ty][k], sb[k][tx], acc);
        __syncthreads();
    }
    if (row < M && col < N) C[(size_t)row * N + col] = acc;
}

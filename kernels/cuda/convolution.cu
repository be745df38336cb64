// Lesson 4: convolution kernels in CUDA C, loaded through CuPy (kernels/cuda_c.py).
//
//   im2col_nchw_*   x (N, C, H, W)  -> cols (C*R*S, N*P*Q): row c*R*S + r*S + s, column (n*P + p)*Q + q
//   im2col_nhwc_*   x (N, H, W, C)  -> cols (N*P*Q, R*S*C): row (n*P + p)*Q + q, column (r*S + s)*C + c
//   conv_direct_nchw_*  y = x (*) w, NCHW, computed directly: no cols matrix, no extra memory
//
// Every kernel takes float or half data; the direct kernel accumulates in float either way. A convolution here is
// what deep learning calls one: a cross-correlation (the filter is not flipped).
#include <cuda_fp16.h>

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <typename T> __device__ __forceinline__ T zero() { return from_float<T>(0.0f); }

// ------------------------------------------------------------------------------------------------ im2col

// NCHW: cols (C*R*S, N*P*Q), the images side by side, so that the whole layer is ONE GEMM, w (K x CRS) @ cols.
// Block (x, row, n): row = c*R*S + r*S + s is the same for the whole block (no divisions for it per element);
// its threads run along p*Q + q: consecutive threads write consecutive addresses and read neighbouring pixels.
template <typename T>
__device__ void im2col_nchw(const T* __restrict__ x, T* __restrict__ cols, int N, int C, int H, int W, int R,
                            int S, int P, int Q, int ph, int pw, int sh, int sw, int dh, int dw)
{
    int n = blockIdx.z, row = blockIdx.y;
    int s = row % S, r = (row / S) % R, c = row / (R * S);
    int PQ = P * Q;
    const T* xc = x + ((long long)n * C + c) * H * W;
    T* out = cols + (long long)row * N * PQ + (long long)n * PQ;
    for (int pq = blockIdx.x * blockDim.x + threadIdx.x; pq < PQ; pq += gridDim.x * blockDim.x) {
        int p = pq / Q, q = pq - p * Q;
        int h = p * sh - ph + r * dh, w = q * sw - pw + s * dw;
        out[pq] = (h >= 0 && h < H && w >= 0 && w < W) ? xc[h * W + w] : zero<T>();
    }
}

// NHWC: cols (N*P*Q, R*S*C). One thread per 16 bytes of a row: (r, s) picks one input pixel, whose C channels lie
// contiguous in NHWC, so each thread copies a vector of 16 / sizeof(T) channels with one load and one store.
// Needs C a multiple of that vector width (the launcher checks). IT: the index type, int when everything fits
// (integer division is much cheaper in 32 bits), long long otherwise.
template <typename T, typename IT>
__device__ void im2col_nhwc_vec(const T* __restrict__ x, T* __restrict__ cols, int N, int C, int H, int W, int R,
                                int S, int P, int Q, int ph, int pw, int sh, int sw, int dh, int dw)
{
    const int V = 16 / sizeof(T);
    int CV = C / V;
    IT total = (IT)N * P * Q * R * S * CV;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    uint4* out = reinterpret_cast<uint4*>(cols);
    for (IT i = (IT)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (IT)gridDim.x * blockDim.x) {
        int cv = (int)(i % CV);
        IT t = i / CV;
        int s = (int)(t % S); t /= S;
        int r = (int)(t % R); t /= R;
        int q = (int)(t % Q); t /= Q;
        int p = (int)(t % P);
        int n = (int)(t / P);
        int h = p * sh - ph + r * dh, w = q * sw - pw + s * dw;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (h >= 0 && h < H && w >= 0 && w < W) v = xv[(((long long)n * H + h) * W + w) * CV + cv];
        out[i] = v;
    }
}

template <typename T, typename IT>
__device__ void im2col_nhwc(const T* __restrict__ x, T* __restrict__ cols, int N, int C, int H, int W, int R,
                            int S, int P, int Q, int ph, int pw, int sh, int sw, int dh, int dw)
{
    IT total = (IT)N * P * Q * R * S * C;
    for (IT i = (IT)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (IT)gridDim.x * blockDim.x) {
        int c = (int)(i % C);
        IT t = i / C;
        int s = (int)(t % S); t /= S;
        int r = (int)(t % R); t /= R;
        int q = (int)(t % Q); t /= Q;
        int p = (int)(t % P);
        int n = (int)(t / P);
        int h = p * sh - ph + r * dh, w = q * sw - pw + s * dw;
        cols[i] = (h >= 0 && h < H && w >= 0 && w < W) ? x[(((long long)n * H + h) * W + w) * C + c] : zero<T>();
    }
}

#define IM2COL_ARGS int N, int C, int H, int W, int R, int S, int P, int Q, int ph, int pw, int sh, int sw, int dh, int dw
#define IM2COL_PASS N, C, H, W, R, S, P, Q, ph, pw, sh, sw, dh, dw
#define IM2COL_NHWC(NAME, FN, T, IT) \
    __global__ void NAME(const T* x, T* cols, IM2COL_ARGS) { FN<T, IT>(x, cols, IM2COL_PASS); }
extern "C" {
__global__ void im2col_nchw_f32(const float* x, float* cols, IM2COL_ARGS) { im2col_nchw<float>(x, cols, IM2COL_PASS); }
__global__ void im2col_nchw_f16(const __half* x, __half* cols, IM2COL_ARGS) { im2col_nchw<__half>(x, cols, IM2COL_PASS); }
IM2COL_NHWC(im2col_nhwc_f32, im2col_nhwc, float, int)
IM2COL_NHWC(im2col_nhwc_f16, im2col_nhwc, __half, int)
IM2COL_NHWC(im2col_nhwc_vec_f32, im2col_nhwc_vec, float, int)
IM2COL_NHWC(im2col_nhwc_vec_f16, im2col_nhwc_vec, __half, int)
IM2COL_NHWC(im2col_nhwc_f32_i64, im2col_nhwc, float, long long)
IM2COL_NHWC(im2col_nhwc_f16_i64, im2col_nhwc, __half, long long)
IM2COL_NHWC(im2col_nhwc_vec_f32_i64, im2col_nhwc_vec, float, long long)
IM2COL_NHWC(im2col_nhwc_vec_f16_i64, im2col_nhwc_vec, __half, long long)
}

// ------------------------------------------------------------------------------------ direct convolution

// A block computes an output tile of TP rows x TQ columns for KB output channels of one image. Its 256
// threads each hold PX x KT accumulators: PX pixels of one row (TQ / PX apart) times KT output channels.
// The input channels go through shared memory CB at a time: the input patch the tile needs (with its halo,
// zero outside the image) and the KB x CB x R x S weights, stored with k innermost so that a thread reads its
// KT weights as two float4, the same for all 32 threads of a warp (a broadcast). The patch's rows are IWP floats
// apart, IWP = 4 (mod 8): the 8 rows x 4 columns a warp reads at once then fall in 32 different banks.
#define TQ 16
#define TP 8
#define KB 64
#define CB 4
#define PX 4
#define KT 8
#define DIRECT_THREADS ((TQ / PX) * TP * (KB / KT))

template <typename T, int FR, int FS>
__device__ void conv_direct_nchw(const T* __restrict__ x, const T* __restrict__ wt, T* __restrict__ y, int N,
                                 int C, int H, int W, int K, int R, int S, int P, int Q, int ph, int pw, int sh,
                                 int sw, int dh, int dw)
{
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);
    const int RR = FR ? FR : R, SS = FS ? FS : S;
    const int IH = (TP - 1) * sh + (RR - 1) * dh + 1, IW = (TQ - 1) * sw + (SS - 1) * dw + 1;
    const int IWP = IW + (12 - IW % 8) % 8;  // the row pitch: IWP % 8 == 4
    const int xsize = ((CB * IH * IWP + 3) / 4) * 4;
    float* sx = smem;
    float* swt = smem + xsize;  // [cc][r][s][k], KB innermost

    int tiles_q = (Q + TQ - 1) / TQ;
    int q0 = (blockIdx.x % tiles_q) * TQ, p0 = (blockIdx.x / tiles_q) * TP;
    int k0 = blockIdx.y * KB, n = blockIdx.z;
    int tid = threadIdx.x;
    int px = tid % (TQ / PX), py = (tid / (TQ / PX)) % TP, kz = tid / ((TQ / PX) * TP);
    int h0 = p0 * sh - ph, w0 = q0 * sw - pw;

    float acc[KT][PX];
#pragma unroll
    for (int i = 0; i < KT; ++i)
#pragma unroll
        for (int j = 0; j < PX; ++j) acc[i][j] = 0.0f;

    for (int c0 = 0; c0 < C; c0 += CB) {
        for (int i = tid; i < CB * IH * IW; i += DIRECT_THREADS) {
            int cc = i / (IH * IW), rem = i % (IH * IW);
            int row = rem / IW, col = rem % IW;
            int h = h0 + row, w = w0 + col, c = c0 + cc;
            sx[(cc * IH + row) * IWP + col] = (c < C && h >= 0 && h < H && w >= 0 && w < W)
                                                  ? to_float(x[(((long long)n * C + c) * H + h) * W + w]) : 0.0f;
        }
        const int crs = CB * RR * SS;
        for (int i = tid; i < KB * crs; i += DIRECT_THREADS) {
            int k = i / crs, rem = i % crs;  // consecutive threads read consecutive (c, r, s) of one filter
            int cc = rem / (RR * SS), rs = rem % (RR * SS);
            swt[rem * KB + k] = (k0 + k < K && c0 + cc < C)
                                    ? to_float(wt[((long long)(k0 + k) * C + c0 + cc) * RR * SS + rs]) : 0.0f;
        }
        __syncthreads();
        for (int cc = 0; cc < CB; ++cc) {
#pragma unroll
            for (int r = 0; r < RR; ++r) {
#pragma unroll
                for (int s = 0; s < SS; ++s) {
                    float xv[PX];
#pragma unroll
                    for (int j = 0; j < PX; ++j)
                        xv[j] = sx[(cc * IH + py * sh + r * dh) * IWP + (px + j * (TQ / PX)) * sw + s * dw];
                    const float4* wp = reinterpret_cast<const float4*>(swt + ((cc * RR + r) * SS + s) * KB + kz * KT);
                    float4 wa = wp[0], wb = wp[1];
                    float wv[KT] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
#pragma unroll
                    for (int i = 0; i < KT; ++i)
#pragma unroll
                        for (int j = 0; j < PX; ++j) acc[i][j] = fmaf(wv[i], xv[j], acc[i][j]);
                }
            }
        }
        __syncthreads();
    }
    int p = p0 + py;
    if (p >= P) return;
#pragma unroll
    for (int i = 0; i < KT; ++i) {
        int k = k0 + kz * KT + i;
        if (k >= K) continue;
#pragma unroll
        for (int j = 0; j < PX; ++j) {
            int q = q0 + px + j * (TQ / PX);
            if (q < Q) y[(((long long)n * K + k) * P + p) * Q + q] = from_float<T>(acc[i][j]);
        }
    }
}

#define DIRECT_ARGS int N, int C, int H, int W, int K, int R, int S, int P, int Q, int ph, int pw, int sh, int sw, int dh, int dw
#define DIRECT_PASS N, C, H, W, K, R, S, P, Q, ph, pw, sh, sw, dh, dw
extern "C" {
__global__ void __launch_bounds__(DIRECT_THREADS) conv_direct_nchw_f32(const float* x, const float* w, float* y, DIRECT_ARGS)
{ conv_direct_nchw<float, 0, 0>(x, w, y, DIRECT_PASS); }
__global__ void __launch_bounds__(DIRECT_THREADS) conv_direct_nchw_f16(const __half* x, const __half* w, __half* y, DIRECT_ARGS)
{ conv_direct_nchw<__half, 0, 0>(x, w, y, DIRECT_PASS); }
__global__ void __launch_bounds__(DIRECT_THREADS) conv_direct_nchw_3x3_f32(const float* x, const float* w, float* y, DIRECT_ARGS)
{ conv_direct_nchw<float, 3, 3>(x, w, y, DIRECT_PASS); }
__global__ void __launch_bounds__(DIRECT_THREADS) conv_direct_nchw_3x3_f16(const __half* x, const __half* w, __half* y, DIRECT_ARGS)
{ conv_direct_nchw<__half, 3, 3>(x, w, y, DIRECT_PASS); }
}

// ------------------------------------------------------------- direct convolution on the tensor cores
//
// The convolution as a GEMM that is never written out (an "implicit GEMM"), NHWC, half in, float sums, half out:
//   y (N*P*Q x K) = A (N*P*Q x R*S*C) @ B (R*S*C x K),  A = the im2col matrix of x, B[(r, s, c), k] = w[k, r, s, c].
// Block (blockIdx.x, blockIdx.y) computes the BM x BN tile of y at pixel row bm = blockIdx.x BM, output channel
// bn = blockIdx.y BN, with (BM/WM) x (BN/WN) warps of (WM/16) x (WN/16) WMMA accumulators, as in lesson 3's tiled
// GEMM. The difference is where A's tile comes from: for each BK-wide step along R*S*C (one filter tap (r, s)
// and BK consecutive channels c0 .. c0 + BK - 1, since C is a multiple of BK), row m of the tile is the input
// pixel x[n, p sh - ph + r dh, q sw - pw + s dw, c0 ..] of output pixel m = (n P + p) Q + q: BK contiguous
// halves of NHWC, copied by cp.async straight from the image into shared memory, 16 bytes at a time, or zeros
// where the filter hangs over the edge (cp.async's src-size 0). im2col happens in shared memory, tile by tile.
// B's tile is BN filters' BK consecutive (r, s, c) values: contiguous in KRSC. STAGES buffers overlap the copies
// of the next steps with the tensor cores' work on this one.
// Needs C a multiple of BK (32) and K a multiple of 8; M = N P Q and K need not be multiples of the tile.
#include <mma.h>

namespace igemm {
using namespace nvcuda;

constexpr int BK = 32;
constexpr int LD = BK + 8;  // shared-memory row pitch in halves: rows 16 bytes apart round the banks

__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    int src_size = valid ? 16 : 0;  // 0: read nothing, write 16 bytes of zeros
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_size));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <int BM, int BN, int WM, int WN, int STAGES>
__device__ __forceinline__ void conv_igemm(const __half* __restrict__ x, const __half* __restrict__ w,
                                           __half* __restrict__ y, int N, int C, int H, int W, int K, int R,
                                           int S, int P, int Q, int ph, int pw, int sh, int sw, int dh, int dw)
{
    constexpr int WARPS_N = BN / WN, WARPS = (BM / WM) * WARPS_N, THREADS = WARPS * 32;
    constexpr int FM = WM / 16, FN = WN / 16;
    constexpr int CHUNKS = BK / 8;                       // 16-byte pieces of a tile row
    constexpr int A_ROWS = THREADS / CHUNKS;             // tile rows one pass of the block copies
    constexpr int A_PASSES = BM / A_ROWS, B_PASSES = (BN + A_ROWS - 1) / A_ROWS;
    constexpr int A_STAGE = BM * LD, B_STAGE = BN * LD;
    extern __shared__ __align__(128) unsigned char smem[];
    __half* As = reinterpret_cast<__half*>(smem);
    __half* Bs = As + STAGES * A_STAGE;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int bm = blockIdx.x * BM, bn = blockIdx.y * BN;
    const int M = N * P * Q, RSC = R * S * C;
    const int chunk = tid % CHUNKS, row0 = tid / CHUNKS;

    // The output pixels of the A rows this thread copies, worked out once: the image's offset and the top-left
    // input position their filter window starts at.
    long long a_base[A_PASSES];
    int a_h[A_PASSES], a_w[A_PASSES];
#pragma unroll
    for (int i = 0; i < A_PASSES; ++i) {
        int m = bm + row0 + i * A_ROWS;
        int q = m % Q, t = m / Q, p = t % P, n = t / P;
        a_base[i] = (long long)n * H * W * C;
        a_h[i] = m < M ? p * sh - ph : -(1 << 28);  // rows past M read nothing: never inside the image
        a_w[i] = q * sw - pw;
    }

    auto load_stage = [&](int stage, int k0) {
        const int rs = k0 / C, c0 = k0 - rs * C, r = rs / S, s = rs - r * S;
        __half* as = As + stage * A_STAGE;
        __half* bs = Bs + stage * B_STAGE;
#pragma unroll
        for (int i = 0; i < A_PASSES; ++i) {
            int h = a_h[i] + r * dh, wc = a_w[i] + s * dw;
            bool ok = h >= 0 && h < H && wc >= 0 && wc < W;
            const __half* src = ok ? x + a_base[i] + ((long long)h * W + wc) * C + c0 + chunk * 8 : x;
            cp_async16_zfill(as + (row0 + i * A_ROWS) * LD + chunk * 8, src, ok);
        }
#pragma unroll
        for (int i = 0; i < B_PASSES; ++i) {
            int kr = row0 + i * A_ROWS;
            if (kr < BN) {
                bool ok = bn + kr < K;
                const __half* src = ok ? w + (long long)(bn + kr) * RSC + k0 + chunk * 8 : w;
                cp_async16_zfill(bs + kr * LD + chunk * 8, src, ok);
            }
        }
    };

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FM][FN];
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

    const int steps = RSC / BK;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) load_stage(s, s * BK);
        cp_async_commit();
    }
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<STAGES - 2>();  // this step's tiles have landed ...
        __syncthreads();              // ... for every thread, and the buffer refilled next is free
        const int next = step + STAGES - 1;
        if (next < steps) load_stage(next % STAGES, next * BK);
        cp_async_commit();
        const __half* as = As + (step % STAGES) * A_STAGE;
        const __half* bs = Bs + (step % STAGES) * B_STAGE;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a[FM];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b[FN];
#pragma unroll
            for (int i = 0; i < FM; ++i) wmma::load_matrix_sync(a[i], as + (wm * WM + i * 16) * LD + kk, LD);
#pragma unroll
            for (int j = 0; j < FN; ++j) wmma::load_matrix_sync(b[j], bs + (wn * WN + j * 16) * LD + kk, LD);
#pragma unroll
            for (int i = 0; i < FM; ++i)
#pragma unroll
                for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    // Each warp rounds its float sums to half through 1 KiB of scratch (16 x 16 floats) and writes its rows of
    // the NHWC output: 8 halves (16 bytes) a lane, guarded at the edges of y.
    float* scratch = reinterpret_cast<float*>(smem) + warp * 256;
    const int er = lane / 2, ec = (lane % 2) * 8;
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j) {
            wmma::store_matrix_sync(scratch, acc[i][j], 16, wmma::mem_row_major);
            __syncwarp();
            int m = bm + wm * WM + i * 16 + er, k = bn + wn * WN + j * 16 + ec;
            if (m < M) {
                __half* dst = y + (long long)m * K + k;
                if (k + 8 <= K) {
                    __align__(16) __half v[8];
#pragma unroll
                    for (int e = 0; e < 8; ++e) v[e] = __float2half_rn(scratch[er * 16 + ec + e]);
                    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(v);
                } else {
                    for (int e = 0; e < 8 && k + e < K; ++e) dst[e] = __float2half_rn(scratch[er * 16 + ec + e]);
                }
            }
            __syncwarp();
        }
}
}  // namespace igemm

// The configurations: conv_igemm_<BM>x<BN>_w<WM>x<WN>_s<STAGES>_nhwc_f16 (kernels/convolution.py parses the name).
#define CONV_IGEMM(BM, BN, WM, WN, ST)                                                                         \
    extern "C" __global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32)                                  \
        conv_igemm_##BM##x##BN##_w##WM##x##WN##_s##ST##_nhwc_f16(const __half* x, const __half* w, __half* y, \
                                                                 int N, int C, int H, int W, int K, int R,   \
                                                                 int S, int P, int Q, int ph, int pw, int sh, \
                                                                 int sw, int dh, int dw)                     \
    {                                                                                                         \
        igemm::conv_igemm<BM, BN, WM, WN, ST>(x, w, y, N, C, H, W, K, R, S, P, Q, ph, pw, sh, sw, dh, dw);    \
    }

CONV_IGEMM(128, 128, 64, 32, 3)  // 8 warps
CONV_IGEMM(128, 64, 64, 32, 3)   // 4 warps
CONV_IGEMM(64, 64, 32, 32, 3)    // 4 warps
CONV_IGEMM(128, 64, 32, 32, 4)   // 8 warps, four buffers
CONV_IGEMM(64, 128, 32, 64, 3)   // 4 warps

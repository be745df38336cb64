// Lesson 5: convolution kernels in CUDA C, loaded through CuPy (gpucourse/cuda_c.py).
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

// region: conv_direct
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
// endregion

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
// bn = blockIdx.y BN, with (BM/WM) x (BN/WN) warps of (WM/16) x (WN/16) WMMA accumulators, as in lesson 4's tiled
// GEMM. The difference is where A's tile comes from: for each BK-wide step along R*S*C (one filter tap (r, s)
// and BK consecutive channels c0 .. c0 + BK - 1, since C is a multiple of BK), row m of the tile is the input
// pixel x[n, p sh - ph + r dh, q sw - pw + s dw, c0 ..] of output pixel m = (n P + p) Q + q: BK contiguous
// halves of NHWC, copied by cp.async straight from the image into shared memory, 16 bytes at a time, or zeros
// where the filter hangs over the edge (cp.async's src-size 0). im2col happens in shared memory, tile by tile.
// B's tile is BN filters' BK consecutive (r, s, c) values: contiguous in KRSC. STAGES buffers overlap the copies
// of the next steps with the tensor cores' work on this one.
// Needs C a multiple of BK (32) and K a multiple of 8; M = N P Q and K need not be multiples of the tile.
#include <mma.h>
#include "async_copy.cuh"

namespace igemm {
using namespace nvcuda;

constexpr int BK = 32;
constexpr int LD = BK + 8;  // shared-memory row pitch in halves: rows 16 bytes apart round the banks

// cp.async needs sm_80+; below (a T4) the copies are synchronous (async_copy.cuh; gpucourse/gpus.py: step
// "05.igemm_wmma").

// region: conv_igemm
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
// endregion
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

// ------------------------------------------------- direct convolution on the CUDA cores, as an implicit GEMM
//
// The same implicit GEMM in FP32 on the ordinary cores, for NCHW, with lesson 4's register-tiled SGEMM inside:
//   y[n, :, p, q] (K x N*P*Q) = W (K x C*R*S) @ X (C*R*S x N*P*Q),  X[(c, r, s), (n, p, q)] = x[n, c, h, w] with
//   h = p sh - ph + r dh, w = q sw - pw + s dw (zero outside the image): the im2col matrix, never written out.
// A block computes a BM x BN tile of that product (BM output channels x BN output pixels); each of its
// (BM/8) x (BN/8) threads keeps 8 x 8 accumulators: the channels ty*4 .. +3 and BM/2 + ty*4 .. +3 times the pixels
// tx*4 .. +3 and BN/2 + tx*4 .. +3, read from shared memory as float4 (conflict-free, as in lesson 4). Each step
// along C*R*S takes BK = 8 of it: the BM x 8 weights (contiguous rows of KCRS, stored transposed) and the 8 x BN
// inputs, gathered straight from the NCHW image: a thread loads one (c, r, s) row for BN*8/THREADS pixels that are
// THREADS/8 apart, so neighbouring threads read neighbouring pixels. The next step's loads go to registers while
// the cores work on this one (two shared-memory buffers, one barrier a step). gridDim.z > 1 splits C*R*S among
// blocks that add their partial sums into y (zeroed first): with 2 the sum 0 + a + b does not depend on the order.
// Strict FP32: every product is an FMA on the CUDA cores.
// region: conv_cores
namespace cores {
constexpr int BK = 8;

template <int BM, int BN>
__device__ __forceinline__ void conv_igemm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                               float* __restrict__ y, int N, int C, int H, int W, int K, int R,
                                               int S, int P, int Q, int ph, int pw, int sh, int sw, int dh, int dw)
{
    constexpr int THREADS = (BM / 8) * (BN / 8);
    constexpr int A_PER = BM * BK / THREADS, A_TPR = BK / A_PER;  // weights a thread loads a step; threads a row
    constexpr int B_PER = BK * BN / THREADS, B_TPR = THREADS / BK;  // inputs a thread loads a step; threads a row
    constexpr int AP = BM + 4;  // row pitch of the transposed weights: the transposing stores hit 32 banks
    __shared__ __align__(16) float As[2][BK][AP];
    __shared__ __align__(16) float Bs[2][BK][BN];

    const int tid = threadIdx.x;
    const int PQ = P * Q, NPQ = N * PQ, RS = R * S, CRS = C * RS, HW = H * W;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int steps = (CRS + BK - 1) / BK, per = (steps + gridDim.z - 1) / gridDim.z;
    const int step0 = blockIdx.z * per, step1 = min(steps, step0 + per);

    // the weights this thread copies: row a_m of the tile, columns a_k .. a_k + A_PER - 1
    const int a_m = tid / A_TPR, a_k = (tid % A_TPR) * A_PER;
    const bool a_ok = m0 + a_m < K;
    const float* wrow = w + (a_ok ? (m0 + a_m) * CRS : 0);
    // the inputs: row b_k of the tile, pixels b_n + j B_TPR; for each, where its filter window starts
    const int b_k = tid / B_TPR, b_n = tid % B_TPR;
    int b_base[B_PER], b_h[B_PER], b_w[B_PER];
#pragma unroll
    for (int j = 0; j < B_PER; ++j) {
        int col = n0 + b_n + j * B_TPR;
        int n = col / PQ, pq = col - n * PQ, p = pq / Q, q = pq - p * Q;
        b_h[j] = col < NPQ ? p * sh - ph : -(1 << 28);  // pixels past N P Q read nothing: never inside the image
        b_w[j] = q * sw - pw;
        b_base[j] = col < NPQ ? n * C * HW + b_h[j] * W + b_w[j] : 0;
    }

    float a_reg[A_PER], b_reg[B_PER];
    auto load = [&](int step) {
        const int kb = step * BK;
#pragma unroll
        for (int i = 0; i < A_PER; ++i) {
            int kk = kb + a_k + i;
            a_reg[i] = (a_ok && kk < CRS) ? __ldg(wrow + kk) : 0.0f;
        }
        const int crs = kb + b_k;
        const int c = crs / RS, rs = crs - c * RS, r = rs / S, s = rs - r * S;
        const int rh = r * dh, rw = s * dw, off = c * HW + rh * W + rw;
        const bool row_ok = crs < CRS;
#pragma unroll
        for (int j = 0; j < B_PER; ++j) {
            int h = b_h[j] + rh, wc = b_w[j] + rw;
            bool ok = row_ok && (unsigned)h < (unsigned)H && (unsigned)wc < (unsigned)W;
            b_reg[j] = ok ? __ldg(x + b_base[j] + off) : 0.0f;
        }
    };
    auto store = [&](int buf) {
#pragma unroll
        for (int i = 0; i < A_PER; ++i) As[buf][a_k + i][a_m] = a_reg[i];
#pragma unroll
        for (int j = 0; j < B_PER; ++j) Bs[buf][b_k][b_n + j * B_TPR] = b_reg[j];
    };

    const int ty = tid / (BN / 8), tx = tid % (BN / 8);
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

    if (step0 < step1) {
        load(step0);
        store(0);
    }
    __syncthreads();
    for (int step = step0; step < step1; ++step) {
        const int buf = (step - step0) & 1;
        const bool more = step + 1 < step1;
        if (more) load(step + 1);  // in flight while the FMAs below run
#pragma unroll
        for (int kk = 0; kk < BK; ++kk) {
            float4 a0 = *reinterpret_cast<const float4*>(&As[buf][kk][ty * 4]);
            float4 a1 = *reinterpret_cast<const float4*>(&As[buf][kk][BM / 2 + ty * 4]);
            float4 b0 = *reinterpret_cast<const float4*>(&Bs[buf][kk][tx * 4]);
            float4 b1 = *reinterpret_cast<const float4*>(&Bs[buf][kk][BN / 2 + tx * 4]);
            float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        if (more) store(buf ^ 1);
        __syncthreads();
    }

    // y[n, k, p, q]: column (n, p, q) of the tile is at n K P Q + p Q + q, row k adds k P Q
    int y_off[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        int col = n0 + (j < 4 ? tx * 4 + j : BN / 2 + tx * 4 + j - 4);
        int n = col / PQ;
        y_off[j] = col < NPQ ? n * K * PQ + (col - n * PQ) : -1;
    }
    const bool split = gridDim.z > 1;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        int k = m0 + (i < 4 ? ty * 4 + i : BM / 2 + ty * 4 + i - 4);
        if (k >= K) continue;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (y_off[j] < 0) continue;
            float* dst = y + y_off[j] + k * PQ;
            if (split) atomicAdd(dst, acc[i][j]);
            else *dst = acc[i][j];
        }
    }
}
}  // namespace cores
// endregion

// The configurations: conv_cores_<BM>x<BN>_b<B>_nchw_f32, (BM/8) x (BN/8) threads, compiled so that B blocks fit
// on an SM (kernels/convolution.py parses the name): with B = 512 / threads, at most 128 registers a thread (16
// warps an SM, a few registers spilled to the L1 cache); with B = 1 the compiler takes what it needs (140 to 170:
// fewer warps, no spills). Which is faster depends on the layer; the benchmark times both.
#define CONV_CORES(BM, BN, B)                                                                                 \
    extern "C" __global__ void __launch_bounds__((BM / 8) * (BN / 8), B)                                      \
        conv_cores_##BM##x##BN##_b##B##_nchw_f32(const float* x, const float* w, float* y, int N, int C, int H, \
                                                 int W, int K, int R, int S, int P, int Q, int ph, int pw,    \
                                                 int sh, int sw, int dh, int dw)                              \
    {                                                                                                         \
        cores::conv_igemm_f32<BM, BN>(x, w, y, N, C, H, W, K, R, S, P, Q, ph, pw, sh, sw, dh, dw);            \
    }

CONV_CORES(128, 128, 2)  // 256 threads
CONV_CORES(128, 128, 1)
CONV_CORES(64, 128, 4)   // 128 threads
CONV_CORES(64, 128, 1)
CONV_CORES(128, 64, 4)   // 128 threads
CONV_CORES(128, 64, 1)
CONV_CORES(64, 64, 8)    // 64 threads
CONV_CORES(64, 64, 1)

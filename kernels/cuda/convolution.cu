// Lesson 4: convolution kernels in CUDA C, loaded through CuPy (kernels/cuda_c.py).
//
//   im2col_nchw_*   x (N, C, H, W)  -> cols (N, C*R*S, P*Q): row c*R*S + r*S + s, column p*Q + q
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

// One thread per element of cols, the column index p*Q + q fastest: consecutive threads write consecutive
// addresses, and read neighbouring pixels of one input row.
template <typename T>
__device__ void im2col_nchw(const T* __restrict__ x, T* __restrict__ cols, int N, int C, int H, int W, int R,
                            int S, int P, int Q, int ph, int pw, int sh, int sw, int dh, int dw)
{
    long long total = (long long)N * C * R * S * P * Q;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        int q = (int)(i % Q);
        long long t = i / Q;
        int p = (int)(t % P); t /= P;
        int s = (int)(t % S); t /= S;
        int r = (int)(t % R); t /= R;
        int c = (int)(t % C);
        int n = (int)(t / C);
        int h = p * sh - ph + r * dh, w = q * sw - pw + s * dw;
        cols[i] = (h >= 0 && h < H && w >= 0 && w < W) ? x[(((long long)n * C + c) * H + h) * W + w] : zero<T>();
    }
}

// One thread per 16 bytes of a cols row: (r, s) picks one input pixel, whose C channels lie contiguous in
// NHWC, so each thread copies a vector of 16 / sizeof(T) channels with one load and one store.
// Needs C a multiple of that vector width (the launcher checks).
template <typename T>
__device__ void im2col_nhwc_vec(const T* __restrict__ x, T* __restrict__ cols, int N, int C, int H, int W, int R,
                                int S, int P, int Q, int ph, int pw, int sh, int sw, int dh, int dw)
{
    const int V = 16 / sizeof(T);
    int CV = C / V;
    long long total = (long long)N * P * Q * R * S * CV;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    uint4* out = reinterpret_cast<uint4*>(cols);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        int cv = (int)(i % CV);
        long long t = i / CV;
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

template <typename T>
__device__ void im2col_nhwc(const T* __restrict__ x, T* __restrict__ cols, int N, int C, int H, int W, int R,
                            int S, int P, int Q, int ph, int pw, int sh, int sw, int dh, int dw)
{
    long long total = (long long)N * P * Q * R * S * C;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        int c = (int)(i % C);
        long long t = i / C;
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
extern "C" {
__global__ void im2col_nchw_f32(const float* x, float* cols, IM2COL_ARGS) { im2col_nchw<float>(x, cols, IM2COL_PASS); }
__global__ void im2col_nchw_f16(const __half* x, __half* cols, IM2COL_ARGS) { im2col_nchw<__half>(x, cols, IM2COL_PASS); }
__global__ void im2col_nhwc_f32(const float* x, float* cols, IM2COL_ARGS) { im2col_nhwc<float>(x, cols, IM2COL_PASS); }
__global__ void im2col_nhwc_f16(const __half* x, __half* cols, IM2COL_ARGS) { im2col_nhwc<__half>(x, cols, IM2COL_PASS); }
__global__ void im2col_nhwc_vec_f32(const float* x, float* cols, IM2COL_ARGS) { im2col_nhwc_vec<float>(x, cols, IM2COL_PASS); }
__global__ void im2col_nhwc_vec_f16(const __half* x, __half* cols, IM2COL_ARGS) { im2col_nhwc_vec<__half>(x, cols, IM2COL_PASS); }
}

// ------------------------------------------------------------------------------------ direct convolution

// A block computes an output tile of TP rows x TQ columns for KB output channels of one image. Its 256
// threads each hold PX x KT accumulators: PX neighbouring pixels of one row times KT output channels.
// The input channels go through shared memory CB at a time: the input patch the tile needs (with its halo,
// zero outside the image) and the KB x CB x R x S weights, stored with k innermost so that a thread reads its
// KT weights as two float4, the same for all 32 threads of a warp (a broadcast).
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
    const int xsize = ((CB * IH * IW + 3) / 4) * 4;
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
            int h = h0 + rem / IW, w = w0 + rem % IW, c = c0 + cc;
            sx[i] = (c < C && h >= 0 && h < H && w >= 0 && w < W)
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
                        xv[j] = sx[(cc * IH + py * sh + r * dh) * IW + (px * PX + j) * sw + s * dw];
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
            int q = q0 + px * PX + j;
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

// Lesson 6: the kernels of a small inference engine, in CUDA C. Loaded from Python by gpucourse/cuda_c.py
// (CuPy compiles it with NVRTC on first use; <mma.h> needs the CUDA include path). The plan that says which
// kernel runs on which buffer, and a NumPy model of every kernel, are in kernels/inference_engine/.
//
// Every activation lives in one "arena" (one allocation, like TensorRT's workspace), NHWC: pixel m of a
// tensor starts at base + m * ld, so a tensor can be a slice of channels of a wider buffer. That is what
// lets a branch of an inception block write straight into its part of the concatenated output.
//
// 1. conv_*: a convolution as an implicit GEMM (rows: output pixels, columns: output channels, reduction:
//    kernel height x width x input channels), with the CBR epilogue: + bias, ReLU, conversion to the
//    activation type, and a destination per output channel (y_off[k], y_ld[k]). With no bias and no ReLU it
//    is the plain convolution of the layer-by-layer engine. Here: SIMT versions for float, half and int8
//    (int32 accumulation), two ways of tiling them (1a), direct SIMT convolutions (1a''), and one output pixel
//    a thread for a short reduction (1e). In inference_engine_tensor_cores.cuh: WMMA versions for half, loading 2 bytes
//    at a time (1b) or 16 (1c), pipelined ones for half and int8 (1d), and direct convolutions on the tensor
//    cores for images at most 16 wide (1f).
// 2. maxpool_*, head_* (average pool + flatten + dense), convert_in_* (the network's input into the arena).
//    In inference_engine_stem.cuh: ResNet-50's stem, convolution + ReLU + max pool in one kernel (stem_pool*).
// 3. The layer-by-layer engine's separate kernels: bias_add_*, batchnorm_*, relu_*, concat_copy_*,
//    avgpool_*, dense_*.

#include <mma.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include "async_copy.cuh"  // cp.async, and what a T4 does instead (gpus.py: "06.tc")

using namespace nvcuda;

typedef signed char int8;

// FP8 e4m3 (Hopper's FP8 plans): the code's byte; cuda_fp8.h converts, in hardware from sm_89, emulated before.
struct fp8 {
    unsigned char b;
    fp8() = default;
    __device__ explicit fp8(int) : b(0) {}  // (T)0: +0
};

// ------------------------------------------------------------------------- conversions to and from float
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(int8 v) { return (float)v; }
__device__ __forceinline__ float to_f(fp8 v) { return __half2float(__half(__nv_cvt_fp8_to_halfraw(v.b, __NV_E4M3))); }

// float -> activation type; inv_scale is 1 / the tensor's INT8 scale (ignored for float and half)
__device__ __forceinline__ void store(float* p, float v, float) { *p = v; }
__device__ __forceinline__ void store(half* p, float v, float) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(int8* p, float v, float inv_scale)
{
    int q = __float2int_rn(v * inv_scale);
    *p = (int8)max(-127, min(127, q));
}
// FP8: v / scale to the nearest e4m3 (ties to even), saturated to +-448
__device__ __forceinline__ void store(fp8* p, float v, float inv_scale)
{
    p->b = __nv_cvt_float_to_fp8(v * inv_scale, __NV_SATFINITE, __NV_E4M3);
}

// what the reduction accumulates in: float for float and half, int32 for int8 (exact)
template <typename T> struct Acc { typedef float type; };
template <> struct Acc<int8> { typedef int type; };
__device__ __forceinline__ float to_acc(float v, float) { return v; }
__device__ __forceinline__ float to_acc(half v, float) { return __half2float(v); }
__device__ __forceinline__ int to_acc(int8 v, int) { return (int)v; }

// region: epilogue
// The epilogue of every convolution: value of output (m, k) from its accumulator. ``residual``: what a ResNet
// block's shortcut adds at (m, k), in real units, before the ReLU (0 for every other convolution).
template <typename T, typename A>
__device__ __forceinline__ void epilogue(A acc, long long m, int k, const float* bias, const float* scale,
                                         T* y, const long long* y_off, const int* y_ld, const float* y_inv_scale,
                                         int relu, float residual = 0.0f)
{
    float v = (float)acc;
    if (scale) v *= scale[k];  // INT8: s_x s_w[k] turns the int32 sum back into real units
    if (bias) v += bias[k];
    v += residual;
    if (relu) v = fmaxf(v, 0.0f);
    store(y + y_off[k] + m * (long long)y_ld[k], v, y_inv_scale ? y_inv_scale[k] : 1.0f);
}

// An output pixel m = (n H + h) W + w, decomposed once per thread: its (h, w) and the index of its input
// pixel (n, h, w). Indices are 32-bit: the launcher refuses layers of 2^31 elements or more.
struct Pixel { int h, w, base; bool valid; };

__device__ __forceinline__ Pixel pixel(int m, int M, int H, int W)
{
    Pixel p;
    p.valid = m < M;
    p.w = m % W;
    p.h = (m / W) % H;
    p.base = m;  // (n H + h) W + w is m itself
    return p;
}

// One reduction index r = (dy KW + dx) C + c, decomposed: the input offset it adds to a pixel, and (dy, dx)
// relative to the centre for the edge test ("same" padding: zero outside the image).
struct Tap { int dy, dx, c; bool valid; };

__device__ __forceinline__ Tap tap(int r, int R, int C, int KH, int KW)
{
    Tap t;
    t.valid = r < R;
    t.c = r % C;
    int q = r / C;
    t.dx = q % KW - KW / 2;
    t.dy = q / KW - KH / 2;
    return t;
}
// endregion

// Element (r, m) of the implicit im2col matrix: input pixel (n, h + dy, w + dx), channel c, or zero.
template <typename T>
__device__ __forceinline__ T im2col(const T* x, int ldx, Pixel p, Tap t, int H, int W)
{
    int hh = p.h + t.dy, ww = p.w + t.dx;
    if (!p.valid || !t.valid || hh < 0 || hh >= H || ww < 0 || ww >= W) return (T)0;
    return x[(long long)(p.base + t.dy * W + t.dx) * ldx + t.c];
}

// ------------------------------------------------------------------------------- 1a. SIMT implicit GEMM
// A block of 256 threads computes BM output pixels x BN output channels; each thread TM x TN of them, in
// registers. Per step of 16 along the reduction the block stages 16 x BM of the im2col matrix and 16 x BN of
// the weights (R x K, row-major) in shared memory. Loading, thread t takes reduction index t % 16 (so a
// warp reads 16 consecutive channels of a pixel: coalesced in NHWC) and BM / 16 pixels, decomposed once.
//
// CONTIG picks which outputs a thread owns. false: pixels tm, tm + BM / TM, ... and channels tn, tn + BN / TN,
// ... (strided). true: TM consecutive pixels and TN consecutive channels, so its operands for one step of the
// reduction are TM and TN consecutive values in shared memory, read as float4 / float2 (int4 / int2 for int8's
// int32 sums): 3 shared-memory loads for 16 multiply-adds where the strided tile needs 6 for 8. Its rows are
// padded by 4 values to keep those loads 16-byte aligned (the strided tile pads by 1 against bank conflicts).
template <typename A> struct Vec;
template <> struct Vec<float> { typedef float4 v4; typedef float2 v2; };
template <> struct Vec<int> { typedef int4 v4; typedef int2 v2; };

template <typename A, int N>
__device__ __forceinline__ void load_row(A (&r)[N], const A* p)
{
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            typename Vec<A>::v4 v = reinterpret_cast<const typename Vec<A>::v4*>(p)[i];
            r[4 * i] = v.x; r[4 * i + 1] = v.y; r[4 * i + 2] = v.z; r[4 * i + 3] = v.w;
        }
    } else if constexpr (N % 2 == 0) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            typename Vec<A>::v2 v = reinterpret_cast<const typename Vec<A>::v2*>(p)[i];
            r[2 * i] = v.x; r[2 * i + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) r[i] = p[i];
    }
}

template <typename T, int BM, int BN, int TM, int TN, bool CONTIG>
__device__ void conv_simt(const T* x, int ldx, const T* w, const float* bias, const float* scale, T* y,
                          const long long* y_off, const int* y_ld, const float* y_inv_scale, int N, int H, int W,
                          int C, int K, int KH, int KW, int relu)
{
    typedef typename Acc<T>::type A;
    const int BK = 16, THREADS = 256, PIX = BM * BK / THREADS;  // pixels each thread loads per step
    static_assert((BM / TM) * (BN / TN) == THREADS, "one thread per TM x TN piece of the tile");
    __shared__ __align__(16) A xs[BK][BM + (CONTIG ? 4 : 1)];
    __shared__ __align__(16) A ws[BK][BN];
    int tid = threadIdx.x;
    int tm = tid / (BN / TN), tn = tid % (BN / TN);
    int M = N * H * W, R = KH * KW * C;
    int m0 = blockIdx.x * BM, k0 = blockIdx.y * BN;
    int rr = tid % BK;
    Pixel px[PIX];
#pragma unroll
    for (int j = 0; j < PIX; ++j) px[j] = pixel(m0 + tid / BK + j * (THREADS / BK), M, H, W);
    A acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = (A)0;
    for (int r0 = 0; r0 < R; r0 += BK) {
        Tap t = tap(r0 + rr, R, C, KH, KW);
#pragma unroll
        for (int j = 0; j < PIX; ++j)
            xs[rr][tid / BK + j * (THREADS / BK)] = to_acc(im2col(x, ldx, px[j], t, H, W), (A)0);
        for (int e = tid; e < BK * BN; e += THREADS) {
            int r = r0 + e / BN, k = k0 + e % BN;
            ws[e / BN][e % BN] = (r < R && k < K) ? to_acc(w[(long long)r * K + k], (A)0) : (A)0;
        }
        __syncthreads();
#pragma unroll
        for (int q = 0; q < BK; ++q) {
            A a[TM], b[TN];
            if constexpr (CONTIG) {
                load_row(a, &xs[q][tm * TM]);
                load_row(b, &ws[q][tn * TN]);
            } else {
#pragma unroll
                for (int i = 0; i < TM; ++i) a[i] = xs[q][tm + i * (BM / TM)];
#pragma unroll
                for (int j = 0; j < TN; ++j) b[j] = ws[q][tn + j * (BN / TN)];
            }
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        int m = m0 + (CONTIG ? tm * TM + i : tm + i * (BM / TM));
        if (m >= M) continue;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            int k = k0 + (CONTIG ? tn * TN + j : tn + j * (BN / TN));
            if (k < K) epilogue(acc[i][j], (long long)m, k, bias, scale, y, y_off, y_ld, y_inv_scale, relu);
        }
    }
}

#define CONV_SIMT(NAME, T, BM, BN, TM, TN, CONTIG)                                                                    \
    extern "C" __global__ void __launch_bounds__(256)                                                          \
    NAME(const T* x, int ldx, const T* w, const float* bias, const float* scale, T* y, const long long* y_off, \
         const int* y_ld, const float* y_inv_scale, int N, int H, int W, int C, int K, int KH, int KW, int relu) \
    {                                                                                                          \
        conv_simt<T, BM, BN, TM, TN, CONTIG>(x, ldx, w, bias, scale, y, y_off, y_ld, y_inv_scale, N, H, W, C, K, KH,  \
                                     KW, relu);                                                                \
    }

CONV_SIMT(conv_simt_64x64_f32, float, 64, 64, 4, 4, false)
CONV_SIMT(conv_simt_64x32_f32, float, 64, 32, 4, 2, false)
CONV_SIMT(conv_simt_32x32_f32, float, 32, 32, 2, 2, false)
CONV_SIMT(conv_simt_64x64_f16, half, 64, 64, 4, 4, false)
CONV_SIMT(conv_simt_64x32_f16, half, 64, 32, 4, 2, false)
CONV_SIMT(conv_simt_32x32_f16, half, 32, 32, 2, 2, false)
CONV_SIMT(conv_simt_64x64_i8, int8, 64, 64, 4, 4, false)
CONV_SIMT(conv_simt_64x32_i8, int8, 64, 32, 4, 2, false)
CONV_SIMT(conv_simt_32x32_i8, int8, 32, 32, 2, 2, false)

// 1a with CONTIG: each thread's tile contiguous (see above).
#define CONV_SIMT_VEC_ALL(SUFFIX, T)                               \
    CONV_SIMT(conv_simtv_128x64_##SUFFIX, T, 128, 64, 8, 4, true)  \
    CONV_SIMT(conv_simtv_128x32_##SUFFIX, T, 128, 32, 8, 2, true)  \
    CONV_SIMT(conv_simtv_64x32_##SUFFIX, T, 64, 32, 4, 2, true)    \
    CONV_SIMT(conv_simtv_128x16_##SUFFIX, T, 128, 16, 8, 1, true)  \
    CONV_SIMT(conv_simtv_64x16_##SUFFIX, T, 64, 16, 4, 1, true)

CONV_SIMT_VEC_ALL(f32, float)
CONV_SIMT_VEC_ALL(f16, half)
CONV_SIMT_VEC_ALL(i8, int8)

// ----------------------------------------------- 1a''. SIMT direct convolution, the input tile reused from shared memory
// For the k x k convolutions (stride 1, "same" padding) the implicit GEMM above stages the im2col matrix,
// which holds every input value k^2 times, each with its own index arithmetic and edge test. This kernel
// stages what the outputs actually need: a block computes a TH x TW tile of one image's pixels x BN channels,
// and per chunk of CB input channels loads the input tile with its halo, (TH + KS - 1) x (TW + KS - 1) x CB,
// once (zeros outside the image), and the chunk's weights, KS x KS x CB x BN; one barrier, then the whole
// chunk's arithmetic from shared memory. Each thread owns TM consecutive pixels of one row x TN consecutive
// channels (register tiling, as in lesson 4's SGEMM): per input channel and kernel row it reads TM + KS - 1
// input values into registers once and uses each for up to KS taps, and reads its TN weights of a tap as
// one float4 (int4 for int8's int32 sums), 2 KS + TM - 1 shared loads for KS^2 TM TN multiply-adds.
// The input tile keeps its CB channels of a pixel together, padded to CB + 1 so neighbouring threads' pixels
// fall in different shared-memory banks. Blocks: blockIdx.x a tile (image, tile row, tile column),
// blockIdx.y a group of BN channels (the launcher in kernels/inference_engine/executor.py sizes the grid from DIRECT).
template <typename T, int KS, int TH, int TW, int BN, int TM, int TN, int CB>
__device__ void conv_direct(const T* x, int ldx, const T* w, const float* bias, const float* scale, T* y,
                            const long long* y_off, const int* y_ld, const float* y_inv_scale, int N, int H,
                            int W, int C, int K, int KH, int KW, int relu)
{
    typedef typename Acc<T>::type A;
    const int THREADS = TH * (TW / TM) * (BN / TN);
    const int HH = TH + KS - 1, WW = TW + KS - 1, CBP = CB + 1, P = KS / 2, TAPS = KS * KS;
    static_assert(THREADS <= 256 && TW % TM == 0 && BN % TN == 0, "one thread per TM x TN piece of the tile");
    __shared__ A xs[HH * WW * CBP];
    __shared__ __align__(16) A ws[CB * TAPS * BN];
    int tid = threadIdx.x;
    int tn = tid % (BN / TN), pg = tid / (BN / TN);
    int ph = pg / (TW / TM), pw = (pg % (TW / TM)) * TM;
    int tiles_w = (W + TW - 1) / TW, tiles_h = (H + TH - 1) / TH;
    int b = blockIdx.x;
    int n = b / (tiles_h * tiles_w);
    b -= n * tiles_h * tiles_w;
    int h0 = (b / tiles_w) * TH, w0 = (b % tiles_w) * TW;
    int k0 = blockIdx.y * BN;
    A acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = (A)0;
    for (int c0 = 0; c0 < C; c0 += CB) {
        int nc = min(CB, C - c0);
        for (int e = tid; e < HH * WW * CB; e += THREADS) {  // consecutive threads: consecutive channels
            int c = e % CB, p = e / CB;
            int hh = h0 - P + p / WW, ww = w0 - P + p % WW;
            A v = (A)0;
            if (c < nc && hh >= 0 && hh < H && ww >= 0 && ww < W)
                v = to_acc(x[((long long)(n * H + hh) * W + ww) * ldx + c0 + c], (A)0);
            xs[p * CBP + c] = v;
        }
        for (int e = tid; e < CB * TAPS * BN; e += THREADS) {  // ws[c][tap][k]; w is R x K, r = tap C + c
            int k = e % BN, q = e / BN;
            int tap = q % TAPS, c = q / TAPS;
            A v = (A)0;
            if (c < nc && k0 + k < K) v = to_acc(w[((long long)tap * C + c0 + c) * K + k0 + k], (A)0);
            ws[e] = v;
        }
        __syncthreads();
        for (int c = 0; c < nc; ++c) {
#pragma unroll
            for (int dy = 0; dy < KS; ++dy) {
                A row[TM + KS - 1];
#pragma unroll
                for (int i = 0; i < TM + KS - 1; ++i) row[i] = xs[((ph + dy) * WW + pw + i) * CBP + c];
#pragma unroll
                for (int dx = 0; dx < KS; ++dx) {
                    A bv[TN];
                    load_row(bv, &ws[(c * TAPS + dy * KS + dx) * BN + tn * TN]);
#pragma unroll
                    for (int i = 0; i < TM; ++i)
#pragma unroll
                        for (int j = 0; j < TN; ++j) acc[i][j] += row[i + dx] * bv[j];
                }
            }
        }
        __syncthreads();
    }
    int h = h0 + ph;
    if (h >= H) return;
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        int ww = w0 + pw + i;
        if (ww >= W) continue;
        long long m = (long long)(n * H + h) * W + ww;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            int k = k0 + tn * TN + j;
            if (k < K) epilogue(acc[i][j], m, k, bias, scale, y, y_off, y_ld, y_inv_scale, relu);
        }
    }
}

#define CONV_DIRECT(NAME, T, KS, TH, TW, BN, TM, TN, CB)                                                      \
    extern "C" __global__ void __launch_bounds__(TH * (TW / TM) * (BN / TN))                                   \
    NAME(const T* x, int ldx, const T* w, const float* bias, const float* scale, T* y, const long long* y_off, \
         const int* y_ld, const float* y_inv_scale, int N, int H, int W, int C, int K, int KH, int KW, int relu) \
    {                                                                                                          \
        conv_direct<T, KS, TH, TW, BN, TM, TN, CB>(x, ldx, w, bias, scale, y, y_off, y_ld, y_inv_scale, N, H, \
                                                   W, C, K, KH, KW, relu);                                     \
    }

// name: direct<KS>_<TH>x<TW>x<BN>_<TM>x<TN>; threads TH (TW / TM) (BN / TN). Keep in step with DIRECT in engine.py.
#define CONV_DIRECT_ALL(SUFFIX, T)                                                  \
    CONV_DIRECT(conv_direct3_16x16x32_8x4_##SUFFIX, T, 3, 16, 16, 32, 8, 4, 16)     \
    CONV_DIRECT(conv_direct3_8x16x32_8x4_##SUFFIX, T, 3, 8, 16, 32, 8, 4, 16)       \
    CONV_DIRECT(conv_direct3_8x16x32_4x4_##SUFFIX, T, 3, 8, 16, 32, 4, 4, 16)       \
    CONV_DIRECT(conv_direct3_4x16x32_4x4_##SUFFIX, T, 3, 4, 16, 32, 4, 4, 16)       \
    CONV_DIRECT(conv_direct3_16x16x16_4x4_##SUFFIX, T, 3, 16, 16, 16, 4, 4, 16)     \
    CONV_DIRECT(conv_direct5_16x16x16_8x4_##SUFFIX, T, 5, 16, 16, 16, 8, 4, 8)      \
    CONV_DIRECT(conv_direct5_16x16x16_4x4_##SUFFIX, T, 5, 16, 16, 16, 4, 4, 8)      \
    CONV_DIRECT(conv_direct5_8x16x16_4x4_##SUFFIX, T, 5, 8, 16, 16, 4, 4, 8)        \
    CONV_DIRECT(conv_direct5_8x16x32_8x4_##SUFFIX, T, 5, 8, 16, 32, 8, 4, 8)

CONV_DIRECT_ALL(f32, float)
CONV_DIRECT_ALL(f16, half)
CONV_DIRECT_ALL(i8, int8)

// ------------------------------------------------------------ epilogue of 8 channels at once (1d, 1e, 1f)
// 8 consecutive channels k .. k + 7 of output pixel m from their accumulators: one 16-byte (half) or 8-byte
// (int8) store when they are contiguous and aligned in the destination, else one at a time.
__device__ __forceinline__ void store8(half* p, const float (&v)[8], const float*, int)
{
    __align__(16) half h[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) h[j] = __float2half_rn(v[j]);
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(h);
}
__device__ __forceinline__ void store8(int8* p, const float (&v)[8], const float* inv, int k)
{
    __align__(8) int8 q[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) q[j] = (int8)max(-127, min(127, __float2int_rn(v[j] * inv[k + j])));
    *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(q);
}
__device__ __forceinline__ void store8(float* p, const float (&v)[8], const float*, int)
{
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// res: the residual's element (m, k) (its next 7 follow it), or null; res_scale its INT8 scale (1 otherwise).
// 8 residual values in real units (zeros without a residual), in one load where it is aligned
template <typename T>
__device__ __forceinline__ void load8(float (&r)[8], const T* res, float res_scale)
{
    if (!res) {
#pragma unroll
        for (int j = 0; j < 8; ++j) r[j] = 0.0f;
        return;
    }
    __align__(16) T v[8];
    if (sizeof(T) == 2 && (size_t)res % 16 == 0)
        *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(res);
    else if (sizeof(T) == 1 && (size_t)res % 8 == 0)
        *reinterpret_cast<uint2*>(v) = *reinterpret_cast<const uint2*>(res);
    else
        for (int j = 0; j < 8; ++j) v[j] = res[j];
#pragma unroll
    for (int j = 0; j < 8; ++j) r[j] = to_f(v[j]) * res_scale;
}

template <typename T, typename A>
__device__ __forceinline__ void epilogue8(const A* acc, long long m, int k, int K, const float* bias,
                                          const float* scale, T* y, const long long* y_off, const int* y_ld,
                                          const float* y_inv_scale, int relu, const T* res = nullptr,
                                          float res_scale = 1.0f)
{
    long long at = y_off[k] + m * (long long)y_ld[k];
    bool vec = k + 8 <= K && y_ld[k + 7] == y_ld[k] && y_off[k + 7] == y_off[k] + 7 && at % 8 == 0 &&
               (sizeof(T) != 1 || y_inv_scale);
    if (!vec) {
        for (int j = 0; j < 8 && k + j < K; ++j)
            epilogue(acc[j], m, k + j, bias, scale, y, y_off, y_ld, y_inv_scale, relu,
                     res ? to_f(res[j]) * res_scale : 0.0f);
        return;
    }
    float v[8], r[8];
    load8(r, res, res_scale);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        v[j] = (float)acc[j];
        if (scale) v[j] *= scale[k + j];
        if (bias) v[j] += bias[k + j];
        v[j] += r[j];
        if (relu) v[j] = fmaxf(v[j], 0.0f);
    }
    store8(y + at, v, y_inv_scale, k);
}

// ------------------------------------------------- 1b, 1c, 1d, 1f: the convolutions on the tensor cores
#include "inference_engine_tensor_cores.cuh"

// ------------------------------------- 1e. one output pixel a thread, for a short reduction (the stem: C = 1)
// With R = KH KW C of 9, an implicit GEMM wastes most of each 16- or 32-deep step. Here a thread computes BN
// channels of one pixel: R input values (its im2col row) times the R x BN weights, which the block keeps in
// shared memory (every thread reads the same weight at once: a broadcast). Needs R <= PIX_R.
#define PIX_R 64
template <typename T, int BN>
__device__ void conv_pix(const T* x, int ldx, const T* w, const float* bias, const float* scale, T* y,
                         const long long* y_off, const int* y_ld, const float* y_inv_scale, int N, int H, int W,
                         int C, int K, int KH, int KW, int relu)
{
    typedef typename Acc<T>::type A;
    __shared__ A ws[PIX_R][BN];
    int M = N * H * W, R = KH * KW * C, k0 = blockIdx.y * BN;
    for (int e = threadIdx.x; e < R * BN; e += blockDim.x) {
        int r = e / BN, k = k0 + e % BN;
        ws[r][e % BN] = k < K ? to_acc(w[(long long)r * K + k], (A)0) : (A)0;
    }
    __syncthreads();
    int m = blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= M) return;
    Pixel p = pixel(m, M, H, W);
    A acc[BN];
#pragma unroll
    for (int j = 0; j < BN; ++j) acc[j] = (A)0;
    for (int r = 0; r < R; ++r) {
        A v = to_acc(im2col(x, ldx, p, tap(r, R, C, KH, KW), H, W), (A)0);
#pragma unroll
        for (int j = 0; j < BN; ++j) acc[j] += v * ws[r][j];
    }
#pragma unroll
    for (int j = 0; j < BN; j += 8)
        if (k0 + j < K) epilogue8(acc + j, (long long)m, k0 + j, K, bias, scale, y, y_off, y_ld, y_inv_scale, relu);
}

#define CONV_PIX(SUFFIX, T, BN)                                                                                \
    extern "C" __global__ void __launch_bounds__(128)                                                          \
    conv_pix_##BN##_##SUFFIX(const T* x, int ldx, const T* w, const float* bias, const float* scale, T* y,    \
                             const long long* y_off, const int* y_ld, const float* y_inv_scale, int N, int H,  \
                             int W, int C, int K, int KH, int KW, int relu)                                    \
    {                                                                                                          \
        conv_pix<T, BN>(x, ldx, w, bias, scale, y, y_off, y_ld, y_inv_scale, N, H, W, C, K, KH, KW, relu);     \
    }
CONV_PIX(f32, float, 32)
CONV_PIX(f16, half, 32)
CONV_PIX(i8, int8, 32)
CONV_PIX(f32, float, 16)
CONV_PIX(f16, half, 16)
CONV_PIX(i8, int8, 16)

// ------------------------------------------------------------------------------ 2. the other fused kernels

// Max over a P x P window, stride 1, "same" padding (the window clipped at the edges); the INT8 scale of the
// output is the input's, so max works on the stored integers. One thread per pixel and V channels, V = 16 bytes'
// worth of T when the channels and pixel strides allow it (vector_width in kernels/inference_engine/executor.py says
// the same), else 1. 32-bit indices (the plan refuses tensors of 2^31 elements): 64-bit division is slow.
template <typename T, int V>
__device__ __forceinline__ void maxpool_v(const T* x, int ldx, T* y, int ldy, int N, int H, int W, int C, int P)
{
    int groups = C / V, work = N * H * W * groups;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < work; e += gridDim.x * blockDim.x) {
        int c = (e % groups) * V, m = e / groups;
        int w = m % W, h = (m / W) % H;
        float best[V];
#pragma unroll
        for (int j = 0; j < V; ++j) best[j] = -3.0e38f;
        for (int dy = -(P / 2); dy <= P / 2; ++dy) {
            int hh = h + dy;
            if (hh < 0 || hh >= H) continue;
            for (int dx = -(P / 2); dx <= P / 2; ++dx) {
                int ww = w + dx;
                if (ww < 0 || ww >= W) continue;
                const T* src = x + (m + dy * W + dx) * ldx + c;
                __align__(16) T v[V];
                if constexpr (V * sizeof(T) == 16) *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(src);
                else v[0] = *src;
#pragma unroll
                for (int j = 0; j < V; ++j) best[j] = fmaxf(best[j], to_f(v[j]));
            }
        }
        __align__(16) T out[V];
#pragma unroll
        for (int j = 0; j < V; ++j) store(out + j, best[j], 1.0f);  // exact: each best is a stored value
        if constexpr (V * sizeof(T) == 16) *reinterpret_cast<uint4*>(y + m * ldy + c) = *reinterpret_cast<uint4*>(out);
        else y[m * ldy + c] = out[0];
    }
}

template <typename T>
__device__ void maxpool(const T* x, int ldx, T* y, int ldy, int N, int H, int W, int C, int P)
{
    constexpr int V = 16 / sizeof(T);
    if (C % V == 0 && ldx % V == 0 && ldy % V == 0 && (size_t)x % 16 == 0 && (size_t)y % 16 == 0)
        maxpool_v<T, V>(x, ldx, y, ldy, N, H, W, C, P);
    else
        maxpool_v<T, 1>(x, ldx, y, ldy, N, H, W, C, P);
}

// Average pool P x P (stride P) + flatten (h, w, c) + dense D -> O, one block per image: the pooled vector
// goes to shared memory (V channels of a pixel per load where the strides allow, as maxpool), then each
// thread multiplies its share of it by the rows of the dense weights it needs (D x O: row d is O contiguous
// floats) into O partial sums, which the block adds up. x_scale dequantises INT8 (1 otherwise).
#define HEAD_O 16  // outputs kept in registers; a wider layer takes HEAD_CHUNK outputs a block instead
#define HEAD_CHUNK 64
template <typename T, int V>
__device__ __forceinline__ void head_pool(const T* img, int ldx, int H, int W, int C, int P, float x_scale,
                                          float* pooled)
{
    int Hp = H / P, Wp = W / P, groups = C / V;
    for (int d = threadIdx.x; d < Hp * Wp * groups; d += blockDim.x) {
        int c = (d % groups) * V, t = d / groups, wp = t % Wp, hp = t / Wp;
        float s[V];
#pragma unroll
        for (int j = 0; j < V; ++j) s[j] = 0.0f;
        for (int i = 0; i < P; ++i)
            for (int j = 0; j < P; ++j) {
                const T* src = img + ((hp * P + i) * W + wp * P + j) * ldx + c;
                __align__(16) T v[V];
                if constexpr (V * sizeof(T) == 16) *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(src);
                else v[0] = *src;
#pragma unroll
                for (int q = 0; q < V; ++q) s[q] += to_f(v[q]);
            }
#pragma unroll
        for (int q = 0; q < V; ++q) pooled[t * C + c + q] = s[q] * x_scale / (P * P);
    }
}

template <typename T>
__device__ void head(const T* x, int ldx, int H, int W, int C, int P, float x_scale, const float* wd,
                     const float* bd, float* out, int O)
{
    extern __shared__ float pooled[];
    __shared__ float red[HEAD_O][32];
    constexpr int V = 16 / sizeof(T);
    int n = blockIdx.x, D = (H / P) * (W / P) * C;
    const T* img = x + (long long)n * H * W * ldx;
    if (C % V == 0 && ldx % V == 0 && (size_t)img % 16 == 0)
        head_pool<T, V>(img, ldx, H, W, C, P, x_scale, pooled);
    else
        head_pool<T, 1>(img, ldx, H, W, C, P, x_scale, pooled);
    __syncthreads();
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    if (O > HEAD_O) {
        // a wide layer (ResNet's 2048 -> 1000): block (n, j) computes outputs HEAD_CHUNK j .. HEAD_CHUNK (j + 1) - 1,
        // thread t output o = t % HEAD_CHUNK over a quarter of D; a warp reads 32 consecutive weights of a row
        __shared__ float part[256 / HEAD_CHUNK][HEAD_CHUNK];
        int o = blockIdx.y * HEAD_CHUNK + threadIdx.x % HEAD_CHUNK, q = threadIdx.x / HEAD_CHUNK;
        int parts = blockDim.x / HEAD_CHUNK;
        float s = 0.0f;
        if (o < O)
            for (int d = q; d < D; d += parts) s += pooled[d] * wd[(long long)d * O + o];
        part[q][threadIdx.x % HEAD_CHUNK] = s;
        __syncthreads();
        if (q == 0 && o < O) {
            for (int j = 1; j < parts; ++j) s += part[j][threadIdx.x];
            out[(long long)n * O + o] = s + bd[o];
        }
        return;
    }
    float part[HEAD_O];
#pragma unroll
    for (int o = 0; o < HEAD_O; ++o) part[o] = 0.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float p = pooled[d];
        const float* row = wd + (long long)d * O;
#pragma unroll
        for (int o = 0; o < HEAD_O; ++o)
            if (o < O) part[o] += p * row[o];
    }
#pragma unroll
    for (int o = 0; o < HEAD_O; ++o) {
        float s = part[o];
        for (int off = 16; off > 0; off /= 2) s += __shfl_down_sync(0xffffffffu, s, off);
        if (lane == 0) red[o][warp] = s;
    }
    __syncthreads();
    if (threadIdx.x < O) {
        float s = 0.0f;
        for (int w = 0; w < warps; ++w) s += red[threadIdx.x][w];
        out[(long long)n * O + threadIdx.x] = s + bd[threadIdx.x];
    }
}

// The network's float input (M pixels x C) into the arena's type (INT8: quantised with the input's scale), ldy
// channels a pixel: channels C .. ldy - 1 are zeros (the stem's 3 channels padded to a whole 16-byte load).
template <typename T>
__device__ void convert_in(const float* x, long long M, int C, T* y, int ldy, float inv_scale)
{
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= M * ldy) return;
    long long m = e / ldy;
    int c = (int)(e % ldy);
    store(y + e, c < C ? x[m * C + c] : 0.0f, inv_scale);
}

// The network's float input (N x H x W x C) as the stem's im2col matrix (N P Q x R, R = KH KW C rounded up to a
// multiple of 8, zeros past the KH KW C taps and outside the image): what a stem of 3 channels reads as a 1 x 1
// convolution. One thread per 8 consecutive elements of a row (one 16-byte store of half). The indices are
// decomposed once a thread, in 32 bits (the plan refuses tensors of 2^31 elements), and then stepped: integer
// division by a value known only at run time costs tens of instructions, and 8 elements a thread each dividing
// by C and KW made this step compute-bound at several times its memory floor.
template <typename T>
__device__ void convert_in_im2col(const float* x, int N, int H, int W, int C, int KW, int stride, int pad_t,
                                  int pad_l, int P, int Q, int R, int taps, T* y, float inv_scale)
{
    const unsigned groups = R / 8, g = blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (unsigned)N * P * Q * groups) return;
    const unsigned m = g / groups, r0 = (g - m * groups) * 8, pq = m / Q, q = m - pq * Q, n = pq / P, p = pq - n * P;
    int tap = r0 / C, c = r0 - tap * C, dy = tap / KW, dx = tap - dy * KW;
    const int h0 = p * stride - pad_t, w0 = q * stride - pad_l;
    const float* xn = x + (size_t)n * H * W * C;
    __align__(16) T v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int hh = h0 + dy, ww = w0 + dx;
        const float f = (int)r0 + j < taps && hh >= 0 && hh < H && ww >= 0 && ww < W ? xn[(hh * W + ww) * C + c] : 0.0f;
        store(v + j, f, inv_scale);
        if (++c == C) {  // the next tap: the next column of the window, or the first of its next row
            c = 0;
            if (++dx == KW) {
                dx = 0;
                ++dy;
            }
        }
    }
    T* out = y + (size_t)g * 8;
    if constexpr (sizeof(T) == 2) *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(v);
    else if constexpr (sizeof(T) == 1) *reinterpret_cast<uint2*>(out) = *reinterpret_cast<const uint2*>(v);
    else for (int j = 0; j < 8; ++j) out[j] = v[j];
}

// Max over a P x P window, ``stride`` apart, of the input padded with zeros (pad_t rows above, pad_l columns to
// the left, as Keras' ZeroPadding2D before a "valid" pool: ResNet-50's pool1): N x Ho x Wo x C. One thread per
// output pixel and V channels, as maxpool_v.
template <typename T, int V>
__device__ __forceinline__ void maxpool_pad_v(const T* x, int ldx, T* y, int ldy, int N, int H, int W, int C,
                                              int P, int stride, int pad_t, int pad_l, int Ho, int Wo)
{
    int groups = C / V, work = N * Ho * Wo * groups;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < work; e += gridDim.x * blockDim.x) {
        int c = (e % groups) * V, m = e / groups;
        int wo = m % Wo, ho = (m / Wo) % Ho, n = m / (Wo * Ho);
        float best[V];
#pragma unroll
        for (int j = 0; j < V; ++j) best[j] = -3.0e38f;
        for (int dy = 0; dy < P; ++dy)
            for (int dx = 0; dx < P; ++dx) {
                int hh = ho * stride - pad_t + dy, ww = wo * stride - pad_l + dx;
                __align__(16) T v[V];
                if (hh < 0 || hh >= H || ww < 0 || ww >= W) {
#pragma unroll
                    for (int j = 0; j < V; ++j) v[j] = (T)0;  // the padding's zeros take part in the max
                } else {
                    const T* src = x + ((long long)(n * H + hh) * W + ww) * ldx + c;
                    if constexpr (V * sizeof(T) == 16) *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(src);
                    else v[0] = *src;
                }
#pragma unroll
                for (int j = 0; j < V; ++j) best[j] = fmaxf(best[j], to_f(v[j]));
            }
        __align__(16) T out[V];
#pragma unroll
        for (int j = 0; j < V; ++j) store(out + j, best[j], 1.0f);
        if constexpr (V * sizeof(T) == 16) *reinterpret_cast<uint4*>(y + (long long)m * ldy + c) = *reinterpret_cast<uint4*>(out);
        else y[(long long)m * ldy + c] = out[0];
    }
}

template <typename T>
__device__ void maxpool_pad(const T* x, int ldx, T* y, int ldy, int N, int H, int W, int C, int P, int stride,
                            int pad_t, int pad_l, int Ho, int Wo)
{
    constexpr int V = 16 / sizeof(T);
    if (C % V == 0 && ldx % V == 0 && ldy % V == 0 && (size_t)x % 16 == 0 && (size_t)y % 16 == 0)
        maxpool_pad_v<T, V>(x, ldx, y, ldy, N, H, W, C, P, stride, pad_t, pad_l, Ho, Wo);
    else
        maxpool_pad_v<T, 1>(x, ldx, y, ldy, N, H, W, C, P, stride, pad_t, pad_l, Ho, Wo);
}

// A wide classifier after a global pool (ResNet-50's 2048 -> 1000), in two kernels. global_pool: the mean of each
// image's HW pixels, channel by channel, in float (x_scale dequantises INT8): one thread per image and V channels.
template <typename T, int V>
__device__ __forceinline__ void global_pool_v(const T* x, int ldx, int HW, int C, float x_scale, float* pooled,
                                              int N)
{
    int groups = C / V;
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= N * groups) return;
    int n = e / groups, c = (e % groups) * V;
    float s[V];
#pragma unroll
    for (int j = 0; j < V; ++j) s[j] = 0.0f;
    const T* img = x + (long long)n * HW * ldx + c;
#pragma unroll 7
    for (int i = 0; i < HW; ++i) {
        __align__(16) T v[V];
        if constexpr (V * sizeof(T) == 16) *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(img + (long long)i * ldx);
        else if constexpr (V * sizeof(T) == 8) *reinterpret_cast<uint2*>(v) = *reinterpret_cast<const uint2*>(img + (long long)i * ldx);
        else v[0] = img[(long long)i * ldx];
#pragma unroll
        for (int j = 0; j < V; ++j) s[j] += to_f(v[j]);
    }
#pragma unroll
    for (int j = 0; j < V; ++j) pooled[(long long)n * C + c + j] = s[j] * x_scale / HW;
}

template <typename T>
__device__ void global_pool(const T* x, int ldx, int HW, int C, float x_scale, float* pooled, int N)
{
    // 16 bytes a load in FP16; 8 in the 8-bit types, so that they have as many threads (ResNet-50 at batch 64: 16
    // channels a thread left 8192 threads, each 49 loads in turn, and the pool took twice FP16's time)
    constexpr int V = sizeof(T) == 1 ? 8 : 16 / sizeof(T);
    if (C % V == 0 && ldx % V == 0 && (size_t)x % 16 == 0)
        global_pool_v<T, V>(x, ldx, HW, C, x_scale, pooled, N);
    else
        global_pool_v<T, 1>(x, ldx, HW, C, x_scale, pooled, N);
}

// classifier: out (N x O) = pooled (N x D, float) wd (D x O) + bd. Block (j, i): outputs 32 j .. 32 j + 31 (a lane
// each) of images 8 i .. 8 i + 7; its 8 warps split D, so each weight is read once per block and used for 8 images
// (kept in registers), the pooled values broadcast from shared memory; the warps' partial sums meet in shared memory.
#define CLS_IMAGES 8
extern "C" __global__ void __launch_bounds__(256) classifier(const float* pooled, int N, int D, const float* wd,
                                                             const float* bd, float* out, int O)
{
    extern __shared__ float xs[];  // CLS_IMAGES x D
    __shared__ float red[8][CLS_IMAGES][32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int o = blockIdx.x * 32 + lane, i0 = blockIdx.y * CLS_IMAGES, ni = min(CLS_IMAGES, N - i0);
    for (int e = threadIdx.x; e < ni * D; e += blockDim.x) xs[e] = pooled[(long long)i0 * D + e];
    __syncthreads();
    float s[CLS_IMAGES];
#pragma unroll
    for (int i = 0; i < CLS_IMAGES; ++i) s[i] = 0.0f;
    int per = (D + 7) / 8, d0 = warp * per, d1 = min(D, d0 + per);
    // unrolled: 8 weights of the loop in flight at once (one at a time, each load waited out its L2 latency and the
    // classifier, 8 MB of float weights, took 47 us at batch 64 on an H200)
    if (o < O)
#pragma unroll 8
        for (int d = d0; d < d1; ++d) {
            float w = wd[(long long)d * O + o];
#pragma unroll
            for (int i = 0; i < CLS_IMAGES; ++i)
                if (i < ni) s[i] += xs[i * D + d] * w;
        }
#pragma unroll
    for (int i = 0; i < CLS_IMAGES; ++i) red[warp][i][lane] = s[i];
    __syncthreads();
    if (warp < ni && o < O) {  // warp i adds up image i's sums
        float t = bd[o];
        for (int w = 0; w < 8; ++w) t += red[w][warp][lane];
        out[(long long)(i0 + warp) * O + o] = t;
    }
}

// Softmax of each row of the logits (N x O, float) into out: one block per row (the classifier's probabilities).
extern "C" __global__ void softmax_rows(const float* logits, float* out, int O)
{
    __shared__ float red[32];
    const float* row = logits + (long long)blockIdx.x * O;
    float* prob = out + (long long)blockIdx.x * O;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    auto reduce = [&](float v, bool is_max) {
        for (int off = 16; off > 0; off /= 2) {
            float o = __shfl_xor_sync(0xffffffffu, v, off);
            v = is_max ? fmaxf(v, o) : v + o;
        }
        if (lane == 0) red[warp] = v;
        __syncthreads();
        v = red[0];
        for (int w = 1; w < warps; ++w) v = is_max ? fmaxf(v, red[w]) : v + red[w];
        __syncthreads();
        return v;
    };
    float mx = -3.0e38f;
    for (int o = threadIdx.x; o < O; o += blockDim.x) mx = fmaxf(mx, row[o]);
    mx = reduce(mx, true);
    float sum = 0.0f;
    for (int o = threadIdx.x; o < O; o += blockDim.x) sum += __expf(row[o] - mx);
    sum = reduce(sum, false);
    for (int o = threadIdx.x; o < O; o += blockDim.x) prob[o] = __expf(row[o] - mx) / sum;
}

// ------------------------------------------------------------------ 3. the layer-by-layer engine's kernels
// Each works on a whole tensor of M pixels x C channels, contiguous (ld = C), in place where it can.

template <typename T>
__device__ void bias_add(T* y, long long M, int C, const float* b)
{
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e < M * C) store(y + e, to_f(y[e]) + b[e % C], 1.0f);
}

template <typename T>
__device__ void batchnorm(T* y, long long M, int C, const float* gamma, const float* beta, const float* mean,
                          const float* var, float eps)
{
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= M * C) return;
    int c = (int)(e % C);
    store(y + e, (to_f(y[e]) - mean[c]) * rsqrtf(var[c] + eps) * gamma[c] + beta[c], 1.0f);
}

template <typename T>
__device__ void relu(T* y, long long n)
{
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e < n) store(y + e, fmaxf(to_f(y[e]), 0.0f), 1.0f);
}

// dst (pre-offset to its first channel, pixel stride ldd) <- src (M x Cs, contiguous)
template <typename T>
__device__ void concat_copy(const T* src, long long M, int Cs, T* dst, int ldd)
{
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e < M * Cs) dst[(e / Cs) * ldd + e % Cs] = src[e];
}

// N x H x W x C -> N x H/P x W/P x C, average of each P x P window
template <typename T>
__device__ void avgpool(const T* x, int N, int H, int W, int C, int P, T* y)
{
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int Hp = H / P, Wp = W / P;
    if (e >= (long long)N * Hp * Wp * C) return;
    int c = (int)(e % C);
    long long t = e / C;
    int wp = (int)(t % Wp), hp = (int)((t / Wp) % Hp);
    long long n = t / ((long long)Hp * Wp);
    float s = 0.0f;
    for (int i = 0; i < P; ++i)
        for (int j = 0; j < P; ++j) s += to_f(x[((n * H + hp * P + i) * W + wp * P + j) * C + c]);
    store(y + e, s / (P * P), 1.0f);
}

// out (N x O, float) = x (N x D) wd (D x O) + bd, one thread per output
template <typename T>
__device__ void dense(const T* x, int N, int D, const float* wd, const float* bd, float* out, int O)
{
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (long long)N * O) return;
    long long n = e / O;
    int o = (int)(e % O);
    float s = 0.0f;
    for (int d = 0; d < D; ++d) s += to_f(x[n * D + d]) * wd[(long long)d * O + o];
    out[e] = s + bd[o];
}

#define ENGINE_KERNELS(SUFFIX, T)                                                                              \
    extern "C" __global__ void maxpool_##SUFFIX(const T* x, int ldx, T* y, int ldy, int N, int H, int W,       \
                                                int C, int P)                                                  \
    { maxpool<T>(x, ldx, y, ldy, N, H, W, C, P); }                                                             \
    extern "C" __global__ void head_##SUFFIX(const T* x, int ldx, int H, int W, int C, int P, float x_scale,  \
                                             const float* wd, const float* bd, float* out, int O)             \
    { head<T>(x, ldx, H, W, C, P, x_scale, wd, bd, out, O); }                                                  \
    extern "C" __global__ void convert_in_##SUFFIX(const float* x, long long M, int C, T* y, int ldy,         \
                                                   float inv_scale)                                            \
    { convert_in<T>(x, M, C, y, ldy, inv_scale); }                                                             \
    extern "C" __global__ void maxpool_pad_##SUFFIX(const T* x, int ldx, T* y, int ldy, int N, int H, int W,   \
                                                    int C, int P, int stride, int pad_t, int pad_l, int Ho,    \
                                                    int Wo)                                                    \
    { maxpool_pad<T>(x, ldx, y, ldy, N, H, W, C, P, stride, pad_t, pad_l, Ho, Wo); }                           \
    extern "C" __global__ void bias_add_##SUFFIX(T* y, long long M, int C, const float* b)                   \
    { bias_add<T>(y, M, C, b); }                                                                               \
    extern "C" __global__ void batchnorm_##SUFFIX(T* y, long long M, int C, const float* gamma,               \
                                                  const float* beta, const float* mean, const float* var,     \
                                                  float eps)                                                   \
    { batchnorm<T>(y, M, C, gamma, beta, mean, var, eps); }                                                    \
    extern "C" __global__ void relu_##SUFFIX(T* y, long long n) { relu<T>(y, n); }                            \
    extern "C" __global__ void convert_in_im2col_##SUFFIX(const float* x, int N, int H, int W, int C, int KW,  \
                                                          int stride, int pad_t, int pad_l, int P, int Q, int R, \
                                                          int taps, T* y, float inv_scale)                   \
    { convert_in_im2col<T>(x, N, H, W, C, KW, stride, pad_t, pad_l, P, Q, R, taps, y, inv_scale); }            \
    extern "C" __global__ void global_pool_##SUFFIX(const T* x, int ldx, int HW, int C, float x_scale,         \
                                                    float* pooled, int N)                                      \
    { global_pool<T>(x, ldx, HW, C, x_scale, pooled, N); }                                                     \
    extern "C" __global__ void concat_copy_##SUFFIX(const T* src, long long M, int Cs, T* dst, int ldd)       \
    { concat_copy<T>(src, M, Cs, dst, ldd); }                                                                  \
    extern "C" __global__ void avgpool_##SUFFIX(const T* x, int N, int H, int W, int C, int P, T* y)          \
    { avgpool<T>(x, N, H, W, C, P, y); }                                                                       \
    extern "C" __global__ void dense_##SUFFIX(const T* x, int N, int D, const float* wd, const float* bd,     \
                                              float* out, int O)                                               \
    { dense<T>(x, N, D, wd, bd, out, O); }

ENGINE_KERNELS(f32, float)
ENGINE_KERNELS(f16, half)
ENGINE_KERNELS(i8, int8)
ENGINE_KERNELS(f8, fp8)  // FP8 plans: their convolutions are Hopper's (inference_engine_wgmma.cu), the rest these

// region: reformat
// A mixed plan (build_plan's keep_fp16: some layers of an INT8 or FP8 plan kept in FP16, as TensorRT's per-layer
// precision) stores each activation in the precision of the layer that writes it; a reader of another precision
// reads a copy this kernel writes first: FP16 -> INT8 / FP8 quantised with the tensor's calibrated scale (store's
// 1 / scale), INT8 / FP8 -> FP16 dequantised (x scale). M pixels of C channels, from x (pixel stride ldx) to y (ldy);
// V = 8: a thread's 8 channels in one load and one store (C, both strides and both first elements multiples of 8).
template <int BYTES> struct Chunk;
template <> struct Chunk<8> { typedef uint2 type; };
template <> struct Chunk<16> { typedef uint4 type; };

template <typename Ti, typename To, int V>
__device__ void reformat(const Ti* x, int ldx, To* y, int ldy, long long M, int C, float scale, float inv_scale)
{
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // V channels of one pixel
    int per = C / V;
    if (e >= M * per) return;
    long long m = e / per;
    int c = (int)(e % per) * V;
    const Ti* src = x + m * ldx + c;
    To* dst = y + m * ldy + c;
    if (V == 1) {
        store(dst, to_f(*src) * scale, inv_scale);
        return;
    }
    __align__(16) Ti in[8];
    __align__(16) To out[8];
    typedef typename Chunk<8 * sizeof(Ti)>::type In8;
    typedef typename Chunk<8 * sizeof(To)>::type Out8;
    *reinterpret_cast<In8*>(in) = *reinterpret_cast<const In8*>(src);
#pragma unroll
    for (int j = 0; j < 8; ++j) store(out + j, to_f(in[j]) * scale, inv_scale);
    *reinterpret_cast<Out8*>(dst) = *reinterpret_cast<const Out8*>(out);
}
// endregion

#define REFORMAT(FROM, TI, TO, TT)                                                                             \
    extern "C" __global__ void reformat_##FROM##_##TO(const TI* x, int ldx, TT* y, int ldy, long long M,      \
                                                      int C, float scale, float inv_scale)                     \
    { reformat<TI, TT, 1>(x, ldx, y, ldy, M, C, scale, inv_scale); }                                           \
    extern "C" __global__ void reformat8_##FROM##_##TO(const TI* x, int ldx, TT* y, int ldy, long long M,     \
                                                       int C, float scale, float inv_scale)                    \
    { reformat<TI, TT, 8>(x, ldx, y, ldy, M, C, scale, inv_scale); }

REFORMAT(i8, int8, f16, half)
REFORMAT(f16, half, i8, int8)
REFORMAT(f8, fp8, f16, half)
REFORMAT(f16, half, f8, fp8)

// ResNet-50's stem (convolution 7 x 7 / 2, ReLU, max pool 3 x 3 / 2) in one kernel: stem_pool8_*, stem_pool4_*
#include "inference_engine_stem.cuh"

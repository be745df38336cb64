// Lesson 6: the engine's convolutions on the tensor cores (WMMA), in the order the lesson met them: 1b staged
// 2 bytes at a time, 1c 16 bytes at a time, 1d pipelined and in INT8 too, 1f direct for narrow images.
// Part of inference_engine.cu, which includes it after the helpers these kernels share (pixel and tap arithmetic, the
// epilogues, cp.async).
#pragma once

// ------------------------------------------------------------------- 1b. tensor cores (WMMA), half only
// A block of 4 warps (WARPS_M x WARPS_N) computes BM pixels x BN channels; each warp FM x FN fragments of
// 16 x 16 with FP32 accumulators. Per step of 16 along the reduction the block stages BM x 16 of the im2col
// matrix and 16 x BN of the weights in shared memory (zeros past the edges); thread t loads reduction index
// t % 16 for BM / 8 pixels. The accumulators then go through shared memory to the same epilogue as the SIMT
// kernels.
template <int WARPS_M, int WARPS_N, int FM, int FN>
__device__ void conv_wmma(const half* x, int ldx, const half* w, const float* bias, const float* scale, half* y,
                          const long long* y_off, const int* y_ld, const float* y_inv_scale, int N, int H, int W,
                          int C, int K, int KH, int KW, int relu)
{
    const int BM = WARPS_M * FM * 16, BN = WARPS_N * FN * 16, THREADS = 128, PIX = BM * 16 / THREADS;
    __shared__ __align__(32) half xs[BM][24];       // [pixel][r]: row-major matrix_a, ldm 24 (a multiple of 8)
    __shared__ __align__(32) half ws[16][BN + 8];   // [r][channel]: row-major matrix_b
    __shared__ __align__(32) float cs[BM][BN + 4];
    int tid = threadIdx.x, warp = tid / 32;
    int wm = warp / WARPS_N, wn = warp % WARPS_N;
    int M = N * H * W, R = KH * KW * C;
    int m0 = blockIdx.x * BM, k0 = blockIdx.y * BN;
    int rr = tid % 16;
    Pixel px[PIX];
#pragma unroll
    for (int j = 0; j < PIX; ++j) px[j] = pixel(m0 + tid / 16 + j * (THREADS / 16), M, H, W);
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FM][FN];
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
    wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> a[FM];
    wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::row_major> b[FN];
    for (int r0 = 0; r0 < R; r0 += 16) {
        Tap t = tap(r0 + rr, R, C, KH, KW);
#pragma unroll
        for (int j = 0; j < PIX; ++j) xs[tid / 16 + j * (THREADS / 16)][rr] = im2col(x, ldx, px[j], t, H, W);
        for (int e = tid; e < 16 * BN; e += THREADS) {
            int r = r0 + e / BN, k = k0 + e % BN;
            ws[e / BN][e % BN] = (r < R && k < K) ? w[(long long)r * K + k] : __float2half(0.0f);
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < FM; ++i) wmma::load_matrix_sync(a[i], &xs[(wm * FM + i) * 16][0], 24);
#pragma unroll
        for (int j = 0; j < FN; ++j) wmma::load_matrix_sync(b[j], &ws[0][(wn * FN + j) * 16], BN + 8);
#pragma unroll
        for (int i = 0; i < FM; ++i)
#pragma unroll
            for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j)
            wmma::store_matrix_sync(&cs[(wm * FM + i) * 16][(wn * FN + j) * 16], acc[i][j], BN + 4,
                                    wmma::mem_row_major);
    __syncthreads();
    for (int e = tid; e < BM * BN; e += THREADS) {
        int mm = e / BN, kk = e % BN;
        int m = m0 + mm, k = k0 + kk;
        if (m < M && k < K) epilogue(cs[mm][kk], (long long)m, k, bias, scale, y, y_off, y_ld, y_inv_scale, relu);
    }
}

#define CONV_WMMA(NAME, WARPS_M, WARPS_N, FM, FN)                                                              \
    extern "C" __global__ void __launch_bounds__(128)                                                          \
    NAME(const half* x, int ldx, const half* w, const float* bias, const float* scale, half* y,               \
         const long long* y_off, const int* y_ld, const float* y_inv_scale, int N, int H, int W, int C, int K,  \
         int KH, int KW, int relu)                                                                             \
    {                                                                                                          \
        conv_wmma<WARPS_M, WARPS_N, FM, FN>(x, ldx, w, bias, scale, y, y_off, y_ld, y_inv_scale, N, H, W, C, K, \
                                            KH, KW, relu);                                                     \
    }

CONV_WMMA(conv_wmma_64x64_f16, 2, 2, 2, 2)
CONV_WMMA(conv_wmma_64x32_f16, 4, 1, 1, 2)
CONV_WMMA(conv_wmma_128x32_f16, 4, 1, 2, 2)

// ------------------------------------------------------- 1c. tensor cores, fed 16 bytes at a time (half only)
// The same tiles as 1b, with the loads that starve it fixed. When C, the input's pixel stride and its first
// channel are multiples of 8 (the engine checks, see kernel_fits in engine.py), 8 consecutive reduction
// indices are 8 consecutive channels of one input pixel: one 16-byte load (uint4) instead of eight 2-byte
// ones, and the edge test is made once for the 8. A step covers 32 of the reduction (two mma per fragment
// pair between barriers, half as many barriers), and the weights come in 16 bytes at a time too.
template <int WARPS_M, int WARPS_N, int FM, int FN>
__device__ void conv_wmma_vec(const half* x, int ldx, const half* w, const float* bias, const float* scale,
                              half* y, const long long* y_off, const int* y_ld, const float* y_inv_scale, int N,
                              int H, int W, int C, int K, int KH, int KW, int relu)
{
    const int BM = WARPS_M * FM * 16, BN = WARPS_N * FN * 16, BK = 32, THREADS = 128;
    __shared__ __align__(32) half xs[BM][BK + 8];   // [pixel][r], ldm 40
    __shared__ __align__(32) half ws[BK][BN + 8];   // [r][channel], ldm BN + 8
    __shared__ __align__(32) float cs[BM][BN + 4];
    int tid = threadIdx.x, warp = tid / 32;
    int wm = warp / WARPS_N, wn = warp % WARPS_N;
    int M = N * H * W, R = KH * KW * C;
    int m0 = blockIdx.x * BM, k0 = blockIdx.y * BN;
    bool k_vec = (K % 8) == 0;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FM][FN];
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
    wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> a[FM];
    wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::row_major> b[FN];
    for (int r0 = 0; r0 < R; r0 += BK) {
        for (int e = tid; e < BM * (BK / 8); e += THREADS) {  // im2col tile: BM pixels x 4 chunks of 8
            int mm = e / (BK / 8), q = e % (BK / 8);
            Pixel p = pixel(m0 + mm, M, H, W);
            Tap t = tap(r0 + q * 8, R, C, KH, KW);
            int hh = p.h + t.dy, ww = p.w + t.dx;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (p.valid && t.valid && hh >= 0 && hh < H && ww >= 0 && ww < W)
                v = *reinterpret_cast<const uint4*>(x + (long long)(p.base + t.dy * W + t.dx) * ldx + t.c);
            *reinterpret_cast<uint4*>(&xs[mm][q * 8]) = v;
        }
        for (int e = tid; e < BK * (BN / 8); e += THREADS) {  // weights: BK rows x BN / 8 chunks of 8
            int rr = e / (BN / 8), kk = (e % (BN / 8)) * 8;
            int r = r0 + rr, k = k0 + kk;
            if (k_vec && r < R && k + 8 <= K) {
                *reinterpret_cast<uint4*>(&ws[rr][kk]) = *reinterpret_cast<const uint4*>(w + (long long)r * K + k);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    ws[rr][kk + j] = (r < R && k + j < K) ? w[(long long)r * K + k + j] : __float2half(0.0f);
            }
        }
        __syncthreads();
#pragma unroll
        for (int s = 0; s < BK; s += 16) {
#pragma unroll
            for (int i = 0; i < FM; ++i) wmma::load_matrix_sync(a[i], &xs[(wm * FM + i) * 16][s], BK + 8);
#pragma unroll
            for (int j = 0; j < FN; ++j) wmma::load_matrix_sync(b[j], &ws[s][(wn * FN + j) * 16], BN + 8);
#pragma unroll
            for (int i = 0; i < FM; ++i)
#pragma unroll
                for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j)
            wmma::store_matrix_sync(&cs[(wm * FM + i) * 16][(wn * FN + j) * 16], acc[i][j], BN + 4,
                                    wmma::mem_row_major);
    __syncthreads();
    for (int e = tid; e < BM * BN; e += THREADS) {
        int mm = e / BN, kk = e % BN;
        int m = m0 + mm, k = k0 + kk;
        if (m < M && k < K) epilogue(cs[mm][kk], (long long)m, k, bias, scale, y, y_off, y_ld, y_inv_scale, relu);
    }
}

#define CONV_WMMA_VEC(NAME, WARPS_M, WARPS_N, FM, FN)                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                                          \
    NAME(const half* x, int ldx, const half* w, const float* bias, const float* scale, half* y,               \
         const long long* y_off, const int* y_ld, const float* y_inv_scale, int N, int H, int W, int C, int K,  \
         int KH, int KW, int relu)                                                                             \
    {                                                                                                          \
        conv_wmma_vec<WARPS_M, WARPS_N, FM, FN>(x, ldx, w, bias, scale, y, y_off, y_ld, y_inv_scale, N, H, W, \
                                                C, K, KH, KW, relu);                                           \
    }

CONV_WMMA_VEC(conv_wmmav_64x32_f16, 4, 1, 1, 2)
CONV_WMMA_VEC(conv_wmmav_128x32_f16, 4, 1, 2, 2)
CONV_WMMA_VEC(conv_wmmav_64x16_f16, 4, 1, 1, 1)
CONV_WMMA_VEC(conv_wmmav_128x16_f16, 4, 1, 2, 1)

// ----------------------------------------- 1d. tensor cores, pipelined: half and int8 (integer tensor cores)
// What 1c still lacks, added: (1) the next tiles are copied while the tensor cores work on this one
// (cp.async into STAGES shared-memory buffers, as lesson 5's convolution does); (2) INT8 runs on the integer
// tensor cores (WMMA with signed char tiles and int32 sums: IMMA instructions), exact like the SIMT kernels;
// (3) the epilogue writes 8 channels of a pixel at once (16 bytes of half, 8 of int8) where they are
// contiguous in the destination. Each step covers 64 bytes of the reduction per pixel: 32 halves or 64 int8,
// kept in "planes" 16 values wide (one WMMA k-step each), so every fragment starts 32-byte aligned as WMMA
// requires. The weights come transposed, wt = K x R (output channel major): a 16-byte load is 16 bytes of one
// channel's reduction, and the tile is the column-major B that the integer tensor cores take as it is (their
// mma has only the row.col form; a row-major B would be transposed byte by byte on every load). Needs C, the
// input's pixel stride and first channel, and K multiples of 16 bytes' worth of T (kernels/inference_engine/tuning.py:
// kernel_fits).

template <typename T> struct Tile;  // pitch of a plane row in shared memory, in elements (a multiple of 16 bytes)
template <> struct Tile<half> { static constexpr int PITCH = 24; };  // 48 bytes: rows spread over the banks
template <> struct Tile<int8> { static constexpr int PITCH = 16; };  // 16 bytes: 8 rows fill the 32 banks

//
// These kernels also take any geometry (ResNet-50's): an output of P x Q pixels, the input read ``stride`` pixels
// apart from (-pad_t, -pad_l), zeros outside the image; and a residual tensor (res, pixel stride ldres, INT8 scale
// res_scale) added before the ReLU. The digits network's "same" convolutions pass P = H, Q = W, stride 1,
// pad KH / 2 and KW / 2, and no residual.
struct PixelG { int h, w, base; bool valid; };  // an output pixel's input origin (h, w) and its index there

__device__ __forceinline__ PixelG pixel_g(int m, int M, int P, int Q, int H, int W, int stride, int pad_t,
                                          int pad_l)
{
    PixelG p;
    p.valid = m < M;
    int q = m % Q, t = m / Q, r = t % P, n = t / P;
    p.h = r * stride - pad_t;
    p.w = q * stride - pad_l;
    p.base = (n * H + p.h) * W + p.w;  // may point before the image: only used for taps inside it
    return p;
}

template <typename T, int WARPS_M, int WARPS_N, int FM, int FN, int STAGES>
__device__ void conv_tc(const T* __restrict__ x, int ldx, const T* __restrict__ w /* K x R */, const float* bias,
                        const float* scale, T* y, const long long* y_off, const int* y_ld, const float* y_inv_scale,
                        int N, int H, int W, int C, int K, int KH, int KW, int relu, int P, int Q, int stride,
                        int pad_t, int pad_l, const T* res, int ldres, float res_scale)
{
    typedef typename Acc<T>::type A;
    constexpr int BM = WARPS_M * FM * 16, BN = WARPS_N * FN * 16, THREADS = WARPS_M * WARPS_N * 32;
    constexpr int CH = 16 / sizeof(T);         // elements in a 16-byte chunk: 8 half, 16 int8
    constexpr int BK = 64 / sizeof(T);         // reduction per step: 4 chunks of a pixel
    constexpr int NP = BK / 16, LP = Tile<T>::PITCH;
    constexpr int A_STAGE = NP * BM * LP, B_STAGE = NP * BN * LP;  // elements
    constexpr int PIPE = STAGES * (A_STAGE + B_STAGE) * sizeof(T), OUT = BM * (BN + 4) * sizeof(A);
    __shared__ __align__(128) unsigned char smem[PIPE > OUT ? PIPE : OUT];
    T* xs = reinterpret_cast<T*>(smem);                  // [STAGES][NP][BM][LP]
    T* ws = xs + STAGES * A_STAGE;                       // [STAGES][NP][BN][LP]: column-major B
    A* cs = reinterpret_cast<A*>(smem);                  // [BM][BN + 4], after the last step

    int tid = threadIdx.x, warp = tid / 32, wm = warp / WARPS_N, wn = warp % WARPS_N;
    int M = N * P * Q, R = KH * KW * C;
    int m0 = blockIdx.x * BM, k0 = blockIdx.y * BN;
    constexpr int A_CHUNKS = BM * 4 / THREADS, B_ALL = BN * 4, B_CHUNKS = (B_ALL + THREADS - 1) / THREADS;
    static_assert(BM * 4 % THREADS == 0, "the tile's rows and the threads do not divide");
    PixelG px[A_CHUNKS];  // the pixels this thread loads, the same at every step
#pragma unroll
    for (int i = 0; i < A_CHUNKS; ++i) px[i] = pixel_g(m0 + (tid + i * THREADS) / 4, M, P, Q, H, W, stride, pad_t, pad_l);

    auto load = [&](int stage, int r0) {
        T* xa = xs + stage * A_STAGE;
        T* wb = ws + stage * B_STAGE;
#pragma unroll
        for (int i = 0; i < A_CHUNKS; ++i) {
            int e = tid + i * THREADS, mm = e / 4, q = e % 4;
            Tap t = tap(r0 + q * CH, R, C, KH, KW);
            t.dy += KH / 2;  // tap() counts from the kernel's centre; here from its corner
            t.dx += KW / 2;
            int hh = px[i].h + t.dy, ww = px[i].w + t.dx;
            bool ok = px[i].valid && t.valid && hh >= 0 && hh < H && ww >= 0 && ww < W;
            const T* src = ok ? x + (long long)(px[i].base + t.dy * W + t.dx) * ldx + t.c : x;
            int col = q * CH;  // position in the step: plane col / 16, offset col % 16
            cp_async16_zfill(xa + ((col / 16) * BM + mm) * LP + col % 16, src, ok);
        }
#pragma unroll
        for (int i = 0; i < B_CHUNKS; ++i) {
            int e = tid + i * THREADS, kk = e / 4, q = e % 4;
            if (B_ALL % THREADS != 0 && e >= B_ALL) break;
            int r = r0 + q * CH, k = k0 + kk, col = q * CH;
            bool ok = r < R && k < K;
            cp_async16_zfill(wb + ((col / 16) * BN + kk) * LP + col % 16, ok ? w + (long long)k * R + r : w, ok);
        }
    };

    wmma::fragment<wmma::accumulator, 16, 16, 16, A> acc[FM][FN];
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[i][j], (A)0);
    int steps = (R + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) load(s, s * BK);
        cp_async_commit();
    }
    for (int it = 0; it < steps; ++it) {
        cp_async_wait<STAGES - 2>();  // this step's tiles have landed (this thread's copies) ...
        __syncthreads();              // ... everyone's, and everyone is done with the buffer refilled next
        int next = it + STAGES - 1;
        if (next < steps) load(next % STAGES, next * BK);
        cp_async_commit();
        const T* xa = xs + (it % STAGES) * A_STAGE;
        const T* wb = ws + (it % STAGES) * B_STAGE;
#pragma unroll
        for (int p = 0; p < NP; ++p) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a[FM];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b[FN];
#pragma unroll
            for (int i = 0; i < FM; ++i) wmma::load_matrix_sync(a[i], xa + (p * BM + (wm * FM + i) * 16) * LP, LP);
#pragma unroll
            for (int j = 0; j < FN; ++j)
                wmma::load_matrix_sync(b[j], wb + (p * BN + (wn * FN + j) * 16) * LP, LP);
#pragma unroll
            for (int i = 0; i < FM; ++i)
#pragma unroll
                for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // the pipeline's buffers become the accumulators' staging area
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j)
            wmma::store_matrix_sync(cs + (wm * FM + i) * 16 * (BN + 4) + (wn * FN + j) * 16, acc[i][j], BN + 4,
                                    wmma::mem_row_major);
    __syncthreads();
    for (int e = tid; e < BM * (BN / 8); e += THREADS) {
        int mm = e / (BN / 8), kk = (e % (BN / 8)) * 8;
        int m = m0 + mm, k = k0 + kk;
        if (m < M && k < K)
            epilogue8(cs + mm * (BN + 4) + kk, (long long)m, k, K, bias, scale, y, y_off, y_ld, y_inv_scale, relu,
                      res ? res + (long long)m * ldres + k : nullptr, res_scale);
    }
}

#define CONV_TC(NAME, T, WARPS_M, WARPS_N, FM, FN, STAGES)                                                     \
    extern "C" __global__ void __launch_bounds__(WARPS_M * WARPS_N * 32)                                      \
    NAME(const T* x, int ldx, const T* w, const float* bias, const float* scale, T* y, const long long* y_off, \
         const int* y_ld, const float* y_inv_scale, int N, int H, int W, int C, int K, int KH, int KW, int relu, \
         int P, int Q, int stride, int pad_t, int pad_l, const T* res, int ldres, float res_scale)             \
    {                                                                                                          \
        conv_tc<T, WARPS_M, WARPS_N, FM, FN, STAGES>(x, ldx, w, bias, scale, y, y_off, y_ld, y_inv_scale, N, H, \
                                                     W, C, K, KH, KW, relu, P, Q, stride, pad_t, pad_l, res,   \
                                                     ldres, res_scale);                                        \
    }
#define CONV_TC_ALL(SUFFIX, T)                                                                                 \
    CONV_TC(conv_tc_64x32_##SUFFIX, T, 4, 1, 1, 2, 3)                                                          \
    CONV_TC(conv_tc_128x32_##SUFFIX, T, 4, 1, 2, 2, 3)                                                         \
    CONV_TC(conv_tc_64x16_##SUFFIX, T, 4, 1, 1, 1, 3)                                                          \
    CONV_TC(conv_tc_128x16_##SUFFIX, T, 4, 1, 2, 1, 3)                                                         \
    CONV_TC(conv_tc_64x64_##SUFFIX, T, 2, 2, 2, 2, 3)                                                          \
    CONV_TC(conv_tc_32x32_##SUFFIX, T, 2, 2, 1, 1, 4)

CONV_TC_ALL(f16, half)
CONV_TC_ALL(i8, int8)

// --------------------------- 1f. direct convolution on the tensor cores, for images at most 16 pixels wide
// The implicit GEMM above stages every input value once per filter tap (9 or 25 times). Here a block loads
// TH + KS - 1 rows of one image, with their border, into shared memory once (zeros outside the image), and
// the weights of BN output channels; then every A fragment of the GEMM is read straight from that tile: for
// output row r, tap (dy, dx) and 16 channels, its 16 rows are the 16 output pixels of the row, whose inputs
// sit side by side in the tile, one pixel pitch apart, shifted by dx. WMMA's load takes exactly that: a
// pointer and a row pitch. Each of the 4 warps computes TH / 4 rows x BN channels, summing over taps and
// channels. Channels are kept in planes of 16 (one WMMA k-step), each pixel's 16 in a 32-byte row, so every
// fragment starts 32-byte aligned as WMMA requires, whatever the shift dx and the channel block.
// Needs W <= 16, C <= CMAX and C a multiple of 16, the input's pixel stride and first channel multiples of 16
// bytes' worth of T (kernels/inference_engine/tuning.py: kernel_fits); weights transposed, K x R, as for 1d.
template <typename T, int KS, int TH, int BN, int CMAX>
__device__ void conv_tcd(const T* __restrict__ x, int ldx, const T* __restrict__ w /* K x R */,
                         const float* bias, const float* scale, T* y, const long long* y_off, const int* y_ld,
                         const float* y_inv_scale, int N, int H, int W, int C, int K, int relu)
{
    typedef typename Acc<T>::type A;
    constexpr int THREADS = 128, CH = 16 / sizeof(T), HALO = KS / 2, HT = TH + KS - 1, WT = 16 + KS - 1;
    constexpr int FM = TH / 4, FN = BN / 16, TAPS = KS * KS, PL = CMAX / 16, ROW = 32 / sizeof(T);
    constexpr int IN = PL * HT * WT * 32, WTS = PL * BN * TAPS * 32;  // bytes
    constexpr int OUT = TH * 16 * (BN + 4) * sizeof(A);
    static_assert(TH % 4 == 0 && BN % 16 == 0, "4 warps of whole rows; 16-channel fragments");
    __shared__ __align__(128) unsigned char smem[IN + WTS > OUT ? IN + WTS : OUT];
    T* tile = reinterpret_cast<T*>(smem);           // [PL][HT][WT][ROW]: 16 channels (+ pad) per pixel row
    T* ws = reinterpret_cast<T*>(smem + IN);        // [PL][BN][TAPS][ROW]: column-major B per tap
    A* cs = reinterpret_cast<A*>(smem);             // [TH * 16][BN + 4], after the sums

    int tid = threadIdx.x, warp = tid / 32;
    int bands = (H + TH - 1) / TH, n = blockIdx.x / bands, h0 = (blockIdx.x % bands) * TH, k0 = blockIdx.y * BN;
    int R = TAPS * C, cch = C / CH;
    for (int e = tid; e < HT * WT * cch; e += THREADS) {  // the rows of the image this block needs, bordered
        int q = e % cch, p = e / cch, j = p % WT, i = p / WT;
        int hh = h0 - HALO + i, ww = j - HALO;
        bool ok = hh >= 0 && hh < H && ww >= 0 && ww < W;
        const T* src = ok ? x + ((long long)(n * H + hh) * W + ww) * ldx + q * CH : x;
        int c = q * CH;
        cp_async16_zfill(tile + ((c / 16) * HT * WT + p) * ROW + c % 16, src, ok);
    }
    for (int e = tid; e < BN * TAPS * cch; e += THREADS) {  // weights: BN channels x (tap, C), from K x R
        int q = e % cch, t = (e / cch) % TAPS, kk = e / (cch * TAPS);
        bool ok = k0 + kk < K;
        int c = q * CH;
        cp_async16_zfill(ws + (((c / 16) * BN + kk) * TAPS + t) * ROW + c % 16, ok ? w + (long long)(k0 + kk) * R + t * C + c : w,
                   ok);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    wmma::fragment<wmma::accumulator, 16, 16, 16, A> acc[FM][FN];
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[i][j], (A)0);
    for (int t = 0; t < TAPS; ++t) {
        int dy = t / KS, dx = t % KS;
        for (int c0 = 0; c0 < C; c0 += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a[FM];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b[FN];
#pragma unroll
            for (int i = 0; i < FM; ++i)  // output row warp * FM + i: tile row + dy, columns dx .. dx + 15
                wmma::load_matrix_sync(a[i], tile + ((c0 / 16) * HT * WT + (warp * FM + i + dy) * WT + dx) * ROW, ROW);
#pragma unroll
            for (int j = 0; j < FN; ++j)
                wmma::load_matrix_sync(b[j], ws + (((c0 / 16) * BN + j * 16) * TAPS + t) * ROW, TAPS * ROW);
#pragma unroll
            for (int i = 0; i < FM; ++i)
#pragma unroll
                for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
    }
    __syncthreads();  // the tile becomes the accumulators' staging area
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j)
            wmma::store_matrix_sync(cs + (warp * FM + i) * 16 * (BN + 4) + j * 16, acc[i][j], BN + 4,
                                    wmma::mem_row_major);
    __syncthreads();
    for (int e = tid; e < TH * 16 * (BN / 8); e += THREADS) {
        int pix = e / (BN / 8), kk = (e % (BN / 8)) * 8, r = pix / 16, c = pix % 16;
        int h = h0 + r, k = k0 + kk;
        if (h < H && c < W && k < K)
            epilogue8(cs + pix * (BN + 4) + kk, ((long long)n * H + h) * W + c, k, K, bias, scale, y, y_off, y_ld,
                      y_inv_scale, relu);
    }
}

#define CONV_TCD(SUFFIX, T, KS, TH, BN, CMAX)                                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                                          \
    conv_tcd##KS##_##TH##x##BN##_c##CMAX##_##SUFFIX(const T* x, int ldx, const T* w, const float* bias,       \
                                                    const float* scale, T* y, const long long* y_off,          \
                                                    const int* y_ld, const float* y_inv_scale, int N, int H,   \
                                                    int W, int C, int K, int KH, int KW, int relu)             \
    {                                                                                                          \
        conv_tcd<T, KS, TH, BN, CMAX>(x, ldx, w, bias, scale, y, y_off, y_ld, y_inv_scale, N, H, W, C, K, relu); \
    }
#define CONV_TCD_ALL(SUFFIX, T)                                                                                \
    CONV_TCD(SUFFIX, T, 3, 8, 32, 32)                                                                          \
    CONV_TCD(SUFFIX, T, 3, 4, 32, 32)                                                                          \
    CONV_TCD(SUFFIX, T, 3, 8, 16, 32)                                                                          \
    CONV_TCD(SUFFIX, T, 5, 8, 16, 16)                                                                          \
    CONV_TCD(SUFFIX, T, 5, 4, 16, 16)
CONV_TCD_ALL(f16, half)
CONV_TCD_ALL(i8, int8)

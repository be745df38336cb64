// Lesson 6: ResNet-50's stem in one kernel: the 7 x 7 convolution of stride 2 over the image's 3 colours, + bias,
// ReLU, and the 3 x 3 max pool of stride 2 after it (Keras: ZeroPadding2D(3), Conv2D(64, 7, 2), BatchNorm, ReLU,
// ZeroPadding2D(1), MaxPool2D(3, 2)), from the network's float input straight to the pooled activations.
//
// Run as separate kernels, the stem is three passes over memory: the input step writes every output pixel's
// receptive field (an im2col matrix of 147 taps, padded to 192: 3x the image's bytes, in FP16), the GEMM reads it
// back and writes 112 x 112 x 64 activations, and the pool reads those to keep a quarter of them. Here a block
// owns a TP x TP tile of the pool's output. It loads the image patch those pixels see (for TP = 8: 39 x 39 x 3
// floats, converted to half) into shared memory once, computes the (2 TP + 1)^2 convolution outputs the pool's
// windows cover on the tensor cores, keeps them in shared memory, and writes only the pooled tile: the image is
// read once and a quarter of the convolution's output is written, nothing else goes through memory. (The pool's
// windows overlap by one row and column, so neighbouring tiles compute those convolution outputs twice: 13%
// more multiplications for TP = 8, 27% for TP = 4.)
//
// The GEMM: rows are the tile's convolution outputs, columns the 64 channels, the reduction the 147 taps (kh, kw,
// c), padded to 160 = 10 steps of 16. The A operand is never laid out as a matrix: each thread gathers its own
// elements of mma.sync's A fragment from the patch (row m of the tile starts at patch offset (2 r PH + 2 s) 3, tap k
// adds a fixed offset, koff[k]). Each warp keeps the B fragments of its 32 channels for all 10 steps in registers
// (80 of them) and walks its share of the tile's rows, 16 at a time: 4 mma.sync a step, 8 two-byte gathers.
//
// Its arithmetic: the input rounded to half, FP32 sums, + bias, ReLU, rounded to half; the max of those (rounding
// keeps the order, so the max of the rounded values is the rounded max); INT8 and FP8 plans quantise the pooled
// value with the pool's scale (the stem runs in FP16 in every plan, as TensorRT keeps a network's first layer
// in higher precision). The engine's NumPy runtime (executor.py, step "stem") computes the same.
#include "mma_sync.cuh"  // mma16816: on sm_75 (a T4) as two m16n8k8

#define STEM_KS 7     // kernel size
#define STEM_C 3      // input channels
#define STEM_K 64     // output channels
#define STEM_TAPS (STEM_KS * STEM_KS * STEM_C)  // 147
#define STEM_KP 160   // the reduction padded to whole steps of 16 (the weights' row: wt is 64 x 160 half)
#define STEM_STEPS (STEM_KP / 16)


__device__ __forceinline__ unsigned stem_pack(half lo, half hi)
{
    return (unsigned)__half_as_ushort(lo) | ((unsigned)__half_as_ushort(hi) << 16);
}

// region: stem_pool
// x: N x H x W x 3 float (the network's input); wt: 64 x 160 half, channel k's taps (kh, kw, c) then zeros;
// bias: 64 float; y: N x Ho x Wo pixels of ldy elements, the pooled output's 64 channels at its start.
// (pad_t, pad_l): the convolution's zero padding; P x Q its output; (ppad_t, ppad_l) the pool's.
// TP: the pool's output tile a block owns (TP x TP pixels); WM: warps along the tile's rows (2 WM warps: each
// pair splits the 64 channels).
template <int TP, int WM, typename T>
__device__ __forceinline__ void stem_pool(const float* __restrict__ x, int N, int H, int W, int pad_t, int pad_l,
                                          int P, int Q, int ppad_t, int ppad_l, int Ho, int Wo,
                                          const half* __restrict__ wt, const float* __restrict__ bias,
                                          T* __restrict__ y, int ldy, float inv_scale)
{
    constexpr int CT = 2 * TP + 1;                   // the convolution outputs the tile's pool windows cover, a side
    constexpr int M = CT * CT, MT = (M + 15) / 16;   // rows of the tile's GEMM, and its 16-row slices
    constexpr int PH = 2 * (CT - 1) + STEM_KS;       // the image patch those outputs see, a side
    constexpr int PATCH = PH * PH * STEM_C;          // halves
    __shared__ __align__(16) half patch[PATCH];
    __shared__ __align__(16) half conv[M * STEM_K];   // the tile's outputs: row m, 8-channel groups swizzled by m
    __shared__ int2 koff[STEM_STEPS][8];               // the patch offsets of the taps each lane's fragment holds

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, gid = lane / 4, tig = lane % 4;
    const int tiles_w = (Wo + TP - 1) / TP, tiles_h = (Ho + TP - 1) / TP;
    const int n = blockIdx.x / (tiles_h * tiles_w), t = blockIdx.x % (tiles_h * tiles_w);
    const int ho0 = (t / tiles_w) * TP, wo0 = (t % tiles_w) * TP;
    const int cr0 = 2 * ho0 - ppad_t, cc0 = 2 * wo0 - ppad_l;  // the tile's first convolution output
    const int ir0 = 2 * cr0 - pad_t, ic0 = 2 * cc0 - pad_l;    // and the first image pixel it sees

    // the patch, converted to half, zeros outside the image (the convolution's padding). All of a thread's loads
    // first, then the stores: a loop of load, convert, store waits out the memory's latency once an element (18 of
    // them a thread for TP = 8), and that alone made this kernel take 3x its time.
    constexpr int THREADS = 64 * WM, PER = (PATCH + THREADS - 1) / THREADS;
    const float* xn = x + (size_t)n * H * W * STEM_C;
    float v[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int e = tid + i * THREADS, pr = e / (PH * STEM_C), rest = e - pr * (PH * STEM_C);
        const int h = ir0 + pr, w = ic0 + rest / STEM_C;
        v[i] = e < PATCH && h >= 0 && h < H && w >= 0 && w < W ? xn[((long long)h * W + ic0) * STEM_C + rest] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < PER; ++i)
        if (tid + i * THREADS < PATCH) patch[tid + i * THREADS] = __float2half_rn(v[i]);
    // tap k -> (kh PH + kw) 3 + c. The padded taps (147 .. 159) meet weights of zero: they read the row's own first
    // element, a finite value (an offset past the patch would read whatever lies there, and 0 x NaN is NaN)
    if (tid < STEM_STEPS * 8) {
        const int s = tid / 8, j = tid % 8, k = s * 16 + (j % 4) * 2 + (j / 4) * 8;
        auto off = [](int k) {
            return k < STEM_TAPS ? ((k / (STEM_KS * STEM_C)) * PH + (k % (STEM_KS * STEM_C)) / STEM_C) * STEM_C +
                                       k % STEM_C
                                 : 0;
        };
        koff[s][j] = make_int2(off(k), off(k + 1));
    }

    // this warp's 32 channels: their B fragments for every step, from the weights (64 x 160 half, L2-resident)
    const int wn = warp % 2, wm = warp / 2, ch0 = wn * 32;
    unsigned b[STEM_STEPS][4][2];
#pragma unroll
    for (int s = 0; s < STEM_STEPS; ++s)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const half* col = wt + (size_t)(ch0 + j * 8 + gid) * STEM_KP + s * 16 + tig * 2;
            b[s][j][0] = *reinterpret_cast<const unsigned*>(col);
            b[s][j][1] = *reinterpret_cast<const unsigned*>(col + 8);
        }
    __syncthreads();

    for (int mt = wm; mt < MT; mt += WM) {
        int base[2], row[2];
        bool valid[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // rows gid and gid + 8 of the slice: convolution output (r, s) of the tile
            row[h] = mt * 16 + gid + 8 * h;
            const int m = row[h] < M ? row[h] : 0, r = m / CT, s = m % CT;
            base[h] = (2 * r * PH + 2 * s) * STEM_C;
            valid[h] = row[h] < M && cr0 + r >= 0 && cr0 + r < P && cc0 + s >= 0 && cc0 + s < Q;
        }
        float d[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) d[j][q] = 0.0f;
#pragma unroll
        for (int s = 0; s < STEM_STEPS; ++s) {
            const int2 lo = koff[s][tig], hi = koff[s][4 + tig];
            unsigned a[4];  // (row gid, taps 2 tig, +1), (row gid + 8, same), (row gid, taps 2 tig + 8, +9), ...
            a[0] = stem_pack(patch[base[0] + lo.x], patch[base[0] + lo.y]);
            a[1] = stem_pack(patch[base[1] + lo.x], patch[base[1] + lo.y]);
            a[2] = stem_pack(patch[base[0] + hi.x], patch[base[0] + hi.y]);
            a[3] = stem_pack(patch[base[1] + hi.x], patch[base[1] + hi.y]);
#pragma unroll
            for (int j = 0; j < 4; ++j) mma16816(d[j], a, b[s][j][0], b[s][j][1]);  // mma_sync.cuh
        }
        // + bias, ReLU, to half; outputs outside the convolution's P x Q (the pool's padding) are zeros, which
        // the max of ReLU's outputs may take as the padding's
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (row[h] >= M) continue;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int c = ch0 + j * 8 + tig * 2;
                const float2 bc = *reinterpret_cast<const float2*>(bias + c);
                const float v0 = valid[h] ? fmaxf(d[j][2 * h] + bc.x, 0.0f) : 0.0f;
                const float v1 = valid[h] ? fmaxf(d[j][2 * h + 1] + bc.y, 0.0f) : 0.0f;
                const int sw = ((c / 8) ^ (row[h] & 7)) * 8 + c % 8;
                *reinterpret_cast<__half2*>(conv + row[h] * STEM_K + sw) = __floats2half2_rn(v0, v1);
            }
        }
    }
    __syncthreads();

    // the pool: each thread a pooled pixel's 8 channels at a time, the max of its 3 x 3 window
    for (int e = tid; e < TP * TP * (STEM_K / 8); e += blockDim.x) {
        const int g = e % (STEM_K / 8), p = e / (STEM_K / 8), pi = p / TP, pj = p % TP;
        const int ho = ho0 + pi, wo = wo0 + pj;
        if (ho >= Ho || wo >= Wo) continue;
        __half2 best[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) best[q] = __float2half2_rn(0.0f);  // ReLU's outputs are >= 0
#pragma unroll
        for (int dy = 0; dy < 3; ++dy)
#pragma unroll
            for (int dx = 0; dx < 3; ++dx) {
                const int m = (2 * pi + dy) * CT + 2 * pj + dx;
                const uint4 raw = *reinterpret_cast<const uint4*>(conv + m * STEM_K + ((g ^ (m & 7)) * 8));
                const __half2* v = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
                for (int q = 0; q < 4; ++q) best[q] = __hmax2(best[q], v[q]);
            }
        T* out = y + ((size_t)(n * Ho + ho) * Wo + wo) * ldy + g * 8;
        if constexpr (sizeof(T) == 2) {
            *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(best);
        } else {  // INT8, FP8: quantised with the pool's scale, 8 bytes
            __align__(8) T q8[8];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float2 f = __half22float2(best[q]);
                store(q8 + 2 * q, f.x, inv_scale);
                store(q8 + 2 * q + 1, f.y, inv_scale);
            }
            *reinterpret_cast<uint2*>(out) = *reinterpret_cast<const uint2*>(q8);
        }
    }
}
// endregion: stem_pool

// Two tiles: 8 x 8 pooled pixels a block (8 warps) for large batches, 4 x 4 (6 warps) where the batch is small and
// the GPU's SMs need more blocks (ResNet-50 at batch 1: 196 blocks instead of 49).
#define STEM_KERNELS(SUFFIX, T)                                                                                \
    extern "C" __global__ void __launch_bounds__(256, 2) stem_pool8_##SUFFIX(                                  \
        const float* x, int N, int H, int W, int pad_t, int pad_l, int P, int Q, int ppad_t, int ppad_l, int Ho, \
        int Wo, const half* wt, const float* bias, T* y, int ldy, float inv_scale)                             \
    { stem_pool<8, 4, T>(x, N, H, W, pad_t, pad_l, P, Q, ppad_t, ppad_l, Ho, Wo, wt, bias, y, ldy, inv_scale); } \
    extern "C" __global__ void __launch_bounds__(192) stem_pool4_##SUFFIX(                                     \
        const float* x, int N, int H, int W, int pad_t, int pad_l, int P, int Q, int ppad_t, int ppad_l, int Ho, \
        int Wo, const half* wt, const float* bias, T* y, int ldy, float inv_scale)                             \
    { stem_pool<4, 3, T>(x, N, H, W, pad_t, pad_l, P, Q, ppad_t, ppad_l, Ho, Wo, wt, bias, y, ldy, inv_scale); }

STEM_KERNELS(f16, half)
STEM_KERNELS(i8, int8)
STEM_KERNELS(f8, fp8)

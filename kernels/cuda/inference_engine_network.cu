// Lesson 6: the digits network in one kernel. Loaded from Python by gpucourse/cuda_c.py; the plan step that runs it
// ("network", build_plan(fuse_network=True)), its weights as this file reads them and the NumPy model of the same
// arithmetic are in kernels/inference_engine/network.py.
//
// The fused plan runs the network as 8 kernels: every layer writes its output to memory and the next reads it back,
// and at batch 1 each kernel is a few microseconds of launch and ramp for a few microseconds of work. Here one
// kernel runs the whole network. A block owns TR rows of one image (TR = 16: the whole image; 8, 4 or 2: 2, 4 or 8
// blocks an image, for small batches, so that more SMs work on it) and keeps everything between the input and the
// logits in shared memory:
//
//   the image's rows the tile sees (its TR rows and 3 more each side: a 3 x 3 stem, then a 5 x 5 branch)
//   -> the stem's 32 channels (TR + 4 rows)   -> the 1 x 1 reductions for the 3 x 3 (TR + 2 rows) and 5 x 5 (TR + 4)
//                                              -> the 1 x 1 branch and the max pool + 1 x 1 branch (TR rows): pooled
//   -> the 3 x 3 and 5 x 5 branches (TR rows): pooled
//   -> each row's 4 x 4 average-pool sums, 96 channels: the only thing a branch's output becomes
//   -> the logits (a tile's share of the dense layer; the last tile of an image to finish adds the shares up).
//
// The rows a tile needs beyond its own are computed again by the neighbouring tile (the halo): for TR = 4, 7% more
// multiply-adds than the network has, because the expensive layers (3 x 3 and 5 x 5) have no halo. The branches'
// outputs are never stored: each value is rounded as the plan stores it, then summed into its pooling window.
//
// Arithmetic, per precision, as the engine's unfused plan does it (the NumPy runtime computes the same):
//   FP32: FP32 on the CUDA cores (conv_simt);
//   FP16: the input and every activation rounded to half, mma.sync m16n8k16 with FP32 sums (conv_mma);
//   INT8: every activation an INT8 code of its tensor's calibrated scale, weights with a scale per output channel,
//         mma.sync m16n8k32 with int32 sums (conv_mma), x scale[k] + bias, ReLU, quantised;
// the head in FP32 (the average pool's sums times the dense layer's weights, pre-multiplied by 1 / 16 and INT8's
// scale). GPUs before sm_80 (a T4) run each mma.sync as two (FP16) or four (INT8) of their smaller shapes.

#include <cuda_fp16.h>
#include "mma_sync.cuh"

typedef signed char int8;

#define NET_THREADS 256
#define NET_WARPS (NET_THREADS / 32)

namespace net {
constexpr int IMG = 16;                                   // 16 x 16 pixels, one channel
constexpr int C = 32;                                     // the stem's channels
constexpr int R3 = 32, R5 = 16;                           // the 1 x 1 reductions before the 3 x 3 and 5 x 5 branches
constexpr int B1 = 32, B3 = 32, B5 = 16, BP = 16;         // the four branches' channels
constexpr int RED = R3 + R5 + B1;                         // 80: the three 1 x 1 convolutions of the stem, side by side
constexpr int CAT = B1 + B3 + B5 + BP;                    // 96: the concatenation
constexpr int AT_B1 = 0, AT_B3 = B1, AT_B5 = B1 + B3, AT_BP = B1 + B3 + B5;  // the branches' channels in it
constexpr int POOL = 4;                                   // the average pool's window: 4 x 4 pooled pixels an image
constexpr int O = 10;                                     // logits
// the sections of the weights' buffer (network.py writes it: a table of their byte offsets, then each section)
enum { W_STEM, B_STEM, S_STEM, W_RED, B_RED, S_RED, W_C3, B_C3, S_C3, W_C5, B_C5, S_C5, W_PP, B_PP, S_PP, W_DENSE,
       B_DENSE, SCALARS, SECTIONS };
enum { INV_IN, INV_STEM, INV_R3, INV_R5, INV_CAT };       // SCALARS: 1 / the INT8 scales of the stored tensors
}  // namespace net

extern __shared__ __align__(16) unsigned char net_smem[];

// ------------------------------------------------------------------------- values as the plan stores them
// keep(t, v, inv): t = v as the plan stores it; returns the stored value as a float (INT8: the code; its scale is in
// the head's weights). INT8 without the conversion unit (F2I and I2F issue at a quarter of the FP32 rate, and the
// epilogue made three of them per output): v / scale, clamped to +-127, plus 1.5 x 2^23 is a float whose low
// mantissa bits hold round(v / scale), to nearest with halves to even as __float2int_rn and NumPy's rint; its low byte
// is the code, and the float less 1.5 x 2^23 the code's value.
constexpr float NET_ROUND = 12582912.0f;  // 1.5 x 2^23
__device__ __forceinline__ float keep(float& t, float v, float) { return t = v; }
__device__ __forceinline__ float keep(half& t, float v, float)
{
    t = __float2half_rn(v);
    return __half2float(t);
}
__device__ __forceinline__ float keep(int8& t, float v, float inv, float lo = -127.0f)
{
    const float c = fminf(fmaxf(v * inv, lo), 127.0f) + NET_ROUND;
    t = (int8)__float_as_int(c);
    return c - NET_ROUND;
}
// keep(t, ReLU(v), inv): INT8's clamp at 0 is the ReLU (v / scale >= 0 exactly where v >= 0)
__device__ __forceinline__ float relu(float v) { return v > 0.0f ? v : 0.0f; }  // (not fmaxf: -0 would order above
                                                                                // +0 in max_packed)
__device__ __forceinline__ float keep_relu(half& t, float v, float inv) { return keep(t, relu(v), inv); }
__device__ __forceinline__ float keep_relu(int8& t, float v, float inv) { return keep(t, v, inv, 0.0f); }
template <typename T>
__device__ __forceinline__ void put(T* p, float v, float inv) { keep(*p, v, inv); }
// two neighbouring channels' values with one store
__device__ __forceinline__ void put_pair(half* p, half a, half b)
{
    *reinterpret_cast<__half2*>(p) = __halves2half2(a, b);
}
__device__ __forceinline__ void put_pair(int8* p, int8 a, int8 b)
{
    *reinterpret_cast<unsigned short*>(p) = (unsigned short)((unsigned char)a | (unsigned)(unsigned char)b << 8);
}
__device__ __forceinline__ unsigned bits(half v) { return __half_as_ushort(v); }

template <typename T> struct Acc { typedef float type; };
template <> struct Acc<int8> { typedef int type; };

// The max of packed values that are all >= 0 (ReLU's outputs, zeros around them): for half and for INT8 codes
// their bit patterns order as unsigned integers do.
template <typename T>
__device__ __forceinline__ unsigned max_packed(unsigned a, unsigned b)
{
    if constexpr (sizeof(T) == 2) return __vmaxu2(a, b);
    else return __vmaxu4(a, b);
}

// ------------------------------------------------------------------------- the tensor-core instructions
// mma_sync.cuh's instructions with B's two registers as one uint2 (how the weights are stored): D += A B, 16 x 8
// outputs, FP16 (k = 16) with FP32 sums or INT8 (k = 32) with int32 sums
__device__ __forceinline__ void net_mma(float (&d)[4], const unsigned (&a)[4], uint2 b) { mma16816(d, a, b.x, b.y); }
__device__ __forceinline__ void net_mma(int (&d)[4], const unsigned (&a)[4], uint2 b) { mma16832(d, a, b.x, b.y); }

__device__ __forceinline__ unsigned net_dynamic_smem()
{
    unsigned v;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
    return v;
}

// ------------------------------------------------------------------------- the tile's planes in shared memory
// A plane holds one tensor for the tile: rows of COLS pixels (the image's 16 and BORDER columns of zeros each side,
// the next convolution's padding), PITCH bytes a pixel: its channels, padded to an odd number of 16-byte chunks so
// that ldmatrix's 8 rows (8 neighbouring pixels) fall in 8 different groups of banks.
constexpr int pitch_of(int bytes) { return (bytes / 16) % 2 ? bytes : bytes + 16; }
constexpr int up16(int bytes) { return (bytes + 15) / 16 * 16; }

template <typename T, int TR>
struct Tile {
    static constexpr int E = sizeof(T);
    static constexpr int XR = TR + 6, XC = 18;                               // image rows r0 - 3 .. r0 + TR + 2
    static constexpr int SR = TR + 4, SC = 18, SB = 1, SP = pitch_of(net::C * E);    // stem: rows r0 - 2 ..
    // the input as the stem reads it: FP32 and FP16 the image rows (XR x XC); INT8 each stem pixel's 9 taps (its
    // 3 x 3 window's codes, then 7 zero bytes: 16 bytes a pixel, SR x 16 pixels), the A operand of the stem's mma
    static constexpr int X_BYTES = E == 1 ? SR * net::IMG * 16 : up16(XR * XC * E);
    static constexpr int R3R = TR + 2, R3C = 18, R3B = 1, R3P = pitch_of(net::R3 * E);  // rows r0 - 1 ..
    static constexpr int R5R = TR + 4, R5C = 20, R5B = 2, R5P = pitch_of(net::R5 * E);  // rows r0 - 2 ..
    static constexpr int X_AT = 0;
    static constexpr int S_AT = X_AT + X_BYTES;
    static constexpr int R3_AT = S_AT + SR * SC * SP;
    static constexpr int R5_AT = R3_AT + R3R * R3C * R3P;
    static constexpr int POOL_AT = R5_AT + R5R * R5C * R5P;                  // float [TR][4][96]: each row's sums
    static constexpr int RED_AT = POOL_AT + TR * net::POOL * net::CAT * 4;  // float [8 warps][10], and a flag
    static constexpr int BYTES = RED_AT + (NET_WARPS * net::O + 4) * 4;
};

// The output of a layer, and what becomes of it: ReLU(sum (x scale[k]) + bias[k]), then stored in a plane (output
// row r in plane row r: cols pixels a row, border columns of zeros before the first, pitch bytes a pixel), or
// (pool != nullptr) rounded as stored and summed over the 4 pixels of each pooling window in the row, into channels
// at .. at + the layer's of the row's pooled sums.
struct Out {
    unsigned char* plane;
    int cols, border, pitch;
    float* pool;
    int at;
    const float* bias;
    const float* scale;  // INT8 only: s_x s_w[k], from the int32 sum to real units
    float inv;           // INT8 only: 1 / the stored tensor's scale

    // channel k's sum in real units plus its bias, from its scale s (INT8 only) and bias b in registers; INT8 rounds
    // the product before the bias is added
    __device__ __forceinline__ float pre(float sum, float, float b) const { return sum + b; }
    __device__ __forceinline__ float pre(int sum, float s, float b) const { return __fmul_rn((float)sum, s) + b; }
    // the same, loading them
    __device__ __forceinline__ float pre(float sum, int k) const { return pre(sum, 1.0f, __ldg(bias + k)); }
    __device__ __forceinline__ float pre(int sum, int k) const { return pre(sum, __ldg(scale + k), __ldg(bias + k)); }
    template <typename A>
    __device__ __forceinline__ float act(A sum, int k) const { return relu(pre(sum, k)); }
    template <typename T>
    __device__ __forceinline__ T* at_pixel(int r, int px, int k) const
    {
        return reinterpret_cast<T*>(plane + (r * cols + px + border) * pitch) + k;
    }
};

__device__ __forceinline__ Out to_plane(unsigned char* plane, int cols, int border, int pitch, const float* bias,
                                        const float* scale, float inv)
{
    return {plane, cols, border, pitch, nullptr, 0, bias, scale, inv};
}

__device__ __forceinline__ Out to_pool(float* pool, int at, const float* bias, const float* scale, float inv)
{
    return {nullptr, 0, 0, 0, pool, at, bias, scale, inv};
}

// ------------------------------------------------------------------------- a layer on the tensor cores
// Output rows lo .. hi - 1 of a KS x KS convolution ("same" padding) over the plane `in` (CIN channels of T; output
// row r's tap dy reads plane row in_row0 + r + dy), as GEMMs: each output row is one m16 tile (its 16 pixels), the
// reduction runs over the taps and channels in steps of 32 bytes (16 halves, 32 INT8 codes), NT n8 tiles of output
// channels (the weights' tiles nt0 .. nt0 + NT - 1 of ntw). A warp takes an item of MG rows x NG n tiles: per step it
// loads the NG B fragments (prepared in fragment order: a 256-byte line per warp, L1-cached) and, per row, the A
// fragment with one ldmatrix (each lane gives the address of one pixel's 16 bytes of the tap: the im2col matrix is
// never formed). MAXPOOL: the A operand is the max over the 3 x 3 window around each pixel (the max pool before
// the pool branch's 1 x 1). `slot`: the items of the phase's earlier layers, so that warps share the phase evenly.
// A 1 x 1 layer whose items each take all NT n tiles uses the same B fragments, scales and biases in every item:
// they are loaded once, before the first.
// The tile's 16 rows are the row's pixels in the order perm (0 2 4 6 9 11 13 15, then 1 3 5 7 8 10 12 14): the two
// rows a lane's sums hold (g and g + 8) are neighbours, and lanes g and g ^ 1 hold one pooling window of 4 pixels,
// so a window's sum is one addition in the lane and one shuffle (in the order the plan adds them: the two pairs,
// then their sums); each half of the order is 8 pixels in 8 different groups of banks, as ldmatrix needs.
template <typename T, int KS, int CIN, int COLS, int BORDER, int PITCH, int NT, int MG, int NG, bool MAXPOOL>
__device__ __forceinline__ void conv_mma(const unsigned char* in, int in_row0, int lo, int hi,
                                         const uint2* __restrict__ wf, int ntw, int nt0, int& slot, const Out& out)
{
    typedef typename Acc<T>::type A;
    constexpr int CB = CIN * (int)sizeof(T), STEPS = (KS * KS * CB + 31) / 32, TAPS = KS * KS;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, gid = lane / 4, tig = lane % 4;
    auto perm = [](int i) { return (2 * (i % 8) + (i % 8 >= 4)) ^ (i / 8); };  // the tile's row i: pixel perm(i)
    const int lpx = perm(lane % 8 + 8 * ((lane / 8) % 2)), lhalf = lane / 16;  // this lane's ldmatrix row, 16 bytes
    const int groups = (hi - lo + MG - 1) / MG, items = groups * (NT / NG);
    constexpr bool SAME = KS == 1 && NG == NT;  // every item the same weights: in registers
    uint2 wr[SAME ? STEPS : 1][NG];
    float sr[NG][2], br[NG][2];
    if constexpr (SAME) {
#pragma unroll
        for (int s = 0; s < STEPS; ++s)
#pragma unroll
            for (int j = 0; j < NG; ++j) wr[s][j] = __ldg(wf + (s * ntw + nt0 + j) * 32 + lane);
#pragma unroll
        for (int j = 0; j < NG; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                br[j][e] = __ldg(out.bias + j * 8 + 2 * tig + e);
                sr[j][e] = sizeof(T) == 1 ? __ldg(out.scale + j * 8 + 2 * tig + e) : 1.0f;
            }
    }
    for (int it = (warp + NET_WARPS - slot % NET_WARPS) % NET_WARPS; it < items; it += NET_WARPS) {
        const int g = it / (NT / NG), nb = (it % (NT / NG)) * NG;
        const unsigned char* row[MG];
#pragma unroll
        for (int mi = 0; mi < MG; ++mi) {
            const int r = min(lo + g * MG + mi, hi - 1);
            row[mi] = in + ((in_row0 + r) * COLS + lpx + BORDER - KS / 2) * PITCH;
        }
        A d[MG][NG][4];
#pragma unroll
        for (int mi = 0; mi < MG; ++mi)
#pragma unroll
            for (int j = 0; j < NG; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q) d[mi][j][q] = 0;
#pragma unroll 2
        for (int s = 0; s < STEPS; ++s) {
            uint2 b[NG];
#pragma unroll
            for (int j = 0; j < NG; ++j) {
                if constexpr (SAME) b[j] = wr[s][j];
                else b[j] = __ldg(wf + (s * ntw + nt0 + nb + j) * 32 + lane);
            }
            // this lane's 16 bytes of step s: tap t, channel byte cb (taps past the last: zero weights, any pixel)
            const int kb = s * 32 + lhalf * 16, t = kb / CB < TAPS ? kb / CB : 0, cb = kb / CB < TAPS ? kb % CB : 0;
            const int off = ((t / KS) * COLS + t % KS) * PITCH + cb;
#pragma unroll
            for (int mi = 0; mi < MG; ++mi) {
                unsigned a[4];
                if constexpr (MAXPOOL) {
                    ldmatrix_x4(a, row[mi] + off - (COLS + 1) * PITCH);
#pragma unroll
                    for (int w = 1; w < 9; ++w) {
                        unsigned v[4];
                        ldmatrix_x4(v, row[mi] + off + ((w / 3 - 1) * COLS + w % 3 - 1) * PITCH);
#pragma unroll
                        for (int q = 0; q < 4; ++q) a[q] = max_packed<T>(a[q], v[q]);
                    }
                } else {
                    ldmatrix_x4(a, row[mi] + off);
                }
#pragma unroll
                for (int j = 0; j < NG; ++j) net_mma(d[mi][j], a, b[j]);
            }
        }
        // the epilogue: lane (gid, tig) holds pixels perm(gid) and perm(gid + 8) (neighbours), channels 2 tig and
        // 2 tig + 1 of each n tile
#pragma unroll
        for (int mi = 0; mi < MG; ++mi) {
            const int r = lo + g * MG + mi;
            if (r >= hi) continue;
#pragma unroll
            for (int j = 0; j < NG; ++j) {
                const int k = (nb + j) * 8 + 2 * tig;
                float v[4];
                T t[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    float pre;
                    if constexpr (SAME) pre = out.pre(d[mi][j][q], sr[j][q % 2], br[j][q % 2]);
                    else pre = out.pre(d[mi][j][q], k + q % 2);
                    v[q] = keep_relu(t[q], pre, out.inv);
                }
                if (!out.pool) {
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        put_pair(out.at_pixel<T>(r, perm(gid + 8 * h), k), t[2 * h], t[2 * h + 1]);
                } else {  // the row's sums over pooling window gid / 2: this lane's two pixels, then lane gid ^ 1's
#pragma unroll
                    for (int q = 0; q < 2; ++q) {
                        v[q] += v[q + 2];
                        v[q] += __shfl_xor_sync(0xffffffffu, v[q], 4);
                    }
                    if (gid % 2 == 0)
                        *reinterpret_cast<float2*>(out.pool + (r * net::POOL + gid / 2) * net::CAT + out.at + k) =
                            make_float2(v[0], v[1]);
                }
            }
        }
    }
    slot += items;
}

// The stem on the tensor cores: 9 taps over one channel, padded to one step of the reduction; each lane gathers its
// own A fragment from the image rows (row r's tap (dy, dx) is image plane row r + dy, column pixel + dx).
template <typename T, int TR>
__device__ __forceinline__ void stem_mma(const T* x, int lo, int hi, const uint2* __restrict__ wf, int& slot,
                                         const Out& out)
{
    typedef Tile<T, TR> G;
    typedef typename Acc<T>::type A;
    constexpr int KPR = 4 / (int)sizeof(T);  // reduction elements a register holds: 2 halves, 4 INT8 codes
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, gid = lane / 4, tig = lane % 4;
    const int items = hi - lo;
    for (int it = (warp + NET_WARPS - slot % NET_WARPS) % NET_WARPS; it < items; it += NET_WARPS) {
        const int r = lo + it;
        unsigned a[4];
        if constexpr (sizeof(T) == 1) {  // taps 4 tig .. 4 tig + 3 of pixels gid and gid + 8: one word of each record
            const unsigned* taps = reinterpret_cast<const unsigned*>(x) + r * net::IMG * 4 + tig;
            a[0] = taps[gid * 4], a[1] = taps[(gid + 8) * 4], a[2] = a[3] = 0u;
        } else {
#pragma unroll
            for (int q = 0; q < 4; ++q) {  // register q: pixel gid (+ 8 for odd q), taps KPR tig + 4 KPR (q / 2) ..
                const int px = gid + 8 * (q % 2);
                unsigned v = 0;
#pragma unroll
                for (int e = 0; e < KPR; ++e) {
                    const int k = KPR * tig + 4 * KPR * (q / 2) + e;
                    if (k < 9) v |= bits(x[(r + k / 3) * G::XC + px + k % 3]) << (8 * sizeof(T) * e);
                }
                a[q] = v;
            }
        }
        A d[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int q = 0; q < 4; ++q) d[j][q] = 0;
            net_mma(d[j], a, __ldg(wf + j * 32 + lane));
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int k = j * 8 + 2 * tig;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                T even, odd;  // channels k and k + 1
                keep_relu(even, out.pre(d[j][2 * h], k), out.inv);
                keep_relu(odd, out.pre(d[j][2 * h + 1], k + 1), out.inv);
                put_pair(out.at_pixel<T>(r, gid + 8 * h, k), even, odd);
            }
        }
    }
    slot += items;
}

// ------------------------------------------------------------------------- a layer on the CUDA cores (FP32)
// The same layer in FP32: a thread computes 4 pixels (one pooling window's width) x CHT channels of NCH, reading
// 4 channels at a time (float4) of each pixel and of the weights (KS KS CIN x ldw, row-major, L1-cached).
template <int KS, int CIN, int COLS, int BORDER, int PITCH, int NCH, int CHT, bool MAXPOOL>
__device__ __forceinline__ void conv_simt(const unsigned char* in_bytes, int in_row0, int lo, int hi,
                                          const float* __restrict__ w, int ldw, int& slot, const Out& out)
{
    constexpr int PF = PITCH / 4, CG = NCH / CHT;  // floats a pixel; channel groups
    const float* in = reinterpret_cast<const float*>(in_bytes);
    const int units = (hi - lo) * 4 * CG;
    for (int u = (threadIdx.x + NET_THREADS - slot % NET_THREADS) % NET_THREADS; u < units; u += NET_THREADS) {
        const int cg = u % CG, pg = (u / CG) % 4, r = lo + u / (4 * CG), c0 = cg * CHT;
        float acc[4][CHT];
#pragma unroll
        for (int p = 0; p < 4; ++p)
#pragma unroll
            for (int k = 0; k < CHT; ++k) acc[p][k] = 0.0f;
#pragma unroll 1
        for (int t = 0; t < KS * KS; ++t) {
            const float* src = in + ((in_row0 + r + t / KS) * COLS + 4 * pg + t % KS - KS / 2 + BORDER) * PF;
            const float* wt = w + (size_t)t * CIN * ldw + c0;
#pragma unroll
            for (int c = 0; c < CIN; c += (CIN < 4 ? 1 : 4)) {
                float xv[4][4], wv[4][CHT];
                constexpr int CC = CIN < 4 ? 1 : 4;
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    if constexpr (CC == 1) {
                        xv[p][0] = src[p * PF + c];
                    } else {
                        float4 v = *reinterpret_cast<const float4*>(src + p * PF + c);
                        if constexpr (MAXPOOL) {
#pragma unroll
                            for (int n = 0; n < 9; ++n) {
                                const float4 m = *reinterpret_cast<const float4*>(
                                    src + p * PF + c + ((n / 3 - 1) * COLS + n % 3 - 1) * PF);
                                v = make_float4(fmaxf(v.x, m.x), fmaxf(v.y, m.y), fmaxf(v.z, m.z), fmaxf(v.w, m.w));
                            }
                        }
                        xv[p][0] = v.x, xv[p][1] = v.y, xv[p][2] = v.z, xv[p][3] = v.w;
                    }
                }
#pragma unroll
                for (int cc = 0; cc < CC; ++cc) {
                    const float* wr = wt + (size_t)(c + cc) * ldw;
                    if constexpr (CHT == 4) {
                        const float4 v = __ldg(reinterpret_cast<const float4*>(wr));
                        wv[cc][0] = v.x, wv[cc][1] = v.y, wv[cc][2] = v.z, wv[cc][3] = v.w;
                    } else if constexpr (CHT == 2) {
                        const float2 v = __ldg(reinterpret_cast<const float2*>(wr));
                        wv[cc][0] = v.x, wv[cc][1] = v.y;
                    } else {
                        wv[cc][0] = __ldg(wr);
                    }
                }
#pragma unroll
                for (int cc = 0; cc < CC; ++cc)
#pragma unroll
                    for (int p = 0; p < 4; ++p)
#pragma unroll
                        for (int k = 0; k < CHT; ++k) acc[p][k] = fmaf(xv[p][cc], wv[cc][k], acc[p][k]);
            }
        }
#pragma unroll
        for (int k = 0; k < CHT; ++k) {
            if (!out.pool) {
#pragma unroll
                for (int p = 0; p < 4; ++p) *out.at_pixel<float>(r, 4 * pg + p, c0 + k) = out.act(acc[p][k], c0 + k);
            } else {  // the 4 pixels are one pooling window's row: their sum
                float s = 0.0f;
#pragma unroll
                for (int p = 0; p < 4; ++p) s += out.act(acc[p][k], c0 + k);
                out.pool[(r * net::POOL + pg) * net::CAT + out.at + c0 + k] = s;
            }
        }
    }
    slot += units;
}

// One layer: on the tensor cores (FP16, INT8) or the CUDA cores (FP32), with the split of its work that gives the
// 8 warps (256 threads) about one item each: KS > 1 (the 3 x 3 and 5 x 5 branches, most of the work) in smaller
// items when the tile has fewer rows; with a whole image a block, two rows an item (one for the max pool's 1 x 1,
// whose steps make nine loads each).
// w: the layer's weights, ldw output channels of which this call computes NCH from channel ch0.
template <typename T, int TR, int KS, int CIN, int NCH, int COLS, int BORDER, int PITCH, bool MAXPOOL = false>
__device__ __forceinline__ void layer(const unsigned char* in, int in_row0, int lo, int hi, const unsigned char* w,
                                      int ldw, int ch0, int& slot, const Out& out)
{
    if constexpr (sizeof(T) == 4) {
        constexpr int CHT = KS == 1 ? 4 : (TR >= 8 ? NCH / 8 : NCH / 16);
        conv_simt<KS, CIN, COLS, BORDER, PITCH, NCH, CHT, MAXPOOL>(
            in, in_row0, lo, hi, reinterpret_cast<const float*>(w) + ch0, ldw, slot, out);
    } else {
        constexpr int NT = NCH / 8, MG = TR >= 16 && (KS > 1 || !MAXPOOL) ? 2 : 1;
        constexpr int NG = KS == 1 || TR >= 8 ? NT : NT / 2;
        conv_mma<T, KS, CIN, COLS, BORDER, PITCH, NT, MG, NG, MAXPOOL>(
            in, in_row0, lo, hi, reinterpret_cast<const uint2*>(w), ldw / 8, ch0 / 8, slot, out);
    }
}

// ------------------------------------------------------------------------- the head
// This tile's share of the logits: its rows' pooled sums times the dense layer's weights (rows in the kernel's
// channel order, times 1 / 16 and INT8's scale). With several tiles an image, each writes its share, and the last
// to finish (a counter per image, reset for the next launch) adds them in tile order: the same sums every run.
template <int TR>
__device__ __forceinline__ void head(const float* pool, float* red, int n, int tile, int r0,
                                     const float* __restrict__ wd, const float* __restrict__ bd, float* logits,
                                     float* partial, int* done)
{
    // RPP of the tile's rows fall in each of its PR rows of pooled pixels: their sums are added first, so that each
    // of the dense layer's weights is read once
    constexpr int TILES = net::IMG / TR, PER_ROW = net::POOL * net::CAT;
    constexpr int RPP = TR < net::POOL ? TR : net::POOL, PR = TR / RPP;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    float z[net::O];
#pragma unroll
    for (int o = 0; o < net::O; ++o) z[o] = 0.0f;
    for (int e = tid; e < PR * PER_ROW; e += NET_THREADS) {
        const int pr = e / PER_ROW, c = e % PER_ROW;
        float p = 0.0f;
#pragma unroll
        for (int i = 0; i < RPP; ++i) p += pool[(pr * RPP + i) * PER_ROW + c];
        const float* w = wd + ((size_t)(r0 / net::POOL + pr) * PER_ROW + c) * net::O;
#pragma unroll
        for (int o = 0; o < net::O; o += 2) {
            const float2 v = __ldg(reinterpret_cast<const float2*>(w + o));
            z[o] = fmaf(p, v.x, z[o]);
            z[o + 1] = fmaf(p, v.y, z[o + 1]);
        }
    }
#pragma unroll
    for (int o = 0; o < net::O; ++o)
#pragma unroll
        for (int m = 16; m > 0; m /= 2) z[o] += __shfl_xor_sync(0xffffffffu, z[o], m);
    if (lane == 0)
#pragma unroll
        for (int o = 0; o < net::O; ++o) red[warp * net::O + o] = z[o];
    __syncthreads();
    float s = 0.0f;
    if (tid < net::O)
        for (int w = 0; w < NET_WARPS; ++w) s += red[w * net::O + tid];
    if constexpr (TILES == 1) {
        if (tid < net::O) logits[n * net::O + tid] = s + __ldg(bd + tid);
    } else {
        int* last = reinterpret_cast<int*>(red + NET_WARPS * net::O);
        if (tid < net::O) partial[(n * TILES + tile) * net::O + tid] = s;
        __threadfence();  // this tile's share is visible to every block before the counter says it is there
        __syncthreads();
        if (tid == 0) *last = atomicAdd(done + n, 1) == TILES - 1;
        __syncthreads();
        if (*last) {
            __threadfence();
            if (tid < net::O) {
                float z = __ldg(bd + tid);
                for (int t = 0; t < TILES; ++t) z += __ldcg(partial + (n * TILES + t) * net::O + tid);
                logits[n * net::O + tid] = z;
            }
            if (tid == 0) done[n] = 0;
        }
    }
}

// region: network
// The whole network for rows r0 .. r0 + TR - 1 of image n: x N x 16 x 16 float; blob the weights (network.py);
// logits N x 10; partial, done: the tiles' shares of the logits and a counter per image (TR < 16).
template <typename T, int TR>
__device__ __forceinline__ void network(const float* __restrict__ x, const unsigned char* __restrict__ blob,
                                        float* logits, float* partial, int* done)
{
    typedef Tile<T, TR> G;
    using namespace net;
    const int tid = threadIdx.x, n = blockIdx.x / (IMG / TR), tile = blockIdx.x % (IMG / TR), r0 = tile * TR;
    if (net_dynamic_smem() < (unsigned)G::BYTES) __trap();  // the launcher gave too little shared memory
    const int* off = reinterpret_cast<const int*>(blob);
    auto w = [&](int section) { return blob + __ldg(off + section); };
    auto f = [&](int section) { return reinterpret_cast<const float*>(w(section)); };
    const float* inv = f(SCALARS);
    unsigned char* smem = net_smem;
    T* xs = reinterpret_cast<T*>(smem + G::X_AT);
    unsigned char *S = smem + G::S_AT, *R3p = smem + G::R3_AT, *R5p = smem + G::R5_AT;
    float* pool = reinterpret_cast<float*>(smem + G::POOL_AT);
    const bool int8_plan = sizeof(T) == 1;
    auto scale = [&](int section) { return int8_plan ? f(section) : nullptr; };

    // 0. Zeros in the planes (their borders, and rows outside the image, are the next layers' padding), and the
    //    image as the stem reads it (Tile::X_BYTES), in the plan's precision
    for (int e = tid; e < (G::POOL_AT - G::S_AT) / 16; e += NET_THREADS)
        reinterpret_cast<uint4*>(smem + G::S_AT)[e] = make_uint4(0u, 0u, 0u, 0u);
    auto pixel = [&](int r, int c) {  // the image's pixel, zero outside it
        return r >= 0 && r < IMG && c >= 0 && c < IMG ? __ldg(x + (n * IMG + r) * IMG + c) : 0.0f;
    };
    if constexpr (sizeof(T) == 1) {  // INT8: each stem pixel's taps (row r0 - 2 + e / 16, column e % 16), coded
        for (int e = tid; e < G::SR * IMG; e += NET_THREADS) {
            const int r = r0 - 3 + e / IMG, c = e % IMG - 1;
            unsigned word[3] = {0u, 0u, 0u};
#pragma unroll
            for (int k = 0; k < 9; ++k) {
                int8 code;
                keep(code, pixel(r + k / 3, c + k % 3), __ldg(inv + INV_IN));
                word[k / 4] |= (unsigned)(unsigned char)code << (8 * (k % 4));
            }
            reinterpret_cast<uint4*>(xs)[e] = make_uint4(word[0], word[1], word[2], 0u);
        }
    } else {
        for (int e = tid; e < G::XR * G::XC; e += NET_THREADS)
            put(xs + e, pixel(r0 - 3 + e / G::XC, e % G::XC - 1), __ldg(inv + INV_IN));
    }
    __syncthreads();

    // 1. The stem (3 x 3, 1 -> 32 channels) on the image rows of the tile and 2 more each side
    const int s_lo = max(0, 2 - r0), s_hi = min(G::SR, IMG + 2 - r0);  // plane rows in the image (stem, 5 x 5 red.)
    const int r3_lo = max(0, 1 - r0), r3_hi = min(G::R3R, IMG + 1 - r0);
    int slot = 0;
    const Out stem_out = to_plane(S, G::SC, G::SB, G::SP, f(B_STEM), scale(S_STEM), __ldg(inv + INV_STEM));
    if constexpr (sizeof(T) == 4)
        conv_simt<3, 1, G::XC, 1, 4, C, 4, false>(reinterpret_cast<const unsigned char*>(xs), 0, s_lo, s_hi,
                                                  f(W_STEM), C, slot, stem_out);
    else
        stem_mma<T, TR>(xs, s_lo, s_hi, reinterpret_cast<const uint2*>(w(W_STEM)), slot, stem_out);
    __syncthreads();

    // 2. What reads the stem: the 1 x 1 reductions (to planes R3, R5), the 1 x 1 branch, and the max pool + 1 x 1
    //    branch (both pooled at once); one list of work for the 8 warps
    slot = 0;
    const float *b_red = f(B_RED), *s_red = scale(S_RED);
    const float inv_cat = __ldg(inv + INV_CAT);
    layer<T, TR, 1, C, R3, G::SC, G::SB, G::SP>(S, 1, r3_lo, r3_hi, w(W_RED), RED, 0, slot,
        to_plane(R3p, G::R3C, G::R3B, G::R3P, b_red, s_red, __ldg(inv + INV_R3)));
    layer<T, TR, 1, C, R5, G::SC, G::SB, G::SP>(S, 0, s_lo, s_hi, w(W_RED), RED, R3, slot,
        to_plane(R5p, G::R5C, G::R5B, G::R5P, b_red + R3, s_red ? s_red + R3 : nullptr, __ldg(inv + INV_R5)));
    layer<T, TR, 1, C, B1, G::SC, G::SB, G::SP>(S, 2, 0, TR, w(W_RED), RED, R3 + R5, slot,
        to_pool(pool, AT_B1, b_red + R3 + R5, s_red ? s_red + R3 + R5 : nullptr, inv_cat));
    layer<T, TR, 1, C, BP, G::SC, G::SB, G::SP, true>(S, 2, 0, TR, w(W_PP), BP, 0, slot,
        to_pool(pool, AT_BP, f(B_PP), scale(S_PP), inv_cat));
    __syncthreads();

    // 3. The 3 x 3 and 5 x 5 branches, pooled
    slot = 0;
    layer<T, TR, 3, R3, B3, G::R3C, G::R3B, G::R3P>(R3p, 0, 0, TR, w(W_C3), B3, 0, slot,
        to_pool(pool, AT_B3, f(B_C3), scale(S_C3), inv_cat));
    layer<T, TR, 5, R5, B5, G::R5C, G::R5B, G::R5P>(R5p, 0, 0, TR, w(W_C5), B5, 0, slot,
        to_pool(pool, AT_B5, f(B_C5), scale(S_C5), inv_cat));
    __syncthreads();

    // 4. The head: the average pool and the dense layer, for this tile's rows
    head<TR>(pool, reinterpret_cast<float*>(smem + G::RED_AT), n, tile, r0, f(W_DENSE), f(B_DENSE), logits,
             partial, done);
}
// endregion

// network_<precision>_<rows a block>: N x 16 / TR blocks of 256 threads, Tile<T, TR>::BYTES of shared memory
#define NETWORK_KERNEL(SUFFIX, T, TR)                                                                          \
    extern "C" __global__ void __launch_bounds__(NET_THREADS, 2) network_##SUFFIX##_##TR(                     \
        const float* x, const unsigned char* blob, float* logits, float* partial, int* done)                  \
    { network<T, TR>(x, blob, logits, partial, done); }

NETWORK_KERNEL(f32, float, 16)
NETWORK_KERNEL(f32, float, 8)
NETWORK_KERNEL(f32, float, 4)
NETWORK_KERNEL(f32, float, 2)
NETWORK_KERNEL(f16, half, 16)
NETWORK_KERNEL(f16, half, 8)
NETWORK_KERNEL(f16, half, 4)
NETWORK_KERNEL(f16, half, 2)
NETWORK_KERNEL(i8, int8, 16)
NETWORK_KERNEL(i8, int8, 8)
NETWORK_KERNEL(i8, int8, 4)
NETWORK_KERNEL(i8, int8, 2)

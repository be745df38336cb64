// Lesson 10, the step after WMMA: FlashAttention's forward pass in FlashAttention-2's shape (Dao, 2023) on the
// warp-level MMA instruction of sm_80+, mma.sync.aligned.m16n8k16 (FP16 inputs, FP32 sums), written out in
// inline PTX. Launched by kernels/attention/flash.py (flash_mma).
//
// Q, K, V, O: (batch x heads) x N x D, FP16, row-major; LSE: (batch x heads) x N, FP32 (natural log); D is 64 or
// 128, any N (the last tile's missing keys are zero-filled and masked). What changed from the WMMA kernel
// (attention.cu, flash_forward): mma.sync's register layouts are documented, so nothing goes through shared
// memory but Q, K and V:
//   * a warp's rows of Q come by ldmatrix, into registers once (the variants of 16 rows a warp) or from shared
//     memory every tile (32 rows a warp, whose O alone takes 128 registers a thread at D = 128: FlashAttention-2
//     does the same);
//   * S = Q K^T lands in registers (mma.sync accumulators), K's fragments read by ldmatrix.x4;
//   * the online softmax runs on those registers: lane l holds rows l/4 and l/4 + 8 of each 16-row slice, two
//     adjacent columns of every 8-column tile, so a row's max and sum are the lane's own plus two shuffles
//     (lanes xor 1 and 2);
//   * P is rounded to half2 in registers and is at once the A operand of P V: the accumulators of two adjacent
//     8-key tiles are, register for register, the A fragment of one 16-key slice (FlashAttention-2's trick);
//   * V's fragments come from ldmatrix.x4.trans (V is row-major, P V wants it column-major: the load transposes);
//   * O stays in registers, rescaled row by row, normalised once at the end and written through shared memory
//     in 16-byte stores, with the log-sum-exp.
// K and V arrive by cp.async in a ring of STAGES tiles. Every tile's rows in shared memory are D + 8 halves apart
// (16 bytes of padding), so the eight rows an ldmatrix phase reads fall in eight different bank groups, and every
// fragment's address is the lane's own base plus a constant (an XOR swizzle would save the padding but cost
// registers for the per-step offsets). Causal: tiles wholly above the diagonal are never loaded, only tiles that
// cross it (or the end of the keys) are masked, and the row blocks with the most tiles are launched first.
//
// mma.sync.m16n8k16 needs sm_80: built for sm_75 (the course compiles every source for it) the kernels are stubs
// that trap, and gpus.step("10.mma") refuses before a launch.
#include <cuda_fp16.h>
#include "async_copy.cuh"
#include "fast_math.cuh"
#include "mma_sync.cuh"

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define GPUCOURSE_MMA_M16N8K16 1
#endif

namespace fa2 {

#ifdef GPUCOURSE_MMA_M16N8K16
// ------------------------------------------------------------------------------------------ the instructions

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// ROWS rows of D halves, from src (a row of global memory) on, into a tile of shared memory whose rows are LD =
// D + 8 halves apart, by the block's THREADS threads: thread i copies the 16-byte chunks i, i + THREADS, ... (row
// i / (D / 8) + k THREADS / (D / 8), chunk i % (D / 8)). Rows from ``valid`` on are zero-filled (their copies read
// nothing and point at src, a row that exists); a full tile skips that test.
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_rows(half* dst, const half* src, int valid)
{
    constexpr int CH = D / 8, LD = D + 8, STEP = THREADS / CH, ITERS = ROWS * CH / THREADS;
    static_assert(THREADS % CH == 0 && (ROWS * CH) % THREADS == 0, "a tile's chunks divide evenly among the threads");
    const unsigned r0 = threadIdx.x / CH, c = threadIdx.x % CH;
    dst += r0 * LD + c * 8;
    const half* from = src + r0 * D + c * 8;
    if (valid >= ROWS) {
#pragma unroll
        for (int it = 0; it < ITERS; ++it) cp_async16(dst + it * STEP * LD, from + it * STEP * D);
    } else {
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
            const bool ok = (int)r0 + it * STEP < valid;
            cp_async16_zfill(dst + it * STEP * LD, ok ? from + it * STEP * D : src, ok);
        }
    }
}
#endif  // GPUCOURSE_MMA_M16N8K16

// region: flash_mma
// One block: BM = 16 MT WARPS query rows of one (batch, head); warp w owns rows 16 MT w .. 16 MT (w + 1) - 1 (MT
// slices of 16). Per tile of BN keys, each warp: S = Q K^T (MT x BN/8 accumulators of 4 floats), mask (only tiles
// that cross the diagonal or the end of the keys), online softmax in registers, P V into O (MT x D/8
// accumulators). Shared memory: Q's tile (later O's, on its way out), then STAGES x (K tile, V tile).
template <int D, int WARPS, int MT, int BN, int STAGES, bool Q_IN_REGS, bool CAUSAL>
__device__ __forceinline__ void flash_mma(const half* __restrict__ Q, const half* __restrict__ K,
                                          const half* __restrict__ V, half* __restrict__ O, float* __restrict__ LSE,
                                          int N, float scale_log2)
{
#ifdef GPUCOURSE_MMA_M16N8K16
    constexpr int BM = 16 * MT * WARPS, THREADS = 32 * WARPS, KD = D / 16, NT = BN / 8, DT = D / 8, LD = D + 8;
    const float NEG_INF = __int_as_float(0xff800000);
    static_assert(STAGES >= 2 && BN % 16 == 0 && D % 16 == 0, "tile shapes");
    extern __shared__ __align__(128) unsigned char smem[];
    half* q_s = reinterpret_cast<half*>(smem);  // BM rows of LD halves
    half* kv_s = q_s + BM * LD;                 // [stage][K, V][BN rows of LD halves]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c4 = lane % 4;
    const int mb = CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;  // causal: the longest rows first
    const int m0 = mb * BM, w0 = m0 + warp * 16 * MT;                   // the block's and the warp's first row
    const size_t base = (size_t)blockIdx.y * N * D;
    const int last = CAUSAL ? min(N, m0 + BM) : N;  // keys this block sees: no key past its last row
    const int tiles = (last + BN - 1) / BN;

    // Q, then the first STAGES - 1 tiles of K and V, each its own group of copies
    load_rows<D, BM, THREADS>(q_s, Q + base + (size_t)m0 * D, N - m0);
    cp_async_commit();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < tiles) {
            load_rows<D, BN, THREADS>(kv_s + s * 2 * BN * LD, K + base + (size_t)s * BN * D, N - s * BN);
            load_rows<D, BN, THREADS>(kv_s + s * 2 * BN * LD + BN * LD, V + base + (size_t)s * BN * D, N - s * BN);
        }
        cp_async_commit();
    }

    // The 16 bytes this lane points ldmatrix at, in the first 16 x 16 block of each operand (every other block is
    // a constant offset from it): Q (A operand) lane l -> row l % 16, chunk l / 16; K (B, not transposed) -> key
    // (l / 16) 8 + l % 8, chunk (l / 8) % 2; V (B, transposed) -> key ((l / 8) % 2) 8 + l % 8, chunk l / 16.
    const unsigned q_lane = smem_addr(q_s + (warp * 16 * MT + lane % 16) * LD + (lane / 16) * 8);
    const unsigned k_lane = (((lane / 16) * 8 + lane % 8) * LD + ((lane / 8) % 2) * 8) * 2;
    const unsigned v_lane = ((((lane / 8) % 2) * 8 + lane % 8) * LD + (lane / 16) * 8) * 2;

    unsigned qf[Q_IN_REGS ? MT : 1][Q_IN_REGS ? KD : 1][4];
    float o[MT][DT][4];
    float m[MT][2], l[MT][2];  // running max (log2 units) and this lane's part of the running sum, rows g, g + 8
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int j = 0; j < DT; ++j) o[i][j][0] = o[i][j][1] = o[i][j][2] = o[i][j][3] = 0.0f;
        m[i][0] = m[i][1] = NEG_INF;
        l[i][0] = l[i][1] = 0.0f;
    }
    cp_async_wait<STAGES - 1>();  // Q has landed
    __syncthreads();
    if constexpr (Q_IN_REGS) {
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int kk = 0; kk < KD; ++kk)
                ldmatrix_x4(qf[i][kk], q_lane + (i * 16 * LD + kk * 16) * 2);
    }

    // the first tile that needs a mask: it holds a key past N, or (causal) a key past the block's first row
    const int masked_from = CAUSAL ? min(N / BN, m0 / BN) : N / BN;
#pragma unroll 1
    for (int t = 0; t < tiles; ++t) {
        cp_async_wait<STAGES - 2>();  // tile t has landed ...
        __syncthreads();              // ... for every thread, and every warp is done with tile t - 1's stage
        {
            const int nt = t + STAGES - 1, ns = nt % STAGES;
            if (nt < tiles) {
                load_rows<D, BN, THREADS>(kv_s + ns * 2 * BN * LD, K + base + (size_t)nt * BN * D, N - nt * BN);
                load_rows<D, BN, THREADS>(kv_s + ns * 2 * BN * LD + BN * LD, V + base + (size_t)nt * BN * D,
                                          N - nt * BN);
            }
            cp_async_commit();
        }
        const unsigned k_t = smem_addr(kv_s + (t % STAGES) * 2 * BN * LD) + k_lane;
        const unsigned v_t = k_t - k_lane + BN * LD * 2 + v_lane;
        const int key0 = t * BN;

        // S = Q K^T: MT x NT accumulators (rows of the warp x 8-key tiles)
        float s[MT][NT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j) s[i][j][0] = s[i][j][1] = s[i][j][2] = s[i][j][3] = 0.0f;
#pragma unroll (Q_IN_REGS || MT * BN <= 64 ? KD : 1)  // unrolled unless S and O leave no registers to spare
        for (int kk = 0; kk < KD; ++kk) {
            unsigned qa[Q_IN_REGS ? 1 : MT][4];
            if constexpr (!Q_IN_REGS) {
#pragma unroll
                for (int i = 0; i < MT; ++i) ldmatrix_x4(qa[i], q_lane + (i * 16 * LD + kk * 16) * 2);
            }
#pragma unroll
            for (int j2 = 0; j2 < BN / 16; ++j2) {
                unsigned kb[4];  // keys 16 j2 .. + 15, dims 16 kk .. + 15: B of tiles 2 j2 (kb 0, 1) and 2 j2 + 1
                ldmatrix_x4(kb, k_t + (j2 * 16 * LD + kk * 16) * 2);
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    if constexpr (Q_IN_REGS) {
                        mma16816(s[i][2 * j2], qf[i][kk], kb[0], kb[1]);
                        mma16816(s[i][2 * j2 + 1], qf[i][kk], kb[2], kb[3]);
                    } else {
                        mma16816(s[i][2 * j2], qa[i], kb[0], kb[1]);
                        mma16816(s[i][2 * j2 + 1], qa[i], kb[2], kb[3]);
                    }
                }
            }
        }

        // the online softmax on the accumulators; P = exp2(S scale - m) as half2, the A operand of P V
        unsigned p[MT][BN / 16][4];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[i][j][e] *= scale_log2;
            if (t >= masked_from) {  // keys past N, and (causal) keys past the row: -inf
                // element (j, e) of row 16 i + g + 8 h is key key0 + 2 c4 + 8 j + e % 2: kept while 8 j + e % 2 < end
                const int past_n = N - key0 - 2 * c4, past_row = w0 + g + 1 - key0 - 2 * c4;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int end = CAUSAL ? min(past_n, past_row + 16 * i + 8 * h) : past_n;
#pragma unroll
                    for (int j = 0; j < NT; ++j)
#pragma unroll
                        for (int e = 2 * h; e < 2 * h + 2; ++e)
                            if (8 * j + e % 2 >= end) s[i][j][e] = NEG_INF;
                }
            }
            float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) mx[e / 2] = fmaxf(mx[e / 2], s[i][j][e]);
            float alpha[2], shift[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // the row's four lanes (xor 1, 2) agree on its max
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 1));
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 2));
                const float m_new = fmaxf(m[i][h], mx[h]);
                shift[h] = m_new == NEG_INF ? 0.0f : m_new;  // a row that has seen only -inf so far
                alpha[h] = ex2(m[i][h] - shift[h]);          // 0 on a row's first tile (m = -inf)
                m[i][h] = m_new;
            }
#pragma unroll
            for (int j = 0; j < DT; ++j) {
                o[i][j][0] *= alpha[0];
                o[i][j][1] *= alpha[0];
                o[i][j][2] *= alpha[1];
                o[i][j][3] *= alpha[1];
            }
            float sum[2] = {0.0f, 0.0f};
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {  // tiles 2 kk and 2 kk + 1 are the A fragment of keys 16 kk ..
                float e[8];
#pragma unroll
                for (int x = 0; x < 8; ++x) {
                    e[x] = ex2(s[i][2 * kk + x / 4][x % 4] - shift[(x / 2) % 2]);
                    sum[(x / 2) % 2] += e[x];
                }
                p[i][kk][0] = half2_bits(e[0], e[1]);
                p[i][kk][1] = half2_bits(e[2], e[3]);
                p[i][kk][2] = half2_bits(e[4], e[5]);
                p[i][kk][3] = half2_bits(e[6], e[7]);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) l[i][h] = l[i][h] * alpha[h] + sum[h];  // this lane's columns only
        }

        // O += P V: V's fragments transposed by ldmatrix
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
            for (int dj = 0; dj < D / 16; ++dj) {
                unsigned vb[4];  // keys 16 kk .. + 15, dims 16 dj .. + 15: B of dim tiles 2 dj (vb 0, 1) and 2 dj + 1
                ldmatrix_x4_trans(vb, v_t + (kk * 16 * LD + dj * 16) * 2);
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    mma16816(o[i][2 * dj], p[i][kk], vb[0], vb[1]);
                    mma16816(o[i][2 * dj + 1], p[i][kk], vb[2], vb[3]);
                }
            }
        }
    }
    cp_async_wait<0>();  // no copy left in flight (the last groups are empty)

    // normalise once; O through this warp's rows of Q's tile (only this warp read them), then 16-byte stores
    half* o_s = q_s + warp * 16 * MT * LD;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        float inv[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = l[i][h];
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            sum += __shfl_xor_sync(0xffffffff, sum, 2);
            inv[h] = sum > 0.0f ? 1.0f / sum : 0.0f;
            const int row = w0 + 16 * i + g + 8 * h;
            if (c4 == 0 && row < N)  // natural log: log2 units times ln 2
                LSE[(size_t)blockIdx.y * N + row] = sum > 0.0f ? (m[i][h] + __log2f(sum)) * 0.6931471805599453f
                                                               : NEG_INF;
        }
#pragma unroll
        for (int j = 0; j < DT; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 16 * i + g + 8 * h;
                *reinterpret_cast<unsigned*>(o_s + r * LD + j * 8 + 2 * c4) =
                    half2_bits(o[i][j][2 * h] * inv[h], o[i][j][2 * h + 1] * inv[h]);
            }
    }
    __syncwarp();
#pragma unroll
    for (int i = lane; i < 16 * MT * DT; i += 32) {
        const int r = i / DT, c = i % DT;
        if (w0 + r < N)
            *reinterpret_cast<uint4*>(O + base + (size_t)(w0 + r) * D + c * 8) =
                *reinterpret_cast<const uint4*>(o_s + r * LD + c * 8);
    }
#else
    __trap();  // built for an architecture without mma.sync.m16n8k16: the launcher refuses before it gets here
#endif
}
// endregion

}  // namespace fa2

// The variants: (warps, 16-row slices a warp, keys a tile, stages of K and V, Q's fragments kept in registers,
// blocks an SM that the registers must allow). kernels/attention/flash.py's MMA_VARIANTS holds the same table (a
// test keeps the two equal).
#define FLASH_MMA_w4x2_n128 4, 2, 128, 2, false, 1   // 128 rows, 32 a warp, 128 keys: FlashAttention-2's d = 64 shape
#define FLASH_MMA_w4x2_n64 4, 2, 64, 2, false, 1     // 128 rows, 32 a warp, 64 keys: FlashAttention-2's d = 128 shape
#define FLASH_MMA_w4x2_n32 4, 2, 32, 2, false, 1     // ... 32 keys a tile: fewer registers for S
#define FLASH_MMA_w4x2_n32_s3 4, 2, 32, 3, false, 1  // ... three tiles of K and V in flight
#define FLASH_MMA_w8_n128 8, 1, 128, 2, true, 1      // 128 rows, 16 a warp, Q in registers
#define FLASH_MMA_w8_n64 8, 1, 64, 2, true, 1        // ... 64 keys a tile
#define FLASH_MMA_w8_n64_qs 8, 1, 64, 2, false, 2    // ... Q re-read every tile, two blocks an SM (<= 128 registers)
#define FLASH_MMA_w4_n64 4, 1, 64, 2, true, 1        // 64 rows, 16 a warp, Q in registers

#define FLASH_MMA_PAIR_(D, W, MT, BN, ST, QR, MINB, NAME)                                                             \
    extern "C" __global__ void __launch_bounds__(W * 32, MINB) NAME(const half* q, const half* k, const half* v,      \
                                                                    half* o, float* lse, int n, float scale_log2)  \
    {                                                                                                                \
        fa2::flash_mma<D, W, MT, BN, ST, QR, false>(q, k, v, o, lse, n, scale_log2);                                 \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(W * 32, MINB) NAME##_causal(const half* q, const half* k,            \
                                                                             const half* v, half* o, float* lse,     \
                                                                             int n, float scale_log2)                \
    {                                                                                                                \
        fa2::flash_mma<D, W, MT, BN, ST, QR, true>(q, k, v, o, lse, n, scale_log2);                                  \
    }
#define FLASH_MMA_PAIR(D, CFG, NAME) FLASH_MMA_PAIR_(D, CFG, NAME)
#define FLASH_MMA_VARIANT(D, V) FLASH_MMA_PAIR(D, FLASH_MMA_##V, flash_mma_d##D##_##V)
#define FLASH_MMA_DEFAULT(D, V) FLASH_MMA_PAIR(D, FLASH_MMA_##V, flash_mma_d##D)

// flash_mma_d64, flash_mma_d128 (and _causal): the default of each head dim, one line each; flash.py's MMA_DEFAULT
// names the same variants (a test keeps them equal)
FLASH_MMA_DEFAULT(64, w4x2_n128)
FLASH_MMA_DEFAULT(128, w4x2_n64)

// flash_mma_d<D>_<variant> (and _causal): the variants, for the benchmark to choose from
FLASH_MMA_VARIANT(64, w4x2_n128)
FLASH_MMA_VARIANT(64, w4x2_n64)
FLASH_MMA_VARIANT(64, w8_n128)
FLASH_MMA_VARIANT(64, w8_n64_qs)
FLASH_MMA_VARIANT(128, w4x2_n64)
FLASH_MMA_VARIANT(128, w4x2_n32)
FLASH_MMA_VARIANT(128, w4x2_n32_s3)
FLASH_MMA_VARIANT(128, w8_n64)
FLASH_MMA_VARIANT(128, w8_n64_qs)
FLASH_MMA_VARIANT(128, w4_n64)

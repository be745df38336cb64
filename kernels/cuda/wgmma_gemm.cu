// gpucourse-arch: sm_90a
// Lesson 3, the Hopper step: C = A B on warpgroup MMA (wgmma.mma_async), fed by the Tensor Memory
// Accelerator (cp.async.bulk.tensor) through a ring of shared-memory stages guarded by mbarriers.
//
// A: M x K, FP16, row-major (K-major).  B: K x N, FP16, row-major ("kn", MN-major for the MMA) or N x K
// row-major ("nk", K-major: B transposed, the layout cuBLAS calls "T").  C: M x N, FP32, row-major.
//
// One block computes a BM x BN tile of C with 1 + BM/64 warpgroups (128 threads each):
//   * warpgroup 0 is the PRODUCER: one of its threads asks the TMA for the next BK = 64 slice of A and B
//     (a 2-D box each, swizzled by the copy engine into the 128-byte pattern the MMA reads) and names the
//     stage's "full" mbarrier, which completes when the bytes have landed;
//   * warpgroups 1.. are CONSUMERS: each waits on "full", issues 4 wgmma.mma_async (k = 16 each) on its
//     64 rows of A against all BN columns of B, waits for them, and arrives on the stage's "empty" mbarrier
//     so that the producer may overwrite it.
// The accumulators (64 x BN FP32 per warpgroup: BN / 2 registers a thread) never leave the registers until
// the end, when each thread stores its fragment to C. setmaxnreg moves registers from the producer, which
// needs few, to the consumers, which need many.
//
// The TMA descriptors (CUtensorMap, 128 bytes) are made on the host with cuTensorMapEncodeTiled and passed
// by value as __grid_constant__ parameters (kernels/tensor_cores.py). The tensor map zero-fills reads
// outside the matrices, and stores are guarded, so M, N and K need not be multiples of the tile (the TMA
// needs row strides that are multiples of 16 bytes: K, and N for "kn", multiples of 8).
//
// Everything below needs sm_90a (compute capability 9.0 exactly); compiled for any other architecture the
// kernels are empty stubs that trap (tests/test_gpu_archs.py compiles every source for every GPU).

struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GPUCOURSE_WGMMA 1
#endif

namespace hopper {

#ifdef GPUCOURSE_WGMMA
constexpr int BK = 64;  // K per stage: 64 FP16 = 128 bytes, one row of the 128-byte swizzle pattern

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// ---------------------------------------------------------------------------- mbarriers
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
// This thread's arrival, and the number of bytes the TMA will deliver before the phase may complete.
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// Wait until the phase with this parity (0, 1, 0, ... for the 1st, 2nd, 3rd use) has completed.
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  unsigned done = 0;
  const unsigned addr = smem_addr(bar);
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  }
}

// ------------------------------------------------------------------- the tensor memory accelerator
// One 2-D box of the tensor that ``map`` describes, at element coordinates (c0 along the contiguous
// dimension, c1 along the rows), into shared memory at dst; completion is counted in bytes on ``bar``.
__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap* map, unsigned long long* bar, int c0,
                                            int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}

// --------------------------------------------------------------- shared-memory matrix descriptors
// 64 bits that tell wgmma where an operand lies in shared memory and how it is laid out: the start address,
// the "leading" and "stride" byte offsets between 8 x 128-byte core blocks, and the swizzle (1 << 62:
// the 128-byte pattern, the one the TMA wrote). Addresses and offsets are stored divided by 16.
__device__ __forceinline__ unsigned long long desc_field(unsigned long long x) { return (x & 0x3FFFF) >> 4; }
__device__ __forceinline__ unsigned long long make_desc(unsigned addr, unsigned lbo, unsigned sbo) {
  return desc_field(addr) | (desc_field(lbo) << 16) | (desc_field(sbo) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// D (64 x 128, FP32, in registers) += A (64 x 16) B (16 x 128), both FP16 in shared memory, named by
// their descriptors. TB: 0 if B is stored K-major (N x K), 1 if MN-major (K x N).
template <int TB>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[8][8], unsigned long long da, unsigned long long db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, %67;\n"
      "}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[0][4]), "+f"(d[0][5]), "+f"(d[0][6]), "+f"(d[0][7]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[1][4]), "+f"(d[1][5]), "+f"(d[1][6]), "+f"(d[1][7]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[2][4]), "+f"(d[2][5]), "+f"(d[2][6]), "+f"(d[2][7]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[3][4]), "+f"(d[3][5]), "+f"(d[3][6]), "+f"(d[3][7]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[4][4]), "+f"(d[4][5]), "+f"(d[4][6]), "+f"(d[4][7]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[5][4]), "+f"(d[5][5]), "+f"(d[5][6]), "+f"(d[5][7]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[6][4]), "+f"(d[6][5]), "+f"(d[6][6]), "+f"(d[6][7]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[7][4]), "+f"(d[7][5]), "+f"(d[7][6]), "+f"(d[7][7])
      : "l"(da), "l"(db), "r"(scale_d), "n"(TB));
}

// D (64 x 256, FP32, in registers) += A (64 x 16) B (16 x 256), both FP16 in shared memory, named by
// their descriptors. TB: 0 if B is stored K-major (N x K), 1 if MN-major (K x N).
template <int TB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[16][8], unsigned long long da, unsigned long long db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, %131;\n"
      "}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[0][4]), "+f"(d[0][5]), "+f"(d[0][6]), "+f"(d[0][7]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[1][4]), "+f"(d[1][5]), "+f"(d[1][6]), "+f"(d[1][7]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[2][4]), "+f"(d[2][5]), "+f"(d[2][6]), "+f"(d[2][7]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[3][4]), "+f"(d[3][5]), "+f"(d[3][6]), "+f"(d[3][7]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[4][4]), "+f"(d[4][5]), "+f"(d[4][6]), "+f"(d[4][7]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[5][4]), "+f"(d[5][5]), "+f"(d[5][6]), "+f"(d[5][7]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[6][4]), "+f"(d[6][5]), "+f"(d[6][6]), "+f"(d[6][7]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[7][4]), "+f"(d[7][5]), "+f"(d[7][6]), "+f"(d[7][7]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[8][4]), "+f"(d[8][5]), "+f"(d[8][6]), "+f"(d[8][7]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[9][4]), "+f"(d[9][5]), "+f"(d[9][6]), "+f"(d[9][7]),
        "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[10][4]), "+f"(d[10][5]), "+f"(d[10][6]), "+f"(d[10][7]),
        "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[11][4]), "+f"(d[11][5]), "+f"(d[11][6]), "+f"(d[11][7]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[12][4]), "+f"(d[12][5]), "+f"(d[12][6]), "+f"(d[12][7]),
        "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[13][4]), "+f"(d[13][5]), "+f"(d[13][6]), "+f"(d[13][7]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[14][4]), "+f"(d[14][5]), "+f"(d[14][6]), "+f"(d[14][7]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[15][4]), "+f"(d[15][5]), "+f"(d[15][6]), "+f"(d[15][7])
      : "l"(da), "l"(db), "r"(scale_d), "n"(TB));
}

template <int BN, int TB>
__device__ __forceinline__ void wgmma_k16(float (&d)[BN / 16][8], unsigned long long da, unsigned long long db,
                                          int scale_d) {
  if constexpr (BN == 256) {
    wgmma_m64n256k16<TB>(d, da, db, scale_d);
  } else {
    wgmma_m64n128k16<TB>(d, da, db, scale_d);
  }
}
#endif  // GPUCOURSE_WGMMA

// BM x BN tile of C, STAGES deep ring of (A, B) slices; B_KN: B is K x N (MN-major) rather than N x K.
template <int BM, int BN, int STAGES, bool B_KN>
__device__ __forceinline__ void gemm_tile(const TensorMap* tmA, const TensorMap* tmB, float* __restrict__ C, int M,
                                          int N, int K, int group_m) {
#ifdef GPUCOURSE_WGMMA
  constexpr int CONSUMERS = BM / 64;
  constexpr unsigned A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
  extern __shared__ unsigned char smem_raw[];
  // 128-byte swizzled tiles must start on a 1024-byte boundary (the pattern repeats every 8 rows of 128 B)
  unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  unsigned char* sA = smem;                       // STAGES x [BM][64] FP16
  unsigned char* sB = smem + STAGES * A_BYTES;    // STAGES x [BN][64] (nk) or [BN/64][64][64] (kn) FP16
  unsigned long long* full = reinterpret_cast<unsigned long long*>(sB + STAGES * B_BYTES);
  unsigned long long* empty = full + STAGES;

  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);            // the producer's arrive + the TMA's bytes
      mbar_init(&empty[s], CONSUMERS);   // one arrive per consumer warpgroup
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the async proxy
  }
  __syncthreads();

  // Which tile: blocks run in groups of group_m tile-rows, so that the blocks resident at one time share
  // rows of A and columns of B in the L2 cache.
  const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  const int per_group = group_m * tiles_n;
  const int first_m = (blockIdx.x / per_group) * group_m;
  const int rows_here = min(tiles_m - first_m, group_m);
  const int in_group = blockIdx.x % per_group;
  const int m0 = (first_m + in_group % rows_here) * BM, n0 = (in_group / rows_here) * BN;
  const int kblocks = (K + BK - 1) / BK;

  if (wg == 0) {  // ------------------------------------------------------------------ producer
    if constexpr (CONSUMERS > 1) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (tid == 0) {
      for (int kb = 0; kb < kblocks; ++kb) {
        const int s = kb % STAGES;
        if (kb >= STAGES) mbar_wait(&empty[s], ((kb / STAGES) + 1) & 1);  // consumers are done with it
        mbar_expect_tx(&full[s], A_BYTES + B_BYTES);
        tma_load_2d(sA + s * A_BYTES, tmA, &full[s], kb * BK, m0);
        if constexpr (B_KN) {
          for (int j = 0; j < BN / 64; ++j)  // boxes of 64 columns x 64 rows of B
            tma_load_2d(sB + s * B_BYTES + j * (BK * 128), tmB, &full[s], n0 + 64 * j, kb * BK);
        } else {
          tma_load_2d(sB + s * B_BYTES, tmB, &full[s], kb * BK, n0);
        }
      }
    }
  } else {  // ---------------------------------------------------------------------- consumers
    if constexpr (CONSUMERS > 1) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int c = wg - 1;
    float d[BN / 16][8];
#pragma unroll
    for (int i = 0; i < BN / 16; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) d[i][j] = 0.0f;
    for (int kb = 0; kb < kblocks; ++kb) {
      const int s = kb % STAGES;
      mbar_wait(&full[s], (kb / STAGES) & 1);  // the TMA's bytes have landed
      const unsigned a0 = smem_addr(sA + s * A_BYTES + c * 64 * 128);  // this warpgroup's 64 rows
      const unsigned b0 = smem_addr(sB + s * B_BYTES);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        // K-major, 128-byte swizzle: k advances 16 elements = 32 bytes inside the swizzled row; the 8-row
        // core blocks lie 1024 bytes apart (SBO); LBO is unused for this layout.
        const unsigned long long da = make_desc(a0 + kk * 32, 16, 1024);
        unsigned long long db;
        if constexpr (B_KN)  // MN-major: k advances 16 rows of 128 bytes; the next 64 columns are a box further
          db = make_desc(b0 + kk * 16 * 128, BK * 128, 1024);
        else
          db = make_desc(b0 + kk * 32, 16, 1024);
        wgmma_k16<BN, B_KN ? 1 : 0>(d, da, db, 1);
      }
      wgmma_commit();
      wgmma_wait<0>();  // this stage's MMAs have read their operands ...
      if (tid == 0) mbar_arrive(&empty[s]);  // ... so the producer may refill it
    }
    // Store the fragment: warp w of the warpgroup holds rows 16w .. 16w + 15; lane l holds rows l/4 and
    // l/4 + 8, columns 8i + 2 (l % 4) and the next one, for i = 0 .. BN/8 - 1.
    const int warp = tid / 32, lane = tid % 32;
    const int row = m0 + c * 64 + warp * 16 + lane / 4;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      const int col = n0 + 8 * i + 2 * (lane % 4);
      const float* v = &d[i / 2][(i % 2) * 4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row + 8 * h;
        if (r < M) {
          float* out = C + static_cast<size_t>(r) * N + col;
          if (col + 1 < N && (N % 2) == 0) {
            *reinterpret_cast<float2*>(out) = make_float2(v[2 * h], v[2 * h + 1]);
          } else {
            if (col < N) out[0] = v[2 * h];
            if (col + 1 < N) out[1] = v[2 * h + 1];
          }
        }
      }
    }
  }
#else
  __trap();  // built for an architecture without wgmma: the launcher refuses before it gets here
#endif
}

}  // namespace hopper

// The kernels the course launches (kernels/tensor_cores.py, WGMMA_CONFIGS): tile BM x BN x 64, stages, B layout.
#define WGMMA_GEMM(BM, BN, S, LAYOUT, KN)                                                                        \
  extern "C" __global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)                                         \
      wgmma_##BM##x##BN##x64_s##S##_##LAYOUT(const __grid_constant__ TensorMap tmA,                             \
                                             const __grid_constant__ TensorMap tmB, float* C, int M, int N,    \
                                             int K, int group_m) {                                             \
    hopper::gemm_tile<BM, BN, S, KN>(&tmA, &tmB, C, M, N, K, group_m);                                        \
  }

WGMMA_GEMM(128, 256, 4, kn, true)
WGMMA_GEMM(128, 256, 4, nk, false)
WGMMA_GEMM(128, 256, 3, kn, true)
WGMMA_GEMM(128, 256, 2, kn, true)
WGMMA_GEMM(128, 256, 1, kn, true)
WGMMA_GEMM(64, 256, 4, kn, true)
WGMMA_GEMM(128, 128, 4, kn, true)
WGMMA_GEMM(128, 128, 6, kn, true)

// What lesson 4's Hopper GEMMs share beyond hopper.cuh: the FP16 GEMM (tensor_cores_wgmma.cu) and the FP8 GEMM
// (tensor_cores_fp8.cu), one block per tile or persistent, and lesson 5's persistent convolution
// (convolution_wgmma.cu), a GEMM whose A tiles are gathered from the image tap by tap (gpucourse/cuda_c.py copies this
// file into each source that includes it):
//   * GroupedTiles: the tiles of C in the grouped order (group_m tile-rows at a time, left to right, so that the blocks
//     resident at one time share rows of A and columns of B in the L2 cache) and tile t's first row and column;
//   * Ring: the STAGES shared-memory stages between the producer and the consumers, their "full" and "empty"
//     mbarriers, and the phase of each use, from a count of slices that runs on over all of a block's tiles;
//   * produce_tiles: the persistent producer, which walks this block's tiles (blockIdx.x, blockIdx.x + gridDim.x, ...)
//     and loads every slice of each through the ring, the next tile's first slices while the consumers store C (a
//     tile's state, made once a tile and carried from slice to slice, where its loads need more than the tile's
//     origin: the convolution's pixel and tap);
//   * ClusterTiles, and Ring and produce_tiles with CLUSTER = 2: the cluster GEMMs' schedule, two blocks of a cluster
//     (thread-block cluster of 2 along M) taking the two tiles of one column of C on adjacent rows, in lockstep,
//     each loading its own A and half of the B they share, multicast by the TMA into both blocks' stages (a stage is
//     refilled only when the consumers of both blocks have released it);
//   * StreamK, for_each_unit, produce_units, sk_store_piece, sk_add_pieces: the last wave's tiles shared out among
//     all the blocks by slices (stream-K), the pieces of a tile summed by its owner before its epilogue;
//   * store_tile_tma: the epilogue that writes a consumer warpgroup's 64 rows of C through shared memory, 64 columns
//     at a time, by stmatrix in the TMA's 128-byte swizzle, each piece stored by the TMA (clipped at C's edges).
#pragma once
#include "fast_math.cuh"  // half2_bits
#include "hopper.cuh"

namespace hopper {

// The stream-K tail's state (below, with the functions that use it).
struct StreamK {
  float* partials;  // gridDim.x x consumers x 64 x BN FP32: block b's first piece, if it is not a tile's first
  int* flags;       // gridDim.x x consumers: epoch once block b's consumer has written its piece
  int sk_tiles;     // the last sk_tiles tiles are shared out by slices (0: every tile whole, to a block)
  int epoch;        // a number no earlier launch on these flags used
};

#ifdef GPUCOURSE_WGMMA
template <int BM, int BN>
struct GroupedTiles {
  int tiles_m, tiles_n, count, group_m;
  __device__ __forceinline__ GroupedTiles(int M, int N, int group_m_)
      : tiles_m((M + BM - 1) / BM), tiles_n((N + BN - 1) / BN), count(tiles_m * tiles_n), group_m(group_m_) {}
  // The persistent kernels' walk: block b takes tiles b, b + gridDim.x, ...
  __device__ __forceinline__ int first() const { return blockIdx.x; }
  __device__ __forceinline__ int step() const { return gridDim.x; }
  // Tile t's first row m0 and column n0 of C; true (the tile lies in C: ClusterTiles' may not).
  __device__ __forceinline__ bool origin(int t, int& m0, int& n0) const {
    const int per_group = group_m * tiles_n;
    const int first_m = (t / per_group) * group_m;
    const int rows_here = min(tiles_m - first_m, group_m);
    const int in_group = t % per_group;
    m0 = (first_m + in_group % rows_here) * BM;
    n0 = (in_group / rows_here) * BN;
    return true;
  }
};

// The cluster GEMMs' tiles: a cluster of CLUSTER blocks (cluster dims (CLUSTER, 1, 1)) takes CLUSTER tiles of one
// column of C on adjacent rows, a "cluster tile" of CLUSTER BM x BN, whose blocks share B's BN rows (or columns) of
// every slice. Cluster tiles go in GroupedTiles' order (group_m tile-rows a group, as the one-block kernels': group_m
// / CLUSTER rows of cluster tiles, rounded up), cluster c taking c, c + clusters, ...; the block of rank r in its
// cluster takes the cluster tile's r-th tile. With a number of tile-rows that is not a multiple of CLUSTER, the last
// row of cluster tiles reaches past C: the blocks whose tile lies wholly below C's last row still load it (the TMA
// fills rows outside A with zeros, and counts their bytes, so the partner gets its B and every barrier its bytes) and
// run its MMAs, and store nothing.
template <int BM, int BN, int CLUSTER>
struct ClusterTiles {
  GroupedTiles<CLUSTER * BM, BN> clusters;
  int count, M;
  unsigned rank;
  __device__ __forceinline__ ClusterTiles(int M_, int N, int group_m)
      : clusters(M_, N, (group_m + CLUSTER - 1) / CLUSTER), count(clusters.count), M(M_), rank(cluster_rank()) {}
  __device__ __forceinline__ int first() const { return static_cast<int>(cluster_id_x()); }
  __device__ __forceinline__ int step() const { return static_cast<int>(cluster_count_x()); }
  // This block's tile of cluster tile t: its first row m0 and column n0; false where it lies past C's last row.
  __device__ __forceinline__ bool origin(int t, int& m0, int& n0) const {
    clusters.origin(t, m0, n0);
    m0 += static_cast<int>(rank) * BM;
    return m0 < M;
  }
};

// The tiles a persistent kernel walks: GroupedTiles for one block, ClusterTiles for a cluster of several.
template <int BM, int BN, int CLUSTER>
struct TilesOf {
  using type = ClusterTiles<BM, BN, CLUSTER>;
};
template <int BM, int BN>
struct TilesOf<BM, BN, 1> {
  using type = GroupedTiles<BM, BN>;
};

// A consumer warpgroup's release of a stage (one thread): an arrival on the stage's empty mbarrier, or, in a cluster
// of CLUSTER blocks, on the one at the same offset in every block of the cluster, since each block's producer fills
// (through the TMA's multicast) the stage in all of them.
template <int CLUSTER>
__device__ __forceinline__ void release_stage(unsigned long long* empty) {
  if constexpr (CLUSTER == 1) {
    mbar_arrive(empty);
  } else {
#pragma unroll
    for (unsigned r = 0; r < CLUSTER; ++r) mbar_arrive_remote(empty, r);
  }
}

// Slice g of a block's K loop (counted over all its tiles) lives in stage g % STAGES, in that stage's (g / STAGES)-th
// use: the phase whose parity each wait names.
//
// CLUSTER = 2 (the cluster GEMMs): the two blocks of a cluster walk the same number of slices, and each block's stage s
// is filled by both producers (its own A and half of B, the partner's half of B by multicast). So a stage's empty
// barrier counts the consumers of both blocks (consumers x 2 arrivals a phase, each consumer arriving on both blocks'
// barriers), and a producer refills stage s only when the consumers of both blocks have released its previous use:
// neither producer runs more than STAGES slices ahead of either block's consumers. The full barrier expects this
// block's A and both halves of B; the partner's half may land before this block's producer has announced the phase's
// bytes (the phase cannot complete before that arrival: the count of bytes still due may go below zero meanwhile), but
// never before the previous phase completed (the partner's producer waited for this block's consumers, which waited
// for that phase).
template <int STAGES, int CLUSTER = 1>
struct Ring {
  unsigned long long* full;   // the producer's arrival and the TMA's bytes
  unsigned long long* empty;  // one arrival per consumer warpgroup (of each block of the cluster)
  // By one thread, before a __syncthreads (CLUSTER > 1: before a cluster_sync, so that no block's producer or consumers
  // touch the partner's barriers before they exist).
  __device__ __forceinline__ void init(unsigned consumers) const {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], consumers * CLUSTER);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the async proxy (and the cluster)
  }
  // The producer, for slice g: wait until the consumers are done with the stage's previous use, then announce the
  // bytes the TMA will deliver. Returns the stage.
  __device__ __forceinline__ int acquire(int g, unsigned bytes) const {
    const int s = g % STAGES;
    if (g >= STAGES) mbar_wait(&empty[s], ((g / STAGES) + 1) & 1);
    mbar_expect_tx(&full[s], bytes);
    return s;
  }
  // A consumer, for slice g: wait until the TMA's bytes have landed. Returns the stage.
  __device__ __forceinline__ int wait_full(int g) const {
    const int s = g % STAGES;
    mbar_wait(&full[s], (g / STAGES) & 1);
    return s;
  }
  // One thread of each consumer warpgroup, once its MMAs have read stage s: the producer may refill it.
  __device__ __forceinline__ void release(int s) const { release_stage<CLUSTER>(&empty[s]); }
};

// The persistent producer (one thread): every slice of every tile of this block (tiles: GroupedTiles, or the
// cluster GEMMs' ClusterTiles), in order, through the ring.
// begin(m0, n0) is called once a tile, at its first row m0 and column n0, and returns the tile's state (the
// convolution's: the output pixel of the tile's first row, and where in the taps and channels its next slice lies);
// load(s, bar, kb, m0, n0, state) then issues the TMA loads of slice kb of the tile into stage s, completing on bar,
// and may move the state on to slice kb + 1 (it gets it by reference).
template <typename Tiles, int STAGES, int CLUSTER, typename Begin, typename Load>
__device__ __forceinline__ void produce_tiles(const Tiles& tiles, const Ring<STAGES, CLUSTER>& ring, int kblocks,
                                              unsigned bytes, Begin begin, Load load) {
  int g = 0;  // slices loaded so far over all of this block's tiles: the ring's position and phase
  for (int t = tiles.first(); t < tiles.count; t += tiles.step()) {
    int m0, n0;
    tiles.origin(t, m0, n0);
    auto state = begin(m0, n0);
    for (int kb = 0; kb < kblocks; ++kb, ++g) {
      const int s = ring.acquire(g, bytes);
      load(s, &ring.full[s], kb, m0, n0, state);
    }
  }
}
// The GEMMs': a slice needs only its tile's origin and its index, load(s, bar, kb, m0, n0).
template <typename Tiles, int STAGES, int CLUSTER, typename Load>
__device__ __forceinline__ void produce_tiles(const Tiles& tiles, const Ring<STAGES, CLUSTER>& ring, int kblocks,
                                              unsigned bytes, Load load) {
  produce_tiles(tiles, ring, kblocks, bytes, [](int, int) { return 0; },
                [&](int s, unsigned long long* bar, int kb, int m0, int n0, int) { load(s, bar, kb, m0, n0); });
}

// ------------------------------------------------------------------ stream-K: the last wave shared out by slices
// T tiles on P blocks (one an SM) make T / P waves; when T is not a multiple of P, the last wave runs T % P tiles
// and leaves the other SMs idle (2,048 tiles of 128 x 256 on 132 SMs: 15.5 waves, timed as 16). With a stream-K
// tail, the first T - sk_tiles tiles go to the blocks in turn as before (block b: b, b + P, ...), and the slices of
// the last sk_tiles tiles, sk_tiles x kblocks of them in one row (tile by tile, each tile's slices in order), are
// cut into P runs of equal length, block b taking run b. A run may start or end inside a tile: then a tile's slices
// are summed by several blocks, a "piece" each. The block whose piece holds the tile's first slice (the tile's owner:
// the piece is the last of its run) adds the others' sums to its own and stores C; every other piece is the first
// of its block's run, and that block writes its FP32 sums to ``partials`` (its consumers' accumulators, in their
// registers' order) and then marks ``flags`` with this launch's ``epoch``. The owner waits for those marks, which
// are set by blocks with higher indices and never wait themselves: no cycle, as long as every block of the grid is
// resident at once (a persistent launch, at most a block an SM). The owner adds the pieces in the order of the
// blocks, so the same launch on the same grid gives the same bits every time.

// Where block b's run of the stream-K slices begins (b = gridDim.x: where the last one ends).
__device__ __forceinline__ long long sk_run_start(int b, long long slices) {
  return slices * b / gridDim.x;
}

// The units of work of this block, in order: f(t, k0, k1) for tile t's slices k0 .. k1 - 1. First the whole tiles
// (b, b + P, ... below count - sk_tiles), then the block's run of the stream-K tail, piece by piece.
template <typename F>
__device__ __forceinline__ void for_each_unit(int count, int kblocks, int sk_tiles, F f) {
  const int whole = count - sk_tiles;
  const long long slices = static_cast<long long>(sk_tiles) * kblocks;
  int t = static_cast<int>(blockIdx.x);
  long long i = sk_run_start(blockIdx.x, slices);
  const long long end = sk_run_start(blockIdx.x + 1, slices);
  for (;;) {  // one call of f, so that the mainloop it holds is compiled once
    int tile, k0, k1;
    if (t < whole) {
      tile = t, k0 = 0, k1 = kblocks;
      t += static_cast<int>(gridDim.x);
    } else if (i < end) {
      tile = whole + static_cast<int>(i / kblocks), k0 = static_cast<int>(i % kblocks);
      k1 = static_cast<int>(min(static_cast<long long>(kblocks), k0 + (end - i)));
      i += k1 - k0;
    } else {
      break;
    }
    f(tile, k0, k1);
  }
}

// The persistent producer under a stream-K tail: produce_tiles' loads, unit by unit (tiles: GroupedTiles).
template <typename Tiles, int STAGES, typename Load>
__device__ __forceinline__ void produce_units(const Tiles& tiles, const Ring<STAGES, 1>& ring, int kblocks,
                                              int sk_tiles, unsigned bytes, Load load) {
  int g = 0;
  for_each_unit(tiles.count, kblocks, sk_tiles, [&](int t, int k0, int k1) {
    int m0, n0;
    tiles.origin(t, m0, n0);
    for (int kb = k0; kb < k1; ++kb, ++g) {
      const int s = ring.acquire(g, bytes);
      load(s, &ring.full[s], kb, m0, n0);
    }
  });
}

// A consumer warpgroup's piece of a stream-K tile that is not the tile's first: its 64 x BN sums to partials (thread
// tid's 8 BN / 16 values at float4 q .. : q x 128 + tid, so that each store instruction writes 2 KiB in a row), then
// the mark. bar: the warpgroup's named barrier. The mark is a release at the GPU's scope by one thread after the
// barrier, as CUTLASS's stream-K barrier: the other threads' stores are ordered before it.
template <int BN>
__device__ __forceinline__ void sk_store_piece(const float (&d)[BN / 16][8], const StreamK& sk, int consumers, int c,
                                               int bar) {
  const int tid = threadIdx.x % 128;
  const int slot = static_cast<int>(blockIdx.x) * consumers + c;
  float4* out = reinterpret_cast<float4*>(sk.partials) + static_cast<size_t>(slot) * (BN / 16) * 2 * 128 + tid;
#pragma unroll
  for (int i = 0; i < BN / 16; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      __stcg(out + (2 * i + h) * 128, make_float4(d[i][4 * h], d[i][4 * h + 1], d[i][4 * h + 2], d[i][4 * h + 3]));
  named_sync(bar, 128);
  if (tid == 0) asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(sk.flags + slot), "r"(sk.epoch) : "memory");
}

// The owner of stream-K tile u (the u-th of the tail), whose piece held the tile's first slices and ended at slice
// k1: add the pieces of the blocks after this one that hold the rest, in block order, each once its mark is set.
template <int BN>
__device__ __forceinline__ void sk_add_pieces(float (&d)[BN / 16][8], const StreamK& sk, int consumers, int c, int u,
                                              int kblocks, int bar) {
  const int tid = threadIdx.x % 128;
  const long long slices = static_cast<long long>(sk.sk_tiles) * kblocks, tile_end = (u + 1LL) * kblocks;
  for (int b = static_cast<int>(blockIdx.x) + 1; b < static_cast<int>(gridDim.x); ++b) {
    const long long start = sk_run_start(b, slices);
    if (start >= tile_end) break;
    if (sk_run_start(b + 1, slices) == start) continue;  // an empty run: no piece
    const int slot = b * consumers + c;
    if (tid == 0) {
      int mark;
      unsigned long long t0 = 0, t;
      for (;;) {
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(mark) : "l"(sk.flags + slot) : "memory");
        if (mark == sk.epoch) break;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t0 == 0) t0 = t;
        if (t - t0 > MBAR_TIMEOUT_NS) GPUCOURSE_FAIL();
      }
    }
    named_sync(bar, 128);
    const float4* in = reinterpret_cast<const float4*>(sk.partials) + static_cast<size_t>(slot) * (BN / 16) * 2 * 128 + tid;
#pragma unroll
    for (int i = 0; i < BN / 16; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float4 v = __ldcg(in + (2 * i + h) * 128);
        d[i][4 * h] += v.x;
        d[i][4 * h + 1] += v.y;
        d[i][4 * h + 2] += v.z;
        d[i][4 * h + 3] += v.w;
      }
  }
}

// stmatrix: four 8 x 8 matrices of 16-bit values from the registers of a warp to shared memory. Register q of lane l
// holds row l / 4, columns 2 (l % 4) and the next of matrix q (an accumulator's layout); lane l gives the address of
// row l % 8 of matrix l / 8, 16 bytes.
__device__ __forceinline__ void stmatrix_x4(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

// A piece of C on its way out: 64 rows x 64 columns of a 2-byte type (FP16, BF16), 128 bytes a row, in the 128-byte
// swizzle; the tensor map of C has boxes of 64 x 64. Each consumer warpgroup has two, used in turn.
constexpr int STORE_PIECE = 64;
constexpr unsigned STORE_PIECE_BYTES = STORE_PIECE * STORE_PIECE * 2;

// One piece of C, columns col .. col + W - 1 of the tile (d[j0 .. j0 + W / 16 - 1]), through buffer buf and map tm
// (boxes of 64 x W). A row of the piece is 2 W bytes (128 or 64), in the TMA's swizzle of that width: 16-byte chunk k
// of row r at chunk k ^ ((2 W r / 128) % (2 W / 16)), that is k ^ (r % 8) for 128-byte rows, k ^ ((r / 2) % 4) for
// 64-byte ones. Stored only where it lies in C (``inside``).
template <int W, int NJ, typename Pack>
__device__ __forceinline__ void store_piece_tma(const float (&d)[NJ][8], int j0, unsigned char* buf,
                                                const TensorMap* tm, int col, int m0, bool inside, int bar, Pack pack) {
  constexpr int ROW = 2 * W, CHUNKS = ROW / 16;  // bytes and 16-byte chunks a row
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  if (tid == 0) bulk_wait_read<1>();  // the store from this buffer, two pieces ago, has read it
  named_sync(bar, 128);
  const int q = lane / 8, row = warp * 16 + (q % 2) * 8 + lane % 8;
#pragma unroll
  for (int jj = 0; jj < W / 16; ++jj) {
    const int j = j0 + jj, chunk = 2 * jj + q / 2;
    stmatrix_x4(smem_addr(buf + row * ROW + ((chunk ^ ((row * ROW / 128) % CHUNKS)) * 16)), pack(d[j][0], d[j][1]),
                pack(d[j][2], d[j][3]), pack(d[j][4], d[j][5]), pack(d[j][6], d[j][7]));
  }
  fence_async_shared();  // the piece, seen by the TMA
  named_sync(bar, 128);
  if (tid == 0) {
    if (inside) tma_store_2d(tm, buf, col, m0);
    bulk_commit();
  }
}

// A consumer warpgroup's 64 x BN accumulators d, rows m0 .. m0 + 63 and columns n0 .. of C, stored through shared
// memory. Piece p (columns 64p .. 64p + 63) is held in d[4p .. 4p + 3]; d[j] covers 16 rows x 16 columns of each warp
// as four 8 x 8 matrices (rows 0-7 / 8-15, columns 0-7 / 8-15): one stmatrix (store_piece_tma). pack(x, y): two
// values of C's type in one 32-bit word, x in the low half (the lower column). bufs: the warpgroup's two pieces
// (1024-byte aligned); stored: the pieces it has handed to the TMA so far, over all its tiles (the buffer is
// stored % 2); bar: the warpgroup's named barrier. Pieces wholly outside C are not stored; the TMA clips the others
// at C's edges.
//
// A tile 32 columns past whole pieces (BN = 224, lesson 5's 128 x 224 convolution tile) ends with a half piece: its
// last 32 columns, d[BN / 16 - 2 ..], 64 bytes a row in the 64-byte swizzle, stored through tmC32, a map of C in boxes
// of 64 x 32.
template <int BN, typename Pack>
__device__ __forceinline__ void store_tile_tma(const float (&d)[BN / 16][8], unsigned char* bufs, int& stored,
                                               const TensorMap* tmC, int m0, int n0, int M, int N, int bar, Pack pack,
                                               const TensorMap* tmC32 = nullptr) {
  static_assert(BN % STORE_PIECE == 0 || BN % STORE_PIECE == STORE_PIECE / 2,
                "the TMA store: whole 64-column pieces, and at most one of 32 columns");
#pragma unroll
  for (int p = 0; p < BN / STORE_PIECE; ++p, ++stored) {
    const int col = n0 + STORE_PIECE * p;
    store_piece_tma<STORE_PIECE>(d, 4 * p, bufs + (stored % 2) * STORE_PIECE_BYTES, tmC, col, m0, m0 < M && col < N,
                                 bar, pack);
  }
  if constexpr (BN % STORE_PIECE != 0) {  // the half piece: columns BN - 32 .. BN - 1
    constexpr int HALF = STORE_PIECE / 2;
    const int col = n0 + BN - HALF;
    store_piece_tma<HALF>(d, BN / 16 - 2, bufs + (stored % 2) * STORE_PIECE_BYTES, tmC32, col, m0, m0 < M && col < N,
                          bar, pack);
    ++stored;
  }
}

// After a consumer warpgroup's last tile: its stores are done before the block's shared memory goes.
__device__ __forceinline__ void store_tma_drain() {
  if (threadIdx.x % 128 == 0) bulk_wait<0>();
}
#endif  // GPUCOURSE_WGMMA

}  // namespace hopper

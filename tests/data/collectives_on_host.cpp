// kernels/cuda/collectives.cu compiled for the CPU, to check the kernels' own arithmetic without a GPU: the
// elements before the first 16-byte boundary, the 16-byte body, the tail, the grid-stride loops. CUDA's
// built-ins are defined here (blockIdx and the rest as globals, the bit-moving intrinsics with memcpy, __half
// as the compiler's _Float16), and a launch runs the grid's threads one after another, which is one of the
// orders a GPU may run them in: every element is written by one thread only and read by no other.
// Built by tests/test_07_collectives.py with -fsanitize=alignment, which stops at any 16-byte load or store
// that is not on a 16-byte boundary.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

struct alignas(16) uint4 { unsigned x, y, z, w; };
static uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
struct Dim { unsigned x; };
static Dim blockIdx, threadIdx, gridDim, blockDim;
static unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static double __hiloint2double(int hi, int lo)
{
    unsigned long long b = ((unsigned long long)(unsigned)hi << 32) | (unsigned)lo;
    double d;
    std::memcpy(&d, &b, 8);
    return d;
}
static int __double2loint(double d) { unsigned long long b; std::memcpy(&b, &d, 8); return (int)(unsigned)b; }
static int __double2hiint(double d) { unsigned long long b; std::memcpy(&b, &d, 8); return (int)(unsigned)(b >> 32); }
typedef _Float16 __half;
struct __half2 { __half lo, hi; };
static __half __ushort_as_half(unsigned short u) { __half h; std::memcpy(&h, &u, 2); return h; }
static unsigned short __half_as_ushort(__half h) { unsigned short u; std::memcpy(&u, &h, 2); return u; }
static __half2 __halves2half2(__half a, __half b) { return {a, b}; }
static __half2 __hadd2(__half2 a, __half2 b) { return {(__half)(a.lo + b.lo), (__half)(a.hi + b.hi)}; }
static __half __low2half(__half2 a) { return a.lo; }
static __half __high2half(__half2 a) { return a.hi; }
static __half __hadd(__half a, __half b) { return (__half)(a + b); }
#define __device__
#define __forceinline__ inline
#define __global__
#include "collectives.cu"

// mine and peer start off_mine and off_peer elements past a 16-byte boundary; elements around them must not
// change. Returns how many elements are wrong.
template <typename T, typename Kernel>
static int check(Kernel kernel, bool add, long long n, int off_mine, int off_peer, unsigned grid, unsigned block)
{
    const int pad = 16;  // elements on either side, at least the largest offset
    std::vector<unsigned char> mraw((n + 2 * pad) * sizeof(T) + 16), praw((n + 2 * pad) * sizeof(T) + 16);
    T* mbase = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(mraw.data()) + 15) / 16 * 16);
    T* pbase = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(praw.data()) + 15) / 16 * 16);
    for (long long i = 0; i < n + 2 * pad; ++i) {  // small whole numbers: exact in every type, sums too
        mbase[i] = (T)(float)(i % 13 + 1);
        pbase[i] = (T)(float)(i % 7 + 1);
    }
    T* mine = mbase + pad + off_mine;
    const T* peer = pbase + pad + off_peer;
    gridDim.x = grid;
    blockDim.x = block;
    for (blockIdx.x = 0; blockIdx.x < grid; ++blockIdx.x)
        for (threadIdx.x = 0; threadIdx.x < block; ++threadIdx.x)
            kernel(mine, peer, n);
    int wrong = 0;
    for (long long j = 0; j < n + 2 * pad; ++j) {
        long long i = j - pad - off_mine;  // index in mine
        float want = (float)(j % 13 + 1);
        if (i >= 0 && i < n) {
            float p = (float)((i + pad + off_peer) % 7 + 1);
            want = add ? want + p : p;
        }
        wrong += (float)mbase[j] != want;
    }
    if (wrong)
        std::printf("wrong: %s, element size %zu, n = %lld, offsets %d/%d, grid %u x %u: %d elements\n",
                    add ? "add" : "copy", sizeof(T), n, off_mine, off_peer, grid, block, wrong);
    return wrong;
}

static void copy_bytes(unsigned char* mine, const unsigned char* peer, long long n) { ring_copy(mine, peer, n); }

int main()
{
    const long long sizes[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 63, 64, 65, 100, 257, 1000, 4099};
    const unsigned grids[][2] = {{1, 1}, {1, 3}, {2, 5}, {3, 32}, {7, 64}};
    int failed = 0, runs = 0;
    for (long long n : sizes)
        for (const auto& g : grids)
            for (int a = 0; a < 4; ++a)
                for (int b = 0; b < 4; ++b) {  // same offsets (16-byte loads after a head) and different ones
                    failed += check<float>(ring_reduce_f32, true, n, a, b, g[0], g[1]) != 0;
                    failed += check<double>(ring_reduce_f64, true, n, a % 2, b % 2, g[0], g[1]) != 0;
                    failed += check<__half>(ring_reduce_f16, true, n, 2 * a, 2 * b + (a == 3), g[0], g[1]) != 0;
                    failed += check<unsigned char>(copy_bytes, false, n, 3 * a, 5 * b, g[0], g[1]) != 0;
                    runs += 4;
                }
    std::printf("%d of %d launches wrong\n", failed, runs);
    return failed != 0;
}

// CPU stand-ins for the CUDA built-ins of TileLang kernels written thread by thread, and of the elementwise code it
// generates for fragments (tools/tilelang_on_cpu.py), the blocks one after another. Each CUDA thread of a block is a
// fiber (ucontext) on the calling thread, run in turn to its next __syncthreads: a round over the fibers is one
// barrier phase, without the OS scheduling a thousand threads through every barrier. Under ThreadSanitizer
// (__SANITIZE_THREAD__, --tsan) each CUDA thread is a std::thread and __syncthreads a std::barrier, so that
// accesses left unordered by the barriers are reported.
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#ifndef __SANITIZE_THREAD__
#include <cstdio>
#include <cstdlib>
#include <sys/mman.h>
#include <ucontext.h>
#endif
typedef unsigned int uint;
typedef unsigned char uchar;
struct Dim { int x = 0, y = 0, z = 0; };
thread_local Dim threadIdx, blockIdx;
alignas(1024) static unsigned char g_shmem[1 << 17];
#ifdef __SANITIZE_THREAD__
static std::barrier<>* g_barrier = nullptr;
#define __syncthreads() g_barrier->arrive_and_wait()
#else
static ucontext_t g_scheduler;
static std::vector<ucontext_t> g_fibers;
static std::vector<char> g_at_partial;  // per fiber: waiting at a barrier of part of the block (bar.sync id, count)
#define __syncthreads() swapcontext(&g_fibers[threadIdx.x], &g_scheduler)
#endif
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(a, b)
#define __restrict__ __restrict
#define CUDART_INF_F INFINITY
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFF) > 0x7F800000) bits = (u >> 16) | 0x40;
    else bits = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
  }
  operator float() const { uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
typedef _Float16 half_t;
template <class A, class B> inline auto max(A a, B b) { using C = std::common_type_t<A, B>; return C(a) < C(b) ? C(b) : C(a); }
template <class A, class B> inline auto min(A a, B b) { using C = std::common_type_t<A, B>; return C(b) < C(a) ? C(b) : C(a); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }  // exact here; the GPU's is within 2 ulp
template <class T> inline void AtomicAdd(T* p, T v) { __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T AtomicAddRet(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
// The vector types, bf16 pairs and block reduction of TileLang's generated elementwise code (row tiles in fragments).
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
struct __nv_bfloat162 { bfloat16_t x, y; };
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {float(v.x), float(v.y)}; }
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return {bfloat16_t(v.x), bfloat16_t(v.y)}; }
inline unsigned __pack_nv_bfloat162(bfloat16_t x, bfloat16_t y) { return (unsigned(y.bits) << 16) | x.bits; }
namespace tl {
struct SumOp { template <class T> T operator()(T a, T b) const { return a + b; } };
struct MaxOp { template <class T> T operator()(T a, T b) const { return max(a, b); } };
struct MinOp { template <class T> T operator()(T a, T b) const { return min(a, b); } };
template <int count> struct NamedBarrier {};
// bar.sync id, count: a barrier of the block's first `count` threads (those that reach it), one per id and block
inline std::mutex g_partial_lock;
inline std::barrier<>* g_partial[16] = {};
inline void __sync_thread_partial(int id, int count) {
#ifdef __SANITIZE_THREAD__
  std::barrier<>* bar;
  {
    std::lock_guard<std::mutex> guard(g_partial_lock);
    if (!g_partial[id]) g_partial[id] = new std::barrier<>(count);
    bar = g_partial[id];
  }
  bar->arrive_and_wait();
#else
  // fibers run in turn to their next barrier: every participant reaches this one before any passes it
  g_at_partial[threadIdx.x] = 1;
  swapcontext(&g_fibers[threadIdx.x], &g_scheduler);
  g_at_partial[threadIdx.x] = 0;
#endif
}
alignas(16) static unsigned char g_exchange[1024 * 8];
// x of the thread whose index differs from this one's in `offset`; every thread of the block calls it (a warp
// shuffle or a shared-memory exchange on the GPU, here a block-wide slot array between two barriers)
template <class T> T exchange(T x, int offset) {
  T* slots = reinterpret_cast<T*>(g_exchange);
  slots[threadIdx.x] = x;
  __syncthreads();
  T other = slots[threadIdx.x ^ offset];
  __syncthreads();
  return other;
}
// tl::AllReduce's butterfly (offsets threads / 2 down to scale), in its order: the same sums bit for bit
template <class Reducer, int threads, int scale, int thread_offset = 0, class Barrier = void, int batch = 1,
          int stride = 0>
struct AllReduce {
  static_assert(thread_offset == 0, "the CPU runner reduces over whole blocks only");
  template <class T> static T run(T x, T* = nullptr) {
    for (int offset = threads / 2; offset >= scale; offset /= 2) x = Reducer()(x, exchange(x, offset));
    return x;
  }
};
}  // namespace tl
#ifdef __SANITIZE_THREAD__
template <class F> void launch_blocks(int gx, int gy, int threads, F body) {
  for (int by = 0; by < gy; ++by)
    for (int bx = 0; bx < gx; ++bx) {
      std::memset(g_shmem, 0xAB, sizeof(g_shmem));  // garbage, as on the GPU
      std::barrier<> bar(threads);
      g_barrier = &bar;
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t)
        pool.emplace_back([=] { threadIdx.x = t; blockIdx.x = bx; blockIdx.y = by; body(); });
      for (auto& th : pool) th.join();
      for (auto*& partial : tl::g_partial) {
        delete partial;
        partial = nullptr;
      }
    }
}
#else
constexpr size_t kFiberStack = 1 << 18;
static void* g_body = nullptr;
static std::vector<bool> g_finished;
template <class F> static void run_fiber() {
  (*static_cast<F*>(g_body))();
  g_finished[threadIdx.x] = true;  // then uc_link: back to the scheduler
}
static char* fiber_stacks(int threads) {  // kept for later launches; a guard page below each stack
  static char* stacks = nullptr;
  static int count = 0;
  if (threads > count) {
    if (stacks) munmap(stacks, count * (kFiberStack + 4096));
    stacks = static_cast<char*>(
        mmap(nullptr, threads * (kFiberStack + 4096), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
             -1, 0));
    if (stacks == MAP_FAILED) { std::perror("fiber stacks"); std::abort(); }
    for (int t = 0; t < threads; ++t) mprotect(stacks + t * (kFiberStack + 4096), 4096, PROT_NONE);
    count = threads;
  }
  return stacks;
}
template <class F> void launch_blocks(int gx, int gy, int threads, F body) {
  char* stacks = fiber_stacks(threads);
  g_body = &body;
  g_fibers.resize(threads);
  for (int by = 0; by < gy; ++by)
    for (int bx = 0; bx < gx; ++bx) {
      std::memset(g_shmem, 0xAB, sizeof(g_shmem));  // garbage, as on the GPU
      blockIdx.x = bx;
      blockIdx.y = by;
      for (int t = 0; t < threads; ++t) {
        getcontext(&g_fibers[t]);
        g_fibers[t].uc_stack.ss_sp = stacks + t * (kFiberStack + 4096) + 4096;
        g_fibers[t].uc_stack.ss_size = kFiberStack;
        g_fibers[t].uc_link = &g_scheduler;
        makecontext(&g_fibers[t], run_fiber<F>, 0);
      }
      g_finished.assign(threads, false);
      g_at_partial.assign(threads, 0);
      for (int running = threads; running > 0;) {
        // while some wait at a barrier of part of the block, only they go on: the others wait at __syncthreads
        bool partial = false;
        for (int t = 0; t < threads; ++t) partial |= !g_finished[t] && g_at_partial[t];
        int returned = 0;
        for (int t = 0; t < threads; ++t) {
          if (g_finished[t] || (partial && !g_at_partial[t])) continue;
          threadIdx.x = t;
          swapcontext(&g_scheduler, &g_fibers[t]);
          returned += g_finished[t];
        }
        int waiting = 0, at_block_barrier = 0;
        for (int t = 0; t < threads; ++t) {
          waiting += !g_finished[t];
          at_block_barrier += !g_finished[t] && !g_at_partial[t];
        }
        // with threads, a __syncthreads that some never reach waits forever
        if (returned > 0 && at_block_barrier > 0) {
          std::fprintf(stderr, "block (%d, %d): %d of %d threads returned while the others wait at __syncthreads\n",
                       bx, by, running - waiting, running);
          std::abort();
        }
        running = waiting;
      }
    }
}
#endif

// CPU stand-ins for the CUDA built-ins of TileLang kernels written thread by thread (tools/tilelang_on_cpu.py):
// one std::thread per CUDA thread, a std::barrier per block for __syncthreads, the blocks one after another.
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>
typedef unsigned int uint;
typedef unsigned char uchar;
struct Dim { int x = 0, y = 0, z = 0; };
thread_local Dim threadIdx, blockIdx;
static std::barrier<>* g_barrier = nullptr;
alignas(1024) static unsigned char g_shmem[1 << 17];
#define __syncthreads() g_barrier->arrive_and_wait()
#define __global__
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
template <class T> inline void AtomicAdd(T* p, T v) { __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T AtomicAddRet(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
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
    }
}

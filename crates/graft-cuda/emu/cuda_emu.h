// A CPU stand-in for the few CUDA features ops/rms_norm/rms_norm.cu uses, so that its kernels
// can be run and checked on a machine without a GPU (emu/emu_test.cpp; emu/run.sh).
//
// One CUDA thread is one fiber (ucontext) with its own stack; the fibers of a block take
// turns on one OS thread, switching only at barriers, and the blocks of a launch run one
// after another, so `__shared__` variables (function-local statics here) belong to the
// running block. __syncthreads is a block barrier; a shuffle is an exchange through a
// per-warp buffer between two warp barriers. Memory is host memory. This checks indexing,
// coverage, reductions and numerics, not timing or the memory model.
//
// The run scripts build with -fno-strict-aliasing: the kernels move 16-byte units through
// other types (a unit of halves stored as a uint4), as CUDA code does, and g++ -O2 may drop
// such stores otherwise (it did for the staged LayerNorm forward).
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <functional>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static
#define GRAFT_DYN_SMEM(name) unsigned char* name = graft_emu::dyn_smem()

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

namespace graft_emu {
// A barrier among `expected` fibers: arrivals count up; the last one opens the next phase;
// the others yield to the scheduler until it has.
struct Barrier {
  unsigned expected = 0, arrived = 0;
  unsigned long phase = 0;
};
struct Block {
  Barrier bar;
  std::vector<Barrier> warp_bar;
  std::vector<double> exchange;  // 32 slots (8 bytes each) per warp
  std::vector<unsigned char> smem;
};
inline Block* g_block = nullptr;
inline unsigned t_tid = 0;  // the running fiber's thread index
inline unsigned t_bid = 0;
inline unsigned char* dyn_smem() { return g_block->smem.data(); }
void yield();
inline void wait(Barrier& b) {
  const unsigned long ph = b.phase;
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    ++b.phase;
    return;
  }
  while (b.phase == ph) yield();
}
}  // namespace graft_emu

// A wait on an emulated mbarrier (ops/common.cuh) lets the block's other threads run.
#define GRAFT_EMU_YIELD() graft_emu::yield()

inline dim3 blockDim, gridDim;
// threadIdx / blockIdx read the running thread's indices.
#define threadIdx (dim3{graft_emu::t_tid, 0, 0})
#define blockIdx (dim3{graft_emu::t_bid, 0, 0})

inline void __syncthreads() { graft_emu::wait(graft_emu::g_block->bar); }
// A barrier of the running thread's warp (every lane of it takes part).
inline void __syncwarp(unsigned /*mask*/ = 0xffffffffu) {
  graft_emu::wait(graft_emu::g_block->warp_bar[graft_emu::t_tid / 32]);
}

template <typename T>
inline T __shfl_xor_sync(unsigned /*mask*/, T v, int o) {
  static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
  auto* b = graft_emu::g_block;
  const unsigned warp = graft_emu::t_tid / 32, lane = graft_emu::t_tid % 32;
  double* slots = &b->exchange[warp * 32];
  std::memcpy(&slots[lane], &v, sizeof(T));
  graft_emu::wait(b->warp_bar[warp]);
  T r;
  std::memcpy(&r, &slots[lane ^ unsigned(o)], sizeof(T));
  graft_emu::wait(b->warp_bar[warp]);
  return r;
}

// The lanes of the running thread's warp holding the same value as it (every lane of the warp
// takes part, as the kernels call it).
template <typename T>
inline unsigned __match_any_sync(unsigned /*mask*/, T v) {
  static_assert(sizeof(T) <= 8, "match of at most 8 bytes");
  auto* b = graft_emu::g_block;
  const unsigned warp = graft_emu::t_tid / 32, lane = graft_emu::t_tid % 32;
  const unsigned lanes = std::min(32u, blockDim.x - 32 * warp);
  double* slots = &b->exchange[warp * 32];
  std::memcpy(&slots[lane], &v, sizeof(T));
  graft_emu::wait(b->warp_bar[warp]);
  unsigned mask = 0;
  for (unsigned l = 0; l < lanes; ++l) {
    if (std::memcmp(&slots[l], &v, sizeof(T)) == 0) mask |= 1u << l;
  }
  graft_emu::wait(b->warp_bar[warp]);
  return mask;
}

inline int __popc(unsigned v) { return __builtin_popcount(v); }

// Fibers switch only at barriers, so a read-modify-write is atomic here.
inline int atomicAdd(int* at, int v) {
  const int old = *at;
  *at = old + v;
  return old;
}

template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline double __longlong_as_double(long long v) {
  double d;
  std::memcpy(&d, &v, 8);
  return d;
}
inline long long __double_as_longlong(double d) {
  long long v;
  std::memcpy(&v, &d, 8);
  return v;
}
inline double __hiloint2double(int hi, int lo) {
  return __longlong_as_double((long long)(((unsigned long long)(unsigned)hi << 32) |
                                          (unsigned long long)(unsigned)lo));
}
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
// Correctly rounded arithmetic with an explicit rounding mode (round to nearest); the emulator
// is built with -ffp-contract=off, so plain operators round each step like these.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
using std::fma;
using std::sqrt;

// 16-bit floating types: storage plus the conversions the kernels call.
struct __half {
  unsigned short bits;
};
struct __half2 {
  __half x, y;
};
struct __nv_bfloat16 {
  unsigned short bits;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline __half __ushort_as_half(unsigned short b) { return {b}; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.bits, 2);
  return float(f);
}
inline __half __float2half_rn(float v) {
  _Float16 f = (_Float16)v;
  __half h;
  std::memcpy(&h.bits, &f, 2);
  return h;
}
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) { return {b}; }
inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float(unsigned(h.bits) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float v) {
  unsigned u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {(unsigned short)((u >> 16) | 0x40)};  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return {(unsigned short)(u >> 16)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}

namespace graft_emu {
struct Fiber {
  ucontext_t ctx;
  bool done = false;
};
constexpr size_t kStack = 64 * 1024;
// Fiber stacks, allocated once (uninitialised) and reused by every block.
inline std::vector<std::unique_ptr<char[]>> g_stacks;
inline ucontext_t g_sched;
inline std::vector<Fiber>* g_fibers = nullptr;
inline unsigned g_current = 0;
inline std::function<void()> g_body;

inline void yield() { swapcontext(&(*g_fibers)[g_current].ctx, &g_sched); }

inline void fiber_main() {
  g_body();
  (*g_fibers)[g_current].done = true;
  // Returning resumes uc_link (the scheduler).
}

// Runs kernel(p) on grid x block threads with `smem` bytes of dynamic shared memory.
template <typename P>
void launch(void (*kernel)(P), unsigned grid, unsigned block, size_t smem, const P& p) {
  blockDim = dim3{block, 1, 1};
  gridDim = dim3{grid, 1, 1};
  g_body = [&] { kernel(p); };
  for (unsigned b = 0; b < grid; ++b) {
    Block blk;
    blk.bar.expected = block;
    const unsigned warps = (block + 31) / 32;
    for (unsigned w = 0; w < warps; ++w) {
      Barrier wb;
      wb.expected = std::min(32u, block - 32 * w);
      blk.warp_bar.push_back(wb);
    }
    blk.exchange.assign(warps * 32, 0.0);
    blk.smem.assign(smem + 16, 0xCD);  // poisoned: kernels must write before reading
    g_block = &blk;
    std::vector<Fiber> fibers(block);
    g_fibers = &fibers;
    while (g_stacks.size() < block) g_stacks.emplace_back(new char[kStack]);
    for (unsigned t = 0; t < block; ++t) {
      Fiber& f = fibers[t];
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = g_stacks[t].get();
      f.ctx.uc_stack.ss_size = kStack;
      f.ctx.uc_link = &g_sched;
      makecontext(&f.ctx, fiber_main, 0);
    }
    t_bid = b;
    for (unsigned left = block; left > 0;) {
      left = 0;
      for (unsigned t = 0; t < block; ++t) {
        if (fibers[t].done) continue;
        g_current = t;
        t_tid = t;
        swapcontext(&g_sched, &fibers[t].ctx);
        if (!fibers[t].done) ++left;
      }
    }
    g_fibers = nullptr;
    g_block = nullptr;
  }
}
}  // namespace graft_emu

// Softmax and log-softmax for graft-cuda, forward and backward, with the semantics of ATen's
// `_softmax` / `_log_softmax` and their `_backward_data` ops:
//   forward:  m = max(x), s = sum(exp(x - m)), y = exp(x - m) * (1 / s)  or  (x - m) - log(s)
//   backward: softmax dx = y * (dy - sum(dy * y)),  log-softmax dx = dy - exp(y) * sum(dy)
// in the accumulation type A (float; double for double). The tensor is `outer x dim x inner`,
// contiguous, reduced over `dim`. Type pairs: forward (input TI, output TO) equal, or half in
// and float out (`half_to_float`); backward (dy and y TG, dx TD) equal, or float in, half out.
//
// Three kernel shapes:
//   *_rows_*     inner == 1, the row held in registers: a row group of `tpr` threads (a power
//                of two up to 32, or a multiple of 32) owns a row, each thread V units of
//                16 bytes of the input type; `rpb` row groups per block. One read, one write.
//                `_v{V}` with 16-byte accesses, `_s{V}` element by element (compile-time, so
//                that one path's registers are not held across the other).
//   *_loop       inner == 1, rows too wide for registers: one row per block at a time. Pass 1
//                keeps a running maximum and rescales the running sum (one exponential per
//                element); pass 2 writes, reading the row again from shared memory when it
//                was staged there (`stage`), else from global memory / L2.
//   *_split{C}   the loop kernels on a row split over a cluster of C blocks (sm_90+): each
//                block stages its C-th of the row and the blocks merge their (maximum, sum)
//                or sum through distributed shared memory, so rows too wide for one SM's
//                shared memory are still read once.
//   *_bulk{C}    16-bit rows too wide for one block (sm_90+): a persistent grid of
//                clusters; the next row's slices arrive by bulk copy (TMA) while the
//                current one is written, and the blocks' partials by st.async. The
//                forward in clusters of 2 writes y back over the staged x and sends it by
//                bulk copy too.
//   *_cols       inner > 1: threads across `inner` (coalesced) and across slices of `dim`,
//                a running maximum / sum per thread merged across slices in a fixed order.
// All loops over rows / tiles are grid-stride with a trip count uniform over the block, so
// barriers and full-warp shuffles are reached by every thread.
//
// Special values as ATen: a row holding NaN or +inf, or only -inf, comes out all NaN; -inf
// elements of other rows give 0 (softmax) and -inf (log-softmax).

#include "common.cuh"

// Dynamic shared memory declaration (a macro so that emu/ can run these kernels on the CPU).
#ifndef GRAFT_DYN_SMEM
#define GRAFT_DYN_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace graft_softmax {

using graft_common::Acc;
using graft_common::BulkSync;
using graft_common::from_acc;
using graft_common::group_reduce;
using graft_common::load_unit;
using graft_common::max_acc;
using graft_common::MaxOp;
using graft_common::Slice;
using graft_common::store_unit;
using graft_common::SumOp;
using graft_common::to_acc;
using graft_common::Units;

// Mirrored by #[repr(C)] SoftmaxParams in src/softmax.rs; every field is 8 bytes.
struct Params {
  const void* in0;  // forward: x; backward: dy
  const void* in1;  // backward: y
  void* out;        // forward: y; backward: dx
  long long outer;  // rows (rows / loop kernels) or outer size (cols kernels)
  long long dim;    // the reduced size
  long long inner;  // 1 for rows / loop kernels
  long long tpr;    // rows: threads per row group; cols: threads across inner
  long long rpb;    // rows: row groups per block; cols: threads across dim
  long long vec;    // 1: 16-byte accesses (aligned pointers, rows a whole number of units)
  long long log;    // 1: log-softmax
  long long stage;  // loop kernels: the row (forward) or dy and y (backward) in shared memory
};

// The largest blocks of the loop and split kernels (src/softmax.rs launches 256 threads where
// a block stages at most 64 KB, several blocks per SM) and of the cols kernels; units per
// thread per step of the loop kernels.
constexpr int kFwdLoopThreads = 512;
constexpr int kBwdLoopThreads = 512;
constexpr int kColsThreads = 256;
constexpr int kLoopUnroll = 4;

// Launch bounds of the rows kernels (maximum block, minimum resident blocks), by direction,
// input element size, V and vector/scalar access: for each, the bound that keeps the most
// bytes in flight per SM with no spill on sm_80 and sm_90 (ptxas; the widened values of a
// thread take V * 16 / size words per array, twice for doubles). Mirrored by `rows_bounds` in
// src/softmax.rs, which launches at most `threads` per block.
template <bool kBackward, int kSize, int V, bool VEC>
struct RowsBounds;
#define GRAFT_SOFTMAX_BOUNDS(BWD, SIZE, V, VEC, THREADS, MIN_BLOCKS) \
  template <>                                                        \
  struct RowsBounds<BWD, SIZE, V, VEC> {                             \
    static constexpr int threads = THREADS;                          \
    static constexpr int min_blocks = MIN_BLOCKS;                    \
  };
GRAFT_SOFTMAX_BOUNDS(false, 4, 1, true, 1024, 2)
GRAFT_SOFTMAX_BOUNDS(false, 4, 2, true, 1024, 2)
GRAFT_SOFTMAX_BOUNDS(false, 4, 4, true, 1024, 1)
GRAFT_SOFTMAX_BOUNDS(false, 4, 8, true, 256, 3)
GRAFT_SOFTMAX_BOUNDS(false, 4, 1, false, 1024, 2)
GRAFT_SOFTMAX_BOUNDS(false, 4, 2, false, 512, 3)
GRAFT_SOFTMAX_BOUNDS(false, 2, 1, true, 1024, 2)
GRAFT_SOFTMAX_BOUNDS(false, 2, 2, true, 1024, 1)
GRAFT_SOFTMAX_BOUNDS(false, 2, 4, true, 1024, 1)
GRAFT_SOFTMAX_BOUNDS(false, 2, 8, true, 256, 2)
GRAFT_SOFTMAX_BOUNDS(false, 2, 1, false, 1024, 2)
GRAFT_SOFTMAX_BOUNDS(false, 2, 2, false, 1024, 1)
GRAFT_SOFTMAX_BOUNDS(false, 8, 1, true, 1024, 2)
GRAFT_SOFTMAX_BOUNDS(false, 8, 2, true, 1024, 1)
GRAFT_SOFTMAX_BOUNDS(false, 8, 4, true, 1024, 1)
GRAFT_SOFTMAX_BOUNDS(false, 8, 8, true, 256, 2)
GRAFT_SOFTMAX_BOUNDS(false, 8, 1, false, 1024, 2)
GRAFT_SOFTMAX_BOUNDS(false, 8, 2, false, 512, 3)
GRAFT_SOFTMAX_BOUNDS(true, 4, 1, true, 1024, 2)
GRAFT_SOFTMAX_BOUNDS(true, 4, 2, true, 512, 3)
GRAFT_SOFTMAX_BOUNDS(true, 4, 4, true, 1024, 1)
GRAFT_SOFTMAX_BOUNDS(true, 4, 8, true, 256, 2)
GRAFT_SOFTMAX_BOUNDS(true, 4, 1, false, 512, 3)
GRAFT_SOFTMAX_BOUNDS(true, 4, 2, false, 1024, 1)
GRAFT_SOFTMAX_BOUNDS(true, 2, 1, true, 512, 3)
GRAFT_SOFTMAX_BOUNDS(true, 2, 2, true, 1024, 1)
GRAFT_SOFTMAX_BOUNDS(true, 2, 4, true, 256, 2)
GRAFT_SOFTMAX_BOUNDS(true, 2, 1, false, 1024, 1)
GRAFT_SOFTMAX_BOUNDS(true, 2, 2, false, 256, 2)
GRAFT_SOFTMAX_BOUNDS(true, 8, 1, true, 1024, 1)
GRAFT_SOFTMAX_BOUNDS(true, 8, 2, true, 256, 3)
GRAFT_SOFTMAX_BOUNDS(true, 8, 4, true, 256, 3)
GRAFT_SOFTMAX_BOUNDS(true, 8, 8, true, 256, 2)
GRAFT_SOFTMAX_BOUNDS(true, 8, 1, false, 1024, 1)
GRAFT_SOFTMAX_BOUNDS(true, 8, 2, false, 256, 3)
#undef GRAFT_SOFTMAX_BOUNDS

template <typename A>
__device__ __forceinline__ A neg_inf() {
  return -A(INFINITY);
}

// exp(v - m), with -inf giving 0 also when m is -inf (nothing but -inf seen yet).
template <typename A>
__device__ __forceinline__ A exp_shift(A v, A m) {
  return v == neg_inf<A>() ? A(0) : exp(v - m);
}

constexpr float kLog2e = 1.4426950408889634f;

// exp(a - b) for merging running sums: 1 when equal (also -inf/-inf, inf/inf).
template <typename A>
__device__ __forceinline__ A rescale(A a, A b) {
  return a == b ? A(1) : exp(a - b);
}

// Merges running (maximum, sum) pairs over the whole block (blockDim.x a multiple of 32);
// `red_m` / `red_s` hold 32 values each and alternate like group_reduce's buffers.
template <typename A>
__device__ __forceinline__ void warp_merge(A& m, A& s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const A m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const A s2 = __shfl_xor_sync(0xffffffffu, s, o);
    const A mm = max_acc(m, m2);
    s = s * rescale(m, mm) + s2 * rescale(m2, mm);
    m = mm;
  }
}

template <typename A>
__device__ __forceinline__ void block_merge(A& m, A& s, A* red_m, A* red_s) {
  warp_merge(m, s);
  const int nw = blockDim.x >> 5;
  if (nw > 1) {
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
      red_m[warp] = m;
      red_s[warp] = s;
    }
    __syncthreads();
    m = red_m[0];
    s = red_s[0];
    for (int i = 1; i < nw; ++i) {
      const A m2 = red_m[i];
      const A mm = max_acc(m, m2);
      s = s * rescale(m, mm) + red_s[i] * rescale(m2, mm);
      m = mm;
    }
  }
}

// Merges the blocks' (maximum, sum) pairs, or sums, over a cluster of C blocks: each block
// publishes its value in `slot`, and lane l of every warp reads block l's, so that every
// thread of every block merges the same values in the same order (identical results). The
// barrier in the middle lets the others read `slot`; the wait that begins the next call (or
// the kernel's last cluster_wait) keeps this block from overwriting `slot`, or exiting,
// before they have. The kernel arrives once before its first call.
template <int C, typename A>
__device__ __forceinline__ void cluster_merge(A& m, A& s, A* slot) {
  graft_common::cluster_wait();
  if (threadIdx.x == 0) {
    slot[0] = m;
    slot[1] = s;
  }
  graft_common::cluster_arrive();
  graft_common::cluster_wait();
  const unsigned lane = threadIdx.x & 31;
  m = neg_inf<A>();
  s = A(0);
  if (lane < C) {
    m = graft_common::load_from_rank(slot, lane);
    s = graft_common::load_from_rank(slot + 1, lane);
  }
  graft_common::cluster_arrive();
  warp_merge(m, s);
}

template <int C, typename A>
__device__ __forceinline__ void cluster_sum(A& r, A* slot) {
  graft_common::cluster_wait();
  if (threadIdx.x == 0) slot[0] = r;
  graft_common::cluster_arrive();
  graft_common::cluster_wait();
  const unsigned lane = threadIdx.x & 31;
  r = lane < C ? graft_common::load_from_rank(slot, lane) : A(0);
  graft_common::cluster_arrive();
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
}


// ---------------------------------------------------------------------------------------
// Rows kernels: thread t of a row group owns units j = k * tpr + t for k < V.

template <typename TI, typename TO, int V, bool VEC>
__device__ __forceinline__ void fwd_rows(const Params& p) {
  using A = typename Acc<TI>::type;
  constexpr int N = Units<TI>::N;
  __shared__ A red[2][32];
  const int tpr = int(p.tpr);
  const int rpb = int(p.rpb);
  const long long cols = p.dim;
  const long long nunits = (cols + N - 1) / N;
  constexpr bool vec = VEC;
  const bool log_softmax = p.log != 0;
  const int g = threadIdx.x / tpr;
  const int t = threadIdx.x - g * tpr;
  const long long nsets = (p.outer + rpb - 1) / rpb;
  int parity = 0;

  for (long long set = blockIdx.x; set < nsets; set += gridDim.x) {
    const long long row = set * rpb + g;
    const bool ok = row < p.outer;
    const TI* x = static_cast<const TI*>(p.in0) + (ok ? row * cols : 0);
    A v[V][N];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const long long j = (long long)k * tpr + t;
      load_unit(v[k], x, j, cols, vec, ok && j < nunits, neg_inf<A>());
    }
    A m = neg_inf<A>();
#pragma unroll
    for (int k = 0; k < V; ++k) {
#pragma unroll
      for (int e = 0; e < N; ++e) m = max_acc(m, v[k][e]);
    }
    m = group_reduce(m, tpr, red[parity], MaxOp());
    parity ^= 1;
    // Padding is -inf: exp(-inf - m) = 0 adds nothing (a row of only -inf is NaN anyway).
    // Softmax keeps the exponentials in place of x; the branches stay apart so that x and
    // its exponentials are never both alive.
    A s = A(0);
    if (log_softmax) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
#pragma unroll
        for (int e = 0; e < N; ++e) s += exp(v[k][e] - m);
      }
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) {
#pragma unroll
        for (int e = 0; e < N; ++e) {
          v[k][e] = exp(v[k][e] - m);
          s += v[k][e];
        }
      }
    }
    s = group_reduce(s, tpr, red[parity], SumOp());
    parity ^= 1;
    if (ok) {
      TO* y = static_cast<TO*>(p.out) + row * cols;
      // (x - m) - log(s), or exp(x - m) * (1 / s): one subtraction and one multiplication
      // by a value computed once per row.
      const A sub = log_softmax ? m : A(0);
      const A mul = log_softmax ? A(1) : A(1) / s;
      const A add = log_softmax ? -log(s) : A(0);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const long long j = (long long)k * tpr + t;
        if (j < nunits) {
          A o[N];
#pragma unroll
          for (int e = 0; e < N; ++e) o[e] = (v[k][e] - sub) * mul + add;
          store_unit(y, o, j, cols, vec);
        }
      }
    }
  }
}

template <typename TG, typename TD, int V, bool VEC>
__device__ __forceinline__ void bwd_rows(const Params& p) {
  using A = typename Acc<TG>::type;
  constexpr int N = Units<TG>::N;
  __shared__ A red[2][32];
  const int tpr = int(p.tpr);
  const int rpb = int(p.rpb);
  const long long cols = p.dim;
  const long long nunits = (cols + N - 1) / N;
  constexpr bool vec = VEC;
  const bool log_softmax = p.log != 0;
  const int g = threadIdx.x / tpr;
  const int t = threadIdx.x - g * tpr;
  const long long nsets = (p.outer + rpb - 1) / rpb;
  int parity = 0;

  for (long long set = blockIdx.x; set < nsets; set += gridDim.x) {
    const long long row = set * rpb + g;
    const bool ok = row < p.outer;
    const long long base = ok ? row * cols : 0;
    const TG* dy = static_cast<const TG*>(p.in0) + base;
    const TG* y = static_cast<const TG*>(p.in1) + base;
    A gv[V][N], yv[V][N];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const long long j = (long long)k * tpr + t;
      const bool valid = ok && j < nunits;
      load_unit(gv[k], dy, j, cols, vec, valid, A(0));
      load_unit(yv[k], y, j, cols, vec, valid, A(0));
    }
    A r = A(0);
#pragma unroll
    for (int k = 0; k < V; ++k) {
#pragma unroll
      for (int e = 0; e < N; ++e) r += log_softmax ? gv[k][e] : gv[k][e] * yv[k][e];
    }
    r = group_reduce(r, tpr, red[parity], SumOp());
    parity ^= 1;
    if (ok) {
      TD* dx = static_cast<TD*>(p.out) + base;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const long long j = (long long)k * tpr + t;
        if (j < nunits) {
          A o[N];
#pragma unroll
          for (int e = 0; e < N; ++e) {
            o[e] = log_softmax ? gv[k][e] - exp(yv[k][e]) * r : yv[k][e] * (gv[k][e] - r);
          }
          store_unit(dx, o, j, cols, vec);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Loop kernels: one row per block (C = 1) or per cluster of C blocks at a time (up to 512
// threads a block); thread t owns units j = lo + t + i * blockDim.x of its block's
// slice [lo, hi) (in both passes, so a staged unit is only ever read back by the thread that
// wrote it).

template <typename TI, typename TO, int C>
__device__ __forceinline__ void fwd_loop(const Params& p) {
  using A = typename Acc<TI>::type;
  constexpr int N = Units<TI>::N;
  // 16-bit input and output (which round to 8 or 11 bits): exponentials in base 2 of
  // (v - m) log2(e), the hardware's ex2 and two more instructions an element, the library's
  // exp elsewhere. The loop kernels are bound by instruction issue (H100, bf16 32768 wide:
  // 0.89 of copy against 0.76 with exp). v - m is exact near the maximum, so its term is 1.
  constexpr bool kFastExp = sizeof(TI) == 2 && sizeof(TO) == 2;
  constexpr int U = kLoopUnroll;
  __shared__ A red_m[2][32];
  __shared__ A red_s[2][32];
  __shared__ A slot[2];
  GRAFT_DYN_SMEM(dyn_smem);
  const int nt = blockDim.x;
  const int t = threadIdx.x;
  const long long cols = p.dim;
  const long long nunits = (cols + N - 1) / N;
  const Slice<C> slice(nunits);
  const long long lo = slice.lo, hi = slice.hi;
  const bool vec = p.vec != 0;
  const bool stage = p.stage != 0;
  const bool log_softmax = p.log != 0;
  graft_common::Pack<TI>* staged = reinterpret_cast<graft_common::Pack<TI>*>(dyn_smem);
  int parity = 0;
  if constexpr (C > 1) graft_common::cluster_arrive();

  for (long long row = blockIdx.x / C; row < p.outer; row += gridDim.x / C) {
    const TI* x = static_cast<const TI*>(p.in0) + row * cols;
    A m = neg_inf<A>(), s = A(0);
    for (long long j0 = lo + t; j0 < hi; j0 += (long long)U * nt) {
      A v[U][N];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const long long j = j0 + (long long)u * nt;
        load_unit(v[u], x, j, cols, vec, j < hi, neg_inf<A>());
      }
      if (stage) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const long long j = j0 + (long long)u * nt;
          if (j < hi) {
            graft_common::Pack<TI> raw;
#pragma unroll
            for (int e = 0; e < N; ++e) raw.v[e] = from_acc<TI>(typename Acc<TI>::type(v[u][e]));
            staged[j - lo] = raw;
          }
        }
      }
      A bm = m;
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int e = 0; e < N; ++e) bm = max_acc(bm, v[u][e]);
      }
      if (bm > m) {
        s *= exp(m - bm);
        m = bm;
      }
      if constexpr (kFastExp) {
        // While m is -inf (only -inf seen) every term is 2^-inf = 0.
        const A shift = m == neg_inf<A>() ? A(0) : m;
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
          for (int e = 0; e < N; ++e) s += exp2f((v[u][e] - shift) * kLog2e);
        }
      } else {
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
          for (int e = 0; e < N; ++e) s += exp_shift(v[u][e], m);
        }
      }
    }
    block_merge(m, s, red_m[parity], red_s[parity]);
    parity ^= 1;
    if constexpr (C > 1) cluster_merge<C>(m, s, slot);
    // ATen's two passes compute exp(inf - inf) = NaN into the sum.
    if (m == -neg_inf<A>()) s = A(NAN);
    const A log_s = log(s);
    const A inv_s = A(1) / s;
    // exp(v - m) / s = 2^((v - m) log2(e) - log2(s)) (NaN for a row of only -inf).
    const A log2_s = kFastExp ? A(log2f(s)) : A(0);
    TO* y = static_cast<TO*>(p.out) + row * cols;
    for (long long j = lo + t; j < hi; j += nt) {
      A v[N];
      if (stage) {
        const graft_common::Pack<TI> raw = staged[j - lo];
#pragma unroll
        for (int e = 0; e < N; ++e) v[e] = A(to_acc(raw.v[e]));
      } else {
        load_unit(v, x, j, cols, vec, true, A(0));
      }
      A o[N];
#pragma unroll
      for (int e = 0; e < N; ++e) {
        if (log_softmax) {
          o[e] = (v[e] - m) - log_s;
        } else if constexpr (kFastExp) {
          o[e] = exp2f(fmaf(v[e] - m, kLog2e, -log2_s));
        } else {
          o[e] = exp(v[e] - m) * inv_s;
        }
      }
      store_unit(y, o, j, cols, vec);
    }
  }
  if constexpr (C > 1) graft_common::cluster_wait();
}

template <typename TG, typename TD, int C>
__device__ __forceinline__ void bwd_loop(const Params& p) {
  using A = typename Acc<TG>::type;
  constexpr int N = Units<TG>::N;
  constexpr bool kFastExp = sizeof(TG) == 2 && sizeof(TD) == 2;  // as the forward's
  constexpr int U = kLoopUnroll;
  __shared__ A red[2][32];
  __shared__ A slot[1];
  GRAFT_DYN_SMEM(dyn_smem);
  const int nt = blockDim.x;
  const int t = threadIdx.x;
  const long long cols = p.dim;
  const long long nunits = (cols + N - 1) / N;
  const Slice<C> slice(nunits);
  const long long lo = slice.lo, hi = slice.hi;
  const long long len = hi - lo;
  const bool vec = p.vec != 0;
  const bool stage = p.stage != 0;
  const bool log_softmax = p.log != 0;
  // Staged: the slice's dy units, then its y units.
  graft_common::Pack<TG>* staged = reinterpret_cast<graft_common::Pack<TG>*>(dyn_smem);
  graft_common::Pack<TG>* staged_y = staged + len;
  int parity = 0;
  if constexpr (C > 1) graft_common::cluster_arrive();

  for (long long row = blockIdx.x / C; row < p.outer; row += gridDim.x / C) {
    const TG* dy = static_cast<const TG*>(p.in0) + row * cols;
    const TG* y = static_cast<const TG*>(p.in1) + row * cols;
    A r = A(0);
    for (long long j0 = lo + t; j0 < hi; j0 += (long long)U * nt) {
      A gv[U][N], yv[U][N];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const long long j = j0 + (long long)u * nt;
        load_unit(gv[u], dy, j, cols, vec, j < hi, A(0));
        load_unit(yv[u], y, j, cols, vec, j < hi, A(0));
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const long long j = j0 + (long long)u * nt;
        if (stage && j < hi) {
          graft_common::Pack<TG> rg, ry;
#pragma unroll
          for (int e = 0; e < N; ++e) {
            rg.v[e] = from_acc<TG>(typename Acc<TG>::type(gv[u][e]));
            ry.v[e] = from_acc<TG>(typename Acc<TG>::type(yv[u][e]));
          }
          staged[j - lo] = rg;
          staged_y[j - lo] = ry;
        }
#pragma unroll
        for (int e = 0; e < N; ++e) r += log_softmax ? gv[u][e] : gv[u][e] * yv[u][e];
      }
    }
    r = group_reduce(r, nt, red[parity], SumOp());
    parity ^= 1;
    if constexpr (C > 1) cluster_sum<C>(r, slot);
    TD* dx = static_cast<TD*>(p.out) + row * cols;
    for (long long j = lo + t; j < hi; j += nt) {
      A gv[N], yv[N];
      if (stage) {
        const graft_common::Pack<TG> rg = staged[j - lo], ry = staged_y[j - lo];
#pragma unroll
        for (int e = 0; e < N; ++e) {
          gv[e] = A(to_acc(rg.v[e]));
          yv[e] = A(to_acc(ry.v[e]));
        }
      } else {
        load_unit(gv, dy, j, cols, vec, true, A(0));
        load_unit(yv, y, j, cols, vec, true, A(0));
      }
      A o[N];
#pragma unroll
      for (int e = 0; e < N; ++e) {
        if (log_softmax) {
          o[e] = gv[e] - (kFastExp ? exp2f(yv[e] * kLog2e) : exp(yv[e])) * r;
        } else {
          o[e] = yv[e] * (gv[e] - r);
        }
      }
      store_unit(dx, o, j, cols, vec);
    }
  }
  if constexpr (C > 1) graft_common::cluster_wait();
}

// ---------------------------------------------------------------------------------------
// Bulk kernels (16-bit input and output, rows a whole number of 16-byte units, sm_90+): a
// persistent grid of clusters of C blocks, no more than can be resident at once, walks rows
// r, r + clusters, ...; block `rank` owns the same slice of each (Slice). One thread fetches
// the block's slice of its next row (of dy and y in the backward) with bulk copies into the
// second of two shared-memory buffers while the current row is reduced and written. The
// blocks' partials go by st.async straight into each block's slot for the row, completing on
// that block's mbarrier, so a block waits for its C values only, not at a cluster barrier
// (whose round trips cost rows this wide about 10%). Two slots by row parity suffice: a block
// cannot run two rows ahead of a peer, as it needs that peer's partial of the row between.
// The forward in clusters of 2 (rows of 32776-65536 columns) writes y by bulk copy too; in
// clusters of 4 and 8 the threads' stores are faster (H100, bf16, fraction of a copy's
// bandwidth, log-softmax / softmax, bench/kernel_lab/softmax_fwd_store_sweep.py: 65536
// columns 0.93-0.94 / 0.93 by bulk copy against 0.89 / 0.91; 131072 0.85 / 0.87 against
// 0.92 / 0.91; 262144 0.85 / 0.85 against 0.94 / 0.93).


#if defined(__CUDA_ARCH__)
template <typename T>
struct Packed2;
template <>
struct Packed2<__half> {
  using type = __half2;
};
template <>
struct Packed2<__nv_bfloat16> {
  using type = __nv_bfloat162;
};
#endif

// The largest of a block's staged units [0, len) (NaN where one is NaN on a GPU, which takes
// pairs of values an instruction; the sums that follow turn NaN either way).
template <typename T>
__device__ __forceinline__ float staged_max(const graft_common::Pack<T>* xs, long long len) {
  constexpr int N = Units<T>::N;
#if defined(__CUDA_ARCH__)
  using T2 = typename Packed2<T>::type;
  const T ninf = from_acc<T>(-INFINITY);
  T2 mx(ninf, ninf);
  for (long long j = threadIdx.x; j < len; j += blockDim.x) {
    const graft_common::Pack<T> raw = xs[j];  // one 16-byte load
    const T2* h = reinterpret_cast<const T2*>(&raw);
#pragma unroll
    for (int e = 0; e < N / 2; ++e) mx = __hmax2_nan(mx, h[e]);
  }
  return max_acc(float(to_acc(mx.x)), float(to_acc(mx.y)));
#else
  float m = -INFINITY;
  for (long long j = threadIdx.x; j < len; j += blockDim.x) {
    const graft_common::Pack<T> raw = xs[j];
#pragma unroll
    for (int e = 0; e < N; ++e) m = max_acc(m, float(to_acc(raw.v[e])));
  }
  return m;
#endif
}

// kStoreBulk: y is written over the staged x and leaves by bulk copy, whose read of the
// buffer the next fetch into it waits for.
template <typename T, int C, bool kStoreBulk>
__device__ __forceinline__ void fwd_bulk(const Params& p) {
  static_assert(sizeof(T) == 2, "16-bit input and output");
  using A = float;
  constexpr int N = Units<T>::N;
  __shared__ BulkSync<C> sync;
  __shared__ A red[2][32];
  GRAFT_DYN_SMEM(dyn_smem);
  const int nt = blockDim.x;
  const int t = threadIdx.x;
  const long long cols = p.dim;
  const Slice<C> slice(cols / N);
  const long long lo = slice.lo, len = slice.hi - slice.lo;
  const long long per = (cols / N + C - 1) / C;  // units between the two buffers
  const unsigned bytes = unsigned(len * 16);
  const bool log_softmax = p.log != 0;
  graft_common::Pack<T>* staged = reinterpret_cast<graft_common::Pack<T>*>(dyn_smem);
  const T* x = static_cast<const T*>(p.in0) + lo * N;
  const auto fetch = [&](long long row, int b) {
    if constexpr (kStoreBulk) graft_common::bulk_copies_read();
    graft_common::mbarrier_expect_bytes(&sync.loaded[b], bytes);
    graft_common::bulk_copy_to_shared(staged + b * per, x + row * cols, bytes, &sync.loaded[b]);
  };
  sync.walk(p.outer, fetch, [&](long long row, int b, long long i) {
    graft_common::Pack<T>* xs = staged + b * per;
    // The slice's maximum, then its sum of 2^((v - m) log2 e) as one fma an element (the
    // sum need not be exact to the last bit), then the cluster's (maximum, sum).
    A m = group_reduce(staged_max(xs, len), nt, red[0], MaxOp());
    const A shift = m == neg_inf<A>() ? A(0) : -m * kLog2e;
    A s = A(0);
    for (long long j = t; j < len; j += nt) {
      const graft_common::Pack<T> raw = xs[j];
#pragma unroll
      for (int e = 0; e < N; ++e) {
        s += graft_common::exp2_ftz(fmaf(A(to_acc(raw.v[e])), kLog2e, shift));
      }
    }
    s = group_reduce(s, nt, red[1], SumOp());
    if constexpr (C > 1) {
      sync.exchange(m, s, i, neg_inf<A>(), A(0));
      warp_merge(m, s);
    }
    // ATen's two passes compute exp(inf - inf) = NaN into the sum.
    if (m == -neg_inf<A>()) s = A(NAN);
    const A log_s = log(s);
    // exp(v - m) / s = 2^(v log2 e - (m log2 e + log2 s)): one fma and the SFU's 2^x.
    const A offset = -fmaf(m, kLog2e, log2f(s));
    T* y = static_cast<T*>(p.out) + row * cols + lo * N;
    T* out = kStoreBulk ? reinterpret_cast<T*>(xs) : y;
    for (long long j = t; j < len; j += nt) {
      const graft_common::Pack<T> raw = xs[j];
      A o[N];
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const A v = A(to_acc(raw.v[e]));
        o[e] = log_softmax ? (v - m) - log_s : graft_common::exp2_ftz(fmaf(v, kLog2e, offset));
      }
      store_unit(out, o, j, cols, true);
    }
    if constexpr (kStoreBulk) {
      graft_common::fence_async_shared();  // the stores to xs come before the bulk copy's reads
      __syncthreads();
      if (t == 0) graft_common::bulk_copy_to_global(y, xs, bytes);
    }
  });
  if constexpr (kStoreBulk) {
    if (t == 0) graft_common::bulk_copies_done();
  }
}

template <typename T, int C>
__device__ __forceinline__ void bwd_bulk(const Params& p) {
  static_assert(sizeof(T) == 2, "16-bit gradients");
  using A = float;
  constexpr int N = Units<T>::N;
  __shared__ BulkSync<C> sync;
  __shared__ A red[2][32];
  GRAFT_DYN_SMEM(dyn_smem);
  const int nt = blockDim.x;
  const int t = threadIdx.x;
  const long long cols = p.dim;
  const Slice<C> slice(cols / N);
  const long long lo = slice.lo, len = slice.hi - slice.lo;
  const long long per = (cols / N + C - 1) / C;  // units between the buffers' arrays
  const unsigned bytes = unsigned(len * 16);
  const bool log_softmax = p.log != 0;
  // [buffer][dy, y][per units]
  graft_common::Pack<T>* staged = reinterpret_cast<graft_common::Pack<T>*>(dyn_smem);
  const T* dy = static_cast<const T*>(p.in0) + lo * N;
  const T* y = static_cast<const T*>(p.in1) + lo * N;
  const auto fetch = [&](long long row, int b) {
    unsigned long long* bar = &sync.loaded[b];
    graft_common::mbarrier_expect_bytes(bar, 2 * bytes);
    graft_common::bulk_copy_to_shared(staged + 2 * b * per, dy + row * cols, bytes, bar);
    graft_common::bulk_copy_to_shared(staged + (2 * b + 1) * per, y + row * cols, bytes, bar);
  };
  sync.walk(p.outer, fetch, [&](long long row, int b, long long i) {
    const graft_common::Pack<T>* gs = staged + 2 * b * per;
    const graft_common::Pack<T>* ys = gs + per;
    A r = A(0);
    for (long long j = t; j < len; j += nt) {
      const graft_common::Pack<T> g = gs[j], yv = ys[j];
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const A gv = A(to_acc(g.v[e]));
        r += log_softmax ? gv : gv * A(to_acc(yv.v[e]));
      }
    }
    r = group_reduce(r, nt, red[b], SumOp());
    if constexpr (C > 1) {
      // Lane l of every warp takes block l's sum: every thread adds the same values in the
      // same order.
      A unused = A(0);
      sync.exchange(r, unused, i, A(0), A(0));
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
    }
    T* dx = static_cast<T*>(p.out) + row * cols + lo * N;
    for (long long j = t; j < len; j += nt) {
      const graft_common::Pack<T> g = gs[j], yv = ys[j];
      A o[N];
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const A gv = A(to_acc(g.v[e])), yy = A(to_acc(yv.v[e]));
        o[e] = log_softmax ? gv - exp2f(yy * kLog2e) * r : yy * (gv - r);
      }
      store_unit(dx, o, j, cols, true);
    }
  });
}

// ---------------------------------------------------------------------------------------
// Cols kernels (inner > 1): a block covers `bx` adjacent columns of one outer index with
// `by` slices of dim; thread (tx, ty) walks d = ty, ty + by, ... of column tx.

template <typename TI, typename TO>
__device__ __forceinline__ void fwd_cols(const Params& p) {
  using A = typename Acc<TI>::type;
  __shared__ A sm_m[kColsThreads];
  __shared__ A sm_s[kColsThreads];
  const int bx = int(p.tpr), by = int(p.rpb);
  const long long dim = p.dim, inner = p.inner;
  const bool log_softmax = p.log != 0;
  const int tx = int(threadIdx.x) % bx, ty = int(threadIdx.x) / bx;
  const long long ntile = (inner + bx - 1) / bx;
  const long long ntiles = p.outer * ntile;
  for (long long tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const long long o = tile / ntile;
    const long long col = (tile - o * ntile) * bx + tx;
    const bool ok = col < inner;
    const long long base = o * dim * inner + col;
    const TI* x = static_cast<const TI*>(p.in0) + base;
    A m = neg_inf<A>(), s = A(0);
    if (ok) {
      for (long long d = ty; d < dim; d += by) {
        const A v = A(to_acc(x[d * inner]));
        if (v > m) {
          s = s * exp(m - v) + A(1);
          m = v;
        } else if (v != neg_inf<A>()) {
          s += exp(v - m);  // NaN lands here and stays
        }
      }
    }
    sm_m[threadIdx.x] = m;
    sm_s[threadIdx.x] = s;
    __syncthreads();
    m = sm_m[tx];
    s = sm_s[tx];
    for (int i = 1; i < by; ++i) {
      const A m2 = sm_m[i * bx + tx];
      const A mm = max_acc(m, m2);
      s = s * rescale(m, mm) + sm_s[i * bx + tx] * rescale(m2, mm);
      m = mm;
    }
    __syncthreads();
    if (m == -neg_inf<A>()) s = A(NAN);
    if (ok) {
      const A log_s = log(s);
      const A inv_s = A(1) / s;
      TO* y = static_cast<TO*>(p.out) + base;
      for (long long d = ty; d < dim; d += by) {
        const A v = A(to_acc(x[d * inner]));
        const A out = log_softmax ? (v - m) - log_s : exp(v - m) * inv_s;
        y[d * inner] = from_acc<TO>(typename Acc<TO>::type(out));
      }
    }
  }
}

template <typename TG, typename TD>
__device__ __forceinline__ void bwd_cols(const Params& p) {
  using A = typename Acc<TG>::type;
  __shared__ A sm_r[kColsThreads];
  const int bx = int(p.tpr), by = int(p.rpb);
  const long long dim = p.dim, inner = p.inner;
  const bool log_softmax = p.log != 0;
  const int tx = int(threadIdx.x) % bx, ty = int(threadIdx.x) / bx;
  const long long ntile = (inner + bx - 1) / bx;
  const long long ntiles = p.outer * ntile;
  for (long long tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const long long o = tile / ntile;
    const long long col = (tile - o * ntile) * bx + tx;
    const bool ok = col < inner;
    const long long base = o * dim * inner + col;
    const TG* dy = static_cast<const TG*>(p.in0) + base;
    const TG* y = static_cast<const TG*>(p.in1) + base;
    A r = A(0);
    if (ok) {
      for (long long d = ty; d < dim; d += by) {
        const A g = A(to_acc(dy[d * inner]));
        r += log_softmax ? g : g * A(to_acc(y[d * inner]));
      }
    }
    sm_r[threadIdx.x] = r;
    __syncthreads();
    r = sm_r[tx];
    for (int i = 1; i < by; ++i) r += sm_r[i * bx + tx];
    __syncthreads();
    if (ok) {
      TD* dx = static_cast<TD*>(p.out) + base;
      for (long long d = ty; d < dim; d += by) {
        const A g = A(to_acc(dy[d * inner]));
        const A yv = A(to_acc(y[d * inner]));
        const A out = log_softmax ? g - exp(yv) * r : yv * (g - r);
        dx[d * inner] = from_acc<TD>(typename Acc<TD>::type(out));
      }
    }
  }
}

}  // namespace graft_softmax

// ---------------------------------------------------------------------------------------
// Entry points, named as src/softmax.rs builds the names:
//   graft_softmax_{fwd,bwd}_rows_{v,s}{V}_{tag}  graft_softmax_{fwd,bwd}_{loop,cols}_{tag}
//   graft_softmax_{fwd,bwd}_split{C}_{tag} (C = 2, 4, 8)
//   graft_softmax_fwd_bulk{C}_{f16,bf16} (C = 2, 4, 8)  graft_softmax_bwd_bulk{8,16}_{f16,bf16}
// tag: f32 f64 f16 bf16, and f16_f32 (forward, half_to_float) / f32_f16 (its backward);
// vector kernels (_v) for V = 1, 2, 4, 8 (backward of 16-bit types: 1, 2, 4), scalar kernels
// (_s: odd widths, unaligned pointers) for V = 1, 2; the loop kernels take wider rows.
// Maximum block sizes (launch bounds) are mirrored in src/softmax.rs.

#define GRAFT_SOFTMAX_BOUNDS_OF(BWD, T, V, VEC) \
  graft_softmax::RowsBounds<BWD, int(sizeof(T)), V, VEC>::threads,   \
      graft_softmax::RowsBounds<BWD, int(sizeof(T)), V, VEC>::min_blocks

#define GRAFT_SOFTMAX_ROWS(NAME, TI, TO, V, VEC)                                             \
  extern "C" __global__ void __launch_bounds__(GRAFT_SOFTMAX_BOUNDS_OF(false, TI, V, VEC))   \
      NAME(const graft_softmax::Params p) {                                                  \
    graft_softmax::fwd_rows<TI, TO, V, VEC>(p);                                              \
  }
#define GRAFT_SOFTMAX_BWD_ROWS(NAME, TG, TD, V, VEC)                                         \
  extern "C" __global__ void __launch_bounds__(GRAFT_SOFTMAX_BOUNDS_OF(true, TG, V, VEC))    \
      NAME(const graft_softmax::Params p) {                                                  \
    graft_softmax::bwd_rows<TG, TD, V, VEC>(p);                                              \
  }

// Loop kernels; C > 1 (the split kernels) as clusters of C blocks.
#define GRAFT_SOFTMAX_CLUSTER_DIMS_1
#define GRAFT_SOFTMAX_CLUSTER_DIMS_2 GRAFT_CLUSTER_DIMS(2)
#define GRAFT_SOFTMAX_CLUSTER_DIMS_4 GRAFT_CLUSTER_DIMS(4)
#define GRAFT_SOFTMAX_CLUSTER_DIMS_8 GRAFT_CLUSTER_DIMS(8)
#define GRAFT_SOFTMAX_FWD_LOOP(NAME, TI, TO, C)                                              \
  extern "C" __global__ void __launch_bounds__(graft_softmax::kFwdLoopThreads, 1)           \
      GRAFT_SOFTMAX_CLUSTER_DIMS_##C NAME(const graft_softmax::Params p) {                  \
    graft_softmax::fwd_loop<TI, TO, C>(p);                                                  \
  }
#define GRAFT_SOFTMAX_BWD_LOOP(NAME, TG, TD, C)                                              \
  extern "C" __global__ void __launch_bounds__(graft_softmax::kBwdLoopThreads, 1)           \
      GRAFT_SOFTMAX_CLUSTER_DIMS_##C NAME(const graft_softmax::Params p) {                  \
    graft_softmax::bwd_loop<TG, TD, C>(p);                                                  \
  }

#define GRAFT_SOFTMAX_FWD(TAG, TI, TO)                                                       \
  GRAFT_SOFTMAX_ROWS(graft_softmax_fwd_rows_v1_##TAG, TI, TO, 1, true)                       \
  GRAFT_SOFTMAX_ROWS(graft_softmax_fwd_rows_v2_##TAG, TI, TO, 2, true)                       \
  GRAFT_SOFTMAX_ROWS(graft_softmax_fwd_rows_v4_##TAG, TI, TO, 4, true)                       \
  GRAFT_SOFTMAX_ROWS(graft_softmax_fwd_rows_v8_##TAG, TI, TO, 8, true)                       \
  GRAFT_SOFTMAX_ROWS(graft_softmax_fwd_rows_s1_##TAG, TI, TO, 1, false)                      \
  GRAFT_SOFTMAX_ROWS(graft_softmax_fwd_rows_s2_##TAG, TI, TO, 2, false)                      \
  GRAFT_SOFTMAX_FWD_LOOP(graft_softmax_fwd_loop_##TAG, TI, TO, 1)                           \
  GRAFT_SOFTMAX_FWD_LOOP(graft_softmax_fwd_split2_##TAG, TI, TO, 2)                         \
  GRAFT_SOFTMAX_FWD_LOOP(graft_softmax_fwd_split4_##TAG, TI, TO, 4)                         \
  GRAFT_SOFTMAX_FWD_LOOP(graft_softmax_fwd_split8_##TAG, TI, TO, 8)                         \
  extern "C" __global__ void __launch_bounds__(graft_softmax::kColsThreads)                 \
      graft_softmax_fwd_cols_##TAG(const graft_softmax::Params p) {                         \
    graft_softmax::fwd_cols<TI, TO>(p);                                                     \
  }

#define GRAFT_SOFTMAX_BWD(TAG, TG, TD)                                                       \
  GRAFT_SOFTMAX_BWD_ROWS(graft_softmax_bwd_rows_v1_##TAG, TG, TD, 1, true)                   \
  GRAFT_SOFTMAX_BWD_ROWS(graft_softmax_bwd_rows_v2_##TAG, TG, TD, 2, true)                   \
  GRAFT_SOFTMAX_BWD_ROWS(graft_softmax_bwd_rows_v4_##TAG, TG, TD, 4, true)                   \
  GRAFT_SOFTMAX_BWD_ROWS(graft_softmax_bwd_rows_s1_##TAG, TG, TD, 1, false)                  \
  GRAFT_SOFTMAX_BWD_ROWS(graft_softmax_bwd_rows_s2_##TAG, TG, TD, 2, false)                  \
  GRAFT_SOFTMAX_BWD_LOOP(graft_softmax_bwd_loop_##TAG, TG, TD, 1)                           \
  GRAFT_SOFTMAX_BWD_LOOP(graft_softmax_bwd_split2_##TAG, TG, TD, 2)                         \
  GRAFT_SOFTMAX_BWD_LOOP(graft_softmax_bwd_split4_##TAG, TG, TD, 4)                         \
  GRAFT_SOFTMAX_BWD_LOOP(graft_softmax_bwd_split8_##TAG, TG, TD, 8)                         \
  extern "C" __global__ void __launch_bounds__(graft_softmax::kColsThreads)                 \
      graft_softmax_bwd_cols_##TAG(const graft_softmax::Params p) {                         \
    graft_softmax::bwd_cols<TG, TD>(p);                                                     \
  }

// Bulk kernels, 16-bit types: the forward in clusters of 2, 4 and 8, the backward of 8 and 16
// (a non-portable size: src/device.rs allows it on load).
#define GRAFT_SOFTMAX_BULK(NAME, C, ...)                                                     \
  extern "C" __global__ void __launch_bounds__(graft_softmax::kFwdLoopThreads, 1)           \
      GRAFT_CLUSTER_DIMS(C) NAME(const graft_softmax::Params p) {                           \
    __VA_ARGS__(p);                                                                         \
  }
#define GRAFT_SOFTMAX_BULKS(TAG, T)                                                          \
  GRAFT_SOFTMAX_BULK(graft_softmax_fwd_bulk2_##TAG, 2, graft_softmax::fwd_bulk<T, 2, true>)  \
  GRAFT_SOFTMAX_BULK(graft_softmax_fwd_bulk4_##TAG, 4, graft_softmax::fwd_bulk<T, 4, false>) \
  GRAFT_SOFTMAX_BULK(graft_softmax_fwd_bulk8_##TAG, 8, graft_softmax::fwd_bulk<T, 8, false>) \
  GRAFT_SOFTMAX_BULK(graft_softmax_bwd_bulk8_##TAG, 8, graft_softmax::bwd_bulk<T, 8>)        \
  GRAFT_SOFTMAX_BULK(graft_softmax_bwd_bulk16_##TAG, 16, graft_softmax::bwd_bulk<T, 16>)

GRAFT_SOFTMAX_FWD(f32, float, float)
GRAFT_SOFTMAX_FWD(f64, double, double)
GRAFT_SOFTMAX_FWD(f16, __half, __half)
GRAFT_SOFTMAX_FWD(bf16, __nv_bfloat16, __nv_bfloat16)
GRAFT_SOFTMAX_FWD(f16_f32, __half, float)
GRAFT_SOFTMAX_BWD(f32, float, float)
GRAFT_SOFTMAX_BWD(f64, double, double)
GRAFT_SOFTMAX_BWD(f16, __half, __half)
GRAFT_SOFTMAX_BWD(bf16, __nv_bfloat16, __nv_bfloat16)
GRAFT_SOFTMAX_BWD(f32_f16, float, __half)
// V = 8 backward only where its two arrays fit (not for 16-bit types: 128 values).
GRAFT_SOFTMAX_BWD_ROWS(graft_softmax_bwd_rows_v8_f32, float, float, 8, true)
GRAFT_SOFTMAX_BWD_ROWS(graft_softmax_bwd_rows_v8_f64, double, double, 8, true)
GRAFT_SOFTMAX_BWD_ROWS(graft_softmax_bwd_rows_v8_f32_f16, float, __half, 8, true)
GRAFT_SOFTMAX_BULKS(f16, __half)
GRAFT_SOFTMAX_BULKS(bf16, __nv_bfloat16)

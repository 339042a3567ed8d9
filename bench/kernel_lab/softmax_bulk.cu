// Kernel lab (not built into the library): bf16 softmax / log-softmax rows of 16k-256k columns
// on persistent clusters. Launched by softmax_bulk_sweep.py beside this file, which sizes the
// grid with cuOccupancyMaxActiveClusters (one resident wave: a row's blocks wait for each other).
//
// A cluster of C blocks walks rows r, r + clusters, ...; block `rank` owns units [lo, hi) of
// each row (graft_softmax::Slice). Two ideas against the split kernels of softmax.cu:
// - Bulk copies (TMA, cp.async.bulk): one thread fetches the block's slice of the *next* row
//   (of dy and y in the backward) into the second of two shared-memory buffers, completing on
//   an mbarrier, while the current row is reduced and written. Rows need a whole number of
//   16-byte units and 16-byte aligned pointers.
// - Pushed partials (PUSH): instead of the cluster barrier pair of cluster_merge / cluster_sum,
//   threads t < C of each block store the block's (maximum, sum) or sum straight into block
//   t's slot for this row with st.async, which completes on block t's mbarrier; a block waits
//   only for its own C values. Two slots, by row parity: a block can run at most one row ahead
//   of its slowest peer, since it needs that peer's next value before it pushes again.
// And for the forward, whose blocks were short of instruction issue: `_push2` takes the
// slice's maximum in packed pairs first (__hmax2_nan), then the sum in one fma an element,
// with no running rescale; `_push3` adds the SFU's 2^x with subnormal results flushed
// (ex2.approx.ftz: exp2f's non-ftz form takes about four instructions) and writes
// 2^(v log2 e - (m log2 e + log2 s)) with one fma.
#include "softmax.cu"
namespace graft_bulk {
// The primitives are ops/common.cuh's (mbarriers, bulk copies, st.async, exp2_ftz).
using graft_common::bulk_copy_to_shared;
using graft_common::exp2_ftz;
using graft_common::fence_async_shared;
using graft_common::mbarrier_expect_bytes;
using graft_common::mbarrier_init;
using graft_common::mbarrier_wait;
using graft_common::push_pair_to_rank;
using graft_softmax::Params;
using TI = __nv_bfloat16;
using A = float;
constexpr int N = 8;
using Pk = graft_common::Pack<TI>;

// Every block of the cluster sends its (a, b) to every block's slots[par][rank]; returns once
// this block has all C pairs (lane l of each warp holds block l's pair, others the identity).
template <int C>
__device__ __forceinline__ void exchange(float& a, float& b, float (*slots)[8][2],
                                         unsigned long long* xbar, int i, float ida, float idb) {
  const int par = i & 1;
  const unsigned rank = graft_common::cluster_rank();
  if (threadIdx.x == 0) mbarrier_expect_bytes(&xbar[par], C * 8);
  if (threadIdx.x < C)
    push_pair_to_rank(&slots[par][rank][0], threadIdx.x, a, b, &xbar[par]);
  mbarrier_wait(&xbar[par], (i >> 1) & 1);
  const unsigned lane = threadIdx.x & 31;
  a = lane < C ? slots[par][lane][0] : ida;
  b = lane < C ? slots[par][lane][1] : idb;
}

template <int C, bool BWD, bool PUSH, bool TWO = false, bool FEX = false>
__device__ __forceinline__ void bulk(const Params& p) {
  constexpr int U = 4;
  constexpr int ARR = BWD ? 2 : 1;
  __shared__ __align__(8) unsigned long long bars[2];
  __shared__ A red_m[2][32];
  __shared__ A red_s[2][32];
  __shared__ A slot[2];
  __shared__ __align__(8) unsigned long long xbar[2];
  __shared__ __align__(8) float slots[2][8][2];
  GRAFT_DYN_SMEM(dyn_smem);
  const int nt = blockDim.x, t = threadIdx.x;
  const long long cols = p.dim, nunits = cols / N;
  const graft_softmax::Slice<C> slice(nunits);
  const long long lo = slice.lo, hi = slice.hi, len = hi - lo;
  const long long per = (nunits + C - 1) / C;
  Pk* bufs = reinterpret_cast<Pk*>(dyn_smem);  // [stage][array][per]
  const unsigned bytes = unsigned(len * 16);
  const long long stride = gridDim.x / C;
  const bool log_softmax = p.log != 0;
  long long row = blockIdx.x / C;
  if (t == 0) {
    mbarrier_init(&bars[0]);
    mbarrier_init(&bars[1]);
    mbarrier_init(&xbar[0]);
    mbarrier_init(&xbar[1]);
  }
  __syncthreads();
  if constexpr (C > 1) graft_common::cluster_arrive();
  if constexpr (C > 1 && PUSH) {
    graft_common::cluster_wait();
    graft_common::cluster_arrive();
  }
  auto issue = [&](long long r, int b) {
    mbarrier_expect_bytes(&bars[b], bytes * ARR);
    bulk_copy_to_shared(bufs + (b * ARR) * per, static_cast<const TI*>(p.in0) + r * cols + lo * N, bytes,
              &bars[b]);
    if (BWD)
      bulk_copy_to_shared(bufs + (b * ARR + 1) * per, static_cast<const TI*>(p.in1) + r * cols + lo * N,
                bytes, &bars[b]);
  };
  if (t == 0 && row < p.outer) issue(row, 0);
  int parity = 0;
  for (int i = 0; row < p.outer; ++i, row += stride) {
    const int b = i & 1;
    if (t == 0 && row + stride < p.outer) {
      fence_async_shared();
      issue(row + stride, b ^ 1);
    }
    mbarrier_wait(&bars[b], (i >> 1) & 1);
    const Pk* s0 = bufs + (b * ARR) * per;
    if constexpr (!BWD) {
      A m = graft_softmax::neg_inf<A>(), s = A(0);
      if constexpr (TWO) {
        __nv_bfloat162 mx = __float2bfloat162_rn(-INFINITY);
        for (long long j = t; j < len; j += nt) {
          const Pk raw = s0[j];
          const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
          for (int e = 0; e < N / 2; ++e) mx = __hmax2_nan(mx, h[e]);
        }
        m = graft_common::max_acc(__low2float(mx), __high2float(mx));
        m = graft_common::group_reduce(m, nt, red_m[parity], graft_common::MaxOp());
        const A shift = m == graft_softmax::neg_inf<A>() ? A(0) : -m * graft_softmax::kLog2e;
        for (long long j = t; j < len; j += nt) {
          const Pk raw = s0[j];
#pragma unroll
          for (int e = 0; e < N; ++e)
            s += FEX ? exp2_ftz(fmaf(graft_common::to_acc(raw.v[e]), graft_softmax::kLog2e, shift))
                     : exp2f(fmaf(graft_common::to_acc(raw.v[e]), graft_softmax::kLog2e, shift));
        }
        s = graft_common::group_reduce(s, nt, red_s[parity], graft_common::SumOp());
        parity ^= 1;
      } else {
      for (long long j0 = t; j0 < len; j0 += (long long)U * nt) {
        A v[U][N];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const long long j = j0 + (long long)u * nt;
          if (j < len) {
            const Pk raw = s0[j];
#pragma unroll
            for (int e = 0; e < N; ++e) v[u][e] = graft_common::to_acc(raw.v[e]);
          } else {
#pragma unroll
            for (int e = 0; e < N; ++e) v[u][e] = graft_softmax::neg_inf<A>();
          }
        }
        A bm = m;
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int e = 0; e < N; ++e) bm = graft_common::max_acc(bm, v[u][e]);
        if (bm > m) {
          s *= exp(m - bm);
          m = bm;
        }
        // The sum's terms need not be exact: one fma an element.
        const A shift = m == graft_softmax::neg_inf<A>() ? A(0) : -m * graft_softmax::kLog2e;
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int e = 0; e < N; ++e) s += exp2f(fmaf(v[u][e], graft_softmax::kLog2e, shift));
      }
      graft_softmax::block_merge(m, s, red_m[parity], red_s[parity]);
      parity ^= 1;
      }
      if constexpr (C > 1 && !PUSH) graft_softmax::cluster_merge<C>(m, s, slot);
      if constexpr (C > 1 && PUSH) {
        exchange<C>(m, s, slots, xbar, i, graft_softmax::neg_inf<A>(), A(0));
        graft_softmax::warp_merge(m, s);
      }
      if (m == -graft_softmax::neg_inf<A>()) s = A(NAN);
      const A log_s = log(s);
      const A log2_s = log2f(s);
      const A off = -fmaf(m, graft_softmax::kLog2e, log2_s);
      TI* y = static_cast<TI*>(p.out) + row * cols + lo * N;
      for (long long j = t; j < len; j += nt) {
        const Pk raw = s0[j];
        A o[N];
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const A v = graft_common::to_acc(raw.v[e]);
          if constexpr (FEX)
            o[e] = log_softmax ? (v - m) - log_s : exp2_ftz(fmaf(v, graft_softmax::kLog2e, off));
          else
            o[e] = log_softmax ? (v - m) - log_s
                               : exp2f(fmaf(v - m, graft_softmax::kLog2e, -log2_s));
        }
        graft_common::store_unit(y, o, j, cols, true);
      }
    } else {
      const Pk* s1 = s0 + per;
      A r = A(0);
      for (long long j = t; j < len; j += nt) {
        const Pk g = s0[j], yy = s1[j];
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const A gv = graft_common::to_acc(g.v[e]);
          r += log_softmax ? gv : gv * A(graft_common::to_acc(yy.v[e]));
        }
      }
      r = graft_common::group_reduce(r, nt, red_m[parity], graft_common::SumOp());
      parity ^= 1;
      if constexpr (C > 1 && !PUSH) graft_softmax::cluster_sum<C>(r, slot);
      if constexpr (C > 1 && PUSH) {
        A z = 0;
        exchange<C>(r, z, slots, xbar, i, A(0), A(0));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
      }
      TI* dx = static_cast<TI*>(p.out) + row * cols + lo * N;
      for (long long j = t; j < len; j += nt) {
        const Pk g = s0[j], yy = s1[j];
        A o[N];
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const A gv = graft_common::to_acc(g.v[e]), yv = graft_common::to_acc(yy.v[e]);
          o[e] = log_softmax ? gv - exp2f(yv * graft_softmax::kLog2e) * r : yv * (gv - r);
        }
        graft_common::store_unit(dx, o, j, cols, true);
      }
    }
    __syncthreads();  // buffer b is read; the next iteration's copy may overwrite it
  }
  if constexpr (C > 1) graft_common::cluster_wait();
}
}  // namespace graft_bulk

// graft_softmax_bulk_{fwd,bwd}{C}[_push]
#define BULK(NAME, C, BWD)                                                                  \
  extern "C" __global__ void __launch_bounds__(1024, 1) GRAFT_SOFTMAX_CLUSTER_DIMS_##C     \
      NAME(const graft_softmax::Params p) {                                                 \
    graft_bulk::bulk<C, BWD, false>(p);                                                     \
  }                                                                                         \
  extern "C" __global__ void __launch_bounds__(1024, 1) GRAFT_SOFTMAX_CLUSTER_DIMS_##C     \
      NAME##_push(const graft_softmax::Params p) {                                          \
    graft_bulk::bulk<C, BWD, true>(p);                                                      \
  }
BULK(graft_softmax_bulk_fwd1, 1, false)
BULK(graft_softmax_bulk_fwd2, 2, false)
BULK(graft_softmax_bulk_fwd4, 4, false)
BULK(graft_softmax_bulk_fwd8, 8, false)
BULK(graft_softmax_bulk_bwd1, 1, true)
BULK(graft_softmax_bulk_bwd2, 2, true)
BULK(graft_softmax_bulk_bwd4, 4, true)
BULK(graft_softmax_bulk_bwd8, 8, true)

#define BULK2(NAME, C)                                                                      \
  extern "C" __global__ void __launch_bounds__(1024, 1) GRAFT_SOFTMAX_CLUSTER_DIMS_##C    \
      NAME(const graft_softmax::Params p) {                                                 \
    graft_bulk::bulk<C, false, true, true>(p);                                              \
  }
BULK2(graft_softmax_bulk_fwd2_push2, 2)
BULK2(graft_softmax_bulk_fwd4_push2, 4)
BULK2(graft_softmax_bulk_fwd8_push2, 8)

#define BULK3(NAME, C)                                                                      \
  extern "C" __global__ void __launch_bounds__(1024, 1) GRAFT_SOFTMAX_CLUSTER_DIMS_##C    \
      NAME(const graft_softmax::Params p) {                                                 \
    graft_bulk::bulk<C, false, true, true, true>(p);                                        \
  }
BULK3(graft_softmax_bulk_fwd2_push3, 2)
BULK3(graft_softmax_bulk_fwd4_push3, 4)
BULK3(graft_softmax_bulk_fwd8_push3, 8)

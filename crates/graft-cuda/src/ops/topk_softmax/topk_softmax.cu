// Mixture-of-experts routing for graft-cuda: for each row (token) of router logits x over
// `experts`, the softmax p, the k largest probabilities and their experts (largest first; the
// lower expert first among equal probabilities; NaN first, as torch.topk), divided by their sum
// when `renormalize`; and the logits' gradient from the weights' gradient g:
//   renormalize:   dl[i_j] = w_j (g_j - sum_j g_j w_j), 0 for the experts not selected
//   otherwise:     dl[e] = (0 - p_e dot) + p_e g_j where e = i_j (and 0 - p_e dot elsewhere),
//                  dot = sum_j g_j p[i_j], p recomputed from the logits
// The formulas and each element's order of operations are those of the CPU kernel
// (graft-kernels ops/topk_softmax.rs); its sequential sums are warp butterflies here, except
// the renormalization's sum of the k weights, added in selection order as there, and its
// divisions may differ in the last bit (`divide`). Equal logits give equal probabilities, so
// ties go the same way. Arithmetic in the accumulation type (float; double for double
// logits); weights in it, indices int64.
//
// One warp per row, 8 rows per block, grid-stride over rows. The forward's register kernels
// (fwd_v<V>) hold V experts a lane (lane l: experts l, l + 32, ...; 32 V >= experts, at most
// 512); the loop kernel (fwd_loop, any count of experts) reads the row again, from L1/L2, for
// each pass and each round. Selection is k rounds of a warp argmax over the total order (NaN
// first, larger probability, lower expert): round r takes the first expert after round r-1's
// pick, so nothing is marked and no register is indexed at run time. The backward (one loop
// kernel per dtype) writes every element of its row, then, after __syncwarp, the k selected ones
// again. It skips indices outside [0, experts); the forward's are distinct (duplicates would
// race).

#include "common.cuh"

namespace graft_topk {

using graft_common::Acc;
using graft_common::divide;
using graft_common::exp_acc;
using graft_common::from_acc;
using graft_common::recip;
using graft_common::to_acc;

// Mirrored by #[repr(C)] TopkParams in src/ops/topk_softmax/mod.rs; every field is 8 bytes.
struct TopkParams {
  const void* logits;        // rows x experts, contiguous
  void* weights;             // rows x k, accumulation type: forward output, backward input
  long long* indices;        // rows x k: forward output, backward input
  const void* grad_weights;  // rows x k, accumulation type (backward)
  void* grad_logits;         // rows x experts (backward)
  long long rows;
  long long experts;  // at most INT_MAX (checked by the launcher)
  long long k;        // 1 <= k <= experts
  long long renormalize;
};

constexpr int kWarpsPerBlock = 8;
constexpr unsigned kFullMask = 0xffffffffu;

// The CPU kernel's maximum: NaN as soon as one value is NaN (softmax is then NaN everywhere).
template <typename A>
__device__ __forceinline__ A nan_max(A a, A b) {
  if (a != a) return a;
  return (b != b || b > a) ? b : a;
}

// Whether (pa, ea) ranks before (pb, eb): NaN first, then the larger probability, then the
// lower expert. A strict total order over distinct experts, so every lane of a butterfly
// agrees on the winner.
template <typename A>
__device__ __forceinline__ bool ranks_before(A pa, int ea, A pb, int eb) {
  const bool na = pa != pa, nb = pb != pb;
  if (na != nb) return na;
  if (!na && pa != pb) return pa > pb;
  return ea < eb;
}

template <typename A>
__device__ __forceinline__ A warp_max(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Every lane gets the same bits (each step adds a commutative pair).
template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

// Calls f(m, e) for each expert e < n of this lane: e = m * 32 + lane, m < V (unrolled, m a
// register slot) when V > 0; every 32nd expert, m = 0, when V == 0.
template <int V, typename F>
__device__ __forceinline__ void each_expert(int n, int lane, F&& f) {
  if constexpr (V > 0) {
#pragma unroll
    for (int m = 0; m < V; ++m) {
      const int e = m * 32 + lane;
      if (e < n) f(m, e);
    }
  } else {
    for (int e = lane; e < n; e += 32) f(0, e);
  }
}

template <typename T, int V>
__device__ void forward(const TopkParams& p) {
  using A = typename Acc<T>::type;
  const int lane = threadIdx.x & 31;
  const int n = static_cast<int>(p.experts);
  const int k = static_cast<int>(p.k);
  const bool renormalize = p.renormalize != 0;
  // With k <= 32 every pick is held by one lane until the end: the weights are written once,
  // already divided by their sum.
  const bool scale_on_store = renormalize && k <= 32;
  const long long stride = static_cast<long long>(gridDim.x) * kWarpsPerBlock;
  for (long long row = static_cast<long long>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
       row < p.rows; row += stride) {
    const T* x = static_cast<const T*>(p.logits) + row * p.experts;
    A* w = static_cast<A*>(p.weights) + row * p.k;
    long long* idx = p.indices + row * p.k;
    A v[V > 0 ? V : 1];  // V > 0: the lane's logits, then exponentials, then probabilities

    A mx = -A(INFINITY);
    each_expert<V>(n, lane, [&](int m, int e) {
      const A xe = to_acc(x[e]);
      if constexpr (V > 0) v[m] = xe;
      mx = nan_max(mx, xe);
    });
    mx = warp_max(mx);
    A sum = A(0);
    each_expert<V>(n, lane, [&](int m, int e) {
      if constexpr (V > 0) {
        v[m] = exp_acc(v[m] - mx);
        sum += v[m];
      } else {
        sum += exp_acc(to_acc(x[e]) - mx);
      }
    });
    sum = warp_sum(sum);
    const A inv = recip(sum);
    if constexpr (V > 0) {
      each_expert<V>(n, lane, [&](int m, int) { v[m] = divide(v[m], sum, inv); });
    }
    // p[e], the same bits however often it is computed.
    auto prob = [&](int m, int e) -> A {
      if constexpr (V > 0) {
        return v[m];
      } else {
        (void)m;
        return divide(exp_acc(to_acc(x[e]) - mx), sum, inv);
      }
    };

    A prev_p = A(0), total = A(0), held_w = A(0);
    int prev_e = -1, held_e = 0;
    for (int r = 0; r < k; ++r) {
      A best_p = A(0);
      int best_e = -1;
      each_expert<V>(n, lane, [&](int m, int e) {
        const A pe = prob(m, e);
        if ((prev_e < 0 || ranks_before(prev_p, prev_e, pe, e)) &&
            (best_e < 0 || ranks_before(pe, e, best_p, best_e))) {
          best_p = pe;
          best_e = e;
        }
      });
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const A other_p = __shfl_xor_sync(kFullMask, best_p, o);
        const int other_e = __shfl_xor_sync(kFullMask, best_e, o);
        if (other_e >= 0 && (best_e < 0 || ranks_before(other_p, other_e, best_p, best_e))) {
          best_p = other_p;
          best_e = other_e;
        }
      }
      prev_p = best_p;
      prev_e = best_e;
      total += best_p;
      if (lane == (r & 31)) {
        held_w = best_p;
        held_e = best_e;
      }
      if ((r & 31) == 31 || r == k - 1) {
        const int j = (r & ~31) + lane;
        if (j <= r) {
          w[j] = scale_on_store ? divide(held_w, total, recip(total)) : held_w;
          idx[j] = held_e;
        }
      }
    }
    if (renormalize && !scale_on_store) {
      // Each lane divides the weights it stored itself.
      const A inv_total = recip(total);
      for (int j = lane; j < k; j += 32) w[j] = divide(w[j], total, inv_total);
    }
  }
}

template <typename T>
__device__ void backward(const TopkParams& p) {
  using A = typename Acc<T>::type;
  const int lane = threadIdx.x & 31;
  const int n = static_cast<int>(p.experts);
  const int k = static_cast<int>(p.k);
  const long long stride = static_cast<long long>(gridDim.x) * kWarpsPerBlock;
  for (long long row = static_cast<long long>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
       row < p.rows; row += stride) {
    const T* x = static_cast<const T*>(p.logits) + row * p.experts;
    T* dl = static_cast<T*>(p.grad_logits) + row * p.experts;
    const A* g = static_cast<const A*>(p.grad_weights) + row * p.k;
    const A* w = static_cast<const A*>(p.weights) + row * p.k;
    const long long* idx = p.indices + row * p.k;
    if (p.renormalize) {
      A dot = A(0);
      for (int j = lane; j < k; j += 32) dot += g[j] * w[j];
      dot = warp_sum(dot);
      for (int e = lane; e < n; e += 32) dl[e] = from_acc<T>(A(0));
      __syncwarp();
      for (int j = lane; j < k; j += 32) {
        const long long e = idx[j];
        if (e >= 0 && e < n) dl[e] = from_acc<T>(w[j] * (g[j] - dot));
      }
    } else {
      A mx = -A(INFINITY);
      for (int e = lane; e < n; e += 32) mx = nan_max(mx, to_acc(x[e]));
      mx = warp_max(mx);
      A sum = A(0);
      for (int e = lane; e < n; e += 32) sum += exp_acc(to_acc(x[e]) - mx);
      sum = warp_sum(sum);
      const A inv = recip(sum);
      auto prob = [&](long long e) -> A { return divide(exp_acc(to_acc(x[e]) - mx), sum, inv); };
      A dot = A(0);
      for (int j = lane; j < k; j += 32) {
        const long long e = idx[j];
        if (e >= 0 && e < n) dot += g[j] * prob(e);
      }
      dot = warp_sum(dot);
      for (int e = lane; e < n; e += 32) dl[e] = from_acc<T>(A(0) - prob(e) * dot);
      __syncwarp();
      for (int j = lane; j < k; j += 32) {
        const long long e = idx[j];
        if (e >= 0 && e < n) {
          const A pe = prob(e);
          dl[e] = from_acc<T>((A(0) - pe * dot) + pe * g[j]);
        }
      }
    }
  }
}

}  // namespace graft_topk

// Entry points: graft_topk_softmax_fwd_v{1,2,4,8,16}_<dt> (registers), _fwd_loop_<dt> and
// _bwd_<dt>, 256 threads per block (8 warps, one row each; src/ops/topk_softmax/mod.rs). The
// bounds' one block per SM leaves ptxas every register: without it, it held several of these
// kernels to 40-80 registers by spilling loop invariants (sm_80, sm_100). They use 24 (fwd_v1)
// to 103 (fwd_v16_f64) on sm_90.
#define GRAFT_TOPK_FWD(DT, T, NAME, V)                                       \
  extern "C" __global__ void __launch_bounds__(256, 1)                       \
      graft_topk_softmax_fwd_##NAME##_##DT(const graft_topk::TopkParams p) { \
    graft_topk::forward<T, V>(p);                                            \
  }

#define GRAFT_TOPK_DTYPE(DT, T)                                                        \
  GRAFT_TOPK_FWD(DT, T, v1, 1)                                                         \
  GRAFT_TOPK_FWD(DT, T, v2, 2)                                                         \
  GRAFT_TOPK_FWD(DT, T, v4, 4)                                                         \
  GRAFT_TOPK_FWD(DT, T, v8, 8)                                                         \
  GRAFT_TOPK_FWD(DT, T, v16, 16)                                                       \
  GRAFT_TOPK_FWD(DT, T, loop, 0)                                                       \
  extern "C" __global__ void __launch_bounds__(256, 1)                                 \
      graft_topk_softmax_bwd_##DT(const graft_topk::TopkParams p) {                    \
    graft_topk::backward<T>(p);                                                        \
  }

GRAFT_TOPK_DTYPE(f32, float)
GRAFT_TOPK_DTYPE(f64, double)
GRAFT_TOPK_DTYPE(f16, __half)
GRAFT_TOPK_DTYPE(bf16, __nv_bfloat16)

#undef GRAFT_TOPK_DTYPE
#undef GRAFT_TOPK_FWD

// Mixture-of-experts routing with sigmoid scores and group-limited top-k (DeepSeek-V3's,
// GLM-4-MoE's routers) for graft-cuda. For each row (token) of router logits x over `experts`:
//   s_e = 1 / (1 + exp(0 - x_e)),  c_e = s_e + bias_e (c = s without a bias);
//   groups > 1: groups of gs = experts / groups adjacent experts, each scored by the sum of its
//   two largest c; the experts of all but the `topk_groups` best groups are out;
//   the k largest c among the experts left, largest first, as int64 indices; the weights are
//   their s, divided by (sum of those s + 1e-20) when `renormalize`, times `scale`.
// Every order here (within a group, among groups, among experts) is the CPU kernel's
// larger_first: NaN first, then the larger value, then the lower index. The backward:
//   D = sum_j s_j + 1e-20, dot = sum_j g_j s_j (s_j = s at indices[j], 0 for an index outside
//   [0, experts), which is skipped), ds_j = scale (g_j / D - dot / (D D)) when `renormalize`,
//   else scale g_j; dl[i_j] += ds_j s_j (1 - s_j), 0 for the experts not selected.
// The formulas and each element's order of operations are those of the CPU kernel
// (graft-kernels ops/topk_sigmoid.rs), except: the sums of the backward and the forward's
// renormalization sum are per-lane sums added by a warp butterfly (the CPU adds in selection
// order), and the forward's reciprocals (sigmoid's, the renormalization's) are the hardware's
// approximation refined by Newton steps (within an ulp of the CPU's divisions). Equal logits
// (and equal biases) give equal scores, so ties go the same way. Arithmetic in the
// accumulation type (float; double for double logits); weights in it, indices int64.
//
// One warp per row, blockDim.x / 32 rows per block (the launcher's choice, at most 8), grid-
// stride over rows. The forward's register kernels (fwd_v<V>) hold V choice values c a lane
// (lane l: experts l, l + 32, ...; 32 V >= experts, at most 512); the loop kernel (fwd_loop, any
// count of experts) recomputes c from the row, in L1/L2, at each pass and each round.
// Groups (groups > 1) use the warp's slice of dynamic shared memory (smem_per_warp, mirrored by
// the launcher): the register kernels first store the row's c there; then one lane a group
// (groups lane, lane + 32, ...) scans its gs values for the two largest (the loop kernel
// recomputes them) and stores the group's score; then each lane ranks its groups against all
// the others' scores and marks the kept ones. Selection is k rounds of a warp argmax over the
// kept experts in the total order: round r takes the first expert after round r-1's pick, so
// nothing is marked and no register is indexed at run time. Pick r is held by lane r % 32
// until 32 picks are held or the row ends; then each holder recomputes its expert's s from the
// row and stores it (k <= 32 with renormalization: after the sum, as the final weight). The
// backward (one loop kernel per dtype) zeroes its row, then, after __syncwarp, writes each
// selected expert once: the lane of its first occurrence in the row's indices adds the terms of
// all its occurrences (in index order) and stores the total.

#include "common.cuh"

#ifndef GRAFT_DYN_SMEM
#define GRAFT_DYN_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace graft_topk_sigmoid {

using graft_common::Acc;
using graft_common::divide;
using graft_common::exp_acc;
using graft_common::from_acc;
using graft_common::recip;
using graft_common::to_acc;

// Mirrored by #[repr(C)] TopkSigmoidParams in src/ops/topk_sigmoid/mod.rs; every field is
// 8 bytes.
struct TopkSigmoidParams {
  const void* logits;        // rows x experts, contiguous
  const void* bias;          // experts values, accumulation type; null: none (forward)
  void* weights;             // rows x k, accumulation type (forward output)
  long long* indices;        // rows x k: forward output, backward input
  const void* grad_weights;  // rows x k, accumulation type (backward)
  void* grad_logits;         // rows x experts (backward)
  long long rows;
  long long experts;      // at most INT_MAX (checked by the launcher)
  long long k;            // forward: 1 <= k <= topk_groups * experts / groups
  long long groups;       // divides experts into groups of at least 2 (forward)
  long long topk_groups;  // 1 <= topk_groups <= groups (forward)
  long long renormalize;
  double scale;
};

constexpr unsigned kFullMask = 0xffffffffu;

// What the renormalization adds to the sum of the selected scores (the CPU kernel's
// RENORMALIZE_EPSILON, rounded to the accumulation type as there).
constexpr double kEpsilon = 1e-20;

// Bytes of dynamic shared memory a warp uses in the forward (a multiple of 8): none with one
// group; else the row's c (register kernels: `experts` values), the groups' scores and their
// kept flags. The launcher's smem_per_warp computes the same.
template <typename A, int V>
__device__ __forceinline__ long long smem_per_warp(long long experts, long long groups) {
  if (groups <= 1) return 0;
  const long long values = (V > 0 ? experts : 0) + groups;
  return values * static_cast<long long>(sizeof(A)) + (groups + 7) / 8 * 8;
}

// 1 / (1 + exp(0 - x)), the CPU kernel's formula. The denominator v is at least 1: +inf gives
// 0 as the division does, and v beyond 2^100 (float) or 2^1000 (double), whose reciprocal may
// be subnormal (which rcp.approx.ftz flushes), is scaled by a power of two first.
template <typename A>
__device__ __forceinline__ A sigmoid(A x) {
  const A v = A(1) + exp_acc(A(0) - x);
  if (v == A(INFINITY)) return A(0);
  const bool huge = sizeof(A) == 8 ? v > A(0x1p1000) : v > A(0x1p100);
  const A f = huge ? (sizeof(A) == 8 ? A(0x1p-64) : A(0x1p-32)) : A(1);
  return recip(v * f) * f;
}

// Whether (va, ea) ranks before (vb, eb): NaN first, then the larger value, then the lower
// index (the CPU kernel's larger_first). A strict total order over distinct indices, so every
// lane of a butterfly agrees on the winner.
template <typename A>
__device__ __forceinline__ bool ranks_before(A va, int ea, A vb, int eb) {
  const bool na = va != va, nb = vb != vb;
  if (na != nb) return na;
  if (!na && va != vb) return va > vb;
  return ea < eb;
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
__device__ void forward(const TopkSigmoidParams& p) {
  using A = typename Acc<T>::type;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int n = static_cast<int>(p.experts);
  const int k = static_cast<int>(p.k);
  const int groups = static_cast<int>(p.groups);
  const int gs = n / groups;
  const int topk_groups = static_cast<int>(p.topk_groups);
  const bool renormalize = p.renormalize != 0;
  const A scale = static_cast<A>(p.scale);
  const A* bias = static_cast<const A*>(p.bias);
  // With k <= 32 every pick is held by one lane until the end: the weights are written once.
  const bool hold = k <= 32;

  GRAFT_DYN_SMEM(topk_sigmoid_smem);
  unsigned char* slice = topk_sigmoid_smem + warp * smem_per_warp<A, V>(p.experts, p.groups);
  A* cached = reinterpret_cast<A*>(slice);  // register kernels: the row's c
  A* score = cached + (V > 0 ? n : 0);      // the groups' scores
  unsigned char* kept = reinterpret_cast<unsigned char*>(score + groups);

  const long long stride = static_cast<long long>(gridDim.x) * warps;
  for (long long row = static_cast<long long>(blockIdx.x) * warps + warp; row < p.rows;
       row += stride) {
    const T* x = static_cast<const T*>(p.logits) + row * p.experts;
    A* w = static_cast<A*>(p.weights) + row * p.k;
    long long* idx = p.indices + row * p.k;
    // c[e], the same bits however often it is computed.
    auto choice = [&](int e) -> A {
      const A s = sigmoid(to_acc(x[e]));
      return bias != nullptr ? s + bias[e] : s;
    };
    A c[V > 0 ? V : 1];  // V > 0: the lane's c
    if constexpr (V > 0) each_expert<V>(n, lane, [&](int m, int e) { c[m] = choice(e); });
    // V > 0: bit m says whether expert m * 32 + lane is in a kept group.
    unsigned live = ~0u;
    if (groups > 1) {
      if constexpr (V > 0) {
        each_expert<V>(n, lane, [&](int m, int e) { cached[e] = c[m]; });
        __syncwarp();
      }
      auto cached_choice = [&](int e) -> A {
        if constexpr (V > 0) {
          return cached[e];
        } else {
          return choice(e);
        }
      };
      for (int g = lane; g < groups; g += 32) {
        // The group's two largest c; the scan starts at expert g % gs of the group (any start
        // gives the same pair), which spreads the lanes over the shared-memory banks.
        const int base = g * gs;
        const int start = g % gs;
        A b1 = A(0), b2 = A(0);
        int e1 = -1, e2 = -1;
        for (int i = 0; i < gs; ++i) {
          const int off = start + i < gs ? start + i : start + i - gs;
          const int e = base + off;
          const A v = cached_choice(e);
          if (e1 < 0 || ranks_before(v, e, b1, e1)) {
            b2 = b1;
            e2 = e1;
            b1 = v;
            e1 = e;
          } else if (e2 < 0 || ranks_before(v, e, b2, e2)) {
            b2 = v;
            e2 = e;
          }
        }
        score[g] = b1 + b2;
      }
      __syncwarp();
      for (int g = lane; g < groups; g += 32) {
        const A sg = score[g];
        int before = 0;
        for (int h = 0; h < groups && before < topk_groups; ++h) {
          before += ranks_before(score[h], h, sg, g) ? 1 : 0;
        }
        kept[g] = before < topk_groups ? 1 : 0;
      }
      __syncwarp();
      if constexpr (V > 0) {
        live = 0;
        each_expert<V>(n, lane, [&](int m, int e) {
          if (kept[e / gs]) live |= 1u << m;
        });
      }
    }

    A prev_c = A(0), held_s = A(0), part = A(0);
    int prev_e = -1, held_e = 0;
    for (int r = 0; r < k; ++r) {
      A best_c = A(0);
      int best_e = -1;
      auto consider = [&](A v, int e) {
        if ((prev_e < 0 || ranks_before(prev_c, prev_e, v, e)) &&
            (best_e < 0 || ranks_before(v, e, best_c, best_e))) {
          best_c = v;
          best_e = e;
        }
      };
      if constexpr (V > 0) {
        each_expert<V>(n, lane, [&](int m, int e) {
          if ((live >> m) & 1u) consider(c[m], e);
        });
      } else {
        for (int e = lane; e < n; e += 32) {
          if (groups == 1 || kept[e / gs]) consider(choice(e), e);
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const A other_c = __shfl_xor_sync(kFullMask, best_c, o);
        const int other_e = __shfl_xor_sync(kFullMask, best_e, o);
        if (other_e >= 0 && (best_e < 0 || ranks_before(other_c, other_e, best_c, best_e))) {
          best_c = other_c;
          best_e = other_e;
        }
      }
      prev_c = best_c;
      prev_e = best_e;
      if (lane == (r & 31)) held_e = best_e;
      if ((r & 31) == 31 || r == k - 1) {
        const int j = (r & ~31) + lane;
        if (j <= r) {
          const A s = sigmoid(to_acc(x[held_e]));
          part += s;
          idx[j] = held_e;
          if (hold) {
            held_s = s;
          } else {
            w[j] = renormalize ? s : s * scale;
          }
        }
      }
    }
    if (renormalize) {
      const A denominator = warp_sum(part) + static_cast<A>(kEpsilon);
      const A inv = recip(denominator);
      if (hold) {
        if (lane < k) w[lane] = divide(held_s, denominator, inv) * scale;
      } else {
        // Each lane rescales the weights it stored itself.
        for (int j = lane; j < k; j += 32) w[j] = divide(w[j], denominator, inv) * scale;
      }
    } else if (hold && lane < k) {
      w[lane] = held_s * scale;
    }
  }
}

template <typename T>
__device__ void backward(const TopkSigmoidParams& p) {
  using A = typename Acc<T>::type;
  const int lane = threadIdx.x & 31;
  const int warps = blockDim.x >> 5;
  const int n = static_cast<int>(p.experts);
  const int k = static_cast<int>(p.k);
  const bool renormalize = p.renormalize != 0;
  const A scale = static_cast<A>(p.scale);
  const long long stride = static_cast<long long>(gridDim.x) * warps;
  for (long long row = static_cast<long long>(blockIdx.x) * warps + (threadIdx.x >> 5);
       row < p.rows; row += stride) {
    const T* x = static_cast<const T*>(p.logits) + row * p.experts;
    T* dl = static_cast<T*>(p.grad_logits) + row * p.experts;
    const A* g = static_cast<const A*>(p.grad_weights) + row * p.k;
    const long long* idx = p.indices + row * p.k;
    auto valid = [&](long long e) { return e >= 0 && e < n; };
    A sum = A(0), dot = A(0);
    for (int j = lane; j < k; j += 32) {
      const long long e = idx[j];
      const A s = valid(e) ? sigmoid(to_acc(x[e])) : A(0);
      sum += s;
      dot += g[j] * s;
    }
    sum = warp_sum(sum);
    dot = warp_sum(dot);
    const A denominator = sum + static_cast<A>(kEpsilon);
    const A square = denominator * denominator;
    for (int e = lane; e < n; e += 32) dl[e] = from_acc<T>(A(0));
    __syncwarp();
    for (int j = lane; j < k; j += 32) {
      const long long e = idx[j];
      if (!valid(e)) continue;
      bool first = true;
      for (int i = 0; i < j && first; ++i) first = idx[i] != e;
      if (!first) continue;
      const A s = sigmoid(to_acc(x[e]));
      A total = A(0);
      for (int i = j; i < k; ++i) {
        if (idx[i] != e) continue;
        // Plain divisions: square may be subnormal, and nothing here is held in registers.
        const A ds = renormalize ? scale * (g[i] / denominator - dot / square) : scale * g[i];
        total += ds * s * (A(1) - s);
      }
      dl[e] = from_acc<T>(total);
    }
  }
}

}  // namespace graft_topk_sigmoid

// Entry points: graft_topk_sigmoid_fwd_v{1,2,4,8,16}_<dt> (registers), _fwd_loop_<dt> and
// _bwd_<dt>, blockDim.x / 32 rows per block (src/ops/topk_sigmoid/mod.rs). One block per SM in
// the bounds leaves ptxas every register, as in topk_softmax.cu.
#define GRAFT_TOPK_SIGMOID_FWD(DT, T, NAME, V)                                             \
  extern "C" __global__ void __launch_bounds__(256, 1)                                     \
      graft_topk_sigmoid_fwd_##NAME##_##DT(const graft_topk_sigmoid::TopkSigmoidParams p) { \
    graft_topk_sigmoid::forward<T, V>(p);                                                  \
  }

#define GRAFT_TOPK_SIGMOID_DTYPE(DT, T)                                               \
  GRAFT_TOPK_SIGMOID_FWD(DT, T, v1, 1)                                                \
  GRAFT_TOPK_SIGMOID_FWD(DT, T, v2, 2)                                                \
  GRAFT_TOPK_SIGMOID_FWD(DT, T, v4, 4)                                                \
  GRAFT_TOPK_SIGMOID_FWD(DT, T, v8, 8)                                                \
  GRAFT_TOPK_SIGMOID_FWD(DT, T, v16, 16)                                              \
  GRAFT_TOPK_SIGMOID_FWD(DT, T, loop, 0)                                              \
  extern "C" __global__ void __launch_bounds__(256, 1)                                \
      graft_topk_sigmoid_bwd_##DT(const graft_topk_sigmoid::TopkSigmoidParams p) {    \
    graft_topk_sigmoid::backward<T>(p);                                               \
  }

GRAFT_TOPK_SIGMOID_DTYPE(f32, float)
GRAFT_TOPK_SIGMOID_DTYPE(f64, double)
GRAFT_TOPK_SIGMOID_DTYPE(f16, __half)
GRAFT_TOPK_SIGMOID_DTYPE(bf16, __nv_bfloat16)

#undef GRAFT_TOPK_SIGMOID_DTYPE
#undef GRAFT_TOPK_SIGMOID_FWD

// Cross-entropy for graft-cuda: per-row loss and, in the same kernel, the gradient, written to
// its own buffer or over the logits. For a row x of `cols` logits, target t and label smoothing
// eps:
//   lse  = log(sum_c exp(x_c))
//   loss = lse - (1 - eps) x_t - (eps / cols) sum_c x_c
//   grad = scale * (softmax(x) - (1 - eps) onehot(t) - eps / cols)
// Rows whose target is `ignore_index` get loss 0 and a zero gradient; any other target outside
// [0, cols) stops the count kernel (always launched first) with a device-side assertion, as
// ATen's CUDA loss does.
//
// One block per row (grid-stride over rows). Pass 1 reads the row once for its maximum and sum
// of exponentials (online softmax, per 16-byte pack), pass 2 reads it again (mostly from L2)
// and writes the gradient. Pass 1 asks L2 to keep the row (evict-last), pass 2 to drop it
// first (its last read, and the gradient's stores). Arithmetic in the accumulation type (float; double for double),
// exponentials with __expf in float. The gradient may alias the logits: each element is read
// before it is written, by the thread that writes it.
//
// Vocabulary blocks (the two-pass fused linear cross-entropy, whose rows' logits exist one block
// of classes at a time): the block stats kernel merges a block into each row's running maximum
// and sum of exponentials (online softmax) and records the target's logit when the target is in
// the block; after the last block it writes the loss and the log-sum-exp. The block grad kernel
// turns a block of logits into the loss's gradient in place, (exp(x - lse) - [c == t]) * factor.
// The accumulate kernel adds one float buffer into another (the f32 accumulator of the hidden
// states' gradient).
//
// Also here: counting the rows that are not ignored (the mean's divisor, read by the row kernel
// so that nothing waits for the host), reducing the per-row losses, and scaling a gradient by
// the upstream gradient (a scalar or one factor per row; in place, rows whose factor is exactly
// 1 are not touched).

#include <assert.h>

#include "common.cuh"

namespace graft_ce {

using graft_common::Acc;
using graft_common::from_acc;
using graft_common::Pack;
using graft_common::to_acc;

// Mirrored by #[repr(C)] CeRowsParams in src/cross_entropy.rs; every field is 8 bytes.
struct CeRowsParams {
  const void* logits;      // rows x cols, row-major, contiguous
  const long long* target; // rows
  void* grad;              // rows x cols, or null (loss only); may equal logits
  void* loss;              // rows, accumulation type
  const double* count;     // rows not ignored (grad scale 1 / count), or null (scale 1)
  const void* row_scale;   // rows factors (accumulation type), or null
  long long rows;
  long long cols;
  long long ignore_index;
  double on_target;        // 1 - eps
  double per_class;        // eps / cols
  long long smoothing;     // eps > 0: the row's sum is needed
};

struct CeCountParams {
  const long long* target;
  double* count;
  long long rows;
  long long cols;
  long long ignore_index;
};

struct CeReduceParams {
  const void* loss_rows;   // rows, accumulation type
  const double* count;     // mean: divide by *count; null: sum
  void* out;               // one value, accumulation type
  long long rows;
};

struct CeScaleParams {
  const void* src;         // n elements
  void* dst;               // n elements (may equal src)
  const void* factor;      // one value, or one per row of `cols` (accumulation type)
  long long n;
  long long cols;
  long long per_row;
  long long vec;           // 16-byte packs (pointers aligned, cols a multiple of the pack)
};

// Mirrored by #[repr(C)] BlockStatsParams in src/cross_entropy.rs; every field is 8 bytes.
struct CeBlockStatsParams {
  const void* logits;      // rows x cols: one block of classes, row-major, contiguous
  const long long* target; // rows (whole-vocabulary class indices)
  void* max;               // rows, accumulation type: running maximum; lse after the last block
  void* sum;               // rows, accumulation type: running sum of exp(x - max)
  void* target_logit;      // rows, accumulation type: written by the block holding the target
  void* loss;              // rows, accumulation type: lse - x_t, written by the last block; null
                           // for the other blocks
  long long rows;
  long long cols;
  long long first_col;     // class index of the block's first column
  long long ignore_index;
  long long first;         // the first block: max and sum are written, not read
};

// Mirrored by #[repr(C)] BlockGradParams in src/cross_entropy.rs.
struct CeBlockGradParams {
  void* logits;            // rows x cols, replaced by the gradient
  const long long* target; // rows
  const void* lse;         // rows, accumulation type
  const double* count;     // rows not ignored (factor 1 / count), or null (factor 1)
  const void* row_scale;   // rows factors (accumulation type), or null
  long long rows;
  long long cols;
  long long first_col;
  long long ignore_index;
};

// Mirrored by #[repr(C)] AccumulateParams in src/cross_entropy.rs: acc[i] += src[i] (float).
struct CeAccumulateParams {
  float* acc;
  const float* src;
  long long n;
  long long vec;           // 16-byte packs (both pointers 16-byte aligned, n a multiple of 4)
};

constexpr int kMaxWarps = 32;

__device__ __forceinline__ float fast_exp(float v) { return __expf(v); }
__device__ __forceinline__ double fast_exp(double v) { return exp(v); }
__device__ __forceinline__ float neg_inf(float) { return -INFINITY; }
__device__ __forceinline__ double neg_inf(double) { return -(double)INFINITY; }

// exp(v - m) for the softmax sums: 0 for v = -inf (also when m is -inf, where v - m is NaN).
template <typename A>
__device__ __forceinline__ A exp_shifted(A v, A m) {
  return v == neg_inf(v) ? A(0) : fast_exp(v - m);
}

// (m, s) merged with (m2, s2): s scaled to the larger maximum. While a maximum is -inf its sum
// is 0, or NaN when a NaN element was seen: both survive the merge (0 * NaN is NaN).
template <typename A>
__device__ __forceinline__ void merge(A& m, A& s, A m2, A s2) {
  const A mx = m > m2 ? m : m2;
  if (mx == neg_inf(mx)) {
    s = s + s2;
  } else {
    s = s * exp_shifted(m, mx) + s2 * exp_shifted(m2, mx);
  }
  // NaN maxima do not occur: NaN elements never win a comparison, they reach s.
  m = mx;
}

// Adds values v[0..n) to the thread's running (m, s, sum).
template <typename A, int N>
__device__ __forceinline__ void accumulate(const A (&v)[N], A& m, A& s, A& sum, bool smoothing) {
  A pm = v[0];
#pragma unroll
  for (int e = 1; e < N; ++e) pm = v[e] > pm ? v[e] : pm;
  if (pm > m) {
    // From m = -inf the factor is exp(-inf) = 0: s (0, or NaN after a NaN element) keeps a NaN.
    s = s * fast_exp(m - pm);
    m = pm;
  }
#pragma unroll
  for (int e = 0; e < N; ++e) {
    s += exp_shifted(v[e], m);
    if (smoothing) sum += v[e];
  }
}

// Block-wide merge of every thread's (m, s, sum); every thread gets the result.
template <typename A>
__device__ void block_reduce(A& m, A& s, A& sum) {
  __shared__ A sm[kMaxWarps], ss[kMaxWarps], su[kMaxWarps];
  for (int o = 16; o > 0; o >>= 1) {
    const A m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const A s2 = __shfl_xor_sync(0xffffffffu, s, o);
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
    merge(m, s, m2, s2);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warps = (blockDim.x + 31) / 32;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
    su[warp] = sum;
  }
  __syncthreads();
  m = sm[0];
  s = ss[0];
  sum = su[0];
  for (int w = 1; w < warps; ++w) {
    merge(m, s, sm[w], ss[w]);
    sum += su[w];
  }
  __syncthreads();  // the shared arrays are reused by the next row
}

// Elements before the first 16-byte boundary of p (p is aligned to its element size).
template <typename T>
__device__ __forceinline__ long long head_of(const T* p, long long cols) {
  const long long misalign = (long long)((unsigned long long)p & 15u);
  const long long head = misalign == 0 ? 0 : (16 - misalign) / (long long)sizeof(T);
  return head < cols ? head : cols;
}

// This thread's share of a row's statistics (block-strided over x[0..cols)): the running
// maximum m, the sum s of exponentials relative to it and, with smoothing, the plain sum;
// the unaligned head and the tail element by element, the body in 16-byte packs (read with
// the L2 eviction `policy`).
template <typename T, typename A>
__device__ __forceinline__ void row_partial_stats(const T* x, long long cols, A& m, A& s, A& sum,
                                                  bool smoothing, unsigned long long policy) {
  constexpr int N = Pack<T>::N;
  const long long head = head_of(x, cols);
  const long long packs = (cols - head) / N;
  const long long body_end = head + packs * N;
  for (long long c = threadIdx.x; c < head; c += blockDim.x) {
    const A v[1] = {to_acc(x[c])};
    accumulate(v, m, s, sum, smoothing);
  }
  // Unrolled so that several 16-byte loads are in flight per thread (8: loss alone 0.99 ms
  // against 1.01 with 4 at 8192 x 128256, bf16, H100).
#pragma unroll 8
  for (long long k = threadIdx.x; k < packs; k += blockDim.x) {
    const Pack<T> pk = graft_common::load_pack_hinted(x + head + k * N, policy);
    A v[N];
#pragma unroll
    for (int e = 0; e < N; ++e) v[e] = to_acc(pk.v[e]);
    accumulate(v, m, s, sum, smoothing);
  }
  for (long long c = body_end + threadIdx.x; c < cols; c += blockDim.x) {
    const A v[1] = {to_acc(x[c])};
    accumulate(v, m, s, sum, smoothing);
  }
}

template <typename T>
__device__ void rows_kernel(const CeRowsParams& p) {
  using A = typename Acc<T>::type;
  constexpr int N = Pack<T>::N;
  const T* logits = static_cast<const T*>(p.logits);
  T* grad = static_cast<T*>(p.grad);
  A* loss = static_cast<A*>(p.loss);
  const A* row_scale = static_cast<const A*>(p.row_scale);
  const long long cols = p.cols;
  const bool smoothing = p.smoothing != 0;
  const A on_target = A(p.on_target), per_class = A(p.per_class);
  A all_scale = A(1);
  if (p.count != nullptr) all_scale = A(1.0 / *p.count);
  // Without a gradient pass 1 is the row's only read.
  const unsigned long long keep =
      grad == nullptr ? graft_common::l2_evict_first_policy() : graft_common::l2_evict_last_policy();
  const unsigned long long last_use = graft_common::l2_evict_first_policy();

  for (long long row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = logits + row * cols;
    T* g = grad == nullptr ? nullptr : grad + row * cols;
    const long long t = p.target[row];
    if (t == p.ignore_index) {
      if (threadIdx.x == 0) loss[row] = A(0);
      if (g != nullptr) {
        for (long long c = threadIdx.x; c < cols; c += blockDim.x) g[c] = from_acc<T>(A(0));
      }
      continue;
    }
    // The count kernel, launched before this one on the same stream, asserts on bad targets
    // (as ATen does); this guard only keeps the read below in bounds.
    if (t < 0 || t >= cols) __trap();

    // The target's logit, read before any thread of the block can overwrite it in pass 2.
    const A xt = threadIdx.x == 0 ? to_acc(x[t]) : A(0);

    // Pass 1: maximum, sum of exponentials, sum of the row.
    A m = neg_inf(A(0)), s = A(0), sum = A(0);
    row_partial_stats(x, cols, m, s, sum, smoothing, keep);
    block_reduce(m, s, sum);
    const A lse = m + log(s);
    if (threadIdx.x == 0) {
      A l = lse - on_target * xt;
      if (smoothing) l -= per_class * sum;
      loss[row] = l;
    }
    if (g == nullptr) continue;

    // Pass 2: the gradient.
    const A scale = row_scale == nullptr ? all_scale : all_scale * row_scale[row];
    const A hit = on_target * scale;
    const bool same_phase = (((unsigned long long)g ^ (unsigned long long)x) & 15u) == 0;
    if (same_phase) {
      const long long head = head_of(x, cols);
      const long long packs = (cols - head) / N;
      const long long body_end = head + packs * N;
      for (long long c = threadIdx.x; c < head; c += blockDim.x) {
        const A v = to_acc(x[c]);
        g[c] = from_acc<T>((fast_exp(v - lse) - per_class) * scale - (c == t ? hit : A(0)));
      }
#pragma unroll 4
      for (long long k = threadIdx.x; k < packs; k += blockDim.x) {
        const long long c0 = head + k * N;
        const Pack<T> pk = graft_common::load_pack_hinted(x + c0, last_use);
        Pack<T> out;
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const A v = to_acc(pk.v[e]);
          const A gv = (fast_exp(v - lse) - per_class) * scale;
          out.v[e] = from_acc<T>(c0 + e == t ? gv - hit : gv);
        }
        graft_common::store_pack_hinted(g + c0, out, last_use);
      }
      for (long long c = body_end + threadIdx.x; c < cols; c += blockDim.x) {
        const A v = to_acc(x[c]);
        g[c] = from_acc<T>((fast_exp(v - lse) - per_class) * scale - (c == t ? hit : A(0)));
      }
    } else {
      for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
        const A v = to_acc(x[c]);
        g[c] = from_acc<T>((fast_exp(v - lse) - per_class) * scale - (c == t ? hit : A(0)));
      }
    }
  }
}

// One block per row (grid-stride): the row's maximum and sum of exponentials over this block,
// merged into the running ones; the target's logit when it is in the block; after the last
// block, lse (over max) and the loss. Ignored rows are skipped (loss 0).
template <typename T>
__device__ void block_stats_kernel(const CeBlockStatsParams& p) {
  using A = typename Acc<T>::type;
  const T* logits = static_cast<const T*>(p.logits);
  A* run_max = static_cast<A*>(p.max);
  A* run_sum = static_cast<A*>(p.sum);
  A* tl = static_cast<A*>(p.target_logit);
  A* loss = static_cast<A*>(p.loss);
  const long long cols = p.cols;
  const unsigned long long normal = graft_common::l2_evict_normal_policy();
  for (long long row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = logits + row * cols;
    const long long t = p.target[row];
    if (t == p.ignore_index) {
      if (threadIdx.x == 0 && loss != nullptr) loss[row] = A(0);
      continue;
    }
    A m = neg_inf(A(0)), s = A(0), unused = A(0);
    row_partial_stats(x, cols, m, s, unused, false, normal);
    block_reduce(m, s, unused);
    if (threadIdx.x == 0) {
      const long long local = t - p.first_col;
      if (local >= 0 && local < cols) tl[row] = to_acc(x[local]);
      if (!p.first) merge(m, s, run_max[row], run_sum[row]);
      if (loss != nullptr) {
        const A lse = m + log(s);
        run_max[row] = lse;
        loss[row] = lse - tl[row];
      } else {
        run_max[row] = m;
        run_sum[row] = s;
      }
    }
  }
}

// One block per row (grid-stride): the block's logits replaced by
// (exp(x - lse) - [class == target]) * factor; zeros for ignored rows.
template <typename T>
__device__ void block_grad_kernel(const CeBlockGradParams& p) {
  using A = typename Acc<T>::type;
  constexpr int N = Pack<T>::N;
  T* logits = static_cast<T*>(p.logits);
  const A* lse_rows = static_cast<const A*>(p.lse);
  const A* row_scale = static_cast<const A*>(p.row_scale);
  const long long cols = p.cols;
  A all_scale = A(1);
  if (p.count != nullptr) all_scale = A(1.0 / *p.count);
  for (long long row = blockIdx.x; row < p.rows; row += gridDim.x) {
    T* g = logits + row * cols;
    const long long t = p.target[row];
    if (t == p.ignore_index) {
      for (long long c = threadIdx.x; c < cols; c += blockDim.x) g[c] = from_acc<T>(A(0));
      continue;
    }
    const long long local = t - p.first_col;
    const A lse = lse_rows[row];
    const A f = row_scale == nullptr ? all_scale : all_scale * row_scale[row];
    if constexpr (sizeof(T) == 8) {
      // Double (tests, not speed): one element per step; the pack loops spill there.
      for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
        const A v = to_acc(g[c]);
        g[c] = from_acc<T>(fast_exp(v - lse) * f - (c == local ? f : A(0)));
      }
      continue;
    }
    const long long head = head_of(g, cols);
    const long long packs = (cols - head) / N;
    const long long body_end = head + packs * N;
    for (long long c = threadIdx.x; c < head; c += blockDim.x) {
      const A v = to_acc(g[c]);
      g[c] = from_acc<T>(fast_exp(v - lse) * f - (c == local ? f : A(0)));
    }
#pragma unroll 4
    for (long long k = threadIdx.x; k < packs; k += blockDim.x) {
      const long long c0 = head + k * N;
      const Pack<T> pk = graft_common::load_pack(g + c0);
      Pack<T> out;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const A gv = fast_exp(to_acc(pk.v[e]) - lse) * f;
        out.v[e] = from_acc<T>(c0 + e == local ? gv - f : gv);
      }
      graft_common::store_pack(g + c0, out);
    }
    for (long long c = body_end + threadIdx.x; c < cols; c += blockDim.x) {
      const A v = to_acc(g[c]);
      g[c] = from_acc<T>(fast_exp(v - lse) * f - (c == local ? f : A(0)));
    }
  }
}

// acc[i] += src[i] (grid-stride).
__device__ void accumulate_kernel(const CeAccumulateParams& p) {
  const long long stride = graft_common::grid_threads();
  const long long first = graft_common::thread_index();
  if (p.vec) {
    constexpr int N = Pack<float>::N;
    for (long long k = first; k < p.n / N; k += stride) {
      Pack<float> a = graft_common::load_pack(p.acc + k * N);
      const Pack<float> b = graft_common::load_pack(p.src + k * N);
#pragma unroll
      for (int e = 0; e < N; ++e) a.v[e] += b.v[e];
      graft_common::store_pack(p.acc + k * N, a);
    }
  } else {
    for (long long i = first; i < p.n; i += stride) p.acc[i] += p.src[i];
  }
}

// One block: counts the rows whose target is not ignore_index, and stops with a device-side
// assertion at a target that is neither ignore_index nor a class (ATen's CUDA behaviour).
__device__ void count_kernel(const CeCountParams& p) {
  __shared__ long long part[kMaxWarps];
  long long n = 0;
  for (long long r = threadIdx.x; r < p.rows; r += blockDim.x) {
    const long long t = p.target[r];
    if (t == p.ignore_index) continue;
    assert(t >= 0 && t < p.cols && "Target is out of bounds");
    ++n;
  }
  for (int o = 16; o > 0; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = n;
  __syncthreads();
  if (threadIdx.x == 0) {
    long long total = 0;
    for (int w = 0; w < (int)((blockDim.x + 31) / 32); ++w) total += part[w];
    *p.count = (double)total;
  }
}

// One block: the sum of the per-row losses (in double, a fixed order), divided by *count for a
// mean (0 / 0 is NaN, as in ATen).
template <typename A>
__device__ void reduce_kernel(const CeReduceParams& p) {
  __shared__ double part[kMaxWarps];
  const A* l = static_cast<const A*>(p.loss_rows);
  double acc = 0.0;
  for (long long r = threadIdx.x; r < p.rows; r += blockDim.x) acc += (double)l[r];
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int w = 0; w < (int)((blockDim.x + 31) / 32); ++w) total += part[w];
    if (p.count != nullptr) total /= *p.count;
    *static_cast<A*>(p.out) = A(total);
  }
}

// dst = src * factor, elementwise (grid-stride); in place, elements whose factor is exactly 1
// are neither read nor written.
template <typename T>
__device__ void scale_kernel(const CeScaleParams& p) {
  using A = typename Acc<T>::type;
  const T* src = static_cast<const T*>(p.src);
  T* dst = static_cast<T*>(p.dst);
  const A* factor = static_cast<const A*>(p.factor);
  const bool in_place = p.src == p.dst;
  if (!p.per_row && in_place && factor[0] == A(1)) return;
  const long long stride = graft_common::grid_threads();
  const long long first = graft_common::thread_index();
  if (p.vec) {
    constexpr int N = Pack<T>::N;
    for (long long k = first; k < p.n / N; k += stride) {
      const A f = factor[p.per_row ? k * N / p.cols : 0];
      if (in_place && f == A(1)) continue;
      const Pack<T> in = graft_common::load_pack(src + k * N);
      Pack<T> out;
#pragma unroll
      for (int e = 0; e < N; ++e) out.v[e] = from_acc<T>(to_acc(in.v[e]) * f);
      graft_common::store_pack(dst + k * N, out);
    }
  } else {
    for (long long i = first; i < p.n; i += stride) {
      const A f = factor[p.per_row ? i / p.cols : 0];
      if (in_place && f == A(1)) continue;
      dst[i] = from_acc<T>(to_acc(src[i]) * f);
    }
  }
}

}  // namespace graft_ce

// Entry points (src/cross_entropy.rs launches them): rows kernels with at most MAXT threads (a
// multiple of 32; one such block per SM leaves each thread up to 64 registers, 128 for double),
// the one-block count and reduce kernels with 1024, the scale and accumulate kernels with 256, the
// vocabulary-block kernels with at most BLOCKT (several blocks per SM: their rows are short; 1024
// threads would leave 64 registers a thread, where the bf16 stats kernel spills on sm_100).
#define GRAFT_CE_DTYPE(DT, T, MAXT, BLOCKT)                                                         \
  extern "C" __global__ void __launch_bounds__(MAXT, 1)                                       \
      graft_ce_rows_##DT(const graft_ce::CeRowsParams p) {                                    \
    graft_ce::rows_kernel<T>(p);                                                              \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(256)                                           \
      graft_ce_scale_##DT(const graft_ce::CeScaleParams p) {                                  \
    graft_ce::scale_kernel<T>(p);                                                             \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(BLOCKT)                                        \
      graft_ce_block_stats_##DT(const graft_ce::CeBlockStatsParams p) {                       \
    graft_ce::block_stats_kernel<T>(p);                                                       \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(BLOCKT)                                        \
      graft_ce_block_grad_##DT(const graft_ce::CeBlockGradParams p) {                         \
    graft_ce::block_grad_kernel<T>(p);                                                        \
  }

GRAFT_CE_DTYPE(f32, float, 1024, 512)
GRAFT_CE_DTYPE(f64, double, 512, 512)
GRAFT_CE_DTYPE(f16, __half, 1024, 512)
GRAFT_CE_DTYPE(bf16, __nv_bfloat16, 1024, 512)

extern "C" __global__ void __launch_bounds__(256)
    graft_ce_accumulate_f32(const graft_ce::CeAccumulateParams p) {
  graft_ce::accumulate_kernel(p);
}
extern "C" __global__ void __launch_bounds__(1024) graft_ce_count(const graft_ce::CeCountParams p) {
  graft_ce::count_kernel(p);
}
extern "C" __global__ void __launch_bounds__(1024)
    graft_ce_reduce_f32(const graft_ce::CeReduceParams p) {
  graft_ce::reduce_kernel<float>(p);
}
extern "C" __global__ void __launch_bounds__(1024)
    graft_ce_reduce_f64(const graft_ce::CeReduceParams p) {
  graft_ce::reduce_kernel<double>(p);
}

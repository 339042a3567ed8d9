// LayerNorm forward and backward for graft-cuda, with the semantics of ATen's
// `native_layer_norm` / `native_layer_norm_backward` over `rows` contiguous rows of `cols`:
//   forward:  mean = sum(x) / cols, var = sum((x - mean)^2) / cols, rstd = 1 / sqrt(var + eps),
//             y = (x - mean) * rstd * w + b  (w, b of the input's type, each optional)
//   backward: xhat = (x - mean) * rstd, g = dy * w,
//             dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),
//             dw = sum over rows of dy * xhat, db = sum over rows of dy
// in the accumulation type A (float; double for double); mean and rstd are A.
//
// Kernel shapes (as ops/softmax/softmax.cu):
//   *_rows_{v,s}{V}  a row group of `tpr` threads holds a row in registers (V units of 16
//                    bytes per thread, 16-byte or element accesses); `rpb` groups per block.
//                    Forward: one read, one write; 16-bit inputs take the mean and variance
//                    from one reduction of shifted sums (below). Backward: a persistent grid;
//                    each thread keeps dw and db for its columns across rows, the row groups
//                    of a block are added in a fixed order and each block writes one partial
//                    row (dw then db). With `stage` (vector access), each thread copies its
//                    units of the block's next x and dy rows into shared memory (cp.async)
//                    while the current row computes: the loads stay in flight through the
//                    row's reduction and stores.
//   fwd_staged       16-bit rows of 16-byte units (2048 to 16384 columns): one row per block at
//                    a time, copied into shared memory (cp.async) and read back twice, for the
//                    shifted sums and for y. An SM keeps as many rows in flight as its shared
//                    memory holds.
//   bwd_bulk         16-bit rows of 16-byte units (7168 to 8192 columns, sm_90+): a persistent
//                    grid of clusters, each block a slice of every row fetched by bulk copies,
//                    the row's sums exchanged in the cluster; one partial row per cluster.
//   *_loop           any cols: one row per block at a time. Forward: shifted sums (around the
//                    row's first element) in one pass, the output in a second. Backward: the
//                    row's sums, then dx, adding dw and db into the block's partial row.
//   *_finalize       dw and db: the partial rows summed in block order (the same bits on every
//                    run), rounded to the parameters' type.

#include "common.cuh"

// Dynamic shared memory declaration (a macro so that emu/ can run these kernels on the CPU).
#ifndef GRAFT_DYN_SMEM
#define GRAFT_DYN_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace graft_layer_norm {

using graft_common::Acc;
using graft_common::BulkSync;
using graft_common::copy_async;
using graft_common::copy_async_commit;
using graft_common::copy_async_wait_all;
using graft_common::copy_async_wait_all_but_one;
using graft_common::from_acc;
using graft_common::group_reduce;
using graft_common::group_sum_pair;
using graft_common::load_unit;
using graft_common::Pack;
using graft_common::Slice;
using graft_common::store_unit;
using graft_common::SumOp;
using graft_common::to_acc;
using graft_common::Units;

// Mirrored by #[repr(C)] LayerNormParams in src/layer_norm.rs; every field is 8 bytes.
struct Params {
  const void* x;
  const void* w;   // null: no weight
  const void* b;   // null: no bias (forward)
  void* y;         // forward
  void* mean;      // forward: written; backward: read
  void* rstd;      // forward: written; backward: read
  const void* dy;  // backward
  void* dx;        // backward; null when dx is not wanted
  void* partial;   // backward: gridDim.x rows of 2 * cols A (dw, db); null when not wanted
  long long rows;
  long long cols;
  long long tpr;
  long long rpb;
  long long vec;
  long long stage;  // backward rows kernels, vector access: rows staged in shared memory
  double eps;
  double inv_cols;
};

struct FinalizeParams {
  const void* partial;
  void* dw;  // null when not wanted
  void* db;  // null when not wanted
  long long nparts;
  long long cols;
};

constexpr int kLoopThreads = 512;
// The bulk backward: clusters of kBulkCluster blocks of kBulkThreads threads, kBulkUnits
// units a thread (src/layer_norm.rs mirrors these), four blocks an SM.
constexpr int kBulkCluster = 4;
constexpr int kBulkThreads = 128;
constexpr int kBulkUnits = 2;
// Launch bounds of the staged forward (32 registers).
constexpr int kStagedThreads = 512;
constexpr int kStagedMinBlocks = 4;

__device__ __forceinline__ float rsqrt_acc(float v) { return rsqrtf(v); }
__device__ __forceinline__ double rsqrt_acc(double v) { return 1.0 / sqrt(v); }

// A row's mean and rstd from its sums s1 of x - K and s2 of (x - K)^2 around K = `shift`.
template <typename A>
__device__ __forceinline__ void shifted_stats(A shift, A s1, A s2, A inv_cols, A eps, A& mean,
                                              A& r) {
  const A dm = s1 * inv_cols;
  mean = shift + dm;
  A var = s2 * inv_cols - dm * dm;
  var = var < A(0) ? A(0) : var;  // NaN (a non-finite row) stays NaN
  r = rsqrt_acc(var + eps);
}

// Launch bounds of the rows kernels by direction, element size, V and vector access: the
// bound keeping the most bytes in flight per SM with no spill on sm_80, sm_90 and sm_100 (ptxas).
// Mirrored by `rows_table` in src/layer_norm.rs.
template <bool kBackward, int kSize, int V, bool VEC>
struct RowsBounds;
#define GRAFT_LN_BOUNDS(BWD, SIZE, V, VEC, THREADS, MIN_BLOCKS) \
  template <>                                                   \
  struct RowsBounds<BWD, SIZE, V, VEC> {                        \
    static constexpr int threads = THREADS;                     \
    static constexpr int min_blocks = MIN_BLOCKS;               \
  };
GRAFT_LN_BOUNDS(false, 4, 1, true, 1024, 2)
GRAFT_LN_BOUNDS(false, 4, 2, true, 1024, 1)
GRAFT_LN_BOUNDS(false, 4, 4, true, 1024, 1)
GRAFT_LN_BOUNDS(false, 4, 8, true, 256, 2)
GRAFT_LN_BOUNDS(false, 4, 1, false, 1024, 2)
GRAFT_LN_BOUNDS(false, 4, 2, false, 512, 2)
GRAFT_LN_BOUNDS(false, 2, 1, true, 1024, 2)
GRAFT_LN_BOUNDS(false, 2, 2, true, 1024, 1)
GRAFT_LN_BOUNDS(false, 2, 4, true, 512, 2)
GRAFT_LN_BOUNDS(false, 2, 8, true, 256, 2)
GRAFT_LN_BOUNDS(false, 2, 1, false, 1024, 1)
// The 16-bit scalar V = 2 forward spills at 64 registers on sm_90 and sm_100: one block.
GRAFT_LN_BOUNDS(false, 2, 2, false, 512, 1)
GRAFT_LN_BOUNDS(false, 8, 1, true, 1024, 2)
GRAFT_LN_BOUNDS(false, 8, 2, true, 1024, 1)
GRAFT_LN_BOUNDS(false, 8, 4, true, 512, 2)
GRAFT_LN_BOUNDS(false, 8, 8, true, 256, 2)
GRAFT_LN_BOUNDS(false, 8, 1, false, 1024, 1)
GRAFT_LN_BOUNDS(false, 8, 2, false, 512, 2)
GRAFT_LN_BOUNDS(true, 4, 1, true, 1024, 1)
GRAFT_LN_BOUNDS(true, 4, 2, true, 512, 2)
GRAFT_LN_BOUNDS(true, 4, 4, true, 256, 2)
GRAFT_LN_BOUNDS(true, 4, 1, false, 1024, 1)
GRAFT_LN_BOUNDS(true, 4, 2, false, 256, 2)
GRAFT_LN_BOUNDS(true, 2, 1, true, 512, 2)
GRAFT_LN_BOUNDS(true, 2, 2, true, 512, 1)
GRAFT_LN_BOUNDS(true, 2, 4, true, 256, 1)
GRAFT_LN_BOUNDS(true, 2, 1, false, 512, 2)
GRAFT_LN_BOUNDS(true, 2, 2, false, 256, 2)
GRAFT_LN_BOUNDS(true, 8, 1, true, 1024, 1)
GRAFT_LN_BOUNDS(true, 8, 2, true, 512, 2)
GRAFT_LN_BOUNDS(true, 8, 4, true, 256, 2)
GRAFT_LN_BOUNDS(true, 8, 1, false, 1024, 1)
GRAFT_LN_BOUNDS(true, 8, 2, false, 512, 2)
#undef GRAFT_LN_BOUNDS

// ---------------------------------------------------------------------------------------
// Rows kernels: thread t of a row group owns units j = k * tpr + t for k < V.

template <typename T, int V, bool VEC>
__device__ __forceinline__ void fwd_rows(const Params& p) {
  using A = typename Acc<T>::type;
  constexpr int N = Units<T>::N;
  constexpr bool kShifted = sizeof(T) == 2;
  __shared__ A red[2][2][32];
  const int tpr = int(p.tpr), rpb = int(p.rpb);
  const long long cols = p.cols;
  const long long nunits = (cols + N - 1) / N;
  const int g = threadIdx.x / tpr;
  const int t = threadIdx.x - g * tpr;
  const A inv_cols = A(p.inv_cols), eps = A(p.eps);
  const T* __restrict__ w = static_cast<const T*>(p.w);
  const T* __restrict__ b = static_cast<const T*>(p.b);
  const long long nsets = (p.rows + rpb - 1) / rpb;
  int parity = 0;
  for (long long set = blockIdx.x; set < nsets; set += gridDim.x) {
    const long long row = set * rpb + g;
    const bool ok = row < p.rows;
    const T* x = static_cast<const T*>(p.x) + (ok ? row * cols : 0);
    A v[V][N];
    // The row's units into v; missing units (past the row's end) get `pad`.
    auto load_row = [&](A pad) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const long long j = (long long)k * tpr + t;
        load_unit(v[k], x, j, cols, VEC, ok && j < nunits, pad);
      }
    };
    A mean, var;
    if constexpr (kShifted) {
      // One reduction: sums of x - K and (x - K)^2 around the row's first element K. The
      // variance loses at most about cols float ulps to cancellation (K is one of the row's
      // values), far below a 16-bit output's rounding; float inputs keep two exact passes.
      const A shift = ok ? to_acc(x[0]) : A(0);
      load_row(shift);  // padding is K: it adds nothing
      A s1 = A(0), s2 = A(0);
#pragma unroll
      for (int k = 0; k < V; ++k) {
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const A d = v[k][e] - shift;
          s1 += d;
          s2 += d * d;
        }
      }
      group_sum_pair(s1, s2, tpr, red[parity]);
      parity ^= 1;
      const A dm = s1 * inv_cols;
      mean = shift + dm;
      var = s2 * inv_cols - dm * dm;
      var = var < A(0) ? A(0) : var;  // NaN (a non-finite row) stays NaN
    } else {
      load_row(A(0));
      A s = A(0);
#pragma unroll
      for (int k = 0; k < V; ++k) {
#pragma unroll
        for (int e = 0; e < N; ++e) s += v[k][e];
      }
      mean = group_reduce(s, tpr, red[parity][0], SumOp()) * inv_cols;
      parity ^= 1;
      A q = A(0);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const long long j = (long long)k * tpr + t;
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const A d = v[k][e] - mean;
          // Padding (past the row's end) adds nothing.
          if (ok && j * N + e < cols) q += d * d;
        }
      }
      var = group_reduce(q, tpr, red[parity][0], SumOp()) * inv_cols;
      parity ^= 1;
    }
    const A r = rsqrt_acc(var + eps);
    if (ok) {
      if (t == 0) {
        static_cast<A*>(p.mean)[row] = mean;
        static_cast<A*>(p.rstd)[row] = r;
      }
      T* y = static_cast<T*>(p.y) + row * cols;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const long long j = (long long)k * tpr + t;
        if (j < nunits) {
          A wv[N], bv[N];
          load_unit(wv, w, j, cols, VEC, w != nullptr, A(1));
          load_unit(bv, b, j, cols, VEC, b != nullptr, A(0));
          A o[N];
#pragma unroll
          for (int e = 0; e < N; ++e) o[e] = (v[k][e] - mean) * r * wv[e] + bv[e];
          store_unit(y, o, j, cols, VEC);
        }
      }
    }
  }
}

// The block's dw and db accumulators (V units of N per thread, for the thread's columns),
// added over its row groups in a fixed order and written as the block's partial row.
template <typename A, int V, int N, bool VEC>
__device__ __forceinline__ void write_partial(const Params& p, A (&dw)[V][N], A (&db)[V][N],
                                              int tpr, int rpb, int g, int t, A* sm) {
  const long long cols = p.cols;
  const long long nunits = (cols + N - 1) / N;
  if (rpb > 1) {
    // Layout [group - 1][k * N + e][t] for dw, then the same for db: conflict-free.
    const long long stride = (long long)(rpb - 1) * V * N * tpr;
    if (g > 0) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const long long at = ((long long)(g - 1) * V * N + k * N + e) * tpr + t;
          sm[at] = dw[k][e];
          sm[stride + at] = db[k][e];
        }
      }
    }
    __syncthreads();
    if (g > 0) return;
    for (int h = 1; h < rpb; ++h) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const long long at = ((long long)(h - 1) * V * N + k * N + e) * tpr + t;
          dw[k][e] += sm[at];
          db[k][e] += sm[stride + at];
        }
      }
    }
  }
  A* part = static_cast<A*>(p.partial) + (long long)blockIdx.x * 2 * cols;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const long long j = (long long)k * tpr + t;
    if (j < nunits) {
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const long long c = j * N + e;
        if (c < cols) {
          part[c] = dw[k][e];
          part[cols + c] = db[k][e];
        }
      }
    }
  }
}

// dx of a thread's units j = k * stride + t (k < V) below `units`, from its g = dy * w and
// xhat: rstd * (g - mean(g) - xhat * mean(g * xhat)).
template <typename T, typename A, int V, int N, bool VEC>
__device__ __forceinline__ void store_dx(T* dx, const A (&gv)[V][N], const A (&xh)[V][N], A r,
                                         A mean_g, A mean_gx, int stride, int t, long long units,
                                         long long cols) {
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const long long j = (long long)k * stride + t;
    if (j < units) {
      A o[N];
#pragma unroll
      for (int e = 0; e < N; ++e) o[e] = r * (gv[k][e] - mean_g - xh[k][e] * mean_gx);
      store_unit(dx, o, j, cols, VEC);
    }
  }
}

template <typename T, int V, bool VEC>
__device__ __forceinline__ void bwd_rows(const Params& p) {
  using A = typename Acc<T>::type;
  constexpr int N = Units<T>::N;
  __shared__ A red[2][2][32];
  GRAFT_DYN_SMEM(dyn_smem);
  const int tpr = int(p.tpr), rpb = int(p.rpb);
  const long long cols = p.cols;
  const long long nunits = (cols + N - 1) / N;
  const int g = threadIdx.x / tpr;
  const int t = threadIdx.x - g * tpr;
  const A inv_cols = A(p.inv_cols);
  const T* __restrict__ w = static_cast<const T*>(p.w);
  const A* __restrict__ means = static_cast<const A*>(p.mean);
  const A* __restrict__ rstds = static_cast<const A*>(p.rstd);
  const bool has_dx = p.dx != nullptr;
  const bool has_sums = p.partial != nullptr;
  const long long nsets = (p.rows + rpb - 1) / rpb;
  // Staging: two buffers of [x, dy][group][k][t] units in dynamic shared memory (reused by
  // write_partial at the end). A thread copies and reads only its own units, so no barrier
  // guards a buffer; the copies of set + gridDim.x fly while set computes.
  const bool stage = VEC && p.stage != 0;
  Pack<T>* staged = reinterpret_cast<Pack<T>*>(dyn_smem);
  auto slot = [&](int st, int a, int k) { return ((st * 2 + a) * rpb + g) * V * tpr + k * tpr + t; };
  auto prefetch = [&](long long set, int st) {
    const long long row = set * rpb + g;
    if (set < nsets && row < p.rows) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const long long j = (long long)k * tpr + t;
        if (j < nunits) {
          copy_async(&staged[slot(st, 0, k)], static_cast<const T*>(p.x) + row * cols + j * N);
          copy_async(&staged[slot(st, 1, k)], static_cast<const T*>(p.dy) + row * cols + j * N);
        }
      }
    }
    copy_async_commit();
  };
  if (stage) prefetch(blockIdx.x, 0);
  int parity = 0, it = 0;
  A dw[V][N], db[V][N];
#pragma unroll
  for (int k = 0; k < V; ++k) {
#pragma unroll
    for (int e = 0; e < N; ++e) dw[k][e] = db[k][e] = A(0);
  }
  for (long long set = blockIdx.x; set < nsets; set += gridDim.x, ++it) {
    const long long row = set * rpb + g;
    const bool ok = row < p.rows;
    const long long base = ok ? row * cols : 0;
    const T* x = static_cast<const T*>(p.x) + base;
    const T* dy = static_cast<const T*>(p.dy) + base;
    const A mean = ok ? means[row] : A(0), r = ok ? rstds[row] : A(0);
    const int st = it & 1;
    if (stage) {
      prefetch(set + gridDim.x, st ^ 1);  // into the buffer the previous set used
      copy_async_wait_all_but_one();      // this set's copies have landed
    }
    A xh[V][N], gv[V][N];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const long long j = (long long)k * tpr + t;
      const bool valid = ok && j < nunits;
      if (stage) {
        const Pack<T> px = staged[slot(st, 0, k)], pd = staged[slot(st, 1, k)];
#pragma unroll
        for (int e = 0; e < N; ++e) {
          xh[k][e] = valid ? to_acc(px.v[e]) : A(0);
          gv[k][e] = valid ? to_acc(pd.v[e]) : A(0);
        }
      } else {
        load_unit(xh[k], x, j, cols, VEC, valid, A(0));
        load_unit(gv[k], dy, j, cols, VEC, valid, A(0));
      }
#pragma unroll
      for (int e = 0; e < N; ++e) {
        // xhat of padding is -mean * r, but its dy (and so every term) is 0.
        xh[k][e] = (xh[k][e] - mean) * r;
        if (has_sums) {
          dw[k][e] += gv[k][e] * xh[k][e];
          db[k][e] += gv[k][e];
        }
      }
    }
    if (has_dx) {
      A sg = A(0), sgx = A(0);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const long long j = (long long)k * tpr + t;
        A wv[N];
        load_unit(wv, w, j, cols, VEC, w != nullptr && j < nunits, A(1));
#pragma unroll
        for (int e = 0; e < N; ++e) {
          gv[k][e] *= wv[e];
          sg += gv[k][e];
          sgx += gv[k][e] * xh[k][e];
        }
      }
      group_sum_pair(sg, sgx, tpr, red[parity]);
      parity ^= 1;
      const A mean_g = sg * inv_cols, mean_gx = sgx * inv_cols;
      if (ok) {
        T* dx = static_cast<T*>(p.dx) + base;
        store_dx<T, A, V, N, VEC>(dx, gv, xh, r, mean_g, mean_gx, tpr, t, nunits, cols);
      }
    }
  }
  if (has_sums) {
    if (stage && rpb > 1) __syncthreads();  // other groups may still read their stages
    write_partial<A, V, N, VEC>(p, dw, db, tpr, rpb, g, t, reinterpret_cast<A*>(dyn_smem));
  }
}

// Bulk backward (16-bit rows of 16-byte units, sm_90+): a persistent grid of clusters of C
// blocks, no more than can be resident at once, walks rows r, r + clusters, ...; block `rank`
// owns the same slice of each, V units a thread. One thread fetches the block's slice of the
// next row's x and dy with bulk copies while the current row computes (BulkSync::walk); the
// row's two sums go to every block of the cluster by st.async (BulkSync::exchange). Each
// block keeps dw and db of its slice's columns and writes them into its cluster's partial
// row: four blocks an SM fit where one block holding a whole row of 8192 columns fits one.
template <typename T, int C, int V>
__device__ __forceinline__ void bwd_bulk(const Params& p) {
  static_assert(sizeof(T) == 2, "16-bit inputs");
  using A = float;
  constexpr int N = Units<T>::N;
  __shared__ BulkSync<C> sync;
  __shared__ A red[2][2][32];
  GRAFT_DYN_SMEM(dyn_smem);
  const int nt = blockDim.x, t = threadIdx.x;
  const long long cols = p.cols;
  const Slice<C> slice(cols / N);
  const long long lo = slice.lo, len = slice.hi - slice.lo;
  const long long per = (cols / N + C - 1) / C;  // units between the buffers' arrays
  const unsigned bytes = unsigned(len * 16);
  Pack<T>* staged = reinterpret_cast<Pack<T>*>(dyn_smem);  // [buffer][x, dy][per units]
  const T* x = static_cast<const T*>(p.x) + lo * N;
  const T* dy = static_cast<const T*>(p.dy) + lo * N;
  const T* w = p.w ? static_cast<const T*>(p.w) + lo * N : nullptr;
  const A* __restrict__ means = static_cast<const A*>(p.mean);
  const A* __restrict__ rstds = static_cast<const A*>(p.rstd);
  const bool has_dx = p.dx != nullptr, has_sums = p.partial != nullptr;
  const A inv_cols = A(p.inv_cols);
  A dw[V][N], db[V][N];
#pragma unroll
  for (int k = 0; k < V; ++k) {
#pragma unroll
    for (int e = 0; e < N; ++e) dw[k][e] = db[k][e] = A(0);
  }
  const auto fetch = [&](long long row, int b) {
    unsigned long long* bar = &sync.loaded[b];
    graft_common::mbarrier_expect_bytes(bar, 2 * bytes);
    graft_common::bulk_copy_to_shared(staged + 2 * b * per, x + row * cols, bytes, bar);
    graft_common::bulk_copy_to_shared(staged + (2 * b + 1) * per, dy + row * cols, bytes, bar);
  };
  sync.walk(p.rows, fetch, [&](long long row, int b, long long i) {
    const Pack<T>* xs = staged + 2 * b * per;
    const Pack<T>* gs = xs + per;
    const A mean = means[row], r = rstds[row];
    A xh[V][N], gv[V][N];
    A sg = A(0), sgx = A(0);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const long long j = (long long)k * nt + t;
      const bool valid = j < len;
      Pack<T> px, pd;
      if (valid) {
        px = xs[j];
        pd = gs[j];
      }
      A wv[N];
      load_unit(wv, w, j, cols, true, w != nullptr && valid, A(1));
#pragma unroll
      for (int e = 0; e < N; ++e) {
        xh[k][e] = valid ? (A(to_acc(px.v[e])) - mean) * r : A(0);
        const A g = valid ? A(to_acc(pd.v[e])) : A(0);
        if (has_sums) {
          dw[k][e] += g * xh[k][e];
          db[k][e] += g;
        }
        gv[k][e] = g * wv[e];
        sg += gv[k][e];
        sgx += gv[k][e] * xh[k][e];
      }
    }
    if (!has_dx) return;
    group_sum_pair(sg, sgx, nt, red[i & 1]);
    if constexpr (C > 1) {
      // Lane l of every warp takes block l's sums: every block adds the same values in the
      // same order.
      sync.exchange(sg, sgx, i, A(0), A(0));
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        sg += __shfl_xor_sync(0xffffffffu, sg, o);
        sgx += __shfl_xor_sync(0xffffffffu, sgx, o);
      }
    }
    const A mean_g = sg * inv_cols, mean_gx = sgx * inv_cols;
    T* dx = static_cast<T*>(p.dx) + row * cols + lo * N;
    store_dx<T, A, V, N, true>(dx, gv, xh, r, mean_g, mean_gx, nt, t, len, cols);
  });
  if (has_sums) {
    A* part = static_cast<A*>(p.partial) + (long long)(blockIdx.x / C) * 2 * cols + lo * N;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const long long j = (long long)k * nt + t;
      if (j < len) {
#pragma unroll
        for (int e = 0; e < N; ++e) {
          part[j * N + e] = dw[k][e];
          part[cols + j * N + e] = db[k][e];
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Loop kernels: one row per block at a time; thread t owns units j = t + i * blockDim.x.

template <typename T>
__device__ __forceinline__ void fwd_loop(const Params& p) {
  using A = typename Acc<T>::type;
  constexpr int N = Units<T>::N;
  __shared__ A red[2][32];
  const int nt = blockDim.x, t = threadIdx.x;
  const long long cols = p.cols;
  const long long nunits = (cols + N - 1) / N;
  const bool vec = p.vec != 0;
  const A inv_cols = A(p.inv_cols), eps = A(p.eps);
  const T* __restrict__ w = static_cast<const T*>(p.w);
  const T* __restrict__ b = static_cast<const T*>(p.b);
  int parity = 0;
  for (long long row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * cols;
    // Sums of x - K and (x - K)^2 around the row's first element K: no cancellation when
    // the values sit far from 0.
    const A shift = A(to_acc(x[0]));
    A s1 = A(0), s2 = A(0);
    for (long long j = t; j < nunits; j += nt) {
      A v[N];
      load_unit(v, x, j, cols, vec, true, shift);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const A d = v[e] - shift;
        s1 += d;
        s2 += d * d;
      }
    }
    s1 = group_reduce(s1, nt, red[parity], SumOp());
    parity ^= 1;
    s2 = group_reduce(s2, nt, red[parity], SumOp());
    parity ^= 1;
    A mean, r;
    shifted_stats(shift, s1, s2, inv_cols, eps, mean, r);
    if (t == 0) {
      static_cast<A*>(p.mean)[row] = mean;
      static_cast<A*>(p.rstd)[row] = r;
    }
    T* y = static_cast<T*>(p.y) + row * cols;
    for (long long j = t; j < nunits; j += nt) {
      A v[N], wv[N], bv[N], o[N];
      load_unit(v, x, j, cols, vec, true, A(0));
      load_unit(wv, w, j, cols, vec, w != nullptr, A(1));
      load_unit(bv, b, j, cols, vec, b != nullptr, A(0));
#pragma unroll
      for (int e = 0; e < N; ++e) o[e] = (v[e] - mean) * r * wv[e] + bv[e];
      store_unit(y, o, j, cols, vec);
    }
  }
}

// Staged forward (16-bit rows of 16-byte units): one row per block at a time. Each thread
// copies its units of the row into shared memory (cp.async: no registers held while the copies
// fly), then reads them back twice, for the shifted sums and for y. An SM keeps as many rows in
// flight as its shared memory holds (the rows kernels: as many as its registers hold, fewer).
// A thread reads back only the units it copied, so no barrier guards them.
template <typename T>
__device__ __forceinline__ void fwd_staged(const Params& p) {
  using A = typename Acc<T>::type;
  constexpr int N = Units<T>::N;
  __shared__ A red[2][2][32];
  GRAFT_DYN_SMEM(dyn_smem);
  Pack<T>* staged = reinterpret_cast<Pack<T>*>(dyn_smem);
  const int nt = blockDim.x, t = threadIdx.x;
  const long long cols = p.cols;
  const long long nunits = cols / N;
  const A inv_cols = A(p.inv_cols), eps = A(p.eps);
  const T* __restrict__ w = static_cast<const T*>(p.w);
  const T* __restrict__ b = static_cast<const T*>(p.b);
  int parity = 0;
  for (long long row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * cols;
    for (long long j = t; j < nunits; j += nt) copy_async(&staged[j], x + j * N);
    copy_async_commit();
    // Sums of x - K and (x - K)^2 around the row's first element K (as fwd_rows).
    const A shift = to_acc(x[0]);
    copy_async_wait_all();
    A s1 = A(0), s2 = A(0);
    for (long long j = t; j < nunits; j += nt) {
      const Pack<T> raw = staged[j];
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const A d = A(to_acc(raw.v[e])) - shift;
        s1 += d;
        s2 += d * d;
      }
    }
    group_sum_pair(s1, s2, nt, red[parity]);
    parity ^= 1;
    A mean, r;
    shifted_stats(shift, s1, s2, inv_cols, eps, mean, r);
    if (t == 0) {
      static_cast<A*>(p.mean)[row] = mean;
      static_cast<A*>(p.rstd)[row] = r;
    }
    T* y = static_cast<T*>(p.y) + row * cols;
    for (long long j = t; j < nunits; j += nt) {
      const Pack<T> raw = staged[j];
      A wv[N], bv[N], o[N];
      load_unit(wv, w, j, cols, true, w != nullptr, A(1));
      load_unit(bv, b, j, cols, true, b != nullptr, A(0));
#pragma unroll
      for (int e = 0; e < N; ++e) o[e] = (A(to_acc(raw.v[e])) - mean) * r * wv[e] + bv[e];
      store_unit(y, o, j, cols, true);
    }
  }
}

template <typename T>
__device__ __forceinline__ void bwd_loop(const Params& p) {
  using A = typename Acc<T>::type;
  constexpr int N = Units<T>::N;
  __shared__ A red[2][32];
  const int nt = blockDim.x, t = threadIdx.x;
  const long long cols = p.cols;
  const long long nunits = (cols + N - 1) / N;
  const bool vec = p.vec != 0;
  const A inv_cols = A(p.inv_cols);
  const T* __restrict__ w = static_cast<const T*>(p.w);
  const bool has_dx = p.dx != nullptr;
  A* part = p.partial ? static_cast<A*>(p.partial) + (long long)blockIdx.x * 2 * cols : nullptr;
  int parity = 0;
  // A thread zeroes, adds into and reads only the partial entries of its own units.
  if (part) {
    for (long long j = t; j < nunits; j += nt) {
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const long long c = j * N + e;
        if (c < cols) part[c] = part[cols + c] = A(0);
      }
    }
  }
  for (long long row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * cols;
    const T* dy = static_cast<const T*>(p.dy) + row * cols;
    const A mean = static_cast<const A*>(p.mean)[row];
    const A r = static_cast<const A*>(p.rstd)[row];
    A mean_g = A(0), mean_gx = A(0);
    if (has_dx) {
      A sg = A(0), sgx = A(0);
      for (long long j = t; j < nunits; j += nt) {
        A xv[N], gv[N], wv[N];
        load_unit(xv, x, j, cols, vec, true, A(0));
        load_unit(gv, dy, j, cols, vec, true, A(0));
        load_unit(wv, w, j, cols, vec, w != nullptr, A(1));
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const A gw = gv[e] * wv[e];
          sg += gw;
          sgx += gw * ((xv[e] - mean) * r);
        }
      }
      mean_g = group_reduce(sg, nt, red[parity], SumOp()) * inv_cols;
      parity ^= 1;
      mean_gx = group_reduce(sgx, nt, red[parity], SumOp()) * inv_cols;
      parity ^= 1;
    }
    for (long long j = t; j < nunits; j += nt) {
      A xv[N], gv[N];
      load_unit(xv, x, j, cols, vec, true, A(0));
      load_unit(gv, dy, j, cols, vec, true, A(0));
      if (has_dx) {
        A wv[N], o[N];
        load_unit(wv, w, j, cols, vec, w != nullptr, A(1));
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const A xhat = (xv[e] - mean) * r;
          o[e] = r * (gv[e] * wv[e] - mean_g - xhat * mean_gx);
        }
        store_unit(static_cast<T*>(p.dx) + row * cols, o, j, cols, vec);
      }
      if (part) {
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const long long c = j * N + e;
          if (c < cols) {
            part[c] += gv[e] * ((xv[e] - mean) * r);
            part[cols + c] += gv[e];
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// dw and db = the partial rows summed in block order. Block: 32 columns x 8 slices; slice s
// sums partial rows s, s + 8, ... and the 8 slice sums are added in order.

template <typename A, typename T>
__device__ __forceinline__ void finalize(const FinalizeParams& p) {
  __shared__ A acc[2][8][33];
  const int lane = threadIdx.x & 31, slice = threadIdx.x >> 5;
  const long long col = (long long)blockIdx.x * 32 + lane;
  const A* __restrict__ part = static_cast<const A*>(p.partial);
  A sw = A(0), sb = A(0);
  if (col < p.cols) {
    for (long long b = slice; b < p.nparts; b += 8) {
      sw += part[b * 2 * p.cols + col];
      sb += part[b * 2 * p.cols + p.cols + col];
    }
  }
  acc[0][slice][lane] = sw;
  acc[1][slice][lane] = sb;
  __syncthreads();
  if (slice == 0 && col < p.cols) {
    A tw = acc[0][0][lane], tb = acc[1][0][lane];
    for (int i = 1; i < 8; ++i) {
      tw += acc[0][i][lane];
      tb += acc[1][i][lane];
    }
    if (p.dw) static_cast<T*>(p.dw)[col] = from_acc<T>(tw);
    if (p.db) static_cast<T*>(p.db)[col] = from_acc<T>(tb);
  }
}

}  // namespace graft_layer_norm

// ---------------------------------------------------------------------------------------
// Entry points, named as src/layer_norm.rs builds the names:
//   graft_ln_{fwd,bwd}_rows_{v,s}{V}_{dt}   graft_ln_{fwd,bwd}_loop_{dt}   graft_ln_finalize_{dt}
// dt: f32 f64 f16 bf16; vector kernels for V = 1, 2, 4 (and 8 forward), scalar for V = 1, 2.
//   graft_ln_fwd_staged_{f16,bf16}   graft_ln_bwd_bulk_{f16,bf16}

#define GRAFT_LN_BOUNDS_OF(BWD, T, V, VEC)                               \
  graft_layer_norm::RowsBounds<BWD, int(sizeof(T)), V, VEC>::threads,    \
      graft_layer_norm::RowsBounds<BWD, int(sizeof(T)), V, VEC>::min_blocks

#define GRAFT_LN_FWD_ROWS(NAME, T, V, VEC)                                                  \
  extern "C" __global__ void __launch_bounds__(GRAFT_LN_BOUNDS_OF(false, T, V, VEC))       \
      NAME(const graft_layer_norm::Params p) {                                              \
    graft_layer_norm::fwd_rows<T, V, VEC>(p);                                               \
  }
#define GRAFT_LN_BWD_ROWS(NAME, T, V, VEC)                                                  \
  extern "C" __global__ void __launch_bounds__(GRAFT_LN_BOUNDS_OF(true, T, V, VEC))        \
      NAME(const graft_layer_norm::Params p) {                                              \
    graft_layer_norm::bwd_rows<T, V, VEC>(p);                                               \
  }

#define GRAFT_LN_ALL(DT, T)                                                                 \
  GRAFT_LN_FWD_ROWS(graft_ln_fwd_rows_v1_##DT, T, 1, true)                                  \
  GRAFT_LN_FWD_ROWS(graft_ln_fwd_rows_v2_##DT, T, 2, true)                                  \
  GRAFT_LN_FWD_ROWS(graft_ln_fwd_rows_v4_##DT, T, 4, true)                                  \
  GRAFT_LN_FWD_ROWS(graft_ln_fwd_rows_v8_##DT, T, 8, true)                                  \
  GRAFT_LN_FWD_ROWS(graft_ln_fwd_rows_s1_##DT, T, 1, false)                                 \
  GRAFT_LN_FWD_ROWS(graft_ln_fwd_rows_s2_##DT, T, 2, false)                                 \
  GRAFT_LN_BWD_ROWS(graft_ln_bwd_rows_v1_##DT, T, 1, true)                                  \
  GRAFT_LN_BWD_ROWS(graft_ln_bwd_rows_v2_##DT, T, 2, true)                                  \
  GRAFT_LN_BWD_ROWS(graft_ln_bwd_rows_v4_##DT, T, 4, true)                                  \
  GRAFT_LN_BWD_ROWS(graft_ln_bwd_rows_s1_##DT, T, 1, false)                                 \
  GRAFT_LN_BWD_ROWS(graft_ln_bwd_rows_s2_##DT, T, 2, false)                                 \
  extern "C" __global__ void __launch_bounds__(graft_layer_norm::kLoopThreads, 1)          \
      graft_ln_fwd_loop_##DT(const graft_layer_norm::Params p) {                            \
    graft_layer_norm::fwd_loop<T>(p);                                                       \
  }                                                                                         \
  extern "C" __global__ void __launch_bounds__(graft_layer_norm::kLoopThreads, 1)          \
      graft_ln_bwd_loop_##DT(const graft_layer_norm::Params p) {                            \
    graft_layer_norm::bwd_loop<T>(p);                                                       \
  }                                                                                         \
  extern "C" __global__ void __launch_bounds__(256)                                         \
      graft_ln_finalize_##DT(const graft_layer_norm::FinalizeParams p) {                    \
    graft_layer_norm::finalize<typename graft_common::Acc<T>::type, T>(p);                  \
  }

GRAFT_LN_ALL(f32, float)
GRAFT_LN_ALL(f64, double)
GRAFT_LN_ALL(f16, __half)
GRAFT_LN_ALL(bf16, __nv_bfloat16)

#define GRAFT_LN_FWD_STAGED(DT, T)                                                           \
  extern "C" __global__ void __launch_bounds__(graft_layer_norm::kStagedThreads,            \
                                               graft_layer_norm::kStagedMinBlocks)          \
      graft_ln_fwd_staged_##DT(const graft_layer_norm::Params p) {                          \
    graft_layer_norm::fwd_staged<T>(p);                                                     \
  }

GRAFT_LN_FWD_STAGED(f16, __half)
GRAFT_LN_FWD_STAGED(bf16, __nv_bfloat16)

#define GRAFT_LN_BWD_BULK(DT, T)                                                             \
  extern "C" __global__ void __launch_bounds__(graft_layer_norm::kBulkThreads, 4)           \
      GRAFT_CLUSTER_DIMS(graft_layer_norm::kBulkCluster)                                    \
          graft_ln_bwd_bulk_##DT(const graft_layer_norm::Params p) {                        \
    using namespace graft_layer_norm;                                                         \
    bwd_bulk<T, kBulkCluster, kBulkUnits>(p);                                                \
  }

GRAFT_LN_BWD_BULK(f16, __half)
GRAFT_LN_BWD_BULK(bf16, __nv_bfloat16)

// RMSNorm forward and backward kernels for graft-cuda.
//
// Semantics follow PyTorch's reference composite (`_fused_rms_norm` and
// `_fused_rms_norm_backward` in torch/_decomp/decompositions.py):
//   forward:  ms = mean(x^2) in the accumulation type A, rstd = 1/sqrt(ms + eps),
//             y = (x * rstd) * w, rounded to T
//   backward: xhat = x * rstd, g = dy * w (or dy), dx = rstd * (g - xhat * mean(g * xhat)),
//             dw = sum over rows of dy * xhat
// A is float for float/half/bfloat16 and double for double.
//
// Two run-time parameters give the variants models write by hand (torchgraft::rms_norm):
// the weight applied is `w + offset` in A (Gemma: offset 1; PyTorch's own op passes -0.0,
// which adds exactly nothing, -0 included), and with `round_first` xhat is rounded to T before
// the weight multiply (Llama: `w * xhat.to(dtype)`), in the forward and in dw (dy * round(xhat)),
// the derivative of the rounding taken as 1 as autograd does for `.to()`.
//
// Layout: x, y, dy, dx are contiguous rows x cols of T; rstd is rows of A; the weight is
// cols of WT (T, or A for a weight in the accumulation dtype).
//
// Two kernel shapes:
//   *_rows_*  the row is held in registers. A "row group" of `tpr` threads (a power of two
//             up to 32, or a multiple of 32) owns one row; each thread holds V units of
//             VE = 16 / sizeof(T) elements. `rpb` row groups per block.
//   *_loop_*  any cols: one row per block at a time, two passes over the row.
// Both run a grid-stride loop over sets of `rpb` rows whose trip count is the same for
// every thread of a block, so barriers and full-warp shuffles are reached by all threads.
//
// A unit is one 16-byte access on the vector path (every row pointer 16-byte aligned and
// cols * sizeof(T) % 16 == 0: the `_v{V}` rows kernels, or `vec` = 1 for the loop
// kernels), else VE scalar accesses (`_s{V}` rows kernels, `vec` = 0).
//
// dw is deterministic: each block of a persistent grid writes one partial row (in A) to the
// workspace, and dw_finalize sums the partial rows in a fixed order.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// Dynamic shared memory declaration (a macro so that emu/ can run these kernels on the CPU).
#ifndef GRAFT_DYN_SMEM
#define GRAFT_DYN_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace graft {

// ---------------------------------------------------------------------------------------
// Parameters (mirrored by #[repr(C)] structs in src/params.rs; every field is 8 bytes).

struct FwdParams {
  const void* x;
  const void* w;  // null when there is no weight
  void* y;
  void* rstd;
  long long rows;
  long long cols;
  long long tpr;  // rows kernels: threads per row group
  long long rpb;  // rows kernels: row groups per block
  long long vec;  // 1: 16-byte vector accesses
  double eps;
  double inv_cols;
  double offset;          // added to the weight (-0.0: none)
  long long round_first;  // 1: round xhat to T before the weight multiply
};

struct BwdParams {
  const void* dy;
  const void* x;
  const void* rstd;
  const void* w;  // null when there is no weight
  void* dx;       // null when dx is not requested
  void* partial;  // gridDim.x rows of cols A (dw partials); null when dw is not requested
  long long rows;
  long long cols;
  long long tpr;
  long long rpb;
  long long vec;
  long long has_dx;
  long long has_dw;
  long long dw_smem;  // loop kernels: accumulate the partial row in shared memory
  double inv_cols;
  double offset;          // added to the weight (-0.0: none)
  long long round_first;  // 1: dw sums dy * round(xhat)
};

struct FinalizeParams {
  const void* partial;
  void* dw;
  long long nparts;
  long long cols;
};

// ---------------------------------------------------------------------------------------
// Types.

struct NoWeight {};

template <typename A, typename B>
struct SameType {
  static constexpr bool value = false;
};
template <typename A>
struct SameType<A, A> {
  static constexpr bool value = true;
};

template <bool C, typename A, typename B>
struct Cond {
  using type = A;
};
template <typename A, typename B>
struct Cond<false, A, B> {
  using type = B;
};

template <typename T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

// Elements live in registers as packed 32-bit words (two 16-bit elements per word), so a
// 16-byte unit costs 4 registers whatever the dtype. Conv<E> converts between words and A.
template <typename E>
struct Conv;

template <>
struct Conv<float> {
  using Raw = unsigned;
  static __device__ __forceinline__ float get(const unsigned* u, int e) {
    return __uint_as_float(u[e]);
  }
  static __device__ __forceinline__ void put2(unsigned* u, int e, float a, float b) {
    u[e] = __float_as_uint(a);
    u[e + 1] = __float_as_uint(b);
  }
  static __device__ __forceinline__ void insert(unsigned* u, int e, Raw r) { u[e] = r; }
  static __device__ __forceinline__ Raw extract(const unsigned* u, int e) { return u[e]; }
  static __device__ __forceinline__ float from_raw(Raw r) { return __uint_as_float(r); }
  static __device__ __forceinline__ Raw to_raw(float v) { return __float_as_uint(v); }
  static __device__ __forceinline__ float round(float v) { return v; }
};

template <>
struct Conv<double> {
  using Raw = unsigned long long;
  static __device__ __forceinline__ double get(const unsigned* u, int e) {
    return __hiloint2double(int(u[2 * e + 1]), int(u[2 * e]));
  }
  static __device__ __forceinline__ void put2(unsigned* u, int e, double a, double b) {
    insert(u, e, Raw(__double_as_longlong(a)));
    insert(u, e + 1, Raw(__double_as_longlong(b)));
  }
  static __device__ __forceinline__ void insert(unsigned* u, int e, Raw r) {
    u[2 * e] = unsigned(r);
    u[2 * e + 1] = unsigned(r >> 32);
  }
  static __device__ __forceinline__ Raw extract(const unsigned* u, int e) {
    return Raw(u[2 * e]) | (Raw(u[2 * e + 1]) << 32);
  }
  static __device__ __forceinline__ double from_raw(Raw r) {
    return __longlong_as_double((long long)r);
  }
  static __device__ __forceinline__ Raw to_raw(double v) { return Raw(__double_as_longlong(v)); }
  static __device__ __forceinline__ double round(double v) { return v; }
};

template <>
struct Conv<__nv_bfloat16> {
  using Raw = unsigned short;
  static __device__ __forceinline__ float get(const unsigned* u, int e) {
    const unsigned w = u[e >> 1];
    return __uint_as_float((e & 1) ? (w & 0xffff0000u) : (w << 16));
  }
  static __device__ __forceinline__ void put2(unsigned* u, int e, float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);  // a in the low half
    u[e >> 1] = *reinterpret_cast<const unsigned*>(&h);
  }
  static __device__ __forceinline__ void insert(unsigned* u, int e, Raw r) {
    u[e >> 1] = (e & 1) ? (u[e >> 1] | (unsigned(r) << 16)) : unsigned(r);
  }
  static __device__ __forceinline__ Raw extract(const unsigned* u, int e) {
    return Raw((e & 1) ? (u[e >> 1] >> 16) : (u[e >> 1] & 0xffffu));
  }
  static __device__ __forceinline__ float from_raw(Raw r) {
    return __uint_as_float(unsigned(r) << 16);
  }
  static __device__ __forceinline__ Raw to_raw(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
  // v rounded to bfloat16 and widened back.
  static __device__ __forceinline__ float round(float v) {
    return __bfloat162float(__float2bfloat16_rn(v));
  }
};

template <>
struct Conv<__half> {
  using Raw = unsigned short;
  static __device__ __forceinline__ float get(const unsigned* u, int e) {
    const unsigned w = u[e >> 1];
    return __half2float(__ushort_as_half((unsigned short)((e & 1) ? (w >> 16) : (w & 0xffffu))));
  }
  static __device__ __forceinline__ void put2(unsigned* u, int e, float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);  // a in the low half
    u[e >> 1] = *reinterpret_cast<const unsigned*>(&h);
  }
  static __device__ __forceinline__ void insert(unsigned* u, int e, Raw r) {
    u[e >> 1] = (e & 1) ? (u[e >> 1] | (unsigned(r) << 16)) : unsigned(r);
  }
  static __device__ __forceinline__ Raw extract(const unsigned* u, int e) {
    return Raw((e & 1) ? (u[e >> 1] >> 16) : (u[e >> 1] & 0xffffu));
  }
  static __device__ __forceinline__ float from_raw(Raw r) { return __half2float(__ushort_as_half(r)); }
  static __device__ __forceinline__ Raw to_raw(float v) {
    return __half_as_ushort(__float2half_rn(v));
  }
  // v rounded to half and widened back.
  static __device__ __forceinline__ float round(float v) {
    return __half2float(__float2half_rn(v));
  }
};

__device__ __forceinline__ float rsqrt_acc(float v) { return rsqrtf(v); }
__device__ __forceinline__ double rsqrt_acc(double v) { return 1.0 / sqrt(v); }

// N elements of E as packed 32-bit words, 16-byte aligned.
template <typename E, int N>
struct alignas(16) Arr {
  static constexpr int WORDS = int(N * sizeof(E) / 4);
  static_assert(WORDS % 4 == 0, "a unit is a whole number of 16-byte vectors");
  unsigned u[WORDS];

  __device__ __forceinline__ typename AccOf<E>::type get(int e) const {
    return Conv<E>::get(u, e);
  }
  // Rounds N values of the accumulation type into the unit.
  __device__ __forceinline__ void put(const typename AccOf<E>::type (&v)[N]) {
#pragma unroll
    for (int e = 0; e < N; e += 2) Conv<E>::put2(u, e, v[e], v[e + 1]);
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < WORDS; ++i) u[i] = 0u;
  }
  // Makes the compiler forget what it knows about the words, so that conversions are
  // recomputed after a reduction instead of being kept alive across it (which would take
  // one register per element instead of per word). Emits no instruction.
  __device__ __forceinline__ void forget() {
#pragma unroll
    for (int i = 0; i < WORDS; ++i) asm volatile("" : "+r"(u[i]));
  }
};

// Whether round_first can change a result: 16-bit inputs with a weight of their own dtype.
// float32 and float64 round to themselves; for a wider weight (kind `acc`) the llama product
// would be wider than T, which these kernels do not write: the launcher refuses round_first.
template <typename T, typename WT>
constexpr bool ROUNDS = SameType<WT, T>::value && sizeof(T) == 2;

// x <- (x * r) * (w + off) rounded to T (without HAS_W: x * r).
//
// Where ROUNDS, the forward calls this twice: pass 1 without the weight, r1 = r with
// round_first (xhat rounded to T in place) else 1 (x * 1 is x: exact), then pass 2 with the
// weight and r2 = 1 or r. Branch-free on purpose: a select between rounded and unrounded
// values, or the rounding pass behind a branch, makes ptxas keep more values live (up to 1.5x
// the registers at 4 and 16 units per thread); the extra pass costs a few ALU operations per
// element of a memory-bound kernel.
template <bool HAS_W, typename T, typename WL, int N>
__device__ __forceinline__ void scale_unit(Arr<T, N>& x, const Arr<WL, N>& w,
                                           typename AccOf<T>::type r,
                                           typename AccOf<T>::type off) {
  using A = typename AccOf<T>::type;
  A o[N];
#pragma unroll
  for (int e = 0; e < N; ++e) {
    o[e] = x.get(e) * r;
    if constexpr (HAS_W) o[e] *= A(w.get(e)) + off;
  }
  x.put(o);
}

// xhat as the weight multiply sees it: rounded to T with round_first, else as is.
template <typename T>
__device__ __forceinline__ typename AccOf<T>::type pre_weight(typename AccOf<T>::type xhat,
                                                             bool round_first) {
  return round_first ? Conv<T>::round(xhat) : xhat;
}

// 16-byte loads through the read-only path, and 16-byte stores.
template <typename E, int N>
__device__ __forceinline__ void load_vec(Arr<E, N>& dst, const E* src) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int i = 0; i < Arr<E, N>::WORDS / 4; ++i) {
    const uint4 v = __ldg(s + i);
    dst.u[4 * i] = v.x;
    dst.u[4 * i + 1] = v.y;
    dst.u[4 * i + 2] = v.z;
    dst.u[4 * i + 3] = v.w;
  }
}

template <typename E, int N>
__device__ __forceinline__ void store_vec(E* dst, const Arr<E, N>& src) {
  uint4* d = reinterpret_cast<uint4*>(dst);
#pragma unroll
  for (int i = 0; i < Arr<E, N>::WORDS / 4; ++i) {
    d[i] = make_uint4(src.u[4 * i], src.u[4 * i + 1], src.u[4 * i + 2], src.u[4 * i + 3]);
  }
}

// Unit j of a row: columns [j * N, j * N + N); `cols` bounds the scalar path only.
template <typename E, int N>
__device__ __forceinline__ void load_unit(Arr<E, N>& r, const E* __restrict__ row, long long j,
                                          long long cols, bool vec) {
  if (vec) {
    load_vec(r, row + j * N);
  } else {
    using Raw = typename Conv<E>::Raw;
    const Raw* p = reinterpret_cast<const Raw*>(row);
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const long long c = j * N + e;
      Conv<E>::insert(r.u, e, c < cols ? __ldg(p + c) : Raw(0));
    }
  }
}

template <typename E, int N>
__device__ __forceinline__ void store_unit(E* __restrict__ row, const Arr<E, N>& r, long long j,
                                           long long cols, bool vec) {
  if (vec) {
    store_vec(row + j * N, r);
  } else {
    using Raw = typename Conv<E>::Raw;
    Raw* p = reinterpret_cast<Raw*>(row);
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const long long c = j * N + e;
      if (c < cols) p[c] = Conv<E>::extract(r.u, e);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Rows kernels: thread t of a row group owns units j = k * tpr + t for k < V.

template <typename E, int N, int V>
__device__ __forceinline__ void load_row(Arr<E, N> (&r)[V], const E* __restrict__ row, int cols,
                                         int tpr, int t, bool vec, bool ok) {
  const int nunits = (cols + N - 1) / N;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int j = k * tpr + t;
    if (ok && j < nunits) {
      load_unit(r[k], row, j, cols, vec);
    } else {
      r[k].zero();
    }
  }
}

template <typename E, int N, int V>
__device__ __forceinline__ void store_row(E* __restrict__ row, const Arr<E, N> (&r)[V], int cols,
                                          int tpr, int t, bool vec) {
  const int nunits = (cols + N - 1) / N;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int j = k * tpr + t;
    if (j < nunits) store_unit(row, r[k], j, cols, vec);
  }
}

template <typename E, int N, int V>
__device__ __forceinline__ void forget_all(Arr<E, N> (&r)[V]) {
#pragma unroll
  for (int k = 0; k < V; ++k) r[k].forget();
}

// Sums of squares and dot products of one unit, with two independent accumulators (even
// and odd elements): short dependency chains, for accuracy as much as for speed. Callers
// add unit sums into the thread's total, so no chain is longer than a row's units.
template <typename E, int N>
__device__ __forceinline__ typename AccOf<E>::type unit_sumsq(const Arr<E, N>& a) {
  using A = typename AccOf<E>::type;
  A s0 = A(0), s1 = A(0);
#pragma unroll
  for (int e = 0; e < N; e += 2) {
    const A v0 = a.get(e), v1 = a.get(e + 1);
    s0 = fma(v0, v0, s0);
    s1 = fma(v1, v1, s1);
  }
  return s0 + s1;
}

// sum over the unit of (g * (w + off)) * (x * r), w absent when WE is NoWeight.
template <typename E, typename WE, int N>
__device__ __forceinline__ typename AccOf<E>::type unit_dot(const Arr<E, N>& g,
                                                            const Arr<WE, N>& w,
                                                            const Arr<E, N>& x,
                                                            typename AccOf<E>::type r,
                                                            typename AccOf<E>::type off,
                                                            bool has_w) {
  using A = typename AccOf<E>::type;
  A s[2] = {A(0), A(0)};
#pragma unroll
  for (int e = 0; e < N; ++e) {
    A gv = g.get(e);
    if (has_w) gv *= A(w.get(e)) + off;
    s[e & 1] = fma(gv, x.get(e) * r, s[e & 1]);
  }
  return s[0] + s[1];
}

// Sum over the `tpr` threads of a row group (all of them get the same bits: xor butterflies
// add commutative pairs, and the cross-warp step reads shared memory in a fixed order).
// `red` holds 32 values; callers alternate between two buffers so that one barrier per
// reduction suffices.
template <typename A>
__device__ __forceinline__ A group_sum(A v, int tpr, A* red) {
  const int width = tpr < 32 ? tpr : 32;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    if (o < width) v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  if (tpr > 32) {
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    const int nw = tpr >> 5;
    const int w0 = (warp / nw) * nw;
    v = red[w0];
    for (int i = 1; i < nw; ++i) v += red[w0 + i];
  }
  return v;
}

template <typename T, typename WT, int V, bool VEC>
__device__ __forceinline__ void fwd_rows(const FwdParams& p) {
  using A = typename AccOf<T>::type;
  constexpr int VE = 16 / sizeof(T);
  constexpr bool HAS_W = !SameType<WT, NoWeight>::value;
  using WL = typename Cond<HAS_W, WT, A>::type;  // A stands in when there is no weight

  __shared__ A red[2][32];
  const int tpr = int(p.tpr);
  const int rpb = int(p.rpb);
  const int cols = int(p.cols);
  constexpr bool vec = VEC;
  const int g = threadIdx.x / tpr;
  const int t = threadIdx.x - g * tpr;
  const A eps = A(p.eps);
  const A inv_cols = A(p.inv_cols);
  const A off = A(p.offset);
  const bool round_first = ROUNDS<T, WT> && p.round_first != 0;
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const WL* __restrict__ w = static_cast<const WL*>(p.w);
  T* __restrict__ y = static_cast<T*>(p.y);
  A* __restrict__ rstd = static_cast<A*>(p.rstd);
  const long long nsets = (p.rows + rpb - 1) / rpb;
  int parity = 0;

  for (long long set = blockIdx.x; set < nsets; set += gridDim.x) {
    const long long row = set * rpb + g;
    const bool ok = row < p.rows;
    const long long base = ok ? row * cols : 0;
    Arr<T, VE> xr[V];
    load_row(xr, x + base, cols, tpr, t, vec, ok);

    A ss = A(0);
#pragma unroll
    for (int k = 0; k < V; ++k) ss += unit_sumsq(xr[k]);
    ss = group_sum(ss, tpr, red[parity]);
    parity ^= 1;
    const A r = rsqrt_acc(ss * inv_cols + eps);
    forget_all(xr);

    if (ok) {
      if (t == 0) rstd[row] = r;
      Arr<WL, VE> wr[V];
      const A r2 = round_first ? A(1) : r;
      if constexpr (ROUNDS<T, WT>) {
        // Pass 1: xhat rounded to T in place, or x * 1 (exact: x itself).
        const A r1 = round_first ? r : A(1);
#pragma unroll
        for (int k = 0; k < V; ++k) scale_unit<false>(xr[k], wr[k], r1, off);
      }
      // Pass 2, loading each weight unit where it is used (loaded up front, a float32 weight
      // at 8 units per thread spills).
      const int nunits = (cols + VE - 1) / VE;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        if constexpr (HAS_W) {
          const int j = k * tpr + t;
          if (j < nunits) {
            load_unit(wr[k], w, j, cols, vec);
          } else {
            wr[k].zero();
          }
        }
        scale_unit<HAS_W>(xr[k], wr[k], r2, off);
      }
      store_row(y + base, xr, cols, tpr, t, vec);
    }
  }
}

// Backward: persistent grid; per-thread dw accumulators for the thread's columns.
template <typename T, typename WT, int V, bool VEC>
__device__ __forceinline__ void bwd_rows(const BwdParams& p) {
  using A = typename AccOf<T>::type;
  constexpr int VE = 16 / sizeof(T);
  constexpr bool HAS_W = !SameType<WT, NoWeight>::value;
  using WL = typename Cond<HAS_W, WT, A>::type;

  __shared__ A red[2][32];
  GRAFT_DYN_SMEM(dyn_smem);
  const int tpr = int(p.tpr);
  const int rpb = int(p.rpb);
  const int cols = int(p.cols);
  constexpr bool vec = VEC;
  const bool has_dx = p.has_dx != 0;
  const bool has_dw = HAS_W && p.has_dw != 0;
  const int g = threadIdx.x / tpr;
  const int t = threadIdx.x - g * tpr;
  const A inv_cols = A(p.inv_cols);
  const A off = A(p.offset);
  const bool round_first = ROUNDS<T, WT> && p.round_first != 0;
  const T* __restrict__ dy = static_cast<const T*>(p.dy);
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const A* __restrict__ rstd = static_cast<const A*>(p.rstd);
  const WL* __restrict__ w = static_cast<const WL*>(p.w);
  T* __restrict__ dx = static_cast<T*>(p.dx);
  const long long nsets = (p.rows + rpb - 1) / rpb;
  int parity = 0;

  A dwacc[V][VE];
#pragma unroll
  for (int k = 0; k < V; ++k) {
#pragma unroll
    for (int e = 0; e < VE; ++e) dwacc[k][e] = A(0);
  }

  for (long long set = blockIdx.x; set < nsets; set += gridDim.x) {
    const long long row = set * rpb + g;
    const bool ok = row < p.rows;
    const long long base = ok ? row * cols : 0;
    Arr<T, VE> xr[V], gr[V];
    load_row(xr, x + base, cols, tpr, t, vec, ok);
    load_row(gr, dy + base, cols, tpr, t, vec, ok);
    const A r = ok ? rstd[row] : A(0);

    if (has_dx) {
      Arr<WL, VE> wr[V];
      if constexpr (HAS_W) load_row(wr, w, cols, tpr, t, vec, true);
      A dot = A(0);
#pragma unroll
      for (int k = 0; k < V; ++k) dot += unit_dot(gr[k], wr[k], xr[k], r, off, HAS_W);
      dot = group_sum(dot, tpr, red[parity]);
      parity ^= 1;
      const A c = dot * inv_cols;
      forget_all(xr);
      forget_all(gr);
      if constexpr (HAS_W) forget_all(wr);
      if (ok) {
        Arr<T, VE> dr[V];
#pragma unroll
        for (int k = 0; k < V; ++k) {
          A o[VE];
#pragma unroll
          for (int e = 0; e < VE; ++e) {
            A gv = gr[k].get(e);
            if constexpr (HAS_W) gv *= A(wr[k].get(e)) + off;
            o[e] = (gv - (xr[k].get(e) * r) * c) * r;
          }
          dr[k].put(o);
        }
        store_row(dx + base, dr, cols, tpr, t, vec);
      }
    }
    if (has_dw) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
#pragma unroll
        for (int e = 0; e < VE; ++e) {
          const A xw = pre_weight<T>(xr[k].get(e) * r, round_first);
          dwacc[k][e] = fma(gr[k].get(e), xw, dwacc[k][e]);
        }
      }
    }
  }

  if (!has_dw) return;
  // Add the row groups' accumulators in a fixed order (0 + 1 + 2 ...); group 0 then writes
  // the block's partial row. Shared layout [group - 1][k * VE + e][t]: conflict-free.
  if (rpb > 1) {
    A* sm = reinterpret_cast<A*>(dyn_smem);
    if (g > 0) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
#pragma unroll
        for (int e = 0; e < VE; ++e) sm[((g - 1) * V * VE + k * VE + e) * tpr + t] = dwacc[k][e];
      }
    }
    __syncthreads();
    if (g > 0) return;
    for (int h = 1; h < rpb; ++h) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
#pragma unroll
        for (int e = 0; e < VE; ++e) dwacc[k][e] += sm[((h - 1) * V * VE + k * VE + e) * tpr + t];
      }
    }
  }
  A* __restrict__ part = static_cast<A*>(p.partial) + (long long)blockIdx.x * cols;
  const int nunits = (cols + VE - 1) / VE;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int j = k * tpr + t;
    if (j < nunits) {
      if constexpr (VEC) {
        Arr<A, VE> o;
#pragma unroll
        for (int e = 0; e < VE; e += 2) Conv<A>::put2(o.u, e, dwacc[k][e], dwacc[k][e + 1]);
        store_vec(part + (long long)j * VE, o);
      } else {
#pragma unroll
        for (int e = 0; e < VE; ++e) {
          if (j * VE + e < cols) part[j * VE + e] = dwacc[k][e];
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Loop kernels: any cols; one row per block at a time; the thread owns units
// j = t + i * blockDim.x. Pass 1 reduces, pass 2 re-reads the row (mostly from L2).

constexpr int LOOP_UNROLL = 4;

template <typename T, typename WT>
__device__ __forceinline__ void fwd_loop(const FwdParams& p) {
  using A = typename AccOf<T>::type;
  constexpr int VE = 16 / sizeof(T);
  constexpr int U = LOOP_UNROLL;
  constexpr bool HAS_W = !SameType<WT, NoWeight>::value;
  using WL = typename Cond<HAS_W, WT, A>::type;

  __shared__ A red[2][32];
  const int nt = blockDim.x;
  const int t = threadIdx.x;
  const long long cols = p.cols;
  const long long nunits = (cols + VE - 1) / VE;
  const bool vec = p.vec != 0;
  const A eps = A(p.eps);
  const A inv_cols = A(p.inv_cols);
  const A off = A(p.offset);
  const bool round_first = ROUNDS<T, WT> && p.round_first != 0;
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const WL* __restrict__ w = static_cast<const WL*>(p.w);
  T* __restrict__ y = static_cast<T*>(p.y);
  A* __restrict__ rstd = static_cast<A*>(p.rstd);
  int parity = 0;

  for (long long row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* __restrict__ xrow = x + row * cols;
    T* __restrict__ yrow = y + row * cols;
    A ss = A(0);
    for (long long j0 = t; j0 < nunits; j0 += U * nt) {
      Arr<T, VE> xr[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const long long j = j0 + (long long)u * nt;
        if (j < nunits) {
          load_unit(xr[u], xrow, j, cols, vec);
        } else {
          xr[u].zero();
        }
      }
      A it = A(0);
#pragma unroll
      for (int u = 0; u < U; ++u) it += unit_sumsq(xr[u]);
      ss += it;
    }
    ss = group_sum(ss, nt, red[parity]);
    parity ^= 1;
    const A r = rsqrt_acc(ss * inv_cols + eps);
    if (t == 0) rstd[row] = r;

    for (long long j = t; j < nunits; j += nt) {
      Arr<T, VE> xv;
      Arr<WL, VE> wv;
      load_unit(xv, xrow, j, cols, vec);
      A r2 = r;
      if constexpr (ROUNDS<T, WT>) {
        scale_unit<false>(xv, wv, round_first ? r : A(1), off);  // as in fwd_rows
        r2 = round_first ? A(1) : r;
      }
      if constexpr (HAS_W) load_unit(wv, w, j, cols, vec);
      scale_unit<HAS_W>(xv, wv, r2, off);
      store_unit(yrow, xv, j, cols, vec);
    }
  }
}

template <typename T, typename WT>
__device__ __forceinline__ void bwd_loop(const BwdParams& p) {
  using A = typename AccOf<T>::type;
  constexpr int VE = 16 / sizeof(T);
  constexpr int U = LOOP_UNROLL;
  constexpr bool HAS_W = !SameType<WT, NoWeight>::value;
  using WL = typename Cond<HAS_W, WT, A>::type;

  __shared__ A red[2][32];
  GRAFT_DYN_SMEM(dyn_smem);
  const int nt = blockDim.x;
  const int t = threadIdx.x;
  const long long cols = p.cols;
  const long long nunits = (cols + VE - 1) / VE;
  const bool vec = p.vec != 0;
  const bool has_dx = p.has_dx != 0;
  const bool has_dw = HAS_W && p.has_dw != 0;
  const A inv_cols = A(p.inv_cols);
  const A off = A(p.offset);
  const bool round_first = ROUNDS<T, WT> && p.round_first != 0;
  const T* __restrict__ dy = static_cast<const T*>(p.dy);
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const A* __restrict__ rstd = static_cast<const A*>(p.rstd);
  const WL* __restrict__ w = static_cast<const WL*>(p.w);
  T* __restrict__ dx = static_cast<T*>(p.dx);
  A* ws_row = has_dw ? static_cast<A*>(p.partial) + (long long)blockIdx.x * cols : nullptr;
  A* part = (has_dw && p.dw_smem) ? reinterpret_cast<A*>(dyn_smem) : ws_row;
  int parity = 0;

  // A thread zeroes, accumulates and copies out only the partial entries of its own units:
  // no barrier is needed around them.
  if (has_dw) {
    for (long long j = t; j < nunits; j += nt) {
#pragma unroll
      for (int e = 0; e < VE; ++e) {
        if (j * VE + e < cols) part[j * VE + e] = A(0);
      }
    }
  }

  for (long long row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* __restrict__ xrow = x + row * cols;
    const T* __restrict__ grow = dy + row * cols;
    const A r = rstd[row];
    A c = A(0);
    if (has_dx) {
      A dot = A(0);
      for (long long j0 = t; j0 < nunits; j0 += U * nt) {
        Arr<T, VE> xr[U], gr[U];
        Arr<WL, VE> wr[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const long long j = j0 + (long long)u * nt;
          if (j < nunits) {
            load_unit(xr[u], xrow, j, cols, vec);
            load_unit(gr[u], grow, j, cols, vec);
            if constexpr (HAS_W) load_unit(wr[u], w, j, cols, vec);
          } else {
            xr[u].zero();
            gr[u].zero();
            if constexpr (HAS_W) wr[u].zero();
          }
        }
        A it = A(0);
#pragma unroll
        for (int u = 0; u < U; ++u) it += unit_dot(gr[u], wr[u], xr[u], r, off, HAS_W);
        dot += it;
      }
      dot = group_sum(dot, nt, red[parity]);
      parity ^= 1;
      c = dot * inv_cols;
    }

    for (long long j = t; j < nunits; j += nt) {
      Arr<T, VE> xv, gv;
      load_unit(xv, xrow, j, cols, vec);
      load_unit(gv, grow, j, cols, vec);
      if (has_dx) {
        Arr<WL, VE> wv;
        if constexpr (HAS_W) load_unit(wv, w, j, cols, vec);
        A o[VE];
#pragma unroll
        for (int e = 0; e < VE; ++e) {
          A gg = gv.get(e);
          if constexpr (HAS_W) gg *= A(wv.get(e)) + off;
          o[e] = (gg - (xv.get(e) * r) * c) * r;
        }
        Arr<T, VE> dv;
        dv.put(o);
        store_unit(dx + row * cols, dv, j, cols, vec);
      }
      if (has_dw) {
#pragma unroll
        for (int e = 0; e < VE; ++e) {
          if (j * VE + e < cols) {
            const A xw = pre_weight<T>(xv.get(e) * r, round_first);
            part[j * VE + e] = fma(gv.get(e), xw, part[j * VE + e]);
          }
        }
      }
    }
  }

  if (has_dw && p.dw_smem) {
    for (long long j = t; j < nunits; j += nt) {
#pragma unroll
      for (int e = 0; e < VE; ++e) {
        if (j * VE + e < cols) ws_row[j * VE + e] = part[j * VE + e];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// dw = sum of the partial rows, in block order, written in the weight dtype.
// Block: 32 columns x 8 slices; slice s sums partial rows s, s + 8, ... and the 8 slice
// sums are then added in order. The order depends only on nparts: the same bits every run.

template <typename A, typename OT>
__device__ __forceinline__ void dw_finalize(const FinalizeParams& p) {
  __shared__ A acc[8][33];
  const int lane = threadIdx.x & 31;
  const int slice = threadIdx.x >> 5;
  const long long col = (long long)blockIdx.x * 32 + lane;
  const A* __restrict__ part = static_cast<const A*>(p.partial);
  A s = A(0);
  if (col < p.cols) {
#pragma unroll 4
    for (long long b = slice; b < p.nparts; b += 8) s += part[b * p.cols + col];
  }
  acc[slice][lane] = s;
  __syncthreads();
  if (slice == 0 && col < p.cols) {
    A tot = acc[0][lane];
#pragma unroll
    for (int i = 1; i < 8; ++i) tot += acc[i][lane];
    using Raw = typename Conv<OT>::Raw;
    static_cast<Raw*>(p.dw)[col] = Conv<OT>::to_raw(tot);
  }
}

}  // namespace graft

// ---------------------------------------------------------------------------------------
// Entry points, named as src/kernels.rs builds the names:
//   graft_rms_{fwd,bwd}_rows_{dt}_{wk}_{v,s}{V}   graft_rms_{fwd,bwd}_loop_{dt}_{wk}
//   graft_rms_dw_finalize_{acc}_{out}
// dt: f32 f64 f16 bf16; wk: none | same (weight dtype == x dtype) | acc (weight in the
// accumulation dtype; f16/bf16 only: for f32/f64 it is `same`).
// The maximum block size of each kernel (launch bounds) is mirrored in src/config.rs.

#define GRAFT_LOOP_THREADS 512
#define GRAFT_FWD_MAXT_1 512
#define GRAFT_FWD_MAXT_2 512
#define GRAFT_FWD_MAXT_4 512
#define GRAFT_FWD_MAXT_8 512
#define GRAFT_FWD_MAXT_16 256
#define GRAFT_BWD_MAXT_1 512
#define GRAFT_BWD_MAXT_2 512
#define GRAFT_BWD_MAXT_4 512
#define GRAFT_BWD_MAXT_8 256

#define GRAFT_FWD_ROWS(NAME, T, WT, V, VEC)                                                 \
  extern "C" __global__ void __launch_bounds__(GRAFT_FWD_MAXT_##V, 1) NAME(                    \
      const graft::FwdParams p) {                                                           \
    graft::fwd_rows<T, WT, V, VEC>(p);                                                      \
  }
#define GRAFT_BWD_ROWS(NAME, T, WT, V, VEC)                                                 \
  extern "C" __global__ void __launch_bounds__(GRAFT_BWD_MAXT_##V, 1) NAME(                    \
      const graft::BwdParams p) {                                                           \
    graft::bwd_rows<T, WT, V, VEC>(p);                                                      \
  }
#define GRAFT_FWD_LOOP(NAME, T, WT)                                                         \
  extern "C" __global__ void __launch_bounds__(GRAFT_LOOP_THREADS, 1) NAME(                    \
      const graft::FwdParams p) {                                                           \
    graft::fwd_loop<T, WT>(p);                                                              \
  }
#define GRAFT_BWD_LOOP(NAME, T, WT)                                                         \
  extern "C" __global__ void __launch_bounds__(GRAFT_LOOP_THREADS, 1) NAME(                    \
      const graft::BwdParams p) {                                                           \
    graft::bwd_loop<T, WT>(p);                                                              \
  }

// Vector kernels (_v{V}) for every V; scalar kernels (_s{V}) for V = 1 and 4 (forward) or
// 1 and 2 (backward) only: the scalar path serves odd cols and unaligned pointers, and the
// loop kernel takes over for rows longer than those cover.
#define GRAFT_ALL(DT, WK, T, WT)                                          \
  GRAFT_FWD_ROWS(graft_rms_fwd_rows_##DT##_##WK##_v1, T, WT, 1, true)     \
  GRAFT_FWD_ROWS(graft_rms_fwd_rows_##DT##_##WK##_v2, T, WT, 2, true)     \
  GRAFT_FWD_ROWS(graft_rms_fwd_rows_##DT##_##WK##_v4, T, WT, 4, true)     \
  GRAFT_FWD_ROWS(graft_rms_fwd_rows_##DT##_##WK##_v8, T, WT, 8, true)     \
  GRAFT_FWD_ROWS(graft_rms_fwd_rows_##DT##_##WK##_v16, T, WT, 16, true)   \
  GRAFT_FWD_ROWS(graft_rms_fwd_rows_##DT##_##WK##_s1, T, WT, 1, false)    \
  GRAFT_FWD_ROWS(graft_rms_fwd_rows_##DT##_##WK##_s4, T, WT, 4, false)    \
  GRAFT_FWD_LOOP(graft_rms_fwd_loop_##DT##_##WK, T, WT)                   \
  GRAFT_BWD_ROWS(graft_rms_bwd_rows_##DT##_##WK##_v1, T, WT, 1, true)     \
  GRAFT_BWD_ROWS(graft_rms_bwd_rows_##DT##_##WK##_v2, T, WT, 2, true)     \
  GRAFT_BWD_ROWS(graft_rms_bwd_rows_##DT##_##WK##_v4, T, WT, 4, true)     \
  GRAFT_BWD_ROWS(graft_rms_bwd_rows_##DT##_##WK##_v8, T, WT, 8, true)     \
  GRAFT_BWD_ROWS(graft_rms_bwd_rows_##DT##_##WK##_s1, T, WT, 1, false)    \
  GRAFT_BWD_ROWS(graft_rms_bwd_rows_##DT##_##WK##_s2, T, WT, 2, false)    \
  GRAFT_BWD_LOOP(graft_rms_bwd_loop_##DT##_##WK, T, WT)

GRAFT_ALL(f32, none, float, graft::NoWeight)
GRAFT_ALL(f32, same, float, float)
GRAFT_ALL(f64, none, double, graft::NoWeight)
GRAFT_ALL(f64, same, double, double)
GRAFT_ALL(f16, none, __half, graft::NoWeight)
GRAFT_ALL(f16, same, __half, __half)
GRAFT_ALL(f16, acc, __half, float)
GRAFT_ALL(bf16, none, __nv_bfloat16, graft::NoWeight)
GRAFT_ALL(bf16, same, __nv_bfloat16, __nv_bfloat16)
GRAFT_ALL(bf16, acc, __nv_bfloat16, float)

#define GRAFT_FINALIZE(NAME, A, OT)                                                        \
  extern "C" __global__ void __launch_bounds__(256) NAME(const graft::FinalizeParams p) { \
    graft::dw_finalize<A, OT>(p);                                                          \
  }
GRAFT_FINALIZE(graft_rms_dw_finalize_f32_f32, float, float)
GRAFT_FINALIZE(graft_rms_dw_finalize_f32_f16, float, __half)
GRAFT_FINALIZE(graft_rms_dw_finalize_f32_bf16, float, __nv_bfloat16)
GRAFT_FINALIZE(graft_rms_dw_finalize_f64_f64, double, double)

// Gated linear units for graft-cuda: y = act(gate) * up, and its backward
//   dgate = dy * up * act'(gate),  dup = dy * act(gate)
// with act one of SiLU (SwiGLU), tanh-approximated GELU and exact (erf) GELU (GeGLU).
// Arithmetic happens in the accumulation type (float; double for double) and each output
// is rounded once.
//
// Layout: gate, up, dy, y, dgate and dup are contiguous arrays of n elements of T, or (the
// packed kernels) gate and up are the two halves of each row of one rows x 2 cols array, as
// are dgate and dup, and dy and y are rows x cols. With `vec` = 1 (every pointer 16-byte
// aligned, n and cols multiples of the pack size) each thread moves 16-byte packs; otherwise
// single elements. Grid-stride loops cover any n.

#include "common.cuh"

namespace graft_glu {

using graft_common::Acc;
using graft_common::from_acc;
using graft_common::Pack;
using graft_common::to_acc;

// Mirrored by #[repr(C)] GluParams in mod.rs; every field is 8 bytes.
struct GluParams {
  const void* gate;
  const void* up;
  const void* dy;  // backward only
  void* out0;      // y (forward) or dgate (backward)
  void* out1;      // dup (backward)
  long long n;
  long long vec;
};

// Mirrored by #[repr(C)] GluPackedParams in mod.rs; every field is 8 bytes.
struct GluPackedParams {
  const void* gate_up;  // rows x 2 cols, each row [gate | up]
  const void* dy;       // rows x cols (backward only)
  void* out;            // y, rows x cols (forward), or d_gate_up, rows x 2 cols (backward)
  long long rows;
  long long cols;       // > 0
  long long vec;
};

// The math of one activation in the accumulation type A. Fast<A> = true (16-bit element
// types, whose outputs keep 8 or 11 bits) uses the SFU's approximate exp and reciprocal (a few
// float ulp of error, far below the output's rounding); float and double outputs get the
// correctly rounded functions.
template <typename A, bool FAST>
struct Math;

template <>
struct Math<float, true> {
  static __device__ __forceinline__ float exp(float x) { return __expf(x); }
  static __device__ __forceinline__ float div(float a, float b) { return __fdividef(a, b); }
};

template <>
struct Math<float, false> {
  static __device__ __forceinline__ float exp(float x) { return expf(x); }
  static __device__ __forceinline__ float div(float a, float b) { return a / b; }
};

template <>
struct Math<double, false> {
  static __device__ __forceinline__ double exp(double x) { return ::exp(x); }
  // a * (1 / b): the correctly rounded reciprocal is computed inline, where a division's slow
  // path is a call whose register saves spill (ptxas) in the SiLU kernel.
  static __device__ __forceinline__ double div(double a, double b) { return a * __drcp_rn(b); }
};

// 1 / (1 + e^-x), as e^x / (1 + e^x) for negative x: e^-|x| never overflows, and the result
// keeps its value down to the subnormals.
template <typename A, bool FAST>
__device__ __forceinline__ A sigmoid(A x) {
  const A e = Math<A, FAST>::exp(-fabs(x));
  return Math<A, FAST>::div(x < A(0) ? e : A(1), A(1) + e);
}

// act(x) and act'(x) for each activation.
struct Silu {
  template <typename A, bool FAST>
  static __device__ __forceinline__ void eval(A x, A& f, A& df) {
    const A s = sigmoid<A, FAST>(x);
    f = x * s;
    df = s * (A(1) + x * (A(1) - s));
  }
};

// 0.5 (1 + tanh(u)) is computed as sigmoid(2u) and 0.5 (1 + erf(z)) as 0.5 erfc(-z): the
// same values without the cancellation that 1 + tanh / 1 + erf suffer for negative x.
struct GeluTanh {
  template <typename A, bool FAST>
  static __device__ __forceinline__ void eval(A x, A& f, A& df) {
    const A k0 = A(0.7978845608028654);  // sqrt(2 / pi)
    const A k1 = A(0.044715);
    const A x2 = x * x;
    const A s = sigmoid<A, FAST>(A(2) * k0 * (x + k1 * x2 * x));
    f = x * s;
    df = s + x * A(2) * s * (A(1) - s) * k0 * (A(1) + A(3) * k1 * x2);
  }
};

struct GeluErf {
  template <typename A, bool FAST>
  static __device__ __forceinline__ void eval(A x, A& f, A& df) {
    const A inv_sqrt_2pi = A(0.3989422804014327);
    const A cdf = normcdf(x);
    f = x * cdf;
    df = cdf + x * inv_sqrt_2pi * Math<A, FAST>::exp(A(-0.5) * x * x);
  }
};

// Whether element type T gets the fast math (its outputs are 16-bit).
template <typename T>
constexpr bool kFast = sizeof(T) == 2;

// Where the gate of element i lives (i counts the outputs y / dy, and the first element of a
// pack on the vector path); up (and dup) sit at the same offset from their own base. dy and y
// are always at i itself.
struct FlatIndex {
  __device__ __forceinline__ long long gate(long long i) const { return i; }
};

// Packed rows [gate | up] of `cols` elements each: gate at row * 2 cols + col = i + row * cols,
// up `cols` further (its base is gate_up + cols).
struct PackedIndex {
  long long cols;
  __device__ __forceinline__ long long gate(long long i) const { return i + (i / cols) * cols; }
};

template <typename Act, typename T>
__device__ __forceinline__ void fwd_one(const T* g, const T* u, T* y, long long gi, long long i) {
  using A = typename Acc<T>::type;
  A f, df;
  Act::template eval<A, kFast<T>>(to_acc(g[gi]), f, df);
  y[i] = from_acc<T>(f * to_acc(u[gi]));
}

template <typename Act, typename T>
__device__ __forceinline__ void bwd_one(const T* g, const T* u, const T* dy, T* dg, T* du,
                                        long long gi, long long i) {
  using A = typename Acc<T>::type;
  A f, df;
  Act::template eval<A, kFast<T>>(to_acc(g[gi]), f, df);
  const A d = to_acc(dy[i]);
  dg[gi] = from_acc<T>(d * to_acc(u[gi]) * df);
  du[gi] = from_acc<T>(d * f);
}

// y = act(gate) * up over n outputs; `vec`: 16-byte packs (every base aligned, n and, for
// packed rows, cols multiples of the pack size, so that no pack straddles two rows).
template <typename Act, typename T, typename Index>
__device__ void forward(const T* g, const T* u, T* y, long long n, bool vec, Index at) {
  using A = typename Acc<T>::type;
  const long long stride = graft_common::grid_threads();
  const long long first = graft_common::thread_index();
  if (vec) {
    constexpr int N = Pack<T>::N;
    const long long packs = n / N;
    for (long long k = first; k < packs; k += stride) {
      const long long gi = at.gate(k * N);
      const Pack<T> gv = graft_common::load_pack(g + gi);
      const Pack<T> uv = graft_common::load_pack(u + gi);
      Pack<T> yv;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        A f, df;
        Act::template eval<A, kFast<T>>(to_acc(gv.v[e]), f, df);
        yv.v[e] = from_acc<T>(f * to_acc(uv.v[e]));
      }
      graft_common::store_pack(y + k * N, yv);
    }
  } else {
    for (long long i = first; i < n; i += stride) fwd_one<Act>(g, u, y, at.gate(i), i);
  }
}

// dgate = dy * up * act'(gate), dup = dy * act(gate) over n elements of dy (as forward).
// Each thread reads an element's gate, up and dy before writing its dgate and dup, so the
// gradients may be written over gate and up.
template <typename Act, typename T, typename Index>
__device__ void backward(const T* g, const T* u, const T* dy, T* dg, T* du, long long n,
                         bool vec, Index at) {
  using A = typename Acc<T>::type;
  const long long stride = graft_common::grid_threads();
  const long long first = graft_common::thread_index();
  // Doubles go one at a time (8-byte accesses already): two erfc/exp evaluations of a pack
  // in flight would spill registers.
  if (sizeof(T) < 8 && vec) {
    constexpr int N = Pack<T>::N;
    const long long packs = n / N;
    for (long long k = first; k < packs; k += stride) {
      const long long gi = at.gate(k * N);
      const Pack<T> gv = graft_common::load_pack(g + gi);
      const Pack<T> uv = graft_common::load_pack(u + gi);
      const Pack<T> dv = graft_common::load_pack(dy + k * N);
      Pack<T> dgv, duv;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        A f, df;
        Act::template eval<A, kFast<T>>(to_acc(gv.v[e]), f, df);
        const A d = to_acc(dv.v[e]);
        dgv.v[e] = from_acc<T>(d * to_acc(uv.v[e]) * df);
        duv.v[e] = from_acc<T>(d * f);
      }
      graft_common::store_pack(dg + gi, dgv);
      graft_common::store_pack(du + gi, duv);
    }
  } else {
    for (long long i = first; i < n; i += stride) {
      bwd_one<Act>(g, u, dy, dg, du, at.gate(i), i);
    }
  }
}

template <typename Act, typename T>
__device__ void forward_flat(const GluParams& p) {
  forward<Act>(static_cast<const T*>(p.gate), static_cast<const T*>(p.up),
               static_cast<T*>(p.out0), p.n, p.vec != 0, FlatIndex{});
}

template <typename Act, typename T>
__device__ void backward_flat(const GluParams& p) {
  backward<Act>(static_cast<const T*>(p.gate), static_cast<const T*>(p.up),
                static_cast<const T*>(p.dy), static_cast<T*>(p.out0), static_cast<T*>(p.out1),
                p.n, p.vec != 0, FlatIndex{});
}

template <typename Act, typename T>
__device__ void forward_packed(const GluPackedParams& p) {
  const T* gate_up = static_cast<const T*>(p.gate_up);
  forward<Act>(gate_up, gate_up + p.cols, static_cast<T*>(p.out), p.rows * p.cols, p.vec != 0,
               PackedIndex{p.cols});
}

template <typename Act, typename T>
__device__ void backward_packed(const GluPackedParams& p) {
  const T* gate_up = static_cast<const T*>(p.gate_up);
  T* out = static_cast<T*>(p.out);
  backward<Act>(gate_up, gate_up + p.cols, static_cast<const T*>(p.dy), out, out + p.cols,
                p.rows * p.cols, p.vec != 0, PackedIndex{p.cols});
}

}  // namespace graft_glu

// Entry points: graft_glu_{fwd,bwd}_{silu,gelu_tanh,gelu_erf}_{f32,f64,f16,bf16} over flat
// arrays and graft_glu_packed_{fwd,bwd}_silu_{f32,f64,f16,bf16} over packed rows, 256 threads
// per block (mod.rs launches them with that block size).
#define GRAFT_GLU(ACT, ACTN, DT, T)                                                       \
  extern "C" __global__ void __launch_bounds__(256)                                       \
      graft_glu_fwd_##ACTN##_##DT(const graft_glu::GluParams p) {                         \
    graft_glu::forward_flat<graft_glu::ACT, T>(p);                                        \
  }                                                                                       \
  extern "C" __global__ void __launch_bounds__(256)                                       \
      graft_glu_bwd_##ACTN##_##DT(const graft_glu::GluParams p) {                         \
    graft_glu::backward_flat<graft_glu::ACT, T>(p);                                       \
  }

#define GRAFT_GLU_DTYPES(ACT, ACTN)          \
  GRAFT_GLU(ACT, ACTN, f32, float)           \
  GRAFT_GLU(ACT, ACTN, f64, double)          \
  GRAFT_GLU(ACT, ACTN, f16, __half)          \
  GRAFT_GLU(ACT, ACTN, bf16, __nv_bfloat16)

GRAFT_GLU_DTYPES(Silu, silu)
GRAFT_GLU_DTYPES(GeluTanh, gelu_tanh)
GRAFT_GLU_DTYPES(GeluErf, gelu_erf)

// SwiGLU over packed rows (torchgraft::swiglu_packed): SiLU only, the activation MoE experts use.
#define GRAFT_GLU_PACKED(ACT, ACTN, DT, T)                                                \
  extern "C" __global__ void __launch_bounds__(256)                                       \
      graft_glu_packed_fwd_##ACTN##_##DT(const graft_glu::GluPackedParams p) {            \
    graft_glu::forward_packed<graft_glu::ACT, T>(p);                                      \
  }                                                                                       \
  extern "C" __global__ void __launch_bounds__(256)                                       \
      graft_glu_packed_bwd_##ACTN##_##DT(const graft_glu::GluPackedParams p) {            \
    graft_glu::backward_packed<graft_glu::ACT, T>(p);                                     \
  }

GRAFT_GLU_PACKED(Silu, silu, f32, float)
GRAFT_GLU_PACKED(Silu, silu, f64, double)
GRAFT_GLU_PACKED(Silu, silu, f16, __half)
GRAFT_GLU_PACKED(Silu, silu, bf16, __nv_bfloat16)

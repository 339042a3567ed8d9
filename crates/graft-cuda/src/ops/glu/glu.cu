// Gated linear units for graft-cuda: y = act(gate) * up, and its backward
//   dgate = dy * up * act'(gate),  dup = dy * act(gate)
// with act one of SiLU (SwiGLU), tanh-approximated GELU and exact (erf) GELU (GeGLU).
// Arithmetic happens in the accumulation type (float; double for double) and each output
// is rounded once.
//
// Layout: gate, up, dy, y, dgate and dup are contiguous arrays of n elements of T. With
// `vec` = 1 (every pointer 16-byte aligned and n a multiple of the pack size) each thread
// moves 16-byte packs; otherwise single elements. Grid-stride loops cover any n.

#include "common.cuh"

namespace graft_glu {

using graft_common::Acc;
using graft_common::from_acc;
using graft_common::Pack;
using graft_common::to_acc;

// Mirrored by #[repr(C)] GluParams in src/glu.rs; every field is 8 bytes.
struct GluParams {
  const void* gate;
  const void* up;
  const void* dy;  // backward only
  void* out0;      // y (forward) or dgate (backward)
  void* out1;      // dup (backward)
  long long n;
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

template <typename Act, typename T>
__device__ __forceinline__ void fwd_one(const T* g, const T* u, T* y, long long i) {
  using A = typename Acc<T>::type;
  A f, df;
  Act::template eval<A, kFast<T>>(to_acc(g[i]), f, df);
  y[i] = from_acc<T>(f * to_acc(u[i]));
}

template <typename Act, typename T>
__device__ __forceinline__ void bwd_one(const T* g, const T* u, const T* dy, T* dg, T* du,
                                        long long i) {
  using A = typename Acc<T>::type;
  A f, df;
  Act::template eval<A, kFast<T>>(to_acc(g[i]), f, df);
  const A d = to_acc(dy[i]);
  dg[i] = from_acc<T>(d * to_acc(u[i]) * df);
  du[i] = from_acc<T>(d * f);
}

template <typename Act, typename T>
__device__ void forward(const GluParams& p) {
  using A = typename Acc<T>::type;
  const T* g = static_cast<const T*>(p.gate);
  const T* u = static_cast<const T*>(p.up);
  T* y = static_cast<T*>(p.out0);
  const long long stride = graft_common::grid_threads();
  const long long first = graft_common::thread_index();
  if (p.vec) {
    constexpr int N = Pack<T>::N;
    const long long packs = p.n / N;
    for (long long k = first; k < packs; k += stride) {
      const Pack<T> gv = graft_common::load_pack(g + k * N);
      const Pack<T> uv = graft_common::load_pack(u + k * N);
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
    for (long long i = first; i < p.n; i += stride) fwd_one<Act>(g, u, y, i);
  }
}

template <typename Act, typename T>
__device__ void backward(const GluParams& p) {
  using A = typename Acc<T>::type;
  const T* g = static_cast<const T*>(p.gate);
  const T* u = static_cast<const T*>(p.up);
  const T* dy = static_cast<const T*>(p.dy);
  T* dg = static_cast<T*>(p.out0);
  T* du = static_cast<T*>(p.out1);
  const long long stride = graft_common::grid_threads();
  const long long first = graft_common::thread_index();
  // Doubles go one at a time (8-byte accesses already): two erfc/exp evaluations of a pack
  // in flight would spill registers.
  if (sizeof(T) < 8 && p.vec) {
    constexpr int N = Pack<T>::N;
    const long long packs = p.n / N;
    for (long long k = first; k < packs; k += stride) {
      const Pack<T> gv = graft_common::load_pack(g + k * N);
      const Pack<T> uv = graft_common::load_pack(u + k * N);
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
      graft_common::store_pack(dg + k * N, dgv);
      graft_common::store_pack(du + k * N, duv);
    }
  } else {
    for (long long i = first; i < p.n; i += stride) bwd_one<Act>(g, u, dy, dg, du, i);
  }
}

}  // namespace graft_glu

// Entry points: graft_glu_{fwd,bwd}_{silu,gelu_tanh,gelu_erf}_{f32,f64,f16,bf16}, 256
// threads per block (src/glu.rs launches them with that block size).
#define GRAFT_GLU(ACT, ACTN, DT, T)                                                       \
  extern "C" __global__ void __launch_bounds__(256)                                       \
      graft_glu_fwd_##ACTN##_##DT(const graft_glu::GluParams p) {                         \
    graft_glu::forward<graft_glu::ACT, T>(p);                                             \
  }                                                                                       \
  extern "C" __global__ void __launch_bounds__(256)                                       \
      graft_glu_bwd_##ACTN##_##DT(const graft_glu::GluParams p) {                         \
    graft_glu::backward<graft_glu::ACT, T>(p);                                            \
  }

#define GRAFT_GLU_DTYPES(ACT, ACTN)          \
  GRAFT_GLU(ACT, ACTN, f32, float)           \
  GRAFT_GLU(ACT, ACTN, f64, double)          \
  GRAFT_GLU(ACT, ACTN, f16, __half)          \
  GRAFT_GLU(ACT, ACTN, bf16, __nv_bfloat16)

GRAFT_GLU_DTYPES(Silu, silu)
GRAFT_GLU_DTYPES(GeluTanh, gelu_tanh)
GRAFT_GLU_DTYPES(GeluErf, gelu_erf)

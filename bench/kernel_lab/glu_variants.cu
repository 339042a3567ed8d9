// Variants of the SwiGLU kernels: U packs per thread per iteration, loads first.
#include "glu.cu"
namespace lab {
using namespace graft_glu;
using graft_common::Pack;
template <int U, typename T>
__device__ void fwd(const GluParams& p) {
  using A = typename Acc<T>::type;
  constexpr int N = Pack<T>::N;
  const T* g = static_cast<const T*>(p.gate);
  const T* u = static_cast<const T*>(p.up);
  T* y = static_cast<T*>(p.out0);
  const long long stride = graft_common::grid_threads();
  const long long packs = p.n / N;
  for (long long k0 = graft_common::thread_index(); k0 < packs; k0 += stride * U) {
    Pack<T> gv[U], uv[U];
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const long long k = k0 + i * stride;
      if (k < packs) { gv[i] = graft_common::load_pack(g + k * N); uv[i] = graft_common::load_pack(u + k * N); }
    }
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const long long k = k0 + i * stride;
      if (k < packs) {
        Pack<T> yv;
#pragma unroll
        for (int e = 0; e < N; ++e) {
          A f, df;
          Silu::template eval<A, true>(to_acc(gv[i].v[e]), f, df);
          yv.v[e] = from_acc<T>(f * to_acc(uv[i].v[e]));
        }
        graft_common::store_pack(y + k * N, yv);
      }
    }
  }
}
template <int U, typename T>
__device__ void bwd(const GluParams& p) {
  using A = typename Acc<T>::type;
  constexpr int N = Pack<T>::N;
  const T* g = static_cast<const T*>(p.gate);
  const T* u = static_cast<const T*>(p.up);
  const T* dy = static_cast<const T*>(p.dy);
  T* dg = static_cast<T*>(p.out0);
  T* du = static_cast<T*>(p.out1);
  const long long stride = graft_common::grid_threads();
  const long long packs = p.n / N;
  for (long long k0 = graft_common::thread_index(); k0 < packs; k0 += stride * U) {
    Pack<T> gv[U], uv[U], dv[U];
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const long long k = k0 + i * stride;
      if (k < packs) {
        gv[i] = graft_common::load_pack(g + k * N); uv[i] = graft_common::load_pack(u + k * N);
        dv[i] = graft_common::load_pack(dy + k * N);
      }
    }
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const long long k = k0 + i * stride;
      if (k < packs) {
        Pack<T> a, b;
#pragma unroll
        for (int e = 0; e < N; ++e) {
          A f, df;
          Silu::template eval<A, true>(to_acc(gv[i].v[e]), f, df);
          const A d = to_acc(dv[i].v[e]);
          a.v[e] = from_acc<T>(d * to_acc(uv[i].v[e]) * df);
          b.v[e] = from_acc<T>(d * f);
        }
        graft_common::store_pack(dg + k * N, a);
        graft_common::store_pack(du + k * N, b);
      }
    }
  }
}
}  // namespace lab
#define LAB(U, B) \
  extern "C" __global__ void __launch_bounds__(B) lab_fwd_u##U##_b##B(const graft_glu::GluParams p) { lab::fwd<U, __nv_bfloat16>(p); } \
  extern "C" __global__ void __launch_bounds__(B) lab_bwd_u##U##_b##B(const graft_glu::GluParams p) { lab::bwd<U, __nv_bfloat16>(p); }
LAB(1, 256) LAB(2, 256) LAB(4, 256) LAB(1, 512) LAB(2, 512) LAB(4, 512) LAB(1, 128) LAB(2, 128) LAB(4, 128)

// Fused Adam / AdamW over a list of tensors (aten::_fused_adam_ / aten::_fused_adamw_), with
// the results of ATen's CUDA kernel (FusedAdamMathFunctor) to the bit: the same operations in
// the same order, each rounding spelled out (__f*_rn / fma) so that no contraction choice of
// the compiler can differ from the one nvcc made for ATen.
//
// One launch covers up to kMaxTensors tensors whose pointers travel in the parameter block
// (kernel parameters of up to 32 KB, CUDA 12.1+ on sm_70+). Each tensor is cut into chunks of
// `chunk` elements; block b finds its tensor by a binary search over the chunks' prefix sums,
// so one launch serves any mix of large and small tensors with no idle tail per tensor.

#include <type_traits>

#include "common.cuh"

namespace graft_adam {

using graft_common::Acc;
using graft_common::from_acc;
using graft_common::Pack;
using graft_common::to_acc;

constexpr int kMaxTensors = 480;

// Mirrored by #[repr(C)] AdamParams in src/adam.rs; every field is 8 bytes.
struct AdamParams {
  double lr;
  double beta1;
  double beta2;
  double weight_decay;
  double eps;
  const float* lr_ptr;      // the learning rate on the device, or null for `lr`
  const float* grad_scale;  // null: no unscaling
  const float* found_inf;   // null: always step
  long long maximize;
  long long ntensors;
  long long chunk;  // elements per block, a multiple of every pack size
  void* param[kMaxTensors];
  void* grad[kMaxTensors];
  void* exp_avg[kMaxTensors];
  void* exp_avg_sq[kMaxTensors];
  void* max_exp_avg_sq[kMaxTensors];
  const float* step[kMaxTensors];
  long long numel[kMaxTensors];
  long long first_chunk[kMaxTensors + 1];  // prefix sums of the tensors' chunk counts
};

// Correctly rounded arithmetic that the compiler may not fuse, per accumulation type.
struct F32 {
  static __device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
  static __device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
  static __device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
  static __device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }
  static __device__ __forceinline__ float sqrt(float a) { return __fsqrt_rn(a); }
  static __device__ __forceinline__ float fma(float a, float b, float c) { return fmaf(a, b, c); }
  static __device__ __forceinline__ float pow(float a, float b) { return powf(a, b); }
};
struct F64 {
  static __device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
  static __device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
  static __device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
  static __device__ __forceinline__ double div(double a, double b) { return __ddiv_rn(a, b); }
  static __device__ __forceinline__ double sqrt(double a) { return __dsqrt_rn(a); }
  static __device__ __forceinline__ double fma(double a, double b, double c) {
    return ::fma(a, b, c);
  }
  static __device__ __forceinline__ double pow(double a, double b) { return ::pow(a, b); }
};
template <typename A>
struct Math;
template <>
struct Math<float> : F32 {};
template <>
struct Math<double> : F64 {};

// The per-tensor constants, as ATen's functor computes them in the accumulation type.
template <typename A>
struct Coeffs {
  A lr, beta1, beta2, weight_decay, eps, lr_wd, step_size, bc2_sqrt;
  float grad_scale;
  bool maximize;
};

template <typename A>
__device__ __forceinline__ Coeffs<A> coeffs(const AdamParams& p, int t) {
  using M = Math<A>;
  Coeffs<A> c;
  c.lr = p.lr_ptr ? A(*p.lr_ptr) : A(p.lr);
  c.beta1 = A(p.beta1);
  c.beta2 = A(p.beta2);
  c.weight_decay = A(p.weight_decay);
  c.eps = A(p.eps);
  const A step = A(*p.step[t]);
  const A bc1 = M::sub(A(1), M::pow(c.beta1, step));
  c.bc2_sqrt = M::sqrt(M::sub(A(1), M::pow(c.beta2, step)));
  c.step_size = M::div(c.lr, bc1);
  c.lr_wd = M::mul(c.lr, c.weight_decay);
  c.grad_scale = p.grad_scale ? *p.grad_scale : 1.0f;
  c.maximize = p.maximize != 0;
  return c;
}

// One element: ATen's adam_math. Returns the unscaled gradient for storing.
template <typename A, bool ADAMW, bool AMS>
__device__ __forceinline__ void update(const Coeffs<A>& c, bool scaled, bool l2_unfused, A& param,
                                       A& grad, A& m, A& v, A& mx) {
  using M = Math<A>;
  if (scaled) grad = M::div(grad, A(c.grad_scale));
  const A g_store = grad;
  A g = c.maximize ? -grad : grad;
  if (c.weight_decay != A(0)) {
    if (ADAMW) {
      param = M::fma(-c.lr_wd, param, param);
    } else if (l2_unfused) {
      g = M::add(g, M::mul(param, c.weight_decay));
    } else {
      g = M::fma(param, c.weight_decay, g);
    }
  }
  m = M::fma(c.beta1, m, M::fma(-c.beta1, g, g));
  const A gg = M::mul(g, g);
  v = M::fma(c.beta2, v, M::fma(-c.beta2, gg, gg));
  A second = v;
  if (AMS) {
    // std::max(mx, v): mx unless it is smaller (NaN keeps mx).
    mx = (mx < v) ? v : mx;
    second = mx;
  }
  const A denom = M::add(M::div(M::sqrt(second), c.bc2_sqrt), c.eps);
  param = M::sub(param, M::div(M::mul(c.step_size, m), denom));
  grad = g_store;
}

// ATen's `grad += param * weight_decay` (Adam's L2 term) is a fused multiply-add in every
// instantiation of torch's CUDA build but one: float math without AMSGrad, where nvcc left it
// a multiply and an add for the first of the kILP = 4 elements a thread holds (measured on an
// H100 with torch 2.11+cu130, element by element). Which element is "first" depends on ATen's
// path: 4 consecutive elements when the tensor's size is a multiple of 4 and its buffers are
// aligned to 4 elements, else elements blockDim (512) apart, per 2048.
constexpr long long kAtenIlp = 4;
constexpr long long kAtenBlock = 512;

template <typename A, bool ADAMW, bool AMS>
constexpr bool kL2Unfused = std::is_same<A, float>::value && !ADAMW && !AMS;

// On ATen's other path, whether element `index` of a tensor is a thread's first of four.
__device__ __forceinline__ bool aten_first_of_strided(long long index) {
  static_assert(((kAtenIlp * kAtenBlock) & (kAtenIlp * kAtenBlock - 1)) == 0, "a power of 2");
  return (static_cast<unsigned>(index) & unsigned(kAtenIlp * kAtenBlock - 1)) < kAtenBlock;
}

template <typename T>
__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15) == 0;
}

template <typename T, bool ADAMW, bool AMS>
__device__ void step(const AdamParams& p) {
  using A = typename Acc<T>::type;
  if (p.found_inf && *p.found_inf == 1.0f) return;
  // The tensor of this block: the last t with first_chunk[t] <= block.
  const long long b = blockIdx.x;
  int lo = 0, hi = int(p.ntensors) - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.first_chunk[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int t = lo;
  const long long start = (b - p.first_chunk[t]) * p.chunk;
  const long long rest = p.numel[t] - start;
  const long long n = rest < p.chunk ? rest : p.chunk;
  T* pp = static_cast<T*>(p.param[t]) + start;
  T* gp = static_cast<T*>(p.grad[t]) + start;
  T* mp = static_cast<T*>(p.exp_avg[t]) + start;
  T* vp = static_cast<T*>(p.exp_avg_sq[t]) + start;
  T* xp = AMS ? static_cast<T*>(p.max_exp_avg_sq[t]) + start : nullptr;
  const Coeffs<A> c = coeffs<A>(p, t);
  const bool scaled = p.grad_scale != nullptr;
  constexpr unsigned long long kAtenAlign = kAtenIlp * sizeof(T);
  const unsigned long long any_address = reinterpret_cast<unsigned long long>(pp) |
                                         reinterpret_cast<unsigned long long>(gp) |
                                         reinterpret_cast<unsigned long long>(mp) |
                                         reinterpret_cast<unsigned long long>(vp) |
                                         reinterpret_cast<unsigned long long>(xp);
  const bool aten_vectorized = p.numel[t] % kAtenIlp == 0 && any_address % kAtenAlign == 0;

  constexpr int N = Pack<T>::N;
  const bool vec = aligned16<T>(pp) && aligned16<T>(gp) && aligned16<T>(mp) &&
                   aligned16<T>(vp) && (!AMS || aligned16<T>(xp));
  long long done = 0;
  if (vec) {
    const long long packs = n / N;
    for (long long k = threadIdx.x; k < packs; k += blockDim.x) {
      const long long i = k * N;
      const bool first_strided = aten_first_of_strided(start + i);
      Pack<T> P = graft_common::load_pack(pp + i);
      Pack<T> G = graft_common::load_pack(gp + i);
      Pack<T> Mv = graft_common::load_pack(mp + i);
      Pack<T> V = graft_common::load_pack(vp + i);
      Pack<T> X;
      if (AMS) X = graft_common::load_pack(xp + i);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        A param = to_acc(P.v[e]), grad = to_acc(G.v[e]), m = to_acc(Mv.v[e]),
          v = to_acc(V.v[e]), mx = AMS ? to_acc(X.v[e]) : A(0);
        // start + i is a multiple of N (>= 4): e decides on ATen's vectorized path, and the
        // whole pack falls on one side of the 512-element boundaries on the other.
        const bool unfused = kL2Unfused<A, ADAMW, AMS> &&
                             (aten_vectorized ? e % kAtenIlp == 0 : first_strided);
        update<A, ADAMW, AMS>(c, scaled, unfused, param, grad, m, v, mx);
        P.v[e] = from_acc<T>(param);
        G.v[e] = from_acc<T>(grad);
        Mv.v[e] = from_acc<T>(m);
        V.v[e] = from_acc<T>(v);
        if (AMS) X.v[e] = from_acc<T>(mx);
      }
      graft_common::store_pack(pp + i, P);
      if (scaled) graft_common::store_pack(gp + i, G);
      graft_common::store_pack(mp + i, Mv);
      graft_common::store_pack(vp + i, V);
      if (AMS) graft_common::store_pack(xp + i, X);
    }
    done = packs * N;
  }
  for (long long i = done + threadIdx.x; i < n; i += blockDim.x) {
    A param = to_acc(pp[i]), grad = to_acc(gp[i]), m = to_acc(mp[i]), v = to_acc(vp[i]),
      mx = AMS ? to_acc(xp[i]) : A(0);
    const bool unfused =
        kL2Unfused<A, ADAMW, AMS> &&
        (aten_vectorized ? (start + i) % kAtenIlp == 0 : aten_first_of_strided(start + i));
    update<A, ADAMW, AMS>(c, scaled, unfused, param, grad, m, v, mx);
    pp[i] = from_acc<T>(param);
    if (scaled) gp[i] = from_acc<T>(grad);
    mp[i] = from_acc<T>(m);
    vp[i] = from_acc<T>(v);
    if (AMS) xp[i] = from_acc<T>(mx);
  }
}

}  // namespace graft_adam

// Two blocks of 512 threads per SM (64 registers each) keep enough loads in flight. double
// needs more registers than that, and so does every type with sm_100's compiler: one block.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define GRAFT_ADAM_MIN_BLOCKS(T) 1
#else
#define GRAFT_ADAM_MIN_BLOCKS(T) (sizeof(T) == 8 ? 1 : 2)
#endif

// Entry points graft_adam_{adam,adamw}_{dtype}_{plain,ams}; src/adam.rs lists the names.
#define GRAFT_ADAM_ENTRY(MODE, ADAMW, AMSNAME, AMS, TAG, T)                                  \
  extern "C" __global__ void __launch_bounds__(512, GRAFT_ADAM_MIN_BLOCKS(T))               \
      graft_adam_##MODE##_##TAG##_##AMSNAME(const graft_adam::AdamParams p) {                 \
    graft_adam::step<T, ADAMW, AMS>(p);                                                      \
  }
#define GRAFT_ADAM_DTYPES(MODE, ADAMW, AMSNAME, AMS)           \
  GRAFT_ADAM_ENTRY(MODE, ADAMW, AMSNAME, AMS, f32, float)      \
  GRAFT_ADAM_ENTRY(MODE, ADAMW, AMSNAME, AMS, f64, double)     \
  GRAFT_ADAM_ENTRY(MODE, ADAMW, AMSNAME, AMS, f16, __half)     \
  GRAFT_ADAM_ENTRY(MODE, ADAMW, AMSNAME, AMS, bf16, __nv_bfloat16)

GRAFT_ADAM_DTYPES(adam, false, plain, false)
GRAFT_ADAM_DTYPES(adam, false, ams, true)
GRAFT_ADAM_DTYPES(adamw, true, plain, false)
GRAFT_ADAM_DTYPES(adamw, true, ams, true)

// Runs the kernels of ops/adam/adam.cu on the CPU (cuda_emu.h): every mode, dtype and AMSGrad
// variant over a list of tensors of many lengths (whole packs, odd tails, misaligned starts
// that take the scalar path, tensors spanning several blocks), with grad scale, maximize and
// found_inf, and compares every output to the bit with a host transcription of ATen's CUDA
// arithmetic (fma where ATen's SASS has FFMA, each other step rounded). Chunks are small here
// so that many blocks and tensor boundaries are exercised. Build and run with emu/run_adam.sh.
// Exit status 1 on any mismatch.

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "cuda_emu.h"
#include "../src/ops/adam/adam.cu"
#include "emu_common.h"

namespace {

using graft_adam::AdamParams;
using emu_common::checks;
using emu_common::fail;
using emu_common::launch;
using emu_common::report;

template <typename T>
using AccT = typename graft_common::Acc<T>::type;

template <typename T>
T from_f(double v) {
  return graft_common::from_acc<T>(AccT<T>(v));
}
template <typename T>
double to_d(T v) {
  return double(graft_common::to_acc(v));
}
template <typename T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// The host transcription of one element (ATen's adam_math, accumulation type A).
template <typename A, bool ADAMW, bool AMS>
void host_update(const AdamParams& p, float step, bool l2_unfused, A& param, A& grad, A& m, A& v,
                 A& mx) {
  const A lr = p.lr_ptr ? A(*p.lr_ptr) : A(p.lr);
  const A b1 = A(p.beta1), b2 = A(p.beta2), wd = A(p.weight_decay), eps = A(p.eps);
  const A bc1 = A(1) - A(std::pow(b1, A(step)));
  const A bc2s = std::sqrt(A(1) - A(std::pow(b2, A(step))));
  const A ss = lr / bc1;
  if (p.grad_scale) grad = grad / A(*p.grad_scale);
  A g = p.maximize ? -grad : grad;
  if (wd != A(0)) {
    if (ADAMW) {
      param = std::fma(-(lr * wd), param, param);
    } else if (l2_unfused) {
      g = g + param * wd;
    } else {
      g = std::fma(param, wd, g);
    }
  }
  m = std::fma(b1, m, std::fma(-b1, g, g));
  const A gg = g * g;
  v = std::fma(b2, v, std::fma(-b2, gg, gg));
  A second = v;
  if (AMS) {
    mx = (mx < v) ? v : mx;
    second = mx;
  }
  const A denom = std::sqrt(second) / bc2s + eps;
  param = param - (ss * m) / denom;
}

struct Tensor5 {
  size_t n = 0, offset = 0;
  std::vector<unsigned char> mem[5];  // param, grad, exp_avg, exp_avg_sq, max
  float step = 1;
};

template <typename T, bool ADAMW, bool AMS>
void run_case(void (*kernel)(AdamParams), const char* name, bool scaled, bool maximize,
              bool lr_on_device, bool skip) {
  std::mt19937 rng(1234);
  std::normal_distribution<double> normal(0.0, 1.0);
  const std::vector<size_t> lengths = {1, 2, 3, 7, 8, 9, 15, 16, 17, 64, 100, 129, 300, 1100, 1101};
  std::vector<Tensor5> ts;
  for (size_t i = 0; i < lengths.size() * 2; ++i) {
    Tensor5 t;
    t.n = lengths[i % lengths.size()];
    t.offset = i >= lengths.size() ? 1 : 0;  // second round: misaligned by one element
    t.step = float(1 + i * 7 % 50);
    for (int k = 0; k < 5; ++k) {
      t.mem[k].resize((t.n + t.offset) * sizeof(T) + 16);
      T* d = reinterpret_cast<T*>(t.mem[k].data()) + t.offset;
      for (size_t e = 0; e < t.n; ++e) {
        const double r = normal(rng);
        d[e] = from_f<T>(k == 3 || k == 4 ? 0.01 * std::fabs(r) : (k == 2 ? 0.1 * r : r));
      }
    }
    ts.push_back(std::move(t));
  }
  std::vector<Tensor5> ref = ts;
  const float grad_scale = 4.0f, lr_dev = 0.02f, found_inf = skip ? 1.0f : 0.0f;
  auto params = std::make_unique<AdamParams>();
  AdamParams& p = *params;
  std::memset(&p, 0, sizeof(p));
  p.lr = 0.01;
  p.beta1 = 0.9;
  p.beta2 = 0.99;
  p.weight_decay = 0.1;
  p.eps = 1e-6;
  p.lr_ptr = lr_on_device ? &lr_dev : nullptr;
  p.grad_scale = scaled ? &grad_scale : nullptr;
  p.found_inf = &found_inf;
  p.maximize = maximize;
  p.chunk = 32;  // small: many blocks per tensor
  p.ntensors = (long long)ts.size();
  long long chunks = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    void** slots[5] = {p.param, p.grad, p.exp_avg, p.exp_avg_sq, p.max_exp_avg_sq};
    for (int k = 0; k < 5; ++k)
      slots[k][i] = reinterpret_cast<T*>(ts[i].mem[k].data()) + ts[i].offset;
    p.step[i] = &ts[i].step;
    p.numel[i] = (long long)ts[i].n;
    p.first_chunk[i] = chunks;
    chunks += ((long long)ts[i].n + p.chunk - 1) / p.chunk;
  }
  p.first_chunk[ts.size()] = chunks;
  launch(kernel, unsigned(chunks), 64, 0, p);

  using A = AccT<T>;
  for (size_t i = 0; i < ref.size(); ++i) {
    Tensor5& r = ref[i];
    T* d[5];
    for (int k = 0; k < 5; ++k) d[k] = reinterpret_cast<T*>(r.mem[k].data()) + r.offset;
    // Which elements ATen computes `grad + param * weight_decay` unfused (ops/adam/adam.cu,
    // aten_first_of_strided): its path depends on the size and on the kernel's buffers.
    unsigned long long any_address = 0;
    for (int k = 0; k < (AMS ? 5 : 4); ++k)
      any_address |= reinterpret_cast<unsigned long long>(ts[i].mem[k].data() + ts[i].offset * sizeof(T));
    const bool aten_vectorized = r.n % 4 == 0 && any_address % (4 * sizeof(T)) == 0;
    for (size_t e = 0; e < r.n && !skip; ++e) {
      const bool l2_unfused = std::is_same<A, float>::value && !ADAMW && !AMS &&
                              (aten_vectorized ? e % 4 == 0 : e % 2048 < 512);
      A param = graft_common::to_acc(d[0][e]), grad = graft_common::to_acc(d[1][e]),
        m = graft_common::to_acc(d[2][e]), v = graft_common::to_acc(d[3][e]),
        mx = graft_common::to_acc(d[4][e]);
      host_update<A, ADAMW, AMS>(p, r.step, l2_unfused, param, grad, m, v, mx);
      d[0][e] = graft_common::from_acc<T>(param);
      if (scaled) d[1][e] = graft_common::from_acc<T>(grad);
      d[2][e] = graft_common::from_acc<T>(m);
      d[3][e] = graft_common::from_acc<T>(v);
      if (AMS) d[4][e] = graft_common::from_acc<T>(mx);
    }
    for (int k = 0; k < 5; ++k) {
      const T* got = reinterpret_cast<const T*>(ts[i].mem[k].data()) + ts[i].offset;
      for (size_t e = 0; e < r.n; ++e) {
        ++checks;
        if (!same_bits(got[e], d[k][e])) {
          char what[160], why[64];
          std::snprintf(what, sizeof what,
                        "%s scaled=%d max=%d lrdev=%d skip=%d tensor %zu list %d elem %zu", name,
                        scaled, maximize, lr_on_device, skip, i, k, e);
          std::snprintf(why, sizeof why, "%.9g vs %.9g", to_d(got[e]), to_d(d[k][e]));
          fail(what, why);
        }
      }
    }
  }
}

template <typename T, bool ADAMW, bool AMS>
void run_all(void (*kernel)(AdamParams), const char* name) {
  for (int flags = 0; flags < 8; ++flags)
    run_case<T, ADAMW, AMS>(kernel, name, flags & 1, flags & 2, flags & 4, false);
  run_case<T, ADAMW, AMS>(kernel, name, true, false, false, true);
}

}  // namespace

#define RUN(MODE, ADAMW, AMSNAME, AMS, TAG, T) \
  run_all<T, ADAMW, AMS>(graft_adam_##MODE##_##TAG##_##AMSNAME, "graft_adam_" #MODE "_" #TAG "_" #AMSNAME);
#define RUN_DTYPES(MODE, ADAMW, AMSNAME, AMS) \
  RUN(MODE, ADAMW, AMSNAME, AMS, f32, float)  \
  RUN(MODE, ADAMW, AMSNAME, AMS, f64, double) \
  RUN(MODE, ADAMW, AMSNAME, AMS, f16, __half) \
  RUN(MODE, ADAMW, AMSNAME, AMS, bf16, __nv_bfloat16)

int main() {
  RUN_DTYPES(adam, false, plain, false)
  RUN_DTYPES(adam, false, ams, true)
  RUN_DTYPES(adamw, true, plain, false)
  RUN_DTYPES(adamw, true, ams, true)
  return report();
}

// Runs the kernels of ops/topk_softmax/topk_softmax.cu on the CPU (cuda_emu.h): every dtype,
// the forward's register kernels at every V and its loop kernel, the backward, with and without
// renormalization, k from 1 to experts (k > 32 included), several rows per warp (grid-stride),
// exact ties (the lower expert first), rows of special values (NaN, +inf, -inf), and in the
// backward indices outside the row (skipped). Outputs are poisoned first and guard elements
// after them must stay untouched. Indices must equal a float64 reference's exactly, weights and
// gradients be within the dtype's tolerance (special values exactly). Build and run with
// emu/run_topk_softmax.sh; exit status 1 on any mismatch.

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "cuda_emu.h"
#include "../src/ops/topk_softmax/topk_softmax.cu"
#include "emu_common.h"

namespace {

using graft_topk::TopkParams;

using namespace emu_common;

// This harness's order of the dtypes (it fixes the random inputs each case gets).
const DT kTopkDtypes[] = {DT::F32, DT::F64, DT::F16, DT::BF16};

// "Device" memory: n elements of `size` bytes, then kGuard guard elements, all poisoned with
// one byte pattern; guard() says whether the guard bytes are still that pattern.
constexpr size_t kGuard = 16;
constexpr unsigned char kPoison = 0x7b;  // 0x7b7b...: no probability, index or small gradient
struct GuardedBuf {
  size_t n, size;
  std::vector<unsigned char> raw;
  GuardedBuf(size_t n_, size_t size_)
      : n(n_), size(size_), raw((n_ + kGuard) * size_ + 64, kPoison) {}
  unsigned char* base() {
    auto p = reinterpret_cast<uintptr_t>(raw.data());
    return reinterpret_cast<unsigned char*>((p + 63) / 64 * 64);
  }
  bool guard() {
    const unsigned char* g = base() + n * size;
    return std::all_of(g, g + kGuard * size, [](unsigned char c) { return c == kPoison; });
  }
};

Lcg rng{0x70bc};

// Softmax of one row in float64 with the kernels' NaN rule (one NaN makes the row NaN).
std::vector<double> ref_softmax(const double* x, int n) {
  double mx = x[0];
  for (int e = 0; e < n; ++e)
    if (x[e] > mx || std::isnan(x[e])) mx = x[e];
  std::vector<double> p(n);
  double sum = 0;
  for (int e = 0; e < n; ++e) sum += p[e] = std::exp(x[e] - mx);
  for (double& v : p) v /= sum;
  return p;
}

// The k first experts in torch.topk's order (NaN first, larger first, lower expert first).
std::vector<int> ref_order(const std::vector<double>& p, int k) {
  std::vector<int> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const bool na = std::isnan(p[a]), nb = std::isnan(p[b]);
    if (na != nb) return na;
    return !na && p[a] > p[b];
  });
  order.resize(k);
  return order;
}

bool same(double got, double want, double tol) {
  if (std::isnan(want)) return std::isnan(got);
  return std::fabs(got - want) <= tol * std::fabs(want);
}

// Logits: 0 random over [-6, 6]; 1 multiples of 0.5 in [-2, 2] (many exact ties); 2 random
// with rows of special values (a NaN, a +inf, all -inf, one -inf).
std::vector<double> fill_logits(GuardedBuf& b, DT d, long rows, int n, int mode) {
  std::vector<double> x(b.n);
  for (size_t i = 0; i < b.n; ++i) {
    double v = (rng.unit() * 2 - 1) * 6;
    if (mode == 1) v = std::round((rng.unit() * 2 - 1) * 4) / 2;
    store(d, b.base() + i * b.size, v);
    x[i] = load(d, b.base() + i * b.size);
  }
  if (mode == 2) {
    auto set = [&](long r, int e, double v) {
      if (r >= rows) return;
      store(d, b.base() + (r * n + e) * b.size, v);
      x[r * n + e] = v;
    };
    set(0, n / 2, NAN);
    set(1, n - 1, INFINITY);
    for (int e = 0; e < n; ++e) set(2, e, -INFINITY);
    set(3, 0, -INFINITY);
  }
  return x;
}

void forward_case(DT d, const std::string& variant, int n, int k, bool renormalize,
                  long rows, unsigned grid, int mode) {
  char what[256];
  std::snprintf(what, sizeof what, "fwd_%s_%s experts=%d k=%d renorm=%d rows=%ld grid=%u mode=%d",
                variant.c_str(), dt_name(d), n, k, int(renormalize), rows, grid, mode);
  const DT acc = acc_of(d);
  GuardedBuf x(size_t(rows) * n, dt_size(d)), w(size_t(rows) * k, dt_size(acc)),
      idx(size_t(rows) * k, 8);
  const std::vector<double> xs = fill_logits(x, d, rows, n, mode);
  TopkParams prm{};
  prm.logits = x.base();
  prm.weights = w.base();
  prm.indices = reinterpret_cast<long long*>(idx.base());
  prm.rows = rows;
  prm.experts = n;
  prm.k = k;
  prm.renormalize = renormalize;
  launch("graft_topk_softmax_fwd_" + variant + "_" + dt_name(d), grid, 256, 0, prm);
  ++checks;
  if (!w.guard() || !idx.guard()) return fail(what, "wrote past the outputs");
  const double tol = emu_common::tol(acc);  // the weights are in the accumulation type
  for (long r = 0; r < rows; ++r) {
    const std::vector<double> p = ref_softmax(&xs[r * n], n);
    const std::vector<int> order = ref_order(p, k);
    double sum = 0;
    for (int e : order) sum += p[e];
    for (int j = 0; j < k; ++j) {
      long long got_e;
      std::memcpy(&got_e, idx.base() + (r * k + j) * 8, 8);
      const double got_w = load(acc, w.base() + (r * k + j) * w.size);
      const double want_w = renormalize ? p[order[j]] / sum : p[order[j]];
      if (got_e != order[j] || !same(got_w, want_w, tol)) {
        char why[160];
        std::snprintf(why, sizeof why, "row %ld pick %d: expert %lld weight %.9g, expected %d %.9g", r,
                      j, got_e, got_w, order[j], want_w);
        return fail(what, why);
      }
    }
  }
}

void backward_case(DT d, int n, int k, bool renormalize, long rows, unsigned grid,
                   bool bad_index) {
  char what[256];
  std::snprintf(what, sizeof what, "bwd_%s experts=%d k=%d renorm=%d rows=%ld grid=%u bad_index=%d",
                dt_name(d), n, k, int(renormalize), rows, grid, int(bad_index));
  const DT acc = acc_of(d);
  GuardedBuf x(size_t(rows) * n, dt_size(d)), w(size_t(rows) * k, dt_size(acc)),
      idx(size_t(rows) * k, 8), g(size_t(rows) * k, dt_size(acc)), dl(size_t(rows) * n, dt_size(d));
  const std::vector<double> xs = fill_logits(x, d, rows, n, rng.unit() < 0.5 ? 0 : 1);
  // The routing the forward gives (float64), its weights rounded to the accumulation type.
  std::vector<double> ws(size_t(rows) * k), gs(size_t(rows) * k);
  std::vector<long long> is(size_t(rows) * k);
  for (long r = 0; r < rows; ++r) {
    const std::vector<double> p = ref_softmax(&xs[r * n], n);
    const std::vector<int> order = ref_order(p, k);
    double sum = 0;
    for (int e : order) sum += p[e];
    for (int j = 0; j < k; ++j) {
      const size_t i = r * k + j;
      store(acc, w.base() + i * w.size, renormalize ? p[order[j]] / sum : p[order[j]]);
      ws[i] = load(acc, w.base() + i * w.size);
      store(acc, g.base() + i * g.size, rng.unit() * 2 - 1);
      gs[i] = load(acc, g.base() + i * g.size);
      is[i] = order[j];
    }
  }
  if (bad_index) {
    is[0] = n + 5;
    if (rows > 1) is[size_t(k)] = -1;
  }
  std::memcpy(idx.base(), is.data(), is.size() * 8);
  TopkParams prm{};
  prm.logits = x.base();
  prm.weights = w.base();
  prm.indices = reinterpret_cast<long long*>(idx.base());
  prm.grad_weights = g.base();
  prm.grad_logits = dl.base();
  prm.rows = rows;
  prm.experts = n;
  prm.k = k;
  prm.renormalize = renormalize;
  launch(std::string("graft_topk_softmax_bwd_") + dt_name(d), grid, 256, 0, prm);
  ++checks;
  if (!dl.guard()) return fail(what, "wrote past the gradient");
  const double tol = d == DT::F32 ? 5e-6 : emu_common::tol(d);
  for (long r = 0; r < rows; ++r) {
    const std::vector<double> p = ref_softmax(&xs[r * n], n);
    std::vector<double> want(n, 0.0), terms(n, 0.0);
    double dot = 0;
    for (int j = 0; j < k; ++j) {
      const size_t i = r * k + j;
      const bool valid = is[i] >= 0 && is[i] < n;
      if (renormalize) dot += gs[i] * ws[i];
      else if (valid) dot += gs[i] * p[is[i]];
    }
    if (!renormalize)
      for (int e = 0; e < n; ++e) {
        want[e] = -p[e] * dot;
        terms[e] = std::fabs(p[e] * dot);
      }
    for (int j = 0; j < k; ++j) {
      const size_t i = r * k + j;
      if (is[i] < 0 || is[i] >= n) continue;
      const long long e = is[i];
      if (renormalize) {
        want[e] = ws[i] * (gs[i] - dot);
        terms[e] = std::fabs(ws[i] * gs[i]) + std::fabs(ws[i] * dot);
      } else {
        want[e] += p[e] * gs[i];
        terms[e] += std::fabs(p[e] * gs[i]);
      }
    }
    double num = 0, den = 0, scale = 0;
    for (int e = 0; e < n; ++e) {
      const double got = load(d, dl.base() + (r * n + e) * dl.size);
      if (want[e] == 0 && got != 0) {
        char why[128];
        std::snprintf(why, sizeof why, "row %ld expert %d: %.9g, expected 0", r, e, got);
        return fail(what, why);
      }
      num += (got - want[e]) * (got - want[e]);
      den += want[e] * want[e];
      scale += terms[e] * terms[e];
    }
    const double err = std::sqrt(num) / std::max(std::sqrt(den), std::sqrt(scale));
    if (den > 0 && !(err <= tol)) {
      char why[128];
      std::snprintf(why, sizeof why, "row %ld: relative error %.3e > %.0e", r, err, tol);
      return fail(what, why);
    }
  }
}

// k values for `n` experts: 1, 8, 33 (more picks than lanes) and n itself where they fit; the
// emulator switches fibers at every shuffle, so the rounds are kept few.
std::vector<int> ks_for(int n) {
  std::vector<int> ks;
  for (int k : {1, 8, 33})
    if (k <= n) ks.push_back(k);
  if (n <= 64 && std::find(ks.begin(), ks.end(), n) == ks.end()) ks.push_back(n);
  return ks;
}

}  // namespace

int main(int argc, char** argv) {
  // `--quick`: one dtype's cases (float32) and the backward of the others.
  const bool quick = emu_common::quick(argc, argv);
  struct Variant {
    std::string name;
    std::vector<int> experts;
  };
  const Variant variants[] = {
      {"v1", {1, 5, 32}}, {"v2", {33, 64}},  {"v4", {8, 128}},
      {"v8", {256}},      {"v16", {64, 512}}, {"loop", {1, 64, 1000}},
  };
  for (DT d : kTopkDtypes) {
    const bool all = !quick || d == DT::F32;
    for (const Variant& v : variants) {
      if (!all) continue;
      for (int n : v.experts) {
        for (int k : ks_for(n))
          for (bool renormalize : {false, true})
            forward_case(d, v.name, n, k, renormalize, 3, 1, 0);
        // Several rows per warp (37 rows on 16 warps), special values, ties.
        forward_case(d, v.name, n, std::min(n, 2), true, 37, 2, 0);
        if (n >= 4) forward_case(d, v.name, n, 4, false, 4, 1, 2);
        forward_case(d, v.name, n, std::min(n, 6), true, 3, 1, 1);
      }
    }
    for (int n : {1, 8, 64, 513})
      for (int k : ks_for(n))
        for (bool renormalize : {false, true}) backward_case(d, n, k, renormalize, 3, 1, k == 1);
    backward_case(d, 64, 8, true, 37, 2, false);
    backward_case(d, 64, 8, false, 37, 2, false);
  }
  return report();
}

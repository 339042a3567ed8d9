// Runs the kernels of ops/topk_sigmoid/topk_sigmoid.cu on the CPU (cuda_emu.h): every dtype, the
// forward's register kernels at every V and its loop kernel (experts 8, 64, 128, 160, 256, 384,
// 1024), with and without a bias, groups 1, 4 and 8 with several topk_groups, k from 1 to
// topk_groups * experts / groups (k > 32 included), renormalization on and off, scale 1 and
// 2.5, several rows per warp (grid-stride) and blocks of fewer than 8 warps, exact ties of
// experts and of groups (the lower index first), rows of special values (NaN, +inf, -inf); and
// the backward with repeated indices (added up) and indices outside the row (skipped). Outputs
// are poisoned first (unwritten elements show) and guard elements after them must stay
// untouched. Indices must equal a float64 reference's exactly, weights and gradients be within
// the dtype's tolerance (NaN where the reference has NaN). The inputs are made free of near
// ties (choice values or kept-group boundaries closer than float rounding can resolve, unless
// their inputs are identical), so that the float64 order is the kernels' order. Build and run
// with emu/run_topk_sigmoid.sh; exit status 1 on any mismatch.

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "cuda_emu.h"
#include "../src/ops/topk_sigmoid/topk_sigmoid.cu"
#include "emu_common.h"

namespace {

using graft_topk_sigmoid::TopkSigmoidParams;

using namespace emu_common;

// This harness's order of the dtypes (it fixes the random inputs each case gets).
const DT kTopkDtypes[] = {DT::F32, DT::F64, DT::F16, DT::BF16};

// "Device" memory: n elements of `size` bytes, then kGuard guard elements, all poisoned with
// one byte pattern; guard() says whether the guard bytes are still that pattern.
constexpr size_t kGuard = 16;
constexpr unsigned char kPoison = 0x7b;  // 0x7b7b...: no score, index, or zero gradient
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

Lcg rng{0x5167};

// The launcher's shared memory a warp (src/ops/topk_sigmoid/mod.rs, smem_per_warp).
size_t smem_per_warp(bool registers, int n, int groups, DT acc) {
  if (groups <= 1) return 0;
  return size_t((registers ? n : 0) + groups) * dt_size(acc) + size_t(groups + 7) / 8 * 8;
}

// One row's routing in float64: scores s, choice values c, group scores, and the order.
struct Route {
  std::vector<double> s, c, group_score;
  std::vector<int> kept_order;  // the groups by larger_first
  std::vector<int> order;       // the k chosen experts
};

// The CPU kernel's larger_first over `v`: NaN first, the larger value, the lower index.
bool larger_first(const std::vector<double>& v, int a, int b) {
  const bool na = std::isnan(v[a]), nb = std::isnan(v[b]);
  if (na != nb) return na;
  if (!na && v[a] != v[b]) return v[a] > v[b];
  return a < b;
}

// The two largest of group g's choice values, larger_first.
std::pair<int, int> top2(const std::vector<double>& c, int g, int gs) {
  std::vector<int> e(gs);
  std::iota(e.begin(), e.end(), g * gs);
  std::sort(e.begin(), e.end(), [&](int a, int b) { return larger_first(c, a, b); });
  return {e[0], e[1]};
}

Route route(const double* x, const double* bias, int n, int k, int groups, int topk_groups) {
  Route r;
  r.s.resize(n);
  r.c.resize(n);
  for (int e = 0; e < n; ++e) {
    r.s[e] = 1.0 / (1.0 + std::exp(-x[e]));
    r.c[e] = bias ? r.s[e] + bias[e] : r.s[e];
  }
  std::vector<int> candidates;
  const int gs = n / groups;
  if (groups == 1) {
    candidates.resize(n);
    std::iota(candidates.begin(), candidates.end(), 0);
  } else {
    r.group_score.resize(groups);
    for (int g = 0; g < groups; ++g) {
      const auto [a, b] = top2(r.c, g, gs);
      r.group_score[g] = r.c[a] + r.c[b];
    }
    r.kept_order.resize(groups);
    std::iota(r.kept_order.begin(), r.kept_order.end(), 0);
    std::sort(r.kept_order.begin(), r.kept_order.end(),
              [&](int a, int b) { return larger_first(r.group_score, a, b); });
    for (int i = 0; i < topk_groups; ++i)
      for (int e = 0; e < gs; ++e) candidates.push_back(r.kept_order[i] * gs + e);
  }
  std::sort(candidates.begin(), candidates.end(),
            [&](int a, int b) { return larger_first(r.c, a, b); });
  candidates.resize(k);
  r.order = candidates;
  return r;
}

// A case's inputs: logits in the dtype, bias in the accumulation type (as the kernels read
// them), and which logits are special values (never redrawn).
struct Inputs {
  std::vector<double> x, bias;
  std::vector<char> special;
  bool has_bias = false;
};

// Logits: mode 0 random over [-6, 6]; 1 multiples of 0.5 in [-2, 2] (many exact ties); 2
// random with rows of special values (a NaN, a +inf, all -inf, one -inf). The bias (if any):
// mode 1 multiples of 0.25 in [-0.5, 0.5], else distinct values at least 0.5 / n apart.
double draw_logit(int mode) {
  if (mode == 1) return std::round((rng.unit() * 2 - 1) * 4) / 2;
  return (rng.unit() * 2 - 1) * 6;
}

Inputs make_inputs(DT d, GuardedBuf* bb, DT acc, long rows, int n, int mode) {
  Inputs in;
  in.x.resize(size_t(rows) * n);
  in.special.assign(in.x.size(), 0);
  for (size_t i = 0; i < in.x.size(); ++i) in.x[i] = round_to(d, draw_logit(mode));
  if (mode == 2) {
    auto set = [&](long r, int e, double v) {
      if (r >= rows) return;
      in.x[r * n + e] = v;
      in.special[r * n + e] = 1;
    };
    set(0, n / 2, NAN);
    set(1, n - 1, INFINITY);
    for (int e = 0; e < n; ++e) set(2, e, -INFINITY);
    set(3, 0, -INFINITY);
  }
  if (bb) {
    in.has_bias = true;
    in.bias.resize(n);
    std::vector<int> perm(n);
    std::iota(perm.begin(), perm.end(), 0);
    for (int i = n - 1; i > 0; --i) std::swap(perm[i], perm[rng.next_u64() % (i + 1)]);
    for (int e = 0; e < n; ++e) {
      const double v = mode == 1 ? std::round((rng.unit() * 2 - 1) * 2) / 4
                                 : -0.5 + (perm[e] + 0.25 + 0.5 * rng.unit()) / n;
      in.bias[e] = round_to(acc, v);
      store(acc, bb->base() + e * bb->size, in.bias[e]);
    }
  }
  return in;
}

// Redraws logits until no two choice values of a row are closer than `delta` (and no two
// groups at the kept boundary closer than 2 delta) unless their inputs are identical: then the
// kernels' rounding cannot change the order. Returns false if that did not happen.
bool separate(Inputs& in, DT d, long rows, int n, int groups, int topk_groups, int mode,
              double delta) {
  const int gs = n / groups;
  const double* bias = in.has_bias ? in.bias.data() : nullptr;
  for (long r = 0; r < rows; ++r) {
    double* x = &in.x[r * n];
    const char* special = &in.special[r * n];
    auto same_inputs = [&](int a, int b) {
      return (x[a] == x[b] || (std::isnan(x[a]) && std::isnan(x[b]))) &&
             (!bias || bias[a] == bias[b]);
    };
    bool clean = false;
    for (int iter = 0; iter < 200 && !clean; ++iter) {
      clean = true;
      const Route rt = route(x, bias, n, 1, groups, topk_groups);
      auto redraw = [&](int a, int b) {
        const int e = !special[b] ? b : a;
        if (special[e]) return;
        x[e] = round_to(d, draw_logit(mode));
        clean = false;
      };
      std::vector<int> by(n);
      std::iota(by.begin(), by.end(), 0);
      std::sort(by.begin(), by.end(), [&](int a, int b) { return larger_first(rt.c, a, b); });
      for (int i = 0; i + 1 < n; ++i) {
        const int a = by[i], b = by[i + 1];
        if (std::isnan(rt.c[a]) || std::isnan(rt.c[b])) continue;
        if (std::fabs(rt.c[a] - rt.c[b]) <= delta && !same_inputs(a, b)) redraw(a, b);
      }
      if (groups > 1 && topk_groups < groups) {
        const int ga = rt.kept_order[topk_groups - 1], gb = rt.kept_order[topk_groups];
        const double sa = rt.group_score[ga], sb = rt.group_score[gb];
        const auto [a1, a2] = top2(rt.c, ga, gs);
        const auto [b1, b2] = top2(rt.c, gb, gs);
        const bool same = same_inputs(a1, b1) && same_inputs(a2, b2);
        if (!std::isnan(sa) && !std::isnan(sb) && std::fabs(sa - sb) <= 2 * delta && !same)
          redraw(a1, b1);
      }
    }
    if (!clean) return false;
  }
  return true;
}

bool same(double got, double want, double tol) {
  if (std::isnan(want)) return std::isnan(got);
  return std::fabs(got - want) <= tol * std::fabs(want);
}

struct Grouping {
  int groups, topk_groups;
};

struct Options {
  bool bias, renormalize;
  double scale;
};

void forward_case(DT d, const std::string& variant, int n, Grouping grp, int k, Options o,
                  long rows, unsigned grid, int warps, int mode) {
  char what[320];
  std::snprintf(what, sizeof what,
                "fwd_%s_%s experts=%d groups=%d topk_groups=%d k=%d bias=%d renorm=%d "
                "scale=%g rows=%ld grid=%u warps=%d mode=%d",
                variant.c_str(), dt_name(d), n, grp.groups, grp.topk_groups, k, int(o.bias),
                int(o.renormalize), o.scale, rows, grid, warps, mode);
  const DT acc = acc_of(d);
  GuardedBuf x(size_t(rows) * n, dt_size(d)), b(n, dt_size(acc)), w(size_t(rows) * k, dt_size(acc)),
      idx(size_t(rows) * k, 8);
  Inputs in = make_inputs(d, o.bias ? &b : nullptr, acc, rows, n, mode);
  const double delta = acc == DT::F64 ? 1e-12 : 1e-5;
  ++checks;
  if (!separate(in, d, rows, n, grp.groups, grp.topk_groups, mode, delta))
    return fail(what, "could not draw inputs without near ties");
  for (size_t i = 0; i < in.x.size(); ++i) store(d, x.base() + i * x.size, in.x[i]);
  TopkSigmoidParams prm{};
  prm.logits = x.base();
  prm.bias = o.bias ? b.base() : nullptr;
  prm.weights = w.base();
  prm.indices = reinterpret_cast<long long*>(idx.base());
  prm.rows = rows;
  prm.experts = n;
  prm.k = k;
  prm.groups = grp.groups;
  prm.topk_groups = grp.topk_groups;
  prm.renormalize = o.renormalize;
  prm.scale = o.scale;
  const size_t smem = size_t(warps) * smem_per_warp(variant != "loop", n, grp.groups, acc);
  launch("graft_topk_sigmoid_fwd_" + variant + "_" + dt_name(d), grid, 32 * warps, smem, prm);
  if (!w.guard() || !idx.guard()) return fail(what, "wrote past the outputs");
  const double tol = emu_common::tol(acc);  // the weights are in the accumulation type
  for (long r = 0; r < rows; ++r) {
    const Route rt = route(&in.x[r * n], o.bias ? in.bias.data() : nullptr, n, k, grp.groups,
                           grp.topk_groups);
    double sum = 0;
    for (int e : rt.order) sum += rt.s[e];
    for (int j = 0; j < k; ++j) {
      long long got_e;
      std::memcpy(&got_e, idx.base() + (r * k + j) * 8, 8);
      const double got_w = load(acc, w.base() + (r * k + j) * w.size);
      const double s = rt.s[rt.order[j]];
      const double want_w = (o.renormalize ? s / (sum + 1e-20) : s) * o.scale;
      if (got_e != rt.order[j] || !same(got_w, want_w, tol)) {
        char why[200];
        std::snprintf(why, sizeof why, "row %ld pick %d: expert %lld weight %.9g, expected %d %.9g",
                      r, j, got_e, got_w, rt.order[j], want_w);
        return fail(what, why);
      }
    }
  }
}

// The backward of the routing the forward gives (groups 1, no bias), with `dup` a repeated
// index and `bad` indices outside the row in the first rows.
void backward_case(DT d, int n, int k, Options o, long rows, unsigned grid, bool bad, bool dup,
                   int mode) {
  char what[256];
  std::snprintf(what, sizeof what,
                "bwd_%s experts=%d k=%d renorm=%d scale=%g rows=%ld grid=%u bad=%d dup=%d mode=%d",
                dt_name(d), n, k, int(o.renormalize), o.scale, rows, grid, int(bad), int(dup),
                mode);
  const DT acc = acc_of(d);
  GuardedBuf x(size_t(rows) * n, dt_size(d)), idx(size_t(rows) * k, 8),
      g(size_t(rows) * k, dt_size(acc)), dl(size_t(rows) * n, dt_size(d));
  Inputs in = make_inputs(d, nullptr, acc, rows, n, mode);
  for (size_t i = 0; i < in.x.size(); ++i) store(d, x.base() + i * x.size, in.x[i]);
  std::vector<double> gs(size_t(rows) * k);
  std::vector<long long> is(size_t(rows) * k);
  for (long r = 0; r < rows; ++r) {
    const Route rt = route(&in.x[r * n], nullptr, n, k, 1, 1);
    for (int j = 0; j < k; ++j) {
      const size_t i = r * k + j;
      store(acc, g.base() + i * g.size, rng.unit() * 2 - 1);
      gs[i] = load(acc, g.base() + i * g.size);
      is[i] = rt.order[j];
    }
  }
  if (dup && k >= 3) {
    // Row 0: the last pick repeats the second (twice when k >= 4); row 1: all picks one expert.
    is[k - 1] = is[1];
    if (k >= 4) is[k - 2] = is[1];
    if (rows > 1)
      for (int j = 0; j < k; ++j) is[size_t(k) + j] = is[size_t(k)];
  }
  if (bad) {
    is[0] = n + 5;
    if (rows > 1) is[size_t(k)] = -1;
  }
  std::memcpy(idx.base(), is.data(), is.size() * 8);
  TopkSigmoidParams prm{};
  prm.logits = x.base();
  prm.indices = reinterpret_cast<long long*>(idx.base());
  prm.grad_weights = g.base();
  prm.grad_logits = dl.base();
  prm.rows = rows;
  prm.experts = n;
  prm.k = k;
  prm.renormalize = o.renormalize;
  prm.scale = o.scale;
  launch(std::string("graft_topk_sigmoid_bwd_") + dt_name(d), grid, 256, 0, prm);
  ++checks;
  if (!dl.guard()) return fail(what, "wrote past the gradient");
  const double tol = d == DT::F32 ? 5e-6 : emu_common::tol(d);
  // 1 - s loses the relative precision of s where s nears 1 (the CPU kernel's formula does too):
  // an error of 4 ulps of s in it is allowed on top of tol.
  const double ulp = acc == DT::F64 ? 0x1p-53 : 0x1p-24;
  for (long r = 0; r < rows; ++r) {
    std::vector<double> s(k, 0.0), want(n, 0.0), terms(n, 0.0), budget(n, 0.0);
    std::vector<char> selected(n, 0);
    double sum = 0, dot = 0;
    for (int j = 0; j < k; ++j) {
      const long long e = is[r * k + j];
      if (e >= 0 && e < n) s[j] = 1.0 / (1.0 + std::exp(-in.x[r * n + e]));
      sum += s[j];
      dot += gs[r * k + j] * s[j];
    }
    const double den = sum + 1e-20;
    for (int j = 0; j < k; ++j) {
      const long long e = is[r * k + j];
      if (e < 0 || e >= n) continue;
      selected[e] = 1;
      const double gj = gs[r * k + j], f = s[j] * (1 - s[j]);
      const double ds =
          o.renormalize ? o.scale * (gj / den - dot / (den * den)) : o.scale * gj;
      want[e] += ds * f;
      // The size of the terms the renormalized gradient's difference cancels.
      const double parts = std::fabs(gj / den) + std::fabs(dot / (den * den));
      terms[e] += o.renormalize ? std::fabs(o.scale * f) * parts : std::fabs(ds * f);
      budget[e] += std::fabs(ds) * s[j] * 4 * ulp;
    }
    double num = 0, norm = 0, scale = 0, allowed = 0;
    for (int e = 0; e < n; ++e) {
      const double got = load(d, dl.base() + (r * n + e) * dl.size);
      char why[160];
      // Experts not selected: exactly 0. Selected ones: NaN where the reference is NaN.
      if (!selected[e] || std::isnan(want[e])) {
        if (selected[e] ? !std::isnan(got) : got != 0) {
          std::snprintf(why, sizeof why, "row %ld expert %d: %.9g, expected %.9g", r, e, got,
                        want[e]);
          return fail(what, why);
        }
        continue;
      }
      num += (got - want[e]) * (got - want[e]);
      norm += want[e] * want[e];
      scale += terms[e] * terms[e];
      allowed += budget[e] * budget[e];
    }
    const double err = std::sqrt(num), bound = tol * std::max(std::sqrt(norm), std::sqrt(scale));
    if (!(err <= bound + std::sqrt(allowed))) {
      char why[160];
      std::snprintf(why, sizeof why, "row %ld: error %.3e > %.3e (relative %.0e) + %.3e", r, err,
                    bound, tol, std::sqrt(allowed));
      return fail(what, why);
    }
  }
}

// Groupings for `n` experts: none, and 4 and 8 groups (where they leave at least 2 experts a
// group) keeping one, half and all of them.
std::vector<Grouping> groupings_for(int n) {
  std::vector<Grouping> out{{1, 1}};
  for (int g : {4, 8}) {
    if (n % g != 0 || n / g < 2) continue;
    for (int t : {1, g / 2, g}) out.push_back({g, t});
  }
  return out;
}

// k values for `candidates` selectable experts: 1, 2, 8, 33 (more picks than lanes) and the
// largest where they fit (the emulator switches fibers at every shuffle, so the rounds are kept
// few: the largest only up to 160).
std::vector<int> ks_for(int candidates) {
  std::vector<int> ks;
  for (int k : {1, 2, 8, 33})
    if (k <= candidates) ks.push_back(k);
  if (candidates <= 160 && ks.back() != candidates) ks.push_back(candidates);
  return ks;
}

// The bias, renormalization and scale combinations, taken in turn.
const Options kOptions[] = {
    {false, false, 1.0}, {true, true, 1.0}, {false, true, 2.5}, {true, false, 2.5}};

}  // namespace

int main(int argc, char** argv) {
  // `--quick`: one dtype's forward (float32) and the backward of all.
  const bool quick = emu_common::quick(argc, argv);
  struct Variant {
    std::string name;
    std::vector<int> experts;
  };
  const Variant variants[] = {
      {"v1", {8}},        {"v2", {64}},        {"v4", {128}},
      {"v8", {160, 256}}, {"v16", {64, 384}},  {"loop", {64, 1024}},
  };
  unsigned turn = 0;
  for (DT d : kTopkDtypes) {
    const bool all = !quick || d == DT::F32;
    const DT acc = acc_of(d);
    for (const Variant& v : variants) {
      if (!all) continue;
      const bool registers = v.name != "loop";
      for (int n : v.experts) {
        for (const Grouping& grp : groupings_for(n)) {
          const int candidates = grp.topk_groups * (n / grp.groups);
          // The launcher's warps a block: as many as 48 KB of shared memory hold, at most 8.
          const size_t per_warp = smem_per_warp(registers, n, grp.groups, acc);
          const int warps = per_warp == 0 ? 8 : int(std::min<size_t>(8, 49152 / per_warp));
          for (int k : ks_for(candidates))
            forward_case(d, v.name, n, grp, k, kOptions[turn++ % 4], 3, 1, warps, 0);
          // Every option once more at a middle k, then several rows per warp (37 rows on 6
          // warps of 3), ties, special values.
          const int k = std::min(candidates, 6);
          for (const Options& o : kOptions) forward_case(d, v.name, n, grp, k, o, 2, 1, warps, 0);
          forward_case(d, v.name, n, grp, k, kOptions[turn++ % 4], 37, 2, 3, 0);
          forward_case(d, v.name, n, grp, k, kOptions[turn++ % 4], 3, 1, warps, 1);
          forward_case(d, v.name, n, grp, std::min(candidates, 40), kOptions[turn++ % 4], 3, 1,
                       warps, 1);
          forward_case(d, v.name, n, grp, k, kOptions[turn++ % 4], 4, 1, warps, 2);
        }
      }
    }
    for (int n : {8, 64, 160, 1024})
      for (int k : ks_for(std::min(n, 64)))
        for (const Options& o : kOptions) backward_case(d, n, k, o, 3, 1, k == 1, k >= 3, 0);
    for (const Options& o : kOptions) {
      backward_case(d, 64, 8, o, 37, 2, false, false, 0);
      backward_case(d, 64, 8, o, 4, 1, false, false, 2);
      backward_case(d, 64, 8, o, 3, 1, true, true, 1);
    }
  }
  return report();
}

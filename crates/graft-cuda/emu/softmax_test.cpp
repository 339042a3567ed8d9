// Runs the kernels of ops/softmax/softmax.cu on the CPU (cuda_emu.h): every type pair, the rows
// kernels at every V (vector and scalar, sub-warp and multi-warp row groups, several rows per
// block, grid-stride loops, misaligned rows), the loop kernels (staged and not), the bulk
// kernels (clusters of one block), the cols kernels (several slicings of dim), softmax and
// log-softmax, forward and backward, and rows of special values. Outputs are poisoned with
// NaN first; results are compared with a float64 reference (special values exactly). Build
// and run with emu/run_softmax.sh.
// Exit status 1 on any mismatch.

#include <cstdio>
#include <string>
#include <vector>

#include "cuda_emu.h"
using std::exp;
using std::log;
#include "../src/ops/softmax/softmax.cu"
#include "emu_common.h"

namespace {

using graft_softmax::Params;

using namespace emu_common;

Lcg rng{0x5eed};

struct Shape {
  long outer, dim, inner;
  size_t numel() const { return size_t(outer * dim * inner); }
};

// The reference in float64, from the (already rounded) inputs.
void ref_forward(bool log_softmax, const std::vector<double>& x, Shape s, std::vector<double>& y) {
  y.assign(x.size(), 0);
  for (long o = 0; o < s.outer; ++o)
    for (long j = 0; j < s.inner; ++j) {
      auto at = [&](long d) { return size_t((o * s.dim + d) * s.inner + j); };
      double m = -INFINITY;
      for (long d = 0; d < s.dim; ++d) m = std::fmax(m, x[at(d)]);
      double sum = 0;
      for (long d = 0; d < s.dim; ++d) sum += std::exp(x[at(d)] - m);
      for (long d = 0; d < s.dim; ++d)
        y[at(d)] = log_softmax ? (x[at(d)] - m) - std::log(sum) : std::exp(x[at(d)] - m) / sum;
    }
}
void ref_backward(bool log_softmax, const std::vector<double>& dy, const std::vector<double>& y,
                  Shape s, std::vector<double>& dx) {
  dx.assign(dy.size(), 0);
  for (long o = 0; o < s.outer; ++o)
    for (long j = 0; j < s.inner; ++j) {
      auto at = [&](long d) { return size_t((o * s.dim + d) * s.inner + j); };
      double r = 0;
      for (long d = 0; d < s.dim; ++d) r += log_softmax ? dy[at(d)] : dy[at(d)] * y[at(d)];
      for (long d = 0; d < s.dim; ++d)
        dx[at(d)] = log_softmax ? dy[at(d)] - std::exp(y[at(d)]) * r : y[at(d)] * (dy[at(d)] - r);
    }
}

// Special values exactly, the rest within the output dtype's tolerance per reduced slice,
// relative to the slice's norm or, when larger, to the norm of the terms its values are
// differences of (`terms`, empty for the forward).
void compare(const std::string& what, DT d, Buf& out, const std::vector<double>& ref, Shape s,
             const std::vector<double>& terms) {
  ++checks;
  for (long o = 0; o < s.outer; ++o)
    for (long j = 0; j < s.inner; ++j) {
      double num = 0, den = 0, scale = 0;
      for (long dd = 0; dd < s.dim; ++dd) {
        const size_t i = size_t((o * s.dim + dd) * s.inner + j);
        const double g = out.get(i), r = ref[i];
        if (!terms.empty()) scale += terms[i] * terms[i];
        const bool special = std::isnan(r) || std::isinf(r) || r == 0;
        if (special ? !(std::isnan(r) ? std::isnan(g) : g == r) : !std::isfinite(g)) {
          char why[128];
          std::snprintf(why, sizeof why, "[%ld,%ld,%ld] = %.9g, expected %.9g", o, dd, j, g, r);
          return fail(what, why);
        }
        if (!special) {
          num += (g - r) * (g - r);
          den += r * r;
        }
      }
      const double e = std::sqrt(num) / std::max(std::sqrt(den), std::sqrt(scale));
      if (den > 0 && !(e <= tol(d))) {
        char why[128];
        std::snprintf(why, sizeof why, "slice [%ld,:,%ld] rel err %.3e > %.0e", o, j, e, tol(d));
        return fail(what, why);
      }
    }
}

struct Pair {
  const char* tag;
  DT in, out;
};
const Pair kFwd[] = {{"f32", DT::F32, DT::F32}, {"f64", DT::F64, DT::F64}, {"f16", DT::F16, DT::F16},
                     {"bf16", DT::BF16, DT::BF16}, {"f16_f32", DT::F16, DT::F32}};
const Pair kBwd[] = {{"f32", DT::F32, DT::F32}, {"f64", DT::F64, DT::F64}, {"f16", DT::F16, DT::F16},
                     {"bf16", DT::BF16, DT::BF16}, {"f32_f16", DT::F32, DT::F16}};

// A launch: kernel name and shape parameters.
struct Launch {
  std::string name;
  unsigned grid, block;
  long tpr, rpb;
  bool vec, stage;
  size_t smem;
};

// Inputs: random values of a few magnitudes (x spread over [-8, 8], so exponentials span a
// wide range), optionally rows of special values.
std::vector<double> random_input(Buf& b, double spread) {
  std::vector<double> v(b.n);
  for (size_t i = 0; i < b.n; ++i) {
    b.set(i, (rng.unit() * 2 - 1) * spread);
    v[i] = b.get(i);
  }
  return v;
}

void run_case(bool backward, const Pair& p, bool log_softmax, Shape s, const Launch& l,
              size_t offset, int special) {
  const size_t n = s.numel();
  char what[256];
  std::snprintf(what, sizeof what, "%s %s %s outer=%ld dim=%ld inner=%ld grid=%u block=%u tpr=%ld rpb=%ld stage=%d off=%zu special=%d",
                l.name.c_str(), log_softmax ? "log" : "softmax", backward ? "bwd" : "fwd", s.outer, s.dim, s.inner, l.grid,
                l.block, l.tpr, l.rpb, int(l.stage), offset, special);
  Params prm{};
  prm.outer = s.outer;
  prm.dim = s.dim;
  prm.inner = s.inner;
  prm.tpr = l.tpr;
  prm.rpb = l.rpb;
  prm.vec = l.vec;
  prm.log = log_softmax;
  prm.stage = l.stage;
  std::vector<double> ref;
  if (!backward) {
    Buf x(p.in, n, offset), y(p.out, n, offset);
    std::vector<double> xv = random_input(x, 8);
    if (special) {
      // Row 0: NaN (1), +inf (2), all -inf (3), some -inf (4) along the reduced dim.
      for (long d = 0; d < s.dim; ++d) {
        const size_t i = size_t(d * s.inner);
        double v = xv[i];
        if (special == 1 && d == s.dim / 2) v = NAN;
        if (special == 2 && d == s.dim - 1) v = INFINITY;
        if (special == 3) v = -INFINITY;
        if (special == 4 && d % 3 == 1) v = -INFINITY;
        x.set(i, v);
        xv[i] = x.get(i);
      }
    }
    y.poison();
    prm.in0 = x.base();
    prm.out = y.base();
    launch(l.name, l.grid, l.block, l.smem, prm);
    ref_forward(log_softmax, xv, s, ref);
    compare(what, p.out, y, ref, s, {});
  } else {
    Buf dy(p.in, n, offset), y(p.in, n, offset), dx(p.out, n, offset);
    std::vector<double> dyv = random_input(dy, 1), x(n), yv(n);
    for (size_t i = 0; i < n; ++i) x[i] = (rng.unit() * 2 - 1) * 4;
    ref_forward(log_softmax, x, s, yv);
    for (size_t i = 0; i < n; ++i) {
      y.set(i, yv[i]);
      yv[i] = y.get(i);
    }
    dx.poison();
    prm.in0 = dy.base();
    prm.in1 = y.base();
    prm.out = dx.base();
    launch(l.name, l.grid, l.block, l.smem, prm);
    ref_backward(log_softmax, dyv, yv, s, ref);
    // dx is a difference of two terms: dy and exp(y) * r (log-softmax), y * dy and y * r.
    std::vector<double> terms(n);
    for (long o = 0; o < s.outer; ++o)
      for (long j = 0; j < s.inner; ++j) {
        auto at = [&](long d) { return size_t((o * s.dim + d) * s.inner + j); };
        double r = 0;
        for (long d = 0; d < s.dim; ++d) r += log_softmax ? dyv[at(d)] : dyv[at(d)] * yv[at(d)];
        for (long d = 0; d < s.dim; ++d) {
          const size_t i = at(d);
          terms[i] = log_softmax ? std::fabs(dyv[i]) + std::exp(yv[i]) * std::fabs(r)
                                 : std::fabs(yv[i]) * (std::fabs(dyv[i]) + std::fabs(r));
        }
      }
    compare(what, p.out, dx, ref, s, terms);
  }
}

// The rows kernels' launch bounds (ops/softmax/softmax.cu RowsBounds).
int rows_max(bool backward, size_t size, int v, bool vec) {
#define B(BWD, SIZE, V, VEC)                                                         \
  if (backward == BWD && size == SIZE && v == V && vec == VEC)                       \
    return graft_softmax::RowsBounds<BWD, SIZE, V, VEC>::threads;
  B(false, 4, 1, true) B(false, 4, 2, true) B(false, 4, 4, true) B(false, 4, 8, true)
  B(false, 4, 1, false) B(false, 4, 2, false) B(false, 2, 1, true) B(false, 2, 2, true)
  B(false, 2, 4, true) B(false, 2, 8, true) B(false, 2, 1, false) B(false, 2, 2, false)
  B(false, 8, 1, true) B(false, 8, 2, true) B(false, 8, 4, true) B(false, 8, 8, true)
  B(false, 8, 1, false) B(false, 8, 2, false) B(true, 4, 1, true) B(true, 4, 2, true)
  B(true, 4, 4, true) B(true, 4, 8, true) B(true, 4, 1, false) B(true, 4, 2, false)
  B(true, 2, 1, true) B(true, 2, 2, true) B(true, 2, 4, true) B(true, 2, 1, false)
  B(true, 2, 2, false) B(true, 8, 1, true) B(true, 8, 2, true) B(true, 8, 4, true)
  B(true, 8, 8, true) B(true, 8, 1, false) B(true, 8, 2, false)
#undef B
  return 0;
}

void rows_cases(bool backward, const Pair& p) {
  const char* dir = backward ? "bwd" : "fwd";
  const long N = long(16 / dt_size(p.in));
  const long widths[] = {1, 2, 3, 7, 8, 9, 16, 31, 33, 64, 100, 256, 257, 1000, 2048};
  for (long cols : widths) {
    for (bool vec : {true, false}) {
      if (vec && cols % N != 0) continue;
      for (int v : {1, 2, 4, 8}) {
        const int maxt = rows_max(backward, dt_size(p.in), v, vec);
        if (maxt == 0) continue;
        const long nunits = (cols + N - 1) / N;
        const unsigned tpr = group_threads((nunits + v - 1) / v);
        if (long(tpr) > maxt || (tpr > 256 && cols < 1000)) continue;
        // Row groups per block: fill a warp at least; a few rows so blocks loop.
        const unsigned per_warp = tpr < 32 ? 32 / tpr : 1;
        unsigned rpb = per_warp * (tpr <= 64 ? 2 : 1);
        while (rpb > per_warp && tpr * rpb > unsigned(maxt)) rpb -= per_warp;
        const long rows = 3 * rpb + 1;  // the last set partly empty
        for (bool log_softmax : {false, true}) {
          Launch l{std::string("graft_softmax_") + dir + "_rows_" + (vec ? "v" : "s") +
                       std::to_string(v) + "_" + p.tag,
                   2, tpr * rpb, long(tpr), long(rpb), vec, false, 0};
          run_case(backward, p, log_softmax, Shape{rows, cols, 1}, l, 0, 0);
          if (!vec) run_case(backward, p, log_softmax, Shape{rows, cols, 1}, l, 1, 0);
          if (!backward && v == 1 && cols >= 3)
            for (int sp = 1; sp <= 4; ++sp) run_case(backward, p, log_softmax, Shape{rows, cols, 1}, l, 0, sp);
        }
      }
    }
  }
}

void loop_cases(bool backward, const Pair& p) {
  const char* dir = backward ? "bwd" : "fwd";
  const long N = long(16 / dt_size(p.in));
  const long widths[] = {1, 5, 64, 999, 1000, 4100};
  for (long cols : widths) {
    for (bool vec : {true, false}) {
      if (vec && cols % N != 0) continue;
      for (bool stage : {false, true}) {
        for (unsigned block : {64u, 256u}) {
          const long nunits = (cols + N - 1) / N;
          const size_t smem = stage ? size_t(nunits) * 16 * (backward ? 2 : 1) : 0;
          for (bool log_softmax : {false, true}) {
            Launch l{std::string("graft_softmax_") + dir + "_loop_" + p.tag, 2, block, block, 1,
                     vec, stage, smem};
            run_case(backward, p, log_softmax, Shape{3, cols, 1}, l, vec ? 0 : 1, 0);
            if (!backward && block == 64 && cols >= 5)
              for (int sp = 1; sp <= 4; ++sp) run_case(backward, p, log_softmax, Shape{3, cols, 1}, l, 0, sp);
          }
        }
      }
    }
  }
}

// The bulk kernels with clusters of one block, the emulator's: the persistent walk over rows
// (grids smaller and larger than the rows), the two buffers and the copies into them, y by
// the threads' stores or (bulk1s) by bulk copy, rows of special values. The exchange between
// the blocks of a cluster runs on a GPU only (tests/grafts/softmax/test_native_softmax_cuda.py).
extern "C" void graft_softmax_fwd_bulk1_f16(const Params p) {
  graft_softmax::fwd_bulk<__half, 1, false>(p);
}
extern "C" void graft_softmax_fwd_bulk1_bf16(const Params p) {
  graft_softmax::fwd_bulk<__nv_bfloat16, 1, false>(p);
}
extern "C" void graft_softmax_fwd_bulk1s_f16(const Params p) {
  graft_softmax::fwd_bulk<__half, 1, true>(p);
}
extern "C" void graft_softmax_fwd_bulk1s_bf16(const Params p) {
  graft_softmax::fwd_bulk<__nv_bfloat16, 1, true>(p);
}
extern "C" void graft_softmax_bwd_bulk1_f16(const Params p) { graft_softmax::bwd_bulk<__half, 1>(p); }
extern "C" void graft_softmax_bwd_bulk1_bf16(const Params p) {
  graft_softmax::bwd_bulk<__nv_bfloat16, 1>(p);
}

void bulk_cases(bool backward, const Pair& p) {
  if (p.in != p.out || dt_size(p.in) != 2) return;
  const char* dir = backward ? "bwd" : "fwd";
  for (long cols : {8L, 64L, 1000L, 4104L}) {
    for (long rows : {1L, 3L, 7L}) {
      for (unsigned grid : {1u, 2u, 3u, 9u}) {
        for (unsigned block : {64u, 256u}) {
          // Two buffers of x, or of dy and y.
          const size_t smem = size_t(cols / 8) * 16 * 2 * (backward ? 2 : 1);
          for (const char* kind : {"_bulk1_", "_bulk1s_"}) {
            if (backward && std::string(kind) == "_bulk1s_") continue;
            for (bool log_softmax : {false, true}) {
              Launch l{std::string("graft_softmax_") + dir + kind + p.tag, grid, block, block, 1,
                       true, true, smem};
              run_case(backward, p, log_softmax, Shape{rows, cols, 1}, l, 0, 0);
              if (!backward && grid == 2 && block == 64)
                for (int sp = 1; sp <= 4; ++sp)
                  run_case(backward, p, log_softmax, Shape{rows, cols, 1}, l, 0, sp);
            }
          }
        }
      }
    }
  }
}

void cols_cases(bool backward, const Pair& p) {
  const char* dir = backward ? "bwd" : "fwd";
  const Shape shapes[] = {{2, 3, 5}, {1, 7, 33}, {3, 100, 2}, {2, 1, 4}, {1, 300, 64}, {5, 9, 3}};
  for (Shape s : shapes) {
    const long bx = std::min<long>(32, group_threads(s.inner));
    for (long by : {1L, 4L, 256L / bx}) {
      for (bool log_softmax : {false, true}) {
        Launch l{std::string("graft_softmax_") + dir + "_cols_" + p.tag, 3, unsigned(bx * by), bx, by,
                 false, false, 0};
        run_case(backward, p, log_softmax, s, l, 0, 0);
        if (!backward && s.dim >= 3)
          for (int sp = 1; sp <= 4; ++sp) run_case(backward, p, log_softmax, s, l, 0, sp);
      }
    }
  }
}

}  // namespace

int main() {
  for (const Pair& p : kFwd) {
    rows_cases(false, p);
    loop_cases(false, p);
    bulk_cases(false, p);
    cols_cases(false, p);
  }
  for (const Pair& p : kBwd) {
    rows_cases(true, p);
    loop_cases(true, p);
    bulk_cases(true, p);
    cols_cases(true, p);
  }
  return report();
}

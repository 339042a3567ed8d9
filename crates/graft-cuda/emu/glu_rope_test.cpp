// Runs the kernels of ops/glu/glu.cu and ops/rope/rope.cu on the CPU (cuda_emu.h) and compares
// them with float64 references: every activation, dtype and direction of the gated linear units
// (packed and one-element paths, grid-stride loops, outputs aliasing the inputs as the in-place
// backward uses them), SwiGLU over packed rows [gate | up] (the same, with row lengths that are
// and are not multiples of the pack size), and RoPE over strided q/k with GQA, broadcast tables, partial rotary dims,
// both directions and both unit sizes. Outputs are poisoned with NaN first.
// Build and run with emu/run_glu_rope.sh. Exit status 1 on any mismatch.

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda_emu.h"

// CUDA math functions the kernels call, as host functions (the emulator checks indexing and
// numerics, not the SFU's approximations).
using std::erfc;
using std::exp;
using std::fabs;
inline float expf(float x) { return std::exp(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline double __drcp_rn(double b) { return 1.0 / b; }
inline float normcdf(float x) { return 0.5f * std::erfc(-x * 0.70710678f); }
inline double normcdf(double x) { return 0.5 * std::erfc(-x * 0.7071067811865476); }

#include "../src/ops/glu/glu.cu"
#include "../src/ops/rope/rope.cu"
#include "emu_common.h"

namespace {

using namespace emu_common;

Lcg rng{0x2545F4914F6CDD1Dull};

// ||out - ref|| / ||ref|| <= slack * tol(d) (||out - ref|| where ref is all zeros), out finite.
void check(const std::string& what, DT d, const std::vector<double>& out,
           const std::vector<double>& ref, double slack = 1) {
  check_close(what, out, ref, {.tol = slack * tol(d)});
}

// ------------------------------------------------------------------------------------ GLU

const char* kActs[] = {"silu", "gelu_tanh", "gelu_erf"};

// (act(x), act'(x)) in double.
void act_ref(int act, double x, double& f, double& df) {
  if (act == 0) {
    const double s = 1 / (1 + std::exp(-x));
    f = x * s;
    df = s * (1 + x * (1 - s));
  } else if (act == 1) {
    const double k0 = std::sqrt(2 / M_PI), k1 = 0.044715;
    const double t = std::tanh(k0 * (x + k1 * x * x * x));
    f = 0.5 * x * (1 + t);
    df = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k0 * (1 + 3 * k1 * x * x);
  } else {
    const double cdf = 0.5 * std::erfc(-x / std::sqrt(2.0));
    f = x * cdf;
    df = cdf + x * std::exp(-0.5 * x * x) / std::sqrt(2 * M_PI);
  }
}

void glu_case(int act, DT d, size_t n, bool vec, bool in_place) {
  const size_t es = dt_size(d);
  Mem g(n * es), u(n * es), dy(n * es), y(n * es), dg(n * es), du(n * es);
  const auto gv = fill(rng, d, g.p, n, 3), uv = fill(rng, d, u.p, n, 1),
             dv = fill(rng, d, dy.p, n, 1);
  std::vector<double> y_ref(n), dg_ref(n), du_ref(n);
  for (size_t i = 0; i < n; ++i) {
    double f, df;
    act_ref(act, gv[i], f, df);
    y_ref[i] = f * uv[i];
    dg_ref[i] = dv[i] * uv[i] * df;
    du_ref[i] = dv[i] * f;
  }
  const std::string tag = std::string(kActs[act]) + "_" + dt_name(d);
  const std::string what = tag + " n=" + std::to_string(n) + (vec ? " vec" : " one") +
                           (in_place ? " in-place" : "");
  const long long work = vec ? (long long)(n / (16 / es)) : (long long)n;
  const unsigned grid = unsigned(std::min<long long>(3, (work + 63) / 64 + 0));
  graft_glu::GluParams p{g.p, u.p, nullptr, y.p, nullptr, (long long)n, vec ? 1 : 0};
  poison(d, y.p, n);
  launch("graft_glu_fwd_" + tag, std::max(grid, 1u), 64, 0, p);
  check("glu fwd " + what, d, read(d, y.p, n), y_ref);
  // Backward, into fresh buffers or over gate and up themselves.
  unsigned char* out0 = in_place ? g.p : dg.p;
  unsigned char* out1 = in_place ? u.p : du.p;
  if (!in_place) {
    poison(d, dg.p, n);
    poison(d, du.p, n);
  }
  graft_glu::GluParams b{g.p, u.p, dy.p, out0, out1, (long long)n, vec ? 1 : 0};
  launch("graft_glu_bwd_" + tag, std::max(grid, 1u), 64, 0, b);
  check("glu bwd dgate " + what, d, read(d, out0, n), dg_ref, 2);
  check("glu bwd dup " + what, d, read(d, out1, n), du_ref);
}

// SwiGLU over packed rows [gate | up] (cols each): forward into y, backward into a packed
// gradient or over gate_up itself (the in-place backward).
void glu_packed_case(DT d, size_t rows, size_t cols, bool vec, bool in_place) {
  const size_t es = dt_size(d), n = rows * cols;
  Mem gu(2 * n * es), dy(n * es), y(n * es), dgu(2 * n * es);
  const auto gv = fill(rng, d, gu.p, 2 * n, 3), dv = fill(rng, d, dy.p, n, 1);
  std::vector<double> y_ref(n), dgu_ref(2 * n);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t j = 0; j < cols; ++j) {
      const double g = gv[r * 2 * cols + j], u = gv[r * 2 * cols + cols + j], dd = dv[r * cols + j];
      double f, df;
      act_ref(0, g, f, df);
      y_ref[r * cols + j] = f * u;
      dgu_ref[r * 2 * cols + j] = dd * u * df;
      dgu_ref[r * 2 * cols + cols + j] = dd * f;
    }
  }
  const std::string tag = std::string("silu_") + dt_name(d);
  const std::string what = tag + " rows=" + std::to_string(rows) + " cols=" +
                           std::to_string(cols) + (vec ? " vec" : " one") +
                           (in_place ? " in-place" : "");
  const long long work = vec ? (long long)(n / (16 / es)) : (long long)n;
  const unsigned grid = unsigned(std::min<long long>(3, (work + 63) / 64));
  graft_glu::GluPackedParams p{gu.p, nullptr, y.p, (long long)rows, (long long)cols, vec ? 1 : 0};
  poison(d, y.p, n);
  launch("graft_glu_packed_fwd_" + tag, std::max(grid, 1u), 64, 0, p);
  check("glu packed fwd " + what, d, read(d, y.p, n), y_ref);
  unsigned char* out = in_place ? gu.p : dgu.p;
  if (!in_place) poison(d, dgu.p, 2 * n);
  graft_glu::GluPackedParams b{gu.p, dy.p, out, (long long)rows, (long long)cols, vec ? 1 : 0};
  launch("graft_glu_packed_bwd_" + tag, std::max(grid, 1u), 64, 0, b);
  // dgate and dup interleaved by rows: dgate's slack (two roundings) bounds the pair's.
  check("glu packed bwd " + what, d, read(d, out, 2 * n), dgu_ref, 2);
}

void glu_packed_all() {
  for (DT d : kDtypes) {
    const size_t pack = 16 / dt_size(d);
    for (size_t rows : {size_t(1), size_t(3), size_t(37)}) {
      for (size_t cols : {size_t(1), size_t(7), pack, 3 * pack + 1, 2 * pack, size_t(96),
                          size_t(768 + 1)}) {
        for (bool in_place : {false, true}) {
          glu_packed_case(d, rows, cols, false, in_place);
          if (cols % pack == 0) glu_packed_case(d, rows, cols, true, in_place);
        }
      }
    }
  }
}

void glu_all() {
  for (int act = 0; act < 3; ++act) {
    for (DT d : kDtypes) {
      const size_t pack = 16 / dt_size(d);
      for (size_t n : {size_t(1), size_t(7), pack, 3 * pack + 1, size_t(1000), size_t(4096 + 8)}) {
        const bool can_vec = n % pack == 0;
        for (bool in_place : {false, true}) {
          glu_case(act, d, n, false, in_place);
          if (can_vec) glu_case(act, d, n, true, in_place);
        }
      }
    }
  }
}

// ----------------------------------------------------------------------------------- RoPE

struct RopeCase {
  long b, s, hq, hk, d, r;
};

// Reference rotation of row x (head_dim d, rotary r) with table rows c, sn.
void rope_row(const double* x, const double* c, const double* sn, long d, long r, bool bwd,
              double* out) {
  const long h = r / 2;
  for (long j = 0; j < d; ++j) {
    if (j >= r) {
      out[j] = x[j];
    } else if (j < h) {
      out[j] = bwd ? x[j] * c[j] + x[j + h] * sn[j + h] : x[j] * c[j] - x[j + h] * sn[j];
    } else {
      out[j] = bwd ? x[j] * c[j] - x[j - h] * sn[j - h] : x[j] * c[j] + x[j - h] * sn[j];
    }
  }
}

void rope_case(const RopeCase& c, DT d, bool bwd, bool vec) {
  const size_t es = dt_size(d);
  // q and k: (B, S, H, D) projections read as (B, H, S) rows in memory order (B, S, H), with
  // a spare element after each head when `vec` is off (rows not 16-byte aligned).
  const long row = vec ? c.d : c.d + 1;
  Mem q(c.b * c.s * c.hq * row * es), k(c.b * c.s * c.hk * row * es);
  Mem qo(c.b * c.s * c.hq * c.d * es), ko(c.b * c.s * c.hk * c.d * es);
  Mem cs(c.b * c.s * c.r * es), sn(c.b * c.s * c.r * es);
  const auto qv = fill(rng, d, q.p, c.b * c.s * c.hq * row, 1);
  const auto kv = fill(rng, d, k.p, c.b * c.s * c.hk * row, 1);
  const auto cv = fill(rng, d, cs.p, c.b * c.s * c.r, 1);
  const auto sv = fill(rng, d, sn.p, c.b * c.s * c.r, 1);
  poison(d, qo.p, c.b * c.s * c.hq * c.d);
  poison(d, ko.p, c.b * c.s * c.hk * c.d);
  const long pack = vec ? long(16 / es) : 1;
  auto operand = [&](const Mem& x, const Mem& out, long heads) {
    graft_rope::RopeOperand o{};
    o.x = x.p;
    o.out = out.p;
    // Leading dims in memory order (B, S, H); the output follows the same order.
    o.sizes[0] = c.b; o.sizes[1] = c.s; o.sizes[2] = heads;
    o.x_strides[0] = c.s * heads * row; o.x_strides[1] = heads * row; o.x_strides[2] = row;
    o.cos_strides[0] = c.s * c.r; o.cos_strides[1] = c.r; o.cos_strides[2] = 0;
    for (int i = 0; i < 3; ++i) o.sin_strides[i] = o.cos_strides[i];
    o.head_dim = c.d;
    o.units = c.b * c.s * heads * ((c.r / 2 + c.d - c.r) / pack);
    return o;
  };
  graft_rope::RopeParams p{};
  p.op[0] = operand(q, qo, c.hq);
  p.op[1] = operand(k, ko, c.hk);
  p.cos = cs.p;
  p.sin = sn.p;
  p.rotary_dim = c.r;
  const long long units = p.op[0].units + p.op[1].units;
  const std::string name = std::string("graft_rope_") + (bwd ? "bwd" : "fwd") + "_" +
                           (vec ? "vec" : "one") + "_" + dt_name(d);
  launch(name, unsigned(std::min<long long>(3, (units + 63) / 64)), 64, 0, p);
  // References, row by row in the output's order.
  for (int which = 0; which < 2; ++which) {
    const long heads = which == 0 ? c.hq : c.hk;
    const auto& xv = which == 0 ? qv : kv;
    std::vector<double> ref(c.b * c.s * heads * c.d);
    for (long bi = 0; bi < c.b; ++bi)
      for (long si = 0; si < c.s; ++si)
        for (long hi = 0; hi < heads; ++hi) {
          const long r = (bi * c.s + si) * heads + hi;
          const double* tc = &cv[(bi * c.s + si) * c.r];
          const double* ts = &sv[(bi * c.s + si) * c.r];
          rope_row(&xv[r * row], tc, ts, c.d, c.r, bwd, &ref[r * c.d]);
        }
    const std::string what = name + " " + (which ? "k" : "q") + " d=" + std::to_string(c.d) +
                             " r=" + std::to_string(c.r) + " h=" + std::to_string(heads);
    check(what, d, read(d, which == 0 ? qo.p : ko.p, ref.size()), ref);
  }
}

void rope_all() {
  const RopeCase cases[] = {
      {2, 3, 4, 2, 64, 64}, {1, 5, 3, 1, 128, 128}, {2, 2, 2, 2, 2, 2},
      {1, 3, 4, 2, 6, 6},   {2, 3, 2, 1, 96, 64},   {1, 2, 8, 1, 80, 32},
      {1, 0, 2, 2, 16, 16},
  };
  for (const RopeCase& c : cases) {
    for (DT d : kDtypes) {
      const long pack = long(16 / dt_size(d));
      const bool can_vec = (c.r / 2) % pack == 0 && (c.d - c.r) % pack == 0 && c.d % pack == 0;
      for (bool bwd : {false, true}) {
        rope_case(c, d, bwd, false);
        if (can_vec) rope_case(c, d, bwd, true);
      }
    }
  }
}

}  // namespace

int main() {
  glu_all();
  glu_packed_all();
  rope_all();
  return report();
}

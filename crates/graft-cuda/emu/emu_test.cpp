// Runs the kernels of ops/rms_norm/rms_norm.cu on the CPU (cuda_emu.h) over many shapes and
// launch configurations (every V of every rows kernel, vector and scalar paths, sub-warp
// and multi-warp row groups, several rows per block, grid-stride loops, the loop kernels,
// dx/dw modes, the weight modes of torchgraft::rms_norm) and compares with a float64
// reference; the forward is also checked bit for bit against the same steps replayed in the
// accumulation type from the kernel's own rstd. Outputs are poisoned with NaN first.
// Build and run with emu/run.sh. Exit status 1 on any mismatch.

#include <cstdio>
#include <string>

#include "cuda_emu.h"
#include "../src/ops/rms_norm/rms_norm.cu"
#include "emu_common.h"

namespace {

using namespace emu_common;

enum class WK { None, Same, Acc };
const char* wk_name(WK w) { return w == WK::None ? "none" : w == WK::Same ? "same" : "acc"; }

Lcg rng{0x1234567};
double signed_value() {
  const double m = 0.25 + 1.75 * rng.unit();
  return rng.unit() < 0.5 ? m : -m;
}

// RMSNorm's float32 outputs are held to 1e-6 (emu_common's tol: 2e-6).
double rms_tol(DT d) { return d == DT::F32 ? 1e-6 : tol(d); }

// The weight mode (graft::FwdParams offset / round_first): scale by (offset + w), and round
// xhat to the dtype before the weight multiply.
struct Mode {
  double offset = 0;
  bool round_first = false;
};

// The offset as the launcher passes it: 0 as -0.0 (adds exactly nothing).
double kernel_offset(const Mode& m) { return m.offset == 0 ? -0.0 : m.offset; }

// xhat as the weight multiply sees it, computed as the kernels do: x * r in the accumulation
// type, rounded to the dtype when round_first.
double pre_weight(DT d, double x, double r, bool round_first) {
  const double xhat = acc_of(d) == DT::F64 ? x * r : double(float(x) * float(r));
  return round_first ? round_to(d, xhat) : xhat;
}

// One output of the forward, replayed step by step in the accumulation type.
double forward_exact(DT d, double x, double r, bool has_w, double w, const Mode& m) {
  if (acc_of(d) == DT::F64) {
    double v = x * r;
    if (has_w) v = v * (w + kernel_offset(m));
    return v;
  }
  float v = float(x) * float(r);
  if (has_w) {
    if (m.round_first) v = float(round_to(d, v));
    v = v * (float(w) + float(kernel_offset(m)));
  }
  return round_to(d, v);
}

// ||out - ref|| / max(||ref||, scale) <= rms_tol(d). `scale` is the size the output has when
// its terms do not cancel (dx: ||rstd * g||; dw: the typical size of a sum of random-sign
// terms): where they cancel (cols == 1: dx ~ eps; a dw column summing to nearly 0) the
// relative error grows in any precision and is measured against that size instead.
void check(const std::string& what, DT d, const std::vector<double>& out,
           const std::vector<double>& ref, double scale = 0) {
  check_close(what, out, ref, {.tol = rms_tol(d), .scale = scale});
}

struct Config {
  std::string name;  // kernel
  long tpr = 0, rpb = 1;
  unsigned block = 0, grid = 0;
  size_t smem = 0;
  bool vec = false;
};

// Rows-kernel configs for every V in the table plus the loop kernel.
std::vector<Config> configs(bool fwd, DT d, WK w, long rows, long cols, bool vec) {
  const char* dir = fwd ? "fwd" : "bwd";
  const unsigned ve = 16 / dt_size(d);
  const unsigned long nunits = (cols + ve - 1) / ve;
  std::vector<std::pair<unsigned, unsigned>> table;
  if (fwd) {
    table = vec ? std::vector<std::pair<unsigned, unsigned>>{{1, 512}, {2, 512}, {4, 512}, {8, 512}, {16, 256}}
                : std::vector<std::pair<unsigned, unsigned>>{{1, 512}, {4, 512}};
  } else {
    table = vec ? std::vector<std::pair<unsigned, unsigned>>{{1, 512}, {2, 512}, {4, 512}, {8, 256}}
                : std::vector<std::pair<unsigned, unsigned>>{{1, 512}, {2, 512}};
  }
  const WK wn = (w == WK::Acc && (d == DT::F32 || d == DT::F64)) ? WK::Same : w;
  std::vector<Config> out;
  for (auto [v, maxt] : table) {
    const unsigned tpr = group_threads((nunits + v - 1) / v);
    if (tpr > maxt) continue;
    // Up to 128 threads per block, whole warps, at most the rows needed.
    const long per_warp = tpr < 32 ? 32 / tpr : 1;
    long rpb = std::max<long>(1, 128 / tpr);
    rpb = std::min<long>(rpb, (rows + per_warp - 1) / per_warp * per_warp);
    rpb = (rpb + per_warp - 1) / per_warp * per_warp;
    Config c;
    c.name = std::string("graft_rms_") + dir + "_rows_" + dt_name(d) + "_" + wk_name(wn) + "_" +
             (vec ? "v" : "s") + std::to_string(v);
    c.tpr = tpr;
    c.rpb = rpb;
    c.block = unsigned(tpr * rpb);
    const long sets = (rows + rpb - 1) / rpb;
    c.grid = unsigned(std::min<long>(sets, 2));  // grid-stride loops when sets > 2
    c.vec = vec;
    if (!fwd) c.smem = size_t(rpb - 1) * tpr * v * ve * dt_size(acc_of(d));
    out.push_back(c);
  }
  Config l;
  l.name = std::string("graft_rms_") + dir + "_loop_" + dt_name(d) + "_" + wk_name(wn);
  l.block = 64;
  l.tpr = 64;
  l.grid = unsigned(std::min<long>(rows, 2));
  l.vec = vec;
  out.push_back(l);
  if (!fwd) {
    l.smem = size_t(cols) * dt_size(acc_of(d));  // the dw partial row in shared memory
    out.push_back(l);
  }
  return out;
}

void run_case(DT d, WK w, long rows, long cols, bool offset, Mode mode = {}) {
  const DT acc = acc_of(d);
  const bool has_w = w != WK::None;
  const DT wd = w == WK::Acc ? acc : d;
  const size_t es = dt_size(d), as = dt_size(acc), ws = dt_size(wd);
  const size_t n = size_t(rows) * cols;
  const size_t off = offset ? 1 : 0;
  const double eps = 1e-6;

  std::vector<double> x(n), dy(n), wv(cols, 1.0);
  for (auto& v : x) v = round_to(d, signed_value());
  for (auto& v : dy) v = round_to(d, signed_value());
  if (has_w)
    for (auto& v : wv) v = round_to(wd, 0.5 + rng.unit());

  Mem X((n + 1) * es), Y((n + 1) * es), DY((n + 1) * es), DX((n + 1) * es);
  Mem W((cols + 1) * 8), DW((cols + 1) * 8), R((rows + 1) * 8);
  for (size_t i = 0; i < n; ++i) {
    store(d, X.p + (off + i) * es, x[i]);
    store(d, DY.p + (off + i) * es, dy[i]);
  }
  for (long j = 0; j < cols; ++j) store(wd, W.p + (off + j) * ws, wv[j]);

  // Reference.
  std::vector<double> yref(n), rref(rows), dxref(n), dwref(cols, 0.0);
  for (long r = 0; r < rows; ++r) {
    double ss = 0;
    for (long j = 0; j < cols; ++j) ss += x[r * cols + j] * x[r * cols + j];
    const double rs = 1.0 / std::sqrt(ss / cols + eps);
    rref[r] = rs;
    for (long j = 0; j < cols; ++j) {
      const double xh = x[r * cols + j] * rs;
      yref[r * cols + j] =
          has_w ? (mode.round_first ? round_to(d, xh) : xh) * (wv[j] + mode.offset) : xh;
    }
  }
  double gscale = 0;  // ||rstd * g||, the scale of dx's terms
  std::vector<double> dwabs(cols, 0.0);  // for dw's scale: sum of |terms| / sqrt(rows)
  std::vector<double> rin(rows);
  for (long r = 0; r < rows; ++r) rin[r] = round_to(acc, rref[r]);
  for (long r = 0; r < rows; ++r) {
    double dot = 0;
    const auto scale = [&](long j) { return has_w ? wv[j] + mode.offset : 1.0; };
    for (long j = 0; j < cols; ++j) dot += dy[r * cols + j] * scale(j) * x[r * cols + j] * rin[r];
    const double c = dot / cols;
    for (long j = 0; j < cols; ++j) {
      const double xh = x[r * cols + j] * rin[r];
      dxref[r * cols + j] = (dy[r * cols + j] * scale(j) - xh * c) * rin[r];
      gscale += std::pow(dy[r * cols + j] * scale(j) * rin[r], 2);
      // dw sums dy times xhat as the weight multiply saw it.
      const double xw = pre_weight(d, x[r * cols + j], rin[r], mode.round_first);
      dwabs[j] += std::fabs(dy[r * cols + j] * xw);
      dwref[j] += dy[r * cols + j] * xw;
    }
  }

  const bool vec = !offset && (cols * es) % 16 == 0;
  char label[160];
  std::snprintf(label, sizeof label, "%s w=%s %ldx%ld%s offset=%g%s", dt_name(d), wk_name(w),
                rows, cols, offset ? " +1" : "", mode.offset,
                mode.round_first ? " round_first" : "");

  // Forward, every config.
  for (const Config& c : configs(true, d, w, rows, cols, vec)) {
    poison(d, Y.p + off * es, n);
    poison(acc, R.p + off * as, rows);
    graft::FwdParams p{};
    p.x = X.p + off * es;
    p.w = has_w ? W.p + off * ws : nullptr;
    p.y = Y.p + off * es;
    p.rstd = R.p + off * as;
    p.rows = rows;
    p.cols = cols;
    p.tpr = c.tpr;
    p.rpb = c.rpb;
    p.vec = c.vec;
    p.eps = eps;
    p.inv_cols = 1.0 / cols;
    p.offset = kernel_offset(mode);
    p.round_first = mode.round_first;
    launch(c.name, c.grid, c.block, c.smem, p);
    std::vector<double> y(n), r(rows);
    for (size_t i = 0; i < n; ++i) y[i] = load(d, Y.p + (off + i) * es);
    for (long i = 0; i < rows; ++i) r[i] = load(acc, R.p + (off + i) * as);
    check(std::string(label) + " " + c.name + " y", d, y, yref);
    check(std::string(label) + " " + c.name + " rstd", acc, r, rref);
    std::vector<double> yexact(n);
    for (long i = 0; i < rows; ++i) {
      for (long j = 0; j < cols; ++j) {
        yexact[i * cols + j] = forward_exact(d, x[i * cols + j], r[i], has_w, wv[j], mode);
      }
    }
    check_exact(std::string(label) + " " + c.name + " y replayed", y, yexact);
  }

  // Backward, every config with dx+dw; the first config also dx-only and dw-only.
  for (long i = 0; i < rows; ++i) store(acc, R.p + (off + i) * as, rin[i]);
  bool first = true;
  for (const Config& c : configs(false, d, w, rows, cols, vec)) {
    std::vector<std::pair<bool, bool>> modes = {{true, has_w}};
    if (first && has_w) modes.insert(modes.end(), {{true, false}, {false, true}});
    first = false;
    for (auto [want_dx, want_dw] : modes) {
      poison(d, DX.p + off * es, n);
      poison(wd, DW.p + off * ws, cols);
      Mem part(size_t(c.grid) * cols * as + 16);
      poison(acc, part.p, size_t(c.grid) * cols);
      graft::BwdParams p{};
      p.dy = DY.p + off * es;
      p.x = X.p + off * es;
      p.rstd = R.p + off * as;
      p.w = has_w ? W.p + off * ws : nullptr;
      p.dx = want_dx ? DX.p + off * es : nullptr;
      p.partial = want_dw ? part.p : nullptr;
      p.rows = rows;
      p.cols = cols;
      p.tpr = c.tpr;
      p.rpb = c.rpb;
      p.vec = c.vec;
      p.has_dx = want_dx;
      p.has_dw = want_dw;
      p.dw_smem = c.smem > 0 && c.name.find("_loop_") != std::string::npos;
      p.inv_cols = 1.0 / cols;
      p.offset = kernel_offset(mode);
      p.round_first = mode.round_first;
      launch(c.name, c.grid, c.block, c.smem, p);
      if (want_dw) {
        graft::FinalizeParams f{};
        f.partial = part.p;
        f.dw = DW.p + off * ws;
        f.nparts = c.grid;
        f.cols = cols;
        const std::string fin = std::string("graft_rms_dw_finalize_") + dt_name(acc) + "_" +
                                dt_name(wd);
        launch(fin, unsigned((cols + 31) / 32), 256, 0, f);
      }
      const std::string tag = std::string(label) + " " + c.name + (want_dx ? " dx" : "") +
                              (want_dw ? " dw" : "");
      if (want_dx) {
        std::vector<double> dxo(n);
        for (size_t i = 0; i < n; ++i) dxo[i] = load(d, DX.p + (off + i) * es);
        check(tag + " dx", d, dxo, dxref, std::sqrt(gscale));
      }
      if (want_dw) {
        std::vector<double> dwo(cols);
        for (long j = 0; j < cols; ++j) dwo[j] = load(wd, DW.p + (off + j) * ws);
        double dwscale = 0;
        for (double v : dwabs) dwscale += v * v;
        check(tag + " dw", wd, dwo, dwref, std::sqrt(dwscale / double(rows)));
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = emu_common::quick(argc, argv);
  const auto& dts = kDtypes;
  const WK wks[] = {WK::None, WK::Same, WK::Acc};
  std::vector<long> cols_list = {1, 7, 64, 100, 1000, 4096, 4097};
  std::vector<long> rows_list = {1, 5};
  if (quick) cols_list = {7, 1000, 4096};
  for (DT d : dts)
    for (WK w : wks)
      for (long cols : cols_list)
        for (long rows : rows_list)
          for (bool offset : {false, true}) run_case(d, w, rows, cols, offset);
  // Rows longer than any rows kernel covers: the loop kernels alone.
  for (DT d : dts) run_case(d, WK::Same, 2, 70000, false);
  run_case(DT::BF16, WK::Acc, 2, 70001, true);
  // The weight modes of torchgraft::rms_norm: Gemma's offset 1, Llama's rounding first, both.
  // round_first with a wider (acc) weight under 16-bit inputs is refused by the launcher.
  const Mode modes[] = {{1.0, false}, {0.0, true}, {1.0, true}};
  for (const Mode& m : modes)
    for (DT d : dts)
      for (WK w : {WK::Same, WK::Acc})
        for (long cols : {7L, 1000L})
          for (bool offset : {false, true})
            if (!(m.round_first && w == WK::Acc && dt_size(d) == 2))
              run_case(d, w, 5, cols, offset, m);
  run_case(DT::BF16, WK::Same, 2, 70001, false, {1.0, true});
  run_case(DT::BF16, WK::Acc, 2, 70001, true, {1.0, false});
  run_case(DT::F16, WK::Same, 1, 4096, false, {0.0, true});
  return report();
}

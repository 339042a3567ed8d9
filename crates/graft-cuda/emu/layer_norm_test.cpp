// Runs the kernels of ops/layer_norm/layer_norm.cu on the CPU (cuda_emu.h): every dtype, the rows
// kernels at every V (vector and scalar, sub-warp and multi-warp row groups, several rows per
// block, grid-stride loops), the loop kernels, the staged forward, the bulk backward (clusters
// of one block), weight and bias present or not, dx / dw / db alone or together through the
// finalize kernel. Outputs are poisoned with NaN first; results are compared with a float64
// reference. Build and run with emu/run_layer_norm.sh. Exit status 1 on any mismatch.

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda_emu.h"
using std::sqrt;
#include "../src/ops/layer_norm/layer_norm.cu"
#include "emu_common.h"

namespace {

using graft_layer_norm::FinalizeParams;
using graft_layer_norm::Params;

using namespace emu_common;

Lcg rng{0x1a7e5};

// ||got - ref|| / max(||ref||, scale) <= t, NaN nowhere. (A width of 1 makes y = b and
// dx, dw = 0 exactly: an all-zero reference needs exact zeros.)
void compare(const char* what, const std::string& ctx, Buf& got, const std::vector<double>& ref,
             double t, double scale = 0) {
  check_close(std::string(what) + " " + ctx, got.read(), ref,
              {.tol = t, .scale = scale, .zero_exact = true});
}

template <bool BWD>
int rows_max(size_t size, int v, bool vec) {
#define B(SIZE, V, VEC) \
  if (size == SIZE && v == V && vec == VEC) return graft_layer_norm::RowsBounds<BWD, SIZE, V, VEC>::threads;
  B(4, 1, true) B(4, 2, true) B(4, 4, true) B(2, 1, true) B(2, 2, true) B(2, 4, true)
  B(8, 1, true) B(8, 2, true) B(8, 4, true) B(4, 1, false) B(4, 2, false) B(2, 1, false)
  B(2, 2, false) B(8, 1, false) B(8, 2, false)
#undef B
  if (!BWD && v == 8 && vec) {
    if (size == 4) return graft_layer_norm::RowsBounds<false, 4, 8, true>::threads;
    if (size == 2) return graft_layer_norm::RowsBounds<false, 2, 8, true>::threads;
    return graft_layer_norm::RowsBounds<false, 8, 8, true>::threads;
  }
  return 0;
}

struct Launch {
  std::string name;
  unsigned grid, block;
  long tpr, rpb;
  bool vec;
  size_t smem;
  bool stage;  // backward rows, vector access: x and dy rows staged in shared memory
};

void run_case(DT d, long rows, long cols, const Launch& fl, const Launch& bl, bool w_on, bool b_on,
              int mask) {
  const size_t n = size_t(rows * cols);
  char ctx[256];
  std::snprintf(ctx, sizeof ctx, "%s/%s rows=%ld cols=%ld tpr=%ld rpb=%ld grid=%u stage=%d w=%d b=%d mask=%d",
                fl.name.c_str(), bl.name.c_str(), rows, cols, bl.tpr, bl.rpb, bl.grid, bl.stage, w_on, b_on,
                mask);
  const DT a = acc_of(d);
  Buf x(d, n), y(d, n), w(d, size_t(cols)), b(d, size_t(cols)), mean(a, size_t(rows)), rstd(a, size_t(rows));
  std::vector<double> xv(n), wv(size_t(cols), 1.0), bv(size_t(cols), 0.0);
  for (size_t i = 0; i < n; ++i) {
    x.set(i, 2.0 + (rng.unit() * 2 - 1) * 3);
    xv[i] = x.get(i);
  }
  for (long c = 0; c < cols; ++c) {
    if (w_on) { w.set(size_t(c), 1.0 + (rng.unit() - 0.5)); wv[size_t(c)] = w.get(size_t(c)); }
    if (b_on) { b.set(size_t(c), rng.unit() - 0.5); bv[size_t(c)] = b.get(size_t(c)); }
  }
  y.poison();
  mean.poison();
  rstd.poison();
  Params p{};
  p.x = x.base();
  p.w = w_on ? w.base() : nullptr;
  p.b = b_on ? b.base() : nullptr;
  p.y = y.base();
  p.mean = mean.base();
  p.rstd = rstd.base();
  p.rows = rows;
  p.cols = cols;
  p.tpr = fl.tpr;
  p.rpb = fl.rpb;
  p.vec = fl.vec;
  p.eps = 1e-5;
  p.inv_cols = 1.0 / double(cols);
  launch(fl.name, fl.grid, fl.block, fl.smem, p);
  std::vector<double> yr(n), mr(static_cast<size_t>(rows)), rr(static_cast<size_t>(rows));
  for (long r = 0; r < rows; ++r) {
    double m = 0, v = 0;
    for (long c = 0; c < cols; ++c) m += xv[size_t(r * cols + c)];
    m /= double(cols);
    for (long c = 0; c < cols; ++c) v += (xv[size_t(r * cols + c)] - m) * (xv[size_t(r * cols + c)] - m);
    v /= double(cols);
    mr[size_t(r)] = m;
    rr[size_t(r)] = 1.0 / std::sqrt(v + 1e-5);
    for (long c = 0; c < cols; ++c)
      yr[size_t(r * cols + c)] = (xv[size_t(r * cols + c)] - m) * rr[size_t(r)] * wv[size_t(c)] + bv[size_t(c)];
  }
  compare("y", ctx, y, yr, tol(d));
  compare("mean", ctx, mean, mr, a == DT::F64 ? 1e-12 : 2e-6);
  compare("rstd", ctx, rstd, rr, a == DT::F64 ? 1e-12 : 2e-5);

  // Backward from the kernel's own mean and rstd.
  Buf dy(d, n), dx(d, n), dw(d, size_t(cols)), db(d, size_t(cols));
  std::vector<double> gv(n), ms(static_cast<size_t>(rows)), rs(static_cast<size_t>(rows));
  for (size_t i = 0; i < n; ++i) {
    dy.set(i, rng.unit() * 2 - 1);
    gv[i] = dy.get(i);
  }
  for (long r = 0; r < rows; ++r) {
    ms[size_t(r)] = mean.get(size_t(r));
    rs[size_t(r)] = rstd.get(size_t(r));
  }
  dx.poison();
  dw.poison();
  db.poison();
  const bool want_dx = mask & 1, want_sums = mask & 2;
  const size_t part_rows = bl.grid;
  Buf partial(a, part_rows * 2 * size_t(cols));
  partial.poison();
  Params q{};
  q.x = x.base();
  q.w = w_on ? w.base() : nullptr;
  q.mean = mean.base();
  q.rstd = rstd.base();
  q.dy = dy.base();
  q.dx = want_dx ? dx.base() : nullptr;
  q.partial = want_sums ? partial.base() : nullptr;
  q.rows = rows;
  q.cols = cols;
  q.tpr = bl.tpr;
  q.rpb = bl.rpb;
  q.vec = bl.vec;
  q.stage = bl.stage;
  q.inv_cols = 1.0 / double(cols);
  launch(bl.name, bl.grid, bl.block, bl.smem, q);
  if (want_sums) {
    FinalizeParams f{partial.base(), dw.base(), db.base(), (long long)part_rows, cols};
    const std::string fin = std::string("graft_ln_finalize_") + dt_name(d);
    launch(fin, unsigned((cols + 31) / 32), 256, 0, f);
  }
  std::vector<double> dxr(n), dwr(size_t(cols), 0.0), dbr(size_t(cols), 0.0);
  double scale = 0;
  for (long r = 0; r < rows; ++r) {
    double sg = 0, sgx = 0;
    for (long c = 0; c < cols; ++c) {
      const size_t i = size_t(r * cols + c);
      const double xh = (xv[i] - ms[size_t(r)]) * rs[size_t(r)], g = gv[i] * wv[size_t(c)];
      sg += g;
      sgx += g * xh;
      dwr[size_t(c)] += gv[i] * xh;
      dbr[size_t(c)] += gv[i];
    }
    for (long c = 0; c < cols; ++c) {
      const size_t i = size_t(r * cols + c);
      const double xh = (xv[i] - ms[size_t(r)]) * rs[size_t(r)], g = gv[i] * wv[size_t(c)];
      dxr[i] = rs[size_t(r)] * (g - sg / double(cols) - xh * sgx / double(cols));
      scale += (rs[size_t(r)] * g) * (rs[size_t(r)] * g);
    }
  }
  if (want_dx) compare("dx", ctx, dx, dxr, 4 * tol(d), std::sqrt(scale));
  if (want_sums) {
    const double t = a == DT::F64 ? 1e-12 : d == DT::F32 ? 2e-6 : tol(d);
    compare("dw", ctx, dw, dwr, t);
    compare("db", ctx, db, dbr, t);
  }
}

// The bulk backward with clusters of one block, the emulator's (V = 2): the persistent walk
// over rows with two buffers, the partial row per cluster.
extern "C" void graft_ln_bwd_bulk1_f16(const Params p) {
  graft_layer_norm::bwd_bulk<__half, 1, 2>(p);
}
extern "C" void graft_ln_bwd_bulk1_bf16(const Params p) {
  graft_layer_norm::bwd_bulk<__nv_bfloat16, 1, 2>(p);
}

void cases(DT d) {
  const long N = long(16 / dt_size(d));
  const long widths[] = {1, 3, 8, 17, 64, 100, 256, 1000, 2048};
  for (long cols : widths) {
    for (bool vec : {true, false}) {
      if (vec && cols % N != 0) continue;
      for (int v : {1, 2, 4}) {
        const int fmax = rows_max<false>(dt_size(d), v, vec), bmax = rows_max<true>(dt_size(d), v, vec);
        if (fmax == 0 || bmax == 0) continue;
        const long nunits = (cols + N - 1) / N;
        const unsigned tpr = group_threads((nunits + v - 1) / v);
        if (long(tpr) > std::min(fmax, bmax) || (tpr > 256 && cols < 1000)) continue;
        const unsigned per_warp = tpr < 32 ? 32 / tpr : 1;
        unsigned rpb = per_warp * (tpr <= 64 ? 2 : 1);
        while (rpb > per_warp && tpr * rpb > unsigned(std::min(fmax, bmax))) rpb -= per_warp;
        const long rows = 3 * rpb + 1;
        const std::string vs =
            std::string(vec ? "v" : "s") + std::to_string(v) + "_" + dt_name(d);
        const size_t acc = dt_size(acc_of(d));
        const size_t smem = size_t(rpb - 1) * size_t(v) * size_t(N) * tpr * 2 * acc;
        Launch fl{std::string("graft_ln_fwd_rows_") + vs, 2, tpr * rpb, long(tpr), long(rpb), vec, 0, false};
        for (bool stage : {false, true}) {
          if (stage && !vec) continue;
          // Staged: two buffers of x and dy, 16 bytes a unit, shared with the partial rows.
          const size_t staged = stage ? 4 * size_t(rpb) * size_t(v) * tpr * 16 : 0;
          Launch bl{std::string("graft_ln_bwd_rows_") + vs, 2, tpr * rpb, long(tpr), long(rpb), vec,
                    std::max(smem, staged), stage};
          for (int mask : {3, 1, 2})
            run_case(d, rows, cols, fl, bl, mask != 1, mask == 3, mask);
        }
      }
    }
  }
  for (long cols : {1L, 5L, 100L, 1000L, 5000L}) {
    for (bool vec : {true, false}) {
      if (vec && cols % N != 0) continue;
      for (unsigned block : {64u, 256u}) {
        const std::string fwd = std::string("graft_ln_fwd_loop_") + dt_name(d);
        const std::string bwd = std::string("graft_ln_bwd_loop_") + dt_name(d);
        Launch fl{fwd, 2, block, block, 1, vec, 0, false};
        Launch bl{bwd, 2, block, block, 1, vec, 0, false};
        for (int mask : {3, 1, 2}) run_case(d, 5, cols, fl, bl, mask != 2, mask != 1, mask);
      }
    }
  }
  // The staged forward (16-bit rows of 16-byte units), blocks of fewer and more threads than
  // units, a grid-stride loop over 5 rows; the loop kernel's backward after it.
  if (dt_size(d) != 2) return;
  for (long cols : {8L, 64L, 1000L, 2048L, 5000L}) {
    for (unsigned block : {32u, 64u, 256u}) {
      const size_t smem = size_t(cols / N) * 16;
      const std::string staged = std::string("graft_ln_fwd_staged_") + dt_name(d);
      Launch fl{staged, 2, block, block, 1, true, smem, false};
      Launch bl{std::string("graft_ln_bwd_loop_") + dt_name(d), 2, block, block, 1, true, 0, false};
      for (int mask : {3, 1}) run_case(d, 5, cols, fl, bl, mask != 2, mask != 1, mask);
    }
  }
  // The bulk backward: slices of fewer units than two a thread, and exactly as many; grids
  // smaller and larger than the rows; dx, the sums, or both.
  for (long cols : {8L, 200L, 1024L}) {
    for (unsigned block : {32u, 64u}) {
      if (cols / N > 2 * long(block)) continue;
      for (unsigned grid : {1u, 3u, 9u}) {
        const size_t smem = 4 * size_t(cols / N) * 16;
        const std::string staged = std::string("graft_ln_fwd_staged_") + dt_name(d);
        const std::string bulk = std::string("graft_ln_bwd_bulk1_") + dt_name(d);
        Launch fl{staged, 2, block, block, 1, true, smem / 4, false};
        Launch bl{bulk, grid, block, block, 1, true, smem, false};
        for (int mask : {3, 1, 2}) run_case(d, 7, cols, fl, bl, mask != 2, mask != 1, mask);
      }
    }
  }
}

}  // namespace

int main() {
  for (DT d : {DT::F32, DT::F64, DT::F16, DT::BF16}) cases(d);
  return report();
}

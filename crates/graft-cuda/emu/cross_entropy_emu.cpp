// Runs the kernels of ops/cross_entropy/cross_entropy.cu on the CPU (cuda_emu.h): the rows kernel for
// every dtype over odd row lengths and misaligned rows (head / packs / tail), loss only, a
// separate gradient (same and different 16-byte phase) and the gradient over the logits, label
// smoothing, ignored rows, a mean's count, per-row scales, rows masked with -inf, block sizes
// from one warp to 1024 threads and grids smaller than the rows; the count and reduce kernels;
// the scale kernel (per row and scalar, vector and scalar paths, in place skipping factors of
// 1); the vocabulary-block kernels (block stats over consecutive blocks of odd widths, first and
// last flags, the loss and log-sum-exp after the last block, then the block gradient with a
// mean's count and per-row factors, a whole -inf block and a NaN in one) and the f32
// accumulate kernel. Everything is compared with a float64 reference; outputs are poisoned with NaN first.
// Build and run with emu/run_cross_entropy.sh. Exit status 1 on any mismatch.

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cuda_emu.h"

using std::exp;
using std::log;
inline float __expf(float v) { return std::exp(v); }
[[noreturn]] inline void __trap() { std::abort(); }

#include "../src/ops/cross_entropy/cross_entropy.cu"
#include "emu_common.h"

namespace {

using namespace emu_common;

Lcg rng{0x5eed1234};

// ||out - ref|| / max(||ref||, scale) <= tol; NaN / inf must match exactly, and an all-zero
// reference (with no scale) needs exact zeros.
void check(const std::string& what, const std::vector<double>& out, const std::vector<double>& ref,
           double tol, double scale) {
  check_close(what, out, ref, {.tol = tol, .scale = scale, .zero_exact = true, .specials = true});
}

enum class Mode { LossOnly, Separate, OtherPhase, InPlace };
const char* mode_name(Mode m) {
  switch (m) {
    case Mode::LossOnly: return "loss";
    case Mode::Separate: return "grad";
    case Mode::OtherPhase: return "grad-phase";
    default: return "in-place";
  }
}

const long long kIgnore = -100;

struct Case {
  DT d;
  long rows, cols;
  bool offset;       // logits start one element past a 16-byte boundary
  Mode mode;
  double eps;
  bool mean;         // gradient divided by the count
  bool row_scale;
  bool masked;       // a run of -inf logits in every row
  unsigned block;
  unsigned grid;
};

void run_case(const Case& c) {
  const DT d = c.d, acc = acc_of(d);
  const size_t es = dt_size(d), as = dt_size(acc);
  const size_t n = size_t(c.rows) * c.cols;
  const size_t off = c.offset ? 1 : 0;
  const std::string ctx = std::string(dt_name(d)) + " " + std::to_string(c.rows) + "x" +
                          std::to_string(c.cols) + (c.offset ? " off" : "") + " " +
                          mode_name(c.mode) + " eps " + std::to_string(c.eps) +
                          (c.mean ? " mean" : "") + (c.row_scale ? " rowscale" : "") +
                          (c.masked ? " masked" : "") + " block " + std::to_string(c.block) +
                          " grid " + std::to_string(c.grid);

  std::vector<double> x(n);
  for (auto& v : x) v = round_to(d, (rng.unit() * 2 - 1) * 6);
  if (c.masked) {
    // -inf over a run longer than one thread's share of small blocks, and over the row's
    // first element (the head path).
    for (long r = 0; r < c.rows; ++r) {
      for (long j = 0; j < c.cols / 2; ++j) x[r * c.cols + j] = -INFINITY;
    }
    // A NaN inside row 0's -inf run: seen by a thread whose maximum is still -inf, it must
    // survive that thread's later finite values and every merge (the row's loss is NaN).
    if (c.cols / 2 > 1) x[1] = NAN;
  }
  std::vector<long long> target(c.rows);
  for (long r = 0; r < c.rows; ++r) {
    target[r] = (r % 3 == 1) ? kIgnore : (long long)(rng.unit() * c.cols);
    if (c.masked && target[r] != kIgnore) target[r] = c.cols - 1 - target[r] % ((c.cols + 1) / 2);
  }
  std::vector<double> rs(c.rows);
  for (auto& v : rs) v = round_to(acc, 0.5 + rng.unit());

  // Reference (float64).
  long valid = 0;
  for (auto t : target) valid += t != kIgnore;
  const double all = c.mean ? 1.0 / double(valid) : 1.0;
  std::vector<double> lref(c.rows, 0.0), gref(n, 0.0);
  double gscale = 0;
  for (long r = 0; r < c.rows; ++r) {
    if (target[r] == kIgnore) continue;
    const double* row = &x[r * c.cols];
    double m = -INFINITY;
    for (long j = 0; j < c.cols; ++j) m = std::max(m, row[j]);
    double s = 0, sum = 0;
    for (long j = 0; j < c.cols; ++j) {
      s += std::exp(row[j] - m);
      sum += row[j];
    }
    const double lse = m + std::log(s);
    const long t = long(target[r]);
    double l = lse - (1 - c.eps) * row[t];
    if (c.eps > 0) l -= c.eps / c.cols * sum;
    lref[r] = l;
    const double sc = all * (c.row_scale ? rs[r] : 1.0);
    gscale += sc * sc;
    for (long j = 0; j < c.cols; ++j) {
      gref[r * c.cols + j] =
          (std::exp(row[j] - lse) - c.eps / c.cols - (j == t ? 1 - c.eps : 0.0)) * sc;
    }
  }
  // Masked rows with smoothing: sum_c x_c is -inf and the loss +inf, in float64 as in ATen.

  Mem X((n + 2) * es), G((n + 2) * es), L((c.rows + 1) * as), T((c.rows + 1) * 8);
  Mem RS((c.rows + 1) * as), CNT(16), OUT(16);
  for (size_t i = 0; i < n; ++i) store(d, X.p + (off + i) * es, x[i]);
  for (long r = 0; r < c.rows; ++r) store(acc, RS.p + r * as, rs[r]);
  std::memcpy(T.p, target.data(), c.rows * 8);
  poison(acc, L.p, c.rows);
  poison(d, G.p, n + 2);
  store(DT::F64, CNT.p, NAN);

  unsigned char* logits = X.p + off * es;
  unsigned char* grad = nullptr;
  switch (c.mode) {
    case Mode::LossOnly: break;
    case Mode::Separate: grad = G.p + off * es; break;
    case Mode::OtherPhase: grad = G.p + (1 - off) * es; break;
    case Mode::InPlace: grad = logits; break;
  }

  graft_ce::CeCountParams cp{reinterpret_cast<const long long*>(T.p),
                             reinterpret_cast<double*>(CNT.p), c.rows, c.cols, kIgnore};
  launch("graft_ce_count", 1, 1024, 0, cp);
  check("count " + ctx, {load(DT::F64, CNT.p)}, {double(valid)}, 0, 0);

  graft_ce::CeRowsParams p{};
  p.logits = logits;
  p.target = reinterpret_cast<const long long*>(T.p);
  p.grad = grad;
  p.loss = L.p;
  p.count = c.mean ? reinterpret_cast<const double*>(CNT.p) : nullptr;
  p.row_scale = c.row_scale ? RS.p : nullptr;
  p.rows = c.rows;
  p.cols = c.cols;
  p.ignore_index = kIgnore;
  p.on_target = 1 - c.eps;
  p.per_class = c.eps / c.cols;
  p.smoothing = c.eps > 0;
  launch(std::string("graft_ce_rows_") + dt_name(d), c.grid, c.block, 0, p);

  std::vector<double> lout(c.rows);
  for (long r = 0; r < c.rows; ++r) lout[r] = load(acc, L.p + r * as);
  // The loss is a difference of terms of size |lse| + |x_t|: measured against that size.
  double lscale = 0;
  for (long r = 0; r < c.rows; ++r) lscale += 36 + std::log(double(c.cols)) * std::log(double(c.cols));
  check("loss " + ctx, lout, lref, acc == DT::F64 ? 1e-12 : 2e-6, std::sqrt(lscale));
  if (grad != nullptr) {
    std::vector<double> gout(n);
    for (size_t i = 0; i < n; ++i) gout[i] = load(d, grad + i * es);
    check("grad " + ctx, gout, gref, tol(d), std::sqrt(gscale));
  }

  // The reduction of the per-row losses.
  store(acc, OUT.p, NAN);
  graft_ce::CeReduceParams rp{L.p, c.mean ? reinterpret_cast<const double*>(CNT.p) : nullptr,
                              OUT.p, c.rows};
  launch(std::string("graft_ce_reduce_") + dt_name(acc), 1, 1024, 0, rp);
  double total = 0;
  for (long r = 0; r < c.rows; ++r) total += lout[r];
  if (c.mean) total /= double(valid);
  check("reduce " + ctx, {load(acc, OUT.p)}, {total}, acc == DT::F64 ? 1e-12 : 1e-7, 0);
}

void scale_case(DT d, long rows, long cols, bool per_row, bool in_place, bool offset) {
  const DT acc = acc_of(d);
  const size_t es = dt_size(d), as = dt_size(acc);
  const size_t n = size_t(rows) * cols, off = offset ? 1 : 0;
  std::vector<double> src(n), f(per_row ? rows : 1);
  for (auto& v : src) v = round_to(d, rng.unit() * 2 - 1);
  for (size_t i = 0; i < f.size(); ++i)
    f[i] = (i % 2 == 0) ? 1.0 : round_to(acc, rng.unit() * 3 - 1);
  Mem S((n + 2) * es), D((n + 2) * es), F((f.size() + 1) * as);
  for (size_t i = 0; i < n; ++i) store(d, S.p + (off + i) * es, src[i]);
  poison(d, D.p, n + 2);
  for (size_t i = 0; i < f.size(); ++i) store(acc, F.p + i * as, f[i]);
  unsigned char* s = S.p + off * es;
  unsigned char* dst = in_place ? s : D.p + off * es;
  const long pack = 16 / long(es);
  const bool vec = !offset && n % pack == 0 && (!per_row || cols % pack == 0);
  graft_ce::CeScaleParams p{s, dst, F.p, (long long)n, per_row ? cols : (long long)n,
                            per_row ? 1 : 0, vec ? 1 : 0};
  launch(std::string("graft_ce_scale_") + dt_name(d), 3, 64, 0, p);
  std::vector<double> out(n), ref(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = load(d, dst + i * es);
    ref[i] = round_to(d, src[i] * f[per_row ? i / cols : 0]);
  }
  const std::string ctx = std::string(dt_name(d)) + " " + std::to_string(rows) + "x" +
                          std::to_string(cols) + (per_row ? " per-row" : " scalar") +
                          (in_place ? " in-place" : "") + (vec ? " vec" : "");
  check("scale " + ctx, out, ref, d == DT::F64 ? 0 : tol(d), 0);
}

// The vocabulary-block kernels: rows x cols logits cut into blocks of `block` classes, each in
// its own buffer (one element past a 16-byte boundary when `offset`), stats over every block,
// then the gradient of every block, against float64.
void blocks_case(DT d, long rows, long cols, long block, bool offset, bool mean, bool row_scale,
                 bool masked, unsigned threads, unsigned grid) {
  const DT acc = acc_of(d);
  const size_t es = dt_size(d), as = dt_size(acc);
  const size_t off = offset ? 1 : 0;
  const std::string ctx = std::string(dt_name(d)) + " " + std::to_string(rows) + "x" +
                          std::to_string(cols) + " blocks of " + std::to_string(block) +
                          (offset ? " off" : "") + (mean ? " mean" : "") +
                          (row_scale ? " rowscale" : "") + (masked ? " masked" : "") +
                          " block " + std::to_string(threads) + " grid " + std::to_string(grid);
  std::vector<double> x(size_t(rows) * cols);
  for (auto& v : x) v = round_to(d, (rng.unit() * 2 - 1) * 6);
  if (masked && cols > block) {
    // Row 0's first block all -inf (it adds nothing); with three rows or more, a NaN in row 2's
    // first block, which is otherwise -inf (that row's loss is NaN).
    for (long j = 0; j < block; ++j) x[j] = -INFINITY;
    if (rows > 2) {
      for (long j = 0; j < block; ++j) x[2 * cols + j] = -INFINITY;
      x[2 * cols + block / 2] = NAN;
    }
  }
  std::vector<long long> target(rows);
  for (long r = 0; r < rows; ++r) {
    target[r] = (r % 3 == 1) ? kIgnore : (long long)(rng.unit() * cols);
    if (masked && r == 0 && cols > block) target[r] = cols - 1;
  }
  std::vector<double> rs(rows);
  for (auto& v : rs) v = round_to(acc, 0.5 + rng.unit());
  long valid = 0;
  for (auto t : target) valid += t != kIgnore;
  const double all = mean ? 1.0 / double(valid) : 1.0;
  std::vector<double> lref(rows, 0.0), gref(x.size(), 0.0);
  double gscale = 0;
  for (long r = 0; r < rows; ++r) {
    if (target[r] == kIgnore) continue;
    const double* row = &x[r * cols];
    double m = -INFINITY;
    for (long j = 0; j < cols; ++j) m = std::max(m, row[j]);
    double s = 0;
    for (long j = 0; j < cols; ++j) s += row[j] == -INFINITY ? 0.0 : std::exp(row[j] - m);
    const double lse = m + std::log(s);
    lref[r] = lse - row[target[r]];
    const double sc = all * (row_scale ? rs[r] : 1.0);
    gscale += sc * sc;
    for (long j = 0; j < cols; ++j) {
      gref[r * cols + j] = (std::exp(row[j] - lse) - (j == target[r] ? 1.0 : 0.0)) * sc;
    }
  }
  Mem T((rows + 1) * 8), MX((rows + 1) * as), SM((rows + 1) * as), TL((rows + 1) * as);
  Mem L((rows + 1) * as), RS((rows + 1) * as), CNT(16);
  std::memcpy(T.p, target.data(), rows * 8);
  for (Mem* m : {&MX, &SM, &TL, &L}) poison(acc, m->p, rows);
  for (long r = 0; r < rows; ++r) store(acc, RS.p + r * as, rs[r]);
  graft_ce::CeCountParams cp{reinterpret_cast<const long long*>(T.p),
                             reinterpret_cast<double*>(CNT.p), rows, cols, kIgnore};
  launch("graft_ce_count", 1, 1024, 0, cp);
  // Each block's logits in their own buffer (kept for the gradient pass).
  std::vector<std::unique_ptr<Mem>> bufs;
  for (long b0 = 0; b0 < cols; b0 += block) {
    const long len = std::min(block, cols - b0);
    bufs.push_back(std::make_unique<Mem>((size_t(rows) * len + 2) * es));
    unsigned char* at = bufs.back()->p + off * es;
    for (long r = 0; r < rows; ++r) {
      for (long j = 0; j < len; ++j) store(d, at + (r * len + j) * es, x[r * cols + b0 + j]);
    }
    graft_ce::CeBlockStatsParams p{};
    p.logits = at;
    p.target = reinterpret_cast<const long long*>(T.p);
    p.max = MX.p;
    p.sum = SM.p;
    p.target_logit = TL.p;
    p.loss = b0 + len >= cols ? L.p : nullptr;
    p.rows = rows;
    p.cols = len;
    p.first_col = b0;
    p.ignore_index = kIgnore;
    p.first = b0 == 0;
    launch(std::string("graft_ce_block_stats_") + dt_name(d), grid, threads, 0, p);
  }
  std::vector<double> lout(rows);
  for (long r = 0; r < rows; ++r) lout[r] = load(acc, L.p + r * as);
  double lscale = 0;
  for (long r = 0; r < rows; ++r) lscale += 36 + std::log(double(cols)) * std::log(double(cols));
  check("block loss " + ctx, lout, lref, acc == DT::F64 ? 1e-12 : 2e-6, std::sqrt(lscale));
  std::vector<double> gout(x.size());
  size_t k = 0;
  for (long b0 = 0; b0 < cols; b0 += block, ++k) {
    const long len = std::min(block, cols - b0);
    unsigned char* at = bufs[k]->p + off * es;
    graft_ce::CeBlockGradParams p{};
    p.logits = at;
    p.target = reinterpret_cast<const long long*>(T.p);
    p.lse = MX.p;
    p.count = mean ? reinterpret_cast<const double*>(CNT.p) : nullptr;
    p.row_scale = row_scale ? RS.p : nullptr;
    p.rows = rows;
    p.cols = len;
    p.first_col = b0;
    p.ignore_index = kIgnore;
    launch(std::string("graft_ce_block_grad_") + dt_name(d), grid, threads, 0, p);
    for (long r = 0; r < rows; ++r) {
      for (long j = 0; j < len; ++j) gout[r * cols + b0 + j] = load(d, at + (r * len + j) * es);
    }
  }
  check("block grad " + ctx, gout, gref, tol(d), std::sqrt(gscale));
}

void accumulate_case(long n, bool offset) {
  std::vector<double> a(n), b(n);
  for (auto& v : a) v = round_to(DT::F32, rng.unit() * 2 - 1);
  for (auto& v : b) v = round_to(DT::F32, rng.unit() * 2 - 1);
  const size_t off = offset ? 1 : 0;
  Mem A((n + 2) * 4), B((n + 2) * 4);
  for (long i = 0; i < n; ++i) {
    store(DT::F32, A.p + (off + i) * 4, a[i]);
    store(DT::F32, B.p + i * 4, b[i]);
  }
  float* acc = reinterpret_cast<float*>(A.p) + off;
  const bool vec = !offset && n % 4 == 0;
  graft_ce::CeAccumulateParams p{acc, reinterpret_cast<const float*>(B.p), n, vec ? 1 : 0};
  launch("graft_ce_accumulate_f32", 3, 64, 0, p);
  std::vector<double> out(n), ref(n);
  for (long i = 0; i < n; ++i) {
    out[i] = acc[i];
    ref[i] = double(float(a[i]) + float(b[i]));
  }
  check("accumulate " + std::to_string(n) + (vec ? " vec" : ""), out, ref, 0, 0);
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = emu_common::quick(argc, argv);
  const DT dtypes[] = {DT::F32, DT::BF16, DT::F16, DT::F64};
  const std::pair<long, long> shapes[] = {{1, 1}, {4, 7}, {5, 33}, {4, 1000}, {3, 4099}, {7, 130}};
  for (DT d : dtypes) {
    for (auto [rows, cols] : shapes) {
      for (Mode mode : {Mode::LossOnly, Mode::Separate, Mode::OtherPhase, Mode::InPlace}) {
        for (bool offset : {false, true}) {
          for (double eps : {0.0, 0.2}) {
            Case c{d, rows, cols, offset, mode, eps, eps == 0.0, eps > 0, false, 128, 2};
            run_case(c);
            if (quick) continue;
            c.block = 32;
            c.grid = 1;
            run_case(c);
          }
        }
      }
      // Block shapes: one warp, a full 1024-thread block; masked rows (a thread's whole share
      // is -inf); one block per row.
      // (The double kernel is bounded to 512 threads.)
      for (unsigned block : {32u, d == DT::F64 ? 512u : 1024u}) {
        run_case({d, rows, cols, true, Mode::InPlace, 0.0, true, false, cols > 1, block, 3});
      }
      run_case({d, rows, cols, false, Mode::Separate, 0.1, false, true, cols > 1, 64,
                (unsigned)rows});
    }
    for (bool per_row : {false, true}) {
      for (bool in_place : {false, true}) {
        for (bool offset : {false, true}) {
          scale_case(d, 5, 24, per_row, in_place, offset);
          scale_case(d, 3, 7, per_row, in_place, offset);
        }
      }
    }
  }
  // Vocabulary blocks: widths that divide the row or not, one class per block, misaligned
  // buffers, block shapes from one warp up, grids smaller than the rows.
  for (DT d : dtypes) {
    const struct { long rows, cols, block; } shapes[] = {
        {1, 1, 1}, {4, 7, 3}, {5, 33, 8}, {7, 130, 128}, {3, 1000, 333}, {6, 4099, 1024}};
    for (auto sh : shapes) {
      for (bool offset : {false, true}) {
        blocks_case(d, sh.rows, sh.cols, sh.block, offset, true, false, false, 128, 2);
        blocks_case(d, sh.rows, sh.cols, sh.block, offset, false, true, sh.cols > sh.block, 32,
                    1);
        if (quick) continue;
        blocks_case(d, sh.rows, sh.cols, sh.block, offset, true, true, sh.cols > sh.block,
                    d == DT::F64 ? 512u : 1024u, (unsigned)sh.rows);
      }
    }
  }
  for (long n : {1L, 7L, 64L, 1000L}) {
    for (bool offset : {false, true}) accumulate_case(n, offset);
  }
  // An empty batch: count 0, sum 0, mean 0 / 0 = NaN.
  {
    Mem CNT(16), OUT(16), T(16), L(16);
    graft_ce::CeCountParams cp{reinterpret_cast<const long long*>(T.p),
                               reinterpret_cast<double*>(CNT.p), 0, 10, kIgnore};
    launch("graft_ce_count", 1, 1024, 0, cp);
    graft_ce::CeReduceParams rp{L.p, reinterpret_cast<const double*>(CNT.p), OUT.p, 0};
    launch("graft_ce_reduce_f32", 1, 1024, 0, rp);
    check("empty mean", {load(DT::F32, OUT.p)}, {NAN}, 0, 0);
    rp.count = nullptr;
    launch("graft_ce_reduce_f32", 1, 1024, 0, rp);
    check("empty sum", {load(DT::F32, OUT.p)}, {0.0}, 0, 0);
  }
  return report();
}

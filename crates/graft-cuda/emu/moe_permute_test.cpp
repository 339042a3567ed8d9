// Runs the kernels of ops/moe_permute/moe_permute.cu on the CPU (cuda_emu.h) and compares them
// with float64 references: every dtype and weight kind (none, same, acc), packed and
// one-element paths, sentinel slots (valid < S) read as int32 and int64, valid out of range
// (clamped), out-of-range indices (read as sentinels), K = 1, grid-stride loops (fewer warps
// than rows). Outputs are poisoned with NaN first: every element must be written.
// Build and run with emu/run_moe_permute.sh. Exit status 1 on any mismatch.

#include <dlfcn.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "cuda_emu.h"

#include "../src/ops/moe_permute/moe_permute.cu"

namespace {

enum class DT { F32, F16, BF16, F64 };
const DT kDtypes[] = {DT::F32, DT::F16, DT::BF16, DT::F64};
const char* dt_name(DT d) {
  switch (d) {
    case DT::F32: return "f32";
    case DT::F16: return "f16";
    case DT::BF16: return "bf16";
    default: return "f64";
  }
}
size_t dt_size(DT d) { return d == DT::F64 ? 8 : d == DT::F32 ? 4 : 2; }
DT acc_of(DT d) { return d == DT::F64 ? DT::F64 : DT::F32; }
double tol(DT d) {
  switch (d) {
    case DT::F64: return 1e-12;
    case DT::F32: return 2e-6;
    case DT::F16: return 2e-3;
    default: return 1e-2;
  }
}

// "Device" memory: 64-byte aligned host bytes, plus an offset to misalign on purpose.
struct Mem {
  unsigned char* base = nullptr;
  unsigned char* p = nullptr;
  explicit Mem(size_t bytes, size_t offset = 0) {
    base = static_cast<unsigned char*>(std::aligned_alloc(64, (bytes + offset + 63) / 64 * 64 + 64));
    p = base + offset;
  }
  ~Mem() { std::free(base); }
  Mem(const Mem&) = delete;
  Mem& operator=(const Mem&) = delete;
};

void store(DT d, unsigned char* at, double v) {
  switch (d) {
    case DT::F32: { float f = float(v); std::memcpy(at, &f, 4); break; }
    case DT::F64: std::memcpy(at, &v, 8); break;
    case DT::F16: { __half h = __float2half_rn(float(v)); std::memcpy(at, &h.bits, 2); break; }
    case DT::BF16: { __nv_bfloat16 h = __float2bfloat16_rn(float(v)); std::memcpy(at, &h.bits, 2); break; }
  }
}
double load(DT d, const unsigned char* at) {
  switch (d) {
    case DT::F32: { float f; std::memcpy(&f, at, 4); return f; }
    case DT::F64: { double v; std::memcpy(&v, at, 8); return v; }
    case DT::F16: { __half h; std::memcpy(&h.bits, at, 2); return __half2float(h); }
    default: { __nv_bfloat16 h; std::memcpy(&h.bits, at, 2); return __bfloat162float(h); }
  }
}

unsigned long long rng_state = 0x2545F4914F6CDD1Dull;
unsigned long long next_u64() {
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return rng_state >> 11;
}
double unit() { return double(next_u64()) / double(1ull << 53); }
double normalish() { return (unit() + unit() + unit() - 1.5) * 2; }

std::vector<double> fill(DT d, unsigned char* at, size_t n) {
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) {
    store(d, at + i * dt_size(d), normalish());
    v[i] = load(d, at + i * dt_size(d));
  }
  return v;
}
void poison(DT d, unsigned char* at, size_t n) {
  for (size_t i = 0; i < n; ++i) store(d, at + i * dt_size(d), std::nan(""));
}
std::vector<double> read(DT d, const unsigned char* at, size_t n) {
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = load(d, at + i * dt_size(d));
  return v;
}

int failures = 0, checks = 0, launches = 0;

void check(const std::string& what, DT d, const std::vector<double>& out,
           const std::vector<double>& ref, bool exact = false) {
  ++checks;
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) {
      ++failures;
      std::printf("FAIL %s: element %zu is %g\n", what.c_str(), i, out[i]);
      return;
    }
    if (exact && out[i] != ref[i]) {
      ++failures;
      std::printf("FAIL %s: element %zu is %g, expected %g\n", what.c_str(), i, out[i], ref[i]);
      return;
    }
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  const double e = den == 0 ? std::sqrt(num) : std::sqrt(num / den);
  if (!(e <= tol(d))) {
    ++failures;
    std::printf("FAIL %s: rel err %.3e > %.1e\n", what.c_str(), e, tol(d));
  }
}

void* kernel(const std::string& name) {
  void* f = dlsym(RTLD_DEFAULT, name.c_str());
  if (!f) {
    std::printf("FAIL missing kernel %s\n", name.c_str());
    std::exit(1);
  }
  return f;
}

void launch(const std::string& name, unsigned grid, unsigned block, const graft_moe::MoeParams& p) {
  auto* f = reinterpret_cast<void (*)(graft_moe::MoeParams)>(kernel(name));
  graft_emu::launch(f, grid, block, 0, p);
  ++launches;
}

struct Case {
  long tokens, top_k, hidden;
  long valid;   // as stored (may be out of [0, S]: clamped)
  bool bad;     // one perm / inv_perm entry out of range
};

enum Weights { NONE, SAME, ACC };
const char* kWeightTags[] = {"none", "same", "acc"};

void run_case(const Case& c, DT d, Weights wk, bool vec, bool valid64, unsigned grid) {
  const long S = c.tokens * c.top_k, H = c.hidden;
  const long v = c.valid < 0 ? 0 : (c.valid > S ? S : c.valid);
  const size_t es = dt_size(d);
  const size_t off = vec ? 0 : es;  // misaligned rows: the one-element path
  // A random permutation of the pairs and its inverse.
  std::vector<long long> perm(S), inv(S);
  std::iota(perm.begin(), perm.end(), 0);
  for (long i = S - 1; i > 0; --i) std::swap(perm[i], perm[next_u64() % (i + 1)]);
  for (long s = 0; s < S; ++s) inv[perm[s]] = s;
  // An out-of-range index makes its slot (perm) or pair (inv_perm) a sentinel.
  std::vector<long long> perm_k = perm, inv_k = inv;
  long bad_slot = -1, bad_pair = -1;
  if (c.bad && S > 0) {
    bad_slot = long(next_u64() % S);
    bad_pair = long(next_u64() % S);
    perm_k[bad_slot] = (bad_slot % 2) ? -5 : S + 7;
    inv_k[bad_pair] = (bad_pair % 2) ? -5 : S + 7;
  }
  auto slot_real = [&](long s) { return s < v && s != bad_slot; };
  auto pair_real = [&](long p) { return p != bad_pair && inv[p] < v; };

  Mem x(c.tokens * H * es, off), y(S * H * es, off), g(c.tokens * H * es, off);
  Mem out_p(S * H * es, off), out_u(c.tokens * H * es, off), dy(S * H * es, off);
  const DT wd = wk == SAME ? d : acc_of(d);
  Mem w(S * dt_size(wd) + 8), dw(S * dt_size(wd) + 8);
  const auto xv = fill(d, x.p, c.tokens * H), yv = fill(d, y.p, S * H), gv = fill(d, g.p, c.tokens * H);
  const auto wv = fill(wd, w.p, S);
  long long valid_store[1] = {c.valid};
  int valid_store32[1] = {int(c.valid)};
  const void* valid_ptr = valid64 ? static_cast<const void*>(valid_store)
                                  : static_cast<const void*>(valid_store32);
  const std::string tag = std::string(dt_name(d)) + " T=" + std::to_string(c.tokens) +
                          " K=" + std::to_string(c.top_k) + " H=" + std::to_string(H) +
                          " valid=" + std::to_string(c.valid) + (c.bad ? " bad" : "") +
                          (vec ? " vec" : " one") + (valid64 ? " i64" : " i32");

  graft_moe::MoeParams base{};
  base.valid = valid_ptr;
  base.pairs = S;
  base.hidden = H;
  base.top_k = c.top_k;
  base.valid_i64 = valid64 ? 1 : 0;
  base.vec = vec ? 1 : 0;

  if (wk == NONE) {  // the permutation has no weights: once per case
    poison(d, out_p.p, S * H);
    graft_moe::MoeParams p = base;
    p.src = x.p;
    p.index = perm_k.data();
    p.out = out_p.p;
    p.rows = S;
    launch(std::string("graft_moe_permute_") + dt_name(d), grid, 64, p);
    std::vector<double> ref(S * H, 0.0);
    for (long s = 0; s < S; ++s)
      if (slot_real(s))
        for (long j = 0; j < H; ++j) ref[s * H + j] = xv[(perm[s] / c.top_k) * H + j];
    check("permute " + tag, d, read(d, out_p.p, S * H), ref, true);
  }

  const std::string wtag = kWeightTags[wk];
  {
    poison(d, out_u.p, c.tokens * H);
    graft_moe::MoeParams p = base;
    p.src = y.p;
    p.index = inv_k.data();
    p.weights = wk == NONE ? nullptr : w.p;
    p.out = out_u.p;
    p.rows = c.tokens;
    launch(std::string("graft_moe_unpermute_") + dt_name(d) + "_" + wtag, grid, 64, p);
    std::vector<double> ref(c.tokens * H, 0.0);
    for (long q = 0; q < S; ++q) {
      if (!pair_real(q)) continue;
      const double wq = wk == NONE ? 1.0 : wv[q];
      for (long j = 0; j < H; ++j) ref[(q / c.top_k) * H + j] += wq * yv[inv[q] * H + j];
    }
    check("unpermute " + wtag + " " + tag, d, read(d, out_u.p, c.tokens * H), ref);
  }
  {
    poison(d, dy.p, S * H);
    poison(wd, dw.p, S);
    graft_moe::MoeParams p = base;
    p.src = g.p;
    p.y = y.p;
    p.index = perm_k.data();
    p.weights = wk == NONE ? nullptr : w.p;
    p.out = dy.p;
    p.dweights = wk == NONE ? nullptr : dw.p;
    p.rows = S;
    launch(std::string("graft_moe_unpermute_bwd_") + dt_name(d) + "_" + wtag, grid, 64, p);
    std::vector<double> ref_dy(S * H, 0.0), ref_dw(S, 0.0);
    for (long s = 0; s < S; ++s) {
      if (!slot_real(s)) continue;
      const long q = perm[s];
      const double wq = wk == NONE ? 1.0 : wv[q];
      for (long j = 0; j < H; ++j) {
        ref_dy[s * H + j] = wq * gv[(q / c.top_k) * H + j];
        ref_dw[q] += yv[s * H + j] * gv[(q / c.top_k) * H + j];
      }
    }
    check("bwd dy " + wtag + " " + tag, d, read(d, dy.p, S * H), ref_dy);
    if (wk != NONE) {
      // The pair a bad slot held is named by no slot: its gradient stays unwritten.
      auto got = read(wd, dw.p, S);
      if (bad_slot >= 0) got[perm[bad_slot]] = ref_dw[perm[bad_slot]];
      check("bwd dweights " + wtag + " " + tag, wd, got, ref_dw);
    }
  }
}

}  // namespace

int main() {
  const Case cases[] = {
      {1, 1, 8, 1, false},  {1, 4, 16, 4, false},  {7, 1, 24, 5, false},
      {16, 4, 32, 64, false}, {16, 4, 32, 41, false}, {16, 4, 32, 0, false},
      {9, 3, 40, 100, false}, {9, 3, 40, -2, false},  {12, 2, 72, 20, true},
      {33, 8, 8, 200, false}, {5, 2, 3, 7, false},
  };
  for (const Case& c : cases) {
    for (DT d : kDtypes) {
      const bool can_vec = (c.hidden * long(dt_size(d))) % 16 == 0;
      for (int wk = NONE; wk <= ACC; ++wk) {
        for (bool valid64 : {false, true}) {
          // Grids of 1 and 3 blocks of 2 warps: fewer warps than rows, grid-stride loops.
          for (unsigned grid : {1u, 3u}) {
            run_case(c, d, Weights(wk), false, valid64, grid);
            if (can_vec) run_case(c, d, Weights(wk), true, valid64, grid);
          }
        }
      }
    }
  }
  std::printf("emu: %d launches, %d checks, %d failures\n", launches, checks, failures);
  return failures == 0 ? 0 : 1;
}

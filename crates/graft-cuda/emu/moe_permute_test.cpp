// Runs the kernels of ops/moe_permute/moe_permute.cu on the CPU (cuda_emu.h) and compares them
// with references. The sort by expert against a stable comparison sort: one block and several,
// chunks of one tile and of several, other ranks' ids, one expert, many experts; outputs
// poisoned. The permutation ops against float64: every dtype and weight kind (none, same,
// acc), packed and one-element paths, sentinel slots (valid < S) read as int32 and int64,
// valid out of range (clamped), out-of-range indices (read as sentinels), K = 1, grid-stride
// loops (fewer warps than rows). Outputs are poisoned with NaN first: every element must be
// written.
// Build and run with emu/run_moe_permute.sh. Exit status 1 on any mismatch.

#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "cuda_emu.h"

#include "../src/ops/moe_permute/moe_permute.cu"
#include "emu_common.h"

namespace {

using namespace emu_common;

Lcg rng{0x2545F4914F6CDD1Dull};

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
  for (long i = S - 1; i > 0; --i) std::swap(perm[i], perm[rng.next_u64() % (i + 1)]);
  for (long s = 0; s < S; ++s) inv[perm[s]] = s;
  // An out-of-range index makes its slot (perm) or pair (inv_perm) a sentinel.
  std::vector<long long> perm_k = perm, inv_k = inv;
  long bad_slot = -1, bad_pair = -1;
  if (c.bad && S > 0) {
    bad_slot = long(rng.next_u64() % S);
    bad_pair = long(rng.next_u64() % S);
    perm_k[bad_slot] = (bad_slot % 2) ? -5 : S + 7;
    inv_k[bad_pair] = (bad_pair % 2) ? -5 : S + 7;
  }
  auto slot_real = [&](long s) { return s < v && s != bad_slot; };
  auto pair_real = [&](long p) { return p != bad_pair && inv[p] < v; };

  Mem x(c.tokens * H * es, off), y(S * H * es, off), g(c.tokens * H * es, off);
  Mem out_p(S * H * es, off), out_u(c.tokens * H * es, off), dy(S * H * es, off);
  const DT wd = wk == SAME ? d : acc_of(d);
  Mem w(S * dt_size(wd) + 8), dw(S * dt_size(wd) + 8);
  const auto xv = fill(rng, d, x.p, c.tokens * H), yv = fill(rng, d, y.p, S * H),
             gv = fill(rng, d, g.p, c.tokens * H);
  const auto wv = fill(rng, wd, w.p, S);
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
    launch(std::string("graft_moe_permute_") + dt_name(d), grid, 64, 0, p);
    std::vector<double> ref(S * H, 0.0);
    for (long s = 0; s < S; ++s)
      if (slot_real(s))
        for (long j = 0; j < H; ++j) ref[s * H + j] = xv[(perm[s] / c.top_k) * H + j];
    check_exact("permute " + tag, read(d, out_p.p, S * H), ref);
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
    launch(std::string("graft_moe_unpermute_") + dt_name(d) + "_" + wtag, grid, 64, 0, p);
    std::vector<double> ref(c.tokens * H, 0.0);
    for (long q = 0; q < S; ++q) {
      if (!pair_real(q)) continue;
      const double wq = wk == NONE ? 1.0 : wv[q];
      for (long j = 0; j < H; ++j) ref[(q / c.top_k) * H + j] += wq * yv[inv[q] * H + j];
    }
    check_close("unpermute " + wtag + " " + tag, read(d, out_u.p, c.tokens * H), ref,
                {.tol = tol(d)});
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
    launch(std::string("graft_moe_unpermute_bwd_") + dt_name(d) + "_" + wtag, grid, 64, 0, p);
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
    check_close("bwd dy " + wtag + " " + tag, read(d, dy.p, S * H), ref_dy, {.tol = tol(d)});
    if (wk != NONE) {
      // The pair a bad slot held is named by no slot: its gradient stays unwritten.
      auto got = read(wd, dw.p, S);
      if (bad_slot >= 0) got[perm[bad_slot]] = ref_dw[perm[bad_slot]];
      // A dot product of H terms summed in the accumulation type: its error grows with H.
      const double dot_tol = tol(wd) * std::max(1.0, std::sqrt(double(H) / 256.0));
      check_close("bwd dweights " + wtag + " " + tag, got, ref_dw, {.tol = dot_tol});
    }
  }
}

// The sort of `pairs` random ids (some outside [0, experts) when `foreign`) with `chunk` pairs
// per block, against std::stable_sort of the keys.
void run_sort(long pairs, long experts, bool foreign, long chunk) {
  std::vector<long long> ids(pairs);
  const unsigned long long span = experts + (foreign ? 5 : 0);
  for (auto& id : ids) id = (long long)(rng.next_u64() % span) - (foreign ? 2 : 0);
  auto key = [&](long long id) { return id >= 0 && id < experts ? id : experts; };
  std::vector<long long> want(pairs);
  std::iota(want.begin(), want.end(), 0);
  std::stable_sort(want.begin(), want.end(),
                   [&](long long a, long long b) { return key(ids[a]) < key(ids[b]); });
  const long keys = experts + 1;
  const unsigned chunks = unsigned(std::max(1L, (pairs + chunk - 1) / chunk));
  std::vector<long long> perm(pairs, -7), inv(pairs, -7);
  std::vector<int> offsets(experts, -7), counts(chunks * keys, -7);
  graft_moe::SortParams p{ids.data(), perm.data(), inv.data(), offsets.data(), counts.data(),
                          pairs, experts, chunk};
  const unsigned threads = graft_moe::kSortThreads;
  launch("graft_moe_sort_count", chunks, threads, 4 * keys, p);
  launch("graft_moe_sort_place", chunks, threads,
         4 * ((1 + graft_moe::kSortWarps) * keys + threads), p);
  const std::string tag = "sort S=" + std::to_string(pairs) + " E=" + std::to_string(experts) +
                          " chunk=" + std::to_string(chunk) + (foreign ? " foreign" : "");
  ++checks;
  if (perm != want) fail(tag, "perm differs from a stable sort by expert");
  ++checks;
  for (long s = 0; s < pairs; ++s) {
    if (inv[want[s]] != s) {
      fail(tag, "inv_perm is not perm's inverse at slot " + std::to_string(s));
      break;
    }
  }
  ++checks;
  long end = 0;
  for (long e = 0; e < experts; ++e) {
    end += std::count_if(ids.begin(), ids.end(), [&](long long id) { return id == e; });
    if (offsets[e] != end) {
      fail(tag, "offsets[" + std::to_string(e) + "] = " + std::to_string(offsets[e]) +
                    ", expected " + std::to_string(end));
      break;
    }
  }
}

}  // namespace

int main() {
  // (pairs, experts, foreign ids, pairs per block): one block and several, chunks of one and
  // of several tiles (128 threads), a last chunk part-full, one expert, more experts than
  // threads (a thread owns several keys).
  const struct {
    long pairs, experts;
    bool foreign;
    long chunk;
  } sorts[] = {
      {0, 4, false, 1},     {1, 1, false, 1},     {5, 3, true, 5},       {64, 8, false, 64},  {300, 8, true, 300},
      {300, 8, true, 100},  {1000, 64, false, 256}, {1000, 64, true, 333},
      {777, 1, true, 128},  {2000, 300, true, 512}, {513, 160, false, 129},
  };
  for (const auto& c : sorts) run_sort(c.pairs, c.experts, c.foreign, c.chunk);

  const Case cases[] = {
      {1, 1, 8, 1, false},  {1, 4, 16, 4, false},  {7, 1, 24, 5, false},
      {16, 4, 32, 64, false}, {16, 4, 32, 41, false}, {16, 4, 32, 0, false},
      {9, 3, 40, 100, false}, {9, 3, 40, -2, false},  {12, 2, 72, 20, true},
      {33, 8, 8, 200, false}, {5, 2, 3, 7, false}, {3, 2, 2056, 5, false},
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
  return report();
}

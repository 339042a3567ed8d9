// What the emulator harnesses (emu/*_test.cpp, emu/cross_entropy_emu.cpp) share: dtypes as
// values, "device" buffers, random inputs, NaN poison, comparison with a float64 reference,
// kernel launches by name, and the tally whose summary line tests/emu_harness/mod.rs reads.
// Header-only: each harness is one translation unit, built by its run_*.sh. Harnesses include
// this after the kernel file, so that none of these names reaches the kernels.
#pragma once

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_emu.h"

namespace emu_common {

// ----------------------------------------------------------------------------------- dtypes

enum class DT { F32, F16, BF16, F64 };
// The dtypes in the order the harnesses that loop over all four use (it fixes the random
// inputs each case gets).
inline constexpr DT kDtypes[] = {DT::F32, DT::F16, DT::BF16, DT::F64};

// The name the kernels' symbols end with.
inline const char* dt_name(DT d) {
  switch (d) {
    case DT::F32: return "f32";
    case DT::F16: return "f16";
    case DT::BF16: return "bf16";
    default: return "f64";
  }
}
inline size_t dt_size(DT d) { return d == DT::F64 ? 8 : d == DT::F32 ? 4 : 2; }
// The accumulation type the kernels compute in: float64 for float64, float32 otherwise.
inline DT acc_of(DT d) { return d == DT::F64 ? DT::F64 : DT::F32; }

// The relative error most outputs are held to: a few roundings of the dtype (harnesses pass
// their own where a result takes more roundings or is exact).
inline double tol(DT d) {
  switch (d) {
    case DT::F64: return 1e-12;
    case DT::F32: return 2e-6;
    case DT::F16: return 2e-3;
    default: return 1e-2;
  }
}

// One element of dtype d at `at`, rounded to nearest from v.
inline void store(DT d, unsigned char* at, double v) {
  switch (d) {
    case DT::F32: { float f = float(v); std::memcpy(at, &f, 4); break; }
    case DT::F64: std::memcpy(at, &v, 8); break;
    case DT::F16: { __half h = __float2half_rn(float(v)); std::memcpy(at, &h.bits, 2); break; }
    case DT::BF16: {
      // double -> float -> bf16 can round twice; harnesses generate inputs that round once.
      __nv_bfloat16 h = __float2bfloat16_rn(float(v));
      std::memcpy(at, &h.bits, 2);
      break;
    }
  }
}
inline double load(DT d, const unsigned char* at) {
  switch (d) {
    case DT::F32: { float f; std::memcpy(&f, at, 4); return f; }
    case DT::F64: { double v; std::memcpy(&v, at, 8); return v; }
    case DT::F16: { __half h; std::memcpy(&h.bits, at, 2); return __half2float(h); }
    default: { __nv_bfloat16 h; std::memcpy(&h.bits, at, 2); return __bfloat162float(h); }
  }
}
// v as dtype d holds it: references are computed from the values the kernels read.
inline double round_to(DT d, double v) {
  unsigned char b[8];
  store(d, b, v);
  return load(d, b);
}

// ----------------------------------------------------------------------------------- memory

// "Device" memory: host bytes from a 64-byte boundary plus `offset` bytes (to misalign on
// purpose), with 64 bytes to spare after the end. Not initialised: harnesses poison outputs.
struct Mem {
  unsigned char* base = nullptr;
  unsigned char* p = nullptr;
  explicit Mem(size_t bytes, size_t offset = 0) {
    const size_t size = (bytes + offset + 63) / 64 * 64 + 64;
    base = static_cast<unsigned char*>(std::aligned_alloc(64, size));
    p = base + offset;
  }
  ~Mem() { std::free(base); }
  Mem(const Mem&) = delete;
  Mem& operator=(const Mem&) = delete;
};

// Kernels must write every output element: outputs are filled with NaN before a launch, so an
// element left unwritten fails the comparison.
inline void poison(DT d, unsigned char* at, size_t n) {
  for (size_t i = 0; i < n; ++i) store(d, at + i * dt_size(d), std::nan(""));
}
inline std::vector<double> read(DT d, const unsigned char* at, size_t n) {
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = load(d, at + i * dt_size(d));
  return v;
}

// "Device" memory as n elements of one dtype, `offset` elements past a 64-byte boundary
// (zeroed, with room to spare after the end).
struct Buf {
  DT d;
  size_t n, offset;
  std::vector<unsigned char> raw;
  Buf(DT d_, size_t n_, size_t offset_ = 0)
      : d(d_), n(n_), offset(offset_), raw((n_ + offset_) * 8 + 128) {}
  unsigned char* base() {
    auto p = reinterpret_cast<uintptr_t>(raw.data());
    return reinterpret_cast<unsigned char*>((p + 63) / 64 * 64) + offset * dt_size(d);
  }
  void set(size_t i, double v) { store(d, base() + i * dt_size(d), v); }
  double get(size_t i) { return load(d, base() + i * dt_size(d)); }
  void poison() { emu_common::poison(d, base(), n); }
  std::vector<double> read() { return emu_common::read(d, base(), n); }
};

// ----------------------------------------------------------------------------------- random

// A 64-bit LCG (Knuth's MMIX constants): the same inputs on every machine and compiler, one
// seed per harness so that each keeps the cases it was tuned with.
struct Lcg {
  unsigned long long state;
  unsigned long long next_u64() {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return state >> 11;
  }
  // Uniform in [0, 1).
  double unit() { return double(next_u64()) / double(1ull << 53); }
  // Bell-shaped in (-3, 3) * scale: a sum of three uniforms.
  double normalish(double scale = 1) { return (unit() + unit() + unit() - 1.5) * 2 * scale; }
};

// Fills n elements of dtype d with normalish(scale) values; returns them as stored.
inline std::vector<double> fill(Lcg& rng, DT d, unsigned char* at, size_t n, double scale = 1) {
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) {
    store(d, at + i * dt_size(d), rng.normalish(scale));
    v[i] = load(d, at + i * dt_size(d));
  }
  return v;
}

// ---------------------------------------------------------------------------- tally, checks

// The counts of the summary line; a harness adds to them in its own checks too.
inline int failures = 0, checks = 0, launches = 0;
// Failures past this many are counted, not printed: one broken kernel fails many checks.
inline constexpr int kPrintedFailures = 30;

inline void fail(const std::string& what, const std::string& why) {
  if (++failures <= kPrintedFailures) std::printf("FAIL %s: %s\n", what.c_str(), why.c_str());
}

// How close an output must be to its float64 reference (check_close).
struct Close {
  double tol;
  // ||out - ref|| is measured against max(||ref||, scale): `scale` is the size the output has
  // where its terms do not cancel (where they do, the relative error grows in any precision).
  double scale = 0;
  // Where ||ref|| and scale are both 0: true, out must equal ref; false, ||out - ref|| <= tol.
  bool zero_exact = false;
  // true: a NaN or +-inf in ref must stand at the same place in out (out elsewhere finite);
  // false: out must be finite everywhere.
  bool specials = false;
};

// One check: ||out - ref|| / max(||ref||, c.scale) <= c.tol, and out finite (see Close).
inline void check_close(const std::string& what, const std::vector<double>& out,
                        const std::vector<double>& ref, const Close& c) {
  ++checks;
  char why[160];
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const bool special = c.specials && !std::isfinite(ref[i]);
    if (special ? !(std::isnan(ref[i]) ? std::isnan(out[i]) : out[i] == ref[i])
                : !std::isfinite(out[i])) {
      std::snprintf(why, sizeof why, "element %zu is %.9g, expected %.9g", i, out[i], ref[i]);
      return fail(what, why);
    }
    if (special) continue;
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  const double norm = std::max(std::sqrt(den), c.scale);
  const double e = norm > 0 ? std::sqrt(num) / norm
                   : c.zero_exact ? (num == 0 ? 0 : INFINITY)
                                  : std::sqrt(num);
  if (!(e <= c.tol)) {
    std::snprintf(why, sizeof why, "rel err %.3e > %.1e", e, c.tol);
    fail(what, why);
  }
}

// One check: out equals ref element for element (NaN equals nothing).
inline void check_exact(const std::string& what, const std::vector<double>& out,
                        const std::vector<double>& ref) {
  ++checks;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!(out[i] == ref[i])) {
      char why[160];
      std::snprintf(why, sizeof why, "element %zu is %.9g, expected %.9g", i, out[i], ref[i]);
      return fail(what, why);
    }
  }
}

// The summary line tests/emu_harness/mod.rs reads, and the exit status: 1 on any failure.
inline int report() {
  std::printf("emu: %d launches, %d checks, %d failures\n", launches, checks, failures);
  return failures == 0 ? 0 : 1;
}

// `--quick` as the first argument: the shorter run `make test-rust` asks some harnesses for.
inline bool quick(int argc, char** argv) { return argc > 1 && std::string(argv[1]) == "--quick"; }

// --------------------------------------------------------------------------------- launches

// A kernel of this binary by its exported name (the run scripts link with -rdynamic); a
// missing one ends the run.
inline void* kernel_symbol(const std::string& name) {
  void* f = dlsym(RTLD_DEFAULT, name.c_str());
  if (!f) {
    std::printf("FAIL missing kernel %s\n", name.c_str());
    std::exit(1);
  }
  return f;
}

// Runs kernel `name` (taking P) on grid x block threads with `smem` bytes of dynamic shared
// memory, and counts the launch.
template <typename P>
void launch(const std::string& name, unsigned grid, unsigned block, size_t smem, const P& p) {
  graft_emu::launch(reinterpret_cast<void (*)(P)>(kernel_symbol(name)), grid, block, smem, p);
  ++launches;
}
template <typename P>
void launch(void (*kernel)(P), unsigned grid, unsigned block, size_t smem, const P& p) {
  graft_emu::launch(kernel, grid, block, smem, p);
  ++launches;
}

// Threads per row group for `need` threads' work: a power of two up to a warp (so that groups
// tile a warp), whole warps beyond.
inline unsigned group_threads(long need) {
  if (need <= 32) {
    unsigned t = 1;
    while (long(t) < need) t *= 2;
    return t;
  }
  return unsigned((need + 31) / 32 * 32);
}

}  // namespace emu_common

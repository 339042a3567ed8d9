// A stand-in libcuda.so.1 that runs graft-cuda's kernels on the CPU (cuda_emu.h), so the
// whole host path (driver loading, module and function lookup, parameter blocks, launch
// configurations) and examples/selftest.rs can run on a machine without a GPU:
//   emu/run_selftest.sh   (builds this as libcuda.so.1 and runs `selftest --small`)
// Device memory is host memory; streams run synchronously; event times are host times.
// It reports itself as an H100 (132 SMs) so launch planning follows the GPU's path.

#include <dlfcn.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "cuda_emu.h"
#include "../src/ops/rms_norm/rms_norm.cu"

namespace {
using CUresult = int;
constexpr CUresult OK = 0, INVALID_VALUE = 1, NOT_FOUND = 500, INVALID_HANDLE = 400;

struct Function {
  std::string name;
  void* fn;
};
struct Event {
  std::chrono::steady_clock::time_point t;
};
int g_ctx_tag = 0;
void* g_current = nullptr;
std::vector<void*> g_stack;
}  // namespace

extern "C" {

CUresult cuInit(unsigned) { return OK; }
CUresult cuDriverGetVersion(int* v) { *v = 13000; return OK; }
CUresult cuDeviceGetCount(int* n) { *n = 1; return OK; }
CUresult cuDeviceGet(int* d, int ordinal) {
  if (ordinal != 0) return 101;  // CUDA_ERROR_INVALID_DEVICE
  *d = 0;
  return OK;
}
CUresult cuDeviceGetName(char* name, int len, int) {
  std::snprintf(name, size_t(len), "graft-cuda CPU emulator (H100 limits)");
  return OK;
}
CUresult cuDeviceGetAttribute(int* v, int attr, int) {
  switch (attr) {
    case 16: *v = 132; break;             // multiprocessors
    case 38: *v = 50 << 20; break;        // L2
    case 39: *v = 2048; break;            // threads per SM
    case 75: *v = 9; break;               // cc major
    case 76: *v = 0; break;               // cc minor
    case 81: *v = 233472; break;          // smem per SM
    case 82: *v = 65536; break;           // registers per SM
    case 97: *v = 232448; break;          // smem per block opt-in
    case 106: *v = 32; break;             // blocks per SM
    case 111: *v = 1024; break;           // reserved smem per block
    default: return INVALID_VALUE;
  }
  return OK;
}
CUresult cuDevicePrimaryCtxRetain(void** ctx, int) { *ctx = &g_ctx_tag; return OK; }
CUresult cuCtxGetCurrent(void** ctx) { *ctx = g_current; return OK; }
CUresult cuCtxPushCurrent_v2(void* ctx) {
  g_stack.push_back(g_current);
  g_current = ctx;
  return OK;
}
CUresult cuCtxPopCurrent_v2(void** ctx) {
  if (g_stack.empty()) return INVALID_VALUE;
  if (ctx) *ctx = g_current;
  g_current = g_stack.back();
  g_stack.pop_back();
  return OK;
}
CUresult cuCtxSynchronize() { return g_current ? OK : 201; }
CUresult cuModuleLoadData(void** m, const void* image) {
  // The image must at least be a fatbin.
  unsigned magic;
  std::memcpy(&magic, image, 4);
  if (magic != 0xBA55ED50u) return 200;  // CUDA_ERROR_INVALID_IMAGE
  *m = &g_ctx_tag;
  return g_current ? OK : 201;  // needs a current context
}
// This library's own handle (it is opened RTLD_LOCAL, so RTLD_DEFAULT cannot see it).
void* self_handle() {
  static void* h = [] {
    Dl_info info;
    dladdr(reinterpret_cast<void*>(&cuInit), &info);
    return dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  }();
  return h;
}
CUresult cuModuleGetFunction(void** f, void*, const char* name) {
  void* fn = dlsym(self_handle(), name);
  if (!fn) return NOT_FOUND;
  *f = new Function{name, fn};
  return OK;
}
CUresult cuFuncGetAttribute(int* v, int attr, void* f) {
  const std::string& n = static_cast<Function*>(f)->name;
  switch (attr) {
    case 0: {  // launch bounds, as in ops/rms_norm/rms_norm.cu
      const bool v16 = n.find("_v16") != std::string::npos;
      const bool bwd_v8 = n.find("bwd_rows") != std::string::npos && n.find("_v8") != std::string::npos;
      *v = v16 || bwd_v8 ? 256 : 512;
      break;
    }
    case 1: *v = 512; break;   // static smem
    case 3: *v = 0; break;     // local bytes
    case 4: *v = 64; break;    // registers
    default: return INVALID_VALUE;
  }
  return OK;
}
CUresult cuFuncSetAttribute(void*, int attr, int value) {
  return attr == 8 && value >= 0 && value <= 232448 ? OK : INVALID_VALUE;
}
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned smem, void*, void** params, void** extra) {
  if (!g_current) return 201;
  if (gy != 1 || gz != 1 || by != 1 || bz != 1 || extra || !params) return INVALID_VALUE;
  if (gx == 0 || bx == 0 || bx > 1024 || bx % 32 != 0) return INVALID_VALUE;
  auto* fn = static_cast<Function*>(f);
  const int max_threads = [&] { int v; cuFuncGetAttribute(&v, 0, f); return v; }();
  if (int(bx) > max_threads) return 701;  // CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
  if (smem > 232448 - 512) return INVALID_VALUE;
  const std::string& n = fn->name;
  if (n.rfind("graft_rms_fwd_", 0) == 0) {
    graft_emu::launch(reinterpret_cast<void (*)(graft::FwdParams)>(fn->fn), gx, bx, smem,
                      *static_cast<graft::FwdParams*>(params[0]));
  } else if (n.rfind("graft_rms_bwd_", 0) == 0) {
    graft_emu::launch(reinterpret_cast<void (*)(graft::BwdParams)>(fn->fn), gx, bx, smem,
                      *static_cast<graft::BwdParams*>(params[0]));
  } else {
    graft_emu::launch(reinterpret_cast<void (*)(graft::FinalizeParams)>(fn->fn), gx, bx, smem,
                      *static_cast<graft::FinalizeParams*>(params[0]));
  }
  return OK;
}
CUresult cuGetErrorName(CUresult r, const char** s) {
  static std::string names[1000];
  if (r < 0 || r >= 1000) return INVALID_VALUE;
  names[r] = "CUDA_ERROR_" + std::to_string(r);
  *s = names[r].c_str();
  return OK;
}
CUresult cuGetErrorString(CUresult r, const char** s) {
  *s = r == 0 ? "no error" : "emulated driver error";
  return OK;
}
CUresult cuMemAlloc_v2(unsigned long long* p, size_t bytes) {
  if (bytes == 0) return INVALID_VALUE;
  void* m = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (!m) return 2;  // CUDA_ERROR_OUT_OF_MEMORY
  *p = reinterpret_cast<unsigned long long>(m);
  return OK;
}
CUresult cuMemFree_v2(unsigned long long p) {
  std::free(reinterpret_cast<void*>(p));
  return OK;
}
CUresult cuMemcpyHtoD_v2(unsigned long long dst, const void* src, size_t n) {
  std::memcpy(reinterpret_cast<void*>(dst), src, n);
  return OK;
}
CUresult cuMemcpyDtoH_v2(void* dst, unsigned long long src, size_t n) {
  std::memcpy(dst, reinterpret_cast<const void*>(src), n);
  return OK;
}
CUresult cuMemcpyDtoDAsync_v2(unsigned long long dst, unsigned long long src, size_t n, void*) {
  std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
  return OK;
}
CUresult cuStreamCreate(void** s, unsigned) { *s = new int(0); return OK; }
CUresult cuStreamDestroy_v2(void* s) { delete static_cast<int*>(s); return OK; }
CUresult cuStreamSynchronize(void*) { return OK; }
CUresult cuEventCreate(void** e, unsigned) { *e = new Event{}; return OK; }
CUresult cuEventRecord(void* e, void*) {
  static_cast<Event*>(e)->t = std::chrono::steady_clock::now();
  return OK;
}
CUresult cuEventSynchronize(void*) { return OK; }
CUresult cuEventElapsedTime(float* ms, void* a, void* b) {
  *ms = std::chrono::duration<float, std::milli>(static_cast<Event*>(b)->t -
                                                 static_cast<Event*>(a)->t)
            .count();
  return OK;
}
CUresult cuEventDestroy_v2(void* e) { delete static_cast<Event*>(e); return OK; }

}  // extern "C"

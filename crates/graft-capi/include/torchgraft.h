/* libtorchgraft: torchgraft's native grafts for C and C++ programs that load libtorch themselves.
 *
 * Load libtorch first (e.g. dlopen("…/torch/lib/libtorch.so", RTLD_NOW | RTLD_GLOBAL)), then this
 * library; torchgraft_enable() registers the Rust and CUDA kernels with the dispatcher, and every
 * call of aten::_fused_rms_norm / _fused_rms_norm_backward on CPU (and CUDA, when built with
 * kernels and a GPU is present) runs them, with no Python involved. */
#ifndef TORCHGRAFT_H
#define TORCHGRAFT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Registers the native grafts (idempotent). 0 on success, -1 on error (see torchgraft_last_error). */
int torchgraft_enable(void);
/* Removes them, restoring the kernels that were registered before (idempotent); the CPU
   backward stays registered, as graphs recorded while enabled call it (docs/reliability.md). */
void torchgraft_disable(void);
/* 1 while enabled, else 0. */
int torchgraft_is_enabled(void);
/* Calls so far of the graft for `op` (e.g. "aten::_fused_rms_norm") at `dispatch_key` (e.g. "CPU"),
 * or -1 if there is no such graft. */
int64_t torchgraft_calls(const char* op, const char* dispatch_key);
/* 0 when the CUDA grafts are available (number of GPUs in *devices), else -1 with the reason in
 * torchgraft_last_error(). */
int torchgraft_cuda_status(int64_t* devices);
/* The last error of this thread, or "" (valid until the next call on this thread). */
const char* torchgraft_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* TORCHGRAFT_H */

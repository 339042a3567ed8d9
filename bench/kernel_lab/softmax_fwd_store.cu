// Kernel lab (not built into the library): ops/softmax/softmax.cu's forward bulk kernel in both of
// its store modes, for clusters of 2, 4 and 8, bf16: y by the threads' 16-byte stores
// (lab_fwd{C}_threads) or written over the staged x and sent by bulk copy (lab_fwd{C}_bulk).
// Launched by softmax_fwd_store_sweep.py beside this file.
#include "softmax.cu"

#define LAB_FWD(NAME, C, STORE_BULK)                                                        \
  extern "C" __global__ void __launch_bounds__(graft_softmax::kFwdLoopThreads, 1)          \
      GRAFT_CLUSTER_DIMS(C) NAME(const graft_softmax::Params p) {                          \
    graft_softmax::fwd_bulk<__nv_bfloat16, C, STORE_BULK>(p);                              \
  }
LAB_FWD(lab_fwd2_threads, 2, false)
LAB_FWD(lab_fwd2_bulk, 2, true)
LAB_FWD(lab_fwd4_threads, 4, false)
LAB_FWD(lab_fwd4_bulk, 4, true)
LAB_FWD(lab_fwd8_threads, 8, false)
LAB_FWD(lab_fwd8_bulk, 8, true)

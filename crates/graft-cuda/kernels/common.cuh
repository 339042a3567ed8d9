// Pieces shared by the elementwise and row kernels other than RMSNorm: element loads and
// stores through the accumulation type, 16-byte packs, and the grid-stride index type.
//
// Included by each kernels/*.cu that needs it; build.rs compiles all of them as one
// translation unit, so this header is guarded.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace graft_common {

// The type arithmetic happens in: float for float/half/bfloat16, double for double.
template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_acc(typename Acc<T>::type v);
template <>
__device__ __forceinline__ float from_acc<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ double from_acc<double>(double v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_acc<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Sixteen bytes of T: one LDG.128 / STG.128 when the address is 16-byte aligned.
template <typename T>
struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T>*>(p);
}

template <typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T>& v) {
  *reinterpret_cast<Pack<T>*>(p) = v;
}

// Total threads of a 1-D grid and this thread's first index, as 64-bit values.
__device__ __forceinline__ long long grid_threads() {
  return (long long)gridDim.x * blockDim.x;
}
__device__ __forceinline__ long long thread_index() {
  return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}

}  // namespace graft_common

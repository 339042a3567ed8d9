// Copy kernels for bench/kernel_lab/copy_bandwidth_sweep.py: how fast can a kernel that reads
// n 16-byte packs and writes them elsewhere go, by the number of packs a thread keeps in flight
// and the grid's shape? Each kernel takes CopyParams by value.

struct CopyParams {
  const uint4* src;
  uint4* dst;
  long long n;  // 16-byte packs
};

// U packs per thread, loads before stores; a grid that covers the packs (each thread runs once).
template <int U>
__device__ __forceinline__ void copy_covering(const CopyParams& p) {
  const long long base = (long long)blockIdx.x * blockDim.x * U + threadIdx.x;
  uint4 r[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const long long i = base + (long long)u * blockDim.x;
    if (i < p.n) r[u] = p.src[i];
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const long long i = base + (long long)u * blockDim.x;
    if (i < p.n) p.dst[i] = r[u];
  }
}

// The same with a grid of fewer blocks, each looping over the packs (grid-stride).
template <int U>
__device__ __forceinline__ void copy_striding(const CopyParams& p) {
  const long long stride = (long long)gridDim.x * blockDim.x * U;
  for (long long base = (long long)blockIdx.x * blockDim.x * U + threadIdx.x; base < p.n;
       base += stride) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long i = base + (long long)u * blockDim.x;
      if (i < p.n) r[u] = p.src[i];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long i = base + (long long)u * blockDim.x;
      if (i < p.n) p.dst[i] = r[u];
    }
  }
}

#define COPY(NAME, BODY, U) \
  extern "C" __global__ void __launch_bounds__(256) NAME(const CopyParams p) { BODY<U>(p); }
COPY(copy_cover_u1, copy_covering, 1)
COPY(copy_cover_u2, copy_covering, 2)
COPY(copy_cover_u4, copy_covering, 4)
COPY(copy_cover_u8, copy_covering, 8)
COPY(copy_stride_u4, copy_striding, 4)
COPY(copy_stride_u8, copy_striding, 8)

// Copy kernels for bench/kernel_lab/copy_bandwidth_sweep.py: how fast can a kernel that reads
// n 16-byte packs and writes them elsewhere go, by the number of packs a thread keeps in flight
// and the grid's shape? Each kernel takes CopyParams by value.

struct CopyParams {
  const uint4* src;
  uint4* dst;
  long long n;  // 16-byte packs
};

// The U packs of this thread starting at pack `base` (a block's packs interleaved: pack
// base + u * blockDim.x), all loads before the stores.
template <int U>
__device__ __forceinline__ void copy_packs(const CopyParams& p, long long base) {
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

// A grid that covers the packs: each thread copies U of them once.
template <int U>
__device__ __forceinline__ void copy_covering(const CopyParams& p) {
  copy_packs<U>(p, (long long)blockIdx.x * blockDim.x * U + threadIdx.x);
}

// A grid of fewer blocks, each looping over the packs (grid-stride).
template <int U>
__device__ __forceinline__ void copy_striding(const CopyParams& p) {
  const long long stride = (long long)gridDim.x * blockDim.x * U;
  for (long long base = (long long)blockIdx.x * blockDim.x * U + threadIdx.x; base < p.n;
       base += stride) {
    copy_packs<U>(p, base);
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

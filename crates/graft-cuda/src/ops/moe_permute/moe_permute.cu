// Mixture-of-experts token permutation for graft-cuda (T tokens, K experts each, S = T * K
// pairs, pair p = t * K + k; slot s holds pair perm[s], pair p sits at slot inv_perm[p]; slots
// at or beyond `valid` are sentinels):
//
//   sort:          perm, inv_perm, offsets from the pairs' expert ids (a stable counting
//                  sort; ids outside [0, E) sort last, counted in no expert)
//   permute:       out[s] = hidden[perm[s] / K]                       (s < valid; else 0)
//   unpermute:     out[t] = sum_k w[t, k] * y[inv_perm[t * K + k]]     (slots < valid)
//   unpermute_bwd: dy[s] = w[perm[s]] * grad[perm[s] / K]              (s < valid; else 0)
//                  dw[perm[s]] = dot(y[s], grad[perm[s] / K])          (0 for s >= valid)
//
// One warp per output row (a slot, or a token for unpermute), grid-stride over the rows; the
// row's lanes move 16-byte packs when `vec` (every row 16-byte aligned: the base pointers are
// and hidden * sizeof(T) is a multiple of 16), else single elements. Sums and dot products in
// the accumulation type (float; double for double), each output rounded once; a dot product is
// a fixed xor-butterfly over the warp. No atomics: each output element is written by one lane.
//
// `valid` is read on the device (int32 or int64) and clamped to [0, S]; an index outside
// [0, S) makes its slot or pair a sentinel, so no access leaves the arrays (the host does not
// check index values: that would synchronise).

#include "common.cuh"

#ifndef GRAFT_DYN_SMEM
#define GRAFT_DYN_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace graft_moe {

using graft_common::Acc;
using graft_common::from_acc;
using graft_common::Pack;
using graft_common::to_acc;

// Mirrored by #[repr(C)] MoeParams in mod.rs; every field is 8 bytes.
struct MoeParams {
  const void* src;          // hidden (permute), y (unpermute), grad (backward)
  const void* y;            // backward: the forward's y
  const long long* index;   // perm (permute, backward) or inv_perm (unpermute)
  const void* valid;        // one int32 or int64
  const void* weights;      // (S,) of W, or null
  void* out;                // (rows, hidden)
  void* dweights;           // backward with weights: (S,) of W
  long long rows;           // output rows: S, or T for unpermute
  long long pairs;          // S
  long long hidden;
  long long top_k;
  long long valid_i64;      // 1: valid is int64; 0: int32
  long long vec;
};

__device__ __forceinline__ long long read_valid(const MoeParams& p) {
  const long long v = p.valid_i64 ? *static_cast<const long long*>(p.valid)
                                  : (long long)*static_cast<const int*>(p.valid);
  return v < 0 ? 0 : (v > p.pairs ? p.pairs : v);
}

// This warp's first row, the rows between its visits, and its lane.
struct Warp {
  long long first, stride;
  int lane;
  __device__ __forceinline__ Warp() {
    const int warps = int(blockDim.x >> 5);
    first = (long long)blockIdx.x * warps + (threadIdx.x >> 5);
    stride = (long long)gridDim.x * warps;
    lane = int(threadIdx.x & 31);
  }
};

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T>
__device__ void permute(const MoeParams& p) {
  const T* src = static_cast<const T*>(p.src);
  T* out = static_cast<T*>(p.out);
  const long long valid = read_valid(p), h = p.hidden;
  const T zero = from_acc<T>(typename Acc<T>::type(0));
  const Warp w;
  for (long long s = w.first; s < p.rows; s += w.stride) {
    const long long pair = s < valid ? p.index[s] : -1;
    const bool real = pair >= 0 && pair < p.pairs;
    const T* row = src + (real ? pair / p.top_k : 0) * h;
    T* dst = out + s * h;
    if (p.vec) {
      constexpr int N = Pack<T>::N;
      Pack<T> zeros;
#pragma unroll
      for (int e = 0; e < N; ++e) zeros.v[e] = zero;
      for (long long j = w.lane; j < h / N; j += 32) {
        graft_common::store_pack(dst + j * N, real ? graft_common::load_pack(row + j * N) : zeros);
      }
    } else {
      for (long long c = w.lane; c < h; c += 32) dst[c] = real ? row[c] : zero;
    }
  }
}

template <typename T, typename W, bool WEIGHTED>
__device__ void unpermute(const MoeParams& p) {
  using A = typename Acc<T>::type;
  const T* y = static_cast<const T*>(p.src);
  const W* weights = static_cast<const W*>(p.weights);
  T* out = static_cast<T*>(p.out);
  const long long valid = read_valid(p), h = p.hidden, kk = p.top_k;
  const Warp w;
  for (long long t = w.first; t < p.rows; t += w.stride) {
    const long long* slots = p.index + t * kk;
    T* dst = out + t * h;
    if (p.vec) {
      constexpr int N = Pack<T>::N;
      for (long long j = w.lane; j < h / N; j += 32) {
        A acc[N];
#pragma unroll
        for (int e = 0; e < N; ++e) acc[e] = A(0);
        for (long long k = 0; k < kk; ++k) {
          const long long s = slots[k];
          if (s < 0 || s >= valid) continue;
          const A wk = WEIGHTED ? A(to_acc(weights[t * kk + k])) : A(1);
          const Pack<T> v = graft_common::load_pack(y + s * h + j * N);
#pragma unroll
          for (int e = 0; e < N; ++e) acc[e] += wk * to_acc(v.v[e]);
        }
        Pack<T> o;
#pragma unroll
        for (int e = 0; e < N; ++e) o.v[e] = from_acc<T>(acc[e]);
        graft_common::store_pack(dst + j * N, o);
      }
    } else {
      for (long long c = w.lane; c < h; c += 32) {
        A acc = A(0);
        for (long long k = 0; k < kk; ++k) {
          const long long s = slots[k];
          if (s < 0 || s >= valid) continue;
          const A wk = WEIGHTED ? A(to_acc(weights[t * kk + k])) : A(1);
          acc += wk * to_acc(y[s * h + c]);
        }
        dst[c] = from_acc<T>(acc);
      }
    }
  }
}

template <typename T, typename W, bool WEIGHTED>
__device__ void unpermute_backward(const MoeParams& p) {
  using A = typename Acc<T>::type;
  const T* grad = static_cast<const T*>(p.src);
  const T* y = static_cast<const T*>(p.y);
  const W* weights = static_cast<const W*>(p.weights);
  T* dy = static_cast<T*>(p.out);
  W* dweights = static_cast<W*>(p.dweights);
  const long long valid = read_valid(p), h = p.hidden;
  const Warp w;
  for (long long s = w.first; s < p.rows; s += w.stride) {
    const long long pair = p.index[s];
    const bool in_range = pair >= 0 && pair < p.pairs;
    const bool real = in_range && s < valid;
    const A wp = WEIGHTED && real ? A(to_acc(weights[pair])) : A(1);
    const T* g = grad + (real ? pair / p.top_k : 0) * h;
    const T* ys = y + s * h;
    T* dst = dy + s * h;
    A dot = A(0);
    if (p.vec) {
      constexpr int N = Pack<T>::N;
      for (long long j = w.lane; j < h / N; j += 32) {
        Pack<T> o;
        if (real) {
          const Pack<T> gv = graft_common::load_pack(g + j * N);
          if (WEIGHTED) {
            const Pack<T> yv = graft_common::load_pack(ys + j * N);
#pragma unroll
            for (int e = 0; e < N; ++e) {
              const A ge = to_acc(gv.v[e]);
              o.v[e] = from_acc<T>(wp * ge);
              dot += to_acc(yv.v[e]) * ge;
            }
          } else {
            o = gv;
          }
        } else {
#pragma unroll
          for (int e = 0; e < N; ++e) o.v[e] = from_acc<T>(A(0));
        }
        graft_common::store_pack(dst + j * N, o);
      }
    } else {
      for (long long c = w.lane; c < h; c += 32) {
        if (real) {
          const A ge = to_acc(g[c]);
          dst[c] = from_acc<T>(wp * ge);
          if (WEIGHTED) dot += to_acc(ys[c]) * ge;
        } else {
          dst[c] = from_acc<T>(A(0));
        }
      }
    }
    if (WEIGHTED) {
      dot = warp_sum(dot);
      if (w.lane == 0 && in_range) {
        dweights[pair] = from_acc<W>(typename Acc<W>::type(real ? dot : A(0)));
      }
    }
  }
}

// ----------------------------------------------------------------------------- the sort
//
// Two launches over the same chunks of pairs (chunk c: pairs [c * chunk, (c + 1) * chunk)),
// one block per chunk, no atomics in global memory (the result is the same on every run):
//   sort_count: counts[c][key] = the pairs of each key in chunk c;
//   sort_place: a key's first slot for chunk c is every smaller key's total plus this key's
//               pairs in the chunks before c; the chunk is then walked in tiles of the block's
//               threads, each pair's slot that start plus the pairs of its key before it
//               (earlier tiles, earlier warps of this tile, lower lanes of its warp).
// A pair's key is its expert id when in [0, E), else E (another rank's expert: last).

constexpr int kSortThreads = 128;
constexpr int kSortWarps = kSortThreads / 32;

// Mirrored by #[repr(C)] SortParams in mod.rs; every field is 8 bytes.
struct SortParams {
  const long long* ids;  // (S,)
  long long* perm;       // (S,)
  long long* inv_perm;   // (S,)
  int* offsets;          // (E,): the end of each expert's slots
  int* counts;           // (chunks, E + 1) workspace
  long long pairs;       // S
  long long experts;     // E
  long long chunk;       // pairs per block
};

__device__ __forceinline__ int sort_key(long long id, long long experts) {
  return id >= 0 && id < experts ? int(id) : int(experts);
}

__device__ void sort_count(const SortParams& p) {
  GRAFT_DYN_SMEM(smem);
  int* n = reinterpret_cast<int*>(smem);
  const int keys = int(p.experts) + 1;
  for (int k = threadIdx.x; k < keys; k += blockDim.x) n[k] = 0;
  __syncthreads();
  const long long begin = (long long)blockIdx.x * p.chunk;
  const long long end = begin + p.chunk < p.pairs ? begin + p.chunk : p.pairs;
  for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
    atomicAdd(&n[sort_key(p.ids[i], p.experts)], 1);  // shared memory: a count, order-free
  }
  __syncthreads();
  for (int k = threadIdx.x; k < keys; k += blockDim.x) p.counts[blockIdx.x * keys + k] = n[k];
}

__device__ void sort_place(const SortParams& p) {
  GRAFT_DYN_SMEM(smem);
  const int keys = int(p.experts) + 1;
  int* start = reinterpret_cast<int*>(smem);  // (keys): the next slot of each key
  int* warp_n = start + keys;                 // (warps, keys): a tile's pairs per warp and key
  int* part = warp_n + kSortWarps * keys;     // (threads): the scan of key totals
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int chunks = gridDim.x, c = blockIdx.x;
  // Each thread owns keys [k0, k1): their totals (in start) and their pairs in earlier chunks
  // (in warp_n's first row), then its keys' total in part.
  const int per = (keys + kSortThreads - 1) / kSortThreads;
  const int k0 = tid * per < keys ? tid * per : keys;
  const int k1 = k0 + per < keys ? k0 + per : keys;
  int mine = 0;
  for (int k = k0; k < k1; ++k) {
    int total = 0, before = 0;
    for (int b = 0; b < chunks; ++b) {
      const int n = p.counts[b * keys + k];
      total += n;
      before += b < c ? n : 0;
    }
    start[k] = total;
    warp_n[k] = before;
    mine += total;
  }
  part[tid] = mine;
  __syncthreads();
  if (tid == 0) {
    int run = 0;
    for (int t = 0; t < kSortThreads; ++t) {
      const int n = part[t];
      part[t] = run;
      run += n;
    }
  }
  __syncthreads();
  int run = part[tid];
  for (int k = k0; k < k1; ++k) {
    const int total = start[k];
    start[k] = run + warp_n[k];
    run += total;
    if (c == 0 && k < p.experts) p.offsets[k] = run;
  }
  __syncthreads();
  for (int k = tid; k < kSortWarps * keys; k += kSortThreads) warp_n[k] = 0;
  __syncthreads();

  const long long begin = (long long)c * p.chunk;
  const long long end = begin + p.chunk < p.pairs ? begin + p.chunk : p.pairs;
  for (long long base = begin; base < end; base += kSortThreads) {
    const long long i = base + tid;
    const int key = i < end ? sort_key(p.ids[i], p.experts) : -1;
    const unsigned same = __match_any_sync(0xffffffffu, key);
    const int rank = __popc(same & ((1u << lane) - 1u));  // lower lanes of this key
    const bool leader = rank == 0 && key >= 0;
    if (leader) warp_n[warp * keys + key] = __popc(same);
    __syncthreads();
    if (key >= 0) {
      int slot = start[key] + rank;
      for (int w = 0; w < warp; ++w) slot += warp_n[w * keys + key];
      p.perm[slot] = i;
      p.inv_perm[i] = slot;
    }
    __syncthreads();
    if (leader) {
      atomicAdd(&start[key], __popc(same));  // shared memory: the warps' counts of one key
      warp_n[warp * keys + key] = 0;
    }
    __syncthreads();
  }
}

}  // namespace graft_moe

// The sort's two entry points (kSortThreads threads per block; mod.rs sizes the shared memory:
// 4 * (E + 1) bytes for the count, 4 * ((1 + warps) * (E + 1) + threads) for the placement).
extern "C" __global__ void __launch_bounds__(graft_moe::kSortThreads)
    graft_moe_sort_count(const graft_moe::SortParams p) {
  graft_moe::sort_count(p);
}
extern "C" __global__ void __launch_bounds__(graft_moe::kSortThreads)
    graft_moe_sort_place(const graft_moe::SortParams p) {
  graft_moe::sort_place(p);
}

// Entry points, 256 threads per block (mod.rs launches them so; any multiple of 32 works), at
// least 4 blocks per SM: up to 64 registers a thread (with no minimum, ptxas gave the unweighted
// unpermute 32 on sm_100 and spilled):
//   graft_moe_permute_{f32,f64,f16,bf16}
//   graft_moe_unpermute_{dt}_{none,same,acc}, graft_moe_unpermute_bwd_{dt}_{none,same,acc}
// with the weights of none, of the element type (same) or of its accumulation type (acc).
#define GRAFT_MOE_WEIGHTED(DT, T, WN, W, WEIGHTED)                                         \
  extern "C" __global__ void __launch_bounds__(256, 4)                                     \
      graft_moe_unpermute_##DT##_##WN(const graft_moe::MoeParams p) {                      \
    graft_moe::unpermute<T, W, WEIGHTED>(p);                                               \
  }                                                                                        \
  extern "C" __global__ void __launch_bounds__(256, 4)                                     \
      graft_moe_unpermute_bwd_##DT##_##WN(const graft_moe::MoeParams p) {                  \
    graft_moe::unpermute_backward<T, W, WEIGHTED>(p);                                      \
  }

#define GRAFT_MOE(DT, T)                                                                   \
  extern "C" __global__ void __launch_bounds__(256, 4)                                     \
      graft_moe_permute_##DT(const graft_moe::MoeParams p) {                               \
    graft_moe::permute<T>(p);                                                              \
  }                                                                                        \
  GRAFT_MOE_WEIGHTED(DT, T, none, T, false)                                                \
  GRAFT_MOE_WEIGHTED(DT, T, same, T, true)                                                 \
  GRAFT_MOE_WEIGHTED(DT, T, acc, graft_common::Acc<T>::type, true)

GRAFT_MOE(f32, float)
GRAFT_MOE(f64, double)
GRAFT_MOE(f16, __half)
GRAFT_MOE(bf16, __nv_bfloat16)

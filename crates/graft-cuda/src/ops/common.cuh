// Pieces shared by the elementwise and row kernels other than RMSNorm: element loads and
// stores through the accumulation type, 16-byte packs and row units, row-group reductions,
// and the grid-stride index type.
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

__device__ __forceinline__ float max_acc(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_acc(double a, double b) { return fmax(a, b); }

struct MaxOp {
  template <typename A>
  __device__ __forceinline__ A operator()(A a, A b) const {
    return max_acc(a, b);
  }
};
struct SumOp {
  template <typename A>
  __device__ __forceinline__ A operator()(A a, A b) const {
    return a + b;
  }
};

// Reduction over the `tpr` threads of a row group (all of them get the same bits: xor
// butterflies combine commutative pairs; the cross-warp step reads shared memory in a fixed
// order). `red` holds 32 values; callers alternate two buffers, one barrier per reduction.
template <typename A, typename Op>
__device__ __forceinline__ A group_reduce(A v, int tpr, A* red, Op op) {
  const int width = tpr < 32 ? tpr : 32;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    if (o < width) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  if (tpr > 32) {
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    const int nw = tpr >> 5;
    const int w0 = (warp / nw) * nw;
    v = red[w0];
    for (int i = 1; i < nw; ++i) v = op(v, red[w0 + i]);
  }
  return v;
}

// Two sums over the `tpr` threads of a row group at once, with group_reduce's rules: one
// barrier for both. `red` holds 2 x 32 values; callers alternate two buffers.
template <typename A>
__device__ __forceinline__ void group_sum_pair(A& a, A& b, int tpr, A (*red)[32]) {
  const int width = tpr < 32 ? tpr : 32;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    if (o < width) {
      a += __shfl_xor_sync(0xffffffffu, a, o);
      b += __shfl_xor_sync(0xffffffffu, b, o);
    }
  }
  if (tpr > 32) {
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
      red[0][warp] = a;
      red[1][warp] = b;
    }
    __syncthreads();
    const int nw = tpr >> 5;
    const int w0 = (warp / nw) * nw;
    a = red[0][w0];
    b = red[1][w0];
    for (int i = 1; i < nw; ++i) {
      a += red[0][w0 + i];
      b += red[1][w0 + i];
    }
  }
}

// Asynchronous 16-byte copies global -> shared (cp.async, sm_80+), which hold no registers
// while in flight; a plain copy where cp.async does not exist (the CPU emulator). A thread
// waits only for its own copies: callers read back only what the same thread copied.
template <typename T>
__device__ __forceinline__ void copy_async(Pack<T>* smem, const T* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
#else
  *smem = load_pack(gmem);
#endif
}

// Closes this thread's group of copies issued since the last commit.
__device__ __forceinline__ void copy_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most one of this thread's committed groups is still in flight.
__device__ __forceinline__ void copy_async_wait_all_but_one() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
#endif
}

// Waits until all of this thread's copies have landed.
__device__ __forceinline__ void copy_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// L2 eviction priorities for 16-byte accesses (sm_80+; plain accesses where the hints do not
// exist, e.g. the CPU emulator): data read now and again soon stays (`evict_last`); data read
// or written for the last time goes first (`evict_first`); `evict_normal` is the default. A
// policy is made once per thread. The hinted load and store carry no memory clobber, so that
// the compiler may still batch a loop's loads ahead of its stores; the load may then move
// across other memory accesses and barriers too. Use them only on data no other thread writes
// meanwhile, where a thread reads each address before it writes it (the data dependence keeps
// that order).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define GRAFT_L2_POLICY(NAME, PRIORITY)                                               \
  __device__ __forceinline__ unsigned long long NAME() {                               \
    unsigned long long policy;                                                         \
    asm("createpolicy.fractional.L2::" PRIORITY ".b64 %0, 1.0;" : "=l"(policy));       \
    return policy;                                                                     \
  }
#else
#define GRAFT_L2_POLICY(NAME, PRIORITY) \
  __device__ __forceinline__ unsigned long long NAME() { return 0; }
#endif
GRAFT_L2_POLICY(l2_evict_last_policy, "evict_last")
GRAFT_L2_POLICY(l2_evict_normal_policy, "evict_normal")
GRAFT_L2_POLICY(l2_evict_first_policy, "evict_first")
#undef GRAFT_L2_POLICY

template <typename T>
__device__ __forceinline__ Pack<T> load_pack_hinted(const T* p, unsigned long long policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  Pack<T> out;
  unsigned* r = reinterpret_cast<unsigned*>(&out);
  asm("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "l"(p), "l"(policy));
  return out;
#else
  (void)policy;
  return load_pack(p);
#endif
}

template <typename T>
__device__ __forceinline__ void store_pack_hinted(T* p, const Pack<T>& v,
                                                  unsigned long long policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned* r = reinterpret_cast<const unsigned*>(&v);
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]), "l"(policy));
#else
  (void)policy;
  store_pack(p, v);
#endif
}

// Thread-block clusters (sm_90+; a kernel declares its size with GRAFT_CLUSTER_DIMS): this
// block's rank in its cluster; the two halves of a barrier over every thread of the cluster
// (arrive releases this thread's earlier shared-memory accesses, wait acquires the others'),
// which must alternate; and a load from the shared memory of the cluster's block `rank`.
// Kernels that use them are launched only on sm_90 and newer: on older archs they trap, and
// the CPU emulator, which runs one block at a time, has clusters of one block.
//
// Also sm_90+: mbarriers (`mbarrier_*`: one arrival, by the thread that announces how many
// bytes will land, and a transaction count the bytes bring down; a wait is for a phase, by
// its parity), bulk copies from global to this block's shared memory that complete on an
// mbarrier (TMA without a tensor map: 16-byte aligned addresses and sizes), and a pair of
// floats stored into block `rank`'s shared memory that completes on that block's mbarrier
// (st.async). Bulk copies the other way, from shared to global memory, complete in bulk
// groups, which the issuing thread waits for: until they have read shared memory (which may
// then be overwritten), or until done. The emulator copies and stores at once; its waits let
// the block's other threads run until the phase completes.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define GRAFT_CLUSTER_DIMS(C) __cluster_dims__(C, 1, 1)
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ unsigned cluster_address(const void* local, unsigned rank) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned remote;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(a), "r"(rank));
  return remote;
}
__device__ __forceinline__ float load_from_rank(const float* local, unsigned rank) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];"
               : "=f"(v)
               : "r"(cluster_address(local, rank))
               : "memory");
  return v;
}
__device__ __forceinline__ double load_from_rank(const double* local, unsigned rank) {
  double v;
  asm volatile("ld.shared::cluster.f64 %0, [%1];"
               : "=d"(v)
               : "r"(cluster_address(local, rank))
               : "memory");
  return v;
}
__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// Initialises `bar` for one arrival a phase, visible to the cluster and the copy engine.
__device__ __forceinline__ void mbarrier_init(unsigned long long* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// The phase's arrival, announcing `bytes` still to land.
__device__ __forceinline__ void mbarrier_expect_bytes(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                   shared_address(bar)),
               "r"(bytes)
               : "memory");
}
// Returns once the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}
// Orders this thread's earlier shared-memory accesses before later bulk copies' writes.
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, unsigned bytes,
                                                    unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar))
      : "memory");
}
// Starts a bulk copy of `bytes` from this block's shared memory to global memory, as a bulk
// group of its own.
__device__ __forceinline__ void bulk_copy_to_global(void* dst, const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(shared_address(src)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Returns once this thread's bulk copies to global memory have read their shared memory.
__device__ __forceinline__ void bulk_copies_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
// Returns once this thread's bulk copies to global memory are done.
__device__ __forceinline__ void bulk_copies_done() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
// Stores (a, b) at `local`'s address in block `rank`'s shared memory; 8 bytes for `bar` there.
__device__ __forceinline__ void push_pair_to_rank(float* local, unsigned rank, float a, float b,
                                                  unsigned long long* bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::"r"(
          cluster_address(local, rank)),
      "f"(a), "f"(b), "r"(cluster_address(bar, rank))
      : "memory");
}
#else
#define GRAFT_CLUSTER_DIMS(C)
#if defined(__CUDA_ARCH__)
#define GRAFT_NO_CLUSTERS() __trap()
#else
#define GRAFT_NO_CLUSTERS() (void)0
#endif
__device__ __forceinline__ unsigned cluster_rank() {
  GRAFT_NO_CLUSTERS();
  return 0;
}
__device__ __forceinline__ void cluster_arrive() { GRAFT_NO_CLUSTERS(); }
__device__ __forceinline__ void cluster_wait() { GRAFT_NO_CLUSTERS(); }
template <typename A>
__device__ __forceinline__ A load_from_rank(const A* local, unsigned rank) {
  GRAFT_NO_CLUSTERS();
  (void)rank;
  return *local;
}
// The emulator's mbarrier, in the 8 bytes of one: bytes still to land, whether the phase's
// arrival came, and the phases completed. A wait yields to the other threads of the block
// (GRAFT_EMU_YIELD, from emu/cuda_emu.h) until its phase completes.
struct EmuBarrier {
  long long pending;
  unsigned arrived, phases;
};
__device__ __forceinline__ EmuBarrier emu_barrier(const unsigned long long* bar) {
  const long long v = static_cast<long long>(*bar);
  return EmuBarrier{(v << 32) >> 32, unsigned(v >> 32) & 1u, unsigned(v >> 33)};
}
// Stores `e`, completing its phase once it has its arrival and no bytes are pending.
__device__ __forceinline__ void emu_barrier_set(unsigned long long* bar, EmuBarrier e) {
  if (e.arrived && e.pending == 0) {
    e.arrived = 0;
    ++e.phases;
  }
  *bar = (static_cast<unsigned long long>(e.phases) << 33) |
         (static_cast<unsigned long long>(e.arrived) << 32) |
         static_cast<unsigned>(static_cast<int>(e.pending));
}
__device__ __forceinline__ void mbarrier_init(unsigned long long* bar) {
  GRAFT_NO_CLUSTERS();
  *bar = 0;
}
__device__ __forceinline__ void mbarrier_expect_bytes(unsigned long long* bar, unsigned bytes) {
  GRAFT_NO_CLUSTERS();
  EmuBarrier e = emu_barrier(bar);
  e.pending += bytes;
  e.arrived = 1;
  emu_barrier_set(bar, e);
}
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned parity) {
  GRAFT_NO_CLUSTERS();
  while ((emu_barrier(bar).phases & 1u) == parity) {
#ifdef GRAFT_EMU_YIELD
    GRAFT_EMU_YIELD();
#endif
  }
}
__device__ __forceinline__ void fence_async_shared() { GRAFT_NO_CLUSTERS(); }
__device__ __forceinline__ void landed(unsigned long long* bar, unsigned bytes) {
  EmuBarrier e = emu_barrier(bar);
  e.pending -= bytes;
  emu_barrier_set(bar, e);
}
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, unsigned bytes,
                                                    unsigned long long* bar) {
  GRAFT_NO_CLUSTERS();
  memcpy(dst, src, bytes);
  landed(bar, bytes);
}
__device__ __forceinline__ void bulk_copy_to_global(void* dst, const void* src, unsigned bytes) {
  GRAFT_NO_CLUSTERS();
  memcpy(dst, src, bytes);
}
__device__ __forceinline__ void bulk_copies_read() { GRAFT_NO_CLUSTERS(); }
__device__ __forceinline__ void bulk_copies_done() { GRAFT_NO_CLUSTERS(); }
__device__ __forceinline__ void push_pair_to_rank(float* local, unsigned rank, float a, float b,
                                                  unsigned long long* bar) {
  GRAFT_NO_CLUSTERS();
  (void)rank;  // 0: the emulator's clusters are one block
  local[0] = a;
  local[1] = b;
  landed(bar, 8);
}
#undef GRAFT_NO_CLUSTERS
#endif

// 2^x by the SFU with results below 2^-126 flushed to zero: one instruction where exp2f takes
// four (it rescales around the SFU to keep subnormal results). For kernels whose outputs are
// 16-bit: a flushed value is below bf16's smallest normal and f16's smallest subnormal. The
// emulator computes exp2f.
__device__ __forceinline__ float exp2_ftz(float x) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  return exp2f(x);
#endif
}

// Units: 16 bytes of a row's element type (N = 16 / sizeof(T) elements), widened to A.

template <typename T>
struct Units {
  static constexpr int N = 16 / sizeof(T);
};

// Unit j of a row into v[]; elements past `cols` (scalar path) or of a missing unit get `pad`.
template <typename T, typename A, int N>
__device__ __forceinline__ void load_unit(A (&v)[N], const T* __restrict__ row, long long j,
                                          long long cols, bool vec, bool valid, A pad) {
  if (valid && vec) {
    const graft_common::Pack<T> p = graft_common::load_pack(row + j * N);
#pragma unroll
    for (int e = 0; e < N; ++e) v[e] = A(to_acc(p.v[e]));
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const long long c = j * N + e;
      v[e] = (valid && c < cols) ? A(to_acc(row[c])) : pad;
    }
  }
}

// N values rounded to TO stored as columns [j * N, j * N + N) of a row: one or two 16-byte
// stores (or one 8-byte store for 4 halves) on the vector path, else element by element.
template <typename TO, typename A, int N>
__device__ __forceinline__ void store_unit(TO* __restrict__ row, const A (&v)[N], long long j,
                                           long long cols, bool vec) {
  if (vec) {
    struct alignas(16) Out {
      TO v[N];
    } o;
#pragma unroll
    for (int e = 0; e < N; ++e) o.v[e] = from_acc<TO>(typename Acc<TO>::type(v[e]));
    constexpr int kBytes = int(N * sizeof(TO));
    if constexpr (kBytes % 16 == 0) {
      const uint4* src = reinterpret_cast<const uint4*>(&o);
      uint4* dst = reinterpret_cast<uint4*>(row + j * N);
#pragma unroll
      for (int i = 0; i < kBytes / 16; ++i) dst[i] = src[i];
    } else {
      static_assert(kBytes == 8, "a unit of output is 8 bytes or whole 16-byte vectors");
      *reinterpret_cast<unsigned long long*>(row + j * N) =
          *reinterpret_cast<const unsigned long long*>(&o);
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const long long c = j * N + e;
      if (c < cols) row[c] = from_acc<TO>(typename Acc<TO>::type(v[e]));
    }
  }
}

// Total threads of a 1-D grid and this thread's first index, as 64-bit values.
__device__ __forceinline__ long long grid_threads() {
  return (long long)gridDim.x * blockDim.x;
}
__device__ __forceinline__ long long thread_index() {
  return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}

// ---------------------------------------------------------------------------------------
// Rows split over a thread-block cluster (the softmax and LayerNorm bulk kernels).

// The units [lo, hi) of a row that block `rank` of a cluster of C owns.
template <int C>
struct Slice {
  long long lo, hi;
  __device__ __forceinline__ Slice(long long nunits) {
    const long long per = (nunits + C - 1) / C;
    const long long rank = C > 1 ? (long long)graft_common::cluster_rank() : 0;
    lo = rank * per < nunits ? rank * per : nunits;
    hi = lo + per < nunits ? lo + per : nunits;
  }
};

// Barriers and slots of a bulk kernel's block, and the start and end of its walk.
template <int C>
struct BulkSync {
  struct alignas(8) Slot {
    float a, b;  // st.async stores 8 aligned bytes
  };
  unsigned long long loaded[2];    // mbarriers, by buffer
  unsigned long long received[2];  // mbarriers, by row parity
  Slot slots[2][C];                // [parity][rank]

  __device__ __forceinline__ void start() {
    if (threadIdx.x == 0) {
      for (int b = 0; b < 2; ++b) {
        graft_common::mbarrier_init(&loaded[b]);
        graft_common::mbarrier_init(&received[b]);
      }
    }
    __syncthreads();
    // No block pushes a partial before every block's mbarriers are initialised.
    if constexpr (C > 1) {
      graft_common::cluster_arrive();
      graft_common::cluster_wait();
    }
  }
  // No block exits while a peer's st.async may still be writing to it.
  __device__ __forceinline__ void finish() {
    if constexpr (C > 1) {
      graft_common::cluster_arrive();
      graft_common::cluster_wait();
    }
  }
  // Walks the block's rows of a persistent grid of clusters: row blockIdx.x / C, then every
  // (gridDim.x / C)th. Thread 0 calls `fetch(row, b)` to start the bulk copies of a row's slice
  // into buffer b, completing on loaded[b], one row ahead; `body(row, b, i)` then runs on row
  // number i of the walk, in buffer b = i & 1.
  template <typename Fetch, typename Body>
  __device__ __forceinline__ void walk(long long rows, Fetch fetch, Body body) {
    const long long clusters = gridDim.x / C;
    long long row = blockIdx.x / C;
    start();
    if (threadIdx.x == 0 && row < rows) fetch(row, 0);
    for (long long i = 0; row < rows; ++i, row += clusters) {
      const int b = int(i & 1);
      if (threadIdx.x == 0 && row + clusters < rows) {
        graft_common::fence_async_shared();  // the buffer's reads (two rows back) come first
        fetch(row + clusters, b ^ 1);
      }
      graft_common::mbarrier_wait(&loaded[b], unsigned(i >> 1) & 1u);
      body(row, b, i);
      __syncthreads();  // buffer b is read: the next row's copy may overwrite it
    }
    finish();
  }
  // Sends this block's (a, b) for row number i to every block of the cluster; returns with
  // lane l of every warp holding block l's pair (lanes from C on hold (ida, idb)).
  __device__ __forceinline__ void exchange(float& a, float& b, long long i, float ida,
                                           float idb) {
    const int par = int(i & 1);
    if (threadIdx.x == 0) graft_common::mbarrier_expect_bytes(&received[par], C * 8);
    if (threadIdx.x < C) {
      graft_common::push_pair_to_rank(&slots[par][graft_common::cluster_rank()].a, threadIdx.x,
                                      a, b, &received[par]);
    }
    graft_common::mbarrier_wait(&received[par], unsigned(i >> 1) & 1u);
    const unsigned lane = threadIdx.x & 31;
    a = lane < C ? slots[par][lane].a : ida;
    b = lane < C ? slots[par][lane].b : idb;
  }
};

// Accumulation-type math for the routing kernels (topk_softmax.cu, topk_sigmoid.cu).
__device__ __forceinline__ float exp_acc(float v) { return expf(v); }
__device__ __forceinline__ double exp_acc(double v) { return exp(v); }

// 1 / v without a call: the hardware's approximation (rcp.approx) refined by Newton steps, one
// for float (from about an ulp), three for double (from about 2^-22). The correctly rounded
// reciprocal and division have slow paths that are calls, whose saved registers spilled in the
// routing kernels' register variants (ptxas: __frcp_rn). v must be a normal number or NaN (the
// callers' operands: sums of at least one probability or exponential, or 1 + exp(-x) scaled
// into range). The emulator divides.
__device__ __forceinline__ float rcp_approx(float v) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
#else
  return 1.0f / v;
#endif
}
__device__ __forceinline__ double rcp_approx(double v) {
#if defined(__CUDA_ARCH__)
  double r;
  asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(r) : "d"(v));
  return r;
#else
  return 1.0 / v;
#endif
}
template <typename A>
__device__ __forceinline__ A recip(A v) {
  constexpr int kSteps = sizeof(A) == 8 ? 3 : 1;
  A r = rcp_approx(v);
#pragma unroll
  for (int i = 0; i < kSteps; ++i) r = fma(r, fma(-v, r, A(1)), r);
  return r;
}

// a / b from inv = recip(b): a * inv corrected once (Markstein), the correctly rounded quotient
// of the CPU kernels' division or within an ulp of it, for the routing kernels' operands (b a
// sum of exponentials or scores, at least one of them; 0 <= a <= b).
template <typename A>
__device__ __forceinline__ A divide(A a, A b, A inv) {
  const A q = a * inv;
  return fma(fma(-q, b, a), inv, q);
}

}  // namespace graft_common

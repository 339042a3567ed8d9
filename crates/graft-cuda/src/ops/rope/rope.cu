// Rotary position embedding (transformers' `rotate_half` convention) for graft-cuda: q and k
// in one launch, forward and backward. For a row x of head_dim elements and h = rotary_dim/2,
//   forward:   out[j] = x[j] cos[j] - x[j+h] sin[j]      out[j+h] = x[j+h] cos[j+h] + x[j] sin[j+h]
//   backward:  out[j] = g[j] cos[j] + g[j+h] sin[j+h]    out[j+h] = g[j+h] cos[j+h] - g[j] sin[j]
// for j < h, and out[j] = x[j] for rotary_dim <= j < head_dim (partial rotary embeddings).
// Arithmetic in the accumulation type, each output rounded once.
//
// Layout: each operand's rows are addressed by three leading indices (i0, i1, i2) with
// per-operand strides for x, cos and sin (0 where a table row serves many heads), so that
// transposed views are read in place; the output is dense, row r = (i0*n1 + i1)*n2 + i2 at
// r*head_dim. A work unit is V elements of the first half together with the V matching
// elements of the second (or V pass-through elements); V is the 16-byte pack size when every
// row start is 16-byte aligned and h and head_dim - rotary_dim are multiples of it, else 1.

#include "common.cuh"

namespace graft_rope {

using graft_common::Acc;
using graft_common::from_acc;
using graft_common::Pack;
using graft_common::to_acc;

// Mirrored by #[repr(C)] RopeOperandParams in src/rope.rs; every field is 8 bytes.
struct RopeOperand {
  const void* x;
  void* out;
  long long sizes[3];
  long long x_strides[3];
  long long cos_strides[3];
  long long sin_strides[3];
  long long head_dim;
  long long units;  // rows * units per row
};

// Mirrored by #[repr(C)] RopeParams in src/rope.rs.
struct RopeParams {
  RopeOperand op[2];
  const void* cos;
  const void* sin;
  long long rotary_dim;
};

// a / b and a % b, in 32 bits when both fit (integer division is a long sequence on the GPU,
// twice as long in 64 bits).
__device__ __forceinline__ void divmod(unsigned long long a, unsigned long long b,
                                       unsigned long long& q, unsigned long long& r) {
  if ((a | b) >> 32 == 0) {
    const unsigned a32 = (unsigned)a, b32 = (unsigned)b;
    q = a32 / b32;
    r = a32 - (unsigned)q * b32;
  } else {
    q = a / b;
    r = a - q * b;
  }
}

// V consecutive elements of T.
template <typename T, int V>
struct Chunk {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Chunk<T, V> load(const T* p) {
  Chunk<T, V> c;
  if constexpr (V == Pack<T>::N) {
    const Pack<T> pk = graft_common::load_pack(p);
#pragma unroll
    for (int e = 0; e < V; ++e) c.v[e] = pk.v[e];
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) c.v[e] = p[e];
  }
  return c;
}

template <typename T, int V>
__device__ __forceinline__ void store(T* p, const Chunk<T, V>& c) {
  if constexpr (V == Pack<T>::N) {
    Pack<T> pk;
#pragma unroll
    for (int e = 0; e < V; ++e) pk.v[e] = c.v[e];
    graft_common::store_pack(p, pk);
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) p[e] = c.v[e];
  }
}

template <typename T, int V, bool BWD>
__device__ __forceinline__ void unit(const RopeParams& p, const RopeOperand& op,
                                     unsigned long long u) {
  using A = typename Acc<T>::type;
  const long long d = op.head_dim, r = p.rotary_dim, h = r / 2;
  const unsigned long long per_row = (unsigned long long)(h / V + (d - r) / V);
  unsigned long long row, k, t, i0, i1, i2;
  divmod(u, per_row, row, k);
  divmod(row, (unsigned long long)op.sizes[2], t, i2);
  divmod(t, (unsigned long long)op.sizes[1], i0, i1);
  const long long xo = i0 * op.x_strides[0] + i1 * op.x_strides[1] + i2 * op.x_strides[2];
  const T* x = static_cast<const T*>(op.x) + xo;
  T* out = static_cast<T*>(op.out) + (long long)row * d;
  const long long rot_units = h / V;
  if ((long long)k >= rot_units) {  // pass-through elements
    const long long j = r + ((long long)k - rot_units) * V;
    store<T, V>(out + j, load<T, V>(x + j));
    return;
  }
  const long long j = (long long)k * V;
  const long long co = i0 * op.cos_strides[0] + i1 * op.cos_strides[1] + i2 * op.cos_strides[2];
  const long long so = i0 * op.sin_strides[0] + i1 * op.sin_strides[1] + i2 * op.sin_strides[2];
  const T* cos = static_cast<const T*>(p.cos) + co;
  const T* sin = static_cast<const T*>(p.sin) + so;
  const Chunk<T, V> x1 = load<T, V>(x + j), x2 = load<T, V>(x + h + j);
  const Chunk<T, V> c1 = load<T, V>(cos + j), c2 = load<T, V>(cos + h + j);
  const Chunk<T, V> s1 = load<T, V>(sin + j), s2 = load<T, V>(sin + h + j);
  Chunk<T, V> o1, o2;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const A a = to_acc(x1.v[e]), b = to_acc(x2.v[e]);
    if (BWD) {
      o1.v[e] = from_acc<T>(a * to_acc(c1.v[e]) + b * to_acc(s2.v[e]));
      o2.v[e] = from_acc<T>(b * to_acc(c2.v[e]) - a * to_acc(s1.v[e]));
    } else {
      o1.v[e] = from_acc<T>(a * to_acc(c1.v[e]) - b * to_acc(s1.v[e]));
      o2.v[e] = from_acc<T>(b * to_acc(c2.v[e]) + a * to_acc(s2.v[e]));
    }
  }
  store<T, V>(out + j, o1);
  store<T, V>(out + h + j, o2);
}

// Grid-stride over the units of both operands (op[0]'s first).
template <typename T, int V, bool BWD>
__device__ void rope(const RopeParams& p) {
  const unsigned long long first = (unsigned long long)p.op[0].units;
  const unsigned long long total = first + (unsigned long long)p.op[1].units;
  const unsigned long long stride = (unsigned long long)graft_common::grid_threads();
  for (unsigned long long g = graft_common::thread_index(); g < total; g += stride) {
    if (g < first) {
      unit<T, V, BWD>(p, p.op[0], g);
    } else {
      unit<T, V, BWD>(p, p.op[1], g - first);
    }
  }
}

}  // namespace graft_rope

// Entry points: graft_rope_{fwd,bwd}_{vec,one}_{f32,f64,f16,bf16}, 256 threads per block
// (src/rope.rs launches them with that block size).
#define GRAFT_ROPE(DIR, BWD, KIND, V, DT, T)                                                \
  extern "C" __global__ void __launch_bounds__(256)                                        \
      graft_rope_##DIR##_##KIND##_##DT(const graft_rope::RopeParams p) {                   \
    graft_rope::rope<T, V, BWD>(p);                                                        \
  }

#define GRAFT_ROPE_DTYPE(DT, T)                                                             \
  GRAFT_ROPE(fwd, false, vec, graft_common::Pack<T>::N, DT, T)                              \
  GRAFT_ROPE(fwd, false, one, 1, DT, T)                                                     \
  GRAFT_ROPE(bwd, true, vec, graft_common::Pack<T>::N, DT, T)                               \
  GRAFT_ROPE(bwd, true, one, 1, DT, T)

GRAFT_ROPE_DTYPE(f32, float)
GRAFT_ROPE_DTYPE(f64, double)
GRAFT_ROPE_DTYPE(f16, __half)
GRAFT_ROPE_DTYPE(bf16, __nv_bfloat16)

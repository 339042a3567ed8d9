//! x86-64 tokens: [`Avx2`] (AVX2 + FMA + F16C, 256-bit) and [`Avx512`] (AVX-512F on top, 512-bit).
//!
//! This module holds the crate's `unsafe` code. Every intrinsic call relies on one invariant: a
//! token value exists only if `detect()` found its features on this CPU (the tokens' only field is
//! private, so nothing else can make one). Loads and stores also check their slice's length.

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::{Lanes, Simd, SimdF32};
use crate::dispatch::{FusedKernels, Kernels};
use crate::float::Acc;
use crate::glu::{self, ActLanes, Activation};
use crate::rope::{self, RopeOperand};
use crate::rows::{self, BackwardRows, ForwardRows};

/// Token for AVX2, FMA and F16C.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2 {
    _detected: (),
}

/// Token for AVX-512F, AVX2, FMA and F16C.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512 {
    _detected: (),
    /// Set only inside entry points compiled with AVX512-BF16, AVX512-DQ and AVX512-BW (after
    /// detecting them): bf16 stores then use `vcvtneps2bf16`, and bf16 pairs load and store
    /// interleaved. Elsewhere `false`, and those branches are never taken.
    bf16: bool,
}

impl Avx2 {
    /// The token, if this CPU has the features.
    pub(crate) fn detect() -> Option<Self> {
        let ok = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        ok.then_some(Avx2 { _detected: () })
    }
}

impl From<Avx512> for Avx2 {
    /// AVX-512 tokens are only made on CPUs that also have AVX2, FMA and F16C.
    fn from(_: Avx512) -> Avx2 {
        Avx2 { _detected: () }
    }
}

impl Avx512 {
    /// The token, if this CPU has the features.
    pub(crate) fn detect() -> Option<Self> {
        let ok = is_x86_feature_detected!("avx512f") && Avx2::detect().is_some();
        ok.then_some(Avx512 {
            _detected: (),
            bf16: false,
        })
    }

    /// Whether this CPU also has AVX512-BF16 (`vcvtneps2bf16`: f32 to bf16 in one instruction),
    /// AVX512-DQ (`vfpclassps`, which finds the subnormal lanes that instruction flushes) and
    /// AVX512-BW (`vpermw`, which interleaves bf16 pairs again: [`Lanes::store_pair`]); every
    /// CPU with AVX512-BF16 has the other two.
    fn has_bf16() -> bool {
        is_x86_feature_detected!("avx512bf16")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512bw")
    }
}

/// Entry points: the generic row kernels compiled with the token's target features, and the
/// [`Kernels`] table of them.
macro_rules! entry_points {
    ($token:ident, $features:literal) => {
        impl $token {
            /// The table of this token's kernels for `T`.
            pub(crate) fn kernels<T>() -> Kernels<T>
            where
                T: Lanes<$token>,
                T::Acc: Lanes<$token>,
                $token: Simd<T::Acc>,
            {
                Kernels {
                    forward: |rows| $token::get().forward(rows),
                    backward: |rows| $token::get().backward(rows),
                    widen: |src, dst| $token::get().widen(src, dst),
                    narrow: |src, dst| $token::get().narrow(src, dst),
                    accumulate: |acc, part| $token::get().accumulate(acc, part),
                }
            }

            /// The token; tables are only built for available tokens, so this cannot fail.
            fn get() -> Self {
                Self::detect().expect(concat!(
                    stringify!($token),
                    " kernels called on a CPU without it"
                ))
            }

            fn forward<T>(self, rows: ForwardRows<'_, T>)
            where
                T: Lanes<$token>,
                T::Acc: Lanes<$token>,
                $token: Simd<T::Acc>,
            {
                #[target_feature(enable = $features)]
                unsafe fn run<T>(s: $token, rows: ForwardRows<'_, T>)
                where
                    T: Lanes<$token>,
                    T::Acc: Lanes<$token>,
                    $token: Simd<T::Acc>,
                {
                    rows::forward(s, rows)
                }
                // SAFETY: `self` proves the CPU has `$features`.
                unsafe { run(self, rows) }
            }

            fn backward<T>(self, rows: BackwardRows<'_, T>)
            where
                T: Lanes<$token>,
                T::Acc: Lanes<$token>,
                $token: Simd<T::Acc>,
            {
                #[target_feature(enable = $features)]
                unsafe fn run<T>(s: $token, rows: BackwardRows<'_, T>)
                where
                    T: Lanes<$token>,
                    T::Acc: Lanes<$token>,
                    $token: Simd<T::Acc>,
                {
                    rows::backward(s, rows)
                }
                // SAFETY: `self` proves the CPU has `$features`.
                unsafe { run(self, rows) }
            }

            fn widen<T>(self, src: &[T], dst: &mut [T::Acc])
            where
                T: Lanes<$token>,
                T::Acc: Lanes<$token>,
                $token: Simd<T::Acc>,
            {
                #[target_feature(enable = $features)]
                unsafe fn run<T>(s: $token, src: &[T], dst: &mut [T::Acc])
                where
                    T: Lanes<$token>,
                    T::Acc: Lanes<$token>,
                    $token: Simd<T::Acc>,
                {
                    rows::widen(s, src, dst)
                }
                // SAFETY: `self` proves the CPU has `$features`.
                unsafe { run(self, src, dst) }
            }

            fn narrow<T>(self, src: &[T::Acc], dst: &mut [T])
            where
                T: Lanes<$token>,
                T::Acc: Lanes<$token>,
                $token: Simd<T::Acc>,
            {
                #[target_feature(enable = $features)]
                unsafe fn run<T>(s: $token, src: &[T::Acc], dst: &mut [T])
                where
                    T: Lanes<$token>,
                    T::Acc: Lanes<$token>,
                    $token: Simd<T::Acc>,
                {
                    rows::narrow(s, src, dst)
                }
                // SAFETY: `self` proves the CPU has `$features`.
                unsafe { run(self, src, dst) }
            }

            fn accumulate<A>(self, acc: &mut [A], part: &[A])
            where
                A: Acc + Lanes<$token>,
                $token: Simd<A>,
            {
                #[target_feature(enable = $features)]
                unsafe fn run<A>(s: $token, acc: &mut [A], part: &[A])
                where
                    A: Acc + Lanes<$token>,
                    $token: Simd<A>,
                {
                    rows::accumulate(s, acc, part)
                }
                // SAFETY: `self` proves the CPU has `$features`.
                unsafe { run(self, acc, part) }
            }
        }
    };
}

entry_points!(Avx2, "avx2,fma,f16c");
entry_points!(Avx512, "avx512f,avx2,fma,f16c");

/// Entry points of the elementwise fused ops (GLU, RoPE) compiled with the token's target
/// features, and the [`FusedKernels`] table of them.
macro_rules! fused_entry_points {
    ($token:ident, $features:literal) => {
        fused_entry_points!(
            $token,
            $features,
            glu_forward,
            glu_backward,
            glu_backward_in_place
        );
    };
    (
        $token:ident,
        $features:literal,
        $glu_forward:ident,
        $glu_backward:ident,
        $glu_backward_in_place:ident
    ) => {
        impl $token {
            /// The table of this token's fused-op kernels for `T`.
            pub(crate) fn fused_kernels<T>() -> FusedKernels<T>
            where
                T: Lanes<$token>,
                $token: Simd<T::Acc>,
                T::Acc: ActLanes<$token>,
            {
                FusedKernels {
                    glu_forward: |act, g, u, y| $token::get().$glu_forward(act, g, u, y),
                    glu_backward: |act, g, u, dy, dg, du| {
                        $token::get().$glu_backward(act, g, u, dy, dg, du)
                    },
                    glu_backward_in_place: |act, g, u, dy| {
                        $token::get().$glu_backward_in_place(act, g, u, dy)
                    },
                    rope: |op, bwd, first, out| $token::get().rope(op, bwd, first, out),
                }
            }

            fn glu_forward<T>(self, act: Activation, gate: &[T], up: &[T], y: &mut [T])
            where
                T: Lanes<$token>,
                $token: Simd<T::Acc>,
                T::Acc: ActLanes<$token>,
            {
                #[target_feature(enable = $features)]
                unsafe fn run<T>(s: $token, act: Activation, gate: &[T], up: &[T], y: &mut [T])
                where
                    T: Lanes<$token>,
                    $token: Simd<T::Acc>,
                    T::Acc: ActLanes<$token>,
                {
                    glu::forward_lanes(s, act, gate, up, y)
                }
                // SAFETY: `self` proves the CPU has `$features`.
                unsafe { run(self, act, gate, up, y) }
            }

            #[allow(clippy::too_many_arguments)]
            fn glu_backward<T>(
                self,
                act: Activation,
                gate: &[T],
                up: &[T],
                dy: &[T],
                dgate: &mut [T],
                dup: &mut [T],
            ) where
                T: Lanes<$token>,
                $token: Simd<T::Acc>,
                T::Acc: ActLanes<$token>,
            {
                #[target_feature(enable = $features)]
                #[allow(clippy::too_many_arguments)]
                unsafe fn run<T>(
                    s: $token,
                    act: Activation,
                    gate: &[T],
                    up: &[T],
                    dy: &[T],
                    dgate: &mut [T],
                    dup: &mut [T],
                ) where
                    T: Lanes<$token>,
                    $token: Simd<T::Acc>,
                    T::Acc: ActLanes<$token>,
                {
                    glu::backward_lanes(s, act, gate, up, dy, dgate, dup)
                }
                // SAFETY: `self` proves the CPU has `$features`.
                unsafe { run(self, act, gate, up, dy, dgate, dup) }
            }

            fn glu_backward_in_place<T>(
                self,
                act: Activation,
                gate: &mut [T],
                up: &mut [T],
                dy: &[T],
            ) where
                T: Lanes<$token>,
                $token: Simd<T::Acc>,
                T::Acc: ActLanes<$token>,
            {
                #[target_feature(enable = $features)]
                unsafe fn run<T>(s: $token, act: Activation, gate: &mut [T], up: &mut [T], dy: &[T])
                where
                    T: Lanes<$token>,
                    $token: Simd<T::Acc>,
                    T::Acc: ActLanes<$token>,
                {
                    glu::backward_in_place_lanes(s, act, gate, up, dy)
                }
                // SAFETY: `self` proves the CPU has `$features`.
                unsafe { run(self, act, gate, up, dy) }
            }

            fn rope<T>(self, op: &RopeOperand<'_, T>, backward: bool, first: usize, out: &mut [T])
            where
                T: Lanes<$token>,
                $token: Simd<T::Acc>,
            {
                #[target_feature(enable = $features)]
                unsafe fn run<T>(
                    s: $token,
                    op: &RopeOperand<'_, T>,
                    backward: bool,
                    first: usize,
                    out: &mut [T],
                ) where
                    T: Lanes<$token>,
                    $token: Simd<T::Acc>,
                {
                    rope::rows_lanes(s, op, backward, first, out)
                }
                // SAFETY: `self` proves the CPU has `$features`.
                unsafe { run(self, op, backward, first, out) }
            }
        }
    };
}

fused_entry_points!(Avx2, "avx2,fma,f16c");
fused_entry_points!(
    Avx512,
    "avx512f,avx2,fma,f16c",
    glu_forward_any,
    glu_backward_any,
    glu_backward_in_place_any
);

/// The GLU kernels compiled once more with AVX512-BF16, for CPUs that have it: bf16 outputs are
/// then rounded by `vcvtneps2bf16` (2 instructions a vector instead of 10; the other element
/// types compile to the same code as without it).
impl Avx512 {
    fn glu_forward_any<T>(self, act: Activation, gate: &[T], up: &[T], y: &mut [T])
    where
        T: Lanes<Avx512>,
        Avx512: Simd<T::Acc>,
        T::Acc: ActLanes<Avx512>,
    {
        #[target_feature(enable = "avx512f,avx512bf16,avx512dq,avx512bw,avx2,fma,f16c")]
        unsafe fn run<T>(act: Activation, gate: &[T], up: &[T], y: &mut [T])
        where
            T: Lanes<Avx512>,
            Avx512: Simd<T::Acc>,
            T::Acc: ActLanes<Avx512>,
        {
            let s = Avx512 {
                _detected: (),
                bf16: true,
            };
            glu::forward_lanes(s, act, gate, up, y)
        }
        if Self::has_bf16() {
            // SAFETY: `self` proves AVX-512F, AVX2, FMA and F16C, and detection found
            // AVX512-BF16, AVX512-DQ and AVX512-BW.
            unsafe { run(act, gate, up, y) }
        } else {
            self.glu_forward(act, gate, up, y)
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn glu_backward_any<T>(
        self,
        act: Activation,
        gate: &[T],
        up: &[T],
        dy: &[T],
        dgate: &mut [T],
        dup: &mut [T],
    ) where
        T: Lanes<Avx512>,
        Avx512: Simd<T::Acc>,
        T::Acc: ActLanes<Avx512>,
    {
        #[target_feature(enable = "avx512f,avx512bf16,avx512dq,avx512bw,avx2,fma,f16c")]
        unsafe fn run<T>(
            act: Activation,
            gate: &[T],
            up: &[T],
            dy: &[T],
            dgate: &mut [T],
            dup: &mut [T],
        ) where
            T: Lanes<Avx512>,
            Avx512: Simd<T::Acc>,
            T::Acc: ActLanes<Avx512>,
        {
            let s = Avx512 {
                _detected: (),
                bf16: true,
            };
            glu::backward_lanes(s, act, gate, up, dy, dgate, dup)
        }
        if Self::has_bf16() {
            // SAFETY: `self` proves AVX-512F, AVX2, FMA and F16C, and detection found
            // AVX512-BF16, AVX512-DQ and AVX512-BW.
            unsafe { run(act, gate, up, dy, dgate, dup) }
        } else {
            self.glu_backward(act, gate, up, dy, dgate, dup)
        }
    }

    fn glu_backward_in_place_any<T>(self, act: Activation, gate: &mut [T], up: &mut [T], dy: &[T])
    where
        T: Lanes<Avx512>,
        Avx512: Simd<T::Acc>,
        T::Acc: ActLanes<Avx512>,
    {
        #[target_feature(enable = "avx512f,avx512bf16,avx512dq,avx512bw,avx2,fma,f16c")]
        unsafe fn run<T>(act: Activation, gate: &mut [T], up: &mut [T], dy: &[T])
        where
            T: Lanes<Avx512>,
            Avx512: Simd<T::Acc>,
            T::Acc: ActLanes<Avx512>,
        {
            let s = Avx512 {
                _detected: (),
                bf16: true,
            };
            glu::backward_in_place_lanes(s, act, gate, up, dy)
        }
        if Self::has_bf16() {
            // SAFETY: `self` proves AVX-512F, AVX2, FMA and F16C, and detection found
            // AVX512-BF16, AVX512-DQ and AVX512-BW.
            unsafe { run(act, gate, up, dy) }
        } else {
            self.glu_backward_in_place(act, gate, up, dy)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// AVX2: f32 in __m256 (8 lanes), f64 in __m256d (4 lanes).

impl Simd<f32> for Avx2 {
    type V = __m256;
    const LANES: usize = 8;

    #[inline(always)]
    fn splat(self, v: f32) -> __m256 {
        // SAFETY: the token proves AVX2 (see module docs).
        unsafe { _mm256_set1_ps(v) }
    }
    #[inline(always)]
    fn add(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: the token proves AVX2.
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: the token proves AVX.
        unsafe { _mm256_sub_ps(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: the token proves AVX2.
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    fn div(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: the token proves AVX.
        unsafe { _mm256_div_ps(a, b) }
    }
    #[inline(always)]
    fn mul_add(self, a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: the token proves FMA.
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn sum(self, v: __m256) -> f32 {
        // SAFETY: the token proves AVX2.
        unsafe {
            let v = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)))
        }
    }
    #[inline(always)]
    fn prefetch<E>(self, data: &[E]) {
        // SAFETY: the token proves SSE; a prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(data.as_ptr().cast()) }
    }
}

impl SimdF32 for Avx2 {
    #[inline(always)]
    fn min(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: the token proves AVX. `vminps` returns `b` when either lane is NaN.
        unsafe { _mm256_min_ps(a, b) }
    }
    #[inline(always)]
    fn max(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: the token proves AVX. `vmaxps` returns `b` when either lane is NaN.
        unsafe { _mm256_max_ps(a, b) }
    }
    #[inline(always)]
    fn abs(self, v: __m256) -> __m256 {
        // SAFETY: the token proves AVX.
        unsafe { _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff))) }
    }
    #[inline(always)]
    fn round(self, v: __m256) -> __m256 {
        // SAFETY: the token proves AVX.
        unsafe { _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v) }
    }
    #[inline(always)]
    fn scale(self, v: __m256, n: __m256) -> __m256 {
        // SAFETY: the token proves AVX2.
        unsafe {
            // Two factors 2^half and 2^(n - half), each a normal number for n in -150..=128.
            let pow2 = |k: __m256| {
                let biased = _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127));
                _mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased))
            };
            let half = self.round(_mm256_mul_ps(n, _mm256_set1_ps(0.5)));
            _mm256_mul_ps(_mm256_mul_ps(v, pow2(half)), pow2(_mm256_sub_ps(n, half)))
        }
    }
    #[inline(always)]
    fn fma(self, a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: the token proves FMA.
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn select_lt(self, a: __m256, b: __m256, x: __m256, y: __m256) -> __m256 {
        // SAFETY: the token proves AVX.
        unsafe { _mm256_blendv_ps(y, x, _mm256_cmp_ps::<_CMP_LT_OQ>(a, b)) }
    }
}

impl Simd<f64> for Avx2 {
    type V = __m256d;
    const LANES: usize = 4;

    #[inline(always)]
    fn splat(self, v: f64) -> __m256d {
        // SAFETY: the token proves AVX2.
        unsafe { _mm256_set1_pd(v) }
    }
    #[inline(always)]
    fn add(self, a: __m256d, b: __m256d) -> __m256d {
        // SAFETY: the token proves AVX2.
        unsafe { _mm256_add_pd(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m256d, b: __m256d) -> __m256d {
        // SAFETY: the token proves AVX.
        unsafe { _mm256_sub_pd(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m256d, b: __m256d) -> __m256d {
        // SAFETY: the token proves AVX2.
        unsafe { _mm256_mul_pd(a, b) }
    }
    #[inline(always)]
    fn div(self, a: __m256d, b: __m256d) -> __m256d {
        // SAFETY: the token proves AVX.
        unsafe { _mm256_div_pd(a, b) }
    }
    #[inline(always)]
    fn mul_add(self, a: __m256d, b: __m256d, c: __m256d) -> __m256d {
        // SAFETY: the token proves FMA.
        unsafe { _mm256_fmadd_pd(a, b, c) }
    }
    #[inline(always)]
    fn sum(self, v: __m256d) -> f64 {
        // SAFETY: the token proves AVX2.
        unsafe {
            let v = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd::<1>(v));
            _mm_cvtsd_f64(_mm_add_sd(v, _mm_unpackhi_pd(v, v)))
        }
    }
    #[inline(always)]
    fn prefetch<E>(self, data: &[E]) {
        // SAFETY: the token proves SSE; a prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(data.as_ptr().cast()) }
    }
}

impl Avx2 {
    /// Writes the 32 bytes `bits` to `dst` (exactly 32 bytes).
    #[inline(always)]
    fn put<T>(self, dst: &mut [T], bits: __m256i) {
        assert_eq!(std::mem::size_of_val(dst), 32);
        // SAFETY: the token proves AVX; `dst` spans the 32 bytes written.
        unsafe { _mm256_storeu_si256(dst.as_mut_ptr().cast(), bits) }
    }

    /// Writes the 16 bytes `bits` to `dst` (exactly 16 bytes).
    #[inline(always)]
    fn put_half<T>(self, dst: &mut [T], bits: __m128i) {
        assert_eq!(std::mem::size_of_val(dst), 16);
        // SAFETY: the token proves SSE2; `dst` spans the 16 bytes written.
        unsafe { _mm_storeu_si128(dst.as_mut_ptr().cast(), bits) }
    }

    /// Reads 16 bytes from `src` (exactly 16 bytes).
    #[inline(always)]
    fn get_half<T>(self, src: &[T]) -> __m128i {
        assert_eq!(std::mem::size_of_val(src), 16);
        // SAFETY: the token proves SSE2; `src` spans the 16 bytes read.
        unsafe { _mm_loadu_si128(src.as_ptr().cast()) }
    }

    /// f32 lanes rounded to bf16 (nearest even; NaN kept, quieted), packed.
    #[inline(always)]
    fn to_bf16(self, v: __m256) -> __m128i {
        // SAFETY: the token proves AVX2.
        unsafe {
            let bits = _mm256_castps_si256(v);
            let high = _mm256_srli_epi32::<16>(bits);
            // Round to nearest even: add 0x7fff plus the lowest kept bit, keep the high half.
            let bias = _mm256_add_epi32(
                _mm256_and_si256(high, _mm256_set1_epi32(1)),
                _mm256_set1_epi32(0x7fff),
            );
            let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(bits, bias));
            // NaN: keep sign and leading payload, set the quiet bit.
            let quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
            let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            let halves = _mm256_blendv_epi8(rounded, quiet, nan);
            // Pack the eight 32-bit lanes (all < 2^16) into 16 bytes.
            let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(halves, halves));
            _mm256_castsi256_si128(packed)
        }
    }
}

impl Lanes<Avx2> for f32 {
    #[inline(always)]
    fn load(_: Avx2, src: &[f32]) -> __m256 {
        let src = &src[..8];
        // SAFETY: the token proves AVX; `src` holds the 8 values read.
        unsafe { _mm256_loadu_ps(src.as_ptr()) }
    }
    #[inline(always)]
    fn store(s: Avx2, v: __m256, dst: &mut [f32]) {
        // SAFETY: the token proves AVX.
        s.put(&mut dst[..8], unsafe { _mm256_castps_si256(v) })
    }
    #[inline(always)]
    fn round(_: Avx2, v: __m256) -> __m256 {
        v
    }
}

impl Lanes<Avx2> for f64 {
    #[inline(always)]
    fn load(_: Avx2, src: &[f64]) -> __m256d {
        let src = &src[..4];
        // SAFETY: the token proves AVX; `src` holds the 4 values read.
        unsafe { _mm256_loadu_pd(src.as_ptr()) }
    }
    #[inline(always)]
    fn store(s: Avx2, v: __m256d, dst: &mut [f64]) {
        // SAFETY: the token proves AVX.
        s.put(&mut dst[..4], unsafe { _mm256_castpd_si256(v) })
    }
    #[inline(always)]
    fn round(_: Avx2, v: __m256d) -> __m256d {
        v
    }
}

impl Lanes<Avx2> for bf16 {
    #[inline(always)]
    fn load(s: Avx2, src: &[bf16]) -> __m256 {
        let bits = s.get_half(&src[..8]);
        // SAFETY: the token proves AVX2. A bf16 is the high half of the f32 of the same value.
        unsafe { _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits))) }
    }
    #[inline(always)]
    fn load_exact(s: Avx2, src: &[bf16]) -> __m256 {
        let v = Self::load(s, src);
        // SAFETY: the token proves AVX. Sets the quiet bit of NaNs, as `half` does.
        unsafe {
            let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v);
            let quiet_bit = _mm256_castsi256_ps(_mm256_set1_epi32(0x40_0000));
            _mm256_or_ps(v, _mm256_and_ps(nan, quiet_bit))
        }
    }
    #[inline(always)]
    fn store(s: Avx2, v: __m256, dst: &mut [bf16]) {
        s.put_half(&mut dst[..8], s.to_bf16(v))
    }
}

impl Lanes<Avx2> for f16 {
    #[inline(always)]
    fn load(s: Avx2, src: &[f16]) -> __m256 {
        let bits = s.get_half(&src[..8]);
        // SAFETY: the token proves F16C.
        unsafe { _mm256_cvtph_ps(bits) }
    }
    #[inline(always)]
    fn store(s: Avx2, v: __m256, dst: &mut [f16]) {
        // SAFETY: the token proves F16C.
        let bits = unsafe { _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v) };
        s.put_half(&mut dst[..8], bits)
    }
}

// ---------------------------------------------------------------------------------------------
// AVX-512: f32 in __m512 (16 lanes), f64 in __m512d (8 lanes).

impl Simd<f32> for Avx512 {
    type V = __m512;
    const LANES: usize = 16;

    #[inline(always)]
    fn splat(self, v: f32) -> __m512 {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    fn add(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    fn div(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_div_ps(a, b) }
    }
    #[inline(always)]
    fn mul_add(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn sum(self, v: __m512) -> f32 {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_reduce_add_ps(v) }
    }
    #[inline(always)]
    fn prefetch<E>(self, data: &[E]) {
        // SAFETY: the token proves SSE; a prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(data.as_ptr().cast()) }
    }
}

impl SimdF32 for Avx512 {
    #[inline(always)]
    fn min(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: the token proves AVX-512F. `vminps` returns `b` when either lane is NaN.
        unsafe { _mm512_min_ps(a, b) }
    }
    #[inline(always)]
    fn max(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: the token proves AVX-512F. `vmaxps` returns `b` when either lane is NaN.
        unsafe { _mm512_max_ps(a, b) }
    }
    #[inline(always)]
    fn abs(self, v: __m512) -> __m512 {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_abs_ps(v) }
    }
    #[inline(always)]
    fn round(self, v: __m512) -> __m512 {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v) }
    }
    #[inline(always)]
    fn scale(self, v: __m512, n: __m512) -> __m512 {
        // SAFETY: the token proves AVX-512F. `vscalefps` computes v * 2^floor(n) with one rounding.
        unsafe { _mm512_scalef_ps(v, n) }
    }
    #[inline(always)]
    fn fma(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn select_lt(self, a: __m512, b: __m512, x: __m512, y: __m512) -> __m512 {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, b), y, x) }
    }
    #[inline(always)]
    fn mul_where_lt(self, a: __m512, b: __m512, x: __m512, y: __m512) -> __m512 {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_mask_mul_ps(x, _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, b), x, y) }
    }
    #[inline(always)]
    fn neg_abs_scaled_min(self, v: __m512, scale: f32, limit: f32) -> __m512 {
        if self.bf16 {
            // SAFETY: `self.bf16` is only set where detection found AVX512-DQ (and the entry
            // point enables it). `vrangeps` with imm8 0b11_10: the smaller magnitude of the two
            // operands, sign bit set; a NaN operand gives a NaN.
            unsafe {
                let t = _mm512_mul_ps(v, _mm512_set1_ps(scale));
                _mm512_range_ps::<0b1110>(t, _mm512_set1_ps(limit))
            }
        } else {
            // SAFETY: the token proves AVX-512F. `vmaxps` keeps a NaN in its second operand.
            unsafe {
                let t = _mm512_mul_ps(_mm512_abs_ps(v), _mm512_set1_ps(-scale));
                _mm512_max_ps(_mm512_set1_ps(-limit), t)
            }
        }
    }
}

impl Simd<f64> for Avx512 {
    type V = __m512d;
    const LANES: usize = 8;

    #[inline(always)]
    fn splat(self, v: f64) -> __m512d {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_set1_pd(v) }
    }
    #[inline(always)]
    fn add(self, a: __m512d, b: __m512d) -> __m512d {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_add_pd(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m512d, b: __m512d) -> __m512d {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_sub_pd(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m512d, b: __m512d) -> __m512d {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_mul_pd(a, b) }
    }
    #[inline(always)]
    fn div(self, a: __m512d, b: __m512d) -> __m512d {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_div_pd(a, b) }
    }
    #[inline(always)]
    fn mul_add(self, a: __m512d, b: __m512d, c: __m512d) -> __m512d {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_fmadd_pd(a, b, c) }
    }
    #[inline(always)]
    fn sum(self, v: __m512d) -> f64 {
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_reduce_add_pd(v) }
    }
    #[inline(always)]
    fn prefetch<E>(self, data: &[E]) {
        // SAFETY: the token proves SSE; a prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(data.as_ptr().cast()) }
    }
}

impl Avx512 {
    /// Writes the 64 bytes `bits` to `dst` (exactly 64 bytes).
    #[inline(always)]
    fn put<T>(self, dst: &mut [T], bits: __m512i) {
        assert_eq!(std::mem::size_of_val(dst), 64);
        // SAFETY: the token proves AVX-512F; `dst` spans the 64 bytes written.
        unsafe { _mm512_storeu_si512(dst.as_mut_ptr().cast(), bits) }
    }

    /// Reads 32 bytes from `src` (exactly 32 bytes).
    #[inline(always)]
    fn get_half<T>(self, src: &[T]) -> __m256i {
        assert_eq!(std::mem::size_of_val(src), 32);
        // SAFETY: the token proves AVX; `src` spans the 32 bytes read.
        unsafe { _mm256_loadu_si256(src.as_ptr().cast()) }
    }

    /// f32 lanes rounded to bf16 (nearest even; NaN kept, quieted), packed: with
    /// `vcvtneps2bf16` where the CPU has it and no lane is subnormal (the instruction flushes
    /// those to zero), else in integer arithmetic.
    #[inline(always)]
    fn to_bf16(self, v: __m512) -> __m256i {
        if self.bf16 {
            // SAFETY: `self.bf16` is only set where detection found AVX512-DQ as well
            // (`Avx512::has_bf16`). `vfpclassps` with 0x20 flags the (nonzero) subnormal lanes:
            // one instruction where two tests and a mask operation did it before.
            let subnormal = unsafe { _mm512_fpclass_ps_mask::<0x20>(v) };
            if subnormal == 0 {
                // SAFETY: `self.bf16` is only set where detection found AVX512-BF16. The
                // instruction rounds to nearest even and quiets NaNs (sign and leading payload
                // kept) as the integer path does; it flushes subnormals, excluded above.
                return unsafe { std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v)) };
            }
        }
        self.to_bf16_integer(v)
    }

    /// [`Avx512::to_bf16`] in integer arithmetic (any AVX-512F CPU, any lane).
    #[inline(always)]
    fn to_bf16_integer(self, v: __m512) -> __m256i {
        // SAFETY: the token proves AVX-512F.
        unsafe {
            let bits = _mm512_castps_si512(v);
            let high = _mm512_srli_epi32::<16>(bits);
            // Round to nearest even: add 0x7fff plus the lowest kept bit, keep the high half.
            let bias = _mm512_add_epi32(
                _mm512_and_si512(high, _mm512_set1_epi32(1)),
                _mm512_set1_epi32(0x7fff),
            );
            let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, bias));
            // NaN: keep sign and leading payload, set the quiet bit.
            let quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet))
        }
    }
}

impl Lanes<Avx512> for f32 {
    #[inline(always)]
    fn load(_: Avx512, src: &[f32]) -> __m512 {
        let src = &src[..16];
        // SAFETY: the token proves AVX-512F; `src` holds the 16 values read.
        unsafe { _mm512_loadu_ps(src.as_ptr()) }
    }
    #[inline(always)]
    fn store(s: Avx512, v: __m512, dst: &mut [f32]) {
        // SAFETY: the token proves AVX-512F.
        s.put(&mut dst[..16], unsafe { _mm512_castps_si512(v) })
    }
    #[inline(always)]
    fn round(_: Avx512, v: __m512) -> __m512 {
        v
    }
}

impl Lanes<Avx512> for f64 {
    #[inline(always)]
    fn load(_: Avx512, src: &[f64]) -> __m512d {
        let src = &src[..8];
        // SAFETY: the token proves AVX-512F; `src` holds the 8 values read.
        unsafe { _mm512_loadu_pd(src.as_ptr()) }
    }
    #[inline(always)]
    fn store(s: Avx512, v: __m512d, dst: &mut [f64]) {
        // SAFETY: the token proves AVX-512F.
        s.put(&mut dst[..8], unsafe { _mm512_castpd_si512(v) })
    }
    #[inline(always)]
    fn round(_: Avx512, v: __m512d) -> __m512d {
        v
    }
}

impl Lanes<Avx512> for bf16 {
    #[inline(always)]
    fn load(s: Avx512, src: &[bf16]) -> __m512 {
        let bits = s.get_half(&src[..16]);
        // SAFETY: the token proves AVX-512F. A bf16 is the high half of the f32 of the same
        // value.
        unsafe { _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits))) }
    }
    #[inline(always)]
    fn load_exact(s: Avx512, src: &[bf16]) -> __m512 {
        let v = Self::load(s, src);
        // SAFETY: the token proves AVX-512F. Sets the quiet bit of NaNs, as `half` does.
        unsafe {
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            let bits = _mm512_castps_si512(v);
            let quiet = _mm512_mask_or_epi32(bits, nan, bits, _mm512_set1_epi32(0x40_0000));
            _mm512_castsi512_ps(quiet)
        }
    }
    #[inline(always)]
    fn store(s: Avx512, v: __m512, dst: &mut [bf16]) {
        Avx2::from(s).put(&mut dst[..16], s.to_bf16(v))
    }
    /// With AVX512-BF16 (and so AVX512-BW): 32 bf16 in one load, the even elements shifted into
    /// f32 lanes and the odd ones masked in place (one instruction a vector instead of a
    /// widening and a shift).
    #[inline(always)]
    fn load_pair(s: Avx512, src: &[bf16]) -> (__m512, __m512) {
        if !s.bf16 {
            return (Self::load(s, src), Self::load(s, &src[16..]));
        }
        let src = &src[..32];
        // SAFETY: the token proves AVX-512F; `src` spans the 64 bytes read. A bf16 is the high
        // half of the f32 of the same value: element 2i is the low half of dword i, 2i + 1 the
        // high half.
        unsafe {
            let bits = _mm512_loadu_si512(src.as_ptr().cast());
            let even = _mm512_slli_epi32::<16>(bits);
            let odd = _mm512_and_si512(bits, _mm512_set1_epi32(0xffff_0000_u32 as i32));
            (_mm512_castsi512_ps(even), _mm512_castsi512_ps(odd))
        }
    }
    /// [`Lanes::load_pair`]'s lanes back in order: both vectors rounded into one register by
    /// `vcvtne2ps2bf16` (even elements in the low 16 words, odd in the high) and interleaved by
    /// one word permutation (`vpermw`). A vector with a subnormal lane is rounded in integer
    /// arithmetic instead, as [`Avx512::to_bf16`] does.
    #[inline(always)]
    fn store_pair(s: Avx512, v: (__m512, __m512), dst: &mut [bf16]) {
        if !s.bf16 {
            Self::store(s, v.0, dst);
            Self::store(s, v.1, &mut dst[16..]);
            return;
        }
        let (even, odd) = v;
        // SAFETY: `s.bf16` is only set inside entry points compiled with (and after detecting)
        // AVX512-BF16, AVX512-DQ and AVX512-BW (`Avx512::has_bf16`). `vfpclassps` with 0x20
        // flags the (nonzero) subnormal lanes, which `vcvtne2ps2bf16` would flush; otherwise it
        // rounds to nearest even and quiets NaNs as the integer path does. `INTERLEAVE` is 64
        // bytes.
        let bits = unsafe {
            let subnormal =
                _mm512_fpclass_ps_mask::<0x20>(even) | _mm512_fpclass_ps_mask::<0x20>(odd);
            // Words 0..16: the even elements; 16..32: the odd ones.
            let packed = if subnormal == 0 {
                std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(odd, even))
            } else {
                _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(s.to_bf16_integer(even)),
                    s.to_bf16_integer(odd),
                )
            };
            let order = _mm512_loadu_si512(INTERLEAVE.as_ptr().cast());
            _mm512_permutexvar_epi16(order, packed)
        };
        s.put(&mut dst[..32], bits)
    }
}

/// The word permutation that interleaves the even elements (words 0..16) and the odd ones
/// (words 16..32) of [`Lanes::store_pair`]: word `2i` takes word `i`, word `2i + 1` word
/// `16 + i`.
const INTERLEAVE: [u16; 32] = {
    let mut order = [0u16; 32];
    let mut i = 0;
    while i < 16 {
        order[2 * i] = i as u16;
        order[2 * i + 1] = 16 + i as u16;
        i += 1;
    }
    order
};

impl Lanes<Avx512> for f16 {
    #[inline(always)]
    fn load(s: Avx512, src: &[f16]) -> __m512 {
        let bits = s.get_half(&src[..16]);
        // SAFETY: the token proves AVX-512F.
        unsafe { _mm512_cvtph_ps(bits) }
    }
    #[inline(always)]
    fn store(s: Avx512, v: __m512, dst: &mut [f16]) {
        // SAFETY: the token proves AVX-512F.
        let bits =
            unsafe { _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v) };
        Avx2::from(s).put(&mut dst[..16], bits)
    }
}

// ---------------------------------------------------------------------------------------------
// Any `vectorize::Job`, compiled with each token's features.

/// Entry point running a [`Job`] compiled with the token's target features.
macro_rules! job_entry_point {
    ($token:ident, $features:literal) => {
        impl $token {
            /// Runs `job`, its loops compiled (inlined) with this token's features.
            pub(crate) fn run_job<J: Job>(self, job: J) -> J::Output {
                #[target_feature(enable = $features)]
                unsafe fn run<J: Job>(job: J) -> J::Output {
                    job.run()
                }
                // SAFETY: `self` proves the CPU has `$features`.
                unsafe { run(job) }
            }
        }
    };
}

use crate::vectorize::Job;

job_entry_point!(Avx2, "avx2,fma,f16c");
job_entry_point!(Avx512, "avx512f,avx2,fma,f16c");

// ---------------------------------------------------------------------------------------------
// Adam / AdamW (crate::adam): the chunk update compiled with FMA, as ATen's AVX2 kernel is.

impl Avx2 {
    /// [`crate::adam::run_chunk`] compiled for AVX2, FMA and F16C.
    pub(crate) fn adam_chunk<T: crate::adam::AdamFloat>(
        self,
        c: &crate::adam::Coeffs<T::Acc>,
        chunk: crate::adam::Chunk<'_, T>,
    ) {
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn run<T: crate::adam::AdamFloat>(
            c: &crate::adam::Coeffs<T::Acc>,
            chunk: crate::adam::Chunk<'_, T>,
        ) {
            crate::adam::run_chunk(c, chunk)
        }
        // SAFETY: `self` proves the CPU has AVX2, FMA and F16C.
        unsafe { run(c, chunk) }
    }
}

// ---------------------------------------------------------------------------------------------
// Softmax / log-softmax (crate::softmax): the tasks compiled for each token, so that their loops
// (exponentials included, crate::exp) vectorize.

macro_rules! softmax_entry_points {
    ($token:ident, $features:literal) => {
        impl $token {
            /// [`crate::softmax::run_forward`] compiled for this token's features.
            pub(crate) fn softmax_forward<T: crate::softmax::SoftmaxFloat>(
                self,
                kind: crate::softmax::Kind,
                cv: crate::softmax::Convert<T>,
                task: crate::softmax::ForwardTask<'_, T>,
            ) {
                #[target_feature(enable = $features)]
                unsafe fn run<T: crate::softmax::SoftmaxFloat>(
                    kind: crate::softmax::Kind,
                    cv: crate::softmax::Convert<T>,
                    task: crate::softmax::ForwardTask<'_, T>,
                ) {
                    crate::softmax::run_forward::<T, true>(kind, cv, task)
                }
                // SAFETY: `self` proves the CPU has `$features`.
                unsafe { run(kind, cv, task) }
            }

            /// [`crate::softmax::run_backward`] compiled for this token's features.
            pub(crate) fn softmax_backward<T: crate::softmax::SoftmaxFloat>(
                self,
                kind: crate::softmax::Kind,
                cv: crate::softmax::Convert<T>,
                task: crate::softmax::BackwardTask<'_, T>,
            ) {
                #[target_feature(enable = $features)]
                unsafe fn run<T: crate::softmax::SoftmaxFloat>(
                    kind: crate::softmax::Kind,
                    cv: crate::softmax::Convert<T>,
                    task: crate::softmax::BackwardTask<'_, T>,
                ) {
                    crate::softmax::run_backward::<T, true>(kind, cv, task)
                }
                // SAFETY: `self` proves the CPU has `$features`.
                unsafe { run(kind, cv, task) }
            }
        }
    };
}

softmax_entry_points!(Avx2, "avx2,fma,f16c");
softmax_entry_points!(Avx512, "avx512f,avx2,fma,f16c");

// ---------------------------------------------------------------------------------------------
// LayerNorm (crate::layer_norm): the tasks compiled for each token, so that their loops vectorize.

macro_rules! layer_norm_entry_points {
    ($token:ident, $features:literal) => {
        impl $token {
            /// [`crate::layer_norm::run_forward`] compiled for this token's features.
            pub(crate) fn layer_norm_forward<T: crate::layer_norm::NormFloat>(
                self,
                cv: crate::elem::Convert<T>,
                task: crate::layer_norm::ForwardTask<'_, T>,
            ) {
                #[target_feature(enable = $features)]
                unsafe fn run<T: crate::layer_norm::NormFloat>(
                    cv: crate::elem::Convert<T>,
                    task: crate::layer_norm::ForwardTask<'_, T>,
                ) {
                    crate::layer_norm::run_forward(cv, task)
                }
                // SAFETY: `self` proves the CPU has `$features`.
                unsafe { run(cv, task) }
            }

            /// [`crate::layer_norm::run_backward`] compiled for this token's features.
            pub(crate) fn layer_norm_backward<T: crate::layer_norm::NormFloat>(
                self,
                cv: crate::elem::Convert<T>,
                task: crate::layer_norm::BackwardTask<'_, T>,
            ) {
                #[target_feature(enable = $features)]
                unsafe fn run<T: crate::layer_norm::NormFloat>(
                    cv: crate::elem::Convert<T>,
                    task: crate::layer_norm::BackwardTask<'_, T>,
                ) {
                    crate::layer_norm::run_backward(cv, task)
                }
                // SAFETY: `self` proves the CPU has `$features`.
                unsafe { run(cv, task) }
            }
        }
    };
}

layer_norm_entry_points!(Avx2, "avx2,fma,f16c");
layer_norm_entry_points!(Avx512, "avx512f,avx2,fma,f16c");

//! The AVX2 token's vector arithmetic: f32 in `__m256` (8 lanes), f64 in `__m256d` (4 lanes),
//! bf16 and f16 widened to f32 (F16C for f16).

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::Avx2;
use crate::simd::{Lanes, Simd, SimdF32};

impl Simd<f32> for Avx2 {
    type V = __m256;
    const LANES: usize = 8;

    #[inline(always)]
    fn splat(self, v: f32) -> __m256 {
        // SAFETY: the token proves AVX2 (see the `x86` module docs).
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
    pub(super) fn put<T>(self, dst: &mut [T], bits: __m256i) {
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

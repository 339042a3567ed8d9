//! The AVX-512 token's vector arithmetic: f32 in `__m512` (16 lanes), f64 in `__m512d` (8 lanes),
//! bf16 and f16 widened to f32 (with AVX512-BF16 where the token's `bf16` is set).

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::{Avx2, Avx512};
use crate::simd::{Lanes, Simd, SimdF32};

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

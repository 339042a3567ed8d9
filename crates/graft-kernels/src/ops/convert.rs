//! Vectorized conversions between element slices and their accumulation type (e.g. a `bf16`
//! weight to `f32` for the kernels, and an `f32` weight gradient back to `bf16`), and the table
//! of them ([`Convert`]) that the other ops look up once per call to widen and narrow 16-bit
//! values.

use crate::float::Float;
use crate::isa::Isa;
use crate::simd::portable::Portable;
#[cfg(target_arch = "x86_64")]
use crate::simd::x86::{Avx2, Avx512};
use crate::simd::{load_exact_part, load_part, store_part, Lanes, Simd};
use crate::tables::select_table;

/// `dst[i] = src[i].to_acc()` for every `i`.
///
/// # Panics
/// If the lengths differ.
pub fn to_acc<T: Float>(src: &[T], dst: &mut [T::Acc]) {
    check_lens("convert::to_acc", src.len(), dst.len());
    (Convert::<T>::new().widen)(src, dst);
}

/// `src` converted to a new vector of `T::Acc`.
pub fn to_acc_vec<T: Float>(src: &[T]) -> Vec<T::Acc> {
    let mut dst = vec![T::Acc::default(); src.len()];
    to_acc(src, &mut dst);
    dst
}

/// `dst[i] = T::from_acc(src[i])` for every `i` (round to nearest even, NaN stays NaN).
///
/// # Panics
/// If the lengths differ.
pub fn from_acc<T: Float>(src: &[T::Acc], dst: &mut [T]) {
    check_lens("convert::from_acc", src.len(), dst.len());
    (Convert::<T>::new().narrow)(src, dst);
}

/// `src` converted to a new vector of `T`.
pub fn from_acc_vec<T: Float>(src: &[T::Acc]) -> Vec<T> {
    let mut dst = vec![T::default(); src.len()];
    from_acc(src, &mut dst);
    dst
}

#[track_caller]
fn check_lens(func: &str, src: usize, dst: usize) {
    assert!(
        src == dst,
        "{func}: `src` has {src} elements but `dst` has {dst}"
    );
}

/// The conversions between `T` and its accumulation type, compiled for one instruction set and
/// looked up once per call.
pub struct Convert<T: Float> {
    /// [`to_acc`].
    pub(crate) widen: fn(&[T], &mut [T::Acc]),
    /// [`from_acc`].
    pub(crate) narrow: fn(&[T::Acc], &mut [T]),
}

impl<T: Float> Clone for Convert<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: Float> Copy for Convert<T> {}

impl<T: Float> Default for Convert<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Float> Convert<T> {
    /// The conversions of [`Isa::current`]: SIMD ones for `f32`, `f64`, `bf16` and `f16`, the
    /// portable ones otherwise.
    pub fn new() -> Self {
        let isa = Isa::current();
        select_table!(|N| match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => Convert::<N> {
                widen: |src, dst| x86::avx512::widen(Avx512::get(), src, dst),
                narrow: |src, dst| x86::avx512::narrow(Avx512::get(), src, dst),
            },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => Convert::<N> {
                widen: |src, dst| x86::avx2::widen(Avx2::get(), src, dst),
                narrow: |src, dst| x86::avx2::narrow(Avx2::get(), src, dst),
            },
            _ => Convert::<N>::portable(),
        })
        .unwrap_or_else(Convert::portable)
    }

    /// The portable conversions, for any `T`.
    fn portable() -> Self {
        Convert {
            widen: |src, dst| widen(Portable, src, dst),
            narrow: |src, dst| narrow(Portable, src, dst),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use crate::simd::{Lanes, Simd};

    crate::vectorize::x86_entry_points! { [avx2, avx512]
        /// `convert::widen` compiled for the token `S`.
        fn widen<T>(s: S, src: &[T], dst: &mut [T::Acc])
        where [T: Lanes<S>, T::Acc: Lanes<S>, S: Simd<T::Acc>]
        { crate::ops::convert::widen(s, src, dst) }

        /// `convert::narrow` compiled for the token `S`.
        fn narrow<T>(s: S, src: &[T::Acc], dst: &mut [T])
        where [T: Lanes<S>, T::Acc: Lanes<S>, S: Simd<T::Acc>]
        { crate::ops::convert::narrow(s, src, dst) }
    }
}

/// `dst = src` widened to `T::Acc`.
#[inline(always)]
fn widen<S, T>(s: S, src: &[T], dst: &mut [T::Acc])
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: Lanes<S>,
{
    let full = src.len() / S::LANES * S::LANES;
    let (src, src_tail) = src.split_at(full);
    let (dst, dst_tail) = dst.split_at_mut(full);
    for (src, dst) in src
        .chunks_exact(S::LANES)
        .zip(dst.chunks_exact_mut(S::LANES))
    {
        T::Acc::store(s, T::load_exact(s, src), dst);
    }
    if !src_tail.is_empty() {
        store_part(s, load_exact_part(s, src_tail), dst_tail);
    }
}

/// `dst = src` narrowed to `T` (rounding as [`Float::from_acc`]).
#[inline(always)]
fn narrow<S, T>(s: S, src: &[T::Acc], dst: &mut [T])
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: Lanes<S>,
{
    let full = src.len() / S::LANES * S::LANES;
    let (src, src_tail) = src.split_at(full);
    let (dst, dst_tail) = dst.split_at_mut(full);
    for (src, dst) in src
        .chunks_exact(S::LANES)
        .zip(dst.chunks_exact_mut(S::LANES))
    {
        T::store(s, T::Acc::load(s, src), dst);
    }
    if !src_tail.is_empty() {
        store_part(s, load_part(s, src_tail), dst_tail);
    }
}

//! Vectorized conversions between element slices and their accumulation type (e.g. a `bf16`
//! weight to `f32` for the kernels, and an `f32` weight gradient back to `bf16`).

use crate::dispatch::kernels;
use crate::float::Float;

/// `dst[i] = src[i].to_acc()` for every `i`.
///
/// # Panics
/// If the lengths differ.
pub fn to_acc<T: Float>(src: &[T], dst: &mut [T::Acc]) {
    check_lens("convert::to_acc", src.len(), dst.len());
    (kernels::<T>().widen)(src, dst);
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
    (kernels::<T>().narrow)(src, dst);
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

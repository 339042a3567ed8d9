//! RMSNorm over the last dimension of a contiguous row-major `rows x cols` buffer, with the
//! semantics of PyTorch's `_fused_rms_norm` / `_fused_rms_norm_backward` reference composite,
//! and the variants models write by hand ([`WeightMode`], for torchgraft::rms_norm).

mod rows;

use self::rows::{BackwardRows, ForwardRows};
use crate::blocks;
use crate::float::{Acc, Float};
use crate::isa::Isa;
use crate::parallel::Parallel;
use crate::simd::portable::Portable;
#[cfg(target_arch = "x86_64")]
use crate::simd::x86::{Avx2, Avx512};
use crate::tables::select_table;

/// Forward work per block, in elements (rows are never split). Blocks are the unit tasks own.
const FORWARD_BLOCK_ELEMS: usize = 1 << 14;
/// Backward blocks per call at most: one weight-gradient partial (`cols` values) each.
const BACKWARD_MAX_BLOCKS: usize = 32;
/// Backward work per block at least, in elements.
const BACKWARD_MIN_BLOCK_ELEMS: usize = 1 << 14;

/// How the weight scales the normalized value `xhat = x * rstd`. The default is PyTorch's
/// `_fused_rms_norm`: `y = xhat * weight` in `T::Acc`, rounded once.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WeightMode<A> {
    /// Added to the weight in `T::Acc`: rows are scaled by `offset + weight` (Gemma's
    /// `1 + weight`). Unused without a weight.
    pub offset: A,
    /// Round `xhat` to `T` before the weight multiply, as Llama's `weight * xhat.to(dtype)`; the
    /// backward's dw then sums `dy * round(xhat)` (the rounding's derivative taken as 1, as
    /// autograd does for `.to()`).
    pub round_first: bool,
}

/// `offset + weight` (`weight` itself for a zero offset, so that -0 stays -0), or ones without a
/// weight (multiplying by one is exact).
fn scale_of<A: Acc>(weight: Option<&[A]>, offset: A, cols: usize) -> std::borrow::Cow<'_, [A]> {
    match weight {
        Some(w) if offset != A::ZERO => w.iter().map(|&w| w + offset).collect(),
        Some(w) => w.into(),
        None => vec![A::ONE; cols].into(),
    }
}

/// y = (x * rstd) * weight per row, rstd = 1 / sqrt(mean(x^2) + eps), all in T::Acc.
/// x, y: rows*cols; rstd: rows; weight: cols.
///
/// With `cols == 0`, rstd is NaN (the mean of an empty row). Parallel work goes through `par`.
///
/// # Panics
/// If a slice's length does not match `rows`/`cols`.
#[allow(clippy::too_many_arguments)] // the signature the callers code against
pub fn forward<T: Float>(
    x: &[T],
    rows: usize,
    cols: usize,
    weight: Option<&[T::Acc]>,
    eps: T::Acc,
    y: &mut [T],
    rstd: &mut [T::Acc],
    par: &dyn Parallel,
) {
    forward_with(
        x,
        rows,
        cols,
        weight,
        eps,
        WeightMode::default(),
        y,
        rstd,
        par,
    );
}

/// [`forward`] with the weight applied as `mode` says: `y = pre(xhat) * (offset + weight)`,
/// `pre` rounding to `T` with `mode.round_first`.
///
/// # Panics
/// If a slice's length does not match `rows`/`cols`.
#[allow(clippy::too_many_arguments)] // the signature the callers code against
pub fn forward_with<T: Float>(
    x: &[T],
    rows: usize,
    cols: usize,
    weight: Option<&[T::Acc]>,
    eps: T::Acc,
    mode: WeightMode<T::Acc>,
    y: &mut [T],
    rstd: &mut [T::Acc],
    par: &dyn Parallel,
) {
    const FN: &str = "rms_norm::forward";
    let len = elements(FN, rows, cols);
    check_len(FN, "x", x.len(), len);
    check_len(FN, "y", y.len(), len);
    check_len(FN, "rstd", rstd.len(), rows);
    if let Some(weight) = weight {
        check_len(FN, "weight", weight.len(), cols);
    }
    if rows == 0 {
        return;
    }
    if cols == 0 {
        rstd.fill(T::Acc::NAN);
        return;
    }

    // Without a weight, rounding first changes nothing: y is rounded once either way.
    let round_first = mode.round_first && weight.is_some();
    let weight = &*scale_of(weight, mode.offset, cols);
    let kernels = kernels::<T>();
    let block_rows = (FORWARD_BLOCK_ELEMS / cols).max(1);
    let block_elems = block_rows * cols;
    let pieces: Vec<_> = y
        .chunks_mut(block_elems)
        .zip(rstd.chunks_mut(block_rows))
        .collect();
    blocks::for_each(par, pieces, block_elems, |b, (y, rstd)| {
        let x = &x[b * block_elems..][..y.len()];
        (kernels.forward)(ForwardRows {
            x,
            y,
            rstd,
            cols,
            weight,
            eps,
            round_first,
        });
    });
}

/// xhat = x * rstd, g = dy * weight (or dy), dx = rstd * (g - xhat * mean(g * xhat)),
/// dw = sum over rows of dy * xhat. dx/dw are computed only when Some.
///
/// dw is deterministic: rows are summed in blocks fixed by `rows` and `cols` alone, then the
/// blocks in order, so its bits do not depend on `par`. With `rows == 0`, dw is zero.
///
/// # Panics
/// If a slice's length does not match `rows`/`cols`.
#[allow(clippy::too_many_arguments)] // the signature the callers code against
pub fn backward<T: Float>(
    dy: &[T],
    x: &[T],
    rstd: &[T::Acc],
    rows: usize,
    cols: usize,
    weight: Option<&[T::Acc]>,
    dx: Option<&mut [T]>,
    dw: Option<&mut [T::Acc]>,
    par: &dyn Parallel,
) {
    let mode = WeightMode::default();
    backward_with(dy, x, rstd, rows, cols, weight, mode, dx, dw, par);
}

/// [`backward`] of [`forward_with`]: `g = dy * (offset + weight)`, and dw sums
/// `dy * round(xhat)` with `mode.round_first` (the gradient of `offset + weight` is dw's).
///
/// # Panics
/// If a slice's length does not match `rows`/`cols`.
#[allow(clippy::too_many_arguments)] // the signature the callers code against
pub fn backward_with<T: Float>(
    dy: &[T],
    x: &[T],
    rstd: &[T::Acc],
    rows: usize,
    cols: usize,
    weight: Option<&[T::Acc]>,
    mode: WeightMode<T::Acc>,
    dx: Option<&mut [T]>,
    dw: Option<&mut [T::Acc]>,
    par: &dyn Parallel,
) {
    const FN: &str = "rms_norm::backward";
    let len = elements(FN, rows, cols);
    check_len(FN, "dy", dy.len(), len);
    check_len(FN, "x", x.len(), len);
    check_len(FN, "rstd", rstd.len(), rows);
    if let Some(weight) = weight {
        check_len(FN, "weight", weight.len(), cols);
    }
    if let Some(dx) = dx.as_deref() {
        check_len(FN, "dx", dx.len(), len);
    }
    if let Some(dw) = dw.as_deref() {
        check_len(FN, "dw", dw.len(), cols);
    }
    if rows == 0 || cols == 0 || (dx.is_none() && dw.is_none()) {
        if let Some(dw) = dw {
            dw.fill(T::Acc::ZERO);
        }
        return;
    }

    let round_first = mode.round_first && weight.is_some();
    let weight = &*scale_of(weight, mode.offset, cols);
    let kernels = kernels::<T>();
    let block_rows = rows
        .div_ceil(BACKWARD_MAX_BLOCKS)
        .max(BACKWARD_MIN_BLOCK_ELEMS.div_ceil(cols));
    let block_elems = block_rows * cols;
    let n_blocks = rows.div_ceil(block_rows);

    // One weight-gradient partial per block, reduced in block order below.
    let mut partials = match dw {
        Some(_) => vec![T::Acc::ZERO; n_blocks * cols],
        None => Vec::new(),
    };
    let mut dx_blocks = dx.map(|dx| dx.chunks_mut(block_elems));
    let mut dw_blocks = dw.is_some().then(|| partials.chunks_mut(cols));
    let pieces: Vec<_> = (0..n_blocks)
        .map(|_| {
            let dx = dx_blocks.as_mut().and_then(Iterator::next);
            let dw = dw_blocks.as_mut().and_then(Iterator::next);
            (dx, dw)
        })
        .collect();
    blocks::for_each(par, pieces, block_elems, |b, (dx, dw)| {
        let start = b * block_elems;
        let end = (start + block_elems).min(len);
        (kernels.backward)(BackwardRows {
            dy: &dy[start..end],
            x: &x[start..end],
            rstd: &rstd[b * block_rows..][..(end - start) / cols],
            cols,
            weight,
            dx,
            dw,
            round_first,
        });
    });

    if let Some(dw) = dw {
        let mut parts = partials.chunks_exact(cols);
        dw.copy_from_slice(parts.next().expect("rows > 0 makes one block at least"));
        for part in parts {
            (kernels.accumulate)(dw, part);
        }
    }
}

/// `rows * cols`, or a panic naming `func` when it overflows.
#[track_caller]
fn elements(func: &str, rows: usize, cols: usize) -> usize {
    rows.checked_mul(cols)
        .unwrap_or_else(|| panic!("{func}: rows * cols = {rows} * {cols} overflows usize"))
}

/// Panics, naming `func` and the slice, unless `got == want`.
#[track_caller]
fn check_len(func: &str, what: &str, got: usize, want: usize) {
    assert!(
        got == want,
        "{func}: `{what}` has {got} elements, expected {want}"
    );
}

/// RMSNorm's row kernels for element type `T`, compiled for one instruction set.
struct Kernels<T: Float> {
    /// [`rows::forward`] over a block of rows.
    forward: fn(ForwardRows<'_, T>),
    /// [`rows::backward`] over a block of rows.
    backward: fn(BackwardRows<'_, T>),
    /// [`rows::accumulate`].
    accumulate: fn(&mut [T::Acc], &[T::Acc]),
}

impl<T: Float> Clone for Kernels<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: Float> Copy for Kernels<T> {}

/// The kernels for `T` and [`Isa::current`]: SIMD ones for `f32`, `f64`, `bf16` and `f16`, the
/// portable ones otherwise.
fn kernels<T: Float>() -> Kernels<T> {
    let isa = Isa::current();
    select_table!(|N| match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => Kernels::<N> {
            forward: |rows| x86::avx512::forward(Avx512::get(), rows),
            backward: |rows| x86::avx512::backward(Avx512::get(), rows),
            accumulate: |acc, part| x86::avx512::accumulate(Avx512::get(), acc, part),
        },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Kernels::<N> {
            forward: |rows| x86::avx2::forward(Avx2::get(), rows),
            backward: |rows| x86::avx2::backward(Avx2::get(), rows),
            accumulate: |acc, part| x86::avx2::accumulate(Avx2::get(), acc, part),
        },
        _ => portable::<N>(),
    })
    .unwrap_or_else(portable::<T>)
}

/// The portable kernels, for any `T`.
fn portable<T: Float>() -> Kernels<T> {
    Kernels {
        forward: |rows| rows::forward(Portable, rows),
        backward: |rows| rows::backward(Portable, rows),
        accumulate: |acc, part| rows::accumulate(Portable, acc, part),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::rows::{self, BackwardRows, ForwardRows};
    use crate::float::Acc;
    use crate::simd::{Lanes, Simd};

    crate::vectorize::x86_entry_points! { [avx2, avx512]
        /// [`rows::forward`] compiled for the token `S`.
        fn forward<T>(s: S, rows: ForwardRows<'_, T>)
        where [T: Lanes<S>, T::Acc: Lanes<S>, S: Simd<T::Acc>]
        { rows::forward(s, rows) }

        /// [`rows::backward`] compiled for the token `S`.
        fn backward<T>(s: S, rows: BackwardRows<'_, T>)
        where [T: Lanes<S>, T::Acc: Lanes<S>, S: Simd<T::Acc>]
        { rows::backward(s, rows) }

        /// [`rows::accumulate`] compiled for the token `S`.
        fn accumulate<A>(s: S, acc: &mut [A], part: &[A])
        where [A: Acc + Lanes<S>, S: Simd<A>]
        { rows::accumulate(s, acc, part) }
    }
}

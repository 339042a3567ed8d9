//! Row kernels written once against [`Simd`]/[`Lanes`], compiled per token.
//!
//! Every function here is `#[inline(always)]`: each is meant to be inlined into a token's entry
//! point (for x86, a `#[target_feature]` function), never to be called on its own.

use crate::float::{Acc, Float};
use crate::simd::{load_exact_part, load_part, store_part, Lanes, Simd};

/// One block of whole rows for the forward kernel.
pub(crate) struct ForwardRows<'a, T: Float> {
    /// Input rows, `rows * cols` elements.
    pub x: &'a [T],
    /// Output rows, like `x`.
    pub y: &'a mut [T],
    /// One reciprocal RMS per row.
    pub rstd: &'a mut [T::Acc],
    /// Row length, at least 1.
    pub cols: usize,
    /// Per-column scale (all ones when the caller has no weight: multiplying by one is exact).
    pub weight: &'a [T::Acc],
    /// Added to the mean square.
    pub eps: T::Acc,
}

/// One block of whole rows for the backward kernel.
pub(crate) struct BackwardRows<'a, T: Float> {
    /// Output gradient rows, `rows * cols` elements.
    pub dy: &'a [T],
    /// Input rows, like `dy`.
    pub x: &'a [T],
    /// One reciprocal RMS per row (from the forward pass).
    pub rstd: &'a [T::Acc],
    /// Row length, at least 1.
    pub cols: usize,
    /// Per-column scale (all ones when the caller has no weight).
    pub weight: &'a [T::Acc],
    /// Input gradient rows, like `dy`, when wanted.
    pub dx: Option<&'a mut [T]>,
    /// This block's partial weight gradient (`cols` values, accumulated into), when wanted.
    pub dw: Option<&'a mut [T::Acc]>,
}

/// `y = (x * rstd) * weight` per row, with `rstd = 1 / sqrt(mean(x^2) + eps)`.
#[inline(always)]
pub(crate) fn forward<S, T>(s: S, rows: ForwardRows<'_, T>)
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: Lanes<S>,
{
    let ForwardRows {
        x,
        y,
        rstd,
        cols,
        weight,
        eps,
    } = rows;
    let n = T::Acc::from_usize(cols);
    let row_pairs = x.chunks_exact(cols).zip(y.chunks_exact_mut(cols));
    for (i, ((x_row, y), rstd)) in row_pairs.zip(rstd.iter_mut()).enumerate() {
        let r = T::Acc::ONE / (sum_squares(s, x_row) / n + eps).sqrt();
        *rstd = r;
        let next = x.get((i + 1) * cols..).unwrap_or(&[]);
        scale(s, x_row, r, weight, y, next);
    }
    s.fence_streams();
}

/// The sum of `x^2` in `T::Acc`, over four vector accumulators.
#[inline(always)]
fn sum_squares<S, T>(s: S, x: &[T]) -> T::Acc
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
{
    let lanes = S::LANES;
    let mut acc = [s.splat(T::Acc::ZERO); 4];
    let quads = x.chunks_exact(4 * lanes);
    let rest = quads.remainder();
    for quad in quads {
        for (k, acc) in acc.iter_mut().enumerate() {
            let v = T::load(s, &quad[k * lanes..(k + 1) * lanes]);
            *acc = s.mul_add(v, v, *acc);
        }
    }
    let singles = rest.chunks_exact(lanes);
    let tail = singles.remainder();
    for single in singles {
        let v = T::load(s, single);
        acc[0] = s.mul_add(v, v, acc[0]);
    }
    if !tail.is_empty() {
        let v = load_part(s, tail);
        acc[1] = s.mul_add(v, v, acc[1]);
    }
    s.sum(s.add(s.add(acc[0], acc[1]), s.add(acc[2], acc[3])))
}

/// `y = (x * r) * w` for one row, prefetching the row after (`next`, empty for none).
#[inline(always)]
fn scale<S, T>(s: S, x: &[T], r: T::Acc, w: &[T::Acc], y: &mut [T], next: &[T])
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: Lanes<S>,
{
    let lanes = S::LANES;
    let full = x.len() / lanes * lanes;
    let r = s.splat(r);
    let (x, x_tail) = x.split_at(full);
    let (w, w_tail) = w.split_at(full);
    let (y, y_tail) = y.split_at_mut(full);
    let chunks = x.chunks_exact(lanes).zip(w.chunks_exact(lanes));
    for (i, ((x, w), y)) in chunks.zip(y.chunks_exact_mut(lanes)).enumerate() {
        if exp(0) {
            s.prefetch(next.get(i * lanes..).unwrap_or(&[]));
        }
        let v = s.mul(s.mul(T::load(s, x), r), T::Acc::load(s, w));
        if exp(1) {
            T::store_stream(s, v, y);
        } else {
            T::store(s, v, y);
        }
    }
    if !x_tail.is_empty() {
        let v = s.mul(s.mul(load_part(s, x_tail), r), load_part(s, w_tail));
        store_part(s, v, y_tail);
    }
}

/// Per row: `xhat = x * rstd`, `g = dy * weight`, `dx = (g - xhat * mean(g * xhat)) * rstd`, and
/// `dw += dy * xhat` into the block's partial.
#[inline(always)]
pub(crate) fn backward<S, T>(s: S, rows: BackwardRows<'_, T>)
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: Lanes<S>,
{
    let BackwardRows {
        dy,
        x,
        rstd,
        cols,
        weight,
        dx,
        dw,
    } = rows;
    let inputs = dy.chunks_exact(cols).zip(x.chunks_exact(cols)).zip(rstd);
    match (dx, dw) {
        (Some(dx), Some(dw)) => {
            for (((dy, x), &r), dx) in inputs.zip(dx.chunks_exact_mut(cols)) {
                backward_row::<S, T, true, true>(s, dy, x, r, weight, dx, dw);
            }
        }
        (Some(dx), None) => {
            for (((dy, x), &r), dx) in inputs.zip(dx.chunks_exact_mut(cols)) {
                backward_row::<S, T, true, false>(s, dy, x, r, weight, dx, &mut []);
            }
        }
        (None, Some(dw)) => {
            for ((dy, x), &r) in inputs {
                backward_row::<S, T, false, true>(s, dy, x, r, weight, &mut [], dw);
            }
        }
        (None, None) => {}
    }
}

/// One row of [`backward`]; `DX`/`DW` select the outputs (`dx`/`dw` are empty when not).
#[inline(always)]
fn backward_row<S, T, const DX: bool, const DW: bool>(
    s: S,
    dy: &[T],
    x: &[T],
    r: T::Acc,
    w: &[T::Acc],
    dx: &mut [T],
    dw: &mut [T::Acc],
) where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: Lanes<S>,
{
    let lanes = S::LANES;
    let cols = x.len();
    let full = cols / lanes * lanes;
    let rv = s.splat(r);

    // Pass 1 (dy and x from memory): dot = sum(g * xhat); dw += dy * xhat.
    let mut dot = s.splat(T::Acc::ZERO);
    let mut step = |d: S::V, xhat: S::V, w: &[T::Acc], dw: &mut [T::Acc], part: bool| {
        if DX {
            let w = if part {
                load_part(s, w)
            } else {
                T::Acc::load(s, w)
            };
            dot = s.mul_add(s.mul(d, w), xhat, dot);
        }
        if DW {
            if part {
                store_part(s, s.mul_add(d, xhat, load_part(s, dw)), dw);
            } else {
                T::Acc::store(s, s.mul_add(d, xhat, T::Acc::load(s, dw)), dw);
            }
        }
    };
    for i in (0..full).step_by(lanes) {
        let end = i + lanes;
        let xhat = s.mul(T::load(s, &x[i..end]), rv);
        let d = T::load(s, &dy[i..end]);
        let dw = if DW { &mut dw[i..end] } else { &mut [] };
        step(d, xhat, &w[i..end], dw, false);
    }
    if full < cols {
        let xhat = s.mul(load_part(s, &x[full..]), rv);
        let d = load_part(s, &dy[full..]);
        let dw = if DW { &mut dw[full..] } else { &mut [] };
        step(d, xhat, &w[full..], dw, true);
    }
    if !DX {
        return;
    }

    // Pass 2 (dy and x from cache): dx = (g - xhat * mean) * rstd.
    let neg_mean = s.splat(T::Acc::ZERO - s.sum(dot) / T::Acc::from_usize(cols));
    let grad = |x: S::V, d: S::V, w: S::V| {
        let g = s.mul(d, w);
        s.mul(s.mul_add(s.mul(x, rv), neg_mean, g), rv)
    };
    for i in (0..full).step_by(lanes) {
        let end = i + lanes;
        let v = grad(
            T::load(s, &x[i..end]),
            T::load(s, &dy[i..end]),
            T::Acc::load(s, &w[i..end]),
        );
        T::store(s, v, &mut dx[i..end]);
    }
    if full < cols {
        let v = grad(
            load_part(s, &x[full..]),
            load_part(s, &dy[full..]),
            load_part(s, &w[full..]),
        );
        store_part(s, v, &mut dx[full..]);
    }
}

/// `dst = src` widened to `T::Acc`.
#[inline(always)]
pub(crate) fn widen<S, T>(s: S, src: &[T], dst: &mut [T::Acc])
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
pub(crate) fn narrow<S, T>(s: S, src: &[T::Acc], dst: &mut [T])
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

/// `acc += part`, lane by lane (the fixed-order reduction of weight-gradient partials).
#[inline(always)]
pub(crate) fn accumulate<S, A>(s: S, acc: &mut [A], part: &[A])
where
    A: Acc + Lanes<S>,
    S: Simd<A>,
{
    let full = acc.len() / S::LANES * S::LANES;
    let (acc, acc_tail) = acc.split_at_mut(full);
    let (part, part_tail) = part.split_at(full);
    for (acc, part) in acc
        .chunks_exact_mut(S::LANES)
        .zip(part.chunks_exact(S::LANES))
    {
        A::store(s, s.add(A::load(s, acc), A::load(s, part)), acc);
    }
    for (acc, &part) in acc_tail.iter_mut().zip(part_tail) {
        *acc += part;
    }
}

/// TEMPORARY experiment switches.
#[doc(hidden)]
pub static EXP: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
pub(crate) fn exp(bit: u32) -> bool {
    EXP.load(std::sync::atomic::Ordering::Relaxed) >> bit & 1 == 1
}

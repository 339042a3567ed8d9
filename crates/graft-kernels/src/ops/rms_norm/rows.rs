//! RMSNorm's row kernels, written once against [`Simd`]/[`Lanes`] and compiled per token.
//!
//! Every function here is `#[inline(always)]`, and none takes a closure: each must be inlined
//! into a token's entry point (for x86, a `#[target_feature]` function), or its intrinsics would
//! be calls.
//!
//! Each row is read twice: a first pass reduces it (from memory), a second pass writes the
//! outputs (from cache). During the second pass the next row is prefetched, so that memory keeps
//! streaming while the core computes.

use crate::float::{Acc, Float};
use crate::simd::{load_part, store_part, Lanes, Simd};

/// One block of whole rows for the forward kernel.
pub(super) struct ForwardRows<'a, T: Float> {
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
    /// Round `x * rstd` to `T` before the weight multiply (Llama's `w * xhat.to(dtype)`).
    pub round_first: bool,
}

/// One block of whole rows for the backward kernel.
pub(super) struct BackwardRows<'a, T: Float> {
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
    /// The forward rounded `x * rstd` to `T` before the weight multiply: dw sums
    /// `dy * round(xhat)` (dx is unchanged: the rounding's derivative is taken as 1).
    pub round_first: bool,
}

/// Row `i` of the `cols`-long rows of `data`, and the row to prefetch while working on it: the
/// next one, or row `i` itself for the last row.
#[inline(always)]
fn row_and_next<T>(data: &[T], cols: usize, i: usize) -> (&[T], &[T]) {
    let row = &data[i * cols..(i + 1) * cols];
    (row, data.get((i + 1) * cols..(i + 2) * cols).unwrap_or(row))
}

/// `y = (x * rstd) * weight` per row, with `rstd = 1 / sqrt(mean(x^2) + eps)` (`x * rstd`
/// rounded to `T` first with `round_first`).
#[inline(always)]
pub(super) fn forward<S, T>(s: S, rows: ForwardRows<'_, T>)
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
        round_first,
    } = rows;
    let n = T::Acc::from_usize(cols);
    for (i, (y, rstd)) in y.chunks_exact_mut(cols).zip(rstd).enumerate() {
        let (x, next) = row_and_next(x, cols, i);
        let r = T::Acc::ONE / (sum_squares(s, x) / n + eps).sqrt();
        *rstd = r;
        if round_first {
            scale::<S, T, true>(s, x, r, weight, y, next);
        } else {
            scale::<S, T, false>(s, x, r, weight, y, next);
        }
    }
}

/// `xhat` as the weight multiply sees it: rounded to `T` if `ROUND`.
#[inline(always)]
fn pre_weight<S, T, const ROUND: bool>(s: S, xhat: S::V) -> S::V
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
{
    if ROUND {
        T::round(s, xhat)
    } else {
        xhat
    }
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

/// `y = (x * r) * w` for one row (`x * r` rounded to `T` first if `ROUND`), prefetching `next`
/// (as long as `x`).
#[inline(always)]
fn scale<S, T, const ROUND: bool>(s: S, x: &[T], r: T::Acc, w: &[T::Acc], y: &mut [T], next: &[T])
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: Lanes<S>,
{
    let lanes = S::LANES;
    let r = s.splat(r);
    let (x, x_tail) = x.split_at(x.len() / lanes * lanes);
    let (w, w_tail) = w.split_at(x.len());
    let (y, y_tail) = y.split_at_mut(x.len());
    let inputs = x.chunks_exact(lanes).zip(w.chunks_exact(lanes));
    let outputs = y.chunks_exact_mut(lanes).zip(next.chunks_exact(lanes));
    for ((x, w), (y, next)) in inputs.zip(outputs) {
        s.prefetch(next);
        let xhat = pre_weight::<S, T, ROUND>(s, s.mul(T::load(s, x), r));
        T::store(s, s.mul(xhat, T::Acc::load(s, w)), y);
    }
    if !x_tail.is_empty() {
        let xhat = pre_weight::<S, T, ROUND>(s, s.mul(load_part(s, x_tail), r));
        store_part(s, s.mul(xhat, load_part(s, w_tail)), y_tail);
    }
}

/// Per row: `xhat = x * rstd`, `g = dy * weight`, `dx = (g - xhat * mean(g * xhat)) * rstd`, and
/// `dw += dy * xhat` (`xhat` rounded to `T` with `round_first`) into the block's partial.
#[inline(always)]
pub(super) fn backward<S, T>(s: S, rows: BackwardRows<'_, T>)
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
        round_first,
    } = rows;
    let n = T::Acc::from_usize(cols);
    match (dx, dw) {
        (Some(dx), dw) => {
            let mut dw = dw;
            for (i, (dx, &r)) in dx.chunks_exact_mut(cols).zip(rstd).enumerate() {
                let (dy, next_dy) = row_and_next(dy, cols, i);
                let (x, next_x) = row_and_next(x, cols, i);
                let w = weight;
                let mean = match (dw.as_deref_mut(), round_first) {
                    (Some(dw), false) => dot_and_dw::<S, T, true, false>(s, dy, x, r, w, dw),
                    (Some(dw), true) => dot_and_dw::<S, T, true, true>(s, dy, x, r, w, dw),
                    (None, _) => dot_and_dw::<S, T, false, false>(s, dy, x, r, w, &mut []),
                } / n;
                input_grad(s, dy, x, r, weight, mean, dx, (next_dy, next_x));
            }
        }
        (None, Some(dw)) => {
            for (i, &r) in rstd.iter().enumerate() {
                let (dy, x) = (&dy[i * cols..(i + 1) * cols], &x[i * cols..(i + 1) * cols]);
                if round_first {
                    weight_grad::<S, T, true>(s, dy, x, r, dw);
                } else {
                    weight_grad::<S, T, false>(s, dy, x, r, dw);
                }
            }
        }
        (None, None) => {}
    }
}

/// Backward pass 1 over one row: returns `sum(g * xhat)`, and adds `dy * xhat` (`xhat` rounded
/// to `T` if `ROUND`) to `dw` if `DW` (`dw` is empty otherwise).
#[inline(always)]
fn dot_and_dw<S, T, const DW: bool, const ROUND: bool>(
    s: S,
    dy: &[T],
    x: &[T],
    r: T::Acc,
    w: &[T::Acc],
    dw: &mut [T::Acc],
) -> T::Acc
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: Lanes<S>,
{
    let lanes = S::LANES;
    let full = x.len() / lanes * lanes;
    let rv = s.splat(r);
    // The vector at `i`: returns `dot + g * xhat`, and adds `dy * xhat` to `dw`.
    #[inline(always)]
    fn step<S, T, const DW: bool, const ROUND: bool>(
        s: S,
        (dy, x, w): (&[T], &[T], &[T::Acc]),
        r: S::V,
        dw: &mut [T::Acc],
        dot: S::V,
    ) -> S::V
    where
        S: Simd<T::Acc>,
        T: Lanes<S>,
        T::Acc: Lanes<S>,
    {
        let (dy, xhat) = (T::load(s, dy), s.mul(T::load(s, x), r));
        if DW {
            let xw = pre_weight::<S, T, ROUND>(s, xhat);
            T::Acc::store(s, s.mul_add(dy, xw, T::Acc::load(s, dw)), dw);
        }
        s.mul_add(s.mul(dy, T::Acc::load(s, w)), xhat, dot)
    }
    // Two accumulators taking turns, so that consecutive vectors do not wait on each other.
    let (mut dot0, mut dot1) = (s.splat(T::Acc::ZERO), s.splat(T::Acc::ZERO));
    for (k, i) in (0..full).step_by(lanes).enumerate() {
        let j = i + lanes;
        let inputs = (&dy[i..j], &x[i..j], &w[i..j]);
        let dw: &mut [T::Acc] = if DW { &mut dw[i..j] } else { &mut [] };
        if k % 2 == 0 {
            dot0 = step::<S, T, DW, ROUND>(s, inputs, rv, dw, dot0);
        } else {
            dot1 = step::<S, T, DW, ROUND>(s, inputs, rv, dw, dot1);
        }
    }
    if full < x.len() {
        let (dy, x, w) = (
            load_part(s, &dy[full..]),
            load_part(s, &x[full..]),
            load_part(s, &w[full..]),
        );
        let xhat = s.mul(x, rv);
        if DW {
            let dw = &mut dw[full..];
            let xw = pre_weight::<S, T, ROUND>(s, xhat);
            store_part(s, s.mul_add(dy, xw, load_part(s, dw)), dw);
        }
        dot1 = s.mul_add(s.mul(dy, w), xhat, dot1);
    }
    s.sum(s.add(dot0, dot1))
}

/// Backward pass 2 over one row: `dx = (dy * w - xhat * mean) * rstd`, prefetching `next`
/// (the next row's `dy` and `x`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn input_grad<S, T>(
    s: S,
    dy: &[T],
    x: &[T],
    r: T::Acc,
    w: &[T::Acc],
    mean: T::Acc,
    dx: &mut [T],
    next: (&[T], &[T]),
) where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: Lanes<S>,
{
    let lanes = S::LANES;
    let full = x.len() / lanes * lanes;
    let rv = s.splat(r);
    let neg_mean = s.splat(T::Acc::ZERO - mean);
    #[inline(always)]
    fn grad<S: Simd<A>, A: Acc>(s: S, dy: S::V, x: S::V, w: S::V, r: S::V, neg_mean: S::V) -> S::V {
        let g = s.mul(dy, w);
        s.mul(s.mul_add(s.mul(x, r), neg_mean, g), r)
    }
    let (dy, dy_tail) = dy.split_at(full);
    let (x, x_tail) = x.split_at(full);
    let (w, w_tail) = w.split_at(full);
    let (dx, dx_tail) = dx.split_at_mut(full);
    let inputs = dy
        .chunks_exact(lanes)
        .zip(x.chunks_exact(lanes))
        .zip(w.chunks_exact(lanes));
    let next = next.0.chunks_exact(lanes).zip(next.1.chunks_exact(lanes));
    for (((dy, x), w), (dx, (next_dy, next_x))) in inputs.zip(dx.chunks_exact_mut(lanes).zip(next))
    {
        s.prefetch(next_dy);
        s.prefetch(next_x);
        let v = grad(
            s,
            T::load(s, dy),
            T::load(s, x),
            T::Acc::load(s, w),
            rv,
            neg_mean,
        );
        T::store(s, v, dx);
    }
    if !x_tail.is_empty() {
        let (dy, x, w) = (
            load_part(s, dy_tail),
            load_part(s, x_tail),
            load_part(s, w_tail),
        );
        store_part(s, grad(s, dy, x, w, rv, neg_mean), dx_tail);
    }
}

/// The weight gradient alone, one pass over the row: `dw += dy * x * rstd` (`x * rstd` rounded
/// to `T` first if `ROUND`).
#[inline(always)]
fn weight_grad<S, T, const ROUND: bool>(s: S, dy: &[T], x: &[T], r: T::Acc, dw: &mut [T::Acc])
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: Lanes<S>,
{
    let lanes = S::LANES;
    let full = x.len() / lanes * lanes;
    let rv = s.splat(r);
    let (dy, dy_tail) = dy.split_at(full);
    let (x, x_tail) = x.split_at(full);
    let (dw, dw_tail) = dw.split_at_mut(full);
    let inputs = dy.chunks_exact(lanes).zip(x.chunks_exact(lanes));
    for ((dy, x), dw) in inputs.zip(dw.chunks_exact_mut(lanes)) {
        let xhat = pre_weight::<S, T, ROUND>(s, s.mul(T::load(s, x), rv));
        T::Acc::store(s, s.mul_add(T::load(s, dy), xhat, T::Acc::load(s, dw)), dw);
    }
    if !x_tail.is_empty() {
        let xhat = pre_weight::<S, T, ROUND>(s, s.mul(load_part(s, x_tail), rv));
        store_part(
            s,
            s.mul_add(load_part(s, dy_tail), xhat, load_part(s, dw_tail)),
            dw_tail,
        );
    }
}

/// `acc += part`, lane by lane (the fixed-order reduction of weight-gradient partials).
#[inline(always)]
pub(super) fn accumulate<S, A>(s: S, acc: &mut [A], part: &[A])
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

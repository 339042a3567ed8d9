//! Cross-entropy over rows of logits, with the gradient computed in the same call.
//!
//! For a row `x` of `cols` logits, target class `t` and label smoothing `eps`:
//!
//! ```text
//! lse  = log(sum_c exp(x_c))
//! loss = lse - (1 - eps) x_t - (eps / cols) sum_c x_c
//! grad = scale * (softmax(x) - (1 - eps) onehot(t) - eps / cols)
//! ```
//!
//! which is PyTorch's `cross_entropy(x.float(), t, label_smoothing=eps)` per row. Rows whose
//! target is `ignore_index` get a zero loss and a zero gradient. Arithmetic happens in `T::Acc`
//! (f32, f64 for f64). Each row is read twice (its maximum, then its exponentials, stored in a
//! per-thread scratch row in `T::Acc`; the second read comes from cache); the gradient is made
//! in the scratch row and narrowed once to `T` by the ISA's vectorized conversion, possibly over
//! the logits themselves ([`forward_in_place`]).
//!
//! The loops work on [`LANES`]-wide arrays with a branch-free exponential, so that the compiler
//! vectorizes them; [`crate::vectorize`] compiles them for the best instruction set.

use std::cell::RefCell;

use crate::blocks;
use crate::float::{Acc, Float};
use crate::isa::Isa;
use crate::ops::convert::Convert;
use crate::parallel::Parallel;
use crate::vectorize::{self, Job};

/// Lanes of the arrays the row loops work on (one AVX-512 vector of f32, two of AVX2).
const LANES: usize = 16;

/// Elements per parallel task, about (whole rows for the loss).
const TASK_ELEMS: usize = 1 << 15;

/// The loss's parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Options {
    /// Classes per row (`V`), at least 1.
    pub cols: usize,
    /// Target value of rows to skip.
    pub ignore_index: i64,
    /// Label smoothing in `[0, 1]` (PyTorch treats negative values as 0; callers pass 0 then).
    pub smoothing: f64,
}

/// The factor each row's gradient is multiplied by: `all`, times `rows[r]` when given (the
/// per-row upstream gradient of an unreduced loss).
#[derive(Clone, Copy, Debug)]
pub struct Scale<'a, A> {
    /// Factor of every row (e.g. `1 / valid rows` for a mean).
    pub all: A,
    /// Per-row factors, one per row, when given.
    pub rows: Option<&'a [A]>,
}

/// A target that is neither `ignore_index` nor a class in `0..cols`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadTarget(pub i64);

/// Checks every target and counts the rows that are not ignored.
///
/// # Errors
/// The first target outside `0..cols` that is not `ignore_index`.
pub fn count_valid(target: &[i64], cols: usize, ignore_index: i64) -> Result<usize, BadTarget> {
    let mut valid = 0;
    for &t in target {
        if t == ignore_index {
            continue;
        }
        if t < 0 || t as u64 >= cols as u64 {
            return Err(BadTarget(t));
        }
        valid += 1;
    }
    Ok(valid)
}

/// The transcendental functions the rows need, in the accumulation types.
pub trait CeMath: Acc {
    /// `-inf`.
    const NEG_INF: Self;
    /// `e^self` for `self <= 0` (or NaN, which stays NaN). Below the smallest normal result it
    /// returns 0.
    fn exp_nonpos(self) -> Self;
    /// The natural logarithm.
    fn ln(self) -> Self;
    /// `v` rounded to `Self`.
    fn from_f64(v: f64) -> Self;
    /// Runs `f` with `len` values of this thread's scratch (reused between calls).
    fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [Self]) -> R) -> R;
}

thread_local! {
    static SCRATCH_F32: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static SCRATCH_F64: RefCell<Vec<f64>> = const { RefCell::new(Vec::new()) };
}

fn with_scratch_in<A: Copy + Default, R>(
    cell: &RefCell<Vec<A>>,
    len: usize,
    f: impl FnOnce(&mut [A]) -> R,
) -> R {
    let mut v = cell.borrow_mut();
    if v.len() < len {
        v.resize(len, A::default());
    }
    f(&mut v[..len])
}

impl CeMath for f32 {
    const NEG_INF: f32 = f32::NEG_INFINITY;
    /// Cody-Waite reduction `x = k ln2 + r`, `|r| <= ln2 / 2`, a degree-7 minimax polynomial
    /// for `e^r` (Cephes' coefficients, about 1 ulp), and `2^k` built from its bits: no branch
    /// and no call, so loops over it vectorize.
    #[inline(always)]
    fn exp_nonpos(self) -> f32 {
        const LOG2E: f32 = std::f32::consts::LOG2_E;
        // ln 2 split so that `k * LN2_HI` is exact for |k| < 2^15.
        const LN2_HI: f32 = 0.693_359_4;
        const LN2_LO: f32 = -2.121_944_4e-4;
        // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
        const ROUND: f32 = 12_582_912.0;
        const LO: f32 = -87.0;
        const HI: f32 = 88.0;
        let x = self;
        // NaN stays NaN and produces NaN.
        let xc = x.clamp(LO, HI);
        // `rounded`'s low mantissa bits hold k (ROUND's bits plus k): 2^k is built from them
        // with integer operations, no float-to-int conversion (which would not vectorize).
        let rounded = xc * LOG2E + ROUND;
        let kf = rounded - ROUND;
        let r = (xc - kf * LN2_HI) - kf * LN2_LO;
        let mut p = 1.987_569_2e-4_f32;
        p = p * r + 1.398_199_9e-3;
        p = p * r + 8.333_452e-3;
        p = p * r + 4.166_579_6e-2;
        p = p * r + 1.666_666_5e-1;
        p = p * r + 0.5;
        let er = p * r * r + r + 1.0;
        // k is in [-126, 127] (garbage for NaN, whose `er` is NaN anyway): 2^k is normal.
        let k_biased = rounded
            .to_bits()
            .wrapping_sub(ROUND.to_bits())
            .wrapping_add(127);
        let two_k = f32::from_bits(k_biased << 23);
        let y = er * two_k;
        if x < LO {
            0.0
        } else {
            y
        }
    }
    #[inline(always)]
    fn ln(self) -> f32 {
        f32::ln(self)
    }
    #[inline(always)]
    fn from_f64(v: f64) -> f32 {
        v as f32
    }
    fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
        SCRATCH_F32.with(|c| with_scratch_in(c, len, f))
    }
}

impl CeMath for f64 {
    const NEG_INF: f64 = f64::NEG_INFINITY;
    #[inline(always)]
    fn exp_nonpos(self) -> f64 {
        f64::exp(self)
    }
    #[inline(always)]
    fn ln(self) -> f64 {
        f64::ln(self)
    }
    #[inline(always)]
    fn from_f64(v: f64) -> f64 {
        v
    }
    fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f64]) -> R) -> R {
        SCRATCH_F64.with(|c| with_scratch_in(c, len, f))
    }
}

/// Per-row constants of the loss.
#[derive(Clone, Copy)]
struct Consts<A> {
    cols: usize,
    ignore_index: i64,
    /// `1 - eps`.
    on_target: A,
    /// `eps / cols`.
    per_class: A,
    /// Whether `eps > 0` (the sum of the row is needed).
    smoothing: bool,
}

impl<A: CeMath> Consts<A> {
    fn new(o: &Options) -> Self {
        let eps = o.smoothing.max(0.0);
        Consts {
            cols: o.cols,
            ignore_index: o.ignore_index,
            on_target: A::from_f64(1.0 - eps),
            per_class: A::from_f64(eps / o.cols as f64),
            smoothing: eps > 0.0,
        }
    }
}

/// `(max, sum_c exp(x_c - max), sum_c x_c)` of a row (the sum of the row only when smoothing),
/// each exponential also stored in `e` when given.
#[inline(always)]
fn row_stats<T: Float>(
    x: &[T],
    smoothing: bool,
    e: Option<&mut [T::Acc]>,
) -> (T::Acc, T::Acc, T::Acc)
where
    T::Acc: CeMath,
{
    let split = x.len() - x.len() % LANES;
    let (body, tail) = x.split_at(split);
    let mut mx = [T::Acc::NEG_INF; LANES];
    let mut sum = [T::Acc::ZERO; LANES];
    for chunk in body.chunks_exact(LANES) {
        for i in 0..LANES {
            let v = chunk[i].to_acc();
            // NaN never wins here; it reaches the result through the exponentials below.
            mx[i] = if v > mx[i] { v } else { mx[i] };
            if smoothing {
                sum[i] += v;
            }
        }
    }
    for (i, t) in tail.iter().enumerate() {
        let v = t.to_acc();
        mx[i] = if v > mx[i] { v } else { mx[i] };
        if smoothing {
            sum[i] += v;
        }
    }
    let m = mx
        .iter()
        .fold(T::Acc::NEG_INF, |a, &b| if b > a { b } else { a });
    let mut se = [T::Acc::ZERO; LANES];
    match e {
        Some(e) => {
            let (e_body, e_tail) = e.split_at_mut(split);
            for (chunk, ec) in body.chunks_exact(LANES).zip(e_body.chunks_exact_mut(LANES)) {
                for i in 0..LANES {
                    let v = (chunk[i].to_acc() - m).exp_nonpos();
                    ec[i] = v;
                    se[i] += v;
                }
            }
            for (i, (t, ec)) in tail.iter().zip(e_tail.iter_mut()).enumerate() {
                let v = (t.to_acc() - m).exp_nonpos();
                *ec = v;
                se[i] += v;
            }
        }
        None => {
            for chunk in body.chunks_exact(LANES) {
                for i in 0..LANES {
                    se[i] += (chunk[i].to_acc() - m).exp_nonpos();
                }
            }
            for (i, t) in tail.iter().enumerate() {
                se[i] += (t.to_acc() - m).exp_nonpos();
            }
        }
    }
    (m, lane_sum(se), lane_sum(sum))
}

/// The sum of the lanes, pairwise (a fixed order).
#[inline(always)]
fn lane_sum<A: Acc>(v: [A; LANES]) -> A {
    let mut w = v;
    let mut n = LANES;
    while n > 1 {
        n /= 2;
        for i in 0..n {
            let hi = w[i + n];
            w[i] += hi;
        }
    }
    w[0]
}

/// One row's loss and, when `e` (`cols` values of scratch) is given, its gradient in `e`:
/// `scale * (softmax - (1 - eps) onehot(t) - eps / cols)`. Ignored rows give zeros.
#[inline(always)]
fn row<T: Float>(
    x: &[T],
    t: i64,
    k: &Consts<T::Acc>,
    scale: T::Acc,
    e: Option<&mut [T::Acc]>,
) -> T::Acc
where
    T::Acc: CeMath,
{
    if t == k.ignore_index {
        if let Some(e) = e {
            e.fill(T::Acc::ZERO);
        }
        return T::Acc::ZERO;
    }
    let t = t as usize;
    let xt = x[t].to_acc();
    let (m, se, sum) = match e {
        None => row_stats(x, k.smoothing, None),
        Some(e) => {
            let (m, se, sum) = row_stats(x, k.smoothing, Some(&mut *e));
            // e holds exp(x - m): the softmax is e / se.
            let f = scale / se;
            let off = k.per_class * scale;
            for v in e.iter_mut() {
                *v = *v * f - off;
            }
            e[t] = e[t] - k.on_target * scale;
            (m, se, sum)
        }
    };
    let lse = m + se.ln();
    let mut loss = lse - k.on_target * xt;
    if k.smoothing {
        loss = loss - k.per_class * sum;
    }
    loss
}

/// Where a task's rows come from and where their gradient goes.
enum RowsData<'a, T> {
    /// Read the logits; write the gradient into `grad` when given.
    Read {
        x: &'a [T],
        grad: Option<&'a mut [T]>,
    },
    /// Read the logits, then write the gradient over them.
    InPlace(&'a mut [T]),
}

/// Rows `first..first + loss.len()` of one task.
struct Rows<'a, T: Float> {
    data: RowsData<'a, T>,
    target: &'a [i64],
    loss: &'a mut [T::Acc],
    /// `cols` values of scratch (unused for the loss alone).
    scratch: &'a mut [T::Acc],
    scale: Scale<'a, T::Acc>,
    first: usize,
    k: Consts<T::Acc>,
    /// The vectorized narrowing of the calling thread's ISA.
    narrow: fn(&[T::Acc], &mut [T]),
}

impl<T: Float> Job for Rows<'_, T>
where
    T::Acc: CeMath,
{
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let cols = self.k.cols;
        let Rows {
            data,
            target,
            loss,
            scratch,
            scale,
            first,
            k,
            narrow,
        } = self;
        match data {
            RowsData::Read { x, grad } => {
                let mut grad = grad;
                for (r, loss) in loss.iter_mut().enumerate() {
                    let xr = &x[r * cols..(r + 1) * cols];
                    let s = row_scale(&scale, first + r);
                    match grad.as_deref_mut() {
                        None => *loss = row(xr, target[first + r], &k, s, None),
                        Some(g) => {
                            *loss = row(xr, target[first + r], &k, s, Some(&mut *scratch));
                            narrow(scratch, &mut g[r * cols..(r + 1) * cols]);
                        }
                    }
                }
            }
            RowsData::InPlace(x) => {
                for (r, (loss, xr)) in loss.iter_mut().zip(x.chunks_exact_mut(cols)).enumerate() {
                    let s = row_scale(&scale, first + r);
                    *loss = row(&*xr, target[first + r], &k, s, Some(&mut *scratch));
                    narrow(scratch, xr);
                }
            }
        }
    }
}

#[inline(always)]
fn row_scale<A: Acc>(s: &Scale<'_, A>, row: usize) -> A {
    match s.rows {
        Some(rows) => s.all * rows[row],
        None => s.all,
    }
}

fn rows_per_task(cols: usize) -> usize {
    (TASK_ELEMS / cols.max(1)).max(1)
}

#[track_caller]
fn check(logits: usize, target: &[i64], loss: usize, o: &Options, scale_rows: Option<usize>) {
    let rows = target.len();
    assert!(o.cols >= 1, "cross_entropy: cols must be at least 1");
    assert_eq!(logits, rows * o.cols, "cross_entropy: logits length");
    assert_eq!(loss, rows, "cross_entropy: loss length");
    if let Some(n) = scale_rows {
        assert_eq!(n, rows, "cross_entropy: per-row scale length");
    }
}

/// Runs the tasks: `items` are each task's (loss rows, data), `per` rows each.
fn run_rows<'a, T: Float>(
    items: Vec<(&'a mut [T::Acc], RowsData<'a, T>)>,
    target: &'a [i64],
    o: &Options,
    scale: Scale<'a, T::Acc>,
    par: &dyn Parallel,
) where
    T::Acc: CeMath,
{
    let k = Consts::new(o);
    let per = rows_per_task(o.cols);
    let isa = Isa::current();
    let narrow = Convert::<T>::new().narrow;
    blocks::for_each(par, items, per * o.cols, |i, (loss, data)| {
        T::Acc::with_scratch(o.cols, |scratch| {
            vectorize::run_with(
                isa,
                Rows {
                    data,
                    target,
                    loss,
                    scratch,
                    scale,
                    first: i * per,
                    k,
                    narrow,
                },
            );
        });
    });
}

/// Per-row losses of `logits` (`target.len()` rows of `o.cols`), and the gradient into `grad`
/// (same length as `logits`) when given. Targets must have passed [`count_valid`].
///
/// # Panics
/// If a length disagrees, or a target is out of range.
pub fn forward<T: Float>(
    logits: &[T],
    target: &[i64],
    o: &Options,
    loss: &mut [T::Acc],
    grad: Option<(&mut [T], Scale<'_, T::Acc>)>,
    par: &dyn Parallel,
) where
    T::Acc: CeMath,
{
    check(logits.len(), target, loss.len(), o, None);
    let per = rows_per_task(o.cols);
    let rows = per * o.cols;
    let x = logits.chunks(rows);
    match grad {
        Some((g, scale)) => {
            assert_eq!(g.len(), logits.len(), "cross_entropy: grad length");
            check(
                logits.len(),
                target,
                loss.len(),
                o,
                scale.rows.map(<[_]>::len),
            );
            let items = loss
                .chunks_mut(per)
                .zip(x.zip(g.chunks_mut(rows)))
                .map(|(l, (x, g))| (l, RowsData::Read { x, grad: Some(g) }))
                .collect();
            run_rows::<T>(items, target, o, scale, par);
        }
        None => {
            let items = loss
                .chunks_mut(per)
                .zip(x)
                .map(|(l, x)| (l, RowsData::Read { x, grad: None }))
                .collect();
            let scale = Scale {
                all: T::Acc::ONE,
                rows: None,
            };
            run_rows::<T>(items, target, o, scale, par);
        }
    }
}

/// [`forward`] with the gradient written over the logits.
///
/// # Panics
/// If a length disagrees, or a target is out of range.
pub fn forward_in_place<T: Float>(
    logits: &mut [T],
    target: &[i64],
    o: &Options,
    loss: &mut [T::Acc],
    scale: Scale<'_, T::Acc>,
    par: &dyn Parallel,
) where
    T::Acc: CeMath,
{
    check(
        logits.len(),
        target,
        loss.len(),
        o,
        scale.rows.map(<[_]>::len),
    );
    let per = rows_per_task(o.cols);
    let items = loss
        .chunks_mut(per)
        .zip(logits.chunks_mut(per * o.cols))
        .map(|(l, x)| (l, RowsData::InPlace(x)))
        .collect();
    run_rows::<T>(items, target, o, scale, par);
}

/// Elements converted at a time through the scratch when scaling.
const PIECE: usize = 4096;

/// What a scaling task reads and writes.
enum ScaleData<'a, T> {
    Into { src: &'a [T], dst: &'a mut [T] },
    InPlace(&'a mut [T]),
}

/// Elements `first..first + len` of a gradient of rows of `cols`, times their row's factor:
/// widened into the scratch, multiplied, narrowed (the ISA's vectorized conversions). In place,
/// pieces whose factor is exactly 1 are left alone.
struct ScaleTask<'a, T: Float> {
    data: ScaleData<'a, T>,
    first: usize,
    cols: usize,
    scale: Scale<'a, T::Acc>,
    scratch: &'a mut [T::Acc],
    widen: fn(&[T], &mut [T::Acc]),
    narrow: fn(&[T::Acc], &mut [T]),
}

impl<T: Float> Job for ScaleTask<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let ScaleTask {
            mut data,
            first,
            cols,
            scale,
            scratch,
            widen,
            narrow,
        } = self;
        let len = match &data {
            ScaleData::Into { dst, .. } => dst.len(),
            ScaleData::InPlace(x) => x.len(),
        };
        let mut i = 0;
        while i < len {
            let row = (first + i) / cols;
            let end = len.min(i + PIECE).min((row + 1) * cols - first);
            let f = row_scale(&scale, row);
            let buf = &mut scratch[..end - i];
            match &mut data {
                ScaleData::Into { src, dst } => {
                    widen(&src[i..end], buf);
                    for v in buf.iter_mut() {
                        *v = *v * f;
                    }
                    narrow(buf, &mut dst[i..end]);
                }
                ScaleData::InPlace(_) if f == T::Acc::ONE => {}
                ScaleData::InPlace(x) => {
                    widen(&x[i..end], buf);
                    for v in buf.iter_mut() {
                        *v = *v * f;
                    }
                    narrow(buf, &mut x[i..end]);
                }
            }
            i = end;
        }
    }
}

/// Checks the shapes of a scaling (rows of `cols`, per-row factors matching).
#[track_caller]
fn check_scale<A>(len: usize, cols: usize, scale: &Scale<'_, A>) {
    let rows = len / cols;
    assert_eq!(rows * cols, len, "cross_entropy: scale rows");
    if let Some(r) = scale.rows {
        assert_eq!(r.len(), rows, "cross_entropy: per-row scale length");
    }
}

/// Runs the scaling tasks over `items` (each `TASK_ELEMS` elements but the last).
fn run_scale<'a, T: Float>(
    items: Vec<ScaleData<'a, T>>,
    cols: usize,
    scale: Scale<'a, T::Acc>,
    par: &dyn Parallel,
) where
    T::Acc: CeMath,
{
    let isa = Isa::current();
    let table = Convert::<T>::new();
    blocks::for_each(par, items, TASK_ELEMS, |i, data| {
        T::Acc::with_scratch(PIECE, |scratch| {
            vectorize::run_with(
                isa,
                ScaleTask {
                    data,
                    first: i * TASK_ELEMS,
                    cols,
                    scale,
                    scratch,
                    widen: table.widen,
                    narrow: table.narrow,
                },
            );
        });
    });
}

/// `grad *= scale` row by row (rows of `cols`), in place; elements whose factor is exactly 1
/// are not touched.
///
/// # Panics
/// If `grad.len()` is not a multiple of `cols`, or the per-row factors do not match the rows.
pub fn scale_in_place<T: Float>(
    grad: &mut [T],
    cols: usize,
    scale: Scale<'_, T::Acc>,
    par: &dyn Parallel,
) where
    T::Acc: CeMath,
{
    let cols = cols.max(1);
    check_scale(grad.len(), cols, &scale);
    let items = grad
        .chunks_mut(TASK_ELEMS)
        .map(ScaleData::InPlace)
        .collect();
    run_scale(items, cols, scale, par);
}

/// `dst = src * scale` row by row (rows of `cols`), each element rounded once.
///
/// # Panics
/// As [`scale_in_place`], or if `dst` and `src` differ in length.
pub fn scale_into<T: Float>(
    src: &[T],
    dst: &mut [T],
    cols: usize,
    scale: Scale<'_, T::Acc>,
    par: &dyn Parallel,
) where
    T::Acc: CeMath,
{
    assert_eq!(src.len(), dst.len(), "cross_entropy: scale_into lengths");
    let cols = cols.max(1);
    check_scale(src.len(), cols, &scale);
    let items = src
        .chunks(TASK_ELEMS)
        .zip(dst.chunks_mut(TASK_ELEMS))
        .map(|(src, dst)| ScaleData::Into { src, dst })
        .collect();
    run_scale(items, cols, scale, par);
}

/// The reduced loss: the sum of the per-row losses, divided by `valid` for a mean (`0 / 0` is
/// NaN, as in PyTorch). Summed in f64 in row order.
pub fn reduce<A: CeMath + Into<f64>>(loss: &[A], mean: bool, valid: usize) -> A {
    let total: f64 = loss.iter().map(|&l| l.into()).sum();
    A::from_f64(if mean { total / valid as f64 } else { total })
}

// ------------------------------------------------------------------- vocabulary blocks

/// One block of consecutive classes `first_col..first_col + cols` of every row, as the
/// vocabulary-blocked fused linear cross-entropy computes them (two passes over the blocks:
/// statistics, then gradients; the rows' full logits never exist).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// Classes in the block (>= 1); the block's logits are `rows * cols`, row-major.
    pub cols: usize,
    /// Class index of the block's first column.
    pub first_col: usize,
    /// Target value of rows to skip.
    pub ignore_index: i64,
}

/// Per-row running statistics over the blocks seen so far (accumulation type), and where the
/// last block writes the result.
#[derive(Debug)]
pub struct BlockStats<'a, A> {
    /// Running maximum; after the last block, the row's log-sum-exp.
    pub max: &'a mut [A],
    /// Running sum of `exp(x - max)`.
    pub sum: &'a mut [A],
    /// The target's logit, written by the block that holds the target.
    pub target_logit: &'a mut [A],
    /// For the last block: each row's loss `lse - x_t` (0 for ignored rows); `max` then
    /// becomes the log-sum-exp.
    pub loss: Option<&'a mut [A]>,
    /// Whether this is the first block (the running statistics start from it, unread).
    pub first: bool,
}

/// `(max, sum_c exp(x_c - max))` of a block's row: `(-inf, 0)` for a row of `-inf` (NaN for
/// the sum if a NaN is among them: NaN never wins the maximum, it reaches the sum).
#[inline(always)]
fn block_row_stats<T: Float>(x: &[T]) -> (T::Acc, T::Acc)
where
    T::Acc: CeMath,
{
    let (m, s, _) = row_stats(x, false, None);
    if m == T::Acc::NEG_INF {
        // NaN is the one value not comparable with itself.
        let nan = x
            .iter()
            .any(|v| v.to_acc().partial_cmp(&v.to_acc()).is_none());
        return (m, if nan { T::Acc::NAN } else { T::Acc::ZERO });
    }
    (m, s)
}

/// `(m, s)` merged with `(m2, s2)`: both sums scaled to the larger maximum. While the maximum
/// is `-inf` the sums are 0 (or NaN), and add.
#[inline(always)]
fn merge_stats<A: CeMath>(m: A, s: A, m2: A, s2: A) -> (A, A) {
    let mx = if m2 > m { m2 } else { m };
    if mx == A::NEG_INF {
        return (mx, s + s2);
    }
    (mx, s * (m - mx).exp_nonpos() + s2 * (m2 - mx).exp_nonpos())
}

/// One task of [`block_stats`]: rows `first_row..` of a block.
struct StatsTask<'a, T: Float> {
    x: &'a [T],
    target: &'a [i64],
    max: &'a mut [T::Acc],
    sum: &'a mut [T::Acc],
    target_logit: &'a mut [T::Acc],
    loss: Option<&'a mut [T::Acc]>,
    first: bool,
    b: Block,
}

impl<T: Float> Job for StatsTask<'_, T>
where
    T::Acc: CeMath,
{
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let StatsTask {
            x,
            target,
            max,
            sum,
            target_logit,
            mut loss,
            first,
            b,
        } = self;
        for (r, xr) in x.chunks_exact(b.cols).enumerate() {
            let t = target[r];
            if t == b.ignore_index {
                if let Some(l) = loss.as_deref_mut() {
                    l[r] = T::Acc::ZERO;
                }
                continue;
            }
            let (bm, bs) = block_row_stats(xr);
            let (m, s) = if first {
                (bm, bs)
            } else {
                merge_stats(max[r], sum[r], bm, bs)
            };
            let local = (t as u64).wrapping_sub(b.first_col as u64);
            if local < b.cols as u64 {
                target_logit[r] = xr[local as usize].to_acc();
            }
            match loss.as_deref_mut() {
                Some(l) => {
                    let lse = m + s.ln();
                    max[r] = lse;
                    l[r] = lse - target_logit[r];
                }
                None => {
                    max[r] = m;
                    sum[r] = s;
                }
            }
        }
    }
}

/// The rows of a vocabulary block (one per target), after checking that `b` has classes and
/// the logits hold `rows x b.cols` values.
fn check_block_shape(logits_len: usize, target: &[i64], b: &Block) -> usize {
    let rows = target.len();
    assert!(
        b.cols >= 1,
        "cross_entropy: a block needs at least one class"
    );
    assert_eq!(
        logits_len,
        rows * b.cols,
        "cross_entropy: block logits length"
    );
    rows
}

/// Merges one block of logits (`target.len()` rows of `b.cols`) into each row's running
/// maximum and sum of exponentials (online softmax), and records the target's logit when the
/// target is in the block. Rows whose target is `b.ignore_index` are skipped (their loss is 0).
/// Targets must have passed [`count_valid`] over the whole vocabulary.
///
/// # Panics
/// If a length disagrees or `b.cols` is 0.
pub fn block_stats<T: Float>(
    logits: &[T],
    target: &[i64],
    b: &Block,
    stats: BlockStats<'_, T::Acc>,
    par: &dyn Parallel,
) where
    T::Acc: CeMath,
{
    let rows = check_block_shape(logits.len(), target, b);
    for (name, len) in [
        ("max", stats.max.len()),
        ("sum", stats.sum.len()),
        ("target logit", stats.target_logit.len()),
        ("loss", stats.loss.as_ref().map_or(rows, |l| l.len())),
    ] {
        assert_eq!(len, rows, "cross_entropy: block {name} length");
    }
    let per = rows_per_task(b.cols);
    let BlockStats {
        max,
        sum,
        target_logit,
        loss,
        first,
    } = stats;
    let mut losses: Vec<Option<&mut [T::Acc]>> = match loss {
        Some(l) => l.chunks_mut(per).map(Some).collect(),
        None => (0..rows.div_ceil(per)).map(|_| None).collect(),
    };
    let items: Vec<_> = logits
        .chunks(per * b.cols)
        .zip(max.chunks_mut(per))
        .zip(sum.chunks_mut(per).zip(target_logit.chunks_mut(per)))
        .zip(losses.drain(..))
        .collect();
    let isa = Isa::current();
    let b = *b;
    blocks::for_each(
        par,
        items,
        per * b.cols,
        |i, (((x, max), (sum, tl)), loss)| {
            let first_row = i * per;
            vectorize::run_with(
                isa,
                StatsTask::<T> {
                    x,
                    target: &target[first_row..first_row + max.len()],
                    max,
                    sum,
                    target_logit: tl,
                    loss,
                    first,
                    b,
                },
            );
        },
    );
}

/// One task of [`block_grad`].
struct GradTask<'a, T: Float> {
    x: &'a mut [T],
    target: &'a [i64],
    lse: &'a [T::Acc],
    scale: Scale<'a, T::Acc>,
    first_row: usize,
    scratch: &'a mut [T::Acc],
    b: Block,
    narrow: fn(&[T::Acc], &mut [T]),
}

impl<T: Float> Job for GradTask<'_, T>
where
    T::Acc: CeMath,
{
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let GradTask {
            x,
            target,
            lse,
            scale,
            first_row,
            scratch,
            b,
            narrow,
        } = self;
        for (r, xr) in x.chunks_exact_mut(b.cols).enumerate() {
            let t = target[r];
            if t == b.ignore_index {
                scratch.fill(T::Acc::ZERO);
                narrow(scratch, xr);
                continue;
            }
            let f = row_scale(&scale, first_row + r);
            let l = lse[r];
            for (e, v) in scratch.iter_mut().zip(xr.iter()) {
                *e = (v.to_acc() - l).exp_nonpos() * f;
            }
            let local = (t as u64).wrapping_sub(b.first_col as u64);
            if local < b.cols as u64 {
                let e = &mut scratch[local as usize];
                *e = *e - f;
            }
            narrow(scratch, xr);
        }
    }
}

/// Replaces one block of logits (`target.len()` rows of `b.cols`) by the loss's gradient over
/// them: `(exp(x - lse) - [class == target]) * factor`, the factor `scale.all` times
/// `scale.rows[row]` when given; rows whose target is `b.ignore_index` get zeros. `lse` is
/// each row's log-sum-exp over the whole vocabulary ([`BlockStats::max`] after the last block).
///
/// # Panics
/// If a length disagrees or `b.cols` is 0.
pub fn block_grad<T: Float>(
    logits: &mut [T],
    target: &[i64],
    b: &Block,
    lse: &[T::Acc],
    scale: Scale<'_, T::Acc>,
    par: &dyn Parallel,
) where
    T::Acc: CeMath,
{
    let rows = check_block_shape(logits.len(), target, b);
    assert_eq!(lse.len(), rows, "cross_entropy: block lse length");
    if let Some(r) = scale.rows {
        assert_eq!(r.len(), rows, "cross_entropy: per-row scale length");
    }
    let per = rows_per_task(b.cols);
    let isa = Isa::current();
    let narrow = Convert::<T>::new().narrow;
    let b = *b;
    let items: Vec<_> = logits.chunks_mut(per * b.cols).collect();
    blocks::for_each(par, items, per * b.cols, |i, x| {
        let first_row = i * per;
        let n = x.len() / b.cols;
        T::Acc::with_scratch(b.cols, |scratch| {
            vectorize::run_with(
                isa,
                GradTask::<T> {
                    x,
                    target: &target[first_row..first_row + n],
                    lse: &lse[first_row..first_row + n],
                    scale,
                    first_row,
                    scratch,
                    b,
                    narrow,
                },
            );
        });
    });
}

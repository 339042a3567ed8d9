//! The loss and gradient of whole rows: per row, the maximum, then the exponentials (kept in
//! the scratch row, which becomes the gradient), then the log-sum-exp.

use super::{row_scale, rows_per_task, CeMath, Options, Scale, LANES};
use crate::blocks;
use crate::float::{Acc, Float};
use crate::isa::Isa;
use crate::ops::convert::Convert;
use crate::parallel::Parallel;
use crate::vectorize::{self, Job};

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
pub(super) fn row_stats<T: Float>(
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
/// (same length as `logits`) when given. Targets must have passed [`count_valid`](super::count_valid).
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

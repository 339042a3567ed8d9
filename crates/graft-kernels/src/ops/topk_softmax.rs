//! Mixture-of-experts routing: softmax over each row of router logits, the `k` largest
//! probabilities and their expert indices (largest first, the lower index first among equals),
//! optionally renormalized to sum to one (Qwen3-MoE's and Mixtral's `norm_topk_prob`).
//!
//! Probabilities and weights are in the accumulation type (`f32`, `f64` for `f64` logits), as
//! the models compute them (`softmax(logits, dtype=torch.float)`). The backward needs the
//! probabilities of every expert only without renormalization; with it, the gradient reaches the
//! selected logits alone (`dl_j = w_j (g_j - sum_i g_i w_i)`).

use std::cmp::Ordering;

use crate::blocks::for_each;
pub use crate::float::RoutingMath;
use crate::float::{Acc, Float};
use crate::parallel::Parallel;

/// One call's problem: `rows` rows of `experts` logits, `k` of them selected per row.
#[derive(Clone, Copy, Debug)]
pub struct Routing {
    pub rows: usize,
    pub experts: usize,
    pub k: usize,
    pub renormalize: bool,
}

/// Softmax of `logits` into `probs` (same length, nonzero).
fn softmax<T: Float>(logits: &[T], probs: &mut [T::Acc])
where
    T::Acc: RoutingMath,
{
    let mut max = logits[0].to_acc();
    for &x in logits {
        let x = x.to_acc();
        // A NaN logit makes every probability NaN, as torch's softmax does.
        if x > max || x.is_nan() {
            max = x;
        }
    }
    let mut sum = <T::Acc as Acc>::ZERO;
    for (p, &x) in probs.iter_mut().zip(logits) {
        *p = (x.to_acc() - max).exp();
        sum += *p;
    }
    for p in probs.iter_mut() {
        *p = *p / sum;
    }
}

/// Descending probability, then ascending index; NaN first (torch.topk's order).
fn larger_first<A: RoutingMath>(probs: &[A], a: usize, b: usize) -> Ordering {
    let (pa, pb) = (probs[a], probs[b]);
    match (pa.is_nan(), pb.is_nan()) {
        (true, false) => return Ordering::Less,
        (false, true) => return Ordering::Greater,
        _ => {}
    }
    match pb.partial_cmp(&pa) {
        Some(Ordering::Equal) | None => a.cmp(&b),
        Some(order) => order,
    }
}

/// The `k` largest of `probs`, largest first, into `chosen` (`order` is scratch of its length).
fn top_k<A: RoutingMath>(probs: &[A], k: usize, order: &mut Vec<usize>, chosen: &mut [i64]) {
    order.clear();
    order.extend(0..probs.len());
    let by = |a: &usize, b: &usize| larger_first(probs, *a, *b);
    if k < order.len() {
        order.select_nth_unstable_by(k - 1, by);
    }
    order[..k].sort_unstable_by(by);
    for (c, &e) in chosen.iter_mut().zip(&order[..k]) {
        *c = e as i64;
    }
}

/// Routing weights `(rows, k)` and expert indices `(rows, k)` of `logits` `(rows, experts)`,
/// rows contiguous. `k` is at least 1 and at most `experts`.
pub fn forward<T: Float>(
    shape: Routing,
    logits: &[T],
    weights: &mut [T::Acc],
    indices: &mut [i64],
    par: &dyn Parallel,
) where
    T::Acc: RoutingMath,
{
    let Routing {
        rows,
        experts,
        k,
        renormalize,
    } = shape;
    assert!(k >= 1 && k <= experts, "k must be in 1..=experts");
    assert_eq!(logits.len(), rows * experts);
    assert_eq!(weights.len(), rows * k);
    assert_eq!(indices.len(), rows * k);
    let items: Vec<_> = weights.chunks_mut(k).zip(indices.chunks_mut(k)).collect();
    for_each(par, items, experts, |row, (w, idx)| {
        let mut probs = vec![<T::Acc as Acc>::ZERO; experts];
        let mut order = Vec::with_capacity(experts);
        softmax(&logits[row * experts..(row + 1) * experts], &mut probs);
        top_k(&probs, k, &mut order, idx);
        let mut sum = <T::Acc as Acc>::ZERO;
        for (wj, &e) in w.iter_mut().zip(idx.iter()) {
            *wj = probs[e as usize];
            sum += *wj;
        }
        if renormalize {
            for wj in w.iter_mut() {
                *wj = *wj / sum;
            }
        }
    });
}

/// The gradient `(rows, experts)` of the logits from that of the weights `(rows, k)`, given the
/// forward's `weights` and `indices`.
pub fn backward<T: Float>(
    shape: Routing,
    grad_weights: &[T::Acc],
    logits: &[T],
    weights: &[T::Acc],
    indices: &[i64],
    grad_logits: &mut [T],
    par: &dyn Parallel,
) where
    T::Acc: RoutingMath,
{
    let Routing {
        rows,
        experts,
        k,
        renormalize,
    } = shape;
    assert_eq!(grad_weights.len(), rows * k);
    assert_eq!(weights.len(), rows * k);
    assert_eq!(indices.len(), rows * k);
    assert_eq!(logits.len(), rows * experts);
    assert_eq!(grad_logits.len(), rows * experts);
    let zero = <T::Acc as Acc>::ZERO;
    let items: Vec<_> = grad_logits.chunks_mut(experts).collect();
    for_each(par, items, experts, |row, out| {
        let g = &grad_weights[row * k..(row + 1) * k];
        let w = &weights[row * k..(row + 1) * k];
        let idx = &indices[row * k..(row + 1) * k];
        let mut dl = vec![zero; experts];
        if renormalize {
            // w = p / sum(p_selected): the unselected logits get no gradient.
            let mut dot = zero;
            for (&gj, &wj) in g.iter().zip(w) {
                dot += gj * wj;
            }
            for ((&gj, &wj), &e) in g.iter().zip(w).zip(idx) {
                dl[e as usize] = wj * (gj - dot);
            }
        } else {
            // w = p: every logit moves the selected probabilities through the softmax.
            let mut probs = vec![zero; experts];
            softmax(&logits[row * experts..(row + 1) * experts], &mut probs);
            let mut dot = zero;
            for (&gj, &e) in g.iter().zip(idx) {
                dot += gj * probs[e as usize];
            }
            for (d, &p) in dl.iter_mut().zip(&probs) {
                *d = zero - p * dot;
            }
            for (&gj, &e) in g.iter().zip(idx) {
                let e = e as usize;
                dl[e] += probs[e] * gj;
            }
        }
        for (o, &d) in out.iter_mut().zip(&dl) {
            *o = T::from_acc(d);
        }
    });
}

//! Mixture-of-experts routing with sigmoid scores and group-limited top-k (DeepSeek-V3's,
//! GLM-4-MoE's routers): per row of router logits,
//!
//! 1. the scores `s = sigmoid(logits)`, and the choice scores `c = s + bias` (the router's
//!    `e_score_correction_bias`, which steers the choice and nothing else);
//! 2. the experts split into `groups` equal groups of adjacent experts; each group's score is
//!    the sum of its two largest `c`; the `topk_groups` best groups stay, the others' experts
//!    are out (with `groups == 1` every expert stays);
//! 3. the `k` largest `c` among the experts left, largest first (the lower index first among
//!    equals, NaN first: torch.topk's order, made definite);
//! 4. the weights are their `s`, divided by `sum + 1e-20` when `renormalize`, times `scale`
//!    (the router's `routed_scaling_factor`).
//!
//! Scores and weights are in the accumulation type (`f32`, `f64` for `f64` logits). The
//! gradient reaches the selected logits only (`s` through the sigmoid); the bias gets none.

use std::cmp::Ordering;

use crate::blocks::for_each;
pub use crate::float::RoutingMath;
use crate::float::{Acc, Float};
use crate::parallel::Parallel;

/// What the renormalization adds to the sum of the selected scores (the models' `1e-20`).
pub const RENORMALIZE_EPSILON: f64 = 1e-20;

/// One call's problem: `rows` rows of `experts` logits, `k` of them selected per row from the
/// `topk_groups` best of `groups` groups.
#[derive(Clone, Copy, Debug)]
pub struct GroupedRouting {
    pub rows: usize,
    pub experts: usize,
    pub k: usize,
    /// Groups of `experts / groups` adjacent experts; divides `experts`.
    pub groups: usize,
    /// Groups kept per row, `1..=groups`; `k <= topk_groups * experts / groups`.
    pub topk_groups: usize,
    pub renormalize: bool,
    pub scale: f64,
}

impl GroupedRouting {
    /// Experts per group.
    pub fn group_size(&self) -> usize {
        self.experts / self.groups
    }

    fn assert_valid(&self) {
        assert!(self.groups >= 1 && self.experts.is_multiple_of(self.groups));
        assert!(self.group_size() >= 2, "a group's score sums its two best");
        assert!(self.topk_groups >= 1 && self.topk_groups <= self.groups);
        assert!(self.k >= 1 && self.k <= self.topk_groups * self.group_size());
    }
}

/// `1 / (1 + e^-x)`.
pub fn sigmoid<A: RoutingMath>(x: A) -> A {
    A::ONE / (A::ONE + (A::ZERO - x).exp())
}

/// Descending value, then ascending index; NaN first (torch.topk's order, made definite).
fn larger_first<A: RoutingMath>(values: &[A], a: usize, b: usize) -> Ordering {
    let (va, vb) = (values[a], values[b]);
    match (va.is_nan(), vb.is_nan()) {
        (true, false) => return Ordering::Less,
        (false, true) => return Ordering::Greater,
        _ => {}
    }
    match vb.partial_cmp(&va) {
        Some(Ordering::Equal) | None => a.cmp(&b),
        Some(order) => order,
    }
}

/// The `k` largest of `values` among `candidates`, largest first, into `order[..k]`.
fn top_k<A: RoutingMath>(values: &[A], k: usize, order: &mut [usize]) {
    let by = |a: &usize, b: &usize| larger_first(values, *a, *b);
    if k < order.len() {
        order.select_nth_unstable_by(k - 1, by);
    }
    order[..k].sort_unstable_by(by);
}

/// One row: the chosen experts into `chosen`, their weights into `w`.
fn route_row<T: Float>(
    shape: &GroupedRouting,
    logits: &[T],
    bias: Option<&[T::Acc]>,
    w: &mut [T::Acc],
    chosen: &mut [i64],
) where
    T::Acc: RoutingMath,
{
    let zero = <T::Acc as Acc>::ZERO;
    let size = shape.group_size();
    let scores: Vec<T::Acc> = logits.iter().map(|x| sigmoid(x.to_acc())).collect();
    let choice: Vec<T::Acc> = match bias {
        Some(b) => scores.iter().zip(b).map(|(&s, &b)| s + b).collect(),
        None => scores.clone(),
    };
    let mut candidates: Vec<usize> = if shape.groups == 1 {
        (0..shape.experts).collect()
    } else {
        let group_scores: Vec<T::Acc> = choice
            .chunks(size)
            .map(|group| {
                let mut order: Vec<usize> = (0..size).collect();
                top_k(group, 2, &mut order);
                group[order[0]] + group[order[1]]
            })
            .collect();
        let mut kept: Vec<usize> = (0..shape.groups).collect();
        top_k(&group_scores, shape.topk_groups, &mut kept);
        kept[..shape.topk_groups]
            .iter()
            .flat_map(|g| g * size..(g + 1) * size)
            .collect()
    };
    top_k(&choice, shape.k, &mut candidates);
    let mut sum = zero;
    for ((wj, c), &e) in w.iter_mut().zip(chosen.iter_mut()).zip(&candidates) {
        *wj = scores[e];
        *c = e as i64;
        sum += *wj;
    }
    let scale = T::Acc::from_f64(shape.scale);
    let denominator = sum + T::Acc::from_f64(RENORMALIZE_EPSILON);
    for wj in w.iter_mut() {
        if shape.renormalize {
            *wj = *wj / denominator;
        }
        *wj = *wj * scale;
    }
}

/// Routing weights `(rows, k)` and expert indices `(rows, k)` of `logits` `(rows, experts)`,
/// rows contiguous; `bias` holds `experts` values.
pub fn forward<T: Float>(
    shape: GroupedRouting,
    logits: &[T],
    bias: Option<&[T::Acc]>,
    weights: &mut [T::Acc],
    indices: &mut [i64],
    par: &dyn Parallel,
) where
    T::Acc: RoutingMath,
{
    shape.assert_valid();
    let (experts, k) = (shape.experts, shape.k);
    assert_eq!(logits.len(), shape.rows * experts);
    assert_eq!(weights.len(), shape.rows * k);
    assert_eq!(indices.len(), shape.rows * k);
    if let Some(b) = bias {
        assert_eq!(b.len(), experts);
    }
    let items: Vec<_> = weights.chunks_mut(k).zip(indices.chunks_mut(k)).collect();
    for_each(par, items, experts, |row, (w, idx)| {
        let x = &logits[row * experts..(row + 1) * experts];
        route_row(&shape, x, bias, w, idx);
    });
}

/// The gradient `(rows, experts)` of the logits from that of the weights `(rows, k)`, given the
/// forward's `indices`; entries outside `0..experts` are skipped, repeated ones add up.
pub fn backward<T: Float>(
    shape: GroupedRouting,
    grad_weights: &[T::Acc],
    logits: &[T],
    indices: &[i64],
    grad_logits: &mut [T],
    par: &dyn Parallel,
) where
    T::Acc: RoutingMath,
{
    let (experts, k) = (shape.experts, shape.k);
    assert_eq!(grad_weights.len(), shape.rows * k);
    assert_eq!(indices.len(), shape.rows * k);
    assert_eq!(logits.len(), shape.rows * experts);
    assert_eq!(grad_logits.len(), shape.rows * experts);
    let zero = <T::Acc as Acc>::ZERO;
    let one = <T::Acc as Acc>::ONE;
    let scale = T::Acc::from_f64(shape.scale);
    let items: Vec<_> = grad_logits.chunks_mut(experts).collect();
    for_each(par, items, experts, |row, out| {
        let g = &grad_weights[row * k..(row + 1) * k];
        let x = &logits[row * experts..(row + 1) * experts];
        let idx = &indices[row * k..(row + 1) * k];
        let selected = |e: i64| usize::try_from(e).ok().filter(|&e| e < experts);
        let s: Vec<T::Acc> = idx
            .iter()
            .map(|&e| selected(e).map_or(zero, |e| sigmoid(x[e].to_acc())))
            .collect();
        // w_j = scale s_j / D with D = sum(s) + eps: ds_i = scale (g_i / D - sum(g s) / D^2).
        let (mut sum, mut dot) = (zero, zero);
        for (&gj, &sj) in g.iter().zip(&s) {
            sum += sj;
            dot += gj * sj;
        }
        let denominator = sum + T::Acc::from_f64(RENORMALIZE_EPSILON);
        let mut dl = vec![zero; experts];
        for ((&gj, &sj), &e) in g.iter().zip(&s).zip(idx) {
            let Some(e) = selected(e) else { continue };
            let ds = if shape.renormalize {
                scale * (gj / denominator - dot / (denominator * denominator))
            } else {
                scale * gj
            };
            dl[e] += ds * sj * (one - sj);
        }
        for (o, &d) in out.iter_mut().zip(&dl) {
            *o = T::from_acc(d);
        }
    });
}

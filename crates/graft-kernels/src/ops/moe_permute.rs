//! Mixture-of-experts token permutation: the `(token, k)` pairs grouped by expert (`sort`), the
//! rows of the pairs gathered into expert order (`permute`), and the experts' output rows put
//! back and summed per token with the routing weights (`unpermute`), with the backward of
//! `unpermute`. `permute`'s backward is `unpermute` without weights.
//!
//! Notation: `tokens` tokens, `top_k` experts each, `S = tokens * top_k` pairs, pair
//! `p = t * top_k + k`. `perm[s]` is the pair in slot `s` (expert order), `inv_perm[p]` the slot
//! of pair `p`. Slots at or beyond `valid` hold pairs of no local expert (sentinels under expert
//! parallelism): they count as zero everywhere, and their rows of any output are zero.
//!
//! Sums and dot products are in `T::Acc` (`f32`, `f64` for `f64`), each output rounded once.
//! No atomics: each output row is written by one task, in a fixed order.
//!
//! The callers check the indices (`perm`, `inv_perm` within `0..S`, `valid <= S`); an index out of
//! range here panics (bounds-checked), it never reads outside a slice.

use crate::blocks::for_each;
use crate::float::{Acc, Float};
use crate::parallel::Parallel;

/// One call's problem: `tokens * top_k` slots of `hidden` elements each, the first `valid` of
/// them holding real experts.
#[derive(Clone, Copy, Debug)]
pub struct Permutation {
    pub tokens: usize,
    pub top_k: usize,
    pub hidden: usize,
    pub valid: usize,
}

impl Permutation {
    /// Number of `(token, k)` pairs (and of slots).
    pub fn pairs(&self) -> usize {
        self.tokens * self.top_k
    }

    fn check(&self) {
        assert!(self.top_k >= 1, "top_k must be at least 1");
        assert!(
            self.valid <= self.pairs(),
            "valid must be at most tokens * top_k"
        );
    }
}

/// Groups the pairs of `expert_ids` (`S`, pair `p = t * top_k + k`) by expert with a stable
/// counting sort: `perm[s]` is the pair in slot `s` (experts ascending, pairs ascending within
/// an expert), `inv_perm[perm[s]] = s`, and `offsets[e]` (`num_experts` of them) the end of
/// expert `e`'s slots. An id outside `0..num_experts` (another rank's expert) counts in no
/// expert: its pair sorts after every local one, so the slots from `offsets[num_experts - 1]`
/// on are the sentinels. `S` must fit in `i32` (the offsets' type).
pub fn sort(
    expert_ids: &[i64],
    num_experts: usize,
    perm: &mut [i64],
    inv_perm: &mut [i64],
    offsets: &mut [i32],
) {
    let pairs = expert_ids.len();
    assert!(num_experts >= 1, "num_experts must be at least 1");
    assert!(i32::try_from(pairs).is_ok(), "at most i32::MAX pairs");
    assert_eq!(perm.len(), pairs);
    assert_eq!(inv_perm.len(), pairs);
    assert_eq!(offsets.len(), num_experts);
    // Key `num_experts` collects the other ranks' pairs, last.
    let key = |id: i64| {
        if (0..num_experts as i64).contains(&id) {
            id as usize
        } else {
            num_experts
        }
    };
    let mut next = vec![0usize; num_experts + 1];
    for &id in expert_ids {
        next[key(id)] += 1;
    }
    // Counts -> each key's first slot; `offsets` are the local keys' ends.
    let mut start = 0;
    for (e, n) in next.iter_mut().enumerate() {
        let count = *n;
        *n = start;
        start += count;
        if e < num_experts {
            offsets[e] = start as i32;
        }
    }
    for (p, &id) in expert_ids.iter().enumerate() {
        let slot = &mut next[key(id)];
        perm[*slot] = p as i64;
        inv_perm[p] = *slot as i64;
        *slot += 1;
    }
}

/// The first index of `indices` outside `0..bound`, with its value (`None` when all are in).
pub fn first_out_of_range(indices: &[i64], bound: usize) -> Option<(usize, i64)> {
    indices
        .iter()
        .position(|&i| i < 0 || i as u64 >= bound as u64)
        .map(|at| (at, indices[at]))
}

/// `out[s] = hidden[perm[s] / top_k]` for `s < valid`, zero beyond. `hidden` is
/// `(tokens, hidden)`, `out` `(S, hidden)`, both row-major.
pub fn permute<T: Float>(
    shape: Permutation,
    hidden: &[T],
    perm: &[i64],
    out: &mut [T],
    par: &dyn Parallel,
) {
    shape.check();
    let (h, s_len) = (shape.hidden, shape.pairs());
    assert_eq!(hidden.len(), shape.tokens * h);
    assert_eq!(perm.len(), s_len);
    assert_eq!(out.len(), s_len * h);
    if h == 0 {
        return;
    }
    let rows: Vec<_> = out.chunks_mut(h).collect();
    for_each(par, rows, h, |s, row| {
        if s < shape.valid {
            let t = perm[s] as usize / shape.top_k;
            row.copy_from_slice(&hidden[t * h..(t + 1) * h]);
        } else {
            row.fill(T::default());
        }
    });
}

/// `out[t] = sum_k w[t, k] * y[inv_perm[t * top_k + k]]` over the pairs whose slot is below
/// `valid` (`w = 1` without `weights`), summed in `k` order in `T::Acc` and rounded once.
/// `y` is `(S, hidden)`, `weights` `(tokens, top_k)`, `out` `(tokens, hidden)`.
pub fn unpermute<T: Float, W: Float<Acc = T::Acc>>(
    shape: Permutation,
    y: &[T],
    inv_perm: &[i64],
    weights: Option<&[W]>,
    out: &mut [T],
    par: &dyn Parallel,
) {
    shape.check();
    let (h, k_len) = (shape.hidden, shape.top_k);
    assert_eq!(y.len(), shape.pairs() * h);
    assert_eq!(inv_perm.len(), shape.pairs());
    assert!(weights.is_none_or(|w| w.len() == shape.pairs()));
    assert_eq!(out.len(), shape.tokens * h);
    if h == 0 {
        return;
    }
    let rows: Vec<_> = out.chunks_mut(h).collect();
    for_each(par, rows, h * k_len, |t, row| {
        let mut acc = vec![<T::Acc as Acc>::ZERO; h];
        for p in t * k_len..(t + 1) * k_len {
            let s = inv_perm[p] as usize;
            if s >= shape.valid {
                continue;
            }
            let src = &y[s * h..(s + 1) * h];
            match weights {
                Some(w) => {
                    let w = w[p].to_acc();
                    for (a, &v) in acc.iter_mut().zip(src) {
                        *a += w * v.to_acc();
                    }
                }
                None => {
                    for (a, &v) in acc.iter_mut().zip(src) {
                        *a += v.to_acc();
                    }
                }
            }
        }
        for (o, &a) in row.iter_mut().zip(&acc) {
            *o = T::from_acc(a);
        }
    });
}

/// The backward of [`unpermute`] given the gradient `grad` `(tokens, hidden)` of its output:
///
/// - `dy[s] = w[perm[s]] * grad[perm[s] / top_k]` for `s < valid`, zero beyond (`w = 1` without
///   weights);
/// - `dweights[p] = dot(y[inv_perm[p]], grad[p / top_k])` in `T::Acc`, zero for a pair whose slot
///   is at or beyond `valid` (`dweights` only with `weights`).
#[allow(clippy::too_many_arguments)]
pub fn unpermute_backward<T: Float, W: Float<Acc = T::Acc>>(
    shape: Permutation,
    grad: &[T],
    y: &[T],
    perm: &[i64],
    inv_perm: &[i64],
    weights: Option<&[W]>,
    dy: &mut [T],
    dweights: Option<&mut [W]>,
    par: &dyn Parallel,
) {
    shape.check();
    let (h, k_len, s_len) = (shape.hidden, shape.top_k, shape.pairs());
    assert_eq!(grad.len(), shape.tokens * h);
    assert_eq!(y.len(), s_len * h);
    assert_eq!(perm.len(), s_len);
    assert_eq!(inv_perm.len(), s_len);
    assert!(weights.is_none_or(|w| w.len() == s_len));
    assert_eq!(dy.len(), s_len * h);
    if h > 0 {
        let rows: Vec<_> = dy.chunks_mut(h).collect();
        for_each(par, rows, h, |s, row| {
            if s >= shape.valid {
                row.fill(T::default());
                return;
            }
            let p = perm[s] as usize;
            let t = p / k_len;
            let src = &grad[t * h..(t + 1) * h];
            match weights {
                Some(w) => {
                    let w = w[p].to_acc();
                    for (o, &g) in row.iter_mut().zip(src) {
                        *o = T::from_acc(w * g.to_acc());
                    }
                }
                None => row.copy_from_slice(src),
            }
        });
    }
    let Some(dweights) = dweights else {
        return;
    };
    assert_eq!(dweights.len(), s_len);
    let items: Vec<_> = dweights.chunks_mut(k_len).collect();
    for_each(par, items, (h * k_len).max(1), |t, dw| {
        let g = &grad[t * h..(t + 1) * h];
        for (k, d) in dw.iter_mut().enumerate() {
            let s = inv_perm[t * k_len + k] as usize;
            let mut dot = <T::Acc as Acc>::ZERO;
            if s < shape.valid {
                for (&a, &b) in y[s * h..(s + 1) * h].iter().zip(g) {
                    dot += a.to_acc() * b.to_acc();
                }
            }
            *d = W::from_acc(dot);
        }
    });
}

//! Sigmoid group-limited MoE routing forward and backward against f64 references written here
//! (every expert sorted, every group scored by sorting), for every dtype, with and without a
//! bias, renormalization and scale, one group or several, and on parallel schedules.
//!
//! Logits lie on a grid of 1/16 and biases on one of 1/8, so that equal choice scores are equal
//! in every precision (ties go to the lower index everywhere) and unequal ones are far apart
//! compared with float32 rounding: the chosen experts are compared exactly.

mod common;

use common::*;
use graft_kernels::ops::topk_sigmoid::{backward, forward, GroupedRouting, RoutingMath};
use graft_kernels::{Parallel, Serial, Threads};
use half::{bf16, f16};

/// (rows, experts, k, groups, topk_groups).
const SHAPES: [(usize, usize, usize, usize, usize); 7] = [
    (1, 2, 1, 1, 1),
    (7, 8, 2, 1, 1),
    (33, 64, 8, 8, 4),
    (5, 60, 6, 6, 2),
    (3, 16, 8, 4, 2),
    (40, 256, 8, 8, 4),
    (9, 32, 4, 16, 3),
];

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Indices of `values` largest first, the lower index first among equals.
fn ranked(values: &[f64]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].partial_cmp(&values[a]).unwrap().then(a.cmp(&b)));
    order
}

/// f64 reference of one row: (weights, indices).
fn reference_forward(
    row: &[f64],
    bias: Option<&[f64]>,
    s: &GroupedRouting,
) -> (Vec<f64>, Vec<i64>) {
    let scores: Vec<f64> = row.iter().map(|&x| sigmoid(x)).collect();
    let choice: Vec<f64> = (0..row.len())
        .map(|e| scores[e] + bias.map_or(0.0, |b| b[e]))
        .collect();
    let size = s.experts / s.groups;
    let group_scores: Vec<f64> = choice
        .chunks(size)
        .map(|g| {
            let r = ranked(g);
            g[r[0]] + g[r[1]]
        })
        .collect();
    let kept = &ranked(&group_scores)[..s.topk_groups];
    let masked: Vec<f64> = (0..row.len())
        .map(|e| {
            if s.groups == 1 || kept.contains(&(e / size)) {
                choice[e]
            } else {
                f64::NEG_INFINITY
            }
        })
        .collect();
    let chosen = &ranked(&masked)[..s.k];
    let sum: f64 = chosen.iter().map(|&e| scores[e]).sum::<f64>() + 1e-20;
    let w = chosen
        .iter()
        .map(|&e| {
            s.scale
                * if s.renormalize {
                    scores[e] / sum
                } else {
                    scores[e]
                }
        })
        .collect();
    (w, chosen.iter().map(|&e| e as i64).collect())
}

/// f64 reference gradient of one row's logits, the selection held fixed.
fn reference_backward(row: &[f64], idx: &[i64], g: &[f64], s: &GroupedRouting) -> Vec<f64> {
    let sel: Vec<f64> = idx.iter().map(|&e| sigmoid(row[e as usize])).collect();
    let d = sel.iter().sum::<f64>() + 1e-20;
    let dot: f64 = g.iter().zip(&sel).map(|(a, b)| a * b).sum();
    let mut out = vec![0.0; row.len()];
    for ((&e, &gj), &sj) in idx.iter().zip(g).zip(&sel) {
        let ds = if s.renormalize {
            s.scale * (gj / d - dot / (d * d))
        } else {
            s.scale * gj
        };
        out[e as usize] += ds * sj * (1.0 - sj);
    }
    out
}

fn grid<T: Approx>(rng: &mut Rng, n: usize, scale: f64, step: f64) -> Vec<T> {
    (0..n)
        .map(|_| T::from_f64((rng.normal(scale) / step).round() * step))
        .collect()
}

fn check<T: TestFloat>(par: &dyn Parallel)
where
    T::Acc: RoutingMath,
{
    let mut rng = Rng::new(11);
    for (rows, experts, k, groups, topk_groups) in SHAPES {
        for (with_bias, renormalize, scale) in [
            (false, false, 1.0),
            (true, true, 1.0),
            (true, false, 2.5),
            (false, true, 2.5),
        ] {
            let shape = GroupedRouting {
                rows,
                experts,
                k,
                groups,
                topk_groups,
                renormalize,
                scale,
            };
            let ctx = format!("{} {shape:?} bias {with_bias}", T::NAME);
            let logits: Vec<T> = grid(&mut rng, rows * experts, 2.0, 1.0 / 16.0);
            let bias: Option<Vec<T::Acc>> =
                with_bias.then(|| grid(&mut rng, experts, 0.5, 1.0 / 8.0));
            let mut w: Vec<T::Acc> = poisoned(rows * k);
            let mut idx = vec![-1i64; rows * k];
            forward(shape, &logits, bias.as_deref(), &mut w, &mut idx, par);
            let x = to_f64(&logits);
            let b = bias.as_deref().map(to_f64);
            let (mut want_w, mut want_idx) = (Vec::new(), Vec::new());
            for r in 0..rows {
                let row = &x[r * experts..(r + 1) * experts];
                let (wr, ir) = reference_forward(row, b.as_deref(), &shape);
                want_w.extend(wr);
                want_idx.extend(ir);
            }
            assert_eq!(idx, want_idx, "indices ({ctx})");
            assert_close(
                &to_f64(&w),
                &want_w,
                <T::Acc as Approx>::TOL * 4.0,
                "weights",
                &ctx,
            );

            let g: Vec<T::Acc> = random(&mut rng, rows * k, 1.0);
            let mut dl: Vec<T> = poisoned(rows * experts);
            backward(shape, &g, &logits, &idx, &mut dl, par);
            let gf = to_f64(&g);
            let mut want = Vec::new();
            for r in 0..rows {
                let row = &x[r * experts..(r + 1) * experts];
                let (ir, gr) = (&idx[r * k..(r + 1) * k], &gf[r * k..(r + 1) * k]);
                want.extend(reference_backward(row, ir, gr, &shape));
            }
            // Cancelling terms: measured against the gradient's scale, ||g|| / 4 (the largest
            // derivative of the sigmoid).
            let norm = gf.iter().map(|v| v * v).sum::<f64>().sqrt() * scale * 1e-3;
            assert_close_scaled(
                &to_f64(&dl),
                &want,
                norm,
                T::TOL.max(1e-6) * 4.0,
                "grad",
                &ctx,
            );
        }
    }
}

#[test]
fn routing_matches_the_f64_reference_for_every_dtype() {
    for par in [&Serial as &dyn Parallel, &Threads(3), &ReverseChunks] {
        check::<f32>(par);
        check::<f64>(par);
        check::<bf16>(par);
        check::<f16>(par);
    }
}

#[test]
fn the_group_limit_keeps_experts_of_the_best_groups_only() {
    // Groups of 2: {0,1} scores 0.9+0.1, {2,3} 0.8+0.7 (kept), {4,5} 0.6+0.6 (kept).
    let scores = [0.9f64, 0.1, 0.8, 0.7, 0.6, 0.6];
    let logits: Vec<f32> = scores.iter().map(|p| (p / (1.0 - p)).ln() as f32).collect();
    let shape = GroupedRouting {
        rows: 1,
        experts: 6,
        k: 3,
        groups: 3,
        topk_groups: 2,
        renormalize: false,
        scale: 1.0,
    };
    let (mut w, mut idx) = (vec![0.0f32; 3], vec![0i64; 3]);
    forward(shape, &logits, None, &mut w, &mut idx, &Serial);
    // Expert 0 has the largest score but its group is out; 4 and 5 tie: the lower first.
    assert_eq!(idx, [2, 3, 4]);
    for (got, want) in w.iter().zip([0.8f32, 0.7, 0.6]) {
        assert!((got - want).abs() < 1e-6, "{w:?}");
    }
}

#[test]
fn the_bias_steers_the_choice_but_not_the_weights() {
    let logits = [0.0f32, 1.0, -1.0, 0.5];
    let bias = [0.0f32, 0.0, 2.0, 0.0];
    let shape = GroupedRouting {
        rows: 1,
        experts: 4,
        k: 2,
        groups: 1,
        topk_groups: 1,
        renormalize: false,
        scale: 1.0,
    };
    let (mut w, mut idx) = (vec![0.0f32; 2], vec![0i64; 2]);
    forward(shape, &logits, Some(&bias), &mut w, &mut idx, &Serial);
    assert_eq!(idx, [2, 1]);
    assert!((w[0] as f64 - sigmoid(-1.0)).abs() < 1e-6);
    assert!((w[1] as f64 - sigmoid(1.0)).abs() < 1e-6);
}

#[test]
fn a_nan_logit_is_chosen_first_and_its_weight_is_nan() {
    let logits = [0.5f32, f32::NAN, 1.0, -2.0];
    let shape = GroupedRouting {
        rows: 1,
        experts: 4,
        k: 2,
        groups: 1,
        topk_groups: 1,
        renormalize: true,
        scale: 1.0,
    };
    let (mut w, mut idx) = (vec![0.0f32; 2], vec![0i64; 2]);
    forward(shape, &logits, None, &mut w, &mut idx, &Serial);
    assert_eq!(idx, [1, 2]);
    assert!(w.iter().all(|v| v.is_nan()));
}

#[test]
fn indices_outside_the_row_get_no_gradient() {
    let logits = [0.3f32, -0.2, 0.9];
    let shape = GroupedRouting {
        rows: 1,
        experts: 3,
        k: 2,
        groups: 1,
        topk_groups: 1,
        renormalize: false,
        scale: 1.0,
    };
    let mut dl = vec![f32::NAN; 3];
    backward(shape, &[1.0, 1.0], &logits, &[2, 3], &mut dl, &Serial);
    let s = sigmoid(0.9f32 as f64);
    assert_eq!(dl[..2], [0.0, 0.0]);
    assert!((dl[2] as f64 - s * (1.0 - s)).abs() < 1e-6);
}

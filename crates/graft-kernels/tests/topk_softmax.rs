//! MoE routing (softmax, top-k, renormalize) forward and backward against f64 references, for
//! every dtype, with and without renormalization, over expert counts and k that leave ties,
//! k = experts, and on parallel schedules that split the rows.

mod common;

use common::*;
use graft_kernels::ops::topk_softmax::{backward, forward, Routing, RoutingMath};
use graft_kernels::{Parallel, Serial, Threads};
use half::{bf16, f16};

/// (rows, experts, k).
const SHAPES: [(usize, usize, usize); 6] = [
    (1, 1, 1),
    (7, 8, 2),
    (33, 64, 8),
    (5, 60, 4),
    (3, 16, 16),
    (300, 128, 8),
];

fn softmax(row: &[f64]) -> Vec<f64> {
    let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = row.iter().map(|x| (x - max).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

/// f64 reference: (weights, indices) of one row, by sorting every expert.
fn reference_forward(row: &[f64], k: usize, renormalize: bool) -> (Vec<f64>, Vec<i64>) {
    let p = softmax(row);
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap().then(a.cmp(&b)));
    let chosen = &order[..k];
    let sum: f64 = chosen.iter().map(|&e| p[e]).sum();
    let w = chosen
        .iter()
        .map(|&e| if renormalize { p[e] / sum } else { p[e] })
        .collect();
    (w, chosen.iter().map(|&e| e as i64).collect())
}

/// f64 reference gradient of the logits: the Jacobian of the reference forward, applied to `g`
/// (the selection held fixed, as autograd sees it).
fn reference_backward(row: &[f64], idx: &[i64], g: &[f64], renormalize: bool) -> Vec<f64> {
    let p = softmax(row);
    let n = row.len();
    let sum: f64 = idx.iter().map(|&e| p[e as usize]).sum();
    // dL/dp for every expert, then through the softmax.
    let mut dp = vec![0.0; n];
    for (j, &e) in idx.iter().enumerate() {
        if renormalize {
            let dot: f64 = idx
                .iter()
                .zip(g)
                .map(|(&i, &gi)| gi * p[i as usize])
                .sum::<f64>();
            dp[e as usize] = g[j] / sum - dot / (sum * sum);
        } else {
            dp[e as usize] = g[j];
        }
    }
    let dot: f64 = dp.iter().zip(&p).map(|(a, b)| a * b).sum();
    p.iter().zip(&dp).map(|(pe, d)| pe * (d - dot)).collect()
}

fn check<T: TestFloat>(par: &dyn Parallel)
where
    T::Acc: RoutingMath,
{
    let mut rng = Rng::new(7);
    for (rows, experts, k) in SHAPES {
        for renormalize in [false, true] {
            let ctx = format!(
                "{} rows {rows} experts {experts} k {k} renorm {renormalize}",
                T::NAME
            );
            let logits: Vec<T> = random(&mut rng, rows * experts, 2.0);
            let shape = Routing {
                rows,
                experts,
                k,
                renormalize,
            };
            let mut w: Vec<T::Acc> = poisoned(rows * k);
            let mut idx = vec![-1i64; rows * k];
            forward(shape, &logits, &mut w, &mut idx, par);
            let x = to_f64(&logits);
            let (mut want_w, mut want_idx) = (Vec::new(), Vec::new());
            for r in 0..rows {
                let (wr, ir) =
                    reference_forward(&x[r * experts..(r + 1) * experts], k, renormalize);
                want_w.extend(wr);
                want_idx.extend(ir);
            }
            assert_eq!(idx, want_idx, "indices ({ctx})");
            assert_close(
                &to_f64(&w),
                &want_w,
                <T::Acc as Approx>::TOL,
                "weights",
                &ctx,
            );

            let g: Vec<T::Acc> = random(&mut rng, rows * k, 1.0);
            let mut dl: Vec<T> = poisoned(rows * experts);
            backward(shape, &g, &logits, &w, &idx, &mut dl, par);
            let gf = to_f64(&g);
            let mut want = Vec::new();
            for r in 0..rows {
                let row = &x[r * experts..(r + 1) * experts];
                want.extend(reference_backward(
                    row,
                    &idx[r * k..(r + 1) * k],
                    &gf[r * k..(r + 1) * k],
                    renormalize,
                ));
            }
            // Cancelling terms: measured against the gradient's scale, ||g||.
            let scale = gf.iter().map(|v| v * v).sum::<f64>().sqrt() * 1e-3;
            assert_close_scaled(
                &to_f64(&dl),
                &want,
                scale,
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
fn ties_go_to_the_lower_index_and_k_equal_to_experts_keeps_every_expert() {
    let logits = [0.5f32, 1.0, 1.0, 0.5];
    let shape = Routing {
        rows: 1,
        experts: 4,
        k: 4,
        renormalize: true,
    };
    let (mut w, mut idx) = (vec![0.0f32; 4], vec![0i64; 4]);
    forward(shape, &logits, &mut w, &mut idx, &Serial);
    assert_eq!(idx, [1, 2, 0, 3]);
    assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
}

#[test]
fn a_nan_logit_makes_the_row_nan() {
    let logits = [0.5f32, f32::NAN, 1.0];
    let shape = Routing {
        rows: 1,
        experts: 3,
        k: 2,
        renormalize: false,
    };
    let (mut w, mut idx) = (vec![0.0f32; 2], vec![0i64; 2]);
    forward(shape, &logits, &mut w, &mut idx, &Serial);
    assert!(w.iter().all(|v| v.is_nan()));
}

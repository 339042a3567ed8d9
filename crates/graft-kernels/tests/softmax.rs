//! Softmax and log-softmax, forward and backward, against f64 references for every dtype,
//! available ISA, layout (rows and columns) and special value.

mod common;

use common::*;
use graft_kernels::ops::softmax::{self, Kind, Shape};
use graft_kernels::{with_isa, Isa, Parallel, Serial, Threads};
use half::{bf16, f16};

/// (outer, dim, inner): rows of many widths (around the 256-element blocks and the 16 lanes),
/// and reductions over a middle or first dim (columns, around the 64-column tiles).
const SHAPES: [(usize, usize, usize); 17] = [
    (1, 1, 1),
    (3, 1, 1),
    (5, 2, 1),
    (4, 15, 1),
    (3, 17, 1),
    (2, 255, 1),
    (3, 256, 1),
    (2, 257, 1),
    (2, 1000, 1),
    (1, 4099, 1),
    (64, 100, 1),
    (2, 3, 5),
    (1, 7, 64),
    (3, 5, 65),
    (2, 300, 129),
    (1, 1, 7),
    (4, 33, 2),
];

fn parallels() -> [(&'static str, &'static dyn Parallel); 4] {
    [
        ("Serial", &Serial),
        ("Threads(2)", &Threads(2)),
        ("Threads(3)", &Threads(3)),
        ("ReverseChunks", &ReverseChunks),
    ]
}

fn for_each_isa(f: impl Fn(Isa)) {
    for isa in Isa::available() {
        with_isa(isa, || f(isa));
    }
}

/// The reference forward in f64, two passes as ATen's kernels compute it.
fn ref_forward(kind: Kind, x: &[f64], s: Shape) -> Vec<f64> {
    let mut y = vec![0.0; x.len()];
    for o in 0..s.outer {
        for j in 0..s.inner {
            let at = |d: usize| (o * s.dim + d) * s.inner + j;
            let m = (0..s.dim)
                .map(|d| x[at(d)])
                .fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = (0..s.dim).map(|d| (x[at(d)] - m).exp()).sum();
            for d in 0..s.dim {
                y[at(d)] = match kind {
                    Kind::Softmax => (x[at(d)] - m).exp() / sum,
                    Kind::LogSoftmax => x[at(d)] - m - sum.ln(),
                };
            }
        }
    }
    y
}

fn ref_backward(kind: Kind, dy: &[f64], y: &[f64], s: Shape) -> Vec<f64> {
    let mut dx = vec![0.0; dy.len()];
    for o in 0..s.outer {
        for j in 0..s.inner {
            let at = |d: usize| (o * s.dim + d) * s.inner + j;
            let total: f64 = (0..s.dim)
                .map(|d| match kind {
                    Kind::Softmax => dy[at(d)] * y[at(d)],
                    Kind::LogSoftmax => dy[at(d)],
                })
                .sum();
            for d in 0..s.dim {
                dx[at(d)] = match kind {
                    Kind::Softmax => y[at(d)] * (dy[at(d)] - total),
                    Kind::LogSoftmax => dy[at(d)] - y[at(d)].exp() * total,
                };
            }
        }
    }
    dx
}

fn shape((outer, dim, inner): (usize, usize, usize)) -> Shape {
    Shape { outer, dim, inner }
}

fn check<T: TestFloat + softmax::SoftmaxFloat>() {
    for_each_isa(|isa| {
        for (case, &dims) in SHAPES.iter().enumerate() {
            for kind in [Kind::Softmax, Kind::LogSoftmax] {
                let s = shape(dims);
                let n = s.outer * s.dim * s.inner;
                let seed = 100 * case as u64 + kind as u64;
                let mut rng = Rng::new(seed);
                let (par_name, par) = parallels()[case % 4];
                let ctx = format!("{} {isa:?} {kind:?} {s:?} {par_name} seed={seed}", T::NAME);
                let x = random::<T>(&mut rng, n, 3.0);
                let mut y = poisoned::<T>(n);
                softmax::forward(kind, &x, &mut y, s, par);
                let want = ref_forward(kind, &to_f64(&x), s);
                assert_close(&to_f64(&y), &want, T::TOL, "y", &ctx);

                let dy = random::<T>(&mut rng, n, 1.0);
                let mut dx = poisoned::<T>(n);
                softmax::backward(kind, &dy, &y, &mut dx, s, par);
                let want = ref_backward(kind, &to_f64(&dy), &to_f64(&y), s);
                // dx is a difference of terms of the size of dy (times y for softmax).
                let scale = to_f64(&dy).iter().map(|v| v * v).sum::<f64>().sqrt();
                assert_close_scaled(&to_f64(&dx), &want, scale, 4.0 * T::TOL, "dx", &ctx);
            }
        }
    });
}

#[test]
fn f32_matches_the_reference() {
    check::<f32>();
}

#[test]
fn f64_matches_the_reference() {
    check::<f64>();
}

#[test]
fn bf16_matches_the_reference() {
    check::<bf16>();
}

#[test]
fn f16_matches_the_reference() {
    check::<f16>();
}

/// Rows of special values: NaN or +inf anywhere, or only -inf, make the whole row NaN (as
/// ATen's max-then-sum computes it); -inf among finite values gives 0 / -inf.
#[test]
fn special_values_follow_aten() {
    let inf = f32::INFINITY;
    let cases: [(&[f32], &str); 6] = [
        (&[1.0, f32::NAN, 2.0], "nan"),
        (&[1.0, inf, 2.0], "+inf"),
        (&[-inf, -inf, -inf], "all -inf"),
        (&[-inf, 0.5, -inf, 1.5], "some -inf"),
        (&[-inf; 300], "all -inf, wider than a block"),
        (&[inf, inf], "two +inf"),
    ];
    for_each_isa(|isa| {
        for (row, name) in cases {
            // Long rows: the special value in a later block than the maximum, too.
            let mut wide = vec![-3.0f32; 600];
            wide[..row.len()].copy_from_slice(row);
            for x in [row.to_vec(), wide] {
                for kind in [Kind::Softmax, Kind::LogSoftmax] {
                    for inner in [1, 3] {
                        // The same row along a dim of stride `inner` (columns) too.
                        let xs: Vec<f32> = x.iter().flat_map(|&v| vec![v; inner]).collect();
                        let s = Shape {
                            outer: 1,
                            dim: x.len(),
                            inner,
                        };
                        let mut y = vec![7.0f32; xs.len()];
                        softmax::forward(kind, &xs, &mut y, s, &Serial);
                        let want = ref_forward(kind, &to_f64(&xs), s);
                        let ctx = format!("{isa:?} {kind:?} {name} len={} inner={inner}", x.len());
                        for (i, (&g, &w)) in y.iter().zip(&want).enumerate() {
                            if w.is_nan() {
                                assert!(g.is_nan(), "y[{i}] = {g}, expected NaN ({ctx})");
                            } else if w.is_infinite() || w == 0.0 {
                                assert_eq!(g as f64, w, "y[{i}] ({ctx})");
                            } else {
                                let err = ((g as f64) - w).abs();
                                assert!(
                                    err <= 1e-5 * w.abs().max(1.0),
                                    "y[{i}] = {g}, expected {w} ({ctx})"
                                );
                            }
                        }
                    }
                }
            }
        }
    });
}

#[test]
fn width_one_is_exact() {
    let x = [3.5f32, -1e30, 0.0, 88.0];
    let mut y = [9.0f32; 4];
    let s = Shape {
        outer: 4,
        dim: 1,
        inner: 1,
    };
    softmax::forward(Kind::Softmax, &x, &mut y, s, &Serial);
    assert_eq!(y, [1.0; 4]);
    softmax::forward(Kind::LogSoftmax, &x, &mut y, s, &Serial);
    assert_eq!(y, [0.0; 4]);
}

#[test]
fn results_do_not_depend_on_the_parallel_for() {
    let s = Shape {
        outer: 7,
        dim: 333,
        inner: 70,
    };
    let n = s.outer * s.dim * s.inner;
    let mut rng = Rng::new(5);
    let x = random::<f32>(&mut rng, n, 2.0);
    let mut first = vec![0.0f32; n];
    softmax::forward(Kind::Softmax, &x, &mut first, s, &Serial);
    for (_, par) in parallels() {
        let mut y = vec![0.0f32; n];
        softmax::forward(Kind::Softmax, &x, &mut y, s, par);
        assert_eq!(y, first);
    }
}

#[test]
fn empty_shapes_do_nothing() {
    for (outer, dim, inner) in [(0, 5, 1), (3, 0, 1), (2, 4, 0)] {
        let s = Shape { outer, dim, inner };
        let mut y: Vec<f32> = vec![];
        softmax::forward(Kind::Softmax, &[], &mut y, s, &Serial);
        let mut dx: Vec<f32> = vec![];
        softmax::backward(Kind::LogSoftmax, &[], &[], &mut dx, s, &Serial);
    }
}

//! LayerNorm forward and backward against f64 references, for every dtype, available ISA,
//! parameter combination and gradient mask.

mod common;

use common::*;
use graft_kernels::ops::layer_norm::{self, Affine, ForwardOut, Grads, NormFloat, Stats};
use graft_kernels::{with_isa, Isa, Parallel, Serial, Threads};
use half::{bf16, f16};

const COLS: [usize; 9] = [1, 3, 16, 17, 100, 256, 1000, 4097, 20000];
const ROWS: [usize; 4] = [1, 5, 64, 300];

fn parallels() -> [(&'static str, &'static dyn Parallel); 4] {
    [
        ("Serial", &Serial),
        ("Threads(2)", &Threads(2)),
        ("Threads(3)", &Threads(3)),
        ("ReverseChunks", &ReverseChunks),
    ]
}

/// (y, mean, rstd) in f64.
fn reference(
    x: &[f64],
    cols: usize,
    w: Option<&[f64]>,
    b: Option<&[f64]>,
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut y, mut mean, mut rstd) = (vec![], vec![], vec![]);
    for row in x.chunks(cols) {
        let m = row.iter().sum::<f64>() / cols as f64;
        let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / cols as f64;
        let r = 1.0 / (var + eps).sqrt();
        for (c, v) in row.iter().enumerate() {
            y.push((v - m) * r * w.map_or(1.0, |w| w[c]) + b.map_or(0.0, |b| b[c]));
        }
        mean.push(m);
        rstd.push(r);
    }
    (y, mean, rstd)
}

/// (dx, dw, db) in f64.
fn reference_backward(
    dy: &[f64],
    x: &[f64],
    (mean, rstd): (&[f64], &[f64]),
    cols: usize,
    w: Option<&[f64]>,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut dx, mut dw, mut db) = (vec![], vec![0.0; cols], vec![0.0; cols]);
    for (i, (g, x)) in dy.chunks(cols).zip(x.chunks(cols)).enumerate() {
        let xhat: Vec<f64> = x.iter().map(|v| (v - mean[i]) * rstd[i]).collect();
        let gw: Vec<f64> = (0..cols).map(|c| g[c] * w.map_or(1.0, |w| w[c])).collect();
        let mg = gw.iter().sum::<f64>() / cols as f64;
        let mgx = (0..cols).map(|c| gw[c] * xhat[c]).sum::<f64>() / cols as f64;
        for c in 0..cols {
            dx.push(rstd[i] * (gw[c] - mg - xhat[c] * mgx));
            dw[c] += g[c] * xhat[c];
            db[c] += g[c];
        }
    }
    (dx, dw, db)
}

fn check<T: TestFloat + NormFloat>() {
    for isa in Isa::available() {
        with_isa(isa, || {
            let mut case = 0;
            for cols in COLS {
                for rows in ROWS {
                    if rows * cols > 400_000 {
                        continue;
                    }
                    case += 1;
                    let (par_name, par) = parallels()[case % 4];
                    let with_w = case % 3 != 0;
                    let with_b = case % 2 == 0;
                    let ctx = format!(
                        "{} {isa:?} rows={rows} cols={cols} w={with_w} b={with_b} {par_name}",
                        T::NAME
                    );
                    let mut rng = Rng::new(case as u64);
                    // An offset so that the mean matters (variance computed around it).
                    let x: Vec<T> = (0..rows * cols)
                        .map(|_| T::from_f64(3.0 + rng.normal(1.5)))
                        .collect();
                    let w: Vec<T::Acc> = (0..cols)
                        .map(|_| <T::Acc as Approx>::from_f64(1.0 + rng.normal(0.3)))
                        .collect();
                    let b: Vec<T::Acc> = (0..cols)
                        .map(|_| <T::Acc as Approx>::from_f64(rng.normal(0.5)))
                        .collect();
                    let affine = Affine {
                        weight: with_w.then_some(&w[..]),
                        bias: with_b.then_some(&b[..]),
                    };
                    let mut y = poisoned::<T>(rows * cols);
                    let mut mean = poisoned::<T::Acc>(rows);
                    let mut rstd = poisoned::<T::Acc>(rows);
                    let eps = <T::Acc as Approx>::from_f64(1e-5);
                    let out = ForwardOut {
                        y: &mut y,
                        mean: &mut mean,
                        rstd: &mut rstd,
                    };
                    layer_norm::forward(&x, (rows, cols), affine, eps, out, par);
                    let (wf, bf) = (to_f64(&w), to_f64(&b));
                    let (wr, br) = (with_w.then_some(&wf[..]), with_b.then_some(&bf[..]));
                    let (y_ref, m_ref, r_ref) = reference(&to_f64(&x), cols, wr, br, 1e-5);
                    assert_close(&to_f64(&y), &y_ref, T::TOL, "y", &ctx);
                    assert_close(&to_f64(&mean), &m_ref, 1e-6, "mean", &ctx);
                    assert_close(&to_f64(&rstd), &r_ref, 1e-5, "rstd", &ctx);

                    let dy: Vec<T> = (0..rows * cols)
                        .map(|_| T::from_f64(rng.normal(1.0)))
                        .collect();
                    for mask in [
                        (true, true, true),
                        (true, false, false),
                        (false, true, true),
                    ] {
                        let mut dx = poisoned::<T>(rows * cols);
                        let mut dw = poisoned::<T::Acc>(cols);
                        let mut db = poisoned::<T::Acc>(cols);
                        let grads = Grads {
                            dx: mask.0.then_some(&mut dx[..]),
                            dw: mask.1.then_some(&mut dw[..]),
                            db: mask.2.then_some(&mut db[..]),
                        };
                        let stats = Stats {
                            mean: &mean,
                            rstd: &rstd,
                        };
                        layer_norm::backward(
                            (&dy, &x),
                            (rows, cols),
                            stats,
                            affine.weight,
                            grads,
                            par,
                        );
                        let (mf, rf) = (to_f64(&mean), to_f64(&rstd));
                        let (dx_ref, dw_ref, db_ref) =
                            reference_backward(&to_f64(&dy), &to_f64(&x), (&mf, &rf), cols, wr);
                        let ctx = format!("{ctx} mask={mask:?}");
                        if mask.0 {
                            let scale = to_f64(&dy).iter().map(|v| v * v).sum::<f64>().sqrt();
                            let tol = 4.0 * T::TOL;
                            assert_close_scaled(&to_f64(&dx), &dx_ref, scale, tol, "dx", &ctx);
                        }
                        if mask.1 {
                            assert_close(&to_f64(&dw), &dw_ref, 1e-5, "dw", &ctx);
                            assert_close(&to_f64(&db), &db_ref, 1e-5, "db", &ctx);
                        }
                    }
                }
            }
        });
    }
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

#[test]
fn weight_gradients_do_not_depend_on_the_parallel_for() {
    let (rows, cols) = (500, 300);
    let mut rng = Rng::new(9);
    let x = random::<f32>(&mut rng, rows * cols, 2.0);
    let dy = random::<f32>(&mut rng, rows * cols, 1.0);
    let mut mean = vec![0.0f32; rows];
    let mut rstd = vec![0.0f32; rows];
    let mut y = vec![0.0f32; rows * cols];
    let out = ForwardOut {
        y: &mut y,
        mean: &mut mean,
        rstd: &mut rstd,
    };
    layer_norm::forward(&x, (rows, cols), Affine::default(), 1e-5, out, &Serial);
    let mut first: Option<(Vec<f32>, Vec<f32>)> = None;
    for (_, par) in parallels() {
        let (mut dw, mut db) = (vec![0.0f32; cols], vec![0.0f32; cols]);
        let grads = Grads {
            dx: None,
            dw: Some(&mut dw),
            db: Some(&mut db),
        };
        let stats = Stats {
            mean: &mean,
            rstd: &rstd,
        };
        layer_norm::backward((&dy, &x), (rows, cols), stats, None, grads, par);
        match &first {
            None => first = Some((dw, db)),
            Some((w0, b0)) => assert!(w0 == &dw && b0 == &db),
        }
    }
}

#[test]
fn empty_rows_and_columns() {
    let (mut mean, mut rstd) = (vec![7.0f32; 3], vec![7.0f32; 3]);
    let out = ForwardOut {
        y: &mut [],
        mean: &mut mean,
        rstd: &mut rstd,
    };
    layer_norm::forward::<f32>(&[], (3, 0), Affine::default(), 1e-5, out, &Serial);
    assert_eq!(mean, [0.0; 3]);
    assert!(rstd.iter().all(|r| r.is_nan()));
    let (mut dw, mut db) = (vec![7.0f32; 4], vec![7.0f32; 4]);
    let grads = Grads {
        dx: None,
        dw: Some(&mut dw),
        db: Some(&mut db),
    };
    let stats = Stats {
        mean: &[],
        rstd: &[],
    };
    layer_norm::backward::<f32>((&[], &[]), (0, 4), stats, None, grads, &Serial);
    assert_eq!((dw, db), (vec![0.0; 4], vec![0.0; 4]));
}

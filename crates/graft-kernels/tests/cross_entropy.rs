//! Cross-entropy rows against a float64 reference, for every element type, every available ISA,
//! odd row lengths, ignored rows, label smoothing, per-row scales, in place and not.

mod common;

use common::{
    assert_close, assert_close_scaled, poisoned, random, to_f64, ReverseChunks, Rng, TestFloat,
};
use graft_kernels::ops::cross_entropy::{self as ce, BadTarget, CeMath, Options, Scale};
use graft_kernels::{with_isa, Isa, Serial, Threads};
use half::{bf16, f16};

const IGNORE: i64 = -100;

/// Reference per-row loss and gradient (before the scale) in f64.
fn reference(x: &[f64], target: &[i64], o: &Options) -> (Vec<f64>, Vec<f64>) {
    let cols = o.cols;
    let eps = o.smoothing;
    let mut loss = vec![0.0; target.len()];
    let mut grad = vec![0.0; x.len()];
    for (r, &t) in target.iter().enumerate() {
        if t == o.ignore_index {
            continue;
        }
        let row = &x[r * cols..(r + 1) * cols];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        let logp: Vec<f64> = row.iter().map(|v| v - lse).collect();
        let t = t as usize;
        loss[r] = -(1.0 - eps) * logp[t] - eps / cols as f64 * logp.iter().sum::<f64>();
        for c in 0..cols {
            let onehot = if c == t { 1.0 - eps } else { 0.0 };
            grad[r * cols + c] = logp[c].exp() - onehot - eps / cols as f64;
        }
    }
    (loss, grad)
}

fn targets(rng: &mut Rng, rows: usize, cols: usize, ignore_every: usize) -> Vec<i64> {
    (0..rows)
        .map(|r| {
            if ignore_every > 0 && r % ignore_every == 1 {
                IGNORE
            } else {
                (rng.next_u64() % cols as u64) as i64
            }
        })
        .collect()
}

fn scaled(g: &[f64], cols: usize, all: f64, rows: Option<&[f64]>) -> Vec<f64> {
    g.iter()
        .enumerate()
        .map(|(i, v)| v * all * rows.map_or(1.0, |r| r[i / cols]))
        .collect()
}

fn check_type<T: TestFloat>()
where
    T::Acc: CeMath,
{
    let mut rng = Rng::new(7);
    for isa in Isa::available() {
        for &(rows, cols) in &[(1, 1), (3, 2), (5, 17), (9, 33), (4, 1000), (3, 4099)] {
            for &eps in &[0.0, 0.1] {
                let x: Vec<T> = random(&mut rng, rows * cols, 3.0);
                let target = targets(&mut rng, rows, cols, 3);
                let o = Options {
                    cols,
                    ignore_index: IGNORE,
                    smoothing: eps,
                };
                let x64 = to_f64(&x);
                let (want_loss, want_grad) = reference(&x64, &target, &o);
                let row_scale: Vec<T::Acc> = (0..rows)
                    .map(|_| <T::Acc as common::Approx>::from_f64(rng.normal(1.0)))
                    .collect();
                let rs64 = to_f64(&row_scale);
                let all = 0.25;
                let want_g = scaled(&want_grad, cols, all, Some(&rs64));
                let ctx = format!("{} {isa:?} {rows}x{cols} eps {eps}", T::NAME);
                // Loss tolerance: the accumulation type's, relative to the loss; grads: T's.
                let ltol = <T::Acc as common::Approx>::TOL * 20.0;
                with_isa(isa, || {
                    let scale = Scale {
                        all: <T::Acc as CeMath>::from_f64(all),
                        rows: Some(&row_scale[..]),
                    };
                    // Separate gradient buffer.
                    let mut loss = poisoned::<T::Acc>(rows);
                    let mut grad = poisoned::<T>(rows * cols);
                    ce::forward(
                        &x,
                        &target,
                        &o,
                        &mut loss,
                        Some((&mut grad, scale)),
                        &Serial,
                    );
                    // Errors are measured against the size of the terms (a row's loss and its
                    // gradient can cancel to zero, e.g. one class with smoothing).
                    let lscale = (rows as f64).sqrt();
                    let gscale = rs64.iter().map(|s| (s * all).powi(2)).sum::<f64>().sqrt();
                    let (l64, g64) = (to_f64(&loss), to_f64(&grad));
                    assert_close_scaled(&l64, &want_loss, lscale, ltol, "loss", &ctx);
                    assert_close_scaled(&g64, &want_g, gscale, 2.0 * T::TOL, "grad", &ctx);
                    // In place, with threads: the same bits.
                    let mut inplace = x.clone();
                    let mut loss2 = poisoned::<T::Acc>(rows);
                    ce::forward_in_place(&mut inplace, &target, &o, &mut loss2, scale, &Threads(3));
                    assert_eq!(to_f64(&loss2), to_f64(&loss), "in-place loss ({ctx})");
                    assert_eq!(to_f64(&inplace), to_f64(&grad), "in-place grad ({ctx})");
                    // Loss only.
                    let mut loss3 = poisoned::<T::Acc>(rows);
                    ce::forward(&x, &target, &o, &mut loss3, None, &ReverseChunks);
                    assert_eq!(to_f64(&loss3), to_f64(&loss), "loss only ({ctx})");
                });
            }
        }
    }
}

#[test]
fn rows_match_float64_f32() {
    check_type::<f32>();
}

#[test]
fn rows_match_float64_f64() {
    check_type::<f64>();
}

#[test]
fn rows_match_float64_bf16() {
    check_type::<bf16>();
}

#[test]
fn rows_match_float64_f16() {
    check_type::<f16>();
}

#[test]
fn large_rows_in_every_isa() {
    // A vocabulary-sized row with large logits: the exponential's range reduction at work.
    let mut rng = Rng::new(3);
    let (rows, cols) = (2, 50_257);
    let x: Vec<bf16> = random(&mut rng, rows * cols, 12.0);
    let target = vec![17, 50_256];
    let o = Options {
        cols,
        ignore_index: IGNORE,
        smoothing: 0.0,
    };
    let (want_loss, want_grad) = reference(&to_f64(&x), &target, &o);
    for isa in Isa::available() {
        with_isa(isa, || {
            let mut loss = poisoned::<f32>(rows);
            let mut grad = poisoned::<bf16>(rows * cols);
            let scale = Scale {
                all: 1.0,
                rows: None,
            };
            ce::forward(
                &x,
                &target,
                &o,
                &mut loss,
                Some((&mut grad, scale)),
                &Serial,
            );
            let ctx = format!("{isa:?}");
            assert_close(&to_f64(&loss), &want_loss, 1e-6, "loss", &ctx);
            assert_close(&to_f64(&grad), &want_grad, 1e-2, "grad", &ctx);
        });
    }
}

#[test]
fn exp_matches_std_over_its_domain() {
    let mut worst = 0.0f64;
    let mut x = -87.0f32;
    while x <= 0.0 {
        let got = x.exp_nonpos() as f64;
        let want = (x as f64).exp();
        worst = worst.max(((got - want) / want).abs());
        x += 0.000_731;
    }
    assert!(worst < 3e-7, "worst relative error {worst:e}");
    assert_eq!((-88.0f32).exp_nonpos(), 0.0);
    assert_eq!(f32::NEG_INFINITY.exp_nonpos(), 0.0);
    assert!(f32::NAN.exp_nonpos().is_nan());
    assert_eq!(0.0f32.exp_nonpos(), 1.0);
}

#[test]
fn nan_and_infinite_logits_give_nan_rows() {
    let cols = 20;
    let mut x: Vec<f32> = (0..2 * cols).map(|i| (i as f32 * 0.37).sin()).collect();
    x[3] = f32::NAN;
    x[cols + 5] = f32::INFINITY;
    let o = Options {
        cols,
        ignore_index: IGNORE,
        smoothing: 0.0,
    };
    let mut loss = [0.0f32; 2];
    let mut grad = vec![0.0f32; 2 * cols];
    let scale = Scale {
        all: 1.0,
        rows: None,
    };
    ce::forward(
        &x,
        &[1, 2],
        &o,
        &mut loss,
        Some((&mut grad, scale)),
        &Serial,
    );
    assert!(loss[0].is_nan() && loss[1].is_nan(), "{loss:?}");
    assert!(grad.iter().all(|g| g.is_nan()));
}

#[test]
fn count_valid_checks_targets() {
    assert_eq!(ce::count_valid(&[0, 4, IGNORE, 2], 5, IGNORE), Ok(3));
    assert_eq!(ce::count_valid(&[0, 5, 2], 5, IGNORE), Err(BadTarget(5)));
    assert_eq!(ce::count_valid(&[-1], 5, IGNORE), Err(BadTarget(-1)));
    assert_eq!(ce::count_valid(&[3, 3], 5, 3), Ok(0));
    assert_eq!(ce::count_valid(&[], 5, IGNORE), Ok(0));
}

#[test]
fn scaling_in_place_and_into() {
    let mut rng = Rng::new(11);
    let (rows, cols) = (7, 13);
    let g: Vec<bf16> = random(&mut rng, rows * cols, 1.0);
    let per_row: Vec<f32> = vec![1.0, 2.0, -0.5, 1.0, 3.0, 0.0, 1.0];
    let scale = Scale {
        all: 1.0,
        rows: Some(&per_row[..]),
    };
    let want = scaled(&to_f64(&g), cols, 1.0, Some(&to_f64(&per_row)));
    let mut dst = poisoned::<bf16>(rows * cols);
    ce::scale_into(&g, &mut dst, cols, scale, &Threads(2));
    assert_close(&to_f64(&dst), &want, 4e-3, "scale_into", "");
    let mut inplace = g.clone();
    ce::scale_in_place(&mut inplace, cols, scale, &Serial);
    assert_eq!(to_f64(&inplace), to_f64(&dst));
    // Rows with factor 1 are left as they were (bit for bit).
    assert_eq!(to_f64(&inplace[..cols]), to_f64(&g[..cols]));
}

#[test]
fn reduce_sums_and_means() {
    assert_eq!(ce::reduce(&[1.0f32, 2.0, 3.0], false, 3), 6.0);
    assert_eq!(ce::reduce(&[1.0f32, 2.0, 0.0], true, 2), 1.5);
    assert!(ce::reduce::<f32>(&[0.0, 0.0], true, 0).is_nan());
    assert!(ce::reduce::<f64>(&[], true, 0).is_nan());
    assert_eq!(ce::reduce::<f64>(&[], false, 0), 0.0);
}

#[test]
#[should_panic(expected = "logits length")]
fn mismatched_lengths_panic() {
    let o = Options {
        cols: 4,
        ignore_index: IGNORE,
        smoothing: 0.0,
    };
    let mut loss = [0.0f32; 2];
    ce::forward(&[0.0f32; 7], &[0, 1], &o, &mut loss, None, &Serial);
}

/// The vocabulary-blocked pair: [`ce::block_stats`] over consecutive blocks of every row, then
/// [`ce::block_grad`] per block, against the float64 reference of the whole rows.
fn check_blocks<T: TestFloat>()
where
    T::Acc: CeMath,
{
    let mut rng = Rng::new(11);
    for isa in Isa::available() {
        for &(rows, cols, block) in &[
            (1, 1, 1),
            (3, 7, 2),
            (5, 33, 8),
            (9, 130, 128),
            (4, 1000, 333),
        ] {
            let x: Vec<T> = random(&mut rng, rows * cols, 3.0);
            let target = targets(&mut rng, rows, cols, 3);
            let o = Options {
                cols,
                ignore_index: IGNORE,
                smoothing: 0.0,
            };
            let (want_loss, want_grad) = reference(&to_f64(&x), &target, &o);
            let row_scale: Vec<T::Acc> = (0..rows)
                .map(|_| <T::Acc as common::Approx>::from_f64(rng.normal(1.0)))
                .collect();
            let rs64 = to_f64(&row_scale);
            let all = 0.25;
            let want_g = scaled(&want_grad, cols, all, Some(&rs64));
            let ctx = format!("{} {isa:?} {rows}x{cols} blocks of {block}", T::NAME);
            with_isa(isa, || {
                let (mut max, mut sum) = (poisoned::<T::Acc>(rows), poisoned::<T::Acc>(rows));
                let mut tl = poisoned::<T::Acc>(rows);
                let mut loss = poisoned::<T::Acc>(rows);
                let starts: Vec<usize> = (0..cols).step_by(block).collect();
                // Each block's logits in their own (rows, len) buffer, as the op computes them.
                let blk = |s: usize| -> Vec<T> {
                    let len = block.min(cols - s);
                    (0..rows)
                        .flat_map(|r| x[r * cols + s..r * cols + s + len].iter().copied())
                        .collect()
                };
                for (k, &s) in starts.iter().enumerate() {
                    let b = ce::Block {
                        cols: block.min(cols - s),
                        first_col: s,
                        ignore_index: IGNORE,
                    };
                    let last = k + 1 == starts.len();
                    let stats = ce::BlockStats {
                        max: &mut max,
                        sum: &mut sum,
                        target_logit: &mut tl,
                        loss: if last { Some(&mut loss) } else { None },
                        first: k == 0,
                    };
                    ce::block_stats(&blk(s), &target, &b, stats, &Threads(3));
                }
                let ltol = <T::Acc as common::Approx>::TOL * 20.0;
                let lscale = (rows as f64).sqrt();
                assert_close_scaled(&to_f64(&loss), &want_loss, lscale, ltol, "loss", &ctx);
                let mut grad = poisoned::<T>(rows * cols);
                for &s in &starts {
                    let len = block.min(cols - s);
                    let b = ce::Block {
                        cols: len,
                        first_col: s,
                        ignore_index: IGNORE,
                    };
                    let mut g = blk(s);
                    let scale = Scale {
                        all: <T::Acc as CeMath>::from_f64(all),
                        rows: Some(&row_scale[..]),
                    };
                    ce::block_grad(&mut g, &target, &b, &max, scale, &ReverseChunks);
                    for r in 0..rows {
                        grad[r * cols + s..r * cols + s + len]
                            .copy_from_slice(&g[r * len..(r + 1) * len]);
                    }
                }
                let gscale = rs64.iter().map(|s| (s * all).powi(2)).sum::<f64>().sqrt();
                assert_close_scaled(&to_f64(&grad), &want_g, gscale, 2.0 * T::TOL, "grad", &ctx);
            });
        }
    }
}

#[test]
fn vocabulary_blocks_match_float64() {
    check_blocks::<f32>();
    check_blocks::<f64>();
    check_blocks::<bf16>();
    check_blocks::<f16>();
}

#[test]
fn vocabulary_blocks_keep_masked_and_nan_rows() {
    // Row 0: its whole first block is -inf (that block adds nothing); row 1: a NaN in a block
    // of -inf (the loss is NaN, as the whole-row kernel gives).
    let inf = f32::NEG_INFINITY;
    let x = [[inf, inf, 1.0, 2.0], [inf, f32::NAN, 0.5, 0.25]];
    let target = [3i64, 2];
    let (mut max, mut sum, mut tl, mut loss) = ([0f32; 2], [0f32; 2], [0f32; 2], [7f32; 2]);
    for (k, s) in [0usize, 2].into_iter().enumerate() {
        let blk: Vec<f32> = x.iter().flat_map(|r| r[s..s + 2].iter().copied()).collect();
        let b = ce::Block {
            cols: 2,
            first_col: s,
            ignore_index: IGNORE,
        };
        let stats = ce::BlockStats {
            max: &mut max,
            sum: &mut sum,
            target_logit: &mut tl,
            loss: if k == 1 { Some(&mut loss) } else { None },
            first: k == 0,
        };
        ce::block_stats(&blk, &target, &b, stats, &Serial);
    }
    let want = (1f64.exp() + 2f64.exp()).ln() - 2.0;
    assert!((f64::from(loss[0]) - want).abs() < 1e-6, "{loss:?}");
    assert!(loss[1].is_nan(), "{loss:?}");
}

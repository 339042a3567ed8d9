//! RMSNorm with a weight mode (`forward_with` / `backward_with`: the model variants of
//! torchgraft::rms_norm): the forward replayed bit for bit, the backward against f64, for every
//! dtype and available ISA.

mod common;

use common::*;
use graft_kernels::ops::rms_norm::{self, WeightMode};
use graft_kernels::{with_isa, Float, Isa, Serial, Threads};
use half::{bf16, f16};

/// Odd and even widths, a vector tail, a row longer than the forward's block.
const SHAPES: [(usize, usize); 5] = [(3, 1), (5, 7), (4, 33), (9, 1000), (2, 17000)];
const EPS: f64 = 1e-6;

/// Llama (rounding first), Gemma (offset 1, fp32), both, and a negative offset.
fn modes<A: Approx>() -> [WeightMode<A>; 4] {
    let mode = |offset: f64, round_first| WeightMode {
        offset: A::from_f64(offset),
        round_first,
    };
    [
        mode(0.0, true),
        mode(1.0, false),
        mode(1.0, true),
        mode(-0.5, false),
    ]
}

fn for_each_isa(f: impl Fn(Isa)) {
    for isa in Isa::available() {
        with_isa(isa, || f(isa));
    }
}

/// `xhat` rounded to `T` (or not), as the weight multiply sees it.
fn pre_weight<T: Float>(xhat: T::Acc, round_first: bool) -> T::Acc {
    if round_first {
        T::from_acc(xhat).to_acc()
    } else {
        xhat
    }
}

fn check_forward<T: TestFloat>() {
    for_each_isa(|isa| {
        for (case, &(rows, cols)) in SHAPES.iter().enumerate() {
            for mode in modes::<T::Acc>() {
                let mut rng = Rng::new(31 * case as u64 + 5);
                let ctx = format!("{} {isa:?} {rows}x{cols} {mode:?}", T::NAME);
                let x = random::<T>(&mut rng, rows * cols, 1.5);
                let w: Vec<T::Acc> = random(&mut rng, cols, 0.5);
                let mut y = poisoned::<T>(rows * cols);
                let mut rstd = poisoned::<T::Acc>(rows);
                let eps = <T::Acc as Approx>::from_f64(EPS);
                let par = &Threads(2);
                rms_norm::forward_with(&x, rows, cols, Some(&w), eps, mode, &mut y, &mut rstd, par);

                // The order of operations: y = T(pre(x * rstd) * (offset + w)), bit for bit.
                let offset = mode.offset;
                for (i, &got) in y.iter().enumerate() {
                    let (r, c) = (i / cols, i % cols);
                    let xhat = pre_weight::<T>(x[i].to_acc() * rstd[r], mode.round_first);
                    let want = T::from_acc(xhat * (offset + w[c]));
                    assert_eq!(
                        got.to_f64().to_bits(),
                        want.to_f64().to_bits(),
                        "y[{i}] ({ctx})"
                    );
                }
                // And against f64: the scale is offset + w.
                let scale: Vec<f64> = w.iter().map(|&w| (offset + w).to_f64()).collect();
                let (y_ref, _) = ref_forward(&to_f64(&x), rows, cols, Some(&scale), EPS);
                assert_close(&to_f64(&y), &y_ref, T::TOL, "y", &ctx);
            }
        }
    });
}

/// dx is `_fused_rms_norm_backward`'s with `offset + w` as the weight; dw sums `dy * pre(xhat)`.
fn check_backward<T: TestFloat>() {
    for_each_isa(|isa| {
        for (case, &(rows, cols)) in SHAPES.iter().enumerate() {
            for mode in modes::<T::Acc>() {
                for (want_dx, want_dw) in [(true, true), (false, true), (true, false)] {
                    let mut rng = Rng::new(77 * case as u64 + 1);
                    let ctx = format!("{} {isa:?} {rows}x{cols} {mode:?} dx={want_dx}", T::NAME);
                    let x = random::<T>(&mut rng, rows * cols, 1.5);
                    let dy = random::<T>(&mut rng, rows * cols, 1.0);
                    let w: Vec<T::Acc> = random(&mut rng, cols, 0.5);
                    let (x64, dy64) = (to_f64(&x), to_f64(&dy));
                    let rstd: Vec<T::Acc> = ref_forward(&x64, rows, cols, None, EPS)
                        .1
                        .into_iter()
                        .map(<T::Acc as Approx>::from_f64)
                        .collect();
                    let mut dx = poisoned::<T>(rows * cols);
                    let mut dw = poisoned::<T::Acc>(cols);
                    rms_norm::backward_with(
                        &dy,
                        &x,
                        &rstd,
                        rows,
                        cols,
                        Some(&w),
                        mode,
                        want_dx.then_some(&mut dx[..]),
                        want_dw.then_some(&mut dw[..]),
                        &Serial,
                    );

                    let scale: Vec<f64> = w.iter().map(|&w| (mode.offset + w).to_f64()).collect();
                    let rstd64 = to_f64(&rstd);
                    let (dx_ref, _) = ref_backward(&dy64, &x64, &rstd64, rows, cols, Some(&scale));
                    if want_dx {
                        let s = dx_scale(&dy64, &rstd64, cols, Some(&scale));
                        assert_close_scaled(&to_f64(&dx), &dx_ref, s, T::TOL, "dx", &ctx);
                    }
                    if want_dw {
                        // dw sums dy * xhat as the weight multiply saw it (rounded or not).
                        let mut dw_ref = vec![0.0; cols];
                        for i in 0..rows * cols {
                            let xhat = x[i].to_acc() * rstd[i / cols];
                            let xw = pre_weight::<T>(xhat, mode.round_first).to_f64();
                            dw_ref[i % cols] += dy64[i] * xw;
                        }
                        let tol = <T::Acc as Approx>::TOL * (rows as f64).sqrt().max(4.0);
                        assert_close(&to_f64(&dw), &dw_ref, tol, "dw", &ctx);
                    }
                }
            }
        }
    });
}

#[test]
fn forward_with_modes_f32() {
    check_forward::<f32>();
}

#[test]
fn forward_with_modes_f64() {
    check_forward::<f64>();
}

#[test]
fn forward_with_modes_bf16() {
    check_forward::<bf16>();
}

#[test]
fn forward_with_modes_f16() {
    check_forward::<f16>();
}

#[test]
fn backward_with_modes_f32() {
    check_backward::<f32>();
}

#[test]
fn backward_with_modes_f64() {
    check_backward::<f64>();
}

#[test]
fn backward_with_modes_bf16() {
    check_backward::<bf16>();
}

#[test]
fn backward_with_modes_f16() {
    check_backward::<f16>();
}

/// A zero offset keeps the weight as it is: -0.0 weights give -0.0 (adding +0.0 would not).
#[test]
fn zero_offset_keeps_negative_zero_weights() {
    let x = [1.0f32, 2.0, -3.0];
    let w = [-0.0f32, 1.0, -0.0];
    let mut y = [f32::NAN; 3];
    let mut rstd = [f32::NAN; 1];
    let mode = WeightMode {
        offset: 0.0,
        round_first: true,
    };
    rms_norm::forward_with(&x, 1, 3, Some(&w), 1e-6, mode, &mut y, &mut rstd, &Serial);
    assert!(y[0] == 0.0 && y[0].is_sign_negative(), "{y:?}");
    assert!(y[2] == 0.0 && y[2].is_sign_positive(), "{y:?}");
}

/// Without a weight the mode changes nothing: y is x * rstd rounded once.
#[test]
fn modes_without_a_weight_are_plain() {
    let mut rng = Rng::new(3);
    let (rows, cols) = (4, 19);
    let x = random::<bf16>(&mut rng, rows * cols, 2.0);
    let (mut y0, mut y1) = (poisoned::<bf16>(rows * cols), poisoned::<bf16>(rows * cols));
    let (mut r0, mut r1) = (poisoned::<f32>(rows), poisoned::<f32>(rows));
    rms_norm::forward(&x, rows, cols, None, 1e-6, &mut y0, &mut r0, &Serial);
    let mode = WeightMode {
        offset: 1.0,
        round_first: true,
    };
    rms_norm::forward_with(&x, rows, cols, None, 1e-6, mode, &mut y1, &mut r1, &Serial);
    assert_eq!(to_f64(&y0), to_f64(&y1));
}

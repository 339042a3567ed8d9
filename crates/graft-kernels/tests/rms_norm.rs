//! RMSNorm forward and backward against f64 references, for every dtype and available ISA.

mod common;

use common::*;
use graft_kernels::ops::rms_norm;
use graft_kernels::{with_isa, Acc, Isa, Parallel, Serial, Threads};
use half::{bf16, f16};

const COLS: [usize; 15] = [
    1, 2, 3, 7, 8, 15, 16, 31, 33, 64, 100, 1000, 4096, 4097, 12288,
];
const ROWS: [usize; 6] = [0, 1, 2, 5, 64, 1000];
const EPS: [f64; 5] = [1e-6, 1e-5, 0.0, 1e-2, 1.0];

/// The (rows, cols) grid, trimmed so that a case stays under ~100k elements.
fn shapes() -> impl Iterator<Item = (usize, usize)> {
    COLS.into_iter()
        .flat_map(|cols| ROWS.into_iter().map(move |rows| (rows, cols)))
        .filter(|&(rows, cols)| rows * cols <= 100_000 || rows <= 2)
}

/// The parallel-fors cases rotate through.
fn parallels() -> [(&'static str, &'static dyn Parallel); 4] {
    [
        ("Serial", &Serial),
        ("Threads(2)", &Threads(2)),
        ("Threads(3)", &Threads(3)),
        ("ReverseChunks", &ReverseChunks),
    ]
}

/// Runs `f` once per available ISA.
fn for_each_isa(f: impl Fn(Isa)) {
    for isa in Isa::available() {
        with_isa(isa, || f(isa));
    }
}

/// Weight in Acc (as the lead passes it), around 1 so it matters but does not cancel.
fn random_weight<T: TestFloat>(rng: &mut Rng, cols: usize) -> Vec<T::Acc> {
    (0..cols)
        .map(|_| <T::Acc as Approx>::from_f64(1.0 + rng.normal(0.3)))
        .collect()
}

fn check_forward<T: TestFloat>() {
    for_each_isa(|isa| {
        for (case, (rows, cols)) in shapes().enumerate() {
            for with_weight in [false, true] {
                let seed = 1000 * case as u64 + with_weight as u64 + 17;
                let mut rng = Rng::new(seed);
                let eps = EPS[case % EPS.len()];
                let (par_name, par) = parallels()[case % 4];
                let ctx = format!(
                    "{} {isa:?} rows={rows} cols={cols} weight={with_weight} eps={eps} \
                     {par_name} seed={seed}",
                    T::NAME
                );
                let x = random::<T>(&mut rng, rows * cols, 1.5);
                let w = with_weight.then(|| random_weight::<T>(&mut rng, cols));
                let mut y = poisoned::<T>(rows * cols);
                let mut rstd = poisoned::<T::Acc>(rows);
                let eps_acc = <T::Acc as Approx>::from_f64(eps);
                rms_norm::forward(
                    &x,
                    rows,
                    cols,
                    w.as_deref(),
                    eps_acc,
                    &mut y,
                    &mut rstd,
                    par,
                );

                let w64 = w.as_deref().map(to_f64);
                let (y_ref, rstd_ref) = ref_forward(&to_f64(&x), rows, cols, w64.as_deref(), eps);
                let acc_tol = <T::Acc as Approx>::TOL;
                assert_close(&to_f64(&rstd), &rstd_ref, acc_tol, "rstd", &ctx);
                assert_close(&to_f64(&y), &y_ref, T::TOL, "y", &ctx);

                // The order of operations is fixed: y = T((x * rstd) * w), bit for bit.
                for (i, &got) in y.iter().enumerate() {
                    let (r, c) = (i / cols, i % cols);
                    let scale = w.as_ref().map_or(<T::Acc as Acc>::ONE, |w| w[c]);
                    let want = T::from_acc(x[i].to_acc() * rstd[r] * scale);
                    assert_eq!(
                        got.to_f64().to_bits(),
                        want.to_f64().to_bits(),
                        "y[{i}] ({ctx})"
                    );
                }
            }
        }
    });
}

#[derive(Clone, Copy, Debug)]
enum Outputs {
    Both,
    DxOnly,
    DwOnly,
}

fn check_backward<T: TestFloat>() {
    for_each_isa(|isa| {
        for (case, (rows, cols)) in shapes().enumerate() {
            for (k, outputs) in [Outputs::Both, Outputs::DxOnly, Outputs::DwOnly]
                .into_iter()
                .enumerate()
            {
                let with_weight = (case + k) % 2 == 1;
                let seed = 7919 * case as u64 + k as u64 + 3;
                let mut rng = Rng::new(seed);
                let eps = EPS[case % EPS.len()];
                let (par_name, par) = parallels()[(case + k) % 4];
                let ctx = format!(
                    "{} {isa:?} rows={rows} cols={cols} weight={with_weight} {outputs:?} \
                     {par_name} seed={seed}",
                    T::NAME
                );
                let x = random::<T>(&mut rng, rows * cols, 1.5);
                let dy = random::<T>(&mut rng, rows * cols, 1.0);
                let w = with_weight.then(|| random_weight::<T>(&mut rng, cols));
                let w64 = w.as_deref().map(to_f64);
                let (x64, dy64) = (to_f64(&x), to_f64(&dy));
                // rstd as the forward pass stores it (in Acc); the reference uses the same values.
                let rstd: Vec<T::Acc> = ref_forward(&x64, rows, cols, None, eps)
                    .1
                    .into_iter()
                    .map(<T::Acc as Approx>::from_f64)
                    .collect();
                let rstd64 = to_f64(&rstd);

                let mut dx = poisoned::<T>(rows * cols);
                let mut dw = poisoned::<T::Acc>(cols);
                let want_dx = !matches!(outputs, Outputs::DwOnly);
                let want_dw = !matches!(outputs, Outputs::DxOnly);
                rms_norm::backward(
                    &dy,
                    &x,
                    &rstd,
                    rows,
                    cols,
                    w.as_deref(),
                    want_dx.then_some(&mut dx[..]),
                    want_dw.then_some(&mut dw[..]),
                    par,
                );

                let (dx_ref, dw_ref) =
                    ref_backward(&dy64, &x64, &rstd64, rows, cols, w64.as_deref());
                if want_dx {
                    // dx subtracts terms that nearly cancel when cols is small.
                    let scale = dx_scale(&dy64, &rstd64, cols, w64.as_deref());
                    assert_close_scaled(&to_f64(&dx), &dx_ref, scale, T::TOL, "dx", &ctx);
                } else {
                    assert!(dx.iter().all(|v| v.to_f64().is_nan()), "dx written ({ctx})");
                }
                if want_dw {
                    // A sum over rows, accumulated in Acc.
                    let tol = <T::Acc as Approx>::TOL * (rows as f64).sqrt().max(4.0);
                    assert_close(&to_f64(&dw), &dw_ref, tol, "dw", &ctx);
                } else {
                    assert!(dw.iter().all(|v| v.to_f64().is_nan()), "dw written ({ctx})");
                }
            }
        }
    });
}

#[test]
fn forward_f32() {
    check_forward::<f32>();
}

#[test]
fn forward_f64() {
    check_forward::<f64>();
}

#[test]
fn forward_bf16() {
    check_forward::<bf16>();
}

#[test]
fn forward_f16() {
    check_forward::<f16>();
}

#[test]
fn backward_f32() {
    check_backward::<f32>();
}

#[test]
fn backward_f64() {
    check_backward::<f64>();
}

#[test]
fn backward_bf16() {
    check_backward::<bf16>();
}

#[test]
fn backward_f16() {
    check_backward::<f16>();
}

/// NaN and infinities in x, dy and weight propagate as in the f64 reference.
fn check_non_finite<T: TestFloat>() {
    let (rows, cols) = (6, 37);
    let nan = T::from_f64(f64::NAN);
    for_each_isa(|isa| {
        let seed = 99;
        let ctx = format!("{} {isa:?} seed={seed}", T::NAME);
        let mut rng = Rng::new(seed);
        let eps = <T::Acc as Approx>::from_f64(1e-6);

        // Forward: non-finite x (rows 1 to 3) and weight (columns 9 and 10).
        let mut x = random::<T>(&mut rng, rows * cols, 1.0);
        let mut w = random_weight::<T>(&mut rng, cols);
        x[cols + 3] = nan;
        x[2 * cols + 30] = T::from_f64(f64::INFINITY);
        x[3 * cols] = T::from_f64(f64::NEG_INFINITY);
        w[9] = <T::Acc as Approx>::from_f64(f64::NAN);
        w[10] = <T::Acc as Approx>::from_f64(f64::INFINITY);
        let mut y = poisoned::<T>(rows * cols);
        let mut rstd = poisoned::<T::Acc>(rows);
        rms_norm::forward(&x, rows, cols, Some(&w), eps, &mut y, &mut rstd, &Serial);
        let (y_ref, rstd_ref) = ref_forward(&to_f64(&x), rows, cols, Some(&to_f64(&w)), 1e-6);
        assert_close(
            &to_f64(&rstd),
            &rstd_ref,
            <T::Acc as Approx>::TOL,
            "rstd",
            &ctx,
        );
        assert_close(&to_f64(&y), &y_ref, T::TOL, "y", &ctx);
        let y64 = to_f64(&y);
        assert!(
            y64[cols..2 * cols].iter().all(|v| v.is_nan()),
            "NaN row ({ctx})"
        );
        assert!(
            y64[cols * 5..].iter().filter(|v| v.is_finite()).count() == cols - 2,
            "{ctx}"
        );

        // Backward: finite x, non-finite dy (NaN in row 4 / column 5, inf in row 2 / column 7).
        let x = random::<T>(&mut rng, rows * cols, 1.0);
        let w = random_weight::<T>(&mut rng, cols);
        let mut dy = random::<T>(&mut rng, rows * cols, 1.0);
        dy[4 * cols + 5] = nan;
        dy[2 * cols + 7] = T::from_f64(f64::INFINITY);
        let (x64, dy64, w64) = (to_f64(&x), to_f64(&dy), to_f64(&w));
        let rstd: Vec<T::Acc> = ref_forward(&x64, rows, cols, None, 1e-6)
            .1
            .into_iter()
            .map(<T::Acc as Approx>::from_f64)
            .collect();
        let mut dx = poisoned::<T>(rows * cols);
        let mut dw = poisoned::<T::Acc>(cols);
        rms_norm::backward(
            &dy,
            &x,
            &rstd,
            rows,
            cols,
            Some(&w),
            Some(&mut dx),
            Some(&mut dw),
            &Threads(2),
        );
        let (dx_ref, dw_ref) = ref_backward(&dy64, &x64, &to_f64(&rstd), rows, cols, Some(&w64));
        assert_close(&to_f64(&dx), &dx_ref, 4.0 * T::TOL, "dx", &ctx);
        assert_close(
            &to_f64(&dw),
            &dw_ref,
            4.0 * <T::Acc as Approx>::TOL,
            "dw",
            &ctx,
        );
        let (dx64, dw64) = (to_f64(&dx), to_f64(&dw));
        assert!(
            dx64[4 * cols..5 * cols].iter().all(|v| v.is_nan()),
            "NaN dx row ({ctx})"
        );
        assert!(
            dx64[..cols].iter().all(|v| v.is_finite()),
            "finite dx row ({ctx})"
        );
        assert!(
            dw64[5].is_nan() && dw64[7].is_infinite(),
            "dw columns ({ctx})"
        );
        assert!(dw64[0].is_finite(), "finite dw column ({ctx})");
    });
}

#[test]
fn non_finite_propagates() {
    check_non_finite::<f32>();
    check_non_finite::<f64>();
    check_non_finite::<bf16>();
    check_non_finite::<f16>();
}

#[test]
fn zero_cols_gives_nan_rstd() {
    for_each_isa(|_| {
        let mut rstd = vec![7.0f32; 3];
        let mut y: Vec<bf16> = Vec::new();
        rms_norm::forward::<bf16>(&[], 3, 0, None, 1e-6, &mut y, &mut rstd, &Serial);
        assert!(rstd.iter().all(|r| r.is_nan()), "{rstd:?}");

        let mut dx: Vec<bf16> = Vec::new();
        let mut dw: Vec<f32> = Vec::new();
        rms_norm::backward::<bf16>(
            &[],
            &[],
            &rstd,
            3,
            0,
            Some(&[]),
            Some(&mut dx),
            Some(&mut dw),
            &Threads(2),
        );
    });
}

#[test]
fn zero_rows_gives_zero_dw() {
    for_each_isa(|_| {
        let (mut y, mut rstd): (Vec<f32>, Vec<f32>) = (Vec::new(), Vec::new());
        let w = vec![2.0f32; 5];
        rms_norm::forward::<f32>(&[], 0, 5, Some(&w), 1e-6, &mut y, &mut rstd, &Threads(2));

        let mut dx: Vec<f32> = Vec::new();
        let mut dw = vec![f32::NAN; 5];
        rms_norm::backward::<f32>(
            &[],
            &[],
            &[],
            0,
            5,
            Some(&w),
            Some(&mut dx),
            Some(&mut dw),
            &Serial,
        );
        assert_eq!(dw, vec![0.0; 5]);
        let mut dw = vec![f64::NAN; 5];
        rms_norm::backward::<f64>(&[], &[], &[], 0, 5, None, None, Some(&mut dw), &Serial);
        assert_eq!(dw, vec![0.0; 5]);
    });
}

/// No outputs requested: nothing is written, nothing panics.
#[test]
fn backward_without_outputs_is_a_no_op() {
    let x = vec![1.0f32; 12];
    rms_norm::backward::<f32>(&x, &x, &[1.0; 3], 3, 4, None, None, None, &Serial);
}

/// dw has the same bits for every Parallel (the row blocking depends on the shape only).
#[test]
fn dw_is_deterministic() {
    fn check<T: TestFloat>(rows: usize, cols: usize, isa: Isa) {
        let seed = (rows * 31 + cols) as u64;
        let mut rng = Rng::new(seed);
        let x = random::<T>(&mut rng, rows * cols, 1.0);
        let dy = random::<T>(&mut rng, rows * cols, 1.0);
        let w = random_weight::<T>(&mut rng, cols);
        let rstd = vec![<T::Acc as Approx>::from_f64(0.9); rows];
        let run = |par: &dyn Parallel| {
            let mut dx = poisoned::<T>(rows * cols);
            let mut dw = poisoned::<T::Acc>(cols);
            rms_norm::backward(
                &dy,
                &x,
                &rstd,
                rows,
                cols,
                Some(&w),
                Some(&mut dx),
                Some(&mut dw),
                par,
            );
            let bits = |v: &[f64]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            (bits(&to_f64(&dx)), bits(&to_f64(&dw)))
        };
        let serial = run(&Serial);
        let pars: [(&str, &dyn Parallel); 4] = [
            ("Threads(2)", &Threads(2)),
            ("Threads(3)", &Threads(3)),
            ("Threads(8)", &Threads(8)),
            ("ReverseChunks", &ReverseChunks),
        ];
        for (name, par) in pars {
            let other = run(par);
            let ctx = format!(
                "{} {isa:?} rows={rows} cols={cols} {name} seed={seed}",
                T::NAME
            );
            assert!(serial.1 == other.1, "dw bits differ from Serial ({ctx})");
            assert!(serial.0 == other.0, "dx bits differ from Serial ({ctx})");
        }
    }
    for_each_isa(|isa| {
        for (rows, cols) in [(1000, 100), (4096, 64), (300, 4097), (2000, 33), (77, 1000)] {
            check::<f32>(rows, cols, isa);
            check::<bf16>(rows, cols, isa);
            check::<f64>(rows, cols, isa);
        }
    });
}

#[test]
#[should_panic(expected = "rms_norm::forward: `x` has 11 elements, expected 12")]
fn forward_rejects_short_x() {
    let (mut y, mut rstd) = (vec![0.0f32; 12], vec![0.0f32; 3]);
    rms_norm::forward::<f32>(&[1.0; 11], 3, 4, None, 1e-6, &mut y, &mut rstd, &Serial);
}

#[test]
#[should_panic(expected = "rms_norm::forward: `weight` has 3 elements, expected 4")]
fn forward_rejects_bad_weight() {
    let (mut y, mut rstd) = (vec![0.0f32; 12], vec![0.0f32; 3]);
    rms_norm::forward::<f32>(
        &[1.0; 12],
        3,
        4,
        Some(&[1.0; 3]),
        1e-6,
        &mut y,
        &mut rstd,
        &Serial,
    );
}

#[test]
#[should_panic(expected = "rms_norm::forward: `rstd` has 2 elements, expected 3")]
fn forward_rejects_bad_rstd() {
    let (mut y, mut rstd) = (vec![0.0f32; 12], vec![0.0f32; 2]);
    rms_norm::forward::<f32>(&[1.0; 12], 3, 4, None, 1e-6, &mut y, &mut rstd, &Serial);
}

#[test]
#[should_panic(expected = "rms_norm::backward: `dw` has 5 elements, expected 4")]
fn backward_rejects_bad_dw() {
    let mut dw = vec![0.0f32; 5];
    rms_norm::backward::<f32>(
        &[1.0; 12],
        &[1.0; 12],
        &[1.0; 3],
        3,
        4,
        None,
        None,
        Some(&mut dw),
        &Serial,
    );
}

#[test]
#[should_panic(expected = "rms_norm::backward: `dx` has 13 elements, expected 12")]
fn backward_rejects_bad_dx() {
    let mut dx = vec![0.0f32; 13];
    rms_norm::backward::<f32>(
        &[1.0; 12],
        &[1.0; 12],
        &[1.0; 3],
        3,
        4,
        None,
        Some(&mut dx),
        None,
        &Serial,
    );
}

#[test]
#[should_panic(expected = "overflows usize")]
fn forward_rejects_overflowing_shape() {
    rms_norm::forward::<f32>(&[], usize::MAX, 2, None, 1e-6, &mut [], &mut [], &Serial);
}

/// A `Parallel` that skips part of the range is caught, not silently wrong.
#[test]
#[should_panic(expected = "Parallel::for_range covered")]
fn broken_parallel_is_detected() {
    struct FirstHalf;
    impl Parallel for FirstHalf {
        fn for_range(&self, n: usize, _: usize, body: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
            body(0..n / 2);
        }
    }
    let n = 64 * 4096;
    let (x, mut y, mut rstd) = (vec![1.0f32; n], vec![0.0f32; n], vec![0.0f32; 64]);
    rms_norm::forward::<f32>(&x, 64, 4096, None, 1e-6, &mut y, &mut rstd, &FirstHalf);
}

//! The fastest of N runs of the (8192 x 4096) cases, for a quick look on a busy machine where
//! criterion's means wander: `cargo run -p graft-kernels --release --example quick_bench [N]`.
//!
//! `QUICK_BENCH_ALL_ISAS=1` also times the AVX2 and portable kernels (default: the best only).
//! GB/s counts bytes read plus bytes written (2 tensors for copy and forward, 3 for backward).

use std::time::Instant;

use graft_kernels::ops::rms_norm;
use graft_kernels::{with_isa, Float, Isa, Parallel, Serial, Threads};
use half::bf16;

#[path = "../benches/common/mod.rs"]
mod common;
use common::{aligned, copy, random, COLS, ROWS};

/// The fastest of `reps` runs of `f`, in milliseconds.
fn best_ms(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e3
        })
        .fold(f64::INFINITY, f64::min)
}

fn run<T: Float<Acc = f32>>(name: &str, reps: usize) {
    let n = ROWS * COLS;
    let gb = (n * std::mem::size_of::<T>()) as f64 / 1e9;
    let x = random::<T>(n, 1);
    let dy = random::<T>(n, 2);
    let w: Vec<f32> = random::<T>(COLS, 3).into_iter().map(T::to_acc).collect();
    let (mut y_storage, mut dx_storage) = (Vec::new(), Vec::new());
    let y = aligned(&mut y_storage, n);
    let dx = aligned(&mut dx_storage, n);
    let (mut rstd, mut dw) = (vec![0.0f32; ROWS], vec![0.0f32; COLS]);
    let report = |what: &str, par: &str, ms: f64, tensors: f64| {
        let rate = tensors * gb / ms * 1e3;
        println!("{name:5} {what:8} {par:10} {ms:7.2} ms {rate:6.1} GB/s");
    };
    let pars: [(&str, &dyn Parallel); 2] = [("Serial", &Serial), ("Threads(2)", &Threads(2))];
    for (par_name, par) in pars {
        report("copy", par_name, best_ms(reps, || copy(&x, y, par)), 2.0);
        let ms = best_ms(reps, || {
            rms_norm::forward(&x, ROWS, COLS, Some(&w), 1e-6, y, &mut rstd, par)
        });
        report("forward", par_name, ms, 2.0);
        let ms = best_ms(reps, || {
            let (dx, dw) = (Some(&mut dx[..]), Some(&mut dw[..]));
            rms_norm::backward(&dy, &x, &rstd, ROWS, COLS, Some(&w), dx, dw, par)
        });
        report("backward", par_name, ms, 3.0);
    }
}

fn main() {
    let reps = std::env::args()
        .nth(1)
        .map_or(20, |r| r.parse().expect("N"));
    let all = std::env::var_os("QUICK_BENCH_ALL_ISAS").is_some();
    let isas = if all {
        Isa::available()
    } else {
        vec![Isa::best()]
    };
    for isa in isas {
        println!("-- {isa:?}, best of {reps}");
        with_isa(isa, || {
            run::<bf16>("bf16", reps);
            run::<f32>("f32", reps);
        });
    }
}

//! The fastest of N runs of the (8192 x 4096) cases, for a quick look on a busy machine where
//! criterion's means wander: `cargo run -p graft-kernels --release --example quick_bench [N]`.
//!
//! `QUICK_BENCH_ALL_ISAS=1` also times the AVX2 and portable kernels (default: the best only).
//! GB/s counts bytes read plus bytes written (2 tensors for copy and forward, 3 for backward).

use std::time::Instant;

use graft_kernels::{rms_norm, with_isa, Float, Isa, Parallel, Serial, Threads};
use half::bf16;

const ROWS: usize = 8192;
const COLS: usize = 4096;

/// Deterministic inputs in about [-2, 2) (splitmix64).
fn random<T: Float<Acc = f32>>(n: usize, seed: u64) -> Vec<T> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            T::from_acc((z >> 40) as f32 / (1u64 << 22) as f32 - 2.0)
        })
        .collect()
}

/// A zeroed buffer of `n` elements starting on a 64-byte boundary, as torch allocates.
fn aligned<T: Float>(storage: &mut Vec<T>, n: usize) -> &mut [T] {
    *storage = vec![T::default(); n + 64];
    let skip = storage.as_ptr().align_offset(64);
    &mut storage[skip..skip + n]
}

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

/// `dst.copy_from_slice(src)` in two halves over `par`.
fn copy<T: Float>(src: &[T], dst: &mut [T], par: &dyn Parallel) {
    let half = src.len() / 2;
    let (lo, hi) = dst.split_at_mut(half);
    let halves = [std::sync::Mutex::new(lo), std::sync::Mutex::new(hi)];
    par.for_range(2, 1, &|range| {
        for i in range {
            let mut dst = halves[i].lock().unwrap();
            let len = dst.len();
            dst.copy_from_slice(&src[i * half..][..len]);
        }
    });
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

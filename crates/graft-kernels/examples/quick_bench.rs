//! A quick min-of-N timing of the (8192 x 4096) cases, less sensitive to a busy machine than the
//! criterion means: `cargo run -p graft-kernels --release --example quick_bench [reps]`.

use std::time::Instant;

use graft_kernels::{rms_norm, with_isa, Float, Isa, Parallel, Serial, Threads};
use half::bf16;

const ROWS: usize = 8192;
const COLS: usize = 4096;

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
    let (mut y, mut dx) = (vec![T::default(); n], vec![T::default(); n]);
    let (mut rstd, mut dw) = (vec![0.0f32; ROWS], vec![0.0f32; COLS]);
    let pars: [(&str, &dyn Parallel); 2] = [("serial", &Serial), ("threads2", &Threads(2))];
    for (pn, par) in pars {
        let ms = best_ms(reps, || y.copy_from_slice(&x));
        if pn == "serial" {
            println!(
                "{name:5} copy     {pn:8} {ms:7.2} ms {:6.1} GB/s",
                2.0 * gb / ms * 1e3
            );
        }
        let ms = best_ms(reps, || {
            rms_norm::forward(&x, ROWS, COLS, Some(&w), 1e-6, &mut y, &mut rstd, par)
        });
        println!(
            "{name:5} forward  {pn:8} {ms:7.2} ms {:6.1} GB/s",
            2.0 * gb / ms * 1e3
        );
        let ms = best_ms(reps, || {
            rms_norm::backward(
                &dy,
                &x,
                &rstd,
                ROWS,
                COLS,
                Some(&w),
                Some(&mut dx),
                Some(&mut dw),
                par,
            )
        });
        println!(
            "{name:5} backward {pn:8} {ms:7.2} ms {:6.1} GB/s",
            3.0 * gb / ms * 1e3
        );
    }
}

fn main() {
    let reps = std::env::args()
        .nth(1)
        .map_or(10, |r| r.parse().expect("reps"));
    let only = std::env::var("ONLY").unwrap_or_default();
    for isa in Isa::available() {
        if !only.is_empty() && isa != Isa::Avx512 {
            continue;
        }
        if isa == Isa::Portable && std::env::var_os("QUICK_BENCH_PORTABLE").is_none() {
            continue;
        }
        println!("-- {isa:?}");
        with_isa(isa, || {
            if only.is_empty() || only == "bf16" {
                run::<bf16>("bf16", reps);
            }
            if only.is_empty() || only == "f32" {
                run::<f32>("f32", reps);
            }
        });
    }
}

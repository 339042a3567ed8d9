//! TEMPORARY A/B experiment harness.
use graft_kernels::{rms_norm, Float, Parallel, Serial, Threads};
use half::bf16;
use std::time::Instant;
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
fn go<T: Float<Acc = f32>>(name: &str) {
    let variants: Vec<u32> = std::env::var("VARIANTS")
        .unwrap()
        .split(',')
        .map(|v| v.parse().unwrap())
        .collect();
    let what = std::env::var("WHAT").unwrap_or("fwd".into());
    let threads: usize = std::env::var("T").map(|t| t.parse().unwrap()).unwrap_or(1);
    let par: &dyn Parallel = if threads == 1 {
        &Serial
    } else {
        &Threads(threads)
    };
    let n = ROWS * COLS;
    let gb = (n * std::mem::size_of::<T>()) as f64 / 1e9;
    let x = random::<T>(n, 1);
    let dy = random::<T>(n, 2);
    let w: Vec<f32> = random::<T>(COLS, 3).into_iter().map(T::to_acc).collect();
    let (mut y, mut dx) = (vec![T::default(); n], vec![T::default(); n]);
    let (mut rstd, mut dw) = (vec![0.0f32; ROWS], vec![0.0f32; COLS]);
    rms_norm::forward(&x, ROWS, COLS, Some(&w), 1e-6, &mut y, &mut rstd, &Serial);
    let mut best = vec![f64::INFINITY; variants.len() + 1];
    for _ in 0..30 {
        let t = Instant::now();
        y.copy_from_slice(&x);
        best[0] = best[0].min(t.elapsed().as_secs_f64() * 1e3);
        for (k, &v) in variants.iter().enumerate() {
            graft_kernels::rows::EXP.store(v, std::sync::atomic::Ordering::Relaxed);
            let t = Instant::now();
            if what == "fwd" {
                rms_norm::forward(&x, ROWS, COLS, Some(&w), 1e-6, &mut y, &mut rstd, par);
            } else {
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
                );
            }
            best[k + 1] = best[k + 1].min(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let f = if what == "fwd" { 2.0 } else { 3.0 };
    println!(
        "{name} copy {:.2} ms {:.1} GB/s",
        best[0],
        2.0 * gb / best[0] * 1e3
    );
    for (k, v) in variants.iter().enumerate() {
        println!(
            "{name} {what} T={threads} EXP={v}: {:.2} ms {:.1} GB/s",
            best[k + 1],
            f * gb / best[k + 1] * 1e3
        );
    }
}
fn main() {
    go::<bf16>("bf16");
    go::<f32>("f32");
}

//! RMSNorm at (8192 x 4096), bf16 and f32, forward and backward, Serial and Threads(2), against
//! a plain copy of the same bytes (the bandwidth reference). Outputs are allocated 64-byte
//! aligned (as torch does) and faulted in once, outside the timing.
//!
//! `cargo bench -p graft-kernels --bench rms_norm`; criterion prints time and GB/s (bytes read
//! plus bytes written: 2 tensors for copy and forward, 3 for backward).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use graft_kernels::ops::rms_norm;
use graft_kernels::{Float, Isa, Parallel, Serial, Threads};
use half::bf16;

mod common;
use common::{aligned, copy, random, COLS, ROWS};

fn bench_dtype<T: Float<Acc = f32>>(c: &mut Criterion, name: &str) {
    let n = ROWS * COLS;
    let bytes = (n * std::mem::size_of::<T>()) as u64;
    let x = random::<T>(n, 1);
    let dy = random::<T>(n, 2);
    let weight: Vec<f32> = random::<T>(COLS, 3).into_iter().map(T::to_acc).collect();
    let (mut y_storage, mut dx_storage) = (Vec::new(), Vec::new());
    let y = aligned(&mut y_storage, n);
    let dx = aligned(&mut dx_storage, n);
    let mut rstd = vec![0.0f32; ROWS];
    let mut dw = vec![0.0f32; COLS];
    let pars: [(&str, &dyn Parallel); 2] = [("serial", &Serial), ("threads2", &Threads(2))];
    let eps = 1e-6;

    let mut group = c.benchmark_group(format!("{name}_{ROWS}x{COLS}"));
    group.sample_size(20);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(3));

    group.throughput(Throughput::Bytes(2 * bytes));
    for (par_name, par) in pars {
        group.bench_function(BenchmarkId::new("copy", par_name), |b| {
            b.iter(|| copy(&x, y, par))
        });
    }
    for (par_name, par) in pars {
        group.bench_function(BenchmarkId::new("forward", par_name), |b| {
            b.iter(|| rms_norm::forward(&x, ROWS, COLS, Some(&weight), eps, y, &mut rstd, par))
        });
    }
    rms_norm::forward(&x, ROWS, COLS, Some(&weight), eps, y, &mut rstd, &Serial);

    group.throughput(Throughput::Bytes(3 * bytes));
    for (par_name, par) in pars {
        group.bench_function(BenchmarkId::new("backward", par_name), |b| {
            b.iter(|| {
                rms_norm::backward(
                    &dy,
                    &x,
                    &rstd,
                    ROWS,
                    COLS,
                    Some(&weight),
                    Some(&mut dx[..]),
                    Some(&mut dw),
                    par,
                )
            })
        });
    }
    group.finish();
}

fn benches(c: &mut Criterion) {
    eprintln!(
        "instruction set: {:?} (available: {:?})",
        Isa::best(),
        Isa::available()
    );
    bench_dtype::<bf16>(c, "bf16");
    bench_dtype::<f32>(c, "f32");
}

criterion_group!(rms_norm_benches, benches);
criterion_main!(rms_norm_benches);

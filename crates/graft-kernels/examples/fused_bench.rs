//! Single-thread throughput of the fused elementwise kernels (GLU forward/backward, RoPE) per
//! instruction set, in nanoseconds per element (fastest of N runs over a cache-resident
//! buffer, so the number is the kernel's compute cost, not memory's):
//! `cargo run -p graft-kernels --release --example fused_bench [N]`.
//!
//! Then SwiGLU's forward and backward over the Python bench's bf16 2048 x 4096 (16 MiB a
//! buffer, far beyond L2), on one thread and two (fastest of `N / 10` runs, at least 5): what
//! streaming the operands from memory adds to the arithmetic, in nanoseconds per element of
//! wall time.

use std::time::Instant;

use graft_kernels::ops::glu::{self, Activation};
use graft_kernels::ops::rope::{self, RopeOperand};
use graft_kernels::{with_isa, Isa, Parallel, Serial, Threads};
use half::bf16;

#[path = "../benches/common/mod.rs"]
#[allow(dead_code)] // shared with the RMSNorm benches
mod common;
use common::random;

/// Elements per buffer: 256 KiB of bf16, resident in L2.
const N: usize = 1 << 17;

/// Elements per buffer of the streaming runs: the Python bench's 2048 x 4096.
const BIG: usize = 2048 * 4096;

/// The fastest of `reps` runs of `f` over `n` elements, in nanoseconds per element.
fn ns_per(n: usize, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e9 / n as f64
        })
        .fold(f64::INFINITY, f64::min)
}

/// [`ns_per`] over the cache-resident `N` elements.
fn ns_per_elem(reps: usize, f: impl FnMut()) -> f64 {
    ns_per(N, reps, f)
}

/// SwiGLU bf16 over [`BIG`] elements, the best ISA, one thread and two.
fn streaming(reps: usize) {
    let (g, u, dy) = (
        random::<bf16>(BIG, 1),
        random::<bf16>(BIG, 2),
        random::<bf16>(BIG, 3),
    );
    let (mut y, mut dg, mut du) = (
        vec![bf16::ZERO; BIG],
        vec![bf16::ZERO; BIG],
        vec![bf16::ZERO; BIG],
    );
    let reps = (reps / 10).max(5);
    let act = Activation::Silu;
    let pars: [(&str, &dyn Parallel); 2] = [("1 thread", &Serial), ("2 threads", &Threads(2))];
    for (name, par) in pars {
        let copy = ns_per(BIG, reps, || {
            glu_copy(&g, &mut y, par);
        });
        let fwd = ns_per(BIG, reps, || glu::forward(act, &g, &u, &mut y, par));
        let bwd = ns_per(BIG, reps, || {
            glu::backward(act, &g, &u, &dy, &mut dg, &mut du, par)
        });
        println!(
            "streaming bf16 {BIG} elems, {name}: copy {copy:.3} ns/elem, glu Silu forward \
             {fwd:.3}, backward {bwd:.3}"
        );
    }
}

/// `dst.copy_from_slice(src)` split over `par` (two halves): the bandwidth reference.
fn glu_copy(src: &[bf16], dst: &mut [bf16], par: &dyn Parallel) {
    common::copy(src, dst, par)
}

fn main() {
    let reps = std::env::args()
        .nth(1)
        .map_or(50, |r| r.parse().expect("N"));
    let (g, u, dy) = (
        random::<bf16>(N, 1),
        random::<bf16>(N, 2),
        random::<bf16>(N, 3),
    );
    let (mut y, mut dg, mut du) = (
        vec![bf16::ZERO; N],
        vec![bf16::ZERO; N],
        vec![bf16::ZERO; N],
    );
    let d = 128;
    let table = random::<bf16>(N, 4);
    let copy = ns_per_elem(reps, || y.copy_from_slice(&g));
    println!("copy (reference): {copy:.3} ns/elem");
    for isa in Isa::available() {
        with_isa(isa, || {
            for act in [Activation::Silu, Activation::GeluTanh, Activation::GeluErf] {
                let fwd = ns_per_elem(reps, || glu::forward(act, &g, &u, &mut y, &Serial));
                let bwd = ns_per_elem(reps, || {
                    glu::backward(act, &g, &u, &dy, &mut dg, &mut du, &Serial)
                });
                println!("{isa:?} bf16 glu {act:?}: forward {fwd:.3} ns/elem, backward {bwd:.3}");
            }
            let op = RopeOperand {
                sizes: [1, N / d / 8, 8],
                x: &g,
                x_strides: [0, 8 * d, d],
                cos: &table,
                cos_strides: [0, d, 0],
                sin: &table,
                sin_strides: [0, d, 0],
                head_dim: d,
                rotary_dim: d,
            };
            let ns = ns_per_elem(reps, || rope::rope(&op, false, &mut y[..], &Serial));
            println!("{isa:?} bf16 rope d{d}: {ns:.3} ns/elem");
        });
    }
    streaming(reps);
}

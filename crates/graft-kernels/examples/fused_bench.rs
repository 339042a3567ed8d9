//! Single-thread throughput of the fused elementwise kernels (GLU forward/backward, RoPE) per
//! instruction set, in nanoseconds per element (fastest of N runs over a cache-resident
//! buffer, so the number is the kernel's compute cost, not memory's):
//! `cargo run -p graft-kernels --release --example fused_bench [N]`.

use std::time::Instant;

use graft_kernels::glu::{self, Activation};
use graft_kernels::rope::{self, RopeOperand};
use graft_kernels::{with_isa, Isa, Serial};
use half::bf16;

#[path = "../benches/common/mod.rs"]
#[allow(dead_code)] // shared with the RMSNorm benches
mod common;
use common::random;

/// Elements per buffer: 256 KiB of bf16, resident in L2.
const N: usize = 1 << 17;

/// The fastest of `reps` runs of `f`, in nanoseconds per element.
fn ns_per_elem(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e9 / N as f64
        })
        .fold(f64::INFINITY, f64::min)
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
}

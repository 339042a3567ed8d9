//! RoPE forward and backward against f64 references, for every dtype and available ISA, over
//! strided rows (transposed views, broadcast tables), head dims that leave vector tails, and
//! partial rotary dims.

mod common;

use common::*;
use graft_kernels::ops::rope::{self, coalesce, RopeOperand};
use graft_kernels::{with_isa, Isa, Serial, Threads};
use half::{bf16, f16};

/// (head_dim, rotary_dim) pairs.
const DIMS: [(usize, usize); 9] = [
    (2, 2),
    (6, 6),
    (8, 4),
    (34, 34),
    (64, 64),
    (64, 32),
    (72, 72),
    (128, 128),
    (96, 64),
];

/// f64 reference of one operand.
fn reference<T: TestFloat>(op: &RopeOperand<'_, T>, backward: bool) -> Vec<f64> {
    let (d, r) = (op.head_dim, op.rotary_dim);
    let h = r / 2;
    let mut out = Vec::with_capacity(op.rows() * d);
    for i0 in 0..op.sizes[0] {
        for i1 in 0..op.sizes[1] {
            for i2 in 0..op.sizes[2] {
                let at = |s: [usize; 3]| i0 * s[0] + i1 * s[1] + i2 * s[2];
                let x = |j: usize| op.x[at(op.x_strides) + j].to_f64();
                let c = |j: usize| op.cos[at(op.cos_strides) + j].to_f64();
                let s = |j: usize| op.sin[at(op.sin_strides) + j].to_f64();
                for j in 0..d {
                    out.push(if j >= r {
                        x(j)
                    } else if backward && j < h {
                        x(j) * c(j) + x(j + h) * s(j + h)
                    } else if backward {
                        x(j) * c(j) - x(j - h) * s(j - h)
                    } else if j < h {
                        x(j) * c(j) - x(j + h) * s(j)
                    } else {
                        x(j) * c(j) + x(j - h) * s(j)
                    });
                }
            }
        }
    }
    out
}

fn check<T: TestFloat>() {
    let mut rng = Rng::new(11);
    let (b, s, heads) = (2, 5, 3);
    for (d, r) in DIMS {
        // x: a (B, S, H, D) buffer read as rows in (B, S, H) order, with a spare element per
        // head so that rows are not adjacent; cos/sin: (B, S, R) tables broadcast over heads.
        let x_row = d + 1;
        let x = random::<T>(&mut rng, b * s * heads * x_row, 1.0);
        let cos = random::<T>(&mut rng, b * s * r, 1.0);
        let sin = random::<T>(&mut rng, b * s * r, 1.0);
        let op = RopeOperand {
            sizes: [b, s, heads],
            x: &x,
            x_strides: [s * heads * x_row, heads * x_row, x_row],
            cos: &cos,
            cos_strides: [s * r, r, 0],
            sin: &sin,
            sin_strides: [s * r, r, 0],
            head_dim: d,
            rotary_dim: r,
        };
        for backward in [false, true] {
            let want = reference(&op, backward);
            for isa in Isa::available() {
                let ctx = format!("{} {isa:?} d={d} r={r} backward={backward}", T::NAME);
                let mut out = poisoned::<T>(op.rows() * d);
                with_isa(isa, || rope::rope(&op, backward, &mut out, &Threads(2)));
                assert_close(&to_f64(&out), &want, T::TOL.max(1e-6), "out", &ctx);
            }
        }
    }
}

#[test]
fn rope_f32() {
    check::<f32>();
}

#[test]
fn rope_f64() {
    check::<f64>();
}

#[test]
fn rope_bf16() {
    check::<bf16>();
}

#[test]
fn rope_f16() {
    check::<f16>();
}

/// The backward is the transpose of the forward: <rope(x), g> == <x, rope_backward(g)>.
#[test]
fn backward_is_the_adjoint() {
    let mut rng = Rng::new(3);
    let (rows, d, r) = (7, 40, 32);
    let x = random::<f64>(&mut rng, rows * d, 1.0);
    let g = random::<f64>(&mut rng, rows * d, 1.0);
    let cos = random::<f64>(&mut rng, rows * r, 1.0);
    let sin = random::<f64>(&mut rng, rows * r, 1.0);
    let operand = |data| RopeOperand {
        sizes: [1, 1, rows],
        x: data,
        x_strides: [0, 0, d],
        cos: &cos,
        cos_strides: [0, 0, r],
        sin: &sin,
        sin_strides: [0, 0, r],
        head_dim: d,
        rotary_dim: r,
    };
    let (mut fx, mut bg) = (vec![0.0; rows * d], vec![0.0; rows * d]);
    rope::rope(&operand(&x[..]), false, &mut fx, &Serial);
    rope::rope(&operand(&g[..]), true, &mut bg, &Serial);
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(a, b)| a * b).sum::<f64>();
    let (lhs, rhs) = (dot(&fx, &g), dot(&x, &bg));
    assert!(
        (lhs - rhs).abs() <= 1e-12 * lhs.abs().max(1.0),
        "{lhs} vs {rhs}"
    );
}

#[test]
fn rows_outside_the_buffers_are_rejected() {
    let x = [0.0f32; 16];
    let op = RopeOperand {
        sizes: [1, 1, 3],
        x: &x,
        x_strides: [0, 0, 8],
        cos: &x,
        cos_strides: [0, 0, 0],
        sin: &x,
        sin_strides: [0, 0, 0],
        head_dim: 8,
        rotary_dim: 8,
    };
    let result = std::panic::catch_unwind(|| rope::rope(&op, false, &mut [0.0; 24], &Serial));
    assert!(result.is_err(), "row 2 of x starts at 16, past the buffer");
    let odd = RopeOperand {
        rotary_dim: 3,
        ..op
    };
    assert!(std::panic::catch_unwind(|| rope::rope(&odd, false, &mut [0.0; 24], &Serial)).is_err());
}

#[test]
fn coalesced_layouts_enumerate_the_same_rows() {
    // A contiguous (B, H, S, D) tensor: every leading dim merges into one.
    let (b, h, s, d) = (2, 3, 4, 8);
    let x = [h * s * d, s * d, d];
    let cos = [s * d, 0, d];
    let (sizes, [xs, cs]) = coalesce(&[b, h, s], [&x, &cos]).unwrap();
    assert_eq!(sizes.iter().product::<usize>(), b * h * s);
    // B and H merge for x (b stride = h * (s*d)) but not for cos (0 * h != s*d): three dims stay.
    assert_eq!(sizes, [b, h, s]);
    assert_eq!((xs, cs), (x, cos));
}

//! SwiGLU / GeGLU forward and backward against f64 references, for every dtype, activation and
//! available ISA, over lengths that exercise whole unrolled blocks, single vectors and tails.

mod common;

use common::*;
use graft_kernels::glu::{self, Activation, GluMath};
use graft_kernels::{with_isa, Isa, Serial, Threads};
use half::{bf16, f16};

const LENS: [usize; 12] = [0, 1, 7, 15, 16, 17, 63, 64, 65, 200, 1000, 8192 * 2 + 45];
const ACTS: [Activation; 3] = [Activation::Silu, Activation::GeluTanh, Activation::GeluErf];

/// `(act(x), act'(x))` in f64.
fn act_ref(act: Activation, x: f64) -> (f64, f64) {
    match act {
        Activation::Silu => {
            let s = 1.0 / (1.0 + (-x).exp());
            (x * s, s * (1.0 + x * (1.0 - s)))
        }
        Activation::GeluTanh => {
            let k0 = (2.0 / std::f64::consts::PI).sqrt();
            let u = k0 * (x + 0.044715 * x * x * x);
            let t = u.tanh();
            let du = k0 * (1.0 + 3.0 * 0.044715 * x * x);
            (
                0.5 * x * (1.0 + t),
                0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du,
            )
        }
        Activation::GeluErf => {
            let cdf = 0.5 * libm::erfc(-x / std::f64::consts::SQRT_2);
            let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
            (x * cdf, cdf + x * pdf)
        }
    }
}

/// Tolerance for the gradients: `dgate` is a product of three rounded inputs (one more rounding
/// than the forward) and the derivative of GELU cancels near its zero.
fn tol<T: TestFloat>() -> f64 {
    T::TOL.max(3e-6)
}

fn check<T: TestFloat>()
where
    T::Acc: GluMath,
{
    let mut rng = Rng::new(7);
    for isa in Isa::available() {
        for act in ACTS {
            for n in LENS {
                let ctx = format!("{} {isa:?} {act:?} n={n}", T::NAME);
                let gate = random::<T>(&mut rng, n, 3.0);
                let up = random::<T>(&mut rng, n, 1.0);
                let dy = random::<T>(&mut rng, n, 1.0);
                let (mut y, mut dg, mut du) =
                    (poisoned::<T>(n), poisoned::<T>(n), poisoned::<T>(n));
                with_isa(isa, || {
                    glu::forward(act, &gate, &up, &mut y, &Threads(2));
                    glu::backward(act, &gate, &up, &dy, &mut dg, &mut du, &Serial);
                });
                let (mut y_ref, mut dg_ref, mut du_ref) = (vec![], vec![], vec![]);
                for i in 0..n {
                    let (g, u, d) = (gate[i].to_f64(), up[i].to_f64(), dy[i].to_f64());
                    let (f, df) = act_ref(act, g);
                    y_ref.push(f * u);
                    dg_ref.push(d * u * df);
                    du_ref.push(d * f);
                }
                assert_close(&to_f64(&y), &y_ref, tol::<T>(), "y", &ctx);
                assert_close(&to_f64(&dg), &dg_ref, 2.0 * tol::<T>(), "dgate", &ctx);
                assert_close(&to_f64(&du), &du_ref, tol::<T>(), "dup", &ctx);
            }
        }
    }
}

#[test]
fn glu_f32() {
    check::<f32>();
}

#[test]
fn glu_f64() {
    check::<f64>();
}

#[test]
fn glu_bf16() {
    check::<bf16>();
}

#[test]
fn glu_f16() {
    check::<f16>();
}

/// Far tails, infinities and NaN: the values `x * act(x)` takes there, on every ISA (results
/// below `f32::MIN_POSITIVE` may lose their subnormal digits, as in PyTorch's kernels; in the
/// tails the rounding of the activation's argument `u` costs `|u|` ulp, so 2e-6 relative).
#[test]
fn extreme_gates() {
    let gates = [
        -200.0f32,
        -104.0,
        -89.0,
        -88.8,
        -20.0,
        -14.0,
        -5.0,
        0.0,
        -0.0,
        5.0,
        20.0,
        89.0,
        200.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    let up = vec![1.0f32; gates.len()];
    for isa in Isa::available() {
        for act in ACTS {
            let mut y = poisoned::<f32>(gates.len());
            with_isa(isa, || glu::forward(act, &gates, &up, &mut y, &Serial));
            for (&g, &y) in gates.iter().zip(&y) {
                let want = act_ref(act, g as f64).0;
                let ctx = format!("{isa:?} {act:?} gate {g}: got {y}, want {want}");
                if want.is_nan() {
                    assert!(y.is_nan(), "{ctx}");
                } else if want.is_infinite() {
                    assert_eq!(y as f64, want, "{ctx}");
                } else {
                    let err = (y as f64 - want).abs();
                    assert!(err <= 2e-6 * want.abs() + f32::MIN_POSITIVE as f64, "{ctx}");
                }
            }
        }
    }
}

#[test]
fn lengths_must_match() {
    let g = [1.0f32; 4];
    let result = std::panic::catch_unwind(|| {
        let mut y = [0.0f32; 3];
        glu::forward(Activation::Silu, &g, &g, &mut y, &Serial);
    });
    assert!(result.is_err());
    // An empty problem is fine.
    glu::forward::<bf16>(Activation::Silu, &[], &[], &mut [], &Serial);
}

/// bf16 outputs are the `f32` kernels' results rounded once (nearest even, NaN quieted, the
/// subnormals kept) on every ISA: with AVX512-BF16, vectors round with `vcvtneps2bf16` unless a
/// lane is subnormal (the instruction flushes those) and fall back to integer rounding then.
#[test]
fn bf16_outputs_round_the_f32_results_once() {
    let n = 16 * 40 + 7;
    let mut rng = Rng::new(11);
    let mut gate: Vec<bf16> = random(&mut rng, n, 2.0);
    let mut up: Vec<bf16> = random(&mut rng, n, 1.0);
    let dy: Vec<bf16> = random(&mut rng, n, 1.0);
    // Vectors 3 and 9 get subnormal outputs (tiny up), vector 5 NaN and infinite gates.
    for i in 0..16 {
        up[3 * 16 + i] = bf16::from_f32(1e-39 * (i as f32 + 1.0));
        up[9 * 16 + i] = bf16::from_f32(-3e-39);
    }
    gate[5 * 16] = bf16::NAN;
    gate[5 * 16 + 1] = bf16::INFINITY;
    gate[5 * 16 + 2] = bf16::NEG_INFINITY;
    let wide = |v: &[bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
    let (gate32, up32, dy32) = (wide(&gate), wide(&up), wide(&dy));
    let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
    let rounded = |v: &[f32]| {
        v.iter()
            .map(|&x| bf16::from_f32(x).to_bits())
            .collect::<Vec<u16>>()
    };
    for isa in Isa::available() {
        for act in ACTS {
            let (mut y, mut y32) = (poisoned::<bf16>(n), poisoned::<f32>(n));
            with_isa(isa, || {
                glu::forward(act, &gate, &up, &mut y, &Serial);
                glu::forward(act, &gate32, &up32, &mut y32, &Serial);
            });
            assert_eq!(bits(&y), rounded(&y32), "{isa:?} {act:?} forward");
            let (mut dg, mut du) = (poisoned::<bf16>(n), poisoned::<bf16>(n));
            let (mut dg32, mut du32) = (poisoned::<f32>(n), poisoned::<f32>(n));
            with_isa(isa, || {
                glu::backward(act, &gate, &up, &dy, &mut dg, &mut du, &Serial);
                glu::backward(act, &gate32, &up32, &dy32, &mut dg32, &mut du32, &Serial);
            });
            assert_eq!(bits(&dg), rounded(&dg32), "{isa:?} {act:?} dgate");
            assert_eq!(bits(&du), rounded(&du32), "{isa:?} {act:?} dup");
            assert!(y32[3 * 16..4 * 16].iter().any(|v| v.is_subnormal()));
        }
    }
}

/// The in-place backward gives the out-of-place backward's gradients bit for bit (dtypes, ISAs,
/// activations, lengths with whole blocks, vectors and tails; several threads).
fn in_place_matches<T: TestFloat>()
where
    T::Acc: GluMath,
{
    let mut rng = Rng::new(21);
    for isa in Isa::available() {
        for act in ACTS {
            for n in LENS {
                let gate: Vec<T> = random(&mut rng, n, 2.0);
                let up: Vec<T> = random(&mut rng, n, 1.0);
                let dy: Vec<T> = random(&mut rng, n, 1.0);
                let (mut dg, mut du) = (poisoned::<T>(n), poisoned::<T>(n));
                let (mut g, mut u) = (gate.clone(), up.clone());
                with_isa(isa, || {
                    glu::backward(act, &gate, &up, &dy, &mut dg, &mut du, &Serial);
                    glu::backward_in_place(act, &mut g, &mut u, &dy, &Threads(3));
                });
                let bits = |v: &[T]| v.iter().map(|x| x.to_f64().to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&g), bits(&dg), "{isa:?} {act:?} n={n} dgate");
                assert_eq!(bits(&u), bits(&du), "{isa:?} {act:?} n={n} dup");
            }
        }
    }
}

#[test]
fn in_place_backward_matches() {
    in_place_matches::<f32>();
    in_place_matches::<f64>();
    in_place_matches::<bf16>();
    in_place_matches::<f16>();
}

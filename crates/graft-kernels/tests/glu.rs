//! SwiGLU / GeGLU forward and backward against f64 references, for every dtype, activation and
//! available ISA, over lengths that exercise whole unrolled blocks, single vectors and tails.

mod common;

use common::*;
use graft_kernels::ops::glu::{self, Activation, GluMath};
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
            // 0.5 (1 + tanh(u)) = s and 0.5 (1 - tanh(u)^2) = 2 s (1 - s) with s = sigmoid(2u),
            // 1 - s = sigmoid(-2u): `1 + tanh(u)` would cancel for u < 0 (2% off at u = -17).
            let k0 = (2.0 / std::f64::consts::PI).sqrt();
            let u = k0 * (x + 0.044715 * x * x * x);
            let (s, c) = (
                1.0 / (1.0 + (-2.0 * u).exp()),
                1.0 / (1.0 + (2.0 * u).exp()),
            );
            let du = k0 * (1.0 + 3.0 * 0.044715 * x * x);
            (x * s, s + 2.0 * x * s * c * du)
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

/// A 16-bit element type's spacing, for errors in its ulps.
trait Sixteen: TestFloat {
    /// Explicit significand bits.
    const FRACTION: i32;
    /// The smallest normal exponent.
    const MIN_EXP: i32;
    fn from_bits(bits: u16) -> Self;
    fn bits(self) -> u16;

    /// The spacing of `Self`'s values at magnitude `v` (the subnormal spacing below the normals).
    fn ulp(v: f64) -> f64 {
        let e = if v == 0.0 {
            Self::MIN_EXP
        } else {
            (v.abs().log2().floor() as i32).max(Self::MIN_EXP)
        };
        2f64.powi(e - Self::FRACTION)
    }
}

impl Sixteen for bf16 {
    const FRACTION: i32 = 7;
    const MIN_EXP: i32 = -126;
    fn from_bits(bits: u16) -> bf16 {
        bf16::from_bits(bits)
    }
    fn bits(self) -> u16 {
        self.to_bits()
    }
}

impl Sixteen for f16 {
    const FRACTION: i32 = 10;
    const MIN_EXP: i32 = -14;
    fn from_bits(bits: u16) -> f16 {
        f16::from_bits(bits)
    }
    fn bits(self) -> u16 {
        self.to_bits()
    }
}

/// `act'(x)` is a sum that cancels near its zeros; the magnitude of its largest term, against
/// which any `f32` evaluation's error is measured there (a few `f32` ulp of the terms, which is
/// far below one 16-bit ulp of the terms but many of the cancelled result).
fn derivative_terms(act: Activation, x: f64) -> f64 {
    if x == 0.0 {
        return act_ref(act, x).1;
    }
    match act {
        Activation::Silu => {
            let s = 1.0 / (1.0 + (-x).exp());
            s.max((x * s * (1.0 - s)).abs())
        }
        Activation::GeluTanh => {
            let (f, df) = act_ref(act, x);
            (f / x).abs().max((df - f / x).abs())
        }
        Activation::GeluErf => {
            let cdf = 0.5 * libm::erfc(-x / std::f64::consts::SQRT_2);
            let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
            cdf.max((x * pdf).abs())
        }
    }
}

/// The distance from `got` to `want` in ulps of `T` at `max(|want|, floor)`; 0 when both are
/// the same NaN or infinity, infinite when only one is.
fn ulps<T: Sixteen>(got: T, want: f64, floor: f64) -> f64 {
    let g = got.to_f64();
    if want.is_nan() || want.is_infinite() || g.is_nan() || g.is_infinite() {
        let same = (want.is_nan() && g.is_nan()) || g == want;
        return if same { 0.0 } else { f64::INFINITY };
    }
    (g - want).abs() / T::ulp(want.abs().max(floor))
}

/// What [`sixteen_bit_accuracy`] measured for one activation, over every ISA.
#[derive(Default)]
struct Accuracy {
    act: Option<Activation>,
    /// The worst error of the 16-bit kernels, in ulps of the 16-bit type.
    short: f64,
    /// The worst error of the full `f32` math rounded to the 16-bit type (the former results).
    full: f64,
    /// Outputs that differ from the full math's, of all outputs.
    changed: usize,
    outputs: usize,
}

impl std::fmt::Display for Accuracy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?}: worst {:.4} ulp from float64 (full f32 math: {:.4}); {} of {} outputs differ \
             from the full math's, by 1 ulp",
            self.act.expect("set"),
            self.short,
            self.full,
            self.changed,
            self.outputs
        )
    }
}

/// The worst error of the 16-bit kernels over every value of `T` in `[-200, 200]` (and the
/// infinities and NaN) as the gate, `up = dy = 1`: each output is the activation or its
/// derivative rounded once. Against float64, in ulps of `T` (at the derivative's largest term
/// where it cancels, see [`derivative_terms`]), and against the full-accuracy `f32` math
/// rounded to `T` (the `f32` kernels' results: what the 16-bit kernels returned before they
/// used the shorter math); every ISA, and AVX-512 and AVX2 bit-identical (NaN payloads aside:
/// the gates include every NaN of `T`, and the ISAs propagate different ones).
fn sixteen_bit_accuracy<T: Sixteen>() -> Vec<Accuracy>
where
    T::Acc: GluMath,
{
    let gate: Vec<T> = (0..=u16::MAX)
        .map(T::from_bits)
        .filter(|v| v.to_f64().is_nan() || v.to_f64().abs() <= 200.0 || v.to_f64().is_infinite())
        .collect();
    let n = gate.len();
    let ones = vec![T::from_f64(1.0); n];
    let gate32: Vec<f32> = gate.iter().map(|v| v.to_f64() as f32).collect();
    let ones32 = vec![1.0f32; n];
    let mut worst = vec![];
    for act in ACTS {
        let mut x86_bits: Option<Vec<u16>> = None;
        let mut acc = Accuracy {
            act: Some(act),
            ..Accuracy::default()
        };
        for isa in Isa::available() {
            let (mut y, mut dg, mut du) = (poisoned::<T>(n), poisoned::<T>(n), poisoned::<T>(n));
            let (mut y32, mut dg32, mut du32) =
                (poisoned::<f32>(n), poisoned::<f32>(n), poisoned::<f32>(n));
            with_isa(isa, || {
                glu::forward(act, &gate, &ones, &mut y, &Serial);
                glu::backward(act, &gate, &ones, &ones, &mut dg, &mut du, &Serial);
                glu::forward(act, &gate32, &ones32, &mut y32, &Serial);
                glu::backward(
                    act, &gate32, &ones32, &ones32, &mut dg32, &mut du32, &Serial,
                );
            });
            for i in 0..n {
                let x = gate[i].to_f64();
                let (f, df) = act_ref(act, x);
                let terms = if x.is_finite() {
                    derivative_terms(act, x)
                } else {
                    0.0
                };
                let ctx = || format!("{} {isa:?} {act:?} gate {x}", T::NAME);
                for (got, want, full, floor) in [
                    (y[i], f, y32[i], 0.0),
                    (du[i], f, du32[i], 0.0),
                    (dg[i], df, dg32[i], terms),
                ] {
                    let e = ulps(got, want, floor);
                    assert!(e <= 1.0, "{}: {e} ulp from float64 {want}", ctx());
                    let full = T::from_f64(full as f64);
                    let d = ulps(got, full.to_f64(), floor.max(want.abs()));
                    assert!(d <= 1.0, "{}: {d} ulp from the f32 math's {full:?}", ctx());
                    acc.short = acc.short.max(e);
                    acc.full = acc.full.max(ulps(full, want, floor));
                    acc.changed += usize::from(d > 0.0);
                    acc.outputs += 1;
                }
            }
            if matches!(isa, Isa::Avx512 | Isa::Avx2) {
                let bits: Vec<u16> = [&y, &dg, &du]
                    .iter()
                    .flat_map(|v| {
                        v.iter()
                            .map(|x| if x.to_f64().is_nan() { 0 } else { x.bits() })
                    })
                    .collect();
                match &x86_bits {
                    None => x86_bits = Some(bits),
                    Some(first) => {
                        let at = first.iter().zip(&bits).position(|(a, b)| a != b);
                        assert!(
                            at.is_none(),
                            "{} {act:?}: AVX-512 and AVX2 differ at output {at:?} (gate {})",
                            T::NAME,
                            at.map_or(0.0, |i| gate[i % n].to_f64())
                        )
                    }
                }
            }
        }
        worst.push(acc);
    }
    worst
}

#[test]
fn bf16_outputs_are_within_an_ulp() {
    for acc in sixteen_bit_accuracy::<bf16>() {
        eprintln!("bf16 {acc}");
    }
}

#[test]
fn f16_outputs_are_within_an_ulp() {
    for acc in sixteen_bit_accuracy::<f16>() {
        eprintln!("f16 {acc}");
    }
}

/// bf16 outputs are rounded once (nearest even, NaN quieted, the subnormals kept) on every ISA:
/// with AVX512-BF16, vectors round with `vcvtneps2bf16` unless a lane is subnormal (the
/// instruction flushes those) and fall back to integer rounding then. AVX-512 and AVX2 (integer
/// rounding) compute the same `f32` values, so their outputs agree bit for bit; every output is
/// within an ulp of float64 (subnormal ones in ulps of the subnormal spacing).
/// One ISA's bf16 outputs: `(isa, y, dgate, dup)`.
type Bf16Outputs = (Isa, Vec<bf16>, Vec<bf16>, Vec<bf16>);

/// bf16 forward and backward on every ISA: each output within an ulp of float64 (the gate's
/// gradient against the size of its derivative's terms), and AVX-512 and AVX2 bit for bit
/// (`nan_as_zero`: NaN outputs compared as NaN, whatever their payload). Returns each ISA's
/// `(y, dgate, dup)` for the caller's own checks; `what` names the case in messages.
fn bf16_on_every_isa(
    act: Activation,
    gate: &[bf16],
    up: &[bf16],
    dy: &[bf16],
    nan_as_zero: bool,
    what: &str,
) -> Vec<Bf16Outputs> {
    let n = gate.len();
    let bits = |v: &[bf16]| {
        v.iter()
            .map(|x| {
                if nan_as_zero && x.is_nan() {
                    0
                } else {
                    x.to_bits()
                }
            })
            .collect::<Vec<u16>>()
    };
    let mut x86: Option<Vec<Vec<u16>>> = None;
    let mut out = Vec::new();
    for isa in Isa::available() {
        let (mut y, mut dg, mut du) = (
            poisoned::<bf16>(n),
            poisoned::<bf16>(n),
            poisoned::<bf16>(n),
        );
        with_isa(isa, || {
            glu::forward(act, gate, up, &mut y, &Serial);
            glu::backward(act, gate, up, dy, &mut dg, &mut du, &Serial);
        });
        for i in 0..n {
            let (x, u, d) = (gate[i].to_f64(), up[i].to_f64(), dy[i].to_f64());
            let (f, df) = act_ref(act, x);
            let terms = if x.is_finite() {
                derivative_terms(act, x)
            } else {
                0.0
            };
            let ctx = format!("{isa:?} {act:?} {what} i={i} gate {x} up {u} dy {d}");
            assert!(ulps(y[i], f * u, 0.0) <= 1.0, "y: {} ({ctx})", y[i]);
            assert!(ulps(du[i], f * d, 0.0) <= 1.0, "dup: {} ({ctx})", du[i]);
            let floor = (terms * u * d).abs();
            assert!(
                ulps(dg[i], df * u * d, floor) <= 1.0,
                "dgate: {} ({ctx})",
                dg[i]
            );
        }
        if matches!(isa, Isa::Avx512 | Isa::Avx2) {
            let got = vec![bits(&y), bits(&dg), bits(&du)];
            match &x86 {
                None => x86 = Some(got),
                Some(first) => assert!(*first == got, "{act:?} {what}: AVX-512 and AVX2 differ"),
            }
        }
        out.push((isa, y, dg, du));
    }
    out
}

#[test]
fn bf16_outputs_round_once() {
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
    for act in ACTS {
        for (_, y, _, _) in bf16_on_every_isa(act, &gate, &up, &dy, false, &format!("n={n}")) {
            assert!(y[3 * 16..4 * 16].iter().any(|v| v.to_f32().is_subnormal()));
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

/// Interleaved bf16 pairs (AVX-512 with AVX512-BF16 loads 32 elements at once, computes the even
/// and the odd ones in two vectors and interleaves them again when storing): one element with a
/// subnormal output, a NaN or an infinite gate at an even or an odd position of a pair, at the
/// start, middle and end of a block of 64, and lengths ending inside a pair, a block and a
/// vector. Outputs are within an ulp of float64 and bit-identical between AVX-512 and AVX2 (which
/// loads in order); the subnormal element makes its pair round in integer arithmetic.
#[test]
fn bf16_pairs_keep_element_order() {
    let mut rng = Rng::new(31);
    for n in [32, 33, 47, 63, 64, 65, 95, 96, 127, 128, 129, 64 * 5 + 31] {
        for at in [0, 1, 14, 17, 30, 31, 32, 33, 62, 63] {
            let at = at % n;
            for special in 0..4 {
                let mut gate: Vec<bf16> = random(&mut rng, n, 2.0);
                let mut up: Vec<bf16> = random(&mut rng, n, 1.0);
                let dy: Vec<bf16> = random(&mut rng, n, 1.0);
                match special {
                    0 => (gate[at], up[at]) = (bf16::ONE, bf16::from_f32(-2e-39)),
                    1 => gate[at] = bf16::NAN,
                    2 => gate[at] = bf16::INFINITY,
                    _ => gate[at] = bf16::NEG_INFINITY,
                }
                for act in ACTS {
                    let what = format!("n={n} at={at}");
                    for (_, y, _, _) in bf16_on_every_isa(act, &gate, &up, &dy, true, &what) {
                        if special == 0 {
                            assert!(y[at].to_f32().is_subnormal() || y[at].to_f32() == 0.0);
                        }
                    }
                }
            }
        }
    }
}

/// Several threads give the single thread's results bit for bit, at lengths around the
/// parallel split (64 Ki elements a task, 8 Ki a chunk) and odd ones, and within a bf16 ulp
/// of float64 (the chunks' tails end inside interleaved pairs and blocks).
#[test]
fn threads_match_serial_around_the_split() {
    let mut rng = Rng::new(41);
    let lens = [
        8191,
        8192,
        8193,
        65535,
        65536,
        65537,
        2 * 65536 + 1,
        3 * 65536 - 7,
    ];
    for isa in Isa::available() {
        for act in [Activation::Silu, Activation::GeluErf] {
            for n in lens {
                let gate: Vec<bf16> = random(&mut rng, n, 3.0);
                let up: Vec<bf16> = random(&mut rng, n, 1.0);
                let dy: Vec<bf16> = random(&mut rng, n, 1.0);
                let run = |par: &dyn graft_kernels::Parallel| {
                    let (mut y, mut dg, mut du) = (
                        poisoned::<bf16>(n),
                        poisoned::<bf16>(n),
                        poisoned::<bf16>(n),
                    );
                    with_isa(isa, || {
                        glu::forward(act, &gate, &up, &mut y, par);
                        glu::backward(act, &gate, &up, &dy, &mut dg, &mut du, par);
                    });
                    [y, dg, du].map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>())
                };
                let serial = run(&Serial);
                for threads in [2, 3] {
                    let got = run(&Threads(threads));
                    assert!(
                        got == serial,
                        "{isa:?} {act:?} n={n}: {threads} threads differ"
                    );
                }
                let y: Vec<f64> = serial[0]
                    .iter()
                    .map(|&b| bf16::from_bits(b).to_f64())
                    .collect();
                let want: Vec<f64> = (0..n)
                    .map(|i| act_ref(act, gate[i].to_f64()).0 * up[i].to_f64())
                    .collect();
                assert_close(
                    &y,
                    &want,
                    tol::<bf16>(),
                    "y",
                    &format!("{isa:?} {act:?} n={n}"),
                );
            }
        }
    }
}

/// Packed rows `[gate | up]` of `cols` each: the forward, the backward (into a packed
/// gradient) and the in-place backward against float64, for every dtype, activation and ISA;
/// each bit for bit equal to the flat kernels over the rows' halves (the same span code), and
/// several threads (and a `Parallel` that runs the items in reverse) equal to one.
fn packed_matches<T: TestFloat>()
where
    T::Acc: GluMath,
{
    let mut rng = Rng::new(51);
    // Columns below, at and past a vector, not multiples of the vector width, and a row
    // longer than a work item's worth of elements (8 Ki); rows around a work item's.
    let shapes = [
        (0, 5),
        (1, 1),
        (3, 1),
        (5, 7),
        (4, 16),
        (33, 17),
        (2, 64),
        (7, 100),
        (3, 768),
        (11, 768),
        (2, 8195),
        (1025, 9),
    ];
    let bits = |v: &[T]| v.iter().map(|x| x.to_f64().to_bits()).collect::<Vec<_>>();
    for isa in Isa::available() {
        for act in ACTS {
            for (rows, cols) in shapes {
                let ctx = format!("{} {isa:?} {act:?} rows={rows} cols={cols}", T::NAME);
                let gate_up = random::<T>(&mut rng, rows * 2 * cols, 3.0);
                let dy = random::<T>(&mut rng, rows * cols, 1.0);
                let (mut y, mut dgu) = (poisoned::<T>(rows * cols), poisoned::<T>(2 * rows * cols));
                let mut in_place = gate_up.clone();
                let (mut y_rev, mut dgu_rev) = (y.clone(), dgu.clone());
                // The halves as separate buffers, for the flat kernels.
                let (mut gate, mut up) = (vec![], vec![]);
                for row in gate_up.chunks_exact(2 * cols.max(1)) {
                    gate.extend_from_slice(&row[..cols]);
                    up.extend_from_slice(&row[cols..]);
                }
                let (mut y_flat, mut dg, mut du) = (
                    poisoned::<T>(rows * cols),
                    poisoned::<T>(rows * cols),
                    poisoned::<T>(rows * cols),
                );
                with_isa(isa, || {
                    glu::forward_packed(act, cols, &gate_up, &mut y, &Threads(3));
                    glu::backward_packed(act, cols, &gate_up, &dy, &mut dgu, &Threads(2));
                    glu::backward_packed_in_place(act, cols, &mut in_place, &dy, &Threads(3));
                    glu::forward_packed(act, cols, &gate_up, &mut y_rev, &ReverseChunks);
                    glu::backward_packed(act, cols, &gate_up, &dy, &mut dgu_rev, &ReverseChunks);
                    glu::forward(act, &gate, &up, &mut y_flat, &Serial);
                    glu::backward(act, &gate, &up, &dy, &mut dg, &mut du, &Serial);
                });
                let (mut y_ref, mut dgu_ref, mut dgu_flat) = (vec![], vec![], vec![]);
                for r in 0..rows {
                    let at = r * cols..(r + 1) * cols;
                    for j in 0..cols {
                        let (g, u) = (gate[r * cols + j].to_f64(), up[r * cols + j].to_f64());
                        let (f, _) = act_ref(act, g);
                        y_ref.push(f * u);
                    }
                    for j in 0..cols {
                        let (g, u) = (gate[r * cols + j].to_f64(), up[r * cols + j].to_f64());
                        dgu_ref.push(dy[r * cols + j].to_f64() * u * act_ref(act, g).1);
                    }
                    for j in 0..cols {
                        let g = gate[r * cols + j].to_f64();
                        dgu_ref.push(dy[r * cols + j].to_f64() * act_ref(act, g).0);
                    }
                    dgu_flat.extend_from_slice(&dg[at.clone()]);
                    dgu_flat.extend_from_slice(&du[at]);
                }
                // Against a floor of 1e-2 a element: a lone output far in the activation's
                // tail (gate -8) underflows in f16, which a relative norm of one element sees.
                let floor = 1e-2 * ((rows * cols) as f64).sqrt();
                let (y64, dgu64) = (to_f64(&y), to_f64(&dgu));
                assert_close_scaled(&y64, &y_ref, floor, tol::<T>(), "y", &ctx);
                // dgate and dup side by side: dgate's rounding (2 tol) bounds the pair's.
                let tol2 = 2.0 * tol::<T>();
                assert_close_scaled(&dgu64, &dgu_ref, floor, tol2, "d_gate_up", &ctx);
                assert_eq!(
                    bits(&y),
                    bits(&y_flat),
                    "{ctx}: y differs from the flat kernel"
                );
                assert_eq!(
                    bits(&dgu),
                    bits(&dgu_flat),
                    "{ctx}: grad differs from the flat kernel"
                );
                assert_eq!(bits(&in_place), bits(&dgu), "{ctx}: in-place differs");
                assert_eq!(bits(&y_rev), bits(&y), "{ctx}: y differs in reverse order");
                assert_eq!(
                    bits(&dgu_rev),
                    bits(&dgu),
                    "{ctx}: grad differs in reverse order"
                );
            }
        }
    }
}

#[test]
fn packed_rows_match_float64_and_the_flat_kernels() {
    packed_matches::<f32>();
    packed_matches::<f64>();
    packed_matches::<bf16>();
    packed_matches::<f16>();
}

#[test]
#[should_panic(expected = "not rows of 2 * 4")]
fn packed_rows_must_be_whole() {
    let mut y = vec![0.0f32; 4];
    glu::forward_packed(Activation::Silu, 4, &[0.0f32; 9], &mut y, &Serial);
}

#[test]
#[should_panic(expected = "dy has 3 elements, expected 1 rows of 4")]
fn packed_gradient_must_match_the_rows() {
    let mut gu = vec![0.0f32; 8];
    glu::backward_packed_in_place(Activation::Silu, 4, &mut gu, &[0.0f32; 3], &Serial);
}

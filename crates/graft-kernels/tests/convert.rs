//! Conversions between element types and their accumulation types, bit for bit against the
//! `half` crate (whose rounding of finite values and infinities is PyTorch's), for the scalar
//! `Float` methods and the vectorized slice conversions of every available ISA.

mod common;

use common::Rng;
use graft_kernels::ops::convert;
use graft_kernels::{with_isa, Float, Isa};
use half::{bf16, f16};

/// Every 16-bit pattern, widened: `Float::to_acc` and `convert::to_acc` against `half`.
#[test]
fn half_to_f32_is_exact_for_all_bit_patterns() {
    let bf: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
    let hf: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let bf_want: Vec<u32> = bf.iter().map(|v| v.to_f32().to_bits()).collect();
    let hf_want: Vec<u32> = hf.iter().map(|v| v.to_f32().to_bits()).collect();
    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();

    let scalar: Vec<f32> = bf.iter().map(|v| v.to_acc()).collect();
    assert_eq!(bits(&scalar), bf_want, "bf16 Float::to_acc");
    let scalar: Vec<f32> = hf.iter().map(|v| v.to_acc()).collect();
    assert_eq!(bits(&scalar), hf_want, "f16 Float::to_acc");

    for isa in Isa::available() {
        with_isa(isa, || {
            assert_eq!(bits(&convert::to_acc_vec(&bf)), bf_want, "bf16 {isa:?}");
            assert_eq!(bits(&convert::to_acc_vec(&hf)), hf_want, "f16 {isa:?}");
            // Every tail length and misalignment.
            for start in 0..17 {
                for len in 0..40 {
                    let range = start * 977..start * 977 + len;
                    let got = convert::to_acc_vec(&bf[range.clone()]);
                    assert_eq!(bits(&got), bf_want[range.clone()], "bf16 {isa:?} {range:?}");
                    let got = convert::to_acc_vec(&hf[range.clone()]);
                    assert_eq!(bits(&got), hf_want[range.clone()], "f16 {isa:?} {range:?}");
                }
            }
        });
    }
}

/// f32 values that probe rounding: specials, subnormals, ties, overflow edges, random bits.
fn f32_samples() -> Vec<f32> {
    let mut bits: Vec<u32> = vec![
        0x0000_0000, // +0
        0x8000_0000, // -0
        0x7f80_0000, // +inf
        0xff80_0000, // -inf
        0x7fc0_0000, // quiet NaN
        0xffc0_0000, // negative quiet NaN
        0x7f80_0001, // signaling NaN, payload only in the low bits
        0xff80_0001,
        0x7fbf_ffff, // signaling NaN, full payload
        0x7fff_ffff, // quiet NaN, full payload
        0x0000_0001, // smallest subnormal
        0x807f_ffff, // largest negative subnormal
        0x0080_0000, // smallest normal
        0x7f7f_ffff, // largest finite: rounds to inf in bf16
        0x7f7f_7fff, // just below the bf16 overflow tie
        0x7f7f_8000, // bf16 overflow tie (odd lsb: rounds up to inf)
        0x477f_e000, // 65504 (f16 max)
        0x477f_efff, // just below the f16 overflow tie
        0x477f_f000, // 65520: f16 overflow tie (rounds to inf)
        0x3380_0000, // 2^-24: smallest f16 subnormal
        0x3300_0000, // 2^-25: f16 tie between 0 and the smallest subnormal (rounds to 0)
        0x3300_0001, // just above: rounds to the smallest subnormal
        0x387f_c000, // f16 subnormal/normal boundary region
    ];
    // bf16 ties (low half exactly 0x8000) with even and odd kept bits, and their neighbours.
    for high in [
        0x3f80u32, 0x3f81, 0xbf80, 0xbf81, 0x0001, 0x0002, 0x7f00, 0x4049,
    ] {
        for low in [0x7fff, 0x8000, 0x8001] {
            bits.push(high << 16 | low);
        }
    }
    // f16 ties: 13 dropped mantissa bits exactly 0x1000, normal and subnormal f16 ranges.
    for base in [
        0x3f80_0000u32,
        0x3f80_2000,
        0x4200_0000,
        0x3880_0000,
        0x3400_0000,
        0x3500_2000,
    ] {
        for delta in [0x0fffu32, 0x1000, 0x1001] {
            bits.push(base | delta);
            bits.push((base | delta) | 0x8000_0000);
        }
    }
    // Random bit patterns (all exponents), and random values in the f16 range.
    let mut rng = Rng::new(0x5eed);
    for _ in 0..1 << 20 {
        bits.push(rng.next_u64() as u32);
    }
    for _ in 0..1 << 18 {
        let v = (rng.uniform() * 70000.0 * rng.uniform().powi(6)) as f32;
        bits.push(v.to_bits());
    }
    bits.into_iter().map(f32::from_bits).collect()
}

/// f32 narrowed: `Float::from_acc` and `convert::from_acc` against `half`'s `from_f32`.
#[test]
fn f32_to_half_rounds_like_half() {
    let samples = f32_samples();
    let bf_want: Vec<u16> = samples
        .iter()
        .map(|&v| bf16::from_f32(v).to_bits())
        .collect();
    let hf_want: Vec<u16> = samples
        .iter()
        .map(|&v| f16::from_f32(v).to_bits())
        .collect();

    let scalar: Vec<u16> = samples
        .iter()
        .map(|&v| bf16::from_acc(v).to_bits())
        .collect();
    assert_eq!(scalar, bf_want, "bf16 Float::from_acc");
    let scalar: Vec<u16> = samples
        .iter()
        .map(|&v| f16::from_acc(v).to_bits())
        .collect();
    assert_eq!(scalar, hf_want, "f16 Float::from_acc");

    for isa in Isa::available() {
        with_isa(isa, || {
            let got: Vec<bf16> = convert::from_acc_vec(&samples);
            for (i, (g, w)) in got.iter().zip(&bf_want).enumerate() {
                let x = samples[i].to_bits();
                assert_eq!(g.to_bits(), *w, "bf16 {isa:?} from {x:#010x}");
            }
            let got: Vec<f16> = convert::from_acc_vec(&samples);
            for (i, (g, w)) in got.iter().zip(&hf_want).enumerate() {
                let x = samples[i].to_bits();
                assert_eq!(g.to_bits(), *w, "f16 {isa:?} from {x:#010x}");
            }
            // Every tail length and misalignment.
            for start in 0..17 {
                for len in 0..40 {
                    let range = start * 13..start * 13 + len;
                    let got: Vec<bf16> = convert::from_acc_vec(&samples[range.clone()]);
                    let got: Vec<u16> = got.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, bf_want[range.clone()], "bf16 {isa:?} {range:?}");
                }
            }
        });
    }
}

/// The known values the `half` reference itself must give (an independent spot check).
#[test]
fn known_roundings() {
    let cases: [(u32, u16, u16); 8] = [
        (0x3f80_8000, 0x3f80, 0x3c04), // 1 + 2^-8: bf16 tie to even (down)
        (0x3f81_8000, 0x3f82, 0x3c0c), // bf16 tie to even (up)
        (0x3f80_1000, 0x3f80, 0x3c00), // 1 + 2^-11: f16 tie to even (down)
        (0x3f80_3000, 0x3f80, 0x3c02), // f16 tie to even (up)
        (0x7f7f_ffff, 0x7f80, 0x7c00), // f32 max: inf in both
        (0x477f_f000, 0x4780, 0x7c00), // 65520: inf in f16
        (0x0000_0001, 0x0000, 0x0000), // f32 subnormal: zero in f16; bf16 rounds down to 0
        (0x7fc0_0000, 0x7fc0, 0x7e00), // NaN stays NaN
    ];
    for (x, bf, hf) in cases {
        let v = f32::from_bits(x);
        assert_eq!(bf16::from_acc(v).to_bits(), bf, "bf16 from {x:#010x}");
        assert_eq!(f16::from_acc(v).to_bits(), hf, "f16 from {x:#010x}");
        for isa in Isa::available() {
            with_isa(isa, || {
                let got: Vec<bf16> = convert::from_acc_vec(&[v; 19]);
                assert!(
                    got.iter().all(|g| g.to_bits() == bf),
                    "bf16 {isa:?} {x:#010x}"
                );
                let got: Vec<f16> = convert::from_acc_vec(&[v; 19]);
                assert!(
                    got.iter().all(|g| g.to_bits() == hf),
                    "f16 {isa:?} {x:#010x}"
                );
            });
        }
    }
}

/// f32 and f64 are their own accumulation types: conversion keeps every bit (NaNs too).
#[test]
fn f32_and_f64_convert_to_themselves() {
    let samples = f32_samples();
    let wide: Vec<f64> = samples
        .iter()
        .map(|&v| f64::from_bits(v.to_bits() as u64 * 0x1_0001))
        .collect();
    for isa in Isa::available() {
        with_isa(isa, || {
            let got = convert::to_acc_vec(&samples);
            assert!(
                got.iter()
                    .zip(&samples)
                    .all(|(g, s)| g.to_bits() == s.to_bits()),
                "{isa:?}"
            );
            let got: Vec<f32> = convert::from_acc_vec(&samples);
            assert!(
                got.iter()
                    .zip(&samples)
                    .all(|(g, s)| g.to_bits() == s.to_bits()),
                "{isa:?}"
            );
            let got = convert::to_acc_vec(&wide);
            assert!(
                got.iter()
                    .zip(&wide)
                    .all(|(g, s)| g.to_bits() == s.to_bits()),
                "{isa:?}"
            );
        });
    }
}

#[test]
#[should_panic(expected = "convert::from_acc: `src` has 3 elements but `dst` has 2")]
fn mismatched_lengths_panic() {
    let mut dst = [bf16::ZERO; 2];
    convert::from_acc(&[1.0f32; 3], &mut dst);
}

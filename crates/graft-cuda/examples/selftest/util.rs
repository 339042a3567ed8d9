//! Random numbers, dtype encoding and error measures.

use super::*;

/// splitmix64.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub(super) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// |v| in [0.25, 2), random sign: never zero.
    pub(super) fn signed(&mut self) -> f64 {
        let m = 0.25 + 1.75 * self.unit();
        if self.next_u64() & 1 == 0 {
            m
        } else {
            -m
        }
    }
}

pub(super) fn encode(dtype: DType, v: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * dtype.size());
    for &x in v {
        match dtype {
            DType::F32 => out.extend_from_slice(&(x as f32).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&x.to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f64(x).to_bits().to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f64(x).to_bits().to_le_bytes()),
        }
    }
    out
}

pub(super) fn decode(dtype: DType, b: &[u8]) -> Vec<f64> {
    b.chunks_exact(dtype.size())
        .map(|c| match dtype {
            DType::F32 => f64::from(f32::from_le_bytes(c.try_into().unwrap())),
            DType::F64 => f64::from_le_bytes(c.try_into().unwrap()),
            DType::F16 => f16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f64(),
            DType::BF16 => bf16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f64(),
        })
        .collect()
}

/// Values rounded to `dtype` (so the reference sees exactly what the kernel reads).
pub(super) fn rounded(dtype: DType, v: Vec<f64>) -> Vec<f64> {
    decode(dtype, &encode(dtype, &v))
}

/// One quiet NaN of `dtype`.
pub(super) fn nan_bytes(dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => 0x7FC0_0000u32.to_le_bytes().to_vec(),
        DType::F64 => 0x7FF8_0000_0000_0000u64.to_le_bytes().to_vec(),
        DType::F16 => 0x7E00u16.to_le_bytes().to_vec(),
        DType::BF16 => 0x7FC0u16.to_le_bytes().to_vec(),
    }
}

/// ||out - ref|| / max(||ref||, scale) over the finite reference values; infinite when a
/// non-finite reference value is not matched (NaN by NaN, +-Inf by the same Inf) or `out`
/// has a non-finite value where the reference is finite. `scale` is the size the output
/// has when its terms do not cancel (dx: ||rstd * g||; dw: the typical size of a sum of
/// random-sign terms): where they do cancel (cols == 1: dx ~ eps; a dw column summing to
/// nearly 0) the relative error grows in any precision, and is measured against that size
/// instead. For ordinary data ||ref|| is about `scale` and this is the plain relative
/// error. 0: plain relative error.
pub(super) fn rel_err(out: &[f64], reference: &[f64], scale: f64) -> f64 {
    assert_eq!(out.len(), reference.len());
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&o, &r) in out.iter().zip(reference) {
        if r.is_nan() {
            if !o.is_nan() {
                return f64::INFINITY;
            }
        } else if r.is_infinite() {
            if o != r {
                return f64::INFINITY;
            }
        } else if !o.is_finite() {
            return f64::INFINITY;
        } else {
            num += (o - r) * (o - r);
            den += r * r;
        }
    }
    let den = den.sqrt().max(scale);
    if den == 0.0 {
        num.sqrt()
    } else {
        num.sqrt() / den
    }
}

/// Relative-norm tolerance for outputs of `dtype`.
pub(super) fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-6,
        DType::F16 => 2e-3,
        DType::BF16 => 1e-2,
    }
}

pub(super) fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F64 => "f64",
    }
}

// ---------------------------------------------------------------------------------------
// The float64 reference (threads over row blocks).

pub(super) fn threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get())
}

//! The element types the kernels take.

/// Element type of `x`, `y`, `dy` and `dx`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// `float32`.
    F32,
    /// `float16`.
    F16,
    /// `bfloat16`.
    BF16,
    /// `float64`.
    F64,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
            DType::F64 => 8,
        }
    }

    /// The accumulation dtype (of `rstd`, of an `Acc` weight and of its dw): f32, or f64
    /// for F64.
    pub const fn acc(self) -> DType {
        match self {
            DType::F64 => DType::F64,
            _ => DType::F32,
        }
    }
}

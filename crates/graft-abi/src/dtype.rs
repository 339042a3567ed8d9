//! Scalar types and devices as the stable ABI encodes them.

use std::fmt;

/// A tensor's scalar type: the `c10::ScalarType` code that the stable ABI passes around.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DType(pub i32);

impl DType {
    pub const U8: DType = DType(0);
    pub const I8: DType = DType(1);
    pub const I16: DType = DType(2);
    pub const I32: DType = DType(3);
    pub const I64: DType = DType(4);
    pub const F16: DType = DType(5);
    pub const F32: DType = DType(6);
    pub const F64: DType = DType(7);
    pub const COMPLEX32: DType = DType(8);
    pub const COMPLEX64: DType = DType(9);
    pub const COMPLEX128: DType = DType(10);
    pub const BOOL: DType = DType(11);
    pub const BF16: DType = DType(15);

    /// The name c10 gives the type in messages ("Float", "BFloat16", "Long", ...).
    pub fn name(self) -> &'static str {
        // c10::ScalarType, in code order (torch/headeronly/core/ScalarType.h).
        const NAMES: [&str; 46] = [
            "Byte",
            "Char",
            "Short",
            "Int",
            "Long",
            "Half",
            "Float",
            "Double",
            "ComplexHalf",
            "ComplexFloat",
            "ComplexDouble",
            "Bool",
            "QInt8",
            "QUInt8",
            "QInt32",
            "BFloat16",
            "QUInt4x2",
            "QUInt2x4",
            "Bits1x8",
            "Bits2x4",
            "Bits4x2",
            "Bits8",
            "Bits16",
            "Float8_e5m2",
            "Float8_e4m3fn",
            "Float8_e5m2fnuz",
            "Float8_e4m3fnuz",
            "UInt16",
            "UInt32",
            "UInt64",
            "UInt1",
            "UInt2",
            "UInt3",
            "UInt4",
            "UInt5",
            "UInt6",
            "UInt7",
            "Int1",
            "Int2",
            "Int3",
            "Int4",
            "Int5",
            "Int6",
            "Int7",
            "Float8_e8m0fnu",
            "Float4_e2m1fn_x2",
        ];
        usize::try_from(self.0)
            .ok()
            .and_then(|i| NAMES.get(i))
            .copied()
            .unwrap_or("(other dtype)")
    }

    /// Whether this is one of the real floating-point types kernels compute in.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::F32 | DType::F64 | DType::BF16)
    }

    /// Size of one element in bytes, for the byte-sized and wider types (not the quantized,
    /// bit and sub-byte ones).
    pub fn size(self) -> Option<usize> {
        match self.0 {
            // Byte, Char, Bool, the float8 types.
            0 | 1 | 11 | 23..=26 | 44 => Some(1),
            // Short, Half, BFloat16, UInt16.
            2 | 5 | 15 | 27 => Some(2),
            // Int, Float, ComplexHalf, UInt32.
            3 | 6 | 8 | 28 => Some(4),
            // Long, Double, ComplexFloat, UInt64.
            4 | 7 | 9 | 29 => Some(8),
            10 => Some(16),
            _ => None,
        }
    }
}

impl fmt::Debug for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Rust element types with a torch dtype: what a tensor's data may be viewed as.
pub trait Element: Copy + Send + Sync + 'static {
    /// The matching dtype.
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}

/// A device type code (`c10::DeviceType`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct DeviceType(pub i32);

impl DeviceType {
    pub const CPU: DeviceType = DeviceType(0);
    pub const CUDA: DeviceType = DeviceType(1);
    pub const META: DeviceType = DeviceType(14);

    /// The name torch prints ("cpu", "cuda", ...).
    pub fn name(self) -> &'static str {
        match self {
            DeviceType::CPU => "cpu",
            DeviceType::CUDA => "cuda",
            DeviceType::META => "meta",
            _ => "(other device)",
        }
    }
}

/// A device: type and index (-1 for "current"/none).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Device {
    pub kind: DeviceType,
    pub index: i32,
}

impl Device {
    /// The CPU.
    pub const CPU: Device = Device {
        kind: DeviceType::CPU,
        index: -1,
    };
    /// The meta device (shapes only).
    pub const META: Device = Device {
        kind: DeviceType::META,
        index: -1,
    };
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.index >= 0 {
            write!(f, "{}:{}", self.kind.name(), self.index)
        } else {
            f.write_str(self.kind.name())
        }
    }
}

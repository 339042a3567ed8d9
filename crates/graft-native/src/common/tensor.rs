//! Tensor helpers shared by the grafts and the ops: copies, conversions, filled tensors, dtype
//! rules and ATen's "not implemented" message.

use graft_abi::{contiguous_strides, dispatch, DType, Device, NewTensor, Result, Tensor};

/// The dtype a float op accumulates in (and returns its statistics in): float64 for float64,
/// else float32.
pub fn acc_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// A contiguous tensor with `t`'s values: `t` itself when it already is one.
pub fn contiguous(t: &Tensor) -> Result<Tensor> {
    if t.is_contiguous()? {
        return t.new_ref();
    }
    let sizes = t.sizes()?;
    let out = Tensor::empty_strided(sizes, &contiguous_strides(sizes), t.dtype()?, t.device()?)?;
    out.copy_from(t)?;
    Ok(out)
}

/// `t` converted to `dtype` (a copy through `aten::_to_copy`; `t` itself when it has it).
pub fn to_dtype(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype()? == dtype {
        return t.new_ref();
    }
    let none = None::<i64>;
    let (out,): (Tensor,) = dispatch::call(
        c"aten::_to_copy",
        c"",
        (t, Some(dtype), none, none, None::<bool>, false, none),
    )?;
    Ok(out)
}

/// A tensor of `sizes` on `device` holding `value` everywhere (made on the CPU, then copied:
/// the stable ABI cannot pass a Scalar to `aten::fill_`).
pub fn filled(sizes: &[i64], dtype: DType, device: Device, value: f64) -> Result<Tensor> {
    let mut host = NewTensor::empty(sizes, DType::F64, Device::CPU)?;
    host.as_mut_slice::<f64>()?.fill(value);
    let out = NewTensor::empty(sizes, dtype, device)?.finish();
    out.copy_from(&host.finish())?;
    Ok(out)
}

/// ATen's message for a dtype an op's dispatch macro does not cover (a NotImplementedError).
pub fn unsupported(op: &str, dtype: DType) -> graft_abi::Error {
    graft_abi::Error::msg(format!("\"{op}\" not implemented for '{}'", dtype.name()))
}

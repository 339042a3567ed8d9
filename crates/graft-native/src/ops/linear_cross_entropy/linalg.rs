//! The aten calls both schemes make on their operands: row and column views, products into
//! given outputs, column sums.

use graft_abi::{dispatch, DType, Device};
use graft_abi::{NewTensor, Result, Tensor};

pub(super) fn slice_rows(t: &Tensor, start: usize, end: usize) -> Result<Tensor> {
    let (out,): (Tensor,) = dispatch::call(
        c"aten::slice",
        c"Tensor",
        (t, 0i64, Some(start as i64), Some(end as i64), 1i64),
    )?;
    Ok(out)
}

pub(super) fn transpose(t: &Tensor) -> Result<Tensor> {
    let (out,): (Tensor,) = dispatch::call(c"aten::t", c"", (t,))?;
    Ok(out)
}

/// `out = a @ b` (aten::mm.out).
pub(super) fn mm_out(a: &Tensor, b: &Tensor, out: &Tensor) -> Result<()> {
    let (_,): (Tensor,) = dispatch::call(c"aten::mm", c"out", (a, b, out))?;
    Ok(())
}

/// `out = a @ b` in `dtype` (aten::mm.dtype_out: bf16 / f16 operands, f32 result; CUDA only).
pub(super) fn mm_dtype_out(a: &Tensor, b: &Tensor, dtype: DType, out: &Tensor) -> Result<()> {
    let (_,): (Tensor,) = dispatch::call(c"aten::mm", c"dtype_out", (a, b, dtype, out))?;
    Ok(())
}

/// Columns `start..end` of a 2-D tensor (a view).
pub(super) fn slice_cols(t: &Tensor, start: usize, end: usize) -> Result<Tensor> {
    let (out,): (Tensor,) = dispatch::call(
        c"aten::slice",
        c"Tensor",
        (t, 1i64, Some(start as i64), Some(end as i64), 1i64),
    )?;
    Ok(out)
}

/// The first `rows * cols` elements of the flat `t`, viewed as `(rows, cols)`.
pub(super) fn view_2d(t: &Tensor, rows: usize, cols: usize) -> Result<Tensor> {
    let flat = slice_rows(t, 0, rows * cols)?;
    let sizes: &[i64] = &[rows as i64, cols as i64];
    let (out,): (Tensor,) = dispatch::call(c"aten::view", c"", (&flat, sizes))?;
    Ok(out)
}

/// `out = sum(t, dim 0, keepdim)` in `dtype` (aten::sum.IntList_out; `out` is `(1, cols)`).
pub(super) fn column_sums_out(t: &Tensor, dtype: DType, out: &Tensor) -> Result<()> {
    let dims: &[i64] = &[0];
    let (_,): (Tensor,) = dispatch::call(
        c"aten::sum",
        c"IntList_out",
        (t, Some(dims), true, Some(dtype), out),
    )?;
    Ok(())
}

pub(super) fn column_sums(t: &Tensor, dtype: DType) -> Result<Tensor> {
    let dims: &[i64] = &[0];
    let (out,): (Tensor,) = dispatch::call(
        c"aten::sum",
        c"dim_IntList",
        (t, Some(dims), false, Some(dtype)),
    )?;
    Ok(out)
}

/// `t.zero_()` (aten::zero_).
pub(super) fn zero_(t: &Tensor) -> Result<()> {
    let (_,): (Tensor,) = dispatch::call(c"aten::zero_", c"", (t,))?;
    Ok(())
}

pub(super) fn empty(dtype: DType, device: Device) -> Result<Tensor> {
    Ok(NewTensor::empty(&[0], dtype, device)?.finish())
}

/// The shape of `g @ w`.
pub(super) fn product_shape(g: &Tensor, w: &Tensor) -> Result<(usize, usize)> {
    Ok((g.sizes()?[0] as usize, w.sizes()?[1] as usize))
}

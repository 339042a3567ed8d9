//! Softmax and log-softmax grafts: `aten::_softmax`, `aten::_log_softmax` and their
//! `_backward_data` ops, at CPU and CUDA.
//!
//! What every device shares lives here: which function a kernel computes, the reduced dim
//! wrapped as c10 wraps it, the tensor seen as `outer x dim x inner`, and the checks of ATen's
//! meta functions (sizes, dims) with their messages. Outputs are always contiguous, as ATen's
//! meta functions allocate them (`LEGACY_CONTIGUOUS_MEMORY_FORMAT`).

pub mod cpu;
pub mod cuda;

use std::marker::PhantomData;

use graft_abi::{ensure, DType, DeviceType, Operands, Result, Tensor};
pub use graft_kernels::ops::softmax::{Kind, Shape};

use crate::common::stats::Counters;

/// Softmax or log-softmax, as a type.
pub trait Which: 'static {
    /// The function.
    const KIND: Kind;
    /// ATen's name of it in kernel names and messages: `softmax` or `log_softmax`.
    const NAME: &'static str;
}

/// `aten::_softmax` and `aten::_softmax_backward_data`.
pub struct Softmax;
/// `aten::_log_softmax` and `aten::_log_softmax_backward_data`.
pub struct LogSoftmax;

impl Which for Softmax {
    const KIND: Kind = Kind::Softmax;
    const NAME: &'static str = "softmax";
}

impl Which for LogSoftmax {
    const KIND: Kind = Kind::LogSoftmax;
    const NAME: &'static str = "log_softmax";
}

/// The forward kernel of `W` at device `D`.
pub struct Forward<W, D>(PhantomData<(W, D)>);
/// The backward kernel of `W` at device `D`.
pub struct Backward<W, D>(PhantomData<(W, D)>);

/// `(self, dim, half_to_float)`.
pub type ForwardArgs = (Tensor, i64, bool);
/// `(grad_output, output, dim, input_dtype)`.
pub type BackwardArgs = (Tensor, Tensor, i64, DType);

/// The counters of `W`'s kernel among (softmax, log-softmax).
pub fn counters<W: Which>(two: [&'static Counters; 2]) -> &'static Counters {
    two[usize::from(W::KIND == Kind::LogSoftmax)]
}

/// `dim` wrapped into `0..ndim` as c10's `maybe_wrap_dim` does (a 0-dim tensor counts as 1-dim),
/// with its message (an `IndexError` in ATen).
pub fn wrap_dim(dim: i64, ndim: usize) -> Result<usize> {
    let n = ndim.max(1) as i64;
    ensure!(
        (-n..n).contains(&dim),
        "Dimension out of range (expected to be in range of [{}, {}], but got {dim})",
        -n,
        n - 1
    );
    Ok(if dim < 0 { dim + n } else { dim } as usize)
}

/// The tensor of `sizes` as `outer x dim x inner` around `dim` (already wrapped).
pub fn geometry(sizes: &[i64], dim: usize) -> Shape {
    if sizes.is_empty() {
        return Shape {
            outer: 1,
            dim: 1,
            inner: 1,
        };
    }
    let product = |s: &[i64]| s.iter().map(|&v| v as usize).product::<usize>();
    Shape {
        outer: product(&sizes[..dim]),
        dim: sizes[dim] as usize,
        inner: product(&sizes[dim + 1..]),
    }
}

/// Whether `dim` is the last dim (ATen's `*_lastdim_*` kernels; a 0-dim tensor is viewed as
/// 1-dim).
pub fn is_last_dim(dim: usize, ndim: usize) -> bool {
    dim + 1 == ndim.max(1)
}

/// Checks the forward's input: on the kernel's device (its dtype is checked where ATen's
/// kernels check it, after the empty-tensor return).
pub fn check_forward<W: Which>(kernel: DeviceType, input: &Tensor) -> Result<()> {
    Operands::new(W::NAME, kernel)
        .tensor("input", input)
        .check()?;
    Ok(())
}

/// Checks the backward's operands: one device, and one size. ATen's meta function of
/// `_softmax_backward_data` makes the size check (`checkSameSize`);
/// `_log_softmax_backward_data` has none and reads `output` with `grad`'s geometry, so the graft
/// makes the same check there instead of reading out of bounds.
pub fn check_backward<W: Which>(kernel: DeviceType, grad: &Tensor, output: &Tensor) -> Result<()> {
    Operands::new(W::NAME, kernel)
        .tensor("grad", grad)
        .tensor("output", output)
        .sizes_like("grad")
        .message(
            "Expected tensor for argument #1 'grad' to have same size as tensor for argument #2 \
             'output'; but {want} does not equal {got} (while checking arguments for \
             {op}_backward)",
        )
        .check()?;
    Ok(())
}

/// The dtype of the backward's output as ATen's meta function gives it: the grad's, except a
/// float32 grad of a float16 input (CUDA's `half_to_float`), which gives float16.
pub fn grad_input_dtype(grad: DType, input_dtype: DType) -> DType {
    if grad == DType::F32 && input_dtype == DType::F16 {
        DType::F16
    } else {
        grad
    }
}

/// ATen's message for a dtype its dispatch macro does not cover (a NotImplementedError there).
pub fn not_implemented(kernel: &str, dtype: DType) -> graft_abi::Error {
    graft_abi::Error::msg(format!("\"{kernel}\" not implemented for '{dtype}'"))
}

/// The message of a typed data access that finds another dtype.
pub fn expect_dtype(want: DType, found: DType) -> Result<()> {
    ensure!(
        want == found,
        "expected scalar type {want} but found {found}"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dims_wrap_like_c10() {
        assert_eq!(wrap_dim(-1, 3).unwrap(), 2);
        assert_eq!(wrap_dim(0, 0).unwrap(), 0);
        assert_eq!(wrap_dim(-1, 0).unwrap(), 0);
        let e = wrap_dim(2, 2).unwrap_err();
        assert_eq!(
            e.message(),
            "Dimension out of range (expected to be in range of [-2, 1], but got 2)"
        );
        let e = wrap_dim(1, 0).unwrap_err();
        assert!(e.message().contains("[-1, 0]"));
    }

    #[test]
    fn geometry_splits_around_the_dim() {
        let s = geometry(&[2, 3, 4, 5], 1);
        assert_eq!((s.outer, s.dim, s.inner), (2, 3, 20));
        let s = geometry(&[], 0);
        assert_eq!((s.outer, s.dim, s.inner), (1, 1, 1));
        assert!(is_last_dim(0, 0) && is_last_dim(3, 4) && !is_last_dim(1, 4));
    }
}

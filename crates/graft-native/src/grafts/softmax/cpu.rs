//! Softmax and log-softmax on CPU: graft-kernels' kernels on torch's thread pool, over a
//! contiguous copy of any other layout (as ATen's CPU kernels do).
//!
//! ATen's CPU kernels have no `half_to_float` and compute the backward in the grad's dtype; the
//! errors and their order follow them (the meta function's checks first, then nothing at all
//! for an empty tensor, then the dtype dispatch and the typed data accesses).

use graft_abi::{ensure, DType, Device, DeviceType, Element, Kernel, NewTensor, Result, Tensor};
use graft_kernels::ops::softmax::{self, SoftmaxFloat};
use half::{bf16, f16};

use super::{
    check_backward, check_forward, counters, expect_dtype, geometry, grad_input_dtype, is_last_dim,
    not_implemented, wrap_dim, Backward, BackwardArgs, Forward, ForwardArgs, Shape, Which,
};
use crate::common::stats::Counters;
use crate::common::tensor::contiguous;
use crate::common::threads::TorchPool;

/// Calls of `aten::_softmax` at CPU.
pub static SOFTMAX: Counters = Counters::new();
/// Calls of `aten::_log_softmax` at CPU.
pub static LOG_SOFTMAX: Counters = Counters::new();
/// Calls of `aten::_softmax_backward_data` at CPU.
pub static SOFTMAX_BACKWARD: Counters = Counters::new();
/// Calls of `aten::_log_softmax_backward_data` at CPU.
pub static LOG_SOFTMAX_BACKWARD: Counters = Counters::new();

/// The CPU device, as a type.
pub struct Cpu;

/// The name of the ATen CPU kernel a call would dispatch in (its "not implemented" message).
fn kernel_name<W: Which>(backward: bool, last_dim: bool) -> String {
    let dir = if backward { "_backward" } else { "" };
    let layout = if last_dim { "_lastdim" } else { "" };
    format!("{}{dir}{layout}_kernel_impl", W::NAME)
}

impl<W: Which> Kernel for Forward<W, Cpu> {
    type Args = ForwardArgs;
    type Outputs = (Tensor,);

    fn run((input, dim, half_to_float): ForwardArgs) -> Result<(Tensor,)> {
        counters::<W>([&SOFTMAX, &LOG_SOFTMAX]).call();
        check_forward::<W>(DeviceType::CPU, &input)?;
        let sizes = input.sizes()?;
        let d = wrap_dim(dim, sizes.len())?;
        ensure!(
            !half_to_float,
            "softmax with half to float conversion is not supported on CPU"
        );
        let dtype = input.dtype()?;
        let mut out = NewTensor::empty(sizes, dtype, Device::CPU)?;
        if input.numel()? == 0 {
            return Ok((out.finish(),));
        }
        if !dtype.is_float() {
            let name = kernel_name::<W>(false, is_last_dim(d, sizes.len()));
            return Err(not_implemented(&name, dtype));
        }
        let shape = geometry(sizes, d);
        let x = contiguous(&input)?;
        match dtype {
            DType::F32 => forward::<W, f32>(&x, &mut out, shape),
            DType::F64 => forward::<W, f64>(&x, &mut out, shape),
            DType::BF16 => forward::<W, bf16>(&x, &mut out, shape),
            _ => forward::<W, f16>(&x, &mut out, shape),
        }?;
        Ok((out.finish(),))
    }
}

fn forward<W: Which, T: SoftmaxFloat + Element>(
    x: &Tensor,
    out: &mut NewTensor,
    shape: Shape,
) -> Result<()> {
    softmax::forward(
        W::KIND,
        x.as_slice::<T>()?,
        out.as_mut_slice::<T>()?,
        shape,
        &TorchPool,
    );
    Ok(())
}

impl<W: Which> Kernel for Backward<W, Cpu> {
    type Args = BackwardArgs;
    type Outputs = (Tensor,);

    fn run((grad, output, dim, input_dtype): BackwardArgs) -> Result<(Tensor,)> {
        counters::<W>([&SOFTMAX_BACKWARD, &LOG_SOFTMAX_BACKWARD]).call();
        check_backward::<W>(DeviceType::CPU, &grad, &output)?;
        let sizes = grad.sizes()?;
        let d = wrap_dim(dim, sizes.len())?;
        let dtype = grad.dtype()?;
        let out_dtype = grad_input_dtype(dtype, input_dtype);
        let mut out = NewTensor::empty(sizes, out_dtype, Device::CPU)?;
        if output.numel()? == 0 {
            return Ok((out.finish(),));
        }
        if !dtype.is_float() {
            let name = kernel_name::<W>(true, is_last_dim(d, sizes.len()));
            return Err(not_implemented(&name, dtype));
        }
        // ATen reads grad_input, then output, as the grad's type.
        expect_dtype(dtype, out_dtype)?;
        expect_dtype(dtype, output.dtype()?)?;
        let shape = geometry(sizes, d);
        let (dy, y) = (contiguous(&grad)?, contiguous(&output)?);
        match dtype {
            DType::F32 => backward::<W, f32>(&dy, &y, &mut out, shape),
            DType::F64 => backward::<W, f64>(&dy, &y, &mut out, shape),
            DType::BF16 => backward::<W, bf16>(&dy, &y, &mut out, shape),
            _ => backward::<W, f16>(&dy, &y, &mut out, shape),
        }?;
        Ok((out.finish(),))
    }
}

fn backward<W: Which, T: SoftmaxFloat + Element>(
    dy: &Tensor,
    y: &Tensor,
    out: &mut NewTensor,
    shape: Shape,
) -> Result<()> {
    softmax::backward(
        W::KIND,
        dy.as_slice::<T>()?,
        y.as_slice::<T>()?,
        out.as_mut_slice::<T>()?,
        shape,
        &TorchPool,
    );
    Ok(())
}

/// Registers the four CPU kernels in `lib` (an `aten` implementation library at CPU).
pub fn register(lib: &mut graft_abi::Library) -> Result<()> {
    lib.register::<Forward<super::Softmax, Cpu>>(c"_softmax")?;
    lib.register::<Forward<super::LogSoftmax, Cpu>>(c"_log_softmax")?;
    lib.register::<Backward<super::Softmax, Cpu>>(c"_softmax_backward_data")?;
    lib.register::<Backward<super::LogSoftmax, Cpu>>(c"_log_softmax_backward_data")
}

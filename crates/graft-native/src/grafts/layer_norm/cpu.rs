//! LayerNorm on CPU: graft-kernels' kernels on torch's thread pool.
//!
//! ATen's CPU rules: parameters of the input's dtype, or float32 parameters under a
//! bfloat16/float16 input ("mixed dtype"); mean and rstd in the parameters' dtype (so bfloat16
//! for a bfloat16 input with bfloat16 parameters); the errors in ATen's order.

use graft_abi::{DType, Device, DeviceType, Element, Kernel, NewTensor, Result, Tensor};
use graft_kernels::ops::layer_norm::{self, Affine, ForwardOut, Grads, NormFloat, Stats};
use half::{bf16, f16};

use super::{
    check_devices, check_inputs, contiguous_as, expect_dtype, mask3, missing_parameter,
    not_implemented, stat_sizes, BackwardArgs, ForwardArgs, Saved,
};
use crate::common::stats::Counters;
use crate::common::tensor::{contiguous, filled, to_dtype};
use crate::common::threads::TorchPool;

/// Calls of `aten::native_layer_norm` at CPU.
pub static FORWARD: Counters = Counters::new();
/// Calls of `aten::native_layer_norm_backward` at CPU.
pub static BACKWARD: Counters = Counters::new();

/// ATen's CPU mixed-dtype rule: returns the parameters' dtype (the dtype of mean and rstd).
fn param_dtype(input: DType, params: [Option<&Tensor>; 2]) -> Result<DType> {
    let mut mixed = false;
    for p in params.into_iter().flatten() {
        mixed |= p.dtype()? != input;
    }
    if !mixed {
        return Ok(input);
    }
    for p in params.into_iter().flatten() {
        graft_abi::ensure!(
            p.dtype()? == DType::F32,
            "mixed dtype (CPU): expect parameter to have scalar type of Float"
        );
    }
    graft_abi::ensure!(
        matches!(input, DType::BF16 | DType::F16),
        "mixed dtype (CPU): all inputs must share same datatype."
    );
    Ok(DType::F32)
}

/// The parameters' dtype of ATen's CPU backward kernel: a weight of another dtype than the input
/// makes the call mixed (a float32 weight, mean and rstd under a bfloat16/float16 input); the
/// bias is read only through its gradient.
fn backward_param_dtype(input: DType, weight: Option<&Tensor>) -> Result<DType> {
    match weight {
        Some(w) if w.dtype()? != input => param_dtype(input, [Some(w), None]),
        _ => Ok(input),
    }
}

/// A parameter's values in the accumulation type of inputs of type `T`.
fn acc_values<T: NormFloat>(p: Option<&Tensor>) -> Result<Option<Vec<T::Acc>>>
where
    T::Acc: Element,
{
    p.map(|t| {
        Ok(contiguous_as(t, T::Acc::DTYPE)?
            .as_slice::<T::Acc>()?
            .to_vec())
    })
    .transpose()
}

/// aten::native_layer_norm at the CPU key.
pub struct ForwardCpu;

impl Kernel for ForwardCpu {
    type Args = ForwardArgs;
    type Outputs = (Tensor, Tensor, Tensor);

    fn run(
        (input, normalized_shape, weight, bias, eps): ForwardArgs,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        FORWARD.call();
        let (weight, bias) = (Tensor::defined(weight)?, Tensor::defined(bias)?);
        check_devices(
            DeviceType::CPU,
            &input,
            (weight.as_ref(), bias.as_ref()),
            None,
        )?;
        let dtype = input.dtype()?;
        let params = [weight.as_ref(), bias.as_ref()];
        let param = param_dtype(dtype, params)?;
        let (rows, cols) = check_inputs(&input, &normalized_shape, params[0], params[1])?;
        if !dtype.is_float() {
            return Err(not_implemented("LayerNormKernelImpl", dtype));
        }
        let sizes = input.sizes()?;
        let stat = stat_sizes(sizes, normalized_shape.len());
        let call = Forward {
            input: &input,
            params,
            rows,
            cols,
            eps,
        };
        let (y, mean, rstd) = match dtype {
            DType::F32 => call.run::<f32>(),
            DType::F64 => call.run::<f64>(),
            DType::BF16 => call.run::<bf16>(),
            _ => call.run::<f16>(),
        }?;
        // mean and rstd in the parameters' dtype, shaped like the batch dims and ones.
        let shaped = |t: Tensor| -> Result<Tensor> {
            let out = NewTensor::empty(&stat, param, Device::CPU)?.finish();
            out.copy_from(&reshape_flat(&t, &stat)?)?;
            Ok(out)
        };
        Ok((y, shaped(mean)?, shaped(rstd)?))
    }
}

/// A flat tensor viewed with `sizes` (same number of elements).
fn reshape_flat(t: &Tensor, sizes: &[i64]) -> Result<Tensor> {
    let (out,): (Tensor,) = graft_abi::dispatch::call(c"aten::view", c"", (t, sizes))?;
    Ok(out)
}

struct Forward<'a> {
    input: &'a Tensor,
    params: [Option<&'a Tensor>; 2],
    rows: usize,
    cols: usize,
    eps: f64,
}

impl Forward<'_> {
    /// (y, mean, rstd), mean and rstd flat in the accumulation type.
    fn run<T: NormFloat + Element>(&self) -> Result<(Tensor, Tensor, Tensor)>
    where
        T::Acc: Element + AccValue,
    {
        let x = contiguous(self.input)?;
        let (w, b) = (
            acc_values::<T>(self.params[0])?,
            acc_values::<T>(self.params[1])?,
        );
        let mut y = NewTensor::empty(self.input.sizes()?, T::DTYPE, Device::CPU)?;
        let rows = self.rows as i64;
        let mut mean = NewTensor::empty(&[rows], T::Acc::DTYPE, Device::CPU)?;
        let mut rstd = NewTensor::empty(&[rows], T::Acc::DTYPE, Device::CPU)?;
        let out = ForwardOut {
            y: y.as_mut_slice::<T>()?,
            mean: mean.as_mut_slice::<T::Acc>()?,
            rstd: rstd.as_mut_slice::<T::Acc>()?,
        };
        let affine = Affine {
            weight: w.as_deref(),
            bias: b.as_deref(),
        };
        let eps = T::Acc::of_f64(self.eps);
        let x = x.as_slice::<T>()?;
        layer_norm::forward(x, (self.rows, self.cols), affine, eps, out, &TorchPool);
        Ok((y.finish(), mean.finish(), rstd.finish()))
    }
}

/// The accumulation types' conversion from a double argument.
pub trait AccValue {
    /// `v` rounded to `Self`.
    fn of_f64(v: f64) -> Self;
}

impl AccValue for f32 {
    fn of_f64(v: f64) -> f32 {
        v as f32
    }
}

impl AccValue for f64 {
    fn of_f64(v: f64) -> f64 {
        v
    }
}

/// aten::native_layer_norm_backward at the CPU key.
pub struct BackwardCpu;

impl Kernel for BackwardCpu {
    type Args = BackwardArgs;
    type Outputs = (Tensor, Tensor, Tensor);

    fn run(
        (grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask): BackwardArgs,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        BACKWARD.call();
        let (weight, bias) = (Tensor::defined(weight)?, Tensor::defined(bias)?);
        let saved = Saved {
            grad_out: &grad_out,
            mean: &mean,
            rstd: &rstd,
        };
        let params = (weight.as_ref(), bias.as_ref());
        check_devices(DeviceType::CPU, &input, params, Some(saved))?;
        let mask = mask3(&output_mask)?;
        let dtype = input.dtype()?;
        let params = [weight.as_ref(), bias.as_ref()];
        let (rows, cols) = check_inputs(&input, &normalized_shape, params[0], params[1])?;
        // The gradients of absent parameters cannot be allocated (ATen's error).
        for (want, p) in [(mask[1], params[0]), (mask[2], params[1])] {
            if want && p.is_none() {
                return Err(missing_parameter());
            }
        }
        let grads_wanted = rows > 0 && cols > 0;
        if rows > 0 {
            // ATen checks dtypes in its kernel, which it runs for any rows (of any length).
            if !dtype.is_float() {
                return Err(not_implemented("LayerNormBackwardKernelImpl", dtype));
            }
            let param = backward_param_dtype(dtype, params[0])?;
            expect_dtype(dtype, grad_out.dtype()?)?;
            expect_dtype(param, mean.dtype()?)?;
            expect_dtype(param, rstd.dtype()?)?;
            if let (true, Some(b)) = (mask[2], params[1]) {
                // db is allocated like the bias and written as the parameters' dtype.
                expect_dtype(param, b.dtype()?)?;
            }
            // Beyond ATen (which reads them with input's geometry): sizes that fit.
            graft_abi::ensure!(
                grad_out.sizes()? == input.sizes()?,
                "grad_out of size {:?} does not match input of size {:?}",
                grad_out.sizes()?,
                input.sizes()?
            );
            for (name, t) in [("mean", &mean), ("rstd", &rstd)] {
                graft_abi::ensure!(
                    t.numel()? == rows,
                    "{name} has {} elements, expected one per normalized row ({rows})",
                    t.numel()?
                );
            }
        }
        let call = Backward {
            grad_out: &grad_out,
            input: &input,
            stats: [&mean, &rstd],
            weight: params[0],
            mask,
            rows,
            cols,
        };
        let (dx, dw, db) = if !grads_wanted {
            call.empty()?
        } else {
            match dtype {
                DType::F32 => call.run::<f32>(),
                DType::F64 => call.run::<f64>(),
                DType::BF16 => call.run::<bf16>(),
                _ => call.run::<f16>(),
            }?
        };
        // Parameter gradients shaped and typed like the parameters.
        let cast = |g: Option<Tensor>, p: Option<&Tensor>| -> Result<Tensor> {
            match (g, p) {
                (Some(g), Some(p)) => to_dtype(&reshape_flat(&g, p.sizes()?)?, p.dtype()?),
                _ => Tensor::undefined(),
            }
        };
        Ok((
            dx.map_or_else(Tensor::undefined, Ok)?,
            cast(dw, params[0])?,
            cast(db, params[1])?,
        ))
    }
}

struct Backward<'a> {
    grad_out: &'a Tensor,
    input: &'a Tensor,
    stats: [&'a Tensor; 2],
    weight: Option<&'a Tensor>,
    mask: [bool; 3],
    rows: usize,
    cols: usize,
}

impl Backward<'_> {
    /// Outputs of an empty problem: dx empty, dw and db zero (ATen's zeros_like).
    fn empty(&self) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dtype = self.input.dtype()?;
        let dx = self.mask[0]
            .then(|| NewTensor::empty(self.input.sizes()?, dtype, Device::CPU))
            .transpose()?
            .map(NewTensor::finish);
        let zeros = |want: bool| -> Result<Option<Tensor>> {
            want.then(|| filled(&[self.cols as i64], DType::F64, Device::CPU, 0.0))
                .transpose()
        };
        Ok((dx, zeros(self.mask[1])?, zeros(self.mask[2])?))
    }

    /// (dx, dw, db); dw and db flat in the accumulation type.
    fn run<T: NormFloat + Element>(
        &self,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)>
    where
        T::Acc: Element,
    {
        let dy = contiguous(self.grad_out)?;
        let x = contiguous(self.input)?;
        let mean = contiguous_as(self.stats[0], T::Acc::DTYPE)?;
        let rstd = contiguous_as(self.stats[1], T::Acc::DTYPE)?;
        let w = acc_values::<T>(self.weight)?;
        let sizes = self.input.sizes()?;
        let mut dx = self.mask[0]
            .then(|| NewTensor::empty(sizes, T::DTYPE, Device::CPU))
            .transpose()?;
        let acc_vec = |want: bool| {
            want.then(|| NewTensor::empty(&[self.cols as i64], T::Acc::DTYPE, Device::CPU))
                .transpose()
        };
        let (mut dw, mut db) = (acc_vec(self.mask[1])?, acc_vec(self.mask[2])?);
        let grads = Grads {
            dx: dx.as_mut().map(|t| t.as_mut_slice::<T>()).transpose()?,
            dw: dw
                .as_mut()
                .map(|t| t.as_mut_slice::<T::Acc>())
                .transpose()?,
            db: db
                .as_mut()
                .map(|t| t.as_mut_slice::<T::Acc>())
                .transpose()?,
        };
        let stats = Stats {
            mean: mean.as_slice::<T::Acc>()?,
            rstd: rstd.as_slice::<T::Acc>()?,
        };
        let inputs = (dy.as_slice::<T>()?, x.as_slice::<T>()?);
        let dims = (self.rows, self.cols);
        layer_norm::backward(inputs, dims, stats, w.as_deref(), grads, &TorchPool);
        Ok((
            dx.map(NewTensor::finish),
            dw.map(NewTensor::finish),
            db.map(NewTensor::finish),
        ))
    }
}

/// Registers both CPU kernels in `lib` (an `aten` implementation library at CPU).
pub fn register(lib: &mut graft_abi::Library) -> Result<()> {
    lib.register::<ForwardCpu>(c"native_layer_norm")?;
    lib.register::<BackwardCpu>(c"native_layer_norm_backward")
}

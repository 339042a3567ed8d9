//! Fused Adam / AdamW on CUDA: graft-cuda's multi-tensor kernel (ATen's arithmetic, fewer
//! launches), on PyTorch's current stream of the parameters' device.
//!
//! Tensors are read in memory order, as ATen does: every tensor of a parameter's group must be
//! dense with the parameter's strides (ATen's "fast path restrictions"). Steps that are not
//! `float32` tensors on that device are converted first (ATen would read them as floats).

use graft_abi::cuda::{current_stream, DeviceGuard};
use graft_abi::{ensure, DType, Device, DeviceType, Kernel, Operands, Result, Tensor};
use graft_cuda::{AdamMode, AdamStep, AdamTensor};
use graft_kernels::ops::adam::Mode;

use super::{counters, float_arg, item, Call, Lr, LrArg, Step, Variant};
use crate::common::cuda::ptr;
use crate::common::stats::Counters;

/// Calls of `aten::_fused_adam_` at CUDA.
pub static ADAM: Counters = Counters::new();
/// Calls of `aten::_fused_adam_.tensor_lr` at CUDA.
pub static ADAM_TENSOR_LR: Counters = Counters::new();
/// Calls of `aten::_fused_adamw_` at CUDA.
pub static ADAMW: Counters = Counters::new();
/// Calls of `aten::_fused_adamw_.tensor_lr` at CUDA.
pub static ADAMW_TENSOR_LR: Counters = Counters::new();

/// The CUDA device, as a type.
pub struct Cuda;

/// The kernel of `V`'s overload `L` at CUDA.
pub type StepCuda<V, L> = Step<V, L, Cuda>;

fn kernel_dtype(dtype: DType) -> Result<graft_cuda::DType> {
    Ok(match dtype {
        DType::F32 => graft_cuda::DType::F32,
        DType::F64 => graft_cuda::DType::F64,
        DType::BF16 => graft_cuda::DType::BF16,
        DType::F16 => graft_cuda::DType::F16,
        other => {
            return Err(graft_abi::Error::msg(format!(
                "\"fused_adam_kernel_cuda\" not implemented for '{other}'"
            )))
        }
    })
}

/// ATen's message for a `float` tensor argument of another dtype.
const FLOAT_ARG: &str = "expected scalar type Float but found {got}";

/// Checks the tensors of parameter `i`, all written: on the first parameter's device, of its
/// dtype, with parameter `i`'s layout (dense: the kernel reads them in memory order), none
/// sharing memory with another. The metadata of each is read once: with thousands of small
/// tensors the calls into torch, not the kernel, set the step's time.
fn check_group(call: &Call, i: usize, first: &Tensor, message: &str) -> Result<()> {
    let mut operands = Operands::new("fused_adam", DeviceType::CUDA)
        .tensor("first", first)
        .written("params", &call.params[i])
        .device_message(message)
        .dtype_like("first")
        .message(message)
        .dense()
        .message(message);
    for (name, t) in call.moments(i) {
        operands = operands
            .written(name, t)
            .device_message(message)
            .dtype_like("first")
            .message(message)
            .layout_like("params")
            .message(message);
    }
    operands.check()?;
    Ok(())
}

impl<V: Variant, L: LrArg> Kernel for Step<V, L, Cuda> {
    type Args = super::Args<L>;
    type Outputs = ();

    fn run(args: Self::Args) -> Result<()> {
        let stats = counters::<V, L>([&ADAM, &ADAM_TENSOR_LR, &ADAMW, &ADAMW_TENSOR_LR]);
        stats.call();
        let call = Call::new(args)?;
        call.check_lengths()?;
        let Some(first) = call.params.first() else {
            return Ok(());
        };
        Operands::new("fused_adam", DeviceType::CUDA)
            .tensor("params", first)
            .optional("grad_scale", call.grad_scale.as_ref())
            .device_message("grad_scale must be on the same GPU device as the params")
            .dtype(DType::F32)
            .message(FLOAT_ARG)
            .optional("found_inf", call.found_inf.as_ref())
            .device_message("found_inf must be on the same GPU device as the params")
            .dtype(DType::F32)
            .message(FLOAT_ARG)
            .check()?;

        let device = first.device()?;
        let dtype = first.dtype()?;
        let kdtype = kernel_dtype(dtype)?;
        let _guard = DeviceGuard::new(device.index)?;

        // lr: a CPU tensor is read here (as ATen does); a device one must be a float there.
        let (lr, lr_tensor) = match &call.lr {
            Lr::Value(v) => (*v, None),
            Lr::Tensor(t) if t.device()? == Device::CPU => (item(t)?, None),
            Lr::Tensor(t) => {
                ensure!(
                    t.device()? == device,
                    "lr must be on the same GPU device as the params"
                );
                float_arg(t)?;
                (0.0, Some(t))
            }
        };
        let layout_message = if call.amsgrad {
            "params, grads, exp_avgs, exp_avg_sqs, and max_exp_avg_sqs must have same dtype, \
             device, and layout"
        } else {
            "params, grads, exp_avgs, and exp_avg_sqs must have same dtype, device, and layout"
        };
        let mut converted_steps = Vec::new();
        let mut tensors = Vec::with_capacity(call.params.len());
        for i in 0..call.params.len() {
            check_group(&call, i, first, layout_message)?;
            let param = &call.params[i];
            let sizes = param.sizes()?;
            let numel = sizes.iter().product::<i64>() as u64;
            if numel == 0 {
                continue;
            }
            let step = &call.state_steps[i];
            let step_ptr = if step.device()? == device && step.dtype()? == DType::F32 {
                ensure!(
                    step.numel()? == 1,
                    "a Tensor with {} elements cannot be converted to Scalar",
                    step.numel()?
                );
                ptr(step)?
            } else {
                // A float32 copy on the device (a CPU or other-dtype step; rare).
                let value = item(step)? as f32;
                let on_device = to_device_f32(value, device)?;
                let p = ptr(&on_device)?;
                converted_steps.push(on_device);
                p
            };
            tensors.push(AdamTensor {
                param: ptr(param)?,
                grad: ptr(&call.grads[i])?,
                exp_avg: ptr(&call.exp_avgs[i])?,
                exp_avg_sq: ptr(&call.exp_avg_sqs[i])?,
                max_exp_avg_sq: if call.amsgrad {
                    ptr(&call.max_exp_avg_sqs[i])?
                } else {
                    0
                },
                step: step_ptr,
                numel,
            });
        }
        if !converted_steps.is_empty() {
            stats.fallback();
        }
        let opt_ptr = |t: Option<&Tensor>| t.map(ptr).transpose().map(Option::unwrap_or_default);
        graft_cuda::adam_step(&AdamStep {
            device: device.index,
            stream: current_stream(device.index)? as usize,
            dtype: kdtype,
            mode: match V::MODE {
                Mode::Adam => AdamMode::Adam,
                Mode::AdamW => AdamMode::AdamW,
            },
            amsgrad: call.amsgrad,
            maximize: call.maximize,
            lr,
            lr_ptr: opt_ptr(lr_tensor)?,
            beta1: call.beta1,
            beta2: call.beta2,
            weight_decay: call.weight_decay,
            eps: call.eps,
            grad_scale: opt_ptr(call.grad_scale.as_ref())?,
            found_inf: opt_ptr(call.found_inf.as_ref())?,
            tensors: &tensors,
        })
        .map_err(|e| graft_abi::Error::msg(e.to_string()))?;
        // The converted steps are freed by the caching allocator in stream order.
        drop(converted_steps);
        Ok(())
    }
}

/// A one-element float32 tensor holding `value` on `device`.
fn to_device_f32(value: f32, device: Device) -> Result<Tensor> {
    let mut host = graft_abi::NewTensor::empty(&[], DType::F32, Device::CPU)?;
    host.as_mut_slice::<f32>()?[0] = value;
    let out = graft_abi::NewTensor::empty(&[], DType::F32, device)?.finish();
    out.copy_from(&host.finish())?;
    Ok(out)
}

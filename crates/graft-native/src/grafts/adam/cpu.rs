//! Fused Adam / AdamW on CPU: graft-kernels' step, rounded as ATen's CPU kernel rounds it, one
//! parameter after another (as ATen), each on torch's thread pool.
//!
//! ATen reads every tensor as a flat array; a tensor that is not contiguous is computed here
//! through a contiguous copy that is written back afterwards (counted as a fallback).

use graft_abi::{
    contiguous_strides, in_place_views, DType, DeviceType, Element, Kernel, Operands, Result,
    Tensor,
};
use graft_kernels::ops::adam::{self, AdamFloat, Buffers};
use half::{bf16, f16};

use super::{counters, float_arg, item, same_layout, Call, Lr, LrArg, Step, Variant};
use crate::common::stats::Counters;
use crate::common::threads::TorchPool;

/// Calls of `aten::_fused_adam_` at CPU.
pub static ADAM: Counters = Counters::new();
/// Calls of `aten::_fused_adam_.tensor_lr` at CPU.
pub static ADAM_TENSOR_LR: Counters = Counters::new();
/// Calls of `aten::_fused_adamw_` at CPU.
pub static ADAMW: Counters = Counters::new();
/// Calls of `aten::_fused_adamw_.tensor_lr` at CPU.
pub static ADAMW_TENSOR_LR: Counters = Counters::new();

/// The CPU device, as a type.
pub struct Cpu;

/// The kernel of `V`'s overload `L` at CPU.
pub type StepCpu<V, L> = Step<V, L, Cpu>;

impl<V: Variant, L: LrArg> Kernel for Step<V, L, Cpu> {
    type Args = super::Args<L>;
    type Outputs = ();

    fn run(args: Self::Args) -> Result<()> {
        let stats = counters::<V, L>([&ADAM, &ADAM_TENSOR_LR, &ADAMW, &ADAMW_TENSOR_LR]);
        stats.call();
        let mut call = Call::new(args)?;
        // ATen reads found_inf and grad_scale first and returns before any other check.
        if let Some(found_inf) = &call.found_inf {
            float_arg(found_inf)?;
            if item(found_inf)? == 1.0 {
                return Ok(());
            }
        }
        let grad_scale = match &call.grad_scale {
            Some(scale) => {
                float_arg(scale)?;
                Some(item(scale)? as f32)
            }
            None => None,
        };
        call.check_lengths()?;
        let lr = match &call.lr {
            Lr::Value(v) => *v,
            Lr::Tensor(t) => item(t)?,
        };
        let hyper = call.hyper(V::MODE, lr, grad_scale);
        for i in 0..call.params.len() {
            if step_one(&mut call, i, &hyper)? {
                stats.fallback();
            }
        }
        Ok(())
    }
}

/// Checks the tensors of parameter `i` (all written, on the CPU, of the parameter's floating
/// dtype and number of elements, none sharing memory with another) and returns their dtype.
fn check_group(call: &Call, i: usize) -> Result<DType> {
    let param = &call.params[i];
    let n = param.numel()? as i64;
    let mut operands = Operands::new("fused_adam", DeviceType::CPU)
        .written("params", param)
        .float()
        .message("\"fused_adam_kernel\" not implemented for '{got}'");
    for (name, t) in call.moments(i) {
        operands = operands
            .written(name, t)
            .dtype_like("params")
            .message("expected scalar type {want} but found {got}")
            .numel(n)
            .message("{name} has {got} elements but params has {want}: each tensor must have the size of its parameter");
    }
    Ok(operands.check()?.dtype)
}

/// Steps parameter `i`; true when it went through contiguous copies.
fn step_one(call: &mut Call, i: usize, hyper: &adam::Hyper) -> Result<bool> {
    let amsgrad = call.amsgrad;
    let dtype = check_group(call, i)?;
    let step = f64::from(item(&call.state_steps[i])? as f32);
    if call.params[i].numel()? == 0 {
        return Ok(false);
    }
    let mut group: Vec<&mut Tensor> = vec![
        &mut call.params[i],
        &mut call.grads[i],
        &mut call.exp_avgs[i],
        &mut call.exp_avg_sqs[i],
    ];
    if amsgrad {
        group.push(&mut call.max_exp_avg_sqs[i]);
    }
    // Dense tensors sharing the parameter's layout are stepped in memory order, as ATen does;
    // any other layout through contiguous copies (in logical order).
    let in_memory_order = {
        let param = &*group[0];
        let (mut dense, mut contiguous, mut same) = (true, true, true);
        for t in &group {
            dense &= t.is_dense()?;
            contiguous &= t.is_contiguous()?;
            same &= same_layout(param, t)?;
        }
        dense && (contiguous || same)
    };
    let mut copies: Vec<Option<Tensor>> = Vec::with_capacity(group.len());
    for t in &group {
        copies.push((!in_memory_order).then(|| contiguous(t)).transpose()?);
    }
    let copied = !in_memory_order;
    {
        let mut views: Vec<&mut Tensor> = Vec::with_capacity(group.len());
        for (t, copy) in group.iter_mut().zip(copies.iter_mut()) {
            views.push(match copy {
                Some(c) => c,
                None => t,
            });
        }
        match dtype {
            DType::F32 => run::<f32>(views, hyper, step),
            DType::F64 => run::<f64>(views, hyper, step),
            DType::BF16 => run::<bf16>(views, hyper, step),
            _ => run::<f16>(views, hyper, step),
        }?;
    }
    for (t, copy) in group.iter().zip(&copies) {
        if let Some(c) = copy {
            t.copy_from(c)?;
        }
    }
    Ok(copied)
}

fn run<T: AdamFloat + Element>(
    tensors: Vec<&mut Tensor>,
    hyper: &adam::Hyper,
    step: f64,
) -> Result<()> {
    let mut views = in_place_views::<T>(tensors)
        .map_err(|e| graft_abi::Error::msg(format!("fused adam: {}", e.message())))?
        .into_iter();
    let mut next = || views.next().unwrap_or_default();
    let buffers = Buffers {
        param: next(),
        grad: next(),
        exp_avg: next(),
        exp_avg_sq: next(),
        max_exp_avg_sq: views.next(),
    };
    adam::step(hyper, step, buffers, &TorchPool);
    Ok(())
}

/// A contiguous copy of `t`.
fn contiguous(t: &Tensor) -> Result<Tensor> {
    let sizes = t.sizes()?;
    let out = Tensor::empty_strided(sizes, &contiguous_strides(sizes), t.dtype()?, t.device()?)?;
    out.copy_from(t)?;
    Ok(out)
}

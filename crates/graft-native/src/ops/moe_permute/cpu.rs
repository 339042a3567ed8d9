//! MoE token permutation on CPU: graft-kernels' kernels on torch's thread pool, after the index
//! values are checked.

use graft_abi::{DType, Device, DeviceType, Element, Kernel, NewTensor, Result, Tensor};
use graft_kernels::ops::moe_permute::{self, first_out_of_range, Permutation};
use graft_kernels::Float;
use half::{bf16, f16};

use super::{check_permute, check_sort, check_unpermute, kernel_weights};
use crate::common::stats::Counters;
use crate::common::tensor::{contiguous, to_dtype, unsupported};
use crate::common::threads::TorchPool;

pub static MOE_SORT_CPU: Counters = Counters::new();
pub static MOE_PERMUTE_CPU: Counters = Counters::new();
pub static MOE_UNPERMUTE_CPU: Counters = Counters::new();
pub static MOE_UNPERMUTE_BACKWARD_CPU: Counters = Counters::new();

/// `valid`'s value, clamped to `0..=pairs` (as the CUDA kernels and the reference read it).
fn read_valid(valid: &Tensor, pairs: i64) -> Result<usize> {
    let v = to_dtype(valid, DType::I64)?;
    let v = contiguous(&v)?.as_slice::<i64>()?[0];
    Ok(v.clamp(0, pairs) as usize)
}

/// `index`'s values (contiguous), each within `0..pairs`.
fn read_index(op: &str, name: &str, index: &Tensor, pairs: i64) -> Result<Tensor> {
    let index = contiguous(index)?;
    if let Some((at, v)) = first_out_of_range(index.as_slice::<i64>()?, pairs as usize) {
        return Err(graft_abi::Error::msg(format!(
            "{op}: index {v} is out of bounds for dimension 0 with size {pairs} ({name}[{at}])"
        )));
    }
    Ok(index)
}

/// The kernels' shape of a call with `tokens` tokens of `width`, `valid` read and clamped.
fn permutation(tokens: i64, top_k: i64, width: i64, valid: &Tensor) -> Result<Permutation> {
    Ok(Permutation {
        tokens: tokens as usize,
        top_k: top_k as usize,
        hidden: width as usize,
        valid: read_valid(valid, tokens * top_k)?,
    })
}

fn permute_typed<T: Float + Element>(
    shape: Permutation,
    hidden: &Tensor,
    perm: &Tensor,
) -> Result<Tensor> {
    let x = contiguous(hidden)?;
    let sizes = [shape.pairs() as i64, shape.hidden as i64];
    let mut out = NewTensor::empty(&sizes, T::DTYPE, Device::CPU)?;
    moe_permute::permute::<T>(
        shape,
        x.as_slice()?,
        perm.as_slice()?,
        out.as_mut_slice()?,
        &TorchPool,
    );
    Ok(out.finish())
}

fn unpermute_typed<T: Float + Element, W: Float<Acc = T::Acc> + Element>(
    shape: Permutation,
    y: &Tensor,
    inv_perm: &Tensor,
    weights: Option<&Tensor>,
) -> Result<Tensor> {
    let y = contiguous(y)?;
    let w = weights.map(contiguous).transpose()?;
    let w = w.as_ref().map(|w| w.as_slice::<W>()).transpose()?;
    let sizes = [shape.tokens as i64, shape.hidden as i64];
    let mut out = NewTensor::empty(&sizes, T::DTYPE, Device::CPU)?;
    moe_permute::unpermute::<T, W>(
        shape,
        y.as_slice()?,
        inv_perm.as_slice()?,
        w,
        out.as_mut_slice()?,
        &TorchPool,
    );
    Ok(out.finish())
}

fn backward_typed<T: Float + Element, W: Float<Acc = T::Acc> + Element>(
    shape: Permutation,
    (grad, y): (&Tensor, &Tensor),
    (perm, inv_perm): (&Tensor, &Tensor),
    weights: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (g, y) = (contiguous(grad)?, contiguous(y)?);
    let w = weights.map(contiguous).transpose()?;
    let w = w.as_ref().map(|w| w.as_slice::<W>()).transpose()?;
    let sizes = [shape.pairs() as i64, shape.hidden as i64];
    let mut dy = NewTensor::empty(&sizes, T::DTYPE, Device::CPU)?;
    let dw_sizes: &[i64] = if w.is_some() {
        &[shape.tokens as i64, shape.top_k as i64]
    } else {
        &[0]
    };
    // Without weights, an empty placeholder of the rows' dtype.
    let dw_dtype = if w.is_some() { W::DTYPE } else { T::DTYPE };
    let mut dw = NewTensor::empty(dw_sizes, dw_dtype, Device::CPU)?;
    moe_permute::unpermute_backward::<T, W>(
        shape,
        g.as_slice()?,
        y.as_slice()?,
        perm.as_slice()?,
        inv_perm.as_slice()?,
        w,
        dy.as_mut_slice()?,
        w.is_some().then(|| dw.as_mut_slice()).transpose()?,
        &TorchPool,
    );
    Ok((dy.finish(), dw.finish()))
}

/// Calls `$f::<T, W>($args)` for `y`'s dtype `T` and the kernels' weight type `W` (`T` or
/// `T::Acc`, by `$w`: the dtype [`weight_dtype`] chose, or `None`).
macro_rules! by_dtypes {
    ($op:expr, $y:expr, $w:expr, $f:ident($($arg:expr),*)) => {
        match ($y, $w) {
            (DType::F32, _) => $f::<f32, f32>($($arg),*),
            (DType::F64, _) => $f::<f64, f64>($($arg),*),
            (DType::BF16, Some(DType::BF16)) => $f::<bf16, bf16>($($arg),*),
            (DType::BF16, _) => $f::<bf16, f32>($($arg),*),
            (DType::F16, Some(DType::F16)) => $f::<f16, f16>($($arg),*),
            (DType::F16, _) => $f::<f16, f32>($($arg),*),
            (other, _) => Err(unsupported($op, other)),
        }
    };
}

/// `torchgraft::moe_sort` at CPU: one serial counting sort (linear in the ids).
pub struct MoeSortCpu;

impl Kernel for MoeSortCpu {
    type Args = (Tensor, i64);
    type Outputs = (Tensor, Tensor, Tensor);
    fn run((expert_ids, num_experts): Self::Args) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "moe_sort";
        MOE_SORT_CPU.call();
        let (_, pairs) = check_sort(OP, DeviceType::CPU, &expert_ids, num_experts)?;
        let ids = contiguous(&expert_ids)?;
        let n = pairs as i64;
        let mut perm = NewTensor::empty(&[n], DType::I64, Device::CPU)?;
        let mut inv_perm = NewTensor::empty(&[n], DType::I64, Device::CPU)?;
        let mut offsets = NewTensor::empty(&[num_experts], DType::I32, Device::CPU)?;
        moe_permute::sort(
            ids.as_slice()?,
            num_experts as usize,
            perm.as_mut_slice()?,
            inv_perm.as_mut_slice()?,
            offsets.as_mut_slice()?,
        );
        Ok((perm.finish(), inv_perm.finish(), offsets.finish()))
    }
}

/// `torchgraft::moe_permute` at CPU.
pub struct MoePermuteCpu;

impl Kernel for MoePermuteCpu {
    type Args = (Tensor, Tensor, Tensor, i64);
    type Outputs = (Tensor,);
    fn run((hidden, perm, valid, top_k): Self::Args) -> Result<(Tensor,)> {
        const OP: &str = "moe_permute";
        MOE_PERMUTE_CPU.call();
        let (checked, tokens, width) =
            check_permute(OP, DeviceType::CPU, &hidden, &perm, &valid, top_k)?;
        let pairs = tokens * top_k;
        let shape = permutation(tokens, top_k, width, &valid)?;
        let perm = read_index(OP, "perm", &perm, pairs)?;
        let out = match checked.dtype {
            DType::F32 => permute_typed::<f32>(shape, &hidden, &perm),
            DType::F64 => permute_typed::<f64>(shape, &hidden, &perm),
            DType::BF16 => permute_typed::<bf16>(shape, &hidden, &perm),
            DType::F16 => permute_typed::<f16>(shape, &hidden, &perm),
            other => Err(unsupported(OP, other)),
        }?;
        Ok((out,))
    }
}

/// `torchgraft::moe_unpermute` at CPU.
pub struct MoeUnpermuteCpu;

impl Kernel for MoeUnpermuteCpu {
    type Args = (Tensor, Tensor, Tensor, Option<Tensor>, i64);
    type Outputs = (Tensor,);
    fn run((y, inv_perm, valid, weights, top_k): Self::Args) -> Result<(Tensor,)> {
        const OP: &str = "moe_unpermute";
        MOE_UNPERMUTE_CPU.call();
        let weights = Tensor::defined(weights)?;
        let (checked, tokens, width) = check_unpermute(
            OP,
            DeviceType::CPU,
            None,
            &y,
            None,
            &inv_perm,
            &valid,
            weights.as_ref(),
            top_k,
        )?;
        let pairs = tokens * top_k;
        let shape = permutation(tokens, top_k, width, &valid)?;
        let inv_perm = read_index(OP, "inv_perm", &inv_perm, pairs)?;
        let w = kernel_weights(checked.dtype, weights.as_ref())?;
        let w_dtype = w.as_ref().map(Tensor::dtype).transpose()?;
        let out = by_dtypes!(
            OP,
            checked.dtype,
            w_dtype,
            unpermute_typed(shape, &y, &inv_perm, w.as_ref())
        )?;
        Ok((out,))
    }
}

/// `torchgraft::moe_unpermute_backward` at CPU.
pub struct MoeUnpermuteBackwardCpu;

impl Kernel for MoeUnpermuteBackwardCpu {
    type Args = (Tensor, Tensor, Tensor, Tensor, Tensor, Option<Tensor>, i64);
    type Outputs = (Tensor, Tensor);
    fn run(
        (grad, y, perm, inv_perm, valid, weights, top_k): Self::Args,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "moe_unpermute_backward";
        MOE_UNPERMUTE_BACKWARD_CPU.call();
        let weights = Tensor::defined(weights)?;
        let (checked, tokens, width) = check_unpermute(
            OP,
            DeviceType::CPU,
            Some(&grad),
            &y,
            Some(&perm),
            &inv_perm,
            &valid,
            weights.as_ref(),
            top_k,
        )?;
        let pairs = tokens * top_k;
        let shape = permutation(tokens, top_k, width, &valid)?;
        let perm = read_index(OP, "perm", &perm, pairs)?;
        let inv_perm = read_index(OP, "inv_perm", &inv_perm, pairs)?;
        check_inverse(OP, perm.as_slice()?, inv_perm.as_slice()?)?;
        let w = kernel_weights(checked.dtype, weights.as_ref())?;
        let w_dtype = w.as_ref().map(Tensor::dtype).transpose()?;
        let (dy, dw) = by_dtypes!(
            OP,
            checked.dtype,
            w_dtype,
            backward_typed(shape, (&grad, &y), (&perm, &inv_perm), w.as_ref())
        )?;
        // The weights' gradient in the weights' dtype (computed in the kernels' weight type).
        let dw = match &weights {
            Some(w) => to_dtype(&dw, w.dtype()?)?,
            None => dw,
        };
        Ok((dy, dw))
    }
}

/// `perm` and `inv_perm` (in range) are inverse permutations: `perm[inv_perm[p]] == p`.
fn check_inverse(op: &str, perm: &[i64], inv_perm: &[i64]) -> Result<()> {
    if let Some(p) = (0..inv_perm.len()).find(|&p| perm[inv_perm[p] as usize] != p as i64) {
        return Err(graft_abi::Error::msg(format!(
            "{op}: perm and inv_perm are not inverse permutations (perm[inv_perm[{p}]] = {})",
            perm[inv_perm[p] as usize]
        )));
    }
    Ok(())
}

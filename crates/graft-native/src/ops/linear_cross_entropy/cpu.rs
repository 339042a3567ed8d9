//! The schemes' steps on CPU: graft-kernels' cross-entropy row and block kernels on torch's thread
//! pool.

use graft_abi::{DType, Device, Element};
use graft_abi::{NewTensor, Result, Tensor};
use graft_kernels::ops::cross_entropy::{self as ce, CeMath, Scale};
use graft_kernels::Float;
use half::{bf16, f16};

use super::linalg::{mm_out, product_shape, view_2d};
use super::{BlockStep, Chunk, ChunkStep, Problem};
use crate::common::tensor::acc_dtype;
use crate::common::threads::TorchPool;
use crate::ops::cross_entropy::cpu::{count_cpu, rows_cpu, CpuRows};
use crate::ops::cross_entropy::{grad_scale, Loss, Reduction};

pub(super) struct CpuStep {
    pub(super) valid: usize,
}

impl ChunkStep for CpuStep {
    fn count(&mut self, p: &Problem, loss: &Loss) -> Result<()> {
        self.valid = count_cpu(&p.target, p.vocab, loss.ignore_index)?;
        Ok(())
    }

    fn rows(&mut self, p: &Problem, loss: &Loss, c: Chunk<'_>) -> Result<()> {
        macro_rules! typed {
            ($t:ty) => {
                cpu_rows::<$t>(p, loss, c, self.valid)
            };
        }
        match p.dtype {
            DType::F32 => typed!(f32),
            DType::F64 => typed!(f64),
            DType::BF16 => typed!(bf16),
            _ => typed!(f16),
        }
    }

    fn block_stats(&mut self, p: &Problem, loss: &Loss, b: BlockStep<'_>) -> Result<()> {
        match p.dtype {
            DType::F32 => cpu_block_stats::<f32>(p, loss, b),
            DType::F64 => cpu_block_stats::<f64>(p, loss, b),
            DType::BF16 => cpu_block_stats::<bf16>(p, loss, b),
            _ => cpu_block_stats::<f16>(p, loss, b),
        }
    }

    fn block_grad(&mut self, p: &Problem, loss: &Loss, b: BlockStep<'_>) -> Result<()> {
        let all = grad_scale(loss.reduction, self.valid);
        match p.dtype {
            DType::F32 => cpu_block_grad::<f32>(p, loss, b, all),
            DType::F64 => cpu_block_grad::<f64>(p, loss, b, all),
            DType::BF16 => cpu_block_grad::<bf16>(p, loss, b, all),
            _ => cpu_block_grad::<f16>(p, loss, b, all),
        }
    }

    /// ATen has no mixed-precision matmul on the CPU: the product is in the dtype, added into
    /// the f32 accumulator.
    fn product_dtype(&self, dtype: DType) -> DType {
        dtype
    }

    fn add_product(
        &mut self,
        acc: &mut NewTensor,
        at: usize,
        tmp: &mut NewTensor,
        g: &Tensor,
        w: &Tensor,
        first: bool,
    ) -> Result<()> {
        let (rows, cols) = product_shape(g, w)?;
        mm_out(g, w, &view_2d(tmp.tensor(), rows, cols)?)?;
        let n = rows * cols;
        let acc = &mut acc.as_mut_slice::<f32>()?[at..at + n];
        match tmp.tensor().dtype()? {
            DType::BF16 => add_widened(acc, &tmp.as_mut_slice::<bf16>()?[..n], first),
            _ => add_widened(acc, &tmp.as_mut_slice::<f16>()?[..n], first),
        }
        Ok(())
    }
}

/// `acc = src` (`first`) or `acc += src`, widened to f32.
fn add_widened<T: Float<Acc = f32>>(acc: &mut [f32], src: &[T], first: bool) {
    if first {
        for (a, s) in acc.iter_mut().zip(src) {
            *a = s.to_acc();
        }
    } else {
        for (a, s) in acc.iter_mut().zip(src) {
            *a += s.to_acc();
        }
    }
}

fn cpu_block_stats<T>(p: &Problem, loss: &Loss, b: BlockStep<'_>) -> Result<()>
where
    T: Float + Element,
    T::Acc: CeMath + Element,
{
    let (start, len) = (b.start, b.len);
    let block = b.block(loss);
    let target = &p.target.as_slice::<i64>()?[start..start + len];
    let x = &b.buf.as_mut_slice::<T>()?[..len * b.cols];
    let rows = start..start + len;
    let stats = ce::BlockStats {
        max: &mut b.stats.max.as_mut_slice::<T::Acc>()?[rows.clone()],
        sum: &mut b.stats.sum.as_mut_slice::<T::Acc>()?[rows.clone()],
        target_logit: &mut b.stats.target_logit.as_mut_slice::<T::Acc>()?[rows.clone()],
        loss: if b.last {
            Some(&mut b.loss_rows.as_mut_slice::<T::Acc>()?[rows])
        } else {
            None
        },
        first: b.first,
    };
    ce::block_stats(x, target, &block, stats, &TorchPool);
    Ok(())
}

fn cpu_block_grad<T>(p: &Problem, loss: &Loss, b: BlockStep<'_>, all: f64) -> Result<()>
where
    T: Float + Element,
    T::Acc: CeMath + Element,
{
    let (start, len) = (b.start, b.len);
    let block = b.block(loss);
    let target = &p.target.as_slice::<i64>()?[start..start + len];
    let rows = b
        .row_scale
        .map(|s| s.as_slice::<T::Acc>().map(|s| &s[start..start + len]))
        .transpose()?;
    let lse = &b.stats.max.as_mut_slice::<T::Acc>()?[start..start + len];
    let x = &mut b.buf.as_mut_slice::<T>()?[..len * b.cols];
    let scale = Scale {
        all: T::Acc::from_f64(all),
        rows,
    };
    ce::block_grad(x, target, &block, lse, scale, &TorchPool);
    Ok(())
}

fn cpu_rows<T>(p: &Problem, loss: &Loss, c: Chunk<'_>, valid: usize) -> Result<()>
where
    T: Float + Element,
    T::Acc: CeMath + Element,
{
    let (v, start, len) = (p.vocab, c.start, c.len);
    let target = &p.target.as_slice::<i64>()?[start..start + len];
    let scale = c
        .row_scale
        .map(|s| s.as_slice::<T::Acc>().map(|s| &s[start..start + len]))
        .transpose()?;
    let x = &mut c.buf.as_mut_slice::<T>()?[..len * v];
    let l = &mut c.loss_rows.as_mut_slice::<T::Acc>()?[start..start + len];
    let rows = if c.grad {
        CpuRows::InPlace(x)
    } else {
        CpuRows::LossOnly(x)
    };
    rows_cpu::<T>(
        rows,
        target,
        v,
        loss,
        l,
        (grad_scale(loss.reduction, valid), scale),
    );
    Ok(())
}

pub(super) fn reduce_rows_cpu(
    rows: Tensor,
    reduction: Reduction,
    valid: usize,
    dtype: DType,
) -> Result<Tensor> {
    if reduction == Reduction::None {
        return Ok(rows);
    }
    let mean = reduction == Reduction::Mean;
    let total: f64 = if acc_dtype(dtype) == DType::F64 {
        graft_kernels::ops::cross_entropy::reduce(rows.as_slice::<f64>()?, mean, valid)
    } else {
        graft_kernels::ops::cross_entropy::reduce(rows.as_slice::<f32>()?, mean, valid) as f64
    };
    let acc = acc_dtype(dtype);
    let mut out = NewTensor::empty(&[], acc, Device::CPU)?;
    if acc == DType::F64 {
        out.as_mut_slice::<f64>()?[0] = total;
    } else {
        out.as_mut_slice::<f32>()?[0] = total as f32;
    }
    Ok(out.finish())
}

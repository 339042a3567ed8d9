//! The schemes' steps on CUDA: graft-cuda's cross-entropy row and block kernels on PyTorch's
//! current stream of the tensors' device.

use graft_abi::{DType, Error};
use graft_abi::{NewTensor, Result, Tensor};

use super::linalg::{mm_dtype_out, product_shape, slice_rows, view_2d};
use super::{BlockStep, Chunk, ChunkStep, Problem};
use crate::common::cuda::{cuda_dtype, cuda_error, ptr};
use crate::common::tensor::acc_dtype;
use crate::ops::cross_entropy::cuda::{rows_cuda, CudaCall, CudaRows};
use crate::ops::cross_entropy::{Loss, Reduction};

pub(super) struct CudaStep {
    pub(super) call: CudaCall,
    pub(super) count: Option<Tensor>,
}

impl ChunkStep for CudaStep {
    fn count(&mut self, p: &Problem, loss: &Loss) -> Result<()> {
        self.count = Some(self.call.count(&p.target, p.vocab, loss.ignore_index)?);
        Ok(())
    }

    fn rows(&mut self, p: &Problem, loss: &Loss, c: Chunk<'_>) -> Result<()> {
        let acc = acc_dtype(p.dtype).size().unwrap_or(4) as u64;
        let start = c.start as u64;
        let logits = ptr(c.buf.tensor())?;
        let count = self.count.as_ref().expect("counted first");
        rows_cuda(
            &self.call,
            &CudaRows {
                dtype: p.dtype,
                logits,
                target: ptr(&p.target)? + 8 * start,
                grad: c.grad.then_some(logits),
                loss_rows: ptr(c.loss_rows.tensor())? + acc * start,
                count: if loss.reduction == Reduction::Mean {
                    Some(ptr(count)?)
                } else {
                    None
                },
                row_scale: c
                    .row_scale
                    .map(|s| Ok::<_, Error>(ptr(s)? + acc * start))
                    .transpose()?,
                rows: c.len,
                cols: p.vocab,
            },
            loss,
        )
    }

    fn block_stats(&mut self, p: &Problem, loss: &Loss, b: BlockStep<'_>) -> Result<()> {
        let acc = acc_dtype(p.dtype).size().unwrap_or(4) as u64;
        let at = |t: &Tensor| Ok::<_, Error>(ptr(t)? + acc * b.start as u64);
        graft_cuda::cross_entropy_block_stats(&graft_cuda::CrossEntropyBlockStats {
            device: self.call.device.index,
            stream: self.call.stream,
            dtype: cuda_dtype("linear_cross_entropy", p.dtype)?,
            logits: ptr(b.buf.tensor())?,
            target: ptr(&p.target)? + 8 * b.start as u64,
            max: at(b.stats.max.tensor())?,
            sum: at(b.stats.sum.tensor())?,
            target_logit: at(b.stats.target_logit.tensor())?,
            loss: if b.last {
                Some(at(b.loss_rows.tensor())?)
            } else {
                None
            },
            first: b.first,
            rows: b.len,
            cols: b.cols,
            first_col: b.first_col,
            ignore_index: loss.ignore_index,
        })
        .map_err(cuda_error)
    }

    fn block_grad(&mut self, p: &Problem, loss: &Loss, b: BlockStep<'_>) -> Result<()> {
        let acc = acc_dtype(p.dtype).size().unwrap_or(4) as u64;
        let offset = acc * b.start as u64;
        let count = self.count.as_ref().expect("counted first");
        graft_cuda::cross_entropy_block_grad(&graft_cuda::CrossEntropyBlockGrad {
            device: self.call.device.index,
            stream: self.call.stream,
            dtype: cuda_dtype("linear_cross_entropy", p.dtype)?,
            logits: ptr(b.buf.tensor())?,
            target: ptr(&p.target)? + 8 * b.start as u64,
            lse: ptr(b.stats.max.tensor())? + offset,
            count: if loss.reduction == Reduction::Mean {
                Some(ptr(count)?)
            } else {
                None
            },
            row_scale: b
                .row_scale
                .map(|s| Ok::<_, Error>(ptr(s)? + offset))
                .transpose()?,
            rows: b.len,
            cols: b.cols,
            first_col: b.first_col,
            ignore_index: loss.ignore_index,
        })
        .map_err(cuda_error)
    }

    /// cuBLAS's bf16 / f16 x bf16 / f16 -> f32 product (aten::mm.dtype_out): no rounding of
    /// the partial products to 16 bits. (aten::addmm.dtype_out would accumulate in place, but
    /// its Scalar arguments cannot cross torch_call_dispatcher, and the AOTInductor shim does
    /// not export it: hence `tmp` and the accumulate kernel.)
    fn product_dtype(&self, _dtype: DType) -> DType {
        DType::F32
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
        if first {
            let acc_rows = slice_rows(acc.tensor(), at, at + rows * cols)?;
            return mm_dtype_out(g, w, DType::F32, &view_2d(&acc_rows, rows, cols)?);
        }
        mm_dtype_out(g, w, DType::F32, &view_2d(tmp.tensor(), rows, cols)?)?;
        graft_cuda::accumulate_f32(&graft_cuda::AccumulateF32 {
            device: self.call.device.index,
            stream: self.call.stream,
            acc: ptr(acc.tensor())? + (at * 4) as u64,
            src: ptr(tmp.tensor())?,
            n: rows * cols,
        })
        .map_err(cuda_error)
    }
}

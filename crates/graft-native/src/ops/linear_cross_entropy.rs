//! Fused linear cross-entropy: `torchgraft::linear_cross_entropy` and its backward, on CPU and
//! CUDA: `cross_entropy(hidden @ weight.T + bias, target)` computed by chunks of rows so that
//! the `(N, V)` logits never exist.
//!
//! For each chunk of `C` rows, in Rust, on the tensors' device and (CUDA) current stream:
//!
//! 1. `logits = hidden[chunk] @ weight.T (+ bias)` into one reused `(C, V)` buffer (aten::mm.out,
//!    or aten::addmm with the bias; cuBLAS on CUDA);
//! 2. the cross-entropy rows kernel writes each row's loss and replaces the logits by their
//!    gradient (already divided by the count of rows not ignored for a mean);
//! 3. `d_hidden[chunk] = d_logits @ weight` (aten::mm.out into the output's rows),
//!    `d_weight += d_logits.T @ hidden[chunk]` (aten::addmm accumulating in place; aten::mm.out
//!    for the first chunk), and the chunk's column sums of `d_logits` for `d_bias`.
//!
//! The weight gradient accumulates in the weight's dtype, in place, as Liger-Kernel's does by
//! default: no second `(V, H)` buffer (an f32 accumulator would cost `4 V H` bytes more, e.g.
//! +1 GiB at V = 128256, H = 2048, and twice the accumulator traffic per chunk). Each chunk's
//! product is computed in f32 by the GEMM and rounded once when added, so `d_weight` carries
//! one rounding per chunk (measured: 2x eager's error at 8 chunks, 4x at 32, in bf16). Larger
//! chunks mean fewer roundings and faster accumulation at the cost of a larger logits buffer.
//! The bias gradient sums per-chunk f32 column sums at the end (exact to f32).
//!
//! With `mean` / `sum` every gradient is complete after the forward: the backward only scales
//! it by the upstream gradient (`scale_grad_`). With `none` the upstream gradient is one factor
//! per row, which must multiply each row of `d_logits` before the sums over rows: the forward
//! computes the losses only, and `linear_cross_entropy_backward` runs the chunks again with
//! those factors.

use graft_abi::{aten, dispatch, ensure, DType, Device, DeviceType, Element, Error, Kernel};
use graft_abi::{NewTensor, Result, Tensor};
use graft_kernels::cross_entropy::CeMath;
use graft_kernels::Float;
use half::{bf16, f16};

use super::cross_entropy::{
    acc_dtype, check_target, count_cpu, grad_scale, ptr, rows_cpu, rows_cuda, CpuRows, CudaCall,
    CudaRows, Loss, Reduction,
};
use crate::rms_norm::contiguous;
use crate::stats::Counters;

pub static LINEAR_CROSS_ENTROPY_CPU: Counters = Counters::new();
pub static LINEAR_CROSS_ENTROPY_CUDA: Counters = Counters::new();
pub static LINEAR_CROSS_ENTROPY_BACKWARD_CPU: Counters = Counters::new();
pub static LINEAR_CROSS_ENTROPY_BACKWARD_CUDA: Counters = Counters::new();

/// Fewest rows per chunk: each chunk's `d_weight` update reads and writes the whole `(V, H)`
/// gradient, so small chunks are bound by that traffic (H100, 8192 tokens, 2048 -> 128256,
/// bf16: 34.1 ms with 256-row chunks, 22.5 ms with 1024-row ones, the same peak memory).
const MIN_CHUNK_ROWS: usize = 1024;

/// Rows per chunk when the caller leaves it to us: a logits buffer about the size of `hidden`
/// (`C V ~ N H`, Liger-Kernel's budget), in a power of two, at least [`MIN_CHUNK_ROWS`], at
/// most `rows`.
pub(crate) fn auto_chunk(rows: usize, hidden: usize, vocab: usize) -> usize {
    let budget = (rows as u128 * hidden as u128).div_ceil(vocab.max(1) as u128);
    let pow2 = (budget.max(1) as usize).next_power_of_two();
    pow2.max(MIN_CHUNK_ROWS).min(rows.max(1))
}

/// Which gradients to compute: hidden, weight, bias.
#[derive(Clone, Copy, Debug)]
struct Wanted {
    hidden: bool,
    weight: bool,
    bias: bool,
}

impl Wanted {
    fn from_mask(mask: &[bool], has_bias: bool) -> Result<Wanted> {
        ensure!(
            mask.len() == 3,
            "linear_cross_entropy: output_mask must have 3 values, got {}",
            mask.len()
        );
        Ok(Wanted {
            hidden: mask[0],
            weight: mask[1],
            bias: mask[2] && has_bias,
        })
    }

    fn any(self) -> bool {
        self.hidden || self.weight || self.bias
    }
}

/// The problem, checked: `hidden (N, H)`, `weight (V, H)`, `bias (V,)`, `target (N,)`.
struct Problem {
    hidden: Tensor,
    weight: Tensor,
    bias: Option<Tensor>,
    target: Tensor,
    rows: usize,
    vocab: usize,
    dtype: DType,
    device: Device,
}

impl Problem {
    fn new(
        op: &str,
        hidden: &Tensor,
        weight: &Tensor,
        target: &Tensor,
        bias: Option<Tensor>,
    ) -> Result<Problem> {
        let dtype = hidden.dtype()?;
        ensure!(
            matches!(dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16),
            "\"{op}\" not implemented for '{}'",
            dtype.name()
        );
        let (hs, ws) = (hidden.sizes()?, weight.sizes()?);
        ensure!(
            hs.len() == 2 && ws.len() == 2,
            "{op}: expected 2-D hidden (N, H) and weight (V, H), got {} and {} dimensions",
            hs.len(),
            ws.len()
        );
        ensure!(
            hs[1] == ws[1],
            "mat1 and mat2 shapes cannot be multiplied ({}x{} and {}x{})",
            hs[0],
            hs[1],
            ws[1],
            ws[0]
        );
        let device = hidden.device()?;
        let mut others = vec![("weight", weight)];
        if let Some(b) = bias.as_ref() {
            others.push(("bias", b));
        }
        for (name, t) in others {
            let (d, dt) = (t.device()?, t.dtype()?);
            ensure!(
                d == device,
                "Expected all tensors to be on the same device, but found at least two \
                 devices, {device} and {d}!"
            );
            ensure!(
                dt == dtype,
                "{op}: expected {name} to have dtype {}, got {}",
                dtype.name(),
                dt.name()
            );
        }
        if let Some(b) = bias.as_ref() {
            let bs = b.sizes()?;
            ensure!(
                bs.len() == 1 && bs[0] == ws[0],
                "{op}: expected bias of size [{}], got {bs:?}",
                ws[0]
            );
        }
        check_target(op, target, hs[0], device)?;
        Ok(Problem {
            hidden: contiguous(hidden)?,
            weight: contiguous(weight)?,
            bias: bias.map(|b| contiguous(&b)).transpose()?,
            target: contiguous(target)?,
            rows: hs[0] as usize,
            vocab: ws[0] as usize,
            dtype,
            device,
        })
    }

    fn hidden_size(&self) -> usize {
        self.weight.sizes().map_or(0, |s| s[1] as usize)
    }
}

fn slice_rows(t: &Tensor, start: usize, end: usize) -> Result<Tensor> {
    let (out,): (Tensor,) = dispatch::call(
        c"aten::slice",
        c"Tensor",
        (t, 0i64, Some(start as i64), Some(end as i64), 1i64),
    )?;
    Ok(out)
}

fn transpose(t: &Tensor) -> Result<Tensor> {
    let (out,): (Tensor,) = dispatch::call(c"aten::t", c"", (t,))?;
    Ok(out)
}

/// `out = a @ b` (aten::mm.out).
fn mm_out(a: &Tensor, b: &Tensor, out: &Tensor) -> Result<()> {
    let (_,): (Tensor,) = dispatch::call(c"aten::mm", c"out", (a, b, out))?;
    Ok(())
}

/// `out = sum(t, dim 0, keepdim)` in `dtype` (aten::sum.IntList_out; `out` is `(1, cols)`).
fn column_sums_out(t: &Tensor, dtype: DType, out: &Tensor) -> Result<()> {
    let dims: &[i64] = &[0];
    let (_,): (Tensor,) = dispatch::call(
        c"aten::sum",
        c"IntList_out",
        (t, Some(dims), true, Some(dtype), out),
    )?;
    Ok(())
}

fn column_sums(t: &Tensor, dtype: DType) -> Result<Tensor> {
    let dims: &[i64] = &[0];
    let (out,): (Tensor,) = dispatch::call(
        c"aten::sum",
        c"dim_IntList",
        (t, Some(dims), false, Some(dtype)),
    )?;
    Ok(out)
}

/// `t.zero_()` (aten::zero_).
fn zero_(t: &Tensor) -> Result<()> {
    let (_,): (Tensor,) = dispatch::call(c"aten::zero_", c"", (t,))?;
    Ok(())
}

fn empty(dtype: DType, device: Device) -> Result<Tensor> {
    Ok(NewTensor::empty(&[0], dtype, device)?.finish())
}

/// What one run over the chunks produces.
struct Outputs {
    loss_rows: Tensor,
    d_hidden: Tensor,
    d_weight: Tensor,
    d_bias: Tensor,
}

/// One chunk: rows `start..start + len`, whose logits fill the first `len` rows of `buf`.
struct Chunk<'a> {
    buf: &'a mut NewTensor,
    /// Every row's loss (the chunk's go to `[start..start + len]`).
    loss_rows: &'a mut NewTensor,
    /// Every row's gradient factor, when given.
    row_scale: Option<&'a Tensor>,
    start: usize,
    len: usize,
    /// Whether the gradient replaces the logits (else the losses only).
    grad: bool,
}

/// The device-specific steps: the targets' check and count, and a chunk's cross-entropy rows.
trait ChunkStep {
    /// Checks the targets and counts the rows not ignored.
    fn count(&mut self, p: &Problem, loss: &Loss) -> Result<()>;
    /// The chunk's losses, and its gradient over its logits when `c.grad`.
    fn rows(&mut self, p: &Problem, loss: &Loss, c: Chunk<'_>) -> Result<()>;
}

struct CpuStep {
    valid: usize,
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

struct CudaStep {
    call: CudaCall,
    count: Option<Tensor>,
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
}

/// The chunks: per-row losses, and the gradients in `want` (each row's gradient multiplied by
/// `row_scale[row]` when given).
fn run_chunks(
    p: &Problem,
    loss: &Loss,
    want: Wanted,
    chunk_size: i64,
    row_scale: Option<&Tensor>,
    step: &mut dyn ChunkStep,
) -> Result<Outputs> {
    let (n, v, h) = (p.rows, p.vocab, p.hidden_size());
    let (dtype, device) = (p.dtype, p.device);
    let acc = acc_dtype(dtype);
    ensure!(
        chunk_size >= 0,
        "linear_cross_entropy: chunk_size must be positive (0: automatic), got {chunk_size}"
    );
    let chunk = if chunk_size == 0 {
        auto_chunk(n, h, v)
    } else {
        (chunk_size as usize).min(n.max(1))
    };
    step.count(p, loss)?;
    let mut loss_rows = NewTensor::empty(&[n as i64], acc, device)?;
    let d_hidden = if want.hidden {
        NewTensor::empty(&[n as i64, h as i64], dtype, device)?.finish()
    } else {
        empty(dtype, device)?
    };
    let d_weight = if want.weight {
        NewTensor::empty(&[v as i64, h as i64], dtype, device)?.finish()
    } else {
        empty(dtype, device)?
    };
    let chunks = n.div_ceil(chunk.max(1));
    let bias_parts = if want.bias {
        Some(NewTensor::empty(&[chunks as i64, v as i64], acc, device)?.finish())
    } else {
        None
    };
    let grad = want.any();
    if n > 0 && v > 0 {
        let mut buf = NewTensor::empty(&[chunk as i64, v as i64], dtype, device)?;
        let weight_t = transpose(&p.weight)?;
        for i in 0..chunks {
            let start = i * chunk;
            let len = chunk.min(n - start);
            let h_chunk = slice_rows(&p.hidden, start, start + len)?;
            {
                let logits = slice_rows(buf.tensor(), 0, len)?;
                match p.bias.as_ref() {
                    Some(b) => aten::addmm_out(&logits, b, &h_chunk, &weight_t, 1.0, 1.0)?,
                    None => mm_out(&h_chunk, &weight_t, &logits)?,
                }
            }
            let chunk = Chunk {
                buf: &mut buf,
                loss_rows: &mut loss_rows,
                row_scale,
                start,
                len,
                grad,
            };
            step.rows(p, loss, chunk)?;
            if !grad {
                continue;
            }
            let d_logits = slice_rows(buf.tensor(), 0, len)?;
            if want.hidden {
                mm_out(
                    &d_logits,
                    &p.weight,
                    &slice_rows(&d_hidden, start, start + len)?,
                )?;
            }
            if want.weight {
                let d_logits_t = transpose(&d_logits)?;
                if i == 0 {
                    mm_out(&d_logits_t, &h_chunk, &d_weight)?;
                } else {
                    aten::addmm_out(&d_weight, &d_weight, &d_logits_t, &h_chunk, 1.0, 1.0)?;
                }
            }
            if let Some(parts) = bias_parts.as_ref() {
                column_sums_out(&d_logits, acc, &slice_rows(parts, i, i + 1)?)?;
            }
        }
    } else {
        // No rows or no classes (then every row is ignored): zero losses and gradients.
        for t in [loss_rows.tensor(), &d_hidden, &d_weight] {
            zero_(t)?;
        }
    }
    let d_bias = match bias_parts {
        Some(parts) if n > 0 && v > 0 => column_sums(&parts, dtype)?,
        Some(_) => {
            let d_bias = NewTensor::empty(&[v as i64], dtype, device)?.finish();
            zero_(&d_bias)?;
            d_bias
        }
        None => empty(dtype, device)?,
    };
    Ok(Outputs {
        loss_rows: loss_rows.finish(),
        d_hidden,
        d_weight,
        d_bias,
    })
}

/// Forward: `(loss, d_hidden, d_weight, d_bias)`, the gradients empty when not wanted (and for
/// `none`, whose backward computes them).
fn forward(
    hidden: &Tensor,
    weight: &Tensor,
    target: &Tensor,
    bias: Option<Tensor>,
    loss: &Loss,
    chunk_size: i64,
    mask: &[bool],
) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let bias = Tensor::defined(bias)?;
    let p = Problem::new("linear_cross_entropy", hidden, weight, target, bias)?;
    let mut want = Wanted::from_mask(mask, p.bias.is_some())?;
    if loss.reduction == Reduction::None {
        want = Wanted {
            hidden: false,
            weight: false,
            bias: false,
        };
    }
    if p.device.kind == DeviceType::CUDA {
        let mut step = CudaStep {
            call: CudaCall::new(p.device)?,
            count: None,
        };
        let out = run_chunks(&p, loss, want, chunk_size, None, &mut step)?;
        let count = step.count.take().expect("counted");
        let l = step.call.reduce(out.loss_rows, loss.reduction, &count)?;
        return Ok((l, out.d_hidden, out.d_weight, out.d_bias));
    }
    let mut step = CpuStep { valid: 0 };
    let out = run_chunks(&p, loss, want, chunk_size, None, &mut step)?;
    let l = reduce_rows_cpu(out.loss_rows, loss.reduction, step.valid, p.dtype)?;
    Ok((l, out.d_hidden, out.d_weight, out.d_bias))
}

fn reduce_rows_cpu(
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
        graft_kernels::cross_entropy::reduce(rows.as_slice::<f64>()?, mean, valid)
    } else {
        graft_kernels::cross_entropy::reduce(rows.as_slice::<f32>()?, mean, valid) as f64
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

/// Backward of `none`: the gradients with `grad_output` (one factor per row) folded into each
/// row of `d_logits`.
#[allow(clippy::too_many_arguments)]
fn backward(
    grad_output: &Tensor,
    hidden: &Tensor,
    weight: &Tensor,
    target: &Tensor,
    bias: Option<Tensor>,
    ignore_index: i64,
    chunk_size: i64,
    mask: &[bool],
) -> Result<(Tensor, Tensor, Tensor)> {
    let bias = Tensor::defined(bias)?;
    let op = "linear_cross_entropy_backward";
    let p = Problem::new(op, hidden, weight, target, bias)?;
    let want = Wanted::from_mask(mask, p.bias.is_some())?;
    let acc = acc_dtype(p.dtype);
    let gs = grad_output.sizes()?;
    ensure!(
        gs.len() == 1 && gs[0] as usize == p.rows,
        "{op}: expected grad_output of size [{}], got {gs:?}",
        p.rows
    );
    let go_device = grad_output.device()?;
    ensure!(
        go_device == p.device,
        "Expected all tensors to be on the same device, but found at least two devices, {} \
         and {go_device}!",
        p.device
    );
    let factors = contiguous(&crate::rms_norm::to_dtype(grad_output, acc)?)?;
    let loss = Loss {
        ignore_index,
        reduction: Reduction::None,
        smoothing: 0.0,
    };
    let out = if p.device.kind == DeviceType::CUDA {
        let mut step = CudaStep {
            call: CudaCall::new(p.device)?,
            count: None,
        };
        run_chunks(&p, &loss, want, chunk_size, Some(&factors), &mut step)?
    } else {
        let mut step = CpuStep { valid: 0 };
        run_chunks(&p, &loss, want, chunk_size, Some(&factors), &mut step)?
    };
    Ok((out.d_hidden, out.d_weight, out.d_bias))
}

/// Schema arguments of the forward.
type ForwardArgs = (
    Tensor,
    Tensor,
    Tensor,
    Option<Tensor>,
    i64,
    i64,
    i64,
    Vec<bool>,
);

/// `torchgraft::linear_cross_entropy` at CPU and CUDA (the device is the tensors').
pub struct LinearCrossEntropyKernel<const CUDA: bool>;
impl<const CUDA: bool> Kernel for LinearCrossEntropyKernel<CUDA> {
    type Args = ForwardArgs;
    type Outputs = (Tensor, Tensor, Tensor, Tensor);
    fn run(args: ForwardArgs) -> Result<Self::Outputs> {
        if CUDA {
            LINEAR_CROSS_ENTROPY_CUDA.call();
        } else {
            LINEAR_CROSS_ENTROPY_CPU.call();
        }
        let (hidden, weight, target, bias, ignore, reduction, chunk, mask) = args;
        let loss = Loss::new("linear_cross_entropy", ignore, reduction, 0.0)?;
        forward(&hidden, &weight, &target, bias, &loss, chunk, &mask)
    }
}

/// Schema arguments of the backward.
type BackwardArgs = (
    Tensor,
    Tensor,
    Tensor,
    Tensor,
    Option<Tensor>,
    i64,
    i64,
    Vec<bool>,
);

/// `torchgraft::linear_cross_entropy_backward` at CPU and CUDA.
pub struct LinearCrossEntropyBackwardKernel<const CUDA: bool>;
impl<const CUDA: bool> Kernel for LinearCrossEntropyBackwardKernel<CUDA> {
    type Args = BackwardArgs;
    type Outputs = (Tensor, Tensor, Tensor);
    fn run(args: BackwardArgs) -> Result<Self::Outputs> {
        if CUDA {
            LINEAR_CROSS_ENTROPY_BACKWARD_CUDA.call();
        } else {
            LINEAR_CROSS_ENTROPY_BACKWARD_CPU.call();
        }
        let (go, hidden, weight, target, bias, ignore, chunk, mask) = args;
        backward(&go, &hidden, &weight, &target, bias, ignore, chunk, &mask)
    }
}

#[cfg(test)]
mod tests {
    use super::auto_chunk;

    #[test]
    fn automatic_chunks_hold_about_the_hidden_states() {
        // Llama 3.2 1B's head at 8192 tokens: 8192 * 2048 / 128256 = 131 -> 1024 rows.
        assert_eq!(auto_chunk(8192, 2048, 128_256), 1024);
        // Never fewer than 1024 rows, never more than there are.
        assert_eq!(auto_chunk(100_000, 64, 128_256), 1024);
        assert_eq!(auto_chunk(100, 2048, 32_000), 100);
        assert_eq!(auto_chunk(0, 2048, 32_000), 1);
        // A narrow vocabulary: the buffer grows with the hidden states.
        assert_eq!(auto_chunk(65_536, 4096, 32_000), 16_384);
    }
}

//! Fused linear cross-entropy: `torchgraft::linear_cross_entropy` and its backward, on CPU and
//! CUDA: `cross_entropy(hidden @ weight.T + bias, target)` computed so that the `(N, V)` logits
//! never exist, by one of two schemes ([`choose_scheme`] picks; `chunk_size > 0` asks for the
//! first).
//!
//! **Row chunks.** For each chunk of `C` rows, in Rust, on the tensors' device and (CUDA)
//! current stream:
//!
//! 1. `logits = hidden[chunk] @ weight.T (+ bias)` into one reused `(C, V)` buffer (aten::mm.out,
//!    or aten::addmm with the bias; cuBLAS on CUDA);
//! 2. the cross-entropy rows kernel writes each row's loss and replaces the logits by their
//!    gradient (already divided by the count of rows not ignored for a mean);
//! 3. `d_hidden[chunk] = d_logits @ weight` (aten::mm.out into the output's rows),
//!    `d_weight += d_logits.T @ hidden[chunk]` (aten::addmm accumulating in place; aten::mm.out
//!    for the first chunk), and the chunk's column sums of `d_logits` for `d_bias`.
//!
//! **Two passes over vocabulary blocks** ([`run_two_pass`]). For each group of `R` rows and
//! blocks of `Vb` classes (weight rows), sizes in [`plan::two_pass_sizes`]:
//!
//! 1. pass 1, per block: `logits_blk = h_grp @ W_blk.T (+ bias_blk)` into an `(R, Vb)` buffer;
//!    the block stats kernel merges each row's running maximum and sum of exponentials (f32,
//!    online softmax) and records the target's logit; after the last block it writes
//!    `lse = m + log s` and the loss `lse - z_t` (0 for ignored rows);
//! 2. pass 2 (when a gradient is wanted), per block, the last first: the logits again (but for
//!    the last block's, which pass 1 left in the buffer); the block grad kernel
//!    writes `g = (exp(z - lse) - [j == t]) * factor` over them (`1 / count` for a mean, 1 for
//!    a sum, the row's upstream gradient in `none`'s backward, 0 for ignored rows);
//!    `d_hidden_acc += g @ W_blk` (an f32 `R x H` accumulator for bf16 / f16, rounded into
//!    `d_hidden` once per group: on CUDA cuBLAS's 16-bit -> f32 product through aten::mm.dtype_out
//!    into a buffer of half the group's rows, added by the accumulate kernel; on the CPU the
//!    product in the dtype added in f32; f32 / f64 accumulate in `d_hidden` itself);
//!    `d_weight[blk] = g.T @ h_grp` for the first group (written once), `+=` for the later
//!    ones; `d_bias` from the blocks' column sums.
//!
//! Almost one more `(N, V, H)` GEMM than the row chunks (the logits twice but for one block per
//! group), and buffers within the logits chunk Liger-Kernel would hold instead of `C x V` logits;
//! with one group (`R = N`) no read-modify-write of `d_weight` at all.
//!
//! The weight gradient accumulates in the weight's dtype, in place, as Liger-Kernel's does by
//! default: no second `(V, H)` buffer (an f32 accumulator would cost `4 V H` bytes more, e.g.
//! +1 GiB at V = 128256, H = 2048, and twice the accumulator traffic per chunk). Each chunk's
//! (group's) product is computed in f32 by the GEMM and rounded once when added, so `d_weight`
//! carries one rounding per chunk (measured for row chunks: 2x eager's error at 8 chunks, 4x at
//! 32, in bf16). Larger chunks mean fewer roundings and faster accumulation at the cost of a
//! larger buffer. The bias gradient sums per-chunk f32 column sums at the end (exact to f32).
//!
//! With `mean` / `sum` every gradient is complete after the forward: the backward only scales
//! it by the upstream gradient (`scale_grad_`). With `none` the upstream gradient is one factor
//! per row, which must multiply each row of `d_logits` before the sums over rows: the forward
//! computes the losses only, and `linear_cross_entropy_backward` runs the scheme again with
//! those factors.

mod cpu;
mod cuda;
mod linalg;
mod plan;
mod schemes;

use graft_abi::{ensure, DType, Device, DeviceType, Kernel};
use graft_abi::{Checked, NewTensor, Operands, Result, Tensor};
use graft_kernels::ops::cross_entropy as ce;

use crate::common::stats::Counters;
use crate::common::tensor::{acc_dtype, contiguous, to_dtype};
use crate::ops::cross_entropy::cuda::CudaCall;
use crate::ops::cross_entropy::{kernel_device, with_target, Loss, Reduction};
use cpu::{reduce_rows_cpu, CpuStep};
use cuda::CudaStep;
use plan::{choose_scheme, Scheme};
use schemes::{run_chunks, run_two_pass};

pub static LINEAR_CROSS_ENTROPY_CPU: Counters = Counters::new();
pub static LINEAR_CROSS_ENTROPY_CUDA: Counters = Counters::new();
pub static LINEAR_CROSS_ENTROPY_BACKWARD_CPU: Counters = Counters::new();
pub static LINEAR_CROSS_ENTROPY_BACKWARD_CUDA: Counters = Counters::new();

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
    /// Checks the operands as `F.linear` and `F.cross_entropy` would (one device and dtype,
    /// shapes that multiply, a `(rows,)` int64 target; the backward's `(rows,)` upstream
    /// gradient) and holds them contiguous.
    fn new(
        op: &str,
        kernel: DeviceType,
        (hidden, weight, target): (&Tensor, &Tensor, &Tensor),
        bias: Option<Tensor>,
        grad_output: Option<&Tensor>,
    ) -> Result<Problem> {
        let (hs, ws) = (hidden.sizes()?, weight.sizes()?);
        let (rows, vocab) = (hs.first().copied(), ws.first().copied());
        let operands = Operands::new(op, kernel)
            .tensor("hidden", hidden)
            .float()
            .dims(2)
            .message("{op}: expected 2-D hidden (N, H), got {got} dimensions")
            .tensor("weight", weight)
            .dtype_like("hidden")
            .dims(2)
            .message("{op}: expected 2-D weight (V, H), got {got} dimensions")
            .optional("bias", bias.as_ref())
            .dtype_like("hidden")
            .sizes(&[vocab.unwrap_or(0)])
            .optional("grad_output", grad_output)
            .float()
            .sizes(&[rows.unwrap_or(0)]);
        let Checked { device, dtype } = with_target(operands, target, rows.unwrap_or(0)).check()?;
        ensure!(
            hs[1] == ws[1],
            "mat1 and mat2 shapes cannot be multiplied ({}x{} and {}x{})",
            hs[0],
            hs[1],
            ws[1],
            ws[0]
        );
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

/// Per-row running statistics of the two-pass scheme (accumulation dtype, one per row).
struct RowStats {
    /// Running maximum; the log-sum-exp after pass 1.
    max: NewTensor,
    sum: NewTensor,
    target_logit: NewTensor,
}

/// One block of the two-pass scheme: classes `first_col..first_col + cols` of rows
/// `start..start + len`, whose logits fill the first `len * cols` elements of `buf`.
struct BlockStep<'a> {
    buf: &'a mut NewTensor,
    stats: &'a mut RowStats,
    /// Every row's loss (written by the last block of pass 1).
    loss_rows: &'a mut NewTensor,
    /// Every row's gradient factor, when given.
    row_scale: Option<&'a Tensor>,
    start: usize,
    len: usize,
    first_col: usize,
    cols: usize,
    first: bool,
    last: bool,
}

impl BlockStep<'_> {
    fn block(&self, loss: &Loss) -> ce::Block {
        ce::Block {
            cols: self.cols,
            first_col: self.first_col,
            ignore_index: loss.ignore_index,
        }
    }
}

/// The device-specific steps: the targets' check and count, and a chunk's cross-entropy rows.
trait ChunkStep {
    /// Checks the targets and counts the rows not ignored.
    fn count(&mut self, p: &Problem, loss: &Loss) -> Result<()>;
    /// The chunk's losses, and its gradient over its logits when `c.grad`.
    fn rows(&mut self, p: &Problem, loss: &Loss, c: Chunk<'_>) -> Result<()>;
    /// Two-pass scheme, pass 1: one block's logits merged into the rows' statistics (the
    /// losses and log-sum-exps after the last block).
    fn block_stats(&mut self, p: &Problem, loss: &Loss, b: BlockStep<'_>) -> Result<()>;
    /// Two-pass scheme, pass 2: one block's logits replaced by their gradient.
    fn block_grad(&mut self, p: &Problem, loss: &Loss, b: BlockStep<'_>) -> Result<()>;
    /// The dtype of the partial products `g @ W_blk` added into the f32 accumulator of a
    /// 16-bit `d_hidden`.
    fn product_dtype(&self, dtype: DType) -> DType;
    /// `acc = g @ w` (`first`) or `acc += g @ w` over the `g.rows x w.cols` elements of `acc`
    /// (f32) from element `at`, through the first ones of `tmp` (`product_dtype`).
    fn add_product(
        &mut self,
        acc: &mut NewTensor,
        at: usize,
        tmp: &mut NewTensor,
        g: &Tensor,
        w: &Tensor,
        first: bool,
    ) -> Result<()>;
}

/// Runs the scheme [`choose_scheme`] picks.
fn run(
    p: &Problem,
    loss: &Loss,
    want: Wanted,
    chunk_size: i64,
    row_scale: Option<&Tensor>,
    step: &mut dyn ChunkStep,
) -> Result<Outputs> {
    ensure!(
        chunk_size >= 0,
        "linear_cross_entropy: chunk_size must be positive (0: automatic), got {chunk_size}"
    );
    let (n, v, h) = (p.rows, p.vocab, p.hidden_size());
    let elem = p.dtype.size().unwrap_or(4);
    match choose_scheme(n, h, v, elem, chunk_size as usize) {
        // No rows or no classes: the row chunks' zeros.
        Scheme::TwoPass(sizes) if n > 0 && v > 0 => {
            run_two_pass(p, loss, want, sizes, row_scale, step)
        }
        Scheme::TwoPass(_) => run_chunks(p, loss, want, 1, row_scale, step),
        Scheme::RowChunks(chunk) => run_chunks(p, loss, want, chunk, row_scale, step),
    }
}

/// Forward: `(loss, d_hidden, d_weight, d_bias)`, the gradients empty when not wanted (and for
/// `none`, whose backward computes them).
#[allow(clippy::too_many_arguments)]
fn forward(
    kernel: DeviceType,
    hidden: &Tensor,
    weight: &Tensor,
    target: &Tensor,
    bias: Option<Tensor>,
    loss: &Loss,
    chunk_size: i64,
    mask: &[bool],
) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let bias = Tensor::defined(bias)?;
    let operands = (hidden, weight, target);
    let p = Problem::new("linear_cross_entropy", kernel, operands, bias, None)?;
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
        let out = run(&p, loss, want, chunk_size, None, &mut step)?;
        let count = step.count.take().expect("counted");
        let l = step.call.reduce(out.loss_rows, loss.reduction, &count)?;
        return Ok((l, out.d_hidden, out.d_weight, out.d_bias));
    }
    let mut step = CpuStep { valid: 0 };
    let out = run(&p, loss, want, chunk_size, None, &mut step)?;
    let l = reduce_rows_cpu(out.loss_rows, loss.reduction, step.valid, p.dtype)?;
    Ok((l, out.d_hidden, out.d_weight, out.d_bias))
}

/// Backward of `none`: the gradients with `grad_output` (one factor per row) folded into each
/// row of `d_logits`.
#[allow(clippy::too_many_arguments)]
fn backward(
    kernel: DeviceType,
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
    let operands = (hidden, weight, target);
    let p = Problem::new(op, kernel, operands, bias, Some(grad_output))?;
    let want = Wanted::from_mask(mask, p.bias.is_some())?;
    let acc = acc_dtype(p.dtype);
    let factors = contiguous(&to_dtype(grad_output, acc)?)?;
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
        run(&p, &loss, want, chunk_size, Some(&factors), &mut step)?
    } else {
        let mut step = CpuStep { valid: 0 };
        run(&p, &loss, want, chunk_size, Some(&factors), &mut step)?
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
        let kernel = kernel_device(CUDA);
        forward(kernel, &hidden, &weight, &target, bias, &loss, chunk, &mask)
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
        let kernel = kernel_device(CUDA);
        backward(
            kernel, &go, &hidden, &weight, &target, bias, ignore, chunk, &mask,
        )
    }
}

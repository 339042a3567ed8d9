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
//! blocks of `Vb` classes (weight rows), sizes in [`two_pass_sizes`]:
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

use graft_abi::{aten, dispatch, ensure, DType, Device, DeviceType, Element, Error, Kernel};
use graft_abi::{Checked, NewTensor, Operands, Result, Tensor};
use graft_kernels::ops::cross_entropy::{self as ce, CeMath, Scale};
use graft_kernels::Float;
use half::{bf16, f16};

use crate::common::cuda::{cuda_dtype, cuda_error, ptr};
use crate::common::stats::Counters;
use crate::common::tensor::{acc_dtype, contiguous, to_dtype};
use crate::common::threads::TorchPool;
use crate::ops::cross_entropy::cpu::{count_cpu, rows_cpu, CpuRows};
use crate::ops::cross_entropy::cuda::{rows_cuda, CudaCall, CudaRows};
use crate::ops::cross_entropy::{grad_scale, kernel_device, with_target, Loss, Reduction};

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

/// Classes per vocabulary block of the two-pass scheme (fewer when the vocabulary is smaller):
/// the fastest measured at 8192 tokens, 2048 -> 128256 on the H100 (blocks of 4096 or 6144
/// classes mean more, smaller GEMMs and more launches: 31-34 ms against 30.5).
const BLOCK_COLS: usize = 8192;

/// Sizes of the two-pass, vocabulary-blocked scheme: groups of `group_rows` rows, blocks of
/// `block_cols` classes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TwoPass {
    pub group_rows: usize,
    pub block_cols: usize,
    /// Rows per partial product `g @ W_blk` added into a 16-bit `d_hidden`'s f32 accumulator
    /// (the group's rows in slices of this many: the partial product's buffer holds one).
    pub product_rows: usize,
}

/// How the op runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scheme {
    /// Row chunks of this many rows (full `(C, V)` logits per chunk).
    RowChunks(usize),
    /// Two passes over vocabulary blocks per group of rows.
    TwoPass(TwoPass),
}

/// Bytes of the logits buffer Liger-Kernel's fused linear cross-entropy allocates for the same
/// problem: chunks of `next_power_of_two(ceil(N / ceil(V / H)))` rows of `V` logits. The
/// two-pass scheme keeps its buffers within it, so that its peak (`d_weight`, `d_hidden` and
/// those buffers, as Liger's) is never above Liger-Kernel's: issue 13's memory bound.
fn liger_chunk_bytes(rows: usize, hidden: usize, vocab: usize, elem: usize) -> u128 {
    let ratio = vocab.div_ceil(hidden.max(1)).max(1);
    let chunk = rows
        .div_ceil(ratio)
        .max(1)
        .next_power_of_two()
        .min(rows.max(1));
    chunk as u128 * vocab as u128 * elem as u128
}

/// Bytes the two-pass scheme's buffers take with groups of `r` rows and blocks of `vb` classes:
/// the logits block, and for a 16-bit dtype the f32 accumulator of `d_hidden` (`4 H` a row) and
/// the f32 partial product added into it, half the group's rows at a time (on the CPU it is in
/// the dtype, counted as f32 all the same; f32 / f64 accumulate in `d_hidden` itself).
fn two_pass_bytes(r: usize, vb: usize, hidden: usize, elem: usize) -> u128 {
    let (r, h) = (r as u128, hidden as u128);
    let logits = r * vb as u128 * elem as u128;
    if elem == 2 {
        logits + 4 * h * r + 4 * h * r.div_ceil(2)
    } else {
        logits
    }
}

/// The two-pass scheme's sizes for `rows x hidden -> vocab` in elements of `elem` bytes.
///
/// Blocks of [`BLOCK_COLS`] classes (at most `V`); groups of every row if the buffers
/// ([`two_pass_bytes`]) fit within [`liger_chunk_bytes`] less the scheme's five f32 per-row
/// vectors, else of the largest power of two of rows that fits (at least 1); partial products
/// of half a group's rows.
///
/// Llama 3.2 1B's head at 8192 tokens (2048 -> 128256), bf16: Liger-Kernel's chunk is 256 rows
/// (62.6 MiB); 2048-row groups take 32 MiB of logits, 16 MiB of accumulator and 8 MiB of
/// partial product, 56 MiB. Peak: 501 MiB (d_weight) + 32 (d_hidden) + 56 = 589 MiB, against
/// Liger's 596 (and 784 for the row chunks); 29.6-30.6 ms against Liger's 34.4-35.2 on the H100.
pub(crate) fn two_pass_sizes(rows: usize, hidden: usize, vocab: usize, elem: usize) -> TwoPass {
    let (n, v) = (rows.max(1), vocab.max(1));
    let block_cols = BLOCK_COLS.min(v);
    let budget = liger_chunk_bytes(n, hidden, v, elem).saturating_sub(5 * 4 * n as u128);
    let fits = |r: usize| two_pass_bytes(r, block_cols, hidden, elem) <= budget;
    let group_rows = if fits(n) {
        n
    } else {
        let mut r = 1usize << n.ilog2();
        while r > 1 && !fits(r) {
            r /= 2;
        }
        r
    };
    TwoPass {
        group_rows,
        block_cols,
        product_rows: group_rows.div_ceil(2),
    }
}

/// The scheme for a call: row chunks, of `chunk_size` rows or (`chunk_size == 0`) of
/// [`auto_chunk`] rows. The one place to change the rule.
///
/// The two-pass scheme is the low-memory choice, taken only when asked for: measured on the
/// H100 (bf16, forward + backward, 8192 tokens, 2048 -> 128256) row chunks take 21.5 ms and
/// +784 MiB, two passes 31.9 ms and +565 MiB (Liger-Kernel 34.3 ms, +596 MiB); at 4096 tokens
/// 10.7 against 21.7 ms (docs/losses.md).
///
/// `TORCHGRAFT_LCE_SCHEME` (read at each call) chooses: `rows` row chunks (of `chunk_size`, or
/// automatic), `two-pass` the two-pass scheme with [`two_pass_sizes`], `R,Vb` the two-pass
/// scheme with groups of `R` rows and blocks of `Vb` classes, whatever `chunk_size` is.
pub(crate) fn choose_scheme(
    rows: usize,
    hidden: usize,
    vocab: usize,
    elem: usize,
    chunk_size: usize,
) -> Scheme {
    let rows_scheme = || {
        Scheme::RowChunks(if chunk_size == 0 {
            auto_chunk(rows, hidden, vocab)
        } else {
            chunk_size.min(rows.max(1))
        })
    };
    match std::env::var("TORCHGRAFT_LCE_SCHEME")
        .ok()
        .as_deref()
        .map(str::trim)
    {
        Some("rows") => return rows_scheme(),
        Some("two-pass") => return Scheme::TwoPass(two_pass_sizes(rows, hidden, vocab, elem)),
        Some(v) => {
            if let Some(sizes) = parse_two_pass(v, rows, vocab) {
                return Scheme::TwoPass(sizes);
            }
        }
        None => {}
    }
    rows_scheme()
}

/// `R,Vb` or `R,Vb,P` (all positive): groups of `R` rows, blocks of `Vb` classes, partial
/// products of `P` rows (`R` when not given), each at most what the problem has.
fn parse_two_pass(spec: &str, rows: usize, vocab: usize) -> Option<TwoPass> {
    let sizes: Vec<usize> = spec
        .split(',')
        .map(|s| s.trim().parse::<usize>().ok().filter(|&x| x > 0))
        .collect::<Option<_>>()?;
    let (r, b, p) = match sizes[..] {
        [r, b] => (r, b, r),
        [r, b, p] => (r, b, p),
        _ => return None,
    };
    let group_rows = r.min(rows.max(1));
    Some(TwoPass {
        group_rows,
        block_cols: b.min(vocab.max(1)),
        product_rows: p.min(group_rows),
    })
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

/// `out = a @ b` in `dtype` (aten::mm.dtype_out: bf16 / f16 operands, f32 result; CUDA only).
fn mm_dtype_out(a: &Tensor, b: &Tensor, dtype: DType, out: &Tensor) -> Result<()> {
    let (_,): (Tensor,) = dispatch::call(c"aten::mm", c"dtype_out", (a, b, dtype, out))?;
    Ok(())
}

/// Columns `start..end` of a 2-D tensor (a view).
fn slice_cols(t: &Tensor, start: usize, end: usize) -> Result<Tensor> {
    let (out,): (Tensor,) = dispatch::call(
        c"aten::slice",
        c"Tensor",
        (t, 1i64, Some(start as i64), Some(end as i64), 1i64),
    )?;
    Ok(out)
}

/// The first `rows * cols` elements of the flat `t`, viewed as `(rows, cols)`.
fn view_2d(t: &Tensor, rows: usize, cols: usize) -> Result<Tensor> {
    let flat = slice_rows(t, 0, rows * cols)?;
    let sizes: &[i64] = &[rows as i64, cols as i64];
    let (out,): (Tensor,) = dispatch::call(c"aten::view", c"", (&flat, sizes))?;
    Ok(out)
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

/// The shape of `g @ w`.
fn product_shape(g: &Tensor, w: &Tensor) -> Result<(usize, usize)> {
    Ok((g.sizes()?[0] as usize, w.sizes()?[1] as usize))
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

/// The chunks: per-row losses, and the gradients in `want` (each row's gradient multiplied by
/// `row_scale[row]` when given).
fn run_chunks(
    p: &Problem,
    loss: &Loss,
    want: Wanted,
    chunk: usize,
    row_scale: Option<&Tensor>,
    step: &mut dyn ChunkStep,
) -> Result<Outputs> {
    let (n, v, h) = (p.rows, p.vocab, p.hidden_size());
    let (dtype, device) = (p.dtype, p.device);
    let acc = acc_dtype(dtype);
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

/// The gradients' outputs of a run (empty tensors for those not wanted).
fn gradient_outputs(p: &Problem, want: Wanted) -> Result<(Tensor, Tensor)> {
    let (n, v, h) = (p.rows as i64, p.vocab as i64, p.hidden_size() as i64);
    let new = |wanted: bool, sizes: &[i64]| {
        if wanted {
            Ok::<_, Error>(NewTensor::empty(sizes, p.dtype, p.device)?.finish())
        } else {
            empty(p.dtype, p.device)
        }
    };
    Ok((new(want.hidden, &[n, h])?, new(want.weight, &[v, h])?))
}

/// The two-pass, vocabulary-blocked scheme (module doc): per group of rows, pass 1 over the
/// vocabulary blocks for the rows' statistics and losses, then (when a gradient is wanted)
/// pass 2, recomputing each block's logits, for the gradients.
fn run_two_pass(
    p: &Problem,
    loss: &Loss,
    want: Wanted,
    sizes: TwoPass,
    row_scale: Option<&Tensor>,
    step: &mut dyn ChunkStep,
) -> Result<Outputs> {
    let (n, v, h) = (p.rows, p.vocab, p.hidden_size());
    let (dtype, device) = (p.dtype, p.device);
    let acc = acc_dtype(dtype);
    let (r_max, vb) = (sizes.group_rows.clamp(1, n), sizes.block_cols.clamp(1, v));
    step.count(p, loss)?;
    let mut loss_rows = NewTensor::empty(&[n as i64], acc, device)?;
    let per_row = || NewTensor::empty(&[n as i64], acc, device);
    let mut stats = RowStats {
        max: per_row()?,
        sum: per_row()?,
        target_logit: per_row()?,
    };
    let (d_hidden, d_weight) = gradient_outputs(p, want)?;
    let groups = n.div_ceil(r_max);
    let bias_parts = if want.bias {
        Some(NewTensor::empty(&[groups as i64, v as i64], acc, device)?.finish())
    } else {
        None
    };
    // 16-bit d_hidden: an f32 accumulator of the group (and the partial product added into
    // it); f32 / f64 accumulate in d_hidden's rows.
    let sixteen = dtype.size().unwrap_or(4) == 2;
    let p_rows = sizes.product_rows.clamp(1, r_max);
    let (mut hacc, mut htmp) = if want.hidden && sixteen {
        // Flat: the group's rows are the first `len * h` elements (view_2d).
        (
            Some(NewTensor::empty(&[(r_max * h) as i64], DType::F32, device)?),
            Some(NewTensor::empty(
                &[(p_rows * h) as i64],
                step.product_dtype(dtype),
                device,
            )?),
        )
    } else {
        (None, None)
    };
    let mut buf = NewTensor::empty(&[(r_max * vb) as i64], dtype, device)?;
    let grad = want.any();
    let blocks: Vec<(usize, usize)> = (0..v).step_by(vb).map(|c0| (c0, vb.min(v - c0))).collect();
    for gi in 0..groups {
        let start = gi * r_max;
        let len = r_max.min(n - start);
        let h_grp = slice_rows(&p.hidden, start, start + len)?;
        let logits_of = |buf: &NewTensor, c0: usize, cols: usize| -> Result<Tensor> {
            let logits = view_2d(buf.tensor(), len, cols)?;
            let w_t = transpose(&slice_rows(&p.weight, c0, c0 + cols)?)?;
            match p.bias.as_ref() {
                Some(b) => {
                    let b_blk = slice_rows(b, c0, c0 + cols)?;
                    aten::addmm_out(&logits, &b_blk, &h_grp, &w_t, 1.0, 1.0)?;
                }
                None => mm_out(&h_grp, &w_t, &logits)?,
            }
            Ok(logits)
        };
        // Pass 1: the statistics, the losses.
        for (k, &(c0, cols)) in blocks.iter().enumerate() {
            logits_of(&buf, c0, cols)?;
            let b = BlockStep {
                buf: &mut buf,
                stats: &mut stats,
                loss_rows: &mut loss_rows,
                row_scale,
                start,
                len,
                first_col: c0,
                cols,
                first: k == 0,
                last: k + 1 == blocks.len(),
            };
            step.block_stats(p, loss, b)?;
        }
        if !grad {
            continue;
        }
        // Pass 2: the gradients.
        let dh_grp = if want.hidden {
            Some(slice_rows(&d_hidden, start, start + len)?)
        } else {
            None
        };
        // Last block first: pass 1 left its logits in `buf` (the stats kernel only reads them).
        for (k, &(c0, cols)) in blocks.iter().rev().enumerate() {
            if k > 0 {
                logits_of(&buf, c0, cols)?;
            }
            let b = BlockStep {
                buf: &mut buf,
                stats: &mut stats,
                loss_rows: &mut loss_rows,
                row_scale,
                start,
                len,
                first_col: c0,
                cols,
                first: k == 0,
                last: k + 1 == blocks.len(),
            };
            step.block_grad(p, loss, b)?;
            let g = view_2d(buf.tensor(), len, cols)?;
            let w_blk = slice_rows(&p.weight, c0, c0 + cols)?;
            match (hacc.as_mut(), htmp.as_mut(), dh_grp.as_ref()) {
                (Some(hacc), Some(htmp), _) => {
                    for s in (0..len).step_by(p_rows) {
                        let g_rows = slice_rows(&g, s, (s + p_rows).min(len))?;
                        step.add_product(hacc, s * h, htmp, &g_rows, &w_blk, k == 0)?;
                    }
                }
                (_, _, Some(dh)) if k == 0 => mm_out(&g, &w_blk, dh)?,
                (_, _, Some(dh)) => aten::addmm_out(dh, dh, &g, &w_blk, 1.0, 1.0)?,
                _ => {}
            }
            if want.weight {
                let dw_blk = slice_rows(&d_weight, c0, c0 + cols)?;
                let g_t = transpose(&g)?;
                if gi == 0 {
                    mm_out(&g_t, &h_grp, &dw_blk)?;
                } else {
                    aten::addmm_out(&dw_blk, &dw_blk, &g_t, &h_grp, 1.0, 1.0)?;
                }
            }
            if let Some(parts) = bias_parts.as_ref() {
                let out = slice_cols(&slice_rows(parts, gi, gi + 1)?, c0, c0 + cols)?;
                column_sums_out(&g, acc, &out)?;
            }
        }
        if let (Some(hacc), Some(dh)) = (hacc.as_ref(), dh_grp.as_ref()) {
            // Rounded to the dtype once.
            dh.copy_from(&view_2d(hacc.tensor(), len, h)?)?;
        }
    }
    let d_bias = match bias_parts {
        Some(parts) => column_sums(&parts, dtype)?,
        None => empty(dtype, device)?,
    };
    Ok(Outputs {
        loss_rows: loss_rows.finish(),
        d_hidden,
        d_weight,
        d_bias,
    })
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

#[cfg(test)]
mod tests {
    use super::{
        auto_chunk, choose_scheme, liger_chunk_bytes, parse_two_pass, two_pass_bytes,
        two_pass_sizes, Scheme, TwoPass,
    };

    fn sizes(group_rows: usize, block_cols: usize, product_rows: usize) -> TwoPass {
        TwoPass {
            group_rows,
            block_cols,
            product_rows,
        }
    }

    #[test]
    fn two_pass_buffers_stay_within_ligers_chunk() {
        // Llama 3.2 1B's head, bf16: at 8192 tokens Liger's chunk is 256 rows of 128256
        // logits (62.6 MiB); 2048-row groups take 32 + 16 + 8 = 56 MiB.
        assert_eq!(liger_chunk_bytes(8192, 2048, 128_256, 2), 256 * 128_256 * 2);
        assert_eq!(
            two_pass_sizes(8192, 2048, 128_256, 2),
            sizes(2048, 8192, 1024)
        );
        assert_eq!(two_pass_bytes(2048, 8192, 2048, 2), 56 << 20);
        // At 4096 tokens Liger's chunk is 128 rows (31.3 MiB): 1024-row groups, 28 MiB.
        assert_eq!(
            two_pass_sizes(4096, 2048, 128_256, 2),
            sizes(1024, 8192, 512)
        );
        // f32 needs no accumulator: 2048 rows of 8192 logits (64 MiB of Liger's 125).
        assert_eq!(
            two_pass_sizes(8192, 2048, 128_256, 4),
            sizes(2048, 8192, 1024)
        );
        // Few rows, a small vocabulary: blocks never wider than it.
        assert_eq!(two_pass_sizes(6, 4, 7, 8).block_cols, 7);
        // Every shape: one group of every row or a power of two of them, within the budget
        // unless a single row exceeds it.
        for &(n, h, v, e) in &[
            (8192, 4096, 128_256, 2),
            (100_000, 1000, 50_000, 2),
            (6000, 768, 50_257, 2),
            (37, 24, 50, 2),
            (1, 2048, 128_256, 2),
            (65_536, 4096, 32_000, 4),
        ] {
            let s = two_pass_sizes(n, h, v, e);
            assert!(s.group_rows == n || s.group_rows.is_power_of_two(), "{s:?}");
            assert_eq!(s.block_cols, v.min(8192));
            assert_eq!(s.product_rows, s.group_rows.div_ceil(2));
            let budget = liger_chunk_bytes(n, h, v, e) - 5 * 4 * n as u128;
            assert!(
                s.group_rows == 1 || two_pass_bytes(s.group_rows, s.block_cols, h, e) <= budget,
                "{n} {h} {v} {e}: {s:?}"
            );
        }
    }

    #[test]
    fn two_pass_sizes_parse() {
        assert_eq!(
            parse_two_pass("2048,8192", 8192, 128_256),
            Some(sizes(2048, 8192, 2048))
        );
        assert_eq!(
            parse_two_pass(" 2048 , 8192 , 512 ", 8192, 128_256),
            Some(sizes(2048, 8192, 512))
        );
        // At most what the problem has.
        assert_eq!(
            parse_two_pass("4096,8192,4096", 100, 50),
            Some(sizes(100, 50, 100))
        );
        for bad in [
            "",
            "2048",
            "0,8192",
            "2048,8192,0",
            "a,b",
            "1,2,3,4",
            "-1,5",
        ] {
            assert_eq!(parse_two_pass(bad, 8192, 128_256), None, "{bad:?}");
        }
    }

    #[test]
    fn automatic_scheme_is_row_chunks() {
        // (TORCHGRAFT_LCE_SCHEME is not set under cargo test.)
        assert_eq!(
            choose_scheme(8192, 2048, 128_256, 2, 0),
            Scheme::RowChunks(1024)
        );
        // A chunk size asks for row chunks of that size.
        assert_eq!(
            choose_scheme(8192, 2048, 128_256, 2, 2048),
            Scheme::RowChunks(2048)
        );
        assert_eq!(
            choose_scheme(65_536, 4096, 32_000, 2, 0),
            Scheme::RowChunks(16_384)
        );
    }

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

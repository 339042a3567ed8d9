//! Rotary position embedding: `torchgraft::rope` and `torchgraft::rope_backward`, q and k in one
//! call, on CPU (graft-kernels) and CUDA (graft-cuda, one launch for both).
//!
//! Semantics: transformers' `apply_rotary_pos_emb` (`cos`/`sin` unsqueezed at `unsqueeze_dim`
//! and broadcast against `q` and `k`, which may have different head counts), extended as Phi-3
//! and GPT-NeoX do when `cos.size(-1)` (the rotary dim) is smaller than the head dim: the
//! remaining elements pass through. The backward applies the transposed rotation to the output
//! gradients (`cos`/`sin` get no gradient here; Python's autograd handles that case).
//!
//! Layout: inputs are read in place through their strides (q as a transposed view of a
//! `(B, S, H, D)` projection, tables broadcast over heads). The forward's outputs are dense with
//! their input's strides when the input is dense (what eager's TensorIterator gives), else
//! contiguous; the backward's are dense with the heads innermost (`OutLayout`), the layout of
//! the projections q and k are views of.

pub mod cpu;
pub mod cuda;

use graft_abi::{
    contiguous_strides, dispatch, ensure, is_dense, Checked, DType, Device, DeviceType, NewTensor,
    Operands, Result, Tensor,
};
use graft_kernels::ops::rope::coalesce;

use crate::common::tensor::contiguous;

/// `cos` and `sin` as the kernels read them: last dimension contiguous, and the sizes and
/// strides of `cos.unsqueeze(unsqueeze_dim)` (the same for `sin`).
struct Tables {
    cos: Tensor,
    sin: Tensor,
    sizes: Vec<i64>,
    cos_strides: Vec<i64>,
    sin_strides: Vec<i64>,
    rotary_dim: usize,
    /// Where `unsqueeze_dim` put the tables' size-1 dimension (the heads), in `sizes`.
    heads_at: usize,
}

impl Tables {
    fn new(op: &str, cos: &Tensor, sin: &Tensor, unsqueeze_dim: i64) -> Result<Tables> {
        let sizes = cos.sizes()?.to_vec();
        ensure!(
            sin.sizes()? == sizes.as_slice(),
            "{op}: expected sin of size {sizes:?} (the size of cos), got {:?}",
            sin.sizes()?
        );
        let rank = sizes.len() as i64;
        ensure!(
            (-rank - 1..=rank).contains(&unsqueeze_dim),
            "Dimension out of range (expected to be in range of [{}, {rank}], but got \
             {unsqueeze_dim})",
            -rank - 1
        );
        ensure!(
            rank >= 1,
            "{op}: cos and sin must have at least one dimension"
        );
        // The kernels read table rows as contiguous runs.
        let last_contiguous = |t: &Tensor| -> Result<Tensor> {
            if sizes[sizes.len() - 1] > 1 && t.strides()?[sizes.len() - 1] != 1 {
                contiguous(t)
            } else {
                t.new_ref()
            }
        };
        let (cos, sin) = (last_contiguous(cos)?, last_contiguous(sin)?);
        let at = if unsqueeze_dim < 0 {
            unsqueeze_dim + rank + 1
        } else {
            unsqueeze_dim
        } as usize;
        let unsqueeze = |strides: &[i64]| {
            let mut s = strides.to_vec();
            s.insert(at, 0);
            s
        };
        let mut usizes = sizes.clone();
        usizes.insert(at, 1);
        let rotary_dim = usizes[usizes.len() - 1] as usize;
        ensure!(
            rotary_dim.is_multiple_of(2),
            "{op}: the rotary dimension (the last size of cos, unsqueezed: {usizes:?}) must be \
             even, got {rotary_dim}"
        );
        Ok(Tables {
            cos_strides: unsqueeze(cos.strides()?),
            sin_strides: unsqueeze(sin.strides()?),
            cos,
            sin,
            sizes: usizes,
            rotary_dim,
            heads_at: at,
        })
    }
}

/// One operand (q or k, or a gradient) ready for the kernels: its input, its (dense) output,
/// and three leading dimensions with the strides of the input, the tables and the output.
struct Operand {
    x: Tensor,
    out: NewTensor,
    cos: Tensor,
    sin: Tensor,
    sizes: [usize; 3],
    x_strides: [usize; 3],
    cos_strides: [usize; 3],
    sin_strides: [usize; 3],
    head_dim: usize,
}

/// The strides of each of `x`'s leading dimensions in a table of `table_sizes` / `strides`
/// broadcast against it (aligned at the right, 0 where the table has size 1 or no dimension).
fn broadcast(
    op: &str,
    name: &str,
    x_sizes: &[i64],
    table_sizes: &[i64],
    strides: &[i64],
) -> Result<Vec<i64>> {
    let lead = x_sizes.len() - 1;
    let table_lead = table_sizes.len() - 1;
    let error = || {
        graft_abi::Error::msg(format!(
            "{op}: cos and sin (unsqueezed: {table_sizes:?}) must broadcast to {name}'s size \
             {x_sizes:?} without expanding it"
        ))
    };
    if table_lead > lead {
        return Err(error());
    }
    (0..lead)
        .map(|i| {
            let Some(j) = (i + table_lead).checked_sub(lead) else {
                return Ok(0);
            };
            match table_sizes[j] {
                s if s == x_sizes[i] && s != 1 => Ok(strides[j]),
                1 => Ok(0),
                _ => Err(error()),
            }
        })
        .collect()
}

/// A copy of `t` (or of its view with `view` sizes and strides) into a new tensor of `sizes` and
/// `strides`.
fn copy_to(
    t: &Tensor,
    view: Option<(&[i64], &[i64])>,
    sizes: &[i64],
    strides: &[i64],
) -> Result<Tensor> {
    let out = NewTensor::empty_strided(sizes, strides, t.dtype()?, t.device()?)?.finish();
    match view {
        Some((vs, vst)) => {
            let none = None::<i64>;
            let (v,): (Tensor,) = dispatch::call(c"aten::as_strided", c"", (t, vs, vst, none))?;
            out.copy_from(&v)?;
        }
        None => out.copy_from(t)?,
    }
    Ok(out)
}

/// The strides of a dense tensor of `sizes` whose leading dimension `heads` is the innermost
/// before the last: the layout of `(batch, seq, heads, dim)` projections that q and k are
/// transposed views of, whatever the order of `sizes`.
fn heads_innermost_strides(sizes: &[i64], heads: usize) -> Vec<i64> {
    let lead = sizes.len() - 1;
    let mut order: Vec<usize> = (0..lead).filter(|&i| i != heads).collect();
    order.push(heads);
    order.push(lead);
    let mut strides = vec![0; sizes.len()];
    let mut next = 1;
    for &i in order.iter().rev() {
        strides[i] = next;
        next *= sizes[i].max(1);
    }
    strides
}

/// The layout of an operand's output.
#[derive(Clone, Copy)]
enum OutLayout {
    /// The input's strides when the input is dense (what eager's elementwise ops give), else
    /// contiguous: the forward.
    LikeInput,
    /// Dense with the heads innermost (see [`heads_innermost_strides`]): the backward. The
    /// output gradients usually arrive contiguous `(batch, heads, seq, dim)` (SDPA's backward
    /// gives them so) while q and k are views of `(batch, seq, heads * dim)` projections; in the
    /// projections' layout the gradients reach them with no copy, and each table row serves the
    /// consecutive heads of its token.
    HeadsInnermost,
}

impl Operand {
    fn new(
        op: &str,
        name: &str,
        x: &Tensor,
        tables: &Tables,
        layout: OutLayout,
    ) -> Result<Operand> {
        let sizes = x.sizes()?.to_vec();
        ensure!(
            !sizes.is_empty(),
            "{op}: {name} must have at least one dimension"
        );
        let head_dim = sizes[sizes.len() - 1] as usize;
        let r = tables.rotary_dim;
        ensure!(
            r <= head_dim,
            "{op}: the rotary dimension {r} (the last size of cos) exceeds {name}'s head \
             dimension {head_dim}"
        );
        let cos_lead = broadcast(op, name, &sizes, &tables.sizes, &tables.cos_strides)?;
        let sin_lead = broadcast(op, name, &sizes, &tables.sizes, &tables.sin_strides)?;
        // The kernels read rows as contiguous runs.
        let x = if head_dim > 1 && x.strides()?[sizes.len() - 1] != 1 {
            contiguous(x)?
        } else {
            x.new_ref()?
        };
        let (cos, sin) = (tables.cos.new_ref()?, tables.sin.new_ref()?);
        let x_strides = x.strides()?.to_vec();
        // The heads' dimension of x: the tables' broadcast one, aligned at the right.
        let heads = (sizes.len() + tables.heads_at)
            .checked_sub(tables.sizes.len())
            .filter(|&h| h + 1 < sizes.len());
        let out_strides = match (layout, heads) {
            (OutLayout::HeadsInnermost, Some(h)) => heads_innermost_strides(&sizes, h),
            _ if is_dense(&sizes, &x_strides) => x_strides.clone(),
            _ => contiguous_strides(&sizes),
        };
        let out = NewTensor::empty_strided(&sizes, &out_strides, x.dtype()?, x.device()?)?;
        let mut operand = Operand {
            x,
            out,
            cos,
            sin,
            sizes: [0; 3],
            x_strides: [0; 3],
            cos_strides: [0; 3],
            sin_strides: [0; 3],
            head_dim,
        };
        if operand.x.numel()? == 0 {
            operand.sizes = [0, 1, 1];
            return Ok(operand);
        }
        if !operand.plan(&sizes, &x_strides, &out_strides, &cos_lead, &sin_lead) {
            // More than three leading dimensions that no layout lets merge: copy the input and
            // the broadcast tables into the output's layout, in which every dimension merges.
            operand.x = copy_to(&operand.x, None, &sizes, &out_strides)?;
            let lead = sizes.len() - 1;
            let mut t_sizes = sizes.clone();
            t_sizes[lead] = r as i64;
            // The output's strides scaled from rows of head_dim to rows of r elements.
            let t_strides: Vec<i64> = (0..=lead)
                .map(|i| match i {
                    _ if i == lead => 1,
                    _ if sizes[i] == 1 => 0,
                    _ => out_strides[i] / head_dim as i64 * r as i64,
                })
                .collect();
            let table = |t: &Tensor, lead_strides: &[i64]| -> Result<Tensor> {
                let mut view_strides = lead_strides.to_vec();
                view_strides.push(1);
                copy_to(t, Some((&t_sizes, &view_strides)), &t_sizes, &t_strides)
            };
            operand.cos = table(&tables.cos, &cos_lead)?;
            operand.sin = table(&tables.sin, &sin_lead)?;
            let t_lead = &t_strides[..lead];
            let planned = operand.plan(&sizes, &out_strides, &out_strides, t_lead, t_lead);
            ensure!(planned, "{op}: internal error: no plan for a dense layout");
        }
        Ok(operand)
    }

    /// Orders the leading dimensions as the output lies in memory, merges what every operand
    /// allows and keeps the result if at most three dimensions remain.
    fn plan(
        &mut self,
        sizes: &[i64],
        x_strides: &[i64],
        out_strides: &[i64],
        cos_strides: &[i64],
        sin_strides: &[i64],
    ) -> bool {
        let lead = sizes.len() - 1;
        let mut order: Vec<usize> = (0..lead).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(out_strides[i]));
        let pick = |v: &[i64]| -> Vec<usize> { order.iter().map(|&i| v[i] as usize).collect() };
        let (s, x, o, c, n) = (
            pick(sizes),
            pick(x_strides),
            pick(out_strides),
            pick(cos_strides),
            pick(sin_strides),
        );
        match coalesce(&s, [&x, &o, &c, &n]) {
            Some((sizes, [x, _, c, n])) => {
                self.sizes = sizes;
                self.x_strides = x;
                self.cos_strides = c;
                self.sin_strides = n;
                true
            }
            None => false,
        }
    }
}

/// A planned call: both operands and what they share.
struct Call {
    dtype: DType,
    device: Device,
    rotary_dim: usize,
    ops: [Operand; 2],
}

impl Call {
    /// Checks the operands (one device, one floating dtype; the shapes in [`Tables::new`] and
    /// [`Operand::new`]) and plans the call.
    fn new(
        op: &str,
        kernel: DeviceType,
        backward: bool,
        x: [&Tensor; 2],
        cos: &Tensor,
        sin: &Tensor,
        unsqueeze_dim: i64,
    ) -> Result<Call> {
        let names = if backward {
            ["grad_q", "grad_k"]
        } else {
            ["q", "k"]
        };
        let Checked { device, dtype } = Operands::new(op, kernel)
            .tensor(names[0], x[0])
            .float()
            .tensor(names[1], x[1])
            .dtype_like(names[0])
            .tensor("cos", cos)
            .dtype_like(names[0])
            .tensor("sin", sin)
            .dtype_like(names[0])
            .check()?;
        let tables = Tables::new(op, cos, sin, unsqueeze_dim)?;
        let layout = if backward {
            OutLayout::HeadsInnermost
        } else {
            OutLayout::LikeInput
        };
        let ops = [
            Operand::new(op, names[0], x[0], &tables, layout)?,
            Operand::new(op, names[1], x[1], &tables, layout)?,
        ];
        Ok(Call {
            dtype,
            device,
            rotary_dim: tables.rotary_dim,
            ops,
        })
    }

    fn outputs(self) -> (Tensor, Tensor) {
        let [q, k] = self.ops;
        (q.out.finish(), k.out.finish())
    }
}

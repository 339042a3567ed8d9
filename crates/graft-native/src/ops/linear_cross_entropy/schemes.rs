//! The two schemes, each driving a [`ChunkStep`] (the device's kernels) over the problem: row
//! chunks ([`run_chunks`]) and two passes over vocabulary blocks ([`run_two_pass`]).

use graft_abi::{aten, DType, Error};
use graft_abi::{NewTensor, Result, Tensor};

use super::linalg::{
    column_sums, column_sums_out, empty, mm_out, slice_cols, slice_rows, transpose, view_2d, zero_,
};
use super::plan::TwoPass;
use super::{BlockStep, Chunk, ChunkStep, Outputs, Problem, RowStats, Wanted};
use crate::common::tensor::acc_dtype;
use crate::ops::cross_entropy::Loss;

/// The chunks: per-row losses, and the gradients in `want` (each row's gradient multiplied by
/// `row_scale[row]` when given).
pub(super) fn run_chunks(
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
pub(super) fn run_two_pass(
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

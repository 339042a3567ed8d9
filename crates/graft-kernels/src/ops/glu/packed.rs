//! Gated linear units over packed rows: each row of `gate_up` holds `[gate | up]`, `cols`
//! elements each (the output of a fused gate-and-up projection, as transformers' MoE experts
//! compute it), `y` holds `cols` elements a row, and the backward's gradient is packed like
//! `gate_up`. Each row's halves go through the same span code as [`super::forward`] and
//! [`super::backward`]: only the index map is new.

use super::{
    backward_in_place_span, backward_span, forward_span, kernels, Activation, GluMath, CHUNK,
};
use crate::blocks;
use crate::float::Float;
use crate::parallel::Parallel;

/// The number of rows, checking that every buffer holds `rows` rows of its width (`2 * cols`
/// for `gate_up` and its gradient, `cols` for `y` / `dy`). `cols == 0` has no rows.
fn packed_rows(cols: usize, gate_up: usize, halves: &[(&str, usize)]) -> usize {
    let rows = gate_up.checked_div(2 * cols).unwrap_or(0);
    assert_eq!(
        gate_up,
        rows * 2 * cols,
        "glu packed: gate_up has {gate_up} elements, not rows of 2 * {cols}"
    );
    for (name, len) in halves {
        assert_eq!(
            *len,
            rows * cols,
            "glu packed: {name} has {len} elements, expected {rows} rows of {cols}"
        );
    }
    rows
}

/// Rows per work item: about [`CHUNK`] output elements, at least one row.
fn rows_per_item(cols: usize) -> usize {
    (CHUNK / cols).max(1)
}

/// `y[r, j] = act(gate_up[r, j]) * gate_up[r, cols + j]`.
///
/// # Panics
/// If `gate_up` is not whole rows of `2 * cols` or `y` not as many rows of `cols`.
pub fn forward_packed<T: Float>(
    act: Activation,
    cols: usize,
    gate_up: &[T],
    y: &mut [T],
    par: &dyn Parallel,
) where
    T::Acc: GluMath,
{
    if packed_rows(cols, gate_up.len(), &[("y", y.len())]) == 0 {
        return;
    }
    let kernel = kernels::<T>();
    let per = rows_per_item(cols);
    let items: Vec<&mut [T]> = y.chunks_mut(per * cols).collect();
    blocks::for_each(par, items, per * cols, |i, y| {
        let gate_up = &gate_up[i * per * 2 * cols..][..2 * y.len()];
        for (gu, y) in gate_up.chunks_exact(2 * cols).zip(y.chunks_exact_mut(cols)) {
            let (gate, up) = gu.split_at(cols);
            forward_span(kernel, act, gate, up, y);
        }
    });
}

/// `d_gate_up[r, j] = dy[r, j] * up * act'(gate)`, `d_gate_up[r, cols + j] = dy[r, j] *
/// act(gate)` with `gate = gate_up[r, j]`, `up = gate_up[r, cols + j]`.
///
/// # Panics
/// If `gate_up` and `d_gate_up` are not whole rows of `2 * cols` or `dy` not as many rows of
/// `cols`.
pub fn backward_packed<T: Float>(
    act: Activation,
    cols: usize,
    gate_up: &[T],
    dy: &[T],
    d_gate_up: &mut [T],
    par: &dyn Parallel,
) where
    T::Acc: GluMath,
{
    let rows = packed_rows(cols, gate_up.len(), &[("dy", dy.len())]);
    packed_rows(cols, d_gate_up.len(), &[("dy", dy.len())]);
    if rows == 0 {
        return;
    }
    let kernel = kernels::<T>();
    let per = rows_per_item(cols);
    let items: Vec<&mut [T]> = d_gate_up.chunks_mut(per * 2 * cols).collect();
    blocks::for_each(par, items, per * cols, |i, out| {
        let gate_up = &gate_up[i * per * 2 * cols..][..out.len()];
        let dy = &dy[i * per * cols..][..out.len() / 2];
        let rows = gate_up.chunks_exact(2 * cols).zip(dy.chunks_exact(cols));
        for ((gu, dy), out) in rows.zip(out.chunks_exact_mut(2 * cols)) {
            let (gate, up) = gu.split_at(cols);
            let (dgate, dup) = out.split_at_mut(cols);
            backward_span(kernel, act, gate, up, dy, dgate, dup);
        }
    });
}

/// [`backward_packed`] writing the packed gradient over `gate_up` (no output buffer: the
/// in-place backward). Each element of `gate_up` and `dy` is read before the same element is
/// written.
///
/// # Panics
/// If `gate_up` is not whole rows of `2 * cols` or `dy` not as many rows of `cols`.
pub fn backward_packed_in_place<T: Float>(
    act: Activation,
    cols: usize,
    gate_up: &mut [T],
    dy: &[T],
    par: &dyn Parallel,
) where
    T::Acc: GluMath,
{
    if packed_rows(cols, gate_up.len(), &[("dy", dy.len())]) == 0 {
        return;
    }
    let kernel = kernels::<T>();
    let per = rows_per_item(cols);
    let items: Vec<&mut [T]> = gate_up.chunks_mut(per * 2 * cols).collect();
    blocks::for_each(par, items, per * cols, |i, gate_up| {
        let dy = &dy[i * per * cols..][..gate_up.len() / 2];
        for (gu, dy) in gate_up
            .chunks_exact_mut(2 * cols)
            .zip(dy.chunks_exact(cols))
        {
            let (gate, up) = gu.split_at_mut(cols);
            backward_in_place_span(kernel, act, gate, up, dy);
        }
    });
}

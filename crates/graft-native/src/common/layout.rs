//! Output strides of RMSNorm as torch's meta functions give them, computed in Rust.
//!
//! torch.compile (fake tensors) and every caller that inspects strides see what the meta
//! function says, so a graft must return exactly those layouts. On the meta device the forward
//! is ATen's composite (`rms_norm_composite`: `x.to(opmath)`, `pow`, `mean(keepdim)`, `add_`,
//! `rsqrt`, `mul`, `mul`, `.contiguous()` unless the input suggests channels-last, `type_as`);
//! the backward's meta function is the Python decomposition
//! `torch._decomp.decompositions._fused_rms_norm_backward`. In a Python process the elementwise
//! and reduction ops inside both run torch's Python meta functions (torch._refs over prims, whose
//! output order comes from `torch._prims_common.compute_elementwise_output_logical_to_physical_perm`);
//! `to`, `contiguous` and `expand` run their C++ ones. Asking them at run time would run Python
//! (and import torch._dynamo) on the native call path, so this module replays their rules: c10's
//! contiguity and channels-last tests, `to_will_alias`, `infer_dense_strides`, `inferExpandGeometry`,
//! and prims' stride sort. tests/reliability/test_reliability_layouts.py holds it to torch's meta
//! functions over hundreds of random layouts.

use graft_abi::contiguous_strides;

/// Sizes and strides (in elements) of one tensor.
#[derive(Clone, Copy, Debug)]
pub struct Shape<'a> {
    pub sizes: &'a [i64],
    pub strides: &'a [i64],
}

/// A tensor's layout as an owned value (an intermediate of the replayed computation).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Owned {
    sizes: Vec<i64>,
    strides: Vec<i64>,
}

impl Owned {
    fn of(t: Shape<'_>) -> Owned {
        Owned {
            sizes: t.sizes.to_vec(),
            strides: t.strides.to_vec(),
        }
    }

    fn contiguous(sizes: &[i64]) -> Owned {
        Owned {
            sizes: sizes.to_vec(),
            strides: contiguous_strides(sizes),
        }
    }

    fn shape(&self) -> Shape<'_> {
        Shape {
            sizes: &self.sizes,
            strides: &self.strides,
        }
    }
}

/// c10's `compute_contiguous`: row-major, ignoring the strides of size-1 dims.
pub fn is_contiguous(t: Shape<'_>) -> bool {
    if t.sizes.contains(&0) {
        return true;
    }
    let mut expected = 1;
    for (&size, &stride) in t.sizes.iter().zip(t.strides).rev() {
        if size != 1 {
            if stride != expected {
                return false;
            }
            expected *= size;
        }
    }
    true
}

/// The dims of a 4-d (channels-last) or 5-d (channels-last-3d) tensor, innermost first.
fn channels_last_order(dim: usize) -> Option<&'static [usize]> {
    match dim {
        4 => Some(&[1, 3, 2, 0]),
        5 => Some(&[1, 4, 3, 2, 0]),
        _ => None,
    }
}

/// c10's `compute_channels_last_contiguous_2d` / `_3d`: dense in channels-last order.
fn is_channels_last_contiguous(t: Shape<'_>) -> bool {
    let Some(order) = channels_last_order(t.sizes.len()) else {
        return false;
    };
    let mut expected = 1;
    for &d in order {
        if t.sizes[d] != 1 {
            if t.strides[d] != expected {
                return false;
            }
            expected *= t.sizes[d];
        }
    }
    true
}

/// c10's `is_channels_last_strides_2d_s4` / `_3d_s5`: strides ordered like channels-last, with
/// the ambiguous cases (trivial C, N1..1 tensors) read as contiguous.
fn is_channels_last_strides(t: Shape<'_>) -> bool {
    let Some(order) = channels_last_order(t.sizes.len()) else {
        return false;
    };
    if t.strides[1] == 0 {
        return false;
    }
    let mut min = 0;
    for &d in order {
        if t.sizes[d] == 0 || t.strides[d] < min {
            return false;
        }
        if d == 0 && min == t.strides[1] {
            return false;
        }
        min = t.strides[d];
        if t.sizes[d] > 1 {
            min *= t.sizes[d];
        }
    }
    true
}

/// Whether `Tensor::suggest_memory_format()` is channels-last (2d for 4-d tensors, 3d for 5-d).
pub fn suggests_channels_last(t: Shape<'_>) -> bool {
    match t.sizes.len() {
        // A 5-d tensor that is channels-last-3d contiguous is never "channels-last 2d"-like;
        // is_channels_last_strides only answers for its own dimensionality anyway.
        4 | 5 => is_channels_last_strides(t),
        _ => false,
    }
}

/// c10's `is_non_overlapping_and_dense` (including its contiguous shortcuts).
fn is_non_overlapping_and_dense(t: Shape<'_>) -> bool {
    if is_contiguous(t) || (t.sizes.len() == 4 && is_channels_last_contiguous(t)) {
        return true;
    }
    if t.sizes.len() == 1 {
        return t.sizes[0] < 2 || t.strides[0] == 1;
    }
    // Dims of size >= 2 by increasing stride must tile memory exactly; ties cannot (so the order
    // among equal strides does not matter).
    let mut dims: Vec<usize> = (0..t.sizes.len()).filter(|&d| t.sizes[d] >= 2).collect();
    dims.sort_by_key(|&d| t.strides[d]);
    let mut expected = 1;
    for d in dims {
        if t.strides[d] != expected {
            return false;
        }
        expected *= t.sizes[d];
    }
    true
}

/// ATen's `infer_dense_strides`: dense strides in the order of `t`'s strides (the layout
/// `.to(dtype)` gives a tensor that is not dense).
fn infer_dense_strides(t: Shape<'_>) -> Vec<i64> {
    let dim = t.sizes.len();
    if dim == 0 {
        return Vec::new();
    }
    if dim == 1 {
        return vec![1];
    }
    let should_swap = |d0: usize, d1: usize| -> i32 {
        let (s0, s1) = (t.strides[d0], t.strides[d1]);
        if s0 == 0 || s1 == 0 {
            0
        } else if s0 != s1 {
            if s0 < s1 {
                -1
            } else {
                1
            }
        } else if t.sizes[d0] > t.sizes[d1] {
            1
        } else {
            0
        }
    };
    let perm = sort_dims(dim, should_swap);
    let mut strides = vec![0; dim];
    let mut next = 1;
    for &d in &perm {
        strides[d] = next;
        if t.sizes[d] > 1 {
            next *= t.sizes[d];
        }
    }
    strides
}

/// TensorIterator's insertion sort of dims from the fastest-moving, with ambiguous comparisons
/// (`should_swap` returns 1 to swap, -1 to stop, 0 when it cannot tell); prims and
/// `infer_dense_strides` use the same one.
fn sort_dims(dim: usize, should_swap: impl Fn(usize, usize) -> i32) -> Vec<usize> {
    let mut perm: Vec<usize> = (0..dim).rev().collect();
    for i in 1..dim {
        let mut d1 = i;
        for d0 in (0..i).rev() {
            match should_swap(perm[d0], perm[d1]) {
                c if c > 0 => {
                    perm.swap(d0, d1);
                    d1 = d0;
                }
                c if c < 0 => break,
                _ => {}
            }
        }
    }
    perm
}

/// `t.to(other dtype)` with the default `memory_format=preserve`: same strides when dense, else
/// dense strides in the same order.
fn to_other_dtype(t: &Owned) -> Owned {
    if is_non_overlapping_and_dense(t.shape()) {
        t.clone()
    } else {
        Owned {
            sizes: t.sizes.clone(),
            strides: infer_dense_strides(t.shape()),
        }
    }
}

/// `t.to(dtype, memory_format=torch.contiguous_format)`: `t` itself (whatever its strides)
/// when it has that dtype and does not suggest another memory format (ATen's `to_will_alias`),
/// else a fresh contiguous tensor.
fn to_contiguous_format(t: &Owned, same_dtype: bool) -> Owned {
    if same_dtype && !suggests_channels_last(t.shape()) {
        t.clone()
    } else {
        Owned::contiguous(&t.sizes)
    }
}

/// `t.contiguous()`: `t` itself when contiguous, else a contiguous copy.
fn contiguous(t: &Owned) -> Owned {
    if is_contiguous(t.shape()) {
        t.clone()
    } else {
        Owned::contiguous(&t.sizes)
    }
}

/// The broadcast shape of `inputs` (all assumed broadcastable).
fn broadcast_shape(inputs: &[Shape<'_>]) -> Vec<i64> {
    let dim = inputs.iter().map(|t| t.sizes.len()).max().unwrap_or(0);
    let mut shape = vec![1; dim];
    for t in inputs {
        let offset = dim - t.sizes.len();
        for (i, &size) in t.sizes.iter().enumerate() {
            if size != 1 {
                shape[offset + i] = size;
            }
        }
    }
    shape
}

/// `t.expand(shape)` (ATen's `inferExpandGeometry`): broadcast dims get stride 0, a new leading
/// dim of size 1 the stride that would make it contiguous with the next.
fn expand(t: Shape<'_>, shape: &[i64]) -> Owned {
    let dim = shape.len();
    let offset = dim - t.sizes.len();
    let mut strides = vec![0; dim];
    for i in (0..dim).rev() {
        let (size, stride) = match i.checked_sub(offset) {
            Some(j) => (t.sizes[j], t.strides[j]),
            None if i + 1 < dim => (1, shape[i + 1] * strides[i + 1]),
            None => (1, 1),
        };
        strides[i] = if size != shape[i] { 0 } else { stride };
    }
    Owned {
        sizes: shape.to_vec(),
        strides,
    }
}

/// torch._prims_common's `compute_elementwise_output_logical_to_physical_perm` for tensors of one
/// shape: contiguous or channels-last inputs keep that order, otherwise dims are sorted by stride
/// (TensorIterator's insertion sort and tie-breaks), skipping broadcast (0) strides.
fn output_perm(tensors: &[Shape<'_>]) -> Vec<usize> {
    let Some(first) = tensors.first() else {
        return Vec::new();
    };
    let dim = first.sizes.len();
    if dim <= 1 {
        return (0..dim).collect();
    }
    let contiguous = tensors.iter().all(|&t| is_contiguous(t));
    let channels_last = dim == 4 && tensors.iter().all(|&t| is_channels_last_contiguous(t));
    if contiguous && !channels_last {
        return (0..dim).collect();
    }
    if channels_last && !contiguous {
        return vec![0, 2, 3, 1];
    }
    let shape = first.sizes;
    // prims' `ge`: a >= b, or a is a multiple of b (0 counts as larger than anything).
    let ge = |a: i64, b: i64| b == 0 || (a != 0 && (a >= b || a % b == 0));
    let should_swap = |a: usize, b: usize| -> i32 {
        for t in tensors {
            let (sa, sb) = (t.strides[a], t.strides[b]);
            if sa == 0 || sb == 0 {
                continue;
            }
            if sa == sb {
                if ge(shape[b], shape[a]) {
                    continue;
                }
                return 1;
            }
            if ge(sb, sa) {
                return -1;
            }
            if ge(sa, sb) {
                return 1;
            }
        }
        0
    };
    let mut perm = sort_dims(dim, should_swap);
    perm.reverse();
    perm
}

/// Strides of `torch.empty_permuted(sizes, perm)`: contiguous in the physical order `perm`.
fn permuted_strides(sizes: &[i64], perm: &[usize]) -> Vec<i64> {
    let physical: Vec<i64> = perm.iter().map(|&d| sizes[d]).collect();
    let contiguous = contiguous_strides(&physical);
    let mut strides = vec![0; sizes.len()];
    for (i, &d) in perm.iter().enumerate() {
        strides[d] = contiguous[i];
    }
    strides
}

/// `prims.convert_element_type(t, dtype)`: dense strides are kept, others become those of
/// `torch.empty_like(t)`.
fn convert_element_type(t: Owned) -> Owned {
    if is_non_overlapping_and_dense(t.shape()) {
        return t;
    }
    let strides = permuted_strides(&t.sizes, &output_perm(&[t.shape()]));
    Owned {
        sizes: t.sizes,
        strides,
    }
}

/// The output of an elementwise op as its meta function (a torch._refs reference over prims)
/// lays it out: the inputs (already in the computation dtype) are broadcast, then the output is
/// `empty_permuted` in the order [`output_perm`] finds. 0-dim inputs stand for Python numbers
/// (CPU scalars) and take no part.
fn elementwise(inputs: &[Shape<'_>]) -> Owned {
    let tensors: Vec<Shape<'_>> = inputs
        .iter()
        .copied()
        .filter(|t| !t.sizes.is_empty())
        .collect();
    let shape = broadcast_shape(&tensors);
    let expanded: Vec<Owned> = tensors.iter().map(|&t| expand(t, &shape)).collect();
    let shapes: Vec<Shape<'_>> = expanded.iter().map(Owned::shape).collect();
    let strides = permuted_strides(&shape, &output_perm(&shapes));
    Owned {
        sizes: shape,
        strides,
    }
}

/// rstd's sizes: the batch dims, then a 1 for each normalized dim.
pub fn rstd_sizes(input_sizes: &[i64], normalized_dims: usize) -> Vec<i64> {
    let batch = input_sizes.len() - normalized_dims;
    input_sizes[..batch]
        .iter()
        .copied()
        .chain(std::iter::repeat_n(1, normalized_dims))
        .collect()
}

/// Strides of the forward's outputs (y, rstd) for an input whose trailing `normalized_dims` dims
/// are normalized and a weight shaped like them. `opmath_input`: the input already has the
/// accumulation dtype (float32 / float64), so the composite's `to(opmath)` is a no-op; the
/// weight comes with the same flag of its own.
pub fn forward_strides(
    input: Shape<'_>,
    normalized_dims: usize,
    weight: Option<(Shape<'_>, bool)>,
    opmath_input: bool,
) -> (Vec<i64>, Vec<i64>) {
    let input_owned = Owned::of(input);
    let up = if opmath_input {
        input_owned
    } else {
        to_other_dtype(&input_owned)
    };
    // mean(keepdim) allocates its output contiguous; add_ is in place; rsqrt of a contiguous
    // tensor is contiguous.
    let rstd = Owned::contiguous(&rstd_sizes(input.sizes, normalized_dims));
    let mut y = elementwise(&[up.shape(), rstd.shape()]);
    if let Some((weight, opmath_weight)) = weight {
        // A weight of another dtype is converted to the computation dtype first.
        let weight = match opmath_weight {
            true => Owned::of(weight),
            false => convert_element_type(Owned::of(weight)),
        };
        y = elementwise(&[y.shape(), weight.shape()]);
    }
    if !suggests_channels_last(input) {
        y = contiguous(&y);
    }
    if !opmath_input {
        y = to_other_dtype(&y);
    }
    (y.strides, rstd.strides)
}

/// Strides of the backward's grad_input, replaying the decomposition that is its meta function.
/// `opmath_input`: input and grad_out have the accumulation dtype; the weight comes with the
/// same flag of its own.
pub fn backward_input_strides(
    grad_out: Shape<'_>,
    input: Shape<'_>,
    normalized_dims: usize,
    rstd: Shape<'_>,
    weight: Option<(Shape<'_>, bool)>,
    opmath_input: bool,
) -> Vec<i64> {
    let sizes = input.sizes;
    let batch = sizes.len() - normalized_dims;
    let rows: i64 = sizes[..batch].iter().product();
    let cols: i64 = sizes[batch..].iter().product();
    if rows == 0 || cols == 0 {
        return contiguous_strides(sizes); // input.new_zeros(input.shape)
    }
    let grad_out = to_contiguous_format(&Owned::of(grad_out), opmath_input);
    let input = to_contiguous_format(&Owned::of(input), opmath_input);
    let mut rstd = Owned::of(rstd);
    while rstd.sizes.len() < sizes.len() {
        // unsqueeze(-1): a trailing dim of size 1 and stride 1.
        rstd.sizes.push(1);
        rstd.strides.push(1);
    }
    let grad_x_hat = match weight {
        Some((w, opmath_weight)) => elementwise(&[
            grad_out.shape(),
            to_contiguous_format(&Owned::of(w), opmath_weight).shape(),
        ]),
        None => grad_out,
    };
    let x_hat = elementwise(&[input.shape(), rstd.shape()]);
    // sum(x_hat * grad_x_hat, inner dims, keepdim) allocates its output contiguous.
    let sum_val = Owned::contiguous(&rstd_sizes(sizes, normalized_dims));
    let scalar = Shape {
        sizes: &[],
        strides: &[],
    };
    let scaled = elementwise(&[x_hat.shape(), scalar]); // x_hat / N
    let product = elementwise(&[scaled.shape(), sum_val.shape()]);
    let difference = elementwise(&[grad_x_hat.shape(), product.shape()]);
    let d_input = elementwise(&[difference.shape(), rstd.shape()]);
    if opmath_input {
        d_input.strides
    } else {
        to_other_dtype(&d_input).strides
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape<'a>(sizes: &'a [i64], strides: &'a [i64]) -> Shape<'a> {
        Shape { sizes, strides }
    }

    #[test]
    fn contiguous_inputs_give_contiguous_outputs() {
        let (y, rstd) = forward_strides(shape(&[2, 3, 8], &[24, 8, 1]), 1, None, true);
        assert_eq!(y, vec![24, 8, 1]);
        assert_eq!(rstd, vec![3, 1, 1]);
    }

    #[test]
    fn channels_last_is_recognized_like_c10() {
        // NCHW = 2,3,4,8 in channels-last memory.
        assert!(suggests_channels_last(shape(
            &[2, 3, 4, 8],
            &[96, 1, 24, 3]
        )));
        assert!(!suggests_channels_last(shape(
            &[2, 3, 4, 8],
            &[96, 32, 8, 1]
        )));
        // N111: ambiguous, read as contiguous.
        assert!(!suggests_channels_last(shape(&[4, 1, 1, 1], &[1, 1, 1, 1])));
    }

    #[test]
    fn transposed_input_keeps_its_order_through_elementwise_ops() {
        // An (8, 6) tensor transposed to (6, 8): strides (1, 6).
        let out = elementwise(&[shape(&[6, 8], &[1, 6])]);
        assert_eq!(out.strides, vec![1, 6]);
    }

    #[test]
    fn infer_dense_strides_closes_gaps() {
        assert_eq!(infer_dense_strides(shape(&[4, 8], &[32, 2])), vec![8, 1]);
        assert_eq!(infer_dense_strides(shape(&[6, 8], &[2, 12])), vec![1, 6]);
    }
}

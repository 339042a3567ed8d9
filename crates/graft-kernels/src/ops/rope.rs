//! Rotary position embedding in transformers' `rotate_half` convention, over strided rows.
//!
//! Each row `x` of `head_dim` elements becomes, over its first `rotary_dim` elements (halves
//! `x1 = x[..h]`, `x2 = x[h..rotary_dim]`, `h = rotary_dim / 2`),
//!
//! ```text
//! forward:   out1 = x1 cos1 - x2 sin1          out2 = x2 cos2 + x1 sin2
//! backward:  out1 = g1 cos1 + g2 sin2          out2 = g2 cos2 - g1 sin1
//! ```
//!
//! (`out = x cos + rotate_half(x) sin` and its transpose), and its remaining elements are copied
//! (partial rotary embeddings, as Phi-3 and GPT-NeoX apply them). Arithmetic in `T::Acc`, each
//! output rounded once.
//!
//! Rows are addressed through up to three leading dimensions with per-operand strides, so that
//! transposed views (`q` as `(B, S, H, D).transpose(1, 2)`) and broadcast tables (`cos` shared by
//! every head: stride 0) are read in place. The output is dense: its rows are the row-major
//! enumeration of the leading dimensions. [`coalesce`] brings any layout to that form.

use crate::blocks;
use crate::float::Float;
use crate::isa::Isa;
use crate::parallel::Parallel;
use crate::simd::portable::Portable;
#[cfg(target_arch = "x86_64")]
use crate::simd::x86::{Avx2, Avx512};
use crate::simd::{load_part, store_part, Lanes, Simd};
use crate::tables::select_table;

/// One operand (`q` or `k`, or their gradients) of a rope call.
#[derive(Clone, Copy, Debug)]
pub struct RopeOperand<'a, T> {
    /// Sizes of the three leading dimensions (row `(i0, i1, i2)` is output row
    /// `(i0 * sizes[1] + i1) * sizes[2] + i2`).
    pub sizes: [usize; 3],
    /// The input's elements (from its first), and the strides of its leading dimensions; each row
    /// is `head_dim` consecutive elements.
    pub x: &'a [T],
    /// Strides of `x`'s leading dimensions, in elements.
    pub x_strides: [usize; 3],
    /// The cosine table's elements; each row is `rotary_dim` consecutive elements.
    pub cos: &'a [T],
    /// Strides of the cosine rows (0 where one row serves many).
    pub cos_strides: [usize; 3],
    /// The sine table, like `cos`.
    pub sin: &'a [T],
    /// Strides of the sine rows.
    pub sin_strides: [usize; 3],
    /// Elements per row of `x` and of the output.
    pub head_dim: usize,
    /// Leading elements of each row that are rotated (even, at most `head_dim`).
    pub rotary_dim: usize,
}

impl<T> RopeOperand<'_, T> {
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.sizes.iter().product()
    }

    /// The offsets of row `r`'s first element in `x`, `cos` and `sin`.
    #[inline(always)]
    fn offsets(&self, r: usize) -> (usize, usize, usize) {
        let i2 = r % self.sizes[2];
        let i01 = r / self.sizes[2];
        let (i0, i1) = (i01 / self.sizes[1], i01 % self.sizes[1]);
        let at = |s: &[usize; 3]| i0 * s[0] + i1 * s[1] + i2 * s[2];
        (
            at(&self.x_strides),
            at(&self.cos_strides),
            at(&self.sin_strides),
        )
    }

    /// Panics unless every row lies inside the buffers and the dimensions are consistent.
    fn check(&self, out_len: usize) {
        let (d, r) = (self.head_dim, self.rotary_dim);
        assert!(
            r.is_multiple_of(2) && r <= d,
            "rope: rotary_dim {r} must be even and at most head_dim {d}"
        );
        assert_eq!(out_len, self.rows() * d, "rope: output length");
        if self.rows() == 0 {
            return;
        }
        let last = |s: &[usize; 3]| (0..3).map(|i| (self.sizes[i] - 1) * s[i]).sum::<usize>();
        for (name, len, strides, row) in [
            ("x", self.x.len(), &self.x_strides, d),
            ("cos", self.cos.len(), &self.cos_strides, r),
            ("sin", self.sin.len(), &self.sin_strides, r),
        ] {
            assert!(
                last(strides) + row <= len,
                "rope: the rows of {name} reach past its {len} elements"
            );
        }
    }
}

/// Output rows per task handed to the parallel-for (about 8 Ki elements).
fn rows_per_task(head_dim: usize) -> usize {
    (1usize << 13).div_ceil(head_dim.max(1))
}

/// Writes the rope of `op` (forward, or its backward when `backward`) into `out`, dense rows in
/// the order of `op`'s leading dimensions.
///
/// # Panics
/// If `rotary_dim` is odd or exceeds `head_dim`, or any row lies outside its buffer, or `out`
/// does not hold `rows * head_dim` elements.
pub fn rope<T: Float>(op: &RopeOperand<'_, T>, backward: bool, out: &mut [T], par: &dyn Parallel) {
    op.check(out.len());
    if out.is_empty() {
        return;
    }
    let block = rows_per_task(op.head_dim);
    let chunk = block * op.head_dim;
    let kernel = kernel::<T>();
    let tasks: Vec<&mut [T]> = out.chunks_mut(chunk).collect();
    blocks::for_each(par, tasks, chunk, |i, out| match kernel {
        Some(kernel) => kernel(op, backward, i * block, out),
        None => rows_scalar(op, backward, i * block, out),
    });
}

/// `(op, backward, first, out)`: [`rows_lanes`] over a block of output rows.
type RowsFn<T> = fn(&RopeOperand<'_, T>, bool, usize, &mut [T]);

/// The vector kernel for `T` and [`Isa::current`]; `None` for element types other than `f32`,
/// `f64`, `bf16` and `f16` (computed one element at a time: [`rows_scalar`]).
fn kernel<T: Float>() -> Option<RowsFn<T>> {
    let isa = Isa::current();
    select_table!(|N| {
        let rows: RowsFn<N> = match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                |op, bwd, first, out| x86::avx512::rows(Avx512::get(), op, bwd, first, out)
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => |op, bwd, first, out| x86::avx2::rows(Avx2::get(), op, bwd, first, out),
            _ => |op, bwd, first, out| rows_lanes(Portable, op, bwd, first, out),
        };
        rows
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{rows_lanes, RopeOperand};
    use crate::simd::{Lanes, Simd};

    crate::vectorize::x86_entry_points! { [avx2, avx512]
        /// [`rows_lanes`] compiled for the token `S`.
        fn rows<T>(s: S, op: &RopeOperand<'_, T>, backward: bool, first: usize, out: &mut [T])
        where [T: Lanes<S>, S: Simd<T::Acc>]
        { rows_lanes(s, op, backward, first, out) }
    }
}

/// [`rope`] over the output rows `out` (whole rows) starting at row `first`, one element at a
/// time (element types without vector kernels).
fn rows_scalar<T: Float>(op: &RopeOperand<'_, T>, backward: bool, first: usize, out: &mut [T]) {
    let (d, h) = (op.head_dim, op.rotary_dim / 2);
    for (k, out) in out.chunks_exact_mut(d).enumerate() {
        let (xo, co, so) = op.offsets(first + k);
        let (x, cos, sin) = (&op.x[xo..xo + d], &op.cos[co..], &op.sin[so..]);
        for j in 0..h {
            let (x1, x2) = (x[j].to_acc(), x[j + h].to_acc());
            let (c1, c2) = (cos[j].to_acc(), cos[j + h].to_acc());
            let (s1, s2) = (sin[j].to_acc(), sin[j + h].to_acc());
            let (o1, o2) = if backward {
                (x1 * c1 + x2 * s2, x2 * c2 - x1 * s1)
            } else {
                (x1 * c1 - x2 * s1, x2 * c2 + x1 * s2)
            };
            out[j] = T::from_acc(o1);
            out[j + h] = T::from_acc(o2);
        }
        out[2 * h..].copy_from_slice(&x[2 * h..]);
    }
}

/// [`rope`] over the output rows `out` starting at row `first`, in vectors of the token `S`.
#[inline(always)]
fn rows_lanes<S, T>(s: S, op: &RopeOperand<'_, T>, backward: bool, first: usize, out: &mut [T])
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
{
    let (d, h, lanes) = (op.head_dim, op.rotary_dim / 2, S::LANES);
    for (k, out) in out.chunks_exact_mut(d).enumerate() {
        let (xo, co, so) = op.offsets(first + k);
        let (x, cos, sin) = (
            &op.x[xo..xo + d],
            &op.cos[co..co + 2 * h],
            &op.sin[so..so + 2 * h],
        );
        let (out1, out2) = out[..2 * h].split_at_mut(h);
        let mut j = 0;
        while j < h {
            let n = lanes.min(h - j);
            let (x1, x2) = (load_n(s, x, j, n), load_n(s, x, j + h, n));
            let (c1, c2) = (load_n(s, cos, j, n), load_n(s, cos, j + h, n));
            let (s1, s2) = (load_n(s, sin, j, n), load_n(s, sin, j + h, n));
            let (o1, o2) = if backward {
                (
                    s.mul_add(x1, c1, s.mul(x2, s2)),
                    s.sub(s.mul(x2, c2), s.mul(x1, s1)),
                )
            } else {
                (
                    s.sub(s.mul(x1, c1), s.mul(x2, s1)),
                    s.mul_add(x2, c2, s.mul(x1, s2)),
                )
            };
            store_n(s, o1, &mut out1[j..j + n]);
            store_n(s, o2, &mut out2[j..j + n]);
            j += n;
        }
        out[2 * h..].copy_from_slice(&x[2 * h..]);
    }
}

/// `v[at..at + n]` as a vector (`n <= S::LANES`; missing lanes read as zero). A function, not a
/// closure: closures do not inherit the entry points' target features.
#[inline(always)]
fn load_n<S, T>(s: S, v: &[T], at: usize, n: usize) -> S::V
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
{
    if n == S::LANES {
        T::load(s, &v[at..at + n])
    } else {
        load_part(s, &v[at..at + n])
    }
}

/// Stores the first `dst.len()` (at most `S::LANES`) lanes of `v`.
#[inline(always)]
fn store_n<S, T>(s: S, v: S::V, dst: &mut [T])
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
{
    if dst.len() == S::LANES {
        T::store(s, v, dst)
    } else {
        store_part(s, v, dst)
    }
}

/// The leading dimensions of `N` operands of one shape, simplified: size-1 dimensions dropped,
/// neighbours merged where every operand's strides allow (`stride[i] == stride[i + 1] *
/// size[i + 1]`), and padded in front to three. `None` if more than three remain.
///
/// The order of the dimensions is kept, so a dense operand listed in its memory order stays
/// dense in row-major order.
pub fn coalesce<const N: usize>(
    sizes: &[usize],
    strides: [&[usize]; N],
) -> Option<([usize; 3], [[usize; 3]; N])> {
    if sizes.contains(&0) {
        return Some(([0, 1, 1], [[0; 3]; N]));
    }
    let mut dims: Vec<(usize, [usize; N])> = Vec::with_capacity(sizes.len());
    for (i, &size) in sizes.iter().enumerate() {
        if size == 1 {
            continue;
        }
        let st: [usize; N] = std::array::from_fn(|k| strides[k][i]);
        if let Some((outer, outer_st)) = dims.last_mut() {
            if (0..N).all(|k| outer_st[k] == st[k] * size) {
                *outer *= size;
                *outer_st = st;
                continue;
            }
        }
        dims.push((size, st));
    }
    if dims.len() > 3 {
        return None;
    }
    let mut out_sizes = [1usize; 3];
    let mut out_strides = [[0usize; 3]; N];
    let pad = 3 - dims.len();
    for (i, (size, st)) in dims.into_iter().enumerate() {
        out_sizes[pad + i] = size;
        for k in 0..N {
            out_strides[k][pad + i] = st[k];
        }
    }
    Some((out_sizes, out_strides))
}

#[cfg(test)]
mod tests {
    use super::coalesce;

    #[test]
    fn coalesce_merges_what_every_operand_allows() {
        // The rows of a transposed (B, S, H, D) view listed in memory order (B, S, H), with cos
        // broadcast over H: B and S merge for both; H cannot join them (cos has stride 0 there).
        let (b, s, h, d) = (2, 5, 4, 8);
        let x = [s * h * d, h * d, d];
        let cos = [s * d, d, 0];
        let (sizes, [xs, cs]) = coalesce(&[b, s, h], [&x, &cos]).unwrap();
        assert_eq!(sizes, [1, b * s, h]);
        assert_eq!(xs, [0, h * d, d]);
        assert_eq!(cs, [0, d, 0]);
    }

    #[test]
    fn coalesce_drops_unit_dims_and_pads() {
        let (sizes, [st]) = coalesce(&[1, 6, 1], [&[99, 4, 77]]).unwrap();
        assert_eq!(sizes, [1, 1, 6]);
        assert_eq!(st, [0, 0, 4]);
    }

    #[test]
    fn coalesce_gives_up_beyond_three_dims() {
        let sizes = [2, 3, 4, 5];
        let a = [60, 20, 5, 1];
        let b = [0, 5, 0, 1]; // broadcast in the 1st and 3rd dims: nothing merges
        assert!(coalesce(&sizes, [&a, &b]).is_none());
        assert!(coalesce(&sizes, [&a]).is_some());
    }

    #[test]
    fn empty_shapes_have_no_rows() {
        let (sizes, _) = coalesce(&[3, 0, 2, 7, 1], [&[0, 0, 0, 0, 0]]).unwrap();
        assert_eq!(sizes.iter().product::<usize>(), 0);
    }
}

//! A gradient multiplied by per-row factors, through the scratch and the ISA's conversions.

use super::{row_scale, CeMath, Scale, TASK_ELEMS};
use crate::blocks;
use crate::float::{Acc, Float};
use crate::isa::Isa;
use crate::ops::convert::Convert;
use crate::parallel::Parallel;
use crate::vectorize::{self, Job};

/// Elements converted at a time through the scratch when scaling.
const PIECE: usize = 4096;

/// What a scaling task reads and writes.
enum ScaleData<'a, T> {
    Into { src: &'a [T], dst: &'a mut [T] },
    InPlace(&'a mut [T]),
}

/// Elements `first..first + len` of a gradient of rows of `cols`, times their row's factor:
/// widened into the scratch, multiplied, narrowed (the ISA's vectorized conversions). In place,
/// pieces whose factor is exactly 1 are left alone.
struct ScaleTask<'a, T: Float> {
    data: ScaleData<'a, T>,
    first: usize,
    cols: usize,
    scale: Scale<'a, T::Acc>,
    scratch: &'a mut [T::Acc],
    widen: fn(&[T], &mut [T::Acc]),
    narrow: fn(&[T::Acc], &mut [T]),
}

impl<T: Float> Job for ScaleTask<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let ScaleTask {
            mut data,
            first,
            cols,
            scale,
            scratch,
            widen,
            narrow,
        } = self;
        let len = match &data {
            ScaleData::Into { dst, .. } => dst.len(),
            ScaleData::InPlace(x) => x.len(),
        };
        let mut i = 0;
        while i < len {
            let row = (first + i) / cols;
            let end = len.min(i + PIECE).min((row + 1) * cols - first);
            let f = row_scale(&scale, row);
            let buf = &mut scratch[..end - i];
            match &mut data {
                ScaleData::Into { src, dst } => {
                    widen(&src[i..end], buf);
                    for v in buf.iter_mut() {
                        *v = *v * f;
                    }
                    narrow(buf, &mut dst[i..end]);
                }
                ScaleData::InPlace(_) if f == T::Acc::ONE => {}
                ScaleData::InPlace(x) => {
                    widen(&x[i..end], buf);
                    for v in buf.iter_mut() {
                        *v = *v * f;
                    }
                    narrow(buf, &mut x[i..end]);
                }
            }
            i = end;
        }
    }
}

/// Checks the shapes of a scaling (rows of `cols`, per-row factors matching).
#[track_caller]
fn check_scale<A>(len: usize, cols: usize, scale: &Scale<'_, A>) {
    let rows = len / cols;
    assert_eq!(rows * cols, len, "cross_entropy: scale rows");
    if let Some(r) = scale.rows {
        assert_eq!(r.len(), rows, "cross_entropy: per-row scale length");
    }
}

/// Runs the scaling tasks over `items` (each `TASK_ELEMS` elements but the last).
fn run_scale<'a, T: Float>(
    items: Vec<ScaleData<'a, T>>,
    cols: usize,
    scale: Scale<'a, T::Acc>,
    par: &dyn Parallel,
) where
    T::Acc: CeMath,
{
    let isa = Isa::current();
    let table = Convert::<T>::new();
    blocks::for_each(par, items, TASK_ELEMS, |i, data| {
        T::Acc::with_scratch(PIECE, |scratch| {
            vectorize::run_with(
                isa,
                ScaleTask {
                    data,
                    first: i * TASK_ELEMS,
                    cols,
                    scale,
                    scratch,
                    widen: table.widen,
                    narrow: table.narrow,
                },
            );
        });
    });
}

/// `grad *= scale` row by row (rows of `cols`), in place; elements whose factor is exactly 1
/// are not touched.
///
/// # Panics
/// If `grad.len()` is not a multiple of `cols`, or the per-row factors do not match the rows.
pub fn scale_in_place<T: Float>(
    grad: &mut [T],
    cols: usize,
    scale: Scale<'_, T::Acc>,
    par: &dyn Parallel,
) where
    T::Acc: CeMath,
{
    let cols = cols.max(1);
    check_scale(grad.len(), cols, &scale);
    let items = grad
        .chunks_mut(TASK_ELEMS)
        .map(ScaleData::InPlace)
        .collect();
    run_scale(items, cols, scale, par);
}

/// `dst = src * scale` row by row (rows of `cols`), each element rounded once.
///
/// # Panics
/// As [`scale_in_place`], or if `dst` and `src` differ in length.
pub fn scale_into<T: Float>(
    src: &[T],
    dst: &mut [T],
    cols: usize,
    scale: Scale<'_, T::Acc>,
    par: &dyn Parallel,
) where
    T::Acc: CeMath,
{
    assert_eq!(src.len(), dst.len(), "cross_entropy: scale_into lengths");
    let cols = cols.max(1);
    check_scale(src.len(), cols, &scale);
    let items = src
        .chunks(TASK_ELEMS)
        .zip(dst.chunks_mut(TASK_ELEMS))
        .map(|(src, dst)| ScaleData::Into { src, dst })
        .collect();
    run_scale(items, cols, scale, par);
}

//! Kernel tables: an op's kernels for one element type, compiled for one instruction set, as
//! function pointers. The SIMD kernels exist for `f32`, `f64`, `bf16` and `f16`; an op generic
//! over any [`crate::Float`] finds `T`'s table among theirs with [`select_table`].

use std::any::Any;

/// `table` if it is a `Table`: for tables generic over the element type, if it was built for
/// `Table`'s.
pub(crate) fn downcast<Built: Any, Table: Any + Copy>(table: Built) -> Option<Table> {
    (&table as &dyn Any).downcast_ref::<Table>().copied()
}

/// The table the context asks for (e.g. `Option<Kernels<T>>`) among those `$build` makes for
/// each element type with SIMD kernels, `$n` standing for that type (`f32`, then `f64`, `bf16`
/// and `f16`: `$build` is type-checked for each); `None` if `T` is none of them.
///
/// ```ignore
/// let kernels: Option<Kernels<T>> = select_table!(|N| match isa {
///     Isa::Avx2 => Kernels::<N> { forward: |r| x86::avx2::forward(Avx2::get(), r) },
///     _ => portable::<N>(),
/// });
/// ```
macro_rules! select_table {
    (|$n:ident| $build:expr) => {{
        use $crate::tables::downcast;
        downcast({
            type $n = f32;
            $build
        })
        .or_else(|| {
            downcast({
                type $n = f64;
                $build
            })
        })
        .or_else(|| {
            downcast({
                type $n = ::half::bf16;
                $build
            })
        })
        .or_else(|| {
            downcast({
                type $n = ::half::f16;
                $build
            })
        })
    }};
}

pub(crate) use select_table;

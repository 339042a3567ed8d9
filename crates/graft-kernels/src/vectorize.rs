//! Compiling generic kernels for an instruction set. Kernels are written once, generic over a
//! token ([`crate::simd`]) or as plain loops over lane arrays (a [`Job`]), `#[inline(always)]`
//! throughout; an entry point per x86 token ([`x86_entry_points`]) compiles them, inlined, with
//! that token's target features, where the compiler vectorizes them with its vectors.

use crate::isa::Isa;

/// Work to compile per instruction set. `run` must be `#[inline(always)]` (and so must every
/// function it calls in its loops), or it is compiled once, for the baseline target.
pub(crate) trait Job {
    /// What the work returns.
    type Output;
    /// Does the work.
    fn run(self) -> Self::Output;
}

/// Runs `job` compiled for `isa` (an instruction set this CPU has: [`Isa::current`] taken on the
/// calling thread, so that work handed to other threads uses the same one).
#[inline]
pub(crate) fn run_with<J: Job>(isa: Isa, job: J) -> J::Output {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            let token = crate::simd::x86::Avx512::detect();
            x86::avx512::run(token.expect("AVX-512 work on a CPU without it"), job)
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            let token = crate::simd::x86::Avx2::detect();
            x86::avx2::run(token.expect("AVX2 work on a CPU without it"), job)
        }
        _ => job.run(),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Job;

    super::x86_entry_points! { [avx2, avx512]
        /// Runs `job`, its loops compiled (inlined) with this token's features.
        fn run<J>(_: S, job: J) -> J::Output
        where [J: Job]
        { job.run() }
    }
}

/// Defines, in the calling module, one module per x86 token named in brackets, holding the
/// listed functions compiled with that token's target features:
///
/// ```ignore
/// x86_entry_points! { [avx2, avx512]
///     /// [`rows::forward`] compiled for the token `S`.
///     fn forward<T>(s: S, rows: ForwardRows<'_, T>)
///     where [T: Lanes<S>, T::Acc: Lanes<S>, S: Simd<T::Acc>]
///     { rows::forward(s, rows) }
/// }
/// ```
///
/// gives `avx2::forward(token: Avx2, rows)` and `avx512::forward(token: Avx512, rows)`, visible
/// to the caller's parent (the op, whose `mod x86` calls the macro); in each module `S` names
/// its token type, and `use super::*` brings in the caller's imports. The body
/// runs in a `#[target_feature]` function that the token argument makes safe to call; whatever
/// it calls in its loops must be `#[inline(always)]` (a closure is compiled on its own, without
/// the features). Write `_: S` for a body that does not use the token.
///
/// The modules:
/// - `avx2`: AVX2, FMA and F16C ([`crate::simd::x86::Avx2`]);
/// - `avx512`: AVX-512F on top ([`crate::simd::x86::Avx512`]);
/// - `avx512_bf16` (with `avx512`): the body compiled once more with AVX512-BF16, AVX512-DQ
///   and AVX512-BW and a token that uses them ([`crate::simd::x86::Avx512::with_bf16`]), run
///   where the CPU has them; elsewhere the `avx512` function runs.
#[cfg(target_arch = "x86_64")]
macro_rules! x86_entry_points {
    (@module avx2 $($fns:tt)*) => {
        /// The entry points compiled for AVX2, FMA and F16C.
        pub(super) mod avx2 {
            use super::*;
            /// This module's token.
            type S = $crate::simd::x86::Avx2;
            $crate::vectorize::x86_entry_points!(@fns "avx2,fma,f16c"; $($fns)*);
        }
    };
    (@module avx512 $($fns:tt)*) => {
        /// The entry points compiled for AVX-512F, AVX2, FMA and F16C.
        pub(super) mod avx512 {
            use super::*;
            /// This module's token.
            type S = $crate::simd::x86::Avx512;
            $crate::vectorize::x86_entry_points!(@fns "avx512f,avx2,fma,f16c"; $($fns)*);
        }
    };
    (@module avx512_bf16 $($fns:tt)*) => {
        /// The entry points compiled for AVX-512F, AVX512-BF16, AVX512-DQ, AVX512-BW, AVX2, FMA
        /// and F16C where the CPU has them, else those of `avx512`.
        pub(super) mod avx512_bf16 {
            use super::*;
            /// This module's token.
            type S = $crate::simd::x86::Avx512;
            $crate::vectorize::x86_entry_points!(@bf16_fns $($fns)*);
        }
    };

    // The functions of `avx2` and `avx512`, one at a time.
    (@fns $features:literal;) => {};
    (@fns $features:literal;
        $(#[$attr:meta])*
        fn $name:ident<$($g:ident),*>(_: S $(, $arg:ident: $ty:ty)*) $(-> $ret:ty)?
        where [$($bound:tt)*]
        $body:block
        $($rest:tt)*
    ) => {
        $(#[$attr])*
        #[allow(clippy::too_many_arguments)]
        pub(in super::super) fn $name<$($g),*>(_: S $(, $arg: $ty)*) $(-> $ret)?
        where
            $($bound)*
        {
            #[target_feature(enable = $features)]
            #[allow(clippy::too_many_arguments)]
            unsafe fn compiled<$($g),*>($($arg: $ty),*) $(-> $ret)?
            where
                $($bound)*
            $body
            // SAFETY: the token argument proves that this CPU has this module's features.
            unsafe { compiled($($arg),*) }
        }
        $crate::vectorize::x86_entry_points!(@fns $features; $($rest)*);
    };
    (@fns $features:literal;
        $(#[$attr:meta])*
        fn $name:ident<$($g:ident),*>($s:ident: S $(, $arg:ident: $ty:ty)*) $(-> $ret:ty)?
        where [$($bound:tt)*]
        $body:block
        $($rest:tt)*
    ) => {
        $(#[$attr])*
        #[allow(clippy::too_many_arguments)]
        pub(in super::super) fn $name<$($g),*>($s: S $(, $arg: $ty)*) $(-> $ret)?
        where
            $($bound)*
        {
            #[target_feature(enable = $features)]
            #[allow(clippy::too_many_arguments)]
            unsafe fn compiled<$($g),*>($s: S $(, $arg: $ty)*) $(-> $ret)?
            where
                $($bound)*
            $body
            // SAFETY: the token `$s` proves that this CPU has this module's features.
            unsafe { compiled($s $(, $arg)*) }
        }
        $crate::vectorize::x86_entry_points!(@fns $features; $($rest)*);
    };

    // The functions of `avx512_bf16`, one at a time.
    (@bf16_fns) => {};
    (@bf16_fns
        $(#[$attr:meta])*
        fn $name:ident<$($g:ident),*>($s:ident: S $(, $arg:ident: $ty:ty)*) $(-> $ret:ty)?
        where [$($bound:tt)*]
        $body:block
        $($rest:tt)*
    ) => {
        $(#[$attr])*
        #[allow(clippy::too_many_arguments)]
        pub(in super::super) fn $name<$($g),*>($s: S $(, $arg: $ty)*) $(-> $ret)?
        where
            $($bound)*
        {
            #[target_feature(enable = "avx512f,avx512bf16,avx512dq,avx512bw,avx2,fma,f16c")]
            #[allow(clippy::too_many_arguments)]
            unsafe fn compiled<$($g),*>($($arg: $ty),*) $(-> $ret)?
            where
                $($bound)*
            {
                // SAFETY: called only where detection found these features (below).
                let $s = unsafe { S::with_bf16() };
                $body
            }
            if S::has_bf16() {
                // SAFETY: `$s` proves AVX-512F, AVX2, FMA and F16C, and detection found
                // AVX512-BF16, AVX512-DQ and AVX512-BW.
                unsafe { compiled($($arg),*) }
            } else {
                super::avx512::$name($s $(, $arg)*)
            }
        }
        $crate::vectorize::x86_entry_points!(@bf16_fns $($rest)*);
    };

    // Entry: one module per token.
    ([] $($fns:tt)*) => {};
    ([$module:ident $(, $more:ident)*] $($fns:tt)*) => {
        $crate::vectorize::x86_entry_points!(@module $module $($fns)*);
        $crate::vectorize::x86_entry_points!([$($more),*] $($fns)*);
    };
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86_entry_points;

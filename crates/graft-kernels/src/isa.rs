//! Instruction-set selection: the best one the CPU has, or one forced for a scope (tests, benches).

use std::cell::Cell;

/// The instruction sets the kernels are compiled for, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// x86-64 with AVX-512F, AVX2, FMA and F16C: 512-bit vectors.
    Avx512,
    /// x86-64 with AVX2, FMA and F16C: 256-bit vectors.
    Avx2,
    /// Plain Rust on any target (arrays of 8 lanes that the compiler vectorizes as it can).
    Portable,
}

impl Isa {
    /// Every variant, best first.
    pub const ALL: [Isa; 3] = [Isa::Avx512, Isa::Avx2, Isa::Portable];

    /// Whether this CPU can run the kernels compiled for `self`.
    pub fn is_available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => crate::simd::x86::Avx512::detect().is_some(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => crate::simd::x86::Avx2::detect().is_some(),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx512 | Isa::Avx2 => false,
            Isa::Portable => true,
        }
    }

    /// The instruction sets this CPU can run, best first.
    pub fn available() -> Vec<Isa> {
        Isa::ALL
            .into_iter()
            .filter(|isa| isa.is_available())
            .collect()
    }

    /// The best instruction set this CPU can run.
    pub fn best() -> Isa {
        Isa::ALL
            .into_iter()
            .find(|isa| isa.is_available())
            .unwrap_or(Isa::Portable)
    }

    /// The instruction set kernels called on this thread use: the one forced by [`with_isa`], else
    /// [`Isa::best`].
    pub fn current() -> Isa {
        FORCED.with(Cell::get).unwrap_or_else(Isa::best)
    }
}

thread_local! {
    static FORCED: Cell<Option<Isa>> = const { Cell::new(None) };
}

/// Runs `f` with kernels called from this thread using `isa` (the choice is made on the calling
/// thread, so it holds for work that a [`crate::Parallel`] hands to other threads). For tests and
/// benchmarks that compare instruction sets.
///
/// # Panics
/// If this CPU cannot run `isa`.
pub fn with_isa<R>(isa: Isa, f: impl FnOnce() -> R) -> R {
    assert!(isa.is_available(), "{isa:?} is not available on this CPU");
    /// Restores the previous choice, also when `f` panics.
    struct Restore(Option<Isa>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORCED.with(|forced| forced.set(self.0));
        }
    }
    let _restore = Restore(FORCED.with(|forced| forced.replace(Some(isa))));
    f()
}

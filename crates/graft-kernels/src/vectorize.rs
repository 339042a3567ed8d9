//! Compiling a piece of work for an instruction set: work written as plain loops over lane
//! arrays (a [`Job`]) is compiled, inlined, into a `#[target_feature]` entry point per x86 token
//! (`simd::x86`), where the compiler vectorizes it with that token's vectors.

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
        Isa::Avx512 => crate::simd::x86::Avx512::detect()
            .expect("AVX-512 work on a CPU without it")
            .run_job(job),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => crate::simd::x86::Avx2::detect()
            .expect("AVX2 work on a CPU without it")
            .run_job(job),
        _ => job.run(),
    }
}

//! x86-64 tokens: [`Avx2`] (AVX2 + FMA + F16C, 256-bit) and [`Avx512`] (AVX-512F on top, 512-bit),
//! their detection here and their vector arithmetic in `avx2` and `avx512`.
//!
//! This module holds the crate's intrinsics, and with them most of its `unsafe` code (the rest
//! is the `#[target_feature]` entry points that [`crate::vectorize::x86_entry_points`] makes).
//! Every intrinsic call relies on one invariant: a token value exists only if `detect()` found
//! its features on this CPU (the tokens' only field is private, so nothing else can make one).
//! Loads and stores also check their slice's length.

mod avx2;
mod avx512;

/// Token for AVX2, FMA and F16C.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2 {
    _detected: (),
}

/// Token for AVX-512F, AVX2, FMA and F16C.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512 {
    _detected: (),
    /// Set only inside entry points compiled with AVX512-BF16, AVX512-DQ and AVX512-BW (after
    /// detecting them: [`Avx512::with_bf16`]): bf16 stores then use `vcvtneps2bf16`, and bf16
    /// pairs load and store interleaved. Elsewhere `false`, and those branches are never taken.
    bf16: bool,
}

impl Avx2 {
    /// The token, if this CPU has the features.
    pub(crate) fn detect() -> Option<Self> {
        let ok = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        ok.then_some(Avx2 { _detected: () })
    }

    /// The token, for kernel tables (only built for tokens this CPU has, so this cannot fail).
    pub(crate) fn get() -> Self {
        Self::detect().expect("Avx2 kernels called on a CPU without it")
    }
}

impl From<Avx512> for Avx2 {
    /// AVX-512 tokens are only made on CPUs that also have AVX2, FMA and F16C.
    fn from(_: Avx512) -> Avx2 {
        Avx2 { _detected: () }
    }
}

impl Avx512 {
    /// The token, if this CPU has the features.
    pub(crate) fn detect() -> Option<Self> {
        let ok = is_x86_feature_detected!("avx512f") && Avx2::detect().is_some();
        ok.then_some(Avx512 {
            _detected: (),
            bf16: false,
        })
    }

    /// The token, for kernel tables (only built for tokens this CPU has, so this cannot fail).
    pub(crate) fn get() -> Self {
        Self::detect().expect("Avx512 kernels called on a CPU without it")
    }

    /// Whether this CPU also has AVX512-BF16 (`vcvtneps2bf16`: f32 to bf16 in one instruction),
    /// AVX512-DQ (`vfpclassps`, which finds the subnormal lanes that instruction flushes) and
    /// AVX512-BW (`vpermw`, which interleaves bf16 pairs again: [`super::Lanes::store_pair`]);
    /// every CPU with AVX512-BF16 has the other two.
    pub(crate) fn has_bf16() -> bool {
        is_x86_feature_detected!("avx512bf16")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512bw")
    }

    /// The token that uses AVX512-BF16, AVX512-DQ and AVX512-BW (see the `bf16` field), for
    /// entry points compiled with them (elsewhere their intrinsics would be calls).
    ///
    /// # Safety
    /// This CPU must have AVX-512F, AVX2, FMA and F16C (an [`Avx512`] token exists) and
    /// AVX512-BF16, AVX512-DQ and AVX512-BW ([`Avx512::has_bf16`]).
    #[inline(always)]
    pub(crate) unsafe fn with_bf16() -> Self {
        Avx512 {
            _detected: (),
            bf16: true,
        }
    }
}

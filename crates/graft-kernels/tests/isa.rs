//! Instruction-set selection: detection order and the scoped override.

use graft_kernels::{with_isa, Isa};

#[test]
fn best_is_the_first_available() {
    let available = Isa::available();
    assert_eq!(available.last(), Some(&Isa::Portable), "{available:?}");
    assert_eq!(available[0], Isa::best());
    assert_eq!(Isa::current(), Isa::best());
    if cfg!(target_arch = "x86_64") && std::is_x86_feature_detected!("avx512f") {
        assert!(available.contains(&Isa::Avx2), "AVX-512 CPUs have AVX2 too");
    }
}

#[test]
fn with_isa_nests_and_restores() {
    let best = Isa::best();
    with_isa(Isa::Portable, || {
        assert_eq!(Isa::current(), Isa::Portable);
        with_isa(best, || assert_eq!(Isa::current(), best));
        assert_eq!(Isa::current(), Isa::Portable);
        // Other threads are not affected.
        std::thread::spawn(move || assert_eq!(Isa::current(), best))
            .join()
            .unwrap();
    });
    assert_eq!(Isa::current(), best);
}

#[test]
fn with_isa_restores_after_a_panic() {
    let result = std::panic::catch_unwind(|| with_isa(Isa::Portable, || panic!("inside")));
    assert!(result.is_err());
    assert_eq!(Isa::current(), Isa::best());
}

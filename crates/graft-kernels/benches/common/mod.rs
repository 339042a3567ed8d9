//! Inputs and the copy reference shared by the criterion bench and the quick_bench example.

use graft_kernels::{Float, Parallel};

pub const ROWS: usize = 8192;
pub const COLS: usize = 4096;

/// Deterministic inputs in about [-2, 2) (splitmix64).
pub fn random<T: Float<Acc = f32>>(n: usize, seed: u64) -> Vec<T> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            T::from_acc((z >> 40) as f32 / (1u64 << 22) as f32 - 2.0)
        })
        .collect()
}

/// A zeroed buffer of `n` elements starting on a 64-byte boundary, as torch allocates.
pub fn aligned<T: Float>(storage: &mut Vec<T>, n: usize) -> &mut [T] {
    *storage = vec![T::default(); n + 64];
    let skip = storage.as_ptr().align_offset(64);
    &mut storage[skip..skip + n]
}

/// `dst.copy_from_slice(src)` in two halves over `par`: the bandwidth reference.
pub fn copy<T: Float>(src: &[T], dst: &mut [T], par: &dyn Parallel) {
    let half = src.len() / 2;
    let (lo, hi) = dst.split_at_mut(half);
    let halves = [std::sync::Mutex::new(lo), std::sync::Mutex::new(hi)];
    par.for_range(2, 1, &|range| {
        for i in range {
            let mut dst = halves[i].lock().unwrap();
            let len = dst.len();
            dst.copy_from_slice(&src[i * half..][..len]);
        }
    });
}

//! The parallel-for the kernels run on, supplied by the caller.

use std::ops::Range;

/// Parallel-for supplied by the caller (the lead implements it over torch's intra-op pool via
/// torch_parallel_for, so torch.set_num_threads is respected).
pub trait Parallel: Sync {
    /// Calls `body` on disjoint ranges that together cover `0..n`, each holding at least `grain`
    /// items unless `n` is smaller; may run them concurrently and in any order.
    fn for_range(&self, n: usize, grain: usize, body: &(dyn Fn(Range<usize>) + Sync));
}

/// Runs everything on the calling thread: `body(0..n)`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Serial;

impl Parallel for Serial {
    fn for_range(&self, n: usize, _grain: usize, body: &(dyn Fn(Range<usize>) + Sync)) {
        body(0..n);
    }
}

/// Splits the work over up to `.0` threads with [`std::thread::scope`] (the calling thread takes
/// one share). Spawns threads on every call: meant for tests and benchmarks, not production.
#[derive(Clone, Copy, Debug)]
pub struct Threads(pub usize);

impl Parallel for Threads {
    fn for_range(&self, n: usize, grain: usize, body: &(dyn Fn(Range<usize>) + Sync)) {
        // As many equal shares as there are threads, but none smaller than `grain`.
        let shares = self.0.min(n / grain.max(1)).max(1);
        if shares == 1 {
            body(0..n);
            return;
        }
        let share_range = |i: usize| (i * n / shares)..((i + 1) * n / shares);
        std::thread::scope(|scope| {
            for i in 1..shares {
                let range = share_range(i);
                scope.spawn(move || body(range));
            }
            body(share_range(0));
        });
    }
}

//! Per-graft call counters, cheap enough for every call (relaxed atomics).

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of one graft.
#[derive(Debug)]
pub struct Counters {
    calls: AtomicU64,
    fallbacks: AtomicU64,
}

impl Counters {
    /// Zeroed counters.
    pub const fn new() -> Counters {
        Counters {
            calls: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
        }
    }

    /// Counts one call of the graft.
    pub fn call(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one call that the graft's fast kernel did not cover and that was computed another
    /// way (still correctly).
    pub fn fallback(&self) {
        self.fallbacks.fetch_add(1, Ordering::Relaxed);
    }

    /// (calls, fallbacks) so far.
    pub fn read(&self) -> (u64, u64) {
        (
            self.calls.load(Ordering::Relaxed),
            self.fallbacks.load(Ordering::Relaxed),
        )
    }

    /// Back to zero.
    pub fn reset(&self) {
        self.calls.store(0, Ordering::Relaxed);
        self.fallbacks.store(0, Ordering::Relaxed);
    }
}

impl Default for Counters {
    fn default() -> Counters {
        Counters::new()
    }
}

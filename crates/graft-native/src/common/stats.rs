//! Per-graft call counters, cheap enough for every call (relaxed atomics), and the report of one
//! graft or op kernel with them.

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

/// One native graft: an operator at a dispatch key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraftInfo {
    /// Qualified operator name, e.g. `aten::_fused_rms_norm`.
    pub op: &'static str,
    /// Dispatch key, e.g. `CPU`.
    pub dispatch_key: &'static str,
    /// Whether it is registered now.
    pub active: bool,
    /// Calls since the last reset.
    pub calls: u64,
    /// Calls computed by a slower general path instead of the fused kernel.
    pub fallbacks: u64,
}

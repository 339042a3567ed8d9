//! Output strides for non-contiguous inputs, as ATen's meta functions give them.
//!
//! Contiguous inputs give contiguous outputs; for anything else the meta function (part C++,
//! part Python in torch) is the one source of truth. Asking it costs up to a millisecond, so its
//! answers are cached per input-layout signature: a training loop repeats a handful of layouts.

use std::collections::HashMap;
use std::sync::Mutex;

use graft_abi::{Result, Tensor};

/// Most signatures kept before the cache starts over (each entry is a few hundred bytes).
const CAPACITY: usize = 1024;

/// A layout signature: which op, plus sizes, strides and dtypes of its tensors and its ints.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Signature(Vec<i64>);

impl Signature {
    /// Starts a signature for the op tagged `op`.
    pub fn new(op: i64) -> Signature {
        Signature(vec![op])
    }

    /// Adds a tensor (or its absence).
    pub fn tensor(mut self, t: Option<&Tensor>) -> Result<Signature> {
        match t {
            None => self.0.push(-1),
            Some(t) => {
                let sizes = t.sizes()?;
                self.0.push(i64::from(t.dtype()?.0));
                self.0.push(sizes.len() as i64);
                self.0.extend_from_slice(sizes);
                self.0.extend_from_slice(t.strides()?);
            }
        }
        Ok(self)
    }

    /// Adds integers (e.g. normalized_shape).
    pub fn ints(mut self, values: &[i64]) -> Signature {
        self.0.push(values.len() as i64);
        self.0.extend_from_slice(values);
        self
    }
}

/// Cached output strides per signature.
pub struct LayoutCache {
    entries: Mutex<HashMap<Signature, Vec<Vec<i64>>>>,
}

impl LayoutCache {
    /// An empty cache.
    pub fn new() -> LayoutCache {
        LayoutCache {
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// The strides for `signature`, computed by `ask_meta` on a miss. If the meta function cannot
    /// answer (a host process without torch's Python meta registrations), `fallback` is used.
    pub fn strides(
        &self,
        signature: Signature,
        ask_meta: impl FnOnce() -> Result<Vec<Vec<i64>>>,
        fallback: impl FnOnce() -> Vec<Vec<i64>>,
    ) -> Vec<Vec<i64>> {
        if let Some(found) = self.lock().get(&signature) {
            return found.clone();
        }
        // Not under the lock: the meta function may take the GIL and run Python.
        let strides = ask_meta().unwrap_or_else(|_| fallback());
        let mut entries = self.lock();
        if entries.len() >= CAPACITY {
            entries.clear();
        }
        entries.insert(signature, strides.clone());
        strides
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Signature, Vec<Vec<i64>>>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Default for LayoutCache {
    fn default() -> LayoutCache {
        LayoutCache::new()
    }
}

//! Handing disjoint pieces of the outputs to parallel tasks, in safe code.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::parallel::Parallel;

/// Work per parallel task below which threads cost more than they save (elements).
const MIN_TASK_ELEMS: usize = 1 << 16;

/// Runs `work(i, item)` for every `(i, item)` of `items` through `par`, `item_elems` elements of
/// work per item, so that each task gets about [`MIN_TASK_ELEMS`] or more.
///
/// Each item (typically `&mut` slices of the outputs) sits in its own cell that the task visiting
/// index `i` empties, so no two tasks can share one.
///
/// # Panics
/// If `par` visits an index twice or leaves one out (a broken [`Parallel`] implementation).
pub(crate) fn for_each<I: Send>(
    par: &dyn Parallel,
    items: Vec<I>,
    item_elems: usize,
    work: impl Fn(usize, I) + Sync,
) {
    let n = items.len();
    let cells: Vec<Mutex<Option<I>>> = items.into_iter().map(|i| Mutex::new(Some(i))).collect();
    let done = AtomicUsize::new(0);
    let grain = MIN_TASK_ELEMS.div_ceil(item_elems.max(1));
    par.for_range(n, grain, &|range| {
        for i in range {
            let item = cells[i]
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            let item = item.unwrap_or_else(|| panic!("Parallel::for_range visited {i} twice"));
            work(i, item);
            done.fetch_add(1, Ordering::Relaxed);
        }
    });
    let done = done.into_inner();
    assert_eq!(done, n, "Parallel::for_range covered {done} of 0..{n}");
}

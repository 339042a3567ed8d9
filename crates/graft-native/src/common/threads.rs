//! The kernels' parallel-for, run on torch's intra-op thread pool.

use std::ops::Range;

/// Runs kernel work on torch's thread pool, so `torch.set_num_threads` is respected.
pub struct TorchPool;

impl graft_kernels::Parallel for TorchPool {
    fn for_range(&self, n: usize, grain: usize, body: &(dyn Fn(Range<usize>) + Sync)) {
        if let Err(error) =
            graft_abi::parallel::parallel_for(n, grain, &|begin, end| body(begin..end))
        {
            // Reaches Python as a RuntimeError through the kernel's entry point.
            panic!("torch_parallel_for failed: {error}");
        }
    }
}

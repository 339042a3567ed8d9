//! Torch's intra-op thread pool (`at::parallel_for`), so kernels respect `torch.set_num_threads`.

use std::any::Any;
use std::ffi::c_void;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Mutex;

use crate::error::{check, Result};
use crate::sys::api;

/// Number of threads torch's intra-op pool uses.
pub fn num_threads() -> Result<usize> {
    let api = api()?;
    let mut n = 0u32;
    // SAFETY: valid out-pointer.
    let code = unsafe { (api.torch_get_num_threads)(&mut n) };
    check(code, "torch_get_num_threads")?;
    Ok(n.max(1) as usize)
}

struct Context<'a> {
    body: &'a (dyn Fn(usize, usize) + Sync),
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

/// Runs `body(begin, end)` over chunks covering `0..n` on torch's pool (at least `grain` items a
/// chunk). A panic in `body` is caught on the worker and resumed here once all chunks are done.
pub fn parallel_for(n: usize, grain: usize, body: &(dyn Fn(usize, usize) + Sync)) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let api = api()?;
    let context = Context {
        body,
        panic: Mutex::new(None),
    };
    // SAFETY: `trampoline` matches ParallelFunc; `context` outlives the call, which returns only
    // after every chunk ran.
    let code = unsafe {
        (api.torch_parallel_for)(
            0,
            n as i64,
            grain.max(1) as i64,
            trampoline,
            &context as *const Context as *mut c_void,
        )
    };
    if let Some(payload) = context
        .panic
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
    {
        panic::resume_unwind(payload);
    }
    check(code, "torch_parallel_for")
}

/// # Safety
/// `ctx` must point to a live `Context`.
unsafe extern "C" fn trampoline(begin: i64, end: i64, ctx: *mut c_void) {
    // SAFETY: `parallel_for` passes a pointer to its `Context`, alive for the whole call.
    let context = unsafe { &*(ctx as *const Context) };
    let ran = panic::catch_unwind(AssertUnwindSafe(|| {
        (context.body)(begin as usize, end as usize)
    }));
    if let Err(payload) = ran {
        let mut slot = context.panic.lock().unwrap_or_else(|e| e.into_inner());
        slot.get_or_insert(payload);
    }
}

//! Calling operators through the dispatcher (the full stack of keys, as `torch.ops` does).

use std::ffi::CStr;

use crate::error::{check, Result};
use crate::stack::{CallArgs, CallOutputs};
use crate::sys::{api, TORCH_ABI_TARGET};

/// Calls `op.overload` (e.g. `c"aten::mul"`, `c"Tensor"`; `c""` for the default overload) with
/// `args` in schema order, every argument included, and returns its outputs.
///
/// The arguments are consumed (tensors passed by reference get a new handle each).
pub fn call<A: CallArgs, O: CallOutputs>(op: &CStr, overload: &CStr, args: A) -> Result<O> {
    let api = api()?;
    let mut stack = args.into_slots()?;
    if stack.len() < O::COUNT {
        stack.resize(O::COUNT, 0);
    }
    // SAFETY: the stack holds the op's arguments in schema order (the caller's contract, checked
    // by torch against the schema's length); torch consumes them and writes `O::COUNT` owned
    // return slots from index 0.
    let code = unsafe {
        (api.torch_call_dispatcher)(
            op.as_ptr(),
            overload.as_ptr(),
            stack.as_mut_ptr(),
            TORCH_ABI_TARGET,
        )
    };
    check(code, &op.to_string_lossy())?;
    // SAFETY: on success the first `O::COUNT` slots are owned return values of these types.
    unsafe { O::take(stack.as_ptr()) }
}

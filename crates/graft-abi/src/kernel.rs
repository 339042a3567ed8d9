//! Boxed kernels written in Rust: the entry point torch calls, and how errors reach Python.

use std::any::Any;
use std::ffi::CString;
use std::panic::{self, AssertUnwindSafe};

use crate::error::{Error, Result};
use crate::stack::{KernelArgs, KernelOutputs};
use crate::sys::{api, BoxedKernelFn, StableIValue};

/// A kernel for one operator schema: typed arguments in, typed outputs out.
///
/// Every argument is converted (and so owned and eventually freed) before `run` is called; an
/// `Err` or a panic becomes a `RuntimeError` in Python (a `c10::Error` in C++).
pub trait Kernel: 'static {
    /// The schema's arguments, in order (e.g. `(Tensor, Vec<i64>, Option<Tensor>, Option<f64>)`).
    type Args: KernelArgs;
    /// The schema's returns, in order.
    type Outputs: KernelOutputs;
    /// Computes the outputs.
    fn run(args: Self::Args) -> Result<Self::Outputs>;
}

/// The C entry point torch calls for kernel `K`.
pub(crate) fn entry_point<K: Kernel>() -> BoxedKernelFn {
    boxed_entry::<K>
}

/// # Safety
/// Called by libtorch with a stack holding `num_args` owned argument slots of `K`'s schema and
/// room for `num_outputs` returns.
unsafe extern "C-unwind" fn boxed_entry<K: Kernel>(
    stack: *mut StableIValue,
    num_args: u64,
    num_outputs: u64,
) {
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| -> Result<()> {
        if num_args != K::Args::COUNT as u64 || num_outputs != K::Outputs::COUNT as u64 {
            // A registration for the wrong schema: nothing is safe to read or free.
            return Err(Error::msg(format!(
                "torchgraft kernel registered for the wrong schema: it takes {} arguments and \
                 returns {}, torch passed {num_args} and expects {num_outputs}",
                K::Args::COUNT,
                K::Outputs::COUNT
            )));
        }
        // SAFETY: torch passes `COUNT` owned slots of the schema's types (checked above).
        let args = unsafe { K::Args::take(stack) }?;
        let outputs = K::run(args)?;
        // SAFETY: the stack has room for the schema's returns.
        unsafe { outputs.put(stack) }
    }));
    let message = match outcome {
        Ok(Ok(())) => return,
        Ok(Err(error)) => error.message().to_owned(),
        Err(payload) => format!("torchgraft kernel panicked: {}", panic_message(&*payload)),
    };
    raise(&message)
}

/// Throws a `c10::Error` carrying `message` into the C++ caller. Nothing in Rust frames below
/// the kernel's entry point owns resources other than the message, which unwinding frees.
fn raise(message: &str) -> ! {
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    if let Ok(api) = api() {
        // SAFETY: with `cond == false` aoti_torch_check throws a c10::Error; our caller is the
        // C++ boxed-kernel wrapper, and every frame in between is "C-unwind" or Rust.
        unsafe {
            (api.aoti_torch_check)(
                false,
                c"torchgraft".as_ptr(),
                c"torchgraft".as_ptr(),
                0,
                message.as_ptr(),
            )
        };
    }
    // Only reachable if libtorch is gone, which cannot happen inside one of its kernels.
    std::process::abort()
}

/// The text of a panic payload.
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_owned()
    }
}

//! libtorchgraft: the native grafts behind a C API (see `include/torchgraft.h`), for host
//! programs that load libtorch themselves and have no Python.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = message);
}

/// Registers the native grafts (idempotent). 0 on success, -1 on error.
#[no_mangle]
pub extern "C" fn torchgraft_enable() -> c_int {
    match std::panic::catch_unwind(graft_native::enable) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            set_last_error(e.message());
            -1
        }
        Err(_) => {
            set_last_error("torchgraft_enable panicked");
            -1
        }
    }
}

/// Removes the native grafts (idempotent).
#[no_mangle]
pub extern "C" fn torchgraft_disable() {
    // A panic must not cross the C boundary; disabling cannot fail otherwise.
    let _ = std::panic::catch_unwind(graft_native::disable);
}

/// 1 while the native grafts are registered, else 0.
#[no_mangle]
pub extern "C" fn torchgraft_is_enabled() -> c_int {
    c_int::from(graft_native::is_enabled())
}

/// Calls so far of the graft for `op` at `dispatch_key`, or -1 if there is no such graft.
///
/// # Safety
/// `op` and `dispatch_key` must be NUL-terminated strings (or null).
#[no_mangle]
pub unsafe extern "C" fn torchgraft_calls(op: *const c_char, dispatch_key: *const c_char) -> i64 {
    if op.is_null() || dispatch_key.is_null() {
        return -1;
    }
    // SAFETY: both are non-null NUL-terminated strings (the caller's contract).
    let (op, key) = unsafe { (CStr::from_ptr(op), CStr::from_ptr(dispatch_key)) };
    let (Ok(op), Ok(key)) = (op.to_str(), key.to_str()) else {
        return -1;
    };
    graft_native::grafts()
        .into_iter()
        .find(|g| g.op == op && g.dispatch_key == key)
        .map_or(-1, |g| g.calls as i64)
}

/// Whether the CUDA grafts are available here: 0 with the number of GPUs in `*devices`, or -1
/// with the reason in torchgraft_last_error().
///
/// # Safety
/// `devices` must be null or point to writable memory for one `int64_t`.
#[no_mangle]
pub unsafe extern "C" fn torchgraft_cuda_status(devices: *mut i64) -> c_int {
    match graft_native::cuda_status() {
        Ok(n) => {
            if !devices.is_null() {
                // SAFETY: non-null and writable (the caller's contract).
                unsafe { devices.write(n as i64) };
            }
            0
        }
        Err(why) => {
            set_last_error(&why);
            -1
        }
    }
}

/// The last error of this thread, or "".
#[no_mangle]
pub extern "C" fn torchgraft_last_error() -> *const c_char {
    // The pointer stays valid until this thread's next error replaces the CString.
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

//! `torch::Library` objects: registering boxed kernels and removing them again.

use std::ffi::CStr;
use std::ptr::NonNull;

use crate::error::{check, Error, Result};
use crate::kernel::{entry_point, Kernel};
use crate::sys::{api, TorchLibraryOpaque, TORCH_ABI_TARGET};

/// A `torch::Library` owned by us. Dropping it removes every registration it made, restoring the
/// kernels that were there before.
#[derive(Debug)]
pub struct Library {
    handle: NonNull<TorchLibraryOpaque>,
}

// SAFETY: a torch::Library is a heap object whose registrations live in the dispatcher, which is
// thread-safe; we only use it through `&mut self` or drop it.
unsafe impl Send for Library {}

impl Library {
    /// An `IMPL` library for namespace `ns` at dispatch key `dispatch_key` (e.g. `c"aten"`,
    /// `c"CPU"`).
    pub fn implementations(ns: &CStr, dispatch_key: &CStr) -> Result<Library> {
        let api = api()?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: valid C strings and out-pointer; the handle is owned by the returned Library.
        let code = unsafe {
            (api.aoti_torch_library_init_impl)(
                ns.as_ptr(),
                dispatch_key.as_ptr(),
                c"torchgraft".as_ptr(),
                0,
                &mut handle,
            )
        };
        check(code, "aoti_torch_library_init_impl")?;
        Library::from_handle(handle)
    }

    /// A `FRAGMENT` library for namespace `ns`, to define new operators in it.
    pub fn fragment(ns: &CStr) -> Result<Library> {
        let api = api()?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: as above.
        let code = unsafe {
            (api.aoti_torch_library_init_fragment)(
                ns.as_ptr(),
                c"torchgraft".as_ptr(),
                0,
                &mut handle,
            )
        };
        check(code, "aoti_torch_library_init_fragment")?;
        Library::from_handle(handle)
    }

    fn from_handle(handle: *mut TorchLibraryOpaque) -> Result<Library> {
        NonNull::new(handle)
            .map(|handle| Library { handle })
            .ok_or_else(|| Error::msg("torch returned a null library"))
    }

    /// Defines an operator from its schema (`"name(Tensor x) -> Tensor"`).
    pub fn define(&mut self, schema: &CStr) -> Result<()> {
        let api = api()?;
        // SAFETY: valid handle and C string.
        let code = unsafe { (api.aoti_torch_library_def)(self.handle.as_ptr(), schema.as_ptr()) };
        check(code, "aoti_torch_library_def")
    }

    /// Registers kernel `K` for operator `name` (e.g. `c"_fused_rms_norm"`) at this library's key.
    pub fn register<K: Kernel>(&mut self, name: &CStr) -> Result<()> {
        let api = api()?;
        // SAFETY: valid handle and C string; the entry point is a 'static function that follows
        // the boxed-kernel calling convention.
        let code = unsafe {
            (api.torch_library_impl)(
                self.handle.as_ptr(),
                name.as_ptr(),
                entry_point::<K>(),
                TORCH_ABI_TARGET,
            )
        };
        check(code, "torch_library_impl")
    }
}

impl Drop for Library {
    fn drop(&mut self) {
        if let Ok(api) = api() {
            // SAFETY: we own the handle; deleting it deregisters its kernels exactly once.
            unsafe { (api.aoti_torch_delete_library_object)(self.handle.as_ptr()) };
        }
    }
}

//! PyTorch's CUDA state: the current stream of a device and a device guard.

use std::ffi::c_void;

use crate::error::{check, Error, Result};
use crate::sys::{api, CudaApi, CudaGuardHandle};

fn cuda_api() -> Result<&'static CudaApi> {
    api()?
        .cuda
        .as_ref()
        .ok_or_else(|| Error::msg("libtorch_cuda is not loaded: this torch has no CUDA support"))
}

/// Whether the torch in this process has CUDA support loaded.
pub fn torch_has_cuda() -> bool {
    api().map(|api| api.cuda.is_some()).unwrap_or(false)
}

/// The current CUDA stream (`cudaStream_t`) PyTorch uses on `device`.
pub fn current_stream(device: i32) -> Result<*mut c_void> {
    let cuda = cuda_api()?;
    let mut stream = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    let code = unsafe { (cuda.aoti_torch_get_current_cuda_stream)(device, &mut stream) };
    check(code, "aoti_torch_get_current_cuda_stream")?;
    Ok(stream)
}

/// Makes `device` the current CUDA device until dropped (stable-ABI kernels get no guard).
#[derive(Debug)]
pub struct DeviceGuard {
    handle: CudaGuardHandle,
}

impl DeviceGuard {
    /// Switches to `device`.
    pub fn new(device: i32) -> Result<DeviceGuard> {
        let cuda = cuda_api()?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the guard is owned by the returned value.
        let code = unsafe { (cuda.aoti_torch_create_cuda_guard)(device, &mut handle) };
        check(code, "aoti_torch_create_cuda_guard")?;
        Ok(DeviceGuard { handle })
    }
}

impl Drop for DeviceGuard {
    fn drop(&mut self) {
        if let Ok(cuda) = cuda_api() {
            // SAFETY: we own the guard; deleting it restores the previous device.
            unsafe { (cuda.aoti_torch_delete_cuda_guard)(self.handle) };
        }
    }
}

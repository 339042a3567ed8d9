//! Minimal CUDA driver API bindings, resolved at run time from `libcuda.so.1`.
//!
//! Nothing is linked at build time. The library is opened once per process ([`api`]);
//! every call's `CUresult` goes through [`Api::check`], which names the function and the
//! driver's error name and string.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::marker::PhantomData;
use std::sync::OnceLock;

use libloading::Library;

use super::error::{CudaError, ErrorKind};

/// `CUresult`.
pub(crate) type CuResult = c_int;
/// `CUdevice`.
pub(crate) type CuDevice = c_int;
/// `CUdeviceptr`.
pub(crate) type CuDevicePtr = u64;
/// `CUcontext`.
pub(crate) type CuContext = *mut c_void;
/// `CUmodule`.
pub(crate) type CuModule = *mut c_void;
/// `CUfunction`.
pub(crate) type CuFunction = *mut c_void;
/// `CUstream`.
pub(crate) type CuStream = *mut c_void;
/// `CUevent`.
pub(crate) type CuEvent = *mut c_void;

pub(crate) const CUDA_SUCCESS: CuResult = 0;
pub(crate) const CUDA_ERROR_NO_DEVICE: CuResult = 100;

// CUdevice_attribute values used here (cuda.h).
pub(crate) const ATTR_MULTIPROCESSOR_COUNT: c_int = 16;
pub(crate) const ATTR_L2_CACHE_SIZE: c_int = 38;
pub(crate) const ATTR_MAX_THREADS_PER_MULTIPROCESSOR: c_int = 39;
pub(crate) const ATTR_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
pub(crate) const ATTR_COMPUTE_CAPABILITY_MINOR: c_int = 76;
pub(crate) const ATTR_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: c_int = 81;
pub(crate) const ATTR_MAX_REGISTERS_PER_MULTIPROCESSOR: c_int = 82;
pub(crate) const ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: c_int = 97;
pub(crate) const ATTR_MAX_BLOCKS_PER_MULTIPROCESSOR: c_int = 106;
pub(crate) const ATTR_RESERVED_SHARED_MEMORY_PER_BLOCK: c_int = 111;

// CUfunction_attribute values used here.
pub(crate) const FUNC_ATTR_MAX_THREADS_PER_BLOCK: c_int = 0;
pub(crate) const FUNC_ATTR_SHARED_SIZE_BYTES: c_int = 1;
pub(crate) const FUNC_ATTR_LOCAL_SIZE_BYTES: c_int = 3;
pub(crate) const FUNC_ATTR_NUM_REGS: c_int = 4;
pub(crate) const FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES: c_int = 8;
pub(crate) const FUNC_ATTR_NON_PORTABLE_CLUSTER_SIZE_ALLOWED: c_int = 14;

/// `CUlaunchConfig`, for [`Api::cu_occupancy_max_active_clusters`] (no launch attributes: the
/// kernels asked about declare their cluster size).
#[repr(C)]
pub(crate) struct CuLaunchConfig {
    pub grid_dim: [c_uint; 3],
    pub block_dim: [c_uint; 3],
    pub shared_mem_bytes: c_uint,
    pub stream: CuStream,
    pub attrs: *mut c_void,
    pub num_attrs: c_uint,
}

/// `CU_STREAM_NON_BLOCKING`.
pub(crate) const STREAM_NON_BLOCKING: c_uint = 1;

#[cfg(target_os = "windows")]
pub(crate) const DRIVER_LIBRARY: &str = "nvcuda.dll";
#[cfg(not(target_os = "windows"))]
pub(crate) const DRIVER_LIBRARY: &str = "libcuda.so.1";

/// The driver's entry points. Field names follow the C names.
pub(crate) struct Api {
    pub cu_init: unsafe extern "C" fn(c_uint) -> CuResult,
    pub cu_driver_get_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    pub cu_device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    pub cu_device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    pub cu_device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, CuDevice) -> CuResult,
    pub cu_device_get_name: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    pub cu_device_primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    pub cu_ctx_get_current: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    pub cu_ctx_push_current: unsafe extern "C" fn(CuContext) -> CuResult,
    pub cu_ctx_pop_current: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    pub cu_ctx_synchronize: unsafe extern "C" fn() -> CuResult,
    pub cu_module_load_data: unsafe extern "C" fn(*mut CuModule, *const c_void) -> CuResult,
    pub cu_module_get_function:
        unsafe extern "C" fn(*mut CuFunction, CuModule, *const c_char) -> CuResult,
    pub cu_func_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, CuFunction) -> CuResult,
    pub cu_func_set_attribute: unsafe extern "C" fn(CuFunction, c_int, c_int) -> CuResult,
    #[allow(clippy::type_complexity)]
    pub cu_launch_kernel: unsafe extern "C" fn(
        CuFunction,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        CuStream,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CuResult,
    pub cu_get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    pub cu_get_error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    pub cu_mem_alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult,
    pub cu_mem_free: unsafe extern "C" fn(CuDevicePtr) -> CuResult,
    pub cu_memcpy_htod: unsafe extern "C" fn(CuDevicePtr, *const c_void, usize) -> CuResult,
    pub cu_memcpy_dtoh: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize) -> CuResult,
    pub cu_memcpy_dtod_async:
        unsafe extern "C" fn(CuDevicePtr, CuDevicePtr, usize, CuStream) -> CuResult,
    pub cu_stream_create: unsafe extern "C" fn(*mut CuStream, c_uint) -> CuResult,
    pub cu_stream_destroy: unsafe extern "C" fn(CuStream) -> CuResult,
    pub cu_stream_synchronize: unsafe extern "C" fn(CuStream) -> CuResult,
    pub cu_event_create: unsafe extern "C" fn(*mut CuEvent, c_uint) -> CuResult,
    pub cu_event_record: unsafe extern "C" fn(CuEvent, CuStream) -> CuResult,
    pub cu_event_synchronize: unsafe extern "C" fn(CuEvent) -> CuResult,
    pub cu_event_elapsed_time: unsafe extern "C" fn(*mut f32, CuEvent, CuEvent) -> CuResult,
    pub cu_event_destroy: unsafe extern "C" fn(CuEvent) -> CuResult,
    /// `cuOccupancyMaxActiveClusters` (CUDA 11.8+; `None` on older drivers).
    pub cu_occupancy_max_active_clusters:
        Option<unsafe extern "C" fn(*mut c_int, CuFunction, *const CuLaunchConfig) -> CuResult>,
    /// `cuInit(0)`'s result: a driver that loads but finds no device is not an error for
    /// [`crate::device_count`].
    pub init_result: CuResult,
    /// Keeps the function pointers above valid.
    _lib: Library,
}

static API: OnceLock<Result<Api, CudaError>> = OnceLock::new();

/// The driver, loaded and initialised (`cuInit(0)`) on first use.
pub(crate) fn api() -> Result<&'static Api, CudaError> {
    API.get_or_init(|| load(DRIVER_LIBRARY))
        .as_ref()
        .map_err(Clone::clone)
}

/// Loads `path` as the CUDA driver. Separate from [`api`] so tests can point it at a
/// library that does not exist.
pub(crate) fn load(path: &str) -> Result<Api, CudaError> {
    let unavailable = |what: String| {
        CudaError::new(
            ErrorKind::DriverUnavailable,
            format!("graft-cuda: the CUDA driver is not available: {what}"),
        )
    };
    // SAFETY: loading the CUDA driver runs its initialisers, which have no preconditions
    // beyond being loaded into a process with a C runtime.
    let lib = unsafe { Library::new(path) }
        .map_err(|e| unavailable(format!("could not load {path}: {e}")))?;

    macro_rules! sym {
        ($name:literal) => {{
            // SAFETY: the field this initialises has the signature of the C function named
            // $name in cuda.h (the `_v2` names where cuda.h maps the plain name to them),
            // and the pointer is used only while `lib` is alive (it is stored beside it).
            let s = unsafe { lib.get($name) }
                .map_err(|e| unavailable(format!("{path} has no {}: {e}", $name)))?;
            *s
        }};
    }

    let mut api = Api {
        cu_init: sym!("cuInit"),
        cu_driver_get_version: sym!("cuDriverGetVersion"),
        cu_device_get_count: sym!("cuDeviceGetCount"),
        cu_device_get: sym!("cuDeviceGet"),
        cu_device_get_attribute: sym!("cuDeviceGetAttribute"),
        cu_device_get_name: sym!("cuDeviceGetName"),
        cu_device_primary_ctx_retain: sym!("cuDevicePrimaryCtxRetain"),
        cu_ctx_get_current: sym!("cuCtxGetCurrent"),
        cu_ctx_push_current: sym!("cuCtxPushCurrent_v2"),
        cu_ctx_pop_current: sym!("cuCtxPopCurrent_v2"),
        cu_ctx_synchronize: sym!("cuCtxSynchronize"),
        cu_module_load_data: sym!("cuModuleLoadData"),
        cu_module_get_function: sym!("cuModuleGetFunction"),
        cu_func_get_attribute: sym!("cuFuncGetAttribute"),
        cu_func_set_attribute: sym!("cuFuncSetAttribute"),
        cu_launch_kernel: sym!("cuLaunchKernel"),
        cu_get_error_name: sym!("cuGetErrorName"),
        cu_get_error_string: sym!("cuGetErrorString"),
        cu_mem_alloc: sym!("cuMemAlloc_v2"),
        cu_mem_free: sym!("cuMemFree_v2"),
        cu_memcpy_htod: sym!("cuMemcpyHtoD_v2"),
        cu_memcpy_dtoh: sym!("cuMemcpyDtoH_v2"),
        cu_memcpy_dtod_async: sym!("cuMemcpyDtoDAsync_v2"),
        cu_stream_create: sym!("cuStreamCreate"),
        cu_stream_destroy: sym!("cuStreamDestroy_v2"),
        cu_stream_synchronize: sym!("cuStreamSynchronize"),
        cu_event_create: sym!("cuEventCreate"),
        cu_event_record: sym!("cuEventRecord"),
        cu_event_synchronize: sym!("cuEventSynchronize"),
        cu_event_elapsed_time: {
            // cuEventElapsedTime_v2 (CUDA 12.8+) has the same signature as the original.
            // SAFETY: as in sym!: the signature matches cuda.h and `lib` outlives the pointer.
            let v2 = unsafe { lib.get("cuEventElapsedTime_v2") }.map(|s| *s);
            match v2 {
                Ok(f) => f,
                Err(_) => sym!("cuEventElapsedTime"),
            }
        },
        cu_event_destroy: sym!("cuEventDestroy_v2"),
        // SAFETY: as in sym!: the signature matches cuda.h and `lib` outlives the pointer.
        cu_occupancy_max_active_clusters: unsafe { lib.get("cuOccupancyMaxActiveClusters") }
            .map(|s| *s)
            .ok(),
        init_result: CUDA_SUCCESS,
        _lib: lib,
    };
    // SAFETY: cuInit has no preconditions; 0 is the only valid flag value.
    api.init_result = unsafe { (api.cu_init)(0) };
    if api.init_result != CUDA_SUCCESS && api.init_result != CUDA_ERROR_NO_DEVICE {
        return Err(api.error("cuInit", api.init_result));
    }
    Ok(api)
}

impl Api {
    /// `Ok(())` for `CUDA_SUCCESS`, else an error naming `what` and the driver's error.
    pub(crate) fn check(&self, what: &str, res: CuResult) -> Result<(), CudaError> {
        if res == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(self.error(what, res))
        }
    }

    /// The error for a failed call of `what` (cold path: allocates the message).
    #[cold]
    pub(crate) fn error(&self, what: &str, res: CuResult) -> CudaError {
        let text = |f: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult| {
            let mut p: *const c_char = std::ptr::null();
            // SAFETY: cuGetErrorName/String write a pointer to a static NUL-terminated
            // string (or leave it null for an unknown code); we only read it when non-null.
            let ok = unsafe { f(res, &mut p) } == CUDA_SUCCESS && !p.is_null();
            if ok {
                // SAFETY: non-null and NUL-terminated, as documented for these functions.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            } else {
                "unknown error".to_string()
            }
        };
        let name = text(self.cu_get_error_name);
        let string = text(self.cu_get_error_string);
        CudaError::new(
            ErrorKind::Driver { code: res },
            format!("graft-cuda: {what} failed: {name} ({res}): {string}"),
        )
    }

    /// The thread's current context (null if none).
    pub(crate) fn current_context(&self) -> Result<CuContext, CudaError> {
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: cuCtxGetCurrent writes one CUcontext through the valid pointer.
        self.check("cuCtxGetCurrent", unsafe {
            (self.cu_ctx_get_current)(&mut ctx)
        })?;
        Ok(ctx)
    }
}

/// Makes `ctx` current for the guard's lifetime when it is not already: pushes it on the
/// thread's context stack and pops it on drop, so the caller's current context (and
/// PyTorch's current device, which follows it) is left as it was.
pub(crate) struct ContextGuard {
    api: &'static Api,
    pushed: bool,
    /// Not `Send`: the pop must happen on the thread that pushed.
    _not_send: PhantomData<*const ()>,
}

impl ContextGuard {
    pub(crate) fn enter(api: &'static Api, ctx: CuContext) -> Result<Self, CudaError> {
        let pushed = api.current_context()? != ctx;
        if pushed {
            // SAFETY: ctx is a primary context retained for the life of the process.
            api.check("cuCtxPushCurrent", unsafe {
                (api.cu_ctx_push_current)(ctx)
            })?;
        }
        Ok(Self {
            api,
            pushed,
            _not_send: PhantomData,
        })
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if self.pushed {
            let mut popped: CuContext = std::ptr::null_mut();
            // SAFETY: `enter` pushed a context on this thread (the guard is not Send), so
            // the thread's context stack is not empty; the popped handle is not used.
            let _ = unsafe { (self.api.cu_ctx_pop_current)(&mut popped) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_driver_library_is_a_clean_error() {
        let e = load("libcuda-graft-test-missing.so.1")
            .err()
            .expect("a missing library must not load");
        assert_eq!(e.kind(), ErrorKind::DriverUnavailable);
        let msg = e.to_string();
        assert!(msg.contains("CUDA driver is not available"), "{msg}");
        assert!(msg.contains("libcuda-graft-test-missing.so.1"), "{msg}");
    }

    #[test]
    fn a_library_without_the_driver_api_is_rejected() {
        // libc loads but has no cuInit: the first missing symbol is named.
        let e = load("libc.so.6").err().expect("libc is not a CUDA driver");
        assert_eq!(e.kind(), ErrorKind::DriverUnavailable);
        assert!(e.to_string().contains("has no cuInit"), "{e}");
    }
}

//! Driver-API helpers for tests and benchmarks (the self-test uses them): device facts,
//! device memory, streams, events and copies, all in a device's primary context.
//! Not needed to launch the kernels, which work on memory and streams the caller owns.

use std::ffi::{c_char, c_int};

use crate::runtime::config::{DeviceLimits, KernelAttrs};
use crate::runtime::device;
use crate::runtime::driver::{self, Api, ContextGuard, CuDevicePtr, CuEvent, CuStream};
use crate::runtime::error::CudaError;
use crate::runtime::kernels;

fn enter(device: i32) -> Result<(&'static Api, ContextGuard), CudaError> {
    let api = driver::api()?;
    let ctx = device::context(device)?;
    Ok((api, ContextGuard::enter(api, ctx)?))
}

/// Facts about a device.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// The device's name.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// L2 cache bytes.
    pub l2_bytes: u32,
    /// Driver version (e.g. 13000 for CUDA 13.0).
    pub driver_version: i32,
    /// Launch-relevant limits (SM count etc.).
    pub limits: DeviceLimits,
}

/// Facts about `device` (does not load the kernels).
pub fn device_info(device: i32) -> Result<DeviceInfo, CudaError> {
    let api = driver::api()?;
    let dev = device::cu_device(api, device)?;
    let mut buf = [0 as c_char; 256];
    // SAFETY: cuDeviceGetName writes at most len bytes, NUL-terminated, into buf.
    let r = unsafe { (api.cu_device_get_name)(buf.as_mut_ptr(), buf.len() as c_int, dev) };
    api.check("cuDeviceGetName", r)?;
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    let mut version: c_int = 0;
    // SAFETY: writes one int.
    let r = unsafe { (api.cu_driver_get_version)(&mut version) };
    api.check("cuDriverGetVersion", r)?;
    let a = |attr| device::attribute(api, dev, attr);
    Ok(DeviceInfo {
        name: String::from_utf8_lossy(&bytes).into_owned(),
        compute_capability: (
            a(driver::ATTR_COMPUTE_CAPABILITY_MAJOR)? as i32,
            a(driver::ATTR_COMPUTE_CAPABILITY_MINOR)? as i32,
        ),
        l2_bytes: a(driver::ATTR_L2_CACHE_SIZE)?,
        driver_version: version,
        limits: device::limits(api, dev)?,
    })
}

/// One loaded kernel's attributes as the driver reports them.
#[derive(Clone, Debug)]
pub struct LoadedKernel {
    /// Entry-point name.
    pub name: String,
    /// Registers, static shared memory, maximum block size.
    pub attrs: KernelAttrs,
    /// Local memory bytes per thread (non-zero means spills or a stack array).
    pub local_bytes: u32,
}

/// Every kernel of the table, as `device` loaded them (loads them if needed).
pub fn loaded_kernels(device: i32) -> Result<Vec<LoadedKernel>, CudaError> {
    let st = device::state(device)?;
    Ok((0..st.attrs.len())
        .map(|i| LoadedKernel {
            name: kernels::name(i),
            attrs: st.attrs[i],
            local_bytes: st.local_bytes[i],
        })
        .collect())
}

/// Waits for all work on `device`'s primary context.
pub fn synchronize(device: i32) -> Result<(), CudaError> {
    let (api, _g) = enter(device)?;
    // SAFETY: a context is current (guard).
    api.check("cuCtxSynchronize", unsafe { (api.cu_ctx_synchronize)() })
}

/// Device memory, freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    device: i32,
    ptr: CuDevicePtr,
    bytes: usize,
}

impl DeviceBuffer {
    /// Allocates `bytes` (> 0) on `device` (256-byte aligned, uninitialised).
    pub fn new(device: i32, bytes: usize) -> Result<Self, CudaError> {
        if bytes == 0 {
            return Err(CudaError::invalid("graft-cuda: cannot allocate 0 bytes"));
        }
        let (api, _g) = enter(device)?;
        let mut ptr: CuDevicePtr = 0;
        // SAFETY: a context is current; one device pointer is written.
        api.check("cuMemAlloc", unsafe { (api.cu_mem_alloc)(&mut ptr, bytes) })?;
        Ok(Self { device, ptr, bytes })
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Always false (allocations are never empty).
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<(), CudaError> {
        if offset.checked_add(len).is_none_or(|end| end > self.bytes) {
            return Err(CudaError::invalid(format!(
                "graft-cuda: {len} bytes at offset {offset} exceed a {}-byte buffer",
                self.bytes
            )));
        }
        Ok(())
    }

    /// Copies `data` to `offset` (synchronous with respect to the host).
    pub fn upload(&self, offset: usize, data: &[u8]) -> Result<(), CudaError> {
        self.check_range(offset, data.len())?;
        let (api, _g) = enter(self.device)?;
        // SAFETY: the destination range lies inside this allocation (checked above) and
        // the source is a live host slice of the same length.
        let r = unsafe {
            (api.cu_memcpy_htod)(self.ptr + offset as u64, data.as_ptr().cast(), data.len())
        };
        api.check("cuMemcpyHtoD", r)?;
        // From pageable memory cuMemcpyHtoD may return before its DMA lands, and kernels on
        // non-blocking streams do not wait for it: finish it before anything reads the buffer.
        // SAFETY: no arguments; this device's context is current (guard `_g`).
        let r = unsafe { (api.cu_ctx_synchronize)() };
        api.check("cuCtxSynchronize", r)
    }

    /// Copies from `offset` into `out` (waits for the copy).
    pub fn download(&self, offset: usize, out: &mut [u8]) -> Result<(), CudaError> {
        self.check_range(offset, out.len())?;
        let (api, _g) = enter(self.device)?;
        // SAFETY: the source range lies inside this allocation (checked above) and the
        // destination is a live, writable host slice of the same length.
        let r = unsafe {
            (api.cu_memcpy_dtoh)(out.as_mut_ptr().cast(), self.ptr + offset as u64, out.len())
        };
        api.check("cuMemcpyDtoH", r)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Ok((api, _g)) = enter(self.device) {
            // SAFETY: ptr came from cuMemAlloc in this context and is freed once.
            let _ = unsafe { (api.cu_mem_free)(self.ptr) };
        }
    }
}

/// Copies `bytes` from `src` to `dst` on `stream` (device addresses of `device`).
///
/// # Safety
/// Both ranges must be valid device memory of `device` for `bytes` bytes until the copy
/// completes.
pub unsafe fn copy_dtod_async(
    device: i32,
    dst: u64,
    src: u64,
    bytes: usize,
    stream: &Stream,
) -> Result<(), CudaError> {
    let (api, _g) = enter(device)?;
    // SAFETY: the caller guarantees both ranges; the stream is live (borrowed).
    let r = unsafe { (api.cu_memcpy_dtod_async)(dst, src, bytes, stream.raw) };
    api.check("cuMemcpyDtoDAsync", r)
}

/// A non-blocking stream (does not synchronise with the legacy default stream).
#[derive(Debug)]
pub struct Stream {
    device: i32,
    raw: CuStream,
}

impl Stream {
    /// Creates a stream on `device`.
    pub fn new(device: i32) -> Result<Self, CudaError> {
        let (api, _g) = enter(device)?;
        let mut raw: CuStream = std::ptr::null_mut();
        // SAFETY: a context is current; one handle is written.
        let r = unsafe { (api.cu_stream_create)(&mut raw, driver::STREAM_NON_BLOCKING) };
        api.check("cuStreamCreate", r)?;
        Ok(Self { device, raw })
    }

    /// The `CUstream` handle, as the launch functions take it.
    pub fn handle(&self) -> usize {
        self.raw as usize
    }

    /// Waits for the stream's work and reports any asynchronous error.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        let (api, _g) = enter(self.device)?;
        // SAFETY: the stream is live.
        api.check("cuStreamSynchronize", unsafe {
            (api.cu_stream_synchronize)(self.raw)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Ok((api, _g)) = enter(self.device) {
            // SAFETY: created by cuStreamCreate, destroyed once.
            let _ = unsafe { (api.cu_stream_destroy)(self.raw) };
        }
    }
}

/// A timing event.
#[derive(Debug)]
pub struct Event {
    device: i32,
    raw: CuEvent,
}

impl Event {
    /// Creates an event on `device`.
    pub fn new(device: i32) -> Result<Self, CudaError> {
        let (api, _g) = enter(device)?;
        let mut raw: CuEvent = std::ptr::null_mut();
        // SAFETY: a context is current; one handle is written; 0 = CU_EVENT_DEFAULT.
        api.check("cuEventCreate", unsafe {
            (api.cu_event_create)(&mut raw, 0)
        })?;
        Ok(Self { device, raw })
    }

    /// Records the event on `stream`.
    pub fn record(&self, stream: &Stream) -> Result<(), CudaError> {
        let (api, _g) = enter(self.device)?;
        // SAFETY: event and stream are live and belong to the same context.
        api.check("cuEventRecord", unsafe {
            (api.cu_event_record)(self.raw, stream.raw)
        })
    }

    /// Milliseconds from `self` to `end` (waits for `end`).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32, CudaError> {
        let (api, _g) = enter(self.device)?;
        // SAFETY: `end` is a live event.
        api.check("cuEventSynchronize", unsafe {
            (api.cu_event_synchronize)(end.raw)
        })?;
        let mut ms = 0f32;
        // SAFETY: both events are live and recorded; one float is written.
        let r = unsafe { (api.cu_event_elapsed_time)(&mut ms, self.raw, end.raw) };
        api.check("cuEventElapsedTime", r)?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Ok((api, _g)) = enter(self.device) {
            // SAFETY: created by cuEventCreate, destroyed once.
            let _ = unsafe { (api.cu_event_destroy)(self.raw) };
        }
    }
}

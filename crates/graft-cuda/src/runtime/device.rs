//! Per-device state: the primary context, the loaded module, every kernel's handle and
//! attributes, and the device's limits. Built once per device (under a lock), then read
//! lock-free: the launch path is two atomic loads.

use std::ffi::{c_int, CString};
use std::sync::{Mutex, OnceLock};

use super::config::{DeviceLimits, KernelAttrs};
use super::driver::{self, Api, ContextGuard, CuContext, CuDevice, CuFunction, CuModule};
use super::error::{CudaError, ErrorKind};
use super::{fatbin, kernels};

/// One device's loaded kernels.
pub(crate) struct DeviceState {
    /// The device's primary context (the one PyTorch uses), retained for the process.
    pub ctx: CuContext,
    pub limits: DeviceLimits,
    /// Kernel handles and attributes, indexed as in the kernel table ([`kernels::table`]).
    pub functions: Box<[CuFunction]>,
    pub attrs: Box<[KernelAttrs]>,
    /// Local memory (spill) bytes per thread of each kernel, as loaded.
    pub local_bytes: Box<[u32]>,
    _module: CuModule,
}

// SAFETY: CUDA driver handles (contexts, modules, functions) may be used from any thread;
// the state is immutable after construction and never freed.
unsafe impl Send for DeviceState {}
// SAFETY: as above; shared references only read the handles.
unsafe impl Sync for DeviceState {}

/// A retained primary context.
#[derive(Clone, Copy)]
struct Context(CuContext);

// SAFETY: a CUcontext handle may be used from any thread.
unsafe impl Send for Context {}
// SAFETY: as above; the handle is only copied.
unsafe impl Sync for Context {}

/// One device's lazily built state: its primary context, then its kernels.
struct Slot {
    ctx: OnceLock<Context>,
    state: OnceLock<DeviceState>,
}

static DEVICES: OnceLock<Box<[Slot]>> = OnceLock::new();
static INIT_LOCK: Mutex<()> = Mutex::new(());

/// Number of CUDA devices (0 when the driver is present but sees none).
pub(crate) fn device_count() -> Result<usize, CudaError> {
    let api = driver::api()?;
    if api.init_result == driver::CUDA_ERROR_NO_DEVICE {
        return Ok(0);
    }
    let mut n: c_int = 0;
    // SAFETY: cuDeviceGetCount writes one int through the valid pointer.
    api.check("cuDeviceGetCount", unsafe {
        (api.cu_device_get_count)(&mut n)
    })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

fn slot(dev: i32) -> Result<&'static Slot, CudaError> {
    let slots = match DEVICES.get() {
        Some(s) => s,
        None => {
            let n = device_count()?;
            DEVICES.get_or_init(|| {
                (0..n)
                    .map(|_| Slot {
                        ctx: OnceLock::new(),
                        state: OnceLock::new(),
                    })
                    .collect()
            })
        }
    };
    usize::try_from(dev)
        .ok()
        .and_then(|i| slots.get(i))
        .ok_or_else(|| {
            CudaError::invalid(format!(
                "graft-cuda: invalid device {dev} ({} CUDA devices)",
                slots.len()
            ))
        })
}

/// Device `dev`'s primary context (the one PyTorch uses), retained for the process.
pub(crate) fn context(dev: i32) -> Result<CuContext, CudaError> {
    let slot = slot(dev)?;
    if let Some(c) = slot.ctx.get() {
        return Ok(c.0);
    }
    let _guard = INIT_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = slot.ctx.get() {
        return Ok(c.0);
    }
    let api = driver::api()?;
    let d = cu_device(api, dev)?;
    let mut ctx: CuContext = std::ptr::null_mut();
    // SAFETY: writes one CUcontext; the retain is never released (process lifetime).
    let r = unsafe { (api.cu_device_primary_ctx_retain)(&mut ctx, d) };
    api.check("cuDevicePrimaryCtxRetain", r)?;
    Ok(slot.ctx.get_or_init(|| Context(ctx)).0)
}

/// The state of device `dev`, loading its module on first use.
pub(crate) fn state(dev: i32) -> Result<&'static DeviceState, CudaError> {
    let slot = slot(dev)?;
    if let Some(s) = slot.state.get() {
        return Ok(s);
    }
    let ctx = context(dev)?;
    let _guard = INIT_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(s) = slot.state.get() {
        return Ok(s);
    }
    let s = load(driver::api()?, dev, ctx)?;
    Ok(slot.state.get_or_init(|| s))
}

/// How many clusters of `cluster` blocks of kernel `kernel` (which declares that cluster size)
/// can be resident on device `dev` at once, with `block` threads and `smem` bytes of dynamic
/// shared memory a block; 0 where the driver cannot say (before CUDA 11.8). Cached per shape.
pub(crate) fn resident_clusters(
    dev: i32,
    kernel: usize,
    cluster: u32,
    block: u32,
    smem: u32,
) -> Result<u32, CudaError> {
    type Key = (i32, usize, u32, u32, u32);
    static CACHE: Mutex<Vec<(Key, u32)>> = Mutex::new(Vec::new());
    let key = (dev, kernel, cluster, block, smem);
    let cached = |c: &Vec<(Key, u32)>| c.iter().find(|(k, _)| *k == key).map(|&(_, n)| n);
    if let Some(n) = cached(&CACHE.lock().unwrap_or_else(|e| e.into_inner())) {
        return Ok(n);
    }
    let api = driver::api()?;
    let Some(query) = api.cu_occupancy_max_active_clusters else {
        return Ok(0);
    };
    let st = state(dev)?;
    let _ctx = ContextGuard::enter(api, st.ctx)?;
    let config = driver::CuLaunchConfig {
        grid_dim: [cluster, 1, 1],
        block_dim: [block, 1, 1],
        shared_mem_bytes: smem,
        stream: std::ptr::null_mut(),
        attrs: std::ptr::null_mut(),
        num_attrs: 0,
    };
    let mut n: c_int = 0;
    // SAFETY: the function belongs to this device's module, whose context is current; the
    // config is a valid CUlaunchConfig without attributes; one int is written.
    let r = unsafe { query(&mut n, st.functions[kernel], &config) };
    api.check("cuOccupancyMaxActiveClusters", r)?;
    let n = u32::try_from(n).unwrap_or(0);
    CACHE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((key, n));
    Ok(n)
}

pub(crate) fn cu_device(api: &Api, ordinal: i32) -> Result<CuDevice, CudaError> {
    let mut dev: CuDevice = 0;
    // SAFETY: cuDeviceGet writes one CUdevice; the driver range-checks the ordinal.
    api.check("cuDeviceGet", unsafe {
        (api.cu_device_get)(&mut dev, ordinal)
    })?;
    Ok(dev)
}

pub(crate) fn attribute(api: &Api, dev: CuDevice, attr: c_int) -> Result<u32, CudaError> {
    let mut v: c_int = 0;
    // SAFETY: cuDeviceGetAttribute writes one int; dev came from cuDeviceGet.
    let r = unsafe { (api.cu_device_get_attribute)(&mut v, attr, dev) };
    api.check("cuDeviceGetAttribute", r)?;
    Ok(u32::try_from(v).unwrap_or(0))
}

/// The launch-relevant limits of a device.
pub(crate) fn limits(api: &Api, dev: CuDevice) -> Result<DeviceLimits, CudaError> {
    let a = |attr| attribute(api, dev, attr);
    Ok(DeviceLimits {
        sms: a(driver::ATTR_MULTIPROCESSOR_COUNT)?,
        max_threads_per_sm: a(driver::ATTR_MAX_THREADS_PER_MULTIPROCESSOR)?,
        regs_per_sm: a(driver::ATTR_MAX_REGISTERS_PER_MULTIPROCESSOR)?,
        max_blocks_per_sm: a(driver::ATTR_MAX_BLOCKS_PER_MULTIPROCESSOR)?,
        smem_per_sm: a(driver::ATTR_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?,
        smem_per_block_optin: a(driver::ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
        reserved_smem_per_block: a(driver::ATTR_RESERVED_SHARED_MEMORY_PER_BLOCK)?,
        clusters: a(driver::ATTR_COMPUTE_CAPABILITY_MAJOR)? >= 9,
    })
}

fn func_attribute(api: &Api, f: CuFunction, attr: c_int) -> Result<u32, CudaError> {
    let mut v: c_int = 0;
    // SAFETY: f is a function handle of a loaded module; one int is written.
    let r = unsafe { (api.cu_func_get_attribute)(&mut v, attr, f) };
    api.check("cuFuncGetAttribute", r)?;
    Ok(u32::try_from(v).unwrap_or(0))
}

fn load(api: &'static Api, ordinal: i32, ctx: CuContext) -> Result<DeviceState, CudaError> {
    let image = fatbin::fatbin().ok_or_else(|| {
        CudaError::new(
            ErrorKind::NoKernels,
            "graft-cuda was built without CUDA kernels (nvcc was not found or failed at build \
             time; rebuild with NVCC=/path/to/nvcc)",
        )
    })?;
    let dev = cu_device(api, ordinal)?;
    let limits = limits(api, dev)?;
    let _current = ContextGuard::enter(api, ctx)?;

    let mut module: CuModule = std::ptr::null_mut();
    // SAFETY: `image` is a complete fatbin that lives for the whole program (static) and
    // is 64-byte aligned (fatbin.rs); the driver copies what it needs.
    let r = unsafe { (api.cu_module_load_data)(&mut module, image.as_ptr().cast()) };
    api.check("cuModuleLoadData (graft-cuda kernels)", r)?;

    let table = kernels::table();
    let mut functions = Vec::with_capacity(table.len());
    let mut attrs = Vec::with_capacity(table.len());
    let mut local_bytes = Vec::with_capacity(table.len());
    for kernel in table {
        let name = &kernel.name;
        let cname = CString::new(name.as_str()).expect("kernel names have no NUL");
        let mut f: CuFunction = std::ptr::null_mut();
        // SAFETY: module is loaded; cname is NUL-terminated; one handle is written.
        let r = unsafe { (api.cu_module_get_function)(&mut f, module, cname.as_ptr()) };
        api.check(&format!("cuModuleGetFunction({name})"), r)?;
        let k = KernelAttrs {
            regs: func_attribute(api, f, driver::FUNC_ATTR_NUM_REGS)?,
            static_smem: func_attribute(api, f, driver::FUNC_ATTR_SHARED_SIZE_BYTES)?,
            max_threads: func_attribute(api, f, driver::FUNC_ATTR_MAX_THREADS_PER_BLOCK)?,
        };
        if kernel.attrs.large_smem {
            let max_dyn = limits.smem_per_block_optin.saturating_sub(k.static_smem);
            // SAFETY: f is a valid function handle; the value is within the device limit.
            let r = unsafe {
                (api.cu_func_set_attribute)(
                    f,
                    driver::FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    max_dyn as c_int,
                )
            };
            api.check("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", r)?;
        }
        // The answer is not checked (see LoadAttrs::large_cluster).
        if limits.clusters && kernel.attrs.large_cluster {
            // SAFETY: f is a valid function handle; the attribute takes 0 or 1.
            let _ = unsafe {
                (api.cu_func_set_attribute)(
                    f,
                    driver::FUNC_ATTR_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                    1,
                )
            };
        }
        local_bytes.push(func_attribute(api, f, driver::FUNC_ATTR_LOCAL_SIZE_BYTES)?);
        functions.push(f);
        attrs.push(k);
    }
    Ok(DeviceState {
        ctx,
        limits,
        functions: functions.into_boxed_slice(),
        attrs: attrs.into_boxed_slice(),
        local_bytes: local_bytes.into_boxed_slice(),
        _module: module,
    })
}

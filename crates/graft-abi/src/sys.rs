//! Raw C types of PyTorch's stable ABI and the table of its functions, resolved at run time.
//!
//! Nothing links libtorch at build time: the symbols are looked up with `dlopen(RTLD_NOLOAD)` +
//! `dlsym` in the libtorch that the host process (usually `import torch`) already loaded, so one
//! build serves every torch >= 2.11. Functions added after 2.11 are optional.

use std::ffi::{c_char, c_void};
use std::sync::OnceLock;

use libc::{RTLD_NOLOAD, RTLD_NOW};
use libloading::os::unix::Library;

/// One slot of a boxed stack: a tensor handle, a list handle, a heap cell pointer or plain bits.
pub type StableIValue = u64;
/// 0 on success (`AOTI_TORCH_SUCCESS`).
pub type AOTITorchError = i32;

/// Opaque `at::Tensor` behind an `AtenTensorHandle`.
#[repr(C)]
pub struct AtenTensorOpaque {
    _private: [u8; 0],
}
/// Opaque `torch::Library` behind a `TorchLibraryHandle`.
#[repr(C)]
pub struct TorchLibraryOpaque {
    _private: [u8; 0],
}
/// Opaque `std::vector<StableIValue>` behind a `StableListHandle`.
#[repr(C)]
pub struct StableListOpaque {
    _private: [u8; 0],
}
/// Opaque `c10::cuda::CUDAGuard`.
#[repr(C)]
pub struct CudaGuardOpaque {
    _private: [u8; 0],
}

pub type AtenTensorHandle = *mut AtenTensorOpaque;
pub type TorchLibraryHandle = *mut TorchLibraryOpaque;
pub type StableListHandle = *mut StableListOpaque;
pub type CudaGuardHandle = *mut CudaGuardOpaque;

/// A boxed kernel: `(stack, num_args, num_outputs)`. It may unwind a C++ exception (our kernels
/// raise errors through `aoti_torch_check`), hence "C-unwind".
pub type BoxedKernelFn = unsafe extern "C-unwind" fn(*mut StableIValue, u64, u64);
/// Body of `torch_parallel_for`: `(begin, end, ctx)`. Must not unwind.
pub type ParallelFn = unsafe extern "C" fn(i64, i64, *mut c_void);

/// The stable-ABI version we build against, passed to the versioned entry points
/// (`TORCH_VERSION_2_11_0`): libtorch converts values the way a 2.11 extension expects.
pub const TORCH_ABI_TARGET: u64 = (2 << 56) | (11 << 48);

macro_rules! symbol_table {
    (
        required { $( $name:ident : $ty:ty ; )* }
        optional { $( $oname:ident : $oty:ty ; )* }
    ) => {
        /// Functions of the stable ABI, resolved once per process.
        #[allow(non_snake_case, missing_docs)]
        pub struct Api {
            $( pub $name: $ty, )*
            $( pub $oname: Option<$oty>, )*
            /// libstdc++'s `operator new(size_t)` as libtorch sees it (2.11 heap cells).
            pub operator_new: unsafe extern "C" fn(usize) -> *mut c_void,
            /// libstdc++'s `operator delete(void*)` as libtorch sees it (2.11 heap cells).
            pub operator_delete: unsafe extern "C" fn(*mut c_void),
            /// Present when libtorch_cuda is loaded.
            pub cuda: Option<CudaApi>,
        }

        impl Api {
            fn load(lib: &Library) -> Result<Api, String> {
                Ok(Api {
                    $( $name: required(lib, stringify!($name))?, )*
                    $( $oname: optional(lib, stringify!($oname)), )*
                    operator_new: required(lib, "_Znwm")?,
                    operator_delete: required(lib, "_ZdlPv")?,
                    cuda: CudaApi::load(),
                })
            }
        }
    };
}

symbol_table! {
    required {
        aoti_torch_check: unsafe extern "C-unwind" fn(bool, *const c_char, *const c_char, u32, *const c_char);
        aoti_torch_device_type_cpu: unsafe extern "C" fn() -> i32;
        aoti_torch_device_type_cuda: unsafe extern "C" fn() -> i32;
        aoti_torch_device_type_meta: unsafe extern "C" fn() -> i32;
        aoti_torch_dtype_float32: unsafe extern "C" fn() -> i32;
        aoti_torch_dtype_bfloat16: unsafe extern "C" fn() -> i32;
        aoti_torch_delete_tensor_object: unsafe extern "C" fn(AtenTensorHandle) -> AOTITorchError;
        aoti_torch_new_tensor_handle: unsafe extern "C" fn(AtenTensorHandle, *mut AtenTensorHandle) -> AOTITorchError;
        aoti_torch_new_uninitialized_tensor: unsafe extern "C" fn(*mut AtenTensorHandle) -> AOTITorchError;
        aoti_torch_is_defined: unsafe extern "C" fn(AtenTensorHandle, *mut bool) -> AOTITorchError;
        aoti_torch_get_dtype: unsafe extern "C" fn(AtenTensorHandle, *mut i32) -> AOTITorchError;
        aoti_torch_get_device_type: unsafe extern "C" fn(AtenTensorHandle, *mut i32) -> AOTITorchError;
        aoti_torch_get_device_index: unsafe extern "C" fn(AtenTensorHandle, *mut i32) -> AOTITorchError;
        aoti_torch_get_dim: unsafe extern "C" fn(AtenTensorHandle, *mut i64) -> AOTITorchError;
        aoti_torch_get_numel: unsafe extern "C" fn(AtenTensorHandle, *mut i64) -> AOTITorchError;
        aoti_torch_get_sizes: unsafe extern "C" fn(AtenTensorHandle, *mut *mut i64) -> AOTITorchError;
        aoti_torch_get_strides: unsafe extern "C" fn(AtenTensorHandle, *mut *mut i64) -> AOTITorchError;
        aoti_torch_get_data_ptr: unsafe extern "C" fn(AtenTensorHandle, *mut *mut c_void) -> AOTITorchError;
        aoti_torch_is_contiguous: unsafe extern "C" fn(AtenTensorHandle, *mut bool) -> AOTITorchError;
        aoti_torch_empty_strided: unsafe extern "C" fn(i64, *const i64, *const i64, i32, i32, i32, *mut AtenTensorHandle) -> AOTITorchError;
        aoti_torch_copy_: unsafe extern "C" fn(AtenTensorHandle, AtenTensorHandle, i32) -> AOTITorchError;
        aoti_torch_library_init_impl: unsafe extern "C" fn(*const c_char, *const c_char, *const c_char, u32, *mut TorchLibraryHandle) -> AOTITorchError;
        aoti_torch_library_init_fragment: unsafe extern "C" fn(*const c_char, *const c_char, u32, *mut TorchLibraryHandle) -> AOTITorchError;
        aoti_torch_library_def: unsafe extern "C" fn(TorchLibraryHandle, *const c_char) -> AOTITorchError;
        aoti_torch_delete_library_object: unsafe extern "C" fn(TorchLibraryHandle) -> AOTITorchError;
        torch_library_impl: unsafe extern "C" fn(TorchLibraryHandle, *const c_char, BoxedKernelFn, u64) -> AOTITorchError;
        torch_call_dispatcher: unsafe extern "C" fn(*const c_char, *const c_char, *mut StableIValue, u64) -> AOTITorchError;
        torch_new_list_reserve_size: unsafe extern "C" fn(usize, *mut StableListHandle) -> AOTITorchError;
        torch_list_size: unsafe extern "C" fn(StableListHandle, *mut usize) -> AOTITorchError;
        torch_list_get_item: unsafe extern "C" fn(StableListHandle, usize, *mut StableIValue) -> AOTITorchError;
        torch_list_push_back: unsafe extern "C" fn(StableListHandle, StableIValue) -> AOTITorchError;
        torch_delete_list: unsafe extern "C" fn(StableListHandle) -> AOTITorchError;
        torch_parallel_for: unsafe extern "C" fn(i64, i64, i64, ParallelFn, *mut c_void) -> AOTITorchError;
        torch_get_num_threads: unsafe extern "C" fn(*mut u32) -> AOTITorchError;
    }
    optional {
        // 2.13+
        torch_new_stable_ivalue: unsafe extern "C" fn(*mut *mut StableIValue) -> AOTITorchError;
        torch_delete_stable_ivalue: unsafe extern "C" fn(*mut StableIValue) -> AOTITorchError;
        torch_exception_get_what_without_backtrace: unsafe extern "C" fn() -> *const c_char;
        // The AOTInductor shim's addmm (its schema's Scalars cannot cross torch_call_dispatcher);
        // marked deprecated in newer torch, so optional.
        aoti_torch_addmm_out: unsafe extern "C" fn(AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, f32, f32) -> AOTITorchError;
    }
}

/// CUDA functions, exported by libtorch_cuda.
#[allow(missing_docs)]
pub struct CudaApi {
    pub aoti_torch_get_current_cuda_stream:
        unsafe extern "C" fn(i32, *mut *mut c_void) -> AOTITorchError,
    pub aoti_torch_create_cuda_guard:
        unsafe extern "C" fn(i32, *mut CudaGuardHandle) -> AOTITorchError,
    pub aoti_torch_delete_cuda_guard: unsafe extern "C" fn(CudaGuardHandle) -> AOTITorchError,
}

impl CudaApi {
    fn load() -> Option<CudaApi> {
        let lib = open_loaded("libtorch_cuda.so").ok()?;
        let api = (|| -> Result<CudaApi, String> {
            Ok(CudaApi {
                aoti_torch_get_current_cuda_stream: required(
                    &lib,
                    "aoti_torch_get_current_cuda_stream",
                )?,
                aoti_torch_create_cuda_guard: required(&lib, "aoti_torch_create_cuda_guard")?,
                aoti_torch_delete_cuda_guard: required(&lib, "aoti_torch_delete_cuda_guard")?,
            })
        })()
        .ok();
        // The function pointers stay valid while libtorch_cuda stays loaded, which it does for the
        // life of the process once torch has loaded it; keep our reference too.
        std::mem::forget(lib);
        api
    }
}

/// Opens a library that is already loaded in the process, without loading anything.
fn open_loaded(name: &str) -> Result<Library, String> {
    // SAFETY: RTLD_NOLOAD never runs initialisers: it only returns a handle to an object that is
    // already mapped, or fails.
    unsafe { Library::open(Some(name), RTLD_NOW | RTLD_NOLOAD) }
        .map_err(|e| format!("{name} is not loaded in this process ({e}); import torch first"))
}

fn optional<T: Copy>(lib: &Library, name: &str) -> Option<T> {
    // SAFETY: every `T` in the symbol table is the C signature that the stable-ABI headers declare
    // for `name`; the symbol is only called through that signature.
    unsafe { lib.get::<T>(name.as_bytes()) }.ok().map(|s| *s)
}

fn required<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
    optional(lib, name)
        .ok_or_else(|| format!("libtorch does not export `{name}`: torch >= 2.11 is required"))
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

/// The stable-ABI function table of the libtorch in this process, loaded on first use.
pub fn api() -> Result<&'static Api, String> {
    API.get_or_init(|| {
        let lib = open_loaded("libtorch_cpu.so")?;
        let api = Api::load(&lib)?;
        // Keep libtorch_cpu referenced: our function pointers must never dangle.
        std::mem::forget(lib);
        Ok(api)
    })
    .as_ref()
    .map_err(Clone::clone)
}

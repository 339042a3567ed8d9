//! Safe Rust bindings to PyTorch's stable C ABI.
//!
//! The functions are resolved when first used, from the libtorch that the process already loaded
//! (`import torch` in Python, or a host program that loaded it): nothing links libtorch at build
//! time, and one build serves torch 2.11, 2.12 and 2.13+. Functions added after 2.11 are used when
//! present.
//!
//! - [`Tensor`] / [`NewTensor`]: owned tensor handles (freed exactly once) and fresh outputs.
//! - [`Kernel`] and [`Library`]: boxed kernels for aten (or new) operators, registered at a
//!   dispatch key and removed when the library is dropped.
//! - [`dispatch::call`]: calling other operators through the dispatcher; [`aten`]: the few
//!   ATen functions it cannot reach (schemas with `Scalar`s).
//! - [`parallel`]: torch's intra-op thread pool; [`cuda`]: current stream and device guard.
//! - [`operands`]: the checks every kernel entry makes of its tensor operands (devices, dtypes,
//!   sizes, layouts, shared memory) before it touches their data.

pub mod aten;
pub mod cuda;
pub mod dispatch;
mod dtype;
mod error;
mod kernel;
mod library;
pub mod operands;
pub mod parallel;
mod stack;
pub mod sys;
mod tensor;

pub use dtype::{DType, Device, DeviceType, Element};
pub use error::{Error, Result};
pub use kernel::{panic_message, Kernel};
pub use library::Library;
pub use operands::{Checked, Operands};
pub use stack::{CallArgs, CallOutputs, FromStable, IntoStable, KernelArgs, KernelOutputs};
pub use tensor::{contiguous_strides, in_place_views, is_dense, NewTensor, Tensor};

/// Loads the stable-ABI table now, checking that this torch is one we support.
///
/// Fails with a clear message when libtorch is not loaded in the process or is too old.
pub fn load() -> Result<()> {
    let api = sys::api().map_err(Error::msg)?;
    // SAFETY: the getters take no arguments and return constants.
    let codes = unsafe {
        [
            ((api.aoti_torch_device_type_cpu)(), DeviceType::CPU.0),
            ((api.aoti_torch_device_type_cuda)(), DeviceType::CUDA.0),
            ((api.aoti_torch_device_type_meta)(), DeviceType::META.0),
            ((api.aoti_torch_dtype_float32)(), DType::F32.0),
            ((api.aoti_torch_dtype_bfloat16)(), DType::BF16.0),
        ]
    };
    ensure!(
        codes.iter().all(|(torch, ours)| torch == ours),
        "this libtorch encodes dtypes or devices differently from what torchgraft expects"
    );
    Ok(())
}

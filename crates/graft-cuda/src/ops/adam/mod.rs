//! Fused Adam / AdamW steps over lists of tensors (adam.cu): the arithmetic of ATen's
//! `_fused_adam_` / `_fused_adamw_` CUDA kernel, in as few launches as the parameter block
//! allows (up to [`MAX_TENSORS`] tensors each).

use crate::runtime::error::CudaError;
use crate::runtime::kernels::Kernel;
use crate::runtime::launch::{launch_named, NamedLaunch};
use crate::DType;

/// Tensors one launch carries (`kMaxTensors` in adam.cu).
pub const MAX_TENSORS: usize = 480;
/// Elements per block: a multiple of every pack size, large enough that the per-block
/// constants (two `pow`) cost nothing, small enough to spread a small tensor over many SMs.
const CHUNK: u64 = 1 << 15;
/// Threads per block.
const BLOCK: u32 = 512;

/// Adam or AdamW.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AdamMode {
    /// L2 penalty added to the gradient (`aten::_fused_adam_`).
    Adam,
    /// Decoupled weight decay (`aten::_fused_adamw_`).
    AdamW,
}

/// One tensor's device pointers, all to `numel` contiguous elements of the step's dtype.
#[derive(Clone, Copy, Debug, Default)]
pub struct AdamTensor {
    /// The parameter.
    pub param: u64,
    /// Its gradient (written back unscaled when a grad scale is given).
    pub grad: u64,
    /// First moment.
    pub exp_avg: u64,
    /// Second moment.
    pub exp_avg_sq: u64,
    /// AMSGrad's running maximum (0 without AMSGrad).
    pub max_exp_avg_sq: u64,
    /// The step count: one `float` on the device.
    pub step: u64,
    /// Elements.
    pub numel: u64,
}

/// Arguments of [`adam_step`].
#[derive(Clone, Copy, Debug)]
pub struct AdamStep<'a> {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Element type of every tensor.
    pub dtype: DType,
    /// Adam or AdamW.
    pub mode: AdamMode,
    /// Whether `max_exp_avg_sq` is kept (AMSGrad).
    pub amsgrad: bool,
    /// Whether to ascend.
    pub maximize: bool,
    /// Learning rate (unused when `lr_ptr` is set).
    pub lr: f64,
    /// The learning rate as one `float` on the device, or 0.
    pub lr_ptr: u64,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Weight decay.
    pub weight_decay: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// One `float` the gradients are divided by, or 0.
    pub grad_scale: u64,
    /// One `float`; when it holds 1.0 nothing is updated. 0 for none.
    pub found_inf: u64,
    /// The tensors (empty ones are skipped).
    pub tensors: &'a [AdamTensor],
}

/// `graft_adam::AdamParams` of adam.cu (every field 8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct AdamParams {
    lr: f64,
    beta1: f64,
    beta2: f64,
    weight_decay: f64,
    eps: f64,
    lr_ptr: u64,
    grad_scale: u64,
    found_inf: u64,
    maximize: i64,
    ntensors: i64,
    chunk: i64,
    param: [u64; MAX_TENSORS],
    grad: [u64; MAX_TENSORS],
    exp_avg: [u64; MAX_TENSORS],
    exp_avg_sq: [u64; MAX_TENSORS],
    max_exp_avg_sq: [u64; MAX_TENSORS],
    step: [u64; MAX_TENSORS],
    numel: [i64; MAX_TENSORS],
    first_chunk: [i64; MAX_TENSORS + 1],
}

fn dtype_tag(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
    }
}

fn kernel_name(mode: AdamMode, dtype: DType, amsgrad: bool) -> String {
    let mode = match mode {
        AdamMode::Adam => "adam",
        AdamMode::AdamW => "adamw",
    };
    let ams = if amsgrad { "ams" } else { "plain" };
    format!("graft_adam_{mode}_{}_{ams}", dtype_tag(dtype))
}

/// adam's kernel table: its kernels need no attribute set at load time.
pub(crate) fn kernel_table() -> Vec<Kernel> {
    kernel_names().into_iter().map(Kernel::plain).collect()
}

/// Entry points of adam.cu.
fn kernel_names() -> Vec<String> {
    let mut out = Vec::new();
    for mode in [AdamMode::Adam, AdamMode::AdamW] {
        for amsgrad in [false, true] {
            for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
                out.push(kernel_name(mode, dtype, amsgrad));
            }
        }
    }
    out
}

fn check_ptr(what: &str, i: usize, p: u64, align: u64) -> Result<(), CudaError> {
    if p == 0 || !p.is_multiple_of(align) {
        return Err(CudaError::invalid(format!(
            "graft-cuda: adam: {what} of tensor {i} (0x{p:x}) is null or misaligned"
        )));
    }
    Ok(())
}

fn check(a: &AdamStep<'_>) -> Result<(), CudaError> {
    let size = a.dtype.size() as u64;
    for (i, t) in a.tensors.iter().enumerate() {
        if t.numel == 0 {
            continue;
        }
        if t.numel
            .checked_mul(size)
            .is_none_or(|b| b > i64::MAX as u64)
        {
            return Err(CudaError::invalid(format!(
                "graft-cuda: adam: tensor {i} of {} elements is too large",
                t.numel
            )));
        }
        check_ptr("param", i, t.param, size)?;
        check_ptr("grad", i, t.grad, size)?;
        check_ptr("exp_avg", i, t.exp_avg, size)?;
        check_ptr("exp_avg_sq", i, t.exp_avg_sq, size)?;
        if a.amsgrad {
            check_ptr("max_exp_avg_sq", i, t.max_exp_avg_sq, size)?;
        }
        check_ptr("step", i, t.step, 4)?;
    }
    for (what, p) in [
        ("lr", a.lr_ptr),
        ("grad_scale", a.grad_scale),
        ("found_inf", a.found_inf),
    ] {
        if !p.is_multiple_of(4) {
            return Err(CudaError::invalid(format!(
                "graft-cuda: adam: {what} (0x{p:x}) is misaligned"
            )));
        }
    }
    Ok(())
}

/// One Adam/AdamW step of every tensor in `a.tensors`, on `a.stream` (no synchronisation, no
/// allocation): one launch per [`MAX_TENSORS`] non-empty tensors.
pub fn adam_step(a: &AdamStep<'_>) -> Result<(), CudaError> {
    check(a)?;
    let name = kernel_name(a.mode, a.dtype, a.amsgrad);
    let mut params = Box::new(AdamParams {
        lr: a.lr,
        beta1: a.beta1,
        beta2: a.beta2,
        weight_decay: a.weight_decay,
        eps: a.eps,
        lr_ptr: a.lr_ptr,
        grad_scale: a.grad_scale,
        found_inf: a.found_inf,
        maximize: i64::from(a.maximize),
        ntensors: 0,
        chunk: CHUNK as i64,
        param: [0; MAX_TENSORS],
        grad: [0; MAX_TENSORS],
        exp_avg: [0; MAX_TENSORS],
        exp_avg_sq: [0; MAX_TENSORS],
        max_exp_avg_sq: [0; MAX_TENSORS],
        step: [0; MAX_TENSORS],
        numel: [0; MAX_TENSORS],
        first_chunk: [0; MAX_TENSORS + 1],
    });
    let tensors: Vec<&AdamTensor> = a.tensors.iter().filter(|t| t.numel > 0).collect();
    for group in tensors.chunks(MAX_TENSORS) {
        let p = &mut *params;
        let mut chunks = 0u64;
        for (k, t) in group.iter().enumerate() {
            p.param[k] = t.param;
            p.grad[k] = t.grad;
            p.exp_avg[k] = t.exp_avg;
            p.exp_avg_sq[k] = t.exp_avg_sq;
            p.max_exp_avg_sq[k] = t.max_exp_avg_sq;
            p.step[k] = t.step;
            p.numel[k] = t.numel as i64;
            p.first_chunk[k] = chunks as i64;
            chunks += t.numel.div_ceil(CHUNK);
        }
        p.first_chunk[group.len()] = chunks as i64;
        p.ntensors = group.len() as i64;
        let grid = u32::try_from(chunks).map_err(|_| {
            CudaError::invalid("graft-cuda: adam: too many elements for one launch".to_string())
        })?;
        let launch = NamedLaunch {
            device: a.device,
            stream: a.stream,
            name: &name,
            grid,
            block: BLOCK,
            smem: 0,
        };
        launch_named(&launch, p)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_match_the_cuda_struct() {
        // 11 scalars, 8 arrays of MAX_TENSORS, one more prefix sum; within the 32764-byte
        // parameter limit.
        let size = std::mem::size_of::<AdamParams>();
        assert_eq!(size, 8 * (11 + 8 * MAX_TENSORS + 1));
        assert!(size <= 32764);
    }

    #[test]
    fn names_cover_every_mode_dtype_and_amsgrad() {
        let names = kernel_names();
        assert_eq!(names.len(), 16);
        assert!(names.contains(&"graft_adam_adamw_bf16_ams".to_string()));
        assert!(names.contains(&"graft_adam_adam_f64_plain".to_string()));
    }

    #[test]
    fn chunks_hold_whole_packs() {
        assert!(CHUNK.is_multiple_of(8));
    }
}

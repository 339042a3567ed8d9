//! Gated linear units (SwiGLU, GeGLU) over contiguous arrays: `y = act(gate) * up` and its
//! backward, launched from glu.cu.

use crate::runtime::error::CudaError;
use crate::runtime::kernels::Kernel;
use crate::runtime::launch::{grid_covering, launch_named, NamedLaunch};
use crate::DType;

/// The activation applied to the gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GluActivation {
    /// `x * sigmoid(x)` (SwiGLU).
    Silu,
    /// GELU with the tanh approximation (GeGLU, `approximate="tanh"`).
    GeluTanh,
    /// Exact GELU, `x * Phi(x)` (GeGLU, `approximate="none"`).
    GeluErf,
}

impl GluActivation {
    const ALL: [GluActivation; 3] = [
        GluActivation::Silu,
        GluActivation::GeluTanh,
        GluActivation::GeluErf,
    ];

    fn tag(self) -> &'static str {
        match self {
            GluActivation::Silu => "silu",
            GluActivation::GeluTanh => "gelu_tanh",
            GluActivation::GeluErf => "gelu_erf",
        }
    }
}

/// Arguments of [`glu_forward`]: device pointers to `n` contiguous elements of `dtype` each.
#[derive(Clone, Copy, Debug)]
pub struct GluForward {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Element type of every array.
    pub dtype: DType,
    /// The activation.
    pub activation: GluActivation,
    /// Input `gate`.
    pub gate: u64,
    /// Input `up`.
    pub up: u64,
    /// Output `y = act(gate) * up`.
    pub y: u64,
    /// Elements per array.
    pub n: usize,
}

/// Arguments of [`glu_backward`]: device pointers to `n` contiguous elements of `dtype` each.
#[derive(Clone, Copy, Debug)]
pub struct GluBackward {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Element type of every array.
    pub dtype: DType,
    /// The activation.
    pub activation: GluActivation,
    /// Forward input `gate`.
    pub gate: u64,
    /// Forward input `up`.
    pub up: u64,
    /// Gradient of `y`.
    pub dy: u64,
    /// Output: gradient of `gate` (may be `gate` itself).
    pub dgate: u64,
    /// Output: gradient of `up` (may be `up` itself).
    pub dup: u64,
    /// Elements per array.
    pub n: usize,
}

/// `graft_glu::GluParams` of glu.cu (every field 8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct GluParams {
    gate: u64,
    up: u64,
    dy: u64,
    out0: u64,
    out1: u64,
    n: i64,
    vec: i64,
}

const BLOCK: u32 = 256;

fn dtype_tag(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
    }
}

/// glu's kernel table: its kernels need no attribute set at load time.
pub(crate) fn kernel_table() -> Vec<Kernel> {
    kernel_names().into_iter().map(Kernel::plain).collect()
}

/// Entry points of glu.cu.
fn kernel_names() -> Vec<String> {
    let mut out = Vec::new();
    for act in GluActivation::ALL {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            for dir in ["fwd", "bwd"] {
                out.push(format!(
                    "graft_glu_{dir}_{}_{}",
                    act.tag(),
                    dtype_tag(dtype)
                ));
            }
        }
    }
    out
}

fn check_ptr(name: &str, p: u64, dtype: DType) -> Result<(), CudaError> {
    if p == 0 || !p.is_multiple_of(dtype.size() as u64) {
        return Err(CudaError::invalid(format!(
            "graft-cuda: glu: {name} (0x{p:x}) is null or not aligned to its element size"
        )));
    }
    Ok(())
}

/// Whether 16-byte packs cover the arrays exactly.
fn vectorizable(ptrs: &[u64], n: usize, dtype: DType) -> bool {
    n.is_multiple_of(16 / dtype.size()) && ptrs.iter().all(|p| p.is_multiple_of(16))
}

fn run(
    dir: &str,
    device: i32,
    stream: usize,
    dtype: DType,
    activation: GluActivation,
    mut params: GluParams,
    ptrs: &[u64],
) -> Result<(), CudaError> {
    let n = params.n as u64;
    let vec = vectorizable(ptrs, params.n as usize, dtype);
    params.vec = i64::from(vec);
    let work = if vec {
        n / (16 / dtype.size() as u64)
    } else {
        n
    };
    let name = format!("graft_glu_{dir}_{}_{}", activation.tag(), dtype_tag(dtype));
    let launch = NamedLaunch {
        device,
        stream,
        name: &name,
        grid: grid_covering(work, BLOCK),
        block: BLOCK,
        smem: 0,
    };
    launch_named(&launch, &mut params)
}

fn check_len(n: usize, dtype: DType) -> Result<(), CudaError> {
    if (n as u64)
        .checked_mul(dtype.size() as u64)
        .is_none_or(|b| b > i64::MAX as u64)
    {
        return Err(CudaError::invalid(format!(
            "graft-cuda: glu of {n} elements is too large"
        )));
    }
    Ok(())
}

/// `y = act(gate) * up` on `a.stream`; nothing is launched for `n == 0`.
pub fn glu_forward(a: &GluForward) -> Result<(), CudaError> {
    if a.n == 0 {
        return Ok(());
    }
    check_len(a.n, a.dtype)?;
    for (name, p) in [("gate", a.gate), ("up", a.up), ("y", a.y)] {
        check_ptr(name, p, a.dtype)?;
    }
    let params = GluParams {
        gate: a.gate,
        up: a.up,
        dy: 0,
        out0: a.y,
        out1: 0,
        n: a.n as i64,
        vec: 0,
    };
    let ptrs = [a.gate, a.up, a.y];
    run(
        "fwd",
        a.device,
        a.stream,
        a.dtype,
        a.activation,
        params,
        &ptrs,
    )
}

/// `dgate = dy * up * act'(gate)`, `dup = dy * act(gate)` on `a.stream`; nothing is launched for
/// `n == 0`. Each element is read before it is written, so the outputs may alias the inputs.
pub fn glu_backward(a: &GluBackward) -> Result<(), CudaError> {
    if a.n == 0 {
        return Ok(());
    }
    check_len(a.n, a.dtype)?;
    for (name, p) in [
        ("gate", a.gate),
        ("up", a.up),
        ("dy", a.dy),
        ("dgate", a.dgate),
        ("dup", a.dup),
    ] {
        check_ptr(name, p, a.dtype)?;
    }
    let params = GluParams {
        gate: a.gate,
        up: a.up,
        dy: a.dy,
        out0: a.dgate,
        out1: a.dup,
        n: a.n as i64,
        vec: 0,
    };
    let ptrs = [a.gate, a.up, a.dy, a.dgate, a.dup];
    run(
        "bwd",
        a.device,
        a.stream,
        a.dtype,
        a.activation,
        params,
        &ptrs,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_match_the_cuda_struct() {
        assert_eq!(std::mem::size_of::<GluParams>(), 7 * 8);
    }

    #[test]
    fn names_cover_every_activation_dtype_and_direction() {
        let names = kernel_names();
        assert_eq!(names.len(), 3 * 4 * 2);
        assert!(names.contains(&"graft_glu_bwd_gelu_tanh_bf16".to_string()));
    }

    #[test]
    fn packs_need_aligned_pointers_and_whole_packs() {
        assert!(vectorizable(&[256, 512], 16, DType::BF16));
        assert!(!vectorizable(&[256, 514], 16, DType::BF16));
        assert!(!vectorizable(&[256, 512], 12, DType::BF16));
        assert!(vectorizable(&[256, 512], 12, DType::F32));
    }
}

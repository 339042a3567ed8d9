//! Gated linear units (SwiGLU, GeGLU) over contiguous arrays: `y = act(gate) * up` and its
//! backward, launched from glu.cu; and SwiGLU over packed rows `[gate | up]` (one array of
//! `rows x 2 cols`, a fused gate-and-up projection's output) with a gradient packed the same way.

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

/// Arguments of [`glu_packed_forward`] (SwiGLU): device pointers to contiguous arrays of
/// `dtype`.
#[derive(Clone, Copy, Debug)]
pub struct GluPackedForward {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Element type of every array.
    pub dtype: DType,
    /// Input, `rows x 2 cols`: each row `[gate | up]`.
    pub gate_up: u64,
    /// Output `y = silu(gate) * up`, `rows x cols`.
    pub y: u64,
    /// Rows of every array.
    pub rows: usize,
    /// Elements of `gate` (and of `up`) per row: half a row of `gate_up`.
    pub cols: usize,
}

/// Arguments of [`glu_packed_backward`] (SwiGLU): device pointers to contiguous arrays of
/// `dtype`.
#[derive(Clone, Copy, Debug)]
pub struct GluPackedBackward {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Element type of every array.
    pub dtype: DType,
    /// Forward input, `rows x 2 cols`: each row `[gate | up]`.
    pub gate_up: u64,
    /// Gradient of `y`, `rows x cols`.
    pub dy: u64,
    /// Output, `rows x 2 cols`: each row `[dgate | dup]` (may be `gate_up` itself).
    pub d_gate_up: u64,
    /// Rows of every array.
    pub rows: usize,
    /// Elements of `gate` (and of `up`) per row: half a row of `gate_up`.
    pub cols: usize,
}

/// `graft_glu::GluPackedParams` of glu.cu (every field 8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct GluPackedParams {
    gate_up: u64,
    dy: u64,
    out: u64,
    rows: i64,
    cols: i64,
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

const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// Entry points of glu.cu: the flat kernels of every activation, the packed ones of SiLU.
fn kernel_names() -> Vec<String> {
    let mut out = Vec::new();
    for act in GluActivation::ALL {
        for dtype in DTYPES {
            for dir in ["fwd", "bwd"] {
                out.push(format!(
                    "graft_glu_{dir}_{}_{}",
                    act.tag(),
                    dtype_tag(dtype)
                ));
            }
        }
    }
    for dtype in DTYPES {
        for dir in ["fwd", "bwd"] {
            out.push(packed_kernel_name(dir, dtype));
        }
    }
    out
}

fn packed_kernel_name(dir: &str, dtype: DType) -> String {
    format!("graft_glu_packed_{dir}_silu_{}", dtype_tag(dtype))
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

/// The packed kernels' launch: 16-byte packs when every base is aligned and `cols` (so every
/// row, and with it `rows * cols`) is a whole number of packs.
fn run_packed(
    dir: &str,
    device: i32,
    stream: usize,
    dtype: DType,
    mut params: GluPackedParams,
    ptrs: &[u64],
) -> Result<(), CudaError> {
    let n = (params.rows * params.cols) as u64;
    let vec = vectorizable(ptrs, params.cols as usize, dtype);
    params.vec = i64::from(vec);
    let work = if vec {
        n / (16 / dtype.size() as u64)
    } else {
        n
    };
    let name = packed_kernel_name(dir, dtype);
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

/// The elements of `rows x 2 cols` (the larger array of a packed call), checked as
/// [`check_len`] checks a flat one.
fn packed_len(rows: usize, cols: usize, dtype: DType) -> Result<usize, CudaError> {
    let n = rows
        .checked_mul(cols)
        .and_then(|n| n.checked_mul(2))
        .ok_or_else(|| {
            CudaError::invalid(format!(
                "graft-cuda: glu packed of {rows} x 2 * {cols} elements is too large"
            ))
        })?;
    check_len(n, dtype)?;
    Ok(n)
}

/// `y[r, j] = silu(gate_up[r, j]) * gate_up[r, cols + j]` on `a.stream`; nothing is launched
/// without elements.
pub fn glu_packed_forward(a: &GluPackedForward) -> Result<(), CudaError> {
    if packed_len(a.rows, a.cols, a.dtype)? == 0 {
        return Ok(());
    }
    for (name, p) in [("gate_up", a.gate_up), ("y", a.y)] {
        check_ptr(name, p, a.dtype)?;
    }
    let params = GluPackedParams {
        gate_up: a.gate_up,
        dy: 0,
        out: a.y,
        rows: a.rows as i64,
        cols: a.cols as i64,
        vec: 0,
    };
    run_packed(
        "fwd",
        a.device,
        a.stream,
        a.dtype,
        params,
        &[a.gate_up, a.y],
    )
}

/// `d_gate_up[r, j] = dy * up * silu'(gate)`, `d_gate_up[r, cols + j] = dy * silu(gate)` on
/// `a.stream` (`gate`, `up` and `dy` of row `r`, column `j`); nothing is launched without
/// elements. Each element is read before it is written, so `d_gate_up` may be `gate_up`.
pub fn glu_packed_backward(a: &GluPackedBackward) -> Result<(), CudaError> {
    if packed_len(a.rows, a.cols, a.dtype)? == 0 {
        return Ok(());
    }
    for (name, p) in [
        ("gate_up", a.gate_up),
        ("dy", a.dy),
        ("d_gate_up", a.d_gate_up),
    ] {
        check_ptr(name, p, a.dtype)?;
    }
    let params = GluPackedParams {
        gate_up: a.gate_up,
        dy: a.dy,
        out: a.d_gate_up,
        rows: a.rows as i64,
        cols: a.cols as i64,
        vec: 0,
    };
    run_packed(
        "bwd",
        a.device,
        a.stream,
        a.dtype,
        params,
        &[a.gate_up, a.dy, a.d_gate_up],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_match_the_cuda_struct() {
        assert_eq!(std::mem::size_of::<GluParams>(), 7 * 8);
        assert_eq!(std::mem::size_of::<GluPackedParams>(), 6 * 8);
    }

    #[test]
    fn names_cover_every_activation_dtype_and_direction() {
        let names = kernel_names();
        assert_eq!(names.len(), 3 * 4 * 2 + 4 * 2);
        assert!(names.contains(&"graft_glu_bwd_gelu_tanh_bf16".to_string()));
        assert!(names.contains(&"graft_glu_packed_fwd_silu_f16".to_string()));
    }

    #[test]
    fn packed_calls_without_elements_launch_nothing_and_huge_ones_are_refused() {
        let a = GluPackedForward {
            device: 0,
            stream: 0,
            dtype: DType::BF16,
            gate_up: 0,
            y: 0,
            rows: 0,
            cols: 768,
        };
        assert!(glu_packed_forward(&a).is_ok());
        assert!(glu_packed_forward(&GluPackedForward {
            rows: 5,
            cols: 0,
            ..a
        })
        .is_ok());
        let huge = GluPackedForward {
            rows: usize::MAX / 2,
            cols: 3,
            ..a
        };
        assert!(glu_packed_forward(&huge).is_err());
    }

    #[test]
    fn packs_need_aligned_pointers_and_whole_packs() {
        assert!(vectorizable(&[256, 512], 16, DType::BF16));
        assert!(!vectorizable(&[256, 514], 16, DType::BF16));
        assert!(!vectorizable(&[256, 512], 12, DType::BF16));
        assert!(vectorizable(&[256, 512], 12, DType::F32));
    }
}

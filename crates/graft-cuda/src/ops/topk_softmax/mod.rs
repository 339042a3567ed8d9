//! Mixture-of-experts routing (topk_softmax.cu): softmax over each row of router logits, the
//! `k` largest probabilities and their experts, optionally renormalized, and the logits'
//! gradient; validation, the choice of kernel, the launch.
//!
//! One warp per row. The forward holds a row in registers (`fwd_v{V}`: V experts a lane, the
//! smallest V of 1, 2, 4, 8, 16 that covers the row, so up to 512 experts) or, for wider rows,
//! reads it again from L1/L2 for each of its passes and each of the `k` rounds (`fwd_loop`).
//! The backward reads the row from memory in every case (`bwd`).

use crate::runtime::error::CudaError;
use crate::runtime::kernels::Kernel;
use crate::runtime::launch::{grid_covering, launch_named, NamedLaunch};
use crate::DType;

/// Arguments of [`topk_softmax_forward`]: contiguous arrays on `device`.
#[derive(Clone, Copy, Debug)]
pub struct TopkSoftmaxForward {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Element type of the logits (the weights are in `dtype.acc()`).
    pub dtype: DType,
    /// Input: `rows x experts` logits.
    pub logits: u64,
    /// Output: `rows x k` routing weights in `dtype.acc()`, largest first.
    pub weights: u64,
    /// Output: `rows x k` int64 experts of the weights.
    pub indices: u64,
    /// Rows (tokens).
    pub rows: usize,
    /// Experts per row.
    pub experts: usize,
    /// Experts selected per row, `1..=experts`.
    pub k: usize,
    /// Divide each row's weights by their sum.
    pub renormalize: bool,
}

/// Arguments of [`topk_softmax_backward`]: contiguous arrays on `device`.
#[derive(Clone, Copy, Debug)]
pub struct TopkSoftmaxBackward {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Element type of the logits and their gradient.
    pub dtype: DType,
    /// Input: `rows x k` gradient of the weights, in `dtype.acc()`.
    pub grad_weights: u64,
    /// Input: the forward's `rows x experts` logits (read only without `renormalize`).
    pub logits: u64,
    /// Input: the forward's `rows x k` weights, in `dtype.acc()`.
    pub weights: u64,
    /// Input: the forward's `rows x k` int64 experts (distinct within a row; entries outside
    /// `0..experts` are skipped).
    pub indices: u64,
    /// Output: `rows x experts` gradient of the logits.
    pub grad_logits: u64,
    /// Rows (tokens).
    pub rows: usize,
    /// Experts per row.
    pub experts: usize,
    /// Experts selected per row, `1..=experts`.
    pub k: usize,
    /// Whether the forward renormalized the weights.
    pub renormalize: bool,
}

/// `graft_topk::TopkParams` of topk_softmax.cu (every field 8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct TopkParams {
    logits: u64,
    weights: u64,
    indices: u64,
    grad_weights: u64,
    grad_logits: u64,
    rows: i64,
    experts: i64,
    k: i64,
    renormalize: i64,
}

/// Threads per block: 8 warps, one row each (topk_softmax.cu's `kWarpsPerBlock`).
const BLOCK: u32 = 256;
const ROWS_PER_BLOCK: u64 = BLOCK as u64 / 32;
/// The register kernels' experts per lane.
const REGISTER_V: [usize; 5] = [1, 2, 4, 8, 16];

fn dtype_tag(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
    }
}

const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// topk_softmax's kernel table: its kernels need no attribute set at load time.
pub(crate) fn kernel_table() -> Vec<Kernel> {
    kernel_names().into_iter().map(Kernel::plain).collect()
}

/// Entry points of topk_softmax.cu.
fn kernel_names() -> Vec<String> {
    let mut out = Vec::new();
    for dtype in DTYPES {
        let dt = dtype_tag(dtype);
        for v in REGISTER_V {
            out.push(format!("graft_topk_softmax_fwd_v{v}_{dt}"));
        }
        out.push(format!("graft_topk_softmax_fwd_loop_{dt}"));
        out.push(format!("graft_topk_softmax_bwd_{dt}"));
    }
    out
}

/// The forward kernel's variant for rows of `experts`: `v{V}` for the smallest V with
/// `32 V >= experts`, else `loop`.
fn forward_variant(experts: usize) -> String {
    REGISTER_V
        .iter()
        .find(|&&v| 32 * v >= experts)
        .map_or_else(|| "loop".to_string(), |v| format!("v{v}"))
}

fn invalid(msg: String) -> CudaError {
    CudaError::invalid(format!("graft-cuda: topk_softmax: {msg}"))
}

fn check_ptr(name: &str, p: u64, align: usize) -> Result<(), CudaError> {
    if p == 0 || !p.is_multiple_of(align as u64) {
        return Err(invalid(format!(
            "{name} (0x{p:x}) is null or not aligned to its element size"
        )));
    }
    Ok(())
}

/// Checks the sizes (`experts` within the kernels' `int`, every array's bytes within `i64`)
/// and returns the parameter block with no pointers set.
fn shape_params(
    rows: usize,
    experts: usize,
    k: usize,
    renormalize: bool,
    dtype: DType,
) -> Result<TopkParams, CudaError> {
    if k == 0 || k > experts {
        return Err(invalid(format!(
            "k = {k} is not within 1..={experts} (the experts)"
        )));
    }
    if experts > i32::MAX as usize {
        return Err(invalid(format!("{experts} experts are too many")));
    }
    let elem = dtype.size().max(8) as u64;
    let fits = |cols: usize| {
        (rows as u64)
            .checked_mul(cols as u64)
            .and_then(|n| n.checked_mul(elem))
            .is_some_and(|b| b <= i64::MAX as u64)
    };
    if !fits(experts) {
        return Err(invalid(format!("{rows} x {experts} logits are too large")));
    }
    Ok(TopkParams {
        logits: 0,
        weights: 0,
        indices: 0,
        grad_weights: 0,
        grad_logits: 0,
        rows: rows as i64,
        experts: experts as i64,
        k: k as i64,
        renormalize: i64::from(renormalize),
    })
}

fn run(
    device: i32,
    stream: usize,
    name: &str,
    rows: usize,
    params: &mut TopkParams,
) -> Result<(), CudaError> {
    let launch = NamedLaunch {
        device,
        stream,
        name,
        grid: grid_covering(rows as u64, ROWS_PER_BLOCK as u32),
        block: BLOCK,
        smem: 0,
    };
    launch_named(&launch, params)
}

/// The routing weights and experts of `a.logits` on `a.stream`; nothing is launched for
/// `rows == 0`.
pub fn topk_softmax_forward(a: &TopkSoftmaxForward) -> Result<(), CudaError> {
    let mut params = shape_params(a.rows, a.experts, a.k, a.renormalize, a.dtype)?;
    if a.rows == 0 {
        return Ok(());
    }
    check_ptr("logits", a.logits, a.dtype.size())?;
    check_ptr("weights", a.weights, a.dtype.acc().size())?;
    check_ptr("indices", a.indices, 8)?;
    params.logits = a.logits;
    params.weights = a.weights;
    params.indices = a.indices;
    let name = format!(
        "graft_topk_softmax_fwd_{}_{}",
        forward_variant(a.experts),
        dtype_tag(a.dtype)
    );
    run(a.device, a.stream, &name, a.rows, &mut params)
}

/// The gradient of the logits from that of the routing weights on `a.stream`; nothing is
/// launched for `rows == 0`. Every element of `a.grad_logits` is written.
pub fn topk_softmax_backward(a: &TopkSoftmaxBackward) -> Result<(), CudaError> {
    let mut params = shape_params(a.rows, a.experts, a.k, a.renormalize, a.dtype)?;
    if a.rows == 0 {
        return Ok(());
    }
    let acc = a.dtype.acc().size();
    check_ptr("grad_weights", a.grad_weights, acc)?;
    check_ptr("logits", a.logits, a.dtype.size())?;
    check_ptr("weights", a.weights, acc)?;
    check_ptr("indices", a.indices, 8)?;
    check_ptr("grad_logits", a.grad_logits, a.dtype.size())?;
    params.logits = a.logits;
    params.weights = a.weights;
    params.indices = a.indices;
    params.grad_weights = a.grad_weights;
    params.grad_logits = a.grad_logits;
    let name = format!("graft_topk_softmax_bwd_{}", dtype_tag(a.dtype));
    run(a.device, a.stream, &name, a.rows, &mut params)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_match_the_cuda_struct() {
        assert_eq!(std::mem::size_of::<TopkParams>(), 9 * 8);
    }

    #[test]
    fn names_cover_every_dtype_and_variant() {
        let names = kernel_names();
        assert_eq!(names.len(), 4 * 7);
        assert!(names.contains(&"graft_topk_softmax_fwd_v16_bf16".to_string()));
        assert!(names.contains(&"graft_topk_softmax_fwd_loop_f64".to_string()));
        assert!(names.contains(&"graft_topk_softmax_bwd_f16".to_string()));
    }

    #[test]
    fn rows_up_to_512_experts_stay_in_registers() {
        let variant = |e| forward_variant(e);
        assert_eq!(variant(1), "v1");
        assert_eq!(variant(32), "v1");
        assert_eq!(variant(33), "v2");
        assert_eq!(variant(64), "v2");
        assert_eq!(variant(128), "v4");
        assert_eq!(variant(160), "v8");
        assert_eq!(variant(512), "v16");
        assert_eq!(variant(513), "loop");
        for name in REGISTER_V
            .iter()
            .map(|v| format!("v{v}"))
            .chain(["loop".to_string()])
        {
            assert!(kernel_names()
                .iter()
                .any(|n| *n == format!("graft_topk_softmax_fwd_{name}_f32")));
        }
    }

    #[test]
    fn k_must_be_within_the_experts() {
        for (k, experts) in [(0, 4), (5, 4)] {
            let e = shape_params(3, experts, k, false, DType::F32).unwrap_err();
            assert!(e.message().contains("is not within"), "{e}");
        }
        assert!(shape_params(0, 4, 4, true, DType::BF16).is_ok());
        assert!(shape_params(usize::MAX / 2, 4, 1, true, DType::BF16).is_err());
    }
}

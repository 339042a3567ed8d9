//! Mixture-of-experts routing with sigmoid scores and group-limited top-k (topk_sigmoid.cu;
//! DeepSeek-V3's and GLM-4-MoE's routers): per row of router logits, the sigmoid scores, the
//! `k` best experts by score plus bias among the `topk_groups` best of `groups` groups, their
//! scores as weights (optionally renormalized, then scaled), and the logits' gradient;
//! validation, the choice of kernel, the launch. The semantics are graft-kernels'
//! `ops::topk_sigmoid`.
//!
//! One warp per row. The forward holds a row's choice values in registers (`fwd_v{V}`: V
//! experts a lane, the smallest V of 1, 2, 4, 8, 16 that covers the row, so up to 512 experts)
//! or, for wider rows, recomputes them from the row for each of its passes and each of the `k`
//! rounds (`fwd_loop`). With `groups > 1` each warp uses a slice of dynamic shared memory
//! ([`smem_per_warp`]); the block then has as many warps (at most 8) as 48 KB hold. The
//! backward reads the row from memory (`bwd`).

use crate::runtime::error::CudaError;
use crate::runtime::kernels::Kernel;
use crate::runtime::launch::{grid_covering, launch_named, NamedLaunch};
use crate::DType;

/// Arguments of [`topk_sigmoid_forward`]: contiguous arrays on `device`.
#[derive(Clone, Copy, Debug)]
pub struct TopkSigmoidForward {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Element type of the logits (the bias and the weights are in `dtype.acc()`).
    pub dtype: DType,
    /// Input: `rows x experts` logits.
    pub logits: u64,
    /// Input: `experts` values in `dtype.acc()` added to the scores to choose the experts (not
    /// to the weights); 0: none.
    pub bias: u64,
    /// Output: `rows x k` routing weights in `dtype.acc()`, in the order of the choice (largest
    /// score plus bias first).
    pub weights: u64,
    /// Output: `rows x k` int64 experts of the weights.
    pub indices: u64,
    /// Rows (tokens).
    pub rows: usize,
    /// Experts per row.
    pub experts: usize,
    /// Experts selected per row, `1..=topk_groups * experts / groups`.
    pub k: usize,
    /// Groups of `experts / groups` adjacent experts: divides `experts`, into groups of at
    /// least 2 (1: no grouping).
    pub groups: usize,
    /// Groups kept per row (those whose two best experts score most), `1..=groups`.
    pub topk_groups: usize,
    /// Divide each row's weights by their sum (plus 1e-20).
    pub renormalize: bool,
    /// Factor of every weight (after the renormalization).
    pub scale: f64,
}

/// Arguments of [`topk_sigmoid_backward`]: contiguous arrays on `device`.
#[derive(Clone, Copy, Debug)]
pub struct TopkSigmoidBackward {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Element type of the logits and their gradient.
    pub dtype: DType,
    /// Input: `rows x k` gradient of the weights, in `dtype.acc()`.
    pub grad_weights: u64,
    /// Input: the forward's `rows x experts` logits.
    pub logits: u64,
    /// Input: the forward's `rows x k` int64 experts (entries outside `0..experts` are
    /// skipped; repeated ones add up).
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
    /// The forward's factor of the weights.
    pub scale: f64,
}

/// `graft_topk_sigmoid::TopkSigmoidParams` of topk_sigmoid.cu (every field 8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct TopkSigmoidParams {
    logits: u64,
    bias: u64,
    weights: u64,
    indices: u64,
    grad_weights: u64,
    grad_logits: u64,
    rows: i64,
    experts: i64,
    k: i64,
    groups: i64,
    topk_groups: i64,
    renormalize: i64,
    scale: f64,
}

/// Warps (rows) per block at most: 256 threads (the kernels' launch bounds).
const MAX_WARPS: usize = 8;
/// Dynamic shared memory a block may have without opting in.
const SMEM_LIMIT: usize = 48 * 1024;
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

/// topk_sigmoid's kernel table: its kernels need no attribute set at load time.
pub(crate) fn kernel_table() -> Vec<Kernel> {
    kernel_names().into_iter().map(Kernel::plain).collect()
}

/// Entry points of topk_sigmoid.cu.
fn kernel_names() -> Vec<String> {
    let mut out = Vec::new();
    for dtype in DTYPES {
        let dt = dtype_tag(dtype);
        for v in REGISTER_V {
            out.push(format!("graft_topk_sigmoid_fwd_v{v}_{dt}"));
        }
        out.push(format!("graft_topk_sigmoid_fwd_loop_{dt}"));
        out.push(format!("graft_topk_sigmoid_bwd_{dt}"));
    }
    out
}

/// The forward kernel's V for rows of `experts`: the smallest with `32 V >= experts`, or
/// `None` (the loop kernel).
fn register_v(experts: usize) -> Option<usize> {
    REGISTER_V.iter().copied().find(|&v| 32 * v >= experts)
}

/// The forward kernel's variant for rows of `experts`: `v{V}` or `loop`.
fn forward_variant(experts: usize) -> String {
    register_v(experts).map_or_else(|| "loop".to_string(), |v| format!("v{v}"))
}

/// Bytes of dynamic shared memory one warp of the forward uses (topk_sigmoid.cu's
/// `smem_per_warp`): none with one group; else the row's choice values (register kernels
/// only), the groups' scores (all in `acc`) and a byte a group, rounded up to 8.
fn smem_per_warp(register: bool, experts: usize, groups: usize, acc: DType) -> usize {
    if groups <= 1 {
        return 0;
    }
    let values = if register { experts } else { 0 } + groups;
    values * acc.size() + groups.div_ceil(8) * 8
}

/// How the forward is launched: its kernel, warps (rows) per block and shared memory.
#[derive(Debug, PartialEq, Eq)]
struct ForwardPlan {
    name: String,
    warps: usize,
    smem: usize,
}

fn forward_plan(dtype: DType, experts: usize, groups: usize) -> Result<ForwardPlan, CudaError> {
    let register = register_v(experts).is_some();
    let per_warp = smem_per_warp(register, experts, groups, dtype.acc());
    if per_warp > SMEM_LIMIT {
        return Err(invalid(format!(
            "{groups} groups need {per_warp} bytes of shared memory a row, more than the \
             {SMEM_LIMIT} a block has"
        )));
    }
    let warps = SMEM_LIMIT
        .checked_div(per_warp)
        .map_or(MAX_WARPS, |w| w.min(MAX_WARPS));
    Ok(ForwardPlan {
        name: format!(
            "graft_topk_sigmoid_fwd_{}_{}",
            forward_variant(experts),
            dtype_tag(dtype)
        ),
        warps,
        smem: warps * per_warp,
    })
}

fn invalid(msg: String) -> CudaError {
    CudaError::invalid(format!("graft-cuda: topk_sigmoid: {msg}"))
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
/// and `1 <= k <= max_k`, and returns the parameter block with no pointers or grouping set.
fn shape_params(
    rows: usize,
    experts: usize,
    k: usize,
    max_k: usize,
    renormalize: bool,
    scale: f64,
    dtype: DType,
) -> Result<TopkSigmoidParams, CudaError> {
    if experts > i32::MAX as usize {
        return Err(invalid(format!("{experts} experts are too many")));
    }
    if k == 0 || k > max_k {
        return Err(invalid(format!("k = {k} is not within 1..={max_k}")));
    }
    let elem = dtype.size().max(8) as u64;
    let fits = (rows as u64)
        .checked_mul(experts as u64)
        .and_then(|n| n.checked_mul(elem))
        .is_some_and(|b| b <= i64::MAX as u64);
    if !fits {
        return Err(invalid(format!("{rows} x {experts} logits are too large")));
    }
    Ok(TopkSigmoidParams {
        logits: 0,
        bias: 0,
        weights: 0,
        indices: 0,
        grad_weights: 0,
        grad_logits: 0,
        rows: rows as i64,
        experts: experts as i64,
        k: k as i64,
        groups: 1,
        topk_groups: 1,
        renormalize: i64::from(renormalize),
        scale,
    })
}

/// Checks the grouping of the forward: `groups` divides `experts` into groups of at least 2,
/// `1 <= topk_groups <= groups`; returns the most experts that can be chosen.
fn check_grouping(experts: usize, groups: usize, topk_groups: usize) -> Result<usize, CudaError> {
    if groups == 0 || !experts.is_multiple_of(groups) || experts / groups < 2 {
        return Err(invalid(format!(
            "groups = {groups} does not split the {experts} experts into groups of at least 2"
        )));
    }
    if topk_groups == 0 || topk_groups > groups {
        return Err(invalid(format!(
            "topk_groups = {topk_groups} is not within 1..={groups} (the groups)"
        )));
    }
    Ok(topk_groups * (experts / groups))
}

fn run(
    device: i32,
    stream: usize,
    name: &str,
    rows: usize,
    warps: usize,
    smem: usize,
    params: &mut TopkSigmoidParams,
) -> Result<(), CudaError> {
    let launch = NamedLaunch {
        device,
        stream,
        name,
        grid: grid_covering(rows as u64, warps as u32),
        block: 32 * warps as u32,
        smem: smem as u32,
    };
    launch_named(&launch, params)
}

/// The routing weights and experts of `a.logits` on `a.stream`; nothing is launched for
/// `rows == 0`.
pub fn topk_sigmoid_forward(a: &TopkSigmoidForward) -> Result<(), CudaError> {
    let max_k = check_grouping(a.experts, a.groups, a.topk_groups)?;
    let mut params = shape_params(
        a.rows,
        a.experts,
        a.k,
        max_k,
        a.renormalize,
        a.scale,
        a.dtype,
    )?;
    let plan = forward_plan(a.dtype, a.experts, a.groups)?;
    if a.rows == 0 {
        return Ok(());
    }
    let acc = a.dtype.acc().size();
    check_ptr("logits", a.logits, a.dtype.size())?;
    if a.bias != 0 {
        check_ptr("bias", a.bias, acc)?;
    }
    check_ptr("weights", a.weights, acc)?;
    check_ptr("indices", a.indices, 8)?;
    params.logits = a.logits;
    params.bias = a.bias;
    params.weights = a.weights;
    params.indices = a.indices;
    params.groups = a.groups as i64;
    params.topk_groups = a.topk_groups as i64;
    run(
        a.device,
        a.stream,
        &plan.name,
        a.rows,
        plan.warps,
        plan.smem,
        &mut params,
    )
}

/// The gradient of the logits from that of the routing weights on `a.stream`; nothing is
/// launched for `rows == 0`. Every element of `a.grad_logits` is written.
pub fn topk_sigmoid_backward(a: &TopkSigmoidBackward) -> Result<(), CudaError> {
    let mut params = shape_params(
        a.rows,
        a.experts,
        a.k,
        a.experts,
        a.renormalize,
        a.scale,
        a.dtype,
    )?;
    if a.rows == 0 {
        return Ok(());
    }
    check_ptr("grad_weights", a.grad_weights, a.dtype.acc().size())?;
    check_ptr("logits", a.logits, a.dtype.size())?;
    check_ptr("indices", a.indices, 8)?;
    check_ptr("grad_logits", a.grad_logits, a.dtype.size())?;
    params.logits = a.logits;
    params.indices = a.indices;
    params.grad_weights = a.grad_weights;
    params.grad_logits = a.grad_logits;
    let name = format!("graft_topk_sigmoid_bwd_{}", dtype_tag(a.dtype));
    run(a.device, a.stream, &name, a.rows, MAX_WARPS, 0, &mut params)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_match_the_cuda_struct() {
        assert_eq!(std::mem::size_of::<TopkSigmoidParams>(), 13 * 8);
    }

    #[test]
    fn names_cover_every_dtype_and_variant() {
        let names = kernel_names();
        assert_eq!(names.len(), 4 * 7);
        assert!(names.contains(&"graft_topk_sigmoid_fwd_v16_bf16".to_string()));
        assert!(names.contains(&"graft_topk_sigmoid_fwd_loop_f64".to_string()));
        assert!(names.contains(&"graft_topk_sigmoid_bwd_f16".to_string()));
        for dtype in DTYPES {
            for experts in [8, 64, 160, 256, 384, 512, 513, 1024] {
                let plan = forward_plan(dtype, experts, 8).unwrap();
                assert!(names.contains(&plan.name), "{}", plan.name);
            }
        }
    }

    #[test]
    fn rows_up_to_512_experts_stay_in_registers() {
        let variant = |e| forward_variant(e);
        assert_eq!(variant(8), "v1");
        assert_eq!(variant(32), "v1");
        assert_eq!(variant(33), "v2");
        assert_eq!(variant(64), "v2");
        assert_eq!(variant(160), "v8");
        assert_eq!(variant(256), "v8");
        assert_eq!(variant(384), "v16");
        assert_eq!(variant(512), "v16");
        assert_eq!(variant(513), "loop");
        assert_eq!(variant(1024), "loop");
    }

    #[test]
    fn shared_memory_holds_the_groups_of_every_warp() {
        // One group: no shared memory, 8 rows a block.
        let plan = forward_plan(DType::BF16, 256, 1).unwrap();
        assert_eq!((plan.warps, plan.smem), (8, 0));
        // DeepSeek-V3: 256 c, 8 scores, 8 flags a warp.
        let plan = forward_plan(DType::BF16, 256, 8).unwrap();
        assert_eq!(plan.name, "graft_topk_sigmoid_fwd_v8_bf16");
        assert_eq!((plan.warps, plan.smem), (8, 8 * ((256 + 8) * 4 + 8)));
        // 512 float64 c and 256 scores a warp: 7 warps fit in 48 KB.
        let plan = forward_plan(DType::F64, 512, 256).unwrap();
        let per_warp = (512 + 256) * 8 + 256;
        assert_eq!((plan.warps, plan.smem), (7, 7 * per_warp));
        assert!(plan.smem <= SMEM_LIMIT);
        // The loop kernel keeps the scores and flags only.
        let plan = forward_plan(DType::F32, 1024, 4).unwrap();
        assert_eq!((plan.warps, plan.smem), (8, 8 * (4 * 4 + 8)));
        // One warp's groups beyond 48 KB are refused.
        let e = forward_plan(DType::F64, 2 * 8192, 8192).unwrap_err();
        assert!(e.message().contains("shared memory"), "{e}");
        let plan = forward_plan(DType::F32, 2 * 8192, 8192).unwrap();
        assert_eq!(plan.warps, 1);
    }

    #[test]
    fn grouping_and_k_must_be_consistent() {
        assert_eq!(check_grouping(256, 8, 4).unwrap(), 128);
        assert_eq!(check_grouping(160, 1, 1).unwrap(), 160);
        for (experts, groups) in [(256, 0), (256, 3), (8, 8), (8, 5)] {
            let e = check_grouping(experts, groups, 1).unwrap_err();
            assert!(e.message().contains("does not split"), "{e}");
        }
        for topk_groups in [0, 9] {
            let e = check_grouping(256, 8, topk_groups).unwrap_err();
            assert!(e.message().contains("topk_groups"), "{e}");
        }
        for k in [0, 129] {
            let e = shape_params(3, 256, k, 128, false, 1.0, DType::F32).unwrap_err();
            assert!(e.message().contains("is not within"), "{e}");
        }
        assert!(shape_params(0, 256, 128, 128, true, 2.5, DType::BF16).is_ok());
        assert!(shape_params(usize::MAX / 2, 4, 1, 4, true, 1.0, DType::BF16).is_err());
        assert!(shape_params(1, 1 << 31, 1, 4, true, 1.0, DType::BF16).is_err());
    }

    #[test]
    fn invalid_arguments_fail_before_any_launch() {
        let f = TopkSigmoidForward {
            device: 0,
            stream: 0,
            dtype: DType::F32,
            logits: 0x1000,
            bias: 0,
            weights: 0x2000,
            indices: 0x3000,
            rows: 4,
            experts: 256,
            k: 8,
            groups: 8,
            topk_groups: 4,
            renormalize: true,
            scale: 2.5,
        };
        let bad =
            |g: TopkSigmoidForward| topk_sigmoid_forward(&g).unwrap_err().message().to_string();
        assert!(bad(TopkSigmoidForward { k: 129, ..f }).contains("k = 129"));
        assert!(bad(TopkSigmoidForward { groups: 3, ..f }).contains("groups = 3"));
        assert!(bad(TopkSigmoidForward {
            topk_groups: 9,
            ..f
        })
        .contains("topk_groups = 9"));
        assert!(bad(TopkSigmoidForward { bias: 0x1002, ..f }).contains("bias"));
        assert!(bad(TopkSigmoidForward { logits: 0, ..f }).contains("logits"));
        // No rows: nothing to check beyond the shape, nothing launched.
        assert!(topk_sigmoid_forward(&TopkSigmoidForward {
            rows: 0,
            logits: 0,
            ..f
        })
        .is_ok());
        let b = TopkSigmoidBackward {
            device: 0,
            stream: 0,
            dtype: DType::BF16,
            grad_weights: 0x1000,
            logits: 0x2000,
            indices: 0x3000,
            grad_logits: 0x4001,
            rows: 4,
            experts: 64,
            k: 8,
            renormalize: false,
            scale: 1.0,
        };
        let e = topk_sigmoid_backward(&b).unwrap_err();
        assert!(e.message().contains("grad_logits"), "{e}");
        let e = topk_sigmoid_backward(&TopkSigmoidBackward { k: 65, ..b }).unwrap_err();
        assert!(e.message().contains("k = 65"), "{e}");
        assert!(topk_sigmoid_backward(&TopkSigmoidBackward { rows: 0, ..b }).is_ok());
    }
}

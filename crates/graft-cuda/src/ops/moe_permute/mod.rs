//! Mixture-of-experts token permutation (moe_permute.cu): the pairs sorted by expert (two
//! launches, a count and a placement), the pairs' hidden rows gathered into expert order, the
//! experts' rows put back and summed per token with the routing weights, and that sum's
//! backward (the rows' gradient and the weights' in one launch). One warp per row.

use crate::runtime::error::CudaError;
use crate::runtime::kernels::Kernel;
use crate::runtime::launch::{grid_covering, launch_named, NamedLaunch};
use crate::DType;

/// The routing weights' element type, relative to the rows' `dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MoeWeights {
    /// No weights (each weight 1).
    None,
    /// Of the rows' dtype.
    Same,
    /// Of the rows' accumulation dtype (`dtype.acc()`: float32, float64 for F64).
    Acc,
}

impl MoeWeights {
    const ALL: [MoeWeights; 3] = [MoeWeights::None, MoeWeights::Same, MoeWeights::Acc];

    fn tag(self) -> &'static str {
        match self {
            MoeWeights::None => "none",
            MoeWeights::Same => "same",
            MoeWeights::Acc => "acc",
        }
    }

    /// The weights' dtype for rows of `dtype` (`None` without weights).
    pub fn dtype(self, dtype: DType) -> Option<DType> {
        match self {
            MoeWeights::None => None,
            MoeWeights::Same => Some(dtype),
            MoeWeights::Acc => Some(dtype.acc()),
        }
    }
}

/// The one-element tensor holding the number of real slots, read by the kernels.
#[derive(Clone, Copy, Debug)]
pub struct MoeValid {
    /// Device pointer to it.
    pub ptr: u64,
    /// Whether it is int64 (else int32).
    pub int64: bool,
}

/// Arguments of [`moe_permute`]: `out[s] = hidden[perm[s] / top_k]` for `s < valid`, zero
/// beyond. Every array contiguous on `device`.
#[derive(Clone, Copy, Debug)]
pub struct MoePermute {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Element type of `hidden` and `out`.
    pub dtype: DType,
    /// `(tokens, hidden)`.
    pub hidden: u64,
    /// `(pairs,)` int64.
    pub perm: u64,
    /// Number of real slots.
    pub valid: MoeValid,
    /// Output `(pairs, hidden)`.
    pub out: u64,
    /// `tokens * top_k`.
    pub pairs: usize,
    /// Elements per row.
    pub width: usize,
    /// Experts per token (at least 1).
    pub top_k: usize,
}

/// Arguments of [`moe_unpermute`]: `out[t] = sum_k w[t, k] * y[inv_perm[t * top_k + k]]` over
/// the slots below `valid`, in float32 (float64 for F64), rounded once.
#[derive(Clone, Copy, Debug)]
pub struct MoeUnpermute {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Element type of `y` and `out`.
    pub dtype: DType,
    /// `(pairs, hidden)`.
    pub y: u64,
    /// `(pairs,)` int64.
    pub inv_perm: u64,
    /// Number of real slots.
    pub valid: MoeValid,
    /// The weights' type, and `(pairs,)` weights (0 for [`MoeWeights::None`]).
    pub weights_kind: MoeWeights,
    /// Device pointer to the weights.
    pub weights: u64,
    /// Output `(pairs / top_k, hidden)`.
    pub out: u64,
    /// `tokens * top_k`.
    pub pairs: usize,
    /// Elements per row.
    pub width: usize,
    /// Experts per token (at least 1, dividing `pairs`).
    pub top_k: usize,
}

/// Arguments of [`moe_unpermute_backward`]: `dy[s] = w[perm[s]] * grad[perm[s] / top_k]` for
/// `s < valid` (zero beyond) and, with weights, `dweights[perm[s]] = dot(y[s], grad[perm[s] /
/// top_k])` (zero for `s >= valid`), in the weights' type.
#[derive(Clone, Copy, Debug)]
pub struct MoeUnpermuteBackward {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Element type of `grad`, `y` and `dy`.
    pub dtype: DType,
    /// `(tokens, hidden)`.
    pub grad: u64,
    /// `(pairs, hidden)`.
    pub y: u64,
    /// `(pairs,)` int64.
    pub perm: u64,
    /// Number of real slots.
    pub valid: MoeValid,
    /// The weights' type, and `(pairs,)` weights (0 for [`MoeWeights::None`]).
    pub weights_kind: MoeWeights,
    /// Device pointer to the weights.
    pub weights: u64,
    /// Output `(pairs, hidden)`.
    pub dy: u64,
    /// Output `(pairs,)` of the weights' type (0 for [`MoeWeights::None`]).
    pub dweights: u64,
    /// `tokens * top_k`.
    pub pairs: usize,
    /// Elements per row.
    pub width: usize,
    /// Experts per token (at least 1, dividing `pairs`).
    pub top_k: usize,
}

/// Arguments of [`moe_sort`]: the `pairs` expert ids grouped by expert with a stable counting
/// sort (`perm[s]` the pair in slot `s`, `inv_perm` its inverse, `offsets[e]` the end of expert
/// `e`'s slots; ids outside `0..experts` sort last, counted in no expert). Every array
/// contiguous on `device`.
#[derive(Clone, Copy, Debug)]
pub struct MoeSort {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// `(pairs,)` int64 expert ids.
    pub ids: u64,
    /// Output `(pairs,)` int64.
    pub perm: u64,
    /// Output `(pairs,)` int64.
    pub inv_perm: u64,
    /// Output `(experts,)` int32.
    pub offsets: u64,
    /// Workspace of [`moe_sort_workspace`] int32 elements.
    pub counts: u64,
    /// Number of ids (at most `i32::MAX`).
    pub pairs: usize,
    /// Number of experts (`1..=MOE_SORT_MAX_EXPERTS`).
    pub experts: usize,
}

/// The most experts [`moe_sort`] takes: its placement keeps five counters per expert in 48 KB
/// of shared memory.
pub const MOE_SORT_MAX_EXPERTS: usize = 2048;

// The placement's shared memory at the most experts stays within the default 48 KB.
const _: () =
    assert!(4 * ((1 + SORT_BLOCK as usize / 32) * (MOE_SORT_MAX_EXPERTS + 1) + 128) <= 48 * 1024);

/// `graft_moe::SortParams` of moe_permute.cu (every field 8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct SortParams {
    ids: u64,
    perm: u64,
    inv_perm: u64,
    offsets: u64,
    counts: u64,
    pairs: i64,
    experts: i64,
    chunk: i64,
}

/// Threads per block of the sort's kernels (moe_permute.cu's `kSortThreads`).
const SORT_BLOCK: u32 = 128;
/// Pairs per block the sort aims at.
const SORT_CHUNK: usize = 2048;

/// The sort's blocks and pairs per block. Each placement block reads every block's counts, so
/// the blocks are capped at 65536 counters in all (32 blocks of 2048 pairs at 64 experts and
/// 65536 pairs; fewer, longer chunks for many experts).
fn sort_chunks(pairs: usize, experts: usize) -> (usize, usize) {
    let cap = (65536 / (experts + 1)).max(1);
    let chunks = pairs.div_ceil(SORT_CHUNK).clamp(1, cap);
    (chunks, pairs.div_ceil(chunks).max(1))
}

/// The int32 elements of [`moe_sort`]'s workspace: one count per block and key.
pub fn moe_sort_workspace(pairs: usize, experts: usize) -> usize {
    sort_chunks(pairs, experts).0 * (experts + 1)
}

/// Sorts the pairs by expert on `a.stream` (two launches; with no pairs they write the offsets,
/// all 0).
pub fn moe_sort(a: &MoeSort) -> Result<(), CudaError> {
    if a.experts == 0 || a.experts > MOE_SORT_MAX_EXPERTS {
        return Err(invalid(format!(
            "experts ({}) must be in 1..={MOE_SORT_MAX_EXPERTS}",
            a.experts
        )));
    }
    if i32::try_from(a.pairs).is_err() {
        return Err(invalid(format!(
            "{} pairs are too many (the offsets are int32)",
            a.pairs
        )));
    }
    for (name, p, al) in [
        ("ids", a.ids, 8),
        ("perm", a.perm, 8),
        ("inv_perm", a.inv_perm, 8),
        ("offsets", a.offsets, 4),
        ("counts", a.counts, 4),
    ] {
        // Empty tensors may have no storage.
        if a.pairs > 0 || name == "offsets" || name == "counts" {
            check_ptr(name, p, al)?;
        }
    }
    let (chunks, chunk) = sort_chunks(a.pairs, a.experts);
    let mut params = SortParams {
        ids: a.ids,
        perm: a.perm,
        inv_perm: a.inv_perm,
        offsets: a.offsets,
        counts: a.counts,
        pairs: a.pairs as i64,
        experts: a.experts as i64,
        chunk: chunk as i64,
    };
    let keys = (a.experts + 1) as u32;
    let warps = SORT_BLOCK / 32;
    for (name, smem) in [
        ("graft_moe_sort_count", 4 * keys),
        (
            "graft_moe_sort_place",
            4 * ((1 + warps) * keys + SORT_BLOCK),
        ),
    ] {
        let launch = NamedLaunch {
            device: a.device,
            stream: a.stream,
            name,
            grid: chunks as u32,
            block: SORT_BLOCK,
            smem,
        };
        launch_named(&launch, &mut params)?;
    }
    Ok(())
}

/// `graft_moe::MoeParams` of moe_permute.cu (every field 8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MoeParams {
    src: u64,
    y: u64,
    index: u64,
    valid: u64,
    weights: u64,
    out: u64,
    dweights: u64,
    rows: i64,
    pairs: i64,
    hidden: i64,
    top_k: i64,
    valid_i64: i64,
    vec: i64,
}

/// Threads per block: 8 warps, one row each at a time.
const BLOCK: u32 = 256;
const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

fn dtype_tag(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
    }
}

/// moe_permute's kernel table: its kernels need no attribute set at load time.
pub(crate) fn kernel_table() -> Vec<Kernel> {
    kernel_names().into_iter().map(Kernel::plain).collect()
}

/// Entry points of moe_permute.cu.
fn kernel_names() -> Vec<String> {
    let mut out = vec![
        "graft_moe_sort_count".to_string(),
        "graft_moe_sort_place".to_string(),
    ];
    for dtype in DTYPES {
        let dt = dtype_tag(dtype);
        out.push(format!("graft_moe_permute_{dt}"));
        for w in MoeWeights::ALL {
            out.push(format!("graft_moe_unpermute_{dt}_{}", w.tag()));
            out.push(format!("graft_moe_unpermute_bwd_{dt}_{}", w.tag()));
        }
    }
    out
}

fn invalid(message: String) -> CudaError {
    CudaError::invalid(format!("graft-cuda: moe_permute: {message}"))
}

fn check_ptr(name: &str, p: u64, align: usize) -> Result<(), CudaError> {
    if p == 0 || !p.is_multiple_of(align as u64) {
        return Err(invalid(format!(
            "{name} (0x{p:x}) is null or not aligned to its element size"
        )));
    }
    Ok(())
}

/// Checks the sizes and returns the `vec` flag: 16-byte packs cover every row exactly.
fn plan(
    dtype: DType,
    pairs: usize,
    width: usize,
    top_k: usize,
    rows: &[u64],
) -> Result<bool, CudaError> {
    if top_k == 0 || !pairs.is_multiple_of(top_k) {
        return Err(invalid(format!(
            "top_k ({top_k}) must be at least 1 and divide the pairs ({pairs})"
        )));
    }
    if (pairs as u64)
        .checked_mul(width as u64)
        .and_then(|n| n.checked_mul(dtype.size() as u64))
        .is_none_or(|b| b > i64::MAX as u64)
    {
        return Err(invalid(format!(
            "{pairs} rows of {width} elements are too large"
        )));
    }
    Ok((width * dtype.size()).is_multiple_of(16) && rows.iter().all(|p| p.is_multiple_of(16)))
}

fn check_valid(valid: MoeValid) -> Result<(), CudaError> {
    check_ptr("valid", valid.ptr, if valid.int64 { 8 } else { 4 })
}

fn run(name: &str, device: i32, stream: usize, mut params: MoeParams) -> Result<(), CudaError> {
    let launch = NamedLaunch {
        device,
        stream,
        name,
        grid: grid_covering((params.rows as u64).saturating_mul(32), BLOCK),
        block: BLOCK,
        smem: 0,
    };
    launch_named(&launch, &mut params)
}

/// Gathers the rows into expert order on `a.stream`; nothing is launched without pairs.
pub fn moe_permute(a: &MoePermute) -> Result<(), CudaError> {
    let vec = plan(a.dtype, a.pairs, a.width, a.top_k, &[a.hidden, a.out])?;
    if a.pairs == 0 || a.width == 0 {
        return Ok(());
    }
    let align = a.dtype.size();
    for (name, p, al) in [
        ("hidden", a.hidden, align),
        ("perm", a.perm, 8),
        ("out", a.out, align),
    ] {
        check_ptr(name, p, al)?;
    }
    check_valid(a.valid)?;
    let params = MoeParams {
        src: a.hidden,
        index: a.perm,
        valid: a.valid.ptr,
        out: a.out,
        rows: a.pairs as i64,
        pairs: a.pairs as i64,
        hidden: a.width as i64,
        top_k: a.top_k as i64,
        valid_i64: i64::from(a.valid.int64),
        vec: i64::from(vec),
        ..MoeParams::default()
    };
    let name = format!("graft_moe_permute_{}", dtype_tag(a.dtype));
    run(&name, a.device, a.stream, params)
}

fn check_weights(kind: MoeWeights, weights: u64, dtype: DType) -> Result<(), CudaError> {
    match kind.dtype(dtype) {
        Some(w) => check_ptr("weights", weights, w.size()),
        None => Ok(()),
    }
}

/// Puts the rows back and sums them per token on `a.stream`; nothing is launched without
/// tokens or columns.
pub fn moe_unpermute(a: &MoeUnpermute) -> Result<(), CudaError> {
    let vec = plan(a.dtype, a.pairs, a.width, a.top_k, &[a.y, a.out])?;
    if a.pairs == 0 || a.width == 0 {
        return Ok(());
    }
    let align = a.dtype.size();
    for (name, p, al) in [
        ("y", a.y, align),
        ("inv_perm", a.inv_perm, 8),
        ("out", a.out, align),
    ] {
        check_ptr(name, p, al)?;
    }
    check_valid(a.valid)?;
    check_weights(a.weights_kind, a.weights, a.dtype)?;
    let params = MoeParams {
        src: a.y,
        index: a.inv_perm,
        valid: a.valid.ptr,
        weights: a.weights,
        out: a.out,
        rows: (a.pairs / a.top_k) as i64,
        pairs: a.pairs as i64,
        hidden: a.width as i64,
        top_k: a.top_k as i64,
        valid_i64: i64::from(a.valid.int64),
        vec: i64::from(vec),
        ..MoeParams::default()
    };
    let name = format!(
        "graft_moe_unpermute_{}_{}",
        dtype_tag(a.dtype),
        a.weights_kind.tag()
    );
    run(&name, a.device, a.stream, params)
}

/// The backward of [`moe_unpermute`] on `a.stream`: `dy` and, with weights, `dweights`, in one
/// launch; nothing is launched without pairs. With zero columns every weight gradient is a dot
/// product of nothing: the launch still runs (and writes zeros) when there are weights.
pub fn moe_unpermute_backward(a: &MoeUnpermuteBackward) -> Result<(), CudaError> {
    let vec = plan(a.dtype, a.pairs, a.width, a.top_k, &[a.grad, a.y, a.dy])?;
    if a.pairs == 0 || (a.width == 0 && a.weights_kind == MoeWeights::None) {
        return Ok(());
    }
    let align = a.dtype.size();
    for (name, p, al) in [
        ("grad", a.grad, align),
        ("y", a.y, align),
        ("perm", a.perm, 8),
        ("dy", a.dy, align),
    ] {
        if a.width > 0 || name == "perm" {
            check_ptr(name, p, al)?;
        }
    }
    check_valid(a.valid)?;
    check_weights(a.weights_kind, a.weights, a.dtype)?;
    check_weights(a.weights_kind, a.dweights, a.dtype)?;
    let params = MoeParams {
        src: a.grad,
        y: a.y,
        index: a.perm,
        valid: a.valid.ptr,
        weights: a.weights,
        out: a.dy,
        dweights: a.dweights,
        rows: a.pairs as i64,
        pairs: a.pairs as i64,
        hidden: a.width as i64,
        top_k: a.top_k as i64,
        valid_i64: i64::from(a.valid.int64),
        vec: i64::from(vec),
    };
    let name = format!(
        "graft_moe_unpermute_bwd_{}_{}",
        dtype_tag(a.dtype),
        a.weights_kind.tag()
    );
    run(&name, a.device, a.stream, params)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_match_the_cuda_struct() {
        assert_eq!(std::mem::size_of::<MoeParams>(), 13 * 8);
    }

    #[test]
    fn names_cover_every_dtype_and_weight_kind() {
        let names = kernel_names();
        assert_eq!(names.len(), 2 + 4 * (1 + 3 * 2));
        assert!(names.contains(&"graft_moe_unpermute_bwd_bf16_acc".to_string()));
        assert!(names.contains(&"graft_moe_permute_f64".to_string()));
    }

    #[test]
    fn sort_params_match_the_cuda_struct() {
        assert_eq!(std::mem::size_of::<SortParams>(), 8 * 8);
    }

    #[test]
    fn sort_chunks_cover_the_pairs_within_the_counter_cap() {
        assert_eq!(sort_chunks(65536, 64), (32, 2048));
        assert_eq!(sort_chunks(0, 8), (1, 1));
        assert_eq!(sort_chunks(5, 8), (1, 5));
        for (pairs, experts) in [(1 << 20, 64), (1 << 20, 2048), (4097, 1), (123_457, 160)] {
            let (chunks, chunk) = sort_chunks(pairs, experts);
            assert!(chunks * chunk >= pairs && (chunks - 1) * chunk < pairs);
            assert!(chunks * (experts + 1) <= 65536 || chunks == 1);
        }
    }

    #[test]
    fn packs_need_aligned_rows() {
        assert!(plan(DType::BF16, 8, 16, 2, &[256, 512]).unwrap());
        assert!(!plan(DType::BF16, 8, 12, 2, &[256, 512]).unwrap());
        assert!(!plan(DType::BF16, 8, 16, 2, &[256, 514]).unwrap());
        assert!(plan(DType::F32, 8, 4, 2, &[256, 512]).unwrap());
        assert!(plan(DType::F32, 7, 4, 2, &[256]).is_err());
        assert!(plan(DType::F32, 8, 4, 0, &[256]).is_err());
    }
}

//! RMSNorm's kernel table: every entry point of rms_norm.cu, its name and its index. RMSNorm's
//! kernels come first in the crate's kernel table (ops/mod.rs), so these indices are theirs
//! there too.
//!
//! The names and the (V, maximum block size) tables below mirror the instantiation macros
//! and `GRAFT_*_MAXT_*` launch bounds at the end of rms_norm.cu.

use crate::runtime::kernels::{Kernel, LoadAttrs};
use crate::DType;

/// How the weight reaches the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WeightKind {
    /// No weight.
    None,
    /// Weight of the input dtype.
    Same,
    /// Weight of the accumulation dtype (only distinct from `Same` for f16/bf16).
    Acc,
}

/// Forward or backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dir {
    Fwd,
    Bwd,
}

/// Which body of a (direction, dtype, weight) family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Body {
    /// Row in registers: V 16-byte units per thread, vector or scalar accesses.
    Rows { v: u32, vec: bool },
    /// Any cols, two passes over the row.
    Loop,
}

/// (V, maximum threads per block) of the rows kernels.
pub(crate) const FWD_VEC: &[(u32, u32)] = &[(1, 512), (2, 512), (4, 512), (8, 512), (16, 256)];
pub(crate) const FWD_SCALAR: &[(u32, u32)] = &[(1, 512), (4, 512)];
pub(crate) const BWD_VEC: &[(u32, u32)] = &[(1, 512), (2, 512), (4, 512), (8, 256)];
pub(crate) const BWD_SCALAR: &[(u32, u32)] = &[(1, 512), (2, 512)];
/// Maximum (and default) block size of the loop kernels.
pub(crate) const LOOP_THREADS: u32 = 512;
/// Block size of the dw finalize kernel (32 columns x 8 slices).
pub(crate) const FINALIZE_THREADS: u32 = 256;

/// The (V, max threads) table of a rows-kernel family.
pub(crate) fn rows_table(dir: Dir, vec: bool) -> &'static [(u32, u32)] {
    match (dir, vec) {
        (Dir::Fwd, true) => FWD_VEC,
        (Dir::Fwd, false) => FWD_SCALAR,
        (Dir::Bwd, true) => BWD_VEC,
        (Dir::Bwd, false) => BWD_SCALAR,
    }
}

/// (dtype, weight kind) families, in table order.
const FAMILIES: [(DType, WeightKind); 10] = [
    (DType::F32, WeightKind::None),
    (DType::F32, WeightKind::Same),
    (DType::F64, WeightKind::None),
    (DType::F64, WeightKind::Same),
    (DType::F16, WeightKind::None),
    (DType::F16, WeightKind::Same),
    (DType::F16, WeightKind::Acc),
    (DType::BF16, WeightKind::None),
    (DType::BF16, WeightKind::Same),
    (DType::BF16, WeightKind::Acc),
];

/// Kernels per family: forward 5 vector + 2 scalar + loop, backward 4 + 2 + loop.
const PER_FAMILY: usize = 15;
/// (accumulation dtype, dw dtype) of the finalize kernels, in table order.
const FINALIZE: [(DType, DType); 4] = [
    (DType::F32, DType::F32),
    (DType::F32, DType::F16),
    (DType::F32, DType::BF16),
    (DType::F64, DType::F64),
];
/// Number of kernels in the table.
pub(crate) const NUM_KERNELS: usize = FAMILIES.len() * PER_FAMILY + FINALIZE.len();

/// `Acc` is the same kernel as `Same` when the accumulation dtype is the input dtype.
pub(crate) fn normalize(dtype: DType, wk: WeightKind) -> WeightKind {
    match (dtype, wk) {
        (DType::F32 | DType::F64, WeightKind::Acc) => WeightKind::Same,
        _ => wk,
    }
}

fn family(dtype: DType, wk: WeightKind) -> usize {
    let wk = normalize(dtype, wk);
    FAMILIES
        .iter()
        .position(|&f| f == (dtype, wk))
        .expect("every (dtype, normalized weight kind) has a family")
}

fn slot(dir: Dir, body: Body) -> Option<usize> {
    let within = match body {
        Body::Rows { v, vec } => {
            let table = rows_table(dir, vec);
            let i = table.iter().position(|&(tv, _)| tv == v)?;
            let vec_len = rows_table(dir, true).len();
            if vec {
                i
            } else {
                vec_len + i
            }
        }
        Body::Loop => rows_table(dir, true).len() + rows_table(dir, false).len(),
    };
    Some(match dir {
        Dir::Fwd => within,
        Dir::Bwd => FWD_VEC.len() + FWD_SCALAR.len() + 1 + within,
    })
}

/// Index of a forward/backward kernel, `None` if that V is not instantiated.
pub(crate) fn index(dir: Dir, dtype: DType, wk: WeightKind, body: Body) -> Option<usize> {
    Some(family(dtype, wk) * PER_FAMILY + slot(dir, body)?)
}

/// Index of the dw finalize kernel for a partial (accumulation) dtype and a dw dtype.
pub(crate) fn finalize_index(acc: DType, out: DType) -> Option<usize> {
    let i = FINALIZE.iter().position(|&f| f == (acc, out))?;
    Some(FAMILIES.len() * PER_FAMILY + i)
}

fn dtype_tag(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F64 => "f64",
    }
}

fn weight_tag(w: WeightKind) -> &'static str {
    match w {
        WeightKind::None => "none",
        WeightKind::Same => "same",
        WeightKind::Acc => "acc",
    }
}

/// The entry-point name of kernel `i` (`i < NUM_KERNELS`), as in rms_norm.cu.
pub(crate) fn name(i: usize) -> String {
    let fams = FAMILIES.len() * PER_FAMILY;
    if i >= fams {
        let (acc, out) = FINALIZE[i - fams];
        return format!(
            "graft_rms_dw_finalize_{}_{}",
            dtype_tag(acc),
            dtype_tag(out)
        );
    }
    let (dtype, wk) = FAMILIES[i / PER_FAMILY];
    let mut s = i % PER_FAMILY;
    let fwd_len = FWD_VEC.len() + FWD_SCALAR.len() + 1;
    let dir = if s < fwd_len {
        Dir::Fwd
    } else {
        s -= fwd_len;
        Dir::Bwd
    };
    let vec_t = rows_table(dir, true);
    let sca_t = rows_table(dir, false);
    let d = if dir == Dir::Fwd { "fwd" } else { "bwd" };
    let base = format!("graft_rms_{d}");
    let (dt, w) = (dtype_tag(dtype), weight_tag(wk));
    if s < vec_t.len() {
        format!("{base}_rows_{dt}_{w}_v{}", vec_t[s].0)
    } else if s < vec_t.len() + sca_t.len() {
        format!("{base}_rows_{dt}_{w}_s{}", sca_t[s - vec_t.len()].0)
    } else {
        format!("{base}_loop_{dt}_{w}")
    }
}

/// RMSNorm's kernels, in index order. The backward kernels may take more than the default
/// 48 KB of dynamic shared memory (a dw partial row).
pub(crate) fn kernel_table() -> Vec<Kernel> {
    (0..NUM_KERNELS)
        .map(|i| {
            let name = name(i);
            let attrs = LoadAttrs {
                large_smem: name.starts_with("graft_rms_bwd_"),
                ..LoadAttrs::default()
            };
            Kernel { name, attrs }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_indices_round_trip() {
        let names: Vec<String> = kernel_table().into_iter().map(|k| k.name).collect();
        assert_eq!(names.len(), NUM_KERNELS);
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len());

        let i = index(
            Dir::Fwd,
            DType::BF16,
            WeightKind::Same,
            Body::Rows { v: 8, vec: true },
        );
        assert_eq!(name(i.unwrap()), "graft_rms_fwd_rows_bf16_same_v8");
        let i = index(
            Dir::Bwd,
            DType::F16,
            WeightKind::Acc,
            Body::Rows { v: 2, vec: false },
        );
        assert_eq!(name(i.unwrap()), "graft_rms_bwd_rows_f16_acc_s2");
        let i = index(Dir::Bwd, DType::F64, WeightKind::None, Body::Loop);
        assert_eq!(name(i.unwrap()), "graft_rms_bwd_loop_f64_none");
        let i = finalize_index(DType::F32, DType::BF16).unwrap();
        assert_eq!(name(i), "graft_rms_dw_finalize_f32_bf16");
        // f32 / f64 weights in the accumulation dtype use the `same` kernels.
        let i = index(Dir::Fwd, DType::F32, WeightKind::Acc, Body::Loop);
        assert_eq!(name(i.unwrap()), "graft_rms_fwd_loop_f32_same");
    }

    #[test]
    fn uninstantiated_variants_have_no_index() {
        let b = Body::Rows { v: 16, vec: true };
        assert!(index(Dir::Bwd, DType::F32, WeightKind::None, b).is_none());
        let b = Body::Rows { v: 4, vec: false };
        assert!(index(Dir::Bwd, DType::F32, WeightKind::None, b).is_none());
        assert!(index(Dir::Fwd, DType::F32, WeightKind::None, b).is_some());
        assert!(finalize_index(DType::F64, DType::F32).is_none());
    }

    #[test]
    fn every_index_names_a_kernel_of_its_family() {
        for dir in [Dir::Fwd, Dir::Bwd] {
            for &(dtype, wk) in &FAMILIES {
                for vec in [true, false] {
                    for &(v, _) in rows_table(dir, vec) {
                        let n = name(index(dir, dtype, wk, Body::Rows { v, vec }).unwrap());
                        let d = if dir == Dir::Fwd { "fwd" } else { "bwd" };
                        let kind = if vec { 'v' } else { 's' };
                        let want = format!(
                            "graft_rms_{d}_rows_{}_{}_{kind}{v}",
                            dtype_tag(dtype),
                            weight_tag(wk)
                        );
                        assert_eq!(n, want);
                    }
                }
            }
        }
    }
}

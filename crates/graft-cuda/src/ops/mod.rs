//! The ops: each folder holds one op's launches (Rust) and its kernels (`<op>.cu`, compiled by
//! build.rs into the crate's one fatbin). Each op declares its kernels, with the attributes
//! they need at load time, in a `kernel_table()`; [`kernel_table`] concatenates them.

pub(crate) mod adam;
pub(crate) mod cross_entropy;
pub(crate) mod glu;
pub(crate) mod layer_norm;
pub(crate) mod moe_permute;
pub(crate) mod rms_norm;
pub(crate) mod rope;
pub(crate) mod softmax;
pub(crate) mod topk_sigmoid;
pub(crate) mod topk_softmax;

use crate::runtime::kernels::Kernel;

/// Every op's kernel table, in this order. RMSNorm's comes first: it launches its kernels by
/// their index in its own table.
const TABLES: &[fn() -> Vec<Kernel>] = &[
    rms_norm::kernel_table,
    glu::kernel_table,
    adam::kernel_table,
    softmax::kernel_table,
    layer_norm::kernel_table,
    rope::kernel_table,
    cross_entropy::kernel_table,
    moe_permute::kernel_table,
    topk_softmax::kernel_table,
    topk_sigmoid::kernel_table,
];

/// The crate's kernel table: every op's kernels.
pub(crate) fn kernel_table() -> Vec<Kernel> {
    TABLES.iter().flat_map(|table| table()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_comes_first_and_names_are_unique() {
        let table = kernel_table();
        let rms = rms_norm::kernel_table();
        assert_eq!(rms.len(), rms_norm::NUM_KERNELS);
        for (a, b) in table.iter().zip(&rms) {
            assert_eq!(a.name, b.name);
        }
        let mut names: Vec<&str> = table.iter().map(|k| k.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), table.len());
    }

    #[test]
    fn load_attributes_follow_each_ops_kernels() {
        for k in kernel_table() {
            let n = k.name.as_str();
            let smem = n.starts_with("graft_rms_bwd_")
                || n.starts_with("graft_ln_bwd_rows_v")
                || [
                    "fwd_loop_",
                    "bwd_loop_",
                    "fwd_split",
                    "bwd_split",
                    "fwd_bulk",
                    "bwd_bulk",
                ]
                .iter()
                .any(|p| n.starts_with(&format!("graft_softmax_{p}")));
            assert_eq!(k.attrs.large_smem, smem, "{n}");
            let cluster = n.starts_with("graft_softmax_bwd_bulk16_");
            assert_eq!(k.attrs.large_cluster, cluster, "{n}");
        }
    }
}

//! RMSNorm's kernel parameter blocks, laid out exactly as the structs in rms_norm.cu (every
//! field 8 bytes, so `#[repr(C)]` has no padding to disagree about).

/// `graft::FwdParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct FwdParams {
    pub x: u64,
    pub w: u64,
    pub y: u64,
    pub rstd: u64,
    pub rows: i64,
    pub cols: i64,
    pub tpr: i64,
    pub rpb: i64,
    pub vec: i64,
    pub eps: f64,
    pub inv_cols: f64,
    pub offset: f64,
    pub round_first: i64,
}

/// `graft::BwdParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct BwdParams {
    pub dy: u64,
    pub x: u64,
    pub rstd: u64,
    pub w: u64,
    pub dx: u64,
    pub partial: u64,
    pub rows: i64,
    pub cols: i64,
    pub tpr: i64,
    pub rpb: i64,
    pub vec: i64,
    pub has_dx: i64,
    pub has_dw: i64,
    pub dw_smem: i64,
    pub inv_cols: f64,
    pub offset: f64,
    pub round_first: i64,
}

/// `graft::FinalizeParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct FinalizeParams {
    pub partial: u64,
    pub dw: u64,
    pub nparts: i64,
    pub cols: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_the_cuda_structs() {
        // 13, 17 and 4 eight-byte fields (rms_norm.cu).
        assert_eq!(std::mem::size_of::<FwdParams>(), 104);
        assert_eq!(std::mem::size_of::<BwdParams>(), 136);
        assert_eq!(std::mem::size_of::<FinalizeParams>(), 32);
    }
}

//! Rotary position embedding over strided rows, q and k in one launch: rope.cu.

use crate::runtime::error::CudaError;
use crate::runtime::kernels::Kernel;
use crate::runtime::launch::{grid_covering, launch_named, NamedLaunch};
use crate::DType;

/// One operand of [`rope`] (q or k, or their gradients): rows addressed by three leading
/// indices `(i0, i1, i2)` with element strides; the output is dense, row
/// `(i0 * sizes[1] + i1) * sizes[2] + i2` at that row times `head_dim`.
#[derive(Clone, Copy, Debug, Default)]
pub struct RopeOperand {
    /// Device pointer to the input's element `(0, 0, 0, 0)`.
    pub x: u64,
    /// Device pointer to the dense output.
    pub out: u64,
    /// Sizes of the leading dimensions (any may be 0: no rows).
    pub sizes: [usize; 3],
    /// Element strides of `x`'s leading dimensions (its rows are contiguous).
    pub x_strides: [usize; 3],
    /// Element strides of the cosine rows (0 where one row serves many).
    pub cos_strides: [usize; 3],
    /// Element strides of the sine rows.
    pub sin_strides: [usize; 3],
    /// Elements per row of `x` and of the output.
    pub head_dim: usize,
}

impl RopeOperand {
    fn rows(&self) -> Option<u64> {
        self.sizes
            .iter()
            .try_fold(1u64, |acc, &s| acc.checked_mul(s as u64))
    }
}

/// Arguments of [`rope`].
#[derive(Clone, Copy, Debug)]
pub struct RopeArgs {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Element type of every array.
    pub dtype: DType,
    /// The backward (transposed) rotation instead of the forward one.
    pub backward: bool,
    /// The two operands (q and k); an operand without rows is skipped.
    pub operands: [RopeOperand; 2],
    /// Device pointer to the cosine table (rows of `rotary_dim` contiguous elements).
    pub cos: u64,
    /// Device pointer to the sine table, like `cos`.
    pub sin: u64,
    /// Leading elements of each row that are rotated: even, at most each `head_dim`.
    pub rotary_dim: usize,
}

/// `graft_rope::RopeOperand` of rope.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct OperandParams {
    x: u64,
    out: u64,
    sizes: [i64; 3],
    x_strides: [i64; 3],
    cos_strides: [i64; 3],
    sin_strides: [i64; 3],
    head_dim: i64,
    units: i64,
}

/// `graft_rope::RopeParams` of rope.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct RopeParams {
    op: [OperandParams; 2],
    cos: u64,
    sin: u64,
    rotary_dim: i64,
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

/// rope's kernel table: its kernels need no attribute set at load time.
pub(crate) fn kernel_table() -> Vec<Kernel> {
    kernel_names().into_iter().map(Kernel::plain).collect()
}

/// Entry points of rope.cu.
fn kernel_names() -> Vec<String> {
    let mut out = Vec::new();
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for dir in ["fwd", "bwd"] {
            for kind in ["vec", "one"] {
                out.push(format!("graft_rope_{dir}_{kind}_{}", dtype_tag(dtype)));
            }
        }
    }
    out
}

fn invalid(msg: String) -> CudaError {
    CudaError::invalid(format!("graft-cuda: rope: {msg}"))
}

/// Whether 16-byte packs of `pack` elements cover every row piece exactly and start aligned.
fn vectorizable(a: &RopeArgs, pack: usize) -> bool {
    let h = a.rotary_dim / 2;
    let bytes = 16u64;
    let aligned = |p: u64| p.is_multiple_of(bytes);
    let strides_ok = |s: &[usize; 3]| s.iter().all(|v| v.is_multiple_of(pack));
    h.is_multiple_of(pack)
        && aligned(a.cos)
        && aligned(a.sin)
        && a.operands.iter().all(|op| {
            op.rows() == Some(0)
                || ((op.head_dim - a.rotary_dim).is_multiple_of(pack)
                    && aligned(op.x)
                    && aligned(op.out)
                    && strides_ok(&op.x_strides)
                    && strides_ok(&op.cos_strides)
                    && strides_ok(&op.sin_strides))
        })
}

fn to_i64(v: usize, what: &str) -> Result<i64, CudaError> {
    i64::try_from(v).map_err(|_| invalid(format!("{what} {v} is too large")))
}

fn operand_params(
    op: &RopeOperand,
    rotary_dim: usize,
    v: usize,
) -> Result<OperandParams, CudaError> {
    let rows = op
        .rows()
        .ok_or_else(|| invalid("the number of rows overflows".into()))?;
    if rows == 0 {
        return Ok(OperandParams::default());
    }
    if op.head_dim < rotary_dim {
        return Err(invalid(format!(
            "head_dim {} is smaller than rotary_dim {rotary_dim}",
            op.head_dim
        )));
    }
    if op.x == 0 || op.out == 0 {
        return Err(invalid("null x or out".into()));
    }
    let per_row = (rotary_dim / 2 + op.head_dim - rotary_dim) / v;
    let units = rows
        .checked_mul(per_row as u64)
        .filter(|&u| u <= i64::MAX as u64 / 2)
        .ok_or_else(|| invalid("too many elements".into()))?;
    let arr = |s: &[usize; 3], what: &str| -> Result<[i64; 3], CudaError> {
        Ok([
            to_i64(s[0], what)?,
            to_i64(s[1], what)?,
            to_i64(s[2], what)?,
        ])
    };
    Ok(OperandParams {
        x: op.x,
        out: op.out,
        sizes: arr(&op.sizes, "size")?,
        x_strides: arr(&op.x_strides, "stride")?,
        cos_strides: arr(&op.cos_strides, "stride")?,
        sin_strides: arr(&op.sin_strides, "stride")?,
        head_dim: to_i64(op.head_dim, "head_dim")?,
        units: units as i64,
    })
}

/// The rope (or its backward) of both operands on `a.stream`, in one launch; nothing is launched
/// when neither has rows. The caller guarantees that every row lies inside its allocation.
pub fn rope(a: &RopeArgs) -> Result<(), CudaError> {
    if !a.rotary_dim.is_multiple_of(2) {
        return Err(invalid(format!("rotary_dim {} is odd", a.rotary_dim)));
    }
    let pack = 16 / a.dtype.size();
    let vec = vectorizable(a, pack);
    let v = if vec { pack } else { 1 };
    let op = [
        operand_params(&a.operands[0], a.rotary_dim, v)?,
        operand_params(&a.operands[1], a.rotary_dim, v)?,
    ];
    let work = op[0].units as u64 + op[1].units as u64;
    if work == 0 {
        return Ok(());
    }
    if a.rotary_dim > 0 && (a.cos == 0 || a.sin == 0) {
        return Err(invalid("null cos or sin".into()));
    }
    let mut params = RopeParams {
        op,
        cos: a.cos,
        sin: a.sin,
        rotary_dim: to_i64(a.rotary_dim, "rotary_dim")?,
    };
    let name = format!(
        "graft_rope_{}_{}_{}",
        if a.backward { "bwd" } else { "fwd" },
        if vec { "vec" } else { "one" },
        dtype_tag(a.dtype)
    );
    let launch = NamedLaunch {
        device: a.device,
        stream: a.stream,
        name: &name,
        grid: grid_covering(work, BLOCK),
        block: BLOCK,
        smem: 0,
    };
    launch_named(&launch, &mut params)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_match_the_cuda_struct() {
        assert_eq!(std::mem::size_of::<OperandParams>(), 16 * 8);
        assert_eq!(std::mem::size_of::<RopeParams>(), (2 * 16 + 3) * 8);
    }

    #[test]
    fn names_cover_every_dtype_direction_and_kind() {
        let names = kernel_names();
        assert_eq!(names.len(), 4 * 2 * 2);
        assert!(names.contains(&"graft_rope_bwd_vec_bf16".to_string()));
    }

    fn args(head_dim: usize, rotary_dim: usize, stride: usize) -> RopeArgs {
        let op = RopeOperand {
            x: 4096,
            out: 8192,
            sizes: [2, 3, 4],
            x_strides: [stride * 12, stride * 4, stride],
            cos_strides: [0, rotary_dim, 0],
            sin_strides: [0, rotary_dim, 0],
            head_dim,
        };
        RopeArgs {
            device: 0,
            stream: 0,
            dtype: DType::BF16,
            backward: false,
            operands: [op, RopeOperand::default()],
            cos: 1024,
            sin: 2048,
            rotary_dim,
        }
    }

    #[test]
    fn packs_need_whole_aligned_pieces() {
        assert!(vectorizable(&args(64, 64, 64), 8));
        assert!(vectorizable(&args(96, 64, 96), 8));
        assert!(!vectorizable(&args(64, 64, 68), 8), "misaligned rows");
        assert!(
            !vectorizable(&args(72, 72, 72), 8),
            "h = 36 is not a multiple of 8"
        );
        assert!(
            !vectorizable(&args(68, 64, 72), 8),
            "4 pass-through elements"
        );
    }

    #[test]
    fn odd_rotary_dims_and_short_rows_are_rejected() {
        assert!(rope(&args(64, 63, 64)).is_err());
        let short = RopeArgs {
            rotary_dim: 66,
            ..args(64, 64, 64)
        };
        assert!(operand_params(&short.operands[0], 66, 1).is_err());
    }
}

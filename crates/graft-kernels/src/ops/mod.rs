//! The ops, one module each: its public functions, its kernels, its `#[target_feature]` entry
//! points (`x86` inside it, made by `vectorize::x86_entry_points!`) and its dispatch.
//! An op imports the neutral modules of the crate and [`convert`] (the element conversions),
//! never another op.

pub mod adam;
pub mod convert;
pub mod cross_entropy;
pub mod glu;
pub mod layer_norm;
pub mod moe_permute;
pub mod rms_norm;
pub mod rope;
pub mod softmax;
pub mod topk_sigmoid;
pub mod topk_softmax;

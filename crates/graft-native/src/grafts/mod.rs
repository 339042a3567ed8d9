//! The aten grafts: one folder per aten op family, `mod.rs` (argument checks and what every
//! device shares), `cpu.rs` and `cuda.rs` (the kernels registered at each key). Each is listed,
//! one row per (op, key), in the crate's `GRAFTS` table.

pub mod adam;
pub mod layer_norm;
pub mod rms_norm;
pub mod softmax;

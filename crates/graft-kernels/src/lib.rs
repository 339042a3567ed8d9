//! Pure Rust CPU kernels for torchgraft: RMSNorm forward and backward over contiguous row-major
//! buffers, gated linear units ([`glu`]) and rotary position embeddings over strided rows
//! ([`rope`]), generic over `f32`, `f64`, `bf16` and `f16` (see [`Float`]). The activations'
//! `f32` transcendental functions are vectorized too (`vmath`).
//!
//! The kernels are SIMD, chosen at run time ([`Isa`]: AVX-512, AVX2 + FMA + F16C, or portable
//! Rust), and run near memory bandwidth: the forward pass reads each row from memory once (the
//! second pass, which writes `y`, finds it in cache), the backward pass reads `x` and `dy` once.
//! Parallelism comes only from the caller's [`Parallel`] (torch's intra-op pool in torchgraft);
//! [`Serial`] and [`Threads`] serve tests and benchmarks.
//!
//! No torch dependency: the numerics follow PyTorch's reference composites for
//! `aten::_fused_rms_norm` and `aten::_fused_rms_norm_backward`.

pub mod adam;
mod blocks;
pub mod convert;
pub mod cross_entropy;
mod dispatch;
pub mod elem;
pub mod exp;
mod float;
pub mod glu;
mod isa;
pub mod layer_norm;
mod parallel;
pub mod rms_norm;
pub mod rope;
mod rows;
mod simd;
pub mod softmax;
mod vectorize;
mod vmath;

pub use float::{Acc, Float};
pub use isa::{with_isa, Isa};
pub use parallel::{Parallel, Serial, Threads};

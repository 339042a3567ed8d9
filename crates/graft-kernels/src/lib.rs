//! Pure Rust CPU kernels for torchgraft, one module per op under [`ops`]: RMSNorm, LayerNorm,
//! softmax, gated linear units, rotary position embeddings, cross-entropy, Adam, MoE routing
//! and token permutation, and the element conversions. They work on contiguous (RoPE: strided)
//! buffers, generic over `f32`, `f64`, `bf16` and `f16` (see [`Float`]), with the numerics of
//! PyTorch's reference composites and ATen's CPU kernels (each op's docs say which).
//!
//! The kernels are SIMD, chosen at run time ([`Isa`]: AVX-512, AVX2 + FMA + F16C, or portable
//! Rust), and run near memory bandwidth. Parallelism comes only from the caller's [`Parallel`]
//! (torch's intra-op pool in torchgraft); [`Serial`] and [`Threads`] serve tests and benchmarks.
//! No torch dependency.
//!
//! Layout: `ops/<op>` holds an op's public functions, its kernels written once against the
//! vector tokens, its `#[target_feature]` entry points and its dispatch. The ops share only
//! neutral modules: `simd` (the vector tokens and their arithmetic, which names no op), `isa`,
//! `vectorize` (compiling a generic kernel per instruction set), `tables` (kernel tables per
//! element type), `float`, `parallel`, `blocks`, `elem`, `exp` and `vmath`; and `ops::convert`,
//! whose conversions every op with 16-bit inputs uses.

mod blocks;
pub mod elem;
pub mod exp;
mod float;
mod isa;
pub mod ops;
mod parallel;
mod simd;
mod tables;
mod vectorize;
mod vmath;

pub use float::{Acc, Float};
pub use isa::{with_isa, Isa};
pub use parallel::{Parallel, Serial, Threads};

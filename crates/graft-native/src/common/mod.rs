//! What every graft and op shares: tensor helpers, CUDA launch helpers, the meta functions'
//! layouts, call counters and the parallel-for. Imports no graft and no op.

pub mod cuda;
pub mod layout;
pub mod rms_norm_cuda;
pub mod stats;
pub mod tensor;
pub mod threads;

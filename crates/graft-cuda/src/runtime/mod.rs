//! The CUDA runtime under every op: the driver API (opened at run time), per-device state (the
//! primary context and the loaded module), launching, the embedded fatbin and launch-planning
//! helpers. It knows no op: the ops declare their kernels, with the attributes each needs at
//! load time, in the kernel table ([`kernels`]), which the runtime applies to every kernel.

pub(crate) mod config;
pub(crate) mod device;
pub(crate) mod driver;
pub(crate) mod error;
pub mod fatbin;
pub(crate) mod kernels;
pub(crate) mod launch;

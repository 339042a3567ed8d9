//! The crate's error type.

use std::fmt;

/// What went wrong, for callers that map errors to their own kinds (e.g. ATen's
/// `ValueError` for [`ErrorKind::InvalidArgument`], `RuntimeError` otherwise).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The CUDA driver library could not be loaded or lacks a needed function.
    DriverUnavailable,
    /// A driver call failed; `code` is its `CUresult`.
    Driver {
        /// The driver's `CUresult` value.
        code: i32,
    },
    /// An argument was rejected before anything was launched.
    InvalidArgument,
    /// This build has no kernels (nvcc was missing or failed at build time).
    NoKernels,
}

/// An error from graft-cuda; its `Display` is a complete message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaError {
    kind: ErrorKind,
    message: String,
}

impl CudaError {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }

    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message (the same text `Display` writes).
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for CudaError {}

//! Errors of stable-ABI calls and of kernels, and how they reach Python.

use std::ffi::CStr;
use std::fmt;

use crate::sys::{self, AOTITorchError};

/// An error from a stable-ABI call or a kernel; it reaches Python as a `RuntimeError`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error(String);

/// Result with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An error with this message.
    pub fn msg(message: impl Into<String>) -> Error {
        Error(message.into())
    }

    /// The error a failed stable-ABI call `function` returned, with torch's message when this
    /// torch can tell it (2.13+; older versions log it to stderr themselves).
    pub fn from_call(function: &str) -> Error {
        let detail = sys::api()
            .ok()
            .and_then(|api| api.torch_exception_get_what_without_backtrace)
            // SAFETY: the function takes no arguments and returns a borrowed C string or null.
            .map(|what| unsafe { what() })
            .filter(|p| !p.is_null())
            // SAFETY: non-null, NUL-terminated and valid until the next exception on this thread.
            .map(|p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
        match detail {
            Some(detail) => Error(detail),
            None => Error(format!("{function} failed (torch logged the reason above)")),
        }
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

impl From<String> for Error {
    fn from(message: String) -> Error {
        Error(message)
    }
}

/// Turns a stable-ABI return code into a `Result`.
pub(crate) fn check(code: AOTITorchError, function: &str) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(Error::from_call(function))
    }
}

/// Returns early with an [`Error`] built from a format string when `cond` is false.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::Error::msg(format!($($fmt)+)));
        }
    };
}

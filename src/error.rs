//! The one error type of the library: every fallible call returns [`XqError`].

use std::fmt;

/// What went wrong, typed so that callers (the CLI, the JS layer) can map it.
#[derive(Debug, Clone, PartialEq)]
pub enum XqError {
    /// A tensor has the wrong rank, length or an empty axis.
    Shape(String),
    /// A configuration value is out of range (bits, group size, eta, ...).
    Config(String),
    /// An input holds NaN or ±Inf (or a value the chosen params precision cannot hold).
    NonFinite(String),
    /// A context budget (`max_ctx`) would be exceeded.
    ContextBudget(String),
    /// No GPU adapter (WebGPU unavailable, no Vulkan/GL driver).
    NoAdapter(String),
    /// The GPU device was lost; the context cannot be used any more.
    DeviceLost(String),
    /// The GPU reported an error (validation, out of memory) or a readback failed.
    Gpu(String),
    /// A tensor is larger than what the device can bind in one storage binding.
    TooLarge(String),
    /// A file could not be read: missing, unreadable, a failed download.
    Io(String),
    /// Bytes that are not a valid file of their kind: corrupt, truncated, unsupported
    /// version, or not matching (another model, a device that cannot hold them).
    Format(String),
}

impl XqError {
    /// A short stable name for the kind of error (`"ShapeError"`, `"ConfigError"`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            XqError::Shape(_) => "ShapeError",
            XqError::Config(_) => "ConfigError",
            XqError::NonFinite(_) => "NonFiniteError",
            XqError::ContextBudget(_) => "ContextBudgetError",
            XqError::NoAdapter(_) => "WebGpuUnavailableError",
            XqError::DeviceLost(_) => "DeviceLostError",
            XqError::Gpu(_) => "GpuError",
            XqError::TooLarge(_) => "TooLargeError",
            XqError::Io(_) => "IoError",
            XqError::Format(_) => "FormatError",
        }
    }

    /// The message without the kind prefix.
    pub fn message(&self) -> &str {
        match self {
            XqError::Shape(m)
            | XqError::Config(m)
            | XqError::NonFinite(m)
            | XqError::ContextBudget(m)
            | XqError::NoAdapter(m)
            | XqError::DeviceLost(m)
            | XqError::Gpu(m)
            | XqError::TooLarge(m)
            | XqError::Io(m)
            | XqError::Format(m) => m,
        }
    }
}

impl fmt::Display for XqError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind(), self.message())
    }
}

impl std::error::Error for XqError {}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, XqError>;

/// Returns `Err(XqError::Shape)` with a formatted message.
macro_rules! shape_err {
    ($($arg:tt)*) => { Err($crate::error::XqError::Shape(format!($($arg)*))) };
}
/// Returns `Err(XqError::Config)` with a formatted message.
macro_rules! config_err {
    ($($arg:tt)*) => { Err($crate::error::XqError::Config(format!($($arg)*))) };
}
pub(crate) use config_err;
pub(crate) use shape_err;

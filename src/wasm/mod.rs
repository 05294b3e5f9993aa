//! The thin wasm-bindgen layer under the npm package's JavaScript facade (`js/`).
//!
//! Everything here converts: typed arrays and plain objects in, typed arrays and plain
//! objects out, and every `XqError` into an instance of the facade's error classes. No call
//! can panic on bad input; a call that fails changes nothing.

mod cache;
mod context;
mod convert;
mod errors;
mod model;
mod options;

pub use cache::CacheSetCore;
pub use context::XQuantCore;
pub use errors::register_error_classes;
pub use model::{F16CacheCore, GenerationCore, ModelCore};
pub use options::check_options;

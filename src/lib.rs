//! XQuant cross-layer KV-cache quantization on WebGPU (wgpu), with a CPU reference.
//!
//! * [`reference`](mod@reference): CPU twins of every kernel (the numerics to reproduce).
//! * [`gpu`]: the [`gpu::GpuContext`] and the WGSL kernels on GPU tensors.
//! * [`layout`]: the packed storage format both share.

// On the web wgpu's handles are not Send/Sync and everything runs on one thread; `Arc`
// keeps one code path for both targets.
#![cfg_attr(target_arch = "wasm32", allow(clippy::arc_with_non_send_sync))]

pub mod analysis;
pub mod cache;
pub mod config;
mod digest;
pub mod error;
pub mod gpu;
pub mod kvfile;
pub mod layout;
pub mod model;
pub mod reference;
pub mod synth;
#[cfg(target_arch = "wasm32")]
pub mod wasm;

pub use config::{
    DType, KvKind, Levels, ParamsPrecision, QuantSpec, Rotation, TensorShape, ValueAxis,
    XQuantConfig,
};
pub use error::{Result, XqError};

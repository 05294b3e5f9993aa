//! Host side of each WGSL family: shape checks, output allocation, uniforms, dispatch.

pub mod attention;
#[cfg(not(target_arch = "wasm32"))]
pub mod bench;
pub mod quant;
pub mod similarity;

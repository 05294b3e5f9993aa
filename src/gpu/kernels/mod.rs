//! Host side of each WGSL family: shape checks, output allocation, uniforms, dispatch.

pub mod bench;
pub mod quant;
pub mod similarity;

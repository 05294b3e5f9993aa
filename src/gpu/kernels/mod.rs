//! Host side of each WGSL family (one module per `wgsl/*.wgsl`: its uniform struct, shape
//! checks, output allocation, dispatch), plus the public tensor operations built on them.

pub mod attention;
#[cfg(not(target_arch = "wasm32"))]
pub mod bench;
pub(crate) mod group_quant;
pub(crate) mod llama;
pub(crate) mod materialize;
pub mod ops;
pub(crate) mod rotate;
pub mod similarity;
pub(crate) mod transpose;
pub(crate) mod views;
pub(crate) mod window;

//! Host of `wgsl/llama.wgsl`'s uniform (the forward pass itself is orchestrated by
//! `model/gpu.rs`).

use crate::gpu::mirror::wgsl_struct;
use crate::gpu::pipelines::Family;

wgsl_struct! {
    /// Mirrors `Dims` in `wgsl/llama.wgsl`.
    pub(crate) struct LlamaDims = Family::Llama, "Dims" {
        t: u32,
        k: u32,
        n: u32,
        heads: u32,
        n0: u32,
        head_dim: u32,
        pos0: u32,
        grid_x: u32,
        eps: f32,
        theta: f32,
        scale: f32,
        x_row0: u32,
        y_cols: u32,
        _pad0: u32,
        _pad1: u32,
        _pad2: u32,
    }
}

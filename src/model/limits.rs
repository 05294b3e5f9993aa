//! What the WGSL forward can run on a device: checked when a model is loaded, so a shape
//! beyond a kernel's reach is a typed error, never a wrong answer.
//!
//! The forward's kernels take any width (`matmul` walks K in tiles; RMSNorm, RoPE and the gated
//! activation loop or run one invocation per element; launches use a 2-D grid). What remains:
//! 16 rows of a weight matrix must fit one storage binding (a larger matrix is split into parts
//! of whole rows), the matrix a 32-bit element index, and a head must fit the attention
//! kernels' workgroup memory (`GpuContext::max_attention_dim`). An even head_dim is checked by
//! `ModelConfig::from_gguf`. Activations are checked per pass (`TooLarge` naming the buffer).

use crate::error::{Result, XqError};
use crate::gpu::GpuContext;
use crate::model::config::ModelConfig;
use crate::model::gguf::{Gguf, TensorInfo};
use crate::model::weight_format::GpuWeightFormat;

/// Every weight matrix the forward reads: (tensor name, rows, cols), `[rows, cols]` row-major
/// (GGUF dims `[cols, rows]`).
pub(crate) fn weight_shapes(cfg: &ModelConfig) -> Vec<(String, usize, usize)> {
    let (d, q, kv) = (
        cfg.hidden,
        cfg.heads * cfg.head_dim,
        cfg.kv_heads * cfg.head_dim,
    );
    let mut shapes = vec![("token_embd.weight".to_string(), cfg.vocab, d)];
    for l in 0..cfg.layers {
        for (name, rows, cols) in [
            ("attn_q", q, d),
            ("attn_k", kv, d),
            ("attn_v", kv, d),
            ("attn_output", d, q),
            ("ffn_gate", cfg.ffn, d),
            ("ffn_up", cfg.ffn, d),
            ("ffn_down", d, cfg.ffn),
        ] {
            shapes.push((format!("blk.{l}.{name}.weight"), rows, cols));
        }
    }
    shapes
}

/// An `IoError` unless `info` holds a `[rows, cols]` matrix.
pub(crate) fn expect_matrix(info: &TensorInfo, rows: usize, cols: usize) -> Result<()> {
    if info.dims != [cols, rows] {
        return Err(XqError::Io(format!(
            "{}: shape {:?}, expected [{cols}, {rows}]",
            info.name, info.dims
        )));
    }
    Ok(())
}

/// Refuses (`TooLarge`, naming the field and the limit) a model `ctx` cannot run, reading
/// only `g`'s metadata and tensor table.
pub(crate) fn check(ctx: &GpuContext, cfg: &ModelConfig, g: &Gguf) -> Result<()> {
    let max_dim = ctx.max_attention_dim();
    if cfg.head_dim > max_dim {
        return Err(XqError::TooLarge(format!(
            "head_dim {} exceeds {max_dim}, the widest head this device's attention kernels \
             hold in workgroup memory ({} bytes)",
            cfg.head_dim,
            ctx.limits().max_compute_workgroup_storage_size
        )));
    }
    let shapes = weight_shapes(cfg);
    for (name, rows, cols) in &shapes {
        // Kernels index elements (and blocks of 32) with u32.
        if (*rows as u64) * (*cols as u64) > 1 << 32 {
            return Err(XqError::TooLarge(format!(
                "{name}: {rows} × {cols} elements exceed the 2^32 the kernels' 32-bit \
                 indices reach"
            )));
        }
    }
    let limit = ctx.max_bound_buffer_bytes();
    for (name, rows, cols) in &shapes {
        let info = g.tensor(name)?;
        expect_matrix(info, *rows, *cols)?;
        let bytes = GpuWeightFormat::of(info.ty).bytes(info.ty, *rows, *cols);
        // A matrix larger than one binding is split into parts of whole rows (16 at least).
        let part = bytes / *rows as u64 * 16;
        if part > limit {
            return Err(XqError::TooLarge(format!(
                "{name}: 16 rows take {part} bytes on the GPU ({:?}), more than the device's \
                 storage binding limit of {limit} bytes",
                info.ty
            )));
        }
    }
    Ok(())
}

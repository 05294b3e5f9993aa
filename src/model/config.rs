//! The shape of a llama-architecture model, read from GGUF metadata.

use crate::error::{Result, XqError};
use crate::model::gguf::Gguf;

/// Hyper-parameters of a llama model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelConfig {
    /// Transformer blocks.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention).
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Feed-forward size.
    pub ffn: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// RoPE base θ.
    pub rope_theta: f32,
    /// RMSNorm ε.
    pub rms_eps: f32,
    /// Training context length.
    pub context: usize,
}

impl ModelConfig {
    /// Reads `llama.*` metadata; any other architecture is an error.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let arch = g.get("general.architecture")?.as_str().unwrap_or("");
        if arch != "llama" {
            return Err(XqError::Io(format!(
                "architecture `{arch}` is not supported (llama is)"
            )));
        }
        let n = |k: &str| g.get_u64(&format!("llama.{k}")).map(|v| v as usize);
        let hidden = n("embedding_length")?;
        let heads = n("attention.head_count")?;
        let cfg = ModelConfig {
            layers: n("block_count")?,
            hidden,
            heads,
            kv_heads: n("attention.head_count_kv").unwrap_or(heads),
            head_dim: hidden / heads.max(1),
            ffn: n("feed_forward_length")?,
            vocab: g
                .get("tokenizer.ggml.tokens")?
                .as_array()
                .map_or(0, |a| a.len()),
            rope_theta: g.get_f64("llama.rope.freq_base").unwrap_or(10000.0) as f32,
            rms_eps: g
                .get_f64("llama.attention.layer_norm_rms_epsilon")
                .unwrap_or(1e-5) as f32,
            context: n("context_length").unwrap_or(2048),
        };
        if cfg.heads == 0
            || cfg.kv_heads == 0
            || cfg.heads % cfg.kv_heads != 0
            || cfg.hidden % cfg.heads != 0
        {
            return Err(XqError::Io(format!("inconsistent llama shape {cfg:?}")));
        }
        if cfg.head_dim % 2 != 0 || cfg.head_dim > 256 {
            return Err(XqError::Io(format!(
                "head dim {} is not supported (even, at most 256)",
                cfg.head_dim
            )));
        }
        Ok(cfg)
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

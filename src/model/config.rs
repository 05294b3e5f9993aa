//! The shape of a llama-architecture model, read from GGUF metadata.

use crate::error::{config_err, Result, XqError};
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
    /// Channels per head: `llama.attention.key_length`, or hidden / heads without it.
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
            return Err(XqError::Format(format!(
                "architecture `{arch}` is not supported (llama is)"
            )));
        }
        let n = |k: &str| g.get_u64(&format!("llama.{k}")).map(|v| v as usize);
        let hidden = n("embedding_length")?;
        let heads = n("attention.head_count")?;
        // Optional keys: absent is fine, present but not an integer is an error.
        let optional = |k: &str| {
            g.meta
                .contains_key(&format!("llama.{k}"))
                .then(|| n(k))
                .transpose()
        };
        let key_length = optional("attention.key_length")?;
        let cfg = ModelConfig {
            layers: n("block_count")?,
            hidden,
            heads,
            kv_heads: n("attention.head_count_kv").unwrap_or(heads),
            head_dim: key_length.unwrap_or(hidden / heads.max(1)),
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
        if cfg.heads == 0 || cfg.kv_heads == 0 || cfg.heads % cfg.kv_heads != 0 {
            return Err(XqError::Format(format!("inconsistent llama shape {cfg:?}")));
        }
        if key_length.is_none() && cfg.hidden % cfg.heads != 0 {
            return config_err!(
                "llama.embedding_length {} is not a multiple of llama.attention.head_count {} \
                 (and no llama.attention.key_length gives head_dim)",
                cfg.hidden,
                cfg.heads
            );
        }
        if let Some(v) = optional("attention.value_length")? {
            if v != cfg.head_dim {
                return config_err!(
                    "llama.attention.value_length {v} differs from head_dim {} (only equal \
                     key and value widths are supported)",
                    cfg.head_dim
                );
            }
        }
        for (field, value) in [
            ("llama.block_count", cfg.layers),
            ("llama.embedding_length", cfg.hidden),
            ("llama.feed_forward_length", cfg.ffn),
            ("head_dim", cfg.head_dim),
            ("the vocabulary (tokenizer.ggml.tokens)", cfg.vocab),
        ] {
            if value == 0 {
                return config_err!("{field} is 0");
            }
        }
        // RoPE rotates pairs of channels. (Widths the GPU cannot run are refused by
        // `GpuModel::load`, against the device's limits.)
        if cfg.head_dim % 2 != 0 {
            return config_err!(
                "head_dim {} is not supported: RoPE needs an even head_dim",
                cfg.head_dim
            );
        }
        Ok(cfg)
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

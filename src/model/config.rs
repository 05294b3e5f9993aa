//! The shape of a model, read from GGUF metadata: the hyper-parameters every family has, and
//! what differs between the families (norm placement, activation, RoPE layout, sliding-window
//! pattern) as data the forward passes read.

use crate::error::{config_err, Result, XqError};
use crate::model::gguf::Gguf;

/// The model families this runtime runs (`general.architecture`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `llama` (SmolLM2): pre-norm blocks, SwiGLU, RoPE on adjacent pairs.
    Llama,
    /// `gemma3`: Q/K RMSNorm, post-attention and post-FFN norms, GELU-gated FFN, embeddings
    /// scaled by √hidden, RoPE on the two halves of a head, sliding-window layers.
    Gemma3,
}

impl Family {
    /// The family's `general.architecture`.
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Gemma3 => "gemma3",
        }
    }
}

/// Which channels RoPE rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopePairs {
    /// `(x[2i], x[2i + 1])`: llama.cpp's "normal" RoPE (GGUF permutes llama's Q/K rows for it).
    Adjacent,
    /// `(x[i], x[i + d/2])`: NEOX style.
    Halves,
}

/// The gate's activation in the gated FFN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// x·σ(x) (SwiGLU).
    Silu,
    /// GELU, tanh approximation (GeGLU).
    GeluTanh,
}

/// Gemma 3: every layer with `index % 6 == 5` attends globally, the others over a sliding
/// window. Not in the GGUF metadata; llama.cpp's `gemma3` graph fixes it (and HF's config's
/// `sliding_window_pattern: 6`).
pub const GEMMA3_GLOBAL_EVERY: usize = 6;

/// Gemma 3's RoPE base on sliding-window layers (`rope_local_base_freq`); global layers use
/// `gemma3.rope.freq_base`. Not in the GGUF metadata; llama.cpp fixes it.
pub const GEMMA3_LOCAL_ROPE_BASE: f32 = 10_000.0;

/// Hyper-parameters of a model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelConfig {
    /// The family: what the fields below that differ between families came from.
    pub family: Family,
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
    /// RoPE channel pairing.
    pub rope_pairs: RopePairs,
    /// RoPE base θ on sliding-window layers (equal to `rope_theta` without them).
    pub rope_theta_sliding: f32,
    /// The FFN gate's activation.
    pub activation: Activation,
    /// Per-head RMSNorm of queries and keys before RoPE (`attn_q_norm`, `attn_k_norm`).
    pub qk_norm: bool,
    /// RMSNorm of the attention and FFN outputs before they join the residual stream
    /// (`post_attention_norm`, `post_ffw_norm`).
    pub post_norms: bool,
    /// The embedding rows are multiplied by this before the first block.
    pub embed_scale: f32,
    /// Sliding-window layers attend to the last this many positions (the query's included).
    pub sliding_window: Option<usize>,
}

impl ModelConfig {
    /// Reads `llama.*` or `gemma3.*` metadata; any other architecture is an error naming it.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let arch = g.get("general.architecture")?.as_str().unwrap_or("");
        let family = match arch {
            "llama" => Family::Llama,
            "gemma3" => Family::Gemma3,
            _ => {
                return Err(XqError::Format(format!(
                    "architecture `{arch}` is not supported (llama and gemma3 are)"
                )))
            }
        };
        let n = |k: &str| g.get_u64(&format!("{arch}.{k}")).map(|v| v as usize);
        let hidden = n("embedding_length")?;
        let heads = n("attention.head_count")?;
        // Optional keys: absent is fine, present but not an integer is an error.
        let optional = |k: &str| {
            g.meta
                .contains_key(&format!("{arch}.{k}"))
                .then(|| n(k))
                .transpose()
        };
        let key_length = optional("attention.key_length")?;
        let rope_theta = g
            .get_f64(&format!("{arch}.rope.freq_base"))
            .unwrap_or(10000.0) as f32;
        let gemma = family == Family::Gemma3;
        let sliding_window = match gemma {
            true => optional("attention.sliding_window")?,
            false => None,
        };
        let cfg = ModelConfig {
            family,
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
            rope_theta,
            rms_eps: g
                .get_f64(&format!("{arch}.attention.layer_norm_rms_epsilon"))
                .unwrap_or(if gemma { 1e-6 } else { 1e-5 }) as f32,
            context: n("context_length").unwrap_or(2048),
            rope_pairs: if gemma {
                RopePairs::Halves
            } else {
                RopePairs::Adjacent
            },
            rope_theta_sliding: if sliding_window.is_some() {
                GEMMA3_LOCAL_ROPE_BASE
            } else {
                rope_theta
            },
            activation: if gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            qk_norm: gemma,
            post_norms: gemma,
            embed_scale: if gemma { (hidden as f32).sqrt() } else { 1.0 },
            sliding_window,
        };
        if sliding_window == Some(0) {
            return config_err!("{arch}.attention.sliding_window is 0");
        }
        if cfg.heads == 0 || cfg.kv_heads == 0 || cfg.heads % cfg.kv_heads != 0 {
            return Err(XqError::Format(format!(
                "inconsistent {arch} shape {cfg:?}"
            )));
        }
        if key_length.is_none() && cfg.hidden % cfg.heads != 0 {
            return config_err!(
                "{arch}.embedding_length {} is not a multiple of {arch}.attention.head_count {} \
                 (and no {arch}.attention.key_length gives head_dim)",
                cfg.hidden,
                cfg.heads
            );
        }
        if let Some(v) = optional("attention.value_length")? {
            if v != cfg.head_dim {
                return config_err!(
                    "{arch}.attention.value_length {v} differs from head_dim {} (only equal \
                     key and value widths are supported)",
                    cfg.head_dim
                );
            }
        }
        for (field, value) in [
            (format!("{arch}.block_count"), cfg.layers),
            (format!("{arch}.embedding_length"), cfg.hidden),
            (format!("{arch}.feed_forward_length"), cfg.ffn),
            ("head_dim".into(), cfg.head_dim),
            ("the vocabulary (tokenizer.ggml.tokens)".into(), cfg.vocab),
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

    /// The positions layer `l` attends to, counting the query's own: a sliding window, or
    /// `None` for every position so far.
    pub fn layer_window(&self, l: usize) -> Option<usize> {
        match self.family {
            Family::Gemma3 if l % GEMMA3_GLOBAL_EVERY != GEMMA3_GLOBAL_EVERY - 1 => {
                self.sliding_window
            }
            _ => None,
        }
    }

    /// Layer `l`'s RoPE base.
    pub fn layer_rope_theta(&self, l: usize) -> f32 {
        match self.layer_window(l) {
            Some(_) => self.rope_theta_sliding,
            None => self.rope_theta,
        }
    }
}

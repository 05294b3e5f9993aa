//! What a cache set is built for (the model) and how (the options).

use crate::cache::plan::{CachePlan, KIVI_2, KIVI_LLOYD};
use crate::config::{DType, XQuantConfig};
use crate::error::{config_err, Result};
use crate::reference::MAX_ROTATION_DIM;

/// The attention geometry of a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelSpec {
    /// Attention layers, one cache each.
    pub layers: usize,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Channels per head (D).
    pub head_dim: usize,
    /// Sequences decoded together.
    pub batch: usize,
}

impl ModelSpec {
    /// Checks every field is at least 1.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("layers", self.layers),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("batch", self.batch),
        ] {
            if v == 0 {
                return config_err!("model spec: {name} must be >= 1");
            }
        }
        Ok(())
    }

    /// Rows R = batch × kv_heads.
    pub fn rows(&self) -> usize {
        self.batch * self.kv_heads
    }
}

/// How decode steps are quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DecodePolicy {
    /// The most recent tokens stay in an f16 window; whole groups are quantized as it fills.
    #[default]
    Window,
    /// Every call is quantized as its own group, exactly like the reference (its weak point:
    /// one decode token pays a whole group of params). For porting the reference's tests.
    Reference,
}

impl DecodePolicy {
    /// Parses `window` or `reference`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "window" => Ok(DecodePolicy::Window),
            "reference" => Ok(DecodePolicy::Reference),
            other => config_err!("decode policy must be `window` or `reference`, got `{other}`"),
        }
    }

    /// `window` or `reference`.
    pub fn name(self) -> &'static str {
        match self {
            DecodePolicy::Window => "window",
            DecodePolicy::Reference => "reference",
        }
    }
}

/// Options of a cache set.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CacheConfig {
    /// Layer grouping, bit widths, quantization groups, η, value axis, params precision.
    pub quant: XQuantConfig,
    /// With the window policy, the most tokens a layer holds. With the reference policy, as in
    /// the reference, the most tokens an anchor may publish that its readers have not read.
    pub max_ctx: usize,
    /// Full-precision (f16) tokens kept unquantized: a multiple of `group_quant_size`.
    pub window: usize,
    /// First tokens kept in f16 in every layer (attention sinks); 0 = none.
    pub sinks: usize,
    /// Window (default) or reference.
    pub decode_policy: DecodePolicy,
    /// dtype of fetched K/V.
    pub output: DType,
    /// Most tokens per storage page (a multiple of `group_quant_size`); 0 (the default): as
    /// many as one storage binding holds. A layer's last page grows by doubling.
    pub page_tokens: usize,
}

/// The cache set's default quantizer, `kivi-lloyd`'s, chosen from the 1024- and 4096-token
/// evaluations of SmolLM2-135M and Gemma 3 270M (docs/quality.md; with `DEFAULT_SINKS`): no
/// cross-layer sharing; keys grouped along tokens (per channel) at 3 bits, values
/// Hadamard-rotated and grouped along channels (per token) with 2-bit Lloyd–Max levels and a
/// norm per group; groups of 64 (2.875 bits per quantized element). KIVI-2 (the previous
/// default) and the reference's pairs (`XQuantConfig::default()`) cost more perplexity.
pub const DEFAULT_QUANT: XQuantConfig = KIVI_LLOYD;

/// The base of quantizer options a caller writes (JS `cacheSet` options, the CLI's XQuant
/// options) over the defaults `base`: `base` itself, except that the cache set's default
/// ([`DEFAULT_QUANT`]) with any option given becomes KIVI-2's options ([`KIVI_2`]: 2-bit
/// keys and values, uniform, unrotated, groups of 32) — the options describe the reference's
/// grouping, and the default's Lloyd–Max values and rotation would not fit most combinations
/// of them (values along tokens, shared codes).
pub fn options_base(base: XQuantConfig, any_given: bool) -> XQuantConfig {
    if base == DEFAULT_QUANT && any_given {
        KIVI_2
    } else {
        base
    }
}

/// The cache set's default f16 sinks: the first 4 tokens (KIVI-2's +12.0% perplexity on
/// SmolLM2 became +5.5% with 4 sinks, +5.9% with 32).
pub const DEFAULT_SINKS: usize = 4;

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            quant: DEFAULT_QUANT,
            max_ctx: 8192,
            window: 128,
            sinks: DEFAULT_SINKS,
            decode_policy: DecodePolicy::Window,
            output: DType::F16,
            page_tokens: 0,
        }
    }
}

impl CacheConfig {
    /// The quantizer these options give a model of head dim `head_dim`: `quant`, except
    /// that the default ([`DEFAULT_QUANT`], kivi-lloyd's) falls back to KIVI-2's
    /// ([`KIVI_2`]: groups of 32, no rotation, the default before) where it cannot apply: a
    /// head dim that is not a power of two from 64 to [`MAX_ROTATION_DIM`] (its values'
    /// rotation and groups of 64 channels), or a window or page size that is not a multiple
    /// of 64 tokens.
    pub fn quant_for(&self, head_dim: usize) -> XQuantConfig {
        let g = DEFAULT_QUANT.group_quant_size;
        let fits = head_dim.is_power_of_two()
            && (g..=MAX_ROTATION_DIM).contains(&head_dim)
            && self.window % g == 0
            && self.page_tokens % g == 0;
        if self.quant == DEFAULT_QUANT && !fits {
            KIVI_2
        } else {
            self.quant
        }
    }

    /// Checks every option for a model of head dim `head_dim`.
    pub fn validate(&self, head_dim: usize) -> Result<()> {
        let q = self.quant_for(head_dim);
        q.validate()?;
        let g = q.group_quant_size;
        self.options().check_group(g)?;
        if self.window % g != 0 {
            return config_err!(
                "window ({}) must be a multiple of group_quant_size ({g})",
                self.window
            );
        }
        Ok(())
    }

    /// The plan these options describe for `layers` layers of head dim `head_dim` (see
    /// [`quant_for`](Self::quant_for)): the reference's grouping.
    pub fn plan(&self, layers: usize, head_dim: usize) -> Result<CachePlan> {
        let q = self.quant_for(head_dim);
        q.validate()?;
        CachePlan::grouped(layers, &q, self.window, self.sinks)
    }

    /// The options that are not part of the plan.
    pub fn options(&self) -> CacheOptions {
        CacheOptions {
            max_ctx: self.max_ctx,
            decode_policy: self.decode_policy,
            output: self.output,
            page_tokens: self.page_tokens,
        }
    }
}

/// How a cache set runs, apart from its [`CachePlan`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CacheOptions {
    /// See [`CacheConfig::max_ctx`].
    pub max_ctx: usize,
    /// Window (default) or reference.
    pub decode_policy: DecodePolicy,
    /// dtype of fetched K/V.
    pub output: DType,
    /// See [`CacheConfig::page_tokens`].
    pub page_tokens: usize,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheConfig::default().options()
    }
}

impl CacheOptions {
    /// Checks `max_ctx`, and `page_tokens` against groups of `g`.
    fn check_group(&self, g: usize) -> Result<()> {
        if self.max_ctx == 0 {
            return config_err!("max_ctx must be >= 1");
        }
        if self.page_tokens % g != 0 {
            return config_err!(
                "page_tokens ({}) must be 0 (automatic) or a multiple of group_quant_size ({g})",
                self.page_tokens
            );
        }
        Ok(())
    }

    /// Checks the options against the plan they run.
    pub fn validate(&self, plan: &CachePlan) -> Result<()> {
        self.check_group(plan.group_quant_size)?;
        if self.decode_policy == DecodePolicy::Reference {
            if let Some(i) = plan
                .layers
                .iter()
                .position(|l| l.attention_window.is_some())
            {
                return config_err!(
                    "layers[{i}].attention_window: the reference decode policy keeps every \
                     token as the reference does; sliding-window layers need the window policy"
                );
            }
            for (i, l) in plan.layers.iter().enumerate() {
                if l.key.codes != l.value.codes {
                    return config_err!(
                        "layers[{i}]: with the reference decode policy keys and values must \
                         take their codes from the same layer (the reference publishes both \
                         together)"
                    );
                }
            }
        }
        Ok(())
    }
}

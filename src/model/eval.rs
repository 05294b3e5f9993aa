//! `xquant eval`: perplexity of a text with the f16 cache and with XQuant configurations,
//! and how far each XQuant run's next-token distributions are from the f16 run's.

use serde_json::{json, Value};

use crate::cache::{CacheConfig, CachePlan, DecodePolicy};
use crate::config::{ValueAxis, XQuantConfig};
use crate::error::Result;
use crate::model::gpu::Logits;
use crate::model::runtime::{CacheChoice, Runtime};

/// One evaluated cache configuration.
#[derive(Clone, Debug)]
pub struct EvalRow {
    /// Short name, e.g. `g2 b2 r4`.
    pub name: String,
    /// The cache.
    pub cache: CacheChoice,
    /// Reference-accounted effective bits of the whole cache holding the whole text (the last
    /// token joins it after the log-probs), everything counted (window, sinks, params,
    /// residuals; 16 for f16).
    pub effective_bits: f64,
    /// Bits per quantized element alone (what long contexts tend to; 16 for f16).
    pub quantized_bits: f64,
    /// GPU bytes of the cache's storage at the end.
    pub kv_bytes: u64,
    /// exp(mean negative log-likelihood) of the text's tokens.
    pub perplexity: f64,
    /// Perplexity minus the f16 run's.
    pub delta_perplexity: f64,
    /// Share of positions whose most likely next token equals the f16 run's.
    pub top1_agreement: f64,
    /// Mean KL(f16 ‖ this) of the next-token distributions (nats).
    pub mean_kl: f64,
    /// Share of the text's tokens still unquantized at the end (in layer 0: the f16 window
    /// and sinks; 1 for f16). Near 1, the row says little about quantization.
    pub unquantized_share: f64,
}

impl EvalRow {
    /// As JSON.
    pub fn to_json(&self) -> Value {
        let config = match &self.cache {
            CacheChoice::F16 => json!("f16"),
            CacheChoice::XQuant(c) => {
                let mut v = c.quant.to_json();
                v["window"] = json!(c.window);
                v["sinks"] = json!(c.sinks);
                v["decode_policy"] = json!(c.decode_policy.name());
                v
            }
            CacheChoice::Plan(p) => p.to_json(),
        };
        json!({
            "name": self.name,
            "config": config,
            "effective_bits": self.effective_bits,
            "quantized_bits": self.quantized_bits,
            "kv_bytes": self.kv_bytes,
            "perplexity": self.perplexity,
            "delta_perplexity": self.delta_perplexity,
            "top1_agreement": self.top1_agreement,
            "mean_kl": self.mean_kl,
            "unquantized_share": self.unquantized_share,
        })
    }
}

/// The sweep `xquant eval` runs (window and sinks as given): the f16 baseline, then XQuant pairs at 2 bits with residual
/// 4, 2, 1, 0, no sharing (KIVI-like), η on, and per-token values.
pub fn standard_sweep(window: usize, sinks: usize) -> Vec<(String, CacheChoice)> {
    let base = CacheConfig {
        window,
        sinks,
        ..CacheConfig::default()
    };
    let with = |name: &str, quant: XQuantConfig| {
        (
            name.to_string(),
            CacheChoice::XQuant(CacheConfig { quant, ..base }),
        )
    };
    let q = XQuantConfig::default();
    vec![
        ("f16".to_string(), CacheChoice::F16),
        with("g2 b2 r4 (reference)", q),
        with(
            "g2 b2 r2",
            XQuantConfig {
                residual_bits: 2,
                ..q
            },
        ),
        with(
            "g2 b2 r1",
            XQuantConfig {
                residual_bits: 1,
                ..q
            },
        ),
        with(
            "g2 b2 r0 (pure reuse)",
            XQuantConfig {
                residual_bits: 0,
                ..q
            },
        ),
        with(
            "g1 b2 (no sharing, KIVI-like)",
            XQuantConfig {
                layers_per_group: 1,
                ..q
            },
        ),
        with(
            "g1 b2, per-token values (KIVI-2, default)",
            XQuantConfig {
                layers_per_group: 1,
                value_axis: ValueAxis::Channels,
                ..q
            },
        ),
        with("g2 b2 r4, eta 0.09", XQuantConfig { eta: 0.09, ..q }),
        with(
            "g2 b2 r4, per-token values",
            XQuantConfig {
                value_axis: ValueAxis::Channels,
                ..q
            },
        ),
    ]
}

/// How [`evaluate`] feeds the tokens after the prefill.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EvalMode {
    /// Teacher-forced chunks (up to [`MAX_CHUNK`] tokens) that join the cache and attend over
    /// it as decoding would. A chunk never spans a point where token-by-token decode quantizes
    /// a group, so every query sees the cache exactly as token-by-token decode shows it; the
    /// results differ from [`EvalMode::TokenByToken`] only by f32 rounding.
    #[default]
    Chunked,
    /// One token per forward pass, as a runtime decodes.
    TokenByToken,
}

impl EvalMode {
    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            EvalMode::Chunked => "chunked",
            EvalMode::TokenByToken => "token",
        }
    }
}

/// Most tokens of one evaluation chunk.
pub const MAX_CHUNK: usize = 64;

/// The chunks (`[start, end)` positions) that feed positions `from..to` under `choice`.
///
/// With the window policy a layer of `len` tokens holds `q(len) = ⌊(len − S − W) / G⌋·G`
/// quantized tokens (0 below `S + W`; `S` sinks, window `W`, group `G`): the quantized set
/// changes only when `len` reaches `S + W + k·G`. A chunk `[a, b)` shows query `p` the cache
/// of length `b` where decode shows it the cache of length `p + 1`; both quantize the same
/// groups when no `S + W + k·G` lies in `(a + 1, b]`. The reference policy quantizes every
/// call as its own group: one token per chunk.
pub fn eval_chunks(
    choice: &CacheChoice,
    mode: EvalMode,
    from: usize,
    to: usize,
) -> Vec<(usize, usize)> {
    // (first quantization point S + W + G, G) under the window policy.
    let window = |p: &CachePlan| (p.sinks + p.window + p.group_quant_size, p.group_quant_size);
    let points = match choice {
        CacheChoice::F16 => None,
        CacheChoice::XQuant(c) if c.decode_policy == DecodePolicy::Reference => Some((0, 0)),
        CacheChoice::XQuant(c) => Some((
            c.sinks + c.window + c.quant.group_quant_size,
            c.quant.group_quant_size,
        )),
        CacheChoice::Plan(p) => Some(window(p)),
    };
    let mut chunks = Vec::new();
    let mut a = from;
    while a < to {
        let mut b = (a + MAX_CHUNK).min(to);
        match (mode, points) {
            (EvalMode::TokenByToken, _) | (_, Some((_, 0))) => b = a + 1,
            (_, Some((first, g))) => {
                // The first quantization point after length a + 1.
                let next = if a + 1 < first {
                    first
                } else {
                    first + ((a + 1 - first) / g + 1) * g
                };
                b = b.min(next - 1);
            }
            (_, None) => {}
        }
        chunks.push((a, b));
        a = b;
    }
    chunks
}

/// Evaluates `tokens` under each cache (the first must be the f16 baseline): `prefill`
/// tokens in one call, then the rest as `mode` says.
pub async fn evaluate(
    rt: &Runtime,
    tokens: &[u32],
    prefill: usize,
    mode: EvalMode,
    configs: &[(String, CacheChoice)],
    mut progress: impl FnMut(&EvalRow),
) -> Result<Vec<EvalRow>> {
    let mut rows = Vec::new();
    let mut baseline: Option<Vec<Vec<f64>>> = None;
    for (name, choice) in configs {
        let mut cache = rt.cache(choice, tokens.len())?;
        let chunks = eval_chunks(choice, mode, prefill, tokens.len().saturating_sub(1));
        let lp = rt
            .next_token_logprobs_in(tokens, prefill, &chunks, cache.as_mut())
            .await?;
        // The last token predicts nothing but joins the cache, so the row's bits and bytes
        // are those of a cache holding the whole text.
        let held = cache.tokens(0);
        if held < tokens.len() {
            rt.model
                .forward(&tokens[held..], held, cache.as_mut(), Logits::Last)
                .await?;
        }
        let n = lp.len() as f64;
        let nll: f64 = lp
            .iter()
            .zip(&tokens[1..])
            .map(|(row, &t)| -row[t as usize])
            .sum::<f64>()
            / n;
        let (mut agree, mut kl) = (0.0, 0.0);
        if let Some(base) = &baseline {
            for (p, q) in base.iter().zip(&lp) {
                let top = |r: &[f64]| {
                    r.iter()
                        .enumerate()
                        .max_by(|a, b| a.1.total_cmp(b.1))
                        .map(|(i, _)| i)
                };
                if top(p) == top(q) {
                    agree += 1.0;
                }
                kl += p.iter().zip(q).map(|(a, b)| a.exp() * (a - b)).sum::<f64>();
            }
        } else {
            agree = n;
        }
        let (effective_bits, kv_bytes) = (cache.effective_bits(), cache.storage_bytes());
        let c = rt.model.cfg;
        let quantized_bits = match choice.plan(c.layers)? {
            None => 16.0,
            Some((plan, DecodePolicy::Window)) => plan
                .bytes_at(cache.tokens(0), c.kv_heads, c.head_dim)
                .quantized_bits(),
            // Every token is quantized: the accounting is the quantized rate.
            Some((_, DecodePolicy::Reference)) => effective_bits,
        };
        let unquantized_share = cache.unquantized_tokens(0) as f64 / cache.tokens(0) as f64;
        let perplexity = nll.exp();
        let row = EvalRow {
            name: name.clone(),
            cache: choice.clone(),
            effective_bits,
            quantized_bits,
            kv_bytes,
            perplexity,
            delta_perplexity: perplexity
                - rows.first().map_or(perplexity, |r: &EvalRow| r.perplexity),
            top1_agreement: agree / n,
            mean_kl: kl / n,
            unquantized_share,
        };
        progress(&row);
        if baseline.is_none() {
            baseline = Some(lp);
        }
        rows.push(row);
    }
    Ok(rows)
}

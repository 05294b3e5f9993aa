//! `xquant eval`: perplexity of a text with the f16 cache and with XQuant configurations,
//! and how far each XQuant run's next-token distributions are from the f16 run's.

use serde_json::{json, Value};

use crate::cache::{CacheConfig, CachePlan, DecodePolicy};
use crate::config::{ValueAxis, XQuantConfig};
use crate::error::{Result, XqError};
use crate::model::gpu::Logits;
use crate::model::runtime::{CacheChoice, Runtime};

pub use crate::digest::content_digest;

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

    /// The mode of a CLI name.
    pub fn from_name(name: &str) -> Option<EvalMode> {
        [EvalMode::Chunked, EvalMode::TokenByToken]
            .into_iter()
            .find(|m| m.name() == name)
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

/// What identifies an f16 evaluation run: the model file, the device, the kernels, the
/// tokens, the prefill and the feeding. Two runs with equal keys compute the same log-probs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BaselineKey {
    /// A digest of the model file's bytes ([`content_digest`]).
    pub model: String,
    /// The adapter the run used (its name and backend).
    pub adapter: String,
    /// A digest of the sources the run's build compiled ([`kernels_digest`]): a kernel that
    /// sums in another order, or a dispatch cut elsewhere, changes the log-probs.
    pub kernels: String,
    /// The evaluated token ids.
    pub tokens: Vec<u32>,
    /// Tokens of the first pass.
    pub prefill: usize,
    /// How the rest was fed.
    pub mode: EvalMode,
}

impl BaselineKey {
    /// The key of evaluating `tokens` on `rt` (its adapter) from the model file whose
    /// [`content_digest`] is `model`.
    pub fn new(rt: &Runtime, model: &str, tokens: &[u32], prefill: usize, mode: EvalMode) -> Self {
        BaselineKey {
            model: model.to_string(),
            adapter: rt.model.context().adapter().to_string(),
            kernels: kernels_digest(),
            tokens: tokens.to_vec(),
            prefill,
            mode,
        }
    }

    /// A file name for the baseline of this key: the digest of the whole key (the key
    /// inside the file is still compared in full).
    pub fn file_name(&self) -> String {
        let k = self;
        let key = json!([
            k.model,
            k.adapter,
            k.kernels,
            k.tokens,
            k.prefill,
            k.mode.name()
        ]);
        format!("{}.xqbase", content_digest(key.to_string().as_bytes()))
    }
}

/// The f16 row of an evaluation, kept so that the next evaluation of the same key need not
/// run the model with the f16 cache again: the row's cache figures and every position's
/// final-normalized hidden state, from which the output matmul recomputes the f16 run's
/// log-probs bit for bit ([`Runtime::logprobs_of_hidden`]): about a fifth of the f16 run's
/// work on SmolLM2, where the output matmul is a fifth of the weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Baseline {
    /// What run it is.
    pub key: BaselineKey,
    /// `[tokens - 1, hidden]`: the input of the output matmul for each predicting position.
    pub hidden: Vec<f32>,
    /// The f16 cache's GPU bytes at the end ([`EvalRow::kv_bytes`]).
    pub kv_bytes: u64,
    /// The f16 cache's effective bits ([`EvalRow::effective_bits`]).
    pub effective_bits: f64,
}

/// The first bytes of a saved [`Baseline`].
const BASELINE_MAGIC: &[u8; 8] = b"XQEVALB1";

impl Baseline {
    /// The file form: magic, a little-endian u32 length, a JSON header, the hidden states as
    /// little-endian f32.
    pub fn to_bytes(&self) -> Vec<u8> {
        let header = json!({
            "model": self.key.model,
            "adapter": self.key.adapter,
            "kernels": self.key.kernels,
            "tokens": self.key.tokens,
            "prefill": self.key.prefill,
            "mode": self.key.mode.name(),
            "kv_bytes": self.kv_bytes,
            "effective_bits": self.effective_bits,
            "hidden": self.hidden.len(),
        })
        .to_string();
        let mut out = Vec::with_capacity(12 + header.len() + 4 * self.hidden.len());
        out.extend_from_slice(BASELINE_MAGIC);
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        for v in &self.hidden {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    /// Reads [`Baseline::to_bytes`]'s form; a file that is not one, or is cut short, is a
    /// [`XqError::Format`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Baseline> {
        let bad = |why: &str| XqError::Format(format!("not an evaluation baseline: {why}"));
        if bytes.len() < 12 || &bytes[..8] != BASELINE_MAGIC {
            return Err(bad("wrong magic"));
        }
        let n = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
        let header: Value = bytes
            .get(12..12 + n)
            .and_then(|h| serde_json::from_slice(h).ok())
            .ok_or_else(|| bad("unreadable header"))?;
        let int = |k: &str| header[k].as_u64().ok_or_else(|| bad(k));
        let text = |k: &str| header[k].as_str().map(str::to_string).ok_or_else(|| bad(k));
        let tokens = header["tokens"]
            .as_array()
            .and_then(|a| {
                a.iter()
                    .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect::<Option<Vec<u32>>>()
            })
            .ok_or_else(|| bad("tokens"))?;
        let floats = int("hidden")? as usize;
        let body = &bytes[12 + n..];
        if body.len() != 4 * floats {
            return Err(bad("the hidden states are cut short"));
        }
        Ok(Baseline {
            key: BaselineKey {
                model: text("model")?,
                adapter: text("adapter")?,
                kernels: text("kernels")?,
                tokens,
                prefill: int("prefill")? as usize,
                mode: EvalMode::from_name(&text("mode")?).ok_or_else(|| bad("mode"))?,
            },
            hidden: body
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            kv_bytes: int("kv_bytes")?,
            effective_bits: header["effective_bits"]
                .as_f64()
                .ok_or_else(|| bad("effective_bits"))?,
        })
    }
}

/// A digest of every source this build compiles (`src/` and `wgsl/`, by `build.rs`): part of a
/// [`BaselineKey`], so that a baseline kept by another build is not replayed. The WGSL alone
/// was not enough: the Rust that dispatches it decides where split-K partials merge (a CPU
/// adapter's chunks cut in whole pairs of runs moved SmolLM2's f16 perplexity on chapter 42
/// from 55.81060 to 55.81097, with the same kernels).
pub fn kernels_digest() -> String {
    env!("XQUANT_SOURCE_DIGEST").to_string()
}

/// What [`evaluate`] returns.
pub struct Evaluation {
    /// One row per cache, in order.
    pub rows: Vec<EvalRow>,
    /// The f16 run's baseline: computed (keep it for the next evaluation) or the one given.
    pub baseline: Baseline,
    /// Whether the f16 row was recomputed from a given baseline instead of run.
    pub baseline_replayed: bool,
}

/// Evaluates the key's tokens under each cache (the first must be the f16 baseline): its
/// `prefill` tokens in one call, then the rest as its `mode` says. `known` is a baseline
/// kept from an earlier evaluation: when its key is `key`, the f16 row's log-probs are
/// recomputed from it instead of run; any other key is ignored.
pub async fn evaluate(
    rt: &Runtime,
    key: &BaselineKey,
    configs: &[(String, CacheChoice)],
    known: Option<Baseline>,
    mut progress: impl FnMut(&EvalRow),
) -> Result<Evaluation> {
    if configs.first().map(|c| &c.1) != Some(&CacheChoice::F16) {
        return Err(XqError::Shape(
            "an evaluation's first cache must be the f16 baseline".into(),
        ));
    }
    let (tokens, prefill, mode) = (key.tokens.as_slice(), key.prefill, key.mode);
    let known = known.filter(|b| &b.key == key);
    let baseline_replayed = known.is_some();
    let mut kept = known;
    let mut rows = Vec::new();
    let mut baseline: Option<Vec<Vec<f64>>> = None;
    for (name, choice) in configs {
        let chunks = eval_chunks(choice, mode, prefill, tokens.len().saturating_sub(1));
        let (lp, figures) = match (choice, &kept) {
            (CacheChoice::F16, Some(b)) => {
                let figures = CacheFigures {
                    effective_bits: b.effective_bits,
                    quantized_bits: 16.0,
                    kv_bytes: b.kv_bytes,
                    unquantized_share: 1.0,
                };
                let lp = rt.logprobs_of_hidden(&b.hidden, prefill, &chunks).await?;
                (lp, figures)
            }
            _ => {
                let (lp, figures, hidden) = run_row(rt, choice, tokens, prefill, &chunks).await?;
                if *choice == CacheChoice::F16 {
                    kept = Some(Baseline {
                        key: key.clone(),
                        hidden,
                        kv_bytes: figures.kv_bytes,
                        effective_bits: figures.effective_bits,
                    });
                }
                (lp, figures)
            }
        };
        let row = score_row(
            name,
            choice,
            figures,
            &lp,
            tokens,
            baseline.as_deref(),
            &rows,
        );
        progress(&row);
        baseline.get_or_insert(lp);
        rows.push(row);
    }
    Ok(Evaluation {
        rows,
        baseline: kept.expect("the first row is the f16 run"),
        baseline_replayed,
    })
}

/// Runs one row: its log-probs, its cache's figures at the end, and for the f16 cache the
/// final hidden states (empty for the others).
async fn run_row(
    rt: &Runtime,
    choice: &CacheChoice,
    tokens: &[u32],
    prefill: usize,
    chunks: &[(usize, usize)],
) -> Result<(Vec<Vec<f64>>, CacheFigures, Vec<f32>)> {
    let mut cache = rt.cache(choice, tokens.len())?;
    let (lp, hidden) = match choice {
        CacheChoice::F16 => {
            rt.next_token_logprobs_keeping_hidden(tokens, prefill, chunks, cache.as_mut())
                .await?
        }
        _ => (
            rt.next_token_logprobs_in(tokens, prefill, chunks, cache.as_mut())
                .await?,
            Vec::new(),
        ),
    };
    // The last token predicts nothing but joins the cache, so the row's bits and bytes are
    // those of a cache holding the whole text.
    let held = cache.tokens(0);
    if held < tokens.len() {
        rt.model
            .forward(&tokens[held..], held, cache.as_mut(), Logits::Last)
            .await?;
    }
    let effective_bits = cache.effective_bits();
    let c = rt.model.cfg;
    let quantized_bits = match choice.plan(c.layers, c.head_dim)? {
        None => 16.0,
        Some((plan, DecodePolicy::Window)) => plan
            .bytes_at(cache.tokens(0), c.kv_heads, c.head_dim)
            .quantized_bits(),
        // Every token is quantized: the accounting is the quantized rate.
        Some((_, DecodePolicy::Reference)) => effective_bits,
    };
    let figures = CacheFigures {
        effective_bits,
        quantized_bits,
        kv_bytes: cache.storage_bytes(),
        unquantized_share: cache.unquantized_tokens(0) as f64 / cache.held_tokens(0) as f64,
    };
    Ok((lp, figures, hidden))
}

/// A row's cache figures, measured on the cache after the run.
struct CacheFigures {
    effective_bits: f64,
    quantized_bits: f64,
    kv_bytes: u64,
    unquantized_share: f64,
}

/// One row from its log-probs, against the f16 run's (`base`; none for the f16 row itself).
fn score_row(
    name: &str,
    choice: &CacheChoice,
    figures: CacheFigures,
    lp: &[Vec<f64>],
    tokens: &[u32],
    base: Option<&[Vec<f64>]>,
    rows: &[EvalRow],
) -> EvalRow {
    let n = lp.len() as f64;
    let nll: f64 = lp
        .iter()
        .zip(&tokens[1..])
        .map(|(row, &t)| -row[t as usize])
        .sum::<f64>()
        / n;
    let (mut agree, mut kl) = (0.0, 0.0);
    if let Some(base) = base {
        for (p, q) in base.iter().zip(lp) {
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
    let perplexity = nll.exp();
    EvalRow {
        name: name.to_string(),
        cache: choice.clone(),
        effective_bits: figures.effective_bits,
        quantized_bits: figures.quantized_bits,
        kv_bytes: figures.kv_bytes,
        perplexity,
        delta_perplexity: perplexity - rows.first().map_or(perplexity, |r: &EvalRow| r.perplexity),
        top1_agreement: agree / n,
        mean_kl: kl / n,
        unquantized_share: figures.unquantized_share,
    }
}

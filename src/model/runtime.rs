//! A model with its tokenizer and a cache: generation, evaluation and K/V capture.

use std::sync::Arc;

use crate::cache::{
    CacheConfig, CacheOptions, CachePlan, CacheSet, DecodePolicy, Fp16CacheSet, KvCache, ModelSpec,
};
use crate::config::DType;
use crate::error::{Result, XqError};
use crate::gpu::GpuContext;
use crate::kvfile::{tensors_to_bytes, FileDType, KvFile, KvLayer, Tensor};
use crate::model::generate::{Decoder, Sampling};
use crate::model::gguf::Gguf;
use crate::model::gpu::{GpuModel, Logits};
use crate::model::tokenizer::Tokenizer;
use crate::TensorShape;

/// Which cache a run uses.
#[derive(Clone, Debug, PartialEq)]
pub enum CacheChoice {
    /// Plain f16 K/V.
    F16,
    /// An XQuant cache set built from options (the reference's grouping).
    XQuant(CacheConfig),
    /// An XQuant cache set following a plan (window policy).
    Plan(CachePlan),
}

impl CacheChoice {
    /// The plan of an XQuant choice for `layers` layers of head dim `head_dim` and its
    /// decode policy (`None` for f16).
    pub fn plan(
        &self,
        layers: usize,
        head_dim: usize,
    ) -> Result<Option<(CachePlan, DecodePolicy)>> {
        Ok(match self {
            CacheChoice::F16 => None,
            CacheChoice::XQuant(c) => Some((c.plan(layers, head_dim)?, c.decode_policy)),
            CacheChoice::Plan(p) => Some((p.clone(), DecodePolicy::Window)),
        })
    }

    /// A short description: `f16`, the options as JSON, or the plan's name.
    pub fn describe(&self) -> String {
        match self {
            CacheChoice::F16 => "f16".into(),
            CacheChoice::XQuant(c) => format!("xquant {}", c.quant.to_json()),
            CacheChoice::Plan(p) => format!("plan `{}`", p.name),
        }
    }
}

/// The model, its tokenizer, on one GPU context.
pub struct Runtime {
    /// The forward pass.
    pub model: GpuModel,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
}

/// Index of the largest logit.
pub fn argmax(logits: &[f32]) -> u32 {
    logits
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i as u32)
}

/// log-softmax of one row of logits.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = logits
        .iter()
        .map(|&l| (l as f64 - m).exp())
        .sum::<f64>()
        .ln()
        + m;
    logits.iter().map(|&l| l as f64 - lse).collect()
}

impl Runtime {
    /// Loads the model file's bytes onto `ctx`.
    pub fn load(ctx: Arc<GpuContext>, bytes: &[u8]) -> Result<Runtime> {
        let g = Gguf::parse(bytes)?;
        Ok(Runtime {
            tokenizer: Tokenizer::from_gguf(&g)?,
            model: GpuModel::load(ctx, &g, bytes)?,
        })
    }

    /// The K/V shape of one sequence of this model (what its caches are built for).
    pub fn spec(&self) -> ModelSpec {
        let c = self.model.cfg;
        ModelSpec {
            layers: c.layers,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            batch: 1,
        }
    }

    /// Refuses a cache built for another shape than this model's.
    pub fn check_cache(&self, cache: &dyn KvCache) -> Result<()> {
        let (want, got) = (self.spec(), *cache.model());
        if want != got {
            return Err(XqError::Shape(format!(
                "the cache holds {} layers × {} KV heads × head_dim {} (batch {}), the model needs {} × {} × {} (batch 1)",
                got.layers, got.kv_heads, got.head_dim, got.batch, want.layers, want.kv_heads, want.head_dim
            )));
        }
        Ok(())
    }

    /// Each layer's attention window (`None` on global layers): Gemma 3's sliding layers.
    pub fn attention_windows(&self) -> Vec<Option<usize>> {
        let c = &self.model.cfg;
        (0..c.layers).map(|l| c.layer_window(l)).collect()
    }

    /// A fresh cache for up to `max_ctx` tokens. Its sliding-window layers (the model's
    /// [`Runtime::attention_windows`], on every layer a plan leaves without one) keep only
    /// their window; with the reference decode policy every layer keeps every token.
    pub fn cache(&self, choice: &CacheChoice, max_ctx: usize) -> Result<Box<dyn KvCache>> {
        let spec = self.spec();
        let ctx = self.model.context().clone();
        let windows = self.attention_windows();
        Ok(match choice {
            CacheChoice::F16 => Box::new(
                Fp16CacheSet::for_model(ctx, spec, max_ctx, DType::F16)?
                    .with_attention_windows(&windows)?,
            ),
            CacheChoice::XQuant(config) => {
                let config = CacheConfig { max_ctx, ..*config };
                config.validate(spec.head_dim)?;
                let mut plan = config.plan(spec.layers, spec.head_dim)?;
                if config.decode_policy == DecodePolicy::Window {
                    plan = plan.with_model_windows(&windows);
                }
                Box::new(CacheSet::for_plan(ctx, spec, plan, config.options())?)
            }
            CacheChoice::Plan(plan) => {
                let options = CacheOptions {
                    max_ctx,
                    ..Default::default()
                };
                let plan = plan.clone().with_model_windows(&windows);
                Box::new(CacheSet::for_plan(ctx, spec, plan, options)?)
            }
        })
    }

    /// Generation after `prompt` (token ids, continuing after what `cache` holds): up to
    /// `max_tokens` new tokens chosen by `sampling`, stopping at end of sequence; `on_token`
    /// sees each one as it comes. The same [`Decoder`] steps the browser's generations.
    pub async fn generate(
        &self,
        prompt: &[u32],
        max_tokens: usize,
        sampling: Sampling,
        cache: &mut dyn KvCache,
        mut on_token: impl FnMut(u32),
    ) -> Result<Vec<u32>> {
        let mut decoder = Decoder::new(sampling, max_tokens)?;
        decoder.prefill(self, prompt, cache, |_, _| {}).await?;
        let mut out = Vec::new();
        while let Some(next) = decoder.next(self, cache).await? {
            out.push(next);
            on_token(next);
        }
        Ok(out)
    }

    /// Next-token log-probabilities along `tokens`, as a runtime decodes: `prefill` tokens in
    /// one call, then one token per call. Row i predicts token i + 1 (`tokens.len() - 1` rows).
    pub async fn next_token_logprobs(
        &self,
        tokens: &[u32],
        prefill: usize,
        cache: &mut dyn KvCache,
    ) -> Result<Vec<Vec<f64>>> {
        let steps: Vec<_> = (prefill..tokens.len().saturating_sub(1))
            .map(|p| (p, p + 1))
            .collect();
        self.next_token_logprobs_in(tokens, prefill, &steps, cache)
            .await
    }

    /// [`Runtime::next_token_logprobs`] with the tokens after the prefill fed in `chunks`
    /// (`[start, end)` positions, consecutive from `prefill` to the second-to-last token):
    /// each chunk's tokens join the cache, then attend over it causally.
    pub async fn next_token_logprobs_in(
        &self,
        tokens: &[u32],
        prefill: usize,
        chunks: &[(usize, usize)],
        cache: &mut dyn KvCache,
    ) -> Result<Vec<Vec<f64>>> {
        Ok(self
            .next_token_pass(tokens, prefill, chunks, cache, false)
            .await?
            .0)
    }

    /// [`Runtime::next_token_logprobs_in`], also returning every row's final-normalized hidden
    /// state (`[tokens.len() - 1, hidden]`), from which [`Runtime::logprobs_of_hidden`]
    /// recomputes the same log-probs with the output matmul alone.
    pub async fn next_token_logprobs_keeping_hidden(
        &self,
        tokens: &[u32],
        prefill: usize,
        chunks: &[(usize, usize)],
        cache: &mut dyn KvCache,
    ) -> Result<(Vec<Vec<f64>>, Vec<f32>)> {
        self.next_token_pass(tokens, prefill, chunks, cache, true)
            .await
    }

    /// The log-probs of the hidden rows [`Runtime::next_token_logprobs_keeping_hidden`] kept
    /// with the same `prefill` and `chunks`: each pass's rows go through the output matmul
    /// as that pass did (same row count, same kernel), so the log-probs are the same bit for bit.
    pub async fn logprobs_of_hidden(
        &self,
        hidden: &[f32],
        prefill: usize,
        chunks: &[(usize, usize)],
    ) -> Result<Vec<Vec<f64>>> {
        let (d, vocab) = (self.model.cfg.hidden, self.model.cfg.vocab);
        let rows: usize = prefill + chunks.iter().map(|&(a, b)| b - a).sum::<usize>();
        if prefill == 0 || hidden.len() != rows * d {
            return Err(XqError::Shape(format!(
                "{} hidden floats for a prefill of {prefill} and {} chunks ({rows} rows of {d})",
                hidden.len(),
                chunks.len()
            )));
        }
        let mut out = Vec::with_capacity(rows);
        let mut row = 0;
        for n in std::iter::once(prefill).chain(chunks.iter().map(|&(a, b)| b - a)) {
            let logits = self
                .model
                .logits_of_hidden(&hidden[row * d..(row + n) * d])
                .await?;
            out.extend(logits.chunks_exact(vocab).map(log_softmax));
            row += n;
        }
        Ok(out)
    }

    async fn next_token_pass(
        &self,
        tokens: &[u32],
        prefill: usize,
        chunks: &[(usize, usize)],
        cache: &mut dyn KvCache,
        keep_hidden: bool,
    ) -> Result<(Vec<Vec<f64>>, Vec<f32>)> {
        if tokens.len() < 2 || prefill == 0 || prefill >= tokens.len() {
            return Err(XqError::Shape(format!(
                "evaluation needs at least 2 tokens and a prefill in 1..{} (got {} tokens, prefill {prefill})",
                tokens.len(),
                tokens.len()
            )));
        }
        let vocab = self.model.cfg.vocab;
        let mut rows = Vec::with_capacity(tokens.len() - 1);
        let mut hidden = Vec::new();
        let mut pass = async |ids: &[u32], pos0: usize, which: Logits, cache: &mut dyn KvCache| {
            let logits = match keep_hidden {
                true => {
                    let (logits, h) = self
                        .model
                        .forward_keeping_hidden(ids, pos0, cache, which)
                        .await?;
                    hidden.extend_from_slice(&h);
                    logits
                }
                false => self.model.forward(ids, pos0, cache, which).await?,
            };
            rows.extend(logits.chunks_exact(vocab).map(log_softmax));
            Ok::<(), XqError>(())
        };
        pass(&tokens[..prefill], 0, Logits::All, cache).await?;
        let mut pos = prefill;
        for &(a, b) in chunks {
            if a != pos || b <= a || b > tokens.len() - 1 {
                return Err(XqError::Shape(format!(
                    "evaluation chunk {a}..{b} does not continue at {pos} within {}",
                    tokens.len() - 1
                )));
            }
            let which = if b - a == 1 {
                Logits::Last
            } else {
                Logits::All
            };
            pass(&tokens[a..b], a, which, cache).await?;
            pos = b;
        }
        if pos != tokens.len() - 1 {
            return Err(XqError::Shape(format!(
                "evaluation chunks end at {pos}, not {}",
                tokens.len() - 1
            )));
        }
        Ok((rows, hidden))
    }

    /// Runs `tokens` through the model with an f16 cache and returns every layer's K/V (keys
    /// after RoPE, as attention reads them), `[1, kv_heads, T, head_dim]` f16.
    pub async fn capture(&self, tokens: &[u32]) -> Result<KvFile> {
        Ok(self.capture_inner(tokens, false).await?.0)
    }

    /// [`Runtime::capture`] plus every layer's queries after RoPE, `[1, heads, T, head_dim]`
    /// (what `xquant plan` weighs key errors with).
    pub async fn capture_with_queries(&self, tokens: &[u32]) -> Result<(KvFile, Vec<Vec<f32>>)> {
        self.capture_inner(tokens, true).await
    }

    /// The capture as a safetensors file: `past_key_values.{i}.key/.value` (f16), and with
    /// `queries` every layer's queries `q.{i}` (`[1, heads, T, head_dim]`, f16): what
    /// `xquant capture [--queries]` writes and the planner reads.
    pub async fn capture_file(&self, tokens: &[u32], queries: bool) -> Result<Vec<u8>> {
        let (kv, qs) = self.capture_inner(tokens, queries).await?;
        let mut tensors = kv.tensors();
        let c = self.model.cfg;
        for (i, q) in qs.into_iter().enumerate() {
            let t = Tensor {
                shape: vec![1, c.heads, tokens.len(), c.head_dim],
                dtype: FileDType::F16,
                data: q,
            };
            tensors.push((format!("q.{i}"), t));
        }
        let refs: Vec<(String, &Tensor)> = tensors.iter().map(|(n, t)| (n.clone(), t)).collect();
        Ok(tensors_to_bytes(&refs))
    }

    async fn capture_inner(
        &self,
        tokens: &[u32],
        queries: bool,
    ) -> Result<(KvFile, Vec<Vec<f32>>)> {
        let c = self.model.cfg;
        let ctx = self.model.context();
        let per_layer = tokens.len() * c.heads * c.head_dim;
        let sink = match queries {
            true => {
                Some(ctx.storage_buffer("captured queries", (c.layers * per_layer * 4) as u64)?)
            }
            false => None,
        };
        // Every token of every layer (sliding layers included): an f16 set without windows
        // (the forward still gives each layer its window).
        let mut cache =
            Fp16CacheSet::for_model(ctx.clone(), self.spec(), tokens.len().max(1), DType::F16)?;
        self.model
            .forward_capturing(
                tokens,
                0,
                &mut cache,
                Logits::Last,
                sink.as_deref().map(|b| -> &wgpu::Buffer { b }),
            )
            .await?;
        let mut qs = Vec::new();
        if let Some(sink) = &sink {
            let bytes = ctx
                .read_bytes(sink, (c.layers * per_layer * 4) as u64)
                .await?;
            let all: &[f32] = bytemuck::cast_slice(&bytes);
            qs = all.chunks_exact(per_layer).map(<[f32]>::to_vec).collect();
        }
        let mut layers = Vec::with_capacity(c.layers);
        for l in 0..c.layers {
            let f = cache.fetch(l).await?;
            let ctx = self.model.context();
            layers.push(KvLayer {
                key: ctx.read_f32(&f.keys).await?,
                value: ctx.read_f32(&f.values).await?,
            });
        }
        let kv = KvFile {
            shape: TensorShape::new(&[1, c.kv_heads, tokens.len(), c.head_dim])?,
            dtype: FileDType::F16,
            layers,
        };
        Ok((kv, qs))
    }
}

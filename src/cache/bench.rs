//! Cache benchmark: decode steps and a prefill on a SmolLM2-shaped model, the XQuant set
//! against the plain f16 cache on the same device in the same run.

use std::sync::Arc;
use std::time::Instant;

use crate::cache::{CacheConfig, CacheSet, Fp16CacheSet, KvInput, ModelSpec};
use crate::config::DType;
use crate::error::Result;
use crate::gpu::{GpuContext, GpuTensor};

/// One measured context length.
#[derive(Clone, Debug)]
pub struct DecodeRow {
    /// Tokens in each layer's cache before the timed steps.
    pub context: usize,
    /// XQuant: milliseconds per decode step (one token appended to and fetched from every layer).
    pub xquant_ms: f64,
    /// f16 cache: the same.
    pub fp16_ms: f64,
    /// XQuant: GPU bytes of all layers per cached token.
    pub xquant_bytes_per_token: f64,
    /// f16 cache: the same (buffers grow by doubling, so capacity can exceed use).
    pub fp16_bytes_per_token: f64,
    /// XQuant: reference-accounted effective bits (window at 16 bits).
    pub effective_bits: f64,
}

/// A timed prefill.
#[derive(Clone, Debug)]
pub struct PrefillRow {
    /// Tokens per layer.
    pub tokens: usize,
    /// XQuant: milliseconds to append them to every layer and fetch.
    pub xquant_ms: f64,
    /// f16 cache: the same.
    pub fp16_ms: f64,
}

fn random_tokens(
    ctx: &GpuContext,
    model: &ModelSpec,
    tokens: usize,
    seed: u64,
) -> Result<GpuTensor> {
    let n = model.rows() * tokens * model.head_dim;
    let dims = [model.batch, model.kv_heads, tokens, model.head_dim];
    ctx.upload(
        &crate::synth::normal(n, seed),
        &dims,
        DType::F16,
        crate::ParamsPrecision::F16,
    )
}

/// The two caches under test, driven the same way.
enum Cache {
    XQuant(CacheSet),
    Fp16(Fp16CacheSet),
}

impl Cache {
    async fn step(&mut self, layer: usize, x: &GpuTensor, fetch: bool) -> Result<()> {
        let (k, v) = (KvInput::Gpu(x), KvInput::Gpu(x));
        match (self, fetch) {
            (Cache::XQuant(s), true) => s.update_and_fetch(layer, k, v).await.map(|_| ()),
            (Cache::XQuant(s), false) => s.append(layer, k, v).await,
            (Cache::Fp16(s), _) => s.update_and_fetch(layer, k, v).await.map(|_| ()),
        }
    }

    fn bytes(&self) -> u64 {
        match self {
            Cache::XQuant(s) => s.stats().allocated_bytes,
            Cache::Fp16(s) => s.allocated_bytes(),
        }
    }
}

/// Cache `0` (XQuant) or `1` (f16).
fn new_cache(
    ctx: &Arc<GpuContext>,
    model: ModelSpec,
    config: CacheConfig,
    which: usize,
) -> Result<Cache> {
    Ok(match which {
        0 => Cache::XQuant(CacheSet::for_model(ctx.clone(), model, config)?),
        _ => Cache::Fp16(Fp16CacheSet::for_model(
            ctx.clone(),
            model,
            config.max_ctx,
            config.output,
        )?),
    })
}

/// Decode-step timings at each context length (`steps` timed steps after a prefill to the
/// context), and a timed prefill of `prefill` tokens.
pub fn bench_cache(
    ctx: &Arc<GpuContext>,
    model: ModelSpec,
    config: CacheConfig,
    contexts: &[usize],
    steps: usize,
    prefill: usize,
) -> Result<(Vec<DecodeRow>, PrefillRow)> {
    let one = random_tokens(ctx, &model, 1, 2)?;
    let mut rows = Vec::new();
    for &context in contexts {
        let history = random_tokens(ctx, &model, context, 1)?;
        let mut ms = [0.0; 2];
        let mut per_token = [0.0; 2];
        let mut effective_bits = 16.0;
        for i in 0..2 {
            let mut cache = new_cache(ctx, model, config, i)?;
            for layer in 0..model.layers {
                pollster::block_on(cache.step(layer, &history, false))?;
            }
            per_token[i] = cache.bytes() as f64 / context as f64;
            // One untimed step (pipelines, scratch growth), then the timed ones.
            for layer in 0..model.layers {
                pollster::block_on(cache.step(layer, &one, true))?;
            }
            ctx.wait_idle()?;
            let start = Instant::now();
            for _ in 0..steps {
                for layer in 0..model.layers {
                    pollster::block_on(cache.step(layer, &one, true))?;
                }
            }
            ctx.wait_idle()?;
            ms[i] = start.elapsed().as_secs_f64() * 1e3 / steps.max(1) as f64;
            if let Cache::XQuant(s) = &cache {
                effective_bits = s.stats().effective_bits;
            }
        }
        rows.push(DecodeRow {
            context,
            xquant_ms: ms[0],
            fp16_ms: ms[1],
            xquant_bytes_per_token: per_token[0],
            fp16_bytes_per_token: per_token[1],
            effective_bits,
        });
    }
    let tokens = random_tokens(ctx, &model, prefill, 3)?;
    let mut ms = [0.0; 2];
    for (i, slot) in ms.iter_mut().enumerate() {
        // A throwaway set compiles the pipelines first.
        pollster::block_on(new_cache(ctx, model, config, i)?.step(0, &tokens, true))?;
        let mut cache = new_cache(ctx, model, config, i)?;
        ctx.wait_idle()?;
        let start = Instant::now();
        for layer in 0..model.layers {
            pollster::block_on(cache.step(layer, &tokens, true))?;
        }
        ctx.wait_idle()?;
        *slot = start.elapsed().as_secs_f64() * 1e3;
    }
    Ok((
        rows,
        PrefillRow {
            tokens: prefill,
            xquant_ms: ms[0],
            fp16_ms: ms[1],
        },
    ))
}

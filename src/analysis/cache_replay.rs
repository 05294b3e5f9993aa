//! `xquant analyze --prefill N`: replay a K/V dump through a [`CacheSet`] as a runtime would
//! (one prefill of N tokens, then one token at a time) and measure what it returns.

use serde_json::{json, Value};

use crate::cache::{
    CacheOptions, CachePlan, CacheSet, CacheStats, Inputs, KvCache, KvInput, ModelSpec,
};
use crate::config::KvKind;
use crate::error::{config_err, Result};
use crate::gpu::GpuContext;
use crate::kvfile::KvFile;

/// Per-layer findings of a replay.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheLayerReport {
    /// MSE of the fetched keys after the last step.
    pub recon_mse_key: f64,
    /// MSE of the fetched values after the last step.
    pub recon_mse_value: f64,
    /// Reference accounting, K + V (window at 16 bits).
    pub effective_bits: f64,
    /// Accounted bytes, K + V.
    pub accounted_bytes: u64,
    /// GPU bytes of the layer's cache, K + V.
    pub allocated_bytes: u64,
    /// Tokens in the f16 sinks.
    pub sink_tokens: usize,
}

/// A replay's findings.
#[derive(Clone, Debug)]
pub struct CacheReplay {
    /// Tokens fed as the prefill.
    pub prefill: usize,
    /// The plan the set followed.
    pub plan: CachePlan,
    /// The set's other options.
    pub options: CacheOptions,
    /// Per layer.
    pub layers: Vec<CacheLayerReport>,
    /// The set's accounting after the last step.
    pub stats: CacheStats,
}

impl CacheReplay {
    /// The `cache` object of a layer in `analyze --json`.
    pub fn layer_json(&self, layer: usize) -> Value {
        let l = &self.layers[layer];
        json!({
            "recon_mse_key": l.recon_mse_key,
            "recon_mse_value": l.recon_mse_value,
            "effective_bits": l.effective_bits,
            "accounted_bytes": l.accounted_bytes,
            "allocated_bytes": l.allocated_bytes,
            "sink_tokens": l.sink_tokens,
        })
    }

    /// The `cache` object of `totals` in `analyze --json`.
    pub fn totals_json(&self) -> Value {
        let n = self.layers.len().max(1) as f64;
        let s = &self.stats;
        json!({
            "prefill": self.prefill,
            "window": self.plan.window,
            "sinks": self.plan.sinks,
            "plan": self.plan.name,
            "decode_policy": self.options.decode_policy.name(),
            "recon_mse_key": self.layers.iter().map(|l| l.recon_mse_key).sum::<f64>() / n,
            "recon_mse_value": self.layers.iter().map(|l| l.recon_mse_value).sum::<f64>() / n,
            "effective_bits": s.effective_bits,
            "accounted_bytes": s.accounted_bytes,
            "allocated_bytes": s.allocated_bytes,
            "fp16_bytes": s.fp16_bytes,
            "ratio_vs_fp16": s.ratio_vs_fp16,
        })
    }
}

fn mse(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum::<f64>()
        / a.len().max(1) as f64
}

/// A cache set fed `kv` as a runtime would: tokens `[0, prefill)` as one call per layer,
/// then one token per call, layers in order each step.
pub async fn fill(
    ctx: &std::sync::Arc<GpuContext>,
    kv: &KvFile,
    plan: &CachePlan,
    options: CacheOptions,
    prefill: usize,
) -> Result<CacheSet> {
    let dims = kv.shape.dims();
    let (batch, heads, seq, dim) = (dims[0], dims[1], dims[2], dims[3]);
    if prefill == 0 || prefill > seq {
        return config_err!("--prefill must be in 1..={seq} (the file's tokens), got {prefill}");
    }
    let model = ModelSpec {
        layers: kv.layers.len(),
        kv_heads: heads,
        head_dim: dim,
        batch,
    };
    let mut set = CacheSet::for_plan(ctx.clone(), model, plan.clone(), options)?;
    // The prefill of every layer in one submission, then one token per call.
    let host: Vec<_> = (0..model.layers)
        .map(|l| {
            let k = kv.tokens(l, KvKind::Key, 0, prefill);
            (k, kv.tokens(l, KvKind::Value, 0, prefill))
        })
        .collect();
    let inputs = host
        .iter()
        .map(|(k, v)| {
            Inputs::prepare(
                ctx,
                &model,
                set.input_params(),
                KvInput::F32(k),
                KvInput::F32(v),
            )
        })
        .collect::<Result<Vec<_>>>()?;
    ctx.run("prefill", |enc| {
        for (layer, i) in inputs.iter().enumerate() {
            set.encode_append(enc, layer, i.keys.tensor(), i.values.tensor())?;
        }
        Ok(())
    })
    .await?;
    drop(inputs);
    let mut start = prefill;
    while start < seq {
        let end = start + 1;
        for layer in 0..model.layers {
            let k = kv.tokens(layer, KvKind::Key, start, end);
            let v = kv.tokens(layer, KvKind::Value, start, end);
            set.append(layer, KvInput::F32(&k), KvInput::F32(&v))
                .await?;
        }
        start = end;
    }
    Ok(set)
}

/// Feeds `kv` through a cache set ([`fill`]) and fetches every layer.
pub async fn replay(
    ctx: &std::sync::Arc<GpuContext>,
    kv: &KvFile,
    plan: &CachePlan,
    options: CacheOptions,
    prefill: usize,
) -> Result<CacheReplay> {
    let mut set = fill(ctx, kv, plan, options, prefill).await?;
    let model = *set.model();
    let stats = set.stats();
    let mut layers = Vec::with_capacity(model.layers);
    for (layer, s) in stats.layers.iter().enumerate() {
        let f = set.fetch(layer).await?;
        let k = ctx.read_f32(&f.keys).await?;
        let v = ctx.read_f32(&f.values).await?;
        layers.push(CacheLayerReport {
            recon_mse_key: mse(&k, &kv.layers[layer].key),
            recon_mse_value: mse(&v, &kv.layers[layer].value),
            effective_bits: s.effective_bits,
            accounted_bytes: s.accounted_bytes,
            allocated_bytes: s.allocated_bytes,
            sink_tokens: s.sink_tokens,
        });
    }
    Ok(CacheReplay {
        prefill,
        plan: plan.clone(),
        options,
        layers,
        stats,
    })
}

//! Decode speed of the model with the f16 cache and with XQuant, same device, same run.

use std::time::Instant;

use crate::cache::CacheConfig;
use crate::error::Result;
use crate::model::gpu::Logits;
use crate::model::runtime::{argmax, CacheChoice, Runtime};

/// One cache's decode figures.
#[derive(Clone, Debug)]
pub struct DecodeSpeed {
    /// `f16` or `xquant`.
    pub cache: &'static str,
    /// Tokens in the cache before the timed steps.
    pub context: usize,
    /// Decode tokens per second (mean over the timed steps).
    pub tokens_per_s: f64,
    /// GPU bytes of the cache's storage after the steps.
    pub kv_bytes: u64,
    /// `kv_bytes` per cached token.
    pub kv_bytes_per_token: f64,
}

/// Prefills `context` tokens (cycling `text`), then times `steps` greedy decode steps, with
/// the f16 cache and with `xquant`.
pub fn bench_decode(
    rt: &Runtime,
    text: &[u32],
    context: usize,
    steps: usize,
    xquant: CacheConfig,
) -> Result<Vec<DecodeSpeed>> {
    let prompt: Vec<u32> = text.iter().copied().cycle().take(context).collect();
    let mut out = Vec::new();
    for (name, choice) in [
        ("f16", CacheChoice::F16),
        ("xquant", CacheChoice::XQuant(xquant)),
    ] {
        let mut cache = rt.cache(choice, context + steps + 1)?;
        let logits =
            pollster::block_on(rt.model.forward(&prompt, 0, cache.as_mut(), Logits::Last))?;
        let mut next = argmax(&logits);
        rt.model.context().wait_idle()?;
        let start = Instant::now();
        for pos in context..context + steps {
            let logits =
                pollster::block_on(rt.model.forward(&[next], pos, cache.as_mut(), Logits::Last))?;
            next = argmax(&logits);
        }
        let secs = start.elapsed().as_secs_f64();
        let kv_bytes = cache.storage_bytes();
        out.push(DecodeSpeed {
            cache: name,
            context,
            tokens_per_s: steps as f64 / secs,
            kv_bytes,
            kv_bytes_per_token: kv_bytes as f64 / (context + steps) as f64,
        });
    }
    Ok(out)
}

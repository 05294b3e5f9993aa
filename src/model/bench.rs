//! Decode speed of the model with the f16 cache and with XQuant, same device, same run,
//! decode steps of the two interleaved.

use std::time::Instant;

use crate::cache::KvCache;
use crate::error::Result;
use crate::gpu::kernels::bench::median;
use crate::gpu::KernelTime;
use crate::model::gpu::Logits;
use crate::model::runtime::{argmax, CacheChoice, Runtime};

/// Decode figures at one context length.
#[derive(Clone, Debug)]
pub struct DecodeSpeed {
    /// Tokens in the caches before the timed steps.
    pub context: usize,
    /// XQuant: decode tokens per second (median step).
    pub xquant_tokens_per_s: f64,
    /// f16 cache: the same.
    pub fp16_tokens_per_s: f64,
    /// Median over steps of XQuant's speed / f16's (each pair of steps back to back).
    pub speed_ratio: f64,
    /// XQuant: prefill tokens per second (the context in one pass, logits of the last token).
    pub xquant_prefill_tokens_per_s: f64,
    /// f16 cache: the same.
    pub fp16_prefill_tokens_per_s: f64,
    /// XQuant: GPU bytes of the cache's storage after the steps.
    pub xquant_kv_bytes: u64,
    /// f16 cache: the same.
    pub fp16_kv_bytes: u64,
    /// XQuant: the set's scratch bytes (attention partials; no dense K/V).
    pub xquant_scratch_bytes: u64,
    /// Kernel launches of one decode step: XQuant, f16.
    pub launches: [u64; 2],
    /// With `profile`: GPU time of one more decode step by kernel, XQuant and f16.
    pub profile: Option<[Vec<KernelTime>; 2]>,
    /// With `profile`: GPU time of one more prefill of the context by kernel, XQuant and f16
    /// (into fresh caches, after the timed ones).
    pub prefill_profile: Option<[Vec<KernelTime>; 2]>,
}

/// GPU time by kernel of one greedy step at `pos` (the cache then holds it).
fn profile_step(
    rt: &Runtime,
    cache: &mut dyn KvCache,
    next: u32,
    pos: usize,
) -> Result<Vec<KernelTime>> {
    let (_, times) = rt.model.context().profiled(|| step(rt, cache, next, pos))?;
    Ok(times)
}

/// GPU time by kernel of a prefill of `prompt` into a fresh cache of `choice`.
fn profile_prefill(
    rt: &Runtime,
    choice: &CacheChoice,
    prompt: &[u32],
    max_ctx: usize,
) -> Result<Vec<KernelTime>> {
    let mut cache = rt.cache(choice, max_ctx)?;
    rt.model.context().wait_idle()?;
    let (_, times) = rt.model.context().profiled(|| {
        pollster::block_on(rt.model.forward(prompt, 0, cache.as_mut(), Logits::Last))
    })?;
    Ok(times)
}

/// One greedy decode step: runs `next` at `pos`, returns the next token and the seconds.
fn step(rt: &Runtime, cache: &mut dyn KvCache, next: u32, pos: usize) -> Result<(u32, f64)> {
    rt.model.context().wait_idle()?;
    let start = Instant::now();
    let logits = pollster::block_on(rt.model.forward(&[next], pos, cache, Logits::Last))?;
    Ok((argmax(&logits), start.elapsed().as_secs_f64()))
}

/// For each context: prefills it (cycling `text`) into an f16 cache and an XQuant cache,
/// then times `steps` greedy decode steps of each, alternating. `xquant` is the XQuant
/// cache (options or a plan). With `profile`, one more step and one more prefill of each are
/// timed launch by launch on the GPU.
pub fn bench_decode(
    rt: &Runtime,
    text: &[u32],
    contexts: &[usize],
    steps: usize,
    xquant: &CacheChoice,
    profile: bool,
) -> Result<Vec<DecodeSpeed>> {
    let mut out = Vec::new();
    for &context in contexts {
        let prompt: Vec<u32> = text.iter().copied().cycle().take(context).collect();
        let max_ctx = context + steps + 3;
        let mut xq = rt.cache(xquant, max_ctx)?;
        let mut f16 = rt.cache(&CacheChoice::F16, max_ctx)?;
        let mut next = [0u32; 2];
        let mut prefill = [0.0f64; 2];
        // Prefills in the order XQuant, f16, f16, XQuant (the second pair into spare caches),
        // each cache's time the mean of its two: on lavapipe the first prefill of a pair ran
        // 10-20% slower than the second whichever cache it filled.
        // An untimed prefill of the same prompt into throwaway caches of each kind first: a
        // kind's first pass creates its pipelines, seconds on a GPU driver (the XQuant
        // cache's first 512-token prefill read 0.07x the f16 cache's on an H200 for it).
        for choice in [xquant, &CacheChoice::F16] {
            let mut warm = rt.cache(choice, max_ctx)?;
            pollster::block_on(rt.model.forward(&prompt, 0, warm.as_mut(), Logits::Last))?;
        }
        let (mut xq_spare, mut f16_spare) = (
            rt.cache(xquant, max_ctx)?,
            rt.cache(&CacheChoice::F16, max_ctx)?,
        );
        let order: [(usize, &mut dyn KvCache); 4] = [
            (0, xq.as_mut()),
            (1, f16.as_mut()),
            (1, f16_spare.as_mut()),
            (0, xq_spare.as_mut()),
        ];
        for (k, (i, cache)) in order.into_iter().enumerate() {
            rt.model.context().wait_idle()?;
            let start = Instant::now();
            let logits = pollster::block_on(rt.model.forward(&prompt, 0, cache, Logits::Last))?;
            prefill[i] += start.elapsed().as_secs_f64() / 2.0;
            if k < 2 {
                next[i] = argmax(&logits);
            }
        }
        drop((xq_spare, f16_spare));
        // One untimed step each (pipelines; its launches counted), then the timed ones.
        let (mut tx, mut tf, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
        let mut launches = [0; 2];
        let ctx = rt.model.context();
        for s in 0..=steps {
            let pos = context + s;
            let before = ctx.launches_recorded();
            let (nx, sx) = step(rt, xq.as_mut(), next[0], pos)?;
            let between = ctx.launches_recorded();
            let (nf, sf) = step(rt, f16.as_mut(), next[1], pos)?;
            if s == 0 {
                launches = [between - before, ctx.launches_recorded() - between];
            }
            next = [nx, nf];
            if s > 0 {
                tx.push(sx);
                tf.push(sf);
                ratio.push(sf / sx);
            }
        }
        let step_profile = if profile {
            let pos = context + steps + 1;
            Some([
                profile_step(rt, xq.as_mut(), next[0], pos)?,
                profile_step(rt, f16.as_mut(), next[1], pos)?,
            ])
        } else {
            None
        };
        let prefill_profile = if profile {
            Some([
                profile_prefill(rt, xquant, &prompt, max_ctx)?,
                profile_prefill(rt, &CacheChoice::F16, &prompt, max_ctx)?,
            ])
        } else {
            None
        };
        out.push(DecodeSpeed {
            context,
            xquant_tokens_per_s: 1.0 / median(tx),
            fp16_tokens_per_s: 1.0 / median(tf),
            speed_ratio: median(ratio),
            xquant_prefill_tokens_per_s: context as f64 / prefill[0],
            fp16_prefill_tokens_per_s: context as f64 / prefill[1],
            xquant_kv_bytes: xq.storage_bytes(),
            fp16_kv_bytes: f16.storage_bytes(),
            xquant_scratch_bytes: xq.scratch_bytes(),
            launches,
            profile: step_profile,
            prefill_profile,
        });
    }
    Ok(out)
}

//! Fused split-K attention over the packed cache against dense attention over `fetch()`:
//! random configurations (every bit width, residuals, both value axes, η, windows, page
//! boundaries, GQA 1/3/4, 1–8 query tokens, contexts from one token to several pages).
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::attend::attention_trial;
use common::gpu::{assert_no_gpu_errors, block};
use xquant_wgpu::cache::{CacheConfig, CacheSet, Fp16CacheSet, KvCache, KvInput, ModelSpec};
use xquant_wgpu::DType;

/// Random trials run natively: every bit width twice, every residual width four times.
const TRIALS: u64 = 16;

#[test]
fn fused_attention_matches_dense_attention_over_fetch() {
    let ctx = gpu_or_skip!();
    let mut worst = 0.0f32;
    let mut calls = 0;
    for seed in 0..TRIALS {
        let r = block(attention_trial(&ctx, seed));
        eprintln!("{} calls, worst {:.2e}: {}", r.calls, r.worst, r.case);
        worst = worst.max(r.worst);
        calls += r.calls;
    }
    eprintln!("{TRIALS} trials, {calls} attention calls, worst relative difference {worst:.2e}");
    assert_no_gpu_errors(&ctx);
}

/// Allocated bytes of a set decoding through attention: storage plus scratch.
fn held(set: &dyn KvCache) -> u64 {
    set.storage_bytes() + set.scratch_bytes()
}

/// A decode step on both sets: one token appended to every layer, every layer attended.
fn step(
    sets: &mut [&mut dyn KvCache; 2],
    x: &[f32],
    q: &xquant_wgpu::gpu::GpuTensor,
    out: &xquant_wgpu::gpu::GpuTensor,
) {
    for set in sets.iter_mut() {
        for l in 0..set.model().layers {
            block(set.append(l, KvInput::F32(x), KvInput::F32(x))).unwrap();
            block(set.attend(l, q, out)).unwrap();
        }
    }
}

/// XQuant never holds more GPU memory than the f16 cache holding the same tokens (both
/// decoding through attention, scratch counted), at every token count from 1 up, for the
/// default (KIVI-2 + 4 f16 sinks), KIVI-2 without sinks and the reference's pairs: a short
/// context's sinks, block and window are one chunk written directly, as the f16 cache's whole
/// context is, so neither needs partials. Long prefills are checked the same way.
#[test]
fn xquant_never_allocates_more_than_the_f16_cache() {
    let ctx = gpu_or_skip!();
    let model = ModelSpec {
        layers: 2,
        kv_heads: 3,
        head_dim: 64,
        batch: 1,
    };
    let per_token = model.rows() * model.head_dim;
    let q = ctx
        .upload(
            &xquant_wgpu::synth::normal(9 * 64, 3),
            &[1, 9, 1, 64],
            DType::F32,
            Default::default(),
        )
        .unwrap();
    let out = ctx
        .upload(
            &vec![0.0; 9 * 64],
            &[1, 9, 1, 64],
            DType::F32,
            Default::default(),
        )
        .unwrap();
    let configs = [
        CacheConfig::default(),
        CacheConfig {
            sinks: 0,
            ..Default::default()
        },
        CacheConfig {
            quant: xquant_wgpu::XQuantConfig::default(),
            sinks: 0,
            ..Default::default()
        },
    ];
    for config in configs {
        let config = CacheConfig {
            max_ctx: 16384,
            ..config
        };
        let mut xq = CacheSet::for_model(ctx.clone(), model, config).unwrap();
        let mut f16 = Fp16CacheSet::for_model(ctx.clone(), model, 16384, DType::F16).unwrap();
        let x = xquant_wgpu::synth::normal(per_token, 5);
        for tokens in 1..=300 {
            step(&mut [&mut xq, &mut f16], &x, &q, &out);
            let (a, b) = (held(&xq), held(&f16));
            assert!(
                a <= b,
                "{config:?}: {tokens} tokens: XQuant {a} B (storage {}, scratch {}) > f16 {b} B",
                xq.storage_bytes(),
                xq.scratch_bytes()
            );
        }
        // Long prefills: every page and the ring as a long conversation holds them.
        for tokens in [1000, 4000] {
            let mut xq = CacheSet::for_model(ctx.clone(), model, config).unwrap();
            let mut f16 = Fp16CacheSet::for_model(ctx.clone(), model, 16384, DType::F16).unwrap();
            let x = xquant_wgpu::synth::normal(tokens * per_token, 6);
            for set in [&mut xq as &mut dyn KvCache, &mut f16] {
                for l in 0..2 {
                    block(set.append(l, KvInput::F32(&x), KvInput::F32(&x))).unwrap();
                    block(set.attend(l, &q, &out)).unwrap();
                }
            }
            let (a, b) = (held(&xq), held(&f16));
            assert!(
                a <= b,
                "{config:?}: {tokens} tokens: XQuant {a} B > f16 {b} B"
            );
            eprintln!(
                "{tokens} tokens: XQuant {a} B, f16 {b} B ({:.2})",
                a as f64 / b as f64
            );
        }
    }
    // A small token budget caps the f16 cache's growth at it (an exact fit): the window ring
    // stops there too, short of its window + 2 groups.
    let budget = 140;
    let config = CacheConfig {
        max_ctx: budget,
        ..Default::default()
    };
    let mut xq = CacheSet::for_model(ctx.clone(), model, config).unwrap();
    let mut f16 = Fp16CacheSet::for_model(ctx.clone(), model, budget, DType::F16).unwrap();
    let x = xquant_wgpu::synth::normal(per_token, 7);
    for tokens in 1..=budget {
        step(&mut [&mut xq, &mut f16], &x, &q, &out);
        let (a, b) = (held(&xq), held(&f16));
        assert!(
            a <= b,
            "budget {budget}: {tokens} tokens: XQuant {a} B > f16 {b} B"
        );
    }
    assert_no_gpu_errors(&ctx);
}

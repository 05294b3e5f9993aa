//! Fused split-K attention over the packed cache against dense attention over `fetch()`:
//! random configurations (every bit width, residuals, both value axes, η, windows, page
//! boundaries, GQA 1/3/4, 1–8 query tokens, contexts from one token to several pages).
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::attend::{
    attention_trial, dense, levels_attention_trial, plan_attention_trial, rotated_attention_trial,
    ATTEND_F32_REL,
};
use common::gpu::{assert_no_gpu_errors, block};
use std::sync::Arc;
use xquant_wgpu::cache::{
    AttendOptions, CacheConfig, CacheSet, Fp16CacheSet, KvCache, KvInput, ModelSpec,
};
use xquant_wgpu::gpu::{
    AttentionChunks, AttentionFill, AttentionWorkgroup, ContextOptions, GpuContext,
};
use xquant_wgpu::reference::AttentionShape;
use xquant_wgpu::DType;

/// Random trials run natively: every bit width twice, residual widths 0 (four times), 1, 2,
/// 3, 4, 5 and 8 (twice each).
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

/// A prefill's shape: hundreds of causal queries over a context of several chunks (512
/// tokens each), the queries ending at the last token or in the middle of the window ring,
/// on the f16 cache and on XQuant sets (sinks, quantized pages, a ring of one or several
/// chunks). Each query tile stops at the ring token of its newest query; the outputs must
/// still equal dense causal attention over `fetch()`, and the call's split-K partials are
/// not kept after it. On a CPU adapter's narrow workgroups a ring alone sums its values in
/// blocks of 16 channels, split over 2 threads for a head of 64 and over 1 for a head of 128.
#[test]
fn long_causal_attends_match_dense_attention() {
    let ctx = gpu_or_skip!();
    long_causal_attends(&ctx, 64);
    long_causal_attends(&ctx, 128);
}

/// The same on a context that launches attention as on a GPU, whatever the adapter here:
/// many chunks (128 tokens a workgroup for a decode query over 1100 tokens) and wide
/// workgroups (the default context here, lavapipe, has narrow ones).
#[test]
fn long_causal_attends_in_many_chunks_match_dense_attention() {
    let _ = gpu_or_skip!();
    let ctx = wide_context(AttentionChunks::Many);
    assert!(ctx.many_attention_chunks());
    long_causal_attends(&ctx, 64);
}

/// The same on wide workgroups with the fewest chunks (as here: two of about 550 tokens over
/// 1100): launches of several chunks split a channel block's tokens over 8 value-phase
/// threads for a head of 64 channels, 4 for one of 128 (the narrow workgroups here over 2
/// and 1, many chunks of 128 tokens over 2 in blocks of 4 channels), and the ring's blocks
/// over 2.
#[test]
fn long_causal_attends_on_wide_workgroups_match_dense_attention() {
    let _ = gpu_or_skip!();
    let ctx = wide_context(AttentionChunks::Fewest);
    long_causal_attends(&ctx, 64);
    long_causal_attends(&ctx, 128);
}

/// Short launches spread over every thread of the workgroup (`AttentionFill::Workgroup`) on a
/// context that launches attention as on a GPU: 128-token chunks of 32-thread workgroups
/// score runs of 4 tokens, a launch of one chunk of 256 tokens runs of 8, and value blocks
/// split their tokens over threads in launches of one chunk and for values grouped along
/// tokens, in both caches.
///
/// The long prefill and decode calls above, and the first eight random trials of
/// `fused_attention_matches_dense_attention_over_fetch` (each bit width once, residuals of 0,
/// 1, 2 and 4 bits, both value axes), against dense attention over `fetch()`.
#[test]
fn launches_that_fill_the_workgroup_match_dense_attention() {
    let _ = gpu_or_skip!();
    let options = ContextOptions {
        attention_chunks: AttentionChunks::Many,
        attention_workgroup: AttentionWorkgroup::Wide,
        attention_fill: AttentionFill::Workgroup,
        ..Default::default()
    };
    let ctx = context_with(options, 32);
    assert!(ctx.fills_attention_workgroup());
    long_causal_attends(&ctx, 64);
    let mut worst = 0.0f32;
    for seed in 0..8 {
        let r = block(attention_trial(&ctx, seed));
        eprintln!("{} calls, worst {:.2e}: {}", r.calls, r.worst, r.case);
        worst = worst.max(r.worst);
    }
    eprintln!("launches that fill the workgroup: worst relative difference {worst:.2e}");
    assert_no_gpu_errors(&ctx);
}

/// A second context with wide (32-invocation) attention workgroups and `chunks`.
fn wide_context(chunks: AttentionChunks) -> Arc<GpuContext> {
    attention_context(AttentionWorkgroup::Wide, chunks, 32)
}

/// A second context with `workgroup` attention workgroups (of `size` invocations) and
/// `chunks`, whatever the adapter.
fn attention_context(
    workgroup: AttentionWorkgroup,
    chunks: AttentionChunks,
    size: u32,
) -> Arc<GpuContext> {
    context_with(
        ContextOptions {
            attention_chunks: chunks,
            attention_workgroup: workgroup,
            ..Default::default()
        },
        size,
    )
}

/// A second context with `options`, whose attention workgroups have `size` invocations.
fn context_with(options: ContextOptions, size: u32) -> Arc<GpuContext> {
    let ctx = Arc::new(block(GpuContext::new(&options)).expect("a second context"));
    assert_eq!(ctx.attention_workgroup_size(), size);
    ctx
}

/// Two layers (with `layers_per_group: 2`, an anchor and its reuse layer) of one KV head.
fn anchor_and_reuse_layer(head_dim: usize) -> ModelSpec {
    ModelSpec {
        layers: 2,
        kv_heads: 1,
        head_dim,
        batch: 1,
    }
}

/// A cache set of `model` (f32 output, no sinks) holding `x` as every layer's keys and
/// values.
fn filled_set(
    ctx: &Arc<GpuContext>,
    model: ModelSpec,
    quant: xquant_wgpu::XQuantConfig,
    window: usize,
    x: &[f32],
) -> CacheSet {
    let config = CacheConfig {
        quant,
        window,
        sinks: 0,
        output: DType::F32,
        ..Default::default()
    };
    let mut set = CacheSet::for_model(ctx.clone(), model, config).unwrap();
    for l in 0..model.layers {
        block(set.append(l, KvInput::F32(x), KvInput::F32(x))).unwrap();
    }
    set
}

fn long_causal_attends(ctx: &Arc<GpuContext>, head_dim: usize) {
    let model = ModelSpec {
        layers: 1,
        kv_heads: 2,
        head_dim,
        batch: 1,
    };
    let (len, gqa) = (1100, 3);
    let q_heads = model.kv_heads * gqa;
    let x = xquant_wgpu::synth::normal(len * model.rows() * model.head_dim, 8);
    let f32_out = |config: CacheConfig| CacheConfig {
        max_ctx: 2048,
        output: DType::F32,
        ..config
    };
    let mut sets: Vec<(&str, Box<dyn KvCache>)> = vec![
        (
            "f16 cache",
            Box::new(Fp16CacheSet::for_model(ctx.clone(), model, 2048, DType::F32).unwrap()),
        ),
        (
            "default",
            Box::new(CacheSet::for_model(ctx.clone(), model, f32_out(Default::default())).unwrap()),
        ),
        (
            "window 1024",
            Box::new(
                CacheSet::for_model(
                    ctx.clone(),
                    model,
                    f32_out(CacheConfig {
                        window: 1024,
                        ..Default::default()
                    }),
                )
                .unwrap(),
            ),
        ),
    ];
    // (query tokens, position of the first query)
    let calls = [
        (len, 0),
        (301, len - 301),
        (257, 601),
        (5, 1000),
        (1, len - 1),
    ];
    for (what, set) in sets.iter_mut() {
        block(set.append(0, KvInput::F32(&x), KvInput::F32(&x))).unwrap();
        for (i, &(t, pos0)) in calls.iter().enumerate() {
            let call = Queries::new(ctx, q_heads, t, model.head_dim, 20 + i as u64);
            call.attend(set.as_mut(), 0, pos0);
            if i == 0 {
                // Nothing fetched yet: the only scratch would be the split-K partials of
                // this prefill-sized call, which are not kept.
                assert_eq!(
                    set.scratch_bytes(),
                    0,
                    "{what}: scratch kept after {t} queries"
                );
            }
            let worst = call.worst_against_dense(ctx, set.as_mut(), 0, len, pos0);
            assert!(
                worst <= ATTEND_F32_REL,
                "{what}: {t} queries from position {pos0} over {len} tokens: \
                 worst relative difference {worst:e} > {ATTEND_F32_REL:e}"
            );
        }
    }
    assert_no_gpu_errors(ctx);
}

/// A reuse layer with 2-bit codes (a key-phase thread scores runs of 16 tokens) and residuals
/// of 3, 5 and 8 bits, keys and values grouped along tokens: a run's residual codes fill two
/// words with a shift (3 bits) or span three and more (5, 8), each read its own way in both
/// phases. Head dim 64 reads 4 channels' params and code words a load, 30 a channel's at a
/// time. Decode and short prefill queries against dense attention over `fetch()`.
#[test]
fn wide_residuals_in_runs_of_16_tokens_match_dense_attention() {
    let ctx = gpu_or_skip!();
    let (len, gqa) = (300, 3);
    for (head_dim, residual_bits) in [(64, 3), (64, 5), (64, 8), (30, 3), (30, 5)] {
        let model = anchor_and_reuse_layer(head_dim);
        let q_heads = model.kv_heads * gqa;
        let x = xquant_wgpu::synth::normal(len * model.rows() * model.head_dim, 5);
        let quant = xquant_wgpu::XQuantConfig {
            layers_per_group: 2,
            base_bits: 2,
            residual_bits,
            group_quant_size: 32,
            value_axis: xquant_wgpu::ValueAxis::Tokens,
            ..xquant_wgpu::XQuantConfig::default()
        };
        let mut set = filled_set(&ctx, model, quant, 32, &x);
        let what = format!("head dim {head_dim}, {residual_bits}-bit residual");
        decode_and_prefill_match_dense(&ctx, &mut set, 1, len, q_heads, 7, &what);
    }
    assert_no_gpu_errors(&ctx);
}

/// Values per token in blocks of 8 channels a value-phase thread (head dims from 64 on, in a
/// launch of one chunk), which sum the window ring's values 8 channels a walk over its tokens:
/// at head dims that are not a multiple of 8 (66, 68) a token's words are read one at a time,
/// the last block's past the row clamped to its last word (and those channels not written).
/// Anchors with 2- and 4-bit values in groups of 32 and 64 channels, a block and the ring
/// (window 64) in one dispatch; decode and short prefill queries against dense attention
/// over `fetch()`.
#[test]
fn ring_values_in_blocks_of_8_channels_match_dense_attention() {
    let ctx = gpu_or_skip!();
    let (len, gqa) = (300, 3);
    for (head_dim, bits, group) in [(66, 2, 32), (68, 4, 64), (68, 2, 32)] {
        let model = ModelSpec {
            layers: 1,
            kv_heads: 2,
            head_dim,
            batch: 1,
        };
        let q_heads = model.kv_heads * gqa;
        let x = xquant_wgpu::synth::normal(len * model.rows() * model.head_dim, 13);
        let quant = xquant_wgpu::XQuantConfig {
            layers_per_group: 1,
            base_bits: bits,
            group_quant_size: group,
            value_axis: xquant_wgpu::ValueAxis::Channels,
            ..xquant_wgpu::XQuantConfig::default()
        };
        let mut set = filled_set(&ctx, model, quant, 64, &x);
        let what = format!("head dim {head_dim}, {bits}-bit values in groups of {group}");
        decode_and_prefill_match_dense(&ctx, &mut set, 0, len, q_heads, 3, &what);
    }
    assert_no_gpu_errors(&ctx);
}

/// Narrow workgroups (8 invocations) whose chunk holds 512 quantized tokens or more score
/// their keys in pairs of runs (32 tokens a walk over the channels; `block_pair_scores`):
/// every code width a pair's words hold (1–4 bits; anchors), residuals of 1–4 bits on reuse
/// layers' 1- and 2-bit keys, keys in groups of 32 and 64 tokens, a decode query over 600
/// tokens, on any adapter, against dense attention over `fetch()`.
#[test]
fn key_runs_in_pairs_match_dense_attention() {
    let _ = gpu_or_skip!();
    let ctx = attention_context(AttentionWorkgroup::Narrow, AttentionChunks::Fewest, 8);
    // One chunk (DIRECT) whose block of 512-544 tokens (whole groups) is paired.
    let (len, gqa) = (600, 3);
    // Keys with a residual pair where their base codes take 1 or 2 bits (a run of 3- or 4-bit
    // keys with a residual spans more than a word: runs of 8 tokens). Head dim 32 reads 4
    // channels' params and code words a load; 30, a channel's at a time.
    let quads = [(1, 3, 32), (2, 4, 64), (2, 1, 32), (3, 2, 32), (4, 2, 64)];
    let words = [(2, 4, 64), (3, 2, 32)];
    let shapes = [(32, &quads[..]), (30, &words[..])];
    for (head_dim, cases) in shapes {
        let model = anchor_and_reuse_layer(head_dim);
        let q_heads = model.kv_heads * gqa;
        let x = xquant_wgpu::synth::normal(len * model.rows() * model.head_dim, 11);
        for &(base_bits, residual_bits, group) in cases {
            let quant = xquant_wgpu::XQuantConfig {
                layers_per_group: 2,
                base_bits,
                residual_bits,
                group_quant_size: group,
                // Values per token: wide values along tokens would shorten the key runs.
                value_axis: xquant_wgpu::ValueAxis::Channels,
                ..xquant_wgpu::XQuantConfig::default()
            };
            let mut set = filled_set(&ctx, model, quant, group, &x);
            for layer in 0..model.layers {
                let pos0 = len - 1;
                let call = Queries::new(&ctx, q_heads, 1, model.head_dim, 31);
                let what = format!(
                    "head dim {head_dim}, {base_bits}-bit keys in groups of {group}, layer \
                     {layer} (residual {residual_bits} bits on the reuse layer)"
                );
                call.assert_matches_dense(&ctx, &mut set, layer, len, pos0, &what);
            }
        }
    }
    assert_no_gpu_errors(&ctx);
}

/// A decode query at the last of layer `layer`'s `len` tokens and a 5-token prefill ending
/// there (queries seeded `seed` + their count), each against dense attention over `fetch()`.
fn decode_and_prefill_match_dense(
    ctx: &GpuContext,
    set: &mut dyn KvCache,
    layer: usize,
    len: usize,
    q_heads: usize,
    seed: u64,
    what: &str,
) {
    for t in [1, 5] {
        let call = Queries::new(ctx, q_heads, t, set.model().head_dim, seed + t as u64);
        call.assert_matches_dense(ctx, set, layer, len, len - t, what);
    }
}

/// One attention call's random queries (`[1, q_heads, t, dim]`, f32) and its f32 output.
struct Queries {
    q: Vec<f32>,
    queries: xquant_wgpu::gpu::GpuTensor,
    out: xquant_wgpu::gpu::GpuTensor,
    q_heads: usize,
    t: usize,
}

impl Queries {
    fn new(
        ctx: &xquant_wgpu::gpu::GpuContext,
        q_heads: usize,
        t: usize,
        dim: usize,
        seed: u64,
    ) -> Self {
        let n = q_heads * t * dim;
        let q = xquant_wgpu::synth::normal(n, seed);
        let dims = [1, q_heads, t, dim];
        let queries = ctx
            .upload(&q, &dims, DType::F32, Default::default())
            .unwrap();
        let out = ctx
            .upload(&vec![0.0; n], &dims, DType::F32, Default::default())
            .unwrap();
        Queries {
            q,
            queries,
            out,
            q_heads,
            t,
        }
    }

    /// Attends layer `layer` of `set` with the first query at position `pos0`.
    fn attend(&self, set: &mut dyn KvCache, layer: usize, pos0: usize) {
        let options = AttendOptions {
            pos0: Some(pos0),
            ..Default::default()
        };
        block(set.attend_with(layer, &self.queries, &self.out, options)).unwrap();
    }

    /// Attends layer `layer` of `set` (the first query at position `pos0`) and asserts the
    /// output is dense causal attention over `fetch()` of its `len` tokens within
    /// [`ATTEND_F32_REL`]; `what` names the case in the failure.
    fn assert_matches_dense(
        &self,
        ctx: &xquant_wgpu::gpu::GpuContext,
        set: &mut dyn KvCache,
        layer: usize,
        len: usize,
        pos0: usize,
        what: &str,
    ) {
        self.attend(set, layer, pos0);
        let worst = self.worst_against_dense(ctx, set, layer, len, pos0);
        assert!(
            worst <= ATTEND_F32_REL,
            "{what}, {} queries from position {pos0}: worst relative difference {worst:e} > \
             {ATTEND_F32_REL:e}",
            self.t
        );
    }

    /// The worst difference of the output from dense causal attention over `fetch()` of
    /// the layer's `len` tokens, relative to the largest value.
    fn worst_against_dense(
        &self,
        ctx: &xquant_wgpu::gpu::GpuContext,
        set: &mut dyn KvCache,
        layer: usize,
        len: usize,
        pos0: usize,
    ) -> f32 {
        let got = block(ctx.read_f32(&self.out)).unwrap();
        let model = *set.model();
        let shape = AttentionShape {
            batch: 1,
            q_heads: self.q_heads,
            kv_heads: model.kv_heads,
            q_tokens: self.t,
            kv_tokens: len,
            dim: model.head_dim,
        };
        let (want, vmax) = block(dense(set, layer, &self.q, shape, pos0));
        got.iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs() / vmax)
            .fold(0.0f32, f32::max)
    }
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
/// default (kivi-lloyd + 4 f16 sinks) with and without sinks, KIVI-2 + 4 sinks and the
/// reference's pairs: a short context's sinks, block and window are one chunk written
/// directly, as the f16 cache's whole context is, so neither needs partials. Long prefills
/// are checked the same way.
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
            quant: xquant_wgpu::cache::KIVI_2,
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

/// Rotated plans (keys, values, both or neither rotated per layer; sinks, windows, borrowed
/// codes and residuals): fused attention over the rotated cache equals dense attention over
/// its `fetch()`, which returns the K/V un-rotated.
#[test]
fn rotated_caches_attend_like_dense_attention_over_fetch() {
    let ctx = gpu_or_skip!();
    let mut worst = 0.0f32;
    for seed in 0..6 {
        let r = block(rotated_attention_trial(&ctx, seed));
        eprintln!("{} calls, worst {:.2e}: {}", r.calls, r.worst, r.case);
        assert!(
            r.case.contains("\"hadamard\""),
            "seed {seed} rotated nothing"
        );
        worst = worst.max(r.worst);
    }
    eprintln!("rotated plans: worst relative difference {worst:.2e}");
    assert_no_gpu_errors(&ctx);
}

/// Fused attention over Lloyd–Max caches (every entry per-token Lloyd–Max codes of 1..=4
/// bits, rotated or not, f16 and f32 norms, with sinks and windows) equals dense attention
/// over their `fetch()`.
#[test]
fn lloyd_max_caches_attend_like_dense_attention_over_fetch() {
    let ctx = gpu_or_skip!();
    let mut worst = 0.0f32;
    for seed in 0..2 {
        let r = block(levels_attention_trial(&ctx, seed));
        eprintln!("{} calls, worst {:.2e}: {}", r.calls, r.worst, r.case);
        assert!(
            r.case.contains("\"lloyd-max\""),
            "seed {seed}: no Lloyd-Max entry"
        );
        worst = worst.max(r.worst);
    }
    eprintln!("Lloyd-Max plans: worst relative difference {worst:.2e}");
    assert_no_gpu_errors(&ctx);
}

/// Rotated Lloyd–Max codes of several groups a token (each group its own norm), of the
/// widths whose fetch decodes and rotates back a token in one launch (1, 2 and 4 bits) and
/// of one that decodes first and rotates in place (3 bits), with sinks and a window, f16 and
/// f32 norms: fused attention equals dense attention over `fetch()`, f32 and f16 outputs.
#[test]
fn rotated_lloyd_max_groups_fetch_like_they_attend() {
    use xquant_wgpu::cache::{CachePlan, Rotation, TensorPlan};
    use xquant_wgpu::{Levels, ParamsPrecision, ValueAxis};
    let ctx = gpu_or_skip!();
    let lloyd = |bits: u8| TensorPlan {
        levels: Levels::LloydMax,
        rotation: Rotation::Hadamard,
        ..TensorPlan::own(bits, ValueAxis::Channels)
    };
    for (i, (head_dim, group, keys, values, output, params)) in [
        (64, 16, 4, 2, DType::F32, ParamsPrecision::F16),
        (32, 8, 3, 4, DType::F16, ParamsPrecision::F32),
        (64, 32, 2, 1, DType::F16, ParamsPrecision::F16),
    ]
    .into_iter()
    .enumerate()
    {
        let model = ModelSpec {
            layers: 2,
            kv_heads: 2,
            head_dim,
            batch: 1,
        };
        let mut plan = CachePlan::preset("kivi-2", model.layers).unwrap();
        plan.group_quant_size = group;
        plan.window = group;
        plan.sinks = 3;
        plan.params = params;
        for l in &mut plan.layers {
            l.key = lloyd(keys);
            l.value = lloyd(values);
        }
        let r = block(plan_attention_trial(&ctx, model, plan, output, i as u64));
        eprintln!("{} calls, worst {:.2e}: {}", r.calls, r.worst, r.case);
        assert!(r.calls > 0, "{}: nothing compared", r.case);
    }
    assert_no_gpu_errors(&ctx);
}

/// A rotated 8-bit cache gives back, from `fetch()`, what was appended (the window and sinks
/// to f16 rounding, quantized tokens to 8-bit error), and attends like the f16 cache: the
/// rotation is undone on the way out, not only consistent inside. 1100 tokens: attention in
/// several chunks, so the rotated output is merged by `combine`; 100 tokens: one chunk
/// writes it.
#[test]
fn a_rotated_cache_returns_and_attends_to_the_original_tensors() {
    let ctx = gpu_or_skip!();
    // A head dim that is not a power of two cannot be rotated: a ConfigError naming it.
    let odd = ModelSpec {
        layers: 2,
        kv_heads: 2,
        head_dim: 48,
        batch: 1,
    };
    let options = CacheConfig::default().options();
    match CacheSet::for_plan(ctx.clone(), odd, rotated_plan(64), options) {
        Err(xquant_wgpu::XqError::Config(m)) => assert!(m.contains("power of two"), "{m}"),
        other => panic!("expected a ConfigError, got {:?}", other.err()),
    }
    // Every pass structure of the output's inverse rotation: head dims whose stages pair up
    // (4, 64, 256) or leave one (2, 128), through `combine` (1100 tokens) and written
    // directly by one chunk (100 tokens).
    for (head_dim, tokens) in [
        (64, 1100),
        (128, 1100),
        (128, 100),
        (256, 100),
        (4, 100),
        (2, 100),
    ] {
        rotated_cache_round_trip(&ctx, head_dim, tokens);
    }
    assert_no_gpu_errors(&ctx);
}

/// Two layers of 8-bit codes grouped per token (groups of at most the head dim), window 32
/// and 4 sinks; layer 0 rotates its keys and values, layer 1 its values only.
fn rotated_plan(head_dim: usize) -> xquant_wgpu::cache::CachePlan {
    use xquant_wgpu::cache::{CachePlan, Rotation};
    use xquant_wgpu::ValueAxis;
    let mut plan = CachePlan::preset("kivi-2", 2).unwrap();
    plan.group_quant_size = plan.group_quant_size.min(head_dim);
    plan.window = 32;
    plan.sinks = 4;
    for l in &mut plan.layers {
        for e in [&mut l.key, &mut l.value] {
            e.bits = 8;
            e.axis = ValueAxis::Channels;
            e.rotation = Rotation::Hadamard;
        }
    }
    plan.layers[1].key.rotation = Rotation::None;
    plan
}

fn rotated_cache_round_trip(
    ctx: &std::sync::Arc<xquant_wgpu::gpu::GpuContext>,
    head_dim: usize,
    tokens: usize,
) {
    let model = ModelSpec {
        layers: 2,
        kv_heads: 2,
        head_dim,
        batch: 1,
    };
    let options = CacheConfig::default().options();
    let mut set = CacheSet::for_plan(ctx.clone(), model, rotated_plan(head_dim), options).unwrap();
    let mut f16 = Fp16CacheSet::for_model(ctx.clone(), model, 4096, DType::F32).unwrap();
    let mut g = xquant_wgpu::synth::SplitMix::new(3);
    let n = model.rows() * tokens * model.head_dim;
    // Channel 5 an outlier, as real keys have.
    let x = |g: &mut xquant_wgpu::synth::SplitMix| -> Vec<f32> {
        (0..n)
            .map(|i| g.normal() * if i % head_dim == 5 { 8.0 } else { 1.0 })
            .collect()
    };
    for layer in 0..model.layers {
        let (k, v) = (x(&mut g), x(&mut g));
        block(set.append(layer, KvInput::F32(&k), KvInput::F32(&v))).unwrap();
        block(f16.append(layer, KvInput::F32(&k), KvInput::F32(&v))).unwrap();
        let fetched = block(set.fetch(layer)).unwrap();
        for (input, t) in [(&k, &fetched.keys), (&v, &fetched.values)] {
            let got = block(set.read(t)).unwrap();
            let peak = input.iter().fold(0.0f32, |a, b| a.max(b.abs()));
            let worst = got
                .iter()
                .zip(input.iter())
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            // 8-bit codes of rotated tokens: a step is about 1/50 of a token's range.
            assert!(
                worst <= 0.05 * peak,
                "D {head_dim}, {tokens} tokens, layer {layer}: fetch off by {worst} (peak {peak})"
            );
        }
        let q: Vec<f32> = (0..model.rows() * 3 * 4 * model.head_dim)
            .map(|_| g.normal())
            .collect();
        let qdims = [1, model.kv_heads * 3, 4, model.head_dim];
        let queries = ctx
            .upload(&q, &qdims, DType::F32, xquant_wgpu::ParamsPrecision::F32)
            .unwrap();
        let mut outs = Vec::new();
        for cache in [&mut set as &mut dyn KvCache, &mut f16] {
            let out = ctx
                .upload(
                    &vec![0.0; q.len()],
                    &qdims,
                    DType::F32,
                    xquant_wgpu::ParamsPrecision::F32,
                )
                .unwrap();
            block(cache.attend(layer, &queries, &out)).unwrap();
            outs.push(block(ctx.read_f32(&out)).unwrap());
        }
        let peak = outs[1].iter().fold(0.0f32, |a, b| a.max(b.abs()));
        let worst = outs[0]
            .iter()
            .zip(&outs[1])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst <= 0.05 * peak,
            "D {head_dim}, {tokens} tokens, layer {layer}: attention off by {worst} (peak {peak})"
        );
    }
}

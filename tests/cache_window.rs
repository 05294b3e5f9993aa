//! The cache set with the window policy: against the CPU model, accounting, fallback,
//! budgets, GPU inputs, long decode.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use std::sync::Arc;

use common::cache_model::*;
use common::gpu::{assert_no_gpu_errors, block};
use xquant_wgpu::cache::{
    CacheConfig, CacheOptions, CachePlan, CacheSet, CodeSource, DecodePolicy, Fp16CacheSet,
    KvCache, KvInput, LayerPlan, ModelSpec, Rotation, TensorPlan, DEFAULT_ROTATION_SEED,
};
use xquant_wgpu::gpu::{ContextOptions, GpuContext, GpuTensor};
use xquant_wgpu::reference::Role;
use xquant_wgpu::synth::SplitMix;
use xquant_wgpu::{DType, KvKind, Levels, ParamsPrecision, ValueAxis, XQuantConfig};

fn normal(g: &mut SplitMix, n: usize) -> Vec<f32> {
    (0..n).map(|_| g.normal()).collect()
}

/// `data` as an f32 tensor of shape `dims` on the GPU.
fn upload_f32(ctx: &GpuContext, data: &[f32], dims: &[usize]) -> GpuTensor {
    ctx.upload(data, dims, DType::F32, ParamsPrecision::F32)
        .unwrap()
}

/// Feeds every layer the same call sizes (layer l's data: a noisy copy of layer l-1's) and
/// checks every fetch against the CPU model. Returns the set.
fn run_against_model(
    ctx: &Arc<GpuContext>,
    model: ModelSpec,
    config: CacheConfig,
    steps: &[usize],
    seed: u64,
) -> CacheSet {
    let plan = config.plan(model.layers, model.head_dim).unwrap();
    run_plan_against_model(ctx, model, plan, config.options(), steps, seed)
}

/// [`run_against_model`] for a set built from a plan: every layer's keys and values against
/// the CPU model of their own plan entry (sinks f16, own or borrowed codes, the window).
fn run_plan_against_model(
    ctx: &Arc<GpuContext>,
    model: ModelSpec,
    plan: CachePlan,
    options: CacheOptions,
    steps: &[usize],
    seed: u64,
) -> CacheSet {
    let mut set = CacheSet::for_plan(ctx.clone(), model, plan.clone(), options).unwrap();
    let (rows, dim) = (model.rows(), model.head_dim);
    let mut g = SplitMix::new(seed);
    let mut seqs: Vec<[LayerSeq; 2]> = (0..model.layers)
        .map(|_| [LayerSeq::new(rows, dim), LayerSeq::new(rows, dim)])
        .collect();
    for (s, &t) in steps.iter().enumerate() {
        let n = rows * t * dim;
        let (mut k, mut v) = (normal(&mut g, n), normal(&mut g, n));
        for l in 0..model.layers {
            if l > 0 {
                k = k.iter().map(|x| 0.8 * x + 0.4 * g.normal()).collect();
                v = v.iter().map(|x| 0.8 * x + 0.4 * g.normal()).collect();
            }
            seqs[l][0].push(&k);
            seqs[l][1].push(&v);
            let f = block(set.update_and_fetch(l, KvInput::F32(&k), KvInput::F32(&v))).unwrap();
            let len = seqs[l][0].len;
            assert_eq!(
                f.keys.shape().dims(),
                [model.batch, model.kv_heads, len, dim]
            );
            let q = plan.quantized_tokens(len);
            for (kind, got) in [(KvKind::Key, &f.keys), (KvKind::Value, &f.values)] {
                let i = kind as usize;
                let e = plan.layers[l].get(kind);
                let anchor = match e.codes {
                    CodeSource::Layer(a) => Some(&seqs[a][i]),
                    CodeSource::Own => None,
                };
                let want = expected_with_sinks(
                    &seqs[l][i],
                    anchor,
                    plan.sinks,
                    q,
                    &e.spec(plan.group_quant_size, plan.params),
                    e.residual_bits,
                    options.output,
                );
                let got = block(ctx.read_f32(got)).unwrap();
                assert_matches_model(
                    &format!("step {s} (+{t}) layer {l} {kind:?}"),
                    &got,
                    &want,
                    0,
                );
            }
        }
    }
    assert_no_gpu_errors(ctx);
    set
}

fn steps() -> Vec<usize> {
    // A prefill, single tokens across window flushes and a page boundary, then chunks.
    let mut s = vec![37];
    s.extend(std::iter::repeat_n(1, 20));
    s.extend([5, 1, 13]);
    s
}

#[test]
fn window_policy_matches_the_cpu_model() {
    let ctx = gpu_or_skip!();
    let model = ModelSpec {
        layers: 2,
        kv_heads: 2,
        head_dim: 16,
        batch: 1,
    };
    let config = CacheConfig {
        quant: XQuantConfig {
            group_quant_size: 8,
            ..Default::default()
        },
        window: 16,
        page_tokens: 24,
        output: DType::F32,
        ..Default::default()
    };
    let set = run_against_model(&ctx, model, config, &steps(), 1);
    // The reuse layer shared every group: it is charged as reuse (params + 4-bit residual).
    let st = set.stats();
    assert!(st.layers[1].key.effective_bits > st.layers[0].key.effective_bits);
}

#[test]
fn mixed_plan_with_sinks_matches_the_cpu_model() {
    let ctx = gpu_or_skip!();
    let model = ModelSpec {
        layers: 4,
        kv_heads: 2,
        head_dim: 16,
        batch: 1,
    };
    let (t, c) = (ValueAxis::Tokens, ValueAxis::Channels);
    let own = TensorPlan::own;
    let borrow = |src, from: TensorPlan, residual_bits| TensorPlan {
        codes: CodeSource::Layer(src),
        residual_bits,
        ..from
    };
    let k0 = TensorPlan {
        eta: 1.0 / 6.0,
        ..own(3, t)
    };
    let v0 = own(2, c);
    let v1 = own(4, t);
    let plan = CachePlan {
        name: "mixed".into(),
        layers: vec![
            LayerPlan::new(k0, v0),
            LayerPlan {
                key: borrow(0, k0, 2),
                value: v1,
                attention_window: None,
            },
            LayerPlan {
                key: own(1, c),
                value: borrow(0, v0, 0),
                attention_window: None,
            },
            LayerPlan {
                key: borrow(0, k0, 0),
                value: borrow(1, v1, 4),
                attention_window: None,
            },
        ],
        window: 16,
        sinks: 5,
        group_quant_size: 8,
        params: ParamsPrecision::F16,
        rotation_seed: DEFAULT_ROTATION_SEED,
    };
    let options = CacheOptions {
        page_tokens: 24,
        output: DType::F32,
        ..Default::default()
    };
    let set = run_plan_against_model(&ctx, model, plan, options, &steps(), 7);
    let st = set.stats();
    assert_eq!(st.layers[3].sink_tokens, 5);
    // Layer 3's keys borrow without a residual: params only, below layer 0's own codes.
    assert!(st.layers[3].key.effective_bits < st.layers[0].key.effective_bits);
    assert_eq!(st.layers[2].value.codes, CodeSource::Layer(0));
}

/// Lloyd–Max entries (per-token norms and level codes) next to uniform ones and borrowed
/// codes, with sinks: every fetch equals the CPU model. Groups of 8 in head dim 16 (f16
/// norms, pages growing 8 → 16 → 24 tokens), then groups of 3 in head dim 15 with pages of
/// odd token counts (a row's last f16 norm pads its word; growth copies half-filled words).
#[test]
fn lloyd_max_entries_match_the_cpu_model() {
    let ctx = gpu_or_skip!();
    let lloyd = |bits| TensorPlan {
        levels: Levels::LloydMax,
        ..TensorPlan::own(bits, ValueAxis::Channels)
    };
    let k1 = TensorPlan::own(3, ValueAxis::Tokens);
    for (head_dim, group, page_tokens, params, output) in [
        (16, 8, 24, ParamsPrecision::F16, DType::F32),
        (15, 3, 9, ParamsPrecision::F16, DType::F16),
        (16, 4, 24, ParamsPrecision::F32, DType::F32),
    ] {
        let model = ModelSpec {
            layers: 3,
            kv_heads: 2,
            head_dim,
            batch: 1,
        };
        let plan = CachePlan {
            name: "lloyd".into(),
            layers: vec![
                LayerPlan {
                    key: lloyd(2),
                    value: lloyd(3),
                    attention_window: None,
                },
                LayerPlan {
                    key: k1,
                    value: lloyd(1),
                    attention_window: None,
                },
                LayerPlan {
                    key: TensorPlan {
                        codes: CodeSource::Layer(1),
                        residual_bits: 2,
                        ..k1
                    },
                    value: lloyd(4),
                    attention_window: None,
                },
            ],
            window: 2 * group,
            sinks: 3,
            group_quant_size: group,
            params,
            rotation_seed: DEFAULT_ROTATION_SEED,
        };
        let options = CacheOptions {
            page_tokens,
            output,
            ..Default::default()
        };
        let set = run_plan_against_model(&ctx, model, plan, options, &steps(), 11);
        // Layer 0's values: 3-bit codes and one 16-bit norm per token and group of the
        // quantized tokens, f16 for the rest (the reference accounting's convention).
        let (len, rows) = (steps().iter().sum::<usize>(), model.rows());
        let q = set.plan().quantized_tokens(len);
        let want = rows * ((q * head_dim * 3).div_ceil(8) + q * (head_dim / group) * 2)
            + rows * (len - q) * head_dim * 2;
        let got = set.stats().layers[0].value.accounted_bytes as usize;
        if head_dim * 3 % 8 == 0 {
            assert_eq!(
                got, want,
                "head dim {head_dim}: layer 0 values' accounted bytes"
            );
        }
    }
}

#[test]
fn channels_axis_eta_f16_output_odd_dim_group_of_three() {
    let ctx = gpu_or_skip!();
    let model = ModelSpec {
        layers: 5,
        kv_heads: 3,
        head_dim: 15,
        batch: 2,
    };
    let config = CacheConfig {
        quant: XQuantConfig {
            layers_per_group: 3,
            residual_bits: 2,
            group_quant_size: 4,
            eta: 0.09,
            value_axis: ValueAxis::Channels,
            ..Default::default()
        },
        window: 8,
        page_tokens: 12,
        output: DType::F16,
        ..Default::default()
    };
    run_against_model(&ctx, model, config, &[9, 1, 1, 1, 4, 1, 7, 1], 2);
}

#[test]
fn group_sizes_one_two_three_with_odd_layer_counts() {
    let ctx = gpu_or_skip!();
    for (group_size, layers) in [(1, 3), (2, 5), (3, 7)] {
        let model = ModelSpec {
            layers,
            kv_heads: 1,
            head_dim: 8,
            batch: 1,
        };
        let config = CacheConfig {
            quant: XQuantConfig {
                layers_per_group: group_size,
                group_quant_size: 4,
                residual_bits: 1,
                ..Default::default()
            },
            window: 4,
            page_tokens: 8,
            output: DType::F32,
            ..Default::default()
        };
        let set = run_against_model(&ctx, model, config, &[6, 1, 1, 3, 1], 3);
        let roles: Vec<Role> = set.roles().iter().map(|r| r.role).collect();
        let want: Vec<Role> = (0..layers)
            .map(|l| {
                if l % group_size == 0 {
                    Role::Anchor
                } else {
                    Role::Reuse
                }
            })
            .collect();
        assert_eq!(roles, want, "group size {group_size}");
    }
}

#[test]
fn window_is_exact_and_history_is_quantized() {
    let ctx = gpu_or_skip!();
    let model = ModelSpec {
        layers: 1,
        kv_heads: 1,
        head_dim: 32,
        batch: 1,
    };
    let config = CacheConfig {
        sinks: 0,
        window: 32,
        output: DType::F32,
        ..Default::default()
    };
    let mut set = CacheSet::for_model(ctx.clone(), model, config).unwrap();
    let x = normal(&mut SplitMix::new(4), 100 * 32);
    let f = block(set.update_and_fetch(0, KvInput::F32(&x), KvInput::F32(&x))).unwrap();
    let got = block(ctx.read_f32(&f.keys)).unwrap();
    // 100 tokens, window 32, groups of 32: tokens 0..64 quantized, 64..100 exact (as f16).
    let exact = |i: usize| got[i] == f16(x[i]);
    assert!(
        (64 * 32..100 * 32).all(exact),
        "window tokens are stored exactly"
    );
    let quantized = (0..64 * 32).filter(|&i| !exact(i)).count();
    assert!(
        quantized > 60 * 32,
        "history is 2-bit quantized ({quantized} of {} elements differ)",
        64 * 32
    );
    assert_eq!(set.stats().layers[0].window_tokens, 36);
}

#[test]
fn fallback_when_the_anchor_is_late_does_not_leak() {
    let ctx = gpu_or_skip!();
    let model = ModelSpec {
        layers: 2,
        kv_heads: 2,
        head_dim: 16,
        batch: 1,
    };
    let mut g = SplitMix::new(5);
    let x = normal(&mut g, 2 * 64 * 16);
    // Window policy: the reuse layer goes first, so it quantizes its 2 groups itself...
    let config = CacheConfig {
        sinks: 0,
        quant: XQuantConfig::default(),
        window: 0,
        output: DType::F32,
        ..Default::default()
    };
    let mut set = CacheSet::for_model(ctx.clone(), model, config).unwrap();
    block(set.update_and_fetch(1, KvInput::F32(&x), KvInput::F32(&x))).unwrap();
    let alone = set.stats().layers[1].clone();
    assert_eq!(
        alone.key.effective_bits, 3.0,
        "charged as an anchor: 2-bit codes + params"
    );
    // ...and the anchor catching up adds only its own storage.
    block(set.update_and_fetch(0, KvInput::F32(&x), KvInput::F32(&x))).unwrap();
    let st = set.stats();
    assert_eq!(st.layers[1], alone, "the reuse layer is unchanged");
    assert_eq!(
        st.layers[0].accounted_bytes, alone.accounted_bytes,
        "both are charged as anchors"
    );
    // Later groups are shared again once the anchor leads.
    let y = normal(&mut g, 2 * 32 * 16);
    block(set.update_and_fetch(0, KvInput::F32(&y), KvInput::F32(&y))).unwrap();
    block(set.update_and_fetch(1, KvInput::F32(&y), KvInput::F32(&y))).unwrap();
    assert!(
        set.stats().layers[1].key.effective_bits > 3.0,
        "the third group carries params + residual"
    );

    // Reference policy: the coordinator does not keep the late anchor's segment for a reader
    // that already fell back (the reference leaks it until reset).
    let config = CacheConfig {
        decode_policy: DecodePolicy::Reference,
        ..config
    };
    let mut set = CacheSet::for_model(ctx.clone(), model, config).unwrap();
    block(set.update_and_fetch(1, KvInput::F32(&x), KvInput::F32(&x))).unwrap();
    block(set.update_and_fetch(0, KvInput::F32(&x), KvInput::F32(&x))).unwrap();
    assert_eq!(set.live_tokens(), 0);
    assert_no_gpu_errors(&ctx);
}

#[test]
fn allocated_bytes_match_the_accounting() {
    let ctx = gpu_or_skip!();
    let model = ModelSpec {
        layers: 4,
        kv_heads: 3,
        head_dim: 64,
        batch: 1,
    };
    // The reference's pairs: anchors and reuse layers with a 4-bit residual.
    let config = CacheConfig {
        sinks: 0,
        quant: XQuantConfig::default(),
        page_tokens: 256,
        ..Default::default()
    };
    let mut set = CacheSet::for_model(ctx.clone(), model, config).unwrap();
    let mut g = SplitMix::new(6);
    for step in 0..40 {
        let t = if step == 0 { 300 } else { 7 };
        let x = normal(&mut g, 3 * t * 64);
        for l in 0..4 {
            block(set.append(l, KvInput::F32(&x), KvInput::F32(&x))).unwrap();
        }
        let st = set.stats();
        for (l, s) in st.layers.iter().enumerate() {
            assert!(
                s.allocated_bytes >= s.accounted_bytes,
                "layer {l}: allocated {} < accounted {}",
                s.allocated_bytes,
                s.accounted_bytes
            );
            let slack = s.allocated_bytes - s.accounted_bytes;
            assert!(
                slack <= set.slack_bound(l),
                "layer {l} step {step}: slack {slack} > bound {}",
                set.slack_bound(l)
            );
        }
    }
    // The formula, checked by hand for the anchor's keys at 300 + 39·7 = 573 tokens:
    // 416 quantized (13 groups of 32) + 157 in the window (W = 128 plus a partial group).
    let st = set.stats();
    assert_eq!(st.layers[0].tokens, 573);
    assert_eq!(st.layers[0].window_tokens, 157);
    let quantized = 3 * (416 * 64 * 2 / 8 + 13 * 64 * 4);
    let window = 3 * 157 * 64 * 2;
    assert_eq!(
        st.layers[0].accounted_bytes,
        2 * (quantized + window) as u64
    );
    assert_no_gpu_errors(&ctx);
}

#[test]
fn max_ctx_failure_leaves_the_cache_intact() {
    let ctx = gpu_or_skip!();
    let model = ModelSpec {
        layers: 2,
        kv_heads: 1,
        head_dim: 16,
        batch: 1,
    };
    let config = CacheConfig {
        max_ctx: 40,
        window: 8,
        quant: XQuantConfig {
            group_quant_size: 8,
            ..Default::default()
        },
        output: DType::F32,
        ..Default::default()
    };
    let mut set = CacheSet::for_model(ctx.clone(), model, config).unwrap();
    let mut g = SplitMix::new(7);
    let x = normal(&mut g, 37 * 16);
    for l in 0..2 {
        block(set.append(l, KvInput::F32(&x), KvInput::F32(&x))).unwrap();
    }
    let before = block(set.fetch(1)).unwrap();
    let before = (
        block(ctx.read_f32(&before.keys)).unwrap(),
        block(ctx.read_f32(&before.values)).unwrap(),
    );
    let stats = set.stats();
    let four = normal(&mut g, 4 * 16);
    let e = block(set.update_and_fetch(1, KvInput::F32(&four), KvInput::F32(&four))).unwrap_err();
    assert_eq!(e.kind(), "ContextBudgetError");
    assert!(e.to_string().contains("max_ctx = 40"), "{e}");
    assert_eq!(set.tokens(1), 37);
    assert_eq!(set.stats(), stats, "a refused call changes nothing");
    let after = block(set.fetch(1)).unwrap();
    let after = (
        block(ctx.read_f32(&after.keys)).unwrap(),
        block(ctx.read_f32(&after.values)).unwrap(),
    );
    assert_eq!(after, before);
    // Other bad calls are refused the same way.
    let nan = vec![f32::NAN; 16];
    assert_eq!(
        block(set.append(1, KvInput::F32(&nan), KvInput::F32(&nan)))
            .unwrap_err()
            .kind(),
        "NonFiniteError"
    );
    assert_eq!(
        block(set.append(1, KvInput::F32(&x[..15]), KvInput::F32(&x[..15])))
            .unwrap_err()
            .kind(),
        "ShapeError"
    );
    assert_eq!(
        block(set.append(1, KvInput::F32(&x[..16]), KvInput::F32(&x[..32])))
            .unwrap_err()
            .kind(),
        "ShapeError"
    );
    assert_eq!(
        block(set.append(9, KvInput::F32(&x[..16]), KvInput::F32(&x[..16])))
            .unwrap_err()
            .kind(),
        "ShapeError"
    );
    assert_eq!(set.stats(), stats);
    // Three more tokens fit exactly.
    block(set.append(1, KvInput::F32(&x[..48]), KvInput::F32(&x[..48]))).unwrap();
    assert_eq!(set.tokens(1), 40);
    assert_no_gpu_errors(&ctx);
}

#[test]
fn gpu_inputs_give_the_same_result_as_host_inputs() {
    let ctx = gpu_or_skip!();
    let model = ModelSpec {
        layers: 2,
        kv_heads: 2,
        head_dim: 32,
        batch: 1,
    };
    let config = CacheConfig {
        window: 32,
        ..Default::default()
    };
    let mut host = CacheSet::for_model(ctx.clone(), model, config).unwrap();
    let mut gpu = CacheSet::for_model(ctx.clone(), model, config).unwrap();
    let mut g = SplitMix::new(8);
    for t in [70, 1, 1, 30] {
        let k = normal(&mut g, 2 * t * 32);
        let v = normal(&mut g, 2 * t * 32);
        let dims = [1, 2, t, 32];
        let (kg, vg) = (
            ctx.upload(&k, &dims, DType::F16, config.quant.params)
                .unwrap(),
            ctx.upload_f32(&v, &dims, config.quant.params).unwrap(),
        );
        for l in 0..2 {
            let a = block(host.update_and_fetch(l, KvInput::F32(&k), KvInput::F32(&v))).unwrap();
            let a = (
                block(ctx.read_f32(&a.keys)).unwrap(),
                block(ctx.read_f32(&a.values)).unwrap(),
            );
            let b = block(gpu.update_and_fetch(l, KvInput::Gpu(&kg), KvInput::Gpu(&vg))).unwrap();
            let b = (
                block(ctx.read_f32(&b.keys)).unwrap(),
                block(ctx.read_f32(&b.values)).unwrap(),
            );
            assert_eq!(a, b, "layer {l}, +{t} tokens");
        }
    }
    let wrong = ctx
        .upload_f32(&vec![0.0; 2 * 32], &[2, 1, 32], config.quant.params)
        .unwrap();
    let e = block(gpu.append(0, KvInput::Gpu(&wrong), KvInput::Gpu(&wrong))).unwrap_err();
    assert_eq!(e.kind(), "ShapeError");
    assert_no_gpu_errors(&ctx);
}

/// 3000 decode steps over 30 layers of 3 heads × 64 (SmolLM2's shape): memory grows at the
/// quantized rate, not by a group of params per token as the reference policy does.
#[test]
fn long_decode_grows_at_the_quantized_rate() {
    let ctx = gpu_or_skip!();
    let model = ModelSpec {
        layers: 30,
        kv_heads: 3,
        head_dim: 64,
        batch: 1,
    };
    // The reference's pairs: anchors and reuse layers with a 4-bit residual.
    let config = CacheConfig {
        sinks: 0,
        quant: XQuantConfig::default(),
        page_tokens: 256,
        ..Default::default()
    };
    let mut set = CacheSet::for_model(ctx.clone(), model, config).unwrap();
    let mut g = SplitMix::new(9);
    // A pool of GPU-resident tokens (the runtime's own buffers), cycled.
    let pool: Vec<_> = (0..8)
        .map(|_| {
            ctx.upload(
                &normal(&mut g, 3 * 64),
                &[1, 3, 1, 64],
                DType::F16,
                config.quant.params,
            )
            .unwrap()
        })
        .collect();
    // Sampled where the window holds exactly W = 128 tokens: every 480 tokens (15 groups).
    let mut samples = Vec::new();
    for step in 1..=3008 {
        let x = &pool[step % pool.len()];
        for l in 0..30 {
            block(set.append(l, KvInput::Gpu(x), KvInput::Gpu(x))).unwrap();
        }
        if step >= 608 && (step - 128) % 480 == 0 {
            let st = set.stats();
            assert!(st.layers.iter().all(|l| l.window_tokens == 128));
            samples.push((step, st.accounted_bytes, st.allocated_bytes));
        }
    }
    assert_eq!(samples.len(), 6);
    // Accounted bytes per quantized token over all layers (K + V): anchors 2-bit codes +
    // f16 params per group of 32, reuse layers params + 4-bit residual + its params.
    let anchor = 2.0 / 8.0 + 4.0 / 32.0;
    let reuse = 4.0 / 32.0 + 4.0 / 8.0 + 4.0 / 32.0;
    let per_token = 2.0 * 3.0 * 64.0 * 15.0 * (anchor + reuse);
    for w in samples.windows(2) {
        let ((t1, a1, _), (t2, a2, _)) = (w[0], w[1]);
        let slope = (a2 - a1) as f64 / (t2 - t1) as f64;
        assert!(
            (slope - per_token).abs() < 1e-9 * per_token,
            "accounted slope {slope} vs {per_token}"
        );
    }
    // Allocation follows in whole pages: within one page per layer and tensor of the line.
    let (first, last) = (samples[0], samples[samples.len() - 1]);
    let grown = last.2 as f64 - first.2 as f64;
    let want = per_token * (last.0 - first.0) as f64;
    let page = 2.0 * 3.0 * 256.0 * 64.0 * 15.0 * (anchor + reuse);
    assert!(
        (grown - want).abs() <= page,
        "allocated grew {grown} B, the quantized rate gives {want} B"
    );
    let last = set.stats();
    assert!(
        last.allocated_bytes
            <= last.accounted_bytes + (0..30).map(|l| set.slack_bound(l)).sum::<u64>()
    );
    // 4.5 bits per element (3 + 6 over a pair) once the window is amortised: well under 16.
    assert!(last.effective_bits < 5.0, "{}", last.effective_bits);
    assert_no_gpu_errors(&ctx);
}

#[test]
fn reset_frees_everything_and_the_set_stays_usable() {
    let ctx = gpu_or_skip!();
    let model = ModelSpec {
        layers: 2,
        kv_heads: 1,
        head_dim: 16,
        batch: 1,
    };
    let mut set = CacheSet::for_model(ctx.clone(), model, CacheConfig::default()).unwrap();
    let x = normal(&mut SplitMix::new(10), 200 * 16);
    for l in 0..2 {
        block(set.update_and_fetch(l, KvInput::F32(&x), KvInput::F32(&x))).unwrap();
    }
    assert!(set.stats().allocated_bytes > 0);
    set.reset();
    let st = set.stats();
    assert_eq!(
        (st.allocated_bytes, st.scratch_bytes, set.tokens(0)),
        (0, 0, 0)
    );
    let f = block(set.update_and_fetch(0, KvInput::F32(&x[..16]), KvInput::F32(&x[..16]))).unwrap();
    assert_eq!(f.tokens, 1);
    assert_no_gpu_errors(&ctx);
}

#[test]
fn fp16_baseline_returns_its_inputs() {
    let ctx = gpu_or_skip!();
    let model = ModelSpec {
        layers: 2,
        kv_heads: 2,
        head_dim: 9,
        batch: 1,
    };
    let mut set = Fp16CacheSet::for_model(ctx.clone(), model, 500, DType::F32).unwrap();
    let mut g = SplitMix::new(11);
    let mut seq = LayerSeq::new(2, 9);
    for t in [3, 1, 70, 1] {
        let x = normal(&mut g, 2 * t * 9);
        seq.push(&x);
        let f = block(set.update_and_fetch(1, KvInput::F32(&x), KvInput::F32(&x))).unwrap();
        assert_eq!(block(ctx.read_f32(&f.values)).unwrap(), seq.all());
    }
    assert_eq!(set.tokens(1), 75);
    assert!(set.storage_bytes() >= set.fp16_bytes());
    assert_no_gpu_errors(&ctx);
}

/// The reference's grouping written as a plan file by hand (not through `CacheConfig::plan`)
/// gives bit for bit what the options give: every fetch and every attention output.
#[test]
fn a_plan_equal_to_the_options_is_bit_identical() {
    let ctx = gpu_or_skip!();
    let model = ModelSpec {
        layers: 3,
        kv_heads: 2,
        head_dim: 32,
        batch: 1,
    };
    let config = CacheConfig {
        quant: XQuantConfig {
            value_axis: ValueAxis::Channels,
            eta: 0.09,
            ..Default::default()
        },
        window: 32,
        sinks: 3,
        ..Default::default()
    };
    let entry = |codes: &str, axis: &str, r: u8| {
        format!(
            r#"{{"codes": {codes}, "bits": 2, "residual_bits": {r}, "axis": "{axis}", "eta": 0.09}}"#
        )
    };
    let layer = |codes: &str, r: u8| {
        format!(
            r#"{{"key": {}, "value": {}}}"#,
            entry(codes, "tokens", r),
            entry(codes, "channels", r)
        )
    };
    let text = format!(
        r#"{{"window": 32, "sinks": 3, "group_quant_size": 32, "params": "f16",
            "layers": [{}, {}, {}]}}"#,
        layer(r#""own""#, 0),
        layer("0", 4),
        layer(r#""own""#, 0)
    );
    let plan = CachePlan::from_json(&text).unwrap();
    let mut by_options = CacheSet::for_model(ctx.clone(), model, config).unwrap();
    let mut by_plan = CacheSet::for_plan(ctx.clone(), model, plan, config.options()).unwrap();
    let mut g = SplitMix::new(11);
    let per_token = model.rows() * model.head_dim;
    let q_dims = [1, 4, 1, model.head_dim];
    let queries = upload_f32(&ctx, &normal(&mut g, 4 * model.head_dim), &q_dims);
    let outs: Vec<_> = (0..2)
        .map(|_| upload_f32(&ctx, &vec![0.0; 4 * model.head_dim], &q_dims))
        .collect();
    for t in [70, 1, 1, 30, 1, 40] {
        for l in 0..model.layers {
            let (k, v) = (normal(&mut g, t * per_token), normal(&mut g, t * per_token));
            let mut got = Vec::new();
            for (set, out) in [&mut by_options, &mut by_plan].into_iter().zip(&outs) {
                let f = block(set.update_and_fetch(l, KvInput::F32(&k), KvInput::F32(&v))).unwrap();
                let mut bits: Vec<u32> = block(ctx.read_f32(&f.keys))
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect();
                bits.extend(
                    block(ctx.read_f32(&f.values))
                        .unwrap()
                        .iter()
                        .map(|x| x.to_bits()),
                );
                block(set.attend(l, &queries, out)).unwrap();
                bits.extend(
                    block(ctx.read_f32(out))
                        .unwrap()
                        .iter()
                        .map(|x| x.to_bits()),
                );
                got.push(bits);
            }
            assert_eq!(got[0], got[1], "layer {l} after +{t}");
        }
    }
    assert_eq!(by_options.stats(), by_plan.stats());
    assert_no_gpu_errors(&ctx);
}

/// The model of [`mixed_rotations`].
const MIXED_MODEL: ModelSpec = ModelSpec {
    layers: 3,
    kv_heads: 2,
    head_dim: 16,
    batch: 1,
};

/// A plan of three layers rotating their values, both sides, their keys (window 16, 3 sinks,
/// groups of 8: the first group leaves the window at 27 tokens).
fn mixed_rotations() -> CachePlan {
    let rotated = |e: TensorPlan| TensorPlan {
        rotation: Rotation::Hadamard,
        ..e
    };
    let lloyd = |bits| TensorPlan {
        levels: Levels::LloydMax,
        ..TensorPlan::own(bits, ValueAxis::Channels)
    };
    let per_channel = TensorPlan::own(3, ValueAxis::Tokens);
    let layer = |key, value| LayerPlan {
        key,
        value,
        attention_window: None,
    };
    CachePlan {
        name: "rotated".into(),
        layers: vec![
            // Keys per channel, rotated Lloyd–Max values; both rotated; keys only.
            layer(per_channel, rotated(lloyd(2))),
            layer(rotated(lloyd(3)), rotated(lloyd(2))),
            layer(rotated(per_channel), lloyd(2)),
        ],
        window: 16,
        sinks: 3,
        group_quant_size: 8,
        params: ParamsPrecision::F16,
        rotation_seed: DEFAULT_ROTATION_SEED,
    }
}

/// The options the [`mixed_rotations`] sets run with: pages of 24 tokens, f32 outputs.
fn mixed_options() -> CacheOptions {
    CacheOptions {
        page_tokens: 24,
        output: DType::F32,
        ..Default::default()
    }
}

/// Everything a [`MIXED_MODEL`] set gives back for every layer, as bits: its fetched keys
/// and values, and its attention of `queries` (`[1, 4, 1, D]`).
fn read_back(ctx: &GpuContext, set: &mut CacheSet, queries: &GpuTensor) -> Vec<Vec<u32>> {
    let bits = |t: &GpuTensor| -> Vec<u32> {
        let x = block(ctx.read_f32(t)).unwrap();
        x.iter().map(|x| x.to_bits()).collect()
    };
    let mut all = Vec::new();
    for l in 0..MIXED_MODEL.layers {
        let f = block(set.fetch(l)).unwrap();
        all.push(bits(&f.keys));
        all.push(bits(&f.values));
        let out = upload_f32(
            ctx,
            &vec![0.0; 4 * MIXED_MODEL.head_dim],
            queries.shape().dims(),
        );
        block(set.attend(l, queries, &out)).unwrap();
        all.push(bits(&out));
    }
    all
}

/// A rotated plan's layer holds its tokens as they came until a call quantizes some: up to
/// then it appends, fetches and attends bit for bit like the same plan without rotations
/// (no rotation runs); from the call that quantizes the first group on, it does not.
#[test]
fn a_rotated_plan_rotates_nothing_inside_the_window() {
    let ctx = gpu_or_skip!();
    let model = MIXED_MODEL;
    let rotated = mixed_rotations();
    let mut plain = rotated.clone();
    for l in &mut plain.layers {
        l.key.rotation = Rotation::None;
        l.value.rotation = Rotation::None;
    }
    let mut sets = [rotated, plain]
        .map(|p| CacheSet::for_plan(ctx.clone(), model, p, mixed_options()).unwrap());
    let mut g = SplitMix::new(9);
    let q_dims = [1, 4, 1, model.head_dim];
    let queries = upload_f32(&ctx, &normal(&mut g, 4 * model.head_dim), &q_dims);
    let per_step = model.rows() * model.head_dim;
    for step in 0..28 {
        // Two tokens in one call once (sinks and window filled by one call), else one.
        let t = if step == 3 { 2 } else { 1 };
        let (k, v) = (normal(&mut g, t * per_step), normal(&mut g, t * per_step));
        let mut seen = Vec::new();
        for set in &mut sets {
            for l in 0..model.layers {
                block(set.append(l, KvInput::F32(&k), KvInput::F32(&v))).unwrap();
            }
            seen.push(read_back(&ctx, set, &queries));
        }
        let tokens = sets[0].tokens(0);
        if tokens < 27 {
            assert!(
                seen[0] == seen[1],
                "{tokens} tokens: the rotated plan differs"
            );
        } else {
            // Every layer's attention output now differs (rotated, then rotated back).
            for l in 0..model.layers {
                assert_ne!(
                    seen[0][3 * l + 2],
                    seen[1][3 * l + 2],
                    "{tokens} tokens, layer {l}"
                );
            }
        }
    }
}

/// A rotated plan's decode steps are rotated as they are written into the ring (one launch),
/// longer appends into scratch first, and the tokens a layer held before it quantized any
/// (as they came) are rotated in place by the call that does: the routes hold the same f16
/// tokens and the same codes, so a cache fed token by token (and in short chunks, before
/// and across that call) gives back, bit for bit, what the same tokens appended in one call
/// give: every fetch and every attention output.
#[test]
fn rotation_into_the_ring_is_bit_identical_to_rotation_first() {
    let ctx = gpu_or_skip!();
    let model = MIXED_MODEL;
    let plan = mixed_rotations();
    let options = mixed_options();
    let mut g = SplitMix::new(5);
    let steps = steps();
    let total: usize = steps.iter().sum();
    let per_token = model.rows() * model.head_dim;
    let data: Vec<[Vec<f32>; 2]> = (0..model.layers)
        .map(|_| {
            [
                normal(&mut g, total * per_token),
                normal(&mut g, total * per_token),
            ]
        })
        .collect();
    // Tokens [a, b) of every row of a [rows, total, D] tensor.
    let slice = |x: &[f32], a: usize, b: usize| -> Vec<f32> {
        x.chunks(total * model.head_dim)
            .flat_map(|row| row[a * model.head_dim..b * model.head_dim].to_vec())
            .collect()
    };
    let q_dims = [1, 4, 1, model.head_dim];
    let queries = upload_f32(&ctx, &normal(&mut g, 4 * model.head_dim), &q_dims);
    let mut one_call = CacheSet::for_plan(ctx.clone(), model, plan.clone(), options).unwrap();
    for (l, [k, v]) in data.iter().enumerate() {
        block(one_call.append(l, KvInput::F32(k), KvInput::F32(v))).unwrap();
    }
    let want = read_back(&ctx, &mut one_call, &queries);
    // The first group leaves the window at sinks + window + group = 27 tokens: a prefill
    // past it; single tokens up to it, then one more; a chunk that crosses it.
    let ones = |n: usize| std::iter::repeat_n(1, n);
    let schedules: [Vec<usize>; 3] = [
        steps,
        ones(27).chain([total - 27]).collect(),
        ones(20)
            .chain([10])
            .chain(ones(10))
            .chain([total - 40])
            .collect(),
    ];
    // Host values travel as halves; f32 tensors on the GPU are rounded as they come in.
    for (schedule, on_gpu) in schedules.iter().flat_map(|s| [(s, false), (s, true)]) {
        let mut stepwise = CacheSet::for_plan(ctx.clone(), model, plan.clone(), options).unwrap();
        let mut at = 0;
        for &t in schedule {
            for (l, [k, v]) in data.iter().enumerate() {
                let (k, v) = (slice(k, at, at + t), slice(v, at, at + t));
                if on_gpu {
                    let dims = [1, model.kv_heads, t, model.head_dim];
                    let (k, v) = (upload_f32(&ctx, &k, &dims), upload_f32(&ctx, &v, &dims));
                    block(stepwise.append(l, KvInput::Gpu(&k), KvInput::Gpu(&v))).unwrap();
                } else {
                    block(stepwise.append(l, KvInput::F32(&k), KvInput::F32(&v))).unwrap();
                }
            }
            at += t;
        }
        assert_eq!(at, total);
        let got = read_back(&ctx, &mut stepwise, &queries);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let (l, what) = (i / 3, ["keys", "values", "attention"][i % 3]);
            assert!(
                g == w,
                "layer {l} {what}: appends of {schedule:?} (f32 on the GPU: {on_gpu}) differ \
                 from one call"
            );
        }
    }
    assert_no_gpu_errors(&ctx);
}

/// A decode step's keys and values are written into their rings by one launch, in every
/// kind of cache: the f16 baseline, plans with neither side rotated, the default (values
/// rotated, keys not) and both sides rotated; a step that quantizes a group records more.
/// (What the paired writes hold is checked by the tests above, against the CPU model.)
#[test]
fn a_decode_step_writes_keys_and_values_in_one_launch() {
    gpu_or_skip!();
    // A context of its own: its launch counter counts every thread's launches, and the
    // other tests of this binary run beside this one.
    let options = ContextOptions::default();
    let ctx = Arc::new(block(GpuContext::new(&options)).expect("a second context"));
    let model = ModelSpec {
        layers: 2,
        kv_heads: 2,
        head_dim: 64,
        batch: 1,
    };
    let mut g = SplitMix::new(21);
    let per_token = model.rows() * model.head_dim;
    let prompt = normal(&mut g, 300 * per_token);
    let step = normal(&mut g, per_token);
    // Launches of one layer's append of `x`.
    let launches = |cache: &mut dyn KvCache, x: &[f32]| {
        let before = ctx.launches_recorded();
        block(cache.append(0, KvInput::F32(x), KvInput::F32(x))).unwrap();
        ctx.launches_recorded() - before
    };
    let mut f16 = Fp16CacheSet::for_model(ctx.clone(), model, 1024, DType::F32).unwrap();
    launches(&mut f16, &prompt);
    assert_eq!(launches(&mut f16, &step), 1, "f16 cache");
    for preset in ["kivi-2", "default", "rotated-2"] {
        let plan = CachePlan::preset_for(preset, model.layers, model.head_dim).unwrap();
        let options = CacheOptions {
            max_ctx: 1024,
            ..Default::default()
        };
        let mut set = CacheSet::for_plan(ctx.clone(), model, plan, options).unwrap();
        launches(&mut set, &prompt);
        // 300 tokens: the next step quantizes no group (window 128, groups of 32 or 64).
        assert_eq!(launches(&mut set, &step), 1, "{preset}");
        let mut quantized = false;
        for _ in 0..64 {
            quantized |= launches(&mut set, &step) > 1;
        }
        assert!(quantized, "{preset}: 64 steps quantized no group");
    }
    assert_no_gpu_errors(&ctx);
}

/// A rotated cache's sinks and window come back from `update_and_fetch` as they went in: the
/// default plan (`kivi-lloyd`: keys unrotated per channel, values rotated Lloyd–Max per
/// token; the window's and sinks' values rotated back as they are read, in the window's
/// launch) at head dim 64, and at head dim 16 with groups of 16, window 16 and 3 sinks. A
/// prefill that quantizes groups, then decode steps: every fetched sink and window token
/// is its input to within f16 rounding (the ring holds rotated halves: each element off by
/// at most 2^-11 of its token's norm, here 2^-10), a sink or window token of the wrong slot
/// by about the inputs' scale.
#[test]
fn a_rotated_cache_fetches_its_sinks_and_window_as_they_went_in() {
    let ctx = gpu_or_skip!();
    for (head_dim, small) in [(64, false), (16, true)] {
        let model = ModelSpec {
            layers: 1,
            kv_heads: 2,
            head_dim,
            batch: 1,
        };
        let mut plan = CachePlan::preset("kivi-lloyd", model.layers).unwrap();
        if small {
            plan.group_quant_size = 16;
            plan.window = 16;
            plan.sinks = 3;
        }
        let (sinks, window) = (plan.sinks, plan.window);
        assert!(
            plan.layers[0].value.rotation == Rotation::Hadamard && sinks > 0,
            "D {head_dim}: {plan:?}"
        );
        let options = CacheOptions {
            output: DType::F32,
            ..Default::default()
        };
        let mut set = CacheSet::for_plan(ctx.clone(), model, plan, options).unwrap();
        let mut g = SplitMix::new(17);
        let (rows, prefill) = (model.rows(), 3 * window + 5);
        // Keys and values: per row, every token appended so far.
        let mut inputs = [vec![Vec::new(); rows], vec![Vec::new(); rows]];
        for (step, t) in std::iter::once(prefill).chain([1; 6]).enumerate() {
            let (k, v) = (
                normal(&mut g, rows * t * head_dim),
                normal(&mut g, rows * t * head_dim),
            );
            for (side, x) in inputs.iter_mut().zip([&k, &v]) {
                for (r, row) in x.chunks(t * head_dim).enumerate() {
                    side[r].extend_from_slice(row);
                }
            }
            let f = block(set.update_and_fetch(0, KvInput::F32(&k), KvInput::F32(&v))).unwrap();
            let len = set.tokens(0);
            // The last `window` tokens are in the window whatever the quantizer's phase.
            let held: Vec<usize> = (0..sinks).chain(len - window..len).collect();
            for (kind, (side, got)) in inputs.iter().zip([&f.keys, &f.values]).enumerate() {
                let got = block(ctx.read_f32(got)).unwrap();
                for (r, row) in side.iter().enumerate() {
                    for &tok in &held {
                        let want = &row[tok * head_dim..(tok + 1) * head_dim];
                        let at = (r * len + tok) * head_dim;
                        let norm = want.iter().map(|x| x * x).sum::<f32>().sqrt();
                        let worst = want
                            .iter()
                            .zip(&got[at..at + head_dim])
                            .map(|(a, b)| (a - b).abs())
                            .fold(0.0f32, f32::max);
                        assert!(
                            worst <= norm / 1024.0,
                            "D {head_dim}, step {step}, {} of row {r}, token {tok} of {len}: \
                             off by {worst} (norm {norm})",
                            ["keys", "values"][kind]
                        );
                    }
                }
            }
            assert_eq!(len, prefill + step);
        }
    }
    assert_no_gpu_errors(&ctx);
}

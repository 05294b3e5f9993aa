//! Fused attention (split-K over the packed cache) against dense attention over the same
//! cache's `fetch()`, on random cache configurations. Shared by the native tests and the
//! in-browser wasm-bindgen tests.

use std::sync::Arc;

use xquant_wgpu::cache::{
    AttendOptions, CacheConfig, CachePlan, CacheSet, CodeSource, DecodePolicy, Fp16CacheSet,
    KvCache, KvInput, ModelSpec, OutLayout, Rotation, TensorPlan,
};
use xquant_wgpu::config::KvKind;
use xquant_wgpu::gpu::GpuContext;
use xquant_wgpu::reference::{attention_windowed, AttentionShape};
use xquant_wgpu::synth::SplitMix;
use xquant_wgpu::{DType, Levels, ParamsPrecision, ValueAxis, XQuantConfig};

pub use super::tolerances::{ATTEND_F16_REL, ATTEND_F32_REL};

/// What a trial compared.
#[derive(Clone, Debug, Default)]
pub struct AttendReport {
    /// Attention calls compared.
    pub calls: usize,
    /// Largest |fused - dense| / max(1, max |V|) seen.
    pub worst: f32,
    /// A description of the configuration.
    pub case: String,
}

fn normal(g: &mut SplitMix, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| g.normal() * scale).collect()
}

fn pick<T: Copy>(g: &mut SplitMix, xs: &[T]) -> T {
    xs[g.range(0, xs.len() - 1)]
}

/// Dense attention over `set`'s fetched K/V of `layer` (CPU, f64) for `q`, and the largest
/// |V| (at least 1).
pub async fn dense(
    set: &mut dyn KvCache,
    layer: usize,
    q: &[f32],
    shape: AttentionShape,
    pos0: usize,
) -> (Vec<f32>, f32) {
    dense_windowed(set, layer, q, shape, pos0, None).await
}

/// [`dense`] for a sliding-window layer.
pub async fn dense_windowed(
    set: &mut dyn KvCache,
    layer: usize,
    q: &[f32],
    shape: AttentionShape,
    pos0: usize,
    window: Option<usize>,
) -> (Vec<f32>, f32) {
    let f = set.fetch(layer).await.expect("fetch");
    let k = set.read(&f.keys).await.unwrap();
    let v = set.read(&f.values).await.unwrap();
    let vmax = v.iter().fold(1.0f32, |a, b| a.max(b.abs()));
    let scale = 1.0 / (shape.dim as f32).sqrt();
    let out = attention_windowed(q, &k, &v, shape, pos0, scale, window).unwrap();
    (out, vmax)
}

/// Attends random queries to every layer of `set` and compares with dense attention over
/// `fetch()`; returns the worst relative difference.
#[allow(clippy::too_many_arguments)]
async fn compare_layers(
    ctx: &Arc<GpuContext>,
    set: &mut dyn KvCache,
    g: &mut SplitMix,
    model: ModelSpec,
    gqa: usize,
    budget: f32,
    what: &str,
    report: &mut AttendReport,
) {
    for layer in 0..model.layers {
        let len = set.tokens(layer);
        let t = g.range(1, 8).min(len);
        let q_heads = model.kv_heads * gqa;
        // Causal over the last t tokens, or (sometimes) queries after every cached token.
        let after = g.range(0, 3) == 0;
        let pos0 = if after { len } else { len - t };
        let layout = pick(g, &[OutLayout::HeadsMajor, OutLayout::TokensMajor]);
        let q_dtype = pick(g, &[DType::F32, DType::F16]);
        let out_dtype = if model.head_dim % 2 == 0 {
            pick(g, &[DType::F32, DType::F32, DType::F16])
        } else {
            DType::F32
        };
        let peak = pick(g, &[1.0, 1.0, 4.0]);
        let qn = model.batch * q_heads * t * model.head_dim;
        let q: Vec<f32> = normal(g, qn, peak)
            .iter()
            .map(|&x| match q_dtype {
                DType::F16 => half::f16::from_f32(x).to_f32(),
                DType::F32 => x,
            })
            .collect();
        let qdims = [model.batch, q_heads, t, model.head_dim];
        let queries = ctx
            .upload(&q, &qdims, q_dtype, ParamsPrecision::F32)
            .unwrap();
        let odims = match layout {
            OutLayout::HeadsMajor => qdims,
            OutLayout::TokensMajor => [model.batch, t, q_heads, model.head_dim],
        };
        let out = ctx
            .upload(&vec![0.0; qn], &odims, out_dtype, ParamsPrecision::F32)
            .unwrap();
        // Sometimes a sliding window (Gemma 3's local layers), from one position to past
        // everything cached.
        let window = (g.range(0, 2) == 0).then(|| g.range(1, len + 2));
        let options = AttendOptions {
            pos0: after.then_some(len),
            layout,
            window,
            ..Default::default()
        };
        set.attend_with(layer, &queries, &out, options)
            .await
            .unwrap_or_else(|e| panic!("{what}: attend layer {layer}: {e}"));
        let got = ctx.read_f32(&out).await.unwrap();
        let shape = AttentionShape {
            batch: model.batch,
            q_heads,
            kv_heads: model.kv_heads,
            q_tokens: t,
            kv_tokens: len,
            dim: model.head_dim,
        };
        let (want, vmax) = dense_windowed(set, layer, &q, shape, pos0, window).await;
        let out_tol = match out_dtype {
            DType::F16 => 1.0 / 1024.0,
            DType::F32 => 0.0,
        };
        for b in 0..model.batch {
            for h in 0..q_heads {
                for tt in 0..t {
                    for d in 0..model.head_dim {
                        let w = want[((b * q_heads + h) * t + tt) * model.head_dim + d];
                        let at = match layout {
                            OutLayout::HeadsMajor => (b * q_heads + h) * t + tt,
                            OutLayout::TokensMajor => (b * t + tt) * q_heads + h,
                        } * model.head_dim
                            + d;
                        let err = (got[at] - w).abs() / vmax;
                        let allowed = budget + out_tol * w.abs().max(1e-3) / vmax;
                        assert!(
                            err <= allowed,
                            "{what}: layer {layer} b {b} head {h} query {tt} channel {d}: \
                             fused {} vs dense {w} (relative {err} > {allowed}; {len} tokens, \
                             T {t}, pos0 {pos0}, window {window:?}, {layout:?}, q {q_dtype:?}, \
                             out {out_dtype:?})",
                            got[at]
                        );
                        report.worst = report.worst.max(err);
                    }
                }
            }
        }
        report.calls += 1;
    }
}

/// A random plan over `base`'s layers, group and window: each layer's keys and values own
/// codes of random width, axis and η, or borrow an earlier owner's with a random residual;
/// random sinks (none, fewer than a group, more than one). With a power-of-two `head_dim`
/// owners are rotated half the time, under a random seed; where the group divides
/// `head_dim`, a third of the per-token owners of up to 4 bits take Lloyd–Max levels (which
/// are never borrowed).
pub fn random_plan(g: &mut SplitMix, base: &CachePlan, head_dim: usize) -> CachePlan {
    let mut plan = base.clone();
    let gq = plan.group_quant_size;
    plan.sinks = pick(g, &[0, 1, 4, gq + 3]);
    plan.rotation_seed = g.range(0, 1 << 30) as u32;
    let axes = [ValueAxis::Tokens, ValueAxis::Channels];
    for i in 0..plan.layers.len() {
        for kind in [KvKind::Key, KvKind::Value] {
            let owners: Vec<usize> = (0..i)
                .filter(|&j| {
                    let e = plan.layers[j].get(kind);
                    e.codes == CodeSource::Own && e.levels == Levels::Uniform
                })
                .collect();
            let entry = if !owners.is_empty() && g.range(0, 1) == 0 {
                let src = pick(g, &owners);
                TensorPlan {
                    codes: CodeSource::Layer(src),
                    residual_bits: pick(g, &[0, 1, 2, 4]),
                    eta: pick(g, &[0.0, 0.09]),
                    ..*plan.layers[src].get(kind)
                }
            } else {
                let rotation = match head_dim.is_power_of_two() && g.range(0, 1) == 0 {
                    true => Rotation::Hadamard,
                    false => Rotation::None,
                };
                let own = TensorPlan {
                    eta: pick(g, &[0.0, 0.0, 1.0 / 6.0]),
                    rotation,
                    ..TensorPlan::own(g.range(1, 8) as u8, pick(g, &axes))
                };
                // A coin of its own (not drawn from `g`, so the trials' other choices stay
                // what they were before Lloyd-Max entries existed).
                let coin = SplitMix::new(
                    u64::from(plan.rotation_seed) ^ (4 * i as u64 + u64::from(kind.index()) + 1),
                )
                .range(0, 2)
                    == 0;
                let coded = own.axis == ValueAxis::Channels && own.bits <= 4;
                if coded && head_dim % gq == 0 && coin {
                    TensorPlan {
                        eta: 0.0,
                        levels: Levels::LloydMax,
                        ..own
                    }
                } else {
                    own
                }
            };
            match kind {
                KvKind::Key => plan.layers[i].key = entry,
                KvKind::Value => plan.layers[i].value = entry,
            }
        }
    }
    plan.validate().unwrap();
    plan
}

/// One random trial: a cache set of a random configuration fed a prefill and decode steps,
/// then every layer attended and compared; the same inputs through the f16 set.
pub async fn attention_trial(ctx: &Arc<GpuContext>, seed: u64) -> AttendReport {
    trial(ctx, seed, Flavor::Any).await
}

/// A random trial of a rotated plan: window policy, power-of-two head dims, a random plan
/// whose owners are rotated half the time (keys only, values only, both, neither).
pub async fn rotated_attention_trial(ctx: &Arc<GpuContext>, seed: u64) -> AttendReport {
    trial(ctx, seed, Flavor::Rotated).await
}

/// A random trial of a Lloyd–Max plan: window policy, power-of-two head dims, every entry
/// per-token Lloyd–Max codes of 1..=4 bits, half of them rotated.
pub async fn levels_attention_trial(ctx: &Arc<GpuContext>, seed: u64) -> AttendReport {
    trial(ctx, seed, Flavor::Levels).await
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Flavor {
    Any,
    Rotated,
    Levels,
}

async fn trial(ctx: &Arc<GpuContext>, seed: u64, flavor: Flavor) -> AttendReport {
    let mut g = SplitMix::new(
        seed ^ match flavor {
            Flavor::Any => 0xa77e,
            Flavor::Rotated => 0x707a7e,
            Flavor::Levels => 0x11d7a,
        },
    );
    let rotated = flavor != Flavor::Any;
    let dims: &[usize] = match rotated {
        true => &[64, 16, 64, 32, 128],
        false => &[64, 64, 16, 31, 33, 128],
    };
    let model = ModelSpec {
        layers: g.range(1, 4),
        kv_heads: g.range(1, 2),
        head_dim: pick(&mut g, dims),
        batch: g.range(1, 2),
    };
    let gqa = pick(&mut g, &[1, 3, 4]);
    let gq = match flavor {
        Flavor::Levels => pick(&mut g, &[16, 16, 32, 64]).min(model.head_dim),
        _ => pick(&mut g, &[32, 32, 32, 16, 64, 96]),
    };
    // Every width comes up in every 8 seeds; residual widths 0, 1, 2 and 4 in seeds 0..8 (the
    // browser's), then 8, 5, 3 and 0: 8-bit residuals on 1- and 2-bit codes (runs of 16
    // tokens whose residual spans more than two words), 5 on 3 and 4 bits.
    let bits = (seed % 8) as u8 + 1;
    let residual_bits = match seed % 16 < 8 {
        true => [0, 1, 2, 4],
        false => [8, 5, 3, 0],
    }[(seed / 2 % 4) as usize];
    let reference = !rotated && g.range(0, 5) == 0;
    let output = pick(&mut g, &[DType::F32, DType::F32, DType::F16]);
    let config = CacheConfig {
        quant: XQuantConfig {
            layers_per_group: g.range(1, 3),
            base_bits: bits,
            residual_bits,
            group_quant_size: gq,
            eta: pick(&mut g, &[0.0, 0.0, 0.09]),
            value_axis: [ValueAxis::Tokens, ValueAxis::Channels][(seed / 3 % 2) as usize],
            params: pick(&mut g, &[ParamsPrecision::F16, ParamsPrecision::F32]),
            ..XQuantConfig::default()
        },
        max_ctx: 4096,
        window: gq * g.range(0, 3),
        sinks: 0,
        decode_policy: if reference {
            DecodePolicy::Reference
        } else {
            DecodePolicy::Window
        },
        output,
        page_tokens: gq * pick(&mut g, &[1, 2, 4, 32]),
    };
    // Half the window-policy trials follow a mixed plan with sinks instead of the grouping.
    let mut plan = config.plan(model.layers, model.head_dim).unwrap();
    if rotated || (!reference && g.range(0, 1) == 0) {
        plan = random_plan(&mut g, &plan, model.head_dim);
    }
    if flavor == Flavor::Levels {
        for l in &mut plan.layers {
            for e in [&mut l.key, &mut l.value] {
                *e = TensorPlan {
                    levels: Levels::LloydMax,
                    rotation: e.rotation,
                    ..TensorPlan::own(g.range(1, 4) as u8, ValueAxis::Channels)
                };
            }
        }
    }
    if rotated && !plan.rotates() {
        for l in &mut plan.layers {
            l.key.rotation = Rotation::Hadamard;
            l.value.rotation = Rotation::Hadamard;
        }
    }
    let case = format!(
        "seed {seed}: {model:?} gqa {gqa} {config:?} {}",
        plan.to_json()
    );
    let mut set = CacheSet::for_plan(ctx.clone(), model, plan, config.options()).expect(&case);
    let mut fp16 = Fp16CacheSet::for_model(ctx.clone(), model, 4096, output).unwrap();
    let prefill = pick(&mut g, &[1, 5, 40, 130, 300]);
    let decode = if reference {
        g.range(0, 6)
    } else {
        g.range(0, 40)
    };
    let per_token = model.rows() * model.head_dim;
    let mut steps = vec![prefill];
    steps.extend((0..decode).map(|_| if g.range(0, 4) == 0 { 3 } else { 1 }));
    for &t in &steps {
        let mut k = normal(&mut g, t * per_token, 1.0);
        let mut v = normal(&mut g, t * per_token, 1.0);
        for layer in 0..model.layers {
            if layer > 0 {
                k = k.iter().map(|x| 0.8 * x + 0.4 * g.normal()).collect();
                v = v.iter().map(|x| 0.8 * x + 0.4 * g.normal()).collect();
            }
            set.append(layer, KvInput::F32(&k), KvInput::F32(&v))
                .await
                .expect(&case);
            fp16.append(layer, KvInput::F32(&k), KvInput::F32(&v))
                .await
                .unwrap();
        }
    }
    let (budget, mut report) = budget_and_report(output, &case);
    compare_layers(
        ctx,
        &mut set,
        &mut g,
        model,
        gqa,
        budget,
        &case,
        &mut report,
    )
    .await;
    // The f16 set's window holds exactly the f16 values its fetch returns.
    let f16_case = format!("{case} (f16 set)");
    compare_layers(
        ctx,
        &mut fp16,
        &mut g,
        model,
        gqa,
        budget,
        &f16_case,
        &mut report,
    )
    .await;
    report
}

/// Fused attention over a cache set built from `plan` (a prefill, then single tokens and
/// short chunks) against dense attention over its `fetch()`.
pub async fn plan_attention_trial(
    ctx: &Arc<GpuContext>,
    model: ModelSpec,
    plan: CachePlan,
    output: DType,
    seed: u64,
) -> AttendReport {
    let mut g = SplitMix::new(seed);
    let case = format!("seed {seed}: {model:?} {output:?} {}", plan.to_json());
    let options = xquant_wgpu::cache::CacheOptions {
        output,
        ..Default::default()
    };
    let mut set = CacheSet::for_plan(ctx.clone(), model, plan, options).expect(&case);
    let per_token = model.rows() * model.head_dim;
    let mut steps = vec![70];
    steps.extend((0..30).map(|_| if g.range(0, 4) == 0 { 3 } else { 1 }));
    for &t in &steps {
        let k = normal(&mut g, t * per_token, 1.0);
        let v = normal(&mut g, t * per_token, 1.0);
        for layer in 0..model.layers {
            set.append(layer, KvInput::F32(&k), KvInput::F32(&v))
                .await
                .expect(&case);
        }
    }
    let (budget, mut report) = budget_and_report(output, &case);
    compare_layers(ctx, &mut set, &mut g, model, 3, budget, &case, &mut report).await;
    report
}

/// The attention tolerance for outputs of `output`, and an empty report of `case`.
fn budget_and_report(output: DType, case: &str) -> (f32, AttendReport) {
    let budget = match output {
        DType::F32 => ATTEND_F32_REL,
        DType::F16 => ATTEND_F16_REL,
    };
    let report = AttendReport {
        case: case.to_string(),
        ..Default::default()
    };
    (budget, report)
}

//! A cache call that fails — bad input, context budget, a GPU validation error, an
//! allocation the device refuses, device loss — leaves the set's tokens, stats and stored
//! data exactly as they were, and the set stays usable.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use std::sync::Arc;

use common::gpu::{assert_no_gpu_errors, block, gpu_required};
use xquant_wgpu::cache::{
    CacheConfig, CacheOptions, CachePlan, CacheSet, KvCache, KvInput, ModelSpec, DEFAULT_QUANT,
};
use xquant_wgpu::gpu::GpuContext;
use xquant_wgpu::{DType, ParamsPrecision, XQuantConfig, XqError};

const MODEL: ModelSpec = ModelSpec {
    layers: 3,
    kv_heads: 2,
    head_dim: 16,
    batch: 1,
};

/// What a failed call must not change.
#[derive(PartialEq)]
struct Snapshot {
    tokens: Vec<usize>,
    stats: xquant_wgpu::cache::CacheStats,
    /// Every layer's fetched keys and values.
    kv: Vec<(Vec<f32>, Vec<f32>)>,
}

fn snapshot(set: &mut CacheSet) -> Snapshot {
    let ctx = set.context().clone();
    let mut kv = Vec::new();
    for l in 0..MODEL.layers {
        let f = block(set.fetch(l)).expect("fetch");
        kv.push((
            block(ctx.read_f32(&f.keys)).unwrap(),
            block(ctx.read_f32(&f.values)).unwrap(),
        ));
    }
    Snapshot {
        tokens: (0..MODEL.layers).map(|l| set.tokens(l)).collect(),
        stats: set.stats(),
        kv,
    }
}

impl std::fmt::Debug for Snapshot {
    /// Tokens, stats and a digest of the data (the values themselves are too many to print).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let digest: Vec<(usize, f64)> = self
            .kv
            .iter()
            .flat_map(|(k, v)| [k, v])
            .map(|x| (x.len(), x.iter().map(|&e| f64::from(e)).sum::<f64>()))
            .collect();
        write!(
            f,
            "tokens {:?}, {:?}, K/V (len, sum) {digest:?}",
            self.tokens, self.stats
        )
    }
}

fn kv(tokens: usize, seed: u64) -> Vec<f32> {
    xquant_wgpu::synth::normal(MODEL.rows() * tokens * MODEL.head_dim, seed)
}

/// Appends `tokens` tokens to every layer.
fn feed(set: &mut CacheSet, tokens: usize, seed: u64) {
    for l in 0..MODEL.layers {
        let (k, v) = (
            kv(tokens, seed + l as u64),
            kv(tokens, seed + 100 + l as u64),
        );
        block(set.append(l, KvInput::F32(&k), KvInput::F32(&v))).expect("append");
    }
}

/// The configurations tried: the default (kivi-lloyd + sinks, window) and the reference's pairs
/// (reuse layers borrowing codes, residual), with a small window so pages hold data.
fn configs() -> Vec<(&'static str, CachePlan, CacheOptions)> {
    let default = CacheConfig {
        quant: XQuantConfig {
            group_quant_size: 8,
            ..DEFAULT_QUANT
        },
        window: 8,
        max_ctx: 64,
        ..CacheConfig::default()
    };
    let pairs = CacheConfig {
        quant: XQuantConfig {
            group_quant_size: 8,
            ..XQuantConfig::default()
        },
        sinks: 0,
        ..default
    };
    vec![
        (
            "default",
            default.plan(MODEL.layers, MODEL.head_dim).unwrap(),
            default.options(),
        ),
        (
            "reference pairs",
            pairs.plan(MODEL.layers, MODEL.head_dim).unwrap(),
            pairs.options(),
        ),
    ]
}

fn set_with_data(ctx: &Arc<GpuContext>, plan: &CachePlan, options: CacheOptions) -> CacheSet {
    let mut set = CacheSet::for_plan(ctx.clone(), MODEL, plan.clone(), options).unwrap();
    feed(&mut set, 37, 1);
    set
}

/// `call` fails with `kind` and changes nothing; the set then takes a token like a fresh copy.
fn fails_without_effect(
    ctx: &Arc<GpuContext>,
    name: &str,
    kind: &str,
    call: impl Fn(&mut CacheSet) -> Result<(), XqError>,
) {
    for (config, plan, options) in configs() {
        let mut set = set_with_data(ctx, &plan, options);
        let before = snapshot(&mut set);
        let err = call(&mut set).expect_err(name);
        assert!(
            format!("{err:?}").starts_with(kind),
            "{config}: {name}: expected {kind}, got {err:?}"
        );
        assert_eq!(
            snapshot(&mut set),
            before,
            "{config}: {name} changed the set"
        );
        // Still usable: one more token gives what a set that never failed gives.
        let mut twin = set_with_data(ctx, &plan, options);
        snapshot(&mut twin); // (the first fetch allocates the reused output buffers)
        feed(&mut set, 1, 50);
        feed(&mut twin, 1, 50);
        assert_eq!(
            snapshot(&mut set),
            snapshot(&mut twin),
            "{config}: after {name}"
        );
    }
    assert_no_gpu_errors(ctx);
}

#[test]
fn bad_input_changes_nothing() {
    let ctx = gpu_or_skip!();
    let good = kv(1, 9);
    fails_without_effect(&ctx, "short keys", "Shape", |s| {
        block(s.append(1, KvInput::F32(&good[1..]), KvInput::F32(&good)))
    });
    fails_without_effect(&ctx, "NaN values", "NonFinite", |s| {
        let mut bad = good.clone();
        bad[5] = f32::NAN;
        block(s.append(0, KvInput::F32(&good), KvInput::F32(&bad)))
    });
    fails_without_effect(&ctx, "no such layer", "Shape", |s| {
        block(s.append(MODEL.layers, KvInput::F32(&good), KvInput::F32(&good)))
    });
    fails_without_effect(&ctx, "update_and_fetch of NaN", "NonFinite", |s| {
        let bad = vec![f32::INFINITY; good.len()];
        block(s.update_and_fetch(2, KvInput::F32(&bad), KvInput::F32(&good))).map(|_| ())
    });
}

#[test]
fn context_budget_changes_nothing() {
    let ctx = gpu_or_skip!();
    // 37 tokens held, max_ctx 64: 28 more do not fit, in one call or as a prefill.
    let big = kv(28, 3);
    fails_without_effect(&ctx, "append past max_ctx", "ContextBudget", |s| {
        block(s.append(0, KvInput::F32(&big), KvInput::F32(&big)))
    });
    fails_without_effect(
        &ctx,
        "update_and_fetch past max_ctx",
        "ContextBudget",
        |s| block(s.update_and_fetch(1, KvInput::F32(&big), KvInput::F32(&big))).map(|_| ()),
    );
}

#[test]
fn a_gpu_validation_error_changes_nothing() {
    let ctx = gpu_or_skip!();
    // The runtime hands over a buffer it has destroyed: the submission is invalid.
    fails_without_effect(&ctx, "destroyed input", "Gpu", |s| {
        let t = ctx.upload_f32(&kv(2, 4), &[1, 2, 2, 16], ParamsPrecision::F16)?;
        t.buffer().destroy();
        block(s.append(1, KvInput::Gpu(&t), KvInput::Gpu(&t)))
    });
}

/// A context on a device whose buffers may hold at most `max_buffer` bytes.
fn small_device(max_buffer: u64) -> Option<Arc<GpuContext>> {
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let adapter = block(instance.request_adapter(&wgpu::RequestAdapterOptions::default()));
    let adapter = match adapter {
        Ok(a) => a,
        Err(e) if gpu_required() => panic!("REQUIRE_GPU=1 but no GPU: {e}"),
        Err(_) => return None,
    };
    let (device, queue) = block(adapter.request_device(&wgpu::DeviceDescriptor {
        required_limits: wgpu::Limits {
            max_buffer_size: max_buffer,
            max_storage_buffer_binding_size: max_buffer,
            ..Default::default()
        },
        ..Default::default()
    }))
    .expect("device");
    // Like a runtime sharing its device: its handler sees what escapes our scopes.
    device.on_uncaptured_error(Arc::new(|e: wgpu::Error| eprintln!("uncaptured: {e}")));
    Some(Arc::new(GpuContext::from_device(
        device,
        queue,
        &adapter.get_info(),
    )))
}

#[test]
fn an_allocation_the_device_refuses_changes_nothing() {
    let Some(ctx) = small_device(8192) else {
        return;
    };
    // update_and_fetch returns every token dense: 37 tokens × 2 rows × 16 × 4 bytes fit
    // 8192 bytes; 32 more do not, so the call fails after its append was recorded.
    for (config, plan, options) in configs() {
        let options = CacheOptions {
            output: DType::F32,
            max_ctx: 512,
            ..options
        };
        let mut set = set_with_data(&ctx, &plan, options);
        let before = snapshot(&mut set);
        let more = kv(32, 7);
        let err = block(set.update_and_fetch(0, KvInput::F32(&more), KvInput::F32(&more)))
            .map(|_| ())
            .expect_err("a fetch output over the device's buffer limit");
        assert!(
            matches!(err, XqError::TooLarge(_) | XqError::Gpu(_)),
            "{config}: {err:?}"
        );
        assert_eq!(
            snapshot(&mut set),
            before,
            "{config}: the refused call changed the set"
        );
        feed(&mut set, 1, 8);
        assert_eq!(set.tokens(0), 38, "{config}: usable after the refusal");
    }
}

#[test]
fn device_loss_is_a_typed_error_and_a_new_context_works() {
    let Some(ctx) = small_device(1 << 24) else {
        return;
    };
    let (_, plan, options) = configs().remove(0);
    let mut set = set_with_data(&ctx, &plan, options);
    let tokens = set.tokens(0);
    ctx.device().destroy();
    let t = kv(1, 2);
    for _ in 0..2 {
        let err = block(set.append(0, KvInput::F32(&t), KvInput::F32(&t))).unwrap_err();
        assert!(matches!(err, XqError::DeviceLost(_)), "{err:?}");
        let err = block(set.fetch(0)).map(|_| ()).unwrap_err();
        assert!(matches!(err, XqError::DeviceLost(_)), "{err:?}");
        let err = ctx
            .upload_f32(&t, &[1, 2, 1, 16], ParamsPrecision::F16)
            .map(|_| ());
        assert!(matches!(err, Err(XqError::DeviceLost(_))), "{err:?}");
    }
    assert_eq!(
        set.tokens(0),
        tokens,
        "a lost device's failed append added nothing"
    );
    assert!(CacheSet::for_plan(ctx.clone(), MODEL, plan.clone(), options).is_err());
    drop(set);
    // A new context on a new device works.
    let fresh = small_device(1 << 24).unwrap();
    let mut set = set_with_data(&fresh, &plan, options);
    feed(&mut set, 1, 3);
    assert_eq!(set.tokens(0), 38);
    assert_no_gpu_errors(&fresh);
}

//! Writes the seed corpus of the fuzz harness's `saved-cache` target: small cache sets of
//! every shape the container holds, saved by this build (XQuant: the default plan, pairs
//! borrowing codes with a residual, layers out of step leaving orphan and fallback codes,
//! rotated Lloyd–Max codes, sliding layers that dropped pages and sinks; f16: a full set and
//! one with a sliding layer), 4–9 KB each (rings grow in steps of 64 tokens), within the
//! harness's mutation size for this target (16 KiB).
//!
//! `cargo run --example saved_cache_corpus` (needs a GPU adapter; lavapipe will do). The files
//! are named by their FNV-1a hash, as the driver names what it keeps.

// For `input_name`: corpus files are named as the fuzz driver names what it keeps.
#[allow(unused_imports)]
#[path = "../fuzz/harness/mod.rs"]
mod harness;

use std::path::Path;
use std::sync::Arc;

use xquant_wgpu::cache::{
    CacheConfig, CachePlan, CacheSet, Fp16CacheSet, KvCache, KvInput, ModelSpec, Rotation,
    TensorPlan, KIVI_2,
};
use xquant_wgpu::gpu::{ContextOptions, GpuContext};
use xquant_wgpu::{DType, Levels, Result, ValueAxis, XQuantConfig, XqError};

const MODEL: ModelSpec = ModelSpec {
    layers: 2,
    kv_heads: 1,
    head_dim: 8,
    batch: 1,
};
/// The most bytes one corpus file may hold (the harness's mutation size for this target).
const MAX_LEN: usize = 16 << 10;

/// Appends `tokens` tokens to `layer` (every layer when `None`).
fn feed(set: &mut dyn KvCache, layer: Option<usize>, tokens: usize, seed: u64) -> Result<()> {
    let layers = layer.map_or(0..MODEL.layers, |l| l..l + 1);
    for l in layers {
        let n = MODEL.rows() * tokens * MODEL.head_dim;
        let k = xquant_wgpu::synth::normal(n, seed + l as u64);
        let v = xquant_wgpu::synth::normal(n, seed + 50 + l as u64);
        pollster::block_on(set.append(l, KvInput::F32(&k), KvInput::F32(&v)))?;
    }
    Ok(())
}

fn main() -> Result<()> {
    let ctx = Arc::new(pollster::block_on(GpuContext::new(
        &ContextOptions::default(),
    ))?);
    // "default": KIVI-2's quantizer, the cache set's default when the corpus was written.
    let small = CacheConfig {
        quant: XQuantConfig {
            group_quant_size: 4,
            ..KIVI_2
        },
        window: 4,
        sinks: 2,
        max_ctx: 128,
        page_tokens: 8,
        ..CacheConfig::default()
    };
    let pairs = CacheConfig {
        quant: XQuantConfig {
            group_quant_size: 4,
            ..XQuantConfig::default()
        },
        sinks: 0,
        page_tokens: 0,
        ..small
    };
    let mut lloyd = small.plan(MODEL.layers, MODEL.head_dim)?;
    for l in &mut lloyd.layers {
        for e in [&mut l.key, &mut l.value] {
            *e = TensorPlan {
                levels: Levels::LloydMax,
                rotation: Rotation::Hadamard,
                ..TensorPlan::own(3, ValueAxis::Channels)
            };
        }
    }
    let sliding = small
        .plan(MODEL.layers, MODEL.head_dim)?
        .with_model_windows(&[Some(8), None]);
    // (name, plan, options, appends: (layer or all, tokens)).
    type Appends = &'static [(Option<usize>, usize)];
    let ragged: Appends = &[(None, 3), (None, 1), (None, 9), (None, 1), (None, 6)];
    let cases: Vec<(&str, CachePlan, CacheConfig, Appends)> = vec![
        (
            "default",
            small.plan(MODEL.layers, MODEL.head_dim)?,
            small,
            ragged,
        ),
        (
            "pairs",
            pairs.plan(MODEL.layers, MODEL.head_dim)?,
            pairs,
            ragged,
        ),
        (
            "pairs out of step",
            pairs.plan(MODEL.layers, MODEL.head_dim)?,
            pairs,
            &[
                (None, 4),
                (Some(0), 13),
                (Some(1), 5),
                (Some(1), 14),
                (Some(0), 1),
            ],
        ),
        ("rotated lloyd-max", lloyd, small, ragged),
        (
            "sliding",
            sliding,
            small,
            &[(None, 5), (None, 17), (None, 1), (None, 9)],
        ),
    ];
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/saved-cache");
    let io = |e: std::io::Error| XqError::Io(format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(&dir).map_err(io)?;
    let write = |name: &str, bytes: Vec<u8>| -> Result<()> {
        assert!(bytes.len() <= MAX_LEN, "{name}: {} bytes", bytes.len());
        let path = dir.join(harness::input_name(&bytes));
        std::fs::write(&path, &bytes).map_err(io)?;
        println!("{name}: {} bytes -> {}", bytes.len(), path.display());
        Ok(())
    };
    for (name, plan, config, appends) in cases {
        let mut set = CacheSet::for_plan(ctx.clone(), MODEL, plan, config.options())?;
        for (i, &(layer, tokens)) in appends.iter().enumerate() {
            feed(&mut set, layer, tokens, 100 * i as u64)?;
        }
        write(name, pollster::block_on(set.save())?)?;
    }
    for (name, windows) in [("f16", [None, None]), ("f16 sliding", [Some(6), None])] {
        let mut set = Fp16CacheSet::for_model(ctx.clone(), MODEL, 128, DType::F16)?
            .with_attention_windows(&windows)?;
        for (i, tokens) in [3, 1, 9, 1].into_iter().enumerate() {
            feed(&mut set, None, tokens, 7 * i as u64)?;
        }
        write(name, pollster::block_on(set.save())?)?;
    }
    Ok(())
}

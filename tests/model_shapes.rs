//! Llama models of unusual shapes, written by the test (random weights, tests/common/gguf.rs):
//! the WGSL forward against the CPU reference (a prefill, then decode steps over the f16 cache
//! and the default XQuant cache), and the shapes the kernels cannot run refused with typed
//! errors before anything runs.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::gguf::{TinyLlama, Value};
use common::gpu::{assert_no_gpu_errors, block};
use xquant_wgpu::cache::CacheConfig;
use xquant_wgpu::model::cpu::{CpuKv, CpuModel};
use xquant_wgpu::model::{CacheChoice, GgmlType, Gguf, GpuModel, Logits, ModelConfig, Runtime};

/// Largest |GPU − CPU| logit difference allowed, as a share of the reference's logit scale
/// (their root mean square over the pass; with tied embeddings a token's own logit stands far
/// above the rest, so the largest |logit| would be a lax scale): f32 sums in another order,
/// and K/V rounded to f16 on both sides (a value on a rounding boundary may round apart).
/// Observed up to 1.0e-4 on lavapipe (see `check`'s output).
const REL_TOL: f32 = 1e-3;

/// The prefill (11 tokens) and the three-token step run the tiled `matmul_tiled` (8 tokens a
/// tile, the second tile ragged); the one-token step runs `matmul_few`.
const PREFILL: [u32; 11] = [0, 3, 1, 4, 1, 5, 9, 2, 6, 5, 3];
const STEPS: [&[u32]; 2] = [&[7], &[8, 9, 7]];

/// Runs the prefill and the decode steps on the GPU (over the f16 cache, and with `xquant` also
/// over the default XQuant cache) and on the CPU; returns the largest relative logit
/// difference seen.
fn check(spec: TinyLlama, xquant: bool) -> f32 {
    let Some(ctx) = common::gpu::gpu() else {
        return 0.0;
    };
    let started = std::time::Instant::now();
    let bytes = spec.gguf();
    let g = Gguf::parse(&bytes).unwrap();
    let rt = Runtime::load(ctx.clone(), &bytes).unwrap();
    assert_eq!(rt.model.cfg.head_dim, spec.head_dim());
    let cpu = CpuModel::load(&g, &bytes).unwrap();
    let mut kv = CpuKv::default();
    let steps: Vec<&[u32]> = std::iter::once(&PREFILL[..]).chain(STEPS).collect();
    let wants: Vec<Vec<f32>> = steps.iter().map(|s| cpu.forward(s, &mut kv)).collect();
    let mut worst = 0.0f32;
    let mut choices = vec![CacheChoice::F16];
    if xquant {
        choices.push(CacheChoice::XQuant(CacheConfig::default()));
    }
    for choice in choices {
        let mut cache = rt.cache(&choice, 64).unwrap();
        let mut pos = 0;
        for (step, want) in steps.iter().zip(&wants) {
            let got = block(rt.model.forward(step, pos, cache.as_mut(), Logits::All)).unwrap();
            assert_eq!(got.len(), want.len());
            let scale = (want.iter().map(|v| v * v).sum::<f32>() / want.len() as f32).sqrt();
            let (i, diff) = got
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .enumerate()
                .fold((0, 0.0f32), |m, (i, d)| if d > m.1 { (i, d) } else { m });
            let rel = diff / scale;
            assert!(
                rel <= REL_TOL,
                "{spec:?} {}: {} tokens at {pos}: logit {i}: gpu {} cpu {} (rms \
                 {scale}): {rel:.2e} of the scale > {REL_TOL:.0e}",
                choice.describe(),
                step.len(),
                got[i],
                want[i]
            );
            worst = worst.max(rel);
            pos += step.len();
        }
    }
    assert_no_gpu_errors(&ctx);
    eprintln!(
        "{spec:?}: max |gpu - cpu| = {worst:.2e} of the logits' scale (tolerance {REL_TOL:.0e}), \
         {:.1} s",
        started.elapsed().as_secs_f32()
    );
    worst
}

#[test]
fn hidden_and_ffn_wider_than_a_matmul_tile_q4_1() {
    // K = 2304 (hidden) and 6144 (ffn): wide rows (wider than the 2048 weights `matmul`
    // holds at once; with K a multiple of 32 they run `matmul_tiled` and `matmul_few`). Narrow
    // heads keep the attention weights small, and the f16 cache alone keeps it quick: the
    // caches differ in attention only, which the other shapes check over both. A vocabulary
    // of 99 leaves the output projection's last row quad (Q4_1 is uploaded in quads of rows)
    // a real row and three of padding.
    check(
        TinyLlama {
            layers: 1,
            hidden: 2304,
            heads: 8,
            kv_heads: 2,
            head_dim: Some(64),
            ffn: 6144,
            vocab: 99,
            weights: GgmlType::Q4_1,
            seed: 1,
            sliding_window: None,
        },
        false,
    );
}

#[test]
fn head_dim_96_f32() {
    check(
        TinyLlama {
            layers: 2,
            hidden: 384,
            heads: 4,
            kv_heads: 4,
            head_dim: None,
            ffn: 1024,
            vocab: 128,
            weights: GgmlType::F32,
            seed: 2,
            sliding_window: None,
        },
        true,
    );
}

#[test]
fn head_dim_128_from_key_length_q8_0() {
    // Query width heads · head_dim = 512 differs from the hidden size 256. A vocabulary of
    // 66 leaves the output projection's last row quad (Q8_0 is uploaded in quads of rows)
    // two real rows and two of padding.
    check(
        TinyLlama {
            layers: 2,
            hidden: 256,
            heads: 4,
            kv_heads: 2,
            head_dim: Some(128),
            ffn: 512,
            vocab: 66,
            weights: GgmlType::Q8_0,
            seed: 3,
            sliding_window: None,
        },
        true,
    );
}

#[test]
fn grouped_query_attention_4_to_1_f16() {
    check(
        TinyLlama {
            layers: 1,
            hidden: 512,
            heads: 8,
            kv_heads: 2,
            head_dim: None,
            ffn: 1408,
            vocab: 100,
            weights: GgmlType::F16,
            seed: 4,
            sliding_window: None,
        },
        true,
    );
}

/// A model with `spec`'s metadata (and `extra`), no tensors: what the loader checks first.
fn metadata_only(spec: TinyLlama, extra: Vec<(&str, Value)>) -> Gguf {
    let mut w = spec.metadata();
    for (k, v) in extra {
        w.meta(k, v);
    }
    Gguf::parse(&w.bytes()).unwrap()
}

const SMALL: TinyLlama = TinyLlama {
    layers: 1,
    hidden: 64,
    heads: 2,
    kv_heads: 1,
    head_dim: None,
    ffn: 128,
    vocab: 16,
    weights: GgmlType::F32,
    seed: 5,
    sliding_window: None,
};

#[test]
fn shapes_the_kernels_cannot_run_are_refused() {
    let refused = |spec: TinyLlama, extra: Vec<(&str, Value)>| {
        ModelConfig::from_gguf(&metadata_only(spec, extra)).unwrap_err()
    };
    // RoPE rotates pairs of channels.
    let e = refused(
        TinyLlama {
            hidden: 36,
            heads: 4,
            ..SMALL
        },
        vec![],
    );
    assert_eq!(e.kind(), "ConfigError", "{e}");
    assert!(
        e.message().contains("head_dim 9") && e.message().contains("even"),
        "{e}"
    );
    let e = refused(
        SMALL,
        vec![
            ("llama.attention.key_length", Value::U32(64)),
            ("llama.attention.value_length", Value::U32(32)),
        ],
    );
    assert_eq!(e.kind(), "ConfigError", "{e}");
    assert!(e.message().contains("value_length"), "{e}");
    let e = refused(SMALL, vec![("llama.feed_forward_length", Value::U32(0))]);
    assert_eq!(e.kind(), "ConfigError", "{e}");

    // Limits of the device and of the kernels' 32-bit indices: refused by the GPU model's
    // constructor before any weight is read.
    let Some(ctx) = common::gpu::gpu() else {
        return;
    };
    let gpu_refused = |g: &Gguf| match GpuModel::load(ctx.clone(), g, &[]) {
        Ok(_) => panic!("loaded"),
        Err(e) => e,
    };
    let wide = metadata_only(
        TinyLlama {
            head_dim: Some(2048),
            ..SMALL
        },
        vec![],
    );
    let e = gpu_refused(&wide);
    assert_eq!(e.kind(), "TooLargeError", "{e}");
    assert!(e.message().contains("head_dim 2048"), "{e}");
    // 65537 × 65536 embedding elements: more than a u32 index reaches.
    let huge = metadata_only(
        TinyLlama {
            hidden: 65536,
            heads: 512,
            kv_heads: 512,
            vocab: 65537,
            ..SMALL
        },
        vec![],
    );
    let e = gpu_refused(&huge);
    assert_eq!(e.kind(), "TooLargeError", "{e}");
    assert!(e.message().contains("token_embd.weight"), "{e}");
    assert_no_gpu_errors(&ctx);
}

#[test]
fn gemma3_with_a_sliding_window_of_4() {
    // Gemma 3's graph (Q/K norms, post norms, GELU, RoPE on halves with a local and a global
    // base, the embedding scaled) and its weight types as random blocks (Q5_0, Q4_0, Q8_0,
    // Q4_K, Q5_K, Q6_K and Q5_1, each read by the matmuls in its own layout); six layers, the
    // sixth global, the others sliding over 4 positions:
    // the 11-token prefill and the decode steps see past the window.
    check(
        TinyLlama {
            layers: 6,
            hidden: 128,
            heads: 4,
            kv_heads: 2,
            head_dim: Some(64),
            ffn: 512,
            vocab: 96,
            weights: GgmlType::Q8_0,
            seed: 7,
            sliding_window: Some(4),
        },
        true,
    );
}

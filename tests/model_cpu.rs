//! The real model on the CPU: GGUF parsing, tokenizer, the reference forward.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use xquant_wgpu::model::cpu::{CpuKv, CpuModel};
use xquant_wgpu::model::{GgmlType, Gguf, ModelConfig, Tokenizer};

#[test]
fn cpu_reference_says_paris() {
    let bytes = model_or_skip!();
    let g = Gguf::parse(&bytes).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let ids = tok.encode("The capital of France is", false);
    eprintln!("ids {ids:?}");
    let m = CpuModel::load(&g, &bytes).unwrap();
    let mut kv = CpuKv::default();
    let logits = m.forward(&ids, &mut kv);
    let v = m.cfg.vocab;
    let last = &logits[(ids.len() - 1) * v..];
    let best = last
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0;
    eprintln!("next: {:?}", tok.decode(&[best as u32]));
    let _ = (GgmlType::F32, ModelConfig::from_gguf(&g).unwrap());
}

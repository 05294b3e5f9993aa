//! Gemma 3 270M past its sliding window, against llama.cpp: the WGSL forward over the f16
//! cache and over the default XQuant cache at the positions `tests/data/gemma3-llama-cpp-moby1.json`
//! holds (llama.cpp's top-5 logits on 560 tokens of Moby-Dick ch. 1, written by
//! `scripts/llama-cpp-reference.py`), each the last token of a pass: a prefill, passes of up to
//! 180 tokens, and single tokens at 512 and 513, where the local layers' window starts to slide.
//!
//! `cargo run --release --example gemma3_llama_cpp -- [MODEL.gguf]` (default: where
//! `scripts/fetch-model gemma3-270m` caches it). About a minute per cache on lavapipe. Exits
//! non-zero when the f16 cache's top-1 differs from llama.cpp's or a top-5 logit differs by more
//! than `LLAMA_CPP_LOGIT_TOL`; the XQuant cache's top-1 agreement is printed.

use std::sync::Arc;

use xquant_wgpu::gpu::{ContextOptions, GpuContext};
use xquant_wgpu::model::runtime::argmax;
use xquant_wgpu::model::{CacheChoice, Logits, Runtime};
use xquant_wgpu::Result;

/// llama.cpp rounds activations to 8 bits for its dot products: its logits differ from the
/// f32 CPU reference by up to 0.75 at these positions, and from the GPU forward alike.
const LLAMA_CPP_LOGIT_TOL: f32 = 1.0;

fn main() -> Result<()> {
    let path = std::env::args().nth(1).unwrap_or_else(|| {
        let home = std::env::var("HOME").unwrap_or_default();
        let dir = std::env::var("XQUANT_CACHE").unwrap_or(format!("{home}/.cache/xquant-wgpu"));
        format!("{dir}/gemma-3-270m-q4_k_m.gguf")
    });
    let bytes =
        std::fs::read(&path).map_err(|e| xquant_wgpu::XqError::Io(format!("{path}: {e}")))?;
    let ctx = Arc::new(pollster::block_on(GpuContext::new(
        &ContextOptions::default(),
    ))?);
    println!("adapter: {}", ctx.adapter());
    let rt = Runtime::load(ctx.clone(), &bytes)?;
    println!(
        "weights on the GPU: {} bytes (the file: {})",
        ctx.allocated_bytes(),
        bytes.len()
    );
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("../tests/data/gemma3-llama-cpp-moby1.json"))
            .map_err(|e| xquant_wgpu::XqError::Format(e.to_string()))?;
    let ids: Vec<u32> = fixture["ids"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_u64().map(|v| v as u32))
        .collect();
    let mut checked: Vec<(usize, Vec<(usize, f32)>)> = fixture["positions"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(p, e)| {
            let top = e["top"].as_array().into_iter().flatten();
            let logits = e["logits"].as_array().into_iter().flatten();
            let pairs = top
                .zip(logits)
                .map(|(t, l)| {
                    (
                        t.as_u64().unwrap_or(0) as usize,
                        l.as_f64().unwrap_or(0.0) as f32,
                    )
                })
                .collect();
            (p.parse().unwrap_or(0), pairs)
        })
        .collect();
    checked.sort_by_key(|c| c.0);
    let mut failed = false;
    for (name, choice) in [
        ("f16", CacheChoice::F16),
        ("xquant (default)", CacheChoice::XQuant(Default::default())),
    ] {
        let started = std::time::Instant::now();
        let mut cache = rt.cache(&choice, ids.len())?;
        let (mut at, mut agree, mut worst) = (0, 0, 0.0f32);
        for (p, top) in &checked {
            let row = pollster::block_on(rt.model.forward(
                &ids[at..=*p],
                at,
                cache.as_mut(),
                Logits::Last,
            ))?;
            at = p + 1;
            let ours = argmax(&row) as usize;
            agree += usize::from(ours == top[0].0);
            let d = top
                .iter()
                .map(|&(i, l)| (row[i] - l).abs())
                .fold(0.0f32, f32::max);
            worst = worst.max(d);
            println!(
                "{name}: position {p}: ours {ours}, llama.cpp {} (top-5 logits within {d:.3})",
                top[0].0
            );
        }
        println!(
            "{name}: top-1 agrees at {agree}/{} positions, top-5 logits within {worst:.3}, {:.1} s",
            checked.len(),
            started.elapsed().as_secs_f32()
        );
        if name == "f16" && (agree != checked.len() || worst > LLAMA_CPP_LOGIT_TOL) {
            failed = true;
        }
    }
    if failed {
        eprintln!("the f16 cache disagrees with llama.cpp");
        std::process::exit(1);
    }
    Ok(())
}

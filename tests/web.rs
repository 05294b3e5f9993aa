//! The golden values and the GPU-vs-CPU property trials, in a real browser on WebGPU
//! (`wasm-pack test --headless --chrome`): another GPU, other limits (256 invocations per
//! workgroup, no shader-f16).
#![cfg(target_arch = "wasm32")]

/// The shared helpers, under the names the suite uses (`crate::common::...`).
mod common {
    #[path = "../common/attend.rs"]
    #[allow(dead_code)] // `dense` serves the native attention tests' own set-ups
    pub mod attend;
    #[path = "../common/golden.rs"]
    pub mod golden;
    #[path = "../common/suite.rs"]
    pub mod suite;
    #[path = "../common/tolerances.rs"]
    #[allow(dead_code)] // the browser runs only the kernel suite's share
    pub mod tolerances;
    #[path = "../common/trial.rs"]
    #[allow(unused_imports)] // it re-exports tolerances for the native suites too
    pub mod trial;
}

use std::sync::Arc;

use common::{attend, suite};

use wasm_bindgen_test::*;
use xquant_wgpu::gpu::{ContextOptions, GpuContext};

wasm_bindgen_test_configure!(run_in_browser);

async fn context() -> GpuContext {
    let ctx = GpuContext::new(&ContextOptions::default())
        .await
        .expect("WebGPU adapter (chromium --enable-unsafe-webgpu)");
    web_sys_log(&format!("adapter: {}", ctx.adapter()));
    ctx
}

fn web_sys_log(s: &str) {
    wasm_bindgen_test::console_log!("{s}");
}

#[wasm_bindgen_test]
async fn golden_values_in_the_browser() {
    let ctx = context().await;
    suite::golden_on_gpu(&ctx).await;
    ctx.check().expect("no GPU errors");
}

/// The native batch's [`suite::browser_seeds`]: every kind of trial it draws.
#[wasm_bindgen_test]
async fn kernels_match_the_cpu_reference_in_the_browser() {
    let ctx = context().await;
    let seeds = suite::browser_seeds();
    assert_eq!(
        suite::uncovered_kinds(seeds.iter().copied()),
        Vec::<String>::new()
    );
    let mut ties = 0;
    for &seed in &seeds {
        ties += suite::run_trial(&ctx, seed).await;
    }
    web_sys_log(&format!(
        "trials {seeds:?} of the native batch, {ties} near-tie code differences"
    ));
    ctx.check().expect("no GPU errors");
}

/// The 8-channel kernels' register path, whose vector views share bindings with the scalar
/// kernels' variables (one variable per binding per entry point): every code width once.
#[wasm_bindgen_test]
async fn kept_group_kernels_match_the_cpu_reference_in_the_browser() {
    let ctx = context().await;
    for seed in 0..8u64 {
        let t = common::trial::Trial::kept_group(seed, 1 + seed as u8);
        suite::run_trial_on(&ctx, seed, t).await;
    }
    ctx.check().expect("no GPU errors");
}

#[wasm_bindgen_test]
async fn fused_attention_matches_dense_attention_in_the_browser() {
    let ctx = Arc::new(context().await);
    let mut worst = 0.0f32;
    // Seeds 0..8 cover every bit width once, residual widths 0, 1, 2 and 4 twice each.
    for seed in 0..8 {
        let r = attend::attention_trial(&ctx, seed).await;
        worst = worst.max(r.worst);
    }
    web_sys_log(&format!(
        "fused attention: 8 trials, worst relative difference {worst:.2e}"
    ));
    ctx.check().expect("no GPU errors");
}

#[wasm_bindgen_test]
async fn rotated_caches_attend_like_dense_attention_in_the_browser() {
    let ctx = Arc::new(context().await);
    let mut worst = 0.0f32;
    for seed in 0..2 {
        let r = attend::rotated_attention_trial(&ctx, seed).await;
        assert!(
            r.case.contains("\"hadamard\""),
            "seed {seed} rotated nothing"
        );
        worst = worst.max(r.worst);
    }
    web_sys_log(&format!(
        "rotated plans: 2 trials, worst relative difference {worst:.2e}"
    ));
    ctx.check().expect("no GPU errors");
}

#[wasm_bindgen_test]
async fn lloyd_max_caches_attend_like_dense_attention_in_the_browser() {
    let ctx = Arc::new(context().await);
    let mut worst = 0.0f32;
    for seed in 0..1 {
        let r = attend::levels_attention_trial(&ctx, seed).await;
        assert!(
            r.case.contains("\"lloyd-max\""),
            "seed {seed}: no Lloyd-Max entry"
        );
        worst = worst.max(r.worst);
    }
    web_sys_log(&format!(
        "Lloyd-Max plans: 1 trial, worst relative difference {worst:.2e}"
    ));
    ctx.check().expect("no GPU errors");
}

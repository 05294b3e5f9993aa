//! Fused split-K attention over the packed cache against dense attention over `fetch()`:
//! random configurations (every bit width, residuals, both value axes, η, windows, page
//! boundaries, GQA 1/3/4, 1–8 query tokens, contexts from one token to several pages).
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::attend::attention_trial;
use common::gpu::{assert_no_gpu_errors, block};

/// Random trials run natively: every bit width twice, every residual width four times.
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

//! The GPU kernels reproduce the reference implementation's golden values (f32 params).
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::gpu::{assert_no_gpu_errors, block};

#[test]
fn gpu_matches_golden_for_f16_and_f32_inputs() {
    let ctx = gpu_or_skip!();
    block(common::suite::golden_on_gpu(&ctx));
    assert_no_gpu_errors(&ctx);
}

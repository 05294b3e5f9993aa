//! Every buffer the library allocates is counted and released when its owner goes.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::gpu::{assert_no_gpu_errors, block};
use xquant_wgpu::cache::{CacheConfig, CacheSet, KvCache, KvInput, ModelSpec};
use xquant_wgpu::{DType, QuantSpec};

#[test]
fn allocated_bytes_return_to_the_start() {
    let ctx = gpu_or_skip!();
    let model = ModelSpec {
        layers: 4,
        kv_heads: 2,
        head_dim: 32,
        batch: 1,
    };
    let x = xquant_wgpu::synth::normal(2 * 200 * 32, 1);
    let start = ctx.allocated_bytes();
    for i in 0..200 {
        let mut set = CacheSet::for_model(ctx.clone(), model, CacheConfig::default()).unwrap();
        for l in 0..4 {
            let t = if i % 2 == 0 { 200 } else { 1 };
            let f = block(set.update_and_fetch(
                l,
                KvInput::F32(&x[..2 * t * 32]),
                KvInput::F32(&x[..2 * t * 32]),
            ))
            .unwrap();
            assert!(f.tokens >= 1);
        }
        assert!(ctx.allocated_bytes() > start);
        if i == 0 {
            let st = set.stats();
            let held = ctx.allocated_bytes() - start;
            assert!(
                held >= st.allocated_bytes + st.scratch_bytes,
                "the counter sees the set's buffers"
            );
        }
    }
    let t = ctx
        .upload(&x, &[2, 200, 32], DType::F16, Default::default())
        .unwrap();
    let q = block(ctx.quantize(&t, &QuantSpec::new(2, 32))).unwrap();
    drop((t, q));
    assert_eq!(ctx.allocated_bytes(), start, "everything freed");
    assert_no_gpu_errors(&ctx);
}

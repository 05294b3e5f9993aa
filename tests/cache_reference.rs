//! The reference implementation's 19 cache tests, ported with the `reference` decode policy
//! (every call quantized as its own group). fp16 standard-normal tensors, D = 64,
//! [B, H] = [1, 2].
#![cfg(not(target_arch = "wasm32"))]

mod common;

use std::sync::Arc;

use common::cache_model::{halves, mix, mse, randn_f16};
use common::gpu::{assert_no_gpu_errors, block};
use xquant_wgpu::cache::{
    CacheConfig, CacheSet, Coordinator, DecodePolicy, KvCache, KvInput, ModelSpec,
};
use xquant_wgpu::gpu::GpuContext;
use xquant_wgpu::reference::{pair_layers, Role};
use xquant_wgpu::synth::SplitMix;
use xquant_wgpu::{DType, QuantSpec, XQuantConfig};

const HEADS: usize = 2;
const D: usize = 64;

fn config(group_size: usize, residual_bits: u8, max_ctx: usize) -> CacheConfig {
    CacheConfig {
        quant: XQuantConfig {
            layers_per_group: group_size,
            residual_bits,
            ..Default::default()
        },
        max_ctx,
        decode_policy: DecodePolicy::Reference,
        ..Default::default()
    }
}

fn set(ctx: &Arc<GpuContext>, layers: usize, cfg: CacheConfig) -> CacheSet {
    let model = ModelSpec {
        layers,
        kv_heads: HEADS,
        head_dim: D,
        batch: 1,
    };
    CacheSet::for_model(ctx.clone(), model, cfg).unwrap()
}

fn n(tokens: usize) -> usize {
    HEADS * tokens * D
}

/// update_and_fetch with the same tensor as keys and values; returns (keys, values) read back.
fn step(s: &mut CacheSet, layer: usize, x: &[u16]) -> (Vec<f32>, Vec<f32>, Vec<usize>) {
    let f = block(s.update_and_fetch(layer, KvInput::F16(x), KvInput::F16(x))).unwrap();
    let dims = f.keys.shape().dims().to_vec();
    (
        block(s.read(&f.keys)).unwrap(),
        block(s.read(&f.values)).unwrap(),
        dims,
    )
}

/// The MSE of the values a layer reconstructs for a 32-token prefill of `x`, with `y` fed to
/// the reuse layer, under `residual_bits`: (anchor MSE, reuse MSE).
fn pair_mse(ctx: &Arc<GpuContext>, x: &[u16], y: &[u16], residual_bits: u8) -> (f64, f64) {
    let mut s = set(ctx, 2, config(2, residual_bits, 8192));
    let (_, va, _) = step(&mut s, 0, x);
    let (_, vr, _) = step(&mut s, 1, y);
    (mse(&va, &halves(x)), mse(&vr, &halves(y)))
}

// 1
#[test]
fn cache_without_coordinator_acts_as_anchor() {
    let ctx = gpu_or_skip!();
    let mut s = set(&ctx, 1, config(2, 4, 8192));
    assert_eq!(s.roles()[0].role, Role::Anchor);
    let x = randn_f16(&mut SplitMix::new(1), n(32));
    let (k, _, dims) = step(&mut s, 0, &x);
    assert_eq!(dims, [1, HEADS, 32, D]);
    assert!(
        mse(&k, &halves(&x)) < 0.2,
        "a 2-bit anchor reconstructs its own data"
    );
    assert_eq!(s.live_tokens(), 0, "no readers: nothing published");
    assert_no_gpu_errors(&ctx);
}

// 2
#[test]
fn for_model_pairs_six_layers_into_three_groups() {
    let ctx = gpu_or_skip!();
    let s = set(&ctx, 6, config(2, 4, 8192));
    let roles: Vec<(Role, usize)> = s.roles().iter().map(|r| (r.role, r.group)).collect();
    assert_eq!(
        roles,
        [
            (Role::Anchor, 0),
            (Role::Reuse, 0),
            (Role::Anchor, 1),
            (Role::Reuse, 1),
            (Role::Anchor, 2),
            (Role::Reuse, 2)
        ]
    );
}

// 3
#[test]
fn coordinator_round_trip() {
    let ctx = gpu_or_skip!();
    let x: Vec<f32> = halves(&randn_f16(&mut SplitMix::new(3), n(16)));
    let t = ctx
        .upload_f32(&x, &[1, HEADS, 16, D], xquant_wgpu::ParamsPrecision::F16)
        .unwrap();
    let q = block(ctx.quantize(&t, &QuantSpec::new(2, 32))).unwrap();
    let before = block(ctx.read_codes(&q.codes)).unwrap();
    let mut c = Coordinator::new(8192);
    c.publish(0, 0, 16, 1, q.codes.clone()).unwrap();
    assert_eq!(c.live_tokens(), 16);
    let got = c.fetch(0, 0).expect("published codes");
    assert_eq!(
        block(ctx.read_codes(&got)).unwrap(),
        before,
        "codes come back exactly"
    );
    assert_eq!(c.live_tokens(), 0);
    assert!(c.fetch(0, 0).is_none(), "consumed");
    assert!(c.fetch(0, 16).is_none(), "missing");
    assert!(c.fetch(1, 0).is_none(), "missing group");
}

// 4
#[test]
fn anchor_shapes_after_prefill_and_decode() {
    let ctx = gpu_or_skip!();
    let mut g = SplitMix::new(4);
    let mut s = set(&ctx, 2, config(2, 4, 8192));
    step(&mut s, 0, &randn_f16(&mut g, n(32)));
    let (k, v, dims) = step(&mut s, 0, &randn_f16(&mut g, n(1)));
    assert_eq!(dims, [1, HEADS, 33, D]);
    assert_eq!((k.len(), v.len()), (n(33), n(33)));
}

// 5
#[test]
fn reuse_shapes_after_prefill_and_decode() {
    let ctx = gpu_or_skip!();
    let mut g = SplitMix::new(5);
    let mut s = set(&ctx, 2, config(2, 4, 8192));
    let (p, d) = (randn_f16(&mut g, n(32)), randn_f16(&mut g, n(1)));
    step(&mut s, 0, &p);
    step(&mut s, 1, &p);
    step(&mut s, 0, &d);
    let (_, _, dims) = step(&mut s, 1, &d);
    assert_eq!(dims, [1, HEADS, 33, D]);
}

// 6
#[test]
fn values_are_reconstructed_finite() {
    let ctx = gpu_or_skip!();
    let mut g = SplitMix::new(6);
    let mut s = set(&ctx, 2, config(2, 4, 8192));
    let x = randn_f16(&mut g, n(32));
    step(&mut s, 0, &x);
    let (_, v, dims) = step(&mut s, 1, &mix(&x, &randn_f16(&mut g, n(32)), 0.1));
    assert_eq!(dims, [1, HEADS, 32, D]);
    assert!(v.iter().all(|x| x.is_finite()));
}

// 7
#[test]
fn identical_data_reuse_costs_nothing() {
    let ctx = gpu_or_skip!();
    let x = randn_f16(&mut SplitMix::new(7), n(32));
    let (own, reuse) = pair_mse(&ctx, &x, &x, 0);
    assert!(
        reuse <= 1.05 * own + 1e-4,
        "reuse {reuse} vs self-quant {own}"
    );
}

// 8
#[test]
fn residual_lowers_mse_on_correlated_pair() {
    let ctx = gpu_or_skip!();
    let mut g = SplitMix::new(8);
    let x = randn_f16(&mut g, n(32));
    let y = mix(&x, &randn_f16(&mut g, n(32)), 0.02);
    let (_, r0) = pair_mse(&ctx, &x, &y, 0);
    let (_, r2) = pair_mse(&ctx, &x, &y, 2);
    assert!(r2 < r0, "residual 2: {r2}, residual 0: {r0}");
}

// 9
#[test]
fn correlated_reuse_is_near_self_quant() {
    let ctx = gpu_or_skip!();
    let mut g = SplitMix::new(9);
    let x = randn_f16(&mut g, n(32));
    let y = mix(&x, &randn_f16(&mut g, n(32)), 0.02);
    let (own, reuse) = pair_mse(&ctx, &x, &y, 0);
    assert!(reuse < 1.5 * own, "reuse {reuse} vs self-quant {own}");
}

// 10
#[test]
fn residual_recovers_uncorrelated_pair() {
    let ctx = gpu_or_skip!();
    let mut g = SplitMix::new(10);
    let x = randn_f16(&mut g, n(32));
    let y = mix(&x, &randn_f16(&mut g, n(32)), 1.0);
    let (_, r0) = pair_mse(&ctx, &x, &y, 0);
    let (_, r4) = pair_mse(&ctx, &x, &y, 4);
    assert!(r4 < 0.1 * r0, "residual 4: {r4}, residual 0: {r0}");
}

// 11 (pure reuse: with a residual a reuse layer stores more than its anchor)
#[test]
fn reuse_key_bytes_below_anchor_below_fp16() {
    let ctx = gpu_or_skip!();
    let mut g = SplitMix::new(11);
    let mut s = set(&ctx, 2, config(2, 0, 8192));
    let x = randn_f16(&mut g, n(32));
    step(&mut s, 0, &x);
    step(&mut s, 1, &x);
    let st = s.stats();
    let (a, r) = (
        st.layers[0].key.effective_bits,
        st.layers[1].key.effective_bits,
    );
    assert!(r < a && a < 16.0, "reuse {r} < anchor {a} < fp16 16");
}

// 12
#[test]
fn pure_reuse_is_below_two_bits() {
    let ctx = gpu_or_skip!();
    let mut s = set(&ctx, 2, config(2, 0, 8192));
    let x = randn_f16(&mut SplitMix::new(12), n(32));
    step(&mut s, 0, &x);
    step(&mut s, 1, &x);
    let bits = s.stats().layers[1].key.effective_bits;
    assert!(bits < 2.0, "{bits}");
}

// 13
#[test]
fn decode_keeps_anchor_and_reuse_in_step() {
    let ctx = gpu_or_skip!();
    let mut g = SplitMix::new(13);
    let mut s = set(&ctx, 2, config(2, 4, 8192));
    let p = randn_f16(&mut g, n(20));
    step(&mut s, 0, &p);
    step(&mut s, 1, &p);
    for i in 0..5 {
        let d = randn_f16(&mut g, n(1));
        let (_, _, a) = step(&mut s, 0, &d);
        let (_, _, r) = step(&mut s, 1, &d);
        assert_eq!(a, r);
        assert_eq!(a[2], 21 + i);
    }
    assert_eq!(s.live_tokens(), 0);
}

// 14
#[test]
fn coordinator_budget_raises() {
    let ctx = gpu_or_skip!();
    let mut c: Coordinator<()> = Coordinator::new(16);
    c.publish(0, 0, 16, 1, ()).unwrap();
    let e = c.publish(0, 16, 1, 1, ()).unwrap_err();
    assert_eq!(e.kind(), "ContextBudgetError");
    assert!(e.to_string().contains("max_ctx"), "{e}");
    // The same through a cache set: the anchor runs one token past its unread budget.
    let mut g = SplitMix::new(14);
    let mut s = set(&ctx, 2, config(2, 4, 16));
    step(&mut s, 0, &randn_f16(&mut g, n(16)));
    let x = randn_f16(&mut g, n(1));
    let e = block(s.update_and_fetch(0, KvInput::F16(&x), KvInput::F16(&x))).unwrap_err();
    assert!(e.to_string().contains("max_ctx"), "{e}");
    assert_eq!(s.tokens(0), 16, "a refused call changes nothing");
    assert_eq!(s.live_tokens(), 16);
}

// 15
#[test]
fn group_size_three() {
    let ctx = gpu_or_skip!();
    let roles: Vec<Role> = pair_layers(6, 3).unwrap().iter().map(|r| r.role).collect();
    assert_eq!(
        roles,
        [
            Role::Anchor,
            Role::Reuse,
            Role::Reuse,
            Role::Anchor,
            Role::Reuse,
            Role::Reuse
        ]
    );
    let mut s = set(&ctx, 6, config(3, 4, 8192));
    let x = randn_f16(&mut SplitMix::new(15), n(32));
    for layer in 0..3 {
        let (_, _, dims) = step(&mut s, layer, &x);
        assert_eq!(dims, [1, HEADS, 32, D]);
    }
}

// 16
#[test]
fn determinism() {
    let ctx = gpu_or_skip!();
    let run = || {
        let mut g = SplitMix::new(16);
        let mut s = set(&ctx, 2, config(2, 4, 8192));
        let x = randn_f16(&mut g, n(32));
        let y = mix(&x, &randn_f16(&mut g, n(32)), 0.3);
        step(&mut s, 0, &x);
        step(&mut s, 1, &y)
    };
    assert_eq!(run(), run());
}

// 17
#[test]
fn small_budget_survives_single_token_decode() {
    let ctx = gpu_or_skip!();
    let mut g = SplitMix::new(17);
    let mut s = set(&ctx, 2, config(2, 4, 8));
    for i in 0..20 {
        let d = randn_f16(&mut g, n(1));
        step(&mut s, 0, &d);
        let (_, _, dims) = step(&mut s, 1, &d);
        assert_eq!(dims[2], i + 1);
    }
    assert_eq!(s.live_tokens(), 0);
}

// 18
#[test]
fn group_size_three_live_tokens_drain_as_readers_consume() {
    let ctx = gpu_or_skip!();
    let mut s = set(&ctx, 3, config(3, 4, 8192));
    let x = randn_f16(&mut SplitMix::new(18), n(16));
    step(&mut s, 0, &x);
    assert_eq!(s.live_tokens(), 16);
    step(&mut s, 1, &x);
    assert_eq!(s.live_tokens(), 16);
    step(&mut s, 2, &x);
    assert_eq!(s.live_tokens(), 0);
}

// 19
#[test]
fn pairing_survives_past_max_ctx() {
    let ctx = gpu_or_skip!();
    let mut g = SplitMix::new(19);
    let mut s = set(&ctx, 4, config(2, 0, 8));
    for _ in 0..12 {
        let d = randn_f16(&mut g, n(1));
        for layer in 0..4 {
            step(&mut s, layer, &d);
        }
    }
    let roles: Vec<Role> = s.roles().iter().map(|r| r.role).collect();
    assert_eq!(
        roles,
        [Role::Anchor, Role::Reuse, Role::Anchor, Role::Reuse]
    );
    assert!((0..4).all(|l| s.tokens(l) == 12));
    assert_eq!(s.live_tokens(), 0);
    // Every reuse layer read its anchor's codes: charged as (pure) reuse, not as a
    // fallback anchor.
    let st = s.stats();
    assert!(st.layers[1].key.effective_bits < st.layers[0].key.effective_bits);
    let _ = DType::F16;
}

//! The cache set with the window policy against the CPU model.

mod common;

use std::sync::Arc;

use common::cache_model::*;
use common::gpu::{assert_no_gpu_errors, block};
use xquant_wgpu::cache::{CacheConfig, CacheSet, KvInput, ModelSpec};
use xquant_wgpu::synth::SplitMix;
use xquant_wgpu::{DType, KvKind, XQuantConfig};

fn normal(g: &mut SplitMix, n: usize) -> Vec<f32> {
    (0..n).map(|_| g.normal()).collect()
}

#[test]
fn window_policy_matches_the_cpu_model() {
    let ctx = gpu_or_skip!();
    let model = ModelSpec {
        layers: 2,
        kv_heads: 2,
        head_dim: 16,
        batch: 1,
    };
    let config = CacheConfig {
        quant: XQuantConfig {
            group_quant_size: 8,
            ..Default::default()
        },
        window: 16,
        page_tokens: 24,
        output: DType::F32,
        ..Default::default()
    };
    let mut set = CacheSet::for_model(ctx.clone(), model, config).unwrap();
    let mut g = SplitMix::new(1);
    let rows = model.rows();
    let mut seqs = vec![
        [LayerSeq::new(rows, 16), LayerSeq::new(rows, 16)],
        [LayerSeq::new(rows, 16), LayerSeq::new(rows, 16)],
    ];
    // Prefill 37, then single tokens, then a chunk of 5, past two pages.
    let steps: Vec<usize> = std::iter::once(37)
        .chain(std::iter::repeat(1).take(20))
        .chain([5, 1, 1])
        .collect();
    for (s, &t) in steps.iter().enumerate() {
        let n = rows * t * 16;
        let k0 = normal(&mut g, n);
        let v0 = normal(&mut g, n);
        let layer_inputs = [
            (k0.clone(), v0.clone()),
            (
                k0.iter()
                    .map(|x| 0.8 * x + 0.3 * g.normal())
                    .collect::<Vec<_>>(),
                v0.iter().map(|x| 0.8 * x + 0.3 * g.normal()).collect(),
            ),
        ];
        for (l, (k, v)) in layer_inputs.iter().enumerate() {
            seqs[l][0].push(k);
            seqs[l][1].push(v);
            let f = block(set.update_and_fetch(l, KvInput::F32(k), KvInput::F32(v))).unwrap();
            let len = seqs[l][0].len;
            assert_eq!(f.tokens, len);
            assert_eq!(f.keys.shape().dims(), [1, 2, len, 16]);
            let q = quantized_tokens(len, 16, 8);
            for (kind, got) in [(KvKind::Key, &f.keys), (KvKind::Value, &f.values)] {
                let i = kind as usize;
                let spec = config.quant.spec(kind);
                let anchor = (l == 1).then(|| &seqs[0][i]);
                let want = expected_window(
                    &seqs[l][i],
                    anchor,
                    q,
                    &spec,
                    config.quant.residual_bits,
                    DType::F32,
                );
                let got = block(ctx.read_f32(got)).unwrap();
                assert_matches_model(&format!("step {s} layer {l} {kind:?}"), &got, &want, 0);
            }
        }
    }
    assert_no_gpu_errors(&ctx);
    let _ = Arc::clone(&ctx);
}

//! The GPU kernels reproduce the reference implementation's golden values (f32 params).

mod common;

use common::golden::{Golden, BITS, D, GROUP, N, RESIDUAL_BITS};
use common::gpu::{assert_no_gpu_errors, block};
use xquant_wgpu::{DType, ParamsPrecision, QuantSpec};

/// GPU division and fused multiply-add may differ from the CPU by an f32 ulp; on fp16
/// outputs that can flip one f16 rounding: one f16 ulp relative (2^-10).
const FP16_OUT_TOL: f32 = 1.0 / 1024.0;
/// f32 params: (max - min) / levels may differ by an ulp on the GPU.
const PARAM_TOL: f32 = 2e-7;

fn spec() -> QuantSpec {
    QuantSpec {
        params: ParamsPrecision::F32,
        ..QuantSpec::new(BITS, GROUP)
    }
}

fn assert_close(name: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let bound = tol * w.abs().max(1.0);
        assert!(
            (g - w).abs() <= bound,
            "{name}[{i}]: got {g}, want {w} (tol {bound})"
        );
    }
}

#[test]
fn gpu_matches_golden_for_f16_and_f32_inputs() {
    let ctx = gpu_or_skip!();
    let g = Golden::load();
    for dtype in [DType::F16, DType::F32] {
        let x = ctx
            .upload(&Golden::x(), &[1, 1, N, D], dtype, ParamsPrecision::F32)
            .unwrap();
        let y = ctx
            .upload(&Golden::y(), &[1, 1, N, D], dtype, ParamsPrecision::F32)
            .unwrap();
        let q = block(ctx.quantize(&x, &spec())).unwrap();
        let codes = block(ctx.read_codes(&q.codes)).unwrap();
        let want: Vec<u8> = g.flat("codes").iter().map(|&c| c as u8).collect();
        assert_eq!(codes, want, "{dtype:?}: codes [3, 32, 8] including padding");
        let (scale, zero) = block(ctx.read_params(&q.params)).unwrap();
        assert_close("scale", &scale, &g.flat("scale"), PARAM_TOL);
        assert_close("zero", &zero, &g.flat("zero"), PARAM_TOL);
        let recon = block(ctx.dequant(&q.codes, &q.params, DType::F16)).unwrap();
        assert_close(
            "recon_x_fp16",
            &block(ctx.read_f32(&recon)).unwrap(),
            &g.flat("recon_x_fp16"),
            FP16_OUT_TOL,
        );

        let reuse_params = block(ctx.compute_reuse_params(&y, &q.codes, &spec())).unwrap();
        let (rs, rz) = block(ctx.read_params(&reuse_params)).unwrap();
        assert_close("reuse_scale", &rs, &g.flat("reuse_scale"), PARAM_TOL);
        assert_close("reuse_zero", &rz, &g.flat("reuse_zero"), PARAM_TOL);
        let recon_y = block(ctx.dequant(&q.codes, &reuse_params, DType::F16)).unwrap();
        assert_close(
            "recon_y_fp16",
            &block(ctx.read_f32(&recon_y)).unwrap(),
            &g.flat("recon_y_fp16"),
            FP16_OUT_TOL,
        );
        let res =
            block(ctx.quantize_residual(&y, &recon_y, RESIDUAL_BITS, &spec(), DType::F16)).unwrap();
        assert_close(
            "residual_fp16",
            &block(ctx.read_f32(&res)).unwrap(),
            &g.flat("residual_fp16"),
            FP16_OUT_TOL,
        );

        let fused = block(ctx.reuse_fit(&y, &q.codes, &spec(), RESIDUAL_BITS, DType::F16)).unwrap();
        let full = block(ctx.reuse_reconstruct(&q.codes, &fused, DType::F16)).unwrap();
        assert_close(
            "recon_y_plus_res_fp16",
            &block(ctx.read_f32(&full)).unwrap(),
            &g.flat("recon_y_plus_res_fp16"),
            FP16_OUT_TOL,
        );

        let sim = block(ctx.cross_layer_similarity(&x, &y)).unwrap();
        assert!(
            (sim.mse - g.sim("mse")).abs() <= 1e-5 * g.sim("mse"),
            "mse {} vs {}",
            sim.mse,
            g.sim("mse")
        );
        assert!(
            (sim.cosine - g.sim("cosine")).abs() <= 1e-5,
            "cosine {}",
            sim.cosine
        );
    }
    assert_no_gpu_errors(&ctx);
}

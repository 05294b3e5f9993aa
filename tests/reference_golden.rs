//! The CPU reference reproduces the reference implementation's golden values.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::golden::{Golden, BITS, D, GROUP, N, RESIDUAL_BITS};
use common::suite::assert_golden;
use common::tolerances::GOLDEN_CPU_PARAM_REL;
use xquant_wgpu::reference::*;
use xquant_wgpu::{DType, ParamsPrecision, QuantSpec, TensorShape};

/// The CPU reference does the reference's f32 arithmetic in the same order, so every golden
/// value (codes, f32 params, fp16 reconstructions) is reproduced bit for bit.
const FP16_ULP_TOL: f32 = GOLDEN_CPU_PARAM_REL;
const PARAM_TOL: f32 = GOLDEN_CPU_PARAM_REL;

fn spec() -> QuantSpec {
    QuantSpec {
        params: ParamsPrecision::F32,
        ..QuantSpec::new(BITS, GROUP)
    }
}

#[test]
fn codes_and_params_match_golden() {
    let g = Golden::load();
    let (codes, params) = quantize_codes(&Golden::x(), N, D, &spec()).unwrap();
    let want: Vec<u8> = g.flat("codes").iter().map(|&c| c as u8).collect();
    assert_eq!(codes.codes, want, "codes [3, 32, 8] including padding rows");
    assert_golden("scale", &params.scale, &g.flat("scale"), PARAM_TOL);
    assert_golden("zero", &params.zero, &g.flat("zero"), PARAM_TOL);
    let recon = dequant_with_params(&codes, &params, DType::F16).unwrap();
    assert_golden(
        "recon_x_fp16",
        &recon,
        &g.flat("recon_x_fp16"),
        FP16_ULP_TOL,
    );
}

#[test]
fn reuse_path_matches_golden() {
    let g = Golden::load();
    let (codes, _) = quantize_codes(&Golden::x(), N, D, &spec()).unwrap();
    let y = Golden::y();
    let params = compute_reuse_params(&y, N, D, &codes, &spec()).unwrap();
    assert_golden(
        "reuse_scale",
        &params.scale,
        &g.flat("reuse_scale"),
        PARAM_TOL,
    );
    assert_golden("reuse_zero", &params.zero, &g.flat("reuse_zero"), PARAM_TOL);
    let recon_y = dequant_with_params(&codes, &params, DType::F16).unwrap();
    assert_golden(
        "recon_y_fp16",
        &recon_y,
        &g.flat("recon_y_fp16"),
        FP16_ULP_TOL,
    );
    let res = quantize_residual(&y, &recon_y, N, D, RESIDUAL_BITS, &spec(), DType::F16).unwrap();
    assert_golden(
        "residual_fp16",
        &res,
        &g.flat("residual_fp16"),
        FP16_ULP_TOL,
    );

    let shape = TensorShape::new(&[N, D]).unwrap();
    let enc = reuse_encode(&y, &shape, &codes, &spec(), RESIDUAL_BITS, DType::F16).unwrap();
    let full = reuse_reconstruct(&codes, &enc, DType::F16).unwrap();
    assert_golden(
        "recon_y_plus_res_fp16",
        &full,
        &g.flat("recon_y_plus_res_fp16"),
        FP16_ULP_TOL,
    );
}

#[test]
fn similarity_matches_golden() {
    let g = Golden::load();
    let shape = TensorShape::new(&[N, D]).unwrap();
    let s = cross_layer_similarity(&Golden::x(), &Golden::y(), &shape).unwrap();
    assert!(
        (s.mse - g.sim("mse")).abs() <= 1e-6 * g.sim("mse").max(1e-3),
        "mse {}",
        s.mse
    );
    assert!(
        (s.cosine - g.sim("cosine")).abs() <= 1e-6,
        "cosine {}",
        s.cosine
    );
}

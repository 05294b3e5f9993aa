//! GPU checks shared by the native tests and the in-browser wasm-bindgen tests: the same
//! async code runs under pollster natively and under the browser's event loop.

use crate::common::golden::{Golden, BITS, D, GROUP, N, RESIDUAL_BITS};
use crate::common::trial::*;
use xquant_wgpu::gpu::GpuContext;
use xquant_wgpu::reference::{self, GroupCodes};
use xquant_wgpu::{DType, ParamsPrecision, QuantSpec, ValueAxis};

use super::tolerances::{F16_OUT_REL, GOLDEN_GPU_PARAM_REL, GOLDEN_SIM_REL, SIM_GPU_CPU_REL};

fn golden_spec() -> QuantSpec {
    QuantSpec {
        params: ParamsPrecision::F32,
        ..QuantSpec::new(BITS, GROUP)
    }
}

/// Elementwise closeness to golden values, relative to max(1, |want|).
pub fn assert_golden(name: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let bound = tol * w.abs().max(1.0);
        assert!(
            (g - w).abs() <= bound,
            "{name}[{i}]: got {g}, want {w} (tol {bound})"
        );
    }
}

/// The golden values of the reference implementation, for f16 and f32 inputs.
pub async fn golden_on_gpu(ctx: &GpuContext) {
    let g = Golden::load();
    for dtype in [DType::F16, DType::F32] {
        let x = ctx
            .upload(&Golden::x(), &[1, 1, N, D], dtype, ParamsPrecision::F32)
            .unwrap();
        let y = ctx
            .upload(&Golden::y(), &[1, 1, N, D], dtype, ParamsPrecision::F32)
            .unwrap();
        let q = ctx.quantize(&x, &golden_spec()).await.unwrap();
        let codes = ctx.read_codes(&q.codes).await.unwrap();
        let want: Vec<u8> = g.flat("codes").iter().map(|&c| c as u8).collect();
        assert_eq!(codes, want, "{dtype:?}: codes [3, 32, 8] including padding");
        let (scale, zero) = ctx.read_params(&q.params).await.unwrap();
        assert_golden("scale", &scale, &g.flat("scale"), GOLDEN_GPU_PARAM_REL);
        assert_golden("zero", &zero, &g.flat("zero"), GOLDEN_GPU_PARAM_REL);
        let recon = ctx.dequant(&q.codes, &q.params, DType::F16).await.unwrap();
        assert_golden(
            "recon_x_fp16",
            &ctx.read_f32(&recon).await.unwrap(),
            &g.flat("recon_x_fp16"),
            F16_OUT_REL,
        );

        let reuse_params = ctx
            .compute_reuse_params(&y, &q.codes, &golden_spec())
            .await
            .unwrap();
        let (rs, rz) = ctx.read_params(&reuse_params).await.unwrap();
        assert_golden(
            "reuse_scale",
            &rs,
            &g.flat("reuse_scale"),
            GOLDEN_GPU_PARAM_REL,
        );
        assert_golden(
            "reuse_zero",
            &rz,
            &g.flat("reuse_zero"),
            GOLDEN_GPU_PARAM_REL,
        );
        let recon_y = ctx
            .dequant(&q.codes, &reuse_params, DType::F16)
            .await
            .unwrap();
        assert_golden(
            "recon_y_fp16",
            &ctx.read_f32(&recon_y).await.unwrap(),
            &g.flat("recon_y_fp16"),
            F16_OUT_REL,
        );
        let res = ctx
            .quantize_residual(&y, &recon_y, RESIDUAL_BITS, &golden_spec(), DType::F16)
            .await
            .unwrap();
        assert_golden(
            "residual_fp16",
            &ctx.read_f32(&res).await.unwrap(),
            &g.flat("residual_fp16"),
            F16_OUT_REL,
        );

        let fused = ctx
            .reuse_fit(&y, &q.codes, &golden_spec(), RESIDUAL_BITS, DType::F16)
            .await
            .unwrap();
        let full = ctx
            .reuse_reconstruct(&q.codes, &fused, DType::F16)
            .await
            .unwrap();
        assert_golden(
            "recon_y_plus_res_fp16",
            &ctx.read_f32(&full).await.unwrap(),
            &g.flat("recon_y_plus_res_fp16"),
            F16_OUT_REL,
        );

        let sim = ctx.cross_layer_similarity(&x, &y).await.unwrap();
        assert!(
            (sim.mse - g.sim("mse")).abs() <= GOLDEN_SIM_REL * g.sim("mse"),
            "mse {} vs {}",
            sim.mse,
            g.sim("mse")
        );
        assert!(
            (sim.cosine - g.sim("cosine")).abs() <= GOLDEN_SIM_REL,
            "cosine {}",
            sim.cosine
        );
    }
}

/// Kernel trials: how many trials in one batch.
pub const TRIALS: u64 = 48;

/// The browser's share of the batch: SwiftShader builds a trial's pipelines about 8× slower
/// than lavapipe (2.5 s a trial), so the browser runs [`browser_seeds`].
pub const BROWSER_TRIALS: u64 = 16;

/// A kind of trial, and whether a trial is of it.
type Kind = (String, Box<dyn Fn(&Trial) -> bool>);

/// Every kind a random trial draws: each code width and residual width, both axes, f16 and
/// f32 params, inputs and outputs, D a multiple of 8 and not, η zero and not.
fn kinds() -> Vec<Kind> {
    let mut kinds: Vec<Kind> = Vec::new();
    for bits in 1..=8u8 {
        kinds.push((
            format!("{bits}-bit codes"),
            Box::new(move |t| t.spec.bits == bits),
        ));
    }
    for r in 0..=8u8 {
        kinds.push((
            format!("{r}-bit residuals"),
            Box::new(move |t| t.residual_bits == r),
        ));
    }
    for axis in [ValueAxis::Tokens, ValueAxis::Channels] {
        kinds.push((
            format!("{axis:?} groups"),
            Box::new(move |t| t.spec.axis == axis),
        ));
    }
    for params in [ParamsPrecision::F16, ParamsPrecision::F32] {
        kinds.push((
            format!("{params:?} params"),
            Box::new(move |t| t.spec.params == params),
        ));
    }
    for dtype in [DType::F16, DType::F32] {
        kinds.push((
            format!("{dtype:?} input"),
            Box::new(move |t| t.input == dtype),
        ));
        kinds.push((
            format!("{dtype:?} output"),
            Box::new(move |t| t.output == dtype),
        ));
    }
    kinds.push(("D a multiple of 8".into(), Box::new(|t| t.dims[3] % 8 == 0)));
    kinds.push((
        "D not a multiple of 8".into(),
        Box::new(|t| t.dims[3] % 8 != 0),
    ));
    kinds.push(("η = 0".into(), Box::new(|t| t.spec.eta == 0.0)));
    kinds.push(("η > 0".into(), Box::new(|t| t.spec.eta > 0.0)));
    kinds
}

/// The kinds the random trials of `seeds` leave out (empty: they hold every one).
pub fn uncovered_kinds(seeds: impl IntoIterator<Item = u64>) -> Vec<String> {
    let trials: Vec<Trial> = seeds.into_iter().map(Trial::random).collect();
    kinds()
        .into_iter()
        .filter(|(_, held)| !trials.iter().any(held))
        .map(|(name, _)| name)
        .collect()
}

/// [`BROWSER_TRIALS`] seeds of the batch that between them hold every kind the batch does:
/// greedily the seed holding the most kinds not yet held, then the lowest seeds not chosen.
pub fn browser_seeds() -> Vec<u64> {
    let trials: Vec<(u64, Trial)> = (0..TRIALS).map(|s| (s, Trial::random(s))).collect();
    let mut left = kinds();
    let mut chosen: Vec<u64> = Vec::new();
    while (chosen.len() as u64) < BROWSER_TRIALS {
        let gain = |t: &Trial| left.iter().filter(|(_, held)| held(t)).count();
        let Some((seed, trial)) = trials
            .iter()
            .filter(|(s, t)| !chosen.contains(s) && gain(t) > 0)
            .max_by_key(|(s, t)| (gain(t), std::cmp::Reverse(*s)))
        else {
            break;
        };
        left.retain(|(_, held)| !held(trial));
        chosen.push(*seed);
    }
    let rest: Vec<u64> = (0..TRIALS).filter(|s| !chosen.contains(s)).collect();
    chosen.extend(
        rest.into_iter()
            .take(BROWSER_TRIALS as usize - chosen.len()),
    );
    chosen.sort_unstable();
    chosen
}

/// Largest |v|.
pub fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

pub async fn run_trial(ctx: &GpuContext, seed: u64) -> usize {
    run_trial_on(ctx, seed, Trial::random(seed)).await
}

/// Every kernel against the CPU reference on trial `t` (drawn from `seed`); returns the
/// near-tie code differences allowed.
pub async fn run_trial_on(ctx: &GpuContext, seed: u64, t: Trial) -> usize {
    let name = format!(
        "seed {seed} {:?} {:?} rbits {} in {:?} out {:?}",
        t.dims, t.spec, t.residual_bits, t.input, t.output
    );
    let shape = t.shape();
    let layout = t.layout();
    let x = ctx.upload(&t.x, &t.dims, t.input, t.spec.params).unwrap();
    let y = ctx.upload(&t.y, &t.dims, t.input, t.spec.params).unwrap();
    let p_abs = param_rel(t.spec.params) * max_abs(&t.x).max(max_abs(&t.y));
    let mut ties = 0;

    // quantize_codes
    let q = ctx.quantize(&x, &t.spec).await.unwrap();
    let (cpu_codes, cpu_params) = reference::quantize_codes_batched(&t.x, &shape, &t.spec).unwrap();
    let gpu_codes = ctx.read_codes(&q.codes).await.unwrap();
    ties += assert_codes(
        &format!("{name}: codes"),
        &layout,
        &t.x,
        &gpu_codes,
        &cpu_codes,
    );
    let gpu_params = params_from(layout, ctx.read_params(&q.params).await.unwrap());
    let rel = param_rel(t.spec.params);
    assert_close(
        &format!("{name}: scale"),
        &gpu_params.scale,
        &cpu_params.scale,
        rel,
        p_abs,
    );
    assert_close(
        &format!("{name}: zero"),
        &gpu_params.zero,
        &cpu_params.zero,
        rel,
        p_abs,
    );

    // dequant_with_params, given the GPU's own codes and params
    let anchor = GroupCodes {
        layout,
        codes: gpu_codes,
    };
    let recon = ctx.dequant(&q.codes, &q.params, t.output).await.unwrap();
    let want = reference::dequant_with_params_batched(&anchor, &gpu_params, t.output).unwrap();
    let o_abs = out_rel(t.output) * max_abs(&want);
    assert_close(
        &format!("{name}: dequant"),
        &ctx.read_f32(&recon).await.unwrap(),
        &want,
        out_rel(t.output),
        o_abs,
    );

    // compute_reuse_params and the fused reuse path on the next layer
    let reuse = ctx
        .reuse_fit(&y, &q.codes, &t.spec, t.residual_bits, t.output)
        .await
        .unwrap();
    let own = params_from(layout, ctx.read_params(&reuse.params).await.unwrap());
    let cpu_own = reference::compute_reuse_params_batched(&t.y, &shape, &anchor, &t.spec).unwrap();
    assert_close(
        &format!("{name}: reuse scale"),
        &own.scale,
        &cpu_own.scale,
        rel,
        p_abs,
    );
    assert_close(
        &format!("{name}: reuse zero"),
        &own.zero,
        &cpu_own.zero,
        rel,
        p_abs,
    );
    let mut enc = reference::ReuseEncoding {
        params: own.clone(),
        residual: None,
    };
    if let Some(res) = &reuse.residual {
        // The residual of y against the reconstruction the GPU's own params give.
        let base = reference::dequant_with_params_batched(&anchor, &own, t.output).unwrap();
        let diff: Vec<f32> = t.y.iter().zip(&base).map(|(a, b)| a - b).collect();
        let rspec = t.spec.residual(t.residual_bits);
        let (cpu_rc, cpu_rp) = reference::quantize_codes_batched(&diff, &shape, &rspec).unwrap();
        let rlayout = layout.with_bits(t.residual_bits);
        let gpu_rc = ctx.read_codes(&res.codes).await.unwrap();
        ties += assert_codes(
            &format!("{name}: residual codes"),
            &rlayout,
            &diff,
            &gpu_rc,
            &cpu_rc,
        );
        let gpu_rp = params_from(rlayout, ctx.read_params(&res.params).await.unwrap());
        let r_abs = rel * max_abs(&diff) + p_abs * 1e-3;
        assert_close(
            &format!("{name}: residual scale"),
            &gpu_rp.scale,
            &cpu_rp.scale,
            rel,
            r_abs,
        );
        assert_close(
            &format!("{name}: residual zero"),
            &gpu_rp.zero,
            &cpu_rp.zero,
            rel,
            r_abs,
        );
        enc.residual = Some((
            GroupCodes {
                layout: rlayout,
                codes: gpu_rc,
            },
            gpu_rp,
        ));
    }
    let full = ctx
        .reuse_reconstruct(&q.codes, &reuse, t.output)
        .await
        .unwrap();
    let want = reference::reuse_reconstruct(&anchor, &enc, t.output).unwrap();
    let o_abs = 2.0 * out_rel(t.output) * max_abs(&want);
    assert_close(
        &format!("{name}: reuse reconstruct"),
        &ctx.read_f32(&full).await.unwrap(),
        &want,
        2.0 * out_rel(t.output),
        o_abs,
    );

    // similarity
    let sim = ctx.cross_layer_similarity(&x, &y).await.unwrap();
    let cpu = reference::cross_layer_similarity(&t.x, &t.y, &shape).unwrap();
    assert!(
        (sim.mse - cpu.mse).abs() <= SIM_GPU_CPU_REL * cpu.mse + 1e-30,
        "{name}: mse {} vs {}",
        sim.mse,
        cpu.mse
    );
    assert!(
        (sim.cosine - cpu.cosine).abs() <= SIM_GPU_CPU_REL,
        "{name}: cosine {} vs {}",
        sim.cosine,
        cpu.cosine
    );
    ties
}

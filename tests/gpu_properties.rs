//! Property tests: every GPU kernel against the CPU reference on random shapes (ragged
//! tails, odd D, bits 1..=8, both axes, η, constant groups, large magnitudes, f16/f32 in
//! and out, f16/f32 params). Each kernel is checked on the same inputs the GPU used.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::gpu::{assert_no_gpu_errors, block};
use common::suite::{
    browser_seeds, max_abs, run_trial, run_trial_on, uncovered_kinds, BROWSER_TRIALS, TRIALS,
};
use common::trial::*;
use xquant_wgpu::gpu::{ContextOptions, GpuContext};
use xquant_wgpu::reference;
use xquant_wgpu::{DType, QuantSpec, TensorShape};

#[test]
fn gpu_kernels_match_cpu_reference_on_random_shapes() {
    let ctx = gpu_or_skip!();
    let ties: usize = (0..TRIALS).map(|seed| block(run_trial(&ctx, seed))).sum();
    eprintln!("{TRIALS} trials, {ties} near-tie code differences allowed");
    assert_no_gpu_errors(&ctx);
}

/// The browser runs a share of the batch's seeds; between them they draw every kind of
/// trial, as the whole batch does.
#[test]
fn the_browser_trials_draw_every_kind() {
    let seeds = browser_seeds();
    assert_eq!(seeds.len() as u64, BROWSER_TRIALS);
    assert!(seeds.iter().all(|&s| s < TRIALS), "{seeds:?}");
    assert_eq!(uncovered_kinds(seeds), Vec::<String>::new());
    assert_eq!(uncovered_kinds(0..TRIALS), Vec::<String>::new());
    // The check sees a gap: the first seeds alone miss some widths.
    assert!(!uncovered_kinds(0..BROWSER_TRIALS).is_empty());
}

/// The 8-channel kernels keep a group of up to 32 tokens in registers, their walks written
/// out member by member: every code width (the fused reuse fit for widths dividing 32),
/// residuals of 1..=8 bits, ragged tails.
#[test]
fn kept_group_kernels_match_cpu_reference() {
    let ctx = gpu_or_skip!();
    for seed in 0..24 {
        let bits = 1 + (seed % 8) as u8;
        block(run_trial_on(&ctx, seed, Trial::kept_group(seed, bits)));
    }
    assert_no_gpu_errors(&ctx);
}

#[test]
fn quantize_residual_matches_cpu() {
    let ctx = gpu_or_skip!();
    for seed in 100..112 {
        let t = Trial::random(seed);
        let shape = t.shape();
        let bits = t.residual_bits.max(1);
        let x = ctx.upload(&t.x, &t.dims, t.input, t.spec.params).unwrap();
        let recon_dtype = if max_abs(&t.y) < 60000.0 {
            t.output
        } else {
            DType::F32
        };
        let recon = ctx
            .upload(&t.y, &t.dims, recon_dtype, t.spec.params)
            .unwrap();
        let recon_vals = block(ctx.read_f32(&recon)).unwrap();
        let q = block(ctx.run("residual", |enc| {
            ctx.encode_quantize_residual(enc, &x, &recon, bits, &t.spec)
        }))
        .unwrap();
        let diff: Vec<f32> = t.x.iter().zip(&recon_vals).map(|(a, b)| a - b).collect();
        let rspec = t.spec.residual(bits);
        let (cpu_codes, cpu_params) =
            reference::quantize_codes_batched(&diff, &shape, &rspec).unwrap();
        let layout = xquant_wgpu::layout::GroupLayout::new(&shape, &rspec);
        let gpu_codes = block(ctx.read_codes(&q.codes)).unwrap();
        assert_codes(
            &format!("seed {seed}: residual codes"),
            &layout,
            &diff,
            &gpu_codes,
            &cpu_codes,
        );
        let gp = params_from(layout, block(ctx.read_params(&q.params)).unwrap());
        let rel = param_rel(t.spec.params);
        let abs = rel * max_abs(&diff);
        assert_close(
            &format!("seed {seed}: residual scale"),
            &gp.scale,
            &cpu_params.scale,
            rel,
            abs,
        );
        assert_close(
            &format!("seed {seed}: residual zero"),
            &gp.zero,
            &cpu_params.zero,
            rel,
            abs,
        );
    }
    assert_no_gpu_errors(&ctx);
}

/// One dispatch over [B, H, N, D] gives bit-identical codes and params to one dispatch per
/// (b, h) row.
#[test]
fn batched_equals_looped() {
    let ctx = gpu_or_skip!();
    for seed in 200..206 {
        let mut t = Trial::random(seed);
        t.dims[0] = 2;
        t.dims[1] = 3;
        let (n, d) = (t.dims[2], t.dims[3]);
        let len: usize = t.dims.iter().product();
        let x: Vec<f32> = xquant_wgpu::synth::normal(len, seed)
            .iter()
            .map(|&v| t.input.round(v))
            .collect();
        let batched = block(ctx.quantize(
            &ctx.upload(&x, &t.dims, t.input, t.spec.params).unwrap(),
            &t.spec,
        ))
        .unwrap();
        let all_codes = block(ctx.read_codes(&batched.codes)).unwrap();
        let (all_s, all_z) = block(ctx.read_params(&batched.params)).unwrap();
        let row_layout =
            xquant_wgpu::layout::GroupLayout::new(&TensorShape::new(&[n, d]).unwrap(), &t.spec);
        let (codes_per_row, cells_per_row) = (row_layout.unpacked_len(), row_layout.cells());
        for (r, row) in x.chunks(n * d).enumerate() {
            let q = block(ctx.quantize(
                &ctx.upload(row, &[n, d], t.input, t.spec.params).unwrap(),
                &t.spec,
            ))
            .unwrap();
            let codes = block(ctx.read_codes(&q.codes)).unwrap();
            let (s, z) = block(ctx.read_params(&q.params)).unwrap();
            assert_eq!(
                codes,
                all_codes[r * codes_per_row..(r + 1) * codes_per_row],
                "seed {seed} row {r} codes"
            );
            assert_eq!(
                s,
                all_s[r * cells_per_row..(r + 1) * cells_per_row],
                "seed {seed} row {r} scale"
            );
            assert_eq!(
                z,
                all_z[r * cells_per_row..(r + 1) * cells_per_row],
                "seed {seed} row {r} zero"
            );
        }
    }
    assert_no_gpu_errors(&ctx);
}

/// The same (kernel, constants) compiles once per device.
#[test]
fn pipelines_are_built_once() {
    // A context of its own: the shared one gains other tests' pipelines concurrently.
    let _shared = gpu_or_skip!();
    let ctx = block(GpuContext::new(&ContextOptions::default())).expect("a second context");
    assert_eq!(ctx.pipeline_count(), 0);
    let t = Trial::random(300);
    let x = ctx.upload(&t.x, &t.dims, t.input, t.spec.params).unwrap();
    block(ctx.quantize(&x, &t.spec)).unwrap();
    let first = ctx.pipeline_count();
    assert_eq!(first, 1, "one quantize kernel");
    for _ in 0..3 {
        block(ctx.quantize(&x, &t.spec)).unwrap();
    }
    assert_eq!(ctx.pipeline_count(), first, "repeats reuse the pipeline");
    // Other constants are another pipeline, built once too.
    let other = QuantSpec {
        bits: t.spec.bits % 8 + 1,
        ..t.spec
    };
    for _ in 0..2 {
        block(ctx.quantize(&x, &other)).unwrap();
    }
    assert_eq!(ctx.pipeline_count(), first + 1);
    assert_no_gpu_errors(&ctx);
}

/// Exact .5 ties round to even on the GPU too. Integer data in [0, 2·levels] gives
/// scale 2 and zero 0, so every pre-rounding value is exact and half of them are ties.
#[test]
fn exact_ties_round_half_to_even() {
    let ctx = gpu_or_skip!();
    for bits in 1..=8u8 {
        let levels = (1u32 << bits) - 1;
        let (n, d) = (64, 9);
        let mut g = xquant_wgpu::synth::SplitMix::new(bits as u64);
        let mut x: Vec<f32> = (0..n * d)
            .map(|_| g.range(0, 2 * levels as usize) as f32)
            .collect();
        // Every (group, channel) must hold both extremes so that scale is exactly 2.
        for t in [0, 32] {
            for c in 0..d {
                x[t * d + c] = 0.0;
                x[(t + 1) * d + c] = (2 * levels) as f32;
            }
        }
        let spec = xquant_wgpu::QuantSpec {
            params: xquant_wgpu::ParamsPrecision::F32,
            ..xquant_wgpu::QuantSpec::new(bits, 32)
        };
        let shape = TensorShape::new(&[n, d]).unwrap();
        let (cpu, _) = reference::quantize_codes_batched(&x, &shape, &spec).unwrap();
        let q = block(ctx.quantize(
            &ctx.upload(&x, &[n, d], DType::F32, spec.params).unwrap(),
            &spec,
        ))
        .unwrap();
        let gpu = block(ctx.read_codes(&q.codes)).unwrap();
        assert_eq!(
            gpu, cpu.codes,
            "bits {bits}: exact ties must round half to even"
        );
        assert!(
            x.iter()
                .any(|&v| v % 2.0 == 1.0 && (v / 2.0).floor() % 2.0 == 0.0),
            "bits {bits}: no tie in data"
        );
    }
    assert_no_gpu_errors(&ctx);
}

/// The weighted MSE (the planner's key error) against its CPU twin on random shapes, odd D
/// and f16 inputs included.
#[test]
fn weighted_similarity_matches_cpu() {
    let ctx = gpu_or_skip!();
    let mut g = xquant_wgpu::synth::SplitMix::new(5);
    for trial in 0..8 {
        let dims = [
            1 + g.range(0, 2),
            1 + g.range(0, 3),
            1 + g.range(0, 300),
            [7, 32, 64, 33][trial % 4],
        ];
        let shape = TensorShape::new(&dims).unwrap();
        let n = shape.len();
        let a: Vec<f32> = (0..n).map(|_| g.normal()).collect();
        let b: Vec<f32> = (0..n).map(|_| g.normal() * 0.5).collect();
        let w: Vec<f32> = (0..shape.rows() * shape.dim())
            .map(|_| g.uniform() as f32 * 3.0)
            .collect();
        let dtype = if trial % 2 == 0 {
            DType::F32
        } else {
            DType::F16
        };
        let round = |x: &[f32]| -> Vec<f32> { x.iter().map(|&v| dtype.round(v)).collect() };
        let (ga, gb) = (
            ctx.upload(&a, &dims, dtype, xquant_wgpu::ParamsPrecision::F32)
                .unwrap(),
            ctx.upload(&b, &dims, DType::F32, xquant_wgpu::ParamsPrecision::F32)
                .unwrap(),
        );
        let got =
            block(ctx.weighted_similarities(&[&ga, &gb], &[(0, 1)], Some(&w))).unwrap()[0].mse;
        let want = reference::weighted_mse(&round(&a), &b, &shape, &w).unwrap();
        assert!(
            (got - want).abs() <= 1e-4 * want,
            "{dims:?} {dtype:?}: {got} vs {want}"
        );
    }
    assert!(block(ctx.weighted_similarities(&[], &[], Some(&[1.0]))).is_err());
    assert_no_gpu_errors(&ctx);
}

/// Token-major inputs into heads-major, bit for bit the CPU twin's, on ragged shapes (odd
/// element counts in f16, batch 2, one token), also from a byte offset into a larger buffer
/// (a runtime's arena).
#[test]
fn tokens_to_heads_matches_cpu() {
    let ctx = gpu_or_skip!();
    let mut g = xquant_wgpu::synth::SplitMix::new(9);
    for trial in 0..12 {
        let dims = [
            1 + g.range(0, 2),
            [1, 1 + g.range(0, 40)][trial % 2],
            1 + g.range(0, 5),
            [7, 64, 33, 1][trial % 4],
        ];
        let n: usize = dims.iter().product();
        let dtype = [DType::F32, DType::F16][(trial / 2) % 2];
        let x: Vec<f32> = (0..n).map(|_| g.normal() * 3.0).collect();
        let [b, t, h, d] = dims;
        let want = reference::tokens_to_heads(&x, b, t, h, d).unwrap();
        // At byte 256 of a buffer that holds other data before it.
        let pad = match dtype {
            DType::F32 => 64,
            DType::F16 => 128,
        };
        let mut padded = vec![9.5f32; pad];
        padded.extend(&x);
        let pad_dims = [1, pad + n];
        let arena = ctx
            .upload(&padded, &pad_dims, dtype, xquant_wgpu::ParamsPrecision::F32)
            .unwrap();
        let input =
            xquant_wgpu::gpu::GpuTensor::from_buffer_at(arena.buffer().clone(), 256, &dims, dtype)
                .unwrap();
        let out =
            block(ctx.run("transpose", |enc| ctx.encode_tokens_to_heads(enc, &input))).unwrap();
        assert_eq!(out.shape().dims(), &[b, h, t, d]);
        let got = block(ctx.read_f32(&out)).unwrap();
        let want: Vec<f32> = want.iter().map(|&v| dtype.round(v)).collect();
        let same = got
            .iter()
            .zip(&want)
            .all(|(a, w)| a.to_bits() == w.to_bits());
        assert!(same && got.len() == want.len(), "{dims:?} {dtype:?}");
    }
    let flat = ctx
        .upload(
            &[1.0; 12],
            &[3, 4],
            DType::F32,
            xquant_wgpu::ParamsPrecision::F32,
        )
        .unwrap();
    assert!(block(ctx.run("transpose", |enc| ctx.encode_tokens_to_heads(enc, &flat))).is_err());
    assert!(reference::tokens_to_heads(&[1.0f32; 5], 1, 2, 1, 3).is_err());
    assert_no_gpu_errors(&ctx);
}

/// The Hadamard rotation kernel against its CPU twin: every power-of-two head dim from 2 to
/// 256, f32 and f16 in and out, in place, inverse, heads- and token-major, grouped queries,
/// launches of a few vectors and of thousands; and a rotation followed by its inverse gives
/// the input back. On this adapter's workgroups and on the other width (narrow on a CPU
/// rasterizer, wide on a GPU).
#[test]
fn rotate_matches_cpu() {
    use xquant_wgpu::gpu::AttentionWorkgroup;
    let ctx = gpu_or_skip!();
    rotate_matches_cpu_on(&ctx);
    let other = match ctx.attention_workgroup_size() {
        8 => AttentionWorkgroup::Wide,
        _ => AttentionWorkgroup::Narrow,
    };
    let options = ContextOptions {
        attention_workgroup: other,
        ..Default::default()
    };
    let second = block(GpuContext::new(&options)).expect("a second context");
    assert_ne!(second.rotate_workgroup_size(), ctx.rotate_workgroup_size());
    rotate_matches_cpu_on(&second);
}

fn rotate_matches_cpu_on(ctx: &GpuContext) {
    use common::tolerances::{ROTATE_F16_REL, ROTATE_F32_REL};
    use xquant_wgpu::reference::{rotate_tensor, RotationTarget};
    let mut g = xquant_wgpu::synth::SplitMix::new(21);
    let dims = [2usize, 4, 8, 16, 32, 64, 128, 256];
    for trial in 0..30 {
        let dim = dims[trial % dims.len()];
        let gqa = [1, 3, 1, 4][trial % 4];
        let mut target = RotationTarget {
            batch: 1 + g.range(0, 1),
            heads: (1 + g.range(0, 2)) * gqa,
            tokens: [1, 1 + g.range(0, 9)][trial % 2],
            dim,
            token_major: trial % 3 == 0,
            gqa,
            layer: g.range(0, 29),
            kind: (trial % 2) as u32,
        };
        // Launches of thousands of vectors (an append's), heads-major with an odd token count
        // and token-major (a new head every vector).
        if trial >= 24 {
            target.tokens = [1501, 4100][trial % 2];
            target.dim = [4, 16][trial % 2];
        }
        let dim = target.dim;
        let seed = g.range(0, 1 << 20) as u32;
        let inverse = trial % 5 == 1;
        let in_dtype = [DType::F32, DType::F16][(trial / 2) % 2];
        let out_dtype = [DType::F32, DType::F16][(trial / 4) % 2];
        let in_place = trial % 7 == 3;
        let n = target.vectors() * dim;
        let x: Vec<f32> = (0..n).map(|_| in_dtype.round(g.normal() * 2.0)).collect();
        let shape = [n / dim, dim];
        let f32p = xquant_wgpu::ParamsPrecision::F32;
        let out_t = if in_place {
            ctx.upload(&x, &shape, out_dtype, f32p).unwrap()
        } else {
            ctx.upload(&vec![0.0; n], &shape, out_dtype, f32p).unwrap()
        };
        let input = ctx.upload(&x, &shape, in_dtype, f32p).unwrap();
        let source = (!in_place).then_some(&input);
        block(ctx.run("rotate", |enc| {
            ctx.encode_rotate(enc, source, &out_t, &target, seed, inverse)
        }))
        .unwrap();
        let got = block(ctx.read_f32(&out_t)).unwrap();
        let mut want: Vec<f32> = match in_place {
            true => x.iter().map(|&v| out_dtype.round(v)).collect(),
            false => x.clone(),
        };
        rotate_tensor(&mut want, &target, seed, inverse).unwrap();
        let tol = match out_dtype {
            DType::F32 => ROTATE_F32_REL,
            DType::F16 => ROTATE_F16_REL,
        };
        for (i, (gv, wv)) in got.chunks(dim).zip(want.chunks(dim)).enumerate() {
            let peak = wv.iter().fold(1e-6f32, |a, b| a.max(b.abs()));
            for d in 0..dim {
                assert!(
                    (gv[d] - wv[d]).abs() <= tol * peak.max(wv[d].abs()),
                    "trial {trial} {target:?} {in_dtype:?}->{out_dtype:?} in place {in_place} \
                     inverse {inverse}: vector {i} element {d}: {} vs {}",
                    gv[d],
                    wv[d]
                );
            }
        }
        // Rotated and back: the input (f32 throughout).
        if out_dtype == DType::F32 && !in_place {
            block(ctx.run("unrotate", |enc| {
                ctx.encode_rotate(enc, None, &out_t, &target, seed, !inverse)
            }))
            .unwrap();
            let back = block(ctx.read_f32(&out_t)).unwrap();
            let peak = x.iter().fold(1e-6f32, |a, b| a.max(b.abs()));
            assert!(back
                .iter()
                .zip(&x)
                .all(|(a, b)| (a - b).abs() <= 1e-5 * peak));
        }
    }
    // Shapes that do not fit, and head dims that are not powers of two, are errors.
    let bad = RotationTarget {
        batch: 1,
        heads: 2,
        tokens: 3,
        dim: 48,
        token_major: false,
        gqa: 1,
        layer: 0,
        kind: 0,
    };
    let t = ctx
        .upload(
            &[0.0; 288],
            &[6, 48],
            DType::F32,
            xquant_wgpu::ParamsPrecision::F32,
        )
        .unwrap();
    assert!(block(ctx.run("rotate", |enc| {
        ctx.encode_rotate(enc, None, &t, &bad, 1, false)
    }))
    .is_err());
    let short = RotationTarget { dim: 64, ..bad };
    assert!(block(ctx.run("rotate", |enc| {
        ctx.encode_rotate(enc, None, &t, &short, 1, false)
    }))
    .is_err());
    assert_no_gpu_errors(ctx);
}

/// Lloyd–Max levels: the quantize kernel's codes and norms equal the CPU twin's (a code may
/// differ by one only where a value sits within [`LEVEL_TIE_REL`] of a boundary, the GPU's
/// norm being an ulp apart), and the dequantize kernel returns `level · norm` of the codes
/// and norms it was given. Bits 1..=4, groups of 2..64 (odd ones too), odd token counts (a
/// lone f16 norm pads its word), f16/f32 in, out and params, all-zero groups.
#[test]
fn lloyd_max_kernels_match_cpu() {
    use xquant_wgpu::layout::GroupLayout;
    use xquant_wgpu::reference::{level_values, GroupCodes, GroupParams};
    use xquant_wgpu::synth::SplitMix;
    use xquant_wgpu::{Levels, ParamsPrecision, ValueAxis};
    let ctx = gpu_or_skip!();
    let mut ties = 0;
    for seed in 0..16u64 {
        let mut g = SplitMix::new(seed ^ 0x11d);
        let group = [2, 3, 4, 6, 8, 16, 32, 64][g.range(0, 7)];
        let d = group * g.range(1, 4);
        let dims = vec![g.range(1, 2), g.range(1, 3), g.range(1, 70), d];
        let pick = |g: &mut SplitMix| {
            if g.range(0, 1) == 0 {
                DType::F16
            } else {
                DType::F32
            }
        };
        let (input, output) = (pick(&mut g), pick(&mut g));
        let spec = QuantSpec {
            bits: g.range(1, 4) as u8,
            group_size: group,
            axis: ValueAxis::Channels,
            eta: 0.0,
            params: [ParamsPrecision::F16, ParamsPrecision::F32][g.range(0, 1)],
            levels: Levels::LloydMax,
        };
        let name = format!("seed {seed} {dims:?} {spec:?} in {input:?} out {output:?}");
        let n: usize = dims.iter().product();
        let magnitude = [1.0, 0.01, 30.0][g.range(0, 2)];
        let mut x: Vec<f32> = (0..n)
            .map(|_| input.round(g.normal() * magnitude))
            .collect();
        x[..d].iter_mut().for_each(|v| *v = 0.0); // a token of all-zero groups
        let shape = TensorShape::new(&dims).unwrap();
        let layout = GroupLayout::new(&shape, &spec);
        let gx = ctx.upload(&x, &dims, input, spec.params).unwrap();
        let q = block(ctx.quantize(&gx, &spec)).unwrap();
        assert_eq!(
            q.params.allocated_bytes() as usize,
            4 * layout.rows
                * layout.n_groups()
                * match spec.params {
                    ParamsPrecision::F16 => layout.other().div_ceil(2),
                    ParamsPrecision::F32 => layout.other(),
                },
            "{name}: one norm per group"
        );
        let (want_codes, want_params) =
            reference::quantize_codes_batched(&x, &shape, &spec).unwrap();
        let got_codes = block(ctx.read_codes(&q.codes)).unwrap();
        let (norms, zeros) = block(ctx.read_params(&q.params)).unwrap();
        assert!(zeros.iter().all(|&z| z == 0.0), "{name}: no zeros");
        assert_close(
            &format!("{name}: norms"),
            &norms,
            &want_params.scale,
            param_rel(spec.params),
            0.0,
        );
        let levels = level_values(&layout);
        for r in 0..layout.rows {
            for gi in 0..layout.n_groups() {
                for o in 0..layout.other() {
                    let norm = want_params.scale[layout.cell(r, gi, o)];
                    for i in 0..group {
                        let at = layout.code_index(r, gi, i, o);
                        let (a, b) = (got_codes[at], want_codes.codes[at]);
                        if a == b {
                            continue;
                        }
                        let v = x[layout.element(r, gi, i, o)];
                        let m = (levels[a.min(b) as usize] + levels[a.max(b) as usize]) * 0.5;
                        assert!(
                            a.abs_diff(b) == 1
                                && (v - m * norm).abs() <= LEVEL_TIE_REL * norm.abs().max(1e-30),
                            "{name}: code {a} vs {b} at {at} (value {v}, boundary {})",
                            m * norm
                        );
                        ties += 1;
                    }
                }
            }
        }
        let recon = block(ctx.dequant(&q.codes, &q.params, output)).unwrap();
        let want = reference::dequant_with_params_batched(
            &GroupCodes {
                layout,
                codes: got_codes,
            },
            &GroupParams {
                layout,
                scale: norms,
                zero: zeros,
            },
            output,
        )
        .unwrap();
        assert_close(
            &format!("{name}: dequant"),
            &block(ctx.read_f32(&recon)).unwrap(),
            &want,
            match output {
                DType::F16 => F16_OUT_REL,
                DType::F32 => F32_OUT_REL,
            },
            0.0,
        );
    }
    eprintln!("{ties} near-boundary code differences allowed");
    // What the levels cannot hold is refused before anything is allocated.
    let x = ctx
        .upload(&[1.0; 24], &[4, 6], DType::F32, ParamsPrecision::F32)
        .unwrap();
    let lloyd = QuantSpec {
        axis: ValueAxis::Channels,
        levels: Levels::LloydMax,
        ..QuantSpec::new(2, 4)
    };
    for (what, spec) in [
        ("ragged group", lloyd),
        (
            "tokens axis",
            QuantSpec {
                axis: ValueAxis::Tokens,
                group_size: 2,
                ..lloyd
            },
        ),
        (
            "5 bits",
            QuantSpec {
                bits: 5,
                group_size: 2,
                ..lloyd
            },
        ),
        (
            "eta",
            QuantSpec {
                eta: 0.1,
                group_size: 2,
                ..lloyd
            },
        ),
    ] {
        let err = block(ctx.quantize(&x, &spec)).expect_err(what);
        assert!(
            matches!(err, xquant_wgpu::XqError::Config(_)),
            "{what}: {err}"
        );
    }
    assert_no_gpu_errors(&ctx);
}

/// f16 outputs of the dequantize and reuse-reconstruct kernels are the reference's f16
/// roundings (within one f16 ulp, for an f32 product the GPU may fuse) at every magnitude:
/// subnormal (under 6.1e-5), small and large normals, negative values, and past the largest
/// f16 (infinity; a reconstruction's NaN where its two terms overflow apart). The reference
/// gets the codes and params the GPU wrote: only the reconstruction and its rounding differ.
#[test]
fn f16_outputs_round_like_the_reference_at_every_magnitude() {
    use xquant_wgpu::gpu::PackedCodes;
    use xquant_wgpu::reference::{GroupCodes, GroupParams, ReuseEncoding};
    use xquant_wgpu::synth::SplitMix;
    use xquant_wgpu::{ParamsPrecision, ValueAxis};
    let ctx = gpu_or_skip!();
    // One f16 ulp at |w|: 2^-24 below the smallest normal, else 2^(exponent - 10).
    let ulp = |w: f32| {
        let a = w.abs();
        if a < 6.103_515_6e-5 {
            2f32.powi(-24)
        } else {
            2f32.powi(a.log2().floor() as i32 - 10)
        }
    };
    let dims = [1usize, 2, 64, 64];
    let shape = TensorShape::new(&dims).unwrap();
    let spec = QuantSpec {
        bits: 4,
        group_size: 32,
        axis: ValueAxis::Tokens,
        params: ParamsPrecision::F32,
        ..Default::default()
    };
    let mut g = SplitMix::new(0xf16);
    for magnitude in [3e-6f32, 4e-5, 1e-3, 1.0, 5e3, 1e6] {
        let n = shape.len();
        let x: Vec<f32> = (0..n).map(|_| g.normal() * magnitude).collect();
        let y: Vec<f32> = x
            .iter()
            .map(|&v| 0.8 * v + 0.3 * magnitude * g.normal())
            .collect();
        let gx = ctx.upload(&x, &dims, DType::F32, spec.params).unwrap();
        let gy = ctx.upload(&y, &dims, DType::F32, spec.params).unwrap();
        let q = block(ctx.quantize(&gx, &spec)).unwrap();
        let reuse = block(ctx.reuse_fit(&gy, &q.codes, &spec, 4, DType::F16)).unwrap();
        // The GPU's codes and params as the reference takes them (params in their codes'
        // layout).
        let read_codes = |c: &PackedCodes| GroupCodes {
            layout: *c.layout(),
            codes: block(ctx.read_codes(c)).unwrap(),
        };
        let read_params = |p, codes: &PackedCodes| {
            let (scale, zero) = block(ctx.read_params(p)).unwrap();
            GroupParams {
                layout: *codes.layout(),
                scale,
                zero,
            }
        };
        let codes = read_codes(&q.codes);
        let res = reuse.residual.as_ref().unwrap();
        let encoding = ReuseEncoding {
            params: read_params(&reuse.params, &q.codes),
            residual: Some((read_codes(&res.codes), read_params(&res.params, &res.codes))),
        };
        let cases = [
            (
                "dequantize",
                block(ctx.dequant(&q.codes, &q.params, DType::F16)).unwrap(),
                reference::dequant_with_params_batched(
                    &codes,
                    &read_params(&q.params, &q.codes),
                    DType::F16,
                )
                .unwrap(),
            ),
            (
                "reuse reconstruct",
                block(ctx.reuse_reconstruct(&q.codes, &reuse, DType::F16)).unwrap(),
                reference::reuse_reconstruct(&codes, &encoding, DType::F16).unwrap(),
            ),
        ];
        for (name, got, want) in cases {
            let got = block(ctx.read_f32(&got)).unwrap();
            let mut exact = 0;
            for (i, (&a, &w)) in got.iter().zip(&want).enumerate() {
                // Past f16's range both overflow alike (a reconstruction's inf - inf: NaN).
                let same = a == w || (a.is_nan() && w.is_nan());
                assert!(
                    same || (a - w).abs() <= ulp(w),
                    "{name}, magnitude {magnitude}: element {i}: {a} vs {w}"
                );
                exact += usize::from(same);
            }
            assert!(
                exact * 100 >= 99 * got.len(),
                "{name}, magnitude {magnitude}: {exact} of {} exact",
                got.len()
            );
        }
    }
    assert_no_gpu_errors(&ctx);
}

/// `start_profile` … `finish_profile` times every launch recorded on the context in between,
/// by kernel: as many launches as were recorded, each with GPU time; none after it ends.
#[test]
fn a_profile_times_every_launch_by_kernel() {
    let _ = gpu_or_skip!();
    // A context of its own: a profile times every launch of its context, and the other
    // tests here share theirs.
    let ctx = block(GpuContext::new(&ContextOptions::default())).unwrap();
    assert!(block(ctx.finish_profile()).is_err(), "no profile started");
    if !ctx.can_profile() {
        assert!(ctx.start_profile().is_err());
        assert!(
            !common::gpu::gpu_required(),
            "REQUIRE_GPU=1 but this device has no timestamp queries"
        );
        return;
    }
    let x = ctx
        .upload_f32(
            &xquant_wgpu::synth::normal(4 * 256 * 64, 3),
            &[1, 4, 256, 64],
            xquant_wgpu::ParamsPrecision::F16,
        )
        .unwrap();
    let spec = QuantSpec::new(2, 32);
    block(ctx.quantize(&x, &spec)).unwrap();
    ctx.start_profile().unwrap();
    let before = ctx.launches_recorded();
    for _ in 0..3 {
        block(ctx.quantize(&x, &spec)).unwrap();
    }
    let recorded = ctx.launches_recorded() - before;
    let times = block(ctx.finish_profile()).unwrap();
    assert!(recorded >= 3, "{recorded} launches for three quantizations");
    assert_eq!(
        times.iter().map(|t| t.launches as u64).sum::<u64>(),
        recorded,
        "{times:?}"
    );
    assert!(times.iter().all(|t| t.micros > 0.0), "{times:?}");
    block(ctx.quantize(&x, &spec)).unwrap();
    assert!(block(ctx.finish_profile()).is_err(), "the profile ended");
    assert_no_gpu_errors(&ctx);
}

/// The dequantizer's vector paths against the CPU reference, every case taking one: groups
/// along tokens in runs of 8 channels (every width, codes straddling words where 32 % bits
/// != 0), groups along D in quads of tokens (widths 1, 2 and 4, uniform and Lloyd–Max), f16
/// and f32 params and outputs, ragged token counts.
#[test]
fn vector_dequant_paths_match_cpu() {
    use xquant_wgpu::layout::GroupLayout;
    use xquant_wgpu::reference::{GroupCodes, GroupParams};
    use xquant_wgpu::synth::SplitMix;
    use xquant_wgpu::{Levels, ParamsPrecision, ValueAxis};
    let ctx = gpu_or_skip!();
    let mut cases = Vec::new();
    for bits in 1..=8u8 {
        for (group, tokens, d) in [(32, 45, 8), (64, 130, 24), (96, 96, 16)] {
            cases.push((bits, group, tokens, d, ValueAxis::Tokens, Levels::Uniform));
        }
    }
    for bits in [1u8, 2, 4] {
        for (group, tokens, d) in [(8, 12, 16), (16, 36, 48), (32, 8, 32), (64, 20, 64)] {
            for levels in [Levels::Uniform, Levels::LloydMax] {
                cases.push((bits, group, tokens, d, ValueAxis::Channels, levels));
            }
        }
    }
    for (i, &(bits, group, tokens, d, axis, levels)) in cases.iter().enumerate() {
        let mut g = SplitMix::new(0x7ec + i as u64);
        let pick = |g: &mut SplitMix| [DType::F16, DType::F32][g.range(0, 1)];
        let (input, output) = (pick(&mut g), pick(&mut g));
        let spec = QuantSpec {
            bits,
            group_size: group,
            axis,
            eta: 0.0,
            params: [ParamsPrecision::F16, ParamsPrecision::F32][g.range(0, 1)],
            levels,
        };
        let dims = vec![1, g.range(1, 3), tokens, d];
        let name = format!("{dims:?} {spec:?} in {input:?} out {output:?}");
        let n: usize = dims.iter().product();
        let x: Vec<f32> = (0..n).map(|_| input.round(g.normal() * 3.0)).collect();
        let layout = GroupLayout::new(&TensorShape::new(&dims).unwrap(), &spec);
        let gx = ctx.upload(&x, &dims, input, spec.params).unwrap();
        let q = block(ctx.quantize(&gx, &spec)).unwrap();
        let (scale, zero) = block(ctx.read_params(&q.params)).unwrap();
        let codes = GroupCodes {
            layout,
            codes: block(ctx.read_codes(&q.codes)).unwrap(),
        };
        let params = GroupParams {
            layout,
            scale,
            zero,
        };
        let want = reference::dequant_with_params_batched(&codes, &params, output).unwrap();
        let got =
            block(ctx.read_f32(&block(ctx.dequant(&q.codes, &q.params, output)).unwrap())).unwrap();
        let rel = match output {
            DType::F16 => F16_OUT_REL,
            DType::F32 => F32_OUT_REL,
        };
        assert_close(&format!("{name}: dequant"), &got, &want, rel, 0.0);
    }
    assert_no_gpu_errors(&ctx);
}

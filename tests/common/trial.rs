//! Random trial cases and comparisons with named tolerances, shared by the property tests.

use xquant_wgpu::layout::GroupLayout;
use xquant_wgpu::reference::{fit_cell, GroupCodes, GroupParams};
use xquant_wgpu::synth::SplitMix;
use xquant_wgpu::{DType, ParamsPrecision, QuantSpec, TensorShape, ValueAxis};

pub use super::tolerances::{
    F16_OUT_REL, F16_PARAM_REL, F32_OUT_REL, F32_PARAM_REL, LEVEL_TIE_REL, TIE_WINDOW,
};

/// One random problem.
#[derive(Clone, Debug)]
pub struct Trial {
    pub dims: Vec<usize>,
    pub spec: QuantSpec,
    pub residual_bits: u8,
    pub input: DType,
    pub output: DType,
    /// Values as the GPU sees them (already rounded to f16 for f16 inputs).
    pub x: Vec<f32>,
    pub y: Vec<f32>,
}

impl Trial {
    /// A random trial: ragged token counts, odd D and D a multiple of 8, every bit width,
    /// constant groups and large magnitudes among the cases.
    pub fn random(seed: u64) -> Trial {
        Self::draw(seed, None)
    }

    /// A random trial on the kernels' 8-channel path with the group held in registers:
    /// groups of at most 32 tokens along tokens, D a multiple of 8, codes of `bits` bits and
    /// a residual of at least 1 bit (the rest drawn as in [`Trial::random`]).
    pub fn kept_group(seed: u64, bits: u8) -> Trial {
        Self::draw(seed, Some(bits))
    }

    fn draw(seed: u64, kept_bits: Option<u8>) -> Trial {
        let mut g = SplitMix::new(seed);
        let kept = kept_bits.is_some();
        let mut group_size = if g.range(0, 2) == 0 {
            32
        } else {
            g.range(1, 40)
        };
        if kept {
            group_size = group_size.min(32);
        }
        let mut tokens = g.range(1, 90);
        if tokens % group_size == 0 {
            tokens += 1;
        }
        // Half the trials have D a multiple of 8 (the kernels' 8-channel paths), half any D.
        let d = match (g.range(0, 1), kept) {
            (0, _) | (_, true) => 8 * g.range(1, 8),
            _ => g.range(1, 33),
        };
        let dims = vec![g.range(1, 2), g.range(1, 3), tokens, d];
        let params = if g.range(0, 1) == 0 {
            ParamsPrecision::F16
        } else {
            ParamsPrecision::F32
        };
        let axis = if g.range(0, 2) == 0 && !kept {
            ValueAxis::Channels
        } else {
            ValueAxis::Tokens
        };
        let eta = [0.0, 0.0, 0.045, 0.09, 1.0 / 6.0][g.range(0, 4)];
        let input = if g.range(0, 1) == 0 {
            DType::F16
        } else {
            DType::F32
        };
        let output = if g.range(0, 1) == 0 {
            DType::F16
        } else {
            DType::F32
        };
        let drawn_bits = g.range(1, 8) as u8;
        let spec = QuantSpec {
            bits: kept_bits.unwrap_or(drawn_bits),
            group_size,
            axis,
            eta,
            params,
            ..Default::default()
        };
        // Largest magnitude every stored quantity can hold: f16 params (see
        // F16_PARAMS_MAX_ABS), f16 inputs or outputs, otherwise f32.
        let max_abs: f32 = match (params, input, output) {
            (ParamsPrecision::F16, _, _) => 16000.0,
            (_, DType::F16, _) | (_, _, DType::F16) => 60000.0,
            _ => 1e6,
        };
        // 1e-4: around the smallest normal f16 (6.1e-5), so f16 roundings meet subnormals.
        let magnitude = [1.0, 0.01, 30.0, max_abs / 5.0, 1e-4][g.range(0, 4)];
        let n: usize = dims.iter().product();
        let mut x: Vec<f32> = (0..n).map(|_| g.normal() * magnitude).collect();
        // A correlated next layer: scaled, shifted, plus noise.
        let mut y: Vec<f32> = x
            .iter()
            .map(|&v| 0.9 * v + 0.05 * magnitude + 0.2 * magnitude * g.normal())
            .collect();
        // Constant runs: a stretch of tokens (or a whole token row) set to one value.
        if g.range(0, 1) == 0 {
            let d = dims[3];
            let start = g.range(0, tokens - 1);
            let len = g.range(1, tokens - start);
            let value = g.normal() * magnitude;
            for t in start..start + len {
                for c in 0..d {
                    x[t * d + c] = value;
                    y[t * d + c] = value * 0.5;
                }
            }
        }
        let clamp = |v: &mut f32| *v = input.round(v.clamp(-max_abs, max_abs));
        x.iter_mut().for_each(clamp);
        y.iter_mut().for_each(clamp);
        Trial {
            dims,
            spec,
            residual_bits: (g.range(0, 8) as u8).max(kept as u8),
            input,
            output,
            x,
            y,
        }
    }

    pub fn shape(&self) -> TensorShape {
        TensorShape::new(&self.dims).unwrap()
    }

    pub fn layout(&self) -> GroupLayout {
        GroupLayout::new(&self.shape(), &self.spec)
    }
}

/// Relative-to-max(1, |want|) closeness with a name, index and both values on failure.
pub fn assert_close(ctx: &str, got: &[f32], want: &[f32], rel: f32, abs: f32) {
    assert_eq!(got.len(), want.len(), "{ctx}: lengths differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let bound = rel * w.abs() + abs;
        assert!(
            (g - w).abs() <= bound,
            "{ctx}[{i}]: got {g}, want {w} (bound {bound})"
        );
    }
}

/// Params tolerance for a precision.
pub fn param_rel(p: ParamsPrecision) -> f32 {
    match p {
        ParamsPrecision::F16 => F16_PARAM_REL,
        ParamsPrecision::F32 => F32_PARAM_REL,
    }
}

/// Output tolerance for a dtype.
pub fn out_rel(d: DType) -> f32 {
    match d {
        DType::F16 => F16_OUT_REL,
        DType::F32 => F32_OUT_REL,
    }
}

/// Compares GPU codes with CPU codes of `values` (the quantized quantity, `[R, N, D]`):
/// equal, except ±1 where the CPU's pre-rounding value is within [`TIE_WINDOW`] of a tie.
/// Returns how many near-tie differences were allowed.
pub fn assert_codes(
    ctx: &str,
    layout: &GroupLayout,
    values: &[f32],
    gpu: &[u8],
    cpu: &GroupCodes,
) -> usize {
    assert_eq!(gpu.len(), cpu.codes.len(), "{ctx}: code count");
    let levels = (1u32 << layout.bits) - 1;
    let mut ties = 0;
    for r in 0..layout.rows {
        for g in 0..layout.n_groups() {
            for o in 0..layout.other() {
                let members = (0..layout.valid(g)).map(|i| values[layout.element(r, g, i, o)]);
                let (scale, zero) = fit_cell(members, levels);
                for i in 0..layout.group_size {
                    let k = layout.code_index(r, g, i, o);
                    if gpu[k] == cpu.codes[k] {
                        continue;
                    }
                    let v = (values[layout.element(r, g, i, o)] - zero) / scale;
                    let near_tie = (v - v.floor() - 0.5).abs() < TIE_WINDOW;
                    assert!(
                        near_tie && gpu[k].abs_diff(cpu.codes[k]) == 1,
                        "{ctx}: code (r {r}, g {g}, i {i}, o {o}) gpu {} cpu {} (pre-rounding {v})",
                        gpu[k],
                        cpu.codes[k]
                    );
                    ties += 1;
                }
            }
        }
    }
    ties
}

/// GroupParams from read-back (scale, zero).
pub fn params_from(layout: GroupLayout, (scale, zero): (Vec<f32>, Vec<f32>)) -> GroupParams {
    GroupParams {
        layout,
        scale,
        zero,
    }
}

//! Group quantization: codes, params, reuse params, dequantization and the residual.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use crate::config::{check_values, validate_bits, DType, Levels, QuantSpec, TensorShape};
use crate::error::{shape_err, Result};
use crate::layout::GroupLayout;
use crate::reference::codebook::{level_boundaries, lloyd_max_levels};

/// The reference's lower bound on a group's scale.
pub const SCALE_FLOOR: f32 = 1e-8;

/// Unpacked codes `[R, n_groups, group_size, O]` (padding members included, as the reference).
#[derive(Clone, Debug, PartialEq)]
pub struct GroupCodes {
    /// Where each code belongs.
    pub layout: GroupLayout,
    /// One code per member, in `[0, 2^bits - 1]`.
    pub codes: Vec<u8>,
}

/// Stored (scale, zero) per cell, `[R, n_groups, O]`, already rounded to the params precision
/// and calibrated by η.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupParams {
    /// Geometry (its `bits` is the width these params dequantize).
    pub layout: GroupLayout,
    /// Step per code.
    pub scale: Vec<f32>,
    /// Value of code 0.
    pub zero: Vec<f32>,
}

/// What a reuse layer stores: its own params for the anchor's codes, and an optional residual.
#[derive(Clone, Debug, PartialEq)]
pub struct ReuseEncoding {
    /// This layer's params for the anchor's codes.
    pub params: GroupParams,
    /// Residual codes and params (`None` with residual bits 0).
    pub residual: Option<(GroupCodes, GroupParams)>,
}

/// Min/max calibration of one cell: `scale = max((max - min) / levels, 1e-8)`, `zero = min`.
pub fn fit_cell(values: impl Iterator<Item = f32>, levels: u32) -> (f32, f32) {
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    for v in values {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    (((hi - lo) / levels as f32).max(SCALE_FLOOR), lo)
}

/// `clip(round_half_even((v - zero) / scale), 0, levels)`.
pub fn code_of(v: f32, scale: f32, zero: f32, levels: u32) -> u8 {
    ((v - zero) / scale)
        .round_ties_even()
        .clamp(0.0, levels as f32) as u8
}

/// Data-free calibration (η) and storage rounding of a fitted (scale, zero).
fn stored_params(scale: f32, zero: f32, spec: &QuantSpec) -> (f32, f32) {
    let levels = spec.levels() as f32;
    let (s, z) = if spec.eta == 0.0 {
        (scale, zero)
    } else {
        (
            (1.0 - 2.0 * spec.eta) * scale,
            zero + spec.eta * scale * levels,
        )
    };
    (spec.params.store(s), spec.params.store(z))
}

fn validated(x: &[f32], shape: &TensorShape, spec: &QuantSpec) -> Result<GroupLayout> {
    spec.validate()?;
    shape.check_len(x.len(), "x")?;
    check_values(x, spec.params, "x")?;
    let layout = GroupLayout::new(shape, spec);
    spec.check_axis(layout.group_axis_len())?;
    Ok(layout)
}

/// What each code of `layout` stands for before its cell's params: the code itself
/// (uniform), or the Lloyd–Max level (`x̂ = level · norm`).
/// Lloyd–Max tables are computed once per (bits, members) and kept.
pub fn level_values(layout: &GroupLayout) -> Vec<f32> {
    match layout.levels {
        Levels::Uniform => (0..1u32 << layout.bits).map(|c| c as f32).collect(),
        Levels::LloydMax => {
            type Tables = HashMap<(u8, usize), Vec<f32>>;
            static TABLES: OnceLock<Mutex<Tables>> = OnceLock::new();
            let mut tables = TABLES
                .get_or_init(Default::default)
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            tables
                .entry((layout.bits, layout.group_size))
                .or_insert_with(|| lloyd_max_levels(layout.bits as u32, layout.group_size))
                .clone()
        }
    }
}

/// The L2 norm of a group in f32, summed in member order (as the kernel sums it).
pub fn group_norm(values: impl Iterator<Item = f32>) -> f32 {
    values.fold(0f32, |acc, v| acc + v * v).sqrt()
}

/// The Lloyd–Max code of `v` in a group of norm `norm`: how many of the levels' midpoints
/// `b` have `v >= b · norm` (no division, so the kernel decides every code alike).
pub fn level_code(v: f32, norm: f32, boundaries: &[f32]) -> u8 {
    boundaries.iter().filter(|&&b| v >= b * norm).count() as u8
}

/// Lloyd–Max codes and norms of every cell (`scale` = the stored norm, `zero` = 0).
fn quantize_levels(x: &[f32], layout: &GroupLayout, spec: &QuantSpec) -> (GroupCodes, GroupParams) {
    let boundaries = level_boundaries(&level_values(layout));
    let cells = layout.cells();
    let mut codes = vec![0u8; layout.unpacked_len()];
    let mut scale = vec![0f32; cells];
    for r in 0..layout.rows {
        for g in 0..layout.n_groups() {
            for o in 0..layout.other() {
                let member = |i| x[layout.element(r, g, i, o)];
                let norm = group_norm((0..layout.valid(g)).map(member));
                for i in 0..layout.group_size {
                    codes[layout.code_index(r, g, i, o)] = level_code(member(i), norm, &boundaries);
                }
                scale[layout.cell(r, g, o)] = spec.params.store(norm);
            }
        }
    }
    (
        GroupCodes {
            layout: *layout,
            codes,
        },
        GroupParams {
            layout: *layout,
            scale,
            zero: vec![0.0; cells],
        },
    )
}

/// Fits every cell; calls `codes_for` with the raw (scale, zero) of each cell.
fn fit_all(
    x: &[f32],
    layout: &GroupLayout,
    spec: &QuantSpec,
    mut codes_for: impl FnMut(usize, usize, usize, f32, f32),
) -> GroupParams {
    let cells = layout.cells();
    let (mut scale, mut zero) = (vec![0.0; cells], vec![0.0; cells]);
    for r in 0..layout.rows {
        for g in 0..layout.n_groups() {
            for o in 0..layout.other() {
                let members = (0..layout.valid(g)).map(|i| x[layout.element(r, g, i, o)]);
                let (s, z) = fit_cell(members, spec.levels());
                codes_for(r, g, o, s, z);
                let c = layout.cell(r, g, o);
                (scale[c], zero[c]) = stored_params(s, z, spec);
            }
        }
    }
    GroupParams {
        layout: *layout,
        scale,
        zero,
    }
}

/// Batched `quantize_codes` over `[..., N, D]`: codes and params of every group.
/// Codes are computed with the unrounded f32 params (so they equal the reference's whatever
/// the params precision); the returned params are what storage keeps.
pub fn quantize_codes_batched(
    x: &[f32],
    shape: &TensorShape,
    spec: &QuantSpec,
) -> Result<(GroupCodes, GroupParams)> {
    let layout = validated(x, shape, spec)?;
    if spec.levels == Levels::LloydMax {
        return Ok(quantize_levels(x, &layout, spec));
    }
    let mut codes = vec![0u8; layout.unpacked_len()];
    let levels = spec.levels();
    let params = fit_all(x, &layout, spec, |r, g, o, s, z| {
        for i in 0..layout.group_size {
            codes[layout.code_index(r, g, i, o)] =
                code_of(x[layout.element(r, g, i, o)], s, z, levels);
        }
    });
    Ok((GroupCodes { layout, codes }, params))
}

/// `quantize_codes(x [N, D], bits, group_size)`.
pub fn quantize_codes(
    x: &[f32],
    n: usize,
    d: usize,
    spec: &QuantSpec,
) -> Result<(GroupCodes, GroupParams)> {
    quantize_codes_batched(x, &TensorShape::new(&[n, d])?, spec)
}

fn check_codes_match(codes: &GroupCodes, layout: &GroupLayout) -> Result<()> {
    if codes.layout != *layout {
        return shape_err!(
            "codes were made for {:?}, not for this tensor's layout {:?}",
            codes.layout,
            layout
        );
    }
    Ok(())
}

/// Batched `compute_reuse_params`: a fresh min/max calibration of `x`; the anchor codes only
/// fix the shape.
pub fn compute_reuse_params_batched(
    x: &[f32],
    shape: &TensorShape,
    codes: &GroupCodes,
    spec: &QuantSpec,
) -> Result<GroupParams> {
    let layout = validated(x, shape, spec)?;
    check_codes_match(codes, &layout)?;
    spec.check_borrowable()?;
    Ok(fit_all(x, &layout, spec, |_, _, _, _, _| {}))
}

/// `compute_reuse_params(x [N, D], codes, bits, group_size)`.
pub fn compute_reuse_params(
    x: &[f32],
    n: usize,
    d: usize,
    codes: &GroupCodes,
    spec: &QuantSpec,
) -> Result<GroupParams> {
    compute_reuse_params_batched(x, &TensorShape::new(&[n, d])?, codes, spec)
}

/// Batched `dequant_with_params`: `level(code) · scale + zero` in f32 (the level is the code
/// itself unless the levels are Lloyd–Max), padding cut, rounded to `out`.
pub fn dequant_with_params_batched(
    codes: &GroupCodes,
    params: &GroupParams,
    out: DType,
) -> Result<Vec<f32>> {
    let l = params.layout;
    if codes.layout.with_bits(l.bits) != l {
        return shape_err!(
            "codes layout {:?} does not match params layout {:?}",
            codes.layout,
            l
        );
    }
    let table = level_values(&l);
    Ok((0..l.elements())
        .map(|e| {
            let (r, g, i, o) = l.locate(e);
            let c = l.cell(r, g, o);
            let level = table[codes.codes[l.code_index(r, g, i, o)] as usize];
            out.round(level * params.scale[c] + params.zero[c])
        })
        .collect())
}

/// `dequant_with_params(codes, params)` → `[n_rows, D]` (fp16 by default in the reference).
pub fn dequant_with_params(
    codes: &GroupCodes,
    params: &GroupParams,
    out: DType,
) -> Result<Vec<f32>> {
    dequant_with_params_batched(codes, params, out)
}

/// Residual codes and params of `x - recon` at `bits`.
fn residual_codes(
    x: &[f32],
    recon: &[f32],
    shape: &TensorShape,
    bits: u8,
    spec: &QuantSpec,
) -> Result<(GroupCodes, GroupParams)> {
    validate_bits("residual bits", bits)?;
    shape.check_len(recon.len(), "recon")?;
    check_values(recon, spec.params, "recon")?;
    let diff: Vec<f32> = x.iter().zip(recon).map(|(a, b)| a - b).collect();
    quantize_codes_batched(&diff, shape, &spec.residual(bits))
}

/// Batched `quantize_residual`: the dequantized `bits`-bit quantization of `x - recon`,
/// rounded to `out`; the caller adds it to `recon` in f32.
pub fn quantize_residual_batched(
    x: &[f32],
    recon: &[f32],
    shape: &TensorShape,
    bits: u8,
    spec: &QuantSpec,
    out: DType,
) -> Result<Vec<f32>> {
    let (codes, params) = residual_codes(x, recon, shape, bits, spec)?;
    dequant_with_params_batched(&codes, &params, out)
}

/// `quantize_residual(x [N, D], recon, bits, group_size)`.
pub fn quantize_residual(
    x: &[f32],
    recon: &[f32],
    n: usize,
    d: usize,
    bits: u8,
    spec: &QuantSpec,
    out: DType,
) -> Result<Vec<f32>> {
    quantize_residual_batched(x, recon, &TensorShape::new(&[n, d])?, bits, spec, out)
}

/// The reuse path, as the reference runs it: own params for the anchor codes, then (with
/// `residual_bits > 0`) the residual of `x` against the reconstruction rounded to `out`.
pub fn reuse_encode(
    x: &[f32],
    shape: &TensorShape,
    anchor: &GroupCodes,
    spec: &QuantSpec,
    residual_bits: u8,
    out: DType,
) -> Result<ReuseEncoding> {
    let params = compute_reuse_params_batched(x, shape, anchor, spec)?;
    let residual = if residual_bits == 0 {
        None
    } else {
        let recon = dequant_with_params_batched(anchor, &params, out)?;
        Some(residual_codes(x, &recon, shape, residual_bits, spec)?)
    };
    Ok(ReuseEncoding { params, residual })
}

/// Reconstruction of a reuse layer: `round_out(round_out(dequant) + round_out(residual))`.
pub fn reuse_reconstruct(anchor: &GroupCodes, enc: &ReuseEncoding, out: DType) -> Result<Vec<f32>> {
    let recon = dequant_with_params_batched(anchor, &enc.params, out)?;
    let Some((codes, params)) = &enc.residual else {
        return Ok(recon);
    };
    let res = dequant_with_params_batched(codes, params, out)?;
    Ok(recon
        .iter()
        .zip(&res)
        .map(|(a, b)| out.round(a + b))
        .collect())
}

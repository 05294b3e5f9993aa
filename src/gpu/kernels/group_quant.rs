//! Host of `wgsl/group_quant.wgsl`: quantize, fit params, residual and the fused reuse path
//! on blocks of pages (the public tensor operations are in `ops.rs`).

use crate::config::{DType, Levels, ParamsPrecision, QuantSpec, ValueAxis};
use crate::error::Result;
use crate::gpu::dispatch::Bind;
use crate::gpu::kernels::views::{Block, TokenView};
use crate::gpu::mirror::wgsl_struct;
use crate::gpu::pipelines::{Constants, Family, GroupQuantConstants, KernelKey};
use crate::gpu::{GpuContext, GpuParams, PackedCodes, QuantizedTensor};
use crate::layout::GroupLayout;
use crate::reference::level_values;

wgsl_struct! {
    /// Mirrors `Dims` in `wgsl/group_quant.wgsl`.
    pub(crate) struct GroupDims = Family::GroupQuant, "Dims" {
        rows: u32,
        dim: u32,
        n_groups: u32,
        other: u32,
        words_per_group: u32,
        res_words_per_group: u32,
        t0: u32,
        n: u32,
        block_groups: u32,
        block_other: u32,
        cells: u32,
        x_tokens: u32,
        x_t0: u32,
        x_stride: u32,
        grid_x: u32,
        eta: f32,
        levels: [[f32; 4]; 4],
    }
}

/// A layout's Lloyd–Max levels as the kernels' dims hold them (16 slots; zeros for uniform
/// levels, whose codes stand for themselves). The levels are exactly symmetric, which the
/// attention kernel relies on (it picks magnitudes from the upper half).
pub(crate) fn level_slots(l: &GroupLayout) -> [[f32; 4]; 4] {
    let mut slots = [[0.0; 4]; 4];
    if l.levels == Levels::LloydMax {
        let levels = level_values(l);
        debug_assert!(levels
            .iter()
            .zip(levels.iter().rev())
            .all(|(a, b)| *a == -*b));
        for (i, v) in levels.into_iter().enumerate() {
            slots[i / 4][i % 4] = v;
        }
    }
    slots
}

impl GroupQuantConstants {
    /// The constants of codes laid out by `l` with params stored at `params`.
    pub(crate) fn for_layout(l: &GroupLayout, params: ParamsPrecision) -> Self {
        GroupQuantConstants {
            bits: l.bits,
            group: l.group_size as u32,
            params_f32: params == ParamsPrecision::F32,
            axis_channels: l.axis == ValueAxis::Channels,
            ..Default::default()
        }
    }
}

impl GpuContext {
    #[allow(clippy::too_many_arguments)]
    fn launch_group(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        entry: &'static str,
        constants: GroupQuantConstants,
        block: &Block,
        x: &TokenView,
        eta: f32,
        buffers: &[(u32, Bind<'_>)],
    ) -> Result<()> {
        let l = &block.page;
        // Groups along tokens with D a multiple of 8: one invocation per 8 channels of a
        // group, so every word of x loaded is used whole (the reuse path also needs codes
        // that never straddle words).
        let eight = !constants.axis_channels
            && l.dim % 8 == 0
            && x.stride % 8 == 0
            && match entry {
                "quantize" | "fit_params" => true,
                "reuse_fit" => 32 % l.bits as usize == 0,
                _ => false,
            };
        let (entry, cells) = match (eight, entry) {
            (true, "quantize") => ("quantize8", block.cells() / 8),
            (true, "fit_params") => ("fit_params8", block.cells() / 8),
            (true, "reuse_fit") => ("reuse_fit8", block.cells() / 8),
            _ => (entry, block.cells()),
        };
        let key = KernelKey::new(
            entry,
            Constants::GroupQuant(GroupQuantConstants {
                in_f16: x.dtype == DType::F16,
                x_to_f16: x.dtype == DType::F32 && x.to_f16,
                ..constants
            }),
        );
        let grid = self.grid(cells, key.workgroup_size())?;
        let dims = GroupDims {
            rows: l.rows as u32,
            dim: l.dim as u32,
            n_groups: l.n_groups() as u32,
            other: l.other() as u32,
            words_per_group: l.words_per_group() as u32,
            res_words_per_group: l.with_bits(constants.res_bits.max(1)).words_per_group() as u32,
            t0: block.t0 as u32,
            n: block.n as u32,
            block_groups: block.groups() as u32,
            block_other: block.other() as u32,
            cells: cells as u32,
            x_tokens: x.tokens as u32,
            x_t0: x.t0 as u32,
            x_stride: x.stride as u32,
            grid_x: grid.x,
            eta,
            levels: level_slots(l),
        };
        self.dispatch(encoder, &key, &dims, buffers, grid);
        Ok(())
    }

    /// Records `quantize_codes` of `x` into a block of `codes`/`params`.
    pub(crate) fn encode_quantize_block(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        x: &TokenView,
        block: &Block,
        spec: &QuantSpec,
        codes: &PackedCodes,
        params: &GpuParams,
    ) -> Result<()> {
        let entry = match spec.levels {
            Levels::Uniform => "quantize",
            Levels::LloydMax => "quantize_levels",
        };
        self.launch_group(
            encoder,
            entry,
            GroupQuantConstants::for_layout(&block.page, spec.params),
            block,
            x,
            spec.eta,
            &[(1, x.buffer), (4, params.bind()), (5, codes.bind())],
        )
    }

    /// Records the fused reuse path for a block: own params for `anchor`'s codes and, with a
    /// residual, its codes and params against that reconstruction rounded to `out`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn encode_reuse_fit_block(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        x: &TokenView,
        block: &Block,
        spec: &QuantSpec,
        anchor: &PackedCodes,
        params: &GpuParams,
        residual: Option<&QuantizedTensor>,
        out: DType,
    ) -> Result<()> {
        let base = GroupQuantConstants::for_layout(&block.page, spec.params);
        let Some(res) = residual else {
            return self.launch_group(
                encoder,
                "fit_params",
                base,
                block,
                x,
                spec.eta,
                &[(1, x.buffer), (4, params.bind())],
            );
        };
        let constants = GroupQuantConstants {
            res_bits: res.params.layout.bits,
            round_f16: out == DType::F16,
            ..base
        };
        self.launch_group(
            encoder,
            "reuse_fit",
            constants,
            block,
            x,
            spec.eta,
            &[
                (1, x.buffer),
                (2, anchor.bind()),
                (4, params.bind()),
                (6, res.params.bind()),
                (7, res.codes.bind()),
            ],
        )
    }

    /// Records the quantization of `x - recon` (a block of `recon`'s tokens at `x`'s
    /// positions) into `res` at its own bits, without calibration.
    pub(crate) fn encode_residual_block(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        x: &TokenView,
        recon: &TokenView,
        block: &Block,
        spec: &QuantSpec,
        res: &QuantizedTensor,
    ) -> Result<()> {
        self.launch_group(
            encoder,
            "quantize_residual",
            GroupQuantConstants {
                recon_f16: recon.dtype == DType::F16,
                ..GroupQuantConstants::for_layout(&block.page, spec.params)
            },
            block,
            x,
            0.0,
            &[
                (1, x.buffer),
                (3, recon.buffer),
                (4, res.params.bind()),
                (5, res.codes.bind()),
            ],
        )
    }
}

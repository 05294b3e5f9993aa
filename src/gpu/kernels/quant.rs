//! Quantization kernels (`wgsl/group_quant.wgsl`, `wgsl/dequant.wgsl`) on GPU tensors.

use bytemuck::{Pod, Zeroable};

use crate::config::{validate_bits, DType, ParamsPrecision, QuantSpec, ValueAxis};
use crate::error::{shape_err, Result};
use crate::gpu::dispatch::Grid;
use crate::gpu::pipelines::{Family, KernelKey, Overrides, DEQUANT_RUN};
use crate::gpu::{GpuContext, GpuParams, GpuTensor, PackedCodes, QuantizedTensor};
use crate::layout::GroupLayout;

/// What a reuse layer stores on the GPU: its params for the anchor's codes and an optional
/// residual.
#[derive(Clone, Debug)]
pub struct ReuseEncodingGpu {
    /// Own (scale, zero) for the anchor's codes.
    pub params: GpuParams,
    /// Residual codes and params (`None` with residual bits 0).
    pub residual: Option<QuantizedTensor>,
}

impl ReuseEncodingGpu {
    /// Bytes allocated on the device.
    pub fn allocated_bytes(&self) -> u64 {
        self.params.allocated_bytes() + self.residual.as_ref().map_or(0, |r| r.allocated_bytes())
    }

    /// Frees the GPU memory now.
    pub fn destroy(&self) {
        self.params.destroy();
        if let Some(r) = &self.residual {
            r.destroy();
        }
    }
}

/// Mirrors `Dims` in `wgsl/group_quant.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct GroupDims {
    rows: u32,
    tokens: u32,
    dim: u32,
    n_groups: u32,
    other: u32,
    group_axis_len: u32,
    words_per_group: u32,
    res_words_per_group: u32,
    cells: u32,
    grid_x: u32,
    eta: f32,
    _pad: u32,
}

/// Mirrors `Dims` in `wgsl/dequant.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct DequantDims {
    rows: u32,
    tokens: u32,
    dim: u32,
    n_groups: u32,
    other: u32,
    words_per_group: u32,
    res_words_per_group: u32,
    elements: u32,
    runs: u32,
    grid_x: u32,
    _pad: [u32; 2],
}

fn group_dims(l: &GroupLayout, res_bits: u8, eta: f32, grid: Grid) -> GroupDims {
    GroupDims {
        rows: l.rows as u32,
        tokens: l.tokens as u32,
        dim: l.dim as u32,
        n_groups: l.n_groups() as u32,
        other: l.other() as u32,
        group_axis_len: l.group_axis_len() as u32,
        words_per_group: l.words_per_group() as u32,
        res_words_per_group: l.with_bits(res_bits.max(1)).words_per_group() as u32,
        cells: l.cells() as u32,
        grid_x: grid.x,
        eta,
        _pad: 0,
    }
}

fn overrides(l: &GroupLayout, params: ParamsPrecision) -> Overrides {
    Overrides {
        bits: l.bits,
        group: l.group_size as u32,
        params_f32: params == ParamsPrecision::F32,
        axis_channels: l.axis == ValueAxis::Channels,
        ..Default::default()
    }
}

fn group_key(entry: &'static str, overrides: Overrides) -> KernelKey {
    KernelKey {
        family: Family::GroupQuant,
        entry,
        overrides,
    }
}

fn check_layout(what: &str, got: &GroupLayout, want: &GroupLayout) -> Result<()> {
    if got != want {
        return shape_err!("{what}: layout {got:?} does not match the tensor's {want:?}");
    }
    Ok(())
}

impl GpuContext {
    fn launch_group(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        key: KernelKey,
        layout: &GroupLayout,
        res_bits: u8,
        eta: f32,
        buffers: &[(u32, &wgpu::Buffer)],
    ) -> Result<()> {
        let grid = self.grid(layout.cells(), key.workgroup_size())?;
        let dims = group_dims(layout, res_bits, eta, grid);
        self.dispatch(encoder, &key, bytemuck::bytes_of(&dims), buffers, grid);
        Ok(())
    }

    /// Records `quantize_codes` of `x`: packed codes and stored params.
    pub fn encode_quantize(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        x: &GpuTensor,
        spec: &QuantSpec,
    ) -> Result<QuantizedTensor> {
        spec.validate()?;
        let layout = GroupLayout::new(&x.shape, spec);
        let codes = self.empty_codes(layout, &x.shape)?;
        let params = self.empty_params(layout, spec.params)?;
        let key = group_key(
            "quantize",
            Overrides {
                in_f16: x.dtype == DType::F16,
                ..overrides(&layout, spec.params)
            },
        );
        self.launch_group(
            encoder,
            key,
            &layout,
            0,
            spec.eta,
            &[(1, &x.buffer), (4, &params.buffer), (5, &codes.buffer)],
        )?;
        Ok(QuantizedTensor { codes, params })
    }

    /// Records `compute_reuse_params`: a fresh calibration of `x` for `codes` (shape only).
    pub fn encode_fit_params(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        x: &GpuTensor,
        codes: &PackedCodes,
        spec: &QuantSpec,
    ) -> Result<GpuParams> {
        spec.validate()?;
        let layout = GroupLayout::new(&x.shape, spec);
        check_layout("anchor codes", &codes.layout, &layout)?;
        let params = self.empty_params(layout, spec.params)?;
        let key = group_key(
            "fit_params",
            Overrides {
                in_f16: x.dtype == DType::F16,
                ..overrides(&layout, spec.params)
            },
        );
        self.launch_group(
            encoder,
            key,
            &layout,
            0,
            spec.eta,
            &[(1, &x.buffer), (4, &params.buffer)],
        )?;
        Ok(params)
    }

    /// Records the quantization of `x - recon` at `bits` (no calibration): residual codes and
    /// params.
    pub fn encode_quantize_residual(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        x: &GpuTensor,
        recon: &GpuTensor,
        bits: u8,
        spec: &QuantSpec,
    ) -> Result<QuantizedTensor> {
        validate_bits("residual bits", bits)?;
        let spec = spec.residual(bits);
        spec.validate()?;
        if recon.shape != x.shape {
            return shape_err!(
                "recon shape {:?} differs from x {:?}",
                recon.shape.dims(),
                x.shape.dims()
            );
        }
        let layout = GroupLayout::new(&x.shape, &spec);
        let codes = self.empty_codes(layout, &x.shape)?;
        let params = self.empty_params(layout, spec.params)?;
        let key = group_key(
            "quantize_residual",
            Overrides {
                in_f16: x.dtype == DType::F16,
                recon_f16: recon.dtype == DType::F16,
                ..overrides(&layout, spec.params)
            },
        );
        self.launch_group(
            encoder,
            key,
            &layout,
            0,
            0.0,
            &[
                (1, &x.buffer),
                (3, &recon.buffer),
                (4, &params.buffer),
                (5, &codes.buffer),
            ],
        )?;
        Ok(QuantizedTensor { codes, params })
    }

    /// Records the fused reuse path: own params for `anchor`'s codes and, with
    /// `residual_bits > 0`, the residual against that reconstruction rounded to `out`.
    pub fn encode_reuse_fit(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        x: &GpuTensor,
        anchor: &PackedCodes,
        spec: &QuantSpec,
        residual_bits: u8,
        out: DType,
    ) -> Result<ReuseEncodingGpu> {
        if residual_bits == 0 {
            let params = self.encode_fit_params(encoder, x, anchor, spec)?;
            return Ok(ReuseEncodingGpu {
                params,
                residual: None,
            });
        }
        spec.validate()?;
        validate_bits("residual bits", residual_bits)?;
        let layout = GroupLayout::new(&x.shape, spec);
        check_layout("anchor codes", &anchor.layout, &layout)?;
        let res_layout = layout.with_bits(residual_bits);
        let params = self.empty_params(layout, spec.params)?;
        let res_codes = self.empty_codes(res_layout, &x.shape)?;
        let res_params = self.empty_params(res_layout, spec.params)?;
        let key = group_key(
            "reuse_fit",
            Overrides {
                res_bits: residual_bits,
                in_f16: x.dtype == DType::F16,
                round_f16: out == DType::F16,
                ..overrides(&layout, spec.params)
            },
        );
        self.launch_group(
            encoder,
            key,
            &layout,
            residual_bits,
            spec.eta,
            &[
                (1, &x.buffer),
                (2, &anchor.buffer),
                (4, &params.buffer),
                (6, &res_params.buffer),
                (7, &res_codes.buffer),
            ],
        )?;
        Ok(ReuseEncodingGpu {
            params,
            residual: Some(QuantizedTensor {
                codes: res_codes,
                params: res_params,
            }),
        })
    }

    fn launch_dequant(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        entry: &'static str,
        codes: &PackedCodes,
        params: &GpuParams,
        residual: Option<&QuantizedTensor>,
        out: &GpuTensor,
    ) -> Result<()> {
        let l = params.layout;
        check_layout("codes", &codes.layout, &l)?;
        if out.shape.len() != l.elements()
            || out.shape.tokens() != l.tokens
            || out.shape.dim() != l.dim
        {
            return shape_err!(
                "output {:?} does not fit the codes' {} x {} x {}",
                out.shape.dims(),
                l.rows,
                l.tokens,
                l.dim
            );
        }
        let res_bits = residual.map_or(0, |r| r.params.layout.bits);
        if let Some(r) = residual {
            check_layout("residual codes", &r.codes.layout, &l.with_bits(res_bits))?;
            check_layout("residual params", &r.params.layout, &l.with_bits(res_bits))?;
        }
        let runs = l.elements().div_ceil(DEQUANT_RUN as usize);
        let key = KernelKey {
            family: Family::Dequant,
            entry,
            overrides: Overrides {
                res_bits,
                out_f16: out.dtype == DType::F16,
                ..overrides(&l, params.precision)
            },
        };
        let grid = self.grid(runs, key.workgroup_size())?;
        let dims = DequantDims {
            rows: l.rows as u32,
            tokens: l.tokens as u32,
            dim: l.dim as u32,
            n_groups: l.n_groups() as u32,
            other: l.other() as u32,
            words_per_group: l.words_per_group() as u32,
            res_words_per_group: l.with_bits(res_bits.max(1)).words_per_group() as u32,
            elements: l.elements() as u32,
            runs: runs as u32,
            grid_x: grid.x,
            _pad: [0; 2],
        };
        let mut buffers = vec![(1, &*codes.buffer), (2, &*params.buffer), (5, &*out.buffer)];
        if let Some(r) = residual {
            buffers.extend([(3, &*r.codes.buffer), (4, &*r.params.buffer)]);
        }
        self.dispatch(encoder, &key, bytemuck::bytes_of(&dims), &buffers, grid);
        Ok(())
    }

    /// Records `dequant_with_params` into `out` (f32, or f16 rounded once).
    pub fn encode_dequant_into(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        codes: &PackedCodes,
        params: &GpuParams,
        out: &GpuTensor,
    ) -> Result<()> {
        self.launch_dequant(encoder, "dequant", codes, params, None, out)
    }

    /// Records a reuse layer's reconstruction (anchor codes with own params, plus residual)
    /// into `out`.
    pub fn encode_reuse_reconstruct_into(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        anchor: &PackedCodes,
        reuse: &ReuseEncodingGpu,
        out: &GpuTensor,
    ) -> Result<()> {
        match &reuse.residual {
            None => self.launch_dequant(encoder, "dequant", anchor, &reuse.params, None, out),
            Some(r) => self.launch_dequant(
                encoder,
                "dequant_residual",
                anchor,
                &reuse.params,
                Some(r),
                out,
            ),
        }
    }

    /// `quantize_codes` on the GPU.
    pub async fn quantize(&self, x: &GpuTensor, spec: &QuantSpec) -> Result<QuantizedTensor> {
        self.run("quantize", |enc| self.encode_quantize(enc, x, spec))
            .await
    }

    /// `compute_reuse_params` on the GPU.
    pub async fn compute_reuse_params(
        &self,
        x: &GpuTensor,
        codes: &PackedCodes,
        spec: &QuantSpec,
    ) -> Result<GpuParams> {
        self.run("compute_reuse_params", |enc| {
            self.encode_fit_params(enc, x, codes, spec)
        })
        .await
    }

    /// `dequant_with_params` on the GPU, output `[..., N, D]` in `out`.
    pub async fn dequant(
        &self,
        codes: &PackedCodes,
        params: &GpuParams,
        out: DType,
    ) -> Result<GpuTensor> {
        let t = self.empty_tensor(&codes.shape, out)?;
        self.run("dequant", |enc| {
            self.encode_dequant_into(enc, codes, params, &t)
        })
        .await?;
        Ok(t)
    }

    /// `quantize_residual` on the GPU: the dequantized `bits`-bit residual of `x - recon`.
    pub async fn quantize_residual(
        &self,
        x: &GpuTensor,
        recon: &GpuTensor,
        bits: u8,
        spec: &QuantSpec,
        out: DType,
    ) -> Result<GpuTensor> {
        let t = self.empty_tensor(&x.shape, out)?;
        self.run("quantize_residual", |enc| {
            let q = self.encode_quantize_residual(enc, x, recon, bits, spec)?;
            self.encode_dequant_into(enc, &q.codes, &q.params, &t)
        })
        .await?;
        Ok(t)
    }

    /// The fused reuse path on the GPU (see [`GpuContext::encode_reuse_fit`]).
    pub async fn reuse_fit(
        &self,
        x: &GpuTensor,
        anchor: &PackedCodes,
        spec: &QuantSpec,
        residual_bits: u8,
        out: DType,
    ) -> Result<ReuseEncodingGpu> {
        self.run("reuse_fit", |enc| {
            self.encode_reuse_fit(enc, x, anchor, spec, residual_bits, out)
        })
        .await
    }

    /// A reuse layer's reconstruction on the GPU.
    pub async fn reuse_reconstruct(
        &self,
        anchor: &PackedCodes,
        reuse: &ReuseEncodingGpu,
        out: DType,
    ) -> Result<GpuTensor> {
        let t = self.empty_tensor(&anchor.shape, out)?;
        self.run("reuse_reconstruct", |enc| {
            self.encode_reuse_reconstruct_into(enc, anchor, reuse, &t)
        })
        .await?;
        Ok(t)
    }
}

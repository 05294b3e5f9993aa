//! The public tensor operations: the reference's functions (`quantize_codes`,
//! `compute_reuse_params`, `dequant_with_params`, `quantize_residual`, the fused reuse path)
//! on whole GPU tensors, as `encode_*` into a caller's encoder or as async calls.

use crate::config::{validate_bits, DType, QuantSpec};
use crate::error::{shape_err, Result};
use crate::gpu::kernels::materialize::{Encoded, OutView, Source};
use crate::gpu::kernels::views::{check_layout, Block};
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
}

impl GpuContext {
    /// Records `quantize_codes` of `x`: packed codes and stored params.
    pub fn encode_quantize(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        x: &GpuTensor,
        spec: &QuantSpec,
    ) -> Result<QuantizedTensor> {
        spec.validate()?;
        let layout = GroupLayout::new(&x.shape, spec);
        spec.check_axis(layout.group_axis_len())?;
        let codes = self.empty_codes(layout, &x.shape)?;
        let params = self.empty_params(layout, spec.params)?;
        self.encode_quantize_block(
            encoder,
            &x.view(),
            &Block::whole(layout),
            spec,
            &codes,
            &params,
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
        // The reuse path without a residual is exactly this calibration.
        let reuse = self.encode_reuse_fit(encoder, x, codes, spec, 0, DType::F32)?;
        Ok(reuse.params)
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
        let res = QuantizedTensor { codes, params };
        self.encode_residual_block(
            encoder,
            &x.view(),
            &recon.view(),
            &Block::whole(layout),
            &spec,
            &res,
        )?;
        Ok(res)
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
        spec.validate()?;
        if residual_bits != 0 {
            validate_bits("residual bits", residual_bits)?;
        }
        let layout = GroupLayout::new(&x.shape, spec);
        check_layout("anchor codes", &anchor.layout, &layout)?;
        spec.check_borrowable()?;
        let params = self.empty_params(layout, spec.params)?;
        let residual = match residual_bits {
            0 => None,
            bits => {
                let res_layout = layout.with_bits(bits);
                Some(QuantizedTensor {
                    codes: self.empty_codes(res_layout, &x.shape)?,
                    params: self.empty_params(res_layout, spec.params)?,
                })
            }
        };
        let block = Block::whole(layout);
        self.encode_reuse_fit_block(
            encoder,
            &x.view(),
            &block,
            spec,
            anchor,
            &params,
            residual.as_ref(),
            out,
        )?;
        Ok(ReuseEncodingGpu { params, residual })
    }

    fn check_out(&self, layout: &GroupLayout, out: &GpuTensor) -> Result<()> {
        let l = layout;
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
        Ok(())
    }

    fn materialize_whole(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        enc: Encoded,
        out: &GpuTensor,
    ) -> Result<()> {
        let l = enc.params.layout;
        check_layout("codes", &enc.codes.layout, &l)?;
        if let Some(r) = enc.residual {
            let rl = l.with_bits(r.params.layout.bits);
            check_layout("residual codes", &r.codes.layout, &rl)?;
            check_layout("residual params", &r.params.layout, &rl)?;
        }
        self.check_out(&l, out)?;
        let source = Source::Block(Block::whole(l), enc);
        let view = OutView {
            buffer: out.bind(),
            dtype: out.dtype,
            rows: l.rows,
            tokens: l.tokens,
            dim: l.dim,
            t0: 0,
        };
        self.encode_materialize(encoder, &source, &view)
    }

    /// Records `dequant_with_params` into `out` (f32, or f16 rounded once).
    pub fn encode_dequant_into(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        codes: &PackedCodes,
        params: &GpuParams,
        out: &GpuTensor,
    ) -> Result<()> {
        let enc = Encoded {
            codes,
            params,
            residual: None,
        };
        self.materialize_whole(encoder, enc, out)
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
        let enc = Encoded {
            codes: anchor,
            params: &reuse.params,
            residual: reuse.residual.as_ref(),
        };
        self.materialize_whole(encoder, enc, out)
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
        // The residual's codes and params must outlive the submission that uses them.
        let _residual = self
            .run("quantize_residual", |enc| {
                let q = self.encode_quantize_residual(enc, x, recon, bits, spec)?;
                self.encode_dequant_into(enc, &q.codes, &q.params, &t)?;
                Ok(q)
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

//! Quantization kernels (`wgsl/group_quant.wgsl`, `wgsl/materialize.wgsl`,
//! `wgsl/window.wgsl`) on GPU tensors, whole or as blocks of pages.

use bytemuck::{Pod, Zeroable};

use crate::config::{validate_bits, DType, ParamsPrecision, QuantSpec, ValueAxis};
use crate::error::{shape_err, Result};
use crate::gpu::dispatch::Bind;
use crate::gpu::pipelines::{Family, KernelKey, MaterializeKind, Overrides, DEQUANT_RUN};
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

/// A token range of a dense buffer `[R, tokens, stride]` (stride = elements per token).
#[derive(Clone, Copy, Debug)]
pub(crate) struct TokenView<'a> {
    pub buffer: Bind<'a>,
    pub dtype: DType,
    /// Token rows per row of the buffer.
    pub tokens: usize,
    /// First token of the range.
    pub t0: usize,
    /// Elements per token (D, or D rounded up to even in window rings).
    pub stride: usize,
    /// Round f32 values to f16 as they are read (cache inputs: caches hold f16 K/V).
    pub to_f16: bool,
}

impl GpuTensor {
    /// The whole tensor as a view.
    pub(crate) fn view(&self) -> TokenView<'_> {
        TokenView {
            buffer: self.bind(),
            dtype: self.dtype,
            tokens: self.shape.tokens(),
            t0: 0,
            stride: self.shape.dim(),
            to_f16: false,
        }
    }
}

impl GpuTensor {
    /// The whole tensor as a cache input: f32 values are read as f16.
    pub(crate) fn cache_view(&self) -> TokenView<'_> {
        TokenView {
            to_f16: true,
            ..self.view()
        }
    }
}

/// Tokens `[t0, t0 + n)` of a page whose codes and params are laid out by `page`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    pub page: GroupLayout,
    pub t0: usize,
    pub n: usize,
}

impl Block {
    /// The whole tensor a layout describes.
    pub fn whole(page: GroupLayout) -> Block {
        Block {
            page,
            t0: 0,
            n: page.tokens,
        }
    }

    /// Groups per row inside the block.
    fn groups(&self) -> usize {
        match self.page.axis {
            ValueAxis::Tokens => self.n.div_ceil(self.page.group_size),
            ValueAxis::Channels => self.page.n_groups(),
        }
    }

    /// Other-axis length inside the block.
    fn other(&self) -> usize {
        match self.page.axis {
            ValueAxis::Tokens => self.page.dim,
            ValueAxis::Channels => self.n,
        }
    }

    fn cells(&self) -> usize {
        self.page.rows * self.groups() * self.other()
    }
}

/// Mirrors `Dims` in `wgsl/group_quant.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct GroupDims {
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
}

/// Mirrors `Dims` in `wgsl/materialize.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct MaterializeDims {
    rows: u32,
    dim: u32,
    n_groups: u32,
    other: u32,
    words_per_group: u32,
    res_words_per_group: u32,
    t0: u32,
    n: u32,
    out_tokens: u32,
    out_t0: u32,
    region_len: u32,
    region_stride: u32,
    runs_per_region: u32,
    regions: u32,
    grid_x: u32,
    ring_tokens: u32,
}

/// Mirrors `Dims` in `wgsl/window.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct WindowDims {
    rows: u32,
    dim: u32,
    n: u32,
    ring_tokens: u32,
    ring_t0: u32,
    x_tokens: u32,
    x_t0: u32,
    grid_x: u32,
}

/// The codes a materialize dispatch decodes: base codes and params, plus a residual.
pub(crate) struct Encoded<'a> {
    pub codes: &'a PackedCodes,
    pub params: &'a GpuParams,
    pub residual: Option<&'a QuantizedTensor>,
}

/// Where a materialize dispatch writes: tokens `[t0, t0 + n)` of `[rows, tokens, dim]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OutView<'a> {
    pub buffer: Bind<'a>,
    pub dtype: DType,
    pub rows: usize,
    pub tokens: usize,
    pub dim: usize,
    pub t0: usize,
}

/// Where appended tokens go: an f16 ring `[rows, tokens, D_even]`, first token `t0`
/// (absolute; slot `t0 % tokens`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RingTarget<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub tokens: usize,
    pub t0: usize,
    pub rows: usize,
    pub dim: usize,
}

/// What a materialize dispatch reads.
pub(crate) enum Source<'a> {
    /// A block of quantized tokens.
    Block(Block, Encoded<'a>),
    /// Window tokens `[t0, t0 + n)` (absolute) of an f16 ring `[R, ring_tokens, D_even]`.
    Ring {
        ring: &'a wgpu::Buffer,
        ring_tokens: usize,
        t0: usize,
        n: usize,
    },
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

fn check_layout(what: &str, got: &GroupLayout, want: &GroupLayout) -> Result<()> {
    if got != want {
        return shape_err!("{what}: layout {got:?} does not match the tensor's {want:?}");
    }
    Ok(())
}

impl GpuContext {
    #[allow(clippy::too_many_arguments)]
    fn launch_group(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        entry: &'static str,
        overrides: Overrides,
        block: &Block,
        x: &TokenView,
        eta: f32,
        buffers: &[(u32, Bind<'_>)],
    ) -> Result<()> {
        let l = &block.page;
        // Groups along tokens with D a multiple of 8: one invocation per 8 channels of a
        // group, so every word of x loaded is used whole (the reuse path also needs codes
        // that never straddle words).
        let eight = !overrides.axis_channels
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
        let key = KernelKey {
            family: Family::GroupQuant,
            entry,
            overrides: Overrides {
                in_f16: x.dtype == DType::F16,
                x_to_f16: x.dtype == DType::F32 && x.to_f16,
                ..overrides
            },
        };
        let grid = self.grid(cells, key.workgroup_size())?;
        let dims = GroupDims {
            rows: l.rows as u32,
            dim: l.dim as u32,
            n_groups: l.n_groups() as u32,
            other: l.other() as u32,
            words_per_group: l.words_per_group() as u32,
            res_words_per_group: l.with_bits(overrides.res_bits.max(1)).words_per_group() as u32,
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
        };
        self.dispatch(encoder, &key, bytemuck::bytes_of(&dims), buffers, grid);
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
        self.launch_group(
            encoder,
            "quantize",
            overrides(&block.page, spec.params),
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
        let base = overrides(&block.page, spec.params);
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
        let key = Overrides {
            res_bits: res.params.layout.bits,
            round_f16: out == DType::F16,
            ..base
        };
        self.launch_group(
            encoder,
            "reuse_fit",
            key,
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

    /// Records a materialize dispatch: `source` into tokens `[out.t0, out.t0 + n)` of `out`.
    pub(crate) fn encode_materialize(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        source: &Source,
        out: &OutView,
    ) -> Result<()> {
        let (out_dtype, out_tokens, out_t0, rows, dim) =
            (out.dtype, out.tokens, out.t0, out.rows, out.dim);
        let placeholder = self.placeholder();
        let (n, kind, page, t0, ring_tokens) = match source {
            Source::Block(b, e) => {
                let kind = match e.residual {
                    None => MaterializeKind::Dequant,
                    Some(_) => MaterializeKind::DequantResidual,
                };
                (b.n, kind, Some(b.page), b.t0, 1)
            }
            Source::Ring {
                ring_tokens, t0, n, ..
            } => (*n, MaterializeKind::Window, None, *t0, *ring_tokens),
        };
        let contiguous = out_tokens == n;
        let (regions, region_len, region_stride) = if contiguous {
            (1, rows * n * dim, 0)
        } else {
            (rows, n * dim, out_tokens * dim)
        };
        let (words, per_run) = match out_dtype {
            DType::F32 => (region_len, DEQUANT_RUN as usize),
            DType::F16 => (region_len / 2 + 1, DEQUANT_RUN as usize / 2),
        };
        let runs_per_region = words.div_ceil(per_run);
        // A window needs no codes: any valid code geometry will do.
        let mut ov = Overrides {
            out_f16: out_dtype == DType::F16,
            kind,
            bits: 1,
            group: 1,
            ..Default::default()
        };
        let ph = Bind::from(&placeholder);
        let mut buffers: [(u32, Bind); 6] =
            [(1, ph), (2, ph), (3, ph), (4, ph), (5, out.buffer), (6, ph)];
        let mut res_bits = 1;
        match source {
            Source::Block(b, e) => {
                ov = Overrides {
                    kind: ov.kind,
                    out_f16: ov.out_f16,
                    ..overrides(&b.page, e.params.precision)
                };
                buffers[0].1 = e.codes.bind();
                buffers[1].1 = e.params.bind();
                if let Some(r) = e.residual {
                    res_bits = r.params.layout.bits;
                    ov.res_bits = res_bits;
                    buffers[2].1 = r.codes.bind();
                    buffers[3].1 = r.params.bind();
                }
            }
            Source::Ring { ring, .. } => buffers[5].1 = Bind::from(*ring),
        }
        // Groups along tokens, D a multiple of 8, codes that never straddle words: one
        // invocation per code word of tokens and 8 channels, whole output words.
        let whole_words =
            |bits: u8, g: usize| 32 % bits as usize == 0 && (g * bits as usize) % 32 == 0;
        let eight = match source {
            Source::Block(b, e) => {
                b.page.axis == ValueAxis::Tokens
                    && dim % 8 == 0
                    && whole_words(b.page.bits, b.page.group_size)
                    && e.residual
                        .is_none_or(|r| whole_words(r.params.layout.bits, b.page.group_size))
            }
            Source::Ring { .. } => false,
        };
        let key = KernelKey {
            family: Family::Materialize,
            entry: if eight { "dequant8" } else { "materialize" },
            overrides: ov,
        };
        let threads = match (eight, page) {
            (true, Some(p)) => rows * n.div_ceil(32 / p.bits as usize) * (dim / 8),
            _ => regions * runs_per_region,
        };
        let grid = self.grid(threads, key.workgroup_size())?;
        let dims = MaterializeDims {
            rows: rows as u32,
            dim: dim as u32,
            n_groups: page.map_or(1, |p| p.n_groups()) as u32,
            other: page.map_or(1, |p| p.other()) as u32,
            words_per_group: page.map_or(1, |p| p.words_per_group()) as u32,
            res_words_per_group: page.map_or(1, |p| p.with_bits(res_bits).words_per_group()) as u32,
            t0: t0 as u32,
            n: n as u32,
            out_tokens: out_tokens as u32,
            out_t0: out_t0 as u32,
            region_len: region_len as u32,
            region_stride: region_stride as u32,
            runs_per_region: runs_per_region as u32,
            regions: regions as u32,
            grid_x: grid.x,
            ring_tokens: ring_tokens as u32,
        };
        self.dispatch(encoder, &key, bytemuck::bytes_of(&dims), &buffers, grid);
        Ok(())
    }

    /// Records appending tokens `[x.t0, x.t0 + n)` of `x` to a ring.
    pub(crate) fn encode_window_append(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        x: &TokenView,
        n: usize,
        ring: &RingTarget,
    ) -> Result<()> {
        let (rows, dim, ring_tokens, ring_t0) = (ring.rows, ring.dim, ring.tokens, ring.t0);
        let key = KernelKey {
            family: Family::Window,
            entry: "append",
            overrides: Overrides {
                in_f16: x.dtype == DType::F16,
                ..Default::default()
            },
        };
        let grid = self.grid(rows * n * dim.div_ceil(2), key.workgroup_size())?;
        let dims = WindowDims {
            rows: rows as u32,
            dim: dim as u32,
            n: n as u32,
            ring_tokens: ring_tokens as u32,
            ring_t0: ring_t0 as u32,
            x_tokens: x.tokens as u32,
            x_t0: x.t0 as u32,
            grid_x: grid.x,
        };
        self.dispatch(
            encoder,
            &key,
            bytemuck::bytes_of(&dims),
            &[(1, x.buffer), (2, ring.buffer.into())],
            grid,
        );
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
        self.launch_group(
            encoder,
            "quantize_residual",
            Overrides {
                recon_f16: recon.dtype == DType::F16,
                ..overrides(&layout, spec.params)
            },
            &Block::whole(layout),
            &x.view(),
            0.0,
            &[
                (1, x.bind()),
                (3, recon.bind()),
                (4, params.bind()),
                (5, codes.bind()),
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
        spec.validate()?;
        if residual_bits != 0 {
            validate_bits("residual bits", residual_bits)?;
        }
        let layout = GroupLayout::new(&x.shape, spec);
        check_layout("anchor codes", &anchor.layout, &layout)?;
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

//! Host of `wgsl/materialize.wgsl`: decoding a block of codes (with or without a residual),
//! or a window ring's f16 tokens, into a dense output.

use crate::config::{DType, Levels, ParamsPrecision, ValueAxis};
use crate::error::{shape_err, Result};
use crate::gpu::dispatch::Bind;
use crate::gpu::kernels::group_quant::level_slots;
use crate::gpu::kernels::views::{Block, RingSinks};
use crate::gpu::mirror::wgsl_struct;
use crate::gpu::pipelines::{
    Constants, Family, KernelKey, MaterializeConstants, MaterializeKind, DEQUANT_RUN,
};
use crate::gpu::{GpuContext, GpuParams, PackedCodes, QuantizedTensor};
use crate::layout::GroupLayout;

wgsl_struct! {
    /// Mirrors `Dims` in `wgsl/materialize.wgsl`.
    pub(crate) struct MaterializeDims = Family::Materialize, "Dims" {
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
        sinks: u32,
        sink_slots: u32,
        sink_word: u32,
        _pad0: u32,
        levels: [[f32; 4]; 4],
    }
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

/// What a materialize dispatch reads.
pub(crate) enum Source<'a> {
    /// A block of quantized tokens.
    Block(Block, Encoded<'a>),
    /// Window tokens `[t0, t0 + n)` (absolute) of an f16 ring `[R, ring_tokens, D_even]` (a
    /// buffer, or a section of one), and the `sinks` its buffer holds, in the same launch
    /// (a D that [`joins_sinks`]).
    Ring {
        ring: Bind<'a>,
        ring_tokens: usize,
        t0: usize,
        n: usize,
        sinks: RingSinks,
    },
}

impl MaterializeConstants {
    /// The constants of decoding codes laid out by `l` with params stored at `params`.
    fn for_layout(l: &GroupLayout, params: ParamsPrecision) -> Self {
        MaterializeConstants {
            bits: l.bits,
            group: l.group_size as u32,
            params_f32: params == ParamsPrecision::F32,
            axis_channels: l.axis == ValueAxis::Channels,
            levels: l.levels == Levels::LloydMax,
            ..Default::default()
        }
    }
}

impl GpuContext {
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
        let (n, kind, page, t0, ring_tokens, sinks) = match source {
            Source::Block(b, e) => {
                let kind = match e.residual {
                    None => MaterializeKind::Dequant,
                    Some(_) => MaterializeKind::DequantResidual,
                };
                (b.n, kind, Some(b.page), b.t0, 1, RingSinks::default())
            }
            Source::Ring {
                ring_tokens,
                t0,
                n,
                sinks,
                ..
            } => (*n, MaterializeKind::Window, None, *t0, *ring_tokens, *sinks),
        };
        if sinks.n > 0 && !joins_sinks(dim) {
            return shape_err!("a ring's sinks with its window: no vector path for D = {dim}");
        }
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
        let mut ov = MaterializeConstants {
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
                ov = MaterializeConstants {
                    kind: ov.kind,
                    out_f16: ov.out_f16,
                    ..MaterializeConstants::for_layout(&b.page, e.params.precision)
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
            Source::Ring { ring, .. } => buffers[5].1 = *ring,
        }
        let entry = vector_entry(source, dim);
        let key = KernelKey::new(entry.name(), Constants::Materialize(ov));
        let threads = match (entry, page) {
            (Entry::Dequant8, Some(p)) => rows * n.div_ceil(run8(p.bits as usize)) * (dim / 8),
            (Entry::Dequant4, Some(p)) => rows * (n / 4) * p.n_groups() * p.words_per_group(),
            (Entry::Ring8, _) => rows * (sinks.n + n) * (dim / 8),
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
            sinks: sinks.n as u32,
            sink_slots: sinks.slots as u32,
            sink_word: sinks.word as u32,
            _pad0: 0,
            levels: page.map_or([[0.0; 4]; 4], |p| level_slots(&p)),
        };
        self.dispatch(encoder, &key, &dims, &buffers, grid);
        Ok(())
    }
}

/// Whether a ring's sinks are fetched in its window's launch: where its tokens take `ring8`
/// (D a multiple of 8, as [`vector_entry`] has it).
pub(crate) fn joins_sinks(dim: usize) -> bool {
    dim % 8 == 0
}

/// The entry point that decodes a source: a vector path where its geometry allows one, else
/// the element-by-element `materialize`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    Materialize,
    /// Groups along tokens: 8 channels x a run of members (`run8`).
    Dequant8,
    /// Groups along D without a residual: 4 tokens x one code word of channels.
    Dequant4,
    /// Window tokens: one token x 8 channels.
    Ring8,
}

impl Entry {
    fn name(self) -> &'static str {
        match self {
            Entry::Materialize => "materialize",
            Entry::Dequant8 => "dequant8",
            Entry::Dequant4 => "dequant4",
            Entry::Ring8 => "ring8",
        }
    }
}

fn vector_entry(source: &Source, dim: usize) -> Entry {
    if dim % 8 != 0 {
        return Entry::Materialize;
    }
    let (b, e) = match source {
        Source::Ring { .. } => return Entry::Ring8,
        Source::Block(b, e) => (b, e),
    };
    let l = &b.page;
    let bits = l.bits as usize;
    match l.axis {
        // Runs of members that start a word and stay in one group (`run8`).
        ValueAxis::Tokens if b.t0 % run8(bits) == 0 && l.group_size % run8(bits) == 0 => {
            Entry::Dequant8
        }
        // Words of whole channels (no residual); the block and the page hold whole quads of
        // tokens (cells).
        ValueAxis::Channels
            if e.residual.is_none()
                && channel_words(l)
                && l.other() % 4 == 0
                && b.t0 % 4 == 0
                && b.n % 4 == 0 =>
        {
            Entry::Dequant4
        }
        _ => Entry::Materialize,
    }
}

/// Whether every code word of `l` holds 8 or more whole channels of one group: codes
/// grouped along D of 1, 2 or 4 bits, in groups that start a word and tile D. The word
/// geometry `dequant4` and the fetch's un-rotation of Lloyd–Max codes (`rotate_held`,
/// `FROM_LEVELS`) decode.
pub(crate) fn channel_words(l: &GroupLayout) -> bool {
    let bits = l.bits as usize;
    l.axis == ValueAxis::Channels
        && matches!(bits, 1 | 2 | 4)
        && (l.group_size * bits) % 32 == 0
        && l.dim % l.group_size == 0
}

/// Members a `dequant8` invocation decodes (`run8` in the shader): one code word's where
/// codes never straddle words, else 32 (`bits` whole words).
fn run8(bits: usize) -> usize {
    if 32 % bits == 0 {
        32 / bits
    } else {
        32
    }
}

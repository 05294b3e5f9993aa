//! Split-K attention over a cache's K/V (`wgsl/attention.wgsl`): one dispatch per source
//! (a block of quantized tokens of a page, or the f16 tokens of a ring; a ring right after a
//! block joins the block's dispatch), each writing a partial per (row, query, chunk), then
//! one `combine` dispatch into the output.

use crate::config::{DType, ParamsPrecision, ValueAxis};
use crate::error::{shape_err, Result, XqError};
use crate::gpu::dispatch::Bind;
use crate::gpu::mirror::wgsl_struct;
use crate::gpu::pipelines::{AttentionConstants, Constants, Family, KernelKey, ATTENTION_WG};
use crate::gpu::{GpuContext, GpuParams, GpuTensor, PackedCodes, QuantizedTensor};

/// Most queries one workgroup handles (one vec4 of them).
const QT_MAX: usize = 4;
/// Most tokens per workgroup.
const CHUNK_MAX: usize = 512;
/// Most tokens per key-phase thread, and a ring's (`TT_MAX` in the shader).
pub(crate) const TT_MAX: usize = 16;

/// Tokens per workgroup for queries of dimension `dim` and `tt` tokens per key-phase thread
/// within `workgroup_bytes` of workgroup memory (queries: D vec4s, probabilities: CHUNK
/// vec4s, softmax statistics: 2 vec4s); `None` when not even one run fits.
pub(crate) fn chunk_tokens(dim: usize, tt: usize, workgroup_bytes: usize) -> Option<usize> {
    let room = (workgroup_bytes / 16).saturating_sub(dim + 2);
    let chunk = room.min(CHUNK_MAX) / tt * tt;
    (chunk > 0).then_some(chunk)
}

/// How an attention output is laid out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OutLayout {
    /// `[batch, query_heads, tokens, head_dim]`, like the queries.
    #[default]
    HeadsMajor,
    /// `[batch, tokens, query_heads, head_dim]`: one row per token, as an output
    /// projection reads it.
    TokensMajor,
}

/// Options of an attention call.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttendOptions {
    /// Absolute position of query token 0; query `t` sees cached tokens at positions
    /// `<= pos0 + t`. Default: the queries are the layer's last `T` tokens (causal decode).
    pub pos0: Option<usize>,
    /// Softmax scale; default `1 / sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// Layout of the output; default heads-major like the queries.
    pub layout: OutLayout,
}

wgsl_struct! {
    /// Mirrors `Dims` in `wgsl/attention.wgsl`.
    pub(crate) struct AttnDims = Family::Attention, "Dims" {
        rows: u32,
        kv_heads: u32,
        q_heads: u32,
        q_tokens: u32,
        q_per_row: u32,
        tiles: u32,
        pos0: u32,
        scale: f32,
        n: u32,
        abs0: u32,
        chunks: u32,
        slot0: u32,
        slots: u32,
        grid_x: u32,
        t0: u32,
        ring_tokens: u32,
        k: Side,
        v: Side,
        out_batch: u32,
        out_head: u32,
        out_token: u32,
        ring_n: u32,
        ring_t0: u32,
        ring_abs0: u32,
        _pad1: u32,
        _pad2: u32,
    }
}

wgsl_struct! {
    /// Mirrors `Side` in `wgsl/attention.wgsl`: the key or value half of `Dims` (page
    /// geometry and word offsets of its sections).
    pub(crate) struct Side = Family::Attention, "Side" {
        groups: u32,
        other: u32,
        wpg: u32,
        rwpg: u32,
        params: u32,
        res_params: u32,
        res_codes: u32,
        codes: u32,
    }
}

/// One attention call: the queries, the output and the cache geometry.
#[derive(Clone, Copy)]
pub(crate) struct AttnCall<'a> {
    /// `[B, q_heads, T, D]`, f32 or f16.
    pub queries: &'a GpuTensor,
    /// `[B, q_heads, T, D]` or `[B, T, q_heads, D]` (see `layout`), f32 or f16.
    pub out: &'a GpuTensor,
    pub batch: usize,
    pub kv_heads: usize,
    pub q_heads: usize,
    pub q_tokens: usize,
    pub dim: usize,
    pub pos0: usize,
    pub scale: f32,
    pub layout: OutLayout,
}

impl AttnCall<'_> {
    fn rows(&self) -> usize {
        self.batch * self.kv_heads
    }

    fn q_per_row(&self) -> usize {
        self.q_heads / self.kv_heads * self.q_tokens
    }
}

/// One side (keys or values) of a quantized block: the codes it decodes (own, or the
/// anchor's) and its page's params and residual, sections of one page buffer.
#[derive(Clone, Copy)]
pub(crate) struct BlockSide<'a> {
    pub codes: &'a PackedCodes,
    pub params: &'a GpuParams,
    pub residual: Option<&'a QuantizedTensor>,
}

/// What one attention dispatch reads.
pub(crate) enum AttnSource<'a> {
    /// Page tokens `[t0, t0 + n)` of a page, at absolute positions `abs0..`.
    Block {
        key: BlockSide<'a>,
        value: BlockSide<'a>,
        t0: usize,
        n: usize,
        abs0: usize,
    },
    /// Ring tokens `[t0, t0 + n)` (slot `t % ring_tokens`) of f16 rings
    /// `[R, ring_tokens, D_even / 2]`, at absolute positions `abs0..`.
    Ring {
        key: &'a wgpu::Buffer,
        value: &'a wgpu::Buffer,
        ring_tokens: usize,
        t0: usize,
        n: usize,
        abs0: usize,
    },
}

impl AttnSource<'_> {
    fn n(&self) -> usize {
        match self {
            AttnSource::Block { n, .. } | AttnSource::Ring { n, .. } => *n,
        }
    }

    /// Tokens per key-phase thread: a multiple of 4 (a power of two) dividing the group
    /// size, whose codes fit one 32-bit window; and whether the group size forces the generic
    /// per-token path (not a multiple of 4).
    fn tokens_per_thread(&self) -> (usize, bool) {
        match self {
            AttnSource::Ring { .. } => (TT_MAX, false),
            AttnSource::Block { key, value, .. } => {
                // Residual codes wider than the run's are read a window per 4 tokens.
                let widest = key.params.layout.bits.max(value.params.layout.bits) as usize;
                let g = key.params.layout.group_size;
                let mut tt = TT_MAX;
                while tt > 4 && (tt * widest > 32 || g % tt != 0) {
                    tt /= 2;
                }
                (tt, g % 4 != 0)
            }
        }
    }
}

/// Workgroup geometry of one dispatch: tokens per key-phase thread, queries, chunk tokens.
#[derive(Clone, Copy, Debug)]
struct Tiling {
    tt: usize,
    generic: bool,
    qt: usize,
    chunk: usize,
}

impl GpuContext {
    /// The widest head the attention kernels can tile on this device: the queries (D vec4s),
    /// the stats (2) and at least one run of a ring's tokens (`TT_MAX` vec4s) in workgroup
    /// memory.
    pub(crate) fn max_attention_dim(&self) -> usize {
        (self.limits().max_compute_workgroup_storage_size as usize / 16).saturating_sub(2 + TT_MAX)
    }

    /// The tiling of a source for `q_per_row` queries of dimension `dim` that fits the
    /// workgroup memory (queries: D vec4s; probabilities: CHUNK vec4s).
    fn tiling(&self, source: &AttnSource, q_per_row: usize, dim: usize) -> Result<Tiling> {
        let (tt, generic) = source.tokens_per_thread();
        let bytes = self.limits().max_compute_workgroup_storage_size as usize;
        let Some(chunk) = chunk_tokens(dim, tt, bytes) else {
            return Err(XqError::TooLarge(format!(
                "attention over head_dim {dim} does not fit the device's workgroup memory"
            )));
        };
        Ok(Tiling {
            tt,
            generic,
            qt: q_per_row.clamp(1, QT_MAX),
            chunk,
        })
    }
}

/// Checks the queries and the output of a call; returns `(q_heads, T)`.
pub(crate) fn check_attend_shapes(
    queries: &GpuTensor,
    out: &GpuTensor,
    batch: usize,
    kv_heads: usize,
    dim: usize,
    layout: OutLayout,
) -> Result<(usize, usize)> {
    let q = queries.shape().dims();
    if q.len() != 4 || q[0] != batch || q[3] != dim || q[1] == 0 || q[1] % kv_heads != 0 {
        return shape_err!(
            "queries {q:?} are not [batch {batch}, query_heads (a multiple of kv_heads \
             {kv_heads}), tokens, head_dim {dim}]"
        );
    }
    let (heads, t) = (q[1], q[2]);
    let want = match layout {
        OutLayout::HeadsMajor => [batch, heads, t, dim],
        OutLayout::TokensMajor => [batch, t, heads, dim],
    };
    if out.shape().dims() != want {
        return shape_err!(
            "attention output {:?} is not {want:?} ({layout:?})",
            out.shape().dims()
        );
    }
    if out.dtype() == DType::F16 && dim % 2 == 1 {
        return shape_err!("an f16 attention output needs an even head_dim, got {dim}");
    }
    if std::ptr::eq(queries.buffer(), out.buffer()) {
        return shape_err!("the queries and the attention output must be different buffers");
    }
    Ok((heads, t))
}

fn side_dims(s: &BlockSide) -> Result<Side> {
    let l = s.params.layout;
    let word = |b: u64| (b / 4) as u32;
    let mut d = Side {
        groups: l.n_groups() as u32,
        other: l.other() as u32,
        wpg: l.words_per_group() as u32,
        rwpg: 1,
        params: word(s.params.offset),
        res_params: 0,
        res_codes: 0,
        codes: word(s.codes.offset),
    };
    if let Some(r) = s.residual {
        if !std::ptr::eq(&**r.params.buffer, &**s.params.buffer)
            || !std::ptr::eq(&**r.codes.buffer, &**s.params.buffer)
        {
            return Err(XqError::Gpu(
                "a residual must live in its page's buffer".into(),
            ));
        }
        d.rwpg = r.params.layout.words_per_group() as u32;
        d.res_params = word(r.params.offset);
        d.res_codes = word(r.codes.offset);
    }
    Ok(d)
}

impl GpuContext {
    /// Partial slots a call over `sources` needs per (row, query).
    fn attention_slots(&self, call: &AttnCall, sources: &[AttnSource]) -> Result<usize> {
        let mut slots = 0;
        for s in sources {
            let t = self.tiling(s, call.q_per_row(), call.dim)?;
            slots += s.n().div_ceil(t.chunk);
        }
        Ok(slots)
    }

    /// Bytes of the partials buffer of a call over `sources` (0 when the call has one chunk
    /// in all: it writes its output directly).
    pub(crate) fn attention_partials_bytes(
        &self,
        call: &AttnCall,
        sources: &[AttnSource],
    ) -> Result<u64> {
        let slots = self.attention_slots(call, sources)?;
        if slots == 1 {
            return Ok(0);
        }
        Ok((call.rows() * call.q_per_row() * slots * (call.dim + 2) * 4) as u64)
    }

    /// Records the attention of `call`'s queries over `sources` into `call.out`, through
    /// `partials` (at least [`GpuContext::attention_partials_bytes`]; unused, and may be
    /// `None`, when that is 0).
    pub(crate) fn encode_attention(
        &self,
        enc: &mut wgpu::CommandEncoder,
        call: &AttnCall,
        sources: &[AttnSource],
        partials: Option<&wgpu::Buffer>,
    ) -> Result<()> {
        let slots = self.attention_slots(call, sources)?;
        if slots == 0 {
            return shape_err!("attention over no cached tokens");
        }
        let direct = slots == 1;
        let placeholder = self.placeholder();
        let partials = match partials {
            Some(p) => p,
            None if direct => &placeholder,
            None => return Err(XqError::Gpu("attention partials missing".into())),
        };
        let need = self.attention_partials_bytes(call, sources)?;
        if partials.size() < need {
            return Err(XqError::Gpu(format!(
                "attention partials: {} bytes, {need} needed",
                partials.size()
            )));
        }
        let (heads, t, d) = (call.q_heads, call.q_tokens, call.dim);
        let (out_batch, out_head, out_token) = match call.layout {
            OutLayout::HeadsMajor => (heads * t * d, t * d, d),
            OutLayout::TokensMajor => (t * heads * d, d, heads * d),
        };
        let base = AttnDims {
            rows: call.rows() as u32,
            kv_heads: call.kv_heads as u32,
            q_heads: heads as u32,
            q_tokens: t as u32,
            q_per_row: call.q_per_row() as u32,
            pos0: call.pos0 as u32,
            scale: call.scale,
            slots: slots as u32,
            out_batch: out_batch as u32,
            out_head: out_head as u32,
            out_token: out_token as u32,
            ..Default::default()
        };
        let q_f16 = call.queries.dtype() == DType::F16;
        let mut slot0 = 0;
        let mut i = 0;
        while i < sources.len() {
            let source = &sources[i];
            i += 1;
            let tiling = self.tiling(source, call.q_per_row(), d)?;
            let own_chunks = source.n().div_ceil(tiling.chunk);
            if own_chunks == 0 {
                continue;
            }
            // A ring right after a block joins the block's dispatch when both tile alike.
            let joined = match (source, sources.get(i)) {
                (AttnSource::Block { .. }, Some(next @ AttnSource::Ring { n, .. })) if *n > 0 => {
                    let alike = self.tiling(next, call.q_per_row(), d)?.chunk == tiling.chunk;
                    alike.then_some(next)
                }
                _ => None,
            };
            let ring_chunks = joined.map_or(0, |r| r.n().div_ceil(tiling.chunk));
            i += usize::from(joined.is_some());
            let chunks = own_chunks + ring_chunks;
            let mut dims = AttnDims {
                n: source.n() as u32,
                chunks: chunks as u32,
                slot0: slot0 as u32,
                ..base
            };
            let mut a = AttentionConstants {
                dim: d as u32,
                group: tiling.tt as u32,
                chunk: tiling.chunk as u32,
                tt: tiling.tt as u32,
                qt: tiling.qt as u32,
                generic: tiling.generic,
                q_f16,
                out_f16: direct && call.out.dtype() == DType::F16,
                direct,
                with_ring: joined.is_some(),
                ..Default::default()
            };
            let (entry, binds) = match source {
                AttnSource::Block {
                    key,
                    value,
                    t0,
                    abs0,
                    ..
                } => {
                    let (kl, vl) = (key.params.layout, value.params.layout);
                    a.group = kl.group_size as u32;
                    a.k_bits = kl.bits;
                    a.v_bits = vl.bits;
                    a.k_channels = kl.axis == ValueAxis::Channels;
                    a.v_channels = vl.axis == ValueAxis::Channels;
                    a.params_f32 = key.params.precision == ParamsPrecision::F32;
                    if let Some(r) = key.residual {
                        a.k_residual = true;
                        a.k_res_bits = r.params.layout.bits;
                    }
                    if let Some(r) = value.residual {
                        a.v_residual = true;
                        a.v_res_bits = r.params.layout.bits;
                    }
                    if vl.group_size != kl.group_size
                        || value.params.precision != key.params.precision
                    {
                        return Err(XqError::Gpu(
                            "keys and values of a block differ in group size or params".into(),
                        ));
                    }
                    dims.t0 = *t0 as u32;
                    dims.abs0 = *abs0 as u32;
                    dims.k = side_dims(key)?;
                    dims.v = side_dims(value)?;
                    let (k_ring, v_ring) = match joined {
                        Some(AttnSource::Ring {
                            key,
                            value,
                            ring_tokens,
                            t0,
                            n,
                            abs0,
                        }) => {
                            dims.ring_n = *n as u32;
                            dims.ring_t0 = *t0 as u32;
                            dims.ring_abs0 = *abs0 as u32;
                            dims.ring_tokens = *ring_tokens as u32;
                            (Bind::from(*key), Bind::from(*value))
                        }
                        _ => (Bind::from(&placeholder), Bind::from(&placeholder)),
                    };
                    let binds = vec![
                        (2, Bind::from(&*key.params.buffer)),
                        (3, Bind::from(&*key.codes.buffer)),
                        (4, Bind::from(&*value.params.buffer)),
                        (5, Bind::from(&*value.codes.buffer)),
                        (8, k_ring),
                        (9, v_ring),
                    ];
                    ("attend_block", binds)
                }
                AttnSource::Ring {
                    key,
                    value,
                    ring_tokens,
                    t0,
                    abs0,
                    ..
                } => {
                    dims.t0 = *t0 as u32;
                    dims.abs0 = *abs0 as u32;
                    dims.ring_tokens = *ring_tokens as u32;
                    (
                        "attend_ring",
                        vec![(8, (*key).into()), (9, (*value).into())],
                    )
                }
            };
            slot0 += chunks;
            let tiles = call.q_per_row().div_ceil(tiling.qt);
            dims.tiles = tiles as u32;
            let key = KernelKey::new(entry, Constants::Attention(a));
            let wg = ATTENTION_WG as usize;
            let grid = self.grid(call.rows() * chunks * tiles * wg, ATTENTION_WG)?;
            dims.grid_x = grid.x;
            // DIRECT: the one chunk writes the output itself, at the partials' binding.
            let written = if direct {
                call.out.bind()
            } else {
                Bind::from(partials)
            };
            let mut all = vec![(1, call.queries.bind()), (6, written)];
            all.extend(binds);
            self.dispatch(enc, &key, &dims, &all, grid);
        }
        if direct {
            return Ok(());
        }
        let key = KernelKey::new(
            "combine",
            Constants::Attention(AttentionConstants {
                dim: d as u32,
                out_f16: call.out.dtype() == DType::F16,
                ..Default::default()
            }),
        );
        let grid = self.grid(
            call.rows() * call.q_per_row() * ATTENTION_WG as usize,
            ATTENTION_WG,
        )?;
        let dims = AttnDims {
            grid_x: grid.x,
            ..base
        };
        self.dispatch(
            enc,
            &key,
            &dims,
            &[(6, Bind::from(partials)), (7, call.out.bind())],
            grid,
        );
        Ok(())
    }
}

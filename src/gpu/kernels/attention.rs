//! Split-K attention over a cache's K/V (`wgsl/attention.wgsl`): one dispatch per block of
//! quantized tokens of a page, the f16 ring (the sinks, then the window, in one buffer)
//! joining the last, or one dispatch over the ring alone; each writes a partial per (row,
//! query, chunk), then one `combine` dispatch merges them into the output. A call of one
//! chunk in all (a short context: block, sinks and window within one chunk) writes its output
//! directly: one dispatch.

use crate::config::{DType, Levels, ParamsPrecision, ValueAxis};
use crate::error::{shape_err, Result, XqError};
use crate::gpu::dispatch::Bind;
use crate::gpu::kernels::group_quant::level_slots;
use crate::gpu::kernels::views::RingSinks;
use crate::gpu::mirror::wgsl_struct;
use crate::gpu::pipelines::{AttentionConstants, Constants, Family, KernelKey};
use crate::gpu::{GpuContext, GpuParams, GpuTensor, PackedCodes, QuantizedTensor};

/// Most queries one workgroup handles (one vec4 of them).
const QT_MAX: usize = 4;
/// Most tokens per workgroup on a GPU (what the H200 was measured with).
const GPU_CHUNK_MAX: usize = 512;
/// Most tokens per key-phase thread, and a ring's (`TT_MAX` in the shader).
pub(crate) const TT_MAX: usize = 16;
/// Most channels per code window of a side grouped along D (four `mat4x4` accumulators).
const CV_MAX: usize = 16;
/// Fewest value-phase threads a head's channels are split over when values are grouped
/// along D and a launch is one chunk (`D / CV`, while a window holds at least 4 channels): a
/// head of 64 channels runs 8 threads of 8 channels rather than 4 of 16, where a CPU
/// rasterizer's 8 SIMD lanes would otherwise idle (the default's decode step at 256 tokens:
/// 1.08–1.12× → 1.02–1.04× the f16 cache's on llvmpipe). Longer launches split a block's
/// tokens instead ([`value_phases`]).
const VALUE_THREADS: usize = 8;

/// Vec4s of workgroup memory the softmax of a workgroup of `wg` threads holds (`stat`: each
/// thread's maxima and sums over the queries).
fn softmax_vec4s(wg: usize) -> usize {
    2 * wg
}

/// Most tokens per workgroup of `wg` threads for queries of dimension `dim` and `tt` tokens
/// per key-phase thread within `workgroup_bytes` of workgroup memory (queries: D vec4s,
/// probabilities: CHUNK vec4s, the softmax's [`softmax_vec4s`]); `None` when not even one
/// run fits.
pub(crate) fn chunk_tokens(
    dim: usize,
    tt: usize,
    wg: usize,
    workgroup_bytes: usize,
) -> Option<usize> {
    let room = (workgroup_bytes / 16).saturating_sub(dim + softmax_vec4s(wg));
    let chunk = room / tt * tt;
    (chunk > 0).then_some(chunk)
}

/// Workgroups a GPU launch is cut into at least, when its tokens allow: a GPU runs a
/// workgroup (here one wave) per multiprocessor and waits on each one's serial walk over its
/// chunk, so a launch of 3 rows x 2 chunks leaves it nearly idle. Measured on an H200
/// (SmolLM2's 3 KV heads, 2026-12-04): 128-token chunks made a decode step at 1K-4K tokens
/// 19-38% faster for both caches than 512-token ones; at 16K, 512 was best (96 workgroups).
const GPU_WORKGROUPS: usize = 96;
/// Fewest tokens per workgroup when a GPU launch is cut (32 was no faster than 128 at 1K
/// tokens and slower at 16K: each chunk adds a partial to combine).
const GPU_MIN_CHUNK: usize = 128;

/// Tokens per chunk of a launch over `tokens` (padded to runs of `tt`) with `groups`
/// workgroups per chunk (rows x query tiles), at most `most` (what fits the workgroup
/// memory, a multiple of `tt`). A CPU adapter runs a workgroup per core: the fewest chunks,
/// of about even length in whole pairs of runs (1040 tokens in chunks of at most 944: 544
/// and 496, not 944 and 96, whose short one leaves a core idle; in one profile the f16
/// cache's 1K decode step on llvmpipe took 10.3 ms of GPU time in 512-token chunks, 11.9 in
/// 944 and 80). Pairs of runs let a chunk's quantized keys be scored two runs a walk from its
/// first token (the default's step at 16K tokens 0.53-0.56 -> 0.48-0.49x the f16 cache's).
/// On a GPU (`gpu`) chunks hold at most [`GPU_CHUNK_MAX`] tokens, and a launch longer than
/// one chunk is cut into about [`GPU_WORKGROUPS`] workgroups; a launch that fits one chunk
/// stays one (it writes its output directly, no combine pass).
pub(crate) fn launch_chunk(
    tokens: usize,
    groups: usize,
    most: usize,
    tt: usize,
    gpu: bool,
) -> usize {
    if !gpu {
        // Chunks start at even runs, so a chunk's quantized tokens pair up from its first
        // (`block_pair_scores`).
        let chunks = tokens.div_ceil(most).max(1);
        return tokens
            .div_ceil(chunks)
            .next_multiple_of(2 * tt)
            .min(most)
            .max(tt);
    }
    let most = most.min(GPU_CHUNK_MAX) / tt * tt;
    if tokens <= most {
        return most;
    }
    let wanted = (tokens * groups)
        .div_ceil(GPU_WORKGROUPS)
        .next_power_of_two();
    (wanted.max(GPU_MIN_CHUNK).min(most) / tt * tt).max(tt)
}

/// Tokens per key-phase run with [`AttentionFill::Workgroup`](crate::gpu::AttentionFill):
/// from the longest run `tt` the codes allow, halved (down to 4) while a chunk holding `span`
/// tokens would leave some of a workgroup's `wg` threads without a run. Halving keeps the run
/// a divisor of a quantization group and of the chunk, which are multiples of `tt`.
pub(crate) fn runs_to_fill(tt: usize, span: usize, wg: usize) -> usize {
    let mut tt = tt;
    while tt > 4 && span.div_ceil(tt) < wg {
        tt /= 2;
    }
    tt
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
    /// A sliding-window layer's window: query position `p` sees cached positions `p'` with
    /// `p − p' < window` only (Gemma 3's local layers: 512). Default: every position.
    pub window: Option<usize>,
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
        sink_n: u32,
        sink_tokens: u32,
        sink_word: u32,
        rot_seed: u32,
        q_stream: u32,
        o_stream: u32,
        window: u32,
        span: u32,
        _pad2: u32,
        _pad3: u32,
        k_levels: [[f32; 4]; 4],
        v_levels: [[f32; 4]; 4],
    }
}

/// The Hadamard rotations an attention call folds in (a rotated cache's, `cache/rotate.rs`):
/// the queries rotated with its keys' signs as they are loaded, the output rotated back with
/// its values' signs as it is written. Streams as `reference::rotation_stream(layer, kind, 0)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct AttnRotation {
    pub seed: u32,
    /// The keys' sign streams (their high bits), when they are rotated.
    pub keys: Option<u32>,
    /// The values' sign streams, when they are rotated.
    pub values: Option<u32>,
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
    /// Rotations folded into the call (none for an unrotated cache).
    pub rotation: AttnRotation,
    /// Sliding window (`AttendOptions::window`); 0: none.
    pub window: usize,
}

impl AttnCall<'_> {
    fn rows(&self) -> usize {
        self.batch * self.kv_heads
    }

    fn q_per_row(&self) -> usize {
        self.q_heads / self.kv_heads * self.q_tokens
    }
}

/// Bytes a ring buffer's size is a multiple of: attention reads rings 16 bytes at a time
/// (a token's 8 channels in one load where the head dim is a multiple of 8).
pub(crate) const RING_ALIGN: u64 = 16;

/// One side (keys or values) of a quantized block: the codes it decodes (own, or the
/// anchor's) and its page's params and residual, sections of one page buffer.
#[derive(Clone, Copy)]
pub(crate) struct BlockSide<'a> {
    pub codes: &'a PackedCodes,
    pub params: &'a GpuParams,
    pub residual: Option<&'a QuantizedTensor>,
}

/// What one attention dispatch reads.
#[derive(Clone, Copy)]
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
    /// `[R, ring_tokens, D_even / 2]`, at absolute positions `abs0..` (the last source),
    /// after the sinks the ring buffers hold.
    Ring {
        key: &'a wgpu::Buffer,
        value: &'a wgpu::Buffer,
        ring_tokens: usize,
        t0: usize,
        n: usize,
        abs0: usize,
        sinks: RingSinks,
    },
}

impl AttnSource<'_> {
    fn n(&self) -> usize {
        match self {
            AttnSource::Block { n, .. } => *n,
            AttnSource::Ring { n, sinks, .. } => sinks.n + n,
        }
    }

    /// A block whose key and value codes are its page's own (not an anchor's): read from
    /// its page buffer, not bound again.
    fn own_codes(&self) -> bool {
        let own = |s: &BlockSide| std::ptr::eq(&**s.codes.buffer, &**s.params.buffer);
        matches!(self, AttnSource::Block { key, value, .. } if own(key) && own(value))
    }

    /// Tokens per key-phase thread: a multiple of 4 (a power of two) dividing the group
    /// size, whose codes fit one 32-bit window on the sides grouped along tokens — keys
    /// without a residual two words (16 tokens of 3- or 4-bit keys, `run_window` in the
    /// shader; a run's residual codes are read the same way where they fit two words); and
    /// whether the group size forces the generic per-token path (not a multiple of 4).
    fn tokens_per_thread(&self) -> (usize, bool) {
        match self {
            AttnSource::Ring { .. } => (TT_MAX, false),
            AttnSource::Block { key, value, .. } => {
                // Residual codes wider than the run's are read a window per 4 tokens.
                let along_tokens = |s: &BlockSide| match s.params.layout.axis {
                    ValueAxis::Tokens => s.params.layout.bits as usize,
                    ValueAxis::Channels => 0,
                };
                let key_bits = match (along_tokens(key), key.residual) {
                    (b @ 3..=4, None) => b.div_ceil(2),
                    (b, _) => b,
                };
                let widest = key_bits.max(along_tokens(value));
                let g = key.params.layout.group_size;
                (per_window(TT_MAX, widest, g), g % 4 != 0)
            }
        }
    }

    /// Whether the value phase reads values grouped along D (`token_values`, whose blocks'
    /// tokens `VP` threads may share).
    fn splits_value_tokens(&self) -> bool {
        matches!(self, AttnSource::Block { value, .. }
            if value.params.layout.axis == ValueAxis::Channels)
    }

    /// Channels per code window of the keys (`CK`) and per value-phase thread of the values
    /// (`CV`) where grouped along D: 16, 8 or 4, dividing the group size, their codes (own
    /// and residual) in one 32-bit window; the values' at most `value_most`.
    fn channels_per_window(&self, value_most: usize) -> (usize, usize) {
        let AttnSource::Block { key, value, .. } = self else {
            return (4, 4);
        };
        let along_channels = |s: &BlockSide| match s.params.layout.axis {
            ValueAxis::Channels => (s.params.layout.bits as usize)
                .max(s.residual.map_or(0, |r| r.params.layout.bits as usize)),
            ValueAxis::Tokens => 0,
        };
        let g = key.params.layout.group_size;
        (
            per_window(CV_MAX, along_channels(key), g),
            per_window(value_most, along_channels(value), g),
        )
    }
}

/// The part of `sources` a sliding-window call can see: sources wholly before the first
/// query's window are left out and a ring starts at it (a block partly inside stays whole;
/// the kernel masks what each query cannot see). Without a window, `sources` as they are.
fn in_window<'a>(call: &AttnCall, sources: &[AttnSource<'a>]) -> Vec<AttnSource<'a>> {
    let first = match call.window {
        0 => 0,
        w => (call.pos0 + 1).saturating_sub(w),
    };
    let kept: Vec<AttnSource<'a>> = sources
        .iter()
        .filter_map(|&s| match s {
            AttnSource::Block { abs0, n, .. } if abs0 + n <= first => None,
            AttnSource::Ring {
                key,
                value,
                ring_tokens,
                t0,
                n,
                abs0,
                sinks,
            } if abs0 < first || (sinks.n > 0 && sinks.n <= first) => {
                let cut = first.saturating_sub(abs0).min(n);
                let sinks = match sinks.n <= first {
                    true => RingSinks::default(),
                    false => sinks,
                };
                (cut < n || sinks.n > 0).then_some(AttnSource::Ring {
                    key,
                    value,
                    ring_tokens,
                    t0: t0 + cut,
                    n: n - cut,
                    abs0: abs0 + cut,
                    sinks,
                })
            }
            s => Some(s),
        })
        .collect();
    // Queries placed before every source (explicit pos0) still get a dispatch: masked.
    match kept.is_empty() {
        true => sources.to_vec(),
        false => kept,
    }
}

/// The most members (a power of two from `most` down to 4) whose `bits`-wide codes share one
/// 32-bit window and that divide the group size `group`.
fn per_window(most: usize, bits: usize, group: usize) -> usize {
    let mut n = most;
    while n > 4 && (n * bits > 32 || group % n != 0) {
        n /= 2;
    }
    n
}

/// Workgroup geometry of one dispatch: tokens per key-phase thread, channels per key window
/// and per value thread, value-phase threads per channel block, queries, chunk tokens.
#[derive(Clone, Copy, Debug)]
struct Tiling {
    tt: usize,
    ck: usize,
    cv: usize,
    vp: usize,
    rp: usize,
    /// Values grouped along tokens split their blocks over `rp` threads
    /// ([`AttentionFill::Workgroup`](crate::gpu::AttentionFill) only).
    split_block: bool,
    rc: usize,
    generic: bool,
    qt: usize,
    chunk: usize,
}

/// The value phase of a launch of several chunks, values grouped along D: of the block widths
/// `widths` (channels, widest first) its code windows allow, the one that keeps the most of a
/// workgroup's `wg` threads busy (blocks × [`value_phases`]), the widest of those (fewest
/// loads per code); `(CV, VP)`. A narrow workgroup (8) fills with blocks of 16 channels, as
/// a wide one (32) does in 512-token chunks; in 128-token chunks the slots of blocks of 16
/// leave room for 2 phases only (8 threads), blocks of 4 fill it (not measured on a GPU).
pub(crate) fn split_tiling(
    wg: usize,
    dim: usize,
    chunk: usize,
    widths: &[usize],
) -> (usize, usize) {
    let mut best = (0, widths[0], 1);
    for &cv in widths {
        let blocks = dim.div_ceil(cv);
        let vp = value_phases(wg, blocks, cv + 1, chunk);
        let busy = (blocks * vp).min(wg);
        if busy > best.0 {
            best = (busy, cv, vp);
        }
    }
    (best.1, best.2)
}

/// Threads a block of channels' tokens are split over in a value phase (`VP` for values
/// grouped along D, `RP` for a ring): enough for the `blocks` to fill a workgroup of `wg` (a
/// head of 64 channels in blocks of 16 takes two threads a block in a narrow workgroup, eight
/// in a wide one), as long as the phases past the first can leave their sums (`slot` vec4s
/// each) in the chunk's probabilities (`chunk` vec4s) for the first to add up.
pub(crate) fn value_phases(wg: usize, blocks: usize, slot: usize, chunk: usize) -> usize {
    let mut vp = (wg / blocks.max(1)).max(1);
    while vp > 1 && (vp - 1) * blocks * slot > chunk {
        vp -= 1;
    }
    vp
}

/// Channels per value-phase thread of a ring alone (`RC`): 8 where blocks of 8 still give
/// every one of a workgroup's `wg` threads a block (a head of 64 in a narrow workgroup: the
/// tokens' addresses and probabilities serve 8 channels, not 4; its 512-token prefill's
/// attention 325 -> 266 ms a layer on llvmpipe), else 4 (those blocks split over `RP`
/// threads in launches of several chunks).
pub(crate) fn ring_channels(wg: usize, dim: usize) -> usize {
    if dim % 8 == 0 && dim / 8 >= wg {
        8
    } else {
        4
    }
}

/// Threads a block of 16 channels of a ring alone is split over (`RP`, with `RC` 16) in a
/// launch of several chunks, where such blocks keep all of a workgroup's `wg` threads busy
/// (a head of 64 in a narrow workgroup: 4 blocks over 2 threads each) within the chunk's
/// probabilities (`chunk` vec4s; slots of 16): each thread's loads of 4 tokens' probabilities
/// then serve 16 channels, not 8 (a CPU rasterizer loads workgroup memory lane by lane: the
/// f16 cache's attention at 16K tokens on llvmpipe ~7% faster, 1K ~30% with the per-channel
/// sums). `None`: blocks as [`ring_channels`] has them.
pub(crate) fn ring_split(wg: usize, dim: usize, chunk: usize) -> Option<usize> {
    if dim % 16 != 0 || dim / 16 > wg {
        return None;
    }
    let blocks = dim / 16;
    let rp = value_phases(wg, blocks, 16, chunk);
    (blocks * rp == wg).then_some(rp)
}

impl GpuContext {
    /// The widest head the attention kernels can tile on this device: the queries (D vec4s),
    /// the softmax's [`softmax_vec4s`] and at least one run of a ring's tokens (`TT_MAX`
    /// vec4s) in workgroup memory.
    pub(crate) fn max_attention_dim(&self) -> usize {
        let wg = self.attention_workgroup_size() as usize;
        (self.limits().max_compute_workgroup_storage_size as usize / 16)
            .saturating_sub(softmax_vec4s(wg) + TT_MAX)
    }

    /// The tiling of a source for `q_per_row` queries of dimension `dim` that fits the
    /// workgroup memory (queries: D vec4s; probabilities: CHUNK vec4s).
    fn tiling(&self, source: &AttnSource, q_per_row: usize, dim: usize) -> Result<Tiling> {
        let (tt, generic) = source.tokens_per_thread();
        let bytes = self.limits().max_compute_workgroup_storage_size as usize;
        let wg = self.attention_workgroup_size() as usize;
        let Some(chunk) = chunk_tokens(dim, tt, wg, bytes) else {
            return Err(XqError::TooLarge(format!(
                "attention over head_dim {dim} does not fit the device's workgroup memory"
            )));
        };
        let most = (dim / VALUE_THREADS).clamp(4, CV_MAX);
        let (ck, cv) = source.channels_per_window(1 << most.ilog2());
        Ok(Tiling {
            tt,
            ck,
            cv,
            vp: 1,
            rp: 1,
            split_block: false,
            rc: ring_channels(wg, dim),
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

/// Bytes of the partials of a call with `slots` partial slots per (row, query): none for one
/// slot (the chunk writes the output directly).
fn partials_bytes(call: &AttnCall, slots: usize) -> u64 {
    if slots == 1 {
        return 0;
    }
    (call.rows() * call.q_per_row() * slots * (call.dim + 2) * 4) as u64
}

/// One attention dispatch: the segments it reads (at least one) and its geometry.
struct Launch<'s, 'a> {
    block: Option<&'s AttnSource<'a>>,
    ring: Option<&'s AttnSource<'a>>,
    tiling: Tiling,
    /// Tokens per chunk (`dims.span`), at most `tiling.chunk`.
    span: usize,
    chunks: usize,
}

/// The dispatches of a call over `sources` (blocks, then the ring, in position order): each
/// block is one, the ring joining the last; a ring without a block is a dispatch of its own.
fn group_sources<'s, 'a>(sources: &'s [AttnSource<'a>]) -> Vec<[Option<&'s AttnSource<'a>>; 2]> {
    let mut blocks = Vec::new();
    let mut ring = None;
    for s in sources.iter().filter(|s| s.n() > 0) {
        match s {
            AttnSource::Block { .. } => blocks.push(s),
            AttnSource::Ring { .. } => ring = Some(s),
        }
    }
    let mut out: Vec<[Option<&AttnSource>; 2]> = Vec::new();
    let last = blocks.len().saturating_sub(1);
    for (i, b) in blocks.iter().enumerate() {
        out.push([Some(b), ring.filter(|_| i == last)]);
    }
    if blocks.is_empty() && ring.is_some() {
        out.push([None, ring]);
    }
    out
}

impl GpuContext {
    /// The dispatches of a call over `sources`, with their tilings and chunks.
    fn launches<'s, 'a>(
        &self,
        call: &AttnCall,
        sources: &'s [AttnSource<'a>],
    ) -> Result<Vec<Launch<'s, 'a>>> {
        if sources
            .windows(2)
            .any(|w| matches!(w[0], AttnSource::Ring { .. }))
        {
            return Err(XqError::Gpu(
                "attention sources out of order: the ring last".into(),
            ));
        }
        group_sources(sources)
            .into_iter()
            .map(|[block, ring]| {
                let lead = block.or(ring).expect("a launch reads a segment");
                let mut tiling = self.tiling(lead, call.q_per_row(), call.dim)?;
                let padded =
                    |s: Option<&AttnSource>, tt: usize| s.map_or(0, |s| s.n().next_multiple_of(tt));
                let total = padded(block, tiling.tt) + padded(ring, tiling.tt);
                let groups = call.rows() * call.q_per_row().div_ceil(tiling.qt);
                let gpu = self.many_attention_chunks();
                let span = launch_chunk(total, groups, tiling.chunk, tiling.tt, gpu);
                if gpu {
                    // Workgroup memory for the chunk alone: more workgroups resident at once.
                    tiling.chunk = span;
                }
                let fill = self.fills_attention_workgroup();
                let wg = self.attention_workgroup_size() as usize;
                if fill && !tiling.generic {
                    tiling.tt = runs_to_fill(tiling.tt, span.min(total), wg);
                }
                // Segments pad to whole runs: with shorter runs, fewer tokens to cover.
                let total = padded(block, tiling.tt) + padded(ring, tiling.tt);
                let chunks = total.div_ceil(span);
                // A launch of one chunk keeps its fixed costs low: no split (measured on
                // llvmpipe at 256 tokens, the default's step 1.05 -> 1.13x the f16 cache's
                // with one; at 16K its attention 102 -> 93 ms), unless asked to fill the
                // workgroup. The ring's blocks of 4 channels split alike, the f16 cache's and
                // an XQuant cache's (blocks of 8 fill the workgroup unsplit).
                if chunks > 1 || fill {
                    if tiling.rc == 4 {
                        tiling.rp = value_phases(wg, call.dim.div_ceil(4), 4, tiling.chunk);
                    }
                    // A ring alone whose blocks of 8 fill the workgroup: blocks of 16, split.
                    let eights = tiling.rc == 8 && block.is_none();
                    if let Some(rp) = ring_split(wg, call.dim, tiling.chunk).filter(|_| eights) {
                        (tiling.rc, tiling.rp) = (16, rp);
                    }
                    if lead.splits_value_tokens() && !tiling.generic {
                        let widths = [CV_MAX, 8, 4].map(|most| lead.channels_per_window(most).1);
                        (tiling.cv, tiling.vp) = split_tiling(wg, call.dim, tiling.chunk, &widths);
                    }
                    // Values grouped along tokens split their blocks of 4 channels as the
                    // ring does, only when asked to fill the workgroup.
                    if fill && block.is_some() && !lead.splits_value_tokens() {
                        tiling.split_block = true;
                    }
                }
                Ok(Launch {
                    block,
                    ring,
                    tiling,
                    span,
                    chunks,
                })
            })
            .collect()
    }

    /// Bytes of the partials buffer of a call over `sources` (0 when the call has one chunk
    /// in all: it writes its output directly).
    pub(crate) fn attention_partials_bytes(
        &self,
        call: &AttnCall,
        sources: &[AttnSource],
    ) -> Result<u64> {
        let sources = in_window(call, sources);
        let slots = self
            .launches(call, &sources)?
            .iter()
            .map(|l| l.chunks)
            .sum();
        Ok(partials_bytes(call, slots))
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
        let sources = in_window(call, sources);
        let launches = self.launches(call, &sources)?;
        let slots: usize = launches.iter().map(|l| l.chunks).sum();
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
        let need = partials_bytes(call, slots);
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
            window: call.window as u32,
            slots: slots as u32,
            out_batch: out_batch as u32,
            out_head: out_head as u32,
            out_token: out_token as u32,
            rot_seed: call.rotation.seed,
            q_stream: call.rotation.keys.unwrap_or(0),
            o_stream: call.rotation.values.unwrap_or(0),
            ..Default::default()
        };
        let q_f16 = call.queries.dtype() == DType::F16;
        let (rotate_q, rotate_out) = (call.rotation.keys.is_some(), call.rotation.values.is_some());
        if (rotate_q || rotate_out) && !call.dim.is_power_of_two() {
            return shape_err!("a rotated attention needs a power-of-two head dim, got {d}");
        }
        let wg = self.attention_workgroup_size();
        let mut slot0 = 0;
        for launch in &launches {
            let tiling = launch.tiling;
            let mut dims = AttnDims {
                chunks: launch.chunks as u32,
                span: launch.span as u32,
                slot0: slot0 as u32,
                ..base
            };
            let mut a = AttentionConstants {
                wg,
                dim: d as u32,
                group: tiling.tt as u32,
                chunk: tiling.chunk as u32,
                tt: tiling.tt as u32,
                cv: tiling.cv as u32,
                vp: tiling.vp as u32,
                rp: tiling.rp as u32,
                split_block: tiling.split_block,
                rc: tiling.rc as u32,
                ck: tiling.ck as u32,
                qt: tiling.qt as u32,
                generic: tiling.generic,
                q_f16,
                out_f16: direct && call.out.dtype() == DType::F16,
                direct,
                with_ring: launch.ring.is_some(),
                rotate_q,
                rotate_out: direct && rotate_out,
                ..Default::default()
            };
            let (mut k_ring, mut v_ring) = (Bind::from(&placeholder), Bind::from(&placeholder));
            if let Some(AttnSource::Ring {
                key,
                value,
                ring_tokens,
                t0,
                n,
                abs0,
                sinks,
            }) = launch.ring
            {
                dims.sink_n = sinks.n as u32;
                dims.sink_tokens = sinks.slots as u32;
                dims.sink_word = sinks.word as u32;
                dims.ring_n = *n as u32;
                // As a slot: the kernel wraps the window's slots with one subtraction.
                dims.ring_t0 = (*t0 % (*ring_tokens).max(1)) as u32;
                dims.ring_abs0 = *abs0 as u32;
                dims.ring_tokens = *ring_tokens as u32;
                if key.size() % RING_ALIGN != 0 || value.size() % RING_ALIGN != 0 {
                    return Err(XqError::Gpu(format!(
                        "a ring buffer's size must be a multiple of {RING_ALIGN} bytes"
                    )));
                }
                (k_ring, v_ring) = (Bind::from(*key), Bind::from(*value));
            }
            let unused = Bind::from(&placeholder);
            let mut binds = vec![(3, unused), (5, unused), (8, k_ring), (9, v_ring)];
            let entry = match launch.block {
                Some(
                    block @ AttnSource::Block {
                        key,
                        value,
                        t0,
                        n,
                        abs0,
                    },
                ) => {
                    let (kl, vl) = (key.params.layout, value.params.layout);
                    a.group = kl.group_size as u32;
                    a.k_bits = kl.bits;
                    a.v_bits = vl.bits;
                    a.k_channels = kl.axis == ValueAxis::Channels;
                    a.v_channels = vl.axis == ValueAxis::Channels;
                    a.params_f32 = key.params.precision == ParamsPrecision::F32;
                    a.k_levels = kl.levels == Levels::LloydMax;
                    a.v_levels = vl.levels == Levels::LloydMax;
                    dims.k_levels = level_slots(&kl);
                    dims.v_levels = level_slots(&vl);
                    a.own_codes = block.own_codes();
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
                    dims.n = *n as u32;
                    dims.t0 = *t0 as u32;
                    dims.abs0 = *abs0 as u32;
                    dims.k = side_dims(key)?;
                    dims.v = side_dims(value)?;
                    // Sections start at multiples of 4 words; a side grouped along D holds
                    // its tokens' words consecutively, `other` apart, from its first token.
                    a.token_quads = *t0 % 4 == 0
                        && (!a.k_channels || dims.k.other % 4 == 0)
                        && (!a.v_channels || dims.v.other % 4 == 0);
                    binds.push((2, Bind::from(&*key.params.buffer)));
                    binds.push((4, Bind::from(&*value.params.buffer)));
                    if !a.own_codes {
                        binds[0] = (3, Bind::from(&*key.codes.buffer));
                        binds[1] = (5, Bind::from(&*value.codes.buffer));
                    }
                    // An entry point per key and value phase (per-token keys without a
                    // residual in runs of 16: a run's quads at once).
                    let token_keys = a.k_channels && !a.generic;
                    let runs = token_keys && !a.k_residual && a.tt == TT_MAX as u32;
                    match (token_keys, runs, a.v_channels && !a.generic) {
                        (false, _, false) => "attend_block",
                        (false, _, true) => "attend_block_token_values",
                        (true, false, false) => "attend_block_token_keys",
                        (true, false, true) => "attend_block_token_keys_token_values",
                        (true, true, false) => "attend_block_runs",
                        (true, true, true) => "attend_block_runs_token_values",
                    }
                }
                _ => "attend_ring",
            };
            slot0 += launch.chunks;
            let tiles = call.q_per_row().div_ceil(tiling.qt);
            dims.tiles = tiles as u32;
            let key = KernelKey::new(entry, Constants::Attention(a));
            let grid = self.grid(call.rows() * launch.chunks * tiles * wg as usize, wg)?;
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
                wg,
                dim: d as u32,
                out_f16: call.out.dtype() == DType::F16,
                rotate_out,
                ..Default::default()
            }),
        );
        // One workgroup per (row, tile of up to 4 queries).
        let grid = self.grid(
            call.rows() * call.q_per_row().div_ceil(QT_MAX) * wg as usize,
            wg,
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

#[cfg(test)]
mod tests {
    use super::{
        launch_chunk, ring_channels, ring_split, runs_to_fill, split_tiling, value_phases,
    };

    #[test]
    fn runs_shorten_until_every_thread_of_the_workgroup_has_one() {
        // A GPU's 128-token chunks in 32-thread workgroups: 8 runs of 16, 16 of 8, 32 of 4.
        assert_eq!(runs_to_fill(16, 128, 32), 4);
        // 256 tokens in one chunk: 32 runs of 8.
        assert_eq!(runs_to_fill(16, 256, 32), 8);
        // 512-token chunks hold 32 runs of 16 already.
        assert_eq!(runs_to_fill(16, 512, 32), 16);
        // Narrow workgroups (8 threads) shorten only short launches: 64 tokens, runs of 8.
        assert_eq!(runs_to_fill(16, 64, 8), 8);
        assert_eq!(runs_to_fill(16, 1024, 8), 16);
        // Never below 4 tokens, nor above what the codes allow.
        assert_eq!(runs_to_fill(16, 20, 32), 4);
        assert_eq!(runs_to_fill(8, 4096, 32), 8);
        assert_eq!(runs_to_fill(4, 16, 32), 4);
    }

    #[test]
    fn a_ring_takes_blocks_of_8_channels_only_where_they_fill_the_workgroup() {
        // SmolLM2's head (64) in a narrow workgroup: 8 blocks of 8 for 8 threads.
        assert_eq!(ring_channels(8, 64), 8);
        // In a wide one blocks of 4 (16 of them, split over RP threads) keep more busy.
        assert_eq!(ring_channels(32, 64), 4);
        // Gemma 3's head (256): 32 blocks of 8 fill either.
        assert_eq!(ring_channels(8, 256), 8);
        assert_eq!(ring_channels(32, 256), 8);
        // Heads not a multiple of 8 (odd ones included) and small ones: blocks of 4.
        for dim in [4, 12, 36, 63, 65, 100] {
            assert_eq!(ring_channels(8, dim), 4, "{dim}");
        }
    }

    #[test]
    fn a_ring_splits_blocks_of_16_channels_only_where_they_fill_the_workgroup() {
        // SmolLM2's head in a narrow workgroup: 4 blocks, 2 threads each; a head of 128: 8
        // blocks, one thread each.
        assert_eq!(ring_split(8, 64, 928), Some(2));
        assert_eq!(ring_split(8, 128, 512), Some(1));
        // More blocks than threads (a head of 256), heads not a multiple of 16, blocks that
        // leave threads idle (6 of 8), chunks too short for the second phase's slots.
        assert_eq!(ring_split(8, 256, 512), None);
        assert_eq!(ring_split(8, 72, 512), None);
        assert_eq!(ring_split(8, 96, 512), None);
        assert_eq!(ring_split(8, 64, 32), None);
    }

    #[test]
    fn the_value_split_keeps_the_most_threads_busy_with_the_widest_blocks() {
        let widths = [16, 8, 4];
        // Narrow workgroups: blocks of 16, 2 threads a block (blocks of 8 or 4 fill the 8
        // threads as well, with more loads).
        assert_eq!(split_tiling(8, 64, 512, &widths), (16, 2));
        // Wide ones in 512-token chunks: blocks of 16, 8 threads a block.
        assert_eq!(split_tiling(32, 64, 512, &widths), (16, 8));
        // In 128-token chunks blocks of 16 leave room for 2 phases (8 threads busy), of 8 for
        // 2 (16), of 4 for 2 (32).
        assert_eq!(split_tiling(32, 64, 128, &widths), (4, 2));
        // What a head's code windows allow: 2-bit codes in groups of 8 channels.
        assert_eq!(split_tiling(8, 64, 512, &[8, 8, 4]), (8, 1));
        // A head of 256 channels fills any workgroup with blocks of 16.
        assert_eq!(split_tiling(32, 256, 512, &widths).0, 16);
    }

    #[test]
    fn value_phases_fill_the_workgroup_within_the_probabilities_memory() {
        // SmolLM2's head (64 channels) in blocks of 16 (slots of 17 vec4s): 2 threads a block
        // in a narrow workgroup, 8 in a wide one, 2 where a wide one's chunk is 128 tokens.
        assert_eq!(value_phases(8, 4, 17, 512), 2);
        assert_eq!(value_phases(32, 4, 17, 512), 8);
        assert_eq!(value_phases(32, 4, 17, 128), 2);
        // Its ring in blocks of 4 channels (slots of 4 vec4s): 2 threads a block when wide.
        assert_eq!(value_phases(8, 16, 4, 512), 1);
        assert_eq!(value_phases(32, 16, 4, 128), 2);
        // As many blocks as threads, or more: none shared.
        assert_eq!(value_phases(8, 8, 17, 512), 1);
        assert_eq!(value_phases(8, 16, 17, 512), 1);
        for wg in [1, 8, 32, 64] {
            for blocks in [1, 2, 3, 4, 7, 16, 64, 250] {
                for slot in [4, 5, 9, 17] {
                    for chunk in [16, 64, 128, 512, 944] {
                        let vp = value_phases(wg, blocks, slot, chunk);
                        let at = format!("{wg} {blocks} {slot} {chunk}");
                        assert!(vp >= 1);
                        assert!(vp == 1 || blocks * vp <= wg, "{at}");
                        assert!((vp - 1) * blocks * slot <= chunk, "{at}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_gpu_launch_is_cut_into_enough_workgroups_and_a_cpu_one_is_not() {
        // SmolLM2's decode step: 3 rows, one query tile; the workgroup memory holds 944
        // tokens, a GPU's chunks 512 at most.
        for most in [512, 944] {
            let gpu = |tokens| launch_chunk(tokens, 3, most, 16, true);
            assert_eq!(gpu(256), 512, "one chunk stays one (no combine pass)");
            assert_eq!(gpu(512), 512);
            assert_eq!(gpu(1024), 128);
            assert_eq!(gpu(4096), 128);
            assert_eq!(gpu(8192), 256);
            assert_eq!(gpu(16384), 512);
            assert_eq!(gpu(65536), 512, "never past GPU_CHUNK_MAX");
        }
        // A chunk is a whole number of runs, even where the memory bound is not a power of 2.
        assert_eq!(launch_chunk(100_000, 1, 200, 16, true), 192);
        assert_eq!(launch_chunk(4096, 64, 96, 8, true), 96);
    }

    #[test]
    fn a_cpu_launch_takes_the_fewest_chunks_of_even_length() {
        let cpu = |tokens| launch_chunk(tokens, 3, 944, 16, false);
        assert_eq!(cpu(64), 64, "one chunk: the launch's tokens");
        assert_eq!(cpu(944), 944);
        assert_eq!(cpu(1024), 512, "two chunks of 512, not 944 and 80");
        assert_eq!(cpu(1040), 544, "two of 520 tokens, in whole pairs of runs");
        assert_eq!(cpu(16384), 928, "18 chunks");
        for tokens in (16..20_000).step_by(16) {
            let span = cpu(tokens);
            let chunks = tokens.div_ceil(span);
            assert!(span % 16 == 0 && span <= 944, "{tokens}: {span}");
            assert!(
                span % 32 == 0 || span == 944,
                "{tokens}: {span}: pairs of runs"
            );
            assert_eq!(chunks, tokens.div_ceil(944), "{tokens}: the fewest chunks");
            assert!(
                chunks * span - tokens < 32 * chunks,
                "{tokens}: {chunks} x {span}"
            );
        }
    }
}

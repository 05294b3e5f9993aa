//! One layer's keys or values on the GPU: quantized pages, and an f16 window ring of the
//! most recent tokens.
//!
//! Tokens are encoded in *blocks* (whole groups of `group_quant_size` tokens with the window
//! policy; one block per call with the reference policy) written into *pages* (`page.rs`).
//! With the window policy the last page grows with the tokens, by doubling from one group up
//! to 1024 tokens, then by a quarter (its contents are moved into the larger buffer), until it reaches the most one storage
//! binding holds; then a new page starts. So a layer's history is one page, and attention
//! one dispatch, up to hundreds of thousands of tokens. A block's codes are the layer's own
//! (anchors, and reuse layers that fell back) or the anchor's page codes, shared by
//! reference (reuse layers). The window ring grows the same way, up to
//! `window + 2 × group_quant_size` slots.
//!
//! A sliding-window layer (attention window A) keeps only what a future query can see:
//! before each append, the pages that lie wholly before the next query's window are
//! dropped (and the sinks, once they fall out of it), and its pages have a fixed size of
//! about A − window tokens (`sliding_page`), so it holds at most two or three of them and
//! its memory stays flat however long the context.

use std::sync::Arc;

use crate::cache::page::{BlockRecord, Page, PageKind, SECTION_ALIGN};
use crate::config::{DType, QuantSpec};
use crate::error::{Result, XqError};
use crate::gpu::dispatch::Bind;
use crate::gpu::kernels::attention::{AttnSource, BlockSide, RING_ALIGN};
use crate::gpu::kernels::materialize::{joins_sinks, Encoded, OutView, Source};
use crate::gpu::kernels::rotate::{unrotates, unrotates_levels, RingRotation};
use crate::gpu::kernels::views::{Block, RingSinks, TokenView};
use crate::gpu::kernels::window::{RingTarget, RingWrite};
use crate::gpu::{GpuBuffer, GpuContext, GpuTensor, PackedCodes};
use crate::reference::{reference_bytes, Role, RotationTarget};

/// Pages double up to this many tokens, then grow by a quarter.
const GEOMETRIC_TOKENS: usize = 1024;

/// The tokens an append brings: `t` tokens of `x` (`[R, t, D]`), un-rotated where
/// `rotation` says how to rotate them as they are written into the ring and the sinks.
/// `held`: how a rotated plan rotates this side's tokens, for the tokens the store holds
/// as they came when this call starts its rotated phase ([`TensorStore::rotated`]).
#[derive(Clone, Copy)]
pub(crate) struct Incoming<'a> {
    pub x: TokenView<'a>,
    pub t: usize,
    pub rotation: Option<RingRotation>,
    pub held: Option<HeldRotation>,
}

/// An append's last command, a write of tokens into the store's ring, left for the caller
/// to record with the other side's (one launch for a decode step's keys and values:
/// [`GpuContext::encode_window_appends`]).
pub(crate) struct DeferredWrite<'a> {
    x: TokenView<'a>,
    n: usize,
    ring: Arc<GpuBuffer>,
    tokens: usize,
    t0: usize,
    rows: usize,
    dim: usize,
    rotation: Option<RingRotation>,
}

impl DeferredWrite<'_> {
    /// The write, to record.
    pub(crate) fn write(&self) -> RingWrite<'_> {
        RingWrite {
            x: self.x,
            n: self.n,
            ring: RingTarget {
                buffer: Bind::from(&*self.ring),
                tokens: self.tokens,
                t0: self.t0,
                rows: self.rows,
                dim: self.dim,
                rotation: self.rotation,
            },
        }
    }
}

/// The rotation of one side (keys or values) of a layer of a rotated plan, as the tokens
/// held in the ring and the sinks take it when the store starts holding rotated tokens.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeldRotation {
    pub seed: u32,
    /// The layer whose signs rotate this side, and the side (0 keys, 1 values).
    pub signs_layer: usize,
    pub kind: u32,
    /// KV heads (the ring's rows are batch × heads).
    pub heads: usize,
}

/// The f16 window: `[R, tokens, D_even]` halves, token t in slot `t % tokens`; then, at the
/// next section boundary, `sinks` slots for the f16 sinks, `[R, sinks, D_even]` (so attention
/// reads the sinks and the window from one buffer, by one code path).
#[derive(Clone, Debug)]
pub(crate) struct Ring {
    pub(super) buffer: Arc<GpuBuffer>,
    pub(super) tokens: usize,
    pub(super) sinks: usize,
}

impl Ring {
    /// A ring of `tokens` window slots and `sinks` sink slots, each `slot_bytes` (all rows).
    pub(crate) fn new(
        ctx: &GpuContext,
        label: &str,
        tokens: usize,
        sinks: usize,
        slot_bytes: usize,
    ) -> Result<Ring> {
        let window = (tokens * slot_bytes) as u64;
        let bytes = match sinks {
            0 => window,
            s => window.next_multiple_of(SECTION_ALIGN) + (s * slot_bytes) as u64,
        };
        // Attention reads a ring 16 bytes at a time.
        let bytes = bytes.next_multiple_of(RING_ALIGN);
        Ok(Ring {
            buffer: ctx.storage_buffer(label, bytes)?,
            tokens,
            sinks,
        })
    }

    /// Byte offset of the sink slots (the window's slots, padded to a section boundary).
    pub(crate) fn sink_offset(&self, slot_bytes: usize) -> u64 {
        ((self.tokens * slot_bytes) as u64).next_multiple_of(SECTION_ALIGN)
    }

    /// The sink slots, `[R, sinks, D_even]` halves.
    pub(crate) fn sink_section(&self, slot_bytes: usize) -> Bind<'_> {
        let size = (self.sinks * slot_bytes) as u64;
        Bind::section(&self.buffer, self.sink_offset(slot_bytes), size)
    }
}

/// One layer's keys or values.
#[derive(Clone, Debug)]
pub(crate) struct TensorStore {
    pub(super) kind: PageKind,
    pub spec: QuantSpec,
    pub residual_bits: u8,
    pub rows: usize,
    pub dim: usize,
    /// Most tokens of a page (window policy).
    pub(super) max_page: usize,
    /// Window length W (0 with the reference policy).
    pub window: usize,
    /// The most tokens the store will hold (the set's `max_ctx`, window policy).
    pub(super) max_tokens: usize,
    pub(super) pages: Vec<Page>,
    /// The window ring, which also holds the sinks (allocated with the first sink, with no
    /// window slots until the body needs them).
    pub(super) ring: Option<Ring>,
    /// First tokens kept in f16 (attention sinks), in the ring's sink slots.
    pub(super) sinks: usize,
    /// Tokens in the sink slots.
    pub(super) sink_len: usize,
    /// A sliding layer dropped its sinks (they fell out of its window).
    pub(super) sinks_dropped: bool,
    /// Tokens held after the sinks (the *body*: pages, then the window). Page starts, block
    /// records and ring slots count body tokens.
    pub(super) len: usize,
    /// Body tokens quantized into pages (the rest are in the window).
    pub(super) quantized: usize,
    /// A sliding layer's attention window (0: none).
    pub(super) attention_window: usize,
    /// Body tokens dropped by a sliding layer (whole pages): its pages start here.
    pub(super) dropped: usize,
    /// The store holds its tokens rotated, where its plan rotates them: from the first call
    /// that quantizes any (pages hold rotated codes, and the ring and the sinks are rotated
    /// in that call). Before it, a rotated plan's ring and sinks hold the tokens as they
    /// came, so a context inside the window appends and attends without rotations.
    pub(super) rotated: bool,
}

/// The page size of a sliding layer with attention window `attention_window`, f16 window
/// `window` and groups of `group`: the quantized tokens a query can see (A − window, in
/// whole groups), at most `max_page`. The pages a query sees then number two at most
/// (three when a call brings many tokens), so attention stays a few dispatches.
pub(crate) fn sliding_page(
    max_page: usize,
    attention_window: usize,
    window: usize,
    group: usize,
) -> usize {
    let seen = attention_window.saturating_sub(window).div_ceil(group) * group;
    seen.max(group).min(max_page)
}

/// Byte accounting of a store.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StoreBytes {
    /// Reference accounting of quantized blocks plus 2 bytes per window element.
    pub accounted: u64,
    /// Bytes of the GPU buffers.
    pub allocated: u64,
    /// The same tokens in fp16.
    pub fp16: u64,
}

/// Records copying tokens `range` (absolute: token t in slot `t % tokens`) of the f16 ring
/// `from` into `to` (rings of `rows` rows of `stride` halves per slot), in runs that wrap
/// in neither.
pub(crate) fn copy_ring_tokens(
    enc: &mut wgpu::CommandEncoder,
    from: &Ring,
    to: &Ring,
    range: std::ops::Range<usize>,
    rows: usize,
    stride: usize,
) {
    let row_bytes = |slots: usize| (slots * stride * 2) as u64;
    let mut t = range.start;
    while t < range.end {
        let (a, b) = (t % from.tokens, t % to.tokens);
        let n = (range.end - t).min(from.tokens - a).min(to.tokens - b);
        for r in 0..rows {
            enc.copy_buffer_to_buffer(
                &from.buffer,
                r as u64 * row_bytes(from.tokens) + row_bytes(a),
                &to.buffer,
                r as u64 * row_bytes(to.tokens) + row_bytes(b),
                row_bytes(n),
            );
        }
        t += n;
    }
}

impl TensorStore {
    /// A store of `kind` pages of at most `max_page` tokens (the set's
    /// page size (the same in every store, so reuse layers share pages)), a window of `window` and `sinks` f16 tokens; at most `max_tokens`
    /// tokens.
    pub fn new(
        kind: PageKind,
        max_page: usize,
        window: usize,
        sinks: usize,
        max_tokens: usize,
    ) -> Self {
        TensorStore {
            kind,
            spec: kind.spec,
            residual_bits: kind.residual_bits,
            rows: kind.rows,
            dim: kind.dim,
            max_page,
            window,
            max_tokens: max_tokens.saturating_sub(sinks).max(1),
            pages: Vec::new(),
            ring: None,
            sinks,
            sink_len: 0,
            sinks_dropped: false,
            len: 0,
            quantized: 0,
            attention_window: 0,
            dropped: 0,
            rotated: false,
        }
    }

    /// The store of a sliding layer with this attention window (`None`: a global layer):
    /// pages of [`sliding_page`] tokens, dropped as they fall out of the window.
    pub fn sliding(mut self, attention_window: Option<usize>) -> Self {
        if let Some(a) = attention_window {
            self.attention_window = a;
            self.max_page = sliding_page(self.max_page, a, self.window, self.group());
        }
        self
    }

    /// The first position the store still holds: 0, or past what a sliding layer dropped.
    pub fn held_from(&self) -> usize {
        match self.sinks_held() {
            true => 0,
            false => self.sink_len + self.dropped,
        }
    }

    /// Whether the ring holds sinks (filled at least in part, not dropped).
    fn sinks_held(&self) -> bool {
        self.sink_len > 0 && !self.sinks_dropped
    }

    /// Tokens still held (every token, except what a sliding layer dropped).
    pub fn held(&self) -> usize {
        self.len() - self.held_from()
    }

    /// Tokens in the f16 sinks (none once a sliding layer dropped them).
    pub fn sink_tokens(&self) -> usize {
        if self.sinks_held() {
            self.sink_len
        } else {
            0
        }
    }

    /// A sliding layer: drops the pages (and the sinks) wholly before the window of the
    /// next query, at position `len()`: it and every later query see positions
    /// `> len() − attention_window` only. A page is dropped once it is also full, so the
    /// pages still start where quantization continues.
    fn drop_unseen(&mut self) {
        if self.attention_window == 0 {
            return;
        }
        let first_seen = (self.len() + 1).saturating_sub(self.attention_window);
        if first_seen >= self.sinks && self.sink_len == self.sinks {
            self.sinks_dropped = true;
        }
        let unseen = first_seen.saturating_sub(self.sinks).min(self.quantized);
        let gone = self
            .pages
            .iter()
            .take_while(|p| p.start + p.layout.tokens <= unseen)
            .count();
        if gone > 0 {
            self.dropped = self.pages[gone - 1].start + self.pages[gone - 1].layout.tokens;
            self.pages.drain(..gone);
        }
    }

    /// Capacity of a new page at body token `start` that must reach `need`: a sliding
    /// layer's pages after the first are whole pages at once (the first grows like any).
    fn new_page_capacity(&self, start: usize, need: usize) -> usize {
        if self.attention_window > 0 && start > 0 {
            self.max_page
        } else {
            self.capacity_for(need - start)
        }
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.sink_len + self.len
    }

    /// Tokens in the full-precision window.
    pub fn window_tokens(&self) -> usize {
        self.len - self.quantized
    }

    fn group(&self) -> usize {
        self.spec.group_size
    }

    /// Slots of the ring: the window plus room for two groups in flight.
    fn ring_tokens(&self) -> usize {
        self.window + 2 * self.group()
    }

    /// Halves per token in the ring (D rounded up to even, so tokens own whole words).
    pub(super) fn ring_stride(&self) -> usize {
        self.dim.div_ceil(2) * 2
    }

    /// Bytes of one ring slot across the rows.
    pub(super) fn slot_bytes(&self) -> usize {
        self.rows * self.ring_stride() * 2
    }

    /// Capacity of a page that must hold `need` tokens: one group, doubling up to
    /// [`GEOMETRIC_TOKENS`], then by a quarter (in whole groups), at most the largest page.
    /// Growth stays amortised O(1) per token while a long context's last page holds at most
    /// a quarter more than its tokens (doubling left up to twice).
    fn capacity_for(&self, need: usize) -> usize {
        let g = self.group();
        let mut c = g;
        while c < need && c < self.max_page {
            c = if c < GEOMETRIC_TOKENS {
                c * 2
            } else {
                c + (c / 4).div_ceil(g) * g
            };
        }
        c.min(self.max_page)
    }

    /// The page holding token `t` (window policy), and where it ends.
    fn page_of(&self, t: usize) -> (usize, usize) {
        let i = self
            .pages
            .partition_point(|p| p.start + p.layout.tokens <= t);
        let end = self.pages.get(i).map_or(t, |p| p.start + p.layout.tokens);
        (i, end)
    }

    /// The window policy's plan for `t` more tokens: (new quantized count, first block
    /// boundary at or after the current length).
    fn window_plan(&self, t: usize) -> (usize, usize) {
        let g = self.group();
        let len2 = self.len + t;
        let q2 = if len2 >= self.window {
            self.quantized.max((len2 - self.window) / g * g)
        } else {
            self.quantized
        };
        (q2, self.len.div_ceil(g) * g)
    }

    /// Makes the pages cover tokens `[0, q2)` (window policy): the last page grows (moved
    /// into a buffer twice the size, shared blocks re-pointed at the anchor's grown page)
    /// until it is as large as a page may be, then new pages follow.
    fn cover(
        &mut self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        q2: usize,
        anchor: Option<&TensorStore>,
    ) -> Result<()> {
        loop {
            let Some(last) = self.pages.last() else {
                let start = self.dropped;
                if q2 <= start {
                    return Ok(());
                }
                let cap = self.new_page_capacity(start, q2);
                self.pages.push(Page::new(ctx, &self.kind, start, cap)?);
                continue;
            };
            let end = last.start + last.layout.tokens;
            if end >= q2 {
                return Ok(());
            }
            if last.layout.tokens >= self.max_page {
                let cap = self.new_page_capacity(end, q2);
                self.pages.push(Page::new(ctx, &self.kind, end, cap)?);
                continue;
            }
            let idx = self.pages.len() - 1;
            let cap = self.capacity_for(q2 - last.start);
            let filled_end = last.start + last.filled();
            let anchor_page = anchor.and_then(|a| {
                a.page_at(last.start)
                    .filter(|p| p.layout.tokens == cap && a.quantized >= filled_end)
            });
            let grown = last.grown(ctx, enc, &self.kind, cap, anchor_page)?;
            // The replaced buffer lives on in the caller's checkpoint until the copy out of
            // it has been submitted.
            self.pages[idx] = grown;
        }
    }

    /// Ring slots a call appending `t` tokens needs at its busiest: the tokens completing
    /// the partial group join the window before whole groups leave it, and afterwards the
    /// window holds `len + t - q2` tokens.
    fn ring_need(&self, t: usize) -> usize {
        let (q2, s) = self.window_plan(t);
        let len2 = self.len + t;
        (s.min(len2) - self.quantized).max(len2 - q2)
    }

    /// Makes the ring ready for `t` more body tokens. Groups leave the ring from the call
    /// that brings the body to window + group tokens.
    ///
    /// With `held`, the tokens the ring and the sinks hold are rotated in the ring the call
    /// then uses (a new one: the one holding them as they came stays as it is, for a
    /// checkpoint taken before the call).
    fn reserve_ring(
        &mut self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        t: usize,
        held: Option<&HeldRotation>,
    ) -> Result<()> {
        let aligned = self.len + t >= self.window + self.group();
        self.grow_ring(ctx, enc, self.ring_need(t), aligned, held)
    }

    /// Records the rotation, in place, of every slot of `ring` (window and, when held,
    /// sinks): `[batch, heads, slots, D]` halves each.
    fn rotate_ring(
        &self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        ring: &Ring,
        held: &HeldRotation,
    ) -> Result<()> {
        let sections = [
            (0, ring.tokens),
            (
                ring.sink_offset(self.slot_bytes()),
                ring.sinks * self.sinks_held() as usize,
            ),
        ];
        for (offset, slots) in sections.into_iter().filter(|s| s.1 > 0) {
            let dims = [self.rows / held.heads, held.heads, slots, self.dim];
            let tensor = GpuTensor::at(ring.buffer.clone(), offset, &dims, DType::F16)?;
            let target = RotationTarget::kv(dims, held.signs_layer, held.kind);
            ctx.encode_rotate(enc, None, &tensor, &target, held.seed, false)?;
        }
        Ok(())
    }

    /// Makes the ring hold at least `need` slots. Once groups are quantized out of it
    /// (`aligned`), its slots are a multiple of the group (a group never wraps): `need` in
    /// whole groups, up to `window + 2 × group` (or the store's token budget, when smaller:
    /// then the ring never wraps), so a decode stream's ring stays at window + group. Before
    /// that it doubles, but never past window + group, nor past what the sinks and the
    /// window's tokens would fill of the next power of two, nor past the token budget, so
    /// sinks + ring (+ the first pages) stay within what an f16 cache doubling its capacity
    /// up to the same budget holds. A grown ring receives the window's tokens.
    fn grow_ring(
        &mut self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        need: usize,
        aligned: bool,
        held: Option<&HeldRotation>,
    ) -> Result<()> {
        let have = self.ring.as_ref().map_or(0, |r| r.tokens);
        let full = self.ring_tokens();
        let fits = need <= have && (!aligned || have % self.group() == 0);
        let held = held.filter(|_| self.ring.is_some());
        if fits && held.is_none() {
            return Ok(());
        }
        let tokens = if fits {
            have
        } else if aligned {
            let g = self.group();
            (need.div_ceil(g) * g)
                .min(full)
                .min(self.max_tokens.max(need))
        } else {
            let fits = (self.sinks + need).next_power_of_two() - self.sinks;
            let stream = self.window + self.group();
            need.max((2 * have).min(fits).min(stream).min(self.max_tokens))
        };
        if tokens < need {
            return Err(XqError::Gpu(format!(
                "window ring of {full} slots cannot hold {need} tokens"
            )));
        }
        let new = Ring::new(ctx, "window", tokens, self.sinks, self.slot_bytes())?;
        if let Some(old) = &self.ring {
            copy_ring_tokens(
                enc,
                old,
                &new,
                self.quantized..self.len,
                self.rows,
                self.ring_stride(),
            );
            if self.sinks_held() {
                let sb = self.slot_bytes();
                enc.copy_buffer_to_buffer(
                    &old.buffer,
                    old.sink_offset(sb),
                    &new.buffer,
                    new.sink_offset(sb),
                    (old.sinks * sb) as u64,
                );
            }
        }
        if let Some(held) = held {
            self.rotate_ring(ctx, enc, &new, held)?;
        }
        self.ring = Some(new);
        Ok(())
    }

    /// Encodes tokens `[start, start + n)` (inside one page) from `x` into the page: with the
    /// anchor's codes when given (reuse), else with the page's own codes.
    #[allow(clippy::too_many_arguments)]
    fn encode_block(
        &mut self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        x: &TokenView,
        page: usize,
        start: usize,
        n: usize,
        anchor: Option<PackedCodes>,
        out: DType,
    ) -> Result<()> {
        let spec = self.spec;
        let p = &mut self.pages[page];
        let block = Block {
            page: p.layout,
            t0: start - p.start,
            n,
        };
        // Codes laid out for another geometry (a reference-policy call of another length)
        // cannot be shared: the layer quantizes itself.
        let anchor = anchor.filter(|c| c.layout == p.layout);
        let record = match anchor {
            Some(codes) => {
                ctx.encode_reuse_fit_block(
                    enc,
                    x,
                    &block,
                    &spec,
                    &codes,
                    &p.params,
                    p.residual.as_ref(),
                    out,
                )?;
                BlockRecord {
                    t0: block.t0,
                    n,
                    codes,
                    shared: true,
                }
            }
            None => {
                let codes = p.own_codes(ctx)?;
                ctx.encode_quantize_block(enc, x, &block, &spec, &codes, &p.params)?;
                BlockRecord {
                    t0: block.t0,
                    n,
                    codes,
                    shared: false,
                }
            }
        };
        p.record(record);
        Ok(())
    }

    /// The page starting at body token `start`, if the store has it.
    fn page_at(&self, start: usize) -> Option<&Page> {
        self.pages.iter().find(|p| p.start == start)
    }

    /// The anchor's codes for tokens `[start, start + n)` of its page starting at
    /// `page_start`, if it has them.
    fn anchor_page_codes(
        anchor: &TensorStore,
        page_start: usize,
        start: usize,
        n: usize,
    ) -> Option<PackedCodes> {
        if anchor.quantized < start + n {
            return None;
        }
        anchor.page_at(page_start).and_then(|p| p.own_codes.clone())
    }

    /// Window policy: appends the incoming tokens: the first `sinks` tokens of the stream
    /// into the sink buffer, then the body's, quantizing whole groups that leave the window;
    /// a reuse layer shares `anchor`'s codes where it has them. Tokens that come un-rotated
    /// (`input.rotation`) must all [land in the ring](Self::lands_in_ring). The call's last
    /// command, when it is a write into the ring, is returned un-recorded: the caller records
    /// it (after everything else this call recorded). On error the store may be
    /// half-advanced: the caller restores a clone taken before.
    pub fn append_window<'a>(
        &mut self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        input: Incoming<'a>,
        anchor: Option<&TensorStore>,
        out: DType,
    ) -> Result<Option<DeferredWrite<'a>>> {
        let Incoming {
            x,
            t,
            rotation,
            held,
        } = input;
        if rotation.is_some() && !self.lands_in_ring(t) {
            return Err(XqError::Gpu(
                "a rotation into the ring for tokens quantized straight from the input".into(),
            ));
        }
        self.drop_unseen();
        // The ring the call needs, before the sinks go into it (one ring per call: a ring
        // replaced within the call would be dropped before the call's commands ran).
        // A call that quantizes tokens starts the rotated phase: what the ring and the
        // sinks hold is rotated first (the call's tokens come in rotated).
        let body = t - self.sinks_taken(t);
        let starts_rotated = !self.rotated && self.rotated_after(t);
        if body > 0 {
            self.reserve_ring(ctx, enc, body, held.as_ref().filter(|_| starts_rotated))?;
        }
        self.rotated |= starts_rotated;
        let s = self.fill_sinks(ctx, enc, &input)?;
        if s == t {
            return Ok(None);
        }
        let body = Incoming {
            x: TokenView { t0: x.t0 + s, ..x },
            t: t - s,
            rotation,
            held,
        };
        self.append_body(ctx, enc, body, anchor, out)
    }

    /// Whether the store holds its tokens rotated after an append of `t` tokens (window
    /// policy): it does from the first call that quantizes any.
    pub fn rotated_after(&self, t: usize) -> bool {
        let body = t - self.sinks_taken(t);
        self.rotated || (body > 0 && self.window_plan(body).0 > 0)
    }

    /// Whether an append of `t` tokens writes all of them into the ring or the sinks (none is
    /// quantized straight from the input): a decode step, or any append no longer than the
    /// window once a whole group is held.
    pub fn lands_in_ring(&self, t: usize) -> bool {
        let (q2, s) = self.window_plan(t);
        q2 <= s
    }

    /// How many of an append's `t` tokens go into the sinks (the first, while they are not
    /// full); the others are the body's.
    fn sinks_taken(&self, t: usize) -> usize {
        self.sinks.saturating_sub(self.sink_len).min(t)
    }

    /// Copies the first incoming tokens into the sinks while they are not full; returns how
    /// many it took.
    fn fill_sinks(
        &mut self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        input: &Incoming,
    ) -> Result<usize> {
        let n = self.sinks_taken(input.t);
        if n == 0 {
            return Ok(0);
        }
        if self.ring.is_none() {
            self.ring = Some(Ring::new(ctx, "window", 0, self.sinks, self.slot_bytes())?);
        }
        let ring = self.ring.as_ref().expect("allocated above");
        let target = RingTarget {
            buffer: ring.sink_section(self.slot_bytes()),
            tokens: self.sinks,
            t0: self.sink_len,
            rows: self.rows,
            dim: self.dim,
            rotation: input.rotation,
        };
        ctx.encode_window_append(enc, &input.x, n, &target)?;
        self.sink_len += n;
        Ok(n)
    }

    /// The window policy over the body (tokens after the sinks), into the ring
    /// `append_window` reserved for them; its last ring write is returned un-recorded.
    fn append_body<'a>(
        &mut self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        input: Incoming<'a>,
        anchor: Option<&TensorStore>,
        out: DType,
    ) -> Result<Option<DeferredWrite<'a>>> {
        let Incoming { x, t, rotation, .. } = input;
        let g = self.group();
        let (len, q) = (self.len, self.quantized);
        let len2 = len + t;
        let (q2, s) = self.window_plan(t);
        self.cover(ctx, enc, q2, anchor)?;
        // The ring, when this call needs one (a window of 0 may quantize everything).
        let ring = self.ring.clone();
        let ring = || ring.as_ref().expect("grow_ring made room for the window");
        let at = |t0: usize| TokenView { t0: x.t0 + t0, ..x };
        // 1. Complete the partial group (and the window) from the first new tokens.
        let (rows, dim) = (self.rows, self.dim);
        let deferred = |x: TokenView<'a>, n: usize, t0: usize| DeferredWrite {
            x,
            n,
            ring: ring().buffer.clone(),
            tokens: ring().tokens,
            t0,
            rows,
            dim,
            rotation,
        };
        let keep = s.max(q2);
        let a1 = s.min(len2) - len;
        let mut last = None;
        if a1 > 0 {
            let write = deferred(at(0), a1, len);
            if q < q2 || keep < len2 {
                // Not the call's last command (groups quantized or tokens kept follow it).
                ctx.encode_window_appends(enc, &[write.write()])?;
            } else {
                last = Some(write);
            }
        }
        // 2. Groups now whole in the window, then 3. groups straight from the input.
        let mut b = q;
        while b < q2 {
            let (page, page_end) = self.page_of(b);
            let from_ring = b < s;
            let end = if from_ring { b + g } else { q2.min(page_end) };
            let page_start = self.pages[page].start;
            let codes = anchor.and_then(|a| Self::anchor_page_codes(a, page_start, b, end - b));
            let view = match from_ring {
                true => TokenView {
                    buffer: (&*ring().buffer).into(),
                    dtype: DType::F16,
                    tokens: ring().tokens,
                    t0: b % ring().tokens,
                    stride: self.ring_stride(),
                    to_f16: false,
                },
                false => at(b - len),
            };
            self.encode_block(ctx, enc, &view, page, b, end - b, codes, out)?;
            b = end;
        }
        // 4. The rest of the input stays in the window.
        if keep < len2 {
            last = Some(deferred(at(keep - len), len2 - keep, keep));
        }
        self.len = len2;
        self.quantized = q2;
        Ok(last)
    }

    /// Reference policy: the call's `t` tokens become one block (its own page), quantized
    /// as one tensor with the tail group padded, as the reference does.
    pub fn append_reference(
        &mut self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        x: &TokenView,
        t: usize,
        anchor: Option<PackedCodes>,
        out: DType,
    ) -> Result<()> {
        let page = Page::new(ctx, &self.kind, self.len, t)?;
        self.pages.push(page);
        let idx = self.pages.len() - 1;
        let start = self.len;
        self.encode_block(ctx, enc, x, idx, start, t, anchor, out)?;
        self.len += t;
        self.quantized = self.len;
        self.rotated = true;
        Ok(())
    }

    /// The own codes of the page written by the last reference-policy call (to publish).
    pub fn last_page_codes(&self) -> Option<PackedCodes> {
        self.pages.last().and_then(|p| p.own_codes.clone())
    }

    /// Records the reconstruction of every token held into `out` (`[R, held, D]`, token 0
    /// at position `held_from`): sinks, pages, window. With `unrotate` (a rotated store's
    /// signs) each source is rotated back as it is read where every source has that path
    /// (`rotate_held`: f16 tokens, and Lloyd–Max codes grouped along D); returns whether it
    /// was, else the caller rotates `out` back in place.
    pub fn encode_fetch(
        &self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        out: Bind<'_>,
        out_dtype: DType,
        unrotate: Option<&RingRotation>,
    ) -> Result<bool> {
        let sinks = self.sink_len;
        let from = self.held_from();
        let view = |abs: usize| OutView {
            buffer: out,
            dtype: out_dtype,
            rows: self.rows,
            tokens: self.held(),
            dim: self.dim,
            t0: abs - from,
        };
        let unrotate = unrotate.filter(|_| {
            unrotates(self.dim)
                && self.pages.iter().all(|p| {
                    p.blocks
                        .iter()
                        .all(|b| unrotates_levels(&p.layout, b.shared && p.residual.is_some()))
                })
        });
        // A ring's tokens: rotated back as they are read, or as they are.
        let ring_out = |enc: &mut wgpu::CommandEncoder, source: Source, at: OutView| match unrotate
        {
            Some(rotation) => ctx.encode_unrotate_ring(enc, &source, &at, rotation),
            None => ctx.encode_materialize(enc, &source, &at),
        };
        let window = self.quantized < self.len;
        // The sinks: in the window's launch where that reads them, else a launch of their own.
        let sink_ring = self.ring.as_ref().filter(|_| self.sinks_held());
        let joined = sink_ring.is_some() && window && joins_sinks(self.dim);
        if let Some(ring) = sink_ring.filter(|_| !joined) {
            let source = Source::Ring {
                ring: ring.sink_section(self.slot_bytes()),
                ring_tokens: ring.sinks,
                t0: 0,
                n: sinks,
                sinks: RingSinks::default(),
            };
            ring_out(enc, source, view(0))?;
        }
        for p in &self.pages {
            for b in &p.blocks {
                let block = Block {
                    page: p.layout,
                    t0: b.t0,
                    n: b.n,
                };
                let encoded = Encoded {
                    codes: &b.codes,
                    params: &p.params,
                    residual: if b.shared { p.residual.as_ref() } else { None },
                };
                let at = view(sinks + p.start + b.t0);
                if let Some(rotation) = unrotate {
                    ctx.encode_unrotate_levels(enc, &block, &encoded, &at, rotation)?;
                } else {
                    ctx.encode_materialize(enc, &Source::Block(block, encoded), &at)?;
                }
            }
        }
        if window {
            let ring = self
                .ring
                .as_ref()
                .expect("a window holds tokens only after reserve");
            let source = Source::Ring {
                ring: Bind::from(&*ring.buffer),
                ring_tokens: ring.tokens,
                t0: self.quantized,
                n: self.len - self.quantized,
                sinks: match joined {
                    true => self.ring_sinks(ring, sinks),
                    false => RingSinks::default(),
                },
            };
            ring_out(enc, source, view(sinks + self.quantized))?;
        }
        Ok(unrotate.is_some())
    }

    /// `n` sink tokens of `ring` (this store's, or its values' twin), as its readers take them.
    fn ring_sinks(&self, ring: &Ring, n: usize) -> RingSinks {
        RingSinks {
            n,
            slots: ring.sinks,
            word: (ring.sink_offset(self.slot_bytes()) / 4) as usize,
        }
    }

    /// Accounting: reference formula for quantized blocks, 2 bytes per window and sink
    /// element.
    pub fn bytes(&self) -> StoreBytes {
        let mut accounted = 0u64;
        for p in &self.pages {
            for b in &p.blocks {
                let role = if b.shared { Role::Reuse } else { Role::Anchor };
                let rbits = if b.shared { self.residual_bits } else { 0 };
                accounted += (reference_bytes(role, b.n, self.dim, &self.spec, rbits).compressed
                    * self.rows) as u64;
            }
        }
        let element_bytes = (self.rows * self.dim * 2) as u64;
        accounted += (self.window_tokens() + self.sink_tokens()) as u64 * element_bytes;
        let allocated = self.pages.iter().map(Page::allocated_bytes).sum::<u64>()
            + self.ring.as_ref().map_or(0, |r| r.buffer.size());
        StoreBytes {
            accounted,
            allocated,
            fp16: self.held() as u64 * element_bytes,
        }
    }

    /// Bytes of the ring plus the last page plus the pages' section padding: the most by
    /// which allocation may exceed accounting (full pages are filled; the last one is at
    /// most its own size short).
    pub fn slack_bound(&self) -> u64 {
        let ring = self.ring.as_ref().map_or(0, |r| r.buffer.size());
        let last = self.pages.last().map_or(0, Page::allocated_bytes);
        let padding = self.pages.len() as u64 * 4 * (SECTION_ALIGN - 4);
        ring + last + padding
    }

    /// What attention reads: one source per block of every page, then the window's tokens.
    /// `self` holds keys and `value` the values of the same layer.
    pub fn attention_sources<'a>(&'a self, value: &'a TensorStore) -> Result<Vec<AttnSource<'a>>> {
        let mismatch = || XqError::Gpu("keys and values of a layer are out of step".into());
        if self.len != value.len
            || self.sink_len != value.sink_len
            || self.pages.len() != value.pages.len()
        {
            return Err(mismatch());
        }
        let mut sources = Vec::new();
        let sinks = self.sink_len;
        for (kp, vp) in self.pages.iter().zip(&value.pages) {
            if kp.blocks.len() != vp.blocks.len() || kp.start != vp.start {
                return Err(mismatch());
            }
            for (kb, vb) in kp.blocks.iter().zip(&vp.blocks) {
                if (kb.t0, kb.n) != (vb.t0, vb.n) {
                    return Err(mismatch());
                }
                let side = |p: &'a Page, b: &'a BlockRecord| BlockSide {
                    codes: &b.codes,
                    params: &p.params,
                    residual: if b.shared { p.residual.as_ref() } else { None },
                };
                sources.push(AttnSource::Block {
                    key: side(kp, kb),
                    value: side(vp, vb),
                    t0: kb.t0,
                    n: kb.n,
                    abs0: sinks + kp.start + kb.t0,
                });
            }
        }
        let held_sinks = self.sink_tokens();
        if self.quantized < self.len || held_sinks > 0 {
            let (kr, vr) = match (&self.ring, &value.ring) {
                (Some(k), Some(v)) if (k.tokens, k.sinks) == (v.tokens, v.sinks) => (k, v),
                _ => return Err(mismatch()),
            };
            sources.push(AttnSource::Ring {
                key: &kr.buffer,
                value: &vr.buffer,
                ring_tokens: kr.tokens,
                t0: self.quantized,
                n: self.len - self.quantized,
                abs0: sinks + self.quantized,
                sinks: self.ring_sinks(kr, held_sinks),
            });
        }
        Ok(sources)
    }

    /// Drops every buffer (shared codes live on while a reuse layer holds them).
    pub fn clear(&mut self) {
        self.pages.clear();
        self.ring = None;
        self.sink_len = 0;
        self.sinks_dropped = false;
        self.len = 0;
        self.quantized = 0;
        self.dropped = 0;
        self.rotated = false;
    }
}

//! One layer's keys or values on the GPU: quantized pages, and an f16 window ring of the
//! most recent tokens.
//!
//! Tokens are encoded in *blocks* (whole groups of `group_quant_size` tokens with the window
//! policy; one block per call with the reference policy) written into *pages*: fixed-size
//! buffers that are allocated as the context grows and never copied. A block's codes are the
//! layer's own (anchors, and reuse layers that fell back) or the anchor's page codes, shared
//! by reference (reuse layers).

use std::sync::Arc;

use crate::config::{DType, QuantSpec, TensorShape};
use crate::error::Result;
use crate::gpu::kernels::quant::{Block, Encoded, OutView, RingTarget, Source, TokenView};
use crate::gpu::{GpuBuffer, GpuContext, GpuParams, PackedCodes, QuantizedTensor};
use crate::layout::GroupLayout;
use crate::reference::{reference_bytes, Role};

/// Codes, params and residual of one block, as recorded in its page.
#[derive(Clone, Debug)]
struct BlockRecord {
    /// Page-relative first token.
    t0: usize,
    /// Tokens.
    n: usize,
    /// The codes this block decodes with (own, or the anchor's page codes).
    codes: PackedCodes,
    /// Whether the codes are the anchor's (then a residual applies, when configured).
    shared: bool,
}

/// A fixed-size run of tokens `[start, start + capacity)` and its buffers.
#[derive(Debug)]
pub(crate) struct Page {
    start: usize,
    layout: GroupLayout,
    params: GpuParams,
    own_codes: Option<PackedCodes>,
    residual: Option<QuantizedTensor>,
    blocks: Vec<BlockRecord>,
}

impl Page {
    fn allocated_bytes(&self) -> u64 {
        self.params.allocated_bytes()
            + self.own_codes.as_ref().map_or(0, |c| c.allocated_bytes())
            + self.residual.as_ref().map_or(0, |r| r.allocated_bytes())
    }

    /// The page's own code buffer (allocated on first use by a reuse layer's fallback).
    fn own_codes(&mut self, ctx: &GpuContext) -> Result<PackedCodes> {
        if self.own_codes.is_none() {
            let shape =
                TensorShape::from_rows(self.layout.rows, self.layout.tokens, self.layout.dim)?;
            self.own_codes = Some(ctx.empty_codes(self.layout, &shape)?);
        }
        Ok(self.own_codes.clone().expect("just set"))
    }
}

/// The f16 window: `[R, tokens, D_even]` halves, token t in slot `t % tokens`.
#[derive(Debug)]
pub(crate) struct Ring {
    buffer: Arc<GpuBuffer>,
    tokens: usize,
}

/// One layer's keys or values.
#[derive(Debug)]
pub(crate) struct TensorStore {
    pub spec: QuantSpec,
    pub residual_bits: u8,
    pub role: Role,
    pub rows: usize,
    pub dim: usize,
    /// Tokens per page (window policy).
    pub page_tokens: usize,
    /// Window length W (0 with the reference policy).
    pub window: usize,
    pages: Vec<Page>,
    ring: Option<Ring>,
    /// Tokens held.
    len: usize,
    /// Tokens quantized into pages (the rest are in the window).
    quantized: usize,
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

impl TensorStore {
    pub fn new(
        spec: QuantSpec,
        residual_bits: u8,
        role: Role,
        rows: usize,
        dim: usize,
        page_tokens: usize,
        window: usize,
    ) -> Self {
        TensorStore {
            spec,
            residual_bits,
            role,
            rows,
            dim,
            page_tokens,
            window,
            pages: Vec::new(),
            ring: None,
            len: 0,
            quantized: 0,
        }
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
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
    fn ring_stride(&self) -> usize {
        self.dim.div_ceil(2) * 2
    }

    /// Tokens of the `k`-th page: one group, doubling up to `page_tokens`, so short contexts
    /// waste little and long ones need few pages (and few dispatches per fetch).
    fn page_size(&self, k: usize) -> usize {
        let g = self.group();
        (g << k.min(20)).min(self.page_tokens).max(g)
    }

    /// The page holding token `t` (window policy), and where it ends.
    fn page_of(&self, t: usize) -> (usize, usize) {
        let i = self
            .pages
            .partition_point(|p| p.start + p.layout.tokens <= t);
        let end = self.pages.get(i).map_or(t, |p| p.start + p.layout.tokens);
        (i, end)
    }

    fn page_layout(&self, tokens: usize) -> Result<GroupLayout> {
        let shape = TensorShape::from_rows(self.rows, tokens, self.dim)?;
        Ok(GroupLayout::new(&shape, &self.spec))
    }

    fn new_page(&self, ctx: &GpuContext, start: usize, tokens: usize) -> Result<Page> {
        let layout = self.page_layout(tokens)?;
        let shape = TensorShape::from_rows(self.rows, tokens, self.dim)?;
        let own_codes = match self.role {
            Role::Anchor => Some(ctx.empty_codes(layout, &shape)?),
            Role::Reuse => None,
        };
        let residual = match (self.role, self.residual_bits) {
            (Role::Reuse, bits) if bits > 0 => {
                let rl = layout.with_bits(bits);
                Some(QuantizedTensor {
                    codes: ctx.empty_codes(rl, &shape)?,
                    params: ctx.empty_params(rl, self.spec.params)?,
                })
            }
            _ => None,
        };
        Ok(Page {
            start,
            params: ctx.empty_params(layout, self.spec.params)?,
            layout,
            own_codes,
            residual,
            blocks: Vec::new(),
        })
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

    /// Allocates, before anything changes, the ring and the pages `t` more tokens need.
    pub fn reserve(&mut self, ctx: &GpuContext, t: usize, reference: bool) -> Result<()> {
        if reference {
            return Ok(());
        }
        let ring = match &self.ring {
            Some(_) => None,
            None => {
                let bytes = (self.rows * self.ring_tokens() * self.ring_stride() * 2) as u64;
                Some(Ring {
                    buffer: ctx.storage_buffer("window", bytes)?,
                    tokens: self.ring_tokens(),
                })
            }
        };
        let (q2, _) = self.window_plan(t);
        let mut fresh = Vec::new();
        let mut start = self.pages.last().map_or(0, |p| p.start + p.layout.tokens);
        while start < q2 {
            let size = self.page_size(self.pages.len() + fresh.len());
            fresh.push(self.new_page(ctx, start, size)?);
            start += size;
        }
        if let Some(r) = ring {
            self.ring = Some(r);
        }
        self.pages.extend(fresh);
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
        p.blocks.push(record);
        Ok(())
    }

    /// The anchor's codes for tokens `[start, start + n)` of page `page`, if it has them.
    fn anchor_page_codes(
        anchor: &TensorStore,
        page: usize,
        start: usize,
        n: usize,
    ) -> Option<PackedCodes> {
        if anchor.quantized < start + n {
            return None;
        }
        anchor.pages.get(page).and_then(|p| p.own_codes.clone())
    }

    /// Window policy: appends `t` tokens of `x` (`[R, t, D]`), quantizing whole groups that
    /// leave the window; a reuse layer shares `anchor`'s codes where it has them.
    /// [`TensorStore::reserve`] must have run.
    pub fn append_window(
        &mut self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        x: &TokenView,
        t: usize,
        anchor: Option<&TensorStore>,
        out: DType,
    ) -> Result<()> {
        let g = self.group();
        let (len, q) = (self.len, self.quantized);
        let len2 = len + t;
        let (q2, s) = self.window_plan(t);
        let ring = self.ring.as_ref().expect("ring reserved");
        let (ring_buf, ring_tokens) = (ring.buffer.clone(), ring.tokens);
        let at = |t0: usize| TokenView { t0, ..*x };
        // 1. Complete the partial group (and the window) from the first new tokens.
        let (rows, dim) = (self.rows, self.dim);
        let target = |t0| RingTarget {
            buffer: &ring_buf,
            tokens: ring_tokens,
            t0,
            rows,
            dim,
        };
        let a1 = s.min(len2) - len;
        if a1 > 0 {
            ctx.encode_window_append(enc, &at(0), a1, &target(len))?;
        }
        // 2. Groups now whole in the window, then 3. groups straight from the input.
        let mut b = q;
        while b < q2 {
            let (page, page_end) = self.page_of(b);
            let from_ring = b < s;
            let end = if from_ring { b + g } else { q2.min(page_end) };
            let codes = anchor.and_then(|a| Self::anchor_page_codes(a, page, b, end - b));
            let ring_view = TokenView {
                buffer: &ring_buf,
                dtype: DType::F16,
                tokens: ring_tokens,
                t0: b % ring_tokens,
                stride: self.ring_stride(),
                to_f16: false,
            };
            let view = if from_ring { ring_view } else { at(b - len) };
            self.encode_block(ctx, enc, &view, page, b, end - b, codes, out)?;
            b = end;
        }
        // 4. The rest of the input stays in the window.
        let keep = s.max(q2);
        if keep < len2 {
            ctx.encode_window_append(enc, &at(keep - len), len2 - keep, &target(keep))?;
        }
        self.len = len2;
        self.quantized = q2;
        Ok(())
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
        let page = self.new_page(ctx, self.len, t)?;
        self.pages.push(page);
        let idx = self.pages.len() - 1;
        let start = self.len;
        self.encode_block(ctx, enc, x, idx, start, t, anchor, out)?;
        self.len += t;
        self.quantized = self.len;
        Ok(())
    }

    /// The own codes of the page written by the last reference-policy call (to publish).
    pub fn last_page_codes(&self) -> Option<PackedCodes> {
        self.pages.last().and_then(|p| p.own_codes.clone())
    }

    /// Records the reconstruction of every token into `out` (`[R, len, D]`).
    pub fn encode_fetch(
        &self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        out: &wgpu::Buffer,
        out_dtype: DType,
    ) -> Result<()> {
        let view = |t0| OutView {
            buffer: out,
            dtype: out_dtype,
            rows: self.rows,
            tokens: self.len,
            dim: self.dim,
            t0,
        };
        for p in &self.pages {
            let mut i = 0;
            while i < p.blocks.len() {
                // Merge consecutive blocks decoded from the same codes.
                let first = &p.blocks[i];
                let mut n = first.n;
                let mut j = i + 1;
                while j < p.blocks.len()
                    && p.blocks[j].shared == first.shared
                    && Arc::ptr_eq(&p.blocks[j].codes.buffer, &first.codes.buffer)
                    && p.blocks[j].t0 == first.t0 + n
                {
                    n += p.blocks[j].n;
                    j += 1;
                }
                let block = Block {
                    page: p.layout,
                    t0: first.t0,
                    n,
                };
                let encoded = Encoded {
                    codes: &first.codes,
                    params: &p.params,
                    residual: if first.shared {
                        p.residual.as_ref()
                    } else {
                        None
                    },
                };
                let source = Source::Block(block, encoded);
                ctx.encode_materialize(enc, &source, &view(p.start + first.t0))?;
                i = j;
            }
        }
        if self.quantized < self.len {
            let ring = self
                .ring
                .as_ref()
                .expect("a window holds tokens only after reserve");
            let source = Source::Ring {
                ring: &ring.buffer,
                ring_tokens: ring.tokens,
                t0: self.quantized,
                n: self.len - self.quantized,
            };
            ctx.encode_materialize(enc, &source, &view(self.quantized))?;
        }
        Ok(())
    }

    /// Accounting: reference formula for quantized blocks, 2 bytes per window element.
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
        accounted += self.window_tokens() as u64 * element_bytes;
        let allocated = self.pages.iter().map(Page::allocated_bytes).sum::<u64>()
            + self.ring.as_ref().map_or(0, |r| r.buffer.size());
        StoreBytes {
            accounted,
            allocated,
            fp16: self.len as u64 * element_bytes,
        }
    }

    /// Bytes of the ring plus the largest page: the most by which allocation may exceed
    /// accounting (pages double, so the unfilled part is at most the largest page).
    pub fn slack_bound(&self) -> u64 {
        let ring = self.ring.as_ref().map_or(0, |r| r.buffer.size());
        let page = self.page_layout(self.page_tokens).map_or(0, |l| {
            let params = (l.cells() * self.spec.params.pair_bytes()) as u64;
            let codes = l.code_bytes() as u64;
            let residual = match self.residual_bits {
                0 => 0,
                b => l.with_bits(b).code_bytes() as u64 + params,
            };
            params + codes + residual
        });
        ring + page
    }

    /// Drops every buffer (shared codes live on while a reuse layer holds them).
    pub fn clear(&mut self) {
        self.pages.clear();
        self.ring = None;
        self.len = 0;
        self.quantized = 0;
    }
}

//! A page: the quantized tokens `[start, start + capacity)` of one layer's keys or values in
//! one buffer, its params, own codes (anchors) and residual (reuse layers) as 256-byte
//! aligned sections; and the records of which codes decode each block of it.

use std::sync::Arc;

use crate::config::{Levels, ParamsPrecision, QuantSpec, TensorShape, ValueAxis};
use crate::error::{Result, XqError};
use crate::gpu::{GpuBuffer, GpuContext, GpuParams, PackedCodes, QuantizedTensor};
use crate::layout::GroupLayout;
use crate::reference::Role;

/// Alignment of the sections of a page buffer (WebGPU's largest storage binding offset
/// alignment, so every section can be bound on its own).
pub(crate) const SECTION_ALIGN: u64 = 256;

fn align(bytes: u64) -> u64 {
    bytes.div_ceil(SECTION_ALIGN) * SECTION_ALIGN
}

/// Codes of one block (page tokens `[t0, t0 + n)`), as recorded in its page.
#[derive(Clone, Debug)]
pub(crate) struct BlockRecord {
    /// Page-relative first token.
    pub t0: usize,
    /// Tokens.
    pub n: usize,
    /// The codes this block decodes with (own, or the anchor's page codes), laid out like
    /// the page.
    pub codes: PackedCodes,
    /// Whether the codes are the anchor's (then a residual applies, when configured).
    pub shared: bool,
}

/// What a page holds, by role.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PageKind {
    pub spec: QuantSpec,
    pub residual_bits: u8,
    pub role: Role,
    pub rows: usize,
    pub dim: usize,
}

impl PageKind {
    pub fn layout(&self, tokens: usize) -> Result<GroupLayout> {
        let shape = TensorShape::from_rows(self.rows, tokens, self.dim)?;
        Ok(GroupLayout::new(&shape, &self.spec))
    }

    /// Byte sizes of a page's sections: params, own codes, residual params, residual codes
    /// (0 where the role has none).
    pub fn sections(&self, layout: &GroupLayout) -> [u64; 4] {
        let params = layout.params_bytes(self.spec.params) as u64;
        let codes = match self.role {
            Role::Anchor => layout.code_bytes() as u64,
            Role::Reuse => 0,
        };
        let (res_params, res_codes) = match (self.role, self.residual_bits) {
            (Role::Reuse, bits) if bits > 0 => (params, layout.with_bits(bits).code_bytes() as u64),
            _ => (0, 0),
        };
        [params, codes, res_params, res_codes]
    }

    /// Bytes of a page of `tokens` tokens.
    pub fn page_bytes(&self, tokens: usize) -> Result<u64> {
        let l = self.layout(tokens)?;
        Ok(self
            .sections(&l)
            .iter()
            .filter(|&&s| s > 0)
            .map(|&s| align(s))
            .sum())
    }
}

/// A run of tokens `[start, start + capacity)` and its buffer.
#[derive(Clone, Debug)]
pub(crate) struct Page {
    pub start: usize,
    pub layout: GroupLayout,
    /// Params, own codes (anchors), residual params and codes, as sections.
    pub buffer: Arc<GpuBuffer>,
    pub params: GpuParams,
    pub own_codes: Option<PackedCodes>,
    /// A reuse layer's own codes for ranges it could not share (their own buffer, allocated
    /// on first use).
    pub fallback_codes: Option<PackedCodes>,
    pub residual: Option<QuantizedTensor>,
    pub blocks: Vec<BlockRecord>,
}

impl Page {
    /// An empty page of `tokens` tokens from `start`.
    pub fn new(ctx: &GpuContext, kind: &PageKind, start: usize, tokens: usize) -> Result<Page> {
        let layout = kind.layout(tokens)?;
        let shape = TensorShape::from_rows(kind.rows, tokens, kind.dim)?;
        let sizes = kind.sections(&layout);
        let mut at = [0u64; 4];
        let mut total = 0;
        for (i, &size) in sizes.iter().enumerate() {
            at[i] = total;
            if size > 0 {
                total += align(size);
            }
        }
        let buffer = ctx.storage_buffer("cache page", total)?;
        let precision = kind.spec.params;
        let own_codes = (sizes[1] > 0)
            .then(|| PackedCodes::section(buffer.clone(), at[1], layout, shape.clone()));
        let residual = (sizes[3] > 0).then(|| {
            let rl = layout.with_bits(kind.residual_bits);
            QuantizedTensor {
                codes: PackedCodes::section(buffer.clone(), at[3], rl, shape.clone()),
                params: GpuParams::section(buffer.clone(), at[2], rl, precision),
            }
        });
        Ok(Page {
            start,
            params: GpuParams::section(buffer.clone(), at[0], layout, precision),
            buffer,
            layout,
            own_codes,
            fallback_codes: None,
            residual,
            blocks: Vec::new(),
        })
    }

    /// Page tokens quantized so far (the blocks are contiguous from 0).
    pub fn filled(&self) -> usize {
        self.blocks.last().map_or(0, |b| b.t0 + b.n)
    }

    pub fn allocated_bytes(&self) -> u64 {
        self.buffer.size() + self.fallback_codes.as_ref().map_or(0, |c| c.buffer.size())
    }

    /// The codes this layer writes itself: an anchor's own section, or (reuse layers) the
    /// fallback buffer, allocated on first use.
    pub fn own_codes(&mut self, ctx: &GpuContext) -> Result<PackedCodes> {
        if let Some(c) = &self.own_codes {
            return Ok(c.clone());
        }
        if self.fallback_codes.is_none() {
            let l = self.layout;
            let shape = TensorShape::from_rows(l.rows, l.tokens, l.dim)?;
            self.fallback_codes = Some(ctx.empty_codes(l, &shape)?);
        }
        Ok(self.fallback_codes.clone().expect("just set"))
    }

    /// Records a block, merging it into the previous one when it continues it with the
    /// same codes.
    pub fn record(&mut self, b: BlockRecord) {
        if let Some(last) = self.blocks.last_mut() {
            if last.shared == b.shared
                && Arc::ptr_eq(&last.codes.buffer, &b.codes.buffer)
                && last.codes.offset == b.codes.offset
                && last.t0 + last.n == b.t0
            {
                last.n += b.n;
                return;
            }
        }
        self.blocks.push(b);
    }

    /// A copy of this page with `tokens` capacity (recorded into `enc`): params, own codes
    /// and residual are moved into the new layout; a shared block points at `anchor` (the
    /// anchor's page of the same tokens and capacity) when given, else its codes are copied
    /// into the new page's own (fallback) codes.
    pub fn grown(
        &self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        kind: &PageKind,
        tokens: usize,
        anchor: Option<&Page>,
    ) -> Result<Page> {
        let mut page = Page::new(ctx, kind, self.start, tokens)?;
        let filled = self.filled();
        if filled == 0 {
            return Ok(page);
        }
        let pair = kind.spec.params.pair_words();
        let (old_params, new_params) = (self.params.bind_parts(), page.params.bind_parts());
        match (kind.spec.levels, kind.spec.params) {
            // Two norms share a word: copy each row's words.
            (Levels::LloydMax, ParamsPrecision::F16) => {
                relayout_norms(enc, &old_params, &new_params, filled)
            }
            // A word per norm, or a word (f16) or two (f32) per (scale, zero) pair.
            (levels, _) => {
                let words = if levels == Levels::LloydMax { 1 } else { pair };
                relayout(enc, &old_params, &new_params, 1, words, 0, filled)
            }
        }
        if let (Some(old), Some(new)) = (&self.residual, &page.residual) {
            relayout(
                enc,
                &old.params.bind_parts(),
                &new.params.bind_parts(),
                1,
                pair,
                0,
                filled,
            );
            let wpg = old.codes.layout.words_per_group();
            relayout(
                enc,
                &old.codes.bind_parts(),
                &new.codes.bind_parts(),
                wpg,
                1,
                0,
                filled,
            );
        }
        let wpg = self.layout.words_per_group();
        for b in &self.blocks {
            let codes = match (b.shared, anchor) {
                (true, Some(a)) => a.own_codes.clone().filter(|c| c.layout == page.layout),
                _ => None,
            };
            let codes = match codes {
                Some(c) => c,
                None => {
                    let own = page.own_codes(ctx)?;
                    relayout(
                        enc,
                        &b.codes.bind_parts(),
                        &own.bind_parts(),
                        wpg,
                        1,
                        b.t0,
                        b.n,
                    );
                    own
                }
            };
            page.record(BlockRecord {
                t0: b.t0,
                n: b.n,
                codes,
                shared: b.shared,
            });
        }
        Ok(page)
    }
}

/// A section of a page buffer as a copy source or target: buffer, byte offset and layout.
pub(crate) struct SectionRef<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub offset: u64,
    pub layout: GroupLayout,
}

impl PackedCodes {
    pub(crate) fn bind_parts(&self) -> SectionRef<'_> {
        SectionRef {
            buffer: &self.buffer,
            offset: self.offset,
            layout: self.layout,
        }
    }
}

impl GpuParams {
    pub(crate) fn bind_parts(&self) -> SectionRef<'_> {
        SectionRef {
            buffer: &self.buffer,
            offset: self.offset,
            layout: self.layout,
        }
    }
}

/// Records copying the cells of tokens `[t0, t0 + n)` from one section to another whose
/// layout differs only in token capacity. A cell holds `words` words per group (codes: words
/// per group; params: 1) of `pair` words each (f32 params: 2).
fn relayout(
    enc: &mut wgpu::CommandEncoder,
    src: &SectionRef,
    dst: &SectionRef,
    words: usize,
    pair: usize,
    t0: usize,
    n: usize,
) {
    let (ls, ld) = (&src.layout, &dst.layout);
    let bytes = |w: usize| (w * 4) as u64;
    match ls.axis {
        ValueAxis::Tokens => {
            // Per row, groups [g0, g1) are contiguous: words ((r*ng + g)*W + w)*D*pair.
            let g0 = t0 / ls.group_size;
            let g1 = (t0 + n).div_ceil(ls.group_size);
            let span = (g1 - g0) * words * ls.dim * pair;
            for r in 0..ls.rows {
                let at = |l: &GroupLayout| ((r * l.n_groups() + g0) * words) * l.dim * pair;
                enc.copy_buffer_to_buffer(
                    src.buffer,
                    src.offset + bytes(at(ls)),
                    dst.buffer,
                    dst.offset + bytes(at(ld)),
                    bytes(span),
                );
            }
        }
        ValueAxis::Channels => {
            // Per (row, channel group, word), tokens are contiguous: O = page tokens.
            for r in 0..ls.rows {
                for g in 0..ls.n_groups() {
                    for w in 0..words {
                        let at = |l: &GroupLayout| {
                            (((r * l.n_groups() + g) * words + w) * l.tokens + t0) * pair
                        };
                        enc.copy_buffer_to_buffer(
                            src.buffer,
                            src.offset + bytes(at(ls)),
                            dst.buffer,
                            dst.offset + bytes(at(ld)),
                            bytes(n * pair),
                        );
                    }
                }
            }
        }
    }
}

/// Copies the f16 norms of tokens `[0, n)` (Lloyd–Max levels, groups along channels) into a
/// page of another size: per row `(r, g)`, its first `ceil(n / 2)` words (rows start words).
fn relayout_norms(enc: &mut wgpu::CommandEncoder, src: &SectionRef, dst: &SectionRef, n: usize) {
    let (ls, ld) = (&src.layout, &dst.layout);
    let words = n.div_ceil(2) as u64;
    for row in 0..ls.rows * ls.n_groups() {
        enc.copy_buffer_to_buffer(
            src.buffer,
            src.offset + 4 * (row * ls.norm_row_words()) as u64,
            dst.buffer,
            dst.offset + 4 * (row * ld.norm_row_words()) as u64,
            4 * words,
        );
    }
}

/// The largest page (a multiple of the group size, at most `cap` when `cap > 0`) whose
/// buffer fits one storage binding of `limit` bytes.
pub(crate) fn max_page_tokens(kind: &PageKind, cap: usize, limit: u64) -> Result<usize> {
    let g = kind.spec.group_size;
    let mut tokens = g;
    let ceiling = if cap > 0 { cap } else { usize::MAX / 4 };
    let fits = |t: usize| kind.page_bytes(t).is_ok_and(|b| b <= limit);
    while tokens * 2 <= ceiling && fits(tokens * 2) {
        tokens *= 2;
    }
    if cap > 0 && tokens < cap && fits(cap) {
        tokens = cap;
    }
    if !fits(tokens) {
        return Err(XqError::TooLarge(format!(
            "one group of {g} tokens does not fit a storage binding of {limit} bytes"
        )));
    }
    Ok(tokens)
}

impl ParamsPrecision {
    /// `u32` words of one (scale, zero) pair.
    pub(crate) fn pair_words(self) -> usize {
        self.pair_bytes() / 4
    }
}

//! What the group kernels read and write: token ranges of dense buffers and blocks of pages.

use crate::config::{DType, ValueAxis};
use crate::error::{shape_err, Result};
use crate::gpu::dispatch::Bind;
use crate::gpu::GpuTensor;
use crate::layout::GroupLayout;

/// The f16 sinks in a ring's buffer, read with its window: `n` tokens at absolute positions
/// `0..n` (a fetch writes them to its output's tokens `0..n`), `[R, slots, D_even / 2]` from
/// word `word` of the buffer (after the ring's slots). `n` 0: none.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct RingSinks {
    pub n: usize,
    pub slots: usize,
    pub word: usize,
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
    pub(crate) fn groups(&self) -> usize {
        match self.page.axis {
            ValueAxis::Tokens => self.n.div_ceil(self.page.group_size),
            ValueAxis::Channels => self.page.n_groups(),
        }
    }

    /// Other-axis length inside the block.
    pub(crate) fn other(&self) -> usize {
        match self.page.axis {
            ValueAxis::Tokens => self.page.dim,
            ValueAxis::Channels => self.n,
        }
    }

    /// Cells (row, group, other index) inside the block: one group each.
    pub(crate) fn cells(&self) -> usize {
        self.page.rows * self.groups() * self.other()
    }
}

/// Fails unless `got` is the layout `want` (codes or params handed in for a tensor).
pub(crate) fn check_layout(what: &str, got: &GroupLayout, want: &GroupLayout) -> Result<()> {
    if got != want {
        return shape_err!("{what}: layout {got:?} does not match the tensor's {want:?}");
    }
    Ok(())
}

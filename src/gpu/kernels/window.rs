//! Host of `wgsl/window.wgsl`: appending tokens to an f16 window ring.

use crate::config::DType;
use crate::error::Result;
use crate::gpu::dispatch::Bind;
use crate::gpu::kernels::rotate::RingRotation;
use crate::gpu::kernels::views::TokenView;
use crate::gpu::mirror::wgsl_struct;
use crate::gpu::pipelines::{Constants, Family, KernelKey, WindowConstants};
use crate::gpu::GpuContext;

wgsl_struct! {
    /// Mirrors `Dims` in `wgsl/window.wgsl`.
    pub(crate) struct WindowDims = Family::Window, "Dims" {
        rows: u32,
        dim: u32,
        n: u32,
        ring_tokens: u32,
        ring_t0: u32,
        x_tokens: u32,
        x_t0: u32,
        grid_x: u32,
    }
}

/// Where appended tokens go: an f16 ring `[rows, tokens, D_even]` (a buffer, or a section of
/// one), first token `t0` (absolute; slot `t0 % tokens`); rotated on the way in when
/// `rotation` says so (a rotated cache's un-rotated inputs).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RingTarget<'a> {
    pub buffer: Bind<'a>,
    pub tokens: usize,
    pub t0: usize,
    pub rows: usize,
    pub dim: usize,
    pub rotation: Option<RingRotation>,
}

impl GpuContext {
    /// Records appending tokens `[x.t0, x.t0 + n)` of `x` to a ring.
    pub(crate) fn encode_window_append(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        x: &TokenView,
        n: usize,
        ring: &RingTarget,
    ) -> Result<()> {
        match ring.rotation {
            Some(_) => self.encode_rotate_into_ring(encoder, &[(x, ring)], n),
            None => self.encode_plain_append(encoder, &[(x, ring)], n),
        }
    }

    /// Records the appends of `writes` (an append's keys, then its values), in one launch
    /// where they agree in everything but their buffers and rotation signs (a decode step:
    /// one token of each row into both rings), else one launch each.
    pub(crate) fn encode_window_appends(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        writes: &[RingWrite],
    ) -> Result<()> {
        if let [k, v] = writes {
            let pair = [(&k.x, &k.ring), (&v.x, &v.ring)];
            match pairable(k, v) {
                Some(Paired::Plain) => return self.encode_plain_append(encoder, &pair, k.n),
                Some(Paired::Rotated) => return self.encode_rotate_into_ring(encoder, &pair, k.n),
                None => {}
            }
        }
        for w in writes {
            self.encode_window_append(encoder, &w.x, w.n, &w.ring)?;
        }
        Ok(())
    }

    /// One launch of `append`: one tensor, or two (`PAIR`) of one shape.
    fn encode_plain_append(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        tensors: &[(&TokenView, &RingTarget)],
        n: usize,
    ) -> Result<()> {
        let (x, ring) = tensors[0];
        let (rows, dim, ring_tokens, ring_t0) = (ring.rows, ring.dim, ring.tokens, ring.t0);
        let pair = tensors.len() == 2;
        let key = KernelKey::new(
            "append",
            Constants::Window(WindowConstants {
                in_f16: x.dtype == DType::F16,
                pair,
            }),
        );
        let words = rows * n * dim.div_ceil(2);
        let grid = self.grid(tensors.len() * words, key.workgroup_size())?;
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
        let mut buffers = vec![(1, x.buffer), (2, ring.buffer)];
        if let [_, (x2, ring2)] = tensors {
            buffers.extend([(3, x2.buffer), (4, ring2.buffer)]);
        }
        self.dispatch(encoder, &key, &dims, &buffers, grid);
        Ok(())
    }
}

/// One append into a ring, recorded later with its pair ([`GpuContext::encode_window_appends`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RingWrite<'a> {
    pub x: TokenView<'a>,
    pub n: usize,
    pub ring: RingTarget<'a>,
}

/// How two ring writes share one launch.
enum Paired {
    /// Neither is rotated: `append` with `PAIR`.
    Plain,
    /// The second is rotated, the first too or copied: `rotate_vectors` with `PAIR`.
    Rotated,
}

/// Whether two writes can share a launch: the same tokens of tensors of one shape and dtype
/// into rings of one shape at one slot; both plain, or the second rotated and the first
/// plain or rotated with the same seed and heads.
fn pairable(a: &RingWrite, b: &RingWrite) -> Option<Paired> {
    let shape = |w: &RingWrite| {
        let (x, r) = (&w.x, &w.ring);
        (
            w.n, x.dtype, x.tokens, x.t0, x.stride, r.tokens, r.t0, r.rows, r.dim,
        )
    };
    if shape(a) != shape(b) {
        return None;
    }
    match (&a.ring.rotation, &b.ring.rotation) {
        (None, None) => Some(Paired::Plain),
        (None, Some(_)) => Some(Paired::Rotated),
        (Some(ra), Some(rb)) if (ra.seed, ra.heads) == (rb.seed, rb.heads) => Some(Paired::Rotated),
        _ => None,
    }
}

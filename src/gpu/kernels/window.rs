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
        if let Some(rotation) = &ring.rotation {
            return self.encode_rotate_into_ring(encoder, x, n, ring, rotation);
        }
        let (rows, dim, ring_tokens, ring_t0) = (ring.rows, ring.dim, ring.tokens, ring.t0);
        let key = KernelKey::new(
            "append",
            Constants::Window(WindowConstants {
                in_f16: x.dtype == DType::F16,
            }),
        );
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
            &dims,
            &[(1, x.buffer), (2, ring.buffer)],
            grid,
        );
        Ok(())
    }
}

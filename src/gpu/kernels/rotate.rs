//! Host of `wgsl/rotate.wgsl`: the randomized Walsh–Hadamard rotation of head vectors (a
//! rotated cache's keys and values as they enter it, the queries that attend over them and
//! the outputs and fetched K/V that leave it).

use crate::config::DType;
use crate::error::{shape_err, Result};
use crate::gpu::mirror::wgsl_struct;
use crate::gpu::pipelines::{Constants, Family, KernelKey, RotateConstants};
use crate::gpu::{GpuContext, GpuTensor};
use crate::reference::{check_rotation_dim, rotation_stream, RotationTarget};

wgsl_struct! {
    /// Mirrors `Dims` in `wgsl/rotate.wgsl`.
    pub(crate) struct RotateDims = Family::Rotate, "Dims" {
        vectors: u32,
        dim: u32,
        head_div: u32,
        heads: u32,
        gqa: u32,
        stream: u32,
        seed: u32,
        grid_x: u32,
    }
}

impl GpuContext {
    /// Records the rotation of every vector of `x` (laid out as `target` says) into `out`
    /// (the same vectors, f32 or f16 each), or of `out` in place when `x` is `None`;
    /// `inverse` undoes it ([`crate::reference::rotate_tensor`] on the CPU).
    pub fn encode_rotate(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        x: Option<&GpuTensor>,
        out: &GpuTensor,
        target: &RotationTarget,
        seed: u32,
        inverse: bool,
    ) -> Result<()> {
        check_rotation_dim(target.dim)?;
        let elements = target.vectors() * target.dim;
        for t in x.into_iter().chain([out]) {
            if t.shape().len() != elements {
                return shape_err!(
                    "rotation of {} vectors of {}: a tensor holds {} elements",
                    target.vectors(),
                    target.dim,
                    t.shape().len()
                );
            }
        }
        if target.gqa == 0 || target.heads % target.gqa != 0 || elements > u32::MAX as usize {
            return shape_err!(
                "rotation: {} heads in groups of {} over {elements} elements",
                target.heads,
                target.gqa
            );
        }
        let key = KernelKey::new(
            "rotate_vectors",
            Constants::Rotate(RotateConstants {
                in_f16: x.is_some_and(|x| x.dtype() == DType::F16),
                out_f16: out.dtype() == DType::F16,
                in_place: x.is_none(),
                inverse,
            }),
        );
        let wg = key.workgroup_size();
        let grid = self.grid(target.vectors() * wg as usize, wg)?;
        let dims = RotateDims {
            vectors: target.vectors() as u32,
            dim: target.dim as u32,
            head_div: if target.token_major {
                1
            } else {
                target.tokens as u32
            },
            heads: target.heads as u32,
            gqa: target.gqa as u32,
            stream: rotation_stream(target.layer, target.kind, 0),
            seed,
            grid_x: grid.x,
        };
        let mut buffers = vec![(2, out.bind())];
        if let Some(x) = x {
            buffers.push((1, x.bind()));
        }
        self.dispatch(encoder, &key, &dims, &buffers, grid);
        Ok(())
    }
}

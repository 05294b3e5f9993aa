//! Host of `wgsl/transpose.wgsl`: a runtime's token-major tensors into the heads-major
//! layout the caches and attention read.

use crate::config::{DType, TensorShape};
use crate::error::{shape_err, Result};
use crate::gpu::mirror::wgsl_struct;
use crate::gpu::pipelines::{Constants, Family, KernelKey, TransposeConstants};
use crate::gpu::{GpuContext, GpuTensor};

wgsl_struct! {
    /// Mirrors `Dims` in `wgsl/transpose.wgsl`.
    pub(crate) struct TransposeDims = Family::Transpose, "Dims" {
        batch: u32,
        tokens: u32,
        heads: u32,
        dim: u32,
        words: u32,
        grid_x: u32,
        _pad0: u32,
        _pad1: u32,
    }
}

impl GpuContext {
    /// Records `x` (`[batch, tokens, heads, dim]`, token-major, as a runtime's projections
    /// write it) copied into a new heads-major tensor `[batch, heads, tokens, dim]` of the
    /// same dtype, bit for bit ([`crate::reference::tokens_to_heads`] on the CPU).
    pub fn encode_tokens_to_heads(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        x: &GpuTensor,
    ) -> Result<GpuTensor> {
        let &[batch, tokens, heads, dim] = x.shape().dims() else {
            return shape_err!(
                "a token-major tensor is [batch, tokens, heads, dim], got {:?}",
                x.shape().dims()
            );
        };
        let out = self.empty_tensor(&TensorShape::new(&[batch, heads, tokens, dim])?, x.dtype())?;
        let elements = batch * tokens * heads * dim;
        let words = match x.dtype() {
            DType::F32 => elements,
            DType::F16 => elements.div_ceil(2),
        };
        let key = KernelKey::new(
            "tokens_to_heads",
            Constants::Transpose(TransposeConstants {
                f16: x.dtype() == DType::F16,
            }),
        );
        let grid = self.grid(words, key.workgroup_size())?;
        let dims = TransposeDims {
            batch: batch as u32,
            tokens: tokens as u32,
            heads: heads as u32,
            dim: dim as u32,
            words: words as u32,
            grid_x: grid.x,
            _pad0: 0,
            _pad1: 0,
        };
        self.dispatch(
            encoder,
            &key,
            &dims,
            &[(1, x.bind()), (2, out.bind())],
            grid,
        );
        Ok(out)
    }
}

//! A rotated plan's boundary: keys and values are rotated as they enter the set (a decode
//! step's as they are written into the ring, longer appends into the set's `rotated`
//! scratch first), queries before they meet rotated keys, and attention outputs
//! and fetched K/V are rotated back (the queries and outputs inside the attention kernels).
//! Everything inside (sinks, window, pages) holds the rotated vectors, from the first call
//! that quantizes tokens of the layer: before it, the sinks and the window hold them as
//! they came and nothing is rotated (a short context costs what an un-rotated plan's does);
//! that call rotates what they hold in place. Every route rotates the f16 rounding of a
//! token (what the window holds), so the set's contents do not depend on the route.

use crate::cache::config::ModelSpec;
use crate::cache::io::Growing;
use crate::cache::plan::CachePlan;
use crate::cache::store::HeldRotation;
use crate::config::{DType, KvKind};
use crate::error::Result;
use crate::gpu::kernels::attention::AttnRotation;
use crate::gpu::kernels::rotate::{RingRotation, RotateLaunch};
use crate::gpu::{GpuContext, GpuTensor, TENSOR_ALIGN};
use crate::reference::{rotation_stream, RotationTarget};

/// The rotations of one layer of a set: where its plan rotates keys or values, the
/// tensors crossing the set's boundary are rotated (in) or rotated back (out).
pub(super) struct LayerRotation<'a> {
    pub ctx: &'a GpuContext,
    pub plan: &'a CachePlan,
    pub model: &'a ModelSpec,
    pub layer: usize,
}

impl LayerRotation<'_> {
    /// Heads-major `[batch, heads, tokens, dim]` K/V of `kind`, if rotated.
    fn kv_target(&self, tokens: usize, kind: KvKind) -> Option<RotationTarget> {
        let source = self.plan.signs_layer(self.layer, kind)?;
        let m = self.model;
        Some(RotationTarget::kv(
            [m.batch, m.kv_heads, tokens, m.head_dim],
            source,
            kind.index(),
        ))
    }

    /// Records the rotation of an append's keys and values (`[batch, kv_heads, t, dim]`)
    /// into `scratch` (f32: the keys, then the values, of those the plan rotates); returns
    /// what the stores take (the inputs themselves where not rotated). The scratch of a call
    /// of several tokens is not kept (a decode step's is).
    pub fn inputs(
        &self,
        enc: &mut wgpu::CommandEncoder,
        scratch: &mut Growing,
        keys: &GpuTensor,
        values: &GpuTensor,
    ) -> Result<[GpuTensor; 2]> {
        let mut out = [keys.clone(), values.clone()];
        let dims = keys.shape().dims().to_vec();
        let t = dims[2];
        let targets = [KvKind::Key, KvKind::Value].map(|k| self.kv_target(t, k));
        if targets.iter().all(Option::is_none) {
            return Ok(out);
        }
        let stride = ((keys.shape().len() * 4) as u64).div_ceil(TENSOR_ALIGN) * TENSOR_ALIGN;
        let sides = targets.iter().flatten().count() as u64;
        let buffer = scratch.get(self.ctx, "rotated inputs", sides * stride)?;
        let seed = self.plan.rotation_seed;
        match &targets {
            // Both rotated, one dtype: one launch.
            [Some(k), Some(v)] if keys.dtype() == values.dtype() => {
                out = self
                    .ctx
                    .encode_rotate_pair(enc, [keys, values], [k, v], &buffer, seed)?;
            }
            _ => {
                let mut at = 0;
                for (i, x) in [keys, values].into_iter().enumerate() {
                    let Some(target) = &targets[i] else { continue };
                    let rotated = GpuTensor::at(buffer.clone(), at, &dims, DType::F32)?;
                    let launch = RotateLaunch {
                        x: Some(x),
                        out: &rotated,
                        target,
                        seed,
                        inverse: false,
                        round_in: true,
                    };
                    self.ctx.encode_rotate_launch(enc, &launch)?;
                    out[i] = rotated;
                    at += stride;
                }
            }
        }
        if t > 1 {
            scratch.release();
        }
        Ok(out)
    }

    /// The rotation of `kind` as a decode step writes it into the ring, if rotated.
    pub fn ring(&self, kind: KvKind) -> Option<RingRotation> {
        let source = self.plan.signs_layer(self.layer, kind)?;
        Some(RingRotation {
            seed: self.plan.rotation_seed,
            stream: rotation_stream(source, kind.index(), 0),
            heads: self.model.kv_heads,
        })
    }

    /// The rotation of `kind`'s held tokens when the layer starts holding rotated ones, if
    /// rotated.
    pub fn held(&self, kind: KvKind) -> Option<HeldRotation> {
        Some(HeldRotation {
            seed: self.plan.rotation_seed,
            signs_layer: self.plan.signs_layer(self.layer, kind)?,
            kind: kind.index(),
            heads: self.model.kv_heads,
        })
    }

    /// What an attention call over the layer folds in when it holds rotated tokens
    /// (`rotated`): its queries rotated with the keys' signs as the kernel loads them, its
    /// output rotated back with the values' as it is written (no launches of their own).
    pub fn attention(&self, rotated: bool) -> AttnRotation {
        if !rotated {
            return AttnRotation::default();
        }
        let stream = |kind: KvKind| {
            self.plan
                .signs_layer(self.layer, kind)
                .map(|source| rotation_stream(source, kind.index(), 0))
        };
        AttnRotation {
            seed: self.plan.rotation_seed,
            keys: stream(KvKind::Key),
            values: stream(KvKind::Value),
        }
    }

    /// Records the un-rotation, in place, of fetched keys or values (`[batch, kv_heads,
    /// len, dim]`).
    pub fn fetched(
        &self,
        enc: &mut wgpu::CommandEncoder,
        kind: KvKind,
        x: &GpuTensor,
    ) -> Result<()> {
        let Some(target) = self.kv_target(x.shape().dims()[2], kind) else {
            return Ok(());
        };
        let seed = self.plan.rotation_seed;
        self.ctx.encode_rotate(enc, None, x, &target, seed, true)
    }
}

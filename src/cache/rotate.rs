//! A rotated plan's boundary: keys and values are rotated as they enter the set, queries
//! before they meet rotated keys, and attention outputs and fetched K/V are rotated back.
//! Everything inside (sinks, window, pages) holds the rotated vectors.

use crate::cache::config::ModelSpec;
use crate::cache::io::Growing;
use crate::cache::plan::CachePlan;
use crate::config::{DType, KvKind};
use crate::error::Result;
use crate::gpu::{GpuContext, GpuTensor, TENSOR_ALIGN};
use crate::reference::RotationTarget;

/// The scratch of a rotated plan: rotated inputs and queries, and attention outputs set
/// aside before their un-rotation (a separate buffer: one dispatch reads the queries and
/// writes the output).
#[derive(Clone, Default)]
pub(crate) struct RotationScratch {
    inputs: Growing,
    out: Growing,
}

impl RotationScratch {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.inputs.bytes() + self.out.bytes()
    }

    /// Drops the buffers.
    pub fn clear(&mut self) {
        self.inputs.clear();
        self.out.clear();
    }

    /// Lets a multi-token call's buffers go (work recorded with them still reads them).
    fn release(&mut self) {
        self.inputs.release();
        self.out.release();
    }
}

/// What an attention call over a rotated layer reads and writes instead of the caller's
/// tensors: its queries rotated (when the keys are), and an f32 output to un-rotate into the
/// caller's f16 one (when the values are: rounded to f16 once, after the rotation).
#[derive(Default)]
pub(super) struct RotatedAttend {
    pub queries: Option<GpuTensor>,
    pub out: Option<GpuTensor>,
}

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
        Some(RotationTarget {
            batch: self.model.batch,
            heads: self.model.kv_heads,
            tokens,
            dim: self.model.head_dim,
            token_major: false,
            gqa: 1,
            layer: source,
            kind: kind.index(),
        })
    }

    /// `heads` query heads (or their outputs) of `tokens` tokens read against `kind`.
    fn query_target(
        &self,
        heads: usize,
        tokens: usize,
        token_major: bool,
        kind: KvKind,
    ) -> Option<RotationTarget> {
        Some(RotationTarget {
            heads,
            token_major,
            gqa: heads / self.model.kv_heads,
            ..self.kv_target(tokens, kind)?
        })
    }

    /// Records the rotation of an append's keys and values (`[batch, kv_heads, t, dim]`)
    /// into `scratch` (f32, keys then values) where the plan rotates them; returns what the
    /// stores take (the inputs themselves where not rotated). The scratch of a call of
    /// several tokens is not kept (a decode step's is).
    pub fn inputs(
        &self,
        enc: &mut wgpu::CommandEncoder,
        scratch: &mut RotationScratch,
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
        let buffer = scratch.inputs.get(self.ctx, "rotated inputs", 2 * stride)?;
        let seed = self.plan.rotation_seed;
        match &targets {
            // Both rotated, one dtype: one launch.
            [Some(k), Some(v)] if keys.dtype() == values.dtype() => {
                out = self
                    .ctx
                    .encode_rotate_pair(enc, [keys, values], [k, v], &buffer, seed)?;
            }
            _ => {
                for (i, x) in [keys, values].into_iter().enumerate() {
                    let Some(target) = &targets[i] else { continue };
                    let at = i as u64 * stride;
                    let rotated = GpuTensor::at(buffer.clone(), at, &dims, DType::F32)?;
                    self.ctx
                        .encode_rotate(enc, Some(x), &rotated, target, seed, false)?;
                    out[i] = rotated;
                }
            }
        }
        if t > 1 {
            scratch.release();
        }
        Ok(out)
    }

    /// Records the rotation of the queries (`[batch, q_heads, t, dim]`) of an attention
    /// call into `scratch` (f32) when the keys are rotated, and sets aside an f32 output
    /// when the values are and `out` is f16.
    pub fn queries(
        &self,
        enc: &mut wgpu::CommandEncoder,
        scratch: &mut RotationScratch,
        queries: &GpuTensor,
        out: &GpuTensor,
    ) -> Result<RotatedAttend> {
        let dims = queries.shape().dims().to_vec();
        let (heads, t) = (dims[1], dims[2]);
        let keys = self.query_target(heads, t, false, KvKind::Key);
        let staged =
            self.plan.signs_layer(self.layer, KvKind::Value).is_some() && out.dtype() == DType::F16;
        let mut r = RotatedAttend::default();
        if let Some(target) = &keys {
            let bytes = (queries.shape().len() * 4) as u64;
            let buffer = scratch.inputs.get(self.ctx, "rotated queries", bytes)?;
            let rotated = GpuTensor::on(buffer, &dims, DType::F32)?;
            let seed = self.plan.rotation_seed;
            self.ctx
                .encode_rotate(enc, Some(queries), &rotated, target, seed, false)?;
            r.queries = Some(rotated);
        }
        if staged {
            let bytes = (out.shape().len() * 4) as u64;
            let buffer = scratch
                .out
                .get(self.ctx, "attention output to un-rotate", bytes)?;
            r.out = Some(GpuTensor::on(buffer, out.shape().dims(), DType::F32)?);
        }
        if t > 1 {
            scratch.release();
        }
        Ok(r)
    }

    /// Records the un-rotation of an attention output (`[batch, q_heads, t, dim]`, or
    /// token-major) into `out` when the values are rotated: from the f32 output set aside
    /// (`staged`), or in place.
    pub fn output(
        &self,
        enc: &mut wgpu::CommandEncoder,
        staged: Option<&GpuTensor>,
        out: &GpuTensor,
        (heads, tokens, token_major): (usize, usize, bool),
    ) -> Result<()> {
        let Some(target) = self.query_target(heads, tokens, token_major, KvKind::Value) else {
            return Ok(());
        };
        let seed = self.plan.rotation_seed;
        self.ctx
            .encode_rotate(enc, staged, out, &target, seed, true)
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

//! What goes in and out of `update_and_fetch`, shared by the XQuant and f16 cache sets:
//! input checks and uploads, and the reused output buffers.

use std::sync::Arc;

use crate::cache::config::ModelSpec;
use crate::config::{check_values, DType, ParamsPrecision};
use half::f16;

use crate::error::{shape_err, Result, XqError};
use crate::gpu::kernels::attention::{AttnCall, AttnSource};
use crate::gpu::{GpuBuffer, GpuContext, GpuTensor};

/// New keys or values for `update_and_fetch`, `[batch, kv_heads, tokens, head_dim]`.
#[derive(Clone, Copy, Debug)]
pub enum KvInput<'a> {
    /// Host f32 values.
    F32(&'a [f32]),
    /// Host IEEE half bit patterns.
    F16(&'a [u16]),
    /// A tensor already on this device (f32 or f16). GPU-resident values are not checked
    /// for NaN/Inf: that would need a readback per call.
    Gpu(&'a GpuTensor),
}

/// The reconstructed K/V of every token so far, `[batch, kv_heads, tokens, head_dim]`.
///
/// Both tensors live in buffers the set reuses: they hold this layer's result until the next
/// `update_and_fetch` call of the set (any layer) is submitted. Read or consume them before.
#[derive(Clone, Debug)]
pub struct Fetched {
    /// Reconstructed keys.
    pub keys: GpuTensor,
    /// Reconstructed values.
    pub values: GpuTensor,
    /// Tokens in the layer's cache.
    pub tokens: usize,
}

/// An input on the GPU: uploaded from the host, or the caller's tensor.
pub(crate) enum OnGpu<'a> {
    Uploaded(GpuTensor),
    Borrowed(&'a GpuTensor),
}

impl OnGpu<'_> {
    pub fn tensor(&self) -> &GpuTensor {
        match self {
            OnGpu::Uploaded(t) => t,
            OnGpu::Borrowed(t) => t,
        }
    }

    /// The tensor, owned (a borrowed one is a second handle on the same buffer).
    #[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
    pub fn into_tensor(self) -> GpuTensor {
        match self {
            OnGpu::Uploaded(t) => t,
            OnGpu::Borrowed(t) => t.clone(),
        }
    }
}

/// Checked keys and values of one call.
pub(crate) struct Inputs<'a> {
    pub keys: OnGpu<'a>,
    pub values: OnGpu<'a>,
}

fn tokens_of(model: &ModelSpec, input: &KvInput, what: &str) -> Result<usize> {
    let per_token = model.rows() * model.head_dim;
    let (len, dims) = match input {
        KvInput::F32(v) => (v.len(), None),
        KvInput::F16(v) => (v.len(), None),
        KvInput::Gpu(t) => (t.shape().len(), Some(t.shape().dims().to_vec())),
    };
    if len == 0 || len % per_token != 0 {
        return shape_err!(
            "{what}: {len} elements are not [batch {}, kv_heads {}, tokens, head_dim {}] with tokens >= 1",
            model.batch,
            model.kv_heads,
            model.head_dim
        );
    }
    let t = len / per_token;
    if let Some(d) = dims {
        if d != [model.batch, model.kv_heads, t, model.head_dim] {
            return shape_err!(
                "{what}: GPU tensor {d:?} is not [{}, {}, {t}, {}]",
                model.batch,
                model.kv_heads,
                model.head_dim
            );
        }
    }
    Ok(t)
}

fn to_gpu<'a>(
    ctx: &GpuContext,
    input: KvInput<'a>,
    dims: &[usize],
    what: &str,
    params: ParamsPrecision,
) -> Result<OnGpu<'a>> {
    Ok(match input {
        KvInput::F32(v) => {
            check_values(v, params, what)?;
            // A cache holds f16 K/V: host values travel (and are checked) as halves.
            if let Some(i) = v.iter().position(|x| x.abs() > f16::MAX.to_f32()) {
                return Err(XqError::NonFinite(format!(
                    "{what}: element {i} = {} exceeds f16's range",
                    v[i]
                )));
            }
            OnGpu::Uploaded(ctx.upload(v, dims, DType::F16, params)?)
        }
        KvInput::F16(v) => OnGpu::Uploaded(ctx.upload_f16(v, dims, params)?),
        KvInput::Gpu(t) => OnGpu::Borrowed(t),
    })
}

impl<'a> Inputs<'a> {
    /// Checks shapes (keys and values agree) and values, and uploads host data.
    pub fn prepare(
        ctx: &GpuContext,
        model: &ModelSpec,
        params: ParamsPrecision,
        keys: KvInput<'a>,
        values: KvInput<'a>,
    ) -> Result<Inputs<'a>> {
        let t = tokens_of(model, &keys, "keys")?;
        let tv = tokens_of(model, &values, "values")?;
        if t != tv {
            return shape_err!("keys have {t} tokens, values {tv}");
        }
        let dims = [model.batch, model.kv_heads, t, model.head_dim];
        Ok(Inputs {
            keys: to_gpu(ctx, keys, &dims, "keys", params)?,
            values: to_gpu(ctx, values, &dims, "values", params)?,
        })
    }
}

/// A scratch buffer grown by doubling (attention partials); a replaced buffer lives on in
/// any checkpoint that holds it until its submission is done.
#[derive(Clone, Default)]
pub(crate) struct Growing {
    buffer: Option<Arc<GpuBuffer>>,
}

impl Growing {
    /// A buffer of at least `bytes`. A buffer it replaces is let go without being destroyed:
    /// work recorded with it (earlier in the same pass) may not be submitted yet.
    pub fn get(&mut self, ctx: &GpuContext, label: &str, bytes: u64) -> Result<Arc<GpuBuffer>> {
        match &self.buffer {
            Some(b) if b.size() >= bytes => Ok(b.clone()),
            old => {
                let doubled = old.as_ref().map_or(0, |b| b.size() * 2);
                let size = doubled.min(ctx.max_binding_bytes()).max(bytes);
                let b = ctx.storage_buffer(label, size)?;
                if let Some(old) = self.buffer.replace(b.clone()) {
                    old.detach();
                }
                Ok(b)
            }
        }
    }

    /// Records `call`'s attention over `sources`, with partials from this buffer (grown as
    /// needed; none when the call writes its output directly). The partials of a call of
    /// several query tokens (a prefill's: up to one slot per token and chunk) are not kept:
    /// the buffer is let go (detached, so work recorded but not yet submitted still reads it)
    /// and a decode step allocates its own small one.
    pub fn encode_attention(
        &mut self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        call: &AttnCall,
        sources: &[AttnSource],
    ) -> Result<()> {
        let partials = match ctx.attention_partials_bytes(call, sources)? {
            0 => None,
            bytes => Some(self.get(ctx, "attention partials", bytes)?),
        };
        ctx.encode_attention(enc, call, sources, partials.as_deref().map(|b| &**b))?;
        if call.q_tokens > 1 {
            self.release();
        }
        Ok(())
    }

    /// Lets the buffer go without destroying it (work recorded but not yet submitted still
    /// reads it): a multi-token call's scratch is not kept.
    pub fn release(&mut self) {
        if let Some(b) = self.buffer.take() {
            b.detach();
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.buffer.as_ref().map_or(0, |b| b.size())
    }

    /// Drops the buffer.
    pub fn clear(&mut self) {
        self.buffer = None;
    }
}

/// Checks GPU keys and values are `[batch, kv_heads, t, head_dim]` with the same `t`;
/// returns `t`.
pub(crate) fn check_kv_pair(
    model: &ModelSpec,
    keys: &GpuTensor,
    values: &GpuTensor,
) -> Result<usize> {
    let t = check_kv_tensor(model, keys, "keys")?;
    let tv = check_kv_tensor(model, values, "values")?;
    if t != tv {
        return shape_err!("keys have {t} tokens, values {tv}");
    }
    Ok(t)
}

/// Checks a GPU K/V input is `[batch, kv_heads, t, head_dim]`; returns `t`.
pub(crate) fn check_kv_tensor(model: &ModelSpec, x: &GpuTensor, what: &str) -> Result<usize> {
    let d = x.shape().dims();
    if d.len() != 4
        || d[0] != model.batch
        || d[1] != model.kv_heads
        || d[3] != model.head_dim
        || d[2] == 0
    {
        return shape_err!(
            "{what}: {d:?} is not [batch {}, kv_heads {}, tokens >= 1, head_dim {}]",
            model.batch,
            model.kv_heads,
            model.head_dim
        );
    }
    Ok(d[2])
}

/// Refuses `t` more tokens for a layer holding `len` when that would pass `max_ctx`.
pub(crate) fn check_budget(layer: usize, len: usize, t: usize, max_ctx: usize) -> Result<()> {
    if len + t > max_ctx {
        return Err(XqError::ContextBudget(format!(
            "layer {layer}: {len} + {t} tokens would exceed max_ctx = {max_ctx}"
        )));
    }
    Ok(())
}

/// The two output buffers (keys, values) a set reuses across calls, grown by doubling.
#[derive(Clone, Default)]
pub(crate) struct Scratch {
    buffers: [Option<Arc<GpuBuffer>>; 2],
}

impl Scratch {
    /// Output buffers for `[rows, tokens, dim]` of `dtype`.
    pub fn get(
        &mut self,
        ctx: &GpuContext,
        rows: usize,
        tokens: usize,
        dim: usize,
        dtype: DType,
    ) -> Result<[Arc<GpuBuffer>; 2]> {
        let bytes = ((rows * tokens * dim * dtype.size()).div_ceil(4) * 4) as u64;
        let mut out = Vec::with_capacity(2);
        for slot in &mut self.buffers {
            let buffer = match slot {
                Some(b) if b.size() >= bytes => b.clone(),
                old => {
                    let doubled = old.as_ref().map_or(0, |b| b.size() * 2);
                    let size = doubled.min(ctx.max_binding_bytes()).max(bytes);
                    let b = ctx.storage_buffer("fetched K/V", size)?;
                    *old = Some(b.clone());
                    b
                }
            };
            out.push(buffer);
        }
        Ok([out[0].clone(), out[1].clone()])
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.buffers.iter().flatten().map(|b| b.size()).sum()
    }

    /// Drops both buffers.
    pub fn clear(&mut self) {
        self.buffers = [None, None];
    }
}

/// Wraps the two output buffers as `[batch, kv_heads, tokens, head_dim]` tensors.
pub(crate) fn fetched(
    model: &ModelSpec,
    buffers: [Arc<GpuBuffer>; 2],
    tokens: usize,
    dtype: DType,
) -> Result<Fetched> {
    let dims = [model.batch, model.kv_heads, tokens, model.head_dim];
    let [k, v] = buffers;
    Ok(Fetched {
        keys: GpuTensor::on(k, &dims, dtype)?,
        values: GpuTensor::on(v, &dims, dtype)?,
        tokens,
    })
}

//! `xquant attend`: replay a K/V dump through a cache set, then attend given queries to
//! every layer as the next decode step, through the fused kernels (and, to compare, through
//! `fetch` and plain attention).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{json, Value};

use crate::analysis::cache_replay::fill;
use crate::cache::{AttendOptions, CacheOptions, CachePlan, KvCache};
use crate::config::{DType, KvKind, ParamsPrecision};
use crate::error::{shape_err, Result};
use crate::gpu::{GpuContext, GpuTensor, TENSOR_ALIGN};
use crate::kvfile::{FileDType, KvFile, Tensor};
use crate::reference::{attention, AttentionShape};

/// One layer's attention.
#[derive(Clone, Debug)]
pub struct AttendLayer {
    /// Tokens the layer holds.
    pub tokens: usize,
    /// Of which quantized (the rest are in the f16 window).
    pub quantized: usize,
    /// `attn.{i}` through the fused kernels, `[B, query_heads, T, D]`.
    pub fused: Tensor,
    /// The same through `fetch` + plain attention, when asked for.
    pub dense: Option<Tensor>,
}

impl AttendLayer {
    /// max |fused - dense| (when both were computed).
    pub fn max_abs_diff(&self) -> Option<f64> {
        self.dense.as_ref().map(|d| {
            d.data
                .iter()
                .zip(&self.fused.data)
                .map(|(a, b)| (a - b).abs() as f64)
                .fold(0.0, f64::max)
        })
    }

    /// The layer's object in `attend --json`.
    pub fn to_json(&self, layer: usize) -> Value {
        json!({
            "layer": layer,
            "tokens": self.tokens,
            "quantized_tokens": self.quantized,
            "window_tokens": self.tokens - self.quantized,
            "query_shape": self.fused.shape,
            "max_abs_diff_fused_dense": self.max_abs_diff(),
        })
    }
}

/// The queries of every layer (`q.{i}`, `[B, query_heads, T, D]`) checked against `kv`.
fn layer_queries<'a>(
    kv: &KvFile,
    queries: &'a BTreeMap<String, Tensor>,
) -> Result<Vec<&'a Tensor>> {
    let dims = kv.shape.dims();
    let (b, h, d) = (dims[0], dims[1], dims[3]);
    (0..kv.layers.len())
        .map(|i| {
            let name = format!("q.{i}");
            let Some(q) = queries.get(&name) else {
                return shape_err!("the queries file has no {name} (one q.{{i}} per layer)");
            };
            let s = &q.shape;
            if s.len() != 4 || s[0] != b || s[3] != d || s[1] == 0 || s[1] % h != 0 || s[2] == 0 {
                return shape_err!(
                    "{name}: shape {s:?} is not [batch {b}, query_heads (a multiple of {h}), \
                     tokens >= 1, head_dim {d}]"
                );
            }
            Ok(q)
        })
        .collect()
}

/// Replays `kv` through a cache set ([`fill`]: a prefill of `prefill`, then one token per
/// call) and attends every layer's queries as the next decode step: query token `t` sits
/// after every cached token and sees them all.
pub async fn attend_replay(
    ctx: &Arc<GpuContext>,
    kv: &KvFile,
    queries: &BTreeMap<String, Tensor>,
    plan: &CachePlan,
    options: CacheOptions,
    prefill: usize,
    dense: bool,
) -> Result<Vec<AttendLayer>> {
    let qs = layer_queries(kv, queries)?;
    let mut set = fill(ctx, kv, plan, options, prefill).await?;
    let stats = set.stats();
    let m = *set.model();
    let seq = kv.shape.tokens();
    let mut out = Vec::with_capacity(qs.len());
    for (layer, q) in qs.into_iter().enumerate() {
        let dtype = match q.dtype {
            FileDType::F16 => DType::F16,
            _ => DType::F32,
        };
        let queries = ctx.upload(&q.data, &q.shape, dtype, ParamsPrecision::F32)?;
        let result = ctx.upload(
            &vec![0.0; q.data.len()],
            &q.shape,
            DType::F32,
            ParamsPrecision::F32,
        )?;
        let options = AttendOptions {
            pos0: Some(seq),
            ..Default::default()
        };
        set.attend_with(layer, &queries, &result, options).await?;
        let fused = Tensor {
            shape: q.shape.clone(),
            dtype: FileDType::F32,
            data: ctx.read_f32(&result).await?,
        };
        let dense = match dense {
            false => None,
            true => {
                let f = set.fetch(layer).await?;
                let k = ctx.read_f32(&f.keys).await?;
                let v = ctx.read_f32(&f.values).await?;
                let shape = AttentionShape {
                    batch: m.batch,
                    q_heads: q.shape[1],
                    kv_heads: m.kv_heads,
                    q_tokens: q.shape[2],
                    kv_tokens: seq,
                    dim: m.head_dim,
                };
                let scale = 1.0 / (m.head_dim as f32).sqrt();
                Some(Tensor {
                    shape: q.shape.clone(),
                    dtype: FileDType::F32,
                    data: attention(&q.data, &k, &v, shape, seq, scale)?,
                })
            }
        };
        let s = &stats.layers[layer];
        out.push(AttendLayer {
            tokens: s.tokens,
            quantized: s.tokens - s.window_tokens,
            fused,
            dense,
        });
    }
    Ok(out)
}

/// Queries of a layer's last `n` captured tokens: `q` `[B, query_heads, T, D]` sliced to
/// `[B, query_heads, n, D]`.
fn last_queries(q: &Tensor, n: usize) -> Tensor {
    let (t, d) = (q.shape[2], q.shape[3]);
    let n = n.min(t);
    let data = q
        .data
        .chunks_exact(t * d)
        .flat_map(|row| row[(t - n) * d..].iter().copied())
        .collect();
    Tensor {
        shape: vec![q.shape[0], q.shape[1], n, d],
        dtype: FileDType::F32,
        data,
    }
}

/// How many of a capture's last queries judge a plan's attention (`xquant plan`, the
/// package's `suggestPlan`).
pub const PROBE_QUERIES: usize = 64;

/// What a cache's attention is judged against: the last captured queries of every layer and
/// plain attention (f64) of them over the captured K/V, as the next decode step.
pub struct AttentionProbe {
    queries: Vec<Tensor>,
    reference: Vec<Vec<f32>>,
}

impl AttentionProbe {
    /// The last `last` queries (`q.{i}`) of a capture and their reference outputs.
    pub fn new(kv: &KvFile, queries: &BTreeMap<String, Tensor>, last: usize) -> Result<Self> {
        let seq = kv.shape.tokens();
        let (b, h, d) = (kv.shape.dims()[0], kv.shape.dims()[1], kv.shape.dim());
        let scale = 1.0 / (d as f32).sqrt();
        let mut probe = AttentionProbe {
            queries: Vec::new(),
            reference: Vec::new(),
        };
        for (layer, q) in layer_queries(kv, queries)?.into_iter().enumerate() {
            let q = last_queries(q, last);
            let shape = AttentionShape {
                batch: b,
                q_heads: q.shape[1],
                kv_heads: h,
                q_tokens: q.shape[2],
                kv_tokens: seq,
                dim: d,
            };
            let k = kv.tokens(layer, KvKind::Key, 0, seq);
            let v = kv.tokens(layer, KvKind::Value, 0, seq);
            probe
                .reference
                .push(attention(&q.data, &k, &v, shape, seq, scale)?);
            probe.queries.push(q);
        }
        Ok(probe)
    }

    /// The attention-output error of `plan`: the capture's K/V go into the plan's cache set
    /// (as one prefill: the window, sinks and quantized groups end as decode leaves them),
    /// then the probe's queries attend it as the next decode step through the fused kernels.
    /// Per layer the relative squared error `Σ (out − ref)² / Σ ref²` (their sum is the
    /// plan's score): what the model feels from a cache — softmax weights, the f16 window and
    /// sinks as the plan keeps them — rather than the K/V's own error.
    pub async fn errors(
        &self,
        ctx: &Arc<GpuContext>,
        kv: &KvFile,
        plan: &CachePlan,
    ) -> Result<Vec<f64>> {
        let seq = kv.shape.tokens();
        let options = CacheOptions {
            max_ctx: seq,
            ..Default::default()
        };
        let mut set = fill(ctx, kv, plan, options, seq).await?;
        // Every layer's attention in one submission, into one buffer read back once (each
        // layer's output at a binding-aligned offset).
        let stride = |q: &Tensor| (q.data.len() as u64 * 4).next_multiple_of(TENSOR_ALIGN);
        let total: u64 = self.queries.iter().map(stride).sum();
        let out = ctx.storage_buffer("attention probe outputs", total)?;
        let mut launches = Vec::with_capacity(self.queries.len());
        let mut offset = 0;
        for q in &self.queries {
            let queries = ctx.upload(&q.data, &q.shape, DType::F32, ParamsPrecision::F32)?;
            let result = GpuTensor::at(out.clone(), offset, &q.shape, DType::F32)?;
            launches.push((queries, result, offset));
            offset += stride(q);
        }
        let options = AttendOptions {
            pos0: Some(seq),
            ..Default::default()
        };
        ctx.run("attention probe", |enc| {
            for (layer, (queries, result, _)) in launches.iter().enumerate() {
                set.encode_attend(enc, layer, queries, result, &options)?;
            }
            Ok(())
        })
        .await?;
        let bytes = ctx.read_bytes(&out, total).await?;
        let mut errors = Vec::with_capacity(self.queries.len());
        for ((_, _, offset), want) in launches.iter().zip(&self.reference) {
            let at = *offset as usize;
            let got: &[f32] = bytemuck::cast_slice(&bytes[at..at + want.len() * 4]);
            let (mut err, mut norm) = (0f64, 0f64);
            for (g, w) in got.iter().zip(want) {
                err += ((g - w) as f64).powi(2);
                norm += (*w as f64).powi(2);
            }
            errors.push(err / norm.max(f64::MIN_POSITIVE));
        }
        Ok(errors)
    }
}

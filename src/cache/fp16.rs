//! A plain f16 KV cache with the same interface as [`CacheSet`](crate::cache::CacheSet):
//! the baseline for benchmarks and for quality comparisons. Each layer's keys and values live
//! in `[R, capacity, D_even]` f16 buffers that double (copying history) when full.

use std::sync::Arc;

use crate::cache::config::ModelSpec;
use crate::cache::io::{check_budget, fetched, Fetched, Inputs, KvInput, Scratch};
use crate::config::{DType, ParamsPrecision};
use crate::error::{shape_err, Result, XqError};
use crate::gpu::kernels::quant::{OutView, RingTarget, Source};
use crate::gpu::{GpuBuffer, GpuContext};

/// Smallest capacity a layer starts with.
const MIN_CAPACITY: usize = 64;

#[derive(Default)]
struct Fp16Store {
    buffer: Option<Arc<GpuBuffer>>,
    capacity: usize,
}

struct Fp16Layer {
    key: Fp16Store,
    value: Fp16Store,
    len: usize,
}

/// Records copying a layer's `len` tokens into the two output buffers.
fn encode_fetch(
    ctx: &GpuContext,
    enc: &mut wgpu::CommandEncoder,
    l: &Fp16Layer,
    len: usize,
    m: &ModelSpec,
    out: DType,
    outputs: &[Arc<GpuBuffer>; 2],
) -> Result<()> {
    for (store, output) in [(&l.key, &outputs[0]), (&l.value, &outputs[1])] {
        let buffer = store
            .buffer
            .as_ref()
            .ok_or_else(|| XqError::Gpu("f16 cache buffer missing".into()))?;
        let source = Source::Ring {
            ring: buffer,
            ring_tokens: store.capacity,
            t0: 0,
            n: len,
        };
        let view = OutView {
            buffer: output,
            dtype: out,
            rows: m.rows(),
            tokens: len,
            dim: m.head_dim,
            t0: 0,
        };
        ctx.encode_materialize(enc, &source, &view)?;
    }
    Ok(())
}

/// One f16 cache per layer: appends and fetches, no quantization.
pub struct Fp16CacheSet {
    ctx: Arc<GpuContext>,
    model: ModelSpec,
    max_ctx: usize,
    output: DType,
    layers: Vec<Fp16Layer>,
    scratch: Scratch,
}

impl Fp16CacheSet {
    /// Caches for `model`, each holding at most `max_ctx` tokens, fetched as `output`.
    pub fn for_model(
        ctx: Arc<GpuContext>,
        model: ModelSpec,
        max_ctx: usize,
        output: DType,
    ) -> Result<Self> {
        model.validate()?;
        if max_ctx == 0 {
            return Err(XqError::Config("max_ctx must be >= 1".into()));
        }
        let layers = (0..model.layers)
            .map(|_| Fp16Layer {
                key: Fp16Store::default(),
                value: Fp16Store::default(),
                len: 0,
            })
            .collect();
        Ok(Fp16CacheSet {
            ctx,
            model,
            max_ctx,
            output,
            layers,
            scratch: Scratch::default(),
        })
    }

    fn stride(&self) -> usize {
        self.model.head_dim.div_ceil(2) * 2
    }

    /// Tokens held by `layer`.
    pub fn tokens(&self, layer: usize) -> usize {
        self.layers.get(layer).map_or(0, |l| l.len)
    }

    /// Appends and returns every token so far (see [`CacheSet::update_and_fetch`](crate::cache::CacheSet::update_and_fetch)).
    pub async fn update_and_fetch(
        &mut self,
        layer: usize,
        keys: KvInput<'_>,
        values: KvInput<'_>,
    ) -> Result<Fetched> {
        self.ctx.check()?;
        if layer >= self.layers.len() {
            return shape_err!(
                "layer {layer} does not exist (the set has {})",
                self.layers.len()
            );
        }
        let inputs = Inputs::prepare(&self.ctx, &self.model, ParamsPrecision::F32, keys, values)?;
        let t = inputs.tokens;
        let len = self.layers[layer].len;
        check_budget(layer, len, t, self.max_ctx)?;
        let (m, stride, out) = (self.model, self.stride(), self.output);
        let outputs = self
            .scratch
            .get(&self.ctx, m.rows(), len + t, m.head_dim, out)?;
        let want = (len + t).max(MIN_CAPACITY);
        let ctx = self.ctx.clone();
        let l = &mut self.layers[layer];
        // Grow (allocations first, so a failure changes nothing).
        let mut grown = Vec::new();
        // Buffers a growth replaces stay alive until the copy out of them is submitted.
        let mut retired = Vec::new();
        for store in [&l.key, &l.value] {
            grown.push(if store.capacity >= len + t {
                None
            } else {
                let cap = want.max(store.capacity * 2).min(self.max_ctx.max(want));
                let bytes = (m.rows() * cap * stride * 2) as u64;
                Some((ctx.storage_buffer("f16 cache", bytes)?, cap))
            });
        }
        ctx.run("f16 update_and_fetch", |enc| {
            for ((store, input), fresh) in [
                (&mut l.key, inputs.keys.tensor()),
                (&mut l.value, inputs.values.tensor()),
            ]
            .into_iter()
            .zip(grown)
            {
                if let Some((buffer, cap)) = fresh {
                    if let Some(old) = &store.buffer {
                        for r in 0..m.rows() {
                            let (src, dst) =
                                (r * store.capacity * stride * 2, r * cap * stride * 2);
                            enc.copy_buffer_to_buffer(
                                old,
                                src as u64,
                                &buffer,
                                dst as u64,
                                (len * stride * 2) as u64,
                            );
                        }
                    }
                    retired.extend(store.buffer.replace(buffer));
                    store.capacity = cap;
                }
                let buffer = store
                    .buffer
                    .as_ref()
                    .ok_or_else(|| XqError::Gpu("f16 cache buffer missing".into()))?;
                let target = RingTarget {
                    buffer,
                    tokens: store.capacity,
                    t0: len,
                    rows: m.rows(),
                    dim: m.head_dim,
                };
                ctx.encode_window_append(enc, &input.view(), t, &target)?;
            }
            encode_fetch(&ctx, enc, l, len + t, &m, out, &outputs)?;
            Ok(())
        })
        .await?;
        drop(retired);
        l.len = len + t;
        fetched(&m, outputs, len + t, out)
    }

    /// Every token `layer` holds (at least one), without appending.
    pub async fn fetch(&mut self, layer: usize) -> Result<Fetched> {
        let len = self.tokens(layer);
        if len == 0 {
            return shape_err!("layer {layer} holds no tokens to fetch");
        }
        let (m, out) = (self.model, self.output);
        let outputs = self
            .scratch
            .get(&self.ctx, m.rows(), len, m.head_dim, out)?;
        let l = &self.layers[layer];
        let ctx = self.ctx.clone();
        ctx.run("f16 fetch", |enc| {
            encode_fetch(&ctx, enc, l, len, &m, out, &outputs)
        })
        .await?;
        fetched(&m, outputs, len, out)
    }

    /// GPU bytes of every layer's buffers (capacity, not just the tokens held).
    pub fn allocated_bytes(&self) -> u64 {
        self.layers
            .iter()
            .flat_map(|l| [&l.key, &l.value])
            .filter_map(|s| s.buffer.as_ref())
            .map(|b| b.size())
            .sum()
    }

    /// fp16 bytes of the tokens held (K + V).
    pub fn fp16_bytes(&self) -> u64 {
        let m = &self.model;
        self.layers
            .iter()
            .map(|l| (2 * l.len * m.rows() * m.head_dim * 2) as u64)
            .sum()
    }

    /// Frees every buffer.
    pub fn reset(&mut self) {
        for l in &mut self.layers {
            for s in [&mut l.key, &mut l.value] {
                s.buffer = None;
                s.capacity = 0;
            }
            l.len = 0;
        }
        self.scratch.clear();
    }
}

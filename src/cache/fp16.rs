//! A plain f16 KV cache behind the same [`KvCache`] interface as
//! [`CacheSet`](crate::cache::CacheSet): the baseline for benchmarks and quality comparisons.
//! Each layer's keys and values live in `[R, capacity, D_even]` f16 buffers that grow by
//! doubling (copying history) from 64 tokens; attention reads them with the same split-K
//! kernel as the XQuant window.

use std::sync::Arc;

use crate::cache::config::ModelSpec;
use crate::cache::io::{check_budget, check_kv_pair, fetched, Fetched, Growing, Scratch};
use crate::cache::kv_cache::{Checkpoint, KvCache, Scope};
use crate::cache::set::{attend_call, check_fetch_targets};
use crate::config::{DType, ParamsPrecision};
use crate::error::{shape_err, Result, XqError};
use crate::gpu::kernels::attention::{AttendOptions, AttnSource};
use crate::gpu::kernels::materialize::{OutView, Source};
use crate::gpu::kernels::window::RingTarget;
use crate::gpu::{GpuBuffer, GpuContext, GpuTensor};

/// Smallest capacity a layer starts with.
const MIN_CAPACITY: usize = 64;

#[derive(Clone, Default)]
pub(super) struct Fp16Store {
    pub(super) buffer: Option<Arc<GpuBuffer>>,
    pub(super) capacity: usize,
}

#[derive(Clone, Default)]
pub(super) struct Fp16Layer {
    pub(super) key: Fp16Store,
    pub(super) value: Fp16Store,
    pub(super) len: usize,
}

/// What a [`Checkpoint`] of an [`Fp16CacheSet`] holds.
struct Fp16Checkpoint {
    layers: Vec<(usize, Fp16Layer)>,
    scratch: Scratch,
    partials: Growing,
}

/// One f16 cache per layer: appends, attention and fetches, no quantization.
pub struct Fp16CacheSet {
    pub(super) ctx: Arc<GpuContext>,
    pub(super) model: ModelSpec,
    pub(super) max_ctx: usize,
    pub(super) output: DType,
    pub(super) layers: Vec<Fp16Layer>,
    pub(super) scratch: Scratch,
    pub(super) partials: Growing,
}

fn buffer_of(store: &Fp16Store) -> Result<&Arc<GpuBuffer>> {
    store
        .buffer
        .as_ref()
        .ok_or_else(|| XqError::Gpu("f16 cache buffer missing".into()))
}

impl Fp16CacheSet {
    /// Caches for `model`, each holding at most `max_ctx` tokens, fetched as `output`.
    pub fn for_model(
        ctx: Arc<GpuContext>,
        model: ModelSpec,
        max_ctx: usize,
        output: DType,
    ) -> Result<Self> {
        ctx.check()?;
        model.validate()?;
        if max_ctx == 0 {
            return Err(XqError::Config("max_ctx must be >= 1".into()));
        }
        Ok(Fp16CacheSet {
            ctx,
            model,
            max_ctx,
            output,
            layers: vec![Fp16Layer::default(); model.layers],
            scratch: Scratch::default(),
            partials: Growing::default(),
        })
    }

    pub(super) fn stride(&self) -> usize {
        self.model.head_dim.div_ceil(2) * 2
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.layers.len() {
            return shape_err!(
                "layer {layer} does not exist (the set has {})",
                self.layers.len()
            );
        }
        Ok(())
    }

    /// fp16 bytes of the tokens held (K + V).
    pub fn fp16_bytes(&self) -> u64 {
        let m = &self.model;
        self.layers
            .iter()
            .map(|l| (2 * l.len * m.rows() * m.head_dim * 2) as u64)
            .sum()
    }
}

impl KvCache for Fp16CacheSet {
    fn encode_save(&self, enc: &mut wgpu::CommandEncoder) -> Result<crate::cache::SaveJob> {
        self.save_job(enc)
    }

    fn context(&self) -> &Arc<GpuContext> {
        &self.ctx
    }

    fn model(&self) -> &ModelSpec {
        &self.model
    }

    fn tokens(&self, layer: usize) -> usize {
        self.layers.get(layer).map_or(0, |l| l.len)
    }

    /// GPU bytes of every layer's buffers (capacity, not just the tokens held).
    fn storage_bytes(&self) -> u64 {
        self.layers
            .iter()
            .flat_map(|l| [&l.key, &l.value])
            .filter_map(|s| s.buffer.as_ref())
            .map(|b| b.size())
            .sum()
    }

    fn scratch_bytes(&self) -> u64 {
        self.scratch.bytes() + self.partials.bytes()
    }

    fn input_params(&self) -> ParamsPrecision {
        ParamsPrecision::F32
    }

    fn effective_bits(&self) -> f64 {
        16.0
    }

    fn unquantized_tokens(&self, layer: usize) -> usize {
        self.tokens(layer)
    }

    fn reset(&mut self) {
        for l in &mut self.layers {
            *l = Fp16Layer::default();
        }
        self.scratch.clear();
        self.partials.clear();
    }

    fn checkpoint(&self, scope: Scope) -> Checkpoint {
        let layers = scope.layers(&self.layers);
        Checkpoint(Box::new(Fp16Checkpoint {
            layers,
            scratch: self.scratch.clone(),
            partials: self.partials.clone(),
        }))
    }

    fn rollback(&mut self, checkpoint: Checkpoint) {
        let Ok(cp) = checkpoint.0.downcast::<Fp16Checkpoint>() else {
            return;
        };
        let cp = *cp;
        for (l, layer) in cp.layers {
            self.layers[l] = layer;
        }
        self.scratch = cp.scratch;
        self.partials = cp.partials;
    }

    fn encode_append(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        layer: usize,
        keys: &GpuTensor,
        values: &GpuTensor,
    ) -> Result<()> {
        self.check_layer(layer)?;
        let t = check_kv_pair(&self.model, keys, values)?;
        let len = self.layers[layer].len;
        check_budget(layer, len, t, self.max_ctx)?;
        let (m, stride) = (self.model, self.stride());
        let want = (len + t).max(MIN_CAPACITY);
        let max_ctx = self.max_ctx;
        let ctx = self.ctx.clone();
        let l = &mut self.layers[layer];
        for (store, input) in [(&mut l.key, keys), (&mut l.value, values)] {
            if store.capacity < len + t {
                // Grow by doubling; the replaced buffer lives on in the caller's checkpoint
                // until the copy out of it has been submitted.
                let cap = want.max(store.capacity * 2).min(max_ctx.max(want));
                let bytes = (m.rows() * cap * stride * 2) as u64;
                let buffer = ctx.storage_buffer("f16 cache", bytes)?;
                if let Some(old) = &store.buffer {
                    for r in 0..m.rows() {
                        let (src, dst) = (r * store.capacity * stride * 2, r * cap * stride * 2);
                        enc.copy_buffer_to_buffer(
                            old,
                            src as u64,
                            &buffer,
                            dst as u64,
                            (len * stride * 2) as u64,
                        );
                    }
                }
                store.buffer = Some(buffer);
                store.capacity = cap;
            }
            let target = RingTarget {
                buffer: buffer_of(store)?,
                tokens: store.capacity,
                t0: len,
                rows: m.rows(),
                dim: m.head_dim,
            };
            ctx.encode_window_append(enc, &input.view(), t, &target)?;
        }
        l.len = len + t;
        Ok(())
    }

    fn encode_attend(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        layer: usize,
        queries: &GpuTensor,
        out: &GpuTensor,
        options: &AttendOptions,
    ) -> Result<()> {
        self.check_layer(layer)?;
        let m = self.model;
        let l = &self.layers[layer];
        let call = attend_call(&m, l.len, layer, queries, out, options)?;
        let sources = [AttnSource::Ring {
            key: buffer_of(&l.key)?,
            value: buffer_of(&l.value)?,
            ring_tokens: l.key.capacity,
            t0: 0,
            abs0: 0,
            n: l.len,
        }];
        self.partials
            .encode_attention(&self.ctx, enc, &call, &sources)
    }

    fn encode_fetch_into(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        layer: usize,
        keys: &GpuTensor,
        values: &GpuTensor,
    ) -> Result<()> {
        self.check_layer(layer)?;
        let (m, l) = (self.model, &self.layers[layer]);
        check_fetch_targets(&m, layer, l.len, keys, values)?;
        for (store, output) in [(&l.key, keys), (&l.value, values)] {
            let source = Source::Ring {
                ring: buffer_of(store)?,
                ring_tokens: store.capacity,
                t0: 0,
                n: l.len,
            };
            let view = OutView {
                buffer: output.bind(),
                dtype: output.dtype(),
                rows: m.rows(),
                tokens: l.len,
                dim: m.head_dim,
                t0: 0,
            };
            self.ctx.encode_materialize(enc, &source, &view)?;
        }
        Ok(())
    }

    fn encode_fetch(&mut self, enc: &mut wgpu::CommandEncoder, layer: usize) -> Result<Fetched> {
        self.check_layer(layer)?;
        let (m, out, len) = (self.model, self.output, self.tokens(layer));
        if len == 0 {
            return shape_err!("layer {layer} holds no tokens to fetch");
        }
        let buffers = self
            .scratch
            .get(&self.ctx, m.rows(), len, m.head_dim, out)?;
        let f = fetched(&m, buffers, len, out)?;
        self.encode_fetch_into(enc, layer, &f.keys, &f.values)?;
        Ok(f)
    }
}

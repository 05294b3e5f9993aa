//! A plain f16 KV cache behind the same [`KvCache`] interface as
//! [`CacheSet`](crate::cache::CacheSet): the baseline for benchmarks and quality comparisons.
//! Each layer's keys and values live in `[R, capacity, D_even]` f16 buffers that grow by
//! doubling (copying history) from 64 tokens; attention reads them with the same split-K
//! kernel as the XQuant window. A sliding-window layer's buffers are rings (token t in slot
//! `t % capacity`) that stop growing at its window plus the tokens of one call.

use std::sync::Arc;

use crate::cache::config::ModelSpec;
use crate::cache::io::{check_budget, check_kv_pair, fetched, Fetched, Growing, Scratch};
use crate::cache::kv_cache::{Checkpoint, KvCache, Scope};
use crate::cache::set::{attend_call, check_fetch_targets, sliding_call};
use crate::cache::store::{copy_ring_tokens, Ring};
use crate::config::{DType, ParamsPrecision};
use crate::error::{shape_err, Result, XqError};
use crate::gpu::dispatch::Bind;
use crate::gpu::kernels::attention::{AttendOptions, AttnSource, RING_ALIGN};
use crate::gpu::kernels::materialize::{OutView, Source};
use crate::gpu::kernels::views::RingSinks;
use crate::gpu::kernels::window::{RingTarget, RingWrite};
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
    /// The first position still held (0 but in a sliding layer, whose ring overwrote the
    /// positions before it).
    pub(super) held_from: usize,
}

impl Fp16Layer {
    /// Tokens held: every token, or a sliding layer's last ones.
    pub(super) fn held(&self) -> usize {
        self.len - self.held_from
    }
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
    /// Each layer's attention window (`None`: a global layer).
    pub(super) windows: Vec<Option<usize>>,
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
            windows: vec![None; model.layers],
            scratch: Scratch::default(),
            partials: Growing::default(),
        })
    }

    /// The set with these per-layer attention windows (`None` on global layers: Gemma 3's
    /// 512 on its local layers): a sliding layer keeps its window (plus one call's tokens)
    /// in a ring and attends within it. Set before the first append.
    pub fn with_attention_windows(mut self, windows: &[Option<usize>]) -> Result<Self> {
        if windows.len() != self.layers.len() {
            return Err(XqError::Config(format!(
                "attention windows: {} given for {} layers",
                windows.len(),
                self.layers.len()
            )));
        }
        if let Some(i) = windows
            .iter()
            .position(|w| matches!(w, Some(w) if !(1..=u32::MAX as usize).contains(w)))
        {
            return Err(XqError::Config(format!(
                "attention window of layer {i} must be at least 1 (and fit 32 bits), got {:?}",
                windows[i]
            )));
        }
        if self.layers.iter().any(|l| l.len > 0) {
            return Err(XqError::Config(
                "attention windows are set before the first append".into(),
            ));
        }
        self.windows = windows.to_vec();
        Ok(self)
    }

    /// Each layer's attention window (`None`: a global layer).
    pub fn attention_windows(&self) -> &[Option<usize>] {
        &self.windows
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

    /// GPU bytes of one layer's buffers (K + V; 0 for a layer that does not exist).
    pub fn layer_storage_bytes(&self, layer: usize) -> u64 {
        self.layers.get(layer).map_or(0, |l| {
            [&l.key, &l.value]
                .iter()
                .filter_map(|s| s.buffer.as_ref())
                .map(|b| b.size())
                .sum()
        })
    }

    /// fp16 bytes of the tokens held (K + V).
    pub fn fp16_bytes(&self) -> u64 {
        let m = &self.model;
        self.layers
            .iter()
            .map(|l| (2 * l.held() * m.rows() * m.head_dim * 2) as u64)
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

    fn held_tokens(&self, layer: usize) -> usize {
        self.layers.get(layer).map_or(0, Fp16Layer::held)
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
        self.held_tokens(layer)
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
        // Slots the call needs: every token, or a sliding layer's window as seen by the
        // call's first query (A − 1 earlier tokens) and the call's tokens; what a moved ring
        // keeps: every token held, or the A − 1 that query sees.
        let l = &self.layers[layer];
        let (need, most, keep_from) = match self.windows[layer] {
            None => (len + t, self.max_ctx, l.held_from),
            Some(a) => {
                let seen = (len + t).min(a - 1 + t);
                let ring = (a - 1 + t).next_multiple_of(MIN_CAPACITY);
                let keep_from = l.held_from.max(len.saturating_sub(a - 1));
                (seen, ring.min(self.max_ctx), keep_from)
            }
        };
        let want = need.max(MIN_CAPACITY);
        // A sliding layer's ring that a long call (a whole prompt at once) left more than
        // twice what this call needs shrinks back to it, so memory stays flat after a prefill.
        let shrink = self.windows[layer].is_some() && l.key.capacity > 2 * most.max(want);
        let ctx = self.ctx.clone();
        let l = &mut self.layers[layer];
        let mut held_from = l.held_from;
        for store in [&mut l.key, &mut l.value] {
            if store.capacity < need || shrink {
                // Grow by doubling (or shrink); the replaced buffer lives on in the caller's
                // checkpoint until the copy out of it has been submitted.
                let cap = match shrink {
                    true => most.max(want),
                    false => want.max(store.capacity * 2).min(most.max(want)),
                };
                let bytes = ((m.rows() * cap * stride * 2) as u64).next_multiple_of(RING_ALIGN);
                let buffer = ctx.storage_buffer("f16 cache", bytes)?;
                if let Some(old) = &store.buffer {
                    let from = Ring {
                        buffer: old.clone(),
                        tokens: store.capacity,
                        sinks: 0,
                    };
                    let to = Ring {
                        buffer: buffer.clone(),
                        tokens: cap,
                        sinks: 0,
                    };
                    copy_ring_tokens(enc, &from, &to, keep_from..len, m.rows(), stride);
                }
                store.buffer = Some(buffer);
                store.capacity = cap;
                held_from = keep_from;
            }
        }
        // Keys and values in one launch.
        let (kv, views) = ([&l.key, &l.value], [keys.view(), values.view()]);
        let mut writes = Vec::with_capacity(2);
        for (store, x) in kv.into_iter().zip(views) {
            let ring = RingTarget {
                buffer: Bind::from(&**buffer_of(store)?),
                tokens: store.capacity,
                t0: len,
                rows: m.rows(),
                dim: m.head_dim,
                rotation: None,
            };
            writes.push(RingWrite { x, n: t, ring });
        }
        ctx.encode_window_appends(enc, &writes)?;
        l.len = len + t;
        l.held_from = held_from.max(l.len.saturating_sub(l.key.capacity));
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
        let call = sliding_call(call, layer, self.windows[layer], l.held_from)?;
        let sources = [AttnSource::Ring {
            key: buffer_of(&l.key)?,
            value: buffer_of(&l.value)?,
            ring_tokens: l.key.capacity,
            t0: l.held_from,
            abs0: l.held_from,
            n: l.held(),
            sinks: RingSinks::default(),
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
        check_fetch_targets(&m, layer, l.held(), keys, values)?;
        for (store, output) in [(&l.key, keys), (&l.value, values)] {
            let source = Source::Ring {
                ring: Bind::from(&**buffer_of(store)?),
                ring_tokens: store.capacity,
                t0: l.held_from,
                n: l.held(),
                sinks: RingSinks::default(),
            };
            let view = OutView {
                buffer: output.bind(),
                dtype: output.dtype(),
                rows: m.rows(),
                tokens: l.held(),
                dim: m.head_dim,
                t0: 0,
            };
            self.ctx.encode_materialize(enc, &source, &view)?;
        }
        Ok(())
    }

    fn encode_fetch(&mut self, enc: &mut wgpu::CommandEncoder, layer: usize) -> Result<Fetched> {
        self.check_layer(layer)?;
        let (m, out, len) = (self.model, self.output, self.held_tokens(layer));
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

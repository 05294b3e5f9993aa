//! The coordinated set of XQuant caches of a model: one per attention layer.

use std::sync::Arc;

use crate::cache::config::{CacheConfig, CacheOptions, DecodePolicy, ModelSpec};
use crate::cache::coordinator::Coordinator;
use crate::cache::io::{check_budget, check_kv_pair, fetched, Fetched, Growing, Scratch};
use crate::cache::kv_cache::{Checkpoint, KvCache, Scope};
use crate::cache::page::{max_page_tokens, PageKind};
use crate::cache::plan::{CachePlan, CodeSource, LayerPlan, TensorPlan};
use crate::cache::rotate::LayerRotation;
use crate::cache::store::{Incoming, StoreBytes, TensorStore};
use crate::config::{KvKind, ParamsPrecision, ValueAxis};
use crate::error::{shape_err, Result, XqError};
use crate::gpu::kernels::attention::{check_attend_shapes, AttendOptions, AttnCall};
use crate::gpu::{GpuContext, GpuTensor, PackedCodes};
use crate::reference::{effective_bits, LayerRole};

/// Accounting of one layer's keys or values, with the plan entry they follow.
#[derive(Clone, Debug, PartialEq)]
pub struct KvStats {
    /// Own codes, or the layer whose codes these decode.
    pub codes: CodeSource,
    /// Code width.
    pub bits: u8,
    /// Residual width (0: none).
    pub residual_bits: u8,
    /// Grouping axis.
    pub axis: ValueAxis,
    /// `16 · accounted / fp16`.
    pub effective_bits: f64,
    /// Reference accounting of quantized blocks plus 2 bytes per window and sink element.
    pub accounted_bytes: u64,
    /// GPU buffers (pages, window ring, sinks).
    pub allocated_bytes: u64,
    /// The same tokens in fp16.
    pub fp16_bytes: u64,
}

/// Accounting of one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerStats {
    /// Layer index.
    pub layer: usize,
    /// Tokens appended (the next token's position).
    pub tokens: usize,
    /// Tokens still held: all of them, or a sliding layer's last ones (about its window).
    pub held_tokens: usize,
    /// Tokens in the f16 window.
    pub window_tokens: usize,
    /// Tokens in the f16 sinks.
    pub sink_tokens: usize,
    /// Keys.
    pub key: KvStats,
    /// Values.
    pub value: KvStats,
    /// `16 · accounted / fp16` over K and V.
    pub effective_bits: f64,
    /// K + V accounted bytes.
    pub accounted_bytes: u64,
    /// K + V GPU bytes.
    pub allocated_bytes: u64,
    /// K + V in fp16.
    pub fp16_bytes: u64,
}

/// Accounting of a set.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheStats {
    /// Per layer.
    pub layers: Vec<LayerStats>,
    /// Sum of the layers' accounted bytes.
    pub accounted_bytes: u64,
    /// Sum of the layers' GPU bytes.
    pub allocated_bytes: u64,
    /// fp16 bytes of the same tokens.
    pub fp16_bytes: u64,
    /// `allocated / fp16`.
    pub ratio_vs_fp16: f64,
    /// `16 · accounted / fp16` over all layers.
    pub effective_bits: f64,
    /// The set's scratch, not part of any layer: attention partials and the reused output
    /// buffers of `update_and_fetch` / `fetch`.
    pub scratch_bytes: u64,
    /// Reference policy: tokens published and not yet read by every reader.
    pub live_tokens: usize,
}

#[derive(Clone)]
pub(super) struct LayerCache {
    pub(super) plan: LayerPlan,
    pub(super) key: TensorStore,
    pub(super) value: TensorStore,
}

impl LayerCache {
    pub(super) fn store(&self, kind: KvKind) -> &TensorStore {
        match kind {
            KvKind::Key => &self.key,
            KvKind::Value => &self.value,
        }
    }
}

/// What a [`Checkpoint`] of a [`CacheSet`] holds.
struct SetCheckpoint {
    /// The layers saved, by index.
    layers: Vec<(usize, LayerCache)>,
    coordinator: Coordinator<(PackedCodes, PackedCodes)>,
    scratch: Scratch,
    partials: Growing,
    rotated: Growing,
}

/// The caches of every layer of a model, built together so layers that borrow codes read
/// them from the layer that owns them (its packed code buffers, directly). Each layer's keys
/// and values follow their own entry of a [`CachePlan`]. Everything a runtime does with it
/// goes through the [`KvCache`] trait.
pub struct CacheSet {
    pub(super) ctx: Arc<GpuContext>,
    pub(super) model: ModelSpec,
    pub(super) plan: CachePlan,
    pub(super) options: CacheOptions,
    pub(super) layers: Vec<LayerCache>,
    pub(super) coordinator: Coordinator<(PackedCodes, PackedCodes)>,
    pub(super) scratch: Scratch,
    pub(super) partials: Growing,
    /// A rotated plan's rotated keys and values of an append.
    pub(super) rotated: Growing,
    /// The page size of global layers (sliding layers' pages are smaller: `sliding_page`).
    pub(super) max_page: usize,
}

impl CacheSet {
    /// Builds the caches of `model` from options: the reference's grouping
    /// (`CacheConfig::plan`).
    pub fn for_model(ctx: Arc<GpuContext>, model: ModelSpec, config: CacheConfig) -> Result<Self> {
        model.validate()?;
        config.validate(model.head_dim)?;
        let plan = config.plan(model.layers, model.head_dim)?;
        Self::for_plan(ctx, model, plan, config.options())
    }

    /// Builds the caches of `model` as `plan` says.
    pub fn for_plan(
        ctx: Arc<GpuContext>,
        model: ModelSpec,
        plan: CachePlan,
        options: CacheOptions,
    ) -> Result<Self> {
        ctx.check()?;
        model.validate()?;
        plan.validate()?;
        plan.check_layers(model.layers)?;
        options.validate(&plan)?;
        plan.check_head_dim(model.head_dim)?;
        // The reference policy quantizes every token: no window, no sinks.
        let (window, sinks) = match options.decode_policy {
            DecodePolicy::Window => (plan.window, plan.sinks),
            DecodePolicy::Reference => (0, 0),
        };
        let limit = ctx.max_bound_buffer_bytes();
        let kind = |l: &LayerPlan, kv: KvKind| page_kind(&plan, &model, l, kv);
        // One page size for every store: pages cover the same tokens in every layer, so a
        // layer that borrows codes finds them laid out like its own page.
        let mut max_page = usize::MAX;
        for l in &plan.layers {
            for kv in [KvKind::Key, KvKind::Value] {
                max_page = max_page.min(max_page_tokens(&kind(l, kv), options.page_tokens, limit)?);
            }
        }
        let layers = plan
            .layers
            .iter()
            .map(|l| {
                let store = |kv| {
                    TensorStore::new(kind(l, kv), max_page, window, sinks, options.max_ctx)
                        .sliding(l.attention_window)
                };
                LayerCache {
                    plan: *l,
                    key: store(KvKind::Key),
                    value: store(KvKind::Value),
                }
            })
            .collect();
        Ok(CacheSet {
            ctx,
            model,
            coordinator: Coordinator::new(options.max_ctx),
            plan,
            options,
            layers,
            scratch: Scratch::default(),
            partials: Growing::default(),
            rotated: Growing::default(),
            max_page,
        })
    }

    /// The plan every layer follows.
    pub fn plan(&self) -> &CachePlan {
        &self.plan
    }

    /// The reference's view of the keys' plan ([`CachePlan::key_roles`]).
    pub fn roles(&self) -> Vec<LayerRole> {
        self.plan.key_roles()
    }

    /// The options that are not part of the plan.
    pub fn options(&self) -> &CacheOptions {
        &self.options
    }

    /// Reference policy: tokens published by anchors and not yet read by all their readers.
    pub fn live_tokens(&self) -> usize {
        self.coordinator.live_tokens()
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

    /// Per-layer and total accounting.
    pub fn stats(&self) -> CacheStats {
        let mut layers = Vec::with_capacity(self.layers.len());
        for (i, l) in self.layers.iter().enumerate() {
            let side = |kv: KvKind| {
                let (e, b): (&TensorPlan, StoreBytes) = (l.plan.get(kv), l.store(kv).bytes());
                KvStats {
                    codes: e.codes,
                    bits: e.bits,
                    residual_bits: e.residual_bits,
                    axis: e.axis,
                    effective_bits: effective_bits(b.accounted as usize, b.fp16 as usize),
                    accounted_bytes: b.accounted,
                    allocated_bytes: b.allocated,
                    fp16_bytes: b.fp16,
                }
            };
            let (key, value) = (side(KvKind::Key), side(KvKind::Value));
            let accounted = key.accounted_bytes + value.accounted_bytes;
            let fp16 = key.fp16_bytes + value.fp16_bytes;
            layers.push(LayerStats {
                layer: i,
                tokens: l.key.len(),
                held_tokens: l.key.held(),
                window_tokens: l.key.window_tokens(),
                sink_tokens: l.key.sink_tokens(),
                effective_bits: effective_bits(accounted as usize, fp16 as usize),
                accounted_bytes: accounted,
                allocated_bytes: key.allocated_bytes + value.allocated_bytes,
                fp16_bytes: fp16,
                key,
                value,
            });
        }
        let sum = |f: fn(&LayerStats) -> u64| layers.iter().map(f).sum::<u64>();
        let (accounted, allocated, fp16) = (
            sum(|l| l.accounted_bytes),
            sum(|l| l.allocated_bytes),
            sum(|l| l.fp16_bytes),
        );
        CacheStats {
            accounted_bytes: accounted,
            allocated_bytes: allocated,
            fp16_bytes: fp16,
            ratio_vs_fp16: if fp16 == 0 {
                0.0
            } else {
                allocated as f64 / fp16 as f64
            },
            effective_bits: effective_bits(accounted as usize, fp16 as usize),
            scratch_bytes: self.scratch_bytes(),
            live_tokens: self.coordinator.live_tokens(),
            layers,
        }
    }

    /// The most by which `layer`'s allocated bytes may exceed its accounted bytes (f16
    /// params): its window rings plus one unfilled page plus section padding, for K and V.
    pub fn slack_bound(&self, layer: usize) -> u64 {
        self.layers
            .get(layer)
            .map_or(0, |l| l.key.slack_bound() + l.value.slack_bound())
    }
}

impl KvCache for CacheSet {
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
        self.layers.get(layer).map_or(0, |l| l.key.len())
    }

    fn held_tokens(&self, layer: usize) -> usize {
        self.layers.get(layer).map_or(0, |l| l.key.held())
    }

    fn storage_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| l.key.bytes().allocated + l.value.bytes().allocated)
            .sum()
    }

    fn scratch_bytes(&self) -> u64 {
        self.scratch.bytes() + self.partials.bytes() + self.rotated.bytes()
    }

    fn input_params(&self) -> ParamsPrecision {
        self.plan.params
    }

    fn effective_bits(&self) -> f64 {
        self.stats().effective_bits
    }

    fn unquantized_tokens(&self, layer: usize) -> usize {
        self.layers
            .get(layer)
            .map_or(0, |l| l.key.window_tokens() + l.key.sink_tokens())
    }

    fn reset(&mut self) {
        for l in &mut self.layers {
            l.key.clear();
            l.value.clear();
        }
        self.scratch.clear();
        self.partials.clear();
        self.rotated.clear();
        self.coordinator.clear();
    }

    fn checkpoint(&self, scope: Scope) -> Checkpoint {
        let layers = scope.layers(&self.layers);
        Checkpoint(Box::new(SetCheckpoint {
            layers,
            coordinator: self.coordinator.clone(),
            scratch: self.scratch.clone(),
            partials: self.partials.clone(),
            rotated: self.rotated.clone(),
        }))
    }

    fn rollback(&mut self, checkpoint: Checkpoint) {
        let Ok(cp) = checkpoint.0.downcast::<SetCheckpoint>() else {
            return;
        };
        let cp = *cp;
        for (l, c) in cp.layers {
            self.layers[l] = c;
        }
        self.coordinator = cp.coordinator;
        self.scratch = cp.scratch;
        self.partials = cp.partials;
        self.rotated = cp.rotated;
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
        let len = self.layers[layer].key.len();
        let plan = self.layers[layer].plan;
        let reference = self.options.decode_policy == DecodePolicy::Reference;
        if !reference {
            check_budget(layer, len, t, self.options.max_ctx)?;
        }
        // Reference policy: keys and values share their code source (checked by the
        // options), so the coordinator publishes and reads them together, keyed by the
        // layer that owns them.
        let readers = self.plan.readers(layer, KvKind::Key);
        let publishes = reference && plan.key.codes == CodeSource::Own;
        if publishes {
            self.coordinator.check_publish(layer, len, t, readers)?;
        }
        let source = match plan.key.codes {
            CodeSource::Layer(s) if reference => Some(s),
            _ => None,
        };
        let published = source.and_then(|s| self.coordinator.peek(s, len));
        let out = self.options.output;
        let ctx = self.ctx.clone();
        let rotation = LayerRotation {
            ctx: &ctx,
            plan: &self.plan,
            model: &self.model,
            layer,
        };
        let (before, rest) = self.layers.split_at_mut(layer);
        let this = &mut rest[0];
        // Until a call quantizes tokens, they are held as they come (no rotation). From then
        // on a decode step's tokens land in the ring or the sinks: rotated as they are
        // written there (one launch each). Longer appends are rotated first, into scratch.
        let rotated = reference || this.key.rotated_after(t);
        let into_ring = !reference && this.key.lands_in_ring(t) && this.value.lands_in_ring(t);
        let [keys, values] = &match rotated && !into_ring {
            false => [keys.clone(), values.clone()],
            true => rotation.inputs(enc, &mut self.rotated, keys, values)?,
        };
        let mut deferred = Vec::with_capacity(2);
        for (kind, x) in [(KvKind::Key, keys), (KvKind::Value, values)] {
            let store = match kind {
                KvKind::Key => &mut this.key,
                KvKind::Value => &mut this.value,
            };
            if reference {
                let codes = published.as_ref().map(|(k, v)| match kind {
                    KvKind::Key => k.clone(),
                    KvKind::Value => v.clone(),
                });
                store.append_reference(&ctx, enc, &x.cache_view(), t, codes, out)?;
            } else {
                let anchor = match this.plan.get(kind).codes {
                    CodeSource::Layer(s) => Some(before[s].store(kind)),
                    CodeSource::Own => None,
                };
                let input = Incoming {
                    x: x.cache_view(),
                    t,
                    rotation: (rotated && into_ring)
                        .then(|| rotation.ring(kind))
                        .flatten(),
                    held: rotation.held(kind),
                };
                deferred.extend(store.append_window(&ctx, enc, input, anchor, out)?);
            }
        }
        // The keys' and values' last ring writes (a decode step's tokens) in one launch.
        let writes: Vec<_> = deferred.iter().map(|d| d.write()).collect();
        ctx.encode_window_appends(enc, &writes)?;
        if publishes {
            if let (Some(k), Some(v)) = (this.key.last_page_codes(), this.value.last_page_codes()) {
                self.coordinator.publish(layer, len, t, readers, (k, v))?;
            }
        }
        if let Some(s) = source {
            match published {
                Some(_) => self.coordinator.consume(s, len),
                None => self.coordinator.fell_back(s, len),
            }
        }
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
        let call = attend_call(&m, self.tokens(layer), layer, queries, out, options)?;
        let call = sliding_call(call, layer, l.plan.attention_window, l.key.held_from())?;
        let sources = l.key.attention_sources(&l.value)?;
        let rotation = LayerRotation {
            ctx: &self.ctx,
            plan: &self.plan,
            model: &m,
            layer,
        };
        let call = AttnCall {
            rotation: rotation.attention(l.key.rotated),
            ..call
        };
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
        let held = self.held_tokens(layer);
        check_fetch_targets(&self.model, layer, held, keys, values)?;
        let l = &self.layers[layer];
        let rotation = LayerRotation {
            ctx: &self.ctx,
            plan: &self.plan,
            model: &self.model,
            layer,
        };
        for (kind, store, out) in [
            (KvKind::Key, &l.key, keys),
            (KvKind::Value, &l.value, values),
        ] {
            // A layer holds rotated tokens from its first quantized group on.
            let signs = rotation.ring(kind).filter(|_| l.key.rotated);
            let unrotated =
                store.encode_fetch(&self.ctx, enc, out.bind(), out.dtype(), signs.as_ref())?;
            if signs.is_some() && !unrotated {
                rotation.fetched(enc, kind, out)?;
            }
        }
        Ok(())
    }

    fn encode_fetch(&mut self, enc: &mut wgpu::CommandEncoder, layer: usize) -> Result<Fetched> {
        self.check_layer(layer)?;
        let (m, out, len) = (self.model, self.options.output, self.held_tokens(layer));
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

/// What the pages of `l`'s keys or values hold.
pub(super) fn page_kind(
    plan: &CachePlan,
    model: &ModelSpec,
    l: &LayerPlan,
    kv: KvKind,
) -> PageKind {
    let e = l.get(kv);
    PageKind {
        spec: e.spec(plan.group_quant_size, plan.params),
        residual_bits: e.residual_bits,
        role: e.role(),
        rows: model.rows(),
        dim: model.head_dim,
    }
}

/// The geometry of an attention call over a layer holding `len` tokens.
pub(crate) fn attend_call<'a>(
    m: &ModelSpec,
    len: usize,
    layer: usize,
    queries: &'a GpuTensor,
    out: &'a GpuTensor,
    options: &AttendOptions,
) -> Result<AttnCall<'a>> {
    if len == 0 {
        return shape_err!("layer {layer} holds no tokens to attend to");
    }
    let (heads, t) = check_attend_shapes(
        queries,
        out,
        m.batch,
        m.kv_heads,
        m.head_dim,
        options.layout,
    )?;
    let pos0 = match options.pos0 {
        Some(p) => p,
        None => len.checked_sub(t).ok_or_else(|| {
            XqError::Shape(format!(
                "{t} query tokens cannot be the last tokens of layer {layer}, which holds {len}; \
                 give their position (pos0)"
            ))
        })?,
    };
    let scale = options.scale.unwrap_or(1.0 / (m.head_dim as f32).sqrt());
    if !(scale.is_finite() && scale > 0.0) {
        return Err(XqError::Config(format!(
            "attention scale must be finite and > 0, got {scale}"
        )));
    }
    let window = match options.window {
        None => 0,
        Some(w) if (1..=u32::MAX as usize).contains(&w) => w,
        Some(w) => {
            return Err(XqError::Config(format!(
                "attention window must be at least 1 (and fit 32 bits), got {w}"
            )))
        }
    };
    Ok(AttnCall {
        queries,
        out,
        batch: m.batch,
        kv_heads: m.kv_heads,
        q_heads: heads,
        q_tokens: t,
        dim: m.head_dim,
        pos0,
        scale,
        layout: options.layout,
        rotation: Default::default(),
        window,
    })
}

/// `call` over a layer with this attention window (`None`: a global layer) that holds
/// positions from `held_from` on: the narrower of the call's window and the layer's, and a
/// `ShapeError` when a query's window reaches positions the layer no longer holds (queries
/// placed earlier with `pos0`).
pub(crate) fn sliding_call<'a>(
    call: AttnCall<'a>,
    layer: usize,
    attention_window: Option<usize>,
    held_from: usize,
) -> Result<AttnCall<'a>> {
    let window = match (call.window, attention_window.unwrap_or(0)) {
        (0, w) | (w, 0) => w,
        (a, b) => a.min(b),
    };
    let needs = match window {
        0 => 0,
        w => (call.pos0 + 1).saturating_sub(w),
    };
    if needs < held_from {
        return shape_err!(
            "layer {layer} no longer holds positions before {held_from} (a sliding-window \
             layer drops what falls out of its window); a query at position {} needs \
             them",
            call.pos0
        );
    }
    Ok(AttnCall { window, ..call })
}

/// Checks caller-owned fetch targets: `[batch, kv_heads, len, head_dim]`, f32 or f16.
pub(crate) fn check_fetch_targets(
    m: &ModelSpec,
    layer: usize,
    len: usize,
    keys: &GpuTensor,
    values: &GpuTensor,
) -> Result<()> {
    if len == 0 {
        return shape_err!("layer {layer} holds no tokens to fetch");
    }
    let want = [m.batch, m.kv_heads, len, m.head_dim];
    for (what, t) in [("keys", keys), ("values", values)] {
        if t.shape().dims() != want {
            return shape_err!(
                "{what} target {:?} is not {want:?} (layer {layer} holds {len} tokens)",
                t.shape().dims()
            );
        }
    }
    Ok(())
}

impl Drop for CacheSet {
    fn drop(&mut self) {
        self.reset();
    }
}

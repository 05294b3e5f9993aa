//! The coordinated set of XQuant caches of a model: one per attention layer.

use std::sync::Arc;

use crate::cache::config::{CacheConfig, DecodePolicy, ModelSpec};
use crate::cache::coordinator::Coordinator;
use crate::cache::io::{check_budget, fetched, Fetched, Inputs, KvInput, Scratch};
use crate::cache::store::{StoreBytes, TensorStore};
use crate::config::KvKind;
use crate::error::{shape_err, Result, XqError};
use crate::gpu::{GpuContext, GpuTensor, PackedCodes};
use crate::reference::{anchor_of, effective_bits, pair_layers, LayerRole, Role};

/// Accounting of one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerStats {
    /// Layer index.
    pub layer: usize,
    /// Anchor or reuse.
    pub role: Role,
    /// Group id.
    pub group: usize,
    /// Tokens held.
    pub tokens: usize,
    /// Tokens in the f16 window.
    pub window_tokens: usize,
    /// `16 · accounted / fp16` over K and V.
    pub effective_bits: f64,
    /// The reference's `effective_pair_bits`: keys only.
    pub key_effective_bits: f64,
    /// Values only.
    pub value_effective_bits: f64,
    /// Reference accounting (quantized blocks) plus 2 bytes per window element, K + V.
    pub accounted_bytes: u64,
    /// GPU buffers of the layer, K + V.
    pub allocated_bytes: u64,
    /// The same tokens in fp16, K + V.
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
    /// The reused output buffers of `update_and_fetch` (not part of any layer).
    pub scratch_bytes: u64,
    /// Reference policy: tokens published and not yet read by every reader.
    pub live_tokens: usize,
}

struct LayerCache {
    role: LayerRole,
    key: TensorStore,
    value: TensorStore,
}

impl LayerCache {
    fn store(&self, kind: KvKind) -> &TensorStore {
        match kind {
            KvKind::Key => &self.key,
            KvKind::Value => &self.value,
        }
    }
}

/// The caches of every layer of a model, built together so anchors and reuse layers
/// cooperate. A reuse layer reads its anchor's packed code buffers directly.
pub struct CacheSet {
    ctx: Arc<GpuContext>,
    model: ModelSpec,
    config: CacheConfig,
    layers: Vec<LayerCache>,
    coordinator: Coordinator<(PackedCodes, PackedCodes)>,
    scratch: Scratch,
}

impl CacheSet {
    /// Builds the caches of `model`: roles from `pair_layers(layers, group_size)`.
    pub fn for_model(ctx: Arc<GpuContext>, model: ModelSpec, config: CacheConfig) -> Result<Self> {
        model.validate()?;
        config.validate()?;
        let roles = pair_layers(model.layers, config.quant.group_size)?;
        let window = match config.decode_policy {
            DecodePolicy::Window => config.window,
            DecodePolicy::Reference => 0,
        };
        let layers = roles
            .iter()
            .map(|&role| {
                let store = |kind| {
                    TensorStore::new(
                        config.quant.spec(kind),
                        config.quant.residual_bits,
                        role.role,
                        model.rows(),
                        model.head_dim,
                        config.page_tokens,
                        window,
                    )
                };
                LayerCache {
                    role,
                    key: store(KvKind::Key),
                    value: store(KvKind::Value),
                }
            })
            .collect();
        Ok(CacheSet {
            ctx,
            model,
            config,
            layers,
            coordinator: Coordinator::new(config.max_ctx),
            scratch: Scratch::default(),
        })
    }

    /// The model this set was built for.
    pub fn model(&self) -> &ModelSpec {
        &self.model
    }

    /// The options.
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// Roles and groups of every layer.
    pub fn roles(&self) -> Vec<LayerRole> {
        self.layers.iter().map(|l| l.role).collect()
    }

    /// Tokens held by `layer` (0 for an unknown layer).
    pub fn tokens(&self, layer: usize) -> usize {
        self.layers.get(layer).map_or(0, |l| l.key.len())
    }

    /// Reference policy: tokens published by anchors and not yet read by all their readers.
    pub fn live_tokens(&self) -> usize {
        self.coordinator.live_tokens()
    }

    /// Reuse layers reading the anchor of `layer`'s group.
    fn readers(&self, layer: usize) -> usize {
        let g = self.config.quant.group_size;
        let anchor = anchor_of(layer, g);
        (anchor + g).min(self.layers.len()) - anchor - 1
    }

    /// Appends `keys`/`values` (`[batch, kv_heads, tokens, head_dim]`, prefill or decode) to
    /// `layer` and returns the reconstruction of every token so far. Layers are expected in
    /// order 0..L-1 each step; a reuse layer whose anchor has not yet encoded a range
    /// quantizes it itself. A call that fails changes nothing.
    pub async fn update_and_fetch(
        &mut self,
        layer: usize,
        keys: KvInput<'_>,
        values: KvInput<'_>,
    ) -> Result<Fetched> {
        let fetched = self.step(layer, Some((keys, values)), true).await?;
        fetched.ok_or_else(|| XqError::Gpu("fetch produced nothing".into()))
    }

    /// Appends without fetching (one submission less when the reconstruction is not needed).
    pub async fn append(
        &mut self,
        layer: usize,
        keys: KvInput<'_>,
        values: KvInput<'_>,
    ) -> Result<()> {
        self.step(layer, Some((keys, values)), false)
            .await
            .map(|_| ())
    }

    /// The reconstruction of every token `layer` holds (at least one).
    pub async fn fetch(&mut self, layer: usize) -> Result<Fetched> {
        if self.tokens(layer) == 0 {
            return shape_err!("layer {layer} holds no tokens to fetch");
        }
        let fetched = self.step(layer, None, true).await?;
        fetched.ok_or_else(|| XqError::Gpu("fetch produced nothing".into()))
    }

    async fn step(
        &mut self,
        layer: usize,
        input: Option<(KvInput<'_>, KvInput<'_>)>,
        fetch: bool,
    ) -> Result<Option<Fetched>> {
        self.ctx.check()?;
        if layer >= self.layers.len() {
            return shape_err!(
                "layer {layer} does not exist (the set has {})",
                self.layers.len()
            );
        }
        let inputs = match input {
            Some((k, v)) => Some(Inputs::prepare(
                &self.ctx,
                &self.model,
                self.config.quant.params,
                k,
                v,
            )?),
            None => None,
        };
        let t = inputs.as_ref().map_or(0, |i| i.tokens);
        let len = self.layers[layer].key.len();
        let role = self.layers[layer].role;
        let reference = self.config.decode_policy == DecodePolicy::Reference;
        let readers = self.readers(layer);
        if !reference {
            check_budget(layer, len, t, self.config.max_ctx)?;
        }
        let publishes = reference && t > 0 && role.role == Role::Anchor;
        if publishes {
            self.coordinator
                .check_publish(role.group, len, t, readers)?;
        }
        let m = self.model;
        let out = self.config.output;
        let outputs = match fetch {
            true => Some(
                self.scratch
                    .get(&self.ctx, m.rows(), len + t, m.head_dim, out)?,
            ),
            false => None,
        };
        // Published anchor codes (reference policy) for this call's tokens.
        let reads = reference && t > 0 && role.role == Role::Reuse;
        let published = if reads {
            self.coordinator.peek(role.group, len)
        } else {
            None
        };
        if !reference && t > 0 {
            let l = &mut self.layers[layer];
            l.key.reserve(&self.ctx, t, false)?;
            l.value.reserve(&self.ctx, t, false)?;
        }
        let anchor_idx = anchor_of(layer, self.config.quant.group_size);
        let ctx = self.ctx.clone();
        let (before, rest) = self.layers.split_at_mut(layer);
        let this = &mut rest[0];
        let anchor_layer = (anchor_idx < layer).then(|| &before[anchor_idx]);
        ctx.run("update_and_fetch", |enc| {
            if let Some(inputs) = &inputs {
                for (kind, x) in [
                    (KvKind::Key, inputs.keys.tensor()),
                    (KvKind::Value, inputs.values.tensor()),
                ] {
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
                        let anchor = anchor_layer.map(|a| a.store(kind));
                        store.append_window(&ctx, enc, &x.cache_view(), t, anchor, out)?;
                    }
                }
            }
            if let Some([k_out, v_out]) = &outputs {
                this.key.encode_fetch(&ctx, enc, k_out, out)?;
                this.value.encode_fetch(&ctx, enc, v_out, out)?;
            }
            Ok(())
        })
        .await?;
        if publishes {
            if let (Some(k), Some(v)) = (this.key.last_page_codes(), this.value.last_page_codes()) {
                self.coordinator
                    .publish(role.group, len, t, readers, (k, v))?;
            }
        }
        if reads {
            match published {
                Some(_) => self.coordinator.consume(role.group, len),
                None => self.coordinator.fell_back(role.group, len),
            }
        }
        outputs.map(|o| fetched(&m, o, len + t, out)).transpose()
    }

    /// Reads a fetched tensor back to the host as f32.
    pub async fn read(&self, t: &GpuTensor) -> Result<Vec<f32>> {
        self.ctx.read_f32(t).await
    }

    /// Per-layer and total accounting.
    pub fn stats(&self) -> CacheStats {
        let mut layers = Vec::with_capacity(self.layers.len());
        for (i, l) in self.layers.iter().enumerate() {
            let (k, v): (StoreBytes, StoreBytes) = (l.key.bytes(), l.value.bytes());
            layers.push(LayerStats {
                layer: i,
                role: l.role.role,
                group: l.role.group,
                tokens: l.key.len(),
                window_tokens: l.key.window_tokens(),
                effective_bits: effective_bits(
                    (k.accounted + v.accounted) as usize,
                    (k.fp16 + v.fp16) as usize,
                ),
                key_effective_bits: effective_bits(k.accounted as usize, k.fp16 as usize),
                value_effective_bits: effective_bits(v.accounted as usize, v.fp16 as usize),
                accounted_bytes: k.accounted + v.accounted,
                allocated_bytes: k.allocated + v.allocated,
                fp16_bytes: k.fp16 + v.fp16,
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
            scratch_bytes: self.scratch.bytes(),
            live_tokens: self.coordinator.live_tokens(),
            layers,
        }
    }

    /// The most by which `layer`'s allocated bytes may exceed its accounted bytes (f16
    /// params): its window rings plus one unfilled page, for K and V.
    pub fn slack_bound(&self, layer: usize) -> u64 {
        self.layers
            .get(layer)
            .map_or(0, |l| l.key.slack_bound() + l.value.slack_bound())
    }

    /// Frees every buffer and forgets every token; the set stays usable.
    pub fn reset(&mut self) {
        for l in &mut self.layers {
            l.key.clear();
            l.value.clear();
        }
        self.scratch.clear();
        self.coordinator.clear();
    }

    /// The GPU context.
    pub fn context(&self) -> &Arc<GpuContext> {
        &self.ctx
    }
}

impl Drop for CacheSet {
    fn drop(&mut self) {
        self.reset();
    }
}

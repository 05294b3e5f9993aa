//! The interface every cache set offers a runtime: append K/V, attend over them where they
//! live, or fetch them dense. Implemented by the XQuant [`CacheSet`](crate::cache::CacheSet)
//! and the plain [`Fp16CacheSet`](crate::cache::Fp16CacheSet).

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::cache::config::ModelSpec;
use crate::cache::io::{Fetched, Inputs, KvInput};
use crate::cache::persist::SaveJob;
use crate::config::ParamsPrecision;
use crate::error::Result;
use crate::gpu::kernels::attention::AttendOptions;
use crate::gpu::{GpuContext, GpuTensor};

/// The future of a cache call (not `Send`: on the web everything runs on one thread).
pub type CacheFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + 'a>>;

/// A snapshot of a set's bookkeeping taken before encoding (cheap: buffers are shared by
/// reference). Holding it until the submission is done also keeps alive every buffer the
/// encoding replaced (a grown window ring, a grown scratch buffer).
pub struct Checkpoint(pub(crate) Box<dyn Any>);

/// What a [`Checkpoint`] covers besides the set's scratch buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Nothing else (attention and fetches change no layer).
    Scratch,
    /// One layer's bookkeeping.
    Layer(usize),
    /// Every layer's.
    All,
}

impl Scope {
    /// Copies of the layers this scope covers, with their indices.
    pub(crate) fn layers<L: Clone>(self, layers: &[L]) -> Vec<(usize, L)> {
        match self {
            Scope::Scratch => Vec::new(),
            Scope::Layer(l) => layers
                .get(l)
                .map(|c| vec![(l, c.clone())])
                .unwrap_or_default(),
            Scope::All => layers.iter().cloned().enumerate().collect(),
        }
    }
}

/// One KV cache per attention layer of a model.
///
/// The `encode_*` methods record into the caller's command encoder, so a runtime can put a
/// whole decode step (every layer's append and attention, and its own kernels) into one
/// submission. They change the set's bookkeeping as they record; take a [`Checkpoint`]
/// first, keep it until the submission has been made, and [`KvCache::rollback`] to it if
/// recording or the submission fails. The async methods do exactly that around one call:
/// a call that fails changes nothing.
pub trait KvCache {
    /// The GPU context the set lives on.
    fn context(&self) -> &Arc<GpuContext>;

    /// The model geometry.
    fn model(&self) -> &ModelSpec;

    /// Tokens appended to `layer`, which is the position of the next one (0 for a layer
    /// that does not exist).
    fn tokens(&self, layer: usize) -> usize;

    /// Tokens `layer` still holds: its last `held_tokens` positions, what a fetch returns.
    /// Every token, except in a sliding-window layer, which drops what falls out of its
    /// window (it holds at least the window).
    fn held_tokens(&self, layer: usize) -> usize {
        self.tokens(layer)
    }

    /// GPU bytes of the caches' storage (every layer's buffers).
    fn storage_bytes(&self) -> u64;

    /// GPU bytes of the set's scratch: attention partials and reused fetch outputs.
    fn scratch_bytes(&self) -> u64;

    /// Accounted bits per cached element, K and V of every layer (16 for f16).
    fn effective_bits(&self) -> f64;

    /// Tokens of `layer` held unquantized (the f16 window; every token of an f16 cache).
    fn unquantized_tokens(&self, layer: usize) -> usize;

    /// The precision host inputs are checked against (f16 params bound values to ±16000).
    fn input_params(&self) -> ParamsPrecision;

    /// Frees every buffer and forgets every token; the set stays usable.
    fn reset(&mut self);

    /// Snapshot of the set's scratch and the bookkeeping `scope` names.
    fn checkpoint(&self, scope: Scope) -> Checkpoint;

    /// Restores a snapshot taken by [`KvCache::checkpoint`] on this set.
    fn rollback(&mut self, checkpoint: Checkpoint);

    /// Records appending `keys`/`values` (`[batch, kv_heads, tokens, head_dim]`, f32 or f16,
    /// on this device) to `layer`. Layers are expected in order 0..L-1 each step.
    fn encode_append(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        layer: usize,
        keys: &GpuTensor,
        values: &GpuTensor,
    ) -> Result<()>;

    /// Records attention of `queries` (`[batch, query_heads, T, head_dim]`, f32 or f16) over
    /// every token `layer` holds, read where they live, into `out` (f32 or f16, laid out as
    /// `options.layout` says). By default the queries are the layer's last `T` tokens and
    /// each sees the tokens up to its own (causal).
    fn encode_attend(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        layer: usize,
        queries: &GpuTensor,
        out: &GpuTensor,
        options: &AttendOptions,
    ) -> Result<()>;

    /// Records writing every token `layer` holds, reconstructed, into `keys`/`values`
    /// (`[batch, kv_heads, held, head_dim]` with `held` = [`KvCache::held_tokens`], f32 or
    /// f16, caller-owned).
    fn encode_fetch_into(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        layer: usize,
        keys: &GpuTensor,
        values: &GpuTensor,
    ) -> Result<()>;

    /// Records a fetch into the set's two reused output buffers (valid until the set's next
    /// call is submitted; a later call may replace them with larger ones).
    fn encode_fetch(&mut self, enc: &mut wgpu::CommandEncoder, layer: usize) -> Result<Fetched>;

    /// Appends `keys`/`values` to `layer` (prefill: many tokens; decode: one or a few).
    fn append<'a>(
        &'a mut self,
        layer: usize,
        keys: KvInput<'a>,
        values: KvInput<'a>,
    ) -> CacheFuture<'a, ()> {
        Box::pin(async move {
            self.context().check()?;
            let inputs = Inputs::prepare(
                self.context(),
                self.model(),
                self.input_params(),
                keys,
                values,
            )?;
            submit(self, Scope::Layer(layer), "append", |s, enc| {
                s.encode_append(enc, layer, inputs.keys.tensor(), inputs.values.tensor())
            })
            .await
        })
    }

    /// Attention of `queries` over `layer`'s tokens into `out` (see
    /// [`KvCache::encode_attend`]); with [`KvCache::append`] first, a decode step.
    fn attend<'a>(
        &'a mut self,
        layer: usize,
        queries: &'a GpuTensor,
        out: &'a GpuTensor,
    ) -> CacheFuture<'a, ()> {
        self.attend_with(layer, queries, out, AttendOptions::default())
    }

    /// [`KvCache::attend`] with options (query positions, scale, output layout).
    fn attend_with<'a>(
        &'a mut self,
        layer: usize,
        queries: &'a GpuTensor,
        out: &'a GpuTensor,
        options: AttendOptions,
    ) -> CacheFuture<'a, ()> {
        Box::pin(async move {
            self.context().check()?;
            submit(self, Scope::Scratch, "attend", |s, enc| {
                s.encode_attend(enc, layer, queries, out, &options)
            })
            .await
        })
    }

    /// Writes every token of `layer`, reconstructed, into caller-owned `keys`/`values`.
    fn fetch_into<'a>(
        &'a mut self,
        layer: usize,
        keys: &'a GpuTensor,
        values: &'a GpuTensor,
    ) -> CacheFuture<'a, ()> {
        Box::pin(async move {
            self.context().check()?;
            submit(self, Scope::Scratch, "fetch", |s, enc| {
                s.encode_fetch_into(enc, layer, keys, values)
            })
            .await
        })
    }

    /// Appends and returns the reconstruction of every token so far (dense K/V for
    /// runtimes that attend themselves), in the set's reused output buffers.
    fn update_and_fetch<'a>(
        &'a mut self,
        layer: usize,
        keys: KvInput<'a>,
        values: KvInput<'a>,
    ) -> CacheFuture<'a, Fetched> {
        Box::pin(async move {
            self.context().check()?;
            let inputs = Inputs::prepare(
                self.context(),
                self.model(),
                self.input_params(),
                keys,
                values,
            )?;
            submit(self, Scope::Layer(layer), "update_and_fetch", |s, enc| {
                s.encode_append(enc, layer, inputs.keys.tensor(), inputs.values.tensor())?;
                s.encode_fetch(enc, layer)
            })
            .await
        })
    }

    /// The reconstruction of every token `layer` holds, in the set's reused output buffers.
    fn fetch(&mut self, layer: usize) -> CacheFuture<'_, Fetched> {
        Box::pin(async move {
            self.context().check()?;
            submit(self, Scope::Scratch, "fetch", |s, enc| {
                s.encode_fetch(enc, layer)
            })
            .await
        })
    }

    /// Records copying everything the set holds into staging buffers; the returned job
    /// reads them back into the saved file once the encoder is submitted (the set may change
    /// after the submission: the copies hold what it was). See `KvCache::save`.
    fn encode_save(&self, enc: &mut wgpu::CommandEncoder) -> Result<SaveJob>;

    /// The set as bytes: a versioned, checksummed container holding its plan, options,
    /// bookkeeping and the packed data exactly as stored (nothing re-quantized), restored by
    /// [`CacheSet::restore`](crate::cache::CacheSet::restore) /
    /// [`Fp16CacheSet::restore`](crate::cache::Fp16CacheSet::restore) (or
    /// [`restore_cache`](crate::cache::restore_cache) for either) into a set that continues
    /// bit for bit. One submission of copies, then readback (awaited, never blocking on the
    /// web).
    fn save(&self) -> CacheFuture<'_, Vec<u8>> {
        Box::pin(async move {
            let ctx = self.context().clone();
            let job = ctx.run("save cache", |enc| self.encode_save(enc)).await?;
            job.finish(&ctx).await
        })
    }

    /// Reads a tensor back to the host as f32.
    fn read<'a>(&'a self, t: &'a GpuTensor) -> CacheFuture<'a, Vec<f32>> {
        Box::pin(async move { self.context().read_f32(t).await })
    }
}

/// Runs `encode` in one submission; on any failure restores the set as it was.
async fn submit<S: KvCache + ?Sized, T>(
    set: &mut S,
    scope: Scope,
    label: &str,
    encode: impl FnOnce(&mut S, &mut wgpu::CommandEncoder) -> Result<T>,
) -> Result<T> {
    let checkpoint = set.checkpoint(scope);
    let ctx = set.context().clone();
    let out = ctx.run(label, |enc| encode(set, enc)).await;
    if out.is_err() {
        set.rollback(checkpoint);
    }
    out
}

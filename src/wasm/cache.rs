//! `CacheSetCore`: a cache set for the facade's `CacheSet` class.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use js_sys::{Array, Float32Array, Promise};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;

use crate::cache::{CacheSet, Fetched, KvCache, KvInput};
use crate::config::DType;
use crate::error::{Result, XqError};
use crate::wasm::convert::{object, HostData};
use crate::wasm::errors::{to_js, usage_error};

/// Where the set is: ready, lent to the call now running, or freed.
pub(crate) enum Slot {
    Ready(CacheSet),
    Busy,
    Freed,
}

type Shared = Rc<RefCell<Slot>>;

const IN_FLIGHT: &str = "another call on this cache set is still running; await it first";
const FREED: &str = "this cache set was freed";

/// A cache set; `release()` frees its GPU buffers at once (the facade's `free()`), or as
/// soon as a call still running ends.
#[wasm_bindgen]
pub struct CacheSetCore {
    set: Shared,
    /// Released while a call was running: the set is dropped when that call ends.
    closing: Rc<Cell<bool>>,
}

impl CacheSetCore {
    pub(crate) fn new(set: CacheSet) -> Self {
        CacheSetCore {
            set: Rc::new(RefCell::new(Slot::Ready(set))),
            closing: Rc::new(Cell::new(false)),
        }
    }

    /// Runs `f` on the set now (no await): stats, reset.
    fn now<T>(&self, f: impl FnOnce(&mut CacheSet) -> T) -> std::result::Result<T, JsValue> {
        match &mut *self.set.borrow_mut() {
            Slot::Ready(s) => Ok(f(s)),
            Slot::Busy => Err(usage_error(IN_FLIGHT)),
            Slot::Freed => Err(usage_error(FREED)),
        }
    }
}

fn input(v: &HostData) -> KvInput<'_> {
    match v {
        HostData::F32(x) => KvInput::F32(x),
        HostData::F16(x) => KvInput::F16(x),
    }
}

/// Lends the set to `f` for the length of one async call: a second call meanwhile gets a
/// `UsageError`; a release meanwhile drops the set when `f` is done.
fn lend<F, Fut>(core: &CacheSetCore, f: F) -> Promise
where
    F: FnOnce(CacheSet) -> Fut + 'static,
    Fut: std::future::Future<Output = (CacheSet, Result<JsValue>)> + 'static,
{
    let (slot, closing) = (core.set.clone(), core.closing.clone());
    future_to_promise(async move {
        // A statement of its own: the borrow must end before the slot is written again.
        let taken = std::mem::replace(&mut *slot.borrow_mut(), Slot::Busy);
        let set = match taken {
            Slot::Ready(s) => s,
            other => {
                let busy = matches!(other, Slot::Busy);
                *slot.borrow_mut() = other;
                return Err(usage_error(if busy { IN_FLIGHT } else { FREED }));
            }
        };
        let (set, out) = f(set).await;
        *slot.borrow_mut() = if closing.get() {
            Slot::Freed
        } else {
            Slot::Ready(set)
        };
        out.map_err(to_js)
    })
}

/// Parses a call's inputs and checks its token count.
fn inputs(
    set: &CacheSet,
    keys: &JsValue,
    values: &JsValue,
    tokens: f64,
) -> Result<(HostData, HostData)> {
    let k = HostData::from_js(keys, "keys")?;
    let v = HostData::from_js(values, "values")?;
    if !(tokens.fract() == 0.0 && tokens >= 1.0) {
        return Err(XqError::Shape(format!(
            "tokens must be a positive integer, got {tokens}"
        )));
    }
    let per_token = set.model().rows() * set.model().head_dim;
    if k.len() != tokens as usize * per_token {
        return Err(XqError::Shape(format!(
            "keys hold {} values, not {tokens} tokens of {per_token}",
            k.len()
        )));
    }
    Ok((k, v))
}

/// Checks a call's inputs and runs the set's `update_and_fetch` on them.
async fn update(
    set: &mut CacheSet,
    layer: f64,
    keys: &JsValue,
    values: &JsValue,
    tokens: f64,
) -> Result<Fetched> {
    let (k, v) = inputs(set, keys, values, tokens)?;
    set.update_and_fetch(layer_index(layer)?, input(&k), input(&v))
        .await
}

#[wasm_bindgen]
impl CacheSetCore {
    /// Appends `tokens` tokens (`[batch, kvHeads, tokens, headDim]` typed arrays) to `layer`
    /// and resolves to `{ keys, values, tokens }`: every token's reconstruction, Float32Arrays.
    #[wasm_bindgen(js_name = updateAndFetch)]
    pub fn update_and_fetch(
        &self,
        layer: f64,
        keys: JsValue,
        values: JsValue,
        tokens: f64,
    ) -> Promise {
        lend(self, move |mut s| async move {
            let out = async {
                let f = update(&mut s, layer, &keys, &values, tokens).await?;
                let kh = s.read(&f.keys).await?;
                let vh = s.read(&f.values).await?;
                Ok(object(&[
                    ("keys", Float32Array::from(kh.as_slice()).into()),
                    ("values", Float32Array::from(vh.as_slice()).into()),
                    ("tokens", (f.tokens as f64).into()),
                ]))
            }
            .await;
            (s, out)
        })
    }

    /// As `updateAndFetch`, resolving to `{ keys, values, tokens, dtype, byteLength }` with
    /// `GPUBuffer`s (valid until the next call on this set; read `byteLength` bytes).
    #[wasm_bindgen(js_name = updateAndFetchGpu)]
    pub fn update_and_fetch_gpu(
        &self,
        layer: f64,
        keys: JsValue,
        values: JsValue,
        tokens: f64,
    ) -> Promise {
        lend(self, move |mut s| async move {
            let out = async {
                let f = update(&mut s, layer, &keys, &values, tokens).await?;
                let dtype = s.config().output;
                let gpu = |t: &crate::gpu::GpuTensor| -> JsValue {
                    t.buffer().as_webgpu().map_or(JsValue::NULL, |b| {
                        let v: &JsValue = b.as_ref();
                        v.clone()
                    })
                };
                let bytes = f.keys.shape().len() * dtype.size();
                Ok(object(&[
                    ("keys", gpu(&f.keys)),
                    ("values", gpu(&f.values)),
                    ("tokens", (f.tokens as f64).into()),
                    (
                        "dtype",
                        if dtype == DType::F16 { "f16" } else { "f32" }.into(),
                    ),
                    ("byteLength", (bytes as f64).into()),
                ]))
            }
            .await;
            (s, out)
        })
    }

    /// Per-layer and total accounting.
    pub fn stats(&self) -> std::result::Result<JsValue, JsValue> {
        let st = self.now(|s| s.stats())?;
        let layers: Array = st
            .layers
            .iter()
            .map(|l| {
                object(&[
                    ("layer", (l.layer as f64).into()),
                    ("role", l.role.name().into()),
                    ("group", (l.group as f64).into()),
                    ("tokens", (l.tokens as f64).into()),
                    ("windowTokens", (l.window_tokens as f64).into()),
                    ("effectiveBits", l.effective_bits.into()),
                    ("keyEffectiveBits", l.key_effective_bits.into()),
                    ("valueEffectiveBits", l.value_effective_bits.into()),
                    ("accountedBytes", (l.accounted_bytes as f64).into()),
                    ("allocatedBytes", (l.allocated_bytes as f64).into()),
                    ("fp16Bytes", (l.fp16_bytes as f64).into()),
                ])
            })
            .collect();
        let totals = object(&[
            ("effectiveBits", st.effective_bits.into()),
            ("accountedBytes", (st.accounted_bytes as f64).into()),
            ("allocatedBytes", (st.allocated_bytes as f64).into()),
            ("fp16Bytes", (st.fp16_bytes as f64).into()),
            ("ratioVsFp16", st.ratio_vs_fp16.into()),
            ("scratchBytes", (st.scratch_bytes as f64).into()),
            ("liveTokens", (st.live_tokens as f64).into()),
        ]);
        Ok(object(&[("layers", layers.into()), ("totals", totals)]))
    }

    /// Forgets every token and frees the buffers; the set stays usable.
    pub fn reset(&self) -> std::result::Result<(), JsValue> {
        self.now(|s| s.reset())
    }

    /// Frees the set now (its GPU buffers are destroyed), or when the call still running
    /// ends; later calls throw a `UsageError`.
    pub fn release(&self) {
        self.closing.set(true);
        let mut slot = self.set.borrow_mut();
        if !matches!(*slot, Slot::Busy) {
            *slot = Slot::Freed;
        }
    }
}

fn layer_index(layer: f64) -> Result<usize> {
    if layer.fract() == 0.0 && (0.0..1e9).contains(&layer) {
        Ok(layer as usize)
    } else {
        Err(XqError::Shape(format!(
            "layer must be a non-negative integer, got {layer}"
        )))
    }
}

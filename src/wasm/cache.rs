//! `CacheSetCore`: a cache set for the facade's `CacheSet` class.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use js_sys::{Array, Float32Array, Promise};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;

use crate::cache::{CacheSet, KvInput};
use crate::config::DType;
use crate::error::{Result, XqError};
use crate::wasm::convert::{object, HostData};
use crate::wasm::errors::{to_js, usage_error};

type Shared = Rc<RefCell<Option<CacheSet>>>;

/// A cache set; `release()` frees its GPU buffers at once (the facade's `free()`), or as
/// soon as a call still running ends.
#[wasm_bindgen]
pub struct CacheSetCore {
    set: Shared,
    /// Released while a call was running: the call drops the set when it ends.
    closing: Rc<Cell<bool>>,
}

impl CacheSetCore {
    pub(crate) fn new(set: Shared) -> Self {
        CacheSetCore {
            set,
            closing: Rc::new(Cell::new(false)),
        }
    }

    fn check_open(&self) -> std::result::Result<(), JsValue> {
        if self.closing.get() {
            return Err(usage_error("this cache set was freed"));
        }
        Ok(())
    }
}

const IN_FLIGHT: &str = "another call on this cache set is still running; await it first";

fn input(v: &HostData) -> KvInput<'_> {
    match v {
        HostData::F32(x) => KvInput::F32(x),
        HostData::F16(x) => KvInput::F16(x),
    }
}

/// Runs `f` on the set, refusing a freed set or a call while another is in flight; drops
/// the set afterwards if it was released meanwhile.
fn with_set<F, Fut>(core: &CacheSetCore, f: F) -> Promise
where
    F: FnOnce(Shared) -> Fut + 'static,
    Fut: std::future::Future<Output = Result<JsValue>> + 'static,
{
    let (set, closing) = (core.set.clone(), core.closing.clone());
    future_to_promise(async move {
        if closing.get() {
            return Err(usage_error("this cache set was freed"));
        }
        match set.try_borrow() {
            Err(_) => return Err(usage_error(IN_FLIGHT)),
            Ok(s) if s.is_none() => return Err(usage_error("this cache set was freed")),
            Ok(_) => {}
        }
        let out = f(set.clone()).await.map_err(to_js);
        if closing.get() {
            *set.borrow_mut() = None;
        }
        out
    })
}

/// Parses a call's inputs and checks its token count.
fn inputs(keys: &JsValue, values: &JsValue, tokens: f64) -> Result<(HostData, HostData, usize)> {
    let k = HostData::from_js(keys, "keys")?;
    let v = HostData::from_js(values, "values")?;
    if !(tokens.fract() == 0.0 && tokens >= 1.0) {
        return Err(XqError::Shape(format!(
            "tokens must be a positive integer, got {tokens}"
        )));
    }
    Ok((k, v, tokens as usize))
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
        with_set(self, move |set| async move {
            let (k, v, t) = inputs(&keys, &values, tokens)?;
            let mut guard = set.borrow_mut();
            let s = guard
                .as_mut()
                .ok_or_else(|| XqError::Config("freed".into()))?;
            let per_token = s.model().rows() * s.model().head_dim;
            if k.len() != t * per_token {
                return Err(XqError::Shape(format!(
                    "keys hold {} values, not {t} tokens of {per_token}",
                    k.len()
                )));
            }
            let f = s
                .update_and_fetch(layer_index(layer)?, input(&k), input(&v))
                .await?;
            let kh = s.read(&f.keys).await?;
            let vh = s.read(&f.values).await?;
            Ok(object(&[
                ("keys", Float32Array::from(kh.as_slice()).into()),
                ("values", Float32Array::from(vh.as_slice()).into()),
                ("tokens", (f.tokens as f64).into()),
            ]))
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
        with_set(self, move |set| async move {
            let (k, v, t) = inputs(&keys, &values, tokens)?;
            let mut guard = set.borrow_mut();
            let s = guard
                .as_mut()
                .ok_or_else(|| XqError::Config("freed".into()))?;
            let per_token = s.model().rows() * s.model().head_dim;
            if k.len() != t * per_token {
                return Err(XqError::Shape(format!(
                    "keys hold {} values, not {t} tokens of {per_token}",
                    k.len()
                )));
            }
            let f = s
                .update_and_fetch(layer_index(layer)?, input(&k), input(&v))
                .await?;
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
        })
    }

    /// Per-layer and total accounting.
    pub fn stats(&self) -> std::result::Result<JsValue, JsValue> {
        self.check_open()?;
        let guard = self.set.try_borrow().map_err(|_| usage_error(IN_FLIGHT))?;
        let s = guard
            .as_ref()
            .ok_or_else(|| usage_error("this cache set was freed"))?;
        let st = s.stats();
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
        self.check_open()?;
        let mut guard = self
            .set
            .try_borrow_mut()
            .map_err(|_| usage_error(IN_FLIGHT))?;
        guard
            .as_mut()
            .ok_or_else(|| usage_error("this cache set was freed"))?
            .reset();
        Ok(())
    }

    /// Frees the set now (its GPU buffers are destroyed), or when the call still running
    /// ends; later calls throw a `UsageError`.
    pub fn release(&self) {
        self.closing.set(true);
        if let Ok(mut guard) = self.set.try_borrow_mut() {
            *guard = None;
        }
    }
}

fn layer_index(layer: f64) -> Result<usize> {
    if layer.fract() == 0.0 && layer >= 0.0 && layer < 1e9 {
        Ok(layer as usize)
    } else {
        Err(XqError::Shape(format!(
            "layer must be a non-negative integer, got {layer}"
        )))
    }
}

//! `ModelCore`, `GenerationCore` and `F16CacheCore`: the model runtime (the same Rust
//! [`Runtime`] and [`Decoder`] the CLI runs) for the facade's `Model` and `Generation`.

use std::cell::{RefCell, RefMut};
use std::rc::Rc;
use std::sync::Arc;

use js_sys::{Array, Function, Promise, Uint8Array};
use wasm_bindgen::prelude::*;
use wasm_bindgen::JsCast;
use wasm_bindgen_futures::future_to_promise;

use crate::cache::{CacheSet, Fp16CacheSet, KvCache, SavedCache, SavedKind};
use crate::config::DType;
use crate::error::{Result, XqError};
use crate::gpu::GpuContext;
use crate::model::{Decoder, Runtime, Sampling, TextStream};
use crate::wasm::cache::CacheSetCore;
use crate::wasm::convert::{field, int, num, object};
use crate::wasm::errors::{in_scopes, to_js, usage_error};
use crate::wasm::options;

const FREED_CACHE: &str = "this generation's cache was freed";
const BUSY_CACHE: &str =
    "the cache is in the middle of another call (one generation or call at a time per cache)";
const BUSY_GENERATION: &str = "this generation is already computing its next token";

/// Loads a GGUF's bytes onto `ctx` (inside error scopes of its own, so a shared device's
/// handler never sees our upload errors).
pub(crate) async fn load_model(ctx: Arc<GpuContext>, bytes: Vec<u8>) -> Result<ModelCore> {
    let device = ctx.device().clone();
    let (rt, ok) = in_scopes(&device, || Runtime::load(ctx, &bytes));
    drop(bytes);
    let rt = rt?;
    ok.await?;
    Ok(ModelCore { rt: Rc::new(rt) })
}

/// A loaded model: weights on the GPU, its tokenizer.
#[wasm_bindgen]
pub struct ModelCore {
    rt: Rc<Runtime>,
}

#[wasm_bindgen]
impl ModelCore {
    /// `{ architecture, layers, heads, kvHeads, headDim, hidden, ffn, vocab, contextLength,
    /// eosToken, bosToken, addBos, chatTemplate, attentionWindows }`.
    pub fn info(&self) -> JsValue {
        let c = self.rt.model.cfg;
        let windows: js_sys::Array = self
            .rt
            .attention_windows()
            .iter()
            .map(|w| w.map_or(JsValue::NULL, |w| (w as f64).into()))
            .collect();
        object(&[
            ("attentionWindows", windows.into()),
            ("architecture", c.family.name().into()),
            ("layers", (c.layers as f64).into()),
            ("heads", (c.heads as f64).into()),
            ("kvHeads", (c.kv_heads as f64).into()),
            ("headDim", (c.head_dim as f64).into()),
            ("hidden", (c.hidden as f64).into()),
            ("ffn", (c.ffn as f64).into()),
            ("vocab", (c.vocab as f64).into()),
            ("contextLength", (c.context as f64).into()),
            ("eosToken", (self.rt.tokenizer.eos as f64).into()),
            ("bosToken", (self.rt.tokenizer.bos as f64).into()),
            ("addBos", self.rt.tokenizer.add_bos.into()),
            ("chatTemplate", self.rt.tokenizer.has_chat_template().into()),
        ])
    }

    /// Token ids of `text`; with `special`, control tokens such as `<|im_start|>` are
    /// recognised in the text; with `bos`, BOS comes first where the model wants it (Gemma).
    pub fn tokenize(&self, text: &str, special: bool, bos: bool) -> Vec<u32> {
        match bos {
            true => self.rt.tokenizer.encode_prompt(text, special),
            false => self.rt.tokenizer.encode(text, special),
        }
    }

    /// The text of token ids (invalid UTF-8 replaced; unknown ids skipped).
    pub fn detokenize(&self, ids: Vec<u32>) -> String {
        self.rt.tokenizer.decode(&ids)
    }

    /// The chat template over `[{ role, content }]`.
    #[wasm_bindgen(js_name = chatTemplate)]
    pub fn chat_template(
        &self,
        messages: JsValue,
        add_generation_prompt: bool,
    ) -> std::result::Result<String, JsValue> {
        let read = || -> Result<String> {
            let Some(list) = messages.dyn_ref::<Array>() else {
                return Err(XqError::Config(
                    "chatTemplate: messages must be an array of { role, content }".into(),
                ));
            };
            let mut pairs = Vec::new();
            for (i, m) in list.iter().enumerate() {
                let role = field(&m, "role").and_then(|v| v.as_string());
                let content = field(&m, "content").and_then(|v| v.as_string());
                let (Some(role), Some(content)) = (role, content) else {
                    return Err(XqError::Config(format!(
                        "chatTemplate: messages[{i}] must be {{ role: string, content: string }}"
                    )));
                };
                pairs.push((role, content));
            }
            let refs: Vec<(&str, &str)> = pairs
                .iter()
                .map(|(r, c)| (r.as_str(), c.as_str()))
                .collect();
            self.rt.tokenizer.chat(&refs, add_generation_prompt)
        };
        read().map_err(to_js)
    }

    /// An f16 cache for this model, holding up to `max_ctx` tokens.
    #[wasm_bindgen(js_name = f16Cache)]
    pub fn f16_cache(&self, max_ctx: usize) -> std::result::Result<F16CacheCore, JsValue> {
        let ctx = self.rt.model.context().clone();
        let set = Fp16CacheSet::for_model(ctx, self.rt.spec(), max_ctx, DType::F16)
            .and_then(|s| s.with_attention_windows(&self.rt.attention_windows()))
            .map_err(to_js)?;
        Ok(F16CacheCore::new(set))
    }

    /// A generation over an XQuant cache set (continuing after the tokens it holds).
    #[wasm_bindgen(js_name = generateXQuant)]
    pub fn generate_xquant(
        &self,
        cache: &CacheSetCore,
        options: JsValue,
    ) -> std::result::Result<GenerationCore, JsValue> {
        self.generation(Slot::XQuant(cache.shared()), &options)
    }

    /// A generation over an f16 cache (continuing after the tokens it holds).
    #[wasm_bindgen(js_name = generateF16)]
    pub fn generate_f16(
        &self,
        cache: &F16CacheCore,
        options: JsValue,
    ) -> std::result::Result<GenerationCore, JsValue> {
        self.generation(Slot::F16(cache.set.clone()), &options)
    }

    /// A saved cache (`save()` of a cache set or f16 cache) restored for this model:
    /// resolves to `{ kind: 'xquant' | 'f16', cache }`; a cache saved for another model
    /// shape is a FormatError.
    #[wasm_bindgen(js_name = restoreCache)]
    pub fn restore_cache(&self, bytes: Vec<u8>) -> Promise {
        let rt = self.rt.clone();
        future_to_promise(async move {
            let restore = async {
                let saved = SavedCache::inspect(&bytes)?;
                saved.check_model(&rt.spec())?;
                let ctx = rt.model.context().clone();
                Ok::<_, XqError>(match saved.kind {
                    SavedKind::XQuant => (
                        "xquant",
                        CacheSetCore::new(CacheSet::restore(ctx, &bytes).await?).into(),
                    ),
                    SavedKind::Fp16 => {
                        let set = Fp16CacheSet::restore(ctx, &bytes).await?;
                        ("f16", F16CacheCore::new(set).into())
                    }
                })
            };
            let (kind, cache): (&str, JsValue) = restore.await.map_err(to_js)?;
            Ok(object(&[("kind", kind.into()), ("cache", cache)]))
        })
    }

    /// The K/V safetensors bytes of `text` run through the model with an f16 cache (what
    /// `analyzeKv`, `kvSimilarity` and `suggestPlan` read); with `{ queries: true }` also every
    /// layer's queries `q.{i}`, by which `suggestPlan` judges plans.
    pub fn capture(&self, text: String, options: JsValue) -> Promise {
        if let Err(e) = options::CAPTURE.check(&options) {
            return Promise::reject(&to_js(e));
        }
        let queries = field(&options, "queries").and_then(|v| v.as_bool()) == Some(true);
        let rt = self.rt.clone();
        future_to_promise(async move {
            let ids = rt.tokenizer.encode(&text, true);
            if ids.is_empty() {
                return Err(to_js(XqError::Shape(
                    "capture: the text has no tokens".into(),
                )));
            }
            let bytes = rt.capture_file(&ids, queries).await.map_err(to_js)?;
            Ok(Uint8Array::from(bytes.as_slice()).into())
        })
    }
}

impl ModelCore {
    fn generation(
        &self,
        cache: Slot,
        options: &JsValue,
    ) -> std::result::Result<GenerationCore, JsValue> {
        let read = || -> Result<(Sampling, usize)> {
            options::GENERATE.check(options)?;
            let d = Sampling::default();
            let sampling = Sampling {
                temperature: num(options, "temperature", d.temperature as f64)? as f32,
                top_k: int(options, "topK", d.top_k)?,
                top_p: num(options, "topP", d.top_p as f64)? as f32,
                seed: int(options, "seed", d.seed as usize)? as u64,
            };
            Ok((sampling, int(options, "maxTokens", 128)?))
        };
        let (sampling, max_tokens) = read().map_err(to_js)?;
        let decoder = Decoder::new(sampling, max_tokens).map_err(to_js)?;
        {
            let mut guard = cache.borrow()?;
            self.rt.check_cache(guard.cache()?).map_err(to_js)?;
        }
        Ok(GenerationCore {
            rt: self.rt.clone(),
            cache,
            state: Rc::new(RefCell::new(State {
                decoder,
                text: TextStream::default(),
            })),
        })
    }
}

/// The cache a generation fills.
#[derive(Clone)]
enum Slot {
    XQuant(Rc<RefCell<Option<CacheSet>>>),
    F16(Rc<RefCell<Option<Fp16CacheSet>>>),
}

/// A borrowed cache, for the length of one step.
enum Guard<'a> {
    XQuant(RefMut<'a, Option<CacheSet>>),
    F16(RefMut<'a, Option<Fp16CacheSet>>),
}

impl Slot {
    fn borrow(&self) -> std::result::Result<Guard<'_>, JsValue> {
        let busy = |_| usage_error(BUSY_CACHE);
        Ok(match self {
            Slot::XQuant(s) => Guard::XQuant(s.try_borrow_mut().map_err(busy)?),
            Slot::F16(s) => Guard::F16(s.try_borrow_mut().map_err(busy)?),
        })
    }
}

impl Guard<'_> {
    fn cache(&mut self) -> std::result::Result<&mut dyn KvCache, JsValue> {
        let c: Option<&mut dyn KvCache> = match self {
            Guard::XQuant(g) => g.as_mut().map(|c| c as &mut dyn KvCache),
            Guard::F16(g) => g.as_mut().map(|c| c as &mut dyn KvCache),
        };
        c.ok_or_else(|| usage_error(FREED_CACHE))
    }
}

struct State {
    decoder: Decoder,
    text: TextStream,
}

/// One generation: its decoder and text stream, stepped by the facade's async iterator.
#[wasm_bindgen]
pub struct GenerationCore {
    rt: Rc<Runtime>,
    cache: Slot,
    state: Rc<RefCell<State>>,
}

// A step holds its state and its cache across the GPU's await on purpose: every other access
// uses `try_borrow*` and answers a `UsageError` (busy), never a panic.
#[wasm_bindgen]
#[allow(clippy::await_holding_refcell_ref)]
impl GenerationCore {
    /// Feeds the prompt's token ids; `on_progress(done, total)` after each chunk.
    pub fn prefill(&self, prompt: Vec<u32>, on_progress: Option<Function>) -> Promise {
        let (rt, cache, state) = (self.rt.clone(), self.cache.clone(), self.state.clone());
        future_to_promise(async move {
            let Ok(mut st) = state.try_borrow_mut() else {
                return Err(usage_error(BUSY_GENERATION));
            };
            let mut guard = cache.borrow()?;
            let kv = guard.cache()?;
            let report = |done: usize, total: usize| {
                if let Some(f) = &on_progress {
                    let _ = f.call2(
                        &JsValue::NULL,
                        &(done as f64).into(),
                        &(total as f64).into(),
                    );
                }
            };
            st.decoder
                .prefill(&rt, &prompt, kv, report)
                .await
                .map_err(to_js)?;
            Ok(JsValue::UNDEFINED)
        })
    }

    /// The next piece `{ token, text, cacheTokens, kvAllocatedBytes }`, or `null` at the end
    /// (`finish` then says why).
    pub fn next(&self) -> Promise {
        let (rt, cache, state) = (self.rt.clone(), self.cache.clone(), self.state.clone());
        future_to_promise(async move {
            let Ok(mut st) = state.try_borrow_mut() else {
                return Err(usage_error(BUSY_GENERATION));
            };
            let mut guard = cache.borrow()?;
            let kv = guard.cache()?;
            let Some(token) = st.decoder.next(&rt, kv).await.map_err(to_js)? else {
                return Ok(JsValue::NULL);
            };
            let text = st.text.push(&rt.tokenizer.decode_bytes(&[token]));
            Ok(object(&[
                ("token", (token as f64).into()),
                ("text", text.into()),
                ("cacheTokens", (kv.tokens(0) as f64).into()),
                ("kvAllocatedBytes", (kv.storage_bytes() as f64).into()),
            ]))
        })
    }

    /// Text left over at the end (an incomplete UTF-8 character as U+FFFD).
    pub fn flush(&self) -> std::result::Result<String, JsValue> {
        let mut st = self
            .state
            .try_borrow_mut()
            .map_err(|_| usage_error(BUSY_GENERATION))?;
        Ok(st.text.finish())
    }

    /// Why the generation ended: `'eos'`, `'maxTokens'`, or `null` while it goes on.
    pub fn finish(&self) -> JsValue {
        match self
            .state
            .try_borrow()
            .ok()
            .and_then(|s| s.decoder.finish())
        {
            Some(crate::model::Finish::EndOfSequence) => "eos".into(),
            Some(crate::model::Finish::MaxTokens) => "maxTokens".into(),
            None => JsValue::NULL,
        }
    }
}

/// A plain f16 cache for the model (the baseline a generation can run on).
#[wasm_bindgen]
pub struct F16CacheCore {
    set: Rc<RefCell<Option<Fp16CacheSet>>>,
}

#[wasm_bindgen]
impl F16CacheCore {
    /// The cache as bytes (resolves to a Uint8Array), for `ModelCore.restoreCache`.
    pub fn save(&self) -> Promise {
        let set = self.set.clone();
        future_to_promise(async move {
            let (ctx, job, submitted) = {
                let Ok(slot) = set.try_borrow() else {
                    return Err(usage_error(BUSY_CACHE));
                };
                let s = slot
                    .as_ref()
                    .ok_or_else(|| usage_error("this f16 cache was freed"))?;
                let ctx = s.context().clone();
                let (job, submitted) = ctx.submit("save", |enc| s.encode_save(enc));
                (ctx, job, submitted)
            };
            let job = job.map_err(to_js)?;
            submitted.finish().await.map_err(to_js)?;
            let bytes = job.finish(&ctx).await.map_err(to_js)?;
            Ok(Uint8Array::from(&bytes[..]).into())
        })
    }

    /// Tokens the cache holds.
    pub fn tokens(&self) -> std::result::Result<f64, JsValue> {
        self.with(|s| s.tokens(0) as f64)
    }

    /// `{ totals: { tokens, allocatedBytes, fp16Bytes, scratchBytes } }`.
    pub fn stats(&self) -> std::result::Result<JsValue, JsValue> {
        self.with(|s| {
            let totals = object(&[
                ("tokens", (s.tokens(0) as f64).into()),
                ("allocatedBytes", (s.storage_bytes() as f64).into()),
                ("fp16Bytes", (s.fp16_bytes() as f64).into()),
                ("scratchBytes", (s.scratch_bytes() as f64).into()),
            ]);
            object(&[("totals", totals)])
        })
    }

    /// Forgets every token and frees the buffers (the cache stays usable).
    pub fn reset(&self) -> std::result::Result<(), JsValue> {
        self.with(|s| s.reset())
    }

    /// Frees the buffers now; later calls throw `UsageError`.
    pub fn release(&self) -> std::result::Result<(), JsValue> {
        let mut slot = self
            .set
            .try_borrow_mut()
            .map_err(|_| usage_error(BUSY_CACHE))?;
        *slot = None;
        Ok(())
    }
}

impl F16CacheCore {
    fn new(set: Fp16CacheSet) -> Self {
        F16CacheCore {
            set: Rc::new(RefCell::new(Some(set))),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut Fp16CacheSet) -> T) -> std::result::Result<T, JsValue> {
        let mut slot = self
            .set
            .try_borrow_mut()
            .map_err(|_| usage_error(BUSY_CACHE))?;
        slot.as_mut()
            .map(f)
            .ok_or_else(|| usage_error("this f16 cache was freed"))
    }
}

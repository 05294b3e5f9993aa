//! `CacheSetCore`: a cache set for the facade's `CacheSet` class.
//!
//! Every call validates its arguments, records its work and submits it to the device's queue
//! before it returns (so calls are ordered with each other and with whatever the caller
//! submits around them, with no need to await in between); its promise resolves once the GPU
//! has accepted the submission (and, for host results, once they are read back). A call
//! refused before submission changes nothing. A GPU error reported later undoes the call when
//! no later call has changed the set since; otherwise the set refuses further calls until
//! `reset()`, since what follows was built on the failed call.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use js_sys::{Array, Float32Array, Promise, Reflect};
use wasm_bindgen::prelude::*;
use wasm_bindgen::JsCast;
use wasm_bindgen_futures::future_to_promise;

use crate::cache::Checkpoint;

use crate::cache::{
    AttendOptions, CacheSet, CodeSource, Inputs, KvCache, KvInput, KvStats, OutLayout, Scope,
};
use crate::config::DType;
use crate::error::{Result, XqError};
use crate::gpu::{GpuContext, GpuTensor};
use crate::wasm::convert::{arg_count, field, int, key, num, object, text, HostData, Options};
use crate::wasm::errors::{in_scopes, to_js, usage_error};
use crate::wasm::options;

const FREED: &str = "this cache set was freed";
/// Only reachable when a getter of an argument calls back into the set while it reads it.
const BUSY: &str = "this cache set is in the middle of a call (re-entered from an argument)";

/// The history of a set's calls, for undoing a call the GPU refused later.
#[derive(Default)]
struct Calls {
    /// Calls submitted so far (reset counts as one).
    count: u64,
    /// Incremented by `reset()` and `release()`: a call made before them touched state that
    /// is gone, so its late GPU failure neither undoes anything nor blocks the set.
    epoch: u64,
    /// Why the set refuses calls: a GPU error arrived after later calls were built on it.
    failed: Option<String>,
    /// Checkpoints of calls the GPU accepted whose promises the facade has not settled yet,
    /// oldest first (with their epoch): a device loss noticed as one settles undoes it and
    /// every later one (`settle`).
    unsettled: std::collections::VecDeque<(u64, Option<Checkpoint>)>,
}

/// Checkpoints of the calls recorded into a caller's encoder (`encodeAppend`,
/// `encodeAttend`): they keep what a call replaced (a page that grew: the old page is the
/// source of the copy into the new one) alive until the caller has submitted the encoder.
#[derive(Default)]
struct Recorded {
    /// The encoder the latest calls were recorded into.
    encoder: Option<JsValue>,
    /// It as a wgpu encoder (imported once per encoder, not once per call).
    imported: Option<wgpu::CommandEncoder>,
    /// Their checkpoints.
    checkpoints: Vec<Checkpoint>,
}

/// A cache set; `release()` frees its GPU buffers at once (the facade's `free()`).
#[wasm_bindgen]
pub struct CacheSetCore {
    set: Rc<RefCell<Option<CacheSet>>>,
    calls: Rc<RefCell<Calls>>,
    recorded: RefCell<Recorded>,
}

/// A snapshot of a cache set (`CacheSet.checkpoint()`), for `rollback`. It holds what the
/// layers held when it was taken (buffers a later call replaced stay alive until it is freed
/// or rolled back to).
#[wasm_bindgen]
pub struct CacheCheckpointCore {
    checkpoint: Option<Checkpoint>,
    /// The set it belongs to (the address of its shared slot).
    owner: usize,
    /// The set's epoch when it was taken (reset and free end it).
    epoch: u64,
}

/// A rejected promise.
fn reject(e: JsValue) -> Promise {
    Promise::reject(&e)
}

/// The value of a `Result<T, XqError>`, or (from the enclosing method) a promise rejected
/// with its typed error.
macro_rules! or_reject {
    ($r:expr) => {
        match $r {
            Ok(v) => v,
            Err(e) => return reject(to_js(e)),
        }
    };
}

/// A call's `layer` and `tokens` arguments as counts.
fn layer_and_tokens(layer: &JsValue, tokens: &JsValue) -> Result<(usize, usize)> {
    Ok((arg_count(layer, "layer")?, tokens_of(tokens)?))
}

/// The `GPUDevice` JS object of a context.
fn device_js(ctx: &GpuContext) -> Result<JsValue> {
    ctx.device()
        .as_webgpu()
        .map(|d| {
            let v: &JsValue = d.as_ref();
            v.clone()
        })
        .ok_or_else(|| XqError::Gpu("the device is not a WebGPU device".into()))
}

thread_local! {
    /// What the device hook of [`answer_with`] answers with.
    static ANSWER: RefCell<JsValue> = const { RefCell::new(JsValue::UNDEFINED) };
    /// The hook: one closure for every import, answering with [`ANSWER`].
    static HOOK: Closure<dyn FnMut(JsValue) -> JsValue> =
        Closure::new(|_desc: JsValue| ANSWER.with(|a| a.borrow().clone()));
}

/// Runs `create`, a wgpu call that calls the device's `method` once, with that method
/// answering `answer`: how a caller's object becomes a wgpu one (wgpu imports none). The
/// hook is set on the device object for the duration of this synchronous call only.
fn answer_with<T>(
    ctx: &GpuContext,
    method: &'static str,
    answer: &JsValue,
    create: impl FnOnce() -> T,
) -> Result<T> {
    let device = device_js(ctx)?;
    let name = key(method);
    ANSWER.with(|a| *a.borrow_mut() = answer.clone());
    let attached = HOOK.with(|h| Reflect::set(&device, &name, h.as_ref().unchecked_ref()));
    if attached.is_err() {
        ANSWER.with(|a| *a.borrow_mut() = JsValue::UNDEFINED);
        return Err(XqError::Gpu(format!(
            "cannot attach to the device's {method}"
        )));
    }
    let out = create();
    let _ = Reflect::delete_property(device.unchecked_ref::<js_sys::Object>(), &name);
    ANSWER.with(|a| *a.borrow_mut() = JsValue::UNDEFINED);
    Ok(out)
}

/// Caller buffers imported so far: a `GPUBuffer` handed in again is the same `wgpu::Buffer`,
/// so the bind groups made over it are found again (`gpu::dispatch`) and it is not checked
/// and wrapped again. Let go of (and started over) past [`MAX_IMPORTS`] buffers: the wrappers
/// hold the caller's buffers.
struct Imports {
    /// GPUBuffer → index into `buffers`.
    ids: js_sys::WeakMap,
    buffers: Vec<wgpu::Buffer>,
}

/// Caller buffers kept imported at most.
const MAX_IMPORTS: usize = 256;

thread_local! {
    static IMPORTS: RefCell<Imports> = RefCell::new(Imports {
        ids: js_sys::WeakMap::new(),
        buffers: Vec::new(),
    });
}

/// A caller's `GPUBuffer` as a `wgpu::Buffer` on our device (never destroyed by us), imported
/// once (`Imports`).
fn import_buffer(ctx: &GpuContext, js: &JsValue, what: &str) -> Result<wgpu::Buffer> {
    let known = js.is_object().then(|| {
        IMPORTS.with(|i| {
            let i = i.borrow();
            let id = i.ids.get(js.unchecked_ref()).as_f64()?;
            i.buffers.get(id as usize).cloned()
        })
    });
    if let Some(buffer) = known.flatten() {
        return Ok(buffer);
    }
    let buffer = wrap_buffer(ctx, js, what)?;
    IMPORTS.with(|i| {
        let mut i = i.borrow_mut();
        if i.buffers.len() >= MAX_IMPORTS {
            i.ids = js_sys::WeakMap::new();
            i.buffers.clear();
        }
        let id = i.buffers.len();
        i.ids.set(js.unchecked_ref(), &JsValue::from(id as f64));
        i.buffers.push(buffer.clone());
    });
    Ok(buffer)
}

/// A caller's `GPUBuffer`, checked, as a new `wgpu::Buffer`: wgpu has no import of foreign
/// buffers, so its `createBuffer` call is answered with this buffer by a one-call hook on the
/// device object. A buffer of another device is refused by the GPU when the call is
/// submitted (a `GpuError`).
fn wrap_buffer(ctx: &GpuContext, js: &JsValue, what: &str) -> Result<wgpu::Buffer> {
    if !is_gpu_buffer(js) {
        return Err(XqError::Shape(format!("{what} must be a GPUBuffer")));
    }
    let number = |name: &'static str| Reflect::get(js, &key(name)).ok().and_then(|v| v.as_f64());
    let (Some(size), Some(usage)) = (number("size"), number("usage")) else {
        return Err(XqError::Shape(format!("{what} must be a GPUBuffer")));
    };
    let usage = wgpu::BufferUsages::from_bits_truncate(usage as u32);
    if !usage.contains(wgpu::BufferUsages::STORAGE) {
        return Err(XqError::Config(format!(
            "{what}: the GPUBuffer needs GPUBufferUsage.STORAGE"
        )));
    }
    // No label: the hook answers with the caller's buffer, its own label and all.
    answer_with(ctx, "createBuffer", js, || {
        ctx.device().create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: size as u64,
            usage,
            mapped_at_creation: false,
        })
    })
}

/// Whether `js` is a `GPUBuffer`: an instance of the global class where there is one (an
/// impostor handed to wgpu would make the browser throw inside the call); elsewhere (Node's
/// `webgpu` package) any object, its `size` and `usage` checked by the caller.
fn is_gpu_buffer(js: &JsValue) -> bool {
    is_instance(js, "GPUBuffer", &[])
}

/// Whether `js` is an instance of the global WebGPU class `class` where there is one;
/// elsewhere (Node's `webgpu` package) whether it has the `methods`.
fn is_instance(js: &JsValue, class: &'static str, methods: &[&'static str]) -> bool {
    if !js.is_object() {
        return false;
    }
    let global = Reflect::get(&js_sys::global(), &key(class)).ok();
    if let Some(class) = global.filter(|c| c.is_function()) {
        return match Reflect::get(&class, &key("prototype")) {
            Ok(proto) if proto.is_object() => {
                let proto: &js_sys::Object = proto.unchecked_ref();
                proto.is_prototype_of(js)
            }
            _ => false,
        };
    }
    methods
        .iter()
        .all(|m| Reflect::get(js, &key(m)).is_ok_and(|f| f.is_function()))
}

/// A caller's `GPUCommandEncoder` as a `wgpu::CommandEncoder` recording into it: as for
/// buffers, wgpu has no import, so its `createCommandEncoder` call is answered with the
/// caller's encoder by a one-call hook on the device object. Dropping the wgpu encoder does
/// nothing to the caller's: it is never finished or submitted here.
fn import_encoder(ctx: &GpuContext, js: &JsValue) -> Result<wgpu::CommandEncoder> {
    if !is_instance(js, "GPUCommandEncoder", &["beginComputePass", "finish"]) {
        return Err(XqError::Shape(
            "encoder must be a GPUCommandEncoder (device.createCommandEncoder())".into(),
        ));
    }
    answer_with(ctx, "createCommandEncoder", js, || {
        ctx.device()
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None })
    })
}

/// A tensor of `dims` in a caller's `GPUBuffer` at byte `offset`.
fn gpu_tensor(
    ctx: &GpuContext,
    js: &JsValue,
    what: &str,
    offset: usize,
    dims: &[usize],
    dtype: DType,
) -> Result<GpuTensor> {
    let buffer = import_buffer(ctx, js, what)?;
    GpuTensor::from_buffer_at(buffer, offset as u64, dims, dtype)
        .map_err(|e| XqError::Shape(format!("{what}: {}", e.message())))
}

fn dtype_option(options: &Options, name: &'static str, default: &str) -> Result<DType> {
    DType::parse(&text(options, name, default)?)
}

fn tokens_of(tokens: &JsValue) -> Result<usize> {
    match arg_count(tokens, "tokens")? {
        0 => Err(XqError::Shape("tokens must be at least 1".into())),
        t => Ok(t),
    }
}

/// An input of a call on the GPU and whether it is still token-major.
struct Input {
    tensor: GpuTensor,
    /// `[batch, tokens, heads, dim]` (option `layout: 'tokens'`, more than one token; with
    /// one token both layouts are the same bytes).
    token_major: bool,
}

impl Input {
    fn heads_major(tensor: GpuTensor) -> Self {
        Input {
            tensor,
            token_major: false,
        }
    }

    /// The tensor heads-major: as given, or copied into a new heads-major buffer (recorded
    /// into `enc`) that is let go at once and freed once the GPU is done with it, so a
    /// caller's encoder submitted later still finds it.
    fn as_heads_major(
        &self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
    ) -> Result<GpuTensor> {
        if !self.token_major {
            return Ok(self.tensor.clone());
        }
        let t = ctx.encode_tokens_to_heads(enc, &self.tensor)?;
        t.buffer.detach();
        Ok(t)
    }
}

/// How a caller's input of `[batch, heads, tokens, dim]` is read from its buffer: the dims
/// to read it as, and whether it must be copied heads-major first (`token_major`: laid out
/// `[batch, tokens, heads, dim]`; with one token both layouts are the same bytes, read as
/// heads-major).
fn input_dims(token_major: bool, [b, heads, t, d]: [usize; 4]) -> ([usize; 4], bool) {
    if token_major && t > 1 {
        ([b, t, heads, d], true)
    } else {
        ([b, heads, t, d], false)
    }
}

/// Whether layout option `name` is token-major (`'tokens'`) rather than heads-major
/// (`'heads'`, the default).
fn token_major(options: &Options, name: &'static str) -> Result<bool> {
    match text(options, name, "heads")?.as_str() {
        "heads" => Ok(false),
        "tokens" => Ok(true),
        other => Err(XqError::Config(format!(
            "{name} must be 'heads' ([batch, heads, tokens, headDim]) or 'tokens' ([batch, \
             tokens, heads, headDim]), got {other}"
        ))),
    }
}

/// The keys and values of one call on the GPU: typed arrays (Float32Array, or Uint16Array of
/// f16 bits; checked, made heads-major and uploaded) or the caller's `GPUBuffer`s (`dtype`,
/// offsets, `layout`).
fn kv_tensors(
    set: &CacheSet,
    keys: &JsValue,
    values: &JsValue,
    tokens: usize,
    options: &Options,
) -> Result<(Input, Input)> {
    let m = set.model();
    let ctx = set.context();
    let by_token = token_major(options, "layout")?;
    let dims = [m.batch, m.kv_heads, tokens, m.head_dim];
    if HostData::is_typed(keys) || HostData::is_typed(values) {
        let mut k = HostData::from_js(keys, "keys")?;
        let mut v = HostData::from_js(values, "values")?;
        let per_call = tokens * m.rows() * m.head_dim;
        for (what, x) in [("keys", &k), ("values", &v)] {
            if x.len() != per_call {
                return Err(XqError::Shape(format!(
                    "{what} hold {} values, not {tokens} tokens of [batch {}, kvHeads {}, \
                     headDim {}]",
                    x.len(),
                    m.batch,
                    m.kv_heads,
                    m.head_dim
                )));
            }
        }
        if input_dims(by_token, dims).1 {
            let (b, h, d) = (m.batch, m.kv_heads, m.head_dim);
            k = k.tokens_to_heads(b, tokens, h, d)?;
            v = v.tokens_to_heads(b, tokens, h, d)?;
        }
        fn host(h: &HostData) -> KvInput<'_> {
            match h {
                HostData::F32(x) => KvInput::F32(x),
                HostData::F16(x) => KvInput::F16(x),
            }
        }
        let inputs = Inputs::prepare(ctx, m, set.input_params(), host(&k), host(&v))?;
        return Ok((
            Input::heads_major(inputs.keys.into_tensor()),
            Input::heads_major(inputs.values.into_tensor()),
        ));
    }
    let (dims, token_major) = input_dims(by_token, dims);
    let dtype = dtype_option(options, "dtype", "f32")?;
    let offset = int(options, "offset", 0)?;
    let (k, v) = kv_gpu_tensors(ctx, keys, values, &dims, dtype, options, offset)?;
    Ok((
        Input {
            tensor: k,
            token_major,
        },
        Input {
            tensor: v,
            token_major,
        },
    ))
}

/// Caller-owned key and value `GPUBuffer`s as tensors of `dims`, at the byte offsets of
/// options `keysOffset` / `valuesOffset` (default `offset`).
fn kv_gpu_tensors(
    ctx: &GpuContext,
    keys: &JsValue,
    values: &JsValue,
    dims: &[usize],
    dtype: DType,
    options: &Options,
    offset: usize,
) -> Result<(GpuTensor, GpuTensor)> {
    let k_at = int(options, "keysOffset", offset)?;
    let v_at = int(options, "valuesOffset", offset)?;
    Ok((
        gpu_tensor(ctx, keys, "keys", k_at, dims, dtype)?,
        gpu_tensor(ctx, values, "values", v_at, dims, dtype)?,
    ))
}

/// The attention options of a call: `{ pos0, scale, window, layout: 'heads' | 'tokens' }`.
fn attend_options(options: &Options) -> Result<AttendOptions> {
    let layout = match token_major(options, "layout")? {
        false => OutLayout::HeadsMajor,
        true => OutLayout::TokensMajor,
    };
    Ok(AttendOptions {
        pos0: field(options, "pos0")
            .map(|_| int(options, "pos0", 0))
            .transpose()?,
        scale: field(options, "scale")
            .map(|_| num(options, "scale", 0.0).map(|s| s as f32))
            .transpose()?,
        window: field(options, "window")
            .map(|_| int(options, "window", 0))
            .transpose()?,
        layout,
    })
}

/// `[batch, queryHeads, tokens, headDim]` queries, the output dims of `layout`, and the
/// attention options.
fn attend_dims(
    set: &CacheSet,
    options: &Options,
) -> Result<([usize; 4], [usize; 4], AttendOptions)> {
    let m = set.model();
    let Some(_) = field(options, "queryHeads") else {
        return Err(XqError::Config(
            "queryHeads is required (query heads per layer, a multiple of kvHeads)".into(),
        ));
    };
    let heads = int(options, "queryHeads", 0)?;
    let t = int(options, "tokens", 1)?;
    if t == 0 {
        return Err(XqError::Shape("tokens must be at least 1".into()));
    }
    let q = [m.batch, heads, t, m.head_dim];
    let opts = attend_options(options)?;
    let out = match opts.layout {
        OutLayout::HeadsMajor => q,
        OutLayout::TokensMajor => [m.batch, t, heads, m.head_dim],
    };
    Ok((q, out, opts))
}

/// The queries, output and options of an attention between the caller's GPUBuffers
/// (`attendGpu`, `encodeAttend`).
fn gpu_attend_args(
    set: &CacheSet,
    queries: &JsValue,
    out: &JsValue,
    options: &Options,
) -> Result<(Input, GpuTensor, AttendOptions)> {
    let (qd, od, opts) = attend_dims(set, options)?;
    let ctx = set.context();
    let (dims, token_major) = input_dims(token_major(options, "queryLayout")?, qd);
    let q = Input {
        tensor: gpu_tensor(
            ctx,
            queries,
            "queries",
            int(options, "offset", 0)?,
            &dims,
            dtype_option(options, "dtype", "f32")?,
        )?,
        token_major,
    };
    let o = gpu_tensor(
        ctx,
        out,
        "out",
        int(options, "outOffset", 0)?,
        &od,
        dtype_option(options, "outDtype", "f32")?,
    )?;
    Ok((q, o, opts))
}

/// Host values back as a Float32Array.
fn f32_array(v: &[f32]) -> JsValue {
    Float32Array::from(v).into()
}

impl CacheSetCore {
    pub(crate) fn new(set: CacheSet) -> Self {
        CacheSetCore {
            set: Rc::new(RefCell::new(Some(set))),
            calls: Rc::new(RefCell::new(Calls::default())),
            recorded: RefCell::new(Recorded::default()),
        }
    }

    /// The set itself, for a model generating over it (`ModelCore::generateXQuant`).
    pub(crate) fn shared(&self) -> Rc<RefCell<Option<CacheSet>>> {
        self.set.clone()
    }

    /// Runs `f` on the set now (no GPU work): stats.
    fn now<T>(&self, f: impl FnOnce(&mut CacheSet) -> T) -> std::result::Result<T, JsValue> {
        let Ok(mut slot) = self.set.try_borrow_mut() else {
            return Err(usage_error(BUSY));
        };
        match &mut *slot {
            Some(s) => Ok(f(s)),
            None => Err(usage_error(FREED)),
        }
    }

    /// The set, for a GPU call: not freed, not re-entered, and not refusing calls after a GPU
    /// failure that later calls were built on.
    fn usable(&self) -> std::result::Result<std::cell::RefMut<'_, CacheSet>, JsValue> {
        let slot = self.set.try_borrow_mut().map_err(|_| usage_error(BUSY))?;
        let set =
            std::cell::RefMut::filter_map(slot, Option::as_mut).map_err(|_| usage_error(FREED))?;
        if let Some(why) = &self.calls.borrow().failed {
            return Err(to_js(XqError::Gpu(format!(
                "an earlier call on this cache set failed on the GPU after later calls were \
                 made ({why}); reset() it or roll back to a checkpoint"
            ))));
        }
        Ok(set)
    }

    /// One call: `encode` records it (after `prepare` checked and uploaded its inputs) and
    /// it is submitted now; the promise resolves to `finish(result)` once the GPU accepted it.
    fn call<P, T, F, Fut>(
        &self,
        label: &'static str,
        scope: Scope,
        prepare: impl FnOnce(&CacheSet) -> Result<P>,
        encode: impl FnOnce(&mut CacheSet, &P, &mut wgpu::CommandEncoder) -> Result<T>,
        finish: F,
    ) -> Promise
    where
        P: 'static,
        T: 'static,
        F: FnOnce(Arc<GpuContext>, T) -> Fut + 'static,
        Fut: std::future::Future<Output = Result<JsValue>> + 'static,
    {
        let mut slot = match self.usable() {
            Ok(set) => set,
            Err(e) => return reject(e),
        };
        let set = &mut *slot;
        let ctx = set.context().clone();
        or_reject!(ctx.check());
        let (prepared, prepared_ok) = in_scopes(ctx.device(), || prepare(set));
        let prepared = or_reject!(prepared);
        let checkpoint = set.checkpoint(scope);
        let (out, submitted) = ctx.submit(label, |enc| encode(set, &prepared, enc));
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                set.rollback(checkpoint);
                return reject(to_js(e));
            }
        };
        drop(slot);
        let (mine, epoch) = {
            let mut calls = self.calls.borrow_mut();
            calls.count += 1;
            (calls.count, calls.epoch)
        };
        let (set_rc, calls_rc) = (self.set.clone(), self.calls.clone());
        future_to_promise(async move {
            // The inputs live until the submission has been made (it has).
            drop(prepared);
            // A loss reported meanwhile fails the call as a refused submission does.
            let verdict = match (submitted.finish().await, prepared_ok.await) {
                (Ok(()), Ok(())) => ctx.check(),
                (Err(e), _) | (_, Err(e)) => Err(e),
            };
            if let Err(e) = verdict {
                let mut calls = calls_rc.borrow_mut();
                if calls.epoch != epoch {
                    // reset() or free() came after it: nothing of it is left.
                } else if calls.count == mine {
                    if let Some(set) = set_rc.borrow_mut().as_mut() {
                        set.rollback(checkpoint);
                    }
                } else {
                    calls.failed = Some(e.message().to_string());
                }
                return Err(to_js(e));
            }
            let value = finish(ctx, out).await.map_err(to_js)?;
            calls_rc
                .borrow_mut()
                .unsettled
                .push_back((epoch, Some(checkpoint)));
            Ok(value)
        })
    }
}

impl CacheSetCore {
    /// A call recorded into the caller's `encoder` and not submitted (`encodeAppend`,
    /// `encodeAttend`): `prepare` checks its arguments, `encode` records it. A refused call
    /// changes nothing and throws; the caller submits the encoder (and rolls the set back to
    /// its own checkpoint when that submission fails). No error scopes: the caller's
    /// submission carries every GPU error to the caller's device, as its own passes' do.
    fn record<P>(
        &self,
        scope: Scope,
        encoder: &JsValue,
        prepare: impl FnOnce(&CacheSet) -> Result<P>,
        encode: impl FnOnce(&mut CacheSet, &P, &mut wgpu::CommandEncoder) -> Result<()>,
    ) -> std::result::Result<(), JsValue> {
        let mut slot = self.usable()?;
        let set = &mut *slot;
        let ctx = set.context().clone();
        ctx.check().map_err(to_js)?;
        let prepared = prepare(set).map_err(to_js)?;
        let mut enc = self.encoder_for(&ctx, encoder).map_err(to_js)?;
        let checkpoint = set.checkpoint(scope);
        let encoded = encode(set, &prepared, &mut enc);
        self.recorded.borrow_mut().imported = Some(enc);
        if let Err(e) = encoded {
            set.rollback(checkpoint);
            return Err(to_js(e));
        }
        self.calls.borrow_mut().count += 1;
        self.recorded.borrow_mut().checkpoints.push(checkpoint);
        Ok(())
    }

    /// The caller's `encoder` as a wgpu encoder: the one imported for the latest calls when
    /// it is the same, else imported now. With another encoder, the previous one's
    /// checkpoints (kept until it is submitted) are let go once the work submitted so far is
    /// done.
    fn encoder_for(&self, ctx: &GpuContext, encoder: &JsValue) -> Result<wgpu::CommandEncoder> {
        let mut recorded = self.recorded.borrow_mut();
        let same = recorded
            .encoder
            .as_ref()
            .is_some_and(|e| js_sys::Object::is(e, encoder));
        if same {
            if let Some(enc) = recorded.imported.take() {
                return Ok(enc);
            }
        }
        let enc = import_encoder(ctx, encoder)?;
        if !same {
            let retiring = std::mem::take(&mut recorded.checkpoints);
            recorded.encoder = Some(encoder.clone());
            if !retiring.is_empty() {
                release_when_done(ctx, retiring);
            }
        }
        Ok(enc)
    }

    /// After `reset` or `rollback`: the calls made before touched state that is gone, so a
    /// late failure of one of them neither undoes anything nor blocks the set (their
    /// checkpoints, kept until their promises settle, belong to the old epoch), and the
    /// recorded calls' checkpoints are let go.
    fn start_over(&self) {
        self.forget_recorded();
        let mut calls = self.calls.borrow_mut();
        calls.count += 1;
        calls.epoch += 1;
        calls.failed = None;
    }

    /// Lets go of every recorded call's checkpoint (`reset`, `release`, `rollback`).
    fn forget_recorded(&self) {
        let mut recorded = self.recorded.borrow_mut();
        recorded.encoder = None;
        recorded.imported = None;
        recorded.checkpoints.clear();
    }
}

/// Drops `checkpoints` once the queue's work submitted so far is done (at once when the
/// device cannot be asked). Through the JS promise: wgpu's `on_submitted_work_done` wants a
/// `Send` callback, and a checkpoint is not `Send`.
fn release_when_done(ctx: &GpuContext, checkpoints: Vec<Checkpoint>) {
    let done = device_js(ctx)
        .ok()
        .and_then(|d| Reflect::get(&d, &key("queue")).ok())
        .and_then(|q| {
            let f = Reflect::get(&q, &key("onSubmittedWorkDone")).ok()?;
            let f: js_sys::Function = f.dyn_into().ok()?;
            f.call0(&q).ok()?.dyn_into::<Promise>().ok()
        });
    if let Some(done) = done {
        wasm_bindgen_futures::spawn_local(async move {
            let _ = wasm_bindgen_futures::JsFuture::from(done).await;
            drop(checkpoints);
        });
    }
}

/// Records appending `k` and `v` (made heads-major first) to `layer`.
fn append_inputs(
    set: &mut CacheSet,
    enc: &mut wgpu::CommandEncoder,
    layer: usize,
    k: &Input,
    v: &Input,
) -> Result<()> {
    let ctx = set.context().clone();
    let k = k.as_heads_major(&ctx, enc)?;
    let v = v.as_heads_major(&ctx, enc)?;
    set.encode_append(enc, layer, &k, &v)
}

/// Records the attention of `q` (made heads-major first) over `layer` into `o`.
fn attend_input(
    set: &mut CacheSet,
    enc: &mut wgpu::CommandEncoder,
    layer: usize,
    (q, o, opts): &(Input, GpuTensor, AttendOptions),
) -> Result<()> {
    let q = q.as_heads_major(set.context(), enc)?;
    set.encode_attend(enc, layer, &q, o, opts)
}

/// Nothing to return.
async fn done(_: Arc<GpuContext>, _: ()) -> Result<JsValue> {
    Ok(JsValue::UNDEFINED)
}

#[wasm_bindgen]
impl CacheSetCore {
    /// Appends `tokens` tokens to `layer`: `keys`/`values` are typed arrays (Float32Array,
    /// or Uint16Array of f16 bits) or GPUBuffers on the context's device
    /// (`[batch, kvHeads, tokens, headDim]` from byte `offset`, `dtype` 'f32' | 'f16').
    pub fn append(
        &self,
        layer: JsValue,
        keys: JsValue,
        values: JsValue,
        tokens: JsValue,
        options: JsValue,
    ) -> Promise {
        let options = or_reject!(options::APPEND.read(&options));
        let (layer, tokens) = or_reject!(layer_and_tokens(&layer, &tokens));
        self.call(
            "append",
            Scope::Layer(layer),
            |set| kv_tensors(set, &keys, &values, tokens, &options),
            move |set, (k, v), enc| append_inputs(set, enc, layer, k, v),
            done,
        )
    }

    /// Records appending `tokens` tokens to `layer` into the caller's `encoder` (a
    /// GPUCommandEncoder on the context's device) without submitting: `keys`/`values` are
    /// GPUBuffers as for `append`. The set counts the tokens at once; submit the encoder, or
    /// roll back to a checkpoint taken before.
    #[wasm_bindgen(js_name = encodeAppend)]
    pub fn encode_append(
        &self,
        encoder: JsValue,
        layer: JsValue,
        keys: JsValue,
        values: JsValue,
        tokens: JsValue,
        options: JsValue,
    ) -> std::result::Result<(), JsValue> {
        let options = options::ENCODE_APPEND.read(&options).map_err(to_js)?;
        let (layer, tokens) = layer_and_tokens(&layer, &tokens).map_err(to_js)?;
        if HostData::is_typed(&keys) || HostData::is_typed(&values) {
            return Err(to_js(XqError::Shape(
                "encodeAppend takes keys and values in GPUBuffers (append takes typed arrays)"
                    .into(),
            )));
        }
        self.record(
            Scope::Layer(layer),
            &encoder,
            |set| kv_tensors(set, &keys, &values, tokens, &options),
            move |set, (k, v), enc| append_inputs(set, enc, layer, k, v),
        )
    }

    /// Records the attention of `queries` over `layer`'s tokens into `out` (GPUBuffers, as
    /// for `attendGpu`) into the caller's `encoder`, without submitting.
    #[wasm_bindgen(js_name = encodeAttend)]
    pub fn encode_attend(
        &self,
        encoder: JsValue,
        layer: JsValue,
        queries: JsValue,
        out: JsValue,
        options: JsValue,
    ) -> std::result::Result<(), JsValue> {
        let options = options::ENCODE_ATTEND.read(&options).map_err(to_js)?;
        let layer = arg_count(&layer, "layer").map_err(to_js)?;
        self.record(
            Scope::Scratch,
            &encoder,
            |set| gpu_attend_args(set, &queries, &out, &options),
            move |set, args, enc| attend_input(set, enc, layer, args),
        )
    }

    /// A snapshot of every layer's bookkeeping (and the scratch) to roll the set back to when
    /// a step recorded after it is not submitted or fails on the GPU.
    pub fn checkpoint(&self) -> std::result::Result<CacheCheckpointCore, JsValue> {
        let epoch = self.calls.borrow().epoch;
        let owner = Rc::as_ptr(&self.set) as usize;
        self.now(|s| CacheCheckpointCore {
            checkpoint: Some(s.checkpoint(Scope::All)),
            owner,
            epoch,
        })
    }

    /// Puts every layer back to `checkpoint` (taken on this set since its last `reset()`);
    /// the set accepts calls again. A checkpoint is used up by its rollback.
    pub fn rollback(
        &self,
        checkpoint: &mut CacheCheckpointCore,
    ) -> std::result::Result<(), JsValue> {
        if checkpoint.owner != Rc::as_ptr(&self.set) as usize {
            return Err(usage_error("this checkpoint belongs to another cache set"));
        }
        if checkpoint.epoch != self.calls.borrow().epoch {
            return Err(usage_error(
                "this checkpoint was taken before the set was reset or freed",
            ));
        }
        let Some(cp) = checkpoint.checkpoint.take() else {
            return Err(usage_error(
                "this checkpoint was already rolled back to or freed",
            ));
        };
        self.now(|s| s.rollback(cp))?;
        self.start_over();
        Ok(())
    }

    /// The set as bytes (resolves to a Uint8Array): recorded and submitted now, so later
    /// calls do not change what is saved; `XQuantCore.restoreCacheSet` reads it back.
    pub fn save(&self) -> Promise {
        self.call(
            "save",
            Scope::Scratch,
            |_| Ok(()),
            |set, _, enc| set.encode_save(enc),
            |ctx, job| async move {
                let bytes = job.finish(&ctx).await?;
                Ok(js_sys::Uint8Array::from(&bytes[..]).into())
            },
        )
    }

    /// Attention of `queries` (a GPUBuffer, `[batch, queryHeads, tokens, headDim]`) over
    /// `layer`'s tokens, written into `out` (a GPUBuffer): options `{ queryHeads, tokens,
    /// dtype, outDtype, offset, outOffset, layout, pos0, scale }`.
    #[wasm_bindgen(js_name = attendGpu)]
    pub fn attend_gpu(
        &self,
        layer: JsValue,
        queries: JsValue,
        out: JsValue,
        options: JsValue,
    ) -> Promise {
        let options = or_reject!(options::ATTEND_GPU.read(&options));
        let layer = or_reject!(arg_count(&layer, "layer"));
        self.call(
            "attend",
            Scope::Scratch,
            |set| gpu_attend_args(set, &queries, &out, &options),
            move |set, args, enc| attend_input(set, enc, layer, args),
            done,
        )
    }

    /// Attention of host `queries` (Float32Array or Uint16Array of f16 bits) over `layer`'s
    /// tokens; resolves to a Float32Array (options as for attendGpu, without buffers).
    pub fn attend(&self, layer: JsValue, queries: JsValue, options: JsValue) -> Promise {
        let options = or_reject!(options::ATTEND.read(&options));
        let layer = or_reject!(arg_count(&layer, "layer"));
        self.call(
            "attend",
            Scope::Scratch,
            |set| {
                let (qd, od, opts) = attend_dims(set, &options)?;
                let ctx = set.context();
                let mut host = HostData::from_js(&queries, "queries")?;
                if input_dims(token_major(&options, "queryLayout")?, qd).1 {
                    let [b, heads, t, d] = qd;
                    host = host
                        .tokens_to_heads(b, t, heads, d)
                        .map_err(|e| XqError::Shape(format!("queries: {}", e.message())))?;
                }
                let q = match host {
                    HostData::F32(x) => ctx.upload_f32(&x, &qd, crate::ParamsPrecision::F32)?,
                    HostData::F16(x) => ctx.upload_f16(&x, &qd, crate::ParamsPrecision::F32)?,
                };
                let o = ctx.empty_tensor(&crate::TensorShape::new(&od)?, DType::F32)?;
                Ok((q, o, opts))
            },
            move |set, (q, o, opts), enc| {
                set.encode_attend(enc, layer, q, o, opts)?;
                Ok((o.clone(), set.context().encode_tensor_readback(enc, o)))
            },
            |ctx, (o, staging)| async move { Ok(f32_array(&ctx.map_tensor(&o, staging).await?)) },
        )
    }

    /// Writes every token `layer` holds, reconstructed, into caller-owned GPUBuffers `keys`
    /// and `values` (`[batch, kvHeads, heldTokens, headDim]`, options `{ dtype, keysOffset,
    /// valuesOffset }`).
    #[wasm_bindgen(js_name = fetchInto)]
    pub fn fetch_into(
        &self,
        layer: JsValue,
        keys: JsValue,
        values: JsValue,
        options: JsValue,
    ) -> Promise {
        let options = or_reject!(options::FETCH_INTO.read(&options));
        let layer = or_reject!(arg_count(&layer, "layer"));
        self.call(
            "fetch",
            Scope::Scratch,
            |set| {
                let m = set.model();
                let dims = [m.batch, m.kv_heads, set.held_tokens(layer), m.head_dim];
                if dims[2] == 0 {
                    return Err(XqError::Shape(format!("layer {layer} holds no tokens")));
                }
                let dtype = dtype_option(&options, "dtype", "f32")?;
                kv_gpu_tensors(set.context(), &keys, &values, &dims, dtype, &options, 0)
            },
            move |set, (k, v), enc| set.encode_fetch_into(enc, layer, k, v),
            done,
        )
    }

    /// Appends `tokens` tokens (typed arrays) to `layer` and resolves to `{ keys, values,
    /// tokens }`: every token's reconstruction, Float32Arrays.
    #[wasm_bindgen(js_name = updateAndFetch)]
    pub fn update_and_fetch(
        &self,
        layer: JsValue,
        keys: JsValue,
        values: JsValue,
        tokens: JsValue,
    ) -> Promise {
        let (layer, tokens) = or_reject!(layer_and_tokens(&layer, &tokens));
        self.call(
            "update_and_fetch",
            Scope::Layer(layer),
            |set| kv_tensors(set, &keys, &values, tokens, &Options::default()),
            move |set, (k, v), enc| {
                append_inputs(set, enc, layer, k, v)?;
                let f = set.encode_fetch(enc, layer)?;
                let ctx = set.context();
                let staging = (
                    ctx.encode_tensor_readback(enc, &f.keys),
                    ctx.encode_tensor_readback(enc, &f.values),
                );
                Ok((f, staging))
            },
            |ctx, (f, (ks, vs))| async move {
                let k = ctx.map_tensor(&f.keys, ks).await?;
                let v = ctx.map_tensor(&f.values, vs).await?;
                Ok(object(&[
                    ("keys", f32_array(&k)),
                    ("values", f32_array(&v)),
                    ("tokens", (f.tokens as f64).into()),
                ]))
            },
        )
    }

    /// As `updateAndFetch`, resolving to `{ keys, values, tokens, dtype, byteLength }` with the
    /// set's own GPUBuffers (valid until the set's next call is submitted; a later call may
    /// replace them with larger ones). Prefer `fetchInto`, which writes into your buffers.
    #[wasm_bindgen(js_name = updateAndFetchGpu)]
    pub fn update_and_fetch_gpu(
        &self,
        layer: JsValue,
        keys: JsValue,
        values: JsValue,
        tokens: JsValue,
    ) -> Promise {
        let (layer, tokens) = or_reject!(layer_and_tokens(&layer, &tokens));
        self.call(
            "update_and_fetch",
            Scope::Layer(layer),
            |set| kv_tensors(set, &keys, &values, tokens, &Options::default()),
            move |set, (k, v), enc| {
                append_inputs(set, enc, layer, k, v)?;
                set.encode_fetch(enc, layer)
            },
            |_ctx, f| async move {
                let gpu = |t: &GpuTensor| -> JsValue {
                    t.buffer().as_webgpu().map_or(JsValue::NULL, |b| {
                        let v: &JsValue = b.as_ref();
                        v.clone()
                    })
                };
                let dtype = f.keys.dtype();
                Ok(object(&[
                    ("keys", gpu(&f.keys)),
                    ("values", gpu(&f.values)),
                    ("tokens", (f.tokens as f64).into()),
                    (
                        "dtype",
                        if dtype == DType::F16 { "f16" } else { "f32" }.into(),
                    ),
                    ("byteLength", (f.keys.byte_len() as f64).into()),
                ]))
            },
        )
    }

    /// Tokens appended to `layer` (the next token's position).
    pub fn tokens(&self, layer: JsValue) -> std::result::Result<f64, JsValue> {
        let layer = arg_count(&layer, "layer").map_err(to_js)?;
        self.now(|s| s.tokens(layer) as f64)
    }

    /// Tokens `layer` still holds (its last ones): all of them but in a sliding layer.
    #[wasm_bindgen(js_name = heldTokens)]
    pub fn held_tokens(&self, layer: JsValue) -> std::result::Result<f64, JsValue> {
        let layer = arg_count(&layer, "layer").map_err(to_js)?;
        self.now(|s| s.held_tokens(layer) as f64)
    }

    /// Per-layer and total accounting: `effectiveBits` and `accountedBytes` are the
    /// reference's accounting, `allocatedBytes` and `ratioVsFp16` the GPU buffers;
    /// `liveTokens` sums the tokens the layers hold, `pendingTokens` counts the reference policy's
    /// published-but-unread tokens.
    pub fn stats(&self) -> std::result::Result<JsValue, JsValue> {
        let st = self.now(|s| s.stats())?;
        let layers: Array = st
            .layers
            .iter()
            .map(|l| {
                object(&[
                    ("layer", (l.layer as f64).into()),
                    ("tokens", (l.tokens as f64).into()),
                    ("heldTokens", (l.held_tokens as f64).into()),
                    ("windowTokens", (l.window_tokens as f64).into()),
                    ("sinkTokens", (l.sink_tokens as f64).into()),
                    ("effectiveBits", l.effective_bits.into()),
                    ("accountedBytes", (l.accounted_bytes as f64).into()),
                    ("allocatedBytes", (l.allocated_bytes as f64).into()),
                    ("fp16Bytes", (l.fp16_bytes as f64).into()),
                    ("key", kv_stats(&l.key)),
                    ("value", kv_stats(&l.value)),
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
            (
                "liveTokens",
                (st.layers.iter().map(|l| l.held_tokens).sum::<usize>() as f64).into(),
            ),
            ("pendingTokens", (st.live_tokens as f64).into()),
        ]);
        Ok(object(&[("layers", layers.into()), ("totals", totals)]))
    }

    /// The plan every layer follows (the JSON object `xquant plan` writes).
    pub fn plan(&self) -> std::result::Result<JsValue, JsValue> {
        let json = self.now(|s| s.plan().to_json().to_string())?;
        js_sys::JSON::parse(&json)
    }

    /// Called by the facade as the oldest accepted call's promise settles: with `lost` (the
    /// device was lost before it settled, so it rejects with `DeviceLostError`), the set goes
    /// back to before that call, which also undoes every later call (they settle lost too).
    pub fn settle(&self, lost: bool) {
        let mut calls = self.calls.borrow_mut();
        let Some((epoch, first)) = calls.unsettled.pop_front() else {
            return;
        };
        if !lost || epoch != calls.epoch {
            return;
        }
        // Newest first: each checkpoint holds what its own call changed (its layer, scratch).
        let later: Vec<Option<Checkpoint>> = calls
            .unsettled
            .iter_mut()
            .map(|(_, cp)| cp.take())
            .collect();
        drop(calls);
        if let Ok(mut slot) = self.set.try_borrow_mut() {
            if let Some(set) = slot.as_mut() {
                for cp in later.into_iter().rev().chain([first]).flatten() {
                    set.rollback(cp);
                }
            }
        }
    }

    /// Forgets every token and frees the buffers; the set stays usable (and accepts calls
    /// again after a GPU failure).
    pub fn reset(&self) -> std::result::Result<(), JsValue> {
        self.now(|s| s.reset())?;
        self.start_over();
        Ok(())
    }

    /// Frees the set now: its GPU buffers are destroyed (work already submitted completes);
    /// later calls throw a `UsageError`.
    pub fn release(&self) -> std::result::Result<(), JsValue> {
        let Ok(mut slot) = self.set.try_borrow_mut() else {
            return Err(usage_error(BUSY));
        };
        *slot = None;
        self.forget_recorded();
        self.calls.borrow_mut().epoch += 1;
        Ok(())
    }
}

/// One layer's keys or values in `stats()`.
fn kv_stats(k: &KvStats) -> JsValue {
    object(&[
        (
            "codes",
            match k.codes {
                CodeSource::Own => "own".into(),
                CodeSource::Layer(l) => (l as f64).into(),
            },
        ),
        ("bits", (k.bits as f64).into()),
        ("residualBits", (k.residual_bits as f64).into()),
        ("axis", k.axis.name().into()),
        ("effectiveBits", k.effective_bits.into()),
        ("accountedBytes", (k.accounted_bytes as f64).into()),
        ("allocatedBytes", (k.allocated_bytes as f64).into()),
        ("fp16Bytes", (k.fp16_bytes as f64).into()),
    ])
}

//! `XQuantCore`: the GPU context and the primitives, for the facade's `XQuant` class.

use std::sync::Arc;

use js_sys::{Array, Float32Array, Promise, Uint32Array, Uint8Array};
use wasm_bindgen::prelude::*;
use wasm_bindgen::JsCast;
use wasm_bindgen_futures::future_to_promise;

use crate::analysis::attend::{AttentionProbe, PROBE_QUERIES};
use crate::analysis::plan_by_attention::plan_by_attention;
use crate::analysis::planner::{self, PlannerOptions};
use crate::analysis::{analyze, analyze_plan};
use crate::cache::{options_base, CacheConfig, CachePlan, CacheSet, DecodePolicy, ModelSpec};
use crate::config::{
    DType, Levels, ParamsPrecision, QuantSpec, Rotation, TensorShape, ValueAxis, XQuantConfig,
};
use crate::error::{Result, XqError};
use crate::gpu::{ContextOptions, GpuContext, GpuTensor, PackedCodes};
use crate::kvfile::KvFile;
use crate::reference::pair_layers;
use crate::wasm::cache::CacheSetCore;
use crate::wasm::convert::{
    arg_count, bits, f32s, field, int, num, object, shape, text, typed_array, u32s, HostData,
};
use crate::wasm::errors::{in_scopes, to_js, to_js_plan};
use crate::wasm::options::{self, Table};

/// The device and everything built on it. Created with [`XQuantCore::create`].
#[wasm_bindgen]
pub struct XQuantCore {
    ctx: Arc<GpuContext>,
}

#[wasm_bindgen]
impl XQuantCore {
    /// The facade saw the device's `lost` promise settle: calls in flight that the GPU had
    /// accepted are undone, later ones fail with `DeviceLostError`.
    #[wasm_bindgen(js_name = markLost)]
    pub fn mark_lost(&self, message: String) {
        self.ctx.mark_lost(&message);
    }
}

/// Runs `f` as a promise, mapping errors to the facade's classes.
fn promise<F>(f: F) -> Promise
where
    F: std::future::Future<Output = Result<JsValue>> + 'static,
{
    future_to_promise(async move { f.await.map_err(to_js) })
}

/// As [`promise`] for a call that may be given a plan (its errors keep the plan's names).
fn plan_promise<F>(plan: bool, f: F) -> Promise
where
    F: std::future::Future<Output = Result<JsValue>> + 'static,
{
    let to = if plan { to_js_plan } else { to_js };
    future_to_promise(async move { f.await.map_err(to) })
}

/// Whether `options` gives a `plan`.
fn has_plan(options: &JsValue) -> bool {
    field(options, "plan").is_some()
}

/// `table`'s check of `options`, as a rejected promise when it fails.
fn checked(table: &Table, options: &JsValue) -> std::result::Result<(), Promise> {
    table.check(options).map_err(|e| Promise::reject(&to_js(e)))
}

/// The bytes of a file given as a `Uint8Array` or `ArrayBuffer`.
fn file_bytes(v: &JsValue) -> Result<Vec<u8>> {
    if let Some(a) = typed_array::<Uint8Array>(v) {
        return Ok(a.to_vec());
    }
    if v.is_instance_of::<js_sys::ArrayBuffer>() {
        return Ok(Uint8Array::new(v).to_vec());
    }
    Err(XqError::Io(
        "the file must be given as a Uint8Array or an ArrayBuffer".into(),
    ))
}

/// A JSON value as a plain JS object.
fn json_value(v: &serde_json::Value) -> Result<JsValue> {
    js_sys::JSON::parse(&v.to_string())
        .map_err(|_| XqError::Gpu("could not build the result object".into()))
}

/// The XQuant options in `o` ([`QUANT_OPTIONS`]), the others from `q` (`options_base`).
fn xquant_options(o: &JsValue, q: XQuantConfig) -> Result<XQuantConfig> {
    let q = options_base(q, QUANT_OPTIONS.iter().any(|n| field(o, n).is_some()));
    let cfg = XQuantConfig {
        layers_per_group: int(o, "groupSize", q.layers_per_group)?,
        base_bits: bits(o, "baseBits", q.base_bits)?,
        key_bits: bits(o, "keyBits", q.key_bits)?,
        residual_bits: bits(o, "residualBits", q.residual_bits)?,
        group_quant_size: int(o, "groupQuantSize", q.group_quant_size)?,
        eta: num(o, "eta", q.eta as f64)? as f32,
        value_axis: ValueAxis::parse(&text(o, "valueAxis", q.value_axis.name())?)?,
        params: ParamsPrecision::parse(&text(o, "params", q.params.name())?)?,
        value_levels: Levels::parse(&text(o, "valueLevels", q.value_levels.name())?)?,
        value_rotation: Rotation::parse(&text(o, "valueRotation", q.value_rotation.name())?)?,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// The quantizer options (the reference's grouping and the values' levels and rotation).
const QUANT_OPTIONS: [&str; 10] = [
    "groupSize",
    "baseBits",
    "keyBits",
    "residualBits",
    "groupQuantSize",
    "eta",
    "valueAxis",
    "valueLevels",
    "valueRotation",
    "params",
];

/// The `plan` option of `cacheSet`: a preset's name, a plan object or its JSON text;
/// `window` and `sinks`, when given too, replace the plan's. The layer grouping options
/// describe a plan of their own, so they cannot come with one.
fn plan_option(
    options: &JsValue,
    p: &JsValue,
    layers: usize,
    head_dim: usize,
) -> Result<CachePlan> {
    for name in QUANT_OPTIONS {
        if field(options, name).is_some() {
            return Err(XqError::Config(format!(
                "give either plan or {name} (a plan sets every layer's quantizer)"
            )));
        }
    }
    let mut plan = match p.as_string() {
        Some(s) if s.trim_start().starts_with('{') => CachePlan::from_json(&s)?,
        Some(name) => CachePlan::preset_for(&name, layers, head_dim)?,
        None if p.is_object() => {
            let json = js_sys::JSON::stringify(p)
                .ok()
                .and_then(|s| s.as_string())
                .ok_or_else(|| XqError::Config("plan: cannot be written as JSON".into()))?;
            CachePlan::from_json(&json)?
        }
        None => {
            return Err(XqError::Config(
                "plan must be a preset name, a plan object or its JSON text".into(),
            ))
        }
    };
    plan.window = int(options, "window", plan.window)?;
    plan.sinks = int(options, "sinks", plan.sinks)?;
    plan.validate()?;
    Ok(plan)
}

/// The `attentionWindows` option: one entry per layer, `null` (a global layer) or the
/// layer's attention window (a sliding layer, which then keeps only its window).
fn attention_windows(options: &JsValue, layers: usize) -> Result<Option<Vec<Option<usize>>>> {
    let Some(v) = field(options, "attentionWindows") else {
        return Ok(None);
    };
    let bad = || {
        XqError::Config(format!(
            "attentionWindows must be an array of {layers} entries, each null or a window \
             of at least 1 token"
        ))
    };
    if !Array::is_array(&v) {
        return Err(bad());
    }
    let a = Array::from(&v);
    if a.length() as usize != layers {
        return Err(bad());
    }
    a.iter()
        .map(|w| match w.as_f64() {
            None if w.is_null() || w.is_undefined() => Ok(None),
            Some(x) if x >= 1.0 && x <= u32::MAX as f64 && x.fract() == 0.0 => Ok(Some(x as usize)),
            _ => Err(bad()),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// A primitive call's shape and quantizer: `bits` and `group` as JS passed them (checked to
/// be integers in range), the rest from `options`.
fn shape_and_spec(
    shape_: &JsValue,
    bits_: &JsValue,
    group: &JsValue,
    options: &JsValue,
) -> Result<(Vec<usize>, QuantSpec)> {
    let dims = shape(shape_)?;
    let given = object(&[("bits", bits_.clone()), ("groupQuantSize", group.clone())]);
    let spec = spec_of(
        bits(&given, "bits", 0)?,
        int(&given, "groupQuantSize", 0)?,
        options,
    )?;
    Ok((dims, spec))
}

/// The quantizer options of a primitive call: `{ eta, valueAxis, params, levels }`.
fn spec_of(bits_: u8, group: usize, options: &JsValue) -> Result<QuantSpec> {
    let spec = QuantSpec {
        bits: bits_,
        group_size: group,
        axis: ValueAxis::parse(&text(options, "valueAxis", "tokens")?)?,
        eta: num(options, "eta", 0.0)? as f32,
        params: ParamsPrecision::parse(&text(options, "params", "f16")?)?,
        levels: Levels::parse(&text(options, "levels", "uniform")?)?,
    };
    spec.validate()?;
    Ok(spec)
}

impl XQuantCore {
    /// Uploads a host tensor, inside error scopes of its own (see [`in_scopes`]).
    async fn upload(
        &self,
        x: &JsValue,
        dims: &[usize],
        params: ParamsPrecision,
        what: &str,
    ) -> Result<GpuTensor> {
        let data = HostData::from_js(x, what)?;
        let (t, ok) = in_scopes(self.ctx.device(), || match data {
            HostData::F32(v) => self.ctx.upload_f32(&v, dims, params),
            HostData::F16(v) => self.ctx.upload_f16(&v, dims, params),
        });
        let t = t?;
        ok.await?;
        Ok(t)
    }
}

/// A quantized tensor as JS sees it: `{ codes, scale, zero, nRows, bits, shape, ... }`.
struct Quantized {
    codes: PackedCodes,
    spec: QuantSpec,
    shape: TensorShape,
}

impl Quantized {
    /// Rebuilds the GPU codes from a `quantizeCodes` result object.
    fn from_js(ctx: &GpuContext, q: &JsValue) -> Result<Quantized> {
        let missing = |f: &str| {
            XqError::Shape(format!(
                "codes object lacks `{f}` (pass a quantizeCodes result)"
            ))
        };
        let dims = shape(&field(q, "shape").ok_or_else(|| missing("shape"))?)?;
        let shape = TensorShape::new(&dims)?;
        let spec = spec_of(bits(q, "bits", 0)?, int(q, "groupQuantSize", 0)?, q)?;
        let words = u32s(&field(q, "codes").ok_or_else(|| missing("codes"))?, "codes")?;
        let codes = ctx.upload_codes(&words, &shape, &spec)?;
        Ok(Quantized { codes, spec, shape })
    }

    fn params(&self, ctx: &GpuContext, obj: &JsValue) -> Result<crate::gpu::GpuParams> {
        let scale = f32s(
            &field(obj, "scale").ok_or_else(|| XqError::Shape("params lack `scale`".into()))?,
            "scale",
        )?;
        let zero = f32s(
            &field(obj, "zero").ok_or_else(|| XqError::Shape("params lack `zero`".into()))?,
            "zero",
        )?;
        ctx.upload_params(&scale, &zero, *self.codes.layout(), self.spec.params)
    }
}

fn params_js(scale: Vec<f32>, zero: Vec<f32>) -> Vec<(&'static str, JsValue)> {
    vec![
        ("scale", Float32Array::from(scale.as_slice()).into()),
        ("zero", Float32Array::from(zero.as_slice()).into()),
    ]
}

#[wasm_bindgen]
impl XQuantCore {
    /// Acquires WebGPU through wgpu. `options`: `{ powerPreference: "low-power" |
    /// "high-performance", shared }`; `shared`: the adapter the facade hands over gives the
    /// caller's own `GPUDevice` (its uncaptured-error handler stays the caller's).
    pub fn create(options: JsValue) -> Promise {
        // A bug must say what it was in the console, not just "unreachable".
        console_error_panic_hook::set_once();
        promise(async move {
            let power_preference = match text(&options, "powerPreference", "none")?.as_str() {
                "low-power" => wgpu::PowerPreference::LowPower,
                "high-performance" => wgpu::PowerPreference::HighPerformance,
                "none" => wgpu::PowerPreference::None,
                other => {
                    return Err(XqError::Config(format!(
                        "powerPreference must be low-power or high-performance, got {other}"
                    )))
                }
            };
            let shared_device = field(&options, "shared").is_some_and(|v| v.is_truthy());
            let ctx = GpuContext::new(&ContextOptions {
                power_preference,
                shared_device,
                ..Default::default()
            })
            .await?;
            Ok(XQuantCore { ctx: Arc::new(ctx) }.into())
        })
    }

    /// `{ name, backend, deviceType, driver }` of the adapter in use.
    #[wasm_bindgen(getter, js_name = adapterInfo)]
    pub fn adapter_info(&self) -> JsValue {
        let a = self.ctx.adapter();
        object(&[
            ("name", a.name.clone().into()),
            ("backend", a.backend.clone().into()),
            ("deviceType", a.device_type.clone().into()),
            ("driver", a.driver.clone().into()),
        ])
    }

    /// The `GPUDevice`, to run your own kernels on the same device and read our buffers.
    #[wasm_bindgen(getter)]
    pub fn device(&self) -> JsValue {
        self.ctx.device().as_webgpu().map_or(JsValue::NULL, |d| {
            let v: &JsValue = d.as_ref();
            v.clone()
        })
    }

    /// Bytes of the GPU buffers the library holds right now.
    #[wasm_bindgen(js_name = allocatedBytes)]
    pub fn allocated_bytes(&self) -> f64 {
        self.ctx.allocated_bytes() as f64
    }

    /// `[{ role, group }]` for `n` layers in groups of `group_size`.
    #[wasm_bindgen(js_name = pairLayers)]
    pub fn pair_layers(
        &self,
        n: JsValue,
        group_size: JsValue,
    ) -> std::result::Result<Array, JsValue> {
        let as_count = |v: &JsValue, what: &str| {
            arg_count(v, what).map_err(|e| to_js(XqError::Config(e.message().to_string())))
        };
        let roles =
            pair_layers(as_count(&n, "n")?, as_count(&group_size, "groupSize")?).map_err(to_js)?;
        Ok(roles
            .iter()
            .map(|r| {
                object(&[
                    ("role", r.role.name().into()),
                    ("group", (r.group as f64).into()),
                ])
            })
            .collect())
    }

    /// `quantize_codes`: `{ codes (packed Uint32Array), scale, zero, nRows, bits, shape,
    /// groupQuantSize, valueAxis, params, eta }`.
    #[wasm_bindgen(js_name = quantizeCodes)]
    pub fn quantize_codes(
        &self,
        x: JsValue,
        shape_: JsValue,
        bits_: JsValue,
        group: JsValue,
        options: JsValue,
    ) -> Promise {
        if let Err(p) = checked(&options::QUANTIZE, &options) {
            return p;
        }
        let core = XQuantCore {
            ctx: self.ctx.clone(),
        };
        promise(async move {
            let (dims, spec) = shape_and_spec(&shape_, &bits_, &group, &options)?;
            let t = core.upload(&x, &dims, spec.params, "x").await?;
            let q = core.ctx.quantize(&t, &spec).await?;
            let words = core.ctx.read_code_words(&q.codes).await?;
            let (scale, zero) = core.ctx.read_params(&q.params).await?;
            let mut out = params_js(scale, zero);
            out.extend([
                ("codes", Uint32Array::from(words.as_slice()).into()),
                ("nRows", (t.shape().tokens() as f64).into()),
                ("bits", (spec.bits as f64).into()),
                (
                    "shape",
                    dims.iter()
                        .map(|&d| JsValue::from(d as f64))
                        .collect::<Array>()
                        .into(),
                ),
                ("groupQuantSize", (spec.group_size as f64).into()),
                ("valueAxis", spec.axis.name().into()),
                ("params", spec.params.name().into()),
                ("eta", (spec.eta as f64).into()),
                ("levels", spec.levels.name().into()),
            ]);
            Ok(object(&out))
        })
    }

    /// `compute_reuse_params(x, codes)`: `{ scale, zero }` of `x` for a `quantizeCodes` result.
    #[wasm_bindgen(js_name = computeReuseParams)]
    pub fn compute_reuse_params(&self, x: JsValue, codes: JsValue) -> Promise {
        let core = XQuantCore {
            ctx: self.ctx.clone(),
        };
        promise(async move {
            let q = Quantized::from_js(&core.ctx, &codes)?;
            let t = core.upload(&x, q.shape.dims(), q.spec.params, "x").await?;
            let p = core.ctx.compute_reuse_params(&t, &q.codes, &q.spec).await?;
            let (scale, zero) = core.ctx.read_params(&p).await?;
            Ok(object(&params_js(scale, zero)))
        })
    }

    /// `dequant_with_params(codes, params)` as a Float32Array (`outDtype` "f16" rounds like
    /// the reference's fp16 output).
    #[wasm_bindgen(js_name = dequantWithParams)]
    pub fn dequant_with_params(
        &self,
        codes: JsValue,
        params: JsValue,
        options: JsValue,
    ) -> Promise {
        if let Err(p) = checked(&options::DEQUANT, &options) {
            return p;
        }
        let core = XQuantCore {
            ctx: self.ctx.clone(),
        };
        promise(async move {
            let q = Quantized::from_js(&core.ctx, &codes)?;
            let p = q.params(
                &core.ctx,
                if params.is_undefined() || params.is_null() {
                    &codes
                } else {
                    &params
                },
            )?;
            let out = DType::parse(&text(&options, "outDtype", "f32")?)?;
            let t = core.ctx.dequant(&q.codes, &p, out).await?;
            Ok(Float32Array::from(core.ctx.read_f32(&t).await?.as_slice()).into())
        })
    }

    /// `quantize_residual(x, recon, bits, group)`: the dequantized residual, Float32Array.
    #[wasm_bindgen(js_name = quantizeResidual)]
    pub fn quantize_residual(
        &self,
        x: JsValue,
        recon: JsValue,
        shape_: JsValue,
        bits_: JsValue,
        group: JsValue,
        options: JsValue,
    ) -> Promise {
        if let Err(p) = checked(&options::RESIDUAL, &options) {
            return p;
        }
        let core = XQuantCore {
            ctx: self.ctx.clone(),
        };
        promise(async move {
            let (dims, spec) = shape_and_spec(&shape_, &bits_, &group, &options)?;
            let xt = core.upload(&x, &dims, spec.params, "x").await?;
            let rt = core.upload(&recon, &dims, spec.params, "recon").await?;
            let out = DType::parse(&text(&options, "outDtype", "f32")?)?;
            let t = core
                .ctx
                .quantize_residual(&xt, &rt, spec.bits, &spec, out)
                .await?;
            Ok(Float32Array::from(core.ctx.read_f32(&t).await?.as_slice()).into())
        })
    }

    /// `cross_layer_similarity(a, b)`: `{ mse, cosine }`.
    #[wasm_bindgen(js_name = crossLayerSimilarity)]
    pub fn cross_layer_similarity(&self, a: JsValue, b: JsValue, shape_: JsValue) -> Promise {
        let core = XQuantCore {
            ctx: self.ctx.clone(),
        };
        promise(async move {
            let dims = shape(&shape_)?;
            let at = core.upload(&a, &dims, ParamsPrecision::F32, "a").await?;
            let bt = core.upload(&b, &dims, ParamsPrecision::F32, "b").await?;
            let s = core.ctx.cross_layer_similarity(&at, &bt).await?;
            Ok(object(&[
                ("mse", s.mse.into()),
                ("cosine", s.cosine.into()),
            ]))
        })
    }

    /// All-pairs similarity of `layers` (an array of typed arrays of one `shape`):
    /// `{ layers, mse, cosine }` with L × L row-major Float32Arrays.
    #[wasm_bindgen(js_name = similarityMatrix)]
    pub fn similarity_matrix(&self, layers: JsValue, shape_: JsValue) -> Promise {
        let core = XQuantCore {
            ctx: self.ctx.clone(),
        };
        promise(async move {
            let dims = shape(&shape_)?;
            if !Array::is_array(&layers) {
                return Err(XqError::Shape(
                    "layers must be an array of typed arrays".into(),
                ));
            }
            let list = Array::from(&layers);
            let mut tensors = Vec::with_capacity(list.length() as usize);
            for (i, l) in list.iter().enumerate() {
                let what = format!("layers[{i}]");
                tensors.push(core.upload(&l, &dims, ParamsPrecision::F32, &what).await?);
            }
            let m = core.ctx.similarity_matrix(&tensors).await?;
            Ok(object(&[
                ("layers", (m.layers as f64).into()),
                ("mse", Float32Array::from(m.mse.as_slice()).into()),
                ("cosine", Float32Array::from(m.cosine.as_slice()).into()),
            ]))
        })
    }

    /// `xquant analyze` on the bytes of a K/V safetensors file: the same object as
    /// `analyze --json` (options: `groupSize`, `baseBits`, `residualBits`, `groupQuantSize`,
    /// `eta`, `valueAxis`, `params`; or `plan`: a preset's name, a plan object or its JSON).
    #[wasm_bindgen(js_name = analyzeKv)]
    pub fn analyze_kv(&self, bytes: JsValue, options: JsValue) -> Promise {
        if let Err(p) = checked(&options::ANALYZE, &options) {
            return p;
        }
        let ctx = self.ctx.clone();
        plan_promise(has_plan(&options), async move {
            let kv = KvFile::from_bytes(&file_bytes(&bytes)?)?;
            let report = match field(&options, "plan") {
                None => {
                    analyze(
                        &ctx,
                        &kv,
                        &xquant_options(&options, XQuantConfig::default())?,
                    )
                    .await?
                }
                Some(p) => {
                    let plan = plan_option(&options, &p, kv.layers.len(), kv.shape.dim())?;
                    analyze_plan(&ctx, &kv, &plan).await?
                }
            };
            json_value(&report.to_json())
        })
    }

    /// `xquant plan --json` on the bytes of a K/V safetensors file (options: `targetBits`,
    /// `context`, `window`, `sinks`, `groupQuantSize`; defaults as the CLI's). A file with
    /// queries (`q.{i}`) is planned by the attention output they get; one without is refused
    /// unless `kvError: true` asks for the K/V error alone.
    #[wasm_bindgen(js_name = suggestPlan)]
    pub fn suggest_plan(&self, bytes: JsValue, options: JsValue) -> Promise {
        if let Err(p) = checked(&options::SUGGEST, &options) {
            return p;
        }
        let ctx = self.ctx.clone();
        promise(async move {
            let bytes = file_bytes(&bytes)?;
            let kv = KvFile::from_bytes(&bytes)?;
            let d = PlannerOptions::default();
            let opts = PlannerOptions {
                target_bits: num(&options, "targetBits", d.target_bits)?,
                context: int(&options, "context", d.context)?,
                window: int(&options, "window", d.window)?,
                sinks: int(&options, "sinks", d.sinks)?,
                group_quant_size: int(&options, "groupQuantSize", d.group_quant_size)?,
            };
            let tensors = crate::kvfile::read_tensors(&bytes)?;
            let (p, key_error) = if tensors.contains_key("q.0") {
                let probe = AttentionProbe::new(&kv, &tensors, PROBE_QUERIES)?;
                drop(tensors);
                (
                    plan_by_attention(&ctx, &kv, &probe, &opts).await?,
                    "attention",
                )
            } else if field(&options, "kvError").and_then(|v| v.as_bool()) == Some(true) {
                let weights = planner::KeyWeights::from_tensors(&tensors, &kv, opts.sinks)?;
                drop(tensors);
                (
                    planner::plan(&ctx, &kv, weights.as_ref(), &opts).await?,
                    "relative",
                )
            } else {
                return Err(XqError::Config(
                    "suggestPlan: the file has no queries (q.{i}), which the planner needs to \
                     judge a plan by the attention it gives: capture with \
                     `model.capture(text, { queries: true })` or `xquant capture --queries`, or \
                     pass `kvError: true` to plan by the K/V error alone (it ranks plans poorly \
                     against perplexity and can choose plans that collapse the model)"
                        .into(),
                ));
            };
            json_value(&serde_json::json!({
                "keyError": key_error,
                "targetBits": opts.target_bits,
                "context": opts.context,
                "effectiveBits": p.bytes.effective_bits(),
                "quantizedBits": p.bytes.quantized_bits(),
                "kvBytes": p.bytes.total,
                "error": p.error,
                "plan": p.plan.to_json(),
            }))
        })
    }

    /// The L × L cosine and MSE of a K/V safetensors file's keys and values:
    /// `{ layers, shape, key: { cosine, mse }, value: { cosine, mse } }` (row-major
    /// Float32Arrays).
    #[wasm_bindgen(js_name = kvSimilarity)]
    pub fn kv_similarity(&self, bytes: JsValue) -> Promise {
        let ctx = self.ctx.clone();
        promise(async move {
            let kv = KvFile::from_bytes(&file_bytes(&bytes)?)?;
            let dims = kv.shape.dims().to_vec();
            let mut out = vec![
                ("layers", JsValue::from(kv.layers.len() as f64)),
                (
                    "shape",
                    dims.iter()
                        .map(|&d| JsValue::from(d as f64))
                        .collect::<Array>()
                        .into(),
                ),
            ];
            let sim = crate::analysis::kv_similarity(&ctx, &kv).await?;
            for (name, m) in [("key", &sim.key), ("value", &sim.value)] {
                out.push((
                    name,
                    object(&[
                        ("cosine", Float32Array::from(m.cosine.as_slice()).into()),
                        ("mse", Float32Array::from(m.mse.as_slice()).into()),
                    ]),
                ));
            }
            Ok(object(&out))
        })
    }

    /// Loads a GGUF model (llama family) from its bytes (`Uint8Array` or `ArrayBuffer`).
    #[wasm_bindgen(js_name = loadModel)]
    pub fn load_model(&self, bytes: JsValue) -> Promise {
        let ctx = self.ctx.clone();
        promise(async move {
            let bytes = file_bytes(&bytes)?;
            Ok(crate::wasm::model::load_model(ctx, bytes).await?.into())
        })
    }

    /// A cache set restored from the bytes of `CacheSetCore.save()` (a Uint8Array or
    /// ArrayBuffer); rejects with a FormatError for bytes that are not a whole saved set.
    #[wasm_bindgen(js_name = restoreCacheSet)]
    pub fn restore_cache_set(&self, bytes: JsValue) -> Promise {
        let bytes = match file_bytes(&bytes) {
            Ok(b) => b,
            Err(_) => {
                return Promise::reject(&to_js(XqError::Format(
                    "a saved cache set must be given as a Uint8Array or an ArrayBuffer".into(),
                )))
            }
        };
        let ctx = self.ctx.clone();
        promise(async move {
            let set = CacheSet::restore(ctx, &bytes).await?;
            Ok(CacheSetCore::new(set).into())
        })
    }

    /// A coordinated set of caches (options as in the facade's `cacheSet`).
    #[wasm_bindgen(js_name = cacheSet)]
    pub fn cache_set(&self, options: JsValue) -> std::result::Result<CacheSetCore, JsValue> {
        let build = || -> Result<CacheSetCore> {
            options::CACHE_SET.check(&options)?;
            let d = CacheConfig::default();
            let model = ModelSpec {
                layers: int(&options, "layers", 0)?,
                kv_heads: int(&options, "kvHeads", 0)?,
                head_dim: int(&options, "headDim", 0)?,
                batch: int(&options, "batch", 1)?,
            };
            let config = CacheConfig {
                quant: xquant_options(&options, d.quant)?,
                max_ctx: int(&options, "maxCtx", d.max_ctx)?,
                window: int(&options, "window", d.window)?,
                sinks: int(&options, "sinks", d.sinks)?,
                decode_policy: DecodePolicy::parse(&text(&options, "decodePolicy", "window")?)?,
                output: DType::parse(&text(&options, "outputDtype", "f16")?)?,
                page_tokens: int(&options, "pageTokens", d.page_tokens)?,
            };
            let windows = attention_windows(&options, model.layers)?;
            let mut plan = match field(&options, "plan") {
                None => {
                    model.validate()?;
                    config.validate(model.head_dim)?;
                    config.plan(model.layers, model.head_dim)?
                }
                Some(p) => plan_option(&options, &p, model.layers, model.head_dim)?,
            };
            if let Some(w) = windows {
                plan = plan.with_model_windows(&w);
            }
            let set = CacheSet::for_plan(self.ctx.clone(), model, plan, config.options())?;
            Ok(CacheSetCore::new(set))
        };
        build().map_err(if has_plan(&options) {
            to_js_plan
        } else {
            to_js
        })
    }
}

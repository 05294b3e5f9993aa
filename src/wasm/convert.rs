//! JS values in and out: typed arrays, option objects.

use js_sys::{Float32Array, Object, Reflect, Uint16Array, Uint32Array};
use wasm_bindgen::prelude::*;
use wasm_bindgen::JsCast;

use crate::error::{Result, XqError};
use crate::gpu::word_hash::WordHashMap;
use crate::wasm::options::describe;

/// `v` as a `T` typed array when it is a real one: an object that merely inherits a typed
/// array's prototype passes `instanceof`, and its accessors would throw.
pub(crate) fn typed_array<T: JsCast>(v: &JsValue) -> Option<&T> {
    if js_sys::ArrayBuffer::is_view(v) {
        v.dyn_ref::<T>()
    } else {
        None
    }
}

/// Host data from a typed array: f32 values or f16 bit patterns.
pub(crate) enum HostData {
    F32(Vec<f32>),
    F16(Vec<u16>),
}

impl HostData {
    /// The values of `[batch, tokens, heads, dim]` rearranged heads-major (`[batch, heads,
    /// tokens, dim]`).
    pub(crate) fn tokens_to_heads(
        self,
        batch: usize,
        tokens: usize,
        heads: usize,
        dim: usize,
    ) -> crate::error::Result<Self> {
        use crate::reference::tokens_to_heads as t2h;
        Ok(match self {
            HostData::F32(x) => HostData::F32(t2h(&x, batch, tokens, heads, dim)?),
            HostData::F16(x) => HostData::F16(t2h(&x, batch, tokens, heads, dim)?),
        })
    }

    /// From a `Float32Array` or `Uint16Array` (IEEE half bits).
    pub fn from_js(v: &JsValue, what: &str) -> Result<HostData> {
        if let Some(a) = typed_array::<Float32Array>(v) {
            return Ok(HostData::F32(a.to_vec()));
        }
        if let Some(a) = typed_array::<Uint16Array>(v) {
            return Ok(HostData::F16(a.to_vec()));
        }
        Err(XqError::Shape(format!(
            "{what} must be a Float32Array or a Uint16Array of f16 bits"
        )))
    }

    /// Whether `v` is a typed array this type takes.
    pub fn is_typed(v: &JsValue) -> bool {
        typed_array::<Float32Array>(v).is_some() || typed_array::<Uint16Array>(v).is_some()
    }

    pub fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::F16(v) => v.len(),
        }
    }
}

/// `Uint32Array` contents.
pub(crate) fn u32s(v: &JsValue, what: &str) -> Result<Vec<u32>> {
    typed_array::<Uint32Array>(v)
        .map(|a| a.to_vec())
        .ok_or_else(|| XqError::Shape(format!("{what} must be a Uint32Array")))
}

/// `Float32Array` contents.
pub(crate) fn f32s(v: &JsValue, what: &str) -> Result<Vec<f32>> {
    typed_array::<Float32Array>(v)
        .map(|a| a.to_vec())
        .ok_or_else(|| XqError::Shape(format!("{what} must be a Float32Array")))
}

/// A shape given as an array of non-negative integers.
pub(crate) fn shape(v: &JsValue) -> Result<Vec<usize>> {
    if !js_sys::Array::is_array(v) {
        return Err(XqError::Shape("shape must be an array of integers".into()));
    }
    let arr = js_sys::Array::from(v);
    arr.iter()
        .map(|d| {
            d.as_f64()
                .filter(|x| x.fract() == 0.0 && *x >= 0.0 && *x < 4294967296.0)
                .map(|x| x as usize)
                .ok_or_else(|| {
                    XqError::Shape(format!(
                        "shape entries must be non-negative integers, got {}",
                        describe(&d)
                    ))
                })
        })
        .collect()
}

thread_local! {
    static KEYS: std::cell::RefCell<WordHashMap<&'static str, JsValue>> =
        std::cell::RefCell::new(WordHashMap::default());
}

/// The JS string `name` (a property name), made once per name: passing a string from wasm
/// decodes it in JS each time, a cost a hot call pays for every field it reads.
pub(crate) fn key(name: &'static str) -> JsValue {
    KEYS.with(|k| {
        k.borrow_mut()
            .entry(name)
            .or_insert_with(|| JsValue::from_str(name))
            .clone()
    })
}

/// Where a call's options are read from: a JS object, each read a call into JS, or the
/// [`Options`] a table read from one at once.
pub(crate) trait OptionSource {
    /// Option `name` (absent, `undefined` or `null` → `None`).
    fn option(&self, name: &'static str) -> Option<JsValue>;
}

impl OptionSource for JsValue {
    fn option(&self, name: &'static str) -> Option<JsValue> {
        if self.is_undefined() || self.is_null() {
            return None;
        }
        Reflect::get(self, &key(name))
            .ok()
            .filter(|v| !v.is_undefined() && !v.is_null())
    }
}

/// The options a call was given, read once and checked by its table
/// ([`crate::wasm::options::Table::read`]): looking one up is no call into JS, which on a
/// hot call (`encodeAppend`, `encodeAttend`: 60 a decode step) was a large share of its time.
#[derive(Default)]
pub(crate) struct Options(Vec<(&'static str, JsValue)>);

impl Options {
    /// From the (name, value) pairs given; `undefined` values count as absent.
    pub(crate) fn new(given: Vec<(&'static str, JsValue)>) -> Self {
        Options(given)
    }

    /// The value of option `name`, as given.
    pub(crate) fn get(&self, name: &str) -> Option<&JsValue> {
        self.0.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }
}

impl OptionSource for Options {
    fn option(&self, name: &'static str) -> Option<JsValue> {
        self.get(name)
            .filter(|v| !v.is_undefined() && !v.is_null())
            .cloned()
    }
}

/// Option `name` of `obj`, a JS object or the [`Options`] read from one (absent, `undefined`
/// or `null` → `None`).
pub(crate) fn field<O: OptionSource + ?Sized>(obj: &O, name: &'static str) -> Option<JsValue> {
    obj.option(name)
}

/// An integer option, `default` when absent.
pub(crate) fn int<O: OptionSource + ?Sized>(
    obj: &O,
    name: &'static str,
    default: usize,
) -> Result<usize> {
    match field(obj, name) {
        None => Ok(default),
        Some(v) => v
            .as_f64()
            .filter(|x| x.fract() == 0.0 && *x >= 0.0 && *x <= 4294967295.0)
            .map(|x| x as usize)
            .ok_or_else(|| {
                XqError::Config(format!(
                    "option `{name}`: expected a non-negative integer, got {}",
                    describe(&v)
                ))
            }),
    }
}

/// A number option, `default` when absent.
pub(crate) fn num<O: OptionSource + ?Sized>(
    obj: &O,
    name: &'static str,
    default: f64,
) -> Result<f64> {
    match field(obj, name) {
        None => Ok(default),
        Some(v) => v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| {
            XqError::Config(format!(
                "option `{name}`: expected a finite number, got {}",
                describe(&v)
            ))
        }),
    }
}

/// A string option, `default` when absent.
pub(crate) fn text<O: OptionSource + ?Sized>(
    obj: &O,
    name: &'static str,
    default: &str,
) -> Result<String> {
    match field(obj, name) {
        None => Ok(default.to_string()),
        Some(v) => v.as_string().ok_or_else(|| {
            XqError::Config(format!(
                "option `{name}`: expected a string, got {}",
                describe(&v)
            ))
        }),
    }
}

/// A bit width option (0..=255 before validation).
pub(crate) fn bits<O: OptionSource + ?Sized>(
    obj: &O,
    name: &'static str,
    default: u8,
) -> Result<u8> {
    let v = int(obj, name, default as usize)?;
    u8::try_from(v)
        .map_err(|_| XqError::Config(format!("option `{name}` must be in 1..=8, got {v}")))
}

/// A plain object from (key, value) pairs.
pub(crate) fn object(pairs: &[(&str, JsValue)]) -> JsValue {
    let o = Object::new();
    for (k, v) in pairs {
        let _ = Reflect::set(&o, &JsValue::from_str(k), v);
    }
    o.into()
}

/// A positional count argument (`layer`, `n`): a non-negative integer, else a `ShapeError`.
pub(crate) fn arg_count(v: &JsValue, what: &str) -> Result<usize> {
    v.as_f64()
        .filter(|x| x.fract() == 0.0 && (0.0..1e9).contains(x))
        .map(|x| x as usize)
        .ok_or_else(|| {
            XqError::Shape(format!(
                "{what} must be a non-negative integer, got {}",
                describe(v)
            ))
        })
}

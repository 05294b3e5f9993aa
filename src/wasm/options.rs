//! Every options object the package accepts, in one place: its option names (as the JS API
//! documents them) and their types. An unknown name or a value of the wrong type is a
//! `ConfigError` naming the option; ranges are checked by the library behind.

use js_sys::{Array, Object};
use wasm_bindgen::prelude::*;
use wasm_bindgen::JsCast;

use crate::error::{Result, XqError};
use crate::wasm::convert::Options;

/// The type an option's value must have.
#[derive(Clone, Copy)]
pub(crate) enum Kind {
    /// An integer in 0..=2^32-1.
    Count,
    /// A finite number.
    Number,
    /// `true` or `false`.
    Bool,
    /// One of these strings.
    OneOf(&'static [&'static str]),
    /// A plan: a preset's name, a plan object or its JSON text.
    Plan,
    /// An object (checked by the caller).
    Object,
    /// Anything but `undefined` (checked by the caller).
    Any,
}

/// The options of one call.
pub(crate) struct Table {
    /// How messages name the call (`cacheSet`).
    pub call: &'static str,
    pub options: &'static [(&'static str, Kind)],
}

const DTYPE: Kind = Kind::OneOf(&["f32", "f16"]);
const AXIS: Kind = Kind::OneOf(&["tokens", "channels"]);
const PARAMS: Kind = Kind::OneOf(&["f16", "f32"]);
const LEVELS: Kind = Kind::OneOf(&["uniform", "lloyd-max"]);
const ROTATION: Kind = Kind::OneOf(&["none", "hadamard"]);
const LAYOUT: Kind = Kind::OneOf(&["heads", "tokens"]);

pub(crate) const CREATE: Table = Table {
    call: "XQuant.create",
    options: &[
        ("device", Kind::Object),
        ("gpu", Kind::Object),
        (
            "powerPreference",
            Kind::OneOf(&["low-power", "high-performance"]),
        ),
        ("wasm", Kind::Any),
    ],
};

pub(crate) const CACHE_SET: Table = Table {
    call: "cacheSet",
    options: &[
        ("layers", Kind::Count),
        ("kvHeads", Kind::Count),
        ("headDim", Kind::Count),
        ("batch", Kind::Count),
        ("groupSize", Kind::Count),
        ("baseBits", Kind::Count),
        ("keyBits", Kind::Count),
        ("residualBits", Kind::Count),
        ("groupQuantSize", Kind::Count),
        ("maxCtx", Kind::Count),
        ("eta", Kind::Number),
        ("valueAxis", AXIS),
        ("valueLevels", LEVELS),
        ("valueRotation", ROTATION),
        ("params", PARAMS),
        ("window", Kind::Count),
        ("sinks", Kind::Count),
        ("decodePolicy", Kind::OneOf(&["window", "reference"])),
        ("outputDtype", Kind::OneOf(&["f16", "f32"])),
        ("pageTokens", Kind::Count),
        ("plan", Kind::Plan),
        ("attentionWindows", Kind::Any),
    ],
};

pub(crate) const QUANTIZE: Table = Table {
    call: "quantizeCodes",
    options: &[
        ("eta", Kind::Number),
        ("valueAxis", AXIS),
        ("params", PARAMS),
        ("levels", LEVELS),
    ],
};

pub(crate) const RESIDUAL: Table = Table {
    call: "quantizeResidual",
    options: &[
        ("eta", Kind::Number),
        ("valueAxis", AXIS),
        ("params", PARAMS),
        ("outDtype", DTYPE),
    ],
};

pub(crate) const DEQUANT: Table = Table {
    call: "dequantWithParams",
    options: &[("outDtype", DTYPE)],
};

pub(crate) const ANALYZE: Table = Table {
    call: "analyzeKv",
    options: &[
        ("groupSize", Kind::Count),
        ("baseBits", Kind::Count),
        ("keyBits", Kind::Count),
        ("residualBits", Kind::Count),
        ("groupQuantSize", Kind::Count),
        ("eta", Kind::Number),
        ("valueAxis", AXIS),
        ("valueLevels", LEVELS),
        ("valueRotation", ROTATION),
        ("params", PARAMS),
        ("plan", Kind::Plan),
        ("window", Kind::Count),
        ("sinks", Kind::Count),
    ],
};

pub(crate) const SUGGEST: Table = Table {
    call: "suggestPlan",
    options: &[
        ("targetBits", Kind::Number),
        ("context", Kind::Count),
        ("window", Kind::Count),
        ("sinks", Kind::Count),
        ("groupQuantSize", Kind::Count),
        ("kvError", Kind::Bool),
    ],
};

pub(crate) const CAPTURE: Table = Table {
    call: "capture",
    options: &[("queries", Kind::Bool)],
};

pub(crate) const APPEND: Table = Table {
    call: "append",
    options: &[
        ("dtype", DTYPE),
        ("offset", Kind::Count),
        ("keysOffset", Kind::Count),
        ("valuesOffset", Kind::Count),
        ("layout", LAYOUT),
    ],
};

pub(crate) const ENCODE_APPEND: Table = Table {
    call: "encodeAppend",
    options: APPEND.options,
};

pub(crate) const ATTEND_GPU: Table = Table {
    call: "attendGpu",
    options: &[
        ("queryHeads", Kind::Count),
        ("tokens", Kind::Count),
        ("pos0", Kind::Count),
        ("scale", Kind::Number),
        ("window", Kind::Count),
        ("layout", LAYOUT),
        ("queryLayout", LAYOUT),
        ("dtype", DTYPE),
        ("outDtype", DTYPE),
        ("offset", Kind::Count),
        ("outOffset", Kind::Count),
    ],
};

pub(crate) const ENCODE_ATTEND: Table = Table {
    call: "encodeAttend",
    options: ATTEND_GPU.options,
};

pub(crate) const ATTEND: Table = Table {
    call: "attend",
    options: &[
        ("queryHeads", Kind::Count),
        ("tokens", Kind::Count),
        ("pos0", Kind::Count),
        ("scale", Kind::Number),
        ("window", Kind::Count),
        ("layout", LAYOUT),
        ("queryLayout", LAYOUT),
    ],
};

pub(crate) const FETCH_INTO: Table = Table {
    call: "fetchInto",
    options: &[
        ("dtype", DTYPE),
        ("keysOffset", Kind::Count),
        ("valuesOffset", Kind::Count),
    ],
};

pub(crate) const LOAD_MODEL: Table = Table {
    call: "loadModel",
    options: &[("onProgress", Kind::Any), ("signal", Kind::Object)],
};

pub(crate) const GENERATE: Table = Table {
    call: "generate",
    options: &[
        ("maxTokens", Kind::Count),
        ("cache", Kind::Any),
        ("maxCtx", Kind::Count),
        ("temperature", Kind::Number),
        ("topK", Kind::Count),
        ("topP", Kind::Number),
        ("seed", Kind::Count),
        ("signal", Kind::Object),
        ("onPrefill", Kind::Any),
    ],
};

pub(crate) const CHAT_TEMPLATE: Table = Table {
    call: "chatTemplate",
    options: &[("addGenerationPrompt", Kind::Any)],
};

pub(crate) const TOKENIZE: Table = Table {
    call: "tokenize",
    options: &[("special", Kind::Any), ("bos", Kind::Bool)],
};

const TABLES: &[&Table] = &[
    &CREATE,
    &CACHE_SET,
    &QUANTIZE,
    &RESIDUAL,
    &DEQUANT,
    &ANALYZE,
    &SUGGEST,
    &CAPTURE,
    &APPEND,
    &ENCODE_APPEND,
    &ATTEND_GPU,
    &ENCODE_ATTEND,
    &ATTEND,
    &FETCH_INTO,
    &LOAD_MODEL,
    &GENERATE,
    &CHAT_TEMPLATE,
    &TOKENIZE,
];

#[wasm_bindgen]
extern "C" {
    /// `Object.entries(o)` (a proxy's trap or a getter may throw).
    #[wasm_bindgen(js_namespace = Object, js_name = entries, catch)]
    fn own_entries(o: &JsValue) -> std::result::Result<Array, JsValue>;
    /// `Object.keys(o)` (a proxy's trap may throw).
    #[wasm_bindgen(js_namespace = Object, js_name = keys, catch)]
    fn own_keys(o: &JsValue) -> std::result::Result<Array, JsValue>;
    /// `Object.getPrototypeOf(o)` (a proxy's trap may throw).
    #[wasm_bindgen(js_namespace = Object, js_name = getPrototypeOf, catch)]
    fn prototype_of(o: &JsValue) -> std::result::Result<JsValue, JsValue>;
}

thread_local! {
    /// This realm's `Object.prototype`.
    static OBJECT_PROTOTYPE: JsValue = prototype_of(&Object::new()).unwrap_or(JsValue::NULL);
}

/// Whether `v`'s prototype is `Object.prototype` (an object literal's) or `null`.
fn is_plain_object(v: &JsValue) -> bool {
    match prototype_of(v) {
        Ok(p) => p.is_null() || OBJECT_PROTOTYPE.with(|o| Object::is(&p, o)),
        Err(_) => false,
    }
}

/// The largest count an option takes (the library's sizes are 32-bit here).
const MAX_COUNT: f64 = 4294967295.0;

/// A value as a message shows it: `the string "1"`, `-3`, `null`, `an array`.
pub(crate) fn describe(v: &JsValue) -> String {
    if let Some(s) = v.as_string() {
        let short: String = s.chars().take(40).collect();
        let more = if short.len() < s.len() { "…" } else { "" };
        return format!("the string {:?}", format!("{short}{more}"));
    }
    if let Some(x) = v.as_f64() {
        return format!("{x}");
    }
    if let Some(b) = v.as_bool() {
        return format!("{b}");
    }
    if v.is_null() {
        return "null".into();
    }
    if v.is_undefined() {
        return "undefined".into();
    }
    if v.is_bigint() {
        return "a bigint".into();
    }
    if v.is_symbol() {
        return "a symbol".into();
    }
    if v.is_function() {
        return "a function".into();
    }
    if Array::is_array(v) {
        return "an array".into();
    }
    // Through Reflect only: a `constructor` key of any value must not throw here.
    let name = js_sys::Reflect::get(v, &JsValue::from_str("constructor"))
        .ok()
        .filter(|c| c.is_function())
        .and_then(|c| js_sys::Reflect::get(&c, &JsValue::from_str("name")).ok())
        .and_then(|n| n.as_string())
        .filter(|n| !n.is_empty() && n != "Object");
    match name {
        Some(n) => format!("a {n}"),
        None => "an object".into(),
    }
}

fn wrong(table: &Table, name: &str, expected: &str, v: &JsValue) -> XqError {
    XqError::Config(format!(
        "{} option `{name}`: expected {expected}, got {}",
        table.call,
        describe(v)
    ))
}

/// Whether `v` is a count option's value.
pub(crate) fn is_count(v: &JsValue) -> bool {
    v.as_f64()
        .is_some_and(|x| x.fract() == 0.0 && (0.0..=MAX_COUNT).contains(&x))
}

impl Table {
    /// Checks `options` (absent, or an object of known names with values of their types).
    pub fn check(&self, options: &JsValue) -> Result<()> {
        self.read(options).map(drop)
    }

    /// Checks `options` as [`Table::check`] does and returns the options given, read once.
    pub fn read(&self, options: &JsValue) -> Result<Options> {
        if options.is_undefined() || options.is_null() {
            return Ok(Options::default());
        }
        if !options.is_object() || options.is_function() || Array::is_array(options) {
            return Err(XqError::Config(format!(
                "{}: options must be an object, got {}",
                self.call,
                describe(options)
            )));
        }
        let given = self.given(options)?;
        for (name, kind) in self.options {
            let Some(v) = given.get(name) else {
                continue;
            };
            match kind {
                Kind::Count if !is_count(v) => {
                    return Err(wrong(self, name, "a non-negative integer", v))
                }
                Kind::Number if !v.as_f64().is_some_and(f64::is_finite) => {
                    return Err(wrong(self, name, "a finite number", v))
                }
                Kind::Bool if v.as_bool().is_none() => {
                    return Err(wrong(self, name, "true or false", v))
                }
                Kind::OneOf(names)
                    if !v.as_string().is_some_and(|s| names.contains(&s.as_str())) =>
                {
                    let list = names
                        .iter()
                        .map(|n| format!("'{n}'"))
                        .collect::<Vec<_>>()
                        .join(" or ");
                    return Err(wrong(self, name, &list, v));
                }
                Kind::Plan
                    if !v.is_string()
                        && (!v.is_object() || v.is_function() || Array::is_array(v)) =>
                {
                    return Err(wrong(
                        self,
                        name,
                        "a preset name, a plan object or its JSON text",
                        v,
                    ));
                }
                Kind::Object if !v.is_object() => {
                    return Err(wrong(self, name, "an object", v));
                }
                _ => {}
            }
        }
        Ok(given)
    }

    /// The options `options` gives, by this table's names (an unknown name is an error). An
    /// object literal's are its own enumerable properties, read in one call into JS; any
    /// other object's (a class instance, one made with a prototype of its own) are read
    /// name by name, inherited ones included, as a property access reads them.
    fn given(&self, options: &JsValue) -> Result<Options> {
        let unreadable = |_| XqError::Config(format!("{}: cannot read its options", self.call));
        let name_of = |key: &JsValue| {
            let key = key.as_string().unwrap_or_default();
            self.options
                .iter()
                .map(|(n, _)| *n)
                .find(|n| *n == key)
                .ok_or_else(|| XqError::Config(self.unknown(&key)))
        };
        let mut given = Vec::new();
        if is_plain_object(options) {
            for entry in own_entries(options).map_err(unreadable)?.iter() {
                let entry: Array = entry.unchecked_into();
                let value = entry.get(1);
                let name = name_of(&entry.get(0))?;
                if !value.is_undefined() {
                    given.push((name, value));
                }
            }
            return Ok(Options::new(given));
        }
        for key in own_keys(options).map_err(unreadable)?.iter() {
            name_of(&key)?;
        }
        for (name, _) in self.options {
            let v = js_sys::Reflect::get(options, &crate::wasm::convert::key(name))
                .map_err(|_| XqError::Config(format!("{}: cannot read `{name}`", self.call)))?;
            if !v.is_undefined() {
                given.push((*name, v));
            }
        }
        Ok(Options::new(given))
    }

    fn unknown(&self, key: &str) -> String {
        let names: Vec<&str> = self.options.iter().map(|(n, _)| *n).collect();
        let fold = |s: &str| s.to_ascii_lowercase().replace(['_', '-'], "");
        let hint = names
            .iter()
            .find(|n| fold(n) == fold(key))
            .or_else(|| names.iter().find(|n| close(&fold(n), &fold(key))))
            .map(|n| format!(" (did you mean `{n}`?)"))
            .unwrap_or_default();
        format!(
            "{}: unknown option `{key}`{hint}; options: {}",
            self.call,
            names.join(", ")
        )
    }
}

/// Whether two names are one edit apart (a typo).
fn close(a: &str, b: &str) -> bool {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    if a.len().abs_diff(b.len()) > 1 {
        return false;
    }
    let (mut i, mut j, mut edits) = (0, 0, 0);
    while i < a.len() && j < b.len() {
        if a[i] == b[j] {
            i += 1;
            j += 1;
            continue;
        }
        edits += 1;
        if edits > 1 {
            return false;
        }
        match a.len().cmp(&b.len()) {
            std::cmp::Ordering::Greater => i += 1,
            std::cmp::Ordering::Less => j += 1,
            std::cmp::Ordering::Equal => {
                i += 1;
                j += 1;
            }
        }
    }
    edits + (a.len() - i) + (b.len() - j) <= 1
}

/// Checks the options object of `call` (a table's name, e.g. `"XQuant.create"`): for the
/// facade's own options.
#[wasm_bindgen(js_name = checkOptions)]
pub fn check_options(call: &str, options: JsValue) -> std::result::Result<(), JsValue> {
    let table = TABLES
        .iter()
        .find(|t| t.call == call)
        .ok_or_else(|| JsValue::from_str("unknown options table"))?;
    table.check(&options).map_err(crate::wasm::errors::to_js)
}

/// Translates the library's names in a message into the JS API's: `head_dim` → `headDim`.
/// With `plan`, the names a plan document itself uses (`group_quant_size`, …) are kept.
pub(crate) fn js_terms(message: &str, plan: bool) -> String {
    const ALWAYS: &[(&str, &str)] = &[
        (
            "group_size (layers per group)",
            "groupSize (layers per group)",
        ),
        ("layers_per_group", "groupSize"),
        ("model spec: ", ""),
        ("kv_heads", "kvHeads"),
        ("head_dim", "headDim"),
        ("max_ctx", "maxCtx"),
        ("top_p", "topP"),
        ("max_tokens", "maxTokens"),
        ("page_tokens", "pageTokens"),
        ("target_bits", "targetBits"),
        ("decode policy", "decodePolicy"),
        ("value axis", "valueAxis"),
        ("params precision", "params"),
        ("--group-quant-size", "groupQuantSize"),
    ];
    const OPTIONS: &[(&str, &str)] = &[
        ("group_quant_size", "groupQuantSize"),
        ("residual_bits", "residualBits"),
        ("base_bits", "baseBits"),
        ("key_bits", "keyBits"),
        ("value_levels", "valueLevels"),
        ("value_axis", "valueAxis"),
        ("value_rotation", "valueRotation"),
        ("group_size", "groupSize"),
    ];
    let mut out = message.to_string();
    let extra: &[(&str, &str)] = if plan { &[] } else { OPTIONS };
    for (from, to) in ALWAYS.iter().chain(extra) {
        out = replace_word(&out, from, to);
    }
    out
}

/// `s` with every `from` that is not part of a longer identifier replaced by `to`.
fn replace_word(s: &str, from: &str, to: &str) -> String {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find(from) {
        let before = rest[..at].chars().next_back();
        let after = rest[at + from.len()..].chars().next();
        let edge =
            |c: Option<char>, f: Option<char>| !(c.is_some_and(ident) && f.is_some_and(ident));
        let bounded = edge(before, from.chars().next()) && edge(after, from.chars().next_back());
        out.push_str(&rest[..at]);
        out.push_str(if bounded { to } else { from });
        rest = &rest[at + from.len()..];
    }
    out.push_str(rest);
    out
}

//! `XqError` → a JavaScript `Error` of the facade's class for its kind.

use std::cell::RefCell;

use js_sys::{Array, Function, Object, Reflect};
use wasm_bindgen::prelude::*;
use wasm_bindgen::JsCast;

use crate::error::XqError;
use crate::wasm::options::js_terms;

thread_local! {
    static CLASSES: RefCell<Option<Object>> = const { RefCell::new(None) };
}

/// Called once by the facade: `{ ShapeError, ConfigError, ... }`, constructors taking a message.
#[wasm_bindgen(js_name = registerErrorClasses)]
pub fn register_error_classes(classes: Object) {
    CLASSES.with(|c| *c.borrow_mut() = Some(classes));
}

/// Kind of error used when the library is misused from JS (freed object, call in flight).
pub(crate) fn usage_error(message: &str) -> JsValue {
    make("UsageError", message)
}

fn make(kind: &str, message: &str) -> JsValue {
    let ctor = CLASSES.with(|c| {
        c.borrow()
            .as_ref()
            .and_then(|o| Reflect::get(o, &JsValue::from_str(kind)).ok())
            .and_then(|f| f.dyn_into::<Function>().ok())
    });
    if let Some(ctor) = ctor {
        let args = Array::of1(&JsValue::from_str(message));
        if let Ok(e) = Reflect::construct(&ctor, &args) {
            return e;
        }
    }
    let e = js_sys::Error::new(message);
    e.set_name(kind);
    e.into()
}

/// The JS error for `e`, its message in the JS API's names.
pub(crate) fn to_js(e: XqError) -> JsValue {
    make(e.kind(), &js_terms(e.message(), false))
}

/// As [`to_js`] for a call given a plan: the plan document's own field names are kept.
pub(crate) fn to_js_plan(e: XqError) -> JsValue {
    make(e.kind(), &js_terms(e.message(), true))
}

/// What the error scopes of [`in_scopes`] caught.
pub(crate) type Verdict =
    std::pin::Pin<Box<dyn std::future::Future<Output = crate::error::Result<()>>>>;

/// Runs `f` (buffer creation, uploads) inside validation and out-of-memory error scopes of
/// its own, popped before this returns: on a runtime's shared device an error of ours never
/// reaches its uncaptured-error handler. The future gives the scopes' verdict.
pub(crate) fn in_scopes<T>(device: &wgpu::Device, f: impl FnOnce() -> T) -> (T, Verdict) {
    let oom = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
    let validation = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let out = f();
    let validation = validation.pop();
    let oom = oom.pop();
    let verdict = Box::pin(async move {
        if let Some(e) = validation.await {
            return Err(XqError::Gpu(format!("preparing the inputs: {e}")));
        }
        if let Some(e) = oom.await {
            return Err(XqError::Gpu(format!("out of GPU memory: {e}")));
        }
        Ok(())
    });
    (out, verdict)
}

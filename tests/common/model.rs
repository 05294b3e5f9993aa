//! The real model for tests: `XQ_MODEL` or the path `scripts/fetch-model` caches it at.
//! Without it the test is skipped with a printed reason, unless `REQUIRE_MODEL=1`.

use std::path::PathBuf;

pub fn model_path() -> Option<PathBuf> {
    let path = std::env::var_os("XQ_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            let cache = std::env::var_os("XQUANT_CACHE")
                .map(PathBuf::from)
                .unwrap_or(home.join(".cache/xquant-wgpu"));
            cache.join("SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    if path.exists() {
        return Some(path);
    }
    if std::env::var("REQUIRE_MODEL").is_ok_and(|v| v == "1") {
        panic!(
            "REQUIRE_MODEL=1 but {} does not exist (run scripts/fetch-model)",
            path.display()
        );
    }
    eprintln!(
        "SKIPPED: no model at {} (run scripts/fetch-model, or set XQ_MODEL)",
        path.display()
    );
    None
}

/// `let bytes = model_or_skip!();` — the model file's bytes, or return (skip).
#[macro_export]
macro_rules! model_or_skip {
    () => {
        match $crate::common::model::model_path() {
            Some(p) => std::fs::read(&p).expect("model readable"),
            None => return,
        }
    };
}

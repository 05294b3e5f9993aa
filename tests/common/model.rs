//! The real models for tests: `XQ_MODEL` (SmolLM2) / `XQ_GEMMA` (Gemma 3) or the paths
//! `scripts/fetch-model` caches them at.
//! Without it the test is skipped with a printed reason, unless `REQUIRE_MODEL=1`.

use std::path::PathBuf;

pub fn model_path() -> Option<PathBuf> {
    find(
        "XQ_MODEL",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "scripts/fetch-model",
    )
}

/// Gemma 3 270M: `XQ_GEMMA` or where `scripts/fetch-model gemma3-270m` caches it.
#[allow(dead_code)]
pub fn gemma_path() -> Option<PathBuf> {
    find(
        "XQ_GEMMA",
        "gemma-3-270m-q4_k_m.gguf",
        "scripts/fetch-model gemma3-270m",
    )
}

fn find(var: &str, file: &str, fetch: &str) -> Option<PathBuf> {
    let path = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_default();
        let cache = std::env::var_os("XQUANT_CACHE")
            .map(PathBuf::from)
            .unwrap_or(home.join(".cache/xquant-wgpu"));
        cache.join(file)
    });
    if path.exists() {
        return Some(path);
    }
    if std::env::var("REQUIRE_MODEL").is_ok_and(|v| v == "1") {
        panic!(
            "REQUIRE_MODEL=1 but {} does not exist (run {fetch})",
            path.display()
        );
    }
    eprintln!(
        "SKIPPED: no model at {} (run {fetch}, or set {var})",
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

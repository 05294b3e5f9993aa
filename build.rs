//! Build script: a digest of every source the crate compiles (`src/`, `wgsl/`) as
//! `XQUANT_SOURCE_DIGEST`, which keys the evaluation baselines an `xquant eval` keeps: the
//! log-probs depend on the WGSL and on the Rust that dispatches it (chunk sizes decide where
//! split-K partials merge), so a baseline kept by another build is not replayed.

use std::fs;
use std::path::{Path, PathBuf};

include!("src/digest.rs");

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files(&path, out);
        } else {
            out.push(path);
        }
    }
}

fn main() {
    let mut paths = Vec::new();
    for dir in ["src", "wgsl"] {
        println!("cargo:rerun-if-changed={dir}");
        files(Path::new(dir), &mut paths);
    }
    paths.sort();
    let mut sources = Vec::new();
    for path in &paths {
        sources.extend(path.to_string_lossy().as_bytes());
        sources.extend(fs::read(path).unwrap_or_default());
    }
    let digest = content_digest(&sources);
    println!("cargo:rustc-env=XQUANT_SOURCE_DIGEST={digest}");
}

//! Build script: a digest of every source the crate compiles (`src/`, `wgsl/`) as
//! `XQUANT_SOURCE_DIGEST`, which keys the evaluation baselines an `xquant eval` keeps: the
//! log-probs depend on the WGSL and on the Rust that dispatches it (chunk sizes decide where
//! split-K partials merge), so a baseline kept by another build is not replayed.

use std::fs;
use std::path::{Path, PathBuf};

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
    // Two FNV-1a hashes, as `content_digest` in src/model/eval.rs (not cryptographic).
    let (mut a, mut b) = (0xcbf2_9ce4_8422_2325u64, 0x6c62_272e_07bb_0142u64);
    let mut i = 0u64;
    for path in &paths {
        let name = path.to_string_lossy().into_owned().into_bytes();
        let bytes = fs::read(path).unwrap_or_default();
        for &x in name.iter().chain(&bytes) {
            a = (a ^ x as u64).wrapping_mul(0x0000_0100_0000_01b3);
            b = (b ^ (x as u64 ^ i.rotate_left(17))).wrapping_mul(0x0000_0100_0000_01b3);
            i += 1;
        }
    }
    println!("cargo:rustc-env=XQUANT_SOURCE_DIGEST={a:016x}{b:016x}");
}

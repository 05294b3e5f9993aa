//! Corpus files.

#![allow(unused_imports)]

use super::*;

/// The files of a corpus directory, sorted by name.
pub fn read_corpus(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_file())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            std::fs::read(e.path()).ok().map(|b| (name, b))
        })
        .collect();
    out.sort();
    out
}

/// A stable name for an input: FNV-1a of its bytes.
pub fn input_name(bytes: &[u8]) -> String {
    format!("{:016x}", fnv1a64(bytes))
}

/// 64-bit FNV-1a (the saved-cache container's checksum, and corpus file names).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

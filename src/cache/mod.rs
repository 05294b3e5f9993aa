//! The cache set: one XQuant cache per attention layer, anchors and reuse layers
//! cooperating on the GPU, plus a plain f16 cache with the same interface as a baseline.

#[cfg(not(target_arch = "wasm32"))]
mod bench;
mod config;
mod coordinator;
mod fp16;
mod io;
mod set;
mod store;

#[cfg(not(target_arch = "wasm32"))]
pub use bench::{bench_cache, DecodeRow, PrefillRow};
pub use config::{CacheConfig, DecodePolicy, ModelSpec};
pub use coordinator::Coordinator;
pub use fp16::Fp16CacheSet;
pub use io::{Fetched, KvInput};
pub use set::{CacheSet, CacheStats, LayerStats};
pub use store::StoreBytes;

//! The cache set: one XQuant cache per attention layer, anchors and reuse layers
//! cooperating on the GPU, plus a plain f16 cache with the same interface as a baseline.
//! Both implement [`KvCache`]: append K/V, attend over them where they live (split-K
//! attention reading the packed codes), or fetch them dense.

#[cfg(not(target_arch = "wasm32"))]
mod bench;
mod config;
mod coordinator;
mod fp16;
mod io;
mod kv_cache;
mod page;
mod persist;
mod plan;
mod rotate;
mod set;
mod store;

pub use crate::gpu::kernels::attention::{AttendOptions, OutLayout};
#[cfg(not(target_arch = "wasm32"))]
pub use bench::{
    bench_cache, max_tokens, CacheBench, CacheBenchResult, DecodeRow, FirstStep, MemoryRow, Paired,
    PrefillRow, StepPart,
};
pub use config::{options_base, CacheConfig, CacheOptions, DecodePolicy, ModelSpec, DEFAULT_QUANT};
pub use coordinator::Coordinator;
pub use fp16::Fp16CacheSet;
pub(crate) use io::Inputs;
pub use io::{Fetched, KvInput};
pub use kv_cache::{CacheFuture, Checkpoint, KvCache, Scope};
pub use persist::{restore_cache, SaveJob, SavedCache, SavedKind, CACHE_MAGIC, CACHE_VERSION};
pub use plan::{
    CachePlan, CodeSource, LayerPlan, PlanBytes, Rotation, TensorPlan, DEFAULT_ROTATION_SEED,
    KIVI_2, KIVI_LLOYD, PRESETS,
};
pub use set::{CacheSet, CacheStats, KvStats, LayerStats};
pub use store::StoreBytes;

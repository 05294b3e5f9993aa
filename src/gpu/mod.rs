//! The GPU side: one [`GpuContext`] per device owns the queue, the pipeline cache and the
//! error sinks; kernels are dispatched through it on GPU-resident tensors.

mod buffer;
mod context;
#[cfg(all(test, not(target_arch = "wasm32")))]
mod contract;
pub(crate) mod dispatch;
pub(crate) mod kernels;
pub(crate) mod mirror;
pub(crate) mod pipelines;
mod profile;
mod readback;
#[cfg(not(target_arch = "wasm32"))]
mod specialise;
mod tensor;
pub(crate) mod word_hash;

pub use buffer::GpuBuffer;
pub use context::{
    AdapterSummary, AttentionChunks, AttentionFill, AttentionWorkgroup, ContextOptions, GpuContext,
};
#[cfg(not(target_arch = "wasm32"))]
pub use kernels::bench::{bench_cpu_reference, BenchKernel, BenchProblem, KernelTiming};
pub use kernels::ops::ReuseEncodingGpu;
pub use kernels::similarity::SimilarityMatrix;
pub use profile::KernelTime;
pub use tensor::{GpuParams, GpuTensor, PackedCodes, QuantizedTensor, TENSOR_ALIGN};

//! A small llama runtime (SmolLM2-135M): GGUF, tokenizer, a CPU reference forward and the
//! WGSL forward whose attention reads K/V from a cache (plain f16, or an XQuant cache set).

#[cfg(not(target_arch = "wasm32"))]
pub mod bench;
pub mod config;
pub mod cpu;
pub mod eval;
pub mod generate;
pub mod gguf;
pub mod gpu;
mod limits;
pub mod runtime;
pub mod tokenizer;
mod weight_format;

pub use config::ModelConfig;
pub use generate::{Decoder, Finish, Sampler, Sampling, TextStream};
pub use gguf::{GgmlType, Gguf};
pub use gpu::{GpuModel, Logits};
pub use runtime::{CacheChoice, Runtime};
pub use tokenizer::Tokenizer;

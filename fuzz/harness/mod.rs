//! The fuzz harness shared by the replay test (`tests/fuzz.rs`) and the long-run driver
//! (`examples/fuzz.rs`): targets over the parsers of untrusted input, a seeded mutation
//! engine, structure-aware generators, and a counting allocator that measures the peak
//! bytes a target holds while it runs on one input. Stable Rust, no fuzzing runtime.
//!
//! Modules: `alloc` (the counting allocator, panic capture), `rng`, `mutate`, `targets`,
//! `tokenizers`, `generate` (structure-aware inputs), `corpus` (files).

#![allow(dead_code)]

use serde_json::{json, Value};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::{Cell, RefCell};
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use xquant_wgpu::cache::{CachePlan, SavedCache, CACHE_MAGIC};
use xquant_wgpu::kvfile::{read_tensors, tensors_to_bytes, KvFile, Tensor};
use xquant_wgpu::model::gguf::{dequantize, Gguf};
use xquant_wgpu::model::{ModelConfig, Tokenizer};
use xquant_wgpu::{KvKind, XqError};

mod alloc;
mod corpus;
mod generate;
mod mutate;
mod rng;
mod targets;
mod tokenizers;

pub use alloc::*;
pub use corpus::*;
pub(crate) use generate::*;
pub use mutate::*;
pub use rng::*;
pub use targets::*;
pub use tokenizers::*;

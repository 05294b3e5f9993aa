//! Helpers shared by the integration tests.
#![allow(dead_code, unused_imports)]

pub mod attend;
pub mod cache_model;
pub mod cli;
pub mod gguf;
pub mod golden;
pub mod gpu;
pub mod model;
pub mod suite;
pub mod tolerances;
pub mod trial;

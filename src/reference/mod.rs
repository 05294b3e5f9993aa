//! CPU twins of every kernel, in plain f32 Rust: the numerics the GPU must reproduce.
//!
//! With default options ([`QuantSpec`](crate::config::QuantSpec) `eta = 0`, tokens axis,
//! f32 params) these are the reference implementation's semantics: padding by repeating the
//! last row, a `1e-8` scale floor, round half to even, clipping to `[0, 2^bits - 1]`.

mod accounting;
mod attention;
pub mod codebook;
mod layout;
mod pairing;
mod quant;
mod rotation;
mod similarity;

pub use accounting::{effective_bits, reference_bytes, ReferenceBytes};
pub use attention::{attention, attention_windowed, AttentionShape};
pub use layout::tokens_to_heads;
pub use pairing::{anchor_of, pair_layers, LayerRole, Role};
pub use quant::{
    code_of, compute_reuse_params, compute_reuse_params_batched, dequant_with_params,
    dequant_with_params_batched, fit_cell, group_norm, level_code, level_values, quantize_codes,
    quantize_codes_batched, quantize_residual, quantize_residual_batched, reuse_encode,
    reuse_reconstruct, GroupCodes, GroupParams, ReuseEncoding, SCALE_FLOOR,
};
pub use rotation::{
    check_rotation_dim, rotate_tensor, rotate_vector, rotation_sign, rotation_stream,
    RotationTarget, MAX_ROTATION_DIM,
};
pub use similarity::{cross_layer_similarity, weighted_mse, Similarity};

//! The reference's byte accounting (`effective_pair_bits`).

use crate::config::{QuantSpec, TensorShape};
use crate::layout::GroupLayout;
use crate::reference::Role;

/// Bytes the reference charges one batch×head of one tensor (K or V).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReferenceBytes {
    /// Charged bytes: codes at their bit width plus two 16-bit numbers per (group, channel)
    /// (one, the norm, with Lloyd–Max levels).
    pub compressed: usize,
    /// The same tokens in fp16.
    pub fp16: usize,
}

impl ReferenceBytes {
    /// `16 · compressed / fp16`.
    pub fn effective_bits(&self) -> f64 {
        effective_bits(self.compressed, self.fp16)
    }
}

/// `16 · compressed / fp16_bytes`, 0 for an empty tensor.
pub fn effective_bits(compressed: usize, fp16: usize) -> f64 {
    if fp16 == 0 {
        0.0
    } else {
        16.0 * compressed as f64 / fp16 as f64
    }
}

/// Reference accounting for `tokens × dim` elements: an anchor pays
/// `ceil(S·D·bits/8) + cells·4`; a reuse layer pays `cells·4`, plus
/// `ceil(S·D·rbits/8) + cells·4` with a residual. `cells` = groups × other-axis length.
/// Lloyd–Max levels keep one 16-bit norm per cell: `cells·2` for an anchor's params.
pub fn reference_bytes(
    role: Role,
    tokens: usize,
    dim: usize,
    spec: &QuantSpec,
    residual_bits: u8,
) -> ReferenceBytes {
    let fp16 = tokens * dim * 2;
    let Ok(shape) = TensorShape::from_rows(1, tokens.max(1), dim.max(1)) else {
        return ReferenceBytes {
            compressed: 0,
            fp16,
        };
    };
    let cells = GroupLayout::new(&shape, spec).cells();
    let params = cells * 2 * spec.levels.params_per_group();
    let codes = |bits: u8| (tokens * dim * bits as usize).div_ceil(8);
    let compressed = if tokens == 0 {
        0
    } else {
        match role {
            Role::Anchor => codes(spec.bits) + params,
            Role::Reuse if residual_bits > 0 => params + codes(residual_bits) + cells * 4,
            Role::Reuse => params,
        }
    };
    ReferenceBytes { compressed, fp16 }
}

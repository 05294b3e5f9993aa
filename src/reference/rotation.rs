//! The randomized Walsh–Hadamard rotation of head vectors: the CPU twin of
//! `wgsl/rotate.wgsl`.
//!
//! A vector `x` of `D` elements (`D` a power of two) becomes `y = H (s ⊙ x) / √D`, where `H` is
//! the Sylvester Hadamard matrix and `s` fixed ±1 signs drawn from a seed for each *stream*
//! (a layer's keys or values, one KV head). The inverse is `x = s ⊙ (H y) / √D`. The rotation
//! is orthogonal, so `q · k = (R q) · (R k)` and a probability-weighted sum of rotated values
//! is the rotation of the sum.

use crate::error::{config_err, shape_err, Result};

/// The largest head dimension the rotation handles (the vector one kernel invocation holds).
pub const MAX_ROTATION_DIM: usize = 256;

/// A 32-bit integer hash (bijective: xor-shifts and odd multipliers).
fn mix(x: u32) -> u32 {
    let mut h = x;
    h ^= h >> 16;
    h = h.wrapping_mul(0x7feb_352d);
    h ^= h >> 15;
    h = h.wrapping_mul(0x846c_a68b);
    h ^= h >> 16;
    h
}

/// The sign stream of one layer's keys (`kind` 0) or values (`kind` 1) and one KV head.
pub fn rotation_stream(layer: usize, kind: u32, head: usize) -> u32 {
    ((layer as u32) << 16) | (kind << 15) | head as u32
}

/// The sign of element `d` of stream `stream` under `seed`: +1 or -1.
pub fn rotation_sign(seed: u32, stream: u32, d: usize) -> f32 {
    if mix(seed ^ mix(stream ^ mix(d as u32))) & 1 == 1 {
        -1.0
    } else {
        1.0
    }
}

/// Checks that vectors of `dim` elements can be rotated.
pub fn check_rotation_dim(dim: usize) -> Result<()> {
    if !dim.is_power_of_two() || !(2..=MAX_ROTATION_DIM).contains(&dim) {
        return config_err!(
            "rotation \"hadamard\" needs a head dim that is a power of two in \
             2..={MAX_ROTATION_DIM}, got {dim}"
        );
    }
    Ok(())
}

/// Rotates one vector in place (`inverse`: undoes the rotation), with the butterflies in the
/// kernel's order.
pub fn rotate_vector(v: &mut [f32], seed: u32, stream: u32, inverse: bool) {
    let dim = v.len();
    if !inverse {
        for (d, x) in v.iter_mut().enumerate() {
            *x *= rotation_sign(seed, stream, d);
        }
    }
    let mut h = 1;
    while h < dim {
        for p in 0..dim / 2 {
            let j = (p / h) * 2 * h + p % h;
            let (a, b) = (v[j], v[j + h]);
            v[j] = a + b;
            v[j + h] = a - b;
        }
        h *= 2;
    }
    let norm = 1.0 / (dim as f32).sqrt();
    for (d, x) in v.iter_mut().enumerate() {
        *x *= norm;
        if inverse {
            *x *= rotation_sign(seed, stream, d);
        }
    }
}

/// Where the vectors of a tensor come from: `[batch, heads, tokens, dim]` (heads-major) or
/// `[batch, tokens, heads, dim]` (token-major), whose heads take the signs of KV head
/// `head / gqa` of layer `layer`'s keys (`kind` 0) or values (1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RotationTarget {
    pub batch: usize,
    pub heads: usize,
    pub tokens: usize,
    pub dim: usize,
    /// `[batch, tokens, heads, dim]` instead of `[batch, heads, tokens, dim]`.
    pub token_major: bool,
    /// Heads per KV head (queries: their GQA group; K/V: 1).
    pub gqa: usize,
    pub layer: usize,
    pub kind: u32,
}

impl RotationTarget {
    /// Heads-major K/V `[batch, heads, tokens, dim]` of layer `layer`'s keys (`kind` 0) or
    /// values (1): one sign stream per head.
    pub fn kv([batch, heads, tokens, dim]: [usize; 4], layer: usize, kind: u32) -> Self {
        RotationTarget {
            batch,
            heads,
            tokens,
            dim,
            token_major: false,
            gqa: 1,
            layer,
            kind,
        }
    }

    /// The head of vector `i` (vectors in memory order).
    pub fn head_of(&self, i: usize) -> usize {
        if self.token_major {
            i % self.heads
        } else {
            (i / self.tokens) % self.heads
        }
    }

    /// The sign stream of vector `i`.
    pub fn stream_of(&self, i: usize) -> u32 {
        rotation_stream(self.layer, self.kind, self.head_of(i) / self.gqa.max(1))
    }

    /// Vectors in the tensor.
    pub fn vectors(&self) -> usize {
        self.batch * self.heads * self.tokens
    }
}

/// Rotates every vector of `x` (laid out as `target` says) in place: the CPU twin of
/// `rotate_vectors`.
pub fn rotate_tensor(
    x: &mut [f32],
    target: &RotationTarget,
    seed: u32,
    inverse: bool,
) -> Result<()> {
    check_rotation_dim(target.dim)?;
    if x.len() != target.vectors() * target.dim {
        return shape_err!(
            "{} values are not {} vectors of {}",
            x.len(),
            target.vectors(),
            target.dim
        );
    }
    for (i, v) in x.chunks_exact_mut(target.dim).enumerate() {
        rotate_vector(v, seed, target.stream_of(i), inverse);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_is_orthogonal_and_inverts() {
        for dim in [2usize, 4, 64, 256] {
            let x: Vec<f32> = (0..dim)
                .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3)
                .collect();
            let mut y = x.clone();
            rotate_vector(&mut y, 7, rotation_stream(3, 1, 2), false);
            let n = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
            assert!(
                (n(&x) - n(&y)).abs() <= 1e-5 * n(&x),
                "norm kept at D = {dim}"
            );
            assert_ne!(x, y);
            rotate_vector(&mut y, 7, rotation_stream(3, 1, 2), true);
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= 1e-5, "inverse at D = {dim}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn signs_depend_on_seed_and_stream_and_are_balanced() {
        let count = |seed, stream| {
            (0..1024)
                .filter(|&d| rotation_sign(seed, stream, d) < 0.0)
                .count()
        };
        let n = count(1, rotation_stream(0, 0, 0));
        assert!((400..=624).contains(&n), "{n} negative signs of 1024");
        let a: Vec<f32> = (0..64).map(|d| rotation_sign(1, 5, d)).collect();
        let b: Vec<f32> = (0..64).map(|d| rotation_sign(2, 5, d)).collect();
        let c: Vec<f32> = (0..64).map(|d| rotation_sign(1, 6, d)).collect();
        assert_ne!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn non_power_of_two_dims_are_refused() {
        assert!(check_rotation_dim(63).is_err());
        assert!(check_rotation_dim(96).is_err());
        assert!(check_rotation_dim(512).is_err());
        assert!(check_rotation_dim(64).is_ok());
    }
}

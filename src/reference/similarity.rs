//! `cross_layer_similarity`: how alike two layers' tensors are.

use crate::config::TensorShape;
use crate::error::Result;

/// MSE over all elements and mean cosine over all vectors (all axes but the last).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Similarity {
    /// Mean of `(a - b)^2`.
    pub mse: f64,
    /// Mean over vectors of `a·b / max(|a||b|, 1e-8)`.
    pub cosine: f64,
}

/// The reference's `cross_layer_similarity(a, b)`, accumulated in f64.
pub fn cross_layer_similarity(a: &[f32], b: &[f32], shape: &TensorShape) -> Result<Similarity> {
    shape.check_len(a.len(), "a")?;
    shape.check_len(b.len(), "b")?;
    let d = shape.dim();
    let (mut sq, mut cos) = (0f64, 0f64);
    for (va, vb) in a.chunks_exact(d).zip(b.chunks_exact(d)) {
        let (mut dot, mut na, mut nb) = (0f64, 0f64, 0f64);
        for (&x, &y) in va.iter().zip(vb) {
            let (x, y) = (x as f64, y as f64);
            sq += (x - y) * (x - y);
            dot += x * y;
            na += x * x;
            nb += y * y;
        }
        cos += dot / (na.sqrt() * nb.sqrt()).max(1e-8);
    }
    let vectors = (a.len() / d) as f64;
    Ok(Similarity {
        mse: sq / a.len() as f64,
        cosine: cos / vectors,
    })
}

/// Mean of `weights[r·D + d] · (a − b)²` over every element (`r`: the row, the leading axes
/// flattened): the twin of the GPU's weighted similarity.
pub fn weighted_mse(a: &[f32], b: &[f32], shape: &TensorShape, weights: &[f32]) -> Result<f64> {
    shape.check_len(a.len(), "a")?;
    shape.check_len(b.len(), "b")?;
    let (d, per_row) = (shape.dim(), shape.tokens() * shape.dim());
    if weights.len() != shape.rows() * d {
        return crate::error::shape_err!(
            "{} weights for {} rows of {d} channels",
            weights.len(),
            shape.rows()
        );
    }
    let sq: f64 = a
        .iter()
        .zip(b)
        .enumerate()
        .map(|(i, (&x, &y))| {
            let w = weights[i / per_row * d + i % d] as f64;
            w * (x as f64 - y as f64).powi(2)
        })
        .sum();
    Ok(sq / a.len() as f64)
}

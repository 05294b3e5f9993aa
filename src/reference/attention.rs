//! Grouped-query attention over dense K/V: the CPU twin of the split-K attention kernels
//! (`wgsl/attention.wgsl`), accumulated in f64.

use crate::error::{shape_err, Result};

/// Geometry of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences.
    pub batch: usize,
    /// Query heads (a multiple of `kv_heads`; head `h` reads KV head `h / (q_heads / kv_heads)`).
    pub q_heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Query tokens per head (T).
    pub q_tokens: usize,
    /// Cached tokens (N).
    pub kv_tokens: usize,
    /// Channels per head (D).
    pub dim: usize,
}

/// Softmax attention of `q` (`[B, q_heads, T, D]`) over `k`, `v` (`[B, kv_heads, N, D]`):
/// query token `t` sits at position `pos0 + t` and sees the cached tokens at positions
/// `<= pos0 + t`. Returns `[B, q_heads, T, D]`.
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: AttentionShape,
    pos0: usize,
    scale: f32,
) -> Result<Vec<f32>> {
    attention_windowed(q, k, v, s, pos0, scale, None)
}

/// [`attention`] of a sliding-window layer: with `window = Some(w)` query position `p` sees
/// the cached positions `p'` with `0 <= p − p' < w` only.
pub fn attention_windowed(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: AttentionShape,
    pos0: usize,
    scale: f32,
    window: Option<usize>,
) -> Result<Vec<f32>> {
    let AttentionShape {
        batch,
        q_heads,
        kv_heads,
        q_tokens,
        kv_tokens,
        dim,
    } = s;
    if kv_heads == 0 || q_heads % kv_heads != 0 {
        return shape_err!("{q_heads} query heads do not share {kv_heads} KV heads evenly");
    }
    if q.len() != batch * q_heads * q_tokens * dim
        || k.len() != batch * kv_heads * kv_tokens * dim
        || v.len() != k.len()
    {
        return shape_err!("attention inputs do not match {s:?}");
    }
    let gqa = q_heads / kv_heads;
    let mut out = vec![0.0f32; q.len()];
    for b in 0..batch {
        for h in 0..q_heads {
            let kv = (b * kv_heads + h / gqa) * kv_tokens * dim;
            for t in 0..q_tokens {
                let qo = ((b * q_heads + h) * q_tokens + t) * dim;
                let seen = (pos0 + t + 1).min(kv_tokens);
                let first = window.map_or(0, |w| (pos0 + t + 1).saturating_sub(w).min(seen));
                let scores: Vec<f64> = (first..seen)
                    .map(|j| {
                        let ko = kv + j * dim;
                        (0..dim)
                            .map(|d| q[qo + d] as f64 * k[ko + d] as f64)
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let m = scores.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                let p: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let l: f64 = p.iter().sum();
                for d in 0..dim {
                    let acc: f64 = p
                        .iter()
                        .zip(first..)
                        .map(|(&pj, j)| pj * v[kv + j * dim + d] as f64)
                        .sum();
                    out[qo + d] = if l > 0.0 { (acc / l) as f32 } else { 0.0 };
                }
            }
        }
    }
    Ok(out)
}

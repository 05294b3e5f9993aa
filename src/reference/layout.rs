//! Tensor layouts a runtime may hold its K/V and queries in.

use crate::error::{shape_err, Result};

/// `x` as `[batch, tokens, heads, dim]` (token-major) rearranged into `[batch, heads, tokens,
/// dim]` (heads-major): the CPU twin of `tokens_to_heads` (`wgsl/transpose.wgsl`).
pub fn tokens_to_heads<T: Copy>(
    x: &[T],
    batch: usize,
    tokens: usize,
    heads: usize,
    dim: usize,
) -> Result<Vec<T>> {
    if x.len() != batch * tokens * heads * dim {
        return shape_err!(
            "{} values are not [batch {batch}, tokens {tokens}, heads {heads}, dim {dim}]",
            x.len()
        );
    }
    let mut out = Vec::with_capacity(x.len());
    for b in 0..batch {
        for h in 0..heads {
            for t in 0..tokens {
                let at = ((b * tokens + t) * heads + h) * dim;
                out.extend_from_slice(&x[at..at + dim]);
            }
        }
    }
    Ok(out)
}

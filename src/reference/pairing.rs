//! Layer roles: which layers store codes (anchors) and which borrow them (reuse layers).

use crate::error::{config_err, Result};

/// The role of a layer in its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Stores its own codes and publishes them to its group.
    Anchor,
    /// Borrows the anchor's codes; stores its own params (+ residual).
    Reuse,
}

impl Role {
    /// `"anchor"` or `"reuse"`.
    pub fn name(self) -> &'static str {
        match self {
            Role::Anchor => "anchor",
            Role::Reuse => "reuse",
        }
    }
}

/// Role and group of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayerRole {
    /// Anchor or reuse.
    pub role: Role,
    /// Group id `layer / group_size`.
    pub group: usize,
}

/// `pair_layers(n, g)`: layer `i` is in group `i / g`, an anchor when `i % g == 0`.
/// A trailing partial group still starts with an anchor. `g = 1` means no sharing.
pub fn pair_layers(n_layers: usize, group_size: usize) -> Result<Vec<LayerRole>> {
    if group_size == 0 {
        return config_err!("group_size (layers per group) must be >= 1, got 0");
    }
    Ok((0..n_layers)
        .map(|i| LayerRole {
            role: if i % group_size == 0 {
                Role::Anchor
            } else {
                Role::Reuse
            },
            group: i / group_size,
        })
        .collect())
}

/// The anchor layer of `layer`'s group.
pub fn anchor_of(layer: usize, group_size: usize) -> usize {
    layer - layer % group_size.max(1)
}

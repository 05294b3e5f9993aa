// Included by `build.rs` as well (its source digest), so only items, no inner attributes.

/// A 128-bit digest of `bytes` (two FNV-1a hashes, one over the bytes and one over them
/// with their offset mixed in), as hex: what names a model file in an evaluation's baseline
/// key ([`BaselineKey`](crate::model::eval::BaselineKey)), and what `build.rs` makes of the
/// sources. Not cryptographic; a baseline's key also holds the tokens, which are compared in
/// full.
pub fn content_digest(bytes: &[u8]) -> String {
    let (mut a, mut b) = (0xcbf2_9ce4_8422_2325u64, 0x6c62_272e_07bb_0142u64);
    for (i, &x) in bytes.iter().enumerate() {
        a = (a ^ x as u64).wrapping_mul(0x0000_0100_0000_01b3);
        b = (b ^ (x as u64 ^ (i as u64).rotate_left(17))).wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{a:016x}{b:016x}")
}

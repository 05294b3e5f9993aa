//! Mutations.

#![allow(unused_imports)]

use super::*;

/// One to a few random mutations of `input`, sometimes spliced with another corpus entry;
/// the result is at most `max_len` bytes.
pub fn mutate(rng: &mut Rng, input: &[u8], corpus: &[Vec<u8>], max_len: usize) -> Vec<u8> {
    let mut x = input.to_vec();
    let rounds = 1 + rng.below(4);
    for _ in 0..rounds {
        mutate_once(rng, &mut x, corpus);
    }
    x.truncate(max_len);
    x
}

pub(crate) fn mutate_once(rng: &mut Rng, x: &mut Vec<u8>, corpus: &[Vec<u8>]) {
    let n = x.len();
    match rng.below(14) {
        // Bit flip.
        0 if n > 0 => {
            let i = rng.below(n);
            x[i] ^= 1 << rng.below(8);
        }
        // A byte set to an interesting value.
        1 if n > 0 => {
            let i = rng.below(n);
            x[i] = *rng.pick(&[0u8, 1, 0x7f, 0x80, 0xff, b'0', b'9', b'"', b'{', b'[', b' ']);
        }
        // A random byte.
        2 if n > 0 => {
            let i = rng.below(n);
            x[i] = rng.next() as u8;
        }
        // A little-endian u32 / u64 extreme written over the bytes at a random offset (length
        // and count fields); the offset prefers multiples of 4.
        3 | 4 if n > 0 => {
            let v = *rng.pick(&INTERESTING);
            let w = if rng.one_in(2) { 4 } else { 8 };
            let mut i = rng.below(n);
            if rng.one_in(2) {
                i &= !3;
            }
            for (k, b) in v.to_le_bytes()[..w].iter().enumerate() {
                if let Some(slot) = x.get_mut(i + k) {
                    *slot = *b;
                }
            }
        }
        // A plausible length: the bytes after the offset (or the whole input) divided by a
        // small item size, as a little-endian u64, u32 or decimal. Trusting such a count
        // allocates many times the input without failing at once.
        12 if n > 0 => {
            // Headers, where the counts are, come first: aligned offsets early in the input
            // half of the time.
            let i = if rng.one_in(2) {
                rng.below(n.min(64)) & !3
            } else {
                rng.below(n)
            };
            let base = if rng.one_in(2) { n - i } else { n };
            let v = (base / *rng.pick(&[1usize, 1, 2, 3, 4, 8, 12, 13, 32])) as u64;
            let v = v.saturating_sub(rng.below(3) as u64);
            match rng.below(3) {
                0 => {
                    for (k, b) in v.to_le_bytes().iter().enumerate() {
                        if let Some(slot) = x.get_mut(i + k) {
                            *slot = *b;
                        }
                    }
                }
                1 => {
                    for (k, b) in (v as u32).to_le_bytes().iter().enumerate() {
                        if let Some(slot) = x.get_mut(i + k) {
                            *slot = *b;
                        }
                    }
                }
                _ => {
                    x.splice(i..i, v.to_string().into_bytes());
                }
            }
        }
        // Add or subtract a small amount from a u32 / u64 at an aligned offset.
        5 if n >= 8 => {
            let i = rng.below(n - 7) & !3;
            let v = u64::from_le_bytes(x[i..i + 8].try_into().unwrap_or([0; 8]));
            let d = 1 + rng.below(16) as u64;
            let v = if rng.one_in(2) {
                v.wrapping_add(d)
            } else {
                v.wrapping_sub(d)
            };
            x[i..i + 8].copy_from_slice(&v.to_le_bytes());
        }
        // Insert random bytes.
        6 => {
            let i = rng.below(n + 1);
            let k = 1 + rng.below(16);
            let bytes: Vec<u8> = (0..k).map(|_| rng.next() as u8).collect();
            x.splice(i..i, bytes);
        }
        // Delete a range.
        7 if n > 0 => {
            let i = rng.below(n);
            let k = 1 + rng.below((n - i).min(64));
            x.drain(i..i + k);
        }
        // Duplicate a range.
        8 if n > 0 => {
            let i = rng.below(n);
            let k = 1 + rng.below((n - i).min(64));
            let copy = x[i..i + k].to_vec();
            let at = rng.below(n + 1);
            x.splice(at..at, copy);
        }
        // Truncate.
        9 if n > 0 => x.truncate(rng.below(n)),
        // Splice with another input: our head, its tail.
        10 if !corpus.is_empty() => {
            let other = rng.pick(corpus);
            let cut = rng.below(n + 1);
            let from = rng.below(other.len() + 1);
            x.truncate(cut);
            x.extend_from_slice(&other[from..]);
        }
        // Insert a decimal number (text formats).
        11 => {
            let i = rng.below(n + 1);
            let s = match rng.below(3) {
                0 => rng.number().to_string(),
                1 => format!("-{}", rng.number()),
                _ => format!("{}e{}", rng.below(10), rng.below(400)),
            };
            x.splice(i..i, s.into_bytes());
        }
        // Insert a token of the formats.
        _ => {
            let i = rng.below(n + 1);
            let tok = *rng.pick(&TOKENS);
            x.splice(i..i, tok.iter().copied());
        }
    }
}

pub(crate) const TOKENS: [&[u8]; 16] = [
    b"GGUF",
    b"\"past_key_values.0.key\"",
    b"\"past_key_values.1.value\"",
    b"\"dtype\"",
    b"\"shape\"",
    b"\"data_offsets\"",
    b"\"layers\"",
    b"\"codes\"",
    b"<|im_start|>",
    b"<|im_end|>",
    b"'s",
    b"   ",
    "é".as_bytes(),
    "中文".as_bytes(),
    "٣".as_bytes(),
    b"\xf0\x9f\x98",
];

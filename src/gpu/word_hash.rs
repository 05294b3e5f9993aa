//! A fast hash for the maps a launch looks things up in (kernels by key, bind groups by what
//! they bind, arenas by thread): FxHash's mixing over whole words. The keys are the
//! library's own (entry names, constants, buffer identities and ranges): no adversary, and
//! SipHash cost more than the lookups it serves (on the web, a visible share of a recorded
//! call's time).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` hashed with [`WordHasher`].
pub(crate) type WordHashMap<K, V> = HashMap<K, V, BuildHasherDefault<WordHasher>>;

/// FxHash's mixing, a word at a time.
#[derive(Default)]
pub(crate) struct WordHasher(u64);

impl Hasher for WordHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    fn write_u32(&mut self, word: u32) {
        self.write_u64(u64::from(word));
    }

    fn write_usize(&mut self, word: usize) {
        self.write_u64(word as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{BuildHasher, Hash};

    fn hash<T: Hash>(x: &T) -> u64 {
        BuildHasherDefault::<WordHasher>::default().hash_one(x)
    }

    #[test]
    fn different_keys_hash_apart_and_equal_keys_alike() {
        assert_eq!(hash(&("attend", 3u32)), hash(&("attend", 3u32)));
        assert_ne!(hash(&("attend", 3u32)), hash(&("attend", 4u32)));
        assert_ne!(hash(&"attend_ring"), hash(&"attend_rinf"));
        // Bytes past a whole word count too.
        assert_ne!(hash(&"abcdefgh1"), hash(&"abcdefgh2"));
    }
}

//! Byte-level BPE (GPT-2 style, `tokenizer.ggml.model = gpt2`) with llama.cpp's `smollm`
//! pre-tokenizer: merges by rank over a byte-to-character mapping.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::error::{Result, XqError};

/// GPT-2's reversible map from bytes to printable characters.
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).unwrap_or('?')
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap_or('?')
        };
    }
    table
}

/// Splits `text` like llama.cpp's `smollm` pre-tokenizer: every number code point alone,
/// then the GPT-2 pattern
/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+` on the rest.
/// (`\p{L}` is approximated by `char::is_alphabetic`.)
pub fn pre_tokenize(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, c) in text.char_indices() {
        if c.is_numeric() {
            if start < i {
                gpt2_split(&text[start..i], &mut out);
            }
            out.push(&text[i..i + c.len_utf8()]);
            start = i + c.len_utf8();
        }
    }
    if start < text.len() {
        gpt2_split(&text[start..], &mut out);
    }
    out
}

#[derive(Clone, Copy, PartialEq)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

fn class(c: char) -> Class {
    if c.is_whitespace() {
        Class::Space
    } else if c.is_numeric() {
        Class::Number
    } else if c.is_alphabetic() {
        Class::Letter
    } else {
        Class::Other
    }
}

fn gpt2_split<'a>(text: &'a str, out: &mut Vec<&'a str>) {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let at = |k: usize| chars.get(k).map(|&(_, c)| c);
    let byte = |k: usize| chars.get(k).map_or(text.len(), |&(i, _)| i);
    let mut k = 0;
    while k < chars.len() {
        let c = chars[k].1;
        // Contractions.
        if c == '\'' {
            let rest = &text[byte(k + 1)..];
            if let Some(n) = ["s", "t", "re", "ve", "m", "ll", "d"]
                .iter()
                .find(|s| rest.starts_with(**s))
                .map(|s| s.len())
            {
                let end = byte(k + 1) + n;
                out.push(&text[byte(k)..end]);
                k += 1 + n;
                continue;
            }
        }
        // ` ?X+` for letters, numbers, other.
        let (lead, body) = match (c, at(k + 1)) {
            (' ', Some(n)) if class(n) != Class::Space => (1, class(n)),
            _ => (0, class(c)),
        };
        if body != Class::Space {
            let mut e = k + lead;
            while at(e).is_some_and(|x| class(x) == body) {
                e += 1;
            }
            out.push(&text[byte(k)..byte(e)]);
            k = e;
            continue;
        }
        // `\s+(?!\S)` then `\s+`.
        let mut e = k;
        while at(e).is_some_and(|x| class(x) == Class::Space) {
            e += 1;
        }
        if e < chars.len() && e - k > 1 {
            e -= 1;
        }
        out.push(&text[byte(k)..byte(e)]);
        k = e;
    }
}

/// The byte-level BPE of a vocabulary: token ids by symbol text, merge ranks, the byte map.
#[derive(Clone, Debug)]
pub(super) struct ByteBpe {
    ids: HashMap<String, u32>,
    ranks: HashMap<(String, String), usize>,
    byte_char: [char; 256],
    char_byte: HashMap<char, u8>,
}

impl ByteBpe {
    /// From the vocabulary and its merges (`"a b"`).
    pub(super) fn new(tokens: &[String], merges: &[String]) -> Result<ByteBpe> {
        let ids: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let mut ranks = HashMap::with_capacity(merges.len());
        for (r, m) in merges.iter().enumerate() {
            let (a, b) = m
                .split_once(' ')
                .ok_or_else(|| XqError::Format(format!("merge `{m}` is not `a b`")))?;
            ranks.insert((a.to_string(), b.to_string()), r);
        }
        let byte_char = byte_chars();
        let char_byte = byte_char
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        Ok(ByteBpe {
            ids,
            ranks,
            byte_char,
            char_byte,
        })
    }

    /// Token ids of plain text (no control tokens): pre-tokenized, then merged piece by piece.
    pub(super) fn encode(&self, text: &str, out: &mut Vec<u32>) {
        for piece in pre_tokenize(text) {
            self.bpe(piece, out);
        }
    }

    /// The bytes of a (non-control) token's text.
    pub(super) fn token_bytes(&self, text: &str, bytes: &mut Vec<u8>) {
        bytes.extend(
            text.chars()
                .map(|c| self.char_byte.get(&c).copied().unwrap_or(b'?')),
        );
    }

    fn bpe(&self, piece: &str, out: &mut Vec<u32>) {
        let mapped: String = piece.bytes().map(|b| self.byte_char[b as usize]).collect();
        if let Some(&id) = self.ids.get(&mapped) {
            out.push(id);
            return;
        }
        // Symbols are byte ranges of `mapped`, linked left to right; merging moves the right
        // symbol into the left one. The lowest-ranked adjacent pair merges first, the leftmost
        // among equals; a heap of candidate pairs keeps this O(n log n) in the piece's length
        // (a rescan of every pair after each merge is quadratic, seconds for a few KB).
        // Positions are u32 to keep the working memory small (16 bytes a heap entry).
        if u32::try_from(mapped.len()).is_err() {
            // Over 4 GiB in one piece: byte by byte, unmerged.
            out.extend(
                mapped
                    .chars()
                    .filter_map(|c| self.ids.get(c.encode_utf8(&mut [0; 4]) as &str).copied()),
            );
            return;
        }
        const NONE: u32 = u32::MAX;
        let mut sym: Vec<(u32, u32)> = mapped
            .char_indices()
            .map(|(i, c)| (i as u32, (i + c.len_utf8()) as u32))
            .collect();
        let n = sym.len();
        let mut prev: Vec<u32> = (0..n as u32)
            .map(|i| i.checked_sub(1).unwrap_or(NONE))
            .collect();
        let mut next: Vec<u32> = (1..=n as u32)
            .map(|i| if i < n as u32 { i } else { NONE })
            .collect();
        let mut key = (String::new(), String::new());
        let mut rank = |a: (u32, u32), b: (u32, u32)| {
            key.0.clear();
            key.0.push_str(&mapped[a.0 as usize..a.1 as usize]);
            key.1.clear();
            key.1.push_str(&mapped[b.0 as usize..b.1 as usize]);
            // Ranks past u32 (billions of merges) tie; no vocabulary comes near.
            self.ranks
                .get(&key)
                .map(|&r| u32::try_from(r).unwrap_or(u32::MAX))
        };
        // (rank, left symbol, left's end, right's end): stale once either symbol changed. A
        // merge pops one entry and pushes at most two, so 2n entries always suffice.
        let mut heap = BinaryHeap::with_capacity(2 * n);
        for i in 1..n {
            if let Some(r) = rank(sym[i - 1], sym[i]) {
                heap.push(Reverse((r, i as u32 - 1, sym[i - 1].1, sym[i].1)));
            }
        }
        while let Some(Reverse((_, i, mid, end))) = heap.pop() {
            let j = next[i as usize];
            if j == NONE || sym[i as usize].1 != mid || sym[j as usize].1 != end {
                continue;
            }
            sym[i as usize].1 = end;
            sym[j as usize] = (NONE, NONE);
            let k = next[j as usize];
            next[i as usize] = k;
            if k != NONE {
                prev[k as usize] = i;
                if let Some(r) = rank(sym[i as usize], sym[k as usize]) {
                    heap.push(Reverse((r, i, end, sym[k as usize].1)));
                }
            }
            let p = prev[i as usize];
            if p != NONE {
                if let Some(r) = rank(sym[p as usize], sym[i as usize]) {
                    heap.push(Reverse((r, p, sym[p as usize].1, end)));
                }
            }
        }
        let mut i = if n > 0 { 0 } else { NONE };
        while i != NONE {
            let (a, b) = sym[i as usize];
            let p = &mapped[a as usize..b as usize];
            match self.ids.get(p) {
                Some(&id) => out.push(id),
                // A byte-level vocabulary normally holds every byte symbol; fall back byte by
                // byte, dropping bytes the vocabulary lacks (SmolLM2 has no token for a few
                // control bytes, e.g. 0x04).
                None => out.extend(
                    p.chars()
                        .filter_map(|c| self.ids.get(c.encode_utf8(&mut [0; 4]) as &str).copied()),
                ),
            }
            i = next[i as usize];
        }
    }
}

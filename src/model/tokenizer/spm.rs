//! SentencePiece BPE (`tokenizer.ggml.model = llama`), as Google's `sentencepiece` encodes
//! with byte fallback, no dummy prefix and no normalization: spaces become `▁`; user-defined
//! pieces are matched first (longest at each position) and never merged further; then the
//! adjacent pair whose joined text is the highest-scoring piece merges first (the leftmost
//! among equal scores); a piece that is unused splits back into what it merged from, and a
//! symbol outside the vocabulary becomes its UTF-8 bytes (`<0xXX>` tokens).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::token_type;

/// The SentencePiece model of a vocabulary.
#[derive(Clone, Debug)]
pub(super) struct SentencePiece {
    /// Pieces that take part in merges and lookups (normal, user-defined, unused), by text.
    pieces: HashMap<String, u32>,
    scores: Vec<f32>,
    types: Vec<u64>,
    /// User-defined pieces by their first character, longest first.
    user_defined: HashMap<char, Vec<String>>,
    /// The `<0xXX>` token of every byte, where the vocabulary has one.
    byte_ids: [Option<u32>; 256],
}

/// A symbol of the text being encoded: its byte range and its neighbours in the list. A
/// merge grows the left symbol over the right one, which dies.
#[derive(Clone, Copy)]
struct Symbol {
    start: u32,
    end: u32,
    prev: u32,
    next: u32,
    alive: bool,
    frozen: bool,
}

const NONE: u32 = u32::MAX;

/// The byte of a byte-fallback piece, `<0xXX>`.
fn byte_piece(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

/// An f32 as a u32 that orders like the float (for the merge agenda).
fn score_key(s: f32) -> u32 {
    let b = s.to_bits();
    if b >> 31 == 1 {
        !b
    } else {
        b | 1 << 31
    }
}

impl SentencePiece {
    /// From the vocabulary, its scores and token types (missing types are normal).
    pub(super) fn new(tokens: &[String], scores: &[f32], types: &[u64]) -> SentencePiece {
        let ty = |i: usize| types.get(i).copied().unwrap_or(token_type::NORMAL);
        let mut pieces = HashMap::with_capacity(tokens.len());
        let mut user_defined: HashMap<char, Vec<String>> = HashMap::new();
        let mut byte_ids = [None; 256];
        for (i, t) in tokens.iter().enumerate() {
            match ty(i) {
                token_type::NORMAL | token_type::UNUSED => {
                    pieces.entry(t.clone()).or_insert(i as u32);
                }
                token_type::USER_DEFINED => {
                    pieces.entry(t.clone()).or_insert(i as u32);
                    if let Some(c) = t.chars().next() {
                        user_defined.entry(c).or_default().push(t.clone());
                    }
                }
                token_type::BYTE => {
                    if let Some(b) = byte_piece(t) {
                        byte_ids[b as usize] = Some(i as u32);
                    }
                }
                _ => {}
            }
        }
        for list in user_defined.values_mut() {
            list.sort_by_key(|s| Reverse(s.len()));
        }
        SentencePiece {
            pieces,
            scores: scores.to_vec(),
            types: (0..tokens.len()).map(ty).collect(),
            user_defined,
            byte_ids,
        }
    }

    /// Token ids of plain text (no control tokens).
    pub(super) fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let norm = text.replace(' ', "\u{2581}");
        if u32::try_from(norm.len()).is_err() {
            // Over 4 GiB in one call: byte tokens, unmerged.
            out.extend(norm.bytes().filter_map(|b| self.byte_ids[b as usize]));
            return;
        }
        // The initial symbols: a user-defined piece where one starts, else one character.
        let mut sym: Vec<Symbol> = Vec::with_capacity(norm.chars().count());
        let mut at = 0;
        while at < norm.len() {
            let rest = &norm[at..];
            let c = rest.chars().next().unwrap_or('\0');
            let user = self
                .user_defined
                .get(&c)
                .and_then(|list| list.iter().find(|u| rest.starts_with(u.as_str())));
            let len = user.map_or(c.len_utf8(), String::len);
            let i = sym.len() as u32;
            sym.push(Symbol {
                start: at as u32,
                end: (at + len) as u32,
                prev: i.checked_sub(1).unwrap_or(NONE),
                next: if at + len < norm.len() { i + 1 } else { NONE },
                alive: true,
                frozen: user.is_some(),
            });
            at += len;
        }
        // The agenda: (score, leftmost first, left symbol, right symbol, the right symbol's
        // end): an entry is stale once either symbol died or the right one grew. A merge
        // pops one entry and pushes at most two, so 2n entries always suffice.
        let n = sym.len();
        let mut agenda = BinaryHeap::with_capacity(2 * n);
        let candidate = |sym: &[Symbol], l: u32, r: u32| {
            if l == NONE || r == NONE {
                return None;
            }
            let (a, b) = (sym[l as usize], sym[r as usize]);
            if a.frozen || b.frozen {
                return None;
            }
            let id = *self.pieces.get(&norm[a.start as usize..b.end as usize])?;
            Some((
                score_key(self.scores[id as usize]),
                Reverse(a.start),
                l,
                r,
                b.end,
            ))
        };
        for i in 1..n as u32 {
            agenda.extend(candidate(&sym, i - 1, i));
        }
        // Where a merge made an unused piece: (start, end) → where its parts meet.
        let mut unused_parts: HashMap<(u32, u32), u32> = HashMap::new();
        while let Some((_, _, l, r, end)) = agenda.pop() {
            let (a, b) = (sym[l as usize], sym[r as usize]);
            if !a.alive || !b.alive || a.next != r || b.end != end {
                continue;
            }
            if let Some(&id) = self.pieces.get(&norm[a.start as usize..b.end as usize]) {
                if self.types[id as usize] == token_type::UNUSED {
                    unused_parts.insert((a.start, b.end), b.start);
                }
            }
            sym[l as usize].end = b.end;
            sym[l as usize].next = b.next;
            sym[r as usize].alive = false;
            if b.next != NONE {
                sym[b.next as usize].prev = l;
            }
            agenda.extend(candidate(&sym, a.prev, l));
            agenda.extend(candidate(&sym, l, b.next));
        }
        let mut i = if n > 0 { 0 } else { NONE };
        while i != NONE {
            let s = sym[i as usize];
            self.emit(&norm, s.start, s.end, &unused_parts, out);
            i = s.next;
        }
    }

    /// The ids of a final symbol `[start, end)`: its piece, what an unused piece merged from,
    /// or its bytes.
    fn emit(
        &self,
        norm: &str,
        start: u32,
        end: u32,
        unused_parts: &HashMap<(u32, u32), u32>,
        out: &mut Vec<u32>,
    ) {
        let text = &norm[start as usize..end as usize];
        match self.pieces.get(text) {
            Some(&id) if self.types[id as usize] != token_type::UNUSED => out.push(id),
            Some(&id) => match unused_parts.get(&(start, end)) {
                Some(&mid) => {
                    self.emit(norm, start, mid, unused_parts, out);
                    self.emit(norm, mid, end, unused_parts, out);
                }
                None => out.push(id),
            },
            None => out.extend(text.bytes().filter_map(|b| self.byte_ids[b as usize])),
        }
    }

    /// The bytes of a (non-control) token: a byte token's byte, or its text with `▁` as a
    /// space.
    pub(super) fn token_bytes(&self, id: u32, text: &str, bytes: &mut Vec<u8>) {
        if self.types.get(id as usize) == Some(&token_type::BYTE) {
            if let Some(b) = byte_piece(text) {
                bytes.push(b);
                return;
            }
        }
        bytes.extend(text.replace('\u{2581}', " ").bytes());
    }
}

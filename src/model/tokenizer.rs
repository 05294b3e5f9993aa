//! Byte-level BPE (GPT-2 style) from GGUF metadata, with llama.cpp's `smollm`
//! pre-tokenizer, control tokens, and the ChatML chat template SmolLM2 ships.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::error::{Result, XqError};
use crate::model::gguf::{Gguf, Meta};

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

/// A byte-level BPE tokenizer.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    tokens: Vec<String>,
    ids: HashMap<String, u32>,
    ranks: HashMap<(String, String), usize>,
    /// Control tokens (`<|im_start|>`, ...) matched in text before pre-tokenizing.
    special: Vec<(String, u32)>,
    byte_char: [char; 256],
    char_byte: HashMap<char, u8>,
    /// Beginning of sequence.
    pub bos: u32,
    /// End of sequence (and of a chat turn).
    pub eos: u32,
    chat_system: Option<String>,
}

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata (model `gpt2`).
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer> {
        let model = g.get("tokenizer.ggml.model")?.as_str().unwrap_or("");
        if model != "gpt2" {
            return Err(XqError::Format(format!(
                "tokenizer model `{model}` is not supported (gpt2 byte-level BPE is)"
            )));
        }
        let strings = |key: &str| -> Result<Vec<String>> {
            g.get(key)?
                .as_array()
                .ok_or_else(|| XqError::Format(format!("{key} is not an array")))?
                .iter()
                .map(|m| {
                    m.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| XqError::Format(format!("{key} holds a non-string")))
                })
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types: Vec<u64> = g
            .get("tokenizer.ggml.token_type")
            .ok()
            .and_then(Meta::as_array)
            .map(|a| a.iter().map(|m| m.as_u64().unwrap_or(1)).collect())
            .unwrap_or_default();
        let template = g
            .get("tokenizer.chat_template")
            .ok()
            .and_then(Meta::as_str)
            .map(str::to_string);
        let id = |key: &str| -> Result<u32> {
            let v = g.get_u64(key)?;
            u32::try_from(v).map_err(|_| XqError::Format(format!("{key} {v} is not a token id")))
        };
        Tokenizer::new(
            tokens,
            &merges,
            &types,
            id("tokenizer.ggml.bos_token_id")?,
            id("tokenizer.ggml.eos_token_id")?,
            template.as_deref(),
        )
    }

    /// A tokenizer from its vocabulary, merges (`"a b"`), token types (3 = control) and ids.
    pub fn new(
        tokens: Vec<String>,
        merges: &[String],
        types: &[u64],
        bos: u32,
        eos: u32,
        template: Option<&str>,
    ) -> Result<Tokenizer> {
        if types.len() > tokens.len() {
            return Err(XqError::Format(format!(
                "{} token types for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
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
        let mut special: Vec<(String, u32)> = types
            .iter()
            .enumerate()
            .filter(|(_, &t)| t == 3)
            .map(|(i, _)| (tokens[i].clone(), i as u32))
            .filter(|(t, _)| !t.is_empty())
            .collect();
        // Longest first, so a special token never matches a prefix of a longer one.
        special.sort_by_key(|(t, _)| Reverse(t.len()));
        let byte_char = byte_chars();
        let char_byte = byte_char
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        // The ChatML template's default system prompt.
        let chat_system = template.filter(|t| t.contains("<|im_start|>")).map(|t| {
            t.split("<|im_start|>system\n")
                .nth(1)
                .and_then(|s| s.split("<|im_end|>").next())
                .unwrap_or("")
                .to_string()
        });
        for (name, id) in [("bos", bos), ("eos", eos)] {
            if id as usize >= tokens.len() {
                return Err(XqError::Format(format!(
                    "{name} token id {id} is outside the vocabulary"
                )));
            }
        }
        Ok(Tokenizer {
            tokens,
            ids,
            ranks,
            special,
            byte_char,
            char_byte,
            bos,
            eos,
            chat_system,
        })
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The text of token `id` (raw BPE symbols).
    pub fn token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
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

    /// Token ids of `text`; control tokens written in the text become their ids when
    /// `special` is set.
    pub fn encode(&self, text: &str, special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        // The next occurrence of every control token at or after `at` (recomputed only once
        // passed, so the search stays linear in the text for each control token).
        let mut found: Vec<Option<usize>> = match special {
            true => self
                .special
                .iter()
                .map(|(t, _)| text.find(t.as_str()))
                .collect(),
            false => Vec::new(),
        };
        let mut at = 0;
        while at < text.len() {
            let mut hit: Option<(usize, usize, u32)> = None;
            if special {
                for ((t, id), f) in self.special.iter().zip(found.iter_mut()) {
                    if f.is_some_and(|p| p < at) {
                        *f = text[at..].find(t.as_str()).map(|p| p + at);
                    }
                    if let Some(p) = *f {
                        // Longest first in `special`: a later token wins only if it starts
                        // earlier.
                        if hit.is_none_or(|(q, _, _)| p < q) {
                            hit = Some((p, t.len(), *id));
                        }
                    }
                }
            }
            let (plain_end, next) = match hit {
                Some((p, len, id)) => (p, Some((id, p + len))),
                None => (text.len(), None),
            };
            for piece in pre_tokenize(&text[at..plain_end]) {
                self.bpe(piece, &mut out);
            }
            match next {
                Some((id, end)) => {
                    out.push(id);
                    at = end;
                }
                None => break,
            }
        }
        out
    }

    /// The bytes of tokens, joined (control tokens as their text).
    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        let mut bytes = Vec::new();
        for &id in ids {
            let Some(t) = self.token(id) else { continue };
            if self.special.iter().any(|(_, s)| *s == id) {
                bytes.extend_from_slice(t.as_bytes());
            } else {
                bytes.extend(
                    t.chars()
                        .map(|c| self.char_byte.get(&c).copied().unwrap_or(b'?')),
                );
            }
        }
        bytes
    }

    /// Text of tokens (invalid UTF-8 replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids)).into_owned()
    }

    /// The model's chat template applied to one user message, ready for the assistant's
    /// reply (ChatML: system prompt from the template, then the user turn).
    pub fn chat_prompt(&self, user: &str) -> Result<String> {
        self.chat(&[("user", user)], true)
    }

    /// The model's chat template (ChatML) over `messages` (`(role, content)`; role `system`,
    /// `user` or `assistant`). Without a system message first, the template's own system
    /// prompt opens the chat. With `add_generation_prompt` the text ends where the
    /// assistant's reply begins.
    pub fn chat(&self, messages: &[(&str, &str)], add_generation_prompt: bool) -> Result<String> {
        let system = self
            .chat_system
            .as_ref()
            .ok_or_else(|| XqError::Config("this model has no ChatML chat template".into()))?;
        let mut s = String::new();
        if messages.first().is_none_or(|(role, _)| *role != "system") && !system.is_empty() {
            s += &format!("<|im_start|>system\n{system}<|im_end|>\n");
        }
        for (i, (role, content)) in messages.iter().enumerate() {
            if !matches!(*role, "system" | "user" | "assistant") {
                return Err(XqError::Config(format!(
                    "messages[{i}].role must be system, user or assistant, got `{role}`"
                )));
            }
            s += &format!("<|im_start|>{role}\n{content}<|im_end|>\n");
        }
        if add_generation_prompt {
            s += "<|im_start|>assistant\n";
        }
        Ok(s)
    }
}

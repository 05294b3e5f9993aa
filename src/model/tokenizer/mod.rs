//! Tokenizers from GGUF metadata, one per algorithm, chosen by `tokenizer.ggml.model`:
//! byte-level BPE (`gpt2`: SmolLM2) and SentencePiece (`llama`: Gemma). What they share lives
//! here: the vocabulary, control tokens (parsed from text only when asked), BOS/EOS and
//! whether a prompt starts with BOS, and the ChatML chat template SmolLM2 ships.

mod bpe;
mod spm;

use std::collections::HashMap;

use crate::error::{Result, XqError};
use crate::model::gguf::{Gguf, Meta};

pub use bpe::pre_tokenize;

/// GGUF token types (`tokenizer.ggml.token_type`), as SentencePiece numbers them.
pub(crate) mod token_type {
    pub const NORMAL: u64 = 1;
    pub const CONTROL: u64 = 3;
    pub const USER_DEFINED: u64 = 4;
    pub const UNUSED: u64 = 5;
    pub const BYTE: u64 = 6;
}

#[derive(Clone, Debug)]
enum Algorithm {
    ByteBpe(Box<bpe::ByteBpe>),
    SentencePiece(Box<spm::SentencePiece>),
}

/// A tokenizer: byte-level BPE or SentencePiece, with control tokens and BOS/EOS.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    tokens: Vec<String>,
    algorithm: Algorithm,
    /// Control tokens (`<|im_start|>`, `<start_of_turn>`, ...) matched in text before the
    /// algorithm runs, when `encode` is asked to: by length, longest first (Gemma has 6,249).
    special: Vec<(usize, HashMap<String, u32>)>,
    /// The first bytes control tokens start with.
    special_first: [bool; 256],
    /// Whether each id is a control token (decoded as its text).
    control: Vec<bool>,
    /// Beginning of sequence.
    pub bos: u32,
    /// End of sequence (and of a chat turn).
    pub eos: u32,
    /// Whether a prompt starts with BOS (`tokenizer.ggml.add_bos_token`; by default true for
    /// SentencePiece, false for byte-level BPE, as llama.cpp does).
    pub add_bos: bool,
    chat_system: Option<String>,
}

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata (model `gpt2` or `llama`).
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer> {
        let model = g.get("tokenizer.ggml.model")?.as_str().unwrap_or("");
        if model != "gpt2" && model != "llama" {
            return Err(XqError::Format(format!(
                "tokenizer model `{model}` is not supported (gpt2 byte-level BPE and llama \
                 SentencePiece are)"
            )));
        }
        let array = |key: &str| -> Result<&[Meta]> {
            g.get(key)?
                .as_array()
                .ok_or_else(|| XqError::Format(format!("{key} is not an array")))
        };
        let strings = |key: &str| -> Result<Vec<String>> {
            array(key)?
                .iter()
                .map(|m| {
                    m.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| XqError::Format(format!("{key} holds a non-string")))
                })
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let types: Vec<u64> = g
            .get("tokenizer.ggml.token_type")
            .ok()
            .and_then(Meta::as_array)
            .map(|a| {
                a.iter()
                    .map(|m| m.as_u64().unwrap_or(token_type::NORMAL))
                    .collect()
            })
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
        let add_bos = match g.get("tokenizer.ggml.add_bos_token") {
            Ok(Meta::Bool(b)) => *b,
            Ok(other) => {
                return Err(XqError::Format(format!(
                    "tokenizer.ggml.add_bos_token {other:?} is not a bool"
                )))
            }
            Err(_) => model == "llama",
        };
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let eos = id("tokenizer.ggml.eos_token_id")?;
        if model == "gpt2" {
            let merges = strings("tokenizer.ggml.merges")?;
            let mut t = Tokenizer::new(tokens, &merges, &types, bos, eos, template.as_deref())?;
            t.add_bos = add_bos;
            return Ok(t);
        }
        let scores: Vec<f32> = array("tokenizer.ggml.scores")?
            .iter()
            .map(|m| {
                m.as_f64().map(|v| v as f32).ok_or_else(|| {
                    XqError::Format("tokenizer.ggml.scores holds a non-number".into())
                })
            })
            .collect::<Result<_>>()?;
        Tokenizer::sentencepiece(tokens, &scores, &types, bos, eos, add_bos)
    }

    /// A byte-level BPE tokenizer from its vocabulary, merges (`"a b"`), token types
    /// (3 = control) and ids; no BOS on prompts.
    pub fn new(
        tokens: Vec<String>,
        merges: &[String],
        types: &[u64],
        bos: u32,
        eos: u32,
        template: Option<&str>,
    ) -> Result<Tokenizer> {
        let algorithm = Algorithm::ByteBpe(Box::new(bpe::ByteBpe::new(&tokens, merges)?));
        Tokenizer::assemble(tokens, algorithm, types, bos, eos, false, template)
    }

    /// A SentencePiece tokenizer from its vocabulary, scores, token types and ids.
    pub fn sentencepiece(
        tokens: Vec<String>,
        scores: &[f32],
        types: &[u64],
        bos: u32,
        eos: u32,
        add_bos: bool,
    ) -> Result<Tokenizer> {
        if scores.len() != tokens.len() {
            return Err(XqError::Format(format!(
                "{} scores for {} tokens",
                scores.len(),
                tokens.len()
            )));
        }
        // (`assemble` checks the types.)
        let spm = spm::SentencePiece::new(&tokens, scores, types);
        let algorithm = Algorithm::SentencePiece(Box::new(spm));
        Tokenizer::assemble(tokens, algorithm, types, bos, eos, add_bos, None)
    }

    fn assemble(
        tokens: Vec<String>,
        algorithm: Algorithm,
        types: &[u64],
        bos: u32,
        eos: u32,
        add_bos: bool,
        template: Option<&str>,
    ) -> Result<Tokenizer> {
        if types.len() > tokens.len() {
            return Err(XqError::Format(format!(
                "{} token types for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        for (name, id) in [("bos", bos), ("eos", eos)] {
            if id as usize >= tokens.len() {
                return Err(XqError::Format(format!(
                    "{name} token id {id} is outside the vocabulary"
                )));
            }
        }
        let mut by_len: HashMap<usize, HashMap<String, u32>> = HashMap::new();
        let mut special_first = [false; 256];
        let mut control = vec![false; tokens.len()];
        for (i, _) in types
            .iter()
            .enumerate()
            .filter(|(_, &t)| t == token_type::CONTROL)
        {
            control[i] = true;
            let t = &tokens[i];
            if let Some(&b) = t.as_bytes().first() {
                special_first[b as usize] = true;
                by_len
                    .entry(t.len())
                    .or_default()
                    .insert(t.clone(), i as u32);
            }
        }
        let mut special: Vec<(usize, HashMap<String, u32>)> = by_len.into_iter().collect();
        // Longest first, so a control token never matches a prefix of a longer one.
        special.sort_by_key(|(len, _)| std::cmp::Reverse(*len));
        // The ChatML template's default system prompt.
        let chat_system = template.filter(|t| t.contains("<|im_start|>")).map(|t| {
            t.split("<|im_start|>system\n")
                .nth(1)
                .and_then(|s| s.split("<|im_end|>").next())
                .unwrap_or("")
                .to_string()
        });
        Ok(Tokenizer {
            tokens,
            algorithm,
            special,
            special_first,
            control,
            bos,
            eos,
            add_bos,
            chat_system,
        })
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The text of token `id` (raw symbols: GPT-2 bytes-as-characters, or SentencePiece's `▁`).
    pub fn token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// Token ids of `text`, without BOS; control tokens written in the text become their ids
    /// when `special` is set (otherwise they are plain text).
    pub fn encode(&self, text: &str, special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        let plain = |t: &str, out: &mut Vec<u32>| match &self.algorithm {
            Algorithm::ByteBpe(b) => b.encode(t, out),
            Algorithm::SentencePiece(s) => s.encode(t, out),
        };
        if !special {
            plain(text, &mut out);
            return out;
        }
        // One scan: at each byte a control token can start with, the longest control token
        // there (a token's first byte starts a character, so `at` is a char boundary).
        let bytes = text.as_bytes();
        let (mut start, mut at) = (0, 0);
        while at < bytes.len() {
            if self.special_first[bytes[at] as usize] {
                let rest = &text[at..];
                let hit = self.special.iter().find_map(|(len, map)| {
                    let piece = rest.get(..*len)?;
                    map.get(piece).map(|&id| (*len, id))
                });
                if let Some((len, id)) = hit {
                    plain(&text[start..at], &mut out);
                    out.push(id);
                    at += len;
                    start = at;
                    continue;
                }
            }
            at += 1;
        }
        plain(&text[start..], &mut out);
        out
    }

    /// The ids a prompt starts a model with: BOS first when the model wants it
    /// (`add_bos`), then `encode(text, special)`.
    pub fn encode_prompt(&self, text: &str, special: bool) -> Vec<u32> {
        let mut ids = if self.add_bos { vec![self.bos] } else { vec![] };
        ids.extend(self.encode(text, special));
        ids
    }

    /// The bytes of tokens, joined (control tokens as their text; ids outside the
    /// vocabulary skipped).
    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        let mut bytes = Vec::new();
        for &id in ids {
            let Some(t) = self.token(id) else { continue };
            if self.control[id as usize] {
                bytes.extend_from_slice(t.as_bytes());
                continue;
            }
            match &self.algorithm {
                Algorithm::ByteBpe(b) => b.token_bytes(t, &mut bytes),
                Algorithm::SentencePiece(s) => s.token_bytes(id, t, &mut bytes),
            }
        }
        bytes
    }

    /// Text of tokens (invalid UTF-8 replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids)).into_owned()
    }

    /// Whether the GGUF carries a chat template this tokenizer applies (ChatML): base models
    /// such as Gemma 3 270M do not.
    pub fn has_chat_template(&self) -> bool {
        self.chat_system.is_some()
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

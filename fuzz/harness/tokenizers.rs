//! Tokenizers.

#![allow(unused_imports)]

use super::*;

/// GPT-2's byte-to-character map (as the tokenizer uses it).
pub fn byte_chars() -> Vec<char> {
    let mut extra = 0u32;
    (0..256u32)
        .map(|b| {
            let printable =
                (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
            if printable {
                char::from_u32(b).unwrap_or('?')
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap_or('?')
            }
        })
        .collect()
}

/// The vocabulary, merges and token types of a small byte-level BPE tokenizer: every byte,
/// a few merges (some of whose results are missing from the vocabulary), control tokens.
pub fn small_vocab() -> (Vec<String>, Vec<String>, Vec<u64>) {
    let chars = byte_chars();
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let sym = |s: &str| -> String { s.bytes().map(|b| chars[b as usize]).collect() };
    let pairs: [(&str, &str); 14] = [
        (" ", "t"),
        ("h", "e"),
        (" t", "he"),
        ("a", "a"),
        ("aa", "aa"),
        ("aaaa", "aaaa"),
        ("i", "n"),
        ("in", "g"),
        ("e", "r"),
        (" ", " "),
        ("\n", "\n"),
        ("\u{e9}", "\u{e9}"),
        ("x", "y"), // its result is not in the vocabulary
        ("'", "s"),
    ];
    let mut merges = Vec::new();
    for (a, b) in pairs {
        merges.push(format!("{} {}", sym(a), sym(b)));
        if (a, b) != ("x", "y") {
            tokens.push(format!("{}{}", sym(a), sym(b)));
        }
    }
    let mut types = vec![1u64; tokens.len()];
    for special in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im"] {
        tokens.push(special.to_string());
        types.push(3);
    }
    (tokens, merges, types)
}

/// The small tokenizer, built once.
pub fn small_tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let (tokens, merges, types) = small_vocab();
        let eos = tokens.len() as u32 - 4;
        Tokenizer::new(tokens, &merges, &types, eos, eos, None).expect("the small tokenizer")
    })
}

/// A small SentencePiece tokenizer: control tokens, every byte as a `<0xXX>` token, a few
/// pieces with scores (merge chains, `▁` pieces, an unused piece, a piece whose parts are not
/// pieces), and user-defined pieces (whitespace runs, a tag).
pub fn small_spm() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let mut tokens: Vec<String> = ["<pad>", "<eos>", "<bos>", "<start_of_turn>"]
            .iter()
            .map(|t| t.to_string())
            .collect();
        let mut types = vec![3u64; tokens.len()];
        tokens.extend((0..256).map(|b| format!("<0x{b:02X}>")));
        types.extend(std::iter::repeat_n(6, 256));
        let pieces: [(&str, u64); 16] = [
            ("\u{2581}", 1),
            ("t", 1),
            ("h", 1),
            ("e", 1),
            ("th", 1),
            ("the", 1),
            ("\u{2581}the", 1),
            ("a", 1),
            ("aa", 1),
            ("aaaa", 5), // unused: split back into what it merged from
            ("\u{e9}", 1),
            ("\u{2581}\u{e9}", 1),
            ("xyz", 1), // no `xy` or `yz` piece leads to it
            ("\n\n", 4),
            ("  ", 4),
            ("<b>", 4),
        ];
        for (p, t) in pieces {
            tokens.push(p.to_string());
            types.push(t);
        }
        let scores: Vec<f32> = (0..tokens.len()).map(|i| -(i as f32) * 0.5).collect();
        Tokenizer::sentencepiece(tokens, &scores, &types, 2, 1, true)
            .expect("the small SentencePiece")
    })
}

/// Gemma 3's SentencePiece tokenizer when its model file is present (`XQ_GEMMA`, or the
/// default cache path); `None` otherwise.
pub fn gemma_tokenizer() -> Option<&'static Tokenizer> {
    static TOK: OnceLock<Option<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = std::env::var_os("XQ_GEMMA")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/root/.cache/xquant-wgpu/gemma-3-270m-q4_k_m.gguf"));
        let bytes = std::fs::read(path).ok()?;
        Tokenizer::from_gguf(&Gguf::parse(&bytes).ok()?).ok()
    })
    .as_ref()
}

/// A tokenizer and the bytes no token of its vocabulary holds (encode drops them).
pub struct RealTokenizer {
    /// The tokenizer.
    pub tok: Tokenizer,
    /// `absent[b]`: no token contains byte `b`'s symbol.
    pub absent: [bool; 256],
}

/// SmolLM2's tokenizer when its model file is present (`XQ_MODEL`, or the default cache
/// path); `None` otherwise.
pub fn real_tokenizer() -> Option<&'static RealTokenizer> {
    static TOK: OnceLock<Option<RealTokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = std::env::var_os("XQ_MODEL")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from("/root/.cache/xquant-wgpu/SmolLM2-135M-Instruct.Q4_1.gguf")
            });
        let bytes = std::fs::read(path).ok()?;
        let g = Gguf::parse(&bytes).ok()?;
        let tok = Tokenizer::from_gguf(&g).ok()?;
        let mut seen = std::collections::HashSet::new();
        for t in g.get("tokenizer.ggml.tokens").ok()?.as_array()? {
            seen.extend(t.as_str()?.chars());
        }
        let chars = byte_chars();
        let absent = std::array::from_fn(|b| !seen.contains(&chars[b]));
        Some(RealTokenizer { tok, absent })
    })
    .as_ref()
}

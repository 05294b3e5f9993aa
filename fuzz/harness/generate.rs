//! Generators.

#![allow(unused_imports)]

use super::*;

pub(crate) fn gen_text(rng: &mut Rng) -> Vec<u8> {
    const PIECES: [&str; 24] = [
        "a",
        "aaaaaaaa",
        "the",
        " the",
        "ing",
        " ",
        "  ",
        "\n",
        "\t",
        "'s",
        "'ll",
        "'",
        "1",
        "٣",
        "é",
        "中",
        "😀",
        "<|im_start|>",
        "<|im_end|>",
        "<|im",
        "<|endoftext|>",
        "xy",
        "\u{a0}",
        "\u{200b}",
    ];
    let mut s = String::new();
    let n = 1 + rng.below(64);
    for _ in 0..n {
        let p = rng.pick(&PIECES);
        let k = if rng.one_in(8) { 1 + rng.below(200) } else { 1 };
        for _ in 0..k {
            s.push_str(p);
        }
    }
    let mut bytes = s.into_bytes();
    if rng.one_in(4) && !bytes.is_empty() {
        // Invalid UTF-8 somewhere.
        let i = rng.below(bytes.len());
        bytes.insert(i, *rng.pick(&[0x80u8, 0xc3, 0xe4, 0xf0, 0xff]));
    }
    bytes
}

pub(crate) const GGUF_KEYS: [&str; 16] = [
    "general.architecture",
    "general.alignment",
    "llama.block_count",
    "llama.embedding_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.feed_forward_length",
    "llama.context_length",
    "llama.rope.freq_base",
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.chat_template",
];

pub(crate) struct Gw(Vec<u8>);

impl Gw {
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
    }
    fn str_array(&mut self, items: &[String]) {
        self.u32(8);
        self.u64(items.len() as u64);
        for s in items {
            self.str(s);
        }
    }
}

/// A random scalar or array metadata value of type `ty` (writing its payload only).
pub(crate) fn gguf_value(rng: &mut Rng, w: &mut Gw, ty: u32, depth: usize) {
    match ty {
        0 | 1 | 7 => w.0.push(rng.number() as u8),
        2 | 3 => w.0.extend_from_slice(&(rng.number() as u16).to_le_bytes()),
        4 | 5 => w.u32(rng.number() as u32),
        6 => {
            w.0.extend_from_slice(&(rng.number() as f32 / 3.0).to_le_bytes())
        }
        8 => {
            let s = match rng.below(4) {
                0 => "llama".to_string(),
                1 => "gpt2".to_string(),
                2 => "<|im_start|>system\nYou are helpful.<|im_end|>".to_string(),
                _ => (0..rng.below(12))
                    .map(|_| (b'a' + rng.below(26) as u8) as char)
                    .collect(),
            };
            if rng.one_in(12) {
                w.u64(rng.number()); // a lying length
            } else {
                w.str(&s);
            }
        }
        9 => {
            let elem = if depth > 4 || rng.one_in(3) {
                *rng.pick(&[0u32, 4, 8, 10, 6, 7])
            } else {
                rng.below(14) as u32
            };
            w.u32(elem);
            let n = rng.below(8);
            if rng.one_in(6) {
                w.u64(rng.number()); // a lying count
            } else {
                w.u64(n as u64);
            }
            for _ in 0..n {
                gguf_value(rng, w, elem, depth + 1);
            }
        }
        10..=12 => w.u64(rng.number()),
        _ => {}
    }
}

pub(crate) fn gen_gguf(rng: &mut Rng) -> Vec<u8> {
    let mut w = Gw(Vec::new());
    w.0.extend_from_slice(if rng.one_in(50) { b"GGUG" } else { b"GGUF" });
    w.u32(if rng.one_in(20) {
        rng.number() as u32
    } else {
        2 + rng.below(2) as u32
    });
    let model_like = rng.one_in(2);
    let n_tensors = rng.below(4);
    // Metadata entries: (key, writer).
    let mut entries: Vec<Vec<u8>> = Vec::new();
    if model_like {
        let (mut tokens, merges, mut types) = small_vocab();
        let vocab = if rng.one_in(3) {
            rng.below(300)
        } else {
            tokens.len()
        };
        tokens.truncate(vocab);
        if rng.one_in(3) {
            types.truncate(rng.below(types.len() + 1));
        } else if rng.one_in(3) {
            types.extend(std::iter::repeat_n(3, rng.below(8))); // more types than tokens
        }
        let hidden = *rng.pick(&[0u64, 8, 64, 96, 1 << 40]);
        let heads = *rng.pick(&[0u64, 1, 2, 3, 4]);
        let mut e = Gw(Vec::new());
        e.str("general.architecture");
        e.u32(8);
        e.str(if rng.one_in(8) { "gpt2" } else { "llama" });
        entries.push(e.0);
        for (key, v) in [
            ("llama.block_count", rng.number()),
            ("llama.embedding_length", hidden),
            ("llama.attention.head_count", heads),
            (
                "llama.attention.head_count_kv",
                *rng.pick(&[1u64, 2, 0, heads]),
            ),
            ("llama.feed_forward_length", rng.number()),
            ("tokenizer.ggml.bos_token_id", rng.below(vocab + 2) as u64),
            (
                "tokenizer.ggml.eos_token_id",
                *rng.pick(&[1u64, 0x1_0000_0001, vocab as u64]),
            ),
        ] {
            if rng.one_in(10) {
                continue;
            }
            let mut e = Gw(Vec::new());
            e.str(key);
            e.u32(*rng.pick(&[4u32, 10, 5, 11]));
            match e.0[e.0.len() - 4] {
                4 | 5 => e.u32(v as u32),
                _ => e.u64(v),
            }
            entries.push(e.0);
        }
        let mut e = Gw(Vec::new());
        e.str("tokenizer.ggml.model");
        e.u32(8);
        e.str("gpt2");
        entries.push(e.0);
        let mut e = Gw(Vec::new());
        e.str("tokenizer.ggml.tokens");
        e.u32(9);
        e.str_array(&tokens);
        entries.push(e.0);
        let mut e = Gw(Vec::new());
        e.str("tokenizer.ggml.merges");
        e.u32(9);
        let mut merges = merges;
        if rng.one_in(6) {
            merges.push("nospace".into());
        }
        e.str_array(&merges);
        entries.push(e.0);
        let mut e = Gw(Vec::new());
        e.str("tokenizer.ggml.token_type");
        e.u32(9);
        e.u32(5);
        e.u64(types.len() as u64);
        for t in &types {
            e.u32(*t as u32);
        }
        entries.push(e.0);
    }
    for _ in 0..rng.below(6) {
        let mut e = Gw(Vec::new());
        let key = *rng.pick(&GGUF_KEYS);
        e.str(key);
        let ty = if rng.one_in(16) {
            rng.number() as u32
        } else {
            rng.below(13) as u32
        };
        e.u32(ty);
        gguf_value(rng, &mut e, ty, 0);
        entries.push(e.0);
    }
    w.u64(if rng.one_in(10) {
        rng.number()
    } else {
        n_tensors as u64
    });
    w.u64(if rng.one_in(10) {
        rng.number()
    } else {
        entries.len() as u64
    });
    for e in &entries {
        w.0.extend_from_slice(e);
    }
    let mut offset = 0u64;
    let mut data_len = 0u64;
    for _ in 0..n_tensors {
        let name = *rng.pick(&[
            "token_embd.weight",
            "output_norm.weight",
            "blk.0.attn_q.weight",
            "blk.0.attn_norm.weight",
        ]);
        w.str(name);
        let n_dims = if rng.one_in(10) {
            rng.number() as u32
        } else {
            1 + rng.below(4) as u32
        };
        w.u32(n_dims);
        let mut elems = 1u64;
        for _ in 0..n_dims.min(6) {
            let d = if rng.one_in(6) {
                rng.number()
            } else {
                *rng.pick(&[1u64, 2, 32, 64])
            };
            elems = elems.wrapping_mul(d);
            w.u64(d);
        }
        let ty = *rng.pick(&[0u32, 1, 3, 8, 2, 30]);
        w.u32(ty);
        let bytes = match ty {
            0 => elems.wrapping_mul(4),
            1 => elems.wrapping_mul(2),
            3 => (elems / 32).wrapping_mul(20),
            _ => (elems / 32).wrapping_mul(34),
        };
        w.u64(if rng.one_in(8) { rng.number() } else { offset });
        offset = offset.wrapping_add(bytes.min(1 << 12)).div_ceil(32) * 32;
        data_len = offset;
    }
    // Pad to the default alignment, then data.
    while w.0.len() % 32 != 0 {
        w.0.push(0);
    }
    let extra = if rng.one_in(4) {
        rng.below(64) as u64
    } else {
        0
    };
    let data = data_len.min(1 << 13) + extra;
    let data = data.saturating_sub(if rng.one_in(4) {
        rng.below(64) as u64
    } else {
        0
    });
    for _ in 0..data {
        w.0.push(rng.next() as u8);
    }
    w.0
}

pub(crate) fn gen_safetensors(rng: &mut Rng) -> Vec<u8> {
    let layers = rng.below(4);
    let dtype = *rng.pick(&["F16", "BF16", "F32"]);
    let size = if dtype == "F32" { 4 } else { 2 };
    let mut shape: Vec<u64> = (0..4).map(|_| *rng.pick(&[1u64, 2, 3, 4])).collect();
    if rng.one_in(6) {
        let i = rng.below(4);
        shape[i] = rng.number();
    }
    if rng.one_in(8) {
        shape.truncate(rng.below(5));
    }
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    let mut names: Vec<String> = Vec::new();
    for l in 0..layers {
        names.push(format!("past_key_values.{l}.key"));
        names.push(format!("past_key_values.{l}.value"));
    }
    if rng.one_in(6) {
        names.push(
            rng.pick(&["past_key_values.7.key", "past_key_values.x.value", "other"])
                .to_string(),
        );
    }
    if rng.one_in(8) && !names.is_empty() {
        let i = rng.below(names.len());
        names.remove(i);
    }
    for name in names {
        let elems = shape.iter().fold(1u64, |a, &d| a.wrapping_mul(d));
        let len = elems.wrapping_mul(size).min(1 << 12);
        let start = data.len() as u64;
        for _ in 0..len {
            data.push(if rng.one_in(200) {
                0xff
            } else {
                rng.next() as u8 & 0x3f
            });
        }
        let mut offs = json!([start, start + len]);
        if rng.one_in(10) {
            offs = json!([rng.number(), rng.number()]);
        }
        let dt = if rng.one_in(20) { "I8" } else { dtype };
        header.insert(
            name,
            json!({"dtype": dt, "shape": shape, "data_offsets": offs}),
        );
    }
    if rng.one_in(3) {
        header.insert("__metadata__".into(), json!({"format": "pt"}));
    }
    let text = serde_json::to_vec(&Value::Object(header)).unwrap_or_default();
    let mut out = if rng.one_in(12) {
        rng.number().to_le_bytes().to_vec()
    } else {
        (text.len() as u64).to_le_bytes().to_vec()
    };
    out.extend_from_slice(&text);
    out.extend_from_slice(&data);
    out
}

pub(crate) fn random_json(rng: &mut Rng, depth: usize) -> Value {
    match rng.below(if depth > 2 { 6 } else { 8 }) {
        0 => Value::Null,
        1 => json!(rng.one_in(2)),
        2 => json!(rng.number()),
        3 => json!(-(rng.below(100) as i64)),
        4 => json!(rng.number() as f64 / 7.0),
        5 => json!(*rng.pick(&["own", "tokens", "channels", "f16", "f32", "xquant-plan", ""])),
        6 => Value::Array(
            (0..rng.below(4))
                .map(|_| random_json(rng, depth + 1))
                .collect(),
        ),
        _ => {
            let mut m = serde_json::Map::new();
            for _ in 0..rng.below(3) {
                m.insert(
                    rng.pick(&["codes", "bits", "key", "value", "window", "x"])
                        .to_string(),
                    random_json(rng, depth + 1),
                );
            }
            Value::Object(m)
        }
    }
}

/// Replaces a random value inside `v` (or removes a field) with probability per node.
pub(crate) fn perturb(rng: &mut Rng, v: &mut Value) {
    match v {
        Value::Object(m) => {
            let keys: Vec<String> = m.keys().cloned().collect();
            for k in keys {
                if rng.one_in(12) {
                    m.remove(&k);
                } else if rng.one_in(10) {
                    m.insert(k, random_json(rng, 0));
                } else if let Some(x) = m.get_mut(&k) {
                    perturb(rng, x);
                }
            }
            if rng.one_in(20) {
                m.insert("unknown".into(), json!(1));
            }
        }
        Value::Array(a) => {
            for x in a.iter_mut() {
                if rng.one_in(12) {
                    *x = random_json(rng, 0);
                } else {
                    perturb(rng, x);
                }
            }
        }
        _ => {}
    }
}

pub(crate) fn gen_plan(rng: &mut Rng) -> Vec<u8> {
    let name = *rng.pick(&xquant_wgpu::cache::PRESETS);
    let layers = 1 + rng.below(6);
    let mut v = match CachePlan::preset(name, layers) {
        Ok(p) => p.to_json(),
        Err(_) => json!({}),
    };
    if rng.one_in(2) {
        perturb(rng, &mut v);
    }
    let mut text = v.to_string();
    if rng.one_in(3) {
        text = serde_json::to_string_pretty(&v).unwrap_or(text);
    }
    text.into_bytes()
}

/// A saved f16 cache set (container version 1 or 2): fields mostly consistent (model,
/// windows, rings of the size their tokens need), one in a few out of range; sealed (length
/// and checksum right) most of the time, so that the body's checks run.
pub(crate) fn gen_saved_cache(rng: &mut Rng) -> Vec<u8> {
    let odd = |rng: &mut Rng, v: usize| -> u64 {
        match rng.one_in(16) {
            true => rng.number(),
            false => v as u64,
        }
    };
    let mut w = Gw(CACHE_MAGIC.to_vec());
    let version = if rng.one_in(4) { 1 } else { 2 };
    w.u32(version);
    // Now and then an XQuant header over an f16 body.
    w.u32(if rng.one_in(8) { 1 } else { 2 });
    w.u64(0);
    let (layers, kv_heads, head_dim) = (1 + rng.below(3), 1 + rng.below(2), 1 + rng.below(9));
    for v in [layers, kv_heads, head_dim, 1] {
        let x = odd(rng, v);
        w.u64(x);
    }
    let max_ctx = 1 + rng.below(24);
    let x = odd(rng, max_ctx);
    w.u64(x);
    w.0.push(if rng.one_in(10) {
        2
    } else {
        rng.below(2) as u8
    });
    let windows: Vec<usize> = (0..layers)
        .map(|_| match rng.one_in(2) || version == 1 {
            true => 0,
            false => 1 + rng.below(8),
        })
        .collect();
    if version == 2 {
        for &a in &windows {
            let x = odd(rng, a);
            w.u64(x);
        }
    }
    let stride = head_dim.div_ceil(2) * 2;
    for &a in &windows {
        let len = rng.below(max_ctx + 1);
        let held_from = if a == 0 { 0 } else { len.saturating_sub(a) };
        let x = odd(rng, len);
        w.u64(x);
        if version == 2 {
            let x = odd(rng, held_from);
            w.u64(x);
        }
        let capacity = if a == 0 { len } else { len - held_from };
        for _ in 0..2 {
            let x = odd(rng, capacity);
            w.u64(x);
            if capacity == 0 && !rng.one_in(8) {
                w.0.push(0);
                continue;
            }
            w.0.push(1);
            let bytes = kv_heads * capacity * stride * 2;
            let x = odd(rng, bytes);
            w.u64(x);
            w.0.extend((0..bytes).map(|_| rng.below(256) as u8));
        }
    }
    w.u64(0);
    let mut b = w.0;
    if rng.one_in(10) {
        let cut = rng.below(b.len());
        b.truncate(cut);
    }
    match rng.one_in(6) {
        true => b,
        false => reseal(&b).unwrap_or(b),
    }
}

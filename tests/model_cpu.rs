//! The real model without a GPU: GGUF parsing (and its errors), the tokenizer against an
//! independent implementation, and the CPU reference forward.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use serde_json::Value;
use xquant_wgpu::model::cpu::{CpuKv, CpuModel};
use xquant_wgpu::model::gguf::Meta;
use xquant_wgpu::model::{GgmlType, Gguf, ModelConfig, Tokenizer};

/// A GGUF v3 file: metadata `(key, type id, encoded value)`, tensors `(name, dims, type id)`
/// each followed by `data_bytes` zero bytes.
fn gguf_bytes(meta: &[(&str, u32, Vec<u8>)], tensors: &[(&str, Vec<u64>, u32, usize)]) -> Vec<u8> {
    let s = |v: &str| {
        [
            (v.len() as u64).to_le_bytes().to_vec(),
            v.as_bytes().to_vec(),
        ]
        .concat()
    };
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    for (k, ty, v) in meta {
        b.extend(s(k));
        b.extend(ty.to_le_bytes());
        b.extend(v);
    }
    let mut offset = 0u64;
    for (name, dims, ty, bytes) in tensors {
        b.extend(s(name));
        b.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (*bytes as u64).div_ceil(32) * 32;
    }
    while b.len() % 32 != 0 {
        b.push(0);
    }
    for (_, _, _, bytes) in tensors {
        b.extend(vec![0u8; bytes.div_ceil(32) * 32]);
    }
    b
}

fn string(v: &str) -> Vec<u8> {
    [
        (v.len() as u64).to_le_bytes().to_vec(),
        v.as_bytes().to_vec(),
    ]
    .concat()
}

#[test]
fn gguf_reader_reads_and_refuses() {
    let meta = vec![
        ("general.architecture", 8, string("llama")),
        ("llama.block_count", 4, 2u32.to_le_bytes().to_vec()),
        ("llama.rope.freq_base", 6, 10000f32.to_le_bytes().to_vec()),
    ];
    let ok = gguf_bytes(
        &meta,
        &[
            ("a", vec![64, 2], 0, 512),
            ("b", vec![32, 3], 3, 60),
            ("c", vec![32], 8, 34),
        ],
    );
    let g = Gguf::parse(&ok).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.get_u64("llama.block_count").unwrap(), 2);
    assert_eq!(
        g.get("general.architecture").unwrap(),
        &Meta::Str("llama".into())
    );
    assert_eq!(g.get_f64("llama.rope.freq_base").unwrap(), 10000.0);
    let b = g.tensor("b").unwrap();
    assert_eq!(
        (b.dims.clone(), b.ty, b.bytes),
        (vec![32, 3], GgmlType::Q4_1, 60)
    );
    assert_eq!(g.tensor("c").unwrap().ty, GgmlType::Q8_0);

    let kind = |bytes: &[u8]| Gguf::parse(bytes).unwrap_err().kind();
    assert_eq!(kind(b"GGML\x03\x00\x00\x00"), "FormatError");
    let mut v1 = ok.clone();
    v1[4] = 1;
    assert_eq!(kind(&v1), "FormatError", "version 1");
    assert_eq!(kind(&ok[..ok.len() - 40]), "FormatError", "truncated data");
    assert_eq!(kind(&ok[..100]), "FormatError", "truncated header");
    let q4_0 = gguf_bytes(&meta, &[("q", vec![32], 2, 18)]);
    let e = Gguf::parse(&q4_0).unwrap_err();
    assert!(e.to_string().contains("not supported"), "{e}");
    let ragged = gguf_bytes(&meta, &[("r", vec![33], 8, 34)]);
    assert_eq!(
        kind(&ragged),
        "FormatError",
        "Q8_0 tensor not a whole number of blocks"
    );
    let mut huge = gguf_bytes(&[], &[]);
    huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_eq!(kind(&huge), "FormatError", "absurd tensor count");

    let gpt = gguf_bytes(&[("general.architecture", 8, string("gpt2"))], &[]);
    let e = ModelConfig::from_gguf(&Gguf::parse(&gpt).unwrap()).unwrap_err();
    assert!(
        e.to_string()
            .contains("architecture `gpt2` is not supported"),
        "{e}"
    );
}

#[test]
fn real_model_metadata() {
    let bytes = model_or_skip!();
    let g = Gguf::parse(&bytes).unwrap();
    let c = ModelConfig::from_gguf(&g).unwrap();
    assert_eq!(
        (c.layers, c.hidden, c.heads, c.kv_heads, c.head_dim, c.ffn, c.vocab),
        (30, 576, 9, 3, 64, 1536, 49152)
    );
    assert_eq!(c.rope_theta, 100000.0);
    assert_eq!(g.tensor("token_embd.weight").unwrap().ty, GgmlType::Q8_0);
    assert_eq!(g.tensor("blk.0.attn_q.weight").unwrap().ty, GgmlType::Q4_1);
    assert_eq!(
        g.tensor("blk.29.ffn_norm.weight").unwrap().ty,
        GgmlType::F32
    );
}

#[test]
fn tokenizer_matches_huggingface_and_round_trips() {
    let bytes = model_or_skip!();
    let tok = Tokenizer::from_gguf(&Gguf::parse(&bytes).unwrap()).unwrap();
    let fixture: Value = serde_json::from_str(include_str!("data/tokenizer_hf_ids.json")).unwrap();
    for case in fixture["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tok.encode(text, false), want, "ids of {text:?}");
        assert_eq!(tok.decode(&want), text, "round trip of {text:?}");
    }
    // Control tokens: parsed in chat prompts, plain text otherwise.
    let chat = tok.chat_prompt("Hi").unwrap();
    assert!(chat.starts_with("<|im_start|>system\n") && chat.ends_with("<|im_start|>assistant\n"));
    let ids = tok.encode(&chat, true);
    assert_eq!(
        ids.iter().filter(|&&i| i == 1).count(),
        3,
        "three <|im_start|>"
    );
    assert_eq!(tok.decode(&ids), chat);
    assert!(!tok.encode("<|im_start|>", false).contains(&1));
}

#[test]
fn cpu_reference_says_paris() {
    let bytes = model_or_skip!();
    let g = Gguf::parse(&bytes).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let ids = tok.encode("The capital of France is", false);
    let m = CpuModel::load(&g, &bytes).unwrap();
    let logits = m.forward(&ids, &mut CpuKv::default());
    let last = &logits[(ids.len() - 1) * m.cfg.vocab..];
    let best = last
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0;
    assert_eq!(tok.decode(&[best as u32]), " Paris");
}

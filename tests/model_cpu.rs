//! The real model without a GPU: GGUF parsing (and its errors), the tokenizer against an
//! independent implementation, and the CPU reference forward.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use serde_json::Value;
use xquant_wgpu::model::cpu::{CpuKv, CpuModel};
use xquant_wgpu::model::gguf::{dequantize, Meta};
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
    let q3_k = gguf_bytes(&meta, &[("q", vec![256], 11, 110)]);
    let e = Gguf::parse(&q3_k).unwrap_err();
    assert!(
        e.to_string().contains("type 11 (Q3_K) is not supported"),
        "{e}"
    );
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

/// Hand-built blocks of every quantized type: integer codes and scales chosen here, packed
/// as ggml lays them out (written from the format, not from the reader), and read back.
#[test]
fn quantized_blocks_dequantize_by_their_formulas() {
    let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
    let (d, m) = (0.25f32, -1.5f32);
    // Q4_0 / Q4_1 / Q5_0 / Q5_1: 32 codes q[j]; byte j holds q[j] (low) and q[j + 16].
    for (id, bits, with_min) in [(2u32, 4, false), (3, 4, true), (6, 5, false), (7, 5, true)] {
        let q: Vec<u32> = (0..32).map(|j| (j * 7 + 3) % (1 << bits)).collect();
        let mut b = f16(d).to_vec();
        if with_min {
            b.extend(f16(m));
        }
        if bits == 5 {
            let qh = (0..32).fold(0u32, |h, j| h | ((q[j] >> 4) << j));
            b.extend(qh.to_le_bytes());
        }
        b.extend((0..16).map(|j| ((q[j] & 15) | ((q[j + 16] & 15) << 4)) as u8));
        let ty = [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
        ][[2, 3, 6, 7].iter().position(|&i| i == id).unwrap()];
        assert_eq!(b.len(), ty.block().1);
        let want: Vec<f32> = q
            .iter()
            .map(|&q| match with_min {
                true => d * q as f32 + m,
                false => d * (q as f32 - (1 << (bits - 1)) as f32),
            })
            .collect();
        assert_eq!(dequantize(&b, ty), want, "{ty:?}");
    }
    // Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins.
    let sc: Vec<u8> = (0..8).map(|i| [1, 63, 17, 40, 5, 33, 62, 9][i]).collect();
    let mn: Vec<u8> = (0..8).map(|i| [0, 12, 63, 31, 48, 2, 7, 60][i]).collect();
    let mut scales = [0u8; 12];
    for j in 0..4 {
        scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        scales[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        scales[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4);
    }
    let (dk, dmin) = (0.5f32, 0.125f32);
    for five in [false, true] {
        let q: Vec<u32> = (0..256)
            .map(|i| (i * 13 + 5) % if five { 32 } else { 16 })
            .collect();
        let mut b = [f16(dk), f16(dmin)].concat();
        b.extend(scales);
        if five {
            // Byte l, bit s: the fifth bit of weight l of sub-block s.
            b.extend(
                (0..32).map(|l| (0..8).fold(0u8, |h, s| h | (((q[32 * s + l] >> 4) as u8) << s))),
            );
        }
        for run in 0..4 {
            let (lo, hi) = (
                &q[64 * run..64 * run + 32],
                &q[64 * run + 32..64 * run + 64],
            );
            b.extend((0..32).map(|l| ((lo[l] & 15) | ((hi[l] & 15) << 4)) as u8));
        }
        let ty = if five { GgmlType::Q5_K } else { GgmlType::Q4_K };
        assert_eq!(b.len(), ty.block().1);
        let want: Vec<f32> = (0..256)
            .map(|i| dk * sc[i / 32] as f32 * q[i] as f32 - dmin * mn[i / 32] as f32)
            .collect();
        assert_eq!(dequantize(&b, ty), want, "{ty:?}");
    }
    // Q6_K: 16 int8 scales (one per 16 weights), 6-bit codes centred on 32.
    let q: Vec<u32> = (0..256).map(|i| (i * 11 + 7) % 64).collect();
    let s6: Vec<i8> = (0..16).map(|i| (i as i8 - 8) * 9).collect();
    let (mut ql, mut qh) = (vec![0u8; 128], vec![0u8; 64]);
    for (i, &qi) in q.iter().enumerate() {
        // Weight i: half n, quarter k (of 32), lane l.
        let (n, k, l) = (i / 128, (i % 128) / 32, i % 32);
        let byte = 64 * n + l + 32 * (k % 2);
        ql[byte] |= ((qi & 15) as u8) << (4 * (k / 2));
        qh[32 * n + l] |= ((qi >> 4) as u8) << (2 * k);
    }
    let mut b = [ql, qh, s6.iter().map(|&s| s as u8).collect()].concat();
    b.extend(f16(d));
    let want: Vec<f32> = (0..256)
        .map(|i| d * s6[i / 16] as f32 * (q[i] as f32 - 32.0))
        .collect();
    assert_eq!(dequantize(&b, GgmlType::Q6_K), want);
}

/// Random blocks of every type (and rows of the Gemma model, when fetched), dequantized by
/// gguf-py (`scripts/ggml-blocks.py` wrote the fixture), equal ours.
#[test]
fn quantized_blocks_match_gguf_py() {
    let fixture: Value = serde_json::from_str(include_str!("data/ggml-blocks.json")).unwrap();
    let ty = |name: &str| match name {
        "Q4_0" => GgmlType::Q4_0,
        "Q4_1" => GgmlType::Q4_1,
        "Q5_0" => GgmlType::Q5_0,
        "Q5_1" => GgmlType::Q5_1,
        "Q8_0" => GgmlType::Q8_0,
        "Q4_K" => GgmlType::Q4_K,
        "Q5_K" => GgmlType::Q5_K,
        "Q6_K" => GgmlType::Q6_K,
        other => panic!("fixture type {other}"),
    };
    let floats = |v: &Value| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    // gguf-py multiplies in a different order (d·sc·q as d·(sc·q)): 1 ulp-level differences.
    let close = |got: &[f32], want: &[f32], what: &str| {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1e-3),
                "{what}[{i}]: {g} vs {w}"
            );
        }
    };
    let cases = fixture["blocks"].as_array().unwrap();
    assert_eq!(cases.len(), 8);
    for case in cases {
        let name = case["type"].as_str().unwrap();
        let hex = case["hex"].as_str().unwrap();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        close(
            &dequantize(&bytes, ty(name)),
            &floats(&case["values"]),
            name,
        );
    }
    let Some(path) = common::model::gemma_path() else {
        return;
    };
    let bytes = std::fs::read(path).unwrap();
    let g = Gguf::parse(&bytes).unwrap();
    let rows = fixture["model_rows"].as_array().unwrap();
    assert_eq!(
        rows.len(),
        8,
        "two rows of each of the Gemma file's four types"
    );
    for row in rows {
        let info = g.tensor(row["tensor"].as_str().unwrap()).unwrap();
        assert_eq!(info.ty, ty(row["type"].as_str().unwrap()));
        let (cols, r) = (info.dims[0], row["row"].as_u64().unwrap() as usize);
        let (per, size) = info.ty.block();
        let start = info.offset + r * cols / per * size;
        let got = dequantize(&bytes[start..start + cols / per * size], info.ty);
        close(&got, &floats(&row["values"]), &info.name);
    }
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

/// A fixture's token ids.
fn ids_of(v: &Value) -> Vec<u32> {
    let ids = v.as_array().unwrap().iter();
    ids.map(|v| v.as_u64().unwrap() as u32).collect()
}

#[test]
fn tokenizer_matches_huggingface_and_round_trips() {
    let bytes = model_or_skip!();
    let tok = Tokenizer::from_gguf(&Gguf::parse(&bytes).unwrap()).unwrap();
    let fixture: Value = serde_json::from_str(include_str!("data/tokenizer_hf_ids.json")).unwrap();
    for case in fixture["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want = ids_of(&case["ids"]);
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

/// Gemma 3's SentencePiece tokenizer gives `sentencepiece`'s ids (a model proto rebuilt from
/// the GGUF by `scripts/spm-tokenizer-ids.py`) on a varied set, and decodes them back.
#[test]
fn sentencepiece_matches_google_sentencepiece_and_round_trips() {
    let Some(path) = common::model::gemma_path() else {
        return;
    };
    let tok = Tokenizer::from_gguf(&Gguf::parse(&std::fs::read(path).unwrap()).unwrap()).unwrap();
    assert_eq!((tok.bos, tok.eos, tok.add_bos), (2, 1, true));
    let fixture: Value = serde_json::from_str(include_str!("data/tokenizer_spm_ids.json")).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want = ids_of(&case["ids"]);
        assert_eq!(tok.encode(text, false), want, "ids of {text:?}");
        assert_eq!(tok.decode(&want), text, "round trip of {text:?}");
    }
    // llama.cpp's ids (scripts/llama-cpp-reference.py) of the first 560 tokens of a chapter,
    // BOS first.
    let lcpp: Value =
        serde_json::from_str(include_str!("data/gemma3-llama-cpp-moby1.json")).unwrap();
    let want = ids_of(&lcpp["ids"]);
    let text = include_str!("../data/moby-dick-ch1.txt");
    let got = tok.encode_prompt(text, false);
    assert_eq!(
        &got[..want.len()],
        &want[..],
        "llama.cpp's ids of Moby-Dick ch. 1"
    );
    // A prompt starts with BOS; control tokens are text unless asked for.
    assert_eq!(tok.encode_prompt("Hi", false)[0], 2);
    let turn = "<start_of_turn>user\nHi<end_of_turn>";
    let ids = tok.encode(turn, true);
    assert_eq!(tok.token(ids[0]), Some("<start_of_turn>"));
    assert_eq!(tok.decode(&ids), turn);
    assert!(tok.encode(turn, false).len() > ids.len());
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

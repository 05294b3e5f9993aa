//! A minimal GGUF v3 writer, and tiny models of any shape with random weights in it: llama
//! (the `llama.*` hyper-parameters the loader reads, a small byte-level tokenizer, every tensor
//! the forward passes read, in F32, F16, Q8_0 or Q4_1) or gemma3 (its keys and extra norms, a
//! SentencePiece vocabulary, a sliding window, and Gemma's mix of weight types as random
//! blocks: Q5_0, Q8_0, Q4_K, Q6_K).

use xquant_wgpu::model::GgmlType;
use xquant_wgpu::synth::SplitMix;

/// A metadata value (the types the loader reads).
pub enum Value {
    U32(u32),
    F32(f32),
    Str(String),
    Strings(Vec<String>),
    I32s(Vec<i32>),
    F32s(Vec<f32>),
}

impl Value {
    fn encode(&self, out: &mut Vec<u8>) {
        let string = |s: &str, out: &mut Vec<u8>| {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        };
        match self {
            Value::U32(v) => {
                out.extend(4u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Value::F32(v) => {
                out.extend(6u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Value::Str(s) => {
                out.extend(8u32.to_le_bytes());
                string(s, out);
            }
            Value::Strings(v) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|s| string(s, out));
            }
            Value::I32s(v) => {
                out.extend(9u32.to_le_bytes());
                out.extend(5u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|x| out.extend(x.to_le_bytes()));
            }
            Value::F32s(v) => {
                out.extend(9u32.to_le_bytes());
                out.extend(6u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|x| out.extend(x.to_le_bytes()));
            }
        }
    }
}

/// A GGUF v3 file being assembled.
#[derive(Default)]
pub struct GgufWriter {
    meta: Vec<(String, Value)>,
    /// (name, GGUF dims (inner first), type id, data)
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

fn type_id(ty: GgmlType) -> u32 {
    ty.id()
}

/// `values` encoded as `ty` (rows of whole 32-blocks for the quantized types).
pub fn encode(values: &[f32], ty: GgmlType) -> Vec<u8> {
    let h = |v: f32| half::f16::from_f32(v).to_le_bytes();
    match ty {
        GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => values.iter().flat_map(|&v| h(v)).collect(),
        GgmlType::Q8_0 => values
            .chunks_exact(32)
            .flat_map(|b| {
                let amax = b.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                let mut out = h(d).to_vec();
                out.extend(
                    b.iter()
                        .map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8),
                );
                out
            })
            .collect(),
        GgmlType::Q4_1 => values
            .chunks_exact(32)
            .flat_map(|b| {
                let lo = b.iter().fold(f32::INFINITY, |a, &v| a.min(v));
                let hi = b.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                let d = (hi - lo) / 15.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                let q = |v: f32| ((v - lo) * inv).round().clamp(0.0, 15.0) as u8;
                let mut out = h(d).to_vec();
                out.extend(h(lo));
                out.extend((0..16).map(|i| q(b[i]) | (q(b[i + 16]) << 4)));
                out
            })
            .collect(),
        other => unimplemented!("the test writer encodes F32, F16, Q8_0, Q4_1, not {other:?}"),
    }
}

impl GgufWriter {
    pub fn meta(&mut self, key: &str, value: Value) -> &mut Self {
        self.meta.push((key.to_string(), value));
        self
    }

    /// A tensor of GGUF dims `dims` (inner first) holding `values` encoded as `ty`.
    pub fn tensor(&mut self, name: &str, dims: &[usize], values: &[f32], ty: GgmlType) {
        assert_eq!(dims.iter().product::<usize>(), values.len(), "{name}");
        self.blocks(name, dims, ty, encode(values, ty));
    }

    /// A tensor of GGUF dims `dims` whose data is `data`, blocks of `ty` as they are.
    pub fn blocks(&mut self, name: &str, dims: &[usize], ty: GgmlType, data: Vec<u8>) {
        let (per, size) = ty.block();
        assert_eq!(
            dims.iter().product::<usize>() / per * size,
            data.len(),
            "{name}"
        );
        let dims = dims.iter().map(|&d| d as u64).collect();
        self.tensors
            .push((name.to_string(), dims, type_id(ty), data));
    }

    /// The file: header, metadata, tensor table, data aligned to 32 bytes.
    pub fn bytes(&self) -> Vec<u8> {
        let string = |s: &str, out: &mut Vec<u8>| {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        };
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend((self.meta.len() as u64).to_le_bytes());
        for (k, v) in &self.meta {
            string(k, &mut b);
            v.encode(&mut b);
        }
        let mut offset = 0u64;
        for (name, dims, ty, data) in &self.tensors {
            string(name, &mut b);
            b.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
            b.extend(ty.to_le_bytes());
            b.extend(offset.to_le_bytes());
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        b.resize(b.len().next_multiple_of(32), 0);
        for (_, _, _, data) in &self.tensors {
            b.extend(data);
            b.resize(b.len().next_multiple_of(32), 0);
        }
        b
    }
}

/// The shape of a tiny llama model.
#[derive(Clone, Copy, Debug)]
pub struct TinyLlama {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Written as `llama.attention.key_length`/`value_length` when given (else the loader
    /// takes hidden / heads).
    pub head_dim: Option<usize>,
    pub ffn: usize,
    pub vocab: usize,
    /// Type of every matrix (norm gains are F32, as llama.cpp writes them). A gemma3 model
    /// takes Gemma 3 270M's mix instead.
    pub weights: GgmlType,
    pub seed: u64,
    /// `Some(window)`: a gemma3 model whose local layers (all but every sixth) slide over
    /// `window` positions.
    pub sliding_window: Option<usize>,
}

/// `n` weights of type `ty` as random blocks whose values are about `scale` in size: random
/// codes, scales chosen for the type's code range.
pub fn random_blocks(rng: &mut SplitMix, n: usize, ty: GgmlType, scale: f32) -> Vec<u8> {
    let (per, size) = ty.block();
    let h = |v: f32| half::f16::from_f32(v).to_le_bytes();
    let mut out = Vec::with_capacity(n / per * size);
    for _ in 0..n / per {
        let mut b: Vec<u8> = (0..size).map(|_| rng.next_u64() as u8).collect();
        // (byte offset, value) of the f16 scale fields.
        let fields: &[(usize, f32)] = match ty {
            GgmlType::Q5_0 | GgmlType::Q4_0 => &[(0, scale / 12.0)],
            GgmlType::Q8_0 => &[(0, scale / 90.0)],
            // d·sc·q − dmin·m with 6-bit sc, m and 4-bit q: about 30·7·d − 30·dmin.
            GgmlType::Q4_K => &[(0, scale / 120.0), (2, scale / 30.0)],
            // The same with 5-bit q: about 30·15·d − 30·dmin.
            GgmlType::Q5_K => &[(0, scale / 240.0), (2, scale / 30.0)],
            // d·q + m with 5-bit q.
            GgmlType::Q5_1 => &[(0, scale / 16.0), (2, -scale)],
            // d·sc·(q − 32) with int8 sc: about 70·20·d.
            GgmlType::Q6_K => &[(208, scale / 1400.0)],
            other => unimplemented!("random blocks of {other:?}"),
        };
        for &(at, v) in fields {
            b[at..at + 2].copy_from_slice(&h(v));
        }
        out.extend(b);
    }
    out
}

impl TinyLlama {
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden / self.heads)
    }

    /// The metadata of the model (hyper-parameters and tokenizer), no tensors.
    pub fn metadata(&self) -> GgufWriter {
        let mut w = GgufWriter::default();
        let u = |v: usize| Value::U32(v as u32);
        let arch = match self.sliding_window {
            Some(_) => "gemma3",
            None => "llama",
        };
        let k = |key: &str| format!("{arch}.{key}");
        w.meta("general.architecture", Value::Str(arch.into()))
            .meta(&k("block_count"), u(self.layers))
            .meta(&k("embedding_length"), u(self.hidden))
            .meta(&k("feed_forward_length"), u(self.ffn))
            .meta(&k("attention.head_count"), u(self.heads))
            .meta(&k("attention.head_count_kv"), u(self.kv_heads))
            .meta(&k("context_length"), u(512))
            .meta(&k("attention.layer_norm_rms_epsilon"), Value::F32(1e-5));
        if let Some(d) = self.head_dim {
            w.meta(&k("attention.key_length"), u(d))
                .meta(&k("attention.value_length"), u(d));
        }
        if let Some(window) = self.sliding_window {
            // A global base unlike the local layers' 10,000, so a mixed-up base shows.
            w.meta(&k("rope.freq_base"), Value::F32(1e6))
                .meta(&k("attention.sliding_window"), u(window));
            // SentencePiece: control tokens, then pieces with scores.
            let tokens: Vec<String> = ["<pad>", "<eos>", "<bos>"]
                .iter()
                .map(|t| t.to_string())
                .chain((3..self.vocab).map(|i| format!("\u{2581}p{i}")))
                .collect();
            let types = (0..self.vocab).map(|i| if i < 3 { 3 } else { 1 }).collect();
            let scores = (0..self.vocab).map(|i| -(i as f32)).collect();
            w.meta("tokenizer.ggml.model", Value::Str("llama".into()))
                .meta("tokenizer.ggml.tokens", Value::Strings(tokens))
                .meta("tokenizer.ggml.scores", Value::F32s(scores))
                .meta("tokenizer.ggml.token_type", Value::I32s(types))
                .meta("tokenizer.ggml.bos_token_id", u(2))
                .meta("tokenizer.ggml.eos_token_id", u(1));
            return w;
        }
        w.meta(&k("rope.freq_base"), Value::F32(10000.0));
        // Token 0 is a control token; the rest are byte-level pieces (no merges).
        let tokens: Vec<String> = std::iter::once("<|endoftext|>".to_string())
            .chain((1..self.vocab).map(|i| format!("t{i}")))
            .collect();
        let types = (0..self.vocab)
            .map(|i| if i == 0 { 3 } else { 1 })
            .collect();
        w.meta("tokenizer.ggml.model", Value::Str("gpt2".into()))
            .meta("tokenizer.ggml.tokens", Value::Strings(tokens))
            .meta("tokenizer.ggml.token_type", Value::I32s(types))
            .meta("tokenizer.ggml.merges", Value::Strings(Vec::new()))
            .meta("tokenizer.ggml.bos_token_id", u(0))
            .meta("tokenizer.ggml.eos_token_id", u(0));
        w
    }

    /// The whole file: metadata and random weights (uniform, scaled by 1/sqrt(fan-in) so
    /// activations stay O(1) through the layers).
    pub fn gguf(&self) -> Vec<u8> {
        let mut w = self.metadata();
        let mut rng = SplitMix::new(self.seed);
        let mut uniform = |n: usize, scale: f32| -> Vec<f32> {
            (0..n)
                .map(|_| (rng.uniform() as f32 * 2.0 - 1.0) * scale)
                .collect()
        };
        let (d, hd, ty) = (self.hidden, self.head_dim(), self.weights);
        let (q, kv) = (self.heads * hd, self.kv_heads * hd);
        let fan = |k: usize| (3.0 / k as f32).sqrt();
        let embed = uniform(d * self.vocab, 1.0);
        w.tensor("token_embd.weight", &[d, self.vocab], &embed, ty);
        let gemma = self.sliding_window.is_some();
        let mut blocks_rng = SplitMix::new(self.seed ^ 0x9e37_79b9_7f4a_7c15);
        for l in 0..self.layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            for norm in ["attn_norm", "ffn_norm"] {
                let gain: Vec<f32> = uniform(d, 0.2).iter().map(|v| 1.0 + v).collect();
                w.tensor(&n(norm), &[d], &gain, GgmlType::F32);
            }
            if gemma {
                for (norm, len) in [
                    ("attn_q_norm", hd),
                    ("attn_k_norm", hd),
                    ("post_attention_norm", d),
                    ("post_ffw_norm", d),
                ] {
                    let gain: Vec<f32> = uniform(len, 0.2).iter().map(|v| 1.0 + v).collect();
                    w.tensor(&n(norm), &[len], &gain, GgmlType::F32);
                }
                // Gemma 3 270M's types: Q5_0 projections, Q8_0 values (every other layer),
                // K-quants for the output projection and the down projection; on odd layers
                // Q4_0 for the queries, Q5_K for the down projection and Q5_1 for the FFN's up
                // (other files' types).
                for (name, rows, cols, ty) in [
                    ("attn_q", q, d, [GgmlType::Q5_0, GgmlType::Q4_0][l % 2]),
                    ("attn_k", kv, d, GgmlType::Q5_0),
                    ("attn_v", kv, d, [GgmlType::Q8_0, GgmlType::Q5_0][l % 2]),
                    ("attn_output", d, q, GgmlType::Q4_K),
                    ("ffn_gate", self.ffn, d, GgmlType::Q5_0),
                    (
                        "ffn_up",
                        self.ffn,
                        d,
                        [GgmlType::Q5_0, GgmlType::Q5_1][l % 2],
                    ),
                    (
                        "ffn_down",
                        d,
                        self.ffn,
                        [GgmlType::Q6_K, GgmlType::Q5_K][l % 2],
                    ),
                ] {
                    let data = random_blocks(&mut blocks_rng, rows * cols, ty, fan(cols));
                    w.blocks(&n(name), &[cols, rows], ty, data);
                }
                continue;
            }
            for (name, rows, cols) in [
                ("attn_q", q, d),
                ("attn_k", kv, d),
                ("attn_v", kv, d),
                ("attn_output", d, q),
                ("ffn_gate", self.ffn, d),
                ("ffn_up", self.ffn, d),
                ("ffn_down", d, self.ffn),
            ] {
                let values = uniform(rows * cols, fan(cols));
                w.tensor(&n(name), &[cols, rows], &values, ty);
            }
        }
        let gain: Vec<f32> = uniform(d, 0.2).iter().map(|v| 1.0 + v).collect();
        w.tensor("output_norm.weight", &[d], &gain, GgmlType::F32);
        w.bytes()
    }
}

//! The reference forward pass on the CPU, in plain f32 Rust: what the WGSL forward must
//! reproduce, for every family (`ModelConfig`'s data says where the norms go, which
//! activation, which RoPE pairs and window). K/V are rounded to f16 as the f16 cache stores
//! them.

use crate::error::Result;
use crate::model::config::{Activation, ModelConfig, RopePairs};
use crate::model::gguf::{dequantize, Gguf};
use crate::model::limits;

/// One block's weights, dequantized; matrices are `[out, in]` row-major.
struct Block {
    attn_norm: Vec<f32>,
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    wo: Vec<f32>,
    ffn_norm: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    /// Per-head Q/K norms (`qk_norm`), `[head_dim]` each.
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// Norms of the attention and FFN outputs (`post_norms`).
    post_norms: Option<(Vec<f32>, Vec<f32>)>,
}

/// The model on the CPU.
pub struct CpuModel {
    /// Shape.
    pub cfg: ModelConfig,
    embed: Vec<f32>,
    blocks: Vec<Block>,
    out_norm: Vec<f32>,
}

/// Keys and values of every position so far, per layer: `[kv_heads][pos * head_dim]`.
#[derive(Default)]
pub struct CpuKv {
    k: Vec<Vec<Vec<f32>>>,
    v: Vec<Vec<Vec<f32>>>,
}

impl CpuKv {
    /// Layer `l`'s keys and values, `[kv_heads][pos * head_dim]` (f16-rounded).
    pub fn layer(&self, l: usize) -> (&[Vec<f32>], &[Vec<f32>]) {
        (&self.k[l], &self.v[l])
    }

    /// Tokens held.
    pub fn len(&self, head_dim: usize) -> usize {
        self.k
            .first()
            .and_then(|l| l.first())
            .map_or(0, |h| h.len() / head_dim)
    }
}

fn matvec(w: &[f32], x: &[f32], out: &mut [f32]) {
    let k = x.len();
    for (o, row) in out.iter_mut().zip(w.chunks_exact(k)) {
        *o = row.iter().zip(x).map(|(a, b)| a * b).sum();
    }
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| v * inv * g).collect()
}

/// RoPE of one head: pair i (channels `(2i, 2i + 1)` adjacent, or `(i, i + d/2)` halves)
/// rotated by `pos · θ^(-2i/d)`.
pub fn rope(x: &mut [f32], pos: usize, theta: f32, pairs: RopePairs) {
    let d = x.len();
    for i in 0..d / 2 {
        let angle = pos as f32 * theta.powf(-((2 * i) as f32) / d as f32);
        let (s, c) = angle.sin_cos();
        let (ia, ib) = match pairs {
            RopePairs::Adjacent => (2 * i, 2 * i + 1),
            RopePairs::Halves => (i, i + d / 2),
        };
        let (a, b) = (x[ia], x[ib]);
        x[ia] = a * c - b * s;
        x[ib] = a * s + b * c;
    }
}

/// The FFN gate's activation.
pub fn activate(g: f32, act: Activation) -> f32 {
    match act {
        Activation::Silu => g / (1.0 + (-g).exp()),
        Activation::GeluTanh => {
            const C: f32 = 0.797_884_6; // √(2/π)
            0.5 * g * (1.0 + (C * (g + 0.044_715 * g * g * g)).tanh())
        }
    }
}

fn f16(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

impl CpuModel {
    /// Dequantizes every weight of `g` (whose data is `bytes`), each checked to have the
    /// shape the config implies.
    pub fn load(g: &Gguf, bytes: &[u8]) -> Result<Self> {
        let cfg = ModelConfig::from_gguf(g)?;
        for (name, rows, cols) in limits::weight_shapes(&cfg) {
            limits::expect_matrix(g.tensor(&name)?, rows, cols)?;
        }
        let t = |name: &str| -> Result<Vec<f32>> {
            let info = g.tensor(name)?;
            Ok(dequantize(
                &bytes[info.offset..info.offset + info.bytes],
                info.ty,
            ))
        };
        let blocks = (0..cfg.layers)
            .map(|l| {
                let b = |s: &str| t(&format!("blk.{l}.{s}.weight"));
                let pair = |on: bool, a: &str, c: &str| -> Result<_> {
                    Ok(match on {
                        true => Some((b(a)?, b(c)?)),
                        false => None,
                    })
                };
                Ok(Block {
                    attn_norm: b("attn_norm")?,
                    wq: b("attn_q")?,
                    wk: b("attn_k")?,
                    wv: b("attn_v")?,
                    wo: b("attn_output")?,
                    ffn_norm: b("ffn_norm")?,
                    gate: b("ffn_gate")?,
                    up: b("ffn_up")?,
                    down: b("ffn_down")?,
                    qk_norm: pair(cfg.qk_norm, "attn_q_norm", "attn_k_norm")?,
                    post_norms: pair(cfg.post_norms, "post_attention_norm", "post_ffw_norm")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CpuModel {
            cfg,
            embed: t("token_embd.weight")?,
            out_norm: t("output_norm.weight")?,
            blocks,
        })
    }

    /// Runs `tokens` after what `kv` holds; returns the logits of every token, `[T, vocab]`.
    pub fn forward(&self, tokens: &[u32], kv: &mut CpuKv) -> Vec<f32> {
        let c = &self.cfg;
        let (d, hd) = (c.hidden, c.head_dim);
        if kv.k.is_empty() {
            kv.k = vec![vec![Vec::new(); c.kv_heads]; c.layers];
            kv.v = vec![vec![Vec::new(); c.kv_heads]; c.layers];
        }
        let past = kv.len(hd);
        let mut logits = Vec::with_capacity(tokens.len() * c.vocab);
        for (t, &tok) in tokens.iter().enumerate() {
            let pos = past + t;
            let mut x: Vec<f32> = self.embed[tok as usize * d..(tok as usize + 1) * d]
                .iter()
                .map(|v| v * c.embed_scale)
                .collect();
            for (l, b) in self.blocks.iter().enumerate() {
                let h = rms_norm(&x, &b.attn_norm, c.rms_eps);
                let mut q = vec![0.0; c.heads * hd];
                let mut k = vec![0.0; c.kv_heads * hd];
                let mut v = vec![0.0; c.kv_heads * hd];
                matvec(&b.wq, &h, &mut q);
                matvec(&b.wk, &h, &mut k);
                matvec(&b.wv, &h, &mut v);
                if let Some((qn, kn)) = &b.qk_norm {
                    for head in q.chunks_exact_mut(hd) {
                        head.copy_from_slice(&rms_norm(head, qn, c.rms_eps));
                    }
                    for head in k.chunks_exact_mut(hd) {
                        head.copy_from_slice(&rms_norm(head, kn, c.rms_eps));
                    }
                }
                let theta = c.layer_rope_theta(l);
                for head in q.chunks_exact_mut(hd).chain(k.chunks_exact_mut(hd)) {
                    rope(head, pos, theta, c.rope_pairs);
                }
                // The positions this layer sees: all, or the last `window` (the query's own
                // included).
                let first = c.layer_window(l).map_or(0, |w| (pos + 1).saturating_sub(w));
                for g in 0..c.kv_heads {
                    kv.k[l][g].extend(k[g * hd..(g + 1) * hd].iter().map(|&x| f16(x)));
                    kv.v[l][g].extend(v[g * hd..(g + 1) * hd].iter().map(|&x| f16(x)));
                }
                let mut att = vec![0.0; c.heads * hd];
                let scale = 1.0 / (hd as f32).sqrt();
                for head in 0..c.heads {
                    let g = head / c.group();
                    let qh = &q[head * hd..(head + 1) * hd];
                    let scores: Vec<f32> = kv.k[l][g]
                        .chunks_exact(hd)
                        .skip(first)
                        .map(|kj| kj.iter().zip(qh).map(|(a, b)| a * b).sum::<f32>() * scale)
                        .collect();
                    let m = scores.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                    let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
                    let sum: f32 = e.iter().sum();
                    let out = &mut att[head * hd..(head + 1) * hd];
                    for (p, vj) in e.iter().zip(kv.v[l][g].chunks_exact(hd).skip(first)) {
                        for (o, vv) in out.iter_mut().zip(vj) {
                            *o += p / sum * vv;
                        }
                    }
                }
                let mut o = vec![0.0; d];
                matvec(&b.wo, &att, &mut o);
                if let Some((post_attn, _)) = &b.post_norms {
                    o = rms_norm(&o, post_attn, c.rms_eps);
                }
                x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
                let h = rms_norm(&x, &b.ffn_norm, c.rms_eps);
                let mut gate = vec![0.0; c.ffn];
                let mut up = vec![0.0; c.ffn];
                matvec(&b.gate, &h, &mut gate);
                matvec(&b.up, &h, &mut up);
                let act: Vec<f32> = gate
                    .iter()
                    .zip(&up)
                    .map(|(&g, u)| activate(g, c.activation) * u)
                    .collect();
                let mut down = vec![0.0; d];
                matvec(&b.down, &act, &mut down);
                if let Some((_, post_ffn)) = &b.post_norms {
                    down = rms_norm(&down, post_ffn, c.rms_eps);
                }
                x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
            }
            let h = rms_norm(&x, &self.out_norm, c.rms_eps);
            let mut out = vec![0.0; c.vocab];
            matvec(&self.embed, &h, &mut out);
            logits.extend(out);
        }
        logits
    }
}

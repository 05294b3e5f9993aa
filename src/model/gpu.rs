//! The forward pass on the GPU (`wgsl/llama.wgsl`), attention reading K/V from a cache: one
//! graph for every family, whose differences (`ModelConfig`) are data.

use std::sync::Arc;

use crate::cache::{AttendOptions, KvCache, OutLayout, Scope};
use crate::config::DType;
use crate::error::{Result, XqError};
use crate::gpu::dispatch::Bind;
use crate::gpu::kernels::attention::{AttnCall, AttnSource, RING_ALIGN};
use crate::gpu::kernels::llama::LlamaDims as Dims;
use crate::gpu::kernels::views::RingSinks;
use crate::gpu::kernels::window::{RingTarget, RingWrite};
use crate::gpu::pipelines::{Constants, KernelKey, LlamaConstants, MATMUL_TILE_K};
use crate::gpu::{GpuBuffer, GpuContext, GpuTensor};
use crate::model::config::{Activation, ModelConfig, RopePairs};
use crate::model::gguf::Gguf;
use crate::model::limits;
use crate::model::weight_format::GpuWeightFormat;

/// A weight matrix `[rows, cols]` on the GPU in its quantized form, in parts of whole rows
/// when it is larger than one storage binding (Gemma 3's embedding: 189 MB as Q8_0).
struct Weight {
    /// (buffer, rows) of each part, in row order.
    parts: Vec<(Arc<GpuBuffer>, usize)>,
    /// `WEIGHT` in the shader: 0 Q4_1, 1 Q8_0 (repacked; both in row quads), 2 f32, 3 Q5_1, 4 Q4_K, 5 Q5_K,
    /// 6 Q6_K, 7 Q5_0, 8 Q4_0 (the last three padded to whole words).
    kind: u8,
    rows: usize,
    cols: usize,
}

struct Block {
    attn_norm: Arc<GpuBuffer>,
    wq: Weight,
    wk: Weight,
    wv: Weight,
    wo: Weight,
    ffn_norm: Arc<GpuBuffer>,
    gate: Weight,
    up: Weight,
    down: Weight,
    /// Per-head Q and K norms (`qk_norm`).
    qk_norm: Option<(Arc<GpuBuffer>, Arc<GpuBuffer>)>,
    /// Norms of the attention and FFN outputs (`post_norms`).
    post_norms: Option<(Arc<GpuBuffer>, Arc<GpuBuffer>)>,
}

/// Which logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's (generation).
    Last,
    /// Every token's (perplexity).
    All,
}

/// Up to this many tokens `matmul_few_any` runs (`FEW` in `wgsl/llama.wgsl`, where it sizes
/// an array).
pub(crate) const FEW_TOKENS: usize = 8;

/// Up to this many tokens the block-wise `matmul_few` runs (one invocation per 8 rows); more
/// go through `matmul_tiled` (one per tile of `tile_rows` x `TILE_TOKENS`), which decodes
/// each weight word once per tile's tokens and reads each input once per tile's rows.
const FEW_BLOCK_TOKENS: usize = 2;

/// `matmul_tiled`'s tile: tokens of one invocation (`TILE_TOKENS` in `wgsl/llama.wgsl`).
const TILE_TOKENS: usize = 8;

/// `matmul_tiled`'s tile: weight rows of one invocation (`tile_rows()` in `wgsl/llama.wgsl`):
/// 32 for Q4_1 blocks, 16 for the other weight types.
fn tile_rows(weight_kind: u8) -> usize {
    match weight_kind {
        0 => 32,
        _ => 16,
    }
}

/// How many workgroups a launch needs.
enum Work {
    /// One workgroup each (matmul rows, normalized tokens).
    Workgroups(usize),
    /// One invocation each.
    Invocations(usize),
}

/// `t` rows of an activation buffer, from row `row0`.
#[derive(Clone, Copy)]
struct Rows<'a> {
    buffer: &'a wgpu::Buffer,
    t: usize,
    row0: usize,
}

/// The model's weights on the GPU.
pub struct GpuModel {
    ctx: Arc<GpuContext>,
    /// Shape.
    pub cfg: ModelConfig,
    embed: Weight,
    blocks: Vec<Block>,
    out_norm: Arc<GpuBuffer>,
}

impl GpuModel {
    /// Uploads the weights of `g` (data in `bytes`) in the layouts of `GpuWeightFormat`:
    /// Q4_1 blocks and Q8_0 blocks (repacked to 36 bytes) interleaved in row quads, Q5_1,
    /// Q4_K and Q5_K blocks as stored, Q6_K, Q5_0 and Q4_0 blocks with two bytes of padding,
    /// F32 and F16 as f32. A shape the kernels cannot run on this device is refused before any
    /// weight is read.
    pub fn load(ctx: Arc<GpuContext>, g: &Gguf, bytes: &[u8]) -> Result<Self> {
        let cfg = ModelConfig::from_gguf(g)?;
        limits::check(&ctx, &cfg, g)?;
        let upload = |label: &str, w: &[u32]| -> Result<Arc<GpuBuffer>> {
            let b = ctx.storage_buffer(label, (w.len() * 4) as u64)?;
            ctx.queue().write_buffer(&b, 0, bytemuck::cast_slice(w));
            Ok(b)
        };
        let weight = |name: &str, rows: usize, cols: usize| -> Result<Weight> {
            let info = g.tensor(name)?;
            limits::expect_matrix(info, rows, cols)?;
            let data = &bytes[info.offset..info.offset + info.bytes];
            let format = GpuWeightFormat::of(info.ty);
            let (kind, w) = (format.kind(), format.words(info.ty, data, rows));
            // Parts of as many whole rows as one binding holds (a multiple of 16, which
            // `limits::check` made sure fit one); the last part's rows past `rows` are
            // padding (Q4_1's last row quad).
            let row_words = w.len() / format.stored_rows(rows);
            let limit = ctx.max_bound_buffer_bytes();
            let per_part = ((limit as usize / 4 / row_words.max(1)) / 16 * 16).max(16);
            let parts = w
                .chunks(per_part * row_words)
                .enumerate()
                .map(|(i, part)| {
                    let part_rows = (part.len() / row_words).min(rows - i * per_part);
                    Ok((upload(name, part)?, part_rows))
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(Weight {
                parts,
                kind,
                rows,
                cols,
            })
        };
        let vector = |name: &str, len: usize| -> Result<Arc<GpuBuffer>> {
            let info = g.tensor(name)?;
            let data = &bytes[info.offset..info.offset + info.bytes];
            let v = crate::model::gguf::dequantize(data, info.ty);
            if v.len() != len {
                return Err(XqError::Io(format!(
                    "{name}: {} elements, expected {len}",
                    v.len()
                )));
            }
            upload(name, bytemuck::cast_slice(&v))
        };
        let (d, hd) = (cfg.hidden, cfg.head_dim);
        let blocks = (0..cfg.layers)
            .map(|l| {
                let n = |s: &str| format!("blk.{l}.{s}.weight");
                let pair = |on: bool, a: &str, b: &str, len: usize| -> Result<_> {
                    Ok(match on {
                        true => Some((vector(&n(a), len)?, vector(&n(b), len)?)),
                        false => None,
                    })
                };
                Ok(Block {
                    qk_norm: pair(cfg.qk_norm, "attn_q_norm", "attn_k_norm", hd)?,
                    post_norms: pair(cfg.post_norms, "post_attention_norm", "post_ffw_norm", d)?,
                    attn_norm: vector(&n("attn_norm"), d)?,
                    wq: weight(&n("attn_q"), cfg.heads * hd, d)?,
                    wk: weight(&n("attn_k"), cfg.kv_heads * hd, d)?,
                    wv: weight(&n("attn_v"), cfg.kv_heads * hd, d)?,
                    wo: weight(&n("attn_output"), d, cfg.heads * hd)?,
                    ffn_norm: vector(&n("ffn_norm"), d)?,
                    gate: weight(&n("ffn_gate"), cfg.ffn, d)?,
                    up: weight(&n("ffn_up"), cfg.ffn, d)?,
                    down: weight(&n("ffn_down"), d, cfg.ffn)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(GpuModel {
            embed: weight("token_embd.weight", cfg.vocab, d)?,
            out_norm: vector("output_norm.weight", d)?,
            blocks,
            cfg,
            ctx,
        })
    }

    /// The GPU context.
    pub fn context(&self) -> &Arc<GpuContext> {
        &self.ctx
    }

    fn launch(
        &self,
        enc: &mut wgpu::CommandEncoder,
        entry: &'static str,
        ov: LlamaConstants,
        mut dims: Dims,
        work: Work,
        buffers: &[(u32, &wgpu::Buffer)],
    ) -> Result<()> {
        let key = KernelKey::new(entry, Constants::Llama(ov));
        let wg = key.workgroup_size();
        let grid = match work {
            Work::Workgroups(n) => self.ctx.grid(n * wg as usize, wg)?,
            Work::Invocations(n) => self.ctx.grid(n, wg)?,
        };
        dims.grid_x = grid.x;
        let placeholder = self.ctx.placeholder();
        let mut all: Vec<(u32, Bind)> = (1..=7).map(|b| (b, (&placeholder).into())).collect();
        for &(b, buf) in buffers {
            all[b as usize - 1] = (b, buf.into());
        }
        self.ctx.dispatch(enc, &key, &dims, &all, grid);
        Ok(())
    }

    /// `y[t, :] (+)= W · x[row0 + t, :]` for the `t` rows of `x`.
    fn matmul(
        &self,
        enc: &mut wgpu::CommandEncoder,
        x: Rows,
        w: &Weight,
        y: &wgpu::Buffer,
        accumulate: bool,
    ) -> Result<()> {
        let ov = LlamaConstants {
            weight: w.kind,
            accumulate,
            ..Default::default()
        };
        let mut n0 = 0;
        for (buffer, rows) in &w.parts {
            let dims = Dims {
                t: x.t as u32,
                k: w.cols as u32,
                n: *rows as u32,
                n0: n0 as u32,
                y_cols: w.rows as u32,
                x_row0: x.row0 as u32,
                ..Default::default()
            };
            // Decode: one invocation per 8 rows; passes of more tokens: one per tile of 32 or
            // 16 rows x 8 tokens (K a multiple of 32), else one workgroup per row, its weights
            // shared through workgroup memory (in tiles when wider than it holds at once).
            let (entry, work) = if x.t <= FEW_BLOCK_TOKENS && w.cols % 32 == 0 {
                ("matmul_few", Work::Invocations(rows.div_ceil(8)))
            } else if w.cols % 32 == 0 {
                (
                    "matmul_tiled",
                    Work::Invocations(rows.div_ceil(tile_rows(w.kind)) * x.t.div_ceil(TILE_TOKENS)),
                )
            } else if x.t <= FEW_TOKENS {
                ("matmul_few_any", Work::Invocations(*rows))
            } else if w.cols <= MATMUL_TILE_K as usize {
                ("matmul", Work::Workgroups(*rows))
            } else {
                ("matmul_tiles", Work::Workgroups(*rows))
            };
            self.launch(
                enc,
                entry,
                ov,
                dims,
                work,
                &[
                    (1, x.buffer),
                    (2, buffer),
                    (3, y),
                    (6, x.buffer),
                    (7, buffer),
                ],
            )?;
            n0 += rows;
        }
        Ok(())
    }

    /// `y[t, :] = norm(x[row0 + t, :]) · gain` over the hidden width.
    fn rmsnorm(
        &self,
        enc: &mut wgpu::CommandEncoder,
        x: Rows,
        gain: &wgpu::Buffer,
        y: &wgpu::Buffer,
    ) -> Result<()> {
        self.rmsnorm_rows(enc, x, self.cfg.hidden, gain, y, false)
    }

    /// RMSNorm of `x.t` rows of `width` (tokens, or heads for the Q/K norms) into `y`,
    /// replacing it or, with `accumulate`, adding to it (a post-norm joining the residual).
    fn rmsnorm_rows(
        &self,
        enc: &mut wgpu::CommandEncoder,
        x: Rows,
        width: usize,
        gain: &wgpu::Buffer,
        y: &wgpu::Buffer,
        accumulate: bool,
    ) -> Result<()> {
        let dims = Dims {
            t: x.t as u32,
            k: width as u32,
            eps: self.cfg.rms_eps,
            x_row0: x.row0 as u32,
            ..Default::default()
        };
        let ov = LlamaConstants {
            accumulate,
            ..Default::default()
        };
        self.launch(
            enc,
            "rmsnorm",
            ov,
            dims,
            Work::Workgroups(x.t),
            &[(1, x.buffer), (3, y), (4, gain)],
        )
    }

    /// `[t, heads · D]` → `[heads, t, D]`, rotated for positions `pos0..` with RoPE base
    /// `theta` when given.
    fn to_heads(
        &self,
        enc: &mut wgpu::CommandEncoder,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        t: usize,
        heads: usize,
        rope: Option<(usize, f32)>,
    ) -> Result<()> {
        let c = &self.cfg;
        let (pos0, theta) = rope.unwrap_or((0, 0.0));
        let dims = Dims {
            t: t as u32,
            heads: heads as u32,
            head_dim: c.head_dim as u32,
            pos0: pos0 as u32,
            theta,
            ..Default::default()
        };
        let ov = LlamaConstants {
            rotate: rope.is_some(),
            halves: c.rope_pairs == RopePairs::Halves,
            ..Default::default()
        };
        self.launch(
            enc,
            "rope",
            ov,
            dims,
            Work::Invocations(t * heads * c.head_dim / 2),
            &[(1, x), (3, y)],
        )
    }

    /// Runs `tokens` at positions `pos0..` through the model, K/V through `cache`; returns
    /// the logits `[T or 1, vocab]`. The whole pass is one submission. A prefill (`pos0 = 0`)
    /// attends densely over its own K/V (rounded to f16, as the cache holds them); any later
    /// pass attends over the cache where its K/V live (no dense K/V is rebuilt). A failed pass
    /// leaves the cache as it was.
    pub async fn forward(
        &self,
        tokens: &[u32],
        pos0: usize,
        cache: &mut dyn KvCache,
        logits: Logits,
    ) -> Result<Vec<f32>> {
        self.forward_capturing(tokens, pos0, cache, logits, None)
            .await
    }

    /// [`GpuModel::forward`], also copying every layer's queries after RoPE into `queries`
    /// (`[layers, 1, heads, T, head_dim]` f32) when given.
    pub async fn forward_capturing(
        &self,
        tokens: &[u32],
        pos0: usize,
        cache: &mut dyn KvCache,
        logits: Logits,
        queries: Option<&wgpu::Buffer>,
    ) -> Result<Vec<f32>> {
        Ok(self
            .forward_pass(tokens, pos0, cache, logits, queries, false)
            .await?
            .0)
    }

    /// [`GpuModel::forward`], also returning the output matmul's input: the final-normalized
    /// hidden state of each row whose logits are returned (`[rows, hidden]`).
    /// [`GpuModel::logits_of_hidden`] turns it back into the same logits, bit for bit.
    pub async fn forward_keeping_hidden(
        &self,
        tokens: &[u32],
        pos0: usize,
        cache: &mut dyn KvCache,
        logits: Logits,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (logits, hidden) = self
            .forward_pass(tokens, pos0, cache, logits, None, true)
            .await?;
        Ok((logits, hidden.unwrap_or_default()))
    }

    /// The logits of final-normalized hidden rows (`[rows, hidden]`, as
    /// [`GpuModel::forward_keeping_hidden`] returns them): the output matmul alone, the same
    /// kernel a pass of that many rows runs, so the same logits.
    pub async fn logits_of_hidden(&self, hidden: &[f32]) -> Result<Vec<f32>> {
        let c = self.cfg;
        if hidden.is_empty() || hidden.len() % c.hidden != 0 {
            return Err(XqError::Shape(format!(
                "hidden rows must be a non-empty multiple of {} floats, got {}",
                c.hidden,
                hidden.len()
            )));
        }
        let rows = hidden.len() / c.hidden;
        let ctx = &self.ctx;
        let h = ctx.storage_buffer("hidden", (hidden.len() * 4) as u64)?;
        ctx.queue()
            .write_buffer(&h, 0, bytemuck::cast_slice(hidden));
        let out = ctx.storage_buffer("logits", (rows * c.vocab * 4) as u64)?;
        ctx.run("logits of hidden", |enc| self.logits(enc, &h, rows, &out))
            .await?;
        let bytes = ctx.read_bytes(&out, (rows * c.vocab * 4) as u64).await?;
        Ok(bytemuck::cast_slice(&bytes).to_vec())
    }

    async fn forward_pass(
        &self,
        tokens: &[u32],
        pos0: usize,
        cache: &mut dyn KvCache,
        logits: Logits,
        queries: Option<&wgpu::Buffer>,
        keep_hidden: bool,
    ) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
        let c = self.cfg;
        let t = tokens.len();
        if t == 0 {
            return Err(XqError::Shape("forward needs at least one token".into()));
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= c.vocab) {
            return Err(XqError::Shape(format!(
                "token id {bad} is outside the vocabulary of {}",
                c.vocab
            )));
        }
        let m = *cache.model();
        if (m.layers, m.kv_heads, m.head_dim, m.batch) != (c.layers, c.kv_heads, c.head_dim, 1) {
            return Err(XqError::Shape(format!(
                "the cache is for {m:?}, the model has {} layers of {} KV heads of {}",
                c.layers, c.kv_heads, c.head_dim
            )));
        }
        if let Some(l) = (0..c.layers).find(|&l| cache.tokens(l) != pos0) {
            return Err(XqError::Shape(format!(
                "layer {l}: the cache holds {} tokens, the model is at {pos0}",
                cache.tokens(l)
            )));
        }
        let ctx = &self.ctx;
        let buf = |label: &str, n: usize| ctx.storage_buffer(label, (n * 4) as u64);
        let (d, hd) = (c.hidden, c.head_dim);
        let ids = buf("tokens", t)?;
        ctx.queue()
            .write_buffer(&ids, 0, bytemuck::cast_slice(tokens));
        let x = buf("x", t * d)?;
        let h = buf("h", t * d)?;
        let q = buf("q", t * c.heads * hd)?;
        let kv_lin = buf("k/v linear", t * c.kv_heads * hd)?;
        let qr = buf("q roped", t * c.heads * hd)?;
        let kr = buf("k roped", t * c.kv_heads * hd)?;
        let vr = buf("v", t * c.kv_heads * hd)?;
        let att = buf("attention", t * c.heads * hd)?;
        let gate = buf("gate", t * c.ffn)?;
        let up = buf("up", t * c.ffn)?;
        // Q or K normed per head before RoPE (`qk_norm`).
        let qk_normed = match c.qk_norm {
            true => Some(buf("q/k normed", t * c.heads.max(c.kv_heads) * hd)?),
            false => None,
        };
        let (rows, row0) = match logits {
            Logits::Last => (1, t - 1),
            Logits::All => (t, 0),
        };
        let out = buf("logits", rows * c.vocab)?;
        let kv_dims = [1, c.kv_heads, t, hd];
        let all = |buffer| Rows { buffer, t, row0: 0 };
        let k_in = GpuTensor::on(kr.clone(), &kv_dims, DType::F32)?;
        let v_in = GpuTensor::on(vr.clone(), &kv_dims, DType::F32)?;
        let q_in = GpuTensor::on(qr.clone(), &[1, c.heads, t, hd], DType::F32)?;
        let att_out = GpuTensor::on(att.clone(), &[1, t, c.heads, hd], DType::F32)?;
        let attend = AttendOptions {
            layout: OutLayout::TokensMajor,
            ..Default::default()
        };
        // A prefill attends over its own K/V, kept as f16 rings (as a cache holds them).
        let prefill = match pos0 {
            0 => Some(Prefill::new(ctx, &c, &q_in, &att_out, t)?),
            _ => None,
        };
        let checkpoint = cache.checkpoint(Scope::All);
        let pass = ctx
            .run("forward", |enc| {
                self.embed(enc, &ids, &x, t)?;
                for (l, b) in self.blocks.iter().enumerate() {
                    let rope = Some((pos0, c.layer_rope_theta(l)));
                    self.rmsnorm(enc, all(&x), &b.attn_norm, &h)?;
                    // Q and K: projected, per-head normed (`qk_norm`), roped into heads.
                    let project = |enc: &mut wgpu::CommandEncoder,
                                   w: &Weight,
                                   heads: usize,
                                   norm: Option<&Arc<GpuBuffer>>,
                                   lin: &wgpu::Buffer,
                                   out: &wgpu::Buffer| {
                        self.matmul(enc, all(&h), w, lin, false)?;
                        let src = match (norm, &qk_normed) {
                            (Some(gain), Some(normed)) => {
                                let rows = Rows {
                                    buffer: lin,
                                    t: t * heads,
                                    row0: 0,
                                };
                                self.rmsnorm_rows(enc, rows, hd, gain, normed, false)?;
                                &**normed
                            }
                            _ => lin,
                        };
                        self.to_heads(enc, src, out, t, heads, rope)
                    };
                    let (qn, kn) = b.qk_norm.as_ref().map(|(q, k)| (q, k)).unzip();
                    project(enc, &b.wq, c.heads, qn, &q, &qr)?;
                    if let Some(sink) = queries {
                        let bytes = (t * c.heads * hd * 4) as u64;
                        enc.copy_buffer_to_buffer(&qr, 0, sink, l as u64 * bytes, bytes);
                    }
                    project(enc, &b.wk, c.kv_heads, kn, &kv_lin, &kr)?;
                    self.matmul(enc, all(&h), &b.wv, &kv_lin, false)?;
                    self.to_heads(enc, &kv_lin, &vr, t, c.kv_heads, None)?;
                    cache.encode_append(enc, l, &k_in, &v_in)?;
                    // Sliding-window layers see the last `window` positions only.
                    let window = c.layer_window(l);
                    match &prefill {
                        Some(p) => p.encode(ctx, enc, &k_in, &v_in, window)?,
                        None => {
                            let attend = AttendOptions { window, ..attend };
                            cache.encode_attend(enc, l, &q_in, &att_out, &attend)?
                        }
                    }
                    // A block output joins the residual stream directly, or normed first
                    // (`post_norms`: into `h`, then normed onto `x`).
                    let residual =
                        |enc: &mut wgpu::CommandEncoder,
                         input: &wgpu::Buffer,
                         w: &Weight,
                         post: Option<&Arc<GpuBuffer>>| {
                            let input = Rows {
                                buffer: input,
                                t,
                                row0: 0,
                            };
                            match post {
                                None => self.matmul(enc, input, w, &x, true),
                                Some(gain) => {
                                    self.matmul(enc, input, w, &h, false)?;
                                    self.rmsnorm_rows(enc, all(&h), d, gain, &x, true)
                                }
                            }
                        };
                    let (post_attn, post_ffn) = b.post_norms.as_ref().map(|(a, f)| (a, f)).unzip();
                    residual(enc, &att, &b.wo, post_attn)?;
                    self.rmsnorm(enc, all(&x), &b.ffn_norm, &h)?;
                    self.matmul(enc, all(&h), &b.gate, &gate, false)?;
                    self.matmul(enc, all(&h), &b.up, &up, false)?;
                    let dims = Dims {
                        t: t as u32,
                        n: c.ffn as u32,
                        ..Default::default()
                    };
                    let ov = LlamaConstants {
                        gelu: c.activation == Activation::GeluTanh,
                        ..Default::default()
                    };
                    self.launch(
                        enc,
                        "gated",
                        ov,
                        dims,
                        Work::Invocations(t * c.ffn),
                        &[(1, &up), (3, &gate)],
                    )?;
                    residual(enc, &gate, &b.down, post_ffn)?;
                }
                self.rmsnorm(
                    enc,
                    Rows {
                        buffer: &x,
                        t: rows,
                        row0,
                    },
                    &self.out_norm,
                    &h,
                )?;
                self.logits(enc, &h, rows, &out)
            })
            .await;
        if let Err(e) = pass {
            cache.rollback(checkpoint);
            return Err(e);
        }
        drop(checkpoint);
        let bytes = ctx.read_bytes(&out, (rows * c.vocab * 4) as u64).await?;
        let hidden = match keep_hidden {
            true => {
                let h = ctx.read_bytes(&h, (rows * d * 4) as u64).await?;
                Some(bytemuck::cast_slice(&h).to_vec())
            }
            false => None,
        };
        Ok((bytemuck::cast_slice(&bytes).to_vec(), hidden))
    }

    /// The output matmul (tied to the embeddings): logits of the first `rows` final-normalized
    /// hidden rows of `h` into `out`.
    fn logits(
        &self,
        enc: &mut wgpu::CommandEncoder,
        h: &wgpu::Buffer,
        rows: usize,
        out: &wgpu::Buffer,
    ) -> Result<()> {
        let h = Rows {
            buffer: h,
            t: rows,
            row0: 0,
        };
        self.matmul(enc, h, &self.embed, out, false)
    }

    /// Token embeddings of `ids` into `x`.
    fn embed(
        &self,
        enc: &mut wgpu::CommandEncoder,
        ids: &wgpu::Buffer,
        x: &wgpu::Buffer,
        t: usize,
    ) -> Result<()> {
        let ov = LlamaConstants {
            weight: self.embed.kind,
            ..Default::default()
        };
        // Each part writes the tokens whose rows it holds.
        let mut n0 = 0;
        for (buffer, rows) in &self.embed.parts {
            let dims = Dims {
                t: t as u32,
                k: self.cfg.hidden as u32,
                n: *rows as u32,
                n0: n0 as u32,
                scale: self.cfg.embed_scale,
                ..Default::default()
            };
            self.launch(
                enc,
                "embed",
                ov,
                dims,
                Work::Invocations(t * self.cfg.hidden),
                &[(2, buffer), (3, x), (5, ids), (7, buffer)],
            )?;
            n0 += rows;
        }
        Ok(())
    }
}

/// A prefill's causal attention over its own K/V: the pass's keys and values are written to
/// f16 rings (rounded as a cache holds them) and read by the same split-K kernel decode uses.
struct Prefill<'a> {
    keys: Arc<GpuBuffer>,
    values: Arc<GpuBuffer>,
    partials: Option<Arc<GpuBuffer>>,
    call: AttnCall<'a>,
    t: usize,
}

impl<'a> Prefill<'a> {
    fn new(
        ctx: &GpuContext,
        c: &ModelConfig,
        queries: &'a GpuTensor,
        out: &'a GpuTensor,
        t: usize,
    ) -> Result<Self> {
        let ring_bytes =
            ((c.kv_heads * t * c.head_dim.div_ceil(2) * 2 * 2) as u64).next_multiple_of(RING_ALIGN);
        let keys = ctx.storage_buffer("prefill keys", ring_bytes)?;
        let values = ctx.storage_buffer("prefill values", ring_bytes)?;
        let call = AttnCall {
            queries,
            out,
            batch: 1,
            kv_heads: c.kv_heads,
            q_heads: c.heads,
            q_tokens: t,
            dim: c.head_dim,
            pos0: 0,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            layout: OutLayout::TokensMajor,
            rotation: Default::default(),
            window: 0,
        };
        let mut p = Prefill {
            keys,
            values,
            partials: None,
            call,
            t,
        };
        let bytes = ctx.attention_partials_bytes(&p.call, &[p.source()])?;
        if bytes > 0 {
            p.partials = Some(ctx.storage_buffer("prefill partials", bytes)?);
        }
        Ok(p)
    }

    fn source(&self) -> AttnSource<'_> {
        AttnSource::Ring {
            key: &self.keys,
            value: &self.values,
            ring_tokens: self.t,
            t0: 0,
            abs0: 0,
            n: self.t,
            sinks: RingSinks::default(),
        }
    }

    /// Records one layer's attention: its K/V into the rings, then the queries over them
    /// (within the layer's sliding window, if it has one).
    fn encode(
        &self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        k: &GpuTensor,
        v: &GpuTensor,
        window: Option<usize>,
    ) -> Result<()> {
        let c = AttnCall {
            window: window.unwrap_or(0),
            ..self.call
        };
        let writes = [(k, &self.keys), (v, &self.values)].map(|(x, ring)| RingWrite {
            x: x.view(),
            n: self.t,
            ring: RingTarget {
                buffer: Bind::from(&**ring),
                tokens: self.t,
                t0: 0,
                rows: c.kv_heads,
                dim: c.dim,
                rotation: None,
            },
        });
        ctx.encode_window_appends(enc, &writes)?;
        ctx.encode_attention(
            enc,
            &c,
            &[self.source()],
            self.partials.as_deref().map(|b| &**b),
        )
    }
}

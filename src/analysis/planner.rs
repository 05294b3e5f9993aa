//! `xquant plan`: a per-layer plan chosen by measurement. For every layer's keys and values
//! of a K/V capture it measures the error of each candidate — own codes at 1–4 bits along
//! either axis (η 0, and the paper's η for 1 and 2 bits), or the previous layer's codes with
//! a residual of 0, 1, 2 or 4 bits — then picks, per K and V, the chain of candidates with the
//! least total error whose bytes at a stated context (everything counted: codes, params,
//! residuals, the f16 window and sinks) meet a target number of bits per element.
//!
//! Errors are measured over the tokens after the sinks (the sinks stay f16). Values: the
//! relative squared error `‖v − v̂‖² / ‖v‖²`. Keys: with the capture's queries (`q.{i}`,
//! `xquant capture --queries`), the mean squared error of the attention logits they cause,
//! `E[(q·(k − k̂))² / D]`, with each channel weighted by its mean squared query over the
//! query heads that read the key's head ([`KeyWeights`]); without queries, their relative
//! squared error. A plan's error is the sum over its tensors. The
//! choice is exact for each Lagrange multiplier (a dynamic program over layers, since a
//! borrowed entry needs the previous layer to own codes of its width and axis), and the
//! multiplier is searched for the least error within the budget.

use crate::cache::{
    CachePlan, CodeSource, LayerPlan, PlanBytes, TensorPlan, DEFAULT_ROTATION_SEED,
};
use crate::config::{DType, KvKind, ParamsPrecision, ValueAxis};
use crate::error::{config_err, Result, XqError};
use crate::gpu::{GpuContext, GpuTensor, PackedCodes, QuantizedTensor, ReuseEncodingGpu};
use crate::kvfile::KvFile;
use crate::reference::reference_bytes;
use crate::reference::{rotate_tensor, RotationTarget};

/// What the planner aims at.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlannerOptions {
    /// Effective bits per element at `context` tokens, everything counted.
    pub target_bits: f64,
    /// The context at which bits are counted.
    pub context: usize,
    /// The set's f16 window.
    pub window: usize,
    /// The set's f16 sinks.
    pub sinks: usize,
    /// Elements per quantization group; 0: each of [`GROUP_SIZES`] that divides the window.
    pub group_quant_size: usize,
}

/// Group sizes the planner tries when none is given: larger groups spend fewer bits on
/// params (two f16 per group and channel: 1 bit per element at 32, 0.25 at 128).
pub const GROUP_SIZES: [usize; 3] = [32, 64, 128];

impl Default for PlannerOptions {
    fn default() -> Self {
        PlannerOptions {
            target_bits: 3.0,
            context: 1024,
            window: 64,
            sinks: 4,
            group_quant_size: 0,
        }
    }
}

/// One candidate for one layer's keys or values: its entry, measured error and bytes at the
/// context (quantized tokens only; the f16 window and sinks are the same for every candidate).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// The plan entry.
    pub entry: TensorPlan,
    /// Relative squared error over the quantized tokens.
    pub error: f64,
    /// Bytes of the quantized tokens at the context.
    pub bytes: u64,
}

/// Candidates per layer, for keys (`[0]`) and values (`[1]`).
#[derive(Clone, Debug, Default)]
pub struct Measured {
    /// `layers[l][kind]`: layer l's candidates.
    pub layers: Vec<[Vec<Candidate>; 2]>,
    /// Heads × batch of the capture.
    pub rows: usize,
    /// Channels per head.
    pub dim: usize,
}

/// A chosen plan and what the planner knows of it.
#[derive(Clone, Debug)]
pub struct Planned {
    /// The plan.
    pub plan: CachePlan,
    /// Its measured error (sum over tensors).
    pub error: f64,
    /// Its bytes at the context.
    pub bytes: PlanBytes,
}

/// Per layer, the weight of each (KV row, channel) in a key's logit error: the mean of
/// `q_d² / D` over the tokens after the sinks and the query heads that read that KV head.
#[derive(Clone, Debug, PartialEq)]
pub struct KeyWeights(pub Vec<Vec<f32>>);

impl KeyWeights {
    /// From the tensors `q.{i}` (`[B, query_heads, T, D]`) of a capture, if it has them.
    pub fn from_tensors(
        tensors: &std::collections::BTreeMap<String, crate::kvfile::Tensor>,
        kv: &KvFile,
        sinks: usize,
    ) -> Result<Option<KeyWeights>> {
        let s = kv.shape.dims();
        let (b, h, n, d) = (s[0], s[1], s[2], s[3]);
        let mut layers = Vec::with_capacity(kv.layers.len());
        for l in 0..kv.layers.len() {
            let Some(q) = tensors.get(&format!("q.{l}")) else {
                if l == 0 {
                    return Ok(None);
                }
                return config_err!("q.{l} is missing (the capture has q.0)");
            };
            let qs = &q.shape;
            if qs.len() != 4 || qs[0] != b || qs[2] != n || qs[3] != d || qs[1] % h != 0 {
                return config_err!(
                    "q.{l}: shape {qs:?} is not [{b}, a multiple of {h} heads, {n}, {d}]"
                );
            }
            let gqa = qs[1] / h;
            let mut w = vec![0f64; b * h * d];
            for (i, row) in q.data.chunks_exact(n * d).enumerate() {
                let (batch, head) = (i / qs[1], i % qs[1]);
                let r = batch * h + head / gqa;
                for tok in row.chunks_exact(d).skip(sinks) {
                    for (c, &v) in tok.iter().enumerate() {
                        w[r * d + c] += (v as f64) * (v as f64);
                    }
                }
            }
            let count = (gqa * n.saturating_sub(sinks) * d).max(1) as f64;
            layers.push(w.iter().map(|&x| (x / count) as f32).collect());
        }
        Ok(Some(KeyWeights(layers)))
    }
}

/// The error of reconstructions `recons` of `x` (`data` on the host): keys with weights,
/// the weighted logit error; otherwise the relative squared error.
async fn errors(
    ctx: &GpuContext,
    x: &GpuTensor,
    data: &[f32],
    recons: &[GpuTensor],
    weights: Option<&[f32]>,
) -> Result<Vec<f64>> {
    let mut tensors = vec![x];
    tensors.extend(recons.iter());
    let pairs: Vec<(usize, usize)> = (1..tensors.len()).map(|i| (0, i)).collect();
    let sims = ctx.weighted_similarities(&tensors, &pairs, weights).await?;
    let d = x.shape().dim() as f64;
    let relative = data.len() as f64 / energy(data).max(f64::MIN_POSITIVE);
    Ok(sims
        .iter()
        .map(|s| match weights {
            Some(_) => s.mse * d,
            None => s.mse * relative,
        })
        .collect())
}

/// Own-code candidates: (bits, axis, η).
fn own_candidates() -> Vec<TensorPlan> {
    let mut v = Vec::new();
    for bits in 1..=4u8 {
        for axis in [ValueAxis::Tokens, ValueAxis::Channels] {
            let etas: &[f32] = match bits {
                1 => &[0.0, 1.0 / 6.0],
                2 => &[0.0, 0.045],
                _ => &[0.0],
            };
            for &eta in etas {
                v.push(TensorPlan {
                    eta,
                    ..TensorPlan::own(bits, axis)
                });
            }
        }
    }
    v
}

/// Residual widths of borrowed candidates.
const RESIDUALS: [u8; 4] = [0, 1, 2, 4];

impl PlannerOptions {
    /// Checks the options against a capture of `tokens` tokens.
    pub fn validate(&self, tokens: usize) -> Result<()> {
        let g = self.group_quant_size;
        if !(self.target_bits.is_finite() && self.target_bits > 0.0) {
            return config_err!("target_bits must be > 0, got {}", self.target_bits);
        }
        if g > crate::config::MAX_GROUP_SIZE || (g > 0 && self.window % g != 0) {
            return config_err!(
                "window ({}) must be a multiple of group_quant_size ({g}, 1..={})",
                self.window,
                crate::config::MAX_GROUP_SIZE
            );
        }
        if g == 0 && self.groups().is_empty() {
            return config_err!(
                "window ({}) is a multiple of none of the group sizes {GROUP_SIZES:?}; give \
                 --group-quant-size",
                self.window
            );
        }
        if self.context == 0 {
            return config_err!("context must be >= 1");
        }
        if self.sinks + 1 >= tokens {
            return config_err!(
                "the capture has {tokens} tokens: nothing left to measure after {} sinks",
                self.sinks
            );
        }
        Ok(())
    }

    /// These options at each group size to try.
    pub(crate) fn per_group(&self) -> Vec<PlannerOptions> {
        self.groups()
            .into_iter()
            .map(|g| PlannerOptions {
                group_quant_size: g,
                ..*self
            })
            .collect()
    }

    /// The group sizes to try.
    pub fn groups(&self) -> Vec<usize> {
        match self.group_quant_size {
            0 => GROUP_SIZES
                .into_iter()
                .filter(|g| self.window % g == 0)
                .collect(),
            g => vec![g],
        }
    }

    fn quantized_tokens(&self) -> usize {
        let body = self.context.saturating_sub(self.sinks);
        body.saturating_sub(self.window) / self.group_quant_size * self.group_quant_size
    }

    pub(crate) fn candidate_bytes(&self, e: &TensorPlan, rows: usize, dim: usize) -> u64 {
        let spec = e.spec(self.group_quant_size, ParamsPrecision::F16);
        let q = self.quantized_tokens();
        (reference_bytes(e.role(), q, dim, &spec, e.residual_bits).compressed * rows) as u64
    }
}

/// Σ x² of a tensor.
fn energy(x: &[f32]) -> f64 {
    x.iter().map(|&v| (v as f64) * (v as f64)).sum()
}

/// Measures and chooses for each group size ([`PlannerOptions::groups`]) and keeps the plan
/// with the least error within the target.
pub async fn plan(
    ctx: &GpuContext,
    kv: &KvFile,
    weights: Option<&KeyWeights>,
    opts: &PlannerOptions,
) -> Result<Planned> {
    opts.validate(kv.shape.tokens())?;
    let mut best = BestPlan::default();
    for o in opts.per_group() {
        best.consider(&measure(ctx, kv, weights, &o).await?, &o);
    }
    best.into_result()
}

/// The plan with the least error over group sizes, or the last reason none fitted.
#[derive(Default)]
pub(crate) struct BestPlan {
    best: Option<Planned>,
    last_err: Option<XqError>,
}

impl BestPlan {
    /// Chooses from `m` (measured at `o`'s group size) and keeps it if it is the best yet.
    pub(crate) fn consider(&mut self, m: &Measured, o: &PlannerOptions) {
        match choose(m, o) {
            Ok(p) if self.best.as_ref().is_none_or(|b| p.error < b.error) => self.best = Some(p),
            Ok(_) => {}
            Err(e) => self.last_err = Some(e),
        }
    }

    pub(crate) fn into_result(self) -> Result<Planned> {
        let last_err = self.last_err;
        self.best.ok_or_else(|| {
            last_err.unwrap_or_else(|| XqError::Config("no group size to try".into()))
        })
    }
}

/// Measures every candidate of every layer's keys and values on the GPU (one group size:
/// `opts.group_quant_size` must be set).
pub async fn measure(
    ctx: &GpuContext,
    kv: &KvFile,
    weights: Option<&KeyWeights>,
    opts: &PlannerOptions,
) -> Result<Measured> {
    let (b, h, n, d) = {
        let s = kv.shape.dims();
        (s[0], s[1], s[2], s[3])
    };
    opts.validate(n)?;
    if opts.group_quant_size == 0 {
        return config_err!("measure needs one group size");
    }
    let rows = b * h;
    let dims = [b, h, n - opts.sinks, d];
    let owns = own_candidates();
    let mut layers: Vec<[Vec<Candidate>; 2]> = vec![Default::default(); kv.layers.len()];
    for (ki, kind) in [KvKind::Key, KvKind::Value].into_iter().enumerate() {
        // The previous layer's codes by (bits, axis): what a borrowed entry decodes.
        let mut prev: Vec<(u8, ValueAxis, PackedCodes)> = Vec::new();
        for (l, slot) in layers.iter_mut().enumerate() {
            let data = kv.tokens(l, kind, opts.sinks, n);
            let x = ctx.upload(&data, &dims, DType::F32, ParamsPrecision::F16)?;
            let Candidates {
                recons,
                entries,
                codes_now,
                ..
            } = ctx
                .run("planner candidates", |enc| {
                    encode_candidates(ctx, enc, &x, &owns, &prev, l, opts.group_quant_size)
                })
                .await?;
            let w = weights
                .filter(|_| kind == KvKind::Key)
                .map(|w| w.0[l].as_slice());
            let errs = errors(ctx, &x, &data, &recons, w).await?;
            slot[ki] = entries
                .iter()
                .zip(errs)
                .map(|(e, error)| Candidate {
                    entry: *e,
                    error,
                    bytes: opts.candidate_bytes(e, rows, d),
                })
                .collect();
            prev = codes_now;
        }
    }
    Ok(Measured {
        layers,
        rows,
        dim: d,
    })
}

/// A layer's candidates recorded in one submission: their reconstructions, their entries,
/// the own codes a next layer may borrow (by bits and axis), and everything else the
/// submission reads, kept until it is done.
struct Candidates {
    recons: Vec<GpuTensor>,
    entries: Vec<TensorPlan>,
    codes_now: Vec<(u8, ValueAxis, PackedCodes)>,
    _read: (Vec<QuantizedTensor>, Vec<ReuseEncodingGpu>),
}

/// Records every candidate of layer `l` (data `x`): each own entry of `owns` quantized and
/// dequantized, and each of `prev`'s codes (the previous layer's) fitted at every residual
/// width and reconstructed. One submission for all of them: each submission waits for its
/// error scopes, in a browser a round trip to the GPU process (in Chromium on SwiftShader,
/// with its pipelines built, a 6-token capture of SmolLM2 was planned in 10.1 s with a
/// submission per kernel, 7.3 s with one per layer).
fn encode_candidates(
    ctx: &GpuContext,
    enc: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    owns: &[TensorPlan],
    prev: &[(u8, ValueAxis, PackedCodes)],
    l: usize,
    group_quant_size: usize,
) -> Result<Candidates> {
    let mut c = Candidates {
        recons: Vec::new(),
        entries: Vec::new(),
        codes_now: Vec::new(),
        _read: (Vec::new(), Vec::new()),
    };
    for e in owns {
        let spec = e.spec(group_quant_size, ParamsPrecision::F16);
        let q = ctx.encode_quantize(enc, x, &spec)?;
        let recon = ctx.empty_tensor(&q.codes.shape, DType::F32)?;
        ctx.encode_dequant_into(enc, &q.codes, &q.params, &recon)?;
        c.recons.push(recon);
        c.entries.push(*e);
        if e.eta == 0.0 {
            c.codes_now.push((e.bits, e.axis, q.codes.clone()));
        }
        c._read.0.push(q);
    }
    for (bits, axis, codes) in prev {
        for r in RESIDUALS {
            let e = TensorPlan {
                codes: CodeSource::Layer(l - 1),
                residual_bits: r,
                ..TensorPlan::own(*bits, *axis)
            };
            let spec = e.spec(group_quant_size, ParamsPrecision::F16);
            let fit = ctx.encode_reuse_fit(enc, x, codes, &spec, r, DType::F32)?;
            let recon = ctx.empty_tensor(&codes.shape, DType::F32)?;
            ctx.encode_reuse_reconstruct_into(enc, codes, &fit, &recon)?;
            c.recons.push(recon);
            c.entries.push(e);
            c._read.1.push(fit);
        }
    }
    Ok(c)
}

/// Whether `c` may follow `prev` (a borrowed entry needs the previous layer to own codes of
/// its width and axis).
fn follows(c: &TensorPlan, prev: &TensorPlan) -> bool {
    match c.codes {
        CodeSource::Own => true,
        CodeSource::Layer(_) => {
            prev.codes == CodeSource::Own && prev.bits == c.bits && prev.axis == c.axis
        }
    }
}

/// The chain of candidates (one index per layer) minimising `error + λ·bytes`.
fn best_chain(layers: &[&[Candidate]], lambda: f64) -> Vec<usize> {
    let cost = |c: &Candidate| c.error + lambda * c.bytes as f64;
    let mut value: Vec<Vec<f64>> = Vec::with_capacity(layers.len());
    let mut from: Vec<Vec<usize>> = Vec::with_capacity(layers.len());
    for (l, cands) in layers.iter().enumerate() {
        let mut v = Vec::with_capacity(cands.len());
        let mut f = Vec::with_capacity(cands.len());
        for c in cands.iter() {
            if l == 0 {
                let ok = c.entry.codes == CodeSource::Own;
                v.push(if ok { cost(c) } else { f64::INFINITY });
                f.push(0);
                continue;
            }
            let (mut best, mut arg) = (f64::INFINITY, 0);
            for (j, p) in layers[l - 1].iter().enumerate() {
                if follows(&c.entry, &p.entry) && value[l - 1][j] < best {
                    best = value[l - 1][j];
                    arg = j;
                }
            }
            v.push(best + cost(c));
            f.push(arg);
        }
        value.push(v);
        from.push(f);
    }
    let last = value.last().map_or(&[][..], |v| v.as_slice());
    let mut i = (0..last.len())
        .min_by(|&a, &b| last[a].total_cmp(&last[b]))
        .unwrap_or(0);
    let mut chain = vec![0; layers.len()];
    for l in (0..layers.len()).rev() {
        chain[l] = i;
        i = from[l][i];
    }
    chain
}

/// Picks the plan with the least measured error whose effective bits at the context meet
/// the target; an error when even the smallest plan does not.
pub fn choose(m: &Measured, opts: &PlannerOptions) -> Result<Planned> {
    let kinds: [Vec<&[Candidate]>; 2] =
        [0, 1].map(|k| m.layers.iter().map(|l| l[k].as_slice()).collect::<Vec<_>>());
    let plan_of = |chains: &[Vec<usize>; 2]| -> (CachePlan, f64) {
        let mut error = 0.0;
        let layers = (0..m.layers.len())
            .map(|l| {
                let mut pick = |k: usize| {
                    let c = &m.layers[l][k][chains[k][l]];
                    error += c.error;
                    c.entry
                };
                let key = pick(0);
                LayerPlan {
                    key,
                    value: pick(1),
                    attention_window: None,
                }
            })
            .collect();
        (
            CachePlan {
                name: format!("measured {:.2} bits", opts.target_bits),
                layers,
                window: opts.window,
                sinks: opts.sinks,
                group_quant_size: opts.group_quant_size,
                params: ParamsPrecision::F16,
                rotation_seed: DEFAULT_ROTATION_SEED,
            },
            error,
        )
    };
    let solve = |lambda: f64| {
        let chains = [best_chain(&kinds[0], lambda), best_chain(&kinds[1], lambda)];
        let (plan, error) = plan_of(&chains);
        let bytes = plan.bytes_at(opts.context, m.rows, m.dim);
        (plan, error, bytes)
    };
    let fits = |b: &PlanBytes| b.effective_bits() <= opts.target_bits + 1e-9;
    // λ large enough picks the fewest bytes; search the smallest λ that fits.
    let (mut lo, mut hi) = (0.0f64, 1e-12f64);
    let mut best = solve(hi);
    while !fits(&best.2) {
        if hi > 1e6 {
            return config_err!(
                "target {} bits is below the smallest plan: {:.3} bits at {} tokens (window {}, \
                 sinks {} in f16); lower the window or the sinks, or raise the target",
                opts.target_bits,
                best.2.effective_bits(),
                opts.context,
                opts.window,
                opts.sinks
            );
        }
        lo = hi;
        hi *= 4.0;
        best = solve(hi);
    }
    if fits(&solve(0.0).2) {
        best = solve(0.0);
    } else {
        for _ in 0..60 {
            let mid = 0.5 * (lo + hi);
            let s = solve(mid);
            if fits(&s.2) {
                hi = mid;
                best = s;
            } else {
                lo = mid;
            }
        }
    }
    let (plan, error, bytes) = best;
    plan.validate()
        .map_err(|e| XqError::Gpu(format!("planner built an invalid plan: {e}")))?;
    Ok(Planned { plan, error, bytes })
}

/// The planner's error of any plan over a capture (the same measure it minimises): the sum
/// over layers and K/V of the relative squared error over the tokens after the plan's sinks.
pub async fn plan_error(
    ctx: &GpuContext,
    kv: &KvFile,
    weights: Option<&KeyWeights>,
    plan: &CachePlan,
) -> Result<f64> {
    let (b, h, n, d) = {
        let s = kv.shape.dims();
        (s[0], s[1], s[2], s[3])
    };
    plan.check_layers(kv.layers.len())?;
    if plan.sinks + 1 >= n {
        return config_err!("the capture has {n} tokens, the plan {} sinks", plan.sinks);
    }
    let dims = [b, h, n - plan.sinks, d];
    let mut total = 0.0;
    for kind in [KvKind::Key, KvKind::Value] {
        let mut owned: Vec<Option<PackedCodes>> = vec![None; plan.layers.len()];
        for (l, lp) in plan.layers.iter().enumerate() {
            let e = lp.get(kind);
            let data = kv.tokens(l, kind, plan.sinks, n);
            let x = ctx.upload(&data, &dims, DType::F32, plan.params)?;
            // A rotated entry quantizes the rotated tokens; its reconstruction is rotated back.
            let rotation = plan
                .signs_layer(l, kind)
                .map(|source| RotationTarget::kv(dims, source, kind.index()));
            let stored = match &rotation {
                Some(target) => {
                    let mut r = data.clone();
                    rotate_tensor(&mut r, target, plan.rotation_seed, false)?;
                    ctx.upload(&r, &dims, DType::F32, plan.params)?
                }
                None => x.clone(),
            };
            let spec = e.spec(plan.group_quant_size, plan.params);
            let recon = match e.codes {
                CodeSource::Own => {
                    let q = ctx.quantize(&stored, &spec).await?;
                    let r = ctx.dequant(&q.codes, &q.params, DType::F32).await?;
                    owned[l] = Some(q.codes);
                    r
                }
                CodeSource::Layer(s) => {
                    let codes = owned[s].as_ref().ok_or_else(|| {
                        XqError::Config(format!("layers[{l}]: layer {s} does not own codes"))
                    })?;
                    let enc = ctx
                        .reuse_fit(&stored, codes, &spec, e.residual_bits, DType::F32)
                        .await?;
                    ctx.reuse_reconstruct(codes, &enc, DType::F32).await?
                }
            };
            if let Some(target) = &rotation {
                let seed = plan.rotation_seed;
                let unrotate = |enc: &mut wgpu::CommandEncoder| {
                    ctx.encode_rotate(enc, None, &recon, target, seed, true)
                };
                ctx.run("un-rotate", unrotate).await?;
            }
            let w = weights
                .filter(|_| kind == KvKind::Key)
                .map(|w| w.0[l].as_slice());
            total += errors(ctx, &x, &data, std::slice::from_ref(&recon), w).await?[0];
        }
    }
    Ok(total)
}

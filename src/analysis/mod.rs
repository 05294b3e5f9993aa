//! `xquant analyze`: run the primitives on a model's K/V layer by layer, with each layer's
//! pairing role, and report reconstruction error, cross-layer similarity and bits; with
//! `--prefill`, also replay the K/V through a cache set ([`cache_replay`]); `xquant attend`
//! attends queries over such a replayed set ([`attend`]).

pub mod attend;
pub mod cache_replay;
pub mod plan_by_attention;
pub mod planner;

pub use attend::{attend_replay, AttendLayer};
pub use cache_replay::{fill, replay, CacheLayerReport, CacheReplay};

use serde_json::{json, Value};

use std::collections::HashMap;

use crate::cache::{CacheConfig, CachePlan, CodeSource};
use crate::config::ParamsPrecision;
use crate::config::{DType, KvKind, XQuantConfig};
use crate::error::{Result, XqError};
use crate::gpu::{GpuContext, GpuTensor, QuantizedTensor, SimilarityMatrix};
use crate::kvfile::KvFile;
use crate::reference::{reference_bytes, Role};

/// Findings for one tensor (a layer's keys or values).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorStats {
    /// MSE of what the layer reconstructs (anchor: own codes; reuse: anchor codes + own
    /// params + residual).
    pub recon_mse: f64,
    /// Reuse layers: MSE without the residual.
    pub recon_mse_no_residual: Option<f64>,
    /// Reuse layers: mean cosine of the raw tensor with its anchor's raw tensor.
    pub cosine_to_anchor: Option<f64>,
    /// Reuse layers: MSE between the raw tensor and its anchor's.
    pub mse_to_anchor: Option<f64>,
    /// Reference accounting: `16 · compressed / fp16` bytes.
    pub effective_bits: f64,
    /// Reference-accounted bytes over all batch × heads.
    pub compressed_bytes: usize,
    /// Bytes the GPU buffers of this tensor's encoding really take.
    pub allocated_bytes: u64,
}

impl TensorStats {
    fn to_json(&self) -> Value {
        json!({
            "recon_mse": self.recon_mse,
            "recon_mse_no_residual": self.recon_mse_no_residual,
            "cosine_to_anchor": self.cosine_to_anchor,
            "mse_to_anchor": self.mse_to_anchor,
            "effective_bits": self.effective_bits,
            "compressed_bytes": self.compressed_bytes,
            "allocated_bytes": self.allocated_bytes,
        })
    }
}

/// One layer's role and findings.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerReport {
    /// Layer index.
    pub layer: usize,
    /// Anchor or reuse.
    pub role: Role,
    /// Group id.
    pub group: usize,
    /// Keys.
    pub key: TensorStats,
    /// Values.
    pub value: TensorStats,
}

/// The whole analysis.
#[derive(Clone, Debug)]
pub struct AnalysisReport {
    /// Options used, when the plan came from them.
    pub config: Option<XQuantConfig>,
    /// The plan analysed.
    pub plan: CachePlan,
    /// Adapter the kernels ran on.
    pub adapter: String,
    /// `[B, H, S, D]`.
    pub shape: Vec<usize>,
    /// dtype of reconstructions (f16 like the reference, f32 when values exceed f16).
    pub recon_dtype: DType,
    /// Per layer.
    pub layers: Vec<LayerReport>,
    /// fp16 bytes of all K and V.
    pub fp16_bytes: usize,
    /// The cache replay (`--prefill`), when asked for.
    pub cache: Option<CacheReplay>,
}

impl AnalysisReport {
    fn tensors(&self) -> impl Iterator<Item = &TensorStats> {
        self.layers.iter().flat_map(|l| [&l.key, &l.value])
    }

    /// Reference-accounted bytes of all K and V.
    pub fn compressed_bytes(&self) -> usize {
        self.tensors().map(|t| t.compressed_bytes).sum()
    }

    /// GPU bytes of all encodings.
    pub fn allocated_bytes(&self) -> u64 {
        self.tensors().map(|t| t.allocated_bytes).sum()
    }

    /// Mean effective bits over keys, values, or both.
    pub fn mean_bits(&self, kind: Option<KvKind>) -> f64 {
        let pick: Vec<f64> = self
            .layers
            .iter()
            .flat_map(|l| match kind {
                Some(KvKind::Key) => vec![l.key.effective_bits],
                Some(KvKind::Value) => vec![l.value.effective_bits],
                None => vec![l.key.effective_bits, l.value.effective_bits],
            })
            .collect();
        pick.iter().sum::<f64>() / pick.len().max(1) as f64
    }

    /// The `--json` object (schema in docs/cli.md).
    pub fn to_json(&self) -> Value {
        let dtype = match self.recon_dtype {
            DType::F16 => "f16",
            DType::F32 => "f32",
        };
        let mut config = match &self.config {
            Some(c) => c.to_json(),
            None => json!({"plan": self.plan.name}),
        };
        config["recon_dtype"] = json!(dtype);
        let mut out = json!({
            "config": config,
            "adapter": self.adapter,
            "shape": self.shape,
            "plan": self.plan.to_json(),
            "layers": self.layers.iter().map(|l| json!({
                "layer": l.layer,
                "role": l.role.name(),
                "group": l.group,
                "key": l.key.to_json(),
                "value": l.value.to_json(),
            })).collect::<Vec<_>>(),
            "totals": {
                "effective_bits": self.mean_bits(None),
                "key_effective_bits": self.mean_bits(Some(KvKind::Key)),
                "value_effective_bits": self.mean_bits(Some(KvKind::Value)),
                "compressed_bytes": self.compressed_bytes(),
                "fp16_bytes": self.fp16_bytes,
                "ratio_vs_fp16": self.compressed_bytes() as f64 / self.fp16_bytes as f64,
                "allocated_bytes": self.allocated_bytes(),
            },
        });
        if let Some(c) = &self.cache {
            for (i, l) in out["layers"]
                .as_array_mut()
                .into_iter()
                .flatten()
                .enumerate()
            {
                l["cache"] = c.layer_json(i);
            }
            out["totals"]["cache"] = c.totals_json();
            out["config"]["prefill"] = json!(c.prefill);
            out["config"]["window"] = json!(c.plan.window);
            out["config"]["sinks"] = json!(c.plan.sinks);
            out["config"]["decode_policy"] = json!(c.options.decode_policy.name());
        }
        out
    }

    /// A human-readable table.
    pub fn to_table(&self) -> String {
        let opt = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
        let mut s = format!(
            "adapter: {}\nshape [B, H, S, D] = {:?}; {}\n\n",
            self.adapter,
            self.shape,
            match &self.config {
                Some(c) => format!("config {}", c.to_json()),
                None => format!("plan `{}`", self.plan.name),
            }
        );
        s += &format!(
            "{:>5} {:>6} {:>5} | {:>10} {:>10} {:>7} {:>5} | {:>10} {:>10} {:>7} {:>5}\n",
            "layer",
            "role",
            "group",
            "K mse",
            "K no-res",
            "K cos",
            "K b",
            "V mse",
            "V no-res",
            "V cos",
            "V b"
        );
        for l in &self.layers {
            s += &format!(
                "{:>5} {:>6} {:>5} | {:>10.3e} {:>10} {:>7} {:>5.2} | {:>10.3e} {:>10} {:>7} {:>5.2}\n",
                l.layer,
                l.role.name(),
                l.group,
                l.key.recon_mse,
                l.key.recon_mse_no_residual.map_or("-".into(), |v| format!("{v:.3e}")),
                opt(l.key.cosine_to_anchor, 3),
                l.key.effective_bits,
                l.value.recon_mse,
                l.value.recon_mse_no_residual.map_or("-".into(), |v| format!("{v:.3e}")),
                opt(l.value.cosine_to_anchor, 3),
                l.value.effective_bits,
            );
        }
        s += &format!(
            "\nmean effective bits: {:.3} (K {:.3}, V {:.3}); accounted {} B vs fp16 {} B ({:.1}%); \
             GPU allocated {} B\n",
            self.mean_bits(None),
            self.mean_bits(Some(KvKind::Key)),
            self.mean_bits(Some(KvKind::Value)),
            self.compressed_bytes(),
            self.fp16_bytes,
            100.0 * self.compressed_bytes() as f64 / self.fp16_bytes as f64,
            self.allocated_bytes()
        );
        if let Some(c) = &self.cache {
            s += &format!(
                "\ncache replay: prefill {}, then one token at a time; {} policy, window {}\n",
                c.prefill,
                c.options.decode_policy.name(),
                c.plan.window
            );
            s += &format!(
                "{:>5} | {:>10} {:>10} {:>6} {:>10} {:>10}\n",
                "layer", "K mse", "V mse", "bits", "accounted", "allocated"
            );
            for (i, l) in c.layers.iter().enumerate() {
                s += &format!(
                    "{:>5} | {:>10.3e} {:>10.3e} {:>6.2} {:>10} {:>10}\n",
                    i,
                    l.recon_mse_key,
                    l.recon_mse_value,
                    l.effective_bits,
                    l.accounted_bytes,
                    l.allocated_bytes
                );
            }
            let st = &c.stats;
            s += &format!(
                "cache: {:.3} effective bits; accounted {} B, allocated {} B, fp16 {} B ({:.1}% of fp16)\n",
                st.effective_bits,
                st.accounted_bytes,
                st.allocated_bytes,
                st.fp16_bytes,
                100.0 * st.ratio_vs_fp16
            );
        }
        s
    }
}

/// The L × L similarity of a K/V file's keys and of its values.
#[derive(Clone, Debug)]
pub struct KvSimilarity {
    pub key: SimilarityMatrix,
    pub value: SimilarityMatrix,
}

/// Cross-layer similarity (MSE, mean cosine) of every pair of layers, keys and values apart
/// (`xquant similarity`, the package's `kvSimilarity`).
pub async fn kv_similarity(ctx: &GpuContext, kv: &KvFile) -> Result<KvSimilarity> {
    let mut matrices = Vec::with_capacity(2);
    for kind in [KvKind::Key, KvKind::Value] {
        let tensors = (0..kv.layers.len())
            .map(|l| {
                let x = kv.tensor(l, kind);
                ctx.upload(
                    x,
                    kv.shape.dims(),
                    kv.dtype.gpu_dtype(),
                    ParamsPrecision::F32,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        matrices.push(ctx.similarity_matrix(&tensors).await?);
    }
    let value = matrices.pop().expect("two matrices");
    let key = matrices.pop().expect("two matrices");
    Ok(KvSimilarity { key, value })
}

/// Analyses every layer's keys or values as `plan` says, layers in order; a layer that owns
/// codes keeps them while a later layer borrows them.
async fn analyze_kind(
    ctx: &GpuContext,
    kv: &KvFile,
    plan: &CachePlan,
    kind: KvKind,
    recon_dtype: DType,
) -> Result<Vec<TensorStats>> {
    let dims = kv.shape.dims();
    let (rows, tokens, dim) = (kv.shape.rows(), kv.shape.tokens(), kv.shape.dim());
    let upload = |l: usize| ctx.upload(kv.tensor(l, kind), dims, kv.dtype.gpu_dtype(), plan.params);
    let mut owners: HashMap<usize, (GpuTensor, QuantizedTensor)> = HashMap::new();
    let mut stats = Vec::with_capacity(plan.layers.len());
    for (l, lp) in plan.layers.iter().enumerate() {
        let e = lp.get(kind);
        let spec = e.spec(plan.group_quant_size, plan.params);
        let acct = reference_bytes(e.role(), tokens, dim, &spec, e.residual_bits);
        let x = upload(l)?;
        let CodeSource::Layer(src) = e.codes else {
            let own = ctx.quantize(&x, &spec).await?;
            let recon = ctx.dequant(&own.codes, &own.params, recon_dtype).await?;
            let sim = ctx.similarities(&[&x, &recon], &[(0, 1)]).await?;
            stats.push(TensorStats {
                recon_mse: sim[0].mse,
                recon_mse_no_residual: None,
                cosine_to_anchor: None,
                mse_to_anchor: None,
                effective_bits: acct.effective_bits(),
                compressed_bytes: acct.compressed * rows,
                allocated_bytes: own.allocated_bytes(),
            });
            if plan.readers(l, kind) > 0 {
                owners.insert(l, (x, own));
            }
            continue;
        };
        let Some((anchor_x, anchor)) = owners.get(&src) else {
            return Err(XqError::Config(format!(
                "layers[{l}]: layer {src} does not own codes"
            )));
        };
        let enc = ctx
            .reuse_fit(&x, &anchor.codes, &spec, e.residual_bits, recon_dtype)
            .await?;
        let full = ctx
            .reuse_reconstruct(&anchor.codes, &enc, recon_dtype)
            .await?;
        let bare: Option<GpuTensor> = match e.residual_bits {
            0 => None,
            _ => Some(ctx.dequant(&anchor.codes, &enc.params, recon_dtype).await?),
        };
        let mut tensors = vec![&x, &full, anchor_x];
        tensors.extend(bare.as_ref());
        let mut pairs = vec![(0, 1), (0, 2)];
        if bare.is_some() {
            pairs.push((0, 3));
        }
        let sim = ctx.similarities(&tensors, &pairs).await?;
        stats.push(TensorStats {
            recon_mse: sim[0].mse,
            recon_mse_no_residual: Some(sim.get(2).unwrap_or(&sim[0]).mse),
            cosine_to_anchor: Some(sim[1].cosine),
            mse_to_anchor: Some(sim[1].mse),
            effective_bits: acct.effective_bits(),
            compressed_bytes: acct.compressed * rows,
            allocated_bytes: enc.allocated_bytes(),
        });
    }
    Ok(stats)
}

/// Runs the analysis of every layer of `kv` on the GPU with the reference's grouping.
pub async fn analyze(ctx: &GpuContext, kv: &KvFile, cfg: &XQuantConfig) -> Result<AnalysisReport> {
    cfg.validate()?;
    let config = CacheConfig {
        quant: *cfg,
        window: 0,
        ..Default::default()
    };
    let plan = config.plan(kv.layers.len(), kv.shape.dim())?;
    let mut report = analyze_plan(ctx, kv, &plan).await?;
    report.config = Some(*cfg);
    Ok(report)
}

/// Runs the analysis of every layer of `kv` on the GPU as `plan` says (its window and sinks
/// play no part: every token is quantized).
pub async fn analyze_plan(
    ctx: &GpuContext,
    kv: &KvFile,
    plan: &CachePlan,
) -> Result<AnalysisReport> {
    plan.validate()?;
    plan.check_layers(kv.layers.len())?;
    let recon_dtype = if kv.max_abs() > 60000.0 {
        DType::F32
    } else {
        DType::F16
    };
    let keys = analyze_kind(ctx, kv, plan, KvKind::Key, recon_dtype).await?;
    let values = analyze_kind(ctx, kv, plan, KvKind::Value, recon_dtype).await?;
    let roles = plan.key_roles();
    let layers = keys
        .into_iter()
        .zip(values)
        .enumerate()
        .map(|(layer, (key, value))| LayerReport {
            layer,
            role: roles[layer].role,
            group: roles[layer].group,
            key,
            value,
        })
        .collect();
    Ok(AnalysisReport {
        config: None,
        plan: plan.clone(),
        adapter: ctx.adapter().to_string(),
        shape: kv.shape.dims().to_vec(),
        recon_dtype,
        layers,
        fp16_bytes: 2 * kv.layers.len() * kv.shape.len() * 2,
        cache: None,
    })
}

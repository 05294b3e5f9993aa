//! `xquant plan` on a capture with queries: candidates judged by what the model feels, the
//! error of every layer's attention output ([`AttentionProbe`]), then chosen under the bit
//! target as the K/V planner chooses ([`choose`](super::planner::choose)).
//!
//! A layer's attention output depends on that layer's keys and values only, so one cache set
//! with the same candidate in every layer gives that candidate's error in every layer at
//! once. Keys and values are measured apart: a key candidate with near-exact values (8-bit
//! uniform codes) and a value candidate with near-exact keys, and a layer's error is taken as
//! the sum of the two. Candidates: own codes of 1–4 bits, Lloyd–Max levels per token on
//! rotated head vectors (where the group divides a power-of-two head dim), and uniform codes
//! per channel (keys, KIVI's) or per token (values) of 2–4 bits.

use std::sync::Arc;

use crate::analysis::attend::AttentionProbe;
use crate::analysis::planner::{BestPlan, Candidate, Measured, Planned, PlannerOptions};
use crate::cache::{CachePlan, LayerPlan, Rotation, TensorPlan, DEFAULT_ROTATION_SEED};
use crate::config::{KvKind, Levels, ParamsPrecision, ValueAxis};
use crate::error::{config_err, Result};
use crate::gpu::GpuContext;
use crate::kvfile::KvFile;

/// Near-exact entries for the side not being measured.
fn exact() -> TensorPlan {
    TensorPlan::own(8, ValueAxis::Channels)
}

/// The candidates for keys or values at group `g` for head dim `dim`.
fn candidates(kind: KvKind, g: usize, dim: usize) -> Vec<TensorPlan> {
    let mut v = Vec::new();
    if dim.is_power_of_two() && dim % g == 0 {
        for bits in 1..=4 {
            v.push(TensorPlan {
                rotation: Rotation::Hadamard,
                levels: Levels::LloydMax,
                ..TensorPlan::own(bits, ValueAxis::Channels)
            });
        }
    }
    let axis = match kind {
        KvKind::Key => ValueAxis::Tokens,
        KvKind::Value => ValueAxis::Channels,
    };
    for bits in 2..=4 {
        v.push(TensorPlan::own(bits, axis));
    }
    v
}

/// Fewest captured tokens the planner judges attention on.
pub const MIN_CAPTURE_TOKENS: usize = 64;

/// The f16 window the candidates are measured with: the plan's, unless the capture is too
/// short for it to leave two groups quantized, then none (every token after the sinks is
/// quantized, so every candidate shows its error; the choice still counts the plan's window).
fn probe_window(opts: &PlannerOptions, tokens: usize) -> usize {
    let g = opts.group_quant_size;
    match tokens >= opts.sinks + opts.window + 2 * g {
        true => opts.window,
        false => 0,
    }
}

/// The attention error of every candidate in every layer, for one group size.
pub async fn measure_attention(
    ctx: &Arc<GpuContext>,
    kv: &KvFile,
    probe: &AttentionProbe,
    opts: &PlannerOptions,
) -> Result<Measured> {
    let s = kv.shape.dims();
    let (rows, dim) = (s[0] * s[1], s[3]);
    let layers = kv.layers.len();
    opts.validate(s[2])?;
    let g = opts.group_quant_size;
    if g == 0 {
        return config_err!("measure_attention needs one group size");
    }
    let mut measured = Measured {
        layers: vec![Default::default(); layers],
        rows,
        dim,
    };
    for (ki, kind) in [KvKind::Key, KvKind::Value].into_iter().enumerate() {
        for entry in candidates(kind, g, dim) {
            let layer = match kind {
                KvKind::Key => LayerPlan {
                    key: entry,
                    value: exact(),
                    attention_window: None,
                },
                KvKind::Value => LayerPlan {
                    key: exact(),
                    value: entry,
                    attention_window: None,
                },
            };
            let plan = CachePlan {
                name: "candidate".into(),
                layers: vec![layer; layers],
                window: probe_window(opts, s[2]),
                sinks: opts.sinks,
                group_quant_size: g,
                params: ParamsPrecision::F16,
                rotation_seed: DEFAULT_ROTATION_SEED,
            };
            let errors = probe.errors(ctx, kv, &plan).await?;
            let bytes = opts.candidate_bytes(&entry, rows, dim);
            for (l, error) in errors.into_iter().enumerate() {
                measured.layers[l][ki].push(Candidate {
                    entry,
                    error,
                    bytes,
                });
            }
        }
    }
    Ok(measured)
}

/// The plan with the least attention error within the target, over the group sizes of
/// `opts` ([`PlannerOptions::groups`]).
pub async fn plan_by_attention(
    ctx: &Arc<GpuContext>,
    kv: &KvFile,
    probe: &AttentionProbe,
    opts: &PlannerOptions,
) -> Result<Planned> {
    let tokens = kv.shape.tokens();
    opts.validate(tokens)?;
    if tokens < MIN_CAPTURE_TOKENS {
        return config_err!(
            "the capture has {tokens} tokens: too few to judge attention by (at least \
             {MIN_CAPTURE_TOKENS}); capture a longer text"
        );
    }
    let mut best = BestPlan::default();
    for o in opts.per_group() {
        best.consider(&measure_attention(ctx, kv, probe, &o).await?, &o);
    }
    let mut planned = best.into_result()?;
    planned.plan.name = format!("attention-planned {:.2} bits", opts.target_bits);
    Ok(planned)
}

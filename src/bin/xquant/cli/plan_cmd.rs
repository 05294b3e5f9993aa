//! `xquant plan`: a per-layer plan chosen by measurement on a K/V capture.

use serde_json::json;
use xquant_wgpu::analysis::attend::{AttentionProbe, PROBE_QUERIES};
use xquant_wgpu::analysis::plan_by_attention::plan_by_attention;
use xquant_wgpu::analysis::planner::{plan as make_plan, plan_error, KeyWeights, PlannerOptions};
use xquant_wgpu::cache::{CachePlan, CodeSource, Rotation, TensorPlan, PRESETS};
use xquant_wgpu::kvfile::{read_tensors, KvFile};
use xquant_wgpu::{Levels, XqError};

use super::{gpu, print_json, usage, Args, CliResult};

fn describe(e: &TensorPlan) -> String {
    let source = match e.codes {
        CodeSource::Own => "own".to_string(),
        CodeSource::Layer(l) => format!("L{l}"),
    };
    let axis = &e.axis.name()[..1];
    let mut s = format!("{source} {}b {axis}", e.bits);
    if e.residual_bits > 0 {
        s += &format!(" r{}", e.residual_bits);
    }
    if e.eta > 0.0 {
        s += &format!(" η{:.3}", e.eta);
    }
    if e.rotation != Rotation::None {
        s += " rot";
    }
    if e.levels == Levels::LloydMax {
        s += " lloyd-max";
    }
    s
}

/// A plan named on the command line: a preset's name or a plan file.
fn named_plan(name: &str, layers: usize, head_dim: usize) -> CliResult<CachePlan> {
    if PRESETS.contains(&name) {
        return Ok(CachePlan::preset_for(name, layers, head_dim)?);
    }
    super::read_plan_file(name)
}

pub(crate) fn cmd_plan(raw: &[String]) -> CliResult<()> {
    let a = Args::parse(
        raw,
        &[
            "target-bits",
            "context",
            "window",
            "sinks",
            "group-quant-size",
            "out",
            "score",
        ],
        &["json", "kv-error"],
    )?;
    let file = a.one_file("plan")?;
    let d = PlannerOptions::default();
    let opts = PlannerOptions {
        target_bits: a.get("target-bits", d.target_bits)?,
        context: a.get("context", d.context)?,
        window: a.get("window", d.window)?,
        sinks: a.get("sinks", d.sinks)?,
        group_quant_size: a.get("group-quant-size", d.group_quant_size)?,
    };
    let bytes = std::fs::read(&file)
        .map_err(|e| XqError::Io(format!("cannot read {}: {e}", file.display())))?;
    let kv = KvFile::from_bytes(&bytes)?;
    let tensors = read_tensors(&bytes)?;
    drop(bytes);
    let weights = |sinks| KeyWeights::from_tensors(&tensors, &kv, sinks);
    let ctx = std::sync::Arc::new(gpu()?);
    if let Some(list) = a.options.get("score") {
        // The planner's error of given plans (to compare with their measured quality), and
        // with captured queries their attention-output error.
        let probe = match tensors.contains_key("q.0") {
            true => Some(AttentionProbe::new(&kv, &tensors, PROBE_QUERIES)?),
            false => None,
        };
        let mut rows = Vec::new();
        for name in list.split(',') {
            let plan = named_plan(name, kv.layers.len(), kv.shape.dim())?;
            let w = weights(plan.sinks)?;
            let error = pollster::block_on(plan_error(&ctx, &kv, w.as_ref(), &plan))?;
            let attention = match &probe {
                Some(p) => Some(
                    pollster::block_on(p.errors(&ctx, &kv, &plan))?
                        .iter()
                        .sum::<f64>(),
                ),
                None => None,
            };
            let s = kv.shape.dims();
            let bits = plan.bytes_at(opts.context, s[0] * s[1], s[3]);
            rows.push(
                json!({"plan": name, "error": error, "attention_error": attention,
                "effective_bits": bits.effective_bits(), "quantized_bits": bits.quantized_bits()}),
            );
            if !a.flag("json") {
                let attn = attention.map_or(String::new(), |e| format!(", attention error {e:.5}"));
                println!(
                    "{name}: error {error:.4}{attn}, {:.3} effective bits at {} tokens ({:.3} \
                     quantized)",
                    bits.effective_bits(),
                    opts.context,
                    bits.quantized_bits()
                );
            }
        }
        if a.flag("json") {
            print_json(&json!({"context": opts.context, "scores": rows}));
        }
        return Ok(());
    }
    if a.options.contains_key("target-bits") && opts.target_bits <= 0.0 {
        return usage("--target-bits must be > 0");
    }
    let w = weights(opts.sinks)?;
    // With queries: candidates judged by the attention output they give; without, by their
    // K/V error, which predicts the model's loss poorly (docs/quality.md).
    let by_attention = tensors.contains_key("q.0");
    let planned = match by_attention {
        true => {
            let probe = AttentionProbe::new(&kv, &tensors, PROBE_QUERIES)?;
            pollster::block_on(plan_by_attention(&ctx, &kv, &probe, &opts))?
        }
        false if a.flag("kv-error") => pollster::block_on(make_plan(&ctx, &kv, w.as_ref(), &opts))?,
        false => {
            return usage(
                "the capture has no queries (q.{i}), which the planner needs to judge a plan by \
                 the attention it gives: capture with `xquant capture --queries`, or pass \
                 --kv-error to plan by the K/V error alone (it ranks plans poorly against \
                 perplexity and can choose plans that collapse the model)",
            )
        }
    };
    let plan = &planned.plan;
    if let Some(out) = a.options.get("out") {
        let text = serde_json::to_string_pretty(&plan.to_json()).unwrap_or_default();
        std::fs::write(out, text + "\n")
            .map_err(|e| XqError::Io(format!("cannot write {out}: {e}")))?;
    }
    if a.flag("json") {
        print_json(&json!({
            "adapter": ctx.adapter().to_string(),
            "target_bits": opts.target_bits,
            "context": opts.context,
            "effective_bits": planned.bytes.effective_bits(),
            "quantized_bits": planned.bytes.quantized_bits(),
            "kv_bytes": planned.bytes.total,
            "error": planned.error,
            "key_error": if w.is_some() { "logit (captured queries)" } else { "relative" },
            "error_kind": if by_attention { "attention output" } else { "K/V" },
            "plan": plan.to_json(),
        }));
        return Ok(());
    }
    println!(
        "plan for {} at {} tokens: {:.3} effective bits (target {}), {:.3} bits per quantized \
         element; window {}, sinks {}, groups of {}; measured error {:.4} ({})",
        file.display(),
        opts.context,
        planned.bytes.effective_bits(),
        opts.target_bits,
        planned.bytes.quantized_bits(),
        plan.window,
        plan.sinks,
        plan.group_quant_size,
        planned.error,
        if by_attention {
            "attention output error under the captured queries"
        } else {
            "K/V error: keys' relative error, no queries in the file"
        }
    );
    println!("| layer | keys | values |");
    println!("|---:|---|---|");
    for (i, l) in plan.layers.iter().enumerate() {
        println!("| {i} | {} | {} |", describe(&l.key), describe(&l.value));
    }
    Ok(())
}

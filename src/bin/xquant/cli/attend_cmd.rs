//! `xquant attend`: the fused attention over a replayed cache set, for checking against
//! other implementations.

use std::sync::Arc;

use serde_json::json;
use xquant_wgpu::analysis::attend_replay;
use xquant_wgpu::config::DType;
use xquant_wgpu::kvfile::{read_tensors, tensors_to_bytes, KvFile, Tensor};
use xquant_wgpu::XqError;

use super::{gpu, plan_arg, print_json, replay_plan, usage, Args, CliResult, XQUANT_OPTIONS};

pub(crate) fn cmd_attend(raw: &[String]) -> CliResult<()> {
    let mut options = XQUANT_OPTIONS.to_vec();
    options.extend(super::PLAN_OPTIONS);
    options.extend(["queries", "prefill", "out", "window", "decode-policy"]);
    let a = Args::parse(raw, &options, &["dense", "json"])?;
    let file = a.one_file("attend")?;
    let (Some(q_path), Some(out), Some(_)) = (
        a.options.get("queries"),
        a.options.get("out"),
        a.options.get("prefill"),
    ) else {
        return usage(
            "attend needs --queries Q.safetensors, --prefill N and --out OUT.safetensors",
        );
    };
    let arg = plan_arg(&a, super::reference_defaults())?;
    let prefill: usize = a.get("prefill", 0)?;
    let kv = KvFile::read(&file)?;
    let (plan, mut options) = replay_plan(&a, &arg, kv.layers.len(), kv.shape.dim())?;
    // Keys and values are held as f16, and reconstructed as the reference does (fp16), unless
    // the file's values exceed f16's range.
    options.output = if kv.max_abs() > 60000.0 {
        DType::F32
    } else {
        DType::F16
    };
    let bytes =
        std::fs::read(q_path).map_err(|e| XqError::Io(format!("cannot read {q_path}: {e}")))?;
    let queries = read_tensors(&bytes).map_err(|e| match e {
        XqError::Io(m) => XqError::Io(format!("{q_path}: {m}")),
        other => other,
    })?;
    let ctx = Arc::new(gpu()?);
    let dense = a.flag("dense");
    let layers = pollster::block_on(attend_replay(
        &ctx,
        &kv,
        &queries,
        &plan,
        options,
        prefill,
        dense || a.flag("json"),
    ))?;
    let written: Vec<(String, &Tensor)> = layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let t = match (dense, &l.dense) {
                (true, Some(d)) => d,
                _ => &l.fused,
            };
            (format!("attn.{i}"), t)
        })
        .collect();
    std::fs::write(out, tensors_to_bytes(&written))
        .map_err(|e| XqError::Io(format!("cannot write {out}: {e}")))?;
    if a.flag("json") {
        print_json(&json!({
            "adapter": ctx.adapter().to_string(),
            "config": match &arg {
                super::PlanArg::Options(c) => c.quant.to_json(),
                _ => json!({"plan": plan.name}),
            },
            "plan": plan.to_json(),
            "prefill": prefill,
            "window": plan.window,
            "sinks": plan.sinks,
            "decode_policy": options.decode_policy.name(),
            "output": if dense { "dense" } else { "fused" },
            "out": out,
            "layers": layers.iter().enumerate().map(|(i, l)| l.to_json(i)).collect::<Vec<_>>(),
        }));
    } else {
        for (i, l) in layers.iter().enumerate() {
            let diff = l
                .max_abs_diff()
                .map_or(String::new(), |d| format!(", max |fused - dense| {d:.2e}"));
            println!(
                "layer {i}: {} tokens ({} quantized, {} in the window), queries {:?}{diff}",
                l.tokens,
                l.quantized,
                l.tokens - l.quantized,
                l.fused.shape
            );
        }
        println!("wrote {out}");
    }
    Ok(())
}

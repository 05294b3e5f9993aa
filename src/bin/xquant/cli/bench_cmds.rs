//! `xquant bench` and `bench-cache`: kernel throughput and cache decode steps, each against
//! its baseline on the same device in the same run.

use std::sync::Arc;

use serde_json::json;
use xquant_wgpu::cache::{
    bench_cache, max_tokens, CacheBench, CacheConfig, CacheOptions, FirstStep, ModelSpec, StepPart,
};
use xquant_wgpu::gpu::{bench_cpu_reference, BenchProblem, GpuContext, KernelTime, KernelTiming};
use xquant_wgpu::{DType, QuantSpec};

use super::{
    choice, gpu, plan_arg, print_json, resolve_plan, usage, Args, CliError, CliResult,
    XQUANT_OPTIONS,
};

/// A comma-separated list of counts for option `--name`.
pub(crate) fn parse_list(name: &str, s: &str) -> CliResult<Vec<usize>> {
    s.split(',')
        .map(|d| {
            d.trim().parse().map_err(|_| {
                CliError::Usage(format!("--{name}: `{s}` is not a list like 1,8,4096,128"))
            })
        })
        .collect()
}

pub(crate) fn cmd_bench(raw: &[String]) -> CliResult<()> {
    let a = Args::parse(
        raw,
        &[
            "dims",
            "dtype",
            "bits",
            "group-quant-size",
            "residual-bits",
            "iters",
            "cpu-iters",
        ],
        &["json"],
    )?;
    a.no_positional("bench")?;
    let dims = parse_list("dims", &a.get("dims", "1,8,4096,128".to_string())?)?;
    let dtype = DType::parse(&a.get("dtype", "f16".to_string())?)?;
    let spec = QuantSpec::new(a.get("bits", 2)?, a.get("group-quant-size", 32)?);
    spec.validate()?;
    let residual_bits: u8 = a.get("residual-bits", 4)?;
    xquant_wgpu::config::validate_bits("residual-bits", residual_bits)?;
    let iters: usize = a.get("iters", 20)?;
    let cpu_iters: usize = a.get("cpu-iters", 2)?;
    if iters == 0 {
        return usage("--iters must be at least 1");
    }
    let ctx = gpu()?;
    let problem = BenchProblem {
        dims: dims.clone(),
        dtype,
        spec,
        residual_bits,
    };
    let gpu = ctx.bench_kernels(&problem, iters)?;
    let cpu = bench_cpu_reference(&problem, cpu_iters)?;
    let rows: Vec<serde_json::Value> = gpu
        .iter()
        .zip(&cpu)
        .map(|(g, c): (&KernelTiming, &KernelTiming)| {
            json!({"kernel": g.kernel.name(), "ms": g.seconds * 1e3, "gbps": g.gbps(),
                   "vs_copy": g.vs_copy, "cpu_gbps": c.gbps(), "vs_cpu": c.seconds / g.seconds})
        })
        .collect();
    let date = today();
    if a.flag("json") {
        print_json(
            &json!({"adapter": ctx.adapter().to_string(), "date": date, "dims": dims,
            "dtype": format!("{dtype:?}").to_lowercase(), "bits": spec.bits, "group_quant_size": spec.group_size,
            "residual_bits": residual_bits, "iters": iters, "kernels": rows}),
        );
        return Ok(());
    }
    println!("adapter: {} ({date})", ctx.adapter());
    println!(
        "{dims:?} {dtype:?}, {} bits, group {}, residual {residual_bits} bits; GB/s of the {:.1} MiB tensor per call\n",
        spec.bits, spec.group_size, gpu[0].tensor_bytes as f64 / (1 << 20) as f64
    );
    println!("| kernel | ms / call | GB/s | × copy | CPU ref GB/s | GPU / CPU |");
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.3} | {:.2} | {:.2} | {:.3} | {:.1}× |",
            r["kernel"].as_str().unwrap_or(""),
            r["ms"].as_f64().unwrap_or(0.0),
            r["gbps"].as_f64().unwrap_or(0.0),
            r["vs_copy"].as_f64().unwrap_or(0.0),
            r["cpu_gbps"].as_f64().unwrap_or(0.0),
            r["vs_cpu"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(())
}

/// A profile as JSON: `[{kernel, launches, us}]` per step, longest first.
pub(crate) fn profile_json(times: &[KernelTime]) -> serde_json::Value {
    json!(times
        .iter()
        .map(|t| json!({"kernel": t.kernel, "launches": t.launches, "us": t.micros}))
        .collect::<Vec<_>>())
}

/// A profile as one line: `kernel ×launches µs, ...` and the sum.
pub(crate) fn profile_line(times: &[KernelTime]) -> String {
    let total: f64 = times.iter().map(|t| t.micros).sum();
    let parts: Vec<String> = times
        .iter()
        .map(|t| format!("{} x{} {:.0} us", t.kernel, t.launches, t.micros))
        .collect();
    format!("{total:.0} us of GPU time: {}", parts.join(", "))
}

/// Prints the XQuant and f16 profiles of what `label` names (`256 tokens`), if there are any.
pub(crate) fn print_profiles(label: &str, profile: Option<&[Vec<KernelTime>; 2]>) {
    if let Some([xq, f16]) = profile {
        println!("\n{label}, XQuant: {}", profile_line(xq));
        println!("{label}, f16: {}", profile_line(f16));
    }
}

pub(crate) fn cmd_bench_cache(raw: &[String]) -> CliResult<()> {
    let mut options = XQUANT_OPTIONS.to_vec();
    options.extend(super::PLAN_OPTIONS);
    options.extend([
        "contexts", "steps", "prefill", "layers", "kv-heads", "q-heads", "head-dim", "window",
        "memory", "part",
    ]);
    let a = Args::parse(raw, &options, &["json", "dense", "profile"])?;
    a.no_positional("bench-cache")?;
    let contexts = parse_list(
        "contexts",
        &a.get("contexts", "1024,4096,8192,16384".to_string())?,
    )?;
    let memory = parse_list(
        "memory",
        &a.get("memory", "16,64,256,1024,4096,16384".to_string())?,
    )?;
    let steps: usize = a.get("steps", 5)?;
    let prefill: usize = a.get("prefill", 4096)?;
    let part = choice(
        "--part",
        &a.get("part", StepPart::Whole.name().to_string())?,
        &StepPart::ALL.map(|p| (p.name(), p)),
    )?;
    let model = ModelSpec {
        layers: a.get("layers", 30)?,
        kv_heads: a.get("kv-heads", 3)?,
        head_dim: a.get("head-dim", 64)?,
        batch: 1,
    };
    let q_heads: usize = a.get("q-heads", 3 * model.kv_heads)?;
    let longest = contexts
        .iter()
        .chain(&memory)
        .copied()
        .max()
        .unwrap_or(0)
        .max(prefill);
    model.validate()?;
    let plan = resolve_plan(
        &a,
        &plan_arg(&a, CacheConfig::default())?,
        model.layers,
        model.head_dim,
    )?;
    let cache_options = CacheOptions {
        max_ctx: max_tokens(
            &contexts,
            longest,
            steps,
            a.flag("dense"),
            a.flag("profile"),
        ),
        ..Default::default()
    };
    cache_options.validate(&plan)?;
    if steps == 0 || prefill == 0 || contexts.contains(&0) || memory.contains(&0) {
        return usage(
            "--steps, --prefill, every context and every --memory count must be at least 1",
        );
    }
    let ctx = Arc::new(gpu()?);
    let bench = CacheBench {
        model,
        q_heads,
        plan: plan.clone(),
        options: cache_options,
        contexts,
        steps,
        prefill,
        dense: a.flag("dense"),
        profile: a.flag("profile"),
        part,
        memory,
    };
    let r = bench_cache(&ctx, &bench)?;
    let date = today();
    if a.flag("json") {
        let decode: Vec<_> = r
            .decode
            .iter()
            .map(|d| {
                json!({"context": d.context,
                       "xquant_attend_ms": d.attend.a_ms, "fp16_attend_ms": d.attend.b_ms,
                       "attend_ratio": d.attend.ratio,
                       "xquant_fetch_ms": d.fetch.map(|f| f.a_ms), "fp16_fetch_ms": d.fetch.map(|f| f.b_ms),
                       "fetch_ratio": d.fetch.map(|f| f.ratio),
                       "xquant_bytes_per_token": d.xquant_bytes_per_token,
                       "fp16_bytes_per_token": d.fp16_bytes_per_token,
                       "xquant_scratch_bytes": d.xquant_scratch, "fp16_scratch_bytes": d.fp16_scratch,
                       "effective_bits": d.effective_bits,
                       "xquant_launches": d.launches[0], "fp16_launches": d.launches[1],
                       "xquant_first_step_ms": d.first_step[0].ms, "fp16_first_step_ms": d.first_step[1].ms,
                       "xquant_first_step_pipelines": d.first_step[0].pipelines,
                       "fp16_first_step_pipelines": d.first_step[1].pipelines,
                       "xquant_profile": d.profile.as_ref().map(|p| profile_json(&p[0])),
                       "fp16_profile": d.profile.as_ref().map(|p| profile_json(&p[1]))})
            })
            .collect();
        let mem: Vec<_> = r
            .memory
            .iter()
            .map(|m| json!({"tokens": m.tokens, "xquant_bytes": m.xquant_bytes, "fp16_bytes": m.fp16_bytes, "fp16_exact_bytes": m.fp16_exact_bytes}))
            .collect();
        print_json(&json!({"adapter": ctx.adapter().to_string(), "date": date,
            "attention_launches": attention_launches(&ctx),
            "model": {"layers": model.layers, "kv_heads": model.kv_heads, "q_heads": q_heads,
                      "head_dim": model.head_dim},
            "window": plan.window, "sinks": plan.sinks, "plan": plan.to_json(), "steps": steps, "part": part.name(), "decode": decode, "memory": mem,
            "prefill": {"tokens": r.prefill.tokens, "xquant_ms": r.prefill.xquant_ms,
                        "fp16_ms": r.prefill.fp16_ms}}));
        return Ok(());
    }
    println!("adapter: {} ({date})", ctx.adapter());
    println!("{}", attention_launches_line(&ctx));
    println!(
        "{} layers x {} KV heads ({} query heads) x head dim {}; XQuant plan `{}` window {} \
         sinks {}; median of {steps} decode steps (XQuant and f16 interleaved), each one \
         submission\n",
        model.layers, model.kv_heads, q_heads, model.head_dim, plan.name, plan.window, plan.sinks
    );
    match part {
        StepPart::Whole => {}
        StepPart::Attention => println!(
            "timed: every layer's attention alone (no appends: the caches keep their tokens)\n"
        ),
        StepPart::Appends => println!("timed: every layer's append alone (no attention)\n"),
    }
    let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    let ratio = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
    println!("| context | XQuant attend ms | f16 attend ms | XQuant / f16 | XQuant fetch ms | f16 fetch ms | XQuant / f16 | XQuant B / token | f16 B / token | XQuant scratch B | f16 scratch B | launches XQuant / f16 | first step ms (pipelines built) XQuant / f16 |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let first = |f: &FirstStep| format!("{:.0} ({})", f.ms, f.pipelines);
    for d in &r.decode {
        println!(
            "| {} | {:.1} | {:.1} | {:.2} | {} | {} | {} | {:.0} | {:.0} | {} | {} | {} / {} | {} / {} |",
            d.context,
            d.attend.a_ms,
            d.attend.b_ms,
            d.attend.ratio,
            ms(d.fetch.map(|f| f.a_ms)),
            ms(d.fetch.map(|f| f.b_ms)),
            ratio(d.fetch.map(|f| f.ratio)),
            d.xquant_bytes_per_token,
            d.fp16_bytes_per_token,
            d.xquant_scratch,
            d.fp16_scratch,
            d.launches[0],
            d.launches[1],
            first(&d.first_step[0]),
            first(&d.first_step[1])
        );
    }
    for d in &r.decode {
        print_profiles(&format!("{} tokens", d.context), d.profile.as_ref());
    }
    println!(
        "\nprefill of {} tokens into every layer: XQuant {:.1} ms, f16 {:.1} ms\n",
        r.prefill.tokens, r.prefill.xquant_ms, r.prefill.fp16_ms
    );
    println!(
        "| tokens | XQuant bytes | f16 bytes (grown by doubling) | XQuant / f16 | \
         f16 exact-fit bytes | XQuant / exact-fit |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for m in &r.memory {
        println!(
            "| {} | {} | {} | {:.2} | {} | {:.2} |",
            m.tokens,
            m.xquant_bytes,
            m.fp16_bytes,
            m.xquant_bytes as f64 / m.fp16_bytes as f64,
            m.fp16_exact_bytes,
            m.xquant_bytes as f64 / m.fp16_exact_bytes as f64
        );
    }
    Ok(())
}

/// How attention is launched on `ctx` (the `XQUANT_ATTENTION_*` switches or the adapter's
/// defaults): invocations per workgroup, and the names of its chunks and fill choices.
fn launch_choices(ctx: &GpuContext) -> (u32, &'static str, &'static str) {
    (
        ctx.attention_workgroup_size(),
        if ctx.many_attention_chunks() {
            "many"
        } else {
            "fewest"
        },
        if ctx.fills_attention_workgroup() {
            "workgroup"
        } else {
            "lean"
        },
    )
}

/// [`launch_choices`] for a benchmark's JSON: the figures depend on it.
pub(crate) fn attention_launches(ctx: &GpuContext) -> serde_json::Value {
    let (workgroup, chunks, fill) = launch_choices(ctx);
    json!({"workgroup": workgroup, "chunks": chunks, "fill": fill})
}

/// [`launch_choices`] as one line of text.
pub(crate) fn attention_launches_line(ctx: &GpuContext) -> String {
    let (workgroup, chunks, fill) = launch_choices(ctx);
    format!("attention launches: workgroups of {workgroup}, {chunks} chunks, {fill} fill")
}

pub(crate) fn today() -> String {
    std::process::Command::new("date")
        .arg("+%Y-%m-%d")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

//! The commands of `xquant` (see `xquant help`).

mod attend_cmd;
mod bench_cmds;
mod model_cmds;
mod plan_cmd;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::ExitCode;

use serde_json::json;
use std::sync::Arc;

use xquant_wgpu::analysis::{analyze, analyze_plan, replay};
use xquant_wgpu::cache::{options_base, CacheConfig, CacheOptions, CachePlan, DecodePolicy};
use xquant_wgpu::gpu::{
    AttentionChunks, AttentionFill, AttentionWorkgroup, ContextOptions, GpuContext,
};
use xquant_wgpu::kvfile::{tensors_to_bytes, FileDType, KvFile, KvLayer, Tensor};
use xquant_wgpu::XQuantConfig;
use xquant_wgpu::{Levels, ParamsPrecision, Rotation, TensorShape, ValueAxis, XqError};

const HELP: &str = "\
xquant — XQuant cross-layer KV-cache quantization on wgpu

USAGE:
  xquant info [--json]
      Adapter name, backend, device type and the limits that matter here.
  xquant analyze FILE.safetensors [XQuant options | --plan FILE.json | --preset NAME]
                 [--prefill N [--window 128] [--sinks 0] [--decode-policy window|reference]]
                 [--json]
      Runs every layer of a K/V dump (tensors past_key_values.{i}.key / .value, [B, H, S, D],
      F16/BF16/F32) through its plan entry on the GPU and reports error, similarity and bits.
      With --prefill N, also replays the dump through a cache set (N tokens as one prefill,
      then one at a time) and reports the fetched K/V error, bits and allocated bytes.
      XQuant options: [--group-size 2] [--base-bits 2] [--key-bits 0 (= base bits)]
      [--residual-bits 4] [--group-quant-size 32] [--eta 0] [--value-axis tokens|channels]
      [--value-levels uniform|lloyd-max] [--value-rotation none|hadamard] [--params f16|f32]
      (the reference's grouping; shown: analyze's and attend's defaults, the reference's
      own. The cache and model commands use the default cache set given none of them,
      kivi-lloyd's: --group-size 1 --key-bits 3 --residual-bits 0 --group-quant-size 64
      --value-axis channels --value-levels lloyd-max --value-rotation hadamard, 4 sinks;
      given any, the others are KIVI-2's: --group-size 1 --residual-bits 0 --value-axis
      channels, 2 bits, uniform, unrotated, group 32.)
      A plan sets each layer's keys and values on its own
      (`xquant plan` writes one); presets: xquant-paper, kivi-2, kivi-lloyd, reference, pure-reuse,
      rotated-k3v2, rotated-2, lloyd-k3v2, lloyd-2.5, lloyd-2, default. --window and --sinks
      replace a plan's.
  xquant plan FILE.safetensors [--target-bits 3.0] [--context 1024] [--window 64] [--sinks 4]
              [--group-quant-size 32|64|128 (default: each that divides the window)]
              [--out PLAN.json] [--json] [--kv-error]
      Picks, per layer, the keys' and values' codes with the least error whose effective
      bits at --context tokens (codes, params, window and sinks counted) meet the target.
      On a capture with queries (q.{i}, from `capture --queries`, at least 64 tokens) the
      error is each layer's attention output under the last 64 queries, candidates Lloyd-Max
      levels on rotated vectors (1-4 bits) and uniform codes (2-4 bits; keys per channel,
      values per token). Without queries it refuses, unless --kv-error: then the error is the
      K/V's (values' relative squared error, keys' relative error) over own codes at 1-4 bits
      along either axis, eta, or the previous layer's codes with a 0/1/2/4-bit residual; it
      ranks plans poorly against perplexity.
  xquant plan FILE.safetensors --score PLAN.json|PRESET[,...] [--context 1024] [--json]
      The planner's error and bits of given plans, to compare with their measured quality;
      with queries in the file (capture --queries), also their attention error: the last 64
      queries of every layer attending the plan's cache of the capture, against plain
      attention over it (relative squared error of the outputs, summed over layers).
  xquant attend FILE.safetensors --queries Q.safetensors --prefill N --out OUT.safetensors
                [XQuant options | --plan FILE.json | --preset NAME] [--window 128] [--sinks 0]
                [--decode-policy window|reference] [--dense] [--json]
      Replays the dump through a cache set (N tokens as one prefill, then one at a time), then
      attends every layer's queries q.{i} ([B, query_heads, T, D]) as the next decode step,
      reading the packed cache, and writes attn.{i}. --dense writes fetch() + plain attention
      instead; --json reports quantized/window tokens and max |fused - dense| per layer.
  xquant similarity FILE.safetensors [--json]
      The L x L cross-layer cosine and MSE of keys and of values.
  xquant bench [--dims 1,8,4096,128] [--dtype f16|f32] [--bits 2] [--group-quant-size 32]
               [--residual-bits 4] [--iters 20] [--cpu-iters 2] [--json]
      Kernel throughput against a same-run copy kernel (the roofline) and the CPU reference.
  xquant bench-cache [--contexts 1024,4096,8192,16384] [--steps 5] [--prefill 4096]
                     [--memory 16,64,256,1024,4096,16384] [--layers 30] [--kv-heads 3]
                     [--q-heads 9] [--head-dim 64] [XQuant options | --plan F | --preset P]
                     [--window 128] [--sinks 0] [--dense] [--profile]
                     [--part step|attention|appends] [--json]
      Decode steps through attention (and with --dense through update_and_fetch) and GPU
      memory of a cache set against a plain f16 cache, XQuant and f16 steps alternating
      (contexts under 1024 tokens run up to 4x the steps). --profile: also the GPU time of
      a step by kernel (timestamp queries; devices that offer them): per kernel the median
      of 7 steps profiled one by one, the two caches alternating. --part attention|appends:
      time (count, profile) only every layer's attention (no appends: the caches keep their
      tokens) or only its append, in both caches.
  xquant generate --model M.gguf --prompt TEXT [--chat] [--max-tokens 64] [--cache f16|xquant]
                  [XQuant options | --plan F | --preset P] [--window 128] [--sinks 0]
                  [--decode-policy window|reference] [--temperature 0] [--top-k 0]
                  [--top-p 1] [--seed 0] [--json] [--save-cache FILE] [--load-cache FILE]
      Generation with SmolLM2 (scripts/fetch-model), streamed; tokens/s at the end. Greedy
      by default; --temperature > 0 samples (after top-k, then top-p) with the seed. --json
      prints the prompt's and the generated token ids, the text and the KV bytes instead.
      --save-cache writes the conversation's cache after generating (with room for the
      model's context); --load-cache continues one: the prompt follows the cached tokens,
      the file's kind, plan and options are kept (cache options are refused with it).
  xquant capture --model M.gguf (--prompt TEXT | --text FILE) [--tokens N] [--queries]
                 --out KV.safetensors
      Runs the text through the model and writes every layer's K/V (keys after RoPE), f16;
      with --queries also its queries q.{i} ([1, heads, T, D], after RoPE), which `xquant
      plan` weighs key errors with.
  xquant eval --model M.gguf --text FILE [--tokens 1024] [--prefill 32] [--window 128]
              [--sinks 0] [--plan F[,F] | --preset P[,P]] [--mode chunked|token]
              [--baseline-dir DIR | --no-baseline-cache] [--json]
      Perplexity with the f16 cache and XQuant caches (each --plan/--preset, or a standard
      sweep); top-1 agreement and mean KL against the f16 run; effective bits (everything
      counted) and bits per quantized element. chunked (default): teacher-forced chunks that
      quantize where decode would (same results as token, one token per step, many times
      faster). Warns when the window kept most of the text unquantized. The f16 run's final
      hidden states are kept (DIR, default $XQUANT_CACHE or ~/.cache/xquant-wgpu, under
      eval-baselines/) per model file, device, kernels, tokens, prefill and mode; a later
      eval of the same recomputes the f16 row from them with the output matmul alone (the
      same log-probs, bit for bit, about a fifth of the work).
  xquant bench-model --model M.gguf [--contexts 1024,4096] [--steps 8] [--text FILE]
                     [XQuant options | --plan F | --preset P] [--window 128] [--sinks 0]
                     [--profile] [--json]
      Prefill and decode tokens/s and KV bytes, f16 cache against XQuant, same device and run
      (decode steps of the two alternating; a prefill the mean of two, in the order XQuant,
      f16, f16, XQuant, after an untimed one of each that creates the pipelines). --profile:
      also the GPU time of one more decode step and one more prefill by kernel.
  xquant synth --out FILE.safetensors [--layers 8] [--heads 2] [--tokens 128] [--dim 64]
               [--correlation 0.8] [--dtype f16|bf16|f32] [--seed 1]
               [--queries Q.safetensors [--query-heads H] [--query-tokens 1]]
      Writes a deterministic synthetic K/V dump (correlated layers) to try the tools on, and
      with --queries standard-normal queries q.{i} for `xquant attend`.

ENVIRONMENT:
  WGPU_BACKEND=vulkan|gl|...       the backend wgpu picks the adapter from.
  XQUANT_ATTENTION_CHUNKS=auto|fewest|many
      How attention cuts a long context into workgroups: auto (default) fewest (of even
      length) on an adapter that reports itself a CPU, such as lavapipe, many elsewhere.
  XQUANT_ATTENTION_WORKGROUP=auto|narrow|wide
      Invocations per attention workgroup: auto (default) narrow (8) on an adapter that
      reports itself a CPU, wide (32) elsewhere. The rotation's workgroups follow (8, or 64).
  XQUANT_ATTENTION_FILL=lean|workgroup
      How a short attention launch spreads over a workgroup's threads: lean (default) runs
      of 16 tokens a key-phase thread and one value-phase thread a block of channels in a
      launch of one chunk, the fewest loads per token; workgroup: shorter runs (8 or 4) and
      split value blocks wherever threads would idle (both caches alike; not yet timed on a
      GPU).
";

pub(crate) enum CliError {
    Usage(String),
    Run(XqError),
}

impl From<XqError> for CliError {
    fn from(e: XqError) -> Self {
        CliError::Run(e)
    }
}

pub(crate) type CliResult<T> = Result<T, CliError>;

pub(crate) fn usage<T>(msg: impl Into<String>) -> CliResult<T> {
    Err(CliError::Usage(msg.into()))
}

/// Parsed `--name value` options, `--flag`s and positionals, checked against what a command
/// accepts.
pub(crate) struct Args {
    positional: Vec<String>,
    pub(crate) options: BTreeMap<String, String>,
    flags: BTreeSet<String>,
}

impl Args {
    pub(crate) fn parse(raw: &[String], options: &[&str], flags: &[&str]) -> CliResult<Args> {
        let mut a = Args {
            positional: Vec::new(),
            options: BTreeMap::new(),
            flags: BTreeSet::new(),
        };
        let mut it = raw.iter();
        while let Some(arg) = it.next() {
            let Some(name) = arg.strip_prefix("--") else {
                a.positional.push(arg.clone());
                continue;
            };
            let (name, inline) = match name.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (name, None),
            };
            if flags.contains(&name) && inline.is_none() {
                a.flags.insert(name.to_string());
            } else if options.contains(&name) {
                let value = match inline.or_else(|| it.next().cloned()) {
                    Some(v) => v,
                    None => return usage(format!("--{name} needs a value")),
                };
                a.options.insert(name.to_string(), value);
            } else {
                return usage(format!("unknown option --{name}"));
            }
        }
        Ok(a)
    }

    pub(crate) fn get<T: std::str::FromStr>(&self, name: &str, default: T) -> CliResult<T> {
        match self.options.get(name) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|_| CliError::Usage(format!("--{name}: cannot parse `{v}`"))),
        }
    }

    pub(crate) fn flag(&self, name: &str) -> bool {
        self.flags.contains(name)
    }

    pub(crate) fn one_file(&self, what: &str) -> CliResult<PathBuf> {
        match self.positional.as_slice() {
            [f] => Ok(PathBuf::from(f)),
            [] => usage(format!("{what} needs a FILE")),
            more => usage(format!("{what} takes one FILE, got {}", more.len())),
        }
    }

    pub(crate) fn no_positional(&self, what: &str) -> CliResult<()> {
        match self.positional.first() {
            Some(p) => usage(format!("{what}: unexpected argument `{p}`")),
            None => Ok(()),
        }
    }
}

pub(crate) fn gpu() -> CliResult<GpuContext> {
    use AttentionChunks as C;
    use AttentionFill as F;
    use AttentionWorkgroup as W;
    let options = ContextOptions {
        attention_chunks: env_choice(
            "XQUANT_ATTENTION_CHUNKS",
            &[
                ("auto", C::ByAdapter),
                ("fewest", C::Fewest),
                ("many", C::Many),
            ],
        )?,
        attention_workgroup: env_choice(
            "XQUANT_ATTENTION_WORKGROUP",
            &[
                ("auto", W::ByAdapter),
                ("narrow", W::Narrow),
                ("wide", W::Wide),
            ],
        )?,
        attention_fill: env_choice(
            "XQUANT_ATTENTION_FILL",
            &[("lean", F::Lean), ("workgroup", F::Workgroup)],
        )?,
        ..Default::default()
    };
    Ok(pollster::block_on(GpuContext::new(&options))?)
}

/// The choice an environment variable names among `choices`; unset or empty: the first.
fn env_choice<T: Copy>(name: &str, choices: &[(&str, T)]) -> CliResult<T> {
    let value = std::env::var(name).unwrap_or_default();
    if value.is_empty() {
        return Ok(choices[0].1);
    }
    choice(name, &value, choices)
}

/// The choice `value` names among `choices`; any other value is a usage error naming `what`
/// (an option or a variable) and the choices.
pub(crate) fn choice<T: Copy>(what: &str, value: &str, choices: &[(&str, T)]) -> CliResult<T> {
    match choices.iter().find(|(n, _)| *n == value) {
        Some(&(_, choice)) => Ok(choice),
        None => {
            let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
            usage(format!(
                "{what} must be one of {}, got `{value}`",
                names.join(", ")
            ))
        }
    }
}

pub(crate) fn print_json(v: &serde_json::Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

fn cmd_info(raw: &[String]) -> CliResult<()> {
    let a = Args::parse(raw, &[], &["json"])?;
    a.no_positional("info")?;
    let ctx = gpu()?;
    let l = ctx.limits();
    let ad = ctx.adapter();
    let limits = json!({
        "max_storage_buffer_binding_size": l.max_storage_buffer_binding_size,
        "max_buffer_size": l.max_buffer_size,
        "max_storage_buffers_per_shader_stage": l.max_storage_buffers_per_shader_stage,
        "max_compute_invocations_per_workgroup": l.max_compute_invocations_per_workgroup,
        "max_compute_workgroups_per_dimension": l.max_compute_workgroups_per_dimension,
        "max_compute_workgroup_storage_size": l.max_compute_workgroup_storage_size,
    });
    if a.flag("json") {
        print_json(
            &json!({"adapter": ad.name, "backend": ad.backend, "device_type": ad.device_type,
                           "driver": ad.driver, "limits": limits}),
        );
    } else {
        println!(
            "adapter:     {}\nbackend:     {}\ndevice type: {}\ndriver:      {}",
            ad.name, ad.backend, ad.device_type, ad.driver
        );
        println!("limits (as requested: WebGPU defaults, storage sizes raised to the adapter's):");
        if let Some(m) = limits.as_object() {
            for (k, v) in m {
                println!("  {k}: {v}");
            }
        }
    }
    Ok(())
}

/// The options `xquant_config` reads.
pub(crate) const XQUANT_OPTIONS: [&str; 10] = [
    "group-size",
    "base-bits",
    "key-bits",
    "residual-bits",
    "group-quant-size",
    "eta",
    "value-axis",
    "value-levels",
    "value-rotation",
    "params",
];

/// The XQuant options given, the others from `d` — or, where `d` is the cache set's default
/// and some are given, from KIVI-2's options (`options_base`).
pub(crate) fn xquant_config(a: &Args, d: XQuantConfig) -> CliResult<XQuantConfig> {
    let given = XQUANT_OPTIONS.iter().any(|o| a.options.contains_key(*o));
    let d = options_base(d, given);
    let cfg = XQuantConfig {
        layers_per_group: a.get("group-size", d.layers_per_group)?,
        base_bits: a.get("base-bits", d.base_bits)?,
        key_bits: a.get("key-bits", d.key_bits)?,
        residual_bits: a.get("residual-bits", d.residual_bits)?,
        group_quant_size: a.get("group-quant-size", d.group_quant_size)?,
        eta: a.get("eta", d.eta)?,
        value_axis: ValueAxis::parse(&a.get("value-axis", d.value_axis.name().to_string())?)?,
        params: ParamsPrecision::parse(&a.get("params", d.params.name().to_string())?)?,
        value_levels: Levels::parse(&a.get("value-levels", d.value_levels.name().to_string())?)?,
        value_rotation: Rotation::parse(
            &a.get("value-rotation", d.value_rotation.name().to_string())?,
        )?,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Options that give the XQuant cache a plan (and its sinks) instead of the XQuant options.
pub(crate) const PLAN_OPTIONS: [&str; 3] = ["plan", "preset", "sinks"];

/// The defaults of the reference tools (`analyze`, `attend`): the reference's options, a
/// 128-token window, no sinks.
pub(crate) fn reference_defaults() -> CacheConfig {
    CacheConfig {
        quant: XQuantConfig::default(),
        sinks: 0,
        ..CacheConfig::default()
    }
}

/// Where an XQuant cache's plan comes from.
pub(crate) enum PlanArg {
    /// The XQuant options (the reference's grouping) over the command's defaults (window
    /// and sinks included).
    Options(CacheConfig),
    /// `--plan FILE.json`.
    File(String),
    /// `--preset NAME`.
    Preset(String),
}

/// Reads `--plan` / `--preset`, or the XQuant options (those not given from `defaults`)
/// when neither is given.
pub(crate) fn plan_arg(a: &Args, defaults: CacheConfig) -> CliResult<PlanArg> {
    let given = |o: &str| a.options.get(o).cloned();
    let (file, preset) = (given("plan"), given("preset"));
    if file.is_some() && preset.is_some() {
        return usage("give --plan FILE or --preset NAME, not both");
    }
    if file.is_some() || preset.is_some() {
        if let Some(o) = XQUANT_OPTIONS.iter().find(|o| a.options.contains_key(**o)) {
            return usage(format!(
                "--{o} cannot come with --plan/--preset (a plan sets every layer's quantizer)"
            ));
        }
    }
    Ok(match (file, preset) {
        (Some(f), _) => PlanArg::File(f),
        (_, Some(p)) => PlanArg::Preset(p),
        _ => PlanArg::Options(CacheConfig {
            quant: xquant_config(a, defaults.quant)?,
            ..defaults
        }),
    })
}

/// A plan file, its errors prefixed with its path.
pub(crate) fn read_plan_file(f: &str) -> CliResult<CachePlan> {
    let text =
        std::fs::read_to_string(f).map_err(|e| XqError::Io(format!("cannot read {f}: {e}")))?;
    Ok(
        CachePlan::from_json(&text)
            .map_err(|e| XqError::Config(format!("{f}: {}", e.message())))?,
    )
}

/// The plan of `arg` for `layers` layers of head dim `head_dim`; `--window` and `--sinks`
/// replace a plan's.
pub(crate) fn resolve_plan(
    a: &Args,
    arg: &PlanArg,
    layers: usize,
    head_dim: usize,
) -> CliResult<CachePlan> {
    let mut plan = match arg {
        PlanArg::Options(d) => CacheConfig {
            window: a.get("window", d.window)?,
            sinks: a.get("sinks", d.sinks)?,
            ..*d
        }
        .plan(layers, head_dim)?,
        PlanArg::File(f) => read_plan_file(f)?,
        PlanArg::Preset(name) => CachePlan::preset_for(name, layers, head_dim)?,
    };
    plan.window = a.get("window", plan.window)?;
    plan.sinks = a.get("sinks", plan.sinks)?;
    plan.validate()?;
    plan.check_layers(layers)?;
    Ok(plan)
}

/// The cache set a replay of a K/V dump uses: the plan, `--decode-policy`, no budget.
pub(crate) fn replay_plan(
    a: &Args,
    arg: &PlanArg,
    layers: usize,
    head_dim: usize,
) -> CliResult<(CachePlan, CacheOptions)> {
    let plan = resolve_plan(a, arg, layers, head_dim)?;
    let options = CacheOptions {
        decode_policy: DecodePolicy::parse(&a.get("decode-policy", "window".to_string())?)?,
        max_ctx: usize::MAX,
        ..Default::default()
    };
    options.validate(&plan)?;
    Ok((plan, options))
}

fn cmd_analyze(raw: &[String]) -> CliResult<()> {
    let mut options = XQUANT_OPTIONS.to_vec();
    options.extend(PLAN_OPTIONS);
    options.extend(["prefill", "window", "decode-policy"]);
    let a = Args::parse(raw, &options, &["json"])?;
    let file = a.one_file("analyze")?;
    let arg = plan_arg(&a, reference_defaults())?;
    let replaying = a.options.contains_key("prefill");
    if !replaying
        && ["window", "sinks", "decode-policy"]
            .iter()
            .any(|o| a.options.contains_key(*o))
    {
        return usage("--window, --sinks and --decode-policy need --prefill");
    }
    let kv = KvFile::read(&file)?;
    let layers = kv.layers.len();
    let cache = match replaying {
        false => None,
        true => Some((
            replay_plan(&a, &arg, layers, kv.shape.dim())?,
            a.get::<usize>("prefill", 0)?,
        )),
    };
    let ctx = Arc::new(gpu()?);
    let mut report = match &arg {
        PlanArg::Options(cfg) => pollster::block_on(analyze(&ctx, &kv, &cfg.quant))?,
        _ => pollster::block_on(analyze_plan(
            &ctx,
            &kv,
            &resolve_plan(&a, &arg, layers, kv.shape.dim())?,
        ))?,
    };
    if let Some(((plan, mut options), prefill)) = cache {
        options.output = report.recon_dtype;
        report.cache = Some(pollster::block_on(replay(
            &ctx, &kv, &plan, options, prefill,
        ))?);
    }
    if a.flag("json") {
        print_json(&report.to_json());
    } else {
        print!("{}", report.to_table());
    }
    Ok(())
}

fn cmd_similarity(raw: &[String]) -> CliResult<()> {
    let a = Args::parse(raw, &[], &["json"])?;
    let file = a.one_file("similarity")?;
    let kv = KvFile::read(&file)?;
    let ctx = gpu()?;
    let sim = pollster::block_on(xquant_wgpu::analysis::kv_similarity(&ctx, &kv))?;
    let mut out = serde_json::Map::new();
    for (name, m) in [("key", &sim.key), ("value", &sim.value)] {
        let rows = |v: &[f32]| v.chunks(m.layers).map(|r| r.to_vec()).collect::<Vec<_>>();
        if !a.flag("json") {
            println!("{name} cosine ({} layers; row i, column j):", m.layers);
            for r in rows(&m.cosine) {
                println!(
                    "  {}",
                    r.iter()
                        .map(|c| format!("{c:6.3}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                );
            }
        }
        out.insert(
            name.into(),
            json!({"cosine": rows(&m.cosine), "mse": rows(&m.mse)}),
        );
    }
    if a.flag("json") {
        out.insert("adapter".into(), json!(ctx.adapter().to_string()));
        print_json(&serde_json::Value::Object(out));
    }
    Ok(())
}

fn cmd_synth(raw: &[String]) -> CliResult<()> {
    let a = Args::parse(
        raw,
        &[
            "out",
            "layers",
            "heads",
            "tokens",
            "dim",
            "correlation",
            "dtype",
            "seed",
            "queries",
            "query-heads",
            "query-tokens",
        ],
        &[],
    )?;
    a.no_positional("synth")?;
    let Some(out) = a.options.get("out") else {
        return usage("synth needs --out FILE");
    };
    let (layers, heads, tokens, dim): (usize, usize, usize, usize) = (
        a.get("layers", 8)?,
        a.get("heads", 2)?,
        a.get("tokens", 128)?,
        a.get("dim", 64)?,
    );
    let correlation: f32 = a.get("correlation", 0.8)?;
    if !(0.0..=1.0).contains(&correlation) {
        return usage("--correlation must be in [0, 1]");
    }
    if layers == 0 {
        return usage("--layers must be at least 1");
    }
    let dtype = match a.get("dtype", "f16".to_string())?.as_str() {
        "f16" => FileDType::F16,
        "bf16" => FileDType::BF16,
        "f32" => FileDType::F32,
        other => return usage(format!("--dtype must be f16, bf16 or f32, got `{other}`")),
    };
    let shape = TensorShape::new(&[1, heads, tokens, dim])?;
    let data = xquant_wgpu::synth::synthetic_kv(
        layers,
        heads,
        tokens,
        dim,
        correlation,
        a.get("seed", 1)?,
    );
    let kv = KvFile {
        shape,
        dtype,
        layers: data
            .into_iter()
            .map(|(key, value)| KvLayer { key, value })
            .collect(),
    };
    kv.write(std::path::Path::new(out))?;
    eprintln!(
        "wrote {out}: {layers} layers of [1, {heads}, {tokens}, {dim}] {}",
        dtype.name()
    );
    if let Some(path) = a.options.get("queries") {
        let q_heads: usize = a.get("query-heads", heads)?;
        let q_tokens: usize = a.get("query-tokens", 1)?;
        if q_heads == 0 || q_heads % heads.max(1) != 0 || q_tokens == 0 {
            return usage(
                "--query-heads must be a positive multiple of --heads, --query-tokens >= 1",
            );
        }
        let seed: u64 = a.get("seed", 1)?;
        let shape = vec![1, q_heads, q_tokens, dim];
        let tensors: Vec<(String, Tensor)> = (0..layers)
            .map(|i| {
                let data = xquant_wgpu::synth::normal(
                    q_heads * q_tokens * dim,
                    seed ^ (0x9e37 + i as u64),
                );
                (
                    format!("q.{i}"),
                    Tensor {
                        shape: shape.clone(),
                        dtype,
                        data,
                    },
                )
            })
            .collect();
        let refs: Vec<(String, &Tensor)> = tensors.iter().map(|(n, t)| (n.clone(), t)).collect();
        std::fs::write(path, tensors_to_bytes(&refs))
            .map_err(|e| XqError::Io(format!("cannot write {path}: {e}")))?;
        eprintln!(
            "wrote {path}: q.0 .. q.{} of {shape:?} {}",
            layers - 1,
            dtype.name()
        );
    }
    Ok(())
}

fn run(args: &[String]) -> CliResult<()> {
    let Some((cmd, rest)) = args.split_first() else {
        print!("{HELP}");
        return Ok(());
    };
    match cmd.as_str() {
        "info" => cmd_info(rest),
        "analyze" => cmd_analyze(rest),
        "plan" => plan_cmd::cmd_plan(rest),
        "similarity" => cmd_similarity(rest),
        "attend" => attend_cmd::cmd_attend(rest),
        "bench" => bench_cmds::cmd_bench(rest),
        "bench-cache" => bench_cmds::cmd_bench_cache(rest),
        "synth" => cmd_synth(rest),
        "generate" => model_cmds::cmd_generate(rest),
        "capture" => model_cmds::cmd_capture(rest),
        "eval" => model_cmds::cmd_eval(rest),
        "bench-model" => model_cmds::cmd_bench_model(rest),
        "help" | "--help" | "-h" => {
            print!("{HELP}");
            Ok(())
        }
        other => usage(format!("unknown command `{other}`")),
    }
}

/// Runs the command line; every error ends as one stderr line and a non-zero exit.
pub fn main() -> ExitCode {
    // A bug must still end as one line on stderr, not a backtrace.
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        eprintln!("xquant: internal error: {msg} (please report this)");
    }));
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(CliError::Usage(m)) => {
            eprintln!("xquant: {m} (see `xquant help`)");
            ExitCode::from(2)
        }
        Err(CliError::Run(e)) => {
            eprintln!("xquant: {e}");
            ExitCode::from(1)
        }
    }
}

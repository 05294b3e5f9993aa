//! `xquant generate`, `capture` and `eval`: the SmolLM2 runtime from the command line.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use serde_json::json;
use xquant_wgpu::cache::{restore_cache, CacheConfig, DecodePolicy, KvCache, SavedCache};
use xquant_wgpu::model::eval::{
    content_digest, evaluate, standard_sweep, Baseline, BaselineKey, EvalMode, EvalRow,
};
use xquant_wgpu::model::{CacheChoice, Runtime, Sampling, TextStream};
use xquant_wgpu::XqError;

use super::{
    gpu, plan_arg, print_json, resolve_plan, usage, Args, CliResult, PlanArg, PLAN_OPTIONS,
    XQUANT_OPTIONS,
};

fn load(a: &Args) -> CliResult<Runtime> {
    Ok(Runtime::load(Arc::new(gpu()?), &model_bytes(a)?)?)
}

/// The bytes of `--model FILE`.
fn model_bytes(a: &Args) -> CliResult<Vec<u8>> {
    let Some(path) = a.options.get("model") else {
        return usage("--model FILE.gguf is required (scripts/fetch-model prints the path)");
    };
    Ok(std::fs::read(path).map_err(|e| XqError::Io(format!("cannot read {path}: {e}")))?)
}

/// Where `xquant eval` keeps the f16 rows it ran, one file per [`BaselineKey`]:
/// `--baseline-dir DIR`, else `$XQUANT_CACHE/eval-baselines`, else
/// `~/.cache/xquant-wgpu/eval-baselines`; none with `--no-baseline-cache`.
struct BaselineStore {
    path: std::path::PathBuf,
}

impl BaselineStore {
    fn new(a: &Args, key: &BaselineKey) -> Option<BaselineStore> {
        if a.flag("no-baseline-cache") {
            return None;
        }
        let dir = match (a.options.get("baseline-dir"), std::env::var("XQUANT_CACHE")) {
            (Some(d), _) => std::path::PathBuf::from(d),
            (None, Ok(c)) => std::path::Path::new(&c).join("eval-baselines"),
            (None, Err(_)) => std::path::Path::new(&std::env::var("HOME").ok()?)
                .join(".cache/xquant-wgpu/eval-baselines"),
        };
        Some(BaselineStore {
            path: dir.join(key.file_name()),
        })
    }

    /// The kept baseline, if a readable one is there (its key is checked by `evaluate`).
    fn load(&self) -> Option<Baseline> {
        let bytes = std::fs::read(&self.path).ok()?;
        match Baseline::from_bytes(&bytes) {
            Ok(b) => Some(b),
            Err(e) => {
                eprintln!(
                    "warning: {}: {} (running the f16 row)",
                    self.path.display(),
                    e.message()
                );
                None
            }
        }
    }

    /// Keeps `b`; says where (or why not).
    fn save(&self, b: &Baseline) -> String {
        let written = self
            .path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&self.path, b.to_bytes()));
        match written {
            Ok(()) => format!("run, kept in {}", self.path.display()),
            Err(e) => format!("run (could not keep it in {}: {e})", self.path.display()),
        }
    }
}

/// The cache a command asked for (`--cache f16|xquant`, then the XQuant options or a plan)
/// for a model of `layers` layers.
fn cache_choice(a: &Args, layers: usize, head_dim: usize) -> CliResult<CacheChoice> {
    match a.get("cache", "xquant".to_string())?.as_str() {
        "f16" => Ok(CacheChoice::F16),
        "xquant" => cache_choice_xquant(a, layers, head_dim),
        other => usage(format!("--cache must be f16 or xquant, got `{other}`")),
    }
}

/// The XQuant cache the options describe: options (any decode policy) or a plan.
fn cache_choice_xquant(a: &Args, layers: usize, head_dim: usize) -> CliResult<CacheChoice> {
    let arg = plan_arg(a, CacheConfig::default())?;
    let policy = DecodePolicy::parse(&a.get("decode-policy", "window".to_string())?)?;
    let PlanArg::Options(d) = arg else {
        if policy != DecodePolicy::Window {
            return usage("a --plan/--preset cache runs with the window decode policy");
        }
        return Ok(CacheChoice::Plan(resolve_plan(a, &arg, layers, head_dim)?));
    };
    let config = CacheConfig {
        window: a.get("window", d.window)?,
        sinks: a.get("sinks", d.sinks)?,
        decode_policy: policy,
        ..d
    };
    config.validate(head_dim)?;
    config.options().validate(&config.plan(layers, head_dim)?)?;
    Ok(CacheChoice::XQuant(config))
}

fn options(extra: &[&'static str]) -> Vec<&'static str> {
    let mut o: Vec<&'static str> = XQUANT_OPTIONS.to_vec();
    o.extend(PLAN_OPTIONS);
    o.extend(["model", "cache", "window", "decode-policy"]);
    o.extend(extra);
    o
}

/// The sampling flags (`--temperature`, `--top-k`, `--top-p`, `--seed`; greedy by default).
fn sampling(a: &Args) -> CliResult<Sampling> {
    let d = Sampling::default();
    let s = Sampling {
        temperature: a.get("temperature", d.temperature)?,
        top_k: a.get("top-k", d.top_k)?,
        top_p: a.get("top-p", d.top_p)?,
        seed: a.get("seed", d.seed)?,
    };
    s.validate()?;
    Ok(s)
}

/// The options that choose a new cache (refused with `--load-cache`, whose file decides).
fn cache_choice_options() -> Vec<&'static str> {
    let mut o: Vec<&'static str> = XQUANT_OPTIONS.to_vec();
    o.extend(PLAN_OPTIONS);
    o.extend(["cache", "window", "decode-policy"]);
    o
}

/// `--load-cache FILE`: the saved cache, which brings its own kind, plan and options (so
/// the options choosing a cache are refused with it); a cache saved for another model shape
/// is refused. `None` without the option.
fn load_cache(a: &Args, rt: &Runtime) -> CliResult<Option<Box<dyn KvCache>>> {
    let Some(path) = a.options.get("load-cache") else {
        return Ok(None);
    };
    if let Some(o) = cache_choice_options()
        .into_iter()
        .find(|o| a.options.contains_key(*o))
    {
        return usage(format!(
            "--{o} cannot come with --load-cache (the saved cache keeps its own kind, plan \
             and options)"
        ));
    }
    let bytes = std::fs::read(path).map_err(|e| XqError::Io(format!("cannot read {path}: {e}")))?;
    let named = |e: XqError| XqError::Format(format!("{path}: {}", e.message()));
    SavedCache::inspect(&bytes)
        .and_then(|s| s.check_model(&rt.spec()))
        .map_err(named)?;
    let ctx = rt.model.context().clone();
    Ok(Some(pollster::block_on(restore_cache(ctx, &bytes))?))
}

/// `--save-cache FILE`: writes the cache (after generating).
fn save_cache(a: &Args, cache: &dyn KvCache) -> CliResult<()> {
    let Some(path) = a.options.get("save-cache") else {
        return Ok(());
    };
    let bytes = pollster::block_on(cache.save())?;
    std::fs::write(path, &bytes).map_err(|e| XqError::Io(format!("cannot write {path}: {e}")))?;
    eprintln!(
        "[cache of {} tokens saved to {path}: {} B]",
        cache.tokens(0),
        bytes.len()
    );
    Ok(())
}

pub fn cmd_generate(raw: &[String]) -> CliResult<()> {
    let a = Args::parse(
        raw,
        &options(&[
            "prompt",
            "max-tokens",
            "temperature",
            "top-k",
            "top-p",
            "seed",
            "save-cache",
            "load-cache",
        ]),
        &["chat", "json"],
    )?;
    a.no_positional("generate")?;
    let Some(prompt) = a.options.get("prompt") else {
        return usage("generate needs --prompt TEXT");
    };
    let max_tokens: usize = a.get("max-tokens", 64)?;
    let sampling = sampling(&a)?;
    let json = a.flag("json");
    let rt = load(&a)?;
    let loaded = load_cache(&a, &rt)?;
    let text = if a.flag("chat") {
        rt.tokenizer.chat_prompt(prompt)?
    } else {
        prompt.clone()
    };
    // A fresh conversation starts with BOS where the model wants it (Gemma); a loaded cache
    // continues one.
    let continuing = loaded.as_ref().is_some_and(|c| c.tokens(0) > 0);
    let ids = match continuing {
        true => rt.tokenizer.encode(&text, a.flag("chat")),
        false => rt.tokenizer.encode_prompt(&text, a.flag("chat")),
    };
    // A cache to be saved gets room for the model's context, so the conversation can go on.
    let mut need = ids.len() + max_tokens + 1;
    if a.options.contains_key("save-cache") {
        need = need.max(rt.model.cfg.context);
    }
    let (mut cache, described) = match loaded {
        Some(c) => (c, "loaded".to_string()),
        None => {
            let choice = cache_choice(&a, rt.model.cfg.layers, rt.model.cfg.head_dim)?;
            (rt.cache(&choice, need)?, choice.describe())
        }
    };
    let cached = cache.tokens(0);
    let start = Instant::now();
    let mut stdout = std::io::stdout();
    if !a.flag("chat") && !json {
        print!("{prompt}");
    }
    let mut stream = TextStream::default();
    let out = pollster::block_on(
        rt.generate(&ids, max_tokens, sampling, cache.as_mut(), |t| {
            if !json {
                print!("{}", stream.push(&rt.tokenizer.decode_bytes(&[t])));
                let _ = stdout.flush();
            }
        }),
    )?;
    let secs = start.elapsed().as_secs_f64();
    if json {
        print_json(&json!({
            "prompt_tokens": ids,
            "tokens": out,
            "text": rt.tokenizer.decode(&out),
            "cache": described,
            "kv_bytes": cache.storage_bytes(),
            "seconds": secs,
        }));
    } else {
        println!("{}", stream.finish());
    }
    eprintln!(
        "[{cached} cached + {} prompt + {} generated tokens in {secs:.1} s: {:.2} tokens/s; \
         cache {described}; KV {} B]",
        ids.len(),
        out.len(),
        out.len() as f64 / secs,
        cache.storage_bytes()
    );
    save_cache(&a, cache.as_ref())
}

fn read_text(a: &Args) -> CliResult<String> {
    match (a.options.get("prompt"), a.options.get("text")) {
        (Some(p), None) => Ok(p.clone()),
        (None, Some(f)) => {
            Ok(std::fs::read_to_string(f)
                .map_err(|e| XqError::Io(format!("cannot read {f}: {e}")))?)
        }
        _ => usage("give exactly one of --prompt TEXT or --text FILE"),
    }
}

fn tokens_of(rt: &Runtime, a: &Args, text: &str) -> CliResult<Vec<u32>> {
    let mut ids = rt.tokenizer.encode_prompt(text, false);
    if let Some(n) = a.options.get("tokens") {
        let n: usize = n
            .parse()
            .map_err(|_| super::CliError::Usage(format!("--tokens: cannot parse `{n}`")))?;
        if n == 0 || n > ids.len() {
            return usage(format!(
                "--tokens must be in 1..={} (the text's tokens)",
                ids.len()
            ));
        }
        ids.truncate(n);
    }
    Ok(ids)
}

pub fn cmd_capture(raw: &[String]) -> CliResult<()> {
    let a = Args::parse(
        raw,
        &["model", "prompt", "text", "tokens", "out"],
        &["queries"],
    )?;
    a.no_positional("capture")?;
    let Some(out) = a.options.get("out").cloned() else {
        return usage("capture needs --out FILE.safetensors");
    };
    let text = read_text(&a)?;
    let rt = load(&a)?;
    let ids = tokens_of(&rt, &a, &text)?;
    let bytes = pollster::block_on(rt.capture_file(&ids, a.flag("queries")))?;
    std::fs::write(&out, bytes).map_err(|e| XqError::Io(format!("cannot write {out}: {e}")))?;
    let c = rt.model.cfg;
    eprintln!(
        "wrote {out}: {} layers of K/V [1, {}, {}, {}] f16{}",
        c.layers,
        c.kv_heads,
        ids.len(),
        c.head_dim,
        if a.flag("queries") {
            ", and their queries"
        } else {
            ""
        }
    );
    Ok(())
}

pub fn cmd_eval(raw: &[String]) -> CliResult<()> {
    let a = Args::parse(
        raw,
        &[
            "model",
            "text",
            "tokens",
            "prefill",
            "window",
            "sinks",
            "mode",
            "plan",
            "preset",
            "baseline-dir",
        ],
        &["json", "no-baseline-cache"],
    )?;
    a.no_positional("eval")?;
    let mode = match a.options.get("mode") {
        None => EvalMode::Chunked,
        Some(m) => match EvalMode::from_name(m) {
            Some(mode) => mode,
            None => return usage(format!("--mode must be chunked or token, got `{m}`")),
        },
    };
    let text = read_text(&a)?;
    let bytes = model_bytes(&a)?;
    let digest = content_digest(&bytes);
    let rt = Runtime::load(Arc::new(gpu()?), &bytes)?;
    drop(bytes);
    let layers = rt.model.cfg.layers;
    let mut ids = tokens_of(&rt, &a, &text)?;
    if !a.options.contains_key("tokens") {
        ids.truncate(DEFAULT_EVAL_TOKENS);
    }
    let prefill: usize = a.get("prefill", 32.min(ids.len().saturating_sub(1)).max(1))?;
    let sweep = eval_rows(&a, layers, rt.model.cfg.head_dim)?;
    let key = BaselineKey::new(&rt, &digest, &ids, prefill, mode);
    let store = BaselineStore::new(&a, &key);
    let json = a.flag("json");
    let feeding = match mode {
        EvalMode::Chunked => "chunks that quantize where decode would",
        EvalMode::TokenByToken => "one per step",
    };
    if !json {
        eprintln!("{} tokens (prefill {prefill}, then {feeding})", ids.len());
        println!(
            "| cache | effective bits | quantized bits | KV bytes | perplexity | Δ ppl | top-1 agree | mean KL |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    }
    let known = store.as_ref().and_then(BaselineStore::load);
    let eval = pollster::block_on(evaluate(&rt, &key, &sweep, known, |r: &EvalRow| {
        if !json {
            println!(
                "| {} | {:.2} | {:.2} | {} | {:.3} | {:+.3} ({:+.1}%) | {:.1}% | {:.4} |",
                r.name,
                r.effective_bits,
                r.quantized_bits,
                r.kv_bytes,
                r.perplexity,
                r.delta_perplexity,
                100.0 * r.delta_perplexity / (r.perplexity - r.delta_perplexity),
                100.0 * r.top1_agreement,
                r.mean_kl
            );
        }
    }))?;
    let baseline = match (&store, eval.baseline_replayed) {
        (Some(s), true) => format!("replayed from {}", s.path.display()),
        (Some(s), false) => s.save(&eval.baseline),
        (None, _) => "run (--no-baseline-cache)".to_string(),
    };
    if !json {
        eprintln!("f16 row: {baseline}");
    }
    let rows = eval.rows;
    let warning = window_warning(&rows, ids.len());
    if let Some(w) = &warning {
        eprintln!("warning: {w}");
    }
    if json {
        print_json(&json!({
            "adapter": rt.model.context().adapter().to_string(),
            "tokens": ids.len(),
            "prefill": prefill,
            "mode": mode.name(),
            "f16_row": baseline,
            "warning": warning,
            "rows": rows.iter().map(|r| r.to_json()).collect::<Vec<_>>(),
        }));
    }
    Ok(())
}

/// The caches `xquant eval` compares: f16, then each `--plan FILE[,FILE]` /
/// `--preset NAME[,NAME]` (rows named after the plan), or the standard sweep.
fn eval_rows(a: &Args, layers: usize, head_dim: usize) -> CliResult<Vec<(String, CacheChoice)>> {
    let list = |o: &str| -> Vec<String> {
        a.options
            .get(o)
            .map(|v| v.split(',').map(str::to_string).collect())
            .unwrap_or_default()
    };
    let args: Vec<PlanArg> = list("plan")
        .into_iter()
        .map(PlanArg::File)
        .chain(list("preset").into_iter().map(PlanArg::Preset))
        .collect();
    if args.is_empty() {
        let d = CacheConfig::default();
        let sweep = standard_sweep(a.get("window", d.window)?, a.get("sinks", d.sinks)?);
        for (_, c) in &sweep {
            if let CacheChoice::XQuant(c) = c {
                c.validate(head_dim)?;
            }
        }
        return Ok(sweep);
    }
    let mut rows = vec![("f16".to_string(), CacheChoice::F16)];
    for arg in &args {
        let plan = resolve_plan(a, arg, layers, head_dim)?;
        rows.push((plan.name.clone(), CacheChoice::Plan(plan)));
    }
    Ok(rows)
}

/// Tokens `xquant eval` reads from the text by default.
const DEFAULT_EVAL_TOKENS: usize = 1024;

/// A warning when the window (and sinks) kept most of the text unquantized in some XQuant
/// row (the row then measures the window more than the quantization).
fn window_warning(rows: &[EvalRow], tokens: usize) -> Option<String> {
    let worst = rows
        .iter()
        .filter(|r| r.cache != CacheChoice::F16)
        .max_by(|a, b| a.unquantized_share.total_cmp(&b.unquantized_share))?;
    (worst.unquantized_share > 0.5).then(|| {
        format!(
            "the f16 window and sinks of `{}` kept {:.0}% of the {tokens} tokens unquantized at \
             the end: the XQuant rows mostly measure the window (use more --tokens or a smaller \
             --window)",
            worst.name,
            100.0 * worst.unquantized_share
        )
    })
}

/// The f16 window of an XQuant choice.
fn window_of(choice: &CacheChoice, layers: usize, head_dim: usize) -> CliResult<usize> {
    Ok(choice.plan(layers, head_dim)?.map_or(0, |(p, _)| p.window))
}

pub fn cmd_bench_model(raw: &[String]) -> CliResult<()> {
    let a = Args::parse(
        raw,
        &options(&["contexts", "steps", "text"]),
        &["json", "profile"],
    )?;
    a.no_positional("bench-model")?;
    if a.options.contains_key("cache") {
        return usage("bench-model compares XQuant with f16; --cache is not an option here");
    }
    let contexts =
        super::bench_cmds::parse_list("contexts", &a.get("contexts", "1024,4096".to_string())?)?;
    let steps: usize = a.get("steps", 8)?;
    if contexts.contains(&0) || steps == 0 {
        return usage("--contexts and --steps must be at least 1");
    }
    let rt = load(&a)?;
    let xquant = cache_choice_xquant(&a, rt.model.cfg.layers, rt.model.cfg.head_dim)?;
    let text = match a.options.get("text") {
        Some(_) => read_text(&a)?,
        None => "The quick brown fox jumps over the lazy dog. ".repeat(8),
    };
    let ids = rt.tokenizer.encode_prompt(&text, false);
    let rows = xquant_wgpu::model::bench::bench_decode(
        &rt,
        &ids,
        &contexts,
        steps,
        &xquant,
        a.flag("profile"),
    )?;
    let adapter = rt.model.context().adapter().to_string();
    let date = super::bench_cmds::today();
    if a.flag("json") {
        print_json(&json!({"adapter": adapter, "date": date, "steps": steps,
            "attention_launches": super::bench_cmds::attention_launches(rt.model.context()),
            "xquant": xquant.describe(),
            "plan": xquant.plan(rt.model.cfg.layers, rt.model.cfg.head_dim)?.map(|(p, _)| p.to_json()),
            "rows": rows.iter().map(|r| json!({"context": r.context,
                "xquant_tokens_per_s": r.xquant_tokens_per_s, "fp16_tokens_per_s": r.fp16_tokens_per_s,
                "speed_ratio": r.speed_ratio, "xquant_kv_bytes": r.xquant_kv_bytes,
                "xquant_prefill_tokens_per_s": r.xquant_prefill_tokens_per_s,
                "fp16_prefill_tokens_per_s": r.fp16_prefill_tokens_per_s,
                "fp16_kv_bytes": r.fp16_kv_bytes, "xquant_scratch_bytes": r.xquant_scratch_bytes,
                "xquant_launches": r.launches[0], "fp16_launches": r.launches[1],
                "xquant_profile": r.profile.as_ref().map(|p| super::bench_cmds::profile_json(&p[0])),
                "fp16_profile": r.profile.as_ref().map(|p| super::bench_cmds::profile_json(&p[1])),
                "xquant_prefill_profile": r.prefill_profile.as_ref().map(|p| super::bench_cmds::profile_json(&p[0])),
                "fp16_prefill_profile": r.prefill_profile.as_ref().map(|p| super::bench_cmds::profile_json(&p[1]))}))
                .collect::<Vec<_>>()}));
        return Ok(());
    }
    println!("adapter: {adapter} ({date}); XQuant {} window {}; median of {steps} decode steps, XQuant and f16 alternating",
        xquant.describe(), window_of(&xquant, rt.model.cfg.layers, rt.model.cfg.head_dim)?);
    println!(
        "{}",
        super::bench_cmds::attention_launches_line(rt.model.context())
    );
    println!("| context | XQuant prefill tokens/s | f16 prefill tokens/s | XQuant tokens/s | f16 tokens/s | XQuant / f16 speed | XQuant KV bytes | f16 KV bytes | memory vs f16 | launches per step XQuant / f16 |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {} | {} | {:.2} | {} / {} |",
            r.context,
            r.xquant_prefill_tokens_per_s,
            r.fp16_prefill_tokens_per_s,
            r.xquant_tokens_per_s,
            r.fp16_tokens_per_s,
            r.speed_ratio,
            r.xquant_kv_bytes,
            r.fp16_kv_bytes,
            r.xquant_kv_bytes as f64 / r.fp16_kv_bytes as f64,
            r.launches[0],
            r.launches[1]
        );
    }
    for r in &rows {
        let context = format!("{} tokens", r.context);
        super::bench_cmds::print_profiles(&context, r.profile.as_ref());
        let prefill = format!("prefill of {} tokens", r.context);
        super::bench_cmds::print_profiles(&prefill, r.prefill_profile.as_ref());
    }
    Ok(())
}

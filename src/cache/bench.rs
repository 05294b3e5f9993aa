//! Cache benchmark: decode steps, a prefill and memory on a SmolLM2-shaped model, the XQuant
//! set against the plain f16 cache on the same device in the same run.

use std::sync::Arc;
use std::time::Instant;

use crate::cache::{
    AttendOptions, CacheOptions, CachePlan, CacheSet, Fp16CacheSet, KvCache, KvInput, ModelSpec,
    Scope,
};
use crate::config::DType;
use crate::error::{Result, XqError};
use crate::gpu::kernels::bench::median;
use crate::gpu::{GpuContext, GpuTensor, KernelTime};

/// One measured context length.
#[derive(Clone, Debug)]
pub struct DecodeRow {
    /// Tokens in each layer's cache before the timed steps.
    pub context: usize,
    /// A decode step through attention (one token appended to every layer, then every
    /// layer's query heads attend over its cache; one submission), or the part of it that
    /// [`CacheBench::part`] names: XQuant (`a`) and f16 (`b`).
    pub attend: Paired,
    /// A decode step through `update_and_fetch` (append one token to every layer and rebuild
    /// its dense K/V), when measured.
    pub fetch: Option<Paired>,
    /// XQuant: GPU bytes of all layers per cached token (storage only).
    pub xquant_bytes_per_token: f64,
    /// f16 cache: the same (buffers grow by doubling, so capacity can exceed use).
    pub fp16_bytes_per_token: f64,
    /// XQuant: scratch bytes after the attention steps (partials; no dense K/V).
    pub xquant_scratch: u64,
    /// f16 cache: the same.
    pub fp16_scratch: u64,
    /// XQuant: reference-accounted effective bits (window at 16 bits).
    pub effective_bits: f64,
    /// Kernel launches of one attention step (or its part): XQuant, f16. On a GPU a step of
    /// a small model costs about its launches rather than its bytes.
    pub launches: [u64; 2],
    /// The first attention step at this context, XQuant's then f16's, untimed by the median:
    /// what a runtime's first decode step of this length costs, the pipelines that step
    /// builds included.
    pub first_step: [FirstStep; 2],
    /// With `profile`: GPU time of an attention step by kernel (per kernel the median of
    /// the steps `profile_pair` profiles, seven a cache), XQuant and f16.
    pub profile: Option<[Vec<KernelTime>; 2]>,
}

/// Steps of each cache timed launch by launch with `profile`.
pub const PROFILED_STEPS: usize = 7;

/// Which part of a decode step [`bench_cache`] times (and counts and profiles) for both
/// caches: the whole step, or one of its two launches a layer alone, to tell which of them
/// makes a ratio (on a shared host a part's ratio also scatters less than the step's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StepPart {
    /// Every layer appends one token, then attends (a decode step).
    #[default]
    Whole,
    /// Every layer attends, appending nothing: the caches keep their tokens.
    Attention,
    /// Every layer appends one token, attending nothing.
    Appends,
}

impl StepPart {
    /// Every part, the default first.
    pub const ALL: [StepPart; 3] = [StepPart::Whole, StepPart::Attention, StepPart::Appends];

    /// `step`, `attention` or `appends`.
    pub fn name(self) -> &'static str {
        match self {
            StepPart::Whole => "step",
            StepPart::Attention => "attention",
            StepPart::Appends => "appends",
        }
    }

    fn appends(self) -> bool {
        self != StepPart::Attention
    }

    fn attends(self) -> bool {
        self != StepPart::Appends
    }
}

/// A cache's first attention step at a context: its wall time to the GPU's idle and the
/// pipelines it built (attention's kernels are built on first use, one per shape; on a CPU
/// adapter building one takes from tens of milliseconds to a second, and a driver's shader
/// cache, such as Mesa's on disk, can make a repeated run's builds cheaper).
#[derive(Clone, Copy, Debug, Default)]
pub struct FirstStep {
    /// Milliseconds.
    pub ms: f64,
    /// Pipelines built.
    pub pipelines: usize,
}

/// The first attention step of `cache` (the step is taken): its kernel launches, and its time
/// and the pipelines it built ([`FirstStep`]).
fn first_step(
    cache: &mut dyn KvCache,
    part: StepPart,
    one: &GpuTensor,
    queries: &GpuTensor,
    out: &GpuTensor,
) -> Result<(u64, FirstStep)> {
    let ctx = cache.context().clone();
    ctx.wait_idle()?;
    let (launches, pipelines) = (ctx.launches_recorded(), ctx.pipeline_count());
    let start = Instant::now();
    attend_step(cache, part, one, queries, out)?;
    ctx.wait_idle()?;
    let first = FirstStep {
        ms: start.elapsed().as_secs_f64() * 1e3,
        pipelines: ctx.pipeline_count() - pipelines,
    };
    Ok((ctx.launches_recorded() - launches, first))
}

/// GPU time by kernel of an attention step of each cache (XQuant, f16): [`PROFILED_STEPS`]
/// steps of each, profiled one at a time with the two caches alternating, and per kernel the
/// median of its steps' times and launches ([`median_by_kernel`]). A host whose speed drifts
/// (a shared machine's CPU, a GPU's clocks) moves both caches' steps alike, and a slow step
/// moves no median; a mean over consecutive steps of one cache, then the other's, let one
/// burst of load decide which kernel looked slower.
fn profile_pair(
    caches: [&mut dyn KvCache; 2],
    part: StepPart,
    one: &GpuTensor,
    queries: &GpuTensor,
    out: &GpuTensor,
) -> Result<[Vec<KernelTime>; 2]> {
    let mut steps: [Vec<Vec<KernelTime>>; 2] = Default::default();
    let [xq, f16] = caches;
    for _ in 0..PROFILED_STEPS {
        for (cache, into) in [&mut *xq, &mut *f16].into_iter().zip(&mut steps) {
            let ctx = cache.context().clone();
            let ((), times) = ctx.profiled(|| attend_step(cache, part, one, queries, out))?;
            into.push(times);
        }
    }
    Ok(steps.map(|s| median_by_kernel(&s)))
}

/// Per kernel of any of `steps` (profiles of one step each), the median of its time and of
/// its launches over the steps (0 in a step without it: a kernel that runs in a minority of
/// the steps, such as a quantization as tokens leave the window, has a median of 0 and is
/// left out), in the order kernels first appear.
fn median_by_kernel(steps: &[Vec<KernelTime>]) -> Vec<KernelTime> {
    let mut kernels: Vec<&str> = Vec::new();
    for t in steps.iter().flatten() {
        if !kernels.contains(&t.kernel.as_str()) {
            kernels.push(&t.kernel);
        }
    }
    kernels
        .into_iter()
        .filter_map(|kernel| {
            let over_steps = |value: fn(&KernelTime) -> f64| {
                let of =
                    |s: &Vec<KernelTime>| s.iter().find(|t| t.kernel == kernel).map_or(0.0, value);
                median(steps.iter().map(of).collect())
            };
            let micros = over_steps(|t| t.micros);
            let launches = over_steps(|t| t.launches as f64);
            (launches > 0.0).then(|| KernelTime {
                kernel: kernel.to_string(),
                launches: launches.round() as usize,
                micros,
            })
        })
        .collect()
}

/// A timed prefill.
#[derive(Clone, Debug)]
pub struct PrefillRow {
    /// Tokens per layer.
    pub tokens: usize,
    /// XQuant: milliseconds to append them to every layer.
    pub xquant_ms: f64,
    /// f16 cache: the same.
    pub fp16_ms: f64,
}

/// GPU memory of both caches holding the same tokens.
#[derive(Clone, Debug)]
pub struct MemoryRow {
    /// Tokens per layer.
    pub tokens: usize,
    /// XQuant: storage + scratch bytes after an attention step.
    pub xquant_bytes: u64,
    /// f16 cache: the same (its buffers grow by doubling, so they may hold up to twice the
    /// tokens).
    pub fp16_bytes: u64,
    /// An f16 cache sized exactly to the tokens (no growth slack), plus its scratch: the
    /// tightest f16 baseline.
    pub fp16_exact_bytes: u64,
}

/// What `bench-cache` measures.
#[derive(Clone, Debug)]
pub struct CacheBench {
    /// The model shape.
    pub model: ModelSpec,
    /// Query heads per layer (a multiple of the KV heads).
    pub q_heads: usize,
    /// The XQuant cache's plan.
    pub plan: CachePlan,
    /// Its other options (`max_ctx` also bounds the f16 cache; `output` is both caches').
    pub options: CacheOptions,
    /// Context lengths of the decode rows.
    pub contexts: Vec<usize>,
    /// Timed steps per context of 1024 tokens or more; shorter contexts, whose steps are
    /// short and noisy, run more (`steps_at`).
    pub steps: usize,
    /// Tokens of the timed prefill.
    pub prefill: usize,
    /// Also time the dense `update_and_fetch` step.
    pub dense: bool,
    /// Also time each launch of `PROFILED_STEPS` steps on the GPU (timestamp queries).
    pub profile: bool,
    /// The part of a decode step timed, counted and profiled (the memory rows take whole
    /// steps).
    pub part: StepPart,
    /// Token counts of the memory rows.
    pub memory: Vec<usize>,
}

/// The results.
#[derive(Clone, Debug)]
pub struct CacheBenchResult {
    /// Decode steps per context.
    pub decode: Vec<DecodeRow>,
    /// The prefill.
    pub prefill: PrefillRow,
    /// Memory per token count.
    pub memory: Vec<MemoryRow>,
}

fn random_tokens(
    ctx: &GpuContext,
    model: &ModelSpec,
    tokens: usize,
    seed: u64,
) -> Result<GpuTensor> {
    let n = model.rows() * tokens * model.head_dim;
    let dims = [model.batch, model.kv_heads, tokens, model.head_dim];
    ctx.upload(
        &crate::synth::normal(n, seed),
        &dims,
        DType::F16,
        crate::ParamsPrecision::F16,
    )
}

/// Cache `0` (XQuant) or `1` (f16).
fn new_cache(
    ctx: &Arc<GpuContext>,
    model: ModelSpec,
    plan: &CachePlan,
    options: CacheOptions,
    which: usize,
) -> Result<Box<dyn KvCache>> {
    Ok(match which {
        0 => Box::new(CacheSet::for_plan(
            ctx.clone(),
            model,
            plan.clone(),
            options,
        )?),
        _ => Box::new(Fp16CacheSet::for_model(
            ctx.clone(),
            model,
            options.max_ctx,
            options.output,
        )?),
    })
}

/// Appends `x` to every layer.
fn fill(cache: &mut dyn KvCache, x: &GpuTensor) -> Result<()> {
    for layer in 0..cache.model().layers {
        pollster::block_on(cache.append(layer, KvInput::Gpu(x), KvInput::Gpu(x)))?;
    }
    Ok(())
}

/// One decode step through attention, or the `part` of it: every layer appends `one` and
/// attends `queries` into `out`, all in one submission.
fn attend_step(
    cache: &mut dyn KvCache,
    part: StepPart,
    one: &GpuTensor,
    queries: &GpuTensor,
    out: &GpuTensor,
) -> Result<()> {
    let ctx = cache.context().clone();
    let checkpoint = cache.checkpoint(Scope::All);
    let step = pollster::block_on(ctx.run("decode step", |enc| {
        for layer in 0..cache.model().layers {
            if part.appends() {
                cache.encode_append(enc, layer, one, one)?;
            }
            if part.attends() {
                cache.encode_attend(enc, layer, queries, out, &AttendOptions::default())?;
            }
        }
        Ok(())
    }));
    if step.is_err() {
        cache.rollback(checkpoint);
    }
    step
}

/// One decode step through `update_and_fetch`: every layer appends `one` and rebuilds its
/// dense K/V.
fn fetch_step(cache: &mut dyn KvCache, one: &GpuTensor) -> Result<()> {
    for layer in 0..cache.model().layers {
        pollster::block_on(cache.update_and_fetch(layer, KvInput::Gpu(one), KvInput::Gpu(one)))?;
    }
    Ok(())
}

/// Milliseconds of one call of `step`, run to completion.
fn time_once(ctx: &GpuContext, step: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    ctx.wait_idle()?;
    let start = Instant::now();
    step()?;
    ctx.wait_idle()?;
    Ok(start.elapsed().as_secs_f64() * 1e3)
}

/// Timings of two steps measured in alternation.
#[derive(Clone, Copy, Debug)]
pub struct Paired {
    /// Median milliseconds of the first.
    pub a_ms: f64,
    /// Median milliseconds of the second.
    pub b_ms: f64,
    /// Median of the per-pair ratios first / second (each pair timed back to back, so a busy
    /// spell of a shared machine cancels out).
    pub ratio: f64,
}

/// Times `steps` calls of `a` and of `b`, alternating, after one untimed call of each.
fn time_pair(
    ctx: &GpuContext,
    steps: usize,
    a: &mut dyn FnMut() -> Result<()>,
    b: &mut dyn FnMut() -> Result<()>,
) -> Result<Paired> {
    a()?;
    b()?;
    let (mut ta, mut tb, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..steps {
        let (x, y) = (time_once(ctx, a)?, time_once(ctx, b)?);
        ta.push(x);
        tb.push(y);
        ratios.push(x / y);
    }
    Ok(Paired {
        a_ms: median(ta),
        b_ms: median(tb),
        ratio: median(ratios),
    })
}

/// Timed steps at `context`: `steps` from 1024 tokens on, more below (up to 4×), so a short
/// context's median rests on about as much time as a long one's.
pub fn steps_at(steps: usize, context: usize) -> usize {
    steps * (1024 / context.max(1)).clamp(1, 4)
}

/// The tokens a layer of either cache holds at most during [`bench_cache`]: a prefill or a
/// memory count of `longest` tokens, or a context of `contexts` with its decode steps (one
/// whose launches are counted, an untimed one, then `steps_at` timed ones; the last two
/// twice with `dense`; then `PROFILED_STEPS` of each with `profile`).
pub fn max_tokens(
    contexts: &[usize],
    longest: usize,
    steps: usize,
    dense: bool,
    profile: bool,
) -> usize {
    let passes = if dense { 2 } else { 1 };
    let profiled = if profile { PROFILED_STEPS } else { 0 };
    contexts
        .iter()
        .map(|&c| c + 1 + passes * (steps_at(steps, c) + 1) + profiled)
        .fold(longest, usize::max)
}

/// Decode steps at each context, a timed prefill, and memory at each token count.
pub fn bench_cache(ctx: &Arc<GpuContext>, b: &CacheBench) -> Result<CacheBenchResult> {
    let (model, plan, options) = (b.model, &b.plan, b.options);
    if b.q_heads == 0 || b.q_heads % model.kv_heads != 0 {
        return Err(XqError::Config(format!(
            "query heads ({}) must be a positive multiple of the KV heads ({})",
            b.q_heads, model.kv_heads
        )));
    }
    let one = random_tokens(ctx, &model, 1, 2)?;
    let qdims = [model.batch, b.q_heads, 1, model.head_dim];
    let n = model.batch * b.q_heads * model.head_dim;
    let queries = ctx.upload(
        &crate::synth::normal(n, 4),
        &qdims,
        DType::F32,
        crate::ParamsPrecision::F32,
    )?;
    let out = ctx.upload(
        &vec![0.0; n],
        &qdims,
        DType::F32,
        crate::ParamsPrecision::F32,
    )?;
    let mut decode = Vec::new();
    for &context in &b.contexts {
        let history = random_tokens(ctx, &model, context, 1)?;
        let mut xq = new_cache(ctx, model, plan, options, 0)?;
        let mut f16 = new_cache(ctx, model, plan, options, 1)?;
        fill(xq.as_mut(), &history)?;
        fill(f16.as_mut(), &history)?;
        drop(history);
        let per_token = |c: &dyn KvCache| c.storage_bytes() as f64 / context as f64;
        let bytes_per_token = [per_token(xq.as_ref()), per_token(f16.as_ref())];
        let steps = steps_at(b.steps, context);
        let (xq_first, f16_first) = (
            first_step(xq.as_mut(), b.part, &one, &queries, &out)?,
            first_step(f16.as_mut(), b.part, &one, &queries, &out)?,
        );
        let launches = [xq_first.0, f16_first.0];
        let attend = time_pair(
            ctx,
            steps,
            &mut || attend_step(xq.as_mut(), b.part, &one, &queries, &out),
            &mut || attend_step(f16.as_mut(), b.part, &one, &queries, &out),
        )?;
        let scratch = [xq.scratch_bytes(), f16.scratch_bytes()];
        let effective_bits = xq.effective_bits();
        let fetch = if b.dense {
            Some(time_pair(
                ctx,
                steps,
                &mut || fetch_step(xq.as_mut(), &one),
                &mut || fetch_step(f16.as_mut(), &one),
            )?)
        } else {
            None
        };
        let profile = if b.profile {
            Some(profile_pair(
                [xq.as_mut(), f16.as_mut()],
                b.part,
                &one,
                &queries,
                &out,
            )?)
        } else {
            None
        };
        decode.push(DecodeRow {
            context,
            attend,
            fetch,
            xquant_bytes_per_token: bytes_per_token[0],
            fp16_bytes_per_token: bytes_per_token[1],
            xquant_scratch: scratch[0],
            fp16_scratch: scratch[1],
            effective_bits,
            launches,
            first_step: [xq_first.1, f16_first.1],
            profile,
        });
    }
    let tokens = random_tokens(ctx, &model, b.prefill, 3)?;
    let mut ms = [0.0; 2];
    for (i, slot) in ms.iter_mut().enumerate() {
        // A throwaway set compiles the pipelines first.
        let mut warm = new_cache(ctx, model, plan, options, i)?;
        pollster::block_on(warm.append(0, KvInput::Gpu(&tokens), KvInput::Gpu(&tokens)))?;
        drop(warm);
        let mut cache = new_cache(ctx, model, plan, options, i)?;
        ctx.wait_idle()?;
        let start = Instant::now();
        fill(cache.as_mut(), &tokens)?;
        ctx.wait_idle()?;
        *slot = start.elapsed().as_secs_f64() * 1e3;
    }
    let mut memory = Vec::new();
    for &n in &b.memory {
        let mut bytes = [0; 2];
        let mut fp16_scratch = 0;
        for (i, slot) in bytes.iter_mut().enumerate() {
            let mut cache = new_cache(ctx, model, plan, options, i)?;
            // A decode step's worth: the history, then one token appended and attended.
            if n > 1 {
                let head = random_tokens(ctx, &model, n - 1, 5)?;
                fill(cache.as_mut(), &head)?;
            }
            attend_step(cache.as_mut(), StepPart::Whole, &one, &queries, &out)?;
            *slot = cache.storage_bytes() + cache.scratch_bytes();
            fp16_scratch = cache.scratch_bytes();
        }
        let d_even = model.head_dim.next_multiple_of(2);
        let exact = (model.layers * 2 * model.rows() * n * d_even * 2) as u64;
        memory.push(MemoryRow {
            tokens: n,
            xquant_bytes: bytes[0],
            fp16_bytes: bytes[1],
            fp16_exact_bytes: exact + fp16_scratch,
        });
    }
    Ok(CacheBenchResult {
        decode,
        prefill: PrefillRow {
            tokens: b.prefill,
            xquant_ms: ms[0],
            fp16_ms: ms[1],
        },
        memory,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn time(kernel: &str, launches: usize, micros: f64) -> KernelTime {
        KernelTime {
            kernel: kernel.to_string(),
            launches,
            micros,
        }
    }

    #[test]
    fn a_profile_takes_each_kernels_median_over_the_steps() {
        let steps = vec![
            vec![time("attend", 30, 900.0), time("append", 30, 50.0)],
            vec![time("append", 30, 70.0), time("attend", 30, 100.0)],
            // A slow step, and a quantization in one step of three.
            vec![
                time("attend", 30, 120.0),
                time("append", 30, 400.0),
                time("quantize", 2, 9.0),
            ],
        ];
        let m = median_by_kernel(&steps);
        let got: Vec<(&str, usize, f64)> = m
            .iter()
            .map(|t| (t.kernel.as_str(), t.launches, t.micros))
            .collect();
        assert_eq!(got, [("attend", 30, 120.0), ("append", 30, 70.0)]);
        // Even counts: the mean of the middle two; a kernel in half the steps stays.
        let m = median_by_kernel(&steps[1..]);
        let got: Vec<(&str, usize, f64)> = m
            .iter()
            .map(|t| (t.kernel.as_str(), t.launches, t.micros))
            .collect();
        assert_eq!(
            got,
            [
                ("append", 30, 235.0),
                ("attend", 30, 110.0),
                ("quantize", 1, 4.5)
            ]
        );
        assert!(median_by_kernel(&[]).is_empty());
    }
}

//! Soak: 10,000 decode steps (append one token to every layer, attend with every query head;
//! one submission per step) of a SmolLM2-shaped cache set, tracking the set's allocated
//! bytes against what its plan accounts at the same token count, its scratch, and the bytes
//! the library holds on the device.
//!
//! `cargo run --release --example soak -- [--steps 10000] [--every 500]`
//! Prints one JSON line per checkpoint, then a summary line; exits non-zero when the
//! device holds bytes the set and this program do not account for, or the set's allocated
//! bytes leave `[accounted, accounted + slack_bound]`.

use std::sync::Arc;
use std::time::Instant;

use xquant_wgpu::cache::{CacheConfig, CacheSet, KvCache, ModelSpec, Scope};
use xquant_wgpu::gpu::{ContextOptions, GpuContext, GpuTensor};
use xquant_wgpu::{ParamsPrecision, Result};

const MODEL: ModelSpec = ModelSpec {
    layers: 30,
    kv_heads: 3,
    head_dim: 64,
    batch: 1,
};
const QUERY_HEADS: usize = 9;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<()> {
    let steps = arg("--steps", 10_000);
    let every = arg("--every", 500).max(1);
    let ctx = Arc::new(pollster::block_on(GpuContext::new(
        &ContextOptions::default(),
    ))?);
    let config = CacheConfig {
        max_ctx: steps,
        ..CacheConfig::default()
    };
    let plan = config.plan(MODEL.layers, MODEL.head_dim)?;
    let mut set = CacheSet::for_plan(ctx.clone(), MODEL, plan.clone(), config.options())?;
    let token = |seed| -> Result<GpuTensor> {
        let n = MODEL.rows() * MODEL.head_dim;
        let x = xquant_wgpu::synth::normal(n, seed);
        ctx.upload_f32(
            &x,
            &[1, MODEL.kv_heads, 1, MODEL.head_dim],
            ParamsPrecision::F16,
        )
    };
    // A pool of distinct tokens, cycled (the data does not matter to memory).
    let pool: Vec<(GpuTensor, GpuTensor)> = (0..16)
        .map(|i| Ok((token(2 * i)?, token(2 * i + 1)?)))
        .collect::<Result<_>>()?;
    let q = xquant_wgpu::synth::normal(QUERY_HEADS * MODEL.head_dim, 99);
    let queries = ctx.upload_f32(
        &q,
        &[1, QUERY_HEADS, 1, MODEL.head_dim],
        ParamsPrecision::F32,
    )?;
    let out = ctx.upload_f32(
        &vec![0.0; q.len()],
        &[1, QUERY_HEADS, 1, MODEL.head_dim],
        ParamsPrecision::F32,
    )?;
    let (rows, dim) = (MODEL.rows(), MODEL.head_dim);
    let start = Instant::now();
    let mut worst_ratio: f64 = 0.0;
    let mut unaccounted_max = 0i64;
    let mut scratch_prev = 0u64;
    let mut scratch_growths = Vec::new();
    let mut out_of_bounds = Vec::new();
    for step in 1..=steps {
        let (k, v) = &pool[step % pool.len()];
        // Kept until the submission is made: it holds buffers the step replaces.
        let _checkpoint = set.checkpoint(Scope::All);
        pollster::block_on(ctx.run("decode step", |enc| {
            for l in 0..MODEL.layers {
                set.encode_append(enc, l, k, v)?;
                set.encode_attend(enc, l, &queries, &out, &Default::default())?;
            }
            Ok(())
        }))?;
        ctx.wait_idle()?;
        if step % every == 0 || step == steps {
            let st = set.stats();
            let planned = plan.bytes_at(step, rows, dim);
            let ratio = st.allocated_bytes as f64 / planned.total as f64;
            let held = ctx.allocated_bytes() as i64;
            // Everything the device holds: the set, its scratch, the inputs of this program.
            let inputs = (pool.len() * 2 * k.byte_len() as usize) as i64
                + (queries.byte_len() + out.byte_len()) as i64;
            let unaccounted = held - (st.allocated_bytes + st.scratch_bytes) as i64 - inputs;
            // The set's own promise: accounted <= allocated <= accounted + its slack bound.
            let slack: u64 = (0..MODEL.layers).map(|l| set.slack_bound(l)).sum();
            if st.allocated_bytes < st.accounted_bytes
                || st.allocated_bytes > st.accounted_bytes + slack
            {
                out_of_bounds.push(step);
            }
            unaccounted_max = unaccounted_max.max(unaccounted.abs());
            if step > 2048 {
                worst_ratio = worst_ratio.max(ratio);
            }
            if st.scratch_bytes > scratch_prev && step > every {
                scratch_growths.push((step, st.scratch_bytes));
            }
            scratch_prev = st.scratch_bytes;
            println!(
                "{{\"step\": {step}, \"tokens\": {}, \"allocated_bytes\": {}, \"plan_bytes\": {}, \
                 \"ratio\": {ratio:.4}, \"fp16_bytes\": {}, \"scratch_bytes\": {}, \
                 \"device_bytes\": {held}, \"unaccounted_bytes\": {unaccounted}, \"seconds\": {:.1}}}",
                set.tokens(0),
                st.allocated_bytes,
                planned.total,
                st.fp16_bytes,
                st.scratch_bytes,
                start.elapsed().as_secs_f64()
            );
        }
    }
    let scratch_growths: Vec<[u64; 2]> = scratch_growths
        .into_iter()
        .map(|(step, bytes)| [step as u64, bytes])
        .collect();
    println!(
        "{{\"summary\": true, \"steps\": {steps}, \"adapter\": \"{}\", \
         \"worst_allocated_over_plan_past_2048\": {worst_ratio:.4}, \"max_unaccounted_bytes\": \
         {unaccounted_max}, \"outside_slack_bound_at\": {out_of_bounds:?}, \"scratch_growths\": \
         {scratch_growths:?}, \"seconds\": {:.1}}}",
        ctx.adapter(),
        start.elapsed().as_secs_f64()
    );
    if unaccounted_max != 0 || !out_of_bounds.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}

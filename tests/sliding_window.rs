//! Sliding-window layers (Gemma 3's local layers) in both cache sets: attention within the
//! window equal to a set that keeps everything, fetches equal to its last tokens, memory
//! flat to 4× the window, save/restore, and the refusals.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use std::sync::Arc;

use common::gpu::{assert_no_gpu_errors, block};
use xquant_wgpu::cache::{
    restore_cache, AttendOptions, CacheOptions, CachePlan, CacheSet, CodeSource, DecodePolicy,
    Fp16CacheSet, KvCache, KvInput, ModelSpec, TensorPlan,
};
use xquant_wgpu::gpu::{GpuContext, GpuTensor};
use xquant_wgpu::synth::SplitMix;
use xquant_wgpu::{DType, ParamsPrecision, XqError};

/// The attention window of the sliding layers below.
const A: usize = 40;
/// Layers 0 and 1 slide (1 borrows 0's key codes), layer 2 is global.
const WINDOWS: [Option<usize>; 3] = [Some(A), Some(A), None];
/// Largest difference between the fused attention of a sliding layer and of a set that
/// keeps every token, masked to the same window: the same codes read in other chunks.
const ATTEND_TOLERANCE: f32 = 2e-4;

fn model() -> ModelSpec {
    ModelSpec {
        layers: 3,
        kv_heads: 2,
        head_dim: 16,
        batch: 1,
    }
}

/// KIVI-2 with 3 sinks, window 16, groups of 8; layer 1's keys borrow layer 0's codes.
fn plan(windows: bool) -> CachePlan {
    let mut plan = CachePlan::preset("kivi-2", 3).unwrap();
    plan.window = 16;
    plan.sinks = 3;
    plan.group_quant_size = 8;
    plan.layers[1].key = TensorPlan {
        codes: CodeSource::Layer(0),
        residual_bits: 2,
        ..plan.layers[0].key
    };
    if windows {
        plan = plan.with_model_windows(&WINDOWS);
    }
    plan.validate().unwrap();
    plan
}

fn options() -> CacheOptions {
    CacheOptions {
        max_ctx: 1024,
        output: DType::F32,
        ..Default::default()
    }
}

fn xquant(ctx: &Arc<GpuContext>, windows: bool) -> CacheSet {
    CacheSet::for_plan(ctx.clone(), model(), plan(windows), options()).unwrap()
}

fn fp16(ctx: &Arc<GpuContext>, windows: bool) -> Fp16CacheSet {
    let set = Fp16CacheSet::for_model(ctx.clone(), model(), 1024, DType::F32).unwrap();
    match windows {
        true => set.with_attention_windows(&WINDOWS).unwrap(),
        false => set,
    }
}

/// Call sizes: a prefill, chunks (the largest: 40) and single tokens up to 110 tokens, then
/// single tokens (decode) past 4×A.
fn steps() -> Vec<usize> {
    let mut s = vec![29, 40];
    s.extend(std::iter::repeat_n(1, 11));
    s.extend([13, 1, 7, 9]);
    s.extend(std::iter::repeat_n(1, 65));
    s
}

fn normal(g: &mut SplitMix, n: usize) -> Vec<f32> {
    (0..n).map(|_| g.normal()).collect()
}

fn read(ctx: &GpuContext, t: &GpuTensor) -> Vec<f32> {
    block(ctx.read_f32(t)).unwrap()
}

/// Appends the same tokens to `slide` (sliding layers) and `full` (keeps every token) and
/// after every call compares each layer's attention (queries: the call's tokens, `full`
/// masked to the layer's window) and fetch (`slide`'s = `full`'s last held tokens).
/// Returns the sliding layers' storage bytes (`sliding_bytes`) after each call, with the
/// tokens then.
fn compare<S: KvCache>(
    ctx: &Arc<GpuContext>,
    slide: &mut S,
    full: &mut S,
    steps: &[usize],
    seed: u64,
    sliding_bytes: impl Fn(&S) -> u64,
) -> Vec<(usize, u64)> {
    let m = model();
    let (rows, dim, heads) = (m.rows(), m.head_dim, 2 * m.kv_heads);
    let mut g = SplitMix::new(seed);
    let mut memory = Vec::new();
    for (s, &t) in steps.iter().enumerate() {
        for (l, window) in WINDOWS.iter().enumerate() {
            let (k, v) = (
                normal(&mut g, rows * t * dim),
                normal(&mut g, rows * t * dim),
            );
            block(slide.append(l, KvInput::F32(&k), KvInput::F32(&v))).unwrap();
            block(full.append(l, KvInput::F32(&k), KvInput::F32(&v))).unwrap();
            let len = full.tokens(l);
            assert_eq!(slide.tokens(l), len);
            let held = slide.held_tokens(l);
            match window {
                None => assert_eq!(held, len, "a global layer holds everything"),
                Some(a) => assert!(
                    held >= len.min(*a) && held <= len,
                    "step {s} layer {l}: holds {held} of {len}"
                ),
            }
            let dims = [1, heads, t, dim];
            let q = normal(&mut g, heads * t * dim);
            let queries = ctx.upload_f32(&q, &dims, ParamsPrecision::F32).unwrap();
            let out = |ctx: &GpuContext| {
                ctx.upload_f32(&vec![0.0; q.len()], &dims, ParamsPrecision::F32)
                    .unwrap()
            };
            let (a, b) = (out(ctx), out(ctx));
            block(slide.attend(l, &queries, &a)).unwrap();
            let masked = AttendOptions {
                window: *window,
                ..Default::default()
            };
            block(full.attend_with(l, &queries, &b, masked)).unwrap();
            let (a, b) = (read(ctx, &a), read(ctx, &b));
            let worst = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max);
            assert!(
                worst <= ATTEND_TOLERANCE,
                "step {s} (+{t}, {len} tokens) layer {l}: attention differs by {worst}"
            );
            let fs = block(slide.fetch(l)).unwrap();
            let (sk, sv) = (read(ctx, &fs.keys), read(ctx, &fs.values));
            let ff = block(full.fetch(l)).unwrap();
            let (fk, fv) = (read(ctx, &ff.keys), read(ctx, &ff.values));
            for (what, got, all) in [("keys", sk, fk), ("values", sv, fv)] {
                for r in 0..rows {
                    let tail = &all[(r * len + len - held) * dim..(r + 1) * len * dim];
                    let got = &got[r * held * dim..(r + 1) * held * dim];
                    assert!(
                        got == tail,
                        "step {s} layer {l} row {r}: fetched {what} are not the last {held}"
                    );
                }
            }
        }
        memory.push((slide.tokens(0), sliding_bytes(slide)));
    }
    assert_no_gpu_errors(ctx);
    memory
}

/// Decode past 3×A never takes more storage than the calls before it (which include the
/// largest call: a ring or page holds the window plus one call's tokens).
fn assert_flat(what: &str, memory: &[(usize, u64)]) {
    let most = |lo: usize, hi: usize| {
        memory
            .iter()
            .filter(|(t, _)| (lo..hi).contains(t))
            .map(|m| m.1)
            .max()
            .unwrap()
    };
    let end = memory.last().unwrap().0;
    assert!(end >= 4 * A, "{what}: the run reaches {end} tokens");
    let (settled, later) = (most(0, 3 * A), most(3 * A, usize::MAX));
    assert!(
        later <= settled,
        "{what}: {later} bytes past 3×A, at most {settled} before"
    );
}

#[test]
fn xquant_sliding_layers_attend_and_fetch_like_a_full_set_and_stay_flat() {
    let ctx = gpu_or_skip!();
    let (mut slide, mut full) = (xquant(&ctx, true), xquant(&ctx, false));
    let sliding_bytes = |s: &CacheSet| {
        let st = s.stats();
        st.layers[0].allocated_bytes + st.layers[1].allocated_bytes
    };
    let memory = compare(&ctx, &mut slide, &mut full, &steps(), 7, sliding_bytes);
    assert_flat("xquant", &memory);
    let (s, f) = (slide.stats(), full.stats());
    let len = s.layers[0].tokens;
    // The sliding layers hold about their window, the global one everything.
    for l in 0..2 {
        let held = s.layers[l].held_tokens;
        assert!(held < len / 2, "layer {l} holds {held} of {len}");
        assert_eq!(
            s.layers[l].sink_tokens, 0,
            "the sinks fell out of the window"
        );
        assert!(s.layers[l].allocated_bytes < f.layers[l].allocated_bytes / 2);
        // Accounting counts what is held: its fp16 figure is the held tokens'.
        let element = (2 * model().rows() * model().head_dim * 2) as u64;
        assert_eq!(s.layers[l].fp16_bytes, held as u64 * element);
    }
    assert_eq!(s.layers[2], f.layers[2]);
}

#[test]
fn f16_sliding_layers_attend_and_fetch_like_a_full_set_and_stay_flat() {
    let ctx = gpu_or_skip!();
    let (mut slide, mut full) = (fp16(&ctx, true), fp16(&ctx, false));
    let sliding_bytes = |s: &Fp16CacheSet| s.layer_storage_bytes(0) + s.layer_storage_bytes(1);
    let memory = compare(&ctx, &mut slide, &mut full, &steps(), 8, sliding_bytes);
    assert_flat("f16", &memory);
    // Each sliding layer: a ring of at most the window plus the largest call (40), in
    // slots of 64; the global layer as in the full set.
    let m = model();
    let ring = (2 * m.rows() * m.head_dim * 2 * (A - 1 + 40).next_multiple_of(64)) as u64;
    for l in 0..2 {
        assert!(slide.layer_storage_bytes(l) <= ring);
        assert!(slide.layer_storage_bytes(l) < full.layer_storage_bytes(l));
    }
    assert_eq!(slide.layer_storage_bytes(2), full.layer_storage_bytes(2));
    // A whole prompt in one call leaves a ring that large; the next call moves the window into
    // a ring of its own size again (and attention and fetches stay right across the move).
    let (mut slide, mut full) = (fp16(&ctx, true), fp16(&ctx, false));
    compare(&ctx, &mut slide, &mut full, &[150, 1, 1, 3, 1], 9, |_| 0);
    let ring = (2 * m.rows() * m.head_dim * 2 * (A - 1 + 3).next_multiple_of(64)) as u64;
    assert!(
        slide.layer_storage_bytes(0) <= ring,
        "{}",
        slide.layer_storage_bytes(0)
    );
}

#[test]
fn saved_sliding_sets_continue_bit_for_bit() {
    let ctx = gpu_or_skip!();
    let m = model();
    let mut g = SplitMix::new(11);
    let sets: Vec<Box<dyn KvCache>> =
        vec![Box::new(xquant(&ctx, true)), Box::new(fp16(&ctx, true))];
    for mut original in sets {
        let feed = |set: &mut dyn KvCache, g: &mut SplitMix, t: usize| {
            for l in 0..m.layers {
                let n = m.rows() * t * m.head_dim;
                let (k, v) = (normal(g, n), normal(g, n));
                block(set.append(l, KvInput::F32(&k), KvInput::F32(&v))).unwrap();
            }
        };
        for t in [60, 1, 1, 50, 1] {
            feed(original.as_mut(), &mut g, t);
        }
        let bytes = block(original.save()).unwrap();
        let mut restored = block(restore_cache(ctx.clone(), &bytes)).unwrap();
        for t in [1, 30, 1, 1] {
            let mut twin = g.clone();
            feed(original.as_mut(), &mut g, t);
            feed(restored.as_mut(), &mut twin, t);
        }
        for l in 0..m.layers {
            assert_eq!(restored.tokens(l), original.tokens(l));
            assert_eq!(restored.held_tokens(l), original.held_tokens(l));
            let a = block(original.fetch(l)).unwrap();
            let (ak, av) = (read(&ctx, &a.keys), read(&ctx, &a.values));
            let b = block(restored.fetch(l)).unwrap();
            assert!(
                ak == read(&ctx, &b.keys) && av == read(&ctx, &b.values),
                "layer {l}"
            );
        }
        assert_eq!(restored.storage_bytes(), original.storage_bytes());
    }
    assert_no_gpu_errors(&ctx);
}

#[test]
fn sliding_windows_are_refused_where_they_cannot_work() {
    let ctx = gpu_or_skip!();
    // Codes shared across a sliding/global boundary.
    let mut p = plan(true);
    p.layers[2].value = TensorPlan {
        codes: CodeSource::Layer(0),
        ..p.layers[0].value
    };
    let e = p.validate().unwrap_err();
    assert!(matches!(e, XqError::Config(_)) && e.message().contains("attention window"));
    // The reference policy keeps every token.
    let reference = CacheOptions {
        decode_policy: DecodePolicy::Reference,
        ..options()
    };
    let mut same_source = plan(true);
    same_source.layers[1].key.codes = CodeSource::Own;
    same_source.layers[1].key.residual_bits = 0;
    let e = CacheSet::for_plan(ctx.clone(), model(), same_source, reference)
        .err()
        .unwrap();
    assert!(matches!(e, XqError::Config(_)) && e.message().contains("attention_window"));
    // A window of 0, in a plan's JSON and for the f16 set.
    let json = plan(true).to_json().to_string();
    assert!(json.contains("\"attention_window\":40"));
    assert_eq!(CachePlan::from_json(&json).unwrap(), plan(true));
    let zero = json.replacen("\"attention_window\":40", "\"attention_window\":0", 1);
    assert!(matches!(
        CachePlan::from_json(&zero),
        Err(XqError::Config(_))
    ));
    let f = Fp16CacheSet::for_model(ctx.clone(), model(), 64, DType::F32).unwrap();
    assert!(matches!(
        f.with_attention_windows(&[Some(0), None, None]),
        Err(XqError::Config(_))
    ));
    // Queries placed before what a sliding layer still holds: refused, nothing changes.
    let m = model();
    let mut set = xquant(&ctx, true);
    let mut g = SplitMix::new(3);
    let n = m.rows() * 200 * m.head_dim;
    let (k, v) = (normal(&mut g, n), normal(&mut g, n));
    block(set.append(0, KvInput::F32(&k), KvInput::F32(&v))).unwrap();
    let (k, v) = (
        normal(&mut g, m.rows() * m.head_dim),
        normal(&mut g, m.rows() * m.head_dim),
    );
    block(set.append(0, KvInput::F32(&k), KvInput::F32(&v))).unwrap();
    let before = set.stats();
    let dims = [1, 2 * m.kv_heads, 1, m.head_dim];
    let q = ctx
        .upload_f32(
            &vec![0.5; 2 * m.kv_heads * m.head_dim],
            &dims,
            ParamsPrecision::F32,
        )
        .unwrap();
    let out = ctx
        .upload_f32(
            &vec![0.0; 2 * m.kv_heads * m.head_dim],
            &dims,
            ParamsPrecision::F32,
        )
        .unwrap();
    let early = AttendOptions {
        pos0: Some(100),
        ..Default::default()
    };
    let e = block(set.attend_with(0, &q, &out, early)).unwrap_err();
    assert!(matches!(e, XqError::Shape(_)) && e.message().contains("no longer holds"));
    assert_eq!(set.stats(), before);
    // Within what it holds, the same placement is served.
    let late = AttendOptions {
        pos0: Some(190),
        ..Default::default()
    };
    block(set.attend_with(0, &q, &out, late)).unwrap();
    assert_no_gpu_errors(&ctx);
}

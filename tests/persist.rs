//! A saved and restored cache continues bit for bit like the original; malformed bytes are
//! `FormatError`s that allocate nothing.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use std::sync::{Arc, Mutex};

use common::gpu::{assert_no_gpu_errors, block};
use xquant_wgpu::cache::{
    CacheConfig, CacheOptions, CachePlan, CacheSet, Fp16CacheSet, KvCache, KvInput, ModelSpec,
    Rotation, SavedCache, SavedKind, TensorPlan, DEFAULT_QUANT,
};
use xquant_wgpu::gpu::{GpuContext, GpuTensor};
use xquant_wgpu::synth::SplitMix;
use xquant_wgpu::{DType, Levels, ParamsPrecision, ValueAxis, XQuantConfig, XqError};

const MODEL: ModelSpec = ModelSpec {
    layers: 3,
    kv_heads: 2,
    head_dim: 16,
    batch: 1,
};
/// Query heads per KV head.
const GQA: usize = 2;
/// Tokens before saving (ragged: partial groups, pages growing, several pages) and after.
const BEFORE: [usize; 9] = [5, 13, 1, 1, 27, 3, 1, 1, 40];
const AFTER: [usize; 6] = [1, 1, 9, 1, 20, 1];

/// Tests run one at a time: the leak checks read the context's allocated bytes.
static SERIAL: Mutex<()> = Mutex::new(());

fn kv(tokens: usize, seed: u64) -> Vec<f32> {
    xquant_wgpu::synth::normal(MODEL.rows() * tokens * MODEL.head_dim, seed)
}

/// Appends `tokens` tokens to every layer.
fn feed<C: KvCache>(set: &mut C, tokens: usize, seed: u64) {
    for l in 0..MODEL.layers {
        let (k, v) = (
            kv(tokens, seed + l as u64),
            kv(tokens, seed + 50 + l as u64),
        );
        block(set.append(l, KvInput::F32(&k), KvInput::F32(&v))).expect("append");
    }
}

fn bits(v: Vec<f32>) -> Vec<u32> {
    v.into_iter().map(f32::to_bits).collect()
}

/// Every layer's attention of 2 new queries, and its fetched keys and values, as bits.
fn observe<C: KvCache>(set: &mut C, seed: u64) -> Vec<Vec<u32>> {
    let ctx = set.context().clone();
    let dims = [MODEL.batch, MODEL.kv_heads * GQA, 2, MODEL.head_dim];
    let n = dims.iter().product::<usize>();
    let mut out = Vec::new();
    for l in 0..MODEL.layers {
        let q = xquant_wgpu::synth::normal(n, seed + l as u64);
        let q: GpuTensor = ctx.upload_f32(&q, &dims, ParamsPrecision::F32).unwrap();
        let o = ctx
            .upload_f32(&vec![0.0; n], &dims, ParamsPrecision::F32)
            .unwrap();
        block(set.attend(l, &q, &o)).expect("attend");
        out.push(bits(block(ctx.read_f32(&o)).unwrap()));
        let f = block(set.fetch(l)).expect("fetch");
        out.push(bits(block(ctx.read_f32(&f.keys)).unwrap()));
        out.push(bits(block(ctx.read_f32(&f.values)).unwrap()));
    }
    out
}

/// Stats without the scratch (reused output buffers grow with the set's own history).
fn stats(set: &CacheSet) -> xquant_wgpu::cache::CacheStats {
    xquant_wgpu::cache::CacheStats {
        scratch_bytes: 0,
        ..set.stats()
    }
}

fn configs() -> Vec<(&'static str, CachePlan, CacheOptions)> {
    // The default (kivi-lloyd: 3-bit keys per channel, values rotated per token with 2-bit
    // Lloyd–Max levels) + 4 sinks, small groups and window, pages of at most 32 tokens.
    let default = CacheConfig {
        quant: XQuantConfig {
            group_quant_size: 8,
            ..DEFAULT_QUANT
        },
        window: 8,
        max_ctx: 256,
        page_tokens: 32,
        ..CacheConfig::default()
    };
    // The reference's pairs: reuse layers borrowing codes, 4-bit residual, grown pages.
    let pairs = CacheConfig {
        quant: XQuantConfig {
            group_quant_size: 8,
            ..XQuantConfig::default()
        },
        sinks: 0,
        page_tokens: 0,
        ..default
    };
    // The pairs again, every entry rotated (a layer that borrows codes rotates like their
    // owner), under a seed of its own.
    let mut rotated = pairs.plan(MODEL.layers, MODEL.head_dim).unwrap();
    rotated.rotation_seed = 99;
    for l in &mut rotated.layers {
        l.key.rotation = Rotation::Hadamard;
        l.value.rotation = Rotation::Hadamard;
    }
    // Lloyd–Max codes (f16 norms per token) on every entry, rotated, at 2 and 3 bits.
    let mut levels = default.plan(MODEL.layers, MODEL.head_dim).unwrap();
    for (i, l) in levels.layers.iter_mut().enumerate() {
        for (e, bits) in [(&mut l.key, 3), (&mut l.value, 2 + i as u8 % 2)] {
            *e = TensorPlan {
                levels: Levels::LloydMax,
                rotation: Rotation::Hadamard,
                ..TensorPlan::own(bits, ValueAxis::Channels)
            };
        }
    }
    // The default with sliding layers (window 24, every other layer): pages and sinks
    // dropped, pages of their own size.
    let windows: Vec<Option<usize>> = (0..MODEL.layers)
        .map(|l| (l % 2 == 0).then_some(24))
        .collect();
    let sliding = default
        .plan(MODEL.layers, MODEL.head_dim)
        .unwrap()
        .with_model_windows(&windows);
    vec![
        (
            "default",
            default.plan(MODEL.layers, MODEL.head_dim).unwrap(),
            default.options(),
        ),
        (
            "reference pairs",
            pairs.plan(MODEL.layers, MODEL.head_dim).unwrap(),
            pairs.options(),
        ),
        ("rotated pairs", rotated, pairs.options()),
        ("rotated lloyd-max", levels, default.options()),
        ("sliding", sliding, default.options()),
    ]
}

fn filled(ctx: &Arc<GpuContext>, plan: &CachePlan, options: CacheOptions) -> CacheSet {
    let mut set = CacheSet::for_plan(ctx.clone(), MODEL, plan.clone(), options).unwrap();
    for (i, &t) in BEFORE.iter().enumerate() {
        feed(&mut set, t, 100 * i as u64);
    }
    set
}

/// Layers out of step: the anchor (layer 0) runs ahead, so its page grows while the reuse
/// layer (1) still decodes blocks with the old page's codes (saved as orphans), then the
/// reuse layer overtakes it and quantizes tokens with codes of its own (fallback codes).
fn filled_out_of_step(ctx: &Arc<GpuContext>, plan: &CachePlan, options: CacheOptions) -> CacheSet {
    let mut set = CacheSet::for_plan(ctx.clone(), MODEL, plan.clone(), options).unwrap();
    feed(&mut set, 20, 1);
    for (layer, t) in [
        (0, 70),
        (1, 9),
        (2, 30),
        (1, 80),
        (2, 50),
        (0, 19),
        (0, 60),
        (1, 1),
    ] {
        let (k, v) = (kv(t, 7 * t as u64), kv(t, 7 * t as u64 + 1));
        block(set.append(layer, KvInput::F32(&k), KvInput::F32(&v))).expect("append");
    }
    set
}

#[test]
fn a_restored_set_continues_bit_identically() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = gpu_or_skip!();
    let (_, pairs, pair_options) = configs().swap_remove(1);
    let mut cases: Vec<_> = configs()
        .into_iter()
        .map(|(name, plan, options)| (name, filled(&ctx, &plan, options)))
        .collect();
    cases.push((
        "reference pairs, layers out of step",
        filled_out_of_step(&ctx, &pairs, pair_options),
    ));
    // The default (rotated) before its first group leaves the window (4 sinks + 8 + 8): the
    // sinks and the window hold the tokens as they came, and are rotated after the restore
    // by the call that quantizes the first group.
    let (_, default, default_options) = configs().swap_remove(0);
    let mut short = CacheSet::for_plan(ctx.clone(), MODEL, default, default_options).unwrap();
    for (i, t) in [5, 1, 1].into_iter().enumerate() {
        feed(&mut short, t, 100 * i as u64);
    }
    cases.push(("default, inside the window", short));
    for (name, mut original) in cases {
        let bytes = block(original.save()).expect("save");
        let saved = SavedCache::inspect(&bytes).unwrap();
        assert_eq!((saved.kind, saved.model), (SavedKind::XQuant, MODEL));
        let mut restored = block(CacheSet::restore(ctx.clone(), &bytes)).expect("restore");
        restored.check_model(&MODEL).unwrap();
        assert_eq!(restored.plan(), original.plan(), "{name}");
        assert_eq!(restored.options(), original.options(), "{name}");
        assert_eq!(stats(&restored), stats(&original), "{name}: stats");
        let again = block(restored.save()).expect("save the restored set");
        assert!(
            again == bytes,
            "{name}: save → restore → save changed the bytes"
        );
        let s = original.stats();
        println!(
            "{name}: {} tokens, saved {} bytes, allocated {} bytes (fp16 {})",
            original.tokens(0),
            bytes.len(),
            s.allocated_bytes,
            s.fp16_bytes
        );
        assert_eq!(
            observe(&mut restored, 7),
            observe(&mut original, 7),
            "{name}"
        );
        for (i, &t) in AFTER.iter().enumerate() {
            let seed = 10_000 + 100 * i as u64;
            feed(&mut original, t, seed);
            feed(&mut restored, t, seed);
            assert_eq!(
                observe(&mut restored, seed),
                observe(&mut original, seed),
                "{name}: after {t} more tokens"
            );
            assert_eq!(stats(&restored), stats(&original), "{name}: stats");
        }
    }
    assert_no_gpu_errors(&ctx);
}

#[test]
fn an_f16_set_continues_bit_identically() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = gpu_or_skip!();
    let mut original = Fp16CacheSet::for_model(ctx.clone(), MODEL, 256, DType::F16).unwrap();
    for (i, &t) in BEFORE.iter().enumerate() {
        feed(&mut original, t, 100 * i as u64);
    }
    let bytes = block(original.save()).expect("save");
    assert_eq!(SavedCache::inspect(&bytes).unwrap().kind, SavedKind::Fp16);
    let mut restored = block(Fp16CacheSet::restore(ctx.clone(), &bytes)).expect("restore");
    assert_eq!(block(restored.save()).unwrap(), bytes);
    assert_eq!(restored.storage_bytes(), original.storage_bytes());
    // The same set as version 1 wrote it (no attention windows, no first position held)
    // reads back to the same set: caches saved before sliding windows still restore.
    let old = block(Fp16CacheSet::restore(ctx.clone(), &as_version_1(&bytes))).expect("v1");
    assert_eq!(block(old.save()).unwrap(), bytes);
    for (i, &t) in AFTER.iter().enumerate() {
        let seed = 10_000 + 100 * i as u64;
        feed(&mut original, t, seed);
        feed(&mut restored, t, seed);
        assert_eq!(observe(&mut restored, seed), observe(&mut original, seed));
        assert_eq!(restored.storage_bytes(), original.storage_bytes());
    }
    // Fields changed under a valid checksum: refused or restored, never a panic.
    let mut g = SplitMix::new(3);
    for i in 0..100 {
        let mut b = bytes.clone();
        let at = 24 + g.range(0, b.len() - 40);
        if i % 2 == 0 {
            b[at] ^= 1 << g.range(0, 7);
        } else {
            b[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        }
        reseal(&mut b);
        let limit = ctx.max_bound_buffer_bytes();
        let valid = SavedCache::validate(&b, limit);
        match block(Fp16CacheSet::restore(ctx.clone(), &b)) {
            Ok(_) => assert!(valid.is_ok(), "byte {at}: validate refuses: {valid:?}"),
            Err(XqError::Format(_)) => assert!(valid.is_err(), "byte {at}: validate accepts"),
            Err(e) => panic!("byte {at}: {e:?}"),
        }
    }
    // Each kind refuses the other's bytes.
    assert!(matches!(
        block(CacheSet::restore(ctx.clone(), &bytes)),
        Err(XqError::Format(_))
    ));
    assert_no_gpu_errors(&ctx);
}

/// A saved f16 set of [`MODEL`] (global layers) as container version 1 wrote it: without
/// the attention windows and each layer's first position held.
fn as_version_1(v2: &[u8]) -> Vec<u8> {
    let u64_at = |at: usize| u64::from_le_bytes(v2[at..at + 8].try_into().unwrap()) as usize;
    let mut body = v2[24..24 + 32 + 8 + 1].to_vec();
    let mut at = 24 + 32 + 8 + 1 + 8 * MODEL.layers;
    for _ in 0..MODEL.layers {
        body.extend_from_slice(&v2[at..at + 8]);
        assert_eq!(u64_at(at + 8), 0, "a global layer holds every position");
        at += 16;
        for _ in 0..2 {
            let start = at;
            at += 8;
            if v2[at] == 1 {
                at += 1 + 8 + u64_at(at + 1);
            } else {
                at += 1;
            }
            body.extend_from_slice(&v2[start..at]);
        }
    }
    assert_eq!(at, v2.len() - 8);
    let mut out = v2[..24].to_vec();
    out[8..12].copy_from_slice(&1u32.to_le_bytes());
    out[16..24].copy_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    out.extend_from_slice(&[0; 8]);
    reseal(&mut out);
    out
}

/// Recomputes the checksum after a deliberate change (to reach the field checks).
fn reseal(bytes: &mut [u8]) {
    let end = bytes.len() - 8;
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in &bytes[..end] {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    bytes[end..].copy_from_slice(&h.to_le_bytes());
}

fn format_error(r: Result<CacheSet, XqError>, what: &str) -> String {
    match r {
        Err(XqError::Format(m)) => m,
        Err(e) => panic!("{what}: expected a FormatError, got {e:?}"),
        Ok(_) => panic!("{what}: restored"),
    }
}

#[test]
fn malformed_bytes_are_format_errors_and_allocate_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = gpu_or_skip!();
    let (_, plan, options) = configs().swap_remove(1);
    let set = filled(&ctx, &plan, options);
    let bytes = block(set.save()).unwrap();
    let before = ctx.allocated_bytes();
    let restore = |b: &[u8]| block(CacheSet::restore(ctx.clone(), b));
    let limit = ctx.max_bound_buffer_bytes();
    assert_eq!(
        SavedCache::validate(&bytes, limit).unwrap(),
        SavedCache::inspect(&bytes).unwrap()
    );

    assert!(format_error(restore(&[]), "empty").contains("empty"));
    let mut b = bytes.clone();
    b[0] = b'Y';
    assert!(format_error(restore(&b), "magic").contains("magic"));
    let mut b = bytes.clone();
    b[8] = 4;
    assert!(format_error(restore(&b), "version").contains("version 4"));
    let mut b = bytes.clone();
    let mid = b.len() / 2;
    b[mid] ^= 1;
    assert!(format_error(restore(&b), "one byte").contains("checksum"));
    for cut in [1, 8, 23, 24, 100, mid, bytes.len() - 8, bytes.len() - 1] {
        let what = format!("truncated at {cut}");
        assert!(format_error(restore(&bytes[..cut]), &what).contains("truncated") || cut < 8);
    }
    // A page size this device cannot bind (the field after the plan and the options).
    let json = u64::from_le_bytes(bytes[56..64].try_into().unwrap()) as usize;
    let at = 64 + json + 8 + 1 + 1 + 8;
    let mut b = bytes.clone();
    b[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    reseal(&mut b);
    assert!(format_error(restore(&b), "huge pages").contains("do not fit one storage binding"));
    // Fields changed under a valid checksum: refused, or (a changed data byte) restored;
    // never a panic, never a leak.
    let mut g = SplitMix::new(5);
    let mut refused = 0;
    for i in 0..300 {
        let mut b = bytes.clone();
        // Mostly the fields before the first page's data, then anywhere; a byte, or 8 bytes
        // set to an extreme (a length, count or position gone wrong).
        let span = if i % 3 == 0 {
            b.len() - 40
        } else {
            2048.min(b.len() - 40)
        };
        let at = 24 + g.range(0, span);
        if i % 2 == 0 {
            b[at] = b[at].wrapping_add(1 + g.range(0, 254) as u8);
        } else {
            let v = [u64::MAX, 1 << 62, 1 << 31, 0][g.range(0, 3)];
            b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
        reseal(&mut b);
        // Validation without a GPU says what restoring says.
        let valid = SavedCache::validate(&b, limit);
        match restore(&b) {
            Err(XqError::Format(_)) => {
                assert!(
                    valid.is_err(),
                    "byte {at}: validate accepts what restore refuses"
                );
                refused += 1
            }
            Err(e) => panic!("byte {at}: {e:?}"),
            Ok(s) => {
                assert!(
                    valid.is_ok(),
                    "byte {at}: validate refuses what restores: {valid:?}"
                );
                drop(s)
            }
        }
    }
    assert!(refused > 0);
    // Another model.
    let other = ModelSpec {
        head_dim: 32,
        ..MODEL
    };
    let restored = restore(&bytes).unwrap();
    let e = restored.check_model(&other).unwrap_err();
    assert!(
        matches!(&e, XqError::Format(m) if m.contains("head_dim = 16, not 32")),
        "{e}"
    );
    drop(restored);
    assert_eq!(
        ctx.allocated_bytes(),
        before,
        "a refused restore leaked buffers"
    );
    // The f16 set refuses XQuant bytes; the reference policy is not saved.
    assert!(matches!(
        block(Fp16CacheSet::restore(ctx.clone(), &bytes)),
        Err(XqError::Format(_))
    ));
    let reference = CacheOptions {
        decode_policy: xquant_wgpu::cache::DecodePolicy::Reference,
        ..options
    };
    let r = CacheSet::for_plan(ctx.clone(), MODEL, plan.clone(), reference).unwrap();
    assert!(matches!(block(r.save()), Err(XqError::Config(_))));
    assert_no_gpu_errors(&ctx);
}

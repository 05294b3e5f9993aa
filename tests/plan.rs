//! Cache plans: JSON round trips, presets, and invalid plans as `ConfigError`s that name
//! the field.

use serde_json::{json, Value};
use xquant_wgpu::analysis::planner::{choose, Candidate, Measured, PlannerOptions};
use xquant_wgpu::cache::{
    CacheConfig, CacheOptions, CachePlan, CodeSource, DecodePolicy, Rotation, TensorPlan,
    DEFAULT_ROTATION_SEED, PRESETS,
};
use xquant_wgpu::reference::{pair_layers, reference_bytes, Role};
use xquant_wgpu::synth::SplitMix;
use xquant_wgpu::{KvKind, Levels, ParamsPrecision, ValueAxis, XQuantConfig, XqError};

fn config_error(r: Result<CachePlan, XqError>) -> String {
    match r {
        Err(XqError::Config(m)) => m,
        other => panic!("expected a ConfigError, got {other:?}"),
    }
}

/// A plan of 3 layers written by hand, edited by `edit`.
fn edited(edit: impl FnOnce(&mut Value)) -> Result<CachePlan, XqError> {
    let mut v = json!({
        "format": "xquant-plan", "version": 1, "window": 64, "sinks": 4,
        "group_quant_size": 32, "params": "f16",
        "layers": [
            {"key": {"codes": "own", "bits": 2, "axis": "tokens"},
             "value": {"codes": "own", "bits": 3, "axis": "channels", "eta": 0.1}},
            {"key": {"codes": 0, "residual_bits": 4},
             "value": {"codes": "own", "bits": 1, "axis": "tokens"}},
            {"key": {"codes": 0, "bits": 2, "axis": "tokens"},
             "value": {"codes": 1, "residual_bits": 2}},
        ]
    });
    edit(&mut v);
    CachePlan::from_json(&v.to_string())
}

#[test]
fn plans_round_trip_through_json() {
    let mut plans: Vec<CachePlan> = PRESETS
        .iter()
        .map(|p| CachePlan::preset(p, 30).unwrap())
        .collect();
    plans.push(edited(|_| {}).unwrap());
    for plan in plans {
        let text = plan.to_json().to_string();
        let back = CachePlan::from_json(&text).unwrap();
        assert_eq!(back, plan, "{text}");
    }
    // Borrowed entries inherit bits and axis from their source when left out.
    let p = edited(|_| {}).unwrap();
    assert_eq!(p.layers[1].key.bits, 2);
    assert_eq!(p.layers[2].value.axis, ValueAxis::Tokens);
    assert_eq!(p.layers[2].value.codes, CodeSource::Layer(1));
    // Rotation: per entry, borrowed entries inherit their source's; the seed round-trips.
    let r = edited(|v| {
        v["rotation_seed"] = json!(12345);
        v["layers"][0]["key"]["rotation"] = json!("hadamard");
    })
    .unwrap();
    assert_eq!(r.rotation_seed, 12345);
    assert_eq!(r.layers[0].key.rotation, Rotation::Hadamard);
    assert_eq!(
        r.layers[1].key.rotation,
        Rotation::Hadamard,
        "borrowed from layer 0"
    );
    assert_eq!(r.layers[0].value.rotation, Rotation::None);
    assert_eq!(r.signs_layer(2, KvKind::Key), Some(0));
    assert_eq!(r.signs_layer(0, KvKind::Value), None);
    assert_eq!(CachePlan::from_json(&r.to_json().to_string()).unwrap(), r);
    assert_eq!(p.rotation_seed, DEFAULT_ROTATION_SEED);
    // Levels: per entry, uniform unless named; Lloyd–Max entries round-trip.
    let l = edited(|v| {
        v["layers"][0]["value"] = json!({"bits": 3, "axis": "channels", "levels": "lloyd-max"});
    })
    .unwrap();
    assert_eq!(l.layers[0].value.levels, Levels::LloydMax);
    assert_eq!(l.layers[0].key.levels, Levels::Uniform);
    assert_eq!(CachePlan::from_json(&l.to_json().to_string()).unwrap(), l);
    assert!(l.check_head_dim(64).is_ok());
    let m = match l.check_head_dim(48) {
        Err(XqError::Config(m)) => m,
        other => panic!("{other:?}"),
    };
    assert!(m.contains("layers[0].value") && m.contains("divide"), "{m}");
}

/// An edit of the hand-written plan.
type Edit = Box<dyn FnOnce(&mut Value)>;

#[test]
fn invalid_plans_name_the_field() {
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|v| v["layers"][1]["key"]["codes"] = json!(7)),
            "layers[1].key.codes",
        ),
        (
            Box::new(|v| v["layers"][1]["key"]["codes"] = json!(2)),
            "layers[1].key.codes",
        ),
        (
            Box::new(|v| v["layers"][0]["key"]["bits"] = json!(0)),
            "layers[0].key.bits",
        ),
        (
            Box::new(|v| v["layers"][0]["value"]["bits"] = json!(9)),
            "layers[0].value.bits",
        ),
        (
            Box::new(|v| v["layers"][1]["key"]["bits"] = json!(3)),
            "layers[1].key.bits",
        ),
        (
            Box::new(|v| v["layers"][1]["key"]["axis"] = json!("channels")),
            "layers[1].key.axis",
        ),
        (
            Box::new(|v| v["layers"][2]["key"]["codes"] = json!(1)),
            "layers[2].key.codes",
        ),
        (
            Box::new(|v| v["layers"][0]["key"]["residual_bits"] = json!(2)),
            "layers[0].key.residual_bits",
        ),
        (
            Box::new(|v| v["layers"][2]["value"]["residual_bits"] = json!(9)),
            "layers[2].value.residual_bits",
        ),
        (
            Box::new(|v| v["layers"][0]["value"]["eta"] = json!(0.7)),
            "layers[0].value.eta",
        ),
        (
            Box::new(|v| v["layers"][0]["key"]["bitz"] = json!(2)),
            "unknown field `bitz`",
        ),
        (Box::new(|v| v["windw"] = json!(2)), "unknown field `windw`"),
        (
            Box::new(|v| v["window"] = json!(40)),
            "window (40) must be a multiple",
        ),
        (
            Box::new(|v| v["window"] = json!(-1)),
            "window must be a whole number",
        ),
        (
            Box::new(|v| v["group_quant_size"] = json!(0)),
            "group_quant_size",
        ),
        (Box::new(|v| v["layers"] = json!([])), "layers"),
        (Box::new(|v| v["version"] = json!(2)), "version"),
        (
            Box::new(|v| v["layers"][0]["value"]["axis"] = json!("rows")),
            "layers[0].value.axis",
        ),
        (
            Box::new(|v| v["layers"][0]["key"]["rotation"] = json!("walsh")),
            "layers[0].key.rotation",
        ),
        (
            Box::new(|v| v["layers"][1]["key"]["rotation"] = json!("hadamard")),
            "layers[1].key.rotation (hadamard) must equal",
        ),
        (
            Box::new(|v| v["rotation_seed"] = json!(-3)),
            "rotation_seed must be a whole number",
        ),
        (
            Box::new(|v| v["layers"][0]["value"]["levels"] = json!("nf4")),
            "layers[0].value.levels",
        ),
        (
            Box::new(|v| v["layers"][0]["key"]["levels"] = json!("lloyd-max")),
            "layers[0].key: levels lloyd-max needs axis channels",
        ),
        (
            Box::new(|v| {
                v["layers"][0]["value"]["levels"] = json!("lloyd-max");
                v["layers"][0]["value"]["eta"] = json!(0.0);
                v["layers"][0]["value"]["bits"] = json!(5);
            }),
            "layers[0].value: bits must be in 1..=4",
        ),
        (
            Box::new(|v| v["layers"][0]["value"]["levels"] = json!("lloyd-max")),
            "layers[0].value: eta must be 0",
        ),
        (
            Box::new(|v| {
                v["layers"][1]["value"] = json!({"codes": "own", "bits": 2, "axis": "channels",
                                                 "levels": "lloyd-max"});
            }),
            "layers[2].value.codes: layer 1's codes are lloyd-max",
        ),
        (
            Box::new(|v| {
                v["layers"][0]["value"]["eta"] = json!(0.0);
                v["layers"][0]["value"]["levels"] = json!("lloyd-max");
                v["layers"][2]["value"]["codes"] = json!(0);
                v["layers"][2]["value"]["levels"] = json!("lloyd-max");
            }),
            "layers[2].value.levels: lloyd-max codes are the layer's own",
        ),
    ];
    for (edit, field) in cases {
        let m = config_error(edited(edit));
        assert!(m.contains(field), "`{m}` does not name `{field}`");
    }
    assert!(config_error(CachePlan::from_json("{")).contains("not JSON"));
    assert!(config_error(CachePlan::preset("kivi-3", 4)).contains("unknown preset"));
    let plan = edited(|_| {}).unwrap();
    let m = match plan.check_layers(4) {
        Err(XqError::Config(m)) => m,
        other => panic!("{other:?}"),
    };
    assert!(
        m.contains("layers") && m.contains("3") && m.contains("4"),
        "{m}"
    );
    // The reference decode policy publishes keys and values together: they must share
    // their code source.
    let reference = CacheOptions {
        decode_policy: DecodePolicy::Reference,
        ..Default::default()
    };
    let m = match reference.validate(&plan) {
        Err(XqError::Config(m)) => m,
        other => panic!("{other:?}"),
    };
    assert!(m.contains("layers[1]"), "{m}");
}

#[test]
fn the_reference_grouping_is_a_plan() {
    let config = CacheConfig {
        quant: XQuantConfig {
            key_bits: 3,
            ..XQuantConfig::default()
        },
        ..CacheConfig::default()
    };
    let plan = config.plan(7, 64).unwrap();
    let roles = pair_layers(7, config.quant.layers_per_group).unwrap();
    for (l, (p, r)) in plan.layers.iter().zip(&roles).enumerate() {
        for (kind, e) in [(KvKind::Key, &p.key), (KvKind::Value, &p.value)] {
            match r.role {
                Role::Anchor => assert_eq!(e.codes, CodeSource::Own),
                Role::Reuse => {
                    assert_eq!(e.codes, CodeSource::Layer(l - l % 2));
                    assert_eq!(e.residual_bits, config.quant.residual_bits);
                }
            }
            let bits = [3, config.quant.base_bits][kind.index() as usize];
            assert_eq!(e.bits, bits);
            assert_eq!(e.levels, Levels::Uniform);
            assert_eq!(e.rotation, Rotation::None);
        }
        assert_eq!(p.key.axis, ValueAxis::Tokens);
        assert_eq!(p.value.axis, config.quant.value_axis);
    }
    assert_eq!(plan.window, config.window);
}

#[test]
fn the_default_is_kivi_lloyd_where_it_applies_and_kivi_2_elsewhere() {
    let layers = |p: &CachePlan| p.layers.clone();
    let kivi_lloyd = CachePlan::preset("kivi-lloyd", 30).unwrap();
    let d = CacheConfig::default();
    for head_dim in [64, 128, 256] {
        let plan = d.plan(30, head_dim).unwrap();
        assert_eq!(layers(&plan), layers(&kivi_lloyd), "head dim {head_dim}");
        assert_eq!(
            (plan.window, plan.sinks, plan.group_quant_size),
            (128, 4, 64)
        );
    }
    assert_eq!(
        layers(&CachePlan::preset("default", 30).unwrap()),
        layers(&kivi_lloyd)
    );
    let named = CachePlan::preset_for("default", 30, 64).unwrap();
    assert_eq!(
        (layers(&named), named.name.as_str()),
        (layers(&kivi_lloyd), "default")
    );
    // Where its rotation or its groups of 64 cannot apply, KIVI-2's quantizer with the sinks.
    let kivi_2 = CachePlan::preset("kivi-2", 30).unwrap();
    let window_32 = CacheConfig { window: 32, ..d };
    let pages_32 = CacheConfig {
        page_tokens: 32,
        ..d
    };
    for (config, head_dim) in [(d, 96), (d, 32), (d, 80), (window_32, 64), (pages_32, 64)] {
        let plan = config.plan(30, head_dim).unwrap();
        assert_eq!(
            layers(&plan),
            layers(&kivi_2),
            "{config:?}, head dim {head_dim}"
        );
        assert_eq!((plan.sinks, plan.group_quant_size), (4, 32));
        config.validate(head_dim).unwrap();
    }
    // The `default` preset for a model is what its cache set given nothing uses.
    let d96 = CachePlan::preset_for("default", 30, 96).unwrap();
    assert_eq!((layers(&d96), d96.sinks), (layers(&kivi_2), 4));
    assert_eq!(
        CachePlan::preset_for("kivi-2", 30, 96).unwrap(),
        CachePlan::preset("kivi-2", 30).unwrap()
    );
    // Options that are not the default's are kept as given: errors, not a fallback.
    let given = CacheConfig {
        quant: XQuantConfig {
            key_bits: 4,
            ..d.quant
        },
        window: 32,
        ..d
    };
    assert!(matches!(given.validate(64), Err(XqError::Config(_))));
    assert!(matches!(given.plan(30, 64), Err(XqError::Config(_))));
}

#[test]
fn presets_say_what_they_are() {
    let kivi = CachePlan::preset("kivi-2", 30).unwrap();
    for l in &kivi.layers {
        assert_eq!(l.key, TensorPlan::own(2, ValueAxis::Tokens));
        assert_eq!(l.value, TensorPlan::own(2, ValueAxis::Channels));
    }
    let paper = CachePlan::preset("xquant-paper", 30).unwrap();
    assert_eq!(paper.layers[3].key.codes, CodeSource::Own);
    assert_eq!(paper.layers[14].key.bits, 2);
    assert_eq!(
        paper.layers[15].key.bits, 2,
        "layer 15 borrows layer 14's 2-bit codes"
    );
    assert_eq!(paper.layers[15].key.codes, CodeSource::Layer(14));
    assert_eq!(paper.layers[16].value.bits, 1);
    assert_eq!(paper.layers[17].value.codes, CodeSource::Layer(16));
    assert_eq!(paper.layers[17].value.residual_bits, 0);
    assert_eq!(paper.layers[17].value.axis, ValueAxis::Channels);
    let rotated = CachePlan::preset("rotated-k3v2", 30).unwrap();
    assert!(rotated
        .layers
        .iter()
        .all(|l| l.key.rotation == Rotation::Hadamard
            && l.value.rotation == Rotation::Hadamard
            && l.key.axis == ValueAxis::Channels
            && (l.key.bits, l.value.bits) == (3, 2)));
    assert_eq!(
        (rotated.window, rotated.sinks, rotated.group_quant_size),
        (128, 4, 64)
    );
    // 3 bits + an f16 pair per 64 for keys, 2 + the same for values.
    assert_eq!(rotated.bytes_at(4096, 3, 64).quantized_bits(), 3.0);
    let two = CachePlan::preset("rotated-2", 30).unwrap();
    assert_eq!(two.bytes_at(4096, 3, 64).quantized_bits(), 2.5);
    // Lloyd–Max presets: one f16 norm per 64 (0.25 bits) on top of the codes.
    for (name, bits) in [("lloyd-k3v2", 2.75), ("lloyd-2.5", 2.5), ("lloyd-2", 2.25)] {
        let p = CachePlan::preset(name, 30).unwrap();
        assert!(p.layers.iter().all(|l| l.key.levels == Levels::LloydMax
            && l.value.levels == Levels::LloydMax
            && l.key.rotation == Rotation::Hadamard
            && l.value.bits == 2));
        assert_eq!(p.bytes_at(4096, 3, 64).quantized_bits(), bits, "{name}");
        assert_eq!(
            (p.window, p.sinks, p.group_quant_size),
            (128, 4, 64),
            "{name}"
        );
    }
    // Keys per channel at 3 bits (3 + 32/64), values Lloyd–Max at 2 (2 + 16/64): 2.875.
    let kl = CachePlan::preset("kivi-lloyd", 30).unwrap();
    assert!(kl.layers.iter().all(|l| l.key.rotation == Rotation::None
        && l.key.axis == ValueAxis::Tokens
        && l.key.levels == Levels::Uniform
        && l.key.bits == 3
        && l.value.rotation == Rotation::Hadamard
        && l.value.axis == ValueAxis::Channels
        && l.value.levels == Levels::LloydMax
        && l.value.bits == 2));
    assert_eq!(kl.bytes_at(4096, 3, 64).quantized_bits(), 2.875);
    assert_eq!((kl.window, kl.sinks, kl.group_quant_size), (128, 4, 64));
    let half = CachePlan::preset("lloyd-2.5", 30).unwrap();
    assert_eq!((half.layers[14].key.bits, half.layers[15].key.bits), (2, 3));
}

#[test]
fn accounting_at_a_context_counts_window_sinks_and_params() {
    // 2-bit own codes along tokens, group 32: 2 bits + one f16 pair per 32 = 3 bits.
    let mut plan = CachePlan::preset("kivi-2", 2).unwrap();
    plan.layers[0].value = plan.layers[0].key;
    plan.layers[1].value = plan.layers[1].key;
    plan.window = 0;
    let b = plan.bytes_at(1024, 3, 64);
    assert!(
        (b.effective_bits() - 3.0).abs() < 1e-9,
        "{}",
        b.effective_bits()
    );
    assert!((b.quantized_bits() - 3.0).abs() < 1e-9);
    plan.window = 128;
    plan.sinks = 4;
    // 4 + 128 f16 tokens; 892 → 864 quantized (whole groups), 160 in f16.
    assert_eq!(plan.quantized_tokens(1024), 864);
    let b = plan.bytes_at(1024, 3, 64);
    let want = (864.0 * 3.0 + 160.0 * 16.0) / 1024.0;
    assert!((b.effective_bits() - want).abs() < 1e-9);
    assert!((b.quantized_bits() - 3.0).abs() < 1e-9);
}

/// Synthetic measurements: each candidate's error falls with its bytes, with noise.
fn synthetic(layers: usize, seed: u64, opts: &PlannerOptions) -> Measured {
    let mut g = SplitMix::new(seed);
    let (rows, dim) = (3, 64);
    let q = opts.context - opts.sinks - opts.window;
    let q = q / opts.group_quant_size * opts.group_quant_size;
    let mut m = Measured {
        layers: Vec::new(),
        rows,
        dim,
    };
    for l in 0..layers {
        let mut kinds: [Vec<Candidate>; 2] = Default::default();
        for kind in &mut kinds {
            let mut entries = Vec::new();
            for bits in 1..=4u8 {
                for axis in [ValueAxis::Tokens, ValueAxis::Channels] {
                    entries.push(TensorPlan::own(bits, axis));
                    if l > 0 {
                        for r in [0u8, 1, 2, 4] {
                            entries.push(TensorPlan {
                                codes: CodeSource::Layer(l - 1),
                                residual_bits: r,
                                ..TensorPlan::own(bits, axis)
                            });
                        }
                    }
                }
            }
            *kind = entries
                .into_iter()
                .map(|entry| {
                    let spec = entry.spec(opts.group_quant_size, ParamsPrecision::F16);
                    let bytes = (reference_bytes(entry.role(), q, dim, &spec, entry.residual_bits)
                        .compressed
                        * rows) as u64;
                    let bits = 8.0 * bytes as f64 / (q * rows * dim) as f64;
                    Candidate {
                        entry,
                        error: (0.5f64).powf(bits) * (0.5 + g.uniform()),
                        bytes,
                    }
                })
                .collect();
        }
        m.layers.push(kinds);
    }
    m
}

#[test]
fn the_planner_never_exceeds_its_target() {
    let mut feasible = 0;
    for (i, target) in [1.2, 1.5, 2.0, 2.5, 3.0, 3.7, 5.0].into_iter().enumerate() {
        for (window, sinks) in [(0, 0), (32, 4), (64, 0)] {
            let opts = PlannerOptions {
                target_bits: target,
                context: 1024,
                window,
                sinks,
                group_quant_size: 32,
            };
            let m = synthetic(6, i as u64, &opts);
            match choose(&m, &opts) {
                Ok(p) => {
                    feasible += 1;
                    let bits = p.plan.bytes_at(1024, 3, 64).effective_bits();
                    assert!(bits <= target + 1e-9, "{target}: {bits}");
                    assert_eq!(p.bytes.effective_bits(), bits);
                    p.plan.validate().unwrap();
                    // The plan spends its budget: within one step of the target.
                    assert!(
                        bits > target - 1.0 || target >= 4.5,
                        "{target}: only {bits}"
                    );
                }
                Err(XqError::Config(m)) => assert!(m.contains("below the smallest plan"), "{m}"),
                Err(e) => panic!("{e}"),
            }
        }
    }
    assert!(feasible >= 12, "{feasible}");
}

#[test]
fn the_planner_prefers_less_error_at_equal_budget() {
    let opts = PlannerOptions {
        target_bits: 2.5,
        context: 1024,
        window: 0,
        sinks: 0,
        group_quant_size: 32,
    };
    let mut m = synthetic(4, 9, &opts);
    // Make layer 2's keys worthless unless they own 4-bit codes: the planner must pay for it.
    for c in &mut m.layers[2][0] {
        c.error = if c.entry.codes == CodeSource::Own && c.entry.bits == 4 {
            0.0
        } else {
            100.0
        };
    }
    let p = choose(&m, &opts).unwrap();
    assert_eq!(p.plan.layers[2].key.bits, 4);
    assert_eq!(p.plan.layers[2].key.codes, CodeSource::Own);
}

#[test]
fn model_windows_split_a_grouping_that_straddles_them() {
    // Gemma 3's pattern on 6 layers: 0-4 slide, 5 is global; pairs (4, 5) straddle it.
    let windows: Vec<Option<usize>> = (0..6).map(|l| (l != 5).then_some(512)).collect();
    let pairs = CachePlan::grouped(6, &XQuantConfig::default(), 64, 4).unwrap();
    let mut straddling = pairs.clone();
    for l in &mut straddling.layers {
        l.attention_window = Some(512);
    }
    straddling.layers[5].attention_window = None;
    assert!(config_error(straddling.validate().map(|_| pairs.clone())).contains("same window"));
    let plan = pairs.with_model_windows(&windows);
    plan.validate().unwrap();
    for kv in [KvKind::Key, KvKind::Value] {
        // Within one window the grouping stays; across, the layer owns its codes.
        assert_eq!(plan.layers[1].get(kv).codes, CodeSource::Layer(0));
        assert_eq!(plan.layers[1].get(kv).residual_bits, 4);
        assert_eq!(plan.layers[3].get(kv).codes, CodeSource::Layer(2));
        assert_eq!(plan.layers[5].get(kv).codes, CodeSource::Own);
        assert_eq!(plan.layers[5].get(kv).residual_bits, 0);
        assert_eq!(plan.layers[5].get(kv).bits, 2);
    }
    assert_eq!(plan.layers[5].attention_window, None);
    assert_eq!(plan.layers[4].attention_window, Some(512));
}

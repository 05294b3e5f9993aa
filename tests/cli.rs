//! The `xquant` CLI on safetensors files the tests write themselves.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::cli::{assert_one_line_error, temp_path, xquant, xquant_env, Run};
use common::golden::{Golden, D, N};
use common::tolerances::CLI_REL;
use serde_json::{json, Value};
use xquant_wgpu::kvfile::{FileDType, KvFile, KvLayer};
use xquant_wgpu::reference;
use xquant_wgpu::{DType, ParamsPrecision, QuantSpec, TensorShape};

fn write_kv(
    name: &str,
    dims: &[usize],
    dtype: FileDType,
    layers: Vec<(Vec<f32>, Vec<f32>)>,
) -> String {
    let kv = KvFile {
        shape: TensorShape::new(dims).unwrap(),
        dtype,
        layers: layers
            .into_iter()
            .map(|(key, value)| KvLayer { key, value })
            .collect(),
    };
    let path = temp_path(name);
    kv.write(&path).unwrap();
    path.to_string_lossy().into_owned()
}

/// A safetensors file from a header and `data_len` zero bytes of data.
fn raw_safetensors(name: &str, header: &str, data_len: usize) -> String {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + data_len, 0);
    let path = temp_path(name);
    std::fs::write(&path, bytes).unwrap();
    path.to_string_lossy().into_owned()
}

fn analyze_json(args: &[&str]) -> Value {
    let r = xquant(args);
    assert_eq!(r.code, 0, "xquant {args:?} failed: {}", r.stderr);
    serde_json::from_str(&r.stdout).expect("analyze --json prints one JSON object")
}

fn mse(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum::<f64>()
        / a.len() as f64
}

fn rel_diff(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

/// `recon_mse` equals what the reference implementation's own outputs give (golden
/// reconstructions), within 1e-3 relative, with `--params f32`.
#[test]
fn analyze_matches_reference_recon_mse_on_golden_layers() {
    let _ctx = gpu_or_skip!();
    let g = Golden::load();
    let (x, y) = (Golden::x(), Golden::y());
    let file = write_kv(
        "golden.safetensors",
        &[1, 1, N, D],
        FileDType::F16,
        vec![(x.clone(), x.clone()), (y.clone(), y.clone())],
    );
    let j = analyze_json(&[
        "analyze",
        &file,
        "--params",
        "f32",
        "--residual-bits",
        "4",
        "--json",
    ]);
    let want_anchor = mse(&x, &g.flat("recon_x_fp16"));
    let want_reuse = mse(&y, &g.flat("recon_y_plus_res_fp16"));
    let want_bare = mse(&y, &g.flat("recon_y_fp16"));
    for kind in ["key", "value"] {
        let l0 = &j["layers"][0][kind];
        let l1 = &j["layers"][1][kind];
        assert!(
            rel_diff(l0["recon_mse"].as_f64().unwrap(), want_anchor) < CLI_REL,
            "{kind} anchor {l0}"
        );
        assert!(
            rel_diff(l1["recon_mse"].as_f64().unwrap(), want_reuse) < CLI_REL,
            "{kind} reuse {l1} want {want_reuse}"
        );
        assert!(
            rel_diff(l1["recon_mse_no_residual"].as_f64().unwrap(), want_bare) < CLI_REL,
            "{kind} {l1}"
        );
        assert!(
            rel_diff(l1["mse_to_anchor"].as_f64().unwrap(), g.sim("mse")) < 1e-4,
            "{kind} {l1}"
        );
        assert!(
            (l1["cosine_to_anchor"].as_f64().unwrap() - g.sim("cosine")).abs() < 1e-5,
            "{kind} {l1}"
        );
        assert!(l0["recon_mse_no_residual"].is_null() && l0["cosine_to_anchor"].is_null());
    }
}

/// The JSON schema of `analyze --json`, and its numbers against the CPU reference.
#[test]
fn analyze_json_schema_and_values() {
    let _ctx = gpu_or_skip!();
    let dims = [1, 2, 45, 16];
    let layers = xquant_wgpu::synth::synthetic_kv(5, 2, 45, 16, 0.7, 3);
    let file = write_kv("synth.safetensors", &dims, FileDType::F32, layers.clone());
    let j = analyze_json(&[
        "analyze",
        &file,
        "--group-size",
        "3",
        "--residual-bits",
        "2",
        "--group-quant-size",
        "16",
        "--json",
    ]);
    assert_eq!(j["config"]["group_size"], 3);
    assert_eq!(j["config"]["params"], "f16");
    assert!(j["adapter"].as_str().is_some_and(|a| !a.is_empty()));
    let ls = j["layers"].as_array().unwrap();
    assert_eq!(ls.len(), 5);
    let roles: Vec<&str> = ls.iter().map(|l| l["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["anchor", "reuse", "reuse", "anchor", "reuse"]);
    let groups: Vec<u64> = ls.iter().map(|l| l["group"].as_u64().unwrap()).collect();
    assert_eq!(groups, [0, 0, 0, 1, 1]);

    // Layer 4 (reuse of layer 3), keys: the CPU reference's reconstruction error.
    let spec = QuantSpec::new(2, 16);
    let shape = TensorShape::new(&dims).unwrap();
    let (k3, k4) = (&layers[3].0, &layers[4].0);
    let (codes, _) = reference::quantize_codes_batched(k3, &shape, &spec).unwrap();
    let enc = reference::reuse_encode(k4, &shape, &codes, &spec, 2, DType::F16).unwrap();
    let recon = reference::reuse_reconstruct(&codes, &enc, DType::F16).unwrap();
    let got = ls[4]["key"]["recon_mse"].as_f64().unwrap();
    assert!(
        rel_diff(got, mse(k4, &recon)) < CLI_REL,
        "reuse key recon_mse {got} vs cpu {}",
        mse(k4, &recon)
    );
    let sim = reference::cross_layer_similarity(k4, k3, &shape).unwrap();
    assert!((ls[4]["key"]["cosine_to_anchor"].as_f64().unwrap() - sim.cosine).abs() < 1e-4);

    // Accounting: reference formula at S = 45, D = 16, gs = 16 (3 groups).
    let anchor = reference::reference_bytes(reference::Role::Anchor, 45, 16, &spec, 2);
    let reuse = reference::reference_bytes(reference::Role::Reuse, 45, 16, &spec, 2);
    assert_eq!(
        ls[0]["key"]["effective_bits"].as_f64().unwrap(),
        anchor.effective_bits()
    );
    assert_eq!(
        ls[1]["value"]["effective_bits"].as_f64().unwrap(),
        reuse.effective_bits()
    );
    let t = &j["totals"];
    assert_eq!(t["fp16_bytes"].as_u64().unwrap(), 5 * 2 * 2 * 45 * 16 * 2);
    let compressed = t["compressed_bytes"].as_u64().unwrap() as f64;
    assert!(
        (t["ratio_vs_fp16"].as_f64().unwrap() - compressed / t["fp16_bytes"].as_f64().unwrap())
            .abs()
            < 1e-12
    );
    for key in [
        "effective_bits",
        "key_effective_bits",
        "value_effective_bits",
        "allocated_bytes",
    ] {
        assert!(t[key].as_f64().is_some(), "totals.{key} missing");
    }
}

#[test]
fn analyze_reads_bf16_and_channels_axis_and_prints_a_table() {
    let _ctx = gpu_or_skip!();
    let layers = xquant_wgpu::synth::synthetic_kv(2, 1, 33, 8, 0.9, 4);
    let file = write_kv("bf16.safetensors", &[1, 1, 33, 8], FileDType::BF16, layers);
    let j = analyze_json(&[
        "analyze",
        &file,
        "--value-axis",
        "channels",
        "--group-quant-size",
        "4",
        "--eta",
        "0.09",
        "--json",
    ]);
    assert_eq!(j["config"]["value_axis"], "channels");
    assert!(j["layers"][1]["value"]["recon_mse"].as_f64().unwrap() > 0.0);
    // The default cache set's quantizer, written as options: 3-bit keys, rotated Lloyd–Max
    // values.
    let j = analyze_json(&[
        "analyze",
        &file,
        "--group-size",
        "1",
        "--residual-bits",
        "0",
        "--key-bits",
        "3",
        "--value-axis",
        "channels",
        "--value-levels",
        "lloyd-max",
        "--value-rotation",
        "hadamard",
        "--group-quant-size",
        "8",
        "--json",
    ]);
    let c = &j["config"];
    assert_eq!(
        (
            &c["key_bits"],
            &c["base_bits"],
            &c["value_levels"],
            &c["value_rotation"]
        ),
        (
            &json!(3),
            &json!(2),
            &json!("lloyd-max"),
            &json!("hadamard")
        ),
        "{c}"
    );
    assert!(j["layers"][1]["value"]["recon_mse"].as_f64().unwrap() > 0.0);
    let r = xquant(&["analyze", &file]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.contains("anchor") && r.stdout.contains("mean effective bits"),
        "{}",
        r.stdout
    );
}

#[test]
fn similarity_matrix_matches_cpu() {
    let _ctx = gpu_or_skip!();
    let dims = [1, 2, 20, 8];
    let layers = xquant_wgpu::synth::synthetic_kv(4, 2, 20, 8, 0.5, 9);
    let file = write_kv("sim.safetensors", &dims, FileDType::F32, layers.clone());
    let r = xquant(&["similarity", &file, "--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let j: Value = serde_json::from_str(&r.stdout).unwrap();
    let shape = TensorShape::new(&dims).unwrap();
    for i in 0..4 {
        for k in 0..4 {
            let cpu =
                reference::cross_layer_similarity(&layers[i].1, &layers[k].1, &shape).unwrap();
            let got = j["value"]["cosine"][i][k].as_f64().unwrap();
            assert!(
                (got - cpu.cosine).abs() < 1e-4,
                "value cosine [{i}][{k}] {got} vs {}",
                cpu.cosine
            );
            let got = j["key"]["mse"][i][k].as_f64().unwrap();
            let cpu =
                reference::cross_layer_similarity(&layers[i].0, &layers[k].0, &shape).unwrap();
            assert!(
                (got - cpu.mse).abs() <= 1e-4 * cpu.mse + 1e-9,
                "key mse [{i}][{k}] {got} vs {}",
                cpu.mse
            );
        }
    }
}

#[test]
fn info_reports_the_adapter() {
    let ctx = gpu_or_skip!();
    let r = xquant(&["info", "--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let j: Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(j["adapter"].as_str().unwrap(), ctx.adapter().name);
    assert!(
        j["limits"]["max_storage_buffer_binding_size"]
            .as_u64()
            .unwrap()
            > 0
    );
}

#[test]
fn bad_input_is_one_line_and_a_nonzero_exit() {
    // Usage errors need no GPU.
    assert_one_line_error(&xquant(&["analyze"]), "needs a FILE");
    assert_one_line_error(&xquant(&["frobnicate"]), "unknown command");
    assert_one_line_error(
        &xquant(&["analyze", "x.safetensors", "--bogus"]),
        "unknown option --bogus",
    );
    assert_one_line_error(
        &xquant(&["analyze", "x.safetensors", "--base-bits"]),
        "needs a value",
    );
    assert_one_line_error(
        &xquant(&["analyze", "x.safetensors", "--base-bits", "two"]),
        "cannot parse",
    );
    assert_one_line_error(
        &xquant(&["analyze", "x.safetensors", "--base-bits", "9"]),
        "bits must be in 1..=8",
    );
    assert_one_line_error(
        &xquant(&["analyze", "x.safetensors", "--residual-bits", "12"]),
        "residual_bits",
    );
    assert_one_line_error(
        &xquant(&["analyze", "x.safetensors", "--eta", "0.7"]),
        "eta",
    );
    assert_one_line_error(
        &xquant(&["analyze", "x.safetensors", "--group-size", "0"]),
        "group_size",
    );
    assert_one_line_error(
        &xquant(&["analyze", "x.safetensors", "--group-quant-size", "0"]),
        "group_quant_size",
    );
    assert_one_line_error(
        &xquant(&["analyze", "x.safetensors", "--value-axis", "diagonal"]),
        "value axis",
    );
    assert_one_line_error(
        &xquant(&["analyze", "x.safetensors", "--params", "f8"]),
        "params precision",
    );
    assert_one_line_error(
        &xquant(&["analyze", "x.safetensors", "--key-bits", "9"]),
        "key_bits must be in 1..=8",
    );
    assert_one_line_error(
        &xquant(&["analyze", "x.safetensors", "--value-levels", "lloyd"]),
        "levels must be",
    );
    assert_one_line_error(
        &xquant(&["analyze", "x.safetensors", "--value-rotation", "spin"]),
        "rotation must be",
    );
    assert_one_line_error(
        &xquant(&["analyze", "x.safetensors", "--value-levels", "lloyd-max"]),
        "value_levels lloyd-max needs value_axis channels",
    );
    assert_one_line_error(
        &xquant(&["analyze", "/nonexistent/kv.safetensors"]),
        "cannot read",
    );

    let garbage = temp_path("garbage.safetensors");
    std::fs::write(&garbage, b"definitely not safetensors").unwrap();
    assert_one_line_error(
        &xquant(&["analyze", garbage.to_str().unwrap()]),
        "not a safetensors file",
    );

    // Wrong names: a valid safetensors file without past_key_values tensors.
    let wrong = raw_safetensors(
        "wrong-names.safetensors",
        r#"{"model.weight":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
        8,
    );
    assert_one_line_error(&xquant(&["analyze", &wrong]), "past_key_values.0.key");

    // Mismatched shapes: layer 0's value is [1, 1, 2, 4], its key [1, 1, 4, 2].
    let mismatched = raw_safetensors(
        "mismatched.safetensors",
        r#"{"past_key_values.0.key":{"dtype":"F32","shape":[1,1,4,2],"data_offsets":[0,32]},
            "past_key_values.0.value":{"dtype":"F32","shape":[1,1,2,4],"data_offsets":[32,64]}}"#,
        64,
    );
    assert_one_line_error(&xquant(&["analyze", &mismatched]), "differs from layer 0");

    // A gap in layer numbers.
    let gap = raw_safetensors(
        "gap.safetensors",
        r#"{"past_key_values.0.key":{"dtype":"F32","shape":[1,1,4,2],"data_offsets":[0,32]},
            "past_key_values.0.value":{"dtype":"F32","shape":[1,1,4,2],"data_offsets":[32,64]},
            "past_key_values.2.key":{"dtype":"F32","shape":[1,1,4,2],"data_offsets":[64,96]},
            "past_key_values.2.value":{"dtype":"F32","shape":[1,1,4,2],"data_offsets":[96,128]}}"#,
        128,
    );
    assert_one_line_error(&xquant(&["analyze", &gap]), "without gaps");

    // Non-finite values.
    let nan = write_kv(
        "nan.safetensors",
        &[1, 1, 4, 2],
        FileDType::F32,
        vec![(
            vec![0.0, 1.0, f32::NAN, 0.0, 0.0, 0.0, 0.0, 0.0],
            vec![0.0; 8],
        )],
    );
    assert_one_line_error(&xquant(&["analyze", &nan]), "NaN");
}

#[test]
fn f16_params_refuse_values_they_cannot_hold() {
    let _ctx = gpu_or_skip!();
    let big = write_kv(
        "big.safetensors",
        &[1, 1, 4, 2],
        FileDType::F32,
        vec![(vec![20000.0; 8], vec![1.0; 8])],
    );
    assert_one_line_error(&xquant(&["analyze", &big]), "params f32");
    let r = xquant(&["analyze", &big, "--params", "f32", "--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let _ = ParamsPrecision::F32;
}

/// `analyze --prefill`: the cache replay's numbers against the CPU model of the window policy.
#[test]
fn analyze_prefill_replays_through_a_cache_set() {
    let _ctx = gpu_or_skip!();
    use common::cache_model::{expected_window, quantized_tokens, LayerSeq};
    let dims = [1, 2, 40, 16];
    let layers = xquant_wgpu::synth::synthetic_kv(4, 2, 40, 16, 0.8, 21);
    let file = write_kv("replay.safetensors", &dims, FileDType::F32, layers.clone());
    let j = analyze_json(&[
        "analyze",
        &file,
        "--prefill",
        "20",
        "--window",
        "8",
        "--group-quant-size",
        "4",
        "--residual-bits",
        "2",
        "--json",
    ]);
    assert_eq!(j["config"]["prefill"], 20);
    assert_eq!(j["config"]["decode_policy"], "window");
    let cfg = xquant_wgpu::XQuantConfig {
        group_quant_size: 4,
        residual_bits: 2,
        ..Default::default()
    };
    let q = quantized_tokens(40, 8, 4);
    let seq = |x: &[f32]| {
        let mut s = LayerSeq::new(2, 16);
        s.push(x);
        s
    };
    for (l, layer) in j["layers"].as_array().unwrap().iter().enumerate() {
        let c = &layer["cache"];
        for (kind, field, pick) in [
            (xquant_wgpu::KvKind::Key, "recon_mse_key", 0),
            (xquant_wgpu::KvKind::Value, "recon_mse_value", 1),
        ] {
            let data = |i: usize| {
                if pick == 0 {
                    &layers[i].0
                } else {
                    &layers[i].1
                }
            };
            let anchor = (l % 2 == 1).then(|| seq(data(l - 1)));
            let want = expected_window(
                &seq(data(l)),
                anchor.as_ref(),
                q,
                &cfg.spec(kind),
                2,
                DType::F16,
            );
            let want = mse(data(l), &want);
            let got = c[field].as_f64().unwrap();
            assert!(
                rel_diff(got, want) < CLI_REL,
                "layer {l} {field}: {got} vs model {want}"
            );
        }
        assert!(c["allocated_bytes"].as_u64().unwrap() >= c["accounted_bytes"].as_u64().unwrap());
    }
    let t = &j["totals"]["cache"];
    assert!(t["effective_bits"].as_f64().unwrap() < 16.0);
    assert_eq!(t["fp16_bytes"].as_u64().unwrap(), 4 * 2 * 2 * 40 * 16 * 2);
    // The reference policy is there too, and bad replay options are refused.
    let j = analyze_json(&[
        "analyze",
        &file,
        "--prefill",
        "40",
        "--decode-policy",
        "reference",
        "--json",
    ]);
    assert_eq!(j["totals"]["cache"]["decode_policy"], "reference");
    assert_one_line_error(
        &xquant(&["analyze", &file, "--prefill", "41"]),
        "--prefill must be in 1..=40",
    );
    assert_one_line_error(
        &xquant(&["analyze", &file, "--window", "8"]),
        "need --prefill",
    );
    assert_one_line_error(
        &xquant(&["analyze", &file, "--prefill", "4", "--window", "7"]),
        "multiple of group_quant_size",
    );
}

/// `attend`: the fused attention over a replayed cache against plain attention over the CPU
/// model of the same cache; `--dense`, the JSON report and bad input.
#[test]
fn attend_matches_attention_over_the_cpu_model_of_the_cache() {
    let _ctx = gpu_or_skip!();
    use common::cache_model::{expected_window, quantized_tokens, LayerSeq};
    use xquant_wgpu::kvfile::{read_tensors, tensors_to_bytes, Tensor};
    let (heads, tokens, dim, q_heads, t) = (2, 70, 16, 6, 3);
    let dims = [1, heads, tokens, dim];
    let layers = xquant_wgpu::synth::synthetic_kv(3, heads, tokens, dim, 0.8, 23);
    let file = write_kv(
        "attend-kv.safetensors",
        &dims,
        FileDType::F32,
        layers.clone(),
    );
    let queries: Vec<(String, Tensor)> = (0..3)
        .map(|i| {
            let data = xquant_wgpu::synth::normal(q_heads * t * dim, 40 + i as u64);
            let tensor = Tensor {
                shape: vec![1, q_heads, t, dim],
                dtype: FileDType::F32,
                data,
            };
            (format!("q.{i}"), tensor)
        })
        .collect();
    let q_path = temp_path("attend-q.safetensors");
    let refs: Vec<(String, &Tensor)> = queries.iter().map(|(n, q)| (n.clone(), q)).collect();
    std::fs::write(&q_path, tensors_to_bytes(&refs)).unwrap();
    let q_file = q_path.to_string_lossy().into_owned();
    let out = temp_path("attend-out.safetensors")
        .to_string_lossy()
        .into_owned();
    let args = [
        "attend",
        &file,
        "--queries",
        &q_file,
        "--prefill",
        "30",
        "--window",
        "16",
        "--group-quant-size",
        "8",
        "--out",
        &out,
    ];
    let j = analyze_json(&[&args[..], &["--json"]].concat());
    let cfg = xquant_wgpu::XQuantConfig {
        group_quant_size: 8,
        ..Default::default()
    };
    let q = quantized_tokens(tokens, 16, 8);
    let seq = |x: &[f32]| {
        let mut s = LayerSeq::new(heads, dim);
        s.push(x);
        s
    };
    let attn = read_tensors(&std::fs::read(&out).unwrap()).unwrap();
    let scale = 1.0 / (dim as f32).sqrt();
    for l in 0..3 {
        let report = &j["layers"][l];
        assert_eq!(report["tokens"], tokens);
        assert_eq!(report["quantized_tokens"], q);
        assert_eq!(report["window_tokens"], tokens - q);
        // The CPU model of what the cache holds (anchor 0, reuse 1, anchor 2), in f16.
        let recon = |pick: usize, kind| {
            let data = |i: usize| {
                if pick == 0 {
                    &layers[i].0
                } else {
                    &layers[i].1
                }
            };
            let anchor = (l == 1).then(|| seq(data(0)));
            expected_window(
                &seq(data(l)),
                anchor.as_ref(),
                q,
                &cfg.spec(kind),
                4,
                DType::F16,
            )
        };
        let k = recon(0, xquant_wgpu::KvKind::Key);
        let v = recon(1, xquant_wgpu::KvKind::Value);
        let shape = reference::AttentionShape {
            batch: 1,
            q_heads,
            kv_heads: heads,
            q_tokens: t,
            kv_tokens: tokens,
            dim,
        };
        let want = reference::attention(&queries[l].1.data, &k, &v, shape, tokens, scale).unwrap();
        let got = &attn[&format!("attn.{l}")];
        assert_eq!(got.shape, vec![1, q_heads, t, dim]);
        let vmax = v.iter().fold(1.0f32, |a, b| a.max(b.abs()));
        let worst = got
            .data
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs() / vmax)
            .fold(0.0f32, f32::max);
        // The model's K/V are rounded to f16 (as fetch returns them), the fused kernel's are
        // not: common::attend::ATTEND_F16_REL.
        assert!(worst < 2e-3, "layer {l}: fused vs model {worst}");
        let diff = report["max_abs_diff_fused_dense"].as_f64().unwrap();
        assert!(
            diff < 2e-3 * vmax as f64,
            "layer {l}: fused vs dense {diff}"
        );
    }
    // --dense writes fetch + plain attention instead.
    let r = xquant(&[&args[..], &["--dense"]].concat());
    assert_eq!(r.code, 0, "{}", r.stderr);
    let dense = read_tensors(&std::fs::read(&out).unwrap()).unwrap();
    assert_ne!(dense["attn.0"].data, attn["attn.0"].data);
    // Bad input: missing options, queries of the wrong shape or missing layers.
    assert_one_line_error(&xquant(&["attend", &file, "--out", &out]), "attend needs");
    let short = temp_path("attend-short.safetensors");
    std::fs::write(&short, tensors_to_bytes(&refs[..2])).unwrap();
    let short = short.to_string_lossy().into_owned();
    assert_one_line_error(
        &xquant(&[
            "attend",
            &file,
            "--queries",
            &short,
            "--prefill",
            "30",
            "--out",
            &out,
        ]),
        "no q.2",
    );
    let odd = temp_path("attend-odd.safetensors");
    let bad = Tensor {
        shape: vec![1, 5, 1, dim],
        dtype: FileDType::F32,
        data: vec![0.0; 5 * dim],
    };
    let bad_refs: Vec<(String, &Tensor)> = (0..3).map(|i| (format!("q.{i}"), &bad)).collect();
    std::fs::write(&odd, tensors_to_bytes(&bad_refs)).unwrap();
    let odd = odd.to_string_lossy().into_owned();
    assert_one_line_error(
        &xquant(&[
            "attend",
            &file,
            "--queries",
            &odd,
            "--prefill",
            "30",
            "--out",
            &out,
        ]),
        "multiple of 2",
    );
}

/// Without `--group-quant-size` the planner measures every group size that divides the
/// window and keeps the plan with the least error: the plan and error of the best of the
/// sizes planned one at a time.
#[test]
fn plan_keeps_the_best_of_the_group_sizes_that_divide_the_window() {
    let _ctx = gpu_or_skip!();
    let kv = temp_path("plan-sizes.safetensors");
    let kv = kv.to_str().unwrap();
    let r = xquant(&[
        "synth", "--out", kv, "--layers", "4", "--heads", "2", "--tokens", "160", "--dim", "32",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let plan = |size: Option<&str>| {
        let mut args = vec![
            "plan",
            kv,
            "--kv-error",
            "--target-bits",
            "5",
            "--window",
            "64",
            "--sinks",
            "2",
            "--json",
        ];
        if let Some(g) = size {
            args.extend(["--group-quant-size", g]);
        }
        analyze_json(&args)
    };
    let error = |v: &Value| v["error"].as_f64().unwrap();
    let searched = plan(None);
    let sizes: Vec<Value> = ["32", "64"].map(|g| plan(Some(g))).into();
    let best = sizes
        .iter()
        .min_by(|a, b| error(a).total_cmp(&error(b)))
        .unwrap();
    assert_eq!(searched["plan"], best["plan"]);
    assert_eq!(error(&searched), error(best));
    // The sizes' plans differ, so the search chose.
    assert!(sizes.iter().any(|s| error(s) != error(best)));
}

/// `xquant plan` on a synthetic capture: the plan meets its target, is written as a file that
/// `analyze --plan` and `attend --plan` read, and scores itself with the error it reported;
/// plan options that cannot work are one-line errors.
#[test]
fn plan_writes_a_plan_the_other_commands_follow() {
    let kv = temp_path("plan-synth.safetensors");
    let kv = kv.to_str().unwrap();
    let r = xquant(&[
        "synth", "--out", kv, "--layers", "6", "--heads", "2", "--tokens", "160", "--dim", "32",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let plan_path = temp_path("plan-synth.json");
    let plan_file = plan_path.to_str().unwrap();
    // Without queries the planner refuses unless told to plan by the K/V error.
    assert_one_line_error(&xquant(&["plan", kv, "--target-bits", "3.5"]), "no queries");
    let planned = analyze_json(&[
        "plan",
        kv,
        "--kv-error",
        "--target-bits",
        "3.5",
        "--context",
        "512",
        "--window",
        "32",
        "--sinks",
        "2",
        "--out",
        plan_file,
        "--json",
    ]);
    let bits = planned["effective_bits"].as_f64().unwrap();
    assert!(bits <= 3.5 + 1e-9 && bits > 2.5, "{bits}");
    let written: Value =
        serde_json::from_str(&std::fs::read_to_string(plan_file).unwrap()).unwrap();
    assert_eq!(written, planned["plan"]);
    assert_eq!(written["layers"].as_array().unwrap().len(), 6);
    // The planner's own error of the plan it chose, measured again through --score.
    let scored = analyze_json(&[
        "plan",
        kv,
        "--score",
        plan_file,
        "--context",
        "512",
        "--json",
    ]);
    let (a, b) = (
        scored["scores"][0]["error"].as_f64().unwrap(),
        planned["error"].as_f64().unwrap(),
    );
    assert!(rel_diff(a, b) < 1e-6, "{a} vs {b}");
    assert!(
        rel_diff(
            scored["scores"][0]["effective_bits"].as_f64().unwrap(),
            bits
        ) < 1e-12
    );
    // analyze follows the plan entry by entry.
    let report = analyze_json(&[
        "analyze",
        kv,
        "--plan",
        plan_file,
        "--prefill",
        "100",
        "--json",
    ]);
    assert_eq!(report["plan"], written);
    for (l, layer) in report["layers"].as_array().unwrap().iter().enumerate() {
        let own = written["layers"][l]["key"]["codes"] == "own";
        assert_eq!(
            layer["role"],
            if own { "anchor" } else { "reuse" },
            "layer {l}"
        );
    }
    assert_eq!(report["config"]["sinks"], 2);
    // A plan file's mistakes and option conflicts.
    let bad = temp_path("plan-bad.json");
    std::fs::write(&bad, written.to_string().replace("\"bits\":", "\"bitz\":")).unwrap();
    assert_one_line_error(
        &xquant(&["analyze", kv, "--plan", bad.to_str().unwrap()]),
        "unknown field `bitz`",
    );
    assert_one_line_error(
        &xquant(&["analyze", kv, "--preset", "kivi-2", "--base-bits", "3"]),
        "--base-bits cannot come with --plan/--preset",
    );
    assert_one_line_error(
        &xquant(&["analyze", kv, "--preset", "kivi-9"]),
        "unknown preset",
    );
    assert_one_line_error(
        &xquant(&[
            "plan",
            kv,
            "--kv-error",
            "--target-bits",
            "0.5",
            "--window",
            "64",
        ]),
        "below the smallest plan",
    );
}

/// `plan --score` on a capture with queries reports each plan's attention-output error: ~0
/// for a plan whose f16 window holds every token, small for 8-bit codes, larger as the
/// codes get coarser; without queries there is none.
#[test]
fn plan_score_reports_the_attention_output_error_with_queries() {
    let _ctx = gpu_or_skip!();
    use xquant_wgpu::kvfile::{tensors_to_bytes, Tensor};
    let (layers, heads, tokens, dim, q_heads) = (2, 2, 64, 32, 4);
    let kv = xquant_wgpu::synth::synthetic_kv(layers, heads, tokens, dim, 0.8, 5);
    let tensor = |data: &Vec<f32>, h: usize| Tensor {
        shape: vec![1, h, tokens, dim],
        dtype: FileDType::F32,
        data: data.clone(),
    };
    let mut named = Vec::new();
    for (i, (k, v)) in kv.iter().enumerate() {
        named.push((format!("past_key_values.{i}.key"), tensor(k, heads)));
        named.push((format!("past_key_values.{i}.value"), tensor(v, heads)));
        let q = xquant_wgpu::synth::normal(q_heads * tokens * dim, 70 + i as u64);
        named.push((format!("q.{i}"), tensor(&q, q_heads)));
    }
    let refs: Vec<(String, &Tensor)> = named.iter().map(|(n, t)| (n.clone(), t)).collect();
    let path = temp_path("score-attn.safetensors");
    std::fs::write(&path, tensors_to_bytes(&refs)).unwrap();
    let file = path.to_string_lossy().into_owned();
    // Every layer own codes of `bits` per token, groups of 16, `window` f16 tokens, no sinks.
    let plan = |name: &str, bits: u8, window: usize| {
        let entry = serde_json::json!({"codes": "own", "bits": bits, "axis": "channels"});
        let layer = serde_json::json!({"key": entry, "value": entry});
        let p = serde_json::json!({"format": "xquant-plan", "version": 1, "name": name,
            "window": window, "group_quant_size": 16, "layers": vec![layer; layers]});
        let path = temp_path(&format!("score-{name}.json"));
        std::fs::write(&path, p.to_string()).unwrap();
        path.to_string_lossy().into_owned()
    };
    let list = [
        plan("f16", 2, 96),
        plan("eight", 8, 0),
        plan("two", 2, 0),
        plan("one", 1, 0),
    ];
    let scored = analyze_json(&["plan", &file, "--score", &list.join(","), "--json"]);
    let e: Vec<f64> = (0..4)
        .map(|i| scored["scores"][i]["attention_error"].as_f64().unwrap())
        .collect();
    assert!(e[0] < 1e-5, "an f16 window over every token: {}", e[0]);
    assert!(e[1] < 1e-3 && e[1] > e[0], "8-bit codes: {e:?}");
    assert!(
        e[2] > 10.0 * e[1] && e[3] > e[2],
        "coarser codes, larger errors: {e:?}"
    );
    // With queries the planner chooses by the attention error: within the target, and with
    // less error for more bits.
    let planned = |bits: &str| {
        analyze_json(&[
            "plan",
            &file,
            "--target-bits",
            bits,
            "--context",
            "64",
            "--window",
            "0",
            "--sinks",
            "0",
            "--group-quant-size",
            "16",
            "--json",
        ])
    };
    let (low, high) = (planned("3.0"), planned("4.5"));
    for (p, target) in [(&low, 3.0), (&high, 4.5)] {
        assert_eq!(p["error_kind"], "attention output");
        assert!(
            p["effective_bits"].as_f64().unwrap() <= target + 1e-9,
            "{p}"
        );
    }
    assert!(high["error"].as_f64().unwrap() < low["error"].as_f64().unwrap());
    // Without queries: the planner's error only.
    let bare = temp_path("score-bare.safetensors");
    std::fs::write(
        &bare,
        tensors_to_bytes(
            &refs
                .iter()
                .filter(|(n, _)| !n.starts_with("q."))
                .cloned()
                .collect::<Vec<_>>(),
        ),
    )
    .unwrap();
    let bare = bare.to_string_lossy().into_owned();
    let scored = analyze_json(&["plan", &bare, "--score", &list[2], "--json"]);
    assert!(scored["scores"][0]["attention_error"].is_null());
    assert!(scored["scores"][0]["error"].as_f64().unwrap() > 0.0);
}

/// `xquant bench-cache` on one layer at 64 tokens (a 16-token prefill and memory row) with
/// `steps` timed steps and the `extra` arguments.
fn bench_cache_one_layer(steps: &str, extra: &[&str]) -> Run {
    let mut args = vec![
        "bench-cache",
        "--contexts",
        "64",
        "--steps",
        steps,
        "--prefill",
        "16",
        "--memory",
        "16",
        "--layers",
        "1",
    ];
    args.extend_from_slice(extra);
    xquant(&args)
}

/// Short contexts run up to 4× the steps (`steps_at`): the caches' budget covers them when
/// nothing longer (a prefill, a memory count) raises it, and the profiled steps after them.
#[test]
fn bench_cache_budgets_the_extra_steps_of_short_contexts() {
    let _ctx = gpu_or_skip!();
    let r = bench_cache_one_layer("8", &["--dense", "--profile"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

/// `--part` times (and counts) one part of the decode step in both caches: at 64 tokens
/// (one chunk, nothing quantized yet) a layer's step is one append launch and one attention
/// launch, so one layer counts 2 launches whole and 1 for either part; the JSON names the
/// part. Any other part is a usage error naming the choices, before any device.
#[test]
fn bench_cache_times_a_part_of_the_step() {
    let _ctx = gpu_or_skip!();
    let launches = |part: &str| -> (Value, Value) {
        let r = bench_cache_one_layer("1", &["--part", part, "--json"]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let j: Value = serde_json::from_str(&r.stdout).unwrap();
        assert_eq!(j["part"], json!(part));
        let row = &j["decode"][0];
        (row["xquant_launches"].clone(), row["fp16_launches"].clone())
    };
    assert_eq!(launches("step"), (json!(2), json!(2)));
    assert_eq!(launches("attention"), (json!(1), json!(1)));
    assert_eq!(launches("appends"), (json!(1), json!(1)));
    let r = xquant(&["bench-cache", "--part", "layers"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("--part must be one of step, attention, appends"),
        "{}",
        r.stderr
    );
}

#[test]
fn cache_commands_default_to_kivi_lloyd_and_options_start_from_kivi_2() {
    let _ctx = gpu_or_skip!();
    let value_entry = |extra: &[&str]| -> Value {
        let mut args = vec!["--json"];
        args.extend_from_slice(extra);
        let r = bench_cache_one_layer("1", &args);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let j: Value = serde_json::from_str(&r.stdout).unwrap();
        j["plan"]["layers"][0].clone()
    };
    let d = value_entry(&[]);
    assert_eq!(
        (
            &d["key"]["bits"],
            &d["value"]["levels"],
            &d["value"]["rotation"]
        ),
        (&json!(3), &json!("lloyd-max"), &json!("hadamard")),
        "{d}"
    );
    // Some quantizer options: the others are KIVI-2's, not the default's (whose Lloyd–Max
    // values would refuse values grouped along tokens).
    let o = value_entry(&["--value-axis", "tokens"]);
    assert_eq!(
        (
            &o["key"]["bits"],
            &o["value"]["axis"],
            &o["value"]["levels"]
        ),
        (&json!(2), &json!("tokens"), &json!("uniform")),
        "{o}"
    );
}

/// The attention launch switches of the environment take only their named values: anything
/// else is a usage error (exit 2) naming the variable and its choices, before any device.
#[test]
fn attention_launch_variables_reject_unknown_values() {
    for (name, choices) in [
        ("XQUANT_ATTENTION_CHUNKS", "auto, fewest, many"),
        ("XQUANT_ATTENTION_WORKGROUP", "auto, narrow, wide"),
        ("XQUANT_ATTENTION_FILL", "lean, workgroup"),
    ] {
        let r = xquant_env(&["info"], &[(name, "bogus")]);
        assert_eq!(r.code, 2, "{name}=bogus: {}", r.stderr);
        assert_one_line_error(&r, &format!("{name} must be one of {choices}, got `bogus`"));
    }
}

//! `xquant generate`, `capture` and `eval` on the real model.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::cli::{assert_one_line_error, temp_path, xquant};
use common::model::model_path;
use xquant_wgpu::kvfile::{read_tensors, KvFile};

#[test]
fn generate_capture_eval() {
    let Some(model) = model_path() else { return };
    let _ctx = gpu_or_skip!();
    let m = model.to_str().unwrap();

    let r = xquant(&[
        "generate",
        "--model",
        m,
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "2",
        "--cache",
        "f16",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.starts_with("The capital of France is Paris"),
        "{}",
        r.stdout
    );
    assert!(r.stderr.contains("tokens/s"), "{}", r.stderr);
    let r = xquant(&[
        "generate",
        "--model",
        m,
        "--prompt",
        "Name the capital of France.",
        "--chat",
        "--max-tokens",
        "12",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("Paris"), "chat reply: {}", r.stdout);

    let out = temp_path("capture.safetensors");
    let r = xquant(&[
        "capture",
        "--model",
        m,
        "--prompt",
        "It is a truth universally acknowledged",
        "--tokens",
        "6",
        "--queries",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let kv = KvFile::read(&out).unwrap();
    assert_eq!(
        (kv.layers.len(), kv.shape.dims().to_vec()),
        (30, vec![1, 3, 6, 64])
    );
    // The queries (9 heads) ride along, and the planner weighs key errors with them.
    let tensors = read_tensors(&std::fs::read(&out).unwrap()).unwrap();
    for l in 0..30 {
        let q = &tensors[&format!("q.{l}")];
        assert_eq!(q.shape, [1, 9, 6, 64]);
        assert!(q.data.iter().any(|&v| v != 0.0), "q.{l} is all zero");
    }
    // Six tokens are too few for the planner to judge attention by: it says so.
    let r = xquant(&[
        "plan",
        out.to_str().unwrap(),
        "--target-bits",
        "4",
        "--window",
        "0",
        "--sinks",
        "1",
        "--json",
    ]);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("6 tokens") && r.stderr.contains("at least 64"),
        "{}",
        r.stderr
    );

    let text = temp_path("eval.txt");
    std::fs::write(&text, include_str!("../data/pride-and-prejudice-ch1.txt")).unwrap();
    // The f16 rows kept by `eval` go to this run's own directory.
    let baselines = temp_path("eval-baselines");
    let _ = std::fs::remove_dir_all(&baselines);
    let eval = |extra: &[&str]| {
        let mut args = vec!["eval", "--model", m, "--text", text.to_str().unwrap()];
        args.extend_from_slice(&["--baseline-dir", baselines.to_str().unwrap()]);
        args.extend_from_slice(extra);
        xquant(&args)
    };
    // Runs `eval` with `extra` and parses its JSON.
    let eval_json = |extra: &[&str]| {
        let r = eval(extra);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let j: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
        (j, r.stderr)
    };
    let (j, _) = eval_json(&[
        "--tokens",
        "34",
        "--prefill",
        "32",
        "--window",
        "0",
        "--sinks",
        "0",
        "--json",
    ]);
    let rows = j["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 9);
    assert!(
        j["f16_row"].as_str().unwrap().starts_with("run, kept in"),
        "{}",
        j["f16_row"]
    );
    let f16_perplexity = rows[0]["perplexity"].as_f64().unwrap();
    assert_eq!(rows[0]["name"], "f16");
    assert_eq!(rows[0]["effective_bits"], 16.0);
    assert_eq!(rows[0]["top1_agreement"], 1.0);
    assert_eq!(j["mode"], "chunked");
    assert_eq!(rows[0]["unquantized_share"], 1.0);
    // Window 0, the whole text (34 tokens) held at the end: 32 of them quantized.
    assert!((rows[1]["unquantized_share"].as_f64().unwrap() - 2.0 / 34.0).abs() < 1e-9);
    assert!(j["warning"].is_null(), "{}", j["warning"]);
    for r in rows {
        let ppl = r["perplexity"].as_f64().unwrap();
        assert!(ppl.is_finite() && ppl > 1.0, "{r}");
        assert!(r["mean_kl"].as_f64().unwrap() >= -1e-9, "{r}");
    }
    // Pure reuse on a model whose adjacent layers are uncorrelated is worse than a residual.
    let ppl = |name: &str| {
        rows.iter()
            .find(|r| r["name"].as_str().unwrap().starts_with(name))
            .unwrap()["perplexity"]
            .as_f64()
            .unwrap()
    };
    assert!(
        ppl("g2 b2 r0") > ppl("g2 b2 r4"),
        "pure reuse {} vs residual 4 {}",
        ppl("g2 b2 r0"),
        ppl("g2 b2 r4")
    );

    // --preset: the f16 row and the preset's, named after it.
    let (j, _) = eval_json(&[
        "--tokens",
        "34",
        "--prefill",
        "32",
        "--preset",
        "kivi-2,xquant-paper",
        "--window",
        "0",
        "--sinks",
        "1",
        "--json",
    ]);
    let names: Vec<&str> = j["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["f16", "kivi-2", "xquant-paper"]);
    // The same tokens, prefill and mode: the f16 row is recomputed from the kept one, equal.
    assert!(
        j["f16_row"].as_str().unwrap().starts_with("replayed from"),
        "{}",
        j["f16_row"]
    );
    assert_eq!(j["rows"][0]["perplexity"].as_f64().unwrap(), f16_perplexity);
    let kivi = &j["rows"][1];
    assert_eq!(kivi["config"]["sinks"], 1);
    assert_eq!(kivi["config"]["layers"][0]["value"]["axis"], "channels");
    // 34 tokens held: 1 sink, 32 quantized, 1 in the window; KIVI-2 quantizes at 3 bits.
    assert!((kivi["quantized_bits"].as_f64().unwrap() - 3.0).abs() < 1e-9);

    // A window that keeps every token in f16 is said, on stderr and in the JSON.
    let (j, stderr) = eval_json(&["--tokens", "4", "--prefill", "2", "--json"]);
    let warning = j["warning"].as_str().unwrap();
    assert!(warning.contains("100%"), "{warning}");
    assert!(stderr.contains(warning), "{stderr}");

    // Bad input: one line, non-zero exit.
    assert_one_line_error(&xquant(&["generate", "--prompt", "x"]), "--model");
    assert_one_line_error(
        &xquant(&["generate", "--model", "/nonexistent.gguf", "--prompt", "x"]),
        "cannot read",
    );
    let junk = temp_path("junk.gguf");
    std::fs::write(&junk, b"GGUF\x03\x00\x00\x00 not really").unwrap();
    assert_one_line_error(
        &xquant(&[
            "generate",
            "--model",
            junk.to_str().unwrap(),
            "--prompt",
            "x",
        ]),
        "GGUF",
    );
    assert_one_line_error(&eval(&["--tokens", "100000"]), "--tokens");
    assert_one_line_error(&eval(&["--mode", "fast"]), "--mode");
    assert_one_line_error(
        &xquant(&["generate", "--model", m, "--prompt", "x", "--cache", "f8"]),
        "--cache",
    );
}

#[test]
fn generate_saves_and_continues_a_cache() {
    let Some(model) = model_path() else { return };
    let _ctx = gpu_or_skip!();
    let m = model.to_str().unwrap();
    let file = temp_path("conversation.xqcache");
    let f = file.to_str().unwrap();
    let r = xquant(&[
        "generate",
        "--model",
        m,
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "3",
        "--cache",
        "f16",
        "--save-cache",
        f,
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stderr.contains("saved to"), "{}", r.stderr);
    // The prompt follows the cached tokens; the file's kind is kept.
    let r = xquant(&[
        "generate",
        "--model",
        m,
        "--prompt",
        " and the capital of Spain is",
        "--max-tokens",
        "2",
        "--load-cache",
        f,
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stderr.contains("[8 cached + "), "{}", r.stderr);
    assert!(r.stdout.contains("Madrid"), "{}", r.stdout);
    let r = xquant(&[
        "generate",
        "--model",
        m,
        "--prompt",
        "x",
        "--load-cache",
        f,
        "--window",
        "64",
    ]);
    assert_one_line_error(&r, "--window cannot come with --load-cache");
    let mut bytes = std::fs::read(&file).unwrap();
    let n = bytes.len();
    bytes[n / 2] ^= 1;
    std::fs::write(&file, &bytes).unwrap();
    let r = xquant(&["generate", "--model", m, "--prompt", "x", "--load-cache", f]);
    assert_one_line_error(&r, "FormatError");
}

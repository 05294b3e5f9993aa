#![cfg(not(target_arch = "wasm32"))]
//! Replays the committed fuzz corpus (`fuzz/corpus/<target>/`) and a fixed number of seeded
//! mutations and generated inputs per target, on stable Rust: no panic, no violated
//! property (round trips), peak allocation within `fuzz/harness/`'s bound, and a time
//! limit per input. The long-run driver is `examples/fuzz.rs`.

#[path = "../fuzz/harness/mod.rs"]
mod harness;

use std::time::Duration;

use harness::{input_name, mutate, read_corpus, Rng, Target};

#[global_allocator]
static ALLOC: harness::Counting = harness::Counting;

// Seeded mutations of corpus entries and structure-aware inputs per target, sized so that
// the five tests take a few seconds each in the test build (the tokenizer's ~15 s: every
// input through four tokenizers, Gemma's 262,144-piece SentencePiece among them).
const MUTATIONS_SAFETENSORS: usize = 100_000;
const MUTATIONS_GGUF: usize = 100_000;
const MUTATIONS_TOKENIZER: usize = 4_000;
const MUTATIONS_PLAN: usize = 100_000;
const MUTATIONS_SAVED_CACHE: usize = 50_000;
const GENERATED: usize = 2_000;
/// Inputs up to this many bytes (saved caches: `Target::max_len`, their rings and pages).
const MAX_LEN: usize = 4096;
/// Per-input time limit: the driver's 1 s (release), with room for this unoptimised build
/// on a shared machine.
const TIME_LIMIT: Duration = Duration::from_secs(3);

#[derive(Default)]
struct Stats {
    runs: usize,
    worst_ratio: f64,
    slowest: Duration,
}

fn check(input: &[u8], target: Target, what: &str, failures: &mut Vec<String>, st: &mut Stats) {
    let ex = target.exec(input);
    st.runs += 1;
    st.slowest = st.slowest.max(ex.elapsed);
    if input.len() >= 256 {
        let ratio = ex.peak.saturating_sub(harness::ALLOC_SLACK) as f64 / input.len() as f64;
        st.worst_ratio = st.worst_ratio.max(ratio);
    }
    let mut problems = Vec::new();
    if let Some(f) = ex.failure {
        problems.push(f);
    }
    if ex.peak > ex.limit {
        problems.push(format!(
            "allocation: peak {} bytes for {} input bytes (limit {})",
            ex.peak,
            input.len(),
            ex.limit
        ));
    }
    if ex.elapsed > TIME_LIMIT {
        // A busy machine can stall one run: the input counts as slow when two more runs
        // are slow too.
        let again = (0..2).map(|_| target.exec(input).elapsed).min();
        if again.is_some_and(|t| t > TIME_LIMIT) {
            problems.push(format!("time: {:?} (limit {TIME_LIMIT:?})", ex.elapsed));
        }
    }
    if problems.is_empty() {
        return;
    }
    // Keep the input for a look (and for the corpus once fixed).
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-findings");
    let path = dir.join(format!("{}-{}", target.name(), input_name(input)));
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(&path, input);
    failures.push(format!(
        "{} {what} ({} bytes, saved to {}): {}",
        target.name(),
        input.len(),
        path.display(),
        problems.join("; ")
    ));
}

fn replay(target: Target, seed: u64, mutations: usize, generated: usize) {
    let start = std::time::Instant::now();
    let mut st = Stats::default();
    harness::quiet_panics();
    target.prepare();
    let corpus = read_corpus(&target.corpus_dir());
    assert!(
        !corpus.is_empty(),
        "no corpus in {}",
        target.corpus_dir().display()
    );
    let mut failures = Vec::new();
    for (name, input) in &corpus {
        let what = format!("corpus file {name}");
        check(input, target, &what, &mut failures, &mut st);
    }
    let inputs: Vec<Vec<u8>> = corpus.into_iter().map(|(_, b)| b).collect();
    let mut rng = Rng::new(seed);
    for i in 0..mutations {
        let base = &inputs[rng.below(inputs.len())];
        let m = mutate(&mut rng, base, &inputs, target.max_len().unwrap_or(MAX_LEN));
        let what = format!("mutation {i} of seed {seed}");
        check(&m, target, &what, &mut failures, &mut st);
    }
    for i in 0..generated {
        let g = target.generate(&mut rng);
        let what = format!("generated input {i} of seed {seed}");
        check(&g, target, &what, &mut failures, &mut st);
    }
    eprintln!(
        "{}: {} inputs in {:.1} s, worst (peak - slack)/len {:.1} (inputs >= 256 bytes), slowest {:?}",
        target.name(),
        st.runs,
        start.elapsed().as_secs_f64(),
        st.worst_ratio,
        st.slowest
    );
    assert!(
        failures.is_empty(),
        "{} failing inputs:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn fuzz_safetensors() {
    replay(Target::Safetensors, 11, MUTATIONS_SAFETENSORS, GENERATED);
}

#[test]
fn fuzz_gguf() {
    replay(Target::Gguf, 12, MUTATIONS_GGUF, GENERATED);
}

#[test]
fn fuzz_tokenizer() {
    replay(Target::Tokenizer, 13, MUTATIONS_TOKENIZER, GENERATED);
}

#[test]
fn fuzz_plan() {
    replay(Target::Plan, 14, MUTATIONS_PLAN, GENERATED);
}

#[test]
fn fuzz_saved_cache() {
    replay(Target::SavedCache, 15, MUTATIONS_SAVED_CACHE, GENERATED);
}

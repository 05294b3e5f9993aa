//! The long-run fuzz driver (stable Rust): mutates the committed corpus and structure-aware
//! generated inputs for one target, checking every run for panics, violated properties,
//! the allocation bound and the time limit.
//!
//! `cargo run --release --example fuzz -- <safetensors|gguf|tokenizer|plan|saved-cache> [--seconds 600]
//! [--seed N] [--max-len 8192] [--seeds DIR] [--save DIR [--save-max N]]`
//!
//! Failing inputs go to `fuzz/findings/`; `--save DIR` writes, for every distinct outcome
//! seen, the smallest input that reached it (a corpus to commit after review); with
//! `--save-max N` at most N of them: successes first, then errors spread evenly. `--seeds DIR`
//! replays a directory of inputs first (with `--seconds 0`, only that: to choose a corpus
//! from a previous run's saved inputs).

#[path = "../fuzz/harness/mod.rs"]
mod harness;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness::{input_name, mutate, read_corpus, Rng, Target, TIME_LIMIT};

#[global_allocator]
static ALLOC: harness::Counting = harness::Counting;

/// Inputs running longer than this are a hang: the driver saves the input and aborts.
const HANG: Duration = Duration::from_secs(20);

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage =
        "usage: fuzz <safetensors|gguf|tokenizer|plan|saved-cache> [--seconds S] [--seed N] \
                 [--max-len B] [--seeds DIR] [--save DIR [--save-max N]]";
    let Some(target) = args.first().and_then(|a| Target::by_name(a)) else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let opt = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let seconds: u64 = opt("--seconds").and_then(|s| s.parse().ok()).unwrap_or(60);
    let seed: u64 = opt("--seed").and_then(|s| s.parse().ok()).unwrap_or(1);
    let max_len: usize = opt("--max-len")
        .and_then(|s| s.parse().ok())
        .unwrap_or(target.max_len().unwrap_or(8192));
    let save = opt("--save").map(PathBuf::from);
    let save_max: usize = opt("--save-max")
        .and_then(|s| s.parse().ok())
        .unwrap_or(usize::MAX);
    let findings = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/findings");

    harness::quiet_panics();
    target.prepare();

    // The watchdog: an input running past HANG is saved and the process aborts.
    let current: Arc<Mutex<Vec<u8>>> = Arc::default();
    let started = Arc::new(AtomicU64::new(0));
    let epoch = Instant::now();
    {
        let (current, started, findings) = (current.clone(), started.clone(), findings.clone());
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(500));
            let s = started.load(Ordering::Relaxed);
            if s != 0
                && (epoch.elapsed().as_millis() as u64).saturating_sub(s) > HANG.as_millis() as u64
            {
                let input = current.lock().map(|c| c.clone()).unwrap_or_default();
                let _ = std::fs::create_dir_all(&findings);
                let path = findings.join(format!("{}-hang-{}", target.name(), input_name(&input)));
                let _ = std::fs::write(&path, &input);
                eprintln!(
                    "HANG: an input ran over {HANG:?}; saved to {}",
                    path.display()
                );
                std::process::abort();
            }
        });
    }

    let mut rng = Rng::new(seed);
    let mut corpus: Vec<Vec<u8>> = read_corpus(&target.corpus_dir())
        .into_iter()
        .map(|(_, b)| b)
        .collect();
    let committed = corpus.len();
    // Inputs to replay first, e.g. a previous run's saved inputs (to choose a corpus again).
    if let Some(dir) = opt("--seeds") {
        corpus.extend(read_corpus(Path::new(&dir)).into_iter().map(|(_, b)| b));
    }
    // Smallest input per outcome.
    let mut best: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut failures: BTreeMap<String, usize> = BTreeMap::new();
    let (mut execs, mut kept, mut worst_ratio, mut slowest) =
        (0u64, 0usize, 0.0f64, Duration::ZERO);
    let mut worst_input_len = 0usize;
    let mut retimed = 0usize;
    let mut worst_large = 0.0f64;
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut last_report = Instant::now();
    let begin = Instant::now();
    // Replay the committed corpus first.
    let mut replay = corpus.clone().into_iter();
    loop {
        let input = match replay.next() {
            Some(x) => x,
            None if Instant::now() >= deadline => break,
            None if corpus.is_empty() || rng.one_in(4) => target.generate(&mut rng),
            None => {
                let base = corpus[rng.below(corpus.len())].clone();
                mutate(&mut rng, &base, &corpus, max_len)
            }
        };
        if let Ok(mut c) = current.lock() {
            c.clear();
            c.extend_from_slice(&input);
        }
        started.store(epoch.elapsed().as_millis() as u64 + 1, Ordering::Relaxed);
        let ex = target.exec(&input);
        started.store(0, Ordering::Relaxed);
        execs += 1;
        let mut problem = ex.failure.clone();
        if ex.peak > ex.limit {
            problem.get_or_insert(format!(
                "allocation: peak {} bytes for a {}-byte input (limit {})",
                ex.peak,
                input.len(),
                ex.limit
            ));
        }
        if ex.elapsed > TIME_LIMIT {
            // A busy machine can stall one run: a slow input counts when two more runs
            // are slow too.
            let again = (0..2).map(|_| target.exec(&input).elapsed).min();
            if again.is_some_and(|t| t > TIME_LIMIT) {
                problem.get_or_insert(format!(
                    "time: {:?} for a {}-byte input (limit {TIME_LIMIT:?})",
                    ex.elapsed,
                    input.len()
                ));
            } else {
                retimed += 1;
            }
        }
        if input.len() >= 256 {
            // The factor this input needed beyond the fixed part of the bound.
            let ratio = ex.peak.saturating_sub(harness::ALLOC_SLACK) as f64 / input.len() as f64;
            if ratio > worst_ratio {
                worst_ratio = ratio;
                worst_input_len = input.len();
            }
            if input.len() >= 4096 {
                worst_large = worst_large.max(ratio);
            }
        }
        slowest = slowest.max(ex.elapsed);
        if let Some(p) = problem {
            let key: String = p
                .chars()
                .filter(|c| !c.is_ascii_digit())
                .take(160)
                .collect();
            let seen = failures.entry(key).or_insert(0);
            if *seen == 0 {
                let _ = std::fs::create_dir_all(&findings);
                let path = findings.join(format!("{}-{}", target.name(), input_name(&input)));
                let _ = std::fs::write(&path, &input);
                eprintln!("FINDING: {p}\n  input: {}", path.display());
            }
            *seen += 1;
            continue;
        }
        match best.get(&ex.outcome) {
            None => {
                kept += 1;
                corpus.push(input.clone());
                best.insert(ex.outcome, input);
            }
            Some(b) if input.len() < b.len() => {
                best.insert(ex.outcome, input);
            }
            Some(_) => {}
        }
        if last_report.elapsed() > Duration::from_secs(30) {
            last_report = Instant::now();
            eprintln!(
                "[{}] {:>4}s execs {execs} ({:.0}/s) outcomes {} corpus {} findings {}",
                target.name(),
                begin.elapsed().as_secs(),
                execs as f64 / begin.elapsed().as_secs_f64(),
                best.len(),
                corpus.len(),
                failures.len()
            );
        }
    }
    let secs = begin.elapsed().as_secs_f64();
    println!(
        "{}: {execs} executions in {secs:.0} s ({:.0}/s), seed {seed}, committed corpus \
         {committed}, new corpus entries {kept}, outcomes {}, distinct findings {}, worst \
         (peak - slack)/len {worst_ratio:.1} (input of {worst_input_len} bytes, inputs >= 256 bytes; \
         {worst_large:.1} over inputs >= 4 KiB), \
         slowest input {slowest:?} ({retimed} slow runs not slow when rerun)",
        target.name(),
        execs as f64 / secs,
        best.len(),
        failures.len()
    );
    for (f, n) in &failures {
        println!("  finding ({n}×): {f}");
    }
    if let Some(dir) = save {
        let chosen = choose(&best, save_max);
        let _ = std::fs::create_dir_all(&dir);
        for (_, input) in &chosen {
            let _ = std::fs::write(dir.join(input_name(input)), input);
        }
        let index: String = chosen.iter().map(|(o, _)| format!("{o}\n")).collect();
        let _ = std::fs::write(dir.with_extension("outcomes.txt"), index);
        println!(
            "  wrote {} of {} inputs (one per outcome) to {}",
            chosen.len(),
            best.len(),
            dir.display()
        );
    }
    if !failures.is_empty() {
        std::process::exit(1);
    }
}

/// At most `max` (outcome, input) pairs: half from the outcomes that got furthest (most
/// `ok` parts: a parsed file whose config and tokenizer also read), the rest spread evenly
/// over the other outcomes in sorted order.
fn choose(best: &BTreeMap<String, Vec<u8>>, max: usize) -> Vec<(String, Vec<u8>)> {
    let mut all: Vec<(String, Vec<u8>)> =
        best.iter().map(|(o, i)| (o.clone(), i.clone())).collect();
    if all.len() <= max {
        return all;
    }
    all.sort_by_key(|(o, i)| (std::cmp::Reverse(o.matches("ok").count()), i.len()));
    let rest = all.split_off(max / 2);
    let room = max - all.len();
    let step = rest.len() as f64 / room as f64;
    all.extend((0..room).map(|k| rest[(k as f64 * step) as usize].clone()));
    all
}

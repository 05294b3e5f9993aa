//! Targets.

#![allow(unused_imports)]

use super::*;

/// A parser under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// `read_tensors` and `KvFile::from_bytes` (safetensors K/V files).
    Safetensors,
    /// `Gguf::parse`, tensor data, `ModelConfig::from_gguf`, `Tokenizer::from_gguf`.
    Gguf,
    /// `Tokenizer::encode` / `decode` round trips on arbitrary text and ids.
    Tokenizer,
    /// `CachePlan::from_json` and its round trip through `to_json`.
    Plan,
    /// `SavedCache::validate` and `inspect` on saved cache sets (XQuant and f16), as given
    /// and resealed (length and checksum rewritten, so that mutations reach the body).
    SavedCache,
}

/// Every target.
pub const TARGETS: [Target; 5] = [
    Target::Safetensors,
    Target::Gguf,
    Target::Tokenizer,
    Target::Plan,
    Target::SavedCache,
];

/// How a run on one input went.
#[derive(Debug)]
pub struct Exec {
    /// The target's outcome (a normalized error, or the shape of a success): new outcomes
    /// are what the driver keeps in its corpus.
    pub outcome: String,
    /// A panic or a violated property.
    pub failure: Option<String>,
    /// Peak live bytes while the target ran.
    pub peak: usize,
    /// The bound on `peak` for this input.
    pub limit: usize,
    /// Wall time.
    pub elapsed: Duration,
}

impl Target {
    /// The name used for corpus directories and the driver's argument.
    pub fn name(self) -> &'static str {
        match self {
            Target::Safetensors => "safetensors",
            Target::Gguf => "gguf",
            Target::Tokenizer => "tokenizer",
            Target::Plan => "plan",
            Target::SavedCache => "saved-cache",
        }
    }

    /// The longest input worth mutating for this target, where it needs more than the
    /// driver's default: a saved cache's smallest real sets take 4–9 KB (rings grow in
    /// steps of 64 tokens).
    pub fn max_len(self) -> Option<usize> {
        (self == Target::SavedCache).then_some(16 << 10)
    }

    /// The target named `name`.
    pub fn by_name(name: &str) -> Option<Target> {
        TARGETS.into_iter().find(|t| t.name() == name)
    }

    /// Where the committed corpus of this target lives.
    pub fn corpus_dir(self) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/corpus")
            .join(self.name())
    }

    /// Builds what the target needs once (tokenizers), outside any measurement.
    pub fn prepare(self) {
        source_words();
        if self == Target::Tokenizer {
            small_tokenizer();
            real_tokenizer();
            small_spm();
            gemma_tokenizer();
        }
    }

    /// Runs the target on `input` under panic catching and allocation measurement.
    pub fn exec(self, input: &[u8]) -> Exec {
        let _ = PANIC_MSG.try_with(|m| m.borrow_mut().take());
        let start = Instant::now();
        let (r, peak) = measure(|| panic::catch_unwind(AssertUnwindSafe(|| self.run(input))));
        let elapsed = start.elapsed();
        let (outcome, failure) = match r {
            Ok(Ok(outcome)) => (outcome, None),
            Ok(Err(violation)) => ("property violated".to_string(), Some(violation)),
            Err(_) => {
                let msg = PANIC_MSG
                    .try_with(|m| m.borrow_mut().take())
                    .ok()
                    .flatten()
                    .unwrap_or_else(|| "(no message)".into());
                ("panic".to_string(), Some(format!("panic: {msg}")))
            }
        };
        let limit = match self {
            Target::Tokenizer => {
                TOKENIZER_FACTOR * String::from_utf8_lossy(input).len() + ALLOC_SLACK
            }
            _ => alloc_limit(input.len()),
        };
        Exec {
            outcome,
            failure,
            peak,
            limit,
            elapsed,
        }
    }

    /// Runs the target: `Ok(outcome)` or `Err(property violated)`; a panic is a failure too.
    pub fn run(self, input: &[u8]) -> Result<String, String> {
        match self {
            Target::Safetensors => run_safetensors(input),
            Target::Gguf => run_gguf(input),
            Target::Tokenizer => run_tokenizer(input),
            Target::Plan => run_plan(input),
            Target::SavedCache => run_saved_cache(input),
        }
    }

    /// A structure-aware input: mostly well-formed, with fields chosen to stress the checks.
    pub fn generate(self, rng: &mut Rng) -> Vec<u8> {
        match self {
            Target::Safetensors => gen_safetensors(rng),
            Target::Gguf => gen_gguf(rng),
            Target::Tokenizer => gen_text(rng),
            Target::Plan => gen_plan(rng),
            Target::SavedCache => gen_saved_cache(rng),
        }
    }
}

/// An error reduced to its kind and the words of its message, numbers and names elided, so
/// that outcomes count kinds of rejection rather than values.
pub fn normalize(e: &XqError) -> String {
    // Quoted and bracketed parts are values (names, shapes, JSON): dropped.
    let mut depth = 0usize;
    let mut quoted: Option<char> = None;
    let mut bare = String::new();
    for c in e.message().chars() {
        match (quoted, c) {
            (Some(q), c) if c == q => quoted = None,
            (Some(_), _) => {}
            (None, '"' | '`') => quoted = Some(c),
            (None, '[' | '(' | '{') => depth += 1,
            (None, ']' | ')' | '}') => depth = depth.saturating_sub(1),
            (None, c) if depth == 0 => bare.push(c),
            _ => {}
        }
    }
    let mut words: Vec<String> = bare
        .split_whitespace()
        // What follows `got` / `found` is a value from the input.
        .take_while(|w| !matches!(*w, "got" | "(found"))
        .take(16)
        .map(|w| {
            let w = w.trim_matches(|c: char| ",.:;".contains(c));
            if w.len() > 2 && source_words().contains(w) {
                w.to_string()
            } else if w.chars().all(|c| c.is_ascii_digit()) {
                "#".to_string()
            } else {
                "*".to_string()
            }
        })
        .collect();
    words.dedup_by(|a, b| a == "*" && b == "*");
    format!("{}: {}", e.kind(), words.join(" "))
}

/// Lower-case words of the parsers' sources: the words of their messages. Words of an
/// error message outside this set come from the input.
pub(crate) fn source_words() -> &'static std::collections::HashSet<&'static str> {
    static WORDS: OnceLock<std::collections::HashSet<&'static str>> = OnceLock::new();
    WORDS.get_or_init(|| {
        [
            include_str!("../../src/kvfile.rs"),
            include_str!("../../src/model/gguf.rs"),
            include_str!("../../src/model/config.rs"),
            include_str!("../../src/model/tokenizer/mod.rs"),
            include_str!("../../src/model/tokenizer/bpe.rs"),
            include_str!("../../src/model/tokenizer/spm.rs"),
            include_str!("../../src/cache/plan.rs"),
            include_str!("../../src/cache/persist.rs"),
            include_str!("../../src/cache/page.rs"),
            include_str!("../../src/layout.rs"),
            include_str!("../../src/config.rs"),
        ]
        .iter()
        .flat_map(|s| s.split(|c: char| !(c.is_ascii_lowercase() || c == '-')))
        .filter(|w| !w.is_empty())
        .collect()
    })
}

pub(crate) fn outcome<T>(r: &Result<T, XqError>, ok: impl FnOnce(&T) -> String) -> String {
    match r {
        Ok(v) => format!("ok {}", ok(v)),
        Err(e) => normalize(e),
    }
}

pub(crate) fn run_safetensors(input: &[u8]) -> Result<String, String> {
    let tensors = read_tensors(input);
    if let Ok(map) = &tensors {
        for (name, t) in map {
            let elements = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            if elements != Some(t.data.len()) {
                return Err(format!(
                    "read_tensors: {name} has shape {:?} but {} values",
                    t.shape,
                    t.data.len()
                ));
            }
        }
        let refs: Vec<(String, &Tensor)> = map.iter().map(|(n, t)| (n.clone(), t)).collect();
        let again = read_tensors(&tensors_to_bytes(&refs))
            .map_err(|e| format!("read_tensors: written tensors do not read back: {e}"))?;
        if &again != map {
            return Err("read_tensors: tensors differ after a write and a read".into());
        }
    }
    let kv = KvFile::from_bytes(input);
    if let Ok(kv) = &kv {
        let shape = kv.shape.dims().to_vec();
        for (i, l) in kv.layers.iter().enumerate() {
            if l.key.len() != kv.shape.len() || l.value.len() != kv.shape.len() {
                return Err(format!(
                    "KvFile: layer {i} length differs from shape {shape:?}"
                ));
            }
        }
        let whole = kv.tokens(0, KvKind::Key, 0, kv.shape.tokens());
        if whole != kv.layers[0].key {
            return Err("KvFile::tokens of every token differs from layer 0's keys".into());
        }
        let again = KvFile::from_bytes(&kv.to_bytes())
            .map_err(|e| format!("KvFile: written file does not read back: {e}"))?;
        if again.shape != kv.shape || again.dtype != kv.dtype {
            return Err("KvFile: shape or dtype differs after a write and a read".into());
        }
        for (a, b) in again.layers.iter().zip(&kv.layers) {
            if a.key != b.key || a.value != b.value {
                return Err("KvFile: values differ after a write and a read".into());
            }
        }
        let _ = kv.max_abs();
    }
    Ok(format!(
        "{} | {}",
        outcome(&tensors, |m| format!("{} tensors", m.len().min(3))),
        outcome(&kv, |k| format!(
            "{} layers {:?} rank {}",
            k.layers.len().min(3),
            k.dtype,
            k.shape.dims().len()
        ))
    ))
}

pub(crate) fn run_gguf(input: &[u8]) -> Result<String, String> {
    let g = Gguf::parse(input);
    let Ok(g) = &g else {
        return Ok(outcome(&g, |_| String::new()));
    };
    for (name, t) in &g.tensors {
        if name != &t.name {
            return Err(format!("tensor {name} is listed under another name"));
        }
        let end = t.offset.checked_add(t.bytes);
        let Some(data) = end.and_then(|e| input.get(t.offset..e)) else {
            return Err(format!(
                "tensor {name}: [{}, +{}) is outside the file",
                t.offset, t.bytes
            ));
        };
        let values = dequantize(data, t.ty);
        if values.len() != t.elements() {
            return Err(format!(
                "tensor {name}: {} values dequantized, {} elements",
                values.len(),
                t.elements()
            ));
        }
    }
    let cfg = ModelConfig::from_gguf(g);
    let tok = Tokenizer::from_gguf(g);
    if let Ok(tok) = &tok {
        let ids = tok.encode("Hello world, it's 2024! <|im_start|>user\n", true);
        if ids.iter().any(|&i| i as usize >= tok.vocab_size()) {
            return Err("encode returned an id outside the vocabulary".into());
        }
        let _ = tok.decode(&ids);
        let _ = tok.decode(&[0, 1, u32::MAX, tok.bos, tok.eos]);
        let _ = tok.chat_prompt("hi");
    }
    Ok(format!(
        "ok v{} meta {} tensors {} | cfg {} | tok {}",
        g.version,
        g.meta.len().min(3),
        g.tensors.len().min(3),
        outcome(&cfg, |_| String::new()),
        outcome(&tok, |t| format!(
            "vocab {}",
            t.vocab_size().next_power_of_two()
        ))
    ))
}

pub(crate) fn run_tokenizer(input: &[u8]) -> Result<String, String> {
    let text = String::from_utf8_lossy(input);
    let mut outcome = String::new();
    let real = real_tokenizer();
    // SentencePiece writes spaces as `▁` and reads every `▁` back as a space: its round trip
    // is the text with `▁` as spaces.
    let spm_text = text.replace('\u{2581}', " ");
    // Gemma's 262,144-piece tokenizer takes a quarter of the inputs (lengths a multiple of
    // 4) in the test build, which keeps its replay short; long runs (release) take them all.
    let gemma = gemma_tokenizer().filter(|_| input.len() % 4 == 0 || !cfg!(debug_assertions));
    let tokenizers = [
        ("small", Some(small_tokenizer()), None, false),
        (
            "smollm2",
            real.map(|r| &r.tok),
            real.map(|r| &r.absent),
            false,
        ),
        ("small-spm", Some(small_spm()), None, true),
        ("gemma3", gemma, None, true),
    ];
    for (which, tok, absent, spm) in tokenizers {
        let Some(tok) = tok else { continue };
        for special in [false, true] {
            let ids = tok.encode(&text, special);
            if let Some(&bad) = ids.iter().find(|&&i| i as usize >= tok.vocab_size()) {
                return Err(format!("{which}: encode returned id {bad}"));
            }
            let back = tok.decode_bytes(&ids);
            // Bytes the vocabulary has no symbol for are dropped, and only those.
            let expected: Vec<u8> = match (absent, spm) {
                (Some(a), _) => text.bytes().filter(|&b| !a[b as usize]).collect(),
                (None, true) => spm_text.as_bytes().to_vec(),
                (None, false) => text.as_bytes().to_vec(),
            };
            if back != expected {
                return Err(format!(
                    "{which}: decode(encode(text, special={special})) differs from the text \
                     ({} bytes in, {} bytes out)",
                    text.len(),
                    back.len()
                ));
            }
            // Outcomes: how many ids (log2), how many bytes per id (log2), whether a
            // control token matched.
            if special {
                let plain = tok.encode(&text, false).len();
                outcome += &format!(
                    " {which} ids ~2^{} bytes/id ~2^{} control {}",
                    usize::BITS - ids.len().leading_zeros(),
                    usize::BITS - (text.len() / ids.len().max(1)).leading_zeros(),
                    plain != ids.len()
                );
            }
        }
        // Arbitrary ids decode without panicking.
        let ids: Vec<u32> = input
            .chunks(4)
            .map(|c| {
                let mut w = [0u8; 4];
                w[..c.len()].copy_from_slice(c);
                u32::from_le_bytes(w) % (tok.vocab_size() as u32 + 8)
            })
            .collect();
        let _ = tok.decode(&ids);
    }
    Ok(format!(
        "ok{outcome} utf8 {}",
        std::str::from_utf8(input).is_ok()
    ))
}

pub(crate) fn run_plan(input: &[u8]) -> Result<String, String> {
    let text = String::from_utf8_lossy(input);
    let plan = CachePlan::from_json(&text);
    if let Ok(plan) = &plan {
        let written = plan.to_json().to_string();
        let again = CachePlan::from_json(&written)
            .map_err(|e| format!("a written plan does not read back: {e}\n{written}"))?;
        if &again != plan {
            return Err(format!(
                "the plan differs after a write and a read: {written}"
            ));
        }
        let _ = plan.key_roles();
        let _ = plan.bytes_at(4096, 9, 64);
        let _ = plan.quantized_tokens(usize::MAX);
    }
    Ok(outcome(&plan, |p| {
        format!(
            "{} layers {} sinks {}",
            p.layers.len().min(4),
            p.params.name(),
            p.sinks.min(1)
        )
    }))
}

/// The storage binding `run_saved_cache` validates against (WebGPU's default, 128 MiB) and a
/// small one, which never accepts what the large one refuses.
const SAVED_LIMITS: [u64; 2] = [128 << 20, 4096];

/// `input` with its container's length and checksum rewritten to fit its bytes, when it
/// starts with the magic and holds a header and a trailer.
pub(crate) fn reseal(input: &[u8]) -> Option<Vec<u8>> {
    const HEADER: usize = 24;
    if input.len() < HEADER + 8 || input[..8] != CACHE_MAGIC {
        return None;
    }
    let mut b = input.to_vec();
    let end = b.len() - 8;
    b[16..24].copy_from_slice(&((end - HEADER) as u64).to_le_bytes());
    let sum = fnv1a64(&b[..end]);
    b[end..].copy_from_slice(&sum.to_le_bytes());
    Some(b)
}

fn check_saved(bytes: &[u8]) -> Result<String, String> {
    let [large, small] = SAVED_LIMITS.map(|limit| SavedCache::validate(bytes, limit));
    let head = SavedCache::inspect(bytes);
    if let Ok(full) = &large {
        match &head {
            Ok(h) if h == full => {}
            other => return Err(format!("validate accepts {full:?}, inspect says {other:?}")),
        }
    }
    if small.is_ok() && large.is_err() {
        return Err("a device binding 4 KiB accepts what one binding 128 MiB refuses".into());
    }
    Ok(outcome(&large, |c| {
        format!("{} layers {}", c.kind.name(), c.model.layers.min(3))
    }))
}

pub(crate) fn run_saved_cache(input: &[u8]) -> Result<String, String> {
    let raw = check_saved(input)?;
    let sealed = match reseal(input) {
        Some(b) => check_saved(&b)?,
        None => "not resealed".into(),
    };
    Ok(format!("{raw} | {sealed}"))
}

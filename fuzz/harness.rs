//! The fuzz harness shared by the replay test (`tests/fuzz.rs`) and the long-run driver
//! (`examples/fuzz.rs`): targets over the parsers of untrusted input, a seeded mutation
//! engine, structure-aware generators, and a counting allocator that measures the peak
//! bytes a target holds while it runs on one input. Stable Rust, no fuzzing runtime.

#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::{Cell, RefCell};
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use xquant_wgpu::cache::CachePlan;
use xquant_wgpu::kvfile::{read_tensors, tensors_to_bytes, KvFile, Tensor};
use xquant_wgpu::model::gguf::{dequantize, Gguf};
use xquant_wgpu::model::{ModelConfig, Tokenizer};
use xquant_wgpu::{KvKind, XqError};

// ---------------------------------------------------------------------------------------
// Allocation accounting.

/// Peak live bytes allowed while a file reader runs on an input of `len` bytes, per input
/// byte. The readers hold a value per element of JSON (`serde_json::Value`, 32 bytes) or
/// GGUF metadata (`Meta`, 32 bytes) whose smallest encoding is one or two bytes, so a few
/// tens of bytes per input byte are inherent; what the bound rules out is trusting a length
/// field.
pub const ALLOC_FACTOR: usize = 48;
/// The tokenizer's bound per byte of the text it encodes (the input as lossy UTF-8, up to
/// three times longer): BPE holds about 50 bytes per character of the piece it merges
/// (symbols, links, a heap of candidate pairs), besides its input, output and the harness's
/// copies.
pub const TOKENIZER_FACTOR: usize = 128;
/// The fixed part of the bound.
pub const ALLOC_SLACK: usize = 16 << 10;

/// The allocation bound of a file reader: `ALLOC_FACTOR × len + ALLOC_SLACK`.
pub fn alloc_limit(len: usize) -> usize {
    ALLOC_FACTOR * len + ALLOC_SLACK
}

/// A per-input time limit (release builds; the debug replay allows more).
pub const TIME_LIMIT: Duration = Duration::from_secs(1);

thread_local! {
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
    static PANIC_MSG: RefCell<Option<String>> = const { RefCell::new(None) };
}

fn account(delta: isize) {
    let _ = TRACKING.try_with(|t| {
        if t.get() {
            let live = LIVE.with(|l| {
                let v = l.get() + delta;
                l.set(v);
                v
            });
            PEAK.with(|p| p.set(p.get().max(live)));
        }
    });
}

/// The system allocator, counting the bytes of the thread that is measuring.
pub struct Counting;

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            account(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            account(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        account(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // Old and new blocks may both be live while the contents move: count the new one
        // first, then release the old.
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            account(new_size as isize);
            account(-(layout.size() as isize));
        }
        p
    }
}

/// Runs `f`, returning its result and the peak of bytes allocated and not yet freed by this
/// thread while it ran.
pub fn measure<R>(f: impl FnOnce() -> R) -> (R, usize) {
    LIVE.with(|l| l.set(0));
    PEAK.with(|p| p.set(0));
    TRACKING.with(|t| t.set(true));
    let r = f();
    TRACKING.with(|t| t.set(false));
    (r, PEAK.with(|p| p.get()).max(0) as usize)
}

/// Installs (once) a panic hook that records the message and location of a panic inside a
/// measured target instead of printing it; other panics go to the default hook.
pub fn quiet_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if TRACKING.try_with(Cell::get).unwrap_or(false) {
                record_panic(info);
            } else {
                default(info);
            }
        }));
    });
}

fn record_panic(info: &panic::PanicHookInfo<'_>) {
    {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let _ = PANIC_MSG.try_with(|m| *m.borrow_mut() = Some(format!("{msg}{at}")));
    }
}

// ---------------------------------------------------------------------------------------
// Deterministic randomness.

/// SplitMix64.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x5851_f42d_4c95_7f2d)
    }

    /// 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// True with probability `1/n`.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }

    /// One of `items`.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// A number that is usually small and sometimes an extreme.
    pub fn number(&mut self) -> u64 {
        match self.below(10) {
            0 => *self.pick(&INTERESTING),
            1 => self.next(),
            2 => self.next() >> self.below(64),
            3..=5 => self.below(4) as u64,
            _ => self.below(80) as u64,
        }
    }
}

/// Values that break length and offset arithmetic.
pub const INTERESTING: [u64; 20] = [
    0,
    1,
    2,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x7fff,
    0x8000,
    0xffff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x1_0000_0000,
    0x1_0000_0001,
    0x3fff_ffff_ffff_ffff,
    0x4000_0000_0000_0000,
    0x7fff_ffff_ffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX,
];

// ---------------------------------------------------------------------------------------
// Mutations.

/// One to a few random mutations of `input`, sometimes spliced with another corpus entry;
/// the result is at most `max_len` bytes.
pub fn mutate(rng: &mut Rng, input: &[u8], corpus: &[Vec<u8>], max_len: usize) -> Vec<u8> {
    let mut x = input.to_vec();
    let rounds = 1 + rng.below(4);
    for _ in 0..rounds {
        mutate_once(rng, &mut x, corpus);
    }
    x.truncate(max_len);
    x
}

fn mutate_once(rng: &mut Rng, x: &mut Vec<u8>, corpus: &[Vec<u8>]) {
    let n = x.len();
    match rng.below(14) {
        // Bit flip.
        0 if n > 0 => {
            let i = rng.below(n);
            x[i] ^= 1 << rng.below(8);
        }
        // A byte set to an interesting value.
        1 if n > 0 => {
            let i = rng.below(n);
            x[i] = *rng.pick(&[0u8, 1, 0x7f, 0x80, 0xff, b'0', b'9', b'"', b'{', b'[', b' ']);
        }
        // A random byte.
        2 if n > 0 => {
            let i = rng.below(n);
            x[i] = rng.next() as u8;
        }
        // A little-endian u32 / u64 extreme written over the bytes at a random offset (length
        // and count fields); the offset prefers multiples of 4.
        3 | 4 if n > 0 => {
            let v = *rng.pick(&INTERESTING);
            let w = if rng.one_in(2) { 4 } else { 8 };
            let mut i = rng.below(n);
            if rng.one_in(2) {
                i &= !3;
            }
            for (k, b) in v.to_le_bytes()[..w].iter().enumerate() {
                if let Some(slot) = x.get_mut(i + k) {
                    *slot = *b;
                }
            }
        }
        // A plausible length: the bytes after the offset (or the whole input) divided by a
        // small item size, as a little-endian u64, u32 or decimal. Trusting such a count
        // allocates many times the input without failing at once.
        12 if n > 0 => {
            // Headers, where the counts are, come first: aligned offsets early in the input
            // half of the time.
            let i = if rng.one_in(2) {
                rng.below(n.min(64)) & !3
            } else {
                rng.below(n)
            };
            let base = if rng.one_in(2) { n - i } else { n };
            let v = (base / *rng.pick(&[1usize, 1, 2, 3, 4, 8, 12, 13, 32])) as u64;
            let v = v.saturating_sub(rng.below(3) as u64);
            match rng.below(3) {
                0 => {
                    for (k, b) in v.to_le_bytes().iter().enumerate() {
                        if let Some(slot) = x.get_mut(i + k) {
                            *slot = *b;
                        }
                    }
                }
                1 => {
                    for (k, b) in (v as u32).to_le_bytes().iter().enumerate() {
                        if let Some(slot) = x.get_mut(i + k) {
                            *slot = *b;
                        }
                    }
                }
                _ => {
                    x.splice(i..i, v.to_string().into_bytes());
                }
            }
        }
        // Add or subtract a small amount from a u32 / u64 at an aligned offset.
        5 if n >= 8 => {
            let i = rng.below(n - 7) & !3;
            let v = u64::from_le_bytes(x[i..i + 8].try_into().unwrap_or([0; 8]));
            let d = 1 + rng.below(16) as u64;
            let v = if rng.one_in(2) {
                v.wrapping_add(d)
            } else {
                v.wrapping_sub(d)
            };
            x[i..i + 8].copy_from_slice(&v.to_le_bytes());
        }
        // Insert random bytes.
        6 => {
            let i = rng.below(n + 1);
            let k = 1 + rng.below(16);
            let bytes: Vec<u8> = (0..k).map(|_| rng.next() as u8).collect();
            x.splice(i..i, bytes);
        }
        // Delete a range.
        7 if n > 0 => {
            let i = rng.below(n);
            let k = 1 + rng.below((n - i).min(64));
            x.drain(i..i + k);
        }
        // Duplicate a range.
        8 if n > 0 => {
            let i = rng.below(n);
            let k = 1 + rng.below((n - i).min(64));
            let copy = x[i..i + k].to_vec();
            let at = rng.below(n + 1);
            x.splice(at..at, copy);
        }
        // Truncate.
        9 if n > 0 => x.truncate(rng.below(n)),
        // Splice with another input: our head, its tail.
        10 if !corpus.is_empty() => {
            let other = rng.pick(corpus);
            let cut = rng.below(n + 1);
            let from = rng.below(other.len() + 1);
            x.truncate(cut);
            x.extend_from_slice(&other[from..]);
        }
        // Insert a decimal number (text formats).
        11 => {
            let i = rng.below(n + 1);
            let s = match rng.below(3) {
                0 => rng.number().to_string(),
                1 => format!("-{}", rng.number()),
                _ => format!("{}e{}", rng.below(10), rng.below(400)),
            };
            x.splice(i..i, s.into_bytes());
        }
        // Insert a token of the formats.
        _ => {
            let i = rng.below(n + 1);
            let tok = *rng.pick(&TOKENS);
            x.splice(i..i, tok.iter().copied());
        }
    }
}

const TOKENS: [&[u8]; 16] = [
    b"GGUF",
    b"\"past_key_values.0.key\"",
    b"\"past_key_values.1.value\"",
    b"\"dtype\"",
    b"\"shape\"",
    b"\"data_offsets\"",
    b"\"layers\"",
    b"\"codes\"",
    b"<|im_start|>",
    b"<|im_end|>",
    b"'s",
    b"   ",
    "é".as_bytes(),
    "中文".as_bytes(),
    "٣".as_bytes(),
    b"\xf0\x9f\x98",
];

// ---------------------------------------------------------------------------------------
// Targets.

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
}

/// Every target.
pub const TARGETS: [Target; 4] = [
    Target::Safetensors,
    Target::Gguf,
    Target::Tokenizer,
    Target::Plan,
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
        }
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
        }
    }

    /// A structure-aware input: mostly well-formed, with fields chosen to stress the checks.
    pub fn generate(self, rng: &mut Rng) -> Vec<u8> {
        match self {
            Target::Safetensors => gen_safetensors(rng),
            Target::Gguf => gen_gguf(rng),
            Target::Tokenizer => gen_text(rng),
            Target::Plan => gen_plan(rng),
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
fn source_words() -> &'static std::collections::HashSet<&'static str> {
    static WORDS: OnceLock<std::collections::HashSet<&'static str>> = OnceLock::new();
    WORDS.get_or_init(|| {
        [
            include_str!("../src/kvfile.rs"),
            include_str!("../src/model/gguf.rs"),
            include_str!("../src/model/config.rs"),
            include_str!("../src/model/tokenizer.rs"),
            include_str!("../src/cache/plan.rs"),
            include_str!("../src/config.rs"),
        ]
        .iter()
        .flat_map(|s| s.split(|c: char| !(c.is_ascii_lowercase() || c == '-')))
        .filter(|w| !w.is_empty())
        .collect()
    })
}

fn outcome<T>(r: &Result<T, XqError>, ok: impl FnOnce(&T) -> String) -> String {
    match r {
        Ok(v) => format!("ok {}", ok(v)),
        Err(e) => normalize(e),
    }
}

fn run_safetensors(input: &[u8]) -> Result<String, String> {
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

fn run_gguf(input: &[u8]) -> Result<String, String> {
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

fn run_tokenizer(input: &[u8]) -> Result<String, String> {
    let text = String::from_utf8_lossy(input);
    let mut outcome = String::new();
    let real = real_tokenizer();
    let tokenizers = [
        ("small", Some(small_tokenizer()), None),
        ("smollm2", real.map(|r| &r.tok), real.map(|r| &r.absent)),
    ];
    for (which, tok, absent) in tokenizers {
        let Some(tok) = tok else { continue };
        for special in [false, true] {
            let ids = tok.encode(&text, special);
            if let Some(&bad) = ids.iter().find(|&&i| i as usize >= tok.vocab_size()) {
                return Err(format!("{which}: encode returned id {bad}"));
            }
            let back = tok.decode_bytes(&ids);
            // Bytes the vocabulary has no symbol for are dropped, and only those.
            let expected: Vec<u8> = match absent {
                Some(a) => text.bytes().filter(|&b| !a[b as usize]).collect(),
                None => text.as_bytes().to_vec(),
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

fn run_plan(input: &[u8]) -> Result<String, String> {
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

// ---------------------------------------------------------------------------------------
// Tokenizers.

/// GPT-2's byte-to-character map (as the tokenizer uses it).
pub fn byte_chars() -> Vec<char> {
    let mut extra = 0u32;
    (0..256u32)
        .map(|b| {
            let printable =
                (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
            if printable {
                char::from_u32(b).unwrap_or('?')
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap_or('?')
            }
        })
        .collect()
}

/// The vocabulary, merges and token types of a small byte-level BPE tokenizer: every byte,
/// a few merges (some of whose results are missing from the vocabulary), control tokens.
pub fn small_vocab() -> (Vec<String>, Vec<String>, Vec<u64>) {
    let chars = byte_chars();
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let sym = |s: &str| -> String { s.bytes().map(|b| chars[b as usize]).collect() };
    let pairs: [(&str, &str); 14] = [
        (" ", "t"),
        ("h", "e"),
        (" t", "he"),
        ("a", "a"),
        ("aa", "aa"),
        ("aaaa", "aaaa"),
        ("i", "n"),
        ("in", "g"),
        ("e", "r"),
        (" ", " "),
        ("\n", "\n"),
        ("\u{e9}", "\u{e9}"),
        ("x", "y"), // its result is not in the vocabulary
        ("'", "s"),
    ];
    let mut merges = Vec::new();
    for (a, b) in pairs {
        merges.push(format!("{} {}", sym(a), sym(b)));
        if (a, b) != ("x", "y") {
            tokens.push(format!("{}{}", sym(a), sym(b)));
        }
    }
    let mut types = vec![1u64; tokens.len()];
    for special in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im"] {
        tokens.push(special.to_string());
        types.push(3);
    }
    (tokens, merges, types)
}

/// The small tokenizer, built once.
pub fn small_tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let (tokens, merges, types) = small_vocab();
        let eos = tokens.len() as u32 - 4;
        Tokenizer::new(tokens, &merges, &types, eos, eos, None).expect("the small tokenizer")
    })
}

/// A tokenizer and the bytes no token of its vocabulary holds (encode drops them).
pub struct RealTokenizer {
    /// The tokenizer.
    pub tok: Tokenizer,
    /// `absent[b]`: no token contains byte `b`'s symbol.
    pub absent: [bool; 256],
}

/// SmolLM2's tokenizer when its model file is present (`XQ_MODEL`, or the default cache
/// path); `None` otherwise.
pub fn real_tokenizer() -> Option<&'static RealTokenizer> {
    static TOK: OnceLock<Option<RealTokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = std::env::var_os("XQ_MODEL")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from("/root/.cache/xquant-wgpu/SmolLM2-135M-Instruct.Q4_1.gguf")
            });
        let bytes = std::fs::read(path).ok()?;
        let g = Gguf::parse(&bytes).ok()?;
        let tok = Tokenizer::from_gguf(&g).ok()?;
        let mut seen = std::collections::HashSet::new();
        for t in g.get("tokenizer.ggml.tokens").ok()?.as_array()? {
            seen.extend(t.as_str()?.chars());
        }
        let chars = byte_chars();
        let absent = std::array::from_fn(|b| !seen.contains(&chars[b]));
        Some(RealTokenizer { tok, absent })
    })
    .as_ref()
}

// ---------------------------------------------------------------------------------------
// Generators.

fn gen_text(rng: &mut Rng) -> Vec<u8> {
    const PIECES: [&str; 24] = [
        "a",
        "aaaaaaaa",
        "the",
        " the",
        "ing",
        " ",
        "  ",
        "\n",
        "\t",
        "'s",
        "'ll",
        "'",
        "1",
        "٣",
        "é",
        "中",
        "😀",
        "<|im_start|>",
        "<|im_end|>",
        "<|im",
        "<|endoftext|>",
        "xy",
        "\u{a0}",
        "\u{200b}",
    ];
    let mut s = String::new();
    let n = 1 + rng.below(64);
    for _ in 0..n {
        let p = rng.pick(&PIECES);
        let k = if rng.one_in(8) { 1 + rng.below(200) } else { 1 };
        for _ in 0..k {
            s.push_str(p);
        }
    }
    let mut bytes = s.into_bytes();
    if rng.one_in(4) && !bytes.is_empty() {
        // Invalid UTF-8 somewhere.
        let i = rng.below(bytes.len());
        bytes.insert(i, *rng.pick(&[0x80u8, 0xc3, 0xe4, 0xf0, 0xff]));
    }
    bytes
}

const GGUF_KEYS: [&str; 16] = [
    "general.architecture",
    "general.alignment",
    "llama.block_count",
    "llama.embedding_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.feed_forward_length",
    "llama.context_length",
    "llama.rope.freq_base",
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.chat_template",
];

struct Gw(Vec<u8>);

impl Gw {
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
    }
    fn str_array(&mut self, items: &[String]) {
        self.u32(8);
        self.u64(items.len() as u64);
        for s in items {
            self.str(s);
        }
    }
}

/// A random scalar or array metadata value of type `ty` (writing its payload only).
fn gguf_value(rng: &mut Rng, w: &mut Gw, ty: u32, depth: usize) {
    match ty {
        0 | 1 | 7 => w.0.push(rng.number() as u8),
        2 | 3 => w.0.extend_from_slice(&(rng.number() as u16).to_le_bytes()),
        4 | 5 => w.u32(rng.number() as u32),
        6 => {
            w.0.extend_from_slice(&(rng.number() as f32 / 3.0).to_le_bytes())
        }
        8 => {
            let s = match rng.below(4) {
                0 => "llama".to_string(),
                1 => "gpt2".to_string(),
                2 => "<|im_start|>system\nYou are helpful.<|im_end|>".to_string(),
                _ => (0..rng.below(12))
                    .map(|_| (b'a' + rng.below(26) as u8) as char)
                    .collect(),
            };
            if rng.one_in(12) {
                w.u64(rng.number()); // a lying length
            } else {
                w.str(&s);
            }
        }
        9 => {
            let elem = if depth > 4 || rng.one_in(3) {
                *rng.pick(&[0u32, 4, 8, 10, 6, 7])
            } else {
                rng.below(14) as u32
            };
            w.u32(elem);
            let n = rng.below(8);
            if rng.one_in(6) {
                w.u64(rng.number()); // a lying count
            } else {
                w.u64(n as u64);
            }
            for _ in 0..n {
                gguf_value(rng, w, elem, depth + 1);
            }
        }
        10..=12 => w.u64(rng.number()),
        _ => {}
    }
}

fn gen_gguf(rng: &mut Rng) -> Vec<u8> {
    let mut w = Gw(Vec::new());
    w.0.extend_from_slice(if rng.one_in(50) { b"GGUG" } else { b"GGUF" });
    w.u32(if rng.one_in(20) {
        rng.number() as u32
    } else {
        2 + rng.below(2) as u32
    });
    let model_like = rng.one_in(2);
    let n_tensors = rng.below(4);
    // Metadata entries: (key, writer).
    let mut entries: Vec<Vec<u8>> = Vec::new();
    if model_like {
        let (mut tokens, merges, mut types) = small_vocab();
        let vocab = if rng.one_in(3) {
            rng.below(300)
        } else {
            tokens.len()
        };
        tokens.truncate(vocab);
        if rng.one_in(3) {
            types.truncate(rng.below(types.len() + 1));
        } else if rng.one_in(3) {
            types.extend(std::iter::repeat_n(3, rng.below(8))); // more types than tokens
        }
        let hidden = *rng.pick(&[0u64, 8, 64, 96, 1 << 40]);
        let heads = *rng.pick(&[0u64, 1, 2, 3, 4]);
        let mut e = Gw(Vec::new());
        e.str("general.architecture");
        e.u32(8);
        e.str(if rng.one_in(8) { "gpt2" } else { "llama" });
        entries.push(e.0);
        for (key, v) in [
            ("llama.block_count", rng.number()),
            ("llama.embedding_length", hidden),
            ("llama.attention.head_count", heads),
            (
                "llama.attention.head_count_kv",
                *rng.pick(&[1u64, 2, 0, heads]),
            ),
            ("llama.feed_forward_length", rng.number()),
            ("tokenizer.ggml.bos_token_id", rng.below(vocab + 2) as u64),
            (
                "tokenizer.ggml.eos_token_id",
                *rng.pick(&[1u64, 0x1_0000_0001, vocab as u64]),
            ),
        ] {
            if rng.one_in(10) {
                continue;
            }
            let mut e = Gw(Vec::new());
            e.str(key);
            e.u32(*rng.pick(&[4u32, 10, 5, 11]));
            match e.0[e.0.len() - 4] {
                4 | 5 => e.u32(v as u32),
                _ => e.u64(v),
            }
            entries.push(e.0);
        }
        let mut e = Gw(Vec::new());
        e.str("tokenizer.ggml.model");
        e.u32(8);
        e.str("gpt2");
        entries.push(e.0);
        let mut e = Gw(Vec::new());
        e.str("tokenizer.ggml.tokens");
        e.u32(9);
        e.str_array(&tokens);
        entries.push(e.0);
        let mut e = Gw(Vec::new());
        e.str("tokenizer.ggml.merges");
        e.u32(9);
        let mut merges = merges;
        if rng.one_in(6) {
            merges.push("nospace".into());
        }
        e.str_array(&merges);
        entries.push(e.0);
        let mut e = Gw(Vec::new());
        e.str("tokenizer.ggml.token_type");
        e.u32(9);
        e.u32(5);
        e.u64(types.len() as u64);
        for t in &types {
            e.u32(*t as u32);
        }
        entries.push(e.0);
    }
    for _ in 0..rng.below(6) {
        let mut e = Gw(Vec::new());
        let key = *rng.pick(&GGUF_KEYS);
        e.str(key);
        let ty = if rng.one_in(16) {
            rng.number() as u32
        } else {
            rng.below(13) as u32
        };
        e.u32(ty);
        gguf_value(rng, &mut e, ty, 0);
        entries.push(e.0);
    }
    w.u64(if rng.one_in(10) {
        rng.number()
    } else {
        n_tensors as u64
    });
    w.u64(if rng.one_in(10) {
        rng.number()
    } else {
        entries.len() as u64
    });
    for e in &entries {
        w.0.extend_from_slice(e);
    }
    let mut offset = 0u64;
    let mut data_len = 0u64;
    for _ in 0..n_tensors {
        let name = *rng.pick(&[
            "token_embd.weight",
            "output_norm.weight",
            "blk.0.attn_q.weight",
            "blk.0.attn_norm.weight",
        ]);
        w.str(name);
        let n_dims = if rng.one_in(10) {
            rng.number() as u32
        } else {
            1 + rng.below(4) as u32
        };
        w.u32(n_dims);
        let mut elems = 1u64;
        for _ in 0..n_dims.min(6) {
            let d = if rng.one_in(6) {
                rng.number()
            } else {
                *rng.pick(&[1u64, 2, 32, 64])
            };
            elems = elems.wrapping_mul(d);
            w.u64(d);
        }
        let ty = *rng.pick(&[0u32, 1, 3, 8, 2, 30]);
        w.u32(ty);
        let bytes = match ty {
            0 => elems.wrapping_mul(4),
            1 => elems.wrapping_mul(2),
            3 => (elems / 32).wrapping_mul(20),
            _ => (elems / 32).wrapping_mul(34),
        };
        w.u64(if rng.one_in(8) { rng.number() } else { offset });
        offset = offset.wrapping_add(bytes.min(1 << 12)).div_ceil(32) * 32;
        data_len = offset;
    }
    // Pad to the default alignment, then data.
    while w.0.len() % 32 != 0 {
        w.0.push(0);
    }
    let extra = if rng.one_in(4) {
        rng.below(64) as u64
    } else {
        0
    };
    let data = data_len.min(1 << 13) + extra;
    let data = data.saturating_sub(if rng.one_in(4) {
        rng.below(64) as u64
    } else {
        0
    });
    for _ in 0..data {
        w.0.push(rng.next() as u8);
    }
    w.0
}

fn gen_safetensors(rng: &mut Rng) -> Vec<u8> {
    let layers = rng.below(4);
    let dtype = *rng.pick(&["F16", "BF16", "F32"]);
    let size = if dtype == "F32" { 4 } else { 2 };
    let mut shape: Vec<u64> = (0..4).map(|_| *rng.pick(&[1u64, 2, 3, 4])).collect();
    if rng.one_in(6) {
        let i = rng.below(4);
        shape[i] = rng.number();
    }
    if rng.one_in(8) {
        shape.truncate(rng.below(5));
    }
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    let mut names: Vec<String> = Vec::new();
    for l in 0..layers {
        names.push(format!("past_key_values.{l}.key"));
        names.push(format!("past_key_values.{l}.value"));
    }
    if rng.one_in(6) {
        names.push(
            rng.pick(&["past_key_values.7.key", "past_key_values.x.value", "other"])
                .to_string(),
        );
    }
    if rng.one_in(8) && !names.is_empty() {
        let i = rng.below(names.len());
        names.remove(i);
    }
    for name in names {
        let elems = shape.iter().fold(1u64, |a, &d| a.wrapping_mul(d));
        let len = elems.wrapping_mul(size).min(1 << 12);
        let start = data.len() as u64;
        for _ in 0..len {
            data.push(if rng.one_in(200) {
                0xff
            } else {
                rng.next() as u8 & 0x3f
            });
        }
        let mut offs = json!([start, start + len]);
        if rng.one_in(10) {
            offs = json!([rng.number(), rng.number()]);
        }
        let dt = if rng.one_in(20) { "I8" } else { dtype };
        header.insert(
            name,
            json!({"dtype": dt, "shape": shape, "data_offsets": offs}),
        );
    }
    if rng.one_in(3) {
        header.insert("__metadata__".into(), json!({"format": "pt"}));
    }
    let text = serde_json::to_vec(&Value::Object(header)).unwrap_or_default();
    let mut out = if rng.one_in(12) {
        rng.number().to_le_bytes().to_vec()
    } else {
        (text.len() as u64).to_le_bytes().to_vec()
    };
    out.extend_from_slice(&text);
    out.extend_from_slice(&data);
    out
}

fn random_json(rng: &mut Rng, depth: usize) -> Value {
    match rng.below(if depth > 2 { 6 } else { 8 }) {
        0 => Value::Null,
        1 => json!(rng.one_in(2)),
        2 => json!(rng.number()),
        3 => json!(-(rng.below(100) as i64)),
        4 => json!(rng.number() as f64 / 7.0),
        5 => json!(*rng.pick(&["own", "tokens", "channels", "f16", "f32", "xquant-plan", ""])),
        6 => Value::Array(
            (0..rng.below(4))
                .map(|_| random_json(rng, depth + 1))
                .collect(),
        ),
        _ => {
            let mut m = serde_json::Map::new();
            for _ in 0..rng.below(3) {
                m.insert(
                    rng.pick(&["codes", "bits", "key", "value", "window", "x"])
                        .to_string(),
                    random_json(rng, depth + 1),
                );
            }
            Value::Object(m)
        }
    }
}

/// Replaces a random value inside `v` (or removes a field) with probability per node.
fn perturb(rng: &mut Rng, v: &mut Value) {
    match v {
        Value::Object(m) => {
            let keys: Vec<String> = m.keys().cloned().collect();
            for k in keys {
                if rng.one_in(12) {
                    m.remove(&k);
                } else if rng.one_in(10) {
                    m.insert(k, random_json(rng, 0));
                } else if let Some(x) = m.get_mut(&k) {
                    perturb(rng, x);
                }
            }
            if rng.one_in(20) {
                m.insert("unknown".into(), json!(1));
            }
        }
        Value::Array(a) => {
            for x in a.iter_mut() {
                if rng.one_in(12) {
                    *x = random_json(rng, 0);
                } else {
                    perturb(rng, x);
                }
            }
        }
        _ => {}
    }
}

fn gen_plan(rng: &mut Rng) -> Vec<u8> {
    let name = *rng.pick(&xquant_wgpu::cache::PRESETS);
    let layers = 1 + rng.below(6);
    let mut v = match CachePlan::preset(name, layers) {
        Ok(p) => p.to_json(),
        Err(_) => json!({}),
    };
    if rng.one_in(2) {
        perturb(rng, &mut v);
    }
    let mut text = v.to_string();
    if rng.one_in(3) {
        text = serde_json::to_string_pretty(&v).unwrap_or(text);
    }
    text.into_bytes()
}

// ---------------------------------------------------------------------------------------
// Corpus files.

/// The files of a corpus directory, sorted by name.
pub fn read_corpus(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_file())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            std::fs::read(e.path()).ok().map(|b| (name, b))
        })
        .collect();
    out.sort();
    out
}

/// A stable name for an input: FNV-1a of its bytes.
pub fn input_name(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    format!("{h:016x}")
}

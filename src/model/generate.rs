//! Generation one token at a time: sampling, a chunked prefill and a decoder whose state is
//! plain data, so the CLI's loop and the browser's async iterator step the same code.

use crate::cache::KvCache;
use crate::error::{Result, XqError};
use crate::model::gpu::Logits;
use crate::model::runtime::{argmax, Runtime};

/// Prompt tokens per prefill pass: progress is reported between passes, and a long prompt
/// never becomes one submission that keeps the GPU busy for seconds.
pub const PREFILL_CHUNK: usize = 64;

/// How the next token is chosen from the logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Softmax temperature; 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1: all).
    pub top_p: f32,
    /// Seed of the random draws (the same seed draws the same tokens).
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl Sampling {
    /// Checks the ranges (temperature ≥ 0 and finite, top_p in (0, 1]).
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(XqError::Config(format!(
                "temperature must be a finite number ≥ 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(XqError::Config(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }

    /// Whether tokens are picked by argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Draws tokens from logits as [`Sampling`] says, with its own seeded generator.
#[derive(Clone, Debug)]
pub struct Sampler {
    sampling: Sampling,
    state: u64,
}

impl Sampler {
    /// A sampler; fails on out-of-range options.
    pub fn new(sampling: Sampling) -> Result<Self> {
        sampling.validate()?;
        Ok(Sampler {
            sampling,
            state: sampling.seed,
        })
    }

    /// A uniform number in [0, 1) (splitmix64).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// The next token: argmax when greedy; otherwise top-k, then the softmax at the
    /// temperature, then top-p, then one draw.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let s = self.sampling;
        if s.is_greedy() || logits.is_empty() {
            return argmax(logits);
        }
        // Most likely first; ties by token id so the order (and the draw) is deterministic.
        let by_logit = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        if s.top_k > 0 && s.top_k < ids.len() {
            ids.select_nth_unstable_by(s.top_k - 1, by_logit);
            ids.truncate(s.top_k);
        }
        ids.sort_unstable_by(by_logit);
        let top = logits[ids[0] as usize] as f64;
        let t = s.temperature as f64;
        let mut p: Vec<f64> = ids
            .iter()
            .map(|&i| ((logits[i as usize] as f64 - top) / t).exp())
            .collect();
        let total: f64 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= total);
        if s.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = p
                .iter()
                .position(|&x| {
                    acc += x;
                    acc >= s.top_p as f64
                })
                .map_or(p.len(), |i| i + 1);
            p.truncate(keep);
        }
        let mut r = self.uniform() * p.iter().sum::<f64>();
        for (i, &x) in p.iter().enumerate() {
            if r < x {
                return ids[i];
            }
            r -= x;
        }
        ids[p.len() - 1]
    }
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The model produced its end-of-sequence token (not fed to the cache).
    EndOfSequence,
    /// `max_tokens` tokens were generated.
    MaxTokens,
}

/// A generation's state between steps: the position, the logits of the last token fed and
/// the sampler. Every generated token is fed to the cache before it is returned, so the cache
/// holds the prompt and all generated tokens and a later prompt continues after them.
#[derive(Debug)]
pub struct Decoder {
    sampler: Sampler,
    max_tokens: usize,
    generated: usize,
    pos: usize,
    logits: Option<Vec<f32>>,
    finish: Option<Finish>,
}

impl Decoder {
    /// A decoder for up to `max_tokens` new tokens.
    pub fn new(sampling: Sampling, max_tokens: usize) -> Result<Self> {
        Ok(Decoder {
            sampler: Sampler::new(sampling)?,
            max_tokens,
            generated: 0,
            pos: 0,
            logits: None,
            finish: None,
        })
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Why generation ended (`None` while it goes on).
    pub fn finish(&self) -> Option<Finish> {
        self.finish
    }

    /// Feeds `prompt` after what `cache` holds, [`PREFILL_CHUNK`] tokens per pass;
    /// `progress(done, total)` after each pass. A failed pass leaves the cache with the
    /// chunks before it.
    pub async fn prefill(
        &mut self,
        rt: &Runtime,
        prompt: &[u32],
        cache: &mut dyn KvCache,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<()> {
        if prompt.is_empty() {
            return Err(XqError::Shape("the prompt has no tokens".into()));
        }
        if self.logits.is_some() || self.generated > 0 {
            return Err(XqError::Config(
                "this generation already has its prompt".into(),
            ));
        }
        let free = rt.model.cfg.context.saturating_sub(cache.tokens(0));
        if prompt.len() > free {
            return Err(XqError::ContextBudget(format!(
                "the prompt's {} tokens do not fit in the model's context ({} of {} tokens free)",
                prompt.len(),
                free,
                rt.model.cfg.context
            )));
        }
        let start = cache.tokens(0);
        self.pos = start;
        for chunk in prompt.chunks(PREFILL_CHUNK) {
            let logits = rt
                .model
                .forward(chunk, self.pos, cache, Logits::Last)
                .await?;
            self.pos += chunk.len();
            self.logits = Some(logits);
            progress(self.pos - start, prompt.len());
        }
        Ok(())
    }

    /// The next token, already fed to the cache; `None` once generation ended (end of
    /// sequence, `max_tokens`, or the model's context full).
    pub async fn next(&mut self, rt: &Runtime, cache: &mut dyn KvCache) -> Result<Option<u32>> {
        if self.finish.is_some() {
            return Ok(None);
        }
        let Some(logits) = &self.logits else {
            return Err(XqError::Config("prefill the prompt before decoding".into()));
        };
        if self.generated >= self.max_tokens || self.pos >= rt.model.cfg.context {
            self.finish = Some(Finish::MaxTokens);
            return Ok(None);
        }
        let next = self.sampler.sample(logits);
        if next == rt.tokenizer.eos {
            self.finish = Some(Finish::EndOfSequence);
            return Ok(None);
        }
        let logits = rt
            .model
            .forward(&[next], self.pos, cache, Logits::Last)
            .await?;
        self.logits = Some(logits);
        self.pos += 1;
        self.generated += 1;
        Ok(Some(next))
    }
}

/// Turns token bytes into text as whole UTF-8 characters complete (invalid bytes become
/// U+FFFD).
#[derive(Debug, Default)]
pub struct TextStream {
    pending: Vec<u8>,
}

impl TextStream {
    /// The text that `bytes` completes ('' while a character is still incomplete).
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..good]).unwrap_or_default());
                    match e.error_len() {
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..good);
                            return out;
                        }
                        Some(n) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..good + n);
                        }
                    }
                }
            }
        }
    }

    /// What is left at the end (an incomplete character as U+FFFD).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> Sampler {
        Sampler::new(Sampling {
            temperature,
            top_k,
            top_p,
            seed,
        })
        .unwrap()
    }

    #[test]
    fn greedy_is_argmax() {
        let logits = [0.1, 3.0, -1.0, 2.9];
        assert_eq!(sampler(0.0, 0, 1.0, 9).sample(&logits), 1);
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let logits = [0.1, 3.0, -1.0, 2.9, 0.0];
        for seed in 0..50 {
            assert_eq!(sampler(1.5, 1, 1.0, seed).sample(&logits), 1);
            assert_eq!(sampler(1.5, 0, 1e-6, seed).sample(&logits), 1);
        }
    }

    #[test]
    fn draws_follow_the_softmax_and_the_seed() {
        let logits = [0.0f32, (2.0f32).ln(), f32::NEG_INFINITY];
        let mut s = sampler(1.0, 0, 1.0, 7);
        let n = 30_000;
        let ones = (0..n).filter(|_| s.sample(&logits) == 1).count();
        // P(1) = 2/3; 5 standard deviations of a binomial at n = 30,000 is ±0.0136.
        let p = ones as f64 / n as f64;
        assert!((p - 2.0 / 3.0).abs() < 0.0136, "P(token 1) = {p}");
        let a: Vec<u32> = {
            let mut s = sampler(0.8, 0, 0.9, 42);
            (0..64).map(|_| s.sample(&[0.3, 0.2, 0.1, 0.5])).collect()
        };
        let b: Vec<u32> = {
            let mut s = sampler(0.8, 0, 0.9, 42);
            (0..64).map(|_| s.sample(&[0.3, 0.2, 0.1, 0.5])).collect()
        };
        assert_eq!(a, b);
        assert!(
            a.iter().any(|&t| t != a[0]),
            "a temperature of 0.8 never varied"
        );
    }

    #[test]
    fn top_p_drops_the_tail() {
        // Probabilities 0.5, 0.3, 0.2 at T = 1: top_p 0.75 keeps tokens 0 and 1 only.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let mut s = sampler(1.0, 0, 0.75, 3);
        let seen: std::collections::BTreeSet<u32> = (0..2000).map(|_| s.sample(&logits)).collect();
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![0, 1]);
    }

    #[test]
    fn bad_options_are_config_errors() {
        for (t, p) in [(-1.0, 1.0), (f32::NAN, 1.0), (1.0, 0.0), (1.0, 1.5)] {
            let r = Sampler::new(Sampling {
                temperature: t,
                top_p: p,
                ..Default::default()
            });
            assert!(matches!(r, Err(XqError::Config(_))), "{t} {p}");
        }
    }

    #[test]
    fn text_stream_waits_for_whole_characters() {
        let mut s = TextStream::default();
        let e = "é".as_bytes();
        assert_eq!(s.push(b"a"), "a");
        assert_eq!(s.push(&e[..1]), "");
        assert_eq!(s.push(&e[1..]), "é");
        assert_eq!(s.push(&[0xff, b'b']), "\u{FFFD}b");
        assert_eq!(s.push(&e[..1]), "");
        assert_eq!(s.finish(), "\u{FFFD}");
    }
}

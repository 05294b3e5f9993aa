//! Deterministic synthetic data for examples, benchmarks and tests (no `rand` dependency).

/// A small, fast, seedable generator (SplitMix64).
#[derive(Clone, Debug)]
pub struct SplitMix(u64);

impl SplitMix {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        SplitMix(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

/// `n` standard-normal values from `seed`.
pub fn normal(n: usize, seed: u64) -> Vec<f32> {
    let mut g = SplitMix::new(seed);
    (0..n).map(|_| g.normal()).collect()
}

/// Synthetic K/V of a small model: `layers` layers of `[1, heads, tokens, dim]`, where each
/// layer is a scaled copy of the previous one plus fresh noise (`correlation` in [0, 1]), and
/// keys carry a few large outlier channels as real models' keys do.
pub fn synthetic_kv(
    layers: usize,
    heads: usize,
    tokens: usize,
    dim: usize,
    correlation: f32,
    seed: u64,
) -> Vec<(Vec<f32>, Vec<f32>)> {
    let mut g = SplitMix::new(seed);
    let n = heads * tokens * dim;
    let outlier: Vec<f32> = (0..dim)
        .map(|_| if g.uniform() < 0.1 { 4.0 } else { 1.0 })
        .collect();
    let fresh = |g: &mut SplitMix, outliers: bool| -> Vec<f32> {
        (0..n)
            .map(|i| g.normal() * if outliers { outlier[i % dim] } else { 1.0 })
            .collect()
    };
    let mix = |prev: &[f32], noise: Vec<f32>| -> Vec<f32> {
        let keep = correlation;
        let add = (1.0 - correlation * correlation).sqrt();
        prev.iter()
            .zip(noise)
            .map(|(p, z)| keep * p + add * z)
            .collect()
    };
    let mut out: Vec<(Vec<f32>, Vec<f32>)> = Vec::with_capacity(layers);
    for l in 0..layers {
        let (k, v) = if l == 0 {
            (fresh(&mut g, true), fresh(&mut g, false))
        } else {
            let (pk, pv) = &out[l - 1];
            let (nk, nv) = (fresh(&mut g, true), fresh(&mut g, false));
            (mix(pk, nk), mix(pv, nv))
        };
        out.push((k, v));
    }
    out
}

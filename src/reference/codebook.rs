//! Lloyd–Max codebooks for rotated head vectors.
//!
//! After a random rotation, each coordinate of a group of `n` values divided by the group's L2
//! norm is distributed like one coordinate of a uniform random unit vector in `R^n`: density
//! `f(x) ∝ (1 − x²)^((n−3)/2)` on `[−1, 1]`. With `x = cos θ` the density of `θ` is
//! `∝ sin^(n−2) θ` on `[0, π]`, smooth for every `n ≥ 2` (no endpoint singularity at `n = 2`).
//!
//! A `b`-bit codebook holds the `2^b` levels `c_0 < … < c_{2^b−1}` (symmetric about 0) of the
//! Lloyd–Max quantizer for that density: each level is the conditional mean of its cell, the
//! cells' boundaries are the midpoints of neighbouring levels. Plan entries with
//! `levels: "lloyd-max"` code each value `x_i` of a group `x` as the level nearest to
//! `x_i / ‖x‖` ([`nearest_level`]) and reconstruct it as `x̂_i = ‖x‖ · c[code]`.
//!
//! `scripts/lloyd-max.py` computes the same tables independently (written to
//! `data/codebooks/lloyd-max.json`, checked by `tests/codebook.rs`).

pub use crate::config::MAX_CODEBOOK_BITS;

/// The largest group (vector length `n`) a codebook is computed for.
pub const MAX_CODEBOOK_GROUP: usize = 4096;

/// Intervals of the cumulative mass table in `θ`.
const TABLE_INTERVALS: usize = 1 << 15;
/// The iteration stops once no level moves by this much...
const TOLERANCE: f64 = 1e-12;
/// ...or after this many rounds.
const MAX_ROUNDS: usize = 10_000;
/// The table starts where `sin^(n−2) θ` falls below `e^(−TAIL_LOG)`: the mass left out is
/// below `1e-24` of the total.
const TAIL_LOG: f64 = 60.0;

/// Whether [`lloyd_max_levels`] computes a codebook of `bits` bits for groups of `n` values:
/// `1 ≤ bits ≤ MAX_CODEBOOK_BITS` and `2 ≤ n ≤ MAX_CODEBOOK_GROUP`.
pub fn codebook_supported(bits: u32, n: usize) -> bool {
    (1..=MAX_CODEBOOK_BITS).contains(&bits) && (2..=MAX_CODEBOOK_GROUP).contains(&n)
}

/// The `2^bits` Lloyd–Max levels, ascending and exactly symmetric (`c[i] = −c[2^bits − 1 − i]`),
/// for one coordinate of a uniform random unit vector in `R^n`.
///
/// The input must satisfy [`codebook_supported`] (debug builds assert it; release builds clamp
/// `bits` and `n` into the supported range rather than panic). Deterministic; computed in f64
/// (the positive half, mirrored) and rounded to f32.
pub fn lloyd_max_levels(bits: u32, n: usize) -> Vec<f32> {
    debug_assert!(
        codebook_supported(bits, n),
        "no Lloyd-Max codebook for {bits} bits and groups of {n}"
    );
    let bits = bits.clamp(1, MAX_CODEBOOK_BITS);
    let n = n.clamp(2, MAX_CODEBOOK_GROUP);
    let half = positive_half(1 << (bits - 1), n);
    let mut levels: Vec<f32> = half.iter().rev().map(|&c| -(c as f32)).collect();
    levels.extend(half.iter().map(|&c| c as f32));
    levels
}

/// The decision boundaries of ascending `levels`: the midpoints `(a + b) * 0.5`, in f32.
pub fn level_boundaries(levels: &[f32]) -> Vec<f32> {
    levels.windows(2).map(|w| (w[0] + w[1]) * 0.5).collect()
}

/// The code of `x` for ascending `levels`: the number of boundaries
/// ([`level_boundaries`]) `b` with `x >= b`, i.e. the index of the nearest level, ties to the
/// higher one. NaN codes as 0.
pub fn nearest_level(levels: &[f32], x: f32) -> u32 {
    levels
        .windows(2)
        .map(|w| u32::from(x >= (w[0] + w[1]) * 0.5))
        .sum()
}

/// The `k` positive levels (ascending) of the symmetric `2k`-level quantizer; a boundary sits
/// at 0.
fn positive_half(k: usize, n: usize) -> Vec<f64> {
    let table = MassTable::new(n);
    // Tail mass `G(t) = ∫_t^1 f` and tail moment `P(t) = ∫_t^1 x f` of each boundary; cell `i`
    // is `[t_i, t_{i+1}]` with `t_0 = 0`, `t_k = 1`. The first cells have equal masses.
    let total = table.tail_mass(0.0);
    let (mut tail_mass, mut tail_moment): (Vec<f64>, Vec<f64>) = (0..=k)
        .map(|i| {
            let t = match i {
                0 => 0.0,
                _ if i == k => 1.0,
                _ => table.boundary_with_tail_mass(total * (k - i) as f64 / k as f64),
            };
            (table.tail_mass(t), table.tail_moment(t))
        })
        .unzip();
    let mut levels = vec![0.0; k];
    for round in 0..MAX_ROUNDS {
        if round > 0 {
            for i in 1..k {
                let t = 0.5 * (levels[i - 1] + levels[i]);
                tail_mass[i] = table.tail_mass(t);
                tail_moment[i] = table.tail_moment(t);
            }
        }
        let mut delta = 0.0f64;
        for (i, level) in levels.iter_mut().enumerate() {
            let mass = tail_mass[i] - tail_mass[i + 1];
            if mass > 0.0 {
                let c = (tail_moment[i] - tail_moment[i + 1]) / mass;
                delta = delta.max((c - *level).abs());
                *level = c;
            }
        }
        if round > 0 && delta < TOLERANCE {
            break;
        }
    }
    levels
}

/// `F(θ) = ∫_{θ_lo}^θ sin^(n−2) φ dφ` tabulated on a uniform grid over `[θ_lo, π/2]` (all but a
/// negligible mass), with the integrand, for cubic Hermite interpolation.
struct MassTable {
    /// `n − 2`: the exponent of `sin`.
    m: f64,
    theta_lo: f64,
    step: f64,
    cumulative: Vec<f64>,
    density: Vec<f64>,
}

impl MassTable {
    fn new(n: usize) -> Self {
        let m = (n - 2) as f64;
        let theta_lo = if n > 2 {
            (-TAIL_LOG / m).exp().asin()
        } else {
            0.0
        };
        let step = (std::f64::consts::FRAC_PI_2 - theta_lo) / TABLE_INTERVALS as f64;
        let mut cumulative = Vec::with_capacity(TABLE_INTERVALS + 1);
        let mut density = Vec::with_capacity(TABLE_INTERVALS + 1);
        // The integrand and its derivative at each node; each interval's integral is that of
        // its cubic Hermite interpolant (trapezoid with the endpoint-derivative correction,
        // error O(h^5) like Simpson's). sin and cos step by rotation through `step`, exact
        // every RESYNC nodes (drift below 1e-14).
        const RESYNC: usize = 32;
        let (sin_step, cos_step) = step.sin_cos();
        let (mut sin, mut cos) = (0.0f64, 1.0f64);
        let (mut prev_s, mut prev_ds, mut acc) = (0.0, 0.0, 0.0);
        for j in 0..=TABLE_INTERVALS {
            if j % RESYNC == 0 {
                (sin, cos) = (theta_lo + step * j as f64).sin_cos();
            } else {
                (sin, cos) = (
                    sin * cos_step + cos * sin_step,
                    cos * cos_step - sin * sin_step,
                );
            }
            let (s, ds) = if n == 2 {
                (1.0, 0.0)
            } else {
                let p = ((m - 1.0) * sin.ln()).exp(); // sin^(m−1), m ≥ 1, sin > 0
                (p * sin, m * p * cos)
            };
            if j > 0 {
                acc += 0.5 * step * (prev_s + s) + step * step / 12.0 * (prev_ds - ds);
            }
            cumulative.push(acc);
            density.push(s);
            (prev_s, prev_ds) = (s, ds);
        }
        MassTable {
            m,
            theta_lo,
            step,
            cumulative,
            density,
        }
    }

    /// `F(θ)`, by cubic Hermite interpolation (0 below the table).
    fn mass_below(&self, theta: f64) -> f64 {
        let u = (theta - self.theta_lo) / self.step;
        if u <= 0.0 {
            return 0.0;
        }
        let j = (u as usize).min(TABLE_INTERVALS - 1);
        let t = u - j as f64;
        let (t2, t3) = (t * t, t * t * t);
        let h00 = 2.0 * t3 - 3.0 * t2 + 1.0;
        let h10 = t3 - 2.0 * t2 + t;
        let h01 = -2.0 * t3 + 3.0 * t2;
        let h11 = t3 - t2;
        h00 * self.cumulative[j]
            + h01 * self.cumulative[j + 1]
            + self.step * (h10 * self.density[j] + h11 * self.density[j + 1])
    }

    /// `∫_t^1 f(x) dx` (unnormalized) for `0 ≤ t ≤ 1`: `F(acos t)`.
    fn tail_mass(&self, t: f64) -> f64 {
        self.mass_below(t.clamp(-1.0, 1.0).acos())
    }

    /// `∫_t^1 x f(x) dx = (1 − t²)^((n−1)/2) / (n − 1)`, exactly (same normalization as
    /// [`Self::tail_mass`]).
    fn tail_moment(&self, t: f64) -> f64 {
        let one_minus_t2 = ((1.0 - t) * (1.0 + t)).max(0.0);
        (0.5 * (self.m + 1.0) * one_minus_t2.ln()).exp() / (self.m + 1.0)
    }

    /// The `t` with `tail_mass(t) ≈ target` (for the starting cells; linear in the table).
    fn boundary_with_tail_mass(&self, target: f64) -> f64 {
        let j = self.cumulative.partition_point(|&c| c < target);
        let theta = if j == 0 {
            self.theta_lo
        } else if j > TABLE_INTERVALS {
            std::f64::consts::FRAC_PI_2
        } else {
            let (a, b) = (self.cumulative[j - 1], self.cumulative[j]);
            let frac = if b > a { (target - a) / (b - a) } else { 0.0 };
            self.theta_lo + self.step * ((j - 1) as f64 + frac)
        };
        theta.cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIMS: [usize; 12] = [2, 3, 4, 5, 8, 16, 32, 64, 128, 256, 1000, 4096];

    #[test]
    fn supported_range() {
        assert!(codebook_supported(1, 2));
        assert!(codebook_supported(4, 4096));
        assert!(!codebook_supported(0, 64));
        assert!(!codebook_supported(5, 64));
        assert!(!codebook_supported(2, 1));
        assert!(!codebook_supported(2, 4097));
    }

    #[test]
    fn ascending_symmetric_inside_the_interval() {
        for bits in 1..=MAX_CODEBOOK_BITS {
            for n in DIMS {
                let c = lloyd_max_levels(bits, n);
                assert_eq!(c.len(), 1 << bits);
                for i in 0..c.len() {
                    assert_eq!(
                        c[i],
                        -c[c.len() - 1 - i],
                        "bits {bits} n {n}: not symmetric"
                    );
                }
                assert!(
                    c.windows(2).all(|w| w[0] < w[1]),
                    "bits {bits} n {n}: {c:?}"
                );
                assert!(c[0] > -1.0 && c[0].is_finite(), "bits {bits} n {n}: {c:?}");
            }
        }
    }

    /// At `n = 3` the density is uniform: the levels are the uniform quantizer's.
    #[test]
    fn uniform_density_at_three() {
        for bits in 1..=MAX_CODEBOOK_BITS {
            let c = lloyd_max_levels(bits, 3);
            let k = c.len() as f64;
            for (i, &v) in c.iter().enumerate() {
                let want = -1.0 + (2 * i + 1) as f64 / k;
                assert!((v as f64 - want).abs() < 1e-6, "bits {bits}: {c:?}");
            }
        }
    }

    /// Each level is the conditional mean of its cell, by a crude independent integration
    /// (midpoint rule in θ over each cell).
    #[test]
    fn centroid_condition() {
        const STEPS: usize = 100_000;
        for bits in 1..=MAX_CODEBOOK_BITS {
            for n in [2, 3, 4, 7, 16, 64, 128, 1000, 4096] {
                let c = lloyd_max_levels(bits, n);
                let mut edges = vec![-1.0f64];
                edges.extend(level_boundaries(&c).iter().map(|&b| b as f64));
                edges.push(1.0);
                for (i, &level) in c.iter().enumerate() {
                    let (t_hi, t_lo) = (edges[i].acos(), edges[i + 1].acos());
                    let h = (t_hi - t_lo) / STEPS as f64;
                    let (mut mass, mut moment) = (0.0, 0.0);
                    for s in 0..STEPS {
                        let t = t_lo + h * (s as f64 + 0.5);
                        let w = t.sin().powi(n as i32 - 2);
                        mass += w;
                        moment += w * t.cos();
                    }
                    let mean = moment / mass;
                    let err = (level as f64 - mean).abs() / mean.abs();
                    assert!(err < 1e-6, "bits {bits} n {n} level {i}: {level} vs {mean}");
                }
            }
        }
    }

    /// For large `n`, `√n · c` approaches the Lloyd–Max levels of the standard normal.
    #[test]
    fn gaussian_limit() {
        let gaussian: [&[f64]; 3] = [
            &[0.797_884_6],
            &[0.452_780_0, 1.510_417_6],
            &[0.245_120_9, 0.756_005_2, 1.343_909_3, 2.151_945_7],
        ];
        for (b, g) in gaussian.iter().enumerate() {
            let bits = b as u32 + 1;
            let mut prev_err = f64::INFINITY;
            for n in [256, 1024, 4096] {
                let c = lloyd_max_levels(bits, n);
                let half = &c[c.len() / 2..];
                let err = half
                    .iter()
                    .zip(g.iter())
                    .map(|(&v, &want)| ((v as f64 * (n as f64).sqrt()) / want - 1.0).abs())
                    .fold(0.0, f64::max);
                assert!(err < prev_err, "bits {bits} n {n}: not approaching, {err}");
                prev_err = err;
            }
            assert!(
                prev_err < 1e-3,
                "bits {bits} n 4096: relative error {prev_err}"
            );
        }
    }

    #[test]
    fn nearest_level_ties_go_up() {
        let levels = [-1.5f32, -0.5, 0.5, 1.5];
        assert_eq!(level_boundaries(&levels), vec![-1.0, 0.0, 1.0]);
        assert_eq!(nearest_level(&levels, -9.0), 0);
        assert_eq!(nearest_level(&levels, -1.0), 1);
        assert_eq!(
            nearest_level(&levels, f32::from_bits((-1.0f32).to_bits() + 1)),
            0
        );
        assert_eq!(nearest_level(&levels, 0.0), 2);
        assert_eq!(nearest_level(&levels, -0.0), 2);
        assert_eq!(nearest_level(&levels, 0.99), 2);
        assert_eq!(nearest_level(&levels, 1.0), 3);
        assert_eq!(nearest_level(&levels, f32::INFINITY), 3);
        assert_eq!(nearest_level(&levels, f32::NAN), 0);
    }
}

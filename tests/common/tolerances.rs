//! Every numeric tolerance of the Rust tests, named and justified in one place (the browser
//! tests mirror them in `tests/browser/tolerances.mjs`).

// ---- GPU kernels against the CPU reference (property tests on random shapes) ----

/// A code may differ by one only where the CPU's pre-rounding value `(x - zero) / scale`
/// lies within this distance of a .5 tie (GPU division is not correctly rounded).
pub const TIE_WINDOW: f32 = 1e-4;
/// Lloyd–Max codes: a code may differ by one only where the value lies within this distance
/// (relative to the group's norm) of a level boundary `b · norm`: the GPU's square root and
/// sum may put the norm an ulp or two from the CPU's.
pub const LEVEL_TIE_REL: f32 = 1e-5;
/// f32 params: WGSL division is accurate to 2.5 ulp, not correctly rounded.
pub const F32_PARAM_REL: f32 = 4e-7;
/// f16 params: one f16 ulp when the f32 value sat on an f16 rounding boundary.
pub const F16_PARAM_REL: f32 = 1.0 / 1024.0;
/// f32 dequant outputs: `code * scale + zero` may be fused into one fma on the GPU.
pub const F32_OUT_REL: f32 = 2.5e-7;
/// f16 dequant outputs: one f16 ulp (an fma can flip the f16 rounding).
pub const F16_OUT_REL: f32 = 1.0 / 1024.0;
/// Rotation, f32 output, relative to the vector's largest |y|: the butterflies run in the
/// same order on both sides; 1/√D and the GPU's adds may differ by an ulp or two.
pub const ROTATE_F32_REL: f32 = 1e-6;
/// Rotation, f16 output: one f16 ulp (a value on an f16 rounding boundary may round apart).
pub const ROTATE_F16_REL: f32 = 1.0 / 1024.0;
/// Similarity (MSE relative, cosine absolute), GPU against the CPU twin: partial sums in
/// another order.
pub const SIM_GPU_CPU_REL: f64 = 1e-4;

// ---- against the reference implementation's golden values ----

/// The CPU reference's params equal the golden ones exactly (same f32 operations).
pub const GOLDEN_CPU_PARAM_REL: f32 = 0.0;
/// GPU f32 params against the golden ones: `(max - min) / levels` may differ by an ulp.
pub const GOLDEN_GPU_PARAM_REL: f32 = 2e-7;
/// GPU similarity against the golden values (MSE relative, cosine absolute).
pub const GOLDEN_SIM_REL: f64 = 1e-5;

// ---- caches ----

/// Fused vs dense attention, both reading the same K/V with f32 fetches: the sums are
/// reassociated (scales folded into the queries, zeros into one bias per group, probability-
/// weighted codes), so they agree to f32 rounding, relative to the largest |V|.
pub const ATTEND_F32_REL: f32 = 2e-5;
/// With f16 fetches the dense side reads every K/V value rounded to f16 (the fused side
/// does not round): about two f16 ulps of the values, relative to the largest |V|.
pub const ATTEND_F16_REL: f32 = 2e-3;
/// Rounding budget of a reconstruction element: one f16 ulp of the value, plus two f16 ulps
/// at unit scale for terms that were rounded before they cancelled (a reuse layer's base
/// and residual, each rounded to the output dtype, may sum to a small value).
pub const RECON_ABS: f32 = 2.0 / 1024.0;

// ---- the model ----

/// Largest |GPU − CPU| logit difference allowed (observed 0.0055 on lavapipe, logits up to
/// ±27): f32 sums in a different order through 30 layers.
pub const LOGIT_TOL: f32 = 0.05;

// ---- numbers printed by the CLI ----

/// Relative agreement of a JSON number the CLI printed with the value computed here (the
/// CLI prints f32 results through f64 without loss; 1e-3 allows for its own accumulation
/// order).
pub const CLI_REL: f64 = 1e-3;

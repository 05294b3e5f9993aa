// Numeric tolerances of the browser tests, named once (mirrors tests/common/tolerances.rs).

/**
 * Relative MSE, page (SwiftShader) vs CLI (lavapipe) on the demo's analysis: codes within
 * 1e-4 of a rounding tie may round one step differently, which moves a layer's MSE by ~1e-3
 * relative (measured 1.4e-3 at most).
 */
export const DEMO_MSE_REL = 1e-2;

/** Relative reconstruction MSE of a cache set or primitive, browser vs CLI (same data). */
export const CLI_MSE_REL = 1e-3;

/** Absolute cosine, and relative MSE, of cross-layer similarity, browser vs CLI. */
export const SIMILARITY_ABS = 1e-4;
export const SIMILARITY_MSE_REL = 1e-4;

/** Fused attention over the packed cache vs attention over fetchInto's reconstruction, as a
 * fraction of max |V|. */
export const ATTEND_VS_FETCH_REL = 2e-5;

/** Cosine of a tensor with itself (f32 accumulation). */
export const SELF_COSINE_MIN = 0.999;

/** A suggested plan's effective bits may exceed its target by rounding only. */
export const PLAN_BITS_SLACK = 1e-9;

/** Relative error of recomputed stats ratios (effectiveBits, ratioVsFp16) vs stats(). */
export const STATS_REL = 1e-9;

/** The page's JS heap after a soak, garbage collected, may exceed its start by this much
 * (measured: +93 KB after 1,000 cycles, +96 KB after 3,000; a leak of one promise per call
 * showed as +520 KB after 1,000). */
export const SOAK_HEAP_BYTES = 256 * 1024;

//! GPU acquisition for tests: one context per test binary. Without an adapter the test is
//! skipped with a printed reason, unless `REQUIRE_GPU=1`, which turns that into a failure.
//! Any GPU error (validation, out of memory) that escapes an operation fails the test.

use std::sync::{Arc, OnceLock};

use xquant_wgpu::gpu::{ContextOptions, GpuContext};

static CONTEXT: OnceLock<Option<Arc<GpuContext>>> = OnceLock::new();

/// True when `REQUIRE_GPU=1`: a missing adapter fails instead of skipping.
pub fn gpu_required() -> bool {
    std::env::var("REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// The shared context, or `None` (after printing why) when there is no adapter.
pub fn gpu() -> Option<Arc<GpuContext>> {
    CONTEXT
        .get_or_init(
            || match pollster::block_on(GpuContext::new(&ContextOptions::default())) {
                Ok(ctx) => {
                    eprintln!("GPU adapter: {}", ctx.adapter());
                    Some(Arc::new(ctx))
                }
                Err(e) if gpu_required() => panic!("REQUIRE_GPU=1 but no GPU: {e}"),
                Err(e) => {
                    eprintln!("SKIPPED: no GPU adapter ({e}); set REQUIRE_GPU=1 to fail instead");
                    None
                }
            },
        )
        .clone()
}

/// Fails the test if the device was lost or any GPU error escaped every scope.
pub fn assert_no_gpu_errors(ctx: &GpuContext) {
    if let Err(e) = ctx.check() {
        panic!("GPU error: {e}");
    }
    let escaped = ctx.take_uncaptured_errors();
    assert!(escaped.is_empty(), "GPU errors escaped: {escaped:?}");
}

/// `let ctx = gpu_or_skip!();` — returns from the test (skips) when there is no GPU.
#[macro_export]
macro_rules! gpu_or_skip {
    () => {
        match $crate::common::gpu::gpu() {
            Some(ctx) => ctx,
            None => return,
        }
    };
}

/// Blocks on a future (the tests' executor).
pub fn block<F: std::future::Future>(f: F) -> F::Output {
    pollster::block_on(f)
}

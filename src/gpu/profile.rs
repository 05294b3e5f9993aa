//! GPU time per kernel launch: timestamp queries at the start and end of each launch's pass,
//! where the device has `TIMESTAMP_QUERY` (natively, where the adapter offers it). On a GPU a
//! decode step of a small model costs its launches' latencies more than its bytes; this says
//! which launches.

use std::collections::BTreeMap;

use crate::error::{Result, XqError};
use crate::gpu::GpuContext;

/// Launches one profile records at most (two timestamps each; a query set holds 4096).
pub(crate) const PROFILE_LAUNCHES: u32 = 2048;

/// The launches of one kernel entry point in a profile.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    /// The WGSL entry point.
    pub kernel: String,
    /// Launches recorded.
    pub launches: usize,
    /// Their GPU time in all, microseconds (start to end of each launch's pass).
    pub micros: f64,
}

/// Timestamp queries of the launches recorded while a profile is on.
pub(crate) struct Profiler {
    queries: wgpu::QuerySet,
    /// The kernel of each recorded launch, in query order (launch `i`: queries `2i`, `2i + 1`).
    kernels: Vec<&'static str>,
}

impl Profiler {
    /// The timestamp writes of the next launch's pass (of `kernel`), while room is left.
    pub(crate) fn next(
        &mut self,
        kernel: &'static str,
    ) -> Option<wgpu::ComputePassTimestampWrites<'_>> {
        let i = self.kernels.len() as u32;
        if i >= PROFILE_LAUNCHES {
            return None;
        }
        self.kernels.push(kernel);
        Some(wgpu::ComputePassTimestampWrites {
            query_set: &self.queries,
            beginning_of_pass_write_index: Some(2 * i),
            end_of_pass_write_index: Some(2 * i + 1),
        })
    }
}

impl GpuContext {
    /// Whether the device can time launches ([`GpuContext::start_profile`]).
    pub fn can_profile(&self) -> bool {
        self.device
            .features()
            .contains(wgpu::Features::TIMESTAMP_QUERY)
    }

    /// Times every launch recorded from now until [`GpuContext::finish_profile`] (the first
    /// 2048), on the GPU. Fails where the device has no timestamp queries.
    pub fn start_profile(&self) -> Result<()> {
        if !self.can_profile() {
            return Err(XqError::Config(
                "this device has no timestamp queries (TIMESTAMP_QUERY): nothing to profile with"
                    .into(),
            ));
        }
        let queries = self.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("launch times"),
            ty: wgpu::QueryType::Timestamp,
            count: 2 * PROFILE_LAUNCHES,
        });
        *self.profiler.lock().unwrap_or_else(|p| p.into_inner()) = Some(Profiler {
            queries,
            kernels: Vec::new(),
        });
        Ok(())
    }

    /// Stops timing and returns the GPU time of the launches recorded since
    /// [`GpuContext::start_profile`], by kernel, longest first (the work that recorded them
    /// must have been submitted).
    pub async fn finish_profile(&self) -> Result<Vec<KernelTime>> {
        let Some(profiler) = self
            .profiler
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        else {
            return Err(XqError::Config("no profile was started".into()));
        };
        let n = profiler.kernels.len() as u32;
        if n == 0 {
            return Ok(Vec::new());
        }
        let bytes = u64::from(2 * n) * 8;
        let resolved = self.resolve_buffer("launch times", bytes)?;
        let staging = self
            .run("resolve launch times", |enc| {
                enc.resolve_query_set(&profiler.queries, 0..2 * n, &resolved, 0);
                Ok(self.encode_readback(enc, &resolved, 0, bytes))
            })
            .await?;
        let raw = self.map_staging(staging, bytes).await?;
        let ticks: &[u64] = bytemuck::cast_slice(&raw);
        let period = f64::from(self.queue.get_timestamp_period());
        let mut by_kernel: BTreeMap<&str, (usize, f64)> = BTreeMap::new();
        for (i, kernel) in profiler.kernels.iter().enumerate() {
            let ns = ticks[2 * i + 1].saturating_sub(ticks[2 * i]) as f64 * period;
            let slot = by_kernel.entry(kernel).or_default();
            slot.0 += 1;
            slot.1 += ns / 1e3;
        }
        let mut out: Vec<KernelTime> = by_kernel
            .into_iter()
            .map(|(kernel, (launches, micros))| KernelTime {
                kernel: kernel.to_string(),
                launches,
                micros,
            })
            .collect();
        out.sort_by(|a, b| b.micros.total_cmp(&a.micros));
        Ok(out)
    }

    /// Runs `work` with a profile on and returns its result with the GPU time of the launches
    /// it recorded, by kernel; the profile ends whether `work` succeeds or not. Blocks on the
    /// readback: for the native benchmarks.
    #[cfg(not(target_arch = "wasm32"))]
    pub(crate) fn profiled<T>(
        &self,
        work: impl FnOnce() -> Result<T>,
    ) -> Result<(T, Vec<KernelTime>)> {
        self.start_profile()?;
        let out = work();
        let times = pollster::block_on(self.finish_profile());
        Ok((out?, times?))
    }

    /// A buffer timestamp queries resolve into (`QUERY_RESOLVE`, copied out from).
    fn resolve_buffer(&self, label: &str, bytes: u64) -> Result<wgpu::Buffer> {
        self.check()?;
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        }))
    }
}

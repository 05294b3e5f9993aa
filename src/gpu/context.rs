//! Device acquisition and the context every kernel runs through.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Result, XqError};
use crate::gpu::pipelines::{
    Access, PipelineCache, ATTENTION_WG, ATTENTION_WG_CPU, GROUP_WG, ROTATE_WG_CPU,
};

/// Bindings of the widest kernel family (`Family::bindings`).
pub(crate) const MAX_BINDINGS: u64 = 10;

/// What a user wants from adapter selection.
#[derive(Clone, Debug, Default)]
pub struct ContextOptions {
    /// Prefer a low-power or high-performance adapter.
    pub power_preference: wgpu::PowerPreference,
    /// The device the adapter gives is the caller's (on the web: a runtime's `GPUDevice`
    /// handed over by the facade): leave its uncaptured-error handler alone.
    pub shared_device: bool,
    /// How attention cuts a long context into workgroups.
    pub attention_chunks: AttentionChunks,
    /// How many invocations an attention workgroup has.
    pub attention_workgroup: AttentionWorkgroup,
    /// How a short attention launch spreads its work over a workgroup's threads.
    pub attention_fill: AttentionFill,
}

/// Invocations per attention workgroup.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionWorkgroup {
    /// [`AttentionWorkgroup::Narrow`] on an adapter that reports itself a CPU (lavapipe,
    /// SwiftShader; on the web, the browser's fallback adapter), else
    /// [`AttentionWorkgroup::Wide`].
    #[default]
    ByAdapter,
    /// 8 invocations: a CPU rasterizer runs a workgroup's SIMD groups in turn on one core.
    /// The rotation's workgroups narrow with them ([`GpuContext::rotate_workgroup_size`]).
    Narrow,
    /// 32 invocations: a GPU's wave.
    Wide,
}

/// How a short attention launch spreads its work over a workgroup's threads: a key-phase
/// thread scores a run of tokens in one walk over the channels, and a value-phase thread sums
/// a block of channels over the chunk's tokens (or a share of them). Long runs and unsplit
/// blocks load each query channel, param and code word for more tokens; short runs and split
/// blocks keep more of a workgroup's threads busy on a short chunk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionFill {
    /// The fewest loads and fixed costs per token, as measured on lavapipe (whose loads are a
    /// loop over the SIMD lanes): runs of 16 tokens where the codes allow, and a launch of one
    /// chunk sums each block of channels over all its tokens in one thread. On a GPU's wide
    /// workgroups that leaves threads idle: a 128-token chunk's 8 runs for 32 threads, a
    /// 256-token launch's value phase on 8 (XQuant) or 16 (f16) of them.
    #[default]
    Lean,
    /// Every thread of a workgroup works in both phases where the chunk has room: key-phase
    /// runs of 16, 8 or 4 tokens (the longest that give each thread a run: a 128-token chunk of
    /// a 32-thread workgroup, runs of 4), and value blocks whose tokens are split over threads
    /// in every launch: in one of one chunk too, and for values grouped along tokens too
    /// (which `Lean` never splits). The same for both caches; not yet timed on a GPU.
    Workgroup,
}

/// How attention cuts a long context into workgroups (each a chunk of tokens whose partial a
/// combine pass merges).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionChunks {
    /// [`AttentionChunks::Fewest`] on an adapter that reports itself a CPU (lavapipe,
    /// SwiftShader; on the web, the browser's fallback adapter), else
    /// [`AttentionChunks::Many`] (a GPU; on the web, where a GPU reports no type, any adapter
    /// but the fallback one), as [`AttentionWorkgroup::ByAdapter`] decides.
    #[default]
    ByAdapter,
    /// The fewest chunks that fit, of even length: a workgroup per core of a CPU.
    Fewest,
    /// Enough chunks to fill a GPU's multiprocessors (about 96 workgroups a launch).
    Many,
}

/// The error scopes of a submission, resolving once the GPU has validated it.
#[must_use = "a submission's errors are only known once its scopes are awaited"]
pub struct Submitted {
    label: String,
    validation: Pin<Box<dyn Future<Output = Option<wgpu::Error>>>>,
    oom: Pin<Box<dyn Future<Output = Option<wgpu::Error>>>>,
}

impl Submitted {
    /// The submission's GPU error, if any (validation, then out of memory).
    pub async fn finish(self) -> Result<()> {
        let (v, m) = (self.validation.await, self.oom.await);
        match v.or(m) {
            Some(e) => Err(XqError::Gpu(format!("{}: {e}", self.label))),
            None => Ok(()),
        }
    }
}

/// A printable description of the adapter in use.
#[derive(Clone, Debug, PartialEq)]
pub struct AdapterSummary {
    /// Adapter name, e.g. `llvmpipe (LLVM 15.0.6, 256 bits)`.
    pub name: String,
    /// `Vulkan`, `Metal`, `Dx12`, `Gl` or `BrowserWebGpu`.
    pub backend: String,
    /// `DiscreteGpu`, `IntegratedGpu`, `Cpu`, ...
    pub device_type: String,
    /// Driver name and version where known.
    pub driver: String,
}

impl AdapterSummary {
    fn from_info(info: &wgpu::AdapterInfo) -> Self {
        AdapterSummary {
            name: info.name.clone(),
            backend: format!("{:?}", info.backend),
            device_type: format!("{:?}", info.device_type),
            driver: format!("{} {}", info.driver, info.driver_info)
                .trim()
                .to_string(),
        }
    }
}

impl std::fmt::Display for AdapterSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}, {})", self.name, self.backend, self.device_type)
    }
}

/// Device, queue, pipeline cache and error sinks. Cheap to share behind an `Arc`.
pub struct GpuContext {
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    adapter: AdapterSummary,
    pub(crate) pipelines: PipelineCache,
    uncaptured: Arc<Mutex<Vec<String>>>,
    lost: Arc<Mutex<Option<String>>>,
    placeholder: wgpu::Buffer,
    /// Sections of this buffer stand in for writable bindings a kernel does not use, one per
    /// binding number: writable bindings of one bind group may not overlap.
    placeholder_rw: wgpu::Buffer,
    pub(crate) live_bytes: Arc<AtomicU64>,
    /// Attention cuts a long context into many chunks ([`AttentionChunks::Many`]).
    many_chunks: bool,
    /// Invocations per attention workgroup ([`AttentionWorkgroup`]).
    attention_wg: u32,
    /// Short launches spread over every thread ([`AttentionFill::Workgroup`]).
    fill_workgroup: bool,
    /// The launches being timed, while a profile is on ([`GpuContext::start_profile`]).
    pub(crate) profiler: Mutex<Option<crate::gpu::profile::Profiler>>,
    /// Kernel launches recorded so far (see [`GpuContext::launches_recorded`]).
    pub(crate) launches: AtomicU64,
    /// The launches' dims.
    pub(crate) uniforms: crate::gpu::dispatch::UniformArena,
    /// The device's limits, read once (on the web each read is a call into the browser per
    /// field).
    limits: wgpu::Limits,
}

/// Limits we ask for: WebGPU's defaults (what every browser gives), with the storage and
/// buffer sizes raised to what the adapter offers.
fn portable_limits(adapter: &wgpu::Limits) -> wgpu::Limits {
    wgpu::Limits {
        max_storage_buffer_binding_size: adapter.max_storage_buffer_binding_size,
        max_buffer_size: adapter.max_buffer_size,
        ..Default::default()
    }
}

impl GpuContext {
    /// Acquires an adapter and a device. `WGPU_BACKEND` (native) selects the backend.
    pub async fn new(options: &ContextOptions) -> Result<Self> {
        let instance =
            wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let adapter = instance
            .request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: options.power_preference,
                force_fallback_adapter: false,
                compatible_surface: None,
                ..Default::default()
            })
            .await
            .map_err(|e| {
                XqError::NoAdapter(format!(
                    "no GPU adapter found ({e}); natively install a Vulkan driver \
                     (Debian: apt-get install mesa-vulkan-drivers), in a browser enable WebGPU"
                ))
            })?;
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("xquant"),
                // Timestamp queries where offered natively, for `start_profile` (nothing
                // else uses them).
                required_features: if cfg!(target_arch = "wasm32") {
                    wgpu::Features::empty()
                } else {
                    adapter.features() & wgpu::Features::TIMESTAMP_QUERY
                },
                required_limits: portable_limits(&adapter.limits()),
                ..Default::default()
            })
            .await
            .map_err(|e| XqError::NoAdapter(format!("the adapter refused a device: {e}")))?;
        let mut ctx = Self::from_device(device, queue, &adapter.get_info());
        match options.attention_chunks {
            AttentionChunks::ByAdapter => {}
            AttentionChunks::Fewest => ctx.many_chunks = false,
            AttentionChunks::Many => ctx.many_chunks = true,
        }
        match options.attention_workgroup {
            AttentionWorkgroup::ByAdapter => {}
            AttentionWorkgroup::Narrow => ctx.attention_wg = ATTENTION_WG_CPU,
            AttentionWorkgroup::Wide => ctx.attention_wg = ATTENTION_WG,
        }
        ctx.fill_workgroup = options.attention_fill == AttentionFill::Workgroup;
        if !options.shared_device {
            // Our own device: errors that escape every scope are ours to report.
            let sink = ctx.uncaptured.clone();
            ctx.device
                .on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
                    if let Ok(mut v) = sink.lock() {
                        v.push(e.to_string());
                    }
                }));
        }
        Ok(ctx)
    }

    /// Wraps a device a runtime already owns, so its buffers and ours live on one device. The
    /// device's uncaptured-error handler stays the runtime's: every call of ours catches its
    /// own errors in error scopes. Device loss is observed (without replacing anything).
    pub fn from_device(device: wgpu::Device, queue: wgpu::Queue, info: &wgpu::AdapterInfo) -> Self {
        let uncaptured = Arc::new(Mutex::new(Vec::new()));
        let lost = Arc::new(Mutex::new(None));
        let lost_sink = lost.clone();
        device.set_device_lost_callback(move |reason, message| {
            if let Ok(mut slot) = lost_sink.lock() {
                *slot = Some(format!("{reason:?}: {message}"));
            }
        });
        let placeholder = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("unused binding"),
            size: 16,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let limits = device.limits();
        // A CPU rasterizer (on the web: the fallback adapter) gets the fewest attention
        // chunks and narrow workgroups; anything else (a GPU, typeless on the web) the GPU's.
        let cpu = info.device_type == wgpu::DeviceType::Cpu;
        let placeholder_rw = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("unused writable bindings"),
            size: u64::from(limits.min_storage_buffer_offset_alignment) * MAX_BINDINGS,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        GpuContext {
            live_bytes: Arc::new(AtomicU64::new(0)),
            uniforms: Default::default(),
            limits,
            placeholder,
            placeholder_rw,
            launches: AtomicU64::new(0),
            profiler: Mutex::new(None),
            many_chunks: !cpu,
            attention_wg: if cpu { ATTENTION_WG_CPU } else { ATTENTION_WG },
            fill_workgroup: false,
            pipelines: PipelineCache::default(),
            device,
            queue,
            adapter: AdapterSummary::from_info(info),
            uncaptured,
            lost,
        }
    }

    /// A 4-byte storage buffer bound where an explicit layout has a binding a kernel
    /// specialisation does not read.
    pub(crate) fn placeholder(&self) -> wgpu::Buffer {
        self.placeholder.clone()
    }

    /// What binding `binding` of an explicit layout is bound to where a kernel does not use
    /// it: the read-only placeholder, or the writable one's section for that binding.
    pub(crate) fn unbound(&self, binding: u32, access: Access) -> (wgpu::Buffer, u64, Option<u64>) {
        match access {
            Access::Write => {
                let align = u64::from(self.limits.min_storage_buffer_offset_alignment);
                (
                    self.placeholder_rw.clone(),
                    u64::from(binding) * align,
                    Some(16),
                )
            }
            _ => (self.placeholder.clone(), 0, None),
        }
    }

    /// The wgpu device (to run your own kernels on our buffers).
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    /// The wgpu queue.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    /// Adapter name, backend and type.
    pub fn adapter(&self) -> &AdapterSummary {
        &self.adapter
    }

    /// The limits the device was created with.
    pub fn limits(&self) -> wgpu::Limits {
        self.limits.clone()
    }

    /// Bytes of the buffers the library holds on this device right now (tensors, codes,
    /// params, caches, outputs); freed buffers are subtracted as their last owner drops them.
    pub fn allocated_bytes(&self) -> u64 {
        self.live_bytes.load(Ordering::Relaxed)
    }

    /// Pipelines compiled so far (each (kernel, constants) once per device).
    pub fn pipeline_count(&self) -> usize {
        self.pipelines.len()
    }

    /// Kernel launches recorded on this context so far. On a GPU a short decode step costs
    /// about its launches (each a bind group, a pass and a barrier), not its bytes: the
    /// benchmarks report launches per step beside the times.
    pub fn launches_recorded(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }

    /// Whether attention cuts a long context into many chunks ([`AttentionChunks`]).
    pub fn many_attention_chunks(&self) -> bool {
        self.many_chunks
    }

    /// Invocations per attention workgroup ([`AttentionWorkgroup`]).
    pub fn attention_workgroup_size(&self) -> u32 {
        self.attention_wg
    }

    /// Whether a short attention launch spreads over every thread of a workgroup
    /// ([`AttentionFill`]).
    pub fn fills_attention_workgroup(&self) -> bool {
        self.fill_workgroup
    }

    /// Invocations per workgroup of the rotation: `ROTATE_WG_CPU` with the attention's
    /// narrow workgroups, else the family's (`GROUP_WG`).
    pub fn rotate_workgroup_size(&self) -> u32 {
        if self.attention_wg == ATTENTION_WG_CPU {
            ROTATE_WG_CPU
        } else {
            GROUP_WG
        }
    }

    /// Largest buffer one storage binding may cover.
    pub fn max_binding_bytes(&self) -> u64 {
        self.limits.max_storage_buffer_binding_size
    }

    /// Largest buffer a kernel can use whole: one storage binding's reach, within the
    /// device's buffer size limit.
    pub fn max_bound_buffer_bytes(&self) -> u64 {
        self.max_binding_bytes().min(self.limits.max_buffer_size)
    }

    /// Fails with `DeviceLost` once the device is gone. Errors that escaped every error scope
    /// are not a call's failure (every call catches its own work's errors in scopes; on a
    /// shared device they are the runtime's): see [`GpuContext::take_uncaptured_errors`].
    pub fn check(&self) -> Result<()> {
        // Natively the device-lost callback runs when the device is polled.
        #[cfg(not(target_arch = "wasm32"))]
        let _ = self.device.poll(wgpu::PollType::Poll);
        self.check_latched()
    }

    /// [`GpuContext::check`] without polling: fails once a loss has been latched (for the
    /// allocations inside a call, which already checked at its start).
    pub(crate) fn check_latched(&self) -> Result<()> {
        if let Some(msg) = self.lost.lock().ok().and_then(|s| s.clone()) {
            return Err(XqError::DeviceLost(format!(
                "the GPU device was lost ({msg})"
            )));
        }
        Ok(())
    }

    /// Latches device loss reported by someone who saw it first (on the web, the facade's
    /// `device.lost` handler): every later call fails with `DeviceLost`.
    pub fn mark_lost(&self, message: &str) {
        if let Ok(mut slot) = self.lost.lock() {
            slot.get_or_insert_with(|| message.to_string());
        }
    }

    /// Errors on our own device that escaped every error scope since the last call (always
    /// empty on a shared device, whose uncaptured-error handler stays the runtime's).
    pub fn take_uncaptured_errors(&self) -> Vec<String> {
        self.uncaptured
            .lock()
            .map(|mut v| std::mem::take(&mut *v))
            .unwrap_or_default()
    }

    /// Natively a destroyed device is reported lost only once its queue is idle, and its
    /// operations fail without an error, except a write into a buffer created after the loss
    /// (an invalid one), which fails inside the scopes: a submission's error then finds the
    /// loss. The launches share their uniform arena, so each submission writes one probe.
    #[cfg(not(target_arch = "wasm32"))]
    fn probe_loss(&self) {
        let probe = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("loss probe"),
            size: 4,
            usage: wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.queue.write_buffer(&probe, 0, &[0; 4]);
    }

    /// Runs `encode` on a fresh command encoder inside validation and out-of-memory error
    /// scopes and submits it, now (the scopes are pushed and popped before this returns);
    /// the returned `Submitted` resolves to the GPU's verdict. Nothing is submitted when
    /// `encode` fails.
    pub fn submit<T>(
        &self,
        label: &str,
        encode: impl FnOnce(&mut wgpu::CommandEncoder) -> Result<T>,
    ) -> (Result<T>, Submitted) {
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        #[cfg(not(target_arch = "wasm32"))]
        self.probe_loss();
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) });
        let out = encode(&mut encoder);
        if out.is_ok() {
            self.queue.submit([encoder.finish()]);
        }
        // Pop both scopes before awaiting either: on the web the scope stack is shared by
        // every task (and by a runtime sharing the device), and another call may push its own
        // while we wait.
        let validation = Box::pin(validation.pop());
        let oom = Box::pin(oom.pop());
        (
            out,
            Submitted {
                label: label.to_string(),
                validation,
                oom,
            },
        )
    }

    /// Runs `encode` on a fresh command encoder inside validation and out-of-memory error
    /// scopes, submits it, and reports any GPU error as `Err`.
    pub async fn run<T>(
        &self,
        label: &str,
        encode: impl FnOnce(&mut wgpu::CommandEncoder) -> Result<T>,
    ) -> Result<T> {
        self.check()?;
        let (out, submitted) = self.submit(label, encode);
        if let Err(e) = submitted.finish().await {
            return Err(self.lost_or(e));
        }
        self.check()?;
        out
    }

    /// `DeviceLost` when a failed submission's cause was the device going away, else `e`.
    /// (Natively a destroyed device is only reported lost once its queue is idle.)
    pub(crate) fn lost_or(&self, e: XqError) -> XqError {
        #[cfg(not(target_arch = "wasm32"))]
        let _ = self.wait_idle();
        self.check().err().unwrap_or(e)
    }

    /// Blocks until submitted work is done (native); a no-op on the web.
    pub fn wait_idle(&self) -> Result<()> {
        #[cfg(not(target_arch = "wasm32"))]
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| XqError::Gpu(format!("poll: {e}")))?;
        Ok(())
    }
}

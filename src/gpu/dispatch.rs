//! Recording one kernel launch: uniform, bind group, 1-D work spread over a 2-D grid.

use crate::error::{Result, XqError};
use crate::gpu::mirror::WgslStruct;

use crate::gpu::pipelines::{Access, Kernel, KernelKey};
use crate::gpu::word_hash::WordHashMap;
use crate::gpu::GpuContext;

/// A storage binding: a whole buffer, or a section of one (offset a multiple of the
/// device's `min_storage_buffer_offset_alignment`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bind<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub offset: u64,
    /// Bytes from `offset`; `None` = to the end of the buffer.
    pub size: Option<u64>,
}

impl<'a> Bind<'a> {
    /// Bytes `[offset, offset + size)` of `buffer`.
    pub fn section(buffer: &'a wgpu::Buffer, offset: u64, size: u64) -> Self {
        Bind {
            buffer,
            offset,
            size: Some(size.max(4)),
        }
    }
}

impl<'a> From<&'a wgpu::Buffer> for Bind<'a> {
    fn from(buffer: &'a wgpu::Buffer) -> Self {
        Bind {
            buffer,
            offset: 0,
            size: None,
        }
    }
}

impl<'a> From<&'a crate::gpu::GpuBuffer> for Bind<'a> {
    fn from(buffer: &'a crate::gpu::GpuBuffer) -> Self {
        Bind::from(&**buffer)
    }
}

/// Bytes of one uniform arena: 4096 launches' dims at WebGPU's default 256-byte alignment (a
/// decode step of a 30-layer set records ~90-120 launches, so a step's bind groups are found
/// again for ~30 steps before the arena is let go).
const ARENA_BYTES: u64 = 1024 * 1024;

/// Threads' arenas kept at most.
const MAX_ARENAS: usize = 64;

/// Bind groups kept per arena at most (a caller cycling through ever new buffers would grow
/// the map without bound otherwise).
const MAX_BIND_GROUPS: usize = 2048;

/// The dims of launches: slots of a uniform buffer (one per recording thread), each written
/// once through the queue (ahead of any submission that reads it) and never reused, so a
/// launch recorded into an encoder that is submitted later (the caller's) still reads its own
/// dims. A full arena is let go (work that reads it keeps it alive) and a new one started: one
/// buffer per 4096 launches instead of one per launch (on the web each a call into the
/// browser; natively a buffer, its memory and a bind group per launch cost a GPU's decode
/// step more than its kernels). A lost device, which a launch's own new buffer used to reveal, is found by the
/// probe each submission writes ([`GpuContext::submit`]).
///
/// The dims are bound at a dynamic offset, so the arena also keeps the bind groups made over
/// it, by what they bind: a launch that binds the same buffers at the same ranges as an
/// earlier one (every decode step of a set) reuses its bind group instead of asking the
/// browser for a new one. They go with the arena.
#[derive(Default)]
pub(crate) struct UniformArena {
    /// One arena per recording thread. Natively, one uniform buffer shared by the launches of
    /// several threads at once gave some launches wrong results on lavapipe (the model tests,
    /// which share a context across threads, failed in 4 runs of 11; a buffer per launch or
    /// per thread: none in 10; the cause inside wgpu was not found).
    current: std::sync::Mutex<WordHashMap<std::thread::ThreadId, Arena>>,
}

#[derive(Default)]
struct Arena {
    buffer: Option<wgpu::Buffer>,
    next: u64,
    bind_groups: WordHashMap<BindKey, wgpu::BindGroup>,
}

/// What a bind group binds: its layout, the dims' size, and each storage binding's buffer
/// and range.
#[derive(PartialEq, Eq, Hash)]
struct BindKey {
    layout: &'static [(u32, Access)],
    dims_len: u64,
    storage: [Option<Bound>; MAX_STORAGE],
}

/// A storage binding of a bind group: binding number, buffer, offset, size.
type Bound = (u32, wgpu::Buffer, u64, Option<u64>);

/// Storage bindings of a layout at most (WebGPU's default `maxStorageBuffersPerShaderStage`).
pub(crate) const MAX_STORAGE: usize = 8;

impl Arena {
    /// A slot holding `bytes`: its offset in `self.buffer`, a new arena's when this one is full.
    fn slot(&mut self, ctx: &GpuContext, bytes: &[u8]) -> u64 {
        let limits = ctx.limits();
        let align = u64::from(limits.min_uniform_buffer_offset_alignment).max(16);
        let len = (bytes.len() as u64).next_multiple_of(align);
        let size = ARENA_BYTES.min(limits.max_buffer_size).max(len);
        if self.buffer.is_none() || self.next + len > size {
            // Written through the queue, not mapped at creation: mapping a buffer of a lost
            // device panics in wgpu, a queue write fails softly.
            self.buffer = Some(ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("dims"),
                size,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }));
            self.next = 0;
            self.bind_groups.clear();
        }
        let buffer = self.buffer.as_ref().expect("an arena");
        let offset = self.next;
        self.next += len;
        ctx.queue.write_buffer(buffer, offset, bytes);
        offset
    }

    /// The bind group of `key` over this arena's buffer, made on first use.
    fn bind_group(&mut self, ctx: &GpuContext, kernel: &Kernel, key: BindKey) -> wgpu::BindGroup {
        if let Some(group) = self.bind_groups.get(&key) {
            return group.clone();
        }
        if self.bind_groups.len() >= MAX_BIND_GROUPS {
            self.bind_groups.clear();
        }
        let uniform = self.buffer.as_ref().expect("an arena");
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: uniform,
                offset: 0,
                size: wgpu::BufferSize::new(key.dims_len),
            }),
        }];
        entries.extend(
            key.storage
                .iter()
                .flatten()
                .map(|(binding, buffer, offset, size)| wgpu::BindGroupEntry {
                    binding: *binding,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer,
                        offset: *offset,
                        size: size.and_then(wgpu::BufferSize::new),
                    }),
                }),
        );
        // No labels on the web: each would be a string decoded into JS.
        let label = (!cfg!(target_arch = "wasm32")).then_some("kernel bindings");
        let group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label,
            layout: &kernel.bind_layout,
            entries: &entries,
        });
        self.bind_groups.insert(key, group.clone());
        group
    }
}

/// Workgroups along x and y; kernels linearise `(wg.y * x + wg.x) * WG + local`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grid {
    pub x: u32,
    pub y: u32,
}

impl GpuContext {
    /// The grid covering `threads` invocations in workgroups of `wg`.
    pub(crate) fn grid(&self, threads: usize, wg: u32) -> Result<Grid> {
        let groups = threads.div_ceil(wg as usize).max(1);
        let max = self.limits().max_compute_workgroups_per_dimension as usize;
        let x = groups.min(max);
        let y = groups.div_ceil(x);
        if y > max {
            return Err(XqError::TooLarge(format!(
                "{threads} invocations exceed the dispatch grid"
            )));
        }
        Ok(Grid {
            x: x as u32,
            y: y as u32,
        })
    }

    /// Records `key` over `grid` with `dims` (the uniform) at binding 0 and `buffers` at their bindings.
    pub(crate) fn dispatch<D: WgslStruct>(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        key: &KernelKey,
        dims: &D,
        buffers: &[(u32, Bind<'_>)],
        grid: Grid,
    ) {
        debug_assert_eq!(
            D::FAMILY,
            key.family(),
            "{}: dims of another family",
            key.entry
        );
        let kernel = self.pipelines.get(&self.device, key);
        self.launches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let bytes = bytemuck::bytes_of(dims);
        // Every storage binding of the family's layout: the launch's buffers, placeholders
        // where the kernel reads nothing.
        let mut storage: [Option<Bound>; MAX_STORAGE] = Default::default();
        let bound = kernel
            .bindings
            .iter()
            .filter(|(_, access)| *access != Access::Uniform);
        for (slot, &(binding, access)) in storage.iter_mut().zip(bound) {
            *slot = Some(match buffers.iter().find(|(b, _)| *b == binding) {
                Some((_, b)) => (binding, b.buffer.clone(), b.offset, b.size),
                None => {
                    let (buffer, offset, size) = self.unbound(binding, access);
                    (binding, buffer, offset, size)
                }
            });
        }
        let bind_key = BindKey {
            layout: kernel.bindings,
            dims_len: bytes.len() as u64,
            storage,
        };
        let (bind_group, offset) = {
            let mut arenas = self
                .uniforms
                .current
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if arenas.len() >= MAX_ARENAS {
                // Threads that are gone keep theirs otherwise (work that reads one keeps it).
                arenas.clear();
            }
            let arena = arenas.entry(std::thread::current().id()).or_default();
            let offset = arena.slot(self, bytes);
            (arena.bind_group(self, &kernel, bind_key), offset)
        };
        let label = (!cfg!(target_arch = "wasm32")).then_some(key.entry);
        let mut pass = {
            let mut profiler = self.profiler.lock().unwrap_or_else(|p| p.into_inner());
            encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label,
                timestamp_writes: profiler.as_mut().and_then(|p| p.next(key.entry)),
            })
        };
        pass.set_pipeline(&kernel.pipeline);
        pass.set_bind_group(0, &bind_group, &[offset as u32]);
        pass.dispatch_workgroups(grid.x, grid.y, 1);
    }
}

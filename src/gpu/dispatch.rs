//! Recording one kernel launch: uniform, bind group, 1-D work spread over a 2-D grid.

use crate::error::{Result, XqError};
use crate::gpu::mirror::WgslStruct;
use crate::gpu::pipelines::KernelKey;
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

/// Bytes of one uniform arena: 256 launches' dims at WebGPU's default 256-byte alignment.
const ARENA_BYTES: u64 = 64 * 1024;

/// The dims of launches: slots of a shared uniform buffer, each written once through the queue
/// (ahead of any submission that reads it) and never reused, so a launch recorded into an
/// encoder that is submitted later (the caller's) still reads its own dims. A full arena is
/// let go (work that reads it keeps it alive) and a new one started: on the web one
/// `createBuffer` per 256 launches instead of one per launch (each a call into the browser).
/// Natively every launch keeps a buffer of its own: there creating one costs little, and a
/// buffer created on a destroyed device is what reports the loss inside the call's error
/// scopes (a queue write there reports nothing the scopes catch).
#[derive(Default)]
pub(crate) struct UniformArena {
    current: std::sync::Mutex<Option<(wgpu::Buffer, u64)>>,
}

impl UniformArena {
    /// A slot holding `bytes`: the arena's buffer and the slot's offset.
    fn slot(&self, ctx: &GpuContext, bytes: &[u8]) -> (wgpu::Buffer, u64) {
        let limits = ctx.limits();
        let align = u64::from(limits.min_uniform_buffer_offset_alignment).max(16);
        let len = (bytes.len() as u64).next_multiple_of(align);
        let arena = if cfg!(target_arch = "wasm32") {
            ARENA_BYTES.min(limits.max_buffer_size).max(len)
        } else {
            len
        };
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let fits = current
            .as_ref()
            .is_some_and(|(_, next)| next + len <= arena);
        if !fits {
            // Written through the queue, not mapped at creation: mapping a buffer of a lost
            // device panics in wgpu, a queue write fails softly.
            let buffer = ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("dims"),
                size: arena,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            *current = Some((buffer, 0));
        }
        let (buffer, next) = current.as_mut().expect("an arena");
        let offset = *next;
        *next += len;
        ctx.queue.write_buffer(buffer, offset, bytes);
        (buffer.clone(), offset)
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
        let bytes = bytemuck::bytes_of(dims);
        let (uniform, offset) = self.uniforms.slot(self, bytes);
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &uniform,
                offset,
                size: wgpu::BufferSize::new(bytes.len() as u64),
            }),
        }];
        entries.extend(buffers.iter().map(|(binding, b)| wgpu::BindGroupEntry {
            binding: *binding,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: b.buffer,
                offset: b.offset,
                size: b.size.and_then(wgpu::BufferSize::new),
            }),
        }));
        // No labels on the web: each would be a string decoded into JS per launch.
        let label = (!cfg!(target_arch = "wasm32")).then_some(key.entry);
        let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label,
            layout: &kernel.bind_layout,
            entries: &entries,
        });
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label,
            timestamp_writes: None,
        });
        pass.set_pipeline(&kernel.pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        pass.dispatch_workgroups(grid.x, grid.y, 1);
    }
}

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
        let pipeline = self.pipelines.get(&self.device, key);
        // Written through the queue (ahead of the submission that reads it), not mapped at
        // creation: mapping a buffer of a lost device panics in wgpu, a queue write fails softly.
        let bytes = bytemuck::bytes_of(dims);
        let uniform = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("dims"),
            size: bytes.len() as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.queue.write_buffer(&uniform, 0, bytes);
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: uniform.as_entire_binding(),
        }];
        entries.extend(buffers.iter().map(|(binding, b)| wgpu::BindGroupEntry {
            binding: *binding,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: b.buffer,
                offset: b.offset,
                size: b.size.and_then(wgpu::BufferSize::new),
            }),
        }));
        let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(key.entry),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some(key.entry),
            timestamp_writes: None,
        });
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        pass.dispatch_workgroups(grid.x, grid.y, 1);
    }
}

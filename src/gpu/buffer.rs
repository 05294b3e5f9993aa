//! Buffers the library allocates: counted while alive and destroyed when the last owner
//! drops them (on the web, dropping a `wgpu::Buffer` alone frees nothing until GC).

use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A device buffer: the library's own (counted, destroyed on drop) or a caller's (neither).
#[derive(Debug)]
pub struct GpuBuffer {
    inner: wgpu::Buffer,
    live: Option<Arc<AtomicU64>>,
}

impl GpuBuffer {
    /// Takes ownership of a buffer just created, adding its size to `live`.
    pub(crate) fn owned(inner: wgpu::Buffer, live: &Arc<AtomicU64>) -> Self {
        live.fetch_add(inner.size(), Ordering::Relaxed);
        GpuBuffer {
            inner,
            live: Some(live.clone()),
        }
    }

    /// Wraps a caller's buffer: not counted, never destroyed by the library.
    pub fn external(inner: wgpu::Buffer) -> Self {
        GpuBuffer { inner, live: None }
    }
}

impl Deref for GpuBuffer {
    type Target = wgpu::Buffer;

    fn deref(&self) -> &wgpu::Buffer {
        &self.inner
    }
}

impl Drop for GpuBuffer {
    fn drop(&mut self) {
        if let Some(live) = &self.live {
            live.fetch_sub(self.inner.size(), Ordering::Relaxed);
            self.inner.destroy();
        }
    }
}

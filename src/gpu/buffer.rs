//! Buffers the library allocates: counted while alive and destroyed when the last owner
//! drops them (on the web, dropping a `wgpu::Buffer` alone frees nothing until GC).

use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// A device buffer: the library's own (counted, destroyed on drop) or a caller's (neither).
#[derive(Debug)]
pub struct GpuBuffer {
    inner: wgpu::Buffer,
    live: Option<Arc<AtomicU64>>,
    /// Let go by [`GpuBuffer::detach`]: no longer counted, not destroyed on drop.
    detached: AtomicBool,
}

impl GpuBuffer {
    /// Takes ownership of a buffer just created, adding its size to `live`.
    pub(crate) fn owned(inner: wgpu::Buffer, live: &Arc<AtomicU64>) -> Self {
        live.fetch_add(inner.size(), Ordering::Relaxed);
        GpuBuffer {
            inner,
            live: Some(live.clone()),
            detached: AtomicBool::new(false),
        }
    }

    /// Lets go of the buffer without destroying it: it is no longer counted, and it is freed
    /// once nothing uses it any more (work recorded but not yet submitted may still read it;
    /// on the web, at garbage collection).
    pub(crate) fn detach(&self) {
        if let Some(live) = &self.live {
            if !self.detached.swap(true, Ordering::Relaxed) {
                live.fetch_sub(self.inner.size(), Ordering::Relaxed);
            }
        }
    }

    /// Wraps a caller's buffer: not counted, never destroyed by the library.
    pub fn external(inner: wgpu::Buffer) -> Self {
        GpuBuffer {
            inner,
            live: None,
            detached: AtomicBool::new(false),
        }
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
            if !*self.detached.get_mut() {
                live.fetch_sub(self.inner.size(), Ordering::Relaxed);
                self.inner.destroy();
            }
        }
    }
}

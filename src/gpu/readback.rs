//! Copying GPU buffers back to the host: staging buffer, `map_async`, poll (native) or
//! await (web).

use crate::config::DType;
use crate::config::{Levels, ParamsPrecision};
use crate::error::{Result, XqError};
use crate::gpu::{GpuContext, GpuParams, GpuTensor, PackedCodes};

impl GpuContext {
    /// Reads the first `bytes` (a multiple of 4) of `buffer`.
    pub async fn read_bytes(&self, buffer: &wgpu::Buffer, bytes: u64) -> Result<Vec<u8>> {
        self.read_range(buffer, 0, bytes).await
    }

    /// Reads `bytes` (a multiple of 4) of `buffer` from byte `offset` (a multiple of 4).
    pub async fn read_range(
        &self,
        buffer: &wgpu::Buffer,
        offset: u64,
        bytes: u64,
    ) -> Result<Vec<u8>> {
        let staging = self
            .run("readback copy", |enc| {
                Ok(self.encode_readback(enc, buffer, offset, bytes))
            })
            .await?;
        self.map_staging(staging, bytes).await
    }

    /// Records copying `bytes` of `buffer` from `offset` into a new mappable staging buffer
    /// (read it with [`GpuContext::map_staging`] once the copy is submitted).
    pub fn encode_readback(
        &self,
        enc: &mut wgpu::CommandEncoder,
        buffer: &wgpu::Buffer,
        offset: u64,
        bytes: u64,
    ) -> wgpu::Buffer {
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: bytes.max(4),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        enc.copy_buffer_to_buffer(buffer, offset, &staging, 0, bytes);
        staging
    }

    /// The first `bytes` of a staging buffer whose copy has been submitted; destroys it.
    pub async fn map_staging(&self, staging: wgpu::Buffer, bytes: u64) -> Result<Vec<u8>> {
        let (tx, rx) = futures_channel::oneshot::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.wait_idle()?;
        rx.await
            .map_err(|_| XqError::Gpu("readback was cancelled".into()))?
            .map_err(|e| XqError::Gpu(format!("readback map failed: {e}")))?;
        let data = staging
            .get_mapped_range(..)
            .map_err(|e| XqError::Gpu(format!("readback view: {e}")))?
            .to_vec();
        staging.unmap();
        staging.destroy();
        Ok(data[..bytes as usize].to_vec())
    }

    /// Reads a tensor as f32 values (halves widened).
    pub async fn read_f32(&self, t: &GpuTensor) -> Result<Vec<f32>> {
        let bytes = self.read_range(&t.buffer, t.offset, t.byte_len()).await?;
        Ok(tensor_values(t, &bytes))
    }

    /// Records copying a tensor into a staging buffer (see [`GpuContext::encode_readback`]).
    pub fn encode_tensor_readback(
        &self,
        enc: &mut wgpu::CommandEncoder,
        t: &GpuTensor,
    ) -> wgpu::Buffer {
        self.encode_readback(enc, &t.buffer, t.offset, t.byte_len())
    }

    /// The f32 values of a tensor copied into `staging` by
    /// [`GpuContext::encode_tensor_readback`] (submitted since).
    pub async fn map_tensor(&self, t: &GpuTensor, staging: wgpu::Buffer) -> Result<Vec<f32>> {
        let bytes = self.map_staging(staging, t.byte_len()).await?;
        Ok(tensor_values(t, &bytes))
    }
}

/// A tensor's values from its bytes, halves widened.
fn tensor_values(t: &GpuTensor, bytes: &[u8]) -> Vec<f32> {
    let n = t.shape.len();
    match t.dtype {
        DType::F32 => bytemuck::cast_slice::<u8, f32>(bytes)[..n].to_vec(),
        DType::F16 => bytemuck::cast_slice::<u8, u16>(bytes)[..n]
            .iter()
            .map(|&h| half::f16::from_bits(h).to_f32())
            .collect(),
    }
}

impl GpuContext {
    /// Reads packed words as stored.
    pub async fn read_code_words(&self, c: &PackedCodes) -> Result<Vec<u32>> {
        let bytes = self
            .read_range(&c.buffer, c.offset, c.layout.code_bytes() as u64)
            .await?;
        Ok(bytemuck::cast_slice(&bytes).to_vec())
    }

    /// Reads and unpacks codes to `[R, n_groups, group_size, O]`.
    pub async fn read_codes(&self, c: &PackedCodes) -> Result<Vec<u8>> {
        Ok(c.layout.unpack(&self.read_code_words(c).await?))
    }

    /// Reads params as (scale, zero), each `[R, n_groups, O]`.
    pub async fn read_params(&self, p: &GpuParams) -> Result<(Vec<f32>, Vec<f32>)> {
        let bytes = self.read_range(&p.buffer, p.offset, p.bytes()).await?;
        let words: &[u32] = bytemuck::cast_slice(&bytes);
        let cells = p.layout.cells();
        if p.layout.levels == Levels::LloydMax {
            return Ok((p.layout.unpack_norms(words, p.precision), vec![0.0; cells]));
        }
        let mut scale = Vec::with_capacity(cells);
        let mut zero = Vec::with_capacity(cells);
        for c in 0..cells {
            let (s, z) = match p.precision {
                ParamsPrecision::F32 => (
                    f32::from_bits(words[2 * c]),
                    f32::from_bits(words[2 * c + 1]),
                ),
                ParamsPrecision::F16 => {
                    let w = words[c];
                    (
                        half::f16::from_bits(w as u16).to_f32(),
                        half::f16::from_bits((w >> 16) as u16).to_f32(),
                    )
                }
            };
            scale.push(s);
            zero.push(z);
        }
        Ok((scale, zero))
    }
}

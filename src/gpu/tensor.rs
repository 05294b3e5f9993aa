//! GPU-resident tensors: dense f32/f16 tensors, packed codes and packed params.

use std::sync::Arc;

use crate::config::{check_values, DType, Levels, ParamsPrecision, QuantSpec, TensorShape};
use crate::error::{Result, XqError};
use crate::gpu::dispatch::Bind;
use crate::gpu::{GpuBuffer, GpuContext};
use crate::layout::GroupLayout;

/// Usage of every data buffer: bindable as storage, copyable both ways.
pub(crate) const DATA_USAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

/// A dense `[..., N, D]` tensor in a storage buffer: f32 words, or f16 pairs in `u32` words.
#[derive(Clone, Debug)]
pub struct GpuTensor {
    pub(crate) buffer: Arc<GpuBuffer>,
    /// Byte offset of element 0 in `buffer` (a multiple of [`TENSOR_ALIGN`]).
    pub(crate) offset: u64,
    pub(crate) shape: TensorShape,
    pub(crate) dtype: DType,
}

/// Bit-packed codes in the layout of [`GroupLayout`] (see `src/layout.rs`).
#[derive(Clone, Debug)]
pub struct PackedCodes {
    pub(crate) buffer: Arc<GpuBuffer>,
    /// Byte offset of the codes in `buffer` (a section of a cache page's buffer, or 0).
    pub(crate) offset: u64,
    pub(crate) layout: GroupLayout,
    /// Shape of the tensor these codes encode.
    pub(crate) shape: TensorShape,
}

/// (scale, zero) per cell, f16 pairs or f32 pairs.
#[derive(Clone, Debug)]
pub struct GpuParams {
    pub(crate) buffer: Arc<GpuBuffer>,
    /// Byte offset of the pairs in `buffer` (a section of a cache page's buffer, or 0).
    pub(crate) offset: u64,
    pub(crate) layout: GroupLayout,
    pub(crate) precision: ParamsPrecision,
}

/// Codes plus the params that dequantize them.
#[derive(Clone, Debug)]
pub struct QuantizedTensor {
    /// Packed codes.
    pub codes: PackedCodes,
    /// Their params.
    pub params: GpuParams,
}

/// Alignment of a tensor's offset inside a caller's buffer: WebGPU's largest
/// `minStorageBufferOffsetAlignment`, so any device can bind it.
pub const TENSOR_ALIGN: u64 = 256;

/// Bytes of the params of `layout` at `precision`.
pub(crate) fn params_bytes(layout: &GroupLayout, precision: ParamsPrecision) -> u64 {
    layout.params_bytes(precision) as u64
}

/// Bytes of `n` elements of `dtype`, rounded up to whole `u32` words.
pub(crate) fn dense_bytes(n: usize, dtype: DType) -> u64 {
    ((n * dtype.size()).div_ceil(4) * 4) as u64
}

impl GpuContext {
    /// A zero-filled storage buffer of `bytes` (at least 4), checked against device limits.
    pub(crate) fn storage_buffer(&self, label: &str, bytes: u64) -> Result<Arc<GpuBuffer>> {
        self.check_latched()?;
        let bytes = bytes.max(4);
        let limit = self.max_bound_buffer_bytes();
        if bytes > limit {
            return Err(XqError::TooLarge(format!(
                "{label}: {bytes} bytes exceed the device's storage binding limit of {limit} bytes"
            )));
        }
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes,
            usage: DATA_USAGE,
            mapped_at_creation: false,
        });
        Ok(Arc::new(GpuBuffer::owned(buffer, &self.live_bytes)))
    }

    pub(crate) fn upload_words(&self, label: &str, words: &[u8]) -> Result<Arc<GpuBuffer>> {
        let buffer = self.storage_buffer(label, words.len() as u64)?;
        self.queue.write_buffer(&buffer, 0, words);
        Ok(buffer)
    }

    /// Uploads f32 values of shape `dims`; NaN/Inf are rejected before anything is allocated.
    /// Values beyond ±16000 are also rejected when `params` is f16 (they would overflow the
    /// stored params).
    pub fn upload_f32(
        &self,
        data: &[f32],
        dims: &[usize],
        params: ParamsPrecision,
    ) -> Result<GpuTensor> {
        let shape = TensorShape::new(dims)?;
        shape.check_len(data.len(), "data")?;
        check_values(data, params, "data")?;
        Ok(GpuTensor {
            buffer: self.upload_words("f32 tensor", bytemuck::cast_slice(data))?,
            offset: 0,
            shape,
            dtype: DType::F32,
        })
    }

    /// Uploads IEEE half bit patterns of shape `dims` (checked like [`GpuContext::upload_f32`]).
    pub fn upload_f16(
        &self,
        data: &[u16],
        dims: &[usize],
        params: ParamsPrecision,
    ) -> Result<GpuTensor> {
        let shape = TensorShape::new(dims)?;
        shape.check_len(data.len(), "data")?;
        let as_f32: Vec<f32> = data
            .iter()
            .map(|&h| half::f16::from_bits(h).to_f32())
            .collect();
        check_values(&as_f32, params, "data")?;
        let mut bytes: Vec<u8> = bytemuck::cast_slice(data).to_vec();
        bytes.resize(dense_bytes(data.len(), DType::F16) as usize, 0);
        Ok(GpuTensor {
            buffer: self.upload_words("f16 tensor", &bytes)?,
            offset: 0,
            shape,
            dtype: DType::F16,
        })
    }

    /// Uploads f32 values converted to `dtype`.
    pub fn upload(
        &self,
        data: &[f32],
        dims: &[usize],
        dtype: DType,
        params: ParamsPrecision,
    ) -> Result<GpuTensor> {
        match dtype {
            DType::F32 => self.upload_f32(data, dims, params),
            DType::F16 => {
                let halves: Vec<u16> = data
                    .iter()
                    .map(|&v| half::f16::from_f32(v).to_bits())
                    .collect();
                self.upload_f16(&halves, dims, params)
            }
        }
    }

    /// Uploads packed code words of a tensor of `shape` quantized with `spec`.
    pub fn upload_codes(
        &self,
        words: &[u32],
        shape: &TensorShape,
        spec: &QuantSpec,
    ) -> Result<PackedCodes> {
        spec.validate()?;
        let layout = GroupLayout::new(shape, spec);
        if words.len() != layout.code_words() {
            return Err(XqError::Shape(format!(
                "{} code words do not fit shape {:?} at {} bits in groups of {} ({} words)",
                words.len(),
                shape.dims(),
                spec.bits,
                spec.group_size,
                layout.code_words()
            )));
        }
        Ok(PackedCodes {
            buffer: self.upload_words("codes", bytemuck::cast_slice(words))?,
            offset: 0,
            layout,
            shape: shape.clone(),
        })
    }

    /// Uploads (scale, zero) pairs, `[R, n_groups, O]` each, stored at `precision`.
    pub fn upload_params(
        &self,
        scale: &[f32],
        zero: &[f32],
        layout: GroupLayout,
        precision: ParamsPrecision,
    ) -> Result<GpuParams> {
        let cells = layout.cells();
        if scale.len() != cells || zero.len() != cells {
            return Err(XqError::Shape(format!(
                "params: {} scales and {} zeros, the layout has {cells} cells",
                scale.len(),
                zero.len()
            )));
        }
        check_values(scale, precision, "scale")?;
        check_values(zero, precision, "zero")?;
        if layout.levels == Levels::LloydMax && zero.iter().any(|&z| z != 0.0) {
            return Err(XqError::Config(
                "params: lloyd-max levels keep a norm per group and no zero (zeros must be 0)"
                    .into(),
            ));
        }
        let words: Vec<u32> = match (layout.levels, precision) {
            (Levels::LloydMax, _) => layout.pack_norms(scale, precision),
            (_, ParamsPrecision::F32) => scale
                .iter()
                .zip(zero)
                .flat_map(|(s, z)| [s.to_bits(), z.to_bits()])
                .collect(),
            (_, ParamsPrecision::F16) => scale
                .iter()
                .zip(zero)
                .map(|(&s, &z)| {
                    half::f16::from_f32(s).to_bits() as u32
                        | (half::f16::from_f32(z).to_bits() as u32) << 16
                })
                .collect(),
        };
        Ok(GpuParams {
            buffer: self.upload_words("params", bytemuck::cast_slice(&words))?,
            offset: 0,
            layout,
            precision,
        })
    }

    /// A new dense tensor (zero-filled).
    pub(crate) fn empty_tensor(&self, shape: &TensorShape, dtype: DType) -> Result<GpuTensor> {
        Ok(GpuTensor {
            buffer: self.storage_buffer("tensor", dense_bytes(shape.len(), dtype))?,
            offset: 0,
            shape: shape.clone(),
            dtype,
        })
    }

    pub(crate) fn empty_codes(
        &self,
        layout: GroupLayout,
        shape: &TensorShape,
    ) -> Result<PackedCodes> {
        Ok(PackedCodes {
            buffer: self.storage_buffer("codes", layout.code_bytes() as u64)?,
            offset: 0,
            layout,
            shape: shape.clone(),
        })
    }

    pub(crate) fn empty_params(
        &self,
        layout: GroupLayout,
        precision: ParamsPrecision,
    ) -> Result<GpuParams> {
        Ok(GpuParams {
            buffer: self.storage_buffer("params", params_bytes(&layout, precision))?,
            offset: 0,
            layout,
            precision,
        })
    }
}

impl GpuTensor {
    /// Shape `[..., N, D]`.
    pub fn shape(&self) -> &TensorShape {
        &self.shape
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The storage buffer (f32 words or f16 pairs), for a runtime's own kernels; the
    /// tensor starts at byte [`GpuTensor::offset`].
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }

    /// Byte offset of element 0 in [`GpuTensor::buffer`].
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Bytes the tensor's elements take (rounded up to whole words).
    pub fn byte_len(&self) -> u64 {
        dense_bytes(self.shape.len(), self.dtype)
    }

    /// Wraps a caller's storage buffer (usage must include STORAGE); the library never
    /// destroys it.
    pub fn from_buffer(buffer: wgpu::Buffer, dims: &[usize], dtype: DType) -> Result<Self> {
        Self::from_buffer_at(buffer, 0, dims, dtype)
    }

    /// Wraps a tensor starting at byte `offset` (a multiple of [`TENSOR_ALIGN`]) of a
    /// caller's storage buffer; the library never destroys the buffer.
    pub fn from_buffer_at(
        buffer: wgpu::Buffer,
        offset: u64,
        dims: &[usize],
        dtype: DType,
    ) -> Result<Self> {
        Self::at(Arc::new(GpuBuffer::external(buffer)), offset, dims, dtype)
    }

    /// A tensor of `dims` at the start of `buffer`.
    pub(crate) fn on(buffer: Arc<GpuBuffer>, dims: &[usize], dtype: DType) -> Result<Self> {
        Self::at(buffer, 0, dims, dtype)
    }

    /// A tensor of `dims` at byte `offset` of `buffer`.
    pub(crate) fn at(
        buffer: Arc<GpuBuffer>,
        offset: u64,
        dims: &[usize],
        dtype: DType,
    ) -> Result<Self> {
        let shape = TensorShape::new(dims)?;
        if offset % TENSOR_ALIGN != 0 {
            return Err(XqError::Shape(format!(
                "offset {offset} is not a multiple of {TENSOR_ALIGN} bytes (WebGPU's storage \
                 binding alignment)"
            )));
        }
        let need = dense_bytes(shape.len(), dtype);
        if buffer.size() < offset + need {
            return Err(XqError::Shape(format!(
                "buffer of {} bytes is too small for {dims:?} {dtype:?} at offset {offset} \
                 ({need} bytes)",
                buffer.size()
            )));
        }
        if !buffer.usage().contains(wgpu::BufferUsages::STORAGE) {
            return Err(XqError::Config("buffer lacks STORAGE usage".into()));
        }
        Ok(GpuTensor {
            buffer,
            offset,
            shape,
            dtype,
        })
    }

    /// The binding of exactly this tensor's elements.
    pub(crate) fn bind(&self) -> Bind<'_> {
        Bind::section(&self.buffer, self.offset, self.byte_len())
    }

    /// Bytes allocated on the device (the whole buffer).
    pub fn allocated_bytes(&self) -> u64 {
        self.buffer.size()
    }
}

impl PackedCodes {
    /// Codes of `layout` at byte `offset` of `buffer` (a section of a page buffer).
    pub(crate) fn section(
        buffer: Arc<GpuBuffer>,
        offset: u64,
        layout: GroupLayout,
        shape: TensorShape,
    ) -> Self {
        PackedCodes {
            buffer,
            offset,
            layout,
            shape,
        }
    }

    /// The binding of exactly these codes.
    pub(crate) fn bind(&self) -> Bind<'_> {
        Bind::section(&self.buffer, self.offset, self.layout.code_bytes() as u64)
    }

    /// Where each code lives.
    pub fn layout(&self) -> &GroupLayout {
        &self.layout
    }

    /// Shape of the tensor these codes encode.
    pub fn shape(&self) -> &TensorShape {
        &self.shape
    }

    /// Bytes of the codes on the device (their section when they share a page buffer).
    pub fn allocated_bytes(&self) -> u64 {
        self.layout.code_bytes() as u64
    }

    /// The storage buffer of packed words (from byte [`PackedCodes::offset`]).
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }

    /// Byte offset of the codes in [`PackedCodes::buffer`].
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

impl GpuParams {
    /// Params of `layout` at byte `offset` of `buffer` (a section of a page buffer).
    pub(crate) fn section(
        buffer: Arc<GpuBuffer>,
        offset: u64,
        layout: GroupLayout,
        precision: ParamsPrecision,
    ) -> Self {
        GpuParams {
            buffer,
            offset,
            layout,
            precision,
        }
    }

    /// The binding of exactly these pairs.
    pub(crate) fn bind(&self) -> Bind<'_> {
        Bind::section(&self.buffer, self.offset, self.bytes())
    }

    /// Bytes of the pairs.
    pub(crate) fn bytes(&self) -> u64 {
        params_bytes(&self.layout, self.precision)
    }

    /// Geometry of the cells.
    pub fn layout(&self) -> &GroupLayout {
        &self.layout
    }

    /// Storage precision.
    pub fn precision(&self) -> ParamsPrecision {
        self.precision
    }

    /// Bytes of the pairs on the device (their section when they share a page buffer).
    pub fn allocated_bytes(&self) -> u64 {
        self.bytes()
    }
}

impl QuantizedTensor {
    /// Bytes allocated on the device (codes + params).
    pub fn allocated_bytes(&self) -> u64 {
        self.codes.allocated_bytes() + self.params.allocated_bytes()
    }
}

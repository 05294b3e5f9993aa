//! Kernel benchmark: quantize, dequantize and the fused reuse path against a same-run copy
//! kernel (the bandwidth roofline) and the CPU reference.

use crate::config::{DType, QuantSpec, TensorShape};
use crate::error::Result;
use crate::gpu::kernels::views::Block;
use crate::gpu::mirror::wgsl_struct;
use crate::gpu::pipelines::{Constants, Family, KernelKey, ELEMENT_WG};
use crate::gpu::{GpuContext, GpuTensor};

wgsl_struct! {
    /// Mirrors `Dims` in `wgsl/copy.wgsl`.
    pub(crate) struct CopyDims = Family::Copy, "Dims" {
        vec4s: u32,
        grid_x: u32,
        _pad0: u32,
        _pad1: u32,
    }
}

/// The kernels the benchmark times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchKernel {
    /// Copy of the input tensor (the roofline).
    Copy,
    /// `quantize_codes`.
    Quantize,
    /// `dequant_with_params` into a tensor of the input's dtype.
    Dequantize,
    /// Fused reuse fit: own params + residual codes from one read of the layer.
    ReuseFit,
    /// Reuse reconstruction: anchor codes + own params + residual.
    ReuseReconstruct,
}

impl BenchKernel {
    /// All kernels, roofline first.
    pub const ALL: [BenchKernel; 5] = [
        BenchKernel::Copy,
        BenchKernel::Quantize,
        BenchKernel::Dequantize,
        BenchKernel::ReuseFit,
        BenchKernel::ReuseReconstruct,
    ];

    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            BenchKernel::Copy => "copy (roofline)",
            BenchKernel::Quantize => "quantize",
            BenchKernel::Dequantize => "dequantize",
            BenchKernel::ReuseFit => "reuse fit (fused)",
            BenchKernel::ReuseReconstruct => "reuse reconstruct",
        }
    }
}

/// Timed submissions per kernel: the fastest gives the time, the median the ratio to copy.
const BENCH_REPEATS: usize = 5;

/// The median of `v` (the mean of the middle two for an even count; 0 when empty).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Records one call of a benchmarked kernel.
type Encode<'a> = Box<dyn Fn(&mut wgpu::CommandEncoder) -> Result<()> + 'a>;

/// Seconds per call and throughput, in GB/s of the tensor's bytes (its input dtype).
#[derive(Clone, Debug)]
pub struct KernelTiming {
    /// Which kernel.
    pub kernel: BenchKernel,
    /// Mean seconds per call (the best timed submission).
    pub seconds: f64,
    /// Tensor bytes one call processes.
    pub tensor_bytes: u64,
    /// Throughput as a fraction of the copy kernel's: the median over timed submissions of
    /// copy time / kernel time, each submission timed right after one of the copy (so a busy
    /// spell of a shared machine hits both). For the copy itself, copy against copy: how far
    /// this machine's noise moves a ratio (ideally 1). Unset on the CPU.
    pub vs_copy: f64,
}

impl KernelTiming {
    /// `tensor_bytes / seconds` in GB/s (1e9 bytes).
    pub fn gbps(&self) -> f64 {
        self.tensor_bytes as f64 / self.seconds / 1e9
    }
}

/// The benchmarked problem: a random-normal layer `x` and a next layer `y` of `dims`.
#[derive(Clone, Debug)]
pub struct BenchProblem {
    /// `[..., N, D]`.
    pub dims: Vec<usize>,
    /// dtype of the tensors and outputs.
    pub dtype: DType,
    /// Quantizer.
    pub spec: QuantSpec,
    /// Residual bits of the reuse path.
    pub residual_bits: u8,
}

impl BenchProblem {
    /// Shape, and the two layers' values rounded to `dtype`.
    fn data(&self) -> Result<(TensorShape, Vec<f32>, Vec<f32>)> {
        let shape = TensorShape::new(&self.dims)?;
        let layer = |seed| -> Vec<f32> {
            crate::synth::normal(shape.len(), seed)
                .iter()
                .map(|&v| self.dtype.round(v))
                .collect()
        };
        let (x, y) = (layer(7), layer(8));
        Ok((shape, x, y))
    }

    fn tensor_bytes(&self, shape: &TensorShape) -> u64 {
        (shape.len() * self.dtype.size()) as u64
    }
}

impl GpuContext {
    fn encode_copy(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        src: &GpuTensor,
        dst: &wgpu::Buffer,
    ) -> Result<()> {
        let vec4s = (src.buffer.size() / 16) as usize;
        let grid = self.grid(vec4s, ELEMENT_WG)?;
        let key = KernelKey::new("copy", Constants::Copy);
        let dims = CopyDims {
            vec4s: vec4s as u32,
            grid_x: grid.x,
            ..Default::default()
        };
        self.dispatch(
            encoder,
            &key,
            &dims,
            &[(1, src.bind()), (2, dst.into())],
            grid,
        );
        Ok(())
    }

    /// Seconds per call of `encode`: `iters` calls recorded into one submission and timed
    /// to completion; the best of [`BENCH_REPEATS`] such submissions, after one warm-up
    /// submission (which also compiles the pipeline).
    fn time_encoded(
        &self,
        iters: usize,
        encode: &dyn Fn(&mut wgpu::CommandEncoder) -> Result<()>,
    ) -> Result<f64> {
        let start = std::time::Instant::now();
        pollster::block_on(self.run("bench", |enc| (0..iters).try_for_each(|_| encode(enc))))?;
        self.wait_idle()?;
        Ok(start.elapsed().as_secs_f64() / iters as f64)
    }

    /// Best seconds per call of `encode` and the median of copy / kernel over
    /// [`BENCH_REPEATS`] rounds, each timing `iters` copies then `iters` calls, after a
    /// warm-up submission (which also compiles the pipelines).
    fn time_against_copy(
        &self,
        iters: usize,
        copy: &dyn Fn(&mut wgpu::CommandEncoder) -> Result<()>,
        encode: &dyn Fn(&mut wgpu::CommandEncoder) -> Result<()>,
    ) -> Result<(f64, f64)> {
        pollster::block_on(self.run("bench warm-up", |enc| {
            copy(enc)?;
            encode(enc)
        }))?;
        self.wait_idle()?;
        let (mut best, mut ratios) = (f64::INFINITY, Vec::new());
        for _ in 0..BENCH_REPEATS {
            let c = self.time_encoded(iters, copy)?;
            let k = self.time_encoded(iters, encode)?;
            best = best.min(k);
            ratios.push(c / k);
        }
        Ok((best, median(ratios)))
    }

    /// Times every [`BenchKernel`] on the GPU.
    pub fn bench_kernels(&self, problem: &BenchProblem, iters: usize) -> Result<Vec<KernelTiming>> {
        let (shape, xs, ys) = problem.data()?;
        let (dims, dtype, spec, residual_bits) = (
            &problem.dims,
            problem.dtype,
            &problem.spec,
            problem.residual_bits,
        );
        let x = self.upload(&xs, dims, dtype, spec.params)?;
        let y = self.upload(&ys, dims, dtype, spec.params)?;
        let anchor = pollster::block_on(self.quantize(&x, spec))?;
        let reuse =
            pollster::block_on(self.reuse_fit(&y, &anchor.codes, spec, residual_bits, dtype))?;
        let out = self.empty_tensor(&shape, dtype)?;
        // Outputs are written into buffers allocated once, outside the timing.
        let scratch = pollster::block_on(self.quantize(&x, spec))?;
        let whole = Block::whole(*anchor.codes.layout());
        let tensor_bytes = problem.tensor_bytes(&shape);
        let copy = |enc: &mut wgpu::CommandEncoder| self.encode_copy(enc, &x, &out.buffer);
        let mut timings = Vec::new();
        for kernel in BenchKernel::ALL {
            let encode: Encode = match kernel {
                BenchKernel::Copy => Box::new(copy),
                BenchKernel::Quantize => Box::new(|enc| {
                    self.encode_quantize_block(
                        enc,
                        &x.view(),
                        &whole,
                        spec,
                        &scratch.codes,
                        &scratch.params,
                    )
                }),
                BenchKernel::Dequantize => Box::new(|enc| {
                    self.encode_dequant_into(enc, &anchor.codes, &anchor.params, &out)
                }),
                BenchKernel::ReuseFit => Box::new(|enc| {
                    let res = reuse.residual.as_ref();
                    self.encode_reuse_fit_block(
                        enc,
                        &y.view(),
                        &whole,
                        spec,
                        &anchor.codes,
                        &scratch.params,
                        res,
                        dtype,
                    )
                }),
                BenchKernel::ReuseReconstruct => Box::new(|enc| {
                    self.encode_reuse_reconstruct_into(enc, &anchor.codes, &reuse, &out)
                }),
            };
            let (seconds, vs_copy) = self.time_against_copy(iters, &copy, &*encode)?;
            timings.push(KernelTiming {
                kernel,
                seconds,
                tensor_bytes,
                vs_copy,
            });
        }
        Ok(timings)
    }
}

/// Times the CPU reference on the same problem as [`GpuContext::bench_kernels`]
/// (single-threaded; the copy row is a plain `memcpy` of the tensor).
pub fn bench_cpu_reference(problem: &BenchProblem, iters: usize) -> Result<Vec<KernelTiming>> {
    use crate::reference as r;
    let (shape, x, y) = problem.data()?;
    let (dtype, spec, residual_bits) = (problem.dtype, &problem.spec, problem.residual_bits);
    let (codes, params) = r::quantize_codes_batched(&x, &shape, spec)?;
    let reuse = r::reuse_encode(&y, &shape, &codes, spec, residual_bits, dtype)?;
    let tensor_bytes = problem.tensor_bytes(&shape);
    let mut timings = Vec::new();
    for kernel in BenchKernel::ALL {
        let start = std::time::Instant::now();
        for _ in 0..iters.max(1) {
            match kernel {
                BenchKernel::Copy => {
                    std::hint::black_box(x.clone());
                }
                BenchKernel::Quantize => {
                    std::hint::black_box(r::quantize_codes_batched(&x, &shape, spec)?);
                }
                BenchKernel::Dequantize => {
                    std::hint::black_box(r::dequant_with_params_batched(&codes, &params, dtype)?);
                }
                BenchKernel::ReuseFit => {
                    std::hint::black_box(r::reuse_encode(
                        &y,
                        &shape,
                        &codes,
                        spec,
                        residual_bits,
                        dtype,
                    )?);
                }
                BenchKernel::ReuseReconstruct => {
                    std::hint::black_box(r::reuse_reconstruct(&codes, &reuse, dtype)?);
                }
            }
        }
        timings.push(KernelTiming {
            kernel,
            seconds: start.elapsed().as_secs_f64() / iters.max(1) as f64,
            tensor_bytes,
            vs_copy: f64::NAN,
        });
    }
    Ok(timings)
}

//! Host of `wgsl/rotate.wgsl`: the randomized Walsh–Hadamard rotation of head vectors (a
//! rotated cache's keys and values as they enter it, and fetched K/V as they leave it; its
//! queries and outputs are rotated inside the attention kernels).

use std::sync::Arc;

use crate::config::{DType, Levels, ParamsPrecision};
use crate::error::{shape_err, Result};
use crate::gpu::dispatch::Bind;
use crate::gpu::kernels::group_quant::level_slots;
use crate::gpu::kernels::materialize::{channel_words, Encoded, OutView, Source};
use crate::gpu::kernels::views::{Block, TokenView};
use crate::gpu::kernels::window::RingTarget;
use crate::gpu::mirror::wgsl_struct;
use crate::gpu::pipelines::{Constants, Family, KernelKey, RotateConstants};
use crate::gpu::{GpuBuffer, GpuContext, GpuTensor, TENSOR_ALIGN};
use crate::layout::GroupLayout;
use crate::reference::{check_rotation_dim, rotation_stream, RotationTarget};

wgsl_struct! {
    /// Mirrors `Dims` in `wgsl/rotate.wgsl`.
    pub(crate) struct RotateDims = Family::Rotate, "Dims" {
        vectors: u32,
        dim: u32,
        head_div: u32,
        heads: u32,
        gqa: u32,
        stream: u32,
        rot_seed: u32,
        grid_x: u32,
        split: u32,
        stream2: u32,
        y2: u32,
        ring_tokens: u32,
        ring_t0: u32,
        dense_tokens: u32,
        dense_t0: u32,
        other: u32,
        page_t0: u32,
        sinks: u32,
        sink_slots: u32,
        sink_word: u32,
        levels: [[f32; 4]; 4],
    }
}

/// The rotation of K/V written into a window ring as they enter a rotated cache (a decode
/// step's tokens, which land in the ring or the sinks): one launch rotates and writes them,
/// where a rotation into scratch and a copy into the ring would be two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RingRotation {
    pub seed: u32,
    /// The sign streams' high bits (`rotation_stream(layer, kind, 0)`); row r's stream
    /// adds its KV head, `r % heads`.
    pub stream: u32,
    pub heads: usize,
}

/// Checks `target` and that `tensors` hold its vectors.
fn check(target: &RotationTarget, tensors: &[&GpuTensor]) -> Result<()> {
    check_rotation_dim(target.dim)?;
    let elements = target.vectors() * target.dim;
    for t in tensors {
        if t.shape().len() != elements {
            return shape_err!(
                "rotation of {} vectors of {}: a tensor holds {} elements",
                target.vectors(),
                target.dim,
                t.shape().len()
            );
        }
    }
    if target.gqa == 0 || target.heads % target.gqa != 0 || 2 * elements > u32::MAX as usize {
        return shape_err!(
            "rotation: {} heads in groups of {} over {elements} elements",
            target.heads,
            target.gqa
        );
    }
    Ok(())
}

/// One launch of `rotate_vectors`: every vector of `x` (laid out as `target` says) into
/// `out`, or `out` in place when `x` is `None`; `inverse` undoes the rotation; `round_in`
/// rounds f32 inputs to f16 before rotating them (K/V entering a cache: the cache rotates
/// what it holds, whichever route a token takes in).
pub(crate) struct RotateLaunch<'a> {
    pub x: Option<&'a GpuTensor>,
    pub out: &'a GpuTensor,
    pub target: &'a RotationTarget,
    pub seed: u32,
    pub inverse: bool,
    pub round_in: bool,
}

impl GpuContext {
    /// The pipeline key of a rotation launch with `constants`, at this context's
    /// rotation width ([`GpuContext::rotate_workgroup_size`]) and for vectors of `dim`
    /// elements where the shader holds them in registers ([`held_dim`]).
    fn rotate_key(&self, constants: RotateConstants, dim: usize) -> KernelKey {
        let wg = self.rotate_workgroup_size();
        let held = held_dim(dim);
        KernelKey::new(
            if held > 0 {
                "rotate_held"
            } else {
                "rotate_vectors"
            },
            Constants::Rotate(RotateConstants {
                wg,
                dim: held,
                ..constants
            }),
        )
    }

    fn rotate_dims(&self, target: &RotationTarget, vectors: usize, seed: u32) -> RotateDims {
        RotateDims {
            vectors: vectors as u32,
            dim: target.dim as u32,
            head_div: if target.token_major {
                1
            } else {
                target.tokens as u32
            },
            heads: target.heads as u32,
            gqa: target.gqa as u32,
            stream: rotation_stream(target.layer, target.kind, 0),
            rot_seed: seed,
            split: vectors as u32,
            ..Default::default()
        }
    }

    /// Records the rotation of every vector of `x` (laid out as `target` says) into `out`
    /// (the same vectors, f32 or f16 each), or of `out` in place when `x` is `None`;
    /// `inverse` undoes it ([`crate::reference::rotate_tensor`] on the CPU).
    pub fn encode_rotate(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        x: Option<&GpuTensor>,
        out: &GpuTensor,
        target: &RotationTarget,
        seed: u32,
        inverse: bool,
    ) -> Result<()> {
        let launch = RotateLaunch {
            x,
            out,
            target,
            seed,
            inverse,
            round_in: false,
        };
        self.encode_rotate_launch(encoder, &launch)
    }

    /// Records one launch of `rotate_vectors` ([`GpuContext::encode_rotate`], or with
    /// `round_in` for K/V entering a cache).
    pub(crate) fn encode_rotate_launch(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        launch: &RotateLaunch,
    ) -> Result<()> {
        let &RotateLaunch {
            x,
            out,
            target,
            seed,
            inverse,
            round_in,
        } = launch;
        check(target, &[x.unwrap_or(out), out])?;
        let constants = RotateConstants {
            in_f16: x.is_some_and(|x| x.dtype() == DType::F16),
            out_f16: out.dtype() == DType::F16,
            in_place: x.is_none(),
            inverse,
            round_in: round_in && x.is_some_and(|x| x.dtype() == DType::F32),
            ..Default::default()
        };
        let dims = self.rotate_dims(target, target.vectors(), seed);
        let mut buffers = vec![(2, out.bind())];
        if let Some(x) = x {
            buffers.push((1, x.bind()));
        }
        self.dispatch_rotation(encoder, constants, dims, &buffers)
    }

    /// Records, in one launch, the rotation of two tensors of the same shape and dtype (an
    /// append's keys and values, each with its own signs: `targets`) into f32 tensors in
    /// `out` (the first at byte 0, the second at the next 256-byte boundary); returns them.
    /// K/V entering a cache: f32 values are rounded to f16 before they are rotated.
    pub(crate) fn encode_rotate_pair(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        inputs: [&GpuTensor; 2],
        targets: [&RotationTarget; 2],
        out: &Arc<GpuBuffer>,
        seed: u32,
    ) -> Result<[GpuTensor; 2]> {
        let [a, b] = targets;
        let same = (a.vectors(), a.dim, a.heads, a.tokens, a.token_major, a.gqa)
            == (b.vectors(), b.dim, b.heads, b.tokens, b.token_major, b.gqa);
        if !same || inputs[0].dtype() != inputs[1].dtype() {
            return shape_err!("a paired rotation needs two tensors of one shape and dtype");
        }
        check(a, &inputs)?;
        let elements = a.vectors() * a.dim;
        let stride = ((elements * 4) as u64).div_ceil(TENSOR_ALIGN) * TENSOR_ALIGN;
        let dims_of = inputs[0].shape().dims();
        let outs = [
            GpuTensor::at(out.clone(), 0, dims_of, DType::F32)?,
            GpuTensor::at(out.clone(), stride, dims_of, DType::F32)?,
        ];
        let constants = RotateConstants {
            in_f16: inputs[0].dtype() == DType::F16,
            round_in: inputs[0].dtype() == DType::F32,
            pair: true,
            ..Default::default()
        };
        let dims = RotateDims {
            split: a.vectors() as u32,
            stream2: rotation_stream(b.layer, b.kind, 0),
            y2: (stride / 4) as u32,
            ..self.rotate_dims(a, 2 * a.vectors(), seed)
        };
        let y = Bind::section(out, 0, stride + (elements * 4) as u64);
        let buffers = [(1, inputs[0].bind()), (2, y), (3, inputs[1].bind())];
        self.dispatch_rotation(encoder, constants, dims, &buffers)?;
        Ok(outs)
    }

    /// Records, in one launch of `rotate_vectors`, the rotation of tokens `[x.t0, x.t0 + n)`
    /// of every row of `x` (un-rotated K/V, heads-major) into the f16 slots of `ring`, with
    /// the ring's `rotation`: the window append of a rotated cache (f32 values rounded to f16
    /// before they are rotated). Two tensors (`PAIR`: an append's keys and values, of one
    /// shape: the caller has checked that they agree in everything but their buffers and
    /// signs) go into their rings in the same launch, the first copied as it is where its
    /// ring has no rotation.
    pub(crate) fn encode_rotate_into_ring(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        tensors: &[(&TokenView, &RingTarget)],
        n: usize,
    ) -> Result<()> {
        let (x, ring) = tensors[0];
        let first_rotation = ring.rotation.as_ref();
        let Some(rotation) = tensors[tensors.len() - 1].1.rotation.as_ref() else {
            return shape_err!("ring rotation: the last ring has no rotation");
        };
        let pair = tensors.len() == 2;
        let constants = RotateConstants {
            in_f16: x.dtype == DType::F16,
            out_f16: true,
            to_ring: true,
            round_in: x.dtype == DType::F32,
            pair,
            plain_first: pair && first_rotation.is_none(),
            ..Default::default()
        };
        let rows = ring_rows_dims((ring.rows, ring.dim, n), rotation, (x.tokens, x.t0))?;
        let dims = RotateDims {
            vectors: tensors.len() as u32 * rows.vectors,
            stream: first_rotation.unwrap_or(rotation).stream,
            stream2: rotation.stream,
            ring_tokens: ring.tokens as u32,
            ring_t0: ring.t0 as u32,
            ..rows
        };
        let mut buffers = vec![(1, x.buffer), (2, ring.buffer)];
        if let [_, (x2, ring2)] = tensors {
            buffers.extend([(3, x2.buffer), (4, ring2.buffer)]);
        }
        self.dispatch_rotation(encoder, constants, dims, &buffers)
    }

    /// Records, in one launch of `rotate_held`, the inverse rotation of a ring source (each
    /// row's tokens `[t0, t0 + n)` of a rotated cache's f16 ring, token t in slot t %
    /// ring_tokens) into tokens `[out.t0, out.t0 + n)` of the dense `out`, and its buffer's
    /// sinks into tokens `[0, sinks.n)`: a fetch of its window and sinks (or of the sinks
    /// alone, as a ring of their own), rotated back as it is read. For a D that [`unrotates`].
    pub(crate) fn encode_unrotate_ring(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        source: &Source<'_>,
        out: &OutView<'_>,
        rotation: &RingRotation,
    ) -> Result<()> {
        let &Source::Ring {
            ring,
            ring_tokens,
            t0,
            n,
            sinks,
        } = source
        else {
            return shape_err!("un-rotation of a ring: the source is a block of codes");
        };
        if !unrotates(out.dim) {
            return shape_err!("un-rotation of a ring: no held path for D = {}", out.dim);
        }
        let constants = RotateConstants {
            in_f16: true,
            out_f16: out.dtype == DType::F16,
            inverse: true,
            from_ring: true,
            ..Default::default()
        };
        let dims = ring_rows_dims((out.rows, out.dim, n), rotation, (out.tokens, out.t0))?;
        let dims = RotateDims {
            // The sinks' vectors follow the window's (from `split`).
            vectors: dims.vectors + (out.rows * sinks.n) as u32,
            ring_tokens: ring_tokens as u32,
            ring_t0: t0 as u32,
            sinks: sinks.n as u32,
            sink_slots: sinks.slots as u32,
            sink_word: sinks.word as u32,
            ..dims
        };
        self.dispatch_rotation(encoder, constants, dims, &[(1, ring), (2, out.buffer)])
    }

    /// Records, in one launch of `rotate_held`, the decoding and inverse rotation of a
    /// rotated cache's block of Lloyd–Max codes grouped along D into tokens `[out.t0,
    /// out.t0 + n)` of the dense `out`: the values rotated back in f32 and rounded once to
    /// the output. For a block that [`unrotates_levels`].
    pub(crate) fn encode_unrotate_levels(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        block: &Block,
        encoded: &Encoded<'_>,
        out: &OutView<'_>,
        rotation: &RingRotation,
    ) -> Result<()> {
        let l = &block.page;
        if !unrotates_levels(l, encoded.residual.is_some()) || l.dim != out.dim {
            return shape_err!("un-rotation of codes: no held path for {l:?}");
        }
        let constants = RotateConstants {
            out_f16: out.dtype == DType::F16,
            inverse: true,
            from_levels: true,
            bits: l.bits,
            group: l.group_size as u32,
            params_f32: encoded.params.precision == ParamsPrecision::F32,
            ..Default::default()
        };
        let dims = RotateDims {
            other: l.other() as u32,
            page_t0: block.t0 as u32,
            levels: level_slots(l),
            ..ring_rows_dims((out.rows, out.dim, block.n), rotation, (out.tokens, out.t0))?
        };
        let buffers = [
            (1, encoded.codes.bind()),
            (2, out.buffer),
            (3, encoded.params.bind()),
        ];
        self.dispatch_rotation(encoder, constants, dims, &buffers)
    }

    /// Records one rotation launch: the pipeline of `constants` for D = `dims.dim`, a
    /// thread per vector.
    fn dispatch_rotation(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        constants: RotateConstants,
        mut dims: RotateDims,
        buffers: &[(u32, Bind<'_>)],
    ) -> Result<()> {
        let key = self.rotate_key(constants, dims.dim as usize);
        let grid = self.grid(dims.vectors as usize, key.workgroup_size())?;
        dims.grid_x = grid.x;
        self.dispatch(encoder, &key, &dims, buffers, grid);
        Ok(())
    }
}

/// The dims of a rotation of tokens `[t0, t0 + n)` of every row of `rows` x D (`(rows, dim,
/// n)`), vector k token k % n of row k / n, with `rotation`'s signs, into or out of a dense
/// tensor of `dense` (its tokens a row, and its token of each row's first vector): a window
/// append into a ring, or a fetch out of one or out of a page's codes.
fn ring_rows_dims(
    (rows, dim, n): (usize, usize, usize),
    rotation: &RingRotation,
    (dense_tokens, dense_t0): (usize, usize),
) -> Result<RotateDims> {
    check_rotation_dim(dim)?;
    if rotation.heads == 0 || rows % rotation.heads != 0 || n == 0 {
        return shape_err!(
            "ring rotation: {rows} rows of {} heads, {n} tokens",
            rotation.heads
        );
    }
    Ok(RotateDims {
        vectors: (rows * n) as u32,
        dim: dim as u32,
        head_div: n as u32,
        heads: rotation.heads as u32,
        gqa: 1,
        stream: rotation.stream,
        rot_seed: rotation.seed,
        split: (rows * n) as u32,
        dense_tokens: dense_tokens as u32,
        dense_t0: dense_t0 as u32,
        ..Default::default()
    })
}

/// The largest D `rotate_held` holds in registers (`HELD_DIM` of `wgsl/rotate.wgsl`).
pub(crate) const HELD_ROTATION_DIM: usize = 64;

/// The `DIM` a rotation of vectors of `dim` elements is built for: `dim` where the shader
/// holds such a vector in registers (`rotate_held`: a power of two from 8 to
/// [`HELD_ROTATION_DIM`], its walks written out with constant indices and its elements moved
/// 8 at a time), else 0 (`rotate_vectors`, any D: an array that llvmpipe keeps in memory and
/// reads lane by lane).
fn held_dim(dim: usize) -> u32 {
    if dim.is_power_of_two() && (8..=HELD_ROTATION_DIM).contains(&dim) {
        dim as u32
    } else {
        0
    }
}

/// Whether a rotated cache's f16 tokens of D = `dim` are fetched rotated back as they are
/// read (`rotate_held` holds such a vector).
pub(crate) fn unrotates(dim: usize) -> bool {
    held_dim(dim) != 0
}

/// Whether codes laid out by `l` (with a residual: `residual`) are fetched decoded and
/// rotated back in one launch: Lloyd–Max codes grouped along D, of 1, 2 or 4 bits, in
/// groups that start a word and tile a D that [`unrotates`], on pages of a multiple of 8
/// tokens (the codes and norms then fill whole 16-byte vectors, which the shader reads them
/// as; a page of such groups always is one: its tokens are a multiple of the group).
pub(crate) fn unrotates_levels(l: &GroupLayout, residual: bool) -> bool {
    unrotates(l.dim)
        && channel_words(l)
        && l.levels == Levels::LloydMax
        && !residual
        && l.other() % 8 == 0
}

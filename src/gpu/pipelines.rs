//! Shader sources and the per-device pipeline cache, keyed by (kernel, override constants).
//! Every `.wgsl` file is loaded here and only here; specialisation is done with WGSL
//! `override` constants, never by editing shader text (natively they are applied to the
//! parsed module before the driver sees it: `gpu/specialise.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::gpu::word_hash::WordHashMap;

/// Invocations per workgroup of the per-group kernels (one invocation walks a whole group).
pub const GROUP_WG: u32 = 64;
/// Invocations per workgroup of element-wise and reduction kernels (the browsers' maximum).
pub const ELEMENT_WG: u32 = 256;
/// Invocations per workgroup of the attention kernels (a chunk's runs of tokens, or its
/// blocks of channels) on a GPU.
pub const ATTENTION_WG: u32 = 32;
/// The same on a CPU rasterizer (lavapipe, SwiftShader), which runs a workgroup's SIMD
/// groups one after another on one core, each with its own stack frame: 8 invocations
/// (one or two SIMD groups) made a decode step's attention 15-20% faster there than 32 for
/// both caches (SwiftShader 256 tokens: the default's 19.5 -> 15.5 ms, the f16 cache's 15.5
/// -> 14.2; lavapipe 16K: 120 -> 101-106 ms and about 160 for the f16 cache either way).
pub const ATTENTION_WG_CPU: u32 = 8;
/// Invocations per workgroup of the rotation on a CPU rasterizer (the attention's narrow
/// workgroups, `AttentionWorkgroup`): one SIMD group, where a decode step's few vectors (one
/// invocation each) left 7 of a 64-invocation workgroup's 8 idle and the rotation ~20% slower.
pub const ROTATE_WG_CPU: u32 = 8;

/// Consecutive output elements per materialize invocation (even: f16 words are not shared).
pub const DEQUANT_RUN: u32 = 8;

/// Weights of one row the llama `matmul` holds in workgroup memory (`TILE_K`, f32): rows up
/// to this wide take `matmul`, wider ones `matmul_tiles` (the same, a tile at a time).
pub const MATMUL_TILE_K: u32 = 2048;

/// A WGSL file: one family of kernels sharing helpers and override constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// `wgsl/group_quant.wgsl`: quantize, fit_params, quantize_residual, reuse_fit.
    GroupQuant,
    /// `wgsl/materialize.wgsl`: materialize (dequant, dequant + residual, window tokens).
    Materialize,
    /// `wgsl/window.wgsl`: append (tokens into the f16 window ring).
    Window,
    /// `wgsl/transpose.wgsl`: tokens_to_heads (a runtime's token-major inputs).
    Transpose,
    /// `wgsl/rotate.wgsl`: rotate_vectors (the randomized Hadamard rotation of head vectors).
    Rotate,
    /// `wgsl/similarity.wgsl`: pair_partials, finish.
    Similarity,
    /// `wgsl/llama.wgsl`: the model's forward pass (embed, rmsnorm, matmul, rope, gated).
    Llama,
    /// `wgsl/attention.wgsl`: attend_block (and its variants by key and value phase:
    /// attend_block_token_values, attend_block_token_keys*, attend_block_runs*), attend_ring,
    /// combine (split-K attention over a cache's K/V).
    Attention,
    /// `wgsl/copy.wgsl`: copy (the benchmark roofline; native benchmarks only).
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    Copy,
}

impl Family {
    /// The WGSL text of the family.
    pub(crate) fn source(self) -> &'static str {
        match self {
            Family::GroupQuant => include_str!("../../wgsl/group_quant.wgsl"),
            Family::Materialize => include_str!("../../wgsl/materialize.wgsl"),
            Family::Window => include_str!("../../wgsl/window.wgsl"),
            Family::Transpose => include_str!("../../wgsl/transpose.wgsl"),
            Family::Rotate => include_str!("../../wgsl/rotate.wgsl"),
            Family::Llama => include_str!("../../wgsl/llama.wgsl"),
            Family::Similarity => include_str!("../../wgsl/similarity.wgsl"),
            Family::Copy => include_str!("../../wgsl/copy.wgsl"),
            Family::Attention => include_str!("../../wgsl/attention.wgsl"),
        }
    }

    /// The bindings of the family's bind group 0 and how WGSL declares them. The entry points
    /// of a family share one explicit layout (what an entry point does not read is bound to a
    /// placeholder), so a bind group fits every kernel of its family, and the dims (binding
    /// 0) sit at a dynamic offset of a shared uniform buffer, so a bind group can be reused
    /// from launch to launch (`gpu::dispatch`). The attention family is two layouts, as its
    /// nine storage bindings exceed WebGPU's default of eight per stage: the kernels that
    /// read the cache (`attend_*`, which write at binding 6) and `combine` (6 and 7).
    pub(crate) fn bindings(self, entry: &str) -> &'static [(u32, Access)] {
        use Access::{Read as R, Uniform as U, Write as W};
        match self {
            Family::GroupQuant => &[
                (0, U),
                (1, R),
                (2, R),
                (3, R),
                (4, W),
                (5, W),
                (6, W),
                (7, W),
            ],
            Family::Materialize => &[(0, U), (1, R), (2, R), (3, R), (4, R), (5, W), (6, R)],
            Family::Transpose | Family::Copy => &[(0, U), (1, R), (2, W)],
            Family::Window => &[(0, U), (1, R), (2, W), (3, R), (4, W)],
            Family::Rotate => &[(0, U), (1, R), (2, W), (3, R), (4, W)],
            Family::Similarity => &[(0, U), (1, R), (2, R), (3, R), (4, W), (5, W), (6, R)],
            Family::Llama => &[
                (0, U),
                (1, R),
                (2, R),
                (3, W),
                (4, R),
                (5, R),
                (6, R),
                (7, R),
            ],
            Family::Attention if entry == "combine" => &[(0, U), (6, W), (7, W)],
            Family::Attention => &[
                (0, U),
                (1, R),
                (2, R),
                (3, R),
                (4, R),
                (5, R),
                (6, W),
                (8, R),
                (9, R),
            ],
        }
    }

    /// Bind group layout entries of `bindings`.
    fn layout_entries(bindings: &[(u32, Access)]) -> Vec<wgpu::BindGroupLayoutEntry> {
        let buffer = |ty, has_dynamic_offset| wgpu::BindingType::Buffer {
            ty,
            has_dynamic_offset,
            min_binding_size: None,
        };
        bindings
            .iter()
            .map(|&(binding, access)| wgpu::BindGroupLayoutEntry {
                binding,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: match access {
                    Access::Uniform => buffer(wgpu::BufferBindingType::Uniform, true),
                    Access::Read => {
                        buffer(wgpu::BufferBindingType::Storage { read_only: true }, false)
                    }
                    Access::Write => {
                        buffer(wgpu::BufferBindingType::Storage { read_only: false }, false)
                    }
                },
                count: None,
            })
            .collect()
    }

    fn workgroup_size(self) -> u32 {
        match self {
            Family::GroupQuant | Family::Llama | Family::Rotate => GROUP_WG,
            Family::Attention => ATTENTION_WG,
            Family::Materialize
            | Family::Window
            | Family::Transpose
            | Family::Similarity
            | Family::Copy => ELEMENT_WG,
        }
    }
}

/// How a kernel binding is declared in WGSL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Access {
    /// `var<uniform>`: the launch's dims (binding 0).
    Uniform,
    /// `var<storage, read>`.
    Read,
    /// `var<storage, read_write>`.
    Write,
}

/// The value of one `override` constant, typed as the shader declares it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ConstValue {
    Bool(bool),
    U32(u32),
}

impl ConstValue {
    fn as_f64(self) -> f64 {
        match self {
            ConstValue::Bool(b) => f64::from(u8::from(b)),
            ConstValue::U32(v) => f64::from(v),
        }
    }
}

/// The `override` constants of one kernel: one type per WGSL family, so a kernel can only be
/// given its own family's constants (their hosts live in `gpu/kernels/`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Constants {
    GroupQuant(GroupQuantConstants),
    Materialize(MaterializeConstants),
    Window(WindowConstants),
    Transpose(TransposeConstants),
    Rotate(RotateConstants),
    Similarity(SimilarityConstants),
    Llama(LlamaConstants),
    Attention(AttentionConstants),
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    Copy,
}

impl Constants {
    /// The WGSL file these constants belong to.
    pub fn family(&self) -> Family {
        match self {
            Constants::GroupQuant(_) => Family::GroupQuant,
            Constants::Materialize(_) => Family::Materialize,
            Constants::Window(_) => Family::Window,
            Constants::Transpose(_) => Family::Transpose,
            Constants::Rotate(_) => Family::Rotate,
            Constants::Similarity(_) => Family::Similarity,
            Constants::Llama(_) => Family::Llama,
            Constants::Attention(_) => Family::Attention,
            Constants::Copy => Family::Copy,
        }
    }

    /// Invocations per workgroup: the family's, or an attention kernel's own.
    pub fn workgroup_size(&self) -> u32 {
        match self {
            Constants::Attention(a) if a.wg > 0 => a.wg,
            Constants::Rotate(r) if r.wg > 0 => r.wg,
            _ => self.family().workgroup_size(),
        }
    }

    /// Every constant the pipeline sets, by its WGSL name (`WG` included).
    pub fn values(&self) -> Vec<(&'static str, ConstValue)> {
        let mut c = vec![("WG", ConstValue::U32(self.workgroup_size()))];
        match self {
            Constants::GroupQuant(g) => c.extend(g.values()),
            Constants::Materialize(m) => c.extend(m.values()),
            Constants::Window(w) => c.extend(w.values()),
            Constants::Transpose(t) => c.extend(t.values()),
            Constants::Rotate(r) => c.extend(r.values()),
            Constants::Similarity(s) => c.extend(s.values()),
            Constants::Llama(l) => c.extend(l.values()),
            Constants::Attention(a) => c.extend(a.values()),
            Constants::Copy => {}
        }
        c
    }

    /// [`Self::values`] as a pipeline's override values (booleans as 0 and 1).
    pub fn overrides(&self) -> Vec<(&'static str, f64)> {
        self.values()
            .into_iter()
            .map(|(name, v)| (name, v.as_f64()))
            .collect()
    }
}

/// Boolean and integer constants as [`ConstValue`]s.
macro_rules! consts {
    ($($name:literal => $kind:ident($value:expr)),* $(,)?) => {
        vec![$(($name, ConstValue::$kind($value))),*]
    };
}

/// Constants of `wgsl/group_quant.wgsl`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GroupQuantConstants {
    /// `BITS`: code width.
    pub bits: u8,
    /// `RES_BITS`: residual code width (unused without a residual).
    pub res_bits: u8,
    /// `GROUP`: members per quantization group.
    pub group: u32,
    /// `IN_F16`: `x` holds halves.
    pub in_f16: bool,
    /// `X_TO_F16`: f32 `x` values are rounded to f16 on load.
    pub x_to_f16: bool,
    /// `RECON_F16`: `recon` holds halves.
    pub recon_f16: bool,
    /// `ROUND_F16`: intermediate reconstructions are rounded to f16.
    pub round_f16: bool,
    /// `PARAMS_F32`: params as f32 pairs.
    pub params_f32: bool,
    /// `AXIS_CHANNELS`: groups run along channels.
    pub axis_channels: bool,
}

impl GroupQuantConstants {
    fn values(&self) -> Vec<(&'static str, ConstValue)> {
        consts![
            "BITS" => U32(u32::from(self.bits)),
            "RES_BITS" => U32(u32::from(self.res_bits.max(1))),
            "GROUP" => U32(self.group),
            "IN_F16" => Bool(self.in_f16),
            "X_TO_F16" => Bool(self.x_to_f16),
            "RECON_F16" => Bool(self.recon_f16),
            "ROUND_F16" => Bool(self.round_f16),
            "PARAMS_F32" => Bool(self.params_f32),
            "AXIS_CHANNELS" => Bool(self.axis_channels),
        ]
    }
}

/// What the `materialize` kernel writes into its output (`KIND`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum MaterializeKind {
    /// `codes · scale + zero`.
    #[default]
    Dequant = 0,
    /// A reuse layer: dequant of the anchor's codes with own params, plus the residual.
    DequantResidual = 1,
    /// Full-precision window tokens from the f16 ring.
    Window = 2,
}

/// Constants of `wgsl/materialize.wgsl`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MaterializeConstants {
    /// `KIND`.
    pub kind: MaterializeKind,
    /// `BITS`, `RES_BITS`, `GROUP`: the codes' geometry.
    pub bits: u8,
    pub res_bits: u8,
    pub group: u32,
    /// `OUT_F16`: the output holds halves.
    pub out_f16: bool,
    /// `PARAMS_F32`: params as f32 pairs.
    pub params_f32: bool,
    /// `AXIS_CHANNELS`: groups run along channels.
    pub axis_channels: bool,
    /// `LEVELS`: codes index Lloyd–Max levels (params: a norm per cell).
    pub levels: bool,
}

impl MaterializeConstants {
    fn values(&self) -> Vec<(&'static str, ConstValue)> {
        consts![
            "RUN" => U32(DEQUANT_RUN),
            "KIND" => U32(self.kind as u32),
            "BITS" => U32(u32::from(self.bits.max(1))),
            "RES_BITS" => U32(u32::from(self.res_bits.max(1))),
            "GROUP" => U32(self.group.max(1)),
            "OUT_F16" => Bool(self.out_f16),
            "PARAMS_F32" => Bool(self.params_f32),
            "AXIS_CHANNELS" => Bool(self.axis_channels),
            "LEVELS" => Bool(self.levels),
        ]
    }
}

/// Constants of `wgsl/window.wgsl`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct WindowConstants {
    /// `IN_F16`: the appended tokens are halves.
    pub in_f16: bool,
    /// `PAIR`: a second tensor into a second ring in the same launch (keys and values).
    pub pair: bool,
}

impl WindowConstants {
    fn values(&self) -> Vec<(&'static str, ConstValue)> {
        consts!["IN_F16" => Bool(self.in_f16), "PAIR" => Bool(self.pair)]
    }
}

/// Constants of `wgsl/transpose.wgsl`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TransposeConstants {
    /// `F16`: the tensor holds halves.
    pub f16: bool,
}

impl TransposeConstants {
    fn values(&self) -> Vec<(&'static str, ConstValue)> {
        consts!["F16" => Bool(self.f16)]
    }
}

/// Constants of `wgsl/rotate.wgsl`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RotateConstants {
    /// `IN_F16`, `OUT_F16`: the input / output holds halves.
    pub in_f16: bool,
    pub out_f16: bool,
    /// `IN_PLACE`: the output is rotated where it is.
    pub in_place: bool,
    /// `INVERSE`: the rotation is undone.
    pub inverse: bool,
    /// `PAIR`: two tensors in one launch (an append's keys and values).
    pub pair: bool,
    /// `TO_RING`: a token range of each row into an f16 window ring, slot by slot.
    pub to_ring: bool,
    /// `ROUND_IN`: f32 inputs are rounded to f16 as they load (a cache's incoming K/V).
    pub round_in: bool,
    /// `PLAIN_FIRST`: with `pair`, the first tensor is copied, not rotated.
    pub plain_first: bool,
    /// `FROM_RING`: each row's token range out of an f16 window ring into a dense output.
    pub from_ring: bool,
    /// `FROM_LEVELS`: a page's Lloyd–Max codes grouped along D (and their norms) decoded
    /// into a dense output, `bits` (`BITS`) in groups of `group` (`GROUP`), norms f32 with
    /// `params_f32` (`PARAMS_F32`).
    pub from_levels: bool,
    pub bits: u8,
    pub group: u32,
    pub params_f32: bool,
    /// `DIM`: D, when the pipeline is built for one (a power of two from 8 to 64: the
    /// vector is held in registers, `rotate_held`); 0 for any D.
    pub dim: u32,
    /// `WG`, when not 0 (the family's [`GROUP_WG`]).
    pub wg: u32,
}

impl RotateConstants {
    fn values(&self) -> Vec<(&'static str, ConstValue)> {
        consts![
            "IN_F16" => Bool(self.in_f16),
            "OUT_F16" => Bool(self.out_f16),
            "IN_PLACE" => Bool(self.in_place),
            "INVERSE" => Bool(self.inverse),
            "PAIR" => Bool(self.pair),
            "TO_RING" => Bool(self.to_ring),
            "ROUND_IN" => Bool(self.round_in),
            "PLAIN_FIRST" => Bool(self.plain_first),
            "FROM_RING" => Bool(self.from_ring),
            "FROM_LEVELS" => Bool(self.from_levels),
            "BITS" => U32(u32::from(self.bits.max(1))),
            "GROUP" => U32(self.group.max(1)),
            "PARAMS_F32" => Bool(self.params_f32),
            "DIM" => U32(self.dim),
        ]
    }
}

/// Constants of `wgsl/similarity.wgsl`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SimilarityConstants {
    /// `A_F16`, `B_F16`: the two layers hold halves.
    pub a_f16: bool,
    pub b_f16: bool,
    /// `WEIGHTED`: squared differences are weighted.
    pub weighted: bool,
}

impl SimilarityConstants {
    fn values(&self) -> Vec<(&'static str, ConstValue)> {
        consts![
            "A_F16" => Bool(self.a_f16),
            "B_F16" => Bool(self.b_f16),
            "WEIGHTED" => Bool(self.weighted),
        ]
    }
}

/// Constants of `wgsl/llama.wgsl`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LlamaConstants {
    /// `WEIGHT`: matmul weight format (0 Q4_1, 1 Q8_0, 2 f32, 3 Q5_1, 4 Q4_K, 5 Q5_K, 6 Q6_K,
    /// 7 Q5_0, 8 Q4_0).
    pub weight: u8,
    /// `ACCUMULATE`: matmul adds into its output.
    pub accumulate: bool,
    /// `ROTATE`: rope rotates (false: only moves V to heads-major).
    pub rotate: bool,
    /// `HALVES`: rope pairs the two halves of a head (NEOX) instead of adjacent channels.
    pub halves: bool,
    /// `GELU`: the gated FFN's activation is GELU (tanh) instead of SiLU.
    pub gelu: bool,
}

impl LlamaConstants {
    fn values(&self) -> Vec<(&'static str, ConstValue)> {
        consts![
            "WEIGHT" => U32(u32::from(self.weight)),
            "ACCUMULATE" => Bool(self.accumulate),
            "ROTATE" => Bool(self.rotate),
            "HALVES" => Bool(self.halves),
            "GELU" => Bool(self.gelu),
            "TILE_K" => U32(MATMUL_TILE_K),
        ]
    }
}

/// Constants of `wgsl/attention.wgsl` (see the shader for their meaning).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AttentionConstants {
    /// `WG`: invocations per workgroup (0: [`ATTENTION_WG`]).
    pub wg: u32,
    /// `DIM`.
    pub dim: u32,
    /// `GROUP`.
    pub group: u32,
    /// `CHUNK`: tokens per workgroup.
    pub chunk: u32,
    /// `TT`: tokens per key-phase thread.
    pub tt: u32,
    /// `QT`: queries per workgroup.
    pub qt: u32,
    /// `CV`: channels per value-phase thread of values grouped along D (one code window).
    pub cv: u32,
    /// `VP`: value-phase threads a block of `CV` channels' tokens are split over.
    pub vp: u32,
    /// `RP`: value-phase threads a block of 4 ring channels' tokens are split over.
    pub rp: u32,
    /// `SPLIT_BLOCK`: values grouped along tokens split their blocks over `RP` threads too.
    pub split_block: bool,
    /// `RC`: channels per value-phase thread of a ring alone (4, 8 unsplit, or 16).
    pub rc: u32,
    /// `CK`: channels per code window of keys grouped along D.
    pub ck: u32,
    /// `GENERIC`: groups not aligned to runs of 4 tokens.
    pub generic: bool,
    /// `K_BITS`, `K_RES_BITS`, `V_BITS`, `V_RES_BITS`.
    pub k_bits: u8,
    pub k_res_bits: u8,
    pub v_bits: u8,
    pub v_res_bits: u8,
    /// `K_RESIDUAL`, `V_RESIDUAL`: a reuse layer's shared block.
    pub k_residual: bool,
    pub v_residual: bool,
    /// `K_CHANNELS`, `V_CHANNELS`: grouped along D.
    pub k_channels: bool,
    pub v_channels: bool,
    /// `PARAMS_F32`.
    pub params_f32: bool,
    /// `Q_F16`: the queries are halves.
    pub q_f16: bool,
    /// `OUT_F16`: the output holds halves.
    pub out_f16: bool,
    /// `DIRECT`: one chunk in all, the output is written without partials.
    pub direct: bool,
    /// `WITH_RING`: the ring (the f16 sinks, then the window) is a segment of the dispatch.
    pub with_ring: bool,
    /// `OWN_CODES`: the block's codes are its page's own (read from its page buffer).
    pub own_codes: bool,
    /// `ROTATE_Q`: the queries are rotated as they are loaded (a rotated cache's keys).
    pub rotate_q: bool,
    /// `ROTATE_OUT`: the output is rotated back as it is written (rotated values).
    pub rotate_out: bool,
    /// `K_LEVELS`, `V_LEVELS`: codes index Lloyd–Max levels (params: a norm per cell).
    pub k_levels: bool,
    pub v_levels: bool,
    /// `TOKEN_QUADS`: 4 consecutive tokens' words of a side grouped along D are one vec4.
    pub token_quads: bool,
}

impl AttentionConstants {
    fn values(&self) -> Vec<(&'static str, ConstValue)> {
        let bits = |b: u8| ConstValue::U32(u32::from(b.max(1)));
        let mut c = consts![
            "DIM" => U32(self.dim),
            "GROUP" => U32(self.group.max(1)),
            "CHUNK" => U32(self.chunk.max(1)),
            "TT" => U32(self.tt.max(1)),
            "QT" => U32(self.qt.max(1)),
            "CV" => U32(self.cv.clamp(4, 16)),
            "VP" => U32(self.vp.max(1)),
            "RP" => U32(self.rp.max(1)),
            "SPLIT_BLOCK" => Bool(self.split_block),
            "RC" => U32(if matches!(self.rc, 8 | 16) { self.rc } else { 4 }),
            "CK" => U32(self.ck.clamp(4, 16)),
            "GENERIC" => Bool(self.generic),
            "K_RESIDUAL" => Bool(self.k_residual),
            "V_RESIDUAL" => Bool(self.v_residual),
            "K_CHANNELS" => Bool(self.k_channels),
            "V_CHANNELS" => Bool(self.v_channels),
            "PARAMS_F32" => Bool(self.params_f32),
            "Q_F16" => Bool(self.q_f16),
            "OUT_F16" => Bool(self.out_f16),
            "DIRECT" => Bool(self.direct),
            "WITH_RING" => Bool(self.with_ring),
            "OWN_CODES" => Bool(self.own_codes),
            "ROTATE_Q" => Bool(self.rotate_q),
            "ROTATE_OUT" => Bool(self.rotate_out),
            "K_LEVELS" => Bool(self.k_levels),
            "V_LEVELS" => Bool(self.v_levels),
            "TOKEN_QUADS" => Bool(self.token_quads),
        ];
        c.extend([
            ("K_BITS", bits(self.k_bits)),
            ("K_RES_BITS", bits(self.k_res_bits)),
            ("V_BITS", bits(self.v_bits)),
            ("V_RES_BITS", bits(self.v_res_bits)),
        ]);
        c
    }
}

/// One compute entry point with its constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelKey {
    pub entry: &'static str,
    pub constants: Constants,
}

impl KernelKey {
    /// The entry point `entry` with `constants` (which name its family).
    pub fn new(entry: &'static str, constants: Constants) -> Self {
        KernelKey { entry, constants }
    }

    /// The WGSL file of the entry point.
    pub fn family(&self) -> Family {
        self.constants.family()
    }

    /// Workgroup size this kernel is compiled with.
    pub fn workgroup_size(&self) -> u32 {
        self.constants.workgroup_size()
    }
}

/// A compiled kernel: its pipeline and its family's bind group layout.
pub struct Kernel {
    pub pipeline: wgpu::ComputePipeline,
    pub bind_layout: wgpu::BindGroupLayout,
    /// The layout's bindings and how they are declared (`Family::bindings`).
    pub bindings: &'static [(u32, Access)],
}

/// The layouts every kernel of a family shares.
#[derive(Clone)]
struct FamilyLayout {
    bind: wgpu::BindGroupLayout,
    pipeline: wgpu::PipelineLayout,
}

/// Shader modules and pipelines of one device, each built once on first use.
#[derive(Default)]
pub struct PipelineCache {
    modules: Mutex<HashMap<Family, Arc<wgpu::ShaderModule>>>,
    layouts: Mutex<HashMap<&'static [(u32, Access)], FamilyLayout>>,
    pipelines: Mutex<WordHashMap<KernelKey, Arc<Kernel>>>,
}

impl PipelineCache {
    /// The kernel for `key`, compiled on first request.
    pub fn get(&self, device: &wgpu::Device, key: &KernelKey) -> Arc<Kernel> {
        let mut pipelines = self.pipelines.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = pipelines.get(key) {
            return p.clone();
        }
        let family = key.family();
        let bindings = family.bindings(key.entry);
        let layout = self.layout(device, bindings);
        let constants = key.constants.overrides();
        // Natively the driver gets the kernel already specialised (`gpu/specialise.rs`); in
        // the browser, WGSL and its overrides.
        #[cfg(not(target_arch = "wasm32"))]
        let specialised = crate::gpu::specialise::specialised(family, key.entry, &constants)
            .ok()
            .map(|module| {
                Arc::new(device.create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(key.entry),
                    source: wgpu::ShaderSource::Naga(std::borrow::Cow::Owned(module)),
                }))
            });
        #[cfg(target_arch = "wasm32")]
        let specialised: Option<Arc<wgpu::ShaderModule>> = None;
        let (module, constants) = match specialised {
            Some(module) => (module, Vec::new()),
            None => (self.module(device, family), constants),
        };
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(key.entry),
            layout: Some(&layout.pipeline),
            module: &module,
            entry_point: Some(key.entry),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants: &constants,
                // The attention kernels write their workgroup arrays before reading them.
                zero_initialize_workgroup_memory: family != Family::Attention,
            },
            cache: None,
        });
        let kernel = Arc::new(Kernel {
            bind_layout: layout.bind,
            pipeline,
            bindings,
        });
        pipelines.insert(*key, kernel.clone());
        kernel
    }

    /// Number of pipelines built so far.
    pub fn len(&self) -> usize {
        self.pipelines.lock().map(|p| p.len()).unwrap_or(0)
    }

    fn layout(&self, device: &wgpu::Device, bindings: &'static [(u32, Access)]) -> FamilyLayout {
        let mut layouts = self.layouts.lock().unwrap_or_else(|p| p.into_inner());
        layouts
            .entry(bindings)
            .or_insert_with(|| {
                let bind = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                    label: Some("family layout"),
                    entries: &Family::layout_entries(bindings),
                });
                let pipeline = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                    label: Some("family layout"),
                    bind_group_layouts: &[Some(&bind)],
                    immediate_size: 0,
                });
                FamilyLayout { bind, pipeline }
            })
            .clone()
    }

    fn module(&self, device: &wgpu::Device, family: Family) -> Arc<wgpu::ShaderModule> {
        let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        modules
            .entry(family)
            .or_insert_with(|| {
                Arc::new(device.create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(&format!("{family:?}")),
                    source: wgpu::ShaderSource::Wgsl(family.source().into()),
                }))
            })
            .clone()
    }
}

//! Shader sources and the per-device pipeline cache, keyed by (kernel, override constants).
//! Every `.wgsl` file is loaded here and only here; specialisation is done with WGSL
//! `override` constants, never by editing shader text.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Invocations per workgroup of the per-group kernels (one invocation walks a whole group).
pub const GROUP_WG: u32 = 64;
/// Invocations per workgroup of element-wise and reduction kernels (the browsers' maximum).
pub const ELEMENT_WG: u32 = 256;
/// Invocations per workgroup of the attention kernels (a chunk's runs of tokens, or its
/// blocks of channels).
pub const ATTENTION_WG: u32 = 32;

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
    /// `wgsl/similarity.wgsl`: pair_partials, finish.
    Similarity,
    /// `wgsl/llama.wgsl`: the model's forward pass (embed, rmsnorm, matmul, rope, swiglu).
    Llama,
    /// `wgsl/attention.wgsl`: attend_block, attend_ring, combine (split-K attention over a
    /// cache's K/V).
    Attention,
    /// `wgsl/copy.wgsl`: copy (the benchmark roofline; native benchmarks only).
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    Copy,
}

impl Family {
    fn source(self) -> &'static str {
        match self {
            Family::GroupQuant => include_str!("../../wgsl/group_quant.wgsl"),
            Family::Materialize => include_str!("../../wgsl/materialize.wgsl"),
            Family::Window => include_str!("../../wgsl/window.wgsl"),
            Family::Llama => include_str!("../../wgsl/llama.wgsl"),
            Family::Similarity => include_str!("../../wgsl/similarity.wgsl"),
            Family::Copy => include_str!("../../wgsl/copy.wgsl"),
            Family::Attention => include_str!("../../wgsl/attention.wgsl"),
        }
    }

    /// Families whose entry points share one explicit bind group layout (every binding
    /// present, unused ones bound to a placeholder); the others use automatic layouts.
    fn explicit_layout(self) -> Option<Vec<wgpu::BindGroupLayoutEntry>> {
        let entry = |binding, ty| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty,
            count: None,
        };
        let storage = |read_only| wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Storage { read_only },
            has_dynamic_offset: false,
            min_binding_size: None,
        };
        let uniform = wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Uniform,
            has_dynamic_offset: false,
            min_binding_size: None,
        };
        match self {
            Family::Materialize => Some(vec![
                entry(0, uniform),
                entry(1, storage(true)),
                entry(2, storage(true)),
                entry(3, storage(true)),
                entry(4, storage(true)),
                entry(5, storage(false)),
                entry(6, storage(true)),
            ]),
            Family::Llama => Some(vec![
                entry(0, uniform),
                entry(1, storage(true)),
                entry(2, storage(true)),
                entry(3, storage(false)),
                entry(4, storage(true)),
                entry(5, storage(true)),
            ]),
            _ => None,
        }
    }

    fn workgroup_size(self) -> u32 {
        match self {
            Family::GroupQuant | Family::Llama => GROUP_WG,
            Family::Attention => ATTENTION_WG,
            Family::Materialize | Family::Window | Family::Similarity | Family::Copy => ELEMENT_WG,
        }
    }
}

/// Values for a family's `override` constants. Fields a family does not declare are ignored
/// (and left at their defaults by the constructors, so equal kernels share one pipeline).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Overrides {
    /// Code width (`BITS`).
    pub bits: u8,
    /// Residual code width (`RES_BITS`).
    pub res_bits: u8,
    /// Members per group (`GROUP`).
    pub group: u32,
    /// The main input holds halves (`IN_F16`, `A_F16`).
    pub in_f16: bool,
    /// f32 input values are rounded to f16 on load (`X_TO_F16`).
    pub x_to_f16: bool,
    /// The second input holds halves (`RECON_F16`, `B_F16`).
    pub recon_f16: bool,
    /// Intermediate reconstructions are rounded to f16 (`ROUND_F16`).
    pub round_f16: bool,
    /// Squared differences are weighted (`WEIGHTED`, similarity).
    pub weighted: bool,
    /// The output holds halves (`OUT_F16`).
    pub out_f16: bool,
    /// Params as f32 pairs (`PARAMS_F32`).
    pub params_f32: bool,
    /// Groups run along channels (`AXIS_CHANNELS`).
    pub axis_channels: bool,
    /// What `materialize` writes (`KIND`).
    pub kind: MaterializeKind,
    /// Weight format of `matmul` (`WEIGHT`: 0 Q4_1, 1 Q8_0, 2 f32).
    pub weight: u8,
    /// `matmul` adds into its output (`ACCUMULATE`).
    pub accumulate: bool,
    /// `rope` rotates (`ROTATE`).
    pub rotate: bool,
    /// The attention family's constants.
    pub attention: AttentionOverrides,
}

/// Constants of `wgsl/attention.wgsl` (see the shader for their meaning).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AttentionOverrides {
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
    /// `WITH_RING`: a block dispatch also covers the window ring's chunks.
    pub with_ring: bool,
}

/// What the `materialize` kernel writes into its output.
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

impl Overrides {
    fn constants(&self, family: Family) -> Vec<(&'static str, f64)> {
        let b = |v: bool| if v { 1.0 } else { 0.0 };
        let mut c = vec![("WG", family.workgroup_size() as f64)];
        match family {
            Family::GroupQuant => c.extend([
                ("BITS", self.bits as f64),
                ("RES_BITS", self.res_bits.max(1) as f64),
                ("GROUP", self.group as f64),
                ("IN_F16", b(self.in_f16)),
                ("X_TO_F16", b(self.x_to_f16)),
                ("RECON_F16", b(self.recon_f16)),
                ("ROUND_F16", b(self.round_f16)),
                ("PARAMS_F32", b(self.params_f32)),
                ("AXIS_CHANNELS", b(self.axis_channels)),
            ]),
            Family::Materialize => c.extend([
                ("RUN", DEQUANT_RUN as f64),
                ("KIND", self.kind as u32 as f64),
                ("BITS", self.bits as f64),
                ("RES_BITS", self.res_bits.max(1) as f64),
                ("GROUP", self.group as f64),
                ("OUT_F16", b(self.out_f16)),
                ("PARAMS_F32", b(self.params_f32)),
                ("AXIS_CHANNELS", b(self.axis_channels)),
            ]),
            Family::Window => c.push(("IN_F16", b(self.in_f16))),
            Family::Llama => c.extend([
                ("WEIGHT", self.weight as f64),
                ("ACCUMULATE", b(self.accumulate)),
                ("ROTATE", b(self.rotate)),
                ("TILE_K", MATMUL_TILE_K as f64),
            ]),
            Family::Similarity => c.extend([
                ("A_F16", b(self.in_f16)),
                ("B_F16", b(self.recon_f16)),
                ("WEIGHTED", b(self.weighted)),
            ]),
            Family::Attention => {
                let a = &self.attention;
                c.extend([
                    ("DIM", a.dim as f64),
                    ("GROUP", a.group.max(1) as f64),
                    ("CHUNK", a.chunk.max(1) as f64),
                    ("TT", a.tt.max(1) as f64),
                    ("QT", a.qt.max(1) as f64),
                    ("GENERIC", b(a.generic)),
                    ("K_BITS", a.k_bits.max(1) as f64),
                    ("K_RES_BITS", a.k_res_bits.max(1) as f64),
                    ("V_BITS", a.v_bits.max(1) as f64),
                    ("V_RES_BITS", a.v_res_bits.max(1) as f64),
                    ("K_RESIDUAL", b(a.k_residual)),
                    ("V_RESIDUAL", b(a.v_residual)),
                    ("K_CHANNELS", b(a.k_channels)),
                    ("V_CHANNELS", b(a.v_channels)),
                    ("PARAMS_F32", b(a.params_f32)),
                    ("Q_F16", b(a.q_f16)),
                    ("OUT_F16", b(a.out_f16)),
                    ("DIRECT", b(a.direct)),
                    ("WITH_RING", b(a.with_ring)),
                ]);
            }
            Family::Copy => {}
        }
        c
    }
}

/// One compute entry point with its constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelKey {
    pub family: Family,
    pub entry: &'static str,
    pub overrides: Overrides,
}

impl KernelKey {
    /// Workgroup size this kernel is compiled with.
    pub fn workgroup_size(&self) -> u32 {
        self.family.workgroup_size()
    }
}

/// Shader modules and pipelines of one device, each built once on first use.
#[derive(Default)]
pub struct PipelineCache {
    modules: Mutex<HashMap<Family, Arc<wgpu::ShaderModule>>>,
    layouts: Mutex<HashMap<Family, Arc<wgpu::PipelineLayout>>>,
    pipelines: Mutex<HashMap<KernelKey, Arc<wgpu::ComputePipeline>>>,
}

impl PipelineCache {
    /// The pipeline for `key`, compiled on first request.
    pub fn get(&self, device: &wgpu::Device, key: &KernelKey) -> Arc<wgpu::ComputePipeline> {
        let mut pipelines = self.pipelines.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = pipelines.get(key) {
            return p.clone();
        }
        let module = self.module(device, key.family);
        let layout = self.layout(device, key.family);
        let constants = key.overrides.constants(key.family);
        let pipeline = Arc::new(
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(key.entry),
                layout: layout.as_deref(),
                module: &module,
                entry_point: Some(key.entry),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants: &constants,
                    // The attention kernels write their workgroup arrays before reading them.
                    zero_initialize_workgroup_memory: key.family != Family::Attention,
                },
                cache: None,
            }),
        );
        pipelines.insert(*key, pipeline.clone());
        pipeline
    }

    /// Number of pipelines built so far.
    pub fn len(&self) -> usize {
        self.pipelines.lock().map(|p| p.len()).unwrap_or(0)
    }

    fn layout(&self, device: &wgpu::Device, family: Family) -> Option<Arc<wgpu::PipelineLayout>> {
        let entries = family.explicit_layout()?;
        let mut layouts = self.layouts.lock().unwrap_or_else(|p| p.into_inner());
        Some(
            layouts
                .entry(family)
                .or_insert_with(|| {
                    let bind = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                        label: Some("explicit layout"),
                        entries: &entries,
                    });
                    Arc::new(
                        device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                            label: Some("materialize"),
                            bind_group_layouts: &[Some(&bind)],
                            immediate_size: 0,
                        }),
                    )
                })
                .clone(),
        )
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

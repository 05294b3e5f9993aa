//! A cache plan: for every layer, separately for keys and values, where the codes come from
//! (the layer's own, or those of a named earlier layer decoded with the layer's own
//! scale/zero), bit widths, residual, grouping axis and η; plus what the whole set shares:
//! the f16 window, the f16 attention sinks, the quantization group and the params storage.
//! A [`CacheConfig`](crate::cache::CacheConfig) is one way to write a plan; presets are others.

use serde_json::{json, Map, Value};

pub use crate::config::Rotation;
use crate::config::{
    KvKind, Levels, ParamsPrecision, QuantSpec, ValueAxis, XQuantConfig, MAX_GROUP_SIZE,
};
use crate::error::{config_err, Result, XqError};
use crate::reference::{anchor_of, check_rotation_dim, reference_bytes, LayerRole, Role};

/// Where a tensor's codes come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodeSource {
    /// The layer quantizes itself.
    Own,
    /// The codes of this earlier layer (which owns them), with the layer's own scale/zero.
    Layer(usize),
}

/// The rotation seed of plans that do not name one.
pub const DEFAULT_ROTATION_SEED: u32 = 0x5eed;

/// How one layer's keys (or values) are stored.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TensorPlan {
    /// Own codes, or an earlier layer's.
    pub codes: CodeSource,
    /// Code width 1..=8 (a reuse entry has its source's).
    pub bits: u8,
    /// Residual code width of a reuse entry, 0..=8 (0 = pure reuse); 0 for own codes.
    pub residual_bits: u8,
    /// Grouping axis: `tokens` (per-channel params, KIVI's keys) or `channels` (per-token
    /// params, KIVI's values). A reuse entry has its source's.
    pub axis: ValueAxis,
    /// Data-free calibration η in [0, 0.5].
    pub eta: f32,
    /// Rotation of the head vectors before they are stored (a reuse entry has its source's).
    pub rotation: Rotation,
    /// What the codes stand for: uniform steps (scale, zero per group) or Lloyd–Max levels
    /// (a norm per group; own codes grouped per token only).
    pub levels: Levels,
}

impl TensorPlan {
    /// Own codes of `bits` along `axis`, η 0, not rotated.
    pub fn own(bits: u8, axis: ValueAxis) -> Self {
        TensorPlan {
            codes: CodeSource::Own,
            bits,
            residual_bits: 0,
            axis,
            eta: 0.0,
            rotation: Rotation::None,
            levels: Levels::Uniform,
        }
    }

    /// Anchor (own codes) or reuse.
    pub fn role(&self) -> Role {
        match self.codes {
            CodeSource::Own => Role::Anchor,
            CodeSource::Layer(_) => Role::Reuse,
        }
    }

    /// The quantizer of this entry with the set's group size and params.
    pub fn spec(&self, group: usize, params: ParamsPrecision) -> QuantSpec {
        QuantSpec {
            bits: self.bits,
            group_size: group,
            axis: self.axis,
            eta: self.eta,
            params,
            levels: self.levels,
        }
    }
}

/// One layer of a plan.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerPlan {
    /// Keys.
    pub key: TensorPlan,
    /// Values.
    pub value: TensorPlan,
    /// A sliding-window layer's attention window (Gemma 3's local layers: 512): a query at
    /// position `p` sees positions `p' > p − w` only, so the layer keeps about `w` tokens
    /// (the quantized pages that fall out of it are dropped, the sinks too) and its memory
    /// stays flat however long the context. `None`: every position (a global layer).
    pub attention_window: Option<usize>,
}

impl LayerPlan {
    /// A global layer (no attention window) of these entries.
    pub fn new(key: TensorPlan, value: TensorPlan) -> Self {
        LayerPlan {
            key,
            value,
            attention_window: None,
        }
    }

    /// Keys or values.
    pub fn get(&self, kind: KvKind) -> &TensorPlan {
        match kind {
            KvKind::Key => &self.key,
            KvKind::Value => &self.value,
        }
    }
}

/// A per-layer plan of a cache set (JSON: [`CachePlan::to_json`], [`CachePlan::from_json`]).
#[derive(Clone, Debug, PartialEq)]
pub struct CachePlan {
    /// A label (a preset's name, or `plan`).
    pub name: String,
    /// One entry per attention layer.
    pub layers: Vec<LayerPlan>,
    /// Most recent tokens kept in f16 (a multiple of `group_quant_size`).
    pub window: usize,
    /// First tokens kept in f16 in every layer (attention sinks); 0 = none.
    pub sinks: usize,
    /// Elements per quantization group (along each entry's axis).
    pub group_quant_size: usize,
    /// Params storage.
    pub params: ParamsPrecision,
    /// Seed of the rotation signs of entries with `rotation: hadamard`.
    pub rotation_seed: u32,
}

impl CachePlan {
    /// Whether `layer`'s `kind` entry is rotated, and the layer whose signs it takes (the
    /// owner of its codes: a layer that borrows codes rotates like their owner).
    pub fn signs_layer(&self, layer: usize, kind: KvKind) -> Option<usize> {
        let e = self.layers[layer].get(kind);
        match (e.rotation, e.codes) {
            (Rotation::None, _) => None,
            (Rotation::Hadamard, CodeSource::Own) => Some(layer),
            (Rotation::Hadamard, CodeSource::Layer(s)) => Some(s),
        }
    }

    /// The plan with the model's attention windows (one per layer, `None` on global
    /// layers) on every layer that names none. Codes are shared only between layers of one
    /// window: an entry that would borrow the codes of a layer with another window (a
    /// layer grouping that straddles Gemma 3's global layers) gets codes of its own, at the
    /// same bits and without a residual, so that every grouped plan runs on such a model.
    pub fn with_model_windows(mut self, windows: &[Option<usize>]) -> Self {
        for (l, w) in self.layers.iter_mut().zip(windows) {
            l.attention_window = l.attention_window.or(*w);
        }
        let window_of: Vec<Option<usize>> =
            self.layers.iter().map(|l| l.attention_window).collect();
        for (i, l) in self.layers.iter_mut().enumerate() {
            for e in [&mut l.key, &mut l.value] {
                if let CodeSource::Layer(src) = e.codes {
                    if window_of.get(src) != Some(&window_of[i]) {
                        e.codes = CodeSource::Own;
                        e.residual_bits = 0;
                    }
                }
            }
        }
        self
    }

    /// Whether any layer has an attention window.
    pub fn slides(&self) -> bool {
        self.layers.iter().any(|l| l.attention_window.is_some())
    }

    /// Whether any entry is rotated.
    pub fn rotates(&self) -> bool {
        self.layers
            .iter()
            .any(|l| l.key.rotation != Rotation::None || l.value.rotation != Rotation::None)
    }
}

/// KIVI's options (the `kivi-2` preset, with window 128 and no sinks): every layer its own
/// 2-bit codes, keys per channel, values per token, groups of 32.
pub const KIVI_2: XQuantConfig = XQuantConfig {
    layers_per_group: 1,
    base_bits: 2,
    key_bits: 0,
    residual_bits: 0,
    group_quant_size: 32,
    eta: 0.0,
    value_axis: ValueAxis::Channels,
    params: ParamsPrecision::F16,
    value_levels: Levels::Uniform,
    value_rotation: Rotation::None,
};

/// The `kivi-lloyd` preset's options (with window 128 and 4 sinks): keys as KIVI's (per
/// channel, uniform, unrotated) at 3 bits, values Hadamard-rotated and grouped per token with
/// 2-bit Lloyd–Max levels; groups of 64 (2.875 bits per quantized element).
pub const KIVI_LLOYD: XQuantConfig = XQuantConfig {
    key_bits: 3,
    group_quant_size: 64,
    value_levels: Levels::LloydMax,
    value_rotation: Rotation::Hadamard,
    ..KIVI_2
};

/// Names of the built-in presets.
pub const PRESETS: [&str; 11] = [
    "xquant-paper",
    "kivi-2",
    "kivi-lloyd",
    "reference",
    "pure-reuse",
    "rotated-k3v2",
    "rotated-2",
    "lloyd-k3v2",
    "lloyd-2.5",
    "lloyd-2",
    "default",
];

/// Bytes of a plan's K/V at a context length (the reference's accounting: codes at their
/// width, two 16-bit numbers per group and channel, residuals; f16 for window and sinks).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PlanBytes {
    /// Everything: quantized tokens, window, sinks.
    pub total: u64,
    /// The quantized tokens alone.
    pub quantized: u64,
    /// Elements quantized (tokens × rows × dim × 2 tensors × layers).
    pub quantized_elements: u64,
    /// The same tokens in f16.
    pub fp16: u64,
}

impl PlanBytes {
    /// `16 · total / fp16`: bits per element with everything counted.
    pub fn effective_bits(&self) -> f64 {
        ratio_bits(self.total, self.fp16)
    }

    /// Bits per quantized element (what long contexts tend to).
    pub fn quantized_bits(&self) -> f64 {
        if self.quantized_elements == 0 {
            0.0
        } else {
            8.0 * self.quantized as f64 / self.quantized_elements as f64
        }
    }
}

fn ratio_bits(bytes: u64, fp16: u64) -> f64 {
    if fp16 == 0 {
        0.0
    } else {
        16.0 * bytes as f64 / fp16 as f64
    }
}

impl CachePlan {
    /// The plan of the reference's layer grouping as the options `q` describe it: layers in
    /// groups of `q.layers_per_group`, the first of each owns its codes (keys of
    /// `q.bits(Key)`, values of `q.base_bits`), the others reuse them with
    /// `q.residual_bits`; keys grouped along tokens, values along `q.value_axis` with
    /// `q.value_levels` and `q.value_rotation`.
    pub fn grouped(layers: usize, q: &XQuantConfig, window: usize, sinks: usize) -> Result<Self> {
        let n = q.layers_per_group;
        if n == 0 {
            return config_err!("group_size (layers per group) must be >= 1, got 0");
        }
        let entry = |l: usize, kind: KvKind| {
            let a = anchor_of(l, n);
            let spec = q.spec(kind);
            TensorPlan {
                codes: if a == l {
                    CodeSource::Own
                } else {
                    CodeSource::Layer(a)
                },
                residual_bits: if a == l { 0 } else { q.residual_bits },
                eta: q.eta,
                levels: spec.levels,
                rotation: match kind {
                    KvKind::Key => Rotation::None,
                    KvKind::Value => q.value_rotation,
                },
                ..TensorPlan::own(spec.bits, spec.axis)
            }
        };
        let plan = CachePlan {
            name: "plan".into(),
            layers: (0..layers)
                .map(|l| LayerPlan {
                    key: entry(l, KvKind::Key),
                    value: entry(l, KvKind::Value),
                    attention_window: None,
                })
                .collect(),
            window,
            sinks,
            group_quant_size: q.group_quant_size,
            params: q.params,
            rotation_seed: DEFAULT_ROTATION_SEED,
        };
        plan.validate()?;
        Ok(plan)
    }

    /// A built-in plan for `layers` layers (see [`PRESETS`] and docs/plans.md):
    ///
    /// - `kivi-2`: every layer its own 2-bit codes, keys per channel (groups along tokens),
    ///   values per token (groups along channels), group 32, window 128 (KIVI's defaults).
    /// - `xquant-paper`: the paper's scheme as its released code parametrises it
    ///   (`kq_vq_km_vm_i1_i2`): keys per channel and values per token; layers `>= kq` (keys)
    ///   / `>= vq` (values) at 1 bit, earlier ones at 2; from `km` / `vm` on, odd layers take
    ///   the codes of the layer below with their own scale/zero and no residual; η = 1/6 for
    ///   1-bit and 0.045 for 2-bit groups (`i1 = i2 = 1`). The code does not record the
    ///   values per model; we use `kq = vq = km = vm = layers / 2`, group 32, window 128.
    /// - `reference`: the reference's default: pairs, 2-bit anchors, 4-bit residual, both
    ///   grouped along tokens, η 0, group 32, window 128.
    /// - `pure-reuse`: `reference` without the residual.
    /// - `rotated-k3v2`: every layer's keys and values Hadamard-rotated and grouped per token
    ///   (groups of 64 channels), keys 3 bits with η 0.1, values 2 bits with η 0.15 (3.0 bits
    ///   per quantized element); window 128, 4 sinks. Head dims that are powers of two.
    /// - `rotated-2`: the same with 2-bit keys and η 0.15 (2.5 bits per quantized element).
    /// - `lloyd-k3v2`: every layer rotated and grouped per token (groups of 64), Lloyd–Max
    ///   levels with a norm per group: keys 3 bits, values 2 bits (2.75 bits per quantized
    ///   element); window 128, 4 sinks.
    /// - `lloyd-2.5`: the same with 3-bit keys only in the upper half of the layers (2.5
    ///   bits; the half chosen on one text among the upper half, the lower half and every
    ///   other layer, docs/quality.md, "Lloyd–Max levels").
    /// - `lloyd-2`: the same with 2-bit keys everywhere (2.25 bits).
    /// - `kivi-lloyd`: keys as KIVI's (per channel, uniform, unrotated) at 3 bits, values
    ///   rotated and grouped per token with 2-bit Lloyd–Max levels; group 64 (2.875 bits per
    ///   quantized element), window 128, 4 sinks: the best measured plan on both SmolLM2 and
    ///   Gemma 3 (docs/quality.md, "Keys per channel, Lloyd–Max values").
    /// - `default`: what a cache set uses when given nothing (`CacheConfig::default`), as
    ///   it is for head dims that are powers of two from 64 on (`kivi-lloyd`; others fall
    ///   back to `kivi-2` + 4 sinks, see `CacheConfig::quant_for`).
    pub fn preset(name: &str, layers: usize) -> Result<Self> {
        let (t, c) = (ValueAxis::Tokens, ValueAxis::Channels);
        let f16 = ParamsPrecision::F16;
        let mut plan = match name {
            "kivi-2" => CachePlan::grouped(layers, &KIVI_2, 128, 0)?,
            "reference" => CachePlan::grouped(layers, &XQuantConfig::default(), 128, 0)?,
            "pure-reuse" => {
                let q = XQuantConfig {
                    residual_bits: 0,
                    ..XQuantConfig::default()
                };
                CachePlan::grouped(layers, &q, 128, 0)?
            }
            "default" => {
                let d = crate::cache::CacheConfig::default();
                CachePlan::grouped(layers, &d.quant, d.window, d.sinks)?
            }
            "rotated-k3v2" => CachePlan::rotated(layers, (3, 0.1), (2, 0.15)),
            "rotated-2" => CachePlan::rotated(layers, (2, 0.15), (2, 0.15)),
            "lloyd-k3v2" => CachePlan::lloyd(layers, |_| 3, 2),
            "lloyd-2.5" => CachePlan::lloyd(layers, |l| if 2 * l >= layers { 3 } else { 2 }, 2),
            "lloyd-2" => CachePlan::lloyd(layers, |_| 2, 2),
            "kivi-lloyd" => CachePlan::grouped(layers, &KIVI_LLOYD, 128, 4)?,
            "xquant-paper" => {
                let half = layers / 2;
                let entry = |l: usize, axis| {
                    let reuse = l >= half && l % 2 == 1;
                    // A reuse layer decodes the codes of the layer below, at that layer's
                    // width (2 bits when the layer below is under `half`).
                    let coded = if reuse { l - 1 } else { l };
                    let bits = if coded >= half { 1 } else { 2 };
                    TensorPlan {
                        codes: if reuse {
                            CodeSource::Layer(l - 1)
                        } else {
                            CodeSource::Own
                        },
                        bits,
                        residual_bits: 0,
                        axis,
                        eta: if bits == 1 { 1.0 / 6.0 } else { 0.045 },
                        rotation: Rotation::None,
                        levels: Levels::Uniform,
                    }
                };
                CachePlan {
                    name: String::new(),
                    layers: (0..layers)
                        .map(|l| LayerPlan {
                            key: entry(l, t),
                            value: entry(l, c),
                            attention_window: None,
                        })
                        .collect(),
                    window: 128,
                    sinks: 0,
                    group_quant_size: 32,
                    params: f16,
                    rotation_seed: DEFAULT_ROTATION_SEED,
                }
            }
            other => {
                return config_err!("unknown preset `{other}` (presets: {})", PRESETS.join(", "))
            }
        };
        plan.name = name.to_string();
        plan.validate()?;
        Ok(plan)
    }

    /// [`preset`](Self::preset) for layers of head dim `head_dim`: `default` is then exactly
    /// what a cache set given nothing uses for them (`CacheConfig::default().plan`, with its
    /// fallback where the head dim does not fit kivi-lloyd), the others as `preset` gives them.
    pub fn preset_for(name: &str, layers: usize, head_dim: usize) -> Result<Self> {
        if name != "default" {
            return Self::preset(name, layers);
        }
        let mut plan = crate::cache::CacheConfig::default().plan(layers, head_dim)?;
        plan.name = name.to_string();
        Ok(plan)
    }

    /// Every layer's keys and values rotated and grouped per token, own codes of
    /// (bits, η) each; group 64, window 128, 4 sinks.
    fn rotated(layers: usize, key: (u8, f32), value: (u8, f32)) -> CachePlan {
        let entry = |(bits, eta)| TensorPlan {
            eta,
            ..TensorPlan::own(bits, ValueAxis::Channels)
        };
        CachePlan::rotated_per_token(layers, |_| (entry(key), entry(value)))
    }

    /// Every layer's keys and values rotated, grouped per token and coded with Lloyd–Max
    /// levels (a norm per group): keys of `key_bits(layer)`, values of `value_bits`; group 64,
    /// window 128, 4 sinks.
    fn lloyd(layers: usize, key_bits: impl Fn(usize) -> u8, value_bits: u8) -> CachePlan {
        let entry = |bits| TensorPlan {
            levels: Levels::LloydMax,
            ..TensorPlan::own(bits, ValueAxis::Channels)
        };
        CachePlan::rotated_per_token(layers, |l| (entry(key_bits(l)), entry(value_bits)))
    }

    /// Layer `l`'s (key, value) entries from `entries(l)`, each Hadamard-rotated; group 64,
    /// window 128, 4 sinks: the rotated presets' shape.
    fn rotated_per_token(
        layers: usize,
        entries: impl Fn(usize) -> (TensorPlan, TensorPlan),
    ) -> CachePlan {
        let rotated = |e: TensorPlan| TensorPlan {
            rotation: Rotation::Hadamard,
            ..e
        };
        CachePlan::per_token_shape(layers, |l| {
            let (key, value) = entries(l);
            (rotated(key), rotated(value))
        })
    }

    /// Layer `l`'s (key, value) entries from `entries(l)` as they are; group 64, window 128,
    /// 4 sinks: the shape of the presets measured with per-token groups.
    fn per_token_shape(
        layers: usize,
        entries: impl Fn(usize) -> (TensorPlan, TensorPlan),
    ) -> CachePlan {
        CachePlan {
            name: String::new(),
            layers: (0..layers)
                .map(|l| {
                    let (key, value) = entries(l);
                    LayerPlan {
                        key,
                        value,
                        attention_window: None,
                    }
                })
                .collect(),
            window: 128,
            sinks: 4,
            group_quant_size: 64,
            params: ParamsPrecision::F16,
            rotation_seed: DEFAULT_ROTATION_SEED,
        }
    }

    /// Checks every field; errors name the field (`layers[3].value.codes`).
    pub fn validate(&self) -> Result<()> {
        let g = self.group_quant_size;
        if g == 0 || g > MAX_GROUP_SIZE {
            return config_err!("group_quant_size must be in 1..={MAX_GROUP_SIZE}, got {g}");
        }
        if self.window % g != 0 {
            return config_err!(
                "window ({}) must be a multiple of group_quant_size ({g})",
                self.window
            );
        }
        if self.layers.is_empty() {
            return config_err!("layers: a plan needs at least one layer");
        }
        for (i, l) in self.layers.iter().enumerate() {
            if let Some(w) = l.attention_window {
                if !(1..=u32::MAX as usize).contains(&w) {
                    return config_err!(
                        "layers[{i}].attention_window must be at least 1 (and fit 32 bits), \
                         got {w}"
                    );
                }
            }
            for (kind, e) in [("key", &l.key), ("value", &l.value)] {
                let at = format!("layers[{i}].{kind}");
                if !(1..=8).contains(&e.bits) {
                    return config_err!("{at}.bits must be in 1..=8, got {}", e.bits);
                }
                if e.residual_bits > 8 {
                    return config_err!(
                        "{at}.residual_bits must be in 0..=8, got {}",
                        e.residual_bits
                    );
                }
                if !(e.eta.is_finite() && (0.0..=0.5).contains(&e.eta)) {
                    return config_err!("{at}.eta must be in [0, 0.5], got {}", e.eta);
                }
                if e.levels == Levels::LloydMax {
                    let spec = e.spec(g, self.params);
                    spec.validate()
                        .map_err(|err| XqError::Config(format!("{at}: {}", err.message())))?;
                    if e.codes != CodeSource::Own {
                        return config_err!(
                            "{at}.levels: lloyd-max codes are the layer's own (a borrowed \
                             code is refitted with a uniform scale and zero)"
                        );
                    }
                }
                let CodeSource::Layer(src) = e.codes else {
                    if e.residual_bits != 0 {
                        return config_err!(
                            "{at}.residual_bits must be 0 for own codes (a residual corrects \
                             borrowed codes), got {}",
                            e.residual_bits
                        );
                    }
                    continue;
                };
                if src >= i {
                    return config_err!(
                        "{at}.codes: layer {src} is not an earlier layer (codes come from \
                         layers 0..{i})"
                    );
                }
                let s = self.layers[src].get(match kind {
                    "key" => KvKind::Key,
                    _ => KvKind::Value,
                });
                if s.codes != CodeSource::Own {
                    return config_err!(
                        "{at}.codes: layer {src} borrows its codes itself; name the layer \
                         that owns them"
                    );
                }
                let (mine, theirs) = (l.attention_window, self.layers[src].attention_window);
                if mine != theirs {
                    let name = |w: Option<usize>| w.map_or("none".to_string(), |w| w.to_string());
                    return config_err!(
                        "{at}.codes: layer {src} has attention window {} and layer {i} {}; \
                         codes are shared only between layers of the same window (a sliding \
                         layer drops the pages a global one keeps)",
                        name(theirs),
                        name(mine)
                    );
                }
                if s.bits != e.bits {
                    return config_err!(
                        "{at}.bits ({}) must equal the bits of layer {src}'s codes ({})",
                        e.bits,
                        s.bits
                    );
                }
                if s.axis != e.axis {
                    return config_err!(
                        "{at}.axis ({}) must equal the axis of layer {src}'s codes ({})",
                        e.axis.name(),
                        s.axis.name()
                    );
                }
                if s.levels != Levels::Uniform {
                    return config_err!(
                        "{at}.codes: layer {src}'s codes are lloyd-max levels, which are not \
                         borrowed"
                    );
                }
                if s.rotation != e.rotation {
                    return config_err!(
                        "{at}.rotation ({}) must equal the rotation of layer {src}'s codes ({})",
                        e.rotation.name(),
                        s.rotation.name()
                    );
                }
            }
        }
        Ok(())
    }

    /// Checks the plan fits a model's head dim: rotated entries need a power of two (at most
    /// [`MAX_ROTATION_DIM`](crate::reference::MAX_ROTATION_DIM)), Lloyd–Max entries a group
    /// size that divides it.
    pub fn check_head_dim(&self, head_dim: usize) -> Result<()> {
        if self.rotates() {
            check_rotation_dim(head_dim)?;
        }
        for (i, l) in self.layers.iter().enumerate() {
            for (kind, e) in [("key", &l.key), ("value", &l.value)] {
                e.spec(self.group_quant_size, self.params)
                    .check_axis(head_dim)
                    .map_err(|err| {
                        XqError::Config(format!("layers[{i}].{kind}: {}", err.message()))
                    })?;
            }
        }
        Ok(())
    }

    /// Checks the plan has one entry per layer of a model.
    pub fn check_layers(&self, layers: usize) -> Result<()> {
        if self.layers.len() != layers {
            return config_err!(
                "layers: the plan has {} layers, the model {layers}",
                self.layers.len()
            );
        }
        Ok(())
    }

    /// The reference's view of the keys' entries: an anchor owns its codes, a reuse layer
    /// borrows them; `group` counts the owners in layer order (the reference's group id when
    /// the plan is its grouping).
    pub fn key_roles(&self) -> Vec<LayerRole> {
        let owners_before = |l: usize| {
            (0..l)
                .filter(|&j| self.layers[j].key.codes == CodeSource::Own)
                .count()
        };
        self.layers
            .iter()
            .enumerate()
            .map(|(i, l)| match l.key.codes {
                CodeSource::Own => LayerRole {
                    role: Role::Anchor,
                    group: owners_before(i),
                },
                CodeSource::Layer(s) => LayerRole {
                    role: Role::Reuse,
                    group: owners_before(s),
                },
            })
            .collect()
    }

    /// Layers whose `kind` entry borrows layer `source`'s codes.
    pub fn readers(&self, source: usize, kind: KvKind) -> usize {
        self.layers
            .iter()
            .filter(|l| l.get(kind).codes == CodeSource::Layer(source))
            .count()
    }

    /// The accounting of `tokens` tokens of `rows` heads of dimension `dim` under the
    /// window policy: sinks and the window in f16, the rest quantized in whole groups.
    /// A sliding layer past its window counts the window's tokens alone (what it keeps,
    /// give or take a page), without sinks.
    pub fn bytes_at(&self, tokens: usize, rows: usize, dim: usize) -> PlanBytes {
        let element = (rows * dim * 2) as u64;
        let mut b = PlanBytes::default();
        for l in &self.layers {
            let (tokens, q) = match l.attention_window {
                Some(w) if tokens > w => {
                    let g = self.group_quant_size;
                    (w, w.saturating_sub(self.window) / g * g)
                }
                _ => (tokens, self.quantized_tokens(tokens)),
            };
            let f16_tokens = (tokens - q) as u64;
            for e in [&l.key, &l.value] {
                let spec = e.spec(self.group_quant_size, self.params);
                let r = reference_bytes(e.role(), q, dim, &spec, e.residual_bits);
                b.quantized += (r.compressed * rows) as u64;
                b.quantized_elements += (q * rows * dim) as u64;
                b.total += (r.compressed * rows) as u64 + f16_tokens * element;
                b.fp16 += tokens as u64 * element;
            }
        }
        b
    }

    /// Tokens quantized when a layer holds `tokens` (window policy).
    pub fn quantized_tokens(&self, tokens: usize) -> usize {
        let g = self.group_quant_size;
        let body = tokens.saturating_sub(self.sinks);
        body.saturating_sub(self.window) / g * g
    }

    /// As JSON (the format [`CachePlan::from_json`] reads).
    pub fn to_json(&self) -> Value {
        let entry = |e: &TensorPlan| {
            json!({
                "codes": match e.codes {
                    CodeSource::Own => json!("own"),
                    CodeSource::Layer(l) => json!(l),
                },
                "bits": e.bits,
                "residual_bits": e.residual_bits,
                "axis": e.axis.name(),
                "eta": e.eta,
                "rotation": e.rotation.name(),
                "levels": e.levels.name(),
            })
        };
        json!({
            "format": "xquant-plan",
            "version": 1,
            "name": self.name,
            "window": self.window,
            "sinks": self.sinks,
            "group_quant_size": self.group_quant_size,
            "params": self.params.name(),
            "rotation_seed": self.rotation_seed,
            "layers": self.layers.iter().map(|l| {
                let mut o = json!({
                    "key": entry(&l.key),
                    "value": entry(&l.value),
                });
                if let Some(w) = l.attention_window {
                    o["attention_window"] = json!(w);
                }
                o
            }).collect::<Vec<_>>(),
        })
    }

    /// Reads a plan written by [`CachePlan::to_json`] (or by hand: a reuse entry may leave
    /// out `bits` and `axis`, which are its source's; `residual_bits` and `eta` default to 0;
    /// `name`, `sinks` to `plan`/0). Unknown fields are errors; the plan is validated.
    pub fn from_json(text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| XqError::Config(format!("plan: not JSON: {e}")))?;
        let top = object(&v, "plan")?;
        known(
            top,
            "plan",
            &[
                "format",
                "version",
                "name",
                "window",
                "sinks",
                "group_quant_size",
                "params",
                "rotation_seed",
                "layers",
            ],
        )?;
        if let Some(f) = top.get("format") {
            if f != "xquant-plan" {
                return config_err!("format must be \"xquant-plan\", got {f}");
            }
        }
        if let Some(ver) = top.get("version") {
            if ver != 1 {
                return config_err!("version: this library reads plan version 1, got {ver}");
            }
        }
        let name = match top.get("name") {
            None => "plan".to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(other) => return config_err!("name must be a string, got {other}"),
        };
        let params = match top.get("params") {
            None => ParamsPrecision::F16,
            Some(Value::String(s)) => ParamsPrecision::parse(s)?,
            Some(other) => return config_err!("params must be \"f16\" or \"f32\", got {other}"),
        };
        let layers_v = match top.get("layers") {
            Some(Value::Array(a)) => a,
            _ => return config_err!("layers must be an array with one entry per layer"),
        };
        let mut layers: Vec<LayerPlan> = Vec::with_capacity(layers_v.len());
        for (i, lv) in layers_v.iter().enumerate() {
            let at = format!("layers[{i}]");
            let lo = object(lv, &at)?;
            known(lo, &at, &["key", "value", "attention_window"])?;
            let mut entries = [TensorPlan::own(2, ValueAxis::Tokens); 2];
            for (j, (kind, kv)) in [("key", KvKind::Key), ("value", KvKind::Value)]
                .into_iter()
                .enumerate()
            {
                let at = format!("{at}.{kind}");
                let Some(ev) = lo.get(kind) else {
                    return config_err!("{at} is missing");
                };
                entries[j] = parse_entry(ev, &at, i, &layers, kv)?;
            }
            let attention_window = match lo.get("attention_window") {
                None | Some(Value::Null) => None,
                Some(_) => Some(
                    uint(lo, "attention_window", None)
                        .map_err(|e| XqError::Config(format!("{at}.{}", e.message())))?,
                ),
            };
            layers.push(LayerPlan {
                key: entries[0],
                value: entries[1],
                attention_window,
            });
        }
        let plan = CachePlan {
            name,
            layers,
            window: uint(top, "window", None)?,
            sinks: uint(top, "sinks", Some(0))?,
            group_quant_size: uint(top, "group_quant_size", None)?,
            params,
            rotation_seed: uint(top, "rotation_seed", Some(DEFAULT_ROTATION_SEED as usize))? as u32,
        };
        plan.validate()?;
        Ok(plan)
    }
}

fn object<'a>(v: &'a Value, at: &str) -> Result<&'a Map<String, Value>> {
    v.as_object()
        .ok_or_else(|| XqError::Config(format!("{at} must be an object, got {v}")))
}

fn known(o: &Map<String, Value>, at: &str, fields: &[&str]) -> Result<()> {
    match o.keys().find(|k| !fields.contains(&k.as_str())) {
        Some(k) => config_err!("{at}: unknown field `{k}` (fields: {})", fields.join(", ")),
        None => Ok(()),
    }
}

fn uint(o: &Map<String, Value>, field: &str, default: Option<usize>) -> Result<usize> {
    match (o.get(field), default) {
        (None, Some(d)) => Ok(d),
        (None, None) => config_err!("{field} is missing"),
        (Some(v), _) => v
            .as_u64()
            .filter(|&n| n <= u32::MAX as u64)
            .map(|n| n as usize)
            .ok_or_else(|| {
                XqError::Config(format!("{field} must be a whole number >= 0, got {v}"))
            }),
    }
}

/// One `key`/`value` entry of layer `layer`, given the layers parsed before it.
fn parse_entry(
    v: &Value,
    at: &str,
    layer: usize,
    before: &[LayerPlan],
    kind: KvKind,
) -> Result<TensorPlan> {
    let o = object(v, at)?;
    known(
        o,
        at,
        &[
            "codes",
            "bits",
            "residual_bits",
            "axis",
            "eta",
            "rotation",
            "levels",
        ],
    )?;
    let codes = match o.get("codes") {
        None => CodeSource::Own,
        Some(Value::String(s)) if s == "own" => CodeSource::Own,
        Some(n) => match n.as_u64() {
            Some(l) if l < layer as u64 => CodeSource::Layer(l as usize),
            Some(l) => {
                return config_err!(
                    "{at}.codes: layer {l} is not an earlier layer (codes come from layers \
                     0..{layer})"
                )
            }
            None => {
                return config_err!(
                    "{at}.codes must be \"own\" or an earlier layer's index, got {n}"
                )
            }
        },
    };
    let source = match codes {
        CodeSource::Layer(l) => Some(before[l].get(kind)),
        CodeSource::Own => None,
    };
    let small = |field: &str, default: Option<u8>| -> Result<u8> {
        match (o.get(field), default) {
            (None, Some(d)) => Ok(d),
            (None, None) => config_err!("{at}.{field} is missing"),
            (Some(v), _) => v
                .as_u64()
                .filter(|&n| n <= 255)
                .map(|n| n as u8)
                .ok_or_else(|| {
                    XqError::Config(format!(
                        "{at}.{field} must be a small whole number, got {v}"
                    ))
                }),
        }
    };
    let bits = small("bits", source.map(|s| s.bits))?;
    let axis = match (o.get("axis"), source) {
        (Some(Value::String(s)), _) => ValueAxis::parse(s)
            .map_err(|e| XqError::Config(format!("{at}.axis: {}", e.message())))?,
        (Some(other), _) => {
            return config_err!("{at}.axis must be \"tokens\" or \"channels\", got {other}")
        }
        (None, Some(s)) => s.axis,
        (None, None) => return config_err!("{at}.axis is missing"),
    };
    let eta = match o.get("eta") {
        None => 0.0,
        Some(v) => v
            .as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| XqError::Config(format!("{at}.eta must be a number, got {v}")))?,
    };
    let rotation = match (o.get("rotation"), source) {
        (Some(Value::String(s)), _) => Rotation::parse(s)
            .map_err(|e| XqError::Config(format!("{at}.rotation: {}", e.message())))?,
        (Some(other), _) => {
            return config_err!("{at}.rotation must be \"none\" or \"hadamard\", got {other}")
        }
        (None, Some(s)) => s.rotation,
        (None, None) => Rotation::None,
    };
    let levels = match o.get("levels") {
        None => Levels::Uniform,
        Some(Value::String(s)) => Levels::parse(s)
            .map_err(|e| XqError::Config(format!("{at}.levels: {}", e.message())))?,
        Some(other) => {
            return config_err!("{at}.levels must be \"uniform\" or \"lloyd-max\", got {other}")
        }
    };
    Ok(TensorPlan {
        codes,
        bits,
        residual_bits: small("residual_bits", Some(0))?,
        axis,
        eta,
        rotation,
        levels,
    })
}

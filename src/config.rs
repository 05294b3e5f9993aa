//! Quantization options and tensor shapes, validated once and shared by the CPU reference,
//! the GPU kernels and the cache set.

use serde_json::{json, Value};

use crate::error::{config_err, shape_err, Result};

/// Widest codes with [`Levels::LloydMax`] (16 levels).
pub const MAX_CODEBOOK_BITS: u32 = 4;

/// Largest group size accepted (one invocation walks a whole group).
pub const MAX_GROUP_SIZE: usize = 1024;

/// Largest `|x|` accepted with [`ParamsPrecision::F16`]: keeps every scale, zero and
/// residual range inside f16's finite range (65504), with margin for the residual.
pub const F16_PARAMS_MAX_ABS: f32 = 16000.0;

/// Along which axis quantization groups run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum ValueAxis {
    /// Groups of `group_size` tokens, one scale/zero per group and channel (the reference).
    #[default]
    Tokens,
    /// Groups of `group_size` channels, one scale/zero per token and channel group
    /// (the paper's per-token value quantization).
    Channels,
}

impl ValueAxis {
    /// Parses `tokens` or `channels`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "tokens" => Ok(ValueAxis::Tokens),
            "channels" => Ok(ValueAxis::Channels),
            other => config_err!("value axis must be `tokens` or `channels`, got `{other}`"),
        }
    }

    /// `tokens` or `channels`.
    pub fn name(self) -> &'static str {
        match self {
            ValueAxis::Tokens => "tokens",
            ValueAxis::Channels => "channels",
        }
    }
}

/// What a code stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Levels {
    /// Evenly spaced: `x̂ = code · scale + zero`, a (scale, zero) pair per group (min/max).
    #[default]
    Uniform,
    /// Lloyd–Max levels of a rotated unit vector's coordinate (the density of one
    /// coordinate of a uniform random unit vector in `group_size` dimensions):
    /// `x̂ = ‖x‖ · c[code]`, one norm per group and nothing else
    /// ([`reference::codebook`](crate::reference::codebook)). For per-token groups
    /// (`axis: channels`) of 1..=4 bits that tile their axis exactly, with η 0.
    LloydMax,
}

impl Levels {
    /// Parses `uniform` or `lloyd-max`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "uniform" => Ok(Levels::Uniform),
            "lloyd-max" => Ok(Levels::LloydMax),
            other => config_err!("levels must be \"uniform\" or \"lloyd-max\", got \"{other}\""),
        }
    }

    /// `uniform` or `lloyd-max`.
    pub fn name(self) -> &'static str {
        match self {
            Levels::Uniform => "uniform",
            Levels::LloydMax => "lloyd-max",
        }
    }

    /// Params values stored per group: scale and zero, or the norm alone.
    pub fn params_per_group(self) -> usize {
        match self {
            Levels::Uniform => 2,
            Levels::LloydMax => 1,
        }
    }
}

/// An orthogonal rotation of a tensor's head vectors as they enter the cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Rotation {
    /// Stored as given.
    #[default]
    None,
    /// A randomized Walsh–Hadamard transform per (layer, KV head): ±1 signs from the plan's
    /// `rotation_seed`, then the fast transform scaled by 1/√D (head dims that are powers of
    /// two). Outliers spread over every channel, so per-token groups quantize evenly;
    /// attention rotates the queries and un-rotates its output, `fetch` returns un-rotated K/V.
    Hadamard,
}

impl Rotation {
    /// From its JSON / CLI name.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(Rotation::None),
            "hadamard" => Ok(Rotation::Hadamard),
            other => config_err!("rotation must be \"none\" or \"hadamard\", got \"{other}\""),
        }
    }

    /// Its JSON / CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Rotation::None => "none",
            Rotation::Hadamard => "hadamard",
        }
    }
}

/// How scale/zero pairs are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum ParamsPrecision {
    /// Two halves in one `u32` (the compact default; what the byte accounting charges).
    #[default]
    F16,
    /// Two `f32`s (exact reference conformance).
    F32,
}

impl ParamsPrecision {
    /// Parses `f16` or `f32`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "f16" => Ok(ParamsPrecision::F16),
            "f32" => Ok(ParamsPrecision::F32),
            other => config_err!("params precision must be `f16` or `f32`, got `{other}`"),
        }
    }

    /// `f16` or `f32`.
    pub fn name(self) -> &'static str {
        match self {
            ParamsPrecision::F16 => "f16",
            ParamsPrecision::F32 => "f32",
        }
    }

    /// Bytes one (scale, zero) pair occupies.
    pub fn pair_bytes(self) -> usize {
        match self {
            ParamsPrecision::F16 => 4,
            ParamsPrecision::F32 => 8,
        }
    }

    /// Rounds a value to what storage keeps.
    pub fn store(self, v: f32) -> f32 {
        match self {
            ParamsPrecision::F16 => half::f16::from_f32(v).to_f32(),
            ParamsPrecision::F32 => v,
        }
    }
}

/// Element type of a tensor in memory. Halves travel as pairs in `u32` words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum DType {
    /// 32-bit float.
    #[default]
    F32,
    /// IEEE half, two per `u32` word.
    F16,
}

impl DType {
    /// Parses `f32` or `f16`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(DType::F32),
            "f16" => Ok(DType::F16),
            other => config_err!("dtype must be `f32` or `f16`, got `{other}`"),
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 => 2,
        }
    }

    /// Rounds an f32 to this dtype (the identity for f32).
    pub fn round(self, v: f32) -> f32 {
        match self {
            DType::F32 => v,
            DType::F16 => half::f16::from_f32(v).to_f32(),
        }
    }
}

/// Options of one group quantizer: bit width, group size, axis, calibration and params storage.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuantSpec {
    /// Code width, 1..=8.
    pub bits: u8,
    /// Elements per group along the grouping axis, 1..=[`MAX_GROUP_SIZE`].
    pub group_size: usize,
    /// Grouping axis (tokens = the reference).
    pub axis: ValueAxis,
    /// Data-free calibration η in [0, 0.5]; 0 = the reference.
    pub eta: f32,
    /// Params storage precision.
    pub params: ParamsPrecision,
    /// What the codes stand for.
    pub levels: Levels,
}

impl Default for QuantSpec {
    fn default() -> Self {
        QuantSpec {
            bits: 2,
            group_size: 32,
            axis: ValueAxis::Tokens,
            eta: 0.0,
            params: ParamsPrecision::F16,
            levels: Levels::Uniform,
        }
    }
}

impl QuantSpec {
    /// A spec with the given bits and group size, other fields at their defaults.
    pub fn new(bits: u8, group_size: usize) -> Self {
        QuantSpec {
            bits,
            group_size,
            ..Default::default()
        }
    }

    /// Checks every field; the error names the field and its range.
    pub fn validate(&self) -> Result<()> {
        validate_bits("bits", self.bits)?;
        if self.group_size == 0 || self.group_size > MAX_GROUP_SIZE {
            return config_err!(
                "group_quant_size must be in 1..={MAX_GROUP_SIZE}, got {}",
                self.group_size
            );
        }
        if !(self.eta.is_finite() && (0.0..=0.5).contains(&self.eta)) {
            return config_err!("eta must be in [0, 0.5], got {}", self.eta);
        }
        if self.levels == Levels::LloydMax {
            if self.bits as u32 > MAX_CODEBOOK_BITS {
                return config_err!(
                    "bits must be in 1..={MAX_CODEBOOK_BITS} with levels lloyd-max, got {}",
                    self.bits
                );
            }
            if self.axis != ValueAxis::Channels {
                return config_err!(
                    "levels lloyd-max needs axis channels (a norm per token and group of \
                     channels), got axis {}",
                    self.axis.name()
                );
            }
            if self.group_size < 2 {
                return config_err!(
                    "group_quant_size must be at least 2 with levels lloyd-max, got {}",
                    self.group_size
                );
            }
            if self.eta != 0.0 {
                return config_err!(
                    "eta must be 0 with levels lloyd-max (the levels are fixed), got {}",
                    self.eta
                );
            }
        }
        Ok(())
    }

    /// Checks that codes of this spec may be borrowed (decoded with a reuse layer's own
    /// scale and zero): Lloyd–Max codes may not.
    pub fn check_borrowable(&self) -> Result<()> {
        if self.levels == Levels::LloydMax {
            return config_err!(
                "levels lloyd-max codes are not borrowed: a reuse layer fits (scale, zero) to \
                 uniform codes"
            );
        }
        Ok(())
    }

    /// Checks the groups tile an axis of `len` exactly where the levels need it (Lloyd–Max
    /// levels are made for whole groups of `group_size` members).
    pub fn check_axis(&self, len: usize) -> Result<()> {
        if self.levels == Levels::LloydMax && len % self.group_size != 0 {
            return config_err!(
                "levels lloyd-max needs group_quant_size ({}) to divide the grouped axis ({len})",
                self.group_size
            );
        }
        Ok(())
    }

    /// The spec of the residual quantizer of a reuse layer: same groups, its own bits,
    /// no calibration.
    pub fn residual(&self, residual_bits: u8) -> QuantSpec {
        QuantSpec {
            bits: residual_bits,
            eta: 0.0,
            levels: Levels::Uniform,
            ..*self
        }
    }

    /// `2^bits - 1`.
    pub fn levels(&self) -> u32 {
        (1u32 << self.bits) - 1
    }
}

/// Checks a code width is in 1..=8.
pub fn validate_bits(name: &str, bits: u8) -> Result<()> {
    if !(1..=8).contains(&bits) {
        return config_err!("{name} must be in 1..=8, got {bits}");
    }
    Ok(())
}

/// Shape `[..., N, D]` of a K or V tensor: leading axes (batch, heads) flatten into rows.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorShape {
    dims: Vec<usize>,
}

impl TensorShape {
    /// Validates rank ≥ 2, no empty axis, and an element count that fits a `u32` index.
    pub fn new(dims: &[usize]) -> Result<Self> {
        if dims.len() < 2 {
            return shape_err!("expected a shape [..., N, D] of rank >= 2, got {dims:?}");
        }
        if dims.contains(&0) {
            return shape_err!("empty tensor: shape {dims:?} has a zero axis");
        }
        let n = dims
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n < (1usize << 31));
        if n.is_none() {
            return shape_err!("shape {dims:?} has too many elements (limit 2^31)");
        }
        Ok(TensorShape {
            dims: dims.to_vec(),
        })
    }

    /// `[rows, tokens, dim]`.
    pub fn from_rows(rows: usize, tokens: usize, dim: usize) -> Result<Self> {
        TensorShape::new(&[rows, tokens, dim])
    }

    /// All axes.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// Product of the leading axes (batch × heads).
    pub fn rows(&self) -> usize {
        self.dims[..self.dims.len() - 2].iter().product()
    }

    /// N, the token axis.
    pub fn tokens(&self) -> usize {
        self.dims[self.dims.len() - 2]
    }

    /// D, the channel axis.
    pub fn dim(&self) -> usize {
        self.dims[self.dims.len() - 1]
    }

    /// Total elements.
    pub fn len(&self) -> usize {
        self.dims.iter().product()
    }

    /// Always false: shapes are validated non-empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Checks a flat buffer length against the shape.
    pub fn check_len(&self, len: usize, what: &str) -> Result<()> {
        if len != self.len() {
            return shape_err!(
                "{what}: {len} elements do not match shape {:?} ({} elements)",
                self.dims,
                self.len()
            );
        }
        Ok(())
    }
}

/// Checks every value is finite, and within the f16 params range when params are f16.
pub fn check_values(x: &[f32], params: ParamsPrecision, what: &str) -> Result<()> {
    for (i, &v) in x.iter().enumerate() {
        if !v.is_finite() {
            return Err(crate::error::XqError::NonFinite(format!(
                "{what}: element {i} is {v}"
            )));
        }
        if params == ParamsPrecision::F16 && v.abs() > F16_PARAMS_MAX_ABS {
            return Err(crate::error::XqError::NonFinite(format!(
                "{what}: element {i} = {v} exceeds ±{F16_PARAMS_MAX_ABS}, the range f16 params \
                 can hold; use params f32"
            )));
        }
    }
    Ok(())
}

/// XQuant options of an analysis (and of a cache set).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct XQuantConfig {
    /// Layers per group (1 = no sharing; the reference's `group_size`).
    pub layers_per_group: usize,
    /// Anchor code width (of values, and of keys unless `key_bits` says otherwise).
    pub base_bits: u8,
    /// Keys' anchor code width; 0: `base_bits`.
    pub key_bits: u8,
    /// Residual code width of reuse layers (0 = pure reuse).
    pub residual_bits: u8,
    /// Elements per quantization group.
    pub group_quant_size: usize,
    /// Data-free calibration η.
    pub eta: f32,
    /// Grouping axis of values (keys always group along tokens).
    pub value_axis: ValueAxis,
    /// Params storage.
    pub params: ParamsPrecision,
    /// What the values' codes stand for (Lloyd–Max levels: per-token groups only).
    pub value_levels: Levels,
    /// Rotation of the values as they enter the cache (keys are never rotated by these
    /// options; a plan can rotate them).
    pub value_rotation: Rotation,
}

impl Default for XQuantConfig {
    fn default() -> Self {
        XQuantConfig {
            layers_per_group: 2,
            base_bits: 2,
            key_bits: 0,
            residual_bits: 4,
            group_quant_size: 32,
            eta: 0.0,
            value_axis: ValueAxis::Tokens,
            params: ParamsPrecision::F16,
            value_levels: Levels::Uniform,
            value_rotation: Rotation::None,
        }
    }
}

/// Keys or values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvKind {
    /// Keys (grouped along tokens).
    Key,
    /// Values (grouped along `value_axis`).
    Value,
}

impl KvKind {
    /// 0 for keys, 1 for values (the kind of a rotation's sign stream).
    pub fn index(self) -> u32 {
        match self {
            KvKind::Key => 0,
            KvKind::Value => 1,
        }
    }
}

impl XQuantConfig {
    /// Checks every option.
    pub fn validate(&self) -> Result<()> {
        if self.layers_per_group == 0 {
            return config_err!("group_size (layers per group) must be >= 1, got 0");
        }
        if self.residual_bits != 0 {
            validate_bits("residual_bits", self.residual_bits)?;
        }
        if self.key_bits != 0 {
            validate_bits("key_bits", self.key_bits)?;
        }
        if self.value_levels == Levels::LloydMax && self.value_axis != ValueAxis::Channels {
            return config_err!(
                "value_levels lloyd-max needs value_axis channels (a norm per token and group \
                 of channels), got value_axis {}",
                self.value_axis.name()
            );
        }
        self.spec(KvKind::Key).validate()?;
        self.spec(KvKind::Value).validate()
    }

    /// The keys' (or values') anchor code width.
    pub fn bits(&self, kind: KvKind) -> u8 {
        match kind {
            KvKind::Key if self.key_bits != 0 => self.key_bits,
            _ => self.base_bits,
        }
    }

    /// The quantizer of keys or values.
    pub fn spec(&self, kind: KvKind) -> QuantSpec {
        QuantSpec {
            bits: self.bits(kind),
            group_size: self.group_quant_size,
            axis: match kind {
                KvKind::Key => ValueAxis::Tokens,
                KvKind::Value => self.value_axis,
            },
            eta: self.eta,
            params: self.params,
            levels: match kind {
                KvKind::Key => Levels::Uniform,
                KvKind::Value => self.value_levels,
            },
        }
    }

    /// As JSON (the `config` object of reports).
    pub fn to_json(&self) -> Value {
        json!({
            "group_size": self.layers_per_group,
            "base_bits": self.base_bits,
            "key_bits": self.bits(KvKind::Key),
            "residual_bits": self.residual_bits,
            "group_quant_size": self.group_quant_size,
            "eta": self.eta,
            "value_axis": self.value_axis.name(),
            "params": self.params.name(),
            "value_levels": self.value_levels.name(),
            "value_rotation": self.value_rotation.name(),
        })
    }
}

//! The storage format of quantized tensors, shared by the CPU reference and the WGSL kernels.
//!
//! A tensor `[R, N, D]` (R = batch × heads) is cut into groups along one axis:
//! with [`ValueAxis::Tokens`] a group is `group_size` consecutive tokens of one channel
//! (the "other" index `o` is the channel, `O = D`); with [`ValueAxis::Channels`] it is
//! `group_size` consecutive channels of one token (`o` is the token, `O = N`).
//! A partial last group is padded by repeating its last element (the reference's padding).
//!
//! * **Params** `[R, n_groups, O]`: one (scale, zero) pair per group and other-index,
//!   as `pack2x16float(scale, zero)` (f16) or two `f32` words (f32). With
//!   [`Levels::LloydMax`] a cell keeps only its norm: word `c` (f32) or, in f16, half `o` of
//!   row `(r, g)`, each row starting a word (an odd `O` pads its last word): half
//!   [`GroupLayout::norm_half`].
//! * **Codes** `[R, n_groups, words_per_group, O]` `u32` words. Within a group, code `i`
//!   occupies bits `[i·bits, (i+1)·bits)` of the group's little-endian bit stream
//!   (a code may straddle two words when 32 is not a multiple of `bits`);
//!   `words_per_group = ceil(group_size·bits / 32)`. Word `w` of group `(r, g)` for
//!   other-index `o` sits at `((r·n_groups + g)·words_per_group + w)·O + o`, so
//!   neighbouring invocations (neighbouring `o`) touch neighbouring words.
//!
//! With `group_size·bits` a multiple of 32 (e.g. the default group of 32) every bit is used.

use crate::config::{Levels, ParamsPrecision, QuantSpec, TensorShape, ValueAxis};

/// Geometry of one quantized tensor: where every group, code word and param lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupLayout {
    /// R: flattened leading axes.
    pub rows: usize,
    /// N: tokens.
    pub tokens: usize,
    /// D: channels.
    pub dim: usize,
    /// Elements per group along the grouping axis.
    pub group_size: usize,
    /// Grouping axis.
    pub axis: ValueAxis,
    /// Code width.
    pub bits: u8,
    /// What the codes stand for (and so how many params a group keeps).
    pub levels: Levels,
}

impl GroupLayout {
    /// The layout of `shape` quantized with `spec`.
    pub fn new(shape: &TensorShape, spec: &QuantSpec) -> Self {
        GroupLayout {
            rows: shape.rows(),
            tokens: shape.tokens(),
            dim: shape.dim(),
            group_size: spec.group_size,
            axis: spec.axis,
            bits: spec.bits,
            levels: spec.levels,
        }
    }

    /// The same groups with another code width (the residual of a reuse layer).
    pub fn with_bits(self, bits: u8) -> Self {
        GroupLayout { bits, ..self }
    }

    /// Length of the grouping axis (N for tokens, D for channels).
    pub fn group_axis_len(&self) -> usize {
        match self.axis {
            ValueAxis::Tokens => self.tokens,
            ValueAxis::Channels => self.dim,
        }
    }

    /// O: length of the other axis (D for tokens, N for channels).
    pub fn other(&self) -> usize {
        match self.axis {
            ValueAxis::Tokens => self.dim,
            ValueAxis::Channels => self.tokens,
        }
    }

    /// Groups per row: `ceil(group_axis_len / group_size)`.
    pub fn n_groups(&self) -> usize {
        self.group_axis_len().div_ceil(self.group_size)
    }

    /// Real (unpadded) members of group `g`.
    pub fn valid(&self, g: usize) -> usize {
        (self.group_axis_len() - g * self.group_size).min(self.group_size)
    }

    /// `u32` words holding one group's codes for one other-index.
    pub fn words_per_group(&self) -> usize {
        (self.group_size * self.bits as usize).div_ceil(32)
    }

    /// Number of (group, other-index) cells: one param pair each.
    pub fn cells(&self) -> usize {
        self.rows * self.n_groups() * self.other()
    }

    /// `u32` words of the params of every cell at `precision`.
    pub fn params_words(&self, precision: ParamsPrecision) -> usize {
        match (self.levels, precision) {
            (Levels::Uniform, p) => self.cells() * p.pair_bytes() / 4,
            (Levels::LloydMax, ParamsPrecision::F32) => self.cells(),
            (Levels::LloydMax, ParamsPrecision::F16) => self.norm_rows() * self.norm_row_words(),
        }
    }

    /// Bytes of the params of every cell at `precision`.
    pub fn params_bytes(&self, precision: ParamsPrecision) -> usize {
        4 * self.params_words(precision)
    }

    /// Rows `(r, g)` of f16 norms ([`Levels::LloydMax`]).
    fn norm_rows(&self) -> usize {
        self.rows * self.n_groups()
    }

    /// Words of one row `(r, g)` of f16 norms: `O` halves, a lone last one padding its word.
    pub fn norm_row_words(&self) -> usize {
        self.other().div_ceil(2)
    }

    /// Half index of cell `(r, g, o)`'s f16 norm: row `(r, g)` starts a word.
    pub fn norm_half(&self, r: usize, g: usize, o: usize) -> usize {
        (r * self.n_groups() + g) * 2 * self.norm_row_words() + o
    }

    /// Packs norms `[R, n_groups, O]` ([`Levels::LloydMax`]) into their words at `precision`.
    pub fn pack_norms(&self, norms: &[f32], precision: ParamsPrecision) -> Vec<u32> {
        match precision {
            ParamsPrecision::F32 => norms.iter().map(|v| v.to_bits()).collect(),
            ParamsPrecision::F16 => {
                let mut words = vec![0u32; self.params_words(precision)];
                for r in 0..self.rows {
                    for g in 0..self.n_groups() {
                        for o in 0..self.other() {
                            let h = self.norm_half(r, g, o);
                            let bits = half::f16::from_f32(norms[self.cell(r, g, o)]).to_bits();
                            words[h / 2] |= u32::from(bits) << (16 * (h % 2));
                        }
                    }
                }
                words
            }
        }
    }

    /// Unpacks norms `[R, n_groups, O]` from their words at `precision`.
    pub fn unpack_norms(&self, words: &[u32], precision: ParamsPrecision) -> Vec<f32> {
        match precision {
            ParamsPrecision::F32 => words[..self.cells()]
                .iter()
                .map(|&w| f32::from_bits(w))
                .collect(),
            ParamsPrecision::F16 => {
                let mut norms = vec![0f32; self.cells()];
                for r in 0..self.rows {
                    for g in 0..self.n_groups() {
                        for o in 0..self.other() {
                            let h = self.norm_half(r, g, o);
                            let bits = (words[h / 2] >> (16 * (h % 2))) as u16;
                            norms[self.cell(r, g, o)] = half::f16::from_bits(bits).to_f32();
                        }
                    }
                }
                norms
            }
        }
    }

    /// Total code words.
    pub fn code_words(&self) -> usize {
        self.cells() * self.words_per_group()
    }

    /// Bytes of packed codes.
    pub fn code_bytes(&self) -> usize {
        4 * self.code_words()
    }

    /// Elements of the tensor.
    pub fn elements(&self) -> usize {
        self.rows * self.tokens * self.dim
    }

    /// Flat `[R, N, D]` index of member `i` of group `g` at other-index `o` in row `r`;
    /// padding members map to the group's last real element.
    pub fn element(&self, r: usize, g: usize, i: usize, o: usize) -> usize {
        let k = (g * self.group_size + i).min(self.group_axis_len() - 1);
        let (t, d) = match self.axis {
            ValueAxis::Tokens => (k, o),
            ValueAxis::Channels => (o, k),
        };
        (r * self.tokens + t) * self.dim + d
    }

    /// `(r, g, i, o)` of flat element `e` (inverse of [`GroupLayout::element`] for real members).
    pub fn locate(&self, e: usize) -> (usize, usize, usize, usize) {
        let d = e % self.dim;
        let t = (e / self.dim) % self.tokens;
        let r = e / (self.dim * self.tokens);
        let (k, o) = match self.axis {
            ValueAxis::Tokens => (t, d),
            ValueAxis::Channels => (d, t),
        };
        (r, k / self.group_size, k % self.group_size, o)
    }

    /// Index of cell `(r, g, o)` in the params array `[R, n_groups, O]`.
    pub fn cell(&self, r: usize, g: usize, o: usize) -> usize {
        (r * self.n_groups() + g) * self.other() + o
    }

    /// Index of member `i` of cell `(r, g, o)` in unpacked codes `[R, n_groups, group_size, O]`.
    pub fn code_index(&self, r: usize, g: usize, i: usize, o: usize) -> usize {
        ((r * self.n_groups() + g) * self.group_size + i) * self.other() + o
    }

    /// Unpacked code count `R · n_groups · group_size · O` (padding included).
    pub fn unpacked_len(&self) -> usize {
        self.cells() * self.group_size
    }

    /// Packs codes `[R, n_groups, group_size, O]` into the word layout described above.
    pub fn pack(&self, codes: &[u8]) -> Vec<u32> {
        let (ng, other, wpg, bits) = (
            self.n_groups(),
            self.other(),
            self.words_per_group(),
            self.bits as usize,
        );
        let mut words = vec![0u32; self.code_words()];
        for r in 0..self.rows {
            for g in 0..ng {
                let base = (r * ng + g) * wpg;
                for i in 0..self.group_size {
                    let (w, off) = ((i * bits) / 32, (i * bits) % 32);
                    for o in 0..other {
                        let c = codes[self.code_index(r, g, i, o)] as u64;
                        let wide = c << off;
                        words[(base + w) * other + o] |= wide as u32;
                        if off + bits > 32 {
                            words[(base + w + 1) * other + o] |= (wide >> 32) as u32;
                        }
                    }
                }
            }
        }
        words
    }

    /// Unpacks words into codes `[R, n_groups, group_size, O]`.
    pub fn unpack(&self, words: &[u32]) -> Vec<u8> {
        let (ng, other, wpg, bits) = (
            self.n_groups(),
            self.other(),
            self.words_per_group(),
            self.bits as usize,
        );
        let mask = (1u64 << bits) - 1;
        let mut codes = vec![0u8; self.unpacked_len()];
        for r in 0..self.rows {
            for g in 0..ng {
                let base = (r * ng + g) * wpg;
                for i in 0..self.group_size {
                    let (w, off) = ((i * bits) / 32, (i * bits) % 32);
                    for o in 0..other {
                        let mut wide = words[(base + w) * other + o] as u64;
                        if off + bits > 32 {
                            wide |= (words[(base + w + 1) * other + o] as u64) << 32;
                        }
                        codes[self.code_index(r, g, i, o)] = ((wide >> off) & mask) as u8;
                    }
                }
            }
        }
        codes
    }
}

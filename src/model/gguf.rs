//! GGUF v2/v3 reader: header, metadata, tensor table, and the tensor types this runtime
//! reads (F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K), each
//! with its CPU dequantization (ggml's block layouts, documented on the variants). Every
//! malformed input is a typed `IoError`.

use std::collections::BTreeMap;

use crate::error::{Result, XqError};

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Meta {
    /// Any unsigned integer.
    U64(u64),
    /// Any signed integer.
    I64(i64),
    /// f32 or f64.
    F64(f64),
    /// bool.
    Bool(bool),
    /// UTF-8 string.
    Str(String),
    /// Array of values.
    Array(Vec<Meta>),
}

impl Meta {
    /// As an unsigned integer, when it is one.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Meta::U64(v) => Some(*v),
            Meta::I64(v) if *v >= 0 => Some(*v as u64),
            _ => None,
        }
    }

    /// As a float, when numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Meta::F64(v) => Some(*v),
            Meta::U64(v) => Some(*v as f64),
            Meta::I64(v) => Some(*v as f64),
            _ => None,
        }
    }

    /// As a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Meta::Str(s) => Some(s),
            _ => None,
        }
    }

    /// As an array.
    pub fn as_array(&self) -> Option<&[Meta]> {
        match self {
            Meta::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Tensor element types this runtime reads. Block layouts are ggml's; `d`, `m`, `dmin` are
/// little-endian f16, and a block's 32 (or 256) weights are numbered `x[0..]`.
#[allow(non_camel_case_types)] // ggml's names
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// Blocks of 32 in 18 bytes: `d`, 16 bytes of nibbles (`x[j]` low, `x[j + 16]` high);
    /// x = d·(q − 8).
    Q4_0,
    /// Blocks of 32 in 20 bytes: `d`, `m`, 16 bytes of nibbles as in Q4_0; x = d·q + m.
    Q4_1,
    /// Blocks of 32 in 22 bytes: `d`, a u32 of fifth bits (bit j for `x[j]`), nibbles as in
    /// Q4_0; x = d·(q − 16).
    Q5_0,
    /// Blocks of 32 in 24 bytes: `d`, `m`, fifth bits and nibbles as in Q5_0; x = d·q + m.
    Q5_1,
    /// Blocks of 32 in 34 bytes: `d`, 32 int8; x = d·q.
    Q8_0,
    /// Super-blocks of 256 in 144 bytes: `d`, `dmin`, 12 bytes of 6-bit scales and mins for
    /// 8 sub-blocks of 32, 128 bytes of nibbles (per 64 weights: 32 bytes, low nibbles the
    /// first sub-block, high the second); x = d·sc·q − dmin·mn.
    Q4_K,
    /// Super-blocks of 256 in 176 bytes: as Q4_K with 32 bytes of fifth bits before the
    /// nibbles (bit 2i, 2i + 1 of byte l for weight l of the 64-weight pair i).
    Q5_K,
    /// Super-blocks of 256 in 210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs,
    /// 16 int8 scales (one per 16 weights), `d` last; x = d·sc·(q − 32).
    Q6_K,
}

impl GgmlType {
    /// Every type this reader knows.
    pub const ALL: [GgmlType; 10] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    fn from_id(id: u32, name: &str) -> Result<Self> {
        Ok(match Self::ALL.into_iter().find(|t| t.id() == id) {
            Some(t) => t,
            None => {
                let other = id;
                let known = match other {
                    9 => " (Q8_1)",
                    10 => " (Q2_K)",
                    11 => " (Q3_K)",
                    15 => " (Q8_K)",
                    16..=23 | 29 => " (an IQ type)",
                    30 => " (BF16)",
                    _ => "",
                };
                return Err(format_err(format!(
                    "tensor {name}: GGML type {other}{known} is not supported (F32, F16, Q4_0, \
                     Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K are)"
                )));
            }
        })
    }

    /// The type's GGML id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
        }
    }

    /// (elements, bytes) per block.
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4_K => (256, 144),
            GgmlType::Q5_K => (256, 176),
            GgmlType::Q6_K => (256, 210),
        }
    }
}

/// One tensor's entry in the table.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// GGUF order: `dims[0]` is the contiguous (inner) axis.
    pub dims: Vec<usize>,
    /// Element type.
    pub ty: GgmlType,
    /// Byte offset of the data in the file.
    pub offset: usize,
    /// Bytes of data.
    pub bytes: usize,
}

impl TensorInfo {
    /// Elements.
    pub fn elements(&self) -> usize {
        self.dims.iter().product()
    }
}

/// A parsed GGUF file (the bytes stay with the caller).
#[derive(Clone, Debug)]
pub struct Gguf {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata by key.
    pub meta: BTreeMap<String, Meta>,
    /// Tensors by name.
    pub tensors: BTreeMap<String, TensorInfo>,
}

fn format_err(msg: String) -> XqError {
    XqError::Format(msg)
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| {
            format_err(format!(
                "truncated GGUF: {n} bytes wanted at offset {}",
                self.pos
            ))
        })?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count of items that take at least `min_bytes` each in the file: a count the bytes
    /// left cannot hold is an error, so what is allocated for the items stays proportional
    /// to the file.
    fn len(&mut self, what: &str, min_bytes: usize) -> Result<usize> {
        let n = self.u64()?;
        let left = (self.bytes.len() - self.pos) as u64;
        if n.checked_mul(min_bytes as u64).is_none_or(|b| b > left) {
            return Err(format_err(format!(
                "corrupt GGUF: {what} count {n} exceeds the file"
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String> {
        let n = self.len("string length", 1)?;
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| format_err("corrupt GGUF: a string is not UTF-8".into()))
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<Meta> {
        Ok(match ty {
            0 => Meta::U64(self.array::<1>()?[0] as u64),
            1 => Meta::I64(self.array::<1>()?[0] as i8 as i64),
            2 => Meta::U64(u16::from_le_bytes(self.array()?) as u64),
            3 => Meta::I64(i16::from_le_bytes(self.array()?) as i64),
            4 => Meta::U64(self.u32()? as u64),
            5 => Meta::I64(i32::from_le_bytes(self.array()?) as i64),
            6 => Meta::F64(f32::from_le_bytes(self.array()?) as f64),
            7 => Meta::Bool(self.array::<1>()?[0] != 0),
            8 => Meta::Str(self.string()?),
            9 if depth < 4 => {
                let elem = self.u32()?;
                let n = self.len("array", value_bytes(elem))?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(elem, depth + 1)?);
                }
                Meta::Array(v)
            }
            10 => Meta::U64(self.u64()?),
            11 => Meta::I64(i64::from_le_bytes(self.array()?)),
            12 => Meta::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(format_err(format!("corrupt GGUF: metadata type {other}"))),
        })
    }
}

/// The fewest bytes a metadata value of type `ty` takes in the file.
fn value_bytes(ty: u32) -> usize {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        // A string: its length; an array: element type and count.
        8 | 10..=12 => 8,
        9 => 12,
        // Unknown types fail on the first element.
        _ => 1,
    }
}

/// A file's u64 as usize; on 32-bit targets (wasm32) a value past usize is an error rather
/// than a wrapped small number.
fn size(v: u64, what: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| format_err(format!("corrupt GGUF: {what} {v} is too large")))
}

impl Gguf {
    /// Parses the header, metadata and tensor table of `bytes`, checking every tensor lies
    /// inside the file.
    pub fn parse(bytes: &[u8]) -> Result<Gguf> {
        let mut r = Reader { bytes, pos: 0 };
        if r.take(4).ok() != Some(b"GGUF".as_slice()) {
            return Err(format_err("not a GGUF file (no GGUF magic)".into()));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(format_err(format!(
                "GGUF version {version} is not supported (2 and 3 are)"
            )));
        }
        // A tensor entry takes at least 32 bytes (name length, one dim, type, offset), a
        // metadata entry at least 13 (key length, type, a one-byte value).
        let n_tensors = r.len("tensor", 32)?;
        let n_meta = r.len("metadata", 13)?;
        let mut meta = BTreeMap::new();
        for _ in 0..n_meta {
            let key = r.string()?;
            let ty = r.u32()?;
            meta.insert(key, r.value(ty, 0)?);
        }
        let mut infos = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()? as usize;
            if n_dims == 0 || n_dims > 4 {
                return Err(format_err(format!("tensor {name}: {n_dims} dimensions")));
            }
            let dims = (0..n_dims)
                .map(|_| size(r.u64()?, "tensor dimension"))
                .collect::<Result<Vec<_>>>()?;
            let ty = GgmlType::from_id(r.u32()?, &name)?;
            let offset = size(r.u64()?, "tensor offset")?;
            infos.push((name, dims, ty, offset));
        }
        let alignment = match meta.get("general.alignment") {
            None => 32,
            Some(a) => a.as_u64().filter(|a| a.is_power_of_two()).ok_or_else(|| {
                format_err(format!(
                    "corrupt GGUF: general.alignment {a:?} is not a power of two"
                ))
            })?,
        };
        let data_start = (r.pos as u64)
            .div_ceil(alignment)
            .checked_mul(alignment)
            .and_then(|s| usize::try_from(s).ok())
            .ok_or_else(|| {
                format_err(format!(
                    "truncated GGUF: data aligned to {alignment} starts past the end"
                ))
            })?;
        let mut tensors = BTreeMap::new();
        for (name, dims, ty, offset) in infos {
            let elements = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            let (per_block, block_bytes) = ty.block();
            let bytes_len = elements
                .filter(|e| e % per_block == 0)
                .and_then(|e| (e / per_block).checked_mul(block_bytes))
                .ok_or_else(|| {
                    format_err(format!(
                        "tensor {name}: shape {dims:?} does not fit {ty:?} blocks"
                    ))
                })?;
            let start = data_start.checked_add(offset);
            if start
                .and_then(|s| s.checked_add(bytes_len))
                .is_none_or(|end| end > bytes.len())
            {
                return Err(format_err(format!(
                    "truncated GGUF: tensor {name} runs past the end of the file"
                )));
            }
            tensors.insert(
                name.clone(),
                TensorInfo {
                    name,
                    dims,
                    ty,
                    offset: data_start + offset,
                    bytes: bytes_len,
                },
            );
        }
        Ok(Gguf {
            version,
            meta,
            tensors,
        })
    }

    /// A metadata value, or an error naming the key.
    pub fn get(&self, key: &str) -> Result<&Meta> {
        self.meta
            .get(key)
            .ok_or_else(|| format_err(format!("GGUF metadata lacks {key}")))
    }

    /// An integer metadata value.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get(key)?
            .as_u64()
            .ok_or_else(|| format_err(format!("GGUF metadata {key} is not an integer")))
    }

    /// A float metadata value.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.get(key)?
            .as_f64()
            .ok_or_else(|| format_err(format!("GGUF metadata {key} is not a number")))
    }

    /// A tensor's entry, or an error naming it.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .get(name)
            .ok_or_else(|| format_err(format!("GGUF has no tensor {name}")))
    }
}

/// Dequantizes a tensor's bytes to f32 (CPU; tests, the reference forward, and weights the
/// GPU reads as f32). A trailing partial block is ignored.
pub fn dequantize(data: &[u8], ty: GgmlType) -> Vec<f32> {
    let (per_block, block_bytes) = ty.block();
    let mut out = vec![0.0f32; data.len() / block_bytes * per_block];
    for (b, y) in data
        .chunks_exact(block_bytes)
        .zip(out.chunks_exact_mut(per_block))
    {
        dequantize_block(b, ty, y);
    }
    out
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// The 32 codes of a Q4/Q5 block: nibble j of `qs` gives code j (low) and code j + 16
/// (high); bit i of `qh` is code i's fifth bit.
fn block_codes(qs: &[u8], qh: u32) -> [u32; 32] {
    std::array::from_fn(|i| {
        let nibble = (qs[i % 16] >> (4 * (i / 16))) & 15;
        nibble as u32 | (((qh >> i) & 1) << 4)
    })
}

/// A Q4_0 or Q5_0 block as its f16 scale's bytes and signed codes, x = d·code: a Q8_0
/// block's form, exactly (the GPU's matmuls centre the codes the same way). `None` for other
/// types.
pub fn signed_codes(b: &[u8], ty: GgmlType) -> Option<([u8; 2], [i8; 32])> {
    let (codes, offset) = match ty {
        GgmlType::Q4_0 => (block_codes(&b[2..], 0), 8),
        GgmlType::Q5_0 => {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            (block_codes(&b[6..], qh), 16)
        }
        _ => return None,
    };
    Some(([b[0], b[1]], codes.map(|q| q as i8 - offset)))
}

/// 32 weights as `scale · code + offset` with integer codes: the form every block type with
/// a min (Q4_1, Q5_1, Q4_K, Q5_K) or with sub-block scales (Q6_K) takes exactly in f32 (the
/// GPU reads them so).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AffineBlock {
    /// Step between codes.
    pub scale: f32,
    /// Value of code 0.
    pub offset: f32,
    /// The codes (Q6_K's: its sub-block scale times its 6-bit code − 32).
    pub codes: [i16; 32],
}

/// A block of `ty` as its blocks of 32 in affine form (Q4_1, Q5_1: one; K-quants: eight);
/// `None` for other types. Each weight is exactly `scale · code + offset`: a K-quant's
/// sub-block scale and min times the super-block's f16 ones are products of an f16 and a
/// 6-bit integer, and Q6_K's `d · sc · (q − 32)` multiplies at most 24 significant bits.
pub fn affine_blocks(b: &[u8], ty: GgmlType) -> Option<Vec<AffineBlock>> {
    let codes16 = |c: [u32; 32]| c.map(|q| q as i16);
    Some(match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 => {
            let codes = match ty {
                GgmlType::Q5_1 => {
                    block_codes(&b[8..], u32::from_le_bytes([b[4], b[5], b[6], b[7]]))
                }
                _ => block_codes(&b[4..], 0),
            };
            vec![AffineBlock {
                scale: f16_at(b, 0),
                offset: f16_at(b, 2),
                codes: codes16(codes),
            }]
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let (qh, qs) = match ty {
                GgmlType::Q5_K => (Some(&b[16..48]), &b[48..176]),
                _ => (None, &b[16..144]),
            };
            // Four runs of 64 weights: 32 bytes of nibbles each, low nibbles sub-block 2i,
            // high nibbles sub-block 2i + 1.
            (0..8)
                .map(|sub| {
                    let (q, half) = (&qs[32 * (sub / 2)..], sub % 2);
                    let (sc, mn) = k_scale_min(scales, sub);
                    AffineBlock {
                        scale: d * sc as f32,
                        offset: -(dmin * mn as f32),
                        codes: std::array::from_fn(|l| {
                            let nib = (q[l] >> (4 * half)) & 15;
                            let fifth = qh.map_or(0, |h| ((h[l] >> sub) & 1) << 4);
                            (nib | fifth) as i16
                        }),
                    }
                })
                .collect()
        }
        GgmlType::Q6_K => {
            let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
            let d = f16_at(b, 208);
            // Two runs of 128 weights (64 bytes of `ql`, 32 of `qh`, 8 scales each), of four
            // blocks of 32 (k), each with two sub-block scales (weights 0–15 and 16–31).
            (0..8)
                .map(|blk| {
                    let (n, k) = (blk / 4, blk % 4);
                    let (ql, qh, sc) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..]);
                    let codes = std::array::from_fn(|l| {
                        let low = match k {
                            0 => ql[l] & 15,
                            1 => ql[l + 32] & 15,
                            2 => ql[l] >> 4,
                            _ => ql[l + 32] >> 4,
                        };
                        let q = low | (((qh[l] >> (2 * k)) & 3) << 4);
                        let s = sc[l / 16 + 2 * k] as i8 as i16;
                        s * (q as i16 - 32)
                    });
                    AffineBlock {
                        scale: d,
                        offset: 0.0,
                        codes,
                    }
                })
                .collect()
        }
        _ => return None,
    })
}

/// One block of `ty` into `y` (its `ty.block().0` weights).
fn dequantize_block(b: &[u8], ty: GgmlType, y: &mut [f32]) {
    if let Some(blocks) = affine_blocks(b, ty) {
        for (a, y) in blocks.iter().zip(y.chunks_exact_mut(32)) {
            for (o, &q) in y.iter_mut().zip(&a.codes) {
                *o = a.scale * q as f32 + a.offset;
            }
        }
        return;
    }
    match ty {
        GgmlType::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => y[0] = f16_at(b, 0),
        GgmlType::Q8_0 => {
            let d = f16_at(b, 0);
            for (o, &q) in y.iter_mut().zip(&b[2..]) {
                *o = d * q as i8 as f32;
            }
        }
        GgmlType::Q4_0 | GgmlType::Q5_0 => {
            let (d, codes) = signed_codes(b, ty).unwrap_or_default();
            let d = half::f16::from_le_bytes(d).to_f32();
            for (o, q) in y.iter_mut().zip(codes) {
                *o = d * q as f32;
            }
        }
        // The types with a min or sub-block scales went through `affine_blocks` above.
        _ => {}
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K super-block: sub-blocks
/// 0–3 in the low 6 bits of bytes `j` and `j + 4`; 4–7 in the nibbles of byte `j + 4` with
/// their top 2 bits in the high bits of bytes `j − 4` and `j`.
pub fn k_scale_min(scales: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 15) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    }
}

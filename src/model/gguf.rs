//! GGUF v2/v3 reader: header, metadata, tensor table, and the tensor types this runtime
//! uses (F32, F16, Q8_0, Q4_1). Every malformed input is a typed `IoError`.

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

/// Tensor element types this runtime reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// Blocks of 32: f16 scale d, 16 bytes of nibbles; x = d·q + m with an f16 min m.
    Q4_1,
    /// Blocks of 32: f16 scale d, 32 int8; x = d·q.
    Q8_0,
}

impl GgmlType {
    fn from_id(id: u32, name: &str) -> Result<Self> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            other => {
                return Err(format_err(format!(
                    "tensor {name}: GGML type {other} is not supported (F32, F16, Q4_1, Q8_0 are)"
                )))
            }
        })
    }

    /// (elements, bytes) per block.
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 => (1, 2),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q8_0 => (32, 34),
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

/// Dequantizes a tensor's bytes to f32 (CPU; tests and the reference forward).
pub fn dequantize(data: &[u8], ty: GgmlType) -> Vec<f32> {
    let h = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    match ty {
        GgmlType::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        GgmlType::F16 => data.chunks_exact(2).map(h).collect(),
        GgmlType::Q8_0 => data
            .chunks_exact(34)
            .flat_map(|b| {
                let d = h(&b[..2]);
                b[2..].iter().map(move |&q| d * q as i8 as f32)
            })
            .collect(),
        GgmlType::Q4_1 => data
            .chunks_exact(20)
            .flat_map(|b| {
                let (d, m) = (h(&b[..2]), h(&b[2..4]));
                let q = &b[4..];
                let lo = q.iter().map(move |&x| d * (x & 15) as f32 + m);
                let hi = q.iter().map(move |&x| d * (x >> 4) as f32 + m);
                lo.chain(hi).collect::<Vec<_>>()
            })
            .collect(),
    }
}

//! Reading and writing a model's K/V as safetensors: tensors `past_key_values.{i}.key` and
//! `past_key_values.{i}.value`, shape `[B, H, S, D]`, dtype F16, BF16 or F32 (the naming
//! transformers.js and ONNX exports use).

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::config::{DType, TensorShape};
use crate::error::{Result, XqError};

/// Element type of a tensor in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileDType {
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// 32-bit float.
    F32,
}

impl FileDType {
    fn parse(s: &str, name: &str) -> Result<Self> {
        match s {
            "F16" => Ok(FileDType::F16),
            "BF16" => Ok(FileDType::BF16),
            "F32" => Ok(FileDType::F32),
            other => Err(format_err(format!(
                "tensor {name}: dtype {other} is not F16, BF16 or F32"
            ))),
        }
    }

    fn size(self) -> usize {
        match self {
            FileDType::F16 | FileDType::BF16 => 2,
            FileDType::F32 => 4,
        }
    }

    /// The GPU dtype that holds these values exactly (f16 for F16, f32 otherwise).
    pub fn gpu_dtype(self) -> DType {
        match self {
            FileDType::F16 => DType::F16,
            FileDType::BF16 | FileDType::F32 => DType::F32,
        }
    }

    /// Safetensors name.
    pub fn name(self) -> &'static str {
        match self {
            FileDType::F16 => "F16",
            FileDType::BF16 => "BF16",
            FileDType::F32 => "F32",
        }
    }
}

fn format_err(msg: String) -> XqError {
    XqError::Format(msg)
}

/// One layer's keys and values as f32.
#[derive(Clone, Debug)]
pub struct KvLayer {
    /// `[B, H, S, D]` keys.
    pub key: Vec<f32>,
    /// `[B, H, S, D]` values.
    pub value: Vec<f32>,
}

/// A model's K/V: every layer, one shape, one file dtype.
#[derive(Clone, Debug)]
pub struct KvFile {
    /// `[B, H, S, D]` of every tensor.
    pub shape: TensorShape,
    /// dtype of the tensors in the file.
    pub dtype: FileDType,
    /// Layers 0..L-1.
    pub layers: Vec<KvLayer>,
}

fn decode(bytes: &[u8], dtype: FileDType) -> Vec<f32> {
    match dtype {
        FileDType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        FileDType::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        FileDType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
    }
}

fn encode(values: &[f32], dtype: FileDType, out: &mut Vec<u8>) {
    for &v in values {
        match dtype {
            FileDType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            FileDType::F16 => {
                out.extend_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes())
            }
            FileDType::BF16 => {
                out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes())
            }
        }
    }
}

struct Entry {
    dtype: FileDType,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

fn parse_header(bytes: &[u8]) -> Result<(BTreeMap<String, Entry>, usize)> {
    if bytes.len() < 8 {
        return Err(format_err(
            "not a safetensors file: shorter than its 8-byte header length".into(),
        ));
    }
    let n64 = u64::from_le_bytes(bytes[..8].try_into().unwrap_or([0; 8]));
    // On 32-bit targets (wasm32) a length past usize must not wrap into a small one.
    let header = usize::try_from(n64)
        .ok()
        .and_then(|n| bytes.get(8..8usize.checked_add(n)?))
        .ok_or_else(|| {
            format_err(format!(
                "not a safetensors file: header of {n64} bytes runs past the end"
            ))
        })?;
    let n = header.len();
    let json: Value = serde_json::from_slice(header)
        .map_err(|e| format_err(format!("not a safetensors file: header is not JSON ({e})")))?;
    let obj = json
        .as_object()
        .ok_or_else(|| format_err("not a safetensors file: header is not a JSON object".into()))?;
    let data_len = bytes.len() - 8 - n;
    let mut entries = BTreeMap::new();
    for (name, v) in obj {
        if name == "__metadata__" {
            continue;
        }
        let bad = || format_err(format!("tensor {name}: malformed header entry"));
        let dtype = FileDType::parse(v["dtype"].as_str().ok_or_else(bad)?, name)?;
        let shape: Vec<usize> = v["shape"]
            .as_array()
            .ok_or_else(bad)?
            .iter()
            .map(|d| {
                d.as_u64()
                    .and_then(|d| usize::try_from(d).ok())
                    .ok_or_else(bad)
            })
            .collect::<Result<_>>()?;
        let offs = v["data_offsets"].as_array().ok_or_else(bad)?;
        let (start, end) = match (
            offs.first().and_then(Value::as_u64),
            offs.get(1).and_then(Value::as_u64),
        ) {
            (Some(s), Some(e)) => (s, e),
            _ => return Err(bad()),
        };
        // Bytes the shape needs; `None` when the count overflows (then it cannot fit).
        let need = shape
            .iter()
            .try_fold(dtype.size(), |a, &d| a.checked_mul(d));
        let span = end.checked_sub(start).and_then(|n| usize::try_from(n).ok());
        if end > data_len as u64 || span.is_none() || span != need {
            return Err(format_err(format!(
                "tensor {name}: data offsets [{start}, {end}) do not fit shape {shape:?} {} in {data_len} data bytes",
                dtype.name()
            )));
        }
        entries.insert(
            name.clone(),
            Entry {
                dtype,
                shape,
                // Both fit: end <= data_len.
                start: start as usize,
                end: end as usize,
            },
        );
    }
    Ok((entries, 8 + n))
}

/// A named tensor of a safetensors file, values as f32.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Dimensions.
    pub shape: Vec<usize>,
    /// dtype in the file.
    pub dtype: FileDType,
    /// Values, row-major.
    pub data: Vec<f32>,
}

/// Every tensor of safetensors `bytes`, by name; non-finite values are refused.
pub fn read_tensors(bytes: &[u8]) -> Result<BTreeMap<String, Tensor>> {
    let (entries, data_start) = parse_header(bytes)?;
    let data = &bytes[data_start..];
    let mut out = BTreeMap::new();
    for (name, e) in entries {
        let values = decode(&data[e.start..e.end], e.dtype);
        if let Some(j) = values.iter().position(|v| !v.is_finite()) {
            return Err(XqError::NonFinite(format!(
                "{name}: element {j} is {}",
                values[j]
            )));
        }
        out.insert(
            name,
            Tensor {
                shape: e.shape,
                dtype: e.dtype,
                data: values,
            },
        );
    }
    Ok(out)
}

/// Safetensors bytes of `tensors`, each in its own dtype, in the order given.
pub fn tensors_to_bytes(tensors: &[(String, &Tensor)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, t) in tensors {
        let start = data.len();
        encode(&t.data, t.dtype, &mut data);
        header.insert(
            name.clone(),
            json!({"dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut text = serde_json::to_vec(&Value::Object(header)).unwrap_or_default();
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&data);
    out
}

impl KvFile {
    /// Parses safetensors bytes; every layer must have a key and a value of one shape and dtype.
    pub fn from_bytes(bytes: &[u8]) -> Result<KvFile> {
        let (entries, data_start) = parse_header(bytes)?;
        let data = &bytes[data_start..];
        let mut layers = Vec::new();
        let mut first: Option<(Vec<usize>, FileDType)> = None;
        loop {
            let i = layers.len();
            let (kn, vn) = (
                format!("past_key_values.{i}.key"),
                format!("past_key_values.{i}.value"),
            );
            let (k, v) = match (entries.get(&kn), entries.get(&vn)) {
                (Some(k), Some(v)) => (k, v),
                (None, None) => break,
                (Some(_), None) => {
                    return Err(format_err(format!("layer {i}: {kn} has no matching {vn}")))
                }
                (None, Some(_)) => {
                    return Err(format_err(format!("layer {i}: {vn} has no matching {kn}")))
                }
            };
            for (name, e) in [(&kn, k), (&vn, v)] {
                if e.shape.len() != 4 {
                    return Err(XqError::Shape(format!(
                        "{name}: shape {:?} is not [B, H, S, D]",
                        e.shape
                    )));
                }
                match &first {
                    None => first = Some((e.shape.clone(), e.dtype)),
                    Some((s, d)) if *s != e.shape || *d != e.dtype => {
                        return Err(XqError::Shape(format!(
                            "{name}: shape {:?} {} differs from layer 0's {s:?} {}",
                            e.shape,
                            e.dtype.name(),
                            d.name()
                        )))
                    }
                    Some(_) => {}
                }
            }
            layers.push(KvLayer {
                key: decode(&data[k.start..k.end], k.dtype),
                value: decode(&data[v.start..v.end], v.dtype),
            });
        }
        let Some((shape, dtype)) = first else {
            let names: Vec<&String> = entries.keys().take(5).collect();
            return Err(format_err(format!(
                "no tensors named past_key_values.0.key / past_key_values.0.value (found {names:?})"
            )));
        };
        let stray = entries.keys().find(|n| {
            n.starts_with("past_key_values.")
                && n.split('.')
                    .nth(1)
                    .and_then(|i| i.parse::<usize>().ok())
                    .is_some_and(|i| i >= layers.len())
        });
        if let Some(n) = stray {
            return Err(format_err(format!(
                "{n}: layer numbers must run 0..{} without gaps",
                layers.len()
            )));
        }
        for (i, l) in layers.iter().enumerate() {
            for (what, x) in [("key", &l.key), ("value", &l.value)] {
                if let Some(j) = x.iter().position(|v| !v.is_finite()) {
                    return Err(XqError::NonFinite(format!(
                        "past_key_values.{i}.{what}: element {j} is {}",
                        x[j]
                    )));
                }
            }
        }
        Ok(KvFile {
            shape: TensorShape::new(&shape)?,
            dtype,
            layers,
        })
    }

    /// Reads and parses a file.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read(path: &std::path::Path) -> Result<KvFile> {
        let bytes = std::fs::read(path)
            .map_err(|e| XqError::Io(format!("cannot read {}: {e}", path.display())))?;
        KvFile::from_bytes(&bytes).map_err(|e| match e {
            XqError::Format(m) => format_err(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// Serialises to safetensors bytes in `self.dtype`.
    pub fn to_bytes(&self) -> Vec<u8> {
        let tensors = self.tensors();
        let refs: Vec<(String, &Tensor)> = tensors.iter().map(|(n, t)| (n.clone(), t)).collect();
        tensors_to_bytes(&refs)
    }

    /// The file's tensors by name, in `self.dtype`.
    pub fn tensors(&self) -> Vec<(String, Tensor)> {
        let tensor = |x: &Vec<f32>| Tensor {
            shape: self.shape.dims().to_vec(),
            dtype: self.dtype,
            data: x.clone(),
        };
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, l)| {
                [
                    (format!("past_key_values.{i}.key"), tensor(&l.key)),
                    (format!("past_key_values.{i}.value"), tensor(&l.value)),
                ]
            })
            .collect()
    }

    /// Writes the file.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn write(&self, path: &std::path::Path) -> Result<()> {
        std::fs::write(path, self.to_bytes())
            .map_err(|e| format_err(format!("cannot write {}: {e}", path.display())))
    }

    /// One layer's keys or values, `[B, H, N, D]`.
    pub fn tensor(&self, layer: usize, kind: crate::config::KvKind) -> &[f32] {
        match kind {
            crate::config::KvKind::Key => &self.layers[layer].key,
            crate::config::KvKind::Value => &self.layers[layer].value,
        }
    }

    /// Tokens `[start, end)` of one layer's keys or values, `[B, H, end - start, D]`.
    pub fn tokens(
        &self,
        layer: usize,
        kind: crate::config::KvKind,
        start: usize,
        end: usize,
    ) -> Vec<f32> {
        let x = self.tensor(layer, kind);
        let (s, d) = (self.shape.tokens(), self.shape.dim());
        x.chunks(s * d)
            .flat_map(|row| row[start * d..end * d].iter().copied())
            .collect()
    }

    /// Largest |value| in the file.
    pub fn max_abs(&self) -> f32 {
        self.layers
            .iter()
            .flat_map(|l| l.key.iter().chain(&l.value))
            .fold(0.0, |m, v| m.max(v.abs()))
    }
}

//! How each GGUF weight type lives on the GPU for the forward's matmuls (`WEIGHT` in
//! `wgsl/llama.wgsl`): one place decides the layout, so that what `limits::check` counts
//! before loading is what `GpuModel::load` uploads.

use crate::model::gguf::{self, GgmlType};

/// A weight type's GPU layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GpuWeightFormat {
    /// Blocks as stored (Q4_1, Q5_1, Q4_K, Q5_K: whole words already).
    AsStored { kind: u8 },
    /// Blocks with two zero bytes inserted at byte `at` of each block, so that the block is
    /// whole words (Q5_0, Q4_0: after the f16 scale, so their codes are words; Q6_K: at the
    /// end of its 210 bytes).
    Padded { kind: u8, at: usize },
    /// Q8_0 blocks repacked to 36 bytes: the f16 scale's word, then the 32 int8 codes.
    Q8Repacked,
    /// Every other type dequantized to f32.
    F32,
}

impl GpuWeightFormat {
    /// The layout the matmuls read `ty` in.
    pub(crate) fn of(ty: GgmlType) -> Self {
        match ty {
            GgmlType::Q4_1 => Self::AsStored { kind: 0 },
            GgmlType::Q5_1 => Self::AsStored { kind: 3 },
            GgmlType::Q4_K => Self::AsStored { kind: 4 },
            GgmlType::Q5_K => Self::AsStored { kind: 5 },
            GgmlType::Q6_K => Self::Padded { kind: 6, at: 210 },
            GgmlType::Q5_0 => Self::Padded { kind: 7, at: 2 },
            GgmlType::Q4_0 => Self::Padded { kind: 8, at: 2 },
            GgmlType::Q8_0 => Self::Q8Repacked,
            GgmlType::F32 | GgmlType::F16 => Self::F32,
        }
    }

    /// `WEIGHT`: the kernels' name for the layout.
    pub(crate) fn kind(self) -> u8 {
        match self {
            Self::AsStored { kind } | Self::Padded { kind, .. } => kind,
            Self::Q8Repacked => 1,
            Self::F32 => 2,
        }
    }

    /// Bytes on the GPU of `elements` weights of type `ty`.
    pub(crate) fn bytes(self, ty: GgmlType, elements: u64) -> u64 {
        let (per, block) = ty.block();
        let blocks = elements / per as u64;
        match self {
            Self::AsStored { .. } => blocks * block as u64,
            Self::Padded { .. } => blocks * (block as u64 + 2),
            Self::Q8Repacked => blocks * 36,
            Self::F32 => elements * 4,
        }
    }

    /// The words to upload for the weights `data` of type `ty`.
    pub(crate) fn words(self, ty: GgmlType, data: &[u8]) -> Vec<u32> {
        match self {
            Self::AsStored { .. } => words(data),
            Self::Padded { at, .. } => data
                .chunks_exact(ty.block().1)
                .flat_map(|b| words(&[&b[..at], &[0, 0], &b[at..]].concat()))
                .collect(),
            Self::Q8Repacked => data
                .chunks_exact(34)
                .flat_map(|b| {
                    std::iter::once(u16::from_le_bytes([b[0], b[1]]) as u32).chain(words(&b[2..34]))
                })
                .collect(),
            Self::F32 => gguf::dequantize(data, ty)
                .iter()
                .map(|v| v.to_bits())
                .collect(),
        }
    }
}

/// Little-endian words of `bytes` (the last one zero-padded).
fn words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every type: the words uploaded for a few blocks are exactly the bytes `bytes` counts.
    #[test]
    fn uploaded_words_match_the_counted_bytes() {
        for ty in GgmlType::ALL {
            let (per, block) = ty.block();
            let elements = 3 * per.max(32) as u64;
            let stored = elements as usize / per * block;
            // Bytes that dequantize to finite values in every type (small f16 scales).
            let data: Vec<u8> = (0..stored).map(|i| (i % 7) as u8).collect();
            let format = GpuWeightFormat::of(ty);
            let words = format.words(ty, &data);
            assert_eq!(words.len() as u64 * 4, format.bytes(ty, elements), "{ty:?}");
        }
    }

    /// The padded types keep every byte, in order, around the two inserted ones.
    #[test]
    fn padding_inserts_two_zero_bytes_per_block() {
        let data: Vec<u8> = (0..36).map(|i| i as u8 + 1).collect();
        let w = GpuWeightFormat::of(GgmlType::Q4_0).words(GgmlType::Q4_0, &data);
        let bytes: Vec<u8> = w.iter().flat_map(|w| w.to_le_bytes()).collect();
        assert_eq!(&bytes[..4], &[1, 2, 0, 0]);
        assert_eq!(&bytes[4..20], &data[2..18]);
        assert_eq!(&bytes[20..24], &[19, 20, 0, 0]);
    }
}

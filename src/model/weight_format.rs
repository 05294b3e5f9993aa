//! How each GGUF weight type lives on the GPU for the forward's matmuls (`WEIGHT` in
//! `wgsl/llama.wgsl`): one place decides the layout, so that what `limits::check` counts
//! before loading is what `GpuModel::load` uploads.

use crate::model::gguf::{self, GgmlType};

/// A weight type's GPU layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GpuWeightFormat {
    /// Blocks as stored (Q5_1, Q4_K, Q5_K: whole words already).
    AsStored { kind: u8 },
    /// Q4_1 blocks (5 words) interleaved in quads of rows (`quad_block` in
    /// `wgsl/llama.wgsl`): for rows 4r .. 4r + 3 (the last quad padded with zero rows) and
    /// each block, the 4 rows' [d, m] words, then word j of the 4 rows' codes for each j; so
    /// 4 rows' word is one 16-byte load.
    Q4RowQuads,
    /// Blocks with two zero bytes inserted at byte `at` of each block, so that the block is
    /// whole words (Q5_0, Q4_0: after the f16 scale, so their codes are words; Q6_K: at the
    /// end of its 210 bytes).
    Padded { kind: u8, at: usize },
    /// Q8_0 blocks repacked to 36 bytes (the f16 scale's word, then the 32 int8 codes) and
    /// interleaved in quads of rows as `Q4RowQuads`.
    Q8RowQuads,
    /// Every other type dequantized to f32.
    F32,
}

impl GpuWeightFormat {
    /// The layout the matmuls read `ty` in.
    pub(crate) fn of(ty: GgmlType) -> Self {
        match ty {
            GgmlType::Q4_1 => Self::Q4RowQuads,
            GgmlType::Q5_1 => Self::AsStored { kind: 3 },
            GgmlType::Q4_K => Self::AsStored { kind: 4 },
            GgmlType::Q5_K => Self::AsStored { kind: 5 },
            GgmlType::Q6_K => Self::Padded { kind: 6, at: 210 },
            GgmlType::Q5_0 => Self::Padded { kind: 7, at: 2 },
            GgmlType::Q4_0 => Self::Padded { kind: 8, at: 2 },
            GgmlType::Q8_0 => Self::Q8RowQuads,
            GgmlType::F32 | GgmlType::F16 => Self::F32,
        }
    }

    /// `WEIGHT`: the kernels' name for the layout.
    pub(crate) fn kind(self) -> u8 {
        match self {
            Self::AsStored { kind } | Self::Padded { kind, .. } => kind,
            Self::Q4RowQuads => 0,
            Self::Q8RowQuads => 1,
            Self::F32 => 2,
        }
    }

    /// Rows the layout stores for a matrix of `rows` (Q4_1 and Q8_0: whole row quads).
    pub(crate) fn stored_rows(self, rows: usize) -> usize {
        match self {
            Self::Q4RowQuads | Self::Q8RowQuads => rows.next_multiple_of(4),
            _ => rows,
        }
    }

    /// Bytes on the GPU of a `[rows, cols]` matrix of type `ty`.
    pub(crate) fn bytes(self, ty: GgmlType, rows: usize, cols: usize) -> u64 {
        let (per, block) = ty.block();
        let elements = self.stored_rows(rows) as u64 * cols as u64;
        let blocks = elements / per as u64;
        match self {
            Self::AsStored { .. } | Self::Q4RowQuads => blocks * block as u64,
            Self::Padded { .. } => blocks * (block as u64 + 2),
            Self::Q8RowQuads => blocks * 36,
            Self::F32 => elements * 4,
        }
    }

    /// The words to upload for the weights `data` of type `ty`, `rows` rows.
    pub(crate) fn words(self, ty: GgmlType, data: &[u8], rows: usize) -> Vec<u32> {
        match self {
            Self::AsStored { .. } => words(data),
            Self::Q4RowQuads => row_quads(data.chunks_exact(20).map(words), rows),
            Self::Padded { at, .. } => data
                .chunks_exact(ty.block().1)
                .flat_map(|b| words(&[&b[..at], &[0, 0], &b[at..]].concat()))
                .collect(),
            Self::Q8RowQuads => row_quads(
                data.chunks_exact(34).map(|b| {
                    std::iter::once(u16::from_le_bytes([b[0], b[1]]) as u32)
                        .chain(words(&b[2..34]))
                        .collect()
                }),
                rows,
            ),
            Self::F32 => gguf::dequantize(data, ty)
                .iter()
                .map(|v| v.to_bits())
                .collect(),
        }
    }
}

/// Blocks of whole words (each block's words, rows one after another) of `rows` rows,
/// interleaved in quads of rows: per quad and block, word j of the 4 rows side by side for
/// each j; the last quad's missing rows zero.
fn row_quads(blocks: impl ExactSizeIterator<Item = Vec<u32>>, rows: usize) -> Vec<u32> {
    let per_row = blocks.len() / rows.max(1);
    let mut out = Vec::new();
    for (i, block) in blocks.enumerate() {
        let (n, b) = (i / per_row, i % per_row);
        let at = ((n / 4) * per_row + b) * 4 * block.len();
        out.resize(out.len().max(at + 4 * block.len()), 0);
        for (j, word) in block.into_iter().enumerate() {
            out[at + 4 * j + n % 4] = word;
        }
    }
    out
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
            // Rows that fill no whole row quad, and rows that do.
            for rows in [3, 8] {
                let cols = 2 * per.max(32);
                let stored = rows * cols / per * block;
                // Bytes that dequantize to finite values in every type (small f16 scales).
                let data: Vec<u8> = (0..stored).map(|i| (i % 7) as u8).collect();
                let format = GpuWeightFormat::of(ty);
                let words = format.words(ty, &data, rows);
                assert_eq!(
                    words.len() as u64 * 4,
                    format.bytes(ty, rows, cols),
                    "{ty:?}, {rows} rows"
                );
            }
        }
    }

    /// The padded types keep every byte, in order, around the two inserted ones.
    #[test]
    fn padding_inserts_two_zero_bytes_per_block() {
        let data: Vec<u8> = (0..36).map(|i| i as u8 + 1).collect();
        let w = GpuWeightFormat::of(GgmlType::Q4_0).words(GgmlType::Q4_0, &data, 2);
        let bytes: Vec<u8> = w.iter().flat_map(|w| w.to_le_bytes()).collect();
        assert_eq!(&bytes[..4], &[1, 2, 0, 0]);
        assert_eq!(&bytes[4..20], &data[2..18]);
        assert_eq!(&bytes[20..24], &[19, 20, 0, 0]);
    }

    /// Q4_1's row quads: word w of row n's block b lands at word 4w + n % 4 of block b of
    /// quad n / 4; the padding rows are zero.
    #[test]
    fn q4_1_rows_interleave_in_quads() {
        let (rows, blocks) = (5, 2);
        // Every byte names its row, block and position.
        let data: Vec<u8> = (0..rows * blocks * 20)
            .map(|i| ((i / 40) * 64 + (i / 20 % 2) * 32 + i % 20) as u8)
            .collect();
        let w = GpuWeightFormat::of(GgmlType::Q4_1).words(GgmlType::Q4_1, &data, rows);
        assert_eq!(w.len(), 2 * blocks * 20);
        for n in 0..rows {
            for b in 0..blocks {
                for word in 0..5 {
                    let src = (n * blocks + b) * 20 + 4 * word;
                    let want = u32::from_le_bytes(data[src..src + 4].try_into().unwrap());
                    assert_eq!(w[((n / 4) * blocks + b) * 20 + 4 * word + n % 4], want);
                }
            }
        }
        let padding: Vec<u32> = (0..blocks * 20)
            .filter(|i| i % 4 != 0)
            .map(|i| w[blocks * 20 + i])
            .collect();
        assert!(padding.iter().all(|&v| v == 0), "rows 5..8 are zero");
    }
}

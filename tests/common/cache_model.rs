//! A CPU model of the window-policy cache: what `update_and_fetch` must return.

use xquant_wgpu::reference as r;
use xquant_wgpu::{DType, QuantSpec, TensorShape};

/// One layer's keys (or values) as fed so far, `[R, L, D]`, f16-rounded (caches hold f16).
#[derive(Clone, Debug)]
pub struct LayerSeq {
    pub rows: usize,
    pub dim: usize,
    pub len: usize,
    pub data: Vec<Vec<f32>>, // per row: [L, D]
}

pub fn f16(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

impl LayerSeq {
    pub fn new(rows: usize, dim: usize) -> Self {
        LayerSeq {
            rows,
            dim,
            len: 0,
            data: vec![Vec::new(); rows],
        }
    }

    /// Appends a call's `[R, T, D]` values.
    pub fn push(&mut self, call: &[f32]) {
        let t = call.len() / (self.rows * self.dim);
        for (r, row) in self.data.iter_mut().enumerate() {
            row.extend(
                call[r * t * self.dim..(r + 1) * t * self.dim]
                    .iter()
                    .map(|&v| f16(v)),
            );
        }
        self.len += t;
    }

    /// Tokens `[t0, t0 + n)` as `[R, n, D]`.
    pub fn block(&self, t0: usize, n: usize) -> Vec<f32> {
        self.data
            .iter()
            .flat_map(|row| row[t0 * self.dim..(t0 + n) * self.dim].iter().copied())
            .collect()
    }

    /// Tokens from `t0` on, as a sequence of their own.
    pub fn tail(&self, t0: usize) -> LayerSeq {
        let t0 = t0.min(self.len);
        LayerSeq {
            rows: self.rows,
            dim: self.dim,
            len: self.len - t0,
            data: self
                .data
                .iter()
                .map(|r| r[t0 * self.dim..].to_vec())
                .collect(),
        }
    }

    /// Everything as `[R, L, D]`.
    pub fn all(&self) -> Vec<f32> {
        self.block(0, self.len)
    }
}

/// Tokens the window policy has quantized after `len` tokens.
pub fn quantized_tokens(len: usize, window: usize, group: usize) -> usize {
    if len >= window {
        (len - window) / group * group
    } else {
        0
    }
}

/// The reconstruction a window-policy cache returns for `x`: whole groups before `q` through
/// the CPU reference (own codes, or the anchor's codes plus own params and residual), the
/// window as f16.
pub fn expected_window(
    x: &LayerSeq,
    anchor: Option<&LayerSeq>,
    q: usize,
    spec: &QuantSpec,
    rbits: u8,
    out: DType,
) -> Vec<f32> {
    let (rows, dim, g) = (x.rows, x.dim, spec.group_size);
    let mut result = vec![vec![0f32; x.len * dim]; rows];
    let shape = TensorShape::new(&[rows, g, dim]).unwrap();
    for b in (0..q).step_by(g) {
        let xb = x.block(b, g);
        let recon = match anchor {
            None => {
                let (c, p) = r::quantize_codes_batched(&xb, &shape, spec).unwrap();
                r::dequant_with_params_batched(&c, &p, out).unwrap()
            }
            Some(a) => {
                let (c, _) = r::quantize_codes_batched(&a.block(b, g), &shape, spec).unwrap();
                let enc = r::reuse_encode(&xb, &shape, &c, spec, rbits, out).unwrap();
                r::reuse_reconstruct(&c, &enc, out).unwrap()
            }
        };
        for (ri, row) in result.iter_mut().enumerate() {
            row[b * dim..(b + g) * dim].copy_from_slice(&recon[ri * g * dim..(ri + 1) * g * dim]);
        }
    }
    for (row, src) in result.iter_mut().zip(&x.data) {
        for (o, &v) in row[q * dim..].iter_mut().zip(&src[q * dim..]) {
            *o = out.round(v);
        }
    }
    result.concat()
}

/// [`expected_window`] after `sinks` f16 tokens: the sinks as f16, the rest (the body, of
/// which `q` tokens are quantized) as the window policy reconstructs it.
pub fn expected_with_sinks(
    x: &LayerSeq,
    anchor: Option<&LayerSeq>,
    sinks: usize,
    q: usize,
    spec: &QuantSpec,
    rbits: u8,
    out: DType,
) -> Vec<f32> {
    let s = sinks.min(x.len);
    let body = expected_window(
        &x.tail(s),
        anchor.map(|a| a.tail(s)).as_ref(),
        q,
        spec,
        rbits,
        out,
    );
    let per_row = (x.len - s) * x.dim;
    (0..x.rows)
        .flat_map(|r| {
            let head: Vec<f32> = x.data[r][..s * x.dim]
                .iter()
                .map(|&v| out.round(v))
                .collect();
            head.into_iter()
                .chain(body[r * per_row..(r + 1) * per_row].iter().copied())
        })
        .collect()
}

/// Mean squared error.
pub fn mse(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum::<f64>()
        / a.len() as f64
}

pub use super::tolerances::RECON_ABS;

/// Compares a fetched reconstruction with the model: every element within the rounding
/// budget, except at most `max_flips` elements (near-tie code differences).
pub fn assert_matches_model(what: &str, got: &[f32], want: &[f32], max_flips: usize) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut flips = Vec::new();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if (g - w).abs() > w.abs() / 1024.0 + RECON_ABS {
            flips.push((i, *g, *w));
        }
    }
    assert!(
        flips.len() <= max_flips,
        "{what}: {} elements differ, first {:?}",
        flips.len(),
        &flips[..flips.len().min(5)]
    );
}

/// Normal values rounded to f16, as IEEE half bits (the reference tests' fp16 tensors).
pub fn randn_f16(g: &mut xquant_wgpu::synth::SplitMix, n: usize) -> Vec<u16> {
    (0..n)
        .map(|_| half::f16::from_f32(g.normal()).to_bits())
        .collect()
}

/// Half bits to f32.
pub fn halves(v: &[u16]) -> Vec<f32> {
    v.iter()
        .map(|&h| half::f16::from_bits(h).to_f32())
        .collect()
}

/// `a + noise · b`, rounded to f16 bits.
pub fn mix(a: &[u16], b: &[u16], noise: f32) -> Vec<u16> {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| {
            let v = half::f16::from_bits(x).to_f32() + noise * half::f16::from_bits(y).to_f32();
            half::f16::from_f32(v).to_bits()
        })
        .collect()
}

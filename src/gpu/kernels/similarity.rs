//! Cross-layer similarity kernels (`wgsl/similarity.wgsl`): one pair, or all pairs of a
//! model's layers.

use crate::config::DType;
use crate::error::{shape_err, Result, XqError};
use crate::gpu::mirror::wgsl_struct;
use crate::gpu::pipelines::{Constants, Family, KernelKey, SimilarityConstants, ELEMENT_WG};
use crate::gpu::{GpuContext, GpuTensor};
use crate::reference::Similarity;

wgsl_struct! {
    /// Mirrors `Dims` in `wgsl/similarity.wgsl`.
    pub(crate) struct SimDims = Family::Similarity, "Dims" {
        vectors: u32,
        dim: u32,
        layer_stride: u32,
        n_pairs: u32,
        partials: u32,
        pair_base: u32,
        row_vectors: u32,
        _pad1: u32,
    }
}

/// MSE and mean cosine of every pair of layers, row-major `L × L` (symmetric).
#[derive(Clone, Debug, PartialEq)]
pub struct SimilarityMatrix {
    /// Number of layers L.
    pub layers: usize,
    /// `mse[i * L + j]`.
    pub mse: Vec<f32>,
    /// `cosine[i * L + j]`.
    pub cosine: Vec<f32>,
}

impl SimilarityMatrix {
    /// (mse, cosine) of layers i and j.
    pub fn get(&self, i: usize, j: usize) -> (f32, f32) {
        (
            self.mse[i * self.layers + j],
            self.cosine[i * self.layers + j],
        )
    }
}

impl GpuContext {
    /// Similarity of every listed `(i, j)` pair of `tensors` (all of one shape): one
    /// stage-1 dispatch per pair, one stage-2 dispatch for all, one readback.
    pub async fn similarities(
        &self,
        tensors: &[&GpuTensor],
        pairs: &[(usize, usize)],
    ) -> Result<Vec<Similarity>> {
        self.weighted_similarities(tensors, pairs, None).await
    }

    /// [`GpuContext::similarities`] with every squared difference of row `r` (the leading
    /// axes flattened), channel `d` weighted by `weights[r · D + d]` (`mse` is then the
    /// weighted mean; the cosine is unweighted).
    pub async fn weighted_similarities(
        &self,
        tensors: &[&GpuTensor],
        pairs: &[(usize, usize)],
        weights: Option<&[f32]>,
    ) -> Result<Vec<Similarity>> {
        if let Some(&(i, j)) = pairs
            .iter()
            .find(|(i, j)| *i >= tensors.len() || *j >= tensors.len())
        {
            return shape_err!(
                "pair ({i}, {j}) names a tensor beyond the {} given",
                tensors.len()
            );
        }
        let layers = tensors;
        let first = layers
            .first()
            .ok_or_else(|| XqError::Shape("no layers given".into()))?;
        for t in layers {
            if t.shape != first.shape {
                return shape_err!(
                    "layer shapes differ: {:?} vs {:?}",
                    t.shape.dims(),
                    first.shape.dims()
                );
            }
        }
        let dim = first.shape.dim();
        let vectors = first.shape.len() / dim;
        let grid = self.grid(vectors, ELEMENT_WG)?;
        if grid.y > 1 {
            return Err(XqError::TooLarge(format!(
                "{vectors} vectors per layer exceed one dispatch row"
            )));
        }
        let partials = grid.x as usize;
        let rows = first.shape.rows();
        let weights = match weights {
            None => None,
            Some(w) if w.len() == rows * dim && w.iter().all(|v| v.is_finite()) => {
                Some(self.upload_words("similarity weights", bytemuck::cast_slice(w))?)
            }
            Some(w) => {
                return shape_err!(
                    "{} weights for {rows} rows of {dim} channels (finite values needed)",
                    w.len()
                )
            }
        };
        let placeholder = self.placeholder();
        let weight_buf: &wgpu::Buffer = weights.as_deref().map_or(&placeholder, |b| b);
        let part =
            self.storage_buffer("similarity partials", (pairs.len() * partials * 8) as u64)?;
        let result = self.storage_buffer("similarity", (pairs.len() * 8) as u64)?;
        let pair_list = self.storage_buffer("pair list", 4)?;
        let dims = |pair_base: usize, n_pairs: usize, partials: usize| SimDims {
            vectors: vectors as u32,
            dim: dim as u32,
            layer_stride: 0,
            n_pairs: n_pairs as u32,
            partials: partials as u32,
            pair_base: pair_base as u32,
            row_vectors: (vectors / rows) as u32,
            _pad1: 0,
        };
        self.run("similarity", |enc| {
            for (p, &(i, j)) in pairs.iter().enumerate() {
                let (a, b) = (layers[i], layers[j]);
                let key = KernelKey::new(
                    "pair_partials",
                    Constants::Similarity(SimilarityConstants {
                        a_f16: a.dtype == DType::F16,
                        b_f16: b.dtype == DType::F16,
                        weighted: weights.is_some(),
                    }),
                );
                let d = dims(p, 1, partials);
                let buffers = [
                    (1, a.bind()),
                    (2, b.bind()),
                    (3, (&*pair_list).into()),
                    (4, (&*part).into()),
                    (6, weight_buf.into()),
                ];
                self.dispatch(enc, &key, &d, &buffers, grid);
            }
            let key = KernelKey::new("finish", Constants::Similarity(Default::default()));
            let finish_grid = self.grid(pairs.len(), ELEMENT_WG)?;
            let d = dims(0, pairs.len(), partials);
            self.dispatch(
                enc,
                &key,
                &d,
                &[(4, (&*part).into()), (5, (&*result).into())],
                finish_grid,
            );
            Ok(())
        })
        .await?;
        let bytes = self.read_bytes(&result, (pairs.len() * 8) as u64).await?;
        drop((part, result, pair_list));
        Ok(bytemuck::cast_slice::<u8, [f32; 2]>(&bytes)
            .iter()
            .map(|&[mse, cosine]| Similarity {
                mse: mse as f64,
                cosine: cosine as f64,
            })
            .collect())
    }

    /// `cross_layer_similarity(a, b)` on the GPU: MSE and mean cosine.
    pub async fn cross_layer_similarity(&self, a: &GpuTensor, b: &GpuTensor) -> Result<Similarity> {
        Ok(self.similarities(&[a, b], &[(0, 1)]).await?[0])
    }

    /// All-pairs similarity of a model's layers (each `[..., N, D]`, one shape).
    pub async fn similarity_matrix(&self, layers: &[GpuTensor]) -> Result<SimilarityMatrix> {
        let n = layers.len();
        let refs: Vec<&GpuTensor> = layers.iter().collect();
        let pairs: Vec<(usize, usize)> = (0..n).flat_map(|i| (i..n).map(move |j| (i, j))).collect();
        let r = self.similarities(&refs, &pairs).await?;
        let mut m = SimilarityMatrix {
            layers: n,
            mse: vec![0.0; n * n],
            cosine: vec![0.0; n * n],
        };
        for (&(i, j), v) in pairs.iter().zip(&r) {
            for (a, b) in [(i, j), (j, i)] {
                m.mse[a * n + b] = v.mse as f32;
                m.cosine[a * n + b] = v.cosine as f32;
            }
        }
        Ok(m)
    }
}

//! RMSNorm with its weight: plain, fused with the residual add, or per head (q/k norm).

use anyhow::Result;

use crate::backend::Backend;
use crate::weights::Weights;

pub struct RmsNorm<B: Backend> {
    weight: B::Tensor,
    eps: f32,
}

impl<B: Backend> RmsNorm<B> {
    /// Loads `<name>` of shape [dim].
    pub fn load(b: &B, weights: &Weights, name: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: b.upload_weight(&weights.get(name, &[dim])?)?,
            eps: eps as f32,
        })
    }

    pub fn forward(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor> {
        b.rms_norm(x, &self.weight, self.eps)
    }

    /// `residual += x; x = norm(residual)`.
    pub fn forward_residual(
        &self,
        b: &B,
        x: &mut B::Tensor,
        residual: &mut B::Tensor,
    ) -> Result<()> {
        b.fused_add_rms_norm(x, residual, &self.weight, self.eps)
    }

    /// The weight and eps, for an op that fuses the norm (per-head q/k norm).
    pub fn weight_and_eps(&self) -> (&B::Tensor, f32) {
        (&self.weight, self.eps)
    }
}

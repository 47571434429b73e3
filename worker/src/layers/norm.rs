//! RMSNorm with its weight: plain, or fused into another op (the tensor-parallel sum and
//! residual add after a row-parallel projection, per-head q/k norm).

use anyhow::Result;

use super::var_builder::VarBuilder;
use crate::backend::Backend;

pub struct RmsNorm<B: Backend> {
    weight: B::Tensor,
    eps: f32,
}

impl<B: Backend> RmsNorm<B> {
    /// Loads `weight` [dim] of the norm module `vb`.
    pub fn load(vb: &VarBuilder<B>, dim: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: vb.upload(&vb.get("weight", &[dim])?)?,
            eps: eps as f32,
        })
    }

    pub fn forward(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor> {
        b.rms_norm(x, &self.weight, self.eps)
    }

    /// The weight and eps, for an op that fuses the norm (per-head q/k norm, the
    /// all-reduce after a row-parallel projection).
    pub fn weight_and_eps(&self) -> (&B::Tensor, f32) {
        (&self.weight, self.eps)
    }
}

//! RMSNorm with its weight: plain, or fused into another op (the tensor-parallel sum and
//! residual add after a row-parallel projection, per-head q/k norm), or folded into the
//! projection after it (`fold_into`, for `Backend::folds_norms`).

use anyhow::Result;

use super::var_builder::VarBuilder;
use crate::backend::Backend;
use crate::weights::HostTensor;

pub struct RmsNorm<B: Backend> {
    weight: B::Tensor,
    dim: usize,
    eps: f32,
}

impl<B: Backend> RmsNorm<B> {
    /// Loads `weight` [dim] of the norm module `vb`.
    pub fn load(vb: &VarBuilder<B>, dim: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: vb.upload(&vb.get("weight", &[dim])?)?,
            dim,
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

    pub fn eps(&self) -> f32 {
        self.eps
    }

    /// Moves the weight into the columns of `projection` (the weight [out, in] this norm's
    /// output multiplies), leaving a norm of weight 1: `norm(x) · wᵀ` is unchanged, and
    /// the projection may also read x unnormed and scale its rows after.
    pub fn fold_into(&mut self, b: &B, projection: &mut B::Tensor) -> Result<()> {
        b.fold_norm_weight(projection, &self.weight)?;
        self.weight = b.upload(&HostTensor::new(vec![self.dim], vec![1.0; self.dim]))?;
        Ok(())
    }
}

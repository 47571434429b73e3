//! Rotary embedding: the cos/sin table for this model's theta and scaling, which
//! `Backend::prepare_qkv` applies to q and k at each token's position.

use anyhow::Result;
use vllm_kernels::cpu::{compute_cos_sin_cache, compute_inv_freq};

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::weights::HostTensor;

pub struct RotaryEmbedding<B: Backend> {
    cos_sin_cache: B::Tensor,
}

impl<B: Backend> RotaryEmbedding<B> {
    /// A table for positions `0..max_positions` (the served max_model_len).
    pub fn new(b: &B, cfg: &ModelConfig, max_positions: usize) -> Result<Self> {
        let mut inv_freq = compute_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling);
        if let Some(factors) = &cfg.rope_freq_factors {
            for (f, &d) in inv_freq.iter_mut().zip(factors) {
                *f /= f64::from(d);
            }
        }
        let cache = compute_cos_sin_cache(&inv_freq, max_positions);
        let cos_sin_cache = b.upload(&HostTensor::new(vec![max_positions, cfg.head_dim], cache))?;
        Ok(Self { cos_sin_cache })
    }

    /// [max_positions, rotary_dim]: the cos half then the sin half of each position.
    pub fn cos_sin_cache(&self) -> &B::Tensor {
        &self.cos_sin_cache
    }
}

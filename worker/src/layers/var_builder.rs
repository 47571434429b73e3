//! `VarBuilder` (candle's name): where a module's weights come from. It carries the
//! backend that will hold them, the checkpoint, this rank's place in the tensor-parallel
//! group and the module's name prefix, so loading code reads as the module tree
//! (`vb.pp("self_attn").pp("o_proj")`) and each layer shards its own weights.

use std::fmt::Display;

use anyhow::Result;

use super::TensorParallel;
use crate::backend::Backend;
use crate::weights::{WeightTensor, Weights};

pub struct VarBuilder<'a, B: Backend> {
    pub backend: &'a B,
    weights: &'a Weights,
    pub tp: TensorParallel,
    prefix: String,
}

impl<'a, B: Backend> VarBuilder<'a, B> {
    /// The builder of the whole checkpoint (no prefix).
    pub fn new(backend: &'a B, weights: &'a Weights, tp: TensorParallel) -> Self {
        Self {
            backend,
            weights,
            tp,
            prefix: String::new(),
        }
    }

    /// The builder of sub-module `name`: its tensors are `<prefix>.<name>.…`.
    pub fn pp(&self, name: impl Display) -> Self {
        let prefix = match self.prefix.as_str() {
            "" => name.to_string(),
            p => format!("{p}.{name}"),
        };
        Self {
            backend: self.backend,
            weights: self.weights,
            tp: self.tp,
            prefix,
        }
    }

    /// The full name of this module's tensor `name`.
    pub fn name(&self, name: &str) -> String {
        self.pp(name).prefix
    }

    /// This module's tensor `name`, checked against `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<WeightTensor<'a>> {
        self.weights.get(&self.name(name), shape)
    }

    /// Puts a (sharded) tensor on the backend.
    pub fn upload(&self, w: &WeightTensor) -> Result<B::Tensor> {
        self.backend.upload_weight(w)
    }
}

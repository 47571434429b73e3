//! The tensor-parallel linear layers of DESIGN §7, loaded from HF tensor names.
//!
//! Column-parallel layers (`QKVParallelLinear`, `MergedColumnParallelLinear`) keep this
//! rank's slice of output rows and need no communication. `RowParallelLinear` keeps a
//! slice of input columns; its partial outputs are summed across ranks together with the
//! residual add and norm that follow it (`Backend::linear_all_reduce_add_rms_norm`, fused
//! where the backend can). With tp size 1 every shard is the whole tensor.

use anyhow::{ensure, Result};

use super::norm::RmsNorm;
use super::var_builder::VarBuilder;
use crate::backend::Backend;
use crate::weights::WeightTensor;

/// Fused q, k, v projection. Loads `{q,k,v}_proj.{weight,bias}` of the attention module
/// and keeps this rank's heads; when tp size exceeds the kv heads, each rank keeps one
/// replicated kv head.
pub struct QKVParallelLinear<B: Backend> {
    weight: B::Tensor,
    bias: Option<B::Tensor>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
}

impl<B: Backend> QKVParallelLinear<B> {
    pub fn load(
        vb: &VarBuilder<B>,
        hidden: usize,
        (total_heads, total_kv_heads, head_dim): (usize, usize, usize),
        bias: bool,
    ) -> Result<Self> {
        let tp = vb.tp;
        let (q_head0, num_heads) = tp.even_shard(total_heads, "num_attention_heads")?;
        let (kv_head0, num_kv_heads) = if tp.size >= total_kv_heads {
            ensure!(
                tp.size.is_multiple_of(total_kv_heads),
                "tp size {} must be a multiple of kv heads {total_kv_heads}",
                tp.size
            );
            (tp.rank * total_kv_heads / tp.size, 1)
        } else {
            tp.even_shard(total_kv_heads, "num_key_value_heads")?
        };
        let part = |name: &str,
                    heads_total: usize,
                    head0: usize,
                    heads: usize|
         -> Result<(WeightTensor<'_>, Option<WeightTensor<'_>>)> {
            let proj = vb.pp(name);
            let w = proj.get("weight", &[heads_total * head_dim, hidden])?;
            let w = w.narrow(0, head0 * head_dim, heads * head_dim);
            let bias_t = if bias {
                let bt = proj.get("bias", &[heads_total * head_dim])?;
                Some(bt.narrow(0, head0 * head_dim, heads * head_dim))
            } else {
                None
            };
            Ok((w, bias_t))
        };
        let (qw, qb) = part("q_proj", total_heads, q_head0, num_heads)?;
        let (kw, kb) = part("k_proj", total_kv_heads, kv_head0, num_kv_heads)?;
        let (vw, v_bias) = part("v_proj", total_kv_heads, kv_head0, num_kv_heads)?;
        let weight = vb.upload(&WeightTensor::cat_rows(vec![qw, kw, vw]))?;
        let bias = match (qb, kb, v_bias) {
            (Some(q), Some(k), Some(v)) => Some(vb.upload(&WeightTensor::cat_rows(vec![q, k, v]))?),
            _ => None,
        };
        Ok(Self {
            weight,
            bias,
            num_heads,
            num_kv_heads,
        })
    }

    /// [T, (heads + 2·kv_heads)·head_dim]: this rank's q, k and v heads side by side
    /// (`Backend::prepare_qkv` takes them apart), without the bias, which
    /// `prepare_qkv` adds (after a deferred norm's scale).
    pub fn forward(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor> {
        b.linear(x, &self.weight)
    }

    /// The bias of `forward`'s columns, for `Backend::prepare_qkv`.
    pub fn bias(&self) -> Option<&B::Tensor> {
        self.bias.as_ref()
    }

    /// Folds `norm`, the norm before this projection, into the weight.
    pub fn fold_norm(&mut self, b: &B, norm: &mut RmsNorm<B>) -> Result<()> {
        norm.fold_into(b, &mut self.weight)
    }
}

/// Several column-parallel projections of the same input fused into one GEMM (gate/up).
pub struct MergedColumnParallelLinear<B: Backend> {
    weight: B::Tensor,
}

impl<B: Backend> MergedColumnParallelLinear<B> {
    /// Loads the `weight` [out, input] of each sub-module `names[i]` of `vb` and keeps
    /// this rank's rows of each.
    pub fn load(vb: &VarBuilder<B>, names: &[&str], input: usize, out: usize) -> Result<Self> {
        let (start, len) = vb.tp.even_shard(out, "intermediate_size")?;
        let parts = names
            .iter()
            .map(|n| Ok(vb.pp(n).get("weight", &[out, input])?.narrow(0, start, len)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            weight: vb.upload(&WeightTensor::cat_rows(parts))?,
        })
    }

    pub fn forward(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor> {
        b.linear(x, &self.weight)
    }

    /// `silu(gate) · up` of the two halves of the output (the gated MLP), fused where the
    /// backend can.
    pub fn forward_silu_and_mul(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor> {
        b.linear_silu_and_mul(x, &self.weight)
    }

    /// `forward_silu_and_mul` of the unnormed x, its norm folded in (`fold_norm`).
    pub fn forward_rms_silu_and_mul(&self, b: &B, x: &B::Tensor, eps: f32) -> Result<B::Tensor> {
        b.linear_rms_silu_and_mul(x, &self.weight, eps)
    }

    /// Folds `norm`, the norm before this projection, into the weight.
    pub fn fold_norm(&mut self, b: &B, norm: &mut RmsNorm<B>) -> Result<()> {
        norm.fold_into(b, &mut self.weight)
    }
}

/// Row-parallel projection (o_proj, down_proj): this rank's input columns, then the
/// all-reduce that sums the ranks' partial outputs.
pub struct RowParallelLinear<B: Backend> {
    weight: B::Tensor,
}

impl<B: Backend> RowParallelLinear<B> {
    /// Loads `weight` [out, input] of the module `vb` and keeps this rank's columns.
    pub fn load(vb: &VarBuilder<B>, input: usize, out: usize) -> Result<Self> {
        let name = vb.name("weight");
        let (start, len) = vb.tp.even_shard(input, &name)?;
        let w = vb.get("weight", &[out, input])?.narrow(1, start, len);
        Ok(Self {
            weight: vb.upload(&w)?,
        })
    }

    /// The projection summed over the ranks, then `residual += sum` and `norm(residual)`
    /// (the norm that follows every row-parallel projection), which it returns.
    pub fn forward_add_rms_norm(
        &self,
        b: &B,
        x: &B::Tensor,
        norm: &RmsNorm<B>,
        residual: &mut B::Tensor,
    ) -> Result<B::Tensor> {
        let (weight, eps) = norm.weight_and_eps();
        b.linear_all_reduce_add_rms_norm(x, &self.weight, residual, weight, eps)
    }

    /// `residual += x · wᵀ`, at tensor-parallel size 1 (`Backend::folds_norms`).
    pub fn forward_add(&self, b: &B, x: &B::Tensor, residual: &mut B::Tensor) -> Result<()> {
        b.linear_add(x, &self.weight, residual)
    }
}

//! The `Backend`: every op the model uses, over backend-owned tensor handles.
//!
//! Model code is written once against this trait and never touches elements; the CPU
//! backend (`cpu.rs`) runs the fast CPU kernels (or the f32 reference kernels), the CUDA
//! backend (`cuda/`) implements the same ops with its own kernels. Per-step metadata
//! (`StepInputs`) is uploaded once per step as small i32 tensors (`StepMetadata`) that
//! every layer reads, with whatever the backend plans for the step (the CUDA backend's
//! attention plan).

pub mod cpu;
pub mod cuda;

pub use cpu::CpuBackend;
pub use cuda::CudaBackend;

use anyhow::Result;
use vllm_kernels::cpu::attention::PagedAttentionShape;

use crate::weights::{DType, HostTensor, WeightTensor};

/// Host-side inputs of one forward step, in batch order (vLLM's names).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepInputs {
    /// [num_tokens] token ids to compute.
    pub input_ids: Vec<i32>,
    /// [num_tokens] absolute position of each token in its sequence.
    pub positions: Vec<i32>,
    /// [num_tokens] cache slot (`block_id * block_size + offset`) of each token's K/V.
    pub slot_mapping: Vec<i32>,
    /// [num_seqs, max_blocks_per_seq], rows padded with 0 (never read past `seq_lens`).
    pub block_tables: Vec<i32>,
    pub max_blocks_per_seq: usize,
    /// [num_seqs] tokens of each sequence once this step's are in the cache.
    pub seq_lens: Vec<i32>,
    /// [num_seqs + 1] prefix sums of the tokens each sequence computes this step.
    pub query_start_loc: Vec<i32>,
    /// Rows of the hidden states whose logits are needed (last token of each sequence
    /// that completes this step).
    pub logits_indices: Vec<i32>,
}

impl StepInputs {
    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }
    pub fn num_seqs(&self) -> usize {
        self.seq_lens.len()
    }
    /// Whether the logits rows are every token in order (a step of decodes only), so
    /// that the hidden states need no gather before the LM head.
    pub fn samples_every_token(&self) -> bool {
        self.logits_indices.len() == self.num_tokens()
            && self
                .logits_indices
                .iter()
                .enumerate()
                .all(|(i, &r)| r == i as i32)
    }

    /// Every slot and block lies inside a KV cache of `num_blocks` blocks, and every
    /// position inside the context: what a kernel indexes with them, checked before any
    /// launch (a replayed CUDA graph checks nothing itself).
    pub fn check_against_cache(
        &self,
        num_blocks: usize,
        block_size: usize,
        max_model_len: usize,
    ) -> Result<()> {
        let num_slots = num_blocks * block_size;
        if let Some(&slot) = self.slot_mapping.iter().find(|&&s| s >= num_slots as i32) {
            anyhow::bail!("slot {slot} outside the KV cache of {num_blocks} blocks");
        }
        if let Some(&b) = self
            .block_tables
            .iter()
            .find(|&&b| b < 0 || b >= num_blocks as i32)
        {
            anyhow::bail!("block {b} outside the KV cache of {num_blocks} blocks");
        }
        check_rotary_positions(&self.positions, max_model_len)
    }
}

/// The largest step a backend is asked to hold (its step buffers' size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepCapacity {
    pub max_num_tokens: usize,
    pub max_num_seqs: usize,
    /// Block-table entries per sequence: `max_model_len / block_size`, rounded up.
    pub max_blocks_per_seq: usize,
}

/// `StepInputs` on the device, uploaded once per step.
pub struct StepMetadata<B: Backend + ?Sized> {
    /// The backend's plan of this step (`()` on the CPU).
    pub plan: B::StepPlan,
    pub input_ids: B::Ints,
    pub positions: B::Ints,
    pub slot_mapping: B::Ints,
    pub block_tables: B::Ints,
    pub seq_lens: B::Ints,
    pub query_start_loc: B::Ints,
    pub logits_indices: B::Ints,
    /// `StepInputs::samples_every_token`.
    pub samples_every_token: bool,
    pub num_tokens: usize,
    pub num_seqs: usize,
    pub max_blocks_per_seq: usize,
}

/// The ops of a Llama-family decoder. Activations are [rows, cols] (cols may be read as
/// [heads, head_dim]); the KV cache of one layer is one K and one V tensor of
/// [num_blocks, block_size, num_kv_heads, head_dim].
pub trait Backend {
    /// A floating-point tensor (weights, activations, KV cache) owned by the backend.
    type Tensor;
    /// A small i32 tensor of step metadata.
    type Ints;
    /// What the backend works out once per step for every layer (the CUDA attention plan).
    type StepPlan;

    /// Device name reported to the engine ("cpu", "cuda:0").
    fn device_name(&self) -> String;
    /// The dtype activations and weights are computed in ("float32" on CPU).
    fn dtype_name(&self) -> &'static str;
    /// Bytes per element of the KV cache, for sizing the block pool.
    fn kv_cache_element_bytes(&self) -> usize;

    /// An f32 host tensor (rotary tables, test data), stored in the backend's dtype.
    fn upload(&self, t: &HostTensor) -> Result<Self::Tensor>;
    /// The dtype weights are computed in: a weight of this dtype is uploaded without a
    /// conversion, and dummy weights are generated in it.
    fn weight_dtype(&self) -> DType;
    /// A model weight in its checkpoint dtype: uploaded as is when it is the backend's
    /// dtype, else converted (in parallel) on the way.
    fn upload_weight(&self, w: &WeightTensor) -> Result<Self::Tensor>;
    fn to_host(&self, t: &Self::Tensor) -> Result<HostTensor>;

    /// Sizes whatever the backend keeps per step for steps up to `capacity`, planned for
    /// this rank's `num_q_heads` and `num_kv_heads` (the CUDA step buffers); called once,
    /// before the first step.
    fn reserve_steps(
        &self,
        capacity: StepCapacity,
        num_q_heads: usize,
        num_kv_heads: usize,
    ) -> Result<()>;
    /// Uploads one step's metadata; it stays valid until the next step is uploaded.
    fn upload_step(&self, inputs: &StepInputs) -> Result<StepMetadata<Self>>;

    /// One layer's K or V cache, NaN-free but uninitialised in meaning.
    fn alloc_kv_cache(
        &self,
        num_blocks: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self::Tensor>;

    /// Rows of `table` (a vocabulary shard starting at `vocab_start`) for `ids`; zeros for
    /// ids outside the shard.
    fn embedding(
        &self,
        table: &Self::Tensor,
        ids: &Self::Ints,
        vocab_start: usize,
    ) -> Result<Self::Tensor>;
    /// `x · wᵀ`, `w` in [out, in] layout.
    fn linear(&self, x: &Self::Tensor, w: &Self::Tensor) -> Result<Self::Tensor>;
    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Tensor, eps: f32) -> Result<Self::Tensor>;
    /// `residual += x; x = rms_norm(residual)`, in place.
    fn fused_add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        residual: &mut Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
    ) -> Result<()>;
    /// Splits the columns of `x` into consecutive parts of the given widths (q, k, v).
    fn split_cols(&self, x: &Self::Tensor, widths: &[usize]) -> Result<Vec<Self::Tensor>>;
    /// Everything between the fused qkv projection and attention: adds the projection's
    /// `bias` (Qwen2), splits `qkv` [T, (hq + 2·hkv)·d] into q, k and v heads, RMSNorms
    /// q and k per head when `qk_norm` (q weight, k weight, eps) is given, applies neox
    /// rotary to both at `positions`, writes k and v to the cache at `slot_mapping`, and
    /// returns q [T, hq·d]. The CPU runs the single ops; CUDA fuses them into one launch.
    /// `deferred_norm` (the projection's input and its norm's eps, only where
    /// `folds_norms`): the projection read the raw residual, so each row is first scaled by
    /// that input row's 1 / RMS.
    #[allow(clippy::too_many_arguments)]
    fn prepare_qkv(
        &self,
        qkv: &Self::Tensor,
        bias: Option<&Self::Tensor>,
        heads: &PagedAttentionShape,
        qk_norm: Option<(&Self::Tensor, &Self::Tensor, f32)>,
        deferred_norm: Option<(&Self::Tensor, f32)>,
        positions: &Self::Ints,
        cos_sin_cache: &Self::Tensor,
        key_cache: &mut Self::Tensor,
        value_cache: &mut Self::Tensor,
        slot_mapping: &Self::Ints,
    ) -> Result<Self::Tensor>;
    fn paged_attention(
        &self,
        q: &Self::Tensor,
        key_cache: &Self::Tensor,
        value_cache: &Self::Tensor,
        meta: &StepMetadata<Self>,
        shape: &PagedAttentionShape,
        scale: f32,
    ) -> Result<Self::Tensor>;
    /// [T, 2d] → [T, d]: `silu(gate) * up`.
    fn silu_and_mul(&self, x: &Self::Tensor) -> Result<Self::Tensor>;
    /// `silu_and_mul(linear(x, w))` for the fused gate/up weight `w` [2d, in]; a backend
    /// may fuse the two (the CPU backend does, saving the [T, 2d] round trip).
    fn linear_silu_and_mul(&self, x: &Self::Tensor, w: &Self::Tensor) -> Result<Self::Tensor> {
        self.silu_and_mul(&self.linear(x, w)?)
    }
    /// Whether this backend runs deferred norms (`LlamaForCausalLM::forward_deferred`):
    /// the RMSNorm before a projection folded into its columns at load
    /// (`fold_norm_weight`), the projection reading the raw residual, and the op after it
    /// scaling each row by the residual row's 1 / RMS; the residual adds go into the
    /// row-parallel products (`linear_add`). Only at tensor-parallel size 1.
    fn folds_norms(&self) -> bool {
        false
    }
    /// Whether a step of `rows` tokens runs faster deferred (the norms' own kernels
    /// removed); only asked where `folds_norms`.
    fn defers_norms(&self, _rows: usize) -> bool {
        false
    }
    /// w [out, in] *= g [in], column by column: the norm with weight g, which comes before
    /// the projection w, folded into it. Only where `folds_norms`.
    fn fold_norm_weight(&self, _w: &mut Self::Tensor, _g: &Self::Tensor) -> Result<()> {
        anyhow::bail!("{} folds no norm into a projection", self.device_name())
    }
    /// `residual += x · wᵀ` (a row-parallel projection at tensor-parallel size 1). Only
    /// where `folds_norms`.
    fn linear_add(
        &self,
        _x: &Self::Tensor,
        _w: &Self::Tensor,
        _residual: &mut Self::Tensor,
    ) -> Result<()> {
        anyhow::bail!("{} adds no product into the residual", self.device_name())
    }
    /// `silu_and_mul(linear(x, w))` for a gate/up weight with the norm of x folded in:
    /// each product row scaled by x's row 1 / RMS (eps `eps`) first. Only where
    /// `folds_norms`.
    fn linear_rms_silu_and_mul(
        &self,
        _x: &Self::Tensor,
        _w: &Self::Tensor,
        _eps: f32,
    ) -> Result<Self::Tensor> {
        anyhow::bail!("{} defers no norm", self.device_name())
    }
    /// Rows `indices` of `x`, in order.
    fn gather_rows(&self, x: &Self::Tensor, indices: &Self::Ints) -> Result<Self::Tensor>;

    /// Sums `x` over the tensor-parallel ranks (after a row-parallel layer or the
    /// vocab-parallel embedding). Identity on world size 1.
    fn all_reduce(&self, x: &mut Self::Tensor) -> Result<()>;
    /// `all_reduce(x)`, then `fused_add_rms_norm(x, residual, weight, eps)`: what follows
    /// every row-parallel projection, one kernel where the backend has one.
    fn all_reduce_add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        residual: &mut Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
    ) -> Result<()> {
        self.all_reduce(x)?;
        self.fused_add_rms_norm(x, residual, weight, eps)
    }
    /// `linear(x, w)` of a row-parallel projection, then `all_reduce_add_rms_norm` of it:
    /// returns the normed sum. One token's product and sum are fused where the backend
    /// can (the CUDA custom all-reduce: the gemv sends its outputs to the ranks).
    fn linear_all_reduce_add_rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        residual: &mut Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
    ) -> Result<Self::Tensor> {
        let mut y = self.linear(x, w)?;
        self.all_reduce_add_rms_norm(&mut y, residual, weight, eps)?;
        Ok(y)
    }
    /// Each rank's [rows, cols] side by side in rank order: [rows, world_size · cols] (the
    /// vocab-parallel logits). Identity on world size 1.
    fn all_gather_cols(&self, x: Self::Tensor) -> Result<Self::Tensor>;
}

/// Every position must have a row in the rotary cos/sin cache (of `max_pos` rows); a backend
/// checks this before it indexes the cache with them.
pub fn check_rotary_positions(positions: &[i32], max_pos: usize) -> Result<()> {
    let max_pos = max_pos as i32;
    if let Some(&p) = positions.iter().find(|&&p| p < 0 || p >= max_pos) {
        anyhow::bail!("position {p} outside the rotary cache (max_model_len {max_pos})");
    }
    Ok(())
}

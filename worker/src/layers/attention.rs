//! Attention over the paged KV cache: every query token attends causally to its sequence's
//! cached keys (this step's K and V are already in the cache: `Backend::prepare_qkv`).

use anyhow::Result;
use vllm_kernels::cpu::attention::PagedAttentionShape;

use crate::backend::{Backend, StepMetadata};
use crate::kv_cache::KvCacheLayer;

pub struct Attention {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

impl Attention {
    /// Local (this rank's) head counts.
    pub fn new(num_heads: usize, num_kv_heads: usize, head_dim: usize) -> Self {
        Self {
            num_heads,
            num_kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
        }
    }

    /// The geometry of this step's attention.
    pub fn shape<B: Backend>(
        &self,
        block_size: usize,
        meta: &StepMetadata<B>,
    ) -> PagedAttentionShape {
        PagedAttentionShape {
            num_q_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            block_size,
            max_blocks_per_seq: meta.max_blocks_per_seq,
        }
    }

    /// Attention of q over the cache, in this step's `shape` (from `Attention::shape`).
    pub fn forward<B: Backend>(
        &self,
        b: &B,
        q: &B::Tensor,
        cache: &KvCacheLayer<B>,
        shape: &PagedAttentionShape,
        meta: &StepMetadata<B>,
    ) -> Result<B::Tensor> {
        b.paged_attention(q, &cache.key, &cache.value, meta, shape, self.scale)
    }
}

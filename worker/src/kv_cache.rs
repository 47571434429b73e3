//! The worker's KV cache tensors: per layer one K and one V tensor of
//! [num_blocks, block_size, num_kv_heads, head_dim], indexed by the engine's block ids,
//! and the arithmetic that sizes the block pool from a memory budget.

use anyhow::Result;

use crate::backend::Backend;

pub struct KvCacheLayer<B: Backend> {
    pub key: B::Tensor,
    pub value: B::Tensor,
}

pub struct KvCache<B: Backend> {
    pub layers: Vec<KvCacheLayer<B>>,
    pub num_blocks: usize,
    pub block_size: usize,
}

impl<B: Backend> KvCache<B> {
    pub fn allocate(
        b: &B,
        num_layers: usize,
        num_blocks: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let layers = (0..num_layers)
            .map(|_| {
                Ok(KvCacheLayer {
                    key: b.alloc_kv_cache(num_blocks, block_size, num_kv_heads, head_dim)?,
                    value: b.alloc_kv_cache(num_blocks, block_size, num_kv_heads, head_dim)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            num_blocks,
            block_size,
        })
    }
}

/// Bytes one block takes over all layers, K and V.
pub fn bytes_per_block(
    num_layers: usize,
    block_size: usize,
    num_kv_heads: usize,
    head_dim: usize,
    element_bytes: usize,
) -> u64 {
    2 * (num_layers * block_size * num_kv_heads * head_dim * element_bytes) as u64
}

#[cfg(test)]
mod tests {
    #[test]
    fn block_bytes_count_k_and_v_of_every_layer() {
        assert_eq!(
            super::bytes_per_block(2, 16, 2, 16, 4),
            2 * 2 * 16 * 2 * 16 * 4
        );
    }
}

//! `BlockId`: a KV-cache block's index in the pool, the one name the pool, its free queue,
//! the KV cache manager and the scheduler share (and the `block_ids` the workers receive).

pub type BlockId = u32;

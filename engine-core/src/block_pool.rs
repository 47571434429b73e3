//! The pool of KV-cache blocks: reference counts, the LRU free queue and the
//! hash → block map of the prefix cache.
//!
//! A block is either referenced (`ref_cnt > 0`, owned by one or more requests) or free
//! (in the free queue). A free block keeps its hash until it is reallocated, so a later
//! request with the same prefix can revive it; reallocation evicts the hash.

use std::collections::HashMap;

use crate::block_hash::BlockHash;
use crate::block_id::BlockId;
use crate::free_block_queue::FreeBlockQueue;

#[derive(Debug, Clone, Default)]
struct KvCacheBlock {
    ref_cnt: u32,
    /// Set once the block is full and its KV computed; cleared on eviction.
    block_hash: Option<BlockHash>,
}

#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<KvCacheBlock>,
    free_block_queue: FreeBlockQueue,
    /// One block per hash: when two requests compute the same block at the same time, the
    /// second copy is simply not cached (it is freed like an uncached block).
    cached_block_hash_to_block: HashMap<BlockHash, BlockId>,
    enable_caching: bool,
}

impl BlockPool {
    pub fn new(num_blocks: u32, enable_caching: bool) -> Self {
        Self {
            blocks: vec![KvCacheBlock::default(); num_blocks as usize],
            free_block_queue: FreeBlockQueue::new(num_blocks),
            cached_block_hash_to_block: HashMap::new(),
            enable_caching,
        }
    }

    pub fn num_blocks(&self) -> u32 {
        self.blocks.len() as u32
    }

    pub fn num_free_blocks(&self) -> u32 {
        self.free_block_queue.len() as u32
    }

    pub fn ref_cnt(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].ref_cnt
    }

    pub fn block_hash(&self, id: BlockId) -> Option<BlockHash> {
        self.blocks[id as usize].block_hash
    }

    pub fn get_cached_block(&self, hash: &BlockHash) -> Option<BlockId> {
        self.cached_block_hash_to_block.get(hash).copied()
    }

    /// Takes `n` blocks from the front of the free queue (least recently freed first),
    /// evicting their hashes. `None`, with nothing taken, when fewer than `n` are free.
    pub fn get_new_blocks(&mut self, n: u32) -> Option<Vec<BlockId>> {
        if n > self.num_free_blocks() {
            return None;
        }
        let mut out = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let id = self.free_block_queue.pop_front()?;
            self.evict_hash(id);
            self.blocks[id as usize].ref_cnt = 1;
            out.push(id);
        }
        Some(out)
    }

    /// Adds one reference to each block (a prefix-cache hit); a free block leaves the free
    /// queue, keeping its hash.
    pub fn touch(&mut self, ids: &[BlockId]) {
        for &id in ids {
            let block = &mut self.blocks[id as usize];
            if block.ref_cnt == 0 {
                self.free_block_queue.remove(id);
            }
            block.ref_cnt += 1;
        }
    }

    /// Drops one reference from each block, in the given order; blocks reaching zero join
    /// the back of the free queue, so callers pass the eviction order they want.
    pub fn free_blocks(&mut self, ids: impl IntoIterator<Item = BlockId>) {
        for id in ids {
            let block = &mut self.blocks[id as usize];
            debug_assert!(block.ref_cnt > 0, "block {id} freed with no reference");
            block.ref_cnt = block.ref_cnt.saturating_sub(1);
            if block.ref_cnt == 0 {
                self.free_block_queue.push_back(id);
            }
        }
    }

    /// Registers a full, computed block under its hash so later requests can reuse it.
    pub fn cache_block(&mut self, id: BlockId, hash: BlockHash) {
        if !self.enable_caching || self.blocks[id as usize].block_hash.is_some() {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) =
            self.cached_block_hash_to_block.entry(hash)
        {
            e.insert(id);
            self.blocks[id as usize].block_hash = Some(hash);
        }
    }

    fn evict_hash(&mut self, id: BlockId) {
        if let Some(hash) = self.blocks[id as usize].block_hash.take() {
            if self.cached_block_hash_to_block.get(&hash) == Some(&id) {
                self.cached_block_hash_to_block.remove(&hash);
            }
        }
    }

    /// Forgets the hash of every free block; blocks in use keep theirs.
    pub fn reset_prefix_cache(&mut self) {
        let free: Vec<BlockId> = self.free_block_queue.iter().collect();
        for id in free {
            self.evict_hash(id);
        }
    }

    /// Checks the pool's own invariants given how many requests own each block.
    pub fn check_invariants(&self, owners: &[u32]) -> Result<(), String> {
        for (id, block) in self.blocks.iter().enumerate() {
            let id = id as BlockId;
            let in_free = self.free_block_queue.contains(id);
            if block.ref_cnt != owners[id as usize] {
                return Err(format!(
                    "block {id}: ref_cnt {} but {} owners",
                    block.ref_cnt, owners[id as usize]
                ));
            }
            if in_free == (block.ref_cnt > 0) {
                return Err(format!(
                    "block {id}: ref_cnt {} and in free queue = {in_free}",
                    block.ref_cnt
                ));
            }
            if let Some(h) = block.block_hash {
                if self.cached_block_hash_to_block.get(&h) != Some(&id) {
                    return Err(format!("block {id}: hash not mapped back to it"));
                }
            }
        }
        for (h, &id) in &self.cached_block_hash_to_block {
            if self.blocks[id as usize].block_hash != Some(*h) {
                return Err(format!("hash map points to block {id} with another hash"));
            }
        }
        if self.free_block_queue.iter().count() != self.free_block_queue.len() {
            return Err("free queue length disagrees with its links".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_hash::hash_block_tokens;

    #[test]
    fn free_block_keeps_hash_until_reallocated() {
        let mut pool = BlockPool::new(2, true);
        let a = pool.get_new_blocks(1).unwrap()[0];
        let h = hash_block_tokens(None, &[1, 2]);
        pool.cache_block(a, h);
        pool.free_blocks([a]);
        assert_eq!(pool.get_cached_block(&h), Some(a));
        // Revive it: leaves the free queue, keeps its hash.
        pool.touch(&[a]);
        assert_eq!(pool.num_free_blocks(), 1);
        pool.free_blocks([a]);
        // Two allocations drain the queue; the cached block (freed last) goes second.
        let got = pool.get_new_blocks(2).unwrap();
        assert_eq!(got[1], a);
        assert_eq!(pool.get_cached_block(&h), None);
        assert!(pool.get_new_blocks(1).is_none());
    }
}

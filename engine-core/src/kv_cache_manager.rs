//! `KvCacheManager`: each request's block table on top of the [`BlockPool`].
//!
//! It finds a new request's longest cached prefix, allocates the blocks a step needs
//! (all or nothing), registers full computed blocks in the prefix cache, frees a request's
//! blocks tail-first, and counts prefix-cache queries and hits in tokens, like vLLM.

use std::collections::HashMap;

use crate::block_hash::BlockHash;
use crate::block_id::BlockId;
use crate::block_pool::BlockPool;
use crate::request::Request;

/// The cached prefix a waiting request can reuse.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ComputedBlocks {
    pub block_ids: Vec<BlockId>,
    pub num_computed_tokens: u32,
}

#[derive(Debug, Clone, Default)]
struct RequestBlocks {
    block_table: Vec<BlockId>,
    /// How many leading blocks of `block_table` are registered in the prefix cache.
    num_cached_blocks: usize,
}

#[derive(Debug, Clone)]
pub struct KvCacheManager {
    block_size: u32,
    enable_caching: bool,
    block_pool: BlockPool,
    req_to_blocks: HashMap<String, RequestBlocks>,
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
}

impl KvCacheManager {
    pub fn new(num_gpu_blocks: u32, block_size: u32, enable_caching: bool) -> Self {
        Self {
            block_size,
            enable_caching,
            block_pool: BlockPool::new(num_gpu_blocks, enable_caching),
            req_to_blocks: HashMap::new(),
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
        }
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    pub fn enable_caching(&self) -> bool {
        self.enable_caching
    }

    pub fn num_total_blocks(&self) -> u32 {
        self.block_pool.num_blocks()
    }

    pub fn num_free_blocks(&self) -> u32 {
        self.block_pool.num_free_blocks()
    }

    /// Fraction of blocks in use.
    pub fn usage(&self) -> f32 {
        let total = self.num_total_blocks();
        if total == 0 {
            return 0.0;
        }
        (total - self.num_free_blocks()) as f32 / total as f32
    }

    pub fn prefix_cache_queries(&self) -> u64 {
        self.prefix_cache_queries
    }

    pub fn prefix_cache_hits(&self) -> u64 {
        self.prefix_cache_hits
    }

    pub fn block_pool(&self) -> &BlockPool {
        &self.block_pool
    }

    /// The request's block table (empty for a request holding no blocks).
    pub fn block_ids(&self, request_id: &str) -> &[BlockId] {
        self.req_to_blocks
            .get(request_id)
            .map_or(&[], |b| b.block_table.as_slice())
    }

    /// The longest run of cached blocks matching the request's prefix. At least one token
    /// is always left to compute (its logits are needed to sample), so a fully cached
    /// sequence reuses all blocks but the one holding its last token.
    pub fn get_computed_blocks(&self, request: &Request) -> ComputedBlocks {
        if !self.enable_caching {
            return ComputedBlocks::default();
        }
        let max_cache_hit_tokens = request.num_tokens().saturating_sub(1);
        let max_blocks = (max_cache_hit_tokens / self.block_size) as usize;
        let block_ids: Vec<BlockId> = request
            .block_hashes
            .iter()
            .take(max_blocks)
            .map_while(|h| self.block_pool.get_cached_block(h))
            .collect();
        let num_computed_tokens = block_ids.len() as u32 * self.block_size;
        ComputedBlocks {
            block_ids,
            num_computed_tokens,
        }
    }

    /// Counts one prefix-cache lookup that led to an admission (vLLM's tokens metric).
    pub fn record_prefix_cache_query(&mut self, num_query_tokens: u32, num_hit_tokens: u32) {
        if self.enable_caching {
            self.prefix_cache_queries += u64::from(num_query_tokens);
            self.prefix_cache_hits += u64::from(num_hit_tokens);
        }
    }

    /// Number of blocks a request needs to hold `num_tokens` tokens.
    pub fn blocks_for_tokens(&self, num_tokens: u32) -> u32 {
        num_tokens.div_ceil(self.block_size)
    }

    /// Makes room for `num_new_tokens` more tokens after `num_computed_tokens` (which
    /// includes the prefix hit `new_computed_blocks`, given only for a request holding no
    /// blocks yet). All or nothing: returns false, changing nothing, when the pool is short.
    pub fn allocate_slots(
        &mut self,
        request_id: &str,
        num_computed_tokens: u32,
        num_new_tokens: u32,
        new_computed_blocks: &[BlockId],
    ) -> bool {
        let num_held = self.block_ids(request_id).len() as u32;
        let num_required = self.blocks_for_tokens(num_computed_tokens + num_new_tokens);
        let num_new_blocks =
            num_required.saturating_sub(num_held + new_computed_blocks.len() as u32);
        // A hit on a free block takes it out of the free queue too.
        let num_revived = new_computed_blocks
            .iter()
            .filter(|&&id| self.block_pool.ref_cnt(id) == 0)
            .count() as u32;
        if num_new_blocks + num_revived > self.block_pool.num_free_blocks() {
            return false;
        }
        // Touch the hits before taking new blocks, so eviction cannot take a hit.
        self.block_pool.touch(new_computed_blocks);
        let Some(new_blocks) = self.block_pool.get_new_blocks(num_new_blocks) else {
            // Unreachable after the check above; undo the touch rather than leak.
            self.block_pool
                .free_blocks(new_computed_blocks.iter().rev().copied());
            return false;
        };
        // Look up before inserting: `entry()` would allocate the key on every call.
        if !self.req_to_blocks.contains_key(request_id) {
            self.req_to_blocks
                .insert(request_id.to_string(), RequestBlocks::default());
        }
        let Some(entry) = self.req_to_blocks.get_mut(request_id) else {
            return false;
        };
        if entry.block_table.is_empty() {
            entry.num_cached_blocks = new_computed_blocks.len();
        }
        entry.block_table.extend_from_slice(new_computed_blocks);
        entry.block_table.extend(new_blocks);
        true
    }

    /// Registers the request's full blocks whose KV is computed (the first
    /// `num_computed_tokens` tokens) in the prefix cache. Called after a step ran, so a
    /// cache hit never serves KV that has not been written yet.
    pub fn cache_blocks(
        &mut self,
        request_id: &str,
        block_hashes: &[BlockHash],
        num_computed_tokens: u32,
    ) {
        if !self.enable_caching {
            return;
        }
        let Some(entry) = self.req_to_blocks.get_mut(request_id) else {
            return;
        };
        let num_full = ((num_computed_tokens / self.block_size) as usize)
            .min(block_hashes.len())
            .min(entry.block_table.len());
        if num_full > entry.num_cached_blocks {
            let range = entry.num_cached_blocks..num_full;
            for (&id, &hash) in entry.block_table[range.clone()]
                .iter()
                .zip(&block_hashes[range])
            {
                self.block_pool.cache_block(id, hash);
            }
            entry.num_cached_blocks = num_full;
        }
    }

    /// Frees the request's blocks tail-first: the end of a sequence is the least likely to
    /// be shared, so it should be evicted before the prefix.
    pub fn free(&mut self, request_id: &str) {
        if let Some(entry) = self.req_to_blocks.remove(request_id) {
            self.block_pool
                .free_blocks(entry.block_table.into_iter().rev());
        }
    }

    /// Forgets every cached block no request holds.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.block_pool.reset_prefix_cache();
        true
    }

    /// Ids of requests holding blocks.
    pub fn request_ids(&self) -> impl Iterator<Item = &str> {
        self.req_to_blocks.keys().map(String::as_str)
    }

    /// No leak, ref counts equal owners, no block both free and referenced, no block
    /// twice in one table. For tests and debug checks.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut owners = vec![0u32; self.num_total_blocks() as usize];
        for (req, entry) in &self.req_to_blocks {
            let mut seen = std::collections::HashSet::new();
            for &id in &entry.block_table {
                if !seen.insert(id) {
                    return Err(format!("request {req} holds block {id} twice"));
                }
                owners[id as usize] += 1;
            }
            if entry.num_cached_blocks > entry.block_table.len() {
                return Err(format!("request {req}: more cached blocks than blocks"));
            }
        }
        self.block_pool.check_invariants(&owners)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vllm_protocol::{EngineCoreRequest, SamplingParams};

    fn request(id: &str, prompt: Vec<u32>, block_size: usize) -> Request {
        let mut r = Request::from_engine_core_request(
            EngineCoreRequest {
                request_id: id.into(),
                prompt_token_ids: prompt,
                sampling_params: SamplingParams::default(),
                eos_token_ids: vec![],
                arrival_time: 0.0,
                priority: 0,
                parent_request_id: None,
            },
            0,
        );
        r.update_block_hashes(Some(block_size));
        r
    }

    #[test]
    fn prefix_hit_reuses_blocks_and_leaves_one_token() {
        let mut kv = KvCacheManager::new(8, 4, true);
        let a = request("a", (0..8).collect(), 4);
        assert!(kv.get_computed_blocks(&a).block_ids.is_empty());
        assert!(kv.allocate_slots("a", 0, 8, &[]));
        kv.cache_blocks("a", &a.block_hashes, 8);
        // Same 8-token prompt: only the first block is reusable (one token must compute).
        let b = request("b", (0..8).collect(), 4);
        let hit = kv.get_computed_blocks(&b);
        assert_eq!(hit.num_computed_tokens, 4);
        assert!(kv.allocate_slots("b", 4, 4, &hit.block_ids));
        assert_eq!(kv.block_ids("b")[0], kv.block_ids("a")[0]);
        assert_eq!(kv.block_pool().ref_cnt(kv.block_ids("a")[0]), 2);
        kv.check_invariants().unwrap();
        kv.free("a");
        kv.free("b");
        kv.check_invariants().unwrap();
        assert_eq!(kv.num_free_blocks(), 8);
        // Freed blocks keep their hashes: a third request revives them.
        let c = request("c", (0..9).collect(), 4);
        assert_eq!(kv.get_computed_blocks(&c).num_computed_tokens, 8);
    }

    #[test]
    fn allocation_is_all_or_nothing() {
        let mut kv = KvCacheManager::new(2, 4, true);
        assert!(!kv.allocate_slots("a", 0, 9, &[]));
        assert_eq!(kv.num_free_blocks(), 2);
        assert!(kv.allocate_slots("a", 0, 8, &[]));
        assert_eq!(kv.usage(), 1.0);
    }
}

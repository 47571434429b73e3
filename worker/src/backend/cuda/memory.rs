//! KV-cache sizing on the GPU (vLLM's `--gpu-memory-utilization`): after the weights are
//! loaded, a worst-case dummy step measures the activations' peak; what the budget leaves
//! becomes KV blocks.
//!
//! The dummy step is `max_num_batched_tokens` tokens spread over `max_num_seqs` sequences
//! (the most logits rows a step can need), attending through one shared cache block and
//! writing nothing to the cache (every slot is padding).

use crate::backend::StepInputs;

/// The memory facts measured around the dummy step, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemorySnapshot {
    pub total: u64,
    /// Free after the dummy step (the pool keeps what it reserved).
    pub free_after: u64,
    /// The pool's reservation now, and its high-water mark during the dummy step.
    pub pool_now: u64,
    pub pool_high: u64,
}

/// Bytes left for the KV cache: the budget minus everything in use now, minus what the
/// pool reserved at its peak beyond what it still holds.
pub fn kv_cache_bytes(m: &MemorySnapshot, utilization: f64) -> u64 {
    let budget = (m.total as f64 * utilization) as u64;
    let used = m.total.saturating_sub(m.free_after);
    let transient = m.pool_high.saturating_sub(m.pool_now);
    budget.saturating_sub(used).saturating_sub(transient)
}

/// The worst-case step: `tokens` tokens over `min(seqs, tokens)` sequences, positions
/// below `max_model_len`, every sequence reading block 0 and writing nowhere.
pub fn dummy_step(
    tokens: usize,
    seqs: usize,
    block_size: usize,
    max_model_len: usize,
) -> StepInputs {
    let tokens = tokens.max(1);
    let seqs = seqs.clamp(1, tokens);
    let per = tokens / seqs;
    let lens: Vec<usize> = (0..seqs)
        .map(|s| per + usize::from(s < tokens % seqs))
        .collect();
    let max_len = lens.iter().copied().max().unwrap_or(1);
    let max_blocks = max_len.div_ceil(block_size.max(1));
    let mut query_start_loc = vec![0i32];
    let mut positions = Vec::with_capacity(tokens);
    let mut logits_indices = Vec::with_capacity(seqs);
    for &len in &lens {
        let start = *query_start_loc.last().unwrap_or(&0);
        positions.extend((0..len).map(|p| (p % max_model_len.max(1)) as i32));
        query_start_loc.push(start + len as i32);
        logits_indices.push(start + len as i32 - 1);
    }
    StepInputs {
        input_ids: vec![0; tokens],
        positions,
        slot_mapping: vec![-1; tokens],
        block_tables: vec![0; seqs * max_blocks],
        max_blocks_per_seq: max_blocks,
        seq_lens: lens.iter().map(|&l| l as i32).collect(),
        query_start_loc,
        logits_indices,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dummy_step_spreads_tokens_over_sequences() {
        let s = dummy_step(10, 4, 4, 100);
        assert_eq!(s.seq_lens, vec![3, 3, 2, 2]);
        assert_eq!(s.query_start_loc, vec![0, 3, 6, 8, 10]);
        assert_eq!(s.logits_indices, vec![2, 5, 7, 9]);
        assert_eq!(s.max_blocks_per_seq, 1);
        assert!(s.slot_mapping.iter().all(|&x| x == -1));
        assert_eq!(s.num_tokens(), 10);
    }

    #[test]
    fn kv_budget_subtracts_use_and_transient_peak() {
        let m = MemorySnapshot {
            total: 100,
            free_after: 70,
            pool_now: 10,
            pool_high: 15,
        };
        // 90 budget - 30 used - 5 transient
        assert_eq!(kv_cache_bytes(&m, 0.9), 55);
        assert_eq!(kv_cache_bytes(&m, 0.2), 0);
    }
}

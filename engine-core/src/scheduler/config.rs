//! `SchedulerConfig`: the limits one engine step works within, with vLLM's names.

use serde::{Deserialize, Serialize};

/// The order waiting requests are admitted in (`--scheduling-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum SchedulingPolicy {
    /// First come, first served.
    #[default]
    Fcfs,
    /// Lower `priority` value first, then earlier arrival.
    Priority,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    /// Most requests running at once (`--max-num-seqs`).
    pub max_num_seqs: u32,
    /// Token budget of one step (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: u32,
    /// Longest sequence (prompt + output) the model accepts.
    pub max_model_len: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Size of the KV block pool.
    pub num_gpu_blocks: u32,
    pub enable_prefix_caching: bool,
    pub enable_chunked_prefill: bool,
    pub policy: SchedulingPolicy,
    /// Most tokens one request may prefill in a step, so several long prompts share a
    /// step (vLLM's `--long-prefill-token-threshold`); 0 = no limit.
    pub long_prefill_token_threshold: u32,
    /// `--async-scheduling` (vLLM's): schedule step N+1 while step N runs, on output
    /// placeholders for N's tokens. The engine loop reads it; the scheduler's bookkeeping
    /// is the same either way.
    #[serde(default)]
    pub async_scheduling: bool,
}

impl SchedulerConfig {
    /// Steps the engine keeps sent and unanswered: with async scheduling one is queued
    /// behind the running one (depth 1, as vLLM's).
    pub fn max_steps_in_flight(&self) -> usize {
        if self.async_scheduling {
            2
        } else {
            1
        }
    }
}

impl Default for SchedulerConfig {
    /// vLLM's serving defaults; `max_model_len` and `num_gpu_blocks` come from the model
    /// and the memory profile in practice.
    fn default() -> Self {
        Self {
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 4096,
            block_size: 16,
            num_gpu_blocks: 4096,
            enable_prefix_caching: true,
            enable_chunked_prefill: true,
            policy: SchedulingPolicy::Fcfs,
            long_prefill_token_threshold: 0,
            async_scheduling: false,
        }
    }
}

//! Messages between the engine-core and its workers.
//!
//! Engine-core → every rank (ROUTER → DEALER): [`WorkerInput`], mainly one
//! [`SchedulerOutput`] per step. Rank → engine-core (PUSH → PULL): [`WorkerEvent`]; only
//! rank 0 sends [`ModelRunnerOutput`]s, every rank may send `Failed`.
//!
//! A worker keeps each running request's state (token ids, block table) between steps, so
//! a step carries the full data only for requests new to the workers and deltas for the
//! rest (DESIGN §3).
//!
//! With async scheduling (`--async-scheduling`) the engine-core sends step N+1 before it
//! has seen step N's sampled tokens. A request that samples in step N and is scheduled
//! again in N+1 then has an *output placeholder*: a position whose token only the workers
//! know yet. Each worker fills it with the token its own sampler drew in step N (every rank
//! samples the same token), and the engine-core's authoritative copy of that token arrives
//! one step later in `new_token_ids`, which the worker checks against what it used. See
//! [`CachedRequestData::num_output_placeholders`].

use serde::{Deserialize, Serialize};

use crate::{engine::Register, wire_message, SamplingParams, TokenLogprobs, WorkerProfile};

/// A request the workers have not seen (or have dropped after preemption).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewRequestData {
    pub req_id: String,
    pub prompt_token_ids: Vec<u32>,
    /// Tokens already generated: non-empty when a preempted request resumes.
    pub output_token_ids: Vec<u32>,
    pub sampling_params: SamplingParams,
    pub block_ids: Vec<u32>,
    pub num_computed_tokens: u32,
}

/// What changed for a request the workers already hold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CachedRequestData {
    pub req_id: String,
    /// Token ids appended since the workers last saw this request (the tokens sampled in
    /// earlier steps, as rank 0 reported them). A worker holds each of them already, from
    /// its own sampler: one its KV was computed from must equal it (a mismatch fails the
    /// step: the ranks diverged), one not yet computed is simply replaced by it, so every
    /// rank's copy follows the engine-core's.
    pub new_token_ids: Vec<u32>,
    /// Blocks appended to the request's block table.
    pub new_block_ids: Vec<u32>,
    pub num_computed_tokens: u32,
    /// Output placeholders (vLLM's `num_output_placeholders`): how many tokens at the end
    /// of the sequence were sampled in steps whose output the engine-core had not seen when
    /// it scheduled this one. They follow the tokens above; the worker takes them from its
    /// own sampler, and they come back in `new_token_ids` of a later step. Always 0
    /// without async scheduling; at most 1 with it (one step in flight).
    #[serde(default)]
    pub num_output_placeholders: u32,
}

/// The plan of one engine step, broadcast to every rank.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SchedulerOutput {
    pub step_id: u64,
    pub scheduled_new_reqs: Vec<NewRequestData>,
    pub scheduled_cached_reqs: Vec<CachedRequestData>,
    /// Tokens to compute this step for each scheduled request, in batch order: new
    /// requests first, then cached ones, as listed above.
    pub num_scheduled_tokens: Vec<(String, u32)>,
    pub total_num_scheduled_tokens: u32,
    /// Requests that ended since the last step: workers drop their state.
    pub finished_req_ids: Vec<String>,
    /// Requests preempted since the last step: workers drop their state; a preempted
    /// request comes back later as a new request.
    pub preempted_req_ids: Vec<String>,
}

impl SchedulerOutput {
    pub fn is_empty(&self) -> bool {
        self.total_num_scheduled_tokens == 0
    }
}

/// One sampled token for one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampledToken {
    pub req_id: String,
    pub token_id: u32,
    pub logprobs: Option<TokenLogprobs>,
}

/// Rank 0's answer to a `SchedulerOutput`: a token for every request whose scheduled
/// tokens reached the end of its sequence (a partial prefill chunk samples nothing).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelRunnerOutput {
    pub step_id: u64,
    pub sampled: Vec<SampledToken>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InitializeKvCache {
    pub num_blocks: u32,
}

/// What every rank needs to join the tensor-parallel group before it loads its shard.
/// Rank 0 makes it (a CUDA rank creates the NCCL unique id, since only the workers load
/// NCCL) and the engine-core hands the same value to every rank in the handshake.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DistributedInit {
    /// The 128-byte `ncclUniqueId`; `None` on the CPU backend or at world size 1.
    pub nccl_unique_id: Option<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum WorkerInput {
    InitDistributed(DistributedInit),
    InitializeKvCache(InitializeKvCache),
    Execute(SchedulerOutput),
    Shutdown(()),
}

wire_message!(WorkerInput {
    InitDistributed(DistributedInit) = 0x24,
    InitializeKvCache(InitializeKvCache) = 0x21,
    Execute(SchedulerOutput) = 0x22,
    Shutdown(()) = 0x23,
});

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum WorkerEvent {
    /// Sent on the DEALER right after connecting.
    Register(Register),
    /// Rank 0's proposal of the group's `DistributedInit`, right after registering.
    DistributedInit(DistributedInit),
    /// Model loaded and memory profiled.
    Profiled(WorkerProfile),
    /// KV cache allocated; the rank is ready to execute.
    KvCacheReady(u32),
    Output(ModelRunnerOutput),
    /// The rank failed (startup or step); it exits after sending this.
    Failed(String),
}

wire_message!(WorkerEvent {
    Register(Register) = 0x31,
    DistributedInit(DistributedInit) = 0x36,
    Profiled(WorkerProfile) = 0x32,
    KvCacheReady(u32) = 0x33,
    Output(ModelRunnerOutput) = 0x34,
    Failed(String) = 0x35,
});

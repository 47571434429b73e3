//! The worker's copy of every running request (`CachedRequestState`) and the batch builder
//! that turns one `SchedulerOutput` into the step's `StepInputs`.
//!
//! The scheduler sends full data for new requests and deltas for the rest (DESIGN §3);
//! `InputBatch::update_states` applies them, `InputBatch::prepare_inputs` lays out the
//! step's tokens in the order of `num_scheduled_tokens`.

use std::collections::HashMap;

use anyhow::{bail, ensure, Context, Result};
use vllm_protocol::{SamplingParams, SchedulerOutput};

use crate::backend::StepInputs;

/// What the worker remembers about one request between steps.
#[derive(Debug, Clone, PartialEq)]
pub struct CachedRequestState {
    pub req_id: String,
    pub prompt_token_ids: Vec<u32>,
    pub output_token_ids: Vec<u32>,
    pub sampling_params: SamplingParams,
    /// The request's block table.
    pub block_ids: Vec<u32>,
    /// Tokens whose K/V are in the cache, as last sent by the scheduler.
    pub num_computed_tokens: u32,
}

impl CachedRequestState {
    pub fn num_tokens(&self) -> usize {
        self.prompt_token_ids.len() + self.output_token_ids.len()
    }

    fn token_at(&self, pos: usize) -> u32 {
        let p = self.prompt_token_ids.len();
        if pos < p {
            self.prompt_token_ids[pos]
        } else {
            self.output_token_ids[pos - p]
        }
    }
}

/// Running requests by id.
#[derive(Debug, Default)]
pub struct InputBatch {
    pub requests: HashMap<String, CachedRequestState>,
}

/// The step's inputs plus which requests sample a token (in `logits_indices` order).
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedStep {
    pub inputs: StepInputs,
    pub sampled_req_ids: Vec<String>,
}

impl InputBatch {
    /// Drops finished and preempted requests, adds new ones, applies deltas.
    pub fn update_states(&mut self, so: &SchedulerOutput) -> Result<()> {
        for id in so.finished_req_ids.iter().chain(&so.preempted_req_ids) {
            self.requests.remove(id);
        }
        for new in &so.scheduled_new_reqs {
            self.requests.insert(
                new.req_id.clone(),
                CachedRequestState {
                    req_id: new.req_id.clone(),
                    prompt_token_ids: new.prompt_token_ids.clone(),
                    output_token_ids: new.output_token_ids.clone(),
                    sampling_params: new.sampling_params.clone(),
                    block_ids: new.block_ids.clone(),
                    num_computed_tokens: new.num_computed_tokens,
                },
            );
        }
        for delta in &so.scheduled_cached_reqs {
            let state = self.requests.get_mut(&delta.req_id).with_context(|| {
                format!(
                    "scheduler sent a delta for unknown request {}",
                    delta.req_id
                )
            })?;
            state
                .output_token_ids
                .extend_from_slice(&delta.new_token_ids);
            state.block_ids.extend_from_slice(&delta.new_block_ids);
            state.num_computed_tokens = delta.num_computed_tokens;
        }
        Ok(())
    }

    /// Lays out the scheduled tokens in `num_scheduled_tokens` order.
    pub fn prepare_inputs(&self, so: &SchedulerOutput, block_size: usize) -> Result<PreparedStep> {
        let mut inputs = StepInputs {
            query_start_loc: vec![0],
            ..Default::default()
        };
        let mut tables: Vec<&[u32]> = Vec::new();
        let mut sampled_req_ids = Vec::new();
        for (req_id, n) in &so.num_scheduled_tokens {
            let state = self
                .requests
                .get(req_id)
                .with_context(|| format!("scheduled request {req_id} is unknown"))?;
            let start = state.num_computed_tokens as usize;
            let end = start + *n as usize;
            ensure!(
                end <= state.num_tokens(),
                "request {req_id}: {n} tokens scheduled from {start} but it has only {} tokens",
                state.num_tokens()
            );
            let blocks_needed = end.div_ceil(block_size);
            ensure!(
                state.block_ids.len() >= blocks_needed,
                "request {req_id}: {end} tokens need {blocks_needed} blocks, block table has {}",
                state.block_ids.len()
            );
            for pos in start..end {
                inputs.input_ids.push(state.token_at(pos) as i32);
                inputs.positions.push(pos as i32);
                let block = state.block_ids[pos / block_size] as usize;
                inputs
                    .slot_mapping
                    .push((block * block_size + pos % block_size) as i32);
            }
            inputs.seq_lens.push(end as i32);
            inputs.query_start_loc.push(inputs.input_ids.len() as i32);
            tables.push(&state.block_ids[..blocks_needed]);
            // Only a request whose sequence is complete after this step samples; a
            // partial prefill chunk does not.
            if end == state.num_tokens() && end > start {
                inputs
                    .logits_indices
                    .push(inputs.input_ids.len() as i32 - 1);
                sampled_req_ids.push(req_id.clone());
            }
        }
        if inputs.input_ids.len() != so.total_num_scheduled_tokens as usize {
            bail!(
                "total_num_scheduled_tokens is {} but the per-request counts sum to {}",
                so.total_num_scheduled_tokens,
                inputs.input_ids.len()
            );
        }
        inputs.max_blocks_per_seq = tables.iter().map(|t| t.len()).max().unwrap_or(0);
        for t in &tables {
            inputs.block_tables.extend(t.iter().map(|&b| b as i32));
            inputs
                .block_tables
                .extend(std::iter::repeat_n(0, inputs.max_blocks_per_seq - t.len()));
        }
        Ok(PreparedStep {
            inputs,
            sampled_req_ids,
        })
    }
}

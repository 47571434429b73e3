//! The worker's copy of every running request (`CachedRequestState`) and the batch builder
//! that turns one `SchedulerOutput` into the step's `StepInputs`.
//!
//! The scheduler sends full data for new requests and deltas for the rest (DESIGN §3);
//! `InputBatch::update_states` applies them, `InputBatch::prepare_inputs` lays out the
//! step's tokens in the order of `num_scheduled_tokens`.
//!
//! After each step the worker appends the tokens its own sampler drew
//! (`InputBatch::record_sampled`) as *unconfirmed*; the engine-core's copy arrives in a
//! later step's `new_token_ids` and confirms them. Without async scheduling a token is
//! always confirmed before it is computed, so the worker's sampler is never trusted; with
//! it, the worker computes its own token in the next step (an output placeholder), and the
//! confirmation then checks the ranks did not diverge (see `CachedRequestData`).

use std::collections::HashMap;

use anyhow::{bail, ensure, Context, Result};
use vllm_protocol::{SampledToken, SamplingParams, SchedulerOutput};

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
    /// How many trailing `output_token_ids` came from this rank's own sampler and are not
    /// confirmed by the engine-core yet.
    pub num_unconfirmed: usize,
}

impl CachedRequestState {
    pub fn num_tokens(&self) -> usize {
        self.prompt_token_ids.len() + self.output_token_ids.len()
    }

    /// Applies the engine-core's `new_token_ids`: they stand for this rank's oldest
    /// unconfirmed tokens. One whose KV is already computed (a position below
    /// `num_computed_tokens`) must be equal: the step fails rather than let the ranks'
    /// sequences diverge. One not computed yet is overwritten, as the engine-core's word is
    /// final. Tokens beyond the unconfirmed ones (a runner that did not record its samples)
    /// are appended.
    fn confirm(&mut self, new_token_ids: &[u32], num_computed_tokens: u32) -> Result<()> {
        let first = self.output_token_ids.len() - self.num_unconfirmed;
        let num_prompt = self.prompt_token_ids.len();
        for (i, &token) in new_token_ids.iter().enumerate() {
            let at = first + i;
            let Some(held) = self.output_token_ids.get_mut(at) else {
                self.output_token_ids.push(token);
                continue;
            };
            if *held != token {
                let pos = num_prompt + at;
                ensure!(
                    pos >= num_computed_tokens as usize,
                    "request {}: this rank computed position {pos} from its own sampled token \
                     {held}, but rank 0 sampled {token}: the ranks' samplers diverged",
                    self.req_id,
                );
                tracing::debug!(
                    req_id = %self.req_id,
                    pos,
                    "replacing this rank's sampled token {held} by rank 0's {token}"
                );
                *held = token;
            }
        }
        self.num_unconfirmed = self.num_unconfirmed.saturating_sub(new_token_ids.len());
        Ok(())
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
                    num_unconfirmed: 0,
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
            state.confirm(&delta.new_token_ids, delta.num_computed_tokens)?;
            ensure!(
                state.num_unconfirmed == delta.num_output_placeholders as usize,
                "request {}: the scheduler counts {} output placeholders but this rank \
                 holds {} unconfirmed sampled tokens",
                delta.req_id,
                delta.num_output_placeholders,
                state.num_unconfirmed
            );
            state.block_ids.extend_from_slice(&delta.new_block_ids);
            state.num_computed_tokens = delta.num_computed_tokens;
        }
        Ok(())
    }

    /// Appends the tokens this rank sampled in a step, unconfirmed, to their requests: the
    /// next step may compute them before the engine-core has seen them (async scheduling).
    pub fn record_sampled(&mut self, sampled: &[SampledToken]) {
        for s in sampled {
            if let Some(state) = self.requests.get_mut(&s.req_id) {
                state.output_token_ids.push(s.token_id);
                state.num_unconfirmed += 1;
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use vllm_protocol::{CachedRequestData, NewRequestData};

    /// A batch holding request "r": prompt [1, 2, 3], 2 blocks, prompt computed.
    fn batch() -> InputBatch {
        let mut b = InputBatch::default();
        let so = SchedulerOutput {
            scheduled_new_reqs: vec![NewRequestData {
                req_id: "r".into(),
                prompt_token_ids: vec![1, 2, 3],
                output_token_ids: vec![],
                sampling_params: SamplingParams::default(),
                block_ids: vec![0, 1],
                num_computed_tokens: 0,
            }],
            num_scheduled_tokens: vec![("r".into(), 3)],
            total_num_scheduled_tokens: 3,
            ..Default::default()
        };
        b.update_states(&so).unwrap();
        b
    }

    fn sampled(token_id: u32) -> Vec<SampledToken> {
        vec![SampledToken {
            req_id: "r".into(),
            token_id,
            logprobs: None,
        }]
    }

    fn delta(new_token_ids: Vec<u32>, computed: u32, placeholders: u32) -> SchedulerOutput {
        SchedulerOutput {
            scheduled_cached_reqs: vec![CachedRequestData {
                req_id: "r".into(),
                new_token_ids,
                new_block_ids: vec![],
                num_computed_tokens: computed,
                num_output_placeholders: placeholders,
            }],
            num_scheduled_tokens: vec![("r".into(), 1)],
            total_num_scheduled_tokens: 1,
            ..Default::default()
        }
    }

    #[test]
    fn a_placeholder_is_filled_from_this_ranks_sample_and_confirmed_later() {
        let mut b = batch();
        b.record_sampled(&sampled(7));
        // Async: step 2 computes position 3 before the engine knows token 7.
        b.update_states(&delta(vec![], 3, 1)).unwrap();
        let step = b.prepare_inputs(&delta(vec![], 3, 1), 2).unwrap();
        assert_eq!(step.inputs.input_ids, vec![7]);
        assert_eq!(step.sampled_req_ids, vec!["r".to_string()]);
        b.record_sampled(&sampled(8));
        // Step 3 brings 7, confirmed; 8 is the new placeholder.
        b.update_states(&delta(vec![7], 4, 1)).unwrap();
        let r = &b.requests["r"];
        assert_eq!(
            (r.output_token_ids.clone(), r.num_unconfirmed),
            (vec![7, 8], 1)
        );
    }

    #[test]
    fn a_computed_token_that_differs_from_rank_0s_fails_the_step() {
        let mut b = batch();
        b.record_sampled(&sampled(7));
        b.update_states(&delta(vec![], 3, 1)).unwrap();
        b.record_sampled(&sampled(8));
        let err = b.update_states(&delta(vec![9], 4, 1)).unwrap_err();
        assert!(format!("{err:#}").contains("diverged"), "{err:#}");
    }

    #[test]
    fn a_token_not_yet_computed_follows_rank_0() {
        // Serial scheduling: the engine sends the token before any step computes it.
        let mut b = batch();
        b.record_sampled(&sampled(7));
        b.update_states(&delta(vec![9], 3, 0)).unwrap();
        let r = &b.requests["r"];
        assert_eq!(
            (r.output_token_ids.clone(), r.num_unconfirmed),
            (vec![9], 0)
        );
    }

    #[test]
    fn a_placeholder_count_the_rank_cannot_fill_fails_the_step() {
        let mut b = batch();
        let err = b.update_states(&delta(vec![], 3, 1)).unwrap_err();
        assert!(format!("{err:#}").contains("placeholders"), "{err:#}");
    }
}

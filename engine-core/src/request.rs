//! `Request`: the scheduler's state of one request.
//!
//! Token ids (prompt then output), how many of them have KV computed
//! (`num_computed_tokens`), the status, the prefix-cache hashes of its full blocks, and what
//! the workers already know about it (so a step sends them only the delta).

use vllm_protocol::{EngineCoreRequest, FinishReason, SamplingParams};

use crate::block_hash::{extend_block_hashes, BlockHash};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    Waiting,
    Running,
    /// Preempted by recompute: back in the waiting queue with no blocks.
    Preempted,
    Finished(FinishReason),
}

#[derive(Debug, Clone)]
pub struct Request {
    pub request_id: String,
    /// Prompt token ids followed by output token ids.
    pub all_token_ids: Vec<u32>,
    pub num_prompt_tokens: u32,
    pub sampling_params: SamplingParams,
    pub eos_token_ids: Vec<u32>,
    pub arrival_time: f64,
    pub priority: i32,
    /// The group this request shares sequence slots with: its API request's id (its
    /// `parent_request_id`), else its own id.
    pub share_group: String,
    /// Admission order, breaking arrival-time ties and choosing preemption victims.
    pub arrival_seq: u64,
    pub status: RequestStatus,
    /// Tokens whose KV is computed (or scheduled this step: it advances at schedule time).
    pub num_computed_tokens: u32,
    /// Output placeholders (vLLM's name): tokens sampled in steps that are sent but whose
    /// output has not come back. The sequence the scheduler plans with is `num_tokens()`
    /// known tokens followed by these. Only async scheduling schedules a request while it
    /// has one; every step's output takes one away.
    pub num_output_placeholders: u32,
    /// Which admission to the running set this is (unique over all requests, renewed after
    /// every preemption), so the output of a step scheduled for an earlier one, or for an
    /// ended request whose id was reused, is recognised as stale and dropped.
    pub admission_seq: u64,
    /// Prompt tokens served by the prefix cache when first scheduled.
    pub num_cached_tokens: Option<u32>,
    /// Hashes of every full block of `all_token_ids` (kept only with prefix caching).
    pub block_hashes: Vec<BlockHash>,
    /// How many of `all_token_ids` the workers hold; 0 while they hold nothing.
    pub num_tokens_sent: usize,
    /// How many of the block table's ids the workers hold.
    pub num_blocks_sent: usize,
    /// Whether the workers hold this request (false when new or preempted).
    pub known_to_workers: bool,
}

impl Request {
    pub fn from_engine_core_request(req: EngineCoreRequest, arrival_seq: u64) -> Self {
        Self {
            share_group: req
                .parent_request_id
                .unwrap_or_else(|| req.request_id.clone()),
            request_id: req.request_id,
            num_prompt_tokens: req.prompt_token_ids.len() as u32,
            all_token_ids: req.prompt_token_ids,
            sampling_params: req.sampling_params,
            eos_token_ids: req.eos_token_ids,
            arrival_time: req.arrival_time,
            priority: req.priority,
            arrival_seq,
            status: RequestStatus::Waiting,
            num_computed_tokens: 0,
            num_output_placeholders: 0,
            admission_seq: 0,
            num_cached_tokens: None,
            block_hashes: Vec::new(),
            num_tokens_sent: 0,
            num_blocks_sent: 0,
            known_to_workers: false,
        }
    }

    pub fn num_tokens(&self) -> u32 {
        self.all_token_ids.len() as u32
    }

    pub fn num_output_tokens(&self) -> u32 {
        self.num_tokens() - self.num_prompt_tokens
    }

    /// Known tokens plus the placeholders of steps in flight: the sequence the next step
    /// extends.
    pub fn num_tokens_with_placeholders(&self) -> u32 {
        self.num_tokens() + self.num_output_placeholders
    }

    /// Whether the tokens already in flight will end the request by length
    /// (`max_tokens` or the model's length), so scheduling it again would only compute a
    /// token to throw away (vLLM skips such a request the same way).
    pub fn length_reached_with_placeholders(&self, max_model_len: u32) -> bool {
        self.num_output_placeholders > 0
            && self.num_tokens_with_placeholders() >= self.max_total_tokens(max_model_len)
    }

    pub fn prompt_token_ids(&self) -> &[u32] {
        &self.all_token_ids[..self.num_prompt_tokens as usize]
    }

    pub fn output_token_ids(&self) -> &[u32] {
        &self.all_token_ids[self.num_prompt_tokens as usize..]
    }

    pub fn is_finished(&self) -> bool {
        matches!(self.status, RequestStatus::Finished(_))
    }

    /// Appends a sampled token, hashing any block it completes.
    pub fn append_output_token(&mut self, token_id: u32, hash_block_size: Option<usize>) {
        self.all_token_ids.push(token_id);
        self.update_block_hashes(hash_block_size);
    }

    pub fn update_block_hashes(&mut self, hash_block_size: Option<usize>) {
        if let Some(block_size) = hash_block_size {
            extend_block_hashes(&mut self.block_hashes, &self.all_token_ids, block_size);
        }
    }

    /// The largest number of tokens this request can ever hold: its context is capped by
    /// `max_tokens` and by the model's length.
    pub fn max_total_tokens(&self, max_model_len: u32) -> u32 {
        self.num_prompt_tokens
            .saturating_add(self.sampling_params.max_tokens)
            .min(max_model_len)
    }

    /// vLLM's stop checks, run after each sampled token. `min_tokens` holds back eos and
    /// stop ids but never the length caps, so a request can never outgrow the model.
    pub fn check_stop(&self, max_model_len: u32) -> Option<(FinishReason, Option<u32>)> {
        let last = *self.all_token_ids.last()?;
        let params = &self.sampling_params;
        let num_output = self.num_output_tokens();
        if num_output >= params.min_tokens {
            if !params.ignore_eos && self.eos_token_ids.contains(&last) {
                return Some((FinishReason::Stop, None));
            }
            if params.stop_token_ids.contains(&last) {
                return Some((FinishReason::Stop, Some(last)));
            }
        }
        if num_output >= params.max_tokens || self.num_tokens() >= max_model_len {
            return Some((FinishReason::Length, None));
        }
        None
    }
}

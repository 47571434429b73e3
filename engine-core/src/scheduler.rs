//! The `Scheduler`: decides, every step, which requests compute how many tokens.
//!
//! vLLM V1's design: no prefill or decode phase, each request advances
//! `num_computed_tokens` toward `num_tokens` within a per-step token budget and sequence
//! cap. Running requests go first (preempting the most recently admitted one, or the
//! lowest-priority one, when the KV pool is short), then waiting requests in policy order,
//! the sequence slots shared fairly among API requests (`fair_share`).
//! It also applies sampled tokens, runs the stop checks, and tracks what the workers know
//! so each `SchedulerOutput` carries only deltas.
//!
//! Async scheduling (vLLM's): the engine may call `schedule()` again before the last
//! step's output came back. A request that samples in a step in flight holds an output
//! placeholder (`Request::num_output_placeholders`) and is scheduled on top of it; the
//! workers fill it from their own sampler. `in_flight` remembers what each sent step was
//! planned for, so a late output for a request that has since ended or been preempted is
//! dropped. A request's blocks may be freed while a step that writes them is in flight:
//! the workers run steps in order, so the step that next receives those blocks runs after
//! it, and only known tokens are ever hashed, so no cached block holds a dropped token.

mod config;
mod fair_share;
mod in_flight;
mod request_queue;

use std::collections::HashMap;

use vllm_protocol::{
    CachedRequestData, EngineCoreOutput, EngineCoreRequest, ModelRunnerOutput, NewRequestData,
    SampledToken, SchedulerOutput, SchedulerStats,
};

pub use config::{SchedulerConfig, SchedulingPolicy};
use fair_share::Shares;
use in_flight::{InFlightStep, InFlightSteps, ScheduledRequest};
use request_queue::RequestQueue;

use crate::block_id::BlockId;
use crate::kv_cache_manager::KvCacheManager;
use crate::request::{Request, RequestStatus};

#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    kv_cache_manager: KvCacheManager,
    /// Every unfinished request, waiting or running.
    requests: HashMap<String, Request>,
    waiting: RequestQueue,
    /// Running requests in admission order (the last is preempted first under FCFS).
    running: Vec<String>,
    /// Ended requests the workers may still hold; sent with the next non-empty step.
    finished_req_ids: Vec<String>,
    /// Preempted requests the workers still hold; sent with the next non-empty step.
    preempted_req_ids: Vec<String>,
    next_arrival_seq: u64,
    /// Source of `Request::admission_seq`.
    next_admission_seq: u64,
    /// Steps sent to the workers and not yet updated from their output.
    in_flight: InFlightSteps,
    step_id: u64,
    num_preemptions: u64,
}

/// The decisions of one `schedule()` call, before they are turned into wire data.
#[derive(Default)]
struct StepPlan {
    /// (request id, tokens to compute) for running requests, in batch order.
    running: Vec<(String, u32)>,
    /// Same for requests admitted from the waiting queue this step.
    admitted: Vec<(String, u32)>,
    token_budget: u32,
    preempted: bool,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Self {
        let kv_cache_manager = KvCacheManager::new(
            config.num_gpu_blocks,
            config.block_size.max(1),
            config.enable_prefix_caching,
        );
        Self {
            waiting: RequestQueue::new(config.policy),
            config,
            kv_cache_manager,
            requests: HashMap::new(),
            running: Vec::new(),
            finished_req_ids: Vec::new(),
            preempted_req_ids: Vec::new(),
            next_arrival_seq: 0,
            next_admission_seq: 0,
            in_flight: InFlightSteps::default(),
            step_id: 0,
            num_preemptions: 0,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    fn block_size(&self) -> u32 {
        self.kv_cache_manager.block_size()
    }

    /// The block size to hash full blocks with, when prefix caching is on.
    fn hash_block_size(&self) -> Option<usize> {
        self.config
            .enable_prefix_caching
            .then_some(self.block_size() as usize)
    }

    /// Validates and queues a request. Refuses (with one sentence naming the lengths) a
    /// request that could never complete: empty, with no room to generate, or larger than
    /// the whole KV pool, so the scheduler can never spin on it.
    pub fn add_request(&mut self, req: EngineCoreRequest) -> Result<(), String> {
        self.validate(&req)?;
        let mut request = Request::from_engine_core_request(req, self.next_arrival_seq);
        self.next_arrival_seq += 1;
        let max_total = request.max_total_tokens(self.config.max_model_len);
        // The last token is sampled, never computed: it needs no KV slot.
        let blocks_needed = self.kv_cache_manager.blocks_for_tokens(max_total - 1);
        if blocks_needed > self.config.num_gpu_blocks {
            return Err(format!(
                "The request needs up to {max_total} tokens ({} in the prompt, up to {} \
                 generated), but the KV cache holds only {} tokens ({} blocks of {}).",
                request.num_prompt_tokens,
                max_total - request.num_prompt_tokens,
                u64::from(self.config.num_gpu_blocks) * u64::from(self.block_size()),
                self.config.num_gpu_blocks,
                self.block_size()
            ));
        }
        request.update_block_hashes(self.hash_block_size());
        self.waiting.push_back(&request);
        self.requests.insert(request.request_id.clone(), request);
        Ok(())
    }

    fn validate(&self, req: &EngineCoreRequest) -> Result<(), String> {
        let num_prompt = req.prompt_token_ids.len() as u64;
        let max_model_len = u64::from(self.config.max_model_len);
        if self.requests.contains_key(&req.request_id) {
            return Err(format!(
                "Request id {} is already in use by an unfinished request.",
                req.request_id
            ));
        }
        if num_prompt == 0 {
            return Err("The decoder prompt cannot be empty.".to_string());
        }
        if num_prompt >= max_model_len {
            return Err(format!(
                "This model's maximum context length is {max_model_len} tokens. However, you \
                 requested {num_prompt} tokens in the prompt ({num_prompt}), which leaves no \
                 room to generate: a prompt may have at most {} tokens.",
                max_model_len.saturating_sub(1)
            ));
        }
        let budget = u64::from(self.config.max_num_batched_tokens);
        if !self.config.enable_chunked_prefill && num_prompt > budget {
            return Err(format!(
                "The prompt ({num_prompt} tokens) is longer than max_num_batched_tokens \
                 ({budget}) and chunked prefill is disabled, so it can never be scheduled."
            ));
        }
        Ok(())
    }

    /// Finishes these requests as aborted and frees their blocks; unknown ids are ignored.
    pub fn abort_requests(&mut self, ids: &[String]) {
        for id in ids {
            let Some(req) = self.requests.remove(id) else {
                continue;
            };
            match req.status {
                RequestStatus::Waiting | RequestStatus::Preempted => self.waiting.remove(&req),
                RequestStatus::Running => {
                    self.running.retain(|r| r != id);
                    self.kv_cache_manager.free(id);
                }
                RequestStatus::Finished(_) => {}
            }
            if req.known_to_workers {
                self.finished_req_ids.push(req.request_id);
            }
        }
    }

    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut plan = StepPlan {
            token_budget: self.config.max_num_batched_tokens,
            ..StepPlan::default()
        };
        self.make_room_for_waiting_groups();
        self.schedule_running(&mut plan);
        // A step that had to preempt has no blocks to spare for newcomers (vLLM's rule);
        // admitting them would only preempt again.
        if !plan.preempted {
            self.schedule_waiting(&mut plan);
        }
        self.build_output(plan)
    }

    /// Tokens a request would compute this step before the budget is applied.
    fn num_new_tokens(&self, req: &Request, num_computed_tokens: u32) -> u32 {
        let mut n = req
            .num_tokens_with_placeholders()
            .saturating_sub(num_computed_tokens);
        let threshold = self.config.long_prefill_token_threshold;
        if threshold > 0 && self.config.enable_chunked_prefill {
            n = n.min(threshold);
        }
        n
    }

    fn schedule_running(&mut self, plan: &mut StepPlan) {
        let mut i = 0;
        while i < self.running.len() && plan.token_budget > 0 {
            let id = self.running[i].clone();
            let req = &self.requests[&id];
            let num_computed = req.num_computed_tokens;
            let num_new = self
                .num_new_tokens(req, num_computed)
                .min(plan.token_budget);
            if num_new == 0 || req.length_reached_with_placeholders(self.config.max_model_len) {
                i += 1;
                continue;
            }
            loop {
                if self
                    .kv_cache_manager
                    .allocate_slots(&id, num_computed, num_new, &[])
                {
                    break;
                }
                let victim_pos = self.pick_victim();
                let victim = self.running.remove(victim_pos);
                if victim_pos < i {
                    i -= 1;
                }
                // Under Priority the victim may already be in this step: give its tokens back.
                if let Some(pos) = plan.running.iter().position(|(r, _)| *r == victim) {
                    plan.token_budget += plan.running.remove(pos).1;
                }
                plan.preempted = true;
                self.preempt(&victim);
                if victim == id {
                    // The request itself was the victim: nothing more fits this step.
                    return;
                }
            }
            plan.token_budget -= num_new;
            plan.running.push((id, num_new));
            i += 1;
        }
    }

    /// The running request to preempt: the most recently admitted one under FCFS; under
    /// Priority the lowest-priority one (highest value), latest arrival on ties.
    fn pick_victim(&self) -> usize {
        match self.config.policy {
            SchedulingPolicy::Fcfs => self.running.len() - 1,
            SchedulingPolicy::Priority => {
                let key = |id: &String| {
                    let r = &self.requests[id];
                    (r.priority, r.arrival_time, r.arrival_seq)
                };
                let mut best = 0;
                for (pos, id) in self.running.iter().enumerate().skip(1) {
                    let (p, t, s) = key(id);
                    let (bp, bt, bs) = key(&self.running[best]);
                    if p.cmp(&bp).then(t.total_cmp(&bt)).then(s.cmp(&bs)).is_gt() {
                        best = pos;
                    }
                }
                best
            }
        }
    }

    /// Preemption by recompute: free the blocks, forget progress (the prefix cache may
    /// give some back), and requeue at the front.
    ///
    /// With a step of this request in flight, its blocks' known full tokens are cached
    /// first: the step writes their KV before any later step can read it (the workers run
    /// steps in order), so the resumed request finds them again. The step's sampled token
    /// is dropped when it arrives (the admission is over) and sampled again on resumption.
    fn preempt(&mut self, id: &str) {
        if let Some(req) = self.requests.get(id) {
            self.kv_cache_manager
                .cache_blocks(id, &req.block_hashes, req.num_computed_tokens);
        }
        self.kv_cache_manager.free(id);
        let Some(req) = self.requests.get_mut(id) else {
            return;
        };
        req.status = RequestStatus::Preempted;
        req.num_computed_tokens = 0;
        req.num_output_placeholders = 0;
        if req.known_to_workers {
            self.preempted_req_ids.push(id.to_string());
        }
        req.known_to_workers = false;
        req.num_tokens_sent = 0;
        req.num_blocks_sent = 0;
        self.waiting.push_front(req);
        self.num_preemptions += 1;
    }

    /// The share of each group among the running and waiting requests.
    fn shares(&self) -> Shares {
        let group = |id: &str| self.requests.get(id).map_or("", |r| r.share_group.as_str());
        Shares::new(
            self.running.iter().map(|id| group(id)),
            self.waiting.iter().map(group),
            self.config.max_num_seqs,
        )
    }

    /// When every slot is taken while groups under their share wait, preempts the latest
    /// admitted requests of the largest group above its share: one slot for each waiting
    /// request that its group's share lets in.
    fn make_room_for_waiting_groups(&mut self) {
        if self.running.len() < self.config.max_num_seqs as usize || self.waiting.len() == 0 {
            return;
        }
        let mut shares = self.shares();
        let mut wanted: HashMap<&str, u32> = HashMap::new();
        for id in self.waiting.iter() {
            let Some(req) = self.requests.get(id) else {
                continue;
            };
            let group = req.share_group.as_str();
            let room = shares.room(group);
            let w = wanted.entry(group).or_default();
            *w = (*w + 1).min(room);
        }
        let mut needed: u32 = wanted.values().sum();
        while needed > 0 {
            let Some(group) = shares.largest_over_share() else {
                break;
            };
            let Some(pos) = self.running.iter().rposition(|id| {
                self.requests
                    .get(id)
                    .is_some_and(|r| r.share_group == group)
            }) else {
                break;
            };
            let victim = self.running.remove(pos);
            shares.released(&group);
            self.preempt(&victim);
            needed -= 1;
        }
    }

    /// Admits waiting requests while slots, budget and blocks last: first those whose group
    /// is under its share, then (so no slot idles) any, each pass in policy order. A request
    /// that does not fit stops admission, as FCFS requires.
    fn schedule_waiting(&mut self, plan: &mut StepPlan) {
        let max_num_seqs = self.config.max_num_seqs as usize;
        let mut shares = self.shares();
        for within_share in [true, false] {
            while plan.token_budget > 0 && self.running.len() < max_num_seqs {
                let next = self.waiting.iter().find(|id| {
                    !within_share
                        || self
                            .requests
                            .get(*id)
                            .is_some_and(|r| shares.under_share(&r.share_group))
                });
                let Some(id) = next.map(str::to_string) else {
                    break;
                };
                if !self.admit(&id, plan) {
                    return;
                }
                if let Some(req) = self.requests.get(&id) {
                    shares.admitted(&req.share_group);
                }
            }
        }
    }

    /// Moves one waiting request to running with this step's tokens; false when it does
    /// not fit the budget or the KV pool.
    fn admit(&mut self, id: &str, plan: &mut StepPlan) -> bool {
        let max_batched = self.config.max_num_batched_tokens;
        let Some(req) = self.requests.get(id) else {
            return false;
        };
        let hit = self.kv_cache_manager.get_computed_blocks(req);
        let num_computed = hit.num_computed_tokens;
        let num_new = self.num_new_tokens(req, num_computed);
        // Without chunked prefill a sequence must fit whole, unless it could never fit
        // in any step (a long preempted sequence resuming), which is chunked anyway.
        if !self.config.enable_chunked_prefill
            && num_new > plan.token_budget
            && num_new <= max_batched
        {
            return false;
        }
        let num_new = num_new.min(plan.token_budget);
        if !self
            .kv_cache_manager
            .allocate_slots(id, num_computed, num_new, &hit.block_ids)
        {
            return false;
        }
        self.kv_cache_manager
            .record_prefix_cache_query(req.num_tokens(), num_computed);
        self.waiting.remove(req);
        if let Some(req) = self.requests.get_mut(id) {
            req.status = RequestStatus::Running;
            req.num_computed_tokens = num_computed;
            req.num_output_placeholders = 0;
            req.admission_seq = self.next_admission_seq;
            self.next_admission_seq += 1;
            req.num_cached_tokens.get_or_insert(num_computed);
        }
        self.running.push(id.to_string());
        plan.token_budget -= num_new;
        plan.admitted.push((id.to_string(), num_new));
        true
    }

    /// Turns the plan into the wire delta and advances `num_computed_tokens` (after the
    /// workers' data recorded the count computed *before* this step).
    fn build_output(&mut self, plan: StepPlan) -> SchedulerOutput {
        let mut so = SchedulerOutput::default();
        // Cached requests follow the new ones in `num_scheduled_tokens`, and their
        // in-flight records follow the same order.
        let mut cached_order = Vec::with_capacity(plan.running.len());
        let mut records = Vec::with_capacity(plan.admitted.len() + plan.running.len());
        for (id, n) in plan.admitted.into_iter().chain(plan.running) {
            let Some(req) = self.requests.get_mut(&id) else {
                continue;
            };
            let block_ids = self.kv_cache_manager.block_ids(&id);
            let record = ScheduledRequest {
                admission_seq: req.admission_seq,
                samples: req.num_computed_tokens + n == req.num_tokens_with_placeholders(),
            };
            if req.known_to_workers {
                so.scheduled_cached_reqs
                    .push(cached_request_data(req, block_ids));
                cached_order.push(((id, n), record));
            } else {
                so.scheduled_new_reqs.push(new_request_data(req, block_ids));
                so.num_scheduled_tokens.push((id, n));
                records.push(record);
            }
            req.num_computed_tokens += n;
            if record.samples {
                // The token this step samples is unknown until its output comes back.
                req.num_output_placeholders += 1;
            }
            so.total_num_scheduled_tokens += n;
        }
        for (scheduled, record) in cached_order {
            so.num_scheduled_tokens.push(scheduled);
            records.push(record);
        }
        // Dropped-state notices ride only on steps the engine will send to the workers.
        if so.total_num_scheduled_tokens > 0 {
            self.step_id += 1;
            so.finished_req_ids = std::mem::take(&mut self.finished_req_ids);
            so.preempted_req_ids = std::mem::take(&mut self.preempted_req_ids);
            self.in_flight.push(InFlightStep {
                step_id: self.step_id,
                requests: records,
            });
        }
        so.step_id = self.step_id;
        so
    }

    /// Applies rank 0's sampled tokens: one `EngineCoreOutput` per request that got a
    /// token (a partial prefill chunk gets none); finished requests free their blocks.
    /// Steps must be updated in the order they were scheduled. A token for a request that
    /// ended, or was preempted, after the step was scheduled is dropped.
    pub fn update_from_output(
        &mut self,
        so: &SchedulerOutput,
        out: &ModelRunnerOutput,
    ) -> Vec<EngineCoreOutput> {
        let Some(step) = self.in_flight.take(so.step_id) else {
            tracing::error!(
                step = so.step_id,
                "output of a step the scheduler has no record of; dropped"
            );
            return Vec::new();
        };
        let mut sampled = SampledLookup::new(&out.sampled);
        let hash_block_size = self.hash_block_size();
        let max_model_len = self.config.max_model_len;
        let mut outputs = Vec::with_capacity(out.sampled.len());
        let mut finished = Vec::new();
        for ((id, _), planned) in so.num_scheduled_tokens.iter().zip(&step.requests) {
            let Some(req) = self.requests.get_mut(id) else {
                continue; // aborted or finished since the step was scheduled
            };
            if req.status != RequestStatus::Running || req.admission_seq != planned.admission_seq {
                continue; // preempted since: this admission's tokens are void
            }
            // The step wrote these tokens' KV (steps still in flight write theirs before
            // any later step runs): their full blocks may now serve hits.
            self.kv_cache_manager
                .cache_blocks(id, &req.block_hashes, req.num_computed_tokens);
            if !planned.samples {
                continue; // a partial prefill chunk samples nothing
            }
            req.num_output_placeholders = req.num_output_placeholders.saturating_sub(1);
            let Some(token) = sampled.get(id) else {
                if req.num_output_placeholders == 0 {
                    // The runner owed a token and sent none: recompute the last position
                    // next step rather than leave the request stuck.
                    req.num_computed_tokens -= 1;
                    continue;
                }
                // A later step in flight already computed the workers' own token for this
                // position, which the engine will never know: the request cannot go on.
                let why = format!(
                    "step {}: the model runner sent no token for request {id}",
                    so.step_id
                );
                tracing::error!("{why}");
                let mut o = EngineCoreOutput::failed(id.clone(), why);
                o.num_cached_tokens = req.num_cached_tokens.unwrap_or(0);
                outputs.push(o);
                finished.push(id.clone());
                continue;
            };
            req.append_output_token(token.token_id, hash_block_size);
            let stop = req.check_stop(max_model_len);
            outputs.push(EngineCoreOutput {
                request_id: id.clone(),
                new_token_ids: vec![token.token_id],
                new_logprobs: token.logprobs.clone().map(|l| vec![l]),
                finish_reason: stop.map(|(reason, _)| reason),
                stop_reason: stop.and_then(|(_, s)| s),
                num_cached_tokens: req.num_cached_tokens.unwrap_or(0),
                error: None,
            });
            if let Some((reason, _)) = stop {
                req.status = RequestStatus::Finished(reason);
                finished.push(id.clone());
            }
        }
        if !finished.is_empty() {
            for id in finished {
                self.kv_cache_manager.free(&id);
                self.requests.remove(&id);
                self.finished_req_ids.push(id);
            }
            let requests = &self.requests;
            self.running.retain(|id| requests.contains_key(id));
        }
        outputs
    }

    /// Fails every unfinished request with `error` and frees all their blocks.
    pub fn fail_all(&mut self, error: &str) -> Vec<EngineCoreOutput> {
        self.in_flight.clear();
        let mut ids = std::mem::take(&mut self.running);
        ids.extend(self.waiting.ids());
        self.waiting.clear();
        let mut outputs = Vec::with_capacity(ids.len());
        for id in ids {
            self.kv_cache_manager.free(&id);
            if let Some(req) = self.requests.remove(&id) {
                if req.known_to_workers {
                    self.finished_req_ids.push(id.clone());
                }
                let mut o = EngineCoreOutput::failed(id, error.to_string());
                o.num_cached_tokens = req.num_cached_tokens.unwrap_or(0);
                outputs.push(o);
            }
        }
        outputs
    }

    pub fn has_unfinished_requests(&self) -> bool {
        !self.requests.is_empty()
    }

    pub fn stats(&self) -> SchedulerStats {
        let kv = &self.kv_cache_manager;
        SchedulerStats {
            num_running_reqs: self.running.len() as u32,
            num_waiting_reqs: self.waiting.len() as u32,
            kv_cache_usage: kv.usage(),
            num_free_blocks: kv.num_free_blocks(),
            num_total_blocks: kv.num_total_blocks(),
            prefix_cache_queries: kv.prefix_cache_queries(),
            prefix_cache_hits: kv.prefix_cache_hits(),
            num_preemptions: self.num_preemptions,
        }
    }

    /// Drops every cached prefix block that no request holds (blocks in use keep their
    /// hashes, so running requests are unaffected). Always succeeds.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.kv_cache_manager.reset_prefix_cache()
    }

    // ---- Read-only views, for the engine's logs and for tests. ----

    pub fn request(&self, id: &str) -> Option<&Request> {
        self.requests.get(id)
    }

    pub fn block_ids(&self, id: &str) -> &[BlockId] {
        self.kv_cache_manager.block_ids(id)
    }

    pub fn running_ids(&self) -> &[String] {
        &self.running
    }

    pub fn waiting_ids(&self) -> Vec<String> {
        self.waiting.ids()
    }

    pub fn kv_cache_manager(&self) -> &KvCacheManager {
        &self.kv_cache_manager
    }

    /// The scheduler's invariants on top of the KV-cache manager's: exactly the running
    /// requests hold blocks, enough for their computed tokens, within the sequence cap.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.kv_cache_manager.check_invariants()?;
        if self.running.len() + self.waiting.len() != self.requests.len() {
            return Err(format!(
                "{} running + {} waiting != {} requests",
                self.running.len(),
                self.waiting.len(),
                self.requests.len()
            ));
        }
        if self.running.len() > self.config.max_num_seqs as usize {
            return Err("more running requests than max_num_seqs".into());
        }
        let placeholders = self.in_flight.placeholders_by_admission();
        for id in &self.running {
            let req = self
                .requests
                .get(id)
                .ok_or(format!("running {id} unknown"))?;
            if req.status != RequestStatus::Running {
                return Err(format!("running {id} has status {:?}", req.status));
            }
            let in_flight = placeholders.get(&req.admission_seq).copied().unwrap_or(0);
            if req.num_output_placeholders != in_flight {
                return Err(format!(
                    "{id} has {} output placeholders but samples in {in_flight} steps in flight",
                    req.num_output_placeholders
                ));
            }
            if req.num_computed_tokens > req.num_tokens_with_placeholders() {
                return Err(format!(
                    "{id} computed {} tokens of {} (+{} placeholders)",
                    req.num_computed_tokens,
                    req.num_tokens(),
                    req.num_output_placeholders
                ));
            }
            let held = self.block_ids(id).len() as u32;
            if held
                < self
                    .kv_cache_manager
                    .blocks_for_tokens(req.num_computed_tokens)
            {
                return Err(format!(
                    "{id} holds {held} blocks for {} tokens",
                    req.num_computed_tokens
                ));
            }
        }
        for id in self.waiting.ids() {
            if !self.block_ids(&id).is_empty() {
                return Err(format!("waiting {id} holds blocks"));
            }
            if self
                .requests
                .get(&id)
                .is_some_and(|r| r.num_output_placeholders > 0)
            {
                return Err(format!("waiting {id} holds output placeholders"));
            }
        }
        if self.in_flight.len() > self.config.max_steps_in_flight() {
            return Err(format!(
                "{} steps in flight, more than the engine keeps sent",
                self.in_flight.len()
            ));
        }
        for id in self.kv_cache_manager.request_ids() {
            if !self.running.iter().any(|r| r == id) {
                return Err(format!("{id} holds blocks but is not running"));
            }
        }
        if !self.has_unfinished_requests()
            && self.kv_cache_manager.num_free_blocks() != self.kv_cache_manager.num_total_blocks()
        {
            return Err("no request left but blocks are still held".into());
        }
        Ok(())
    }
}

/// Finds each request's sampled token. Rank 0 answers in batch order, so a cursor finds
/// each one in O(1); a map is built only if the order ever differs.
struct SampledLookup<'a> {
    sampled: &'a [SampledToken],
    cursor: usize,
    by_id: Option<HashMap<&'a str, &'a SampledToken>>,
}

impl<'a> SampledLookup<'a> {
    fn new(sampled: &'a [SampledToken]) -> Self {
        Self {
            sampled,
            cursor: 0,
            by_id: None,
        }
    }

    fn get(&mut self, req_id: &str) -> Option<&'a SampledToken> {
        if let Some(s) = self.sampled.get(self.cursor) {
            if s.req_id == req_id {
                self.cursor += 1;
                return Some(s);
            }
        }
        let sampled = self.sampled;
        self.by_id
            .get_or_insert_with(|| sampled.iter().map(|s| (s.req_id.as_str(), s)).collect())
            .get(req_id)
            .copied()
    }
}

fn new_request_data(req: &mut Request, block_ids: &[BlockId]) -> NewRequestData {
    req.known_to_workers = true;
    req.num_tokens_sent = req.all_token_ids.len();
    req.num_blocks_sent = block_ids.len();
    NewRequestData {
        req_id: req.request_id.clone(),
        prompt_token_ids: req.prompt_token_ids().to_vec(),
        output_token_ids: req.output_token_ids().to_vec(),
        sampling_params: req.sampling_params.clone(),
        block_ids: block_ids.to_vec(),
        num_computed_tokens: req.num_computed_tokens,
    }
}

fn cached_request_data(req: &mut Request, block_ids: &[BlockId]) -> CachedRequestData {
    let new_token_ids = req.all_token_ids[req.num_tokens_sent..].to_vec();
    let new_block_ids = block_ids[req.num_blocks_sent.min(block_ids.len())..].to_vec();
    req.num_tokens_sent = req.all_token_ids.len();
    req.num_blocks_sent = block_ids.len();
    CachedRequestData {
        req_id: req.request_id.clone(),
        new_token_ids,
        new_block_ids,
        num_computed_tokens: req.num_computed_tokens,
        num_output_placeholders: req.num_output_placeholders,
    }
}

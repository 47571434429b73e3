//! Test harness: a simulated worker that replays `SchedulerOutput`s the way a real worker
//! keeps its state, a fake model runner, and helpers to build requests and drive steps.
//!
//! The worker also simulates the KV cache itself: every computed position writes its
//! token id into its slot (`block_table[pos / block_size]`, `pos % block_size`), and a step
//! that starts at `num_computed_tokens` first checks every earlier slot holds the right
//! token. A prefix-cache hit that served wrong or never-computed KV fails that check.
//!
//! Like the real worker, it appends the tokens it samples as unconfirmed and checks the
//! scheduler's `new_token_ids` against them, so with async scheduling (the harness keeping
//! one step in flight, as the engine loop does) it fills output placeholders itself and
//! catches a scheduler that plans on tokens the worker does not hold.

#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};

use vllm_engine_core::scheduler::{Scheduler, SchedulerConfig, SchedulingPolicy};
use vllm_protocol::{
    EngineCoreOutput, EngineCoreRequest, ModelRunnerOutput, SampledToken, SamplingParams,
    SchedulerOutput,
};

pub const EOS: u32 = 1;

pub fn config(num_gpu_blocks: u32, block_size: u32) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 16,
        max_num_batched_tokens: 64,
        max_model_len: 256,
        block_size,
        num_gpu_blocks,
        enable_prefix_caching: true,
        enable_chunked_prefill: true,
        policy: SchedulingPolicy::Fcfs,
        long_prefill_token_threshold: 0,
        async_scheduling: false,
    }
}

/// The small, crowded config of the random-workload tests: 4 sequences, 16-token steps,
/// 48-token sequences, blocks of 4 tokens.
pub fn small_config(blocks: u32, chunked: bool, caching: bool, priority: bool) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 4,
        max_num_batched_tokens: 16,
        max_model_len: 48,
        enable_chunked_prefill: chunked,
        enable_prefix_caching: caching,
        policy: if priority {
            SchedulingPolicy::Priority
        } else {
            SchedulingPolicy::Fcfs
        },
        ..config(blocks, 4)
    }
}

/// A sampler that gives eos at position `n` and 77 elsewhere.
pub fn eos_at(n: usize) -> impl FnMut(&str, usize) -> u32 {
    move |_: &str, pos: usize| if pos == n { EOS } else { 77 }
}

pub fn params(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

pub fn request(id: &str, prompt: Vec<u32>, sampling_params: SamplingParams) -> EngineCoreRequest {
    EngineCoreRequest {
        request_id: id.to_string(),
        prompt_token_ids: prompt,
        sampling_params,
        eos_token_ids: vec![EOS],
        arrival_time: 0.0,
        priority: 0,
        parent_request_id: None,
    }
}

/// Prompt token ids that never contain eos: `seed*1000 + i` shifted above it.
pub fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| 10 + seed * 1000 + i).collect()
}

/// A deterministic non-eos token for (request, position).
pub fn default_token(req_id: &str, pos: usize) -> u32 {
    let h = req_id.bytes().fold(pos as u32 ^ 0x9e37, |h, b| {
        h.wrapping_mul(31).wrapping_add(b as u32)
    });
    10 + h % 5000
}

#[derive(Debug, Clone, Default)]
pub struct WorkerRequest {
    pub token_ids: Vec<u32>,
    pub block_table: Vec<u32>,
    pub num_computed_tokens: u32,
    /// Trailing tokens this worker sampled that the scheduler has not confirmed.
    pub num_unconfirmed: usize,
}

#[derive(Debug, Default)]
pub struct SimWorker {
    pub block_size: usize,
    pub reqs: HashMap<String, WorkerRequest>,
    /// block id → the token id written in each slot (None: never written).
    pub kv: HashMap<u32, Vec<Option<u32>>>,
}

impl SimWorker {
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size: block_size as usize,
            ..Self::default()
        }
    }

    /// Applies the deltas: drop finished and preempted, add new, extend cached.
    pub fn apply(&mut self, so: &SchedulerOutput) {
        for id in so.finished_req_ids.iter().chain(&so.preempted_req_ids) {
            self.reqs.remove(id);
        }
        for new in &so.scheduled_new_reqs {
            let mut token_ids = new.prompt_token_ids.clone();
            token_ids.extend(&new.output_token_ids);
            let prev = self.reqs.insert(
                new.req_id.clone(),
                WorkerRequest {
                    token_ids,
                    block_table: new.block_ids.clone(),
                    num_computed_tokens: new.num_computed_tokens,
                    num_unconfirmed: 0,
                },
            );
            assert!(
                prev.is_none(),
                "{} sent as new while the worker holds it",
                new.req_id
            );
        }
        for c in &so.scheduled_cached_reqs {
            let w = self
                .reqs
                .get_mut(&c.req_id)
                .unwrap_or_else(|| panic!("cached {} unknown to the worker", c.req_id));
            let first = w.token_ids.len() - w.num_unconfirmed;
            for (i, &t) in c.new_token_ids.iter().enumerate() {
                match w.token_ids.get(first + i) {
                    Some(&held) => assert_eq!(
                        held, t,
                        "{}: the scheduler's token differs from the worker's sample",
                        c.req_id
                    ),
                    None => w.token_ids.push(t),
                }
            }
            w.num_unconfirmed = w.num_unconfirmed.saturating_sub(c.new_token_ids.len());
            assert_eq!(
                w.num_unconfirmed, c.num_output_placeholders as usize,
                "{}: placeholders the worker must fill",
                c.req_id
            );
            w.block_table.extend(&c.new_block_ids);
            assert_eq!(w.num_computed_tokens, c.num_computed_tokens, "{}", c.req_id);
        }
        let order: Vec<&String> = so
            .scheduled_new_reqs
            .iter()
            .map(|r| &r.req_id)
            .chain(so.scheduled_cached_reqs.iter().map(|r| &r.req_id))
            .collect();
        let scheduled: Vec<&String> = so.num_scheduled_tokens.iter().map(|(id, _)| id).collect();
        assert_eq!(order, scheduled, "batch order is new then cached");
    }

    /// The worker's view equals the scheduler's for every scheduled request (the scheduler
    /// has already advanced `num_computed_tokens` by this step's tokens).
    pub fn check_against(&self, sched: &Scheduler, so: &SchedulerOutput) {
        for (id, n) in &so.num_scheduled_tokens {
            let w = &self.reqs[id];
            let r = sched.request(id).expect("scheduled request exists");
            let known = r.all_token_ids.len();
            assert_eq!(w.token_ids[..known], r.all_token_ids, "{id} token ids");
            assert!(
                w.token_ids.len() - known <= r.num_output_placeholders as usize,
                "{id}: the worker holds more tokens than the scheduler plans on"
            );
            assert_eq!(w.block_table, sched.block_ids(id), "{id} block table");
            assert_eq!(
                w.num_computed_tokens + n,
                r.num_computed_tokens,
                "{id} computed"
            );
        }
        for id in sched.running_ids() {
            if sched.request(id).is_some_and(|r| r.known_to_workers) {
                assert!(
                    self.reqs.contains_key(id),
                    "{id} running but dropped by the worker"
                );
            }
        }
    }

    /// Runs the step: checks the KV of every position already computed, writes this
    /// step's positions, samples a token for each request that reached its end.
    pub fn run(
        &mut self,
        so: &SchedulerOutput,
        sample: &mut dyn FnMut(&str, usize) -> u32,
    ) -> ModelRunnerOutput {
        let bs = self.block_size;
        let mut sampled = Vec::new();
        for (id, n) in &so.num_scheduled_tokens {
            let w = self.reqs.get_mut(id).expect("scheduled request held");
            let start = w.num_computed_tokens as usize;
            let end = start + *n as usize;
            assert!(end <= w.token_ids.len(), "{id} computes past its tokens");
            assert!(
                end <= w.block_table.len() * bs,
                "{id} has no slot for its tokens"
            );
            for pos in 0..start {
                let slot = self
                    .kv
                    .get(&w.block_table[pos / bs])
                    .and_then(|b| b[pos % bs]);
                assert_eq!(
                    slot,
                    Some(w.token_ids[pos]),
                    "{id}: wrong KV at position {pos}"
                );
            }
            for pos in start..end {
                let block = self
                    .kv
                    .entry(w.block_table[pos / bs])
                    .or_insert(vec![None; bs]);
                block[pos % bs] = Some(w.token_ids[pos]);
            }
            w.num_computed_tokens = end as u32;
            if end == w.token_ids.len() {
                let token_id = sample(id, end);
                // Kept unconfirmed, as the real worker does: an async step computes it next.
                w.token_ids.push(token_id);
                w.num_unconfirmed += 1;
                sampled.push(SampledToken {
                    req_id: id.clone(),
                    token_id,
                    logprobs: None,
                });
            }
        }
        ModelRunnerOutput {
            step_id: so.step_id,
            sampled,
        }
    }
}

/// A scheduler, its simulated worker, and every output it produced per request.
pub struct Harness {
    pub sched: Scheduler,
    pub worker: SimWorker,
    pub outputs: HashMap<String, Vec<EngineCoreOutput>>,
    pub steps: Vec<SchedulerOutput>,
    /// Async scheduling: steps run by the worker whose output the scheduler has not seen.
    pub pending: VecDeque<(SchedulerOutput, ModelRunnerOutput)>,
}

impl Harness {
    pub fn new(cfg: SchedulerConfig) -> Self {
        let bs = cfg.block_size;
        Self {
            sched: Scheduler::new(cfg),
            worker: SimWorker::new(bs),
            outputs: HashMap::new(),
            steps: Vec::new(),
            pending: VecDeque::new(),
        }
    }

    /// A harness whose steps pipeline as the engine loop's do with `--async-scheduling`.
    pub fn new_async(mut cfg: SchedulerConfig) -> Self {
        cfg.async_scheduling = true;
        Self::new(cfg)
    }

    /// Applies the oldest step's output, as the engine does once it arrives.
    pub fn update_oldest(&mut self) {
        let Some((so, out)) = self.pending.pop_front() else {
            return;
        };
        for o in self.sched.update_from_output(&so, &out) {
            self.outputs
                .entry(o.request_id.clone())
                .or_default()
                .push(o);
        }
        self.sched.check_invariants().unwrap();
    }

    pub fn has_work(&self) -> bool {
        self.sched.has_unfinished_requests() || !self.pending.is_empty()
    }

    pub fn add(&mut self, req: EngineCoreRequest) {
        self.sched.add_request(req).expect("request accepted");
        self.sched.check_invariants().unwrap();
    }

    /// One engine step with the default sampler.
    pub fn step(&mut self) -> SchedulerOutput {
        self.step_with(&mut default_token)
    }

    /// One engine step: schedule, check limits, replay into the worker, run, update.
    ///
    /// With async scheduling the step's output is applied only after the next step has
    /// been scheduled (or when nothing more can be), as the engine loop does; the worker
    /// runs each step when it is scheduled, which keeps the order the real workers follow.
    pub fn step_with(&mut self, sample: &mut dyn FnMut(&str, usize) -> u32) -> SchedulerOutput {
        assert!(self.pending.len() < self.sched.config().max_steps_in_flight());
        let so = self.sched.schedule();
        let cfg = self.sched.config().clone();
        assert!(so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens);
        assert!(so.num_scheduled_tokens.len() <= cfg.max_num_seqs as usize);
        let sum: u32 = so.num_scheduled_tokens.iter().map(|(_, n)| n).sum();
        assert_eq!(sum, so.total_num_scheduled_tokens);
        self.sched.check_invariants().unwrap();
        if so.is_empty() {
            // The engine sends nothing to the workers for an empty step, and waits for
            // the one in flight.
            self.update_oldest();
            return so;
        }
        self.worker.apply(&so);
        self.worker.check_against(&self.sched, &so);
        let out = self.worker.run(&so, sample);
        self.pending.push_back((so.clone(), out));
        if self.pending.len() == self.sched.config().max_steps_in_flight() {
            self.update_oldest();
        }
        self.steps.push(so.clone());
        so
    }

    /// Steps until no request is left (panics after `max_steps`).
    pub fn run_to_completion(&mut self, max_steps: usize) {
        self.run_to_completion_with(max_steps, &mut default_token);
    }

    /// Steps with `sample` until no request is left and no step is in flight (panics
    /// after `max_steps`).
    pub fn run_to_completion_with(
        &mut self,
        max_steps: usize,
        sample: &mut dyn FnMut(&str, usize) -> u32,
    ) {
        for _ in 0..max_steps {
            if !self.has_work() {
                return;
            }
            self.step_with(sample);
        }
        panic!("requests still unfinished after {max_steps} steps");
    }

    pub fn tokens_of(&self, id: &str) -> Vec<u32> {
        self.outputs
            .get(id)
            .map(|os| os.iter().flat_map(|o| o.new_token_ids.clone()).collect())
            .unwrap_or_default()
    }

    pub fn finish_of(&self, id: &str) -> Option<&EngineCoreOutput> {
        self.outputs
            .get(id)
            .and_then(|os| os.last())
            .filter(|o| o.finish_reason.is_some())
    }

    pub fn assert_pool_free(&self) {
        let s = self.sched.stats();
        assert_eq!(s.num_free_blocks, s.num_total_blocks, "blocks leaked");
        assert!(!self.sched.has_unfinished_requests());
    }
}

//! Overlapped steps, the worker's side of `--async-scheduling` (vLLM's design), host
//! logic only: which steps may run ahead, and the one-step-late bookkeeping.
//!
//! With async scheduling the engine-core sends step N+1 before it waits for step N's
//! output, and N+1 computes N's tokens as output placeholders. The CUDA runner then
//! *defers* step N: it samples N on the device, enqueues the copy of N's tokens to pinned
//! host memory and an event (`backend::cuda::pending_step`), and returns without waiting. When
//! N+1 arrives it is enqueued behind N at once: its inputs are staged from the host as
//! usual, with [`UNKNOWN_TOKEN`] where N's tokens go, and a device-to-device copy from
//! N's sampled-token buffer then overwrites those positions ([`DeferredRows::input_gathers`]),
//! stream-ordered after the upload and before the forward (or the graph replay, which
//! reads the same step buffers). Only then does the host wait for N's tokens, fill them
//! in ([`DeferredRows::fill`]) and send N's output: one step late, and in order.
//!
//! On this rank a deferred token is an unconfirmed output token like any other
//! (`InputBatch::record_sampled`), so the placeholder counts of the scheduler's deltas
//! match; its value is [`UNKNOWN_TOKEN`] until filled. The engine-core never confirms it
//! before then, as it learns it from the output that carries it.
//!
//! The synchronous path is kept, conservatively:
//! - a step is deferred only when the engine runs ahead (some request of it holds an
//!   output placeholder: never without `--async-scheduling`, so the serial path does not
//!   change) and none of its sampled rows asks for logprobs (those come back with a
//!   second, synchronous read-back; [`may_defer`]);
//! - step N+1 runs behind a deferred N only when none of its requests that wait for a
//!   token of N samples from its token history on the host: penalties (the sampler's
//!   entries list the output tokens) and `min_tokens` not yet reached (it reads only the
//!   count, which is right, but is kept out as rare and cheap to wait for; [`may_overlap`]).
//!   Otherwise N is finished first and N+1 is prepared from known tokens. Stop checks
//!   run in the engine-core, on tokens it has received, so they need nothing here.

use std::collections::HashMap;

use anyhow::{ensure, Result};
use vllm_protocol::{SampledToken, SamplingParams, SchedulerOutput};

use crate::backend::StepInputs;
use crate::input_batch::InputBatch;

/// The value of a deferred token on the host until its step's tokens are back; never a
/// vocabulary id. As an input id (-1) the embedding reads zeros, should one ever stay.
pub const UNKNOWN_TOKEN: u32 = u32::MAX;

/// Whether step `so`, sampling `sampled_req_ids`, may return before its tokens are back.
pub fn may_defer(so: &SchedulerOutput, batch: &InputBatch, sampled_req_ids: &[String]) -> bool {
    let engine_runs_ahead = so
        .scheduled_cached_reqs
        .iter()
        .any(|d| d.num_output_placeholders > 0);
    engine_runs_ahead
        && sampled_req_ids.iter().all(|id| {
            batch
                .requests
                .get(id)
                .is_some_and(|s| s.sampling_params.logprobs.is_none())
        })
}

/// Whether step `so` may be prepared and enqueued while `deferred`'s tokens are unknown
/// on the host (call it before `so`'s deltas are applied).
pub fn may_overlap(so: &SchedulerOutput, batch: &InputBatch, deferred: &DeferredRows) -> bool {
    // The history test first: it is a lookup, and almost always false, where the
    // deferred rows are a scan.
    so.num_scheduled_tokens.iter().all(|(id, _)| {
        batch
            .requests
            .get(id)
            .is_none_or(|s| !reads_history(&s.sampling_params, s.output_token_ids.len()))
            || !deferred.req_ids.contains(id)
    })
}

/// Whether sampling a request reads its output tokens (or their count) on the host.
fn reads_history(p: &SamplingParams, num_output_tokens: usize) -> bool {
    p.has_penalties() || (num_output_tokens as u64) < u64::from(p.min_tokens)
}

/// One device-to-device copy of a step's input ids: `len` tokens from the deferred
/// step's sampled-token buffer at row `src` to the step's input ids at `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRun {
    pub dst: usize,
    pub src: usize,
    pub len: usize,
}

/// A deferred step's sampled requests: row `i` of its tokens belongs to `req_ids[i]` and
/// goes to `output_token_ids[slots[i]]` (None: the request was not in the batch).
#[derive(Debug, Clone, PartialEq)]
pub struct DeferredRows {
    pub step_id: u64,
    pub req_ids: Vec<String>,
    slots: Vec<Option<usize>>,
}

impl DeferredRows {
    /// Appends an [`UNKNOWN_TOKEN`], unconfirmed, to each request sampled in `step_id`.
    pub fn record(batch: &mut InputBatch, step_id: u64, req_ids: &[String]) -> Self {
        let slots = req_ids
            .iter()
            .map(|id| {
                let s = batch.requests.get_mut(id)?;
                s.output_token_ids.push(UNKNOWN_TOKEN);
                s.num_unconfirmed += 1;
                Some(s.output_token_ids.len() - 1)
            })
            .collect();
        Self {
            step_id,
            req_ids: req_ids.to_vec(),
            slots,
        }
    }

    /// Writes the step's tokens where its unknown ones are (a request that has ended,
    /// or was preempted and re-sent, since holds none) and returns them as its output.
    pub fn fill(&self, batch: &mut InputBatch, tokens: &[u32]) -> Result<Vec<SampledToken>> {
        ensure!(
            tokens.len() == self.req_ids.len(),
            "step {}: {} tokens came back for {} requests",
            self.step_id,
            tokens.len(),
            self.req_ids.len()
        );
        for ((id, slot), &token) in self.req_ids.iter().zip(&self.slots).zip(tokens) {
            let held = slot.and_then(|at| batch.requests.get_mut(id)?.output_token_ids.get_mut(at));
            if let Some(held) = held.filter(|t| **t == UNKNOWN_TOKEN) {
                *held = token;
            }
        }
        Ok(self
            .req_ids
            .iter()
            .zip(tokens)
            .map(|(id, &token_id)| SampledToken {
                req_id: id.clone(),
                token_id,
                logprobs: None,
            })
            .collect())
    }

    /// Where the next step's `inputs` (laid out from `so` by `batch`, deltas applied)
    /// take this step's tokens: copies in input order, adjacent ones merged (a decode
    /// batch in the same order is one copy). Fails when an input id is unknown that no
    /// copy fills.
    pub fn input_gathers(
        &self,
        so: &SchedulerOutput,
        batch: &InputBatch,
        inputs: &StepInputs,
    ) -> Result<Vec<CopyRun>> {
        let seq_of: HashMap<&str, usize> = so
            .num_scheduled_tokens
            .iter()
            .enumerate()
            .map(|(i, (id, _))| (id.as_str(), i))
            .collect();
        let mut copies: Vec<(usize, usize)> = Vec::new();
        for (row, (id, slot)) in self.req_ids.iter().zip(&self.slots).enumerate() {
            let (Some(&seq), Some(at), Some(s)) =
                (seq_of.get(id.as_str()), *slot, batch.requests.get(id))
            else {
                continue;
            };
            if s.output_token_ids.get(at) != Some(&UNKNOWN_TOKEN) {
                continue;
            }
            let pos = s.prompt_token_ids.len() + at;
            let start = s.num_computed_tokens as usize;
            let first = inputs.query_start_loc[seq] as usize;
            let n = inputs.query_start_loc[seq + 1] as usize - first;
            if (start..start + n).contains(&pos) {
                copies.push((first + pos - start, row));
            }
        }
        copies.sort_unstable();
        let unknown = inputs
            .input_ids
            .iter()
            .filter(|&&t| t == UNKNOWN_TOKEN as i32)
            .count();
        ensure!(
            unknown == copies.len(),
            "step {}: {unknown} input ids wait for step {}'s tokens but {} come from it",
            so.step_id,
            self.step_id,
            copies.len()
        );
        let mut runs: Vec<CopyRun> = Vec::new();
        for (dst, src) in copies {
            match runs.last_mut() {
                Some(r) if r.dst + r.len == dst && r.src + r.len == src => r.len += 1,
                _ => runs.push(CopyRun { dst, src, len: 1 }),
            }
        }
        Ok(runs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vllm_protocol::{CachedRequestData, NewRequestData};

    fn new_req(id: &str, prompt: Vec<u32>, params: SamplingParams) -> NewRequestData {
        NewRequestData {
            req_id: id.into(),
            prompt_token_ids: prompt,
            output_token_ids: vec![],
            sampling_params: params,
            block_ids: vec![0, 1, 2, 3],
            num_computed_tokens: 0,
        }
    }

    fn cached(id: &str, computed: u32, placeholders: u32) -> CachedRequestData {
        CachedRequestData {
            req_id: id.into(),
            new_token_ids: vec![],
            new_block_ids: vec![],
            num_computed_tokens: computed,
            num_output_placeholders: placeholders,
        }
    }

    /// Step 1 prefills "a" (3 tokens) and "b" (2), both sampled.
    fn prefilled(b_params: SamplingParams) -> InputBatch {
        let mut batch = InputBatch::default();
        let so = SchedulerOutput {
            step_id: 1,
            scheduled_new_reqs: vec![
                new_req("a", vec![1, 2, 3], SamplingParams::default()),
                new_req("b", vec![4, 5], b_params),
            ],
            num_scheduled_tokens: vec![("a".into(), 3), ("b".into(), 2)],
            total_num_scheduled_tokens: 5,
            ..Default::default()
        };
        batch.update_states(&so).unwrap();
        batch
    }

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// Decode of "a" and "b" on top of their placeholders, in `order`.
    fn decode(step_id: u64, order: &[&str], computed: &[(&str, u32)]) -> SchedulerOutput {
        SchedulerOutput {
            step_id,
            scheduled_cached_reqs: computed.iter().map(|(id, c)| cached(id, *c, 1)).collect(),
            num_scheduled_tokens: order.iter().map(|id| (id.to_string(), 1)).collect(),
            total_num_scheduled_tokens: order.len() as u32,
            ..Default::default()
        }
    }

    #[test]
    fn only_a_step_the_engine_runs_ahead_of_is_deferred_and_never_with_logprobs() {
        let lp = SamplingParams {
            logprobs: Some(1),
            ..Default::default()
        };
        let batch = prefilled(lp);
        // Step 1: no placeholder anywhere (also every serial step).
        let so = SchedulerOutput::default();
        assert!(!may_defer(&so, &batch, &ids(&["a"])));
        let so = decode(2, &["a", "b"], &[("a", 3), ("b", 2)]);
        assert!(may_defer(&so, &batch, &ids(&["a"])));
        assert!(
            !may_defer(&so, &batch, &ids(&["a", "b"])),
            "b wants logprobs"
        );
    }

    #[test]
    fn a_request_waiting_for_a_deferred_token_overlaps_unless_it_reads_its_history() {
        let penalty = SamplingParams {
            presence_penalty: 0.5,
            ..Default::default()
        };
        let mut batch = prefilled(penalty);
        let deferred = DeferredRows::record(&mut batch, 1, &ids(&["a"]));
        // "b"'s token is known: its penalty reads known tokens.
        let so = decode(2, &["a", "b"], &[("a", 3), ("b", 2)]);
        assert!(may_overlap(&so, &batch, &deferred));
        let deferred = DeferredRows::record(&mut batch, 1, &ids(&["b"]));
        assert!(!may_overlap(&so, &batch, &deferred));
        // min_tokens not reached: synchronous; reached: overlaps.
        let min = SamplingParams {
            min_tokens: 2,
            ..Default::default()
        };
        let mut batch = prefilled(min);
        let deferred = DeferredRows::record(&mut batch, 1, &ids(&["b"]));
        assert!(!may_overlap(&so, &batch, &deferred));
        batch
            .requests
            .get_mut("b")
            .unwrap()
            .output_token_ids
            .push(9);
        assert!(may_overlap(&so, &batch, &deferred));
    }

    #[test]
    fn deferred_tokens_are_filled_one_step_late_and_confirmed_after() {
        let mut batch = prefilled(SamplingParams::default());
        // Step 1 deferred; step 2 decodes both on top of its tokens, in reverse order.
        let step1 = DeferredRows::record(&mut batch, 1, &ids(&["a", "b"]));
        let so2 = decode(2, &["b", "a"], &[("a", 3), ("b", 2)]);
        assert!(may_overlap(&so2, &batch, &step1));
        batch.update_states(&so2).unwrap();
        let step2 = batch.prepare_inputs(&so2, 2).unwrap();
        let unknown = UNKNOWN_TOKEN as i32;
        assert_eq!(step2.inputs.input_ids, vec![unknown, unknown]);
        let runs = step1.input_gathers(&so2, &batch, &step2.inputs).unwrap();
        // b is row 1 of step 1 and input 0 of step 2: not adjacent in both, two copies.
        assert_eq!(
            runs,
            vec![
                CopyRun {
                    dst: 0,
                    src: 1,
                    len: 1
                },
                CopyRun {
                    dst: 1,
                    src: 0,
                    len: 1
                }
            ]
        );
        // Step 2 is deferred too, then step 1's tokens come back.
        let step2_rows = DeferredRows::record(&mut batch, 2, &step2.sampled_req_ids);
        let out1 = step1.fill(&mut batch, &[70, 80]).unwrap();
        assert_eq!(
            out1.iter()
                .map(|t| (t.req_id.as_str(), t.token_id))
                .collect::<Vec<_>>(),
            vec![("a", 70), ("b", 80)]
        );
        let a = &batch.requests["a"];
        assert_eq!(
            (a.output_token_ids.clone(), a.num_unconfirmed),
            (vec![70, UNKNOWN_TOKEN], 2)
        );
        // Step 3 (same order as step 2's rows: one copy) confirms step 1's tokens.
        let mut so3 = decode(3, &["b", "a"], &[("a", 4), ("b", 3)]);
        so3.scheduled_cached_reqs[0].new_token_ids = vec![70];
        so3.scheduled_cached_reqs[1].new_token_ids = vec![80];
        assert!(may_overlap(&so3, &batch, &step2_rows));
        batch.update_states(&so3).unwrap();
        let step3 = batch.prepare_inputs(&so3, 2).unwrap();
        let runs = step2_rows
            .input_gathers(&so3, &batch, &step3.inputs)
            .unwrap();
        assert_eq!(
            runs,
            vec![CopyRun {
                dst: 0,
                src: 0,
                len: 2
            }]
        );
        step2_rows.fill(&mut batch, &[81, 71]).unwrap();
        let a = &batch.requests["a"];
        assert_eq!(
            (a.output_token_ids.clone(), a.num_unconfirmed),
            (vec![70, 71], 1)
        );
    }

    #[test]
    fn a_step_mixing_prefill_and_decode_copies_only_the_decode_tokens() {
        let mut batch = prefilled(SamplingParams::default());
        let step1 = DeferredRows::record(&mut batch, 1, &ids(&["a", "b"]));
        // Step 2: a new prompt "c" first, then a's decode; b is not scheduled.
        let so2 = SchedulerOutput {
            step_id: 2,
            scheduled_new_reqs: vec![new_req("c", vec![6, 7, 8], SamplingParams::default())],
            scheduled_cached_reqs: vec![cached("a", 3, 1)],
            num_scheduled_tokens: vec![("c".into(), 3), ("a".into(), 1)],
            total_num_scheduled_tokens: 4,
            ..Default::default()
        };
        batch.update_states(&so2).unwrap();
        let step2 = batch.prepare_inputs(&so2, 2).unwrap();
        let runs = step1.input_gathers(&so2, &batch, &step2.inputs).unwrap();
        assert_eq!(
            runs,
            vec![CopyRun {
                dst: 3,
                src: 0,
                len: 1
            }]
        );
    }

    #[test]
    fn a_request_gone_or_resent_since_keeps_what_the_engine_sent() {
        let mut batch = prefilled(SamplingParams::default());
        let step1 = DeferredRows::record(&mut batch, 1, &ids(&["a", "b"]));
        // Step 2: "a" finished; "b" preempted and resent with the engine's tokens.
        let mut resent = new_req("b", vec![4, 5], SamplingParams::default());
        resent.output_token_ids = vec![];
        let so2 = SchedulerOutput {
            step_id: 2,
            finished_req_ids: ids(&["a"]),
            preempted_req_ids: ids(&["b"]),
            scheduled_new_reqs: vec![resent],
            num_scheduled_tokens: vec![("b".into(), 2)],
            total_num_scheduled_tokens: 2,
            ..Default::default()
        };
        batch.update_states(&so2).unwrap();
        let step2 = batch.prepare_inputs(&so2, 2).unwrap();
        assert!(step1
            .input_gathers(&so2, &batch, &step2.inputs)
            .unwrap()
            .is_empty());
        let out = step1.fill(&mut batch, &[70, 80]).unwrap();
        assert_eq!(out.len(), 2, "the engine drops what it no longer wants");
        assert!(batch.requests["b"].output_token_ids.is_empty());
    }

    #[test]
    fn an_unknown_input_no_copy_fills_fails_the_step() {
        let mut batch = prefilled(SamplingParams::default());
        let step1 = DeferredRows::record(&mut batch, 1, &ids(&["a"]));
        let so2 = decode(2, &["a"], &[("a", 3)]);
        batch.update_states(&so2).unwrap();
        let step2 = batch.prepare_inputs(&so2, 2).unwrap();
        let other = DeferredRows {
            step_id: 7,
            req_ids: ids(&["b"]),
            slots: vec![Some(0)],
        };
        assert!(other.input_gathers(&so2, &batch, &step2.inputs).is_err());
        assert_eq!(
            step1
                .input_gathers(&so2, &batch, &step2.inputs)
                .unwrap()
                .len(),
            1
        );
        assert!(
            step1.fill(&mut batch, &[1, 2]).is_err(),
            "one token per row"
        );
    }
}

//! Async scheduling's bookkeeping (`--async-scheduling`): the harness keeps one step in
//! flight as the engine loop does, its simulated worker fills output placeholders from its
//! own samples and checks the KV of every position it reads, and every step ends with the
//! scheduler's invariants checked (placeholders equal the steps in flight that sample).

mod common;

use std::collections::HashMap;

use common::*;
use proptest::prelude::*;
use vllm_engine_core::scheduler::SchedulerConfig;
use vllm_protocol::{FinishReason, SamplingParams};

fn with_eos(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ..SamplingParams::default()
    }
}

/// Request "r" (eos as its 3rd output token, position 4 + 2) after four steps: step 3's
/// output finished it while step 4, scheduled on that token's placeholder, is in flight.
fn finished_with_a_step_in_flight() -> Harness {
    let mut h = Harness::new_async(config(64, 4));
    h.add(request("r", prompt(1, 4), with_eos(10)));
    let mut sample = eos_at(6);
    for _ in 0..4 {
        h.step_with(&mut sample);
    }
    h
}

fn steps_with(h: &Harness, id: &str) -> Vec<u64> {
    h.steps
        .iter()
        .filter(|so| so.num_scheduled_tokens.iter().any(|(r, _)| r == id))
        .map(|so| so.step_id)
        .collect()
}

#[test]
fn a_request_finished_at_n_and_scheduled_in_n_plus_1_never_emits_that_token() {
    let mut h = finished_with_a_step_in_flight();
    // Step 4 was scheduled on the placeholder of step 3's token (eos); step 3's output then
    // finished the request while step 4 is still in flight.
    assert_eq!(steps_with(&h, "r"), vec![1, 2, 3, 4]);
    assert_eq!(h.pending.len(), 1);
    assert!(h.sched.request("r").is_none());
    assert_eq!(h.sched.stats().num_free_blocks, 64);
    assert_eq!(h.tokens_of("r"), vec![77, 77, EOS]);
    // Step 4's output (the token after eos) is dropped: nothing more reaches the client.
    h.run_to_completion(10);
    assert_eq!(h.tokens_of("r"), vec![77, 77, EOS]);
    let fin = h.finish_of("r").unwrap();
    assert_eq!(fin.finish_reason, Some(FinishReason::Stop));
    assert_eq!(h.outputs["r"].len(), 3);
    h.assert_pool_free();
}

#[test]
fn length_limits_never_schedule_a_token_to_throw_away() {
    for max_tokens in [1u32, 2, 3, 7] {
        let mut h = Harness::new_async(config(64, 4));
        h.add(request("r", prompt(1, 5), params(max_tokens)));
        h.run_to_completion(50);
        assert_eq!(h.tokens_of("r").len(), max_tokens as usize);
        // One step per token: the placeholder of the last one is never computed on.
        assert_eq!(
            steps_with(&h, "r").len(),
            max_tokens as usize,
            "{max_tokens}"
        );
        h.assert_pool_free();
    }
    // The model's length caps the same way.
    let mut cfg = config(64, 4);
    cfg.max_model_len = 9;
    let mut h = Harness::new_async(cfg);
    h.add(request("r", prompt(1, 5), params(100)));
    h.run_to_completion(50);
    assert_eq!(h.tokens_of("r").len(), 4);
    assert_eq!(steps_with(&h, "r").len(), 4);
}

#[test]
fn a_partial_prefill_chunk_holds_no_placeholder() {
    let mut cfg = config(64, 4);
    cfg.max_num_batched_tokens = 16;
    let mut h = Harness::new_async(cfg);
    h.add(request("r", prompt(1, 40), params(3)));
    h.step(); // tokens 0..16: no sample
    assert_eq!(h.sched.request("r").unwrap().num_output_placeholders, 0);
    h.step(); // 16..32, scheduled before step 1's output: still none
    assert_eq!(h.sched.request("r").unwrap().num_output_placeholders, 0);
    h.step(); // 32..40 samples
    assert_eq!(h.sched.request("r").unwrap().num_output_placeholders, 1);
    h.step(); // the first decode, on the placeholder
    assert_eq!(h.sched.request("r").unwrap().num_computed_tokens, 41);
    h.run_to_completion(20);
    assert_eq!(h.tokens_of("r").len(), 3);
    h.assert_pool_free();
}

#[test]
fn blocks_freed_with_a_step_in_flight_go_only_to_a_later_step() {
    // 4 blocks of 4 slots. r holds 3 of them while decoding; s needs 3 for its prompt, so
    // it waits for r's blocks.
    let mut h = Harness::new_async(config(4, 4));
    h.add(request("r", prompt(1, 8), with_eos(4)));
    h.add(request("s", prompt(2, 12), params(2)));
    // r's eos at its 2nd output token (position 9): it finishes with one step in flight.
    let mut sample = |id: &str, pos: usize| if id == "r" && pos == 9 { EOS } else { 77 };
    h.run_to_completion_with(40, &mut sample);
    assert_eq!(h.tokens_of("r"), vec![77, EOS]);
    assert_eq!(h.tokens_of("s").len(), 2);
    let r_steps = steps_with(&h, "r");
    let s_steps = steps_with(&h, "s");
    // r ran in steps 1..=3 (3 computed its eos on a placeholder, in flight when step 2's
    // output finished it); s got the blocks in step 4, after step 3 ran.
    assert_eq!(r_steps, vec![1, 2, 3]);
    assert_eq!(s_steps[0], 4);
    let r_blocks: Vec<u32> = h.steps[0].scheduled_new_reqs[0].block_ids.clone();
    let s_new = &h.steps[3].scheduled_new_reqs[0];
    assert_eq!(s_new.req_id, "s");
    assert!(s_new.block_ids.iter().any(|b| r_blocks.contains(b)));
    h.assert_pool_free();
}

#[test]
fn abort_while_in_flight_drops_the_step_output() {
    let mut h = Harness::new_async(config(64, 4));
    h.add(request("r", prompt(1, 4), params(20)));
    h.step();
    h.step();
    h.step();
    let emitted = h.tokens_of("r").len();
    assert_eq!(h.pending.len(), 1);
    h.sched.abort_requests(&["r".to_string()]);
    h.sched.check_invariants().unwrap();
    assert_eq!(h.sched.stats().num_free_blocks, 64);
    h.add(request("other", prompt(2, 4), params(2)));
    let so = h.step();
    assert_eq!(so.finished_req_ids, vec!["r".to_string()]);
    h.run_to_completion(20);
    assert_eq!(h.tokens_of("r").len(), emitted, "no token after the abort");
    assert!(h.finish_of("r").is_none());
    h.assert_pool_free();
}

#[test]
fn a_reused_request_id_never_takes_the_old_requests_token() {
    let mut h = finished_with_a_step_in_flight();
    assert!(
        h.sched.request("r").is_none(),
        "finished with step 4 in flight"
    );
    // A new request takes the id before step 4's output is in.
    h.add(request("r", prompt(3, 2), params(2)));
    let mut sample = |_: &str, pos: usize| 100 + pos as u32;
    h.run_to_completion_with(20, &mut sample);
    let tokens = h.tokens_of("r");
    // The old request's 3 tokens, then the new one's two (positions 2 and 3), and not the
    // old request's dropped token from step 4.
    assert_eq!(tokens, vec![77, 77, EOS, 102, 103]);
    h.assert_pool_free();
}

#[test]
fn preemption_with_a_step_in_flight_resamples_and_matches_sync() {
    // Five requests on 7 blocks of 4: decodes outgrow the pool and preempt each other.
    let reqs: Vec<_> = (0..5)
        .map(|i| request(&format!("r{i}"), prompt(i, 6 + i), params(14)))
        .collect();
    let mut cfg = config(7, 4);
    cfg.max_num_batched_tokens = 16;
    let (sync, _) = run_workload(cfg.clone(), &reqs, false);
    let (asy, stats) = run_workload(cfg, &reqs, true);
    assert!(stats.num_preemptions > 0, "the workload must preempt");
    assert_eq!(sync, asy);
}

type Results = HashMap<String, (Vec<u32>, Option<FinishReason>, Option<u32>)>;

/// Runs requests to completion with a sampler that depends only on (request, position),
/// so the tokens must not depend on how the steps were batched, pipelined or preempted.
fn run_workload(
    mut cfg: SchedulerConfig,
    reqs: &[vllm_protocol::EngineCoreRequest],
    async_scheduling: bool,
) -> (Results, vllm_protocol::SchedulerStats) {
    cfg.async_scheduling = async_scheduling;
    let mut h = Harness::new(cfg);
    for r in reqs {
        h.add(r.clone());
    }
    let mut sample = |id: &str, pos: usize| {
        let t = default_token(id, pos);
        // About one token in 13 is eos, a few are a stop id.
        if t.is_multiple_of(13) {
            EOS
        } else {
            2 + t % 9
        }
    };
    h.run_to_completion_with(10_000, &mut sample);
    h.assert_pool_free();
    let results = reqs
        .iter()
        .map(|r| {
            let id = &r.request_id;
            let fin = h.finish_of(id).cloned();
            (
                id.clone(),
                (
                    h.tokens_of(id),
                    fin.as_ref().and_then(|f| f.finish_reason),
                    fin.and_then(|f| f.stop_reason),
                ),
            )
        })
        .collect();
    (results, h.sched.stats())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Mixed lengths, shared prefixes (prefix hits), eos, stop ids, min_tokens, chunked
    /// prefill on and off, small pools (preemption), both policies: async scheduling
    /// produces exactly the tokens and finishes of the serial loop.
    #[test]
    fn async_scheduling_matches_the_serial_loop(
        specs in prop::collection::vec(
            (0u32..3, 0u32..20, 1u32..12, 1u32..16, 0u32..4, any::<bool>(), any::<bool>(), -1i32..2),
            1..12,
        ),
        blocks in 8u32..40,
        chunked in any::<bool>(),
        caching in prop::bool::weighted(0.8),
        priority in any::<bool>(),
    ) {
        let cfg = small_config(blocks, chunked, caching, priority);
        let mut reqs = Vec::new();
        for (i, (family, shared, tail, max_tokens, min_tokens, ignore_eos, stop, prio)) in
            specs.into_iter().enumerate()
        {
            let mut p: Vec<u32> = (0..shared).map(|k| 100 * (family + 1) + k).collect();
            p.extend((0..tail).map(|k| 5000 + i as u32 * 50 + k));
            let fits = (p.len() as u32 + max_tokens).min(48) - 1 <= blocks * 4;
            if !fits || (!chunked && p.len() > 16) {
                continue;
            }
            let mut r = request(
                &format!("r{i}"),
                p,
                SamplingParams {
                    max_tokens,
                    min_tokens: min_tokens.min(max_tokens),
                    ignore_eos,
                    stop_token_ids: if stop { vec![5] } else { vec![] },
                    ..SamplingParams::default()
                },
            );
            r.priority = prio;
            r.arrival_time = i as f64;
            reqs.push(r);
        }
        let (sync, _) = run_workload(cfg.clone(), &reqs, false);
        let (asy, _) = run_workload(cfg, &reqs, true);
        prop_assert_eq!(sync, asy);
    }
}

//! Deterministic simulations of the scheduler with a fake model runner. Every step goes
//! through the harness, which checks the token budget, the sequence cap, the invariants,
//! and that a simulated worker replaying the deltas holds the scheduler's exact view.

mod common;

use common::*;
use vllm_engine_core::scheduler::{Scheduler, SchedulingPolicy};
use vllm_protocol::{FinishReason, SamplingParams};

#[test]
fn budget_and_sequence_cap_hold_every_step() {
    let mut cfg = config(256, 16);
    cfg.max_num_seqs = 4;
    cfg.max_num_batched_tokens = 50;
    let mut h = Harness::new(cfg);
    for i in 0..10 {
        h.add(request(
            &format!("r{i}"),
            prompt(i, 20 + 7 * i),
            params(5 + i),
        ));
    }
    h.run_to_completion(500);
    for i in 0..10 {
        assert_eq!(h.tokens_of(&format!("r{i}")).len() as u32, 5 + i);
        let fin = h.finish_of(&format!("r{i}")).unwrap();
        assert_eq!(fin.finish_reason, Some(FinishReason::Length));
    }
    assert!(h.steps.iter().any(|s| s.num_scheduled_tokens.len() == 4));
    assert!(h.steps.iter().any(|s| s.total_num_scheduled_tokens == 50));
    h.assert_pool_free();
}

#[test]
fn long_prompt_is_chunked_and_interleaved_with_decodes() {
    let mut cfg = config(256, 16);
    cfg.max_num_batched_tokens = 64;
    cfg.max_model_len = 1024;
    let mut h = Harness::new(cfg);
    for i in 0..4 {
        h.add(request(&format!("d{i}"), prompt(i, 8), params(40)));
    }
    h.step(); // the four short prompts prefill together (32 tokens)
    h.add(request("long", prompt(9, 300), params(3)));
    let mut chunks = Vec::new();
    while h
        .sched
        .request("long")
        .is_some_and(|r| r.num_output_tokens() == 0)
    {
        let so = h.step();
        // Every running decode gets its token in every step of the long prefill.
        for i in 0..4 {
            let id = format!("d{i}");
            assert!(so.num_scheduled_tokens.contains(&(id, 1)), "decode starved");
        }
        if let Some((_, n)) = so.num_scheduled_tokens.iter().find(|(id, _)| id == "long") {
            chunks.push(*n);
        }
    }
    assert_eq!(chunks.iter().sum::<u32>(), 300);
    assert!(chunks.len() >= 5, "chunks: {chunks:?}");
    assert!(chunks.iter().all(|&n| n <= 60));
    h.run_to_completion(200);
    h.assert_pool_free();
}

#[test]
fn long_prefill_token_threshold_caps_each_chunk() {
    let mut cfg = config(256, 16);
    cfg.max_num_batched_tokens = 100;
    cfg.long_prefill_token_threshold = 24;
    let mut h = Harness::new(cfg);
    h.add(request("a", prompt(1, 100), params(2)));
    h.add(request("b", prompt(2, 100), params(2)));
    let so = h.step();
    assert_eq!(
        so.num_scheduled_tokens,
        vec![("a".into(), 24), ("b".into(), 24)]
    );
    h.run_to_completion(100);
    h.assert_pool_free();
}

#[test]
fn without_chunked_prefill_a_prompt_waits_for_a_step_it_fits_in() {
    let mut cfg = config(256, 16);
    cfg.max_num_batched_tokens = 40;
    cfg.enable_chunked_prefill = false;
    let mut h = Harness::new(cfg);
    h.add(request("a", prompt(1, 30), params(3)));
    h.add(request("b", prompt(2, 30), params(3)));
    let so = h.step();
    assert_eq!(so.num_scheduled_tokens, vec![("a".into(), 30)]);
    let so = h.step();
    // a decodes (1 token); b's 30 tokens fit in the remaining 39.
    assert_eq!(so.num_scheduled_tokens.len(), 2);
    assert!(so.num_scheduled_tokens.contains(&("b".into(), 30)));
    let err = h
        .sched
        .add_request(request("c", prompt(3, 41), params(1)))
        .unwrap_err();
    assert!(err.contains("41") && err.contains("40"), "{err}");
    h.run_to_completion(100);
    h.assert_pool_free();
}

#[test]
fn prefix_hit_starts_at_the_hit_and_computes_at_least_one_token() {
    let mut h = Harness::new(config(64, 16));
    let p = prompt(1, 64);
    h.add(request("a", p.clone(), params(2)));
    h.run_to_completion(50);
    assert_eq!(h.outputs["a"][0].num_cached_tokens, 0);

    // Same prompt plus 8 tokens: all 4 full blocks are hits.
    let mut longer = p.clone();
    longer.extend(prompt(2, 8));
    h.add(request("b", longer, params(2)));
    let so = h.step();
    assert_eq!(so.scheduled_new_reqs[0].num_computed_tokens, 64);
    assert_eq!(so.num_scheduled_tokens, vec![("b".into(), 8)]);
    h.run_to_completion(50);
    assert_eq!(h.outputs["b"][0].num_cached_tokens, 64);

    // The exact same prompt: fully cached, so the last block is recomputed.
    h.add(request("c", p.clone(), params(2)));
    let so = h.step();
    assert_eq!(so.scheduled_new_reqs[0].num_computed_tokens, 48);
    assert_eq!(so.num_scheduled_tokens, vec![("c".into(), 16)]);
    h.run_to_completion(50);

    // 65 tokens with 64 cached: exactly one token computed.
    let mut plus_one = p.clone();
    plus_one.push(7);
    h.add(request("d", plus_one, params(2)));
    let so = h.step();
    assert_eq!(so.num_scheduled_tokens, vec![("d".into(), 1)]);
    h.run_to_completion(50);

    let s = h.sched.stats();
    assert_eq!(s.prefix_cache_queries, 64 + 72 + 64 + 65);
    assert_eq!(s.prefix_cache_hits, 64 + 48 + 64);
    h.assert_pool_free();
}

#[test]
fn shared_prefix_blocks_are_ref_counted_across_running_requests() {
    let mut h = Harness::new(config(64, 4));
    let p = prompt(1, 16);
    h.add(request("first", p.clone(), params(8)));
    h.step();
    h.step(); // first's prompt blocks are now computed and cached
    for i in 0..3 {
        h.add(request(&format!("s{i}"), p.clone(), params(8)));
    }
    h.step();
    let shared = h.sched.block_ids("first")[0];
    for i in 0..3 {
        assert_eq!(h.sched.block_ids(&format!("s{i}"))[0], shared);
    }
    assert_eq!(h.sched.kv_cache_manager().block_pool().ref_cnt(shared), 4);
    h.run_to_completion(100);
    h.assert_pool_free();
}

#[test]
fn preemption_with_a_tiny_pool_completes_every_request() {
    let mut cfg = config(10, 4); // 40 token slots
    cfg.max_num_batched_tokens = 32;
    let mut h = Harness::new(cfg);
    for i in 0..4 {
        h.add(request(&format!("r{i}"), prompt(i, 6), params(20)));
    }
    h.run_to_completion(1000);
    let stats = h.sched.stats();
    assert!(stats.num_preemptions > 0, "the pool was never short");
    assert!(h.steps.iter().any(|s| !s.preempted_req_ids.is_empty()));
    // A preempted request comes back as new, with its output so far.
    assert!(h
        .steps
        .iter()
        .flat_map(|s| &s.scheduled_new_reqs)
        .any(|r| !r.output_token_ids.is_empty()));
    for i in 0..4 {
        let id = format!("r{i}");
        let tokens = h.tokens_of(&id);
        assert_eq!(tokens.len(), 20, "{id}");
        // Recompute never re-emits or changes a token: each position sampled once.
        let expected: Vec<u32> = (6..26).map(|pos| default_token(&id, pos)).collect();
        assert_eq!(tokens, expected);
    }
    h.assert_pool_free();
}

#[test]
fn the_latest_admitted_request_is_preempted_first() {
    let mut cfg = config(6, 4);
    cfg.max_num_batched_tokens = 64;
    let mut h = Harness::new(cfg);
    h.add(request("old", prompt(1, 8), params(12)));
    h.add(request("new", prompt(2, 8), params(12)));
    let mut preempted = Vec::new();
    while preempted.is_empty() {
        preempted = h.step().preempted_req_ids.clone();
        if preempted.is_empty() {
            // The victim's id reaches the workers with the next non-empty step.
            preempted = h.sched.waiting_ids();
        }
    }
    assert_eq!(preempted, vec!["new".to_string()]);
    h.run_to_completion(200);
    h.assert_pool_free();
}

/// The `n` samples of one API request fill every slot while nothing else waits, but a
/// request that arrives later gets a slot at once (one sample gives it up), and the group
/// takes its slots back when the newcomer is done.
#[test]
fn one_api_request_fills_the_slots_but_never_starves_another() {
    let mut cfg = config(1024, 4);
    cfg.max_num_seqs = 8;
    let mut h = Harness::new(cfg);
    for j in 0..8 {
        let mut child = request(&format!("big-{j}"), prompt(1, 4), params(200));
        child.parent_request_id = Some("big".into());
        h.add(child);
    }
    for _ in 0..3 {
        h.step();
    }
    assert_eq!(
        h.sched.running_ids().len(),
        8,
        "a lone group takes every slot"
    );
    h.add(request("small", prompt(2, 4), params(3)));
    let mut steps = 0;
    while h.finish_of("small").is_none() {
        let so = h.step();
        steps += 1;
        if steps == 1 {
            assert_eq!(so.preempted_req_ids, ["big-7"], "the latest sample yields");
            assert!(so.scheduled_new_reqs.iter().any(|r| r.req_id == "small"));
        }
        assert!(steps <= 3, "the newcomer waited {steps} steps");
    }
    h.step();
    assert_eq!(
        h.sched.running_ids().len(),
        8,
        "the group takes its slot back"
    );
    h.run_to_completion(2000);
    for j in 0..8 {
        assert_eq!(h.tokens_of(&format!("big-{j}")).len(), 200);
    }
    h.assert_pool_free();
}

#[test]
fn priority_policy_admits_by_priority_and_preempts_the_lowest() {
    let mut cfg = config(64, 4);
    cfg.policy = SchedulingPolicy::Priority;
    cfg.max_num_seqs = 1;
    let mut h = Harness::new(cfg);
    for (id, prio) in [("p3", 3), ("p1", 1), ("p2", 2), ("p1b", 1)] {
        let mut r = request(id, prompt(prio as u32, 4), params(2));
        r.priority = prio;
        h.add(r);
    }
    let mut order = Vec::new();
    while h.sched.has_unfinished_requests() {
        let so = h.step();
        order.extend(so.scheduled_new_reqs.iter().map(|r| r.req_id.clone()));
    }
    assert_eq!(order, ["p1", "p1b", "p2", "p3"]);

    // Preemption under Priority takes the highest value, even if admitted first.
    let mut cfg = config(6, 4);
    cfg.policy = SchedulingPolicy::Priority;
    let mut h = Harness::new(cfg);
    let mut low = request("low", prompt(1, 8), params(12));
    low.priority = 5;
    h.add(low);
    h.step();
    let mut high = request("high", prompt(2, 8), params(12));
    high.priority = 0;
    h.add(high);
    let mut victims = Vec::new();
    for _ in 0..40 {
        victims.extend(h.step().preempted_req_ids);
    }
    assert!(!victims.is_empty());
    assert!(victims.iter().all(|v| v == "low"), "{victims:?}");
    h.run_to_completion(200);
    h.assert_pool_free();
}

#[test]
fn abort_mid_prefill_and_mid_decode_frees_blocks() {
    let mut cfg = config(64, 4);
    cfg.max_num_batched_tokens = 16;
    let mut h = Harness::new(cfg);
    h.add(request("prefill", prompt(1, 40), params(5)));
    h.step();
    assert!(h.sched.request("prefill").unwrap().num_computed_tokens < 40);
    assert!(!h.sched.block_ids("prefill").is_empty());
    h.sched
        .abort_requests(&["prefill".to_string(), "unknown".to_string()]);
    h.sched.check_invariants().unwrap();
    assert_eq!(h.sched.stats().num_free_blocks, 64);

    h.add(request("decode", prompt(2, 4), params(50)));
    let so = h.step();
    // The workers learn of the abort with the next step they receive.
    assert_eq!(so.finished_req_ids, vec!["prefill".to_string()]);
    h.step();
    h.step();
    assert_eq!(h.sched.request("decode").unwrap().num_output_tokens(), 3);
    h.add(request("waiting-only", prompt(3, 4), params(50)));
    h.sched.abort_requests(&["decode".to_string()]);
    h.sched.check_invariants().unwrap();
    assert_eq!(h.sched.stats().num_free_blocks, 64);
    let so = h.step();
    assert_eq!(so.finished_req_ids, vec!["decode".to_string()]);
    h.sched.abort_requests(&["waiting-only".to_string()]);
    h.sched.check_invariants().unwrap();
    h.assert_pool_free();
}

#[test]
fn stop_conditions() {
    stop_conditions_with(false);
}

#[test]
fn stop_conditions_with_async_scheduling() {
    stop_conditions_with(true);
}

fn stop_conditions_with(async_scheduling: bool) {
    let run = |p: SamplingParams,
               prompt_len: u32,
               max_model_len: u32,
               sample: &mut dyn FnMut(&str, usize) -> u32| {
        let mut cfg = config(64, 4);
        cfg.max_model_len = max_model_len;
        cfg.async_scheduling = async_scheduling;
        let mut h = Harness::new(cfg);
        h.add(request("r", prompt(1, prompt_len), p));
        while h.has_work() {
            h.step_with(sample);
        }
        h.assert_pool_free();
        let fin = h.finish_of("r").unwrap().clone();
        (h.tokens_of("r"), fin)
    };
    let base = SamplingParams {
        max_tokens: 10,
        ..SamplingParams::default()
    };

    // eos at the 3rd output token (position prompt_len + 2).
    let (toks, fin) = run(base.clone(), 4, 256, &mut eos_at(6));
    assert_eq!(
        (toks.len(), fin.finish_reason, fin.stop_reason),
        (3, Some(FinishReason::Stop), None)
    );
    assert_eq!(*toks.last().unwrap(), EOS);

    // ignore_eos runs to max_tokens.
    let p = SamplingParams {
        ignore_eos: true,
        ..base.clone()
    };
    let (toks, fin) = run(p, 4, 256, &mut eos_at(6));
    assert_eq!(
        (toks.len(), fin.finish_reason),
        (10, Some(FinishReason::Length))
    );

    // stop_token_ids report the id.
    let p = SamplingParams {
        stop_token_ids: vec![77],
        ..base.clone()
    };
    let (toks, fin) = run(p, 4, 256, &mut eos_at(100));
    assert_eq!(
        (toks.len(), fin.finish_reason, fin.stop_reason),
        (1, Some(FinishReason::Stop), Some(77))
    );

    // min_tokens holds back eos and stop ids.
    let p = SamplingParams {
        min_tokens: 5,
        stop_token_ids: vec![77],
        ..base.clone()
    };
    let (toks, fin) = run(p, 4, 256, &mut eos_at(6));
    assert_eq!(
        (toks.len(), fin.finish_reason, fin.stop_reason),
        (5, Some(FinishReason::Stop), Some(77))
    );

    // max_tokens.
    let (toks, fin) = run(base.clone(), 4, 256, &mut eos_at(100));
    assert_eq!(
        (toks.len(), fin.finish_reason),
        (10, Some(FinishReason::Length))
    );

    // max_model_len: 4 prompt tokens, model length 7 → 3 tokens, even under min_tokens.
    let p = SamplingParams {
        min_tokens: 10,
        ..base.clone()
    };
    let (toks, fin) = run(p, 4, 7, &mut eos_at(100));
    assert_eq!(
        (toks.len(), fin.finish_reason),
        (3, Some(FinishReason::Length))
    );
}

#[test]
fn add_request_refuses_what_can_never_run() {
    let mut cfg = config(4, 4); // 16 slots
    cfg.max_model_len = 32;
    let mut s = Scheduler::new(cfg);
    let err = s.add_request(request("e", vec![], params(1))).unwrap_err();
    assert!(err.contains("empty"), "{err}");
    let err = s
        .add_request(request("l", prompt(1, 32), params(1)))
        .unwrap_err();
    assert!(
        err.starts_with("This model's maximum context length is 32 tokens."),
        "{err}"
    );
    assert!(err.contains("32 tokens in the prompt"), "{err}");
    let err = s
        .add_request(request("p", prompt(1, 10), params(10)))
        .unwrap_err();
    assert!(
        err.contains("20 tokens") && err.contains("16 tokens"),
        "{err}"
    );
    // 10 + 7 = 17 tokens: the last is never computed, so 16 slots suffice.
    s.add_request(request("ok", prompt(1, 10), params(7)))
        .unwrap();
    let err = s
        .add_request(request("ok", prompt(1, 3), params(1)))
        .unwrap_err();
    assert!(err.contains("already in use"), "{err}");
    assert_eq!(s.stats().num_waiting_reqs, 1);
}

#[test]
fn fail_all_fails_everyone_and_frees_the_pool() {
    let mut h = Harness::new(config(64, 4));
    for i in 0..20 {
        h.add(request(&format!("r{i}"), prompt(i, 10), params(30)));
    }
    h.step();
    h.step();
    let outs = h.sched.fail_all("worker 0 died");
    assert_eq!(outs.len(), 20);
    assert!(outs
        .iter()
        .all(|o| o.finish_reason == Some(FinishReason::Error)
            && o.error.as_deref() == Some("worker 0 died")));
    h.sched.check_invariants().unwrap();
    h.assert_pool_free();
}

#[test]
fn stats_and_reset_prefix_cache() {
    let mut h = Harness::new(config(32, 4));
    h.add(request("a", prompt(1, 12), params(100)));
    h.step();
    let s = h.sched.stats();
    assert_eq!(
        (s.num_running_reqs, s.num_waiting_reqs, s.num_total_blocks),
        (1, 0, 32)
    );
    assert_eq!(s.num_free_blocks, 29);
    assert!((s.kv_cache_usage - 3.0 / 32.0).abs() < 1e-6);
    h.sched.abort_requests(&["a".to_string()]);
    // Freed blocks still serve hits until the cache is reset.
    assert!(h.sched.reset_prefix_cache());
    h.add(request("b", prompt(1, 12), params(1)));
    let so = h.step();
    assert_eq!(so.scheduled_new_reqs[0].num_computed_tokens, 0);
    h.run_to_completion(10);
    h.add(request("c", prompt(1, 12), params(1)));
    let so = h.step();
    assert_eq!(so.scheduled_new_reqs[0].num_computed_tokens, 8);
    h.run_to_completion(10);
    h.assert_pool_free();
}

#[test]
fn prefix_caching_off_never_hits() {
    let mut cfg = config(64, 4);
    cfg.enable_prefix_caching = false;
    let mut h = Harness::new(cfg);
    h.add(request("a", prompt(1, 12), params(2)));
    h.run_to_completion(10);
    h.add(request("b", prompt(1, 12), params(2)));
    let so = h.step();
    assert_eq!(so.scheduled_new_reqs[0].num_computed_tokens, 0);
    h.run_to_completion(10);
    assert_eq!(h.sched.stats().prefix_cache_hits, 0);
}

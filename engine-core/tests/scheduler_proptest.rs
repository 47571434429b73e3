//! Property tests: random sequences of add / step / abort / prefix-cache reset on a small
//! KV pool (so preemption happens), checking after every operation that no block leaks,
//! ref counts equal the number of owning requests, no block is both free and referenced,
//! the simulated worker's view (and KV contents) match, and that once every request has
//! ended the whole pool is free. Every workload runs with and without async scheduling.

mod common;

use common::*;
use proptest::prelude::*;
use vllm_protocol::SamplingParams;

#[derive(Debug, Clone)]
enum Op {
    Add {
        family: u32,
        shared_len: u32,
        tail_len: u32,
        max_tokens: u32,
        min_tokens: u32,
        priority: i32,
        ignore_eos: bool,
    },
    Step {
        seed: u64,
    },
    Abort {
        pick: usize,
    },
    ResetPrefixCache,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u32..3, 0u32..24, 0u32..10, 1u32..24, 0u32..4, -2i32..3, any::<bool>()).prop_map(
            |(family, shared_len, tail_len, max_tokens, min_tokens, priority, ignore_eos)| Op::Add {
                family, shared_len, tail_len, max_tokens,
                min_tokens: min_tokens.min(max_tokens), priority, ignore_eos,
            }
        ),
        6 => any::<u64>().prop_map(|seed| Op::Step { seed }),
        1 => any::<usize>().prop_map(|pick| Op::Abort { pick }),
        1 => Just(Op::ResetPrefixCache),
    ]
}

/// A sampler over a tiny vocabulary (eos included) so generated blocks repeat too.
fn sampler(seed: u64) -> impl FnMut(&str, usize) -> u32 {
    let mut state = seed | 1;
    move |_, _| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let r = (state >> 33) as u32 % 16;
        if r == 0 {
            EOS
        } else {
            2 + r % 4
        }
    }
}

fn run_ops(
    ops: Vec<Op>,
    priority: bool,
    chunked: bool,
    caching: bool,
    blocks: u32,
    async_scheduling: bool,
) -> vllm_protocol::SchedulerStats {
    let mut cfg = small_config(blocks, chunked, caching, priority);
    cfg.async_scheduling = async_scheduling;
    let mut h = Harness::new(cfg);
    let mut next_id = 0u32;
    let mut ids: Vec<String> = Vec::new();
    for op in ops {
        match op {
            Op::Add {
                family,
                shared_len,
                tail_len,
                max_tokens,
                min_tokens,
                priority,
                ignore_eos,
            } => {
                let mut p: Vec<u32> = (0..shared_len).map(|i| 100 * (family + 1) + i).collect();
                p.extend((0..tail_len).map(|i| 5000 + next_id * 50 + i));
                let id = format!("r{next_id}");
                next_id += 1;
                let mut req = request(
                    &id,
                    p.clone(),
                    SamplingParams {
                        max_tokens,
                        min_tokens,
                        ignore_eos,
                        ..SamplingParams::default()
                    },
                );
                req.priority = priority;
                req.arrival_time = f64::from(next_id);
                let fits_pool = (p.len() as u32 + max_tokens).min(48) - 1 <= blocks * 4;
                let ok = !p.is_empty() && p.len() < 48 && (chunked || p.len() <= 16) && fits_pool;
                assert_eq!(
                    h.sched.add_request(req).is_ok(),
                    ok,
                    "prompt {} max_tokens {max_tokens}",
                    p.len()
                );
                if ok {
                    ids.push(id);
                }
            }
            Op::Step { seed } => {
                h.step_with(&mut sampler(seed));
            }
            Op::Abort { pick } => {
                if !ids.is_empty() {
                    let id = ids.swap_remove(pick % ids.len());
                    h.sched.abort_requests(&[id]);
                }
            }
            Op::ResetPrefixCache => {
                assert!(h.sched.reset_prefix_cache());
            }
        }
        h.sched.check_invariants().unwrap();
    }
    // Everything left must finish without a deadlock, leaving the pool fully free.
    let mut seed = 7;
    for _ in 0..5000 {
        if !h.has_work() {
            break;
        }
        seed += 1;
        h.step_with(&mut sampler(seed));
    }
    assert!(
        !h.sched.has_unfinished_requests(),
        "requests left: {:?}",
        h.sched.stats()
    );
    h.assert_pool_free();
    h.sched.check_invariants().unwrap();
    // Every accepted request either finished with its output or was aborted.
    for (id, outs) in &h.outputs {
        let n: usize = outs.iter().map(|o| o.new_token_ids.len()).sum();
        let finished = outs.iter().filter(|o| o.finish_reason.is_some()).count();
        assert!(finished <= 1, "{id} finished twice");
        assert!(n <= 24, "{id} produced {n} tokens");
    }
    h.sched.stats()
}

/// The generator reaches the interesting states: preemption and prefix hits.
#[test]
fn random_workload_preempts_and_hits_the_prefix_cache() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut preemptions, mut hits) = (0, 0);
    for _ in 0..64 {
        let ops = prop::collection::vec(op(), 100..120)
            .new_tree(&mut runner)
            .expect("strategy")
            .current();
        for async_scheduling in [false, true] {
            let stats = run_ops(ops.clone(), false, true, true, 8, async_scheduling);
            preemptions += stats.num_preemptions;
            hits += stats.prefix_cache_hits;
        }
    }
    assert!(
        preemptions > 0 && hits > 0,
        "preemptions {preemptions}, hits {hits}"
    );
    eprintln!("64 random workloads: {preemptions} preemptions, {hits} prefix-hit tokens");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn block_pool_and_scheduler_invariants(
        ops in prop::collection::vec(op(), 1..120),
        priority in any::<bool>(),
        chunked in any::<bool>(),
        caching in prop::bool::weighted(0.8),
        blocks in 6u32..16,
        async_scheduling in any::<bool>(),
    ) {
        run_ops(ops, priority, chunked, caching, blocks, async_scheduling);
    }
}

//! Overlapped steps (`crate::overlap`) against the same scheduler outputs run one step at
//! a time: identical tokens and logprobs, greedy, seeded and unseeded, through graph
//! replays and eager steps that mix prefills with decodes; and the steps the policy
//! defers are the ones it should.

use std::collections::{BTreeMap, BTreeSet};

use vllm_protocol::{
    CachedRequestData, ModelRunnerOutput, NewRequestData, SampledToken, SchedulerOutput,
};

use super::graphs::cuda_runner;
use super::*;
use crate::model_runner::ModelRunner;

/// A request of the script: prefilled whole in step `start`, one decode step in each of
/// the steps after it up to `end`, finished in `end + 1`.
struct Scripted {
    id: &'static str,
    prompt: Vec<u32>,
    params: SamplingParams,
    start: u64,
    end: u64,
}

/// The script: "a" greedy throughout; "b" seeded top-p, joining a's decode in a mixed
/// step; "c" unseeded with a presence penalty (keeps the synchronous path while it runs);
/// "d" greedy with logprobs (its steps are never deferred).
fn script() -> Vec<Scripted> {
    let prompt = |n: u32, salt: u32| (0..n).map(|j| (j * 37 + salt) % 500).collect();
    vec![
        Scripted {
            id: "a",
            prompt: prompt(7, 3),
            params: SamplingParams {
                temperature: 0.0,
                ..Default::default()
            },
            start: 1,
            end: 24,
        },
        Scripted {
            id: "b",
            prompt: prompt(20, 11),
            params: SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                seed: Some(7),
                ..Default::default()
            },
            start: 3,
            end: 24,
        },
        Scripted {
            id: "c",
            prompt: prompt(5, 29),
            params: SamplingParams {
                temperature: 0.7,
                presence_penalty: 0.5,
                ..Default::default()
            },
            start: 4,
            end: 8,
        },
        Scripted {
            id: "d",
            prompt: prompt(9, 41),
            params: SamplingParams {
                temperature: 0.0,
                logprobs: Some(2),
                ..Default::default()
            },
            start: 12,
            end: 15,
        },
    ]
}

/// The steps `script` defers: those with an output placeholder (from step 2 on) whose
/// sampled rows ask for no logprobs (not 12 to 15, d's).
fn expected_deferred() -> BTreeSet<u64> {
    (2..=11).chain(16..=24).collect()
}

/// Drives `r` through the script as an async-scheduling engine-core would: step k is
/// planned before step k-1's output has come back, on output placeholders, knowing the
/// tokens of steps up to k-2. Returns every step's sampled tokens and the steps whose
/// output came back only with a later step (deferred).
fn drive(
    r: &mut ModelRunner<CudaBackend>,
    overlapped: bool,
) -> (BTreeMap<u64, Vec<SampledToken>>, BTreeSet<u64>) {
    let reqs = script();
    let last = reqs.iter().map(|q| q.end).max().unwrap();
    let mut got: BTreeMap<u64, Vec<SampledToken>> = BTreeMap::new();
    let mut deferred = BTreeSet::new();
    // Per request: tokens sent to the worker so far, K/V computed so far.
    let mut sent = vec![0usize; reqs.len()];
    let mut computed = vec![0u32; reqs.len()];
    for k in 1..=last {
        let known = |id: &str| -> Vec<u32> {
            got.range(..k.saturating_sub(1))
                .flat_map(|(_, s)| s.iter().filter(|t| t.req_id == id).map(|t| t.token_id))
                .collect()
        };
        let mut so = SchedulerOutput {
            step_id: k,
            ..Default::default()
        };
        for (i, q) in reqs.iter().enumerate() {
            if q.end + 1 == k {
                so.finished_req_ids.push(q.id.into());
            }
            if !(q.start..=q.end).contains(&k) {
                continue;
            }
            let n = if q.start == k {
                so.scheduled_new_reqs.push(NewRequestData {
                    req_id: q.id.into(),
                    prompt_token_ids: q.prompt.clone(),
                    output_token_ids: vec![],
                    sampling_params: q.params.clone(),
                    block_ids: (0..12).map(|b| b + 12 * i as u32).collect(),
                    num_computed_tokens: 0,
                });
                q.prompt.len() as u32
            } else {
                let known = known(q.id);
                // It sampled in every step from `start` to k-1.
                let placeholders = (k - q.start) as usize - known.len();
                so.scheduled_cached_reqs.push(CachedRequestData {
                    req_id: q.id.into(),
                    new_token_ids: known[sent[i]..].to_vec(),
                    new_block_ids: vec![],
                    num_computed_tokens: computed[i],
                    num_output_placeholders: placeholders as u32,
                });
                sent[i] = known.len();
                1
            };
            so.num_scheduled_tokens.push((q.id.into(), n));
            so.total_num_scheduled_tokens += n;
            computed[i] += n;
        }
        let outs: Vec<ModelRunnerOutput> = if overlapped {
            r.execute_model_overlapped(&so).unwrap()
        } else {
            vec![r.execute_model_cuda(&so).unwrap()]
        };
        for o in outs {
            assert!(
                got.insert(o.step_id, o.sampled).is_none(),
                "step {}",
                o.step_id
            );
        }
        if !got.contains_key(&k) {
            deferred.insert(k);
        }
        assert!(
            (1..k).all(|j| got.contains_key(&j)),
            "step {k}: an output older than the step before it is still missing"
        );
    }
    if let Some(o) = r.finish_pending().unwrap() {
        got.insert(o.step_id, o.sampled);
    }
    (got, deferred)
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn overlapped_steps_give_the_tokens_of_steps_run_one_at_a_time() {
    if !gpu_present() {
        return;
    }
    for (preset, dtype) in [("tiny-qwen3", Some("float32")), ("tiny-qwen3", None)] {
        for enforce_eager in [false, true] {
            let what = format!("{preset} {dtype:?} eager {enforce_eager}");
            let mut serial = cuda_runner(preset, dtype, enforce_eager);
            assert_eq!(serial.num_cuda_graphs() > 0, !enforce_eager, "{what}");
            let (want, none) = drive(&mut serial, false);
            assert!(
                none.is_empty(),
                "{what}: the serial runner deferred {none:?}"
            );
            drop(serial);
            let mut overlapped = cuda_runner(preset, dtype, enforce_eager);
            let (got, deferred) = drive(&mut overlapped, true);
            assert_eq!(deferred, expected_deferred(), "{what}: deferred steps");
            assert_eq!(got.len(), want.len(), "{what}: steps");
            for (step, w) in &want {
                assert_eq!(&got[step], w, "{what}: step {step} differs");
            }
            // d's logprobs came back (its steps ran synchronously).
            assert!(got[&13].iter().any(|t| t.logprobs.is_some()), "{what}");
            println!(
                "MATCH overlapped == serial: {what}, {} steps, {} deferred",
                want.len(),
                deferred.len()
            );
        }
    }
}

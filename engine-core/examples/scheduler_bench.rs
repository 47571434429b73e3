//! Scheduler benchmark: the CPU cost of one engine step (`schedule()` plus
//! `update_from_output()`) with a fake model runner, for
//!   1. 1,024 running requests, all decoding;
//!   2. 8,192 waiting requests behind a full batch of running decodes;
//!   3. admission: steps that admit from 8,192 waiting requests (prefill chunks).
//!
//! Run: `cargo run --release -p vllm-engine-core --example scheduler_bench`

use std::time::{Duration, Instant};

use vllm_engine_core::scheduler::{Scheduler, SchedulerConfig, SchedulingPolicy};
use vllm_protocol::{
    EngineCoreRequest, ModelRunnerOutput, SampledToken, SamplingParams, SchedulerOutput,
};

fn config(max_num_seqs: u32) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens: 8192,
        max_model_len: 4096,
        block_size: 16,
        num_gpu_blocks: 200_000,
        enable_prefix_caching: true,
        enable_chunked_prefill: true,
        policy: SchedulingPolicy::Fcfs,
        long_prefill_token_threshold: 0,
        async_scheduling: false,
    }
}

fn add_requests(s: &mut Scheduler, n: u32, prompt_len: u32) {
    for i in 0..n {
        let req = EngineCoreRequest {
            request_id: format!("req-{i}"),
            prompt_token_ids: (0..prompt_len).map(|t| 1000 + i * 7 + t).collect(),
            sampling_params: SamplingParams {
                max_tokens: 3000,
                ignore_eos: true,
                ..SamplingParams::default()
            },
            eos_token_ids: vec![2],
            arrival_time: f64::from(i),
            priority: 0,
            parent_request_id: None,
        };
        if let Err(e) = s.add_request(req) {
            panic!("benchmark request refused: {e}");
        }
    }
}

/// What rank 0 would answer: a token for every request whose tokens are all scheduled.
fn fake_runner(s: &Scheduler, so: &SchedulerOutput) -> ModelRunnerOutput {
    let sampled = so
        .num_scheduled_tokens
        .iter()
        .filter(|(id, _)| {
            s.request(id)
                .is_some_and(|r| r.num_computed_tokens == r.num_tokens())
        })
        .map(|(id, _)| SampledToken {
            req_id: id.clone(),
            token_id: 7,
            logprobs: None,
        })
        .collect();
    ModelRunnerOutput {
        step_id: so.step_id,
        sampled,
    }
}

struct Timing {
    schedule: Vec<Duration>,
    update: Vec<Duration>,
}

/// Runs `steps` steps, timing schedule and update apart (the fake runner is not timed).
fn timed_steps(s: &mut Scheduler, steps: usize) -> (Timing, u64) {
    let mut t = Timing {
        schedule: Vec::with_capacity(steps),
        update: Vec::with_capacity(steps),
    };
    let mut tokens = 0u64;
    for _ in 0..steps {
        let t0 = Instant::now();
        let so = s.schedule();
        t.schedule.push(t0.elapsed());
        tokens += u64::from(so.total_num_scheduled_tokens);
        let out = fake_runner(s, &so);
        let t1 = Instant::now();
        let outputs = s.update_from_output(&so, &out);
        t.update.push(t1.elapsed());
        std::hint::black_box(outputs);
    }
    (t, tokens)
}

fn untimed_steps(s: &mut Scheduler, steps: usize) {
    for _ in 0..steps {
        let so = s.schedule();
        let out = fake_runner(s, &so);
        s.update_from_output(&so, &out);
    }
}

fn pct(v: &[Duration], p: f64) -> f64 {
    let mut v: Vec<f64> = v.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn mean(v: &[Duration]) -> f64 {
    v.iter().map(|d| d.as_secs_f64() * 1e6).sum::<f64>() / v.len() as f64
}

fn report(name: &str, t: &Timing, tokens: u64) {
    let total: Vec<Duration> = t
        .schedule
        .iter()
        .zip(&t.update)
        .map(|(a, b)| *a + *b)
        .collect();
    println!(
        "{name:<58} steps {:>4}  tokens/step {:>6}  schedule {:>7.1} us  update {:>7.1} us  \
         step mean {:>7.1} us  p50 {:>7.1}  p99 {:>7.1}",
        total.len(),
        tokens / total.len() as u64,
        mean(&t.schedule),
        mean(&t.update),
        mean(&total),
        pct(&total, 0.5),
        pct(&total, 0.99),
    );
}

fn main() {
    // 1. 1,024 running requests decoding (prompt 128; prefilled before timing).
    let mut s = Scheduler::new(config(1024));
    add_requests(&mut s, 1024, 128);
    untimed_steps(&mut s, 20);
    assert_eq!(s.stats().num_running_reqs, 1024);
    let (t, tokens) = timed_steps(&mut s, 500);
    report("1,024 running, decode", &t, tokens);
    if std::env::var_os("BENCH_SLOW_STEPS").is_some() {
        for (i, (a, b)) in t.schedule.iter().zip(&t.update).enumerate() {
            if (*a + *b) > Duration::from_millis(2) {
                println!("  slow step {i}: schedule {a:?} update {b:?}");
            }
        }
    }

    // 2. 8,192 waiting behind 256 running decodes (max_num_seqs = 256).
    let mut s = Scheduler::new(config(256));
    add_requests(&mut s, 256 + 8192, 128);
    untimed_steps(&mut s, 10);
    let st = s.stats();
    assert_eq!((st.num_running_reqs, st.num_waiting_reqs), (256, 8192));
    let (t, tokens) = timed_steps(&mut s, 500);
    report(
        "8,192 waiting + 256 running decode (seq cap full)",
        &t,
        tokens,
    );

    // 2b. Same with 1,024 running.
    let mut s = Scheduler::new(config(1024));
    add_requests(&mut s, 1024 + 8192, 128);
    untimed_steps(&mut s, 20);
    let st = s.stats();
    assert_eq!((st.num_running_reqs, st.num_waiting_reqs), (1024, 8192));
    let (t, tokens) = timed_steps(&mut s, 300);
    report(
        "8,192 waiting + 1,024 running decode (seq cap full)",
        &t,
        tokens,
    );

    // 3. Admission: 8,192 waiting, steps admit 64 prompts of 128 tokens each.
    let mut s = Scheduler::new(config(1024));
    add_requests(&mut s, 8192, 128);
    let (t, tokens) = timed_steps(&mut s, 16);
    report(
        "admission from 8,192 waiting (64 new prompts/step)",
        &t,
        tokens,
    );
}

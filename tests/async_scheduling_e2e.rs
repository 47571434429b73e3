//! `--async-scheduling` end to end over the real processes on the CPU backend: the engine
//! schedules step N+1 while the workers run step N, and nothing a client sees changes.
//! Each workload runs on a serial server and on an async one with the same flags, and
//! the token ids (and logprobs) must be identical: greedy and seeded random sampling,
//! mixed lengths, chunked prefill, prefix-cache hits, max_tokens of 1 and 2, stop-token
//! finishes, n > 1, preemption on a tiny KV cache, tensor parallelism over two ranks, and
//! requests aborted mid-stream. The tiny random model repeats itself, so SmolLM2 (a real
//! model, whose greedy text varies and ends on eos by itself) runs the workload too.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{metric, post_json, smollm2_gguf, tiny_model, Server};
use serde_json::{json, Value};

/// One completion per body, all in flight at once; each choice's token ids and logprobs.
async fn run_all(server: &Server, bodies: &[Value]) -> Vec<Vec<(Value, Value)>> {
    let requests = bodies.iter().map(|b| async move {
        let (status, body) = post_json(server, "/v1/completions", b).await;
        assert_eq!(status, 200, "{body}");
        body["choices"]
            .as_array()
            .expect("choices")
            .iter()
            .map(|c| {
                (
                    c["token_ids"].clone(),
                    c["logprobs"]["token_logprobs"].clone(),
                )
            })
            .collect::<Vec<_>>()
    });
    futures::future::join_all(requests).await
}

/// Prompts of mixed lengths, a third sharing a long prefix (prefix-cache hits), some longer
/// than the step budget of 64 tokens (chunked prefill).
fn prompts() -> Vec<Vec<u32>> {
    let shared: Vec<u32> = (0..70).map(|i| 97 + i % 26).collect();
    (0..18u32)
        .map(|i| match i % 3 {
            0 => shared.iter().copied().chain([48 + i, 50]).collect(),
            1 => (0..(3 + i * 11)).map(|j| 65 + (i * 7 + j) % 50).collect(),
            _ => (0..(1 + i)).map(|j| 200 + (i + j) % 300).collect(),
        })
        .collect()
}

/// Greedy requests (some with logprobs) and seeded random ones, with max_tokens from 1 up.
fn bodies() -> Vec<Value> {
    prompts()
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let max_tokens = [1, 2, 5, 17, 33][i % 5];
            match i % 4 {
                3 => json!({"prompt": p, "max_tokens": max_tokens, "temperature": 1.0,
                            "seed": i, "n": 2, "ignore_eos": true, "return_token_ids": true}),
                2 => json!({"prompt": p, "max_tokens": max_tokens, "temperature": 0.0,
                            "logprobs": 2, "ignore_eos": true, "return_token_ids": true}),
                _ => json!({"prompt": p, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": true, "return_token_ids": true}),
            }
        })
        .collect()
}

/// Requests that stop on a token id the serial server generated mid-way (so the finish
/// happens with the next step already in flight on the async server).
fn stop_bodies(serial: &[Vec<(Value, Value)>], bodies: &[Value]) -> Vec<Value> {
    let mut out = Vec::new();
    for (choices, body) in serial.iter().zip(bodies) {
        let ids = choices[0].0.as_array().expect("token ids");
        if ids.len() < 6 || body["temperature"] != json!(0.0) {
            continue;
        }
        let mut b = body.clone();
        b["stop_token_ids"] = json!([ids[3]]);
        b["max_tokens"] = json!(40);
        out.push(b);
    }
    assert!(out.len() >= 2, "workload too short for stop-token cases");
    out
}

async fn compare(serial: &Server, asynchronous: &Server) {
    let bodies = bodies();
    let expected = run_all(serial, &bodies).await;
    let got = run_all(asynchronous, &bodies).await;
    assert_eq!(expected, got);
    let stops = stop_bodies(&expected, &bodies);
    let expected = run_all(serial, &stops).await;
    for (choices, body) in expected.iter().zip(&stops) {
        let ids = choices[0].0.as_array().expect("token ids");
        assert_eq!(
            ids.last(),
            body["stop_token_ids"].get(0),
            "ends on its stop id"
        );
    }
    assert_eq!(expected, run_all(asynchronous, &stops).await);
}

/// f32 on the CPU, so both servers compute the same values.
const CPU_F32: [&str; 4] = ["--device", "cpu", "--dtype", "float32"];

/// Small steps, so that the comparisons' prefills are chunked.
const SMALL_STEPS: [&str; 2] = ["--max-num-batched-tokens", "64"];

/// A serial and an async server of `model` with `CPU_F32`, `SMALL_STEPS` and `extra`.
fn serial_and_async(model: &Path, extra: &[&str]) -> (Server, Server) {
    let flags = [&CPU_F32[..], &SMALL_STEPS, extra].concat();
    let with_async = [&flags[..], &["--async-scheduling"]].concat();
    (
        Server::start_with_model(model, &flags),
        Server::start_with_model(model, &with_async),
    )
}

/// Compares the serial and async servers of the tiny model with `extra` on the workload,
/// and returns the async one (for its metrics).
async fn compare_with(extra: &[&str]) -> Server {
    let (serial, asynchronous) = serial_and_async(tiny_model(), extra);
    compare(&serial, &asynchronous).await;
    asynchronous
}

#[tokio::test(flavor = "multi_thread")]
async fn async_scheduling_changes_no_output() {
    let asynchronous = compare_with(&[]).await;
    let hits = metric(&asynchronous, "vllm:prefix_cache_hits_total").await;
    assert!(hits > 0.0, "the workload must hit the prefix cache");
}

#[tokio::test(flavor = "multi_thread")]
async fn async_scheduling_with_constant_preemption_changes_no_output() {
    // 12 blocks of 16 tokens: a few long requests at a time, the rest preempted.
    let asynchronous = compare_with(&["--num-gpu-blocks-override", "12"]).await;
    let preemptions = metric(&asynchronous, "vllm:num_preemptions_total").await;
    assert!(preemptions > 0.0, "the workload must preempt");
}

#[tokio::test(flavor = "multi_thread")]
async fn async_scheduling_at_tensor_parallel_2_changes_no_output() {
    compare_with(&["-t", "2"]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn aborts_mid_stream_leave_the_async_engine_serving() {
    let server = Server::start(&[&CPU_F32[..], &["--async-scheduling"]].concat());
    // Streams dropped after their first few events: the frontend aborts them in the engine
    // while their steps are in flight.
    let streams = (0..6).map(|i| {
        let url = server.url("/v1/completions");
        async move {
            let body = json!({"prompt": format!("abort me {i}"), "max_tokens": 2000,
                              "ignore_eos": true, "stream": true});
            let mut resp = reqwest::Client::new()
                .post(url)
                .json(&body)
                .send()
                .await
                .expect("send");
            for _ in 0..(2 + i) {
                resp.chunk().await.expect("chunk");
            }
            // Dropped here: the connection closes mid-stream.
        }
    });
    futures::future::join_all(streams).await;
    // The engine frees them all and serves on, with the same outputs as a serial run.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while metric(&server, "vllm:num_requests_running").await > 0.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "aborted requests still running"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let serial = Server::start(&CPU_F32);
    let bodies = bodies();
    assert_eq!(
        run_all(&serial, &bodies).await,
        run_all(&server, &bodies).await
    );
    assert_eq!(metric(&server, "vllm:kv_cache_usage_perc").await, 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn async_scheduling_on_smollm2_changes_no_output() {
    let (serial, asynchronous) =
        serial_and_async(&smollm2_gguf(), &["--num-gpu-blocks-override", "24"]);
    let prompts = [
        "The capital of France is",
        "List three colors:",
        "Once upon a time, in a small village by the sea,",
        "def fibonacci(n):",
        "The capital of France is a city where",
        "Q: What is 2 + 2?\nA:",
    ];
    let mut bodies: Vec<Value> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let max_tokens = [1, 3, 24, 48][i % 4];
            json!({"prompt": p, "max_tokens": max_tokens, "temperature": 0.0,
                   "logprobs": 1, "return_token_ids": true})
        })
        .collect();
    bodies.extend(prompts.iter().enumerate().map(|(i, p)| {
        json!({"prompt": p, "max_tokens": 32, "temperature": 0.8, "seed": 7 + i, "n": 2,
               "return_token_ids": true})
    }));
    let expected = run_all(&serial, &bodies).await;
    let distinct: std::collections::HashSet<String> =
        expected.iter().flatten().map(|c| c.0.to_string()).collect();
    assert!(distinct.len() >= 10, "SmolLM2's outputs vary");
    assert_eq!(expected, run_all(&asynchronous, &bodies).await);
}

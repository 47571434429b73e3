//! Tensor parallelism on the CPU backend, over the real processes: one worker per rank,
//! joined by the shared-memory communicator. Greedy output and logprobs at TP=2 and TP=4
//! against TP=1, replicated KV heads, a size that does not divide the heads, and the
//! faults of one rank (death, hang).
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{cmdline, descendants, http_status, post_json, Server};
use serde_json::json;

const PROMPTS: [&str; 4] = [
    "Tensor parallel",
    "the quick brown fox",
    "1 2 3 4 5 6 7",
    "a",
];

/// Greedy token ids and their logprobs for each of `PROMPTS`.
async fn greedy_runs(server: &Server) -> Vec<(Vec<u64>, Vec<f64>)> {
    let mut runs = Vec::new();
    for prompt in PROMPTS {
        let body = json!({"prompt": prompt, "max_tokens": 24, "temperature": 0.0,
                          "ignore_eos": true, "logprobs": 1, "return_token_ids": true});
        let (status, body) = post_json(server, "/v1/completions", &body).await;
        assert_eq!(status, 200, "{body}");
        let choice = &body["choices"][0];
        let ids = choice["token_ids"]
            .as_array()
            .expect("token_ids")
            .iter()
            .map(|v| v.as_u64().expect("id"))
            .collect();
        let logprobs = choice["logprobs"]["token_logprobs"]
            .as_array()
            .expect("token_logprobs")
            .iter()
            .map(|v| v.as_f64().expect("logprob"))
            .collect();
        runs.push((ids, logprobs));
    }
    runs
}

async fn runs_at(model: &Path, tp: usize) -> Vec<(Vec<u64>, Vec<f64>)> {
    let tp = tp.to_string();
    // f32: bf16 rounds each layer's input, which turns the ranks' different order of
    // sums (f32 rounding) into bf16 steps.
    let server =
        Server::start_with_model(model, &["--device", "cpu", "-t", &tp, "--dtype", "float32"]);
    let tree = descendants(server.pid());
    let workers = tree
        .iter()
        .filter(|&&p| cmdline(p).contains(" worker "))
        .count();
    assert_eq!(workers.to_string(), tp, "one worker process per rank");
    greedy_runs(&server).await
}

/// TP=2 and TP=4 give TP=1's greedy tokens, with logprobs within 1e-4. The tiny presets
/// have 4 attention heads and 2 KV heads, so TP=4 also replicates each KV head on 2 ranks.
async fn tensor_parallel_matches_tp1(preset: &str) {
    let model = common::make_tiny_model(preset);
    let reference = runs_at(model.path(), 1).await;
    assert!(
        reference
            .iter()
            .any(|(ids, _)| ids.iter().any(|&i| i != ids[0])),
        "a degenerate reference (one token repeated) proves little: {reference:?}"
    );
    for tp in [2, 4] {
        let runs = runs_at(model.path(), tp).await;
        for (p, ((ids, lps), (ref_ids, ref_lps))) in runs.iter().zip(&reference).enumerate() {
            assert_eq!(
                ids, ref_ids,
                "{preset} TP={tp}, prompt {p}: greedy tokens differ"
            );
            for (i, (a, b)) in lps.iter().zip(ref_lps).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4,
                    "{preset} TP={tp}, prompt {p}, token {i}: logprob {a} vs {b} at TP=1"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn qwen3_at_tp2_and_tp4_matches_tp1() {
    tensor_parallel_matches_tp1("tiny-qwen3").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn llama_at_tp2_and_tp4_matches_tp1() {
    tensor_parallel_matches_tp1("tiny-llama").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn qwen2_with_biases_at_tp4_matches_tp1() {
    let model = common::make_tiny_model("tiny-qwen2");
    let reference = runs_at(model.path(), 1).await;
    let runs = runs_at(model.path(), 4).await;
    for (p, ((ids, _), (ref_ids, _))) in runs.iter().zip(&reference).enumerate() {
        assert_eq!(ids, ref_ids, "tiny-qwen2 TP=4, prompt {p}");
    }
}

/// The trained SmolLM2-135M-Instruct (9 heads, 3 KV heads, a 49,152-token vocabulary) at
/// TP=3 gives TP=1's greedy text on 8 prompts.
#[tokio::test(flavor = "multi_thread")]
async fn smollm2_at_tp3_answers_like_tp1() {
    let model = common::smollm2_gguf();
    let prompts = [
        "The capital of France is",
        "Water boils at a temperature of",
        "def fibonacci(n):",
        "The three primary colors are",
        "Once upon a time, in a small village,",
        "The largest planet in the solar system is",
        "To make a cup of tea, first",
        "1, 2, 3, 4, 5,",
    ];
    let mut texts = Vec::new();
    for tp in ["1", "3"] {
        let server =
            Server::start_with_model(&model, &["--device", "cpu", "-t", tp, "--dtype", "float32"]);
        // One request of 8 prompts: every run schedules them alike, in one batch.
        let body = json!({"prompt": prompts, "max_tokens": 24, "temperature": 0.0});
        let (status, body) = post_json(&server, "/v1/completions", &body).await;
        assert_eq!(status, 200, "TP={tp}: {body}");
        let mut run = vec![String::new(); prompts.len()];
        for choice in body["choices"].as_array().expect("choices") {
            let i = choice["index"].as_u64().expect("index") as usize;
            run[i] = choice["text"].as_str().unwrap_or("").to_string();
        }
        texts.push(run);
    }
    assert!(
        texts[0][0].starts_with(" Paris"),
        "a trained model: {:?}",
        texts[0]
    );
    for (i, (one, three)) in texts[0].iter().zip(&texts[1]).enumerate() {
        assert_eq!(
            one, three,
            "prompt {i} ({:?}): TP=3 differs from TP=1",
            prompts[i]
        );
    }
}

#[test]
fn a_size_that_does_not_divide_the_heads_fails_at_startup_naming_both() {
    let mut server = Server::spawn(common::tiny_model(), &["--device", "cpu", "-t", "3"], &[]);
    let exit = server
        .wait_exit(Duration::from_secs(60))
        .unwrap_or_else(|| panic!("server did not exit:\n{}", server.log()));
    assert!(!exit.success());
    let log = server.log();
    assert!(
        log.contains("4 attention heads") && log.contains("--tensor-parallel-size 3"),
        "the error names both numbers:\n{log}"
    );
    assert_ne!(http_status(&server.url("/health")), Ok(200));
}

#[test]
fn workers_inherit_nccl_nvls_enable() {
    let server = Server::spawn(
        common::tiny_model(),
        &["--device", "cpu", "-t", "2"],
        &[("NCCL_NVLS_ENABLE", "0")],
    );
    let mut server = server;
    server.wait_healthy(Duration::from_secs(120));
    let workers: Vec<u32> = descendants(server.pid())
        .into_iter()
        .filter(|&p| cmdline(p).contains(" worker "))
        .collect();
    assert_eq!(workers.len(), 2);
    for pid in workers {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("environ");
        assert!(
            environ
                .split(|&b| b == 0)
                .any(|kv| kv == b"NCCL_NVLS_ENABLE=0"),
            "worker {pid} lacks NCCL_NVLS_ENABLE=0"
        );
    }
}

/// A long streaming request, started in the background; resolves to how it ended.
fn stream_in_background(server: &Server) -> tokio::task::JoinHandle<Result<String, String>> {
    let url = server.url("/v1/completions");
    tokio::spawn(async move {
        let body = json!({"prompt": "runs until the context is full", "ignore_eos": true,
                          "max_tokens": 30000, "stream": true});
        let resp = reqwest::Client::new()
            .post(url)
            .json(&body)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        // An error either fails the transfer or arrives as an SSE `error` event.
        let text = resp.text().await.map_err(|e| e.to_string())?;
        Ok(text)
    })
}

fn worker_of_rank(tree: &[u32], rank: u32) -> u32 {
    *tree
        .iter()
        .find(|&&p| cmdline(p).contains(&format!(" worker --rank {rank} ")))
        .unwrap_or_else(|| panic!("no worker rank {rank} among {tree:?}"))
}

/// After a rank fails: the stream ends with an error within `limit`, `/health` answers
/// 503 before the server exits non-zero, and no process of the run is left.
async fn expect_clean_failure(
    mut server: Server,
    tree: Vec<u32>,
    in_flight: tokio::task::JoinHandle<Result<String, String>>,
    limit: Duration,
    names: &str,
) {
    let start = Instant::now();
    let ended = tokio::time::timeout(limit, in_flight)
        .await
        .unwrap_or_else(|_| panic!("the stream did not end within {limit:?}"))
        .expect("join");
    if let Ok(text) = &ended {
        assert!(
            text.contains("\"error\""),
            "the stream must end with an error event, got: {}",
            &text[text.len().saturating_sub(500)..]
        );
    }
    let mut saw_503 = false;
    while start.elapsed() < limit + Duration::from_secs(5) {
        match http_status(&server.url("/health")) {
            Ok(503) => saw_503 = true,
            Ok(_) => {}
            Err(_) => break,
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let exit = server
        .wait_exit(Duration::from_secs(10))
        .unwrap_or_else(|| panic!("server still running after the fault:\n{}", server.log()));
    assert!(saw_503, "/health never answered 503");
    assert!(!exit.success(), "the server must exit non-zero");
    assert!(
        server.log().contains(names),
        "the log names `{names}`:\n{}",
        server.log()
    );
    common::assert_gone(&tree, Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_death_of_rank_1_mid_stream_fails_clients_and_ends_the_server() {
    the_death_of_rank_1_mid_stream(&[]).await;
}

/// With a step queued behind the running one, a dead rank still fails everything at once.
#[tokio::test(flavor = "multi_thread")]
async fn the_death_of_rank_1_with_async_scheduling_fails_clients_and_ends_the_server() {
    the_death_of_rank_1_mid_stream(&["--async-scheduling"]).await;
}

async fn the_death_of_rank_1_mid_stream(extra: &[&str]) {
    let mut flags = vec!["--device", "cpu", "-t", "2"];
    flags.extend(extra);
    let server = Server::start(&flags);
    let tree = descendants(server.pid());
    let rank1 = worker_of_rank(&tree, 1);
    let in_flight = stream_in_background(&server);
    tokio::time::sleep(Duration::from_millis(700)).await;
    // SAFETY: kill(2) on a process of this test's own server.
    unsafe { libc::kill(rank1 as libc::pid_t, libc::SIGKILL) };
    // The engine-core waits on its dead rank: no zombie, never left to init.
    common::assert_reaped_by_parent(rank1, Duration::from_secs(5));
    expect_clean_failure(
        server,
        tree,
        in_flight,
        Duration::from_secs(5),
        "worker rank 1",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rank_that_hangs_is_caught_by_the_watchdog() {
    a_rank_that_hangs(&[]).await;
}

/// The step queued behind a hung one does not extend the deadline.
#[tokio::test(flavor = "multi_thread")]
async fn a_rank_that_hangs_with_async_scheduling_is_caught_by_the_watchdog() {
    a_rank_that_hangs(&["--async-scheduling"]).await;
}

async fn a_rank_that_hangs(extra: &[&str]) {
    let mut flags = vec!["--device", "cpu", "-t", "2", "--execute-model-timeout", "2"];
    flags.extend(extra);
    let server = Server::start(&flags);
    let tree = descendants(server.pid());
    let rank1 = worker_of_rank(&tree, 1);
    let in_flight = stream_in_background(&server);
    tokio::time::sleep(Duration::from_millis(700)).await;
    // SAFETY: kill(2) on a process of this test's own server; SIGKILL still ends it.
    unsafe { libc::kill(rank1 as libc::pid_t, libc::SIGSTOP) };
    // The step deadline is the timeout plus 2 s of grace; 5 s more for the error to travel.
    expect_clean_failure(server, tree, in_flight, Duration::from_secs(9), "hang").await;
}

//! End-to-end tests of `vllm-rs serve` on the CPU backend: real frontend, engine-core and
//! worker processes talking over their real sockets, driven over real HTTP.

mod common;

use std::time::{Duration, Instant};

use common::{cmdline, descendants, metric, tiny_model, Server};
use futures::StreamExt;
use serde_json::{json, Value};

async fn post(server: &Server, path: &str, body: Value) -> (u16, Value) {
    common::post_json(server, path, &body).await
}

#[tokio::test(flavor = "multi_thread")]
async fn completion_from_a_prompt() {
    let server = Server::start(&[]);
    let (status, body) = post(
        &server,
        "/v1/completions",
        json!({"model": "tiny", "prompt": "Hello world", "max_tokens": 12, "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 12);
    assert_eq!(
        body["usage"]["prompt_tokens"],
        "Hello world".len(),
        "byte-level tiny tokenizer: one token per byte"
    );
    assert!(!choice["text"].as_str().unwrap_or("").is_empty(), "{body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn sixteen_concurrent_requests_all_complete() {
    let server = Server::start(&[]);
    let requests = (0..16).map(|i| {
        let body = json!({"prompt": format!("request number {i}"), "max_tokens": 8 + i, "ignore_eos": true, "temperature": 0.8, "seed": i});
        let server = &server;
        async move { post(server, "/v1/completions", body).await }
    });
    let results = futures::future::join_all(requests).await;
    for (i, (status, body)) in results.iter().enumerate() {
        assert_eq!(*status, 200, "request {i}: {body}");
        assert_eq!(
            body["usage"]["completion_tokens"],
            8 + i as u64,
            "request {i}: {body}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn aborting_a_stream_frees_its_kv_blocks() {
    let server = Server::start(&[]);
    let resp = reqwest::Client::new()
        .post(server.url("/v1/completions"))
        .json(&json!({"prompt": "a long story", "ignore_eos": true, "stream": true}))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let mut seen = 0;
    while seen < 3 {
        let chunk = body
            .next()
            .await
            .expect("stream ended early")
            .expect("chunk");
        seen += String::from_utf8_lossy(&chunk).matches("data: ").count();
    }
    assert!(
        metric(&server, "vllm:kv_cache_usage_perc").await > 0.0,
        "the running request holds blocks"
    );
    drop(body);
    let start = Instant::now();
    loop {
        let running = metric(&server, "vllm:num_requests_running").await;
        let usage = metric(&server, "vllm:kv_cache_usage_perc").await;
        if running == 0.0 && usage == 0.0 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "abort did not free the request: running {running}, usage {usage}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn greedy_output_equals_a_direct_forward() {
    // The direct forward (`greedy_reference`) computes in f32.
    let server = Server::start(&["--dtype", "float32"]);
    let prompt: Vec<u32> = "The quick brown fox".bytes().map(u32::from).collect();
    let (status, body) = post(
        &server,
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 24, "temperature": 0.0, "ignore_eos": true, "return_token_ids": true}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let served: Vec<u32> =
        serde_json::from_value(body["choices"][0]["token_ids"].clone()).expect("token_ids");
    let expected = vllm_worker::reference::greedy_reference(tiny_model(), &prompt, 24)
        .expect("reference forward");
    assert_eq!(served, expected);
}

#[tokio::test(flavor = "multi_thread")]
async fn prompt_over_max_model_len_is_refused_and_serving_goes_on() {
    let server = Server::start(&["--max-model-len", "64"]);
    let long: Vec<u32> = (0..100).map(|i| 97 + i % 26).collect();
    let (status, body) = post(
        &server,
        "/v1/completions",
        json!({"prompt": long, "max_tokens": 4}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("maximum context length is 64") && message.contains("100"),
        "{message}"
    );
    let (status, body) = post(
        &server,
        "/v1/completions",
        json!({"prompt": "short", "max_tokens": 4}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_json_is_a_400() {
    let server = Server::start(&[]);
    let resp = reqwest::Client::new()
        .post(server.url("/v1/completions"))
        .header("content-type", "application/json")
        .body("{\"prompt\": ")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 400);
    let body: Value = resp.json().await.expect("json error body");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("Invalid JSON"),
        "{body}"
    );
    let (status, _) = post(
        &server,
        "/v1/completions",
        json!({"prompt": "still serving", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_worker_fails_requests_and_the_server_exits() {
    let mut server = Server::start(&[]);
    let tree = descendants(server.pid());
    let worker = *tree
        .iter()
        .find(|&&p| cmdline(p).contains(" worker "))
        .expect("a worker process");
    let in_flight = {
        let url = server.url("/v1/completions");
        tokio::spawn(async move {
            let body = json!({"prompt": "runs until the context is full", "ignore_eos": true});
            let resp = reqwest::Client::new().post(url).json(&body).send().await;
            resp.map(|r| r.status().as_u16())
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    // SAFETY: kill(2) on a process of this test's own server.
    unsafe { libc::kill(worker as libc::pid_t, libc::SIGKILL) };
    let killed_at = Instant::now();
    // The engine-core waits on its dead worker: no zombie, never left to init.
    common::assert_reaped_by_parent(worker, Duration::from_secs(5));

    let status = tokio::time::timeout(Duration::from_secs(10), in_flight)
        .await
        .expect("in-flight request hung")
        .expect("join");
    assert!(
        matches!(status, Ok(code) if code >= 500),
        "in-flight request should fail with a 5xx, got {status:?}"
    );
    let exit = server.wait_exit(Duration::from_secs(10).saturating_sub(killed_at.elapsed()));
    let exit = exit.unwrap_or_else(|| {
        panic!(
            "server still running 10 s after the worker died:\n{}",
            server.log()
        )
    });
    assert!(!exit.success(), "server must exit non-zero");
    assert!(
        server.log().contains("worker rank 0"),
        "the log names the dead process:\n{}",
        server.log()
    );
    common::assert_gone(&tree, Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_shuts_everything_down_cleanly() {
    let mut server = Server::start(&[]);
    let tree = descendants(server.pid());
    assert_eq!(tree.len(), 2, "engine-core and one worker: {tree:?}");
    // SAFETY: kill(2) on this test's own server.
    unsafe { libc::kill(server.pid() as libc::pid_t, libc::SIGTERM) };
    let exit = server
        .wait_exit(Duration::from_secs(15))
        .expect("server did not stop on SIGTERM");
    assert!(
        exit.success(),
        "a requested shutdown exits 0, got {exit}:\n{}",
        server.log()
    );
    common::assert_gone(&tree, Duration::from_secs(5));
}

/// SIGKILL of the frontend, mid-stream, at TP=2: the engine-core notices, ends and reaps
/// its workers (none is left to init), and exits; within 5 s no process of the run is
/// left, zombies included.
#[tokio::test(flavor = "multi_thread")]
async fn a_killed_frontend_takes_the_engine_core_and_workers_with_it() {
    let mut server = Server::start(&["--device", "cpu", "-t", "2"]);
    let tree = descendants(server.pid());
    assert_eq!(tree.len(), 3, "engine-core and two workers: {tree:?}");
    let workers: Vec<u32> = tree
        .iter()
        .copied()
        .filter(|&p| cmdline(p).contains(" worker "))
        .collect();
    let url = server.url("/v1/completions");
    let in_flight = tokio::spawn(async move {
        let body =
            json!({"prompt": "in flight", "max_tokens": 30000, "ignore_eos": true, "stream": true});
        let _ = reqwest::Client::new().post(url).json(&body).send().await;
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.child.kill().expect("SIGKILL the frontend");
    let _ = server.child.wait();
    let killed = Instant::now();
    for worker in workers {
        common::assert_reaped_by_parent(worker, Duration::from_secs(5));
    }
    common::assert_gone(
        &tree,
        Duration::from_secs(5).saturating_sub(killed.elapsed()),
    );
    in_flight.abort();
}

/// A completion of `max_tokens` tokens, started in the background: (status, body).
fn completion_in_background(
    server: &Server,
    max_tokens: u32,
) -> tokio::task::JoinHandle<(u16, Value)> {
    let url = server.url("/v1/completions");
    tokio::spawn(async move {
        let body = json!({"prompt": "in flight", "max_tokens": max_tokens, "ignore_eos": true});
        let resp = reqwest::Client::new()
            .post(url)
            .json(&body)
            .send()
            .await
            .expect("send");
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    })
}

async fn wait_running(server: &Server, n: f64) {
    let start = Instant::now();
    while metric(server, "vllm:num_requests_running").await < n {
        assert!(start.elapsed() < Duration::from_secs(30), "never running");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// SIGTERM drains: /health turns 503 and new requests are refused at once, while the one in
/// flight runs to its end; then the server exits 0 and leaves no process, zombie or not.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_requests_in_flight_finish_then_exits_0() {
    let mut server = Server::start(&["--shutdown-timeout", "60"]);
    let tree = descendants(server.pid());
    let in_flight = completion_in_background(&server, 1500);
    wait_running(&server, 1.0).await;
    // SAFETY: kill(2) on this test's own server.
    unsafe { libc::kill(server.pid() as libc::pid_t, libc::SIGTERM) };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(common::http_status(&server.url("/health")), Ok(503));
    let (status, body) = post(
        &server,
        "/v1/completions",
        json!({"prompt": "too late", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("shutting down"),
        "{body}"
    );
    let (status, body) = in_flight.await.expect("join");
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["usage"]["completion_tokens"], 1500,
        "it ran to its end"
    );
    let exit = server
        .wait_exit(Duration::from_secs(15))
        .expect("the server did not exit after draining");
    assert!(exit.success(), "exit {exit}:\n{}", server.log());
    common::assert_gone(&tree, Duration::from_secs(5));
}

/// Requests still running after --shutdown-timeout end with a 503 naming the shutdown, a
/// stream with an error event; the exit code is still 0.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_ends_what_outlives_the_shutdown_timeout() {
    let mut server = Server::start(&["--shutdown-timeout", "1"]);
    let tree = descendants(server.pid());
    let whole = completion_in_background(&server, 30000);
    let resp = reqwest::Client::new()
        .post(server.url("/v1/completions"))
        .json(
            &json!({"prompt": "streamed", "max_tokens": 30000, "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    wait_running(&server, 2.0).await;
    let signalled = Instant::now();
    // SAFETY: kill(2) on this test's own server.
    unsafe { libc::kill(server.pid() as libc::pid_t, libc::SIGTERM) };
    let text = tokio::time::timeout(Duration::from_secs(10), resp.text())
        .await
        .expect("the stream outlived the shutdown")
        .expect("body");
    let events = common::sse_events(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let error = &events[events.len() - 2];
    assert!(error.contains("shutting down"), "{error}");
    let (status, body) = whole.await.expect("join");
    assert_eq!(status, 503, "{body}");
    assert!(
        signalled.elapsed() >= Duration::from_secs(1),
        "ended before the timeout"
    );
    let exit = server.wait_exit(Duration::from_secs(15)).expect("no exit");
    assert!(exit.success(), "exit {exit}:\n{}", server.log());
    common::assert_gone(&tree, Duration::from_secs(5));
}

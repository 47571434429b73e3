//! The OpenAI-compatible API over real HTTP against the real processes: every endpoint,
//! the validation errors, streaming, stop strings, seeds, logprobs and many clients.

mod common;

use std::time::{Duration, Instant};

use common::{metric, post_json, sse_events, Server};
use futures::StreamExt;
use serde_json::{json, Value};

async fn completion(server: &Server, body: Value) -> Value {
    let (status, body) = post_json(server, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{body}");
    body
}

async fn stream_text(server: &Server, body: Value) -> (String, Vec<Value>) {
    let text = reqwest::Client::new()
        .post(server.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("send")
        .text()
        .await
        .expect("body");
    let events = sse_events(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{text}");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk json"))
        .collect();
    let assembled = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    (assembled, chunks)
}

#[tokio::test(flavor = "multi_thread")]
async fn every_endpoint_answers() {
    let server = Server::start(&[]);
    let models: Value = reqwest::get(server.url("/v1/models"))
        .await
        .expect("models")
        .json()
        .await
        .expect("json");
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(models["data"][0]["max_model_len"], 32768);
    let version: Value = reqwest::get(server.url("/version"))
        .await
        .expect("version")
        .json()
        .await
        .expect("json");
    assert!(version["version"].is_string());
    assert_eq!(common::http_status(&server.url("/health")), Ok(200));

    let (status, tokens) = post_json(&server, "/tokenize", &json!({"prompt": "héllo"})).await;
    assert_eq!(status, 200, "{tokens}");
    assert_eq!(tokens["count"], 6, "byte-level: é is two bytes");
    let (status, text) =
        post_json(&server, "/detokenize", &json!({"tokens": tokens["tokens"]})).await;
    assert_eq!(status, 200);
    assert_eq!(text["prompt"], "héllo");

    completion(
        &server,
        json!({"prompt": "x", "max_tokens": 3, "ignore_eos": true}),
    )
    .await;
    let text = reqwest::get(server.url("/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    ] {
        assert!(
            text.lines()
                .any(|l| l.starts_with(name) && l.contains("model_name=\"tiny\"")),
            "{name} missing:\n{text}"
        );
    }
    assert_eq!(metric(&server, "vllm:generation_tokens_total").await, 3.0);
    assert!(
        text.contains(
            "vllm:request_success_total{model_name=\"tiny\",finished_reason=\"length\"} 1"
        ),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_requests_get_openai_shaped_errors() {
    let server = Server::start(&[]);
    let cases = [
        (
            json!({"prompt": "x", "top_p": 1.5}),
            400,
            "top_p must be in (0, 1], got 1.5.",
        ),
        (
            json!({"prompt": "x", "temperature": -1.0}),
            400,
            "temperature must be non-negative",
        ),
        (
            json!({"prompt": "x", "n": 0}),
            400,
            "n must be an integer in [1, 64] (--max-num-seqs), got 0.",
        ),
        (
            json!({"prompt": "x", "max_tokens": 0}),
            400,
            "max_tokens must be an integer in [1, 32767]",
        ),
        (
            json!({"prompt": "x", "min_tokens": 9, "max_tokens": 3}),
            400,
            "min_tokens must be less than or equal to max_tokens",
        ),
        (
            json!({"prompt": "x", "presence_penalty": 3.0}),
            400,
            "presence_penalty must be in [-2, 2]",
        ),
        (
            json!({"prompt": "x", "logit_bias": {"abc": 1.0}}),
            400,
            "logit_bias",
        ),
        (
            json!({"prompt": "x", "stop_token_ids": [999999]}),
            400,
            "stop_token_ids",
        ),
        (json!({"prompt": "x", "logprobs": 50}), 400, "logprobs"),
        (
            json!({"prompt": "x", "best_of_n_tries": 2}),
            400,
            "Unsupported field `best_of_n_tries`",
        ),
        (json!({"prompt": ""}), 400, "must not be empty"),
        (
            json!({"prompt": "x", "model": "nope"}),
            404,
            "The model `nope` does not exist.",
        ),
        (
            json!({"prompt": [999999]}),
            400,
            "prompt[0] must be a token id in [0, 511]",
        ),
    ];
    for (body, status, message) in cases {
        let (got, err) = post_json(&server, "/v1/completions", &body).await;
        assert_eq!(got, status, "{body} → {err}");
        let text = err["error"]["message"].as_str().unwrap_or_default();
        assert!(
            text.contains(message),
            "{body}: expected {message:?} in {err}"
        );
        assert_eq!(err["error"]["code"], status, "{err}");
        assert!(err["error"]["type"].is_string(), "{err}");
    }
    let long: Vec<u32> = vec![97; 40000];
    let (got, err) = post_json(&server, "/v1/completions", &json!({"prompt": long})).await;
    assert_eq!(got, 400);
    let text = err["error"]["message"].as_str().unwrap_or_default();
    assert!(
        text.contains("32768") && text.contains("40000"),
        "both lengths: {text}"
    );
    completion(&server, json!({"prompt": "still serving", "max_tokens": 2})).await;
}

/// The key comes from VLLM_API_KEY as well as --api-key; it guards every path under /v1
/// (unknown ones too, as in vLLM), and /health, /metrics and /version stay open.
#[tokio::test(flavor = "multi_thread")]
async fn the_api_key_guards_v1() {
    let mut server = Server::spawn(common::tiny_model(), &[], &[("VLLM_API_KEY", "sesame")]);
    server.wait_healthy(Duration::from_secs(120));
    let send = |path: &str, key: Option<&str>| {
        let mut req = reqwest::Client::new()
            .post(server.url(path))
            .json(&json!({"prompt": "x", "max_tokens": 2}));
        if let Some(key) = key {
            req = req.bearer_auth(key);
        }
        async move { req.send().await.expect("send").status().as_u16() }
    };
    assert_eq!(send("/v1/completions", None).await, 401);
    assert_eq!(send("/v1/completions", Some("wrong")).await, 401);
    assert_eq!(send("/v1/completions", Some("sesam")).await, 401);
    assert_eq!(send("/v1/completions", Some("sesame")).await, 200);
    assert_eq!(send("/v1/no-such-path", None).await, 401);
    assert_eq!(send("/v1/no-such-path", Some("sesame")).await, 404);
    for open in ["/health", "/metrics", "/version"] {
        assert_eq!(
            common::http_status(&server.url(open)),
            Ok(200),
            "{open} stays open"
        );
    }
    let resp = reqwest::get(server.url("/v1/models"))
        .await
        .expect("models");
    assert_eq!(resp.status(), 401);
}

/// No prompt reaches the log, even at debug level, unless --enable-log-requests asks for
/// it; with it, the request's id and parameters are logged, and its prompt at debug.
#[tokio::test(flavor = "multi_thread")]
async fn prompts_are_logged_only_with_enable_log_requests() {
    for enabled in [false, true] {
        let flags: &[&str] = if enabled {
            &["--enable-log-requests"]
        } else {
            &[]
        };
        let mut server = Server::spawn(common::tiny_model(), flags, &[("RUST_LOG", "debug")]);
        server.wait_healthy(Duration::from_secs(120));
        let secret = "a secret prompt 8271";
        completion(&server, json!({"prompt": secret, "max_tokens": 2})).await;
        let body = json!({"messages": [{"role": "user", "content": secret}], "max_tokens": 2});
        let (status, _) = post_json(&server, "/v1/chat/completions", &body).await;
        assert_eq!(status, 200);
        let log = server.log();
        assert_eq!(
            log.contains(secret),
            enabled,
            "--enable-log-requests {enabled}: the prompt {} the log:\n{log}",
            if enabled {
                "is missing from"
            } else {
                "reached"
            }
        );
        assert_eq!(log.contains("received request"), enabled, "{log}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_assembled_equals_the_whole_response() {
    let server = Server::start(&[]);
    let request = json!({"prompt": "Once upon", "max_tokens": 40, "temperature": 0.8, "seed": 11, "ignore_eos": true});
    let whole = completion(&server, request.clone()).await;
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (text, chunks) = stream_text(&server, streamed).await;
    assert_eq!(text, whole["choices"][0]["text"].as_str().expect("text"));
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [&json!("length")]);
    let usage = &chunks.last().expect("usage chunk")["usage"];
    assert_eq!(usage, &whole["usage"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn stop_strings_match_across_tokens() {
    let server = Server::start(&[]);
    let prompt = json!({"prompt": "The stop test", "max_tokens": 60, "temperature": 0.0, "ignore_eos": true, "return_token_ids": true});
    let free = completion(&server, prompt.clone()).await;
    let ids: Vec<u32> =
        serde_json::from_value(free["choices"][0]["token_ids"].clone()).expect("ids");
    let full = free["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_string();
    // Two adjacent single-byte printable tokens make a stop string that spans a token boundary.
    let pair = ids
        .windows(2)
        .position(|w| w.iter().all(|&t| (33..127).contains(&t)))
        .expect("two printable tokens in a row");
    let stop: String = ids[pair..pair + 2]
        .iter()
        .map(|&t| t as u8 as char)
        .collect();
    let cut = full.find(&stop).expect("stop string occurs in the text");

    let mut stopped = prompt.clone();
    stopped["stop"] = json!([stop]);
    let body = completion(&server, stopped.clone()).await;
    assert_eq!(body["choices"][0]["text"], full[..cut]);
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["choices"][0]["stop_reason"], stop);

    stopped["include_stop_str_in_output"] = json!(true);
    stopped["stream"] = json!(true);
    let (text, _) = stream_text(&server, stopped).await;
    assert_eq!(text, full[..cut + stop.len()]);
}

#[tokio::test(flavor = "multi_thread")]
async fn n_samples_with_a_seed_are_reproducible() {
    let server = Server::start(&[]);
    let request = json!({"prompt": "Seeds", "n": 3, "seed": 1234, "max_tokens": 16, "temperature": 1.0, "ignore_eos": true});
    let a = completion(&server, request.clone()).await;
    let b = completion(&server, request).await;
    let texts = |v: &Value| -> Vec<String> {
        v["choices"]
            .as_array()
            .expect("choices")
            .iter()
            .map(|c| c["text"].as_str().unwrap_or("").to_string())
            .collect()
    };
    assert_eq!(texts(&a).len(), 3);
    assert_eq!(texts(&a), texts(&b));
    assert!(
        texts(&a)[0] != texts(&a)[1] || texts(&a)[1] != texts(&a)[2],
        "the samples should differ: {:?}",
        texts(&a)
    );
    assert_eq!(a["usage"]["prompt_tokens"], 5, "one prompt counted once");
    assert_eq!(a["usage"]["completion_tokens"], 48);
}

#[tokio::test(flavor = "multi_thread")]
async fn logprobs_agree_with_the_sampled_tokens() {
    let server = Server::start(&[]);
    let body = completion(&server, json!({"prompt": "Logprobs", "max_tokens": 12, "temperature": 0.0, "logprobs": 3, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true})).await;
    let lp = &body["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().expect("tokens");
    let ids = body["choices"][0]["token_ids"]
        .as_array()
        .expect("token_ids");
    assert_eq!(tokens.len(), 12);
    let named: Vec<String> = ids.iter().map(|id| format!("token_id:{id}")).collect();
    assert_eq!(
        tokens.iter().filter_map(Value::as_str).collect::<Vec<_>>(),
        named,
        "logprob tokens are the sampled tokens"
    );
    for (i, token) in tokens.iter().enumerate() {
        let logprob = lp["token_logprobs"][i].as_f64().expect("logprob");
        let top = lp["top_logprobs"][i].as_object().expect("top");
        assert!(logprob <= 0.0);
        assert!(!top.is_empty() && top.len() <= 3);
        // Greedy picks the most likely token, so it tops the list with the same logprob.
        let best = top
            .values()
            .filter_map(Value::as_f64)
            .fold(f64::MIN, f64::max);
        assert!(
            (best - logprob).abs() < 1e-4,
            "token {i}: {token} has {logprob}, best {best}"
        );
        assert!(
            top.get(token.as_str().unwrap_or("")).is_some(),
            "token {i} {token} not among {top:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sixty_four_streaming_clients_all_complete() {
    let server = Server::start(&[]);
    let clients = (0..64).map(|i| {
        let server = &server;
        async move {
            let body = json!({"prompt": format!("client {i}"), "max_tokens": 10, "stream": true, "ignore_eos": true, "seed": i});
            stream_text(server, body).await
        }
    });
    for (i, (_, chunks)) in futures::future::join_all(clients)
        .await
        .into_iter()
        .enumerate()
    {
        let finished = chunks
            .iter()
            .filter(|c| c["choices"][0]["finish_reason"] == "length")
            .count();
        assert_eq!(finished, 1, "client {i}");
    }
    let start = Instant::now();
    while metric(&server, "vllm:num_requests_running").await != 0.0 {
        assert!(start.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(metric(&server, "vllm:kv_cache_usage_perc").await, 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_seed_gives_the_same_tokens_whatever_shares_the_batch() {
    let server = Server::start(&[]);
    let seeded = json!({"prompt": "Seeded", "max_tokens": 24, "temperature": 1.0, "seed": 99, "ignore_eos": true});
    let alone = completion(&server, seeded.clone()).await;
    let noise = (0..8).map(|i| {
        let server = &server;
        async move { completion(server, json!({"prompt": format!("noise {i}"), "max_tokens": 30, "temperature": 1.0, "ignore_eos": true})).await }
    });
    let (crowded, _) = futures::join!(
        completion(&server, seeded),
        futures::future::join_all(noise)
    );
    assert_eq!(crowded["choices"][0]["text"], alone["choices"][0]["text"]);
}

/// Waits until the engine is idle again: no request running or waiting, no KV block held.
async fn wait_idle(server: &Server, limit: Duration) {
    let start = Instant::now();
    loop {
        let running = metric(server, "vllm:num_requests_running").await;
        let waiting = metric(server, "vllm:num_requests_waiting").await;
        let usage = metric(server, "vllm:kv_cache_usage_perc").await;
        if running == 0.0 && waiting == 0.0 && usage == 0.0 {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "not idle after {limit:?}: {running} running, {waiting} waiting, KV usage {usage}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One request may ask for at most --max-num-seqs sequences (64 on the CPU), refused
/// before any work; and the worst request allowed (64 samples, each running to the end of
/// the context) leaves other clients their share: a short request still answers within a
/// second.
#[tokio::test(flavor = "multi_thread")]
async fn one_request_never_holds_more_than_its_share() {
    let server = Server::start(&[]);
    let refused = Instant::now();
    let cases = [
        (
            json!({"prompt": "hi", "n": 1_000_000, "max_tokens": 1}),
            "n",
            "n must be an integer in [1, 64] (--max-num-seqs), got 1000000.",
        ),
        (
            json!({"prompt": "hi", "n": 2, "best_of": 65}),
            "best_of",
            "best_of must be an integer in [1, 64] (--max-num-seqs), got 65.",
        ),
        (
            json!({"prompt": vec!["a"; 33], "n": 2}),
            "prompt",
            "66 sequences (33 prompts × n=2)",
        ),
        (
            json!({"prompt": "hi", "max_tokens": 32768}),
            "max_tokens",
            "max_tokens must be an integer in [1, 32767]",
        ),
    ];
    for (body, param, message) in cases {
        let (status, err) = post_json(&server, "/v1/completions", &body).await;
        assert_eq!(status, 400, "{body} → {err}");
        assert_eq!(err["error"]["param"], param, "{err}");
        let text = err["error"]["message"].as_str().unwrap_or_default();
        assert!(
            text.contains(message),
            "{body}: expected {message:?} in {err}"
        );
    }
    assert!(
        refused.elapsed() < Duration::from_secs(1),
        "refusals took {:?}: work was done first",
        refused.elapsed()
    );

    // "hog" is 3 tokens (one per byte): max_tokens fills the context exactly.
    let worst = json!({"prompt": "hog", "n": 64, "max_tokens": 32768 - 3, "ignore_eos": true, "stream": true});
    let resp = reqwest::Client::new()
        .post(server.url("/v1/completions"))
        .json(&worst)
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    let mut hog = resp.bytes_stream();
    let drain = tokio::spawn(async move { while hog.next().await.is_some() {} });
    let start = Instant::now();
    while metric(&server, "vllm:num_requests_running").await < 64.0 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the 64 samples never all ran"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for i in 0..3 {
        let asked = Instant::now();
        let body = json!({"prompt": format!("meanwhile {i}"), "max_tokens": 5, "ignore_eos": true});
        let answer = tokio::time::timeout(
            Duration::from_secs(10),
            post_json(&server, "/v1/completions", &body),
        )
        .await;
        let (status, body) = answer.expect("a short request starved beside the worst allowed one");
        assert_eq!(status, 200, "{body}");
        assert!(
            asked.elapsed() < Duration::from_secs(1),
            "a short request took {:?} beside the worst allowed one",
            asked.elapsed()
        );
    }
    drain.abort();
    wait_idle(&server, Duration::from_secs(10)).await;
}

/// Sends `body` as it is, with `content_type` (none when `None`) and the API key `key`.
async fn raw(
    server: &Server,
    method: reqwest::Method,
    path: &str,
    content_type: Option<&str>,
    body: Vec<u8>,
    key: Option<&str>,
) -> (u16, Value) {
    let mut req = reqwest::Client::new().request(method, server.url(path));
    if let Some(ct) = content_type {
        req = req.header("content-type", ct);
    }
    if let Some(key) = key {
        req = req.bearer_auth(key);
    }
    let resp = req.body(body).send().await.expect("send");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// A raw request and the error it must get: method, path, content type, body, API key,
/// status, message.
type RawCase<'a> = (
    reqwest::Method,
    &'a str,
    Option<&'a str>,
    Vec<u8>,
    Option<&'a str>,
    u16,
    &'a str,
);

/// One bad input: where it goes, what it is, and the error it must get.
struct Bad {
    path: &'static str,
    body: Vec<u8>,
    status: u16,
    param: Option<&'static str>,
    message: &'static str,
}

fn bad(path: &'static str, body: Value, param: &'static str, message: &'static str) -> Bad {
    Bad {
        path,
        body: body.to_string().into_bytes(),
        status: 400,
        param: Some(param),
        message,
    }
}

fn bad_bytes(body: &[u8], status: u16, message: &'static str) -> Bad {
    Bad {
        path: "/v1/completions",
        body: body.to_vec(),
        status,
        param: None,
        message,
    }
}

/// Every bad input gets an error in OpenAI's shape, with the right status, a `param`
/// naming the field, and a message naming the field, the value and what is allowed;
/// afterwards the server still serves.
#[tokio::test(flavor = "multi_thread")]
async fn bad_inputs_get_errors_naming_the_field_the_value_and_the_range() {
    let server = Server::start(&["--api-key", "sesame"]);
    let key = Some("sesame");
    let c = "/v1/completions";
    let chat = "/v1/chat/completions";
    let user = json!([{"role": "user", "content": "hi"}]);
    let deep = format!("{{\"prompt\": {}{}}}", "[".repeat(200), "]".repeat(200));
    let cases = vec![
        // The body itself.
        bad_bytes(b"{\"prompt\": \"x\",}", 400, "Invalid JSON in request body at line 1"),
        bad_bytes(b"{\"prompt\": \"x\", \"max_tokens\": 5", 400, "it ends early"),
        bad_bytes(b"[1, 2]", 400, "must be a JSON object, got an array"),
        bad_bytes(b"\"hello\"", 400, "must be a JSON object, got a string"),
        bad_bytes(b"", 400, "The request body is empty"),
        bad_bytes(deep.as_bytes(), 400, "nests deeper than 128 levels"),
        bad_bytes(b"{\"prompt\": \"\xff\"}", 400, "not valid UTF-8: byte 12 (0xff)"),
        bad(c, json!({"prompt": "x", "best_of_n_tries": 2}), "best_of_n_tries", "Unsupported field `best_of_n_tries`"),
        // Every sampling field: wrong types and values out of range.
        bad(c, json!({"prompt": "x", "n": "two"}), "n", "n must be an integer in [1, 64] (--max-num-seqs), got a string \"two\"."),
        bad(c, json!({"prompt": "x", "n": 0}), "n", "n must be an integer in [1, 64] (--max-num-seqs), got 0."),
        bad(c, json!({"prompt": "x", "n": 1.5}), "n", "got 1.5."),
        bad(c, json!({"prompt": "x", "temperature": "hot"}), "temperature", "temperature must be a number ≥ 0, got a string \"hot\"."),
        bad(c, json!({"prompt": "x", "temperature": -1}), "temperature", "temperature must be non-negative, got -1."),
        bad(c, json!({"prompt": "x", "top_p": 1.5}), "top_p", "top_p must be in (0, 1], got 1.5."),
        bad(c, json!({"prompt": "x", "top_p": 0}), "top_p", "top_p must be in (0, 1], got 0."),
        bad(c, json!({"prompt": "x", "top_p": []}), "top_p", "top_p must be a number in (0, 1], got an array []."),
        bad(c, json!({"prompt": "x", "top_k": -2}), "top_k", "top_k must be an integer in [-1, 2147483647] (0 or -1 disables it), got -2."),
        bad(c, json!({"prompt": "x", "top_k": 1.5}), "top_k", "top_k must be an integer in [-1, 2147483647]"),
        bad(c, json!({"prompt": "x", "min_p": 2}), "min_p", "min_p must be in [0, 1], got 2."),
        bad(c, json!({"prompt": "x", "min_p": true}), "min_p", "min_p must be a number in [0, 1], got true."),
        bad(c, json!({"prompt": "x", "seed": "x"}), "seed", "seed must be an integer in [-9223372036854775808, 18446744073709551615], got a string \"x\"."),
        bad(c, json!({"prompt": "x", "seed": 1.5}), "seed", "seed must be an integer in"),
        bad(c, json!({"prompt": "x", "stop": 5}), "stop", "stop must be a string or a list of strings, got 5."),
        bad(c, json!({"prompt": "x", "stop": [""]}), "stop", "stop cannot contain an empty string, got one at stop[0]."),
        bad(c, json!({"prompt": "x", "stop": ["a", 1]}), "stop", "stop[1] must be a string, got 1."),
        bad(c, json!({"prompt": "x", "stop_token_ids": [-1]}), "stop_token_ids", "stop_token_ids[0] must be a token id in [0, 511] (the vocabulary has 512 tokens), got -1."),
        bad(c, json!({"prompt": "x", "stop_token_ids": [7, 512]}), "stop_token_ids", "stop_token_ids[1] must be a token id in [0, 511] (the vocabulary has 512 tokens), got 512."),
        bad(c, json!({"prompt": "x", "stop_token_ids": "1"}), "stop_token_ids", "stop_token_ids must be a list of token ids, got a string \"1\"."),
        bad(c, json!({"prompt": "x", "ignore_eos": "yes"}), "ignore_eos", "ignore_eos must be true or false, got a string \"yes\"."),
        bad(c, json!({"prompt": "x", "min_tokens": -1}), "min_tokens", "min_tokens must be an integer in [0, 4294967295], got -1."),
        bad(c, json!({"prompt": "x", "min_tokens": 9, "max_tokens": 3}), "min_tokens", "min_tokens must be less than or equal to max_tokens=3, got 9."),
        bad(c, json!({"prompt": "x", "presence_penalty": 3}), "presence_penalty", "presence_penalty must be in [-2, 2], got 3."),
        bad(c, json!({"prompt": "x", "frequency_penalty": -2.5}), "frequency_penalty", "frequency_penalty must be in [-2, 2], got -2.5."),
        bad(c, json!({"prompt": "x", "repetition_penalty": 0}), "repetition_penalty", "repetition_penalty must be greater than zero, got 0."),
        bad(c, json!({"prompt": "x", "logit_bias": {"abc": 1}}), "logit_bias", "logit_bias keys must be token ids, got \"abc\"."),
        bad(c, json!({"prompt": "x", "logit_bias": {"5": "x"}}), "logit_bias", "logit_bias[\"5\"] must be a number in [-100, 100], got a string \"x\"."),
        bad(c, json!({"prompt": "x", "logit_bias": {"600": 1}}), "logit_bias", "token_id 600 in logit_bias contains out-of-vocab token id. Vocabulary size: 512"),
        bad(c, json!({"prompt": "x", "logit_bias": [1]}), "logit_bias", "logit_bias must be an object, got an array [1]."),
        bad(c, json!({"prompt": "x", "priority": "high"}), "priority", "priority must be an integer in [-2147483648, 2147483647], got a string \"high\"."),
        bad(c, json!({"prompt": "x", "max_tokens": -1}), "max_tokens", "max_tokens must be an integer in [1, 32767] (the context length less a one-token prompt), got -1."),
        bad(c, json!({"prompt": "x", "max_tokens": "ten"}), "max_tokens", "max_tokens must be an integer in [1, 32767] (the context length less a one-token prompt), got a string \"ten\"."),
        bad(c, json!({"prompt": "x", "max_tokens": 32768}), "max_tokens", "got 32768."),
        bad(c, json!({"prompt": "x", "logprobs": 21}), "logprobs", "logprobs must be an integer in [0, 20], got 21."),
        bad(c, json!({"prompt": "x", "logprobs": -1}), "logprobs", "logprobs must be an integer in [0, 20], got -1."),
        bad(c, json!({"prompt": "x", "echo": 1}), "echo", "echo must be true or false, got 1."),
        bad(c, json!({"prompt": "x", "stream": "true"}), "stream", "stream must be true or false, got a string \"true\"."),
        bad(c, json!({"prompt": "x", "stream_options": {"include_usage": true}}), "stream_options", "Stream options can only be defined when `stream=True`."),
        bad(c, json!({"prompt": "x", "stream": true, "stream_options": {"include_usage": "yes"}}), "stream_options", "stream_options.include_usage must be true or false, got a string \"yes\"."),
        bad(c, json!({"prompt": "x", "best_of": 2}), "best_of", "best_of is not supported (only best_of == n), got best_of=2 with n=1."),
        bad(c, json!({"prompt": "x", "suffix": "y"}), "suffix", "suffix is not supported."),
        bad(c, json!({"prompt": "x", "model": 5}), "model", "model must be a string, got 5."),
        // Prompts: missing, empty, out of the vocabulary, of the wrong shape, too long.
        bad(c, json!({"max_tokens": 2}), "prompt", "prompt is required: a string, a list of strings, a list of token ids or a list of lists of token ids."),
        bad(c, json!({"prompt": ""}), "prompt", "The prompt must not be empty"),
        bad(c, json!({"prompt": []}), "prompt", "The prompt must not be empty, got []."),
        bad(c, json!({"prompt": [-1]}), "prompt", "prompt[0] must be a token id in [0, 511] (the vocabulary has 512 tokens), got -1."),
        bad(c, json!({"prompt": [1, 512]}), "prompt", "prompt[1] must be a token id in [0, 511] (the vocabulary has 512 tokens), got 512."),
        bad(c, json!({"prompt": [1, "a"]}), "prompt", "prompt[1] must be a token id in [0, 511] (the vocabulary has 512 tokens), got a string \"a\"."),
        bad(c, json!({"prompt": [[1], [600]]}), "prompt", "prompt[1][0] must be a token id in [0, 511] (the vocabulary has 512 tokens), got 600."),
        bad(c, json!({"prompt": ["a", 1]}), "prompt", "prompt[1] must be a string, as prompt[0] is, got 1."),
        bad(c, json!({"prompt": {"a": 1}}), "prompt", "got an object {\"a\":1}."),
        bad(c, json!({"prompt": [true]}), "prompt", "prompt[0] is true."),
        bad(c, json!({"prompt": vec![97; 40000]}), "prompt", "This model's maximum context length is 32768 tokens. However, your request has 40000 input tokens."),
        bad(c, json!({"prompt": vec![97; 30000], "max_tokens": 5000}), "max_tokens", "However, you requested 35000 tokens (30000 in the messages, 5000 in the completion)."),
        bad(c, json!({"prompt": vec!["a"; 33], "n": 2}), "prompt", "The request asks for 66 sequences (33 prompts × n=2), but one request may ask for at most 64 (--max-num-seqs)."),
        // Chat messages and fields.
        bad(chat, json!({"max_tokens": 2}), "messages", "messages is required: a list of message objects."),
        bad(chat, json!({"messages": "hello"}), "messages", "messages must be a list of message objects."),
        bad(chat, json!({"messages": []}), "messages", "messages must not be empty."),
        bad(chat, json!({"messages": [1]}), "messages", "messages[0] must be an object."),
        bad(chat, json!({"messages": [{"content": "x"}]}), "messages", "messages[0] needs a string `role`."),
        bad(chat, json!({"messages": [{"role": "wizard", "content": "x"}]}), "messages", "messages[0].role `wizard` is not one of"),
        bad(chat, json!({"messages": [{"role": "user", "content": 5}]}), "messages", "messages[0].content must be a string or a list of content parts."),
        bad(chat, json!({"messages": user, "logprobs": true, "top_logprobs": 21}), "top_logprobs", "top_logprobs must be an integer in [0, 20], got 21."),
        bad(chat, json!({"messages": user, "top_logprobs": 2}), "top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true."),
        bad(chat, json!({"messages": user, "max_completion_tokens": 0}), "max_completion_tokens", "max_completion_tokens must be an integer in [1, 32767]"),
        bad(chat, json!({"messages": user, "n": 65}), "n", "n must be an integer in [1, 64] (--max-num-seqs), got 65."),
        bad(chat, json!({"messages": user, "logprobs": "yes"}), "logprobs", "logprobs must be true or false, got a string \"yes\"."),
        bad(chat, json!({"messages": user, "chat_template_kwargs": 3}), "chat_template_kwargs", "chat_template_kwargs must be an object, got 3."),
        // /tokenize and /detokenize.
        bad("/tokenize", json!({}), "prompt", "prompt is required: the text to tokenize."),
        bad("/tokenize", json!({"prompt": 5}), "prompt", "prompt must be a string, got 5."),
        bad("/tokenize", json!({"prompt": "x", "add_special_tokens": "no"}), "add_special_tokens", "add_special_tokens must be true or false, got a string \"no\"."),
        bad("/tokenize", json!({"prompt": "x", "messages": []}), "messages", "Unsupported field `messages`"),
        bad("/detokenize", json!({"tokens": [600]}), "tokens", "tokens[0] must be a token id in [0, 511] (the vocabulary has 512 tokens), got 600."),
        bad("/detokenize", json!({"tokens": [-1]}), "tokens", "got -1."),
        bad("/detokenize", json!({"tokens": "abc"}), "tokens", "tokens must be a list of token ids, got a string \"abc\"."),
        bad("/detokenize", json!({}), "tokens", "tokens is required: a list of token ids."),
    ];
    assert!(cases.len() >= 50);
    for case in &cases {
        let (status, err) = raw(
            &server,
            reqwest::Method::POST,
            case.path,
            Some("application/json"),
            case.body.clone(),
            key,
        )
        .await;
        let shown = String::from_utf8_lossy(&case.body)
            .chars()
            .take(120)
            .collect::<String>();
        assert_eq!(status, case.status, "{} {shown} → {err}", case.path);
        assert_eq!(
            err["error"]["param"].as_str(),
            case.param,
            "{} {shown} → {err}",
            case.path
        );
        assert_eq!(err["error"]["code"], case.status, "{err}");
        assert!(err["error"]["type"].is_string(), "{err}");
        let message = err["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(case.message),
            "{} {shown}: expected {:?} in {err}",
            case.path,
            case.message
        );
        assert!(
            !message.contains("expected u32") && !message.contains("invalid type"),
            "serde's wording: {message}"
        );
    }

    // The router, the content type, the size limit and the key: the same shape.
    let get = reqwest::Method::GET;
    let post = reqwest::Method::POST;
    let x = || json!({"prompt": "x"}).to_string().into_bytes();
    let big = format!("{{\"prompt\": \"{}\"}}", "x".repeat(9 << 20)).into_bytes();
    let others: Vec<RawCase> = vec![
        (
            get.clone(),
            "/v1/nothing",
            None,
            vec![],
            key,
            404,
            "there is no endpoint at `/v1/nothing`",
        ),
        (
            get.clone(),
            "/nothing",
            None,
            vec![],
            None,
            404,
            "there is no endpoint at `/nothing`",
        ),
        (
            get.clone(),
            c,
            None,
            vec![],
            key,
            405,
            "`/v1/completions` does not answer GET",
        ),
        (
            reqwest::Method::DELETE,
            "/health",
            None,
            vec![],
            None,
            405,
            "`/health` does not answer DELETE",
        ),
        (
            post.clone(),
            c,
            Some("text/plain"),
            x(),
            key,
            415,
            "Content-Type must be application/json, got `text/plain`.",
        ),
        (
            post.clone(),
            "/tokenize",
            Some("application/x-www-form-urlencoded"),
            b"prompt=x".to_vec(),
            None,
            415,
            "Content-Type must be application/json",
        ),
        (
            post.clone(),
            c,
            Some("application/json"),
            big,
            key,
            413,
            "The request body is larger than the limit of 8388608 bytes (8 MiB).",
        ),
        (
            post.clone(),
            c,
            Some("application/json"),
            x(),
            None,
            401,
            "missing or invalid API key",
        ),
        (
            post.clone(),
            c,
            Some("application/json"),
            x(),
            Some("wrong"),
            401,
            "missing or invalid API key",
        ),
    ];
    for (method, path, ct, body, key, status, message) in others {
        let (got, err) = raw(&server, method.clone(), path, ct, body, key).await;
        assert_eq!(got, status, "{method} {path} → {err}");
        assert_eq!(err["error"]["code"], status, "{err}");
        assert!(err["error"]["param"].is_null(), "{err}");
        assert!(err["error"]["type"].is_string(), "{err}");
        let text = err["error"]["message"].as_str().unwrap_or_default();
        assert!(
            text.contains(message),
            "{method} {path}: expected {message:?} in {err}"
        );
    }

    let (status, body) = raw(
        &server,
        post,
        c,
        None,
        json!({"prompt": "still serving", "max_tokens": 2})
            .to_string()
            .into_bytes(),
        key,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 2);
}

/// --max-num-queued-reqs bounds the engine requests in flight (prompts × n each): a request
/// that would go over gets a 503 in OpenAI's shape with Retry-After, at once; one that
/// fits is served; when the others end, the room comes back.
#[tokio::test(flavor = "multi_thread")]
async fn over_max_num_queued_reqs_is_a_503_with_retry_after() {
    let server = Server::start(&["--max-num-queued-reqs", "4"]);
    let client = reqwest::Client::new();
    let hog =
        json!({"prompt": "hog", "n": 3, "max_tokens": 30000, "ignore_eos": true, "stream": true});
    let resp = client
        .post(server.url("/v1/completions"))
        .json(&hog)
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    let mut hog = resp.bytes_stream();
    let drain = tokio::spawn(async move { while hog.next().await.is_some() {} });

    for path in ["/v1/completions", "/v1/chat/completions"] {
        let body = json!({"prompt": "x", "messages": [{"role": "user", "content": "x"}], "n": 2, "max_tokens": 2});
        let mut body = body.as_object().cloned().expect("object");
        body.remove(if path == "/v1/completions" {
            "messages"
        } else {
            "prompt"
        });
        let asked = Instant::now();
        let resp = client
            .post(server.url(path))
            .json(&body)
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), 503, "{path}");
        assert_eq!(
            resp.headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok()),
            Some("1"),
            "{path}"
        );
        let err: Value = resp.json().await.expect("json");
        assert_eq!(err["error"]["code"], 503, "{err}");
        assert_eq!(err["error"]["type"], "ServiceUnavailableError", "{err}");
        let message = err["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("3 requests are in flight and this one needs 2 more, but at most 4 may be (--max-num-queued-reqs)"),
            "{err}"
        );
        assert!(asked.elapsed() < Duration::from_secs(1), "refused at once");
    }
    assert_eq!(
        common::http_status(&server.url("/health")),
        Ok(200),
        "a full queue is not an unhealthy server"
    );
    completion(&server, json!({"prompt": "fits", "max_tokens": 2})).await;
    drain.abort();
    wait_idle(&server, Duration::from_secs(10)).await;
    completion(
        &server,
        json!({"prompt": "room again", "n": 4, "max_tokens": 2}),
    )
    .await;
}

/// 200 streaming clients that go away at random moments (before their request is admitted,
/// mid-prefill of a long prompt, mid-stream, or not at all): every abort reaches the
/// engine, which holds nothing a second after the last client left.
#[tokio::test(flavor = "multi_thread")]
async fn clients_that_disconnect_at_random_moments_free_everything() {
    use rand::{Rng, SeedableRng};
    let server = Server::start(&[]);
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    let clients: Vec<_> = (0..200u32)
        .map(|i| {
            let prompt_len = if i % 4 == 0 {
                rng.random_range(2000..6000)
            } else {
                rng.random_range(1..50)
            };
            let prompt: Vec<u32> = (0..prompt_len).map(|t| 97 + (t * 7 + i) % 26).collect();
            let quit_after = Duration::from_millis(rng.random_range(0..1500));
            let body = json!({"prompt": prompt, "max_tokens": rng.random_range(1..3000),
                              "ignore_eos": true, "stream": true});
            let url = server.url("/v1/completions");
            async move {
                let _ = tokio::time::timeout(quit_after, async move {
                    let resp = reqwest::Client::new().post(url).json(&body).send().await?;
                    let mut chunks = resp.bytes_stream();
                    while let Some(chunk) = chunks.next().await {
                        chunk?;
                    }
                    Ok::<(), reqwest::Error>(())
                })
                .await;
            }
        })
        .collect();
    futures::future::join_all(clients).await;
    wait_idle(&server, Duration::from_secs(1)).await;
}

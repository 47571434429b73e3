//! The scheduler's promises, end to end over the real processes: prefix caching and
//! preemption change how work is done, never what is generated.

mod common;

use common::{metric, post_json, Server};
use serde_json::json;

/// Greedy completions of `prompts`, all in flight at once, as token ids.
async fn greedy(server: &Server, prompts: &[Vec<u32>], max_tokens: u32) -> Vec<Vec<u32>> {
    let requests = prompts.iter().map(|p| {
        let body = json!({"prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": true, "return_token_ids": true});
        async move { post_json(server, "/v1/completions", &body).await }
    });
    futures::future::join_all(requests)
        .await
        .into_iter()
        .map(|(status, body)| {
            assert_eq!(status, 200, "{body}");
            serde_json::from_value(body["choices"][0]["token_ids"].clone()).expect("token_ids")
        })
        .collect()
}

fn prompts_with_shared_prefix(count: u32, prefix_len: u32) -> Vec<Vec<u32>> {
    let prefix: Vec<u32> = (0..prefix_len).map(|i| 97 + i % 26).collect();
    (0..count)
        .map(|i| prefix.iter().copied().chain([48 + i, 49 + i, 50]).collect())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn prefix_caching_reuses_kv_and_changes_no_output() {
    let prompts = prompts_with_shared_prefix(6, 70);
    let cached = Server::start(&[]);
    // The first request fills the cache; the others, sent after it, can hit it.
    let mut with_cache = greedy(&cached, &prompts[..1], 16).await;
    with_cache.extend(greedy(&cached, &prompts[1..], 16).await);
    let hits = metric(&cached, "vllm:prefix_cache_hits_total").await;
    assert!(
        hits >= 5.0 * 64.0,
        "five requests should each reuse 4 full blocks of the prefix, hits {hits}"
    );

    let uncached = Server::start(&["--no-enable-prefix-caching"]);
    let without_cache = greedy(&uncached, &prompts, 16).await;
    assert_eq!(metric(&uncached, "vllm:prefix_cache_hits_total").await, 0.0);
    assert_eq!(with_cache, without_cache);
}

#[tokio::test(flavor = "multi_thread")]
async fn constant_preemption_changes_no_output() {
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|i| (0..40).map(|j| 65 + (i * 7 + j) % 50).collect())
        .collect();
    // 12 blocks of 16 tokens hold two of these 80-token requests at a time.
    let small = Server::start(&[
        "--num-gpu-blocks-override",
        "12",
        "--no-enable-prefix-caching",
    ]);
    let squeezed = greedy(&small, &prompts, 40).await;
    let preemptions = metric(&small, "vllm:num_preemptions_total").await;
    assert!(preemptions > 0.0, "a pool this small must preempt");

    let large = Server::start(&["--no-enable-prefix-caching"]);
    let roomy = greedy(&large, &prompts, 40).await;
    assert_eq!(metric(&large, "vllm:num_preemptions_total").await, 0.0);
    assert_eq!(squeezed, roomy);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_larger_than_the_pool_is_refused_and_serving_goes_on() {
    let small = Server::start(&["--num-gpu-blocks-override", "4"]);
    let long: Vec<u32> = (0..100).map(|i| 97 + i % 26).collect();
    let (status, body) = post_json(
        &small,
        "/v1/completions",
        &json!({"prompt": long, "max_tokens": 10}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = post_json(
        &small,
        "/v1/completions",
        &json!({"prompt": "ok", "max_tokens": 4}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

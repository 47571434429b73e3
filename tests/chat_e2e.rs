//! End-to-end tests of `POST /v1/chat/completions` over real HTTP against `vllm-rs serve`
//! on the tiny model, whose tokenizer_config.json carries a ChatML chat template.

mod common;

use common::{post_json, sse_events, tiny_model, Server};
use serde_json::{json, Value};

async fn post(server: &Server, body: Value) -> (u16, Value) {
    post_json(server, "/v1/chat/completions", &body).await
}

/// The `data:` payloads of an SSE response, in order; the last one must be `[DONE]`.
async fn post_stream(server: &Server, body: Value) -> Vec<Value> {
    let resp = reqwest::Client::new()
        .post(server.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status().as_u16(), 200);
    let text = resp.text().await.expect("body");
    let data = sse_events(&text);
    assert_eq!(
        data.last().map(String::as_str),
        Some("[DONE]"),
        "stream must end with [DONE]:\n{text}"
    );
    assert_eq!(data.iter().filter(|d| *d == "[DONE]").count(), 1, "{text}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

fn user(content: &str) -> Value {
    json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}])
}

/// Tokens of `text` under the tiny model's tokenizer, with no special tokens added.
fn tokens(text: &str) -> u64 {
    let tok = vllm_frontend::tokenizer::Tokenizer::from_model_dir(tiny_model()).expect("tokenizer");
    tok.encode(text, false).expect("encode").len() as u64
}

/// Prompt tokens of [`user`] rendered by the tiny model's ChatML template.
fn chatml_prompt_tokens(content: &str) -> u64 {
    tokens(&format!(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    ))
}

#[tokio::test(flavor = "multi_thread")]
async fn chat_completion_works() {
    let server = Server::start(&[]);
    let (status, body) = post(
        &server,
        json!({"model": "tiny", "messages": user("Hello"), "max_tokens": 8, "ignore_eos": true,
               "chat_template_kwargs": {"enable_thinking": false}, "user": "someone"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert!(
        body["id"].as_str().unwrap().starts_with("chatcmpl-"),
        "{body}"
    );
    assert_eq!(body["model"], "tiny");
    let choice = &body["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(choice["message"]["content"].is_string(), "{body}");
    assert_eq!(choice["finish_reason"], "length");
    assert!(choice["logprobs"].is_null());
    assert_eq!(body["usage"]["completion_tokens"], 8);
    assert_eq!(
        body["usage"]["prompt_tokens"],
        chatml_prompt_tokens("Hello")
    );
    assert_eq!(
        body["usage"]["total_tokens"],
        chatml_prompt_tokens("Hello") + 8
    );

    // max_completion_tokens wins over max_tokens.
    let (status, body) = post(
        &server,
        json!({"messages": user("Hi"), "max_tokens": 20, "max_completion_tokens": 5, "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 5);

    // Content as a list of text parts, and no generation prompt.
    let (status, body) = post(
        &server,
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
               "add_generation_prompt": false, "max_tokens": 2, "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["usage"]["prompt_tokens"],
        tokens("<|im_start|>user\na\nb<|im_end|>\n")
    );

    // n = 2: two choices, one prompt counted once.
    let (status, body) = post(
        &server,
        json!({"messages": user("x"), "n": 2, "max_tokens": 3, "ignore_eos": true, "temperature": 1.0, "seed": 1}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"].as_array().unwrap().len(), 2);
    assert_eq!(body["usage"]["prompt_tokens"], chatml_prompt_tokens("x"));
    assert_eq!(body["usage"]["completion_tokens"], 6);
}

#[tokio::test(flavor = "multi_thread")]
async fn streamed_equals_non_streamed() {
    let server = Server::start(&[]);
    let request = json!({"model": "tiny", "messages": user("Tell me a story"), "temperature": 0.8, "seed": 7,
                         "max_tokens": 24, "ignore_eos": true, "logprobs": true, "top_logprobs": 2});
    let (status, whole) = post(&server, request.clone()).await;
    assert_eq!(status, 200, "{whole}");

    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = post_stream(&server, streamed).await;

    // First the role, then content deltas, one finish_reason, then the usage chunk.
    let first = &chunks[0];
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(
        first["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert!(first["choices"][0]["finish_reason"].is_null());
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]), "{usage_chunk}");
    assert_eq!(usage_chunk["usage"], whole["usage"]);
    let content_chunks = &chunks[1..chunks.len() - 1];
    let mut text = String::new();
    let mut logprobs = Vec::new();
    for (i, chunk) in content_chunks.iter().enumerate() {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["id"], first["id"]);
        let choice = &chunk["choices"][0];
        assert!(choice["delta"].get("role").is_none(), "{chunk}");
        text.push_str(choice["delta"]["content"].as_str().unwrap());
        logprobs.extend(
            choice["logprobs"]["content"]
                .as_array()
                .unwrap()
                .iter()
                .cloned(),
        );
        let last = i + 1 == content_chunks.len();
        assert_eq!(choice["finish_reason"].is_null(), !last, "{chunk}");
    }
    let whole_choice = &whole["choices"][0];
    assert_eq!(text, whole_choice["message"]["content"].as_str().unwrap());
    assert_eq!(
        content_chunks.last().unwrap()["choices"][0]["finish_reason"],
        whole_choice["finish_reason"]
    );
    assert_eq!(Value::Array(logprobs), whole_choice["logprobs"]["content"]);

    // Without include_usage: no usage chunk, the finish chunk is right before [DONE].
    let mut plain = request.clone();
    plain["stream"] = json!(true);
    let chunks = post_stream(&server, plain).await;
    assert!(chunks
        .iter()
        .all(|c| c.get("usage").is_none_or(Value::is_null)));
    assert!(!chunks.last().unwrap()["choices"][0]["finish_reason"].is_null());

    // n = 2 streamed: each choice opens with its role chunk before any content.
    let mut two = request;
    two["n"] = json!(2);
    two["stream"] = json!(true);
    let chunks = post_stream(&server, two).await;
    for (i, chunk) in chunks[..2].iter().enumerate() {
        assert_eq!(chunk["choices"][0]["index"], i);
        assert_eq!(chunk["choices"][0]["delta"]["role"], "assistant");
    }
    let finished: Vec<&Value> = chunks
        .iter()
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .collect();
    assert_eq!(finished.len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn logprobs_are_consistent() {
    let server = Server::start(&[]);
    let (status, body) = post(
        &server,
        json!({"messages": user("abc"), "max_tokens": 12, "ignore_eos": true, "temperature": 0.8, "seed": 3,
               "logprobs": true, "top_logprobs": 3}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let content = body["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_eq!(content.len(), 12);
    for entry in content {
        let logprob = entry["logprob"].as_f64().unwrap();
        assert!(logprob <= 0.0, "{entry}");
        let token = entry["token"].as_str().unwrap();
        let bytes: Vec<u8> = serde_json::from_value(entry["bytes"].clone()).unwrap();
        assert_eq!(bytes, token.as_bytes());
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{entry}");
        assert!(
            top.iter()
                .any(|t| t["token"] == entry["token"] && t["logprob"] == entry["logprob"]),
            "{entry}"
        );
        assert!(top.iter().all(|t| t["logprob"].as_f64().unwrap() <= 0.0));
        // After the sampled token, the alternatives come best first.
        let rest: Vec<f64> = top[1..]
            .iter()
            .map(|t| t["logprob"].as_f64().unwrap())
            .collect();
        assert!(rest.windows(2).all(|w| w[0] >= w[1]), "{entry}");
    }

    // Greedy: the sampled token is the most likely one.
    let (status, body) = post(
        &server,
        json!({"messages": user("abc"), "max_tokens": 6, "ignore_eos": true, "temperature": 0.0,
               "logprobs": true, "top_logprobs": 2}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    for entry in body["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
    {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top[0]["token"], entry["token"]);
        assert!(
            top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64(),
            "{entry}"
        );
    }

    // logprobs without top_logprobs: entries with empty top lists.
    let (status, body) = post(
        &server,
        json!({"messages": user("abc"), "max_tokens": 3, "ignore_eos": true, "logprobs": true}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let content = body["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_eq!(content.len(), 3);
    assert!(content.iter().all(|e| e["top_logprobs"] == json!([])));
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_requests_are_400() {
    let server = Server::start(&[]);
    let cases = [
        (
            json!({"messages": user("x"), "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            json!({"messages": user("x"), "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            "messages",
        ),
        (json!({"messages": [{"content": "x"}]}), "messages"),
        (json!({"messages": "hello"}), "messages"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
            "messages",
        ),
        (json!({"messages": user("x"), "echo": true}), "echo"),
        (json!({"messages": user("x"), "tools": []}), "tools"),
        (
            json!({"messages": user("x"), "stream_options": {"include_usage": true}}),
            "stream_options",
        ),
        (
            json!({"messages": user("x"), "continue_final_message": true}),
            "continue_final_message",
        ),
        (
            json!({"messages": user("x"), "chat_template_kwargs": {"messages": []}}),
            "chat_template_kwargs",
        ),
        (
            json!({"messages": user("x"), "max_completion_tokens": 100000}),
            "max_completion_tokens",
        ),
    ];
    for (request, param) in cases {
        let (status, body) = post(&server, request.clone()).await;
        assert_eq!(status, 400, "{request} -> {body}");
        assert_eq!(body["error"]["param"], param, "{request} -> {body}");
        assert_eq!(body["error"]["type"], "BadRequestError");
    }
    let (status, body) = post(&server, json!({"model": "nope", "messages": user("x")})).await;
    assert_eq!(status, 404, "{body}");
    let (status, body) = post(&server, json!({"model": "tiny"})).await;
    assert_eq!(status, 400, "{body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn chat_template_flag_overrides_the_models() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("plain.jinja");
    std::fs::write(
        &file,
        "{% for m in messages %}{{ m.content }}{% if greeting is defined %}{{ greeting }}{% endif %}{% endfor %}",
    )
    .unwrap();
    let server = Server::start(&["--chat-template", file.to_str().unwrap()]);
    let (status, body) = post(
        &server,
        json!({"messages": [{"role": "user", "content": "abcd"}], "max_tokens": 2, "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], tokens("abcd"));
    let (status, body) = post(
        &server,
        json!({"messages": [{"role": "user", "content": "abcd"}], "max_tokens": 2, "ignore_eos": true,
               "chat_template_kwargs": {"greeting": "!!"}}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], tokens("abcd!!"));
}

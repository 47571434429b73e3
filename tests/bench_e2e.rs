//! `vllm-rs bench throughput` and `vllm-rs bench latency` end to end on the CPU backend
//! with the tiny model: the figures they print and write, and their dataset errors.

mod common;

use std::process::{Command, Output};

use common::{exe, tiny_model};

fn bench(args: &[&str]) -> Output {
    Command::new(exe())
        .arg("bench")
        .args(args)
        .arg("--model")
        .arg(tiny_model())
        .args(["--device", "cpu"])
        .env("RUST_LOG", "warn")
        .output()
        .expect("run vllm-rs bench")
}

fn stdout_of(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The number after `label` on its line of `text`.
fn figure(text: &str, label: &str) -> f64 {
    let line = text
        .lines()
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no {label:?} in:\n{text}"));
    line[label.len()..]
        .split_whitespace()
        .next()
        .and_then(|v| v.trim_end_matches(',').parse().ok())
        .unwrap_or_else(|| panic!("no number in {line:?}"))
}

#[test]
fn throughput_runs_a_dataset_and_counts_every_token() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rows = [
        r#"{"prompt_token_ids": [1, 2, 3, 4, 5], "max_tokens": 3}"#,
        r#"{"prompt_token_ids": [10, 20, 30], "max_tokens": 5}"#,
        r#"{"prompt": "Hello world, a text prompt", "output_len": 2}"#,
        "",
        r#"{"prompt_token_ids": [7, 8, 9, 10, 11, 12, 13, 14], "max_tokens": 4, "extra": 1}"#,
        r#"{"prompt_token_ids": [100], "max_tokens": 1}"#,
        r#"{"prompt": "Another one", "max_tokens": 6}"#,
    ];
    let max_tokens_sum = 3 + 5 + 2 + 4 + 1 + 6;
    let data = dir.path().join("data.jsonl");
    std::fs::write(&data, rows.join("\n")).expect("write dataset");
    let json_path = dir.path().join("out.json");
    let out = bench(&[
        "throughput",
        "--dataset",
        data.to_str().unwrap(),
        "--temperature",
        "0.6",
        "--ignore-eos",
        "--output-json",
        json_path.to_str().unwrap(),
    ]);
    let text = stdout_of(&out);
    assert!(text.contains("requests/s"), "{text}");
    assert!(text.contains("total tokens/s"), "{text}");
    assert!(text.contains("output tokens/s"), "{text}");
    assert!(figure(&text, "Throughput:") > 0.0, "{text}");
    assert_eq!(figure(&text, "Total num requests:"), 6.0, "{text}");
    assert_eq!(
        figure(&text, "Total num output tokens:"),
        max_tokens_sum as f64,
        "{text}"
    );
    assert!(
        figure(&text, "Total num prompt tokens:") >= 17.0 + 2.0,
        "{text}"
    );
    assert!(figure(&text, "Elapsed time:") > 0.0, "{text}");
    assert!(
        text.contains("all 6 request(s) generated their full max_tokens"),
        "{text}"
    );

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).expect("read json"))
            .expect("json");
    assert_eq!(json["num_requests"], 6);
    assert_eq!(json["total_output_tokens"], max_tokens_sum);
    assert_eq!(
        json["total_num_tokens"].as_u64().unwrap(),
        json["total_prompt_tokens"].as_u64().unwrap() + max_tokens_sum
    );
    assert_eq!(json["all_full_max_tokens"], true);
    assert_eq!(json["requests_with_full_max_tokens"], 6);
    let elapsed = json["elapsed_time"].as_f64().unwrap();
    assert!(elapsed > 0.0);
    let rps = json["requests_per_second"].as_f64().unwrap();
    assert!((rps - 6.0 / elapsed).abs() <= 1e-6 * rps, "{json}");
    let ops = json["output_tokens_per_second"].as_f64().unwrap();
    assert!((ops - max_tokens_sum as f64 / elapsed).abs() <= 1e-6 * ops);
    assert!(json["tokens_per_second"].as_f64().unwrap() > ops);
}

#[test]
fn throughput_takes_the_first_num_prompts_of_random_prompts() {
    let out = bench(&[
        "throughput",
        "--input-len",
        "6",
        "--output-len",
        "3",
        "--num-prompts",
        "4",
        "--ignore-eos",
        "--detokenize",
    ]);
    let text = stdout_of(&out);
    assert_eq!(figure(&text, "Total num requests:"), 4.0, "{text}");
    assert_eq!(figure(&text, "Total num prompt tokens:"), 24.0, "{text}");
    assert_eq!(figure(&text, "Total num output tokens:"), 12.0, "{text}");
}

#[test]
fn latency_prints_its_figures() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json_path = dir.path().join("lat.json");
    let out = bench(&[
        "latency",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--num-iters",
        "2",
        "--num-iters-warmup",
        "1",
        "--output-json",
        json_path.to_str().unwrap(),
    ]);
    let text = stdout_of(&out);
    for label in [
        "Avg latency:",
        "P50 latency:",
        "P90 latency:",
        "P99 latency:",
        "Mean TTFT:",
        "Mean TPOT:",
        "P50 TPOT:",
    ] {
        let v = figure(&text, label);
        assert!(v.is_finite() && v >= 0.0, "{label} {v}\n{text}");
    }
    assert!(figure(&text, "Avg latency:") > 0.0, "{text}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).expect("read json"))
            .expect("json");
    assert_eq!(
        json["latencies"].as_array().map(Vec::len),
        Some(2),
        "{json}"
    );
    assert!(json["mean_ttft_ms"].as_f64().unwrap() > 0.0, "{json}");
    assert!(json["mean_tpot_ms"].as_f64().unwrap() > 0.0, "{json}");
}

#[test]
fn a_malformed_dataset_line_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("bad.jsonl");
    std::fs::write(
        &data,
        "{\"prompt_token_ids\": [1, 2], \"max_tokens\": 2}\n\
         {\"prompt_token_ids\": [1, 2], \"max_tokens\": 2}\n\
         {\"prompt_token_ids\": [1, 2], \"max_tokens\": \n",
    )
    .expect("write");
    let out = bench(&["throughput", "--dataset", data.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("line 3"), "{stderr}");
    assert!(stderr.contains("bad.jsonl"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    let out = bench(&["throughput", "--dataset", "/no/such/dataset.jsonl"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/no/such/dataset.jsonl"), "{stderr}");
}

#[test]
fn a_prompt_beyond_the_context_length_is_an_error_naming_its_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("long.jsonl");
    let long: Vec<u32> = (1..=40).collect();
    std::fs::write(
        &data,
        format!(
            "{{\"prompt_token_ids\": [1, 2], \"max_tokens\": 2}}\n\
             {{\"prompt_token_ids\": {long:?}, \"max_tokens\": 2}}\n"
        ),
    )
    .expect("write");
    let out = bench(&[
        "throughput",
        "--dataset",
        data.to_str().unwrap(),
        "--max-model-len",
        "32",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("line 2"), "{stderr}");
    assert!(stderr.contains("context length"), "{stderr}");
}

fn bench_serve(args: &[&str]) -> Output {
    Command::new(exe())
        .args(["bench", "serve"])
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run vllm-rs bench serve")
}

#[test]
fn serve_bench_reports_every_request_of_a_poisson_load() {
    let server = common::Server::start(&["--device", "cpu"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let result = dir.path().join("result.json");
    let port = server.base.rsplit(':').next().expect("port").to_string();
    let model = tiny_model().to_str().expect("utf-8 path");
    let out = bench_serve(&[
        "--port",
        &port,
        "--model",
        model,
        "--num-prompts",
        "12",
        "--random-input-len",
        "16",
        "--random-output-len",
        "6",
        "--ignore-eos",
        "--request-rate",
        "40",
        "--max-concurrency",
        "4",
        "--save-result",
        "--result-filename",
        result.to_str().expect("utf-8 path"),
    ]);
    let text = stdout_of(&out);
    assert_eq!(figure(&text, "Successful requests:"), 12.0, "{text}");
    assert_eq!(figure(&text, "Failed requests:"), 0.0, "{text}");
    assert_eq!(figure(&text, "Total input tokens:"), 12.0 * 16.0, "{text}");
    assert_eq!(
        figure(&text, "Total generated tokens:"),
        12.0 * 6.0,
        "{text}"
    );
    for label in [
        "Mean TTFT (ms):",
        "P99 TTFT (ms):",
        "Mean TPOT (ms):",
        "Median ITL (ms):",
    ] {
        assert!(figure(&text, label) > 0.0, "{label} in\n{text}");
    }
    assert!(figure(&text, "Request throughput (req/s):") > 0.0, "{text}");

    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&result).expect("result file"))
            .expect("json");
    assert_eq!(saved["completed"], 12);
    assert_eq!(saved["model_id"], "tiny");
    assert_eq!(saved["request_rate"], 40.0);
    assert_eq!(saved["max_concurrency"], 4);
    let itls = saved["itls"].as_array().expect("itls");
    assert_eq!(itls.len(), 12);
    // Six tokens stream as at most six chunks (the tiny model is fast enough that the
    // server often sends several tokens in one): at most five gaps each.
    assert!(
        itls.iter()
            .all(|l| l.as_array().is_some_and(|l| l.len() <= 5)),
        "{itls:?}"
    );
    assert!(saved["ttfts"]
        .as_array()
        .expect("ttfts")
        .iter()
        .all(|t| t.as_f64() > Some(0.0)));
}

#[test]
fn serve_bench_says_when_no_server_is_there() {
    let port = common::free_port().to_string();
    let out = bench_serve(&[
        "--port",
        &port,
        "--model",
        tiny_model().to_str().expect("utf-8 path"),
        "--num-prompts",
        "2",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "cannot reach the server at http://127.0.0.1:{port}"
        )) && stderr.contains("vllm-rs serve"),
        "{stderr}"
    );
}

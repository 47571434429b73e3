//! `vllm-rs bench serve`: load on a running OpenAI-compatible server over HTTP, with the
//! flags and report of vLLM's `vllm bench serve`. Requests arrive all at once
//! (`--request-rate inf`) or as a Poisson process, at most `--max-concurrency` in flight.
//! Each one streams, and the report gives throughput and TTFT, TPOT and ITL.

mod report;
mod request;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use super::dataset::{self, DatasetPrompt};
use super::{progress_bar, write_json};
use crate::tokenizer::Tokenizer;
pub use report::ServeReport;
use request::{RequestOutcome, RequestSpec};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DatasetName {
    /// `--num-prompts` prompts of `--random-input-len` random token ids.
    Random,
    /// The JSON-lines file of `--dataset-path` (the format `bench throughput` reads).
    Custom,
}

#[derive(Debug, clap::Args)]
pub struct ServeBenchArgs {
    /// The server, e.g. http://localhost:8000 (default: http://HOST:PORT).
    #[arg(long)]
    pub base_url: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    #[arg(long, default_value = "/v1/completions")]
    pub endpoint: String,
    /// The served model's folder or .gguf: its tokenizer draws the random prompts. Requests
    /// name the model the server lists first, unless --served-model-name says otherwise.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The tokenizer's folder, instead of --model's.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// The model name requests carry.
    #[arg(long)]
    pub served_model_name: Option<String>,
    #[arg(long, value_enum, default_value = "random")]
    pub dataset_name: DatasetName,
    /// JSON lines, one request each: {"prompt_token_ids": [...], "max_tokens": N} or
    /// {"prompt": "text", "output_len": N} (with --dataset-name custom).
    #[arg(long, value_name = "FILE")]
    pub dataset_path: Option<PathBuf>,
    #[arg(long, default_value_t = 1024)]
    pub random_input_len: usize,
    /// Output tokens of random prompts, and of dataset rows that give none.
    #[arg(long, default_value_t = 128)]
    pub random_output_len: u32,
    /// Requests to send (a dataset's first N rows).
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: usize,
    /// Requests per second, arriving as a Poisson process; inf sends them all at once.
    #[arg(long, default_value_t = f64::INFINITY)]
    pub request_rate: f64,
    /// Most requests in flight at once (default: no limit).
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Generate every request's full output length.
    #[arg(long)]
    pub ignore_eos: bool,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Seeds the random prompts and the arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the figures and per-request lists as JSON.
    #[arg(long)]
    pub save_result: bool,
    /// The file --save-result writes (default: bench-serve-<unix time>.json).
    #[arg(long)]
    pub result_filename: Option<PathBuf>,
    #[arg(long)]
    pub disable_tqdm: bool,
}

pub async fn run(args: ServeBenchArgs) -> anyhow::Result<i32> {
    if args.request_rate.is_nan() || args.request_rate <= 0.0 {
        bail!(
            "--request-rate must be positive or inf, got {}",
            args.request_rate
        );
    }
    if args.max_concurrency == Some(0) {
        bail!("--max-concurrency must be at least 1");
    }
    let specs = workload(&args)?;
    let base = args
        .base_url
        .clone()
        .unwrap_or_else(|| format!("http://{}:{}", args.host, args.port));
    let base = base.trim_end_matches('/').to_string();
    let client = reqwest::Client::new();
    let model = match &args.served_model_name {
        Some(name) => name.clone(),
        None => first_model(&client, &base).await?,
    };
    let url = format!("{base}{}", args.endpoint);
    println!(
        "bench serve: {} requests to {url} ({model}), request rate {}, max concurrency {}",
        specs.len(),
        args.request_rate,
        args.max_concurrency
            .map_or("none".into(), |n| n.to_string())
    );

    let start = Instant::now();
    let outcomes = dispatch(&args, &client, &url, &model, specs).await;
    let report = ServeReport::new(&outcomes, start.elapsed());
    print!("{}", report.render());
    if args.save_result {
        save(&args, &model, &report, &outcomes)?;
    }
    Ok(if report.completed > 0 { 0 } else { 1 })
}

/// The requests, built before any is sent.
fn workload(args: &ServeBenchArgs) -> anyhow::Result<Vec<RequestSpec>> {
    let spec = |prompt: Value, max_tokens: u32| RequestSpec {
        prompt,
        max_tokens,
        ignore_eos: args.ignore_eos,
        temperature: args.temperature,
    };
    match args.dataset_name {
        DatasetName::Random => {
            let Some(dir) = args.tokenizer.as_ref().or(args.model.as_ref()) else {
                bail!("--dataset-name random draws prompts from the tokenizer: pass --model DIR (or --tokenizer DIR)");
            };
            let tokenizer = Tokenizer::from_model_dir(dir)?;
            let vocab = u32::try_from(tokenizer.vocab_size()).unwrap_or(u32::MAX);
            let requests = dataset::random_requests(
                args.num_prompts,
                args.random_input_len,
                args.random_output_len,
                vocab,
                args.seed,
            );
            Ok(requests
                .into_iter()
                .map(|r| spec(json!(r.prompt_token_ids), r.max_tokens))
                .collect())
        }
        DatasetName::Custom => {
            let Some(path) = &args.dataset_path else {
                bail!("--dataset-name custom needs --dataset-path FILE");
            };
            let rows = dataset::load_dataset(path)?;
            Ok(rows
                .into_iter()
                .take(args.num_prompts)
                .map(|row| {
                    let prompt = match row.prompt {
                        DatasetPrompt::Tokens(ids) => json!(ids),
                        DatasetPrompt::Text(text) => json!(text),
                    };
                    spec(prompt, row.max_tokens.unwrap_or(args.random_output_len))
                })
                .collect())
        }
    }
}

/// The first model `/v1/models` lists; the error when no server answers says so plainly.
async fn first_model(client: &reqwest::Client, base: &str) -> anyhow::Result<String> {
    let url = format!("{base}/v1/models");
    let response = client
        .get(&url)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot reach the server at {base} ({}); is `vllm-rs serve` running there?",
                root_cause(&e)
            )
        })?;
    let status = response.status();
    let body: Value = response
        .json()
        .await
        .with_context(|| format!("GET {url} answered {status} without JSON"))?;
    match body["data"][0]["id"].as_str() {
        Some(id) if status.is_success() => Ok(id.to_string()),
        _ => bail!("GET {url} answered {status} with no model: {body}"),
    }
}

/// The innermost cause of a request error (e.g. "Connection refused (os error 111)").
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = e;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

/// Sends every request on its arrival schedule; returns their outcomes in request order.
async fn dispatch(
    args: &ServeBenchArgs,
    client: &reqwest::Client,
    url: &str,
    model: &str,
    specs: Vec<RequestSpec>,
) -> Vec<RequestOutcome> {
    let bar = progress_bar(specs.len() as u64, "requests");
    if args.disable_tqdm {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let limit = args.max_concurrency.map(|n| Arc::new(Semaphore::new(n)));
    let mut rng = StdRng::seed_from_u64(args.seed ^ 0x0A22_17A1);
    let mut tasks = tokio::task::JoinSet::new();
    for (i, spec) in specs.into_iter().enumerate() {
        if i > 0 && args.request_rate.is_finite() {
            // Exponential gaps: a Poisson process of the requested rate.
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            tokio::time::sleep(Duration::from_secs_f64(-u.ln() / args.request_rate)).await;
        }
        let (client, url, model, bar) = (
            client.clone(),
            url.to_string(),
            model.to_string(),
            bar.clone(),
        );
        let limit = limit.clone();
        tasks.spawn(async move {
            let _permit = match &limit {
                Some(s) => s.clone().acquire_owned().await.ok(),
                None => None,
            };
            let outcome = request::send(&client, &url, &model, &spec).await;
            bar.inc(1);
            (i, outcome)
        });
    }
    let mut outcomes = vec![RequestOutcome::default(); tasks.len()];
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((i, outcome)) => outcomes[i] = outcome,
            Err(e) => tracing::error!("a request task failed: {e}"),
        }
    }
    bar.finish_and_clear();
    outcomes
}

fn save(
    args: &ServeBenchArgs,
    model: &str,
    report: &ServeReport,
    outcomes: &[RequestOutcome],
) -> anyhow::Result<()> {
    let unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let path = args
        .result_filename
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("bench-serve-{unix}.json")));
    let ms = |d: &Duration| d.as_secs_f64() * 1e3;
    let mut v = report.to_json();
    v["date"] = json!(unix);
    v["backend"] = json!("vllm-rs");
    v["model_id"] = json!(model);
    v["num_prompts"] = json!(outcomes.len());
    v["request_rate"] = if args.request_rate.is_finite() {
        json!(args.request_rate)
    } else {
        json!("inf")
    };
    v["max_concurrency"] = json!(args.max_concurrency);
    v["input_lens"] = json!(outcomes.iter().map(|o| o.prompt_len).collect::<Vec<_>>());
    v["output_lens"] = json!(outcomes.iter().map(|o| o.output_tokens).collect::<Vec<_>>());
    v["ttfts"] = json!(outcomes.iter().map(|o| ms(&o.ttft)).collect::<Vec<_>>());
    v["itls"] = json!(outcomes
        .iter()
        .map(|o| o.itl.iter().map(ms).collect::<Vec<_>>())
        .collect::<Vec<_>>());
    v["request_errors"] = json!(outcomes.iter().map(|o| o.error.clone()).collect::<Vec<_>>());
    write_json(&path, &v)?;
    println!("wrote {}", path.display());
    Ok(())
}

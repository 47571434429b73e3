//! `vllm-rs bench latency`: one batch of random prompts at a time, greedy and ignoring eos;
//! end-to-end latency per batch, and per request the time to first token and the time per
//! output token, timed as the outputs arrive in the stream.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde_json::json;
use vllm_protocol::SamplingParams;

use super::dataset::{self, BenchRequest};
use super::{drain, mean, percentile, progress_bar, random_vocab, submit, write_json, Outcome};
use crate::args::EngineArgs;
use crate::async_llm::AsyncLLM;

#[derive(Debug, clap::Args)]
pub struct LatencyArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Prompt tokens of each request (random ids, seeded by --seed).
    #[arg(long, default_value_t = 32)]
    pub input_len: usize,
    /// Output tokens of each request (eos is ignored).
    #[arg(long, default_value_t = 128)]
    pub output_len: u32,
    /// Requests submitted together in each iteration.
    #[arg(long, default_value_t = 1)]
    pub batch_size: usize,
    /// Iterations run first and not counted.
    #[arg(long, default_value_t = 3)]
    pub num_iters_warmup: usize,
    /// Iterations measured.
    #[arg(long, default_value_t = 10)]
    pub num_iters: usize,
    /// Detokenize the outputs as they stream, as a server would (off: token ids only).
    #[arg(long)]
    pub detokenize: bool,
    /// Also write the figures to this file as JSON.
    #[arg(long, value_name = "FILE")]
    pub output_json: Option<PathBuf>,
}

pub async fn run(args: LatencyArgs) -> anyhow::Result<i32> {
    if args.input_len == 0 || args.output_len == 0 {
        bail!("--input-len and --output-len must be at least 1");
    }
    if args.batch_size == 0 || args.num_iters == 0 {
        bail!("--batch-size and --num-iters must be at least 1");
    }
    let llm = AsyncLLM::start(&args.engine).await?;
    let result = bench(&llm, &args).await;
    llm.shutdown().await;
    result.map(|()| 0)
}

async fn bench(llm: &AsyncLLM, args: &LatencyArgs) -> anyhow::Result<()> {
    let vocab_size = llm.client.ready.model.vocab_size;
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: args.output_len,
        ignore_eos: true,
        ..Default::default()
    };
    params.validate(vocab_size)?;
    let shape = BenchRequest {
        origin: "--input-len plus --output-len".into(),
        prompt_token_ids: vec![0; args.input_len],
        max_tokens: args.output_len,
    };
    dataset::check_requests(&[shape], vocab_size, llm.max_model_len())?;
    // Fresh prompts every iteration, so that prefix caching cannot skip the prefill.
    let mut rng = StdRng::seed_from_u64(args.engine.seed);
    let prompt_vocab = random_vocab(llm);
    let mut next_batch = || -> Vec<BenchRequest> {
        (0..args.batch_size)
            .map(|i| BenchRequest {
                origin: format!("random prompt {i}"),
                prompt_token_ids: dataset::random_token_ids(&mut rng, args.input_len, prompt_vocab),
                max_tokens: args.output_len,
            })
            .collect()
    };

    let total = args.num_iters_warmup + args.num_iters;
    let bar = progress_bar(total as u64, "iterations");
    let mut latencies = Vec::with_capacity(args.num_iters);
    let mut ttfts = Vec::new();
    let mut tpots = Vec::new();
    let mut short = 0usize;
    for iter in 0..total {
        let warmup = iter < args.num_iters_warmup;
        let batch = next_batch();
        let (latency, outcomes) = match run_batch(llm, &batch, &params, iter, args.detokenize).await
        {
            Ok(r) => r,
            Err(e) => {
                bar.abandon();
                return Err(e);
            }
        };
        bar.inc(1);
        if warmup {
            continue;
        }
        latencies.push(latency);
        for o in &outcomes {
            ttfts.extend(o.ttft_s());
            tpots.extend(o.tpot_s());
            short += usize::from(o.num_output_tokens != args.output_len as usize);
        }
    }
    bar.finish_and_clear();
    if short > 0 {
        tracing::warn!(
            "{short} measured requests generated fewer than --output-len {} tokens",
            args.output_len
        );
    }

    let ms = |s: Option<f64>| s.unwrap_or(f64::NAN) * 1000.0;
    let avg = mean(&latencies);
    let p = |q: f64| percentile(&latencies, q);
    println!(
        "Latency of {} iterations (batch size {}, {} prompt tokens, {} output tokens):",
        args.num_iters, args.batch_size, args.input_len, args.output_len
    );
    println!("Avg latency: {:.2} ms", ms(avg));
    println!("P50 latency: {:.2} ms", ms(p(50.0)));
    println!("P90 latency: {:.2} ms", ms(p(90.0)));
    println!("P99 latency: {:.2} ms", ms(p(99.0)));
    println!("Mean TTFT: {:.2} ms", ms(mean(&ttfts)));
    println!("Mean TPOT: {:.2} ms", ms(mean(&tpots)));
    println!("P50 TPOT: {:.2} ms", ms(percentile(&tpots, 50.0)));

    if let Some(path) = &args.output_json {
        let percentiles: serde_json::Map<String, serde_json::Value> = [10, 25, 50, 75, 90, 99]
            .iter()
            .map(|&q| (q.to_string(), json!(p(q as f64))))
            .collect();
        write_json(
            path,
            &json!({
                "avg_latency": avg,
                "latencies": latencies,
                "percentiles": percentiles,
                "avg_latency_ms": avg.map(|v| v * 1000.0),
                "p50_latency_ms": p(50.0).map(|v| v * 1000.0),
                "p90_latency_ms": p(90.0).map(|v| v * 1000.0),
                "p99_latency_ms": p(99.0).map(|v| v * 1000.0),
                "mean_ttft_ms": mean(&ttfts).map(|v| v * 1000.0),
                "mean_tpot_ms": mean(&tpots).map(|v| v * 1000.0),
                "p50_tpot_ms": percentile(&tpots, 50.0).map(|v| v * 1000.0),
                "input_len": args.input_len,
                "output_len": args.output_len,
                "batch_size": args.batch_size,
                "num_iters": args.num_iters,
                "num_iters_warmup": args.num_iters_warmup,
                "detokenize": args.detokenize,
            }),
        )?;
    }
    Ok(())
}

/// Submits one batch at once and waits for all of it: (seconds from the submission to the
/// last finish, each request's timings).
async fn run_batch(
    llm: &AsyncLLM,
    batch: &[BenchRequest],
    params: &SamplingParams,
    iter: usize,
    detokenize: bool,
) -> anyhow::Result<(f64, Vec<Outcome>)> {
    let start = Instant::now();
    let mut drains = Vec::with_capacity(batch.len());
    for (i, r) in batch.iter().enumerate() {
        let id = format!("latency-{iter}-{i}");
        let stream = submit(
            llm,
            id.clone(),
            r.prompt_token_ids.clone(),
            params.clone(),
            detokenize,
        )
        .with_context(|| format!("{}: cannot submit", r.origin))?;
        drains.push(drain(id, stream, start));
    }
    let outcomes = futures::future::try_join_all(drains).await?;
    let end = outcomes.iter().map(|o| o.finished).max().unwrap_or(start);
    Ok(((end - start).as_secs_f64(), outcomes))
}

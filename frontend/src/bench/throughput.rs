//! `vllm-rs bench throughput`: every request of a workload submitted at once to the
//! in-process engine; the clock runs from the first submission to the last finish.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::json;
use vllm_protocol::SamplingParams;

use super::dataset::{self, DatasetRow};
use super::{drain, progress_bar, random_vocab, submit, write_json};
use crate::args::{EngineArgs, SamplingFlags};
use crate::async_llm::AsyncLLM;

/// Random prompts when --dataset is absent and --num-prompts is not given (vLLM's default).
const DEFAULT_RANDOM_PROMPTS: usize = 1000;

#[derive(Debug, clap::Args)]
pub struct ThroughputArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// JSON-lines workload, one request per line: {"prompt_token_ids": [...], "max_tokens": N}
    /// or {"prompt": "text", "output_len": N}. Without it: random prompts (--input-len,
    /// --output-len), seeded by --seed.
    #[arg(long, value_name = "FILE")]
    pub dataset: Option<PathBuf>,
    /// Prompt tokens of each random request (without --dataset).
    #[arg(long, conflicts_with = "dataset")]
    pub input_len: Option<usize>,
    /// Output tokens of every request: replaces the dataset's own; required without --dataset.
    #[arg(long, visible_alias = "output-len")]
    pub max_tokens: Option<u32>,
    /// Requests to run: the dataset's first N rows (default: all), or N random prompts
    /// (default: 1000).
    #[arg(long)]
    pub num_prompts: Option<usize>,
    #[command(flatten)]
    pub sampling: SamplingFlags,
    /// Detokenize the outputs as they stream, as a server would (off: token ids only).
    #[arg(long)]
    pub detokenize: bool,
    /// Also write the figures to this file as JSON.
    #[arg(long, value_name = "FILE")]
    pub output_json: Option<PathBuf>,
}

/// Where the requests come from, settled before the engine starts.
enum Workload {
    Dataset(Vec<DatasetRow>),
    Random {
        num: usize,
        input_len: usize,
        output_len: u32,
    },
}

pub async fn run(args: ThroughputArgs) -> anyhow::Result<i32> {
    // Bad flags and a bad dataset are reported before the engine is started.
    let workload = workload(&args)?;
    let llm = AsyncLLM::start(&args.engine).await?;
    let result = bench(&llm, &args, workload).await;
    llm.shutdown().await;
    result.map(|()| 0)
}

fn workload(args: &ThroughputArgs) -> anyhow::Result<Workload> {
    if args.num_prompts == Some(0) {
        bail!("--num-prompts must be at least 1");
    }
    if args.max_tokens == Some(0) {
        bail!("--max-tokens must be at least 1");
    }
    if let Some(path) = &args.dataset {
        let mut rows = dataset::load_dataset(path)?;
        if let Some(n) = args.num_prompts {
            rows.truncate(n);
        }
        return Ok(Workload::Dataset(rows));
    }
    let (Some(input_len), Some(output_len)) = (args.input_len, args.max_tokens) else {
        bail!("give --dataset FILE, or --input-len N and --output-len N for random prompts");
    };
    if input_len == 0 {
        bail!("--input-len must be at least 1");
    }
    Ok(Workload::Random {
        num: args.num_prompts.unwrap_or(DEFAULT_RANDOM_PROMPTS),
        input_len,
        output_len,
    })
}

async fn bench(llm: &AsyncLLM, args: &ThroughputArgs, workload: Workload) -> anyhow::Result<()> {
    let vocab_size = llm.client.ready.model.vocab_size;
    let in_dataset = |e: anyhow::Error| match &args.dataset {
        Some(path) => e.context(format!("dataset {}", path.display())),
        None => e,
    };
    let requests = match workload {
        Workload::Dataset(rows) => {
            dataset::to_requests(&rows, &llm.tokenizer, args.max_tokens).map_err(in_dataset)?
        }
        Workload::Random {
            num,
            input_len,
            output_len,
        } => dataset::random_requests(
            num,
            input_len,
            output_len,
            random_vocab(llm),
            args.engine.seed,
        ),
    };
    dataset::check_requests(&requests, vocab_size, llm.max_model_len()).map_err(in_dataset)?;
    let base = args.sampling.params();
    base.validate(vocab_size)?;

    let num_requests = requests.len();
    let total_prompt_tokens: usize = requests.iter().map(|r| r.prompt_token_ids.len()).sum();
    let total_max_tokens: u64 = requests.iter().map(|r| r.max_tokens as u64).sum();
    tracing::info!(
        "benchmarking {num_requests} requests: {total_prompt_tokens} prompt tokens, \
         {total_max_tokens} max output tokens"
    );

    let bar = progress_bar(num_requests as u64, "requests");
    let mut tasks = tokio::task::JoinSet::new();
    let start = Instant::now();
    for (i, r) in requests.iter().enumerate() {
        let id = format!("bench-{i}");
        let params = SamplingParams {
            max_tokens: r.max_tokens,
            ..base.clone()
        };
        let stream = submit(
            llm,
            id.clone(),
            r.prompt_token_ids.clone(),
            params,
            args.detokenize,
        )
        .with_context(|| format!("{}: cannot submit", r.origin))?;
        tasks.spawn(async move { (i, drain(id, stream, start).await) });
    }
    let mut outcomes = vec![None; num_requests];
    while let Some(joined) = tasks.join_next().await {
        let (i, outcome) = joined.context("a benchmark task failed")?;
        let outcome = match outcome {
            Ok(o) => o,
            Err(e) => {
                bar.abandon();
                // Dropping the other tasks aborts their requests.
                return Err(e.context(requests[i].origin.clone()));
            }
        };
        outcomes[i] = Some(outcome);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let outcomes: Vec<_> = outcomes.into_iter().flatten().collect();
    let end = outcomes.iter().map(|o| o.finished).max().unwrap_or(start);
    let elapsed = (end - start).as_secs_f64().max(f64::MIN_POSITIVE);

    let total_output_tokens: usize = outcomes.iter().map(|o| o.num_output_tokens).sum();
    let full = requests
        .iter()
        .zip(&outcomes)
        .filter(|(r, o)| o.num_output_tokens == r.max_tokens as usize)
        .count();
    let total_tokens = total_prompt_tokens + total_output_tokens;
    let figures = Figures {
        elapsed,
        num_requests,
        total_prompt_tokens,
        total_output_tokens,
        full,
    };
    print_figures(&figures, args);
    if let Some(path) = &args.output_json {
        write_json(
            path,
            &json!({
                "elapsed_time": elapsed,
                "num_requests": num_requests,
                "total_num_tokens": total_tokens,
                "total_prompt_tokens": total_prompt_tokens,
                "total_output_tokens": total_output_tokens,
                "requests_per_second": num_requests as f64 / elapsed,
                "tokens_per_second": total_tokens as f64 / elapsed,
                "output_tokens_per_second": total_output_tokens as f64 / elapsed,
                "requests_with_full_max_tokens": full,
                "all_full_max_tokens": full == num_requests,
                "ignore_eos": args.sampling.ignore_eos,
                "detokenize": args.detokenize,
                // Through its shortest decimal, so that 0.6 is written 0.6.
                "temperature": args.sampling.temperature.to_string().parse::<f64>().unwrap_or(f64::NAN),
            }),
        )?;
    }
    Ok(())
}

struct Figures {
    elapsed: f64,
    num_requests: usize,
    total_prompt_tokens: usize,
    total_output_tokens: usize,
    full: usize,
}

fn print_figures(f: &Figures, args: &ThroughputArgs) {
    let total = f.total_prompt_tokens + f.total_output_tokens;
    println!(
        "Throughput: {:.2} requests/s, {:.2} total tokens/s, {:.2} output tokens/s",
        f.num_requests as f64 / f.elapsed,
        total as f64 / f.elapsed,
        f.total_output_tokens as f64 / f.elapsed,
    );
    println!("Elapsed time: {:.3} s", f.elapsed);
    println!("Total num requests: {}", f.num_requests);
    println!("Total num prompt tokens: {}", f.total_prompt_tokens);
    println!("Total num output tokens: {}", f.total_output_tokens);
    let verdict = if f.full == f.num_requests {
        format!(
            "all {} request(s) generated their full max_tokens",
            f.num_requests
        )
    } else {
        format!(
            "{} of {} request(s) generated their full max_tokens",
            f.full, f.num_requests
        )
    };
    println!("Full length: {verdict}");
    if args.sampling.ignore_eos && f.full != f.num_requests {
        tracing::warn!("with --ignore-eos every request should run to its max_tokens: {verdict}");
    }
}

//! `vllm-rs bench throughput` and `vllm-rs bench latency`: offline benchmarks that start
//! the engine in-process (as `generate` does) and submit requests straight to `AsyncLLM`,
//! with no HTTP in between. Like vLLM's `vllm bench throughput|latency`. `bench serve`
//! (`serve/`) is the online one: HTTP load on a running server.

pub mod dataset;
pub mod latency;
pub mod serve;
pub mod throughput;

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Subcommand;
use vllm_protocol::{EngineCoreRequest, FinishReason, SamplingParams};

use crate::async_llm::AsyncLLM;
use crate::engine_client::RequestStream;
use crate::output_processor::{OutputStream, TextOptions};

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: BenchCommand,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Offline throughput: submit every request at once, report requests/s and tokens/s.
    Throughput(throughput::ThroughputArgs),
    /// Latency of one batch: end to end, time to first token, time per output token.
    Latency(latency::LatencyArgs),
    /// Online serving: HTTP load on a running server; throughput, TTFT, TPOT and ITL.
    Serve(serve::ServeBenchArgs),
}

/// Runs a benchmark; returns the exit code.
pub async fn bench(args: BenchArgs) -> anyhow::Result<i32> {
    match args.command {
        BenchCommand::Throughput(a) => throughput::run(a).await,
        BenchCommand::Latency(a) => latency::run(a).await,
        BenchCommand::Serve(a) => serve::run(a).await,
    }
}

/// The outputs of one benchmark request: the engine's raw token stream, or (with
/// `--detokenize`) the frontend's processed stream, which also detokenizes.
enum BenchStream {
    Raw(RequestStream),
    Text(Box<OutputStream>),
}

/// What one streamed output carried, as far as the benchmarks care.
struct Step {
    num_tokens: usize,
    finish_reason: Option<FinishReason>,
    error: Option<String>,
}

impl BenchStream {
    async fn next(&mut self) -> Option<Step> {
        match self {
            BenchStream::Raw(s) => s.next().await.map(|o| Step {
                num_tokens: o.new_token_ids.len(),
                finish_reason: o.finish_reason,
                error: o.error,
            }),
            BenchStream::Text(s) => s.next().await.map(|o| Step {
                num_tokens: o.new_token_ids.len(),
                finish_reason: o.finish_reason,
                error: o.error,
            }),
        }
    }
}

/// Submits one request. Without `detokenize` it goes to the engine-core client directly,
/// as `AsyncLLM::generate` would send it, and only token ids come back.
fn submit(
    llm: &AsyncLLM,
    request_id: String,
    prompt_token_ids: Vec<u32>,
    params: SamplingParams,
    detokenize: bool,
) -> anyhow::Result<BenchStream> {
    if detokenize {
        let text = TextOptions {
            skip_special_tokens: true,
            ..Default::default()
        };
        let stream = llm.generate(request_id, prompt_token_ids, params, text, 0, None)?;
        return Ok(BenchStream::Text(Box::new(stream)));
    }
    let request = EngineCoreRequest {
        request_id,
        prompt_token_ids,
        sampling_params: params,
        eos_token_ids: llm.eos_token_ids.clone(),
        arrival_time: vllm_engine_core::engine_core::now(),
        priority: 0,
        parent_request_id: None,
    };
    Ok(BenchStream::Raw(llm.client.add_request(request)?))
}

/// When one request's outputs arrived.
#[derive(Debug, Clone)]
struct Outcome {
    submitted: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    finished: Instant,
    num_output_tokens: usize,
}

impl Outcome {
    fn ttft_s(&self) -> Option<f64> {
        Some((self.first_token? - self.submitted).as_secs_f64())
    }

    /// (last token time − first token time) / (output tokens − 1).
    fn tpot_s(&self) -> Option<f64> {
        if self.num_output_tokens < 2 {
            return None;
        }
        let span = self.last_token? - self.first_token?;
        Some(span.as_secs_f64() / (self.num_output_tokens - 1) as f64)
    }
}

/// Reads a request's stream to its end, timing each output as it arrives. An error, an
/// abort or a stream that ends unfinished is an error naming the request.
async fn drain(id: String, mut stream: BenchStream, submitted: Instant) -> anyhow::Result<Outcome> {
    let mut outcome = Outcome {
        submitted,
        first_token: None,
        last_token: None,
        finished: submitted,
        num_output_tokens: 0,
    };
    while let Some(step) = stream.next().await {
        let now = Instant::now();
        if let Some(err) = step.error {
            bail!("request {id} failed: {err}");
        }
        if step.num_tokens > 0 {
            outcome.first_token.get_or_insert(now);
            outcome.last_token = Some(now);
            outcome.num_output_tokens += step.num_tokens;
        }
        match step.finish_reason {
            None => {}
            Some(FinishReason::Stop | FinishReason::Length) => {
                outcome.finished = now;
                return Ok(outcome);
            }
            Some(reason) => bail!("request {id} finished with {:?}", reason.as_str()),
        }
    }
    bail!("request {id}: the engine's stream ended before the request finished")
}

/// The `p`-th percentile (0..=100) with linear interpolation between the closest ranks,
/// as `numpy.percentile` computes it. `None` for no values.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = p.clamp(0.0, 100.0) / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64))
}

pub fn mean(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

fn write_json(path: &Path, value: &serde_json::Value) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").with_context(|| format!("cannot write {}", path.display()))
}

/// A progress bar on stderr (drawn only when stderr is a terminal).
fn progress_bar(len: u64, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len);
    let style = indicatif::ProgressStyle::with_template(&format!(
        "{what} {{bar:40}} {{pos}}/{{len}} [{{elapsed_precise}}<{{eta_precise}}]"
    ))
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}

/// Random prompt ids stay inside both the model's and the tokenizer's vocabularies.
fn random_vocab(llm: &AsyncLLM) -> u32 {
    let model = llm.client.ready.model.vocab_size;
    u32::try_from(llm.tokenizer.vocab_size())
        .map(|t| t.min(model))
        .unwrap_or(model)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(4.0));
        assert_eq!(percentile(&v, 50.0), Some(2.5));
        assert!((percentile(&v, 90.0).unwrap() - 3.7).abs() < 1e-12);
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(mean(&v), Some(2.5));
        assert_eq!(mean(&[]), None);
    }

    #[test]
    fn tpot_spans_first_to_last_token() {
        let t0 = Instant::now();
        let ms = std::time::Duration::from_millis;
        let o = Outcome {
            submitted: t0,
            first_token: Some(t0 + ms(10)),
            last_token: Some(t0 + ms(40)),
            finished: t0 + ms(40),
            num_output_tokens: 4,
        };
        assert!((o.ttft_s().unwrap() - 0.010).abs() < 1e-9);
        assert!((o.tpot_s().unwrap() - 0.010).abs() < 1e-9);
        let one = Outcome {
            num_output_tokens: 1,
            ..o
        };
        assert_eq!(one.tpot_s(), None);
    }
}

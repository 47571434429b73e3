//! The command line of the one `vllm-rs` binary: the user-facing commands and the hidden
//! roles (`engine-core`, `worker`) in which the binary starts itself again.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::args::{EngineArgs, SamplingFlags};

#[derive(Debug, Parser)]
#[command(
    name = "vllm-rs",
    version,
    about = "LLM inference and serving with an OpenAI-compatible API"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve a model over the OpenAI-compatible HTTP API.
    Serve(ServeArgs),
    /// Generate a completion for one prompt and print it.
    Generate(GenerateArgs),
    /// Write a random, seeded model folder (weights, config, tokenizer) for tests and benchmarks.
    MakeTinyModel(MakeTinyModelArgs),
    /// Offline benchmarks: `bench throughput`, `bench latency`.
    Bench(crate::bench::BenchArgs),
    /// Compile the CUDA kernels into the kernel cache with NVRTC alone (no GPU needed), so
    /// that a server's first start on that GPU architecture compiles nothing.
    CompileKernels(crate::compile_kernels::CompileKernelsArgs),
    /// The engine-core process (started by `serve` and `generate`).
    #[command(hide = true)]
    EngineCore {
        #[arg(long)]
        config_json: String,
    },
    /// A worker process (started by the engine-core).
    #[command(hide = true)]
    Worker {
        #[arg(long)]
        rank: u32,
        #[arg(long)]
        world_size: u32,
        #[arg(long)]
        run_dir: PathBuf,
        #[arg(long)]
        config_json: String,
    },
}

impl Command {
    /// The engine flags of a command that loads a model (`serve`, `generate`, `bench *`).
    pub fn engine_args_mut(&mut self) -> Option<&mut EngineArgs> {
        use crate::bench::BenchCommand;
        match self {
            Command::Serve(a) => Some(&mut a.engine),
            Command::Generate(a) => Some(&mut a.engine),
            Command::Bench(b) => match &mut b.command {
                BenchCommand::Throughput(a) => Some(&mut a.engine),
                BenchCommand::Latency(a) => Some(&mut a.engine),
                // It loads no model: it talks to a server.
                BenchCommand::Serve(_) => None,
            },
            Command::MakeTinyModel(_)
            | Command::CompileKernels(_)
            | Command::EngineCore { .. }
            | Command::Worker { .. } => None,
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* (also read from VLLM_API_KEY).
    #[arg(long, env = "VLLM_API_KEY")]
    pub api_key: Option<String>,
    /// Seconds the requests in flight may run on after SIGTERM or Ctrl-C (a second signal
    /// ends them at once); meanwhile /health answers 503 and new requests are refused.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0)]
    pub shutdown_timeout: f64,
    /// Most requests in flight (waiting or running; a request's prompts × n count one
    /// each): one that would go over is refused with 503 and Retry-After. Default: no limit.
    #[arg(long, value_name = "N")]
    pub max_num_queued_reqs: Option<usize>,
    /// Log each request's id and sampling parameters (info), and its prompt (debug, with
    /// RUST_LOG=debug). Without it no prompt is ever logged.
    #[arg(long, overrides_with = "disable_log_requests")]
    pub enable_log_requests: bool,
    /// The default; accepted for compatibility with older vLLM command lines.
    #[arg(long, hide = true)]
    pub disable_log_requests: bool,
    /// A Jinja chat template for /v1/chat/completions, replacing the tokenizer's.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[arg(long)]
    pub prompt: String,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    #[command(flatten)]
    pub sampling: SamplingFlags,
    /// Seed of this request's sampling.
    #[arg(long = "sampling-seed")]
    pub sampling_seed: Option<u64>,
}

#[derive(Debug, clap::Args)]
pub struct MakeTinyModelArgs {
    /// Folder to write (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Shape preset: a tiny test model, or a real model's shape with random weights.
    #[arg(long, default_value = "tiny-qwen3",
          value_parser = clap::builder::PossibleValuesParser::new(vllm_fixtures::PRESETS))]
    pub preset: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

//! `EngineArgs`: the engine flags shared by `serve`, `generate` and `bench`, with vLLM's
//! names and defaults, and their translation into the configs each process is started
//! with; and `SamplingFlags`, those the offline commands share. Built once from the
//! command line and passed down; nothing reads flags later.

use std::path::{Path, PathBuf};

use anyhow::bail;
use clap::{Args, ValueEnum};
use vllm_engine_core::config::EngineCoreConfig;
use vllm_engine_core::scheduler::{SchedulerConfig, SchedulingPolicy};
use vllm_worker::config::AttentionBackend;
use vllm_worker::model_path::ModelPath;
use vllm_worker::model_runner::WorkerConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// CUDA when a GPU is present, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

/// vLLM's `--load-format` values this engine reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LoadFormat {
    /// The checkpoint's safetensors.
    Auto,
    /// Load weights in the safetensors format.
    Safetensors,
    /// Random weights, for profiling and benchmarks: needs only config.json and the
    /// tokenizer files.
    Dummy,
}

impl From<LoadFormat> for vllm_worker::config::LoadFormat {
    fn from(f: LoadFormat) -> Self {
        match f {
            LoadFormat::Auto => Self::Auto,
            LoadFormat::Safetensors => Self::Safetensors,
            LoadFormat::Dummy => Self::Dummy,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Policy {
    Fcfs,
    Priority,
}

#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Hugging Face model folder (config.json, *.safetensors, tokenizer.json), or a GGUF
    /// file, or a folder holding one .gguf file and no config.json; or a Hugging Face Hub
    /// id (`Qwen/Qwen3-0.6B`), fetched into the Hugging Face cache (HF_HOME) unless it is
    /// there already.
    #[arg(long)]
    pub model: PathBuf,
    /// Folder of the tokenizer files (tokenizer.json, tokenizer_config.json), or a Hub id,
    /// to use instead of the model's (default: the --model folder, or the GGUF file's own
    /// tokenizer).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// The branch, tag or commit of a --model given as a Hub id.
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// The branch, tag or commit of a --tokenizer given as a Hub id (default: main).
    #[arg(long)]
    pub tokenizer_revision: Option<String>,
    /// Model name(s) the API answers to (default: --model as given: the path or Hub id).
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// The Hub id --model named, once `hub::resolve_model_args` has replaced --model by its
    /// local snapshot folder.
    #[arg(skip)]
    pub model_id: Option<String>,
    /// Number of GPUs (worker processes) the model is split across.
    #[arg(long, short = 't', default_value_t = 1)]
    pub tensor_parallel_size: u32,
    /// Context length (prompt plus output); default: the model's own.
    #[arg(long)]
    pub max_model_len: Option<u32>,
    /// Most sequences in one step (default: 256 on CUDA, 64 on the CPU).
    #[arg(long)]
    pub max_num_seqs: Option<u32>,
    /// Most tokens in one step (default: 8192 on CUDA, 2048 on the CPU).
    #[arg(long)]
    pub max_num_batched_tokens: Option<u32>,
    /// Fraction of GPU memory for weights, activations and the KV cache.
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f32,
    /// KV-cache budget of the CPU backend, in GiB.
    #[arg(long, default_value_t = 2.0)]
    pub cpu_kv_cache_space: f64,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Reuse the KV of shared prompt prefixes (on by default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Split long prompts into chunks mixed with decodes (on by default).
    #[arg(long, overrides_with = "no_enable_chunked_prefill")]
    pub enable_chunked_prefill: bool,
    #[arg(long)]
    pub no_enable_chunked_prefill: bool,
    #[arg(long, value_enum, default_value_t = Policy::Fcfs)]
    pub scheduling_policy: Policy,
    /// Schedule step N+1 while the workers run step N (vLLM's async scheduling): the
    /// engine's scheduling, bookkeeping and IPC leave the critical path; each worker fills
    /// the unknown last token from its own sampler, checked against rank 0's a step later.
    #[arg(long)]
    pub async_scheduling: bool,
    /// Force the number of KV blocks, whatever the memory budget says.
    #[arg(long)]
    pub num_gpu_blocks_override: Option<u32>,
    /// Never capture CUDA graphs: run every decode step op by op (slower at small batches;
    /// for debugging, and to compare against graphs).
    #[arg(long)]
    pub enforce_eager: bool,
    /// CUDA, tensor parallel: run every all-reduce through NCCL, none through the one-shot
    /// kernel over the GPUs' peer memory that decode-sized ones take by default.
    #[arg(long)]
    pub disable_custom_all_reduce: bool,
    /// Compute dtype: auto (bfloat16), bfloat16, float16, float32. On the CPU, bf16 and f16
    /// store the weight matrices in that dtype; float32 is the exact reference path.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// The format of the model weights to load. "auto" loads the safetensors checkpoint;
    /// "safetensors" loads weights in the safetensors format; "dummy" initializes the
    /// weights with random values, which is mainly for profiling.
    #[arg(long, value_enum, default_value_t = LoadFormat::Auto)]
    pub load_format: LoadFormat,
    /// CUDA attention kernels: flash (a bandwidth-tuned decode kernel and a tensor-core
    /// prefill kernel) or cuda-core (the first kernel, for every token).
    #[arg(long, default_value = "flash", value_parser = AttentionBackend::NAMES)]
    pub attention_backend: String,
    /// Seed of the sampler for requests without their own seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Seconds one step may take before it counts as hung: a tensor-parallel collective
    /// that a peer does not join fails after it, and a worker that gives no answer is
    /// declared dead, its requests failed (vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS).
    #[arg(long, default_value_t = vllm_protocol::DEFAULT_EXECUTE_MODEL_TIMEOUT_S)]
    pub execute_model_timeout: f64,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
}

/// CUDA when a GPU is present (the driver library loads and reports at least one
/// device), else the CPU. Probed once per process.
fn auto_device() -> &'static str {
    static DEVICE: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
    DEVICE.get_or_init(|| {
        if vllm_worker::backend::cuda::device_count() > 0 {
            "cuda"
        } else {
            "cpu"
        }
    })
}

impl EngineArgs {
    /// The device this run uses: `auto` is CUDA when the driver loads and reports a GPU,
    /// else the CPU. `cuda` is taken as asked; the worker reports what is missing.
    pub fn resolved_device(&self) -> anyhow::Result<&'static str> {
        match self.device {
            Device::Cpu => Ok("cpu"),
            Device::Cuda => Ok("cuda"),
            Device::Auto => Ok(auto_device()),
        }
    }

    /// Where the tokenizer comes from: `--tokenizer`, else the model (its folder, or the
    /// GGUF file's metadata).
    pub fn tokenizer_path(&self) -> &Path {
        self.tokenizer.as_deref().unwrap_or(&self.model)
    }

    /// `--model` as the user gave it: the Hub id, or the path.
    pub fn model_name(&self) -> String {
        self.model_id
            .clone()
            .unwrap_or_else(|| self.model.display().to_string())
    }

    pub fn served_model_names(&self) -> Vec<String> {
        if self.served_model_name.is_empty() {
            vec![self.model_name()]
        } else {
            self.served_model_name.clone()
        }
    }

    /// Checks the flags that no process would check before it is too late to say so well.
    pub fn validate(&self) -> anyhow::Result<()> {
        ModelPath::resolve(&self.model).map_err(anyhow::Error::msg)?;
        if let Some(dir) = self.tokenizer.as_ref().filter(|d| !d.is_dir()) {
            bail!("--tokenizer {}: no such directory", dir.display());
        }
        if self.tensor_parallel_size == 0 {
            bail!("--tensor-parallel-size must be at least 1");
        }
        if self.block_size == 0 || self.block_size > 256 {
            bail!("--block-size must be in 1..=256, got {}", self.block_size);
        }
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            bail!(
                "--gpu-memory-utilization must be in (0, 1], got {}",
                self.gpu_memory_utilization
            );
        }
        if self.max_num_seqs == Some(0) || self.max_num_batched_tokens == Some(0) {
            bail!("--max-num-seqs and --max-num-batched-tokens must be at least 1");
        }
        if self.num_gpu_blocks_override == Some(0) {
            bail!("--num-gpu-blocks-override must be at least 1");
        }
        if !(self.execute_model_timeout > 0.0 && self.execute_model_timeout.is_finite()) {
            bail!(
                "--execute-model-timeout must be a positive number of seconds, got {}",
                self.execute_model_timeout
            );
        }
        self.resolved_device()?;
        Ok(())
    }

    /// `--max-num-seqs`, or the device's default.
    pub fn max_num_seqs(&self) -> anyhow::Result<u32> {
        Ok(self.step_limits()?.0)
    }

    fn step_limits(&self) -> anyhow::Result<(u32, u32)> {
        let (seqs, tokens) = match self.resolved_device()? {
            "cpu" => (64, 2048),
            _ => (256, 8192),
        };
        Ok((
            self.max_num_seqs.unwrap_or(seqs),
            self.max_num_batched_tokens.unwrap_or(tokens),
        ))
    }

    fn worker_config(&self) -> anyhow::Result<WorkerConfig> {
        let (max_num_seqs, max_num_batched_tokens) = self.step_limits()?;
        Ok(WorkerConfig {
            model_dir: self.model.clone(),
            rank: 0,
            world_size: self.tensor_parallel_size,
            device: self.resolved_device()?.to_string(),
            dtype: (self.dtype != "auto").then(|| self.dtype.clone()),
            block_size: self.block_size,
            max_model_len: self.max_model_len,
            max_num_batched_tokens,
            max_num_seqs,
            kv_cache_memory_bytes: (self.cpu_kv_cache_space * (1u64 << 30) as f64) as u64,
            gpu_memory_utilization: self.gpu_memory_utilization as f64,
            num_gpu_blocks_override: self.num_gpu_blocks_override,
            seed: self.seed,
            load_format: self.load_format.into(),
            attention_backend: AttentionBackend::from_name(&self.attention_backend)
                .unwrap_or_default(),
            execute_model_timeout_s: self.execute_model_timeout,
            enforce_eager: self.enforce_eager,
            disable_custom_all_reduce: self.disable_custom_all_reduce,
        })
    }

    /// The engine-core's configuration; `exe` is the binary its children run.
    pub fn engine_core_config(&self, exe: PathBuf) -> anyhow::Result<EngineCoreConfig> {
        self.validate()?;
        let (max_num_seqs, max_num_batched_tokens) = self.step_limits()?;
        let scheduler = SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len: 0,
            block_size: self.block_size,
            num_gpu_blocks: 0,
            enable_prefix_caching: !self.no_enable_prefix_caching,
            enable_chunked_prefill: !self.no_enable_chunked_prefill,
            policy: match self.scheduling_policy {
                Policy::Fcfs => SchedulingPolicy::Fcfs,
                Policy::Priority => SchedulingPolicy::Priority,
            },
            long_prefill_token_threshold: 0,
            async_scheduling: self.async_scheduling,
        };
        Ok(EngineCoreConfig {
            run_dir: PathBuf::new(),
            exe,
            world_size: self.tensor_parallel_size,
            worker_config_json: serde_json::to_string(&self.worker_config()?)?,
            scheduler,
            max_model_len_override: self.max_model_len,
            num_gpu_blocks_override: self.num_gpu_blocks_override,
            execute_model_timeout_s: self.execute_model_timeout,
        })
    }
}

/// The sampling flags of the offline commands (`generate`, `bench throughput`).
#[derive(Debug, clap::Args)]
pub struct SamplingFlags {
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 or -1 disables top-k.
    #[arg(long, default_value_t = 0)]
    pub top_k: i32,
    /// Generate every request's full max_tokens whatever tokens it samples.
    #[arg(long)]
    pub ignore_eos: bool,
}

impl SamplingFlags {
    /// Request parameters with these flags, the rest at their defaults.
    pub fn params(&self) -> vllm_protocol::SamplingParams {
        vllm_protocol::SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            ignore_eos: self.ignore_eos,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Flags {
        #[command(flatten)]
        engine: EngineArgs,
    }

    fn worker_config(extra: &[&str]) -> WorkerConfig {
        let args = ["vllm-rs", "--model", "m", "--device", "cuda", "-t", "2"];
        let flags = Flags::try_parse_from(args.iter().chain(extra)).expect("flags parse");
        flags.engine.worker_config().expect("worker config")
    }

    #[test]
    fn disable_custom_all_reduce_reaches_the_workers() {
        assert!(!worker_config(&[]).disable_custom_all_reduce);
        assert!(worker_config(&["--disable-custom-all-reduce"]).disable_custom_all_reduce);
    }
}

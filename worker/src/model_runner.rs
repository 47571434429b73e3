//! `ModelRunner`: the worker's model, KV cache and sampler, driven one `SchedulerOutput`
//! at a time: update request states → build the step's inputs → forward → logits of the
//! requests that complete → sample.

use std::path::PathBuf;

use anyhow::{bail, ensure, Context, Result};
use vllm_protocol::{
    DistributedInit, ModelInfo, ModelRunnerOutput, SampledToken, SchedulerOutput, WorkerProfile,
};

use crate::backend::cuda::pending_step::{InputCopies, PendingStep, Readback};
use crate::backend::cuda::CudaTensor;
use crate::backend::cuda::{memory, sampling};
use crate::backend::{Backend, CpuBackend, CudaBackend, StepCapacity, StepInputs};
use crate::communicator::nccl::CustomAllReduceMode;
use crate::communicator::ShmCommunicator;
use crate::config::{AttentionBackend, LoadFormat, ModelConfig};
use crate::cuda_graphs::{CudaGraphs, GraphGeometry, LogitsView};
use crate::input_batch::{InputBatch, PreparedStep};
use crate::kv_cache::{bytes_per_block, KvCache};
use crate::layers::TensorParallel;
use crate::models::{variant_for, LlamaForCausalLM};
use crate::overlap::{self, CopyRun, DeferredRows};
use crate::sampler::{Sampler, SamplingRequest};
use crate::weights::{DType, Weights};
use vllm_kernels::cpu::fast::Isa;

/// How the engine-core configured this worker.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WorkerConfig {
    pub model_dir: PathBuf,
    pub rank: u32,
    pub world_size: u32,
    /// "cpu" or "cuda".
    pub device: String,
    pub dtype: Option<String>,
    pub block_size: u32,
    pub max_model_len: Option<u32>,
    pub max_num_batched_tokens: u32,
    pub max_num_seqs: u32,
    /// CPU: the memory budget for KV blocks.
    pub kv_cache_memory_bytes: u64,
    /// CUDA: the share of GPU memory for weights, activations and the KV cache.
    pub gpu_memory_utilization: f64,
    pub num_gpu_blocks_override: Option<u32>,
    pub seed: u64,
    /// Where the weights come from: the checkpoint (`auto`, `safetensors`) or random
    /// (`dummy`, vLLM's `--load-format dummy`).
    #[serde(default)]
    pub load_format: LoadFormat,
    /// CUDA: which attention kernels run.
    #[serde(default)]
    pub attention_backend: AttentionBackend,
    /// Seconds a step may take before it counts as hung (`--execute-model-timeout`): a
    /// collective that a peer does not join within it fails instead of waiting for ever.
    #[serde(default = "vllm_protocol::default_execute_model_timeout_s")]
    pub execute_model_timeout_s: f64,
    /// CUDA: run every step op by op, capturing no graphs (`--enforce-eager`).
    #[serde(default)]
    pub enforce_eager: bool,
    /// CUDA, tensor parallel: every all-reduce through NCCL, none through the one-shot
    /// kernel over peer memory (`--disable-custom-all-reduce`).
    #[serde(default)]
    pub disable_custom_all_reduce: bool,
}

/// How this rank joins its tensor-parallel group, from the startup handshake.
#[derive(Debug, Clone)]
pub struct GroupInit {
    /// The CPU backend's shared-memory file, the same path on every rank.
    pub shm_path: PathBuf,
    pub init: DistributedInit,
}

pub struct ModelRunner<B: Backend = CpuBackend> {
    backend: B,
    cfg: WorkerConfig,
    model_config: ModelConfig,
    model: LlamaForCausalLM<B>,
    max_model_len: usize,
    /// This rank's attention heads.
    num_q_heads: usize,
    num_kv_heads: usize,
    kv_cache: Option<KvCache<B>>,
    batch: InputBatch,
    sampler: Sampler,
    /// CUDA only: the decode steps' graphs, once captured.
    graphs: Option<CudaGraphs>,
    /// CUDA only: the deferred step whose tokens are not read yet (`crate::overlap`).
    pending: Option<PendingStep>,
    /// CUDA only: pinned buffers of finished deferred steps, for the next ones.
    readbacks: Vec<Readback>,
}

/// Uploads `inputs`, runs `after_upload` (a deferred step's input copies), then the
/// forward pass op by op; the logits, None when the step samples nothing.
fn eager_pass<B: Backend>(
    backend: &B,
    model: &LlamaForCausalLM<B>,
    cache: Option<&mut KvCache<B>>,
    inputs: &StepInputs,
    after_upload: impl FnOnce(&B) -> Result<()>,
) -> Result<Option<B::Tensor>> {
    let cache = cache.context("execute_model before initialize_kv_cache")?;
    let started = std::time::Instant::now();
    let meta = backend.upload_step(inputs)?;
    after_upload(backend)?;
    let uploaded = started.elapsed();
    let hidden = model.forward(backend, &meta, cache)?;
    let forwarded = started.elapsed();
    let logits = if inputs.logits_indices.is_empty() {
        None
    } else {
        Some(model.compute_logits(backend, &hidden, &meta)?)
    };
    // The host's time in each part: on CUDA, enqueuing it (the GPU runs it later).
    tracing::debug!(
        target: "vllm_worker::step",
        upload_us = uploaded.as_micros() as u64,
        forward_us = (forwarded - uploaded).as_micros() as u64,
        logits_us = (started.elapsed() - forwarded).as_micros() as u64,
        "eager pass"
    );
    Ok(logits)
}

/// Threads of one CPU rank: `VLLM_CPU_NUM_THREADS`, else the cores shared out among the
/// ranks of this machine.
fn cpu_threads(world_size: usize) -> usize {
    if std::env::var_os("VLLM_CPU_NUM_THREADS").is_some() {
        return vllm_kernels::cpu::fast::default_threads();
    }
    (vllm_kernels::cpu::fast::default_threads() / world_size.max(1)).max(1)
}

/// `max_model_len` from the flag, bounded by the model's `max_position_embeddings`.
fn resolve_max_model_len(cfg: &WorkerConfig, model: &ModelConfig) -> Result<usize> {
    let limit = model.max_position_embeddings;
    match cfg.max_model_len {
        None => Ok(limit),
        Some(n) if n as usize > limit => {
            bail!("max_model_len {n} exceeds the model's max_position_embeddings {limit}")
        }
        Some(0) => bail!("max_model_len must be positive"),
        Some(n) => Ok(n as usize),
    }
}

impl ModelRunner<CpuBackend> {
    /// Loads the model of `cfg.model_dir` on the CPU, as the only rank.
    pub fn load(cfg: &WorkerConfig) -> Result<Self> {
        Self::load_in_group(cfg, None)
    }

    /// Loads this rank's shard on the CPU; ranks of a group of more than one talk through
    /// `group`'s shared-memory file.
    pub fn load_in_group(cfg: &WorkerConfig, group: Option<&GroupInit>) -> Result<Self> {
        match cfg.device.as_str() {
            "cpu" => {
                // `--dtype` is the weights' dtype here too (auto: bfloat16); activations,
                // norms and the KV cache stay f32.
                let dtype = DType::from_flag(cfg.dtype.as_deref())?;
                let threads = cpu_threads(cfg.world_size as usize);
                let isa = Isa::detect();
                let mut backend = CpuBackend::with_kernels(dtype, threads, isa);
                if cfg.world_size > 1 {
                    let group = group.context("a tensor-parallel rank needs its group")?;
                    backend = backend.with_communicator(ShmCommunicator::open(
                        &group.shm_path,
                        cfg.rank as usize,
                        cfg.world_size as usize,
                        std::time::Duration::from_secs_f64(cfg.execute_model_timeout_s),
                    )?);
                }
                tracing::info!(
                    weights = dtype.name(),
                    threads,
                    isa = isa.name(),
                    "CPU backend ready"
                );
                Self::with_backend(backend, cfg)
            }
            other => bail!("device \"{other}\" is not supported (supported: cpu, cuda)"),
        }
    }
}

impl<B: Backend> ModelRunner<B> {
    pub fn with_backend(backend: B, cfg: &WorkerConfig) -> Result<Self> {
        ensure!(cfg.block_size > 0, "block_size must be positive");
        ensure!(
            cfg.rank < cfg.world_size,
            "rank {} outside world size {}",
            cfg.rank,
            cfg.world_size
        );
        let model_config = ModelConfig::from_model_dir(&cfg.model_dir)?;
        let max_model_len = resolve_max_model_len(cfg, &model_config)?;
        let tp = TensorParallel {
            rank: cfg.rank as usize,
            size: cfg.world_size as usize,
        };
        tp.check_model(&model_config)?;
        let started = std::time::Instant::now();
        let weights = Weights::load(&cfg.model_dir, cfg.load_format, backend.weight_dtype())?;
        let bar = indicatif::ProgressBar::new(model_config.num_hidden_layers as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("loading weights {bar:30} {pos}/{len} layers")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let model = LlamaForCausalLM::load(
            &backend,
            &weights,
            &model_config,
            variant_for(&model_config),
            tp,
            max_model_len,
            |_| bar.inc(1),
        )
        .with_context(|| format!("loading weights from {}", cfg.model_dir.display()))?;
        bar.finish_and_clear();
        tracing::info!(
            architecture = model_config.architecture.hf_name(),
            layers = model_config.num_hidden_layers,
            device = backend.device_name(),
            load_format = cfg.load_format.name(),
            seconds = started.elapsed().as_secs_f32(),
            "model loaded"
        );
        let num_q_heads = model_config.num_attention_heads / tp.size;
        let num_kv_heads = tp.local_kv_heads(model_config.num_key_value_heads);
        // The worst-case dummy step may hold one sequence longer than max_model_len.
        let longest = max_model_len.max(cfg.max_num_batched_tokens as usize);
        backend.reserve_steps(
            StepCapacity {
                max_num_tokens: cfg.max_num_batched_tokens as usize,
                max_num_seqs: cfg.max_num_seqs as usize,
                max_blocks_per_seq: longest.div_ceil(cfg.block_size as usize),
            },
            num_q_heads,
            num_kv_heads,
        )?;
        Ok(Self {
            backend,
            cfg: cfg.clone(),
            model_config,
            model,
            max_model_len,
            num_q_heads,
            num_kv_heads,
            kv_cache: None,
            batch: InputBatch::default(),
            sampler: Sampler::new(cfg.seed),
            graphs: None,
            pending: None,
            readbacks: Vec::new(),
        })
    }

    pub fn model_config(&self) -> &ModelConfig {
        &self.model_config
    }

    fn bytes_per_block(&self) -> u64 {
        bytes_per_block(
            self.model_config.num_hidden_layers,
            self.cfg.block_size as usize,
            self.num_kv_heads,
            self.model_config.head_dim,
            self.backend.kv_cache_element_bytes(),
        )
    }

    /// How many KV blocks fit this rank's budget (or the override), and the model facts.
    pub fn profile(&mut self) -> Result<WorkerProfile> {
        let per_block = self.bytes_per_block();
        let num_available_blocks = match self.cfg.num_gpu_blocks_override {
            Some(n) => n,
            None => {
                let n = self.cfg.kv_cache_memory_bytes / per_block;
                ensure!(
                    n > 0,
                    "KV cache budget of {} bytes holds no block ({per_block} bytes per block)",
                    self.cfg.kv_cache_memory_bytes
                );
                u32::try_from(n).unwrap_or(u32::MAX)
            }
        };
        tracing::info!(
            num_available_blocks,
            bytes_per_block = per_block,
            "profiled KV cache"
        );
        Ok(self.worker_profile(num_available_blocks))
    }

    /// What the engine learns of this worker: its KV blocks and the model it runs.
    fn worker_profile(&self, num_available_blocks: u32) -> WorkerProfile {
        WorkerProfile {
            rank: self.cfg.rank,
            num_available_blocks,
            model: ModelInfo {
                architecture: self.model_config.architecture.hf_name().to_string(),
                vocab_size: self.model_config.vocab_size as u32,
                num_hidden_layers: self.model_config.num_hidden_layers as u32,
                max_model_len: self.max_model_len as u32,
                dtype: self.backend.dtype_name().to_string(),
            },
            device: self.backend.device_name(),
        }
    }

    pub fn initialize_kv_cache(&mut self, num_blocks: u32) -> Result<()> {
        ensure!(num_blocks > 0, "cannot run with 0 KV blocks");
        self.kv_cache = Some(KvCache::allocate(
            &self.backend,
            self.model_config.num_hidden_layers,
            num_blocks as usize,
            self.cfg.block_size as usize,
            self.num_kv_heads,
            self.model_config.head_dim,
        )?);
        tracing::info!(
            num_blocks,
            block_size = self.cfg.block_size,
            "KV cache allocated"
        );
        Ok(())
    }

    /// Applies the scheduler's deltas and lays out the step's inputs, checked against the
    /// KV cache (None for an empty step).
    fn prepare_step(&mut self, so: &SchedulerOutput) -> Result<Option<PreparedStep>> {
        self.batch.update_states(so)?;
        if so.is_empty() {
            return Ok(None);
        }
        let cache = self
            .kv_cache
            .as_ref()
            .context("execute_model before initialize_kv_cache")?;
        let step = self.batch.prepare_inputs(so, cache.block_size)?;
        step.inputs
            .check_against_cache(cache.num_blocks, cache.block_size, self.max_model_len)?;
        Ok(Some(step))
    }

    /// The front of every step, whichever sampler follows: applies the scheduler's deltas,
    /// runs the forward pass, and returns the ids of the requests to sample with their
    /// logits rows (None when this step samples nothing).
    fn forward_step(&mut self, so: &SchedulerOutput) -> Result<Option<(Vec<String>, B::Tensor)>> {
        let Some(step) = self.prepare_step(so)? else {
            return Ok(None);
        };
        let logits = self.forward_eager(&step.inputs)?;
        Ok(logits.map(|l| (step.sampled_req_ids, l)))
    }

    /// Uploads and runs one step op by op; its logits, None when it samples nothing.
    fn forward_eager(&mut self, inputs: &StepInputs) -> Result<Option<B::Tensor>> {
        eager_pass(
            &self.backend,
            &self.model,
            self.kv_cache.as_mut(),
            inputs,
            |_| Ok(()),
        )
    }

    /// Pairs each request with the token (and logprobs) sampled for it, and keeps the
    /// tokens in the batch, unconfirmed: with async scheduling the next step computes them
    /// before the engine-core has seen them.
    fn record_sampled(
        &mut self,
        req_ids: &[String],
        sampled: Vec<(u32, Option<vllm_protocol::TokenLogprobs>)>,
    ) -> Vec<SampledToken> {
        let tokens = sampled_tokens(req_ids, sampled);
        self.batch.record_sampled(&tokens);
        tokens
    }

    /// Runs one step and samples a token for every request that completes its sequence.
    pub fn execute_model(&mut self, so: &SchedulerOutput) -> Result<ModelRunnerOutput> {
        let mut output = ModelRunnerOutput {
            step_id: so.step_id,
            sampled: Vec::new(),
        };
        let Some((sampled_req_ids, logits)) = self.forward_step(so)? else {
            return Ok(output);
        };
        let mut logits = self.backend.to_host(&logits)?.data;
        let reqs = sampling_requests(&self.batch, &self.model_config, &sampled_req_ids);
        let sampled = self
            .sampler
            .sample(&mut logits, self.model_config.vocab_size, &reqs);
        output.sampled = self.record_sampled(&sampled_req_ids, sampled);
        Ok(output)
    }

    /// Logits of the requests that complete in this step, without sampling (tests).
    pub fn execute_logits(&mut self, so: &SchedulerOutput) -> Result<Vec<(String, Vec<f32>)>> {
        let Some((sampled_req_ids, logits)) = self.forward_step(so)? else {
            return Ok(Vec::new());
        };
        let logits = self.backend.to_host(&logits)?.data;
        let vocab = self.model_config.vocab_size;
        Ok(sampled_req_ids
            .into_iter()
            .zip(logits.chunks_exact(vocab).map(<[f32]>::to_vec))
            .collect())
    }
}

// ---------------------------------------------------------------------------------------
// CUDA: the runner on one GPU. Loading picks the dtype, profiling sizes the KV cache from
// the GPU's memory, and steps sample on the GPU.

/// The model runner of whichever device `WorkerConfig::device` names.
pub enum DeviceRunner {
    Cpu(Box<ModelRunner<CpuBackend>>),
    Cuda(Box<ModelRunner<CudaBackend>>),
}

impl DeviceRunner {
    /// Loads this rank's shard on `cfg.device`: "cuda" opens GPU `cfg.rank`, anything else
    /// is the CPU runner's business (which refuses what it does not know).
    pub fn load(cfg: &WorkerConfig, group: &GroupInit) -> Result<Self> {
        match cfg.device.as_str() {
            "cuda" => Ok(Self::Cuda(Box::new(ModelRunner::load_cuda(
                cfg,
                Some(group),
            )?))),
            _ => Ok(Self::Cpu(Box::new(ModelRunner::load_in_group(
                cfg,
                Some(group),
            )?))),
        }
    }

    /// What the worker's watchdog calls when a step hangs: aborts the NCCL communicator,
    /// so that the GPU's collectives return and the step fails. None without one.
    pub fn abort_handle(&self) -> Option<std::sync::Arc<crate::communicator::nccl::NcclAbort>> {
        match self {
            Self::Cpu(_) => None,
            Self::Cuda(r) => r.backend.communicator().map(|c| c.abort_handle()),
        }
    }

    pub fn profile(&mut self) -> Result<WorkerProfile> {
        match self {
            Self::Cpu(r) => r.profile(),
            Self::Cuda(r) => r.profile_cuda(),
        }
    }

    pub fn initialize_kv_cache(&mut self, num_blocks: u32) -> Result<()> {
        match self {
            Self::Cpu(r) => r.initialize_kv_cache(num_blocks),
            Self::Cuda(r) => {
                r.initialize_kv_cache(num_blocks)?;
                r.capture_cuda_graphs()
            }
        }
    }

    /// Runs a step, possibly leaving it deferred (CUDA, see `crate::overlap`); the
    /// outputs now complete, oldest first: a deferred step before this one, and this one
    /// unless it is deferred.
    pub fn execute_model_overlapped(
        &mut self,
        so: &SchedulerOutput,
    ) -> Result<Vec<ModelRunnerOutput>> {
        match self {
            Self::Cpu(r) => Ok(vec![r.execute_model(so)?]),
            Self::Cuda(r) => r.execute_model_overlapped(so),
        }
    }

    /// The id of the deferred step, if one is in flight.
    pub fn pending_step_id(&self) -> Option<u64> {
        match self {
            Self::Cpu(_) => None,
            Self::Cuda(r) => r.pending_step_id(),
        }
    }

    /// Whether the deferred step's tokens have arrived (true when there is none).
    pub fn pending_is_ready(&self) -> Result<bool> {
        match self {
            Self::Cpu(_) => Ok(true),
            Self::Cuda(r) => r.pending_is_ready(),
        }
    }

    /// Waits for the deferred step's tokens and returns its output.
    pub fn finish_pending(&mut self) -> Result<Option<ModelRunnerOutput>> {
        match self {
            Self::Cpu(_) => Ok(None),
            Self::Cuda(r) => r.finish_pending(),
        }
    }
}

impl ModelRunner<CudaBackend> {
    /// Opens GPU `cfg.rank`, joins the NCCL group of `group` when there is more than one
    /// rank, and loads this rank's shard in `--dtype` (auto: bfloat16).
    pub fn load_cuda(cfg: &WorkerConfig, group: Option<&GroupInit>) -> Result<Self> {
        let dtype = vllm_kernels::cuda::DType::from_flag(cfg.dtype.as_deref())?;
        let kernels = match cfg.attention_backend {
            AttentionBackend::CudaCore => vllm_kernels::cuda::AttentionKernels::CUDA_CORE,
            AttentionBackend::Flash => {
                vllm_kernels::cuda::AttentionKernels::flash(dtype != vllm_kernels::cuda::DType::F32)
            }
        };
        let mut backend = CudaBackend::new(cfg.rank, dtype)?.with_attention_kernels(kernels);
        if cfg.world_size > 1 {
            let id = group
                .and_then(|g| g.init.nccl_unique_id.as_deref())
                .context("a tensor-parallel CUDA rank needs the NCCL unique id of its group")?;
            let custom = if cfg.disable_custom_all_reduce {
                CustomAllReduceMode::Disabled
            } else {
                CustomAllReduceMode::Auto
            };
            backend.join_group(id, cfg.rank, cfg.world_size, custom)?;
        }
        tracing::info!(
            device = backend.device_name(),
            gpu = backend.dev.name,
            dtype = dtype.name(),
            kernels = ?backend.ops.build_source,
            attention = ?cfg.attention_backend,
            "CUDA backend ready"
        );
        Self::with_backend(backend, cfg)
    }

    /// The backend, for tests that change how it launches (before the graphs are captured).
    #[cfg(test)]
    pub(crate) fn backend_mut(&mut self) -> &mut CudaBackend {
        &mut self.backend
    }

    /// Runs the worst-case dummy step and sizes the KV cache from what memory is left
    /// (or takes `num_gpu_blocks_override`).
    pub fn profile_cuda(&mut self) -> Result<WorkerProfile> {
        let per_block = self.bytes_per_block();
        let dev = &self.backend.dev;
        dev.synchronize()?;
        dev.reset_pool_high();
        let started = std::time::Instant::now();
        self.dummy_step()
            .context("the worst-case dummy step failed (lower --max-num-batched-tokens?)")?;
        let dev = &self.backend.dev;
        dev.synchronize()?;
        let (free_after, total) = dev.mem_info()?;
        let snapshot = memory::MemorySnapshot {
            total: total as u64,
            free_after: free_after as u64,
            pool_now: dev.pool_reserved(),
            pool_high: dev.pool_reserved_high(),
        };
        let utilization = self.cfg.gpu_memory_utilization;
        let kv_bytes = memory::kv_cache_bytes(&snapshot, utilization);
        let num_available_blocks = match self.cfg.num_gpu_blocks_override {
            Some(n) => n,
            None => {
                let n = kv_bytes / per_block;
                ensure!(
                    n > 0,
                    "no GPU memory left for the KV cache: {:.2} GiB total, {:.2} GiB in use \
                     after the weights and a {}-token dummy step, utilization {utilization} \
                     (raise --gpu-memory-utilization or lower --max-num-batched-tokens)",
                    gib(snapshot.total),
                    gib(snapshot.total - snapshot.free_after),
                    self.cfg.max_num_batched_tokens
                );
                u32::try_from(n).unwrap_or(u32::MAX)
            }
        };
        tracing::info!(
            total_gib = format!("{:.2}", gib(snapshot.total)),
            in_use_gib = format!("{:.2}", gib(snapshot.total - snapshot.free_after)),
            pool_peak_gib = format!("{:.2}", gib(snapshot.pool_high)),
            kv_cache_gib = format!("{:.2}", gib(kv_bytes)),
            utilization,
            dummy_step_seconds = started.elapsed().as_secs_f32(),
            "profiled GPU memory"
        );
        tracing::info!(
            num_gpu_blocks = num_available_blocks,
            block_size = self.cfg.block_size,
            kv_cache_tokens = u64::from(num_available_blocks) * u64::from(self.cfg.block_size),
            bytes_per_block = per_block,
            "KV cache size"
        );
        Ok(self.worker_profile(num_available_blocks))
    }

    /// One forward of the worst-case step, with logits and GPU sampling of every row,
    /// through a one-block cache that nothing is written to.
    fn dummy_step(&mut self) -> Result<()> {
        let bs = self.cfg.block_size as usize;
        let inputs = memory::dummy_step(
            self.cfg.max_num_batched_tokens as usize,
            self.cfg.max_num_seqs as usize,
            bs,
            self.max_model_len,
        );
        let mut cache = KvCache::allocate(
            &self.backend,
            self.model_config.num_hidden_layers,
            1,
            bs,
            self.num_kv_heads,
            self.model_config.head_dim,
        )?;
        let meta = self.backend.upload_step(&inputs)?;
        let (model, backend) = (&self.model, &self.backend);
        let hidden = backend.warming_gemms(|| model.forward(backend, &meta, &mut cache))?;
        let logits = model.compute_logits(backend, &hidden, &meta)?;
        let n = inputs.logits_indices.len();
        let params = vllm_protocol::SamplingParams::default();
        let reqs: Vec<SamplingRequest> = (0..n)
            .map(|_| SamplingRequest {
                params: &params,
                prompt_token_ids: &[],
                output_token_ids: &[],
                eos_token_ids: &[],
            })
            .collect();
        sampling::sample(&self.backend, &logits, &reqs, self.cfg.seed)?;
        Ok(())
    }

    /// Captures the decode graphs over the KV cache (unless `--enforce-eager`).
    pub fn capture_cuda_graphs(&mut self) -> Result<()> {
        if self.cfg.enforce_eager {
            tracing::info!("CUDA graphs off (--enforce-eager)");
            return Ok(());
        }
        let cache = self
            .kv_cache
            .as_mut()
            .context("capturing CUDA graphs before the KV cache")?;
        let geometry = GraphGeometry {
            max_num_seqs: self.cfg.max_num_seqs as usize,
            max_model_len: self.max_model_len,
            num_q_heads: self.num_q_heads,
            num_kv_heads: self.num_kv_heads,
            num_sms: self.backend.dev.num_sms,
        };
        let started = std::time::Instant::now();
        let graphs = CudaGraphs::capture(
            &self.backend,
            &self.model,
            cache,
            &geometry,
            self.model_config.vocab_size,
        )?;
        self.backend.dev.synchronize()?;
        tracing::info!(
            graphs = graphs.num_graphs(),
            largest_batch = graphs.largest_batch(),
            seconds = started.elapsed().as_secs_f32(),
            "captured CUDA graphs of decode steps"
        );
        self.graphs = (graphs.num_graphs() > 0).then_some(graphs);
        Ok(())
    }

    /// How many decode graphs were captured (0 when eager).
    pub fn num_cuda_graphs(&self) -> usize {
        self.graphs.as_ref().map_or(0, CudaGraphs::num_graphs)
    }

    /// Buffers of the graphs allocated inside a capture (0 when eager, and when every
    /// buffer fit the capture arena).
    pub fn cuda_graph_allocation_nodes(&self) -> usize {
        self.graphs.as_ref().map_or(0, CudaGraphs::allocation_nodes)
    }

    /// `execute_model` with sampling on the GPU: every parameter (penalties, logit bias,
    /// min_tokens and logprobs too) is applied on the device, so the logits never leave it;
    /// only the tokens and the asked-for logprobs come back. Never defers (the serial
    /// path); a deferred step must be finished first.
    pub fn execute_model_cuda(&mut self, so: &SchedulerOutput) -> Result<ModelRunnerOutput> {
        ensure!(
            self.pending.is_none(),
            "execute_model_cuda with a deferred step in flight (finish_pending first)"
        );
        let mut outputs = self.execute_cuda(so, false)?;
        ensure!(
            outputs.len() == 1,
            "a serial step completes exactly one output"
        );
        Ok(outputs.remove(0))
    }

    /// `execute_model_cuda` that may defer the step (`crate::overlap`): enqueued behind a
    /// deferred one when it can be, and itself deferred when the engine runs ahead. The
    /// outputs now complete, oldest first.
    pub fn execute_model_overlapped(
        &mut self,
        so: &SchedulerOutput,
    ) -> Result<Vec<ModelRunnerOutput>> {
        self.execute_cuda(so, true)
    }

    pub fn pending_step_id(&self) -> Option<u64> {
        self.pending.as_ref().map(|p| p.rows.step_id)
    }

    pub fn pending_is_ready(&self) -> Result<bool> {
        self.pending
            .as_ref()
            .map_or(Ok(true), PendingStep::is_ready)
    }

    /// Waits for the deferred step's tokens, fills them in on the host (one step late)
    /// and returns its output.
    pub fn finish_pending(&mut self) -> Result<Option<ModelRunnerOutput>> {
        let Some(pending) = self.pending.take() else {
            return Ok(None);
        };
        let (rows, tokens, readback) = pending.finish()?;
        self.readbacks.push(readback);
        Ok(Some(ModelRunnerOutput {
            step_id: rows.step_id,
            sampled: rows.fill(&mut self.batch, &tokens)?,
        }))
    }

    /// One step: prepared (behind the deferred step when `may_overlap` allows, with its
    /// tokens copied in on the device), enqueued, then sampled: deferred when `defer` and
    /// `may_defer` allow, else read back at once after the deferred step is finished.
    fn execute_cuda(
        &mut self,
        so: &SchedulerOutput,
        defer: bool,
    ) -> Result<Vec<ModelRunnerOutput>> {
        let mut outputs = Vec::new();
        let blocked = |p: &PendingStep| !overlap::may_overlap(so, &self.batch, &p.rows);
        if self.pending.as_ref().is_some_and(blocked) {
            outputs.extend(self.finish_pending()?);
        }
        let mut output = ModelRunnerOutput {
            step_id: so.step_id,
            sampled: Vec::new(),
        };
        let started = std::time::Instant::now();
        let Some(step) = self.prepare_step(so)? else {
            outputs.extend(self.finish_pending()?);
            outputs.push(output);
            return Ok(outputs);
        };
        let prepared = started.elapsed();
        let runs = match &self.pending {
            Some(p) => p.rows.input_gathers(so, &self.batch, &step.inputs)?,
            None => Vec::new(),
        };
        let Some(logits) = self.forward_cuda(&step.inputs, runs)? else {
            outputs.extend(self.finish_pending()?);
            outputs.push(output);
            return Ok(outputs);
        };
        let sampled_req_ids = step.sampled_req_ids;
        // The forward pass is only enqueued here; sampling waits for it, so `sample_us`
        // holds the GPU time the host did not hide (when the step before it was deferred:
        // the wait for that step's tokens, this step's forward already enqueued).
        let enqueued = started.elapsed();
        let deferred = defer && overlap::may_defer(so, &self.batch, &sampled_req_ids);
        if deferred {
            let reqs = sampling_requests(&self.batch, &self.model_config, &sampled_req_ids);
            let mut readback = match self.readbacks.pop() {
                Some(r) => r,
                None => Readback::new(&self.backend, self.cfg.max_num_seqs as usize)?,
            };
            let seed = self.cfg.seed;
            sampling::sample_on_device(&self.backend, &logits, &reqs, seed, &mut readback.device)?;
            let rows = DeferredRows::record(&mut self.batch, so.step_id, &sampled_req_ids);
            let vocab = self.model_config.vocab_size;
            let next = PendingStep::start(&self.backend, rows, readback, vocab)?;
            // This step is on the GPU behind the last one: now wait for the last one.
            outputs.extend(self.finish_pending()?);
            self.pending = Some(next);
        } else {
            // The deferred step's tokens are in the batch before this step's requests
            // (penalties and min_tokens read them).
            outputs.extend(self.finish_pending()?);
            let reqs = sampling_requests(&self.batch, &self.model_config, &sampled_req_ids);
            let sampled = sampling::sample(&self.backend, &logits, &reqs, self.cfg.seed)?;
            output.sampled = self.record_sampled(&sampled_req_ids, sampled);
            outputs.push(output);
        }
        tracing::debug!(
            target: "vllm_worker::step",
            step = so.step_id,
            tokens = so.total_num_scheduled_tokens,
            seqs = so.num_scheduled_tokens.len(),
            graph = matches!(logits, StepLogits::Graph(_)),
            deferred,
            prepare_us = prepared.as_micros() as u64,
            enqueue_us = enqueued.as_micros() as u64,
            sample_us = (started.elapsed() - enqueued).as_micros() as u64,
            "worker step"
        );
        Ok(outputs)
    }

    /// Uploads the prepared step, applies the deferred step's `runs` to its input ids and
    /// enqueues its forward (a graph replay when one fits); its logits, None when it
    /// samples nothing.
    fn forward_cuda(
        &mut self,
        inputs: &StepInputs,
        runs: Vec<CopyRun>,
    ) -> Result<Option<StepLogits>> {
        let copies = self
            .pending
            .as_ref()
            .map(|pending| InputCopies { pending, runs });
        if let Some((graphs, shape)) = self
            .graphs
            .as_ref()
            .and_then(|g| Some((g, g.shape_for(inputs)?)))
        {
            let view = graphs.replay(&self.backend, inputs, shape, copies.as_ref())?;
            return Ok(Some(StepLogits::Graph(view)));
        }
        let logits = eager_pass(
            &self.backend,
            &self.model,
            self.kv_cache.as_mut(),
            inputs,
            |b| copies.as_ref().map_or(Ok(()), |c| c.apply(b)),
        )?;
        Ok(logits.map(StepLogits::Eager))
    }
}

/// A CUDA step's logits: its own tensor, or the first rows of its graph's logits.
enum StepLogits {
    Eager(CudaTensor),
    Graph(LogitsView),
}

impl std::ops::Deref for StepLogits {
    type Target = CudaTensor;
    fn deref(&self) -> &CudaTensor {
        match self {
            Self::Eager(t) => t,
            Self::Graph(v) => v,
        }
    }
}

/// What the sampler needs of each request that gets a token this step.
fn sampling_requests<'a>(
    batch: &'a InputBatch,
    model_config: &'a ModelConfig,
    req_ids: &[String],
) -> Vec<SamplingRequest<'a>> {
    req_ids
        .iter()
        .map(|id| {
            let s = &batch.requests[id];
            SamplingRequest {
                params: &s.sampling_params,
                prompt_token_ids: &s.prompt_token_ids,
                output_token_ids: &s.output_token_ids,
                eos_token_ids: &model_config.eos_token_ids,
            }
        })
        .collect()
}

/// Pairs each request with the token (and logprobs) sampled for it.
fn sampled_tokens(
    req_ids: &[String],
    sampled: Vec<(u32, Option<vllm_protocol::TokenLogprobs>)>,
) -> Vec<SampledToken> {
    req_ids
        .iter()
        .zip(sampled)
        .map(|(req_id, (token_id, logprobs))| SampledToken {
            req_id: req_id.clone(),
            token_id,
            logprobs,
        })
        .collect()
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

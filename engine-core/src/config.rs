//! `EngineCoreConfig`: everything the engine-core process is started with. The launcher
//! builds it once from the command line and hands it to the child as JSON.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::scheduler::SchedulerConfig;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineCoreConfig {
    /// The run's private directory, holding its `ipc://` socket files.
    pub run_dir: PathBuf,
    /// The `vllm-rs` binary, started again in the worker role.
    pub exe: PathBuf,
    /// Number of worker ranks (tensor-parallel size).
    pub world_size: u32,
    /// The workers' configuration, passed through untouched: the engine-core knows nothing
    /// of models or devices.
    pub worker_config_json: String,
    /// Scheduler settings. `num_gpu_blocks` and `max_model_len` are placeholders here: they
    /// are set from the workers' profile (or the overrides below) once the workers are ready.
    pub scheduler: SchedulerConfig,
    /// `--max-model-len`, when given; otherwise the model's own limit.
    pub max_model_len_override: Option<u32>,
    /// `--num-gpu-blocks-override`: the pool size, whatever the memory budget says.
    pub num_gpu_blocks_override: Option<u32>,
    /// `--execute-model-timeout`: seconds a step may take before the workers count as hung.
    #[serde(default = "vllm_protocol::default_execute_model_timeout_s")]
    pub execute_model_timeout_s: f64,
}

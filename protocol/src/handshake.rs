//! Startup handshake payloads: what a child reports to its parent once it is ready.

use serde::{Deserialize, Serialize};

/// Facts about the loaded model that the engine-core and frontend need.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub architecture: String,
    pub vocab_size: u32,
    pub num_hidden_layers: u32,
    pub max_model_len: u32,
    pub dtype: String,
}

/// A worker's answer once its model is loaded and its memory profiled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerProfile {
    pub rank: u32,
    /// KV blocks this rank could hold in its memory budget.
    pub num_available_blocks: u32,
    pub model: ModelInfo,
    pub device: String,
}

/// The engine-core's report to the frontend once every worker is ready.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineReady {
    pub protocol_version: u32,
    pub num_gpu_blocks: u32,
    pub block_size: u32,
    pub max_model_len: u32,
    pub model: ModelInfo,
    pub device: String,
}

//! Messages between the frontend and the engine-core.
//!
//! Frontend → engine-core (ROUTER → DEALER): [`EngineCoreInput`].
//! Engine-core → frontend (PUSH → PULL): [`EngineCoreEvent`].

use serde::{Deserialize, Serialize};

use crate::{handshake::EngineReady, wire_message, SamplingParams};

/// One request, tokenized, as the engine-core receives it. `n > 1` is fanned out by the
/// frontend into `n` requests, which share the prompt's KV blocks through prefix caching.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineCoreRequest {
    pub request_id: String,
    pub prompt_token_ids: Vec<u32>,
    pub sampling_params: SamplingParams,
    /// Token ids that end generation unless `ignore_eos` (a model may have several).
    pub eos_token_ids: Vec<u32>,
    /// Seconds since the Unix epoch, set by the frontend when the request arrived.
    pub arrival_time: f64,
    /// Lower runs first under `--scheduling-policy priority`.
    pub priority: i32,
    /// The API request this one is a part of (one of its prompts or `n` samples). The
    /// scheduler shares sequence slots fairly among these groups; `None`: the request is
    /// a group of its own.
    #[serde(default)]
    pub parent_request_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum UtilityMethod {
    /// Current scheduler statistics (answered with `UtilityOutput::Stats`).
    GetStats,
    /// Drops every cached prefix block that no running request uses.
    ResetPrefixCache,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UtilityCall {
    pub call_id: u64,
    pub method: UtilityMethod,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum UtilityOutput {
    Stats(SchedulerStats),
    Done,
    Failed(String),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UtilityResult {
    pub call_id: u64,
    pub output: UtilityOutput,
}

/// The first frame every child sends its parent on the socket it connects, so the parent's
/// ROUTER learns the child's routing identity and can check the protocol version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Register {
    pub protocol_version: u32,
    pub rank: u32,
}

// A message is built once and moved to the socket: the size of its largest variant costs
// nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum EngineCoreInput {
    Add(EngineCoreRequest),
    Abort(Vec<String>),
    Utility(UtilityCall),
    Shutdown(()),
}

wire_message!(EngineCoreInput {
    Add(EngineCoreRequest) = 0x01,
    Abort(Vec<String>) = 0x02,
    Utility(UtilityCall) = 0x03,
    Shutdown(()) = 0x04,
});

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FinishReason {
    /// An eos token or a stop token id (or, in the frontend, a stop string).
    Stop,
    /// `max_tokens` or the model's context length reached.
    Length,
    /// Aborted by the client or the frontend.
    Abort,
    /// The engine could not serve it (for example the prompt is too long).
    Error,
}

impl FinishReason {
    /// The name OpenAI's API and vLLM's metrics use.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }
}

/// Log-probabilities of one sampled token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    pub token_id: u32,
    pub logprob: f32,
    /// 1-based rank of the sampled token among all tokens.
    pub rank: u32,
    /// The most likely tokens and their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

/// What one step produced for one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineCoreOutput {
    pub request_id: String,
    pub new_token_ids: Vec<u32>,
    /// One entry per new token, when the request asked for logprobs.
    pub new_logprobs: Option<Vec<TokenLogprobs>>,
    pub finish_reason: Option<FinishReason>,
    /// The stop token id that finished the request, if one did.
    pub stop_reason: Option<u32>,
    /// Prompt tokens served from the prefix cache.
    pub num_cached_tokens: u32,
    /// Why the request failed, with `FinishReason::Error`.
    pub error: Option<String>,
}

impl EngineCoreOutput {
    pub fn failed(request_id: String, error: String) -> Self {
        Self {
            request_id,
            new_token_ids: Vec::new(),
            new_logprobs: None,
            finish_reason: Some(FinishReason::Error),
            stop_reason: None,
            num_cached_tokens: 0,
            error: Some(error),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SchedulerStats {
    pub num_running_reqs: u32,
    pub num_waiting_reqs: u32,
    /// Fraction of KV blocks in use, 0..=1.
    pub kv_cache_usage: f32,
    pub num_free_blocks: u32,
    pub num_total_blocks: u32,
    /// Cumulative counters since the engine started.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub num_preemptions: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineCoreOutputs {
    pub outputs: Vec<EngineCoreOutput>,
    pub scheduler_stats: Option<SchedulerStats>,
    /// Seconds since the Unix epoch when the engine produced these outputs.
    pub timestamp: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum EngineCoreEvent {
    Register(Register),
    Ready(EngineReady),
    /// Startup failed; the text says why. The engine-core exits after sending it.
    StartupFailed(String),
    Outputs(EngineCoreOutputs),
    Utility(UtilityResult),
    /// A process of the engine died or failed; every in-flight request has been failed.
    Dead(String),
}

wire_message!(EngineCoreEvent {
    Register(Register) = 0x11,
    Ready(EngineReady) = 0x12,
    StartupFailed(String) = 0x13,
    Outputs(EngineCoreOutputs) = 0x14,
    Utility(UtilityResult) = 0x15,
    Dead(String) = 0x16,
});

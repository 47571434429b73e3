//! The wire protocol between vllm-rs processes.
//!
//! Every socket carries frames of one shape: a message-type byte, then a msgpack payload
//! (see [`frame`]). The types here are the objects of DESIGN §3: what the frontend sends
//! the engine-core (`EngineCoreRequest`, aborts, utility calls), what the engine-core sends
//! back (`EngineCoreOutputs`), what it broadcasts to workers (`SchedulerOutput`) and what
//! rank 0 answers (`ModelRunnerOutput`), plus the startup handshake.
//!
//! This crate depends on nothing of ours and on no runtime, so every process can link it.

pub mod engine;
pub mod frame;
pub mod handshake;
pub mod sampling_params;
pub mod scheduler_output;

pub use engine::*;
pub use frame::{FrameError, WireMessage};
pub use handshake::*;
pub use sampling_params::*;
pub use scheduler_output::*;

/// Bumped whenever a wire type changes shape. Processes of different versions refuse each
/// other at the handshake instead of misreading each other's frames.
pub const PROTOCOL_VERSION: u32 = 3;

/// `--execute-model-timeout`'s default, in seconds (vLLM's
/// `VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`): the one value the flag and both processes' configs
/// fall back on.
pub const DEFAULT_EXECUTE_MODEL_TIMEOUT_S: f64 = 300.0;

/// For serde's `default =` on configs that carry the timeout.
pub fn default_execute_model_timeout_s() -> f64 {
    DEFAULT_EXECUTE_MODEL_TIMEOUT_S
}

//! Model definitions. There is one decoder, `llama::LlamaForCausalLM`; Qwen2 and Qwen3 are
//! small variations of it, each described by its own `DecoderVariant`.

pub mod llama;
pub mod qwen2;
pub mod qwen3;

pub use llama::{DecoderVariant, LlamaForCausalLM};

use crate::config::{Architecture, ModelConfig};

/// How `cfg`'s architecture differs from plain Llama.
pub fn variant_for(cfg: &ModelConfig) -> DecoderVariant {
    match cfg.architecture {
        Architecture::Llama => llama::variant(cfg),
        Architecture::Qwen2 => qwen2::variant(),
        Architecture::Qwen3 => qwen3::variant(cfg),
    }
}

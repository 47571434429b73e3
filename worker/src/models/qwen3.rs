//! Qwen3: the Llama decoder with a per-head RMSNorm on q and k before rotary
//! (`self_attn.q_norm`, `self_attn.k_norm`), and no qkv bias unless the config asks.

use super::DecoderVariant;
use crate::config::ModelConfig;

pub fn variant(cfg: &ModelConfig) -> DecoderVariant {
    DecoderVariant {
        qkv_bias: cfg.attention_bias,
        qk_norm: true,
    }
}

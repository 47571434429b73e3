//! Qwen2: the Llama decoder with a bias on the q, k and v projections.

use super::DecoderVariant;

pub fn variant() -> DecoderVariant {
    DecoderVariant {
        qkv_bias: true,
        qk_norm: false,
    }
}

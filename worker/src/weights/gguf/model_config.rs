//! `ModelConfig` from GGUF metadata (`{arch}.block_count`, `.embedding_length`, …) for the
//! llama, qwen2 and qwen3 architectures; the vocabulary from the tokenizer's token list,
//! tied embeddings from the absence of `output.weight`, eos and bos from `tokenizer.ggml.*`.

use super::GgufFile;
use crate::config::{Architecture, ConfigError, ModelConfig};

/// The GGUF architectures this worker runs.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama", "qwen2", "qwen3"];

impl ModelConfig {
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ConfigError> {
        let invalid = |msg: String| ConfigError::Gguf(format!("{}: {msg}", file.path().display()));
        let arch = file
            .architecture()
            .ok_or_else(|| invalid("no general.architecture".into()))?;
        let architecture = match arch {
            "llama" => Architecture::Llama,
            "qwen2" => Architecture::Qwen2,
            "qwen3" => Architecture::Qwen3,
            other => {
                return Err(invalid(format!(
                    "unsupported GGUF architecture `{other}` (supported: {})",
                    SUPPORTED_ARCHITECTURES.join(", ")
                )))
            }
        };
        let key = |k: &str| format!("{arch}.{k}");
        let usize_of = |k: &str| file.get_u64(&key(k)).map(|v| v as usize);
        let need = |k: &str| {
            usize_of(k).ok_or_else(|| invalid(format!("missing or invalid `{}`", key(k))))
        };

        let hidden_size = need("embedding_length")?;
        let num_attention_heads = need("attention.head_count")?;
        if hidden_size == 0 || num_attention_heads == 0 {
            return Err(invalid(
                "embedding_length and attention.head_count must be positive".into(),
            ));
        }
        let num_key_value_heads =
            usize_of("attention.head_count_kv").unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(invalid(format!(
                "attention.head_count {num_attention_heads} is not a multiple of attention.head_count_kv {num_key_value_heads}"
            )));
        }
        let head_dim =
            usize_of("attention.key_length").unwrap_or(hidden_size / num_attention_heads);
        let rope_freq_factors = rope_freq_factors(file, head_dim).map_err(invalid)?;
        if let Some(kind) = file
            .get_str(&key("rope.scaling.type"))
            .filter(|k| *k != "none")
        {
            return Err(invalid(format!(
                "unsupported rope scaling `{kind}` (supported: none)"
            )));
        }
        let vocab_size = file
            .metadata("tokenizer.ggml.tokens")
            .and_then(|v| v.as_array())
            .map(<[_]>::len)
            .or_else(|| usize_of("vocab_size"))
            .or_else(|| {
                file.tensor_info("token_embd.weight")
                    .and_then(|t| t.dims.get(1).map(|&d| d as usize))
            })
            .ok_or_else(|| invalid("no vocabulary size (tokenizer.ggml.tokens)".into()))?;
        let attention_bias = match architecture {
            Architecture::Qwen2 => true,
            _ => file.tensor_info("blk.0.attn_q.bias").is_some(),
        };
        let token = |k: &str| {
            file.get_u64(&format!("tokenizer.ggml.{k}"))
                .map(|v| v as u32)
        };
        let mut eos_token_ids: Vec<u32> = [token("eos_token_id"), token("eot_token_id")]
            .into_iter()
            .flatten()
            .collect();
        eos_token_ids.dedup();
        Ok(Self {
            architecture,
            hidden_size,
            intermediate_size: need("feed_forward_length")?,
            num_hidden_layers: need("block_count")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size,
            rms_norm_eps: file
                .get_f64(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-6),
            rope_theta: file.get_f64(&key("rope.freq_base")).unwrap_or(10000.0),
            rope_scaling: None,
            rope_freq_factors,
            max_position_embeddings: need("context_length")?,
            tie_word_embeddings: file.tensor_info("output.weight").is_none(),
            attention_bias,
            eos_token_ids,
            bos_token_id: token("bos_token_id"),
            // Quantized weights are dequantized to f32; bf16 is what a GPU computes in.
            dtype: "bfloat16".into(),
        })
    }
}

/// llama.cpp writes Llama 3 rope scaling as `rope_freqs.weight`: one divisor per rotary
/// frequency, 1 for short wavelengths, `factor` for long ones, smoothed between
/// (`1 / ((1 - smooth) / factor + smooth)`), so dividing the plain inverse frequencies by it
/// gives transformers' `_compute_llama3_parameters`.
fn rope_freq_factors(file: &GgufFile, head_dim: usize) -> Result<Option<Vec<f32>>, String> {
    if file.tensor_info("rope_freqs.weight").is_none() {
        return Ok(None);
    }
    let (shape, factors) = file
        .dequantize("rope_freqs.weight")
        .map_err(|e| format!("rope_freqs.weight: {e:#}"))?;
    if factors.len() != head_dim / 2 {
        return Err(format!(
            "rope_freqs.weight has shape {shape:?}, expected [{}] (head_dim / 2)",
            head_dim / 2
        ));
    }
    if let Some(bad) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
        return Err(format!(
            "rope_freqs.weight holds {bad}, not a positive divisor"
        ));
    }
    Ok(Some(factors))
}

//! `ModelConfig`: the facts of a Hugging Face `config.json` the model needs, parsed from
//! both forms found in the wild: the older one (top-level `rope_theta`, `rope_scaling`,
//! `torch_dtype`) and transformers 5's (`rope_parameters`, `dtype`, `layer_types`). A GGUF
//! model's config comes from its metadata instead (`weights::gguf`).

use std::path::{Path, PathBuf};

use serde_json::Value;
use vllm_kernels::cpu::Llama3RopeScaling;

use crate::model_path::ModelPath;
use crate::weights::gguf::GgufFile;

/// The architectures this worker runs: one Llama-family decoder with small variations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
}

impl Architecture {
    pub const SUPPORTED: &'static [&'static str] =
        &["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"];

    pub fn from_hf_name(name: &str) -> Option<Self> {
        match name {
            "LlamaForCausalLM" => Some(Self::Llama),
            "Qwen2ForCausalLM" => Some(Self::Qwen2),
            "Qwen3ForCausalLM" => Some(Self::Qwen3),
            _ => None,
        }
    }

    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
        }
    }
}

/// Where the weights come from (vLLM's `--load-format`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadFormat {
    /// The checkpoint's safetensors (the only format read so far).
    #[default]
    Auto,
    /// The checkpoint's safetensors.
    Safetensors,
    /// Random weights of the model's names and shapes; only config.json is read.
    Dummy,
}

impl LoadFormat {
    /// vLLM's name of the format.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Safetensors => "safetensors",
            Self::Dummy => "dummy",
        }
    }
}

/// The CUDA attention kernels (`--attention-backend`): the decode kernel plus the
/// tensor-core prefill ("flash", the default), or the first, CUDA-core kernel for every
/// token.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttentionBackend {
    CudaCore,
    #[default]
    Flash,
}

impl AttentionBackend {
    pub const NAMES: [&'static str; 2] = ["cuda-core", "flash"];

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "cuda-core" => Some(Self::CudaCore),
            "flash" => Some(Self::Flash),
            _ => None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("model directory {0} does not exist")]
    MissingDir(PathBuf),
    #[error("no config.json in model directory {0}")]
    MissingConfig(PathBuf),
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("unsupported architecture {found} (supported: {})", Architecture::SUPPORTED.join(", "))]
    UnsupportedArchitecture { found: String },
    #[error("config.json: missing or invalid field `{0}`")]
    MissingField(&'static str),
    #[error("config.json: {0}")]
    Invalid(String),
    /// A GGUF file that cannot be read, or whose metadata does not describe a model we run.
    #[error("{0}")]
    Gguf(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Per-frequency divisors of the rotary inverse frequencies: how a GGUF file carries
    /// Llama 3 scaling (its `rope_freqs.weight` tensor), in place of `rope_scaling`.
    pub rope_freq_factors: Option<Vec<f32>>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on the q, k and v projections (always for Qwen2, `attention_bias` otherwise).
    pub attention_bias: bool,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// The checkpoint's dtype name ("bfloat16", "float16", "float32").
    pub dtype: String,
}

fn field_usize(v: &Value, name: &'static str) -> Result<usize, ConfigError> {
    v.get(name)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .ok_or(ConfigError::MissingField(name))
}

fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_u64)
            .map(|x| x as u32)
            .collect(),
        _ => Vec::new(),
    }
}

/// `rope_theta` and Llama 3 scaling from either `rope_parameters` (transformers 5) or the
/// top-level `rope_theta` + `rope_scaling` (older).
fn parse_rope(v: &Value) -> Result<(f64, Option<Llama3RopeScaling>), ConfigError> {
    let params = v.get("rope_parameters").filter(|p| p.is_object());
    let scaling = params.or_else(|| v.get("rope_scaling").filter(|p| p.is_object()));
    let theta = params
        .and_then(|p| p.get("rope_theta"))
        .or_else(|| v.get("rope_theta"))
        .and_then(Value::as_f64)
        .unwrap_or(10000.0);
    let Some(s) = scaling else {
        return Ok((theta, None));
    };
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match kind {
        "default" => Ok((theta, None)),
        "llama3" => {
            let f = |name: &'static str| {
                s.get(name)
                    .and_then(Value::as_f64)
                    .ok_or(ConfigError::MissingField(name))
            };
            Ok((
                theta,
                Some(Llama3RopeScaling {
                    factor: f("factor")?,
                    low_freq_factor: f("low_freq_factor")?,
                    high_freq_factor: f("high_freq_factor")?,
                    original_max_position_embeddings: f("original_max_position_embeddings")?,
                }),
            ))
        }
        other => Err(ConfigError::Invalid(format!(
            "unsupported rope_type \"{other}\" (supported: default, llama3)"
        ))),
    }
}

impl ModelConfig {
    /// Reads `<dir>/config.json`, or the metadata of the GGUF file `dir` names
    /// (`ModelPath`).
    pub fn from_model_dir(dir: &Path) -> Result<Self, ConfigError> {
        if let Ok(ModelPath::Gguf(file)) = ModelPath::resolve(dir) {
            let gguf = GgufFile::open(&file).map_err(|e| ConfigError::Gguf(format!("{e:#}")))?;
            return Self::from_gguf(&gguf);
        }
        if !dir.is_dir() {
            return Err(ConfigError::MissingDir(dir.to_path_buf()));
        }
        let path = dir.join("config.json");
        if !path.is_file() {
            return Err(ConfigError::MissingConfig(dir.to_path_buf()));
        }
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Io {
            path: path.clone(),
            source,
        })?;
        let v: Value =
            serde_json::from_str(&text).map_err(|source| ConfigError::Json { path, source })?;
        Self::from_json(&v)
    }

    pub fn from_json(v: &Value) -> Result<Self, ConfigError> {
        let arch_name = v
            .get("architectures")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .ok_or(ConfigError::MissingField("architectures"))?;
        let architecture = Architecture::from_hf_name(arch_name).ok_or_else(|| {
            ConfigError::UnsupportedArchitecture {
                found: arch_name.to_string(),
            }
        })?;
        let hidden_size = field_usize(v, "hidden_size")?;
        let num_attention_heads = field_usize(v, "num_attention_heads")?;
        if num_attention_heads == 0 || hidden_size == 0 {
            return Err(ConfigError::Invalid(
                "hidden_size and num_attention_heads must be positive".into(),
            ));
        }
        let num_key_value_heads = v
            .get("num_key_value_heads")
            .and_then(Value::as_u64)
            .map(|x| x as usize)
            .unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(ConfigError::Invalid(format!(
                "num_attention_heads {num_attention_heads} is not a multiple of num_key_value_heads {num_key_value_heads}"
            )));
        }
        let head_dim = v
            .get("head_dim")
            .and_then(Value::as_u64)
            .map(|x| x as usize)
            .unwrap_or(hidden_size / num_attention_heads);
        let (rope_theta, rope_scaling) = parse_rope(v)?;
        let dtype = v
            .get("dtype")
            .or_else(|| v.get("torch_dtype"))
            .and_then(Value::as_str)
            .unwrap_or("bfloat16")
            .to_string();
        let attention_bias = match architecture {
            Architecture::Qwen2 => true,
            _ => v
                .get("attention_bias")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        };
        Ok(Self {
            architecture,
            hidden_size,
            intermediate_size: field_usize(v, "intermediate_size")?,
            num_hidden_layers: field_usize(v, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size: field_usize(v, "vocab_size")?,
            rms_norm_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            rope_freq_factors: None,
            max_position_embeddings: field_usize(v, "max_position_embeddings")?,
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            attention_bias,
            eos_token_ids: token_ids(v.get("eos_token_id")),
            bos_token_id: token_ids(v.get("bos_token_id")).first().copied(),
            dtype,
        })
    }

    /// Qwen3 normalizes each q and k head before rotary.
    pub fn qk_norm(&self) -> bool {
        self.architecture == Architecture::Qwen3
    }
}

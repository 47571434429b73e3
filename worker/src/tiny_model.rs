//! `write_tiny_model`: a random, seeded Hugging Face model folder for tests and benchmarks:
//! config.json, model.safetensors (HF names), generation_config.json, and a small byte-level
//! BPE tokenizer (tokenizer.json, tokenizer_config.json with a ChatML template).
//!
//! Weights are scaled so activations stay O(1) through every layer while the logits spread
//! widely (std ≈ 3 over the vocabulary), so greedy decoding is well defined.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{ensure, Context, Result};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};

use crate::config::Architecture;

/// The dtype weights are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TinyDtype {
    BF16,
    F16,
    F32,
}

impl TinyDtype {
    fn hf_name(self) -> &'static str {
        match self {
            Self::BF16 => "bfloat16",
            Self::F16 => "float16",
            Self::F32 => "float32",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct TinyModelSpec {
    pub architecture: Architecture,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub seed: u64,
    pub dtype: TinyDtype,
}

impl TinyModelSpec {
    /// The small test model: hidden 64, 2 layers, 4 heads / 2 kv heads, head_dim 16,
    /// intermediate 128, vocab 512, context 32768 (long runs for abort tests), tied.
    pub fn tiny(architecture: Architecture) -> Self {
        Self {
            architecture,
            hidden: 64,
            intermediate: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            vocab: 512,
            max_position_embeddings: 32768,
            tie_word_embeddings: true,
            seed: 0,
            dtype: TinyDtype::BF16,
        }
    }

    /// `tiny(Qwen3)`.
    pub fn qwen3_tiny() -> Self {
        Self::tiny(Architecture::Qwen3)
    }

    #[allow(clippy::too_many_arguments)]
    fn real(
        architecture: Architecture,
        hidden: usize,
        intermediate: usize,
        layers: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        vocab: usize,
        max_pos: usize,
        tied: bool,
    ) -> Self {
        Self {
            architecture,
            hidden,
            intermediate,
            layers,
            heads,
            kv_heads,
            head_dim,
            vocab,
            max_position_embeddings: max_pos,
            tie_word_embeddings: tied,
            seed: 0,
            dtype: TinyDtype::BF16,
        }
    }

    /// Shapes of Qwen3-0.6B (random weights).
    pub fn qwen3_0_6b() -> Self {
        Self::real(
            Architecture::Qwen3,
            1024,
            3072,
            28,
            16,
            8,
            128,
            151936,
            40960,
            true,
        )
    }
    pub fn qwen3_1_7b() -> Self {
        Self::real(
            Architecture::Qwen3,
            2048,
            6144,
            28,
            16,
            8,
            128,
            151936,
            40960,
            true,
        )
    }
    pub fn qwen3_4b() -> Self {
        Self::real(
            Architecture::Qwen3,
            2560,
            9728,
            36,
            32,
            8,
            128,
            151936,
            40960,
            true,
        )
    }
    pub fn qwen3_8b() -> Self {
        Self::real(
            Architecture::Qwen3,
            4096,
            12288,
            36,
            32,
            8,
            128,
            151936,
            40960,
            false,
        )
    }
    pub fn qwen3_32b() -> Self {
        Self::real(
            Architecture::Qwen3,
            5120,
            25600,
            64,
            64,
            8,
            128,
            151936,
            40960,
            false,
        )
    }
    /// Shapes of Qwen2.5-0.5B-Instruct.
    pub fn qwen2_5_0_5b() -> Self {
        Self::real(
            Architecture::Qwen2,
            896,
            4864,
            24,
            14,
            2,
            64,
            151936,
            32768,
            true,
        )
    }
    /// Shapes of Llama-3.2-1B-Instruct.
    pub fn llama_3_2_1b() -> Self {
        Self::real(
            Architecture::Llama,
            2048,
            8192,
            16,
            32,
            8,
            64,
            128256,
            131072,
            true,
        )
    }
    pub fn llama_3_1_8b() -> Self {
        Self::real(
            Architecture::Llama,
            4096,
            14336,
            32,
            32,
            8,
            128,
            128256,
            131072,
            false,
        )
    }

    /// A preset by name: "tiny-qwen3", "tiny-qwen2", "tiny-llama", "qwen3-0.6b", ….
    pub fn preset(name: &str) -> Option<Self> {
        Some(match name {
            "tiny" | "tiny-qwen3" => Self::tiny(Architecture::Qwen3),
            "tiny-qwen2" => Self::tiny(Architecture::Qwen2),
            "tiny-llama" => Self::tiny(Architecture::Llama),
            "qwen3-0.6b" => Self::qwen3_0_6b(),
            "qwen3-1.7b" => Self::qwen3_1_7b(),
            "qwen3-4b" => Self::qwen3_4b(),
            "qwen3-8b" => Self::qwen3_8b(),
            "qwen3-32b" => Self::qwen3_32b(),
            "qwen2.5-0.5b" => Self::qwen2_5_0_5b(),
            "llama-3.2-1b" => Self::llama_3_2_1b(),
            "llama-3.1-8b" => Self::llama_3_1_8b(),
            _ => return None,
        })
    }
}

/// splitmix64 + Box–Muller: a seeded normal generator without global state.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f32 {
        let (u1, u2) = (self.uniform(), self.uniform());
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
    fn tensor(&mut self, n: usize, mean: f32, std: f32) -> Vec<f32> {
        (0..n).map(|_| mean + std * self.normal()).collect()
    }
}

fn encode(data: &[f32], dtype: TinyDtype) -> Vec<u8> {
    match dtype {
        TinyDtype::F32 => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        TinyDtype::BF16 => data
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        TinyDtype::F16 => data
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
    }
}

/// Every tensor of the model, HF names, f32.
fn random_tensors(spec: &TinyModelSpec) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut rng = Rng(spec.seed ^ 0x7E57_AB1E);
    let (h, i, d) = (spec.hidden, spec.intermediate, spec.head_dim);
    let (q, kv) = (spec.heads * d, spec.kv_heads * d);
    // Final-normed hidden rows have rms ≈ 1, so a head of std 3/sqrt(h) gives logits of std ≈ 3.
    let head_std = 3.0 / (h as f32).sqrt();
    let mut out = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, mean: f32, std: f32, rng: &mut Rng| {
        let n = shape.iter().product();
        out.push((name, shape, rng.tensor(n, mean, std)));
    };
    add(
        "model.embed_tokens.weight".into(),
        vec![spec.vocab, h],
        0.0,
        head_std,
        &mut rng,
    );
    for l in 0..spec.layers {
        let p = format!("model.layers.{l}");
        let lin = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
        add(
            format!("{p}.input_layernorm.weight"),
            vec![h],
            1.0,
            0.1,
            &mut rng,
        );
        add(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            1.0,
            0.1,
            &mut rng,
        );
        add(
            format!("{p}.self_attn.q_proj.weight"),
            vec![q, h],
            0.0,
            lin(h),
            &mut rng,
        );
        add(
            format!("{p}.self_attn.k_proj.weight"),
            vec![kv, h],
            0.0,
            lin(h),
            &mut rng,
        );
        add(
            format!("{p}.self_attn.v_proj.weight"),
            vec![kv, h],
            0.0,
            lin(h),
            &mut rng,
        );
        add(
            format!("{p}.self_attn.o_proj.weight"),
            vec![h, q],
            0.0,
            lin(q),
            &mut rng,
        );
        if spec.architecture == Architecture::Qwen2 {
            add(
                format!("{p}.self_attn.q_proj.bias"),
                vec![q],
                0.0,
                0.1,
                &mut rng,
            );
            add(
                format!("{p}.self_attn.k_proj.bias"),
                vec![kv],
                0.0,
                0.1,
                &mut rng,
            );
            add(
                format!("{p}.self_attn.v_proj.bias"),
                vec![kv],
                0.0,
                0.1,
                &mut rng,
            );
        }
        if spec.architecture == Architecture::Qwen3 {
            add(
                format!("{p}.self_attn.q_norm.weight"),
                vec![d],
                1.0,
                0.1,
                &mut rng,
            );
            add(
                format!("{p}.self_attn.k_norm.weight"),
                vec![d],
                1.0,
                0.1,
                &mut rng,
            );
        }
        add(
            format!("{p}.mlp.gate_proj.weight"),
            vec![i, h],
            0.0,
            lin(h),
            &mut rng,
        );
        add(
            format!("{p}.mlp.up_proj.weight"),
            vec![i, h],
            0.0,
            lin(h),
            &mut rng,
        );
        add(
            format!("{p}.mlp.down_proj.weight"),
            vec![h, i],
            0.0,
            lin(i),
            &mut rng,
        );
    }
    add("model.norm.weight".into(), vec![h], 1.0, 0.1, &mut rng);
    if !spec.tie_word_embeddings {
        add(
            "lm_head.weight".into(),
            vec![spec.vocab, h],
            0.0,
            head_std,
            &mut rng,
        );
    }
    out
}

/// Writes `tensors` as one safetensors file in `dtype`.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    dtype: TinyDtype,
) -> Result<()> {
    let st_dtype = match dtype {
        TinyDtype::BF16 => Dtype::BF16,
        TinyDtype::F16 => Dtype::F16,
        TinyDtype::F32 => Dtype::F32,
    };
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, d)| (n.clone(), s.clone(), encode(d, dtype)))
        .collect();
    let views = bytes
        .iter()
        .map(|(n, s, b)| Ok((n.clone(), TensorView::new(st_dtype, s.clone(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    safetensors::serialize_to_file(views, None, path)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// GPT-2's byte → printable-char map used by byte-level BPE.
fn bytes_to_unicode() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut extra = 0;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap_or('?')
            }
        })
        .collect()
}

pub const ENDOFTEXT: &str = "<|endoftext|>";
pub const IM_START: &str = "<|im_start|>";
pub const IM_END: &str = "<|im_end|>";
const MERGES: &[(&str, &str)] = &[
    ("Ġ", "t"),
    ("h", "e"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
    ("Ġt", "he"),
];

/// Token ids of the special tokens: (endoftext, im_start, im_end).
pub fn special_token_ids() -> (u32, u32, u32) {
    let base = (256 + MERGES.len()) as u32;
    (base, base + 1, base + 2)
}

fn tokenizer_json(vocab_size: usize) -> Result<Value> {
    let chars = bytes_to_unicode();
    let mut vocab: serde_json::Map<String, Value> = serde_json::Map::new();
    for (id, c) in chars.iter().enumerate() {
        vocab.insert(c.to_string(), json!(id));
    }
    for (a, b) in MERGES {
        let id = vocab.len();
        vocab.insert(format!("{a}{b}"), json!(id));
    }
    let base = vocab.len();
    let min = base + 3;
    ensure!(
        vocab_size >= min,
        "vocab size {vocab_size} is below the tokenizer's {min} tokens"
    );
    let added = |id: usize, content: String, special: bool| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": special})
    };
    let mut added_tokens = vec![
        added(base, ENDOFTEXT.into(), true),
        added(base + 1, IM_START.into(), true),
        added(base + 2, IM_END.into(), true),
    ];
    // Pad so every id the model can emit decodes.
    added_tokens
        .extend((min..vocab_size).map(|id| added(id, format!("<|extra_{}|>", id - min), false)));
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true});
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab,
            "merges": MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>(),
        }
    }))
}

const CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

fn config_json(spec: &TinyModelSpec) -> Value {
    let (eot, _, im_end) = special_token_ids();
    let mut c = json!({
        "architectures": [spec.architecture.hf_name()],
        "model_type": match spec.architecture {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
        },
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": spec.dtype.hf_name(),
        "bos_token_id": eot,
        "eos_token_id": im_end,
        "attention_bias": false,
        "rope_theta": 1000000.0,
    });
    if spec.architecture == Architecture::Llama {
        c["rope_theta"] = json!(500000.0);
        c["rope_scaling"] = json!({
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": (spec.max_position_embeddings / 8).max(1),
        });
    }
    c
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v)?;
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Writes a complete random model folder for `spec` into `dir` (created if missing).
pub fn write_tiny_model(dir: &Path, spec: &TinyModelSpec) -> Result<()> {
    ensure!(
        spec.kv_heads > 0 && spec.heads.is_multiple_of(spec.kv_heads),
        "heads must be a multiple of kv_heads"
    );
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let (eot, _, im_end) = special_token_ids();
    write_json(&dir.join("tokenizer.json"), &tokenizer_json(spec.vocab)?)?;
    write_json(&dir.join("config.json"), &config_json(spec))?;
    write_json(
        &dir.join("generation_config.json"),
        &json!({"bos_token_id": eot, "eos_token_id": [im_end, eot], "do_sample": false}),
    )?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": CHAT_TEMPLATE,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "bos_token": null,
            "model_max_length": spec.max_position_embeddings,
            "added_tokens_decoder": HashMap::from([
                (eot.to_string(), json!({"content": ENDOFTEXT, "special": true})),
                ((eot + 1).to_string(), json!({"content": IM_START, "special": true})),
                (im_end.to_string(), json!({"content": IM_END, "special": true})),
            ]),
        }),
    )?;
    write_safetensors(
        &dir.join("model.safetensors"),
        &random_tensors(spec),
        spec.dtype,
    )?;
    tracing::debug!(dir = %dir.display(), "wrote tiny model");
    Ok(())
}

/// The tensors `write_tiny_model` would write for `spec` (tests that build custom files,
/// e.g. sharded checkpoints).
pub fn tiny_model_tensors(spec: &TinyModelSpec) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    random_tensors(spec)
}
